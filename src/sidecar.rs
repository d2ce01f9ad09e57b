//! Callouts to the idem sidecar over Envoy's cluster (`dispatch_http_call`).
//! Request and answer shapes are `idem_core::protocol`, shared with `idemd`.

use crate::host;
use idem_core::policy::PluginConfig;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::time::Duration;

/// Which answer a pending callout token stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    Acquire,
    Complete,
    Release,
    Lookup,
}

pub fn post<T: Serialize>(cfg: &PluginConfig, path: &str, body: &T) -> Option<u32> {
    let body = serde_json::to_vec(body).ok()?;
    host::dispatch(
        &cfg.sidecar_cluster,
        vec![
            (":method", "POST"),
            (":path", path),
            (":authority", &cfg.sidecar_authority),
            ("content-type", "application/json"),
        ],
        Some(&body),
        Duration::from_millis(cfg.sidecar_timeout_ms),
    )
}

pub fn get(cfg: &PluginConfig, path: &str) -> Option<u32> {
    host::dispatch(
        &cfg.sidecar_cluster,
        vec![(":method", "GET"), (":path", path), (":authority", &cfg.sidecar_authority)],
        None,
        Duration::from_millis(cfg.sidecar_timeout_ms),
    )
}

/// The callout's HTTP status and, if it parses, its JSON body. A reset or
/// failed callout arrives with no headers at all: status `None`.
pub fn answer<T: DeserializeOwned>(num_headers: usize, body_size: usize) -> (Option<u16>, Option<T>) {
    if num_headers == 0 {
        return (None, None);
    }
    let status = host::call_response_status();
    let body = host::call_response_body(body_size);
    (status, serde_json::from_slice(&body).ok())
}
