//! The properties, each checked over every reachable state.

use stateright::Property;

use crate::config::Config;
use crate::filter::Said;
use crate::idemd::{Ap, St};
use crate::world::{State, World};
use idem_core::reply::ReplyKind;

pub const AT_MOST_ONCE: &str = "at most one execution per operation";
pub const NOTHING_RAN_IS_TRUE: &str = "no agent is told nothing ran about an operation that executed";
pub const TERMINAL_KEPT: &str = "a terminal record is never overwritten";
pub const FIRST_RESULT: &str = "every result an agent gets is the first execution's";
pub const FAILED_IS_TRUE: &str =
    "an agent is told failed only about an operation the upstream refused and never ran, and ran only about one that ran";
pub const SETTLES: &str = "with faults off, every state settles within the bound";
pub const APPROVED_FIRST: &str = "nothing executes unless its approval is APPROVED";
pub const REFUSED_NEVER_RUNS: &str = "a rejected or lapsed operation never executes";
pub const VERDICT_KEPT: &str = "every answer about a rejected (or lapsed) operation says so";
/// The paths approval opens, each reached somewhere (`sometimes`: a check that never reaches one
/// fails, so the properties above are not true for want of the path).
pub const REACHES_APPROVED_RUN: &str = "reached: an approved operation executes";
pub const REACHES_TOLD_REJECTED: &str = "reached: an agent is told rejected";
pub const REACHES_TOLD_LAPSED: &str = "reached: an agent is told approval_lapsed";
/// The paths of the design every bounded check must reach (without approval).
pub const REACHES_FAILED_REPLAYED: &str = "reached: a FAILED operation is replayed (already_failed)";
pub const REACHES_NEEDS_REVIEW: &str = "reached: an agent is told needs_review";
pub const REACHES_RECONCILER_RELEASE: &str = "reached: the reconciler releases a row";
pub const REACHES_REAP: &str = "reached: the reaper deletes a terminal row";
pub const REACHES_REPLAY_CACHE_HIT: &str = "reached: a filter answers from its replay cache";
pub const REACHES_RECORD_EXPIRED: &str = "reached: an agent is told record_expired";
pub const REACHES_RECONCILED_FAILED: &str =
    "reached: the reconciler decides FAILED from the status endpoint and an agent is told already_failed";

pub fn properties(cfg: &Config) -> Vec<Property<World>> {
    let mut p = vec![
        Property::always(AT_MOST_ONCE, |_, s: &State| s.upstream.executions <= 1),
        Property::always(NOTHING_RAN_IS_TRUE, |_, s: &State| !s.ghost.told_nothing_ran_after_it_ran),
        Property::always(TERMINAL_KEPT, |_, s: &State| !s.ghost.overwritten),
        Property::always(FIRST_RESULT, |_, s: &State| !s.ghost.told_another_result),
        Property::always(FAILED_IS_TRUE, |_, s: &State| !s.ghost.failed_misreported),
    ];
    if !cfg.approval && cfg.reachability {
        use crate::world::reached;
        p.push(Property::sometimes(REACHES_FAILED_REPLAYED, |_, s: &State| told(s, ReplyKind::AlreadyFailed)));
        p.push(Property::sometimes(REACHES_NEEDS_REVIEW, |_, s: &State| told(s, ReplyKind::NeedsReview)));
        p.push(Property::sometimes(REACHES_RECONCILER_RELEASE, |_, s: &State| {
            s.ghost.reached & reached::RECONCILER_RELEASE != 0
        }));
        p.push(Property::sometimes(REACHES_REAP, |_, s: &State| s.ghost.reached & reached::REAP != 0));
        p.push(Property::sometimes(REACHES_REPLAY_CACHE_HIT, |_, s: &State| {
            s.ghost.reached & reached::REPLAY_CACHE_HIT != 0
        }));
        p.push(Property::sometimes(REACHES_RECORD_EXPIRED, |_, s: &State| told(s, ReplyKind::RecordGone)));
        p.push(Property::sometimes(REACHES_RECONCILED_FAILED, |_, s: &State| {
            s.ghost.reached & reached::RECONCILED_FAILED != 0 && told(s, ReplyKind::AlreadyFailed)
        }));
    }
    if cfg.approval {
        p.push(Property::always(APPROVED_FIRST, |_, s: &State| !s.ghost.ran_unapproved));
        p.push(Property::always(REFUSED_NEVER_RUNS, |_, s: &State| {
            s.ghost.verdict.is_none() || s.upstream.executions == 0
        }));
        p.push(Property::always(VERDICT_KEPT, |_, s: &State| !s.ghost.verdict_contradicted));
        p.push(Property::sometimes(REACHES_APPROVED_RUN, |_, s: &State| {
            s.upstream.executions == 1 && s.stores.approval.as_ref().is_some_and(|a| a.state == Ap::Approved)
        }));
        p.push(Property::sometimes(REACHES_TOLD_REJECTED, |_, s: &State| told(s, ReplyKind::Rejected)));
        p.push(Property::sometimes(REACHES_TOLD_LAPSED, |_, s: &State| told(s, ReplyKind::ApprovalLapsed)));
    }
    if cfg.check_settle {
        // Judged on the class's representative, so that the schedule's choice among equals (the
        // first enabled) is the same for every state of a symmetry class.
        p.push(Property::always(SETTLES, |m: &World, s: &State| {
            m.settles(&crate::symmetry::representative(s)).is_ok()
        }));
    }
    p
}

fn told(s: &State, kind: ReplyKind) -> bool {
    s.agents.iter().any(|a| a.last.as_ref().is_some_and(|t| t.answer.said == Said::Guard(kind)))
}

/// Settled: nothing in flight, the operation DONE, FAILED, NEEDS_REVIEW or gone (never run, or
/// released), and every agent that asked holding a definite answer or `needs_review`.
pub fn settled(s: &State) -> bool {
    s.streams.is_empty()
        && s.upstream.late_until.is_none()
        && s.orphans.is_empty()
        && s.passes.iter().all(Option::is_none)
        && s.stores.sql.as_ref().is_none_or(|r| r.state != St::InFlight)
        && s.agents.iter().all(|a| a.last.as_ref().is_none_or(|t| t.answer.is_settled()))
}

impl World {
    /// The bounded form of "eventually" (stateright's `eventually` needs terminal paths, and the
    /// faults keep every path open): from `s`, with faults off, a fair fault-free schedule
    /// reaches a settled state within `settle_steps`. The schedule: answer every callout, let
    /// the upstream answer, bring the stores back, let the reconciler and the clock run, and let
    /// an agent without a definite answer ask again. `Err`: the last state it reached.
    pub fn settles(&self, s: &State) -> Result<(), Box<State>> {
        let known = |s: &State| self.settling.lock().map(|k| k.contains(&hash(s))).unwrap_or(false);
        if known(s) {
            return Ok(());
        }
        let mut path = vec![hash(s)];
        let mut shortcut = false;
        let r = self.settle_path_until(s, |_, next| {
            if known(next) {
                shortcut = true;
                return true;
            }
            path.push(hash(next));
            false
        });
        if r.is_ok() || shortcut {
            if let Ok(mut k) = self.settling.lock() {
                k.extend(path);
            }
            return Ok(());
        }
        r
    }

    pub fn settle_path(&self, s: &State, mut seen: impl FnMut(crate::world::Action, &State)) -> Result<(), Box<State>> {
        self.settle_path_until(s, |a, next| {
            seen(a, next);
            false
        })
    }

    /// [`World::settles`], calling `seen` with every step the schedule takes; `seen` answering
    /// `true` ends the walk as settled.
    fn settle_path_until(
        &self,
        s: &State,
        mut seen: impl FnMut(crate::world::Action, &State) -> bool,
    ) -> Result<(), Box<State>> {
        let mut s = s.clone();
        let mut actions = Vec::new();
        for _ in 0..self.cfg.settle_steps {
            if settled(&s) {
                return Ok(());
            }
            actions.clear();
            self.enabled(&s, false, false, &mut actions);
            let pick = actions.iter().copied().filter_map(|a| self.rank(&s, a).map(|r| (r, a))).min_by_key(|(r, _)| *r);
            let Some((_, action)) = pick else { return Err(Box::new(s)) };
            let Some(next) = self.step(&s, action) else { return Err(Box::new(s)) };
            if seen(action, &next) {
                return Ok(());
            }
            s = next;
        }
        if settled(&s) {
            Ok(())
        } else {
            Err(Box::new(s))
        }
    }

    /// The fair schedule's choices, first the lowest: the stores come back, callouts and the
    /// upstream answer, the reconciler runs, an unsettled agent asks again (once a second: it
    /// polls after an interval), time passes.
    fn rank(&self, s: &State, a: crate::world::Action) -> Option<u8> {
        use crate::world::Action::*;
        match a {
            SqlUp | RedisUp => Some(0),
            Idemd { .. } => Some(1),
            Upstream { .. } => Some(2),
            LateExecute | Orphan(_) => Some(3),
            Lapse => Some(4),
            Reconcile { lookup_fails: false, .. } => Some(1),
            ReconcileStart(_) => s
                .stores
                .sql
                .as_ref()
                .is_some_and(|r| r.lease_until_ms.is_some_and(|l| l < crate::idemd::ms_of(s.now_s)))
                .then_some(4),
            Confirm { agent, .. } => {
                let a = &s.agents[usize::from(agent)];
                let asks = s.streams.is_empty()
                    && s.stores.sql.as_ref().is_none_or(|r| r.state != St::InFlight)
                    && a.last.as_ref().is_some_and(|t| !t.answer.is_settled() && !t.fresh);
                asks.then_some(5)
            }
            Tick => (s.now_s < 64).then_some(6),
            _ => None,
        }
    }
}

fn hash(s: &State) -> u64 {
    crate::hash::hash(s)
}
