//! The processes a generated configuration runs against: the demo and idemd,
//! started once, and one Envoy at a time on a configuration given as data.
//! Every connection manager of a configuration it starts writes an access log
//! (one JSON line per request: what key, method and path went to which
//! upstream host), the witness of what reached the demo.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use idem_testkit::envoy_config::Doc;
use serde_json::{json, Value};

use crate::{
    envoy_bin, filter_host, free_port, render_envoy_text, repo_root, spawn_envoy, start_demo, start_sidecar,
    wait_ready, BoxError, DemoOpts, Ports, Proc, SidecarOpts,
};

/// The demo and idemd, and where Envoy goes.
pub struct Rig {
    pub dir: tempfile::TempDir,
    pub ports: Ports,
    pub demo: Proc,
    pub sidecar: Proc,
    pub http: reqwest::Client,
}

/// What `idemd check` said of one file.
#[derive(Debug, Clone)]
pub struct Verdict {
    pub accepted: bool,
    /// The rules of its findings, one per finding.
    pub rules: Vec<String>,
    pub output: String,
}

impl Rig {
    pub async fn start(demo: DemoOpts) -> Result<Rig, BoxError> {
        let dir = tempfile::tempdir()?;
        let ports = Ports { listener: free_port()?, admin: free_port()?, demo: free_port()?, sidecar: free_port()? };
        let mut demo_proc = start_demo(&demo, ports.demo, dir.path())?;
        wait_ready(&format!("http://127.0.0.1:{}/healthz", ports.demo), &mut demo_proc).await?;
        let mut sidecar = start_sidecar(&SidecarOpts::default().for_ports(&ports), ports.sidecar, dir.path())?;
        wait_ready(&format!("http://127.0.0.1:{}/healthz", ports.sidecar), &mut sidecar).await?;
        let http = reqwest::Client::builder().timeout(Duration::from_secs(20)).build()?;
        Ok(Rig { dir, ports, demo: demo_proc, sidecar, http })
    }

    /// A committed configuration under envoy/, rendered for this rig and the filter host the tests run
    /// (`IDEM_E2E_HOST`), as data.
    /// On the ext_proc host idemd is the filter and runs one plugin configuration: the rig's idemd is
    /// restarted with this base's when it runs another.
    pub async fn base(&mut self, name: &str) -> Result<Doc, BoxError> {
        let text = render_envoy_text(&std::fs::read_to_string(repo_root().join("envoy").join(name))?, &self.ports)?;
        if filter_host::FilterHost::current()?.is_ext_proc() {
            let config =
                crate::ext_proc::plugin_config_of(&text).ok_or_else(|| format!("{name}: no plugin configuration"))?;
            if crate::ext_proc::runs(self.ports.sidecar).is_none_or(|c| c.trim() != config.trim()) {
                crate::ext_proc::prepare(self.ports.sidecar, &config, self.dir.path())?;
                self.sidecar.kill9();
                self.sidecar =
                    start_sidecar(&SidecarOpts::default().for_ports(&self.ports), self.ports.sidecar, self.dir.path())?;
                wait_ready(&format!("http://127.0.0.1:{}/healthz", self.ports.sidecar), &mut self.sidecar).await?;
            }
        }
        let text = filter_host::for_current_host(&text, &mut Command::new("true"))?;
        Doc::parse(&text)
    }

    /// `doc` with an access log on every connection manager, to `<dir>/<name>.access`.
    pub fn with_access_log(&self, doc: &Doc, name: &str) -> Result<(Doc, PathBuf), BoxError> {
        let log = self.dir.path().join(format!("{name}.access"));
        let mut doc = doc.clone();
        for m in doc.managers() {
            let entry = json!({
                "name": "envoy.access_loggers.file",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                    "path": log.display().to_string(),
                    "log_format": { "json_format": {
                        "key": "%REQ(IDEMPOTENCY-KEY)%",
                        "method": "%REQ(:METHOD)%",
                        "path": "%REQ(:PATH)%",
                        "original_path": "%REQ(X-ENVOY-ORIGINAL-PATH)%",
                        "upstream_host": "%UPSTREAM_HOST%",
                        "cluster": "%UPSTREAM_CLUSTER%",
                        "status": "%RESPONSE_CODE%",
                        "probe": "%REQ(X-PROBE)%"
                    } }
                }
            });
            doc.array_mut(&format!("{m}/access_log"))?.push(entry);
        }
        Ok((doc, log))
    }

    /// Write `doc` as `<name>.yaml` in the rig's directory.
    pub fn write(&self, name: &str, doc: &Doc) -> Result<PathBuf, BoxError> {
        let path = self.dir.path().join(format!("{name}.yaml"));
        std::fs::write(&path, doc.to_yaml()?)?;
        Ok(path)
    }

    /// `idemd check --envoy <path>`, with idemd serve's defaults; on the ext_proc host, with the plugin
    /// configuration this rig's idemd serves it with (`--ext-proc-config`), as an operator checks it.
    pub fn check(&self, path: &Path) -> Result<Verdict, BoxError> {
        let mut cmd = Command::new(crate::bin("idemd")?);
        cmd.arg("check")
            .arg("--envoy")
            .arg(path)
            .current_dir(repo_root())
            .env_remove("IDEM_LEASE_MS")
            .env_remove("IDEM_TERMINAL_RETENTION_S")
            .env_remove("IDEM_RETRY_WINDOW_S")
            .env_remove("IDEM_EXT_PROC_CONFIG");
        if filter_host::FilterHost::current()?.is_ext_proc() {
            cmd.arg("--ext-proc-config").arg(crate::ext_proc::config_file(self.ports.sidecar, self.dir.path()));
        }
        let out = cmd.output()?;
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let rules = stderr
            .lines()
            .filter_map(|l| l.split_once(": [").and_then(|(_, r)| r.split_once(']')).map(|(r, _)| r.to_string()))
            .collect();
        match out.status.code() {
            Some(0) => Ok(Verdict { accepted: true, rules, output: stderr }),
            Some(1) => Ok(Verdict { accepted: false, rules, output: stderr }),
            _ => Err(format!("idemd check failed on {}: {stderr}", path.display()).into()),
        }
    }

    /// Start Envoy on the file at `path` and wait until it is ready.
    pub async fn envoy(&self, path: &Path) -> Result<Proc, BoxError> {
        let mut cmd = Command::new(envoy_bin()?);
        // The access log is the witness: written within 20 ms of each request, not once a second.
        cmd.arg("--file-flush-interval-msec").arg("20");
        // istio-like.yaml's HMAC key comes from the environment, as in production.
        cmd.env("IDEM_HMAC_K1", "generated-configs-only-secret-0123456789abcdef");
        // Sets the module's search path when the configuration loads the native module.
        filter_host::for_current_host(&std::fs::read_to_string(path)?, &mut cmd)?;
        let mut envoy = spawn_envoy(cmd, path, self.dir.path(), 1)?;
        wait_ready(&format!("http://127.0.0.1:{}/ready", self.ports.admin), &mut envoy).await?;
        Ok(envoy)
    }

    /// Every listener's address as Envoy bound it (a generated listener asks for port 0), by name.
    pub async fn listeners(&self) -> Result<Vec<(String, u16)>, BoxError> {
        let url = format!("http://127.0.0.1:{}/listeners?format=json", self.ports.admin);
        let v: Value = self.http.get(url).send().await?.json().await?;
        let mut out = Vec::new();
        for l in v["listener_statuses"].as_array().into_iter().flatten() {
            let port = l.pointer("/local_address/socket_address/port_value").and_then(Value::as_u64);
            if let (Some(name), Some(port)) = (l["name"].as_str(), port) {
                out.push((name.to_string(), u16::try_from(port)?));
            }
        }
        Ok(out)
    }

    /// The demo's ledger, straight from the demo.
    pub async fn ledger(&self) -> Result<Value, BoxError> {
        let url = format!("http://127.0.0.1:{}/v1/executions", self.ports.demo);
        Ok(self.http.get(url).send().await?.json().await?)
    }

    /// The access log's lines so far.
    pub fn access(&self, log: &Path) -> Result<Vec<Value>, BoxError> {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        Ok(text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect())
    }

    /// The demo's address as Envoy's access log names an upstream host.
    pub fn demo_host(&self) -> String {
        format!("127.0.0.1:{}", self.ports.demo)
    }
}
