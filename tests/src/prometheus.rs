//! A real Prometheus server for the observability tests: Debian's `prometheus`
//! binary (the package `.ci/run` installs), started on a free port with a
//! configuration and a data directory of the test's own, queried over its HTTP
//! API (`/api/v1/query`, `/api/v1/alerts`, `/api/v1/rules`, `/api/v1/targets`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::{free_port, BoxError, Proc};

/// An executable on PATH.
pub fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(name)).find(|p| p.is_file())
}

pub struct Prometheus {
    pub port: u16,
    pub proc: Proc,
    http: reqwest::Client,
}

impl Prometheus {
    /// Start `binary` with `config` (YAML, written to `dir/prometheus.yml`; rule files it names are
    /// relative to `dir`) and wait until it is ready.
    pub async fn start(binary: &Path, dir: &Path, config: &str) -> Result<Prometheus, BoxError> {
        std::fs::write(dir.join("prometheus.yml"), config)?;
        let port = free_port()?;
        let mut cmd = Command::new(binary);
        cmd.current_dir(dir)
            .arg("--config.file=prometheus.yml")
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn");
        let mut proc = Proc::spawn("prometheus", &mut cmd, dir)?;
        crate::wait_ready(&format!("http://127.0.0.1:{port}/-/ready"), &mut proc).await?;
        let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?;
        Ok(Prometheus { port, proc, http })
    }

    async fn api(&self, path: &str, query: &[(&str, &str)]) -> Result<Value, BoxError> {
        let url = format!("http://127.0.0.1:{}/api/v1/{path}", self.port);
        let v: Value = self.http.get(url).query(query).send().await?.json().await?;
        if v["status"] != "success" {
            return Err(format!("prometheus {path} {query:?}: {v}").into());
        }
        Ok(v["data"].clone())
    }

    /// An instant query at now: the result vector (an error for a query Prometheus refuses).
    pub async fn query(&self, promql: &str) -> Result<Vec<Value>, BoxError> {
        let data = self.api("query", &[("query", promql)]).await?;
        Ok(data["result"].as_array().cloned().unwrap_or_default())
    }

    /// Every alert Prometheus holds (pending or firing), with its labels and state.
    pub async fn alerts(&self) -> Result<Vec<Value>, BoxError> {
        Ok(self.api("alerts", &[]).await?["alerts"].as_array().cloned().unwrap_or_default())
    }

    /// The firing alerts named `name`.
    pub async fn firing(&self, name: &str) -> Result<Vec<Value>, BoxError> {
        Ok(self
            .alerts()
            .await?
            .into_iter()
            .filter(|a| a["labels"]["alertname"] == name && a["state"] == "firing")
            .collect())
    }

    /// Every rule of every group loaded: (group, rule name, health, last error).
    pub async fn rules(&self) -> Result<Vec<(String, String, String, String)>, BoxError> {
        let data = self.api("rules", &[]).await?;
        let mut out = Vec::new();
        for g in data["groups"].as_array().into_iter().flatten() {
            for r in g["rules"].as_array().into_iter().flatten() {
                let field = |k: &str| r[k].as_str().unwrap_or_default().to_string();
                out.push((
                    g["name"].as_str().unwrap_or_default().to_string(),
                    field("name"),
                    field("health"),
                    field("lastError"),
                ));
            }
        }
        Ok(out)
    }

    /// The scrape targets' health by job (`up`, `down`, `unknown`).
    pub async fn targets(&self) -> Result<Vec<(String, String)>, BoxError> {
        let data = self.api("targets", &[]).await?;
        Ok(data["activeTargets"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| {
                (
                    t["labels"]["job"].as_str().unwrap_or_default().to_string(),
                    t["health"].as_str().unwrap_or_default().to_string(),
                )
            })
            .collect())
    }

    /// Ask `check` until it says yes (`Some`), at most `within`: Prometheus learns by scraping and
    /// evaluating on its own clock, so every expectation is a poll with a deadline.
    pub async fn until<T, F, Fut>(&self, what: &str, within: Duration, mut check: F) -> Result<T, BoxError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<Option<T>, BoxError>>,
    {
        let deadline = Instant::now() + within;
        loop {
            if let Some(v) = check().await? {
                return Ok(v);
            }
            if Instant::now() > deadline {
                return Err(format!("prometheus: {what} not seen within {within:?}\n{}", self.proc.log_text()).into());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}
