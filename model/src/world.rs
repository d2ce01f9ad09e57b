//! The world as one stateright model: its state, every action an actor or a fault can take, and
//! what each action does. One operation (the preview's nonce) is followed; agents, filters,
//! idemd, the stores, the upstream, the reconciler, the reaper and the clock act on it in every
//! order the checker can find.

use idem_core::machine::replay_cache::{self, Entry};
use idem_core::protocol::{encode_body, AcquireRequest, OpKey, StoredResult, TerminalState};
use idemd::reconcile::decide::{Asked, Decision, StatusAnswer};
use idemd::reconcile::settle::RowOutcome;
use idemd::store::flow::{Call, Next, Reply};
use idemd::store::rules;

use crate::config::{world, Config, Mutation};
use crate::filter::{self, Answer, Ev, Kind, Said};
use crate::idemd::{self as im, Ap, Progress, Row, St, Stepped, Stores};
use idem_core::reply::ReplyKind;

pub const FILTERS: u8 = 2;

/// What one agent was last told. Only the last answer is kept: the properties judge every
/// answer when it is given (`Ghost`), and what comes next reads only the last one (docs/model.md,
/// "Keeping the state small").
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Told {
    pub answer: Answer,
    /// Said in the current second (an unsettled agent asks again only after it).
    pub fresh: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Agent {
    pub confirms: u8,
    pub polls: u8,
    pub waiting: bool,
    pub last: Option<Told>,
}

impl Agent {
    /// Answers this agent got so far: one per request it no longer waits on.
    pub fn answers(&self) -> u8 {
        self.confirms + self.polls - u8::from(self.waiting)
    }
}

/// A callout to idemd and how far the replica serving it got.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Callout {
    pub method: String,
    pub path: String,
    pub body: Vec<u8>,
    /// The replies its store calls got so far (the flow stands at its next one).
    pub progress: Progress,
}

/// A callout its filter gave up on, still being served.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Orphan {
    pub callout: Callout,
    /// It may still reach idemd until this model second.
    pub until: u64,
}

/// The reconciler's pass over the row: the row as its select read it, and how far its flow got.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Pass {
    pub read: Row,
    pub progress: Progress,
    /// The flow's next call is the status lookup (which may fail).
    pub at_lookup: bool,
}

/// What a stream waits for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Wait {
    /// A callout to idemd, being served one store call at a time.
    Idemd(Callout),
    /// The request is upstream with this `Idempotency-Key`.
    Upstream,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Stream {
    pub filter: u8,
    pub agent: u8,
    pub kind: Kind,
    pub journal: Vec<Ev>,
    pub wait: Wait,
    /// The answer held until the record is acknowledged (the upstream's, or its rewrite).
    pub held: Option<Answer>,
    /// The acquire's binding, as the filter sent it.
    pub param_hash: Option<String>,
    /// Model second the request went upstream: the upstream answers, or Envoy times out, within
    /// its worst case (DESIGN §5: the lease is longer).
    pub forwarded_s: Option<u64>,
    /// The `Idempotency-Key` the filter sent upstream with it ("" for none).
    pub sent_key: Option<String>,
}

/// What the upstream did with a request it took in: ran it (execution `n`, money moved) or
/// refused it (422 insufficient_funds: committed as refused, nothing moved).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    Ran(u8),
    Refused,
}

/// One record of the upstream's, as its status endpoint shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct UpstreamRecord {
    pub outcome: Outcome,
    /// Its status endpoint answers 404 for it until this model second (`Config::status_lag_s`: the
    /// endpoint's index lags the upstream's writes); `None`: shown. Cleared by the tick that reaches
    /// it, so that only a record still hidden carries a time.
    pub shown_from: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Upstream {
    /// Executions so far; execution `n` answers `{"id":"T-<n>"}`.
    pub executions: u8,
    /// Refusals so far (each committed: its status endpoint reports it `failed`). Not executions:
    /// nothing moved (docs/model.md, "What a refusal counts as").
    pub refusals: u8,
    /// The record under the operation's business reference: the first execution, or a refusal
    /// while nothing under it ran.
    pub recorded: Option<UpstreamRecord>,
    /// What an upstream that honours keys did under each `Idempotency-Key` value it was sent: it
    /// deduplicates by the value, whatever it is, and answers the first outcome again (a refusal
    /// too).
    pub by_key: Vec<(String, UpstreamRecord)>,
    /// A request Envoy gave up on (timeout, a killed Envoy) that the upstream may still run,
    /// until this model second (the upstream's worst case).
    pub late_until: Option<u64>,
    /// The `Idempotency-Key` that late request carries.
    pub late_key: Option<String>,
}

impl Upstream {
    /// What the upstream did under `key` (its own deduplication: every record, shown or not).
    fn did(&self, key: &str) -> Option<Outcome> {
        self.by_key.iter().find(|(k, _)| k == key).map(|(_, r)| r.outcome)
    }

    /// What its status endpoint finds at `now_s`: by key (an upstream that honours keys) or by
    /// business reference (one that ignores them, `recorded`); a record it does not show yet is
    /// not found (404).
    pub fn found(&self, honoured: bool, key: &str, now_s: u64) -> Option<Outcome> {
        let record =
            if honoured { self.by_key.iter().find(|(k, _)| k == key).map(|(_, r)| r) } else { self.recorded.as_ref() };
        record.filter(|r| r.shown_from.is_none_or(|t| now_s >= t)).map(|r| r.outcome)
    }
}

/// What the checker remembers to judge the history, not part of any actor.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Ghost {
    /// The first terminal state and result the SQL row took.
    pub first_terminal: Option<(St, Option<String>)>,
    /// A terminal row was changed to another terminal state or result.
    pub overwritten: bool,
    /// An agent was told nothing ran (`not_executed`, `fingerprint_expired`) after the upstream ran it.
    pub told_nothing_ran_after_it_ran: bool,
    /// An agent was given a result other than the first execution's.
    pub told_another_result: bool,
    /// An agent was told the operation failed (`already_failed`, or the upstream's own 4xx).
    pub told_failed: bool,
    /// An agent was told it failed about an operation the upstream did not refuse or that ran, or
    /// told it ran while the upstream ran nothing; or it ran after an agent was told it failed.
    pub failed_misreported: bool,
    /// Approval: what the operation's approval came to, once it is final (REJECTED, or LAPSED /
    /// an agent told `approval_lapsed`): every later answer must say it.
    pub verdict: Option<Ap>,
    /// An agent was told something else about the operation after its verdict (or the verdict
    /// changed).
    pub verdict_contradicted: bool,
    /// The upstream ran the operation while its approval row was not APPROVED.
    pub ran_unapproved: bool,
    /// Paths reached so far ([`reached`]'s bits), for the `sometimes` properties.
    pub reached: u8,
}

/// The paths the `sometimes` properties ask for that no agent's answer shows.
pub mod reached {
    /// The reconciler released a row (the status endpoint proved it never ran).
    pub const RECONCILER_RELEASE: u8 = 1;
    /// The reaper deleted a terminal row.
    pub const REAP: u8 = 2;
    /// A filter answered from its replay cache.
    pub const REPLAY_CACHE_HIT: u8 = 4;
    /// The reconciler decided FAILED from the status endpoint's record.
    pub const RECONCILED_FAILED: u8 = 8;
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    pub now_s: u64,
    pub agents: Vec<Agent>,
    pub streams: Vec<Stream>,
    /// Each filter's replay cache (Envoy's shared data: the operation's slot).
    pub caches: Vec<Option<Vec<u8>>>,
    pub stores: Stores,
    pub upstream: Upstream,
    pub faults: u8,
    /// Callouts the filter gave up on that may still reach idemd.
    pub orphans: Vec<Orphan>,
    /// Each reconciler's pass in progress (one per idemd replica that reconciles: `Config::reconcilers`).
    pub passes: Vec<Option<Pass>>,
    /// Each reconciler ran in the current second (it runs once a second at most).
    pub reconciled: Vec<bool>,
    pub ghost: Ghost,
}

/// Where an idemd replica dies while serving a callout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Crash {
    /// Before its first store call: nothing done.
    Before,
    /// Right after this store call: its effect stands, the answer is lost.
    After,
}

/// How the upstream treats a request that reached it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Up {
    /// It runs (or, deduplicating by key, answers the first result) and answers 201.
    Execute,
    /// 503, nothing ran.
    Busy,
    /// 422: the upstream refuses the operation (nothing ran; the filter records FAILED). The
    /// refusal is committed: its status endpoint reports it `failed`.
    Refuse,
    /// It runs, then the connection drops before the answer (Envoy: reset).
    CommitThenReset,
    /// Envoy times out; the upstream may still run it (until its worst case).
    Timeout,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// `ruled`: on the route whose rule asks a person (approval on; the operation's first confirm
    /// always, every later one on either route of the scope).
    Confirm {
        agent: u8,
        filter: u8,
        ruled: bool,
    },
    Poll {
        agent: u8,
        filter: u8,
    },
    /// The replica serving stream `stream`'s callout makes its next store call (and, if that was
    /// the last, answers); `crash`: the replica dies there.
    Idemd {
        stream: usize,
        crash: Option<Crash>,
    },
    /// The next store call of a callout its filter already gave up on.
    Orphan(usize),
    Upstream {
        stream: usize,
        how: Up,
    },
    LateExecute,
    Tick,
    /// Reconciler `n`'s pass selects the row (its lease ran out) and claims it.
    ReconcileStart(u8),
    /// Reconciler `by`'s next call: the status lookup (`lookup_fails`: it fails) or a write.
    Reconcile {
        by: u8,
        lookup_fails: bool,
    },
    /// Reconciler `n` dies mid-row (the claim holds the row until it runs out).
    CrashReconciler(u8),
    Reap,
    /// The approver decides (`POST /v1/approvals/{key}`), at any moment, late ones too.
    Decide {
        approve: bool,
    },
    /// idemd's lapse sweep (the store probe's, every `--probe-interval-ms`).
    Lapse,
    /// The reaper deletes a decided approval row.
    ReapApproval,
    CrashFilter(u8),
    RedisFlush,
    RedisFailover,
    RedisDown,
    RedisUp,
    SqlDown,
    SqlUp,
}

impl Action {
    fn is_fault(self) -> bool {
        matches!(
            self,
            Action::Idemd { crash: Some(_), .. }
                | Action::CrashReconciler(_)
                | Action::Upstream { how: Up::Busy | Up::Refuse | Up::CommitThenReset | Up::Timeout, .. }
                | Action::Reconcile { lookup_fails: true, .. }
                | Action::CrashFilter(_)
                | Action::RedisFlush
                | Action::RedisFailover
                | Action::RedisDown
                | Action::SqlDown
        )
    }
}

pub struct World {
    pub cfg: Config,
    pub fingerprint: String,
    /// Hashes of states the fault-free completion is known to settle from (every state on a
    /// settling path settles too), so each is walked once.
    pub settling: std::sync::Mutex<std::collections::HashSet<u64>>,
}

impl World {
    pub fn new(cfg: Config) -> Result<World, String> {
        Ok(World { cfg, fingerprint: filter::preview_fingerprint()?, settling: Default::default() })
    }

    fn exp_s(&self) -> u64 {
        world::T0 + world::FINGERPRINT_TTL_S
    }

    pub fn initial(&self) -> State {
        State {
            now_s: 0,
            agents: vec![Agent::default(); usize::from(self.cfg.agents)],
            streams: Vec::new(),
            caches: vec![None; usize::from(FILTERS)],
            stores: Stores::default(),
            upstream: Upstream::default(),
            faults: 0,
            orphans: Vec::new(),
            passes: vec![None; usize::from(self.cfg.reconcilers)],
            reconciled: vec![false; usize::from(self.cfg.reconcilers)],
            ghost: Ghost::default(),
        }
    }

    /// Every action enabled in `s`; `faults`: whether faults may still happen.
    pub fn enabled(&self, s: &State, faults: bool, budgets: bool, out: &mut Vec<Action>) {
        let cfg = &self.cfg;
        for (i, a) in s.agents.iter().enumerate() {
            let agent = u8::try_from(i).unwrap_or(0);
            if a.waiting {
                continue;
            }
            // With approval, confirms take the route with the rule; by default, once the operation
            // waits (its approval row exists), they may take the scope's route without it too: the
            // case the SQL defence claims ("a route of the same scope that lacks the rule cannot run
            // it either once it waits", docs/approvals.md). Before that, such a route runs it without
            // a person, which is why one scope has one rule (`Routes::Any` shows it).
            use crate::config::Routes;
            let routes: &[bool] = match (cfg.approval, cfg.routes, s.stores.approval.is_some()) {
                (false, _, _) => &[false],
                (true, Routes::Ruled, _) | (true, Routes::RuledFirst, false) => &[true],
                (true, Routes::RuledFirst, true) | (true, Routes::Any, _) => &[true, false],
            };
            for filter in 0..FILTERS {
                if !budgets || a.confirms < cfg.confirms {
                    for &ruled in routes {
                        out.push(Action::Confirm { agent, filter, ruled });
                    }
                }
                if (!budgets || a.polls < cfg.polls) && a.last.is_some() {
                    out.push(Action::Poll { agent, filter });
                }
            }
        }
        for (i, st) in s.streams.iter().enumerate() {
            match &st.wait {
                Wait::Idemd(c) => {
                    out.push(Action::Idemd { stream: i, crash: None });
                    if faults {
                        if !c.progress.iter().any(made) {
                            out.push(Action::Idemd { stream: i, crash: Some(Crash::Before) });
                        }
                        out.push(Action::Idemd { stream: i, crash: Some(Crash::After) });
                    }
                }
                Wait::Upstream => {
                    out.push(Action::Upstream { stream: i, how: Up::Execute });
                    if faults {
                        for how in [Up::Busy, Up::Refuse, Up::CommitThenReset, Up::Timeout] {
                            out.push(Action::Upstream { stream: i, how });
                        }
                    }
                }
            }
        }
        if s.upstream.late_until.is_some() {
            out.push(Action::LateExecute);
        }
        for i in 0..s.orphans.len() {
            out.push(Action::Orphan(i));
        }
        // Time cannot pass Envoy's wait for the upstream: by then it answered or Envoy timed out.
        let wait = if cfg.is(Mutation::LeaseShorterThanEnvoyWait) {
            world::ENVOY_WAIT_TOO_LONG_S
        } else {
            world::ENVOY_WAIT_S
        };
        let bounded = s
            .streams
            .iter()
            .all(|st| st.wait != Wait::Upstream || st.forwarded_s.is_none_or(|f| s.now_s < f + u64::from(wait)));
        if bounded && (!budgets || s.now_s < u64::from(cfg.horizon_s)) {
            out.push(Action::Tick);
        }
        // Each reconciler judges "expired" by its own replica's clock.
        let reconcilable =
            |n: u8| {
                s.stores.sql.as_ref().is_some_and(|r| {
                    r.state == St::InFlight && rules::claimable(&r.record(), now_ms(self.clock_of(s, n)))
                }) && !s.stores.sql_down
            };
        for (n, pass) in (0u8..).zip(&s.passes) {
            match pass {
                None if reconcilable(n) && !s.reconciled[usize::from(n)] => out.push(Action::ReconcileStart(n)),
                None => {}
                Some(p) => {
                    out.push(Action::Reconcile { by: n, lookup_fails: false });
                    if faults && p.at_lookup {
                        out.push(Action::Reconcile { by: n, lookup_fails: true });
                    }
                    if faults {
                        out.push(Action::CrashReconciler(n));
                    }
                }
            }
        }
        if s.stores.sql.as_ref().is_some_and(|r| matches!(r.state, St::Done | St::Failed)) {
            out.push(Action::Reap);
        }
        if let Some(a) = s.stores.approval.as_ref().filter(|_| !s.stores.sql_down) {
            if a.state == Ap::Awaiting {
                out.push(Action::Decide { approve: true });
                out.push(Action::Decide { approve: false });
            }
            let open = matches!(a.state, Ap::Awaiting | Ap::Approved);
            if open && s.stores.sql.is_none() && now_ms(s.now_s) >= a.fp_exp_ms {
                out.push(Action::Lapse);
            }
            if a.state != Ap::Awaiting {
                out.push(Action::ReapApproval);
            }
        }
        if s.stores.redis_down {
            out.push(Action::RedisUp);
        }
        if s.stores.sql_down {
            out.push(Action::SqlUp);
        }
        if faults {
            for f in 0..FILTERS {
                if s.streams.iter().any(|st| st.filter == f) || s.caches[usize::from(f)].is_some() {
                    out.push(Action::CrashFilter(f));
                }
            }
            if s.stores.redis.is_some() {
                out.push(Action::RedisFlush);
            }
            if s.stores.redis_before.is_some() {
                out.push(Action::RedisFailover);
            }
            if !s.stores.redis_down {
                out.push(Action::RedisDown);
            }
            if !s.stores.sql_down {
                out.push(Action::SqlDown);
            }
        }
    }

    pub fn step(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        if action.is_fault() {
            s.faults += 1;
        }
        let now = world::T0 + s.now_s;
        match action {
            Action::Confirm { agent, filter, ruled } => {
                // The operation's first confirm carries the memo as previewed; every later one (a
                // retry, the other agent's) was regenerated. A rule of the world, not of an agent, so
                // that the agents stay alike (the symmetry reduction, docs/model.md).
                let drifted = s.agents.iter().any(|a| a.confirms > 0);
                let a = &mut s.agents[usize::from(agent)];
                a.confirms += 1;
                a.waiting = true;
                if self.cfg.is(Mutation::ExpiryBeforeLookup) && now >= self.exp_s() {
                    // The broken host refuses before asking what exists.
                    let answer =
                        Answer { http: 410, said: Said::Guard(ReplyKind::FingerprintExpired), execution: None };
                    self.tell(&mut s, agent, answer);
                } else {
                    self.start(&mut s, agent, filter, Kind::Confirm { drifted, ruled });
                }
            }
            Action::Poll { agent, filter } => {
                let a = &mut s.agents[usize::from(agent)];
                a.polls += 1;
                a.waiting = true;
                self.start(&mut s, agent, filter, Kind::Status);
            }
            Action::Idemd { stream, crash } => {
                let Wait::Idemd(mut c) = s.streams[stream].wait.clone() else { return None };
                let stepped = match crash {
                    Some(Crash::Before) => None,
                    _ => Some(self.serve(&mut s, &mut c)?),
                };
                match (stepped, crash) {
                    (Some(Stepped::Waiting), None) => s.streams[stream].wait = Wait::Idemd(c),
                    (Some(Stepped::Answered((status, body))), None) => {
                        self.feed(&mut s, stream, Ev::Callout { now_s: now, status: Some(status), body });
                    }
                    // The replica died: the filter's callout fails.
                    _ => self.feed(&mut s, stream, Ev::Callout { now_s: now, status: None, body: Vec::new() }),
                }
            }
            Action::Upstream { stream, how } => {
                let key = s.streams[stream].sent_key.clone();
                let ev = match how {
                    // Refuse: it commits a refusal. Either way an upstream that honours keys answers
                    // what it did under the key before (a refusal again, or the first result).
                    Up::Execute | Up::Refuse => match self.execute(&mut s, key.as_deref(), how == Up::Refuse) {
                        Outcome::Ran(n) => {
                            Ev::Response { now_s: now, status: 201, details: "via_upstream", body: transfer(n) }
                        }
                        Outcome::Refused => Ev::Response {
                            now_s: now,
                            status: 422,
                            details: "via_upstream",
                            body: br#"{"error":"insufficient_funds"}"#.to_vec(),
                        },
                    },
                    Up::Busy => Ev::Response {
                        now_s: now,
                        status: 503,
                        details: "via_upstream",
                        body: br#"{"error":"busy"}"#.to_vec(),
                    },
                    Up::CommitThenReset => {
                        self.execute(&mut s, key.as_deref(), false);
                        self.envoy_reply(now, "upstream_reset_before_response_started{connection_termination}")
                    }
                    Up::Timeout => {
                        s.upstream.late_until = Some(s.now_s + u64::from(world::UPSTREAM_WORST_S));
                        s.upstream.late_key = key;
                        self.envoy_reply(now, "upstream_response_timeout")
                    }
                };
                self.feed(&mut s, stream, ev);
            }
            Action::Orphan(i) => {
                let mut o = s.orphans.remove(i);
                if let Stepped::Waiting = self.serve(&mut s, &mut o.callout)? {
                    s.orphans.push(o);
                }
            }
            Action::LateExecute => {
                s.upstream.late_until = None;
                let key = s.upstream.late_key.take();
                self.execute(&mut s, key.as_deref(), false);
            }
            Action::Tick => {
                // A callout still out when time passes has hit the filter's sidecar timeout (shorter
                // than a second here): it fails, whatever became of it.
                for i in (0..s.streams.len()).rev() {
                    if let Wait::Idemd(c) = &s.streams[i].wait {
                        let until = s.now_s + u64::from(world::ORPHAN_S);
                        s.orphans.push(Orphan { callout: c.clone(), until });
                        let failed = Ev::Callout { now_s: now, status: None, body: Vec::new() };
                        self.feed(&mut s, i, failed);
                    }
                }
                s.now_s += 1;
                s.reconciled.iter_mut().for_each(|r| *r = false);
                for a in &mut s.agents {
                    if let Some(t) = &mut a.last {
                        t.fresh = false;
                    }
                }
                self.tick(&mut s);
            }
            Action::ReconcileStart(n) => {
                *s.reconciled.get_mut(usize::from(n))? = true;
                let read = s.stores.sql.clone()?;
                let mut pass = Pass { read, progress: Vec::new(), at_lookup: false };
                self.reconcile(&mut s, n, &mut pass, false);
            }
            Action::Reconcile { by, lookup_fails } => {
                let mut pass = s.passes.get_mut(usize::from(by))?.take()?;
                self.reconcile(&mut s, by, &mut pass, lookup_fails);
            }
            Action::CrashReconciler(n) => *s.passes.get_mut(usize::from(n))? = None,
            Action::Reap => {
                if !im::reap(&mut s.stores, s.now_s, &self.cfg) {
                    return None;
                }
                s.ghost.reached |= reached::REAP;
            }
            Action::Decide { approve } => {
                if !im::decide(&mut s.stores, s.now_s, &self.cfg, approve) {
                    // Refused (decided already, lapsed): nothing changed.
                    return None;
                }
            }
            Action::Lapse => {
                if !im::lapse(&mut s.stores, s.now_s) {
                    return None;
                }
            }
            Action::ReapApproval => {
                if !im::reap_approval(&mut s.stores, s.now_s) {
                    return None;
                }
            }
            Action::CrashFilter(f) => {
                s.caches[usize::from(f)] = None;
                let (gone, kept): (Vec<Stream>, Vec<Stream>) = s.streams.drain(..).partition(|st| st.filter == f);
                s.streams = kept;
                for st in gone {
                    if st.wait == Wait::Upstream {
                        // Envoy is gone; the request it sent may still run.
                        s.upstream.late_until = Some(s.now_s + u64::from(world::UPSTREAM_WORST_S));
                        s.upstream.late_key = st.sent_key.clone();
                    }
                    let reset = Answer::without(Said::Reset);
                    self.tell(&mut s, st.agent, reset);
                }
            }
            Action::RedisFlush => {
                s.stores.redis = None;
                s.stores.redis_before = None;
            }
            Action::RedisFailover => {
                s.stores.redis = s.stores.redis_before.take().flatten();
            }
            Action::RedisDown => s.stores.redis_down = true,
            Action::RedisUp => s.stores.redis_down = false,
            Action::SqlDown => s.stores.sql_down = true,
            Action::SqlUp => s.stores.sql_down = false,
        }
        Self::judge(&mut s);
        if s.faults >= self.cfg.faults {
            // Only a failover (a fault) reads the write it would lose.
            s.stores.redis_before = None;
        }
        Some(s)
    }

    /// One store call of idemd's flow for `c` (`None`: idemd does not serve it).
    fn serve(&self, s: &mut State, c: &mut Callout) -> Option<Stepped<(u16, Vec<u8>)>> {
        let flow = im::callout_flow(&self.cfg, &c.method, &c.path, &c.body)?;
        let none = |_: &idemd::store::record::Record| Asked::NoEndpoint;
        Some(im::step(flow, &mut c.progress, &mut s.stores, s.now_s, &self.cfg, &none))
    }

    /// Reconciler `n`'s replica's clock (seconds): reconciler 1's runs `Config::clock_ahead_s` ahead.
    fn clock_of(&self, s: &State, n: u8) -> u64 {
        if n == 1 {
            s.now_s + u64::from(self.cfg.clock_ahead_s)
        } else {
            s.now_s
        }
    }

    /// One call of the reconciler's pass. The status endpoint answers what the upstream did
    /// (`done` with the execution's id, `failed` for a refusal) or 404 (nothing under the key or
    /// the reference, or a record its index does not show yet: `Config::status_lag_s`), unless
    /// the lookup fails (a fault).
    fn reconcile(&self, s: &mut State, by: u8, pass: &mut Pass, lookup_fails: bool) {
        let upstream = s.upstream.clone();
        let now_s = s.now_s;
        let cfg = &self.cfg;
        let honoured = cfg.upstream == crate::config::UpstreamKeys::Honoured;
        let lookup = |rec: &idemd::store::record::Record| {
            // The upstream's record carries the transfer's fields, the reference's too.
            let record = |what: String| StatusAnswer::Found {
                content_type: Some("application/json".into()),
                body: format!(
                    r#"{{{what},"amount":"10.00","currency":"EUR","ref":"{}"}}"#,
                    crate::filter::BUSINESS_REF
                )
                .into_bytes(),
            };
            let answer = match (lookup_fails, upstream.found(honoured, &rec.key, now_s)) {
                (true, _) => StatusAnswer::Failed("timed out".into()),
                (false, Some(Outcome::Ran(n))) => record(format!(r#""status":"done","id":"T-{n}""#)),
                (false, Some(Outcome::Refused)) => {
                    record(r#""status":"failed","error":"insufficient_funds""#.to_string())
                }
                (false, None) => StatusAnswer::NotFound,
            };
            im::asked(cfg, rec, answer)
        };
        let flow = im::settle_flow(cfg, &pass.read.record());
        let now_s = self.clock_of(s, by);
        match im::step(flow, &mut pass.progress, &mut s.stores, now_s, cfg, &lookup) {
            Stepped::Waiting => {
                let (_, next) = im::settle_flow(cfg, &pass.read.record()).replayed(&pass.progress);
                pass.at_lookup = matches!(next, Next::Call(Call::Lookup { .. }));
                if let Some(slot) = s.passes.get_mut(usize::from(by)) {
                    *slot = Some(pass.clone());
                }
            }
            Stepped::Answered(RowOutcome::Decided(Decision::Release, _)) => {
                s.ghost.reached |= reached::RECONCILER_RELEASE
            }
            Stepped::Answered(RowOutcome::Decided(Decision::Failed(_), _)) => {
                s.ghost.reached |= reached::RECONCILED_FAILED
            }
            Stepped::Answered(_) => {}
        }
    }

    /// The upstream takes a request in: it runs it (execution `n`) or, `refuse`, commits a
    /// refusal; an upstream that honours keys answers what it did under that `Idempotency-Key`
    /// value before, and takes in anything it has not seen (no key is a new request each time).
    /// The record is hidden from its status endpoint for `Config::status_lag_s` seconds.
    fn execute(&self, s: &mut State, key: Option<&str>, refuse: bool) -> Outcome {
        let up = &mut s.upstream;
        let honoured = self.cfg.upstream == crate::config::UpstreamKeys::Honoured;
        let key = key.filter(|k| honoured && !k.is_empty());
        if let Some(done) = key.and_then(|k| up.did(k)) {
            return done;
        }
        let outcome = if refuse {
            up.refusals += 1;
            Outcome::Refused
        } else {
            up.executions += 1;
            Outcome::Ran(up.executions)
        };
        let lag = u64::from(self.cfg.status_lag_s);
        let record = UpstreamRecord { outcome, shown_from: (lag > 0).then_some(s.now_s + lag) };
        // Under the reference: the first execution; a refusal only while nothing under it ran.
        if up.recorded.is_none_or(|r| r.outcome == Outcome::Refused && !refuse) {
            up.recorded = Some(record);
        }
        if let Some(k) = key {
            up.by_key.push((k.to_string(), record));
        }
        if !refuse {
            if self.cfg.approval && s.stores.approval.as_ref().is_none_or(|a| a.state != Ap::Approved) {
                s.ghost.ran_unapproved = true;
            }
            if s.ghost.told_failed {
                s.ghost.failed_misreported = true;
            }
        }
        outcome
    }

    fn envoy_reply(&self, now: u64, details: &'static str) -> Ev {
        if self.cfg.is(Mutation::ReleaseOnUnknown) {
            // The broken host reads a reset or a timeout as "never sent".
            return Ev::Response {
                now_s: now,
                status: 503,
                details: "no_healthy_upstream",
                body: b"no healthy upstream".to_vec(),
            };
        }
        let status = if details == "upstream_response_timeout" { 504 } else { 503 };
        Ev::Response { now_s: now, status, details, body: b"upstream connect error".to_vec() }
    }

    fn tick(&self, s: &mut State) {
        // The filters renew the leases of requests still upstream (LeaseBook), SQL first.
        {
            let leases: Vec<_> = s
                .streams
                .iter()
                .filter_map(|st| filter::replayed(st.kind, &self.fingerprint, self.cfg.upstream, &st.journal).lease)
                .collect();
            for lease in leases {
                let _ = im::run_through(im::renew_flow(&self.cfg, lease), &mut s.stores, s.now_s, &self.cfg);
            }
        }
        if s.stores.redis.as_ref().is_some_and(|c| s.now_s >= c.until_s) {
            s.stores.redis = None;
        }
        if s.upstream.late_until.is_some_and(|t| s.now_s > t) {
            s.upstream.late_until = None;
            s.upstream.late_key = None;
        }
        // A record the status endpoint shows from now on no longer needs its time.
        let now_s = s.now_s;
        let up = &mut s.upstream;
        for r in up.recorded.iter_mut().chain(up.by_key.iter_mut().map(|(_, r)| r)) {
            if r.shown_from.is_some_and(|t| now_s >= t) {
                r.shown_from = None;
            }
        }
        s.orphans.retain(|o| s.now_s <= o.until);
        // An expired replay-cache entry is a miss to every lookup (`replay_cache::lookup`), the
        // only reader of the slot: drop it, so it no longer tells states apart.
        let now = world::T0 + s.now_s;
        for slot in &mut s.caches {
            let expired =
                slot.as_deref().and_then(|v| serde_json::from_slice::<Entry>(v).ok()).is_none_or(|e| now >= e.until);
            if expired {
                *slot = None;
            }
        }
    }

    fn start(&self, s: &mut State, agent: u8, filter: u8, kind: Kind) {
        let cached = s.caches[usize::from(filter)].clone();
        let stream = Stream {
            filter,
            agent,
            kind,
            journal: Vec::new(),
            wait: Wait::Upstream,
            held: None,
            param_hash: None,
            forwarded_s: None,
            sent_key: None,
        };
        s.streams.push(stream);
        let i = s.streams.len() - 1;
        self.feed(s, i, Ev::Start { now_s: world::T0 + s.now_s, cached });
    }

    /// Feed one event to a stream's machine and carry out its effects as the adapter does.
    fn feed(&self, s: &mut State, i: usize, ev: Ev) {
        let is_response = matches!(ev, Ev::Response { .. });
        if let Ev::Response { status, body, .. } = &ev {
            s.streams[i].held = Some(Answer::upstream(*status, body));
        }
        s.streams[i].journal.push(ev);
        let st = &s.streams[i];
        let eff = filter::replayed(st.kind, &self.fingerprint, self.cfg.upstream, &st.journal).effects;
        let f = usize::from(st.filter);
        if let Some(v) = eff.shared_set.clone() {
            s.caches[f] = Some(v);
        }
        if eff.replay_cache_hit {
            s.ghost.reached |= reached::REPLAY_CACHE_HIT;
        }
        if self.cfg.is(Mutation::CacheNonTerminal) && eff.unknown_outcome {
            self.cache_non_terminal(s, i);
        }
        let st = &mut s.streams[i];
        if let Some(r) = eff.rewrite.clone() {
            st.held = Some(r);
        }
        if let Some(reply) = eff.reply {
            let agent = st.agent;
            s.streams.remove(i);
            self.tell(s, agent, reply);
            return;
        }
        if let Some(call) = eff.call {
            if call.path == "/v1/acquire" {
                st.param_hash = call
                    .body
                    .as_deref()
                    .and_then(|b| serde_json::from_slice::<AcquireRequest>(b).ok())
                    .map(|r| r.param_hash);
            }
            st.wait = Wait::Idemd(Callout {
                method: call.method.to_string(),
                path: call.path,
                body: call.body.unwrap_or_default(),
                progress: Vec::new(),
            });
            return;
        }
        if eff.forward.is_some() {
            st.sent_key = eff.forward.clone();
            st.wait = Wait::Upstream;
            st.forwarded_s = Some(s.now_s);
            return;
        }
        if eff.resume_response || (is_response && eff.flow == Some(idem_core::machine::Flow::Continue)) {
            let agent = st.agent;
            let held = st.held.clone().unwrap_or(Answer::without(Said::Nothing));
            s.streams.remove(i);
            self.tell(s, agent, held);
            return;
        }
        let rebuilt = filter::rebuild(st.kind, &self.fingerprint, self.cfg.upstream, &st.journal);
        panic!("stream left with nothing to wait for after {:?}", rebuilt.last);
    }

    /// The mutation [`Mutation::CacheNonTerminal`]: the answer given on an unknown outcome (the
    /// rewritten `in_progress`) is cached as if it were the operation's result.
    fn cache_non_terminal(&self, s: &mut State, i: usize) {
        let st = &s.streams[i];
        let (Ok(key), Some(param_hash)) = (OpKey::parse(&crate::idemd::key()), st.param_hash.clone()) else { return };
        let result =
            StoredResult { status: 202, headers: vec![], body_b64: encode_body(br#"{"status":"in_progress"}"#) };
        let entry = Entry {
            key,
            state: TerminalState::Done,
            param_hash,
            subject_hash: filter::subject(),
            scope: filter::SCOPE.into(),
            result,
            until: world::T0 + s.now_s + world::RETENTION_MS / 1000,
        };
        s.caches[usize::from(st.filter)] = replay_cache::store(&Default::default(), &entry).and_then(|e| match e {
            idem_core::machine::Effect::SharedSet { value, .. } => Some(value),
            _ => None,
        });
    }

    fn tell(&self, s: &mut State, agent: u8, answer: Answer) {
        if answer.says_nothing_ran() && s.upstream.executions > 0 {
            s.ghost.told_nothing_ran_after_it_ran = true;
        }
        if answer.is_result() && answer.execution != Some(1) {
            s.ghost.told_another_result = true;
        }
        // Failed only about a refusal of an operation that never ran; ran only about one that ran.
        if answer.says_failed() {
            s.ghost.told_failed = true;
            if s.upstream.refusals == 0 || s.upstream.executions > 0 {
                s.ghost.failed_misreported = true;
            }
        }
        if answer.is_result() && s.upstream.executions == 0 {
            s.ghost.failed_misreported = true;
        }
        if self.cfg.approval && !answer.is_unknowing() {
            const REJECTED: Said = Said::Guard(ReplyKind::Rejected);
            const LAPSED: Said = Said::Guard(ReplyKind::ApprovalLapsed);
            match (s.ghost.verdict, answer.said) {
                (None, REJECTED) => s.ghost.verdict = Some(Ap::Rejected),
                (None, LAPSED) => s.ghost.verdict = Some(Ap::Lapsed),
                (None, _) | (Some(Ap::Rejected), REJECTED) | (Some(Ap::Lapsed), LAPSED) => {}
                // A release's answer (nothing ran, retry) that crossed the sweep: true, and the
                // retry hears approval_lapsed. Only lapsing can cross a release: a reject needs the
                // row AWAITING, and then no IN_FLIGHT row exists to release.
                (Some(Ap::Lapsed), Said::Guard(ReplyKind::NotExecuted)) => {}
                (Some(_), _) => s.ghost.verdict_contradicted = true,
            }
        }
        let a = &mut s.agents[usize::from(agent)];
        a.waiting = false;
        a.last = Some(Told { answer, fresh: true });
    }

    /// Update what the checker remembers about the history.
    fn judge(s: &mut State) {
        if let Some(a) = &s.stores.approval {
            let final_state = matches!(a.state, Ap::Rejected | Ap::Lapsed).then_some(a.state);
            match (s.ghost.verdict, final_state) {
                (_, None) => {}
                (None, v) => s.ghost.verdict = v,
                (Some(was), Some(now)) if was != now => s.ghost.verdict_contradicted = true,
                (Some(_), Some(_)) => {}
            }
        }
        if let Some(row) = &s.stores.sql {
            if matches!(row.state, St::Done | St::Failed) {
                let now = (row.state, row.result.clone());
                match &s.ghost.first_terminal {
                    None => s.ghost.first_terminal = Some(now),
                    Some(first) if *first != now => s.ghost.overwritten = true,
                    Some(_) => {}
                }
            }
        }
    }
}

/// A reply to a store call, not to the clock or the token counter: a store call was made.
fn made(r: &Reply) -> bool {
    !matches!(r, Reply::Now(_) | Reply::Owner(_))
}

fn now_ms(now_s: u64) -> i64 {
    crate::idemd::ms_of(now_s)
}

fn transfer(n: u8) -> Vec<u8> {
    format!(r#"{{"id":"T-{n}","amount":"10.00"}}"#).into_bytes()
}
