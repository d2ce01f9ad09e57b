//! Hand-written bindings for the part of Envoy's dynamic-modules C ABI that the native
//! HTTP filter uses. Target: Envoy 1.40.0, whose ABI version string is `v0.2.0`.
//!
//! Three kinds of items live here:
//! * types (`#[repr(C)]` structs, opaque pointers, and C enums as `u32` newtypes),
//! * callbacks: functions Envoy exports and the module imports (the `extern "C"` block),
//! * hooks: functions the module must export; only their function-pointer types live here
//!   (`On*` aliases) so the adapter can assert its exports have the exact shape, e.g.
//!   `const _: abi::OnHttpFilterRequestHeaders = envoy_dynamic_module_on_http_filter_request_headers;`.
//!
//! C enums are `int`-sized on every platform Envoy supports, so each one is a
//! `#[repr(transparent)]` `u32` newtype with associated constants. A Rust `enum` would be
//! undefined behaviour the day Envoy hands over a value this file does not know; a newtype is
//! not. Pointer const-ness follows who owns the memory: data the module only reads (Envoy's
//! arrays given to a hook, the module's arrays given to a callback) is `*const` even where
//! the C prototype omits `const`; the two are the same at the ABI level.
//!
//! Semantics (lifetimes, ownership, which body is which) are in `native/ABI-NOTES.md`.
#![allow(non_camel_case_types)]
#![allow(dead_code)] // bindings: not every constant is used by every build

use core::ffi::{c_char, c_void};

/// `ENVOY_DYNAMIC_MODULES_ABI_VERSION` of Envoy 1.40.0.
pub const ABI_VERSION: &str = "v0.2.0";

/// `ABI_VERSION` NUL-terminated: what `envoy_dynamic_module_on_program_init` returns.
pub const ABI_VERSION_NUL: &[u8] = b"v0.2.0\0";

// ------------------------------------------------------------------ opaque pointers

/// `envoy_dynamic_module_type_abi_version_module_ptr` (`const char*`, NUL-terminated).
pub type AbiVersionModulePtr = *const c_char;
/// `envoy_dynamic_module_type_http_filter_config_envoy_ptr` (`void*`, Envoy's filter config).
pub type FilterConfigEnvoyPtr = *mut c_void;
/// `envoy_dynamic_module_type_http_filter_config_module_ptr` (`const void*`, the module's config).
pub type FilterConfigModulePtr = *const c_void;
/// `envoy_dynamic_module_type_http_filter_stream_reset_reason` (Envoy maps any value it does
/// not know to a local reset).
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamResetReason(pub u32);
impl StreamResetReason {
    pub const LOCAL_RESET: Self = Self(0);
}

/// A filter configuration's scheduler (`config_scheduler_new`).
pub type ConfigSchedulerPtr = *mut c_void;
/// `envoy_dynamic_module_type_http_filter_per_route_config_module_ptr` (`const void*`).
pub type PerRouteConfigModulePtr = *const c_void;
/// `envoy_dynamic_module_type_http_filter_envoy_ptr` (`void*`, Envoy's per-stream filter).
pub type FilterEnvoyPtr = *mut c_void;
/// `envoy_dynamic_module_type_http_filter_module_ptr` (`const void*`, the module's per-stream filter).
pub type FilterModulePtr = *const c_void;
/// `envoy_dynamic_module_type_span_envoy_ptr`: a stream's active span, Envoy's, alive with the stream.
pub type SpanEnvoyPtr = *mut c_void;

// ------------------------------------------------------------------ structs

/// `envoy_dynamic_module_type_envoy_buffer`: bytes owned by Envoy.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct envoy_buffer {
    /// `ptr` (`envoy_dynamic_module_type_buffer_envoy_ptr`); may be null.
    pub ptr: *const c_char,
    /// `length`.
    pub len: usize,
}

impl envoy_buffer {
    /// A null, empty buffer: the value to initialise an out-parameter with.
    pub const NULL: Self = Self { ptr: core::ptr::null(), len: 0 };

    /// Views the bytes. A null `ptr` or a zero `len` gives an empty slice.
    ///
    /// The bytes, borrowed no longer than this buffer value: the caller cannot pick a longer
    /// lifetime, and copies what it keeps before the hook returns.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be readable while the borrow lasts; Envoy only promises that until the
    /// current hook returns (or until a setter touches the same map/buffer), see ABI-NOTES.md.
    #[must_use]
    pub unsafe fn as_bytes(&self) -> &[u8] {
        if self.ptr.is_null() || self.len == 0 {
            return &[];
        }
        // SAFETY: non-null, and the caller vouches for `len` readable bytes while the borrow lasts.
        unsafe { core::slice::from_raw_parts(self.ptr.cast::<u8>(), self.len) }
    }
}

/// `envoy_dynamic_module_type_module_buffer`: bytes owned by the module, lent for one call.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct module_buffer {
    /// `ptr` (`envoy_dynamic_module_type_buffer_module_ptr`); may be null where the callback allows it.
    pub ptr: *const c_char,
    /// `length`.
    pub len: usize,
}

impl module_buffer {
    /// A null, empty buffer (e.g. "no details" for `send_response`, "remove" for `set_header`).
    pub const NULL: Self = Self { ptr: core::ptr::null(), len: 0 };

    /// Borrows `bytes`; the result must not outlive them.
    #[must_use]
    pub const fn new(bytes: &[u8]) -> Self {
        Self { ptr: bytes.as_ptr().cast::<c_char>(), len: bytes.len() }
    }
}

/// `envoy_dynamic_module_type_module_http_header`: one header owned by the module.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct module_http_header {
    /// `key_ptr`.
    pub key_ptr: *const c_char,
    /// `key_length`.
    pub key_len: usize,
    /// `value_ptr`.
    pub value_ptr: *const c_char,
    /// `value_length`.
    pub value_len: usize,
}

impl module_http_header {
    /// Borrows `key` and `value`; the result must not outlive them.
    #[must_use]
    pub const fn new(key: &[u8], value: &[u8]) -> Self {
        Self {
            key_ptr: key.as_ptr().cast::<c_char>(),
            key_len: key.len(),
            value_ptr: value.as_ptr().cast::<c_char>(),
            value_len: value.len(),
        }
    }
}

/// `envoy_dynamic_module_type_envoy_http_header`: one header owned by Envoy's header map.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct envoy_http_header {
    /// `key_ptr`.
    pub key_ptr: *const c_char,
    /// `key_length`.
    pub key_len: usize,
    /// `value_ptr`.
    pub value_ptr: *const c_char,
    /// `value_length`.
    pub value_len: usize,
}

impl envoy_http_header {
    /// An empty entry, to fill an output array with before `get_headers` writes it.
    pub const NULL: Self = Self { key_ptr: core::ptr::null(), key_len: 0, value_ptr: core::ptr::null(), value_len: 0 };
}

// ------------------------------------------------------------------ enums

/// `envoy_dynamic_module_type_http_header_type`.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeaderType(pub u32);
impl HeaderType {
    /// `_RequestHeader`.
    pub const REQUEST_HEADER: Self = Self(0);
    /// `_RequestTrailer`.
    pub const REQUEST_TRAILER: Self = Self(1);
    /// `_ResponseHeader`.
    pub const RESPONSE_HEADER: Self = Self(2);
    /// `_ResponseTrailer`.
    pub const RESPONSE_TRAILER: Self = Self(3);
}

/// `envoy_dynamic_module_type_http_body_type`.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BodyType(pub u32);
impl BodyType {
    /// `_ReceivedRequestBody`: the chunk of the current `on_request_body` call only.
    pub const RECEIVED_REQUEST_BODY: Self = Self(0);
    /// `_BufferedRequestBody`: what Envoy buffered for this filter (decodingBuffer).
    pub const BUFFERED_REQUEST_BODY: Self = Self(1);
    /// `_ReceivedResponseBody`: the chunk of the current `on_response_body` call only.
    pub const RECEIVED_RESPONSE_BODY: Self = Self(2);
    /// `_BufferedResponseBody`: what Envoy buffered for this filter (encodingBuffer).
    pub const BUFFERED_RESPONSE_BODY: Self = Self(3);
}

/// `envoy_dynamic_module_type_log_level` (mirrors spdlog's levels).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogLevel(pub u32);
impl LogLevel {
    /// `_Trace`.
    pub const TRACE: Self = Self(0);
    /// `_Debug`.
    pub const DEBUG: Self = Self(1);
    /// `_Info`.
    pub const INFO: Self = Self(2);
    /// `_Warn`.
    pub const WARN: Self = Self(3);
    /// `_Error`.
    pub const ERROR: Self = Self(4);
    /// `_Critical`.
    pub const CRITICAL: Self = Self(5);
    /// `_Off`.
    pub const OFF: Self = Self(6);
}

/// `envoy_dynamic_module_type_http_callout_init_result` (return of `http_filter_http_callout`).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpCalloutInitResult(pub u32);
impl HttpCalloutInitResult {
    /// `_Success`: the callout is in flight; its id was written to `callout_id_out`.
    pub const SUCCESS: Self = Self(0);
    /// `_MissingRequiredHeaders`: `:method`, `:path` or `host` missing.
    pub const MISSING_REQUIRED_HEADERS: Self = Self(1);
    /// `_ClusterNotFound`.
    pub const CLUSTER_NOT_FOUND: Self = Self(2);
    /// `_DuplicateCalloutId` (only possible in ABIs where the module chose the id).
    pub const DUPLICATE_CALLOUT_ID: Self = Self(3);
    /// `_CannotCreateRequest` (e.g. no healthy host).
    pub const CANNOT_CREATE_REQUEST: Self = Self(4);
}

/// `envoy_dynamic_module_type_http_callout_result` (passed to `on_http_filter_http_callout_done`).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpCalloutResult(pub u32);
impl HttpCalloutResult {
    /// `_Success`: a response arrived (any HTTP status, including 5xx).
    pub const SUCCESS: Self = Self(0);
    /// `_Reset`: no response (connect failure, reset, timeout).
    pub const RESET: Self = Self(1);
    /// `_ExceedResponseBufferLimit`.
    pub const EXCEED_RESPONSE_BUFFER_LIMIT: Self = Self(2);
}

/// `envoy_dynamic_module_type_http_stream_reset_reason` (streamed callouts; hook signatures only).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpStreamResetReason(pub u32);
impl HttpStreamResetReason {
    /// `_ConnectionFailure`.
    pub const CONNECTION_FAILURE: Self = Self(0);
    /// `_ConnectionTermination`.
    pub const CONNECTION_TERMINATION: Self = Self(1);
    /// `_LocalReset`.
    pub const LOCAL_RESET: Self = Self(2);
    /// `_LocalRefusedStreamReset`.
    pub const LOCAL_REFUSED_STREAM_RESET: Self = Self(3);
    /// `_Overflow`.
    pub const OVERFLOW: Self = Self(4);
    /// `_RemoteReset`.
    pub const REMOTE_RESET: Self = Self(5);
    /// `_RemoteRefusedStreamReset`.
    pub const REMOTE_REFUSED_STREAM_RESET: Self = Self(6);
    /// `_ProtocolError`.
    pub const PROTOCOL_ERROR: Self = Self(7);
}

/// `envoy_dynamic_module_type_metrics_result`.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetricsResult(pub u32);
impl MetricsResult {
    /// `_Success`.
    pub const SUCCESS: Self = Self(0);
    /// `_MetricNotFound`.
    pub const METRIC_NOT_FOUND: Self = Self(1);
    /// `_InvalidLabels`.
    pub const INVALID_LABELS: Self = Self(2);
    /// `_Frozen`: defining a metric after `on_http_filter_config_new` returned.
    pub const FROZEN: Self = Self(3);
}

/// `envoy_dynamic_module_type_metadata_source`.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetadataSource(pub u32);
impl MetadataSource {
    /// `_Dynamic`: the stream's dynamic metadata.
    pub const DYNAMIC: Self = Self(0);
    /// `_Route`: the matched route's `metadata.filter_metadata`.
    pub const ROUTE: Self = Self(1);
    /// `_Cluster`.
    pub const CLUSTER: Self = Self(2);
    /// `_Host`.
    pub const HOST: Self = Self(3);
    /// `_HostLocality`.
    pub const HOST_LOCALITY: Self = Self(4);
}

/// `envoy_dynamic_module_type_attribute_id` (only the values this filter reads).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttributeId(pub u32);
impl AttributeId {
    /// `_RequestPath` (`request.path`), kept as a cheap self-check of the numbering.
    pub const REQUEST_PATH: Self = Self(0);
    /// `_ResponseCodeDetails` (`response.code_details`).
    pub const RESPONSE_CODE_DETAILS: Self = Self(16);
    /// `_XdsRouteName` (`xds.route_name`).
    pub const XDS_ROUTE_NAME: Self = Self(61);
}

/// `envoy_dynamic_module_type_on_http_filter_request_headers_status` (= `Http::FilterHeadersStatus`).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestHeadersStatus(pub u32);
impl RequestHeadersStatus {
    /// `_Continue`.
    pub const CONTINUE: Self = Self(0);
    /// `_StopIteration`: hold the headers (later filters do not see them) until `continue_decoding`.
    pub const STOP_ITERATION: Self = Self(1);
    /// `_ContinueAndDontEndStream`.
    pub const CONTINUE_AND_DONT_END_STREAM: Self = Self(2);
    /// `_StopAllIterationAndBuffer`.
    pub const STOP_ALL_ITERATION_AND_BUFFER: Self = Self(3);
    /// `_StopAllIterationAndWatermark`.
    pub const STOP_ALL_ITERATION_AND_WATERMARK: Self = Self(4);
}

/// `envoy_dynamic_module_type_on_http_filter_request_body_status` (= `Http::FilterDataStatus`).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestBodyStatus(pub u32);
impl RequestBodyStatus {
    /// `_Continue`.
    pub const CONTINUE: Self = Self(0);
    /// `_StopIterationAndBuffer`: Envoy appends the chunk to the buffered body.
    pub const STOP_ITERATION_AND_BUFFER: Self = Self(1);
    /// `_StopIterationAndWatermark`.
    pub const STOP_ITERATION_AND_WATERMARK: Self = Self(2);
    /// `_StopIterationNoBuffer`.
    pub const STOP_ITERATION_NO_BUFFER: Self = Self(3);
}

/// `envoy_dynamic_module_type_on_http_filter_request_trailers_status` (= `Http::FilterTrailersStatus`).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestTrailersStatus(pub u32);
impl RequestTrailersStatus {
    /// `_Continue`.
    pub const CONTINUE: Self = Self(0);
    /// `_StopIteration`.
    pub const STOP_ITERATION: Self = Self(1);
}

/// `envoy_dynamic_module_type_on_http_filter_response_headers_status`: the same values as the request side's (one Envoy enum behind both).
pub type ResponseHeadersStatus = RequestHeadersStatus;

/// `envoy_dynamic_module_type_on_http_filter_response_body_status`: the same values as the request side's (one Envoy enum behind both).
pub type ResponseBodyStatus = RequestBodyStatus;

/// `envoy_dynamic_module_type_on_http_filter_response_trailers_status`: the same values as the request side's (one Envoy enum behind both).
pub type ResponseTrailersStatus = RequestTrailersStatus;

/// `envoy_dynamic_module_type_on_http_filter_local_reply_status` (= `Http::LocalErrorStatus`).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalReplyStatus(pub u32);
impl LocalReplyStatus {
    /// `_Continue`: send the local reply.
    pub const CONTINUE: Self = Self(0);
    /// `_ContinueAndResetStream`: reset the stream instead of replying.
    pub const CONTINUE_AND_RESET_STREAM: Self = Self(1);
}

// ------------------------------------------------------------------ callbacks (Envoy exports)

unsafe extern "C" {
    /// `envoy_dynamic_module_callback_log` (deprecated in favour of `log_v2`, still exported by 1.40).
    pub fn envoy_dynamic_module_callback_log(level: LogLevel, message: module_buffer);

    /// `envoy_dynamic_module_callback_log_enabled`.
    pub fn envoy_dynamic_module_callback_log_enabled(level: LogLevel) -> bool;

    /// `envoy_dynamic_module_callback_http_get_header`: value number `index` of `key`; the count
    /// of values goes to `optional_size` when it is non-null.
    pub fn envoy_dynamic_module_callback_http_get_header(
        filter: FilterEnvoyPtr,
        header_type: HeaderType,
        key: module_buffer,
        result: *mut envoy_buffer,
        index: usize,
        optional_size: *mut usize,
    ) -> bool;

    /// `envoy_dynamic_module_callback_http_set_header`: replaces every value of `key`; a null or
    /// empty `value` removes the header.
    pub fn envoy_dynamic_module_callback_http_set_header(
        filter: FilterEnvoyPtr,
        header_type: HeaderType,
        key: module_buffer,
        value: module_buffer,
    ) -> bool;

    /// `envoy_dynamic_module_callback_http_add_header`: appends one more value (an empty value is refused).
    pub fn envoy_dynamic_module_callback_http_add_header(
        filter: FilterEnvoyPtr,
        header_type: HeaderType,
        key: module_buffer,
        value: module_buffer,
    ) -> bool;

    /// `envoy_dynamic_module_callback_http_get_headers_size`: number of entries (0 if the map is absent).
    pub fn envoy_dynamic_module_callback_http_get_headers_size(
        filter: FilterEnvoyPtr,
        header_type: HeaderType,
    ) -> usize;

    /// `envoy_dynamic_module_callback_http_get_headers`: fills `result` (sized by `get_headers_size`).
    pub fn envoy_dynamic_module_callback_http_get_headers(
        filter: FilterEnvoyPtr,
        header_type: HeaderType,
        result: *mut envoy_http_header,
    ) -> bool;

    /// `envoy_dynamic_module_callback_http_get_body_chunks`: fills `result` (sized by `get_body_chunks_size`).
    pub fn envoy_dynamic_module_callback_http_get_body_chunks(
        filter: FilterEnvoyPtr,
        body_type: BodyType,
        result: *mut envoy_buffer,
    ) -> bool;

    /// `envoy_dynamic_module_callback_http_get_body_chunks_size`: number of slices (0 if absent).
    pub fn envoy_dynamic_module_callback_http_get_body_chunks_size(
        filter: FilterEnvoyPtr,
        body_type: BodyType,
    ) -> usize;

    /// `envoy_dynamic_module_callback_http_get_body_size`: total bytes (0 if absent).
    pub fn envoy_dynamic_module_callback_http_get_body_size(filter: FilterEnvoyPtr, body_type: BodyType) -> usize;

    /// `envoy_dynamic_module_callback_http_append_body`.
    pub fn envoy_dynamic_module_callback_http_append_body(
        filter: FilterEnvoyPtr,
        body_type: BodyType,
        data: module_buffer,
    ) -> bool;

    /// `envoy_dynamic_module_callback_http_drain_body`: drains `min(n, size)` bytes from the front.
    pub fn envoy_dynamic_module_callback_http_drain_body(filter: FilterEnvoyPtr, body_type: BodyType, n: usize)
        -> bool;

    /// `envoy_dynamic_module_callback_http_received_buffered_request_body`.
    pub fn envoy_dynamic_module_callback_http_received_buffered_request_body(filter: FilterEnvoyPtr) -> bool;

    /// `envoy_dynamic_module_callback_http_received_buffered_response_body`.
    pub fn envoy_dynamic_module_callback_http_received_buffered_response_body(filter: FilterEnvoyPtr) -> bool;

    /// `envoy_dynamic_module_callback_http_send_response`: local reply; `details` may be `NULL`
    /// (C: non-const `headers`; Envoy only reads it).
    pub fn envoy_dynamic_module_callback_http_send_response(
        filter: FilterEnvoyPtr,
        status_code: u32,
        headers: *const module_http_header,
        headers_len: usize,
        body: module_buffer,
        details: module_buffer,
    );

    /// `envoy_dynamic_module_callback_http_filter_continue_decoding`.
    pub fn envoy_dynamic_module_callback_http_filter_continue_decoding(filter: FilterEnvoyPtr);

    /// `envoy_dynamic_module_callback_http_filter_continue_encoding`.
    pub fn envoy_dynamic_module_callback_http_filter_continue_encoding(filter: FilterEnvoyPtr);

    /// `envoy_dynamic_module_callback_http_filter_http_callout`: Envoy picks the id and writes it
    /// to `callout_id_out` on success (C: non-const `headers`; Envoy only reads it).
    pub fn envoy_dynamic_module_callback_http_filter_http_callout(
        filter: FilterEnvoyPtr,
        callout_id_out: *mut u64,
        cluster_name: module_buffer,
        headers: *const module_http_header,
        headers_len: usize,
        body: module_buffer,
        timeout_ms: u64,
    ) -> HttpCalloutInitResult;

    /// `envoy_dynamic_module_callback_get_most_specific_route_config`: the pointer this module's
    /// `on_http_filter_per_route_config_new` returned for the matched route (null if none).
    pub fn envoy_dynamic_module_callback_get_most_specific_route_config(
        filter: FilterEnvoyPtr,
    ) -> PerRouteConfigModulePtr;

    /// `envoy_dynamic_module_callback_http_get_metadata_string`.
    pub fn envoy_dynamic_module_callback_http_get_metadata_string(
        filter: FilterEnvoyPtr,
        source: MetadataSource,
        namespace: module_buffer,
        key: module_buffer,
        result: *mut envoy_buffer,
    ) -> bool;

    /// `envoy_dynamic_module_callback_http_get_metadata_number`.
    pub fn envoy_dynamic_module_callback_http_get_metadata_number(
        filter: FilterEnvoyPtr,
        source: MetadataSource,
        namespace: module_buffer,
        key: module_buffer,
        result: *mut f64,
    ) -> bool;

    /// `envoy_dynamic_module_callback_http_get_metadata_keys_count`: how many keys `namespace` has (0 if absent).
    pub fn envoy_dynamic_module_callback_http_get_metadata_keys_count(
        filter: FilterEnvoyPtr,
        source: MetadataSource,
        namespace: module_buffer,
    ) -> usize;

    /// `envoy_dynamic_module_callback_http_get_metadata_keys`: fills `result` (sized by `get_metadata_keys_count`).
    pub fn envoy_dynamic_module_callback_http_get_metadata_keys(
        filter: FilterEnvoyPtr,
        source: MetadataSource,
        namespace: module_buffer,
        result: *mut envoy_buffer,
    ) -> bool;

    /// `envoy_dynamic_module_callback_http_filter_get_attribute_string`.
    pub fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
        filter: FilterEnvoyPtr,
        attribute: AttributeId,
        result: *mut envoy_buffer,
    ) -> bool;

    /// `envoy_dynamic_module_callback_http_filter_config_define_counter`: only inside
    /// `on_http_filter_config_new` (later: `FROZEN`); `label_names` may be null when `len` is 0.
    pub fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        config: FilterConfigEnvoyPtr,
        name: module_buffer,
        label_names: *const module_buffer,
        label_names_len: usize,
        counter_id_out: *mut usize,
    ) -> MetricsResult;

    /// `envoy_dynamic_module_callback_http_filter_config_scheduler_new`: a scheduler whose
    /// events reach `on_http_filter_config_scheduled` on the main thread (dropped once the
    /// configuration is gone). Call on the main thread, with the config pointer of `config_new`.
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(
        config: FilterConfigEnvoyPtr,
    ) -> ConfigSchedulerPtr;

    /// `envoy_dynamic_module_callback_http_filter_config_scheduler_commit`: post `event_id` to the
    /// main thread. Safe from any thread while the scheduler exists.
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
        scheduler: ConfigSchedulerPtr,
        event_id: u64,
    );

    /// `envoy_dynamic_module_callback_http_filter_config_scheduler_delete`.
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(scheduler: ConfigSchedulerPtr);

    /// `envoy_dynamic_module_callback_http_filter_config_http_callout`: as the stream's callout,
    /// made from the filter configuration on the main thread; its answer goes to
    /// `on_http_filter_config_http_callout_done`, and no stream's end cancels it.
    pub fn envoy_dynamic_module_callback_http_filter_config_http_callout(
        config: FilterConfigEnvoyPtr,
        callout_id_out: *mut u64,
        cluster_name: module_buffer,
        headers: *const module_http_header,
        headers_len: usize,
        body: module_buffer,
        timeout_ms: u64,
    ) -> HttpCalloutInitResult;

    /// `envoy_dynamic_module_callback_http_get_active_span`: the stream's span, or null when
    /// Envoy does not trace it (a `NullSpan`).
    pub fn envoy_dynamic_module_callback_http_get_active_span(filter: FilterEnvoyPtr) -> SpanEnvoyPtr;

    /// `envoy_dynamic_module_callback_http_span_get_trace_id`: the span's trace id (hex) into
    /// `result`, valid until the next tracing callback on this thread; `false` if it has none.
    pub fn envoy_dynamic_module_callback_http_span_get_trace_id(span: SpanEnvoyPtr, result: *mut envoy_buffer) -> bool;

    /// `envoy_dynamic_module_callback_http_span_get_span_id`: as `get_trace_id`, for the span's own id.
    pub fn envoy_dynamic_module_callback_http_span_get_span_id(span: SpanEnvoyPtr, result: *mut envoy_buffer) -> bool;

    /// `envoy_dynamic_module_callback_http_filter_reset_stream`: reset the downstream stream
    /// (`reason`: `StreamResetReason`; `details` goes to the access log's response details).
    pub fn envoy_dynamic_module_callback_http_filter_reset_stream(
        filter: FilterEnvoyPtr,
        reason: StreamResetReason,
        details: module_buffer,
    );

    /// `envoy_dynamic_module_callback_http_filter_increment_counter`: `label_values_len` must equal
    /// the number of label names given at definition.
    pub fn envoy_dynamic_module_callback_http_filter_increment_counter(
        filter: FilterEnvoyPtr,
        counter_id: usize,
        label_values: *const module_buffer,
        label_values_len: usize,
        value: u64,
    ) -> MetricsResult;
}

/// Every callback declared in the `extern "C"` block above, by symbol name.
pub const IMPORTED_CALLBACKS: &[&str] = &[
    "envoy_dynamic_module_callback_log",
    "envoy_dynamic_module_callback_log_enabled",
    "envoy_dynamic_module_callback_http_get_header",
    "envoy_dynamic_module_callback_http_set_header",
    "envoy_dynamic_module_callback_http_add_header",
    "envoy_dynamic_module_callback_http_get_headers_size",
    "envoy_dynamic_module_callback_http_get_headers",
    "envoy_dynamic_module_callback_http_get_body_chunks",
    "envoy_dynamic_module_callback_http_get_body_chunks_size",
    "envoy_dynamic_module_callback_http_get_body_size",
    "envoy_dynamic_module_callback_http_append_body",
    "envoy_dynamic_module_callback_http_drain_body",
    "envoy_dynamic_module_callback_http_received_buffered_request_body",
    "envoy_dynamic_module_callback_http_received_buffered_response_body",
    "envoy_dynamic_module_callback_http_send_response",
    "envoy_dynamic_module_callback_http_filter_continue_decoding",
    "envoy_dynamic_module_callback_http_filter_continue_encoding",
    "envoy_dynamic_module_callback_http_filter_http_callout",
    "envoy_dynamic_module_callback_get_most_specific_route_config",
    "envoy_dynamic_module_callback_http_get_metadata_string",
    "envoy_dynamic_module_callback_http_get_metadata_number",
    "envoy_dynamic_module_callback_http_get_metadata_keys_count",
    "envoy_dynamic_module_callback_http_get_metadata_keys",
    "envoy_dynamic_module_callback_http_filter_get_attribute_string",
    "envoy_dynamic_module_callback_http_filter_config_define_counter",
    "envoy_dynamic_module_callback_http_filter_increment_counter",
    "envoy_dynamic_module_callback_http_filter_config_scheduler_new",
    "envoy_dynamic_module_callback_http_filter_config_scheduler_commit",
    "envoy_dynamic_module_callback_http_filter_config_scheduler_delete",
    "envoy_dynamic_module_callback_http_filter_config_http_callout",
    "envoy_dynamic_module_callback_http_filter_reset_stream",
    "envoy_dynamic_module_callback_http_get_active_span",
    "envoy_dynamic_module_callback_http_span_get_trace_id",
    "envoy_dynamic_module_callback_http_span_get_span_id",
];

// ------------------------------------------------------------------ hooks (the module exports)

/// `envoy_dynamic_module_on_program_init`: returns `ABI_VERSION_NUL`'s pointer, or null to refuse loading.
pub type OnProgramInit = unsafe extern "C" fn() -> AbiVersionModulePtr;

/// `envoy_dynamic_module_on_http_filter_config_new`: `name` = `filter_name`, `config` = the
/// `filter_config` Any as bytes; both valid only during the call. Null rejects the config.
pub type OnHttpFilterConfigNew =
    unsafe extern "C" fn(FilterConfigEnvoyPtr, envoy_buffer, envoy_buffer) -> FilterConfigModulePtr;

/// `envoy_dynamic_module_on_http_filter_config_destroy`.
pub type OnHttpFilterConfigDestroy = unsafe extern "C" fn(FilterConfigModulePtr);

/// `envoy_dynamic_module_on_http_filter_per_route_config_new`: (name, config) of a
/// `DynamicModuleFilterPerRoute`; no Envoy pointer. Null rejects the route configuration.
pub type OnHttpFilterPerRouteConfigNew = unsafe extern "C" fn(envoy_buffer, envoy_buffer) -> PerRouteConfigModulePtr;

/// `envoy_dynamic_module_on_http_filter_per_route_config_destroy`.
pub type OnHttpFilterPerRouteConfigDestroy = unsafe extern "C" fn(PerRouteConfigModulePtr);

/// `envoy_dynamic_module_on_http_filter_new`: one per stream; null fails the stream.
pub type OnHttpFilterNew = unsafe extern "C" fn(FilterConfigModulePtr, FilterEnvoyPtr) -> FilterModulePtr;

/// `envoy_dynamic_module_on_http_filter_request_headers` (bool: end of stream).
pub type OnHttpFilterRequestHeaders =
    unsafe extern "C" fn(FilterEnvoyPtr, FilterModulePtr, bool) -> RequestHeadersStatus;

/// `envoy_dynamic_module_on_http_filter_request_body` (bool: end of stream).
pub type OnHttpFilterRequestBody = unsafe extern "C" fn(FilterEnvoyPtr, FilterModulePtr, bool) -> RequestBodyStatus;

/// `envoy_dynamic_module_on_http_filter_request_trailers`.
pub type OnHttpFilterRequestTrailers = unsafe extern "C" fn(FilterEnvoyPtr, FilterModulePtr) -> RequestTrailersStatus;

/// `envoy_dynamic_module_on_http_filter_response_headers` (bool: end of stream).
pub type OnHttpFilterResponseHeaders =
    unsafe extern "C" fn(FilterEnvoyPtr, FilterModulePtr, bool) -> ResponseHeadersStatus;

/// `envoy_dynamic_module_on_http_filter_response_body` (bool: end of stream).
pub type OnHttpFilterResponseBody = unsafe extern "C" fn(FilterEnvoyPtr, FilterModulePtr, bool) -> ResponseBodyStatus;

/// `envoy_dynamic_module_on_http_filter_response_trailers`.
pub type OnHttpFilterResponseTrailers = unsafe extern "C" fn(FilterEnvoyPtr, FilterModulePtr) -> ResponseTrailersStatus;

/// `envoy_dynamic_module_on_http_filter_stream_complete`: before `destroy` and before access logs.
pub type OnHttpFilterStreamComplete = unsafe extern "C" fn(FilterEnvoyPtr, FilterModulePtr);

/// `envoy_dynamic_module_on_http_filter_destroy`: the module frees its per-stream state.
pub type OnHttpFilterDestroy = unsafe extern "C" fn(FilterModulePtr);

/// `envoy_dynamic_module_on_http_filter_http_callout_done`: (callout id, result, response headers
/// + count, response body slices + count); arrays valid only during the call, null on failure.
pub type OnHttpFilterHttpCalloutDone = unsafe extern "C" fn(
    FilterEnvoyPtr,
    FilterModulePtr,
    u64,
    HttpCalloutResult,
    *const envoy_http_header,
    usize,
    *const envoy_buffer,
    usize,
);

/// `envoy_dynamic_module_on_http_filter_http_stream_headers`: (stream id, headers, count, end of stream).
pub type OnHttpFilterHttpStreamHeaders =
    unsafe extern "C" fn(FilterEnvoyPtr, FilterModulePtr, u64, *const envoy_http_header, usize, bool);

/// `envoy_dynamic_module_on_http_filter_http_stream_data`: (stream id, slices, count, end of stream).
pub type OnHttpFilterHttpStreamData =
    unsafe extern "C" fn(FilterEnvoyPtr, FilterModulePtr, u64, *const envoy_buffer, usize, bool);

/// `envoy_dynamic_module_on_http_filter_http_stream_trailers`: (stream id, trailers, count).
pub type OnHttpFilterHttpStreamTrailers =
    unsafe extern "C" fn(FilterEnvoyPtr, FilterModulePtr, u64, *const envoy_http_header, usize);

/// `envoy_dynamic_module_on_http_filter_http_stream_complete`: (stream id).
pub type OnHttpFilterHttpStreamComplete = unsafe extern "C" fn(FilterEnvoyPtr, FilterModulePtr, u64);

/// `envoy_dynamic_module_on_http_filter_http_stream_reset`: (stream id, reason).
pub type OnHttpFilterHttpStreamReset =
    unsafe extern "C" fn(FilterEnvoyPtr, FilterModulePtr, u64, HttpStreamResetReason);

/// `envoy_dynamic_module_on_http_filter_scheduled`: (event id given to `scheduler_commit`).
pub type OnHttpFilterScheduled = unsafe extern "C" fn(FilterEnvoyPtr, FilterModulePtr, u64);

/// `envoy_dynamic_module_on_http_filter_config_scheduled`: (event id), on the main thread.
pub type OnHttpFilterConfigScheduled = unsafe extern "C" fn(FilterConfigEnvoyPtr, FilterConfigModulePtr, u64);

/// `envoy_dynamic_module_on_http_filter_config_http_callout_done`: as `OnHttpFilterHttpCalloutDone`,
/// for callouts started from the filter config.
pub type OnHttpFilterConfigHttpCalloutDone = unsafe extern "C" fn(
    FilterConfigEnvoyPtr,
    FilterConfigModulePtr,
    u64,
    HttpCalloutResult,
    *const envoy_http_header,
    usize,
    *const envoy_buffer,
    usize,
);

/// `envoy_dynamic_module_on_http_filter_config_http_stream_headers`.
pub type OnHttpFilterConfigHttpStreamHeaders =
    unsafe extern "C" fn(FilterConfigEnvoyPtr, FilterConfigModulePtr, u64, *const envoy_http_header, usize, bool);

/// `envoy_dynamic_module_on_http_filter_config_http_stream_data`.
pub type OnHttpFilterConfigHttpStreamData =
    unsafe extern "C" fn(FilterConfigEnvoyPtr, FilterConfigModulePtr, u64, *const envoy_buffer, usize, bool);

/// `envoy_dynamic_module_on_http_filter_config_http_stream_trailers`.
pub type OnHttpFilterConfigHttpStreamTrailers =
    unsafe extern "C" fn(FilterConfigEnvoyPtr, FilterConfigModulePtr, u64, *const envoy_http_header, usize);

/// `envoy_dynamic_module_on_http_filter_config_http_stream_complete`.
pub type OnHttpFilterConfigHttpStreamComplete = unsafe extern "C" fn(FilterConfigEnvoyPtr, FilterConfigModulePtr, u64);

/// `envoy_dynamic_module_on_http_filter_config_http_stream_reset`.
pub type OnHttpFilterConfigHttpStreamReset =
    unsafe extern "C" fn(FilterConfigEnvoyPtr, FilterConfigModulePtr, u64, HttpStreamResetReason);

/// `envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark`.
pub type OnHttpFilterDownstreamAboveWriteBufferHighWatermark = unsafe extern "C" fn(FilterEnvoyPtr, FilterModulePtr);

/// `envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark`.
pub type OnHttpFilterDownstreamBelowWriteBufferLowWatermark = unsafe extern "C" fn(FilterEnvoyPtr, FilterModulePtr);

/// `envoy_dynamic_module_on_http_filter_local_reply`: (status code, details, reset imminent).
pub type OnHttpFilterLocalReply =
    unsafe extern "C" fn(FilterEnvoyPtr, FilterModulePtr, u32, envoy_buffer, bool) -> LocalReplyStatus;

/// Hooks Envoy 1.40 insists on: a module lacking one fails to load (`program_init`) or its
/// filter / per-route configuration is rejected. The per-route pair is only looked up when a
/// route carries a `DynamicModuleFilterPerRoute` for this module.
pub const REQUIRED_HOOKS: &[&str] = &[
    "envoy_dynamic_module_on_program_init",
    "envoy_dynamic_module_on_http_filter_config_new",
    "envoy_dynamic_module_on_http_filter_config_destroy",
    "envoy_dynamic_module_on_http_filter_per_route_config_new",
    "envoy_dynamic_module_on_http_filter_per_route_config_destroy",
    "envoy_dynamic_module_on_http_filter_new",
    "envoy_dynamic_module_on_http_filter_request_headers",
    "envoy_dynamic_module_on_http_filter_request_body",
    "envoy_dynamic_module_on_http_filter_request_trailers",
    "envoy_dynamic_module_on_http_filter_response_headers",
    "envoy_dynamic_module_on_http_filter_response_body",
    "envoy_dynamic_module_on_http_filter_response_trailers",
    "envoy_dynamic_module_on_http_filter_stream_complete",
    "envoy_dynamic_module_on_http_filter_destroy",
    "envoy_dynamic_module_on_http_filter_http_callout_done",
    "envoy_dynamic_module_on_http_filter_http_stream_headers",
    "envoy_dynamic_module_on_http_filter_http_stream_data",
    "envoy_dynamic_module_on_http_filter_http_stream_trailers",
    "envoy_dynamic_module_on_http_filter_http_stream_complete",
    "envoy_dynamic_module_on_http_filter_http_stream_reset",
    "envoy_dynamic_module_on_http_filter_scheduled",
    "envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark",
    "envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark",
];

/// Hooks Envoy 1.40 looks up for an HTTP filter but tolerates missing (the event is then
/// simply not delivered). Exporting them anyway costs nothing.
pub const OPTIONAL_HOOKS: &[&str] = &[
    "envoy_dynamic_module_on_http_filter_config_scheduled",
    "envoy_dynamic_module_on_http_filter_config_http_callout_done",
    "envoy_dynamic_module_on_http_filter_config_http_stream_headers",
    "envoy_dynamic_module_on_http_filter_config_http_stream_data",
    "envoy_dynamic_module_on_http_filter_config_http_stream_trailers",
    "envoy_dynamic_module_on_http_filter_config_http_stream_complete",
    "envoy_dynamic_module_on_http_filter_config_http_stream_reset",
    "envoy_dynamic_module_on_http_filter_local_reply",
];
