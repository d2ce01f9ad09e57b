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

    /// idemd's lease and retention, with the same flags, variables and
    /// defaults as `idemd serve`: run the check in the deployment's
    /// environment and it judges the deployment's settings.
    #[command(flatten)]
    pub idemd: TtlArgs,
}
