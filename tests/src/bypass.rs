//! What the bypass suite (tests/tests/bypass*.rs) asserts after every attack: what reached the upstream
//! (Envoy's own count of requests sent to the business cluster, and the demo's ledger), and the shape of
//! the gateway's refusal.

use crate::{Answer, BoxError, Stack};
use serde_json::Value;

/// The cluster that serves the business routes in the stack's config.
fn business_cluster(stack: &Stack) -> &'static str {
    if stack.opts.envoy_config == "istio-like.yaml" {
        "inbound|8080||"
    } else {
        "demo"
    }
}

/// Requests Envoy has sent to the business upstream so far (`cluster.<c>.upstream_rq_total`): whatever the
/// demo does with a request, this counts that it got one. idemd's callouts go to another cluster.
pub async fn upstream_requests(stack: &Stack) -> Result<u64, BoxError> {
    let name = format!("cluster.{}.upstream_rq_total", business_cluster(stack));
    let url = format!("http://127.0.0.1:{}/stats?filter=upstream_rq_total", stack.ports.admin);
    let text = stack.http.get(url).send().await?.text().await?;
    for line in text.lines() {
        if let Some((k, v)) = line.split_once(": ") {
            if k == name {
                return Ok(v.trim().parse()?);
            }
        }
    }
    Ok(0)
}

/// What the upstream saw: requests forwarded, and the demo's ledger (executions, attempts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    pub forwarded: u64,
    pub executions: u64,
    pub attempts: u64,
}

pub async fn seen(stack: &Stack) -> Result<Seen, BoxError> {
    let (executions, attempts) = crate::counts(stack).await?;
    Ok(Seen { forwarded: upstream_requests(stack).await?, executions, attempts })
}

impl Seen {
    /// Nothing more reached the upstream than `before`.
    pub fn assert_same(&self, before: Seen, what: &str) {
        assert_eq!(*self, before, "{what}: something reached the upstream (before {before:?}, now {self:?})");
    }
}

/// An answer in one line for assertion messages: status, then the body as text.
pub fn show(a: &Answer) -> String {
    format!("HTTP {} {}", a.status, String::from_utf8_lossy(&a.body))
}

/// An RFC 9457 problem (client-key routes for programs) of `kind` (`urn:agent-idempotency:problem:<kind>`).
pub fn assert_problem(a: &Answer, status: u16, kind: &str) {
    assert_eq!(a.status, status, "{}", show(a));
    assert_eq!(a.header("content-type"), Some("application/problem+json"), "{}", show(a));
    assert_eq!(a.json["type"], format!("urn:agent-idempotency:problem:{kind}"), "{}", show(a));
}

/// A DESIGN §7 envelope of `status` with HTTP `code`.
pub fn assert_envelope(a: &Answer, code: u16, status: &str) {
    assert_eq!(a.status, code, "{}", show(a));
    assert_eq!(a.json["status"], status, "{}", show(a));
    a.assert_prompt(status);
}

/// A JSON-RPC error response with `code` (and its HTTP status).
pub fn assert_rpc_error(a: &Answer, http: u16, code: i64) {
    assert_eq!(a.status, http, "{}", show(a));
    assert_eq!(a.json["jsonrpc"], "2.0", "{}", show(a));
    assert_eq!(a.json["error"]["code"], code, "{}", show(a));
    assert!(a.json["error"]["message"].is_string(), "{}", show(a));
}

/// A JSON-RPC tool result that is an error (`isError: true`) with the envelope `status`.
pub fn assert_tool_error(a: &Answer, status: &str) {
    assert_eq!(a.status, 200, "{}", show(a));
    assert_eq!(a.json["result"]["isError"], true, "{}", show(a));
    // DESIGN §11: no result, so no structuredContent for the output schema to reject; the envelope in `_meta`.
    assert!(a.json["result"].get("structuredContent").is_none(), "{}", show(a));
    assert_eq!(a.json["result"]["_meta"][idem_core::machine::META_KEY]["status"], status, "{}", show(a));
}

/// A key no earlier run used (client keys outlive a test run in shared stores).
pub fn fresh_key(prefix: &str) -> String {
    let mut b = [0u8; 8];
    let _ = getrandom::fill(&mut b);
    format!("{prefix}-{}", b.iter().map(|x| format!("{x:02x}")).collect::<String>())
}

/// A JSON-RPC `tools/call` of `tool` with `arguments`.
pub fn tools_call(id: Value, tool: &str, arguments: Value) -> Value {
    serde_json::json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {"name": tool, "arguments": arguments}})
}

/// The MCP arguments of a transfer (the fingerprint added when given).
pub fn mcp_args(amount: &str, payee: &str, fingerprint: Option<&str>) -> Value {
    let mut a = serde_json::json!({"amount": amount, "currency": "EUR", "payee_id": payee, "memo": "m"});
    if let Some(fp) = fingerprint {
        a["fingerprint"] = Value::String(fp.to_owned());
    }
    a
}
