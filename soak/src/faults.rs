//! The fault schedule: drawn up front from the seed (printed, the same for the
//! same seed), played beside the agents against the real processes.

use crate::agents::{crash_confirm, rng_for, Ctx};
use crate::record::since_ms;
use crate::stack::{SoakStack, Store};
use rand::seq::SliceRandom;
use rand::Rng;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// kill -9 Envoy (both workers, every open connection), restart it.
    EnvoyKill,
    /// kill -9 one idemd replica; restart it after `down_ms`.
    IdemdKill { which: usize, down_ms: u64 },
    /// kill -9 the demo (mid-request, maybe); restart it after `down_ms`.
    DemoKill { down_ms: u64 },
    /// A confirm that makes the demo exit right after it committed; restart it.
    DemoCrashAfterCommit,
    /// FLUSHDB on the private Redis: the fast path forgets everything.
    RedisFlush,
    /// SIGSTOP the private Redis for `ms`, then SIGCONT: connections hang.
    RedisPause { ms: u64 },
    /// pg_terminate_backend on every connection to the run's database.
    PgTerminate,
    /// For `ms`, confirms ask the demo to take 0.3–2.4 s (the confirm route times out at 2 s).
    SlowUpstream { ms: u64 },
    /// `--failover` only: the Postgres standby is cut off, and once something has executed since (its claim
    /// committed on the primary alone, or waiting for the standby on `sync`), at least `lag_ms` later, the
    /// primary is SIGKILLed, the lagging standby promoted and idemd's address moved to it; then a new standby.
    PgFailover { lag_ms: u64 },
    /// `--failover` only: the same for Redis (`REPLICAOF NO ONE` on a replica that missed the window's writes).
    RedisFailover { lag_ms: u64 },
}

impl Fault {
    pub fn kind(self) -> &'static str {
        match self {
            Fault::EnvoyKill => "envoy_kill9",
            Fault::IdemdKill { .. } => "idemd_kill9",
            Fault::DemoKill { .. } => "demo_kill9",
            Fault::DemoCrashAfterCommit => "demo_crash_after_commit",
            Fault::RedisFlush => "redis_flushdb",
            Fault::RedisPause { .. } => "redis_sigstop",
            Fault::PgTerminate => "pg_terminate",
            Fault::SlowUpstream { .. } => "slow_upstream",
            Fault::PgFailover { .. } => "pg_failover",
            Fault::RedisFailover { .. } => "redis_failover",
        }
    }

    /// The faults of a run with replicated stores (`--failover`), beside [`KINDS`](Self::KINDS).
    pub const FAILOVER_KINDS: [&'static str; 2] = ["pg_failover", "redis_failover"];

    pub const KINDS: [&'static str; 8] = [
        "envoy_kill9",
        "idemd_kill9",
        "demo_kill9",
        "demo_crash_after_commit",
        "redis_flushdb",
        "redis_sigstop",
        "pg_terminate",
        "slow_upstream",
    ];
}

#[derive(Debug, Clone, Copy)]
pub struct Scheduled {
    pub at_ms: u64,
    pub fault: Fault,
}

fn draw(rng: &mut impl Rng, kind: usize) -> Fault {
    match kind {
        0 => Fault::EnvoyKill,
        1 => Fault::IdemdKill { which: rng.gen_range(0..2), down_ms: rng.gen_range(0..1500) },
        2 => Fault::DemoKill { down_ms: rng.gen_range(0..1000) },
        3 => Fault::DemoCrashAfterCommit,
        4 => Fault::RedisFlush,
        5 => Fault::RedisPause { ms: rng.gen_range(1500..4000) },
        6 => Fault::PgTerminate,
        7 => Fault::SlowUpstream { ms: rng.gen_range(3000..8000) },
        8 => Fault::PgFailover { lag_ms: rng.gen_range(300..1500) },
        _ => Fault::RedisFailover { lag_ms: rng.gen_range(300..1500) },
    }
}

/// Every kind once (in a seeded order), then seeded picks, one every 1.2–3.5 s from 2 s on, until `chaos_ms` - 1 s.
pub fn schedule(seed: u64, chaos_ms: u64) -> Vec<Scheduled> {
    schedule_of(seed, chaos_ms, false)
}

/// The schedule of a run with replicated stores: the two failovers first (in a seeded order), so a run of a
/// few seconds has both, then every other kind once, then seeded picks among all of them.
pub fn schedule_with_failovers(seed: u64, chaos_ms: u64) -> Vec<Scheduled> {
    schedule_of(seed, chaos_ms, true)
}

fn schedule_of(seed: u64, chaos_ms: u64, failovers: bool) -> Vec<Scheduled> {
    let mut rng = rng_for(seed, usize::MAX);
    let base = Fault::KINDS.len();
    let mut kinds: Vec<usize> = (0..base).collect();
    kinds.shuffle(&mut rng);
    let all = if failovers {
        let mut first: Vec<usize> = (base..base + Fault::FAILOVER_KINDS.len()).collect();
        first.shuffle(&mut rng);
        first.extend(kinds);
        kinds = first;
        base + Fault::FAILOVER_KINDS.len()
    } else {
        base
    };
    let mut out = Vec::new();
    let mut at = 2_000;
    let mut i = 0;
    while at + 1_000 < chaos_ms {
        let kind = kinds.get(i).copied().unwrap_or_else(|| rng.gen_range(0..all));
        out.push(Scheduled { at_ms: at, fault: draw(&mut rng, kind) });
        at += rng.gen_range(1_200..3_500);
        i += 1;
    }
    out
}

/// A fault as it happened.
#[derive(Debug, Clone)]
pub struct Injected {
    pub t_ms: u64,
    pub kind: &'static str,
    pub detail: String,
    pub took_ms: u64,
}

/// Plays the schedule; between faults, watches that nothing died on its own. Errors (a process that does not come
/// back, one that died unprompted) are the soak's own failures: returned in `problems`.
pub async fn play(
    ctx: &Arc<Ctx>,
    stack: &mut SoakStack,
    plan: &[Scheduled],
    crash_agent: usize,
) -> (Vec<Injected>, Vec<String>) {
    let mut done = Vec::new();
    let mut problems = Vec::new();
    for s in plan {
        loop {
            let now = since_ms(ctx.start);
            if now >= s.at_ms {
                break;
            }
            tokio::time::sleep(Duration::from_millis((s.at_ms - now).min(200))).await;
            watch(stack, &mut problems).await;
        }
        let t_ms = since_ms(ctx.start);
        let t0 = Instant::now();
        let detail = match inject(ctx, stack, s.fault, crash_agent).await {
            Ok(d) => d,
            Err(e) => {
                problems.push(format!("{} at {t_ms} ms: {e}", s.fault.kind()));
                format!("error: {e}")
            }
        };
        done.push(Injected { t_ms, kind: s.fault.kind(), detail, took_ms: t0.elapsed().as_millis() as u64 });
    }
    (done, problems)
}

async fn watch(stack: &mut SoakStack, problems: &mut Vec<String>) {
    let mut died = Vec::new();
    if stack.envoy.exited() {
        died.push(("envoy", stack.envoy.log_text()));
    }
    for i in 0..2 {
        if stack.idemd[i].exited() {
            died.push(("idemd", stack.idemd[i].log_text()));
        }
    }
    if stack.demo.exited() {
        died.push(("demo", stack.demo.log_text()));
    }
    if died.is_empty() {
        return;
    }
    for (name, log) in died {
        let tail: String =
            log.lines().rev().take(15).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
        problems.push(format!("{name} died without a fault:\n{tail}"));
    }
    if let Err(e) = stack.ensure_up().await {
        problems.push(format!("restarting after an unprompted exit: {e}"));
    }
}

async fn inject(
    ctx: &Arc<Ctx>,
    stack: &mut SoakStack,
    fault: Fault,
    crash_agent: usize,
) -> Result<String, idem_e2e::BoxError> {
    Ok(match fault {
        Fault::EnvoyKill => {
            stack.restart_envoy().await?;
            "killed, restarted".to_owned()
        }
        Fault::IdemdKill { which, down_ms } => {
            stack.kill_idemd(which);
            tokio::time::sleep(Duration::from_millis(down_ms)).await;
            stack.start_idemd(which).await?;
            format!("idemd-{which} down {down_ms} ms")
        }
        Fault::DemoKill { down_ms } => {
            stack.kill_demo();
            tokio::time::sleep(Duration::from_millis(down_ms)).await;
            stack.start_demo().await?;
            format!("down {down_ms} ms")
        }
        Fault::DemoCrashAfterCommit => {
            let task = {
                let ctx = ctx.clone();
                tokio::spawn(async move { crash_confirm(&ctx, crash_agent).await })
            };
            let deadline = Instant::now() + Duration::from_secs(6);
            while !stack.demo.exited() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let crashed = stack.demo.exited();
            stack.start_demo().await?;
            let op = task.await.ok().flatten();
            match (op, crashed) {
                (Some(op), true) => format!("op {} ({}) committed, the demo exited before answering", op.id, op.nonce),
                (Some(op), false) => {
                    format!("op {} ({}) never crashed the demo (not forwarded?); restarted it anyway", op.id, op.nonce)
                }
                (None, _) => "the preview failed; restarted the demo anyway".to_owned(),
            }
        }
        Fault::RedisFlush => {
            stack.redis_flush().await?;
            "FLUSHDB".to_owned()
        }
        Fault::RedisPause { ms } => {
            stack.redis_signal(true)?;
            tokio::time::sleep(Duration::from_millis(ms)).await;
            stack.redis_signal(false)?;
            format!("stopped {ms} ms")
        }
        Fault::PgTerminate => format!("{} connections terminated", stack.pg_terminate().await?),
        Fault::SlowUpstream { ms } => {
            ctx.slow_until_ms.store(since_ms(ctx.start) + ms, Ordering::Relaxed);
            format!("{ms} ms of slow confirms")
        }
        Fault::PgFailover { lag_ms } => stack.fail_over(Store::Postgres, lag_ms).await?,
        Fault::RedisFailover { lag_ms } => stack.fail_over(Store::Redis, lag_ms).await?,
    })
}
