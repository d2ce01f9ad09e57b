//! How long Envoy may wait for the upstream of one route, read from Envoy's own
//! settings (its documentation: the route `timeout`, `RetryPolicy`,
//! `idle_timeout`, `MaxStreamDuration`, and the connection manager's
//! `stream_idle_timeout` and `common_http_protocol_options.max_stream_duration`),
//! and what a retry policy retries on. The TTL rules compare idemd's lease with
//! this wait instead of a flag someone typed.
//!
//! Every setting that ends the wait is a bound, and the wait is the smallest:
//!
//! * the route `timeout` (15 s when unset, none when `0s`) covers every attempt,
//!   retries and back-off included; with `grpc_timeout_header_max` (or the
//!   deprecated `max_grpc_timeout`) a request sent as gRPC picks its own
//!   timeout up to that maximum (`0s`: any), and the filter does not look at the
//!   content type, so a client can;
//! * a retry policy's `per_try_timeout` × (`num_retries` + 1) plus the longest
//!   back-off of every retry (default 25 ms base, 10 × base maximum; with
//!   `rate_limited_retry_back_off`, up to 1.5 × its `max_interval`, 300 s by
//!   default, per retry);
//! * the idle timeout: the route's `idle_timeout`, else the manager's
//!   `stream_idle_timeout` (5 minutes when unset; `0s` disables either). While
//!   the upstream sends nothing the stream is idle, so it ends the wait for an
//!   answer;
//! * `max_stream_duration`: the route's, else the manager's.
//!
//! The connection manager's `request_timeout` is not a bound: Envoy disarms it
//! once the request has gone upstream.

use serde_json::Value;

/// Envoy's default route timeout.
pub const DEFAULT_ROUTE_TIMEOUT_MS: u64 = 15_000;
/// Envoy's default `stream_idle_timeout`.
pub const DEFAULT_STREAM_IDLE_TIMEOUT_MS: u64 = 300_000;
/// Envoy's default retry back-off base (`upstream.base_retry_backoff_ms`); the maximum is 10 × the base.
const DEFAULT_BACKOFF_BASE_MS: u64 = 25;
/// `rate_limited_retry_back_off.max_interval` when unset.
const DEFAULT_RATE_LIMITED_MAX_MS: u64 = 300_000;

/// A route's own timeouts, as written (None: unset).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RouteTimeouts {
    pub timeout_ms: Option<u64>,
    pub idle_timeout_ms: Option<u64>,
    pub max_stream_duration_ms: Option<u64>,
    /// `max_stream_duration.grpc_timeout_header_max`, or the deprecated `max_grpc_timeout`.
    pub grpc_timeout_max_ms: Option<u64>,
}

/// The connection manager's stream bounds, as written (None: unset).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ManagerTimeouts {
    pub stream_idle_timeout_ms: Option<u64>,
    pub max_stream_duration_ms: Option<u64>,
}

/// A `retry_policy` (route or virtual host: the route's replaces the virtual host's entirely).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retry {
    /// `route` or `virtual host`: where it is set.
    pub from: &'static str,
    /// `retry_on`, split on commas.
    pub retry_on: Vec<String>,
    pub num_retries: u64,
    pub per_try_timeout_ms: Option<u64>,
    pub backoff_base_ms: u64,
    pub backoff_max_ms: u64,
    /// `rate_limited_retry_back_off.max_interval`, when that back-off is configured.
    pub rate_limited_max_ms: Option<u64>,
    pub retriable_status_codes: Vec<u16>,
}

impl Retry {
    /// Whether an attempt this policy retries may have reached the upstream (anything but the conditions that
    /// prove it did not).
    pub fn may_repeat_a_sent_request(&self) -> bool {
        self.retry_on.iter().any(|c| !matches!(condition(c), Some(Condition::NeverSent | Condition::RateLimited)))
    }

    /// Whether every condition proves Envoy sent nothing, not even on the word of the upstream's headers.
    pub fn only_never_sent(&self) -> bool {
        self.retry_on.iter().all(|c| condition(c) == Some(Condition::NeverSent))
    }

    /// The longest all retries can wait between attempts.
    pub fn backoff_total_ms(&self) -> u64 {
        (1..=self.num_retries.min(64)).fold(0u64, |sum, n| {
            // Fully jittered exponential back-off: retry N waits less than (2^N - 1) × base, capped at the maximum.
            let exponential = (1u64 << n.min(62)).saturating_sub(1).saturating_mul(self.backoff_base_ms);
            let mut longest = exponential.min(self.backoff_max_ms);
            if let Some(max) = self.rate_limited_max_ms {
                // A reset header's interval, jittered up to 1.5 times, and at most max_interval before the jitter.
                longest = longest.max(max.saturating_mul(3) / 2);
            }
            sum.saturating_add(longest)
        })
    }
}

/// How long Envoy may wait for the upstream, and which setting says so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wait {
    /// None: nothing bounds it.
    pub ms: Option<u64>,
    pub how: String,
}

/// The smallest bound on Envoy's wait for the upstream of a route.
pub fn envoy_wait(route: &RouteTimeouts, retry: Option<&Retry>, manager: &ManagerTimeouts) -> Wait {
    let mut bounds: Vec<(u64, String)> = Vec::new();
    let mut unbounded: Vec<String> = Vec::new();

    let timeout = route.timeout_ms.unwrap_or(DEFAULT_ROUTE_TIMEOUT_MS);
    let timeout_text = match route.timeout_ms {
        None => format!("the route timeout, unset: Envoy's default {timeout} ms"),
        Some(t) => format!("the route timeout {t} ms"),
    };
    match (timeout, route.grpc_timeout_max_ms) {
        (0, _) => unbounded.push("route timeout 0s".into()),
        (_, Some(0)) => unbounded.push(
            "grpc_timeout_header_max 0s: a request sent as gRPC has no timeout unless it sends grpc-timeout".into(),
        ),
        (t, Some(g)) if g > t => bounds.push((
            g,
            format!("grpc_timeout_header_max {g} ms: a request sent as gRPC sets its own timeout up to that"),
        )),
        (t, _) => bounds.push((t, timeout_text)),
    }

    // Without a per-try timeout each attempt runs until another bound ends it.
    if let Some((r, per_try)) = retry.and_then(|r| r.per_try_timeout_ms.filter(|&p| p > 0).map(|p| (r, p))) {
        let attempts = r.num_retries.saturating_add(1);
        let backoff = r.backoff_total_ms();
        bounds.push((
            per_try.saturating_mul(attempts).saturating_add(backoff),
            format!(
                "the {} retry policy: per_try_timeout {per_try} ms × {attempts} attempts + {backoff} ms back-off",
                r.from
            ),
        ));
    }

    let idle = match route.idle_timeout_ms {
        Some(i) => Some((i, format!("the route idle_timeout {i} ms"))),
        None => match manager.stream_idle_timeout_ms {
            None => Some((
                DEFAULT_STREAM_IDLE_TIMEOUT_MS,
                format!("the stream idle timeout, unset: Envoy's default {DEFAULT_STREAM_IDLE_TIMEOUT_MS} ms"),
            )),
            Some(i) => Some((i, format!("the connection manager's stream_idle_timeout {i} ms"))),
        },
    };
    match idle {
        Some((0, _)) | None => unbounded.push("idle timeout 0s".into()),
        Some(bound) => bounds.push(bound),
    }

    let stream = match route.max_stream_duration_ms {
        Some(d) => Some((d, format!("the route max_stream_duration {d} ms"))),
        None => {
            manager.max_stream_duration_ms.map(|d| (d, format!("the connection manager's max_stream_duration {d} ms")))
        }
    };
    if let Some(bound) = stream.filter(|(d, _)| *d > 0) {
        bounds.push(bound);
    }

    match bounds.into_iter().min_by_key(|(ms, _)| *ms) {
        Some((ms, how)) => Wait { ms: Some(ms), how },
        None => Wait { ms: None, how: format!("nothing bounds it: {}", unbounded.join("; ")) },
    }
}

/// What a retry condition retries after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Condition {
    /// The request provably never reached the upstream: connect failure, a refused stream (HTTP/2
    /// REFUSED_STREAM: the server did not process it), a reset before the request went out.
    NeverSent,
    /// An upstream Envoy's rate limit answered (`x-envoy-ratelimited`): the application never saw it, but the
    /// proof is a header the upstream sets.
    RateLimited,
    /// No answer came (disconnect, reset): the attempt may have run; a retry is safe only with the same
    /// Idempotency-Key to an upstream that deduplicates.
    NoAnswer,
    /// An answer the upstream sent, or a per-try timeout: the attempt may have run, and the retry hides the
    /// answer the filter would have recorded.
    Answered,
    /// Retriable statuses: judged status by status.
    Statuses,
}

/// How `retry_on` condition `name` retries (Envoy's router documentation: `x-envoy-retry-on`,
/// `x-envoy-retry-grpc-on`). None: not a condition this check knows.
pub fn condition(name: &str) -> Option<Condition> {
    Some(match name {
        "connect-failure" | "refused-stream" | "reset-before-request" => Condition::NeverSent,
        "envoy-ratelimited" => Condition::RateLimited,
        "reset" | "http3-post-connect-failure" => Condition::NoAnswer,
        // 5xx and gateway-error retry per-try timeouts too; retriable-headers matches any answer.
        "5xx" | "gateway-error" | "retriable-4xx" | "retriable-headers" => Condition::Answered,
        "cancelled" | "deadline-exceeded" | "internal" | "resource-exhausted" | "unavailable" => Condition::Answered,
        "retriable-status-codes" => Condition::Statuses,
        _ => return None,
    })
}

/// An Envoy `Duration` in ms: `"15s"`, `"0.5s"`, or `{seconds, nanos}`; a fraction of a ms rounds up.
pub fn duration_ms(v: &Value) -> Result<u64, String> {
    if let Some(text) = v.as_str() {
        let secs = text.strip_suffix('s').ok_or_else(|| format!("{text:?} is not a duration such as \"15s\""))?;
        let (whole, frac) = secs.split_once('.').unwrap_or((secs, ""));
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(whole) || !(frac.is_empty() || digits(frac)) {
            return Err(format!("{text:?} is not a duration such as \"15s\""));
        }
        let whole: u64 = whole.parse().map_err(|_| format!("{text:?} is too long a duration"))?;
        let ms_digits: String = frac.chars().chain("000".chars()).take(3).collect();
        let rest_nonzero = frac.chars().skip(3).any(|c| c != '0');
        let frac_ms: u64 = ms_digits.parse().unwrap_or(0);
        return Ok(whole.saturating_mul(1000).saturating_add(frac_ms).saturating_add(u64::from(rest_nonzero)));
    }
    if let Some(obj) = v.as_object() {
        let seconds = obj.get("seconds").map_or(Some(0), Value::as_u64);
        let nanos = obj.get("nanos").map_or(Some(0), Value::as_u64);
        if let (Some(s), Some(n)) = (seconds, nanos) {
            if obj.keys().all(|k| k == "seconds" || k == "nanos") {
                return Ok(s.saturating_mul(1000).saturating_add(n.div_ceil(1_000_000)));
            }
        }
    }
    Err(format!("{v} is not a duration such as \"15s\""))
}

fn optional_duration(v: &Value, key: &str) -> Result<Option<u64>, String> {
    v.get(key).map(|d| duration_ms(d).map_err(|e| format!("{key}: {e}"))).transpose()
}

/// The timeouts of a route's `route` action.
pub fn route_timeouts(action: &Value) -> Result<RouteTimeouts, String> {
    let stream = action.get("max_stream_duration");
    let grpc_max = match stream.map(|s| optional_duration(s, "grpc_timeout_header_max")).transpose()?.flatten() {
        Some(g) => Some(g),
        None => optional_duration(action, "max_grpc_timeout")?,
    };
    Ok(RouteTimeouts {
        timeout_ms: optional_duration(action, "timeout")?,
        idle_timeout_ms: optional_duration(action, "idle_timeout")?,
        max_stream_duration_ms: stream.map(|s| optional_duration(s, "max_stream_duration")).transpose()?.flatten(),
        grpc_timeout_max_ms: grpc_max,
    })
}

/// The stream bounds of a connection manager.
pub fn manager_timeouts(hcm: &Value) -> Result<ManagerTimeouts, String> {
    let common = hcm.get("common_http_protocol_options");
    Ok(ManagerTimeouts {
        stream_idle_timeout_ms: optional_duration(hcm, "stream_idle_timeout")?,
        max_stream_duration_ms: common.map(|c| optional_duration(c, "max_stream_duration")).transpose()?.flatten(),
    })
}

/// `hedge_policy.hedge_on_per_try_timeout` of the route action, else of its virtual host (the route's policy
/// replaces the virtual host's entirely): a second attempt while the first may still run.
pub fn hedges(action: &Value, host: &Value) -> bool {
    let hedge =
        |v: &Value| v.get("hedge_policy").map(|h| h.get("hedge_on_per_try_timeout") == Some(&Value::Bool(true)));
    hedge(action).or_else(|| hedge(host)).unwrap_or(false)
}

/// The retry policy set on `v` (a route action or a virtual host). `retry_policy_typed_config` counts as a
/// retry policy whose conditions this check cannot read.
pub fn retry(v: &Value, from: &'static str) -> Result<Option<Retry>, String> {
    if v.get("retry_policy").is_none() && v.get("retry_policy_typed_config").is_some() {
        return Ok(Some(Retry {
            from,
            retry_on: vec!["retry_policy_typed_config".into()],
            num_retries: 1,
            per_try_timeout_ms: None,
            backoff_base_ms: DEFAULT_BACKOFF_BASE_MS,
            backoff_max_ms: 10 * DEFAULT_BACKOFF_BASE_MS,
            rate_limited_max_ms: None,
            retriable_status_codes: Vec::new(),
        }));
    }
    let Some(p) = v.get("retry_policy") else { return Ok(None) };
    let at = |e: String| format!("{from} retry_policy: {e}");
    let retry_on = p.get("retry_on").and_then(Value::as_str).unwrap_or_default();
    let num_retries = match p.get("num_retries") {
        None => 1,
        Some(n) => n.as_u64().ok_or_else(|| at(format!("num_retries: {n} is not a count")))?,
    };
    let backoff = p.get("retry_back_off");
    let base = backoff.map(|b| optional_duration(b, "base_interval")).transpose().map_err(at)?.flatten();
    let base = base.unwrap_or(DEFAULT_BACKOFF_BASE_MS).max(1);
    let max = backoff.map(|b| optional_duration(b, "max_interval")).transpose().map_err(at)?.flatten();
    let rate_limited = match p.get("rate_limited_retry_back_off") {
        None => None,
        Some(r) => Some(optional_duration(r, "max_interval").map_err(at)?.unwrap_or(DEFAULT_RATE_LIMITED_MAX_MS)),
    };
    let codes = p.get("retriable_status_codes").and_then(Value::as_array).into_iter().flatten();
    let retriable_status_codes = codes
        .map(|c| c.as_u64().and_then(|c| u16::try_from(c).ok()).ok_or_else(|| at(format!("{c} is not a status"))))
        .collect::<Result<_, _>>()?;
    Ok(Some(Retry {
        from,
        retry_on: retry_on.split(',').map(str::trim).filter(|c| !c.is_empty()).map(str::to_string).collect(),
        num_retries,
        per_try_timeout_ms: optional_duration(p, "per_try_timeout").map_err(at)?,
        backoff_base_ms: base,
        backoff_max_ms: max.unwrap_or(base.saturating_mul(10)),
        rate_limited_max_ms: rate_limited,
        retriable_status_codes,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn durations_as_envoy_writes_them() {
        assert_eq!(duration_ms(&json!("15s")), Ok(15_000));
        assert_eq!(duration_ms(&json!("0s")), Ok(0));
        assert_eq!(duration_ms(&json!("0.5s")), Ok(500));
        assert_eq!(duration_ms(&json!("1.0001s")), Ok(1_001), "a fraction of a ms rounds up");
        assert_eq!(duration_ms(&json!({"seconds": 2, "nanos": 500_000})), Ok(2_001));
        for bad in [json!("15"), json!("1m"), json!("-1s"), json!("s"), json!(15), json!({"minutes": 1})] {
            assert!(duration_ms(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_route_timeout_bounds_the_wait_and_defaults_to_15_s() {
        let none = ManagerTimeouts::default();
        let w = envoy_wait(&RouteTimeouts::default(), None, &none);
        assert_eq!(w.ms, Some(15_000));
        assert!(w.how.contains("Envoy's default 15000 ms"), "{}", w.how);
        let w = envoy_wait(&RouteTimeouts { timeout_ms: Some(40_000), ..Default::default() }, None, &none);
        assert_eq!(w.ms, Some(40_000));
    }

    #[test]
    fn without_a_route_timeout_the_idle_and_stream_timeouts_bound_it() {
        let route = RouteTimeouts { timeout_ms: Some(0), ..Default::default() };
        let w = envoy_wait(&route, None, &ManagerTimeouts::default());
        assert_eq!(w.ms, Some(300_000), "the stream idle timeout's default: {}", w.how);
        let idle = ManagerTimeouts { stream_idle_timeout_ms: Some(30_000), max_stream_duration_ms: None };
        assert_eq!(envoy_wait(&route, None, &idle).ms, Some(30_000));
        let route_idle = RouteTimeouts { idle_timeout_ms: Some(0), ..route.clone() };
        let w = envoy_wait(&route_idle, None, &idle);
        assert_eq!(w.ms, None, "the route's 0s idle_timeout disables the manager's: {}", w.how);
        let stream = ManagerTimeouts { stream_idle_timeout_ms: Some(0), max_stream_duration_ms: Some(20_000) };
        assert_eq!(envoy_wait(&route, None, &stream).ms, Some(20_000));
        let route_stream = RouteTimeouts { max_stream_duration_ms: Some(0), ..route };
        assert_eq!(envoy_wait(&route_stream, None, &stream).ms, None);
    }

    #[test]
    fn a_grpc_timeout_header_may_lift_the_route_timeout() {
        let none = ManagerTimeouts::default();
        let lifted =
            RouteTimeouts { timeout_ms: Some(15_000), grpc_timeout_max_ms: Some(60_000), ..Default::default() };
        assert_eq!(envoy_wait(&lifted, None, &none).ms, Some(60_000));
        let any = RouteTimeouts { grpc_timeout_max_ms: Some(0), ..lifted };
        assert_eq!(envoy_wait(&any, None, &none).ms, Some(300_000), "only the idle timeout is left");
    }

    fn policy(v: Value) -> Retry {
        match retry(&json!({ "retry_policy": v }), "route") {
            Ok(Some(r)) => r,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn retries_bound_the_wait_by_per_try_timeout_times_attempts_plus_back_off() {
        let r = policy(json!({"retry_on": "reset", "num_retries": 3, "per_try_timeout": "2s"}));
        // 25 ms base: retries wait < 25, 75, 175 ms.
        assert_eq!(r.backoff_total_ms(), 275);
        let w = envoy_wait(&RouteTimeouts { timeout_ms: Some(0), ..Default::default() }, Some(&r), &Default::default());
        assert_eq!(w.ms, Some(8_275), "{}", w.how);
        // The route timeout includes every retry: the smaller bound wins.
        assert_eq!(envoy_wait(&RouteTimeouts::default(), Some(&r), &Default::default()).ms, Some(8_275));
        let r = policy(json!({"retry_on": "reset", "num_retries": 5, "per_try_timeout": "5s"}));
        assert_eq!(envoy_wait(&RouteTimeouts::default(), Some(&r), &Default::default()).ms, Some(15_000));
    }

    #[test]
    fn back_off_is_capped_by_its_maximum_and_rate_limited_back_off_counts_in_full() {
        let r = policy(json!({"retry_on": "reset", "num_retries": 4,
            "retry_back_off": {"base_interval": "0.1s", "max_interval": "0.5s"}}));
        // 100, 300, 500 (cap), 500 (cap).
        assert_eq!(r.backoff_total_ms(), 1_400);
        let r = policy(json!({"retry_on": "reset", "num_retries": 2,
            "rate_limited_retry_back_off": {"reset_headers": [{"name": "Retry-After"}]}}));
        assert_eq!(r.backoff_total_ms(), 2 * 450_000);
        let r = policy(json!({"retry_on": "reset"}));
        assert_eq!((r.num_retries, r.backoff_total_ms()), (1, 25), "one retry by default");
    }

    #[test]
    fn retry_conditions_are_read_as_envoy_documents_them() {
        assert_eq!(condition("connect-failure"), Some(Condition::NeverSent));
        assert_eq!(condition("envoy-ratelimited"), Some(Condition::RateLimited));
        assert_eq!(condition("reset"), Some(Condition::NoAnswer));
        assert_eq!(condition("5xx"), Some(Condition::Answered));
        assert_eq!(condition("gateway-error"), Some(Condition::Answered));
        assert_eq!(condition("unavailable"), Some(Condition::Answered));
        assert_eq!(condition("retriable-status-codes"), Some(Condition::Statuses));
        assert_eq!(condition("5XX"), None);
    }
}
