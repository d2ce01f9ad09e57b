//! What the adapter needs from its proxy, as a trait: implemented by the
//! proxy-wasm filter (`src/host.rs`), the native Envoy module
//! (`native/src/host.rs`) and a fake in the tests.

use idem_core::machine::{Callout, CalloutAnswer, Counter, Env};
use idem_core::policy::PluginConfig;
use idem_core::policy::ROUTE_NAMESPACE;
use idem_core::protocol::{LeaseRenewal, OwnerToken};
use idem_core::trace::{HostSpan, Trace};
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Warn,
    Error,
}

/// Where route metadata keeps a route's annotation (`xds.route_metadata…`).
pub const ROUTE_ANNOTATION_PATH: [&str; 4] = ["xds", "route_metadata", "filter_metadata", ROUTE_NAMESPACE];

pub trait Host: Env {
    /// A request header's value as the client sent it: bytes, which need not be text (whether
    /// that matters is core's to say, `RequestHead::from_headers`). A host never decodes a value
    /// in a way that can fail (the proxy-wasm SDK's string getters panic on non-UTF-8).
    fn request_header(&self, name: &str) -> Option<Vec<u8>>;
    /// Every request header entry, pseudo-headers included, a repeated header once per value.
    fn request_headers(&self) -> Vec<(String, Vec<u8>)>;
    fn set_request_header(&mut self, name: &str, value: &str);
    fn remove_request_header(&mut self, name: &str);
    /// Every response header entry, values as bytes (`ResponseHead::from_headers` reads them).
    fn response_headers(&self) -> Vec<(String, Vec<u8>)>;
    fn set_response_header(&mut self, name: &str, value: &str);
    fn remove_response_header(&mut self, name: &str);
    /// The route's annotation as `policy::encode_pairs` bytes (one leaf per
    /// field; numbers as 8 little-endian bytes of a double), or `None` if
    /// the route has none. Equal bytes must mean an equal annotation: the
    /// route cache is keyed by them (never by the route's name).
    fn route_annotation(&self) -> Option<Vec<u8>>;

    /// The tracer's span this stream is in, when the host can read it (DESIGN §8): the native
    /// module reads Envoy's active span; proxy-wasm has no such call (envoy#22028).
    fn active_span(&self) -> Option<HostSpan>;
    /// An Envoy property (`response.code_details`, a dynamic-metadata path, …).
    fn property(&self, path: &[&str]) -> Option<Vec<u8>>;
    /// The buffered request body (`size` bytes: the host's count at end of stream).
    fn request_body(&self, size: usize) -> Vec<u8>;
    fn response_body(&self, size: usize) -> Vec<u8>;
    fn replace_response_body(&mut self, old_size: usize, body: &[u8]);
    fn send_reply(&mut self, status: u16, headers: &[(String, String)], body: &[u8]);
    /// Reset the stream: the refusal of a stream whose answer already reached the filter, where a
    /// reply of ours is no longer possible (DESIGN §6: every host fails closed).
    fn reset(&mut self);
    fn resume_request(&mut self);
    fn resume_response(&mut self);
    /// An HTTP callout; its token, or `None` if it could not even be dispatched.
    fn dispatch(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> Option<u64>;
    /// The answer to the callout being reported (`num_headers` 0: it failed).
    fn call_answer(&self, num_headers: usize, body_size: usize) -> CalloutAnswer;
    fn count(&mut self, counter: Counter);
    fn log(&self, level: Level, message: &str);
    /// Store a value in the process-wide shared data (read through `Env::shared_get`).
    fn shared_set(&mut self, key: &str, value: &[u8]);
    /// Keep this lease alive while the stream's request is upstream: put it in the host's
    /// `idem_core::leases::LeaseBook`, which the host's own ticker renews (DESIGN §4).
    fn hold_lease(&mut self, lease: &LeaseRenewal);
    /// The stream no longer needs the lease (its answer is whole, or the stream is gone).
    fn end_lease(&mut self, owner: &OwnerToken);
    /// Send a report nobody waits for (a security event for idemd's audit); `false` if it
    /// could not even be sent. It must outlive the stream, which is usually answered at once: a
    /// host whose stream callouts are cancelled with the stream sends it from elsewhere.
    /// (A host whose callouts outlive the stream sends it with `sidecar::dispatch`.)
    fn report(&mut self, cfg: &PluginConfig, call: &Callout, trace: &Trace) -> bool;
}
