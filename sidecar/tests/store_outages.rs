//! Store failures, per SQL backend: Redis flushed, Redis stopped and started
//! again, SQL cut off. Each test brings its own redis-server (or TCP proxy in
//! front of the database), so nothing shared is flushed or stopped.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{acq, eventually, new_key, simple_result, Backend, CutProxy, Fixture, RedisTarget, ThrowawayRedis};
use idem_core::protocol::{Ack, AcquireOutcome, AcquireRequest, CompleteRequest, ReleaseRequest, TerminalState};
use idemd::store::Store;

async fn complete(store: &Store, key: &str, owner: &str, tag: &str) -> Ack {
    store
        .complete(&CompleteRequest {
            key: idem_core::protocol::OpKey::parse(key).expect("key"),
            owner: idem_core::protocol::OwnerToken::parse(owner).expect("owner"),
            state: TerminalState::Done,
            result: simple_result(tag),
            trace_id: String::new(),
        })
        .await
        .outcome
}

async fn acquired(store: &Store, key: &str) -> String {
    let a = store.acquire(&acq(key)).await;
    assert_eq!(a.outcome, AcquireOutcome::Acquired, "{a:?}");
    a.owner.expect("owner").to_string()
}

/// FLUSHDB after DONE: the acquire is answered from SQL and Redis holds the
/// key again. The same for an IN_FLIGHT key: never ACQUIRED twice.
async fn flushdb_after_done_answers_from_sql(sql: Backend) {
    let Some(redis) = ThrowawayRedis::start().await else { return };
    let Some(fx) = Fixture::with_redis(sql, Some(redis.target())).await else { return };
    let store = fx.store().await;

    let done = new_key();
    let owner = acquired(&store, &done).await;
    assert_eq!(complete(&store, &done, &owner, "before the flush").await, Ack::Ok);
    let busy = new_key();
    let busy_owner = acquired(&store, &busy).await;

    let _: String = redis.target().cmd(&redis::cmd("FLUSHDB")).await.expect("FLUSHDB");
    assert!(redis.target().hgetall(&done).await.is_empty());

    let a = store.acquire(&acq(&done)).await;
    assert_eq!(a.outcome, AcquireOutcome::Done);
    assert_eq!(a.result, Some(simple_result("before the flush")));
    let h = redis.target().hgetall(&done).await;
    assert_eq!(h.get("state").map(String::as_str), Some("DONE"), "Redis holds it again");

    let b = store.acquire(&acq(&busy)).await;
    assert_eq!(b.outcome, AcquireOutcome::InFlight);
    assert_eq!(b.owner.as_deref(), Some(busy_owner.as_str()));
    assert_eq!(redis.target().hgetall(&busy).await.get("owner"), Some(&busy_owner));
    assert_eq!(fx.count_rows(&busy).await, 1);
}

/// Redis dies mid-test: every answer stays exact on SQL alone, the metrics
/// and health say so, and when Redis comes back it is used again without a
/// restart.
async fn redis_stopped_mid_test_keeps_exact_semantics(sql: Backend) {
    let Some(mut redis) = ThrowawayRedis::start().await else { return };
    let Some(fx) = Fixture::with_redis(sql, Some(redis.target())).await else { return };
    let store = fx.store().await;

    let k1 = new_key();
    let o1 = acquired(&store, &k1).await;
    assert_eq!(complete(&store, &k1, &o1, "k1").await, Ack::Ok);
    let k_busy = new_key();
    let o_busy = acquired(&store, &k_busy).await;
    assert_eq!(store.health().await.redis, "up");

    redis.stop();

    // Replays and IN_FLIGHT come from SQL.
    let a = store.acquire(&acq(&k1)).await;
    assert_eq!(a.outcome, AcquireOutcome::Done);
    assert_eq!(a.result, Some(simple_result("k1")));
    let a = store.acquire(&acq(&k_busy)).await;
    assert_eq!(a.outcome, AcquireOutcome::InFlight);
    assert_eq!(a.owner.as_deref(), Some(o_busy.as_str()));

    // A fresh key: exactly one winner among concurrent acquires.
    let k2 = new_key();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..50 {
        let (s, k) = (store.clone(), k2.clone());
        tasks.spawn(async move { s.acquire(&acq(&k)).await });
    }
    let mut owners = Vec::new();
    let mut in_flight = 0;
    while let Some(r) = tasks.join_next().await {
        let a = r.expect("task");
        match a.outcome {
            AcquireOutcome::Acquired => owners.push(a.owner.expect("owner")),
            AcquireOutcome::InFlight => in_flight += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((owners.len(), in_flight), (1, 49));
    let o2 = owners.remove(0);
    let tampered = AcquireRequest { param_hash: "f".repeat(64), ..acq(&k2) };
    assert_eq!(store.acquire(&tampered).await.outcome, AcquireOutcome::ParamMismatch);
    assert_eq!(complete(&store, &k2, &new_key(), "forged").await, Ack::NotOwner);
    assert_eq!(complete(&store, &k2, &o2, "k2").await, Ack::Ok);
    assert_eq!(store.acquire(&acq(&k2)).await.result, Some(simple_result("k2")));

    // release and acquire again.
    let k3 = new_key();
    let o3 = acquired(&store, &k3).await;
    let released = store
        .release(&ReleaseRequest {
            key: idem_core::protocol::OpKey::parse(&k3).expect("key"),
            owner: idem_core::protocol::OwnerToken::parse(&o3).expect("owner"),
            trace_id: String::new(),
        })
        .await;
    assert_eq!(released.outcome, Ack::Ok);
    let o3b = acquired(&store, &k3).await;
    assert_ne!(o3, o3b);

    // It says so.
    assert_eq!(store.health().await.redis, "down");
    let m = store.metrics().encode();
    assert!(m.contains("idem_redis_up 0"), "{m}");
    assert!(!m.contains("idem_redis_fallback_total 0"), "{m}");

    redis.restart().await;

    // Used again, without a restart of idemd.
    let back = eventually(Duration::from_secs(5), || {
        let store = store.clone();
        let target = redis.target();
        async move {
            let k = new_key();
            store.acquire(&acq(&k)).await;
            !target.hgetall(&k).await.is_empty()
        }
    })
    .await;
    assert!(back, "Redis was not used again after it came back");
    assert_eq!(store.health().await.redis, "up");
    assert!(store.metrics().encode().contains("idem_redis_up 1"));
    // And the restarted (empty) Redis is refilled from SQL.
    assert_eq!(store.acquire(&acq(&k2)).await.result, Some(simple_result("k2")));
    assert_eq!(redis.target().hgetall(&k2).await.get("state").map(String::as_str), Some("DONE"));
}

/// SQL cut off: acquire answers STORE_UNAVAILABLE (nothing ran), complete and
/// release too; what Redis already knows still answers. Back up: the nonce
/// that was refused is acquirable — the failed attempt left no IN_FLIGHT.
async fn sql_down_answers_store_unavailable(sql: Backend, with_redis: bool) {
    let (url, default_port) = match sql {
        Backend::Postgres => (common::postgres_test_url(), 5432),
        Backend::MariaDb => (common::mysql_test_url(), 3306),
        Backend::Sqlite => unreachable!("SQLite has no network to cut"),
    };
    let redis = if with_redis {
        match common::shared_redis().await {
            Some(r) => Some(r),
            None => return,
        }
    } else {
        None
    };
    // Reachability of the real server first (loud skip), then the proxy.
    if Fixture::with_redis(sql, None).await.is_none() {
        return;
    }
    let (real, _) = common::reroute(&url, default_port, 0);
    let proxy = CutProxy::start(real).await;
    let (_, proxied) = common::reroute(&url, default_port, proxy.port);
    let Some(fx) = Fixture::with_redis(sql, redis.clone()).await else { return };
    let fx = fx.with_sql_url(proxied);
    let store: Arc<Store> = fx.store().await;

    let k1 = new_key();
    let o1 = acquired(&store, &k1).await;
    assert_eq!(complete(&store, &k1, &o1, "k1").await, Ack::Ok);
    let k_busy = new_key();
    let o_busy = acquired(&store, &k_busy).await;

    proxy.cut();

    // Before any call fails, the probe says so (an idle replica's alert must fire too).
    let (health, backlog) = idemd::probe::Probe::new(store.clone()).once().await;
    assert_eq!((health.sql, backlog), ("down", None));
    assert!(store.metrics().encode().contains("idem_sql_up 0"), "{}", store.metrics().encode());

    let k2 = new_key();
    let a = store.acquire(&acq(&k2)).await;
    assert_eq!(a.outcome, AcquireOutcome::StoreUnavailable, "{a:?}");
    assert_eq!(fx.redis.is_some(), redis.is_some());
    if let Some(r) = &redis {
        assert!(r.hgetall(&k2).await.is_empty(), "the refused attempt left no IN_FLIGHT in Redis");
        // Redis still serves what it knows: replays, and IN_FLIGHT.
        let a = store.acquire(&acq(&k1)).await;
        assert_eq!(a.outcome, AcquireOutcome::Done);
        assert_eq!(a.result, Some(simple_result("k1")));
        let a = store.acquire(&acq(&k_busy)).await;
        assert_eq!(a.outcome, AcquireOutcome::InFlight);
    } else {
        assert_eq!(store.acquire(&acq(&k1)).await.outcome, AcquireOutcome::StoreUnavailable);
    }
    assert_eq!(complete(&store, &k_busy, &o_busy, "busy").await, Ack::StoreUnavailable);
    let released = store
        .release(&ReleaseRequest {
            key: idem_core::protocol::OpKey::parse(&k_busy).expect("key"),
            owner: idem_core::protocol::OwnerToken::parse(&o_busy).expect("owner"),
            trace_id: String::new(),
        })
        .await;
    assert_eq!(released.outcome, Ack::StoreUnavailable);
    assert!(store.operation(&k1).await.is_err());
    assert_eq!(store.health().await.sql, "down");
    assert!(store.metrics().encode().contains("idem_sql_up 0"));

    proxy.restore();

    let back = eventually(Duration::from_secs(10), || {
        let store = store.clone();
        async move { store.health().await.sql == "up" }
    })
    .await;
    assert!(back, "SQL did not come back");
    let o2 = acquired(&store, &k2).await;
    assert_eq!(complete(&store, &k2, &o2, "k2").await, Ack::Ok);
    assert_eq!(complete(&store, &k_busy, &o_busy, "busy").await, Ack::Ok);
    assert_eq!(store.acquire(&acq(&k_busy)).await.result, Some(simple_result("busy")));
}

macro_rules! per_backend {
    ($module:ident, $sql:expr) => {
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn flushdb_after_done_answers_from_sql() {
                super::flushdb_after_done_answers_from_sql($sql).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn redis_stopped_mid_test_keeps_exact_semantics() {
                super::redis_stopped_mid_test_keeps_exact_semantics($sql).await;
            }
        }
    };
}

per_backend!(postgres, Backend::Postgres);
per_backend!(mariadb, Backend::MariaDb);
per_backend!(sqlite, Backend::Sqlite);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_down_with_redis() {
    sql_down_answers_store_unavailable(Backend::Postgres, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_down_sql_only() {
    sql_down_answers_store_unavailable(Backend::Postgres, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_down_with_redis() {
    sql_down_answers_store_unavailable(Backend::MariaDb, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_down_sql_only() {
    sql_down_answers_store_unavailable(Backend::MariaDb, false).await;
}

/// The suite on a real three-node Redis Cluster (hash-tagged keys, scripts
/// routed by slot), in front of SQLite.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_cluster_runs_the_suite() {
    let mut nodes = Vec::new();
    for _ in 0..3 {
        let port = common::free_port();
        let extra = vec![
            "--cluster-enabled".to_string(),
            "yes".to_string(),
            "--cluster-config-file".to_string(),
            "nodes.conf".to_string(),
        ];
        let Some(node) = ThrowawayRedis::start_with(port, extra).await else { return };
        nodes.push(node);
    }
    let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
    let created = std::process::Command::new("redis-cli")
        .args(["--cluster", "create"])
        .args(&addrs)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .output();
    match created {
        Ok(out) if out.status.success() => {}
        Ok(out) => {
            common::skip("redis cluster", String::from_utf8_lossy(&out.stdout).to_string());
            return;
        }
        Err(e) => {
            common::skip("redis cluster (redis-cli)", e);
            return;
        }
    }
    let first = nodes[0].target();
    let ready = eventually(Duration::from_secs(10), || {
        let first = first.clone();
        async move {
            let info: String = first.cmd(redis::cmd("CLUSTER").arg("INFO")).await.unwrap_or_default();
            info.contains("cluster_state:ok")
        }
    })
    .await;
    assert!(ready, "cluster did not become ready");

    let url = nodes.iter().map(|n| n.url()).collect::<Vec<_>>().join(",");
    let target = RedisTarget { url, cluster: true };
    let Some(fx) = Fixture::with_redis(Backend::Sqlite, Some(target)).await else { return };
    common::scenarios::all(&fx).await;

    // The keys really are spread over the nodes.
    let mut keys_per_node = Vec::new();
    for n in &nodes {
        let size: i64 = n.target().cmd(&redis::cmd("DBSIZE")).await.expect("DBSIZE");
        keys_per_node.push(size);
    }
    assert!(keys_per_node.iter().filter(|&&n| n > 0).count() >= 2, "{keys_per_node:?}");
}
