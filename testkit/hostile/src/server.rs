//! Serving: HTTP/1.1 and h2c (prior knowledge) on one port, the demo's paths, each request answered by the
//! plan its draw names and sent exactly as [`crate::answer`] made it (pauses, parts, cuts included).

use crate::answer::{self, Answer, Context};
use crate::grammar::{Delivery, Plan, Role};
use crate::ledger::{Execution, Ledger};
use crate::Config;
use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::net::TcpListener;

pub type Body = UnsyncBoxBody<Bytes, io::Error>;

/// The request header that names a request's draw (reproducible answers whatever the timing).
pub const DRAW_HEADER: &str = "x-hostile-draw";
/// `x-hostile-plan: honest`: the demo's own answer (a test's control request).
pub const PLAN_HEADER: &str = "x-hostile-plan";

/// The largest request body read.
const MAX_REQUEST: usize = 1 << 20;

pub struct State {
    pub config: Config,
    pub ledger: Arc<Ledger>,
    ids: AtomicU64,
}

impl State {
    pub fn new(config: Config, ledger: Arc<Ledger>) -> State {
        State { config, ledger, ids: AtomicU64::new(0) }
    }

    /// `prefix` + 16 hex digits, unique in this upstream and different between seeds.
    fn id(&self, prefix: &str) -> String {
        let n = self.ids.fetch_add(1, Ordering::Relaxed);
        let mut z = self.config.seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        format!("{prefix}{:016x}", z ^ (z >> 31))
    }
}

pub async fn serve(listener: TcpListener, state: Arc<State>) {
    // Dropping this future (Hostile's drop) drops every connection with it.
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        while conns.try_join_next().is_some() {}
        let state = state.clone();
        conns.spawn(async move {
            let _ = stream.set_nodelay(true);
            let svc = hyper::service::service_fn(move |req| handle(state.clone(), req));
            let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
        });
    }
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Percent-decoding of a path segment (a business reference may hold any character).
fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (b[i], b.get(i + 1).copied().and_then(hex), b.get(i + 2).copied().and_then(hex)) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Err: the connection (HTTP/1.1) or the stream (h2) is cut without an answer.
async fn handle(state: Arc<State>, req: Request<Incoming>) -> Result<Response<Body>, io::Error> {
    let (parts, body) = req.into_parts();
    let header = |n: &str| parts.headers.get(n).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let path = parts.uri.path().to_owned();
    let method = parts.method.as_str().to_owned();
    let body = match Limited::new(body, MAX_REQUEST).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return Ok(send(Answer::plain(413, &json!({ "error": "body_too_large" })))),
    };
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    for fp in [header("agent-fingerprint"), request.get("fingerprint").and_then(Value::as_str).map(str::to_owned)]
        .into_iter()
        .flatten()
    {
        state.ledger.saw_fingerprint(&fp);
    }
    let honest = header(PLAN_HEADER).as_deref() == Some("honest");
    let draw = |role: Role| -> (u64, Plan) {
        let d = header(DRAW_HEADER)
            .and_then(|d| d.trim().parse().ok())
            .unwrap_or_else(|| state.ledger.next_draw(role.name()));
        let plan = if honest { crate::honest(role) } else { crate::Grammar::new(state.config.seed).draw(role, d) };
        state.ledger.count_branches(&plan.branches());
        (d, plan)
    };
    let ctx = |stale: Option<String>| Context {
        request: &request,
        now_s: now_ms() / 1000,
        ttl_hint_s: state.config.ttl_hint_s,
        stale,
    };

    let answer = match (method.as_str(), path.as_str()) {
        ("GET", "/healthz") => Answer::plain(200, &json!({ "ok": true, "hostile": true })),
        ("GET", "/v1/executions") => Answer::plain(200, &state.ledger.executions_json()),
        ("GET", "/v1/hostile/ledger") => Answer::plain(200, &state.ledger.to_json()),
        (_, "/v1/transfers/preview") => {
            let (d, plan) = draw(Role::Preview);
            let Plan::Preview(plan) = plan else { return Err(io::Error::other("not a preview plan")) };
            let stale = state.ledger.stale_fingerprint((d % 5) as usize);
            let (a, quote) = answer::preview(&plan, &ctx(stale), &state.id("q_"));
            if let Some(q) = quote {
                state.ledger.quote(q);
            }
            a
        }
        (_, "/v1/transfers") => {
            let (d, plan) = draw(Role::Confirm);
            let Plan::Confirm(plan) = plan else { return Err(io::Error::other("not a confirm plan")) };
            let key = header("idempotency-key").filter(|k| !k.is_empty());
            state.ledger.attempt(key.as_deref());
            let stale = state.ledger.stale_fingerprint((d % 5) as usize);
            let transfer_id = state.id("t_");
            let (record, a) = answer::confirm(&plan, &ctx(stale), &transfer_id, key.as_deref());
            // Committed before anything is sent, and whether or not the caller is still there to hear it.
            if let Some(record) = record {
                state.ledger.execute(Execution {
                    key,
                    transfer_id,
                    client_ref: record.get("client_ref").and_then(Value::as_str).map(str::to_owned),
                    method: method.clone(),
                    record: Value::Object(record).to_string(),
                    outcome: plan.outcome.name(),
                    at_unix_ms: now_ms(),
                });
            }
            a
        }
        ("GET", p) if p.starts_with("/v1/transfers/by-key/") || p.starts_with("/v1/transfers/by-ref/") => {
            let (_, plan) = draw(Role::Lookup);
            let Plan::Lookup(plan) = plan else { return Err(io::Error::other("not a lookup plan")) };
            let (by_key, rest) = match p.strip_prefix("/v1/transfers/by-key/") {
                Some(k) => (true, k),
                None => (false, p.trim_start_matches("/v1/transfers/by-ref/")),
            };
            let id = decode(rest);
            let found = if by_key { state.ledger.first_by_key(&id) } else { state.ledger.first_by_ref(&id) };
            answer::lookup(plan, found.as_ref())
        }
        _ => Answer::plain(404, &json!({ "error": "not_found" })),
    };
    if answer.reset {
        return Err(io::Error::other("hostile: cut without an answer"));
    }
    if let Delivery::HeadPause { ms } = answer.delivery {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    Ok(send(answer))
}

/// The answer as hyper sends it: headers as given (repeated, non-UTF-8), the body as its delivery says.
fn send(a: Answer) -> Response<Body> {
    let len = a.body.len();
    let (body, length): (Body, Option<usize>) = match a.delivery {
        Delivery::Whole | Delivery::HeadPause { .. } => {
            (Full::new(Bytes::from(a.body)).map_err(|never| match never {}).boxed_unsync(), Some(len))
        }
        Delivery::Chunked { parts, pause_ms } => (parted(a.body, parts, pause_ms, false), None),
        Delivery::Sized { parts, pause_ms } => (parted(a.body, parts, pause_ms, false), Some(len)),
        Delivery::Truncated => (parted(a.body, 2, 20, true), Some(len)),
    };
    let mut r = Response::new(body);
    *r.status_mut() = StatusCode::from_u16(a.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let h = r.headers_mut();
    for (name, value) in &a.headers {
        if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_bytes(value)) {
            h.append(n, v);
        }
    }
    if let Some(n) = length {
        h.insert(hyper::header::CONTENT_LENGTH, HeaderValue::from(n));
    }
    r
}

/// The body in `parts` with `pause_ms` between them; `cut`: only the first half, then an error (hyper closes
/// the connection, or resets the h2 stream).
fn parted(body: Vec<u8>, parts: u8, pause_ms: u64, cut: bool) -> Body {
    let mut chunks: VecDeque<Result<Bytes, ()>> = VecDeque::new();
    if cut {
        chunks.push_back(Ok(Bytes::copy_from_slice(&body[..body.len() / 2])));
        chunks.push_back(Err(()));
    } else {
        let size = body.len().div_ceil(usize::from(parts.max(1))).max(1);
        for c in body.chunks(size) {
            chunks.push_back(Ok(Bytes::copy_from_slice(c)));
        }
    }
    let stream = futures_util::stream::unfold((chunks, true), move |(mut chunks, first)| async move {
        let next = chunks.pop_front()?;
        if !first {
            tokio::time::sleep(Duration::from_millis(pause_ms)).await;
        }
        let item = match next {
            Ok(b) => Ok(Frame::data(b)),
            Err(()) => Err(io::Error::other("hostile: body cut short")),
        };
        Some((item, (chunks, false)))
    });
    StreamBody::new(stream).boxed_unsync()
}
