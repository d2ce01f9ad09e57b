//! `idemd ops`: what a person needs when "did it happen?" has no automatic
//! answer — list operations by state, show one with its whole history, and
//! resolve an IN_FLIGHT or NEEDS_REVIEW one by hand, with a reason that goes
//! into the audit trail next to the filter's and the reconciler's lines; and
//! `ops events`, the security events (tampering, another subject's
//! fingerprints, forgeries) newest first.
//!
//! Exit codes: 0 done; 1 the database (or a file) could not be reached;
//! 2 bad usage; 3 refused (no such operation, wrong state, changed meanwhile,
//! lease still held).

mod print;

use std::process::ExitCode;
use std::time::Duration;

use idem_core::protocol::{OpState, TerminalState};

use crate::api::is_token;
use crate::config::ops::{OpsCommand, ResolveArgs};
use crate::config::OpsArgs;
use crate::redact::redact_url;
use crate::store::audit::{clip, Audit, MAX_ACTOR, MAX_WHY};
use crate::store::now_ms;
use crate::store::redis::{RedisOptions, RedisStore};
use crate::store::review::{self, Resolution, ResolveAs};
use crate::store::sql::{SqlOptions, SqlStore};

#[derive(Debug)]
pub enum OpsError {
    Unreachable(String),
    Usage(String),
    Refused(String),
}

impl OpsError {
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Unreachable(_) => 1,
            Self::Usage(_) => 2,
            Self::Refused(_) => 3,
        }
    }
}

impl std::fmt::Display for OpsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unreachable(m) | Self::Usage(m) | Self::Refused(m) => f.write_str(m),
        }
    }
}

pub fn main(args: OpsArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idemd ops: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(args)) {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("idemd ops: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

/// Everything but the printing, so tests can call it: the text for stdout.
pub async fn run(args: OpsArgs) -> Result<String, OpsError> {
    // Check what can be checked before touching the database.
    let actor = operator(&args)?;
    if let OpsCommand::Show { key, .. } = &args.command {
        // An operation key, or a trace id from an agent's reply (printable, bounded).
        if !crate::api::is_token(key)
            && (key.is_empty() || key.len() > 128 || !key.bytes().all(|b| b.is_ascii_graphic()))
        {
            check_key(key)?;
        }
    }
    let resolution = match &args.command {
        OpsCommand::Resolve(r) => Some(Planned::from_args(r)?),
        _ => None,
    };
    let sql = connect(&args).await?;
    match args.command {
        OpsCommand::List { state, limit, json } => {
            let rows = sql.list_in_state(state.op_state(), limit).await.map_err(unreachable)?;
            if json {
                let list: Vec<_> = rows.iter().map(print::record_json).collect();
                Ok(format!("{}\n", serde_json::Value::Array(list)))
            } else {
                Ok(print::table(&rows))
            }
        }
        OpsCommand::Show { key: reference, json } => {
            let key = if crate::api::is_token(&reference) {
                reference
            } else {
                let keys = sql.keys_by_trace(&reference).await.map_err(unreachable)?;
                match keys.as_slice() {
                    [one] => one.clone(),
                    [] => return Err(OpsError::Refused(format!("no operation with trace id {reference}"))),
                    many => {
                        return Err(OpsError::Refused(format!(
                            "trace id {reference} names {} operations: {}; show one by its key",
                            many.len(),
                            many.join(", ")
                        )))
                    }
                }
            };
            let rec = sql.get(&key).await.map_err(unreachable)?;
            let history = sql.history(&key).await.map_err(unreachable)?;
            if rec.is_none() && history.is_empty() {
                return Err(OpsError::Refused(format!("no operation {key}: never acquired, or reaped")));
            }
            if json {
                let v = serde_json::json!({"operation": rec.as_ref().map(print::record_json), "history": history});
                Ok(format!("{v}\n"))
            } else {
                Ok(print::show(&key, rec.as_ref(), &history))
            }
        }
        OpsCommand::Events { since, kind, limit, json } => {
            let since_ms = since.map_or(0, |ms| now_ms().saturating_sub(i64::try_from(ms).unwrap_or(i64::MAX)));
            let events = sql.events(since_ms, kind, limit).await.map_err(unreachable)?;
            if json {
                let list: Vec<_> = events.iter().map(print::event_json).collect();
                Ok(format!("{}\n", serde_json::Value::Array(list)))
            } else {
                Ok(print::events(&events))
            }
        }
        OpsCommand::Resolve(r) => {
            let Some(planned) = resolution else { return Err(OpsError::Usage("nothing to resolve".into())) };
            resolve(&args.redis_url, args.redis_cluster, &sql, &r, &planned, &actor).await
        }
    }
}

/// A resolve, checked and with its result built, before the database is asked.
struct Planned {
    /// `None`: release.
    terminal: Option<(TerminalState, String)>,
    action: &'static str,
    why: String,
}

impl Planned {
    fn from_args(r: &ResolveArgs) -> Result<Self, OpsError> {
        check_key(&r.key)?;
        let why = r.why.trim();
        if why.is_empty() {
            return Err(OpsError::Usage("--why must say why (it goes into the audit trail)".into()));
        }
        if why.len() > MAX_WHY {
            return Err(OpsError::Usage(format!("--why is longer than {MAX_WHY} bytes")));
        }
        let body;
        let said = if r.done {
            let path = r.result_file.as_ref().ok_or_else(|| OpsError::Usage("--done needs --result-file".into()))?;
            body = std::fs::read(path)
                .map_err(|e| OpsError::Unreachable(format!("cannot read {}: {e}", path.display())))?;
            ResolveAs::Done { status: r.status, body: &body }
        } else if r.failed {
            ResolveAs::Failed { status: r.status, reason: r.reason.as_deref().unwrap_or("") }
        } else {
            if r.status.is_some() {
                return Err(OpsError::Usage("--release replays nothing: --status does not apply".into()));
            }
            ResolveAs::Release
        };
        let review::Planned { terminal, action } =
            review::planned(said).map_err(|e| match r.result_file.as_ref().filter(|_| r.done) {
                Some(path) => OpsError::Usage(format!("{}: {e}", path.display())),
                None => OpsError::Usage(e),
            })?;
        Ok(Self { terminal, action, why: why.to_string() })
    }
}

async fn resolve(
    redis_url: &Option<String>,
    redis_cluster: bool,
    sql: &SqlStore,
    r: &ResolveArgs,
    planned: &Planned,
    actor: &str,
) -> Result<String, OpsError> {
    let rec = sql
        .get(&r.key)
        .await
        .map_err(unreachable)?
        .ok_or_else(|| OpsError::Refused(format!("no operation {}: never acquired, released, or reaped", r.key)))?;
    match rec.state {
        OpState::NeedsReview => {}
        OpState::InFlight => {
            let lease = rec.lease_until_ms.unwrap_or(0);
            if lease > now_ms() && !r.force {
                return Err(OpsError::Refused(format!(
                    "{} is IN_FLIGHT with its lease held until {}: its executor may still be running it. \
                     Wait for the lease to end (the reconciler then decides), or pass --force",
                    r.key,
                    idem_core::utc::iso_utc_ms(lease)
                )));
            }
        }
        other => {
            return Err(OpsError::Refused(format!(
                "{} is {}: only IN_FLIGHT or NEEDS_REVIEW operations can be resolved",
                r.key,
                other.as_str()
            )));
        }
    }
    let resolution = match &planned.terminal {
        Some((state, result_json)) => Resolution::Terminal { state: *state, result_json },
        None => Resolution::Release,
    };
    let audit = Audit { actor, action: planned.action, why: &planned.why, trace_id: "" };
    if !sql.resolve(&rec, resolution, &audit).await.map_err(unreachable)? {
        let now = sql.get(&r.key).await.map_err(unreachable)?;
        let now = now.map(|n| n.state.as_str()).unwrap_or("gone");
        return Err(OpsError::Refused(format!(
            "{} changed while you decided (now {now}); run `idemd ops show {}` and decide again",
            r.key, r.key
        )));
    }
    let to = match &planned.terminal {
        Some((TerminalState::Done, _)) => "DONE",
        Some((TerminalState::Failed, _)) => "FAILED",
        None => "released (no row: a confirm may run it again)",
    };
    let mut text = format!("{}: {} -> {to}\n", r.key, rec.state.as_str());
    if let Some(url) = redis_url {
        text.push_str(&evict(url, redis_cluster, &r.key).await);
    }
    Ok(text)
}

/// Drop the cached copy so the next confirm reads the decision from SQL.
/// Not being able to is not a failure: the sidecars check SQL anyway.
async fn evict(url: &str, cluster: bool, key: &str) -> String {
    let opts = RedisOptions {
        url: url.to_string(),
        cluster,
        timeout: Duration::from_secs(2),
        retry: Duration::from_millis(500),
    };
    let outcome = match RedisStore::open(&opts) {
        Ok(r) => r.evict(key).await.map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    match outcome {
        Ok(()) => "redis: cached copy dropped\n".to_string(),
        Err(e) => format!(
            "redis {}: could not drop the cached copy ({e}); the sidecars still see the decision, by checking SQL\n",
            redact_url(url)
        ),
    }
}

async fn connect(args: &OpsArgs) -> Result<SqlStore, OpsError> {
    let opts = SqlOptions { max_connections: 2, timeout: Duration::from_millis(args.sql_timeout_ms.max(1)) };
    SqlStore::connect(&args.database_url, &opts)
        .await
        .map_err(|e| OpsError::Unreachable(format!("database {}: {e}", redact_url(&args.database_url))))
}

/// `operator:<--actor, or $USER>` for the audit trail.
fn operator(args: &OpsArgs) -> Result<String, OpsError> {
    let name = args
        .actor
        .clone()
        .or_else(|| std::env::var("USER").ok())
        .map(|n| n.trim().to_string())
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "unknown".to_string());
    if name.chars().any(char::is_control) {
        return Err(OpsError::Usage("--actor must be printable".into()));
    }
    Ok(clip(&format!("operator:{name}"), MAX_ACTOR).to_string())
}

fn check_key(key: &str) -> Result<(), OpsError> {
    if is_token(key) {
        Ok(())
    } else {
        Err(OpsError::Usage(format!("{key:?} is not a key: expected 32 lowercase hex characters (the nonce)")))
    }
}

fn unreachable(e: crate::store::sql::SqlError) -> OpsError {
    OpsError::Unreachable(e.to_string())
}
