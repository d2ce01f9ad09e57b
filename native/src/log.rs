//! Envoy's log, from any thread and any hook: its own module, so the configuration, the host
//! and the main thread all reach it without depending on one another.

use crate::abi::{self, module_buffer};

/// A line in Envoy's log (component `dynamic_modules`).
pub fn log(level: abi::LogLevel, message: &str) {
    // SAFETY: `message` outlives the call.
    unsafe { abi::envoy_dynamic_module_callback_log(level, module_buffer::new(message.as_bytes())) };
}
