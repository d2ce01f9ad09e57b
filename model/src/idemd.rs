//! idemd's replicas over the model's Redis and SQL: the flow of `sidecar/src/store/mod.rs`
//! (Redis first, SQL the truth, restore, undo), every transition one of the store rules
//! (`idemd::store::rules`), the reconciler's decision the real `reconcile::decide`.
//!
//! A call runs its store calls in order; a replica may crash before any one of them (`crash_at`:
//! the calls made before it stay made, the filter's callout fails). A crash after the last call is
//! an answer lost on the way back.

use idem_core::protocol::{
    self, Ack, AckResponse, AcquireOutcome, AcquireRequest, AcquireResponse, ApprovalState, CompleteRequest,
    NotFoundView, OpState, OwnerToken, ReleaseRequest, StoredResult, TerminalState, WithApproval,
};
use idemd::reconcile::decide::{decide, Asked, Decision, Rules, StatusAnswer};
use idemd::reconcile::target::target;
use idemd::store::record::{ApprovalRow, Record};
use idemd::store::redis::{AcquireReply, WriteReply};
use idemd::store::retention;
use idemd::store::rules::{self, Broken, Cached, Completion, Gate};

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

/// The replica crashed (or its answer was lost) before the next store call.
pub struct Crashed;

/// The store calls one idemd call makes, counted for the crash point.
pub struct Run<'a> {
    pub s: &'a mut Stores,
    pub now_s: u64,
    pub cfg: &'a Config,
    made: u8,
    crash_at: Option<u8>,
}

const STALE_IN_FLIGHT_MS: i64 = 1_000;
const MAX_ATTEMPTS: usize = 3;

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

impl<'a> Run<'a> {
    pub fn new(s: &'a mut Stores, now_s: u64, cfg: &'a Config, crash_at: Option<u8>) -> Run<'a> {
        Run { s, now_s, cfg, made: 0, crash_at }
    }

    fn call(&mut self) -> Result<(), Crashed> {
        if self.crash_at == Some(self.made) {
            return Err(Crashed);
        }
        self.made += 1;
        Ok(())
    }

    fn now_ms(&self) -> i64 {
        ms(self.now_s)
    }

    fn sql_get(&mut self) -> Result<Option<Option<Record>>, Crashed> {
        self.call()?;
        Ok((!self.s.sql_down).then(|| self.s.sql.as_ref().map(Row::record)))
    }

    fn sql_put(&mut self, rec: Option<&Record>) {
        self.s.sql = rec.map(Row::of);
    }

    fn redis_up(&self) -> bool {
        !self.s.redis_down
    }

    fn redis_write(&mut self, next: Option<CacheRow>) {
        if next != self.s.redis {
            self.s.redis_before = Some(self.s.redis.clone());
            self.s.redis = next;
        }
    }

    fn cached(&self) -> Option<Cached> {
        self.s.redis.as_ref().map(CacheRow::cached)
    }

    /// `idem_approval`'s row as read (`None`: SQL down).
    fn approval_get(&mut self) -> Result<Option<Option<ApprovalRow>>, Crashed> {
        self.call()?;
        Ok((!self.s.sql_down).then(|| self.s.approval.as_ref().map(Approval::row)))
    }

    // ---- acquire (Store::acquire_answer) ------------------------------------

    /// The acquire as the API answers it (`Store::acquire_answer`): the approval gate first where
    /// the route asks a person, then the ordinary acquire, with the approval record beside an
    /// answer the row gave.
    pub fn acquire_answer(&mut self, req: &AcquireRequest) -> Result<WithApproval<AcquireResponse>, Crashed> {
        if let Some(gated) = self.approval_gate(req)? {
            return Ok(gated);
        }
        let answer = self.acquire(req)?;
        if matches!(
            answer.outcome,
            AcquireOutcome::AwaitingApproval | AcquireOutcome::Rejected | AcquireOutcome::Lapsed
        ) {
            let approval = self.approval_get()?.flatten().and_then(|r| r.view(None));
            return Ok(WithApproval { answer, approval });
        }
        Ok(WithApproval { answer, approval: None })
    }

    /// `Store::approval_gate`: record the operation AWAITING_APPROVAL, answer from its row, or
    /// (`None`) let an APPROVED one go on to the ordinary acquire.
    fn approval_gate(&mut self, req: &AcquireRequest) -> Result<Option<WithApproval<AcquireResponse>>, Crashed> {
        let Some(ask) = req.approval.as_ref() else { return Ok(None) };
        let binding = (req.param_hash.as_str(), req.subject_hash.as_str(), req.scope.as_str());
        let exp_ms = req.exp.map(|s| i64::try_from(s.saturating_mul(1000)).unwrap_or(i64::MAX));
        for _ in 0..2 {
            let now = self.now_ms();
            let Some(row) = self.approval_get()? else {
                return Ok(Some(gated(AcquireOutcome::StoreUnavailable, None)));
            };
            // No approval row yet: has the operation started without one? Then its row answers.
            let started = match &row {
                Some(_) => false,
                None => match self.sql_get()? {
                    Some(record) => record.is_some(),
                    None => return Ok(Some(gated(AcquireOutcome::StoreUnavailable, None))),
                },
            };
            match rules::approval_gate(row.as_ref(), started, binding, now) {
                Gate::Proceed => return Ok(None),
                Gate::Answer(outcome) => {
                    let view = row.as_ref().filter(|_| outcome != AcquireOutcome::ParamMismatch);
                    return Ok(Some(gated(outcome, view.and_then(|r| r.view(None)))));
                }
                Gate::Record => {}
            }
            let Some(exp_ms) = exp_ms else { return Ok(Some(gated(AcquireOutcome::StoreUnavailable, None))) };
            let new = ApprovalRow::awaiting(req, ask, exp_ms, now);
            self.call()?;
            if self.s.sql_down {
                return Ok(Some(gated(AcquireOutcome::StoreUnavailable, None)));
            }
            let current = self.s.approval.as_ref().map(Approval::row);
            match rules::insert_awaiting(current.as_ref(), &new) {
                Some(inserted) => {
                    self.s.approval = Some(Approval::of(&inserted));
                    return Ok(Some(gated(AcquireOutcome::AwaitingApproval, inserted.view(None))));
                }
                // Another confirm recorded it a moment ago: read it again.
                None => continue,
            }
        }
        Ok(Some(gated(AcquireOutcome::StoreUnavailable, None)))
    }

    /// The ordinary acquire (`Store::acquire_plain`).
    pub fn acquire(&mut self, req: &AcquireRequest) -> Result<AcquireResponse, Crashed> {
        self.s.owners += 1;
        let owner = owner(self.s.owners);
        for _ in 0..MAX_ATTEMPTS {
            if let Some(a) = self.acquire_once(req, &owner)? {
                return Ok(a);
            }
        }
        Ok(unavailable())
    }

    /// `None`: Redis held a stale copy and it was dropped; ask again.
    fn acquire_once(&mut self, req: &AcquireRequest, owner: &str) -> Result<Option<AcquireResponse>, Crashed> {
        if !self.redis_up() {
            return self.sql_acquire(req, owner, false).map(Some);
        }
        self.call()?;
        let age_ms = self.s.redis.as_ref().map_or(0, |c| ms(self.now_s) - ms(c.set_s));
        let cached = self.cached();
        let binding = (req.param_hash.as_str(), req.subject_hash.as_str(), req.scope.as_str());
        let (reply, next) = rules::redis_acquire(cached.as_ref(), binding, owner, age_ms);
        if reply == AcquireReply::Acquired {
            let lease_s = until(self.now_s, i64::try_from(req.lease_ms.max(world::LEASE_MS)).unwrap_or(0));
            self.redis_write(next.as_ref().map(|c| CacheRow::of(c, lease_s, self.now_s)));
        }
        Ok(match reply {
            AcquireReply::Acquired if self.cfg.is(Mutation::AcquiredByRedisAlone) => Some(AcquireResponse {
                outcome: AcquireOutcome::Acquired,
                owner: OwnerToken::parse(owner).ok(),
                result: None,
            }),
            AcquireReply::Acquired => Some(self.sql_acquire(req, owner, true)?),
            AcquireReply::InFlight { owner: holder, age_ms } => self.confirm_in_flight(req, &holder, age_ms)?,
            AcquireReply::Done(json) => Some(replay(AcquireOutcome::Done, &json)),
            AcquireReply::Failed(json) => Some(replay(AcquireOutcome::Failed, &json)),
            AcquireReply::NeedsReview => self.confirm_needs_review(req)?,
            AcquireReply::ParamMismatch => {
                Some(AcquireResponse { outcome: AcquireOutcome::ParamMismatch, owner: None, result: None })
            }
        })
    }

    fn sql_acquire(&mut self, req: &AcquireRequest, owner: &str, gate: bool) -> Result<AcquireResponse, Crashed> {
        for _ in 0..MAX_ATTEMPTS {
            self.call()?;
            if self.s.sql_down {
                self.undo_acquire(owner, gate)?;
                return Ok(unavailable());
            }
            let now = self.now_ms();
            let lease = i64::try_from(req.lease_ms.max(world::LEASE_MS)).unwrap_or(0);
            let new = Record {
                key: req.key.to_string(),
                state: OpState::InFlight,
                param_hash: req.param_hash.clone(),
                subject_hash: req.subject_hash.clone(),
                scope: req.scope.clone(),
                owner: Some(owner.to_string()),
                result: None,
                lease_until_ms: Some(now + lease),
                created_at_ms: now,
                updated_at_ms: now,
                reconcile_attempts: 0,
                fp_exp_ms: req.exp.map(|s| i64::try_from(s * 1000).unwrap_or(i64::MAX)),
                upstream_ignores_keys: req.upstream_ignores_keys,
                business_ref: req.business_ref.clone(),
                bound_fields: req.fields.clone(),
            };
            let current = self.s.sql.as_ref().map(Row::record);
            // The insert's `NOT EXISTS` over `idem_approval`: the approval belongs to the record.
            let approval = self.s.approval.as_ref().map(Approval::row);
            let allowed =
                self.cfg.is(Mutation::AcquireIgnoresApproval) || rules::acquire_allowed(approval.as_ref(), now);
            if let Some(inserted) = rules::insert_in_flight(current.as_ref(), &new).filter(|_| allowed) {
                self.sql_put(Some(&inserted));
                return Ok(AcquireResponse {
                    outcome: AcquireOutcome::Acquired,
                    owner: OwnerToken::parse(owner).ok(),
                    result: None,
                });
            }
            match self.sql_get()? {
                Some(Some(rec)) => {
                    if gate {
                        self.restore(&rec)?;
                    }
                    return Ok(rules::answer_from_row(&rec, &req.param_hash, &req.subject_hash, &req.scope));
                }
                // No row: the insert was refused by an approval not (yet) given, or the row was
                // released between the insert and the read (then insert again).
                Some(None) => match self.approval_get()? {
                    Some(Some(a)) if !rules::acquire_allowed(Some(&a), now) => {
                        self.undo_acquire(owner, gate)?;
                        let binding = (req.param_hash.as_str(), req.subject_hash.as_str(), req.scope.as_str());
                        let outcome = match rules::approval_gate(Some(&a), false, binding, now) {
                            Gate::Answer(o) => o,
                            Gate::Proceed | Gate::Record => AcquireOutcome::AwaitingApproval,
                        };
                        return Ok(AcquireResponse { outcome, owner: None, result: None });
                    }
                    Some(_) => continue,
                    None => {
                        self.undo_acquire(owner, gate)?;
                        return Ok(unavailable());
                    }
                },
                None => {
                    self.undo_acquire(owner, gate)?;
                    return Ok(unavailable());
                }
            }
        }
        self.undo_acquire(owner, gate)?;
        Ok(unavailable())
    }

    fn undo_acquire(&mut self, owner: &str, gate: bool) -> Result<(), Crashed> {
        if gate && self.redis_up() {
            self.call()?;
            let (_, next) = rules::redis_release(self.cached().as_ref(), owner);
            self.keep_ttl(next);
        }
        Ok(())
    }

    /// A script that changes the hash but not its TTL.
    fn keep_ttl(&mut self, next: Option<Cached>) {
        let (until_s, set_s) = self.s.redis.as_ref().map_or((self.now_s + 1, self.now_s), |c| (c.until_s, c.set_s));
        self.redis_write(next.as_ref().map(|c| CacheRow::of(c, until_s, set_s)));
    }

    fn confirm_in_flight(
        &mut self,
        req: &AcquireRequest,
        holder: &str,
        age_ms: i64,
    ) -> Result<Option<AcquireResponse>, Crashed> {
        let in_flight =
            AcquireResponse { outcome: AcquireOutcome::InFlight, owner: OwnerToken::parse(holder).ok(), result: None };
        Ok(match self.sql_get()? {
            Some(Some(rec)) => {
                if rec.state != OpState::InFlight || rec.owner.as_deref() != Some(holder) {
                    self.restore(&rec)?;
                }
                Some(rules::answer_from_row(&rec, &req.param_hash, &req.subject_hash, &req.scope))
            }
            Some(None) if age_ms > STALE_IN_FLIGHT_MS && self.redis_up() => {
                self.call()?;
                let (_, next) = rules::redis_release(self.cached().as_ref(), holder);
                self.keep_ttl(next);
                None
            }
            _ => Some(in_flight),
        })
    }

    fn confirm_needs_review(&mut self, req: &AcquireRequest) -> Result<Option<AcquireResponse>, Crashed> {
        Ok(match self.sql_get()? {
            Some(Some(rec)) => {
                if rec.state != OpState::NeedsReview {
                    self.evict()?;
                    self.restore(&rec)?;
                }
                Some(rules::answer_from_row(&rec, &req.param_hash, &req.subject_hash, &req.scope))
            }
            Some(None) => {
                self.evict()?;
                None
            }
            None => Some(AcquireResponse { outcome: AcquireOutcome::NeedsReview, owner: None, result: None }),
        })
    }

    fn restore(&mut self, rec: &Record) -> Result<(), Crashed> {
        if !self.redis_up() {
            return Ok(());
        }
        self.call()?;
        let now = self.now_ms();
        let ttl = match rec.state {
            OpState::InFlight => rec.lease_until_ms.unwrap_or(0) - now,
            _ => retention::kept_until_ms(rec, world::RETENTION_MS) - now,
        };
        let (written, next) = rules::redis_restore(self.cached().as_ref(), rec);
        if written {
            let until_s = until(self.now_s, ttl);
            self.redis_write(next.as_ref().map(|c| CacheRow::of(c, until_s, self.now_s)));
        }
        Ok(())
    }

    fn evict(&mut self) -> Result<(), Crashed> {
        if self.redis_up() {
            self.call()?;
            self.redis_write(None);
        }
        Ok(())
    }

    // ---- complete / release (Store::complete, Store::release) ---------------

    pub fn complete(&mut self, req: &CompleteRequest) -> Result<Ack, Crashed> {
        self.call()?;
        if self.s.sql_down {
            return Ok(Ack::StoreUnavailable);
        }
        let current = self.s.sql.as_ref().map(Row::record);
        let broken = self.cfg.broken();
        match rules::complete(current.as_ref(), req.owner.as_str(), req.state, &req.result, self.now_ms(), broken) {
            Completion::Applied(rec) => self.sql_put(Some(&*rec)),
            Completion::Repeated => {}
            Completion::NotOwner => return Ok(Ack::NotOwner),
        }
        if self.redis_up() {
            self.call()?;
            let json = serde_json::to_string(&req.result).unwrap_or_default();
            let (reply, next) = rules::redis_complete(self.cached().as_ref(), req.owner.as_str(), req.state, &json);
            if reply == WriteReply::NotOwner {
                self.evict()?;
            } else if let Some(next) = next {
                let until_s = until(self.now_s, i64::try_from(world::RETENTION_MS).unwrap_or(0));
                self.redis_write(Some(CacheRow::of(&next, until_s, self.now_s)));
            }
        }
        Ok(Ack::Ok)
    }

    pub fn release(&mut self, req: &ReleaseRequest) -> Result<Ack, Crashed> {
        self.call()?;
        if self.s.sql_down {
            return Ok(Ack::StoreUnavailable);
        }
        let current = self.s.sql.as_ref().map(Row::record);
        if !rules::release(current.as_ref(), req.owner.as_str()) {
            return Ok(Ack::NotOwner);
        }
        self.sql_put(None);
        if self.redis_up() {
            self.call()?;
            let (_, next) = rules::redis_release(self.cached().as_ref(), req.owner.as_str());
            self.keep_ttl(next);
        }
        Ok(Ack::Ok)
    }

    /// `GET /v1/operations/{key}?exp=`: (HTTP status, body).
    pub fn lookup(&mut self, exp: Option<u64>) -> Result<(u16, Vec<u8>), Crashed> {
        Ok(match self.sql_get()? {
            None => (503, br#"{"error":"STORE_UNAVAILABLE"}"#.to_vec()),
            Some(Some(rec)) => (200, serde_json::to_vec(&idemd::store::view(rec)).unwrap_or_default()),
            Some(None) => {
                let reaped_possible =
                    exp.is_some_and(|exp| retention::reaped_possible(exp, self.now_ms(), world::RETENTION_MS));
                // Nothing executed; a person may be (or have been) asked about it.
                let Some(approval) = self.approval_get()? else {
                    return Ok((503, br#"{"error":"store_unavailable"}"#.to_vec()));
                };
                let answer = NotFoundView { error: "not_found".into(), reaped_possible };
                let body = WithApproval { answer, approval: approval.and_then(|r| r.view(None)) };
                (404, serde_json::to_vec(&body).unwrap_or_default())
            }
        })
    }

    /// `POST /v1/renew` of one lease (Store::renew).
    pub fn renew(&mut self, owner: &str, lease_ms: u64) {
        if self.s.sql_down {
            return;
        }
        let until_ms = self.now_ms() + i64::try_from(lease_ms.max(world::LEASE_MS)).unwrap_or(0);
        let current = self.s.sql.as_ref().map(Row::record);
        let Some(renewed) = rules::renew(current.as_ref(), owner, until_ms, self.now_ms()) else { return };
        self.sql_put(Some(&renewed));
        if self.redis_up() {
            if let Some(c) = &self.s.redis {
                if c.state == St::InFlight && c.owner.as_deref() == Some(owner) {
                    let next = CacheRow {
                        until_s: until(self.now_s, until_ms - self.now_ms()),
                        set_s: self.now_s,
                        ..c.clone()
                    };
                    self.redis_write(Some(next));
                }
            }
        }
    }

    // ---- the reconciler and the reaper --------------------------------------

    /// One reconciler pass over the row: claim it if its lease ran out, ask the upstream's
    /// status endpoint (`status`: its answer, `None` when the lookup failed), decide, write.
    /// The decision, or `None` when there was nothing to claim.
    pub fn reconcile(&mut self, status: impl Fn(&Record) -> Option<StatusAnswer>) -> Option<(Decision, String)> {
        if self.s.sql_down {
            return None;
        }
        let as_read = self.s.sql.as_ref().map(Row::record)?;
        let now = self.now_ms();
        if !rules::claimable(&as_read, now) {
            return None;
        }
        self.s.owners += 1;
        let token = owner(0x80 + self.s.owners);
        let claimed = rules::claim(Some(&as_read), &as_read, &token, now + 1_000, now)?;
        self.sql_put(Some(&claimed));
        let template = match self.cfg.upstream {
            UpstreamKeys::Honoured => "http://upstream/v1/transfers/{key}",
            UpstreamKeys::Ignored => "http://upstream/v1/transfers?ref={ref}",
        };
        let asked = match target(template, &as_read) {
            Ok(t) => Asked::Answered(t.by, status(&as_read).unwrap_or(StatusAnswer::Failed("timed out".into()))),
            Err(why) => Asked::Unaskable(why),
        };
        let reconcile_rules =
            Rules { grace_ms: world::GRACE_MS, retry_budget: world::RETRY_BUDGET, readings: Default::default() };
        let (decision, why) = decide(&as_read, &asked, now, &reconcile_rules);
        let current = self.s.sql.as_ref().map(Row::record);
        let after = match &decision {
            Decision::Done(r) | Decision::Failed(r) => {
                let state =
                    if matches!(decision, Decision::Done(_)) { TerminalState::Done } else { TerminalState::Failed };
                match rules::complete(current.as_ref(), &token, state, r, now, Broken::None) {
                    Completion::Applied(rec) => Some(Some(*rec)),
                    _ => None,
                }
            }
            Decision::Release => rules::release(current.as_ref(), &token).then_some(None),
            Decision::NeedsReview => rules::mark_needs_review(current.as_ref(), &as_read, &token, now).map(Some),
            Decision::Retry => rules::unclaim(current.as_ref(), &as_read, &token, true).map(Some),
            Decision::SkipGrace => rules::unclaim(current.as_ref(), &as_read, &token, false).map(Some),
        };
        if let Some(row) = after {
            self.sql_put(row.as_ref());
            // refresh_cache: evict, then restore the row as it is now.
            if self.redis_up() {
                self.redis_write(None);
                if let Some(rec) = &row {
                    let _ = self.restore(rec);
                }
            }
        }
        Some((decision, why))
    }

    // ---- approval: the approver, the lapse sweep, the reaper ---------------

    /// `POST /v1/approvals/{key}` by the model's approver (`Store::decide`: the rule, then the
    /// `UPDATE … WHERE state = 'AWAITING_APPROVAL' AND fp_exp_ms > now`). `true`: decided.
    pub fn decide(&mut self, approve: bool) -> bool {
        if self.s.sql_down {
            return false;
        }
        let Some(mut row) = self.s.approval.as_ref().map(Approval::row) else { return false };
        let exp_ms = row.fp_exp_ms;
        if self.cfg.is(Mutation::DecideAfterLapse) {
            // The broken decision cannot see the row's exp.
            row.fp_exp_ms = i64::MAX;
        }
        let (decision, reason) = if approve {
            (protocol::Decision::Approve, "within budget")
        } else {
            (protocol::Decision::Reject, "payee not on the list")
        };
        let approver = (world::APPROVER, idem_core::fingerprint::subject_hash(world::APPROVER));
        match rules::decide(Some(&row), decision, (approver.0, &approver.1), reason, false, self.now_ms()) {
            Ok(next) => {
                self.s.approval = Some(Approval::of(&ApprovalRow { fp_exp_ms: exp_ms, ..next }));
                true
            }
            Err(_) => false,
        }
    }

    /// One pass of the lapse sweep (`Store::lapse_due`): `true` when it lapsed the approval.
    pub fn lapse(&mut self) -> bool {
        if self.s.sql_down {
            return false;
        }
        let row = self.s.approval.as_ref().map(Approval::row);
        let executed = self.s.sql.is_some();
        match rules::lapse(row.as_ref(), executed, self.now_ms()) {
            Some(lapsed) => {
                self.s.approval = Some(Approval::of(&lapsed));
                true
            }
            None => false,
        }
    }

    /// The reaper's pass over `idem_approval`: `true` when it deleted the row.
    pub fn reap_approval(&mut self) -> bool {
        let Some(row) = self.s.approval.as_ref().map(Approval::row) else { return false };
        if self.s.sql_down || !rules::approval_reapable(&row, self.now_ms(), world::RETENTION_MS) {
            return false;
        }
        self.s.approval = None;
        true
    }

    /// One reaper pass: `true` when it deleted the row.
    pub fn reap(&mut self) -> bool {
        let Some(rec) = self.s.sql.as_ref().map(Row::record) else { return false };
        if self.s.sql_down || !rules::reapable(&rec, self.now_ms(), world::RETENTION_MS, self.cfg.broken()) {
            return false;
        }
        self.sql_put(None);
        true
    }
}

/// Store::replay: a terminal copy from Redis.
fn replay(outcome: AcquireOutcome, json: &str) -> AcquireResponse {
    let result: Option<StoredResult> = serde_json::from_str(json).ok();
    AcquireResponse { outcome, owner: None, result }
}

fn gated(outcome: AcquireOutcome, approval: Option<protocol::ApprovalView>) -> WithApproval<AcquireResponse> {
    WithApproval { answer: AcquireResponse { outcome, owner: None, result: None }, approval }
}

fn unavailable() -> AcquireResponse {
    AcquireResponse { outcome: AcquireOutcome::StoreUnavailable, owner: None, result: None }
}

/// One filter callout served: (status, body), or `None` when the replica crashed first.
pub fn serve(run: &mut Run<'_>, method: &str, path: &str, body: &[u8]) -> Option<(u16, Vec<u8>)> {
    let answer: Result<(u16, Vec<u8>), Crashed> = match (method, path.split('?').next().unwrap_or_default()) {
        ("POST", "/v1/acquire") => {
            let req: AcquireRequest = serde_json::from_slice(body).ok()?;
            run.acquire_answer(&req).map(|a| {
                let status = if a.answer.outcome == AcquireOutcome::StoreUnavailable { 503 } else { 200 };
                (status, serde_json::to_vec(&a).unwrap_or_default())
            })
        }
        ("POST", "/v1/complete") => {
            let req: CompleteRequest = serde_json::from_slice(body).ok()?;
            run.complete(&req).map(ack)
        }
        ("POST", "/v1/release") => {
            let req: ReleaseRequest = serde_json::from_slice(body).ok()?;
            run.release(&req).map(ack)
        }
        ("GET", p) if p.starts_with("/v1/operations/") => {
            let exp = path.split_once("?exp=").and_then(|(_, e)| e.parse().ok());
            run.lookup(exp)
        }
        _ => return None,
    };
    answer.ok()
}

fn ack(a: Ack) -> (u16, Vec<u8>) {
    let status = if a == Ack::StoreUnavailable { 503 } else { 200 };
    (status, serde_json::to_vec(&AckResponse { outcome: a }).unwrap_or_default())
}
