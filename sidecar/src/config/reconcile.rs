//! Settings of the background work in `idemd serve`: the reconciler (expired
//! IN_FLIGHT rows) and the reaper (terminal rows past the retention).
//!
//! Checked at start next to the TTL rules, for the same reason: a grace
//! longer than the retention, or a status endpoint that can never answer, is
//! not a runtime error but a silent gap in "did it happen?".

use std::collections::BTreeMap;
use std::time::Duration;

use clap::Args;

use super::TtlArgs;
use crate::reconcile::decide::{Reading, Rules};
use crate::reconcile::lookup::StatusClient;
use crate::reconcile::target::{StatusEndpoints, KEY_PLACEHOLDER, REF_PLACEHOLDER};
use crate::reconcile::Lookups;

/// Where each scope's upstream says whether an operation ran, and how its answer reads: what the
/// reconciler asks, and what a person's release of an operation asks at that moment
/// (`review`). `idemd serve` and `idemd ops` read the same flags and variables.
#[derive(Debug, Clone, Args)]
pub struct StatusArgs {
    /// The upstream's status endpoint for one scope, as SCOPE=URL; `{key}` in
    /// the URL is replaced by the operation's nonce (also sent as
    /// `Idempotency-Key`), `{ref}` by its business reference (the route's
    /// `business_ref`, percent-encoded). An operation whose upstream ignores
    /// keys (`upstream_keys: ignored`) is looked up only by `{ref}`; with both
    /// placeholders `{ref}` must be in the query, and is empty for an
    /// operation without a reference. Repeatable; in the environment,
    /// comma-separated. A scope without one goes to NEEDS_REVIEW when its
    /// lease runs out.
    #[arg(long = "status-endpoint", env = "IDEM_STATUS_ENDPOINTS", value_delimiter = ',', value_name = "SCOPE=URL")]
    pub status_endpoints: Vec<String>,

    /// How a scope's status record reads, as SCOPE=SPEC with SPEC
    /// `pointer=/state;done=EXECUTED|SETTLED;failed=REJECTED;done_status=201;failed_status=422`
    /// (every part optional). Without one: `/status` of "failed" is FAILED,
    /// anything else DONE, both replayed with HTTP 200. Repeatable; in the
    /// environment, comma-separated.
    #[arg(long = "status-reading", env = "IDEM_STATUS_READINGS", value_delimiter = ',', value_name = "SCOPE=SPEC")]
    pub status_readings: Vec<String>,

    /// Budget for one status lookup (connect, answer and body).
    #[arg(long, env = "IDEM_STATUS_TIMEOUT_MS", default_value_t = 5_000)]
    pub status_timeout_ms: u64,

    /// A 404 from the status endpoint proves "never executed" only once the
    /// lease ended at least this long ago: it covers a request still sitting
    /// in the upstream's queue, and must be no shorter than the time the
    /// status endpoint takes to show a record the upstream wrote (its index
    /// lag; docs/model.md, "A status endpoint that lags").
    #[arg(long, env = "IDEM_RECONCILE_GRACE_MS", default_value_t = 30_000)]
    pub reconcile_grace_ms: u64,
}

#[derive(Debug, Clone, Args)]
pub struct ReconcileArgs {
    #[command(flatten)]
    pub status: StatusArgs,

    /// How often the reconciler looks for expired IN_FLIGHT rows.
    #[arg(long, env = "IDEM_RECONCILE_INTERVAL_MS", default_value_t = 5_000)]
    pub reconcile_interval_ms: u64,

    /// Failed lookups (errors, timeouts, unexpected answers) of one row
    /// before it goes to NEEDS_REVIEW.
    #[arg(long, env = "IDEM_RECONCILE_RETRY_BUDGET", default_value_t = 5)]
    pub reconcile_retry_budget: u32,

    /// Rows one reconciler pass looks at.
    #[arg(long, env = "IDEM_RECONCILE_BATCH", default_value_t = 100)]
    pub reconcile_batch: u32,

    /// How often the reaper deletes terminal rows past the retention.
    #[arg(long, env = "IDEM_REAPER_INTERVAL_S", default_value_t = 300)]
    pub reaper_interval_s: u64,

    /// Rows per reaper DELETE.
    #[arg(long, env = "IDEM_REAPER_BATCH", default_value_t = 1_000)]
    pub reaper_batch: u32,

    /// Serve the API only: no reconciler, no reaper (other replicas run them).
    #[arg(long, env = "IDEM_NO_RECONCILE")]
    pub no_reconcile: bool,

    /// Names this process in the audit trail (`reconciler:<id>`); default
    /// `<hostname>/<pid>`.
    #[arg(long, env = "IDEM_INSTANCE_ID")]
    pub instance_id: Option<String>,
}

impl StatusArgs {
    /// Every broken rule, each naming the setting; the endpoints when none is.
    pub fn validate(&self) -> Result<StatusEndpoints, Vec<String>> {
        let mut broken = Vec::new();
        let mut endpoints = StatusEndpoints::new();
        for spec in &self.status_endpoints {
            match parse_endpoint(spec) {
                Ok((scope, url)) => {
                    if endpoints.insert(scope.clone(), url).is_some() {
                        broken.push(format!("--status-endpoint: scope {scope:?} is configured twice"));
                    }
                }
                Err(why) => broken.push(format!("--status-endpoint {spec:?}: {why}")),
            }
        }
        match self.readings() {
            Ok(readings) => {
                for scope in readings.keys().filter(|s| !endpoints.contains_key(*s)) {
                    broken.push(format!(
                        "--status-reading: scope {scope:?} has a reading but no --status-endpoint to read"
                    ));
                }
            }
            Err(mut why) => broken.append(&mut why),
        }
        if self.status_timeout_ms == 0 {
            broken.push("--status-timeout-ms must be greater than 0".to_string());
        }
        // Keep every `now + x` in i64 milliseconds.
        for (name, value) in
            [("--status-timeout-ms", self.status_timeout_ms), ("--reconcile-grace-ms", self.reconcile_grace_ms)]
        {
            if value > MAX_MS {
                broken.push(format!("{name} is too large (at most {MAX_MS} ms)"));
            }
        }
        if broken.is_empty() {
            Ok(endpoints)
        } else {
            Err(broken)
        }
    }

    /// Scope → how its status record reads; every broken declaration named.
    pub fn readings(&self) -> Result<BTreeMap<String, Reading>, Vec<String>> {
        let mut broken = Vec::new();
        let mut readings = BTreeMap::new();
        for spec in &self.status_readings {
            let parsed = spec
                .split_once('=')
                .ok_or_else(|| "expected SCOPE=SPEC".to_string())
                .and_then(|(scope, rest)| Ok((scope.trim().to_string(), Reading::parse(rest)?)));
            match parsed {
                Ok((scope, reading)) => {
                    if readings.insert(scope.clone(), reading).is_some() {
                        broken.push(format!("--status-reading: scope {scope:?} is declared twice"));
                    }
                }
                Err(why) => broken.push(format!("--status-reading {spec:?}: {why}")),
            }
        }
        if broken.is_empty() {
            Ok(readings)
        } else {
            Err(broken)
        }
    }

    pub fn status_timeout(&self) -> Duration {
        Duration::from_millis(self.status_timeout_ms)
    }

    /// The status client and the rules that read its answers, as configured; `retry_budget`: the
    /// reconciler's (a person's release never counts attempts).
    pub fn lookups(&self, retry_budget: u32) -> Result<Lookups, Vec<String>> {
        let endpoints = self.validate()?;
        let readings = self.readings()?;
        let status = StatusClient::new(endpoints, self.status_timeout()).map_err(|e| vec![e])?;
        let rules = Rules { grace_ms: self.reconcile_grace_ms, retry_budget, readings: std::sync::Arc::new(readings) };
        Ok(Lookups { status, rules })
    }
}

impl ReconcileArgs {
    /// Every broken rule, each naming the setting; the endpoints when none is.
    pub fn validate(&self, ttl: &TtlArgs) -> Result<StatusEndpoints, Vec<String>> {
        let status = self.status.validate();
        let mut broken = status.as_ref().err().cloned().unwrap_or_default();
        for (name, value) in [
            ("--reconcile-interval-ms", self.reconcile_interval_ms),
            ("--reconcile-retry-budget", u64::from(self.reconcile_retry_budget)),
            ("--reconcile-batch", u64::from(self.reconcile_batch)),
            ("--reaper-interval-s", self.reaper_interval_s),
            ("--reaper-batch", u64::from(self.reaper_batch)),
        ] {
            if value == 0 {
                broken.push(format!("{name} must be greater than 0"));
            }
        }
        if self.status.reconcile_grace_ms > ttl.terminal_retention_ms() {
            broken.push(format!(
                "reconcile grace {} ms must not exceed the terminal retention {} s: a row would be reaped before a 404 could release it",
                self.status.reconcile_grace_ms, ttl.terminal_retention_s
            ));
        }
        // Keep every `now + x` in i64 milliseconds.
        for (name, value) in [
            ("--reconcile-interval-ms", self.reconcile_interval_ms),
            ("--reaper-interval-s", self.reaper_interval_s.saturating_mul(1000)),
        ] {
            if value > MAX_MS {
                broken.push(format!("{name} is too large (at most {MAX_MS} ms)"));
            }
        }
        if let Some(id) = &self.instance_id {
            if id.is_empty() || id.len() > 64 || !id.bytes().all(|c| c.is_ascii_graphic()) {
                broken.push("--instance-id must be 1 to 64 printable ASCII characters without spaces".to_string());
            }
        }
        match status {
            Ok(endpoints) if broken.is_empty() => Ok(endpoints),
            _ => Err(broken),
        }
    }

    pub fn interval(&self) -> Duration {
        Duration::from_millis(self.reconcile_interval_ms)
    }

    pub fn reaper_interval(&self) -> Duration {
        Duration::from_secs(self.reaper_interval_s)
    }

    /// This process's name in the audit trail.
    pub fn instance(&self) -> String {
        match &self.instance_id {
            Some(id) => id.clone(),
            None => {
                let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .ok()
                    .or_else(|| std::env::var("HOSTNAME").ok())
                    .map(|h| h.trim().to_string())
                    .filter(|h| !h.is_empty())
                    .unwrap_or_else(|| "idemd".to_string());
                format!("{host}/{}", std::process::id())
            }
        }
    }
}

/// 30 days: no interval, grace or timeout needs more.
const MAX_MS: u64 = 30 * 24 * 3600 * 1000;

/// `SCOPE=URL`, with the URL checked the way the reconciler will use it.
fn parse_endpoint(spec: &str) -> Result<(String, String), String> {
    let (scope, url) = spec.split_once('=').ok_or("expected SCOPE=URL")?;
    let (scope, url) = (scope.trim(), url.trim());
    if scope.is_empty() || scope.len() > 255 || !scope.bytes().all(|c| c.is_ascii_graphic()) {
        return Err("the scope must be 1 to 255 printable ASCII characters without spaces".into());
    }
    if url.starts_with("https://") {
        // No TLS stack is built in: the sidecar talks to in-cluster endpoints,
        // and TLS to the upstream is the mesh's or the local Envoy's job.
        return Err("https is not supported: point it at a plain-http listener (a local Envoy or mesh sidecar that originates TLS)".into());
    }
    if !url.starts_with("http://") {
        return Err("the URL must start with http://".into());
    }
    let (by_key, by_ref) = (url.find(KEY_PLACEHOLDER), url.find(REF_PLACEHOLDER));
    if by_key.is_none() && by_ref.is_none() {
        return Err(format!(
            "the URL must contain {KEY_PLACEHOLDER} (where the operation's nonce goes) or {REF_PLACEHOLDER} \
             (its business reference), or both"
        ));
    }
    // With both, an operation without a business reference is looked up by key with `{ref}`
    // empty (reconcile::target): harmless in a query (`ref=`), but in the path it would ask
    // another resource (`/by-ref/?key=…`), whose 404 would read as "never executed".
    if let (Some(_), Some(at)) = (by_key, by_ref) {
        if url.find('?').is_none_or(|query| at < query) {
            return Err(format!(
                "with both {KEY_PLACEHOLDER} and {REF_PLACEHOLDER}, {REF_PLACEHOLDER} must be in the query \
                 (…?ref={REF_PLACEHOLDER}): an operation without a business reference is looked up with it empty"
            ));
        }
    }
    let sample = url.replace(KEY_PLACEHOLDER, "0123456789abcdef0123456789abcdef").replace(REF_PLACEHOLDER, "ref-1");
    match reqwest::Url::parse(&sample) {
        Ok(u) if u.host_str().is_some_and(|h| !h.is_empty()) => Ok((scope.to_string(), url.to_string())),
        Ok(_) => Err("the URL has no host".into()),
        Err(e) => Err(format!("not a valid URL: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status() -> StatusArgs {
        StatusArgs {
            status_endpoints: vec!["payments.transfer=http://127.0.0.1:8080/v1/transfers/by-key/{key}".into()],
            status_readings: vec![],
            status_timeout_ms: 5_000,
            reconcile_grace_ms: 30_000,
        }
    }

    fn args() -> ReconcileArgs {
        ReconcileArgs {
            status: status(),
            reconcile_interval_ms: 5_000,
            reconcile_retry_budget: 5,
            reconcile_batch: 100,
            reaper_interval_s: 300,
            reaper_batch: 1_000,
            no_reconcile: false,
            instance_id: None,
        }
    }

    fn ttl() -> TtlArgs {
        TtlArgs {
            lease_ms: 60_000,
            upstream_worst_case_ms: 30_000,
            gateway_timeout_ms: 15_000,
            retry_backoff_total_ms: 5_000,
            terminal_retention_s: 7 * 86_400,
            retry_window_s: 86_400,
        }
    }

    #[test]
    fn defaults_with_one_endpoint_are_valid() {
        let endpoints = args().validate(&ttl()).unwrap();
        assert_eq!(endpoints["payments.transfer"], "http://127.0.0.1:8080/v1/transfers/by-key/{key}");
    }

    #[test]
    fn endpoint_rules_name_the_endpoint() {
        for (spec, says) in [
            ("payments.transfer", "expected SCOPE=URL"),
            ("=http://h/{key}", "the scope must be"),
            ("a b=http://h/{key}", "the scope must be"),
            ("s=ftp://h/{key}", "must start with http://"),
            ("s=https://h/{key}", "https is not supported"),
            ("s=http://h/by-key", "must contain {key} (where the operation's nonce goes) or {ref}"),
            ("s=http://h/by-ref/{ref}?key={key}", "{ref} must be in the query"),
            ("s=http://h/{ref}/{key}", "{ref} must be in the query"),
            ("s=http://:80/{key}", "not a valid URL"),
        ] {
            let a = ReconcileArgs { status: StatusArgs { status_endpoints: vec![spec.into()], ..status() }, ..args() };
            let err = a.validate(&ttl()).unwrap_err();
            assert_eq!(err.len(), 1, "{spec}: {err:?}");
            assert!(err[0].starts_with(&format!("--status-endpoint {spec:?}")), "{err:?}");
            assert!(err[0].contains(says), "{spec}: {err:?}");
        }
    }

    #[test]
    fn endpoints_look_up_by_key_by_reference_or_both() {
        for url in [
            "http://h/v1/transfers/by-ref/{ref}",
            "http://h/v1/transfers/status?key={key}&ref={ref}",
            "http://h/v1/{key}/status?ref={ref}",
        ] {
            let a = ReconcileArgs {
                status: StatusArgs { status_endpoints: vec![format!("s={url}")], ..status() },
                ..args()
            };
            assert_eq!(a.validate(&ttl()).map(|e| e["s"].clone()), Ok(url.to_string()));
        }
    }

    #[test]
    fn a_scope_twice_is_refused() {
        let endpoints = vec!["s=http://a/{key}".into(), "s=http://b/{key}".into()];
        let a = ReconcileArgs { status: StatusArgs { status_endpoints: endpoints, ..status() }, ..args() };
        assert_eq!(a.validate(&ttl()).unwrap_err(), vec!["--status-endpoint: scope \"s\" is configured twice"]);
    }

    #[test]
    fn zeros_are_refused_each_by_name() {
        let a = ReconcileArgs {
            status: StatusArgs { status_timeout_ms: 0, ..status() },
            reconcile_interval_ms: 0,
            reconcile_retry_budget: 0,
            reconcile_batch: 0,
            reaper_interval_s: 0,
            reaper_batch: 0,
            ..args()
        };
        let err = a.validate(&ttl()).unwrap_err();
        assert_eq!(err.len(), 6, "{err:?}");
        assert!(err.iter().any(|e| e == "--reconcile-interval-ms must be greater than 0"));
        assert!(err.iter().any(|e| e == "--reaper-batch must be greater than 0"));
    }

    #[test]
    fn grace_longer_than_the_retention_is_refused() {
        let a =
            ReconcileArgs { status: StatusArgs { reconcile_grace_ms: 7 * 86_400 * 1000 + 1, ..status() }, ..args() };
        let err = a.validate(&ttl()).unwrap_err();
        assert!(err[0].starts_with("reconcile grace 604800001 ms must not exceed the terminal retention 604800 s"));
        let a = ReconcileArgs { status: StatusArgs { reconcile_grace_ms: 7 * 86_400 * 1000, ..status() }, ..args() };
        assert!(a.validate(&ttl()).is_ok());
    }

    #[test]
    fn instance_ids_are_printable() {
        assert!(ReconcileArgs { instance_id: Some("pod-7".into()), ..args() }.validate(&ttl()).is_ok());
        assert!(ReconcileArgs { instance_id: Some("a b".into()), ..args() }.validate(&ttl()).is_err());
        assert!(args().instance().ends_with(&format!("/{}", std::process::id())));
    }

    #[test]
    fn status_readings_are_checked_naming_the_scope() {
        let with = |readings: Vec<String>| ReconcileArgs {
            status: StatusArgs { status_readings: readings, ..status() },
            ..args()
        };
        let ok = with(vec!["payments.transfer=pointer=/state;done_status=201".into()]);
        assert!(ok.validate(&ttl()).is_ok());
        assert_eq!(ok.status.readings().unwrap()["payments.transfer"].done_status, 201);
        let bad = with(vec!["payments.transfer=done_status=2001".into(), "other=failed=X".into()]);
        let err = bad.validate(&ttl()).unwrap_err();
        assert!(err[0].starts_with("--status-reading \"payments.transfer=done_status=2001\": done_status:"), "{err:?}");
        assert!(bad.status.readings().is_err());
        let orphan = with(vec!["other=failed=X".into()]);
        assert_eq!(
            orphan.validate(&ttl()).unwrap_err(),
            vec!["--status-reading: scope \"other\" has a reading but no --status-endpoint to read"]
        );
    }
}
