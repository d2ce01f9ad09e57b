//! `idem_adapter::Host` over Envoy's dynamic-module callbacks.
//!
//! Every value read from Envoy is copied out before the call returns: Envoy's
//! buffers are only lent for the duration of the current hook.

use crate::abi::{self, envoy_buffer, module_buffer, module_http_header, BodyType, FilterEnvoyPtr, HeaderType};
use crate::config::{FilterConfig, RouteConfig};
use crate::log::log;
use crate::shared_data;
use idem_adapter::{Host, Level};
use idem_core::machine::{Callout, CalloutAnswer, Counter, Env};
use idem_core::policy::{self, PluginConfig, ROUTE_NAMESPACE};
use idem_core::protocol::{LeaseRenewal, OwnerToken};
use idem_core::trace::{HostSpan, Trace};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub struct NativeHost {
    /// Envoy's side of this stream: valid from `on_http_filter_new` until `on_http_filter_destroy`.
    envoy: FilterEnvoyPtr,
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

/// A direction of the stream: its body is held by Envoy as what earlier chunks buffered plus,
/// inside a body hook, the chunk being delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Request,
    Response,
}

impl Direction {
    fn buffered(self) -> BodyType {
        match self {
            Direction::Request => BodyType::BUFFERED_REQUEST_BODY,
            Direction::Response => BodyType::BUFFERED_RESPONSE_BODY,
        }
    }

    fn received(self) -> BodyType {
        match self {
            Direction::Request => BodyType::RECEIVED_REQUEST_BODY,
            Direction::Response => BodyType::RECEIVED_RESPONSE_BODY,
        }
    }
}

impl NativeHost {
    /// # Safety
    /// `envoy` is the stream's filter pointer from `on_http_filter_new`, and every use of this
    /// host happens inside one of that stream's hooks, before `on_http_filter_destroy`; `config`
    /// is the configuration the stream was made from. This is the one place that invariant is
    /// vouched for: every call into Envoy below relies on it.
    pub unsafe fn new(envoy: FilterEnvoyPtr, config: *const FilterConfig) -> NativeHost {
        NativeHost { envoy, config, answer: None, in_body_hook: false, resume: None }
    }

    /// Reset the stream (a hook panicked after the upstream's answer began).
    pub fn reset(&self, details: &str) {
        // SAFETY: a live filter pointer (`new`); `details` outlives the call.
        unsafe {
            abi::envoy_dynamic_module_callback_http_filter_reset_stream(
                self.envoy,
                abi::StreamResetReason::LOCAL_RESET,
                module_buffer::new(details.as_bytes()),
            )
        };
    }

    pub fn take_resume(&mut self) -> Option<Direction> {
        self.resume.take()
    }

    fn config(&self) -> Option<&FilterConfig> {
        // SAFETY: Envoy destroys a filter configuration only after every stream using it.
        unsafe { self.config.as_ref() }
    }

    fn header(&self, kind: HeaderType, name: &str) -> Option<String> {
        let mut out = envoy_buffer::NULL;
        // SAFETY: a live filter pointer; `name` outlives the call; `out` is ours to fill.
        let found = unsafe {
            abi::envoy_dynamic_module_callback_http_get_header(
                self.envoy,
                kind,
                module_buffer::new(name.as_bytes()),
                &mut out,
                0,
                std::ptr::null_mut(),
            )
        };
        // SAFETY: Envoy lent `out` until this hook returns; copied at once.
        found.then(|| String::from_utf8_lossy(unsafe { out.as_bytes() }).into_owned())
    }

    /// Every entry of a header map, a repeated header once per value.
    fn headers(&self, kind: HeaderType) -> Vec<(String, String)> {
        // SAFETY: a live filter pointer.
        let n = unsafe { abi::envoy_dynamic_module_callback_http_get_headers_size(self.envoy, kind) };
        let mut raw = vec![abi::envoy_http_header::NULL; n];
        // SAFETY: `raw` has room for the `n` headers Envoy reported.
        if n == 0 || !unsafe { abi::envoy_dynamic_module_callback_http_get_headers(self.envoy, kind, raw.as_mut_ptr()) }
        {
            return Vec::new();
        }
        raw.iter()
            .map(|h| {
                let text = |ptr, len| {
                    // SAFETY: lent until this hook returns; copied at once.
                    String::from_utf8_lossy(unsafe { envoy_buffer { ptr, len }.as_bytes() }).into_owned()
                };
                (text(h.key_ptr, h.key_len), text(h.value_ptr, h.value_len))
            })
            .collect()
    }

    fn set_header(&mut self, kind: HeaderType, name: &str, value: Option<&str>) {
        let value = value.map_or(module_buffer::NULL, |v| module_buffer::new(v.as_bytes()));
        // SAFETY: a live filter pointer; both buffers outlive the call.
        unsafe {
            abi::envoy_dynamic_module_callback_http_set_header(
                self.envoy,
                kind,
                module_buffer::new(name.as_bytes()),
                value,
            )
        };
    }

    /// Whether the chunk in hand is part of what is buffered (then it must not be counted twice):
    /// outside a body hook there is no chunk in hand.
    fn chunk_in_hand(&self, d: Direction) -> bool {
        // SAFETY: a live filter pointer.
        let same = unsafe {
            match d {
                Direction::Request => {
                    abi::envoy_dynamic_module_callback_http_received_buffered_request_body(self.envoy)
                }
                Direction::Response => {
                    abi::envoy_dynamic_module_callback_http_received_buffered_response_body(self.envoy)
                }
            }
        };
        self.in_body_hook && !same
    }

    /// What the adapter calls the body's size: all of it so far, buffered and in hand.
    pub fn body_size(&self, d: Direction) -> usize {
        let size = |kind| {
            // SAFETY: a live filter pointer.
            unsafe { abi::envoy_dynamic_module_callback_http_get_body_size(self.envoy, kind) }
        };
        let buffered = size(d.buffered());
        if self.chunk_in_hand(d) {
            buffered.saturating_add(size(d.received()))
        } else {
            buffered
        }
    }

    /// A body as Envoy holds it: what earlier chunks buffered, then the chunk in hand.
    fn body(&self, d: Direction) -> Vec<u8> {
        let mut out = Vec::new();
        self.append_chunks(d.buffered(), &mut out);
        if self.chunk_in_hand(d) {
            self.append_chunks(d.received(), &mut out);
        }
        out
    }

    fn append_chunks(&self, kind: BodyType, out: &mut Vec<u8>) {
        // SAFETY: a live filter pointer.
        let n = unsafe { abi::envoy_dynamic_module_callback_http_get_body_chunks_size(self.envoy, kind) };
        if n == 0 {
            return;
        }
        let mut chunks = vec![envoy_buffer::NULL; n];
        // SAFETY: `chunks` has room for the `n` slices Envoy reported.
        if unsafe { abi::envoy_dynamic_module_callback_http_get_body_chunks(self.envoy, kind, chunks.as_mut_ptr()) } {
            for c in &chunks {
                // SAFETY: lent until this hook returns; copied at once.
                out.extend_from_slice(unsafe { c.as_bytes() });
            }
        }
    }

    fn drain(&mut self, kind: BodyType) {
        // SAFETY: a live filter pointer.
        unsafe {
            let size = abi::envoy_dynamic_module_callback_http_get_body_size(self.envoy, kind);
            if size > 0 {
                abi::envoy_dynamic_module_callback_http_drain_body(self.envoy, kind, size);
            }
        }
    }

    fn attribute(&self, id: abi::AttributeId) -> Option<Vec<u8>> {
        let mut out = envoy_buffer::NULL;
        // SAFETY: a live filter pointer; `out` is ours to fill.
        let found =
            unsafe { abi::envoy_dynamic_module_callback_http_filter_get_attribute_string(self.envoy, id, &mut out) };
        // SAFETY: lent until this hook returns; copied at once.
        found.then(|| unsafe { out.as_bytes() }.to_vec())
    }

    fn metadata_string(&self, source: abi::MetadataSource, ns: &str, key: &str) -> Option<Vec<u8>> {
        let mut out = envoy_buffer::NULL;
        // SAFETY: a live filter pointer; `ns` and `key` outlive the call.
        let found = unsafe {
            abi::envoy_dynamic_module_callback_http_get_metadata_string(
                self.envoy,
                source,
                module_buffer::new(ns.as_bytes()),
                module_buffer::new(key.as_bytes()),
                &mut out,
            )
        };
        // SAFETY: lent until this hook returns; copied at once.
        found.then(|| unsafe { out.as_bytes() }.to_vec())
    }

    fn metadata_number(&self, source: abi::MetadataSource, ns: &str, key: &str) -> Option<f64> {
        let mut out = 0f64;
        // SAFETY: a live filter pointer; `ns` and `key` outlive the call.
        let found = unsafe {
            abi::envoy_dynamic_module_callback_http_get_metadata_number(
                self.envoy,
                source,
                module_buffer::new(ns.as_bytes()),
                module_buffer::new(key.as_bytes()),
                &mut out,
            )
        };
        found.then_some(out)
    }

    /// The route's `agent_idempotency` metadata, every leaf, in the `.wasm`'s encoding.
    /// An unannotated route costs one call (no keys).
    fn route_metadata(&self) -> Option<Vec<u8>> {
        let source = abi::MetadataSource::ROUTE;
        let ns = module_buffer::new(ROUTE_NAMESPACE.as_bytes());
        // SAFETY: a live filter pointer; `ns` outlives the call.
        let n = unsafe { abi::envoy_dynamic_module_callback_http_get_metadata_keys_count(self.envoy, source, ns) };
        if n == 0 {
            return None;
        }
        let mut keys = vec![envoy_buffer::NULL; n];
        // SAFETY: `keys` has room for the `n` keys Envoy reported.
        if !unsafe {
            abi::envoy_dynamic_module_callback_http_get_metadata_keys(self.envoy, source, ns, keys.as_mut_ptr())
        } {
            return None;
        }
        let mut leaves: Vec<(String, Vec<u8>)> = Vec::with_capacity(n);
        for k in &keys {
            // SAFETY: lent until this hook returns; copied at once.
            let key = String::from_utf8_lossy(unsafe { k.as_bytes() }).into_owned();
            // Asked for first as the type the field has (Envoy logs an error line for every getter called on a
            // leaf of the other type: per request, on a hot route). A leaf that is neither a string nor a number
            // (a list, a struct) is kept empty: the parse refuses it.
            let number = || self.metadata_number(source, ROUTE_NAMESPACE, &key).map(|f| f.to_le_bytes().to_vec());
            let string = || self.metadata_string(source, ROUTE_NAMESPACE, &key);
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
    fn request_header(&self, name: &str) -> Option<String> {
        self.header(HeaderType::REQUEST_HEADER, name)
    }

    fn set_request_header(&mut self, name: &str, value: &str) {
        self.set_header(HeaderType::REQUEST_HEADER, name, Some(value));
    }

    fn remove_request_header(&mut self, name: &str) {
        self.set_header(HeaderType::REQUEST_HEADER, name, None);
    }

    fn response_header(&self, name: &str) -> Option<String> {
        self.header(HeaderType::RESPONSE_HEADER, name)
    }

    fn request_headers(&self) -> Vec<(String, String)> {
        self.headers(HeaderType::REQUEST_HEADER)
    }

    fn response_headers(&self) -> Vec<(String, String)> {
        self.headers(HeaderType::RESPONSE_HEADER)
    }

    fn set_response_header(&mut self, name: &str, value: &str) {
        self.set_header(HeaderType::RESPONSE_HEADER, name, Some(value));
    }

    fn remove_response_header(&mut self, name: &str) {
        self.set_header(HeaderType::RESPONSE_HEADER, name, None);
    }

    /// Envoy's span for this stream, when Envoy traces it: callouts become its children.
    fn active_span(&self) -> Option<HostSpan> {
        // SAFETY: a live filter pointer.
        let span = unsafe { abi::envoy_dynamic_module_callback_http_get_active_span(self.envoy) };
        if span.is_null() {
            return None;
        }
        type Get = unsafe extern "C" fn(abi::SpanEnvoyPtr, *mut envoy_buffer) -> bool;
        let read = |get: Get| {
            let mut out = envoy_buffer::NULL;
            // SAFETY: `span` is this stream's, alive with it; `out` is ours to fill; Envoy's
            // string lives until the next tracing callback on this thread, so it is copied at once.
            unsafe { get(span, &mut out) }.then(|| String::from_utf8_lossy(unsafe { out.as_bytes() }).into_owned())
        };
        let trace_id = read(abi::envoy_dynamic_module_callback_http_span_get_trace_id)?;
        let span_id = read(abi::envoy_dynamic_module_callback_http_span_get_span_id)?;
        Some(HostSpan { trace_id, span_id })
    }

    /// The per-route configuration if the route has one, else the route's metadata.
    fn route_annotation(&self) -> Option<Vec<u8>> {
        // SAFETY: a live filter pointer.
        let ptr = unsafe { abi::envoy_dynamic_module_callback_get_most_specific_route_config(self.envoy) };
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
            ["response", "code_details"] => self.attribute(abi::AttributeId::RESPONSE_CODE_DETAILS),
            ["xds", "route_name"] => self.attribute(abi::AttributeId::XDS_ROUTE_NAME),
            ["metadata", "filter_metadata", ns, key] => self.metadata_string(abi::MetadataSource::DYNAMIC, ns, key),
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
        self.drain(BodyType::BUFFERED_RESPONSE_BODY);
        let target = if self.in_body_hook {
            self.drain(BodyType::RECEIVED_RESPONSE_BODY);
            BodyType::RECEIVED_RESPONSE_BODY
        } else {
            BodyType::BUFFERED_RESPONSE_BODY
        };
        // SAFETY: a live filter pointer; `body` outlives the call.
        unsafe { abi::envoy_dynamic_module_callback_http_append_body(self.envoy, target, module_buffer::new(body)) };
    }

    fn send_reply(&mut self, status: u16, headers: &[(String, String)], body: &[u8]) {
        let raw: Vec<module_http_header> =
            headers.iter().map(|(k, v)| module_http_header::new(k.as_bytes(), v.as_bytes())).collect();
        // SAFETY: a live filter pointer; `raw`, the headers it borrows and `body` outlive the call.
        unsafe {
            abi::envoy_dynamic_module_callback_http_send_response(
                self.envoy,
                u32::from(status),
                raw.as_ptr(),
                raw.len(),
                module_buffer::new(body),
                module_buffer::new(b"agent_idempotency"),
            )
        };
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
        let raw: Vec<module_http_header> =
            headers.iter().map(|(k, v)| module_http_header::new(k.as_bytes(), v.as_bytes())).collect();
        let mut id = 0u64;
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        // SAFETY: a live filter pointer; every buffer outlives the call; `id` is ours to fill.
        let result = unsafe {
            abi::envoy_dynamic_module_callback_http_filter_http_callout(
                self.envoy,
                &mut id,
                module_buffer::new(cluster.as_bytes()),
                raw.as_ptr(),
                raw.len(),
                body.map_or(module_buffer::NULL, module_buffer::new),
                timeout_ms,
            )
        };
        if result == abi::HttpCalloutInitResult::SUCCESS {
            Some(id)
        } else {
            self.log(Level::Warn, &format!("agent_idempotency: callout to {cluster} not started ({})", result.0));
            None
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
        // SAFETY: a live filter pointer; the counter has no labels.
        unsafe {
            abi::envoy_dynamic_module_callback_http_filter_increment_counter(self.envoy, id, std::ptr::null(), 0, 1)
        };
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

/// Resume the stream in `direction`. Envoy runs this filter's next hooks before it returns,
/// so the caller must hold no reference into the filter.
pub fn resume(envoy: FilterEnvoyPtr, direction: Direction) {
    // SAFETY: a live filter pointer.
    unsafe {
        match direction {
            Direction::Request => abi::envoy_dynamic_module_callback_http_filter_continue_decoding(envoy),
            Direction::Response => abi::envoy_dynamic_module_callback_http_filter_continue_encoding(envoy),
        }
    }
}
