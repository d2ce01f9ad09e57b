//! The operator's SQL (`idemd ops`): list rows by state, and resolve one by
//! hand — only an IN_FLIGHT or NEEDS_REVIEW row, and only if it is still as
//! the operator last saw it.

use idem_core::protocol::{encode_body, OpState, StoredResult, TerminalState};

use super::audit::Audit;
use super::now_ms;
use super::record::Record;
use super::sql::{audited, render, Bind, Change, SqlError, SqlStore, COLUMNS};

/// What an operator decided.
#[derive(Clone, Copy, Debug)]
pub enum Resolution<'a> {
    /// It happened (DONE) or definitely failed (FAILED), with this result.
    Terminal { state: TerminalState, result_json: &'a str },
    /// It provably never executed: forget it, a confirm may run it again.
    Release,
}

/// What an operator says an operation came to, before it is checked: the CLI (`idemd ops resolve`)
/// and the approvers' console both resolve through [`planned`], so they accept and write the same.
#[derive(Clone, Copy, Debug)]
pub enum ResolveAs<'a> {
    /// It never ran.
    Release,
    /// It ran: the agent gets this JSON body with a 2xx status (200 by default) as its result.
    Done { status: Option<u16>, body: &'a [u8] },
    /// It definitely failed: the agent gets the reason in a 4xx/5xx answer (422 by default).
    Failed { status: Option<u16>, reason: &'a str },
}

// The largest result an operator may record: what a filter may.
use super::record::MAX_RESULT_BYTES;

/// What a resolution writes: the terminal state and stored result (JSON), none for a release.
#[derive(Clone, Debug)]
pub struct Planned {
    pub terminal: Option<(TerminalState, String)>,
    /// The audit line's action.
    pub action: &'static str,
}

/// What `r` writes; `Err` says what is wrong, in words for the operator.
pub fn planned(r: ResolveAs<'_>) -> Result<Planned, String> {
    let json = || vec![("content-type".to_string(), "application/json".to_string())];
    let (terminal, action) = match r {
        ResolveAs::Release => return Ok(Planned { terminal: None, action: "resolve_release" }),
        ResolveAs::Done { status, body } => {
            let status = status.unwrap_or(200);
            if !(200..=299).contains(&status) {
                return Err(format!("done needs a 2xx status, not {status}"));
            }
            if let Err(e) = serde_json::from_slice::<serde_json::Value>(body) {
                return Err(format!("the result is not JSON ({e}): it is replayed to the agent as JSON"));
            }
            if body.len() > MAX_RESULT_BYTES {
                return Err(format!("the result is larger than {MAX_RESULT_BYTES} bytes"));
            }
            let result = StoredResult { status, headers: json(), body_b64: encode_body(body) };
            ((TerminalState::Done, result), "resolve_done")
        }
        ResolveAs::Failed { status, reason } => {
            let status = status.unwrap_or(422);
            if !(400..=599).contains(&status) {
                return Err(format!("failed needs a 4xx or 5xx status, not {status}"));
            }
            let reason = reason.trim();
            if reason.is_empty() {
                return Err("failed needs a reason for the agent".into());
            }
            let body = serde_json::json!({"error": "resolved_failed", "reason": reason}).to_string();
            let result = StoredResult { status, headers: json(), body_b64: encode_body(body.as_bytes()) };
            ((TerminalState::Failed, result), "resolve_failed")
        }
    };
    let text = serde_json::to_string(&terminal.1).map_err(|e| e.to_string())?;
    Ok(Planned { terminal: Some((terminal.0, text)), action })
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
