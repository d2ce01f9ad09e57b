//! The plugin's root context: validates the plugin configuration once, and
//! hands every HTTP stream the parsed config, the metric ids and the route cache.

use crate::{host, metrics::Metrics, routes::RouteCache, stream::Stream};
use idem_core::policy::{self, PluginConfig};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;
use std::rc::Rc;

/// What every stream on this VM shares.
pub struct Shared {
    pub config: PluginConfig,
    pub metrics: Metrics,
    pub routes: RouteCache,
}

#[derive(Default)]
pub struct Root {
    shared: Option<Rc<Shared>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let raw = host::plugin_configuration();
        // Secrets may come from the VM's environment (vm_config.environment_variables).
        match policy::parse_plugin_config(&raw, &|name| std::env::var(name).ok()) {
            Ok(config) => {
                log::info!(
                    "configured (sidecar cluster {}, active key {})",
                    config.sidecar_cluster,
                    config.keyring.active_kid()
                );
                self.shared = Some(Rc::new(Shared { config, metrics: Metrics::define(), routes: RouteCache::default() }));
                true
            }
            Err(e) => {
                // Returning false makes Envoy refuse the configuration: better than running without idempotency.
                log::error!("invalid plugin configuration: {e}");
                false
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let shared = self.shared.clone()?;
        Some(Box::new(Stream::new(shared)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
