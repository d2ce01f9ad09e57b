//! The reaper's SQL: terminal rows past the retention go, in bounded batches
//! so a large backlog never holds long locks or one huge transaction.
//!
//! Only DONE and FAILED are ever reaped. IN_FLIGHT waits for the reconciler
//! and NEEDS_REVIEW for a person, however old.
//!
//! A record outlives every fingerprint that can name it (DESIGN §4): a row
//! created by a fingerprint is kept until both its last change and the
//! fingerprint's `exp` (plus [`CLOCK_SKEW_MS`]) are older than the retention,
//! whatever the retention says. Otherwise a retry with a fingerprint that is
//! still valid, reaching an Envoy without the cached replay, would find no row,
//! acquire again and execute a second time.

use super::record::Record;
use super::sql::{render, Backend, Bind, SqlError, SqlStore};

/// How far the clocks of idemd's replicas (the one that reaps, the one that
/// answers a lookup) may disagree. A fingerprint's row is reaped this much
/// later than `exp + retention`, and a lookup says `reaped_possible` from
/// `exp + retention` on, so the two agree across replicas whose clocks are
/// this close.
pub const CLOCK_SKEW_MS: i64 = 5_000;

/// The earliest moment (unix ms) the reaper may delete `rec` once it is
/// terminal: the retention after its last change and after its fingerprint's
/// `exp` (plus the skew), whichever is later.
pub fn kept_until_ms(rec: &Record, retention_ms: u64) -> i64 {
    kept_until_skewed_ms(rec, retention_ms, CLOCK_SKEW_MS)
}

/// [`kept_until_ms`] with the skew allowance given: the model checker's world has one clock, so
/// it allows less than [`CLOCK_SKEW_MS`] to reach reaping within its horizon.
pub fn kept_until_skewed_ms(rec: &Record, retention_ms: u64, skew_ms: i64) -> i64 {
    let retention = i64::try_from(retention_ms).unwrap_or(i64::MAX);
    let fp = rec.fp_exp_ms.map_or(i64::MIN, |exp| exp.saturating_add(skew_ms));
    rec.updated_at_ms.max(fp).saturating_add(retention)
}

/// Whether a row for a fingerprint expiring at `exp_s` (unix seconds) may
/// have existed and been reaped by `now_ms`: only from `exp + retention` on.
/// Before that a missing row was never there (or was released: nothing ran).
pub fn reaped_possible(exp_s: u64, now_ms: i64, retention_ms: u64) -> bool {
    let exp_ms = i64::try_from(exp_s.saturating_mul(1000)).unwrap_or(i64::MAX);
    now_ms >= exp_ms.saturating_add(i64::try_from(retention_ms).unwrap_or(i64::MAX))
}

impl SqlStore {
    /// Delete up to `batch` DONE/FAILED rows last changed before `before_ms`
    /// (now minus the retention) whose fingerprint, if any, expired before
    /// `before_ms` minus the skew. How many went.
    pub async fn reap_terminal(&self, before_ms: i64, batch: u32) -> Result<u64, SqlError> {
        let fp_before_ms = before_ms.saturating_sub(CLOCK_SKEW_MS);
        // A record whose approval row still says APPROVED stays until that row goes (`rules::reapable`).
        let terminal = "state IN ('DONE', 'FAILED') AND updated_at < ? AND (fp_exp_ms IS NULL OR fp_exp_ms < ?) \
                        AND NOT EXISTS (SELECT 1 FROM idem_approval WHERE idem_approval.idem_key = idem_record.idem_key \
                        AND idem_approval.state = 'APPROVED')";
        let (sql, binds) = match self.backend() {
            // MySQL refuses LIMIT inside IN (…); its DELETE takes ORDER BY … LIMIT.
            Backend::MySql => (
                format!("DELETE FROM idem_record WHERE {terminal} ORDER BY updated_at LIMIT ?"),
                vec![Bind::Int(before_ms), Bind::Int(fp_before_ms), Bind::Int(i64::from(batch))],
            ),
            Backend::Postgres | Backend::Sqlite => (
                format!(
                    "DELETE FROM idem_record WHERE {terminal} AND idem_key IN \
                     (SELECT idem_key FROM idem_record WHERE {terminal} ORDER BY updated_at LIMIT ?)"
                ),
                vec![
                    Bind::Int(before_ms),
                    Bind::Int(fp_before_ms),
                    Bind::Int(before_ms),
                    Bind::Int(fp_before_ms),
                    Bind::Int(i64::from(batch)),
                ],
            ),
        };
        self.execute(&render(self.backend(), &sql), &binds).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::protocol::OpState;

    fn rec(updated_at_ms: i64, fp_exp_ms: Option<i64>) -> Record {
        Record {
            key: "k".into(),
            state: OpState::Done,
            param_hash: "p".into(),
            subject_hash: "u".into(),
            scope: "s".into(),
            owner: None,
            result: None,
            lease_until_ms: None,
            created_at_ms: 0,
            updated_at_ms,
            reconcile_attempts: 0,
            fp_exp_ms,
            upstream_ignores_keys: false,
            business_ref: None,
            bound_fields: None,
        }
    }

    #[test]
    fn a_row_is_kept_for_the_later_of_its_change_and_its_fingerprint() {
        assert_eq!(kept_until_ms(&rec(10_000, None), 1_000), 11_000);
        assert_eq!(kept_until_ms(&rec(10_000, Some(2_000)), 1_000), 11_000);
        assert_eq!(kept_until_ms(&rec(10_000, Some(60_000)), 1_000), 60_000 + CLOCK_SKEW_MS + 1_000);
        assert_eq!(kept_until_ms(&rec(10_000, Some(i64::MAX)), u64::MAX), i64::MAX);
    }

    #[test]
    fn reaped_is_possible_from_exp_plus_retention_on() {
        assert!(!reaped_possible(100, 100_000 + 4_999, 5_000));
        assert!(reaped_possible(100, 105_000, 5_000));
        assert!(!reaped_possible(u64::MAX, i64::MAX - 1, u64::MAX));
    }
}
