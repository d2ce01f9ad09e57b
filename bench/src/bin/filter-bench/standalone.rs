//! The optional side of the duplicate-confirm case on Redis: a standalone Redis-backed
//! idempotency proxy, ldclabs/idempotent-proxy (its `idempotent-proxy-server`, a small
//! axum service), in front of the same demo, sent the same confirm by the same client.
//!
//! This repository neither contains nor builds it: `IDEM_BENCH_STANDALONE_PROXY` names a
//! binary built outside the repository from that project's own sources, following its own
//! README. Without the variable the report says the row was not measured.
//!
//! How it runs here, all from its environment (it also insists on a `.env` file in its
//! working directory, which gets only a comment): `SERVER_ADDR` a free loopback port;
//! `REDIS_URL` the bench's Redis with database 15 (the project's keys live in database 0) and
//! the Idempotency-Key `idem-bench-standalone-<pid>` (removed at the end); `URL_IDEM_BENCH_DEMO`
//! the demo's confirm endpoint (a request to `/URL_IDEM_BENCH_DEMO` goes there: the proxy
//! forwards to https only otherwise); `REQUEST_TIMEOUT` 10 minutes (it is also how long the
//! cached answer lives); `LOG_LEVEL=warn` (like the demo's); `TOKIO_WORKER_THREADS=1`, one
//! worker like Envoy's `--concurrency 1` (an inherited `TOKIO_WORKER_THREADS` wins). A
//! duplicate costs it two Redis round trips (`SET NX` finds the key taken, `GET` reads the
//! cached answer); the filter answers one from its replay cache.

use crate::cases::DEDUP_BASELINE;
use crate::client::{confirm_request_to, once};
use crate::report::Row;
use crate::stack::redis_del;
use idem_e2e::{free_port, BoxError, Proc};
use std::time::{Duration, Instant};

pub(crate) const ENV: &str = "IDEM_BENCH_STANDALONE_PROXY";
pub(crate) const NAME: &str = "standalone idempotency proxy (ldclabs/idempotent-proxy)";
/// The Redis database it uses: not the project's (0).
const REDIS_DB: u32 = 15;
/// Its `URL_*` route to the demo's confirm endpoint.
const ROUTE: &str = "URL_IDEM_BENCH_DEMO";

pub(crate) struct StandaloneProxy {
    pub(crate) port: u16,
    pub(crate) proc: Proc,
    _dir: tempfile::TempDir,
    redis_url: String,
    pub(crate) key: String,
    /// What the report says about how it ran.
    pub(crate) about: String,
}

/// The standalone proxy, or why it is not measured.
pub(crate) enum Standalone {
    Running(StandaloneProxy),
    NotMeasured(String),
}

/// Its report row's case.
pub(crate) fn row_case() -> String {
    format!("{NAME} replays")
}

/// Its report row when it did not run, saying why.
pub(crate) fn unmeasured_row(why: &str) -> Row {
    Row { case: row_case(), baseline: DEDUP_BASELINE.into(), unmeasured: Some(why.to_owned()), ..Default::default() }
}

/// `url` (a Redis URL) on database `db`.
fn on_database(url: &str, db: u32) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("redis", url));
    let host = rest.split(['/', '?']).next().unwrap_or(rest);
    format!("{scheme}://{host}/{db}")
}

impl Standalone {
    /// Starts it in front of the demo on `demo_port` when `IDEM_BENCH_STANDALONE_PROXY` is set.
    pub(crate) async fn start(demo_port: u16, redis_url: &str) -> Standalone {
        let Some(bin) = std::env::var_os(ENV).filter(|v| !v.is_empty()) else {
            return Standalone::NotMeasured(format!("not measured (set {ENV})"));
        };
        match StandaloneProxy::start(std::path::Path::new(&bin), demo_port, redis_url).await {
            Ok(p) => Standalone::Running(p),
            Err(e) => {
                eprintln!("filter-bench: *** {NAME} NOT MEASURED: {e}");
                Standalone::NotMeasured(format!("not measured: {e}"))
            }
        }
    }

    pub(crate) fn pid(&self) -> Option<u32> {
        match self {
            Standalone::Running(p) => p.proc.pid(),
            Standalone::NotMeasured(_) => None,
        }
    }

    pub(crate) fn about(&self) -> String {
        match self {
            Standalone::Running(p) => p.about.clone(),
            Standalone::NotMeasured(why) => format!("{NAME}: {why}"),
        }
    }

    pub(crate) async fn cleanup(&self) {
        if let Standalone::Running(p) = self {
            p.cleanup().await;
        }
    }
}

impl StandaloneProxy {
    async fn start(bin: &std::path::Path, demo_port: u16, redis_url: &str) -> Result<StandaloneProxy, BoxError> {
        if !bin.is_file() {
            return Err(format!("{ENV}={}: no such file", bin.display()).into());
        }
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join(".env"), "# filter-bench configures it through its environment\n")?;
        let port = free_port()?;
        let redis_url = on_database(redis_url, REDIS_DB);
        let threads = std::env::var("TOKIO_WORKER_THREADS").unwrap_or_else(|_| "1".into());
        let mut cmd = std::process::Command::new(bin);
        cmd.current_dir(dir.path())
            .env_clear()
            .env("SERVER_ADDR", format!("127.0.0.1:{port}"))
            .env("REDIS_URL", &redis_url)
            .env(ROUTE, format!("http://127.0.0.1:{demo_port}/v1/transfers"))
            .env("REQUEST_TIMEOUT", "600000")
            .env("LOG_LEVEL", "warn")
            .env("TOKIO_WORKER_THREADS", &threads);
        let mut proc = Proc::spawn("standalone-proxy", &mut cmd, dir.path())?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
            if proc.exited() || Instant::now() > deadline {
                return Err(format!("it did not listen on 127.0.0.1:{port}:\n{}", proc.log_text()).into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let about = format!(
            "{NAME}: {}, TOKIO_WORKER_THREADS={threads}, Redis {redis_url}, in front of the same demo",
            bin.display()
        );
        Ok(StandaloneProxy {
            port,
            proc,
            _dir: dir,
            redis_url,
            key: format!("idem-bench-standalone-{}", std::process::id()),
            about,
        })
    }

    /// The confirm the duplicate case sends, through this proxy, with its own Idempotency-Key.
    pub(crate) fn confirm(&self, fingerprint: &str) -> Vec<u8> {
        confirm_request_to(&format!("/{ROUTE}"), fingerprint, Some(&self.key))
    }

    /// The first confirm reaches the demo (which executes it), the second is answered from Redis.
    pub(crate) async fn check(&self, req: &[u8]) -> Result<(), BoxError> {
        for what in ["first", "duplicate"] {
            let (status, _, text) = once(self.port, req).await?;
            if status != 201 || !text.contains("\"executed\"") {
                return Err(format!("{NAME}: {what} confirm answered HTTP {status} {text}").into());
            }
        }
        Ok(())
    }

    /// Its Redis key (`<agent>:<method>:<Idempotency-Key>`) goes.
    async fn cleanup(&self) {
        redis_del(&self.redis_url, vec![format!("ANON:POST:{}", self.key)]).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn its_redis_database_is_not_the_projects() {
        assert_eq!(on_database("redis://127.0.0.1:6379", 15), "redis://127.0.0.1:6379/15");
        assert_eq!(on_database("redis://:pw@10.0.0.1:6379/0", 15), "redis://:pw@10.0.0.1:6379/15");
    }
}
