//! The HTTP API the filter calls (JSON over HTTP/1.1, keep-alive).
//!
//! | route                        | answers                                                        |
//! |------------------------------|----------------------------------------------------------------|
//! | `POST /v1/acquire`           | 200 any state outcome; 503 `STORE_UNAVAILABLE`; 400 bad input   |
//! | `POST /v1/complete`          | 200 `OK`/`NOT_OWNER`; 503 `STORE_UNAVAILABLE`; 400 bad input    |
//! | `POST /v1/release`           | 200 `OK`/`NOT_OWNER`; 503 `STORE_UNAVAILABLE`; 400 bad input    |
//! | `POST /v1/renew`             | 200 `{"lost":[keys]}`; 503 `STORE_UNAVAILABLE`; 400 bad input   |
//! | `GET /v1/operations/{key}`   | 200 `OperationView`; 404 `NotFoundView` (below); 503; 400       |
//! | `POST /v1/security-events`   | 202 `OK` (written to the audit); 503 `STORE_UNAVAILABLE`; 400   |
//! | any `/v1/*` without a token  | 401 `{"error":"unauthorized"}`; nothing read or changed         |
//! | `/v1/approvals…`             | an approver's credential, not the filter's (`crate::approvals`) |
//! | `GET /healthz`               | 200 ok/degraded, 503 when SQL is down or a standby; each store's |
//! |                              | state and the SQL replication (`store::sql::replication`)            |
//! | `GET /metrics`               | Prometheus (OpenMetrics text)                                   |
//!
//! `GET /v1/operations/{key}?exp=<unix s>`: the filter names the fingerprint's
//! `exp` (absent for client keys). With no row the 404 is
//! `{"error":"not_found","reaped_possible":<bool>}`: `true` once
//! `now >= exp + retention`, when a row for that fingerprint could have been
//! kept and reaped, so "never started" is no longer known; `false` without
//! `exp` or before that moment (a fingerprint's row is never reaped earlier).
//!
//! `POST /v1/security-events` takes a `SecurityEventReport` the filter sends
//! without waiting for the answer (DESIGN §8): counted in
//! `idem_security_events_total{kind}` and written as one `idem_audit` line
//! (action `security_event`), within the SQL timeout. 503 when it could not
//! be written; the filter ignores every answer.
//!
//! Every trace id the filter sends (a report's, an acquire's, …) is the client's `x-request-id`:
//! it is stored and logged in a safe form (`safe_trace_id`) and never refused, so no value a client
//! picks can keep a call, least of all a security event, out of the audit.
//!
//! `POST /v1/renew` carries every lease one filter instance holds for requests
//! still upstream (DESIGN §4); each is extended if its owner still holds it,
//! and `lost` names those it no longer does. Not audited: nothing changes state.
//!
//! Inputs are validated here, before any store sees them, so a malformed
//! value is a 400 for the caller and never a database error that would be
//! mistaken for an outage.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, MatchedPath, Path, RawQuery, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idem_core::protocol::{
    Ack, AcquireOutcome, AcquireRequest, CompleteRequest, ReleaseRequest, RenewRequest, SecurityEventReport,
    SecurityKind,
};
use serde::de::DeserializeOwned;
use serde_json::json;
use tracing::Instrument;

use crate::approvals::{self, ApprovalsState, Approvers};
use crate::auth::{require_token, AuthState, Tokens};
use crate::reconcile::Lookups;
use crate::store::flow::write::Lookup;
use crate::store::sql::audit::{SecurityEvent, MAX_SCOPE, MAX_SUBJECT_HASH, MAX_TRACE_ID};
use crate::store::Store;

/// The largest request body: a complete carries one stored result.
pub const MAX_BODY_BYTES: usize = crate::store::record::MAX_RESULT_BYTES;

/// The longest lease a route may ask for (and what keeps `now + lease` in i64).
pub const MAX_LEASE_MS: u64 = 30 * 24 * 3600 * 1000;

/// Leases one renewal may carry: one filter instance's requests upstream at once.
pub const MAX_RENEWALS: usize = 10_000;

/// A security event report is a few short fields.
pub const MAX_EVENT_BYTES: usize = 4 * 1024;

/// The latest fingerprint `exp` accepted (unix seconds, the year 9999): keeps
/// `exp` in i64 milliseconds.
pub const MAX_EXP_S: u64 = 253_402_300_799;

/// The API; `/v1/*` answers only callers with one of `tokens` (see `auth`). No approvers: the
/// approval routes answer 401 to everyone.
pub fn router(store: Arc<Store>, tokens: Tokens) -> Router {
    router_with(store, tokens, Approvers::default(), None)
}

/// The API with the approval routes (`crate::approvals`) behind the approvers' own credentials;
/// `lookups`: the scopes' status endpoints, which a person's release asks at that moment
/// (`review`; none configured: a release rests on the person's word).
pub fn router_with(store: Arc<Store>, tokens: Tokens, approvers: Approvers, lookups: Option<Lookups>) -> Router {
    let approvals = ApprovalsState {
        approvers: Arc::new(approvers),
        store: Arc::clone(&store),
        csrf: Arc::new(approvals::CsrfKey::random()),
        lookups: lookups.map(Arc::new),
    };
    let approving = Router::new()
        .route("/v1/approvals", get(approvals::pending))
        .route("/v1/approvals/{key}", post(approvals::decide))
        .route("/approvals", get(crate::console::page))
        .route("/approvals/{key}", post(crate::console::decide))
        .route("/approvals/review/{key}", post(crate::console::resolve))
        .route_layer(axum::middleware::from_fn_with_state(approvals.clone(), approvals::require_approver))
        .route_layer(axum::middleware::from_fn(traced))
        .with_state(approvals);
    let auth = AuthState { tokens: Arc::new(tokens), store: Arc::clone(&store) };
    let guarded = Router::new()
        .route("/v1/acquire", post(acquire))
        .route("/v1/complete", post(complete))
        .route("/v1/release", post(release))
        .route("/v1/renew", post(renew))
        .route("/v1/operations/{key}", get(operation))
        .route("/v1/security-events", post(security_event))
        .route_layer(axum::middleware::from_fn_with_state(auth, require_token))
        // Outermost: a refused call is traced too.
        .route_layer(axum::middleware::from_fn(traced));
    Router::new()
        .merge(guarded)
        .merge(approving)
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(store)
}

async fn acquire(State(store): State<Arc<Store>>, body: Bytes) -> Answer {
    let mut req: AcquireRequest = parse(&body)?;
    req.trace_id = safe_trace_id(&req.trace_id);
    check_acquire(&req)?;
    let answer = store.acquire_answer(&req).await;
    let status = match answer.answer.outcome {
        AcquireOutcome::StoreUnavailable | AcquireOutcome::ReplicationRefused => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::OK,
    };
    Ok((status, Json(answer)).into_response())
}

async fn complete(State(store): State<Arc<Store>>, body: Bytes) -> Answer {
    let mut req: CompleteRequest = parse(&body)?;
    req.trace_id = safe_trace_id(&req.trace_id);
    // key and owner were checked by their types (idem_core::protocol::OpKey, OwnerToken) while parsing.
    let answer = store.complete(&req).await;
    Ok((ack_status(answer.outcome), Json(answer)).into_response())
}

async fn release(State(store): State<Arc<Store>>, body: Bytes) -> Answer {
    let mut req: ReleaseRequest = parse(&body)?;
    req.trace_id = safe_trace_id(&req.trace_id);
    // key and owner were checked by their types (idem_core::protocol::OpKey, OwnerToken) while parsing.
    let answer = store.release(&req).await;
    Ok((ack_status(answer.outcome), Json(answer)).into_response())
}

async fn renew(State(store): State<Arc<Store>>, body: Bytes) -> Answer {
    let req: RenewRequest = parse(&body)?;
    if let Some(l) = req.leases.iter().find(|l| l.lease_ms > MAX_LEASE_MS) {
        return Err(Refused::BadRequest(format!("{}: lease_ms must be at most {MAX_LEASE_MS}", l.key)));
    }
    if req.leases.len() > MAX_RENEWALS {
        return Err(Refused::BadRequest(format!("at most {MAX_RENEWALS} leases per renewal")));
    }
    match store.renew(&req).await {
        Ok(answer) => Ok((StatusCode::OK, Json(answer)).into_response()),
        Err(e) => {
            tracing::warn!(error = %e, "SQL renew failed: STORE_UNAVAILABLE");
            Err(Refused::Unavailable(json!({"error": "STORE_UNAVAILABLE"})))
        }
    }
}

async fn operation(State(store): State<Arc<Store>>, Path(key): Path<String>, RawQuery(query): RawQuery) -> Answer {
    check_key("key", &key)?;
    let exp = lookup_exp(query.as_deref())?;
    match store.lookup(&key, exp).await {
        Lookup::Found(view) => Ok((StatusCode::OK, Json(view)).into_response()),
        Lookup::NotFound(body) => Ok((StatusCode::NOT_FOUND, Json(body)).into_response()),
        Lookup::Unavailable => Err(Refused::Unavailable(json!({"error": "store_unavailable"}))),
    }
}

async fn security_event(State(store): State<Arc<Store>>, body: Bytes) -> Answer {
    if body.len() > MAX_EVENT_BYTES {
        return Err(Refused::BadRequest(format!("a security event report is at most {MAX_EVENT_BYTES} bytes")));
    }
    let report: SecurityEventReport = parse(&body)?;
    check_event(&report)?;
    // The client's `x-request-id`, as the filter passed it on: never a reason to refuse.
    let trace_id = safe_trace_id(&report.trace_id);
    tracing::warn!(
        kind = report.kind.as_str(),
        scope = %report.scope,
        key = report.key.as_ref().map(|k| k.as_str()).unwrap_or("-"),
        trace_id = %trace_id,
        security_event = report.kind.as_str(),
        "security event reported by the filter"
    );
    let event = SecurityEvent {
        actor: "filter",
        kind: report.kind,
        why: event_why(report.kind, &report.scope),
        scope: report.scope,
        key: report.key.map(|k| k.to_string()),
        subject_hash: report.subject_hash,
        trace_id,
    };
    // The write goes on in its own task even if the filter has gone away.
    match store.security_event(event).await {
        Ok(true) => Ok((StatusCode::ACCEPTED, Json(json!({"outcome": "OK"}))).into_response()),
        _ => Err(Refused::Unavailable(json!({"outcome": "STORE_UNAVAILABLE"}))),
    }
}

/// The audit line's words: the kind and the scope, never a secret or a value.
fn event_why(kind: SecurityKind, scope: &str) -> String {
    let what = match kind {
        SecurityKind::ParamsChanged => "the bound parameters differ from those the fingerprint was issued for",
        SecurityKind::CrossSubject => "a fingerprint issued to another subject was presented",
        SecurityKind::BadSignature => "a fingerprint whose signature does not verify (forged or altered)",
        SecurityKind::UnknownKid => "a fingerprint signed with a key id the gateway does not know",
    };
    format!("{} on scope {scope}: {what}; refused by the filter", kind.as_str())
}

/// The filter's own words (the route's scope, the hash it computed) are checked; the trace id is
/// not: it is whatever the client put in `x-request-id`, so it is made safe, never a reason to drop
/// the event (`safe_trace_id`).
fn check_event(r: &SecurityEventReport) -> Result<(), String> {
    check_field("scope", &r.scope, MAX_SCOPE, true)?;
    check_field("subject_hash", &r.subject_hash, MAX_SUBJECT_HASH, false)?;
    // The key was checked by its type (idem_core::protocol::OpKey) while parsing.
    Ok(())
}

/// A trace id as idemd's log lines and audit keep it: the filter's rule (`idem_core::trace::safe_id`),
/// applied again because any caller may send any text, and a client-chosen value must never decide
/// whether a call is recorded (a space in it once made idemd refuse a security event's report, and
/// the forgery left no trace). The filter's safe form passes unchanged.
pub fn safe_trace_id(raw: &str) -> String {
    idem_core::trace::safe_id(raw, MAX_TRACE_ID)
}

async fn healthz(State(store): State<Arc<Store>>) -> Response {
    use crate::store::sql::replication::Mode;
    let h = store.health().await;
    // What the database promises across a failover, read now (as the probe does), and what idemd
    // therefore refuses (DESIGN §4, "The truth never goes back in time").
    let replication = if h.sql == "up" { store.refresh_replication().await } else { store.sql().replication() };
    // Redis down is degraded, not down: SQL alone keeps every answer exact. A standby takes no write:
    // every acquire is refused, as with SQL down.
    let (status, word) = match (h.sql, h.redis, replication.mode) {
        ("up", _, Mode::Standby) => (StatusCode::SERVICE_UNAVAILABLE, "down"),
        ("up", "down", _) => (StatusCode::OK, "degraded"),
        ("up", _, _) => (StatusCode::OK, "ok"),
        _ => (StatusCode::SERVICE_UNAVAILABLE, "down"),
    };
    let refuses = match replication.mode {
        Mode::Single | Mode::Sync | Mode::IdemdWaits => "nothing",
        Mode::Standby => "every acquire",
        Mode::Async | Mode::Unknown if store.accepts_async_failover_risk() => "nothing (risk accepted)",
        Mode::Async | Mode::Unknown => "acquires for upstreams that ignore keys",
    };
    let detail = json!({
        "mode": replication.mode.as_str(),
        "standbys": replication.standbys,
        "sync_standbys": replication.sync_standbys,
        "detail": replication.detail,
        "async_failover_risk_accepted": store.accepts_async_failover_risk(),
        "refuses": refuses,
    });
    (status, Json(json!({"status": word, "redis": h.redis, "sql": h.sql, "replication": detail}))).into_response()
}

async fn metrics(State(store): State<Arc<Store>>) -> Response {
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], store.metrics().encode())
        .into_response()
}

fn ack_status(a: Ack) -> StatusCode {
    match a {
        Ack::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
        Ack::Ok | Ack::NotOwner => StatusCode::OK,
    }
}

/// Any body that is not the expected JSON is the caller's mistake: 400, with
/// serde's words for what was wrong. (axum's `Json` would answer 415 or 422
/// for some of these.)
fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, String> {
    serde_json::from_slice(body).map_err(|e| format!("invalid JSON: {e}"))
}

/// A `/v1/*` call refused: the caller's mistake (400, with the reason; nothing was done), or a store that
/// cannot answer now (503, with the body that endpoint's callers read for it; nothing is known to be done).
#[derive(Debug)]
enum Refused {
    BadRequest(String),
    Unavailable(serde_json::Value),
}

/// The checks and the parser say why in words: each is a bad request.
impl From<String> for Refused {
    fn from(why: String) -> Self {
        Refused::BadRequest(why)
    }
}

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        match self {
            Refused::BadRequest(detail) => {
                (StatusCode::BAD_REQUEST, Json(json!({"error": "bad_request", "detail": detail}))).into_response()
            }
            Refused::Unavailable(body) => (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response(),
        }
    }
}

/// What a `/v1/*` handler answers.
type Answer = Result<Response, Refused>;

/// Every `/v1/*` call in one span (DESIGN §8): a child of the caller's trace
/// context (the filter's `traceparent`) when traces are exported, the parent
/// of each store call's span, and around every log line of the call with the
/// filter's trace id, so a PARAM_MISMATCH warning can be found next to the
/// Envoy access log line.
async fn traced(path: Option<MatchedPath>, request: Request, next: Next) -> Response {
    let span = request_span(path.as_ref().map_or("", MatchedPath::as_str), request.headers());
    let response = next.run(request).instrument(span.clone()).await;
    let status = response.status();
    span.record("http.response.status_code", status.as_u16());
    if status.is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
    response
}

fn request_span(route: &str, headers: &HeaderMap) -> tracing::Span {
    let (op, name) = match route {
        "/v1/acquire" => ("acquire", "idemd acquire"),
        "/v1/complete" => ("complete", "idemd complete"),
        "/v1/release" => ("release", "idemd release"),
        "/v1/renew" => ("renew", "idemd renew"),
        "/v1/operations/{key}" => ("operation", "idemd operation"),
        "/v1/security-events" => ("security_event", "idemd security-event"),
        _ => ("other", "idemd"),
    };
    // The same form as the audit's (`safe_trace_id`), whatever bytes the header holds.
    let trace_id = headers
        .get("x-request-id")
        .or_else(|| headers.get("traceparent"))
        .map_or_else(|| "-".to_string(), |v| safe_trace_id(&String::from_utf8_lossy(v.as_bytes())));
    let trace_id = trace_id.as_str();
    let span = tracing::info_span!(
        "request",
        op,
        trace_id,
        otel.name = name,
        otel.kind = "server",
        http.route = route,
        http.response.status_code = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    crate::telemetry::continue_trace(&span, headers);
    span
}

/// Nonces and owner tokens: 128 bits as 32 lowercase hex chars.
pub fn is_token(s: &str) -> bool {
    idem_core::protocol::is_hex_token(s)
}

fn check_key(name: &str, value: &str) -> Result<(), String> {
    if is_token(value) {
        Ok(())
    } else {
        Err(format!("{name} must be 32 lowercase hex characters"))
    }
}

/// Hashes and scopes are stored in columns of bounded width and compared
/// byte for byte: printable ASCII only, so no database collation or encoding
/// can make two different values equal.
fn check_field(name: &str, value: &str, max: usize, may_be_empty: bool) -> Result<(), String> {
    if value.is_empty() && !may_be_empty {
        return Err(format!("{name} must not be empty"));
    }
    if value.len() > max {
        return Err(format!("{name} must be at most {max} characters"));
    }
    if !value.bytes().all(|c| c.is_ascii_graphic()) {
        return Err(format!("{name} must be printable ASCII without spaces"));
    }
    Ok(())
}

/// The fingerprint's `exp` a lookup names (`?exp=<unix seconds>`); other
/// parameters are ignored.
fn lookup_exp(query: Option<&str>) -> Result<Option<u64>, String> {
    let mut exp = None;
    for (name, value) in query.unwrap_or("").split('&').filter_map(|p| p.split_once('=')) {
        if name == "exp" {
            match value.parse::<u64>() {
                Ok(v) if v <= MAX_EXP_S => exp = Some(v),
                _ => return Err(format!("exp must be unix seconds, at most {MAX_EXP_S}")),
            }
        }
    }
    Ok(exp)
}

fn check_acquire(req: &AcquireRequest) -> Result<(), String> {
    check_field("param_hash", &req.param_hash, 128, false)?;
    check_field("subject_hash", &req.subject_hash, 128, false)?;
    check_field("scope", &req.scope, 255, true)?;
    if req.lease_ms > MAX_LEASE_MS {
        return Err(format!("lease_ms must be at most {MAX_LEASE_MS}"));
    }
    if req.exp.is_some_and(|exp| exp > MAX_EXP_S) {
        return Err(format!("exp must be unix seconds, at most {MAX_EXP_S}"));
    }
    if let Some(r) = &req.business_ref {
        check_business_ref(r)?;
    }
    if let Some(fields) = &req.fields {
        check_fields(fields, &req.param_hash)?;
    }
    if let Some(a) = &req.approval {
        // An approval lapses at the fingerprint's exp: a client key has none.
        if req.exp.is_none() {
            return Err("approval needs the fingerprint's exp".into());
        }
        if a.fields.len() > MAX_APPROVAL_FIELDS || serde_json::from_str::<serde_json::Value>(&a.fields).is_err() {
            return Err(format!("approval.fields must be JSON of at most {MAX_APPROVAL_FIELDS} bytes"));
        }
    }
    Ok(())
}

/// The canonical bound fields an approver sees: a few values, never a body.
pub const MAX_APPROVAL_FIELDS: usize = 16 * 1024;

/// The bound fields sent beside a business reference: a JSON object of at most
/// [`MAX_APPROVAL_FIELDS`] bytes whose SHA-256 is the operation's `param_hash`, i.e. exactly what
/// the fingerprint covers (a record found under the reference is held against them).
fn check_fields(fields: &str, param_hash: &str) -> Result<(), String> {
    use sha2::Digest as _;
    if fields.len() > MAX_APPROVAL_FIELDS
        || !serde_json::from_str::<serde_json::Value>(fields).is_ok_and(|v| v.is_object())
    {
        return Err(format!("fields must be a JSON object of at most {MAX_APPROVAL_FIELDS} bytes"));
    }
    if hex::encode(sha2::Sha256::digest(fields.as_bytes())) != param_hash {
        return Err("fields are not what param_hash covers (its SHA-256 must be param_hash)".into());
    }
    Ok(())
}

/// What `idem_record.business_ref` holds (VARCHAR(256)). Any printable text: a client reference
/// is the upstream's, not ours to restrict further; the reconciler percent-encodes it into a URL.
/// Empty is refused: it names nothing the upstream could look up.
fn check_business_ref(r: &str) -> Result<(), String> {
    if r.is_empty() {
        return Err("business_ref must not be empty (omit it where the route names none)".into());
    }
    if r.chars().count() > MAX_BUSINESS_REF_CHARS {
        return Err(format!("business_ref must be at most {MAX_BUSINESS_REF_CHARS} characters"));
    }
    if r.chars().any(char::is_control) {
        return Err("business_ref must not contain control characters".into());
    }
    Ok(())
}

/// The column's size (migration 0006); the filter sends at most 256 bytes.
pub const MAX_BUSINESS_REF_CHARS: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_exactly_32_lowercase_hex() {
        assert!(is_token("0123456789abcdef0123456789abcdef"));
        assert!(!is_token("0123456789ABCDEF0123456789abcdef"));
        assert!(!is_token("0123456789abcdef0123456789abcde"));
        assert!(!is_token("0123456789abcdef0123456789abcdeg"));
    }

    #[test]
    fn acquire_fields_are_bounded() {
        let ok = AcquireRequest {
            key: idem_core::protocol::OpKey::parse("0123456789abcdef0123456789abcdef").unwrap(),
            param_hash: "a".repeat(64),
            subject_hash: "b".repeat(32),
            scope: "payments.transfer".into(),
            lease_ms: 1,
            trace_id: String::new(),
            mode: Default::default(),
            exp: None,
            upstream_ignores_keys: false,
            business_ref: None,
            fields: None,
            approval: None,
        };
        assert_eq!(check_acquire(&ok), Ok(()));
        assert!(check_acquire(&AcquireRequest { param_hash: String::new(), ..ok.clone() }).is_err());
        assert!(check_acquire(&AcquireRequest { scope: "a b".into(), ..ok.clone() }).is_err());
        assert!(check_acquire(&AcquireRequest { scope: "é".into(), ..ok.clone() }).is_err());
        assert!(check_acquire(&AcquireRequest { scope: "x".repeat(256), ..ok.clone() }).is_err());
        assert!(check_acquire(&AcquireRequest { lease_ms: MAX_LEASE_MS + 1, ..ok.clone() }).is_err());
        assert_eq!(check_acquire(&AcquireRequest { exp: Some(MAX_EXP_S), ..ok.clone() }), Ok(()));
        assert!(check_acquire(&AcquireRequest { exp: Some(MAX_EXP_S + 1), ..ok.clone() }).is_err());
        let with_ref = |r: &str| AcquireRequest { business_ref: Some(r.to_string()), ..ok.clone() };
        assert_eq!(check_acquire(&with_ref("inv-2026/07 Müller & Co")), Ok(()), "printable text, spaces too");
        assert_eq!(check_acquire(&with_ref(&"é".repeat(256))), Ok(()), "256 characters, not bytes");
        for (bad, says) in [
            ("", "must not be empty"),
            (&"x".repeat(257) as &str, "at most 256 characters"),
            ("a\nb", "control characters"),
            ("a\u{7f}", "control characters"),
        ] {
            let err = check_acquire(&with_ref(bad)).unwrap_err();
            assert!(err.starts_with("business_ref") && err.contains(says), "{bad:?}: {err}");
        }
        // The bound fields beside a reference are exactly what param_hash covers.
        let fields = r#"{"/amount":10,"/ref":"inv-7"}"#;
        use sha2::Digest as _;
        let hash = hex::encode(sha2::Sha256::digest(fields.as_bytes()));
        let with_fields =
            |f: &str, p: &str| AcquireRequest { fields: Some(f.into()), param_hash: p.into(), ..ok.clone() };
        assert_eq!(check_acquire(&with_fields(fields, &hash)), Ok(()));
        for (f, p, says) in [
            (fields, "a".repeat(64), "not what param_hash covers"),
            (r#"{"/amount":11,"/ref":"inv-7"}"#, hash.clone(), "not what param_hash covers"),
            ("[1]", hash.clone(), "a JSON object"),
            ("not json", hash.clone(), "a JSON object"),
        ] {
            let err = check_acquire(&with_fields(f, &p)).unwrap_err();
            assert!(err.starts_with("fields") && err.contains(says), "{f}: {err}");
        }
    }

    #[test]
    fn trace_ids_are_kept_safe_never_refused() {
        // What Envoy, tracers and the tests make stays as it is.
        for same in ["", "4bf92f3577b34da6a3ce929d0e0e4736", "f81d4fae-7dec-11d0-a765-00a0c91e6bf6", "sec-a1.b_c~d"] {
            assert_eq!(safe_trace_id(same), same);
        }
        assert_eq!(safe_trace_id("odd id"), "odd%20id");
        assert_eq!(safe_trace_id("café"), "caf%C3%A9");
        assert_eq!(safe_trace_id("100%"), "100%25", "% itself, so every escape reads back");
        assert_eq!(safe_trace_id("a\nb\u{0}"), "a%0Ab%00");
        assert_eq!(safe_trace_id("t-1 security_event=none\r\nFAKE"), "t-1%20security_event=none%0D%0AFAKE");
        assert_eq!(safe_trace_id("\u{fffd}"), "%EF%BF%BD", "what a lossy read of a non-UTF-8 byte gives");
        // Cut to the column at a whole character.
        assert_eq!(safe_trace_id(&"x".repeat(500)), "x".repeat(MAX_TRACE_ID));
        let cut = safe_trace_id(&"é".repeat(100));
        assert_eq!(cut, "%C3%A9".repeat(MAX_TRACE_ID / 6));
        let cut = safe_trace_id(&format!("{}é", "x".repeat(MAX_TRACE_ID - 4)));
        assert_eq!(cut, "x".repeat(MAX_TRACE_ID - 4), "a character is escaped whole or not at all");
        for raw in ["a b", "é", "\n", "%", &"é".repeat(300)] {
            let safe = safe_trace_id(raw);
            assert!(safe.len() <= MAX_TRACE_ID && safe.bytes().all(|b| b.is_ascii_graphic()), "{raw:?}: {safe}");
        }
    }

    #[test]
    fn lookups_name_an_exp_in_unix_seconds() {
        assert_eq!(lookup_exp(None), Ok(None));
        assert_eq!(lookup_exp(Some("")), Ok(None));
        assert_eq!(lookup_exp(Some("exp=1700000000")), Ok(Some(1_700_000_000)));
        assert_eq!(lookup_exp(Some("x=1&exp=5")), Ok(Some(5)));
        for bad in ["exp=", "exp=-1", "exp=1.5", "exp=abc", "exp=253402300800"] {
            assert!(lookup_exp(Some(bad)).is_err(), "{bad}");
        }
    }
}
