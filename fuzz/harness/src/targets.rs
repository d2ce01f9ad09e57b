use crate::json_gen::{self, Node, Style};
use crate::{keyring, route_leaves};
use arbitrary::Unstructured;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use idem_core::canonical::{self, canonical_params, parse_json_body, BodyError, BoundField, CanonError};
use idem_core::fingerprint::{self as fp, Claims, Expect, Key, Keyring, VerifyError, MAX_FINGERPRINT_LEN};
use idem_core::policy::{self, LeafValue, Role, RouteDefaults, ROUTE_KEYS};
use idem_core::protocol::{self, AcquireResponse, StoredResult};
use idem_core::reply::{self, ReplyContext, ReplyKind};
use serde::de::{DeserializeOwned, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;
use std::collections::BTreeSet;
use std::fmt;
use std::sync::OnceLock;

const BODY_LIMIT: usize = 1 << 20;

// ---- fingerprint -----------------------------------------------------------

/// `verify` on the bytes as a token, then a mint→verify round trip of claims
/// built from the same bytes.
pub fn fingerprint(data: &[u8]) {
    verify_any(&String::from_utf8_lossy(data));
    let _ = mint_round_trip(&mut Unstructured::new(data));
}

fn ring(active: &str) -> &'static Keyring {
    static K1: OnceLock<Keyring> = OnceLock::new();
    static K0: OnceLock<Keyring> = OnceLock::new();
    match active {
        "k0" => K0.get_or_init(|| keyring("k0")),
        _ => K1.get_or_init(|| keyring("k1")),
    }
}

/// The payload fields exactly as minted, read by the harness itself.
#[derive(Deserialize)]
struct Payload {
    k: String,
    n: String,
    exp: u64,
    u: String,
    s: String,
    p: String,
}

/// Anything that gets past the signature check must be, byte for byte, a token
/// this keyring mints: no second spelling of a token verifies.
fn verify_any(token: &str) {
    let blind = Expect { subject_hash: "", scope: "", param_hash: None };
    let got = fp::verify(ring("k1"), token, &blind);
    assert_eq!(token.len() > MAX_FINGERPRINT_LEN, got == Err(VerifyError::TooLong), "{token:?}: {got:?}");
    match got {
        Err(VerifyError::TooLong | VerifyError::Malformed | VerifyError::UnknownKid | VerifyError::BadSignature) => {
            return
        }
        // The signature matched; an empty subject hash can never match a minted one.
        Err(VerifyError::SubjectMismatch { .. }) => {}
        other => panic!("verify with an empty subject hash returned {other:?} for {token:?}"),
    }
    let payload = token
        .split_once('.')
        .and_then(|(p, _)| URL_SAFE_NO_PAD.decode(p).ok())
        .and_then(|json| serde_json::from_slice::<Payload>(&json).ok());
    let Some(payload) = payload else { panic!("verify accepted a token whose payload does not decode: {token:?}") };
    let nonce: Option<[u8; 16]> = hex::decode(&payload.n).ok().and_then(|b| b.try_into().ok());
    let Some(nonce) = nonce else { panic!("verify accepted nonce {:?} in {token:?}", payload.n) };
    let remint = fp::mint(ring(&payload.k), nonce, payload.exp, &payload.u, &payload.s, &payload.p);
    assert_eq!(remint, token, "verify accepted a token the keyring would not mint");
    let exact = Expect { subject_hash: &payload.u, scope: &payload.s, param_hash: Some(&payload.p) };
    let claims = fp::verify(ring("k1"), token, &exact);
    let wrong_p = if payload.p.starts_with('0') { "1" } else { "0" }.repeat(64);
    let wrong = Expect { param_hash: Some(&wrong_p), ..exact };
    assert_param_mismatch(fp::verify(ring("k1"), token, &wrong), &payload.n);
    assert_claims(claims, &payload);
}

/// The claims are exactly the payload's (compared as text, so the check does
/// not depend on the types core gives each claim).
fn assert_claims(got: Result<Claims, VerifyError>, want: &Payload) {
    let claims = match got {
        Ok(c) => c,
        Err(e) => panic!("a minted token does not verify with its own claims: {e:?}"),
    };
    assert_eq!(claims.v, 1);
    assert_eq!(claims.kid, want.k);
    assert_eq!(claims.nonce.to_string(), want.n);
    assert_eq!(claims.exp, want.exp);
    assert_eq!(claims.subject_hash, want.u);
    assert_eq!(claims.scope, want.s);
    assert_eq!(claims.param_hash, want.p);
}

/// An authentic token for other bound fields reports its genuine nonce.
fn assert_param_mismatch(got: Result<Claims, VerifyError>, nonce_hex: &str) {
    match got {
        Err(VerifyError::ParamMismatch { nonce }) => assert_eq!(nonce.to_string(), nonce_hex),
        other => panic!("expected a param mismatch for nonce {nonce_hex}, got {other:?}"),
    }
}

fn hash_of_text(text: &str) -> String {
    match canonical::param_hash(&Value::String(text.to_string()), &[BoundField::new("", false)]) {
        Ok(h) => h,
        Err(e) => panic!("a string always has a param hash: {e}"),
    }
}

fn mint_round_trip(u: &mut Unstructured) -> arbitrary::Result<()> {
    let active = if u.arbitrary()? { "k1" } else { "k0" };
    let nonce: [u8; 16] = u.arbitrary()?;
    let exp: u64 = u.int_in_range(1..=u64::MAX)?;
    let back: u64 = u.int_in_range(1..=exp)?;
    let scope: String = u.arbitrary()?;
    let subject: String = u.arbitrary()?;
    let params: String = u.arbitrary()?;
    let p = hash_of_text(&params);
    let sh = fp::subject_hash(&subject);
    let token = fp::mint(ring(active), nonce, exp, &sh, &scope, &p);
    let verifier = ring("k1");
    let expect = Expect { subject_hash: &sh, scope: &scope, param_hash: Some(&p) };
    if token.len() > MAX_FINGERPRINT_LEN {
        assert_eq!(fp::verify(verifier, &token, &expect), Err(VerifyError::TooLong));
        return Ok(());
    }
    let want = Payload { k: active.into(), n: hex::encode(nonce), exp, u: sh.clone(), s: scope.clone(), p: p.clone() };
    let claims = fp::verify(verifier, &token, &expect);
    if let Ok(c) = &claims {
        // Expired exactly at `exp`, valid one second before.
        assert!(!c.expired(exp - back) && c.expired(exp) && c.expired(exp.saturating_add(back)));
    }
    assert_claims(claims, &want);
    let other_subject = fp::subject_hash(&format!("{subject}'"));
    let wrong = Expect { subject_hash: &other_subject, ..expect };
    assert!(matches!(fp::verify(verifier, &token, &wrong), Err(VerifyError::SubjectMismatch { .. })));
    let other_scope = format!("{scope}'");
    let wrong = Expect { scope: &other_scope, ..expect };
    assert_eq!(fp::verify(verifier, &token, &wrong), Err(VerifyError::ScopeMismatch));
    let other_p = hash_of_text(&format!("{params}'"));
    let wrong = Expect { param_hash: Some(&other_p), ..expect };
    assert_param_mismatch(fp::verify(verifier, &token, &wrong), &want.n);

    let other_kid = if active == "k1" { "k0" } else { "k1" };
    let retired = Keyring::new(vec![Key { kid: other_kid.into(), secret: vec![7; 32] }], other_kid);
    let same_kid = Keyring::new(vec![Key { kid: active.into(), secret: vec![7; 32] }], active);
    if let (Ok(retired), Ok(same_kid)) = (retired, same_kid) {
        assert_eq!(fp::verify(&retired, &token, &expect), Err(VerifyError::UnknownKid));
        assert_eq!(fp::verify(&same_kid, &token, &expect), Err(VerifyError::BadSignature));
    }

    // Any one-byte change is rejected.
    let at = u.choose_index(token.len())?;
    let byte: u8 = u.arbitrary()?;
    let mut forged = token.clone().into_bytes();
    if let Some(b) = forged.get_mut(at) {
        if *b != byte {
            *b = byte;
            let forged = String::from_utf8_lossy(&forged);
            let got = fp::verify(verifier, &forged, &expect);
            assert!(got.is_err(), "one-byte change at {at} to {byte:#04x} still verifies: {forged:?}");
        }
    }
    Ok(())
}

// ---- strict JSON -------------------------------------------------------------

/// The body parser on arbitrary bytes, checked against serde_json (which keeps
/// the last of duplicate keys) and an independent duplicate-key finder; then on
/// generated documents, with and without an injected duplicate key.
pub fn strict_json(data: &[u8]) {
    strict_on_bytes(data);
    let _ = strict_on_generated(&mut Unstructured::new(data));
}

const NUMBER_TOKEN: &str = "$serde_json::private::Number";

/// What the duplicate-key finder saw: whether any object repeats a key.
#[derive(Default)]
struct Shape {
    duplicate: bool,
}

impl<'de> Deserialize<'de> for Shape {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Shape, D::Error> {
        d.deserialize_any(ShapeVisitor)
    }
}

struct ShapeVisitor;

impl<'de> Visitor<'de> for ShapeVisitor {
    type Value = Shape;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JSON")
    }
    fn visit_bool<E>(self, _: bool) -> Result<Shape, E> {
        Ok(Shape::default())
    }
    fn visit_i64<E>(self, _: i64) -> Result<Shape, E> {
        Ok(Shape::default())
    }
    fn visit_u64<E>(self, _: u64) -> Result<Shape, E> {
        Ok(Shape::default())
    }
    fn visit_f64<E>(self, _: f64) -> Result<Shape, E> {
        Ok(Shape::default())
    }
    fn visit_str<E>(self, _: &str) -> Result<Shape, E> {
        Ok(Shape::default())
    }
    fn visit_unit<E>(self) -> Result<Shape, E> {
        Ok(Shape::default())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Shape, A::Error> {
        let mut shape = Shape::default();
        while let Some(item) = seq.next_element::<Shape>()? {
            shape.duplicate |= item.duplicate;
        }
        Ok(shape)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Shape, A::Error> {
        let mut shape = Shape::default();
        let mut keys = BTreeSet::new();
        while let Some(key) = map.next_key::<String>()? {
            let value = map.next_value::<Shape>()?;
            shape.duplicate |= value.duplicate || !keys.insert(key);
        }
        Ok(shape)
    }
}

fn strict_on_bytes(data: &[u8]) {
    let strict = parse_json_body(data, BODY_LIMIT);
    let lenient: Result<Value, _> = serde_json::from_slice(data);
    let shape: Result<Shape, _> = serde_json::from_slice(data);
    if let Ok(shape) = &shape {
        if shape.duplicate {
            assert!(
                matches!(&strict, Err(BodyError::Invalid(m)) if m.contains("duplicate key")),
                "a body with a duplicate key was not rejected as such: {strict:?}"
            );
        }
    }
    match &strict {
        Ok(value) => {
            assert!(value.is_object());
            assert!(matches!(&shape, Ok(s) if !s.duplicate));
            assert_eq!(lenient.as_ref().ok(), Some(value), "strict and serde_json read different values");
            // What the filter writes back (e.g. a preview answer) parses to the same value
            // (fuzz/regressions/strict_json/reserved-key-not-first was the exception).
            let text = serde_json::to_vec(value).unwrap_or_default();
            assert_eq!(parse_json_body(&text, BODY_LIMIT).as_ref(), Ok(value), "{}", String::from_utf8_lossy(&text));
        }
        Err(BodyError::TooLarge { .. }) => panic!("{} bytes are under the limit", data.len()),
        Err(BodyError::NotAnObject) => assert!(lenient.is_ok_and(|v| !v.is_object())),
        Err(BodyError::Invalid(message)) => {
            // serde_json also fails, or the strict parser named one of the two
            // things it refuses beyond serde_json: a duplicate or the reserved key.
            let object = matches!(&lenient, Ok(v) if v.is_object());
            assert!(
                !object || message.contains("duplicate key") || message.contains(NUMBER_TOKEN),
                "rejected a body serde_json reads as an object: {message}"
            );
        }
    }
    // The size limit is checked before parsing, exactly at the limit.
    assert!(!matches!(parse_json_body(data, data.len()), Err(BodyError::TooLarge { .. })));
    if let Some(limit) = data.len().checked_sub(1) {
        assert_eq!(parse_json_body(data, limit), Err(BodyError::TooLarge { limit }));
    }
}

fn strict_on_generated(u: &mut Unstructured) -> arbitrary::Result<()> {
    let node = json_gen::node(u, 0)?;
    let mut style =
        Style { seed: u.arbitrary()?, whitespace: u.arbitrary()?, escape_all: u.arbitrary()?, ..Style::plain() };
    let text = json_gen::render(&node, &mut style);
    let parsed = parse_json_body(text.as_bytes(), BODY_LIMIT);
    match &node {
        Node::Obj(_) => {
            let lenient: Result<Value, _> = serde_json::from_str(&text);
            assert_eq!(parsed.as_ref().ok(), lenient.as_ref().ok(), "{text}");
            assert!(parsed.is_ok(), "valid JSON without duplicates rejected: {text}: {parsed:?}");
        }
        _ => assert_eq!(parsed, Err(BodyError::NotAnObject), "{text}"),
    }
    let objects = json_gen::non_empty_objects(&node);
    if objects > 0 {
        let target = u.choose_index(objects)?;
        style.duplicate_in = Some(target);
        let text = json_gen::render(&node, &mut style);
        let got = parse_json_body(text.as_bytes(), BODY_LIMIT);
        assert!(
            matches!(&got, Err(BodyError::Invalid(m)) if m.contains("duplicate key")),
            "duplicate key in object #{target} not rejected: {text}: {got:?}"
        );
    }
    Ok(())
}

// ---- param hash --------------------------------------------------------------

/// The canonical form on arbitrary bodies (re-serialising must not change the
/// hash; canonicalising the canonical text is a fixed point), then on generated
/// bodies spelled two ways (member order, whitespace, escapes, number spellings
/// such as 1 / 1.0 / 1.00 / 100e-2, decimals as strings).
pub fn param_hash(data: &[u8]) {
    hash_on_bytes(data);
    let _ = hash_on_generated(&mut Unstructured::new(data));
}

/// The canonical text of one value on its own (no bound-field wrapper).
fn canonical_value(value: &Value) -> Result<String, CanonError> {
    let wrapped = serde_json::json!({ "v": value });
    let text = canonical_params(&wrapped, &[BoundField::new("/v", false)])?;
    Ok(text.strip_prefix("{\"/v\":").and_then(|t| t.strip_suffix('}')).unwrap_or("").to_string())
}

/// Canonicalising canonical text again changes nothing.
fn assert_fixed_point(value: &Value) {
    let Ok(first) = canonical_value(value) else { return };
    if first.is_empty() {
        return; // a null value has no member to canonicalise
    }
    let wrapped = format!("{{\"v\":{first}}}");
    let reparsed = match parse_json_body(wrapped.as_bytes(), BODY_LIMIT) {
        Ok(v) => v,
        Err(e) => panic!("canonical text is not strict JSON: {e}: {first}"),
    };
    let second = reparsed.get("v").map(canonical_value);
    // fuzz/regressions/param_hash/canonical-number-longer-than-input-bound was the exception.
    assert_eq!(second, Some(Ok(first.clone())), "canonical form is not a fixed point: {first}");
}

fn top_level_fields(body: &Value) -> Vec<BoundField> {
    body.as_object()
        .map(|m| m.keys().map(|k| BoundField::new(&format!("/{}", json_gen::pointer_token(k)), false)).collect())
        .unwrap_or_default()
}

fn hash_on_bytes(data: &[u8]) {
    let Ok(body) = parse_json_body(data, BODY_LIMIT) else { return };
    let fields = top_level_fields(&body);
    let hash = canonical::param_hash(&body, &fields);
    for text in [serde_json::to_string(&body), serde_json::to_string_pretty(&body)] {
        let Ok(text) = text else { panic!("a parsed body serialises") };
        let again = match parse_json_body(text.as_bytes(), BODY_LIMIT) {
            Ok(v) => v,
            Err(e) => panic!("re-serialised body does not parse: {e}: {text}"),
        };
        let mut reversed = fields.clone();
        reversed.reverse();
        assert_eq!(canonical::param_hash(&again, &reversed), hash, "{text}");
    }
    if let Ok(text) = canonical_params(&body, &fields) {
        match parse_json_body(text.as_bytes(), BODY_LIMIT) {
            Ok(c) => {
                let keys: Vec<&String> = c.as_object().map(|m| m.keys().collect()).unwrap_or_default();
                for key in keys {
                    assert!(fields.iter().any(|f| f.pointer == *key), "canonical text names {key:?}, not a field");
                }
            }
            Err(e) => panic!("canonical text is not strict JSON: {e}: {text}"),
        }
    }
    assert_fixed_point(&body);
}

fn hash_on_generated(u: &mut Unstructured) -> arbitrary::Result<()> {
    let node = json_gen::object(u)?;
    let mut all = Vec::new();
    json_gen::pointers(&node, &mut String::new(), &mut all);
    let mut fields: Vec<BoundField> = Vec::new();
    for pointer in &all {
        if !pointer.is_empty() && u.ratio(1, 3)? {
            fields.push(BoundField::new(pointer, u.ratio(1, 3)?));
        }
    }
    if u.ratio(1, 8)? {
        fields.push(BoundField::new("/absent", u.arbitrary()?));
    }
    // A decimal field's number may arrive as a string, unless another bound
    // field covers it too (then its text is part of that field's value).
    let covered =
        |p: &str, by: &BoundField| !by.decimal && (p == by.pointer || p.starts_with(&format!("{}/", by.pointer)));
    let mut stringify = Vec::new();
    for f in fields.iter().filter(|f| f.decimal) {
        if !fields.iter().any(|g| covered(&f.pointer, g)) && u.arbitrary()? {
            stringify.push(f.pointer.clone());
        }
    }

    let plain = json_gen::render(&node, &mut Style::plain());
    let mut style = Style {
        seed: u.arbitrary()?,
        whitespace: u.arbitrary()?,
        escape_all: u.arbitrary()?,
        stringify,
        duplicate_in: None,
    };
    let respelled = json_gen::render(&node, &mut style);
    let parse = |text: &str| match parse_json_body(text.as_bytes(), BODY_LIMIT) {
        Ok(v) => v,
        Err(e) => panic!("generated body rejected: {e}: {text}"),
    };
    let (a, b) = (parse(&plain), parse(&respelled));
    let ha = canonical::param_hash(&a, &fields);
    let hb = canonical::param_hash(&b, &fields);
    assert_eq!(ha, hb, "one value, two spellings, two hashes:\n{plain}\n{respelled}\nfields {fields:?}");
    // Field order does not matter either (when there is an error, which one is
    // reported first may).
    let mut reordered = fields.clone();
    reordered.reverse();
    let hr = canonical::param_hash(&b, &reordered);
    assert_eq!(hr.as_ref().ok(), ha.as_ref().ok(), "field order changed the hash: {fields:?}");
    assert_eq!(hr.is_ok(), ha.is_ok());
    if let Ok(text) = canonical_params(&a, &fields) {
        assert!(parse_json_body(text.as_bytes(), BODY_LIMIT).is_ok(), "canonical text is not strict JSON: {text}");
    }
    assert_fixed_point(&a);
    // The whole documents, too, unless a decimal was respelled as a string.
    if style.stringify.is_empty() {
        assert_eq!(canonical_value(&a), canonical_value(&b), "{plain}\n{respelled}");
    }
    Ok(())
}

// ---- plugin configuration ----------------------------------------------------

fn fuzz_env(name: &str) -> Option<String> {
    match name {
        "IDEM_HMAC_K1" => Some("a-secret-from-the-environment-0123456789".into()),
        "IDEM_SIDECAR_TOKEN" => Some("sidecar-token-0123456789abcdef".into()),
        "IDEM_SHORT" => Some("short".into()),
        "IDEM_EMPTY" => Some(String::new()),
        _ => None,
    }
}

/// `parse_plugin_config` never panics; it either refuses with a message that
/// starts with the field at fault, or accepts a configuration whose every value
/// is in range and whose keyring mints tokens it verifies.
pub fn plugin_config(data: &[u8]) {
    match policy::parse_plugin_config(data, &fuzz_env) {
        Err(e) => {
            // `configuration: …` for the document as a whole; otherwise the
            // message starts with the path of a field the input has, or of a
            // required one it lacks (`keys[1].secret: …`, `subject.header: …`).
            let message = e.to_string();
            let head = message.split([':', '.', '[']).next().unwrap_or("");
            let present: Vec<String> = serde_json::from_slice::<Value>(data)
                .ok()
                .and_then(|v| v.as_object().map(|m| m.keys().cloned().collect()))
                .unwrap_or_default();
            let required = message == format!("{head}: required")
                && !head.is_empty()
                && head.bytes().all(|b| b.is_ascii_lowercase() || b == b'_');
            assert!(
                head == "configuration"
                    || present.iter().any(|k| k == head)
                    || required
                    || message.contains(": unknown field (expected one of: "),
                "error does not name a field: {message:?}"
            );
        }
        Ok(c) => {
            assert!(
                parse_json_body(data, BODY_LIMIT).is_ok(),
                "accepted a configuration that is not a strict JSON object"
            );
            assert!(!c.sidecar_cluster.is_empty() && !c.sidecar_authority.is_empty());
            assert!(policy::SIDECAR_TIMEOUT_MS.contains(&c.sidecar_timeout_ms));
            for n in [c.max_body_bytes, c.max_response_bytes] {
                assert!(policy::BODY_BYTES.contains(&(n as u64)), "{n}");
            }
            assert_defaults_in_range(&c.defaults);
            match &c.subject {
                policy::SubjectSource::Header(h) => {
                    assert!(!h.is_empty() && !h.bytes().any(|b| b.is_ascii_uppercase() || b == b':'), "{h:?}")
                }
                policy::SubjectSource::Property(p) => {
                    assert!(!p.is_empty() && p.len() <= 16 && p.iter().all(|s| !s.is_empty()))
                }
            }
            assert!(fp::kid_problem(c.keyring.active_kid()).is_none());
            let p = hash_of_text("");
            let sh = fp::subject_hash("s");
            let token = fp::mint(&c.keyring, [1; 16], 10, &sh, "scope", &p);
            let expect = Expect { subject_hash: &sh, scope: "scope", param_hash: Some(&p) };
            assert!(
                fp::verify(&c.keyring, &token, &expect).is_ok_and(|cl| cl.kid == c.keyring.active_kid()),
                "the configured keyring does not verify its own token"
            );
        }
    }
}

fn assert_defaults_in_range(d: &RouteDefaults) {
    assert!(policy::FINGERPRINT_TTL_S.contains(&d.fingerprint_ttl_s), "{d:?}");
    assert!(policy::LEASE_MS.contains(&d.lease_ms), "{d:?}");
    assert!(policy::POLL_AFTER_MS.contains(&d.poll_after_ms), "{d:?}");
    assert!(policy::RETRY_AFTER_MS.contains(&d.retry_after_ms), "{d:?}");
}

// ---- route annotations -------------------------------------------------------

/// `parse_route_policy` over the leaves in the bytes ([`crate::route_leaves`]):
/// no `role` means not ours; an error names the annotation key; an accepted
/// policy is in range and is re-read identically from its own normal form.
pub fn route_policy(data: &[u8]) {
    let leaves = route_leaves(data);
    let defaults = RouteDefaults::default();
    let get = |key: &str| leaves.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone());
    let got = policy::parse_route_policy(&get, &defaults);
    let has_role = get("role").is_some();
    match got {
        Err(e) => {
            assert!(has_role, "no role, yet an error: {e}");
            let head = e.0.split(':').next().unwrap_or("");
            assert!(ROUTE_KEYS.contains(&head), "error does not name an annotation key: {:?}", e.0);
        }
        Ok(None) => assert!(!has_role),
        Ok(Some(p)) => {
            assert!(has_role);
            assert!(!p.scope.is_empty() && p.scope.len() <= 128, "{:?}", p.scope);
            assert!(p.scope.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.:-".contains(&b)), "{:?}", p.scope);
            // Only a status route, or a client-key route (its key names the operation; with nothing bound
            // the method and path are hashed), may bind nothing.
            assert!(matches!(p.role, Role::Status | Role::Idempotent) || !p.bound.is_empty(), "{:?}", p.role);
            assert!(p.bound.len() <= 64);
            for (i, f) in p.bound.iter().enumerate() {
                assert!(f.pointer.starts_with('/') && f.pointer.len() <= 256 && !f.pointer.contains(':'), "{f:?}");
                assert!(!p.bound.iter().skip(i + 1).any(|g| g.pointer == f.pointer), "{f:?} twice");
            }
            assert_defaults_in_range(&RouteDefaults {
                fingerprint_ttl_s: p.fingerprint_ttl_s,
                lease_ms: p.lease_ms,
                poll_after_ms: p.poll_after_ms,
                retry_after_ms: 1,
            });
            for (i, (status, _)) in p.outcomes.iter().enumerate() {
                assert!((300..=599).contains(status), "{status}");
                assert!(!p.outcomes.iter().skip(i + 1).any(|(s, _)| s == status), "{status} twice");
            }
            if let Some(r) = &p.result_ref {
                assert!(r.starts_with('/') && r.len() <= 256);
            }

            // The normal form: every value written out again is read back the same.
            let bind: Vec<String> = p
                .bound
                .iter()
                .map(|f| format!("{}{}", f.pointer, f.ty.suffix().map(|t| format!(":{t}")).unwrap_or_default()))
                .collect();
            let outcomes: Vec<String> = p.outcomes.iter().map(|(s, o)| format!("{s}:{}", o.as_str())).collect();
            assert_eq!(policy::parse_bind(&bind.join(", ")).as_ref(), Ok(&p.bound));
            assert_eq!(idem_core::outcome::parse_overrides(&outcomes.join(" ")).as_ref(), Ok(&p.outcomes));
            // Annotation keys this target does not normalise (ones added to core
            // later, say) are passed through as they were.
            const NORMALISED: &[&str] = &[
                "role",
                "scope",
                "bind",
                "fingerprint_ttl_s",
                "lease_ms",
                "poll_after_ms",
                "status_tool",
                "result_ref",
                "outcomes",
            ];
            let mut normal: Vec<(String, LeafValue)> =
                leaves.iter().filter(|(k, _)| !NORMALISED.contains(&k.as_str())).cloned().collect();
            normal.extend([
                ("role".into(), LeafValue::Str(p.role.as_str().into())),
                ("scope".into(), LeafValue::Str(p.scope.clone())),
                ("fingerprint_ttl_s".into(), LeafValue::Num(p.fingerprint_ttl_s as f64)),
                ("lease_ms".into(), LeafValue::Str(p.lease_ms.to_string())),
                ("poll_after_ms".into(), LeafValue::Num(p.poll_after_ms as f64)),
            ]);
            if !bind.is_empty() {
                normal.push(("bind".into(), LeafValue::Str(bind.join(" "))));
            }
            if !outcomes.is_empty() {
                normal.push(("outcomes".into(), LeafValue::Str(outcomes.join(","))));
            }
            if let Some(t) = &p.status_tool {
                normal.push(("status_tool".into(), LeafValue::Str(t.clone())));
            }
            if let Some(r) = &p.result_ref {
                normal.push(("result_ref".into(), LeafValue::Str(r.clone())));
            }
            let get = |key: &str| normal.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone());
            let again = policy::parse_route_policy(&get, &defaults);
            assert_eq!(again.as_ref(), Ok(&Some(p)), "re-reading the normal form changed the policy");
        }
    }
}

// ---- sidecar wire types ------------------------------------------------------

/// Every wire type either refuses the bytes or reads a value that survives
/// serialise → deserialise unchanged; base64 bodies have one spelling; the
/// replay built from an answer is valid JSON.
pub fn protocol(data: &[u8]) {
    use protocol::{AckResponse, AcquireRequest, CompleteRequest, OperationView, ReleaseRequest};
    round_trip::<AcquireRequest>(data);
    round_trip::<CompleteRequest>(data);
    round_trip::<ReleaseRequest>(data);
    round_trip::<AckResponse>(data);
    if let Some(r) = round_trip::<StoredResult>(data) {
        check_result(&r);
    }
    if let Some(a) = round_trip::<AcquireResponse>(data) {
        if let Some(r) = &a.result {
            check_result(r);
        }
    }
    if let Some(v) = round_trip::<OperationView>(data) {
        if let Some(r) = &v.result {
            check_result(r);
        }
    }

    let text = String::from_utf8_lossy(data);
    if let Some(bytes) = protocol::decode_body(&text) {
        assert_eq!(protocol::encode_body(&bytes), text, "a second base64 spelling decodes");
    }
    assert_eq!(protocol::decode_body(&protocol::encode_body(data)).as_deref(), Some(data));
    for pointer in ["", "/transfer_id", "/0", "/a~1b"] {
        if let Some(s) = reply::result_ref(data, pointer) {
            let value: Option<Value> = serde_json::from_slice(data).ok();
            assert!(value.as_ref().and_then(|v| v.pointer(pointer)).is_some(), "result_ref {s:?} out of nothing");
        }
    }
}

fn round_trip<T: Serialize + DeserializeOwned + PartialEq + fmt::Debug>(data: &[u8]) -> Option<T> {
    let value: T = serde_json::from_slice(data).ok()?;
    let text = match serde_json::to_vec(&value) {
        Ok(t) => t,
        Err(e) => panic!("{} does not serialise: {e}: {value:?}", std::any::type_name::<T>()),
    };
    let again: Result<T, _> = serde_json::from_slice(&text);
    assert_eq!(again.as_ref().ok(), Some(&value), "{}: {}", std::any::type_name::<T>(), String::from_utf8_lossy(&text));
    Some(value)
}

fn check_result(r: &StoredResult) {
    if let Some(body) = protocol::decode_body(&r.body_b64) {
        assert_eq!(protocol::encode_body(&body), r.body_b64);
    }
    let kept = protocol::replay_headers(&r.headers);
    assert_eq!(protocol::replay_headers(&kept), kept, "replay_headers is not idempotent");
    for (k, v) in &kept {
        assert!(r.headers.iter().any(|(k2, v2)| k2.eq_ignore_ascii_case(k) && v2 == v));
        assert!(!k.bytes().any(|b| b.is_ascii_uppercase()));
    }
    for kind in [ReplyKind::AlreadyCompleted, ReplyKind::AlreadyFailed] {
        for status_query in [false, true] {
            let ctx = ReplyContext { trace_id: "t", result: Some(r), status_query, ..ReplyContext::default() };
            let out = reply::render(kind, policy::Language::En, &ctx);
            assert!((200..=599).contains(&out.http_status), "{}", out.http_status);
            let body = parse_json_body(&out.body, BODY_LIMIT);
            assert!(body.is_ok(), "the replay envelope is not strict JSON: {body:?}");
        }
    }
}

// ---- splice ----------------------------------------------------------------

/// The preview's splice of the fingerprint into the upstream's answer (`machine::splice`), streamed
/// and held. The first byte chooses where the answer is cut into chunks (and whether its last chunk
/// says end of stream); the rest is the answer. Whatever the bytes: the streamed answer is exactly
/// the length its headers announced. For a JSON object without duplicate keys: the answer keeps
/// every member, gains ours only when it named neither field, and never has two of either.
pub fn splice(data: &[u8]) {
    use idem_core::machine::splice::{names_field, splice_whole, Chunk, StreamSplice};
    // Strict: a duplicate key is an error, so "never two of either field" is checked by the parse.
    let strict = |b: &[u8]| parse_json_body(b, BODY_LIMIT);
    const TOKEN: &str = "k1.eyJ2IjoxfQ.c2ln_-9";
    const EXP: u64 = 1_753_500_000;
    let Some((&pick, body)) = data.split_first() else { return };
    if body.is_empty() {
        return;
    }
    let n = body.len();
    let pick = usize::from(pick);
    let mut bounds = vec![(pick * 7) % (n + 1), (pick * 31 + 3) % (n + 1), (pick >> 3) % (n + 1)];
    bounds.sort_unstable();
    bounds.push(n);
    let mut s = StreamSplice::new(TOKEN, EXP, n as u64);
    let (mut out, mut at, mut spliced) = (Vec::new(), 0, None);
    for end in bounds {
        let piece = &body[at..end.max(at)];
        at = end.max(at);
        match s.chunk(piece, at == n && pick & 1 == 1) {
            Chunk::Pass => out.extend_from_slice(piece),
            Chunk::Replace(bytes) => out.extend_from_slice(&bytes),
            Chunk::Last { body, spliced: done } => {
                out.extend_from_slice(&body);
                spliced = Some(done);
                break;
            }
        }
    }
    let Some(spliced) = spliced else { panic!("the chunk that completes the length is the last") };
    assert_eq!(out.len(), n + s.added(), "the announced length");
    // The upstream's own top-level fields, as any decoder reads them (any case, escaped, `ſ`).
    let theirs = |v: &serde_json::Map<String, Value>| v.keys().filter(|k| names_field(k)).count();
    let Ok(Value::Object(input)) = strict(body) else {
        // Not one JSON object: whatever went out, the upstream's value never stands as a field.
        if let Ok(Value::Object(o)) = serde_json::from_slice::<Value>(&out) {
            let foreign = o.iter().any(|(k, v)| names_field(k) && v.as_str() != Some(TOKEN) && v.as_u64() != Some(EXP));
            assert!(!foreign, "an upstream's fingerprint field went out");
        }
        return;
    };
    // The gateway's fields in place of the upstream's: what the agent gets when the answer is rewritten.
    let mut want = input.clone();
    want.retain(|k, _| !names_field(k));
    want.insert("fingerprint".into(), TOKEN.into());
    want.insert("fingerprint_expires_at".into(), EXP.into());
    if theirs(&input) > 0 {
        // The upstream writes the fingerprint: rewritten to ours, or refused (no JSON at all).
        match serde_json::from_slice::<Value>(&out) {
            Ok(Value::Object(o)) => assert_eq!(o, want, "rewritten: ours in place of the upstream's"),
            Ok(other) => panic!("a self-named object streamed out as {other:?}"),
            Err(_) => assert!(s.refused() && !spliced, "no JSON out, yet not refused"),
        }
    } else {
        let output = match strict(&out) {
            Ok(Value::Object(o)) => o,
            other => panic!("a JSON object streamed out as {other:?} (spliced {spliced})"),
        };
        if spliced {
            assert_eq!(output, want, "every member kept, ours added");
        } else {
            assert_eq!(output, input, "padded: the same JSON");
            let text = String::from_utf8_lossy(body).to_lowercase();
            assert!(
                text.contains("\"fingerprint")
                    || text.contains("\\u00")
                    || text.contains("\\u017")
                    || text.contains('ſ'),
                "not spliced without a reason"
            );
        }
    }
    // Held whole: the upstream's fields dropped, ours in, never doubled (strict_json refuses duplicates).
    let held = splice_whole(body, TOKEN, EXP, BODY_LIMIT).unwrap_or_else(|| panic!("a held object is spliced"));
    match strict(&held) {
        Ok(Value::Object(o)) => assert_eq!(o, want, "held: ours in place of the upstream's"),
        other => panic!("a held object spliced into {other:?}"),
    }
}
