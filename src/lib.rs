//! Envoy proxy-wasm glue for agent idempotency.
//!
//! This crate only moves bytes between Envoy and `idem_core`: it reads headers,
//! bodies and route metadata, asks core what to do, and performs the sidecar
//! callouts. Every decision (canonical params, fingerprints, policy, replies,
//! outcome classification) lives in `core/`, where it is tested natively.

mod host;
mod metrics;
mod root;
mod routes;
mod sidecar;
mod stream;

use proxy_wasm::types::LogLevel;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(root::Root::default())
    });
}}
