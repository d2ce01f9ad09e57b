//! The stream adapter both hosts share: proxy callbacks in, `idem_core::machine`
//! decides, host calls out.
//!
//! A host is anything that implements [`Host`]: the proxy-wasm filter (`src/`,
//! a `.wasm` for Envoy and Istio) and the native Envoy dynamic module
//! (`native/`, a `.so`). Each host only translates its proxy's callbacks into
//! calls on [`Stream`] and implements the trait; every decision lives in
//! `idem-core`, and everything between (route lookup, callout dispatch,
//! effect ordering) lives here once, so the two builds cannot drift apart.

#![forbid(unsafe_code)]

mod host;
mod routes;
pub mod sidecar;
mod stream;
#[cfg(test)]
mod tests;

pub use host::{Host, Level, ROUTE_ANNOTATION_PATH};
pub use routes::{RouteCache, RouteLookup};
pub use stream::{trace_id, Action, Refusal, Shared, Stream};
