//! The reconciler, the reaper and the operator's resolve on real stores,
//! each test on a database of its own (they work on whole tables), against a
//! fake upstream status-by-key endpoint whose answers the test sets per key.

#[macro_use]
mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use clap::Parser;
use common::{acq, new_key, settings, simple_result, Backend, Fixture};
use idem_core::protocol::{decode_body, Ack, AcquireOutcome, CompleteRequest, OpState, TerminalState};
use idemd::ops::OpsError;
use idemd::reaper::Reaper;
use idemd::reconcile::decide::Rules;
use idemd::reconcile::lookup::StatusClient;
use idemd::reconcile::target::StatusEndpoints;
use idemd::reconcile::{PassReport, ReconcileSettings, Reconciler};
use idemd::store::{Store, StoreSettings};

const RECORD: &str = r#"{"transfer_id":"t_42","status":"executed","amount":"12.50"}"#;

// ---- a fake upstream ------------------------------------------------------

#[derive(Clone, Debug)]
enum Reply {
    Found(&'static str),
    NotFound,
    Status(u16),
    Slow(Duration, &'static str),
}

#[derive(Default)]
struct UpstreamState {
    replies: HashMap<String, Reply>,
    hits: HashMap<String, usize>,
    /// Keys whose request did not carry a matching Idempotency-Key.
    wrong_header: Vec<String>,
}

#[derive(Clone)]
struct Upstream {
    addr: SocketAddr,
    state: Arc<Mutex<UpstreamState>>,
}

impl Upstream {
    async fn start() -> Self {
        let state: Arc<Mutex<UpstreamState>> = Arc::default();
        let app = axum::Router::new()
            .route("/by-key/{key}", axum::routing::get(by_key))
            .route("/by-ref/{reference}", axum::routing::get(by_ref))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { addr, state }
    }

    fn set(&self, key: &str, reply: Reply) {
        self.state.lock().expect("state").replies.insert(key.to_string(), reply);
    }

    fn hits(&self, key: &str) -> usize {
        self.state.lock().expect("state").hits.get(key).copied().unwrap_or(0)
    }

    fn template(&self) -> String {
        format!("http://{}/by-key/{{key}}", self.addr)
    }
}

async fn by_key(
    State(state): State<Arc<Mutex<UpstreamState>>>,
    Path(key): Path<String>,
    headers: HeaderMap,
) -> Response {
    let reply = {
        let mut s = state.lock().expect("state");
        *s.hits.entry(key.clone()).or_default() += 1;
        if headers.get("idempotency-key").and_then(|v| v.to_str().ok()) != Some(key.as_str()) {
            s.wrong_header.push(key.clone());
        }
        s.replies.get(&key).cloned().unwrap_or(Reply::NotFound)
    };
    let found = |body: &'static str| (StatusCode::OK, [("content-type", "application/json")], body).into_response();
    match reply {
        Reply::Found(body) => found(body),
        Reply::NotFound => (StatusCode::NOT_FOUND, "{\"error\":\"not_found\"}").into_response(),
        Reply::Status(s) => StatusCode::from_u16(s).expect("status").into_response(),
        Reply::Slow(d, body) => {
            tokio::time::sleep(d).await;
            found(body)
        }
    }
}

/// The upstream's record by client reference, answered like `by_key` from the same replies
/// (set under `ref:<reference>`, the reference as the upstream decoded it from the path).
async fn by_ref(State(state): State<Arc<Mutex<UpstreamState>>>, Path(reference): Path<String>) -> Response {
    let key = format!("ref:{reference}");
    let reply = {
        let mut s = state.lock().expect("state");
        *s.hits.entry(key.clone()).or_default() += 1;
        s.replies.get(&key).cloned().unwrap_or(Reply::NotFound)
    };
    match reply {
        Reply::Found(body) => (StatusCode::OK, [("content-type", "application/json")], body).into_response(),
        _ => (StatusCode::NOT_FOUND, "{\"error\":\"not_found\"}").into_response(),
    }
}

// ---- helpers ---------------------------------------------------------------

const SCOPE: &str = common::SCOPE;

fn rules(grace_ms: u64, retry_budget: u32) -> Rules {
    Rules { grace_ms, retry_budget, readings: Default::default() }
}

/// A reconciler over `store`; `up` answers for SCOPE when given.
fn reconciler(store: &Arc<Store>, up: Option<&Upstream>, rules: Rules, instance: &str) -> Arc<Reconciler> {
    let mut endpoints = StatusEndpoints::new();
    if let Some(up) = up {
        endpoints.insert(SCOPE.to_string(), up.template());
    }
    let status = StatusClient::new(endpoints, Duration::from_millis(300)).expect("status client");
    let settings = ReconcileSettings { rules, batch: 100, claim_ms: 5_000, instance: instance.to_string() };
    Arc::new(Reconciler::new(store.clone(), status, settings))
}

/// A store whose leases last 100 ms, and `n` operations acquired on it whose
/// leases have run out: (key, owner).
async fn stale(fx: &Fixture, n: usize) -> (Arc<Store>, Vec<(String, String)>) {
    let store = fx.store_with(StoreSettings { lease_ms: 100, ..settings() }).await;
    let mut rows = Vec::new();
    for _ in 0..n {
        let key = new_key();
        let a = store.acquire(&acq(&key)).await;
        assert_eq!(a.outcome, AcquireOutcome::Acquired, "{a:?}");
        rows.push((key, a.owner.expect("owner").to_string()));
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    (store, rows)
}

async fn state_of(store: &Store, key: &str) -> Option<OpState> {
    store.operation(key).await.expect("sql").map(|v| v.state)
}

async fn actions(store: &Store, key: &str) -> Vec<String> {
    store.sql().history(key).await.expect("history").into_iter().map(|h| format!("{}:{}", h.actor, h.action)).collect()
}

fn metric(store: &Store, line: &str) -> bool {
    store.metrics().encode().lines().any(|l| l == line)
}

async fn ops(fx: &Fixture, args: &[&str]) -> Result<String, OpsError> {
    ops_as(fx, "alice", args).await
}

/// `idemd ops` as operator `actor`.
async fn ops_as(fx: &Fixture, actor: &str, args: &[&str]) -> Result<String, OpsError> {
    let mut argv = vec!["idemd", "ops", "--database-url", fx.sql_url.as_str(), "--actor", actor];
    argv.extend_from_slice(args);
    let cli = idemd::config::Cli::try_parse_from(argv).expect("ops arguments");
    let idemd::config::Command::Ops(a) = cli.command else { panic!("not ops") };
    idemd::ops::run(a).await
}

// ---- scenarios ---------------------------------------------------------------

/// The upstream has a record: DONE with that record, replayed to the next
/// acquire, cached in Redis, audited and counted.
async fn found_becomes_done_with_the_record(fx: &Fixture) {
    let up = Upstream::start().await;
    let (store, rows) = stale(fx, 1).await;
    let (key, _) = &rows[0];
    up.set(key, Reply::Found(RECORD));
    let r = reconciler(&store, Some(&up), rules(60_000, 3), "t1");
    let report = r.pass().await.expect("pass");
    assert_eq!(report, PassReport { done: 1, ..Default::default() });

    let a = store.acquire(&acq(key)).await;
    assert_eq!(a.outcome, AcquireOutcome::Done, "{a:?}");
    let result = a.result.expect("result");
    assert_eq!(result.status, 200);
    assert_eq!(decode_body(&result.body_b64).expect("body"), RECORD.as_bytes());
    assert_eq!(result.headers, vec![("content-type".to_string(), "application/json".to_string())]);
    if let Some(redis) = &fx.redis {
        assert_eq!(redis.hgetall(key).await.get("state").map(String::as_str), Some("DONE"));
    }
    assert_eq!(actions(&store, key).await, ["filter:acquire", "reconciler:t1:reconcile_done"]);
    let history = store.sql().history(key).await.expect("history");
    assert_eq!((history[1].from_state.as_deref(), history[1].to_state.as_deref()), (Some("IN_FLIGHT"), Some("DONE")));
    assert!(history[1].why.contains("answered 200"), "{history:?}");
    assert!(metric(&store, "idem_reconcile_total{decision=\"done\"} 1"), "{}", store.metrics().encode());
    assert!(
        metric(&store, "idem_reconcile_total{decision=\"needs_review\"} 0"),
        "every decision exists from the start"
    );
    assert!(up.state.lock().expect("state").wrong_header.is_empty(), "Idempotency-Key sent with the lookup");
    // Nothing left to do.
    assert_eq!(r.pass().await.expect("pass"), PassReport::default());
}

/// The upstream's record says it failed: FAILED, replayed as such.
async fn upstream_failure_becomes_failed(fx: &Fixture) {
    let up = Upstream::start().await;
    let (store, rows) = stale(fx, 1).await;
    let (key, _) = &rows[0];
    up.set(key, Reply::Found(r#"{"transfer_id":"t_43","status":"failed","error":"insufficient_funds"}"#));
    let report = reconciler(&store, Some(&up), rules(60_000, 3), "t2").pass().await.expect("pass");
    assert_eq!(report.failed, 1, "{report:?}");
    let a = store.acquire(&acq(key)).await;
    assert_eq!(a.outcome, AcquireOutcome::Failed);
    assert_eq!(actions(&store, key).await[1], "reconciler:t2:reconcile_failed");
}

/// 404 right after the lease: maybe still queued upstream, so wait (the row
/// is given back untouched and its executor may still complete it). 404 after
/// the grace: released, gone from Redis, and the nonce runs again.
async fn not_found_waits_for_the_grace_then_releases(fx: &Fixture) {
    let up = Upstream::start().await;
    let (store, rows) = stale(fx, 2).await;
    let (late, late_owner) = &rows[0];
    let (never, never_owner) = &rows[1];
    let r = reconciler(&store, Some(&up), rules(600, 3), "t3");

    let report = r.pass().await.expect("pass");
    assert_eq!(report, PassReport { skipped_grace: 2, ..Default::default() });
    for (key, owner) in &rows {
        let v = store.operation(key).await.expect("sql").expect("row");
        assert_eq!((v.state, v.owner.as_deref()), (OpState::InFlight, Some(owner.as_str())), "given back as it was");
    }
    // Its executor was only slow: its complete still counts.
    let done = simple_result("late");
    let ack = store
        .complete(&CompleteRequest {
            key: idem_core::protocol::OpKey::parse(late).expect("key"),
            owner: idem_core::protocol::OwnerToken::parse(late_owner).expect("owner"),
            state: TerminalState::Done,
            result: done,
            trace_id: String::new(),
        })
        .await;
    assert_eq!(ack.outcome, Ack::Ok);

    tokio::time::sleep(Duration::from_millis(600)).await;
    let report = r.pass().await.expect("pass");
    assert_eq!(report, PassReport { released: 1, ..Default::default() });
    assert_eq!(state_of(&store, never).await, None);
    assert_eq!(fx.count_rows(never).await, 0);
    if let Some(redis) = &fx.redis {
        assert!(redis.hgetall(never).await.is_empty(), "released in Redis too");
    }
    let again = store.acquire(&acq(never)).await;
    assert_eq!(again.outcome, AcquireOutcome::Acquired, "released: the same nonce may run");
    assert_ne!(again.owner.as_deref(), Some(never_owner.as_str()));
    assert_eq!(actions(&store, never).await, ["filter:acquire", "reconciler:t3:reconcile_release", "filter:acquire"]);
    let why = &store.sql().history(never).await.expect("history")[1].why;
    assert!(why.contains("404") && why.contains("never executed"), "{why}");
    assert!(metric(&store, "idem_reconcile_total{decision=\"skipped_grace\"} 2"));
    assert!(metric(&store, "idem_reconcile_total{decision=\"released\"} 1"));
}

/// Errors, timeouts and refused connections use up the retry budget, one per
/// pass, then NEEDS_REVIEW — which an acquire answers, from Redis or SQL.
async fn lookup_failures_retry_then_need_review(fx: &Fixture) {
    let up = Upstream::start().await;
    let (store, rows) = stale(fx, 2).await;
    let (erroring, _) = &rows[0];
    let (slow, _) = &rows[1];
    up.set(erroring, Reply::Status(500));
    up.set(slow, Reply::Slow(Duration::from_millis(2_000), RECORD));
    let r = reconciler(&store, Some(&up), rules(0, 3), "t4");
    for attempt in 1..=2 {
        let report = r.pass().await.expect("pass");
        assert_eq!(report, PassReport { retry: 2, ..Default::default() }, "pass {attempt}");
        let v = store.sql().get(erroring).await.expect("sql").expect("row");
        assert_eq!((v.state, v.reconcile_attempts), (OpState::InFlight, attempt));
    }
    let report = r.pass().await.expect("pass");
    assert_eq!(report, PassReport { needs_review: 2, ..Default::default() });
    for key in [erroring, slow] {
        assert_eq!(store.acquire(&acq(key)).await.outcome, AcquireOutcome::NeedsReview);
        assert_eq!(store.acquire(&acq(key)).await.outcome, AcquireOutcome::NeedsReview, "from Redis too");
    }
    let history = store.sql().history(erroring).await.expect("history");
    let acts: Vec<&str> = history.iter().map(|h| h.action.as_str()).collect();
    assert_eq!(acts, ["acquire", "reconcile_retry", "reconcile_retry", "reconcile_needs_review"]);
    assert!(history[3].why.contains("after 3 attempts") && history[3].why.contains("answered 500"), "{history:?}");
    let slow_why = &store.sql().history(slow).await.expect("history")[3].why;
    assert!(slow_why.contains("no answer within 300 ms"), "{slow_why}");
    assert!(metric(&store, "idem_needs_review_backlog 2"), "{}", store.metrics().encode());
    // Each lookup counted by its scope and result (the alert on failing lookups reads these).
    let lookups = |result: &str| format!("idem_reconcile_lookups_total{{scope=\"{SCOPE}\",result=\"{result}\"}}");
    assert!(metric(&store, &format!("{} 6", lookups("failed"))), "{}", store.metrics().encode());
    assert!(metric(&store, &format!("{} 0", lookups("found"))), "every result exists from the start");
}

/// The store probe's gauges: how many rows are IN_FLIGHT, how long ago the
/// earliest of their leases ended (the reconciler's lag), how many wait for a
/// person; all from SQL, with no reconciler running.
async fn the_probe_reports_the_backlog_without_a_reconciler(fx: &Fixture) {
    let (store, rows) = stale(fx, 2).await;
    let live = new_key();
    let a = store.acquire(&idem_core::protocol::AcquireRequest { lease_ms: 600_000, ..acq(&live) }).await;
    assert_eq!(a.outcome, AcquireOutcome::Acquired);
    let probe = idemd::probe::Probe::new(store.clone());
    let (health, backlog) = probe.once().await;
    assert_eq!(health.sql, "up");
    let backlog = backlog.expect("the backlog");
    assert_eq!((backlog.in_flight, backlog.needs_review), (3, 0));
    assert!(backlog.overdue_ms >= 50, "the stale leases ended at least 50 ms ago: {backlog:?}");
    assert!(metric(&store, "idem_in_flight 3"), "{}", store.metrics().encode());
    // Seen 90 s later, the earliest lease is 90 s overdue more: the gauge an alert compares with the grace.
    let later = store.sql().backlog(idemd::store::now_ms() + 90_000).await.expect("backlog");
    assert!(later.overdue_ms >= 90_000 + 50 && later.overdue_ms < 90_000 + 60_000, "{later:?}");

    // No endpoint for the scope: both stale rows go to NEEDS_REVIEW; the live one stays.
    let report = reconciler(&store, None, rules(0, 3), "t13").pass().await.expect("pass");
    assert_eq!(report.needs_review, 2, "{report:?}");
    let (_, backlog) = probe.once().await;
    let backlog = backlog.expect("the backlog");
    assert_eq!((backlog.in_flight, backlog.overdue_ms, backlog.needs_review), (1, 0, 2), "{rows:?}");
    assert!(metric(&store, "idem_in_flight 1") && metric(&store, "idem_in_flight_overdue_seconds 0"));
    assert!(metric(&store, "idem_needs_review_backlog 2"), "{}", store.metrics().encode());
}

/// An upstream with its own schema, declared per scope: `{"state":"SETTLED"}`
/// is DONE and replays with the route's 201; `{"state":"REJECTED"}` is FAILED
/// with 422; `{"state":"PENDING"}` is no evidence yet.
async fn a_declared_reading_decides_and_replays_with_the_declared_status(fx: &Fixture) {
    let up = Upstream::start().await;
    let (store, rows) = stale(fx, 3).await;
    let (settled, rejected, pending) = (&rows[0].0, &rows[1].0, &rows[2].0);
    up.set(settled, Reply::Found(r#"{"id":"t_50","state":"SETTLED"}"#));
    up.set(rejected, Reply::Found(r#"{"id":"t_51","state":"REJECTED","reason":"limit"}"#));
    up.set(pending, Reply::Found(r#"{"id":"t_52","state":"PENDING"}"#));
    let reading = idemd::reconcile::decide::Reading::parse(
        "pointer=/state;done=SETTLED|EXECUTED;failed=REJECTED;done_status=201;failed_status=422",
    )
    .expect("reading");
    let readings = [(SCOPE.to_string(), reading)].into_iter().collect();
    let rules = Rules { readings: Arc::new(readings), ..rules(60_000, 3) };
    let report = reconciler(&store, Some(&up), rules, "t12").pass().await.expect("pass");
    assert_eq!(report, PassReport { done: 1, failed: 1, retry: 1, ..Default::default() }, "{report:?}");
    let done = store.acquire(&acq(settled)).await;
    assert_eq!(done.outcome, AcquireOutcome::Done);
    assert_eq!(done.result.expect("result").status, 201, "replays like the original 201");
    let failed = store.acquire(&acq(rejected)).await;
    assert_eq!(failed.outcome, AcquireOutcome::Failed);
    let failed = failed.result.expect("result");
    assert_eq!(failed.status, 422);
    assert!(decode_body(&failed.body_b64).is_some_and(|b| b.starts_with(br#"{"id":"t_51""#)));
    assert_eq!(state_of(&store, pending).await, Some(OpState::InFlight), "PENDING is not evidence");
    let why = &store.sql().history(pending).await.expect("history")[1].why;
    assert!(why.contains("/state = \"PENDING\", neither done nor failed"), "{why}");
}

/// A scope without a status endpoint cannot be asked: NEEDS_REVIEW at once.
async fn no_endpoint_needs_review_at_once(fx: &Fixture) {
    let (store, rows) = stale(fx, 1).await;
    let (key, owner) = &rows[0];
    let report = reconciler(&store, None, rules(0, 3), "t5").pass().await.expect("pass");
    assert_eq!(report, PassReport { needs_review: 1, ..Default::default() });
    let v = store.sql().get(key).await.expect("sql").expect("row");
    assert_eq!(v.state, OpState::NeedsReview);
    assert_eq!(v.owner.as_deref(), Some(owner.as_str()), "the executor stays on record");
    assert_eq!(store.acquire(&acq(key)).await.outcome, AcquireOutcome::NeedsReview);
    if let Some(redis) = &fx.redis {
        assert_eq!(redis.hgetall(key).await.get("state").map(String::as_str), Some("NEEDS_REVIEW"));
    }
    let why = &store.sql().history(key).await.expect("history")[1].why;
    assert_eq!(why, &format!("no status endpoint is configured for scope {SCOPE}"));
}

/// Operations whose upstream ignores `Idempotency-Key` (DESIGN §4): the row keeps that and the
/// business reference (migration 0006, on every backend); the reconciler asks by reference — found
/// is DONE, a 404 after the grace releases — and never by key: on a key-only endpoint such a row
/// goes to NEEDS_REVIEW without a lookup, its reason in the audit line. A row without a reference
/// on a `{ref}`-only endpoint cannot be asked either. And a record under the reference settles only
/// the operation whose bound fields it carries: another amount under the same reference (a transfer
/// idemd never saw) sends the row to a person, never DONE with that record.
async fn an_upstream_that_ignores_keys_is_asked_by_its_reference(fx: &Fixture) {
    const KEY_ONLY_SCOPE: &str = "payments.keyonly";
    let up = Upstream::start().await;
    let store = fx.store_with(StoreSettings { lease_ms: 100, ..settings() }).await;
    let (executed, unknown, key_only, plain, foreign) = (new_key(), new_key(), new_key(), new_key(), new_key());
    // RECORD's amount; another one for the row whose reference names someone else's transfer.
    let (ours, theirs) = (r#"{"/amount":12.5}"#, r#"{"/amount":99}"#);
    for (key, scope, reference, fields) in [
        (&executed, SCOPE, Some("inv/7 Müller"), ours),
        (&unknown, SCOPE, Some("inv-8"), ours),
        (&key_only, KEY_ONLY_SCOPE, Some("inv-9"), ours),
        (&plain, SCOPE, None, ours),
        (&foreign, SCOPE, Some("inv-10"), theirs),
    ] {
        let req = idem_core::protocol::AcquireRequest {
            scope: scope.to_string(),
            upstream_ignores_keys: reference.is_some(),
            business_ref: reference.map(str::to_string),
            fields: Some(fields.to_string()),
            ..acq(key)
        };
        assert_eq!(store.acquire(&req).await.outcome, AcquireOutcome::Acquired);
        let row = store.sql().get(key).await.expect("sql").expect("row");
        let stored = (row.upstream_ignores_keys, row.business_ref.as_deref());
        assert_eq!(stored, (reference.is_some(), reference), "{}", fx.label());
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    up.set("ref:inv/7 Müller", Reply::Found(RECORD));
    up.set("ref:inv-10", Reply::Found(RECORD));
    // Were it asked by key, key_only would be found.
    up.set(&key_only, Reply::Found(RECORD));

    let mut endpoints = StatusEndpoints::new();
    endpoints.insert(SCOPE.to_string(), format!("http://{}/by-ref/{{ref}}", up.addr));
    endpoints.insert(KEY_ONLY_SCOPE.to_string(), up.template());
    let status = StatusClient::new(endpoints, Duration::from_millis(300)).expect("status client");
    let settings = ReconcileSettings { rules: rules(0, 3), batch: 100, claim_ms: 5_000, instance: "t13".into() };
    let report = Arc::new(Reconciler::new(store.clone(), status, settings)).pass().await.expect("pass");
    let want = PassReport { done: 1, released: 1, needs_review: 3, ..Default::default() };
    assert_eq!(report, want, "{}", fx.label());

    let done = store.acquire(&acq(&executed)).await;
    assert_eq!(done.outcome, AcquireOutcome::Done);
    assert_eq!(decode_body(&done.result.expect("result").body_b64).expect("body"), RECORD.as_bytes());
    assert_eq!(up.hits("ref:inv/7 Müller"), 1, "the reference reached the upstream whole (percent-encoded)");
    assert_eq!(state_of(&store, &unknown).await, None, "no record under its reference: released");
    let why = store.sql().history(&unknown).await.expect("history").pop().expect("line").why;
    assert!(why.contains("by business reference") && why.contains("no record under that reference"), "{why}");

    assert_eq!(state_of(&store, &key_only).await, Some(OpState::NeedsReview));
    let why = store.sql().history(&key_only).await.expect("history").pop().expect("line").why;
    assert!(why.starts_with("upstream ignores keys and no business-reference lookup: "), "{why}");
    assert_eq!(state_of(&store, &plain).await, Some(OpState::NeedsReview));
    let why = store.sql().history(&plain).await.expect("history").pop().expect("line").why;
    assert!(why.contains("looks up by {ref} only, and the operation has no business reference"), "{why}");
    assert_eq!(
        state_of(&store, &foreign).await,
        Some(OpState::NeedsReview),
        "another transfer's record settles nothing"
    );
    let why = store.sql().history(&foreign).await.expect("history").pop().expect("line").why;
    assert!(why.contains("a record not proven this operation's (/amount differs)"), "{why}");
    let by_key: usize = [&executed, &unknown, &key_only, &plain, &foreign].iter().map(|k| up.hits(k)).sum();
    assert_eq!(by_key, 0, "nothing was asked by key");
}

/// A live lease is its executor's: the reconciler neither asks nor touches it.
async fn live_leases_are_left_alone(fx: &Fixture) {
    let up = Upstream::start().await;
    let store = fx.store().await;
    let key = new_key();
    assert_eq!(store.acquire(&acq(&key)).await.outcome, AcquireOutcome::Acquired);
    let report = reconciler(&store, Some(&up), rules(0, 3), "t6").pass().await.expect("pass");
    assert_eq!(report, PassReport::default());
    assert_eq!(up.hits(&key), 0);
}

/// Three replicas reconcile the same rows at once: each row is claimed,
/// asked about and decided exactly once.
async fn concurrent_reconcilers_decide_each_row_once(fx: &Fixture) {
    let up = Upstream::start().await;
    let (store, rows) = stale(fx, 24).await;
    for (i, (key, _)) in rows.iter().enumerate() {
        up.set(key, if i % 2 == 0 { Reply::Slow(Duration::from_millis(30), RECORD) } else { Reply::NotFound });
    }
    let mut replicas = Vec::new();
    for i in 0..3 {
        let replica = fx.store().await;
        replicas.push(reconciler(&replica, Some(&up), rules(0, 3), &format!("r{i}")));
    }
    let mut passes = tokio::task::JoinSet::new();
    for _ in 0..2 {
        for r in &replicas {
            let r = r.clone();
            passes.spawn(async move { r.pass().await.expect("pass") });
        }
    }
    let mut total = PassReport::default();
    while let Some(report) = passes.join_next().await {
        let report = report.expect("task");
        total.done += report.done;
        total.released += report.released;
        total.taken_elsewhere += report.taken_elsewhere;
        total.errors += report.errors;
    }
    assert_eq!((total.done, total.released, total.errors), (12, 12, 0), "{total:?}");
    for (i, (key, _)) in rows.iter().enumerate() {
        let decisions: Vec<String> =
            actions(&store, key).await.into_iter().filter(|a| a.starts_with("reconciler:")).collect();
        assert_eq!(decisions.len(), 1, "{key}: {decisions:?}");
        assert_eq!(up.hits(key), 1, "{key} asked once");
        let expected = if i % 2 == 0 { Some(OpState::Done) } else { None };
        assert_eq!(state_of(&store, key).await, expected);
    }
}

/// The original executor completes while the reconciler holds the claim:
/// NOT_OWNER, and the reconciler records what the upstream says.
async fn late_complete_during_a_claim_is_not_owner(fx: &Fixture) {
    let up = Upstream::start().await;
    let (store, rows) = stale(fx, 1).await;
    let (key, owner) = rows[0].clone();
    up.set(&key, Reply::Slow(Duration::from_millis(150), RECORD));
    let r = reconciler(&store, Some(&up), rules(0, 3), "t8");
    let pass = tokio::spawn(async move { r.pass().await.expect("pass") });
    tokio::time::sleep(Duration::from_millis(60)).await;
    let ack = store
        .complete(&CompleteRequest {
            key: idem_core::protocol::OpKey::parse(&key).expect("key"),
            owner: idem_core::protocol::OwnerToken::parse(&owner).expect("owner"),
            state: TerminalState::Done,
            result: simple_result("late"),
            trace_id: String::new(),
        })
        .await;
    assert_eq!(ack.outcome, Ack::NotOwner);
    assert_eq!(pass.await.expect("task").done, 1);
    let a = store.acquire(&acq(&key)).await;
    assert_eq!(decode_body(&a.result.expect("result").body_b64).expect("body"), RECORD.as_bytes());
}

/// Terminal rows past the retention go in batches; IN_FLIGHT and
/// NEEDS_REVIEW stay however old; audit lines go once their row is gone.
async fn reaper_deletes_old_terminal_rows_only(fx: &Fixture) {
    let store = fx.store().await;
    let mut old_terminal = Vec::new();
    for i in 0..5 {
        let key = new_key();
        let owner = store.acquire(&acq(&key)).await.owner.expect("owner");
        let state = if i % 2 == 0 { TerminalState::Done } else { TerminalState::Failed };
        let req = CompleteRequest {
            key: idem_core::protocol::OpKey::parse(&key).expect("key"),
            owner,
            state,
            result: simple_result("old"),
            trace_id: String::new(),
        };
        assert_eq!(store.complete(&req).await.outcome, Ack::Ok);
        old_terminal.push(key);
    }
    let fresh = new_key();
    let owner = store.acquire(&acq(&fresh)).await.owner.expect("owner");
    let req = CompleteRequest {
        key: idem_core::protocol::OpKey::parse(&fresh).expect("key"),
        owner,
        state: TerminalState::Done,
        result: simple_result("new"),
        trace_id: String::new(),
    };
    assert_eq!(store.complete(&req).await.outcome, Ack::Ok);
    let (in_flight, review) = (new_key(), new_key());
    store.acquire(&acq(&in_flight)).await;
    store.acquire(&acq(&review)).await;
    fx.set_state(&review, "NEEDS_REVIEW").await;
    let released = new_key();
    let owner = store.acquire(&acq(&released)).await.owner.expect("owner");
    store
        .release(&idem_core::protocol::ReleaseRequest {
            key: idem_core::protocol::OpKey::parse(&released).expect("key"),
            owner,
            trace_id: String::new(),
        })
        .await;

    // Age everything but `fresh` by a day.
    let aged: Vec<String> =
        old_terminal.iter().chain([&in_flight, &review, &released]).map(|k| format!("'{k}'")).collect();
    let list = aged.join(",");
    fx.exec(&format!("UPDATE idem_record SET updated_at = updated_at - 86400000 WHERE idem_key IN ({list})")).await;
    fx.exec(&format!("UPDATE idem_audit SET at_ms = at_ms - 86400000 WHERE idem_key IN ({list})")).await;

    let reaped = Reaper::new(store.clone(), 3_600_000, 2).pass().await.expect("reap");
    assert_eq!(reaped.rows, 5, "{reaped:?}");
    // Five reaped rows' two lines each, and the released key's two.
    assert_eq!(reaped.audit_lines, 12, "{reaped:?}");
    for key in &old_terminal {
        assert_eq!(fx.count_rows(key).await, 0);
        assert!(store.sql().history(key).await.expect("history").is_empty());
    }
    assert!(store.sql().history(&released).await.expect("history").is_empty());
    for key in [&fresh, &in_flight, &review] {
        assert_eq!(fx.count_rows(key).await, 1, "{key} kept");
        assert!(!store.sql().history(key).await.expect("history").is_empty(), "{key}'s lines kept");
    }
    assert!(metric(&store, "idem_reaped_total 5"));
    assert_eq!(Reaper::new(store.clone(), 3_600_000, 2).pass().await.expect("reap"), Default::default());
}

/// NEEDS_REVIEW → an operator resolves it (without reaching Redis, which
/// still says NEEDS_REVIEW): the next acquire sees the decision at once.
/// Only IN_FLIGHT / NEEDS_REVIEW rows can be resolved, each step is audited.
async fn operator_resolves_what_the_reconciler_could_not(fx: &Fixture) {
    let (store, rows) = stale(fx, 3).await;
    reconciler(&store, None, rules(0, 3), "t10").pass().await.expect("pass");
    let (done, failed, released) = (&rows[0].0, &rows[1].0, &rows[2].0);
    let file = tempfile::NamedTempFile::new().expect("tmp");
    std::fs::write(file.path(), RECORD).expect("write");
    let path = file.path().display().to_string();

    let out = ops(fx, &["resolve", done, "--done", "--result-file", &path, "--why", "found t_42 in the ledger"])
        .await
        .expect("resolve --done");
    assert!(out.contains("NEEDS_REVIEW -> DONE"), "{out}");
    let a = store.acquire(&acq(done)).await;
    assert_eq!(a.outcome, AcquireOutcome::Done, "{a:?}");
    assert_eq!(decode_body(&a.result.expect("result").body_b64).expect("body"), RECORD.as_bytes());

    ops(fx, &["resolve", failed, "--failed", "--reason", "payee account closed", "--why", "bank said so"])
        .await
        .expect("resolve --failed");
    let a = store.acquire(&acq(failed)).await;
    assert_eq!(a.outcome, AcquireOutcome::Failed);
    let r = a.result.expect("result");
    assert_eq!(r.status, 422);
    let body: serde_json::Value = serde_json::from_slice(&decode_body(&r.body_b64).expect("body")).expect("json");
    assert_eq!(body, serde_json::json!({"error": "resolved_failed", "reason": "payee account closed"}));

    ops(fx, &["resolve", released, "--release", "--why", "not in the ledger"]).await.expect("resolve --release");
    assert_eq!(store.acquire(&acq(released)).await.outcome, AcquireOutcome::Acquired);

    let again = ops(fx, &["resolve", done, "--release", "--why", "oops"]).await.expect_err("DONE is final");
    assert_eq!(again.exit_code(), 3);
    assert!(again.to_string().contains("is DONE: only IN_FLIGHT or NEEDS_REVIEW"), "{again}");

    let shown = ops(fx, &["show", done, "--json"]).await.expect("show");
    let v: serde_json::Value = serde_json::from_str(&shown).expect("json");
    assert_eq!(v["operation"]["state"], "DONE");
    assert_eq!(v["operation"]["result_body"], RECORD);
    let steps: Vec<String> = v["history"]
        .as_array()
        .expect("history")
        .iter()
        .map(|h| format!("{} {} {}", h["actor"].as_str().unwrap_or(""), h["action"], h["why"]))
        .collect();
    assert_eq!(
        steps,
        [
            "filter \"acquire\" \"confirm acquired: forwarding to the upstream\"".to_string(),
            format!("reconciler:t10 \"reconcile_needs_review\" \"no status endpoint is configured for scope {SCOPE}\""),
            "operator:alice \"resolve_done\" \"found t_42 in the ledger\"".to_string(),
        ]
    );
}

/// An IN_FLIGHT row whose lease is still held is refused without --force:
/// its executor may still be running it.
async fn operator_needs_force_for_a_live_lease(fx: &Fixture) {
    let store = fx.store().await;
    let key = new_key();
    assert_eq!(store.acquire(&acq(&key)).await.outcome, AcquireOutcome::Acquired);
    let refused = ops(fx, &["resolve", &key, "--release", "--why", "stuck"]).await.expect_err("live lease");
    assert_eq!(refused.exit_code(), 3);
    assert!(refused.to_string().contains("lease held until"), "{refused}");
    let out = ops(fx, &["resolve", &key, "--release", "--why", "stuck", "--force"]).await.expect("forced");
    assert!(out.contains("IN_FLIGHT -> released"), "{out}");
    let listed = ops(fx, &["list", "--state", "in_flight", "--json"]).await.expect("list");
    assert!(!listed.contains(&key), "{listed}");
}

/// `idemd ops resolve --release` is the one decision that lets the agent's retry execute: where the
/// scope has a status endpoint it is asked at that moment, and only an upstream with no record of
/// the operation (past the grace) lets it go; a record or no answer refuses (exit 3, saying what
/// was found) and changes nothing. And the operator never settles an operation of their own subject
/// (`common::SUBJECT` is the hash of "test"), refused before the upstream is asked.
async fn an_operators_release_needs_the_upstream_to_have_no_record(fx: &Fixture) {
    let (store, rows) = stale(fx, 1).await;
    reconciler(&store, None, rules(0, 3), "t11").pass().await.expect("pass");
    let key = rows[0].0.as_str();
    assert_eq!(state_of(&store, key).await, Some(OpState::NeedsReview));
    let up = Upstream::start().await;
    let endpoint = format!("{SCOPE}={}", up.template());
    let release = ["resolve", key, "--release", "--why", "not in the ledger", "--status-endpoint", &endpoint];
    let release = [&release[..], &["--reconcile-grace-ms", "0"]].concat();

    let own = ops_as(fx, "test", &release).await.expect_err("own subject");
    assert_eq!(own.exit_code(), 3);
    assert!(own.to_string().contains("own_subject"), "{own}");
    assert_eq!(up.hits(key), 0, "refused before the upstream is asked");

    up.set(key, Reply::Found(RECORD));
    let found = ops(fx, &release).await.expect_err("a record");
    assert_eq!(found.exit_code(), 3);
    assert!(found.to_string().contains("the upstream has a record of it"), "{found}");
    assert!(found.to_string().contains("resolve it as done or failed"), "{found}");
    up.set(key, Reply::Status(503));
    let unknown = ops(fx, &release).await.expect_err("no answer");
    assert!(unknown.to_string().contains("the lookup proves nothing"), "{unknown}");
    assert_eq!(state_of(&store, key).await, Some(OpState::NeedsReview));
    assert_eq!(actions(&store, key).await, ["filter:acquire", "reconciler:t11:reconcile_needs_review"]);

    up.set(key, Reply::NotFound);
    let out = ops(fx, &release).await.expect("absent: released");
    assert!(out.contains("NEEDS_REVIEW -> released"), "{out}");
    assert_eq!(up.hits(key), 3);
    let last = store.sql().history(key).await.expect("history").pop().expect("a line");
    assert_eq!((last.actor.as_str(), last.action.as_str()), ("operator:alice", "resolve_release"));
    assert!(
        last.why.starts_with("not in the ledger [checked at the release: status endpoint answered 404"),
        "{last:?}"
    );
    assert_eq!(store.acquire(&acq(key)).await.outcome, AcquireOutcome::Acquired, "the retry runs it, once");
}

isolated_backend_suites!(
    an_operators_release_needs_the_upstream_to_have_no_record,
    found_becomes_done_with_the_record,
    upstream_failure_becomes_failed,
    a_declared_reading_decides_and_replays_with_the_declared_status,
    not_found_waits_for_the_grace_then_releases,
    lookup_failures_retry_then_need_review,
    the_probe_reports_the_backlog_without_a_reconciler,
    no_endpoint_needs_review_at_once,
    an_upstream_that_ignores_keys_is_asked_by_its_reference,
    live_leases_are_left_alone,
    concurrent_reconcilers_decide_each_row_once,
    late_complete_during_a_claim_is_not_owner,
    reaper_deletes_old_terminal_rows_only,
    operator_resolves_what_the_reconciler_could_not,
    operator_needs_force_for_a_live_lease,
);
