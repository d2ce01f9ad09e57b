//! The audit trail: one line per state change of an operation, by whoever
//! made it — the filter (through the API), a reconciler, or an operator —
//! written in the same commit as the change itself (see `SqlStore::change`).
//!
//! It answers the question an operator gets after an incident: "did it
//! happen, and who decided?". Lines live as long as their operation's row,
//! and at least the terminal retention after the last change (the reaper
//! prunes the rest).

use sqlx::Row;

use super::sql::{on_pool, render, Bind, SqlError, SqlStore};

/// Who makes a state change, what it is, and the evidence.
#[derive(Clone, Copy, Debug)]
pub struct Audit<'a> {
    /// `filter`, `idemd`, `reconciler:<instance>` or `operator:<name>`.
    pub actor: &'a str,
    /// A short verb: `acquire`, `complete`, `reconcile_done`, `resolve_release`, …
    pub action: &'a str,
    pub why: &'a str,
    /// The filter's trace id for the call behind the change ("" for none).
    pub trace_id: &'a str,
}

/// One line of the trail as stored.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct AuditLine {
    pub at_ms: i64,
    pub actor: String,
    pub action: String,
    pub from_state: Option<String>,
    pub to_state: Option<String>,
    pub why: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
}

/// The bounds of the columns, so a long reason is cut rather than refused by
/// the database after the state change was already decided.
pub const MAX_ACTOR: usize = 128;
pub const MAX_WHY: usize = 2000;

impl SqlStore {
    /// Every line of one operation, oldest first.
    pub async fn history(&self, key: &str) -> Result<Vec<AuditLine>, SqlError> {
        let sql = render(
            self.backend(),
            "SELECT at_ms, actor, action, from_state, to_state, why, trace_id FROM idem_audit WHERE idem_key = ?k ORDER BY id",
        );
        self.bounded(async {
            on_pool!(&self.pool, p => {
                let rows = sqlx::query(&sql).bind(key).fetch_all(p).await?;
                let mut out = Vec::with_capacity(rows.len());
                for row in rows {
                    out.push(AuditLine {
                        at_ms: row.try_get("at_ms")?,
                        actor: row.try_get("actor")?,
                        action: row.try_get("action")?,
                        from_state: row.try_get("from_state")?,
                        to_state: row.try_get("to_state")?,
                        why: row.try_get("why")?,
                        trace_id: row.try_get("trace_id")?,
                    });
                }
                Ok(out)
            })
        })
        .await
    }

    /// The operations whose audit trail names `trace_id` (a reply's reference).
    pub async fn keys_by_trace(&self, trace_id: &str) -> Result<Vec<String>, SqlError> {
        let sql = render(
            self.backend(),
            "SELECT DISTINCT idem_key FROM idem_audit WHERE trace_id = ? ORDER BY idem_key LIMIT 20",
        );
        self.bounded(async {
            on_pool!(&self.pool, p => {
                let rows = sqlx::query(&sql).bind(trace_id).fetch_all(p).await?;
                let mut out = Vec::with_capacity(rows.len());
                for row in rows {
                    let key: String = row.try_get("idem_key")?;
                    out.push(key.trim_end().to_string());
                }
                Ok(out)
            })
        })
        .await
    }

    /// Delete up to `batch` lines older than `before_ms` whose operation has
    /// no row any more (reaped or released). How many went.
    pub async fn prune_audit(&self, before_ms: i64, batch: u32) -> Result<u64, SqlError> {
        let orphaned = "at_ms < ? AND NOT EXISTS (SELECT 1 FROM idem_record r WHERE r.idem_key = idem_audit.idem_key)";
        let sql = match self.backend() {
            // MySQL refuses LIMIT inside IN (…) and a subquery on the table
            // being deleted from; its single-table DELETE takes ORDER BY … LIMIT.
            super::sql::Backend::MySql => format!("DELETE FROM idem_audit WHERE {orphaned} ORDER BY id LIMIT ?"),
            _ => format!(
                "DELETE FROM idem_audit WHERE id IN (SELECT id FROM idem_audit WHERE {orphaned} ORDER BY id LIMIT ?)"
            ),
        };
        self.execute(&render(self.backend(), &sql), &[Bind::Int(before_ms), Bind::Int(i64::from(batch))]).await
    }
}

/// Cut `s` to at most `max` bytes on a character boundary.
pub fn clip(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clip_keeps_whole_characters() {
        assert_eq!(clip("abc", 5), "abc");
        assert_eq!(clip("abcdef", 3), "abc");
        assert_eq!(clip("äöü", 3), "ä");
        assert_eq!(clip("äöü", 4), "äö");
    }
}
