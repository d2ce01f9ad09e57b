//! The `envoy_dynamic_module_on_*` functions Envoy 1.40 calls. Each one finds
//! the module's object behind the pointer Envoy hands back, runs inside
//! `catch_unwind` (a panic must never unwind into Envoy), and passes the event
//! to the adapter's `Stream`, as `src/context.rs` does for proxy-wasm.
//!
//! The `const _: abi::On… = …` lines make the compiler check each hook against
//! the signature written down in `abi.rs`: Envoy itself never checks them.

use crate::abi::{
    self, envoy_buffer, envoy_http_header, AbiVersionModulePtr, FilterConfigEnvoyPtr, FilterConfigModulePtr,
    FilterEnvoyPtr, FilterModulePtr, HeaderType, HttpCalloutResult, HttpStreamResetReason, LocalReplyStatus,
    PerRouteConfigModulePtr, RequestBodyStatus, RequestHeadersStatus, RequestTrailersStatus, ResponseBodyStatus,
    ResponseHeadersStatus, ResponseTrailersStatus,
};
use crate::config::{annotation_pairs, FilterConfig, RouteConfig};
use crate::envoy_stream::{Direction, EnvoyStream};
use crate::host::NativeHost;
use crate::log::log;
use idem_adapter::{trace_id, Action, Refusal, Stream};
use idem_core::machine::CalloutAnswer;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// One stream's filter.
struct Filter {
    /// The adapter's stream; `None` when this stream has no usable filter (the worker could not
    /// rebuild its configuration, or making the stream panicked): every hook then refuses it.
    stream: Option<Stream<NativeHost>>,
    /// The configuration the stream was made from (for the refusal's words).
    config: *const FilterConfig,
    /// The stream was refused (answered or reset): nothing more is done with it.
    refused: bool,
    /// The answer reached this filter: a refusal from here on is a reset.
    responding: bool,
}

/// Which half of the stream a hook belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Half {
    Request,
    Response,
}

/// `f`'s value, or `None` if it panicked: the panic stops here, never unwinding into Envoy.
pub fn caught<T>(f: impl FnOnce() -> T) -> Option<T> {
    catch_unwind(AssertUnwindSafe(f)).ok()
}

/// Run `f`; a panic is logged and becomes `fallback()` (the configuration's hooks).
fn guard<T>(what: &str, f: impl FnOnce() -> T, fallback: impl FnOnce() -> T) -> T {
    caught(f).unwrap_or_else(|| {
        log(abi::LogLevel::ERROR, &format!("agent_idempotency: internal error in {what}"));
        fallback()
    })
}

/// Every hook of one stream: find its filter, hand the event to its stream, and refuse the stream
/// when there is no usable filter or the stream panicked (DESIGN §6: every host fails closed).
/// `hold` is the hook's status that keeps the stream where it is, `go` the one that lets it on.
/// Once refused, the request's hooks hold (nothing more reaches the upstream) and the answer's
/// let it on (that answer is the refusal itself).
fn on_stream<T>(
    what: &str,
    envoy: FilterEnvoyPtr,
    module: FilterModulePtr,
    half: Half,
    (hold, go): (T, T),
    f: impl FnOnce(&mut Stream<NativeHost>) -> T,
) -> T {
    // SAFETY: `module` is a pointer `on_http_filter_new` returned and `on_http_filter_destroy` has
    // not freed; Envoy calls one stream's hooks on one thread, never concurrently.
    let Some(filter) = (unsafe { module.cast_mut().cast::<Filter>().as_mut() }) else {
        // `on_http_filter_new` never returns null; should Envoy hand one anyway, the request is
        // refused and the answer (that refusal) goes on.
        if half == Half::Request {
            refuse_with_reply(envoy, Refusal::unconfigured(), what);
            return hold;
        }
        return go;
    };
    if filter.refused {
        return if half == Half::Request { hold } else { go };
    }
    if half == Half::Response {
        filter.responding = true;
    }
    let Some(stream) = filter.stream.as_mut() else {
        refuse(filter, envoy, what);
        return hold;
    };
    match caught(|| f(stream)) {
        Some(v) => v,
        None => {
            log(abi::LogLevel::ERROR, &format!("agent_idempotency: internal error in {what}"));
            refuse(filter, envoy, what);
            hold
        }
    }
}

/// Refuse a stream with no usable filter. Before the upstream's answer began: the reply of a
/// stream no filter can judge (503 `status_unavailable`: retryable, and it does not claim nothing
/// ran). Once it began, a local reply is no longer possible: reset the stream, as Envoy's own
/// Rust SDK does (the client sees a reset: not an answer, never "nothing ran").
fn refuse(filter: &mut Filter, envoy: FilterEnvoyPtr, what: &str) {
    filter.refused = true;
    // SAFETY: alive for as long as any stream of it (`on_http_filter_new`).
    let config = unsafe { filter.config.as_ref() };
    if filter.responding {
        log(abi::LogLevel::ERROR, &format!("agent_idempotency: no usable filter at {what}; the stream is reset"));
        // SAFETY: the pointer Envoy handed to this hook of this live stream, used within it.
        let _ = caught(|| unsafe { EnvoyStream::new(envoy) }.reset("agent_idempotency_refused"));
        return;
    }
    refuse_with_reply(envoy, config.map_or_else(Refusal::unconfigured, |c| c.refusal), what);
}

/// Answer the stream with the refusal, in the configuration's words where there is one.
fn refuse_with_reply(envoy: FilterEnvoyPtr, refusal: Refusal, what: &str) {
    log(abi::LogLevel::ERROR, &format!("agent_idempotency: no usable filter at {what}; the stream is refused"));
    let _ = caught(|| {
        // SAFETY: the pointer Envoy handed to this hook of this live stream, used within it.
        let envoy = unsafe { EnvoyStream::new(envoy) };
        let trace = trace_id(|name| envoy.header(HeaderType::REQUEST_HEADER, name));
        let reply = refusal.reply(&trace);
        envoy.send_response(reply.http_status, &reply.headers, &reply.body, "agent_idempotency_refused");
    });
}

/// The (hold, go) statuses of the headers and trailers hooks (request and response share Envoy's
/// status values: `abi.rs` aliases them).
const HEADERS: (RequestHeadersStatus, RequestHeadersStatus) =
    (RequestHeadersStatus::STOP_ITERATION, RequestHeadersStatus::CONTINUE);
const TRAILERS: (RequestTrailersStatus, RequestTrailersStatus) =
    (RequestTrailersStatus::STOP_ITERATION, RequestTrailersStatus::CONTINUE);

/// Request and response share Envoy's status values (`abi.rs` aliases them).
fn headers_status(a: Action) -> RequestHeadersStatus {
    match a {
        Action::Continue => RequestHeadersStatus::CONTINUE,
        // Headers are held while the body still reaches this filter (proxy-wasm's Pause).
        Action::Pause => RequestHeadersStatus::STOP_ITERATION,
    }
}

fn trailers_status(a: Action) -> RequestTrailersStatus {
    match a {
        Action::Continue => RequestTrailersStatus::CONTINUE,
        Action::Pause => RequestTrailersStatus::STOP_ITERATION,
    }
}

fn body_status(a: Action) -> RequestBodyStatus {
    match a {
        Action::Continue => RequestBodyStatus::CONTINUE,
        Action::Pause => RequestBodyStatus::STOP_ITERATION_AND_BUFFER,
    }
}

/// A chunk of either body, handed to the adapter with the size of all of it so far.
fn body_hook(envoy: FilterEnvoyPtr, module: FilterModulePtr, end_of_stream: bool, d: Direction) -> RequestBodyStatus {
    let (what, half) = match d {
        Direction::Request => ("the request body", Half::Request),
        Direction::Response => ("the response body", Half::Response),
    };
    on_stream(
        what,
        envoy,
        module,
        half,
        (RequestBodyStatus::STOP_ITERATION_NO_BUFFER, RequestBodyStatus::CONTINUE),
        |stream| {
            // Nothing to do: skip reading the body's size (three calls into Envoy per chunk).
            if stream.passes() {
                return RequestBodyStatus::CONTINUE;
            }
            stream.host_mut().in_body_hook = true;
            let size = stream.host().body_size(d);
            let action = match d {
                Direction::Request => stream.on_request_body(size, end_of_stream),
                Direction::Response => stream.on_response_body(size, end_of_stream),
            };
            stream.host_mut().in_body_hook = false;
            body_status(action)
        },
    )
}

// ------------------------------------------------------------------ module and configurations

static ABI_VERSION: &[u8] = abi::ABI_VERSION_NUL;

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> AbiVersionModulePtr {
    ABI_VERSION.as_ptr().cast()
}
const _: abi::OnProgramInit = envoy_dynamic_module_on_program_init;

/// # Safety
/// Envoy's buffers, valid for the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    envoy: FilterConfigEnvoyPtr,
    _name: envoy_buffer,
    config: envoy_buffer,
) -> FilterConfigModulePtr {
    guard(
        "the filter configuration",
        || {
            // SAFETY: lent for this call; copied by FilterConfig::new.
            let bytes = unsafe { config.as_bytes() };
            let mut define = |name: &str| {
                let mut id = 0usize;
                // SAFETY: Envoy's config pointer, inside the config hook (the only place counters may be defined).
                let r = unsafe {
                    abi::envoy_dynamic_module_callback_http_filter_config_define_counter(
                        envoy,
                        abi::module_buffer::new(name.as_bytes()),
                        std::ptr::null(),
                        0,
                        &mut id,
                    )
                };
                (r == abi::MetricsResult::SUCCESS).then_some(id)
            };
            match FilterConfig::new(bytes, &mut define, envoy) {
                Ok(c) => {
                    log(abi::LogLevel::INFO, "agent_idempotency: configured (native module)");
                    Box::into_raw(Box::new(c)).cast_const().cast()
                }
                Err(e) => {
                    // A null pointer makes Envoy refuse the configuration: better than running without idempotency.
                    log(abi::LogLevel::ERROR, &format!("agent_idempotency: invalid plugin configuration: {e}"));
                    std::ptr::null()
                }
            }
        },
        std::ptr::null,
    )
}
const _: abi::OnHttpFilterConfigNew = envoy_dynamic_module_on_http_filter_config_new;

/// # Safety
/// A pointer `on_http_filter_config_new` returned, freed once.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: FilterConfigModulePtr) {
    if !config.is_null() {
        // SAFETY: made by Box::into_raw in the config hook; Envoy destroys it once. Dropping it joins
        // the lease ticker: a panic there must stop here too.
        let _ = caught(|| drop(unsafe { Box::from_raw(config.cast_mut().cast::<FilterConfig>()) }));
    }
}
const _: abi::OnHttpFilterConfigDestroy = envoy_dynamic_module_on_http_filter_config_destroy;

/// # Safety
/// Envoy's buffers, valid for the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_new(
    _name: envoy_buffer,
    config: envoy_buffer,
) -> PerRouteConfigModulePtr {
    guard(
        "a per-route configuration",
        || {
            // SAFETY: lent for this call; annotation_pairs copies what it keeps.
            match annotation_pairs(unsafe { config.as_bytes() }) {
                Ok(annotation) => Box::into_raw(Box::new(RouteConfig { annotation })).cast_const().cast(),
                Err(e) => {
                    log(abi::LogLevel::ERROR, &format!("agent_idempotency: {e}"));
                    std::ptr::null()
                }
            }
        },
        std::ptr::null,
    )
}
const _: abi::OnHttpFilterPerRouteConfigNew = envoy_dynamic_module_on_http_filter_per_route_config_new;

/// # Safety
/// A pointer `on_http_filter_per_route_config_new` returned, freed once.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_destroy(config: PerRouteConfigModulePtr) {
    if !config.is_null() {
        // SAFETY: made by Box::into_raw in the per-route hook; Envoy destroys it once.
        let _ = caught(|| drop(unsafe { Box::from_raw(config.cast_mut().cast::<RouteConfig>()) }));
    }
}
const _: abi::OnHttpFilterPerRouteConfigDestroy = envoy_dynamic_module_on_http_filter_per_route_config_destroy;

// ------------------------------------------------------------------ one stream

/// Never null: a stream this worker cannot make a filter for (its configuration cannot be
/// rebuilt, or making the stream panicked) gets a filter without a stream, which refuses it.
///
/// # Safety
/// `config` is a pointer `on_http_filter_config_new` returned.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config: FilterConfigModulePtr,
    envoy: FilterEnvoyPtr,
) -> FilterModulePtr {
    let config = config.cast::<FilterConfig>();
    let stream = caught(|| {
        // SAFETY: alive for as long as any stream of it.
        let shared = (unsafe { config.as_ref() }).and_then(FilterConfig::shared)?;
        // SAFETY: Envoy's pointer for this new stream; the handle lives in the filter Envoy
        // destroys with the stream, and is used only inside that stream's hooks.
        let envoy = unsafe { EnvoyStream::new(envoy) };
        // SAFETY: `config` made this stream and outlives it.
        Some(Stream::new(shared, unsafe { NativeHost::new(envoy, config) }))
    })
    .flatten();
    Box::into_raw(Box::new(Filter { stream, config, refused: false, responding: false })).cast_const().cast()
}
const _: abi::OnHttpFilterNew = envoy_dynamic_module_on_http_filter_new;

/// # Safety
/// A pointer `on_http_filter_new` returned, freed once.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_destroy(filter: FilterModulePtr) {
    if !filter.is_null() {
        // SAFETY: made by Box::into_raw in on_http_filter_new; Envoy destroys it once.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(filter.cast_mut().cast::<Filter>()) })));
    }
}
const _: abi::OnHttpFilterDestroy = envoy_dynamic_module_on_http_filter_destroy;

/// # Safety
/// `module` is this stream's filter.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    envoy: FilterEnvoyPtr,
    module: FilterModulePtr,
    end_of_stream: bool,
) -> RequestHeadersStatus {
    on_stream("request headers", envoy, module, Half::Request, HEADERS, |s| {
        headers_status(s.on_request_headers(end_of_stream))
    })
}
const _: abi::OnHttpFilterRequestHeaders = envoy_dynamic_module_on_http_filter_request_headers;

/// # Safety
/// `module` is this stream's filter.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    envoy: FilterEnvoyPtr,
    module: FilterModulePtr,
    end_of_stream: bool,
) -> RequestBodyStatus {
    body_hook(envoy, module, end_of_stream, Direction::Request)
}
const _: abi::OnHttpFilterRequestBody = envoy_dynamic_module_on_http_filter_request_body;

/// # Safety
/// Called by Envoy.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    envoy: FilterEnvoyPtr,
    module: FilterModulePtr,
) -> RequestTrailersStatus {
    // The request's end of stream when it has trailers: continuing here would release a held
    // request the machine has not judged (DESIGN §6).
    on_stream("request trailers", envoy, module, Half::Request, TRAILERS, |s| trailers_status(s.on_request_trailers()))
}
const _: abi::OnHttpFilterRequestTrailers = envoy_dynamic_module_on_http_filter_request_trailers;

/// # Safety
/// `module` is this stream's filter.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    envoy: FilterEnvoyPtr,
    module: FilterModulePtr,
    end_of_stream: bool,
) -> ResponseHeadersStatus {
    on_stream("response headers", envoy, module, Half::Response, HEADERS, |s| {
        headers_status(s.on_response_headers(end_of_stream))
    })
}
const _: abi::OnHttpFilterResponseHeaders = envoy_dynamic_module_on_http_filter_response_headers;

/// # Safety
/// `module` is this stream's filter.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    envoy: FilterEnvoyPtr,
    module: FilterModulePtr,
    end_of_stream: bool,
) -> ResponseBodyStatus {
    body_hook(envoy, module, end_of_stream, Direction::Response)
}
const _: abi::OnHttpFilterResponseBody = envoy_dynamic_module_on_http_filter_response_body;

/// # Safety
/// Called by Envoy.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    envoy: FilterEnvoyPtr,
    module: FilterModulePtr,
) -> ResponseTrailersStatus {
    on_stream("response trailers", envoy, module, Half::Response, TRAILERS, |s| {
        trailers_status(s.on_response_trailers())
    })
}
const _: abi::OnHttpFilterResponseTrailers = envoy_dynamic_module_on_http_filter_response_trailers;

/// # Safety
/// Called by Envoy.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    _envoy: FilterEnvoyPtr,
    _module: FilterModulePtr,
) {
}
const _: abi::OnHttpFilterStreamComplete = envoy_dynamic_module_on_http_filter_stream_complete;

/// The answer to a callout to idemd: copied out of Envoy's arrays, then handed to the adapter.
///
/// # Safety
/// `module` is this stream's filter; the arrays are Envoy's, valid for the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    envoy: FilterEnvoyPtr,
    module: FilterModulePtr,
    callout_id: u64,
    result: HttpCalloutResult,
    headers: *const envoy_http_header,
    headers_len: usize,
    chunks: *const envoy_buffer,
    chunks_len: usize,
) {
    // Either half's callout: a refusal is a reply or a reset by whether the answer began.
    on_stream("a callout answer", envoy, module, Half::Request, ((), ()), |s| {
        // SAFETY: Envoy's arrays of the given lengths, valid for this call.
        let answer = unsafe { callout_answer(result, headers, headers_len, chunks, chunks_len) };
        let answered = usize::from(answer.status.is_some());
        s.host_mut().answer = Some(answer);
        s.on_callout_answer(callout_id, answered, 0);
        s.host_mut().answer = None;
        // Last, and with `s` no longer used: Envoy re-enters this filter's hooks from inside the resume.
        if let Some(direction) = s.host_mut().take_resume() {
            // SAFETY: the pointer Envoy handed to this hook of this live stream, used within it.
            unsafe { EnvoyStream::new(envoy) }.resume(direction);
        }
    })
}
const _: abi::OnHttpFilterHttpCalloutDone = envoy_dynamic_module_on_http_filter_http_callout_done;

/// A callout's answer, copied out of Envoy's arrays (a failed callout, or one without headers, is
/// `CalloutAnswer::failed`).
///
/// # Safety
/// Arrays of the given lengths (or null), valid for the call.
unsafe fn callout_answer(
    result: HttpCalloutResult,
    headers: *const envoy_http_header,
    headers_len: usize,
    chunks: *const envoy_buffer,
    chunks_len: usize,
) -> CalloutAnswer {
    if result != HttpCalloutResult::SUCCESS || headers.is_null() || headers_len == 0 {
        return CalloutAnswer::failed();
    }
    // SAFETY: see above.
    let headers = unsafe { std::slice::from_raw_parts(headers, headers_len) };
    let status = headers.iter().find_map(|h| {
        let key = envoy_buffer { ptr: h.key_ptr, len: h.key_len };
        // SAFETY: lent for the call.
        let key = unsafe { key.as_bytes() };
        (key == b":status").then(|| {
            let v = envoy_buffer { ptr: h.value_ptr, len: h.value_len };
            // SAFETY: lent for the call.
            let v = unsafe { v.as_bytes() };
            std::str::from_utf8(v).ok().and_then(|s| s.parse().ok())
        })?
    });
    let mut body = Vec::new();
    if !chunks.is_null() {
        // SAFETY: see above.
        for c in unsafe { std::slice::from_raw_parts(chunks, chunks_len) } {
            // SAFETY: lent for the call; copied at once.
            body.extend_from_slice(unsafe { c.as_bytes() });
        }
    }
    CalloutAnswer { status, body }
}

// ------------------------------------------------------------------ the configuration, on the main thread

/// A scheduled event of the configuration: a lease tick, or reports queued by a stream.
///
/// # Safety
/// `config` is a pointer `on_http_filter_config_new` returned, not yet destroyed.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    _envoy: FilterConfigEnvoyPtr,
    config: FilterConfigModulePtr,
    event: u64,
) {
    // SAFETY: see above; the main thread is the only one calling the configuration's hooks.
    let Some(config) = (unsafe { config.cast::<FilterConfig>().as_ref() }) else { return };
    guard("a scheduled event", || config.main.on_event(event), || ());
}
const _: abi::OnHttpFilterConfigScheduled = envoy_dynamic_module_on_http_filter_config_scheduled;

/// The answer to a callout of the configuration (a renewal or a report).
///
/// # Safety
/// `config` as above; the arrays are Envoy's, valid for the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
    _envoy: FilterConfigEnvoyPtr,
    config: FilterConfigModulePtr,
    callout_id: u64,
    result: HttpCalloutResult,
    headers: *const envoy_http_header,
    headers_len: usize,
    chunks: *const envoy_buffer,
    chunks_len: usize,
) {
    // SAFETY: see above.
    let Some(config) = (unsafe { config.cast::<FilterConfig>().as_ref() }) else { return };
    guard(
        "a configuration callout's answer",
        || {
            // SAFETY: Envoy's arrays of the given lengths, valid for this call.
            let answer = unsafe { callout_answer(result, headers, headers_len, chunks, chunks_len) };
            config.main.on_answer(callout_id, &answer);
        },
        || (),
    );
}
const _: abi::OnHttpFilterConfigHttpCalloutDone = envoy_dynamic_module_on_http_filter_config_http_callout_done;

// ------------------------------------------------------------------ events this filter never asks for

/// # Safety
/// Called by Envoy.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _: FilterEnvoyPtr,
    _: FilterModulePtr,
    _: u64,
    _: *const envoy_http_header,
    _: usize,
    _: bool,
) {
}
const _: abi::OnHttpFilterHttpStreamHeaders = envoy_dynamic_module_on_http_filter_http_stream_headers;

/// # Safety
/// Called by Envoy.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _: FilterEnvoyPtr,
    _: FilterModulePtr,
    _: u64,
    _: *const envoy_buffer,
    _: usize,
    _: bool,
) {
}
const _: abi::OnHttpFilterHttpStreamData = envoy_dynamic_module_on_http_filter_http_stream_data;

/// # Safety
/// Called by Envoy.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _: FilterEnvoyPtr,
    _: FilterModulePtr,
    _: u64,
    _: *const envoy_http_header,
    _: usize,
) {
}
const _: abi::OnHttpFilterHttpStreamTrailers = envoy_dynamic_module_on_http_filter_http_stream_trailers;

/// # Safety
/// Called by Envoy.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(
    _: FilterEnvoyPtr,
    _: FilterModulePtr,
    _: u64,
) {
}
const _: abi::OnHttpFilterHttpStreamComplete = envoy_dynamic_module_on_http_filter_http_stream_complete;

/// # Safety
/// Called by Envoy.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _: FilterEnvoyPtr,
    _: FilterModulePtr,
    _: u64,
    _: HttpStreamResetReason,
) {
}
const _: abi::OnHttpFilterHttpStreamReset = envoy_dynamic_module_on_http_filter_http_stream_reset;

/// # Safety
/// Called by Envoy.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(_: FilterEnvoyPtr, _: FilterModulePtr, _: u64) {}
const _: abi::OnHttpFilterScheduled = envoy_dynamic_module_on_http_filter_scheduled;

/// # Safety
/// Called by Envoy.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _: FilterEnvoyPtr,
    _: FilterModulePtr,
) {
}
const _: abi::OnHttpFilterDownstreamAboveWriteBufferHighWatermark =
    envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark;

/// # Safety
/// Called by Envoy.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _: FilterEnvoyPtr,
    _: FilterModulePtr,
) {
}
const _: abi::OnHttpFilterDownstreamBelowWriteBufferLowWatermark =
    envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark;

/// # Safety
/// Called by Envoy.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_local_reply(
    _: FilterEnvoyPtr,
    _: FilterModulePtr,
    _: u32,
    _: envoy_buffer,
    _: bool,
) -> LocalReplyStatus {
    LocalReplyStatus::CONTINUE
}
const _: abi::OnHttpFilterLocalReply = envoy_dynamic_module_on_http_filter_local_reply;
