//! A person's decision about an operation the machine could not settle (DESIGN §4, "No person
//! decides their own operation"): the one place every surface — the approvers' console and `idemd
//! ops resolve` — goes through, so they accept, refuse and write the same.
//!
//! - What was said is checked before anything is read ([`check`]): a result that is JSON, statuses
//!   in range, a reason for the audit trail, a person who names themselves.
//! - The row must be NEEDS_REVIEW, or IN_FLIGHT with its lease over (`force`: also a held lease,
//!   the CLI's `--force`), and still as read when written (else "changed meanwhile").
//! - **Nobody settles their own operation**: the person's name, hashed as a subject is, must not be
//!   the operation's subject (`rules::own_subject`, the approvers' rule), unless the deployment
//!   allows it (`--allow-self-approval`).
//! - **A release needs proof that nothing ran**: it is the one decision that lets the agent's retry
//!   execute. Where the scope has a status endpoint, it is asked at that moment, as the reconciler
//!   asks it (`reconcile::decide::proof`), and only "absent" (a 404, the lease over by the grace)
//!   releases; a record, a failed lookup or a 404 too soon refuses, saying what it found. Where no
//!   lookup is possible (no endpoint, or none that can name this operation), the person's word
//!   and reason are all there is, and the audit line says so.
//!
//! The decision lives here, above the store and the reconciler's lookups it uses; what a decision
//! writes, with its audit line, is the store's (`store::resolution`).
//!
//! What the surfaces know of the person differs: the console's approver proved a credential of
//! their own; `idemd ops` runs with database access, so its `--actor` is the operator's own word
//! (anyone with the database's credentials can change rows without idemd). The rule there keeps an
//! honest operator from settling their own operation and names who decided; it is no barrier
//! against someone who holds the database's password.

use idem_core::protocol::{encode_body, OpState, StoredResult, TerminalState};

use crate::reconcile::decide::{proof, Asked, Proof, StatusAnswer};
use crate::reconcile::Lookups;
use crate::store::now_ms;
use crate::store::record::Record;
use crate::store::resolution::Resolution;
use crate::store::rules;
use crate::store::sql::audit::{clip, Audit, MAX_ACTOR, MAX_WHY};
use crate::store::sql::{SqlError, SqlStore};

/// What a person says an operation came to, before it is checked.
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
use crate::store::record::MAX_RESULT_BYTES;

/// What a resolution writes: the terminal state and stored result (JSON), none for a release.
#[derive(Clone, Debug)]
pub struct Planned {
    pub terminal: Option<(TerminalState, String)>,
    /// The audit line's action.
    pub action: &'static str,
}

/// What `r` writes; `Err` says what is wrong, in words for the operator.
fn planned(r: ResolveAs<'_>) -> Result<Planned, String> {
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

/// A person's decision, as a surface received it.
#[derive(Clone, Copy, Debug)]
pub struct Ask<'a> {
    pub said: ResolveAs<'a>,
    /// Why, for the audit trail (required).
    pub why: &'a str,
    /// Who decides, as the gateway names its subjects (the subject header's value, the token's
    /// subject): hashed as a subject is and compared with the operation's. The audit names them
    /// `operator:<person>`.
    pub person: &'a str,
    /// `--allow-self-approval`: a person may settle an operation of their own subject.
    pub allow_self: bool,
    /// Also an IN_FLIGHT operation whose lease is still held (`idemd ops resolve --force`).
    pub force: bool,
}

/// The longest name a person may give (an approver's identity is at most as long).
pub const MAX_PERSON: usize = 128;

/// Why a decision was not written, in words for the person.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// What was said cannot be written as it is: nothing was read.
    Usage(String),
    /// The database (or the status endpoint's lookup, for a release) could not be asked.
    Unavailable(String),
    NoSuchOperation,
    WrongState(OpState),
    /// IN_FLIGHT with its lease held until then (unix ms): its executor may still be running it.
    LeaseHeld(i64),
    /// The person is the operation's own subject.
    OwnSubject,
    /// A release without proof that nothing ran: what the lookup found.
    NotProvenAbsent(String),
    /// The row changed between the read and the write (now in this state; `None`: gone).
    Changed(Option<OpState>),
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Usage(why) | Refusal::Unavailable(why) => f.write_str(why),
            Refusal::NoSuchOperation => f.write_str("no such operation: never acquired, released, or reaped"),
            Refusal::WrongState(state) => {
                write!(f, "it is {}: only IN_FLIGHT or NEEDS_REVIEW operations can be resolved", state.as_str())
            }
            Refusal::LeaseHeld(until) => write!(
                f,
                "it is IN_FLIGHT with its lease held until {}: its executor may still be running it. Wait for \
                 the lease to end (the reconciler then decides), or force it",
                idem_core::utc::iso_utc_ms(*until)
            ),
            Refusal::OwnSubject => {
                f.write_str("own_subject: it is an operation of your own subject; another person must decide it")
            }
            Refusal::NotProvenAbsent(found) => write!(f, "not released: {found}"),
            Refusal::Changed(now) => write!(
                f,
                "it changed while you decided (now {}); look again and decide again",
                now.map_or("gone", |s| s.as_str())
            ),
        }
    }
}

/// What a decision wrote.
#[derive(Clone, Debug)]
pub struct Resolved {
    pub from: OpState,
    /// `None`: released (no row; a confirm may run it again).
    pub to: Option<TerminalState>,
    /// The audit line's action.
    pub action: &'static str,
    /// The row as it is now (`None` when released), for the cache.
    pub now: Option<Record>,
}

/// What `ask` writes, checked before anything is read.
pub fn check(ask: &Ask<'_>) -> Result<Planned, Refusal> {
    let why = ask.why.trim();
    if why.is_empty() {
        return Err(Refusal::Usage("a reason (why) is required: it goes into the audit trail".into()));
    }
    if why.len() > MAX_WHY {
        return Err(Refusal::Usage(format!("the reason (why) is longer than {MAX_WHY} bytes")));
    }
    let person = ask.person.trim();
    if person.is_empty() || person.chars().count() > MAX_PERSON || person.chars().any(char::is_control) {
        return Err(Refusal::Usage(format!(
            "name yourself (1 to {MAX_PERSON} printable characters) as the gateway names you: nobody settles an \
             operation of their own subject"
        )));
    }
    planned(ask.said).map_err(Refusal::Usage)
}

/// May `ask` settle `rec` at `now_ms` at all: its state and lease, and whose it is.
pub fn admissible(rec: &Record, ask: &Ask<'_>, now_ms: i64) -> Result<(), Refusal> {
    match rec.state {
        OpState::NeedsReview => {}
        OpState::InFlight => {
            let lease = rec.lease_until_ms.unwrap_or(0);
            if lease > now_ms && !ask.force {
                return Err(Refusal::LeaseHeld(lease));
            }
        }
        other => return Err(Refusal::WrongState(other)),
    }
    let person_hash = idem_core::fingerprint::subject_hash(ask.person.trim());
    if rules::own_subject(&rec.subject_hash, &person_hash, ask.allow_self) {
        return Err(Refusal::OwnSubject);
    }
    Ok(())
}

/// The evidence a release of `rec` rests on, from what its status endpoint said at that moment
/// (`asked`); refused unless it proves the operation absent. Without a lookup (no endpoint, or
/// none that can name this operation), the person's word.
pub fn release_evidence(
    rec: &Record,
    asked: &Asked,
    lookups: Option<&Lookups>,
    now_ms: i64,
) -> Result<String, Refusal> {
    let rules = lookups.map(|l| l.rules.clone()).unwrap_or_default();
    match asked {
        Asked::NoEndpoint => {
            return Ok(format!("no status endpoint for scope {}: released on the person's word", rec.scope))
        }
        Asked::Unaskable(why) => return Ok(format!("no lookup can name it ({why}): released on the person's word")),
        Asked::Answered(..) => {}
    }
    let found = matches!(asked, Asked::Answered(_, StatusAnswer::Found { .. }));
    match proof(rec, asked, now_ms, &rules) {
        (Proof::Absent, evidence) => Ok(format!("checked at the release: {evidence}")),
        // A record, whatever it reads as (done, failed, neither, another operation's): not absent.
        (_, evidence) if found => Err(Refusal::NotProvenAbsent(format!(
            "the upstream has a record of it ({evidence}); resolve it as done or failed"
        ))),
        (Proof::TooSoon, evidence) => {
            Err(Refusal::NotProvenAbsent(format!("{evidence}: too soon to trust that it never ran")))
        }
        (_, evidence) => {
            Err(Refusal::NotProvenAbsent(format!("the lookup proves nothing ({evidence}); try again later")))
        }
    }
}

/// Settle `key` as `ask` says, through every rule above: read the row, check it, ask its status
/// endpoint (a release), write the decision with its audit line if the row is still as read.
/// The caller brings its cache in line with [`Resolved::now`].
pub async fn resolve(sql: &SqlStore, lookups: Option<&Lookups>, key: &str, ask: &Ask<'_>) -> Result<Resolved, Refusal> {
    let planned = check(ask)?;
    let unavailable = |e: SqlError| Refusal::Unavailable(format!("the database cannot be asked: {e}"));
    let rec = sql.get(key).await.map_err(unavailable)?.ok_or(Refusal::NoSuchOperation)?;
    admissible(&rec, ask, now_ms())?;
    let mut why = ask.why.trim().to_string();
    if planned.terminal.is_none() {
        let asked = match lookups {
            Some(l) => l.status.ask(&rec).await,
            None => Asked::NoEndpoint,
        };
        let evidence = release_evidence(&rec, &asked, lookups, now_ms())?;
        why = clip(&format!("{why} [{evidence}]"), MAX_WHY).to_string();
    }
    let actor = format!("operator:{}", ask.person.trim());
    let audit = Audit { actor: clip(&actor, MAX_ACTOR), action: planned.action, why: &why, trace_id: "" };
    let resolution = match &planned.terminal {
        None => Resolution::Release,
        Some((state, result_json)) => Resolution::Terminal { state: *state, result_json },
    };
    if !sql.resolve(&rec, resolution, &audit).await.map_err(unavailable)? {
        let now = sql.get(key).await.map_err(unavailable)?;
        return Err(Refusal::Changed(now.map(|r| r.state)));
    }
    let now = match &planned.terminal {
        None => None,
        Some(_) => sql.get(key).await.ok().flatten(),
    };
    Ok(Resolved { from: rec.state, to: planned.terminal.as_ref().map(|(s, _)| *s), action: planned.action, now })
}
