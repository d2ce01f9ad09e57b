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
//! (the annotation struct is absent) and no parsing; an annotated route is one
//! property read and a hash lookup. Where the plugin configuration has route
//! rules (meshes without route metadata), a route without an annotation is
//! then matched against them: the path first (one header read), and only if
//! some rule's path matches, the method and authority too.

use crate::host::Host;
use idem_core::machine::read_as;
use idem_core::policy::rules::RouteRules;
use idem_core::policy::{self, PluginConfig, RouteDefaults, RoutePolicy, ROUTE_KEYS};
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
    /// No rule matches the request as sent, but one matches it as a lenient upstream reads it
    /// (another spelling of the path or method): refused, naming the path to send.
    NotCanonical(String),
    /// A rule's path with a method the rule neither guards nor lets pass (DESIGN §6: a guarded
    /// path is guarded for every method): refused, nothing forwarded; the text says why.
    MethodNotGuarded(String),
}

#[derive(Default)]
pub struct RouteCache {
    entries: RefCell<HashMap<Vec<u8>, RouteLookup>>,
}

impl RouteCache {
    pub fn lookup(&self, host: &dyn Host, config: &PluginConfig) -> RouteLookup {
        // One host call: the whole annotation, or nothing for an unannotated route.
        let Some(raw) = host.route_annotation() else {
            return by_rule(host, &config.routes);
        };
        if let Some(hit) = self.entries.borrow().get(&raw) {
            return hit.clone();
        }
        let fresh = RouteLookup::from_annotation(&raw, &config.defaults);
        match &fresh {
            RouteLookup::Broken(why) => host.log(crate::host::Level::Error, &format!("bad route annotation: {why}")),
            // Annotated, but nothing the filter guards (no role): rules may still apply.
            RouteLookup::NotMine => return by_rule(host, &config.routes),
            RouteLookup::Guarded(_) | RouteLookup::NotCanonical(_) | RouteLookup::MethodNotGuarded(_) => {}
        }
        let mut entries = self.entries.borrow_mut();
        if entries.len() >= MAX_ENTRIES {
            entries.clear();
        }
        // Keyed by the annotation's bytes: equal bytes are an equal annotation, whatever the route's name.
        entries.insert(raw, fresh.clone());
        fresh
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.borrow().len()
    }
}

impl RouteLookup {
    /// What an annotation (`policy::encode_pairs` bytes) asks of the filter.
    pub fn from_annotation(raw: &[u8], defaults: &RouteDefaults) -> RouteLookup {
        match policy::decode_pairs(raw) {
            Some(pairs) => parse(&pairs, defaults),
            None => RouteLookup::Broken("the route's agent_idempotency metadata is not a struct of leaves".into()),
        }
    }
}

/// Route metadata wins; without it, the plugin configuration's rules decide.
fn by_rule(host: &dyn Host, rules: &RouteRules) -> RouteLookup {
    if rules.is_empty() {
        return RouteLookup::NotMine;
    }
    // Read leniently (not UTF-8: decoded with replacement characters): these only choose a rule,
    // and a spelling no rule names is still judged by `lenient_match` below, never passed as text
    // nobody could read.
    let header = |name: &str| host.request_header(name).map(|v| lossy(&v)).unwrap_or_default();
    // The path alone rules out most requests: one header read instead of three.
    let path = header(":path");
    let named = rules.any_path_matches(&path);
    if !named && idem_core::policy::rules::lenient_path(&path).is_none() {
        // A plain path no rule names: the common case, settled without reading more.
        return RouteLookup::NotMine;
    }
    let (method, authority) = (header(":method"), header(":authority"));
    if let Some(rule) = rules.find(&method, &authority, &path).filter(|_| named) {
        return RouteLookup::Guarded(Rc::clone(&rule.policy));
    }
    // A rule's path, another method: guarded too, unless the rule lets that method pass.
    if let Some(why) = rules.method_refused(&method, &authority, &path).filter(|_| named) {
        return RouteLookup::MethodNotGuarded(why);
    }
    // Not a guarded request as sent. Could the upstream read it as one? (DESIGN §6)
    let mut methods = vec![method];
    methods.extend(method_overrides(&host.request_headers()));
    let methods: Vec<&str> = methods.iter().map(String::as_str).collect();
    match rules.lenient_match(&methods, &authority, &path) {
        Some(canonical) => RouteLookup::NotCanonical(canonical),
        None => RouteLookup::NotMine,
    }
}

/// Headers web frameworks read as the request's real method (Rails, Express, Spring, ...).
const METHOD_OVERRIDES: [&str; 3] = ["x-http-method-override", "x-http-method", "x-method-override"];

/// The values of every method-override header, in either spelling: Envoy forwards underscores by
/// default, and a CGI-style server (WSGI, Rack, PHP) reads `x_http_method_override` as the dashed one.
fn method_overrides(headers: &[(String, Vec<u8>)]) -> Vec<String> {
    let is_override = |name: &str| METHOD_OVERRIDES.iter().any(|m| read_as(name, m));
    headers.iter().filter(|(k, _)| is_override(k)).map(|(_, v)| lossy(v)).collect()
}

fn lossy(value: &[u8]) -> String {
    String::from_utf8_lossy(value).into_owned()
}

fn parse(pairs: &[(String, Vec<u8>)], defaults: &RouteDefaults) -> RouteLookup {
    let get = |key: &str| {
        let raw = pairs.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())?;
        Some(policy::leaf_value(key, raw))
    };
    if let Some((unknown, _)) = pairs.iter().find(|(k, _)| !ROUTE_KEYS.contains(&k.as_str())) {
        return RouteLookup::Broken(
            format!("{unknown}: unknown annotation field (expected one of: {})", ROUTE_KEYS.join(", ")).into(),
        );
    }
    match policy::parse_route_policy(&get, defaults) {
        Ok(Some(p)) => RouteLookup::Guarded(Rc::new(p)),
        Ok(None) => RouteLookup::NotMine,
        Err(e) => RouteLookup::Broken(e.to_string().into()),
    }
}
