//! The audit trail: one line per state change of an operation, by whoever
//! made it — the filter (through the API), a reconciler, or an operator —
//! written in the same commit as the change itself (see `SqlStore::change`).
//!
//! It answers the question an operator gets after an incident: "did it
//! happen, and who decided?". Lines live as long as their operation's row,
//! and at least the terminal retention after the last change (the reaper
//! prunes the rest).

use idem_core::protocol::SecurityKind;
use sqlx::Row;

use super::dialect::{on_pool, render, Bind, SqlError};
use super::SqlStore;

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
pub const MAX_TRACE_ID: usize = 128;
pub const MAX_SCOPE: usize = 255;
pub const MAX_SUBJECT_HASH: usize = 128;

/// The audit action of a security event's line.
pub const SECURITY_EVENT: &str = "security_event";

/// The `idem_key` of a security event that names no operation (a forged
/// signature or an unknown key id: the claims are the sender's words).
pub const NO_KEY: &str = "00000000000000000000000000000000";

/// A security event as written to the trail: one line, no state change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SecurityEvent {
    /// `filter` (reported by it) or `idemd` (an acquire it answered PARAM_MISMATCH).
    pub actor: &'static str,
    pub kind: SecurityKind,
    pub scope: String,
    /// The operation, where the signature proved it.
    pub key: Option<String>,
    /// Who sent it (the hash of the caller's subject).
    pub subject_hash: String,
    pub trace_id: String,
    /// What happened, in words; no secret, no parameter value.
    pub why: String,
}

/// One security event as `idemd ops events` shows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct EventLine {
    pub at_ms: i64,
    pub actor: String,
    pub kind: String,
    pub scope: String,
    /// `None`: the event names no operation.
    pub key: Option<String>,
    pub subject_hash: String,
    pub trace_id: Option<String>,
    pub why: String,
}

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
            "SELECT DISTINCT idem_key FROM idem_audit WHERE trace_id = ? AND idem_key <> ? ORDER BY idem_key LIMIT 20",
        );
        self.bounded(async {
            on_pool!(&self.pool, p => {
                // A security event that named no operation is no operation to show.
                let rows = sqlx::query(&sql).bind(trace_id).bind(NO_KEY).fetch_all(p).await?;
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

    /// Append a security event's line (no state changes, so no row is touched).
    pub async fn record_event(&self, e: &SecurityEvent, at_ms: i64) -> Result<(), SqlError> {
        let sql = render(
            self.backend(),
            "INSERT INTO idem_audit (idem_key, at_ms, actor, action, from_state, to_state, why, trace_id, kind, scope, \
             subject_hash) VALUES (?k, ?, ?, ?, NULL, NULL, ?, ?, ?, ?, ?)",
        );
        let trace_id = Some(clip(&e.trace_id, MAX_TRACE_ID)).filter(|t| !t.is_empty());
        let binds = [
            Bind::Text(e.key.as_deref().unwrap_or(NO_KEY)),
            Bind::Int(at_ms),
            Bind::Text(clip(e.actor, MAX_ACTOR)),
            Bind::Text(SECURITY_EVENT),
            Bind::Text(clip(&e.why, MAX_WHY)),
            Bind::OptText(trace_id),
            Bind::Text(e.kind.as_str()),
            Bind::Text(clip(&e.scope, MAX_SCOPE)),
            Bind::Text(clip(&e.subject_hash, MAX_SUBJECT_HASH)),
        ];
        self.execute(&sql, &binds).await.map(|_| ())
    }

    /// Security events since `since_ms` (of one kind, if given), newest first.
    pub async fn events(
        &self,
        since_ms: i64,
        kind: Option<SecurityKind>,
        limit: u32,
    ) -> Result<Vec<EventLine>, SqlError> {
        let of_kind = if kind.is_some() { " AND kind = ?" } else { "" };
        let sql = render(
            self.backend(),
            &format!(
                "SELECT at_ms, actor, kind, scope, idem_key, subject_hash, trace_id, why FROM idem_audit \
                 WHERE action = ? AND at_ms >= ?{of_kind} ORDER BY at_ms DESC, id DESC LIMIT ?"
            ),
        );
        self.bounded(async {
            on_pool!(&self.pool, p => {
                let mut q = sqlx::query(&sql).bind(SECURITY_EVENT).bind(since_ms);
                if let Some(k) = kind {
                    q = q.bind(k.as_str());
                }
                let rows = q.bind(i64::from(limit)).fetch_all(p).await?;
                let mut out = Vec::with_capacity(rows.len());
                for row in rows {
                    let key: String = row.try_get("idem_key")?;
                    let key = key.trim_end().to_string();
                    out.push(EventLine {
                        at_ms: row.try_get("at_ms")?,
                        actor: row.try_get("actor")?,
                        kind: row.try_get::<Option<String>, _>("kind")?.unwrap_or_default(),
                        scope: row.try_get::<Option<String>, _>("scope")?.unwrap_or_default(),
                        key: Some(key).filter(|k| k != NO_KEY),
                        subject_hash: row.try_get::<Option<String>, _>("subject_hash")?.unwrap_or_default(),
                        trace_id: row.try_get("trace_id")?,
                        why: row.try_get("why")?,
                    });
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
            super::dialect::Backend::MySql => format!("DELETE FROM idem_audit WHERE {orphaned} ORDER BY id LIMIT ?"),
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
