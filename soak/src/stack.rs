//! The soak's stack: Envoy (2 workers) → 2 × idemd (reconciling) → a private
//! redis-server + a Postgres database of this run's own; the demo in
//! `--no-dedup --faults`. Every process is the harness's (`idem_e2e`), so the
//! soak starts them exactly as the end-to-end tests do; this adds the kills,
//! pauses and restarts the fault schedule needs.
//!
//! With `--failover sync|async` the stores are replicated instead (testkit's
//! `pg_server::Replicated` and `redis_server::RedisReplicated`: a private Postgres
//! primary with a streaming standby, a Redis primary with a replica, each behind
//! one address that follows the primary), and the faults add their failovers.

use crate::Failover;
use idem_e2e::backends::{self, OwnPostgres};
use idem_e2e::{
    free_port, spawn_sidecar, start_demo, start_envoy_workers, wait_ready, BoxError, DemoOpts, Ports, Proc, SidecarOpts,
};
use idem_testkit::pg_server::{Replicated, Replication};
use idem_testkit::redis_server::RedisReplicated;
use std::process::Command;
use std::time::{Duration, Instant};

/// The config under envoy/ the soak runs, and the placeholder of its second idemd endpoint.
pub const ENVOY_CONFIG: &str = "soak.yaml";
pub const SECOND_SIDECAR_PLACEHOLDER: &str = "port_value: 9091";
/// The config of the hostile and mixed worlds, and its placeholders: the hostile upstream's port and the access
/// log's path.
pub const HOSTILE_ENVOY_CONFIG: &str = "soak-hostile.yaml";
pub const HOSTILE_PLACEHOLDER: &str = "port_value: 8181";
pub const ACCESS_LOG_PLACEHOLDER: &str = "/tmp/idem-soak-access.log";
/// The fingerprint TTL of soak-hostile.yaml's hostile previews (the upstream's quotes are relative to it).
pub const HOSTILE_TTL_S: u64 = 60;

/// The demo's by-key endpoint (the harness points 127.0.0.1:8080 at this run's demo), for both scopes.
const STATUS_ENDPOINT: &str = "payments.transfer=http://127.0.0.1:8080/v1/transfers/by-key/{key},\
payments.large_transfer=http://127.0.0.1:8080/v1/transfers/by-key/{key}";

/// The soak's approver (`--approvers`): its identity and bearer credential (not a filter token, not
/// an agent's subject).
pub const APPROVER: (&str, &str) = ("approver-soak", "soak-approver-credential-0123456789");

/// idemd: 5 s leases (the routes' `lease_ms`) covering what the soak does to the upstream (slow answers < 2.4 s, the
/// confirm route's 2 s timeout), a reconciler pass every 200 ms, a 404 trusted 1 s after the lease ended, and a retry
/// budget that outlasts a demo restart (a lookup failing while the demo is down must not give up).
fn idemd_args(instance: &str, hostile: Option<u16>) -> Vec<String> {
    let approvers = format!("{}={}", APPROVER.0, APPROVER.1);
    let status_endpoint = match hostile {
        Some(port) => format!(
            "{STATUS_ENDPOINT},payments.hostile=http://127.0.0.1:{port}/v1/transfers/by-key/{{key}},\
             payments.hostile_nokey=http://127.0.0.1:{port}/v1/transfers/by-ref/{{ref}}"
        ),
        None => STATUS_ENDPOINT.to_owned(),
    };
    [
        "--lease-ms",
        "5000",
        "--upstream-worst-case-ms",
        "2500",
        "--gateway-timeout-ms",
        "2000",
        "--retry-backoff-total-ms",
        "100",
        "--reconcile-interval-ms",
        "200",
        "--reconcile-grace-ms",
        "1000",
        "--status-timeout-ms",
        "1000",
        "--reconcile-retry-budget",
        "100",
        "--status-endpoint",
        status_endpoint.as_str(),
        "--instance-id",
        instance,
        // The approval workload: the approver's own credential, and the lapse sweep every 200 ms.
        "--approvers",
        approvers.as_str(),
        "--probe-interval-ms",
        "200",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The stores under the soak: a database of the run's own on the shared Postgres (and a private
/// redis-server, started with the stack), or, with `--failover`, replicated stores of the run's own.
pub enum Db {
    Own(OwnPostgres),
    Replicated(Box<Replicas>),
}

/// A private Postgres primary with a streaming standby and a Redis primary with a replica, each behind one
/// address that moves to the promoted one.
pub struct Replicas {
    pub pg: Replicated,
    pub redis: RedisReplicated,
    /// Their files (removed with them; made before them, so it is dropped after).
    _dir: tempfile::TempDir,
}

impl Db {
    /// The database URL idemd and the checker use (the address that follows the primary, with `--failover`).
    pub fn url(&self) -> String {
        match self {
            Db::Own(db) => db.url.clone(),
            Db::Replicated(r) => r.pg.url(),
        }
    }
}

/// Which store a failover fault hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    Postgres,
    Redis,
}

/// Backends the soak needs: `redis-server` (a private instance) and Postgres on 127.0.0.1:5432; with
/// `--failover`, Postgres's server binaries and `redis-cli` instead of the shared server.
/// Ok(None): skipped loudly; Err with `IDEM_REQUIRE_BACKENDS=1`.
pub fn backends(failover: Option<Failover>) -> Result<Option<Db>, BoxError> {
    if let Some(f) = failover {
        let dir = tempfile::tempdir()?;
        let mode = match f {
            Failover::Sync => Replication::Sync,
            Failover::Async => Replication::Async,
        };
        let Some(pg) = Replicated::start(dir.path(), mode)? else { return Ok(None) };
        let redis_dir = dir.path().join("redis");
        std::fs::create_dir_all(&redis_dir)?;
        let Some(redis) = RedisReplicated::start(&redis_dir)? else { return Ok(None) };
        return Ok(Some(Db::Replicated(Box::new(Replicas { pg, redis, _dir: dir }))));
    }
    let redis_ok = Command::new("redis-server").arg("--version").output().is_ok_and(|o| o.status.success());
    if !redis_ok {
        if std::env::var("IDEM_REQUIRE_BACKENDS").is_ok_and(|v| v == "1") {
            return Err(
                "backend redis (redis-server for a private instance) is required (IDEM_REQUIRE_BACKENDS=1) but missing"
                    .into(),
            );
        }
        backends::skipped("redis: no redis-server binary for the soak's private instance");
        return Ok(None);
    }
    Ok(backends::own_postgres()?.map(Db::Own))
}

pub struct SoakStack {
    pub dir: tempfile::TempDir,
    pub ports: Ports,
    pub sidecar_ports: [u16; 2],
    pub redis_port: u16,
    pub db: Db,
    pub db_name: String,
    pub demo: Proc,
    pub idemd: [Proc; 2],
    pub envoy: Proc,
    /// The private redis-server (without `--failover`; with it, `db`'s replicated Redis).
    pub redis: Option<Proc>,
    pub redis_stopped: bool,
    /// The hostile upstream (in this process), in the hostile and mixed worlds.
    pub hostile: Option<idem_hostile::Hostile>,
    /// Envoy's access log (the hostile config's), surviving its restarts.
    pub access_log: std::path::PathBuf,
    demo_opts: DemoOpts,
    sidecar_opts: [SidecarOpts; 2],
}

impl SoakStack {
    /// `hostile_seed`: start the hostile upstream with this seed and run `soak-hostile.yaml` (else `soak.yaml`).
    pub async fn start(db: Db, hostile_seed: Option<u64>) -> Result<SoakStack, BoxError> {
        let dir = tempfile::tempdir()?;
        let ports = Ports { listener: free_port()?, admin: free_port()?, demo: free_port()?, sidecar: free_port()? };
        let sidecar_ports = [ports.sidecar, free_port()?];
        let redis_port = free_port()?;
        let db_url = db.url();
        let db_name = db_url.rsplit('/').next().unwrap_or("").split('?').next().unwrap_or("").to_owned();
        if db_name.is_empty() {
            return Err(format!("no database name in {db_url}").into());
        }

        let hostile = match hostile_seed {
            Some(seed) => {
                let config = idem_hostile::Config { seed, ttl_hint_s: HOSTILE_TTL_S };
                Some(idem_hostile::Hostile::start("127.0.0.1:0", config).await?)
            }
            None => None,
        };
        let hostile_port = hostile.as_ref().map(|h| h.addr.port());
        let access_log = dir.path().join("envoy-access.log");
        let (redis, redis_url) = match &db {
            Db::Own(_) => {
                let mut redis = spawn_redis(redis_port, dir.path())?;
                wait_redis(redis_port, &mut redis).await?;
                (Some(redis), format!("redis://127.0.0.1:{redis_port}"))
            }
            Db::Replicated(r) => (None, r.redis.url()),
        };
        // The demo executes every request that reaches it, so a second forward shows as a second execution,
        // on every topology: on an asynchronous standby too, which idemd waits for (`idemd_waits`).
        let demo_opts = DemoOpts { no_dedup: true, faults: true, ..Default::default() };
        let mut demo = start_demo(&demo_opts, ports.demo, dir.path())?;
        wait_ready(&format!("http://127.0.0.1:{}/healthz", ports.demo), &mut demo).await?;
        let sidecar_opts = ["soak-a", "soak-b"].map(|id| {
            SidecarOpts {
                redis_url: Some(redis_url.clone()),
                database_url: Some(db_url.clone()),
                extra_args: idemd_args(id, hostile_port),
            }
            .for_ports(&ports)
        });
        let (config, edits) = envoy_edits(sidecar_ports[1], hostile_port, &access_log);
        if idem_e2e::FilterHost::current()?.is_ext_proc() {
            // Both replicas are the filter (the ext_proc host), with the soak's own plugin configuration.
            let text = idem_e2e::envoy_text(config, &ports, &edits)?;
            let plugin =
                idem_e2e::ext_proc::plugin_config_of(&text).ok_or("the soak's config has no plugin configuration")?;
            for port in sidecar_ports {
                idem_e2e::ext_proc::prepare(port, &plugin, dir.path())?;
            }
        }
        let a = start_idemd(&sidecar_opts[0], 0, sidecar_ports[0], dir.path()).await?;
        let b = start_idemd(&sidecar_opts[1], 1, sidecar_ports[1], dir.path()).await?;
        let mut stack = SoakStack {
            envoy: spawn_envoy(&ports, sidecar_ports[1], hostile_port, &access_log, dir.path())?,
            dir,
            ports,
            sidecar_ports,
            redis_port,
            db,
            db_name,
            demo,
            idemd: [a, b],
            redis,
            redis_stopped: false,
            hostile,
            access_log,
            demo_opts,
            sidecar_opts,
        };
        wait_ready(&format!("http://127.0.0.1:{}/ready", stack.ports.admin), &mut stack.envoy).await?;
        Ok(stack)
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.ports.listener)
    }

    /// idemd replica `i`'s own API (the approver's way in).
    pub fn sidecar_url(&self, i: usize, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.sidecar_ports[i % 2])
    }

    pub fn demo_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.ports.demo)
    }

    /// The Redis idemd uses (with `--failover`, the address that follows the primary).
    pub fn redis_url(&self) -> String {
        match &self.db {
            Db::Replicated(r) => r.redis.url(),
            Db::Own(_) => format!("redis://127.0.0.1:{}", self.redis_port),
        }
    }

    fn redis_pid(&self) -> Option<u32> {
        match &self.db {
            Db::Replicated(r) => r.redis.primary().pid(),
            Db::Own(_) => self.redis.as_ref().and_then(Proc::pid),
        }
    }

    /// A failover in the worst window: the replica is cut off, and once at least `lag_ms` have passed and
    /// the upstream has executed something since (what its claim committed reached the primary alone, or on
    /// a synchronous standby waits for it), the primary is SIGKILLed and the lagging replica promoted, the
    /// address moved to it; then a new replica of it, for the next failover.
    pub async fn fail_over(&mut self, store: Store, lag_ms: u64) -> Result<String, BoxError> {
        let demo = self.demo_url("/v1/executions");
        let Db::Replicated(r) = &mut self.db else {
            return Err("a failover fault needs --failover (replicated stores)".into());
        };
        match store {
            Store::Postgres => tokio::task::block_in_place(|| r.pg.cut_replication())?,
            Store::Redis => r.redis.cut_replication(),
        }
        let before = executions(&demo).await;
        tokio::time::sleep(Duration::from_millis(lag_ms)).await;
        // On a synchronous standby nothing acquired after the cut executes (its commit waits for the standby):
        // what executes then was acquired before it. Wait a little for one, not long.
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut after = executions(&demo).await;
        while after.zip(before).is_none_or(|(a, b)| a <= b) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
            after = executions(&demo).await;
        }
        let t0 = Instant::now();
        match store {
            Store::Postgres => tokio::task::block_in_place(|| {
                r.pg.fail_over()?;
                r.pg.rebuild_standby()
            })?,
            Store::Redis => tokio::task::block_in_place(|| r.redis.fail_over())?,
        }
        let window = match (before, after) {
            (Some(b), Some(a)) if a > b => format!("{} executions", a - b),
            _ => "no execution".to_owned(),
        };
        Ok(format!(
            "replica cut off, {window} in the window, promoted; a new replica streaming {} ms later",
            t0.elapsed().as_millis()
        ))
    }

    pub async fn restart_envoy(&mut self) -> Result<(), BoxError> {
        self.envoy.kill9();
        let hostile = self.hostile.as_ref().map(|h| h.addr.port());
        self.envoy = spawn_envoy(&self.ports, self.sidecar_ports[1], hostile, &self.access_log, self.dir.path())?;
        wait_ready(&format!("http://127.0.0.1:{}/ready", self.ports.admin), &mut self.envoy).await
    }

    pub fn kill_idemd(&mut self, i: usize) {
        self.idemd[i].kill9();
    }

    pub async fn start_idemd(&mut self, i: usize) -> Result<(), BoxError> {
        self.idemd[i].kill9();
        self.idemd[i] = start_idemd(&self.sidecar_opts[i], i, self.sidecar_ports[i], self.dir.path()).await?;
        Ok(())
    }

    pub fn kill_demo(&mut self) {
        self.demo.kill9();
    }

    pub async fn start_demo(&mut self) -> Result<(), BoxError> {
        self.demo.kill9();
        self.demo = start_demo(&self.demo_opts, self.ports.demo, self.dir.path())?;
        wait_ready(&format!("http://127.0.0.1:{}/healthz", self.ports.demo), &mut self.demo).await
    }

    /// SIGSTOP / SIGCONT of the private redis-server: connections stay open, nothing answers.
    pub fn redis_signal(&mut self, stop: bool) -> Result<(), BoxError> {
        let pid = self.redis_pid().ok_or("redis-server is not running")?;
        let sig = if stop { "-STOP" } else { "-CONT" };
        let ok = Command::new("kill").arg(sig).arg(pid.to_string()).status()?.success();
        if !ok {
            return Err(format!("kill {sig} {pid} failed").into());
        }
        self.redis_stopped = stop;
        Ok(())
    }

    pub async fn redis_flush(&self) -> Result<(), BoxError> {
        let client = redis::Client::open(self.redis_url())?;
        let mut con = tokio::time::timeout(Duration::from_secs(2), client.get_multiplexed_async_connection()).await??;
        let _: () = tokio::time::timeout(Duration::from_secs(2), redis::cmd("FLUSHDB").query_async(&mut con)).await??;
        Ok(())
    }

    /// Kills every Postgres connection to this run's database (idemd's pools), from a connection to another one
    /// (with `--failover`, the primary's own clients, never its standby's replication connection).
    pub async fn pg_terminate(&self) -> Result<u64, BoxError> {
        use sqlx::Connection as _;
        let admin = match &self.db {
            Db::Own(_) => backends::postgres_url(),
            Db::Replicated(r) => r.pg.url(),
        };
        let mut con = sqlx::PgConnection::connect(&admin).await?;
        let n: i64 = sqlx::query_scalar(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = $1 \
             AND pid <> pg_backend_pid() AND backend_type = 'client backend'",
        )
        .bind(&self.db_name)
        .fetch_one(&mut con)
        .await?;
        con.close().await?;
        Ok(n.max(0) as u64)
    }

    /// After the faults: every process up again, Redis running.
    pub async fn ensure_up(&mut self) -> Result<Vec<String>, BoxError> {
        let mut restarted = Vec::new();
        if self.redis_stopped {
            self.redis_signal(false)?;
            restarted.push("redis (SIGCONT)".to_owned());
        }
        if self.demo.exited() {
            self.start_demo().await?;
            restarted.push("demo".to_owned());
        }
        for i in 0..2 {
            if self.idemd[i].exited() {
                self.start_idemd(i).await?;
                restarted.push(format!("idemd-{i}"));
            }
        }
        if self.envoy.exited() {
            self.restart_envoy().await?;
            restarted.push("envoy".to_owned());
        }
        Ok(restarted)
    }

    /// Keep the run's directory (logs, the demo's ledger) for a look after a failed run.
    pub fn keep_dir(self) -> std::path::PathBuf {
        let SoakStack { dir, .. } = self;
        dir.keep()
    }
}

/// The demo's executions so far (`None`: it did not answer, as while it restarts).
async fn executions(url: &str) -> Option<i64> {
    let client = reqwest::Client::builder().timeout(Duration::from_secs(2)).build().ok()?;
    let v: serde_json::Value = client.get(url).send().await.ok()?.json().await.ok()?;
    v["total"].as_i64()
}

fn spawn_envoy(
    ports: &Ports,
    second_sidecar: u16,
    hostile: Option<u16>,
    access_log: &std::path::Path,
    dir: &std::path::Path,
) -> Result<Proc, BoxError> {
    let (config, edits) = envoy_edits(second_sidecar, hostile, access_log);
    start_envoy_workers(config, ports, &edits, dir, 2)
}

/// The config under envoy/ the soak runs and its edits: the second idemd's port, and in the hostile
/// world the hostile upstream's port and the access log's path.
fn envoy_edits(
    second_sidecar: u16,
    hostile: Option<u16>,
    access_log: &std::path::Path,
) -> (&'static str, Vec<(String, String)>) {
    let mut edits = vec![(SECOND_SIDECAR_PLACEHOLDER.to_owned(), format!("port_value: {second_sidecar}"))];
    let config = match hostile {
        Some(port) => {
            edits.push((HOSTILE_PLACEHOLDER.to_owned(), format!("port_value: {port}")));
            edits.push((ACCESS_LOG_PLACEHOLDER.to_owned(), access_log.display().to_string()));
            HOSTILE_ENVOY_CONFIG
        }
        None => ENVOY_CONFIG,
    };
    (config, edits)
}

async fn start_idemd(opts: &SidecarOpts, i: usize, port: u16, dir: &std::path::Path) -> Result<Proc, BoxError> {
    let mut p = spawn_sidecar(&format!("idemd-{i}"), opts, port, dir)?;
    wait_ready(&format!("http://127.0.0.1:{port}/healthz"), &mut p).await?;
    Ok(p)
}

fn spawn_redis(port: u16, dir: &std::path::Path) -> Result<Proc, BoxError> {
    let mut cmd = Command::new("redis-server");
    cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]).current_dir(dir);
    Proc::spawn("redis", &mut cmd, dir)
}

async fn wait_redis(port: u16, proc: &mut Proc) -> Result<(), BoxError> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
    while Instant::now() < deadline {
        if proc.exited() {
            return Err(format!("redis-server exited during start:\n{}", proc.log_text()).into());
        }
        if let Ok(mut con) = client.get_multiplexed_async_connection().await {
            let pong: Result<String, _> = redis::cmd("PING").query_async(&mut con).await;
            if pong.is_ok() {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(format!("redis-server not ready on {port}:\n{}", proc.log_text()).into())
}
