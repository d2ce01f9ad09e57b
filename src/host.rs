//! The proxy-wasm implementation of the adapter's `Host` trait.

#[cfg(target_arch = "wasm32")]
pub use wasm::{now_ms, wasm_plugin_configuration, WasmHost};

/// Host calls through `crate::abi`, which report failure instead of panicking: the SDK's own
/// panic on statuses and bytes a host or client chooses, and a panic kills the VM (and with it
/// every stream on this worker).
#[cfg(target_arch = "wasm32")]
mod wasm {
    use crate::abi::{self, Status};
    use crate::metrics::Metrics;
    use idem_adapter::{Host, Level, ROUTE_ANNOTATION_PATH};
    use idem_core::leases::LeaseBook;
    use idem_core::machine::{Callout, CalloutAnswer, Counter, Env};
    use idem_core::policy::PluginConfig;
    use idem_core::protocol::{LeaseRenewal, OwnerToken};
    use idem_core::trace::{HostSpan, Trace};
    use proxy_wasm::hostcalls;
    use std::cell::RefCell;
    use std::rc::Rc;
    use std::time::Duration;

    pub struct WasmHost {
        metrics: Rc<Metrics>,
        /// This VM's leases, renewed by the root context's tick (`root.rs`).
        leases: Rc<RefCell<LeaseBook>>,
    }

    impl WasmHost {
        pub fn new(metrics: Rc<Metrics>, leases: Rc<RefCell<LeaseBook>>) -> WasmHost {
            WasmHost { metrics, leases }
        }
    }

    /// Unix milliseconds by the host's clock (0 if unknown: every held lease then looks fresh,
    /// and the next readable tick renews it).
    pub fn now_ms() -> u64 {
        abi::current_time_ns().map(|ns| ns / 1_000_000).unwrap_or(0)
    }

    fn warn_on_err<T, E: std::fmt::Debug>(what: &str, r: Result<T, E>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(status) => {
                log::warn!("host call {what} failed: {status:?}");
                None
            }
        }
    }

    pub fn wasm_plugin_configuration() -> Vec<u8> {
        abi::get_buffer(abi::PLUGIN_CONFIGURATION, 0, usize::MAX).ok().flatten().unwrap_or_default()
    }

    /// A header map: names as text (HTTP names are tokens; one that is not is read leniently, it
    /// names no header the guard reads), values as the bytes sent.
    fn header_pairs(map: u32) -> Vec<(String, Vec<u8>)> {
        let pairs: Result<_, Status> = abi::header_pairs(map);
        pairs.unwrap_or_default().into_iter().map(|(k, v)| (String::from_utf8_lossy(&k).into_owned(), v)).collect()
    }

    impl Env for WasmHost {
        /// 0 if the host cannot tell, which makes every fingerprint look expired: fail safe.
        fn now_s(&self) -> u64 {
            abi::current_time_ns().map(|ns| ns / 1_000_000_000).unwrap_or(0)
        }

        fn random16(&mut self) -> Option<[u8; 16]> {
            let mut bytes = [0u8; 16];
            getrandom::fill(&mut bytes).ok().map(|()| bytes)
        }

        fn shared_get(&self, key: &str) -> Option<Vec<u8>> {
            abi::shared_data(key).ok().flatten()
        }
    }

    impl Host for WasmHost {
        fn request_header(&self, name: &str) -> Option<Vec<u8>> {
            abi::header_value(abi::REQUEST_HEADERS, name).ok().flatten()
        }

        fn request_headers(&self) -> Vec<(String, Vec<u8>)> {
            header_pairs(abi::REQUEST_HEADERS)
        }

        fn set_request_header(&mut self, name: &str, value: &str) {
            warn_on_err("set request header", abi::set_header(abi::REQUEST_HEADERS, name, value));
        }

        fn remove_request_header(&mut self, name: &str) {
            warn_on_err("remove request header", abi::remove_header(abi::REQUEST_HEADERS, name));
        }

        fn response_headers(&self) -> Vec<(String, Vec<u8>)> {
            header_pairs(abi::RESPONSE_HEADERS)
        }

        fn set_response_header(&mut self, name: &str, value: &str) {
            warn_on_err("set response header", abi::set_header(abi::RESPONSE_HEADERS, name, value));
        }

        fn remove_response_header(&mut self, name: &str) {
            warn_on_err("remove response header", abi::remove_header(abi::RESPONSE_HEADERS, name));
        }

        /// The annotation struct in one property read, already in proxy-wasm's pairs encoding.
        fn route_annotation(&self) -> Option<Vec<u8>> {
            self.property(&ROUTE_ANNOTATION_PATH)
        }

        fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
            abi::property(path).ok().flatten()
        }

        fn request_body(&self, size: usize) -> Vec<u8> {
            abi::get_buffer(abi::REQUEST_BODY, 0, size).ok().flatten().unwrap_or_default()
        }

        fn response_body(&self, size: usize) -> Vec<u8> {
            abi::get_buffer(abi::RESPONSE_BODY, 0, size).ok().flatten().unwrap_or_default()
        }

        fn replace_response_body(&mut self, old_size: usize, body: &[u8]) {
            warn_on_err("set response body", abi::set_buffer(abi::RESPONSE_BODY, 0, old_size, body));
        }

        fn send_reply(&mut self, status: u16, headers: &[(String, String)], body: &[u8]) {
            let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            warn_on_err("send local reply", abi::send_local_response(status, &headers, body));
        }

        fn reset(&mut self) {
            warn_on_err("reset stream", abi::close(abi::STREAM_RESPONSE));
        }

        fn resume_request(&mut self) {
            warn_on_err("resume request", abi::resume(abi::STREAM_REQUEST));
        }

        fn resume_response(&mut self) {
            warn_on_err("resume response", abi::resume(abi::STREAM_RESPONSE));
        }

        fn dispatch(
            &mut self,
            cluster: &str,
            headers: &[(&str, &str)],
            body: Option<&[u8]>,
            timeout: Duration,
        ) -> Option<u64> {
            // The SDK's call (see `abi`): it registers the token for the answer's routing.
            #[allow(clippy::disallowed_methods)]
            let sent = hostcalls::dispatch_http_call(cluster, headers.to_vec(), body, vec![], timeout);
            warn_on_err("dispatch_http_call", sent).map(u64::from)
        }

        fn call_answer(&self, num_headers: usize, body_size: usize) -> CalloutAnswer {
            if num_headers == 0 {
                return CalloutAnswer::failed();
            }
            let status = abi::header_value(abi::CALL_RESPONSE_HEADERS, ":status")
                .ok()
                .flatten()
                .and_then(|s| String::from_utf8(s).ok())
                .and_then(|s| s.parse().ok());
            let body = abi::get_buffer(abi::CALL_RESPONSE_BODY, 0, body_size).ok().flatten().unwrap_or_default();
            CalloutAnswer { status, body }
        }

        fn count(&mut self, counter: Counter) {
            self.metrics.inc(counter);
        }

        fn shared_set(&mut self, key: &str, value: &[u8]) {
            // No CAS: the last terminal result written for a slot wins, and any of them is true.
            warn_on_err("set_shared_data", abi::set_shared_data(key, value));
        }

        /// proxy-wasm has no access to Envoy's span (envoy#22028): callouts continue the
        /// request's own `traceparent` instead.
        fn active_span(&self) -> Option<HostSpan> {
            None
        }

        /// A `.wasm` stream's callout outlives the stream: sent as any other.
        fn report(&mut self, cfg: &PluginConfig, call: &Callout, trace: &Trace) -> bool {
            idem_adapter::sidecar::dispatch(self, cfg, call, trace).is_some()
        }

        fn hold_lease(&mut self, lease: &LeaseRenewal) {
            if let Ok(mut book) = self.leases.try_borrow_mut() {
                book.hold(lease.clone(), now_ms());
            }
        }

        fn end_lease(&mut self, owner: &OwnerToken) {
            if let Ok(mut book) = self.leases.try_borrow_mut() {
                book.end(owner);
            }
        }

        fn log(&self, level: Level, message: &str) {
            match level {
                Level::Warn => log::warn!("{message}"),
                Level::Error => log::error!("{message}"),
            }
        }
    }
}
