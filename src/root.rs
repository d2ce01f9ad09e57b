//! The plugin's root context: validates the plugin configuration once, and
//! hands every HTTP stream the parsed config, the route cache and the metric ids.

#[cfg(target_arch = "wasm32")]
pub use wasm::Root;

#[cfg(target_arch = "wasm32")]
mod wasm {
    use crate::context::WasmStream;
    use crate::host::{wasm_plugin_configuration, WasmHost};
    use crate::metrics::Metrics;
    use idem_adapter::{Shared, Stream};
    use idem_core::policy;
    use proxy_wasm::traits::{Context, HttpContext, RootContext};
    use proxy_wasm::types::ContextType;
    use std::rc::Rc;

    #[derive(Default)]
    pub struct Root {
        shared: Option<Rc<Shared>>,
        metrics: Option<Rc<Metrics>>,
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
                    self.metrics = Some(Rc::new(Metrics::define()));
                    self.shared = Some(Rc::new(Shared::new(config)));
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
            let host = WasmHost::new(self.metrics.clone()?);
            Some(Box::new(WasmStream(Stream::new(shared, host))))
        }

        fn get_type(&self) -> Option<ContextType> {
            Some(ContextType::HttpContext)
        }
    }
}
