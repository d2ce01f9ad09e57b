//! What the test suites share (idemd's store tests, the end-to-end tests, the
//! soak and the bench): where the backends are, a loud skip when one is
//! missing, databases (and PostgreSQL servers, alone or as a primary with a
//! streaming standby), MariaDB and Redis primaries with a replica of a test's own, a TCP forwarder that follows a primary
//! on failover, child processes that die with the test, a look inside
//! fingerprints, an OTLP/HTTP trace receiver, and Envoy configurations read
//! and edited as data.

#![forbid(unsafe_code)]

pub mod backends;
pub mod envoy_config;
pub mod fingerprint;
pub mod forwarder;
pub mod mariadb_server;
pub mod otlp;
pub mod pg_server;
pub mod proc;
pub mod redis_server;

pub type BoxError = Box<dyn std::error::Error>;
