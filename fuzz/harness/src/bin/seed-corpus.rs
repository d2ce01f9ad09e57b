//! Writes the seed corpus, `fuzz/corpus/<target>/seed-*`, from real inputs:
//! the JSON literals in idem-core's tests, the plugin configurations and route
//! annotations of `envoy/*.yaml`, and fingerprints minted with the harness's
//! fixed keyring. Idempotent: `cargo run -p idem-fuzz-harness --bin seed-corpus`.

#![forbid(unsafe_code)]

use idem_core::canonical::{param_hash, parse_json_body, BoundField};
use idem_core::fingerprint::{mint, subject_hash, Key, Keyring};
use idem_fuzz_harness::keyring;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

type Corpus = BTreeMap<&'static str, Vec<(String, Vec<u8>)>>;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_default()
}

/// Every `r#"..."#` / `br#"..."#` literal in Rust source.
fn raw_literals(source: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = source;
    while let Some(start) = rest.find("r#\"") {
        let after = &rest[start + 3..];
        let Some(end) = after.find("\"#") else { break };
        out.push(after[..end].to_string());
        rest = &after[end + 2..];
    }
    out
}

/// Blocks under `key:` in YAML, as (indented lines) until the indentation drops.
fn yaml_blocks(yaml: &str, marker: &str) -> Vec<Vec<String>> {
    let lines: Vec<&str> = yaml.lines().collect();
    let indent = |l: &str| l.len() - l.trim_start().len();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if !line.trim_end().ends_with(marker) {
            continue;
        }
        let base = indent(line);
        let block: Vec<String> = lines[i + 1..]
            .iter()
            .take_while(|l| l.trim().is_empty() || indent(l) > base)
            .map(|l| l.trim().to_string())
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .collect();
        out.push(block);
    }
    out
}

/// A route annotation block as the route target's lines: quoted or non-numeric
/// scalars are strings, bare numbers are numbers (Envoy's Struct has doubles).
fn annotation(block: &[String]) -> String {
    let mut out = String::new();
    for line in block {
        let Some((key, value)) = line.split_once(':') else { continue };
        let value = value.trim();
        if let Some(quoted) = value.strip_prefix('"').and_then(|v| v.strip_suffix('"')) {
            out.push_str(&format!("{key}={quoted}\n"));
        } else if value.parse::<f64>().is_ok() {
            out.push_str(&format!("{key}#={value}\n"));
        } else {
            out.push_str(&format!("{key}={value}\n"));
        }
    }
    out
}

fn token_seeds(c: &mut Corpus) {
    let transfer = br#"{"amount":"1.00","currency":"USD","payee_id":"p_1"}"#;
    let fields =
        [BoundField::new("/amount", true), BoundField::new("/currency", false), BoundField::new("/payee_id", false)];
    let p = parse_json_body(transfer, 1 << 16)
        .ok()
        .and_then(|b| param_hash(&b, &fields).ok())
        .unwrap_or_else(|| "ab".repeat(32));
    let alice = subject_hash("alice");
    let mut tokens = Vec::new();
    for (i, (active, scope, exp)) in [
        ("k1", "payments.transfer", 1_000),
        ("k0", "payments.transfer", 1_700_000_900),
        ("k1", "payments.manual", u64::MAX),
        ("k1", "", 1),
        ("k0", "s\u{1}\"é😀", 42),
    ]
    .into_iter()
    .enumerate()
    {
        let token = mint(&keyring(active), [i as u8 * 17; 16], exp, &alice, scope, &p);
        tokens.push(token.clone());
        add(c, "fingerprint", &format!("minted-{i}"), token.as_bytes());
    }
    // Same kid, another secret: a bad signature.
    if let Ok(other) = Keyring::new(vec![Key { kid: "k1".into(), secret: vec![9; 32] }], "k1") {
        add(c, "fingerprint", "other-secret", mint(&other, [1; 16], 5, &alice, "pay", &p).as_bytes());
    }
    let fp = tokens.first().cloned().unwrap_or_default();
    let (payload, sig) = fp.split_once('.').unwrap_or(("", ""));
    for (label, bad) in [
        ("empty", String::new()),
        ("dot", ".".into()),
        ("word", "not-a-token".into()),
        ("payload-only", payload.to_string()),
        ("no-sig", format!("{payload}.")),
        ("no-payload", format!(".{sig}")),
        ("two-dots", format!("{fp}.{sig}")),
        ("padded-sig", format!("{payload}.{sig}=")),
        ("padded-payload", format!("{payload}=.{sig}")),
        ("short-sig", format!("{payload}.{}", &sig[..sig.len().saturating_sub(2)])),
        ("plus-sig", format!("{payload}.{}", "+".repeat(43))),
        ("leading-space", format!(" {fp}")),
        ("trailing-newline", format!("{fp}\n")),
        ("too-long", "a".repeat(1025)),
    ] {
        add(c, "fingerprint", label, bad.as_bytes());
    }
}

fn add(c: &mut Corpus, target: &'static str, label: &str, data: &[u8]) {
    let entries = c.entry(target).or_default();
    if !entries.iter().any(|(_, d)| d == data) {
        let clean: String = label.chars().map(|ch| if ch.is_ascii_alphanumeric() { ch } else { '-' }).collect();
        entries.push((format!("seed-{clean}"), data.to_vec()));
    }
}

fn json_seeds(c: &mut Corpus) {
    let sources = [
        "core/src/canonical.rs",
        "core/src/strict_json.rs",
        "core/src/protocol.rs",
        "core/src/reply.rs",
        "core/src/fingerprint.rs",
        "core/tests/properties.rs",
    ];
    for source in sources {
        let name = source.rsplit('/').next().unwrap_or(source).trim_end_matches(".rs");
        for (i, literal) in raw_literals(&read(source)).into_iter().enumerate() {
            if literal.contains("{}") || literal.contains("{{") {
                continue; // a format string, not an input
            }
            let starts_like_json = literal.trim_start().starts_with(['{', '[']);
            if starts_like_json {
                add(c, "strict_json", &format!("{name}-{i}"), literal.as_bytes());
                add(c, "param_hash", &format!("{name}-{i}"), literal.as_bytes());
            }
            if serde_json::from_str::<serde_json::Value>(&literal).is_ok_and(|v| v.is_object()) {
                add(c, "protocol", &format!("{name}-{i}"), literal.as_bytes());
            }
        }
    }
    // The splice: the answers of core's preview tests, each behind a chunk-cut byte.
    for source in ["core/src/machine/splice.rs", "core/src/machine/tests.rs"] {
        let name = source.rsplit('/').next().unwrap_or(source).trim_end_matches(".rs");
        for (i, literal) in raw_literals(&read(source)).into_iter().enumerate() {
            if literal.trim_start().starts_with(['{', '[', '"']) {
                for pick in [0u8, 13, 200] {
                    add(c, "splice", &format!("{name}-{i}-{pick}"), &[&[pick][..], literal.as_bytes()].concat());
                }
            }
        }
    }
    for (label, text) in [
        ("deep", format!("{{\"x\":{}1{}}}", "[".repeat(33), "]".repeat(33))),
        ("amounts", r#"{"a":1,"b":1.0,"c":1.00,"d":100e-2,"e":"100e-2","f":-0.0,"g":1e999999999}"#.into()),
        ("escapes", r#"{"\u0061":"\ud83d\ude00","a~1b":{"m/n":[null,{"k":"\u2028"}]}}"#.into()),
        ("dup-escaped", r#"{"amount":1,"\u0061mount":1000}"#.into()),
        ("token-key", r#"{"amount":{"$serde_json::private::Number":"1"}}"#.into()),
    ] {
        add(c, "strict_json", label, text.as_bytes());
        add(c, "param_hash", label, text.as_bytes());
    }
}

fn config_seeds(c: &mut Corpus) {
    for file in ["envoy.yaml", "e2e.yaml", "bench.yaml", "compose.yaml"] {
        let yaml = read(&format!("envoy/{file}"));
        for (i, block) in yaml_blocks(&yaml, "value: |").into_iter().enumerate() {
            add(c, "plugin_config", &format!("envoy-{file}-{i}"), block.join("\n").as_bytes());
        }
        for (i, block) in yaml_blocks(&yaml, "agent_idempotency:").into_iter().enumerate() {
            let text = annotation(&block);
            if !text.is_empty() {
                add(c, "route_policy", &format!("envoy-{file}-{i}"), text.as_bytes());
            }
        }
    }
    // The policy tests: whole configurations, and the fragments they add to a minimal one.
    let secret = "0123456789abcdef0123456789abcdef";
    let minimal = format!(
        r#"{{"sidecar_cluster":"idem_sidecar","keys":[{{"kid":"k1","secret":"{secret}"}}],"active_kid":"k1","subject":{{"header":"X-Agent-Subject"}}"#
    );
    for (i, literal) in raw_literals(&read("core/src/policy.rs")).into_iter().enumerate() {
        let text = literal.replace("{{", "{").replace("}}", "}").replace("{SECRET}", secret);
        if text.starts_with(",\"") {
            add(c, "plugin_config", &format!("policy-{i}"), format!("{minimal}{text}}}").as_bytes());
        } else if text.contains("sidecar_cluster") {
            add(c, "plugin_config", &format!("policy-{i}"), text.as_bytes());
        }
    }
    add(c, "plugin_config", "env-secret", format!(
        r#"{{"sidecar_cluster":"c","keys":[{{"kid":"k1","secret_env":"IDEM_HMAC_K1"}},{{"kid":"k0","secret":"{secret}"}}],"active_kid":"k1","subject":{{"property":["metadata","filter_metadata","envoy.filters.http.jwt_authn","jwt_payload","sub"]}},"language":"zh","defaults":{{"lease_ms":1000}}}}"#
    ).as_bytes());
    for (label, text) in [
        ("bad-role", "role=execute\nscope=pay\nbind=/amount\n"),
        ("num-role", "role#=1\nscope=pay\n"),
        ("no-role", "scope=pay\nbind=/amount\n"),
        ("bad-bind", "role=confirm\nscope=pay\nbind=/amount:decimall, /a~2\n"),
        ("twice", "role=preview\nscope=pay\nbind=/amount, /amount:decimal\n"),
        ("ttl-nan", "role=preview\nscope=pay\nbind=/a\nfingerprint_ttl_s#=NaN\n"),
        ("ttl-text", "role=preview\nscope=pay\nbind=/a\nfingerprint_ttl_s=15m\nlease_ms=120000\n"),
        ("outcomes", "role=confirm\nupstream_keys=honoured\nscope=pay:v1\nbind=/a /b:decimal\noutcomes=409:failed, 425:release 503:unknown\n"),
        ("bad-outcome", "role=confirm\nscope=pay\nbind=/a\noutcomes=200:failed\n"),
        ("status-ref", "role=status\nscope=pay\nresult_ref=transfer_id\nstatus_tool= get_status \n"),
    ] {
        add(c, "route_policy", label, text.as_bytes());
    }
}

fn protocol_seeds(c: &mut Corpus) {
    // Written as JSON text, not built from the types, so a field the types gain
    // later does not stop the seeds from building.
    let body = idem_core::protocol::encode_body(br#"{"transfer_id":"t_1","amount":"1.00"}"#);
    let result = format!(
        r#"{{"status":201,"headers":[["content-type","application/json"],["Location","/v1/t/1"],["set-cookie","s=1"]],"body_b64":"{body}"}}"#
    );
    let key = "07".repeat(16);
    let owner = "0f".repeat(16);
    let (u, p) = (subject_hash("alice"), "ab".repeat(32));
    for (label, text) in [
        (
            "acquire",
            format!(
                r#"{{"key":"{key}","param_hash":"{p}","subject_hash":"{u}","scope":"payments.transfer","lease_ms":60000,"trace_id":"t1"}}"#
            ),
        ),
        ("acquired", format!(r#"{{"outcome":"ACQUIRED","owner":"{owner}"}}"#)),
        ("in-flight", format!(r#"{{"outcome":"IN_FLIGHT","owner":"{owner}"}}"#)),
        ("done", format!(r#"{{"outcome":"DONE","result":{result}}}"#)),
        ("failed", r#"{"outcome":"FAILED","result":{"status":409}}"#.to_string()),
        ("complete", format!(r#"{{"key":"{key}","owner":"{owner}","state":"DONE","result":{result}}}"#)),
        ("release", format!(r#"{{"key":"{key}","owner":"{owner}"}}"#)),
        ("ack", r#"{"outcome":"NOT_OWNER"}"#.to_string()),
        (
            "view",
            format!(
                r#"{{"key":"{key}","state":"NEEDS_REVIEW","scope":"payments.transfer","subject_hash":"{u}","param_hash":"{p}","owner":"{owner}","result":{result},"lease_until_ms":-1,"created_at_ms":1700000000000,"updated_at_ms":9223372036854775807}}"#
            ),
        ),
        ("result", result.clone()),
        ("binary-body", r#"{"status":200,"body_b64":"AJ+Slnt9"}"#.to_string()),
        ("text-body", format!(r#"{{"status":500,"body_b64":"{}"}}"#, idem_core::protocol::encode_body(b"oops"))),
        ("base64", "e30=".to_string()),
        ("base64-noncanonical", "e31=".to_string()),
    ] {
        add(c, "protocol", label, text.as_bytes());
    }
}

fn main() -> std::io::Result<()> {
    let mut corpus = Corpus::new();
    token_seeds(&mut corpus);
    json_seeds(&mut corpus);
    config_seeds(&mut corpus);
    protocol_seeds(&mut corpus);
    for (target, entries) in &corpus {
        let dir = root().join("fuzz/corpus").join(target);
        std::fs::create_dir_all(&dir)?;
        for (name, data) in entries {
            std::fs::write(dir.join(name), data)?;
        }
        println!("{target}: {} seeds", entries.len());
    }
    Ok(())
}
