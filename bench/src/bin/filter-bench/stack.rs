//! The stack under measurement (demo, idemd, one Envoy with the bench listeners
//! of both filter hosts) and what is read from it around each timed run: CPU from
//! /proc, idemd's store latency histograms from its `/metrics`, Envoy's counters
//! from its `/stats`.

use idem_e2e::filter_host::{native_module_dir, to_native, NATIVE_MODULE};
use idem_e2e::{
    bench_plain_listener, ext_proc, free_port, repo_root, spawn_sidecar, start_demo, start_envoy_with, start_sidecar,
    wait_ready, BoxError, DemoOpts, FilterHost, Ports, Proc, SidecarOpts,
};
use std::collections::BTreeMap;
use std::time::Instant;

/// envoy/bench.yaml's `empty` and `rules` listeners, moved to free ports like `plain`.
const BENCH_EMPTY_LISTENER_PORT: u16 = 10002;
const BENCH_RULES_LISTENER_PORT: u16 = 10003;
/// envoy/bench.yaml's `buffered` listener (plain Envoy + its buffer filter), moved likewise.
const BENCH_BUFFERED_LISTENER_PORT: u16 = 10004;
/// The line of envoy/bench.yaml that envoy/bench-empty.yaml replaces.
const EMPTY_LISTENER_MARKER: &str = "  # @empty-listener (envoy/bench-empty.yaml, spliced in here by filter-bench)\n";
/// The line of envoy/bench.yaml where the native twins of `agents` and `rules` go.
const NATIVE_LISTENERS_MARKER: &str =
    "  # @native-listeners (agents_native and rules_native, made by filter-bench from the two above)\n";
const EMPTY_WASM: &str = "target/wasm32-wasip1/wasm/idem_empty_filter.wasm";

/// The line of envoy/bench.yaml before which the ext_proc clusters go.
const CLUSTERS_LINE: &str = "  clusters:\n";
/// The clusters the ext_proc twins of `agents` and `rules` send their streams on.
const EXT_PROC_AGENTS_CLUSTER: &str = "idem_ext_proc";
const EXT_PROC_RULES_CLUSTER: &str = "idem_ext_proc_rules";

/// The filter's three hosts, measured side by side in the same Envoy: the `.wasm`, the native
/// module, and Envoy's ext_proc filter in front of idemd's ext_proc service (BUFFERED, as
/// envoy/ext-proc.yaml ships it).
pub(crate) const HOSTS: [FilterHost; 3] = [FilterHost::Wasm, FilterHost::Native, FilterHost::ExtProc];

/// How a report row names the host.
pub(crate) fn host_name(host: FilterHost) -> &'static str {
    match host {
        FilterHost::Wasm => "wasm",
        FilterHost::Native => "native",
        FilterHost::ExtProc => "ext_proc",
    }
}

/// The filter's replay-cache hit counter, as each host names it: in Envoy's /stats for the two
/// filters, in idemd's /metrics for the ext_proc host (whose filter runs in idemd).
pub(crate) fn replay_hits_counter(host: FilterHost) -> &'static str {
    match host {
        FilterHost::Wasm => "wasmcustom.idem.replay_cache_hits",
        FilterHost::Native => "dynamicmodulescustom.idem.replay_cache_hits",
        FilterHost::ExtProc => "idem_ext_proc_filter_events_total{event=\"replay_cache_hits\"}",
    }
}

/// The replay-cache hits of `host` so far, read where it keeps them.
pub(crate) async fn replay_hits(host: FilterHost, admin: u16, sidecar_port: u16) -> u64 {
    match host {
        FilterHost::ExtProc => idemd_counter(sidecar_port, replay_hits_counter(host)).await,
        _ => envoy_counter(admin, replay_hits_counter(host)).await,
    }
}

/// One host's listeners: the agent filter, and the agent filter with 20 route rules.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FilterPorts {
    pub(crate) agents: u16,
    pub(crate) rules: u16,
}

pub(crate) struct BenchStack {
    pub(crate) label: &'static str,
    _dir: tempfile::TempDir,
    /// The agent filter's listeners as proxy-wasm (`agents`, `rules`), as the native module
    /// (`agents_native`, `rules_native`) and as Envoy's ext_proc filter (`agents_ext_proc`,
    /// `rules_ext_proc`); plain Envoy; the empty proxy-wasm filter.
    wasm: FilterPorts,
    native: FilterPorts,
    ext_proc: FilterPorts,
    pub(crate) plain: u16,
    pub(crate) empty: u16,
    /// Plain Envoy with its buffer filter: the request held until complete, nothing else.
    pub(crate) buffered: u16,
    pub(crate) admin: u16,
    /// The demo (the upstream), for a proxy of another kind in front of it.
    pub(crate) demo_port: u16,
    pub(crate) sidecar_port: u16,
    pub(crate) sql_url: String,
    redis_url: Option<String>,
    demo: Proc,
    sidecar: Proc,
    /// The idemd whose ext_proc service runs `rules`' plugin configuration (an ext_proc service runs
    /// one; the main idemd's runs `agents`'), on the same stores.
    rules_sidecar: Proc,
    pub(crate) envoy: Proc,
    /// Nonces this run wrote into shared stores, removed at the end.
    pub(crate) nonces: Vec<String>,
}

/// The empty proxy-wasm filter's .wasm (`make bench` builds it).
pub(crate) fn empty_wasm() -> Result<std::path::PathBuf, BoxError> {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"));
    let p = target.join(EMPTY_WASM.trim_start_matches("target/"));
    if !p.exists() {
        return Err(format!(
            "{} is missing: run `cargo build --profile wasm --target wasm32-wasip1 -p idem-empty-filter` (make bench does)",
            p.display()
        )
        .into());
    }
    Ok(p)
}

/// The native module's .so (`make native` builds it).
pub(crate) fn native_module() -> Result<std::path::PathBuf, BoxError> {
    Ok(native_module_dir()?.join(format!("lib{NATIVE_MODULE}.so")))
}

/// The listener `name` of envoy/bench.yaml: its `  - name: <name>` line and every line
/// after it that is blank or indented deeper.
fn listener_block(yaml: &str, name: &str) -> Result<String, BoxError> {
    let head = format!("  - name: {name}");
    let mut lines = yaml.lines().skip_while(|l| *l != head);
    let first = lines.next().ok_or_else(|| format!("envoy/bench.yaml has no listener `{name}`"))?;
    let rest = lines.take_while(|l| l.trim().is_empty() || l.starts_with("    "));
    Ok(std::iter::once(first).chain(rest).map(|l| format!("{l}\n")).collect())
}

/// bench.yaml's listener `name` with the native module in place of the .wasm (the harness's
/// `to_native`, as `IDEM_E2E_HOST=native` runs the e2e suite: the same plugin configuration),
/// renamed `<name>_native` and moved to `port`.
fn native_listener(yaml: &str, name: &str, port: u16) -> Result<String, BoxError> {
    twin(&to_native(&listener_block(yaml, name)?)?, name, "native", port)
}

/// bench.yaml's listener `name` with Envoy's ext_proc filter on `cluster` in place of the .wasm
/// (the harness's conversion, as `IDEM_E2E_HOST=extproc` runs the e2e suite), renamed
/// `<name>_ext_proc` and moved to `port`.
fn ext_proc_listener(yaml: &str, name: &str, cluster: &str, port: u16) -> Result<String, BoxError> {
    twin(&ext_proc::listener_to_ext_proc(&listener_block(yaml, name)?, cluster, "BUFFERED")?, name, "ext_proc", port)
}

/// A converted copy of listener `name`, renamed `<name>_<host>` (stats prefix and route-table
/// anchor too) and moved to `port`. The route table is its own copy, so per-route filter configs
/// name the host's filter.
fn twin(converted: &str, name: &str, host: &str, port: u16) -> Result<String, BoxError> {
    let renamed = converted
        .replacen(&format!("  - name: {name}\n"), &format!("  - name: {name}_{host}\n"), 1)
        .replace(&format!("stat_prefix: {name}\n"), &format!("stat_prefix: {name}_{host}\n"))
        .replace("&routes\n", &format!("&routes_{host}\n"))
        .replace("*routes\n", &format!("*routes_{host}\n"));
    // The listener's own address is the block's only `port_value`.
    let (before, after) = renamed.split_once("port_value: ").ok_or_else(|| format!("listener `{name}` has no port"))?;
    let digits = after.find(|c: char| !c.is_ascii_digit()).unwrap_or(after.len());
    Ok(format!("{before}port_value: {port}{}", after.get(digits..).unwrap_or("")))
}

pub(crate) async fn start_stack(
    label: &'static str,
    redis_url: Option<String>,
    sql_url: Option<String>,
) -> Result<BenchStack, BoxError> {
    let dir = tempfile::tempdir()?;
    let ports = Ports { listener: free_port()?, admin: free_port()?, demo: free_port()?, sidecar: free_port()? };
    let (plain, empty, rules, buffered) = (free_port()?, free_port()?, free_port()?, free_port()?);
    let native = FilterPorts { agents: free_port()?, rules: free_port()? };
    let ext_proc_ports = FilterPorts { agents: free_port()?, rules: free_port()? };
    let sql_url = sql_url.unwrap_or_else(|| format!("sqlite://{}/idem.db?mode=rwc", dir.path().display()));
    let mut demo = start_demo(&DemoOpts::default(), ports.demo, dir.path())?;
    wait_ready(&format!("http://127.0.0.1:{}/healthz", ports.demo), &mut demo).await?;
    let bench = std::fs::read_to_string(repo_root().join("envoy/bench.yaml"))?;
    // The ext_proc host: the main idemd serves `agents`' plugin configuration, a second idemd on the
    // same stores `rules'` (an ext_proc service runs one configuration). One thread each, as Envoy
    // runs one worker: the filters' hosts run on that one thread too.
    let rules_sidecar_port = free_port()?;
    // The harness's own ext_proc flags for the idemd on `sidecar_port`, with `listener`'s plugin
    // configuration; and the port its ext_proc service listens on.
    let serve = |listener: &str, sidecar_port: u16| -> Result<(u16, Vec<String>), BoxError> {
        let config = ext_proc::plugin_config_of(&listener_block(&bench, listener)?)
            .ok_or_else(|| format!("envoy/bench.yaml's `{listener}` has no plugin configuration"))?;
        let (_, port) = ext_proc::prepare(sidecar_port, &config, dir.path())?;
        Ok((port, ext_proc::sidecar_args(sidecar_port, dir.path())?))
    };
    let (agents_grpc, agents_args) = serve("agents", ports.sidecar)?;
    let (rules_grpc, rules_args) = serve("rules", rules_sidecar_port)?;
    let opts =
        |extra_args| SidecarOpts { redis_url: redis_url.clone(), database_url: Some(sql_url.clone()), extra_args };
    let mut sidecar = start_sidecar(&opts(agents_args), ports.sidecar, dir.path())?;
    wait_ready(&format!("http://127.0.0.1:{}/healthz", ports.sidecar), &mut sidecar).await?;
    let mut rules_sidecar = spawn_sidecar("idemd-rules", &opts(rules_args), rules_sidecar_port, dir.path())?;
    wait_ready(&format!("http://127.0.0.1:{rules_sidecar_port}/healthz"), &mut rules_sidecar).await?;
    let fragment = std::fs::read_to_string(repo_root().join("envoy/bench-empty.yaml"))?;
    // The fragment's own header comment stays out; its listener goes where the marker is.
    let listener: String = fragment.lines().skip_while(|l| l.starts_with('#')).map(|l| format!("{l}\n")).collect();
    let listener = listener
        .replace(EMPTY_WASM, &empty_wasm()?.display().to_string())
        .replace(&format!("port_value: {BENCH_EMPTY_LISTENER_PORT}"), &format!("port_value: {empty}"));
    let twins = native_listener(&bench, "agents", native.agents)?
        + &native_listener(&bench, "rules", native.rules)?
        + &ext_proc_listener(&bench, "agents", EXT_PROC_AGENTS_CLUSTER, ext_proc_ports.agents)?
        + &ext_proc_listener(&bench, "rules", EXT_PROC_RULES_CLUSTER, ext_proc_ports.rules)?;
    let clusters: String = [(EXT_PROC_AGENTS_CLUSTER, agents_grpc), (EXT_PROC_RULES_CLUSTER, rules_grpc)]
        .into_iter()
        .flat_map(|(name, port)| ext_proc::cluster(name, &[port], "  "))
        .map(|l| format!("{l}\n"))
        .collect();
    let edits = [
        bench_plain_listener(plain),
        (EMPTY_LISTENER_MARKER.to_owned(), listener),
        (format!("port_value: {BENCH_RULES_LISTENER_PORT}"), format!("port_value: {rules}")),
        (format!("port_value: {BENCH_BUFFERED_LISTENER_PORT}"), format!("port_value: {buffered}")),
        (NATIVE_LISTENERS_MARKER.to_owned(), twins),
        (CLUSTERS_LINE.to_owned(), format!("{CLUSTERS_LINE}{clusters}")),
    ];
    let mut envoy = start_envoy_with("bench.yaml", &ports, &edits, dir.path())?;
    wait_ready(&format!("http://127.0.0.1:{}/ready", ports.admin), &mut envoy).await?;
    Ok(BenchStack {
        label,
        _dir: dir,
        wasm: FilterPorts { agents: ports.listener, rules },
        native,
        ext_proc: ext_proc_ports,
        plain,
        empty,
        buffered,
        admin: ports.admin,
        demo_port: ports.demo,
        sidecar_port: ports.sidecar,
        sql_url,
        redis_url,
        demo,
        sidecar,
        rules_sidecar,
        envoy,
        nonces: Vec::new(),
    })
}

impl BenchStack {
    /// The listeners of the filter on `host`.
    pub(crate) fn filter(&self, host: FilterHost) -> FilterPorts {
        match host {
            FilterHost::Wasm => self.wasm,
            FilterHost::Native => self.native,
            FilterHost::ExtProc => self.ext_proc,
        }
    }

    /// Both idemd processes: the CPU of a side is theirs together (the second one only serves
    /// `rules_ext_proc`, and idles otherwise).
    pub(crate) fn idemd_pids(&self) -> Vec<u32> {
        [self.sidecar.pid(), self.rules_sidecar.pid()].into_iter().flatten().collect()
    }

    /// Upstream requests and connections per cluster (a pool that reconnects per request costs a lot).
    pub(crate) async fn upstream_summary(&self) -> String {
        let url = format!(
            "http://127.0.0.1:{}/stats?filter=^cluster%5C.(demo|idem_sidecar)%5C.upstream_(rq|cx)_total$",
            self.admin
        );
        let text = match reqwest::get(url).await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => return String::new(),
        };
        let get = |name: &str| {
            text.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(": "))).unwrap_or("?").to_owned()
        };
        let mut out = Vec::new();
        for c in ["demo", "idem_sidecar"] {
            let (rq, cx) =
                (get(&format!("cluster.{c}.upstream_rq_total")), get(&format!("cluster.{c}.upstream_cx_total")));
            out.push(format!("{c} {rq} requests over {cx} connections"));
        }
        format!("upstreams of the {} stack: {}", self.label, out.join(", "))
    }

    pub(crate) fn pids(&self) -> Vec<u32> {
        [self.demo.pid(), self.sidecar.pid(), self.rules_sidecar.pid(), self.envoy.pid()]
            .into_iter()
            .flatten()
            .collect()
    }

    /// Remove this run's rows from the shared Postgres and keys from Redis.
    pub(crate) async fn cleanup(&mut self) {
        if self.nonces.is_empty() || !self.sql_url.starts_with("postgres") {
            return;
        }
        if let Ok(pool) = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&self.sql_url).await {
            for chunk in self.nonces.chunks(5000) {
                let _ = sqlx::query("DELETE FROM idem_record WHERE idem_key::text = ANY($1)")
                    .bind(chunk.to_vec())
                    .execute(&pool)
                    .await;
            }
            pool.close().await;
        }
        if let Some(url) = &self.redis_url {
            redis_del(url, self.nonces.iter().map(|n| format!("idem:{{{n}}}")).collect()).await;
        }
        self.nonces.clear();
    }
}

/// DEL `keys` on the Redis at `url`, best effort (what a run wrote, at its end).
pub(crate) async fn redis_del(url: &str, keys: Vec<String>) {
    let Ok(client) = redis::Client::open(url) else { return };
    let Ok(mut con) = client.get_multiplexed_async_connection().await else { return };
    for chunk in keys.chunks(1000) {
        let _: Result<i64, _> = redis::cmd("DEL").arg(chunk).query_async(&mut con).await;
    }
}

// ---- CPU accounting ----------------------------------------------------------

/// utime + stime of a process, in clock ticks (USER_HZ, 100/s on Linux).
pub(crate) fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit_once(')').map(|r| r.1).unwrap_or("").split_whitespace().collect();
    let at = |i: usize| fields.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    at(11) + at(12)
}

/// Busy ticks of the whole machine, and of the processes this bench drives
/// (itself, the stack, and the Postgres/Redis servers it loads).
fn cpu_sample(stack_pids: &[u32]) -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let line = stat.lines().next().unwrap_or("");
    let v: Vec<u64> = line.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal
    let busy = [0usize, 1, 2, 5, 6, 7].iter().filter_map(|&i| v.get(i)).sum();
    let ours = cpu_ticks(std::process::id()) + stack_pids.iter().map(|&p| cpu_ticks(p)).sum::<u64>();
    (busy, ours + server_ticks(&["postgres", "redis-server"]))
}

/// CPU ticks of every process named one of `names` (/proc/<pid>/comm), e.g. the Redis server.
pub(crate) fn server_ticks(names: &[&str]) -> u64 {
    let mut ticks = 0;
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let name = e.file_name();
            let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            if names.contains(&comm.trim()) {
                ticks += cpu_ticks(pid);
            }
        }
    }
    ticks
}

/// CPU used by everything else on the machine (other builds and tests) while a stack ran.
pub(crate) struct Foreign {
    start: (u64, u64),
    at: Instant,
}

impl Foreign {
    pub(crate) fn start(stack_pids: &[u32]) -> Foreign {
        Foreign { start: cpu_sample(stack_pids), at: Instant::now() }
    }

    /// Average cores busy with foreign work.
    pub(crate) fn cores(&self, stack_pids: &[u32]) -> f64 {
        let (busy, ours) = cpu_sample(stack_pids);
        let foreign = busy.saturating_sub(self.start.0).saturating_sub(ours.saturating_sub(self.start.1));
        foreign as f64 / 100.0 / self.at.elapsed().as_secs_f64().max(0.001)
    }
}

// ---- idemd's /metrics and Envoy's /stats -------------------------------------

/// `idem_store_latency_seconds` of idemd, by "store op": (sum of seconds, count).
pub(crate) type StoreTimes = BTreeMap<String, (f64, u64)>;

/// idemd's store latency histograms (its /metrics needs no token); empty when unreachable.
pub(crate) async fn store_times(sidecar_port: u16) -> StoreTimes {
    let url = format!("http://127.0.0.1:{sidecar_port}/metrics");
    let text = match reqwest::get(url).await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => return StoreTimes::new(),
    };
    parse_store_times(&text)
}

fn parse_store_times(text: &str) -> StoreTimes {
    let mut out = StoreTimes::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("idem_store_latency_seconds_") else { continue };
        let Some((kind, rest)) = rest.split_once('{') else { continue };
        let Some((labels, value)) = rest.rsplit_once('}') else { continue };
        let label = |name: &str| {
            labels.split(',').find_map(|kv| {
                let (k, v) = kv.split_once('=')?;
                (k.trim() == name).then(|| v.trim().trim_matches('"').to_owned())
            })
        };
        let (Some(store), Some(op)) = (label("store"), label("op")) else { continue };
        let value: f64 = value.split_whitespace().next().and_then(|v| v.parse().ok()).unwrap_or(0.0);
        let e = out.entry(format!("{store} {op}")).or_insert((0.0, 0));
        match kind {
            "sum" => e.0 = value,
            "count" => e.1 = value as u64,
            _ => {}
        }
    }
    out
}

/// What happened between two scrapes: (store op, seconds, calls), the ops that were called.
pub(crate) fn store_delta(before: &StoreTimes, after: &StoreTimes) -> Vec<(String, f64, u64)> {
    after
        .iter()
        .filter_map(|(k, (sum, count))| {
            let (s0, c0) = before.get(k).copied().unwrap_or((0.0, 0));
            let calls = count.saturating_sub(c0);
            (calls > 0).then(|| (k.clone(), (sum - s0).max(0.0), calls))
        })
        .collect()
}

/// A counter of idemd's /metrics, by its whole series (`name{labels}`); 0 when absent.
pub(crate) async fn idemd_counter(sidecar_port: u16, series: &str) -> u64 {
    let text = match reqwest::get(format!("http://127.0.0.1:{sidecar_port}/metrics")).await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => return 0,
    };
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// One counter of Envoy's /stats (e.g. `wasmcustom.idem.replay_cache_hits`); 0 when absent.
pub(crate) async fn envoy_counter(admin: u16, name: &str) -> u64 {
    let url = format!("http://127.0.0.1:{admin}/stats?filter=^{}$", name.replace('.', "%5C."));
    let text = match reqwest::get(url).await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => return 0,
    };
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(": ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn native_listeners_are_the_wasm_ones_on_the_native_module() -> Result<(), BoxError> {
        let bench = std::fs::read_to_string(repo_root().join("envoy/bench.yaml"))?;
        assert!(bench.contains(NATIVE_LISTENERS_MARKER) && bench.contains(EMPTY_LISTENER_MARKER));
        let agents = native_listener(&bench, "agents", 31000)?;
        let rules = native_listener(&bench, "rules", 31001)?;
        for (text, name, port) in [(&agents, "agents_native", 31000), (&rules, "rules_native", 31001)] {
            assert!(text.starts_with(&format!("  - name: {name}\n")), "{text}");
            assert!(text.contains(&format!("stat_prefix: {name}\n")));
            assert!(text.contains(&format!("port_value: {port} ")));
            assert!(text.contains(&format!("dynamic_module_config: {{ name: {NATIVE_MODULE} }}")));
            assert!(!text.contains("envoy.filters.http.wasm") && !text.contains("envoy.extensions.filters.http.wasm"));
            assert!(!text.contains("clusters:") && !text.contains("- name: plain\n"), "one listener only");
        }
        // Its own route table, whose opted-out route disables the native filter.
        assert!(agents.contains("route_config: &routes_native\n") && rules.contains("route_config: *routes_native\n"));
        assert!(agents.contains("envoy.filters.http.dynamic_modules:\n"));
        assert_eq!(rules.matches("\"name\": \"rule_").count(), 20, "the 20 route rules came along");
        Ok(())
    }

    /// The ext_proc twins: Envoy's ext_proc filter on each listener's own cluster, its own route
    /// table (whose opted-out route disables it), the processor's failure answered with the envelope,
    /// and no plugin configuration left in Envoy (idemd has it).
    #[test]
    fn ext_proc_listeners_are_the_wasm_ones_behind_envoys_ext_proc_filter() -> Result<(), BoxError> {
        let bench = std::fs::read_to_string(repo_root().join("envoy/bench.yaml"))?;
        let agents = ext_proc_listener(&bench, "agents", EXT_PROC_AGENTS_CLUSTER, 31002)?;
        let rules = ext_proc_listener(&bench, "rules", EXT_PROC_RULES_CLUSTER, 31003)?;
        for (text, name, port, cluster) in [
            (&agents, "agents_ext_proc", 31002, EXT_PROC_AGENTS_CLUSTER),
            (&rules, "rules_ext_proc", 31003, EXT_PROC_RULES_CLUSTER),
        ] {
            assert!(text.starts_with(&format!("  - name: {name}\n")), "{text}");
            assert!(text.contains(&format!("stat_prefix: {name}\n")) && text.contains(&format!("port_value: {port} ")));
            assert!(text.contains(&format!("envoy_grpc: {{ cluster_name: {cluster} }}")), "{text}");
            assert!(text.contains("failure_mode_allow: false") && text.contains("startsWith('ext_proc_error')"));
            assert!(!text.contains("envoy.extensions.filters.http.wasm") && !text.contains("\"sidecar_cluster\""));
            assert!(!text.contains("clusters:"), "one listener only");
        }
        assert!(
            agents.contains("route_config: &routes_ext_proc\n") && rules.contains("route_config: *routes_ext_proc\n")
        );
        assert!(agents.contains("envoy.filters.http.ext_proc:\n"), "the opted-out route names the ext_proc filter");
        Ok(())
    }

    #[test]
    fn store_times_from_openmetrics() {
        let text = "# TYPE idem_store_latency_seconds histogram\n\
            idem_store_latency_seconds_sum{store=\"sql\",op=\"acquire\"} 0.5\n\
            idem_store_latency_seconds_count{store=\"sql\",op=\"acquire\"} 10\n\
            idem_store_latency_seconds_bucket{le=\"0.1\",store=\"sql\",op=\"acquire\"} 10\n";
        let t = parse_store_times(text);
        assert_eq!(t.get("sql acquire"), Some(&(0.5, 10)));
        let after: StoreTimes = [("sql acquire".to_owned(), (0.75, 15))].into();
        assert_eq!(store_delta(&t, &after), vec![("sql acquire".to_owned(), 0.25, 5)]);
    }
}
