//! Envoy proxy-wasm build of the agent idempotency filter.
//!
//! This crate is only the proxy-wasm host: `host.rs` implements
//! `idem_adapter::Host` with proxy-wasm host calls, `context.rs` hands the
//! proxy's callbacks to `idem_adapter::Stream`, `root.rs` validates the plugin
//! configuration. The stream adapter is shared with the native Envoy module
//! (`native/`); every decision lives in `core/`, tested natively.

#![deny(unsafe_code)]
// Natively (workspace builds and tests) there is nothing to run: the entry points exist on wasm32.
#![cfg_attr(not(target_arch = "wasm32"), allow(dead_code, unused_imports))]

mod abi;
mod context;
mod host;
mod metrics;
mod root;

#[cfg(target_arch = "wasm32")]
proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(root::Root::default())
    });
}}
