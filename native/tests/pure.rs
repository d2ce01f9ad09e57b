//! The module's parts that need no Envoy: the per-route annotation encoding and
//! the panic barrier every hook runs inside. Everything else is exercised in a
//! real Envoy by the end-to-end suite (`IDEM_E2E_HOST=native`, tests/tests/native.rs).

use agent_idempotency_native::annotation_pairs;
use agent_idempotency_native::hooks::caught;
use idem_adapter::RouteLookup;
use idem_core::policy::{self, RouteDefaults};

#[test]
fn a_json_annotation_becomes_the_bytes_route_metadata_would_give() -> Result<(), String> {
    let json =
        br#"{"role":"confirm","upstream_keys":"honoured","scope":"pay","bind":"/amount:decimal","lease_ms":2000}"#;
    let encoded = annotation_pairs(json)?;
    let pairs = policy::decode_pairs(&encoded).ok_or("not pairs")?;
    let lease = pairs.iter().find(|(k, _)| k == "lease_ms").ok_or("no lease")?;
    assert_eq!(lease.1, 2000f64.to_le_bytes().to_vec());
    assert!(matches!(RouteLookup::from_annotation(&encoded, &RouteDefaults::default()), RouteLookup::Guarded(_)));
    Ok(())
}

#[test]
fn broken_annotations_are_refused_at_load() {
    for bad in [
        &br#"{"role":"confirm","upstream_keys":"honoured"}"#[..],
        br#"{"role":"confirm","upstream_keys":"honoured","scope":"pay","rol":"x"}"#,
        br#"{"scope":"pay"}"#,
        br#"["role"]"#,
        br#"{"role":"confirm","upstream_keys":"honoured","scope":"pay","bind":["/a"]}"#,
        b"not json",
    ] {
        assert!(annotation_pairs(bad).is_err(), "{}", String::from_utf8_lossy(bad));
    }
}

#[test]
fn a_panic_stops_at_the_hook_boundary() {
    assert_eq!(caught(|| 7), Some(7));
    assert_eq!(caught(|| -> u8 { panic!("a bug in a hook") }), None);
}
