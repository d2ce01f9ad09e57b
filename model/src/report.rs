//! Running a check and saying what it found: per property the states explored, unique states,
//! maximum depth and time; a counterexample as the agent/filter/idemd steps in order.

use std::time::{Duration, Instant};

use stateright::{Checker, Model};

use crate::config::Config;
use crate::world::{Action, Crash, State, Wait, World};

pub struct Outcome {
    pub states: usize,
    pub unique: usize,
    pub max_depth: usize,
    pub took: Duration,
    /// Property name → the counterexample, readable.
    pub violations: Vec<(&'static str, String)>,
    pub properties: Vec<&'static str>,
    /// `sometimes` properties no explored state satisfied: the paths they name were not checked.
    pub unreached: Vec<&'static str>,
    /// The check stopped at its first counterexample to this property ([`check_until`]): the
    /// states it did not explore were not judged.
    pub stopped_at: Option<&'static str>,
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{} states explored, {} unique, max depth {}, {:.1} s",
            self.states,
            self.unique,
            self.max_depth,
            self.took.as_secs_f64()
        )?;
        if let Some(p) = self.stopped_at {
            writeln!(f, "  (stopped at the first counterexample to \"{p}\": the rest not explored)")?;
        }
        for p in &self.properties {
            let verdict = if self.violations.iter().any(|(v, _)| v == p) {
                "VIOLATED"
            } else if self.stopped_at.is_some() {
                "unjudged"
            } else if self.unreached.contains(p) {
                "UNREACHED"
            } else {
                "holds"
            };
            writeln!(f, "  {verdict:8} {p}")?;
        }
        for (p, trace) in &self.violations {
            writeln!(f, "\ncounterexample to \"{p}\":\n{trace}")?;
        }
        Ok(())
    }
}

/// Check `cfg` exhaustively: depth first, one state of each symmetry class
/// ([`crate::symmetry`]; stateright reduces by symmetry only depth first, and depth first keeps
/// only a fingerprint per state where breadth first also queues whole states).
pub fn check(cfg: Config, threads: usize) -> Result<Outcome, String> {
    run(cfg, threads, None, None)
}

/// [`check`], printing the counts so far to stderr every `every` (the deep run's progress).
pub fn check_telling(cfg: Config, threads: usize, every: Option<Duration>) -> Result<Outcome, String> {
    run(cfg, threads, every, None)
}

/// [`check`] that stops at its first counterexample to `property` (a check that expects one).
pub fn check_until(cfg: Config, threads: usize, property: &'static str) -> Result<Outcome, String> {
    run(cfg, threads, None, Some(property))
}

fn run(cfg: Config, threads: usize, every: Option<Duration>, until: Option<&'static str>) -> Result<Outcome, String> {
    let world = World::new(cfg)?;
    let properties: Vec<&'static str> = world.properties().iter().map(|p| p.name).collect();
    let sometimes: Vec<&'static str> = world
        .properties()
        .iter()
        .filter(|p| p.expectation == stateright::Expectation::Sometimes)
        .map(|p| p.name)
        .collect();
    let started = Instant::now();
    let mut builder = world.checker().threads(threads).symmetry_fn(crate::symmetry::representative);
    if let Some(p) = until {
        builder = builder.finish_when(stateright::HasDiscoveries::AnyOf([p].into()));
    }
    let checker = builder.spawn_dfs();
    if let Some(every) = every {
        while !checker.is_done() {
            std::thread::sleep(every);
            eprintln!(
                "  {:.0} s: {} states explored, {} unique, max depth {}",
                started.elapsed().as_secs_f64(),
                checker.state_count(),
                checker.unique_state_count(),
                checker.max_depth()
            );
        }
    }
    let checker = checker.join();
    let took = started.elapsed();
    let discoveries = checker.discoveries();
    let unreached = sometimes.iter().copied().filter(|p| !discoveries.contains_key(p)).collect();
    let mut violations: Vec<(&'static str, String)> = discoveries
        .into_iter()
        .filter(|(name, _)| !sometimes.contains(name))
        .map(|(name, path)| (name, trace(checker.model(), &path.into_vec())))
        .collect();
    violations.sort_by_key(|(n, _)| *n);
    let stopped_at = until.filter(|p| violations.iter().any(|(v, _)| v == p));
    Ok(Outcome {
        states: checker.state_count(),
        unique: checker.unique_state_count(),
        max_depth: checker.max_depth(),
        took,
        violations,
        properties,
        unreached,
        stopped_at,
    })
}

/// The path as numbered steps, each saying who did what and what followed.
pub fn trace(world: &World, path: &[(State, Option<Action>)]) -> String {
    let mut out = String::new();
    for (n, (state, action)) in path.iter().enumerate() {
        let Some(action) = action else { continue };
        let next = world.step(state, *action);
        let line = match &next {
            Some(next) => describe(world, state, *action, next),
            None => format!("{action:?} (disabled)"),
        };
        out.push_str(&format!("{:3}. t={}s {line}\n", n + 1, state.now_s));
    }
    if let Some((last, _)) = path.last() {
        out.push_str(&format!("     final: {}\n", summary(last)));
        let mut steps = Vec::new();
        let mut prev = last.clone();
        let settled = world.settle_path(last, |a, next| {
            steps.push(format!("       then {}", describe(world, &prev, a, next)));
            prev = next.clone();
        });
        if let Err(stuck) = settled {
            out.push_str("     the fault-free completion from here:\n");
            for line in steps.iter().rev().take(12).rev() {
                out.push_str(line);
                out.push('\n');
            }
            let last_told: Vec<_> = stuck.agents.iter().map(|a| a.last.as_ref().map(|t| t.answer.said)).collect();
            out.push_str(&format!("     stopped unsettled at: {}, agents last told {last_told:?}\n", summary(&stuck)));
        }
    }
    out
}

/// One step in words: the actor, what it did, and what the world shows for it.
pub fn describe(world: &World, last: &State, action: Action, next: &State) -> String {
    let stream = |i: usize| {
        last.streams
            .get(i)
            .map_or_else(String::new, |s| format!("agent {} via filter {} ({:?})", s.agent, s.filter, s.kind))
    };
    let told = |agent: u8| {
        let a = usize::from(agent);
        let before = last.agents.get(a).map_or(0, |x| x.answers());
        let now = next.agents.get(a)?;
        (now.answers() > before).then(|| now.last.as_ref().map(|t| format!(" → agent {agent} told {:?}", t.answer)))?
    };
    let told_any = || (0..world.cfg.agents).filter_map(told).collect::<Vec<_>>().join("");
    let what = match action {
        Action::Confirm { agent, filter, ruled } => {
            let route = match (world.cfg.approval, ruled) {
                (false, _) => "",
                (true, true) => " (the route with the approval rule)",
                (true, false) => " (the scope's route without the rule)",
            };
            format!("agent {agent} sends a confirm to filter {filter}{route}")
        }
        Action::Decide { approve } => {
            format!("the approver {}", if approve { "approves" } else { "rejects" })
        }
        Action::Lapse => "idemd's sweep lapses the approval (past exp, nothing executed)".into(),
        Action::ReapApproval => "reaper deletes the decided approval row".into(),
        Action::Poll { agent, filter } => format!("agent {agent} polls the status route on filter {filter}"),
        Action::Idemd { stream: i, crash } => {
            let call = match last.streams.get(i).map(|s| &s.wait) {
                Some(Wait::Idemd(c)) => format!("{} {}", c.method, c.path),
                _ => "?".into(),
            };
            match crash {
                None => format!("idemd: the next store call of {call} for {}", stream(i)),
                Some(Crash::Before) => format!("idemd replica crashes before serving {call} for {}", stream(i)),
                Some(Crash::After) => {
                    format!("idemd replica makes the next store call of {call} for {}, then crashes", stream(i))
                }
            }
        }
        Action::Upstream { stream: i, how } => format!("upstream {how:?} for {}", stream(i)),
        Action::LateExecute => "upstream runs a request Envoy gave up on".into(),
        Action::Orphan(i) => {
            let path = last.orphans.get(i).map_or("?", |o| o.callout.path.as_str());
            format!("idemd: the next store call of a late {path} its filter gave up on")
        }
        Action::Tick => "clock +1 s (leases renewed, TTLs run)".into(),
        Action::ReconcileStart(n) => format!("reconciler {n} pass: selects the expired row, claims it"),
        Action::Reconcile { by, lookup_fails } => {
            format!("reconciler {by}: its next call{}", if lookup_fails { " (the status lookup fails)" } else { "" })
        }
        Action::Reap => "reaper deletes the terminal row".into(),
        Action::RedisUp | Action::SqlUp => format!("{action:?} (back)"),
        other => format!("fault: {other:?}"),
    };
    format!("{what}{} | {}", told_any(), summary(next))
}

fn summary(s: &State) -> String {
    let sql = match (&s.stores.sql, s.stores.sql_down) {
        (_, true) => "down".to_string(),
        (None, _) => "-".to_string(),
        (Some(r), _) => {
            format!("{:?} owner {}", r.state, r.owner.as_deref().map_or("-", |o| o.trim_start_matches('0')))
        }
    };
    let redis = match (&s.stores.redis, s.stores.redis_down) {
        (_, true) => "down".to_string(),
        (None, _) => "-".to_string(),
        (Some(c), _) => format!("{:?}", c.state),
    };
    let approval = match &s.stores.approval {
        None => String::new(),
        Some(a) => format!("approval {:?}, ", a.state),
    };
    let refused = match s.upstream.refusals {
        0 => String::new(),
        n => format!(" (refused {n})"),
    };
    format!(
        "sql {sql}, {approval}redis {redis}, executions {}{refused}, streams {}",
        s.upstream.executions,
        s.streams.len()
    )
}
