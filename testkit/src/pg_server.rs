//! A PostgreSQL server of one test's own: `initdb` and `pg_ctl` from the
//! installed PostgreSQL (`pg_config --bindir`), in a directory the test owns, on
//! a port it chose. For a test that stops its database: the shared server the
//! other tests use is never touched. As root (CI), the server runs as the
//! `postgres` user, because `initdb` refuses root.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::BoxError;

pub struct PostgresServer {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
    as_postgres: bool,
    running: bool,
}

impl PostgresServer {
    /// Create a cluster under `dir` and start it on 127.0.0.1:`port` (trust
    /// auth, user `postgres`, no fsync: a test's data need not survive a crash).
    /// Ok(None): the server binaries are not installed, skipped loudly.
    pub fn start(dir: &Path, port: u16) -> Result<Option<PostgresServer>, BoxError> {
        let bin = match Command::new("pg_config").arg("--bindir").output() {
            Ok(out) if out.status.success() => PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()),
            _ => {
                crate::backends::skip("postgres (server binaries: initdb, pg_ctl)", "pg_config is not on PATH");
                return Ok(None);
            }
        };
        let as_postgres = Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.trim_ascii() == b"0");
        if as_postgres {
            checked(Command::new("chown").arg("-R").arg("postgres").arg(dir).output()?, "chown")?;
        }
        let mut server = PostgresServer { bin, data: dir.join("pgdata"), port, as_postgres, running: false };
        let initdb = server
            .tool("initdb")
            .arg("-D")
            .arg(&server.data)
            .args(["-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync"])
            .output()?;
        checked(initdb, "initdb")?;
        let options = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off \
             -c full_page_writes=off -c max_connections=50 -c shared_buffers=16MB",
            dir.display()
        );
        let log = dir.join("postgres.log");
        let start = server
            .tool("pg_ctl")
            .arg("-D")
            .arg(&server.data)
            .arg("-l")
            .arg(&log)
            .args(["-w", "-t", "30", "-o", &options, "start"])
            .output()?;
        checked(start, "pg_ctl start")?;
        server.running = true;
        Ok(Some(server))
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
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

impl Drop for PostgresServer {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}
