//! Redis goes back in time (DESIGN §4): a replica that stopped receiving writes is promoted
//! (`REPLICAOF NO ONE`) after its primary is killed, and the one address idemd uses moves to it, as Sentinel
//! and a Service do. The promoted replica lacks the newest gate, and still holds IN_FLIGHT copies of operations
//! SQL has since completed or released. None of it costs a second execution or a wrong answer: SQL decides.
//!
//! Real redis-servers of the test's own (the replica streams through a link the test cuts), SQLite as the
//! truth, idemd's store as `serve` runs it.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::{
    acq, eventually, free_port, new_key, settings, simple_result, Backend, Fixture, RedisTarget, ThrowawayRedis,
};
use idem_core::protocol::{Ack, AcquireOutcome, CompleteRequest, OpKey, OwnerToken, ReleaseRequest, TerminalState};
use idem_testkit::forwarder::Forwarder;
use idemd::store::{Store, StoreSettings};

fn local(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

async fn acquired(store: &Store, key: &str) -> String {
    let a = store.acquire(&acq(key)).await;
    assert_eq!(a.outcome, AcquireOutcome::Acquired, "{a:?}");
    a.owner.expect("owner").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_promoted_redis_replica_missing_writes_costs_nothing() {
    let Some(mut primary) = ThrowawayRedis::start().await else { return };
    let link = Forwarder::start(local(primary.port)).expect("link");
    let replica_args = vec!["--replicaof".into(), "127.0.0.1".into(), link.port().to_string()];
    let Some(replica) = ThrowawayRedis::start_with(free_port(), replica_args).await else { return };
    let front = Forwarder::start(local(primary.port)).expect("front");
    let cache = RedisTarget::single(format!("redis://127.0.0.1:{}", front.port()));
    let Some(fx) = Fixture::with_redis(Backend::Sqlite, Some(cache)).await else { return };
    // A released operation's leftover gate is dropped once older than this (as in production, where it is
    // two SQL timeouts plus a second).
    let store = fx.store_with(StoreSettings { stale_in_flight_ms: 300, ..settings() }).await;

    // Two operations the replica receives while it streams.
    let done = new_key();
    let done_owner = acquired(&store, &done).await;
    let released = new_key();
    let released_owner = acquired(&store, &released).await;
    let streamed = eventually(Duration::from_secs(10), || async {
        !replica.target().hgetall(&done).await.is_empty() && !replica.target().hgetall(&released).await.is_empty()
    })
    .await;
    assert!(streamed, "the replica never received the gates");

    // Cut off: from here the replica misses every write.
    link.cut();
    let ack = store
        .complete(&CompleteRequest {
            key: OpKey::parse(&done).expect("key"),
            owner: OwnerToken::parse(&done_owner).expect("owner"),
            state: TerminalState::Done,
            result: simple_result("paid once"),
            trace_id: String::new(),
        })
        .await;
    assert_eq!(ack.outcome, Ack::Ok);
    let ack = store
        .release(&ReleaseRequest {
            key: OpKey::parse(&released).expect("key"),
            owner: OwnerToken::parse(&released_owner).expect("owner"),
            trace_id: String::new(),
        })
        .await;
    assert_eq!(ack.outcome, Ack::Ok);
    let fresh = new_key();
    let fresh_owner = acquired(&store, &fresh).await;
    // What the replica holds now: two stale IN_FLIGHT copies, and no gate for the newest operation.
    assert_eq!(replica.target().hgetall(&done).await.get("state").map(String::as_str), Some("IN_FLIGHT"));
    assert_eq!(replica.target().hgetall(&released).await.get("state").map(String::as_str), Some("IN_FLIGHT"));
    assert!(replica.target().hgetall(&fresh).await.is_empty());

    // Fail over: the primary dies, the replica is promoted with what it has, the address follows it.
    primary.stop();
    let promoted: String = replica.target().cmd(redis::cmd("REPLICAOF").arg("NO").arg("ONE")).await.expect("promote");
    assert_eq!(promoted, "OK");
    front.move_to(local(replica.port));

    // The newest operation: Redis lost its gate, the SQL row answers. IN_FLIGHT with its first owner, never a
    // second ACQUIRED.
    let a = store.acquire(&acq(&fresh)).await;
    assert_eq!(a.outcome, AcquireOutcome::InFlight, "{a:?}");
    assert_eq!(a.owner.map(|o| o.to_string()), Some(fresh_owner.clone()));
    // Once idemd's connection has found the promoted replica (until then Redis calls fail and SQL answers
    // alone), the lost gate is copied back from SQL by the acquires that miss it, every answer the same.
    let refilled = eventually(Duration::from_secs(10), || {
        let (store, fresh, owner, replica) = (store.clone(), fresh.clone(), fresh_owner.clone(), replica.target());
        async move {
            let a = store.acquire(&acq(&fresh)).await;
            assert_eq!((a.outcome, a.owner.map(|o| o.to_string())), (AcquireOutcome::InFlight, Some(owner.clone())));
            replica.hgetall(&fresh).await.get("owner") == Some(&owner)
        }
    })
    .await;
    assert!(refilled, "the promoted replica never got the lost gate back");
    // Now through the promoted replica. A stale IN_FLIGHT of an operation SQL completed: the replay, never "in progress" for ever.
    let a = store.acquire(&acq(&done)).await;
    assert_eq!(a.outcome, AcquireOutcome::Done, "{a:?}");
    assert_eq!(a.result, Some(simple_result("paid once")));
    let h = replica.target().hgetall(&done).await;
    assert_eq!(h.get("state").map(String::as_str), Some("DONE"), "the stale copy corrected from SQL: {h:?}");
    // A stale IN_FLIGHT of an operation SQL released (it never ran): in progress until the copy is stale, then
    // its first execution (a new owner), exactly once.
    let settled = eventually(Duration::from_secs(10), || {
        let (store, released, first) = (store.clone(), released.clone(), released_owner.clone());
        async move {
            let a = store.acquire(&acq(&released)).await;
            match a.outcome {
                AcquireOutcome::InFlight => false,
                AcquireOutcome::Acquired => {
                    assert_ne!(a.owner.map(|o| o.to_string()), Some(first));
                    true
                }
                other => panic!("released operation answered {other:?}"),
            }
        }
    })
    .await;
    assert!(settled, "the released operation never became acquirable");
    let a = store.acquire(&acq(&released)).await;
    assert_eq!(a.outcome, AcquireOutcome::InFlight, "acquired once only: {a:?}");
    let m = store.metrics().encode();
    assert!(m.contains(r#"idem_redis_refill_total{state="IN_FLIGHT"} "#), "counted as a refill: {m}");
    for key in [&done, &released, &fresh] {
        assert_eq!(fx.count_rows(key).await, 1, "one row each");
    }
}
