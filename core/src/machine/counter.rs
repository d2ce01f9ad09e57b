//! The filter's Envoy counters (`wasmcustom.idem.*` in the `.wasm`, `idem.*` elsewhere): one row per
//! counter, so a counter cannot be declared without its name or left out of [`Counter::ALL`] (whose counts a
//! host registers up front: one missing there would vanish silently).

macro_rules! counters {
    ($($(#[$doc:meta])* $variant:ident => $name:literal,)+) => {
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum Counter {
            $($(#[$doc])* $variant,)+
        }

        impl Counter {
            pub const ALL: &'static [Counter] = &[$(Counter::$variant),+];

            pub fn name(self) -> &'static str {
                match self {
                    $(Counter::$variant => $name,)+
                }
            }
        }
    };
}

counters! {
    Minted => "idem.minted",
    Verified => "idem.verified",
    RejectedMissing => "idem.rejected.fingerprint_missing",
    RejectedInvalid => "idem.rejected.fingerprint_invalid",
    RejectedExpired => "idem.rejected.fingerprint_expired",
    RejectedForbidden => "idem.rejected.forbidden",
    RejectedParams => "idem.rejected.params_changed",
    RejectedBody => "idem.rejected.bad_body",
    RejectedSubject => "idem.rejected.unauthenticated",
    Acquired => "idem.acquired",
    Replayed => "idem.replayed",
    InProgress => "idem.in_progress",
    NeedsReview => "idem.needs_review",
    Completed => "idem.completed",
    Released => "idem.released",
    UnknownOutcome => "idem.unknown_outcome",
    SidecarErrors => "idem.sidecar_errors",
    SecurityEvents => "idem.security_events",
    StatusLookups => "idem.status_lookups",
    ExpiredLookups => "idem.expired_lookups",
    ClientKeyRequests => "idem.client_key_requests",
    ReplayCacheHits => "idem.replay_cache_hits",
    RejectedHeader => "idem.rejected.invalid_header",
    SecurityParamsChanged => "idem.security.params_changed",
    SecurityCrossSubject => "idem.security.cross_subject",
    SecurityBadSignature => "idem.security.bad_signature",
    SecurityUnknownKid => "idem.security.unknown_kid",
    LeaseRenewals => "idem.lease_renewals",
    LeasesLost => "idem.leases_lost",
    /// A guarded route whose annotation does not parse: every call refused (503), none forwarded.
    RejectedMisconfigured => "idem.rejected.misconfigured_route",
    /// A confirm recorded for a person's approval (or still waiting): nothing forwarded.
    ApprovalRequired => "idem.approval_required",
    /// A confirm of an operation a person refused.
    ApprovalRejected => "idem.approval_rejected",
    /// A confirm or lookup of an approval nobody gave before `exp`.
    ApprovalLapsed => "idem.approval_lapsed",
}

#[cfg(test)]
mod tests {
    use super::Counter;

    #[test]
    fn every_counter_has_its_own_name() {
        let mut names: Vec<&str> = Counter::ALL.iter().map(|c| c.name()).collect();
        assert!(names.iter().all(|n| n.starts_with("idem.")), "{names:?}");
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Counter::ALL.len(), "two counters share a name");
    }
}
