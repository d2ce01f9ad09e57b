//! Properties the fingerprint scheme relies on, checked over generated inputs.

use idem_core::canonical::{canonical_params, normalize_decimal, param_hash, parse_json_body, BoundField};
use idem_core::fingerprint::{mint, subject_hash, verify, Expect, Key, Keyring, VerifyError};
use proptest::prelude::*;
use serde_json::Value;

fn body(text: &str) -> Result<Value, TestCaseError> {
    parse_json_body(text.as_bytes(), 1 << 20).map_err(|e| TestCaseError::fail(format!("{e}: {text}")))
}

fn hash(value: &Value, fields: &[BoundField]) -> Result<String, TestCaseError> {
    param_hash(value, fields).map_err(|e| TestCaseError::fail(e.to_string()))
}

fn keyring() -> Result<Keyring, TestCaseError> {
    Keyring::new(
        vec![Key { kid: "k1".into(), secret: vec![0x5a; 32] }, Key { kid: "k0".into(), secret: vec![0xa5; 40] }],
        "k1",
    )
    .map_err(TestCaseError::fail)
}

/// The spellings of `digits × 10^-scale` an agent might produce.
fn spellings(digits: &str, scale: usize, negative: bool) -> Vec<String> {
    let sign = if negative { "-" } else { "" };
    let padded = format!("{digits:0>width$}", width = scale + 1);
    let (whole, fraction) = padded.split_at(padded.len() - scale);
    let plain = if fraction.is_empty() { whole.to_string() } else { format!("{whole}.{fraction}") };
    let with_zeros = if fraction.is_empty() { format!("{whole}.000") } else { format!("{whole}.{fraction}00") };
    let (lead, rest) = digits.split_at(1);
    let scientific = if rest.is_empty() {
        format!("{lead}e-{scale}")
    } else {
        format!("{lead}.{rest}E{:+}", rest.len() as i64 - scale as i64)
    };
    vec![
        format!("{sign}{plain}"),
        format!("{sign}{with_zeros}"),
        format!("{sign}{digits}e-{scale}"),
        format!("{sign}{digits}00E-{}", scale + 2),
        format!("{sign}{scientific}"),
    ]
}

fn digits() -> impl Strategy<Value = String> {
    // Up to 40 digits: more than any double holds, well inside the bounds.
    "[1-9][0-9]{0,39}"
}

proptest! {
    #[test]
    fn equivalent_decimal_spellings_hash_equal(digits in digits(), scale in 0usize..30, negative: bool) {
        let plain = [BoundField::new("/amount", false)];
        let decimal = [BoundField::new("/amount", true)];
        let spelled = spellings(&digits, scale, negative);
        let reference = hash(&body(&format!(r#"{{"amount":{}}}"#, spelled[0]))?, &plain)?;
        let first = normalize_decimal(&spelled[0]);
        for s in &spelled {
            prop_assert_eq!(&normalize_decimal(s), &first, "{}", s);
            let as_number = body(&format!(r#"{{"amount":{s}}}"#))?;
            let as_string = body(&format!(r#"{{"amount":"{s}"}}"#))?;
            prop_assert_eq!(&hash(&as_number, &plain)?, &reference, "{}", s);
            prop_assert_eq!(&hash(&as_number, &decimal)?, &reference, "{}", s);
            prop_assert_eq!(&hash(&as_string, &decimal)?, &reference, "{}", s);
        }
    }

    #[test]
    fn normalized_decimals_are_fixed_points(digits in digits(), scale in 0usize..30, negative: bool) {
        let spelled = spellings(&digits, scale, negative);
        let normal = normalize_decimal(&spelled[2]).ok_or_else(|| TestCaseError::fail("not a decimal"))?;
        prop_assert_eq!(normalize_decimal(&normal), Some(normal.clone()));
        prop_assert!(!normal.contains(['e', 'E']));
        prop_assert!(!(normal.contains('.') && normal.ends_with('0')));
    }

    #[test]
    fn different_decimals_hash_differently(a in digits(), b in digits(), sa in 0usize..10, sb in 0usize..10) {
        let fields = [BoundField::new("/amount", true)];
        let x = format!("{a}e-{sa}");
        let y = format!("{b}e-{sb}");
        prop_assume!(normalize_decimal(&x) != normalize_decimal(&y));
        let hx = hash(&body(&format!(r#"{{"amount":"{x}"}}"#))?, &fields)?;
        let hy = hash(&body(&format!(r#"{{"amount":{y}}}"#))?, &fields)?;
        prop_assert_ne!(hx, hy);
    }

    #[test]
    fn changing_any_bound_value_changes_the_hash(
        values in proptest::collection::vec(json_leaf(), 3),
        which in 0usize..3,
        replacement in json_leaf(),
    ) {
        let fields = [BoundField::new("/amount", false), BoundField::new("/currency", false), BoundField::new("/payee/id", false)];
        let build = |v: &[Value]| serde_json::json!({
            "amount": v[0], "currency": v[1], "payee": {"id": v[2]}, "memo": "free text",
        });
        let before = build(&values);
        let mut changed = values.clone();
        changed[which] = replacement;
        let after = build(&changed);
        let before_text = canonical_params(&before, &fields).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let after_text = canonical_params(&after, &fields).map_err(|e| TestCaseError::fail(e.to_string()))?;
        // Equal canonical text is exactly "the same business value" (e.g. 1.0 → 1).
        prop_assume!(before_text != after_text);
        prop_assert_ne!(hash(&before, &fields)?, hash(&after, &fields)?);
    }

    #[test]
    fn free_text_never_changes_the_hash(memo_a in ".*", memo_b in ".*", amount in digits()) {
        let fields = [BoundField::new("/amount", true)];
        let a = serde_json::json!({"amount": amount, "memo": memo_a});
        let b = serde_json::json!({"amount": amount, "memo": memo_b, "client_ts": 1});
        prop_assert_eq!(hash(&a, &fields)?, hash(&b, &fields)?);
    }

    #[test]
    fn key_order_never_matters(
        // No generated key can be "nested".
        members in proptest::collection::btree_map("[a-m]{1,6}", json_leaf(), 1..8),
        order: u64,
    ) {
        let mut entries: Vec<(String, Value)> = members.into_iter().collect();
        let text = |entries: &[(String, Value)]| {
            let inner: Vec<String> = entries.iter().map(|(k, v)| format!("{}:{}", Value::from(k.as_str()), v)).collect();
            format!(r#"{{"nested":{{{}}},{}}}"#, inner.join(","), inner.join(" , "))
        };
        let forward = text(&entries);
        // A deterministic shuffle from the generated seed.
        let mut seed = order;
        for i in (1..entries.len()).rev() {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            entries.swap(i, (seed >> 33) as usize % (i + 1));
        }
        entries.reverse();
        let shuffled = text(&entries);
        let mut fields: Vec<BoundField> = entries.iter().map(|(k, _)| BoundField::new(&format!("/{k}"), false)).collect();
        fields.push(BoundField::new("/nested", false));
        let h1 = hash(&body(&forward)?, &fields)?;
        fields.reverse();
        let h2 = hash(&body(&shuffled)?, &fields)?;
        prop_assert_eq!(h1, h2);
    }

    #[test]
    fn verify_never_panics_on_random_strings(s in ".{0,1200}") {
        let ring = keyring()?;
        let expect = Expect { subject_hash: "", scope: "", param_hash: None };
        prop_assert!(verify(&ring, &s, &expect).is_err());
    }

    #[test]
    fn verify_never_panics_on_random_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..1200)) {
        let ring = keyring()?;
        let text = String::from_utf8_lossy(&bytes);
        let expect = Expect { subject_hash: "", scope: "", param_hash: None };
        prop_assert!(verify(&ring, &text, &expect).is_err());
    }

    #[test]
    fn verify_rejects_token_shaped_noise(payload in "[A-Za-z0-9_-]{1,400}", sig in "[A-Za-z0-9_-]{1,60}") {
        let ring = keyring()?;
        let expect = Expect { subject_hash: "", scope: "", param_hash: None };
        let got = verify(&ring, &format!("{payload}.{sig}"), &expect);
        prop_assert!(matches!(got, Err(VerifyError::Malformed | VerifyError::UnknownKid | VerifyError::BadSignature)), "{:?}", got);
    }

    #[test]
    fn any_single_character_change_is_rejected(index in any::<prop::sample::Index>(), replacement in "[A-Za-z0-9_.=-]") {
        let ring = keyring()?;
        let u = subject_hash("alice");
        let p = "ab".repeat(32);
        let fp = mint(&ring, [3; 16], 100, &u, "pay", &p);
        let i = index.index(fp.len());
        let mut forged = fp.clone();
        forged.replace_range(i..i + 1, &replacement);
        prop_assume!(forged != fp);
        let expect = Expect { subject_hash: &u, scope: "pay", param_hash: Some(&p) };
        prop_assert!(verify(&ring, &forged, &expect).is_err());
    }

    #[test]
    fn mint_verify_round_trips(
        scope in ".{0,64}",
        subject in ".{0,64}",
        params in proptest::collection::vec(json_leaf(), 0..4),
        nonce: [u8; 16],
        exp in 1u64..u64::MAX,
        now_back in 1u64..1_000_000,
    ) {
        let ring = keyring()?;
        let bound: Vec<BoundField> = (0..params.len()).map(|i| BoundField::new(&format!("/p{i}"), false)).collect();
        let object: serde_json::Map<String, Value> = params.iter().enumerate().map(|(i, v)| (format!("p{i}"), v.clone())).collect();
        let p = hash(&Value::Object(object), &bound)?;
        let u = subject_hash(&subject);
        let fp = mint(&ring, nonce, exp, &u, &scope, &p);
        let now = exp.saturating_sub(now_back);
        let expect = Expect { subject_hash: &u, scope: &scope, param_hash: Some(&p) };
        let claims = verify(&ring, &fp, &expect).map_err(|e| TestCaseError::fail(format!("{e}: {fp}")))?;
        prop_assert!(!claims.expired(now));
        prop_assert!(claims.expired(exp));
        prop_assert_eq!(claims.kid.as_str(), "k1");
        prop_assert_eq!(claims.exp, exp);
        prop_assert_eq!(&claims.scope, &scope);
        prop_assert_eq!(claims.subject_hash, u.clone());
        prop_assert_eq!(claims.param_hash, p.clone());
        prop_assert_eq!(claims.nonce.as_str(), idem_core::fingerprint::nonce_hex(nonce));
    }

    #[test]
    fn decimal_parsing_never_panics(s in ".{0,120}") {
        let _ = normalize_decimal(&s);
    }

    #[test]
    fn body_parsing_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = parse_json_body(&bytes, 256);
    }
}

/// Scalar JSON values, including numbers no f64 could represent exactly.
fn json_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<bool>().prop_map(Value::Bool),
        ".{0,12}".prop_map(Value::String),
        any::<i64>().prop_map(Value::from),
        ("-?[1-9][0-9]{0,30}", "[0-9]{0,12}").prop_filter_map("a number", |(whole, frac)| {
            let literal = if frac.is_empty() { whole } else { format!("{whole}.{frac}") };
            serde_json::from_str::<Value>(&literal).ok()
        }),
    ]
}
