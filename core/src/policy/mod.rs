//! Plugin configuration and route annotations (DESIGN §5, §6).
//!
//! Both are validated completely when loaded: a typo in a field name or a TTL
//! out of range must refuse the configuration, never fall back to a default
//! that quietly weakens idempotency. Every message names the field.
//!
//! - `plugin`: the filter's configuration (idemd, keys, subject, defaults);
//! - `route`: one route's annotation (`RoutePolicy`), wherever it comes from;
//! - `rules`: route rules, for routes that cannot carry metadata (Istio);
//! - `approval`: a confirm route's approval rule (DESIGN §4, "Approval");
//! - `template`: a route's path template;
//! - `pairs`: the bytes Envoy hands a route's metadata struct over in, which both hosts use;
//! - `error`: the one error a configuration is refused with, naming the field.
//!
//! The dependencies run one way (`tests/tests/structure.rs` finds no circle): `plugin` → `rules`,
//! `route`, `error`; `rules` → `route`, `template`, `pairs`, `error`; `route` → `approval`, `template`,
//! `pairs`, `error`; `approval` → `error`. `template`, `pairs` and `error` use none of the others.

pub mod approval;
mod error;
mod pairs;
mod plugin;
mod route;
pub mod rules;
pub mod template;

pub use error::Error;
pub use pairs::{decode_pairs, encode_pairs, is_numeric_key, leaf_value, LeafValue};
pub use plugin::*;
pub use route::*;
