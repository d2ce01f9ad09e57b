//! Host calls that report failure instead of panicking.
//!
//! The SDK's trait helpers `unwrap()` every host status; a panic kills the VM
//! (and with it every stream on this worker), so the filter path goes through
//! these wrappers and logs what the host refused.

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType};
use std::time::{Duration, UNIX_EPOCH};

fn warn_on_err<T>(what: &str, r: Result<T, proxy_wasm::types::Status>) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(status) => {
            log::warn!("host call {what} failed: {status:?}");
            None
        }
    }
}

pub fn property(path: &[&str]) -> Option<Vec<u8>> {
    hostcalls::get_property(path.to_vec()).ok().flatten()
}

pub fn property_string(path: &[&str]) -> Option<String> {
    property(path).and_then(|b| String::from_utf8(b).ok())
}

pub fn request_header(name: &str) -> Option<String> {
    hostcalls::get_map_value(MapType::HttpRequestHeaders, name).ok().flatten()
}

pub fn set_request_header(name: &str, value: &str) {
    warn_on_err("set request header", hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value)));
}

pub fn response_header(name: &str) -> Option<String> {
    hostcalls::get_map_value(MapType::HttpResponseHeaders, name).ok().flatten()
}

/// The response's HTTP status; 0 if the host cannot tell.
pub fn response_status() -> u16 {
    response_header(":status").and_then(|s| s.parse().ok()).unwrap_or(0)
}

pub fn response_headers() -> Vec<(String, String)> {
    hostcalls::get_map(MapType::HttpResponseHeaders).unwrap_or_default()
}

pub fn set_response_header(name: &str, value: &str) {
    warn_on_err("set response header", hostcalls::set_map_value(MapType::HttpResponseHeaders, name, Some(value)));
}

pub fn remove_response_header(name: &str) {
    warn_on_err("remove response header", hostcalls::remove_map_value(MapType::HttpResponseHeaders, name));
}

pub fn request_body(size: usize) -> Vec<u8> {
    hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size).ok().flatten().unwrap_or_default()
}

pub fn response_body(size: usize) -> Vec<u8> {
    hostcalls::get_buffer(BufferType::HttpResponseBody, 0, size).ok().flatten().unwrap_or_default()
}

pub fn replace_response_body(old_size: usize, body: &[u8]) {
    warn_on_err("set response body", hostcalls::set_buffer(BufferType::HttpResponseBody, 0, old_size, body));
}

pub fn plugin_configuration() -> Vec<u8> {
    hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX).ok().flatten().unwrap_or_default()
}

pub fn call_response_status() -> Option<u16> {
    hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status")
        .ok()
        .flatten()
        .and_then(|s| s.parse().ok())
}

pub fn call_response_body(size: usize) -> Vec<u8> {
    hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, size).ok().flatten().unwrap_or_default()
}

pub fn send_reply(status: u16, headers: &[(String, String)], body: &[u8]) {
    let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    warn_on_err("send local reply", hostcalls::send_http_response(u32::from(status), headers, Some(body)));
}

pub fn resume_request() {
    warn_on_err("resume request", hostcalls::resume_http_request());
}

pub fn resume_response() {
    warn_on_err("resume response", hostcalls::resume_http_response());
}

pub fn dispatch(
    cluster: &str,
    headers: Vec<(&str, &str)>,
    body: Option<&[u8]>,
    timeout: Duration,
) -> Option<u32> {
    warn_on_err("dispatch_http_call", hostcalls::dispatch_http_call(cluster, headers, body, vec![], timeout))
}

/// Unix seconds by the host's clock (0 if the host cannot tell, which makes every fingerprint look expired: fail safe).
pub fn now_unix_s() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
