//! The Redis fast path: the Lua scripts in `lua/`, one hash per operation at
//! `idem:{<nonce>}`.
//!
//! The braces are a Redis Cluster hash tag: every script touches exactly one
//! key, so every script runs on the one node that owns the nonce's slot.
//!
//! Redis is a cache and a concurrency gate, never the truth. So every call is
//! bounded by a short timeout, and any error or timeout makes the caller fall
//! back to SQL. While Redis is down a small breaker lets one request probe it
//! every `retry` interval and sends the rest straight to SQL, so an outage
//! costs one timeout per interval instead of one per request, and the fast
//! path returns by itself once a probe succeeds.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use redis::{RedisError, Script, ScriptInvocation, Value};

use super::record::Record;

pub struct Scripts {
    acquire: Script,
    complete: Script,
    release: Script,
    renew: Script,
    restore: Script,
}

impl Default for Scripts {
    fn default() -> Self {
        Self {
            acquire: Script::new(ACQUIRE_LUA),
            complete: Script::new(COMPLETE_LUA),
            release: Script::new(RELEASE_LUA),
            renew: Script::new(RENEW_LUA),
            restore: Script::new(RESTORE_LUA),
        }
    }
}

pub const ACQUIRE_LUA: &str = include_str!("../../../lua/acquire.lua");
pub const COMPLETE_LUA: &str = include_str!("../../../lua/complete.lua");
pub const RELEASE_LUA: &str = include_str!("../../../lua/release.lua");
pub const RENEW_LUA: &str = include_str!("../../../lua/renew.lua");
pub const RESTORE_LUA: &str = include_str!("../../../lua/restore.lua");

/// The cache key of an operation.
pub fn redis_key(nonce: &str) -> String {
    format!("idem:{{{nonce}}}")
}

#[derive(Clone)]
enum Conn {
    /// Multiplexed, reconnects by itself.
    Single(ConnectionManager),
    /// Routes each script to the slot's node and follows MOVED/ASK.
    Cluster(ClusterConnection),
}

/// Why a Redis call gave no answer. The caller serves the request from SQL.
#[derive(Debug)]
pub enum RedisDown {
    /// The breaker is open: Redis failed recently, this call did not try.
    Skipped,
    Timeout,
    Error(RedisError),
    /// The script answered something this version does not understand.
    Protocol(String),
}

impl std::fmt::Display for RedisDown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Skipped => write!(f, "skipped while Redis is down"),
            Self::Timeout => write!(f, "Redis call timed out"),
            Self::Error(e) => write!(f, "Redis error: {e}"),
            Self::Protocol(what) => write!(f, "unexpected Redis reply: {what}"),
        }
    }
}

/// What `lua/acquire.lua` said.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum AcquireReply {
    Acquired,
    InFlight {
        owner: String,
        age_ms: i64,
    },
    /// The stored StoredResult JSON.
    Done(String),
    Failed(String),
    NeedsReview,
    ParamMismatch,
}

/// What `lua/complete.lua` and `lua/release.lua` said.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WriteReply {
    Ok,
    Missing,
    NotOwner,
}

/// The binding an acquire carries: the nonce is only valid with these.
#[derive(Clone, Copy, Debug)]
pub struct Binding<'a> {
    pub param_hash: &'a str,
    pub subject_hash: &'a str,
    pub scope: &'a str,
}

#[derive(Clone, Debug)]
pub struct RedisOptions {
    /// One URL, or with `cluster` a comma-separated list of seed nodes.
    pub url: String,
    pub cluster: bool,
    pub timeout: Duration,
    /// While down, how often one call probes Redis again.
    pub retry: Duration,
}

pub struct RedisStore {
    conn: Conn,
    scripts: Scripts,
    timeout: Duration,
    breaker: Breaker,
}

impl RedisStore {
    /// Never waits for Redis: the connection is made on first use, so idemd
    /// starts (SQL alone) while Redis is still down.
    pub fn open(opts: &RedisOptions) -> Result<Self, RedisError> {
        let conn = if opts.cluster {
            let nodes: Vec<&str> = opts.url.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
            let client = redis::cluster::ClusterClient::builder(nodes)
                .connection_timeout(opts.timeout)
                .response_timeout(opts.timeout)
                .retries(1)
                .build()?;
            Conn::Cluster(
                client.get_pending_async_connection_with_config(
                    redis::cluster::ClusterConfig::new()
                        .set_connection_timeout(opts.timeout)
                        .set_response_timeout(opts.timeout),
                ),
            )
        } else {
            let client = redis::Client::open(opts.url.as_str())?;
            let config = redis::aio::ConnectionManagerConfig::new()
                .set_connection_timeout(Some(opts.timeout))
                .set_response_timeout(Some(opts.timeout))
                // One quick retry: the breaker, not the manager, paces probes.
                .set_number_of_retries(1)
                .set_min_delay(Duration::from_millis(20))
                .set_max_delay(Duration::from_millis(100));
            Conn::Single(ConnectionManager::new_lazy_with_config(client, config)?)
        };
        Ok(Self { conn, scripts: Scripts::default(), timeout: opts.timeout, breaker: Breaker::new(opts.retry) })
    }

    /// Whether the last call (or probe) reached Redis.
    pub fn is_up(&self) -> bool {
        self.breaker.up.load(Ordering::Relaxed)
    }

    async fn invoke(&self, inv: ScriptInvocation<'_>) -> Result<Value, RedisDown> {
        if !self.breaker.may_try() {
            return Err(RedisDown::Skipped);
        }
        let call = async {
            match &self.conn {
                Conn::Single(c) => inv.invoke_async::<Value>(&mut c.clone()).await,
                Conn::Cluster(c) => inv.invoke_async::<Value>(&mut c.clone()).await,
            }
        };
        self.settle(tokio::time::timeout(self.timeout, call).await)
    }

    async fn command(&self, cmd: redis::Cmd, force: bool) -> Result<Value, RedisDown> {
        if !force && !self.breaker.may_try() {
            return Err(RedisDown::Skipped);
        }
        let call = async {
            match &self.conn {
                Conn::Single(c) => cmd.query_async::<Value>(&mut c.clone()).await,
                Conn::Cluster(c) => cmd.query_async::<Value>(&mut c.clone()).await,
            }
        };
        self.settle(tokio::time::timeout(self.timeout, call).await)
    }

    fn settle(&self, r: Result<Result<Value, RedisError>, tokio::time::error::Elapsed>) -> Result<Value, RedisDown> {
        match r {
            Ok(Ok(v)) => {
                self.breaker.succeeded();
                Ok(v)
            }
            Ok(Err(e)) => {
                self.breaker.failed();
                Err(RedisDown::Error(e))
            }
            Err(_) => {
                self.breaker.failed();
                Err(RedisDown::Timeout)
            }
        }
    }

    pub async fn acquire(
        &self,
        key: &str,
        binding: Binding<'_>,
        owner: &str,
        lease_ms: u64,
    ) -> Result<AcquireReply, RedisDown> {
        let mut inv = self.scripts.acquire.key(redis_key(key));
        inv.arg(binding.param_hash).arg(binding.subject_hash).arg(binding.scope).arg(owner).arg(lease_ms);
        let v = self.invoke(inv).await?;
        let parts: (String, String, i64) =
            redis::from_redis_value(v).map_err(|e| RedisDown::Protocol(format!("acquire: {e}")))?;
        Ok(match parts.0.as_str() {
            "ACQUIRED" => AcquireReply::Acquired,
            "IN_FLIGHT" => AcquireReply::InFlight { owner: parts.1, age_ms: parts.2 },
            "DONE" => AcquireReply::Done(parts.1),
            "FAILED" => AcquireReply::Failed(parts.1),
            "NEEDS_REVIEW" => AcquireReply::NeedsReview,
            "PARAM_MISMATCH" => AcquireReply::ParamMismatch,
            other => return Err(RedisDown::Protocol(format!("acquire answered {other:?}"))),
        })
    }

    pub async fn complete(
        &self,
        key: &str,
        owner: &str,
        state: &str,
        result_json: &str,
        retention_ms: u64,
    ) -> Result<WriteReply, RedisDown> {
        let mut inv = self.scripts.complete.key(redis_key(key));
        inv.arg(owner).arg(state).arg(result_json).arg(retention_ms.max(1));
        write_reply(self.invoke(inv).await?)
    }

    pub async fn release(&self, key: &str, owner: &str) -> Result<WriteReply, RedisDown> {
        let mut inv = self.scripts.release.key(redis_key(key));
        inv.arg(owner);
        write_reply(self.invoke(inv).await?)
    }

    /// Extend the cached IN_FLIGHT copy's lease (SQL already did: this only keeps the cache in step).
    pub async fn renew(&self, key: &str, owner: &str, lease_ms: u64) -> Result<WriteReply, RedisDown> {
        let mut inv = self.scripts.renew.key(redis_key(key));
        inv.arg(owner).arg(lease_ms.max(1));
        write_reply(self.invoke(inv).await?)
    }

    /// Copy a SQL row into the cache, never moving it backwards.
    pub async fn restore(&self, rec: &Record, ttl_ms: u64) -> Result<(), RedisDown> {
        let result = match &rec.result {
            Some(r) => serde_json::to_string(r).map_err(|e| RedisDown::Protocol(e.to_string()))?,
            None => String::new(),
        };
        let mut inv = self.scripts.restore.key(redis_key(&rec.key));
        inv.arg(rec.state.as_str())
            .arg(&rec.param_hash)
            .arg(&rec.subject_hash)
            .arg(&rec.scope)
            .arg(rec.owner.as_deref().unwrap_or(""))
            .arg(result)
            .arg(ttl_ms.max(1));
        self.invoke(inv).await.map(|_| ())
    }

    /// Drop the cached copy; the next acquire refills it from SQL.
    pub async fn evict(&self, key: &str) -> Result<(), RedisDown> {
        self.command(redis::cmd("DEL").arg(redis_key(key)).clone(), false).await.map(|_| ())
    }

    /// For /healthz: always tries, whatever the breaker says, and so also
    /// closes the breaker as soon as Redis answers again.
    pub async fn ping(&self) -> Result<(), RedisDown> {
        self.command(redis::cmd("PING"), true).await.map(|_| ())
    }
}

fn write_reply(v: Value) -> Result<WriteReply, RedisDown> {
    let s: String = redis::from_redis_value(v).map_err(|e| RedisDown::Protocol(e.to_string()))?;
    match s.as_str() {
        "OK" => Ok(WriteReply::Ok),
        "MISSING" => Ok(WriteReply::Missing),
        "NOT_OWNER" => Ok(WriteReply::NotOwner),
        other => Err(RedisDown::Protocol(format!("script answered {other:?}"))),
    }
}

/// Up, or down with the time of the next allowed probe.
struct Breaker {
    up: AtomicBool,
    /// Milliseconds since `epoch` before which no call tries Redis.
    next_probe_ms: AtomicU64,
    epoch: Instant,
    retry: Duration,
}

impl Breaker {
    fn new(retry: Duration) -> Self {
        // Optimistic at start: the first call finds out.
        Self { up: AtomicBool::new(true), next_probe_ms: AtomicU64::new(0), epoch: Instant::now(), retry }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn may_try(&self) -> bool {
        if self.up.load(Ordering::Relaxed) {
            return true;
        }
        let now = self.now_ms();
        let next = self.next_probe_ms.load(Ordering::Relaxed);
        // Exactly one caller wins the swap and probes; the rest go to SQL.
        now >= next
            && self
                .next_probe_ms
                .compare_exchange(next, now + self.retry.as_millis() as u64, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
    }

    fn succeeded(&self) {
        self.up.store(true, Ordering::Relaxed);
    }

    fn failed(&self) {
        self.next_probe_ms.store(self.now_ms() + self.retry.as_millis() as u64, Ordering::Relaxed);
        self.up.store(false, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_hash_tagged() {
        assert_eq!(redis_key("0123456789abcdef0123456789abcdef"), "idem:{0123456789abcdef0123456789abcdef}");
    }

    #[test]
    fn breaker_lets_one_probe_through_per_interval() {
        let b = Breaker::new(Duration::from_secs(3600));
        assert!(b.may_try());
        b.failed();
        assert!(!b.may_try(), "inside the interval nobody probes");
        b.next_probe_ms.store(0, Ordering::Relaxed);
        assert!(b.may_try(), "the first caller after the interval probes");
        assert!(!b.may_try(), "and only that one");
        b.succeeded();
        assert!(b.may_try());
    }
}
