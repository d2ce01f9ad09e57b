//! What every handler, REST (`api`) or MCP (`mcp`), works on: the store and the service's
//! configuration. Its own module so both protocols depend on it and neither on the other's router.

use crate::store::Store;
use std::path::PathBuf;
use std::sync::Arc;

pub struct Config {
    /// Deduplicate confirms on `Idempotency-Key` (off: `--no-dedup`).
    pub dedup: bool,
    /// Read `Idempotency-Key` at all (off: `--no-keys`, a downstream without key support: every
    /// confirm executes, found again only by its `client_ref`).
    pub keys: bool,
    /// Honour the `x-demo-*` fault headers (`--faults`).
    pub faults: bool,
    /// Where `x-demo-hold-after-commit` writes and waits for its files (`--fault-dir`).
    pub fault_dir: PathBuf,
    /// Serve the MCP endpoints (`crate::mcp`; off: `--no-mcp`).
    pub mcp: bool,
}

/// The shared state of every handler.
#[derive(Clone)]
pub(crate) struct App {
    pub(crate) store: Store,
    pub(crate) config: Arc<Config>,
}
