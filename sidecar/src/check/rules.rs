//! The rules `idemd check` applies, each by name. A rule reads the parsed
//! configuration and idemd's flags and reports findings; any finding refuses
//! the configuration. A new rule is one more entry in [`RULES`]; the TTL rules
//! are in `ttl`, the retry rules in `retries`.

use std::collections::BTreeMap;

use super::model::{EnvoyConfig, Manager, Matcher, Target};
use super::{retries, ttl, Finding, Inputs};

pub struct Rule {
    /// The name a finding carries (and the docs use).
    pub name: &'static str,
    /// What the rule insists on, in one line.
    pub summary: &'static str,
    pub check: fn(&Rule, &Inputs, &mut Vec<Finding>),
}

impl Rule {
    pub(super) fn finding(&self, at: impl Into<String>, message: impl Into<String>) -> Finding {
        Finding { rule: self.name, at: at.into(), message: message.into() }
    }
}

pub const RULES: &[Rule] = &[
    Rule {
        name: "plugin-config",
        summary: "the agent filter's plugin configuration is one the filter accepts",
        check: plugin_config,
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
        summary: "no unannotated catch-all, prefix or pattern route reaches a cluster that serves an annotated route",
        check: catch_all_to_guarded_cluster,
    },
    Rule {
        name: "filter-disabled-on-annotated-route",
        summary: "the filter is never disabled (typed_per_filter_config) on an annotated route or its virtual host",
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

fn with_filter(config: &EnvoyConfig) -> impl Iterator<Item = &Manager> {
    config.managers.iter().filter(|m| m.filter.is_some())
}

fn plugin_config(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    let config = input.envoy;
    for m in with_filter(config) {
        if let Some(e) = m.filter.as_ref().and_then(|f| f.config_error.as_ref()) {
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

fn catch_all_to_guarded_cluster(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    let config = input.envoy;
    // Every cluster an annotated route sends to, in any connection manager that runs the filter: a client
    // chooses the listener and the Host, so a broad route anywhere in the file reaches them.
    let mut guarded: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut guarded_anywhere = Vec::new();
    for m in with_filter(config) {
        for host in m.routes.iter().flat_map(|t| &t.hosts) {
            for r in host.routes.iter().filter(|r| r.annotation.is_some()) {
                match &r.target {
                    Target::Clusters(cs) => {
                        for c in cs {
                            let labels = guarded.entry(c.clone()).or_default();
                            if !labels.contains(&r.label) {
                                labels.push(r.label.clone());
                            }
                        }
                    }
                    Target::AnyCluster(_) if !guarded_anywhere.contains(&r.label) => {
                        guarded_anywhere.push(r.label.clone())
                    }
                    Target::AnyCluster(_) => {}
                    Target::Local => {}
                }
            }
        }
    }
    for m in &config.managers {
        let Some(table) = &m.routes else { continue };
        for host in &table.hosts {
            for r in host.routes.iter().filter(|r| r.annotation.is_none() && r.matcher.is_broad()) {
                let mut hit: Vec<(&str, &[String])> = guarded
                    .iter()
                    .filter(|(c, _)| r.target.reaches(c))
                    .map(|(c, l)| (c.as_str(), l.as_slice()))
                    .collect();
                // An annotated route whose cluster is chosen per request: any forwarding broad route may meet it.
                if hit.is_empty() && !guarded_anywhere.is_empty() && !matches!(r.target, Target::Local) {
                    hit.push(("chosen per request", guarded_anywhere.as_slice()));
                }
                for (cluster, labels) in hit {
                    let how = match &r.target {
                        Target::AnyCluster(why) => format!("may reach any cluster ({why}), cluster {cluster} too"),
                        _ => format!("reaches cluster {cluster}"),
                    };
                    let shown: Vec<&str> = labels.iter().map(String::as_str).take(4).collect();
                    let more = if labels.len() > shown.len() { ", …" } else { "" };
                    let filter_off = if r.filter_disabled { " (the filter is disabled on it)" } else { "" };
                    out.push(rule.finding(
                        format!("{}: virtual host {}: {}", m.at, host.name, r.label),
                        format!(
                            "{} is not annotated{filter_off} and {how}, which also serves annotated routes ({}{more}): \
                             a path that misses an annotated route by a byte (/v1/transfers/, /V1/transfers) reaches \
                             the upstream unguarded. Route what the upstream serves explicitly, answer the rest with a \
                             direct_response (404), or send it to a cluster that serves no guarded route",
                            r.matcher,
                            shown.join(", ")
                        ),
                    ));
                }
            }
        }
    }
}

fn filter_disabled_on_annotated_route(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    let config = input.envoy;
    for m in with_filter(config) {
        let (Some(table), Some(filter)) = (&m.routes, &m.filter) else { continue };
        for host in &table.hosts {
            for r in host.routes.iter().filter(|r| r.annotation.is_some()) {
                if r.filter_disabled || host.filter_disabled {
                    let on = if r.filter_disabled { "the route" } else { "its virtual host" };
                    out.push(rule.finding(
                        format!("{}: virtual host {}: {}", m.at, host.name, r.label),
                        format!(
                            "annotated, but the {} filter is disabled on {on} (typed_per_filter_config): its \
                             requests pass unguarded",
                            filter.name
                        ),
                    ));
                }
            }
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
