//! One row's reconciliation as a flow (`store::flow`): claim it, ask its status endpoint,
//! decide (`decide`), write the decision owner-checked with the claim token, then bring Redis in
//! line. idemd's reconciler drives it with async I/O; the model checker drives it one call per
//! step, so a claim can run out while the lookup is out and other replicas act in between.

use idem_core::protocol::{OpState, TerminalState};
use tracing::warn;

use super::decide::{decide, Asked, Decision, Rules};
use crate::store::flow::acquire::{refresh_cache, Settings};
use crate::store::flow::{Call, Note, Port, Reply, Said, SqlFail};
use crate::store::record::Record;
use crate::store::sql::audit::{clip, MAX_WHY};

/// What the reconciler needs to settle a row.
#[derive(Clone, Debug)]
pub struct SettleSettings {
    pub rules: Rules,
    /// How long one claim holds a row.
    pub claim_ms: u64,
    /// `reconciler:<instance>`, in the audit trail.
    pub actor: String,
    pub store: Settings,
}

/// How one row ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RowOutcome {
    /// Decided and written; why.
    Decided(Decision, String),
    /// Another reconciler (or a late complete) took it first, or the claim ran out meanwhile.
    TakenElsewhere,
    /// A SQL error on the claim or the write (tried again next pass).
    Error,
}

pub async fn settle(io: Port, rec: Record, s: SettleSettings) -> RowOutcome {
    let token = io.new_owner().await;
    let now = io.now().await;
    let until = now.saturating_add(i64::try_from(s.claim_ms).unwrap_or(i64::MAX));
    let claim = Call::SqlClaim { rec: rec.clone(), token: token.clone(), until_ms: until, now_ms: now };
    match io.sql_changed(claim).await {
        Ok(true) => {}
        Ok(false) => return RowOutcome::TakenElsewhere,
        Err(e) => {
            warn!(key = %rec.key, error = %e, "claim failed");
            return RowOutcome::Error;
        }
    }
    let asked = match io.call(Call::Lookup { rec: rec.clone() }).await {
        Reply::Asked(a) => a,
        other => Asked::Unaskable(format!("the lookup gave no answer: {other:?}")),
    };
    if let Asked::Answered(_, answer) = &asked {
        io.note(Note::Lookup(rec.scope.clone(), answer.metric()));
    }
    let now = io.now().await;
    let (decision, why) = decide(&rec, &asked, now, &s.rules);
    match apply(&io, &s, &rec, &token, &decision, clip(&why, MAX_WHY)).await {
        Ok(true) => RowOutcome::Decided(decision, why),
        // The claim ran out while asking and someone else has the row now.
        Ok(false) => RowOutcome::TakenElsewhere,
        Err(e) => {
            warn!(key = %rec.key, error = %e, "writing the reconciler's decision failed");
            RowOutcome::Error
        }
    }
}

/// The owner-checked write of one decision (the claim token is the owner), then Redis.
/// `false`: the claim was lost.
async fn apply(
    io: &Port,
    s: &SettleSettings,
    rec: &Record,
    token: &str,
    decision: &Decision,
    why: &str,
) -> Result<bool, SqlFail> {
    let Some(action) = decision.action() else {
        // SkipGrace: the claim goes back as it was, and no line says anything happened.
        let call = Call::SqlUnclaim { rec: rec.clone(), token: token.to_string(), failed: false, said: None };
        return io.sql_changed(call).await;
    };
    let said = Said { actor: s.actor.clone(), action, why: why.to_string(), trace_id: String::new() };
    let now = io.now().await;
    match decision {
        Decision::Done(result) | Decision::Failed(result) => {
            let (state, op_state) = match decision {
                Decision::Failed(_) => (TerminalState::Failed, OpState::Failed),
                _ => (TerminalState::Done, OpState::Done),
            };
            let json = serde_json::to_string(result).map_err(|e| SqlFail::Corrupt(e.to_string()))?;
            let call = Call::SqlComplete {
                key: rec.key.clone(),
                owner: token.to_string(),
                state,
                result_json: json,
                now_ms: now,
                said,
            };
            if !io.sql_changed(call).await? {
                return Ok(false);
            }
            let now_row = Record {
                state: op_state,
                owner: Some(token.to_string()),
                result: Some(result.clone()),
                lease_until_ms: None,
                updated_at_ms: now,
                ..rec.clone()
            };
            refresh_cache(io, &s.store, &rec.key, Some(&now_row)).await;
        }
        Decision::Release => {
            let call = Call::SqlRelease { key: rec.key.clone(), owner: token.to_string(), said };
            if !io.sql_changed(call).await? {
                return Ok(false);
            }
            refresh_cache(io, &s.store, &rec.key, None).await;
        }
        Decision::NeedsReview => {
            let call = Call::SqlMarkNeedsReview { rec: rec.clone(), token: token.to_string(), now_ms: now, said };
            if !io.sql_changed(call).await? {
                return Ok(false);
            }
            let now_row =
                Record { state: OpState::NeedsReview, lease_until_ms: None, updated_at_ms: now, ..rec.clone() };
            refresh_cache(io, &s.store, &rec.key, Some(&now_row)).await;
        }
        // A failed lookup counts against the retry budget; SkipGrace returned above.
        Decision::Retry | Decision::SkipGrace => {
            let call = Call::SqlUnclaim { rec: rec.clone(), token: token.to_string(), failed: true, said: Some(said) };
            return io.sql_changed(call).await;
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::flow::{Flow, SqlAnswer};
    use idem_core::protocol::StoredResult;

    fn settings() -> SettleSettings {
        SettleSettings {
            rules: super::super::decide::Rules { grace_ms: 1_000, retry_budget: 3, readings: Default::default() },
            claim_ms: 10_000,
            actor: "reconciler:test".into(),
            store: crate::store::flow::acquire::tests::settings(),
        }
    }

    fn row() -> Record {
        super::super::decide::tests::rec(10, 0)
    }

    /// `apply` of `decision` where the owner-checked write answers `changed`: what it returned and every
    /// call it made.
    fn apply_with(decision: Decision, changed: bool) -> (Result<bool, SqlFail>, Vec<Call>) {
        let mut calls = Vec::new();
        let s = settings();
        let rec = row();
        let returned = Flow::new(|io| async move { apply(&io, &s, &rec, "claim-token", &decision, "why").await })
            .run_with(|call| {
                let reply = match &call {
                    Call::Now => Reply::Now(50),
                    Call::RedisEvict { .. } | Call::RedisRestore { .. } => Reply::Done,
                    _ => Reply::Sql(Ok(SqlAnswer::Changed(changed))),
                };
                calls.push(call);
                reply
            });
        (returned, calls)
    }

    /// The audit line the write carries: its action and why.
    fn said(calls: &[Call]) -> Option<(&'static str, &str)> {
        calls.iter().find_map(|c| match c {
            Call::SqlComplete { said, .. } | Call::SqlRelease { said, .. } | Call::SqlMarkNeedsReview { said, .. } => {
                Some((said.action, said.why.as_str()))
            }
            Call::SqlUnclaim { said: Some(said), .. } => Some((said.action, said.why.as_str())),
            _ => None,
        })
    }

    /// Operators read the trail by these words (docs/operations.md; `idemd ops show`): each decision
    /// writes its own, with the reason it was taken.
    #[test]
    fn each_decision_leaves_its_own_word_in_the_audit_trail() {
        let result = StoredResult { status: 201, headers: vec![], body_b64: "e30=".into() };
        for (decision, word) in [
            (Decision::Done(result.clone()), Some("reconcile_done")),
            (Decision::Failed(result), Some("reconcile_failed")),
            (Decision::Release, Some("reconcile_release")),
            (Decision::NeedsReview, Some("reconcile_needs_review")),
            (Decision::Retry, Some("reconcile_retry")),
            // Waiting out the grace changed nothing: no line.
            (Decision::SkipGrace, None),
        ] {
            let (_, calls) = apply_with(decision.clone(), true);
            assert_eq!(said(&calls), word.map(|w| (w, "why")), "{decision:?}: {calls:?}");
        }
    }

    fn restored(calls: &[Call]) -> Option<&Record> {
        calls.iter().find_map(|c| match c {
            Call::RedisRestore { rec, .. } => Some(rec),
            _ => None,
        })
    }

    #[test]
    fn a_terminal_decision_is_written_under_the_claim_and_copied_to_redis_as_written() {
        let result = StoredResult { status: 201, headers: vec![], body_b64: "e30=".into() };
        for (decision, state, op_state) in [
            (Decision::Done(result.clone()), TerminalState::Done, OpState::Done),
            (Decision::Failed(result.clone()), TerminalState::Failed, OpState::Failed),
        ] {
            let (returned, calls) = apply_with(decision.clone(), true);
            assert_eq!(returned, Ok(true), "{decision:?}");
            let write = calls.iter().find_map(|c| match c {
                Call::SqlComplete { owner, state, now_ms, .. } => Some((owner.as_str(), *state, *now_ms)),
                _ => None,
            });
            assert_eq!(write, Some(("claim-token", state, 50)), "{decision:?}: {calls:?}");
            let copy = restored(&calls).expect("the Redis copy");
            assert_eq!(
                (copy.state, copy.owner.as_deref(), copy.result.as_ref(), copy.lease_until_ms, copy.updated_at_ms),
                (op_state, Some("claim-token"), Some(&result), None, 50),
                "{decision:?}"
            );
            // The claim was lost meanwhile: nothing is copied, and the row is someone else's.
            let (returned, calls) = apply_with(decision.clone(), false);
            assert_eq!(returned, Ok(false), "{decision:?}");
            assert!(restored(&calls).is_none() && !calls.iter().any(|c| matches!(c, Call::RedisEvict { .. })));
        }
    }

    #[test]
    fn each_other_decision_makes_its_own_write() {
        let (returned, calls) = apply_with(Decision::Release, true);
        assert_eq!(returned, Ok(true));
        assert!(calls.iter().any(|c| matches!(c, Call::SqlRelease { owner, .. } if owner == "claim-token")));
        assert!(calls.iter().any(|c| matches!(c, Call::RedisEvict { .. })) && restored(&calls).is_none());
        assert_eq!(apply_with(Decision::Release, false).0, Ok(false));

        let (returned, calls) = apply_with(Decision::NeedsReview, true);
        assert_eq!(returned, Ok(true));
        assert!(calls.iter().any(|c| matches!(c, Call::SqlMarkNeedsReview { token, .. } if token == "claim-token")));
        let copy = restored(&calls).expect("the Redis copy");
        assert_eq!((copy.state, copy.lease_until_ms, copy.updated_at_ms), (OpState::NeedsReview, None, 50));
        assert_eq!(apply_with(Decision::NeedsReview, false).0, Ok(false));

        for (decision, failed) in [(Decision::Retry, true), (Decision::SkipGrace, false)] {
            for changed in [true, false] {
                let (returned, calls) = apply_with(decision.clone(), changed);
                assert_eq!(returned, Ok(changed), "{decision:?}");
                let unclaim = calls.iter().find_map(|c| match c {
                    Call::SqlUnclaim { token, failed, .. } => Some((token.as_str(), *failed)),
                    _ => None,
                });
                assert_eq!(unclaim, Some(("claim-token", failed)), "{decision:?}");
            }
        }
    }
}
