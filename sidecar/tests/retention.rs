//! A record outlives every fingerprint that can name it (DESIGN §4), on real
//! stores, each test on a database of its own (the reaper works on whole
//! tables): the row carries the fingerprint's `exp`, the reaper keeps it
//! until `exp` + skew + retention whatever the retention says, a Redis copy
//! that expired earlier is answered by the row, and a lookup's 404 says
//! whether a row for that `exp` could have been reaped.

#[macro_use]
mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::{acq, eventually, new_key, settings, simple_result, Backend, Fixture};
use idem_core::protocol::{Ack, AcquireOutcome, AcquireRequest, CompleteRequest, OpState, TerminalState};
use idemd::auth::Tokens;
use idemd::reaper::Reaper;
use idemd::store::retention::CLOCK_SKEW_MS;
use idemd::store::{now_ms, Store, StoreSettings};
use serde_json::{json, Value};

const HOUR_MS: u64 = 3_600_000;
const DAY_MS: i64 = 86_400_000;
const TOKEN: &str = "filter-token-0123456789";

fn now_s() -> u64 {
    u64::try_from(now_ms() / 1000).expect("clock after 1970")
}

/// The acquire of a fingerprint expiring at `exp` (unix s); `None`: a client key.
fn acq_exp(key: &str, exp: Option<u64>) -> AcquireRequest {
    AcquireRequest { exp, ..acq(key) }
}

/// Acquire and complete DONE; the owner.
async fn done(store: &Store, key: &str, exp: Option<u64>, tag: &str) -> String {
    let a = store.acquire(&acq_exp(key, exp)).await;
    assert_eq!(a.outcome, AcquireOutcome::Acquired, "{a:?}");
    let owner = a.owner.expect("owner");
    let req = CompleteRequest {
        key: idem_core::protocol::OpKey::parse(key).expect("key"),
        owner: owner.clone(),
        state: TerminalState::Done,
        result: simple_result(tag),
        trace_id: String::new(),
    };
    assert_eq!(store.complete(&req).await.outcome, Ack::Ok);
    owner.to_string()
}

fn metric(store: &Store, line: &str) -> bool {
    store.metrics().encode().lines().any(|l| l == line)
}

fn keys(list: &[&String]) -> String {
    list.iter().map(|k| format!("'{k}'")).collect::<Vec<_>>().join(",")
}

struct Server {
    base: String,
    _task: tokio::task::JoinHandle<()>,
}

async fn serve(store: Arc<Store>) -> Server {
    let tokens = Tokens::new(&[TOKEN.to_string()]).expect("tokens");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr: SocketAddr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, idemd::api::router(store, tokens)).await;
    });
    Server { base: format!("http://{addr}"), _task: task }
}

/// `GET /v1/operations/{key}` with `query` ("" or "?exp=…"), as the filter asks.
async fn lookup(srv: &Server, key: &str, query: &str) -> (u16, Value) {
    let r = reqwest::Client::new()
        .get(format!("{}/v1/operations/{key}{query}", srv.base))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("get");
    let status = r.status().as_u16();
    (status, r.json().await.expect("json"))
}

// ---- scenarios ---------------------------------------------------------------

/// Past the retention, a terminal row whose fingerprint is still valid stays
/// (a client key's and a long-expired fingerprint's of the same age go);
/// exp + retention passed but not the skew: still kept; both passed: reaped,
/// and the lookup with that exp then says a row may have been reaped.
async fn a_fingerprint_row_is_kept_until_its_exp_plus_the_retention(fx: &Fixture) {
    let store = fx.store().await;
    let (live, client, stale) = (new_key(), new_key(), new_key());
    let live_exp = now_s() + 2 * 3600;
    done(&store, &live, Some(live_exp), "live").await;
    done(&store, &client, None, "client").await;
    done(&store, &stale, Some(now_s() - 2 * 86_400), "stale").await;
    let row = store.sql().get(&live).await.expect("get").expect("row");
    assert_eq!(row.fp_exp_ms, Some(i64::try_from(live_exp).expect("exp") * 1000), "{}", fx.label());
    assert_eq!(store.sql().get(&client).await.expect("get").expect("row").fp_exp_ms, None);

    // All three last changed a day ago: a day past the one-hour retention.
    fx.exec(&format!(
        "UPDATE idem_record SET updated_at = updated_at - {DAY_MS} WHERE idem_key IN ({})",
        keys(&[&live, &client, &stale])
    ))
    .await;
    let reaper = Reaper::new(store.clone(), HOUR_MS, 10);
    assert_eq!(reaper.pass().await.expect("reap").rows, 2, "{}", fx.label());
    assert_eq!((fx.count_rows(&client).await, fx.count_rows(&stale).await), (0, 0));
    assert_eq!(fx.count_rows(&live).await, 1, "the fingerprint is valid for two more hours: kept");
    assert!(metric(&store, "idem_reaped_total 2"));
    // The kept row still answers a retry with its original result.
    let again = store.acquire(&acq_exp(&live, Some(live_exp))).await;
    assert_eq!((again.outcome, again.result), (AcquireOutcome::Done, Some(simple_result("live"))));

    // exp + retention has passed, exp + skew + retention not yet: kept.
    let almost = now_ms() - i64::try_from(HOUR_MS).expect("ms") - CLOCK_SKEW_MS / 2;
    fx.exec(&format!("UPDATE idem_record SET fp_exp_ms = {almost} WHERE idem_key = '{live}'")).await;
    assert_eq!(reaper.pass().await.expect("reap").rows, 0, "{}", fx.label());
    assert_eq!(fx.count_rows(&live).await, 1);

    // Both passed: reaped.
    let gone_exp_s = (now_ms() - i64::try_from(HOUR_MS).expect("ms") - CLOCK_SKEW_MS - 2_000) / 1000;
    fx.exec(&format!("UPDATE idem_record SET fp_exp_ms = {} WHERE idem_key = '{live}'", gone_exp_s * 1000)).await;
    assert_eq!(reaper.pass().await.expect("reap").rows, 1, "{}", fx.label());
    assert_eq!(fx.count_rows(&live).await, 0);
    assert!(metric(&store, "idem_reaped_total 3"));

    // Whenever the reaper may have taken a fingerprint's row, the lookup says so.
    let srv = serve(store.clone()).await;
    let (status, body) = lookup(&srv, &live, &format!("?exp={gone_exp_s}")).await;
    assert_eq!((status, body), (404, json!({"error": "not_found", "reaped_possible": true})));
}

/// Redis forgets the terminal copy after the retention while SQL keeps the
/// row for its fingerprint: the next acquire misses in Redis, the SQL insert
/// conflicts, and the row answers with the original result. Nothing is
/// acquired twice, and the copy written back lives as long as the row.
async fn an_expired_redis_copy_is_answered_by_the_kept_row(fx: &Fixture) {
    let retention_ms = 300;
    let store = fx.store_with(StoreSettings { terminal_retention_ms: retention_ms, ..settings() }).await;
    let key = new_key();
    let exp = now_s() + 3600;
    let owner = done(&store, &key, Some(exp), "original").await;
    if let Some(redis) = &fx.redis {
        let pttl = redis.pttl(&key).await;
        assert!(pttl > 0 && pttl <= 300, "the terminal copy expires with the retention: {pttl}");
        let r = redis.clone();
        let k = key.clone();
        assert!(
            eventually(Duration::from_secs(3), || {
                let (r, k) = (r.clone(), k.clone());
                async move { r.pttl(&k).await == -2 }
            })
            .await,
            "the Redis copy expired"
        );
    } else {
        tokio::time::sleep(Duration::from_millis(retention_ms + 100)).await;
    }
    let reaper = Reaper::new(store.clone(), retention_ms, 10);
    assert_eq!(reaper.pass().await.expect("reap").rows, 0, "past the retention, before exp: kept");

    let again = store.acquire(&acq_exp(&key, Some(exp))).await;
    assert_eq!(again.outcome, AcquireOutcome::Done, "{} {again:?}", fx.label());
    assert_eq!(again.result, Some(simple_result("original")));
    let row = store.sql().get(&key).await.expect("get").expect("row");
    assert_eq!((row.state, row.owner.as_deref()), (OpState::Done, Some(owner.as_str())), "the first owner's row");
    assert_eq!(fx.count_rows(&key).await, 1);
    let acquired = "idem_acquire_total{outcome=\"ACQUIRED\",mode=\"fingerprint\"} 1";
    assert!(metric(&store, acquired), "one ACQUIRED only:\n{}", store.metrics().encode());
    if let Some(redis) = &fx.redis {
        assert_eq!(redis.hgetall(&key).await.get("state").map(String::as_str), Some("DONE"));
        let pttl = redis.pttl(&key).await;
        assert!(pttl > 3_000_000, "the copy written back lives as long as the row (about an hour): {pttl}");
    }
}

/// The 404 of a lookup: `reaped_possible` only from `exp + retention` on, never
/// without `exp`; an `exp` that is not unix seconds is a 400; a row answers
/// whatever `exp` says; an acquire's `exp` lands in the row.
async fn not_found_says_whether_a_row_may_have_been_reaped(fx: &Fixture) {
    let store = fx.store().await;
    let srv = serve(store.clone()).await;
    let nobody = new_key();
    let now = now_s();
    let retention_s = HOUR_MS / 1000;
    let not_found = |possible: bool| json!({"error": "not_found", "reaped_possible": possible});
    for (query, possible) in [
        (String::new(), false),
        (format!("?exp={}", now + 60), false),
        (format!("?exp={}", now - retention_s + 60), false),
        (format!("?exp={}", now - retention_s - 5), true),
        (format!("?exp={}", now - 30 * 86_400), true),
        (format!("?other=1&exp={}", now - 30 * 86_400), true),
    ] {
        assert_eq!(lookup(&srv, &nobody, &query).await, (404, not_found(possible)), "{query} {}", fx.label());
    }
    for bad in ["?exp=", "?exp=-5", "?exp=1.5", "?exp=soon", "?exp=253402300800"] {
        let (status, body) = lookup(&srv, &nobody, bad).await;
        assert_eq!((status, body["error"].as_str()), (400, Some("bad_request")), "{bad}");
    }

    // An acquire over HTTP carrying exp: stored with the row, and the row answers any lookup.
    let key = new_key();
    let mut req = serde_json::to_value(acq(&key)).expect("json");
    req["exp"] = json!(now + 120);
    let r = reqwest::Client::new()
        .post(format!("{}/v1/acquire", srv.base))
        .bearer_auth(TOKEN)
        .json(&req)
        .send()
        .await
        .expect("acquire");
    assert_eq!(r.status().as_u16(), 200);
    let row = store.sql().get(&key).await.expect("get").expect("row");
    assert_eq!(row.fp_exp_ms, Some(i64::try_from(now + 120).expect("exp") * 1000));
    let (status, view) = lookup(&srv, &key, &format!("?exp={}", now - 30 * 86_400)).await;
    assert_eq!((status, view["state"].as_str()), (200, Some("IN_FLIGHT")));
}

isolated_backend_suites!(
    a_fingerprint_row_is_kept_until_its_exp_plus_the_retention,
    an_expired_redis_copy_is_answered_by_the_kept_row,
    not_found_says_whether_a_row_may_have_been_reaped,
);
