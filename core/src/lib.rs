//! Pure decisions of the agent-idempotency filter. No proxy-wasm, no I/O, no
//! clock: the host glue passes bytes, time and randomness in.

pub mod protocol;
