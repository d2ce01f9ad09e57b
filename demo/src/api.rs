//! HTTP endpoints of the transfers service, including the fault injection
//! the end-to-end tests use to make it misbehave on purpose.

use crate::app::App;
use crate::server::Hangup;
use crate::store::{Inserted, NewRecord};
use crate::transfer::{self, TransferRequest};
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tracing::{error, info, warn};

/// The REST routes; `crate::router` adds the MCP endpoints beside them.
pub fn router(app: App) -> Router {
    Router::new()
        .route("/healthz", get(|| async { Json(json!({ "ok": true })) }))
        .route("/v1/transfers/preview", post(preview))
        .route("/v1/transfers", post(confirm))
        .route("/v1/transfers/by-key/{idempotency_key}", get(by_key))
        .route("/v1/transfers/by-ref/{client_ref}", get(by_ref))
        .route("/v1/executions", get(executions))
        .with_state(app)
}

async fn preview(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    let faults = Faults::read(&headers, app.config.faults);
    faults.delay().await;
    if let Some(status) = faults.fail {
        return injected_failure(status);
    }
    let req = match TransferRequest::parse(&body) {
        Ok(req) => req,
        Err(detail) => return invalid_request(detail),
    };
    let mut quote = quote(&req, faults.quote_ttl_s);
    if faults.card_fingerprint {
        quote["card"] = json!({ "brand": "visa", "fingerprint": "card_fp_7f3a" });
    }
    let mut text = quote.to_string().into_bytes();
    if let Some(key) = &faults.self_fingerprint {
        // The raw key text goes in as written (`\u0066ingerprint` stays escaped): the first member.
        let member = format!("\"{key}\":\"{SELF_FINGERPRINT}\",");
        text.splice(1..1, member.into_bytes());
    }
    let mut response = match &faults.split {
        Some(name) => split_answer(text, app.config.fault_dir.clone(), name.clone()),
        None => raw_json(StatusCode::OK, String::from_utf8_lossy(&text).into_owned()),
    };
    for value in &faults.quote_expires_at {
        if let Ok(v) = header::HeaderValue::from_bytes(value) {
            response.headers_mut().append(QUOTE_EXPIRES_HEADER, v);
        }
    }
    response
}

/// The header `x-demo-quote-expires-at` fills (a route's `quote_expires: header:quote-expires-at`).
const QUOTE_EXPIRES_HEADER: &str = "quote-expires-at";

/// The value `x-demo-self-fingerprint` gives the upstream's own fingerprint field.
pub(crate) const SELF_FINGERPRINT: &str = "upstream_fp_0000";

/// The `quote-expires-at` lines `x-demo-quote-expires-at: <spec>[,<spec>…]` asks for, one per spec:
/// `+N`/`-N` is unix now plus/minus N seconds, `bytes` a value that is not UTF-8, anything else
/// is sent as written (`soon`).
fn quote_expires_lines(spec: &str) -> Vec<Vec<u8>> {
    let now = transfer::unix_now();
    spec.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            let offset = |n: &str| n.parse::<u64>().ok();
            match (s.strip_prefix('+').and_then(offset), s.strip_prefix('-').and_then(offset)) {
                (Some(n), _) => (now + n).to_string().into_bytes(),
                (_, Some(n)) => now.saturating_sub(n).to_string().into_bytes(),
                _ if s == "bytes" => vec![0xE9, 0xFF],
                _ => s.as_bytes().to_vec(),
            }
        })
        .collect()
}

/// `x-demo-split: <name>`: the answer's `Content-Length` and first half at once, the rest only once
/// `<dir>/<name>.release` exists: a body still streaming, which a gateway that holds the answer
/// whole cannot pass on before the release.
fn split_answer(body: Vec<u8>, dir: std::path::PathBuf, name: String) -> Response {
    let mut first = body;
    let rest = first.split_off(first.len() / 2);
    let length = first.len() + rest.len();
    let later = async move {
        wait_for_release(&dir, &name).await;
        Ok::<_, std::convert::Infallible>(Bytes::from(rest))
    };
    let parts =
        futures_util::stream::once(std::future::ready(Ok(Bytes::from(first)))).chain(futures_util::stream::once(later));
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, length)
        .body(axum::body::Body::from_stream(parts))
        .unwrap_or_else(|_| injected_failure(StatusCode::INTERNAL_SERVER_ERROR))
}

/// The quote a preview answers (REST body, MCP `structuredContent`); it states its own expiry
/// (`expires_at`, unix seconds), which the gateway's fingerprint never outlives. `ttl_s`: the
/// `x-demo-quote-ttl-s` fault, for tests of that rule.
pub(crate) fn quote(req: &TransferRequest, ttl_s: Option<u64>) -> Value {
    json!({
        "quote_id": transfer::new_id("q_"),
        "amount": req.amount,
        "currency": req.currency,
        "payee_id": req.payee_id,
        "fee": transfer::FEE,
        "expires_at": transfer::unix_now() + ttl_s.unwrap_or(transfer::QUOTE_TTL_SECS),
    })
}

/// What a confirm ends in, whichever protocol asked for it (REST
/// `POST /v1/transfers` or the MCP tool `execute_transfer`).
pub(crate) enum Confirmed {
    /// The transfer record as JSON text: this request's execution, or the
    /// first execution's record replayed byte for byte.
    Record(String),
    /// No `Idempotency-Key`: refused, nothing executed.
    KeyRequired,
    /// `x-demo-fail`: refused with this status, nothing executed.
    Injected(StatusCode),
    /// The request does not parse or validate (the detail says why).
    Invalid(String),
    /// Over `transfer::LIMIT`: a definite refusal.
    LimitExceeded,
    /// `x-demo-reset: first` on the first attempt: drop the connection.
    Reset,
}

async fn confirm(
    State(app): State<App>,
    Extension(hangup): Extension<Hangup>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let confirmed = match execute_detached(app, headers, body).await {
        Ok(confirmed) => confirmed,
        Err(()) => return internal_error(),
    };
    match confirmed {
        Confirmed::Record(body) => raw_json(StatusCode::CREATED, body),
        Confirmed::KeyRequired => {
            (StatusCode::PRECONDITION_REQUIRED, Json(json!({ "error": "idempotency_key_required" }))).into_response()
        }
        Confirmed::Injected(status) => injected_failure(status),
        Confirmed::Invalid(detail) => invalid_request(detail),
        Confirmed::LimitExceeded => {
            (StatusCode::UNPROCESSABLE_ENTITY, Json(json!({ "error": "limit_exceeded" }))).into_response()
        }
        Confirmed::Reset => {
            hangup.reset();
            // Never answer: the connection task drops the socket instead.
            std::future::pending().await
        }
    }
}

/// Runs a confirm detached from the caller: a real service keeps executing
/// after the caller (Envoy, on a timeout) hangs up, and the gateway's
/// in-flight handling is tested against exactly that. `Err` is an internal
/// error, already logged.
pub(crate) async fn execute_detached(app: App, headers: HeaderMap, body: Bytes) -> Result<Confirmed, ()> {
    let task = tokio::spawn(async move { execute(&app, &headers, &body).await });
    match task.await {
        Ok(Ok(confirmed)) => Ok(confirmed),
        Ok(Err(e)) => {
            error!(error = %e, "database error");
            Err(())
        }
        Err(e) => {
            error!(error = %e, "confirm task failed");
            Err(())
        }
    }
}

/// Under `--no-keys` (a downstream without key support, the seed's "downstream without key
/// support") the header is never read: no 428 without one, nothing deduplicated on it, no by-key
/// record; every confirm executes, found again only by its `client_ref`. The same faults apply.
async fn execute(app: &App, headers: &HeaderMap, body: &[u8]) -> Result<Confirmed, sqlx::Error> {
    let key = match app.config.keys {
        true => headers.get("idempotency-key").and_then(|v| v.to_str().ok()).filter(|k| !k.is_empty()),
        false => None,
    };
    let now = transfer::unix_now() as i64;
    let attempt = app.store.count_attempt(key, now).await?;

    let faults = Faults::read(headers, app.config.faults);
    faults.delay().await;

    // Without a key, anyone reaching the service around the gateway could
    // execute the same transfer twice.
    if app.config.keys && key.is_none() {
        return Ok(Confirmed::KeyRequired);
    }
    if let Some(status) = faults.fail {
        return Ok(Confirmed::Injected(status));
    }
    if faults.reset_first && attempt == 1 {
        warn!(key, "fault: resetting the connection on the first attempt");
        return Ok(Confirmed::Reset);
    }

    let req = match TransferRequest::parse(body) {
        Ok(req) => req,
        Err(detail) => return Ok(Confirmed::Invalid(detail)),
    };
    if req.over_limit() {
        return Ok(Confirmed::LimitExceeded);
    }

    let transfer_id = transfer::new_id("t_");
    let response = record_json(&req, &transfer_id, key, now);
    let idem_key = match key {
        // --no-keys: each execution its own row; nothing here tells a retry from a new transfer.
        None => format!("nokey#{transfer_id}"),
        Some(key) if app.config.dedup => key.to_string(),
        // Under --no-dedup each attempt gets its own row key, so the UNIQUE
        // constraint never fires and every retry really executes.
        Some(key) => format!("{key}#{attempt}"),
    };
    let amount = match &req.amount {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let record = NewRecord {
        idem_key: &idem_key,
        request_key: key.unwrap_or(crate::store::NO_KEY),
        transfer_id: &transfer_id,
        amount: &amount,
        currency: &req.currency,
        payee_id: &req.payee_id,
        memo: req.memo.as_deref(),
        client_ref: req.client_ref.as_deref(),
        response: &response,
        created_at: now,
    };
    let body = match app.store.insert(&record).await? {
        Inserted::Executed => {
            info!(key, transfer_id, amount, client_ref = req.client_ref.as_deref(), "transfer executed");
            response
        }
        Inserted::Duplicate(stored) => {
            info!(key, "duplicate key: replaying the stored transfer");
            stored
        }
    };

    if faults.crash_after_commit {
        warn!(key, "fault: exiting after commit, before answering");
        std::process::exit(0);
    }
    if let Some(name) = &faults.hold_after_commit {
        hold_after_commit(&app.config.fault_dir, name, &body).await;
    }
    Ok(Confirmed::Record(body))
}

/// The transfer record a confirm answers and stores. `key`: the Idempotency-Key it was executed
/// under (absent under `--no-keys`); `client_ref` only when the request had one, so a record
/// without it is what it always was.
fn record_json(req: &TransferRequest, transfer_id: &str, key: Option<&str>, now: i64) -> String {
    let mut record = json!({
        "transfer_id": transfer_id,
        "status": "executed",
        "amount": req.amount,
        "currency": req.currency,
        "payee_id": req.payee_id,
        "memo": req.memo,
    });
    if let Some(key) = key {
        record["idempotency_key"] = json!(key);
    }
    if let Some(client_ref) = &req.client_ref {
        record["client_ref"] = json!(client_ref);
    }
    record["executed_at"] = json!(now);
    record.to_string()
}

/// How long `x-demo-hold-after-commit` holds an answer at most: a test that never releases it
/// still gets its answer, late.
const HOLD_AT_MOST: Duration = Duration::from_secs(20);

/// `x-demo-hold-after-commit: <name>`: the transfer is committed; say so in `<dir>/<name>.committed`
/// (the record about to be answered, written whole) and answer only once `<dir>/<name>.release`
/// exists. A test acts in between: the service has executed and not yet answered.
async fn hold_after_commit(dir: &std::path::Path, name: &str, record: &str) {
    let committed = dir.join(format!("{name}.committed"));
    let partial = dir.join(format!("{name}.committed.partial"));
    if let Err(e) = tokio::fs::write(&partial, record).await.and(tokio::fs::rename(&partial, &committed).await) {
        error!(error = %e, path = %committed.display(), "fault: cannot write the committed file; answering now");
        return;
    }
    warn!(name, "fault: committed; holding the answer until {name}.release appears");
    wait_for_release(dir, name).await;
}

/// Until `<dir>/<name>.release` exists, or [`HOLD_AT_MOST`].
async fn wait_for_release(dir: &std::path::Path, name: &str) {
    let release = dir.join(format!("{name}.release"));
    let deadline = Instant::now() + HOLD_AT_MOST;
    while !tokio::fs::try_exists(&release).await.unwrap_or(false) {
        if Instant::now() > deadline {
            warn!(name, "fault: nobody released the answer within {HOLD_AT_MOST:?}; answering");
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    info!(name, "fault: released; answering");
}

async fn by_key(State(app): State<App>, Path(key): Path<String>) -> Response {
    record_or_404(app.store.by_key(&key).await)
}

/// The first execution sent with this `client_ref`: how a service that ignores keys is asked "did
/// it happen?" (the reconciler's `{ref}` lookup).
async fn by_ref(State(app): State<App>, Path(client_ref): Path<String>) -> Response {
    record_or_404(app.store.by_client_ref(&client_ref).await)
}

/// A stored record (200, byte for byte) or 404.
fn record_or_404(found: Result<Option<String>, sqlx::Error>) -> Response {
    match found {
        Ok(Some(body)) => raw_json(StatusCode::OK, body),
        Ok(None) => (StatusCode::NOT_FOUND, Json(json!({ "error": "not_found" }))).into_response(),
        Err(e) => {
            error!(error = %e, "database error");
            internal_error()
        }
    }
}

async fn executions(State(app): State<App>) -> Response {
    match app.store.executions().await {
        Ok(executions) => Json(executions).into_response(),
        Err(e) => {
            error!(error = %e, "database error");
            internal_error()
        }
    }
}

/// The `x-demo-*` request headers; all off unless the service runs with `--faults`.
#[derive(Default)]
pub(crate) struct Faults {
    pub(crate) delay: Option<Duration>,
    pub(crate) fail: Option<StatusCode>,
    crash_after_commit: bool,
    /// A name of `[A-Za-z0-9_-]`, at most 64 characters (it names files in the fault dir).
    hold_after_commit: Option<String>,
    reset_first: bool,
    /// MCP only: answers that do not keep to the tool's `outputSchema` (`crate::mcp`).
    pub(crate) off_schema: bool,
    /// `x-demo-quote-ttl-s`: a quote valid for this long instead of 15 minutes.
    pub(crate) quote_ttl_s: Option<u64>,
    /// `x-demo-split: <name>` (preview): half the answer now, the rest on `<name>.release`.
    split: Option<String>,
    /// `x-demo-card-fingerprint: 1` (preview): the quote names a card with a `fingerprint` of its own.
    card_fingerprint: bool,
    /// `x-demo-quote-expires-at: +600,+2` (preview): one `quote-expires-at` line per value, as an
    /// upstream with a clock, a parser or a proxy of its own may send them.
    quote_expires_at: Vec<Vec<u8>>,
    /// `x-demo-self-fingerprint: <key>` (preview): the quote's first member is `"<key>":
    /// "upstream_fp_0000"`, the key text as written (`Fingerprint`, `\u0066ingerprint`): an
    /// upstream that names the gateway's field itself. Letters, digits, `_` and `\` only.
    self_fingerprint: Option<String>,
}

impl Faults {
    pub(crate) fn read(headers: &HeaderMap, enabled: bool) -> Faults {
        if !enabled {
            return Faults::default();
        }
        let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim);
        let file_name = |n: &&str| {
            (1..=64).contains(&n.len()) && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        };
        Faults {
            delay: get("x-demo-delay-ms").and_then(|v| v.parse().ok()).map(Duration::from_millis),
            // Any 4xx/5xx, so tests can also exercise how the gateway
            // classifies definite failures (400, 409, 429, ...).
            fail: get("x-demo-fail")
                .and_then(|v| v.parse::<u16>().ok())
                .filter(|code| (400..=599).contains(code))
                .and_then(|code| StatusCode::from_u16(code).ok()),
            crash_after_commit: get("x-demo-crash-after-commit") == Some("1"),
            hold_after_commit: get("x-demo-hold-after-commit").filter(file_name).map(str::to_owned),
            reset_first: get("x-demo-reset") == Some("first"),
            off_schema: get("x-demo-off-schema") == Some("1"),
            quote_ttl_s: get("x-demo-quote-ttl-s").and_then(|v| v.parse().ok()),
            split: get("x-demo-split").filter(file_name).map(str::to_owned),
            card_fingerprint: get("x-demo-card-fingerprint") == Some("1"),
            quote_expires_at: get("x-demo-quote-expires-at").map(quote_expires_lines).unwrap_or_default(),
            self_fingerprint: get("x-demo-self-fingerprint")
                .filter(|k| {
                    (1..=64).contains(&k.len())
                        && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'\\')
                })
                .map(str::to_owned),
        }
    }

    pub(crate) async fn delay(&self) {
        if let Some(delay) = self.delay {
            tokio::time::sleep(delay).await;
        }
    }
}

/// A stored body goes back byte for byte, so a replay equals the original.
fn raw_json(status: StatusCode, body: String) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

fn invalid_request(detail: String) -> Response {
    let body = json!({ "error": "invalid_request", "detail": detail });
    (StatusCode::BAD_REQUEST, Json(body)).into_response()
}

pub(crate) fn injected_failure(status: StatusCode) -> Response {
    (status, Json(json!({ "error": "injected_failure" }))).into_response()
}

fn internal_error() -> Response {
    let body = json!({ "error": "internal_error" });
    (StatusCode::INTERNAL_SERVER_ERROR, Json(body)).into_response()
}
