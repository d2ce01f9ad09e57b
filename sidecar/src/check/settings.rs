//! What the agent filter is configured with, read as idem-core reads it: the plugin configuration's
//! settings and route rules ([`filter_settings`]), a route's annotation ([`from_annotation`]). The
//! parsed Envoy configuration (`model`) keeps these; `guard` then finds the routes they guard.

use serde_json::Value;

use idem_core::policy::rules::RouteMatch;
use idem_core::policy::{parse_route_policy, CacheConfig, PluginConfig, RouteDefaults, RoutePolicy};

use crate::tools::annotation_leaves;

/// A route's annotation as the filter reads it. `Ok(None)`: no role, not guarded.
pub fn from_annotation(meta: &Value, defaults: &RouteDefaults) -> Result<Option<RoutePolicy>, String> {
    let leaves = annotation_leaves("annotation", meta)?;
    parse_route_policy(&|k| leaves.get(k).cloned(), defaults).map_err(|e| e.0)
}

/// One route rule of a plugin configuration.
#[derive(Debug, Clone)]
pub struct RuleGuard {
    pub name: String,
    pub matcher: RouteMatch,
    pub policy: RoutePolicy,
    /// The methods the rule lets pass its path unguarded (every other method is guarded).
    pub pass_methods: Vec<String>,
}

/// What the TTL rules read of a plugin configuration the filter accepts.
#[derive(Debug, Clone)]
pub struct FilterSettings {
    pub sidecar_timeout_ms: u64,
    pub defaults: RouteDefaults,
    pub replay_cache: CacheConfig,
    pub rules: Vec<RuleGuard>,
}

pub fn filter_settings(config: &PluginConfig) -> FilterSettings {
    FilterSettings {
        sidecar_timeout_ms: config.sidecar_timeout_ms,
        defaults: config.defaults,
        replay_cache: config.replay_cache,
        rules: config
            .routes
            .iter()
            .map(|r| RuleGuard {
                name: r.name.clone(),
                matcher: r.matcher.clone(),
                policy: (*r.policy).clone(),
                pass_methods: r.pass_methods.clone(),
            })
            .collect(),
    }
}
