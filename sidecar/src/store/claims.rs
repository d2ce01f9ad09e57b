//! The reconciler's SQL: find IN_FLIGHT rows whose lease ran out, claim one
//! for a decision, give it back, or hand it to a person.
//!
//! Claiming is a compare-and-set on the row itself (owner, lease, attempts as
//! read), the same on all three dialects: several idemd replicas may
//! reconcile one database at once, and exactly one of them wins each row.
//! The claim is a lease too, so a reconciler that dies mid-lookup only delays
//! the row by one claim. While claimed, the row's owner is the claim token:
//! a late complete from the original executor gets NOT_OWNER, which is fine,
//! because the reconciler learns the same result from the upstream.

use super::record::Record;
use super::sql::audit::Audit;
use super::sql::{audited, render, Bind, Change, SqlError, SqlStore, COLUMNS};

impl SqlStore {
    /// IN_FLIGHT rows whose lease ended before `now_ms`, longest expired first.
    pub async fn stale_in_flight(&self, now_ms: i64, limit: u32) -> Result<Vec<Record>, SqlError> {
        let sql = render(
            self.backend(),
            &format!(
                "SELECT {COLUMNS} FROM idem_record WHERE state = 'IN_FLIGHT' AND lease_until < ? \
                 ORDER BY lease_until LIMIT ?"
            ),
        );
        self.records(&sql, &[Bind::Int(now_ms), Bind::Int(i64::from(limit))]).await
    }

    /// Take `rec` (as read) for one decision until `until_ms`. `false`: it
    /// changed since it was read (another reconciler, a late complete).
    pub async fn claim(&self, rec: &Record, token: &str, until_ms: i64, now_ms: i64) -> Result<bool, SqlError> {
        let sql = render(
            self.backend(),
            "UPDATE idem_record SET owner = ?, lease_until = ? \
             WHERE idem_key = ?k AND state = 'IN_FLIGHT' AND COALESCE(owner, '') = ? \
             AND reconcile_attempts = ? AND lease_until < ?",
        );
        let binds = [
            Bind::Text(token),
            Bind::Int(until_ms),
            Bind::Text(&rec.key),
            Bind::Text(rec.owner.as_deref().unwrap_or("")),
            Bind::Int(rec.reconcile_attempts),
            Bind::Int(now_ms),
        ];
        Ok(self.execute(&sql, &binds).await? == 1)
    }

    /// Give a claimed row back as it was read (its owner and its lease end, so
    /// the grace period keeps counting from the real end), adding a failed
    /// lookup when `failed`. Audited only when there is something to say.
    pub async fn unclaim(
        &self,
        rec: &Record,
        token: &str,
        failed: bool,
        audit: Option<&Audit<'_>>,
    ) -> Result<bool, SqlError> {
        let template =
            "UPDATE idem_record SET owner = ?, lease_until = ?, reconcile_attempts = reconcile_attempts + ? \
                        WHERE idem_key = ?k AND owner = ? AND state = 'IN_FLIGHT'";
        let binds = [
            Bind::OptText(rec.owner.as_deref()),
            Bind::OptInt(rec.lease_until_ms),
            Bind::Int(i64::from(failed)),
            Bind::Text(&rec.key),
            Bind::Text(token),
        ];
        match audit {
            None => Ok(self.execute(&render(self.backend(), template), &binds).await? == 1),
            Some(audit) => {
                let change = Change {
                    key: &rec.key,
                    from: Some("IN_FLIGHT"),
                    to: Some("IN_FLIGHT"),
                    at_ms: super::now_ms(),
                    audit,
                };
                self.change(&audited(self.backend(), template), &binds, &change).await
            }
        }
    }

    /// A claimed IN_FLIGHT row → NEEDS_REVIEW: nobody can tell whether it
    /// executed, so a person decides. The original owner is put back for the record.
    pub async fn mark_needs_review(
        &self,
        rec: &Record,
        token: &str,
        now_ms: i64,
        audit: &Audit<'_>,
    ) -> Result<bool, SqlError> {
        let template = "UPDATE idem_record SET state = 'NEEDS_REVIEW', owner = ?, lease_until = NULL, updated_at = ? \
                        WHERE idem_key = ?k AND owner = ? AND state = 'IN_FLIGHT'";
        let binds = [Bind::OptText(rec.owner.as_deref()), Bind::Int(now_ms), Bind::Text(&rec.key), Bind::Text(token)];
        let change = Change { key: &rec.key, from: Some("IN_FLIGHT"), to: Some("NEEDS_REVIEW"), at_ms: now_ms, audit };
        self.change(&audited(self.backend(), template), &binds, &change).await
    }

    /// How many rows are in `state` (the NEEDS_REVIEW backlog gauge).
    pub async fn count_in_state(&self, state: &str) -> Result<i64, SqlError> {
        let sql = render(self.backend(), "SELECT COUNT(*) FROM idem_record WHERE state = ?");
        self.scalar(&sql, &[Bind::Text(state)]).await
    }
}
