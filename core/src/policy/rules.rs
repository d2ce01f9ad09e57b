//! Route rules in the plugin configuration (DESIGN §6), for meshes where a
//! service owner cannot put metadata on a route (Istio's WasmPlugin selects
//! workloads, not routes).
//!
//! A rule is `{ "name", "match": { "method"?, "host"?, "path" | "prefix" }, "pass_methods"?,
//! ...the route annotation's fields }`. Matching is deliberately small and
//! exact, so what a rule guards is obvious from reading it: an exact path whose
//! `{param}` segments match one non-empty segment, or a literal prefix; an
//! optional method; an optional host (case-insensitive, port ignored). No
//! regular expressions, no query or header matching.
//!
//! A guarded path is guarded for every method (DESIGN §6): a rule with `match.method` guards that
//! method, and any other method on its path is refused (nothing forwarded) unless the rule lists
//! it in `pass_methods` (`["GET", "HEAD"]`: a list endpoint beside a POST-only confirm). Without
//! `match.method` every method is guarded (and `pass_methods` is refused: name the method).
//!
//! Precedence: route metadata, when a route has it, wins; rules apply to routes
//! without an annotation. Two rules that could match one request are refused
//! when the configuration loads, naming both, so the answer never depends on
//! the order of the list.

use super::error::Error;
use super::pairs::LeafValue;
use super::route::{one_approval_rule_per_scope, parse_route_policy, RouteDefaults, RoutePolicy, ROUTE_KEYS};
use serde_json::Value;
use std::rc::Rc;

/// Far above any real configuration; bounds the per-request scan.
pub const MAX_RULES: usize = 256;
const MAX_PATH_LEN: usize = 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteRule {
    pub name: String,
    pub matcher: RouteMatch,
    pub policy: Rc<RoutePolicy>,
    /// Methods that pass this rule's path unguarded (upper case); every other method is guarded.
    pub pass_methods: Vec<String>,
}

impl RouteRule {
    /// Whether `method` passes this rule's path unguarded (method names compared without case:
    /// an upstream may read `get` as GET).
    pub fn passes(&self, method: &str) -> bool {
        self.matcher.method.as_deref().is_some_and(|m| !m.eq_ignore_ascii_case(method.trim()))
            && self.pass_methods.iter().any(|p| p.eq_ignore_ascii_case(method.trim()))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteMatch {
    /// Uppercase; `None` matches any method.
    pub method: Option<String>,
    /// Lowercase, without a port; `None` matches any host.
    pub host: Option<String>,
    pub path: PathMatch,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathMatch {
    /// `/v1/transfers/{id}`: segment by segment.
    Exact(Vec<Segment>),
    /// A literal prefix of the path, as Envoy's `prefix` match.
    Prefix(String),
}

pub use super::template::Segment;

/// The rules of one plugin configuration, checked for overlaps.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RouteRules {
    rules: Vec<RouteRule>,
}

impl RouteRules {
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    pub fn len(&self) -> usize {
        self.rules.len()
    }

    /// The rules in their configured order (tools read their annotations).
    pub fn iter(&self) -> impl Iterator<Item = &RouteRule> {
        self.rules.iter()
    }

    /// The rule for a request: `:method`, `:authority` and `:path` (the query
    /// string is ignored).
    pub fn find(&self, method: &str, authority: &str, path: &str) -> Option<&RouteRule> {
        let path = without_query(path);
        let host = strip_port(authority);
        self.rules.iter().find(|r| r.matcher.matches(method, host, path))
    }

    /// A request to a guarded path that no rule guards as sent (another method): `Some` says why
    /// it is refused, unless every rule naming the path lists the method in `pass_methods`
    /// (DESIGN §6: a guarded path is guarded for every method).
    pub fn method_refused(&self, method: &str, authority: &str, path: &str) -> Option<String> {
        let path = without_query(path);
        let host = strip_port(authority);
        let naming: Vec<&RouteRule> = self
            .rules
            .iter()
            .filter(|r| r.matcher.host.as_deref().is_none_or(|h| h.eq_ignore_ascii_case(host)))
            .filter(|r| r.matcher.path_matches(path))
            .collect();
        if naming.is_empty() || naming.iter().all(|r| r.passes(method)) {
            return None;
        }
        let guarded: Vec<&str> = naming.iter().filter_map(|r| r.matcher.method.as_deref()).collect();
        let passing: Vec<&str> = naming.iter().flat_map(|r| r.pass_methods.iter().map(String::as_str)).collect();
        Some(format!(
            "{path} is guarded for {}; {} nothing else is forwarded: send the operation with {}",
            guarded.join(", "),
            if passing.is_empty() {
                "no method passes it, and".to_string()
            } else {
                format!("{} pass it unguarded;", passing.join(", "))
            },
            guarded.join(" or ")
        ))
    }

    /// Whether any rule's path matches `path`: most requests a mesh sends
    /// through the filter match no rule's path, and a host that must fetch
    /// each header (proxy-wasm copies every value into the VM) can stop here.
    pub fn any_path_matches(&self, path: &str) -> bool {
        let path = without_query(path);
        self.rules.iter().any(|r| r.matcher.path_matches(path))
    }
}

fn without_query(path: &str) -> &str {
    path.split(['?', '#']).next().unwrap_or_default()
}

impl RouteRules {
    /// A request no rule matches as sent, that a rule would match read leniently: with its path
    /// as an upstream may read it (see [`lenient_path`]), its method in another case, or its
    /// method from an override header (`X-HTTP-Method-Override` and kin). The mesh sends such
    /// a request to the same upstream as the guarded one, so it must be refused, never passed
    /// (DESIGN §6). `Some` names the path to send instead.
    pub fn lenient_match(&self, methods: &[&str], authority: &str, path: &str) -> Option<String> {
        let canonical = lenient_path(path);
        let host = strip_port(authority);
        let folded = canonical.as_deref().unwrap_or_else(|| without_query(path));
        // A rule is hit by a method it guards, or by one it does not let pass (refused either way).
        let hit = self.rules.iter().any(|r| {
            methods.iter().any(|m| {
                r.matcher.matches_folded(m, host, folded)
                    || (r.matcher.host.as_deref().is_none_or(|h| h.eq_ignore_ascii_case(host))
                        && r.matcher.path_matches_as(folded, true)
                        && !r.passes(m))
            })
        });
        hit.then(|| folded.to_string())
    }
}

/// A path as a lenient upstream may read it: query and fragment cut, percent-escapes decoded
/// (repeatedly: some decode twice), `;parameters` of a segment dropped, backslashes as slashes,
/// repeated slashes merged, `.` and `..` resolved, no trailing slash, lower case. `None` when
/// the path already is that (the common case costs one scan and no allocation).
pub fn lenient_path(path: &str) -> Option<String> {
    let raw = without_query(path);
    let odd = raw.bytes().any(|b| matches!(b, b'%' | b';' | b'\\') || b.is_ascii_uppercase())
        || raw.contains("//")
        || raw.contains("/.")
        || (raw.len() > 1 && raw.ends_with('/'));
    if !odd {
        return None;
    }
    let mut text = raw.to_string();
    for _ in 0..3 {
        let decoded = percent_decode(&text);
        if decoded == text {
            break;
        }
        text = decoded;
    }
    // A decoded `?` or `#` ends the path for an app that decodes before it splits.
    let text = text.split(['?', '#']).next().unwrap_or_default().replace('\\', "/");
    let mut out: Vec<String> = Vec::new();
    for segment in text.split('/') {
        let segment = segment.split(';').next().unwrap_or_default();
        match segment {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            s => out.push(s.to_lowercase()),
        }
    }
    let canonical = format!("/{}", out.join("/"));
    (canonical != raw).then_some(canonical)
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes.get(i), bytes.get(i + 1).copied().and_then(hex), bytes.get(i + 2).copied().and_then(hex)) {
            (Some(b'%'), Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (Some(&b), _, _) => {
                out.push(b);
                i += 1;
            }
            (None, _, _) => break,
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl RouteMatch {
    fn matches(&self, method: &str, host: &str, path: &str) -> bool {
        self.method.as_deref().is_none_or(|m| m == method)
            && self.host.as_deref().is_none_or(|h| h.eq_ignore_ascii_case(host))
            && self.path_matches(path)
    }

    /// `matches`, with the method in any case and the path's literals compared without case
    /// (the path is already lenient: lower case).
    fn matches_folded(&self, method: &str, host: &str, path: &str) -> bool {
        self.method.as_deref().is_none_or(|m| m.eq_ignore_ascii_case(method.trim()))
            && self.host.as_deref().is_none_or(|h| h.eq_ignore_ascii_case(host))
            && self.path_matches_as(path, true)
    }

    fn path_matches(&self, path: &str) -> bool {
        self.path_matches_as(path, false)
    }

    /// The path against the rule's, its literals exact or (`fold`) without case.
    fn path_matches_as(&self, path: &str, fold: bool) -> bool {
        let same = |g: &str, w: &str| if fold { g.eq_ignore_ascii_case(w) } else { g == w };
        match &self.path {
            PathMatch::Prefix(p) => path.get(..p.len()).is_some_and(|head| same(head, p)),
            PathMatch::Exact(want) => {
                let mut got = path.split('/');
                let mut want = want.iter();
                loop {
                    match (got.next(), want.next()) {
                        (None, None) => break true,
                        (Some(g), Some(Segment::Literal(w))) if same(g, w) => {}
                        (Some(g), Some(Segment::Param(_))) if !g.is_empty() => {}
                        _ => break false,
                    }
                }
            }
        }
    }

    /// Could one request match both? Conservative: a method or host left open
    /// overlaps with any; a parameter overlaps with any literal.
    fn overlaps(&self, other: &RouteMatch) -> bool {
        let method = match (&self.method, &other.method) {
            (Some(a), Some(b)) => a == b,
            _ => true,
        };
        let host = match (&self.host, &other.host) {
            (Some(a), Some(b)) => a == b,
            _ => true,
        };
        method && host && paths_overlap(&self.path, &other.path)
    }
}

fn paths_overlap(a: &PathMatch, b: &PathMatch) -> bool {
    match (a, b) {
        (PathMatch::Prefix(x), PathMatch::Prefix(y)) => x.starts_with(y.as_str()) || y.starts_with(x.as_str()),
        (PathMatch::Exact(segments), PathMatch::Prefix(prefix))
        | (PathMatch::Prefix(prefix), PathMatch::Exact(segments)) => {
            // The most literal path the template allows: does the prefix admit it, or can a parameter?
            let mut text = String::new();
            for (i, s) in segments.iter().enumerate() {
                if i > 0 {
                    text.push('/');
                }
                match s {
                    Segment::Literal(l) => text.push_str(l),
                    // A parameter can be anything: if the prefix reaches into it, they may overlap.
                    Segment::Param(_) => {
                        return prefix.len() > text.len()
                            || prefix.starts_with(text.as_str())
                            || text.starts_with(prefix.as_str())
                    }
                }
            }
            text.starts_with(prefix.as_str())
        }
        (PathMatch::Exact(x), PathMatch::Exact(y)) => {
            x.len() == y.len()
                && x.iter().zip(y).all(|(p, q)| match (p, q) {
                    (Segment::Literal(l), Segment::Literal(m)) => l == m,
                    _ => true,
                })
        }
    }
}

fn strip_port(authority: &str) -> &str {
    if authority.starts_with('[') {
        // [v6]:port
        return authority.split_once(']').map_or(authority, |(h, _)| h.strip_prefix('[').unwrap_or(h));
    }
    authority.rsplit_once(':').filter(|(_, p)| p.bytes().all(|b| b.is_ascii_digit())).map_or(authority, |(h, _)| h)
}

const RULE_FIELDS: &[&str] = &["name", "match", "pass_methods"];
/// Bounds `pass_methods` (HTTP has nine methods; extensions are few).
const MAX_PASS_METHODS: usize = 16;
const MATCH_FIELDS: &[&str] = &["method", "host", "path", "prefix"];

/// The `routes` array of a plugin configuration. Every message names the rule
/// (by index and name) and the field.
pub fn parse_rules(value: &Value, defaults: &RouteDefaults) -> Result<RouteRules, Error> {
    let Value::Array(items) = value else {
        return Err(Error("routes: expected an array of rules".into()));
    };
    if items.len() > MAX_RULES {
        return Err(Error(format!("routes: more than {MAX_RULES} rules")));
    }
    let mut rules: Vec<RouteRule> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let rule = parse_rule(i, item, defaults)?;
        if let Some(other) = rules.iter().find(|r| r.name == rule.name) {
            return Err(Error(format!("routes[{i}] ({}): the name is already used by another rule", other.name)));
        }
        if let Some(other) = rules.iter().find(|r| r.matcher.overlaps(&rule.matcher)) {
            return Err(Error(format!(
                "routes[{i}] ({}): matches requests that rule {} matches too; make their paths, methods or hosts disjoint",
                rule.name, other.name
            )));
        }
        rules.push(rule);
    }
    let confirms = rules.iter().enumerate().flat_map(|(i, rule)| {
        rule.policy.fingerprint_confirms().into_iter().map(move |(tool, policy)| {
            let at = match tool {
                Some(t) => format!("routes[{i}] ({}) tool {t}", rule.name),
                None => format!("routes[{i}] ({})", rule.name),
            };
            (at, policy)
        })
    });
    one_approval_rule_per_scope(confirms).map_err(|(at, message)| Error(format!("{at}: {message}")))?;
    Ok(RouteRules { rules })
}

fn parse_rule(i: usize, item: &Value, defaults: &RouteDefaults) -> Result<RouteRule, Error> {
    let Value::Object(map) = item else {
        return Err(Error(format!("routes[{i}]: expected an object")));
    };
    let name = match map.get("name") {
        Some(Value::String(n)) if !n.is_empty() && n.len() <= 128 && !n.chars().any(char::is_control) => n.clone(),
        _ => return Err(Error(format!("routes[{i}].name: required, 1 to 128 printable characters"))),
    };
    let at = |field: &str| format!("routes[{i}] ({name}).{field}");
    if let Some(unknown) = map.keys().find(|k| !RULE_FIELDS.contains(&k.as_str()) && !ROUTE_KEYS.contains(&k.as_str()))
    {
        return Err(Error(format!(
            "{}: unknown field (expected name, match, or an annotation field: {})",
            at(unknown),
            ROUTE_KEYS.join(", ")
        )));
    }
    let matcher = parse_match(map.get("match"), &at)?;
    let pass_methods = parse_pass_methods(map.get("pass_methods"), &matcher, &at)?;
    if map.contains_key("template") {
        return Err(Error(format!("{}: a route rule's template is its match.path", at("template"))));
    }
    // Where a rule's path is a template, its parameters are the rule's to bind (DESIGN §3).
    let template = match &matcher.path {
        PathMatch::Exact(segments) => Some(super::template::show(segments)),
        PathMatch::Prefix(_) => None,
    };
    let get = |key: &str| match map.get(key) {
        None if key == "template" => template.clone().map(LeafValue::Str),
        None => None,
        Some(Value::String(s)) => Some(LeafValue::Str(s.clone())),
        Some(Value::Number(n)) => n.as_f64().map(LeafValue::Num),
        // Anything else reaches the parser as text it will refuse, naming the field.
        Some(other) => Some(LeafValue::Str(other.to_string())),
    };
    let policy = match parse_route_policy(&get, defaults) {
        Ok(Some(p)) => p,
        Ok(None) => return Err(Error(format!("{}: required (preview, confirm or status)", at("role")))),
        Err(Error(e)) => return Err(Error(format!("routes[{i}] ({name}).{e}"))),
    };
    Ok(RouteRule { name, matcher, policy: Rc::new(policy), pass_methods })
}

/// `pass_methods`: a list of HTTP methods (letters), none twice, never the method the rule guards.
fn parse_pass_methods(
    value: Option<&Value>,
    matcher: &RouteMatch,
    at: &dyn Fn(&str) -> String,
) -> Result<Vec<String>, Error> {
    let Some(value) = value else { return Ok(Vec::new()) };
    let field = at("pass_methods");
    let Value::Array(items) = value else {
        return Err(Error(format!("{field}: expected a list of HTTP methods, e.g. [\"GET\", \"HEAD\"]")));
    };
    if items.len() > MAX_PASS_METHODS {
        return Err(Error(format!("{field}: more than {MAX_PASS_METHODS} methods")));
    }
    let mut out: Vec<String> = Vec::with_capacity(items.len());
    for item in items {
        let method = match item {
            Value::String(m) if !m.is_empty() && m.len() <= 32 && m.bytes().all(|b| b.is_ascii_alphabetic()) => {
                m.to_ascii_uppercase()
            }
            other => return Err(Error(format!("{field}: {other} is not an HTTP method"))),
        };
        if matcher.method.as_deref() == Some(method.as_str()) {
            return Err(Error(format!("{field}: {method} is the method this rule guards; it cannot also pass")));
        }
        if out.contains(&method) {
            return Err(Error(format!("{field}: {method} is listed twice")));
        }
        out.push(method);
    }
    if matcher.method.is_none() && !out.is_empty() {
        // Without match.method the rule guards every method: a list of exceptions would be read
        // the other way round by half of its readers. Name the guarded method instead.
        return Err(Error(format!(
            "{field}: needs match.method (the method the rule guards); without it every method is guarded"
        )));
    }
    Ok(out)
}

fn parse_match(value: Option<&Value>, at: &dyn Fn(&str) -> String) -> Result<RouteMatch, Error> {
    let Some(Value::Object(m)) = value else {
        return Err(Error(format!("{}: required, an object with path or prefix", at("match"))));
    };
    if let Some(unknown) = m.keys().find(|k| !MATCH_FIELDS.contains(&k.as_str())) {
        return Err(Error(format!(
            "{}: unknown field (expected one of: {})",
            at(&format!("match.{unknown}")),
            MATCH_FIELDS.join(", ")
        )));
    }
    let text = |field: &str| -> Result<Option<String>, Error> {
        match m.get(field) {
            None => Ok(None),
            Some(Value::String(s)) if !s.is_empty() && s.len() <= MAX_PATH_LEN => Ok(Some(s.clone())),
            Some(_) => Err(Error(format!("{}: expected a non-empty string", at(&format!("match.{field}"))))),
        }
    };
    let method = match text("method")? {
        Some(m) if m.bytes().all(|b| b.is_ascii_alphabetic()) => Some(m.to_ascii_uppercase()),
        Some(m) => return Err(Error(format!("{}: {m:?} is not an HTTP method", at("match.method")))),
        None => None,
    };
    let host = match text("host")? {
        Some(h) if h.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-')) => {
            Some(h.to_ascii_lowercase())
        }
        Some(h) => {
            return Err(Error(format!("{}: {h:?}: an exact host name (no port, no wildcard)", at("match.host"))))
        }
        None => None,
    };
    let path = match (text("path")?, text("prefix")?) {
        (Some(p), None) => PathMatch::Exact(
            super::template::parse_template(&p).map_err(|why| Error(format!("{}: {why}", at("match.path"))))?,
        ),
        (None, Some(p)) if p.starts_with('/') => PathMatch::Prefix(p),
        (None, Some(p)) => return Err(Error(format!("{}: {p:?} must start with /", at("match.prefix")))),
        _ => return Err(Error(format!("{}: exactly one of path or prefix is required", at("match")))),
    };
    Ok(RouteMatch { method, host, path })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Role;
    use serde_json::json;

    fn rules(v: Value) -> Result<RouteRules, Error> {
        parse_rules(&v, &RouteDefaults::default())
    }

    fn rule(name: &str, m: Value, role: &str) -> Value {
        let mut r =
            json!({"name": name, "match": m, "role": role, "scope": "pay", "bind": "/amount", "lease_ms": 60000});
        let params: Vec<&str> = m["path"]
            .as_str()
            .unwrap_or_default()
            .split('/')
            .filter_map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
            .collect();
        if let (Some(map), "confirm") = (r.as_object_mut(), role) {
            map.insert("upstream_keys".into(), json!("honoured"));
            // These tests are about matching: the parameters are declared not money-relevant.
            if !params.is_empty() {
                map.insert("not_money_relevant".into(), json!(params.join(", ")));
            }
        }
        r
    }

    #[test]
    fn two_confirms_of_one_scope_must_share_their_approval_rule() {
        let confirm = |name: &str, path: &str, approval: Option<serde_json::Value>| {
            let mut r = json!({"name": name, "match": {"path": path}, "role": "confirm", "upstream_keys": "honoured", "scope": "pay",
                               "bind": "/amount:decimal"});
            if let (Some(a), Some(m)) = (approval, r.as_object_mut()) {
                m.insert("approval".into(), a);
            }
            r
        };
        let rule = json!({"field": "/amount", "gte": "1000"});
        let defaults = RouteDefaults::default();
        // The one without the rule would run what the other holds for a person.
        let err =
            parse_rules(&json!([confirm("v1", "/v1/t", Some(rule.clone())), confirm("v2", "/v2/t", None)]), &defaults)
                .err()
                .map(|e| e.0)
                .unwrap_or_default();
        assert!(err.contains("routes[1] (v2): scope \"pay\" is confirmed at routes[0] (v1) too"), "{err}");
        // Another rule is refused as well; the same rule, or another scope, is not.
        let other = json!({"field": "/amount", "gte": "5000"});
        assert!(parse_rules(
            &json!([confirm("v1", "/v1/t", Some(rule.clone())), confirm("v2", "/v2/t", Some(other))]),
            &defaults
        )
        .is_err());
        assert!(parse_rules(
            &json!([confirm("v1", "/v1/t", Some(rule.clone())), confirm("v2", "/v2/t", Some(rule.clone()))]),
            &defaults
        )
        .is_ok());
        let mut apart = confirm("v2", "/v2/t", None);
        if let Some(m) = apart.as_object_mut() {
            m.insert("scope".into(), json!("refunds"));
        }
        assert!(parse_rules(&json!([confirm("v1", "/v1/t", Some(rule)), apart]), &defaults).is_ok());
    }

    #[test]
    fn a_bad_approval_condition_names_the_route_and_the_field() {
        let bad = rules(serde_json::json!([{
            "name": "transfers",
            "match": {"path": "/v1/transfers"},
            "role": "confirm", "upstream_keys": "honoured", "scope": "pay", "bind": "/amount:decimal",
            "approval": {"field": "/amount", "gte": "a lot"}
        }]));
        let err = bad.err().map(|e| e.0).unwrap_or_default();
        assert!(err.contains("routes[0] (transfers).approval.gte (/amount)"), "{err}");
        let good = rules(serde_json::json!([{
            "name": "transfers",
            "match": {"path": "/v1/transfers"},
            "role": "confirm", "upstream_keys": "honoured", "scope": "pay", "bind": "/amount:decimal",
            "approval": {"field": "/amount", "gte": "1000"}
        }]));
        assert!(good.is_ok_and(|r| r.rules.first().is_some_and(|r| r.policy.approval.is_some())));
    }

    #[test]
    fn exact_paths_parameters_prefixes_methods_and_hosts() -> Result<(), Error> {
        let r = rules(json!([
            rule("confirm", json!({"method": "post", "path": "/v1/transfers"}), "confirm"),
            rule("by_id", json!({"path": "/v1/accounts/{id}/pay"}), "confirm"),
            rule("status", json!({"prefix": "/v1/status/", "host": "Pay.Example.com"}), "status"),
        ]))?;
        assert_eq!(r.len(), 3);
        let name = |m: &str, h: &str, p: &str| r.find(m, h, p).map(|x| x.name.clone());
        assert_eq!(name("POST", "any", "/v1/transfers?x=1").as_deref(), Some("confirm"));
        assert_eq!(name("GET", "any", "/v1/transfers"), None, "method");
        assert_eq!(name("POST", "any", "/v1/transfers/"), None, "exact means exact");
        assert_eq!(name("PUT", "h", "/v1/accounts/a-1/pay").as_deref(), Some("by_id"));
        assert_eq!(name("PUT", "h", "/v1/accounts//pay"), None, "a parameter is non-empty");
        assert_eq!(name("PUT", "h", "/v1/accounts/a/b/pay"), None, "one segment");
        assert_eq!(name("GET", "pay.example.com:8443", "/v1/status/x").as_deref(), Some("status"));
        assert_eq!(name("GET", "other.example.com", "/v1/status/x"), None);
        let hit = r.find("POST", "h", "/v1/transfers").map(|x| x.policy.role);
        assert_eq!(hit, Some(Role::Confirm));
        let lease = r.find("POST", "h", "/v1/transfers").map(|x| x.policy.lease_ms);
        assert_eq!(lease, Some(60_000), "numbers arrive as JSON numbers");
        // The path pre-check agrees with `find`: it may say yes where method or host then differ, never no where find says yes.
        for p in
            ["/v1/transfers?x=1", "/v1/accounts/a-1/pay", "/v1/status/x", "/v1/transfers/", "/v1/accounts//pay", "/"]
        {
            let found = ["POST", "PUT", "GET"].iter().any(|m| r.find(m, "pay.example.com", p).is_some());
            assert!(!found || r.any_path_matches(p), "{p}");
        }
        assert!(r.any_path_matches("/v1/transfers?x=1") && r.any_path_matches("/v1/status/x"));
        assert!(!r.any_path_matches("/v1/transfers/") && !r.any_path_matches("/healthz"));
        Ok(())
    }

    #[test]
    fn what_a_lenient_upstream_reads_as_a_guarded_path_is_found() -> Result<(), Error> {
        let r = rules(json!([
            rule("confirm", json!({"method": "POST", "path": "/v1/transfers"}), "confirm"),
            rule("by_id", json!({"path": "/v1/accounts/{id}/pay"}), "confirm"),
        ]))?;
        for path in [
            "/v1/transfers/",
            "//v1/transfers",
            "/v1//transfers",
            "/v1/%74ransfers",
            "/v1/%2574ransfers",
            "/v1/transfers%2F",
            "/v1/./transfers",
            "/v1/x/../transfers",
            "/V1/Transfers",
            "/v1/transfers;x=1",
            "/v1\\transfers",
            "/v1/accounts/A-1/PAY/",
            "/v1/transfers%3Fx=1",
            "/v1/transfers%23frag",
            "/v1/transfers%3fx",
        ] {
            assert!(r.find("POST", "h", path).is_none(), "{path} is not matched as sent");
            assert!(r.lenient_match(&["POST"], "h", path).is_some(), "{path}");
        }
        // The method, in another case or from an override header, is read leniently too.
        assert_eq!(r.lenient_match(&["post"], "h", "/v1/transfers").as_deref(), Some("/v1/transfers"));
        assert!(r.lenient_match(&["GET", "POST"], "h", "/v1/transfers").is_some());
        // Another method on the guarded path is refused as well, unless the rule lets it pass.
        assert!(r.lenient_match(&["GET"], "h", "/v1/transfers").is_some());
        let passing = rules(json!([{"name": "confirm", "match": {"method": "POST", "path": "/v1/transfers"},
            "pass_methods": ["GET"], "role": "confirm", "upstream_keys": "honoured", "scope": "pay", "bind": "/amount", "lease_ms": 60000}]))?;
        assert!(passing.lenient_match(&["GET"], "h", "/V1/transfers").is_none());
        assert!(passing.lenient_match(&["GET", "PUT"], "h", "/V1/transfers").is_some());
        // Other paths stay other paths, and a plain path costs no allocation.
        for path in ["/v1/transfers/preview", "/v1/transfer", "/healthz", "/v1/accounts//pay"] {
            assert!(r.lenient_match(&["POST"], "h", path).is_none(), "{path}");
        }
        assert_eq!(lenient_path("/v1/transfers?x=1"), None);
        assert_eq!(lenient_path("/a/b"), None);
        Ok(())
    }

    /// A rule's path is guarded for every method. Its own method runs the role;
    /// `pass_methods` pass unguarded; every other method is refused (`method_refused` says why).
    #[test]
    fn a_guarded_path_is_guarded_for_every_method_but_those_the_rule_lets_pass() -> Result<(), Error> {
        let with_pass = |pass: Value| {
            json!({"name": "confirm", "match": {"method": "POST", "path": "/v1/transfers/{id}"}, "pass_methods": pass,
                   "role": "confirm", "upstream_keys": "honoured", "scope": "pay", "bind": "/amount, path:id", "lease_ms": 60000})
        };
        let post_only =
            rules(json!([rule("confirm", json!({"method": "POST", "path": "/v1/transfers/{id}"}), "confirm")]))?;
        for method in ["PUT", "PATCH", "DELETE", "GET", "HEAD", "post", "Post"] {
            assert!(post_only.find(method, "h", "/v1/transfers/7").is_none(), "{method}");
            let why = post_only.method_refused(method, "h", "/v1/transfers/7?x").unwrap_or_default();
            assert!(why.contains("guarded for POST") && why.contains("no method passes"), "{method}: {why}");
        }
        assert_eq!(post_only.method_refused("PUT", "h", "/v1/other"), None, "another path is not the rule's");
        let list = rules(json!([with_pass(json!(["get", "HEAD"]))]))?;
        assert_eq!(list.method_refused("GET", "h", "/v1/transfers/7"), None);
        assert_eq!(list.method_refused("head", "h", "/v1/transfers/7"), None);
        for method in ["PUT", "PATCH", "DELETE"] {
            let why = list.method_refused(method, "h", "/v1/transfers/7").unwrap_or_default();
            assert!(why.contains("GET, HEAD pass it unguarded"), "{method}: {why}");
        }
        // Two rules on one path with two methods: each guards its own; a third method passes only if both let it.
        let two = rules(json!([
            rule("confirm", json!({"method": "POST", "path": "/v1/t"}), "confirm"),
            {"name": "status", "match": {"method": "GET", "path": "/v1/t"}, "pass_methods": ["HEAD"], "role": "status",
             "scope": "pay"},
        ]))?;
        assert_eq!(two.find("GET", "h", "/v1/t").map(|r| r.name.as_str()), Some("status"));
        assert!(two.method_refused("HEAD", "h", "/v1/t").is_some(), "the confirm rule does not let HEAD pass");
        // Validated at load: methods, no duplicates, never the guarded method, and a method to guard.
        for (pass, m, want) in [
            (json!("GET"), json!({"method": "POST", "path": "/a"}), "expected a list of HTTP methods"),
            (json!(["G ET"]), json!({"method": "POST", "path": "/a"}), "is not an HTTP method"),
            (json!([1]), json!({"method": "POST", "path": "/a"}), "is not an HTTP method"),
            (json!(["GET", "get"]), json!({"method": "POST", "path": "/a"}), "listed twice"),
            (json!(["post"]), json!({"method": "POST", "path": "/a"}), "the method this rule guards"),
            (json!(["GET"]), json!({"path": "/a"}), "needs match.method"),
        ] {
            let r = json!([{"name": "c", "match": m, "pass_methods": pass, "role": "confirm", "upstream_keys": "honoured", "scope": "pay", "bind": "/amount"}]);
            let err = rules(r).err().map(|e| e.0).unwrap_or_default();
            assert!(err.contains("routes[0] (c).pass_methods") && err.contains(want), "{err}");
        }
        Ok(())
    }

    #[test]
    fn overlapping_rules_are_refused_at_load_naming_both() {
        let cases = [
            (json!({"path": "/a/{x}"}), json!({"path": "/a/b"})),
            (json!({"prefix": "/a/"}), json!({"path": "/a/b"})),
            (json!({"prefix": "/a"}), json!({"prefix": "/a/b"})),
            (json!({"path": "/a/b", "method": "POST"}), json!({"path": "/a/b"})),
            (json!({"path": "/a/{x}/c"}), json!({"prefix": "/a/zz"})),
        ];
        for (a, b) in cases {
            let got = rules(json!([rule("first", a.clone(), "confirm"), rule("second", b.clone(), "preview")]));
            let msg = got.map(|_| String::new()).unwrap_or_else(|e| e.0);
            assert!(
                msg.starts_with("routes[1] (second): matches requests that rule first matches too"),
                "{a} {b}: {msg}"
            );
        }
        let disjoint = [
            (json!({"path": "/a/b", "method": "POST"}), json!({"path": "/a/b", "method": "GET"})),
            (json!({"path": "/a/b", "host": "x.example"}), json!({"path": "/a/b", "host": "y.example"})),
            (json!({"prefix": "/a/"}), json!({"prefix": "/b/"})),
            (json!({"path": "/a/{x}"}), json!({"path": "/a/{x}/c"})),
        ];
        for (a, b) in disjoint {
            assert!(
                rules(json!([rule("first", a.clone(), "confirm"), rule("second", b.clone(), "preview")])).is_ok(),
                "{a} {b}"
            );
        }
    }

    #[test]
    fn bad_rules_name_the_rule_and_the_field() {
        let cases = [
            (json!({"match": {"path": "/x"}, "role": "confirm"}), "routes[0].name: required"),
            (
                json!({"name": "r", "role": "confirm", "upstream_keys": "honoured", "scope": "s", "bind": "/a"}),
                "routes[0] (r).match: required",
            ),
            (
                json!({"name": "r", "match": {"path": "/x", "prefix": "/y"}, "role": "confirm"}),
                "routes[0] (r).match: exactly one of",
            ),
            (json!({"name": "r", "match": {"path": "x"}}), "routes[0] (r).match.path: \"x\" must start with /"),
            (json!({"name": "r", "match": {"path": "/x/*"}}), "routes[0] (r).match.path: segment \"*\""),
            (json!({"name": "r", "match": {"path": "/x?a=1"}}), "routes[0] (r).match.path: \"/x?a=1\": query"),
            (json!({"name": "r", "match": {"regex": "/x"}}), "routes[0] (r).match.regex: unknown field"),
            (json!({"name": "r", "match": {"host": "*.x.com", "path": "/x"}}), "routes[0] (r).match.host"),
            (
                json!({"name": "r", "match": {"path": "/x"}, "role": "confirm", "upstream_keys": "honoured", "scope": "s"}),
                "routes[0] (r).bind: required",
            ),
            (json!({"name": "r", "match": {"path": "/x"}, "scope": "s"}), "routes[0] (r).role: required"),
            (
                json!({"name": "r", "match": {"path": "/x"}, "role": "confirm", "upstream_keys": "honoured", "scope": "s", "bind": "/a", "lease_ms": 5}),
                "routes[0] (r).lease_ms: expected an integer",
            ),
            (
                json!({"name": "r", "match": {"path": "/x"}, "role": "confirm", "upstream_keys": "honoured", "scope": "s", "bind": "/a", "colour": 1}),
                "routes[0] (r).colour: unknown field",
            ),
        ];
        for (r, want) in cases {
            let got = rules(json!([r.clone()])).map(|_| String::new()).unwrap_or_else(|e| e.0);
            assert!(got.starts_with(want), "{r}: want {want:?}, got {got:?}");
        }
        let dup =
            rules(json!([rule("r", json!({"path": "/a"}), "confirm"), rule("r", json!({"path": "/b"}), "confirm")]));
        assert!(dup.is_err());
    }

    /// A rule's template is its match.path: its parameters are the rule's to bind (DESIGN §3).
    #[test]
    fn a_rule_binds_the_parameters_of_its_match_path() {
        let confirm = |m: Value, extra: Value| {
            let mut r = json!({"name": "pay", "match": m, "role": "confirm", "upstream_keys": "honoured", "scope": "s",
                               "bind": "/amount"});
            if let (Some(map), Value::Object(more)) = (r.as_object_mut(), extra) {
                map.extend(more);
            }
            rules(json!([r])).map(|r| r.rules.first().map(|r| r.policy.bound.len()))
        };
        let path = json!({"path": "/v1/accounts/{account}/transfers"});
        let err = confirm(path.clone(), json!({})).err().map(|e| e.0).unwrap_or_default();
        assert!(
            err.starts_with("routes[0] (pay).template: {account} of /v1/accounts/{account}/transfers is neither bound"),
            "{err}"
        );
        assert_eq!(confirm(path.clone(), json!({"bind": "/amount, path:account"})), Ok(Some(2)));
        assert_eq!(confirm(path.clone(), json!({"not_money_relevant": "account"})), Ok(Some(1)));
        let err = confirm(path, json!({"template": "/x/{y}"})).err().map(|e| e.0).unwrap_or_default();
        assert!(err.starts_with("routes[0] (pay).template: a route rule's template is its match.path"), "{err}");
        // A prefix has no template to read a path value from.
        let err =
            confirm(json!({"prefix": "/v1/"}), json!({"bind": "path:account"})).err().map(|e| e.0).unwrap_or_default();
        assert!(
            err.starts_with("routes[0] (pay).bind: path:account: a path value needs the route's template"),
            "{err}"
        );
    }

    #[test]
    fn ports_are_ignored_in_hosts() {
        assert_eq!(strip_port("pay.example.com:8080"), "pay.example.com");
        assert_eq!(strip_port("pay.example.com"), "pay.example.com");
        assert_eq!(strip_port("[::1]:80"), "::1");
    }
}
