//! An empty proxy-wasm HTTP filter: a root context that makes an HTTP context per
//! request, and every callback left at the SDK's default (`Continue`). `make bench`
//! runs it on its own listener (envoy/bench.yaml, `empty`) as the baseline for
//! "any proxy-wasm filter on every route".

#![forbid(unsafe_code)]

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(EmptyRoot) });
}}

struct EmptyRoot;

impl Context for EmptyRoot {}

impl RootContext for EmptyRoot {
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Empty))
    }
}

struct Empty;

impl Context for Empty {}

impl HttpContext for Empty {}
