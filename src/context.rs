//! proxy-wasm's HTTP callbacks, handed to the shared stream adapter: every one the SDK offers
//! for a stream, since a default that continues would release a held request (DESIGN §6).

#[cfg(target_arch = "wasm32")]
pub use wasm::WasmStream;

#[cfg(target_arch = "wasm32")]
mod wasm {
    use crate::host::WasmHost;
    use idem_adapter::{Action, Stream};
    use proxy_wasm::traits::{Context, HttpContext};
    use proxy_wasm::types::Action as ProxyAction;

    pub struct WasmStream(pub Stream<WasmHost>);

    fn to_proxy(a: Action) -> ProxyAction {
        match a {
            Action::Continue => ProxyAction::Continue,
            Action::Pause => ProxyAction::Pause,
        }
    }

    impl Context for WasmStream {
        fn on_http_call_response(&mut self, token_id: u32, num_headers: usize, body_size: usize, _trailers: usize) {
            self.0.on_callout_answer(u64::from(token_id), num_headers, body_size);
        }
    }

    impl HttpContext for WasmStream {
        fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> ProxyAction {
            to_proxy(self.0.on_request_headers(end_of_stream))
        }

        fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> ProxyAction {
            to_proxy(self.0.on_request_body(body_size, end_of_stream))
        }

        /// proxy-wasm's default continues, which would release a held request: the machine decides.
        fn on_http_request_trailers(&mut self, _num_trailers: usize) -> ProxyAction {
            to_proxy(self.0.on_request_trailers())
        }

        fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> ProxyAction {
            to_proxy(self.0.on_response_headers(end_of_stream))
        }

        fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> ProxyAction {
            to_proxy(self.0.on_response_body(body_size, end_of_stream))
        }

        fn on_http_response_trailers(&mut self, _num_trailers: usize) -> ProxyAction {
            to_proxy(self.0.on_response_trailers())
        }
    }
}
