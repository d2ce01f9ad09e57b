//! Envoy's retries on guarded routes (DESIGN §4, "Classifying"). A retry
//! resends the same `Idempotency-Key`, and the filter sees only the last
//! attempt's answer (never releasing one Envoy sent twice, by
//! `x-envoy-attempt-count`). So Envoy may retry:
//!
//! * what provably never reached the upstream (connect failure, refused
//!   stream, reset before the request), on any route: that is the proof the
//!   filter itself needs to release, and no earlier attempt can have run, so
//!   neither the attempt count nor the upstream's keys matter;
//! * an upstream Envoy's rate limit (`envoy-ratelimited`), and an attempt that
//!   got no answer (`reset`), only where the upstream deduplicates by that key
//!   (`upstream_keys: honoured`, the default), and only where the filter sees
//!   the attempt count (`include_attempt_count_in_response`): the retry meets
//!   the first attempt's record, and the filter never releases it;
//!
//! and never an attempt the upstream answered in a way that may mean it ran
//! (a 5xx, 409, per-try timeouts, any header match, gRPC statuses): the retry
//! replaces an answer the filter would have kept for the reconciler with the
//! retry's. A retriable status is judged as the route reads it (`outcomes`,
//! core::outcome): failed (nothing ran) and released (429, 503: the upstream
//! says it did not run it) may be retried; done and unknown may not. On a
//! route whose upstream ignores keys, every retry is a second execution.

use idem_core::outcome::{classify, Verdict};
use idem_core::policy::{RoutePolicy, UpstreamKeys};

use super::forward::{condition, Condition, Retry};
use super::guard::{acquiring, guarded, Guarded};
use super::Rule;
use super::{Finding, Inputs};

/// The retry policy Envoy applies to the route, when it retries at all (a policy without conditions does not).
fn retrying<'a>(g: &Guarded<'a>) -> Option<&'a Retry> {
    g.route.retry.as_ref().filter(|r| !r.retry_on.is_empty())
}

/// Guarded routes that acquire (confirm, idempotent, MCP with a confirm tool) and that Envoy retries (a hedge
/// policy does nothing without a retry policy).
fn retried<'a>(input: &'a Inputs) -> impl Iterator<Item = (Guarded<'a>, &'a Retry)> {
    guarded(input.envoy).into_iter().filter(|g| !acquiring(g.policy).is_empty()).filter_map(|g| {
        let r = retrying(&g)?;
        Some((g, r))
    })
}

/// The route's acquiring policies (an MCP route's confirm tools each have their own) whose upstream `keys`.
fn keyed<'a>(g: &Guarded<'a>, keys: UpstreamKeys) -> Vec<(Option<&'a str>, &'a RoutePolicy)> {
    acquiring(g.policy).into_iter().filter(|(_, p)| p.upstream_keys == keys).collect()
}

/// `a route retry policy (reset,connect-failure)`, with the hedge policy if any, for messages.
fn describe(g: &Guarded, retry: &Retry) -> String {
    let hedge = if g.route.hedges { " that hedges on per-try timeout" } else { "" };
    format!("a {} retry policy ({}){hedge}", retry.from, retry.retry_on.join(","))
}

pub(super) fn retry_on_possible_execution(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    for (g, retry) in retried(input) {
        let honoured = keyed(&g, UpstreamKeys::Honoured);
        if honoured.is_empty() {
            continue;
        }
        let mut why: Vec<String> = Vec::new();
        for c in &retry.retry_on {
            match condition(c) {
                Some(Condition::NeverSent | Condition::RateLimited | Condition::NoAnswer) => {}
                Some(Condition::Answered) => {
                    why.push(format!("{c} (an answer, or a per-try timeout, after which it may have run)"))
                }
                Some(Condition::Statuses) => {
                    for code in &retry.retriable_status_codes {
                        for (tool, policy) in &honoured {
                            let read = classify(*code, Some("via_upstream"), 1, &policy.outcomes, true);
                            if matches!(read, Verdict::Done | Verdict::Unknown) {
                                let whose = tool.map(|t| format!("tool {t}")).unwrap_or_else(|| "the route".into());
                                let text =
                                    format!("retriable-status-codes {code} ({whose} reads it as {})", read.as_str());
                                if !why.contains(&text) {
                                    why.push(text);
                                }
                            }
                        }
                    }
                }
                None => why.push(format!("{c} (not a retry condition this check knows)")),
            }
        }
        if g.route.hedges && retry.per_try_timeout_ms.is_some() {
            why.push("hedge_on_per_try_timeout (a second attempt while the first may still run)".into());
        }
        if why.is_empty() {
            continue;
        }
        let from = retry.from;
        out.push(rule.finding(
            &g.at,
            format!(
                "the {from} retry policy retries after the upstream may have executed: {}. The filter sees only the \
                 last attempt's answer, so the retry hides one that may mean it ran; retry only on \
                 connect-failure, refused-stream, reset-before-request or reset",
                why.join(", ")
            ),
        ));
    }
}

pub(super) fn retry_needs_attempt_count(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    for (g, retry) in retried(input).filter(|(g, _)| !keyed(g, UpstreamKeys::Honoured).is_empty()) {
        // Retrying only what never reached the upstream: the last attempt's answer is the whole story.
        let only_unsent = !retry.may_repeat_a_sent_request() && !g.route.hedges;
        if g.host.attempt_count_in_response || only_unsent {
            continue;
        }
        let what = describe(&g, retry);
        out.push(rule.finding(
            &g.at,
            format!(
                "Envoy retries it ({what}), but virtual host {} lacks `include_attempt_count_in_response: true`: \
                 the filter cannot see that Envoy sent the confirm more than once, and may release one an earlier \
                 attempt executed",
                g.host.name
            ),
        ));
    }
}

pub(super) fn no_retry_without_upstream_keys(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    // Any retry policy, even one that retries only what never reached the upstream (DESIGN §4:
    // on such a route Envoy retries are refused): the filter releases on Envoy's proof itself, so
    // the agent's own retry with the same fingerprint is the one way to run it again.
    for (g, retry) in retried(input) {
        let what = describe(&g, retry);
        for (tool, _) in keyed(&g, UpstreamKeys::Ignored) {
            let at = g.at_tool(tool);
            out.push(rule.finding(
                at,
                format!(
                    "upstream_keys: ignored (the upstream does not deduplicate by Idempotency-Key), and Envoy retries \
                     it ({what}): a retry of an attempt that reached the upstream is a second execution. Remove the \
                     retry policy (a virtual host's policy applies to every route without its own); the filter \
                     releases what Envoy never sent, and the agent's retry runs it"
                ),
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::check::testing::{findings, flags, plugin, vhost, Fixture};

    const ATTEMPTS: &str = "include_attempt_count_in_response: true";

    fn confirm(extra_route: &str, annotation: &str) -> String {
        let annotation = if annotation.contains("upstream_keys") {
            annotation.to_string()
        } else {
            format!(", upstream_keys: honoured{annotation}")
        };
        format!(
            r#"
      - name: confirm
        match: {{ path: /v1/transfers }}
        route: {{ cluster: demo, timeout: 15s{extra_route} }}
        metadata: {{ filter_metadata: {{ agent_idempotency: {{ role: confirm, scope: s, bind: /amount{annotation} }} }} }}"#
        )
    }

    fn retrying(retry_on: &str) -> Fixture {
        let route = confirm(&format!(", retry_policy: {{ retry_on: \"{retry_on}\", num_retries: 2 }}"), "");
        Fixture { vhost: vhost(ATTEMPTS), ..Fixture::new(&route) }
    }

    const RULE: &str = "retry-on-possible-execution";

    #[test]
    fn retries_on_what_never_ran_or_got_no_answer_pass() {
        for ok in ["reset,connect-failure", "refused-stream", "reset-before-request", "envoy-ratelimited"] {
            assert_eq!(findings(&retrying(ok), &flags(), RULE), Vec::<String>::new(), "{ok}");
        }
    }

    #[test]
    fn retries_on_an_answer_that_may_mean_it_ran_are_refused() {
        for bad in ["5xx", "gateway-error", "reset,retriable-4xx", "retriable-headers", "unavailable", "5XX"] {
            let found = findings(&retrying(bad), &flags(), RULE);
            assert_eq!(found.len(), 1, "{bad}: {found:?}");
            assert!(found[0].contains("route confirm") && found[0].contains("the route retry policy"), "{found:?}");
        }
    }

    #[test]
    fn retriable_status_codes_are_judged_as_the_route_reads_them() {
        let codes = |codes: &str, annotation: &str| {
            let route = confirm(
                &format!(", retry_policy: {{ retry_on: retriable-status-codes, retriable_status_codes: [{codes}] }}"),
                annotation,
            );
            findings(&Fixture { vhost: vhost(ATTEMPTS), ..Fixture::new(&route) }, &flags(), RULE)
        };
        // 503 and 429 are released (the upstream did not run it); 400 failed.
        assert_eq!(codes("503, 429, 400", ""), Vec::<String>::new());
        let found = codes("503, 500", "");
        assert!(found.len() == 1 && found[0].contains("retriable-status-codes 500 (the route reads it as unknown)"));
        let found = codes("409", "");
        assert!(found.len() == 1 && found[0].contains("409"), "{found:?}");
        // The route's own readings: its 409 means "refused", its 503 "unknown".
        assert_eq!(codes("409", ", outcomes: \"409:failed\""), Vec::<String>::new());
        let found = codes("503", ", outcomes: \"503:unknown\"");
        assert!(found.len() == 1 && found[0].contains("503"), "{found:?}");
    }

    #[test]
    fn the_virtual_host_policy_counts_and_hedging_on_per_try_timeout_is_refused() {
        let host = Fixture {
            vhost: vhost(&format!("{ATTEMPTS}\nretry_policy: {{ retry_on: 5xx }}")),
            ..Fixture::new(&confirm("", ""))
        };
        let found = findings(&host, &flags(), RULE);
        assert!(found.len() == 1 && found[0].contains("the virtual host retry policy"), "{found:?}");
        let hedged = confirm(
            ", retry_policy: { retry_on: reset, per_try_timeout: 2s }, hedge_policy: { hedge_on_per_try_timeout: true }",
            "",
        );
        let found = findings(&Fixture { vhost: vhost(ATTEMPTS), ..Fixture::new(&hedged) }, &flags(), RULE);
        assert!(found.len() == 1 && found[0].contains("hedge_on_per_try_timeout"), "{found:?}");
    }

    #[test]
    fn a_retried_confirm_needs_the_attempt_count() {
        let rule = "retry-needs-attempt-count";
        assert_eq!(findings(&retrying("reset"), &flags(), rule), Vec::<String>::new());
        let without = Fixture { vhost: String::new(), ..retrying("reset") };
        let found = findings(&without, &flags(), rule);
        assert!(found.len() == 1 && found[0].contains("virtual host transfers lacks"), "{found:?}");
        // No retry policy, or one that retries only what never reached the upstream: no need.
        assert_eq!(findings(&Fixture::new(&confirm("", "")), &flags(), rule), Vec::<String>::new());
        let unsent = Fixture { vhost: String::new(), ..retrying("connect-failure,reset-before-request") };
        assert_eq!(findings(&unsent, &flags(), rule), Vec::<String>::new());
        let rate_limited = Fixture { vhost: String::new(), ..retrying("envoy-ratelimited") };
        assert_eq!(findings(&rate_limited, &flags(), rule), Vec::<String>::new());
        // A hedge policy alone does nothing (Envoy hedges only what a retry policy retries).
        let hedge_only = confirm(", hedge_policy: { hedge_on_per_try_timeout: true }", "");
        assert_eq!(findings(&Fixture::new(&hedge_only), &flags(), rule), Vec::<String>::new());
        // A preview is never released: its retries are not this rule's.
        let preview = confirm(", retry_policy: { retry_on: reset }", "")
            .replace("role: confirm", "role: preview")
            .replace(", upstream_keys: honoured", "");
        assert_eq!(findings(&Fixture::new(&preview), &flags(), rule), Vec::<String>::new());
    }

    #[test]
    fn an_upstream_that_ignores_keys_gets_no_retry_at_all() {
        let rule = "no-retry-without-upstream-keys";
        let ignored = |extra: &str| {
            let route = confirm(extra, ", upstream_keys: ignored");
            Fixture { vhost: vhost(ATTEMPTS), ..Fixture::new(&route) }
        };
        assert_eq!(findings(&ignored(""), &flags(), rule), Vec::<String>::new());
        let found = findings(&ignored(", retry_policy: { retry_on: \"connect-failure,reset\" }"), &flags(), rule);
        assert!(found.len() == 1 && found[0].contains("upstream_keys: ignored"), "{found:?}");
        let found = findings(&ignored(", retry_policy: { retry_on: envoy-ratelimited }"), &flags(), rule);
        assert_eq!(found.len(), 1, "only Envoy's own proof counts: {found:?}");
        // Not even what provably never reached the upstream: the filter releases on that proof itself.
        let unsent = ignored(", retry_policy: { retry_on: \"connect-failure,refused-stream,reset-before-request\" }");
        assert_eq!(findings(&unsent, &flags(), rule).len(), 1);
        // Only this rule speaks for it.
        let fixture = ignored(", retry_policy: { retry_on: 5xx }");
        assert_eq!(findings(&fixture, &flags(), RULE), Vec::<String>::new());
        // The virtual host's policy, and a route rule's upstream_keys.
        let host = Fixture { vhost: vhost("retry_policy: { retry_on: reset }"), ..ignored("") };
        assert_eq!(findings(&host, &flags(), rule).len(), 1);
        let catch_all = "\n      - name: default\n        match: { prefix: / }\n        route: { cluster: demo, retry_policy: { retry_on: reset } }";
        let rules = r#""routes": [{"name": "pay", "match": {"path": "/v1/transfers"}, "role": "confirm", "scope": "s", "bind": "/a", "upstream_keys": "ignored"}]"#;
        let fixture = Fixture { plugin: plugin(rules), vhost: vhost(ATTEMPTS), ..Fixture::new(catch_all) };
        let found = findings(&fixture, &flags(), rule);
        assert!(found.len() == 1 && found[0].contains("rule pay via"), "{found:?}");
        // An MCP route's confirm tools each say it for themselves.
        let mcp = r#"
      - name: mcp
        match: { path: /mcp }
        route: { cluster: demo, timeout: 15s, retry_policy: { retry_on: reset } }
        metadata: { filter_metadata: { agent_idempotency: { role: mcp, tools: '{"pay": {"role": "confirm", "scope": "s", "bind": "/a", "upstream_keys": "ignored"}, "book": {"role": "confirm", "upstream_keys": "honoured", "scope": "s", "bind": "/a"}}' } } }"#;
        let found = findings(&Fixture { vhost: vhost(ATTEMPTS), ..Fixture::new(mcp) }, &flags(), rule);
        assert!(found.len() == 1 && found[0].contains("route mcp: tool pay"), "{found:?}");
        let honoured = rules.replace("ignored", "honoured");
        let fixture = Fixture { plugin: plugin(&honoured), vhost: vhost(ATTEMPTS), ..Fixture::new(catch_all) };
        assert_eq!(findings(&fixture, &flags(), rule), Vec::<String>::new());
    }
}
