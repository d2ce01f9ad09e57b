//! Command line and environment: every option has an `IDEM_*` variable, so the
//! same binary runs from a shell, a Makefile and a container spec.
//!
//! The TTL rules live here because a wrong TTL is not a runtime error but a
//! silent hole in idempotency: a lease shorter than the slowest upstream lets a
//! retry find the key gone and execute again, exactly when retries are densest.
//! So a bad combination refuses to start.

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

pub mod check;
pub mod ops;
pub mod reconcile;
pub mod tools;

pub use self::check::CheckArgs;
pub use self::ops::OpsArgs;
pub use self::reconcile::ReconcileArgs;
pub use self::tools::ToolsArgs;

#[derive(Debug, Parser)]
#[command(name = "idemd", version, about = "Server-issued idempotency for AI-agent tool calls: the store sidecar")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the HTTP API the Envoy filter calls, and reconcile and reap in
    /// the background.
    Serve(ServeArgs),
    /// Operator tools on the same database: list, show, resolve, events.
    Ops(OpsArgs),
    /// Tool definitions for agents (OpenAI, Anthropic, MCP), generated from
    /// the route annotations the filter enforces.
    Tools(ToolsArgs),
    /// Check Envoy configurations before deploying them: refuse (exit 1, each
    /// finding naming its rule, listener and route) one that leaves a path to a
    /// guarded upstream around the annotations, or whose timeouts and retries
    /// break the TTL rules with idemd's flags (the same variables as serve).
    Check(CheckArgs),
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Address of the HTTP API.
    #[arg(long, env = "IDEM_LISTEN", default_value = "127.0.0.1:9090")]
    pub listen: SocketAddr,

    /// Bearer tokens the filter must present on every API call (comma-separated;
    /// give two while rotating). The filter's plugin config names the same
    /// token in `sidecar_token`. `/healthz` and `/metrics` need none.
    #[arg(long, env = "IDEM_AUTH_TOKENS", value_delimiter = ',', hide_env_values = true)]
    pub auth_tokens: Vec<String>,

    /// Serve the API to anyone who can reach it (development only; idemd warns
    /// on every start). Without it, idemd refuses to start with no token.
    #[arg(long, env = "IDEM_INSECURE_NO_AUTH")]
    pub insecure_no_auth: bool,

    /// Who may approve operations on routes with an `approval` rule (DESIGN §4): comma-separated
    /// `identity=credential`, each credential of its own (never a filter token). The identity is
    /// what the audit names (`approver:<identity>`) and is compared, hashed as a subject, with the
    /// operation's subject. Empty: nobody can approve (approval routes wait and lapse).
    #[arg(long, env = "IDEM_APPROVERS", value_delimiter = ',', hide_env_values = true)]
    pub approvers: Vec<String>,

    /// Let an approver decide an operation of their own subject (off: refused with 403).
    #[arg(long, env = "IDEM_ALLOW_SELF_APPROVAL")]
    pub allow_self_approval: bool,

    /// Where a person approves (the console's URL as a browser reaches it, e.g.
    /// `https://idemd.internal/approvals`): the agent is told to send the user there.
    #[arg(long, env = "IDEM_APPROVAL_CONSOLE_URL")]
    pub approval_console_url: Option<String>,

    /// How often idemd asks both stores and the backlog, traffic or not, for
    /// the gauges alerts read (`idem_sql_up`, `idem_redis_up`, `idem_in_flight`,
    /// `idem_in_flight_overdue_seconds`, `idem_needs_review_backlog`).
    #[arg(long, env = "IDEM_PROBE_INTERVAL_MS", default_value_t = 5_000)]
    pub probe_interval_ms: u64,

    /// Export traces (OpenTelemetry, OTLP over HTTP/protobuf) to this collector: its base URL
    /// (`http://collector:4318`, `/v1/traces` is appended) or its full traces URL. Each API call
    /// continues the caller's W3C trace context (the filter's `traceparent`). Unset: no tracing.
    #[arg(long, env = "IDEM_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,

    #[command(flatten)]
    pub stores: StoreArgs,

    #[command(flatten)]
    pub ttl: TtlArgs,

    #[command(flatten)]
    pub reconcile: ReconcileArgs,

    #[command(flatten)]
    pub ext_proc: ExtProcArgs,
}

impl ServeArgs {
    /// Every broken rule of the TTLs and the background settings together, so
    /// one failed start names them all.
    pub fn validate(&self) -> Result<crate::reconcile::target::StatusEndpoints, Vec<String>> {
        let ttl = self.ttl.validate();
        let reconcile = self.reconcile.validate(&self.ttl);
        let probe = if self.probe_interval_ms == 0 {
            Err(vec!["--probe-interval-ms must be greater than 0".to_string()])
        } else {
            Ok(())
        };
        match (ttl, reconcile, probe) {
            (Ok(()), Ok(endpoints), Ok(())) => Ok(endpoints),
            (ttl, reconcile, probe) => {
                let mut broken = ttl.err().unwrap_or_default();
                broken.extend(reconcile.err().unwrap_or_default());
                broken.extend(probe.err().unwrap_or_default());
                Err(broken)
            }
        }
    }

    pub fn probe_interval(&self) -> Duration {
        Duration::from_millis(self.probe_interval_ms)
    }
}

/// The ext_proc host (`idem-extproc`): Envoy's External Processing protocol served by idemd itself,
/// for gateways that load no filter. Its callouts are idemd's own API, called in-process.
#[derive(Debug, Clone, Args)]
pub struct ExtProcArgs {
    /// Serve Envoy's External Processing protocol (gRPC, `envoy.service.ext_proc.v3`) on this address.
    #[arg(long, env = "IDEM_EXT_PROC")]
    pub ext_proc: Option<std::net::SocketAddr>,

    /// The plugin configuration (the same JSON the `.wasm` takes) the ext_proc host runs with.
    #[arg(long, env = "IDEM_EXT_PROC_CONFIG", requires = "ext_proc")]
    pub ext_proc_config: Option<std::path::PathBuf>,

    /// Threads that run ext_proc streams (each with its own parsed configuration).
    #[arg(long, env = "IDEM_EXT_PROC_THREADS", default_value_t = 2)]
    pub ext_proc_threads: usize,
}

/// Where the state lives.
#[derive(Debug, Clone, Args)]
pub struct StoreArgs {
    /// Redis for the fast path; absent means SQL alone. With --redis-cluster,
    /// a comma-separated list of node URLs.
    #[arg(long, env = "IDEM_REDIS_URL")]
    pub redis_url: Option<String>,

    /// Treat --redis-url as Redis Cluster seed nodes.
    #[arg(long, env = "IDEM_REDIS_CLUSTER")]
    pub redis_cluster: bool,

    /// Budget for one Redis call; past it the call is served by SQL alone.
    #[arg(long, env = "IDEM_REDIS_TIMEOUT_MS", default_value_t = 200)]
    pub redis_timeout_ms: u64,

    /// While Redis is down, how often one request probes it again (the rest go
    /// straight to SQL instead of each paying the timeout).
    #[arg(long, env = "IDEM_REDIS_RETRY_MS", default_value_t = 500)]
    pub redis_retry_ms: u64,

    /// The SQL truth: postgres://, mysql:// (MySQL or MariaDB) or sqlite:.
    #[arg(long, env = "IDEM_DATABASE_URL", default_value = "sqlite://./data/idem.db?mode=rwc")]
    pub database_url: String,

    /// SQL pool size of this process (each replica has its own).
    #[arg(long, env = "IDEM_SQL_MAX_CONNECTIONS", default_value_t = 16)]
    pub sql_max_connections: u32,

    /// Budget for one SQL call; past it the database counts as unavailable.
    #[arg(long, env = "IDEM_SQL_TIMEOUT_MS", default_value_t = 2000)]
    pub sql_timeout_ms: u64,

    /// On a database that replicates asynchronously (or whose replication idemd cannot read), neither wait
    /// for the standbys nor refuse: acquire for routes whose upstream ignores Idempotency-Key too. The cost:
    /// a failover to a standby that had not caught up loses the acquire and the record, and the retry
    /// executes the operation a second time. Without it, idemd waits after each write and read until the
    /// standbys it can see (Postgres, with their positions readable) have flushed it, and where it cannot see them it
    /// refuses those acquires (status_unavailable, nothing runs). See docs/operations.md, "Topologies".
    #[arg(long, env = "IDEM_ACCEPT_ASYNC_FAILOVER_RISK")]
    pub accept_async_failover_risk: bool,
}

/// The IN_FLIGHT lease and the terminal retention, with the facts they must cover.
#[derive(Debug, Clone, Args)]
pub struct TtlArgs {
    /// IN_FLIGHT lease: how long an executor owns an operation.
    #[arg(long, env = "IDEM_LEASE_MS", default_value_t = 60_000)]
    pub lease_ms: u64,

    /// The slowest the upstream may take to answer a confirm.
    #[arg(long, env = "IDEM_UPSTREAM_WORST_CASE_MS", default_value_t = 30_000)]
    pub upstream_worst_case_ms: u64,

    /// The gateway's own timeout on the confirm route.
    #[arg(long, env = "IDEM_GATEWAY_TIMEOUT_MS", default_value_t = 15_000)]
    pub gateway_timeout_ms: u64,

    /// The sum of all retry back-offs the gateway may add.
    #[arg(long, env = "IDEM_RETRY_BACKOFF_TOTAL_MS", default_value_t = 5_000)]
    pub retry_backoff_total_ms: u64,

    /// How long DONE/FAILED results stay replayable (default 7 days).
    #[arg(long, env = "IDEM_TERMINAL_RETENTION_S", default_value_t = 7 * 24 * 3600)]
    pub terminal_retention_s: u64,

    /// The callers' longest retry window (default 1 day).
    #[arg(long, env = "IDEM_RETRY_WINDOW_S", default_value_t = 24 * 3600)]
    pub retry_window_s: u64,
}

impl TtlArgs {
    /// Every broken rule, each saying which rule and by how much.
    pub fn validate(&self) -> Result<(), Vec<String>> {
        let mut broken = Vec::new();

        let needed = self
            .upstream_worst_case_ms
            .saturating_add(self.gateway_timeout_ms)
            .saturating_add(self.retry_backoff_total_ms);
        if self.lease_ms <= needed {
            broken.push(format!(
                "IN_FLIGHT lease {} ms must exceed upstream worst case {} + gateway timeout {} + retry backoff {} = {} ms (short by {} ms)",
                self.lease_ms,
                self.upstream_worst_case_ms,
                self.gateway_timeout_ms,
                self.retry_backoff_total_ms,
                needed,
                needed - self.lease_ms + 1,
            ));
        }

        if self.terminal_retention_s < self.retry_window_s {
            broken.push(format!(
                "terminal retention {} s must be at least the retry window {} s (short by {} s)",
                self.terminal_retention_s,
                self.retry_window_s,
                self.retry_window_s - self.terminal_retention_s,
            ));
        }

        // Redis takes the TTL in ms; keep the product representable.
        if self.terminal_retention_s > u64::MAX / 1000 {
            broken.push(format!("terminal retention {} s is too large", self.terminal_retention_s));
        }

        if broken.is_empty() {
            Ok(())
        } else {
            Err(broken)
        }
    }

    pub fn terminal_retention_ms(&self) -> u64 {
        self.terminal_retention_s.saturating_mul(1000)
    }
}

impl StoreArgs {
    pub fn redis_timeout(&self) -> Duration {
        Duration::from_millis(self.redis_timeout_ms)
    }

    pub fn redis_retry(&self) -> Duration {
        Duration::from_millis(self.redis_retry_ms)
    }

    pub fn sql_timeout(&self) -> Duration {
        Duration::from_millis(self.sql_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ttl(lease_ms: u64, retention_s: u64, window_s: u64) -> TtlArgs {
        TtlArgs {
            lease_ms,
            upstream_worst_case_ms: 30_000,
            gateway_timeout_ms: 15_000,
            retry_backoff_total_ms: 5_000,
            terminal_retention_s: retention_s,
            retry_window_s: window_s,
        }
    }

    #[test]
    fn defaults_are_valid() {
        assert_eq!(ttl(60_000, 7 * 86_400, 86_400).validate(), Ok(()));
    }

    #[test]
    fn short_lease_says_which_rule_and_by_how_much() {
        let err = ttl(20_000, 7 * 86_400, 86_400).validate().unwrap_err();
        assert_eq!(
            err,
            vec!["IN_FLIGHT lease 20000 ms must exceed upstream worst case 30000 + gateway timeout 15000 + retry backoff 5000 = 50000 ms (short by 30001 ms)"]
        );
    }

    #[test]
    fn lease_equal_to_the_worst_case_is_one_ms_short() {
        let err = ttl(50_000, 86_400, 86_400).validate().unwrap_err();
        assert!(err[0].ends_with("(short by 1 ms)"), "{err:?}");
        assert_eq!(ttl(50_001, 86_400, 86_400).validate(), Ok(()));
    }

    #[test]
    fn short_retention_and_both_rules_reported_together() {
        let err = ttl(1, 3_600, 86_400).validate().unwrap_err();
        assert_eq!(err.len(), 2);
        assert_eq!(err[1], "terminal retention 3600 s must be at least the retry window 86400 s (short by 82800 s)");
    }
}
