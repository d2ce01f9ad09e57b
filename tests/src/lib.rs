//! End-to-end harness: starts the real processes the way an operator would —
//! the demo service, `idemd`, and Envoy 1.40 loading the built `.wasm` — each on
//! free ports, and kills them when the test ends.
//!
//! `make test` builds the binaries and the `.wasm` first; a missing artifact is
//! a loud failure here, never a skip.

#![forbid(unsafe_code)]

use serde_json::Value;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

pub mod bypass;
pub mod configs;
pub mod ext_proc;
pub mod filter_host;
pub mod http2;
pub mod istio;
pub mod markdown;
pub mod prometheus;
pub mod wire;
pub use filter_host::FilterHost;

pub type TestResult = Result<(), Box<dyn std::error::Error>>;
pub type BoxError = Box<dyn std::error::Error>;

pub const SUBJECT: &str = "user-alice";

/// The bearer token every stack's idemd requires and its Envoy presents
/// (`IDEM_AUTH_TOKENS` / `IDEM_SIDECAR_TOKEN`): the suite runs with auth on.
pub const SIDECAR_TOKEN: &str = "e2e-sidecar-token-0123456789";

/// `--name N` among a command line's arguments (the soak's binaries): None when absent.
pub fn flag_number(args: &[String], name: &str) -> Result<Option<u64>, String> {
    match args.iter().position(|a| a == name) {
        None => Ok(None),
        Some(i) => {
            let v = args.get(i + 1).ok_or(format!("{name} needs a value"))?;
            v.parse().map(Some).map_err(|e| format!("{name} {v}: {e}"))
        }
    }
}

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| repo_root().join("target"))
}

/// The demo/idemd binaries under target/<profile>/: `IDEM_E2E_PROFILE` (default `debug`; `make bench` uses `release`).
pub fn bin(name: &str) -> Result<PathBuf, BoxError> {
    let profile = std::env::var("IDEM_E2E_PROFILE").ok().filter(|p| !p.is_empty()).unwrap_or_else(|| "debug".into());
    let p = target_dir().join(&profile).join(name);
    if !p.exists() {
        let build = if profile == "debug" {
            "`make build` (or `make test`)".to_owned()
        } else {
            format!("cargo build --profile {profile} -p idem-demo -p idemd")
        };
        return Err(format!("{} is missing: run {build} first", p.display()).into());
    }
    Ok(p)
}

pub fn wasm() -> Result<PathBuf, BoxError> {
    let p = target_dir().join("wasm32-wasip1/wasm/agent_idempotency_filter.wasm");
    if !p.exists() {
        return Err(format!("{} is missing: run `make wasm` first", p.display()).into());
    }
    Ok(p)
}

pub fn envoy_bin() -> Result<PathBuf, BoxError> {
    let p = repo_root().join(".venv/bin/envoy");
    if !p.exists() {
        return Err("the pinned Envoy is missing: run `make bootstrap` first".into());
    }
    Ok(p)
}

/// A port nothing listens on, chosen below Linux's ephemeral range (32768–60999): a
/// port from the kernel's own pick (port 0) is in that range, where the many outgoing
/// connections of parallel tests can take it before the process we start binds it.
pub fn free_port() -> Result<u16, BoxError> {
    let mut seed = [0u8; 2];
    for _ in 0..64 {
        std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut seed))?;
        let port = 20_000 + u16::from_le_bytes(seed) % 12_000;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

pub use idem_testkit::proc::Proc;

pub async fn wait_ready(url: &str, proc: &mut Proc) -> Result<(), BoxError> {
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if proc.exited() {
            return Err(format!("{} exited during start:\n{}", proc.name(), proc.log_text()).into());
        }
        if let Ok(r) = client.get(url).send().await {
            if r.status().is_success() {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(format!("{} not ready at {url} after 30 s:\n{}", proc.name(), proc.log_text()).into())
}

#[derive(Debug, Clone, Default)]
pub struct DemoOpts {
    pub no_dedup: bool,
    pub faults: bool,
    /// `--no-keys`: a downstream without key support (never reads Idempotency-Key; finds a
    /// transfer by its `client_ref`).
    pub no_keys: bool,
}

#[derive(Debug, Clone, Default)]
pub struct SidecarOpts {
    pub redis_url: Option<String>,
    /// None: a fresh SQLite file in the stack's temp dir.
    pub database_url: Option<String>,
    pub extra_args: Vec<String>,
}

#[derive(Debug, Clone)]
pub struct StackOpts {
    pub demo: DemoOpts,
    pub sidecar: SidecarOpts,
    /// Which config under envoy/ to run.
    pub envoy_config: &'static str,
    /// Text replacements in that config, e.g. the plugin's `"language": "en"`.
    pub envoy_edits: Vec<(String, String)>,
}

impl Default for StackOpts {
    fn default() -> Self {
        StackOpts {
            demo: DemoOpts::default(),
            sidecar: SidecarOpts::default(),
            envoy_config: "e2e.yaml",
            envoy_edits: Vec::new(),
        }
    }
}

pub struct Ports {
    pub listener: u16,
    pub admin: u16,
    pub demo: u16,
    pub sidecar: u16,
}

/// demo + idemd + Envoy, on their own ports and temp dir.
pub struct Stack {
    pub dir: tempfile::TempDir,
    pub ports: Ports,
    pub opts: StackOpts,
    pub demo: Proc,
    pub sidecar: Proc,
    pub envoy: Proc,
    pub http: reqwest::Client,
}

impl Stack {
    /// Starts the three processes; a port taken between its choice and its bind (another
    /// test's process) is retried with fresh ports, a few times.
    pub async fn start(opts: StackOpts) -> Result<Stack, BoxError> {
        let mut attempt = 0;
        loop {
            match Stack::start_once(opts.clone()).await {
                Err(e) if attempt < 3 && e.to_string().contains("in use") => attempt += 1,
                other => return other,
            }
        }
    }

    async fn start_once(opts: StackOpts) -> Result<Stack, BoxError> {
        let dir = tempfile::tempdir()?;
        let ports = Ports { listener: free_port()?, admin: free_port()?, demo: free_port()?, sidecar: free_port()? };
        let mut demo = start_demo(&opts.demo, ports.demo, dir.path())?;
        wait_ready(&format!("http://127.0.0.1:{}/healthz", ports.demo), &mut demo).await?;
        if FilterHost::current()?.is_ext_proc() {
            // idemd runs the host: it takes the plugin configuration this stack's Envoy config carries.
            let text = envoy_text(opts.envoy_config, &ports, &opts.envoy_edits)?;
            // A config that loads the native module itself (envoy/native.yaml) runs as it is, on any host.
            if !text.contains("DynamicModuleFilter") {
                let config =
                    ext_proc::plugin_config_of(&text).ok_or("the stack's Envoy config has no plugin configuration")?;
                ext_proc::prepare(ports.sidecar, &config, dir.path())?;
            }
        }
        let mut sidecar = start_sidecar(&opts.sidecar.for_ports(&ports), ports.sidecar, dir.path())?;
        wait_ready(&format!("http://127.0.0.1:{}/healthz", ports.sidecar), &mut sidecar).await?;
        let mut envoy = start_envoy_with(opts.envoy_config, &ports, &opts.envoy_edits, dir.path())?;
        wait_ready(&format!("http://127.0.0.1:{}/ready", ports.admin), &mut envoy).await?;
        let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build()?;
        Ok(Stack { dir, ports, opts, demo, sidecar, envoy, http })
    }

    /// What this stack runs: its Envoy config (`name`, as written into its directory) and, on the
    /// ext_proc host, the plugin configuration idemd runs the host with (which Envoy's config no
    /// longer carries: its filter is Envoy's own `ext_proc`).
    pub fn ran(&self, name: &str) -> Result<String, BoxError> {
        let mut text = std::fs::read_to_string(self.dir.path().join(name))?;
        if FilterHost::current()?.is_ext_proc() {
            text.push('\n');
            text.push_str(&std::fs::read_to_string(ext_proc::config_file(self.ports.sidecar, self.dir.path()))?);
        }
        Ok(text)
    }

    /// The log the filter writes its lines to: Envoy's, or idemd's on the ext_proc host (idemd is
    /// the filter there).
    pub fn filter_log(&self) -> Result<String, BoxError> {
        Ok(if FilterHost::current()?.is_ext_proc() { self.sidecar.log_text() } else { self.envoy.log_text() })
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.ports.listener)
    }

    pub async fn restart_demo(&mut self) -> Result<(), BoxError> {
        self.demo.kill9();
        self.demo = start_demo(&self.opts.demo, self.ports.demo, self.dir.path())?;
        wait_ready(&format!("http://127.0.0.1:{}/healthz", self.ports.demo), &mut self.demo).await
    }

    pub async fn restart_sidecar(&mut self) -> Result<(), BoxError> {
        self.sidecar.kill9();
        self.sidecar = start_sidecar(&self.opts.sidecar.for_ports(&self.ports), self.ports.sidecar, self.dir.path())?;
        wait_ready(&format!("http://127.0.0.1:{}/healthz", self.ports.sidecar), &mut self.sidecar).await
    }

    pub async fn restart_envoy(&mut self) -> Result<(), BoxError> {
        self.envoy.kill9();
        self.envoy = start_envoy_with(self.opts.envoy_config, &self.ports, &self.opts.envoy_edits, self.dir.path())?;
        wait_ready(&format!("http://127.0.0.1:{}/ready", self.ports.admin), &mut self.envoy).await
    }

    /// A URL on the sidecar itself (not through Envoy).
    pub fn sidecar_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.ports.sidecar)
    }

    /// POST JSON through Envoy as `subject`.
    pub async fn post(
        &self,
        path: &str,
        subject: &str,
        body: &Value,
        headers: &[(&str, &str)],
    ) -> Result<Answer, BoxError> {
        let mut req = self.http.post(self.url(path)).header("x-agent-subject", subject).json(body);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        Answer::read(req.send().await?).await
    }

    pub async fn get(&self, path: &str, subject: &str, headers: &[(&str, &str)]) -> Result<Answer, BoxError> {
        let mut req = self.http.get(self.url(path)).header("x-agent-subject", subject);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        Answer::read(req.send().await?).await
    }

    /// Send a confirm in the background (one the upstream delays, say), to act while it is in flight.
    pub fn spawn_confirm(
        &self,
        path: &str,
        fp: &str,
        body: Value,
        delay_ms: u64,
    ) -> tokio::task::JoinHandle<reqwest::Result<reqwest::Response>> {
        let req = self
            .http
            .post(self.url(path))
            .header("x-agent-subject", SUBJECT)
            .header("agent-fingerprint", fp)
            .header("x-demo-delay-ms", delay_ms.to_string())
            .json(&body);
        tokio::spawn(req.send())
    }

    /// Preview a transfer and return the fingerprint it minted.
    pub async fn preview(&self, amount: Value) -> Result<(Answer, String), BoxError> {
        let a = self.post("/v1/transfers/preview", SUBJECT, &transfer(amount, "preview memo"), &[]).await?;
        let fp = a.json["fingerprint"]
            .as_str()
            .ok_or_else(|| format!("no fingerprint in preview answer: {a:?}"))?
            .to_owned();
        Ok((a, fp))
    }

    /// What the demo says really happened (straight to the demo, not through Envoy).
    pub async fn executions(&self) -> Result<Value, BoxError> {
        let url = format!("http://127.0.0.1:{}/v1/executions", self.ports.demo);
        Ok(self.http.get(url).send().await?.json().await?)
    }

    /// One counter from Envoy's /stats (the filter's show as `wasmcustom.idem.*`; the native
    /// module's same counters as `dynamicmodulescustom.idem.*`, read here under the wasm name; the
    /// ext_proc host's from idemd's `/ext-proc/stats`, the same names without the prefix).
    pub async fn stat(&self, name: &str) -> Result<u64, BoxError> {
        if let (FilterHost::ExtProc, Some(rest)) = (FilterHost::current()?, name.strip_prefix("wasmcustom.")) {
            let text = self.http.get(self.sidecar_url("/ext-proc/stats")).send().await?.text().await?;
            return Ok(text
                .lines()
                .find_map(|l| l.split_once(": ").filter(|(k, _)| *k == rest).and_then(|(_, v)| v.trim().parse().ok()))
                .unwrap_or(0));
        }
        let native;
        let name = match (FilterHost::current()?, name.strip_prefix("wasmcustom.")) {
            (FilterHost::Native, Some(rest)) => {
                native = format!("dynamicmodulescustom.{rest}");
                native.as_str()
            }
            _ => name,
        };
        let url = format!("http://127.0.0.1:{}/stats?filter={name}", self.ports.admin);
        let text = self.http.get(url).send().await?.text().await?;
        for line in text.lines() {
            if let Some((k, v)) = line.split_once(": ") {
                if k == name {
                    return Ok(v.trim().parse()?);
                }
            }
        }
        Ok(0)
    }
}

impl Stack {
    /// idemd's `/metrics` (OpenMetrics text), straight from the sidecar.
    pub async fn idemd_metrics(&self) -> Result<String, BoxError> {
        let r = self.http.get(self.sidecar_url("/metrics")).send().await?;
        if !r.status().is_success() {
            return Err(format!("idemd /metrics answered {}", r.status()).into());
        }
        Ok(r.text().await?)
    }

    /// The database idemd of this stack writes to.
    pub fn database_url(&self) -> String {
        self.opts
            .sidecar
            .database_url
            .clone()
            .unwrap_or_else(|| format!("sqlite://{}/idem.db", self.dir.path().display()))
    }

    /// How many rows idemd's SQL truth (`idem_record`) and its audit trail (`idem_audit`) hold for an
    /// operation, read straight from the database.
    pub async fn sql_rows(&self, key: &str) -> Result<(i64, i64), BoxError> {
        if key.len() != 32 || !key.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!("not an operation key: {key:?}").into());
        }
        sqlx::any::install_default_drivers();
        let pool = sqlx::pool::PoolOptions::<sqlx::Any>::new().max_connections(1).connect(&self.database_url()).await?;
        // The key is validated hex: inlined, so no dialect's placeholders are needed.
        let count = |table: &str| format!("SELECT COUNT(*) FROM {table} WHERE idem_key = '{key}'");
        let records: i64 = sqlx::query_scalar(&count("idem_record")).fetch_one(&pool).await?;
        let audit: i64 = sqlx::query_scalar(&count("idem_audit")).fetch_one(&pool).await?;
        pool.close().await;
        Ok((records, audit))
    }

    /// Wait (at most `within`) for the demo's `x-demo-hold-after-commit: <name>` confirm to commit:
    /// the demo then writes `<name>.committed` (the record it will answer) into the stack's dir and
    /// holds its answer until `release_hold(name)`.
    pub async fn wait_committed(&self, name: &str, within: Duration) -> Result<Value, BoxError> {
        let path = self.dir.path().join(format!("{name}.committed"));
        let deadline = Instant::now() + within;
        loop {
            if let Ok(text) = std::fs::read_to_string(&path) {
                if let Ok(v) = serde_json::from_str(&text) {
                    return Ok(v);
                }
            }
            if Instant::now() > deadline {
                return Err(format!("the demo did not commit {name} within {within:?}").into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Let the demo answer the confirm it holds under `name`.
    pub fn release_hold(&self, name: &str) -> Result<(), BoxError> {
        Ok(std::fs::write(self.dir.path().join(format!("{name}.release")), b"go")?)
    }
}

/// One series of an OpenMetrics text: the sum of the samples named `name` whose labels include all of
/// `labels`; None when there is none (a counter family nothing has incremented has no series).
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else { continue };
        let (n, set) = match series.split_once('{') {
            Some((n, rest)) => (n, rest.strip_suffix('}').unwrap_or(rest)),
            None => (series, ""),
        };
        if n != name {
            continue;
        }
        let have: Vec<(&str, &str)> =
            set.split(',').filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k, v.trim_matches('"'))).collect();
        if labels.iter().all(|want| have.contains(want)) {
            if let Ok(v) = value.parse::<f64>() {
                *found.get_or_insert(0.0) += v;
            }
        }
    }
    found
}

/// The `envoy_edits` entry that turns the plugin's replay cache off in envoy/e2e.yaml
/// (`"replay_cache": {"slots": 0}`): every replay is then idemd's, as on an Envoy that never saw it.
pub fn without_replay_cache() -> (String, String) {
    ("\"sidecar_timeout_ms\": 5000,".into(), "\"sidecar_timeout_ms\": 5000, \"replay_cache\": {\"slots\": 0},".into())
}

/// Redis + Postgres when both are reachable; None (loud skip) otherwise.
pub fn real_stores(faults: bool) -> Result<Option<StackOpts>, BoxError> {
    if !backends::available("redis", &backends::redis_url())?
        || !backends::available("postgres", &backends::postgres_url())?
    {
        return Ok(None);
    }
    Ok(Some(StackOpts {
        demo: DemoOpts { no_dedup: true, faults, ..Default::default() },
        sidecar: SidecarOpts {
            redis_url: Some(backends::redis_url()),
            database_url: Some(backends::postgres_url()),
            ..Default::default()
        },
        ..Default::default()
    }))
}

pub fn sqlite_only(faults: bool) -> StackOpts {
    StackOpts { demo: DemoOpts { no_dedup: true, faults, ..Default::default() }, ..Default::default() }
}

/// (executions, attempts) as the demo's ledger counts them.
pub async fn counts(stack: &Stack) -> Result<(u64, u64), BoxError> {
    let ex = stack.executions().await?;
    Ok((ex["total"].as_u64().unwrap_or(u64::MAX), ex["attempts"].as_u64().unwrap_or(u64::MAX)))
}

pub fn transfer(amount: Value, memo: &str) -> Value {
    serde_json::json!({"amount": amount, "currency": "EUR", "payee_id": "payee-42", "memo": memo})
}

/// A reply: status, headers and body (JSON when it parses).
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Vec<u8>,
    pub json: Value,
}

impl Answer {
    async fn read(r: reqwest::Response) -> Result<Answer, BoxError> {
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let body = r.bytes().await?.to_vec();
        let json = serde_json::from_slice(&body).unwrap_or(Value::Null);
        Ok(Answer { status, headers, body, json })
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The DESIGN §7 contract: every reply tells the model what to do.
    pub fn assert_prompt(&self, status: &str) {
        assert_eq!(self.json["status"], status, "reply: {self:?}");
        for field in ["meaning", "instruction", "trace_id"] {
            assert!(self.json[field].is_string(), "{field} missing in {self:?}");
        }
        assert!(self.json["retryable"].is_boolean(), "retryable missing in {self:?}");
        assert!(self.header("content-type").is_some_and(|c| c.contains("application/json")));
    }
}

pub fn start_demo(opts: &DemoOpts, port: u16, dir: &Path) -> Result<Proc, BoxError> {
    let mut cmd = Command::new(bin("demo")?);
    cmd.arg("--listen").arg(format!("127.0.0.1:{port}")).arg("--db").arg(format!("sqlite://{}/demo.db", dir.display()));
    if opts.no_dedup {
        cmd.arg("--no-dedup");
    }
    if opts.no_keys {
        cmd.arg("--no-keys");
    }
    if opts.faults {
        // x-demo-hold-after-commit writes and waits for its files here (Stack::wait_committed).
        cmd.arg("--faults").arg("--fault-dir").arg(dir);
    }
    Proc::spawn("demo", &mut cmd, dir)
}

pub fn start_sidecar(opts: &SidecarOpts, port: u16, dir: &Path) -> Result<Proc, BoxError> {
    spawn_sidecar("idemd", opts, port, dir)
}

/// `start_sidecar` with its own log name, for a second replica.
pub fn spawn_sidecar(name: &str, opts: &SidecarOpts, port: u16, dir: &Path) -> Result<Proc, BoxError> {
    let mut cmd = Command::new(bin("idemd")?);
    let db = opts.database_url.clone().unwrap_or_else(|| format!("sqlite://{}/idem.db?mode=rwc", dir.display()));
    cmd.arg("serve").arg("--listen").arg(format!("127.0.0.1:{port}")).arg("--database-url").arg(db);
    cmd.env_remove("IDEM_REDIS_URL");
    let own_auth = opts.extra_args.iter().any(|a| a == "--insecure-no-auth" || a.starts_with("--auth-tokens"));
    if !own_auth {
        cmd.env("IDEM_AUTH_TOKENS", SIDECAR_TOKEN);
    }
    if let Some(r) = &opts.redis_url {
        cmd.arg("--redis-url").arg(r);
    }
    if !opts.reconciles() {
        cmd.arg("--no-reconcile");
    }
    if FilterHost::current()?.is_ext_proc() {
        // The host's plugin configuration names idemd's token as the filters' does.
        cmd.env("IDEM_SIDECAR_TOKEN", SIDECAR_TOKEN);
        cmd.args(ext_proc::sidecar_args(port, dir)?);
    }
    cmd.args(&opts.extra_args);
    Proc::spawn(name, &mut cmd, dir)
}

impl SidecarOpts {
    /// A sidecar runs the reconciler and the reaper only when its test
    /// configures them (`--reconcile-interval-ms`); every other one gets
    /// `--no-reconcile`, so stacks sharing a database never decide each
    /// other's rows.
    pub fn reconciles(&self) -> bool {
        self.extra_args.iter().any(|a| a == "--reconcile-interval-ms")
    }

    /// These options for one stack: the demo's fixed address in the committed
    /// configs and scripts/run.sh (`127.0.0.1:8080`, e.g. in a
    /// `--status-endpoint`) becomes this stack's demo.
    pub fn for_ports(&self, ports: &Ports) -> SidecarOpts {
        let demo = format!("127.0.0.1:{}", ports.demo);
        let extra_args = self.extra_args.iter().map(|a| a.replace("127.0.0.1:8080", &demo)).collect();
        SidecarOpts { extra_args, ..self.clone() }
    }
}

/// The nonce inside a fingerprint (DESIGN §3): the sidecar's key and the downstream's Idempotency-Key.
pub fn nonce_of(fingerprint: &str) -> Result<String, BoxError> {
    idem_testkit::fingerprint::nonce(fingerprint)
}

/// The claims of a fingerprint (`n`, `u`, `s`, `p`, …), unverified.
pub fn fingerprint_claims(fingerprint: &str) -> Result<Value, BoxError> {
    idem_testkit::fingerprint::claims(fingerprint)
}

/// `idemd ops --database-url <db> <args…>`: (exit code, stdout, stderr).
pub fn idemd_ops(database_url: &str, args: &[&str]) -> Result<(i32, String, String), BoxError> {
    let out = Command::new(bin("idemd")?)
        .arg("ops")
        .arg("--database-url")
        .arg(database_url)
        .args(args)
        .env_remove("IDEM_REDIS_URL")
        .output()?;
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    Ok((out.status.code().unwrap_or(-1), text(&out.stdout), text(&out.stderr)))
}

/// Rewrite the committed config's fixed addresses to this stack's ports, so the
/// file that runs in the test is the file users read.
pub fn render_envoy_config(config: &str, ports: &Ports) -> Result<String, BoxError> {
    render_envoy_text(&std::fs::read_to_string(repo_root().join("envoy").join(config))?, ports)
}

/// `render_envoy_config` of a configuration's text.
pub fn render_envoy_text(text: &str, ports: &Ports) -> Result<String, BoxError> {
    let wasm = wasm()?;
    Ok(text
        .replace("port_value: 10000", &format!("port_value: {}", ports.listener))
        .replace("port_value: 9901", &format!("port_value: {}", ports.admin))
        .replace("port_value: 8080", &format!("port_value: {}", ports.demo))
        .replace("port_value: 9090", &format!("port_value: {}", ports.sidecar))
        .replace("target/wasm32-wasip1/wasm/agent_idempotency_filter.wasm", &wasm.display().to_string())
        .replace("/etc/envoy/agent_idempotency_filter.wasm", &wasm.display().to_string()))
}

pub fn start_envoy(config: &str, ports: &Ports, dir: &Path) -> Result<Proc, BoxError> {
    start_envoy_with(config, ports, &[], dir)
}

/// bench.yaml's second listener (`port_value: BENCH_PLAIN_LISTENER_PORT`) moved to `port`.
pub fn bench_plain_listener(port: u16) -> (String, String) {
    (format!("port_value: {BENCH_PLAIN_LISTENER_PORT}"), format!("port_value: {port}"))
}

/// The second listener's port in envoy/bench.yaml (the plain-Envoy baseline), rewritten by `start_envoy_with`.
pub const BENCH_PLAIN_LISTENER_PORT: u16 = 10001;

/// `start_envoy` with extra `(text in the committed file, replacement)` edits, e.g. bench.yaml's second listener.
/// An edit that matches nothing is an error: a renamed field must not silently test the unedited config.
pub fn start_envoy_with(config: &str, ports: &Ports, edits: &[(String, String)], dir: &Path) -> Result<Proc, BoxError> {
    start_envoy_workers(config, ports, edits, dir, 1)
}

/// `start_envoy_with` and `--concurrency workers` (the tests use one worker; the soak two).
pub fn start_envoy_workers(
    config: &str,
    ports: &Ports,
    edits: &[(String, String)],
    dir: &Path,
    workers: u32,
) -> Result<Proc, BoxError> {
    let path = dir.join(format!("envoy-{config}"));
    let mut text = envoy_text(config, ports, edits)?;
    let mut cmd = Command::new(envoy_bin()?);
    text = filter_host::for_current_host(&text, &mut cmd)?;
    std::fs::write(&path, text)?;
    spawn_envoy(cmd, &path, dir, workers)
}

/// A committed config rendered for `ports`, with `edits` applied (before any host conversion).
pub fn envoy_text(config: &str, ports: &Ports, edits: &[(String, String)]) -> Result<String, BoxError> {
    let mut text = render_envoy_config(config, ports)?;
    for (from, to) in edits {
        if !text.contains(from.as_str()) {
            return Err(format!("envoy/{config} has no `{from}` to replace").into());
        }
        text = text.replace(from.as_str(), to);
    }
    Ok(text)
}

/// Start `cmd` (an `envoy`, with the environment its configuration needs) on the configuration file `path`.
pub fn spawn_envoy(mut cmd: Command, path: &Path, dir: &Path, workers: u32) -> Result<Proc, BoxError> {
    cmd.arg("-c")
        .arg(path)
        .arg("--disable-hot-restart")
        .arg("--concurrency")
        .arg(workers.to_string())
        .arg("--log-level")
        .arg("warn")
        .arg("--component-log-level")
        .arg("wasm:info,dynamic_modules:info")
        .env("IDEM_SIDECAR_TOKEN", SIDECAR_TOKEN);
    Proc::spawn("envoy", &mut cmd, dir)
}

/// True (and says so) when the stack runs the native module and the calling test is about
/// something only the `.wasm` does: the test then has nothing to check on this host.
pub fn wasm_only(why: &str) -> Result<bool, BoxError> {
    let other = FilterHost::current()? != FilterHost::Wasm;
    if other {
        eprintln!("*** not applicable to the {:?} host: {why}", FilterHost::current()?);
    }
    Ok(other)
}

/// True (and says so) when the stack runs the ext_proc host and the calling test is about something
/// only a filter inside Envoy does (goes on while idemd is gone, keeps Envoy's replay cache, writes
/// Envoy's log): there idemd is the filter, and what an agent gets when it is gone is the connection
/// manager's envelope for a processor's failure (`confirm.rs`, `trust.rs`, `reconcile.rs` check it).
pub fn in_envoy_only(why: &str) -> Result<bool, BoxError> {
    let ext_proc = FilterHost::current()?.is_ext_proc();
    if ext_proc {
        eprintln!("*** not applicable to the ExtProc host: {why}");
    }
    Ok(ext_proc)
}

/// The `content-length` an answer of `len` bytes that the gateway rewrote goes out with on the host
/// under test: its length, or none (chunked) where the host cannot announce one. Envoy's ext_proc
/// filter always removes it under FULL_DUPLEX_STREAMED (its headers go out before the body's
/// changes come back, so it cannot know the length; the HTTP/1 codec then chunks the answer).
pub fn announced_length(len: usize) -> Result<Option<usize>, BoxError> {
    let duplex = FilterHost::current()?.is_ext_proc() && ext_proc::body_mode()? == "FULL_DUPLEX_STREAMED";
    Ok((!duplex).then_some(len))
}

/// Run `envoy --mode validate` on a config under envoy/ (with the real .wasm path; with
/// `IDEM_E2E_HOST=native`, converted to the native module as the stacks are).
pub fn validate_envoy_config(config: &str) -> Result<(bool, String), BoxError> {
    let ports = Ports { listener: 10000, admin: 9901, demo: 8080, sidecar: 9090 };
    let dir = tempfile::tempdir()?;
    let path = dir.path().join(config);
    let mut cmd = Command::new(envoy_bin()?);
    let text = filter_host::for_current_host(&render_envoy_config(config, &ports)?, &mut cmd)?;
    std::fs::write(&path, text)?;
    let out = cmd
        .arg("--mode")
        .arg("validate")
        .arg("-c")
        .arg(&path)
        .arg("--disable-hot-restart")
        // compose.yaml takes its HMAC key from the environment, as production should.
        .env("IDEM_HMAC_K1", "validate-only-secret-0123456789abcdef-0123")
        // Every config names idemd's bearer token by environment variable.
        .env("IDEM_SIDECAR_TOKEN", SIDECAR_TOKEN)
        .output()?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    Ok((out.status.success(), text))
}

/// Backends, found from the configured URLs (`IDEM_TEST_*_URL`; see `idem_testkit::backends`):
/// `IDEM_REQUIRE_BACKENDS=1` (CI) turns a missing backend into a failure instead of a loud skip.
pub mod backends {
    pub use idem_testkit::backends::{mysql_url, postgres_url, redis_url, OwnPostgres};

    /// A Postgres database of one test's own, dropped with it.
    pub fn own_postgres() -> Result<Option<OwnPostgres>, super::BoxError> {
        idem_testkit::backends::own_postgres("idem_e2e")
    }

    /// Ok(true): reachable. Ok(false): skipped loudly. Err: required but missing.
    /// `url` is a backend URL (`backends::redis_url()`) or a `host:port`.
    pub fn available(name: &str, url: &str) -> Result<bool, super::BoxError> {
        idem_testkit::backends::available(name, url)
    }

    /// Loud: on stderr, and in the file `make test` lists after the run.
    pub fn skipped(what: &str) {
        idem_testkit::backends::skip(what, "skipped");
    }
}
