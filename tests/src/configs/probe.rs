//! Probing a running configuration for a way around the guard and a second
//! execution, with the demo's ledger and Envoy's access log as the witnesses.
//!
//! **Around the guard**: confirm-shaped requests without a fingerprint — a
//! transfer with every method the demo's confirm could be reached by, and an
//! MCP `tools/call` of `execute_transfer` — on every listener, under every
//! Host a virtual host names, to every path a route matches and to the demo's
//! guarded paths and their near misses. Each carries its own
//! `Idempotency-Key: probe-…`. The guard never lets a client's key reach the
//! upstream of a guarded route, and never forwards such a request without a
//! fingerprint, so a probe key in the demo's ledger (it executed) or in an
//! access-log line that reached the demo at its confirm path (`/v1/transfers`
//! for a transfer, an MCP path for a `tools/call`, read as a lenient upstream
//! reads paths) is a way around the guard.
//!
//! **A second execution**: where the filter guards a REST confirm with a
//! preview of its scope, a real preview and the confirm twice with its
//! fingerprint: the demo must have received that operation once.

use std::collections::{BTreeMap, BTreeSet};

use idem_core::policy::rules::lenient_path;
use idem_testkit::envoy_config::{Doc, AGENT};
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

use super::rig::Rig;
use crate::{BoxError, SUBJECT};

/// The demo's paths a probe must never reach unguarded, by the kind of probe that would run something there.
const CONFIRM_PATHS: &[(&str, &str)] = &[
    ("transfer", "/v1/transfers"),
    ("tools-call", "/mcp"),
    ("tools-call", "/mcp/stream"),
    ("tools-call", "/mcp/sse"),
    ("tools-call", "/mcp/session"),
];

/// Paths probed besides the routes' own.
const PROBE_PATHS: &[&str] = &["/v1/transfers", "/v1/transfers/", "/V1/Transfers", "/mcp", "/mcp/stream", "/mcp/sse"];

const METHODS: &[&str] = &["POST", "PUT", "PATCH", "DELETE"];

/// One request a probe sends.
#[derive(Debug, Clone)]
pub struct Probe {
    pub listener: String,
    pub port: u16,
    pub host: String,
    pub method: &'static str,
    pub path: String,
    /// `transfer` or `tools-call`.
    pub kind: &'static str,
}

/// What probing one configuration found.
#[derive(Debug, Default)]
pub struct Found {
    pub probes: usize,
    /// Confirms run twice with one fingerprint (a real preview first).
    pub confirms: usize,
    pub violations: Vec<String>,
}

/// A Host a client can send to reach the virtual host at `h` (a domain it names, wildcards filled in).
fn hosts_of(doc: &Doc, h: &str) -> Vec<String> {
    let domains = doc.0.pointer(&format!("{h}/domains")).and_then(Value::as_array).cloned().unwrap_or_default();
    domains
        .iter()
        .filter_map(Value::as_str)
        .map(|d| match d {
            "*" => "probe.example".to_string(),
            d if d.starts_with("*.") => format!("a{}", &d[1..]),
            d if d.ends_with(".*") => format!("{}example", &d[..d.len() - 1]),
            d => d.to_string(),
        })
        .collect()
}

/// The listener index of a virtual host's pointer.
fn listener_of(h: &str) -> Option<usize> {
    h.split('/').nth(3).and_then(|i| i.parse().ok())
}

/// Hosts a client can name to reach each listener's virtual hosts.
fn hosts_by_listener(doc: &Doc) -> BTreeMap<usize, BTreeSet<String>> {
    let mut out: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
    for h in doc.virtual_hosts() {
        let Some(listener) = listener_of(&h) else { continue };
        out.entry(listener).or_default().extend(hosts_of(doc, &h));
    }
    out
}

/// Every path a route matches (a prefix with something below it too), and the demo's guarded paths.
fn paths(doc: &Doc) -> BTreeSet<String> {
    let mut out: BTreeSet<String> = PROBE_PATHS.iter().map(|p| p.to_string()).collect();
    for r in doc.routes() {
        let m = doc.0.pointer(&format!("{r}/match"));
        if let Some(p) = m.and_then(|m| m.get("path")).and_then(Value::as_str) {
            out.insert(p.to_string());
        }
        if let Some(p) =
            m.and_then(|m| m.get("prefix").or_else(|| m.get("path_separated_prefix"))).and_then(Value::as_str)
        {
            out.insert(p.to_string());
            out.insert(format!("{}/v1/transfers", p.trim_end_matches('/')));
        }
        if m.is_some_and(|m| m.get("path_match_policy").is_some()) {
            out.insert("/t/transfers".into());
        }
    }
    out
}

/// Every probe the configuration offers: listeners × hosts × paths × kinds.
pub async fn probes(rig: &Rig, doc: &Doc) -> Result<Vec<Probe>, BoxError> {
    let bound = rig.listeners().await?;
    let names: Vec<String> = doc
        .0
        .pointer("/static_resources/listeners")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|l| l["name"].as_str().unwrap_or_default().to_string())
        .collect();
    let hosts = hosts_by_listener(doc);
    let paths = paths(doc);
    let mut out = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let Some((_, port)) = bound.iter().find(|(n, _)| n == name) else { continue };
        for host in hosts.get(&i).into_iter().flatten() {
            for path in &paths {
                for method in METHODS {
                    out.push(Probe {
                        listener: name.clone(),
                        port: *port,
                        host: host.clone(),
                        method,
                        path: path.clone(),
                        kind: "transfer",
                    });
                }
                out.push(Probe {
                    listener: name.clone(),
                    port: *port,
                    host: host.clone(),
                    method: "POST",
                    path: path.clone(),
                    kind: "tools-call",
                });
            }
        }
    }
    Ok(out)
}

fn transfer_body(memo: &str) -> Value {
    json!({ "amount": "12.00", "currency": "EUR", "payee_id": "payee-42", "memo": memo, "client_ref": memo })
}

fn tools_call(memo: &str) -> Value {
    json!({ "jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": { "name": "execute_transfer", "arguments": transfer_body(memo) } })
}

/// Send up to `budget` of `all` (a seeded sample) with keys `probe-<tag>-<n>`; then read the witnesses.
pub async fn around_the_guard(
    rig: &Rig,
    all: &[Probe],
    budget: usize,
    tag: &str,
    log: &std::path::Path,
    rng: &mut ChaCha8Rng,
    found: &mut Found,
) -> Result<(), BoxError> {
    // First what a near miss or a mutation is most likely to open: the demo's confirm paths and their near misses,
    // Hosts other than the catch-all's, listeners other than the first; then a sample of the rest.
    let first = all.first().map(|p| p.listener.clone());
    let (mut chosen, rest): (Vec<&Probe>, Vec<&Probe>) = all.iter().partition(|p| {
        PROBE_PATHS.contains(&p.path.as_str()) || p.host != "probe.example" || Some(&p.listener) != first.as_ref()
    });
    chosen.shuffle(rng);
    chosen.truncate(budget);
    let room = budget.saturating_sub(chosen.len());
    chosen.extend(rest.choose_multiple(rng, room.min(rest.len())));
    let mut sent: BTreeMap<String, &Probe> = BTreeMap::new();
    for (n, p) in chosen.iter().enumerate() {
        let key = format!("probe-{tag}-{n}");
        let url = format!("http://127.0.0.1:{}{}", p.port, p.path);
        let body = if p.kind == "transfer" { transfer_body(&key) } else { tools_call(&key) };
        let req = rig
            .http
            .request(p.method.parse()?, url)
            .header("host", &p.host)
            .header("x-agent-subject", SUBJECT)
            .header("idempotency-key", &key)
            .header("x-probe", p.kind)
            .header("accept", "application/json, text/event-stream")
            .json(&body);
        // A probe the gateway or the demo hangs up on is an answer too; what counts is what the demo saw.
        let _ = req.send().await.map(|r| r.status());
        sent.insert(key, p);
    }
    found.probes += sent.len();
    tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    let ledger = rig.ledger().await?;
    for (key, count) in ledger["attempts_by_key"].as_object().into_iter().flatten() {
        if let Some(p) = sent.get(key) {
            found.violations.push(format!("executed around the guard ({count} attempt(s)): {}", show(p)));
        }
    }
    let demo = rig.demo_host();
    for line in rig.access(log)? {
        let (Some(key), Some(kind)) = (line["key"].as_str(), line["probe"].as_str()) else { continue };
        let Some(p) = sent.get(key) else { continue };
        if line["upstream_host"].as_str() != Some(demo.as_str()) {
            continue;
        }
        let upstream = line["path"].as_str().unwrap_or_default();
        let folded = lenient_path(upstream).unwrap_or_else(|| upstream.to_string());
        if CONFIRM_PATHS.iter().any(|(k, path)| *k == kind && folded == *path) {
            found.violations.push(format!(
                "reached the demo's {upstream} with the client's own key, unguarded ({} {}): {}",
                line["method"].as_str().unwrap_or_default(),
                line["status"],
                show(p)
            ));
        }
    }
    Ok(())
}

fn show(p: &Probe) -> String {
    format!("{} {} {} (Host {}, listener {} on :{})", p.kind, p.method, p.path, p.host, p.listener, p.port)
}

/// A guarded REST confirm and the preview of its scope, as a client reaches them.
#[derive(Debug, Clone)]
pub struct Pair {
    pub port: u16,
    pub host: String,
    pub preview: String,
    pub confirm: String,
    pub what: String,
}

/// Preview/confirm pairs the filter guards by annotation, where the subject is a header (the probe can be
/// anyone) and no header match stands in the way.
pub async fn pairs(rig: &Rig, doc: &Doc) -> Result<Vec<Pair>, BoxError> {
    let bound = rig.listeners().await?;
    let mut out = Vec::new();
    for h in doc.virtual_hosts() {
        let Some(listener) = listener_of(&h) else { continue };
        let name = doc.0.pointer(&format!("/static_resources/listeners/{listener}/name")).and_then(Value::as_str);
        let Some((_, port)) = bound.iter().find(|(n, _)| Some(n.as_str()) == name) else { continue };
        let manager = h.split("/route_config").next().unwrap_or_default();
        if doc.agent_filter(manager).is_none() {
            continue;
        }
        let Some(host) = hosts_of(doc, &h).into_iter().next() else { continue };
        let routes = doc.0.pointer(&format!("{h}/routes")).and_then(Value::as_array).cloned().unwrap_or_default();
        let exact = |r: &Value, role: &str| -> Option<(String, String)> {
            let meta = r.pointer(&format!("/metadata/filter_metadata/{AGENT}"))?;
            let plain = r.pointer("/match/headers").and_then(Value::as_array).is_none_or(|hs| {
                hs.iter().all(|x| x["name"] == ":method" && x.pointer("/string_match/exact") == Some(&json!("POST")))
            });
            (meta["role"] == role && plain && meta.get("client_keys").is_none())
                .then(|| Some((r.pointer("/match/path")?.as_str()?.to_string(), meta["scope"].as_str()?.to_string())))
                .flatten()
        };
        for r in &routes {
            let Some((confirm, scope)) = exact(r, "confirm") else { continue };
            let preview = routes.iter().filter_map(|p| exact(p, "preview")).find(|(_, s)| *s == scope);
            if let Some((preview, _)) = preview {
                let what =
                    format!("{} (scope {scope}) on :{port} Host {host}", r["name"].as_str().unwrap_or("(unnamed)"));
                out.push(Pair { port: *port, host: host.clone(), preview, confirm, what });
            }
        }
    }
    Ok(out)
}

/// Preview, then confirm twice with the fingerprint; the demo must have received the operation once.
pub async fn twice(rig: &Rig, pair: &Pair, memo: &str, found: &mut Found) -> Result<(), BoxError> {
    let url = |p: &str| format!("http://127.0.0.1:{}{p}", pair.port);
    let send = |path: String, fp: Option<String>| {
        let mut req = rig
            .http
            .post(url(&path))
            .header("host", &pair.host)
            .header("x-agent-subject", SUBJECT)
            .json(&transfer_body(memo));
        if let Some(fp) = fp {
            req = req.header("agent-fingerprint", fp);
        }
        req.send()
    };
    let preview: Value = match send(pair.preview.clone(), None).await {
        Ok(r) => r.json().await.unwrap_or(Value::Null),
        Err(_) => return Ok(()),
    };
    // A mutation may have taken the preview's guard away: nothing to confirm with.
    let Some(fp) = preview["fingerprint"].as_str().map(str::to_string) else { return Ok(()) };
    let nonce = idem_testkit::fingerprint::nonce(&fp)?;
    let first = send(pair.confirm.clone(), Some(fp.clone())).await.map(|r| r.status().as_u16()).unwrap_or(0);
    let _ = send(pair.confirm.clone(), Some(fp)).await;
    if !(200..300).contains(&first) {
        return Ok(());
    }
    found.confirms += 1;
    tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    let ledger = rig.ledger().await?;
    let attempts = ledger["attempts_by_key"][&nonce].as_u64().unwrap_or(0);
    if attempts != 1 {
        found.violations.push(format!("confirm {} reached the demo {attempts} times for one fingerprint", pair.what));
    }
    Ok(())
}
