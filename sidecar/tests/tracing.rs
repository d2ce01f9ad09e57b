//! idemd's traces (DESIGN §8), from the binary as it runs: with
//! `--otlp-endpoint` it continues the caller's W3C trace context and exports
//! over OTLP/HTTP (protobuf) to a receiver in the test that decodes the real
//! wire format (`idem_testkit::otlp`).
//!
//! - each API call's span is a child of the `traceparent` the caller sent, in
//!   the caller's trace; each store call (the Redis script, the SQL statement)
//!   is a child of the API call's span;
//! - the batch exporter is flushed on SIGTERM (the schedule delay here is a
//!   minute, so only the shutdown can have exported them);
//! - a reconciler lookup has its own span and carries its context to the status
//!   endpoint as `traceparent`;
//! - without `--otlp-endpoint` nothing is exported.
//!
//! The two tracing tests run on every store idemd accepts: SQLite, Postgres and MariaDB, each with
//! the shared Redis in front and without it. On Postgres and MariaDB the API span was dropped from
//! the exporter and its store calls came out as traces of their own (`telemetry::Fresh` says why);
//! SQLite, whose statements run on a thread of their own, hid it.

mod common;

use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_core::protocol::{AcquireRequest, OpKey};
use idem_testkit::otlp::{OtlpReceiver, ReceivedSpan};
use idem_testkit::proc::Proc;

use common::{Backend, Fixture};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const TOKEN: &str = "tracing-test-token-0123456789";
/// The caller's span: what a filter sends on a callout.
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

fn free_port() -> Result<u16, std::io::Error> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn new_key() -> String {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).expect("random");
    hex::encode(b)
}

/// `idemd serve` on `fx`'s stores (its logs in `dir`), exporting to `otlp` if given.
fn idemd(
    fx: &Fixture,
    dir: &Path,
    port: u16,
    otlp: Option<&str>,
    extra: &[(&str, &str)],
) -> Result<Proc, Box<dyn std::error::Error>> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idemd"));
    for (k, _) in std::env::vars() {
        if k.starts_with("IDEM_") || k.starts_with("OTEL_") {
            cmd.env_remove(k);
        }
    }
    cmd.arg("serve")
        .env("IDEM_LISTEN", format!("127.0.0.1:{port}"))
        .env("IDEM_DATABASE_URL", &fx.sql_url)
        .env("IDEM_AUTH_TOKENS", TOKEN)
        // Only the shutdown flush can export within the test (see the module's comment).
        .env("OTEL_BSP_SCHEDULE_DELAY", "60000")
        .env("RUST_LOG", "info");
    if let Some(redis) = &fx.redis {
        cmd.env("IDEM_REDIS_URL", &redis.url);
    }
    if let Some(endpoint) = otlp {
        cmd.env("IDEM_OTLP_ENDPOINT", endpoint);
    }
    for (k, v) in extra {
        cmd.env(k, v);
    }
    Proc::spawn("idemd", &mut cmd, dir)
}

async fn wait_healthy(base: &str, proc: &mut Proc) -> TestResult {
    let deadline = Instant::now() + Duration::from_secs(20);
    let http = reqwest::Client::new();
    loop {
        if let Ok(r) = http.get(format!("{base}/healthz")).send().await {
            if r.status().is_success() {
                return Ok(());
            }
        }
        if proc.exited() || Instant::now() > deadline {
            return Err(format!("idemd did not become healthy:\n{}", proc.log_text()).into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// SIGTERM, as a pod is stopped, and wait for the exit.
async fn terminate(proc: &mut Proc) -> TestResult {
    let pid = proc.pid().ok_or("idemd already gone")?;
    let status = Command::new("kill").args(["-TERM", &pid.to_string()]).status()?;
    assert!(status.success(), "kill -TERM {pid}");
    let deadline = Instant::now() + Duration::from_secs(15);
    while !proc.exited() {
        if Instant::now() > deadline {
            return Err(format!("idemd did not exit on SIGTERM:\n{}", proc.log_text()).into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

fn acquire_request(key: &str, lease_ms: u64) -> AcquireRequest {
    AcquireRequest {
        key: OpKey::parse(key).expect("key"),
        param_hash: "p".repeat(64),
        subject_hash: "s".repeat(32),
        scope: "payments.transfer".into(),
        lease_ms,
        trace_id: "req-1".into(),
        mode: Default::default(),
        exp: None,
        upstream_ignores_keys: false,
        business_ref: None,
        fields: None,
        approval: None,
    }
}

/// A receiver and an idemd on `fx`'s stores (exporting to it when `export`), healthy.
struct Running {
    receiver: OtlpReceiver,
    base: String,
    proc: Proc,
    _dir: tempfile::TempDir,
}

async fn start(fx: &Fixture, export: bool, extra: &[(&str, &str)]) -> Result<Running, Box<dyn std::error::Error>> {
    let receiver = OtlpReceiver::start().await?;
    let dir = tempfile::tempdir()?;
    let port = free_port()?;
    let base = format!("http://127.0.0.1:{port}");
    let mut proc = idemd(fx, dir.path(), port, export.then(|| receiver.base_url()).as_deref(), extra)?;
    wait_healthy(&base, &mut proc).await?;
    Ok(Running { receiver, base, proc, _dir: dir })
}

/// What a SQL statement's span is named after (`store::store_span`: the backend's name).
fn sql_system(fx: &Fixture) -> &'static str {
    match fx.sql {
        Backend::Postgres => "postgres",
        Backend::MariaDb => "mysql",
        Backend::Sqlite => "sqlite",
    }
}

/// Each test on every store: `$sql` with and without the shared Redis, on a database of the test's own
/// (the reconciler decides every stale row it sees).
macro_rules! on_every_store {
    ($($test:ident),* $(,)?) => {
        $(
            mod $test {
                use super::*;

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn sqlite() -> TestResult { run(Backend::Sqlite, false).await }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn redis_sqlite() -> TestResult { run(Backend::Sqlite, true).await }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn postgres() -> TestResult { run(Backend::Postgres, false).await }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn redis_postgres() -> TestResult { run(Backend::Postgres, true).await }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn mariadb() -> TestResult { run(Backend::MariaDb, false).await }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn redis_mariadb() -> TestResult { run(Backend::MariaDb, true).await }

                async fn run(sql: Backend, with_redis: bool) -> TestResult {
                    match Fixture::isolated(sql, with_redis).await {
                        Some(fx) => super::$test(&fx).await,
                        None => Ok(()),
                    }
                }
            }
        )*
    };
}

on_every_store!(
    api_calls_continue_the_callers_trace_and_store_calls_are_their_children,
    a_reconciler_lookup_is_traced_and_carries_its_context_to_the_status_endpoint,
);

/// `POST /v1/acquire` as the filter calls it, with `traceparent` when given.
async fn acquire(
    base: &str,
    key: &str,
    lease_ms: u64,
    traceparent: Option<&str>,
) -> reqwest::Result<reqwest::Response> {
    let mut call = reqwest::Client::new().post(format!("{base}/v1/acquire")).bearer_auth(TOKEN);
    if let Some(tp) = traceparent {
        call = call.header("traceparent", tp).header("tracestate", "idem=1");
    }
    call.json(&acquire_request(key, lease_ms)).send().await
}

/// The one `name` span of the caller's trace.
fn one<'a>(spans: &'a [ReceivedSpan], name: &str) -> &'a ReceivedSpan {
    let found: Vec<&ReceivedSpan> = spans.iter().filter(|s| s.name == name && s.trace_id == TRACE_ID).collect();
    assert_eq!(found.len(), 1, "exactly one {name:?} span in the caller's trace: {spans:#?}");
    found[0]
}

async fn api_calls_continue_the_callers_trace_and_store_calls_are_their_children(fx: &Fixture) -> TestResult {
    let Running { receiver, base, mut proc, _dir } = start(fx, true, &[]).await?;
    let with_redis = fx.redis.is_some();
    let sql = sql_system(fx);

    let http = reqwest::Client::new();
    let traceparent = format!("00-{TRACE_ID}-{CALLER_SPAN}-01");
    let key = new_key();
    let acquired: serde_json::Value =
        acquire(&base, &key, 60_000, Some(&traceparent)).await?.error_for_status()?.json().await?;
    assert_eq!(acquired["outcome"], "ACQUIRED", "{acquired}");
    let owner = acquired["owner"].as_str().ok_or("no owner")?;
    let complete = serde_json::json!({
        "key": key, "owner": owner, "state": "DONE", "result": {"status": 201, "body_b64": ""}
    });
    let completed: serde_json::Value = http
        .post(format!("{base}/v1/complete"))
        .bearer_auth(TOKEN)
        .header("traceparent", &traceparent)
        .json(&complete)
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    assert_eq!(completed["outcome"], "OK", "{completed}");
    // A log line of a call carries the call's span, with the filter's trace id (the same stale filter
    // state dropped it from the log lines' context too).
    let mut mismatch = acquire_request(&key, 60_000);
    mismatch.param_hash = "q".repeat(64);
    let refused: serde_json::Value = http
        .post(format!("{base}/v1/acquire"))
        .bearer_auth(TOKEN)
        .header("x-request-id", "log-line-trace-7")
        .json(&mismatch)
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(refused["outcome"], "PARAM_MISMATCH", "{refused}");
    let logs = proc.log_text();
    let line = logs.lines().find(|l| l.contains("nonce reused")).ok_or_else(|| format!("no warning:\n{logs}"))?;
    assert!(line.contains("trace_id=\"log-line-trace-7\""), "the warning is in its call's span: {line}");

    // Nothing is exported before the shutdown flush (the schedule delay is a minute) ...
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(receiver.spans().is_empty(), "exported before shutdown: {:#?}", receiver.spans());
    // ... and everything is after it.
    terminate(&mut proc).await?;
    let spans = receiver
        .wait_for(Duration::from_secs(5), "idemd acquire and complete spans", |s| {
            s.iter().any(|s| s.name == "idemd acquire") && s.iter().any(|s| s.name == "idemd complete")
        })
        .await?;
    assert!(receiver.refused().is_empty(), "{:?}", receiver.refused());

    for api in ["idemd acquire", "idemd complete"] {
        let span = one(&spans, api);
        assert_eq!(span.service, "idemd");
        assert_eq!(span.kind, 2, "{api} is a server span");
        assert_eq!(span.trace_id, TRACE_ID, "{api} is in the caller's trace");
        assert_eq!(span.parent, CALLER_SPAN, "{api}'s parent is the caller's span");
        assert_eq!(span.attribute("http.response.status_code"), Some("200"));
        let children: Vec<&ReceivedSpan> = spans.iter().filter(|s| s.parent == span.span_id).collect();
        assert!(
            children.iter().any(|c| c.name.starts_with(&format!("{sql} "))),
            "{api} has a SQL child: {children:#?}"
        );
        if with_redis {
            assert!(children.iter().any(|c| c.name.starts_with("redis ")), "{api} has a Redis child: {children:#?}");
        }
        for child in children {
            assert_eq!(child.trace_id, TRACE_ID);
            assert_eq!(child.kind, 3, "store calls are client spans");
            assert!(child.attribute("db.operation.name").is_some(), "{child:?}");
        }
    }
    // The health checks' pings (wait_healthy's /healthz, the probe's) are no traces of their own.
    let orphans: Vec<&ReceivedSpan> =
        spans.iter().filter(|s| s.attribute("db.operation.name").is_some() && s.parent.is_empty()).collect();
    assert!(orphans.is_empty(), "store spans outside any call: {orphans:#?}");
    // The exact store calls of a fresh acquire and a complete (store::Store::acquire/complete).
    let acquire = one(&spans, "idemd acquire");
    let names = |parent: &str| {
        let mut n: Vec<String> = spans.iter().filter(|s| s.parent == parent).map(|s| s.name.clone()).collect();
        n.sort();
        n
    };
    let mut want_acquire = vec![format!("{sql} insert")];
    let mut want_complete = vec![format!("{sql} complete")];
    if with_redis {
        want_acquire.push("redis acquire".into());
        want_complete.push("redis complete".into());
        want_acquire.sort();
        want_complete.sort();
    }
    assert_eq!(names(&acquire.span_id), want_acquire);
    assert_eq!(names(&one(&spans, "idemd complete").span_id), want_complete);
    Ok(())
}

async fn a_reconciler_lookup_is_traced_and_carries_its_context_to_the_status_endpoint(fx: &Fixture) -> TestResult {
    // The upstream's status endpoint: records the traceparent of each lookup and answers 404 (never ran).
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let status = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let status_port = status.local_addr()?.port();
    let record = Arc::clone(&seen);
    let app = axum::Router::new().route(
        "/status/{key}",
        axum::routing::get(move |headers: axum::http::HeaderMap| {
            let record = Arc::clone(&record);
            async move {
                let tp = headers.get("traceparent").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
                record.lock().expect("lock").push(tp);
                axum::http::StatusCode::NOT_FOUND
            }
        }),
    );
    tokio::spawn(async move { axum::serve(status, app).await });

    let endpoint = format!("payments.transfer=http://127.0.0.1:{status_port}/status/{{key}}");
    let Running { receiver, base, mut proc, _dir } = start(
        fx,
        true,
        &[
            ("IDEM_STATUS_ENDPOINTS", &endpoint),
            ("IDEM_RECONCILE_INTERVAL_MS", "100"),
            ("IDEM_RECONCILE_GRACE_MS", "0"),
            // The shortest lease the TTL rules allow with these timeouts: the row is stale 1.5 s after acquire.
            ("IDEM_LEASE_MS", "1500"),
            ("IDEM_UPSTREAM_WORST_CASE_MS", "500"),
            ("IDEM_GATEWAY_TIMEOUT_MS", "500"),
            ("IDEM_RETRY_BACKOFF_TOTAL_MS", "100"),
        ],
    )
    .await?;

    // An executor that acquired with a short lease and went silent.
    let key = new_key();
    let acquired: serde_json::Value = acquire(&base, &key, 200, None).await?.json().await?;
    assert_eq!(acquired["outcome"], "ACQUIRED", "{acquired}");
    // Until the row is decided (a 404 after the grace: released), so its span has ended before the shutdown.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let metrics = reqwest::get(format!("{base}/metrics")).await?.text().await?;
        if metrics
            .lines()
            .any(|l| l.starts_with("idem_reconcile_total{") && l.contains("released") && !l.ends_with(" 0"))
        {
            break;
        }
        assert!(Instant::now() < deadline, "no reconciler decision within 15 s:\n{}", proc.log_text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    terminate(&mut proc).await?;
    let spans = receiver
        .wait_for(Duration::from_secs(5), "a reconciler status lookup span", |s| {
            s.iter().any(|s| s.name == "reconciler status lookup")
        })
        .await?;
    let lookup = spans.iter().find(|s| s.name == "reconciler status lookup").ok_or("no lookup span")?;
    assert_eq!(lookup.kind, 3, "a lookup is a client span");
    assert_eq!(lookup.attribute("answer"), Some("not_found"));
    let row = spans.iter().find(|s| s.span_id == lookup.parent).ok_or("the lookup's parent was not exported")?;
    assert_eq!(row.name, "idemd reconcile");
    assert_eq!(row.attribute("key"), Some(key.as_str()));
    assert_eq!(row.trace_id, lookup.trace_id);
    // The status endpoint got the lookup span's context: the upstream's trace of it joins the reconciler's.
    let first = seen.lock().expect("lock")[0].clone();
    assert_eq!(first, format!("00-{}-{}-01", lookup.trace_id, lookup.span_id));
    Ok(())
}

#[tokio::test]
async fn without_an_endpoint_nothing_is_exported() -> TestResult {
    let Some(fx) = Fixture::new(Backend::Sqlite, false).await else { return Ok(()) };
    // OTEL_EXPORTER_OTLP_ENDPOINT names a receiver: idemd must not export on it alone.
    let other = OtlpReceiver::start().await?;
    let Running { receiver, base, mut proc, _dir } =
        start(&fx, false, &[("OTEL_EXPORTER_OTLP_ENDPOINT", &other.base_url())]).await?;
    let traceparent = format!("00-{TRACE_ID}-{CALLER_SPAN}-01");
    let answer = acquire(&base, &new_key(), 60_000, Some(&traceparent)).await?;
    assert_eq!(answer.status(), 200);
    terminate(&mut proc).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    for r in [&receiver, &other] {
        assert!(r.spans().is_empty() && r.refused().is_empty(), "{:#?}", r.spans());
    }
    assert!(!proc.log_text().contains("exporting traces"), "{}", proc.log_text());
    Ok(())
}
