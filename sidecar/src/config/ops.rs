//! `idemd ops …`: the operator's command line. It talks to the same database
//! as the sidecars (and, when given, the same Redis, to refresh the cached
//! copy right away).

use std::path::PathBuf;

use clap::{Args, Subcommand, ValueEnum};
use idem_core::protocol::{OpState, SecurityKind};

#[derive(Debug, Clone, Args)]
pub struct OpsArgs {
    /// The SQL truth the sidecars use: postgres://, mysql:// or sqlite:.
    #[arg(long, env = "IDEM_DATABASE_URL", default_value = "sqlite://./data/idem.db", global = true)]
    pub database_url: String,

    /// The sidecars' Redis: after a resolve its cached copy is dropped, so the
    /// next confirm sees the decision at once (it would anyway, a little
    /// slower, by checking SQL).
    #[arg(long, env = "IDEM_REDIS_URL", global = true)]
    pub redis_url: Option<String>,

    /// Treat --redis-url as Redis Cluster seed nodes.
    #[arg(long, env = "IDEM_REDIS_CLUSTER", global = true)]
    pub redis_cluster: bool,

    /// Budget for one SQL call.
    #[arg(long, env = "IDEM_SQL_TIMEOUT_MS", default_value_t = 5_000, global = true)]
    pub sql_timeout_ms: u64,

    /// Who you are, as the gateway names you (its subject): the audit trail says
    /// `operator:<actor>`, and `resolve` refuses an operation of your own subject.
    /// Required by `resolve`.
    #[arg(long, env = "IDEM_ACTOR", global = true)]
    pub actor: Option<String>,

    #[command(subcommand)]
    pub command: OpsCommand,
}

#[derive(Debug, Clone, Subcommand)]
pub enum OpsCommand {
    /// Operations in one state, least recently changed first.
    List {
        #[arg(long, value_enum)]
        state: StateArg,
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// One JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// One operation: its row and its whole audit history.
    Show {
        /// The operation key (the nonce: 32 lowercase hex characters, the
        /// downstream's Idempotency-Key, the `operation` of a reply), or the
        /// `trace_id` of a reply the filter sent about it.
        key: String,
        #[arg(long)]
        json: bool,
    },
    /// Decide an IN_FLIGHT or NEEDS_REVIEW operation by hand.
    Resolve(ResolveArgs),
    /// Security events (tampered parameters, another subject's fingerprint,
    /// forged signatures, unknown key ids), newest first.
    Events {
        /// Only those of the last DURATION: seconds, or a number with s, m, h
        /// or d (`90s`, `15m`, `24h`, `7d`). Default: all still kept.
        #[arg(long, value_name = "DURATION", value_parser = parse_duration_ms)]
        since: Option<u64>,
        /// Only this kind: params_changed, cross_subject, bad_signature, unknown_kid.
        #[arg(long, value_name = "K", value_parser = parse_kind)]
        kind: Option<SecurityKind>,
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// One JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// `90`, `90s`, `15m`, `24h`, `7d` as milliseconds.
pub fn parse_duration_ms(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (digits, unit_ms) = match s.char_indices().last() {
        Some((i, 's')) => (&s[..i], 1_000),
        Some((i, 'm')) => (&s[..i], 60_000),
        Some((i, 'h')) => (&s[..i], 3_600_000),
        Some((i, 'd')) => (&s[..i], 86_400_000),
        _ => (s, 1_000),
    };
    let n: u64 = digits.parse().map_err(|_| format!("{s:?} is not a duration: expected e.g. 90s, 15m, 24h, 7d"))?;
    n.checked_mul(unit_ms).filter(|ms| *ms <= i64::MAX as u64).ok_or_else(|| format!("{s:?} is too long"))
}

fn parse_kind(s: &str) -> Result<SecurityKind, String> {
    s.parse::<SecurityKind>().map_err(|_| {
        let known: Vec<&str> = SecurityKind::ALL.iter().map(|k| k.as_str()).collect();
        format!("{s:?} is not a kind: one of {}", known.join(", "))
    })
}

/// Spelled as in the table, in lower case: in_flight, needs_review, done, failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum StateArg {
    #[value(alias = "IN_FLIGHT")]
    InFlight,
    #[value(alias = "NEEDS_REVIEW")]
    NeedsReview,
    #[value(alias = "DONE")]
    Done,
    #[value(alias = "FAILED")]
    Failed,
}

impl StateArg {
    pub fn op_state(self) -> OpState {
        match self {
            Self::InFlight => OpState::InFlight,
            Self::NeedsReview => OpState::NeedsReview,
            Self::Done => OpState::Done,
            Self::Failed => OpState::Failed,
        }
    }
}

#[derive(Debug, Clone, Args)]
#[command(group = clap::ArgGroup::new("decision").required(true).multiple(false).args(["done", "failed", "release"]))]
pub struct ResolveArgs {
    /// The nonce (32 lowercase hex characters).
    pub key: String,

    /// It executed: replay --result-file (JSON) as its result.
    #[arg(long, requires = "result_file")]
    pub done: bool,

    /// It definitely failed: replay `{"error":"resolved_failed","reason":…}`.
    #[arg(long, requires = "reason")]
    pub failed: bool,

    /// It provably never executed: forget it; a confirm with the same
    /// (unexpired) fingerprint may run it, under the same Idempotency-Key.
    /// Where the scope has a status endpoint, it is asked now, and a record
    /// there (or no answer) refuses the release.
    #[arg(long)]
    pub release: bool,

    /// With --done: the upstream's answer body (JSON), e.g. from its
    /// status-by-key endpoint.
    #[arg(long, value_name = "FILE")]
    pub result_file: Option<PathBuf>,

    /// With --failed: the reason the agent will be told.
    #[arg(long)]
    pub reason: Option<String>,

    /// The HTTP status replayed (default 200 with --done, 422 with --failed).
    #[arg(long)]
    pub status: Option<u16>,

    /// Why you decided this (required; goes to the audit trail).
    #[arg(long)]
    pub why: String,

    /// Also resolve an IN_FLIGHT operation whose lease has not run out (its
    /// executor may still be running it).
    #[arg(long)]
    pub force: bool,

    /// Let the operator resolve an operation of their own subject (as
    /// `idemd serve --allow-self-approval` lets approvers).
    #[arg(long, env = "IDEM_ALLOW_SELF_APPROVAL")]
    pub allow_self_approval: bool,

    /// The scopes' status endpoints, as `idemd serve` reads them: `--release`
    /// asks the operation's scope at that moment and releases only if the
    /// upstream has no record of it.
    #[command(flatten)]
    pub status_args: crate::config::reconcile::StatusArgs,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_in_seconds_minutes_hours_days() {
        assert_eq!(parse_duration_ms("90"), Ok(90_000));
        assert_eq!(parse_duration_ms("90s"), Ok(90_000));
        assert_eq!(parse_duration_ms("15m"), Ok(900_000));
        assert_eq!(parse_duration_ms("24h"), Ok(86_400_000));
        assert_eq!(parse_duration_ms("7d"), Ok(604_800_000));
        for bad in ["", "s", "1.5h", "-1m", "10w", "h1", "99999999999999999999d"] {
            assert!(parse_duration_ms(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn kinds_by_their_wire_names() {
        for k in SecurityKind::ALL {
            assert_eq!(parse_kind(k.as_str()), Ok(*k));
        }
        assert!(parse_kind("tampering").is_err());
    }
}
