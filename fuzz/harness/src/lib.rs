//! Bodies of the fuzz targets in `fuzz/fuzz_targets/`: one `pub fn` per target,
//! taking the fuzzer's bytes. Each drives one of idem-core's parsers on the
//! filter path and panics (a crash, to the fuzzer) when an invariant breaks.
//!
//! The same functions replay `fuzz/corpus/<target>/` and
//! `fuzz/regressions/<target>/` in the normal test run (`tests/corpus.rs`).

#![forbid(unsafe_code)]

pub mod json_gen;
pub mod mcp;
pub mod response;
mod targets;

pub use mcp::mcp;
pub use response::response;
pub use targets::{fingerprint, param_hash, plugin_config, protocol, route_policy, splice, strict_json};

/// A target body: the fuzzer's bytes in, a panic when an invariant breaks.
pub type Target = fn(&[u8]);

/// Every target, by the name of its fuzz target and corpus directory.
pub const TARGETS: &[(&str, Target)] = &[
    ("fingerprint", fingerprint),
    ("strict_json", strict_json),
    ("param_hash", param_hash),
    ("plugin_config", plugin_config),
    ("route_policy", route_policy),
    ("protocol", protocol),
    ("mcp", mcp),
    ("splice", splice),
    ("response", response),
];

/// The keys every fingerprint target uses: `k1` (active) and `k0`.
pub const SECRET_K1: [u8; 32] = [0x5a; 32];
pub const SECRET_K0: [u8; 40] = [0xa5; 40];

/// The fixed keyring with `active` ("k1" or "k0") minting.
pub fn keyring(active: &str) -> idem_core::fingerprint::Keyring {
    use idem_core::fingerprint::{Key, Keyring};
    let keys = vec![
        Key { kid: "k1".into(), secret: SECRET_K1.to_vec() },
        Key { kid: "k0".into(), secret: SECRET_K0.to_vec() },
    ];
    match Keyring::new(keys, active) {
        Ok(ring) => ring,
        Err(e) => panic!("the fixed keyring is valid: {e}"),
    }
}

/// The route-annotation target's input: one leaf per line, `key=text` for a
/// string leaf and `key#=number` for a number leaf (as Envoy hands them over:
/// text and doubles). Lines without `=` and unparsable numbers are skipped;
/// a later line for the same key wins.
pub fn route_leaves(data: &[u8]) -> Vec<(String, idem_core::policy::LeafValue)> {
    use idem_core::policy::LeafValue;
    let text = String::from_utf8_lossy(data);
    let mut leaves: Vec<(String, LeafValue)> = Vec::new();
    for line in text.split('\n') {
        let Some((key, value)) = line.split_once('=') else { continue };
        let (key, leaf) = match key.strip_suffix('#') {
            Some(key) => match value.trim().parse::<f64>() {
                Ok(n) => (key, LeafValue::Num(n)),
                Err(_) => continue,
            },
            None => (key, LeafValue::Str(value.to_string())),
        };
        leaves.retain(|(k, _)| k != key);
        leaves.push((key.to_string(), leaf));
    }
    leaves
}

/// The inverse of [`route_leaves`].
pub fn route_text(leaves: &[(String, idem_core::policy::LeafValue)]) -> String {
    use idem_core::policy::LeafValue;
    let mut out = String::new();
    for (key, leaf) in leaves {
        match leaf {
            LeafValue::Str(s) => out.push_str(&format!("{key}={s}\n")),
            LeafValue::Num(n) => out.push_str(&format!("{key}#={n:?}\n")),
        }
    }
    out
}
