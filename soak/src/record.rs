//! What the agents saw: every request with its answer kind and latency, and per
//! operation (one fingerprint) the answers that tell the agent what happened.

use serde_json::Value;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Which request an agent made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Req {
    Preview,
    Confirm,
    /// One of several identical confirms sent at once.
    Race,
    /// A confirm retried after the fingerprint's `exp`.
    Late,
    Status,
    /// The same fingerprint with another amount: must be 422 params_changed.
    Tamper,
    /// Someone else's fingerprint: must be 403 forbidden.
    WrongSubject,
    /// The crash-after-commit fault's own confirm.
    Crash,
    /// After the run, polling status until every operation has a definite answer.
    Final,
}

impl Req {
    pub fn name(self) -> &'static str {
        match self {
            Req::Preview => "preview",
            Req::Confirm => "confirm",
            Req::Race => "race",
            Req::Late => "late",
            Req::Status => "status",
            Req::Tamper => "tamper",
            Req::WrongSubject => "wrong_subject",
            Req::Crash => "crash_confirm",
            Req::Final => "final_status",
        }
    }

    /// Whether the answer tells the agent what happened to its operation (tamper / wrong-subject probes do not).
    pub fn about_the_operation(self) -> bool {
        !matches!(self, Req::Preview | Req::Tamper | Req::WrongSubject)
    }

    pub fn is_confirm(self) -> bool {
        matches!(self, Req::Confirm | Req::Race | Req::Late | Req::Crash)
    }
}

/// One request and its answer.
#[derive(Debug, Clone)]
pub struct Event {
    /// Sent, ms since the soak started.
    pub t_ms: u64,
    pub sent_unix_ms: u64,
    pub agent: usize,
    pub op: Option<usize>,
    pub req: Req,
    /// The answer's kind: a §7 `status`, `executed` (the first execution's own answer), `upstream_4xx`,
    /// `minted`, `transport_error`, `malformed`, …
    pub kind: String,
    pub http: u16,
    pub latency_ms: f64,
    /// The transfer this answer reports as executed (first answer or replay).
    pub transfer_id: Option<String>,
}

/// One operation: a fingerprint an agent holds.
#[derive(Debug, Clone)]
pub struct Op {
    pub id: usize,
    pub agent: usize,
    pub subject: String,
    pub fingerprint: String,
    pub nonce: String,
    pub exp: u64,
    pub short_ttl: bool,
    /// On the approval routes: a person approves (or not) before it may run.
    pub approval: bool,
    pub amount: Value,
    /// On the hostile upstream (`--world hostile|mixed`): its routes, its quote, the draws its requests name.
    pub hostile: Option<std::sync::Arc<HostileOp>>,
}

/// Where a hostile preview route reads the quote's expiry (soak-hostile.yaml).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuoteRead {
    /// `quote_expires: /expires_at`
    Body,
    /// `quote_expires: header:quote-expires-at`
    Header,
    /// No `quote_expires`: the preview streams.
    Free,
}

/// An operation on the hostile upstream.
#[derive(Debug)]
pub struct HostileOp {
    /// `/hostile` (HTTP/1.1 to the upstream), `/hostile2` (h2c) or `/hostile-nokey` (an upstream that ignores keys).
    pub confirm_prefix: &'static str,
    /// Its status route's prefix (`/hostile` or `/hostile-nokey`).
    pub status_prefix: &'static str,
    /// The business reference its requests carry (the `/hostile-nokey` routes).
    pub client_ref: Option<String>,
    pub quote_read: QuoteRead,
    /// The quote the preview answered (its id in the upstream's ledger).
    pub quote_id: Option<String>,
    /// The draws of this operation's requests: `draw_base`, `draw_base + 1`, … (`x-hostile-draw`).
    pub draw_base: u64,
    pub next_draw: AtomicU64,
}

impl HostileOp {
    pub fn draw(&self) -> u64 {
        self.draw_base.wrapping_add(self.next_draw.fetch_add(1, Ordering::Relaxed))
    }
}

/// A broken invariant (or contract), said precisely.
#[derive(Debug, Clone)]
pub struct Violation {
    pub kind: &'static str,
    pub detail: String,
}

/// Answer kinds that settle what happened: the agent may stop asking.
pub fn definite(kind: &str) -> bool {
    matches!(
        kind,
        "executed"
            | "already_completed"
            | "already_failed"
            | "not_executed"
            | "fingerprint_expired"
            | "params_changed"
            | "forbidden"
            | "fingerprint_invalid"
            | "fingerprint_missing"
            | "rejected"
            | "approval_lapsed"
            // The operation's business reference names another one: refused, nothing ran.
            | "reference_in_use"
    ) || kind.starts_with("upstream_4")
}

/// Whether `s` is a §7 status the filter answers with.
pub fn is_prompt_status(s: &str) -> bool {
    idem_core::reply::ReplyKind::ALL.iter().any(|k| k.status() == s)
}

pub struct Reply {
    pub status: u16,
    pub content_type: String,
    pub replayed: Option<String>,
    /// The gateway's `agent-fingerprint` header (a preview's), every value of it.
    pub fingerprint_headers: Vec<String>,
    pub body: Vec<u8>,
    pub json: Value,
}

/// Reads one answer: (kind, transfer id it reports, contract problem if any).
pub fn classify(req: Req, nonce: Option<&str>, r: &Reply) -> (String, Option<String>, Option<String>) {
    let j = &r.json;
    if req == Req::Preview {
        if r.status == 200 && j["fingerprint"].is_string() {
            return ("minted".into(), None, None);
        }
        if let Some(s) = j["status"].as_str().filter(|s| is_prompt_status(s)) {
            return (s.to_owned(), None, prompt_problem(r));
        }
        // The upstream (or Envoy, while the demo is down) answering the preview itself.
        return (format!("preview_{}", r.status), None, None);
    }
    if req.is_confirm() {
        // The first execution's own answer, passed through (the demo's 201; the hostile upstream's 200 or 201).
        if (200..300).contains(&r.status) && j["status"] == "executed" {
            let tid = j["transfer_id"].as_str().map(str::to_owned);
            let mut problem = None;
            if nonce.is_some_and(|n| j["idempotency_key"] != n) {
                problem = Some(format!(
                    "executed under Idempotency-Key {} instead of the nonce {nonce:?}",
                    j["idempotency_key"]
                ));
            }
            if r.replayed.as_deref() != Some("false") {
                problem = Some(format!("first execution without `Idempotent-Replayed: false` (got {:?})", r.replayed));
            }
            return ("executed".into(), tid, problem);
        }
        // A definite refusal of the upstream's own (demo: 422 limit_exceeded), passed through.
        if (400..500).contains(&r.status) && j["error"].is_string() && j.get("meaning").is_none() {
            return (format!("upstream_{}", r.status), None, None);
        }
    }
    match j["status"].as_str() {
        Some(s) if is_prompt_status(s) => {
            let tid = j["result"]["transfer_id"].as_str().map(str::to_owned);
            (s.to_owned(), tid, prompt_problem(r))
        }
        _ => {
            let body = String::from_utf8_lossy(&r.body);
            let body: String = body.chars().take(200).collect();
            ("malformed".into(), None, Some(format!("{} {}: {body:?}", r.status, r.content_type)))
        }
    }
}

/// DESIGN §7: status, meaning, instruction, retryable, trace_id; application/json.
fn prompt_problem(r: &Reply) -> Option<String> {
    let j = &r.json;
    let mut missing = Vec::new();
    for f in ["status", "meaning", "instruction", "trace_id"] {
        if j[f].as_str().is_none_or(|s| s.is_empty()) {
            missing.push(f);
        }
    }
    if !j["retryable"].is_boolean() {
        missing.push("retryable");
    }
    if !r.content_type.contains("application/json") {
        missing.push("content-type application/json");
    }
    if missing.is_empty() {
        None
    } else {
        Some(format!("{} reply without {}: {}", r.status, missing.join(", "), j))
    }
}

pub fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

pub fn since_ms(start: Instant) -> u64 {
    start.elapsed().as_millis() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(status: u16, ct: &str, body: &str) -> Reply {
        Reply {
            status,
            content_type: ct.into(),
            replayed: None,
            fingerprint_headers: Vec::new(),
            body: body.as_bytes().to_vec(),
            json: serde_json::from_str(body).unwrap_or(Value::Null),
        }
    }

    #[test]
    fn envoy_text_on_a_confirm_is_malformed_and_a_prompt_needs_every_field() {
        let (kind, _, problem) = classify(Req::Confirm, None, &reply(503, "text/plain", "upstream connect error"));
        assert_eq!(kind, "malformed");
        assert!(problem.is_some());
        let full = r#"{"status":"in_progress","meaning":"m","instruction":"i","retryable":false,"trace_id":"t"}"#;
        assert_eq!(classify(Req::Confirm, None, &reply(202, "application/json", full)).2, None);
        let no_trace = r#"{"status":"in_progress","meaning":"m","instruction":"i","retryable":false}"#;
        let (kind, _, problem) = classify(Req::Status, None, &reply(202, "application/json", no_trace));
        assert_eq!(kind, "in_progress");
        assert!(problem.is_some_and(|p| p.contains("trace_id")));
    }

    #[test]
    fn the_first_execution_must_carry_the_nonce_and_say_it_is_not_a_replay() {
        let body = r#"{"status":"executed","transfer_id":"t_1","idempotency_key":"n1"}"#;
        let mut r = reply(201, "application/json", body);
        r.replayed = Some("false".into());
        assert_eq!(classify(Req::Confirm, Some("n1"), &r), ("executed".into(), Some("t_1".into()), None));
        assert!(classify(Req::Confirm, Some("n2"), &r).2.is_some());
        // A passthrough preview error (the demo down) is the upstream's answer, not the filter's.
        assert_eq!(classify(Req::Preview, None, &reply(503, "text/plain", "no healthy upstream")).0, "preview_503");
    }
}
