//! The HTTP API over a real listener: status codes, JSON shapes, keep-alive
//! clients, /healthz and /metrics. SQLite behind the shared Redis (or SQL
//! alone if Redis is missing and not required); Postgres through a cuttable
//! proxy for the 503s.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::{acq, new_key, rich_result, Backend, CutProxy, Fixture};
use idem_core::protocol::{Ack, AckResponse, AcquireOutcome, AcquireResponse, OpState, OperationView};
use idemd::auth::Tokens;
use idemd::store::Store;
use serde_json::{json, Value};

struct Server {
    base: String,
    _task: tokio::task::JoinHandle<()>,
}

const TOKEN: &str = "filter-token-0123456789";

/// idemd's API as `serve` runs it: every `/v1/*` call needs the token.
async fn serve(store: Arc<Store>) -> Server {
    serve_with(store, &[TOKEN]).await
}

async fn serve_with(store: Arc<Store>, tokens: &[&str]) -> Server {
    let tokens = Tokens::new(&tokens.iter().map(|t| t.to_string()).collect::<Vec<_>>()).expect("tokens");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr: SocketAddr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, idemd::api::router(store, tokens)).await;
    });
    Server { base: format!("http://{addr}"), _task: task }
}

/// A client that presents `token`, as the filter does.
fn client_with(token: &str) -> reqwest::Client {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(reqwest::header::AUTHORIZATION, format!("Bearer {token}").parse().expect("header"));
    reqwest::Client::builder().default_headers(headers).build().expect("client")
}

fn authed() -> reqwest::Client {
    client_with(TOKEN)
}

async fn fixture() -> Option<Fixture> {
    let redis = common::shared_redis().await;
    Fixture::with_redis(Backend::Sqlite, redis).await
}

async fn post(client: &reqwest::Client, url: String, body: Value) -> (u16, Value) {
    let r = client.post(url).json(&body).send().await.expect("send");
    let status = r.status().as_u16();
    (status, r.json().await.expect("json body"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn acquire_complete_release_and_operations_over_http() {
    let Some(fx) = fixture().await else { return };
    let srv = serve(fx.store().await).await;
    let c = authed();
    let key = new_key();
    let req = serde_json::to_value(acq(&key)).expect("json");

    let (status, body) = post(&c, format!("{}/v1/acquire", srv.base), req.clone()).await;
    assert_eq!(status, 200);
    let first: AcquireResponse = serde_json::from_value(body).expect("AcquireResponse");
    assert_eq!(first.outcome, AcquireOutcome::Acquired);
    let owner = first.owner.expect("owner");

    let (status, body) = post(&c, format!("{}/v1/acquire", srv.base), req.clone()).await;
    assert_eq!(status, 200);
    assert_eq!(body, json!({"outcome": "IN_FLIGHT", "owner": owner}));

    let r = c.get(format!("{}/v1/operations/{key}", srv.base)).send().await.expect("get");
    assert_eq!(r.status().as_u16(), 200);
    let view: OperationView = r.json().await.expect("view");
    assert_eq!(view.state, OpState::InFlight);

    let (result, _) = rich_result(201);
    let done = json!({"key": key, "owner": owner, "state": "DONE", "result": result});
    let (status, body) = post(&c, format!("{}/v1/complete", srv.base), done.clone()).await;
    assert_eq!((status, body), (200, json!({"outcome": "OK"})));
    let stale = json!({"key": key, "owner": new_key(), "state": "DONE", "result": result});
    let (status, body) = post(&c, format!("{}/v1/complete", srv.base), stale).await;
    assert_eq!((status, body), (200, json!({"outcome": "NOT_OWNER"})));

    let (status, body) = post(&c, format!("{}/v1/acquire", srv.base), req).await;
    assert_eq!(status, 200);
    let replay: AcquireResponse = serde_json::from_value(body).expect("replay");
    assert_eq!(replay.outcome, AcquireOutcome::Done);
    assert_eq!(replay.result, Some(result.clone()), "byte for byte over HTTP");

    let tampered = json!({"key": key, "param_hash": "0".repeat(64), "subject_hash": common::SUBJECT,
                          "scope": common::SCOPE, "lease_ms": 0});
    let (status, body) = post(&c, format!("{}/v1/acquire", srv.base), tampered).await;
    assert_eq!((status, body), (200, json!({"outcome": "PARAM_MISMATCH"})));

    let r = c.get(format!("{}/v1/operations/{key}", srv.base)).send().await.expect("get");
    let view: OperationView = r.json().await.expect("view");
    assert_eq!((view.state, view.result), (OpState::Done, Some(result)));

    // release: only for an IN_FLIGHT of one's own.
    let k2 = new_key();
    let (_, body) = post(&c, format!("{}/v1/acquire", srv.base), serde_json::to_value(acq(&k2)).expect("json")).await;
    let o2 = body["owner"].as_str().expect("owner").to_string();
    let (status, body) = post(&c, format!("{}/v1/release", srv.base), json!({"key": k2, "owner": new_key()})).await;
    assert_eq!((status, body), (200, json!({"outcome": "NOT_OWNER"})));
    let (status, body) = post(&c, format!("{}/v1/release", srv.base), json!({"key": k2, "owner": o2})).await;
    let ack: AckResponse = serde_json::from_value(body).expect("ack");
    assert_eq!((status, ack.outcome), (200, Ack::Ok));
    let r = c.get(format!("{}/v1/operations/{k2}", srv.base)).send().await.expect("get");
    assert_eq!(r.status().as_u16(), 404);
    assert_eq!(r.json::<Value>().await.expect("json"), json!({"error": "not_found", "reaped_possible": false}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_input_is_400() {
    let Some(fx) = fixture().await else { return };
    let srv = serve(fx.store().await).await;
    let c = authed();
    let key = new_key();
    let cases: Vec<(&str, String)> = vec![
        ("/v1/acquire", "{not json".into()),
        ("/v1/acquire", "".into()),
        ("/v1/acquire", json!({"key": key}).to_string()),
        (
            "/v1/acquire",
            json!({"key": key.to_uppercase(), "param_hash": "p", "subject_hash": "u", "scope": "s", "lease_ms": 1})
                .to_string(),
        ),
        (
            "/v1/acquire",
            json!({"key": "abc", "param_hash": "p", "subject_hash": "u", "scope": "s", "lease_ms": 1}).to_string(),
        ),
        (
            "/v1/acquire",
            json!({"key": key, "param_hash": "", "subject_hash": "u", "scope": "s", "lease_ms": 1}).to_string(),
        ),
        (
            "/v1/acquire",
            json!({"key": key, "param_hash": "p", "subject_hash": "u", "scope": "s", "lease_ms": -1}).to_string(),
        ),
        (
            "/v1/acquire",
            json!({"key": key, "param_hash": "p", "subject_hash": "u", "scope": "s", "lease_ms": "1"}).to_string(),
        ),
        ("/v1/complete", json!({"key": key, "owner": "x", "state": "DONE", "result": {"status": 200}}).to_string()),
        (
            "/v1/complete",
            json!({"key": key, "owner": new_key(), "state": "MAYBE", "result": {"status": 200}}).to_string(),
        ),
        ("/v1/complete", json!({"key": key, "owner": new_key(), "state": "DONE"}).to_string()),
        ("/v1/release", json!({"key": key}).to_string()),
        ("/v1/release", json!({"key": key, "owner": "../../etc"}).to_string()),
        ("/v1/renew", json!({"leases": [{"key": key, "owner": "x", "lease_ms": 1000}]}).to_string()),
        ("/v1/renew", json!({"leases": [{"key": key, "owner": new_key(), "lease_ms": 1u64 << 60}]}).to_string()),
        ("/v1/renew", json!({"leases": {"key": key}}).to_string()),
    ];
    for (path, body) in cases {
        let r = c
            .post(format!("{}{path}", srv.base))
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .expect("send");
        assert_eq!(r.status().as_u16(), 400, "{path} {body}");
        let v: Value = r.json().await.expect("json");
        assert_eq!(v["error"], "bad_request", "{v}");
        assert!(v["detail"].as_str().is_some_and(|d| !d.is_empty()));
    }
    // No content-type at all is still read as JSON (not 415).
    let r = c
        .post(format!("{}/v1/acquire", srv.base))
        .body(serde_json::to_string(&acq(&key)).expect("json"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 200);
    let r = c.get(format!("{}/v1/operations/NOT-A-KEY", srv.base)).send().await.expect("get");
    assert_eq!(r.status().as_u16(), 400);
    // Nothing bad was recorded.
    assert_eq!(fx.count_rows(&key).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn healthz_and_metrics() {
    let Some(fx) = fixture().await else { return };
    let with_redis = fx.redis.is_some();
    let srv = serve(fx.store().await).await;
    let c = authed();

    let r = c.get(format!("{}/healthz", srv.base)).send().await.expect("get");
    assert_eq!(r.status().as_u16(), 200);
    let h: Value = r.json().await.expect("json");
    assert_eq!(h["status"], "ok");
    assert_eq!(h["sql"], "up");
    assert_eq!(h["redis"], if with_redis { "up" } else { "off" });

    let key = new_key();
    c.post(format!("{}/v1/acquire", srv.base)).json(&acq(&key)).send().await.expect("send");
    c.post(format!("{}/v1/acquire", srv.base)).json(&acq(&key)).send().await.expect("send");

    let r = c.get(format!("{}/metrics", srv.base)).send().await.expect("get");
    assert_eq!(r.status().as_u16(), 200);
    let ct = r.headers()["content-type"].to_str().expect("ct").to_string();
    assert!(ct.starts_with("application/openmetrics-text"), "{ct}");
    let text = r.text().await.expect("text");
    for needle in [
        "idem_acquire_total{outcome=\"ACQUIRED\",mode=\"fingerprint\"} 1",
        "idem_acquire_total{outcome=\"IN_FLIGHT\",mode=\"fingerprint\"} 1",
        "# TYPE idem_store_latency_seconds histogram",
        "idem_store_latency_seconds_count{store=\"sql\",op=\"insert\"}",
        "# TYPE idem_redis_fallback counter",
        "idem_sql_up 1",
        // Label sets an alert reads with increase() exist at 0 before their first event.
        "idem_security_events_total{kind=\"bad_signature\"} 0",
        "idem_reconcile_total{decision=\"retry\"} 0",
        "# TYPE idem_in_flight gauge",
        "# TYPE idem_in_flight_overdue_seconds gauge",
        "# EOF",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
    assert!(text.contains(if with_redis { "idem_redis_up 1" } else { "idem_redis_up 0" }));
    assert!(text.contains(if with_redis { "idem_redis_configured 1" } else { "idem_redis_configured 0" }));
}

/// 200 concurrent acquires of one key, each on its own HTTP connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_acquires_over_many_connections() {
    let Some(fx) = fixture().await else { return };
    let srv = serve(fx.store().await).await;
    let key = new_key();
    let start = Arc::new(tokio::sync::Barrier::new(200));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..200 {
        let url = format!("{}/v1/acquire", srv.base);
        let (key, start) = (key.clone(), start.clone());
        tasks.spawn(async move {
            // A client per task: no connection is shared.
            let mut headers = reqwest::header::HeaderMap::new();
            headers.insert(reqwest::header::AUTHORIZATION, format!("Bearer {TOKEN}").parse().expect("header"));
            let c =
                reqwest::Client::builder().pool_max_idle_per_host(0).default_headers(headers).build().expect("client");
            start.wait().await;
            let r = c.post(url).json(&acq(&key)).send().await.expect("send");
            assert_eq!(r.status().as_u16(), 200);
            r.json::<AcquireResponse>().await.expect("json")
        });
    }
    let (mut acquired, mut in_flight) = (0, 0);
    while let Some(r) = tasks.join_next().await {
        match r.expect("task").outcome {
            AcquireOutcome::Acquired => acquired += 1,
            AcquireOutcome::InFlight => in_flight += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((acquired, in_flight), (1, 199));
    assert_eq!(fx.count_rows(&key).await, 1);
}

/// SQL unreachable: acquire/complete/release answer 503 STORE_UNAVAILABLE,
/// operations 503, healthz 503 "down".
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn store_unavailable_is_503() {
    if Fixture::with_redis(Backend::Postgres, None).await.is_none() {
        return;
    }
    let url = common::postgres_test_url();
    let (real, _) = common::reroute(&url, 5432, 0);
    let proxy = CutProxy::start(real).await;
    let (_, proxied) = common::reroute(&url, 5432, proxy.port);
    let Some(fx) = Fixture::with_redis(Backend::Postgres, None).await else { return };
    let fx = fx.with_sql_url(proxied);
    let srv = serve(fx.store().await).await;
    let c = authed();
    let key = new_key();
    let (_, body) = post(&c, format!("{}/v1/acquire", srv.base), serde_json::to_value(acq(&key)).expect("json")).await;
    let owner = body["owner"].as_str().expect("owner").to_string();

    proxy.cut();

    let (status, body) =
        post(&c, format!("{}/v1/acquire", srv.base), serde_json::to_value(acq(&new_key())).expect("json")).await;
    assert_eq!((status, body), (503, json!({"outcome": "STORE_UNAVAILABLE"})));
    let (result, _) = rich_result(200);
    let done = json!({"key": key, "owner": owner, "state": "DONE", "result": result});
    let (status, body) = post(&c, format!("{}/v1/complete", srv.base), done.clone()).await;
    assert_eq!((status, body), (503, json!({"outcome": "STORE_UNAVAILABLE"})));
    let (status, body) = post(&c, format!("{}/v1/release", srv.base), json!({"key": key, "owner": owner})).await;
    assert_eq!((status, body), (503, json!({"outcome": "STORE_UNAVAILABLE"})));
    let r = c.get(format!("{}/v1/operations/{key}", srv.base)).send().await.expect("get");
    assert_eq!(r.status().as_u16(), 503);
    let r = c.get(format!("{}/healthz", srv.base)).send().await.expect("get");
    assert_eq!(r.status().as_u16(), 503);
    assert_eq!(r.json::<Value>().await.expect("json")["status"], "down");

    proxy.restore();
    let ok = common::eventually(Duration::from_secs(10), || {
        let (c, url, done) = (c.clone(), format!("{}/v1/complete", srv.base), done.clone());
        async move {
            let r = c.post(url).json(&done).send().await.expect("send");
            r.status().as_u16() == 200
        }
    })
    .await;
    assert!(ok, "complete works again once SQL is back");
}

/// DESIGN §6: idemd answers only its filter. Without a token, with a wrong one,
/// or with a token rotated out, every `/v1/*` call is 401 and changes nothing;
/// the probes stay open.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn strangers_get_401_and_change_nothing() {
    let Some(fx) = fixture().await else { return };
    let store = fx.store().await;
    // Rotation: old and new accepted together, then the old one removed.
    let both = serve_with(Arc::clone(&store), &["old-token-0123456789", "new-token-0123456789"]).await;
    let key = new_key();
    let req = serde_json::to_value(acq(&key)).expect("json");
    let (status, _) =
        post(&client_with("old-token-0123456789"), format!("{}/v1/acquire", both.base), req.clone()).await;
    assert_eq!(status, 200);
    let key2 = new_key();
    let req2 = serde_json::to_value(acq(&key2)).expect("json");
    let rotated = serve_with(Arc::clone(&store), &["new-token-0123456789"]).await;
    let strangers = [
        ("none", reqwest::Client::new()),
        ("wrong", client_with("wrong-token-0123456789")),
        ("rotated out", client_with("old-token-0123456789")),
    ];
    for (who, c) in &strangers {
        let (status, body) = post(c, format!("{}/v1/acquire", rotated.base), req2.clone()).await;
        assert_eq!((status, body["error"].as_str()), (401, Some("unauthorized")), "{who}");
        let (status, _) = post(
            c,
            format!("{}/v1/complete", rotated.base),
            json!({"key": key, "owner": key, "state": "DONE", "result": {"status": 201}}),
        )
        .await;
        assert_eq!(status, 401, "{who}");
        let (status, _) = post(c, format!("{}/v1/release", rotated.base), json!({"key": key, "owner": key})).await;
        assert_eq!(status, 401, "{who}");
        let renewal = json!({"leases": [{"key": key, "owner": key, "lease_ms": 60000}]});
        let (status, _) = post(c, format!("{}/v1/renew", rotated.base), renewal).await;
        assert_eq!(status, 401, "{who}");
        let r = c.get(format!("{}/v1/operations/{key}", rotated.base)).send().await.expect("get");
        assert_eq!(r.status().as_u16(), 401, "{who}");
        assert_eq!(r.headers().get("www-authenticate").and_then(|v| v.to_str().ok()), Some("Bearer"));
    }
    // Nothing changed: the stranger's acquire made no row, the first operation is still in flight.
    assert!(store.operation(&key2).await.expect("store").is_none());
    assert_eq!(store.operation(&key).await.expect("store").map(|v| v.state), Some(OpState::InFlight));
    let new = client_with("new-token-0123456789");
    let r = new.get(format!("{}/v1/operations/{key}", rotated.base)).send().await.expect("get");
    assert_eq!(r.status().as_u16(), 200);
    // Probes and scrapers need no token; the refusals are counted.
    let plain = reqwest::Client::new();
    let r = plain.get(format!("{}/healthz", rotated.base)).send().await.expect("healthz");
    assert_eq!(r.status().as_u16(), 200);
    let metrics =
        plain.get(format!("{}/metrics", rotated.base)).send().await.expect("metrics").text().await.expect("text");
    assert!(metrics.contains("idem_auth_rejected_total 15"), "{metrics}");
}

/// The approvers' console resolves a NEEDS_REVIEW operation as `idemd ops resolve` does
/// (`review::planned`): `done` with the result the agent gets (replayed as the first result
/// from then on); a result that is not JSON is refused and changes nothing; the CSRF token is
/// required.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_console_resolves_needs_review_as_done_with_its_result() {
    let Some(fx) = fixture().await else { return };
    let store = fx.store().await;
    let key = new_key();
    assert_eq!(store.acquire(&acq(&key)).await.outcome, AcquireOutcome::Acquired);
    fx.set_state(&key, "NEEDS_REVIEW").await;
    const ANN: &str = "ann-console-credential-0123456789";
    let approvers =
        idemd::approvals::Approvers::new(&[format!("ann={ANN}")], &[TOKEN.to_string()], false).expect("approvers");
    let tokens = Tokens::new(&[TOKEN.to_string()]).expect("tokens");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr: SocketAddr = listener.local_addr().expect("addr");
    let router = idemd::api::router_with(Arc::clone(&store), tokens, approvers, None);
    let _task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    let base = format!("http://{addr}");
    let ann = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .default_headers({
            let mut h = reqwest::header::HeaderMap::new();
            h.insert(reqwest::header::AUTHORIZATION, format!("Bearer {ANN}").parse().expect("header"));
            h
        })
        .build()
        .expect("client");
    let page = ann.get(format!("{base}/approvals")).send().await.expect("page").text().await.expect("text");
    assert!(page.contains(&format!("review-{key}")) && page.contains("value=\"done\""), "{page}");
    let csrf = page
        .split("name=\"csrf\" value=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("a csrf token on the form")
        .to_string();
    let resolve = |fields: Vec<(&'static str, String)>| {
        let (ann, url) = (ann.clone(), format!("{base}/approvals/review/{key}"));
        async move {
            let r = ann.post(url).form(&fields).send().await.expect("resolve");
            (r.status().as_u16(), r.headers().get("location").and_then(|l| l.to_str().ok()).unwrap_or("").to_string())
        }
    };
    let state = || async { store.sql().get(&key).await.expect("get").map(|r| r.state) };
    // Without the token: refused, nothing changed.
    let (code, _) = resolve(vec![("outcome", "done".into()), ("result", "{}".into()), ("why", "x".into())]).await;
    assert_eq!(code, 403);
    // A result that is not JSON: told why, nothing changed.
    let bad = vec![
        ("outcome", "done".into()),
        ("result", "t_42 went out".into()),
        ("why", "found in the ledger".into()),
        ("csrf", csrf.clone()),
    ];
    let (code, location) = resolve(bad).await;
    assert_eq!((code, location.contains("error=") && location.contains("not%20JSON")), (303, true), "{location}");
    assert_eq!(state().await, Some(OpState::NeedsReview));
    let done = vec![
        ("outcome", "done".into()),
        ("result", r#"{"transfer_id":"t_42","status":"sent"}"#.into()),
        ("why", "found t_42 in the ledger".into()),
        ("csrf", csrf.clone()),
    ];
    let (code, location) = resolve(done).await;
    assert_eq!((code, location.contains("resolve_done")), (303, true), "{location}");
    assert_eq!(state().await, Some(OpState::Done));
    // The agent's next confirm gets it as the first result.
    let again = store.acquire(&acq(&key)).await;
    assert_eq!(again.outcome, AcquireOutcome::Done);
    let result = again.result.expect("the recorded result");
    assert_eq!(result.status, 200);
    let body: Value =
        serde_json::from_slice(&idem_core::protocol::decode_body(&result.body_b64).expect("body")).expect("json");
    assert_eq!(body["transfer_id"], "t_42");
}

/// A status endpoint whose answer for every key the test sets: (status, body).
#[derive(Clone, Default)]
struct StatusStub(Arc<std::sync::Mutex<(u16, &'static str)>>);

impl StatusStub {
    async fn start(&self) -> String {
        let state = self.clone();
        let app = axum::Router::new().route(
            "/status/{key}",
            axum::routing::get(move || {
                let (status, body) = *state.0.lock().expect("stub");
                async move {
                    let code = axum::http::StatusCode::from_u16(status).expect("status");
                    (code, [("content-type", "application/json")], body)
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        format!("http://{addr}/status/{{key}}")
    }

    fn answer(&self, status: u16, body: &'static str) {
        *self.0.lock().expect("stub") = (status, body);
    }
}

/// The console as a person sees it (DESIGN §4, "No person decides their own operation"): an
/// approver whose identity is an operation's subject gets no resolve form for it, and a form posted
/// anyway is refused (`own_subject`) whatever it says, so they can never release their own
/// operation and have the agent's retry execute it again. Another approver's release asks the
/// scope's status endpoint at that moment: a record there, or no answer, refuses it (the notice
/// says what was found); only "absent" releases, and the audit line keeps that evidence.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_console_never_lets_a_person_settle_their_own_operation_and_a_release_needs_proof() {
    let Some(fx) = fixture().await else { return };
    let store = fx.store().await;
    let stub = StatusStub::default();
    let template = stub.start().await;
    let (own, other) = (new_key(), new_key());
    let mut sams = acq(&own);
    sams.subject_hash = idem_core::fingerprint::subject_hash("user-sam");
    for req in [sams, acq(&other)] {
        assert_eq!(store.acquire(&req).await.outcome, AcquireOutcome::Acquired);
        fx.set_state(req.key.as_str(), "NEEDS_REVIEW").await;
    }
    const ANN: &str = "ann-console-credential-0123456789";
    const SAM: &str = "sam-console-credential-0123456789";
    let list = [format!("ann={ANN}"), format!("user-sam={SAM}")];
    let approvers = idemd::approvals::Approvers::new(&list, &[TOKEN.to_string()], false).expect("approvers");
    let endpoints = [(common::SCOPE.to_string(), template)].into_iter().collect();
    let status = idemd::reconcile::lookup::StatusClient::new(endpoints, Duration::from_secs(2)).expect("client");
    let rules = idemd::reconcile::decide::Rules { grace_ms: 0, retry_budget: 1, readings: Default::default() };
    let lookups = idemd::reconcile::Lookups { status, rules };
    let tokens = Tokens::new(&[TOKEN.to_string()]).expect("tokens");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr: SocketAddr = listener.local_addr().expect("addr");
    let router = idemd::api::router_with(Arc::clone(&store), tokens, approvers, Some(lookups));
    let _task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    let base = format!("http://{addr}");
    let as_approver = |credential: &str| {
        let mut h = reqwest::header::HeaderMap::new();
        h.insert(reqwest::header::AUTHORIZATION, format!("Bearer {credential}").parse().expect("header"));
        reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .default_headers(h)
            .build()
            .expect("client")
    };
    let (ann, sam) = (as_approver(ANN), as_approver(SAM));
    let page_of = |who: reqwest::Client| {
        let url = format!("{base}/approvals");
        async move { who.get(url).send().await.expect("page").text().await.expect("text") }
    };
    let csrf_of = |page: &str| {
        page.split("name=\"csrf\" value=\"").nth(1).and_then(|r| r.split('"').next()).expect("a form").to_string()
    };
    let section = |page: &str, key: &str| {
        let start = page.find(&format!("id=\"review-{key}\"")).expect("its section");
        page[start..].split("</section>").next().unwrap_or("").to_string()
    };
    // Posts the resolve form for `key`: the notice the page will show (decoded), or the status.
    let resolve = |who: reqwest::Client, key: String, fields: Vec<(&'static str, String)>| {
        let url = format!("{base}/approvals/review/{key}");
        async move {
            let r = who.post(url).form(&fields).send().await.expect("resolve");
            assert_eq!(r.status().as_u16(), 303);
            let location = r.headers().get("location").and_then(|l| l.to_str().ok()).unwrap_or("").to_string();
            let query = location.split_once('?').map_or("", |(_, q)| q).to_string();
            form_urlencoded::parse(query.as_bytes()).map(|(k, v)| format!("{k}: {v}")).collect::<String>()
        }
    };
    let state = |key: String| {
        let store = Arc::clone(&store);
        async move { store.sql().get(&key).await.expect("get").map(|r| r.state) }
    };
    let lines = |key: String| {
        let store = Arc::clone(&store);
        async move { store.sql().history(&key).await.expect("history") }
    };

    // Sam's page: their own operation has no form, another's has one.
    let page = page_of(sam.clone()).await;
    let mine = section(&page, &own);
    assert!(mine.contains("your own subject") && !mine.contains("<form"), "{mine}");
    assert!(section(&page, &other).contains(&format!("action=\"/approvals/review/{other}\"")), "{page}");
    let sams_csrf = csrf_of(&page);
    // A form for it posted anyway (Sam's own token, as an older page had it): refused, whatever it says.
    for outcome in [
        vec![("outcome", "release".to_string())],
        vec![("outcome", "done".to_string()), ("result", r#"{"transfer_id":"t_1"}"#.to_string())],
        vec![("outcome", "failed".to_string()), ("reason", "payee closed".to_string())],
    ] {
        let mut fields = outcome;
        fields.extend([("why", "it is mine and it did not run".to_string()), ("csrf", sams_csrf.clone())]);
        let notice = resolve(sam.clone(), own.clone(), fields).await;
        assert!(notice.starts_with("error: ") && notice.contains("own_subject"), "{notice}");
    }
    assert_eq!(state(own.clone()).await, Some(OpState::NeedsReview));
    assert_eq!(lines(own.clone()).await.len(), 1, "only the acquire: nothing was decided");

    // Ann may decide it, but a release needs the upstream to have no record of it now.
    let anns_csrf = csrf_of(&page_of(ann.clone()).await);
    let release = || {
        vec![("outcome", "release".to_string()), ("why", "not in the ledger".to_string()), ("csrf", anns_csrf.clone())]
    };
    stub.answer(200, r#"{"transfer_id":"t_9","status":"executed"}"#);
    let notice = resolve(ann.clone(), own.clone(), release()).await;
    assert!(notice.starts_with("error: ") && notice.contains("the upstream has a record of it"), "{notice}");
    assert!(notice.contains("status endpoint answered 200 with /status = \"executed\""), "{notice}");
    stub.answer(500, "{}");
    let notice = resolve(ann.clone(), own.clone(), release()).await;
    assert!(notice.contains("the lookup proves nothing") && notice.contains("answered 500"), "{notice}");
    assert_eq!(state(own.clone()).await, Some(OpState::NeedsReview), "refused releases change nothing");
    assert_eq!(lines(own.clone()).await.len(), 1);

    stub.answer(404, r#"{"error":"not_found"}"#);
    let notice = resolve(ann.clone(), own.clone(), release()).await;
    assert!(notice.starts_with("done: ") && notice.contains("resolve_release"), "{notice}");
    assert_eq!(state(own.clone()).await, None, "released: the agent's retry runs it");
    let trail = lines(own.clone()).await;
    let last = trail.last().expect("the release line");
    assert_eq!((last.actor.as_str(), last.action.as_str()), ("operator:ann", "resolve_release"));
    assert!(
        last.why.starts_with("not in the ledger [checked at the release: status endpoint answered 404"),
        "{last:?}"
    );
}
