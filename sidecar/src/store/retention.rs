//! The reaper's SQL: terminal rows past the retention go, in bounded batches
//! so a large backlog never holds long locks or one huge transaction.
//!
//! Only DONE and FAILED are ever reaped. IN_FLIGHT waits for the reconciler
//! and NEEDS_REVIEW for a person, however old.

use super::sql::{render, Backend, Bind, SqlError, SqlStore};

impl SqlStore {
    /// Delete up to `batch` DONE/FAILED rows last changed before `before_ms`.
    /// How many went.
    pub async fn reap_terminal(&self, before_ms: i64, batch: u32) -> Result<u64, SqlError> {
        let terminal = "state IN ('DONE', 'FAILED') AND updated_at < ?";
        let (sql, binds) = match self.backend() {
            // MySQL refuses LIMIT inside IN (…); its DELETE takes ORDER BY … LIMIT.
            Backend::MySql => (
                format!("DELETE FROM idem_record WHERE {terminal} ORDER BY updated_at LIMIT ?"),
                vec![Bind::Int(before_ms), Bind::Int(i64::from(batch))],
            ),
            Backend::Postgres | Backend::Sqlite => (
                format!(
                    "DELETE FROM idem_record WHERE {terminal} AND idem_key IN \
                     (SELECT idem_key FROM idem_record WHERE {terminal} ORDER BY updated_at LIMIT ?)"
                ),
                vec![Bind::Int(before_ms), Bind::Int(before_ms), Bind::Int(i64::from(batch))],
            ),
        };
        self.execute(&render(self.backend(), &sql), &binds).await
    }
}
