//! `make test`'s bounded check of the protocol (docs/model.md): the design as built holds every
//! property on both upstream kinds, and every mutation is refuted with a counterexample.

use idem_core::reply::ReplyKind;
use idem_model::config::{Broken, Config, Mutation, UpstreamKeys};
use idem_model::filter::Said;
use idem_model::props;
use idem_model::report::{check, check_until};
use idem_model::symmetry::{renamed, representative};
use idem_model::world::{State, Wait, World};

fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn holds(upstream: UpstreamKeys) {
    holds_in(Config::bounded(upstream));
}

fn holds_in(cfg: Config) {
    let outcome = check(cfg, threads()).expect("model");
    println!("{outcome}");
    assert!(outcome.unique > 1_000, "the check explored almost nothing: {outcome}");
    assert!(outcome.violations.is_empty(), "{outcome}");
    assert!(outcome.unreached.is_empty(), "paths the check never reached: {outcome}");
}

#[test]
fn the_design_holds_with_an_upstream_that_deduplicates_by_key() {
    holds(UpstreamKeys::Honoured);
}

#[test]
fn the_design_holds_with_an_upstream_that_ignores_keys() {
    holds(UpstreamKeys::Ignored);
}

/// Two idemd replicas reconcile (DESIGN §4: every replica runs the reconciler): each pass's select,
/// claim, lookup and write are steps of their own, so one replica's pass interleaves with the
/// other's, with the filters' calls and with the faults; the claim is what keeps them apart.
#[test]
fn the_design_holds_with_two_reconcilers() {
    holds_in(Config { reconcilers: 2, ..Config::bounded(UpstreamKeys::Ignored) });
}

/// The same, the second replica's clock a second ahead (the skew the bounded world allows, `world::SKEW_MS`):
/// it finds leases expired and the grace passed a second early.
#[test]
fn the_design_holds_with_a_reconciler_whose_clock_runs_ahead() {
    holds_in(Config { reconcilers: 2, clock_ahead_s: 1, ..Config::bounded(UpstreamKeys::Ignored) });
}

/// Approval (docs/approvals.md): a person approves or rejects at any moment (late too), idemd
/// lapses what nobody approved by `exp`, and retries may take the scope's route without the rule.
#[test]
fn the_design_holds_with_approval_and_an_upstream_that_deduplicates_by_key() {
    holds_in(Config::bounded_approval(UpstreamKeys::Honoured));
}

#[test]
fn the_design_holds_with_approval_and_an_upstream_that_ignores_keys() {
    holds_in(Config::bounded_approval(UpstreamKeys::Ignored));
}

/// Each mutation, the upstream it is checked against, and the property that must refute it.
fn refuted(m: Mutation, upstream: UpstreamKeys, property: &'static str) {
    refuted_in(Config::bounded(upstream), m, property);
}

fn refuted_in(cfg: Config, m: Mutation, property: &'static str) {
    let cfg = Config { check_settle: false, ..cfg }.mutated(m);
    // Stopped at the first counterexample to the property that must refute it: what the test asks.
    let outcome = check_until(cfg, threads(), property).expect("model");
    println!("{m:?}: {outcome}");
    let found = outcome.violations.iter().find(|(p, _)| *p == property);
    assert!(found.is_some(), "{m:?} was not refuted by \"{property}\": {outcome}");
}

#[test]
fn complete_without_the_owner_check_is_refuted() {
    refuted(Mutation::Store(Broken::CompleteWithoutOwnerCheck), UpstreamKeys::Honoured, props::TERMINAL_KEPT);
}

#[test]
fn reaping_before_exp_is_refuted() {
    refuted(Mutation::Store(Broken::ReapBeforeExp), UpstreamKeys::Honoured, props::NOTHING_RAN_IS_TRUE);
}

#[test]
fn expiry_refused_before_the_lookup_is_refuted() {
    refuted(Mutation::ExpiryBeforeLookup, UpstreamKeys::Honoured, props::NOTHING_RAN_IS_TRUE);
}

#[test]
fn release_on_an_unknown_outcome_is_refuted() {
    refuted(Mutation::ReleaseOnUnknown, UpstreamKeys::Honoured, props::NOTHING_RAN_IS_TRUE);
}

#[test]
fn acquired_decided_by_redis_alone_is_refuted() {
    refuted(Mutation::AcquiredByRedisAlone, UpstreamKeys::Ignored, props::AT_MOST_ONCE);
}

#[test]
fn caching_a_non_terminal_answer_is_refuted() {
    refuted(Mutation::CacheNonTerminal, UpstreamKeys::Honoured, props::FIRST_RESULT);
}

/// Lease renewal is no substitute for §5's lease rule: with Envoy waiting longer than the lease,
/// a SQL outage stops the renewals, the reconciler finds nothing upstream yet and releases, and
/// the upstream runs it after all.
#[test]
fn a_lease_shorter_than_envoys_wait_is_refuted() {
    refuted(Mutation::LeaseShorterThanEnvoyWait, UpstreamKeys::Honoured, props::NOTHING_RAN_IS_TRUE);
}

/// A `--status-reading` that calls a refusal by another word than the status endpoint's
/// (`failed=declined` where the endpoint says `"failed"`): the reconciler reads a committed refusal
/// as executed and writes DONE, and an agent is told `already_completed` about a payment that
/// never moved money.
#[test]
fn a_status_reading_that_misses_the_refusal_is_refuted() {
    refuted(Mutation::MisdeclaredReading, UpstreamKeys::Honoured, props::FAILED_IS_TRUE);
}

/// The design assumes the status endpoint shows a record within the reconciler's grace
/// (`Config::status_lag_s`, 1 s in the checks above). An endpoint whose index lags longer answers
/// 404 for a request that ran after Envoy gave up on it; past the grace the reconciler releases
/// the row, and a retry after `exp` is told `fingerprint_expired` about an operation that
/// executed. The model's lease outlasts the upstream's last act by two seconds, so a lag of 3 s
/// still holds in this world (docs/model.md, "A status endpoint that lags"); 4 s is refuted.
#[test]
fn a_status_endpoint_lagging_past_the_grace_is_refuted() {
    let cfg =
        Config { status_lag_s: 4, check_settle: false, reachability: false, ..Config::bounded(UpstreamKeys::Honoured) };
    // The whole check (about as fast as stopping at the counterexample): the lie is all that breaks.
    let outcome = check(cfg, threads()).expect("model");
    println!("{outcome}");
    let violated: Vec<&str> = outcome.violations.iter().map(|(p, _)| *p).collect();
    assert_eq!(violated, [props::NOTHING_RAN_IS_TRUE], "{outcome}");
}

/// Without the insert's `NOT EXISTS` over `idem_approval`, a retry on the scope's route that lacks
/// the rule runs what waits for a person.
#[test]
fn an_acquire_ignoring_the_approval_is_refuted() {
    let cfg = Config::bounded_approval(UpstreamKeys::Honoured);
    refuted_in(cfg, Mutation::AcquireIgnoresApproval, props::APPROVED_FIRST);
}

/// A decision past `exp` (before the sweep lapsed it) turns an operation an agent was told had
/// lapsed into a rejected one.
#[test]
fn a_decision_after_the_lapse_is_refuted() {
    let cfg = Config::bounded_approval(UpstreamKeys::Honoured);
    refuted_in(cfg, Mutation::DecideAfterLapse, props::VERDICT_KEPT);
}

/// The symmetry reduction is sound only if renaming the agents or the filters, or reordering the
/// streams, is a symmetry of the world: every renamed state has the renamed successors. Checked
/// on every 5th of the first 30,000 states the bounded world reaches, breadth first (to depth 9:
/// every kind of step occurs).
#[test]
fn renaming_agents_filters_or_streams_is_a_symmetry_of_the_world() {
    symmetry_of(Config::bounded(UpstreamKeys::Honoured));
}

/// The same with approval on: the approver, the sweep and the choice of route single out no
/// agent or filter either.
#[test]
fn renaming_is_a_symmetry_of_the_world_with_approval() {
    symmetry_of(Config::bounded_approval(UpstreamKeys::Honoured));
}

fn symmetry_of(cfg: Config) {
    let world = World::new(cfg).expect("model");
    let successors = |s: &State| -> std::collections::BTreeSet<u64> {
        let mut actions = Vec::new();
        world.enabled(s, s.faults < world.cfg.faults, true, &mut actions);
        let mut out = std::collections::BTreeSet::new();
        for a in actions {
            if let Some(next) = world.step(s, a) {
                out.insert(idem_model::hash::hash(&representative(&next)));
            }
        }
        out
    };
    let mut queue = std::collections::VecDeque::from([world.initial()]);
    let mut seen = std::collections::HashSet::new();
    let (mut visited, mut checked) = (0, 0);
    while let Some(s) = queue.pop_front() {
        if visited == 30_000 {
            break;
        }
        if !seen.insert(idem_model::hash::hash(&s)) {
            continue;
        }
        visited += 1;
        let mut actions = Vec::new();
        world.enabled(&s, s.faults < world.cfg.faults, true, &mut actions);
        queue.extend(actions.into_iter().filter_map(|a| world.step(&s, a)));
        if visited % 5 != 0 {
            continue;
        }
        checked += 1;
        let here = successors(&s);
        let mut reversed = s.clone();
        reversed.streams.reverse();
        reversed.orphans.reverse();
        for other in [renamed(&s, true, false), renamed(&s, false, true), renamed(&s, true, true), reversed] {
            assert_eq!(successors(&other), here, "a renaming of {s:?} has other successors");
        }
    }
    assert_eq!(checked, 6_000, "the bounded world has fewer states than the check expects");
}

/// Found by the model (the approval gate never looked at `idem_record`), now held: an operation
/// that ran on a route of its scope without the rule, then confirmed on the ruled route, is
/// answered from its row (the first result), never recorded for a person to approve, and nobody
/// can reject it afterwards.
#[test]
fn the_gate_answers_from_the_row_of_an_operation_that_already_ran() {
    use idem_model::config::Routes;
    use idem_model::world::Action;
    let cfg = Config { routes: Routes::Any, ..Config::bounded_approval(UpstreamKeys::Honoured) };
    let world = World::new(cfg).expect("model");
    let script = [
        Action::Confirm { agent: 0, filter: 0, ruled: false },
        Action::Idemd { stream: 0, crash: None },
        Action::Upstream { stream: 0, how: idem_model::world::Up::Execute },
        Action::Idemd { stream: 0, crash: None },
        Action::Confirm { agent: 1, filter: 1, ruled: true },
        Action::Idemd { stream: 0, crash: None },
    ];
    let mut path = vec![];
    let mut s = world.initial();
    for a in script {
        let next = world.step(&s, a).unwrap_or_else(|| panic!("{a:?} disabled in {s:?}"));
        path.push((s, Some(a)));
        s = next;
        // idemd serves a callout one store call per step: on to its answer.
        while let Action::Idemd { stream, .. } = a {
            let serving =
                matches!(s.streams.get(stream).map(|st| &st.wait), Some(Wait::Idemd(c)) if !c.progress.is_empty());
            if !serving {
                break;
            }
            let next = world.step(&s, a).unwrap_or_else(|| panic!("{a:?} disabled in {s:?}"));
            path.push((s, Some(a)));
            s = next;
        }
    }
    path.push((s.clone(), None));
    println!("{}", idem_model::report::trace(&world, &path));
    assert_eq!(s.upstream.executions, 1);
    let told = |agent: usize| s.agents[agent].last.as_ref().map(|t| t.answer.said);
    assert_eq!(told(0), Some(Said::Upstream), "agent 0 was told it executed");
    assert_eq!(told(1), Some(Said::Guard(ReplyKind::AlreadyCompleted)), "agent 1 gets the first result");
    assert!(s.stores.approval.is_none(), "no approval recorded for an operation that ran");
    assert!(world.step(&s, Action::Decide { approve: false }).is_none(), "nothing to reject");
    assert!(!s.ghost.told_nothing_ran_after_it_ran);
}

/// Found by the model once a replica's store calls interleave and the horizon reaches reaping
/// (docs/model.md "What the check found"): the lapse sweep takes "no `idem_record` row" for "nothing
/// executed", so an APPROVED operation that ran and whose record the reaper deleted first was then
/// marked LAPSED. The reaper now keeps a record while its approval row says APPROVED
/// (`rules::reapable`) and deletes approval rows first; with one second of skew, so that reaping falls
/// within the horizon, the check that found it passes.
#[test]
fn an_executed_approval_is_never_lapsed_once_its_record_is_reaped() {
    let cfg = Config {
        skew_ms: idem_model::config::world::SKEW_MS,
        check_settle: false,
        ..Config::bounded_approval(UpstreamKeys::Honoured)
    };
    let outcome = check(cfg, threads()).expect("model");
    println!("{outcome}");
    assert!(outcome.violations.is_empty(), "{outcome}");
}
