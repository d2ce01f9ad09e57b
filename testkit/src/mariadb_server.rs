//! A MariaDB primary with a replica of a test's own, as [`pg_server::Replicated`](crate::pg_server::Replicated)
//! is for Postgres: `mariadb-install-db` and `mariadbd` from the installed MariaDB, each server in a
//! directory the test owns on a port it chose (the shared server on 3306 is never touched). The primary
//! writes a binary log; the replica (`read_only`) follows it by GTID through a link the test can cut, so it
//! lags exactly when the test says. [`MariaReplication::SemiSync`]: the primary's commits wait for the
//! replica's acknowledgement (`rpl_semi_sync_master_enabled`, built into MariaDB since 10.3), with a
//! fallback timeout long enough that a test never sees it unless it waits for it.
//! Clients reach the primary through one address that moves to the replica when it is promoted
//! ([`MariaReplicated::fail_over`]: the primary SIGKILLed, `STOP SLAVE; RESET SLAVE ALL`, `read_only` off).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::forwarder::Forwarder;
use crate::pg_server::{free_port, until};
use crate::proc::Proc;
use crate::BoxError;

/// One private `mariadbd`, killed with its handle.
pub struct MariaDbServer {
    port: u16,
    proc: Proc,
}

/// Whether the server binaries are installed (a loud skip when not).
fn installed() -> bool {
    for tool in ["mariadb-install-db", "mariadbd", "mariadb"] {
        let found = Command::new("sh").args(["-c", &format!("command -v {tool}")]).output();
        if !found.is_ok_and(|o| o.status.success()) {
            crate::backends::skip(
                "mariadb (server binaries: mariadb-install-db, mariadbd)",
                &format!("{tool} is not on PATH (Debian: apt-get install mariadb-server)"),
            );
            return false;
        }
    }
    true
}

fn as_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

impl MariaDbServer {
    /// A new data directory under `dir` and a server on 127.0.0.1:`port` with these options (`--name=value`),
    /// root without a password, a database `test`. Ok(None): not installed, skipped loudly.
    pub fn start(dir: &Path, port: u16, options: &[String]) -> Result<Option<MariaDbServer>, BoxError> {
        if !installed() {
            return Ok(None);
        }
        let data = dir.join("data");
        let mut install = Command::new("mariadb-install-db");
        install
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .args(["--auth-root-authentication-method=normal", "--skip-test-db"])
            // Its bootstrap server's temporary tables go to $TMPDIR under fixed names: two installs at once in
            // the shared /tmp delete each other's ("Error on delete of '/tmp/#sql-temptable-…'").
            .env("TMPDIR", dir);
        if as_root() {
            install.arg("--user=root");
        }
        let out = install.output()?;
        if !out.status.success() {
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            return Err(format!("mariadb-install-db failed: {}", text.trim()).into());
        }
        let mut cmd = Command::new("mariadbd");
        cmd.arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .arg(format!("--socket={}", dir.join("mariadb.sock").display()))
            .arg(format!("--pid-file={}", dir.join("mariadb.pid").display()))
            .arg(format!("--port={port}"))
            .arg(format!("--tmpdir={}", dir.display()))
            .args(["--bind-address=127.0.0.1", "--skip-name-resolve", "--innodb-buffer-pool-size=16M"])
            // A test's data need not survive a crash of the machine (a SIGKILL of the server keeps it).
            .args(["--innodb-flush-log-at-trx-commit=2", "--sync-binlog=0"])
            .args(options);
        if as_root() {
            cmd.arg("--user=root");
        }
        let mut proc = Proc::spawn("mariadbd", &mut cmd, dir)?;
        until(Duration::from_secs(30), "mariadbd to answer", || {
            if proc.exited() {
                return Err(format!("mariadbd exited:\n{}", proc.log_text()).into());
            }
            Ok(sql(port, "SELECT 1").is_ok_and(|r| r == "1"))
        })?;
        let server = MariaDbServer { port, proc };
        server.sql("CREATE DATABASE IF NOT EXISTS test")?;
        Ok(Some(server))
    }

    pub fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/test", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// Statements with the `mariadb` client on this server, its rows as tab-separated text.
    pub fn sql(&self, statements: &str) -> Result<String, BoxError> {
        sql(self.port, statements)
    }

    /// SIGKILL: no shutdown, nothing more sent to its replica.
    pub fn kill9(&mut self) {
        self.proc.kill9();
    }

    pub fn log_text(&self) -> String {
        self.proc.log_text()
    }
}

fn sql(port: u16, statements: &str) -> Result<String, BoxError> {
    let out = Command::new("mariadb")
        .args(["-h", "127.0.0.1", "-P", &port.to_string(), "-uroot", "--batch", "--skip-column-names", "-e"])
        .arg(statements)
        .output()
        .map_err(|e| format!("cannot run mariadb: {e}"))?;
    if !out.status.success() {
        return Err(
            format!("mariadb {statements:?} on :{port}: {}", String::from_utf8_lossy(&out.stderr).trim()).into()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// What the primary's commit waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MariaReplication {
    /// A commit returns once the primary has it: a replica promoted before it caught up lacks it.
    Async,
    /// Semi-synchronous: a commit returns once the replica acknowledged it (until the fallback timeout).
    SemiSync,
}

/// A MariaDB primary and its replica behind one address that follows the primary.
pub struct MariaReplicated {
    primary: MariaDbServer,
    replica: MariaDbServer,
    front: Forwarder,
    link: Forwarder,
    mode: MariaReplication,
    _dirs: PathBuf,
}

/// How long a semi-synchronous commit waits for the replica before falling back to asynchronous: longer
/// than any test waits, so a test sees the fallback only where it waits for it on purpose.
pub const SEMI_SYNC_TIMEOUT_MS: u64 = 600_000;

impl MariaReplicated {
    /// A primary under `dir`/primary and a replica under `dir`/replica, the replica following (and, for
    /// `SemiSync`, acknowledging) the primary. Ok(None): not installed, skipped loudly.
    pub fn start(dir: &Path, mode: MariaReplication) -> Result<Option<MariaReplicated>, BoxError> {
        let (primary_dir, replica_dir) = (dir.join("primary"), dir.join("replica"));
        std::fs::create_dir_all(&primary_dir)?;
        std::fs::create_dir_all(&replica_dir)?;
        let primary_opts = vec!["--server-id=1".to_string(), "--log-bin=primary-bin".into()];
        // The replica writes no binary log of its own: once promoted, nothing can follow it (a single node).
        let mut replica_opts = vec!["--server-id=2".to_string(), "--read-only=ON".into()];
        if mode == MariaReplication::SemiSync {
            // The primary turns it on once its replica is there (below): before, every commit of the set-up would
            // wait out the timeout for a replica that does not exist yet.
            replica_opts.push("--rpl-semi-sync-slave-enabled=ON".into());
        }
        let Some(primary) = MariaDbServer::start(&primary_dir, free_port()?, &primary_opts)? else { return Ok(None) };
        let link = Forwarder::start(primary.addr())?;
        let Some(replica) = MariaDbServer::start(&replica_dir, free_port()?, &replica_opts)? else { return Ok(None) };
        // Both were installed alike; the replica reads the primary's binary log from its beginning (its
        // `CREATE DATABASE IF NOT EXISTS test` included).
        replica.sql(&format!(
            "CHANGE MASTER TO MASTER_HOST='127.0.0.1', MASTER_PORT={}, MASTER_USER='root', MASTER_PASSWORD='', \
             MASTER_CONNECT_RETRY=1, MASTER_USE_GTID=slave_pos; START SLAVE",
            link.port()
        ))?;
        let front = Forwarder::start(primary.addr())?;
        let fixture = MariaReplicated { primary, replica, front, link, mode, _dirs: dir.to_path_buf() };
        fixture.caught_up()?;
        if mode == MariaReplication::SemiSync {
            fixture.primary.sql(&format!(
                "SET GLOBAL rpl_semi_sync_master_timeout = {SEMI_SYNC_TIMEOUT_MS}; \
                 SET GLOBAL rpl_semi_sync_master_enabled = ON"
            ))?;
            // The replica asks for semi-synchronous replication when it connects: reconnect it.
            fixture.replica.sql("STOP SLAVE IO_THREAD; START SLAVE IO_THREAD")?;
            until(Duration::from_secs(30), "the replica to acknowledge semi-synchronously", || {
                Ok(fixture.primary.sql("SHOW STATUS LIKE 'Rpl_semi_sync_master_clients'")?.ends_with("\t1"))
            })?;
        }
        Ok(Some(fixture))
    }

    /// The URL clients use: the primary until `fail_over`, then the promoted replica.
    pub fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/test", self.front.port())
    }

    pub fn mode(&self) -> MariaReplication {
        self.mode
    }

    pub fn primary(&self) -> &MariaDbServer {
        &self.primary
    }

    pub fn replica(&self) -> &MariaDbServer {
        &self.replica
    }

    /// Wait until the replica has applied everything the primary has written so far.
    pub fn caught_up(&self) -> Result<(), BoxError> {
        let gtid = self.primary.sql("SELECT @@gtid_binlog_pos")?;
        until(Duration::from_secs(30), "the replica to apply the primary's binary log", || {
            let waited = self.replica.sql(&format!("SELECT MASTER_GTID_WAIT('{gtid}', 1)"))?;
            Ok(waited == "0")
        })
    }

    /// Cut the replica off its primary: it receives nothing more (it lags by every later commit). On
    /// `SemiSync`, every later commit waits for it (until the fallback timeout). The primary notices when it
    /// next writes to the replica's connection, not at once.
    pub fn cut_replication(&self) {
        self.link.cut();
    }

    /// Fail over in the worst way: SIGKILL the primary, promote the replica with whatever it has (stop
    /// replicating, forget the primary, writable), and move the clients' address to it.
    pub fn fail_over(&mut self) -> Result<(), BoxError> {
        self.primary.kill9();
        self.link.cut();
        self.replica.sql("STOP SLAVE; RESET SLAVE ALL; SET GLOBAL read_only = OFF")?;
        self.front.move_to(self.replica.addr());
        Ok(())
    }
}
