//! Envoy stats for the filter (they appear in /stats as `wasmcustom.idem.*`).

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    Minted,
    Verified,
    RejectedMissing,
    RejectedInvalid,
    RejectedExpired,
    RejectedForbidden,
    RejectedParams,
    RejectedBody,
    RejectedSubject,
    Acquired,
    Replayed,
    InProgress,
    NeedsReview,
    Completed,
    Released,
    UnknownOutcome,
    SidecarErrors,
    SecurityEvents,
    StatusLookups,
}

const ALL: [(Counter, &str); 19] = [
    (Counter::Minted, "idem.minted"),
    (Counter::Verified, "idem.verified"),
    (Counter::RejectedMissing, "idem.rejected.fingerprint_missing"),
    (Counter::RejectedInvalid, "idem.rejected.fingerprint_invalid"),
    (Counter::RejectedExpired, "idem.rejected.fingerprint_expired"),
    (Counter::RejectedForbidden, "idem.rejected.forbidden"),
    (Counter::RejectedParams, "idem.rejected.params_changed"),
    (Counter::RejectedBody, "idem.rejected.bad_body"),
    (Counter::RejectedSubject, "idem.rejected.unauthenticated"),
    (Counter::Acquired, "idem.acquired"),
    (Counter::Replayed, "idem.replayed"),
    (Counter::InProgress, "idem.in_progress"),
    (Counter::NeedsReview, "idem.needs_review"),
    (Counter::Completed, "idem.completed"),
    (Counter::Released, "idem.released"),
    (Counter::UnknownOutcome, "idem.unknown_outcome"),
    (Counter::SidecarErrors, "idem.sidecar_errors"),
    (Counter::SecurityEvents, "idem.security_events"),
    (Counter::StatusLookups, "idem.status_lookups"),
];

/// Metric ids, defined once per VM.
#[derive(Debug, Default)]
pub struct Metrics {
    ids: Vec<(Counter, u32)>,
}

impl Metrics {
    pub fn define() -> Metrics {
        let ids = ALL
            .iter()
            .filter_map(|(c, name)| hostcalls::define_metric(MetricType::Counter, name).ok().map(|id| (*c, id)))
            .collect();
        Metrics { ids }
    }

    pub fn inc(&self, counter: Counter) {
        if let Some((_, id)) = self.ids.iter().find(|(c, _)| *c == counter) {
            let _ = hostcalls::increment_metric(*id, 1);
        }
    }
}
