//! The four-state machine (DESIGN §4) over both stores.
//!
//! ```text
//! (empty) ──acquire──▶ IN_FLIGHT(owner, lease) ──complete──▶ DONE | FAILED
//!                          │ release (never reached the upstream) ──▶ (empty)
//!                          └ lease over: stays IN_FLIGHT until the reconciler
//!                            (`crate::reconcile`) decides DONE | FAILED | (empty)
//!                            | NEEDS_REVIEW, and a person resolves NEEDS_REVIEW
//!                            (`crate::ops`)
//! ```
//!
//! The rules that keep it at most once:
//!
//! - Only the SQL insert can make an ACQUIRED. Redis answers first and turns
//!   away the duplicates cheaply, but when it says ACQUIRED the SQL insert
//!   still has to win the primary key; if a row is there, Redis had lost
//!   state and the row is the answer (and is copied back into Redis).
//! - complete and release write SQL first (owner-checked), then Redis. A
//!   stale executor's write matches no row and gets NOT_OWNER.
//! - An IN_FLIGHT answer from Redis is checked against SQL, because Redis may
//!   keep an IN_FLIGHT that SQL already moved on from (complete or release
//!   happened while Redis was unreachable). So is NEEDS_REVIEW: an operator
//!   resolves it in SQL, possibly without reaching Redis. Terminal answers
//!   from Redis are trusted: they are only written after SQL has them.
//! - Every state change is written with its audit line in the same commit
//!   (`audit`).
//! - Redis down or erroring: the same answers from SQL alone.
//!   SQL down: nothing can be acquired (STORE_UNAVAILABLE: nothing ran, safe
//!   to retry), but what Redis already knows (replays, IN_FLIGHT) still answers.
//! - The truth never goes back in time (`replication`): an acquire the
//!   database's topology cannot keep through a failover (a standby; an
//!   asynchronous primary, for a route whose upstream ignores keys, unless the
//!   operator accepted that cost) is answered STORE_UNAVAILABLE before either
//!   store is touched: nothing recorded, nothing runs.

pub mod approval;
pub mod audit;
pub mod backlog;
mod claims;
mod group_commit;
pub mod record;
pub mod redis;
pub mod replication;
pub mod resolution;
pub mod retention;
pub mod rules;
pub mod sql;

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use idem_core::protocol::{
    Ack, AckResponse, AcquireOutcome, AcquireRequest, AcquireResponse, CompleteRequest, OpState, OperationView,
    OwnerToken, ReleaseRequest, RenewRequest, RenewResponse, SecurityKind, StoredResult, WithApproval,
};
use tokio::sync::Semaphore;
use tracing::{debug, info, warn, Instrument};

use self::audit::{Audit, SecurityEvent};
use self::record::Record;
use self::redis::{AcquireReply, Binding, RedisDown, RedisStore, WriteReply};
use self::replication::Replication;
use self::sql::{NewInFlight, SqlError, SqlStore};
use crate::metrics::Metrics;

/// How long a restored IN_FLIGHT copy lives in Redis once its SQL lease has
/// run out. Short: until the reconciler decides, SQL is asked again soon.
const EXPIRED_LEASE_CACHE_MS: u64 = 1_000;

/// A row that vanishes between the conflicting insert and the read (a release
/// raced us) is retried this often before giving up with STORE_UNAVAILABLE.
const MAX_ATTEMPTS: usize = 3;

/// The filter's calls carry no reason; the audit line says what the call means.
const FILTER: &str = "filter";

/// Security events written to SQL at once, at most. A flood of forged
/// fingerprints (each one a report) must not take the connections the
/// acquires need: past this the events wait their turn, in order.
pub const MAX_EVENT_WRITES: usize = 4;

/// Security events waiting to be written, at most: past this one is counted but not written
/// (`idem_security_events_unrecorded_total`), so a flood costs bounded memory. Each waits rather
/// than being dropped at once because a client must not decide which of its forgeries reach the
/// audit: a burst of junk ones once hid the next (four writes at once, the rest only counted).
pub const MAX_QUEUED_EVENTS: usize = 10_000;

#[derive(Clone, Debug)]
pub struct StoreSettings {
    /// The configured IN_FLIGHT lease; an acquire may ask for longer, never shorter.
    pub lease_ms: u64,
    /// How long DONE/FAILED stay replayable: in SQL at least this long after
    /// their last change and after their fingerprint's `exp` (`retention`),
    /// in Redis this long after completing (a lost copy is refilled from SQL).
    pub terminal_retention_ms: u64,
    /// An IN_FLIGHT in Redis with no SQL row, older than this, was left behind
    /// by a release that reached only SQL (a live acquirer inserts its row
    /// within one SQL timeout of taking the Redis gate).
    pub stale_in_flight_ms: u64,
}

/// SQL, the truth, could not answer.
#[derive(Debug)]
pub struct Unavailable(pub String);

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Health {
    /// "up", "down" or "off" (no --redis-url).
    pub redis: &'static str,
    /// "up" or "down".
    pub sql: &'static str,
}

pub struct Store {
    sql: SqlStore,
    redis: Option<RedisStore>,
    settings: StoreSettings,
    metrics: Arc<Metrics>,
    event_writes: Arc<Semaphore>,
    /// Security events counted and not yet written (waiting for, or holding, a write).
    events_pending: Arc<AtomicUsize>,
    /// Where a person approves (`--approval-console-url`): told to the agent with `approval_required`.
    console: Option<String>,
    /// `--accept-async-failover-risk`: on an asynchronously replicated database, acquire for upstreams that
    /// ignore keys anyway (a failover may then run an operation twice).
    accept_async_failover_risk: bool,
}

/// One security event counted in [`Store::events_pending`] until its write ends (or it is not
/// written): `None` when [`MAX_QUEUED_EVENTS`] are already pending.
struct Pending(Arc<AtomicUsize>);

impl Pending {
    fn enter(count: &Arc<AtomicUsize>) -> Option<Pending> {
        let entered = Pending(Arc::clone(count));
        (count.fetch_add(1, Ordering::AcqRel) < MAX_QUEUED_EVENTS).then_some(entered)
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How an attempt ended.
enum Step {
    Answer(AcquireResponse),
    /// Redis held a stale IN_FLIGHT and it was dropped: ask again.
    Again,
}

impl Store {
    pub fn new(sql: SqlStore, redis: Option<RedisStore>, settings: StoreSettings, metrics: Arc<Metrics>) -> Self {
        metrics.set_redis_configured(redis.is_some());
        metrics.set_redis_up(redis.is_some());
        metrics.set_sql_up(true);
        replication::show(&metrics, &sql.replication());
        metrics.replication_refusable(&replication::REFUSING);
        Self {
            sql,
            redis,
            settings,
            metrics,
            event_writes: Arc::new(Semaphore::new(MAX_EVENT_WRITES)),
            events_pending: Arc::new(AtomicUsize::new(0)),
            console: None,
            accept_async_failover_risk: false,
        }
    }

    /// `--accept-async-failover-risk`: acquire on an asynchronously replicated (or unreadable) topology for
    /// upstreams that ignore keys too, at the cost of a second execution after a failover that lost the
    /// acquire.
    pub fn accepting_async_failover_risk(mut self, accept: bool) -> Self {
        self.accept_async_failover_risk = accept;
        self.metrics.set_async_failover_risk_accepted(accept);
        self
    }

    pub fn accepts_async_failover_risk(&self) -> bool {
        self.accept_async_failover_risk
    }

    /// What the database promises, read now (the store probe, `/healthz`): kept for the acquires that follow,
    /// shown in the metrics, and logged when it changed.
    pub async fn refresh_replication(&self) -> Replication {
        let before = self.sql.replication();
        let now = self.sql.refresh_replication().await;
        replication::show(&self.metrics, &now);
        if now.mode != before.mode {
            warn!(from = before.mode.as_str(), to = now.mode.as_str(), detail = %now.detail, "SQL replication changed");
        }
        now
    }

    /// Name where a person approves: the URL the agent is told to send the user to.
    pub fn with_console(mut self, url: Option<String>) -> Self {
        self.console = url;
        self
    }

    pub fn console(&self) -> Option<&str> {
        self.console.as_deref()
    }

    pub fn sql(&self) -> &SqlStore {
        &self.sql
    }

    pub fn redis(&self) -> Option<&RedisStore> {
        self.redis.as_ref()
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    pub fn settings(&self) -> &StoreSettings {
        &self.settings
    }

    // ---- acquire -------------------------------------------------------

    pub async fn acquire(&self, req: &AcquireRequest) -> AcquireResponse {
        self.acquire_answer(req).await.answer
    }

    /// The acquire as the API answers it: with the approval record beside the outcome where the
    /// route asks a person first (DESIGN §4, "Approval"; `approval`).
    pub async fn acquire_answer(&self, req: &AcquireRequest) -> WithApproval<AcquireResponse> {
        // First, before anything is recorded anywhere: can this topology keep the acquire through a failover?
        let mode = self.sql.replication_mode();
        if let Some(why) = replication::refusal(mode, self.accept_async_failover_risk, req.upstream_ignores_keys) {
            warn!(key = %req.key, scope = %req.scope, replication = mode.as_str(), reason = why, "acquire refused");
            self.metrics.replication_refused(mode.as_str());
            let answer = unavailable();
            self.after_acquire(req, &answer);
            return WithApproval { answer, approval: None };
        }
        if let Some(gated) = self.approval_gate(req).await {
            self.after_acquire(req, &gated.answer);
            return gated;
        }
        let answer = self.acquire_plain(req).await;
        // The approval was given, but its row is not where the insert looked (reaped, or an
        // answer from the row that stopped the insert): carry what the row says.
        if matches!(
            answer.outcome,
            AcquireOutcome::AwaitingApproval | AcquireOutcome::Rejected | AcquireOutcome::Lapsed
        ) {
            let approval = self.approval_view(&req.key).await.ok().flatten();
            return WithApproval { answer, approval };
        }
        WithApproval { answer, approval: None }
    }

    async fn acquire_plain(&self, req: &AcquireRequest) -> AcquireResponse {
        let lease_ms = req.lease_ms.max(self.settings.lease_ms);
        let owner = new_owner();
        let mut answer = None;
        for _ in 0..MAX_ATTEMPTS {
            match self.acquire_once(req, &owner, lease_ms).await {
                Step::Answer(a) => {
                    answer = Some(a);
                    break;
                }
                Step::Again => continue,
            }
        }
        let answer = answer.unwrap_or_else(|| {
            warn!(key = %req.key, "acquire kept racing a release; answering STORE_UNAVAILABLE");
            unavailable()
        });
        self.after_acquire(req, &answer);
        answer
    }

    /// What every acquire's answer is followed by: the security event of a mismatch, the count.
    fn after_acquire(&self, req: &AcquireRequest, answer: &AcquireResponse) {
        if answer.outcome == AcquireOutcome::ParamMismatch {
            // A security event: someone reuses a nonce with other parameters,
            // another subject or scope. Never log the hashes' inputs. The
            // filter does not report this one (idemd saw it): idemd writes it,
            // off the acquire's path.
            warn!(key = %req.key, scope = %req.scope, security_event = "param_mismatch", "nonce reused with a different binding");
            let event = SecurityEvent {
                actor: "idemd",
                kind: SecurityKind::ParamsChanged,
                scope: req.scope.clone(),
                key: Some(req.key.to_string()),
                subject_hash: req.subject_hash.clone(),
                trace_id: req.trace_id.clone(),
                why: format!(
                    "params_changed on scope {}: an acquire named this operation with another binding \
                     (parameters, subject or scope) than it was acquired with",
                    req.scope
                ),
            };
            drop(self.security_event(event));
        }
        self.metrics.acquire(answer.outcome.as_str(), req.mode.as_str());
    }

    async fn acquire_once(&self, req: &AcquireRequest, owner: &str, lease_ms: u64) -> Step {
        let binding = Binding { param_hash: &req.param_hash, subject_hash: &req.subject_hash, scope: &req.scope };
        let reply = match &self.redis {
            None => None,
            Some(r) => self.redis_timed("acquire", r.acquire(&req.key, binding, owner, lease_ms)).await,
        };
        let Some(reply) = reply else {
            return Step::Answer(self.sql_acquire(req, owner, lease_ms, false).await);
        };
        match reply {
            AcquireReply::Acquired => Step::Answer(self.sql_acquire(req, owner, lease_ms, true).await),
            AcquireReply::InFlight { owner: holder, age_ms } => self.confirm_in_flight(req, holder, age_ms).await,
            AcquireReply::Done(json) => self.replay(req, owner, lease_ms, AcquireOutcome::Done, &json).await,
            AcquireReply::Failed(json) => self.replay(req, owner, lease_ms, AcquireOutcome::Failed, &json).await,
            AcquireReply::NeedsReview => self.confirm_needs_review(req).await,
            AcquireReply::ParamMismatch => {
                Step::Answer(AcquireResponse { outcome: AcquireOutcome::ParamMismatch, owner: None, result: None })
            }
        }
    }

    async fn replay(
        &self,
        req: &AcquireRequest,
        owner: &str,
        lease_ms: u64,
        outcome: AcquireOutcome,
        json: &str,
    ) -> Step {
        match serde_json::from_str::<StoredResult>(json) {
            Ok(result) => Step::Answer(AcquireResponse { outcome, owner: None, result: Some(result) }),
            Err(e) => {
                // A cache entry this version cannot read: drop it and let SQL
                // answer (and refill it).
                warn!(key = %req.key, error = %e, "unreadable result in Redis; asking SQL");
                self.evict(&req.key).await;
                Step::Answer(self.sql_acquire(req, owner, lease_ms, false).await)
            }
        }
    }

    /// The SQL gate: insert the IN_FLIGHT row, or answer from the row that is
    /// there. `gate_in_redis`: this attempt holds the Redis IN_FLIGHT, which
    /// must not outlive a failure here, and which is replaced by the row when
    /// the row wins.
    async fn sql_acquire(
        &self,
        req: &AcquireRequest,
        owner: &str,
        lease_ms: u64,
        gate_in_redis: bool,
    ) -> AcquireResponse {
        for _ in 0..MAX_ATTEMPTS {
            let now = now_ms();
            let row = NewInFlight {
                key: &req.key,
                param_hash: &req.param_hash,
                subject_hash: &req.subject_hash,
                scope: &req.scope,
                owner,
                lease_until_ms: now.saturating_add(i64::try_from(lease_ms).unwrap_or(i64::MAX)),
                now_ms: now,
                fp_exp_ms: req.exp.map(|s| i64::try_from(s.saturating_mul(1000)).unwrap_or(i64::MAX)),
                upstream_ignores_keys: req.upstream_ignores_keys,
                business_ref: req.business_ref.as_deref(),
                // Kept only beside a reference: what a record found under it must carry.
                bound_fields: req.fields.as_deref().filter(|_| req.business_ref.is_some()),
            };
            let audit = Audit {
                actor: FILTER,
                action: "acquire",
                why: "confirm acquired: forwarding to the upstream",
                trace_id: &req.trace_id,
            };
            let inserted = self.sql_timed("insert", self.sql.insert_in_flight(&row, &audit)).await;
            match inserted {
                Ok(true) => {
                    return AcquireResponse {
                        outcome: AcquireOutcome::Acquired,
                        owner: OwnerToken::parse(owner).ok(),
                        result: None,
                    }
                }
                Ok(false) => {}
                Err(e) => {
                    warn!(key = %req.key, error = %e, "SQL insert failed: STORE_UNAVAILABLE");
                    self.undo_acquire(&req.key, owner, gate_in_redis, matches!(e, SqlError::Timeout)).await;
                    return unavailable();
                }
            }
            match self.sql_timed("get", self.sql.get(&req.key)).await {
                Ok(Some(rec)) => {
                    if gate_in_redis {
                        debug!(key = %req.key, state = rec.state.as_str(), "Redis had lost this key; restoring the row");
                        self.metrics.redis_refill(rec.state.as_str());
                        self.restore(&rec).await;
                    }
                    return answer_from_row(&rec, req);
                }
                // No row: the insert was refused (an approval not given, a business reference
                // another operation holds), or the row was released between our insert and our read
                // (then try the insert again).
                Ok(None) => match self.refused_insert(req, now).await {
                    Ok(Some(outcome)) => {
                        self.undo_acquire(&req.key, owner, gate_in_redis, false).await;
                        return AcquireResponse { outcome, owner: None, result: None };
                    }
                    Ok(None) => continue,
                    Err(_) => {
                        self.undo_acquire(&req.key, owner, gate_in_redis, false).await;
                        return unavailable();
                    }
                },
                Err(e) => {
                    warn!(key = %req.key, error = %e, "SQL read failed: STORE_UNAVAILABLE");
                    self.undo_acquire(&req.key, owner, gate_in_redis, false).await;
                    return unavailable();
                }
            }
        }
        self.undo_acquire(&req.key, owner, gate_in_redis, false).await;
        unavailable()
    }

    /// The attempt answers STORE_UNAVAILABLE: leave nothing behind that would
    /// make a retry wait for an operation that never ran.
    async fn undo_acquire(&self, key: &str, owner: &str, gate_in_redis: bool, insert_may_have_committed: bool) {
        if gate_in_redis {
            if let Some(r) = &self.redis {
                self.redis_timed("release", r.release(key, owner)).await;
            }
        }
        if insert_may_have_committed {
            // The owner token was never handed out, so deleting a row with it
            // can only remove our own. Off the request path: SQL is struggling.
            let key = key.to_string();
            let owner = owner.to_string();
            let sql = self.sql.clone();
            tokio::spawn(async move {
                let audit = Audit {
                    actor: "idemd",
                    action: "release",
                    why: "the acquire's insert timed out; the caller was told to retry (STORE_UNAVAILABLE)",
                    trace_id: "",
                };
                if let Ok(true) = sql.release(&key, &owner, &audit).await {
                    debug!(%key, "removed the row of a timed-out insert");
                }
            });
        }
    }

    /// Redis says someone holds it. SQL has the last word on whether that is
    /// still so.
    async fn confirm_in_flight(&self, req: &AcquireRequest, holder: String, age_ms: i64) -> Step {
        let in_flight = |owner: String| AcquireResponse {
            outcome: AcquireOutcome::InFlight,
            owner: OwnerToken::parse(&owner).ok(),
            result: None,
        };
        match self.sql_timed("get", self.sql.get(&req.key)).await {
            Ok(Some(rec)) => {
                if rec.state != OpState::InFlight || rec.owner.as_deref() != Some(holder.as_str()) {
                    // SQL moved on while Redis could not be told.
                    self.restore(&rec).await;
                }
                Step::Answer(answer_from_row(&rec, req))
            }
            Ok(None) if age_ms > i64::try_from(self.settings.stale_in_flight_ms).unwrap_or(i64::MAX) => {
                // Released in SQL while Redis was unreachable. Drop the copy
                // (only if it is still that holder's) and start over.
                if let Some(r) = &self.redis {
                    if self.redis_timed("release", r.release(&req.key, &holder)).await.is_some() {
                        return Step::Again;
                    }
                }
                Step::Answer(in_flight(holder))
            }
            // The holder took the Redis gate a moment ago and is inserting its row now.
            Ok(None) => Step::Answer(in_flight(holder)),
            // SQL down: IN_FLIGHT is still the safe answer (nothing may run).
            Err(_) => Step::Answer(in_flight(holder)),
        }
    }

    /// Why an insert that found no row inserted nothing, if it was refused: the approval's answer
    /// (not given, or past `exp`), or REFERENCE_IN_USE when another operation of the scope holds the
    /// business reference (DESIGN §4, "A reference proves only its own operation": a reference two
    /// operations shared would let one be settled by the other's record). `None`: not refused
    /// (released meanwhile), insert again.
    async fn refused_insert(&self, req: &AcquireRequest, now: i64) -> Result<Option<AcquireOutcome>, SqlError> {
        if let Some(a) = self.sql_timed("approval_get", self.sql.approval(&req.key)).await? {
            if !rules::acquire_allowed(Some(&a), now) {
                let binding = (req.param_hash.as_str(), req.subject_hash.as_str(), req.scope.as_str());
                return Ok(Some(match rules::approval_gate(Some(&a), false, binding, now) {
                    rules::Gate::Answer(o) => o,
                    // Not allowed, so not APPROVED: awaiting is the closest honest word.
                    rules::Gate::Proceed | rules::Gate::Record => AcquireOutcome::AwaitingApproval,
                }));
            }
        }
        let Some(reference) = req.business_ref.as_deref() else { return Ok(None) };
        let holder = self.sql_timed("reference_get", self.sql.reference_holder(&req.scope, reference)).await?;
        match holder {
            Some(other) if other != req.key.as_str() => {
                info!(key = %req.key, scope = %req.scope, holder = %other, "business reference held by another operation: refused");
                Ok(Some(AcquireOutcome::ReferenceInUse))
            }
            _ => Ok(None),
        }
    }

    /// Redis says a person has to decide. SQL has the last word: an operator
    /// may have resolved it there without reaching Redis.
    async fn confirm_needs_review(&self, req: &AcquireRequest) -> Step {
        match self.sql_timed("get", self.sql.get(&req.key)).await {
            Ok(Some(rec)) => {
                if rec.state != OpState::NeedsReview {
                    // restore never moves the cache backwards, so drop the copy first.
                    self.evict(&req.key).await;
                    self.restore(&rec).await;
                }
                Step::Answer(answer_from_row(&rec, req))
            }
            // Released by an operator: the nonce is free again.
            Ok(None) => {
                self.evict(&req.key).await;
                Step::Again
            }
            // SQL down: the cached NEEDS_REVIEW is still the safe answer (nothing may run).
            Err(_) => Step::Answer(AcquireResponse { outcome: AcquireOutcome::NeedsReview, owner: None, result: None }),
        }
    }

    /// Bring the cache in line with a row SQL just changed: `Some` is the row
    /// as it is now, `None` means it is gone. Best effort: a cache that missed
    /// this is corrected by the next acquire, which checks SQL.
    pub async fn refresh_cache(&self, key: &str, now: Option<&Record>) {
        match now {
            Some(rec) => {
                self.evict(key).await;
                self.restore(rec).await;
            }
            None => self.evict(key).await,
        }
    }

    async fn restore(&self, rec: &Record) {
        let Some(r) = &self.redis else { return };
        let ttl_ms = match rec.state {
            OpState::InFlight => {
                let left = rec.lease_until_ms.unwrap_or(0).saturating_sub(now_ms());
                u64::try_from(left).unwrap_or(0).max(EXPIRED_LEASE_CACHE_MS)
            }
            // As long as SQL keeps the row (its fingerprint's exp counts too).
            OpState::Done | OpState::Failed | OpState::NeedsReview => {
                let left = retention::kept_until_ms(rec, self.settings.terminal_retention_ms).saturating_sub(now_ms());
                u64::try_from(left).unwrap_or(0).max(EXPIRED_LEASE_CACHE_MS)
            }
        };
        self.redis_timed("restore", r.restore(rec, ttl_ms)).await;
    }

    async fn evict(&self, key: &str) {
        if let Some(r) = &self.redis {
            self.redis_timed("evict", r.evict(key)).await;
        }
    }

    // ---- complete / release -------------------------------------------

    pub async fn complete(&self, req: &CompleteRequest) -> AckResponse {
        let outcome = self.complete_inner(req).await;
        self.metrics.complete(outcome.as_str());
        AckResponse { outcome }
    }

    async fn complete_inner(&self, req: &CompleteRequest) -> Ack {
        let result_json = match serde_json::to_string(&req.result) {
            Ok(j) => j,
            Err(e) => {
                warn!(key = %req.key, error = %e, "result does not serialize");
                return Ack::StoreUnavailable;
            }
        };
        let state = req.state.as_str();
        let why = format!("upstream answered {}", req.result.status);
        let audit = Audit { actor: FILTER, action: "complete", why: &why, trace_id: &req.trace_id };
        let updated = self
            .sql_timed("complete", self.sql.complete(&req.key, &req.owner, req.state, &result_json, now_ms(), &audit))
            .await;
        match updated {
            Ok(true) => {}
            Ok(false) => {
                // The filter may retry a complete whose answer it lost: the same
                // owner with the same outcome is a success, not a conflict.
                match self.sql_timed("get", self.sql.get(&req.key)).await {
                    Ok(Some(rec)) if rules::is_repeat(&rec, req.owner.as_str(), req.state, &req.result) => {}
                    Ok(_) => return Ack::NotOwner,
                    Err(_) => return Ack::StoreUnavailable,
                }
            }
            Err(e) => {
                warn!(key = %req.key, error = %e, "SQL complete failed: STORE_UNAVAILABLE");
                return Ack::StoreUnavailable;
            }
        }
        if let Some(r) = &self.redis {
            if let Some(WriteReply::NotOwner) = self
                .redis_timed(
                    "complete",
                    r.complete(&req.key, &req.owner, state, &result_json, self.settings.terminal_retention_ms),
                )
                .await
            {
                // The cache holds some other attempt's view; SQL has the truth.
                // Drop the copy so the next acquire refills it from the row.
                debug!(key = %req.key, "Redis disagreed with SQL on complete; evicting");
                self.evict(&req.key).await;
            }
        }
        Ack::Ok
    }

    pub async fn release(&self, req: &ReleaseRequest) -> AckResponse {
        let outcome = self.release_inner(req).await;
        self.metrics.release(outcome.as_str());
        AckResponse { outcome }
    }

    async fn release_inner(&self, req: &ReleaseRequest) -> Ack {
        let audit = Audit {
            actor: FILTER,
            action: "release",
            why: "the request never reached the upstream",
            trace_id: &req.trace_id,
        };
        match self.sql_timed("release", self.sql.release(&req.key, &req.owner, &audit)).await {
            Ok(true) => {}
            Ok(false) => return Ack::NotOwner,
            Err(e) => {
                warn!(key = %req.key, error = %e, "SQL release failed: STORE_UNAVAILABLE");
                return Ack::StoreUnavailable;
            }
        }
        if let Some(r) = &self.redis {
            // NOT_OWNER here means the cache holds another attempt's gate or a
            // stale copy; either resolves against SQL on the next acquire.
            self.redis_timed("release", r.release(&req.key, &req.owner)).await;
        }
        Ack::Ok
    }

    // ---- renew ---------------------------------------------------------

    /// Extend the leases of requests still upstream (DESIGN §4: a lease cannot lapse under a
    /// live request). Each for the longer of the route's lease and the configured one, as at
    /// acquire; SQL decides (the reconciler claims by SQL's lease), Redis follows. `Err` when
    /// SQL could not be asked: the filter sends the leases again a third of a lease later.
    pub async fn renew(&self, req: &RenewRequest) -> Result<RenewResponse, SqlError> {
        let mut lost = Vec::new();
        for lease in &req.leases {
            let lease_ms = lease.lease_ms.max(self.settings.lease_ms);
            let until = now_ms().saturating_add(i64::try_from(lease_ms).unwrap_or(i64::MAX));
            let renewed = self.sql_timed("renew", self.sql.renew(&lease.key, &lease.owner, until)).await?;
            self.metrics.lease_renewal(if renewed { "renewed" } else { "lost" });
            if !renewed {
                debug!(key = %lease.key, "renewal for an owner that no longer holds the lease");
                lost.push(lease.key.clone());
                continue;
            }
            if let Some(r) = &self.redis {
                self.redis_timed("renew", r.renew(&lease.key, &lease.owner, lease_ms)).await;
            }
        }
        Ok(RenewResponse { lost })
    }

    // ---- security events -----------------------------------------------

    /// Count a security event and write its audit line. The write runs in a
    /// task of its own, bounded by the SQL timeout, so a caller that goes away
    /// (the filter never waits for the answer) does not cancel it, and a
    /// caller that does wait may drop the handle to not wait. The handle
    /// answers `false` when the line was not written (SQL down or slow, or
    /// [`MAX_QUEUED_EVENTS`] already waiting). At most [`MAX_EVENT_WRITES`]
    /// run at once; the rest wait their turn in order (the semaphore is fair).
    pub fn security_event(&self, event: SecurityEvent) -> tokio::task::JoinHandle<bool> {
        self.metrics.security_event(event.kind.as_str());
        let pending = Pending::enter(&self.events_pending);
        let writes = Arc::clone(&self.event_writes);
        let (sql, metrics) = (self.sql.clone(), Arc::clone(&self.metrics));
        tokio::spawn(async move {
            let permit = match pending {
                Some(_) => writes.acquire_owned().await.ok(),
                None => None,
            };
            let Some(_permit) = permit else {
                warn!(kind = event.kind.as_str(), "too many security events waiting: counted, not written");
                metrics.security_event_unrecorded();
                return false;
            };
            let started = Instant::now();
            let written = sql.record_event(&event, now_ms()).await;
            metrics.observe("sql", "event", started);
            match written {
                Ok(()) => {
                    metrics.set_sql_up(true);
                    true
                }
                Err(e) => {
                    warn!(kind = event.kind.as_str(), error = %e, "security event not written to the audit trail");
                    if !matches!(e, SqlError::Corrupt(_)) {
                        metrics.set_sql_up(false);
                    }
                    metrics.security_event_unrecorded();
                    false
                }
            }
        })
    }

    // ---- reads ---------------------------------------------------------

    /// The operation as SQL (the truth) has it.
    pub async fn operation(&self, key: &str) -> Result<Option<OperationView>, Unavailable> {
        match self.sql_timed("get", self.sql.get(key)).await {
            Ok(rec) => Ok(rec.map(view)),
            Err(e) => Err(Unavailable(e.to_string())),
        }
    }

    /// Asks both stores now, whatever the last calls saw.
    pub async fn health(&self) -> Health {
        let redis = match &self.redis {
            None => "off",
            Some(r) => match self.redis_timed("ping", r.ping()).await {
                Some(()) => "up",
                None => "down",
            },
        };
        let sql = match self.sql_timed("ping", self.sql.ping()).await {
            Ok(()) => "up",
            Err(_) => "down",
        };
        Health { redis, sql }
    }

    // ---- bookkeeping ---------------------------------------------------

    /// One Redis call, timed and judged: its value, or `None` when SQL must answer alone.
    async fn redis_timed<T>(&self, op: &'static str, call: impl Future<Output = Result<T, RedisDown>>) -> Option<T> {
        let span = store_span("redis", op);
        let started = Instant::now();
        let r = call.instrument(span.clone()).await;
        if r.is_err() {
            span.record("otel.status_code", "ERROR");
        }
        match r {
            Ok(v) => {
                self.metrics.observe("redis", op, started);
                self.metrics.set_redis_up(true);
                Some(v)
            }
            Err(RedisDown::Skipped) => {
                self.metrics.redis_fallback();
                None
            }
            Err(e) => {
                // Failures are timed too: a timeout shows up as a spike at the budget.
                self.metrics.observe("redis", op, started);
                warn!(op, error = %e, "Redis unavailable; serving from SQL alone");
                self.metrics.redis_fallback();
                self.metrics.set_redis_up(false);
                None
            }
        }
    }

    /// One SQL call, timed, with the store's up/down gauge following it.
    async fn sql_timed<T>(
        &self,
        op: &'static str,
        call: impl Future<Output = Result<T, SqlError>>,
    ) -> Result<T, SqlError> {
        let span = store_span(self.sql.backend().name(), op);
        let started = Instant::now();
        let r = call.instrument(span.clone()).await;
        if r.is_err() {
            span.record("otel.status_code", "ERROR");
        }
        self.metrics.observe("sql", op, started);
        match &r {
            Ok(_) => self.metrics.set_sql_up(true),
            // A row this version cannot read is not an outage.
            Err(SqlError::Corrupt(_)) => {}
            Err(_) => self.metrics.set_sql_up(false),
        }
        r
    }
}

/// One store call's span (DESIGN §8), a child of the API call's (or the
/// reconciler's row): `debug`, so it costs a disabled callsite unless traces are
/// exported. Outside any span (the health probe's pings) there is none: a root
/// trace per ping would bury the requests' traces.
fn store_span(system: &'static str, op: &'static str) -> tracing::Span {
    if tracing::Span::current().is_none() {
        return tracing::Span::none();
    }
    tracing::debug_span!(
        "store",
        otel.name = %format_args!("{system} {op}"),
        otel.kind = "client",
        db.system.name = system,
        db.operation.name = op,
        otel.status_code = tracing::field::Empty,
    )
}

fn unavailable() -> AcquireResponse {
    AcquireResponse { outcome: AcquireOutcome::StoreUnavailable, owner: None, result: None }
}

/// The answer a row gives to an acquire that did not get it.
fn answer_from_row(rec: &Record, req: &AcquireRequest) -> AcquireResponse {
    rules::answer_from_row(rec, &req.param_hash, &req.subject_hash, &req.scope)
}

/// What `GET /v1/operations/{key}` shows of a row.
pub fn view(rec: Record) -> OperationView {
    OperationView {
        key: rec.key,
        state: rec.state,
        scope: rec.scope,
        subject_hash: rec.subject_hash,
        param_hash: rec.param_hash,
        owner: rec.owner.as_deref().and_then(|o| OwnerToken::parse(o).ok()),
        result: rec.result,
        lease_until_ms: rec.lease_until_ms,
        created_at_ms: rec.created_at_ms,
        updated_at_ms: rec.updated_at_ms,
    }
}

/// A fresh owner token: 128 random bits as 32 lowercase hex chars.
pub fn new_owner() -> String {
    let mut bytes = [0u8; 16];
    if getrandom::fill(&mut bytes).is_err() {
        // Without OS randomness an owner could be guessed or repeated; refusing
        // every acquire is worse than this fallback, which is still unique
        // per process and time.
        let t = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        bytes = (t ^ (u128::from(std::process::id()) << 96)).to_le_bytes();
    }
    hex::encode(bytes)
}

pub fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_are_128_bit_lowercase_hex_and_differ() {
        let a = new_owner();
        let b = new_owner();
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)));
        assert_ne!(a, b);
    }

    /// Security events wait for a write up to MAX_QUEUED_EVENTS pending; one more is refused,
    /// and a place frees when an event's write ends.
    #[test]
    fn pending_security_events_are_bounded_and_freed() {
        let count = Arc::new(AtomicUsize::new(0));
        let held: Vec<Pending> = (0..MAX_QUEUED_EVENTS).filter_map(|_| Pending::enter(&count)).collect();
        assert_eq!(held.len(), MAX_QUEUED_EVENTS);
        assert!(Pending::enter(&count).is_none(), "one past the bound is not queued");
        assert_eq!(count.load(Ordering::Acquire), MAX_QUEUED_EVENTS, "a refused one leaves no count");
        drop(held);
        assert_eq!(count.load(Ordering::Acquire), 0);
        assert!(Pending::enter(&count).is_some());
    }
}
