//! The TTL rules of DESIGN §5 against Envoy's own settings: the lease a
//! guarded route gets must outlast everything that can still happen to its
//! request, and the records must outlast every fingerprint and cached replay
//! that can name them. idemd's flags are the check's inputs (the same
//! variables and defaults as `idemd serve`).

use super::forward;
use super::guard::{acquiring, fingerprint_ttls, guarded};
use super::Rule;
use super::{Finding, Inputs};

/// `idemd serve`'s own start-up rule over the same flags: the deployment would not start.
pub(super) fn idemd_start(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    if let Err(broken) = input.idemd.validate() {
        for why in broken {
            out.push(rule.finding(
                format!("{}: idemd's flags", input.envoy.label),
                format!("idemd serve refuses to start with them: {why}"),
            ));
        }
    }
}

/// The lease of every guarded operation is strictly longer than the longest Envoy may wait for its upstream
/// (the route timeout, or the retry, idle and stream bounds: `forward::envoy_wait`), plus the plugin's
/// `sidecar_timeout_ms` (the complete after the answer), plus `--upstream-worst-case-ms`: Envoy's wait ends
/// when Envoy stops waiting, not when the upstream stops working, and an attempt Envoy started just before it
/// gave up may run that long after. Envoy's configuration cannot say how long; the flag does.
pub(super) fn lease_outlasts_envoy(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    let flags = input.idemd;
    for g in guarded(input.envoy) {
        let acquiring = acquiring(g.policy);
        if acquiring.is_empty() {
            continue;
        }
        let wait = forward::envoy_wait(&g.route.timeouts, g.route.retry.as_ref(), &g.manager.timeouts);
        let sidecar = g.settings.sidecar_timeout_ms;
        for (tool, policy) in acquiring {
            let at = g.at_tool(tool);
            // idemd holds the row for the longer of the two (store::acquire).
            let lease = policy.lease_ms.max(flags.lease_ms);
            let Some(w) = wait.ms else {
                out.push(rule.finding(
                    at,
                    format!(
                        "Envoy may wait for this upstream without end: {}. No lease covers that; give the route a \
                         timeout (or an idle_timeout or max_stream_duration)",
                        wait.how
                    ),
                ));
                continue;
            };
            let needed = w.saturating_add(sidecar).saturating_add(flags.upstream_worst_case_ms);
            if lease <= needed {
                out.push(rule.finding(
                    at,
                    format!(
                        "the lease {lease} ms (the longer of the route's lease_ms {} and --lease-ms {}) must exceed \
                         Envoy's longest wait {w} ms ({}) + the plugin's sidecar_timeout_ms {sidecar} + \
                         --upstream-worst-case-ms {} = {needed} ms (short by {} ms): the lease would run out while the \
                         request may still run, and a retry could execute it again",
                        policy.lease_ms,
                        flags.lease_ms,
                        wait.how,
                        flags.upstream_worst_case_ms,
                        needed - lease + 1,
                    ),
                ));
            }
        }
    }
}

/// `--terminal-retention-s` ≥ the longest fingerprint lifetime here + `--retry-window-s`: a caller may retry
/// a confirm made just before its fingerprint expired for the whole retry window.
pub(super) fn retention_outlasts_fingerprints(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    let flags = input.idemd;
    let guards = guarded(input.envoy);
    let longest = guards
        .iter()
        .flat_map(|g| fingerprint_ttls(g.policy).into_iter().map(move |(tool, ttl)| (g, tool, ttl)))
        // The first of the longest, in the file's order.
        .min_by_key(|(_, _, ttl)| std::cmp::Reverse(*ttl));
    let Some((g, tool, ttl)) = longest else { return };
    let needed = ttl.saturating_add(flags.retry_window_s);
    if flags.terminal_retention_s < needed {
        let at = g.at_tool(tool);
        out.push(rule.finding(
            at,
            format!(
                "--terminal-retention-s {} must be at least the longest fingerprint_ttl_s here, {ttl} s (this route), \
                 + --retry-window-s {} = {needed} s (short by {} s): a retry with a fingerprint that was still valid \
                 could find its record reaped",
                flags.terminal_retention_s,
                flags.retry_window_s,
                needed - flags.terminal_retention_s,
            ),
        ));
    }
}

/// A replay Envoy caches (`replay_cache.ttl_s`) never outlives idemd's retention of the record it replays.
pub(super) fn replay_cache_within_retention(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    let retention = input.idemd.terminal_retention_s;
    for m in &input.envoy.managers {
        let Some(settings) = m.filter.as_ref().and_then(|f| f.settings.as_ref()) else { continue };
        let cache = &settings.replay_cache;
        if cache.slots > 0 && cache.ttl_s > retention {
            out.push(rule.finding(
                &m.at,
                format!(
                    "the plugin's replay_cache keeps replays {} s (ttl_s; 3600 when unset), longer than \
                     --terminal-retention-s {retention}: Envoy would replay results idemd has already reaped. Lower \
                     ttl_s, or turn the cache off (slots: 0)",
                    cache.ttl_s
                ),
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::check::testing::{findings, flags, hcm, plugin, vhost, Fixture};

    const CONFIRM: &str = r#"
      - name: confirm
        match: { path: /v1/transfers }
        route: { cluster: demo, timeout: 15s }
        metadata: { filter_metadata: { agent_idempotency: { role: confirm, upstream_keys: honoured, scope: s, bind: /amount, lease_ms: 60000 } } }"#;

    #[test]
    fn a_lease_longer_than_the_route_timeout_and_the_upstream_passes() {
        // 15000 + 2000 + 30000 = 47000 < 60000.
        assert_eq!(findings(&Fixture::new(CONFIRM), &flags(), "lease-outlasts-envoy"), Vec::<String>::new());
    }

    #[test]
    fn a_short_lease_behind_a_long_route_timeout_is_refused_with_the_shortfall() {
        let long = CONFIRM.replace("timeout: 15s", "timeout: 40s");
        let found = findings(&Fixture::new(&long), &flags(), "lease-outlasts-envoy");
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("virtual host transfers: route confirm"), "{found:?}");
        // 40000 + 2000 + 30000 = 72000; the lease is 60000.
        assert!(found[0].contains("= 72000 ms (short by 12001 ms)"), "{found:?}");
        assert!(found[0].contains("the route timeout 40000 ms"), "{found:?}");
        // idemd's --lease-ms is the longer one: it wins, and covers it.
        let mut longer = flags();
        longer.lease_ms = 72_001;
        assert_eq!(findings(&Fixture::new(&long), &longer, "lease-outlasts-envoy"), Vec::<String>::new());
        // The route's own lease_ms counts too.
        let route_lease = long.replace("lease_ms: 60000", "lease_ms: 80000");
        assert_eq!(findings(&Fixture::new(&route_lease), &flags(), "lease-outlasts-envoy"), Vec::<String>::new());
    }

    #[test]
    fn the_lease_equal_to_the_worst_case_is_one_ms_short() {
        let mut f = flags();
        f.lease_ms = 1_000;
        let route = CONFIRM.replace("lease_ms: 60000", "lease_ms: 47000");
        let found = findings(&Fixture::new(&route), &f, "lease-outlasts-envoy");
        assert!(found.len() == 1 && found[0].contains("(short by 1 ms)"), "{found:?}");
    }

    #[test]
    fn the_sidecar_timeout_and_the_upstream_worst_case_count() {
        let fixture = Fixture { plugin: plugin(r#""sidecar_timeout_ms": 20000"#), ..Fixture::new(CONFIRM) };
        // 15000 + 20000 + 30000 = 65000.
        let found = findings(&fixture, &flags(), "lease-outlasts-envoy");
        assert!(found.len() == 1 && found[0].contains("sidecar_timeout_ms 20000"), "{found:?}");
        let mut slow = flags();
        slow.upstream_worst_case_ms = 50_000;
        let found = findings(&Fixture::new(CONFIRM), &slow, "lease-outlasts-envoy");
        assert!(found.len() == 1 && found[0].contains("--upstream-worst-case-ms 50000"), "{found:?}");
    }

    #[test]
    fn without_a_route_timeout_the_idle_timeout_is_the_wait_and_without_both_nothing_covers_it() {
        let none = CONFIRM.replace("timeout: 15s", "timeout: 0s");
        // Envoy's default stream idle timeout: 300000 ms.
        let found = findings(&Fixture::new(&none), &flags(), "lease-outlasts-envoy");
        assert!(found.len() == 1 && found[0].contains("Envoy's default 300000 ms"), "{found:?}");
        let idle = Fixture { hcm: hcm("stream_idle_timeout: 10s"), ..Fixture::new(&none) };
        assert_eq!(findings(&idle, &flags(), "lease-outlasts-envoy"), Vec::<String>::new());
        let endless = Fixture { hcm: hcm("stream_idle_timeout: 0s"), ..Fixture::new(&none) };
        let found = findings(&endless, &flags(), "lease-outlasts-envoy");
        assert!(found.len() == 1 && found[0].contains("without end"), "{found:?}");
    }

    #[test]
    fn retries_with_per_try_timeouts_and_back_off_are_the_wait_when_shorter() {
        let retrying = CONFIRM.replace(
            "timeout: 15s }",
            "timeout: 0s, retry_policy: { retry_on: reset, num_retries: 2, per_try_timeout: 9s } }",
        );
        // 9000 × 3 + 25 + 75 = 27100; + 2000 + 30000 = 59100 < 60000.
        assert_eq!(findings(&Fixture::new(&retrying), &flags(), "lease-outlasts-envoy"), Vec::<String>::new());
        let more = retrying.replace("num_retries: 2", "num_retries: 3");
        let found = findings(&Fixture::new(&more), &flags(), "lease-outlasts-envoy");
        assert!(found.len() == 1 && found[0].contains("per_try_timeout 9000 ms × 4 attempts + 275 ms"), "{found:?}");
        // The virtual host's policy applies to a route without one.
        let host = Fixture {
            vhost: vhost("retry_policy: { retry_on: reset, num_retries: 3, per_try_timeout: 9s }"),
            ..Fixture::new(&CONFIRM.replace("timeout: 15s", "timeout: 0s"))
        };
        let found = findings(&host, &flags(), "lease-outlasts-envoy");
        assert!(found.len() == 1 && found[0].contains("the virtual host retry policy"), "{found:?}");
    }

    #[test]
    fn previews_and_status_routes_hold_no_lease() {
        let preview = CONFIRM
            .replace("role: confirm, upstream_keys: honoured", "role: preview")
            .replace("timeout: 15s", "timeout: 0s");
        assert_eq!(findings(&Fixture::new(&preview), &flags(), "lease-outlasts-envoy"), Vec::<String>::new());
    }

    #[test]
    fn an_mcp_route_is_judged_by_its_confirm_tools() {
        let mcp = r#"
      - name: mcp
        match: { path: /mcp }
        route: { cluster: demo, timeout: 60s }
        metadata: { filter_metadata: { agent_idempotency: { role: mcp, tools: '{"pay": {"role": "confirm", "upstream_keys": "honoured", "scope": "s", "bind": "/a", "lease_ms": 30000}, "quote": {"role": "preview", "scope": "s", "bind": "/a"}}' } } }"#;
        let found = findings(&Fixture::new(mcp), &flags(), "lease-outlasts-envoy");
        assert!(found.len() == 1 && found[0].contains("route mcp: tool pay"), "{found:?}");
    }

    #[test]
    fn route_rules_are_judged_by_the_routes_their_requests_take() {
        let catch_all = r#"
      - name: default
        match: { prefix: / }
        route: { cluster: demo, timeout: 0s }"#;
        let rules = r#""routes": [{"name": "pay", "match": {"path": "/v1/transfers"}, "role": "confirm", "upstream_keys": "honoured", "scope": "s", "bind": "/a"}]"#;
        let fixture = Fixture { plugin: plugin(rules), ..Fixture::new(catch_all) };
        let found = findings(&fixture, &flags(), "lease-outlasts-envoy");
        assert!(
            found.len() == 1 && found[0].contains("rule pay via virtual host transfers: route default"),
            "{found:?}"
        );
        // A route the rule's requests never take does not count.
        let elsewhere = catch_all.replace("prefix: /", "prefix: /v2/");
        let fixture = Fixture { plugin: plugin(rules), ..Fixture::new(&elsewhere) };
        assert_eq!(findings(&fixture, &flags(), "lease-outlasts-envoy"), Vec::<String>::new());
    }

    #[test]
    fn retention_must_cover_the_longest_fingerprint_and_the_retry_window() {
        let preview = r#"
      - name: preview
        match: { path: /v1/transfers/preview }
        route: { cluster: demo }
        metadata: { filter_metadata: { agent_idempotency: { role: preview, scope: s, bind: /amount, fingerprint_ttl_s: 3600 } } }"#;
        let fixture = Fixture::new(&format!("{preview}{CONFIRM}"));
        assert_eq!(findings(&fixture, &flags(), "retention-outlasts-fingerprints"), Vec::<String>::new());
        let mut short = flags();
        short.terminal_retention_s = 86_400;
        short.retry_window_s = 86_400;
        let found = findings(&fixture, &short, "retention-outlasts-fingerprints");
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("route preview") && found[0].contains("= 90000 s (short by 3600 s)"), "{found:?}");
        // The plugin's default lifetime is the longest when no route says otherwise.
        let fixture = Fixture { plugin: plugin(r#""defaults": {"fingerprint_ttl_s": 7200}"#), ..Fixture::new(CONFIRM) };
        let found = findings(&fixture, &short, "retention-outlasts-fingerprints");
        assert!(found.len() == 1 && found[0].contains("7200 s"), "{found:?}");
    }

    #[test]
    fn a_replay_cache_longer_than_the_retention_is_refused_unless_it_is_off() {
        let mut short = flags();
        short.terminal_retention_s = 1_800;
        short.retry_window_s = 600;
        // The default cache keeps replays 3600 s.
        let found = findings(&Fixture::new(CONFIRM), &short, "replay-cache-within-retention");
        assert!(found.len() == 1 && found[0].contains("keeps replays 3600 s"), "{found:?}");
        let fixture = Fixture { plugin: plugin(r#""replay_cache": {"ttl_s": 1800}"#), ..Fixture::new(CONFIRM) };
        assert_eq!(findings(&fixture, &short, "replay-cache-within-retention"), Vec::<String>::new());
        let off = Fixture { plugin: plugin(r#""replay_cache": {"slots": 0}"#), ..Fixture::new(CONFIRM) };
        assert_eq!(findings(&off, &short, "replay-cache-within-retention"), Vec::<String>::new());
    }

    #[test]
    fn flags_idemd_serve_refuses_are_refused_here_too() {
        let mut broken = flags();
        broken.lease_ms = 1_000;
        let found = findings(&Fixture::new(CONFIRM), &broken, "idemd-start");
        assert!(found.len() == 1 && found[0].contains("idemd serve refuses to start"), "{found:?}");
        assert_eq!(findings(&Fixture::new(CONFIRM), &flags(), "idemd-start"), Vec::<String>::new());
    }
}
