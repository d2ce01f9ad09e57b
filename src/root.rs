//! The plugin's root context: validates the plugin configuration once, hands
//! every HTTP stream the parsed config, the route cache and the metric ids, and
//! ticks the VM's lease book: the leases of requests still upstream are renewed
//! from here, one `POST /v1/renew` per tick for all of them (DESIGN §4).

#[cfg(target_arch = "wasm32")]
pub use wasm::Root;

#[cfg(target_arch = "wasm32")]
mod wasm {
    use crate::context::WasmStream;
    use crate::host::{now_ms, wasm_plugin_configuration, WasmHost};
    use crate::metrics::Metrics;
    use idem_adapter::{sidecar, Host, Level, Shared, Stream};
    use idem_core::leases::{self, LeaseBook, TICK_MS};
    use idem_core::machine::Counter;
    use idem_core::policy;
    use idem_core::trace::Trace;
    use proxy_wasm::traits::{Context, HttpContext, RootContext};
    use proxy_wasm::types::ContextType;
    use std::cell::RefCell;
    use std::rc::Rc;

    #[derive(Default)]
    pub struct Root {
        shared: Option<Rc<Shared>>,
        metrics: Option<Rc<Metrics>>,
        /// The leases this VM's streams hold while their requests are upstream.
        leases: Rc<RefCell<LeaseBook>>,
    }

    impl Root {
        fn host(&self) -> Option<WasmHost> {
            Some(WasmHost::new(self.metrics.clone()?, Rc::clone(&self.leases)))
        }
    }

    impl Context for Root {
        /// idemd's answer to a renewal: a lease it did not renew belongs to an operation that
        /// moved on (completed, released, or claimed after its lease ran out): worth a warning.
        fn on_http_call_response(&mut self, _token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
            let Some(mut host) = self.host() else { return };
            match leases::renewal_answer(&host.call_answer(num_headers, body_size)) {
                Ok(lost) => {
                    for key in lost {
                        host.count(Counter::LeasesLost);
                        host.log(
                            Level::Warn,
                            &format!("agent_idempotency: lease of {key} not renewed: no longer ours"),
                        );
                    }
                }
                Err(()) => host.count(Counter::SidecarErrors),
            }
        }
    }

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
                    let tick = u32::try_from(TICK_MS).unwrap_or(u32::MAX);
                    if let Err(status) = crate::abi::set_tick_period_ms(tick) {
                        // Without ticks no lease is renewed: refuse, as for any broken configuration.
                        log::error!("cannot set the lease tick: {status:?}");
                        return false;
                    }
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
            Some(Box::new(WasmStream(Stream::new(shared, self.host()?))))
        }

        /// Renew every lease a third of its length old, in one callout.
        fn on_tick(&mut self) {
            // Most ticks find nothing due: nothing else is touched then.
            let Some(renewal) = self.leases.borrow_mut().renewal(now_ms()) else { return };
            let (Some(shared), Some(metrics), Some(mut host)) =
                (self.shared.clone(), self.metrics.clone(), self.host())
            else {
                return;
            };
            metrics.add(Counter::LeaseRenewals, renewal.leases);
            if sidecar::dispatch(&mut host, &shared.config, &renewal.call, &Trace::default()).is_none() {
                host.count(Counter::SidecarErrors);
            }
        }

        fn get_type(&self) -> Option<ContextType> {
            Some(ContextType::HttpContext)
        }
    }
}
