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
    use idem_adapter::{sidecar, Host, Level, Refusal, Shared, Stream};
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
        /// The words of the refusal every stream gets when this VM keeps no stream configuration.
        refusal: Option<Refusal>,
    }

    /// Fault injection for the tests (`tests/tests/hostile_bytes.rs`), set in the VM's environment
    /// (`vm_config.environment_variables`): the VM keeps no stream configuration after a
    /// configuration that parsed, as when its lease tick cannot be set, so every stream meets a
    /// VM without a usable filter.
    const FAULT_NO_STREAM_CONFIG: &str = "IDEM_FAULT_NO_STREAM_CONFIG";

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
                    let tick = u32::try_from(TICK_MS).unwrap_or(u32::MAX);
                    let tick = crate::abi::set_tick_period_ms(tick);
                    if let Err(status) = tick {
                        // Without ticks no lease is renewed: this VM refuses every stream. Not
                        // `false`: a worker's VM that fails its configuration is one Envoy may
                        // leave out of the chain (the stream then passes unguarded).
                        log::error!("cannot set the lease tick: {status:?}; every stream of this VM is refused");
                        self.refusal = Some(Refusal::of(&config));
                        return true;
                    }
                    if std::env::var(FAULT_NO_STREAM_CONFIG).is_ok() {
                        log::error!("{FAULT_NO_STREAM_CONFIG} is set: every stream of this VM is refused");
                        self.refusal = Some(Refusal::of(&config));
                        return true;
                    }
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

        /// Never `None` (the SDK panics on it, killing the VM): a stream this VM has no usable
        /// configuration for is refused (DESIGN §6: every host fails closed).
        fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
            let stream = match (self.shared.clone(), self.host()) {
                (Some(shared), Some(host)) => WasmStream::Live(Stream::new(shared, host)),
                _ => WasmStream::Refused(self.refusal.unwrap_or_else(Refusal::unconfigured)),
            };
            Some(Box::new(stream))
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
