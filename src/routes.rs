//! Which routes the filter guards, and how: a per-VM cache of route policies
//! keyed by the route's annotation itself, never by its name.
//!
//! Route names are not unique in Envoy (Istio reuses `default` across virtual
//! hosts), so a cache keyed by name could hand a confirm route the policy of
//! an unannotated namesake and let it pass unguarded (DESIGN §6). The key here
//! is every annotation leaf's bytes: two routes share a cached policy only if
//! their annotations are identical, and a route re-annotated over xDS is a new
//! key at once.
//!
//! Unannotated routes stay cheap (DESIGN §9): "not mine" is one property read
//! of the `role` leaf and no parsing. Where the plugin configuration has route
//! rules (meshes without route metadata), a route without an annotation is
//! then matched against them: three header reads and a scan of the rules.

use crate::host::Host;
use idem_core::policy::{self, PluginConfig, RouteDefaults, RoutePolicy, ROUTE_KEYS, ROUTE_NAMESPACE};
use idem_core::route_rules::RouteRules;
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// Distinct annotations are few (one per annotated route); the cap only
/// bounds memory if something churns them.
const MAX_ENTRIES: usize = 1024;

/// What a route asks of the filter.
#[derive(Debug, Clone)]
pub enum RouteLookup {
    NotMine,
    Guarded(Rc<RoutePolicy>),
    /// The annotation does not parse: the route must not run unprotected.
    Broken(Rc<str>),
}

#[derive(Default)]
pub struct RouteCache {
    entries: RefCell<HashMap<Vec<u8>, RouteLookup>>,
}

impl RouteCache {
    pub fn lookup(&self, host: &dyn Host, config: &PluginConfig) -> RouteLookup {
        let Some(role) = leaf_bytes(host, "role") else { return by_rule(host, &config.routes) };
        let defaults = &config.defaults;
        let leaves: Vec<(&str, Option<Vec<u8>>)> = ROUTE_KEYS
            .iter()
            .map(|key| (*key, if *key == "role" { Some(role.clone()) } else { leaf_bytes(host, key) }))
            .collect();
        let key = cache_key(&leaves);
        if let Some(hit) = self.entries.borrow().get(&key) {
            return hit.clone();
        }
        let fresh = parse(&leaves, defaults);
        if let RouteLookup::Broken(why) = &fresh {
            host.log(crate::host::Level::Error, &format!("bad route annotation: {why}"));
        }
        let mut entries = self.entries.borrow_mut();
        if entries.len() >= MAX_ENTRIES {
            entries.clear();
        }
        entries.insert(key, fresh.clone());
        fresh
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.entries.borrow().len()
    }
}

/// Route metadata wins; without it, the plugin configuration's rules decide.
fn by_rule(host: &dyn Host, rules: &RouteRules) -> RouteLookup {
    if rules.is_empty() {
        return RouteLookup::NotMine;
    }
    let header = |name: &str| host.request_header(name).unwrap_or_default();
    match rules.find(&header(":method"), &header(":authority"), &header(":path")) {
        Some(rule) => RouteLookup::Guarded(Rc::clone(&rule.policy)),
        None => RouteLookup::NotMine,
    }
}

fn leaf_bytes(host: &dyn Host, key: &str) -> Option<Vec<u8>> {
    host.property(&["xds", "route_metadata", "filter_metadata", ROUTE_NAMESPACE, key])
}

/// Every leaf, length-prefixed (absent and empty differ), so distinct annotations never share a key.
fn cache_key(leaves: &[(&str, Option<Vec<u8>>)]) -> Vec<u8> {
    let mut key = Vec::with_capacity(128);
    for (_, value) in leaves {
        match value {
            None => key.extend_from_slice(&u32::MAX.to_le_bytes()),
            Some(bytes) => {
                key.extend_from_slice(&u32::try_from(bytes.len()).unwrap_or(u32::MAX - 1).to_le_bytes());
                key.extend_from_slice(bytes);
            }
        }
    }
    key
}

fn parse(leaves: &[(&str, Option<Vec<u8>>)], defaults: &RouteDefaults) -> RouteLookup {
    let get = |key: &str| {
        let raw = leaves.iter().find(|(k, _)| *k == key).and_then(|(_, v)| v.clone())?;
        Some(policy::leaf_value(key, raw))
    };
    match policy::parse_route_policy(&get, defaults) {
        Ok(Some(p)) => RouteLookup::Guarded(Rc::new(p)),
        Ok(None) => RouteLookup::NotMine,
        Err(e) => RouteLookup::Broken(e.to_string().into()),
    }
}
