//! Envoy proxy-wasm adapter for agent idempotency.
//!
//! This crate only moves bytes between Envoy and `idem_core`: `stream` turns
//! proxy callbacks into events for `idem_core::machine` and carries out the
//! effects it returns, through the `host::Host` trait (proxy-wasm here, a fake
//! in the tests). Every decision lives in `core/`, tested natively.

// Natively only the tests drive the adapter; the proxy-wasm entry points exist on wasm32.
#![cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]

mod host;
mod metrics;
mod root;
mod routes;
mod sidecar;
mod stream;
#[cfg(test)]
mod tests;

#[cfg(target_arch = "wasm32")]
proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(root::Root::default())
    });
}}
