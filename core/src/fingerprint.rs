//! Minting and verifying fingerprints (DESIGN §3).
//!
//! Minting is a pure HMAC with no I/O, because most previews are never
//! confirmed. Verification trusts nothing in the token until its HMAC matches,
//! and checks in a fixed order so each rejection means one precise thing.

use crate::json_text::push_json_string;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use hmac::{Hmac, Mac};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::fmt;

pub const MAX_FINGERPRINT_LEN: usize = 1024;
pub const MIN_SECRET_LEN: usize = 32;
pub const MAX_KID_LEN: usize = 32;

type HmacSha256 = Hmac<Sha256>;

#[derive(Clone)]
pub struct Key {
    pub kid: String,
    pub secret: Vec<u8>,
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Key").field("kid", &self.kid).field("secret", &"<redacted>").finish()
    }
}

/// Every configured key verifies; only the active one mints, so a key can be
/// rotated in before it signs and kept after it stops signing.
#[derive(Clone)]
pub struct Keyring {
    /// Keyed once at load: each use clones the prepared state instead of
    /// re-deriving the inner/outer pads.
    entries: Vec<(String, HmacSha256)>,
    active: usize,
}

impl fmt::Debug for Keyring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kids: Vec<&str> = self.entries.iter().map(|(kid, _)| kid.as_str()).collect();
        f.debug_struct("Keyring").field("kids", &kids).field("active_kid", &self.active_kid()).finish()
    }
}

/// Why a kid is unacceptable, or `None`. Kids travel inside the token and in
/// logs, so they stay short and plain.
pub fn kid_problem(kid: &str) -> Option<String> {
    if kid.is_empty() {
        return Some("empty".into());
    }
    if kid.len() > MAX_KID_LEN {
        return Some(format!("longer than {MAX_KID_LEN} characters"));
    }
    if !kid.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-')) {
        return Some("may only contain A-Z a-z 0-9 _ . -".into());
    }
    None
}

impl Keyring {
    /// Errors name the offending entry as `keys[i].kid`, `keys[i].secret` or `active_kid`.
    pub fn new(keys: Vec<Key>, active_kid: &str) -> Result<Keyring, String> {
        if keys.is_empty() {
            return Err("keys: at least one key is required".into());
        }
        let mut entries: Vec<(String, HmacSha256)> = Vec::with_capacity(keys.len());
        for (i, key) in keys.into_iter().enumerate() {
            if let Some(problem) = kid_problem(&key.kid) {
                return Err(format!("keys[{i}].kid: {problem}"));
            }
            if entries.iter().any(|(kid, _)| *kid == key.kid) {
                return Err(format!("keys[{i}].kid: duplicate kid {:?}", key.kid));
            }
            if key.secret.len() < MIN_SECRET_LEN {
                return Err(format!("keys[{i}].secret: shorter than {MIN_SECRET_LEN} bytes"));
            }
            let mac = HmacSha256::new_from_slice(&key.secret)
                .map_err(|_| format!("keys[{i}].secret: unusable as an HMAC key"))?;
            entries.push((key.kid, mac));
        }
        let active = entries
            .iter()
            .position(|(kid, _)| kid == active_kid)
            .ok_or_else(|| format!("active_kid: {active_kid:?} is not one of the configured keys"))?;
        Ok(Keyring { entries, active })
    }

    pub fn active_kid(&self) -> &str {
        self.entries.get(self.active).map(|(kid, _)| kid.as_str()).unwrap_or("")
    }

    fn active_mac(&self) -> Option<HmacSha256> {
        self.entries.get(self.active).map(|(_, mac)| mac.clone())
    }

    fn mac(&self, kid: &str) -> Option<HmacSha256> {
        self.entries.iter().find(|(k, _)| k == kid).map(|(_, mac)| mac.clone())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claims {
    pub v: u8,
    pub kid: String,
    pub nonce: crate::protocol::OpKey,
    pub exp: u64,
    pub subject_hash: String,
    pub scope: String,
    pub param_hash: String,
}

impl Claims {
    /// Exactly at `exp` it is expired; one second before it is valid.
    pub fn expired(&self, now_s: u64) -> bool {
        now_s >= self.exp
    }
}

/// Hex of the first 16 bytes of SHA-256(subject): binds the caller's identity
/// without putting it into the model's context.
pub fn subject_hash(subject: &str) -> String {
    let digest = Sha256::digest(subject.as_bytes());
    hex::encode(digest.get(..16).unwrap_or_default())
}

pub fn nonce_hex(bytes: [u8; 16]) -> String {
    hex::encode(bytes)
}

pub fn mint(keyring: &Keyring, nonce: [u8; 16], exp: u64, subject_hash: &str, scope: &str, param_hash: &str) -> String {
    let kid = keyring.active_kid();
    let mut json = String::with_capacity(160 + scope.len());
    json.push_str("{\"v\":1,\"k\":");
    push_json_string(&mut json, kid);
    json.push_str(",\"n\":");
    push_json_string(&mut json, &nonce_hex(nonce));
    json.push_str(",\"exp\":");
    json.push_str(&exp.to_string());
    json.push_str(",\"u\":");
    push_json_string(&mut json, subject_hash);
    json.push_str(",\"s\":");
    push_json_string(&mut json, scope);
    json.push_str(",\"p\":");
    push_json_string(&mut json, param_hash);
    json.push('}');

    let payload = URL_SAFE_NO_PAD.encode(json.as_bytes());
    let mut out = payload.clone();
    out.push('.');
    if let Some(mut mac) = keyring.active_mac() {
        mac.update(payload.as_bytes());
        out.push_str(&URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes()));
    }
    out
}

/// What the confirm (or status) request must match.
///
/// Expiry is not part of it: an expired fingerprint is still *authentic*, and
/// the caller decides what expiry means (DESIGN §3: it only refuses to start an
/// operation; one that exists is answered as before). See [`Claims::expired`].
#[derive(Debug, Clone, Copy)]
pub struct Expect<'a> {
    pub subject_hash: &'a str,
    pub scope: &'a str,
    /// `None` where the request carries no bound fields to compare (status).
    pub param_hash: Option<&'a str>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VerifyError {
    TooLong,
    Malformed,
    UnknownKid,
    BadSignature,
    /// Authentic, but issued to another subject; the nonce is genuine, for the audit.
    SubjectMismatch {
        nonce: String,
    },
    ScopeMismatch,
    /// Authentic, but issued for other bound fields; the nonce is genuine, for the security log.
    ParamMismatch {
        nonce: String,
    },
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VerifyError::TooLong => write!(f, "fingerprint longer than {MAX_FINGERPRINT_LEN} bytes"),
            VerifyError::Malformed => f.write_str("fingerprint is malformed"),
            VerifyError::UnknownKid => f.write_str("fingerprint signed with an unknown key id"),
            VerifyError::BadSignature => f.write_str("fingerprint signature does not match"),
            VerifyError::SubjectMismatch { .. } => f.write_str("fingerprint was issued to another subject"),
            VerifyError::ScopeMismatch => f.write_str("fingerprint was issued for another scope"),
            VerifyError::ParamMismatch { .. } => f.write_str("bound parameters differ from the preview"),
        }
    }
}

impl std::error::Error for VerifyError {}

/// The payload exactly as minted; anything else (extra, missing or duplicate
/// keys, wrong types) is malformed.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Payload {
    v: u8,
    k: String,
    n: String,
    exp: u64,
    u: String,
    s: String,
    p: String,
}

pub fn verify(keyring: &Keyring, fingerprint: &str, expect: &Expect) -> Result<Claims, VerifyError> {
    if fingerprint.len() > MAX_FINGERPRINT_LEN {
        return Err(VerifyError::TooLong);
    }
    let (payload_b64, sig_b64) = fingerprint.split_once('.').ok_or(VerifyError::Malformed)?;
    if payload_b64.is_empty() || sig_b64.is_empty() || sig_b64.contains('.') {
        return Err(VerifyError::Malformed);
    }
    // The engine rejects padding and non-canonical trailing bits, so each
    // token has exactly one spelling.
    let payload_json = URL_SAFE_NO_PAD.decode(payload_b64).map_err(|_| VerifyError::Malformed)?;
    let signature = URL_SAFE_NO_PAD.decode(sig_b64).map_err(|_| VerifyError::Malformed)?;
    if signature.len() != 32 {
        return Err(VerifyError::Malformed);
    }
    let payload: Payload = serde_json::from_slice(&payload_json).map_err(|_| VerifyError::Malformed)?;
    if payload.v != 1
        || kid_problem(&payload.k).is_some()
        || !is_lower_hex(&payload.n, 32)
        || !is_lower_hex(&payload.u, 32)
        || !is_lower_hex(&payload.p, 64)
    {
        return Err(VerifyError::Malformed);
    }

    let mut mac = keyring.mac(&payload.k).ok_or(VerifyError::UnknownKid)?;
    mac.update(payload_b64.as_bytes());
    mac.verify_slice(&signature).map_err(|_| VerifyError::BadSignature)?;

    if payload.u != expect.subject_hash {
        return Err(VerifyError::SubjectMismatch { nonce: payload.n });
    }
    if payload.s != expect.scope {
        return Err(VerifyError::ScopeMismatch);
    }
    if let Some(p) = expect.param_hash {
        if payload.p != p {
            return Err(VerifyError::ParamMismatch { nonce: payload.n });
        }
    }
    Ok(Claims {
        v: payload.v,
        kid: payload.k,
        nonce: crate::protocol::OpKey::parse(&payload.n).map_err(|_| VerifyError::Malformed)?,
        exp: payload.exp,
        subject_hash: payload.u,
        scope: payload.s,
        param_hash: payload.p,
    })
}

fn is_lower_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: &str = "6b86b273ff34fce19d6b804eff5a3f5747ada4eaa22f1d49c01e52ddb7875b4b";
    const NONCE: [u8; 16] = [7; 16];

    fn ring() -> Result<Keyring, String> {
        Keyring::new(
            vec![Key { kid: "k1".into(), secret: vec![1; 32] }, Key { kid: "k0".into(), secret: vec![2; 48] }],
            "k1",
        )
    }

    fn expect<'a>(_now: u64, u: &'a str) -> Expect<'a> {
        Expect { subject_hash: u, scope: "payments.transfer", param_hash: Some(P) }
    }

    fn token(ring: &Keyring, u: &str) -> String {
        mint(ring, NONCE, 1000, u, "payments.transfer", P)
    }

    /// Re-encode the payload with one claim changed, keeping the signature.
    fn tamper(fp: &str, key: &str, value: serde_json::Value) -> Result<String, Box<dyn std::error::Error>> {
        let (payload, sig) = fp.split_once('.').ok_or("no dot")?;
        let mut json: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&URL_SAFE_NO_PAD.decode(payload)?)?;
        json.insert(key.into(), value);
        Ok(format!("{}.{}", URL_SAFE_NO_PAD.encode(serde_json::to_vec(&json)?), sig))
    }

    #[test]
    fn round_trip() -> Result<(), Box<dyn std::error::Error>> {
        let ring = ring()?;
        let u = subject_hash("alice");
        let fp = token(&ring, &u);
        let claims = verify(&ring, &fp, &expect(999, &u))?;
        assert_eq!(
            claims,
            Claims {
                v: 1,
                kid: "k1".into(),
                nonce: crate::protocol::OpKey::parse(&"07".repeat(16))?,
                exp: 1000,
                subject_hash: u.clone(),
                scope: "payments.transfer".into(),
                param_hash: P.into()
            }
        );
        Ok(())
    }

    #[test]
    fn payload_has_the_documented_shape() -> Result<(), Box<dyn std::error::Error>> {
        let ring = ring()?;
        let fp = mint(&ring, [0xab; 16], 42, &"0".repeat(32), "s", P);
        let (payload, _) = fp.split_once('.').ok_or("no dot")?;
        let text = String::from_utf8(URL_SAFE_NO_PAD.decode(payload)?)?;
        let want = format!(
            r#"{{"v":1,"k":"k1","n":"{}","exp":42,"u":"{}","s":"s","p":"{P}"}}"#,
            "ab".repeat(16),
            "0".repeat(32)
        );
        assert_eq!(text, want);
        Ok(())
    }

    #[test]
    fn expiry_boundary_is_exact() -> Result<(), Box<dyn std::error::Error>> {
        let ring = ring()?;
        let u = subject_hash("alice");
        let fp = token(&ring, &u);
        // Expiry never makes an authentic token unverifiable: the caller decides what it means.
        let claims = verify(&ring, &fp, &expect(5000, &u))?;
        assert!(!claims.expired(999));
        assert!(claims.expired(1000));
        assert!(claims.expired(1001));
        Ok(())
    }

    #[test]
    fn rotation_keeps_old_tokens_valid() -> Result<(), Box<dyn std::error::Error>> {
        let old = Keyring::new(vec![Key { kid: "k0".into(), secret: vec![2; 48] }], "k0")?;
        let u = subject_hash("alice");
        let fp = token(&old, &u);
        let rotated = ring()?;
        assert_eq!(rotated.active_kid(), "k1");
        assert_eq!(verify(&rotated, &fp, &expect(1, &u))?.kid, "k0");
        let retired = Keyring::new(vec![Key { kid: "k1".into(), secret: vec![1; 32] }], "k1")?;
        assert_eq!(verify(&retired, &fp, &expect(1, &u)), Err(VerifyError::UnknownKid));
        Ok(())
    }

    #[test]
    fn same_kid_other_secret_is_a_bad_signature() -> Result<(), Box<dyn std::error::Error>> {
        let u = subject_hash("alice");
        let fp = token(&ring()?, &u);
        let other = Keyring::new(vec![Key { kid: "k1".into(), secret: vec![9; 32] }], "k1")?;
        assert_eq!(verify(&other, &fp, &expect(1, &u)), Err(VerifyError::BadSignature));
        Ok(())
    }

    #[test]
    fn tampering_any_claim_breaks_the_signature() -> Result<(), Box<dyn std::error::Error>> {
        let ring = ring()?;
        let u = subject_hash("alice");
        let fp = token(&ring, &u);
        let changes = [
            ("exp", serde_json::json!(99_999)),
            ("n", serde_json::json!("08".repeat(16))),
            ("u", serde_json::json!(subject_hash("mallory"))),
            ("s", serde_json::json!("payments.refund")),
            ("p", serde_json::json!("0".repeat(64))),
            ("k", serde_json::json!("k0")),
        ];
        for (key, value) in changes {
            let forged = tamper(&fp, key, value)?;
            assert_eq!(verify(&ring, &forged, &expect(1, &u)), Err(VerifyError::BadSignature), "{key}");
        }
        let reordered = tamper(&fp, "v", serde_json::json!(1))?;
        assert_eq!(verify(&ring, &reordered, &expect(1, &u)), Err(VerifyError::BadSignature));
        Ok(())
    }

    #[test]
    fn verification_order() -> Result<(), Box<dyn std::error::Error>> {
        let ring = ring()?;
        let alice = subject_hash("alice");
        let bob = subject_hash("bob");
        let fp = token(&ring, &alice);
        // Every check fails at once; each step is removed in turn to expose the next.
        let mut wrong = Expect { subject_hash: &bob, scope: "other", param_hash: Some("x") };
        let long = "a".repeat(MAX_FINGERPRINT_LEN + 1);
        assert_eq!(verify(&ring, &long, &wrong), Err(VerifyError::TooLong));
        assert_eq!(verify(&ring, "not-a-token", &wrong), Err(VerifyError::Malformed));
        let unknown = tamper(&fp, "k", serde_json::json!("k9"))?;
        assert_eq!(verify(&ring, &unknown, &wrong), Err(VerifyError::UnknownKid));
        let forged = tamper(&fp, "exp", serde_json::json!(1))?;
        assert_eq!(verify(&ring, &forged, &wrong), Err(VerifyError::BadSignature));
        assert!(matches!(verify(&ring, &fp, &wrong), Err(VerifyError::SubjectMismatch { .. })));
        wrong.subject_hash = &alice;
        assert_eq!(verify(&ring, &fp, &wrong), Err(VerifyError::ScopeMismatch));
        wrong.scope = "payments.transfer";
        assert_eq!(verify(&ring, &fp, &wrong), Err(VerifyError::ParamMismatch { nonce: "07".repeat(16) }));
        wrong.param_hash = None;
        assert!(verify(&ring, &fp, &wrong).is_ok());
        Ok(())
    }

    #[test]
    fn syntax_is_strict() -> Result<(), Box<dyn std::error::Error>> {
        let ring = ring()?;
        let u = subject_hash("alice");
        let fp = token(&ring, &u);
        let (payload, sig) = fp.split_once('.').ok_or("no dot")?;
        let bad = [
            String::new(),
            ".".into(),
            payload.to_string(),
            format!("{payload}."),
            format!(".{sig}"),
            format!("{fp}.{sig}"),
            format!("{payload}.{sig}="),
            format!("{payload}=.{sig}"),
            format!("{payload}.{}", &sig[..sig.len() - 2]),
            format!("{payload}.{}", "+".repeat(43)),
            format!(" {fp}"),
            format!("{fp}\n"),
        ];
        for candidate in bad {
            let got = verify(&ring, &candidate, &expect(1, &u));
            assert!(matches!(got, Err(VerifyError::Malformed | VerifyError::BadSignature)), "{candidate:?}: {got:?}");
            assert!(got.is_err());
        }
        for (key, value) in [
            ("v", serde_json::json!(2)),
            ("n", serde_json::json!("07".repeat(15))),
            ("n", serde_json::json!("0A".repeat(16))),
            ("u", serde_json::json!(1)),
            ("p", serde_json::json!("x".repeat(64))),
            ("exp", serde_json::json!(-1)),
            ("exp", serde_json::json!(1.5)),
            ("extra", serde_json::json!(true)),
            ("k", serde_json::json!("")),
        ] {
            let forged = tamper(&fp, key, value)?;
            assert_eq!(verify(&ring, &forged, &expect(1, &u)), Err(VerifyError::Malformed), "{key}");
        }
        Ok(())
    }

    #[test]
    fn keyring_rejects_bad_keys() {
        let key = |kid: &str, len: usize| Key { kid: kid.into(), secret: vec![0; len] };
        let cases: [(Vec<Key>, &str, &str); 6] = [
            (vec![], "k", "keys:"),
            (vec![key("k1", 32), key("k1", 32)], "k1", "keys[1].kid: duplicate"),
            (vec![key("", 32)], "", "keys[0].kid: empty"),
            (vec![key(&"k".repeat(33), 32)], "k", "keys[0].kid: longer"),
            (vec![key("k1", 32), key("k/2", 32)], "k1", "keys[1].kid: may only"),
            (vec![key("k1", 31)], "k1", "keys[0].secret: shorter than 32 bytes"),
        ];
        for (keys, active, want) in cases {
            let got = Keyring::new(keys, active);
            assert!(matches!(&got, Err(e) if e.starts_with(want)), "{want}: {got:?}");
        }
        let got = Keyring::new(vec![key("k1", 32)], "k2");
        assert!(matches!(&got, Err(e) if e.starts_with("active_kid:")));
    }

    #[test]
    fn debug_never_prints_secrets() -> Result<(), String> {
        let key = Key { kid: "k1".into(), secret: b"super-secret-value-that-is-long-enough".to_vec() };
        assert!(!format!("{key:?}").contains("super"));
        let ring = Keyring::new(vec![key], "k1")?;
        let text = format!("{ring:?}");
        assert!(text.contains("k1") && !text.contains("super") && !text.contains("115"));
        Ok(())
    }

    #[test]
    fn helpers() {
        assert_eq!(nonce_hex([0xab; 16]), "ab".repeat(16));
        let u = subject_hash("alice");
        assert_eq!(u.len(), 32);
        assert_eq!(u, "2bd806c97f0e00af1a1fc3328fa763a9");
    }
}
