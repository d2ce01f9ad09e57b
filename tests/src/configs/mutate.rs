//! Mutations of a committed Envoy configuration: each is one change an
//! operator, a mesh or a gateway might make (another virtual host, another
//! listener, a rewrite, a mirror, a retry, a timeout, a catch-all, a route
//! rule's method, the filter disabled on a route, a header or Host match…),
//! drawn from a seeded generator so every configuration is reproducible from
//! the seed and its number. Many of them open a way around the guard; that is
//! the point: `idemd check` must refuse those, and whatever it accepts is run
//! and probed.

use idem_testkit::envoy_config::{filter_disabled, static_cluster, Doc, AGENT};
use rand::seq::SliceRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

use crate::BoxError;

/// Paths a mutation sends requests to or rewrites onto: the demo's confirm, its near misses, and paths nothing
/// guards.
pub const PATHS: &[&str] = &[
    "/v1/transfers",
    "/v1/transfers/",
    "/V1/Transfers",
    "/v1/transfers/preview",
    "/v1/executions",
    "/healthz",
    "/mcp",
    "/elsewhere",
];

/// What a mutation can use of the configuration it changes.
pub struct Ctx {
    /// The demo's port (a cluster with its address is the demo).
    pub demo_port: u16,
}

type Mutation = fn(&mut Doc, &mut ChaCha8Rng, &Ctx) -> Result<Option<String>, BoxError>;

/// Every mutation, by name.
pub const MUTATIONS: &[(&str, Mutation)] = &[
    ("virtual-host", virtual_host),
    ("listener", listener),
    ("rewrite", rewrite),
    ("mirror", mirror),
    ("retry", retry),
    ("timeout", timeout),
    ("catch-all", catch_all),
    ("route-rule-method", route_rule_method),
    ("route-method", route_method),
    ("filter-disabled", disabled),
    ("header-match", header_match),
    ("host-match", host_match),
    ("unannotate", unannotate),
    ("alias-cluster", alias_cluster),
    ("hedge", hedge),
    ("internal-redirect", internal_redirect),
    ("exact-route", exact_route),
    ("cluster-header", cluster_header),
    ("path-template", path_template),
    // What most changes to a working configuration are: nothing to do with the guard. Twice in the draw, so that
    // a fair share of the configurations is accepted and probed.
    ("unrelated", unrelated),
    ("unrelated", unrelated),
];

/// Apply `count` mutations drawn from `rng`; their descriptions, in order.
pub fn mutate(doc: &mut Doc, rng: &mut ChaCha8Rng, ctx: &Ctx, count: usize) -> Result<Vec<String>, BoxError> {
    let mut done = Vec::new();
    let mut tries = 0;
    while done.len() < count && tries < count * 8 {
        tries += 1;
        let (name, m) = MUTATIONS[rng.gen_range(0..MUTATIONS.len())];
        if let Some(what) = m(doc, rng, ctx)? {
            done.push(format!("{name}: {what}"));
        }
    }
    Ok(done)
}

fn pick<'a, T>(rng: &mut ChaCha8Rng, items: &'a [T]) -> Option<&'a T> {
    items.choose(rng)
}

fn name_of(doc: &Doc, pointer: &str) -> String {
    doc.0.pointer(&format!("{pointer}/name")).and_then(Value::as_str).unwrap_or("(unnamed)").to_string()
}

/// Routes that forward (have a `route` action).
fn forwarding(doc: &Doc) -> Vec<String> {
    doc.routes().into_iter().filter(|r| doc.0.pointer(&format!("{r}/route")).is_some()).collect()
}

fn annotated(doc: &Doc) -> Vec<String> {
    doc.routes()
        .into_iter()
        .filter(|r| doc.0.pointer(&format!("{r}/metadata/filter_metadata/{AGENT}")).is_some())
        .collect()
}

fn cluster(doc: &Doc, rng: &mut ChaCha8Rng) -> String {
    pick(rng, &doc.clusters()).cloned().unwrap_or_else(|| "demo".into())
}

/// The demo's cluster: the one sending to its port.
fn demo_cluster(doc: &Doc, ctx: &Ctx) -> Option<String> {
    let clusters = doc.0.pointer("/static_resources/clusters").and_then(Value::as_array)?;
    clusters.iter().find_map(|c| {
        let port = c.pointer("/load_assignment/endpoints/0/lb_endpoints/0/endpoint/address/socket_address/port_value");
        (port.and_then(Value::as_u64) == Some(u64::from(ctx.demo_port)))
            .then(|| c.get("name").and_then(Value::as_str).map(str::to_string))
            .flatten()
    })
}

fn path(rng: &mut ChaCha8Rng) -> String {
    pick(rng, PATHS).copied().unwrap_or("/v1/transfers").to_string()
}

fn virtual_host(doc: &mut Doc, rng: &mut ChaCha8Rng, ctx: &Ctx) -> Result<Option<String>, BoxError> {
    let Some(m) = pick(rng, &doc.managers()).cloned() else { return Ok(None) };
    if doc.0.pointer(&format!("{m}/route_config")).is_none() {
        return Ok(None);
    }
    let n: u32 = rng.gen_range(0..1000);
    let to =
        if rng.gen_bool(0.6) { demo_cluster(doc, ctx).unwrap_or_else(|| cluster(doc, rng)) } else { cluster(doc, rng) };
    let from = path(rng);
    let mut action = json!({ "cluster": to });
    if rng.gen_bool(0.5) {
        action["prefix_rewrite"] = json!(path(rng));
    }
    let mut routes = vec![json!({ "name": format!("m{n}"), "match": { "path": from }, "route": action })];
    let rest = if rng.gen_bool(0.5) {
        json!({ "match": { "prefix": "/" }, "direct_response": { "status": 404 } })
    } else {
        json!({ "match": { "prefix": "/" }, "route": { "cluster": cluster(doc, rng) } })
    };
    routes.push(rest.clone());
    let host = format!("m{n}.example");
    doc.add_virtual_host(&m, json!({ "name": format!("m{n}"), "domains": [host], "routes": routes }))?;
    Ok(Some(format!("virtual host {host}: {from} → {action}, then {rest}")))
}

fn listener(doc: &mut Doc, rng: &mut ChaCha8Rng, _: &Ctx) -> Result<Option<String>, BoxError> {
    let count = doc.0.pointer("/static_resources/listeners").and_then(Value::as_array).map_or(0, Vec::len);
    if count == 0 {
        return Ok(None);
    }
    let without = rng.gen_bool(0.5);
    let n: u32 = rng.gen_range(0..1000);
    let name = format!("extra{n}");
    // Port 0: Envoy picks one; the probe asks the admin interface which.
    let copy = doc.copy_listener(0, &name, 0, without)?;
    doc.add_listener(copy)?;
    Ok(Some(format!("listener {name}, a copy of the first{}", if without { " without the agent filter" } else { "" })))
}

fn rewrite(doc: &mut Doc, rng: &mut ChaCha8Rng, _: &Ctx) -> Result<Option<String>, BoxError> {
    let Some(r) = pick(rng, &forwarding(doc)).cloned() else { return Ok(None) };
    let to = path(rng);
    let exact = doc.0.pointer(&format!("{r}/match/path")).and_then(Value::as_str).map(str::to_string);
    let action = doc.object_mut(&format!("{r}/route"))?;
    action.remove("prefix_rewrite");
    action.remove("regex_rewrite");
    match exact {
        Some(from) if rng.gen_bool(0.5) => {
            action.insert(
                "regex_rewrite".into(),
                json!({ "pattern": { "regex": format!("^{}$", regex_escape(&from)) }, "substitution": to }),
            );
            Ok(Some(format!("route {}: regex_rewrite {from} → {to}", name_of(doc, &r))))
        }
        _ => {
            action.insert("prefix_rewrite".into(), json!(to));
            Ok(Some(format!("route {}: prefix_rewrite {to}", name_of(doc, &r))))
        }
    }
}

fn regex_escape(s: &str) -> String {
    s.chars()
        .flat_map(|c| if c.is_ascii_alphanumeric() || c == '/' || c == '_' { vec![c] } else { vec!['\\', c] })
        .collect()
}

fn mirror(doc: &mut Doc, rng: &mut ChaCha8Rng, _: &Ctx) -> Result<Option<String>, BoxError> {
    let to = cluster(doc, rng);
    let policy = json!([{ "cluster": to }]);
    if rng.gen_bool(0.3) {
        let Some(h) = pick(rng, &doc.virtual_hosts()).cloned() else { return Ok(None) };
        doc.object_mut(&h)?.insert("request_mirror_policies".into(), policy);
        return Ok(Some(format!("virtual host {}: mirror to {to}", name_of(doc, &h))));
    }
    let Some(r) = pick(rng, &forwarding(doc)).cloned() else { return Ok(None) };
    doc.object_mut(&format!("{r}/route"))?.insert("request_mirror_policies".into(), policy);
    Ok(Some(format!("route {}: mirror to {to}", name_of(doc, &r))))
}

const RETRY_ON: &[&str] = &[
    "5xx",
    "reset",
    "connect-failure",
    "retriable-4xx",
    "reset,connect-failure",
    "envoy-ratelimited",
    "gateway-error",
];

fn retry(doc: &mut Doc, rng: &mut ChaCha8Rng, _: &Ctx) -> Result<Option<String>, BoxError> {
    let on = pick(rng, RETRY_ON).copied().unwrap_or("reset");
    let policy = json!({ "retry_on": on, "num_retries": rng.gen_range(1..4) });
    if rng.gen_bool(0.3) {
        let Some(h) = pick(rng, &doc.virtual_hosts()).cloned() else { return Ok(None) };
        let host = doc.object_mut(&h)?;
        host.insert("retry_policy".into(), policy);
        host.insert("include_attempt_count_in_response".into(), json!(true));
        return Ok(Some(format!("virtual host {}: retry on {on}", name_of(doc, &h))));
    }
    let Some(r) = pick(rng, &forwarding(doc)).cloned() else { return Ok(None) };
    doc.object_mut(&format!("{r}/route"))?.insert("retry_policy".into(), policy);
    Ok(Some(format!("route {}: retry on {on}", name_of(doc, &r))))
}

fn timeout(doc: &mut Doc, rng: &mut ChaCha8Rng, _: &Ctx) -> Result<Option<String>, BoxError> {
    let Some(r) = pick(rng, &forwarding(doc)).cloned() else { return Ok(None) };
    let value = pick(rng, &["1s", "5s", "15s", "30s", "120s", "0s"]).copied().unwrap_or("5s");
    let key = if rng.gen_bool(0.7) { "timeout" } else { "idle_timeout" };
    doc.object_mut(&format!("{r}/route"))?.insert(key.into(), json!(value));
    Ok(Some(format!("route {}: {key} {value}", name_of(doc, &r))))
}

fn catch_all(doc: &mut Doc, rng: &mut ChaCha8Rng, ctx: &Ctx) -> Result<Option<String>, BoxError> {
    let Some(h) = pick(rng, &doc.virtual_hosts()).cloned() else { return Ok(None) };
    let to =
        if rng.gen_bool(0.5) { demo_cluster(doc, ctx).unwrap_or_else(|| cluster(doc, rng)) } else { cluster(doc, rng) };
    let len = doc.0.pointer(&format!("{h}/routes")).and_then(Value::as_array).map_or(0, Vec::len);
    let at = rng.gen_range(0..=len);
    let prefix = pick(rng, &["/", "/v1/", "/v1/transfers"]).copied().unwrap_or("/");
    doc.insert_route(
        &h,
        at,
        json!({ "name": "catch_all", "match": { "prefix": prefix }, "route": { "cluster": to } }),
    )?;
    Ok(Some(format!("virtual host {}: prefix {prefix} → {to} at #{at}", name_of(doc, &h))))
}

/// The agent filter's plugin configuration in manager `m`, as JSON, with where its text lives.
fn plugin_config(doc: &Doc, m: &str) -> Option<(String, Value)> {
    let (i, _) = doc.agent_filter(m)?;
    let f = format!("{m}/http_filters/{i}/typed_config");
    let at = [format!("{f}/config/configuration/value"), format!("{f}/filter_config/value")]
        .into_iter()
        .find(|p| doc.0.pointer(p).and_then(Value::as_str).is_some())?;
    let config = serde_json::from_str(doc.0.pointer(&at)?.as_str()?).ok()?;
    Some((at, config))
}

fn route_rule_method(doc: &mut Doc, rng: &mut ChaCha8Rng, _: &Ctx) -> Result<Option<String>, BoxError> {
    let with_rules: Vec<(String, Value)> = doc
        .managers()
        .iter()
        .filter_map(|m| plugin_config(doc, m))
        .filter(|(_, c)| c["routes"].as_array().is_some_and(|r| !r.is_empty()))
        .collect();
    let Some((at, mut config)) = pick(rng, &with_rules).cloned() else { return Ok(None) };
    let Some(rules) = config["routes"].as_array_mut() else { return Ok(None) };
    let i = rng.gen_range(0..rules.len());
    let name = rules[i]["name"].as_str().unwrap_or("(unnamed)").to_string();
    let method = pick(rng, &[None, Some("POST"), Some("PUT"), Some("GET")]).copied().flatten();
    let what = match (method, rules[i]["match"].as_object_mut()) {
        (Some(m), Some(matcher)) => {
            matcher.insert("method".into(), json!(m));
            format!("rule {name}: method {m}")
        }
        (None, Some(matcher)) => {
            matcher.remove("method");
            format!("rule {name}: any method")
        }
        (_, None) => return Ok(None),
    };
    *doc.at_mut(&at)? = json!(config.to_string());
    Ok(Some(what))
}

fn route_method(doc: &mut Doc, rng: &mut ChaCha8Rng, _: &Ctx) -> Result<Option<String>, BoxError> {
    let Some(r) = pick(rng, &forwarding(doc)).cloned() else { return Ok(None) };
    let method = pick(rng, &[None, Some("POST"), Some("PUT")]).copied().flatten();
    let matcher = doc.object_mut(&format!("{r}/match"))?;
    let mut headers: Vec<Value> = matcher.get("headers").and_then(Value::as_array).cloned().unwrap_or_default();
    headers.retain(|h| h["name"] != ":method");
    if let Some(m) = method {
        headers.push(json!({ "name": ":method", "string_match": { "exact": m } }));
    }
    if headers.is_empty() {
        matcher.remove("headers");
    } else {
        matcher.insert("headers".into(), json!(headers));
    }
    Ok(Some(format!("route {}: method {}", name_of(doc, &r), method.unwrap_or("any"))))
}

fn disabled(doc: &mut Doc, rng: &mut ChaCha8Rng, _: &Ctx) -> Result<Option<String>, BoxError> {
    let filter = doc.managers().iter().find_map(|m| doc.agent_filter(m)).map(|(_, name)| name);
    let Some(filter) = filter else { return Ok(None) };
    if rng.gen_bool(0.3) {
        let Some(h) = pick(rng, &doc.virtual_hosts()).cloned() else { return Ok(None) };
        doc.object_mut(&h)?.insert("typed_per_filter_config".into(), filter_disabled(&filter));
        return Ok(Some(format!("virtual host {}: the filter disabled", name_of(doc, &h))));
    }
    let Some(r) = pick(rng, &doc.routes()).cloned() else { return Ok(None) };
    doc.object_mut(&r)?.insert("typed_per_filter_config".into(), filter_disabled(&filter));
    Ok(Some(format!("route {}: the filter disabled", name_of(doc, &r))))
}

fn header_match(doc: &mut Doc, rng: &mut ChaCha8Rng, _: &Ctx) -> Result<Option<String>, BoxError> {
    let Some(r) = pick(rng, &forwarding(doc)).cloned() else { return Ok(None) };
    let matcher = doc.object_mut(&format!("{r}/match"))?;
    let headers = matcher.entry("headers").or_insert_with(|| json!([]));
    if let Some(list) = headers.as_array_mut() {
        list.push(json!({ "name": "x-variant", "string_match": { "exact": "a" } }));
    }
    Ok(Some(format!("route {}: only with x-variant: a", name_of(doc, &r))))
}

fn host_match(doc: &mut Doc, rng: &mut ChaCha8Rng, _: &Ctx) -> Result<Option<String>, BoxError> {
    let Some(h) = pick(rng, &doc.virtual_hosts()).cloned() else { return Ok(None) };
    let n: u32 = rng.gen_range(0..1000);
    let domain = format!("h{n}.example");
    let host = doc.object_mut(&h)?;
    if rng.gen_bool(0.5) {
        host.insert("domains".into(), json!([domain]));
        Ok(Some(format!("virtual host {}: only Host {domain}", name_of(doc, &h))))
    } else {
        if let Some(d) = host.get_mut("domains").and_then(Value::as_array_mut) {
            d.push(json!(domain));
        }
        Ok(Some(format!("virtual host {}: also Host {domain}", name_of(doc, &h))))
    }
}

/// The upstream path of an exact route (its `prefix_rewrite`, else its path), when it has one.
fn upstream_path(doc: &Doc, r: &str) -> Option<String> {
    let route = doc.0.pointer(r)?;
    let path = route.pointer("/match/path")?.as_str()?;
    let rewrite = route.pointer("/route/prefix_rewrite").and_then(Value::as_str);
    Some(rewrite.unwrap_or(path).to_string())
}

/// The annotation taken off a route whose upstream path another annotated route still guards: the way an
/// unannotated namesake or a forgotten copy of a guarded route appears. (Taking off a path's only annotation
/// takes the operator's statement that the path is guarded with it; no check can see what nothing states.)
fn unannotate(doc: &mut Doc, rng: &mut ChaCha8Rng, _: &Ctx) -> Result<Option<String>, BoxError> {
    let all = annotated(doc);
    let shared: Vec<String> = all
        .iter()
        .filter(|r| {
            let Some(up) = upstream_path(doc, r) else { return false };
            all.iter().any(|o| o != *r && upstream_path(doc, o).as_deref() == Some(up.as_str()))
        })
        .cloned()
        .collect();
    let Some(r) = pick(rng, &shared).cloned() else { return Ok(None) };
    doc.object_mut(&r)?.remove("metadata");
    Ok(Some(format!("route {}: annotation removed (another route still guards its path)", name_of(doc, &r))))
}

fn alias_cluster(doc: &mut Doc, rng: &mut ChaCha8Rng, ctx: &Ctx) -> Result<Option<String>, BoxError> {
    let Some(r) = pick(rng, &forwarding(doc)).cloned() else { return Ok(None) };
    let n: u32 = rng.gen_range(0..1000);
    let name = format!("alias{n}");
    doc.add_cluster(static_cluster(&name, "127.0.0.1", ctx.demo_port))?;
    let action = doc.object_mut(&format!("{r}/route"))?;
    for other in ["weighted_clusters", "cluster_header", "cluster_specifier_plugin"] {
        action.remove(other);
    }
    action.insert("cluster".into(), json!(name));
    Ok(Some(format!("route {}: to cluster {name}, the demo's address", name_of(doc, &r))))
}

fn hedge(doc: &mut Doc, rng: &mut ChaCha8Rng, _: &Ctx) -> Result<Option<String>, BoxError> {
    let Some(r) = pick(rng, &forwarding(doc)).cloned() else { return Ok(None) };
    doc.object_mut(&format!("{r}/route"))?.insert("hedge_policy".into(), json!({ "hedge_on_per_try_timeout": true }));
    Ok(Some(format!("route {}: hedge on per-try timeout", name_of(doc, &r))))
}

fn internal_redirect(doc: &mut Doc, rng: &mut ChaCha8Rng, _: &Ctx) -> Result<Option<String>, BoxError> {
    let Some(r) = pick(rng, &forwarding(doc)).cloned() else { return Ok(None) };
    doc.object_mut(&format!("{r}/route"))?
        .insert("internal_redirect_policy".into(), json!({ "max_internal_redirects": 2 }));
    Ok(Some(format!("route {}: internal redirects", name_of(doc, &r))))
}

fn exact_route(doc: &mut Doc, rng: &mut ChaCha8Rng, ctx: &Ctx) -> Result<Option<String>, BoxError> {
    let Some(h) = pick(rng, &doc.virtual_hosts()).cloned() else { return Ok(None) };
    let n: u32 = rng.gen_range(0..1000);
    let from = format!("/x{n}{}", path(rng));
    let to = path(rng);
    let cluster =
        if rng.gen_bool(0.7) { demo_cluster(doc, ctx).unwrap_or_else(|| cluster(doc, rng)) } else { cluster(doc, rng) };
    let route = json!({ "name": format!("x{n}"), "match": { "path": from }, "route": { "cluster": cluster, "prefix_rewrite": to } });
    doc.insert_route(&h, 0, route)?;
    Ok(Some(format!("virtual host {}: {from} → {to} on {cluster}", name_of(doc, &h))))
}

fn cluster_header(doc: &mut Doc, rng: &mut ChaCha8Rng, _: &Ctx) -> Result<Option<String>, BoxError> {
    let Some(h) = pick(rng, &doc.virtual_hosts()).cloned() else { return Ok(None) };
    let from = path(rng);
    doc.insert_route(
        &h,
        0,
        json!({ "name": "by_header", "match": { "path": from }, "route": { "cluster_header": "x-cluster" } }),
    )?;
    Ok(Some(format!("virtual host {}: {from} → the cluster x-cluster names", name_of(doc, &h))))
}

/// A change that opens nothing: an unguarded route to a path nothing guards, a virtual host answering locally, a
/// response header, another stat prefix.
fn unrelated(doc: &mut Doc, rng: &mut ChaCha8Rng, ctx: &Ctx) -> Result<Option<String>, BoxError> {
    let Some(h) = pick(rng, &doc.virtual_hosts()).cloned() else { return Ok(None) };
    let n: u32 = rng.gen_range(0..1000);
    match rng.gen_range(0..4) {
        0 => {
            let to = pick(rng, &["/healthz", "/v1/executions"]).copied().unwrap_or("/healthz");
            let cluster = demo_cluster(doc, ctx).unwrap_or_else(|| cluster(doc, rng));
            let route = json!({ "name": format!("u{n}"), "match": { "path": format!("/u{n}") }, "route": { "cluster": cluster, "prefix_rewrite": to } });
            doc.insert_route(&h, 0, route)?;
            Ok(Some(format!("virtual host {}: /u{n} → {to}", name_of(doc, &h))))
        }
        1 => {
            let m = h.split("/route_config").next().unwrap_or_default().to_string();
            let host = json!({ "name": format!("u{n}"), "domains": [format!("u{n}.example")], "routes": [
                { "match": { "prefix": "/" }, "direct_response": { "status": 503, "body": { "inline_string": "maintenance" } } }
            ] });
            doc.add_virtual_host(&m, host)?;
            Ok(Some(format!("virtual host u{n}.example answering 503 itself")))
        }
        2 => {
            let header = json!([{ "header": { "key": format!("x-u{n}"), "value": "1" } }]);
            doc.object_mut(&h)?.insert("response_headers_to_add".into(), header);
            Ok(Some(format!("virtual host {}: response header x-u{n}", name_of(doc, &h))))
        }
        _ => {
            let Some(m) = pick(rng, &doc.managers()).cloned() else { return Ok(None) };
            doc.object_mut(&m)?.insert("stat_prefix".into(), json!(format!("u{n}")));
            Ok(Some(format!("stat_prefix u{n}")))
        }
    }
}

fn path_template(doc: &mut Doc, rng: &mut ChaCha8Rng, ctx: &Ctx) -> Result<Option<String>, BoxError> {
    let Some(h) = pick(rng, &doc.virtual_hosts()).cloned() else { return Ok(None) };
    let to = pick(rng, &["/v1/{x}", "/v1/transfers", "/elsewhere/{x}"]).copied().unwrap_or("/v1/{x}");
    let cluster = demo_cluster(doc, ctx).unwrap_or_else(|| cluster(doc, rng));
    let route = json!({
        "name": "templated",
        "match": { "path_match_policy": { "name": "envoy.path.match.uri_template.uri_template_matcher", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.path.match.uri_template.v3.UriTemplateMatchConfig",
            "path_template": "/t/{x}" } } },
        "route": { "cluster": cluster, "path_rewrite_policy": { "name": "envoy.path.rewrite.uri_template.uri_template_rewriter", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.path.rewrite.uri_template.v3.UriTemplateRewriteConfig",
            "path_template_rewrite": to } } }
    });
    doc.insert_route(&h, 0, route)?;
    Ok(Some(format!("virtual host {}: /t/{{x}} → {to} on {cluster}", name_of(doc, &h))))
}
