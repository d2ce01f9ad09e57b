//! The store's transitions as pure functions over one operation's state: no I/O, no clock (the
//! caller passes `now`). One definition, three users: the store itself, where a decision is not
//! tied to one atomic statement (what a row answers, whether a lost complete is a repeat); the model checker (`model/`), whose idemd replicas run
//! exactly these; and the differential tests (`sidecar/tests/store_rules.rs`), which drive the
//! real SQL statements and Lua scripts and these functions with the same sequences, hand-written
//! and generated, so a store that drifts from the rules fails a test.
//!
//! Where a transition must stay one atomic SQL statement or Lua script (the owner-checked
//! `UPDATE`, the acquire script), the function here states what that statement does to the row;
//! the differential tests hold the two together.
//!
//! [`Broken`] is the model checker's mutation switch: each variant breaks one rule, so the checker
//! can show that its properties notice. idemd always passes [`Broken::None`].

use idem_core::protocol::{
    AcquireOutcome, AcquireResponse, ApprovalState, Decision, OpState, OwnerToken, StoredResult, TerminalState,
};

use super::record::{ApprovalRow, Record};
use super::redis::{AcquireReply, WriteReply as Write};
use super::retention;

/// A deliberately broken rule, for the model checker's mutation check only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Broken {
    #[default]
    None,
    /// complete writes whatever state the row is in, for any owner.
    CompleteWithoutOwnerCheck,
    /// The reaper looks at the last change only, not at the fingerprint's `exp`.
    ReapBeforeExp,
    /// The acquire takes Redis's ACQUIRED for the answer, without the SQL insert (`flow::acquire`).
    AcquiredByRedisAlone,
}

/// The row a fresh acquire inserts: `None` when a row with this key exists (the insert's
/// `ON CONFLICT DO NOTHING` / `INSERT IGNORE`).
pub fn insert_in_flight(row: Option<&Record>, new: &Record) -> Option<Record> {
    match row {
        Some(_) => None,
        None => Some(Record { state: OpState::InFlight, result: None, reconcile_attempts: 0, ..new.clone() }),
    }
}

/// The answer a row gives to an acquire that did not get it.
pub fn answer_from_row(rec: &Record, param_hash: &str, subject_hash: &str, scope: &str) -> AcquireResponse {
    if rec.param_hash != param_hash || rec.subject_hash != subject_hash || rec.scope != scope {
        return AcquireResponse { outcome: AcquireOutcome::ParamMismatch, owner: None, result: None };
    }
    match rec.state {
        OpState::InFlight => {
            let owner = rec.owner.as_deref().and_then(|o| OwnerToken::parse(o).ok());
            AcquireResponse { outcome: AcquireOutcome::InFlight, owner, result: None }
        }
        OpState::Done => AcquireResponse { outcome: AcquireOutcome::Done, owner: None, result: rec.result.clone() },
        OpState::Failed => AcquireResponse { outcome: AcquireOutcome::Failed, owner: None, result: rec.result.clone() },
        OpState::NeedsReview => AcquireResponse { outcome: AcquireOutcome::NeedsReview, owner: None, result: None },
    }
}

/// How a complete ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Completion {
    /// The owner's IN_FLIGHT row is now terminal (the owner-checked `UPDATE` matched).
    Applied(Box<Record>),
    /// The row already holds this owner's same state and result: a filter retrying a complete
    /// whose answer it lost. OK, nothing changes.
    Repeated,
    /// Not this owner's IN_FLIGHT row: a stale executor never overwrites a newer decision.
    NotOwner,
}

/// complete: the `UPDATE … WHERE key AND owner AND state = 'IN_FLIGHT'`, then, when it matched
/// nothing, [`is_repeat`] on the row as it is.
pub fn complete(
    row: Option<&Record>,
    owner: &str,
    state: TerminalState,
    result: &StoredResult,
    now_ms: i64,
    broken: Broken,
) -> Completion {
    let Some(rec) = row else { return Completion::NotOwner };
    let owned = rec.state == OpState::InFlight && rec.owner.as_deref() == Some(owner);
    if owned || broken == Broken::CompleteWithoutOwnerCheck {
        return Completion::Applied(Box::new(Record {
            state: state.op_state(),
            result: Some(result.clone()),
            lease_until_ms: None,
            updated_at_ms: now_ms,
            ..rec.clone()
        }));
    }
    if is_repeat(rec, owner, state, result) {
        Completion::Repeated
    } else {
        Completion::NotOwner
    }
}

/// The row already holds what this owner's complete would write.
pub fn is_repeat(rec: &Record, owner: &str, state: TerminalState, result: &StoredResult) -> bool {
    rec.owner.as_deref() == Some(owner) && rec.state == state.op_state() && rec.result.as_ref() == Some(result)
}

/// release: the owner-checked delete of an IN_FLIGHT row. `true`: the row goes.
pub fn release(row: Option<&Record>, owner: &str) -> bool {
    row.is_some_and(|rec| rec.state == OpState::InFlight && rec.owner.as_deref() == Some(owner))
}

/// renew: extend an IN_FLIGHT lease to `until_ms`, never shortening it, if `owner` holds it.
pub fn renew(row: Option<&Record>, owner: &str, until_ms: i64, now_ms: i64) -> Option<Record> {
    let rec = row?;
    if rec.state != OpState::InFlight || rec.owner.as_deref() != Some(owner) {
        return None;
    }
    let lease = rec.lease_until_ms.map_or(until_ms, |l| l.max(until_ms));
    Some(Record { lease_until_ms: Some(lease), updated_at_ms: now_ms, ..rec.clone() })
}

/// The reconciler may claim `rec`: IN_FLIGHT and its lease ran out before `now_ms`.
pub fn claimable(rec: &Record, now_ms: i64) -> bool {
    rec.state == OpState::InFlight && rec.lease_until_ms.is_some_and(|l| l < now_ms)
}

/// claim: the reconciler's compare-and-set on the row as read (owner, attempts, an expired
/// lease); the claimed row, or `None` when it changed since it was read.
pub fn claim(row: Option<&Record>, as_read: &Record, token: &str, until_ms: i64, now_ms: i64) -> Option<Record> {
    let rec = row?;
    let unchanged = rec.state == OpState::InFlight
        && rec.owner == as_read.owner
        && rec.reconcile_attempts == as_read.reconcile_attempts
        && claimable(rec, now_ms);
    unchanged.then(|| Record { owner: Some(token.to_string()), lease_until_ms: Some(until_ms), ..rec.clone() })
}

/// unclaim: give a claimed row back as it was read, one failed lookup more when `failed`.
pub fn unclaim(row: Option<&Record>, as_read: &Record, token: &str, failed: bool) -> Option<Record> {
    let rec = row?;
    (rec.state == OpState::InFlight && rec.owner.as_deref() == Some(token)).then(|| Record {
        owner: as_read.owner.clone(),
        lease_until_ms: as_read.lease_until_ms,
        reconcile_attempts: rec.reconcile_attempts + i64::from(failed),
        ..rec.clone()
    })
}

/// mark_needs_review: a claimed row goes to a person, with its executor's owner back.
pub fn mark_needs_review(row: Option<&Record>, as_read: &Record, token: &str, now_ms: i64) -> Option<Record> {
    let rec = row?;
    (rec.state == OpState::InFlight && rec.owner.as_deref() == Some(token)).then(|| Record {
        state: OpState::NeedsReview,
        owner: as_read.owner.clone(),
        lease_until_ms: None,
        updated_at_ms: now_ms,
        ..rec.clone()
    })
}

/// The reaper may delete `rec` at `now_ms` (the `DELETE … WHERE` of `retention::reap_terminal`).
/// `approval`: the operation's `idem_approval` row, if it still has one. While that row says
/// APPROVED the record stays: the lapse sweep reads "APPROVED and no record" as "approved but never
/// run", so a record reaped first would have its executed approval marked LAPSED.
pub fn reapable(rec: &Record, approval: Option<&ApprovalRow>, now_ms: i64, retention_ms: u64, broken: Broken) -> bool {
    reapable_skewed(rec, approval, now_ms, retention_ms, retention::CLOCK_SKEW_MS, broken)
}

/// [`reapable`] with the clock-skew allowance given (`retention::kept_until_skewed_ms`).
pub fn reapable_skewed(
    rec: &Record,
    approval: Option<&ApprovalRow>,
    now_ms: i64,
    retention_ms: u64,
    skew_ms: i64,
    broken: Broken,
) -> bool {
    if approval.is_some_and(|a| a.state == ApprovalState::Approved) {
        return false;
    }
    let terminal = matches!(rec.state, OpState::Done | OpState::Failed);
    let kept_until = if broken == Broken::ReapBeforeExp {
        let unbounded = Record { fp_exp_ms: None, ..rec.clone() };
        retention::kept_until_skewed_ms(&unbounded, retention_ms, skew_ms)
    } else {
        retention::kept_until_skewed_ms(rec, retention_ms, skew_ms)
    };
    terminal && now_ms > kept_until
}

// ---- Redis (the Lua scripts in lua/) ---------------------------------------

/// One cached operation (the hash `idem:{<key>}`), its fields as the scripts keep them; the TTL is
/// what each script says ([`Ttl`]), and the clock it runs on is the caller's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cached {
    pub state: OpState,
    pub param_hash: String,
    pub subject_hash: String,
    pub scope: String,
    pub owner: Option<String>,
    /// The StoredResult JSON.
    pub result: Option<String>,
}

/// What a script does to the key's TTL: leaves it, or sets it (`PEXPIRE`) to so many ms from
/// when it runs. An IN_FLIGHT copy's lease (`lease_ms`, from which an IN_FLIGHT answer's age is
/// counted) is set with its TTL, so the age is the time since the last [`Ttl::Set`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ttl {
    Kept,
    Set(u64),
}

/// `acquire.lua`: the reply, the entry after it and its TTL. `age_ms` of an IN_FLIGHT is the
/// caller's (the script counts it from the key's TTL); `lease_ms` is the TTL a fresh entry gets.
pub fn redis_acquire(
    entry: Option<&Cached>,
    (param_hash, subject_hash, scope): (&str, &str, &str),
    owner: &str,
    age_ms: i64,
    lease_ms: u64,
) -> (AcquireReply, Option<Cached>, Ttl) {
    let Some(e) = entry else {
        let taken = Cached {
            state: OpState::InFlight,
            param_hash: param_hash.to_string(),
            subject_hash: subject_hash.to_string(),
            scope: scope.to_string(),
            owner: Some(owner.to_string()),
            result: None,
        };
        return (AcquireReply::Acquired, Some(taken), Ttl::Set(lease_ms));
    };
    let kept = Some(e.clone());
    if e.param_hash != param_hash || e.subject_hash != subject_hash || e.scope != scope {
        return (AcquireReply::ParamMismatch, kept, Ttl::Kept);
    }
    let result = e.result.clone().unwrap_or_default();
    let reply = match e.state {
        OpState::Done => AcquireReply::Done(result),
        OpState::Failed => AcquireReply::Failed(result),
        OpState::NeedsReview => AcquireReply::NeedsReview,
        OpState::InFlight => AcquireReply::InFlight { owner: e.owner.clone().unwrap_or_default(), age_ms },
    };
    (reply, kept, Ttl::Kept)
}

/// `complete.lua`: the owner's IN_FLIGHT copy becomes terminal and is kept `retention_ms`; a
/// repeat of what it already holds is OK and changes nothing, its TTL included.
pub fn redis_complete(
    entry: Option<&Cached>,
    owner: &str,
    state: TerminalState,
    result: &str,
    retention_ms: u64,
) -> (Write, Option<Cached>, Ttl) {
    let Some(e) = entry else { return (Write::Missing, None, Ttl::Kept) };
    let kept = Some(e.clone());
    if e.owner.as_deref() != Some(owner) {
        return (Write::NotOwner, kept, Ttl::Kept);
    }
    if e.state != OpState::InFlight {
        let same = e.state == state.op_state() && e.result.as_deref() == Some(result);
        return (if same { Write::Ok } else { Write::NotOwner }, kept, Ttl::Kept);
    }
    let done = Cached { state: state.op_state(), result: Some(result.to_string()), ..e.clone() };
    (Write::Ok, Some(done), Ttl::Set(retention_ms))
}

/// `release.lua`: the owner's IN_FLIGHT copy goes; anything else stays as it is, TTL and all.
pub fn redis_release(entry: Option<&Cached>, owner: &str) -> (Write, Option<Cached>) {
    let Some(e) = entry else { return (Write::Missing, None) };
    if e.state != OpState::InFlight || e.owner.as_deref() != Some(owner) {
        return (Write::NotOwner, Some(e.clone()));
    }
    (Write::Ok, None)
}

/// `renew.lua`: the owner's IN_FLIGHT copy gets `lease_ms` from now as its lease and its TTL, a
/// shorter one too (it is SQL's renew that never shortens a lease). The hash's fields stay.
pub fn redis_renew(entry: Option<&Cached>, owner: &str, lease_ms: u64) -> (Write, Option<Cached>, Ttl) {
    let Some(e) = entry else { return (Write::Missing, None, Ttl::Kept) };
    if e.state != OpState::InFlight || e.owner.as_deref() != Some(owner) {
        return (Write::NotOwner, Some(e.clone()), Ttl::Kept);
    }
    (Write::Ok, Some(e.clone()), Ttl::Set(lease_ms))
}

/// `restore.lua`: copy a row into the cache for `ttl_ms`, never moving it backwards. `true`: written.
pub fn redis_restore(entry: Option<&Cached>, rec: &Record, ttl_ms: u64) -> (bool, Option<Cached>, Ttl) {
    let rank = |s: OpState| match s {
        OpState::InFlight => 1,
        OpState::NeedsReview => 2,
        OpState::Done | OpState::Failed => 3,
    };
    if let Some(e) = entry {
        if rank(e.state) > rank(rec.state) {
            return (false, Some(e.clone()), Ttl::Kept);
        }
    }
    let copy = Cached {
        state: rec.state,
        param_hash: rec.param_hash.clone(),
        subject_hash: rec.subject_hash.clone(),
        scope: rec.scope.clone(),
        owner: rec.owner.clone().filter(|o| !o.is_empty()),
        result: rec.result.as_ref().and_then(|r| serde_json::to_string(r).ok()),
    };
    (true, Some(copy), Ttl::Set(ttl_ms))
}

// ---- approval (`idem_approval`; DESIGN §4, "Approval") ---------------------------------------

/// What an acquire that asks for approval meets in `idem_approval`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Gate {
    /// No row yet: record it AWAITING_APPROVAL ([`insert_awaiting`]); nothing is forwarded.
    Record,
    /// The row answers: AWAITING_APPROVAL, REJECTED, LAPSED, or PARAM_MISMATCH for another binding.
    Answer(AcquireOutcome),
    /// APPROVED, before `exp`: the acquire goes on to `idem_record` as any other (its insert wins
    /// once; every other confirm meets that row).
    Proceed,
}

/// The gate an approval acquire passes: by the row's binding first (another binding is a
/// mismatch before anything is shown), then its state as of `now_ms` (past `exp`, awaiting or
/// approved reads as lapsed: expiry only refuses to start an operation, and this one never started).
///
/// `started`: an `idem_record` row exists for the key (the operation started or ran before the
/// route asked for approval: a rule added by a reload, or a route of the scope without it). With no
/// approval row, the gate then steps aside and that row answers: a person is never asked about an
/// operation that already ran, and "rejected, not executed" is never said of one.
pub fn approval_gate(
    row: Option<&ApprovalRow>,
    started: bool,
    (param_hash, subject_hash, scope): (&str, &str, &str),
    now_ms: i64,
) -> Gate {
    let Some(row) = row else { return if started { Gate::Proceed } else { Gate::Record } };
    if row.param_hash != param_hash || row.subject_hash != subject_hash || row.scope != scope {
        return Gate::Answer(AcquireOutcome::ParamMismatch);
    }
    match approval_state_at(row, now_ms) {
        ApprovalState::AwaitingApproval => Gate::Answer(AcquireOutcome::AwaitingApproval),
        ApprovalState::Approved => Gate::Proceed,
        ApprovalState::Rejected => Gate::Answer(AcquireOutcome::Rejected),
        ApprovalState::Lapsed => Gate::Answer(AcquireOutcome::Lapsed),
    }
}

/// The state a row reads as at `now_ms`.
pub fn approval_state_at(row: &ApprovalRow, now_ms: i64) -> ApprovalState {
    match row.state {
        ApprovalState::AwaitingApproval | ApprovalState::Approved if now_ms >= row.fp_exp_ms => ApprovalState::Lapsed,
        s => s,
    }
}

/// The row an approval acquire inserts (`ON CONFLICT DO NOTHING`): `None` when one exists.
pub fn insert_awaiting(row: Option<&ApprovalRow>, new: &ApprovalRow) -> Option<ApprovalRow> {
    match row {
        Some(_) => None,
        None => {
            Some(ApprovalRow { state: ApprovalState::AwaitingApproval, decided_by: None, reason: None, ..new.clone() })
        }
    }
}

/// May a fresh IN_FLIGHT row be inserted for this key at `now_ms`? The insert's `NOT EXISTS` over
/// `idem_approval`: no approval row, or an APPROVED one before its `exp` (after it, the approval has
/// lapsed for every reader: an acquire that reached idemd late must not start what an agent was
/// told will never run). So nothing reaches the upstream before a person approved it, whichever
/// route (or a route that forgot its rule) sends the acquire.
pub fn acquire_allowed(approval: Option<&ApprovalRow>, now_ms: i64) -> bool {
    approval.is_none_or(|a| a.state == ApprovalState::Approved && now_ms < a.fp_exp_ms)
}

/// Why a decision was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No such approval.
    Unknown,
    /// Decided already (approved, rejected or lapsed): a decision is made once.
    Decided(ApprovalState),
    /// The fingerprint's `exp` passed: it lapsed.
    Lapsed,
    /// The approver is the operation's own subject (refused unless allowed).
    OwnSubject,
}

/// No person decides an operation of their own subject (DESIGN §4): `person_subject_hash` is the
/// person's identity hashed as a subject is. Every human decision asks this — an approval, a
/// rejection, and resolving an operation as done, failed or released (`review`) — unless the
/// deployment allows it (`allow_self`).
pub fn own_subject(operation_subject_hash: &str, person_subject_hash: &str, allow_self: bool) -> bool {
    !allow_self && operation_subject_hash == person_subject_hash
}

/// An approver's decision: the `UPDATE … WHERE state = 'AWAITING_APPROVAL' AND fp_exp_ms > now`,
/// after the self-approval check. `approver_subject_hash`: the approver's identity hashed as a
/// subject is, compared with the operation's subject.
pub fn decide(
    row: Option<&ApprovalRow>,
    decision: Decision,
    (approver, approver_subject_hash): (&str, &str),
    reason: &str,
    allow_self: bool,
    now_ms: i64,
) -> Result<ApprovalRow, Refusal> {
    let row = row.ok_or(Refusal::Unknown)?;
    if row.state != ApprovalState::AwaitingApproval {
        return Err(Refusal::Decided(row.state));
    }
    if now_ms >= row.fp_exp_ms {
        return Err(Refusal::Lapsed);
    }
    if own_subject(&row.subject_hash, approver_subject_hash, allow_self) {
        return Err(Refusal::OwnSubject);
    }
    let state = match decision {
        Decision::Approve => ApprovalState::Approved,
        Decision::Reject => ApprovalState::Rejected,
    };
    Ok(ApprovalRow {
        state,
        decided_by: Some(approver.to_string()),
        reason: Some(reason.to_string()),
        updated_at_ms: now_ms,
        ..row.clone()
    })
}

/// The lapse sweep: an approval nobody gave (or an approved operation nobody confirmed) before
/// `exp` becomes LAPSED, where `executed` (an `idem_record` row exists) is false.
pub fn lapse(row: Option<&ApprovalRow>, executed: bool, now_ms: i64) -> Option<ApprovalRow> {
    let row = row?;
    let open = matches!(row.state, ApprovalState::AwaitingApproval | ApprovalState::Approved);
    (open && !executed && now_ms >= row.fp_exp_ms).then(|| ApprovalRow {
        state: ApprovalState::Lapsed,
        updated_at_ms: now_ms,
        ..row.clone()
    })
}

/// The reaper may delete an approval row: decided (or lapsed) and past `exp` plus the retention
/// (a rejection replays that long; an approved one's `idem_record` row answers after it).
pub fn approval_reapable(row: &ApprovalRow, now_ms: i64, retention_ms: u64) -> bool {
    let decided = row.state != ApprovalState::AwaitingApproval;
    let kept = row
        .fp_exp_ms
        .saturating_add(retention::CLOCK_SKEW_MS)
        .saturating_add(i64::try_from(retention_ms).unwrap_or(i64::MAX));
    decided && now_ms > kept
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The insert writes a fresh IN_FLIGHT row with nothing recorded, whatever the record it is
    /// handed says of state, result and attempts: the statement takes none of them from its caller
    /// (`sql::NewInFlight`), and the rule must not either.
    #[test]
    fn a_fresh_insert_is_in_flight_with_nothing_recorded() {
        let done = Record { reconcile_attempts: 3, ..rec(OpState::Done) };
        let row = insert_in_flight(None, &done);
        let seen = row.as_ref().map(|r| (r.state, r.result.is_none(), r.reconcile_attempts, r.key.as_str()));
        assert_eq!(seen, Some((OpState::InFlight, true, 0, "k")));
        assert_eq!(insert_in_flight(Some(&done), &done), None, "a row with the key: the insert does nothing");
    }

    fn rec(state: OpState) -> Record {
        Record {
            key: "k".into(),
            state,
            param_hash: "p".into(),
            subject_hash: "u".into(),
            scope: "s".into(),
            owner: Some("0f".repeat(16)),
            result: Some(StoredResult { status: 200, headers: vec![], body_b64: "e30".into() }),
            lease_until_ms: Some(10),
            created_at_ms: 0,
            updated_at_ms: 0,
            reconcile_attempts: 0,
            fp_exp_ms: None,
            upstream_ignores_keys: false,
            business_ref: None,
            bound_fields: None,
        }
    }

    /// An approval row of the operation `rec` makes, in `state`, lapsing at 1,000 ms.
    fn approval(state: ApprovalState) -> ApprovalRow {
        ApprovalRow {
            key: "k".into(),
            state,
            param_hash: "p".into(),
            subject_hash: "u".into(),
            scope: "s".into(),
            fields: "{}".into(),
            fp_exp_ms: 1_000,
            created_at_ms: 0,
            updated_at_ms: 0,
            decided_by: None,
            reason: None,
        }
    }

    #[test]
    fn any_binding_difference_is_a_mismatch_before_any_result_is_shown() {
        for (p, u, s) in [("x", "u", "s"), ("p", "x", "s"), ("p", "u", "x")] {
            let a = answer_from_row(&rec(OpState::Done), p, u, s);
            assert_eq!(a.outcome, AcquireOutcome::ParamMismatch);
            assert!(a.result.is_none());
        }
    }

    /// The approval gate too: an approval row bound to other arguments, another subject or another
    /// scope answers a mismatch, whatever its state, before any verdict is told.
    #[test]
    fn any_binding_difference_is_a_mismatch_at_the_approval_gate() {
        let row = ApprovalRow { decided_by: Some("ann".into()), ..approval(ApprovalState::Approved) };
        for binding in [("x", "u", "s"), ("p", "x", "s"), ("p", "u", "x")] {
            assert_eq!(approval_gate(Some(&row), false, binding, 10), Gate::Answer(AcquireOutcome::ParamMismatch));
        }
        assert_eq!(approval_gate(Some(&row), false, ("p", "u", "s"), 10), Gate::Proceed);
        // At `exp` an open or approved row has lapsed; a refusal stays what it is.
        for state in [ApprovalState::AwaitingApproval, ApprovalState::Approved] {
            let open = ApprovalRow { state, ..row.clone() };
            assert_eq!(approval_state_at(&open, 999), state);
            assert_eq!(approval_state_at(&open, 1_000), ApprovalState::Lapsed, "{state:?}");
        }
        let refused = ApprovalRow { state: ApprovalState::Rejected, ..row };
        assert_eq!(approval_state_at(&refused, 5_000), ApprovalState::Rejected);
    }

    /// A decision is what idemd writes (`store::approval` hands this row to the `UPDATE`): the new
    /// state, who decided, why, and when; an approval insert is an open row whatever it is handed.
    #[test]
    fn a_decision_records_who_why_and_when_and_an_insert_is_open() {
        let open = approval(ApprovalState::AwaitingApproval);
        for (decision, state) in
            [(Decision::Approve, ApprovalState::Approved), (Decision::Reject, ApprovalState::Rejected)]
        {
            let row = decide(Some(&open), decision, ("ann", "ann-hash"), "checked the invoice", false, 500);
            let seen = row.map(|r| (r.state, r.decided_by, r.reason, r.updated_at_ms));
            assert_eq!(seen, Ok((state, Some("ann".into()), Some("checked the invoice".into()), 500)));
        }
        let handed = ApprovalRow {
            state: ApprovalState::Rejected,
            decided_by: Some("x".into()),
            reason: Some("y".into()),
            ..open.clone()
        };
        let inserted = insert_awaiting(None, &handed).map(|r| (r.state, r.decided_by, r.reason));
        assert_eq!(inserted, Some((ApprovalState::AwaitingApproval, None, None)));
        assert_eq!(insert_awaiting(Some(&open), &handed), None, "a row with the key: the insert does nothing");
    }

    /// A renewal moves the lease forward only, and stamps the row with its own time (as the
    /// statement's `updated_at_ms = now` does).
    #[test]
    fn a_renewal_extends_the_lease_and_stamps_the_row() {
        let owner = "0f".repeat(16);
        let row = rec(OpState::InFlight);
        let longer = renew(Some(&row), &owner, 50, 77);
        assert_eq!(longer.as_ref().map(|r| (r.lease_until_ms, r.updated_at_ms)), Some((Some(50), 77)));
        let shorter = renew(Some(&row), &owner, 5, 78);
        assert_eq!(shorter.as_ref().map(|r| (r.lease_until_ms, r.updated_at_ms)), Some((Some(10), 78)));
        assert_eq!(renew(Some(&row), "another", 50, 77), None);
    }

    #[test]
    fn rows_answer_per_state() {
        let a = |s| answer_from_row(&rec(s), "p", "u", "s");
        assert_eq!(a(OpState::InFlight).owner.as_deref(), Some("0f".repeat(16).as_str()));
        assert_eq!(a(OpState::Done).result.map(|x| x.status), Some(200));
        assert_eq!(a(OpState::Failed).outcome, AcquireOutcome::Failed);
        assert_eq!(a(OpState::NeedsReview).outcome, AcquireOutcome::NeedsReview);
    }

    #[test]
    fn a_stale_owner_never_overwrites_and_a_repeat_is_ok() {
        let owner = "0f".repeat(16);
        let r = StoredResult { status: 201, headers: vec![], body_b64: "e30".into() };
        let live = rec(OpState::InFlight);
        let Completion::Applied(done) = complete(Some(&live), &owner, TerminalState::Done, &r, 5, Broken::None) else {
            panic!("the owner's complete applies")
        };
        assert_eq!((done.state, done.lease_until_ms, done.updated_at_ms), (OpState::Done, None, 5));
        assert_eq!(complete(Some(&done), &owner, TerminalState::Done, &r, 6, Broken::None), Completion::Repeated);
        assert_eq!(
            complete(Some(&done), &"1".repeat(32), TerminalState::Done, &r, 6, Broken::None),
            Completion::NotOwner
        );
        assert_eq!(complete(Some(&done), &owner, TerminalState::Failed, &r, 6, Broken::None), Completion::NotOwner);
        let broken =
            complete(Some(&done), &"1".repeat(32), TerminalState::Failed, &r, 6, Broken::CompleteWithoutOwnerCheck);
        assert!(matches!(broken, Completion::Applied(_)), "the mutation overwrites");
    }

    #[test]
    fn reaping_waits_for_the_fingerprint_unless_broken() {
        let done = Record { fp_exp_ms: Some(100_000), updated_at_ms: 1_000, ..rec(OpState::Done) };
        assert!(!reapable(&done, None, 50_000, 10_000, Broken::None));
        assert!(reapable(&done, None, 50_000, 10_000, Broken::ReapBeforeExp));
        assert!(reapable(&done, None, 100_000 + retention::CLOCK_SKEW_MS + 10_001, 10_000, Broken::None));
        assert!(!reapable(&rec(OpState::InFlight), None, i64::MAX, 0, Broken::None));
    }
}
