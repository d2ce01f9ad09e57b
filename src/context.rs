//! proxy-wasm's HTTP callbacks, handed to the shared stream adapter: every one the SDK offers
//! for a stream, since a default that continues would release a held request (DESIGN §6).
//! A stream of a VM without a usable configuration is refused (DESIGN §6: every host fails
//! closed), never left to the SDK, which panics and so kills the VM for every stream on it.

#[cfg(target_arch = "wasm32")]
pub use wasm::WasmStream;

#[cfg(target_arch = "wasm32")]
mod wasm {
    use crate::abi;
    use crate::host::WasmHost;
    use idem_adapter::{trace_id, Action, Refusal, Stream};
    use proxy_wasm::traits::{Context, HttpContext};
    use proxy_wasm::types::Action as ProxyAction;

    // Boxed whole once per stream (`create_http_context`): boxing the live variant as well would
    // add an allocation to every stream for the sake of the rare refused one.
    #[allow(clippy::large_enum_variant)]
    pub enum WasmStream {
        Live(Stream<WasmHost>),
        /// No usable configuration on this VM: the request is answered with the refusal (in the
        /// words of the configuration that parsed, if one did) and held; the answer (the refusal
        /// itself) goes on.
        Refused(Refusal),
    }

    impl WasmStream {
        /// Run `f` on a live stream; a refused one holds its request (`on_request`) and lets its
        /// answer, the refusal, go on.
        fn on(&mut self, on_request: bool, f: impl FnOnce(&mut Stream<WasmHost>) -> Action) -> ProxyAction {
            match self {
                WasmStream::Live(s) => to_proxy(f(s)),
                WasmStream::Refused(_) if on_request => ProxyAction::Pause,
                WasmStream::Refused(_) => ProxyAction::Continue,
            }
        }
    }

    fn to_proxy(a: Action) -> ProxyAction {
        match a {
            Action::Continue => ProxyAction::Continue,
            Action::Pause => ProxyAction::Pause,
        }
    }

    impl Context for WasmStream {
        fn on_http_call_response(&mut self, token_id: u32, num_headers: usize, body_size: usize, _trailers: usize) {
            if let WasmStream::Live(s) = self {
                s.on_callout_answer(u64::from(token_id), num_headers, body_size);
            }
        }
    }

    impl HttpContext for WasmStream {
        fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> ProxyAction {
            if let WasmStream::Refused(refusal) = self {
                log::error!("no usable configuration on this VM: the stream is refused");
                let trace = trace_id(|name| abi::header_value(abi::REQUEST_HEADERS, name).ok().flatten());
                let reply = refusal.reply(&trace);
                let headers: Vec<(&str, &str)> = reply.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                if let Err(status) = abi::send_local_response(reply.http_status, &headers, &reply.body) {
                    log::warn!("host call send local reply failed: {status:?}");
                }
            }
            self.on(true, |s| s.on_request_headers(end_of_stream))
        }

        fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> ProxyAction {
            self.on(true, |s| s.on_request_body(body_size, end_of_stream))
        }

        /// proxy-wasm's default continues, which would release a held request: the machine decides.
        fn on_http_request_trailers(&mut self, _num_trailers: usize) -> ProxyAction {
            self.on(true, |s| s.on_request_trailers())
        }

        fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> ProxyAction {
            self.on(false, |s| s.on_response_headers(end_of_stream))
        }

        fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> ProxyAction {
            self.on(false, |s| s.on_response_body(body_size, end_of_stream))
        }

        fn on_http_response_trailers(&mut self, _num_trailers: usize) -> ProxyAction {
            self.on(false, |s| s.on_response_trailers())
        }
    }
}
