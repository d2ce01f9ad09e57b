//! Shared test fixtures: real stores, found from the configured URLs
//! (`idem_testkit::backends`: IDEM_TEST_REDIS_URL, IDEM_TEST_POSTGRES_URL,
//! IDEM_TEST_MYSQL_URL); SQLite is a fresh file in a temp dir per test.
//!
//! A backend that cannot be reached skips the test with a loud
//! `SKIPPED BACKEND <name>: <error>` line on stderr, unless
//! IDEM_REQUIRE_BACKENDS=1, which turns the skip into a failure.
//!
//! Tests share the `idem_record` table and the shared Redis: every test uses
//! fresh random nonces, so they run in parallel and repeat. Anything that
//! flushes or stops Redis uses a throwaway redis-server of its own.
#![allow(dead_code)]

pub mod scenarios;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::protocol::{AcquireRequest, StoredResult};
use idemd::metrics::Metrics;
use idemd::store::redis::{RedisOptions, RedisStore};
use idemd::store::sql::{SqlOptions, SqlStore};
use idemd::store::{Store, StoreSettings};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Postgres,
    MariaDb,
    Sqlite,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Postgres => "postgres",
            Backend::MariaDb => "mariadb",
            Backend::Sqlite => "sqlite",
        }
    }
}

// Where the backends are, and the loud skip: shared with the e2e tests, the soak and the bench.
#[allow(unused_imports)]
pub use idem_testkit::backends::{
    mysql_url as mysql_test_url, postgres_url as postgres_test_url, redis_url as redis_test_url,
    required as require_backends,
};

/// Say loudly that a backend is missing; fail instead when CI requires it.
pub fn skip(backend: &str, why: impl std::fmt::Display) {
    idem_testkit::backends::skip(backend, &why.to_string());
}

pub fn sql_opts() -> SqlOptions {
    SqlOptions { max_connections: 8, timeout: Duration::from_millis(1500), ..SqlOptions::default() }
}

pub fn settings() -> StoreSettings {
    StoreSettings { lease_ms: 60_000, terminal_retention_ms: 3_600_000, stale_in_flight_ms: 4_000 }
}

/// Where the cache is: the shared Redis, a throwaway server, or a cluster.
#[derive(Clone, Debug)]
pub struct RedisTarget {
    pub url: String,
    pub cluster: bool,
}

impl RedisTarget {
    pub fn single(url: impl Into<String>) -> Self {
        Self { url: url.into(), cluster: false }
    }

    pub fn open(&self) -> RedisStore {
        RedisStore::open(&RedisOptions {
            url: self.url.clone(),
            cluster: self.cluster,
            timeout: Duration::from_millis(300),
            retry: Duration::from_millis(100),
        })
        .expect("redis options")
    }

    /// A plain command on the cache, bypassing idemd.
    pub async fn cmd<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> redis::RedisResult<T> {
        if self.cluster {
            let nodes: Vec<&str> = self.url.split(',').collect();
            let client = redis::cluster::ClusterClient::new(nodes)?;
            let mut c = client.get_async_connection().await?;
            cmd.query_async(&mut c).await
        } else {
            let client = redis::Client::open(self.url.as_str())?;
            let mut c = client.get_multiplexed_async_connection().await?;
            cmd.query_async(&mut c).await
        }
    }

    pub async fn hgetall(&self, key: &str) -> HashMap<String, String> {
        self.cmd(redis::cmd("HGETALL").arg(idemd::store::redis::redis_key(key))).await.expect("HGETALL")
    }

    pub async fn pttl(&self, key: &str) -> i64 {
        self.cmd(redis::cmd("PTTL").arg(idemd::store::redis::redis_key(key))).await.expect("PTTL")
    }

    pub async fn del(&self, key: &str) {
        let _: i64 = self.cmd(redis::cmd("DEL").arg(idemd::store::redis::redis_key(key))).await.expect("DEL");
    }
}

/// Is the shared Redis there?
pub async fn shared_redis() -> Option<RedisTarget> {
    let url = redis_test_url();
    let target = RedisTarget::single(url.clone());
    let ping = tokio::time::timeout(Duration::from_secs(2), target.cmd::<String>(&redis::cmd("PING"))).await;
    match ping {
        Ok(Ok(_)) => Some(target),
        Ok(Err(e)) => {
            skip(&format!("redis ({url})"), e);
            None
        }
        Err(_) => {
            skip(&format!("redis ({url})"), "PING timed out");
            None
        }
    }
}

/// One SQL backend, reachable and migrated, plus optionally a cache.
pub struct Fixture {
    pub sql: Backend,
    pub sql_url: String,
    pub redis: Option<RedisTarget>,
    _tmp: Option<tempfile::TempDir>,
    _own: Option<OwnDatabase>,
}

/// A database of one test's own on the shared server, dropped with it. The
/// reconciler and the reaper work on whole tables: tests of them must not
/// see (or decide) the rows of the tests running next to them.
pub struct OwnDatabase {
    url: String,
    backend: Backend,
}

impl OwnDatabase {
    async fn create(backend: Backend, server_url: &str) -> Result<Self, String> {
        use sqlx::migrate::MigrateDatabase;
        let name = format!("idem_t_{}", &new_key()[..12]);
        let url = with_database(server_url, &name);
        let created = match backend {
            Backend::Postgres => sqlx::Postgres::create_database(&url).await,
            Backend::MariaDb => sqlx::MySql::create_database(&url).await,
            Backend::Sqlite => return Err("SQLite tests use a temp file".into()),
        };
        created.map_err(|e| e.to_string())?;
        Ok(Self { url, backend })
    }
}

impl Drop for OwnDatabase {
    fn drop(&mut self) {
        let (url, backend) = (self.url.clone(), self.backend);
        // Drop runs outside any runtime the test may still be inside of.
        let _ = std::thread::spawn(move || {
            use sqlx::migrate::MigrateDatabase;
            let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
            rt.block_on(async {
                let _ = match backend {
                    Backend::Postgres => sqlx::Postgres::force_drop_database(&url).await,
                    Backend::MariaDb => sqlx::MySql::drop_database(&url).await,
                    Backend::Sqlite => Ok(()),
                };
            });
        })
        .join();
    }
}

/// `scheme://auth@host:port/db?params` with `db` replaced by `name`.
pub fn with_database(url: &str, name: &str) -> String {
    let start = url.find("://").map(|i| i + 3).unwrap_or(0);
    let (base, query) = match url.find('?') {
        Some(q) => (&url[..q], &url[q..]),
        None => (url, ""),
    };
    match base[start..].find('/') {
        Some(slash) => format!("{}/{name}{query}", &base[..start + slash]),
        None => format!("{base}/{name}{query}"),
    }
}

impl Fixture {
    /// `None` (after a loud line) when a backend is unreachable.
    pub async fn new(sql: Backend, with_redis: bool) -> Option<Self> {
        let redis = if with_redis { Some(shared_redis().await?) } else { None };
        Self::with_redis(sql, redis).await
    }

    pub async fn with_redis(sql: Backend, redis: Option<RedisTarget>) -> Option<Self> {
        let (sql_url, tmp) = match sql {
            Backend::Postgres => (postgres_test_url(), None),
            Backend::MariaDb => (mysql_test_url(), None),
            Backend::Sqlite => {
                let dir = tempfile::tempdir().expect("tempdir");
                (format!("sqlite://{}/idem.db?mode=rwc", dir.path().display()), Some(dir))
            }
        };
        // Connecting also migrates: the first test to get here creates the table.
        match tokio::time::timeout(Duration::from_secs(10), SqlStore::connect(&sql_url, &sql_opts())).await {
            Ok(Ok(_)) => Some(Self { sql, sql_url, redis, _tmp: tmp, _own: None }),
            Ok(Err(e)) => {
                skip(&format!("{} ({})", sql.name(), idemd::redact::redact_url(&sql_url)), e);
                None
            }
            Err(_) => {
                skip(sql.name(), "connect timed out");
                None
            }
        }
    }

    /// Like `new`, on a database of this test's own (SQLite: a temp file anyway).
    pub async fn isolated(sql: Backend, with_redis: bool) -> Option<Self> {
        let mut fx = Self::new(sql, with_redis).await?;
        if sql == Backend::Sqlite {
            return Some(fx);
        }
        match OwnDatabase::create(sql, &fx.sql_url).await {
            Ok(own) => {
                fx.sql_url = own.url.clone();
                fx._own = Some(own);
                // Connecting migrates the new database.
                SqlStore::connect(&fx.sql_url, &sql_opts()).await.expect("migrate own database");
                Some(fx)
            }
            Err(e) => {
                skip(&format!("{} (own database)", sql.name()), e);
                None
            }
        }
    }

    /// The same fixture, reaching the database at another URL (a proxy).
    pub fn with_sql_url(mut self, url: String) -> Self {
        self.sql_url = url;
        self
    }

    pub fn label(&self) -> String {
        format!("{}+{}", if self.redis.is_some() { "redis" } else { "sql-only" }, self.sql.name())
    }

    /// A new replica: its own SQL pool and Redis connection, as another idemd
    /// process would have.
    pub async fn store(&self) -> Arc<Store> {
        self.store_with(settings()).await
    }

    pub async fn store_with(&self, settings: StoreSettings) -> Arc<Store> {
        let sql = SqlStore::connect(&self.sql_url, &sql_opts()).await.expect("sql connect");
        let redis = self.redis.as_ref().map(RedisTarget::open);
        Arc::new(Store::new(sql, redis, settings, Arc::new(Metrics::new())))
    }

    /// A replica that cannot reach Redis at all (as one that lost its network
    /// path to Redis would behave).
    pub async fn store_sql_only(&self) -> Arc<Store> {
        let sql = SqlStore::connect(&self.sql_url, &sql_opts()).await.expect("sql connect");
        Arc::new(Store::new(sql, None, settings(), Arc::new(Metrics::new())))
    }

    /// Raw SQL access, to check what is really in the table.
    pub async fn raw(&self) -> sqlx::AnyPool {
        sqlx::any::install_default_drivers();
        sqlx::pool::PoolOptions::<sqlx::Any>::new()
            .max_connections(2)
            .connect(&self.sql_url)
            .await
            .expect("raw sql connect")
    }

    pub async fn count_rows(&self, key: &str) -> i64 {
        assert!(idemd::api::is_token(key));
        let pool = self.raw().await;
        // The key is validated hex: safe to inline, and no dialect placeholders needed.
        let n: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM idem_record WHERE idem_key = '{key}'"))
            .fetch_one(&pool)
            .await
            .expect("count");
        pool.close().await;
        n
    }

    /// Run one statement as given (test-only SQL with validated values inlined).
    pub async fn exec(&self, sql: &str) -> u64 {
        let pool = self.raw().await;
        let n = sqlx::query(sql).execute(&pool).await.expect(sql).rows_affected();
        pool.close().await;
        n
    }

    /// What the reconciler or an operator would do.
    pub async fn set_state(&self, key: &str, state: &str) {
        assert!(idemd::api::is_token(key));
        let pool = self.raw().await;
        sqlx::query(&format!("UPDATE idem_record SET state = '{state}', lease_until = NULL WHERE idem_key = '{key}'"))
            .execute(&pool)
            .await
            .expect("update");
        pool.close().await;
    }
}

pub fn new_key() -> String {
    idemd::store::new_owner()
}

pub const PARAM: &str = "7d865e959b2466918c9863afca942d0fb89d7c9ac0c99bafc3749504ded97730";
pub const SUBJECT: &str = "9f86d081884c7d659a2feaa0c55ad015";
pub const SCOPE: &str = "payments.transfer";

pub fn acq(key: &str) -> AcquireRequest {
    AcquireRequest {
        key: idem_core::protocol::OpKey::parse(key).expect("key"),
        param_hash: PARAM.into(),
        subject_hash: SUBJECT.into(),
        scope: SCOPE.into(),
        lease_ms: 0,
        trace_id: "test-trace".into(),
        mode: Default::default(),
        exp: None,
        upstream_ignores_keys: false,
        business_ref: None,
        fields: None,
        approval: None,
    }
}

/// A result that only survives if it is stored byte for byte: every byte
/// value in the body, repeated and non-ASCII headers, in order.
pub fn rich_result(status: u16) -> (StoredResult, Vec<u8>) {
    use base64::Engine;
    let mut body: Vec<u8> = (0..=255u8).collect();
    body.extend_from_slice("{\"transfer_id\":\"tr_1\",\"memo\":\"äöü ✓ \\\"quoted\\\"\"}\r\n\0".as_bytes());
    let result = StoredResult {
        status,
        headers: vec![
            ("content-type".into(), "application/json; charset=utf-8".into()),
            ("set-cookie".into(), "a=1; Path=/".into()),
            ("set-cookie".into(), "b=2".into()),
            ("x-note".into(), "ünïcödé \"q\" \\ ✓".into()),
            ("x-empty".into(), String::new()),
        ],
        body_b64: base64::engine::general_purpose::STANDARD.encode(&body),
    };
    (result, body)
}

pub fn simple_result(tag: &str) -> StoredResult {
    use base64::Engine;
    StoredResult {
        status: 200,
        headers: vec![("content-type".into(), "application/json".into())],
        body_b64: base64::engine::general_purpose::STANDARD.encode(format!("{{\"tag\":\"{tag}\"}}")),
    }
}

// ---- throwaway redis-server --------------------------------------------

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// A redis-server of this test's own, so it may be flushed and killed.
pub struct ThrowawayRedis {
    pub port: u16,
    child: Option<Child>,
    extra: Vec<String>,
    /// Its working directory (cluster node files), removed with it.
    dir: tempfile::TempDir,
}

impl ThrowawayRedis {
    /// `None` (after a loud line) when no redis-server binary is installed.
    pub async fn start() -> Option<Self> {
        Self::start_with(free_port(), Vec::new()).await
    }

    pub async fn start_with(port: u16, extra: Vec<String>) -> Option<Self> {
        let mut me = Self { port, child: None, extra, dir: tempfile::tempdir().expect("tempdir") };
        if let Err(e) = me.spawn().await {
            skip("redis-server (throwaway)", e);
            return None;
        }
        Some(me)
    }

    async fn spawn(&mut self) -> Result<(), String> {
        let bin = std::env::var("IDEM_TEST_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        let dir = self.dir.path();
        let child = Command::new(bin)
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--dir", &dir.display().to_string()])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot run redis-server: {e}"))?;
        self.child = Some(child);
        for _ in 0..100 {
            let t = RedisTarget::single(self.url());
            if let Ok(Ok(_)) =
                tokio::time::timeout(Duration::from_millis(200), t.cmd::<String>(&redis::cmd("PING"))).await
            {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(format!("redis-server on port {} did not answer", self.port))
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn target(&self) -> RedisTarget {
        RedisTarget::single(self.url())
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start again on the same port (empty: it keeps nothing on disk).
    pub async fn restart(&mut self) {
        self.stop();
        self.spawn().await.expect("restart redis-server");
    }
}

impl Drop for ThrowawayRedis {
    fn drop(&mut self) {
        self.stop();
    }
}

// ---- a TCP proxy that can cut the database off ---------------------------

/// Sits between idemd and a real database so a test can make SQL unreachable
/// (and reachable again) without touching the shared server.
pub struct CutProxy {
    pub port: u16,
    up: Arc<AtomicBool>,
    links: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl CutProxy {
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().expect("addr").port();
        let up = Arc::new(AtomicBool::new(true));
        let links: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let (up2, links2) = (up.clone(), links.clone());
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if !up2.load(Ordering::SeqCst) {
                    drop(inbound);
                    continue;
                }
                let link = tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                links2.lock().expect("links").push(link);
            }
        });
        Self { port, up, links, accept }
    }

    /// Every open connection dies and new ones are closed on arrival.
    pub fn cut(&self) {
        self.up.store(false, Ordering::SeqCst);
        for l in self.links.lock().expect("links").drain(..) {
            l.abort();
        }
    }

    pub fn restore(&self) {
        self.up.store(true, Ordering::SeqCst);
    }
}

impl Drop for CutProxy {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}

/// `scheme://user@host:port/db?x` → (host:port, the URL pointing at 127.0.0.1:`port`).
pub fn reroute(url: &str, default_port: u16, port: u16) -> (SocketAddr, String) {
    let scheme_end = url.find("://").expect("scheme") + 3;
    let rest = &url[scheme_end..];
    let auth_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let authority = &rest[..auth_end];
    let (userinfo, hostport) = match authority.rfind('@') {
        Some(at) => (&authority[..=at], &authority[at + 1..]),
        None => ("", authority),
    };
    let hostport = if hostport.contains(':') { hostport.to_string() } else { format!("{hostport}:{default_port}") };
    let hostport = hostport.replace("localhost", "127.0.0.1");
    let target: SocketAddr = hostport.parse().expect("numeric host:port in test URL");
    (target, format!("{}{}127.0.0.1:{}{}", &url[..scheme_end], userinfo, port, &rest[auth_end..]))
}

/// Poll until `f` is true or the time is up.
pub async fn eventually<F, Fut>(within: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if f().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One `#[tokio::test]` per store combination (Redis in front of SQL, and SQL alone, on Postgres,
/// MariaDB and SQLite) for each named scenario `async fn name(fx: &Fixture)`, each on a
/// database of its own: `redis_postgres::name`, `sql_only_sqlite::name`, and so on.
#[allow(unused_macros)]
macro_rules! isolated_backend_suites {
    ($($name:ident),* $(,)?) => {
        isolated_backend_suites!(@suite redis_postgres, Backend::Postgres, true; $($name),*);
        isolated_backend_suites!(@suite redis_mariadb, Backend::MariaDb, true; $($name),*);
        isolated_backend_suites!(@suite redis_sqlite, Backend::Sqlite, true; $($name),*);
        isolated_backend_suites!(@suite sql_only_postgres, Backend::Postgres, false; $($name),*);
        isolated_backend_suites!(@suite sql_only_mariadb, Backend::MariaDb, false; $($name),*);
        isolated_backend_suites!(@suite sql_only_sqlite, Backend::Sqlite, false; $($name),*);
    };
    (@suite $module:ident, $sql:expr, $redis:expr; $($name:ident),*) => {
        mod $module {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    if let Some(fx) = Fixture::isolated($sql, $redis).await {
                        super::$name(&fx).await;
                    }
                }
            )*
        }
    };
}
