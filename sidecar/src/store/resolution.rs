//! What a person's decision writes (`review`, above the store, decides it): the row settled as
//! done or failed, or deleted for a release, with its audit line, only if it is still as read.

use super::now_ms;
use super::record::Record;
use super::sql::audit::Audit;
use super::sql::{audited, render, Bind, Change, SqlError, SqlStore, COLUMNS};
use idem_core::protocol::{OpState, TerminalState};

/// What an operator decided.
#[derive(Clone, Copy, Debug)]
pub enum Resolution<'a> {
    /// It happened (DONE) or definitely failed (FAILED), with this result.
    Terminal { state: TerminalState, result_json: &'a str },
    /// It provably never executed: forget it, a confirm may run it again.
    Release,
}

impl SqlStore {
    /// Up to `limit` rows in `state`, least recently changed first.
    pub async fn list_in_state(&self, state: OpState, limit: u32) -> Result<Vec<Record>, SqlError> {
        let sql = render(
            self.backend(),
            &format!("SELECT {COLUMNS} FROM idem_record WHERE state = ? ORDER BY updated_at, idem_key LIMIT ?"),
        );
        self.records(&sql, &[Bind::Text(state.as_str()), Bind::Int(i64::from(limit))]).await
    }

    /// Apply `resolution` to `seen` if the row is still in the state and with
    /// the owner it had when read. `false`: it changed meanwhile (a reconciler
    /// claimed or decided it, the executor completed it); look again.
    pub async fn resolve(
        &self,
        seen: &Record,
        resolution: Resolution<'_>,
        audit: &Audit<'_>,
    ) -> Result<bool, SqlError> {
        let from = seen.state.as_str();
        let owner = seen.owner.as_deref().unwrap_or("");
        let now = now_ms();
        match resolution {
            Resolution::Terminal { state, result_json } => {
                let to = state.as_str();
                let template = "UPDATE idem_record SET state = ?, result = ?, lease_until = NULL, updated_at = ? \
                                WHERE idem_key = ?k AND state = ? AND COALESCE(owner, '') = ?";
                let binds = [
                    Bind::Text(to),
                    Bind::Text(result_json),
                    Bind::Int(now),
                    Bind::Text(&seen.key),
                    Bind::Text(from),
                    Bind::Text(owner),
                ];
                let change = Change { key: &seen.key, from: Some(from), to: Some(to), at_ms: now, audit };
                self.change(&audited(self.backend(), template), &binds, &change).await
            }
            Resolution::Release => {
                let template = "DELETE FROM idem_record WHERE idem_key = ?k AND state = ? AND COALESCE(owner, '') = ?";
                let binds = [Bind::Text(&seen.key), Bind::Text(from), Bind::Text(owner)];
                let change = Change { key: &seen.key, from: Some(from), to: None, at_ms: now, audit };
                self.change(&audited(self.backend(), template), &binds, &change).await
            }
        }
    }
}
