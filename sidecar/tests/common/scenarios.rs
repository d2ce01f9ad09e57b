//! The state-machine suite. Each function is one scenario; `tests/store_suite.rs`
//! runs every one of them unchanged on every backend combination.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use idem_core::protocol::{
    Ack, AcquireOutcome, AcquireRequest, CompleteRequest, LeaseRenewal, OpKey, OpState, OwnerToken, ReleaseRequest,
    RenewRequest, StoredResult, TerminalState,
};
use idemd::store::{now_ms, Store, StoreSettings};

use super::{acq, new_key, rich_result, settings, simple_result, Fixture, SCOPE};

async fn acquired(store: &Store, key: &str) -> String {
    let a = store.acquire(&acq(key)).await;
    assert_eq!(a.outcome, AcquireOutcome::Acquired, "{a:?}");
    a.owner.expect("owner on ACQUIRED").to_string()
}

async fn complete(store: &Store, key: &str, owner: &str, state: TerminalState, result: &StoredResult) -> Ack {
    store
        .complete(&CompleteRequest {
            key: idem_core::protocol::OpKey::parse(key).expect("key"),
            owner: idem_core::protocol::OwnerToken::parse(owner).expect("owner"),
            state,
            result: result.clone(),
            trace_id: String::new(),
        })
        .await
        .outcome
}

async fn release(store: &Store, key: &str, owner: &str) -> Ack {
    store
        .release(&ReleaseRequest {
            key: idem_core::protocol::OpKey::parse(key).expect("key"),
            owner: idem_core::protocol::OwnerToken::parse(owner).expect("owner"),
            trace_id: String::new(),
        })
        .await
        .outcome
}

/// 200 concurrent acquires of one key, spread over four replicas with their
/// own pools and Redis connections: exactly one ACQUIRED, exactly one row,
/// everyone else told IN_FLIGHT with the winner's owner.
pub async fn concurrent_acquires_yield_exactly_one_owner(fx: &Fixture) {
    let mut replicas = Vec::new();
    for _ in 0..4 {
        replicas.push(fx.store().await);
    }
    let key = new_key();
    let start = Arc::new(tokio::sync::Barrier::new(200));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..200 {
        let store = replicas[i % replicas.len()].clone();
        let key = key.clone();
        let start = start.clone();
        tasks.spawn(async move {
            start.wait().await;
            store.acquire(&acq(&key)).await
        });
    }
    let mut counts: HashMap<&str, usize> = HashMap::new();
    let mut winner = None;
    let mut holders = Vec::new();
    while let Some(r) = tasks.join_next().await {
        let a = r.expect("task");
        *counts.entry(a.outcome.as_str()).or_default() += 1;
        match a.outcome {
            AcquireOutcome::Acquired => winner = a.owner,
            AcquireOutcome::InFlight => holders.push(a.owner),
            _ => {}
        }
    }
    assert_eq!(counts.get("ACQUIRED"), Some(&1), "{} {counts:?}", fx.label());
    assert_eq!(counts.get("IN_FLIGHT"), Some(&199), "{} {counts:?}", fx.label());
    assert!(holders.iter().all(|h| h == &winner), "every IN_FLIGHT names the one owner");
    assert_eq!(fx.count_rows(&key).await, 1);
    let row = replicas[0].operation(&key).await.expect("sql").expect("row");
    assert_eq!(row.owner, winner);
    assert_eq!(row.state, OpState::InFlight);
}

/// complete, then acquire again (on this and another replica): the stored
/// result comes back byte for byte.
pub async fn complete_then_acquire_replays_byte_for_byte(fx: &Fixture) {
    let store = fx.store().await;
    let key = new_key();
    let owner = acquired(&store, &key).await;
    let (result, body) = rich_result(201);
    assert_eq!(complete(&store, &key, &owner, TerminalState::Done, &result).await, Ack::Ok);

    let other = fx.store().await;
    for s in [&store, &other, &store] {
        let a = s.acquire(&acq(&key)).await;
        assert_eq!(a.outcome, AcquireOutcome::Done);
        assert_eq!(a.owner, None);
        let replay = a.result.expect("result");
        assert_eq!(replay, result);
        let bytes = base64::engine::general_purpose::STANDARD.decode(&replay.body_b64).expect("base64");
        assert_eq!(bytes, body, "body byte for byte");
    }
    let view = store.operation(&key).await.expect("sql").expect("row");
    assert_eq!(view.result, Some(result));
}

pub async fn failed_result_replays_too(fx: &Fixture) {
    let store = fx.store().await;
    let key = new_key();
    let owner = acquired(&store, &key).await;
    let (result, _) = rich_result(422);
    assert_eq!(complete(&store, &key, &owner, TerminalState::Failed, &result).await, Ack::Ok);
    let a = store.acquire(&acq(&key)).await;
    assert_eq!(a.outcome, AcquireOutcome::Failed);
    assert_eq!(a.result, Some(result));
}

/// The Redis lease runs out while the row is IN_FLIGHT: a retry is told
/// IN_FLIGHT (never ACQUIRED) until the reconciler decides. The original
/// owner can still complete: it really did execute.
pub async fn expired_lease_never_reacquires(fx: &Fixture) {
    let store = fx.store_with(StoreSettings { lease_ms: 300, ..settings() }).await;
    let key = new_key();
    let owner = acquired(&store, &key).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    if let Some(r) = &fx.redis {
        assert!(r.hgetall(&key).await.is_empty(), "the Redis lease has expired");
    }
    for _ in 0..3 {
        let a = store.acquire(&acq(&key)).await;
        assert_eq!(a.outcome, AcquireOutcome::InFlight, "{a:?}");
        assert_eq!(a.owner.as_deref(), Some(owner.as_str()));
    }
    let row = store.operation(&key).await.expect("sql").expect("row");
    assert_eq!(row.state, OpState::InFlight);
    assert_eq!(row.owner.as_deref(), Some(owner.as_str()));
    assert!(row.lease_until_ms.expect("lease") < now_ms());
    assert_eq!(fx.count_rows(&key).await, 1);

    let result = simple_result("late but real");
    assert_eq!(complete(&store, &key, &owner, TerminalState::Done, &result).await, Ack::Ok);
    assert_eq!(store.acquire(&acq(&key)).await.result, Some(result));
}

/// A stale executor (its operation was released and acquired anew) completes
/// late: NOT_OWNER, and the newer result stays.
pub async fn late_complete_from_old_owner_is_not_owner(fx: &Fixture) {
    let store = fx.store().await;
    let key = new_key();
    let old = acquired(&store, &key).await;
    assert_eq!(release(&store, &key, &old).await, Ack::Ok);
    let new = acquired(&store, &key).await;
    assert_ne!(old, new);

    let stale = simple_result("stale");
    let fresh = simple_result("fresh");
    assert_eq!(complete(&store, &key, &old, TerminalState::Done, &stale).await, Ack::NotOwner);
    assert_eq!(complete(&store, &key, &new, TerminalState::Done, &fresh).await, Ack::Ok);
    assert_eq!(complete(&store, &key, &old, TerminalState::Done, &stale).await, Ack::NotOwner);
    assert_eq!(complete(&store, &key, &old, TerminalState::Failed, &stale).await, Ack::NotOwner);
    let forged = new_key();
    assert_eq!(complete(&store, &key, &forged, TerminalState::Done, &stale).await, Ack::NotOwner);

    let a = store.acquire(&acq(&key)).await;
    assert_eq!(a.outcome, AcquireOutcome::Done);
    assert_eq!(a.result, Some(fresh.clone()));
    let view = store.operation(&key).await.expect("sql").expect("row");
    assert_eq!(view.result, Some(fresh));
    assert_eq!(view.owner.as_deref(), Some(new.as_str()));
}

/// The nonce is bound to its parameters, subject and scope: anything else is
/// PARAM_MISMATCH, in every state, and never reveals the result.
pub async fn different_binding_is_param_mismatch(fx: &Fixture) {
    let store = fx.store().await;
    let key = new_key();
    let owner = acquired(&store, &key).await;
    let tampered = [
        AcquireRequest { param_hash: "0".repeat(64), ..acq(&key) },
        AcquireRequest { subject_hash: "1".repeat(32), ..acq(&key) },
        AcquireRequest { scope: "payments.refund".into(), ..acq(&key) },
    ];
    for t in &tampered {
        let a = store.acquire(t).await;
        assert_eq!(a.outcome, AcquireOutcome::ParamMismatch, "while IN_FLIGHT: {t:?}");
        assert_eq!(a.owner, None, "the owner token is not revealed");
    }
    let result = simple_result("secret");
    assert_eq!(complete(&store, &key, &owner, TerminalState::Done, &result).await, Ack::Ok);
    for t in &tampered {
        let a = store.acquire(t).await;
        assert_eq!(a.outcome, AcquireOutcome::ParamMismatch, "when DONE: {t:?}");
        assert_eq!(a.result, None, "the result is not revealed");
    }
    // Also when the answer has to come from SQL (Redis lost the key).
    if let Some(r) = &fx.redis {
        r.del(&key).await;
    }
    let a = store.acquire(&tampered[0]).await;
    assert_eq!(a.outcome, AcquireOutcome::ParamMismatch, "from SQL");
    assert_eq!(a.result, None);
    // And the row is untouched.
    assert_eq!(store.acquire(&acq(&key)).await.result, Some(result));
    let view = store.operation(&key).await.expect("sql").expect("row");
    assert_eq!(view.param_hash, super::PARAM);
}

/// release: the request never reached the upstream. The row goes, the nonce
/// may be acquired again. Only the owner of an IN_FLIGHT may release.
pub async fn release_lets_the_nonce_be_acquired_again(fx: &Fixture) {
    let store = fx.store().await;
    let key = new_key();
    let a = acquired(&store, &key).await;
    assert_eq!(release(&store, &key, &new_key()).await, Ack::NotOwner);
    assert_eq!(fx.count_rows(&key).await, 1);
    assert_eq!(release(&store, &key, &a).await, Ack::Ok);
    assert_eq!(fx.count_rows(&key).await, 0);
    assert!(store.operation(&key).await.expect("sql").is_none());
    if let Some(r) = &fx.redis {
        assert!(r.hgetall(&key).await.is_empty(), "released in Redis too");
    }
    assert_eq!(release(&store, &key, &a).await, Ack::NotOwner, "twice");

    let b = acquired(&store, &key).await;
    assert_ne!(a, b);
    let result = simple_result("second try");
    assert_eq!(complete(&store, &key, &b, TerminalState::Done, &result).await, Ack::Ok);
    assert_eq!(release(&store, &key, &b).await, Ack::NotOwner, "a terminal state is never released");
    assert_eq!(store.acquire(&acq(&key)).await.result, Some(result));
}

/// The filter may retry a complete whose answer it lost.
pub async fn repeated_complete_is_idempotent(fx: &Fixture) {
    let store = fx.store().await;
    let key = new_key();
    let owner = acquired(&store, &key).await;
    let r1 = simple_result("one");
    assert_eq!(complete(&store, &key, &owner, TerminalState::Done, &r1).await, Ack::Ok);
    assert_eq!(complete(&store, &key, &owner, TerminalState::Done, &r1).await, Ack::Ok, "same again");
    assert_eq!(
        complete(&store, &key, &owner, TerminalState::Done, &simple_result("two")).await,
        Ack::NotOwner,
        "a different result never overwrites"
    );
    assert_eq!(complete(&store, &key, &owner, TerminalState::Failed, &r1).await, Ack::NotOwner);
    assert_eq!(store.acquire(&acq(&key)).await.result, Some(r1));
}

/// A route may lengthen the lease, never shorten it below the configured one.
pub async fn requested_lease_is_never_shorter_than_configured(fx: &Fixture) {
    let store = fx.store().await;
    let configured = settings().lease_ms as i64;

    let key = new_key();
    let before = now_ms();
    let a = store.acquire(&AcquireRequest { lease_ms: 1, ..acq(&key) }).await;
    assert_eq!(a.outcome, AcquireOutcome::Acquired);
    let view = store.operation(&key).await.expect("sql").expect("row");
    assert!(view.lease_until_ms.expect("lease") >= before + configured);
    if let Some(r) = &fx.redis {
        assert!(r.pttl(&key).await > configured - 10_000, "Redis TTL follows the lease");
    }

    let key = new_key();
    let before = now_ms();
    store.acquire(&AcquireRequest { lease_ms: 10 * configured as u64, ..acq(&key) }).await;
    let view = store.operation(&key).await.expect("sql").expect("row");
    assert!(view.lease_until_ms.expect("lease") >= before + 10 * configured);
    if let Some(r) = &fx.redis {
        assert!(r.pttl(&key).await > 9 * configured);
    }
}

/// Redis forgets a key (eviction, failover): the row answers and Redis holds
/// the key again afterwards.
pub async fn lost_cache_entry_is_refilled_from_the_row(fx: &Fixture) {
    let store = fx.store().await;
    let done_key = new_key();
    let owner = acquired(&store, &done_key).await;
    let (result, _) = rich_result(200);
    assert_eq!(complete(&store, &done_key, &owner, TerminalState::Done, &result).await, Ack::Ok);
    let busy_key = new_key();
    let busy_owner = acquired(&store, &busy_key).await;

    if let Some(r) = &fx.redis {
        r.del(&done_key).await;
        r.del(&busy_key).await;
    }
    let a = store.acquire(&acq(&done_key)).await;
    assert_eq!(a.outcome, AcquireOutcome::Done);
    assert_eq!(a.result, Some(result.clone()));
    let b = store.acquire(&acq(&busy_key)).await;
    assert_eq!(b.outcome, AcquireOutcome::InFlight);
    assert_eq!(b.owner.as_deref(), Some(busy_owner.as_str()));

    if let Some(r) = &fx.redis {
        let h = r.hgetall(&done_key).await;
        assert_eq!(h.get("state").map(String::as_str), Some("DONE"));
        let cached: StoredResult = serde_json::from_str(&h["result"]).expect("cached result");
        assert_eq!(cached, result);
        assert!(r.pttl(&done_key).await > 0, "restored with a TTL");
        let h = r.hgetall(&busy_key).await;
        assert_eq!(h.get("state").map(String::as_str), Some("IN_FLIGHT"));
        assert_eq!(h.get("owner"), Some(&busy_owner));
    }
    // The metric that says the row, not the cache, answered (none without Redis: nothing was lost).
    let metrics = store.metrics().encode();
    for state in ["DONE", "IN_FLIGHT"] {
        let line = format!("idem_redis_refill_total{{state=\"{state}\"}} 1");
        assert_eq!(metrics.contains(&line), fx.redis.is_some(), "{line}: {metrics}");
    }
    assert_eq!(fx.count_rows(&done_key).await, 1);
    assert_eq!(fx.count_rows(&busy_key).await, 1);
}

/// NEEDS_REVIEW (set by the reconciler in SQL) is answered as such, even
/// while Redis still says IN_FLIGHT; the old owner can no longer complete.
pub async fn needs_review_is_answered_not_reacquired(fx: &Fixture) {
    let store = fx.store().await;
    let key = new_key();
    let owner = acquired(&store, &key).await;
    fx.set_state(&key, "NEEDS_REVIEW").await;
    for _ in 0..2 {
        let a = store.acquire(&acq(&key)).await;
        assert_eq!(a.outcome, AcquireOutcome::NeedsReview, "{a:?}");
        assert_eq!(a.result, None);
    }
    if let Some(r) = &fx.redis {
        let h = r.hgetall(&key).await;
        assert_eq!(h.get("state").map(String::as_str), Some("NEEDS_REVIEW"), "Redis caught up");
    }
    assert_eq!(complete(&store, &key, &owner, TerminalState::Done, &simple_result("x")).await, Ack::NotOwner);
    assert_eq!(release(&store, &key, &owner).await, Ack::NotOwner);
}

/// GET /v1/operations/{key} reads SQL: what it shows at each step.
pub async fn operation_view_follows_the_row(fx: &Fixture) {
    let store = fx.store().await;
    let key = new_key();
    assert!(store.operation(&key).await.expect("sql").is_none());
    let t0 = now_ms();
    let owner = acquired(&store, &key).await;
    let v = store.operation(&key).await.expect("sql").expect("row");
    assert_eq!(v.key, key);
    assert_eq!(v.state, OpState::InFlight);
    assert_eq!(v.owner.as_deref(), Some(owner.as_str()));
    assert_eq!((v.scope.as_str(), v.subject_hash.as_str()), (super::SCOPE, super::SUBJECT));
    assert!(v.created_at_ms >= t0 - 5 && v.created_at_ms == v.updated_at_ms);
    assert!(v.lease_until_ms.is_some());
    assert!(v.result.is_none());

    tokio::time::sleep(Duration::from_millis(5)).await;
    let r = simple_result("view");
    assert_eq!(complete(&store, &key, &owner, TerminalState::Done, &r).await, Ack::Ok);
    let w = store.operation(&key).await.expect("sql").expect("row");
    assert_eq!(w.state, OpState::Done);
    assert_eq!(w.result, Some(r));
    assert_eq!(w.lease_until_ms, None);
    assert_eq!(w.created_at_ms, v.created_at_ms);
    assert!(w.updated_at_ms > w.created_at_ms);
}

/// A complete served by a replica without Redis (or while Redis was down)
/// left Redis saying IN_FLIGHT: the next acquire checks SQL and replays.
pub async fn complete_that_missed_redis_is_still_seen(fx: &Fixture) {
    let fast = fx.store().await;
    let blind = fx.store_sql_only().await;
    let key = new_key();
    let owner = acquired(&fast, &key).await;
    let r = simple_result("done while Redis was away");
    assert_eq!(complete(&blind, &key, &owner, TerminalState::Done, &r).await, Ack::Ok);
    let a = fast.acquire(&acq(&key)).await;
    assert_eq!(a.outcome, AcquireOutcome::Done, "{a:?}");
    assert_eq!(a.result, Some(r));
    if let Some(redis) = &fx.redis {
        assert_eq!(redis.hgetall(&key).await.get("state").map(String::as_str), Some("DONE"));
    }
}

/// A release served without Redis left a stale IN_FLIGHT in Redis: once it is
/// older than any live acquirer could be, it is dropped and the nonce is free.
pub async fn release_that_missed_redis_frees_the_nonce(fx: &Fixture) {
    let fast = fx.store_with(StoreSettings { stale_in_flight_ms: 200, ..settings() }).await;
    let blind = fx.store_sql_only().await;
    let key = new_key();
    let owner = acquired(&fast, &key).await;
    assert_eq!(release(&blind, &key, &owner).await, Ack::Ok);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let a = fast.acquire(&acq(&key)).await;
    assert_eq!(a.outcome, AcquireOutcome::Acquired, "{a:?}");
    assert_ne!(a.owner.as_deref(), Some(owner.as_str()));
    assert_eq!(fx.count_rows(&key).await, 1);
}

async fn renew(store: &Store, key: &str, owner: &str, lease_ms: u64) -> Vec<OpKey> {
    let lease = LeaseRenewal {
        key: OpKey::parse(key).expect("key"),
        owner: OwnerToken::parse(owner).expect("owner"),
        lease_ms,
    };
    store.renew(&RenewRequest { leases: vec![lease] }).await.expect("sql").lost
}

/// The filter renews the lease of a request still upstream (DESIGN §4): the
/// row's lease runs past its first end, and the cached copy with it; only the
/// owner renews, and a lease that moved on (completed) is reported lost.
pub async fn renewal_extends_the_lease_of_its_owner_only(fx: &Fixture) {
    let store = fx.store_with(StoreSettings { lease_ms: 400, ..settings() }).await;
    let key = new_key();
    let owner = acquired(&store, &key).await;
    let first_end = store.operation(&key).await.expect("sql").expect("row").lease_until_ms.expect("lease");
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(renew(&store, &key, &owner, 400).await, Vec::<OpKey>::new());
    }
    let row = store.operation(&key).await.expect("sql").expect("row");
    let lease_until = row.lease_until_ms.expect("lease");
    assert!(now_ms() > first_end, "past the lease's first end");
    assert!(lease_until > now_ms(), "renewed: the lease runs on ({lease_until} vs now {})", now_ms());
    assert_eq!((row.state, row.owner.as_deref()), (OpState::InFlight, Some(owner.as_str())));
    if let Some(r) = &fx.redis {
        assert!(r.pttl(&key).await > 0, "the cached copy's lease follows");
    }

    let forged = new_key();
    assert_eq!(renew(&store, &key, &forged, 400).await.len(), 1, "only the owner renews");
    assert_eq!(store.operation(&key).await.expect("sql").expect("row").lease_until_ms, Some(lease_until));

    let result = simple_result("done while renewed");
    assert_eq!(complete(&store, &key, &owner, TerminalState::Done, &result).await, Ack::Ok);
    assert_eq!(renew(&store, &key, &owner, 400).await.len(), 1, "a completed operation's lease is gone");
    let done = store.operation(&key).await.expect("sql").expect("row");
    assert_eq!((done.state, done.lease_until_ms), (OpState::Done, None), "a renewal never touches a terminal row");
}

/// DESIGN §4, "A reference proves only its own operation": a business reference names one operation
/// per scope among those idemd knows. A second operation with it is refused (REFERENCE_IN_USE):
/// nothing inserted, no Redis copy left, every retry the same, while the holder is in flight or
/// done; the holder's own retries are answered from its row; another scope may use it; a released
/// operation (it never ran) frees it; of 20 operations racing for one reference on four replicas,
/// one acquires. The row keeps the bound fields beside the reference.
pub async fn a_business_reference_names_one_operation_per_scope(fx: &Fixture) {
    let mut replicas = Vec::new();
    for _ in 0..4 {
        replicas.push(fx.store().await);
    }
    let store = &replicas[0];
    let reference = |tag: &str| format!("inv-{tag}-{}", &new_key()[..12]);
    const FIELDS: &str = r#"{"/amount":10,"/ref":"x"}"#;
    let with_ref = |key: &str, scope: &str, r: &str| AcquireRequest {
        scope: scope.into(),
        business_ref: Some(r.to_string()),
        fields: Some(FIELDS.into()),
        ..acq(key)
    };
    let held = reference("held");
    let (a, b) = (new_key(), new_key());
    let first = store.acquire(&with_ref(&a, SCOPE, &held)).await;
    assert_eq!(first.outcome, AcquireOutcome::Acquired, "{}", fx.label());
    let rec = store.sql().get(&a).await.expect("sql").expect("row");
    assert_eq!((rec.business_ref.as_deref(), rec.bound_fields.as_deref()), (Some(held.as_str()), Some(FIELDS)));
    for replica in &replicas[..2] {
        let refused = replica.acquire(&with_ref(&b, SCOPE, &held)).await;
        assert_eq!((refused.outcome, refused.owner), (AcquireOutcome::ReferenceInUse, None), "{}", fx.label());
    }
    assert_eq!(fx.count_rows(&b).await, 0, "nothing inserted for the second operation");
    if let Some(redis) = &fx.redis {
        assert!(redis.hgetall(&b).await.is_empty(), "no Redis gate left behind");
    }
    assert!(store
        .metrics()
        .encode()
        .contains("idem_acquire_total{outcome=\"REFERENCE_IN_USE\",mode=\"fingerprint\"} 1"));
    // The holder's own retry: its row answers.
    assert_eq!(store.acquire(&with_ref(&a, SCOPE, &held)).await.outcome, AcquireOutcome::InFlight);
    // Another scope is another namespace of references.
    assert_eq!(store.acquire(&with_ref(&new_key(), "payments.other", &held)).await.outcome, AcquireOutcome::Acquired);
    // Done, it still holds the reference.
    let owner = first.owner.expect("owner").to_string();
    assert_eq!(complete(store, &a, &owner, TerminalState::Done, &simple_result("a")).await, Ack::Ok);
    assert_eq!(store.acquire(&with_ref(&b, SCOPE, &held)).await.outcome, AcquireOutcome::ReferenceInUse);

    // Released (it provably never ran): the reference is free again.
    let freed = reference("freed");
    let (c, d) = (new_key(), new_key());
    let owner = store.acquire(&with_ref(&c, SCOPE, &freed)).await.owner.expect("owner").to_string();
    assert_eq!(release(store, &c, &owner).await, Ack::Ok);
    assert_eq!(store.acquire(&with_ref(&d, SCOPE, &freed)).await.outcome, AcquireOutcome::Acquired);

    // Twenty operations race for one reference: one acquires.
    let raced = reference("raced");
    let start = Arc::new(tokio::sync::Barrier::new(20));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..20 {
        let (replica, start, req) = (replicas[i % 4].clone(), start.clone(), with_ref(&new_key(), SCOPE, &raced));
        tasks.spawn(async move {
            start.wait().await;
            replica.acquire(&req).await.outcome
        });
    }
    let mut counts: HashMap<&str, usize> = HashMap::new();
    while let Some(r) = tasks.join_next().await {
        *counts.entry(r.expect("task").as_str()).or_default() += 1;
    }
    assert_eq!(counts.get("ACQUIRED"), Some(&1), "{} {counts:?}", fx.label());
    assert_eq!(counts.get("REFERENCE_IN_USE"), Some(&19), "{} {counts:?}", fx.label());
}

/// Every scenario, in order, for fixtures that are expensive to build (a
/// Redis Cluster).
pub async fn all(fx: &Fixture) {
    concurrent_acquires_yield_exactly_one_owner(fx).await;
    complete_then_acquire_replays_byte_for_byte(fx).await;
    failed_result_replays_too(fx).await;
    expired_lease_never_reacquires(fx).await;
    late_complete_from_old_owner_is_not_owner(fx).await;
    different_binding_is_param_mismatch(fx).await;
    release_lets_the_nonce_be_acquired_again(fx).await;
    repeated_complete_is_idempotent(fx).await;
    requested_lease_is_never_shorter_than_configured(fx).await;
    lost_cache_entry_is_refilled_from_the_row(fx).await;
    needs_review_is_answered_not_reacquired(fx).await;
    operation_view_follows_the_row(fx).await;
    complete_that_missed_redis_is_still_seen(fx).await;
    release_that_missed_redis_frees_the_nonce(fx).await;
    renewal_extends_the_lease_of_its_owner_only(fx).await;
    a_business_reference_names_one_operation_per_scope(fx).await;
}

/// SQLite's writes are committed in groups by one writer (`store::sql::group_commit`): 48 fresh
/// operations at once, each acquired and completed, every write answered as its own, every state
/// change with its audit line, and fewer commits than writes. Not a backend scenario: SQLite only.
pub async fn sqlite_groups_concurrent_commits_each_with_its_audit_line(fx: &Fixture) {
    let store = Arc::new(fx.store().await);
    let before = store.sql().commit_groups().expect("SQLite commits in groups");
    let start = Arc::new(tokio::sync::Barrier::new(48));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..48 {
        let (store, start) = (Arc::clone(&store), Arc::clone(&start));
        tasks.spawn(async move {
            let key = new_key();
            start.wait().await;
            let owner = acquired(&store, &key).await;
            let ack = complete(&store, &key, &owner, TerminalState::Done, &simple_result("tr_group")).await;
            (key, ack)
        });
    }
    let mut keys = Vec::new();
    while let Some(r) = tasks.join_next().await {
        let (key, ack) = r.expect("task");
        assert_eq!(ack, Ack::Ok, "{key}");
        keys.push(key);
    }
    for key in &keys {
        let row = store.operation(key).await.expect("sql").expect("row");
        assert_eq!(row.state, OpState::Done, "{key}");
        let actions: Vec<String> =
            store.sql().history(key).await.expect("audit").into_iter().map(|l| l.action).collect();
        assert_eq!(actions, ["acquire", "complete"], "{key}: one audit line per state change");
    }
    let (commits, writes) = store.sql().commit_groups().expect("SQLite commits in groups");
    let (commits, writes) = (commits - before.0, writes - before.1);
    assert_eq!(writes, 96, "48 inserts and 48 completes went through the writer");
    assert!(commits < writes, "concurrent writes shared commits: {commits} commits for {writes} writes");
}
