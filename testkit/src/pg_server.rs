//! A PostgreSQL server of one test's own: `initdb` and `pg_ctl` from the
//! installed PostgreSQL (`pg_config --bindir`), in a directory the test owns, on
//! a port it chose. For a test that stops its database: the shared server the
//! other tests use is never touched. As root (CI), the server runs as the
//! `postgres` user, because `initdb` refuses root.
//!
//! [`Replicated`]: a primary with a streaming standby of its own (asynchronous,
//! or synchronous with `synchronous_standby_names = '*'`), made the way an
//! operator makes one (`pg_basebackup -R` with a physical replication slot, as
//! Patroni and CloudNativePG keep one per member), reached through one address
//! that moves to the standby when it is promoted (`Replicated::fail_over`: the
//! primary SIGKILLed, `pg_ctl promote`), as a Service or a VIP follows the
//! primary. The standby streams through a link the test can cut, so it lags
//! exactly when the test says.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::forwarder::Forwarder;
use crate::BoxError;

pub struct PostgresServer {
    bin: PathBuf,
    dir: PathBuf,
    data: PathBuf,
    port: u16,
    as_postgres: bool,
    running: bool,
    options: String,
}

/// Where the server binaries are, and whether they must run as `postgres`. None: skipped loudly.
fn installed() -> Result<Option<(PathBuf, bool)>, BoxError> {
    let bin = match Command::new("pg_config").arg("--bindir").output() {
        Ok(out) if out.status.success() => PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()),
        _ => {
            crate::backends::skip("postgres (server binaries: initdb, pg_ctl)", "pg_config is not on PATH");
            return Ok(None);
        }
    };
    if !bin.join("initdb").exists() || !bin.join("pg_basebackup").exists() {
        crate::backends::skip(
            "postgres (server binaries: initdb, pg_ctl, pg_basebackup)",
            &format!("not in {} (Debian: apt-get install postgresql)", bin.display()),
        );
        return Ok(None);
    }
    let as_postgres = Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.trim_ascii() == b"0");
    Ok(Some((bin, as_postgres)))
}

impl PostgresServer {
    /// Create a cluster under `dir` and start it on 127.0.0.1:`port` (trust
    /// auth, user `postgres`, no fsync: a test's data need not survive a crash).
    /// Ok(None): the server binaries are not installed, skipped loudly.
    pub fn start(dir: &Path, port: u16) -> Result<Option<PostgresServer>, BoxError> {
        Self::start_with(dir, port, "-c synchronous_commit=off -c full_page_writes=off")
    }

    /// As [`start`](Self::start), with these `postgres` options (`-c name=value …`) on its command line.
    pub fn start_with(dir: &Path, port: u16, extra: &str) -> Result<Option<PostgresServer>, BoxError> {
        let Some((bin, as_postgres)) = installed()? else { return Ok(None) };
        if as_postgres {
            checked(Command::new("chown").arg("-R").arg("postgres").arg(dir).output()?, "chown")?;
        }
        let mut server = PostgresServer::new(bin, as_postgres, dir, port, extra);
        let initdb = server
            .tool("initdb")
            .arg("-D")
            .arg(&server.data)
            .args(["-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync"])
            .output()?;
        checked(initdb, "initdb")?;
        server.launch()?;
        Ok(Some(server))
    }

    fn new(bin: PathBuf, as_postgres: bool, dir: &Path, port: u16, extra: &str) -> PostgresServer {
        // Command-line options, not postgresql.conf: a base backup copies the configuration files, and a
        // standby must not inherit its primary's synchronous_standby_names (as a promoted one would wait
        // for standbys it does not have).
        let options = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=100 \
             -c shared_buffers=16MB {extra}",
            dir.display()
        );
        PostgresServer {
            bin,
            dir: dir.to_path_buf(),
            data: dir.join("pgdata"),
            port,
            as_postgres,
            running: false,
            options,
        }
    }

    fn launch(&mut self) -> Result<(), BoxError> {
        let log = self.dir.join("postgres.log");
        let start = self
            .tool("pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .arg("-l")
            .arg(&log)
            .args(["-w", "-t", "30", "-o", &self.options, "start"])
            .output()?;
        checked(start, "pg_ctl start")?;
        self.running = true;
        Ok(())
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// The server's own log (what a failed start or a failover left there).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(self.dir.join("postgres.log")).unwrap_or_default()
    }

    /// One statement (or several, `;`-separated) with `psql` on this server, its rows as `|`-separated text.
    pub fn psql(&self, sql: &str) -> Result<String, BoxError> {
        let out = Command::new("psql")
            .arg(self.url())
            .args(["-v", "ON_ERROR_STOP=1", "-qAtc", sql])
            .output()
            .map_err(|e| format!("cannot run psql: {e}"))?;
        if !out.status.success() {
            return Err(
                format!("psql {sql:?} on :{}: {}", self.port, String::from_utf8_lossy(&out.stderr).trim()).into()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// Stop it the way a crash does (`-m immediate`): connections die, nothing is flushed.
    pub fn stop(&mut self) -> Result<(), BoxError> {
        if !self.running {
            return Ok(());
        }
        self.running = false;
        let out = self.tool("pg_ctl").arg("-D").arg(&self.data).args(["-m", "immediate", "-w", "stop"]).output()?;
        checked(out, "pg_ctl stop")
    }

    /// SIGKILL the postmaster, as the OOM killer or a lost node does: no shutdown at all. Its backends
    /// notice their postmaster is gone and exit; nothing is left listening on its port.
    pub fn kill9(&mut self) -> Result<(), BoxError> {
        if !self.running {
            return Ok(());
        }
        let pid_file = std::fs::read_to_string(self.data.join("postmaster.pid"))?;
        let pid = pid_file.lines().next().unwrap_or_default().trim().to_string();
        if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("no postmaster pid in {}", self.data.display()).into());
        }
        checked(Command::new("kill").args(["-KILL", &pid]).output()?, "kill -KILL postmaster")?;
        self.running = false;
        // Its port is free once every backend has gone (they exit when they see the postmaster died).
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect_timeout(&self.addr(), Duration::from_millis(200)).is_ok() {
            if Instant::now() > deadline {
                return Err(format!("postgres on :{} still answers after SIGKILL", self.port).into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// A standby of this server under `dir`, on `port`: `pg_basebackup -R` through `via` (the address the
    /// standby streams from, which the base backup writes into its primary_conninfo) with the physical
    /// replication slot `slot`, then started. Waits until this server sees it streaming.
    fn standby(&self, dir: &Path, port: u16, via: u16, slot: &str) -> Result<PostgresServer, BoxError> {
        if self.as_postgres {
            checked(Command::new("chown").arg("-R").arg("postgres").arg(dir).output()?, "chown")?;
        }
        let mut standby = PostgresServer::new(self.bin.clone(), self.as_postgres, dir, port, "");
        let backup = standby
            .tool("pg_basebackup")
            .args(["-h", "127.0.0.1", "-p", &via.to_string(), "-U", "postgres", "-D"])
            .arg(&standby.data)
            // `-c fast`: the base backup starts at once, not after a spread checkpoint (seconds under the soak's writes).
            .args(["-R", "-X", "stream", "-C", "-S", slot, "--no-sync", "-c", "fast"])
            .output()?;
        checked(backup, "pg_basebackup -R")?;
        standby.launch()?;
        Ok(standby)
    }

    /// `pg_ctl promote`: a standby becomes a primary (waits until it accepts writes).
    pub fn promote(&mut self) -> Result<(), BoxError> {
        checked(
            self.tool("pg_ctl").arg("-D").arg(&self.data).args(["-w", "-t", "30", "promote"]).output()?,
            "promote",
        )?;
        until(Duration::from_secs(30), "the promoted standby to leave recovery", || {
            Ok(self.psql("SELECT pg_is_in_recovery()")? == "f")
        })
    }

    fn tool(&self, name: &str) -> Command {
        let path = self.bin.join(name);
        if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            Command::new(path)
        }
    }
}

fn checked(out: Output, what: &str) -> Result<(), BoxError> {
    if out.status.success() {
        return Ok(());
    }
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    Err(format!("{what} failed: {}", text.trim()).into())
}

/// Poll `f` every 50 ms until it is true; an error names what never happened (and the last error).
pub(crate) fn until(
    within: Duration,
    what: &str,
    mut f: impl FnMut() -> Result<bool, BoxError>,
) -> Result<(), BoxError> {
    let deadline = Instant::now() + within;
    loop {
        let last = match f() {
            Ok(true) => return Ok(()),
            Ok(false) => String::new(),
            Err(e) => e.to_string(),
        };
        if Instant::now() > deadline {
            return Err(format!("timed out waiting for {what} {last}").into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// How the standby's copy relates to the primary's commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replication {
    /// A commit returns once the primary has it (Patroni's default, CloudNativePG's default, RDS read
    /// replicas): a standby promoted before it caught up lacks the newest commits.
    Async,
    /// `synchronous_standby_names = '*'` with `synchronous_commit = on`: a commit returns once a
    /// standby has it too (Patroni `synchronous_mode`, CloudNativePG `minSyncReplicas`).
    Sync,
}

/// A primary and its streaming standby behind one address that follows the primary.
pub struct Replicated {
    dir: PathBuf,
    /// Standbys made so far (the first is 1): names the next one's directory and slot.
    generation: u32,
    primary: PostgresServer,
    standby: PostgresServer,
    /// The one address clients use (idemd's --database-url): the primary, then the promoted standby.
    front: Forwarder,
    /// The standby's replication connection to the primary: cut it and the standby lags.
    link: Forwarder,
    mode: Replication,
    failed_over: bool,
}

impl Replicated {
    /// A primary under `dir`/primary and a standby under `dir`/standby, on free ports, the standby
    /// streaming (for `Sync`: acknowledged as the synchronous standby). Ok(None): the server binaries
    /// are not installed, skipped loudly.
    pub fn start(dir: &Path, mode: Replication) -> Result<Option<Replicated>, BoxError> {
        let (primary_dir, standby_dir) = (dir.join("primary"), dir.join("standby"));
        std::fs::create_dir_all(&primary_dir)?;
        std::fs::create_dir_all(&standby_dir)?;
        if Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.trim_ascii() == b"0") {
            // The servers run as `postgres`, which must reach both directories through this one.
            checked(Command::new("chown").arg("postgres").arg(dir).output()?, "chown")?;
        }
        // Durable commits as in production (synchronous_commit = on): what a commit promises is the point.
        let options = match mode {
            Replication::Async => "-c synchronous_commit=on",
            Replication::Sync => "-c synchronous_commit=on -c synchronous_standby_names='*'",
        };
        let Some(primary) = PostgresServer::start_with(&primary_dir, free_port()?, options)? else { return Ok(None) };
        let link = Forwarder::start(primary.addr())?;
        let standby = primary.standby(&standby_dir, free_port()?, link.port(), "standby1")?;
        let front = Forwarder::start(primary.addr())?;
        let fixture = Replicated {
            dir: dir.to_path_buf(),
            generation: 1,
            primary,
            standby,
            front,
            link,
            mode,
            failed_over: false,
        };
        fixture.streaming()?;
        Ok(Some(fixture))
    }

    /// Wait until the primary sees its standby streaming, acknowledged as `mode` says.
    fn streaming(&self) -> Result<(), BoxError> {
        let want = match self.mode {
            Replication::Async => "async",
            Replication::Sync => "sync",
        };
        until(Duration::from_secs(30), "the standby to stream", || {
            Ok(self.primary.psql("SELECT sync_state FROM pg_stat_replication WHERE state = 'streaming'")? == want)
        })
    }

    /// After [`fail_over`](Self::fail_over): the promoted standby is the primary, and a new standby of it
    /// (`pg_basebackup -R` again, a slot of its own) streams through the link, so the pair can fail over
    /// again (the soak's repeated failovers). On `Sync` the new primary's commits wait for it from now on
    /// (`ALTER SYSTEM`, after the base backup so the standby does not inherit it). The dead primary's
    /// files stay in the fixture's directory.
    pub fn rebuild_standby(&mut self) -> Result<(), BoxError> {
        if !self.failed_over {
            return Err("rebuild_standby: the standby has not been promoted".into());
        }
        std::mem::swap(&mut self.primary, &mut self.standby);
        self.generation += 1;
        let name = format!("standby{}", self.generation);
        let dir = self.dir.join(&name);
        std::fs::create_dir_all(&dir)?;
        self.link.move_to(self.primary.addr());
        let standby = self.primary.standby(&dir, free_port()?, self.link.port(), &name)?;
        // The dead primary goes with its handle (nothing runs there any more).
        self.standby = standby;
        if self.mode == Replication::Sync {
            self.primary.psql("ALTER SYSTEM SET synchronous_standby_names = '*'")?;
            self.primary.psql("SELECT pg_reload_conf()")?;
        }
        self.failed_over = false;
        self.streaming()
    }

    /// How many standbys the fixture has made (1 until the first [`rebuild_standby`](Self::rebuild_standby)).
    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// The URL clients use: the primary until `fail_over`, then the promoted standby.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.front.port())
    }

    pub fn mode(&self) -> Replication {
        self.mode
    }

    pub fn primary(&self) -> &PostgresServer {
        &self.primary
    }

    pub fn standby(&self) -> &PostgresServer {
        &self.standby
    }

    /// Wait until the standby has replayed everything the primary has committed so far.
    pub fn caught_up(&self) -> Result<(), BoxError> {
        let lsn = self.primary.psql("SELECT pg_current_wal_lsn()")?;
        until(Duration::from_secs(30), "the standby to replay the primary's WAL", || {
            let sql = format!("SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn");
            Ok(self.standby.psql(&sql)? == "t")
        })
    }

    /// Cut the standby off its primary: from now on it receives nothing (it lags by every later commit).
    /// On `Sync`, every later commit waits for it.
    pub fn cut_replication(&self) -> Result<(), BoxError> {
        self.link.cut();
        until(Duration::from_secs(30), "the primary to see its standby gone", || {
            Ok(self.primary.psql("SELECT count(*) FROM pg_stat_replication")? == "0")
        })
    }

    /// Fail over in the worst way: SIGKILL the primary (no shutdown, nothing more sent to anyone),
    /// promote the standby with whatever it has, and move the clients' address to it.
    pub fn fail_over(&mut self) -> Result<(), BoxError> {
        self.primary.kill9()?;
        self.link.cut();
        self.standby.promote()?;
        self.front.move_to(self.standby.addr());
        self.failed_over = true;
        Ok(())
    }

    pub fn failed_over(&self) -> bool {
        self.failed_over
    }
}

/// A port nothing listens on now (the kernel's pick).
pub(crate) fn free_port() -> Result<u16, BoxError> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}
