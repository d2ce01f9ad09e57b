//! `idemd check …`: refuse a configuration that leaves a path around an
//! annotation or breaks a TTL rule against Envoy's own timeouts and retries
//! (`crate::check`), before it is deployed.

use std::path::PathBuf;

use clap::Args;

use super::TtlArgs;

#[derive(Debug, Clone, Args)]
pub struct CheckArgs {
    /// An Envoy configuration (YAML) to check: every HTTP connection manager
    /// of its static listeners, the route tables they use (inline, an RDS file
    /// named by `path_config_source`, or scoped routes listed inline with their
    /// route configurations in such a file) and its static clusters. A route
    /// table it cannot read is refused. May be given more than once.
    #[arg(long, value_name = "FILE", required = true, num_args = 1..)]
    pub envoy: Vec<PathBuf>,

    /// The plugin configuration (JSON) idemd's ext_proc host runs with: the same file, and the same
    /// variable, as `idemd serve --ext-proc-config`. Where a chain runs neither the `.wasm` nor the native
    /// module, its `envoy.filters.http.ext_proc` filter is then the agent filter, read with this
    /// configuration, and its own settings are checked (failure_mode_allow, processing_mode,
    /// message_timeout, attributes, its cluster, per-route overrides). Without it, a chain with an
    /// ext_proc filter is refused: the check cannot tell what it guards.
    #[arg(long, env = "IDEM_EXT_PROC_CONFIG", value_name = "FILE")]
    pub ext_proc_config: Option<PathBuf>,

    /// idemd's lease and retention, with the same flags, variables and
    /// defaults as `idemd serve`: run the check in the deployment's
    /// environment and it judges the deployment's settings.
    #[command(flatten)]
    pub idemd: TtlArgs,
}
