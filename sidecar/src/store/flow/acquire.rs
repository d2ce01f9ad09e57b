//! The acquire (DESIGN §4): the approval gate where the route asks a person, then Redis first,
//! SQL the truth, the row copied back into Redis, and the Redis gate undone when SQL fails.

use idem_core::protocol::{
    AcquireOutcome, AcquireRequest, AcquireResponse, OpState, OwnerToken, StoredResult, WithApproval,
};
use tracing::{debug, info, warn};

use super::{Call, InFlightRow, Note, Port, Reply, Said, SqlAnswer, SqlFail};
use crate::store::record::{ApprovalRow, Record};
use crate::store::redis::AcquireReply;
use crate::store::rules::{self, Broken, Gate};
use crate::store::{retention, StoreSettings};

/// How long a restored IN_FLIGHT copy lives in Redis once its SQL lease has
/// run out. Short: until the reconciler decides, SQL is asked again soon.
pub const EXPIRED_LEASE_CACHE_MS: u64 = 1_000;

/// A row that vanishes between the conflicting insert and the read (a release
/// raced us) is retried this often before giving up with STORE_UNAVAILABLE.
pub const MAX_ATTEMPTS: usize = 3;

/// The filter's calls carry no reason; the audit line says what the call means.
pub const FILTER: &str = "filter";

/// What the flows need to know of the store's configuration.
#[derive(Clone, Debug)]
pub struct Settings {
    pub store: StoreSettings,
    /// Where a person approves (`--approval-console-url`).
    pub console: Option<String>,
    /// How far replicas' clocks may disagree: a terminal row is kept (and its Redis copy lives)
    /// this much past its fingerprint's `exp` plus the retention (`retention::CLOCK_SKEW_MS`).
    pub clock_skew_ms: i64,
    /// The model checker's mutation switch; idemd always passes [`Broken::None`].
    pub broken: Broken,
}

/// How an attempt ended.
enum Step {
    Answer(AcquireResponse),
    /// Redis held a stale IN_FLIGHT and it was dropped: ask again.
    Again,
}

pub fn unavailable() -> AcquireResponse {
    AcquireResponse { outcome: AcquireOutcome::StoreUnavailable, owner: None, result: None }
}

fn gated(
    outcome: AcquireOutcome,
    approval: Option<idem_core::protocol::ApprovalView>,
) -> WithApproval<AcquireResponse> {
    WithApproval { answer: AcquireResponse { outcome, owner: None, result: None }, approval }
}

/// The acquire as the API answers it: with the approval record beside the outcome where the
/// route asks a person first.
pub async fn acquire_answer(io: Port, req: AcquireRequest, s: Settings) -> WithApproval<AcquireResponse> {
    if let Some(gated) = approval_gate(&io, &req, &s).await {
        return gated;
    }
    let answer = acquire_plain(&io, &req, &s).await;
    // The approval was given, but its row is not where the insert looked (reaped, or an
    // answer from the row that stopped the insert): carry what the row says.
    if matches!(answer.outcome, AcquireOutcome::AwaitingApproval | AcquireOutcome::Rejected | AcquireOutcome::Lapsed) {
        let approval = io.sql_approval(&req.key).await.ok().flatten().and_then(|r| r.view(s.console.as_deref()));
        return WithApproval { answer, approval };
    }
    WithApproval { answer, approval: None }
}

/// An acquire of a route that asks for approval: record it, answer from its approval row, or
/// (`None`) let an APPROVED operation go on to the ordinary acquire.
async fn approval_gate(io: &Port, req: &AcquireRequest, s: &Settings) -> Option<WithApproval<AcquireResponse>> {
    let ask = req.approval.as_ref()?;
    let binding = (req.param_hash.as_str(), req.subject_hash.as_str(), req.scope.as_str());
    let exp_ms = req.exp.map(|s| i64::try_from(s.saturating_mul(1000)).unwrap_or(i64::MAX));
    for _ in 0..2 {
        let now = io.now().await;
        let row = match io.sql_approval(&req.key).await {
            Ok(r) => r,
            Err(e) => {
                warn!(key = %req.key, error = %e, "SQL read of the approval failed: STORE_UNAVAILABLE");
                return Some(gated(AcquireOutcome::StoreUnavailable, None));
            }
        };
        // No approval row yet: has the operation started without one? Then its row answers.
        let started = match &row {
            Some(_) => false,
            None => match io.sql_row(&req.key).await {
                Ok(record) => record.is_some(),
                Err(e) => {
                    warn!(key = %req.key, error = %e, "SQL read of the record failed: STORE_UNAVAILABLE");
                    return Some(gated(AcquireOutcome::StoreUnavailable, None));
                }
            },
        };
        match rules::approval_gate(row.as_ref(), started, binding, now) {
            Gate::Proceed => return None,
            Gate::Answer(outcome) => {
                let view = row.as_ref().filter(|_| outcome != AcquireOutcome::ParamMismatch);
                return Some(gated(outcome, view.and_then(|r| r.view(s.console.as_deref()))));
            }
            Gate::Record => {}
        }
        // An approval belongs to a fingerprint, and lapses at its exp; a client key has none.
        let Some(exp_ms) = exp_ms else { return Some(gated(AcquireOutcome::StoreUnavailable, None)) };
        let new = ApprovalRow::awaiting(req, ask, exp_ms, now);
        let said = Said {
            actor: FILTER.into(),
            action: "await_approval",
            why: "the route asks a person to approve this confirm; nothing forwarded".into(),
            trace_id: req.trace_id.clone(),
        };
        match io.sql_changed(Call::SqlInsertAwaiting { row: new.clone(), said }).await {
            Ok(true) => {
                io.note(Note::Awaiting);
                return Some(gated(AcquireOutcome::AwaitingApproval, new.view(s.console.as_deref())));
            }
            // Another confirm recorded it a moment ago: read it again.
            Ok(false) => continue,
            Err(e) => {
                warn!(key = %req.key, error = %e, "SQL insert of the approval failed: STORE_UNAVAILABLE");
                return Some(gated(AcquireOutcome::StoreUnavailable, None));
            }
        }
    }
    Some(gated(AcquireOutcome::StoreUnavailable, None))
}

async fn acquire_plain(io: &Port, req: &AcquireRequest, s: &Settings) -> AcquireResponse {
    let lease_ms = req.lease_ms.max(s.store.lease_ms);
    let owner = io.new_owner().await;
    for _ in 0..MAX_ATTEMPTS {
        match acquire_once(io, req, s, &owner, lease_ms).await {
            Step::Answer(a) => return a,
            Step::Again => continue,
        }
    }
    warn!(key = %req.key, "acquire kept racing a release; answering STORE_UNAVAILABLE");
    unavailable()
}

async fn acquire_once(io: &Port, req: &AcquireRequest, s: &Settings, owner: &str, lease_ms: u64) -> Step {
    let call = Call::RedisAcquire {
        key: req.key.to_string(),
        param_hash: req.param_hash.clone(),
        subject_hash: req.subject_hash.clone(),
        scope: req.scope.clone(),
        owner: owner.to_string(),
        lease_ms,
    };
    let reply = match io.call(call).await {
        Reply::Acquire(r) => r,
        // Redis off, down or answering nonsense: SQL alone.
        _ => return Step::Answer(sql_acquire(io, req, s, owner, lease_ms, false).await),
    };
    match reply {
        AcquireReply::Acquired if s.broken == Broken::AcquiredByRedisAlone => Step::Answer(AcquireResponse {
            outcome: AcquireOutcome::Acquired,
            owner: OwnerToken::parse(owner).ok(),
            result: None,
        }),
        AcquireReply::Acquired => Step::Answer(sql_acquire(io, req, s, owner, lease_ms, true).await),
        AcquireReply::InFlight { owner: holder, age_ms } => confirm_in_flight(io, req, s, holder, age_ms).await,
        AcquireReply::Done(json) => replay(io, req, s, owner, lease_ms, AcquireOutcome::Done, &json).await,
        AcquireReply::Failed(json) => replay(io, req, s, owner, lease_ms, AcquireOutcome::Failed, &json).await,
        AcquireReply::NeedsReview => confirm_needs_review(io, req, s).await,
        AcquireReply::ParamMismatch => {
            Step::Answer(AcquireResponse { outcome: AcquireOutcome::ParamMismatch, owner: None, result: None })
        }
    }
}

async fn replay(
    io: &Port,
    req: &AcquireRequest,
    s: &Settings,
    owner: &str,
    lease_ms: u64,
    outcome: AcquireOutcome,
    json: &str,
) -> Step {
    match serde_json::from_str::<StoredResult>(json) {
        Ok(result) => Step::Answer(AcquireResponse { outcome, owner: None, result: Some(result) }),
        Err(e) => {
            // A cache entry this version cannot read: drop it and let SQL answer (and refill it).
            warn!(key = %req.key, error = %e, "unreadable result in Redis; asking SQL");
            evict(io, &req.key).await;
            Step::Answer(sql_acquire(io, req, s, owner, lease_ms, false).await)
        }
    }
}

/// The SQL gate: insert the IN_FLIGHT row, or answer from the row that is there.
/// `gate_in_redis`: this attempt holds the Redis IN_FLIGHT, which must not outlive a failure
/// here, and which is replaced by the row when the row wins.
async fn sql_acquire(
    io: &Port,
    req: &AcquireRequest,
    s: &Settings,
    owner: &str,
    lease_ms: u64,
    gate_in_redis: bool,
) -> AcquireResponse {
    for _ in 0..MAX_ATTEMPTS {
        let now = io.now().await;
        let row = InFlightRow {
            key: req.key.to_string(),
            param_hash: req.param_hash.clone(),
            subject_hash: req.subject_hash.clone(),
            scope: req.scope.clone(),
            owner: owner.to_string(),
            lease_until_ms: now.saturating_add(i64::try_from(lease_ms).unwrap_or(i64::MAX)),
            now_ms: now,
            fp_exp_ms: req.exp.map(|s| i64::try_from(s.saturating_mul(1000)).unwrap_or(i64::MAX)),
            upstream_ignores_keys: req.upstream_ignores_keys,
            business_ref: req.business_ref.clone(),
            // Kept only beside a reference: what a record found under it must carry.
            bound_fields: req.fields.clone().filter(|_| req.business_ref.is_some()),
        };
        let said = Said {
            actor: FILTER.into(),
            action: "acquire",
            why: "confirm acquired: forwarding to the upstream".into(),
            trace_id: req.trace_id.clone(),
        };
        match io.sql_changed(Call::SqlInsertInFlight { row, said }).await {
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
                undo_acquire(io, req, owner, gate_in_redis, e == SqlFail::Timeout).await;
                return unavailable();
            }
        }
        match io.sql_row(&req.key).await {
            Ok(Some(rec)) => {
                if gate_in_redis {
                    debug!(key = %req.key, state = rec.state.as_str(), "Redis had lost this key; restoring the row");
                    io.note(Note::RedisRefill(rec.state.as_str()));
                    restore(io, s, &rec).await;
                }
                return rules::answer_from_row(&rec, &req.param_hash, &req.subject_hash, &req.scope);
            }
            // No row: the insert was refused (an approval not given, a business reference
            // another operation holds), or the row was released between our insert and our read
            // (then try the insert again).
            Ok(None) => match refused_insert(io, req, now).await {
                Ok(Some(outcome)) => {
                    undo_acquire(io, req, owner, gate_in_redis, false).await;
                    return AcquireResponse { outcome, owner: None, result: None };
                }
                Ok(None) => continue,
                Err(_) => {
                    undo_acquire(io, req, owner, gate_in_redis, false).await;
                    return unavailable();
                }
            },
            Err(e) => {
                warn!(key = %req.key, error = %e, "SQL read failed: STORE_UNAVAILABLE");
                undo_acquire(io, req, owner, gate_in_redis, false).await;
                return unavailable();
            }
        }
    }
    undo_acquire(io, req, owner, gate_in_redis, false).await;
    unavailable()
}

/// The attempt answers STORE_UNAVAILABLE: leave nothing behind that would make a retry wait for
/// an operation that never ran.
async fn undo_acquire(io: &Port, req: &AcquireRequest, owner: &str, gate_in_redis: bool, may_have_committed: bool) {
    if gate_in_redis {
        io.redis_write(Call::RedisRelease { key: req.key.to_string(), owner: owner.to_string() }).await;
    }
    if may_have_committed {
        // The owner token was never handed out, so deleting a row with it can only remove our
        // own. Off the request path: SQL is struggling.
        let said = Said {
            actor: "idemd".into(),
            action: "release",
            why: "the acquire's insert timed out; the caller was told to retry (STORE_UNAVAILABLE)".into(),
            trace_id: String::new(),
        };
        io.call(Call::SqlReleaseDetached { key: req.key.to_string(), owner: owner.to_string(), said }).await;
    }
}

/// Redis says someone holds it. SQL has the last word on whether that is still so.
async fn confirm_in_flight(io: &Port, req: &AcquireRequest, s: &Settings, holder: String, age_ms: i64) -> Step {
    let in_flight = |owner: String| AcquireResponse {
        outcome: AcquireOutcome::InFlight,
        owner: OwnerToken::parse(&owner).ok(),
        result: None,
    };
    match io.sql_row(&req.key).await {
        Ok(Some(rec)) => {
            if rec.state != OpState::InFlight || rec.owner.as_deref() != Some(holder.as_str()) {
                // SQL moved on while Redis could not be told.
                restore(io, s, &rec).await;
            }
            Step::Answer(rules::answer_from_row(&rec, &req.param_hash, &req.subject_hash, &req.scope))
        }
        Ok(None) if age_ms > i64::try_from(s.store.stale_in_flight_ms).unwrap_or(i64::MAX) => {
            // Released in SQL while Redis was unreachable. Drop the copy (only if it is still
            // that holder's) and start over.
            let dropped = io.redis_write(Call::RedisRelease { key: req.key.to_string(), owner: holder.clone() }).await;
            if dropped.is_some() {
                return Step::Again;
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
/// business reference (DESIGN §4, "A reference proves only its own operation"). `None`: not
/// refused (released meanwhile), insert again.
async fn refused_insert(io: &Port, req: &AcquireRequest, now: i64) -> Result<Option<AcquireOutcome>, SqlFail> {
    if let Some(a) = io.sql_approval(&req.key).await? {
        if !rules::acquire_allowed(Some(&a), now) {
            let binding = (req.param_hash.as_str(), req.subject_hash.as_str(), req.scope.as_str());
            return Ok(Some(match rules::approval_gate(Some(&a), false, binding, now) {
                Gate::Answer(o) => o,
                // Not allowed, so not APPROVED: awaiting is the closest honest word.
                Gate::Proceed | Gate::Record => AcquireOutcome::AwaitingApproval,
            }));
        }
    }
    let Some(reference) = req.business_ref.clone() else { return Ok(None) };
    let holder = match io.sql(Call::SqlReferenceHolder { scope: req.scope.clone(), reference }).await? {
        SqlAnswer::Holder(h) => h,
        other => return Err(SqlFail::Down(format!("not a holder: {other:?}"))),
    };
    match holder {
        Some(other) if other != req.key.as_str() => {
            info!(key = %req.key, scope = %req.scope, holder = %other, "business reference held by another operation: refused");
            Ok(Some(AcquireOutcome::ReferenceInUse))
        }
        _ => Ok(None),
    }
}

/// Redis says a person has to decide. SQL has the last word: an operator may have resolved it
/// there without reaching Redis.
async fn confirm_needs_review(io: &Port, req: &AcquireRequest, s: &Settings) -> Step {
    match io.sql_row(&req.key).await {
        Ok(Some(rec)) => {
            if rec.state != OpState::NeedsReview {
                // restore never moves the cache backwards, so drop the copy first.
                evict(io, &req.key).await;
                restore(io, s, &rec).await;
            }
            Step::Answer(rules::answer_from_row(&rec, &req.param_hash, &req.subject_hash, &req.scope))
        }
        // Released by an operator: the nonce is free again.
        Ok(None) => {
            evict(io, &req.key).await;
            Step::Again
        }
        // SQL down: the cached NEEDS_REVIEW is still the safe answer (nothing may run).
        Err(_) => Step::Answer(AcquireResponse { outcome: AcquireOutcome::NeedsReview, owner: None, result: None }),
    }
}

/// Copy a row into Redis for as long as it means something there: an IN_FLIGHT for its lease,
/// a settled row as long as SQL keeps it.
pub async fn restore(io: &Port, s: &Settings, rec: &Record) {
    let now = io.now().await;
    let ttl_ms = match rec.state {
        OpState::InFlight => {
            let left = rec.lease_until_ms.unwrap_or(0).saturating_sub(now);
            u64::try_from(left).unwrap_or(0).max(EXPIRED_LEASE_CACHE_MS)
        }
        // As long as SQL keeps the row (its fingerprint's exp counts too).
        OpState::Done | OpState::Failed | OpState::NeedsReview => {
            let left = retention::kept_until_skewed_ms(rec, s.store.terminal_retention_ms, s.clock_skew_ms);
            let left = left.saturating_sub(now);
            u64::try_from(left).unwrap_or(0).max(EXPIRED_LEASE_CACHE_MS)
        }
    };
    io.redis_done(Call::RedisRestore { rec: rec.clone(), ttl_ms }).await;
}

pub async fn evict(io: &Port, key: &str) {
    io.redis_done(Call::RedisEvict { key: key.to_string() }).await;
}

/// Bring the cache in line with a row SQL just changed: `Some` is the row as it is now, `None`
/// means it is gone. Best effort: a cache that missed this is corrected by the next acquire,
/// which checks SQL.
pub async fn refresh_cache(io: &Port, s: &Settings, key: &str, now: Option<&Record>) {
    evict(io, key).await;
    if let Some(rec) = now {
        restore(io, s, rec).await;
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::store::flow::Flow;

    pub(crate) const KEY: &str = "0123456789abcdef0123456789abcdef";
    pub(crate) const OWNER: &str = "fedcba9876543210fedcba9876543210";
    const STALE_MS: i64 = 5_000;

    /// The store settings every flow test runs with.
    pub(crate) fn settings() -> Settings {
        let store =
            StoreSettings { lease_ms: 30_000, terminal_retention_ms: 60_000, stale_in_flight_ms: STALE_MS as u64 };
        Settings { store, console: None, clock_skew_ms: 0, broken: Broken::None }
    }

    /// An approval row of [`KEY`] in `state`, undecided, lapsing far past the tests' clock.
    pub(crate) fn approval_row(state: idem_core::protocol::ApprovalState) -> ApprovalRow {
        ApprovalRow {
            key: KEY.into(),
            state,
            param_hash: "p".into(),
            subject_hash: "u".into(),
            scope: "payments.transfer".into(),
            fields: "{}".into(),
            fp_exp_ms: 9_000_000,
            created_at_ms: 0,
            updated_at_ms: 0,
            decided_by: None,
            reason: None,
        }
    }

    fn request() -> AcquireRequest {
        let json = serde_json::json!({"key": KEY, "param_hash": "p", "subject_hash": "u", "scope": "payments.transfer",
            "lease_ms": 1000});
        serde_json::from_value(json).unwrap_or_else(|e| panic!("a request: {e}"))
    }

    /// The acquire with the stores scripted by `answer` (the time and the owner are fixed): its
    /// answer and every call it made.
    fn acquire_with(answer: impl FnMut(&Call) -> Reply) -> (AcquireResponse, Vec<Call>) {
        acquire_of(request(), answer)
    }

    fn acquire_of(req: AcquireRequest, mut answer: impl FnMut(&Call) -> Reply) -> (AcquireResponse, Vec<Call>) {
        let mut calls = Vec::new();
        let s = settings();
        let got = Flow::new(|io| async move { acquire_answer(io, req, s).await }).run_with(|call| {
            let reply = match &call {
                Call::Now => Reply::Now(1_000),
                Call::NewOwner => Reply::Owner(OWNER.into()),
                other => answer(other),
            };
            calls.push(call);
            reply
        });
        (got.answer, calls)
    }

    fn released_in_redis(calls: &[Call]) -> Vec<&str> {
        calls
            .iter()
            .filter_map(|c| match c {
                Call::RedisRelease { owner, .. } => Some(owner.as_str()),
                _ => None,
            })
            .collect()
    }

    /// An insert that failed leaves nothing a retry would wait for: the Redis gate this attempt took
    /// goes, and where the insert may have committed (a timeout), the row it may have written too.
    #[test]
    fn a_failed_insert_leaves_nothing_behind() {
        for (fail, detached) in [(SqlFail::Timeout, true), (SqlFail::Down("refused".into()), false)] {
            let (answer, calls) = acquire_with(|call| match call {
                Call::RedisAcquire { .. } => Reply::Acquire(AcquireReply::Acquired),
                Call::SqlInsertInFlight { .. } => Reply::Sql(Err(fail.clone())),
                _ => Reply::Done,
            });
            assert_eq!(answer.outcome, AcquireOutcome::StoreUnavailable, "{fail:?}");
            assert_eq!(released_in_redis(&calls), [OWNER], "{fail:?}: {calls:?}");
            let row_released =
                calls.iter().any(|c| matches!(c, Call::SqlReleaseDetached { owner, .. } if owner == OWNER));
            assert_eq!(row_released, detached, "{fail:?}: {calls:?}");
        }
    }

    /// Redis says another owner holds it and SQL has no row: the holder may be inserting it right
    /// now, so it is in flight, until the Redis copy is older than `stale_in_flight_ms`; then a
    /// release reached only SQL, the copy is dropped, and the acquire starts over.
    #[test]
    fn a_redis_holder_without_a_row_is_dropped_only_once_stale() {
        for (age_ms, dropped) in [(STALE_MS - 1, false), (STALE_MS, false), (STALE_MS + 1, true)] {
            let mut asked = 0;
            let (answer, calls) = acquire_with(|call| match call {
                Call::RedisAcquire { .. } => {
                    asked += 1;
                    Reply::Acquire(match asked {
                        1 => AcquireReply::InFlight { owner: "holder".into(), age_ms },
                        _ => AcquireReply::Acquired,
                    })
                }
                Call::SqlGet { .. } => Reply::Sql(Ok(SqlAnswer::Row(None))),
                Call::SqlInsertInFlight { .. } => Reply::Sql(Ok(SqlAnswer::Changed(true))),
                Call::RedisRelease { .. } => Reply::Write(crate::store::redis::WriteReply::Ok),
                _ => Reply::Done,
            });
            let released = released_in_redis(&calls);
            if dropped {
                assert_eq!((answer.outcome, released), (AcquireOutcome::Acquired, vec!["holder"]), "{age_ms}");
            } else {
                assert_eq!(answer.outcome, AcquireOutcome::InFlight, "{age_ms}");
                assert!(released.is_empty(), "{age_ms}: {calls:?}");
            }
        }
    }

    /// An insert that found no row and inserted none was refused, or the row went meanwhile. Refused:
    /// by an approval not given (its answer), or by a business reference another operation of the
    /// scope holds (REFERENCE_IN_USE); the Redis gate goes either way. A reference this operation
    /// holds itself refuses nothing: the insert is tried again.
    #[test]
    fn an_insert_refused_says_why_and_one_not_refused_is_tried_again() {
        let awaiting = approval_row(idem_core::protocol::ApprovalState::AwaitingApproval);
        let with_ref = || AcquireRequest { business_ref: Some("R-1".into()), ..request() };
        for (req, approval, holder, want) in [
            (request(), Some(awaiting), None, AcquireOutcome::AwaitingApproval),
            (with_ref(), None, Some("ffffffffffffffffffffffffffffffff"), AcquireOutcome::ReferenceInUse),
            (with_ref(), None, Some(KEY), AcquireOutcome::Acquired),
        ] {
            let mut inserts = 0;
            let (answer, calls) = acquire_of(req, |call| match call {
                Call::RedisAcquire { .. } => Reply::Acquire(AcquireReply::Acquired),
                Call::SqlInsertInFlight { .. } => {
                    inserts += 1;
                    Reply::Sql(Ok(SqlAnswer::Changed(inserts > 1)))
                }
                Call::SqlGet { .. } => Reply::Sql(Ok(SqlAnswer::Row(None))),
                Call::SqlApproval { .. } => Reply::Sql(Ok(SqlAnswer::Approval(approval.clone()))),
                Call::SqlReferenceHolder { .. } => Reply::Sql(Ok(SqlAnswer::Holder(holder.map(str::to_string)))),
                _ => Reply::Write(crate::store::redis::WriteReply::Ok),
            });
            assert_eq!(answer.outcome, want, "{holder:?}: {calls:?}");
            let gate_dropped = released_in_redis(&calls) == [OWNER];
            assert_eq!(gate_dropped, want != AcquireOutcome::Acquired, "{want:?}: {calls:?}");
        }
    }

    /// Redis says a person decides; SQL has the last word: an operator may have resolved it there, and
    /// then the Redis copy is dropped and refilled from the row (a restore never moves it backwards).
    #[test]
    fn a_redis_needs_review_is_checked_against_the_row() {
        let row = |state: OpState| Record { state, ..crate::reconcile::decide::tests::rec(2_000, 0) };
        for (state, refilled) in [(OpState::NeedsReview, false), (OpState::Failed, true)] {
            let rec = row(state);
            let (answer, calls) = acquire_with(|call| match call {
                Call::RedisAcquire { .. } => Reply::Acquire(AcquireReply::NeedsReview),
                Call::SqlGet { .. } => Reply::Sql(Ok(SqlAnswer::Row(Some(rec.clone())))),
                _ => Reply::Done,
            });
            let want = if refilled { AcquireOutcome::Failed } else { AcquireOutcome::NeedsReview };
            assert_eq!(answer.outcome, want, "{state:?}");
            let evicted = calls.iter().any(|c| matches!(c, Call::RedisEvict { .. }));
            let restored = calls.iter().any(|c| matches!(c, Call::RedisRestore { .. }));
            assert_eq!((evicted, restored), (refilled, refilled), "{state:?}: {calls:?}");
        }
    }

    /// Redis says another owner holds it and SQL has the row: SQL answers, and where SQL moved on
    /// (another state or another owner), the Redis copy is put right.
    #[test]
    fn a_redis_holder_is_checked_against_the_row() {
        let row = |state: OpState, owner: &str| Record {
            state,
            owner: Some(owner.into()),
            ..crate::reconcile::decide::tests::rec(2_000, 0)
        };
        for (rec, restored) in [
            (row(OpState::InFlight, "holder"), false),
            (row(OpState::InFlight, "another"), true),
            (row(OpState::Failed, "holder"), true),
        ] {
            let state = rec.state;
            let (answer, calls) = acquire_with(|call| match call {
                Call::RedisAcquire { .. } => {
                    Reply::Acquire(AcquireReply::InFlight { owner: "holder".into(), age_ms: 1 })
                }
                Call::SqlGet { .. } => Reply::Sql(Ok(SqlAnswer::Row(Some(rec.clone())))),
                _ => Reply::Done,
            });
            let want = if state == OpState::InFlight { AcquireOutcome::InFlight } else { AcquireOutcome::Failed };
            assert_eq!(answer.outcome, want, "{state:?}");
            assert_eq!(calls.iter().any(|c| matches!(c, Call::RedisRestore { .. })), restored, "{state:?}: {calls:?}");
        }
    }
}
