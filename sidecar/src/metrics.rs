//! Prometheus metrics, served on `GET /metrics`.
//!
//! Every outcome is counted, not only errors: a rising IN_FLIGHT or
//! PARAM_MISMATCH share is what an operator alerts on, and the fallback
//! counter plus the two `_up` gauges say which store is carrying the load.
//! `idem_needs_review_backlog` is the backlog a person has to work through: alert
//! when it is not zero. `idem_security_events_total{kind}` counts tampering,
//! another subject's fingerprints and forgeries: alert when it rises.
//! `idem_in_flight_overdue_seconds` says how long ago the lease of the
//! longest-expired IN_FLIGHT row ended: a reconciler that keeps up holds it
//! near zero (deploy/observability/alerts.yaml has the rules).
//!
//! `idem_sql_replication_info{mode}` says what the SQL truth promises across a
//! failover (single, sync, async, standby, unknown; 1 on the current mode, 0 on
//! the others), read at start and by every store probe, with
//! `idem_sql_standbys`/`idem_sql_sync_standbys` beside it;
//! `idem_replication_refused_total{mode}` counts the acquires that topology
//! could not keep and idemd refused, and `idem_async_failover_risk_accepted` is
//! 1 when the operator accepted that risk instead.
//!
//! Label sets an alert compares over time (security kinds, reconciler
//! decisions, each scope's lookups) exist at 0 from the start: a series that
//! appears at its first increment is invisible to `increase()`.

use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use idem_core::protocol::SecurityKind;

/// What a status lookup can come to (`idem_reconcile_lookups_total{result}`).
pub const LOOKUP_RESULTS: [&str; 3] = ["found", "not_found", "failed"];

/// Every `decision` label of `idem_reconcile_total` (the reconciler's `Decision::metric`), so
/// each series exists before its first decision.
/// Every `event` label of `idem_approvals_total` (DESIGN §4, "Approval").
pub const APPROVAL_EVENTS: [&str; 4] = ["awaiting", "approved", "rejected", "lapsed"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    event: &'static str,
}

/// A filter counter of the ext_proc host, by its name on the filter hosts' Envoy
/// (`idem.rejected.params_changed` is `rejected_params_changed`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FilterEventLabels {
    event: String,
}

pub const RECONCILE_DECISIONS: [&str; 6] = ["done", "failed", "released", "needs_review", "retry", "skipped_grace"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

/// Acquires by outcome and by how the caller named the operation
/// (`fingerprint` or `client_key`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AcquireLabels {
    outcome: &'static str,
    mode: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    decision: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModeLabels {
    mode: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

/// A reconciler's status lookup: the scope's endpoint and what it answered.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LookupLabels {
    scope: String,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StoreOpLabels {
    store: &'static str,
    op: &'static str,
}

type LatencyFamily = Family<StoreOpLabels, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 50 µs .. ~1.6 s: a Redis EVAL on loopback sits at the bottom, an fsync'd
    // SQL commit in the middle, a timeout at the top.
    Histogram::new(exponential_buckets(0.000_05, 2.0, 16))
}

pub struct Metrics {
    registry: Registry,
    acquire: Family<AcquireLabels, Counter>,
    complete: Family<OutcomeLabels, Counter>,
    release: Family<OutcomeLabels, Counter>,
    lease_renewals: Family<OutcomeLabels, Counter>,
    latency: LatencyFamily,
    redis_fallback: Counter,
    redis_refill: Family<StateLabels, Counter>,
    redis_up: Gauge,
    sql_up: Gauge,
    redis_configured: Gauge,
    reconcile: Family<DecisionLabels, Counter>,
    lookups: Family<LookupLabels, Counter>,
    needs_review: Gauge,
    in_flight: Gauge,
    in_flight_overdue: Gauge,
    reaped: Counter,
    auth_rejected: Counter,
    security_events: Family<KindLabels, Counter>,
    security_events_unrecorded: Counter,
    approvals: Family<EventLabels, Counter>,
    approval_wait: Histogram,
    approvals_awaiting: Gauge,
    replication_info: Family<ModeLabels, Gauge>,
    sql_standbys: Gauge,
    sql_sync_standbys: Gauge,
    replication_refused: Family<ModeLabels, Counter>,
    async_risk_accepted: Gauge,
    /// The ext_proc host's filter counters, copied from its own (`idem_extproc::Counters`) at each scrape.
    filter_events: Family<FilterEventLabels, Counter>,
    ext_proc: std::sync::OnceLock<std::sync::Arc<idem_extproc::Counters>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let acquire = Family::<AcquireLabels, Counter>::default();
        let complete = Family::<OutcomeLabels, Counter>::default();
        let release = Family::<OutcomeLabels, Counter>::default();
        let lease_renewals = Family::<OutcomeLabels, Counter>::default();
        let latency = LatencyFamily::new_with_constructor(latency_histogram as fn() -> Histogram);
        let redis_fallback = Counter::default();
        let redis_refill = Family::<StateLabels, Counter>::default();
        let redis_up = Gauge::default();
        let sql_up = Gauge::default();
        let redis_configured = Gauge::default();
        let reconcile = Family::<DecisionLabels, Counter>::default();
        let lookups = Family::<LookupLabels, Counter>::default();
        let needs_review = Gauge::default();
        let in_flight = Gauge::default();
        let in_flight_overdue = Gauge::default();
        let reaped = Counter::default();
        let auth_rejected = Counter::default();
        let security_events = Family::<KindLabels, Counter>::default();
        let security_events_unrecorded = Counter::default();
        let approvals = Family::<EventLabels, Counter>::default();
        // 1 s .. ~9 h: a person answers in seconds to hours.
        let approval_wait = Histogram::new(exponential_buckets(1.0, 2.0, 16));
        let approvals_awaiting = Gauge::default();
        let replication_info = Family::<ModeLabels, Gauge>::default();
        let sql_standbys = Gauge::default();
        let sql_sync_standbys = Gauge::default();
        let replication_refused = Family::<ModeLabels, Counter>::default();
        let async_risk_accepted = Gauge::default();
        let filter_events = Family::<FilterEventLabels, Counter>::default();

        // Counters get their `_total` suffix from the OpenMetrics encoder.
        registry.register("idem_acquire", "Acquire answers by outcome and key mode", acquire.clone());
        registry.register("idem_complete", "Complete answers by outcome", complete.clone());
        registry.register("idem_release", "Release answers by outcome", release.clone());
        registry.register(
            "idem_lease_renewals",
            "Leases of requests still upstream, renewed by the filter that forwarded them (renewed, lost: no longer the owner's)",
            lease_renewals.clone(),
        );
        registry.register(
            "idem_store_latency_seconds",
            "Latency of each store call, by store and operation",
            latency.clone(),
        );
        registry.register(
            "idem_redis_fallback",
            "Calls served by SQL alone because Redis was unreachable or erroring",
            redis_fallback.clone(),
        );
        registry.register(
            "idem_redis_refill",
            "Acquires Redis had no copy for (flushed, failed over, evicted or expired) while SQL had the row: answered \
             from the row, which is copied back to Redis; by the row's state",
            redis_refill.clone(),
        );
        registry.register(
            "idem_redis_up",
            "1 while the Redis fast path answers, 0 while degraded to SQL alone (or Redis is off)",
            redis_up.clone(),
        );
        registry.register(
            "idem_sql_up",
            "1 while the SQL truth answers (the last call, or the store probe every --probe-interval-ms)",
            sql_up.clone(),
        );
        registry.register(
            "idem_redis_configured",
            "1 when this idemd runs with Redis (--redis-url), 0 when it runs on SQL alone by choice",
            redis_configured.clone(),
        );
        registry.register(
            "idem_reconcile",
            "Reconciler decisions on expired IN_FLIGHT rows (done, failed, released, needs_review, retry, skipped_grace)",
            reconcile.clone(),
        );
        registry.register(
            "idem_reconcile_lookups",
            "Reconciler status lookups by scope and result (found, not_found, failed: no answer, an error status, \
             an unreadable answer)",
            lookups.clone(),
        );
        registry.register(
            "idem_needs_review_backlog",
            "Operations waiting for a person (NEEDS_REVIEW rows), as of the last store probe or reconciler pass",
            needs_review.clone(),
        );
        registry.register(
            "idem_in_flight",
            "IN_FLIGHT rows (executing, or waiting for the reconciler), as of the last store probe",
            in_flight.clone(),
        );
        registry.register(
            "idem_in_flight_overdue_seconds",
            "How long ago the lease of the longest-expired IN_FLIGHT row ended (0 when no lease has run out), as of \
             the last store probe: the reconciler's lag",
            in_flight_overdue.clone(),
        );
        registry.register("idem_reaped", "Terminal rows deleted after the retention", reaped.clone());
        registry.register(
            "idem_auth_rejected",
            "API calls refused for a missing or wrong credential (nothing was read or changed)",
            auth_rejected.clone(),
        );
        registry.register(
            "idem_security_events",
            "Security events by kind (params_changed, cross_subject, bad_signature, unknown_kid): reported by the \
             filter, or an acquire idemd answered PARAM_MISMATCH. Alert when it rises",
            security_events.clone(),
        );
        registry.register(
            "idem_security_events_unrecorded",
            "Security events counted but not written to the audit trail (SQL down or slow, or too many at once)",
            security_events_unrecorded.clone(),
        );

        registry.register(
            "idem_approvals",
            "Approval events (awaiting: a confirm recorded for a person; approved, rejected: a decision; lapsed: \
             nobody decided before the fingerprint's exp)",
            approvals.clone(),
        );
        registry.register(
            "idem_approval_decision_seconds",
            "Time from a confirm recorded for approval to a person's decision",
            approval_wait.clone(),
        );
        registry.register(
            "idem_approvals_awaiting",
            "Operations waiting for a person's approval (AWAITING_APPROVAL, not past exp), as of the last store probe",
            approvals_awaiting.clone(),
        );
        registry.register(
            "idem_sql_replication_info",
            "What the SQL truth promises across a failover, as read at start and by the store probe: 1 on the \
             current mode (single, sync: an acquire survives; async, unknown: a failover can lose it, so acquires \
             for upstreams that ignore keys are refused; standby: read-only, every acquire refused), 0 on the others",
            replication_info.clone(),
        );
        registry.register(
            "idem_sql_standbys",
            "Standbys (replicas) streaming from the SQL database, as of the last store probe",
            sql_standbys.clone(),
        );
        registry.register(
            "idem_sql_sync_standbys",
            "Of those, the standbys a commit waits for (synchronous, quorum, semi-synchronous)",
            sql_sync_standbys.clone(),
        );
        registry.register(
            "idem_replication_refused",
            "Acquires refused before anything ran because the SQL topology could not keep them through a \
             failover (standby; async or unknown for an upstream that ignores keys), by mode",
            replication_refused.clone(),
        );
        registry.register(
            "idem_async_failover_risk_accepted",
            "1 when idemd runs with --accept-async-failover-risk: on an asynchronous topology it acquires for \
             upstreams that ignore keys too, and a failover may run such an operation twice",
            async_risk_accepted.clone(),
        );
        registry.register(
            "idem_ext_proc_filter_events",
            "What the ext_proc host's filter did (idemd serve --ext-proc), by event: the counters the .wasm and the \
             native module keep in Envoy's stats (idem.<event>), under one name; alerts.yaml's idem:filter_events_total \
             adds them to the filters'",
            filter_events.clone(),
        );
        for event in APPROVAL_EVENTS {
            drop(approvals.get_or_create(&EventLabels { event }));
        }
        for kind in SecurityKind::ALL {
            drop(security_events.get_or_create(&KindLabels { kind: kind.as_str() }));
        }
        for decision in RECONCILE_DECISIONS {
            drop(reconcile.get_or_create(&DecisionLabels { decision }));
        }

        Self {
            registry,
            acquire,
            complete,
            release,
            lease_renewals,
            latency,
            redis_fallback,
            redis_refill,
            redis_up,
            sql_up,
            redis_configured,
            reconcile,
            lookups,
            needs_review,
            in_flight,
            in_flight_overdue,
            reaped,
            auth_rejected,
            security_events,
            security_events_unrecorded,
            approvals,
            approval_wait,
            approvals_awaiting,
            replication_info,
            sql_standbys,
            sql_sync_standbys,
            replication_refused,
            async_risk_accepted,
            filter_events,
            ext_proc: std::sync::OnceLock::new(),
        }
    }

    /// The ext_proc host's counters, exported from now on as `idem_ext_proc_filter_events_total`.
    pub fn ext_proc_counters(&self, counters: std::sync::Arc<idem_extproc::Counters>) {
        let _ = self.ext_proc.set(counters);
    }

    /// The replication state just read: `current` at 1, every other mode of `modes` at 0 (so each series
    /// exists from the start), and the standbys seen.
    pub fn set_replication(&self, current: &'static str, modes: &[&'static str], standbys: i64, sync_standbys: i64) {
        for &mode in modes {
            self.replication_info.get_or_create(&ModeLabels { mode }).set(i64::from(mode == current));
        }
        self.sql_standbys.set(standbys);
        self.sql_sync_standbys.set(sync_standbys);
    }

    /// The modes whose refusals `idem_replication_refused_total` counts, at 0 before the first.
    pub fn replication_refusable(&self, modes: &[&'static str]) {
        for &mode in modes {
            drop(self.replication_refused.get_or_create(&ModeLabels { mode }));
        }
    }

    pub fn replication_refused(&self, mode: &'static str) {
        self.replication_refused.get_or_create(&ModeLabels { mode }).inc();
    }

    pub fn set_async_failover_risk_accepted(&self, accepted: bool) {
        self.async_risk_accepted.set(i64::from(accepted));
    }

    pub fn approval(&self, event: &'static str) {
        self.approvals.get_or_create(&EventLabels { event }).inc();
    }

    /// A decision `waited_ms` after the confirm was recorded.
    pub fn approval_decided(&self, waited_ms: u64) {
        self.approval_wait.observe(waited_ms as f64 / 1000.0);
    }

    pub fn set_approvals_awaiting(&self, n: i64) {
        self.approvals_awaiting.set(n);
    }

    pub fn security_event(&self, kind: &'static str) {
        self.security_events.get_or_create(&KindLabels { kind }).inc();
    }

    pub fn security_event_unrecorded(&self) {
        self.security_events_unrecorded.inc();
    }

    pub fn auth_rejected(&self) {
        self.auth_rejected.inc();
    }

    pub fn acquire(&self, outcome: &'static str, mode: &'static str) {
        self.acquire.get_or_create(&AcquireLabels { outcome, mode }).inc();
    }

    pub fn complete(&self, outcome: &'static str) {
        self.complete.get_or_create(&OutcomeLabels { outcome }).inc();
    }

    pub fn release(&self, outcome: &'static str) {
        self.release.get_or_create(&OutcomeLabels { outcome }).inc();
    }

    pub fn lease_renewal(&self, outcome: &'static str) {
        self.lease_renewals.get_or_create(&OutcomeLabels { outcome }).inc();
    }

    pub fn observe(&self, store: &'static str, op: &'static str, started: Instant) {
        self.latency.get_or_create(&StoreOpLabels { store, op }).observe(started.elapsed().as_secs_f64());
    }

    pub fn redis_fallback(&self) {
        self.redis_fallback.inc();
    }

    /// An acquire found the key gone from Redis but the row in SQL: the row answered.
    pub fn redis_refill(&self, state: &'static str) {
        self.redis_refill.get_or_create(&StateLabels { state }).inc();
    }

    pub fn set_redis_up(&self, up: bool) {
        self.redis_up.set(i64::from(up));
    }

    pub fn set_sql_up(&self, up: bool) {
        self.sql_up.set(i64::from(up));
    }

    pub fn reconciled(&self, decision: &'static str) {
        self.reconcile.get_or_create(&DecisionLabels { decision }).inc();
    }

    pub fn set_redis_configured(&self, configured: bool) {
        self.redis_configured.set(i64::from(configured));
    }

    /// Every result of `scope`'s lookups at 0, so the first failure is an increase.
    pub fn lookup_scope(&self, scope: &str) {
        for result in LOOKUP_RESULTS {
            drop(self.lookups.get_or_create(&LookupLabels { scope: scope.to_string(), result }));
        }
    }

    pub fn lookup(&self, scope: &str, result: &'static str) {
        self.lookups.get_or_create(&LookupLabels { scope: scope.to_string(), result }).inc();
    }

    pub fn set_needs_review(&self, backlog: i64) {
        self.needs_review.set(backlog);
    }

    pub fn set_in_flight(&self, rows: i64, overdue_s: i64) {
        self.in_flight.set(rows);
        self.in_flight_overdue.set(overdue_s);
    }

    pub fn reaped(&self, rows: u64) {
        self.reaped.inc_by(rows);
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        if let Some(counters) = self.ext_proc.get() {
            // Both only grow: add what the host counted since the last scrape.
            for (counter, value) in counters.values() {
                let event = counter.name().trim_start_matches("idem.").replace('.', "_");
                let series = self.filter_events.get_or_create(&FilterEventLabels { event });
                series.inc_by(value.saturating_sub(series.get()));
            }
        }
        let mut out = String::new();
        // Writing into a String cannot fail; an empty answer is still valid.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
