//! Pure decisions of the agent-idempotency filter. No proxy-wasm, no I/O, no
//! clock: the host glue passes bytes, time and randomness in.

#![forbid(unsafe_code)]

pub mod canonical;
pub mod client_key;
pub mod fingerprint;
pub mod leases;
pub mod machine;
pub mod outcome;
pub mod policy;
pub mod protocol;
pub mod reply;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod trace;
pub mod utc;

mod json_text;
mod strict_json;
