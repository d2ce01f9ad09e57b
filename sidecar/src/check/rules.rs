//! The rules `idemd check` applies, each by name. A rule reads the parsed
//! configuration and idemd's flags and reports findings; any finding refuses
//! the configuration. A new rule is one more entry in [`RULES`]; the TTL rules
//! are in `ttl`, the retry rules in `retries`, the ext_proc filter's decisions in
//! `ext_proc`.

use super::ext_proc::{self, ExtProcEntry};
use super::model::{filter_off, AgentFilter, EnvoyConfig, Manager, Matcher, Target};
use super::{retries, ttl, ways, Finding, Inputs, Rule};

pub const RULES: &[Rule] = &[
    Rule {
        name: "plugin-config",
        summary: "the agent filter's plugin configuration is one the filter accepts",
        check: plugin_config,
    },
    Rule {
        name: "local-reply",
        summary: "a connection manager that runs the filter answers Envoy's own replies to a cut answer (UR, UC, \
                  UPE, UT) with the §7 in_progress envelope (local_reply_config)",
        check: super::failure::local_reply,
    },
    Rule {
        name: "wasm-reload",
        summary: "the agent .wasm reloads a failed VM (failure_policy: FAIL_RELOAD), never fails open or stays closed",
        check: super::failure::wasm_reload,
    },
    Rule {
        name: "ext-proc-config",
        summary: "an ext_proc filter that is the agent filter is checked with the plugin configuration idemd's \
                  ext_proc host runs with (--ext-proc-config, IDEM_EXT_PROC_CONFIG), and is the chain's only one",
        check: ext_proc_config,
    },
    Rule {
        name: "ext-proc-fail-open",
        summary: "the ext_proc filter in front of idemd never lets a request past unjudged (failure_mode_allow, \
                  observability_mode)",
        check: ext_proc_fail_open,
    },
    Rule {
        name: "ext-proc-processing-mode",
        summary: "the ext_proc filter sends headers and trailers both ways, and bodies BUFFERED or \
                  FULL_DUPLEX_STREAMED both ways (processing_mode)",
        check: ext_proc_processing_mode,
    },
    Rule {
        name: "ext-proc-message-timeout",
        summary: "the ext_proc filter's message_timeout (Envoy's default 200 ms) exceeds the plugin's \
                  sidecar_timeout_ms",
        check: ext_proc_message_timeout,
    },
    Rule {
        name: "ext-proc-attributes",
        summary: "the ext_proc filter sends xds.route_metadata (where routes are annotated) and \
                  response.code_details",
        check: ext_proc_attributes,
    },
    Rule {
        name: "ext-proc-cluster",
        summary: "the ext_proc filter's gRPC service is a static cluster that speaks HTTP/2 (or google_grpc)",
        check: ext_proc_cluster,
    },
    Rule {
        name: "ext-proc-settings",
        summary: "no ext_proc setting that changes what reaches idemd or what Envoy does with its answers \
                  (disable_immediate_response, mutation_rules, forward_rules, route_cache_action: CLEAR, a \
                  non-5xx status_on_error, disabled on its entry), and none the check does not know",
        check: ext_proc_settings,
    },
    Rule {
        name: "ext-proc-per-route",
        summary: "no per-route ext_proc overrides (but metadata) on a guarded route or its virtual host",
        check: ext_proc_per_route,
    },
    Rule {
        name: "normalize-path",
        summary: "a connection manager that runs the filter normalises paths (normalize_path: true)",
        check: normalize_path,
    },
    Rule {
        name: "merge-slashes",
        summary: "a connection manager that runs the filter merges slashes (merge_slashes: true)",
        check: merge_slashes,
    },
    Rule {
        name: "escaped-slashes",
        summary: "a connection manager that runs the filter never passes %2F/%5C unchanged \
                  (path_with_escaped_slashes_action: REJECT_REQUEST, UNESCAPE_AND_REDIRECT or UNESCAPE_AND_FORWARD)",
        check: escaped_slashes,
    },
    Rule {
        name: "catch-all-to-guarded-cluster",
        summary: "no unannotated catch-all, prefix or pattern route reaches an upstream that serves a guarded route \
                  (annotated, or a route rule's), unless the filter's route rules take every request it carries to \
                  their paths, for every method it lets through",
        check: ways::catch_all_to_guarded_cluster,
    },
    Rule {
        name: "exact-route-to-guarded-path",
        summary: "no unannotated route whose upstream path after rewrites (prefix_rewrite, regex_rewrite, path \
                  templates) is a guarded path of the same upstream (any listener, any virtual host, any cluster \
                  with the same endpoints), unless a route rule takes it for every method",
        check: ways::exact_route_to_guarded_path,
    },
    Rule {
        name: "unfiltered-listener-to-guarded-path",
        summary: "no listener or filter chain without the agent filter routes to a guarded path, or with a broad \
                  route to an upstream that serves one",
        check: ways::unfiltered_listener_to_guarded_path,
    },
    Rule {
        name: "role-on-guarded-path",
        summary: "an annotated route whose upstream path is a guarded path has that path's kind of acquiring role \
                  (a preview or status route rewritten onto a confirm's path runs it unguarded)",
        check: ways::role_on_guarded_path,
    },
    Rule {
        name: "undecidable-route",
        summary: "a route the check cannot follow (cluster_header, a cluster specifier plugin, a cluster that sends \
                  anywhere, a rewrite it cannot compute) that may reach a guarded path is refused, unless its \
                  metadata states idemd_check.reaches_no_guarded_path with a reason",
        check: ways::undecidable_route,
    },
    Rule {
        name: "request-mirror",
        summary: "no request mirror on a route that acquires (one confirm sent twice), and no mirror that copies \
                  requests onto a guarded path",
        check: ways::request_mirror,
    },
    Rule {
        name: "hedge-on-guarded-route",
        summary: "no hedge_policy (route or virtual host) on a route that acquires",
        check: ways::hedge_on_guarded_route,
    },
    Rule {
        name: "internal-redirect-on-guarded-route",
        summary: "no internal_redirect_policy on a route that acquires (Envoy would send the confirm again itself)",
        check: ways::internal_redirect_on_guarded_route,
    },
    Rule {
        name: "unreadable-routes",
        summary: "every route table is readable (inline, an RDS file, inline scoped routes) where the filter runs \
                  or anything is guarded",
        check: ways::unreadable_routes,
    },
    Rule {
        name: "filter-after-agent",
        summary: "between the agent filter and the router, only filters that change neither the path nor the route",
        check: ways::filter_after_agent,
    },
    Rule {
        name: "filter-disabled-on-annotated-route",
        summary: "the filter runs on every route it guards (annotated, or taken by a route rule's requests): never \
                  disabled there by typed_per_filter_config (the route's, its virtual host's or its route \
                  configuration's), and, where its http_filters entry says disabled: true, enabled there",
        check: filter_disabled_on_annotated_route,
    },
    Rule {
        name: "guarded-routes-exist",
        summary: "where the filter runs, something is guarded: annotated routes or route rules \
                  (a mesh's catch-all route needs the rules)",
        check: guarded_routes_exist,
    },
    Rule {
        name: "route-annotation",
        summary: "every annotation where the filter runs is one it accepts (it refuses every request to a route whose \
                  annotation it cannot read)",
        check: route_annotation,
    },
    Rule {
        name: "idemd-start",
        summary:
            "idemd serve starts with the flags given (its own TTL rules over --lease-ms, --upstream-worst-case-ms, \
                  --gateway-timeout-ms, --retry-backoff-total-ms, --terminal-retention-s, --retry-window-s)",
        check: ttl::idemd_start,
    },
    Rule {
        name: "approval-per-scope",
        summary: "every guarded confirm and MCP confirm tool of one scope has the same approval rule (a fingerprint \
                  verifies at every confirm of its scope: one without the rule would run what another holds for a \
                  person)",
        check: approval_per_scope,
    },
    Rule {
        name: "lease-outlasts-envoy",
        summary: "each guarded confirm, idempotent or MCP confirm tool's lease (the longer of its lease_ms and \
                  --lease-ms) exceeds Envoy's longest wait for the upstream (route timeout, retries × per-try \
                  timeout + back-off, idle and stream timeouts) + sidecar_timeout_ms + --upstream-worst-case-ms",
        check: ttl::lease_outlasts_envoy,
    },
    Rule {
        name: "retention-outlasts-fingerprints",
        summary:
            "--terminal-retention-s is at least the longest fingerprint_ttl_s of any guarded route + --retry-window-s",
        check: ttl::retention_outlasts_fingerprints,
    },
    Rule {
        name: "replay-cache-within-retention",
        summary: "the plugin's replay_cache ttl_s (when the cache is on) is at most --terminal-retention-s",
        check: ttl::replay_cache_within_retention,
    },
    Rule {
        name: "retry-on-possible-execution",
        summary: "no Envoy retry on a guarded confirm, idempotent or MCP route retries after the upstream may have \
                  executed and answered (5xx, gateway-error, retriable-4xx, retriable-headers, gRPC statuses, a \
                  retriable status the route reads as done or unknown, hedging on per-try timeout)",
        check: retries::retry_on_possible_execution,
    },
    Rule {
        name: "retry-needs-attempt-count",
        summary:
            "a guarded confirm, idempotent or MCP route that Envoy retries has include_attempt_count_in_response: \
                  true on its virtual host",
        check: retries::retry_needs_attempt_count,
    },
    Rule {
        name: "no-retry-without-upstream-keys",
        summary: "no Envoy retry or hedge policy (route or virtual host) on a guarded route whose upstream ignores \
                  Idempotency-Key (upstream_keys: ignored)",
        check: retries::no_retry_without_upstream_keys,
    },
];

/// Each finding `gaps` makes of a connection manager whose agent filter is Envoy's ext_proc filter, at the manager,
/// prefixed with the filter's name.
fn each_ext_proc(
    rule: &Rule,
    input: &Inputs,
    out: &mut Vec<Finding>,
    gaps: impl Fn(&Manager, &AgentFilter, &ExtProcEntry) -> Vec<String>,
) {
    for m in &input.envoy.managers {
        let Some((f, e)) = m.filter.as_ref().and_then(|f| Some((f, f.ext_proc.as_ref()?))) else { continue };
        for gap in gaps(m, f, e) {
            out.push(rule.finding(&m.at, format!("{}: {gap}", f.name)));
        }
    }
}

fn ext_proc_config(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    each_ext_proc(rule, input, out, |_, f, e| {
        let mut gaps = Vec::new();
        if !e.config_given {
            gaps.push(format!("{}: the check cannot tell what it guards", ext_proc::no_config(&f.name)));
        }
        if e.others > 0 {
            gaps.push(format!(
                "the chain runs {} ext_proc filters: the check reads the first as idemd's and cannot tell which one \
                 is; run one in front of idemd",
                e.others + 1
            ));
        }
        gaps
    });
}

fn ext_proc_fail_open(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    each_ext_proc(rule, input, out, |_, _, e| ext_proc::fail_open_settings(&e.typed));
}

fn ext_proc_processing_mode(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    each_ext_proc(rule, input, out, |_, _, e| ext_proc::processing_mode_gaps(&e.typed));
}

fn ext_proc_message_timeout(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    // Without settings the plugin configuration is refused (`plugin-config`, `ext-proc-config`).
    each_ext_proc(rule, input, out, |_, f, e| {
        let timeout = f.settings.as_ref().map(|s| s.sidecar_timeout_ms);
        timeout.and_then(|t| ext_proc::message_timeout_gap(&e.typed, t)).into_iter().collect()
    });
}

fn ext_proc_attributes(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    each_ext_proc(rule, input, out, |m, _, e| {
        let annotated = m.routes.iter().flat_map(|t| &t.hosts).flat_map(|h| &h.routes).any(|r| r.annotation.is_some());
        ext_proc::attribute_gaps(&e.typed, annotated)
    });
}

fn ext_proc_cluster(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    each_ext_proc(rule, input, out, |_, _, e| e.cluster_gap.iter().cloned().collect());
}

fn ext_proc_settings(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    each_ext_proc(rule, input, out, |_, _, e| ext_proc::settings_gaps(&e.typed));
}

/// Per-route overrides on every route that carries guarded requests (annotated, or a route rule's), and on its
/// virtual host (once).
fn ext_proc_per_route(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    let mut hosts_seen: Vec<String> = Vec::new();
    for g in super::guard::guarded(input.envoy) {
        let Some(f) = g.manager.filter.as_ref().filter(|f| f.ext_proc.is_some()) else { continue };
        for gap in g.route.filter_per_route.iter().flat_map(ext_proc::per_route_gaps) {
            out.push(rule.finding(&g.at, format!("guarded, and {}'s per-route configuration has {gap}", f.name)));
        }
        let host_at = format!("{}: virtual host {}", g.manager.at, g.host.name);
        if hosts_seen.contains(&host_at) {
            continue;
        }
        for gap in g.host.filter_per_route.iter().flat_map(ext_proc::per_route_gaps) {
            out.push(rule.finding(
                &host_at,
                format!("carries guarded routes, and {}'s per-route configuration has {gap}", f.name),
            ));
        }
        hosts_seen.push(host_at);
    }
}

fn with_filter(config: &EnvoyConfig) -> impl Iterator<Item = &Manager> {
    config.managers.iter().filter(|m| m.filter.is_some())
}

fn plugin_config(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    let config = input.envoy;
    // An ext_proc filter the check was given no configuration for is `ext-proc-config`'s.
    let given = |f: &&AgentFilter| f.ext_proc.as_ref().is_none_or(|e| e.config_given);
    for m in with_filter(config) {
        if let Some(e) = m.filter.as_ref().filter(given).and_then(|f| f.config_error.as_ref()) {
            out.push(rule.finding(&m.at, format!("the filter refuses its plugin configuration: {e}")));
        }
    }
}

fn normalize_path(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    let config = input.envoy;
    for m in with_filter(config).filter(|m| m.normalize_path != Some(true)) {
        out.push(rule.finding(
            &m.at,
            "runs the agent filter without `normalize_path: true`: `/v1/./transfers`, `/v1/x/../transfers` or \
             `/v1/%74ransfers` miss the route annotated for /v1/transfers, and an upstream that resolves them \
             executes unguarded",
        ));
    }
}

fn merge_slashes(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    let config = input.envoy;
    for m in with_filter(config).filter(|m| m.merge_slashes != Some(true)) {
        out.push(rule.finding(
            &m.at,
            "runs the agent filter without `merge_slashes: true`: `//v1/transfers` or `/v1//transfers` miss the \
             route annotated for /v1/transfers, and an upstream that merges slashes executes unguarded",
        ));
    }
}

/// The actions that never let an escaped slash reach routing unchanged.
const SAFE_ESCAPED_SLASH_ACTIONS: &[&str] = &["REJECT_REQUEST", "UNESCAPE_AND_REDIRECT", "UNESCAPE_AND_FORWARD"];

fn escaped_slashes(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    let config = input.envoy;
    for m in with_filter(config) {
        let action = m.escaped_slashes.as_deref();
        if action.is_some_and(|a| SAFE_ESCAPED_SLASH_ACTIONS.contains(&a)) {
            continue;
        }
        let what = match action {
            None => "without `path_with_escaped_slashes_action` (Envoy's default keeps them unchanged)".to_string(),
            Some(a) => format!("with `path_with_escaped_slashes_action: {a}`"),
        };
        out.push(rule.finding(
            &m.at,
            format!(
                "runs the agent filter {what}: `/v1%2Ftransfers` misses the route annotated for /v1/transfers, and \
                 an upstream that decodes %2F executes unguarded; set REJECT_REQUEST (or UNESCAPE_AND_REDIRECT)"
            ),
        ));
    }
}

fn filter_disabled_on_annotated_route(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    let config = input.envoy;
    for m in with_filter(config) {
        let (Some(table), Some(filter)) = (&m.routes, &m.filter) else { continue };
        for host in &table.hosts {
            for r in host.routes.iter().filter(|r| r.annotation.is_some()) {
                if let Some(why) = filter_off(filter, host, r) {
                    out.push(rule.finding(
                        format!("{}: virtual host {}: {}", m.at, host.name, r.label),
                        format!("annotated, but the {} filter is {why}: its requests pass unguarded", filter.name),
                    ));
                }
            }
        }
    }
    // A route rule guards requests on routes that carry no annotation: the filter must run there too.
    for g in super::guard::guarded(config).into_iter().filter(|g| g.rule.is_some()) {
        let Some(filter) = &g.manager.filter else { continue };
        if let Some(why) = filter_off(filter, g.host, g.route) {
            out.push(rule.finding(
                g.at.clone(),
                format!(
                    "a route rule's requests take this route, but the {} filter is {why}: they pass unguarded",
                    filter.name
                ),
            ));
        }
    }
}

fn guarded_routes_exist(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    let config = input.envoy;
    for m in with_filter(config) {
        let (Some(table), Some(filter)) = (&m.routes, &m.filter) else { continue };
        if filter.config_error.is_some() || filter.rules > 0 {
            continue;
        }
        if table.hosts.iter().flat_map(|h| &h.routes).any(|r| r.annotation.is_some()) {
            continue;
        }
        let broad = table.hosts.iter().flat_map(|h| &h.routes).find(|r| {
            matches!(r.matcher, Matcher::Prefix(_) | Matcher::Pattern(_)) && !matches!(r.target, Target::Local)
        });
        let hint = match broad {
            Some(r) => format!(" ({} sends {} upstream unguarded: add route rules for it)", r.label, r.matcher),
            None => String::new(),
        };
        out.push(rule.finding(
            &m.at,
            format!(
                "runs the agent filter, but {} has no annotated route and the plugin configuration no route rules: \
                 nothing is guarded{hint}",
                table.source
            ),
        ));
    }
}

fn approval_per_scope(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    let guarded = super::guard::guarded(input.envoy);
    let confirms = guarded
        .iter()
        .flat_map(|g| g.policy.fingerprint_confirms().into_iter().map(move |(tool, p)| (g.at_tool(tool), p)));
    if let Err((at, message)) = idem_core::policy::one_approval_rule_per_scope(confirms) {
        out.push(rule.finding(at, message));
    }
}

fn route_annotation(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    for m in with_filter(input.envoy) {
        for host in m.routes.iter().flat_map(|t| &t.hosts) {
            for r in &host.routes {
                if let Some(Err(e)) = &r.guard {
                    out.push(rule.finding(
                        format!("{}: virtual host {}: {}", m.at, host.name, r.label),
                        format!("the filter refuses this route's annotation ({e}): it answers every request to it 503"),
                    ));
                }
            }
        }
    }
}
