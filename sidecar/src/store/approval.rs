//! Approval (DESIGN §4): `idem_approval` in SQL, and the gate an approval acquire passes.
//!
//! ```text
//! (empty) ──acquire with approval──▶ AWAITING_APPROVAL ──approver: approve──▶ APPROVED ──acquire──▶ IN_FLIGHT …
//!                                        │  approver: reject ──▶ REJECTED (terminal, replayed)
//!                                        └─ exp passes ───────▶ LAPSED (nothing executed)
//! ```
//!
//! Approval rows live in SQL only, never in Redis. A person's decision must be durable and
//! audited in the commit that makes it; the rows are read once per confirm of a route that asks
//! for approval (minutes of human latency make a SQL read per confirm irrelevant), and keeping
//! them out of Redis leaves no cached copy of a state a person changes from the console. Once
//! APPROVED, the acquire is the ordinary one (Redis gate, SQL insert), so concurrent confirms
//! after the approval meet the same "one insert wins" rule as any other, and the replay of the
//! executed operation is served from Redis as usual. The IN_FLIGHT insert itself refuses a key
//! whose approval row is not APPROVED (`rules::acquire_allowed`), so no route, retry or race can
//! forward an operation a person has not approved.

use idem_core::protocol::{ApprovalState, ApprovalView, Decision};
use sqlx::Row;

use super::record::ApprovalRow;
use super::rules::{self, Refusal};
use super::sql::audit::Audit;
use super::sql::{audited, on_pool, render, Backend, Bind, Change, SqlError, SqlStore};
use super::{now_ms, Store};

const APPROVAL_COLUMNS: &str =
    "idem_key, state, param_hash, subject_hash, scope, fields, fp_exp_ms, created_at, updated_at, decided_by, reason";

/// Decode one `idem_approval` row selected with [`APPROVAL_COLUMNS`], inside one `on_pool!` arm.
macro_rules! read_approval {
    ($row:expr) => {{
        let row = $row;
        let key: String = row.try_get::<String, _>("idem_key")?.trim_end().to_string();
        let state: String = row.try_get("state")?;
        Ok::<_, SqlError>(ApprovalRow {
            state: state
                .parse::<ApprovalState>()
                .ok()
                .ok_or_else(|| SqlError::Corrupt(format!("approval state {state:?} of {key}")))?,
            param_hash: row.try_get("param_hash")?,
            subject_hash: row.try_get("subject_hash")?,
            scope: row.try_get("scope")?,
            fields: row.try_get("fields")?,
            fp_exp_ms: row.try_get("fp_exp_ms")?,
            created_at_ms: row.try_get("created_at")?,
            updated_at_ms: row.try_get("updated_at")?,
            decided_by: row.try_get("decided_by")?,
            reason: row.try_get("reason")?,
            key,
        })
    }};
}

/// The reason kept with a decision, at most (the column is TEXT; the console's form says so).
pub const MAX_REASON: usize = 1000;

/// A decision's reason as it is kept (trimmed), if it is one: 1 to [`MAX_REASON`] characters, no control
/// characters but newlines (it goes into the audit trail and log lines). The decision route and the console
/// both ask this.
pub fn checked_reason(raw: &str) -> Option<&str> {
    let reason = raw.trim();
    let ok = !reason.is_empty()
        && reason.chars().count() <= MAX_REASON
        && !reason.chars().any(|c| c.is_control() && c != '\n');
    ok.then_some(reason)
}

impl SqlStore {
    /// Record an operation AWAITING_APPROVAL. `false`: a row with this key exists.
    pub async fn insert_awaiting(&self, row: &ApprovalRow, audit: &Audit<'_>) -> Result<bool, SqlError> {
        let values = "(idem_key, state, param_hash, subject_hash, scope, fields, fp_exp_ms, created_at, updated_at) \
                      VALUES (?k, 'AWAITING_APPROVAL', ?, ?, ?, ?, ?, ?, ?)";
        let text = match self.backend() {
            Backend::MySql => format!("INSERT IGNORE INTO idem_approval {values}"),
            Backend::Postgres | Backend::Sqlite => {
                format!("INSERT INTO idem_approval {values} ON CONFLICT (idem_key) DO NOTHING")
            }
        };
        let binds = [
            Bind::Text(&row.key),
            Bind::Text(&row.param_hash),
            Bind::Text(&row.subject_hash),
            Bind::Text(&row.scope),
            Bind::Text(&row.fields),
            Bind::Int(row.fp_exp_ms),
            Bind::Int(row.created_at_ms),
            Bind::Int(row.created_at_ms),
        ];
        let change =
            Change { key: &row.key, from: None, to: Some("AWAITING_APPROVAL"), at_ms: row.created_at_ms, audit };
        self.change(&audited(self.backend(), &text), &binds, &change).await
    }

    pub async fn approval(&self, key: &str) -> Result<Option<ApprovalRow>, SqlError> {
        let text = render(self.backend(), &format!("SELECT {APPROVAL_COLUMNS} FROM idem_approval WHERE idem_key = ?k"));
        self.bounded(async {
            on_pool!(&self.pool, p => {
                let row = sqlx::query(&text).bind(key).fetch_optional(p).await?;
                self.standbys_flushed(true).await?;
                match row {
                    None => Ok(None),
                    Some(row) => Ok(Some(read_approval!(row)?)),
                }
            })
        })
        .await
    }

    /// AWAITING_APPROVAL → APPROVED | REJECTED, before `exp`, with the approver's audit line.
    /// `false`: not awaiting any more (decided, lapsed) or past `exp`.
    pub async fn decide(&self, next: &ApprovalRow, now_ms: i64, audit: &Audit<'_>) -> Result<bool, SqlError> {
        let text = audited(
            self.backend(),
            "UPDATE idem_approval SET state = ?, decided_by = ?, reason = ?, updated_at = ? \
             WHERE idem_key = ?k AND state = 'AWAITING_APPROVAL' AND fp_exp_ms > ?",
        );
        let to = next.state.as_str();
        let binds = [
            Bind::Text(to),
            Bind::OptText(next.decided_by.as_deref()),
            Bind::OptText(next.reason.as_deref()),
            Bind::Int(now_ms),
            Bind::Text(&next.key),
            Bind::Int(now_ms),
        ];
        let change = Change { key: &next.key, from: Some("AWAITING_APPROVAL"), to: Some(to), at_ms: now_ms, audit };
        self.change(&text, &binds, &change).await
    }

    /// Open approvals past `exp` with no `idem_record` row (nothing executed) → LAPSED.
    pub async fn lapse(&self, key: &str, now_ms: i64, audit: &Audit<'_>) -> Result<bool, SqlError> {
        let text = audited(
            self.backend(),
            "UPDATE idem_approval SET state = 'LAPSED', updated_at = ? \
             WHERE idem_key = ?k AND state IN ('AWAITING_APPROVAL', 'APPROVED') AND fp_exp_ms <= ? \
             AND NOT EXISTS (SELECT 1 FROM idem_record WHERE idem_record.idem_key = idem_approval.idem_key)",
        );
        let binds = [Bind::Int(now_ms), Bind::Text(key), Bind::Int(now_ms)];
        let change = Change { key, from: None, to: Some("LAPSED"), at_ms: now_ms, audit };
        self.change(&text, &binds, &change).await
    }

    /// Approvals in `state`, oldest first; `open_at`: only those still open at that time (for
    /// AWAITING_APPROVAL: not past `exp`), or past it (`due`).
    pub async fn approvals(&self, state: ApprovalState, limit: i64) -> Result<Vec<ApprovalRow>, SqlError> {
        let text = render(
            self.backend(),
            &format!("SELECT {APPROVAL_COLUMNS} FROM idem_approval WHERE state = ? ORDER BY created_at LIMIT ?"),
        );
        self.approval_rows(&text, &[Bind::Text(state.as_str()), Bind::Int(limit)]).await
    }

    /// Open approvals whose `exp` has passed and that never executed, oldest first: the lapse
    /// sweep's work, with the same condition as [`Self::lapse`]. An approval that ran stays APPROVED
    /// past its `exp`; counted here, such rows filled every batch of a busy deployment (the oldest
    /// first), and newer undecided approvals never lapsed.
    pub async fn approvals_due(&self, now_ms: i64, limit: i64) -> Result<Vec<ApprovalRow>, SqlError> {
        let text = render(
            self.backend(),
            &format!(
                "SELECT {APPROVAL_COLUMNS} FROM idem_approval WHERE state IN ('AWAITING_APPROVAL', 'APPROVED') \
                 AND fp_exp_ms <= ? \
                 AND NOT EXISTS (SELECT 1 FROM idem_record WHERE idem_record.idem_key = idem_approval.idem_key) \
                 ORDER BY created_at LIMIT ?"
            ),
        );
        self.approval_rows(&text, &[Bind::Int(now_ms), Bind::Int(limit)]).await
    }

    /// Approvals waiting for a person and not past `exp`.
    pub async fn count_awaiting(&self, now_ms: i64) -> Result<i64, SqlError> {
        let text = render(
            self.backend(),
            "SELECT COUNT(*) FROM idem_approval WHERE state = 'AWAITING_APPROVAL' AND fp_exp_ms > ?",
        );
        self.scalar(&text, &[Bind::Int(now_ms)]).await
    }

    /// Decided approval rows past `exp` plus the retention: gone (`rules::approval_reapable`).
    pub async fn reap_approvals(&self, older_than_ms: i64) -> Result<u64, SqlError> {
        let text = render(
            self.backend(),
            "DELETE FROM idem_approval WHERE state IN ('APPROVED', 'REJECTED', 'LAPSED') AND fp_exp_ms < ?",
        );
        self.execute(&text, &[Bind::Int(older_than_ms)]).await
    }

    async fn approval_rows(&self, text: &str, binds: &[Bind<'_>]) -> Result<Vec<ApprovalRow>, SqlError> {
        self.bounded(async {
            on_pool!(&self.pool, p => {
                let rows = super::sql::bind_all!(sqlx::query(text), binds).fetch_all(p).await?;
                self.standbys_flushed(true).await?;
                let mut out = Vec::with_capacity(rows.len());
                for row in rows {
                    out.push(read_approval!(row)?);
                }
                Ok(out)
            })
        })
        .await
    }
}

/// Why a decision did not happen, as the decision route answers it.
#[derive(Debug)]
pub enum DecideError {
    Refused(Refusal),
    Unavailable,
}

impl Store {
    /// The approval row of `key` as the API shows it (a lookup's 404 carries it).
    pub async fn approval_view(&self, key: &str) -> Result<Option<ApprovalView>, SqlError> {
        let row = self.sql_timed("approval_get", self.sql.approval(key)).await?;
        Ok(row.and_then(|r| r.view(self.console())))
    }

    /// An approver's decision, audited as `approver:<identity>`. The approver's identity is
    /// hashed as a subject is, and refused on an operation of its own subject unless allowed.
    pub async fn decide(
        &self,
        key: &str,
        decision: Decision,
        approver: &str,
        reason: &str,
        allow_self: bool,
    ) -> Result<ApprovalRow, DecideError> {
        let row = self.sql_timed("approval_get", self.sql.approval(key)).await.map_err(|_| DecideError::Unavailable)?;
        let now = now_ms();
        let approver_hash = idem_core::fingerprint::subject_hash(approver);
        let next = rules::decide(row.as_ref(), decision, (approver, &approver_hash), reason, allow_self, now)
            .map_err(DecideError::Refused)?;
        let actor = format!("approver:{approver}");
        let why = format!("{}: {reason}", decision.as_str());
        let audit = Audit { actor: &actor, action: decision_action(decision), why: &why, trace_id: "" };
        match self.sql_timed("approval_decide", self.sql.decide(&next, now, &audit)).await {
            Ok(true) => {
                self.metrics.approval(if decision == Decision::Approve { "approved" } else { "rejected" });
                let waited = now.saturating_sub(next.created_at_ms);
                self.metrics.approval_decided(u64::try_from(waited).unwrap_or(0));
                Ok(next)
            }
            // Decided or lapsed between the read and the write: say what it is now.
            Ok(false) => {
                let now_row = self.sql.approval(key).await.map_err(|_| DecideError::Unavailable)?;
                let state = now_row.map_or(ApprovalState::Lapsed, |r| rules::approval_state_at(&r, now_ms()));
                Err(DecideError::Refused(Refusal::Decided(state)))
            }
            Err(_) => Err(DecideError::Unavailable),
        }
    }

    /// One pass of the lapse sweep: open approvals past `exp` with nothing executed → LAPSED.
    pub async fn lapse_due(&self, batch: i64) -> Result<u64, SqlError> {
        let now = now_ms();
        let due = self.sql_timed("approvals_due", self.sql.approvals_due(now, batch)).await?;
        let mut lapsed = 0;
        for row in due {
            let audit = Audit {
                actor: "idemd",
                action: "approval_lapsed",
                why: "no approval before the fingerprint's exp: nothing executed",
                trace_id: "",
            };
            if self.sql_timed("approval_lapse", self.sql.lapse(&row.key, now, &audit)).await? {
                self.metrics.approval("lapsed");
                lapsed += 1;
            }
        }
        Ok(lapsed)
    }

    /// Approvals waiting for a person, oldest first.
    pub async fn pending_approvals(&self, limit: i64) -> Result<Vec<ApprovalRow>, SqlError> {
        let rows = self.sql_timed("approvals", self.sql.approvals(ApprovalState::AwaitingApproval, limit)).await?;
        let now = now_ms();
        Ok(rows.into_iter().filter(|r| r.fp_exp_ms > now).collect())
    }
}

fn decision_action(d: Decision) -> &'static str {
    match d {
        Decision::Approve => "approve",
        Decision::Reject => "reject",
    }
}

#[cfg(test)]
mod reason_tests {
    use super::{checked_reason, MAX_REASON};

    #[test]
    fn a_reason_is_trimmed_bounded_and_free_of_control_characters() {
        assert_eq!(checked_reason("  within budget\n"), Some("within budget"));
        assert_eq!(checked_reason("line one\nline two"), Some("line one\nline two"));
        assert_eq!(checked_reason(&"é".repeat(MAX_REASON)).map(|r| r.chars().count()), Some(MAX_REASON));
        for bad in ["", "   ", "fake\rlog line", "bell\u{7}", "esc\u{1b}[31m"] {
            assert_eq!(checked_reason(bad), None, "{bad:?}");
        }
        assert_eq!(checked_reason(&"x".repeat(MAX_REASON + 1)), None);
    }
}
