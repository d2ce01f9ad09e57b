//! Plugin configuration and route annotations (DESIGN §5, §6).
//!
//! Both are validated completely when loaded: a typo in a field name or a TTL
//! out of range must refuse the configuration, never fall back to a default
//! that quietly weakens idempotency. Every message names the field.
//!
//! - `plugin`: the filter's configuration (idemd, keys, subject, defaults);
//! - `route`: one route's annotation (`RoutePolicy`), wherever it comes from;
//! - `rules`: route rules, for routes that cannot carry metadata (Istio);
//! - `pairs`: the bytes Envoy hands a route's metadata struct over in, which both hosts use.
//!
//! The dependencies run one way: `plugin` → `rules` → `route` → `pairs`.

pub mod approval;
mod pairs;
mod plugin;
mod route;
pub mod rules;
pub mod template;

pub use pairs::{decode_pairs, encode_pairs, is_numeric_key, leaf_value, LeafValue};
pub use plugin::*;
pub use route::*;
