//! Starts the real `demo` binary on a free port with its own SQLite file.

#![allow(dead_code)] // each test file uses a different subset

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub struct Demo {
    child: Child,
    pub addr: String,
    pub base: String,
    pub client: reqwest::Client,
}

impl Demo {
    /// A demo on a fresh database in `dir`, with extra CLI flags.
    pub fn start(dir: &Path, flags: &[&str]) -> Demo {
        Demo::start_with(&db_path(dir), flags, &[])
    }

    /// `--listen 127.0.0.1:0`: the OS picks the port and the binary prints
    /// it, so there is no window in which another process can take it.
    pub fn start_with(db: &str, flags: &[&str], env: &[(&str, &str)]) -> Demo {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_demo"));
        cmd.args(["--listen", "127.0.0.1:0", "--db", db])
            .args(flags)
            .env_remove("DEMO_NO_DEDUP")
            .env_remove("DEMO_NO_KEYS")
            .env_remove("DEMO_FAULTS")
            .env_remove("DEMO_FAULT_DIR")
            .env_remove("DEMO_NO_MCP")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn demo");
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).expect("read banner");
        let addr = line
            .trim()
            .strip_prefix("demo listening on ")
            .unwrap_or_else(|| panic!("unexpected banner {line:?}"))
            .to_string();
        Demo { child, base: format!("http://{addr}"), addr, client: reqwest::Client::new() }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        let resp = self.client.get(self.url(path)).send().await.expect("GET");
        let status = resp.status().as_u16();
        (status, resp.json().await.expect("json body"))
    }

    /// POST a confirm with the given key (if any) and extra headers.
    pub async fn confirm(
        &self,
        key: Option<&str>,
        headers: &[(&str, &str)],
        body: &Value,
    ) -> reqwest::Result<(u16, String)> {
        let mut req = self.client.post(self.url("/v1/transfers")).json(body);
        if let Some(key) = key {
            req = req.header("Idempotency-Key", key);
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = req.send().await?;
        let status = resp.status().as_u16();
        Ok((status, resp.text().await?))
    }

    pub async fn executions(&self) -> Value {
        let (status, body) = self.get("/v1/executions").await;
        assert_eq!(status, 200);
        body
    }

    /// Waits for the process to exit on its own.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "demo did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn db_path(dir: &Path) -> String {
    let path: PathBuf = dir.join("demo.db");
    path.to_str().expect("utf-8 temp path").to_string()
}

pub fn transfer(amount: Value) -> Value {
    serde_json::json!({
        "amount": amount,
        "currency": "EUR",
        "payee_id": "payee_42",
        "memo": "rent",
    })
}

pub fn json(text: &str) -> Value {
    serde_json::from_str(text).expect("json")
}

/// Reads an HTTP/1.1 response head from a raw socket.
pub fn read_head(conn: &mut std::net::TcpStream) -> String {
    use std::io::Read;
    let mut head = Vec::new();
    let mut byte = [0];
    while !head.ends_with(b"\r\n\r\n") {
        conn.read_exact(&mut byte).expect("response head");
        head.push(byte[0]);
    }
    String::from_utf8(head).expect("utf-8 head")
}
