//! idemd's replicas in the model: the flows idemd runs (`idemd::store::flow`, the reconciler's
//! `idemd::reconcile::settle`), driven one store call at a time over the model's Redis and SQL.
//!
//! The model holds no copy of idemd's orchestration. What it has of its own is the stores: each
//! [`Call`] a flow makes is carried out here on [`Stores`] by the store rules
//! (`idemd::store::rules`, tied to the real SQL and Lua by `sidecar/tests/store_rules.rs`).
//! A flow in progress is the replies its calls got so far ([`Progress`]): the flows are
//! deterministic in their replies, so it is rebuilt by replaying them, as a filter's machine is
//! rebuilt from its journal.

use idem_core::protocol::{
    self, AckResponse, AcquireOutcome, AcquireRequest, ApprovalState, CompleteRequest, LeaseRenewal, OpState,
    ReleaseRequest, StoredResult,
};
use idemd::reconcile::decide::{Asked, Reading, Rules, StatusAnswer};
use idemd::reconcile::settle::{settle, RowOutcome, SettleSettings};
use idemd::reconcile::target::target;
use idemd::store::flow::acquire::Settings;
use idemd::store::flow::write::{self, Lookup};
use idemd::store::flow::{acquire, Call, Flow, Next, Reply, SqlAnswer, SqlFail};
use idemd::store::record::{ApprovalRow, Record};
use idemd::store::rules::{self, Broken, Cached, Completion, Ttl};
use idemd::store::StoreSettings;

use crate::config::{world, Config, Mutation, UpstreamKeys};

/// The operation key (the preview's nonce).
pub fn key() -> String {
    hex(&crate::filter::NONCE)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// An owner token (32 hex), numbered: acquires 1, 2, …; reconciler claims from 0x80.
pub fn owner(n: u8) -> String {
    format!("{n:032x}")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum St {
    InFlight,
    Done,
    Failed,
    NeedsReview,
}

impl St {
    pub fn of(s: OpState) -> St {
        match s {
            OpState::InFlight => St::InFlight,
            OpState::Done => St::Done,
            OpState::Failed => St::Failed,
            OpState::NeedsReview => St::NeedsReview,
        }
    }
    pub fn op(self) -> OpState {
        match self {
            St::InFlight => OpState::InFlight,
            St::Done => OpState::Done,
            St::Failed => OpState::Failed,
            St::NeedsReview => OpState::NeedsReview,
        }
    }
}

/// The `idem_record` row (a hashable mirror of `Record`; the result as its JSON).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Row {
    pub state: St,
    pub param_hash: String,
    pub owner: Option<String>,
    pub result: Option<String>,
    pub lease_until_ms: Option<i64>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    pub attempts: i64,
    pub fp_exp_ms: Option<i64>,
    pub ignores_keys: bool,
    pub business_ref: Option<String>,
}

impl Row {
    pub fn record(&self) -> Record {
        Record {
            key: key(),
            state: self.state.op(),
            param_hash: self.param_hash.clone(),
            subject_hash: crate::filter::subject(),
            scope: crate::filter::SCOPE.into(),
            owner: self.owner.clone(),
            result: self.result.as_deref().and_then(|r| serde_json::from_str(r).ok()),
            lease_until_ms: self.lease_until_ms,
            created_at_ms: self.created_at_ms,
            updated_at_ms: self.updated_at_ms,
            reconcile_attempts: self.attempts,
            fp_exp_ms: self.fp_exp_ms,
            upstream_ignores_keys: self.ignores_keys,
            business_ref: self.business_ref.clone(),
            bound_fields: self.business_ref.as_ref().map(|_| crate::filter::fields()),
        }
    }

    pub fn of(rec: &Record) -> Row {
        Row {
            state: St::of(rec.state),
            param_hash: rec.param_hash.clone(),
            owner: rec.owner.clone(),
            result: rec.result.as_ref().and_then(|r| serde_json::to_string(r).ok()),
            lease_until_ms: rec.lease_until_ms,
            created_at_ms: rec.created_at_ms,
            updated_at_ms: rec.updated_at_ms,
            attempts: rec.reconcile_attempts,
            fp_exp_ms: rec.fp_exp_ms,
            ignores_keys: rec.upstream_ignores_keys,
            business_ref: rec.business_ref.clone(),
        }
    }
}

/// `idem_approval.state` (a hashable mirror of `ApprovalState`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Ap {
    Awaiting,
    Approved,
    Rejected,
    Lapsed,
}

impl Ap {
    pub fn of(s: ApprovalState) -> Ap {
        match s {
            ApprovalState::AwaitingApproval => Ap::Awaiting,
            ApprovalState::Approved => Ap::Approved,
            ApprovalState::Rejected => Ap::Rejected,
            ApprovalState::Lapsed => Ap::Lapsed,
        }
    }
    pub fn state(self) -> ApprovalState {
        match self {
            Ap::Awaiting => ApprovalState::AwaitingApproval,
            Ap::Approved => ApprovalState::Approved,
            Ap::Rejected => ApprovalState::Rejected,
            Ap::Lapsed => ApprovalState::Lapsed,
        }
    }
}

/// The `idem_approval` row (a hashable mirror of `ApprovalRow`). In SQL only, never in Redis.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Approval {
    pub state: Ap,
    pub param_hash: String,
    pub fields: String,
    pub fp_exp_ms: i64,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    pub decided_by: Option<String>,
    pub reason: Option<String>,
}

impl Approval {
    pub fn row(&self) -> ApprovalRow {
        ApprovalRow {
            key: key(),
            state: self.state.state(),
            param_hash: self.param_hash.clone(),
            subject_hash: crate::filter::subject(),
            scope: crate::filter::SCOPE.into(),
            fields: self.fields.clone(),
            fp_exp_ms: self.fp_exp_ms,
            created_at_ms: self.created_at_ms,
            updated_at_ms: self.updated_at_ms,
            decided_by: self.decided_by.clone(),
            reason: self.reason.clone(),
        }
    }

    pub fn of(row: &ApprovalRow) -> Approval {
        Approval {
            state: Ap::of(row.state),
            param_hash: row.param_hash.clone(),
            fields: row.fields.clone(),
            fp_exp_ms: row.fp_exp_ms,
            created_at_ms: row.created_at_ms,
            updated_at_ms: row.updated_at_ms,
            decided_by: row.decided_by.clone(),
            reason: row.reason.clone(),
        }
    }
}

/// The Redis hash `idem:{key}` and its TTL.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CacheRow {
    pub state: St,
    pub param_hash: String,
    pub owner: Option<String>,
    pub result: Option<String>,
    /// Model second at which the key expires.
    pub until_s: u64,
    /// Model second the lease was (re)set: the age an IN_FLIGHT answer reports.
    pub set_s: u64,
}

impl CacheRow {
    fn cached(&self) -> Cached {
        Cached {
            state: self.state.op(),
            param_hash: self.param_hash.clone(),
            subject_hash: crate::filter::subject(),
            scope: crate::filter::SCOPE.into(),
            owner: self.owner.clone(),
            result: self.result.clone(),
        }
    }
    fn of(c: &Cached, until_s: u64, set_s: u64) -> CacheRow {
        CacheRow {
            state: St::of(c.state),
            param_hash: c.param_hash.clone(),
            owner: c.owner.clone(),
            result: c.result.clone(),
            until_s,
            set_s,
        }
    }
}

/// Redis and SQL.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Stores {
    pub sql: Option<Row>,
    /// The `idem_approval` row, where the route asks a person first.
    pub approval: Option<Approval>,
    pub redis: Option<CacheRow>,
    /// The value before Redis's last write: what a failover that lost that write brings back.
    pub redis_before: Option<Option<CacheRow>>,
    pub sql_down: bool,
    pub redis_down: bool,
    /// Owner tokens handed out so far (acquires and claims).
    pub owners: u8,
}

/// What one flow has done so far: the replies its calls got, in order (its time readings and
/// owner tokens too). The flow stands at its next store call.
pub type Progress = Vec<Reply>;

/// How a step of a flow ended.
pub enum Stepped<T> {
    /// It waits for its next store call.
    Waiting,
    Answered(T),
}

const STALE_IN_FLIGHT_MS: u64 = 1_000;
/// How long the reconciler's claim holds a row.
pub const CLAIM_MS: u64 = 1_000;

pub fn ms_of(s: u64) -> i64 {
    ms(s)
}

fn ms(s: u64) -> i64 {
    i64::try_from((world::T0 + s) * 1000).unwrap_or(i64::MAX)
}

/// The model second at which a TTL of `ttl_ms` from `now_s` ends (at least one second).
fn until(now_s: u64, ttl_ms: i64) -> u64 {
    now_s + u64::try_from(ttl_ms.max(1_000) + 999).unwrap_or(0) / 1000
}

/// What idemd's flows are told of its configuration in the model.
pub fn settings(cfg: &Config) -> Settings {
    let broken = if cfg.is(Mutation::AcquiredByRedisAlone) { Broken::AcquiredByRedisAlone } else { cfg.broken() };
    Settings {
        store: StoreSettings {
            lease_ms: world::LEASE_MS,
            terminal_retention_ms: world::RETENTION_MS,
            stale_in_flight_ms: STALE_IN_FLIGHT_MS,
        },
        console: None,
        clock_skew_ms: cfg.skew_ms,
        broken,
    }
}

/// The flow that serves one filter callout, answering (HTTP status, body) as idemd's API does;
/// `None` for a callout idemd does not serve.
pub fn callout_flow(cfg: &Config, method: &str, path: &str, body: &[u8]) -> Option<Flow<(u16, Vec<u8>)>> {
    let s = settings(cfg);
    Some(match (method, path.split('?').next().unwrap_or_default()) {
        ("POST", "/v1/acquire") => {
            let req: AcquireRequest = serde_json::from_slice(body).ok()?;
            Flow::new(|io| async move {
                let a = acquire::acquire_answer(io, req, s).await;
                let status = if a.answer.outcome == AcquireOutcome::StoreUnavailable { 503 } else { 200 };
                (status, serde_json::to_vec(&a).unwrap_or_default())
            })
        }
        ("POST", "/v1/complete") => {
            let req: CompleteRequest = serde_json::from_slice(body).ok()?;
            Flow::new(|io| async move { ack(write::complete(io, req, s).await) })
        }
        ("POST", "/v1/release") => {
            let req: ReleaseRequest = serde_json::from_slice(body).ok()?;
            Flow::new(|io| async move { ack(write::release(io, req).await) })
        }
        ("GET", p) if p.starts_with("/v1/operations/") => {
            let exp = path.split_once("?exp=").and_then(|(_, e)| e.parse().ok());
            let key = p.trim_start_matches("/v1/operations/").to_string();
            Flow::new(|io| async move { lookup_reply(write::lookup(io, key, exp, s).await) })
        }
        _ => return None,
    })
}

/// `GET /v1/operations/{key}` as the API answers it.
fn lookup_reply(found: Lookup) -> (u16, Vec<u8>) {
    match found {
        Lookup::Found(view) => (200, serde_json::to_vec(&view).unwrap_or_default()),
        Lookup::NotFound(body) => (404, serde_json::to_vec(&body).unwrap_or_default()),
        Lookup::Unavailable => (503, br#"{"error":"store_unavailable"}"#.to_vec()),
    }
}

fn ack(a: protocol::Ack) -> (u16, Vec<u8>) {
    let status = if a == protocol::Ack::StoreUnavailable { 503 } else { 200 };
    (status, serde_json::to_vec(&AckResponse { outcome: a }).unwrap_or_default())
}

/// The reconciler's flow for the row as its pass read it.
pub fn settle_flow(cfg: &Config, read: &Record) -> Flow<RowOutcome> {
    // The scope's `--status-reading`: the default (`/status` "failed" is FAILED), or, broken, one
    // that calls a refusal by another word than the endpoint's.
    let readings = if cfg.is(Mutation::MisdeclaredReading) {
        [(crate::filter::SCOPE.to_string(), Reading::parse("failed=declined").unwrap_or_default())].into()
    } else {
        Default::default()
    };
    let s = SettleSettings {
        rules: Rules {
            grace_ms: world::GRACE_MS,
            retry_budget: world::RETRY_BUDGET,
            readings: std::sync::Arc::new(readings),
        },
        claim_ms: CLAIM_MS,
        actor: "reconciler:model".into(),
        store: settings(cfg),
    };
    let rec = read.clone();
    Flow::new(|io| settle(io, rec, s))
}

/// The status endpoint's URL template of the model's scope.
pub fn status_template(cfg: &Config) -> &'static str {
    match cfg.upstream {
        UpstreamKeys::Honoured => "http://upstream/v1/transfers/{key}",
        UpstreamKeys::Ignored => "http://upstream/v1/transfers?ref={ref}",
    }
}

/// What the reconciler learns of `rec` when the endpoint answers `answer`.
pub fn asked(cfg: &Config, rec: &Record, answer: StatusAnswer) -> Asked {
    match target(status_template(cfg), rec) {
        Ok(t) => Asked::Answered(t.by, answer),
        Err(why) => Asked::Unaskable(why),
    }
}

/// Take one step of a flow: rebuild it from `progress`, carry out its next store call (the
/// inputs it takes before it, the time and fresh owner tokens, are read now), then run it on to
/// its next store call or its answer. `crash`: the replica dies after the call, its answer lost.
/// `lookup` answers the status lookup (the reconciler's flow).
pub fn step<T>(
    flow: Flow<T>,
    progress: &mut Progress,
    stores: &mut Stores,
    now_s: u64,
    cfg: &Config,
    lookup: &dyn Fn(&Record) -> Asked,
) -> Stepped<T> {
    let (mut flow, mut next) = flow.replayed(progress);
    let mut made = false;
    loop {
        match next {
            Next::Done(t) => return Stepped::Answered(t),
            Next::Call(call) => {
                if call.is_store() && made {
                    return Stepped::Waiting;
                }
                made |= call.is_store();
                let reply = match call {
                    Call::Lookup { rec } => Reply::Asked(lookup(&rec)),
                    call => carry_out(stores, now_s, cfg, call),
                };
                progress.push(reply.clone());
                next = flow.next(Some(reply));
            }
        }
    }
}

/// Run a flow to its answer in one step (the renewals of a tick).
pub fn run_through<T>(flow: Flow<T>, stores: &mut Stores, now_s: u64, cfg: &Config) -> T {
    flow.run_with(|call| carry_out(stores, now_s, cfg, call))
}

/// The flow of one lease's renewal.
pub fn renew_flow(cfg: &Config, lease: LeaseRenewal) -> Flow<Result<bool, SqlFail>> {
    let s = settings(cfg);
    Flow::new(|io| write::renew(io, lease, s))
}

fn down() -> Reply {
    Reply::Sql(Err(SqlFail::Down("SQL is down".into())))
}

fn changed(c: bool) -> Reply {
    Reply::Sql(Ok(SqlAnswer::Changed(c)))
}

/// Carry out one call on the model's stores: SQL statements and Lua scripts as the store rules
/// say they act, the time as the model clock reads, owner tokens from one counter.
pub fn carry_out(st: &mut Stores, now_s: u64, cfg: &Config, call: Call) -> Reply {
    let mut s = Cache { st, now_s };
    match call {
        Call::Now => Reply::Now(ms(now_s)),
        Call::NewOwner => {
            s.st.owners += 1;
            Reply::Owner(owner(s.st.owners))
        }
        // Answered by the world (`step`'s `lookup`); a flow never asks the stores.
        Call::Lookup { .. } => Reply::Asked(Asked::NoEndpoint),
        Call::RedisAcquire { param_hash, subject_hash, scope, owner, lease_ms, .. } => {
            if s.st.redis_down {
                return Reply::RedisDown;
            }
            let age_ms = s.st.redis.as_ref().map_or(0, |c| ms(now_s) - ms(c.set_s));
            let (reply, next, ttl) = rules::redis_acquire(
                s.cached().as_ref(),
                (param_hash.as_str(), subject_hash.as_str(), scope.as_str()),
                &owner,
                age_ms,
                lease_ms,
            );
            s.script(next, ttl);
            Reply::Acquire(reply)
        }
        Call::RedisComplete { owner, state, result_json, retention_ms, .. } => {
            if s.st.redis_down {
                return Reply::RedisDown;
            }
            let (reply, next, ttl) =
                rules::redis_complete(s.cached().as_ref(), &owner, state, &result_json, retention_ms);
            s.script(next, ttl);
            Reply::Write(reply)
        }
        Call::RedisRelease { owner, .. } => {
            if s.st.redis_down {
                return Reply::RedisDown;
            }
            let (reply, next) = rules::redis_release(s.cached().as_ref(), &owner);
            s.script(next, Ttl::Kept);
            Reply::Write(reply)
        }
        Call::RedisRenew { owner, lease_ms, .. } => {
            if s.st.redis_down {
                return Reply::RedisDown;
            }
            let (reply, next, ttl) = rules::redis_renew(s.cached().as_ref(), &owner, lease_ms);
            s.script(next, ttl);
            Reply::Write(reply)
        }
        Call::RedisRestore { rec, ttl_ms } => {
            if s.st.redis_down {
                return Reply::RedisDown;
            }
            let (_, next, ttl) = rules::redis_restore(s.cached().as_ref(), &rec, ttl_ms);
            s.script(next, ttl);
            Reply::Done
        }
        Call::RedisEvict { .. } => {
            if s.st.redis_down {
                return Reply::RedisDown;
            }
            s.write(None);
            Reply::Done
        }
        _ if s.st.sql_down => down(),
        Call::SqlInsertInFlight { row, .. } => {
            let new = Record {
                key: row.key,
                state: OpState::InFlight,
                param_hash: row.param_hash,
                subject_hash: row.subject_hash,
                scope: row.scope,
                owner: Some(row.owner),
                result: None,
                lease_until_ms: Some(row.lease_until_ms),
                created_at_ms: row.now_ms,
                updated_at_ms: row.now_ms,
                reconcile_attempts: 0,
                fp_exp_ms: row.fp_exp_ms,
                upstream_ignores_keys: row.upstream_ignores_keys,
                business_ref: row.business_ref,
                bound_fields: row.bound_fields,
            };
            let current = s.st.sql.as_ref().map(Row::record);
            // The insert's `NOT EXISTS` over `idem_approval`: the approval belongs to the record.
            let approval = s.st.approval.as_ref().map(Approval::row);
            let allowed = cfg.is(Mutation::AcquireIgnoresApproval)
                || rules::acquire_allowed(approval.as_ref(), new.created_at_ms);
            match rules::insert_in_flight(current.as_ref(), &new).filter(|_| allowed) {
                Some(inserted) => {
                    s.st.sql = Some(Row::of(&inserted));
                    changed(true)
                }
                None => changed(false),
            }
        }
        Call::SqlGet { .. } => Reply::Sql(Ok(SqlAnswer::Row(s.st.sql.as_ref().map(Row::record)))),
        Call::SqlApproval { .. } => Reply::Sql(Ok(SqlAnswer::Approval(s.st.approval.as_ref().map(Approval::row)))),
        Call::SqlReferenceHolder { reference, .. } => {
            let held = s.st.sql.as_ref().filter(|r| r.business_ref.as_deref() == Some(reference.as_str()));
            Reply::Sql(Ok(SqlAnswer::Holder(held.map(|_| key()))))
        }
        Call::SqlInsertAwaiting { row, .. } => {
            let current = s.st.approval.as_ref().map(Approval::row);
            match rules::insert_awaiting(current.as_ref(), &row) {
                Some(inserted) => {
                    s.st.approval = Some(Approval::of(&inserted));
                    changed(true)
                }
                None => changed(false),
            }
        }
        Call::SqlComplete { owner, state, result_json, now_ms, .. } => {
            let Ok(result) = serde_json::from_str::<StoredResult>(&result_json) else { return changed(false) };
            let current = s.st.sql.as_ref().map(Row::record);
            match rules::complete(current.as_ref(), &owner, state, &result, now_ms, cfg.broken()) {
                Completion::Applied(rec) => {
                    s.st.sql = Some(Row::of(&rec));
                    changed(true)
                }
                // The UPDATE's `WHERE owner = ? AND state = 'IN_FLIGHT'` matched no row.
                Completion::Repeated | Completion::NotOwner => changed(false),
            }
        }
        Call::SqlRelease { owner, .. } | Call::SqlReleaseDetached { owner, .. } => {
            let current = s.st.sql.as_ref().map(Row::record);
            let released = rules::release(current.as_ref(), &owner);
            if released {
                s.st.sql = None;
            }
            changed(released)
        }
        Call::SqlRenew { owner, until_ms, .. } => {
            let current = s.st.sql.as_ref().map(Row::record);
            match rules::renew(current.as_ref(), &owner, until_ms, ms(now_s)) {
                Some(renewed) => {
                    s.st.sql = Some(Row::of(&renewed));
                    changed(true)
                }
                None => changed(false),
            }
        }
        Call::SqlClaim { rec, token, until_ms, now_ms } => {
            let current = s.st.sql.as_ref().map(Row::record);
            sql_put(s.st, rules::claim(current.as_ref(), &rec, &token, until_ms, now_ms))
        }
        Call::SqlUnclaim { rec, token, failed, .. } => {
            let current = s.st.sql.as_ref().map(Row::record);
            sql_put(s.st, rules::unclaim(current.as_ref(), &rec, &token, failed))
        }
        Call::SqlMarkNeedsReview { rec, token, now_ms, .. } => {
            let current = s.st.sql.as_ref().map(Row::record);
            sql_put(s.st, rules::mark_needs_review(current.as_ref(), &rec, &token, now_ms))
        }
    }
}

/// A conditional update: the row after it, or `None` when its `WHERE` matched nothing.
fn sql_put(st: &mut Stores, next: Option<Record>) -> Reply {
    match next {
        Some(rec) => {
            st.sql = Some(Row::of(&rec));
            changed(true)
        }
        None => changed(false),
    }
}

/// Redis's hash of the operation, with its TTL.
struct Cache<'a> {
    st: &'a mut Stores,
    now_s: u64,
}

impl Cache<'_> {
    fn cached(&self) -> Option<Cached> {
        self.st.redis.as_ref().map(CacheRow::cached)
    }

    fn write(&mut self, next: Option<CacheRow>) {
        if next != self.st.redis {
            self.st.redis_before = Some(self.st.redis.clone());
            self.st.redis = next;
        }
    }

    /// A script's entry after it, with the TTL it leaves (`rules::Ttl`): a TTL set from now also
    /// restarts the age an IN_FLIGHT answer reports; a kept one keeps both.
    fn script(&mut self, next: Option<Cached>, ttl: Ttl) {
        let now_s = self.now_s;
        let (until_s, set_s) = match ttl {
            Ttl::Set(ms) => (until(now_s, i64::try_from(ms).unwrap_or(0)), now_s),
            Ttl::Kept => self.st.redis.as_ref().map_or((now_s + 1, now_s), |c| (c.until_s, c.set_s)),
        };
        self.write(next.as_ref().map(|c| CacheRow::of(c, until_s, set_s)));
    }
}

// ---- what is not a flow: the approver, the lapse sweep, the reaper ------------------------------
// (one SQL statement each: `rules::decide`, `rules::lapse`, `rules::reapable`,
// `rules::approval_reapable` are what `sidecar/tests/store_rules.rs` ties to them)

/// `POST /v1/approvals/{key}` by the model's approver (`Store::decide`: the rule, then the
/// `UPDATE … WHERE state = 'AWAITING_APPROVAL' AND fp_exp_ms > now`). `true`: decided.
pub fn decide(st: &mut Stores, now_s: u64, cfg: &Config, approve: bool) -> bool {
    if st.sql_down {
        return false;
    }
    let Some(mut row) = st.approval.as_ref().map(Approval::row) else { return false };
    let exp_ms = row.fp_exp_ms;
    if cfg.is(Mutation::DecideAfterLapse) {
        // The broken decision cannot see the row's exp.
        row.fp_exp_ms = i64::MAX;
    }
    let (decision, reason) = if approve {
        (protocol::Decision::Approve, "within budget")
    } else {
        (protocol::Decision::Reject, "payee not on the list")
    };
    let approver = (world::APPROVER, idem_core::fingerprint::subject_hash(world::APPROVER));
    match rules::decide(Some(&row), decision, (approver.0, &approver.1), reason, false, ms(now_s)) {
        Ok(next) => {
            st.approval = Some(Approval::of(&ApprovalRow { fp_exp_ms: exp_ms, ..next }));
            true
        }
        Err(_) => false,
    }
}

/// One pass of the lapse sweep (`Store::lapse_due`): `true` when it lapsed the approval.
pub fn lapse(st: &mut Stores, now_s: u64) -> bool {
    if st.sql_down {
        return false;
    }
    let row = st.approval.as_ref().map(Approval::row);
    match rules::lapse(row.as_ref(), st.sql.is_some(), ms(now_s)) {
        Some(lapsed) => {
            st.approval = Some(Approval::of(&lapsed));
            true
        }
        None => false,
    }
}

/// The reaper's pass over `idem_approval`: `true` when it deleted the row.
pub fn reap_approval(st: &mut Stores, now_s: u64) -> bool {
    let Some(row) = st.approval.as_ref().map(Approval::row) else { return false };
    if st.sql_down || !rules::approval_reapable(&row, ms(now_s), world::RETENTION_MS) {
        return false;
    }
    st.approval = None;
    true
}

/// One reaper pass: `true` when it deleted the row.
pub fn reap(st: &mut Stores, now_s: u64, cfg: &Config) -> bool {
    let Some(rec) = st.sql.as_ref().map(Row::record) else { return false };
    let approval = st.approval.as_ref().map(Approval::row);
    let reapable =
        rules::reapable_skewed(&rec, approval.as_ref(), ms(now_s), world::RETENTION_MS, cfg.skew_ms, cfg.broken());
    if st.sql_down || !reapable {
        return false;
    }
    st.sql = None;
    true
}
