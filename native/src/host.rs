//! `idem_adapter::Host` over Envoy's dynamic-module callbacks.
//!
//! Every value read from Envoy is copied out before the call returns: Envoy's
//! buffers are only lent for the duration of the current hook.

use crate::abi::{self, BodyType, HeaderType};
use crate::config::{FilterConfig, RouteConfig};
use crate::envoy_stream::{Direction, EnvoyStream};
use crate::log::log;
use crate::shared_data;
use idem_adapter::{Host, Level};
use idem_core::machine::{Callout, CalloutAnswer, Counter, Env};
use idem_core::policy::{self, PluginConfig, ROUTE_NAMESPACE};
use idem_core::protocol::{LeaseRenewal, OwnerToken};
use idem_core::trace::{HostSpan, Trace};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub struct NativeHost {
    /// Envoy's side of this stream (it owns the filter pointer and its invariant).
    envoy: EnvoyStream,
    /// The filter configuration: Envoy keeps it alive while any of its streams exists.
    config: *const FilterConfig,
    /// The answer of the callout being reported (set by the callout hook, read by `call_answer`).
    pub answer: Option<CalloutAnswer>,
    /// Inside a body hook the chunk being delivered is separate from what was buffered before it.
    pub in_body_hook: bool,
    /// A resume the adapter asked for, carried out by the hook after the adapter returns:
    /// `continue_decoding`/`continue_encoding` re-enter this filter's hooks before they return.
    resume: Option<Direction>,
}

impl NativeHost {
    /// # Safety
    /// `config` is the configuration the stream was made from (Envoy destroys a filter
    /// configuration only after every stream using it).
    pub unsafe fn new(envoy: EnvoyStream, config: *const FilterConfig) -> NativeHost {
        NativeHost { envoy, config, answer: None, in_body_hook: false, resume: None }
    }

    pub fn take_resume(&mut self) -> Option<Direction> {
        self.resume.take()
    }

    fn config(&self) -> Option<&FilterConfig> {
        // SAFETY: `new`'s contract: the configuration outlives every stream made from it.
        unsafe { self.config.as_ref() }
    }

    /// Whether the chunk in hand is part of what is buffered (then it must not be counted twice):
    /// outside a body hook there is no chunk in hand.
    fn chunk_in_hand(&self, d: Direction) -> bool {
        self.in_body_hook && !self.envoy.received_is_buffered(d)
    }

    /// What the adapter calls the body's size: all of it so far, buffered and in hand.
    pub fn body_size(&self, d: Direction) -> usize {
        let buffered = self.envoy.body_size(d.buffered());
        if self.chunk_in_hand(d) {
            buffered.saturating_add(self.envoy.body_size(d.received()))
        } else {
            buffered
        }
    }

    /// A body as Envoy holds it: what earlier chunks buffered, then the chunk in hand.
    fn body(&self, d: Direction) -> Vec<u8> {
        let mut out = Vec::new();
        self.envoy.read_body(d.buffered(), &mut out);
        if self.chunk_in_hand(d) {
            self.envoy.read_body(d.received(), &mut out);
        }
        out
    }

    /// The route's `agent_idempotency` metadata, every leaf, in the `.wasm`'s encoding.
    /// An unannotated route costs one call (no keys).
    fn route_metadata(&self) -> Option<Vec<u8>> {
        let source = abi::MetadataSource::ROUTE;
        let keys = self.envoy.metadata_keys(source, ROUTE_NAMESPACE);
        if keys.is_empty() {
            return None;
        }
        let mut leaves: Vec<(String, Vec<u8>)> = Vec::with_capacity(keys.len());
        for key in keys {
            // Asked for first as the type the field has (Envoy logs an error line for every getter called on a
            // leaf of the other type: per request, on a hot route). A leaf that is neither a string nor a number
            // (a list, a struct) is kept empty: the parse refuses it.
            let number = || self.envoy.metadata_number(source, ROUTE_NAMESPACE, &key).map(|f| f.to_le_bytes().to_vec());
            let string = || self.envoy.metadata_string(source, ROUTE_NAMESPACE, &key);
            let value = if policy::is_numeric_key(&key) { number().or_else(string) } else { string().or_else(number) };
            let value = value.unwrap_or_default();
            leaves.push((key, value));
        }
        // Sorted, so that equal annotations are equal bytes whatever order Envoy lists them in.
        leaves.sort();
        let pairs: Vec<(&str, &[u8])> = leaves.iter().map(|(k, v)| (k.as_str(), v.as_slice())).collect();
        Some(policy::encode_pairs(&pairs))
    }
}

impl Env for NativeHost {
    fn now_s(&self) -> u64 {
        SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
    }

    fn random16(&mut self) -> Option<[u8; 16]> {
        let mut bytes = [0u8; 16];
        getrandom::fill(&mut bytes).ok().map(|()| bytes)
    }

    fn shared_get(&self, key: &str) -> Option<Vec<u8>> {
        shared_data::get(key)
    }
}

impl Host for NativeHost {
    fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        self.envoy.header(HeaderType::REQUEST_HEADER, name)
    }

    fn set_request_header(&mut self, name: &str, value: &str) {
        self.envoy.set_header(HeaderType::REQUEST_HEADER, name, Some(value));
    }

    fn remove_request_header(&mut self, name: &str) {
        self.envoy.set_header(HeaderType::REQUEST_HEADER, name, None);
    }

    fn request_headers(&self) -> Vec<(String, Vec<u8>)> {
        self.envoy.headers(HeaderType::REQUEST_HEADER)
    }

    fn response_headers(&self) -> Vec<(String, Vec<u8>)> {
        self.envoy.headers(HeaderType::RESPONSE_HEADER)
    }

    fn set_response_header(&mut self, name: &str, value: &str) {
        self.envoy.set_header(HeaderType::RESPONSE_HEADER, name, Some(value));
    }

    fn remove_response_header(&mut self, name: &str) {
        self.envoy.set_header(HeaderType::RESPONSE_HEADER, name, None);
    }

    /// Envoy's span for this stream, when Envoy traces it: callouts become its children.
    fn active_span(&self) -> Option<HostSpan> {
        self.envoy.active_span()
    }

    /// The per-route configuration if the route has one, else the route's metadata.
    fn route_annotation(&self) -> Option<Vec<u8>> {
        let ptr = self.envoy.route_config();
        // SAFETY: non-null pointers here are `RouteConfig`s this module made in the per-route config hook,
        // alive while the route configuration that holds them is.
        match unsafe { ptr.cast::<RouteConfig>().as_ref() } {
            Some(route) => Some(route.annotation.clone()),
            None => self.route_metadata(),
        }
    }

    /// The properties the adapter reads: `response.code_details`, `xds.route_name`, and
    /// dynamic metadata one level deep (`metadata.filter_metadata.<namespace>.<key>`, a string).
    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        match path {
            ["response", "code_details"] => self.envoy.attribute(abi::AttributeId::RESPONSE_CODE_DETAILS),
            ["xds", "route_name"] => self.envoy.attribute(abi::AttributeId::XDS_ROUTE_NAME),
            ["metadata", "filter_metadata", ns, key] => {
                self.envoy.metadata_string(abi::MetadataSource::DYNAMIC, ns, key)
            }
            _ => None,
        }
    }

    fn request_body(&self, _size: usize) -> Vec<u8> {
        self.body(Direction::Request)
    }

    fn response_body(&self, _size: usize) -> Vec<u8> {
        self.body(Direction::Response)
    }

    /// The whole body becomes `body`: what was buffered and (inside a body hook) the chunk in hand.
    fn replace_response_body(&mut self, _old_size: usize, body: &[u8]) {
        self.envoy.drain_body(BodyType::BUFFERED_RESPONSE_BODY);
        let target = if self.in_body_hook {
            self.envoy.drain_body(BodyType::RECEIVED_RESPONSE_BODY);
            BodyType::RECEIVED_RESPONSE_BODY
        } else {
            BodyType::BUFFERED_RESPONSE_BODY
        };
        self.envoy.append_body(target, body);
    }

    fn send_reply(&mut self, status: u16, headers: &[(String, String)], body: &[u8]) {
        self.envoy.send_response(status, headers, body, "agent_idempotency");
    }

    fn reset(&mut self) {
        self.envoy.reset("agent_idempotency_refused");
    }

    fn resume_request(&mut self) {
        self.resume = Some(Direction::Request);
    }

    fn resume_response(&mut self) {
        self.resume = Some(Direction::Response);
    }

    fn dispatch(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> Option<u64> {
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        match self.envoy.callout(cluster, headers, body, timeout_ms) {
            Ok(id) => Some(id),
            Err(result) => {
                self.log(Level::Warn, &format!("agent_idempotency: callout to {cluster} not started ({})", result.0));
                None
            }
        }
    }

    fn call_answer(&self, num_headers: usize, _body_size: usize) -> CalloutAnswer {
        match (&self.answer, num_headers) {
            (Some(answer), n) if n > 0 => answer.clone(),
            _ => CalloutAnswer::failed(),
        }
    }

    fn count(&mut self, counter: Counter) {
        let Some(id) = self.config().and_then(|c| c.counter(counter)) else { return };
        self.envoy.increment_counter(id);
    }

    fn log(&self, level: Level, message: &str) {
        log(
            match level {
                Level::Warn => abi::LogLevel::WARN,
                Level::Error => abi::LogLevel::ERROR,
            },
            message,
        );
    }

    fn shared_set(&mut self, key: &str, value: &[u8]) {
        shared_data::set(key, value);
    }

    fn hold_lease(&mut self, lease: &LeaseRenewal) {
        if let Some(c) = self.config() {
            c.main.hold_lease(lease.clone());
        }
    }

    fn end_lease(&mut self, owner: &OwnerToken) {
        if let Some(c) = self.config() {
            c.main.end_lease(owner);
        }
    }

    /// From the main thread: a callout of this stream would be cancelled when the stream ends,
    /// which for a refused confirm is at once.
    fn report(&mut self, _cfg: &PluginConfig, call: &Callout, trace: &Trace) -> bool {
        match self.config() {
            Some(c) => {
                c.main.report(call.clone(), trace.clone());
                true
            }
            None => false,
        }
    }
}
