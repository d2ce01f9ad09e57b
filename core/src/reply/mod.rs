//! Replies are prompts (DESIGN §7).
//!
//! The caller is a model that reads the body and reasons about its next step,
//! and models lean towards "try again". So every body says what happened, what
//! to do next, and, whenever retrying is wrong, what to do instead.

mod en;
mod kind;
mod say;
mod zh;

pub use kind::{ReplyKind, Tells};

use crate::policy::Language;
use crate::protocol::{decode_body, StoredResult};
use serde_json::{Map, Value};

#[derive(Debug, Clone, Default)]
pub struct ReplyContext<'a> {
    pub trace_id: &'a str,
    /// The status tool's name, for `in_progress` (and `needs_review`).
    pub poll_with: Option<&'a str>,
    /// This call's own tool, where it has a name: without a status tool, `in_progress` polls by
    /// calling it again with the same fingerprint (which reports, never executes twice).
    pub own_tool: Option<&'a str>,
    pub poll_after_ms: u64,
    pub retry_after_ms: u64,
    /// The recorded upstream answer, for `already_completed` / `already_failed`.
    pub result: Option<&'a StoredResult>,
    /// The route's `result_ref` pointer: the reference to quote is read from the recorded body
    /// where the reply parses it anyway (one parse of the recorded answer per replay, not two).
    pub result_ref_at: Option<&'a str>,
    /// Unix seconds, for the status route's "not yet executed".
    pub fingerprint_expires_at: Option<u64>,
    /// The operation key (the fingerprint's nonce), for replies an operator may
    /// be asked about: `in_progress`, `needs_review`, `status_unavailable`.
    pub operation: Option<&'a str>,
    pub detail: Option<&'a str>,
    /// The reply answers a status query, not a repeated confirm: the wording
    /// reports the outcome instead of calling the call a duplicate, and the
    /// query itself succeeded (HTTP 200; `original_status` keeps the upstream's).
    pub status_query: bool,
    /// What a person approves (or approved, or refused): for the approval replies.
    pub approval: Option<ApprovalFacts<'a>>,
}

/// The approval replies' facts: what awaits a decision and where it is made.
#[derive(Debug, Clone, Copy, Default)]
pub struct ApprovalFacts<'a> {
    /// The bound fields' canonical JSON (what the fingerprint covers; never free text).
    pub fields: &'a str,
    pub scope: &'a str,
    /// Where a person approves (idemd's console), if configured.
    pub console: Option<&'a str>,
    /// The approver's reason, on a rejection.
    pub reason: Option<&'a str>,
    /// Unix seconds: the approval lapses then.
    pub expires_at: Option<u64>,
}

/// A local reply, rendered for plain HTTP. `facts` keeps what it says as data, so a framing
/// that wraps it (MCP, DESIGN §11) renders its own shape instead of re-parsing `body`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub http_status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub facts: Option<Facts>,
}

/// What a reply says: its kind and the §7 envelope's fields (for a replay, `result` is the
/// recorded answer). `None` on a reply that is the upstream's own recorded answer
/// (`replay: original`) or a framing's own message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Facts {
    pub kind: ReplyKind,
    pub envelope: Map<String, Value>,
}

impl Reply {
    /// A reply that is only bytes (a framing's own message).
    pub fn raw(http_status: u16, headers: Vec<(String, String)>, body: Vec<u8>) -> Reply {
        Reply { http_status, headers, body, facts: None }
    }
}

/// The description of the property a guarded MCP confirm tool's replay carries its envelope in
/// (DESIGN §11): the gateway adds it to the tool's listed `outputSchema`, where the model reads it.
pub fn replay_property_description(lang: Language) -> &'static str {
    match lang {
        Language::En => en::REPLAY_PROPERTY,
        Language::Zh => zh::REPLAY_PROPERTY,
    }
}

pub fn render(kind: ReplyKind, lang: Language, ctx: &ReplyContext) -> Reply {
    let replayed = matches!(kind, ReplyKind::AlreadyCompleted | ReplyKind::AlreadyFailed);
    let (original, is_json) = match ctx.result.filter(|_| replayed) {
        Some(result) => original_body(result),
        None => (Value::Null, false),
    };
    let result_ref = ctx.result_ref_at.filter(|_| is_json).and_then(|pointer| scalar_at(&original, pointer));
    let text = wording(kind, lang, ctx, result_ref.as_deref());
    let mut body = Map::new();
    body.insert("status".into(), kind.status().into());
    body.insert("meaning".into(), text.meaning.into());
    body.insert("instruction".into(), text.instruction.into());
    body.insert("retryable".into(), kind.row().retryable.into());
    body.insert("trace_id".into(), ctx.trace_id.into());

    let mut headers = vec![
        ("content-type".to_string(), "application/json".to_string()),
        // Replays carry one caller's business result; no cache may keep them.
        ("cache-control".to_string(), "no-store".to_string()),
    ];
    match kind {
        ReplyKind::AlreadyCompleted | ReplyKind::AlreadyFailed => {
            body.insert("result".into(), original);
            if let Some(reference) = result_ref {
                body.insert("result_ref".into(), reference.into());
            }
            if let Some(result) = ctx.result {
                body.insert("original_status".into(), result.status.into());
                // The envelope is JSON whatever the original was; other recorded
                // headers (e.g. `location` of a 201) still describe the result.
                headers.extend(result.headers.iter().filter(|(k, _)| !k.eq_ignore_ascii_case("content-type")).cloned());
            }
            headers.push(("idempotent-replayed".to_string(), "true".to_string()));
        }
        ReplyKind::InProgress | ReplyKind::OutcomeUnknown => {
            body.insert("poll_with".into(), ctx.poll_with.or(ctx.own_tool).map_or(Value::Null, Value::from));
            body.insert("poll_after_ms".into(), ctx.poll_after_ms.into());
        }
        ReplyKind::NeedsReview => {
            if let Some(tool) = ctx.poll_with {
                body.insert("poll_with".into(), tool.into());
            }
        }
        ReplyKind::ApprovalRequired | ReplyKind::AwaitingApproval => {
            body.insert("poll_with".into(), ctx.poll_with.or(ctx.own_tool).map_or(Value::Null, Value::from));
            body.insert("poll_after_ms".into(), ctx.poll_after_ms.into());
        }
        _ => {}
    }
    if let Some(facts) = ctx.approval.filter(|_| kind.is_approval()) {
        body.insert("approval".into(), approval_object(kind, &facts));
    }
    if let Some(key) = ctx.operation {
        if matches!(
            kind,
            ReplyKind::InProgress
                | ReplyKind::OutcomeUnknown
                | ReplyKind::NeedsReview
                | ReplyKind::StatusUnavailable
                | ReplyKind::ReplicationRefused
                | ReplyKind::RecordGone
        ) || kind.is_approval()
        {
            body.insert("operation".into(), key.into());
        }
    }
    match kind {
        ReplyKind::NotExecuted | ReplyKind::StatusUnavailable => {
            body.insert("retry_after_ms".into(), ctx.retry_after_ms.into());
            headers.push(("retry-after".to_string(), ctx.retry_after_ms.div_ceil(1000).to_string()));
        }
        ReplyKind::NotYetExecuted => {
            body.insert("fingerprint_expires_at".into(), ctx.fingerprint_expires_at.map_or(Value::Null, Value::from));
        }
        _ => {}
    }
    if let Some(detail) = ctx.detail {
        body.insert("detail".into(), detail.into());
    }

    // Serializing a map of plain values cannot fail.
    let bytes = serde_json::to_vec(&body).unwrap_or_default();
    Reply { http_status: http_status(kind, ctx), headers, body: bytes, facts: Some(Facts { kind, envelope: body }) }
}

/// `approval` in an envelope: the bound fields as JSON, the scope, where a person decides, the
/// deadline and, for a rejection, the reason.
fn approval_object(kind: ReplyKind, facts: &ApprovalFacts) -> Value {
    let mut out = Map::new();
    let fields = serde_json::from_str::<Value>(facts.fields).unwrap_or(Value::Null);
    out.insert("fields".into(), fields);
    out.insert("scope".into(), facts.scope.into());
    if let Some(console) = facts.console {
        out.insert("approve_at".into(), console.into());
    }
    if let Some(at) = facts.expires_at {
        out.insert("expires_at".into(), at.into());
    }
    if kind == ReplyKind::Rejected {
        out.insert("reason".into(), facts.reason.map_or(Value::Null, Value::from));
    }
    Value::Object(out)
}

/// A recorded result replayed as the upstream sent it (the route's `replay:
/// original`): status, recorded headers and body byte for byte, for callers
/// that are programs (Stripe's convention).
pub fn original(result: &StoredResult) -> Reply {
    let mut headers: Vec<(String, String)> =
        result.headers.iter().filter(|(k, _)| !k.eq_ignore_ascii_case("idempotent-replayed")).cloned().collect();
    headers.push(("idempotent-replayed".to_string(), "true".to_string()));
    let status = if (200..=599).contains(&result.status) { result.status } else { 200 };
    Reply::raw(status, headers, decode_body(&result.body_b64).unwrap_or_default())
}

/// Resolve a route's `result_ref` pointer against a recorded body: strings as-is, numbers as their
/// literal, booleans as text; `None` if absent, structured, or the body is not JSON. A replay reads
/// it through `render`'s own parse (`ReplyContext::result_ref_at`); the fuzz harness reads it here.
pub fn result_ref(body: &[u8], pointer: &str) -> Option<String> {
    scalar_at(&serde_json::from_slice(body).ok()?, pointer)
}

fn scalar_at(value: &Value, pointer: &str) -> Option<String> {
    match value.pointer(pointer)? {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

fn http_status(kind: ReplyKind, ctx: &ReplyContext) -> u16 {
    match kind {
        // The query succeeded; `original_status` keeps the upstream's.
        ReplyKind::AlreadyCompleted | ReplyKind::AlreadyFailed | ReplyKind::Rejected if ctx.status_query => 200,
        // A replay answers with the recorded status where it is one.
        ReplyKind::AlreadyCompleted | ReplyKind::AlreadyFailed => {
            ctx.result.map(|r| r.status).filter(|s| (200..=599).contains(s)).unwrap_or(kind.row().http)
        }
        _ => kind.row().http,
    }
}

/// An RFC 9457 problem for callers that are programs (client-key mode with
/// `callers: programs`): the status the IETF draft names, a stable `type` per
/// case, and `Retry-After` where waiting helps.
pub fn problem(kind: ReplyKind, ctx: &ReplyContext) -> Reply {
    let (status, slug, title) = problem_type(kind, ctx);
    let mut body = Map::new();
    body.insert("type".into(), format!("{PROBLEM_BASE}{slug}").into());
    body.insert("title".into(), title.into());
    body.insert("status".into(), status.into());
    if let Some(detail) = ctx.detail {
        body.insert("detail".into(), detail.into());
    }
    if !ctx.trace_id.is_empty() {
        body.insert("trace_id".into(), ctx.trace_id.into());
    }
    let mut headers = vec![
        ("content-type".to_string(), "application/problem+json".to_string()),
        ("cache-control".to_string(), "no-store".to_string()),
    ];
    let wait_ms = match kind {
        ReplyKind::InProgress | ReplyKind::OutcomeUnknown => Some(ctx.poll_after_ms),
        ReplyKind::StatusUnavailable | ReplyKind::NotExecuted => Some(ctx.retry_after_ms),
        _ => None,
    };
    if let Some(ms) = wait_ms {
        headers.push(("retry-after".to_string(), ms.div_ceil(1000).max(1).to_string()));
    }
    let bytes = serde_json::to_vec(&body).unwrap_or_default();
    Reply { http_status: status, headers, body: bytes, facts: Some(Facts { kind, envelope: body }) }
}

/// Every kind's problem: its status, the `type` slug (lower case, hyphens) and a title that is
/// a sentence (the kind's row). Client-key routes name the key; the rest speak of the request.
fn problem_type(kind: ReplyKind, ctx: &ReplyContext) -> (u16, &'static str, &'static str) {
    let row = kind.row();
    (row.problem_status.unwrap_or_else(|| http_status(kind, ctx)), row.slug, row.title)
}

/// The `type` URIs of [`problem`] (`urn:agent-idempotency:problem:idempotency-key-reused`
/// and so on), documented in docs/programs.md. RFC 9457 allows a URI that does not
/// resolve; a URN says so plainly.
pub const PROBLEM_BASE: &str = "urn:agent-idempotency:problem:";

/// The recorded body as the envelope's `result`: its JSON, or its text as a string when it is not
/// JSON; `true` when it was JSON (only there does a `result_ref` pointer resolve).
fn original_body(result: &StoredResult) -> (Value, bool) {
    let Some(bytes) = decode_body(&result.body_b64) else { return (Value::Null, false) };
    if bytes.is_empty() {
        return (Value::Null, false);
    }
    match serde_json::from_slice(&bytes) {
        Ok(value) => (value, true),
        Err(_) => (Value::String(String::from_utf8_lossy(&bytes).into_owned()), false),
    }
}

struct Wording {
    meaning: String,
    instruction: String,
}

/// The variant is chosen once (`say`), then looked up in the language's table.
fn wording(kind: ReplyKind, lang: Language, ctx: &ReplyContext, result_ref: Option<&str>) -> Wording {
    let (meaning, instruction) = say::say(kind, ctx, result_ref);
    match lang {
        Language::En => Wording { meaning: en::meaning(meaning), instruction: en::instruction(instruction) },
        Language::Zh => Wording { meaning: zh::meaning(meaning), instruction: zh::instruction(instruction) },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::encode_body;

    fn json(reply: &Reply) -> Result<Map<String, Value>, serde_json::Error> {
        serde_json::from_slice(&reply.body)
    }

    fn header<'r>(reply: &'r Reply, name: &str) -> Option<&'r str> {
        reply.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    fn stored(status: u16, body: &[u8]) -> StoredResult {
        StoredResult { status, headers: vec![], body_b64: encode_body(body) }
    }

    fn expected_http(kind: ReplyKind) -> u16 {
        match kind {
            ReplyKind::AlreadyCompleted => 201,
            ReplyKind::AlreadyFailed => 402,
            ReplyKind::InProgress | ReplyKind::OutcomeUnknown | ReplyKind::NeedsReview => 202,
            ReplyKind::NotExecuted | ReplyKind::StatusUnavailable | ReplyKind::ReplicationRefused => 503,
            ReplyKind::NotYetExecuted | ReplyKind::AwaitingApproval | ReplyKind::Approved => 200,
            ReplyKind::ParamsChanged => 422,
            ReplyKind::FingerprintExpired | ReplyKind::RecordGone | ReplyKind::ApprovalLapsed => 410,
            ReplyKind::ReferenceInUse => 409,
            ReplyKind::QuoteUnusable => 502,
            ReplyKind::FingerprintInvalid => 400,
            ReplyKind::FingerprintMissing => 428,
            ReplyKind::ApprovalRequired => 202,
            ReplyKind::Forbidden | ReplyKind::Rejected => 403,
            ReplyKind::SubjectMissing => 401,
            ReplyKind::BodyTooLarge => 413,
            ReplyKind::InvalidJson
            | ReplyKind::InvalidField
            | ReplyKind::KeyMissing
            | ReplyKind::KeyInvalid
            | ReplyKind::InvalidHeader
            | ReplyKind::PathNotCanonical => 400,
        }
    }

    #[test]
    fn every_kind_in_every_language_has_the_required_fields() -> Result<(), serde_json::Error> {
        for lang in [Language::En, Language::Zh] {
            for kind in ReplyKind::ALL {
                let result = stored(if kind == ReplyKind::AlreadyFailed { 402 } else { 201 }, br#"{"id":"T-1"}"#);
                let ctx = ReplyContext {
                    trace_id: "trace-123",
                    poll_with: Some("get_transfer_status"),
                    own_tool: None,
                    poll_after_ms: 2000,
                    retry_after_ms: 1500,
                    result: Some(&result),
                    result_ref_at: Some("/id"),
                    fingerprint_expires_at: Some(1_753_500_000),
                    detail: Some("/amount"),
                    operation: Some("0123456789abcdef0123456789abcdef"),
                    status_query: false,
                    approval: Some(ApprovalFacts {
                        fields: r#"{"/amount":"5000"}"#,
                        scope: "payments.transfer",
                        console: Some("https://idemd.example/approvals"),
                        reason: Some("over the limit"),
                        expires_at: Some(1_753_500_000),
                    }),
                };
                let reply = render(kind, lang, &ctx);
                let body = json(&reply)?;
                let label = format!("{kind:?}/{lang:?}");
                assert_eq!(reply.http_status, expected_http(kind), "{label}");
                assert_eq!(body.get("status").and_then(Value::as_str), Some(kind.status()), "{label}");
                for field in ["meaning", "instruction"] {
                    let text = body.get(field).and_then(Value::as_str).unwrap_or_default();
                    assert!(text.chars().count() > 10, "{label}: {field}");
                    if lang == Language::Zh {
                        assert!(text.chars().any(|c| ('\u{4e00}'..='\u{9fff}').contains(&c)), "{label}: {field}");
                    }
                }
                assert!(body.get("retryable").is_some_and(Value::is_boolean), "{label}");
                assert_eq!(body.get("trace_id").and_then(Value::as_str), Some("trace-123"), "{label}");
                assert_eq!(header(&reply, "content-type"), Some("application/json"), "{label}");
                let replayed = matches!(kind, ReplyKind::AlreadyCompleted | ReplyKind::AlreadyFailed);
                assert_eq!(header(&reply, "idempotent-replayed").is_some(), replayed, "{label}");
                let retry_later = matches!(kind, ReplyKind::NotExecuted | ReplyKind::StatusUnavailable);
                assert_eq!(header(&reply, "retry-after").is_some(), retry_later, "{label}");
            }
        }
        Ok(())
    }

    #[test]
    fn status_strings_follow_the_design_table() {
        let names: Vec<&str> = ReplyKind::ALL.iter().map(|k| k.status()).collect();
        assert_eq!(
            names,
            [
                "already_completed",
                "already_failed",
                "in_progress",
                "in_progress",
                "needs_review",
                "not_executed",
                "not_executed",
                "status_unavailable",
                "status_unavailable",
                "params_changed",
                "fingerprint_expired",
                "fingerprint_invalid",
                "fingerprint_missing",
                "forbidden",
                "unauthenticated",
                "body_too_large",
                "invalid_json",
                "invalid_field",
                "idempotency_key_missing",
                "idempotency_key_invalid",
                "invalid_header",
                "path_not_canonical",
                "record_expired",
                "quote_unusable",
                "approval_required",
                "awaiting_approval",
                "approved",
                "rejected",
                "approval_lapsed",
                "reference_in_use"
            ]
        );
    }

    #[test]
    fn replay_carries_the_original_result() -> Result<(), serde_json::Error> {
        let result = stored(201, br#"{"transfer_id":"T-9","amount":"10.00"}"#);
        let ctx = ReplyContext {
            trace_id: "t",
            result: Some(&result),
            result_ref_at: Some("/transfer_id"),
            ..Default::default()
        };
        let reply = render(ReplyKind::AlreadyCompleted, Language::En, &ctx);
        let body = json(&reply)?;
        assert_eq!(reply.http_status, 201);
        assert_eq!(header(&reply, "idempotent-replayed"), Some("true"));
        assert_eq!(body.get("result"), Some(&serde_json::json!({"transfer_id":"T-9","amount":"10.00"})));
        assert_eq!(body.get("result_ref").and_then(Value::as_str), Some("T-9"));
        assert_eq!(body.get("original_status").and_then(Value::as_u64), Some(201));
        assert_eq!(body.get("retryable"), Some(&Value::Bool(false)));
        assert!(body
            .get("instruction")
            .and_then(Value::as_str)
            .is_some_and(|i| i.contains("Do not call") && i.contains("T-9")));
        Ok(())
    }

    /// The route's pointer is resolved in the body the envelope carries (one parse of the
    /// recorded answer), in the instruction and in `result_ref`; a body that is not JSON has
    /// nothing to point into, not even with the whole-document pointer.
    #[test]
    fn the_result_ref_pointer_resolves_in_the_recorded_body() -> Result<(), serde_json::Error> {
        let result = stored(201, br#"{"transfer":{"id":"T-7","seq":12}}"#);
        for (at, want) in [("/transfer/id", Some("T-7")), ("/transfer/seq", Some("12")), ("/transfer", None)] {
            let ctx = ReplyContext { result: Some(&result), result_ref_at: Some(at), ..Default::default() };
            let body = json(&render(ReplyKind::AlreadyCompleted, Language::En, &ctx))?;
            assert_eq!(body.get("result_ref").and_then(Value::as_str), want, "{at}");
            let said = body.get("instruction").and_then(Value::as_str).unwrap_or_default();
            assert_eq!(want.is_some_and(|r| said.contains(r)), want.is_some(), "{at}: {said}");
        }
        let text = stored(402, b"insufficient funds");
        let ctx = ReplyContext { result: Some(&text), result_ref_at: Some(""), ..Default::default() };
        let body = json(&render(ReplyKind::AlreadyFailed, Language::En, &ctx))?;
        assert_eq!(body.get("result_ref"), None);
        assert_eq!(body.get("result").and_then(Value::as_str), Some("insufficient funds"));
        Ok(())
    }

    #[test]
    fn non_json_results_become_strings() -> Result<(), serde_json::Error> {
        let text = stored(402, b"insufficient funds");
        let binary = stored(400, &[0xff, 0xfe, b'x']);
        let empty = stored(404, b"");
        for (result, want) in [
            (&text, Value::from("insufficient funds")),
            (&binary, Value::from("\u{fffd}\u{fffd}x")),
            (&empty, Value::Null),
        ] {
            let ctx = ReplyContext { result: Some(result), ..Default::default() };
            let reply = render(ReplyKind::AlreadyFailed, Language::Zh, &ctx);
            assert_eq!(reply.http_status, result.status);
            assert_eq!(json(&reply)?.get("result"), Some(&want));
        }
        Ok(())
    }

    #[test]
    fn replay_keeps_recorded_headers_but_not_the_content_type() {
        let result = StoredResult {
            status: 201,
            headers: vec![
                ("content-type".into(), "text/plain".into()),
                ("location".into(), "/v1/transfers/T-1".into()),
            ],
            body_b64: encode_body(b"ok"),
        };
        let ctx = ReplyContext { result: Some(&result), ..Default::default() };
        let reply = render(ReplyKind::AlreadyCompleted, Language::En, &ctx);
        assert_eq!(header(&reply, "content-type"), Some("application/json"));
        assert_eq!(reply.headers.iter().filter(|(k, _)| k == "content-type").count(), 1);
        assert_eq!(header(&reply, "location"), Some("/v1/transfers/T-1"));
    }

    #[test]
    fn unreadable_stored_body_is_null() -> Result<(), serde_json::Error> {
        let broken = StoredResult { status: 200, headers: vec![], body_b64: "!!".into() };
        let ctx = ReplyContext { result: Some(&broken), ..Default::default() };
        assert_eq!(json(&render(ReplyKind::AlreadyCompleted, Language::En, &ctx))?.get("result"), Some(&Value::Null));
        Ok(())
    }

    #[test]
    fn replay_status_falls_back_when_unusable() {
        let odd = stored(101, b"");
        let ctx = ReplyContext { result: Some(&odd), ..Default::default() };
        assert_eq!(render(ReplyKind::AlreadyCompleted, Language::En, &ctx).http_status, 200);
        assert_eq!(render(ReplyKind::AlreadyFailed, Language::En, &ReplyContext::default()).http_status, 409);
    }

    #[test]
    fn in_progress_says_where_to_poll() -> Result<(), serde_json::Error> {
        let ctx = ReplyContext { poll_with: Some("get_status"), poll_after_ms: 2000, ..Default::default() };
        let body = json(&render(ReplyKind::InProgress, Language::Zh, &ctx))?;
        assert_eq!(body.get("poll_with").and_then(Value::as_str), Some("get_status"));
        assert_eq!(body.get("poll_after_ms").and_then(Value::as_u64), Some(2000));
        assert_eq!(body.get("retryable"), Some(&Value::Bool(false)));
        let instruction = body.get("instruction").and_then(Value::as_str).unwrap_or_default();
        assert!(instruction.contains("2 秒") && instruction.contains("get_status"), "{instruction}");

        let alone = json(&render(
            ReplyKind::InProgress,
            Language::En,
            &ReplyContext { poll_after_ms: 1500, ..Default::default() },
        ))?;
        assert_eq!(alone.get("poll_with"), Some(&Value::Null));
        assert_eq!(alone.get("retryable"), Some(&Value::Bool(false)), "in flight says do not re-issue");
        let own = json(&render(
            ReplyKind::InProgress,
            Language::En,
            &ReplyContext { own_tool: Some("pay"), ..Default::default() },
        ))?;
        assert_eq!(
            (own.get("poll_with"), own.get("retryable")),
            (Some(&Value::from("pay")), Some(&Value::Bool(false)))
        );
        assert!(own.get("instruction").and_then(Value::as_str).is_some_and(|i| i.contains("same fingerprint")));
        assert!(alone.get("instruction").and_then(Value::as_str).is_some_and(|i| i.contains("1500 ms")));
        Ok(())
    }

    #[test]
    fn not_executed_sets_retry_after_in_whole_seconds() -> Result<(), serde_json::Error> {
        for (ms, secs) in [(1000, "1"), (1001, "2"), (1500, "2"), (0, "0"), (60_000, "60")] {
            let ctx = ReplyContext { retry_after_ms: ms, ..Default::default() };
            let reply = render(ReplyKind::NotExecuted, Language::En, &ctx);
            assert_eq!(reply.http_status, 503);
            assert_eq!(header(&reply, "retry-after"), Some(secs), "{ms}");
            let body = json(&reply)?;
            assert_eq!(body.get("retry_after_ms").and_then(Value::as_u64), Some(ms));
            assert_eq!(body.get("retryable"), Some(&Value::Bool(true)));
        }
        Ok(())
    }

    #[test]
    fn not_yet_executed_gives_the_deadline() -> Result<(), serde_json::Error> {
        let ctx = ReplyContext { fingerprint_expires_at: Some(1_753_500_000), ..Default::default() };
        for lang in [Language::En, Language::Zh] {
            let reply = render(ReplyKind::NotYetExecuted, lang, &ctx);
            assert_eq!(reply.http_status, 200);
            let body = json(&reply)?;
            assert_eq!(body.get("status").and_then(Value::as_str), Some("not_executed"));
            assert_eq!(body.get("fingerprint_expires_at").and_then(Value::as_u64), Some(1_753_500_000));
            let instruction = body.get("instruction").and_then(Value::as_str).unwrap_or_default();
            assert!(instruction.contains("2025-07-26T03:20:00Z"), "{instruction}");
        }
        Ok(())
    }

    #[test]
    fn invalid_field_names_the_field() -> Result<(), serde_json::Error> {
        let ctx = ReplyContext { detail: Some("/amount: expected a decimal"), ..Default::default() };
        let body = json(&render(ReplyKind::InvalidField, Language::En, &ctx))?;
        assert_eq!(body.get("detail").and_then(Value::as_str), Some("/amount: expected a decimal"));
        assert!(body.get("meaning").and_then(Value::as_str).is_some_and(|m| m.contains("/amount")));
        Ok(())
    }

    #[test]
    fn refusals_are_not_retryable_and_say_what_to_do() -> Result<(), serde_json::Error> {
        for kind in ReplyKind::ALL {
            for lang in [Language::En, Language::Zh] {
                let body = json(&render(kind, lang, &ReplyContext { poll_with: Some("s"), ..Default::default() }))?;
                let retryable = body.get("retryable").and_then(Value::as_bool);
                let retry_later =
                    matches!(kind, ReplyKind::NotExecuted | ReplyKind::StatusUnavailable | ReplyKind::QuoteUnusable);
                assert_eq!(retryable, Some(retry_later), "{kind:?}");
                let instruction = body.get("instruction").and_then(Value::as_str).unwrap_or_default();
                let names_next_step = [
                    "preview", "Do not", "call", "Tell", "Send", "Correct", "预览", "不要", "调用", "告诉", "发送",
                    "修正",
                ]
                .iter()
                .any(|word| instruction.contains(word));
                assert!(names_next_step, "{kind:?}/{lang:?}: {instruction}");
            }
        }
        Ok(())
    }

    #[test]
    fn result_ref_resolves_scalars() {
        let body = br#"{"transfer":{"id":"T-1","seq":12.50,"ok":true,"items":[1]}}"#;
        assert_eq!(result_ref(body, "/transfer/id").as_deref(), Some("T-1"));
        assert_eq!(result_ref(body, "/transfer/seq").as_deref(), Some("12.50"));
        assert_eq!(result_ref(body, "/transfer/ok").as_deref(), Some("true"));
        assert_eq!(result_ref(body, "/transfer/items"), None);
        assert_eq!(result_ref(body, "/missing"), None);
        assert_eq!(result_ref(b"not json", "/id"), None);
    }

    #[test]
    fn dates() {
        assert_eq!(crate::utc::iso_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(crate::utc::iso_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(crate::utc::iso_utc(1_753_500_000), "2025-07-26T03:20:00Z");
        assert_eq!(crate::utc::iso_utc(4_102_444_799), "2099-12-31T23:59:59Z");
    }

    #[test]
    fn a_status_query_reports_the_outcome_instead_of_a_duplicate() -> Result<(), serde_json::Error> {
        let result = stored(201, br#"{"transfer_id":"t_1"}"#);
        for lang in [Language::En, Language::Zh] {
            let ctx = ReplyContext { result: Some(&result), status_query: true, ..Default::default() };
            let reply = render(ReplyKind::AlreadyCompleted, lang, &ctx);
            assert_eq!(reply.http_status, 200, "the query itself succeeded");
            let body = json(&reply)?;
            assert_eq!(body["status"], "already_completed");
            assert_eq!(body["original_status"], 201);
            let meaning = body["meaning"].as_str().unwrap_or_default();
            assert!(!meaning.contains("duplicate") && !meaning.contains("重复"), "{meaning}");
        }
        Ok(())
    }

    /// DESIGN §3/§7: a reply may claim the *operation* did not run only where
    /// that is known (released; expired and never started). Every other
    /// refusal speaks about *this call*, because an earlier call with the same
    /// fingerprint may have executed it.
    #[test]
    fn only_provable_replies_say_nothing_ran() {
        // An approval's record is the proof: nothing runs before APPROVED, and a rejected or
        // lapsed one never runs.
        let about_operation = [
            ReplyKind::NotExecuted,
            ReplyKind::FingerprintExpired,
            ReplyKind::ApprovalRequired,
            ReplyKind::AwaitingApproval,
            ReplyKind::Approved,
            ReplyKind::Rejected,
            ReplyKind::ApprovalLapsed,
        ];
        for kind in ReplyKind::ALL {
            for status_query in [false, true] {
                let ctx = ReplyContext { status_query, ..Default::default() };
                let en = wording(kind, Language::En, &ctx, None).meaning.to_lowercase();
                let zh = wording(kind, Language::Zh, &ctx, None).meaning;
                let claims_en = en.contains("nothing was executed") || en.contains("was not executed");
                let claims_zh = zh.contains("什么都没有") || zh.contains("没有被执行");
                if about_operation.contains(&kind) {
                    assert!(claims_en && claims_zh, "{kind:?} must say plainly that nothing ran: {en} / {zh}");
                } else {
                    assert!(!claims_en, "{kind:?} (status_query={status_query}) claims nothing ran: {en}");
                    assert!(!claims_zh, "{kind:?} (status_query={status_query}) claims nothing ran: {zh}");
                }
            }
        }
    }

    #[test]
    fn unchecked_confirm_points_to_the_status_tool_and_the_operation() -> Result<(), serde_json::Error> {
        let ctx = ReplyContext {
            retry_after_ms: 2000,
            poll_with: Some("get_transfer_status"),
            operation: Some("0123456789abcdef0123456789abcdef"),
            ..Default::default()
        };
        let reply = render(ReplyKind::StatusUnavailable, Language::En, &ctx);
        let body = json(&reply)?;
        assert_eq!(reply.http_status, 503);
        assert_eq!(body.get("retryable"), Some(&Value::Bool(true)));
        assert_eq!(body.get("operation").and_then(Value::as_str), Some("0123456789abcdef0123456789abcdef"));
        let instruction = body.get("instruction").and_then(Value::as_str).unwrap_or_default();
        assert!(instruction.contains("get_transfer_status"), "{instruction}");
        assert!(instruction.contains("Do not tell the user it was not done"), "{instruction}");
        assert_eq!(header(&reply, "retry-after"), Some("2"));
        Ok(())
    }

    #[test]
    fn original_replay_is_byte_for_byte() {
        let result = StoredResult {
            status: 201,
            headers: vec![("content-type".into(), "text/plain".into()), ("location".into(), "/t/1".into())],
            body_b64: encode_body(b"created \x00 exactly"),
        };
        let reply = original(&result);
        assert_eq!(reply.http_status, 201);
        assert_eq!(reply.body, b"created \x00 exactly");
        assert_eq!(header(&reply, "content-type"), Some("text/plain"));
        assert_eq!(header(&reply, "location"), Some("/t/1"));
        assert_eq!(header(&reply, "idempotent-replayed"), Some("true"));
    }
}
