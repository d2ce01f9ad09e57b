//! Classifying the upstream's answer to a confirm (DESIGN §4).
//!
//! The question is never "did it work" but "may it have happened": only an
//! answer that proves the request was never acted on may release the
//! operation for a retry; anything ambiguous stays IN_FLIGHT for the reconciler.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Executed: record DONE and replay it.
    Done,
    /// Definitely rejected: record FAILED and replay it.
    Failed,
    /// Provably not executed: release, a retry may run it.
    Release,
    /// May or may not have executed: leave IN_FLIGHT for the reconciler.
    Unknown,
}

impl Verdict {
    pub const ALL: [Verdict; 4] = [Verdict::Done, Verdict::Failed, Verdict::Release, Verdict::Unknown];

    /// The word for it in a route's `outcomes` annotation (and in logs): one spelling, read back by
    /// [`parse_overrides`].
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Done => "done",
            Verdict::Failed => "failed",
            Verdict::Release => "release",
            Verdict::Unknown => "unknown",
        }
    }
}

/// `code_details` is Envoy's `response.code_details` ("via_upstream" when the
/// upstream itself answered). It describes only the *last* attempt: when Envoy
/// retried (`attempts` > 1, from `x-envoy-attempt-count`), an earlier attempt
/// may have executed, so nothing can be released.
///
/// `overrides` are the route's own readings of upstream statuses (its
/// `outcomes` annotation): a service whose 409 means "definitely refused"
/// says `409:failed`. They apply only to answers that came from the upstream.
///
/// `keys_honoured`: the upstream deduplicates by `Idempotency-Key` (a route's
/// `upstream_keys`). Releasing on its "not done" (429, 503) is safe only then: the
/// retry carries the same key to an upstream that would not run it twice. An
/// upstream that ignores keys releases nothing it answered; only a request Envoy
/// never sent is provably not run.
pub fn classify(
    status: u16,
    code_details: Option<&str>,
    attempts: u32,
    overrides: &[(u16, Verdict)],
    keys_honoured: bool,
) -> Verdict {
    let via_upstream = code_details == Some("via_upstream");
    let from_route = if via_upstream { overrides.iter().find(|(s, _)| *s == status).map(|(_, o)| *o) } else { None };
    match from_route.unwrap_or_else(|| classify_attempt(status, code_details)) {
        Verdict::Release if attempts > 1 => Verdict::Unknown,
        Verdict::Release if via_upstream && !keys_honoured => Verdict::Unknown,
        outcome => outcome,
    }
}

fn classify_attempt(status: u16, code_details: Option<&str>) -> Verdict {
    match code_details {
        Some("via_upstream") => classify_upstream(status),
        Some(details) if never_sent(details) => Verdict::Release,
        // Timeouts and resets may come after the upstream acted on the request.
        _ => Verdict::Unknown,
    }
}

/// Parse a route's `outcomes` annotation: `"409:failed, 425:release"`.
/// Only non-2xx statuses may be re-read: a 2xx is always DONE.
pub fn parse_overrides(text: &str) -> Result<Vec<(u16, Verdict)>, String> {
    let mut out: Vec<(u16, Verdict)> = Vec::new();
    for item in text.split(|c: char| c == ',' || c.is_whitespace()).filter(|i| !i.is_empty()) {
        let (status, outcome) = item.split_once(':').ok_or_else(|| format!("{item:?} is not STATUS:OUTCOME"))?;
        let status: u16 = status.parse().map_err(|_| format!("{status:?} is not an HTTP status"))?;
        if !(300..=599).contains(&status) {
            return Err(format!("{status}: only statuses 300-599 can be re-read (2xx is always done)"));
        }
        let Some(outcome) = Verdict::ALL.into_iter().find(|v| v.as_str() == outcome) else {
            return Err(format!("{outcome:?} is not one of done, failed, release, unknown"));
        };
        if out.iter().any(|(s, _)| *s == status) {
            return Err(format!("{status} is listed twice"));
        }
        out.push((status, outcome));
    }
    Ok(out)
}

fn classify_upstream(status: u16) -> Verdict {
    match status {
        200..=299 => Verdict::Done,
        // The upstream refused before doing anything (rate limit, overload).
        429 | 503 => Verdict::Release,
        // Timeout, conflict and too-early say nothing definite about execution.
        408 | 409 | 425 => Verdict::Unknown,
        400..=499 => Verdict::Failed,
        _ => Verdict::Unknown,
    }
}

/// Envoy's details for failures that happen before any request byte reaches
/// an upstream.
fn never_sent(details: &str) -> bool {
    details.contains("connection_failure") || details == "no_healthy_upstream" || details == "cluster_not_found"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_upstream_that_ignores_keys_releases_nothing_it_answered() {
        let up = Some("via_upstream");
        for status in [429, 503] {
            assert_eq!(classify(status, up, 1, &[], false), Verdict::Unknown, "{status}");
        }
        // What it says it did, or refused, is as definite as ever.
        assert_eq!(classify(201, up, 1, &[], false), Verdict::Done);
        assert_eq!(classify(422, up, 1, &[], false), Verdict::Failed);
        // Envoy never sent it: nothing ran, whatever the upstream does with keys.
        let refused = Some("upstream_reset_before_response_started{connection_failure}");
        assert_eq!(classify(503, refused, 1, &[], false), Verdict::Release);
        assert_eq!(classify(503, Some("no_healthy_upstream"), 1, &[], false), Verdict::Release);
    }

    #[test]
    fn upstream_answers() {
        let up = Some("via_upstream");
        for (status, want) in [
            (200, Verdict::Done),
            (201, Verdict::Done),
            (204, Verdict::Done),
            (299, Verdict::Done),
            (400, Verdict::Failed),
            (402, Verdict::Failed),
            (404, Verdict::Failed),
            (422, Verdict::Failed),
            (499, Verdict::Failed),
            (408, Verdict::Unknown),
            (409, Verdict::Unknown),
            (425, Verdict::Unknown),
            (429, Verdict::Release),
            (503, Verdict::Release),
            (500, Verdict::Unknown),
            (502, Verdict::Unknown),
            (504, Verdict::Unknown),
            (100, Verdict::Unknown),
            (302, Verdict::Unknown),
            (0, Verdict::Unknown),
        ] {
            assert_eq!(classify(status, up, 1, &[], true), want, "{status}");
        }
    }

    #[test]
    fn envoy_generated_answers() {
        for (status, details, want) in [
            (503, Some("upstream_reset_before_response_started{connection_failure}"), Verdict::Release),
            (
                503,
                Some("upstream_reset_before_response_started{remote_connection_failure,delayed_connect_error:_111}"),
                Verdict::Release,
            ),
            (503, Some("no_healthy_upstream"), Verdict::Release),
            (503, Some("cluster_not_found"), Verdict::Release),
            (504, Some("upstream_response_timeout"), Verdict::Unknown),
            (503, Some("upstream_reset_before_response_started{remote_reset}"), Verdict::Unknown),
            (503, Some("upstream_reset_after_response_started{remote_reset}"), Verdict::Unknown),
            (200, Some("upstream_per_try_timeout"), Verdict::Unknown),
            (200, None, Verdict::Unknown),
            (503, None, Verdict::Unknown),
            (503, Some(""), Verdict::Unknown),
            (503, Some("no_healthy_upstream_x"), Verdict::Unknown),
        ] {
            assert_eq!(classify(status, details, 1, &[], true), want, "{status} {details:?}");
        }
    }

    #[test]
    fn a_retried_request_is_never_released() {
        assert_eq!(classify(503, Some("via_upstream"), 2, &[], true), Verdict::Unknown);
        assert_eq!(
            classify(503, Some("upstream_reset_before_response_started{connection_failure}"), 3, &[], true),
            Verdict::Unknown
        );
        assert_eq!(classify(201, Some("via_upstream"), 2, &[], true), Verdict::Done);
        assert_eq!(classify(422, Some("via_upstream"), 2, &[], true), Verdict::Failed);
    }

    #[test]
    fn routes_can_reread_upstream_statuses() -> Result<(), String> {
        let o = parse_overrides("409:failed, 425:release 500:failed")?;
        assert_eq!(classify(409, Some("via_upstream"), 1, &o, true), Verdict::Failed);
        assert_eq!(classify(425, Some("via_upstream"), 1, &o, true), Verdict::Release);
        assert_eq!(
            classify(425, Some("via_upstream"), 2, &o, true),
            Verdict::Unknown,
            "a retried confirm is never released"
        );
        assert_eq!(
            classify(408, Some("via_upstream"), 1, &o, true),
            Verdict::Unknown,
            "unlisted statuses keep the default"
        );
        // Envoy's own 500/503 is not the upstream's verdict.
        assert_eq!(classify(500, Some("upstream_response_timeout"), 1, &o, true), Verdict::Unknown);
        assert_eq!(parse_overrides("")?, vec![]);
        for bad in ["409", "201:failed", "409:maybe", "409:failed,409:done", "x:failed"] {
            assert!(parse_overrides(bad).is_err(), "{bad}");
        }
        Ok(())
    }

    /// Each verdict's documented word reads back as that verdict (the annotation's grammar is its words).
    #[test]
    fn every_verdict_is_read_by_its_word() -> Result<(), String> {
        let words = ["done", "failed", "release", "unknown"];
        assert_eq!(Verdict::ALL.map(Verdict::as_str), words);
        for (v, word) in Verdict::ALL.into_iter().zip(words) {
            assert_eq!(parse_overrides(&format!("409:{word}"))?, vec![(409, v)]);
        }
        Ok(())
    }
}
