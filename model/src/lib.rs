//! The protocol, model-checked (docs/model.md).
//!
//! A stateright model of one operation in a world of agents, two filter instances running the
//! real `core::machine`, idemd replicas running idemd's own store flows (`idemd::store::flow`,
//! `idemd::reconcile::settle`) one store call per step over Redis and SQL as the store rules
//! (`idemd::store::rules`), the upstream, the reaper and a clock, with bounded
//! faults. [`report::check`] explores every reachable state and checks [`props`]; a
//! [`config::Mutation`] breaks one rule so the check can show it notices.

#![forbid(unsafe_code)]

pub mod checker;
pub mod config;
pub mod filter;
pub mod hash;
pub mod idemd;
pub mod props;
pub mod report;
pub mod symmetry;
pub mod world;
