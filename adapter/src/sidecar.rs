//! Callouts to idemd over Envoy's cluster: the machine says what to call, this
//! adds where and as whom (DESIGN §6: idemd answers only its filter).

use crate::host::Host;
use idem_core::machine::Callout;
use idem_core::policy::PluginConfig;
use std::time::Duration;

/// Dispatch `call` with the cluster, authority, credential and trace id from
/// the plugin configuration; `None` if the host refused it.
pub fn dispatch(host: &mut dyn Host, cfg: &PluginConfig, call: &Callout, trace_id: &str) -> Option<u64> {
    let bearer = cfg.sidecar_token.as_ref().map(|t| format!("Bearer {}", t.expose()));
    let mut headers: Vec<(&str, &str)> =
        vec![(":method", call.method), (":path", &call.path), (":authority", &cfg.sidecar_authority)];
    if call.body.is_some() {
        headers.push(("content-type", "application/json"));
    }
    if let Some(b) = &bearer {
        headers.push(("authorization", b));
    }
    if !trace_id.is_empty() {
        headers.push(("x-request-id", trace_id));
    }
    host.dispatch(&cfg.sidecar_cluster, &headers, call.body.as_deref(), Duration::from_millis(cfg.sidecar_timeout_ms))
}
