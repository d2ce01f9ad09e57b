//! The plugin's root context: validates the plugin configuration once, and
//! hands every HTTP stream the parsed config, the metric ids and the route cache.

use crate::{metrics::Metrics, routes::RouteCache};
use idem_core::policy::PluginConfig;
use std::rc::Rc;

/// What every stream on this VM shares.
pub struct Shared {
    pub config: Rc<PluginConfig>,
    pub metrics: Rc<Metrics>,
    pub routes: RouteCache,
}

#[cfg(target_arch = "wasm32")]
pub use wasm::Root;

#[cfg(target_arch = "wasm32")]
mod wasm {
    use super::Shared;
    use crate::host::{wasm_plugin_configuration, WasmHost};
    use crate::{metrics::Metrics, routes::RouteCache, stream::Stream};
    use idem_core::policy;
    use proxy_wasm::traits::{Context, HttpContext, RootContext};
    use proxy_wasm::types::ContextType;
    use std::rc::Rc;

    #[derive(Default)]
    pub struct Root {
        shared: Option<Rc<Shared>>,
    }

    impl Context for Root {}

    impl RootContext for Root {
        fn on_configure(&mut self, _size: usize) -> bool {
            let raw = wasm_plugin_configuration();
            // Secrets may come from the VM's environment (vm_config.environment_variables).
            match policy::parse_plugin_config(&raw, &|name| std::env::var(name).ok()) {
                Ok(config) => {
                    log::info!(
                        "configured (sidecar cluster {}, active key {}, sidecar auth {})",
                        config.sidecar_cluster,
                        config.keyring.active_kid(),
                        if config.sidecar_token.is_some() { "token" } else { "none" }
                    );
                    let metrics = Rc::new(Metrics::define());
                    self.shared =
                        Some(Rc::new(Shared { config: Rc::new(config), metrics, routes: RouteCache::default() }));
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
            let host = WasmHost::new(Rc::clone(&shared.metrics));
            Some(Box::new(Stream::new(shared, host)))
        }

        fn get_type(&self) -> Option<ContextType> {
            Some(ContextType::HttpContext)
        }
    }
}
