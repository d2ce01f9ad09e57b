//! filter-bench: DESIGN §9's performance budget, measured as ratios in ONE run.
//!
//! Not a test and never an assertion: the numbers depend on the machine and on
//! what else runs on it; the ratios against the baselines measured in the same
//! run are what to read. `make bench` runs it:
//!
//! ```text
//! make wasm native
//! cargo build --release -p idem-demo -p idemd
//! cargo build --profile wasm --target wasm32-wasip1 -p idem-empty-filter
//! IDEM_E2E_PROFILE=release cargo run --release -p idem-bench --bin filter-bench -- [--seconds 2] [--reps 3] [--conns 16]
//! ```
//!
//! One Envoy (`--concurrency 1`) runs envoy/bench.yaml: listener `agents` with the
//! agent filter, `plain` without any filter, `empty` with an empty proxy-wasm filter
//! (bench/empty-filter, spliced in from envoy/bench-empty.yaml) and `rules` with the
//! agent filter and 20 plugin-config route rules; same routes, the demo as upstream.
//! Both builds of the filter run in that one Envoy: `agents` and `rules` load the
//! `.wasm`, and their twins `agents_native` and `rules_native` (made from them by the
//! harness's wasm-to-native conversion, spliced in at bench.yaml's `@native-listeners`
//! line) load the native dynamic module (`make native`) with the same plugin
//! configuration, and their twins `agents_ext_proc` and `rules_ext_proc` run Envoy's
//! ext_proc filter (BUFFERED, the harness's conversion) in front of idemd's ext_proc
//! service: the main idemd serves `agents`' plugin configuration, a second idemd on the
//! same stores `rules'` (one configuration per service). So every case's three hosts and
//! baselines (plain Envoy, the empty proxy-wasm filter: the reference of hosting any wasm
//! filter, kept as is) run interleaved in the same reps, and its rows end in "(wasm)",
//! "(native)" and "(ext_proc)". `IDEM_E2E_HOST` does not apply here (it is ignored): the
//! bench always runs all three.
//!
//! Optional: `IDEM_BENCH_STANDALONE_PROXY=<binary>` adds a standalone Redis-backed
//! idempotency proxy (ldclabs/idempotent-proxy) to the duplicate case on Redis + Postgres
//! (`standalone`): the same confirm through it, interleaved with the filter's replays.
//! This repository neither contains nor builds it: build it outside the repository from
//! that project's own sources, following its README. Without the variable its row
//! says "not measured".
//!
//! - `client`: the hand-rolled HTTP/1.1 keep-alive load client (one thread, `--conns` connections);
//! - `cases`: the cases; the sides of a case run interleaved `--reps` times in an order rotated
//!   per rep, and each row is the median of the per-rep ratios of two of its sides;
//! - `baselines`: the raw single-row commit rate of idemd's database and the plain-Envoy requests;
//! - `stack`: the processes, and what is read around each run: Envoy's and idemd's CPU from
//!   /proc, idemd's store time from its `/metrics`, Envoy's replay-cache hits from `/stats`
//!   (`wasmcustom.idem.replay_cache_hits`, `dynamicmodulescustom.idem.replay_cache_hits`);
//! - `standalone`: the optional standalone idempotency proxy;
//! - `report`: the markdown table (stdout, target/bench/summary.md) and target/bench/chart.svg.
//!
//! The duplicate and fresh confirms run on idemd with Redis + Postgres and on SQLite
//! alone. An unreachable backend is skipped loudly. Rows written to the shared
//! Postgres/Redis are removed at the end. Beside the replays runs Envoy's own floor for
//! them: the same confirm held whole by Envoy's buffer filter (`buffered`) and answered by
//! Envoy itself (the catch-all direct_response), so a replay's cost reads as floor + filter.

#![forbid(unsafe_code)]

mod baselines;
mod cases;
mod client;
mod report;
mod stack;
mod standalone;

use baselines::{pg_diagnostics, RawDb};
use cases::{duplicate_case, fresh_case, proxy_cases};
use idem_e2e::{backends, repo_root, wasm, BoxError};
use stack::{empty_wasm, native_module, start_stack, Foreign};
use standalone::Standalone;

#[derive(Debug, Clone)]
pub(crate) struct Opts {
    pub(crate) seconds: f64,
    pub(crate) reps: usize,
    pub(crate) conns: usize,
    pub(crate) warmup: f64,
    /// Which case groups run (`--cases proxy,duplicate,fresh`; all by default; `--proxy-only` is
    /// `--cases proxy`, on the SQLite stack): an A/B of one path without the rest. The figures in
    /// docs/performance.md come from full runs.
    pub(crate) cases: Cases,
}

/// The case groups: the cases without idemd, the duplicate confirm, the fresh confirm.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cases {
    pub(crate) proxy: bool,
    pub(crate) duplicate: bool,
    pub(crate) fresh: bool,
}

impl Cases {
    const ALL: Cases = Cases { proxy: true, duplicate: true, fresh: true };

    fn parse(list: &str) -> Result<Cases, BoxError> {
        let mut c = Cases { proxy: false, duplicate: false, fresh: false };
        for name in list.split(',').map(str::trim) {
            match name {
                "proxy" => c.proxy = true,
                "duplicate" => c.duplicate = true,
                "fresh" => c.fresh = true,
                other => return Err(format!("unknown case group {other} (proxy, duplicate, fresh)").into()),
            }
        }
        Ok(c)
    }

    fn idemd(self) -> bool {
        self.duplicate || self.fresh
    }
}

const HELP: &str = "\
filter-bench [--seconds 2] [--reps 3] [--conns 16] [--warmup 0.5] [--proxy-only] [--cases proxy,duplicate,fresh]

--proxy-only: only the cases without idemd (unannotated route, preview), on the SQLite stack.
--cases: only these case groups (all by default): proxy (unannotated route, preview), duplicate (the replay),
    fresh (the fresh confirm); for an A/B of one path. Full runs make the published figures.

The agent filter as proxy-wasm (.wasm), as the native Envoy dynamic module (make native) and behind Envoy's ext_proc filter, side by side
in one Envoy, against plain Envoy and an empty proxy-wasm filter; writes target/bench/summary.md and chart.svg.

Environment:
  IDEM_BENCH_STANDALONE_PROXY=<path>  optional: a binary of ldclabs/idempotent-proxy's idempotent-proxy-server,
      built OUTSIDE this repository from that project's own sources following its own README (this repository
      neither contains nor builds it). filter-bench runs it in front of the demo on 127.0.0.1, on Redis database 15
      with one tokio worker (TOKIO_WORKER_THREADS=1 unless set), and measures its duplicate-confirm replays with
      the same client and body, interleaved with the filter's replays (the Redis + Postgres stack only).
      Unset: its row says \"not measured\".
  IDEM_TEST_REDIS_URL, IDEM_TEST_POSTGRES_URL  the backends (default 127.0.0.1:6379, postgres@127.0.0.1:5432/test).
  IDEM_BENCH_WINDOWS=1  print each timed run's window in Unix seconds (`window start,end`), to cut a profile of
      the Envoy worker recorded with `perf record -k CLOCK_REALTIME` to one side (`perf report --time start,end`).";

fn parse_args() -> Result<Opts, BoxError> {
    let mut o = Opts { seconds: 2.0, reps: 3, conns: 16, warmup: 0.5, cases: Cases::ALL };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--seconds" => o.seconds = val()?.parse()?,
            "--reps" => o.reps = val()?.parse()?,
            "--conns" => o.conns = val()?.parse()?,
            "--warmup" => o.warmup = val()?.parse()?,
            "--proxy-only" => o.cases = Cases { proxy: true, duplicate: false, fresh: false },
            "--cases" => o.cases = Cases::parse(&val()?)?,
            "-h" | "--help" => {
                println!("{HELP}");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other} (see --help)").into()),
        }
    }
    if o.reps == 0 || o.conns == 0 || o.seconds <= 0.0 {
        return Err("--reps, --conns and --seconds must be positive".into());
    }
    Ok(o)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// The commit measured: short hash, "+ local changes" when the tree is dirty.
fn commit() -> String {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .current_dir(repo_root())
            .args(args)
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default()
    };
    let hash = git(&["rev-parse", "--short", "HEAD"]);
    let dirty = !git(&["status", "--porcelain", "--untracked-files=no"]).is_empty();
    match (hash.is_empty(), dirty) {
        (true, _) => "unknown".into(),
        (false, true) => format!("{hash} + local changes"),
        (false, false) => hash,
    }
}

fn bench_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"))
        .join("bench")
}

async fn bench(o: Opts) -> Result<(), BoxError> {
    // Per-request log lines would cost the demo more than Envoy: production-like logging.
    if std::env::var_os("RUST_LOG").is_none() {
        std::env::set_var("RUST_LOG", "warn");
    }
    // The hosts run side by side: the harness must not convert the .wasm listeners too.
    if std::env::var_os("IDEM_E2E_HOST").is_some() {
        eprintln!("filter-bench: IDEM_E2E_HOST ignored: the bench measures the three hosts side by side");
        std::env::remove_var("IDEM_E2E_HOST");
    }
    // The ext_proc host's plugin configuration names idemd's token as the filters' does.
    std::env::set_var("IDEM_SIDECAR_TOKEN", idem_e2e::SIDECAR_TOKEN);
    let wasm_bytes = std::fs::metadata(wasm()?)?.len();
    let empty_wasm_bytes = std::fs::metadata(empty_wasm()?)?.len();
    let native_bytes = std::fs::metadata(native_module()?)?.len();
    let load_start = loadavg();
    eprintln!(
        "filter-bench: load average at start {load_start}; {} s x {} reps, {} connections",
        o.seconds, o.reps, o.conns
    );
    let mut rows = Vec::new();
    let mut lines = vec![format!("load average (1/5/15 min) at start: {load_start}")];
    let mut proxied = false;

    // 1) idemd on Redis + Postgres.
    let pg_up = o.cases.idemd()
        && backends::available("redis", &backends::redis_url())?
        && backends::available("postgres", &backends::postgres_url())?;
    if pg_up {
        let mut st = start_stack("redis+postgres", Some(backends::redis_url()), Some(backends::postgres_url())).await?;
        let standalone = Standalone::start(st.demo_port, &backends::redis_url()).await;
        lines.push(standalone.about());
        let pids: Vec<u32> = st.pids().into_iter().chain(standalone.pid()).collect();
        let foreign = Foreign::start(&pids);
        let raw = RawDb::postgres(&backends::postgres_url()).await?;
        lines.extend(pg_diagnostics(&backends::postgres_url()).await);
        let r = async {
            if o.cases.proxy {
                proxy_cases(&mut st, &o, &mut rows).await?;
                proxied = true;
            }
            if o.cases.duplicate {
                duplicate_case(&mut st, &o, Some(&standalone), &mut rows).await?;
            }
            if o.cases.fresh {
                fresh_case(&mut st, &raw, "postgres", &o, &mut rows).await?;
            }
            Ok::<(), BoxError>(())
        }
        .await;
        lines.push(format!("foreign CPU during the redis+postgres stack: {:.2} cores", foreign.cores(&pids)));
        lines.push(st.upstream_summary().await);
        raw.drop_table().await;
        st.cleanup().await;
        standalone.cleanup().await;
        if let Err(e) = r {
            eprintln!("envoy log:\n{}", st.envoy.log_text());
            return Err(e);
        }
    } else if !o.cases.idemd() {
        lines.push("only the cases without idemd: the unannotated route and the preview".into());
    } else {
        lines.push("SKIPPED BACKEND: idemd on redis+postgres (unreachable, see above)".into());
        rows.push(standalone::unmeasured_row("not measured (Redis unreachable)"));
    }

    // 2) idemd on SQLite alone.
    let mut st = start_stack("sqlite-only", None, None).await?;
    let pids = st.pids();
    let foreign = Foreign::start(&pids);
    let raw = RawDb::sqlite(&st.sql_url).await?;
    let r = async {
        if o.cases.proxy && !proxied {
            proxy_cases(&mut st, &o, &mut rows).await?;
        }
        if o.cases.duplicate {
            duplicate_case(&mut st, &o, None, &mut rows).await?;
        }
        if o.cases.fresh {
            fresh_case(&mut st, &raw, "sqlite", &o, &mut rows).await?;
        }
        Ok::<(), BoxError>(())
    }
    .await;
    lines.push(format!("foreign CPU during the sqlite-only stack: {:.2} cores", foreign.cores(&pids)));
    lines.push(st.upstream_summary().await);
    raw.drop_table().await;
    if let Err(e) = r {
        eprintln!("envoy log:\n{}", st.envoy.log_text());
        return Err(e);
    }
    lines.push(format!("load average at end: {}", loadavg()));
    let ctx = report::Context { commit: commit(), wasm_bytes, empty_wasm_bytes, native_bytes, lines };
    report::write(&rows, &o, &ctx, &bench_dir())
}

fn main() {
    let result = parse_args().and_then(|o| {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        rt.block_on(bench(o))
    });
    if let Err(e) = result {
        eprintln!("filter-bench: {e}");
        std::process::exit(1);
    }
}
