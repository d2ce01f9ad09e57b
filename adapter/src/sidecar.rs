//! Callouts to idemd over Envoy's cluster: the machine says what to call, this
//! adds where and as whom (DESIGN §6: idemd answers only its filter).

use crate::host::Host;
use idem_core::machine::Callout;
use idem_core::policy::PluginConfig;
use idem_core::trace::Trace;
use std::time::Duration;

/// Dispatch `call` with the cluster, authority and credential from the plugin configuration
/// and the request's trace context; `None` if the host refused it.
pub fn dispatch(host: &mut dyn Host, cfg: &PluginConfig, call: &Callout, trace: &Trace) -> Option<u64> {
    let token = cfg.sidecar_token.as_ref().map(|t| t.expose());
    with_headers(&cfg.sidecar_authority, token, call, trace, |headers| {
        host.dispatch(
            &cfg.sidecar_cluster,
            headers,
            call.body.as_deref(),
            Duration::from_millis(cfg.sidecar_timeout_ms),
        )
    })
}

/// Where idemd is and how to call it, owned and `Send`: for a host that calls idemd from
/// outside any stream (the native module's main thread, which renews leases and sends reports).
#[derive(Debug, Clone)]
pub struct Sidecar {
    pub cluster: String,
    pub timeout: Duration,
    authority: String,
    token: Option<String>,
}

impl Sidecar {
    pub fn of(cfg: &PluginConfig) -> Sidecar {
        Sidecar {
            cluster: cfg.sidecar_cluster.clone(),
            timeout: Duration::from_millis(cfg.sidecar_timeout_ms),
            authority: cfg.sidecar_authority.clone(),
            token: cfg.sidecar_token.as_ref().map(|t| t.expose().to_string()),
        }
    }

    /// `send` gets `call`'s request headers, as [`dispatch`] sends them.
    pub fn with_headers<R>(&self, call: &Callout, trace: &Trace, send: impl FnOnce(&[(&str, &str)]) -> R) -> R {
        with_headers(&self.authority, self.token.as_deref(), call, trace, send)
    }
}

fn with_headers<R>(
    authority: &str,
    token: Option<&str>,
    call: &Callout,
    trace: &Trace,
    send: impl FnOnce(&[(&str, &str)]) -> R,
) -> R {
    let bearer = token.map(|t| format!("Bearer {t}"));
    let trace_headers = trace.callout_headers();
    let mut headers: Vec<(&str, &str)> =
        vec![(":method", call.method), (":path", &call.path), (":authority", authority)];
    if call.body.is_some() {
        headers.push(("content-type", "application/json"));
    }
    if let Some(b) = &bearer {
        headers.push(("authorization", b));
    }
    headers.extend(trace_headers.iter().map(|(name, value)| (*name, value.as_str())));
    send(&headers)
}
