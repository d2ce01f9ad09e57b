//! A Redis primary with a replica of its own (`--replicaof`), reached through one address that moves
//! to the replica when it is promoted (`REPLICAOF NO ONE`), as Sentinel and a Service do. The replica
//! streams through a link the test can cut, so it lags exactly when the test says; after a failover a
//! new replica of the promoted one can be started, so the pair fails over again (the soak's repeated
//! failovers). Driven with `redis-cli`, so blocking and async tests alike can use it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::forwarder::Forwarder;
use crate::pg_server::{free_port, until};
use crate::proc::Proc;
use crate::BoxError;

/// One private `redis-server` (no persistence), killed with its handle.
pub struct RedisServer {
    pub port: u16,
    proc: Proc,
}

impl RedisServer {
    /// Start one on `port` with these extra arguments, its log under `dir`. Ok(None): no `redis-server`
    /// or `redis-cli` on PATH, skipped loudly.
    pub fn start(dir: &Path, name: &str, port: u16, extra: &[String]) -> Result<Option<RedisServer>, BoxError> {
        for tool in ["redis-server", "redis-cli"] {
            if !Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success()) {
                crate::backends::skip("redis (a private redis-server)", &format!("{tool} is not on PATH"));
                return Ok(None);
            }
        }
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--dir", &dir.display().to_string()])
            .args(extra);
        let mut proc = Proc::spawn(name, &mut cmd, dir)?;
        until(Duration::from_secs(10), "redis-server to answer PING", || {
            if proc.exited() {
                return Err(format!("redis-server exited:\n{}", proc.log_text()).into());
            }
            Ok(cli(port, &["PING"]).is_ok_and(|r| r == "PONG"))
        })?;
        Ok(Some(RedisServer { port, proc }))
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    pub fn pid(&self) -> Option<u32> {
        self.proc.pid()
    }

    /// One command with `redis-cli`, its answer as text.
    pub fn cli(&self, args: &[&str]) -> Result<String, BoxError> {
        cli(self.port, args)
    }

    /// SIGKILL: no shutdown, nothing more sent to its replicas.
    pub fn kill9(&mut self) {
        self.proc.kill9();
    }

    pub fn exited(&mut self) -> bool {
        self.proc.exited()
    }

    pub fn log_text(&self) -> String {
        self.proc.log_text()
    }
}

fn cli(port: u16, args: &[&str]) -> Result<String, BoxError> {
    let out = Command::new("redis-cli").args(["-h", "127.0.0.1", "-p", &port.to_string()]).args(args).output()?;
    if !out.status.success() {
        return Err(format!("redis-cli {args:?} on :{port}: {}", String::from_utf8_lossy(&out.stderr).trim()).into());
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// A primary and its replica behind one address that follows the primary.
pub struct RedisReplicated {
    dir: PathBuf,
    primary: RedisServer,
    replica: RedisServer,
    /// The one address clients use: the primary, then the promoted replica.
    front: Forwarder,
    /// The replica's connection to its primary: cut it and the replica misses every later write.
    link: Forwarder,
    /// Replicas started so far.
    generation: u32,
}

impl RedisReplicated {
    /// A primary and a replica streaming from it, under `dir`. Ok(None): Redis is not installed.
    pub fn start(dir: &Path) -> Result<Option<RedisReplicated>, BoxError> {
        let Some(primary) = RedisServer::start(dir, "redis-primary", free_port()?, &[])? else { return Ok(None) };
        let link = Forwarder::start(primary.addr())?;
        let Some(replica) = replica_of(dir, 1, &link)? else { return Ok(None) };
        let front = Forwarder::start(primary.addr())?;
        Ok(Some(RedisReplicated { dir: dir.to_path_buf(), primary, replica, front, link, generation: 1 }))
    }

    /// The URL clients use: the primary until a failover, then the promoted replica.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.front.port())
    }

    pub fn primary(&self) -> &RedisServer {
        &self.primary
    }

    pub fn replica(&self) -> &RedisServer {
        &self.replica
    }

    /// Cut the replica off its primary: from now on it receives nothing.
    pub fn cut_replication(&self) {
        self.link.cut();
    }

    /// Fail over in the worst way: SIGKILL the primary, promote the replica with whatever it has
    /// (`REPLICAOF NO ONE`), move the clients' address to it, and start a new replica of it through the
    /// link, so the pair can fail over again. The promoted one is the primary from here on.
    pub fn fail_over(&mut self) -> Result<(), BoxError> {
        self.primary.kill9();
        self.link.cut();
        let promoted = self.replica.cli(&["REPLICAOF", "NO", "ONE"])?;
        if promoted != "OK" {
            return Err(format!("REPLICAOF NO ONE answered {promoted}").into());
        }
        self.front.move_to(self.replica.addr());
        self.link.move_to(self.replica.addr());
        self.generation += 1;
        let Some(next) = replica_of(&self.dir, self.generation, &self.link)? else {
            return Err("redis-server went missing".into());
        };
        // The dead primary goes with its handle.
        self.primary = std::mem::replace(&mut self.replica, next);
        Ok(())
    }

    /// How many replicas the fixture has started (1 until the first failover).
    pub fn generation(&self) -> u32 {
        self.generation
    }
}

/// A replica streaming from whatever `link` forwards to; waits until its link to the primary is up.
fn replica_of(dir: &Path, generation: u32, link: &Forwarder) -> Result<Option<RedisServer>, BoxError> {
    let args = ["--replicaof".to_string(), "127.0.0.1".into(), link.port().to_string()];
    let name = format!("redis-replica{generation}");
    let Some(replica) = RedisServer::start(dir, &name, free_port()?, &args)? else { return Ok(None) };
    until(Duration::from_secs(20), "the redis replica to sync", || {
        Ok(replica.cli(&["INFO", "replication"])?.lines().any(|l| l.trim() == "master_link_status:up"))
    })?;
    Ok(Some(replica))
}
