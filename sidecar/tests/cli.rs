//! The `idemd` binary itself: TTL validation refuses to start (exit 2, the
//! rule and the shortfall), options come from the environment too, and
//! `serve` prints where it listens and answers /healthz.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

fn idemd() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_idemd"));
    // Nothing from the developer's shell leaks into these runs.
    for (k, _) in std::env::vars() {
        if k.starts_with("IDEM_") {
            c.env_remove(k);
        }
    }
    c
}

#[test]
fn short_lease_refuses_to_start_with_the_rule_and_the_shortfall() {
    let out = idemd().args(["serve", "--lease-ms", "20000"]).output().expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("IN_FLIGHT lease 20000 ms must exceed upstream worst case 30000 + gateway timeout 15000 + retry backoff 5000 = 50000 ms (short by 30001 ms)"),
        "{err}"
    );
}

#[test]
fn both_rules_from_environment_variables() {
    let out = idemd()
        .arg("serve")
        .env("IDEM_LEASE_MS", "1000")
        .env("IDEM_UPSTREAM_WORST_CASE_MS", "500")
        .env("IDEM_GATEWAY_TIMEOUT_MS", "400")
        .env("IDEM_RETRY_BACKOFF_TOTAL_MS", "100")
        .env("IDEM_TERMINAL_RETENTION_S", "3600")
        .env("IDEM_RETRY_WINDOW_S", "7200")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("= 1000 ms (short by 1 ms)"), "{err}");
    assert!(
        err.contains("terminal retention 3600 s must be at least the retry window 7200 s (short by 3600 s)"),
        "{err}"
    );
}

#[test]
fn unknown_database_scheme_is_a_configuration_error() {
    let out =
        idemd().args(["serve", "--listen", "127.0.0.1:0", "--database-url", "oracle://x/y"]).output().expect("run");
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unsupported database URL"));
}

#[test]
fn serve_prints_where_it_listens_and_answers_healthz() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut child = idemd()
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env("IDEM_DATABASE_URL", format!("sqlite://{}/sub/idem.db?mode=rwc", dir.path().display()))
        .env("IDEM_REDIS_CLUSTER", "false")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let stdout = child.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("read");
    let guard = KillOnDrop(child);

    assert!(line.starts_with("idemd listening on 127.0.0.1:"), "{line}");
    assert!(line.trim_end().ends_with("(redis: off, sql: sqlite)"), "{line}");
    let addr = line["idemd listening on ".len()..].split(' ').next().expect("addr").to_string();

    let rt = tokio::runtime::Runtime::new().expect("rt");
    let health: serde_json::Value = rt.block_on(async {
        let r = reqwest::Client::new()
            .get(format!("http://{addr}/healthz"))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .expect("healthz");
        assert_eq!(r.status().as_u16(), 200);
        r.json().await.expect("json")
    });
    assert_eq!(health, serde_json::json!({"status": "ok", "redis": "off", "sql": "up"}));
    assert!(dir.path().join("sub/idem.db").exists(), "the SQLite directory is created");
    drop(guard);
}

struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
