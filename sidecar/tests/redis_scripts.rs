//! `lua/complete.lua` on a real Redis, script by script, and the one way idemd
//! reaches its NOT_OWNER answer: SQL (the truth) took the complete, but the
//! cache holds another attempt's gate.
//!
//! The store suite never gets there: a stale owner's complete is refused by
//! SQL's owner-checked UPDATE before Redis is asked. The branch is still
//! reachable by design: Redis loses a key (flush, failover), a second acquire
//! takes the empty Redis gate (its SQL insert will lose to the row), and the
//! first owner's complete lands in between.

mod common;

use common::{acq, new_key, shared_redis, simple_result, Backend, Fixture, RedisTarget, PARAM, SCOPE, SUBJECT};
use idem_core::protocol::{Ack, AcquireOutcome, CompleteRequest, OpKey, OwnerToken, TerminalState};
use idemd::store::redis::{redis_key, AcquireReply, Binding, COMPLETE_LUA};

const BINDING: Binding<'static> = Binding { param_hash: PARAM, subject_hash: SUBJECT, scope: SCOPE };

/// `lua/complete.lua` itself, EVAL'd with its documented KEYS and ARGV: its reply string.
async fn complete_lua(r: &RedisTarget, key: &str, owner: &str, state: &str, result: &str) -> String {
    let client = redis::Client::open(r.url.as_str()).expect("redis url");
    let mut con = client.get_multiplexed_async_connection().await.expect("redis connection");
    redis::Script::new(COMPLETE_LUA)
        .key(redis_key(key))
        .arg(owner)
        .arg(state)
        .arg(result)
        .arg(3_600_000u64)
        .invoke_async(&mut con)
        .await
        .expect("EVAL complete.lua")
}

#[tokio::test]
async fn complete_lua_answers_not_owner_to_another_owner_and_to_another_outcome() {
    let Some(r) = shared_redis().await else { return };
    let cache = r.open();
    let key = new_key();
    let (a, b) = (new_key(), new_key());
    assert_eq!(cache.acquire(&key, BINDING, &a, 60_000).await.expect("acquire.lua"), AcquireReply::Acquired);
    let done = serde_json::to_string(&simple_result("a's answer")).unwrap();
    let other = serde_json::to_string(&simple_result("another answer")).unwrap();

    // IN_FLIGHT held by a: b's complete is refused and changes nothing.
    assert_eq!(complete_lua(&r, &key, &b, "DONE", &done).await, "NOT_OWNER");
    let h = r.hgetall(&key).await;
    assert_eq!((h["state"].as_str(), h["owner"].as_str()), ("IN_FLIGHT", a.as_str()));
    assert!(!h.contains_key("result"), "{h:?}");
    assert!(h.contains_key("lease_ms"), "{h:?}");

    // a's complete is written; its repetition is OK (the filter retried the callout).
    assert_eq!(complete_lua(&r, &key, &a, "DONE", &done).await, "OK");
    assert_eq!(complete_lua(&r, &key, &a, "DONE", &done).await, "OK");
    // Terminal: another owner, another state or another result for the same owner are all NOT_OWNER.
    assert_eq!(complete_lua(&r, &key, &b, "DONE", &done).await, "NOT_OWNER");
    assert_eq!(complete_lua(&r, &key, &a, "FAILED", &done).await, "NOT_OWNER");
    assert_eq!(complete_lua(&r, &key, &a, "DONE", &other).await, "NOT_OWNER");
    let h = r.hgetall(&key).await;
    assert_eq!((h["state"].as_str(), h["owner"].as_str(), h["result"].as_str()), ("DONE", a.as_str(), done.as_str()));
    assert!(!h.contains_key("lease_ms"), "{h:?}");

    // Nothing cached: MISSING, and nothing is created.
    r.del(&key).await;
    assert_eq!(complete_lua(&r, &key, &a, "DONE", &done).await, "MISSING");
    assert!(r.hgetall(&key).await.is_empty());
}

/// The branch as idemd meets it: SQL accepts the owner's complete, Redis
/// answers NOT_OWNER (it holds another attempt's gate), idemd keeps the SQL
/// result and drops the cache entry, and the next acquire answers from the row.
#[tokio::test]
async fn a_complete_the_cache_disagrees_with_stands_in_sql_and_drops_the_entry() {
    let Some(fx) = Fixture::new(Backend::Postgres, true).await else { return };
    let r = fx.redis.clone().expect("with redis");
    let store = fx.store().await;
    let key = new_key();
    let a = store.acquire(&acq(&key)).await;
    assert_eq!(a.outcome, AcquireOutcome::Acquired);
    let owner_a = a.owner.expect("owner").to_string();

    // Redis loses the key; a second attempt (another replica) takes the empty Redis gate,
    // a moment before its SQL insert loses to a's row.
    r.del(&key).await;
    let owner_b = new_key();
    assert_eq!(r.open().acquire(&key, BINDING, &owner_b, 60_000).await.expect("acquire.lua"), AcquireReply::Acquired);
    let result = simple_result("executed once");
    assert_eq!(complete_lua(&r, &key, &owner_a, "DONE", &serde_json::to_string(&result).unwrap()).await, "NOT_OWNER");

    // a's complete through idemd: SQL takes it (the truth), Redis said NOT_OWNER, the entry is dropped.
    let ack = store
        .complete(&CompleteRequest {
            key: OpKey::parse(&key).unwrap(),
            owner: OwnerToken::parse(&owner_a).unwrap(),
            state: TerminalState::Done,
            result: result.clone(),
            trace_id: String::new(),
        })
        .await;
    assert_eq!(ack.outcome, Ack::Ok);
    assert!(r.hgetall(&key).await.is_empty(), "b's gate was evicted, not left to answer IN_FLIGHT");
    let view = store.operation(&key).await.expect("sql").expect("row");
    assert_eq!(view.owner.as_deref(), Some(owner_a.as_str()));
    assert_eq!(view.result.as_ref(), Some(&result));

    // The next acquire answers DONE from the row and copies it back.
    let again = store.acquire(&acq(&key)).await;
    assert_eq!(again.outcome, AcquireOutcome::Done);
    assert_eq!(again.result, Some(result));
    assert_eq!(r.hgetall(&key).await.get("state").map(String::as_str), Some("DONE"));
    assert!(store.metrics().encode().contains("idem_redis_refill_total{state=\"DONE\"} 1"));
    assert_eq!(fx.count_rows(&key).await, 1);
}
