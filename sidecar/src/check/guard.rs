//! What the filter guards, as idem-core parses it: a route's annotation or a
//! route rule becomes a `RoutePolicy` (with its `upstream_keys`: whether the
//! upstream deduplicates by `Idempotency-Key`), and [`guarded`] lists every
//! Envoy route that carries guarded requests upstream: annotated routes, and
//! for each route rule the unannotated routes its requests may take (a mesh's
//! catch-all).

use idem_core::policy::rules::{PathMatch, RouteMatch, Segment};
use idem_core::policy::{Role, RoutePolicy};

use super::model::{EnvoyConfig, Manager, Matcher, Route, Target, VirtualHost};
use super::settings::{FilterSettings, RuleGuard};

/// The policies of `policy` that acquire an operation (so hold a lease while Envoy waits): its own for confirm
/// and idempotent, each confirm tool's on an MCP route. With the tool's name.
pub fn acquiring(policy: &RoutePolicy) -> Vec<(Option<&str>, &RoutePolicy)> {
    match policy.role {
        Role::Idempotent => vec![(None, policy)],
        _ => policy.fingerprint_confirms(),
    }
}

/// Every fingerprint lifetime `policy` may give or accept (an MCP route's tools too), with the tool's name.
pub fn fingerprint_ttls(policy: &RoutePolicy) -> Vec<(Option<&str>, u64)> {
    let mut out = vec![(None, policy.fingerprint_ttl_s)];
    out.extend(policy.tools.iter().map(|(name, p)| (Some(name.as_str()), p.fingerprint_ttl_s)));
    out
}

/// An Envoy route that forwards guarded requests, and the policy it forwards them under.
#[derive(Debug)]
pub struct Guarded<'a> {
    /// `envoy.yaml: listener agents: virtual host transfers: route transfer_confirm`, or for a rule
    /// `…: rule transfer_confirm via virtual host …: route default`.
    pub at: String,
    pub manager: &'a Manager,
    pub settings: &'a FilterSettings,
    pub host: &'a VirtualHost,
    pub route: &'a Route,
    pub policy: &'a RoutePolicy,
    /// The route rule it comes from, when it is not the route's own annotation.
    pub rule: Option<&'a RuleGuard>,
}

impl Guarded<'_> {
    /// Where, for a finding about one of its MCP tools (or the route itself).
    pub fn at_tool(&self, tool: Option<&str>) -> String {
        match tool {
            Some(t) => format!("{}: tool {t}", self.at),
            None => self.at.clone(),
        }
    }
}

/// Every route a request the filter guards may take upstream, in managers that run the filter with a
/// configuration it accepts: annotated routes, and for each route rule every unannotated forwarding route
/// whose match may meet the rule's (metadata wins over rules, so an annotated route never carries a rule).
pub fn guarded(config: &EnvoyConfig) -> Vec<Guarded<'_>> {
    let mut out = Vec::new();
    for m in &config.managers {
        let (Some(settings), Some(table)) = (m.filter.as_ref().and_then(|f| f.settings.as_ref()), &m.routes) else {
            continue;
        };
        for host in &table.hosts {
            for r in host.routes.iter().filter(|r| !matches!(r.target, Target::Local)) {
                let at = format!("{}: virtual host {}: {}", m.at, host.name, r.label);
                match &r.guard {
                    Some(Ok(policy)) => {
                        out.push(Guarded { at, manager: m, settings, host, route: r, policy, rule: None })
                    }
                    Some(Err(_)) => {}
                    None if r.annotation.is_some() => {}
                    None => {
                        for rule in settings.rules.iter().filter(|rule| may_meet(&rule.matcher, &r.matcher)) {
                            out.push(Guarded {
                                at: format!("{}: rule {} via virtual host {}: {}", m.at, rule.name, host.name, r.label),
                                manager: m,
                                settings,
                                host,
                                route: r,
                                policy: &rule.policy,
                                rule: Some(rule),
                            });
                        }
                    }
                }
            }
        }
    }
    out
}

/// Could a request the rule matches be routed by `route`? Conservative: a pattern may match anything; the
/// method and host are not compared.
pub fn may_meet(rule: &RouteMatch, route: &Matcher) -> bool {
    // The literal start of every path the rule matches, and whether that is the whole path.
    let (head, whole) = match &rule.path {
        PathMatch::Prefix(p) => (p.clone(), false),
        PathMatch::Exact(segments) => {
            let literal: Vec<&str> = segments
                .iter()
                .map_while(|s| match s {
                    Segment::Literal(l) => Some(l.as_str()),
                    Segment::Param(_) => None,
                })
                .collect();
            let complete = literal.len() == segments.len();
            let mut head = literal.join("/");
            if !complete {
                head.push('/');
            }
            (head, complete)
        }
    };
    match route {
        Matcher::Pattern(_) => true,
        Matcher::Prefix(p) => head.starts_with(p.as_str()) || (!whole && p.starts_with(head.as_str())),
        Matcher::Exact(p) => match &rule.path {
            PathMatch::Prefix(prefix) => p.starts_with(prefix.as_str()),
            PathMatch::Exact(segments) => {
                let parts: Vec<&str> = p.split('/').collect();
                parts.len() == segments.len()
                    && parts.iter().zip(segments).all(|(part, s)| match s {
                        Segment::Literal(l) => l == part,
                        Segment::Param(_) => !part.is_empty(),
                    })
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::settings::{filter_settings, from_annotation};
    use crate::check::testing::plugin;
    use idem_core::policy::{RouteDefaults, UpstreamKeys};

    fn settings(config: &str) -> Option<FilterSettings> {
        let parsed = idem_core::policy::parse_plugin_config(config.as_bytes(), &crate::tools::placeholder_secret);
        parsed.ok().map(|p| filter_settings(&p))
    }

    fn rule_match(json: &str) -> RouteMatch {
        let config =
            plugin(&format!(r#""routes": [{{"name": "r", "match": {json}, "role": "status", "scope": "s"}}]"#));
        match settings(&config) {
            Some(s) => s.rules[0].matcher.clone(),
            None => panic!("{config}"),
        }
    }

    #[test]
    fn a_rule_meets_the_routes_its_requests_may_take() {
        let exact = rule_match(r#"{"path": "/v1/accounts/{id}/transfers"}"#);
        let prefix = rule_match(r#"{"prefix": "/v1/transfers"}"#);
        let plain = rule_match(r#"{"path": "/v1/transfers"}"#);
        let p = |s: &str| Matcher::Prefix(s.into());
        let e = |s: &str| Matcher::Exact(s.into());
        assert!(may_meet(&exact, &p("/")));
        assert!(may_meet(&exact, &p("/v1/accounts/")));
        assert!(may_meet(&exact, &p("/v1/accounts/42")), "the parameter may be anything");
        assert!(!may_meet(&exact, &p("/v2/")));
        assert!(may_meet(&exact, &e("/v1/accounts/42/transfers")));
        assert!(!may_meet(&exact, &e("/v1/accounts//transfers")));
        assert!(may_meet(&prefix, &p("/v1/")));
        assert!(may_meet(&prefix, &p("/v1/transfers/status")));
        assert!(may_meet(&prefix, &e("/v1/transfers/status")));
        assert!(!may_meet(&prefix, &e("/v1/payees")));
        assert!(may_meet(&plain, &p("/v1/trans")));
        assert!(!may_meet(&plain, &p("/v1/transfers/status")), "the whole path is shorter than the prefix");
        assert!(may_meet(&plain, &Matcher::Pattern("safe_regex .*".into())));
    }

    #[test]
    fn upstream_keys_is_idem_cores_reading_of_rules_and_annotations() {
        let rule = |keys: &str| {
            plugin(&format!(
                r#""routes": [{{"name": "r", "match": {{"path": "/x"}}, "role": "confirm", "scope": "s", "bind": "/a"{keys}}}]"#
            ))
        };
        let keys = |text: &str| settings(text).map(|s| s.rules[0].policy.upstream_keys);
        assert_eq!(keys(&rule("")), None, "no default: the filter refuses it, plugin-config says why");
        assert_eq!(keys(&rule(r#","upstream_keys":"honoured""#)), Some(UpstreamKeys::Honoured));
        assert_eq!(keys(&rule(r#","upstream_keys":"ignored""#)), Some(UpstreamKeys::Ignored));
        assert_eq!(keys(&rule(r#","upstream_keys":"maybe""#)), None, "the filter refuses it: plugin-config says why");

        let defaults = RouteDefaults::default();
        let meta = serde_json::json!({"role": "confirm", "scope": "s", "bind": "/a", "upstream_keys": "ignored"});
        let policy = from_annotation(&meta, &defaults).map(|p| p.map(|p| p.upstream_keys));
        assert_eq!(policy, Ok(Some(UpstreamKeys::Ignored)));
        let meta = serde_json::json!({"role": "confirm", "upstream_keys": "honoured", "scope": "s"});
        assert!(from_annotation(&meta, &defaults).is_err_and(|e| e.contains("bind")), "idem-core's own refusal");
    }
}
