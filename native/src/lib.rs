//! The agent idempotency filter as a native Envoy dynamic module.
//!
//! The same decisions (`idem-core`) and the same stream adapter
//! (`idem-adapter`) as the `.wasm`; only the host differs:
//!
//! - `abi`: hand-written bindings to Envoy 1.40's dynamic-module C ABI,
//!   limited to what this module calls (see `ABI-NOTES.md`);
//! - `hooks`: the `envoy_dynamic_module_on_*` functions Envoy calls, each
//!   panic-safe, each handing its event to the adapter's `Stream`;
//! - `envoy_stream`: Envoy's side of one stream, the one owner of its filter
//!   pointer: every per-stream callback as a safe method, Envoy's bytes copied
//!   before the callback returns;
//! - `host`: `idem_adapter::Host` over an `EnvoyStream` (no `unsafe` of its own
//!   but the two configuration pointers, the filter's and the route's);
//! - `log`: Envoy's log, reachable from every other module without a circle;
//! - `config`: the plugin configuration (the same JSON as the `.wasm`'s) and
//!   the per-route configuration (the route annotation as JSON);
//! - `main_thread`: what runs outside every stream, on Envoy's main thread:
//!   lease renewals (a ticker thread wakes it) and security-event reports;
//! - `shared_data`: the process-wide store behind the replay cache.
//!
//! Nothing sandboxes a native module: a panic that escaped, or a memory bug,
//! takes Envoy down. So no hook lets a panic unwind into Envoy, the filter
//! path keeps the workspace's no-unwrap/no-panic lints, and every `unsafe`
//! block is a call into the ABI or a read of a buffer Envoy lent us for the
//! duration of the callback. A stream's pointer is vouched for once
//! (`EnvoyStream::new`), not at every call.

pub mod abi;
mod config;
mod envoy_stream;
pub mod hooks;
mod host;
mod log;
mod main_thread;
mod shared_data;

pub use config::{annotation_pairs, FilterConfig};
