//! `make soak`: a bounded, seeded chaos soak against the real stack.
//!
//! N agents (tokio tasks, each with its own seeded RNG) preview and confirm
//! transfers through Envoy (2 workers) → 2 × idemd → a private Redis + a
//! Postgres database of the run's own → the demo (`--no-dedup --faults`), while
//! a seeded fault schedule kills and restarts every process, flushes and
//! freezes Redis, kills the Postgres connections and slows the upstream. Then
//! the stack settles (the reconciler decides every stuck operation), the
//! operations still open poll to a definite answer, and the checker compares
//! what the agents were told with the demo's ledger and the SQL truth.

#![forbid(unsafe_code)]

pub mod agents;
pub mod approver;
pub mod check;
pub mod faults;
pub mod record;
pub mod report;
pub mod stack;

use agents::Ctx;
use idem_e2e::BoxError;
use record::Violation;
use sqlx::Row as _;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which upstreams the agents' operations meet (`--world`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum World {
    /// The demo only (`envoy/soak.yaml`).
    Demo,
    /// Every agent but the approval workload on the hostile upstream (`envoy/soak-hostile.yaml`).
    Hostile,
    /// Half the agents on each.
    Mixed,
}

impl World {
    pub fn parse(s: &str) -> Result<World, String> {
        match s {
            "demo" => Ok(World::Demo),
            "hostile" => Ok(World::Hostile),
            "mixed" => Ok(World::Mixed),
            other => Err(format!("--world {other}: expected demo, hostile or mixed")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            World::Demo => "demo",
            World::Hostile => "hostile",
            World::Mixed => "mixed",
        }
    }

    /// Whether agent `id` plays its operations against the hostile upstream (never the approval workload,
    /// which stays on the demo's approval routes).
    pub fn hostile_agent(self, id: usize) -> bool {
        !agents::runs_approvals(id)
            && match self {
                World::Demo => false,
                World::Hostile => true,
                World::Mixed => id % 2 == 1,
            }
    }
}

/// Replicated stores that fail over (`--failover`): what the Postgres standby acknowledges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failover {
    /// `synchronous_standby_names = '*'`: a commit returns once the standby has it. The demo executes every
    /// request that reaches it, as in the single-node soak.
    Sync,
    /// Commits do not wait for the standby; idemd reads its position and waits for it after each of its own
    /// writes (`idemd_waits`). The demo executes every request that reaches it, as on `Sync`.
    Async,
}

impl Failover {
    pub fn parse(s: &str) -> Result<Failover, String> {
        match s {
            "sync" => Ok(Failover::Sync),
            "async" => Ok(Failover::Async),
            other => Err(format!("--failover {other}: expected sync or async")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Failover::Sync => "sync",
            Failover::Async => "async",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Config {
    /// Seconds of chaos (agents and faults); settling and checking come after.
    pub seconds: u64,
    pub seed: u64,
    pub agents: usize,
    pub world: World,
    /// Replicated stores and failover faults (None: single nodes).
    pub failover: Option<Failover>,
    /// Where summary.md and chart.svg go.
    pub out_dir: PathBuf,
}

impl Config {
    pub fn new(seconds: u64, seed: u64, agents: usize) -> Config {
        Config { seconds, seed, agents, world: World::Demo, failover: None, out_dir: default_out_dir() }
    }

    pub fn in_world(self, world: World) -> Config {
        Config { world, ..self }
    }

    /// Replicated stores with failover faults. The demo world only (the failover faults are written for its
    /// one Postgres and one Redis).
    pub fn failing_over(self, failover: Failover) -> Config {
        Config { failover: Some(failover), world: World::Demo, ..self }
    }
}

/// `target/soak/` of this workspace (or of `CARGO_TARGET_DIR`).
pub fn default_out_dir() -> PathBuf {
    let root = idem_e2e::repo_root();
    let root = root.canonicalize().unwrap_or(root);
    std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root.join("target")).join("soak")
}

pub struct Outcome {
    pub violations: Vec<Violation>,
    pub summary: String,
    pub summary_path: PathBuf,
    pub chart_path: PathBuf,
    /// The run's directory (process logs, the demo's database), kept when something broke.
    pub kept_dir: Option<PathBuf>,
}

/// Bound on waiting for the agents' last operations after the chaos.
const AGENTS_DRAIN: Duration = Duration::from_secs(40);
/// Bound on the reconciler settling (no IN_FLIGHT row left).
const SETTLE: Duration = Duration::from_secs(30);
/// Bound on polling open operations to a definite answer.
const RESOLVE: Duration = Duration::from_secs(20);

/// Ok(None): a backend is missing and the soak was skipped (loudly; an error with IDEM_REQUIRE_BACKENDS=1).
pub async fn run(cfg: &Config) -> Result<Option<Outcome>, BoxError> {
    let wall = Instant::now();
    let Some(db) = stack::backends(cfg.failover)? else { return Ok(None) };
    let chaos_ms = cfg.seconds * 1000;
    let plan = match cfg.failover {
        Some(_) => faults::schedule_with_failovers(cfg.seed, chaos_ms),
        None => faults::schedule(cfg.seed, chaos_ms),
    };
    let failover = cfg.failover.map(|f| format!(" --failover {}", f.name())).unwrap_or_default();
    println!(
        "soak: seed {} ({} agents, {} s of chaos, world {}{failover}); replay with `soak --seed {} --seconds {} \
         --world {}{failover}`",
        cfg.seed,
        cfg.agents,
        cfg.seconds,
        cfg.world.name(),
        cfg.seed,
        cfg.seconds,
        cfg.world.name()
    );
    println!(
        "soak: fault schedule: {}",
        plan.iter().map(|s| format!("{:.1}s {:?}", s.at_ms as f64 / 1000.0, s.fault)).collect::<Vec<_>>().join(", ")
    );

    let hostile_seed = (cfg.world != World::Demo).then_some(cfg.seed);
    let mut stack = stack::SoakStack::start(db, hostile_seed).await?;
    println!("soak: stack up in {:.1} s (run dir {})", wall.elapsed().as_secs_f64(), stack.dir.path().display());
    let start = Instant::now();
    let ctx = Arc::new(Ctx::new(stack.url(""), start, start + Duration::from_millis(chaos_ms), cfg.world)?);

    let mut agents = tokio::task::JoinSet::new();
    for id in 0..cfg.agents {
        agents.spawn(agents::agent(ctx.clone(), id, cfg.seed));
    }
    let sidecars = [stack.sidecar_url(0, ""), stack.sidecar_url(1, "")];
    let approver = tokio::spawn(approver::approver(ctx.clone(), sidecars, cfg.seed, stack::APPROVER.1.to_owned()));
    let (injected, mut problems) = faults::play(&ctx, &mut stack, &plan, cfg.agents).await;
    let drain = tokio::time::timeout(ctx.deadline.saturating_duration_since(Instant::now()) + AGENTS_DRAIN, async {
        while agents.join_next().await.is_some() {}
    })
    .await;
    if drain.is_err() {
        problems.push(format!("agents still busy {} s after the chaos ended: aborted", AGENTS_DRAIN.as_secs()));
        agents.abort_all();
    }
    let approver = approver.await.unwrap_or_else(|e| {
        problems.push(format!("the approver task failed: {e}"));
        approver::ApproverLog::default()
    });
    println!("soak: chaos over after {:.1} s; settling", start.elapsed().as_secs_f64());

    // Settle: everything up, then the reconciler decides every stuck operation.
    match stack.ensure_up().await {
        Ok(r) if !r.is_empty() => println!("soak: brought back up: {r:?}"),
        Ok(_) => {}
        Err(e) => problems.push(format!("bringing the stack up after the chaos: {e}")),
    }
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(&stack.db.url()).await?;
    let settle_t0 = Instant::now();
    loop {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM idem_record WHERE state = 'IN_FLIGHT'").fetch_one(&pool).await?;
        if n == 0 || settle_t0.elapsed() > SETTLE {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let settle_ms = settle_t0.elapsed().as_millis() as u64;
    let polled_at_end = agents::resolve_open(&ctx, RESOLVE).await;

    // The evidence.
    let ledger: serde_json::Value =
        ctx.http.get(format!("{}/v1/executions", stack_demo(&stack))).send().await?.json().await?;
    let mut ledger_counts: BTreeMap<String, i64> = ledger["by_key"]
        .as_object()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.as_i64().unwrap_or(0))).collect())
        .unwrap_or_default();
    let (mut executed, mut transfer_owner) = demo_rows(&stack).await?;
    // The hostile upstream's ledger beside the demo's: the keys are nonces, never in both.
    let mut quotes = HashMap::new();
    if let Some(h) = &stack.hostile {
        for (key, n) in h.ledger.executions_by_key() {
            *ledger_counts.entry(key).or_default() += n as i64;
        }
        for x in h.ledger.executions() {
            let Some(key) = x.key else { continue };
            transfer_owner.insert(x.transfer_id.clone(), key.clone());
            let first = check::Executed { transfer_id: x.transfer_id, created_at_s: (x.at_unix_ms / 1000) as i64 };
            executed.entry(key).or_insert(first);
        }
        quotes = h.ledger.quotes().into_iter().collect();
    }
    let mut sql = HashMap::new();
    let mut sql_states: BTreeMap<String, u64> = BTreeMap::new();
    for row in sqlx::query("SELECT idem_key, state, result FROM idem_record").fetch_all(&pool).await? {
        let key: String = row.try_get(0)?;
        let state: String = row.try_get(1)?;
        let result: Option<String> = row.try_get(2)?;
        *sql_states.entry(state.clone()).or_default() += 1;
        let transfer_id = result.as_deref().and_then(check::stored_transfer_id);
        sql.insert(key.trim().to_owned(), check::SqlRow { state, transfer_id });
    }
    let mut review_reasons = HashMap::new();
    for row in sqlx::query("SELECT idem_key, why FROM idem_audit WHERE to_state = 'NEEDS_REVIEW' ORDER BY id")
        .fetch_all(&pool)
        .await?
    {
        let key: String = row.try_get(0)?;
        review_reasons.insert(key.trim().to_owned(), row.try_get::<String, _>(1)?);
    }
    let mut approvals = HashMap::new();
    let mut approval_states: BTreeMap<String, u64> = BTreeMap::new();
    for row in sqlx::query("SELECT idem_key, state, decided_by, fp_exp_ms FROM idem_approval").fetch_all(&pool).await? {
        let key: String = row.try_get(0)?;
        let state: String = row.try_get(1)?;
        *approval_states.entry(state.clone()).or_default() += 1;
        let a = check::ApprovalRow { state, decided_by: row.try_get(2)?, fp_exp_ms: row.try_get(3)? };
        approvals.insert(key.trim().to_owned(), a);
    }
    pool.close().await;
    let decided: HashMap<String, &'static str> =
        approver.sent.iter().filter(|d| d.http == 200).map(|d| (d.key.clone(), d.intent.name())).collect();
    let approved_executed = approvals
        .iter()
        .filter(|(k, a)| a.state == "APPROVED" && ledger_counts.get(k.as_str()).is_some_and(|n| *n > 0))
        .count();
    // Refused as lapsed, where no earlier attempt went unanswered (one that may have committed before the lapse).
    let unanswered: Vec<&str> = approver.sent.iter().filter(|d| d.http == 0).map(|d| d.key.as_str()).collect();
    let refused_lapsed = approver
        .sent
        .iter()
        .filter(|d| d.http == 410 && !unanswered.contains(&d.key.as_str()))
        .map(|d| d.key.clone())
        .collect();
    let evidence = check::Evidence {
        ledger_counts,
        executed,
        sql,
        review_reasons,
        approvals,
        decided,
        refused_lapsed,
        transfer_owner,
        quotes,
    };
    let failed = filter_failures(&stack);

    let log = ctx.log.lock().map_err(|_| "the agents' log is poisoned")?;
    let mut violations = log.violations.clone();
    violations.extend(check::check(&log, &evidence));
    violations.extend(problems.into_iter().map(|p| Violation { kind: "stack_failure", detail: p }));
    // No panic, no stream failed by a dead filter (Envoy's log and access log, across its restarts).
    if failed.panics > 0 {
        let detail = format!("{} panics or failed VMs in Envoy's log; first: {}", failed.panics, failed.first);
        violations.push(Violation { kind: "filter_panic", detail });
    }
    if failed.streams > 0 {
        let detail = format!("{} answers with response code details wasm_fail_stream", failed.streams);
        violations.push(Violation { kind: "filter_failed_streams", detail });
    }

    let facts = report::RunFacts {
        seed: cfg.seed,
        agents: cfg.agents,
        chaos_s: cfg.seconds,
        commit: commit(),
        wall_s: wall.elapsed().as_secs_f64(),
        settle_ms,
        polled_at_end,
        executions: evidence.ledger_counts.values().sum(),
        sql_states,
        approval_states,
        approved_executed,
        approver,
        world: cfg.world.name(),
        failover: cfg.failover.map(Failover::name),
        hostile_branches: stack.hostile.as_ref().map(|h| h.ledger.branch_counts()),
        hostile_executions: stack.hostile.as_ref().map_or(0, |h| h.ledger.executions().len()),
        filter_panics: failed.panics,
        failed_streams: failed.streams,
    };
    let summary = report::summary(&log, &injected, &violations, &facts);
    std::fs::create_dir_all(&cfg.out_dir)?;
    let summary_path = cfg.out_dir.join("summary.md");
    let chart_path = cfg.out_dir.join("chart.svg");
    let mut md = summary.clone();
    md.push_str("\nFaults as injected:\n\n");
    for f in &injected {
        md.push_str(&format!("- {:.1} s {} ({}; {} ms)\n", f.t_ms as f64 / 1000.0, f.kind, f.detail, f.took_ms));
    }
    std::fs::write(&summary_path, md)?;
    let all: String = violations.iter().map(|x| format!("{}: {}\n", x.kind, x.detail)).collect();
    std::fs::write(cfg.out_dir.join("violations.txt"), all)?;
    report::chart(&log, &injected, chaos_ms, &format!("soak seed {}", cfg.seed), &chart_path)?;
    drop(log);
    println!("{summary}");
    println!("soak: wrote {}, {} and violations.txt beside them", summary_path.display(), chart_path.display());
    let kept_dir = if violations.is_empty() {
        None
    } else {
        let d = stack.keep_dir();
        println!("soak: {} violations; logs and the demo's ledger kept in {}", violations.len(), d.display());
        Some(d)
    };
    Ok(Some(Outcome { violations, summary, summary_path, chart_path, kept_dir }))
}

fn stack_demo(stack: &stack::SoakStack) -> String {
    stack.demo_url("")
}

/// What Envoy's log and access log say of the filter: panics and failed VMs, streams failed for it.
struct FilterFailures {
    panics: usize,
    first: String,
    streams: usize,
}

fn filter_failures(stack: &stack::SoakStack) -> FilterFailures {
    let log = stack.envoy.log_text();
    let bad: Vec<&str> = log.lines().filter(|l| l.contains("panicked at") || l.contains("Wasm VM failed")).collect();
    let access = std::fs::read_to_string(&stack.access_log).unwrap_or_default();
    FilterFailures {
        panics: bad.len(),
        first: bad.first().map(|l| l.chars().take(300).collect()).unwrap_or_default(),
        streams: access.lines().filter(|l| l.contains("wasm_fail_stream")).count(),
    }
}

type Owners = HashMap<String, String>;

/// The demo's own rows (the ledger's detail): request key → first transfer and when it arrived; and every
/// transfer id → the key it executed under.
async fn demo_rows(stack: &stack::SoakStack) -> Result<(HashMap<String, check::Executed>, Owners), BoxError> {
    use sqlx::ConnectOptions as _;
    let opts = sqlx::sqlite::SqliteConnectOptions::new().filename(stack.dir.path().join("demo.db")).read_only(true);
    let mut con = opts.connect().await?;
    let mut out = HashMap::new();
    let mut owners = HashMap::new();
    for row in sqlx::query("SELECT request_key, transfer_id, created_at FROM write_record ORDER BY id")
        .fetch_all(&mut con)
        .await?
    {
        let key: String = row.try_get(0)?;
        let x = check::Executed { transfer_id: row.try_get(1)?, created_at_s: row.try_get(2)? };
        owners.insert(x.transfer_id.clone(), key.clone());
        out.entry(key).or_insert(x);
    }
    Ok((out, owners))
}

fn commit() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(idem_e2e::repo_root())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".into())
}
