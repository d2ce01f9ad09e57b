//! What the rules read of an Envoy configuration: its HTTP connection
//! managers, whether the agent filter runs in each and how it is configured,
//! how each normalises paths, and its route tables (inline, or the RDS file
//! a `path_config_source` names), route by route: what a route matches, where
//! it sends the request, whether it is annotated and what the filter guards it
//! as, and the timeouts and retry policy Envoy forwards it with.

use serde_json::Value;

use idem_core::policy::{parse_plugin_config, RouteDefaults, RoutePolicy, ROUTE_NAMESPACE};

use super::clusters::Clusters;
use super::ext_proc::{self, ExtProcEntry};
use super::failure;
use super::forward::{self, ManagerTimeouts, Retry, RouteTimeouts};
use super::paths::{self, Rewrite, Space};
use super::settings::{self, FilterSettings};
use crate::tools::{agent_filter, is_hcm, per_route_annotation, placeholder_secret};

/// One configuration file.
#[derive(Debug)]
pub struct EnvoyConfig {
    /// The file as given on the command line.
    pub label: String,
    pub managers: Vec<Manager>,
    /// What each cluster name stands for (its endpoints).
    pub clusters: Clusters,
    /// What was not checked, and why (an RDS source that is not a readable file).
    pub notes: Vec<String>,
}

/// One HTTP connection manager (of one filter chain of one listener).
#[derive(Debug)]
pub struct Manager {
    /// `envoy/e2e.yaml: listener agents` (with the chain's index when a listener has several).
    pub at: String,
    /// The agent filter in this manager's `http_filters`, if it runs here.
    pub filter: Option<AgentFilter>,
    pub normalize_path: Option<bool>,
    pub merge_slashes: Option<bool>,
    /// `path_with_escaped_slashes_action` as written (None: unset).
    pub escaped_slashes: Option<String>,
    /// The route table; None when it comes from a source this check cannot read.
    pub routes: Option<RouteTable>,
    /// Why the route table could not be read, when it could not.
    pub routes_unread: Option<String>,
    /// The HTTP filters between the agent filter and the router (their `@type`s, else names): each runs after
    /// the filter judged the request.
    pub after_filter: Vec<String>,
    /// `stream_idle_timeout` and `max_stream_duration`: they end Envoy's wait on every route.
    pub timeouts: ManagerTimeouts,
    /// Why Envoy's own reply to a cut answer is not the §7 envelope here (`failure`; None: it is).
    pub local_reply_gap: Option<String>,
}

/// The agent filter's entry (the .wasm, the native module, or Envoy's ext_proc filter in front of idemd's
/// ext_proc host).
#[derive(Debug)]
pub struct AgentFilter {
    /// Its name in `http_filters`: what `typed_per_filter_config` keys it by.
    pub name: String,
    /// The plugin configuration's text, as the filter receives it.
    pub config: Option<String>,
    /// How many route rules (`routes`) the configuration has, once idem-core accepted it.
    pub rules: usize,
    /// Why idem-core refuses the configuration (the filter would not load).
    pub config_error: Option<String>,
    /// What the TTL rules read of it (its timeouts, defaults, replay cache, route rules); None when refused.
    pub settings: Option<FilterSettings>,
    /// The `.wasm`'s failure policy in effect (`failure`); None for the native module and ext_proc.
    pub vm_failure: Option<String>,
    /// The ext_proc filter's own settings, when the agent filter is Envoy's ext_proc filter (`ext_proc`).
    pub ext_proc: Option<ExtProcEntry>,
    /// `disabled: true` on its `http_filters` entry: it runs only where a route's (or its virtual host's,
    /// or its route configuration's) `typed_per_filter_config` enables it (Envoy Gateway writes its
    /// filters so).
    pub entry_disabled: bool,
}

#[derive(Debug)]
pub struct RouteTable {
    /// `route_config transfers`, or `RDS transfers from envoy/e2e-rds-routes.yaml`.
    pub source: String,
    pub hosts: Vec<VirtualHost>,
}

#[derive(Debug)]
pub struct VirtualHost {
    pub name: String,
    pub routes: Vec<Route>,
    /// `typed_per_filter_config.<agent filter>` on the virtual host, as written.
    pub filter_per_route: Option<Value>,
    /// `typed_per_filter_config.<agent filter>` on the route configuration it is in, as written.
    pub table_filter_per_route: Option<Value>,
    /// `include_attempt_count_in_response: true`: the filter sees that Envoy retried.
    pub attempt_count_in_response: bool,
}

#[derive(Debug)]
pub struct Route {
    /// `route transfer_confirm`, or `route #3 (unnamed)`.
    pub label: String,
    pub matcher: Matcher,
    pub target: Target,
    /// The route's annotation (route metadata under `agent_idempotency`, or the native module's per-route
    /// configuration, which wins), when it has a role: the filter guards the route.
    pub annotation: Option<Value>,
    /// `typed_per_filter_config.<agent filter>` on the route, as written.
    pub filter_per_route: Option<Value>,
    /// The annotation as the filter parses it (with the plugin's defaults), where the filter runs and accepts
    /// its configuration: `Err` says why the filter refuses the route.
    pub guard: Option<Result<RoutePolicy, String>>,
    /// The route action's timeouts.
    pub timeouts: RouteTimeouts,
    /// The retry policy Envoy applies: the route's, else its virtual host's.
    pub retry: Option<Retry>,
    /// `hedge_on_per_try_timeout` (the route's hedge policy, else the virtual host's).
    pub hedges: bool,
    /// The paths the route matches.
    pub downstream: Space,
    /// How Envoy rewrites them before they go upstream.
    pub rewrite: Rewrite,
    /// The methods the route matches (a `:method` header match); None: every method.
    pub methods: Option<Vec<String>>,
    /// Where Envoy mirrors its requests (`request_mirror_policies` of the route and its virtual host).
    pub mirrors: Vec<Target>,
    /// `internal_redirect_policy`: Envoy follows the upstream's redirects itself, sending the request again.
    pub internal_redirect: bool,
    /// The route's hedge policy (else its virtual host's), as written.
    pub hedge_policy: Option<String>,
    /// `idemd_check.reaches_no_guarded_path` in the route's metadata: the operator's statement, with its
    /// reason, that a route the check cannot follow reaches no guarded path.
    pub stated_safe: Option<String>,
}

/// What part of the path space a route takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Matcher {
    /// `path`: one path (after normalisation).
    Exact(String),
    /// `prefix` or `path_separated_prefix`: everything below it; `/` is the catch-all.
    Prefix(String),
    /// `safe_regex`, `path_match_policy`, `connect_matcher`: may match anything.
    Pattern(String),
}

impl Matcher {
    /// Matches more than one path: a catch-all, a prefix or a pattern.
    pub fn is_broad(&self) -> bool {
        !matches!(self, Matcher::Exact(_))
    }
}

impl std::fmt::Display for Matcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Matcher::Exact(p) => write!(f, "path {p}"),
            Matcher::Prefix(p) if p == "/" => write!(f, "prefix / (a catch-all)"),
            Matcher::Prefix(p) => write!(f, "prefix {p}"),
            Matcher::Pattern(p) => write!(f, "{p}"),
        }
    }
}

/// Where a route sends its requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// `cluster`, or every cluster of `weighted_clusters`.
    Clusters(Vec<String>),
    /// Decided per request (`cluster_header`, a cluster specifier plugin): any cluster.
    AnyCluster(String),
    /// Answered by Envoy itself (`direct_response`, `redirect`) or not forwarded at all.
    Local,
}

impl Target {
    pub fn reaches(&self, cluster: &str) -> bool {
        match self {
            Target::Clusters(c) => c.iter().any(|c| c == cluster),
            Target::AnyCluster(_) => true,
            Target::Local => false,
        }
    }
}

impl EnvoyConfig {
    /// Parse `yaml` (the file `label`). An RDS `path_config_source` is read relative to the current
    /// directory, as Envoy reads it. `ext_proc_config`: the plugin configuration idemd's ext_proc host runs
    /// with, which an ext_proc filter in a chain without the `.wasm` or native filter is read with.
    pub fn parse(label: &str, yaml: &str, ext_proc_config: Option<&str>) -> Result<EnvoyConfig, String> {
        let doc: Value = serde_norway::from_str(yaml).map_err(|e| format!("{label}: not valid YAML: {e}"))?;
        let Some(listeners) = doc.pointer("/static_resources/listeners").and_then(Value::as_array) else {
            return Err(format!("{label}: no static_resources.listeners"));
        };
        let mut config = EnvoyConfig {
            label: label.to_string(),
            managers: Vec::new(),
            clusters: Clusters::parse(&doc),
            notes: Vec::new(),
        };
        for listener in listeners {
            let name = listener.get("name").and_then(Value::as_str).unwrap_or("(unnamed)");
            let chains: Vec<&Value> = listener
                .get("filter_chains")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .chain(listener.get("default_filter_chain"))
                .collect();
            for (i, chain) in chains.iter().enumerate() {
                let filters = chain.get("filters").and_then(Value::as_array).into_iter().flatten();
                for hcm in filters.filter_map(|f| f.get("typed_config")).filter(|t| is_hcm(t)) {
                    let at = match chains.len() {
                        1 => format!("{label}: listener {name}"),
                        _ => format!("{label}: listener {name} (filter chain #{i})"),
                    };
                    let manager = config.manager(at, hcm, &Host { doc: &doc, ext_proc_config })?;
                    config.managers.push(manager);
                }
            }
        }
        Ok(config)
    }

    fn manager(&mut self, at: String, hcm: &Value, host: &Host) -> Result<Manager, String> {
        let http_filters: Vec<&Value> =
            hcm.get("http_filters").and_then(Value::as_array).into_iter().flatten().collect();
        let (position, filter) = agent_filter_of(&http_filters, host);
        let after_filter = match position {
            Some(i) => http_filters.iter().skip(i + 1).map(|f| filter_kind(f)).collect(),
            None => Vec::new(),
        };
        let reading = Reading {
            filter: filter.as_ref().map(|f| f.name.as_str()),
            defaults: filter.as_ref().and_then(|f| f.settings.as_ref()).map(|s| &s.defaults),
            at: &at,
        };
        let (routes, routes_unread) = if let Some(table) = hcm.get("route_config") {
            let name = table.get("name").and_then(Value::as_str).unwrap_or("(unnamed)");
            (Some(route_table(format!("route_config {name}"), table, &reading)?), None)
        } else if let Some(rds) = hcm.get("rds") {
            let name = rds.get("route_config_name").and_then(Value::as_str).unwrap_or("(unnamed)");
            match self.rds_file(rds.get("config_source"), name)? {
                Ok((path, table)) => (Some(route_table(format!("RDS {name} from {path}"), &table, &reading)?), None),
                Err(why) => (None, Some(why)),
            }
        } else if let Some(scoped) = hcm.get("scoped_routes") {
            match self.scoped(scoped, &reading)? {
                Ok(table) => (Some(table), None),
                Err(why) => (None, Some(why)),
            }
        } else {
            (None, Some("no route_config, rds or scoped_routes".to_string()))
        };
        if let Some(why) = &routes_unread {
            self.notes.push(format!("{at}: routes not checked: {why}"));
        }
        let timeouts = forward::manager_timeouts(hcm).map_err(|e| format!("{at}: {e}"))?;
        Ok(Manager {
            timeouts,
            at,
            normalize_path: hcm.get("normalize_path").and_then(Value::as_bool),
            merge_slashes: hcm.get("merge_slashes").and_then(Value::as_bool),
            escaped_slashes: hcm.get("path_with_escaped_slashes_action").and_then(Value::as_str).map(str::to_string),
            local_reply_gap: failure::local_reply_gap(hcm, filter.as_ref().is_some_and(|f| f.ext_proc.is_some())),
            filter,
            routes,
            routes_unread,
            after_filter,
        })
    }

    /// The route configuration `name` of an RDS subscription, when its source is a file
    /// (`path_config_source`): Ok(Err(why)) when it is not, or cannot be read.
    fn rds_file(&mut self, source: Option<&Value>, name: &str) -> Result<Result<(String, Value), String>, String> {
        let path = source
            .and_then(|s| s.pointer("/path_config_source/path").or_else(|| s.get("path")))
            .and_then(Value::as_str);
        let Some(path) = path else {
            return Ok(Err(format!("routes {name} come from an xDS server, which this check cannot read")));
        };
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) => return Ok(Err(format!("RDS file {path} (routes {name}) cannot be read: {e}"))),
        };
        let doc: Value = serde_norway::from_str(&text).map_err(|e| format!("{path}: not valid YAML: {e}"))?;
        let table = doc
            .get("resources")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .find(|r| r.get("name").and_then(Value::as_str) == Some(name))
            .cloned();
        match table {
            Some(t) => Ok(Ok((path.to_string(), t))),
            None => Ok(Err(format!("RDS file {path} has no route configuration {name}"))),
        }
    }

    /// Scoped routes listed inline (`scoped_route_configurations_list`) whose route configurations come from a
    /// file: every scope's virtual hosts, as one table (a client picks the scope with its headers).
    fn scoped(&mut self, scoped: &Value, reading: &Reading) -> Result<Result<RouteTable, String>, String> {
        let Some(list) = scoped.pointer("/scoped_route_configurations_list/scoped_route_configurations") else {
            return Ok(Err("scoped routes from an xDS server (scoped_rds), which this check cannot read".into()));
        };
        let mut hosts = Vec::new();
        let mut sources = Vec::new();
        for scope in list.as_array().into_iter().flatten() {
            let table = if let Some(inline) = scope.get("route_configuration") {
                inline.clone()
            } else {
                let Some(name) = scope.get("route_configuration_name").and_then(Value::as_str) else {
                    return Ok(Err("a scope without a route configuration".into()));
                };
                match self.rds_file(scoped.get("rds_config_source"), name)? {
                    Ok((_, t)) => t,
                    Err(why) => return Ok(Err(why)),
                }
            };
            let name = table.get("name").and_then(Value::as_str).unwrap_or("(unnamed)").to_string();
            hosts.extend(route_table(String::new(), &table, reading)?.hosts);
            sources.push(name);
        }
        Ok(Ok(RouteTable { source: format!("scoped routes {}", sources.join(", ")), hosts }))
    }
}

/// What the manager is parsed with beside its own entry.
struct Host<'a> {
    /// The whole configuration (the ext_proc filter's cluster is one of its clusters).
    doc: &'a Value,
    /// The plugin configuration idemd's ext_proc host runs with, when the check was given it.
    ext_proc_config: Option<&'a str>,
}

/// The agent filter of a chain, and its place: the `.wasm` or the native module, else (where neither runs)
/// Envoy's ext_proc filter, read with the plugin configuration idemd's ext_proc host runs with.
fn agent_filter_of(http_filters: &[&Value], host: &Host) -> (Option<usize>, Option<AgentFilter>) {
    let own = http_filters.iter().enumerate().find_map(|(i, f)| agent_filter(f).map(|c| (i, *f, c)));
    if let Some((i, f, config)) = own {
        return (Some(i), Some(agent(f, config, failure::vm_failure(f), None)));
    }
    let mut procs = http_filters.iter().enumerate().filter(|(_, f)| ext_proc::is_ext_proc(f));
    let Some((i, f)) = procs.next() else { return (None, None) };
    let entry = ExtProcEntry::read(f, host.doc, procs.count(), host.ext_proc_config.is_some());
    let mut filter = agent(f, host.ext_proc_config, None, Some(entry));
    if host.ext_proc_config.is_none() {
        filter.config_error = Some(ext_proc::no_config(&filter.name));
    }
    (Some(i), Some(filter))
}

/// The agent filter `f`, with its plugin configuration's text as idem-core reads it.
fn agent(f: &Value, config: Option<&str>, vm_failure: Option<String>, ext_proc: Option<ExtProcEntry>) -> AgentFilter {
    let name = f.get("name").and_then(Value::as_str).unwrap_or(ROUTE_NAMESPACE).to_string();
    let parsed = config.map(|c| parse_plugin_config(c.as_bytes(), &placeholder_secret));
    let (rules, config_error, settings) = match parsed {
        Some(Ok(p)) => (p.routes.len(), None, Some(settings::filter_settings(&p))),
        Some(Err(e)) => (0, Some(e.to_string()), None),
        None => (0, Some("no plugin configuration string value".to_string()), None),
    };
    let entry_disabled = f.get("disabled").and_then(Value::as_bool) == Some(true);
    AgentFilter {
        name,
        config: config.map(str::to_string),
        rules,
        config_error,
        settings,
        vm_failure,
        ext_proc,
        entry_disabled,
    }
}

/// An HTTP filter's kind: its `@type` (without the type URL's host), else its name.
fn filter_kind(f: &Value) -> String {
    let typed = f.pointer("/typed_config/@type").and_then(Value::as_str);
    match typed {
        Some(t) => t.rsplit('/').next().unwrap_or(t).to_string(),
        None => f.get("name").and_then(Value::as_str).unwrap_or("(unnamed)").to_string(),
    }
}

/// What reading a route table needs of its connection manager.
struct Reading<'a> {
    /// The agent filter's name, when it runs here.
    filter: Option<&'a str>,
    /// Its route defaults, when it accepts its configuration: annotations are parsed with them.
    defaults: Option<&'a RouteDefaults>,
    at: &'a str,
}

fn route_table(source: String, table: &Value, reading: &Reading) -> Result<RouteTable, String> {
    let (filter, at) = (reading.filter, reading.at);
    let table_filter_per_route = filter.and_then(|f| per_filter(table, f));
    let mut hosts = Vec::new();
    for host in table.get("virtual_hosts").and_then(Value::as_array).into_iter().flatten() {
        let host_name = host.get("name").and_then(Value::as_str).unwrap_or("(unnamed)").to_string();
        let host_retry =
            forward::retry(host, "virtual host").map_err(|e| format!("{at}: virtual host {host_name}: {e}"))?;
        let mut routes = Vec::new();
        for (i, route) in host.get("routes").and_then(Value::as_array).into_iter().flatten().enumerate() {
            let label = match route.get("name").and_then(Value::as_str) {
                Some(n) => format!("route {n}"),
                None => format!("route #{i} (unnamed)"),
            };
            let where_ = format!("{at}: virtual host {host_name}: {label}");
            let annotation = annotation(route, filter).map_err(|e| format!("{where_}: {e}"))?;
            let guard = match (&annotation, reading.defaults) {
                (Some(meta), Some(defaults)) => settings::from_annotation(meta, defaults).transpose(),
                _ => None,
            };
            let action = route.get("route").unwrap_or(&Value::Null);
            let timeouts = forward::route_timeouts(action).map_err(|e| format!("{where_}: {e}"))?;
            let retry = match forward::retry(action, "route").map_err(|e| format!("{where_}: {e}"))? {
                Some(r) => Some(r),
                None => host_retry.clone(),
            };
            let mut mirrors = mirror_targets(action);
            mirrors.extend(mirror_targets(host));
            let stated_safe = route
                .pointer(&format!("/metadata/filter_metadata/{CHECK_NAMESPACE}/reaches_no_guarded_path"))
                .and_then(Value::as_str)
                .map(str::trim)
                .filter(|r| !r.is_empty())
                .map(str::to_string);
            let route_match = route.get("match");
            routes.push(Route {
                matcher: matcher(route_match),
                target: target(route),
                annotation,
                filter_per_route: filter.and_then(|f| per_filter(route, f)),
                label,
                guard,
                timeouts,
                retry,
                hedges: forward::hedges(action, host),
                downstream: downstream(route_match),
                rewrite: rewrite(action),
                methods: methods(route_match),
                mirrors,
                internal_redirect: action.get("internal_redirect_policy").is_some()
                    || action.get("internal_redirect_action").and_then(Value::as_str)
                        == Some("HANDLE_INTERNAL_REDIRECT"),
                hedge_policy: action.get("hedge_policy").or_else(|| host.get("hedge_policy")).map(Value::to_string),
                stated_safe,
            });
        }
        let filter_per_route = filter.and_then(|f| per_filter(host, f));
        let attempt_count_in_response =
            host.get("include_attempt_count_in_response").and_then(Value::as_bool) == Some(true);
        hosts.push(VirtualHost {
            name: host_name,
            routes,
            filter_per_route,
            table_filter_per_route: table_filter_per_route.clone(),
            attempt_count_in_response,
        });
    }
    Ok(RouteTable { source, hosts })
}

fn matcher(m: Option<&Value>) -> Matcher {
    let text = |k: &str| m.and_then(|m| m.get(k)).and_then(Value::as_str).map(str::to_string);
    if let Some(p) = text("path") {
        Matcher::Exact(p)
    } else if let Some(p) = text("prefix").or_else(|| text("path_separated_prefix")) {
        Matcher::Prefix(p)
    } else if let Some(r) = m.and_then(|m| m.pointer("/safe_regex/regex")).and_then(Value::as_str) {
        Matcher::Pattern(format!("safe_regex {r}"))
    } else if m.is_some_and(|m| m.get("path_match_policy").is_some()) {
        Matcher::Pattern("path_match_policy".into())
    } else if m.is_some_and(|m| m.get("connect_matcher").is_some()) {
        Matcher::Pattern("connect_matcher".into())
    } else {
        // Envoy requires one of the above; anything else is read as the widest.
        Matcher::Pattern("an unrecognised match".into())
    }
}

/// The paths a route's match takes.
fn downstream(m: Option<&Value>) -> Space {
    let text = |k: &str| m.and_then(|m| m.get(k)).and_then(Value::as_str).map(str::to_string);
    if let Some(p) = text("path") {
        Space::Exact(p)
    } else if let Some(p) = text("prefix") {
        Space::Prefix(p)
    } else if let Some(p) = text("path_separated_prefix") {
        // The prefix itself, and everything below it after a `/`.
        Space::Prefix(p)
    } else if let Some(t) = m.and_then(|m| m.pointer("/path_match_policy/typed_config/path_template")) {
        paths::template(t.as_str().unwrap_or_default(), &[])
    } else if let Some(r) = m.and_then(|m| m.pointer("/safe_regex/regex")).and_then(Value::as_str) {
        Space::Unknown(format!("the pattern {r}"))
    } else {
        Space::Unknown(format!("{}", matcher(m)))
    }
}

/// How a route action rewrites the path.
fn rewrite(action: &Value) -> Rewrite {
    if let Some(p) = action.get("prefix_rewrite").and_then(Value::as_str) {
        return Rewrite::Prefix(p.to_string());
    }
    if let Some(r) = action.get("regex_rewrite") {
        let pattern = r.pointer("/pattern/regex").and_then(Value::as_str).unwrap_or_default().to_string();
        let substitution = r.get("substitution").and_then(Value::as_str).unwrap_or_default().to_string();
        return Rewrite::Regex { pattern, substitution };
    }
    if let Some(policy) = action.get("path_rewrite_policy") {
        return match policy.pointer("/typed_config/path_template_rewrite").and_then(Value::as_str) {
            Some(t) => Rewrite::Template(t.to_string()),
            None => Rewrite::Other(format!("path_rewrite_policy {}", policy)),
        };
    }
    Rewrite::None
}

/// The methods a route's `:method` header match allows; None: any.
fn methods(m: Option<&Value>) -> Option<Vec<String>> {
    let headers = m.and_then(|m| m.get("headers")).and_then(Value::as_array)?;
    let method = headers.iter().find(|h| h.get("name").and_then(Value::as_str) == Some(":method"))?;
    if method.get("invert_match").and_then(Value::as_bool) == Some(true) {
        return None;
    }
    let exact = method.pointer("/string_match/exact").or_else(|| method.get("exact_match")).and_then(Value::as_str)?;
    Some(vec![exact.to_ascii_uppercase()])
}

/// Where `request_mirror_policies` (or the older `request_mirror_policy`) of `v` send copies.
fn mirror_targets(v: &Value) -> Vec<Target> {
    let list = v.get("request_mirror_policies").and_then(Value::as_array).cloned().unwrap_or_default();
    let single = v.get("request_mirror_policy").cloned();
    list.into_iter()
        .chain(single)
        .map(|m| match (m.get("cluster").and_then(Value::as_str), m.get("cluster_header").and_then(Value::as_str)) {
            (Some(c), _) if !c.is_empty() => Target::Clusters(vec![c.to_string()]),
            (_, Some(h)) => Target::AnyCluster(format!("a mirror's cluster_header {h}")),
            _ => Target::AnyCluster("a mirror without a cluster".into()),
        })
        .collect()
}

fn target(route: &Value) -> Target {
    let Some(action) = route.get("route") else { return Target::Local };
    if let Some(c) = action.get("cluster").and_then(Value::as_str) {
        return Target::Clusters(vec![c.to_string()]);
    }
    if let Some(w) = action.pointer("/weighted_clusters/clusters").and_then(Value::as_array) {
        return Target::Clusters(
            w.iter().filter_map(|c| c.get("name").and_then(Value::as_str)).map(Into::into).collect(),
        );
    }
    if let Some(h) = action.get("cluster_header").and_then(Value::as_str) {
        return Target::AnyCluster(format!("cluster_header {h}"));
    }
    Target::AnyCluster("a cluster specifier plugin".into())
}

/// The route metadata namespace of the operator's statements to `idemd check` (never read by the filter).
pub const CHECK_NAMESPACE: &str = "idemd_check";

/// Where the agent filter does not run on `route` (`None`: it runs). The most specific
/// `typed_per_filter_config` for it decides, as in Envoy: the route's, else its virtual host's, else
/// its route configuration's; `disabled: true` there (Envoy's FilterConfig, or ext_proc's
/// ExtProcPerRoute) turns it off, any other configuration for it turns on a filter whose
/// `http_filters` entry is `disabled: true`. Without one, the entry decides.
pub fn filter_off(filter: &AgentFilter, host: &VirtualHost, route: &Route) -> Option<String> {
    let stated = [
        (&route.filter_per_route, "the route".to_string()),
        (&host.filter_per_route, format!("virtual host {}", host.name)),
        (&host.table_filter_per_route, "its route configuration".to_string()),
    ]
    .into_iter()
    .find_map(|(config, on)| config.as_ref().map(|c| (c, on)));
    match stated {
        Some((config, on)) => disables(config).then(|| format!("disabled on {on} (typed_per_filter_config)")),
        None => filter.entry_disabled.then(|| {
            "disabled on its http_filters entry and not enabled for the route (typed_per_filter_config)".to_string()
        }),
    }
}

/// A `typed_per_filter_config` entry that turns the filter off. A FilterConfig may wrap the filter's
/// own per-route configuration, which may say it too.
fn disables(config: &Value) -> bool {
    [config.get("disabled"), config.pointer("/config/disabled")]
        .iter()
        .any(|d| d.and_then(Value::as_bool) == Some(true))
}

/// `typed_per_filter_config.<filter>` of a route or virtual host.
fn per_filter(v: &Value, filter: &str) -> Option<Value> {
    v.pointer(&format!("/typed_per_filter_config/{}", filter.replace('~', "~0").replace('/', "~1"))).cloned()
}

/// The route's annotation, when it has a role (what the filter guards the route by): the native module's
/// per-route configuration, else route metadata.
fn annotation(route: &Value, filter: Option<&str>) -> Result<Option<Value>, String> {
    let per_route = filter.and_then(|f| per_route_annotation(route, f)).transpose()?;
    let meta = per_route.or_else(|| route.pointer(&format!("/metadata/filter_metadata/{ROUTE_NAMESPACE}")).cloned());
    Ok(meta.filter(|m| m.get("role").is_some() || m.get("protocol").is_some()))
}
