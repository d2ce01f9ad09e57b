//! idemd: the idempotency sidecar of the agent-idempotency Envoy filter.
//!
//! The filter asks it three things per confirm: may I run this (acquire),
//! here is how it ended (complete), it never reached the upstream (release).
//! Redis answers fast (`store::redis`, the Lua scripts in `lua/`); the SQL
//! table is the truth (`store::sql`); `store` is the state machine over both;
//! `api` is the HTTP face; `config` the command line. In the background,
//! `reconcile` decides operations whose executor went silent and `reaper`
//! deletes terminal rows past the retention, and `probe` keeps the health and
//! backlog gauges current; `telemetry` the logs and the optional
//! OpenTelemetry trace export; `ops` is the operator's CLI; `tools` generates agents'
//! tool definitions from the route annotations; `check` refuses Envoy configurations that leave a path
//! around them.
#![forbid(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub mod api;
pub mod approvals;
pub mod auth;
pub mod check;
pub mod config;
pub mod console;
pub mod evidence;
pub mod metrics;
pub mod ops;
pub mod probe;
pub mod reaper;
pub mod reconcile;
pub mod redact;
pub mod review;
pub mod serve;
pub mod store;
pub mod telemetry;
pub mod tools;
