//! `POST /v1/security-events` over a real listener on every store combination
//! ({Redis + SQL, SQL alone} × {Postgres, MariaDB, SQLite}): each kind is one
//! `idem_audit` line (action `security_event`) and one count in
//! `idem_security_events_total{kind}`; idemd's own PARAM_MISMATCH is audited
//! the same way; strangers get 401, bad bodies 400, and a database that is
//! down a 503 within the SQL timeout.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{acq, new_key, Backend, CutProxy, Fixture};
use idem_core::protocol::{AcquireOutcome, SecurityKind};
use idemd::auth::Tokens;
use idemd::store::sql::audit::EventLine;
use idemd::store::Store;
use serde_json::{json, Value};

const TOKEN: &str = "filter-token-0123456789";

async fn serve(store: Arc<Store>) -> String {
    let tokens = Tokens::new(&[TOKEN.to_string()]).expect("tokens");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr: SocketAddr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, idemd::api::router(store, tokens)).await;
    });
    format!("http://{addr}")
}

fn client(token: Option<&str>) -> reqwest::Client {
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(t) = token {
        headers.insert(reqwest::header::AUTHORIZATION, format!("Bearer {t}").parse().expect("header"));
    }
    reqwest::Client::builder().default_headers(headers).build().expect("client")
}

async fn report(c: &reqwest::Client, base: &str, body: String) -> (u16, Value) {
    let r = c
        .post(format!("{base}/v1/security-events"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("send");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// The events of this test only (the table is shared): by their scope.
async fn events_of(store: &Store, scope: &str) -> Vec<EventLine> {
    let all = store.sql().events(0, None, 10_000).await.expect("events");
    all.into_iter().filter(|e| e.scope == scope).collect()
}

fn counted(metrics: &str, kind: &str) -> Option<f64> {
    let series = format!("idem_security_events_total{{kind=\"{kind}\"}} ");
    metrics.lines().find_map(|l| l.strip_prefix(series.as_str())).and_then(|v| v.trim().parse().ok())
}

async fn every_kind_is_one_audit_line_and_one_count(fx: &Fixture) {
    let store = fx.store().await;
    let base = serve(Arc::clone(&store)).await;
    let c = client(Some(TOKEN));
    let scope = format!("sec.{}", &new_key()[..12]);
    let (tampered, foreign) = (new_key(), new_key());
    let subject = "9f86d081884c7d659a2feaa0c55ad015";
    // Trace ids of this run only (the table is shared and outlives runs).
    let trace = |t: &str| format!("{t}-{scope}");
    let cases = [
        (SecurityKind::ParamsChanged, Some(&tampered), trace("params")),
        (SecurityKind::CrossSubject, Some(&foreign), trace("subject")),
        (SecurityKind::BadSignature, None, trace("forged")),
        (SecurityKind::UnknownKid, None, String::new()),
    ];
    for (kind, key, trace) in &cases {
        let mut body = json!({"kind": kind.as_str(), "scope": scope, "subject_hash": subject, "trace_id": trace});
        if let Some(k) = key {
            body["key"] = json!(k);
        }
        let (status, answer) = report(&c, &base, body.to_string()).await;
        assert_eq!((status, answer), (202, json!({"outcome": "OK"})), "{} on {}", kind.as_str(), fx.label());
    }
    // idemd's own PARAM_MISMATCH: the nonce of an operation, acquired again with another binding.
    let op = new_key();
    let mut first = acq(&op);
    first.scope = scope.clone();
    first.trace_id = "trace-first".into();
    assert_eq!(store.acquire(&first).await.outcome, AcquireOutcome::Acquired);
    let mut other = first.clone();
    other.param_hash = "0".repeat(64);
    other.trace_id = "trace-reused".into();
    assert_eq!(store.acquire(&other).await.outcome, AcquireOutcome::ParamMismatch);

    // idemd writes its own line off the acquire's path: wait for it (bounded).
    let settled = common::eventually(Duration::from_secs(5), || {
        let (store, scope) = (Arc::clone(&store), scope.clone());
        async move { events_of(&store, &scope).await.len() == 5 }
    })
    .await;
    let events = events_of(&store, &scope).await;
    assert!(settled, "{} lines on {}: {events:?}", events.len(), fx.label());

    // Newest first: idemd's own line, then the four reports in reverse.
    let kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(kinds, ["params_changed", "unknown_kid", "bad_signature", "cross_subject", "params_changed"]);
    let own = &events[0];
    assert_eq!((own.actor.as_str(), own.key.as_deref()), ("idemd", Some(op.as_str())));
    assert_eq!((own.subject_hash.as_str(), own.trace_id.as_deref()), (common::SUBJECT, Some("trace-reused")));
    for (e, (kind, key, trace)) in events[1..].iter().rev().zip(&cases) {
        assert_eq!(e.kind, kind.as_str());
        assert_eq!((e.actor.as_str(), e.scope.as_str(), e.subject_hash.as_str()), ("filter", scope.as_str(), subject));
        assert_eq!(e.key.as_deref(), key.map(String::as_str), "{e:?}");
        assert_eq!(e.trace_id.as_deref(), Some(trace.as_str()).filter(|t| !t.is_empty()), "{e:?}");
        assert!(e.why.starts_with(&format!("{} on scope {scope}: ", kind.as_str())), "{e:?}");
    }
    let only: Vec<_> = store.sql().events(0, Some(SecurityKind::CrossSubject), 10_000).await.expect("events");
    assert!(only.iter().all(|e| e.kind == "cross_subject") && only.iter().any(|e| e.scope == scope));

    // The lines are part of their operation's history; one without an operation names none.
    let history = store.sql().history(&tampered).await.expect("history");
    assert_eq!(history.len(), 1, "{history:?}");
    assert_eq!((history[0].action.as_str(), history[0].from_state.as_ref()), ("security_event", None));
    assert_eq!(store.sql().history(&op).await.expect("history").len(), 2, "acquire, then the event");
    // No operation row was made or changed by any of it.
    assert_eq!(fx.count_rows(&tampered).await, 0);
    assert_eq!(store.operation(&op).await.expect("op").map(|v| v.param_hash), Some(common::PARAM.to_string()));
    // ops show by a trace id finds no "operation" for an event that named none.
    assert!(store.sql().keys_by_trace(&trace("forged")).await.expect("keys").is_empty());
    assert_eq!(store.sql().keys_by_trace(&trace("params")).await.expect("keys"), std::slice::from_ref(&tampered));

    let metrics = c.get(format!("{base}/metrics")).send().await.expect("metrics").text().await.expect("text");
    assert_eq!(counted(&metrics, "params_changed"), Some(2.0), "{metrics}");
    for kind in ["cross_subject", "bad_signature", "unknown_kid"] {
        assert_eq!(counted(&metrics, kind), Some(1.0), "{kind}: {metrics}");
    }
}

macro_rules! combos {
    ($($name:ident: $sql:expr, $redis:expr;)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                if let Some(fx) = Fixture::new($sql, $redis).await {
                    every_kind_is_one_audit_line_and_one_count(&fx).await;
                }
            }
        )*
    };
}

combos! {
    events_on_redis_postgres: Backend::Postgres, true;
    events_on_redis_mariadb: Backend::MariaDb, true;
    events_on_redis_sqlite: Backend::Sqlite, true;
    events_on_postgres: Backend::Postgres, false;
    events_on_mariadb: Backend::MariaDb, false;
    events_on_sqlite: Backend::Sqlite, false;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn strangers_get_401_and_bad_bodies_400_and_nothing_is_written() {
    let Some(fx) = Fixture::new(Backend::Sqlite, false).await else { return };
    let store = fx.store().await;
    let base = serve(Arc::clone(&store)).await;
    let scope = format!("sec.{}", &new_key()[..12]);
    let good = json!({"kind": "bad_signature", "scope": scope, "subject_hash": "ab12", "trace_id": "t-1"});
    for (who, c) in [("none", client(None)), ("wrong", client(Some("wrong-token-0123456789")))] {
        let (status, body) = report(&c, &base, good.to_string()).await;
        assert_eq!((status, body["error"].as_str()), (401, Some("unauthorized")), "{who}");
    }
    let c = client(Some(TOKEN));
    let with = |field: &str, value: Value| {
        let mut b = good.clone();
        b[field] = value;
        b.to_string()
    };
    let bad = [
        "{not json".to_string(),
        String::new(),
        with("kind", json!("tampering")),
        with("kind", json!("PARAMS_CHANGED")),
        json!({"scope": scope, "subject_hash": "ab12"}).to_string(),
        with("key", json!("abc")),
        with("key", json!("0123456789ABCDEF0123456789ABCDEF")),
        with("subject_hash", json!("")),
        with("subject_hash", json!("x".repeat(129))),
        with("scope", json!("two words")),
        with("scope", json!("s".repeat(256))),
        with("why", json!("x".repeat(idemd::api::MAX_EVENT_BYTES))),
    ];
    for body in &bad {
        let (status, answer) = report(&c, &base, body.clone()).await;
        assert_eq!(status, 400, "{body:.80}: {answer}");
        assert_eq!(answer["error"], "bad_request", "{answer}");
    }
    assert!(events_of(&store, &scope).await.is_empty(), "nothing refused was written");
    let metrics = c.get(format!("{base}/metrics")).send().await.expect("metrics").text().await.expect("text");
    let counted: Vec<&str> = metrics.lines().filter(|l| l.starts_with("idem_security_events_total{")).collect();
    assert_eq!(counted.len(), 4, "every kind has its series from the start: {metrics}");
    assert!(counted.iter().all(|l| l.ends_with(" 0")), "nothing refused was counted: {metrics}");
    // The same report with the token is accepted.
    assert_eq!(report(&c, &base, good.to_string()).await.0, 202);
    assert_eq!(events_of(&store, &scope).await.len(), 1);
}

/// A security event whose trace id (the client's `x-request-id`, passed on by the filter)
/// holds a space, a non-ASCII character, a line break or more than the column takes was refused
/// whole (400), so a forgery sent with such an id left no audit line and no count. Each is now
/// written and counted, its trace id made safe in the audit (percent-encoded, cut at a whole
/// character); idemd's log line is checked end to end (tests/tests/hostile_clients.rs).
async fn odd_trace_ids_are_recorded_made_safe(fx: &Fixture) {
    let store = fx.store().await;
    let base = serve(Arc::clone(&store)).await;
    let c = client(Some(TOKEN));
    let scope = format!("sec.{}", &new_key()[..12]);
    let run = &scope[4..];
    let long = format!("{run}-{}", "x".repeat(400));
    let cases: Vec<(String, Option<String>)> = vec![
        (format!("{run} odd id"), Some(format!("{run}%20odd%20id"))),
        (format!("{run}-café-中"), Some(format!("{run}-caf%C3%A9-%E4%B8%AD"))),
        (format!("{run}\nsecurity_event=none"), Some(format!("{run}%0Asecurity_event=none"))),
        (format!("{run}-100%"), Some(format!("{run}-100%25"))),
        (long.clone(), Some(long[..idemd::store::sql::audit::MAX_TRACE_ID].to_string())),
        (String::new(), None),
    ];
    for (raw, _) in &cases {
        let body = json!({"kind": "bad_signature", "scope": scope, "subject_hash": "ab12", "trace_id": raw});
        let (status, answer) = report(&c, &base, body.to_string()).await;
        assert_eq!((status, answer), (202, json!({"outcome": "OK"})), "trace id {raw:?} on {}", fx.label());
    }
    let events = events_of(&store, &scope).await;
    assert_eq!(events.len(), cases.len(), "one line each on {}: {events:?}", fx.label());
    let mut written: Vec<Option<String>> = events.iter().map(|e| e.trace_id.clone()).collect();
    let mut wanted: Vec<Option<String>> = cases.iter().map(|(_, safe)| safe.clone()).collect();
    written.sort();
    wanted.sort();
    assert_eq!(written, wanted, "on {}", fx.label());
    let metrics = c.get(format!("{base}/metrics")).send().await.expect("metrics").text().await.expect("text");
    assert_eq!(counted(&metrics, "bad_signature"), Some(cases.len() as f64), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn odd_trace_ids_are_recorded_made_safe_on_sqlite() {
    if let Some(fx) = Fixture::new(Backend::Sqlite, false).await {
        odd_trace_ids_are_recorded_made_safe(&fx).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn odd_trace_ids_are_recorded_made_safe_on_postgres() {
    if let Some(fx) = Fixture::new(Backend::Postgres, false).await {
        odd_trace_ids_are_recorded_made_safe(&fx).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn odd_trace_ids_are_recorded_made_safe_on_mariadb() {
    if let Some(fx) = Fixture::new(Backend::MariaDb, false).await {
        odd_trace_ids_are_recorded_made_safe(&fx).await;
    }
}

/// SQL unreachable: 503 `STORE_UNAVAILABLE` within the SQL timeout (the filter
/// ignores it), still counted; written again once SQL is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn database_down_is_a_bounded_503() {
    if Fixture::new(Backend::Postgres, false).await.is_none() {
        return;
    }
    let url = common::postgres_test_url();
    let (real, _) = common::reroute(&url, 5432, 0);
    let proxy = CutProxy::start(real).await;
    let (_, proxied) = common::reroute(&url, 5432, proxy.port);
    let Some(fx) = Fixture::new(Backend::Postgres, false).await else { return };
    let fx = fx.with_sql_url(proxied);
    let store = fx.store().await;
    let base = serve(Arc::clone(&store)).await;
    let c = client(Some(TOKEN));
    let scope = format!("sec.{}", &new_key()[..12]);
    let body = json!({"kind": "unknown_kid", "scope": scope, "subject_hash": "ab12"}).to_string();
    assert_eq!(report(&c, &base, body.clone()).await.0, 202);

    proxy.cut();
    let budget = common::sql_opts().timeout;
    for _ in 0..3 {
        let started = Instant::now();
        let (status, answer) = report(&c, &base, body.clone()).await;
        let took = started.elapsed();
        assert_eq!((status, answer), (503, json!({"outcome": "STORE_UNAVAILABLE"})));
        assert!(took < budget + Duration::from_millis(500), "answered after {took:?} (SQL budget {budget:?})");
    }
    let metrics = c.get(format!("{base}/metrics")).send().await.expect("metrics").text().await.expect("text");
    assert_eq!(counted(&metrics, "unknown_kid"), Some(4.0), "counted even when not written: {metrics}");
    assert!(metrics.contains("idem_security_events_unrecorded_total 3"), "{metrics}");

    proxy.restore();
    let back = common::eventually(Duration::from_secs(10), || {
        let (c, base, body) = (c.clone(), base.clone(), body.clone());
        async move { report(&c, &base, body).await.0 == 202 }
    })
    .await;
    assert!(back, "written again once SQL is back");
    assert_eq!(events_of(&store, &scope).await.len(), 2, "the first and the one after the outage");
}

/// A TCP proxy that, once told to, stops passing bytes but keeps every
/// connection open: a database that hangs rather than refuses.
struct HangProxy {
    port: u16,
    hang: Arc<std::sync::atomic::AtomicBool>,
}

impl HangProxy {
    async fn start(target: SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let hang = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = Arc::clone(&hang);
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let Ok(outbound) = tokio::net::TcpStream::connect(target).await else { continue };
                let (ri, wi) = inbound.into_split();
                let (ro, wo) = outbound.into_split();
                tokio::spawn(pipe(ri, wo, Arc::clone(&flag)));
                tokio::spawn(pipe(ro, wi, Arc::clone(&flag)));
            }
        });
        Self { port, hang }
    }
}

/// Copy bytes one way; while `hang` is set, hold them (and the connection).
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    hang: Arc<std::sync::atomic::AtomicBool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let Ok(n) = from.read(&mut buf).await else { return };
        while hang.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if n == 0 || to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// SQL hangs (accepts, never answers): the report is still answered within the
/// SQL timeout, 503, and the acquires' path is not what waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn database_hanging_is_a_bounded_503() {
    if Fixture::new(Backend::Postgres, false).await.is_none() {
        return;
    }
    let url = common::postgres_test_url();
    let (real, _) = common::reroute(&url, 5432, 0);
    let proxy = HangProxy::start(real).await;
    let (_, proxied) = common::reroute(&url, 5432, proxy.port);
    let Some(fx) = Fixture::new(Backend::Postgres, false).await else { return };
    let fx = fx.with_sql_url(proxied);
    let store = fx.store().await;
    let base = serve(Arc::clone(&store)).await;
    let c = client(Some(TOKEN));
    let scope = format!("sec.{}", &new_key()[..12]);
    let body = json!({"kind": "cross_subject", "scope": scope, "subject_hash": "ab12", "key": new_key()}).to_string();
    assert_eq!(report(&c, &base, body.clone()).await.0, 202);

    proxy.hang.store(true, std::sync::atomic::Ordering::SeqCst);
    let budget = common::sql_opts().timeout;
    let started = Instant::now();
    let (status, answer) = report(&c, &base, body.clone()).await;
    let took = started.elapsed();
    assert_eq!((status, answer), (503, json!({"outcome": "STORE_UNAVAILABLE"})));
    assert!(took >= budget.saturating_sub(Duration::from_millis(100)), "it did wait for SQL: {took:?}");
    assert!(took < budget + Duration::from_millis(700), "answered after {took:?} (SQL budget {budget:?})");
    proxy.hang.store(false, std::sync::atomic::Ordering::SeqCst);
}
