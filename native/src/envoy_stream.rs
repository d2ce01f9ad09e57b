//! `EnvoyStream`: Envoy's side of one HTTP stream, and the one owner of its filter pointer.
//!
//! Every per-stream callback of the ABI takes the stream's `FilterEnvoyPtr` and is sound only while
//! that pointer is live: from `on_http_filter_new` until `on_http_filter_destroy`, on the thread
//! running the stream's hooks. That invariant is vouched for once, by whoever calls
//! [`EnvoyStream::new`]; every method below is then safe, and its `SAFETY` comment names only what
//! that call adds (which buffers must outlive it, which out-parameter is ours).
//!
//! Envoy's bytes are borrowed for the callback only: each method copies what Envoy lent before it
//! returns (`String`/`Vec`), so nothing Envoy owns escapes this module.
//!
//! Modelled on the `EnvoyHttpFilter` of Envoy's Rust dynamic-module SDK; the type is neither
//! `Clone` nor `Copy`, so the one handle lives in the stream's filter and dies with it.

use crate::abi::{
    self, envoy_buffer, module_buffer, module_http_header, AttributeId, BodyType, FilterEnvoyPtr, HeaderType,
    HttpCalloutInitResult, MetadataSource,
};
use idem_core::trace::HostSpan;
use std::ffi::c_void;

/// A direction of the stream: its body is held by Envoy as what earlier chunks buffered plus,
/// inside a body hook, the chunk being delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Request,
    Response,
}

impl Direction {
    pub fn buffered(self) -> BodyType {
        match self {
            Direction::Request => BodyType::BUFFERED_REQUEST_BODY,
            Direction::Response => BodyType::BUFFERED_RESPONSE_BODY,
        }
    }

    pub fn received(self) -> BodyType {
        match self {
            Direction::Request => BodyType::RECEIVED_REQUEST_BODY,
            Direction::Response => BodyType::RECEIVED_RESPONSE_BODY,
        }
    }
}

/// Envoy's side of one stream (see the module's comment for the invariant it owns).
#[derive(Debug)]
pub struct EnvoyStream(FilterEnvoyPtr);

/// Bytes Envoy lent through an out-parameter, copied before the callback's borrow ends.
fn copied(out: &envoy_buffer) -> Vec<u8> {
    // SAFETY: every caller passes a buffer Envoy filled during the callback that just returned;
    // Envoy keeps it readable until the current hook returns, and it is copied here at once.
    unsafe { out.as_bytes() }.to_vec()
}

fn text(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

impl EnvoyStream {
    /// # Safety
    /// `ptr` is the filter pointer Envoy handed to `on_http_filter_new` (or to one of this
    /// stream's hooks), and the value is used only inside that stream's hooks, before
    /// `on_http_filter_destroy`. Every method relies on this and on nothing else of the caller's.
    pub unsafe fn new(ptr: FilterEnvoyPtr) -> EnvoyStream {
        EnvoyStream(ptr)
    }

    /// A header's value as sent: bytes, never decoded here (core decides what non-text means).
    pub fn header(&self, kind: HeaderType, name: &str) -> Option<Vec<u8>> {
        let mut out = envoy_buffer::NULL;
        // SAFETY: `name` outlives the call; `out` is ours to fill; index 0, no count wanted.
        let found = unsafe {
            abi::envoy_dynamic_module_callback_http_get_header(
                self.0,
                kind,
                module_buffer::new(name.as_bytes()),
                &mut out,
                0,
                std::ptr::null_mut(),
            )
        };
        found.then(|| copied(&out))
    }

    /// Every entry of a header map, a repeated header once per value; names as text (HTTP
    /// names are tokens), values as the bytes sent.
    pub fn headers(&self, kind: HeaderType) -> Vec<(String, Vec<u8>)> {
        // SAFETY: no buffers.
        let n = unsafe { abi::envoy_dynamic_module_callback_http_get_headers_size(self.0, kind) };
        if n == 0 {
            return Vec::new();
        }
        let mut raw = vec![abi::envoy_http_header::NULL; n];
        // SAFETY: `raw` has room for the `n` headers Envoy reported.
        if !unsafe { abi::envoy_dynamic_module_callback_http_get_headers(self.0, kind, raw.as_mut_ptr()) } {
            return Vec::new();
        }
        let entry = |ptr, len| copied(&envoy_buffer { ptr, len });
        raw.iter().map(|h| (text(entry(h.key_ptr, h.key_len)), entry(h.value_ptr, h.value_len))).collect()
    }

    /// Sets `name` to `value`, or removes it (`None`).
    pub fn set_header(&self, kind: HeaderType, name: &str, value: Option<&str>) {
        let value = value.map_or(module_buffer::NULL, |v| module_buffer::new(v.as_bytes()));
        // SAFETY: both buffers outlive the call.
        unsafe {
            abi::envoy_dynamic_module_callback_http_set_header(self.0, kind, module_buffer::new(name.as_bytes()), value)
        };
    }

    /// Whether the chunk being delivered to a body hook is already part of the buffered body.
    pub fn received_is_buffered(&self, d: Direction) -> bool {
        // SAFETY: no buffers.
        unsafe {
            match d {
                Direction::Request => abi::envoy_dynamic_module_callback_http_received_buffered_request_body(self.0),
                Direction::Response => abi::envoy_dynamic_module_callback_http_received_buffered_response_body(self.0),
            }
        }
    }

    pub fn body_size(&self, kind: BodyType) -> usize {
        // SAFETY: no buffers.
        unsafe { abi::envoy_dynamic_module_callback_http_get_body_size(self.0, kind) }
    }

    /// Appends a body's bytes, chunk by chunk, to `out`.
    pub fn read_body(&self, kind: BodyType, out: &mut Vec<u8>) {
        // SAFETY: no buffers.
        let n = unsafe { abi::envoy_dynamic_module_callback_http_get_body_chunks_size(self.0, kind) };
        if n == 0 {
            return;
        }
        let mut chunks = vec![envoy_buffer::NULL; n];
        // SAFETY: `chunks` has room for the `n` slices Envoy reported.
        if unsafe { abi::envoy_dynamic_module_callback_http_get_body_chunks(self.0, kind, chunks.as_mut_ptr()) } {
            for c in &chunks {
                out.extend_from_slice(&copied(c));
            }
        }
    }

    /// Drops all of a body.
    pub fn drain_body(&self, kind: BodyType) {
        let size = self.body_size(kind);
        if size > 0 {
            // SAFETY: no buffers; `size` is what Envoy holds.
            unsafe { abi::envoy_dynamic_module_callback_http_drain_body(self.0, kind, size) };
        }
    }

    pub fn append_body(&self, kind: BodyType, bytes: &[u8]) {
        // SAFETY: `bytes` outlives the call.
        unsafe { abi::envoy_dynamic_module_callback_http_append_body(self.0, kind, module_buffer::new(bytes)) };
    }

    pub fn attribute(&self, id: AttributeId) -> Option<Vec<u8>> {
        let mut out = envoy_buffer::NULL;
        // SAFETY: `out` is ours to fill.
        let found =
            unsafe { abi::envoy_dynamic_module_callback_http_filter_get_attribute_string(self.0, id, &mut out) };
        found.then(|| copied(&out))
    }

    pub fn metadata_string(&self, source: MetadataSource, ns: &str, key: &str) -> Option<Vec<u8>> {
        let mut out = envoy_buffer::NULL;
        // SAFETY: `ns` and `key` outlive the call; `out` is ours to fill.
        let found = unsafe {
            abi::envoy_dynamic_module_callback_http_get_metadata_string(
                self.0,
                source,
                module_buffer::new(ns.as_bytes()),
                module_buffer::new(key.as_bytes()),
                &mut out,
            )
        };
        found.then(|| copied(&out))
    }

    pub fn metadata_number(&self, source: MetadataSource, ns: &str, key: &str) -> Option<f64> {
        let mut out = 0f64;
        // SAFETY: `ns` and `key` outlive the call; `out` is ours to fill.
        let found = unsafe {
            abi::envoy_dynamic_module_callback_http_get_metadata_number(
                self.0,
                source,
                module_buffer::new(ns.as_bytes()),
                module_buffer::new(key.as_bytes()),
                &mut out,
            )
        };
        found.then_some(out)
    }

    /// The keys of one metadata namespace (empty when it has none: one call).
    pub fn metadata_keys(&self, source: MetadataSource, ns: &str) -> Vec<String> {
        let ns = module_buffer::new(ns.as_bytes());
        // SAFETY: `ns` outlives the call.
        let n = unsafe { abi::envoy_dynamic_module_callback_http_get_metadata_keys_count(self.0, source, ns) };
        if n == 0 {
            return Vec::new();
        }
        let mut keys = vec![envoy_buffer::NULL; n];
        // SAFETY: `ns` outlives the call; `keys` has room for the `n` keys Envoy reported.
        if !unsafe { abi::envoy_dynamic_module_callback_http_get_metadata_keys(self.0, source, ns, keys.as_mut_ptr()) }
        {
            return Vec::new();
        }
        keys.iter().map(|k| text(copied(k))).collect()
    }

    /// Envoy's span for this stream, when Envoy traces it.
    pub fn active_span(&self) -> Option<HostSpan> {
        // SAFETY: no buffers.
        let span = unsafe { abi::envoy_dynamic_module_callback_http_get_active_span(self.0) };
        if span.is_null() {
            return None;
        }
        type Get = unsafe extern "C" fn(abi::SpanEnvoyPtr, *mut envoy_buffer) -> bool;
        let read = |get: Get| {
            let mut out = envoy_buffer::NULL;
            // SAFETY: `span` is this stream's, alive with it; `out` is ours to fill (Envoy's string
            // lives until the next tracing callback on this thread: `copied` at once).
            unsafe { get(span, &mut out) }.then(|| text(copied(&out)))
        };
        let trace_id = read(abi::envoy_dynamic_module_callback_http_span_get_trace_id)?;
        let span_id = read(abi::envoy_dynamic_module_callback_http_span_get_span_id)?;
        Some(HostSpan { trace_id, span_id })
    }

    /// The module's per-route configuration for this stream's route, as the pointer this module
    /// returned from the per-route config hook (null when the route has none).
    pub fn route_config(&self) -> *const c_void {
        // SAFETY: no buffers.
        unsafe { abi::envoy_dynamic_module_callback_get_most_specific_route_config(self.0) }
    }

    /// A local reply; Envoy sends it and ends the stream.
    pub fn send_response(&self, status: u16, headers: &[(String, String)], body: &[u8], details: &str) {
        let raw: Vec<module_http_header> =
            headers.iter().map(|(k, v)| module_http_header::new(k.as_bytes(), v.as_bytes())).collect();
        // SAFETY: `raw`, the headers it borrows, `body` and `details` outlive the call.
        unsafe {
            abi::envoy_dynamic_module_callback_http_send_response(
                self.0,
                u32::from(status),
                raw.as_ptr(),
                raw.len(),
                module_buffer::new(body),
                module_buffer::new(details.as_bytes()),
            )
        };
    }

    /// Starts a callout; its answer arrives at `on_http_filter_http_callout_done` with the id.
    pub fn callout(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout_ms: u64,
    ) -> Result<u64, HttpCalloutInitResult> {
        let raw: Vec<module_http_header> =
            headers.iter().map(|(k, v)| module_http_header::new(k.as_bytes(), v.as_bytes())).collect();
        let mut id = 0u64;
        // SAFETY: every buffer outlives the call; `id` is ours to fill.
        let result = unsafe {
            abi::envoy_dynamic_module_callback_http_filter_http_callout(
                self.0,
                &mut id,
                module_buffer::new(cluster.as_bytes()),
                raw.as_ptr(),
                raw.len(),
                body.map_or(module_buffer::NULL, module_buffer::new),
                timeout_ms,
            )
        };
        if result == HttpCalloutInitResult::SUCCESS {
            Ok(id)
        } else {
            Err(result)
        }
    }

    /// Adds one to a counter the configuration defined (it has no labels).
    pub fn increment_counter(&self, id: usize) {
        // SAFETY: no labels, no buffers.
        unsafe { abi::envoy_dynamic_module_callback_http_filter_increment_counter(self.0, id, std::ptr::null(), 0, 1) };
    }

    /// Resets the stream (a hook panicked after the upstream's answer began).
    pub fn reset(&self, details: &str) {
        // SAFETY: `details` outlives the call.
        unsafe {
            abi::envoy_dynamic_module_callback_http_filter_reset_stream(
                self.0,
                abi::StreamResetReason::LOCAL_RESET,
                module_buffer::new(details.as_bytes()),
            )
        };
    }

    /// Resumes the stream in `direction`. Envoy runs this filter's next hooks before it returns,
    /// so the caller must hold no reference into the filter.
    pub fn resume(&self, direction: Direction) {
        // SAFETY: no buffers; re-entry is the caller's concern (above), not memory safety's.
        unsafe {
            match direction {
                Direction::Request => abi::envoy_dynamic_module_callback_http_filter_continue_decoding(self.0),
                Direction::Response => abi::envoy_dynamic_module_callback_http_filter_continue_encoding(self.0),
            }
        }
    }
}
