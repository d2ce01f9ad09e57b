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
//! - The truth never goes back in time (`sql::replication`): an acquire the
//!   database's topology cannot keep through a failover (a standby; an
//!   asynchronous primary, for a route whose upstream ignores keys, unless the
//!   operator accepted that cost) is answered STORE_UNAVAILABLE before either
//!   store is touched: nothing recorded, nothing runs.

pub mod approval;
pub mod backlog;
mod claims;
pub mod flow;
pub mod record;
pub mod redis;
pub mod resolution;
pub mod retention;
pub mod rules;
pub mod sql;

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use idem_core::protocol::{
    Ack, AckResponse, AcquireOutcome, AcquireRequest, AcquireResponse, CompleteRequest, OperationView, OwnerToken,
    ReleaseRequest, RenewRequest, RenewResponse, SecurityKind, WithApproval,
};
use tokio::sync::Semaphore;
use tracing::{debug, warn, Instrument};

use crate::evidence::Asked;

use self::flow::{Call, Flow, Next, Note, Reply, Said, SqlAnswer, SqlFail};
use self::record::Record;
use self::redis::{Binding, RedisDown, RedisStore};
use self::rules::Broken;
use self::sql::audit::{Audit, SecurityEvent};
use self::sql::replication::{self, Replication};
use self::sql::{NewInFlight, SqlError, SqlStore};
use crate::metrics::Metrics;

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

impl From<SqlError> for SqlFail {
    fn from(e: SqlError) -> Self {
        match e {
            SqlError::Timeout => SqlFail::Timeout,
            SqlError::Corrupt(what) => SqlFail::Corrupt(what),
            other => SqlFail::Down(other.to_string()),
        }
    }
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
            let answer = AcquireResponse { outcome: AcquireOutcome::ReplicationRefused, owner: None, result: None };
            self.after_acquire(req, &answer);
            return WithApproval { answer, approval: None };
        }
        let answer = self.acquire_plain(req).await;
        self.after_acquire(req, &answer.answer);
        answer
    }

    async fn acquire_plain(&self, req: &AcquireRequest) -> WithApproval<AcquireResponse> {
        let settings = self.flow_settings();
        let req = req.clone();
        self.drive(Flow::new(|io| flow::acquire::acquire_answer(io, req, settings))).await
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

    /// Bring the cache in line with a row SQL just changed: `Some` is the row
    /// as it is now, `None` means it is gone. Best effort: a cache that missed
    /// this is corrected by the next acquire, which checks SQL.
    pub async fn refresh_cache(&self, key: &str, now: Option<&Record>) {
        let (settings, key, now) = (self.flow_settings(), key.to_string(), now.cloned());
        self.drive(Flow::new(
            |io| async move { flow::acquire::refresh_cache(&io, &settings, &key, now.as_ref()).await },
        ))
        .await;
    }

    // ---- complete / release -------------------------------------------

    pub async fn complete(&self, req: &CompleteRequest) -> AckResponse {
        let outcome = self.complete_inner(req).await;
        self.metrics.complete(outcome.as_str());
        AckResponse { outcome }
    }

    async fn complete_inner(&self, req: &CompleteRequest) -> Ack {
        let (settings, req) = (self.flow_settings(), req.clone());
        self.drive(Flow::new(|io| flow::write::complete(io, req, settings))).await
    }

    pub async fn release(&self, req: &ReleaseRequest) -> AckResponse {
        let outcome = self.release_inner(req).await;
        self.metrics.release(outcome.as_str());
        AckResponse { outcome }
    }

    async fn release_inner(&self, req: &ReleaseRequest) -> Ack {
        let req = req.clone();
        self.drive(Flow::new(|io| flow::write::release(io, req))).await
    }

    // ---- renew ---------------------------------------------------------

    /// Extend the leases of requests still upstream (DESIGN §4: a lease cannot lapse under a
    /// live request). Each for the longer of the route's lease and the configured one, as at
    /// acquire; SQL decides (the reconciler claims by SQL's lease), Redis follows. `Err` when
    /// SQL could not be asked: the filter sends the leases again a third of a lease later.
    pub async fn renew(&self, req: &RenewRequest) -> Result<RenewResponse, SqlFail> {
        let mut lost = Vec::new();
        for lease in &req.leases {
            let (settings, one) = (self.flow_settings(), lease.clone());
            if !self.drive(Flow::new(|io| flow::write::renew(io, one, settings))).await? {
                lost.push(lease.key.clone());
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

    /// `GET /v1/operations/{key}`: the row, or a 404 with the approval row beside it.
    pub async fn lookup(&self, key: &str, exp: Option<u64>) -> flow::write::Lookup {
        let (settings, key) = (self.flow_settings(), key.to_string());
        self.drive(Flow::new(|io| flow::write::lookup(io, key, exp, settings))).await
    }

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

    // ---- the driver of the flows ---------------------------------------

    /// What the flows need of the configuration; idemd never breaks a rule.
    pub(crate) fn flow_settings(&self) -> flow::acquire::Settings {
        flow::acquire::Settings {
            store: self.settings.clone(),
            console: self.console.clone(),
            clock_skew_ms: retention::CLOCK_SKEW_MS,
            broken: Broken::None,
        }
    }

    /// Run a flow to its answer, carrying out each call against Redis and SQL.
    pub(crate) async fn drive<T>(&self, mut flow: Flow<T>) -> T {
        let mut reply = None;
        loop {
            let next = flow.next(reply.take());
            for note in flow.notes() {
                self.noted(note);
            }
            match next {
                Next::Done(t) => return t,
                Next::Call(call) => reply = Some(self.carry_out(call).await),
            }
        }
    }

    pub(crate) fn noted(&self, note: Note) {
        match note {
            Note::RedisRefill(state) => self.metrics.redis_refill(state),
            Note::LeaseRenewal(renewed) => self.metrics.lease_renewal(if renewed { "renewed" } else { "lost" }),
            Note::Awaiting => self.metrics.approval("awaiting"),
            Note::Lookup(scope, result) => self.metrics.lookup(&scope, result),
        }
    }

    /// One call of a flow, timed and judged. The status lookup is the reconciler's to carry out.
    pub(crate) async fn carry_out(&self, call: Call) -> Reply {
        fn audit(said: &Said) -> Audit<'_> {
            Audit { actor: &said.actor, action: said.action, why: &said.why, trace_id: &said.trace_id }
        }
        let sql = |r: Result<SqlAnswer, SqlError>| Reply::Sql(r.map_err(SqlFail::from));
        let changed = |r: Result<bool, SqlError>| sql(r.map(SqlAnswer::Changed));
        let redis = |r: Option<Reply>| r.unwrap_or(Reply::RedisDown);
        match call {
            Call::Now => Reply::Now(now_ms()),
            Call::NewOwner => Reply::Owner(new_owner()),
            Call::Lookup { .. } => Reply::Asked(Asked::NoEndpoint),
            Call::RedisAcquire { key, param_hash, subject_hash, scope, owner, lease_ms } => {
                let Some(r) = &self.redis else { return Reply::RedisDown };
                let binding = Binding { param_hash: &param_hash, subject_hash: &subject_hash, scope: &scope };
                redis(self.redis_timed("acquire", r.acquire(&key, binding, &owner, lease_ms)).await.map(Reply::Acquire))
            }
            Call::RedisComplete { key, owner, state, result_json, retention_ms } => {
                let Some(r) = &self.redis else { return Reply::RedisDown };
                let call = r.complete(&key, &owner, state.as_str(), &result_json, retention_ms);
                redis(self.redis_timed("complete", call).await.map(Reply::Write))
            }
            Call::RedisRelease { key, owner } => {
                let Some(r) = &self.redis else { return Reply::RedisDown };
                redis(self.redis_timed("release", r.release(&key, &owner)).await.map(Reply::Write))
            }
            Call::RedisRenew { key, owner, lease_ms } => {
                let Some(r) = &self.redis else { return Reply::RedisDown };
                redis(self.redis_timed("renew", r.renew(&key, &owner, lease_ms)).await.map(Reply::Write))
            }
            Call::RedisRestore { rec, ttl_ms } => {
                let Some(r) = &self.redis else { return Reply::RedisDown };
                redis(self.redis_timed("restore", r.restore(&rec, ttl_ms)).await.map(|()| Reply::Done))
            }
            Call::RedisEvict { key } => {
                let Some(r) = &self.redis else { return Reply::RedisDown };
                redis(self.redis_timed("evict", r.evict(&key)).await.map(|()| Reply::Done))
            }
            Call::SqlInsertInFlight { row, said } => {
                let new = NewInFlight {
                    key: &row.key,
                    param_hash: &row.param_hash,
                    subject_hash: &row.subject_hash,
                    scope: &row.scope,
                    owner: &row.owner,
                    lease_until_ms: row.lease_until_ms,
                    now_ms: row.now_ms,
                    fp_exp_ms: row.fp_exp_ms,
                    upstream_ignores_keys: row.upstream_ignores_keys,
                    business_ref: row.business_ref.as_deref(),
                    bound_fields: row.bound_fields.as_deref(),
                };
                changed(self.sql_timed("insert", self.sql.insert_in_flight(&new, &audit(&said))).await)
            }
            Call::SqlGet { key } => sql(self.sql_timed("get", self.sql.get(&key)).await.map(SqlAnswer::Row)),
            Call::SqlApproval { key } => {
                sql(self.sql_timed("approval_get", self.sql.approval(&key)).await.map(SqlAnswer::Approval))
            }
            Call::SqlReferenceHolder { scope, reference } => {
                let call = self.sql.reference_holder(&scope, &reference);
                sql(self.sql_timed("reference_get", call).await.map(SqlAnswer::Holder))
            }
            Call::SqlInsertAwaiting { row, said } => {
                changed(self.sql_timed("approval_insert", self.sql.insert_awaiting(&row, &audit(&said))).await)
            }
            Call::SqlComplete { key, owner, state, result_json, now_ms, said } => {
                let audit = audit(&said);
                changed(
                    self.sql_timed("complete", self.sql.complete(&key, &owner, state, &result_json, now_ms, &audit))
                        .await,
                )
            }
            Call::SqlRelease { key, owner, said } => {
                changed(self.sql_timed("release", self.sql.release(&key, &owner, &audit(&said))).await)
            }
            Call::SqlReleaseDetached { key, owner, said } => {
                let sql = self.sql.clone();
                tokio::spawn(async move {
                    if let Ok(true) = sql.release(&key, &owner, &audit(&said)).await {
                        debug!(%key, "removed the row of a timed-out insert");
                    }
                });
                Reply::Done
            }
            Call::SqlRenew { key, owner, until_ms } => {
                changed(self.sql_timed("renew", self.sql.renew(&key, &owner, until_ms)).await)
            }
            Call::SqlClaim { rec, token, until_ms, now_ms } => {
                changed(self.sql_timed("claim", self.sql.claim(&rec, &token, until_ms, now_ms)).await)
            }
            Call::SqlUnclaim { rec, token, failed, said } => {
                let audit = said.as_ref().map(audit);
                changed(self.sql_timed("unclaim", self.sql.unclaim(&rec, &token, failed, audit.as_ref())).await)
            }
            Call::SqlMarkNeedsReview { rec, token, now_ms, said } => {
                let audit = audit(&said);
                changed(
                    self.sql_timed("mark_needs_review", self.sql.mark_needs_review(&rec, &token, now_ms, &audit)).await,
                )
            }
        }
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
