//! `idemd ops`: what a person needs when "did it happen?" has no automatic
//! answer — list operations by state, show one with its whole history, and
//! resolve an IN_FLIGHT or NEEDS_REVIEW one by hand, with a reason that goes
//! into the audit trail next to the filter's and the reconciler's lines
//! (through `review`, as the approvers' console: the operator names
//! themselves with `--actor` and may not settle an operation of their own
//! subject; a release asks the scope's status endpoint first); and
//! `ops events`, the security events (tampering, another subject's
//! fingerprints, forgeries) newest first.
//!
//! Exit codes: 0 done; 1 the database (or a file) could not be reached;
//! 2 bad usage; 3 refused (no such operation, wrong state, changed meanwhile,
//! lease still held).

mod print;

use std::process::ExitCode;
use std::time::Duration;

use idem_core::protocol::TerminalState;

use crate::api::is_token;
use crate::config::ops::{OpsCommand, ResolveArgs};
use crate::config::OpsArgs;
use crate::reconcile::Lookups;
use crate::redact::redact_url;
use crate::review::{self, Ask, ResolveAs};
use crate::store::now_ms;
use crate::store::redis::{RedisOptions, RedisStore};
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
    if let OpsCommand::Show { key, .. } = &args.command {
        // An operation key, or a trace id from an agent's reply: any text a client sent as its
        // request id (idemd keeps it percent-encoded, `api::safe_trace_id`), bounded, one line.
        if !crate::api::is_token(key) && (key.trim().is_empty() || key.len() > 512 || key.chars().any(char::is_control))
        {
            check_key(key)?;
        }
    }
    let resolution = match &args.command {
        OpsCommand::Resolve(r) => Some(Resolve::from_args(r, args.actor.as_deref())?),
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
                // As the audit keeps it (`api::safe_trace_id`: a request id with a space or a
                // non-ASCII letter is percent-encoded), or as the operator pasted it from there.
                let mut keys = sql.keys_by_trace(&crate::api::safe_trace_id(&reference)).await.map_err(unreachable)?;
                if keys.is_empty() {
                    keys = sql.keys_by_trace(&reference).await.map_err(unreachable)?;
                }
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
            let Some(resolve) = resolution else { return Err(OpsError::Usage("nothing to resolve".into())) };
            resolve.run(&args.redis_url, args.redis_cluster, &sql, &r).await
        }
    }
}

/// A resolve, its input read and checked (`review::check`) and its lookups configured,
/// before the database is asked.
struct Resolve {
    /// The `--result-file`'s bytes (`--done`).
    body: Vec<u8>,
    person: String,
    lookups: Lookups,
}

impl Resolve {
    fn from_args(r: &ResolveArgs, actor: Option<&str>) -> Result<Self, OpsError> {
        check_key(&r.key)?;
        // The operator names themselves: no $USER, which is often a shared account on the host
        // that runs this; the name is compared with the operation's subject (review).
        let person = actor.map(str::trim).filter(|a| !a.is_empty()).ok_or_else(|| {
            OpsError::Usage(
                "resolve needs --actor (or IDEM_ACTOR): your name as the gateway names you (its subject), for the \
                 audit trail and the rule that nobody settles an operation of their own subject"
                    .into(),
            )
        })?;
        let body = match (r.done, r.result_file.as_ref()) {
            (true, Some(path)) => std::fs::read(path)
                .map_err(|e| OpsError::Unreachable(format!("cannot read {}: {e}", path.display())))?,
            (true, None) => return Err(OpsError::Usage("--done needs --result-file".into())),
            (false, _) => Vec::new(),
        };
        if r.release && r.status.is_some() {
            return Err(OpsError::Usage("--release replays nothing: --status does not apply".into()));
        }
        let lookups = r.status_args.lookups(1).map_err(|broken| OpsError::Usage(broken.join("\n")))?;
        let resolve = Self { body, person: person.to_string(), lookups };
        review::check(&resolve.ask(r)).map_err(|refused| OpsError::Usage(refused.to_string()))?;
        Ok(resolve)
    }

    fn ask<'a>(&'a self, r: &'a ResolveArgs) -> Ask<'a> {
        let said = if r.done {
            ResolveAs::Done { status: r.status, body: &self.body }
        } else if r.failed {
            ResolveAs::Failed { status: r.status, reason: r.reason.as_deref().unwrap_or("") }
        } else {
            ResolveAs::Release
        };
        Ask { said, why: &r.why, person: &self.person, allow_self: r.allow_self_approval, force: r.force }
    }

    async fn run(
        &self,
        redis_url: &Option<String>,
        redis_cluster: bool,
        sql: &SqlStore,
        r: &ResolveArgs,
    ) -> Result<String, OpsError> {
        let done = review::resolve(sql, Some(&self.lookups), &r.key, &self.ask(r)).await.map_err(|refused| {
            let text = format!("{}: {refused}", r.key);
            match refused {
                review::Refusal::Usage(_) => OpsError::Usage(text),
                review::Refusal::Unavailable(_) => OpsError::Unreachable(text),
                _ => OpsError::Refused(text),
            }
        })?;
        let to = match done.to {
            Some(TerminalState::Done) => "DONE",
            Some(TerminalState::Failed) => "FAILED",
            None => "released (no row: a confirm may run it again)",
        };
        let mut text = format!("{}: {} -> {to}\n", r.key, done.from.as_str());
        if let Some(url) = redis_url {
            text.push_str(&evict(url, redis_cluster, &r.key).await);
        }
        Ok(text)
    }
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
    let opts = SqlOptions {
        max_connections: 2,
        timeout: Duration::from_millis(args.sql_timeout_ms.max(1)),
        ..SqlOptions::default()
    };
    SqlStore::connect(&args.database_url, &opts)
        .await
        .map_err(|e| OpsError::Unreachable(format!("database {}: {e}", redact_url(&args.database_url))))
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
