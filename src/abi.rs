//! The proxy-wasm host calls the filter makes, declared here against the ABI itself, so that no
//! status and no byte a host or a client chooses can panic the VM.
//!
//! Why not the SDK's `proxy_wasm::hostcalls`: every one of its functions `panic!`s on a status it
//! does not expect (`set_buffer` on anything but `Ok`: a response body replaced from the headers
//! callback, where Envoy has no body, killed the VM), and its string getters (`get_map`,
//! `get_map_value`, the trait helpers such as `get_http_request_header`) `unwrap()`
//! `String::from_utf8` of a header a client sent. Those panics are inside the SDK, where the
//! workspace's `unwrap_used`/`panic` lints never look; `clippy.toml` now disallows calling them
//! (`disallowed-methods`), and this module is the one way in. Every function here returns the
//! host's status as an error; nothing in it can panic.
//!
//! The exception is `dispatch_http_call`, which stays the SDK's: it registers the callout's token
//! with the SDK's dispatcher, which routes the answer back to the stream. It panics only on a
//! status Envoy never returns for that call (it answers `Ok`, `BadArgument` or `InternalFailure`).

#![allow(unsafe_code)]

/// A host status other than `Ok` (proxy-wasm ABI 0.2.1 numbering: 1 not found, 2 bad argument, …).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Status(pub u32);

const OK: u32 = 0;
const NOT_FOUND: u32 = 1;
const EMPTY: u32 = 7;

pub const REQUEST_HEADERS: u32 = 0;
pub const RESPONSE_HEADERS: u32 = 2;
pub const CALL_RESPONSE_HEADERS: u32 = 6;

pub const REQUEST_BODY: u32 = 0;
pub const RESPONSE_BODY: u32 = 1;
pub const CALL_RESPONSE_BODY: u32 = 4;
pub const PLUGIN_CONFIGURATION: u32 = 7;

/// A header map's entries: names and values as bytes, in the host's order.
pub type Pairs = Vec<(Vec<u8>, Vec<u8>)>;

#[cfg(target_arch = "wasm32")]
pub use calls::*;

#[cfg(target_arch = "wasm32")]
mod calls {
    use super::*;
    use std::ptr::{null, null_mut};

    #[link(wasm_import_module = "env")]
    extern "C" {
        fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
        fn proxy_get_buffer_bytes(
            buffer_type: u32,
            start: usize,
            max_size: usize,
            return_buffer_data: *mut *mut u8,
            return_buffer_size: *mut usize,
        ) -> u32;
        fn proxy_set_buffer_bytes(
            buffer_type: u32,
            start: usize,
            size: usize,
            buffer_data: *const u8,
            buffer_size: usize,
        ) -> u32;
        fn proxy_get_header_map_pairs(map_type: u32, return_map_data: *mut *mut u8, return_map_size: *mut usize)
            -> u32;
        fn proxy_get_header_map_value(
            map_type: u32,
            key_data: *const u8,
            key_size: usize,
            return_value_data: *mut *mut u8,
            return_value_size: *mut usize,
        ) -> u32;
        fn proxy_replace_header_map_value(
            map_type: u32,
            key_data: *const u8,
            key_size: usize,
            value_data: *const u8,
            value_size: usize,
        ) -> u32;
        fn proxy_remove_header_map_value(map_type: u32, key_data: *const u8, key_size: usize) -> u32;
        fn proxy_get_property(
            path_data: *const u8,
            path_size: usize,
            return_value_data: *mut *mut u8,
            return_value_size: *mut usize,
        ) -> u32;
        fn proxy_get_shared_data(
            key_data: *const u8,
            key_size: usize,
            return_value_data: *mut *mut u8,
            return_value_size: *mut usize,
            return_cas: *mut u32,
        ) -> u32;
        fn proxy_set_shared_data(
            key_data: *const u8,
            key_size: usize,
            value_data: *const u8,
            value_size: usize,
            cas: u32,
        ) -> u32;
        fn proxy_send_local_response(
            status_code: u32,
            status_code_details_data: *const u8,
            status_code_details_size: usize,
            body_data: *const u8,
            body_size: usize,
            headers_data: *const u8,
            headers_size: usize,
            grpc_status: i32,
        ) -> u32;
        fn proxy_continue_stream(stream_type: u32) -> u32;
        fn proxy_close_stream(stream_type: u32) -> u32;
        fn proxy_define_metric(metric_type: u32, name_data: *const u8, name_size: usize, return_id: *mut u32) -> u32;
        fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
        fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    }

    fn check(status: u32) -> Result<(), Status> {
        if status == OK {
            Ok(())
        } else {
            Err(Status(status))
        }
    }

    /// Bytes the host allocated in this VM (through the SDK's `proxy_on_memory_allocate`) and handed
    /// over: ours to own and free.
    ///
    /// # Safety
    /// `data`/`size` must be what a host call that returned `Ok` wrote into its out-parameters.
    unsafe fn taken(data: *mut u8, size: usize) -> Vec<u8> {
        if data.is_null() {
            return Vec::new();
        }
        // SAFETY: the host allocated exactly `size` bytes at `data` with this VM's allocator for us.
        unsafe { Vec::from_raw_parts(data, size, size) }
    }

    /// An out-parameter answer: `Ok(None)` where the host has nothing (not found, empty).
    fn answer(status: u32, data: *mut u8, size: usize) -> Result<Option<Vec<u8>>, Status> {
        match status {
            // SAFETY: the call returned `Ok`, so `data`/`size` are its answer.
            OK => Ok(Some(unsafe { taken(data, size) })),
            NOT_FOUND | EMPTY => Ok(None),
            other => Err(Status(other)),
        }
    }

    pub fn current_time_ns() -> Result<u64, Status> {
        let mut t = 0u64;
        // SAFETY: `t` is ours to fill.
        check(unsafe { proxy_get_current_time_nanoseconds(&mut t) })?;
        Ok(t)
    }

    pub fn set_tick_period_ms(ms: u32) -> Result<(), Status> {
        // SAFETY: no pointers.
        check(unsafe { proxy_set_tick_period_milliseconds(ms) })
    }

    pub fn get_buffer(buffer: u32, start: usize, max: usize) -> Result<Option<Vec<u8>>, Status> {
        let (mut data, mut size) = (null_mut(), 0usize);
        // SAFETY: the out-parameters are ours to fill.
        let status = unsafe { proxy_get_buffer_bytes(buffer, start, max, &mut data, &mut size) };
        answer(status, data, size)
    }

    pub fn set_buffer(buffer: u32, start: usize, size: usize, value: &[u8]) -> Result<(), Status> {
        // SAFETY: `value` outlives the call.
        check(unsafe { proxy_set_buffer_bytes(buffer, start, size, value.as_ptr(), value.len()) })
    }

    /// Every entry of a header map: names and values as bytes, in the host's order.
    pub fn header_pairs(map: u32) -> Result<Pairs, Status> {
        let (mut data, mut size) = (null_mut(), 0usize);
        // SAFETY: the out-parameters are ours to fill.
        let status = unsafe { proxy_get_header_map_pairs(map, &mut data, &mut size) };
        Ok(answer(status, data, size)?.map(|bytes| decode_pairs(&bytes)).unwrap_or_default())
    }

    pub fn header_value(map: u32, name: &str) -> Result<Option<Vec<u8>>, Status> {
        let (mut data, mut size) = (null_mut(), 0usize);
        // SAFETY: `name` outlives the call; the out-parameters are ours to fill.
        let status = unsafe { proxy_get_header_map_value(map, name.as_ptr(), name.len(), &mut data, &mut size) };
        answer(status, data, size)
    }

    pub fn set_header(map: u32, name: &str, value: &str) -> Result<(), Status> {
        // SAFETY: both slices outlive the call.
        check(unsafe { proxy_replace_header_map_value(map, name.as_ptr(), name.len(), value.as_ptr(), value.len()) })
    }

    pub fn remove_header(map: u32, name: &str) -> Result<(), Status> {
        // SAFETY: `name` outlives the call.
        check(unsafe { proxy_remove_header_map_value(map, name.as_ptr(), name.len()) })
    }

    pub fn property(path: &[&str]) -> Result<Option<Vec<u8>>, Status> {
        let serialized = path.join("\0");
        let (mut data, mut size) = (null_mut(), 0usize);
        // SAFETY: `serialized` outlives the call; the out-parameters are ours to fill.
        let status = unsafe { proxy_get_property(serialized.as_ptr(), serialized.len(), &mut data, &mut size) };
        answer(status, data, size)
    }

    pub fn shared_data(key: &str) -> Result<Option<Vec<u8>>, Status> {
        let (mut data, mut size, mut cas) = (null_mut(), 0usize, 0u32);
        // SAFETY: `key` outlives the call; the out-parameters are ours to fill.
        let status = unsafe { proxy_get_shared_data(key.as_ptr(), key.len(), &mut data, &mut size, &mut cas) };
        answer(status, data, size)
    }

    pub fn set_shared_data(key: &str, value: &[u8]) -> Result<(), Status> {
        // SAFETY: both slices outlive the call; cas 0: no compare.
        check(unsafe { proxy_set_shared_data(key.as_ptr(), key.len(), value.as_ptr(), value.len(), 0) })
    }

    pub fn send_local_response(status: u16, headers: &[(&str, &str)], body: &[u8]) -> Result<(), Status> {
        let headers = encode_pairs(headers);
        // SAFETY: every slice outlives the call; no details; -1: not gRPC.
        check(unsafe {
            proxy_send_local_response(
                u32::from(status),
                null(),
                0,
                body.as_ptr(),
                body.len(),
                headers.as_ptr(),
                headers.len(),
                -1,
            )
        })
    }

    /// Resume a paused request (0) or response (1).
    pub fn resume(stream: u32) -> Result<(), Status> {
        // SAFETY: no pointers.
        check(unsafe { proxy_continue_stream(stream) })
    }

    /// Reset the stream (`STREAM_RESPONSE`: its answer half, where a local reply is no longer ours).
    pub fn close(stream: u32) -> Result<(), Status> {
        // SAFETY: no pointers.
        check(unsafe { proxy_close_stream(stream) })
    }

    pub const STREAM_REQUEST: u32 = 0;
    pub const STREAM_RESPONSE: u32 = 1;

    pub fn define_counter(name: &str) -> Result<u32, Status> {
        let mut id = 0u32;
        // SAFETY: `name` outlives the call; `id` is ours to fill. 0: a counter.
        check(unsafe { proxy_define_metric(0, name.as_ptr(), name.len(), &mut id) })?;
        Ok(id)
    }

    pub fn increment_metric(id: u32, by: i64) -> Result<(), Status> {
        // SAFETY: no pointers.
        check(unsafe { proxy_increment_metric(id, by) })
    }
}

/// The proxy-wasm map encoding: a count, then a (name length, value length) pair per entry, then
/// each name and value followed by a NUL. A malformed map yields the entries read before the fault.
pub fn decode_pairs(bytes: &[u8]) -> Pairs {
    let word = |at: usize| -> Option<usize> {
        let b: [u8; 4] = bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
        usize::try_from(u32::from_le_bytes(b)).ok()
    };
    let Some(count) = word(0) else { return Vec::new() };
    let mut out = Vec::with_capacity(count.min(256));
    let Some(mut at) = count.checked_mul(8).and_then(|n| n.checked_add(4)) else { return out };
    for n in 0..count {
        let Some(lens) = n.checked_mul(8).and_then(|i| i.checked_add(4)) else { break };
        let (Some(klen), Some(vlen)) = (word(lens), lens.checked_add(4).and_then(word)) else { break };
        let Some(key) = at.checked_add(klen).and_then(|end| bytes.get(at..end)) else { break };
        at = at.saturating_add(klen).saturating_add(1);
        let Some(value) = at.checked_add(vlen).and_then(|end| bytes.get(at..end)) else { break };
        at = at.saturating_add(vlen).saturating_add(1);
        out.push((key.to_vec(), value.to_vec()));
    }
    out
}

/// The proxy-wasm map encoding of `pairs` (see [`decode_pairs`]).
fn encode_pairs(pairs: &[(&str, &str)]) -> Vec<u8> {
    let len = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes();
    let mut out = Vec::new();
    out.extend_from_slice(&len(pairs.len()));
    for (k, v) in pairs {
        out.extend_from_slice(&len(k.len()));
        out.extend_from_slice(&len(v.len()));
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_round_trip_and_bytes_stay_bytes() {
        let encoded = encode_pairs(&[(":status", "200"), ("x", "")]);
        assert_eq!(decode_pairs(&encoded), vec![(b":status".to_vec(), b"200".to_vec()), (b"x".to_vec(), Vec::new())]);
        // A value that is not UTF-8 is read as its bytes, never refused or decoded.
        let mut raw = encode_pairs(&[("x-request-id", "ab")]);
        let at = raw.len() - 3;
        raw[at] = 0xE9;
        raw[at + 1] = 0xFF;
        assert_eq!(decode_pairs(&raw), vec![(b"x-request-id".to_vec(), vec![0xE9, 0xFF])]);
        // Truncated or lying maps end early, never panic.
        for cut in 0..encoded.len() {
            let _ = decode_pairs(&encoded[..cut]);
        }
        assert!(decode_pairs(&[0xff, 0xff, 0xff, 0xff]).is_empty());
    }
}
