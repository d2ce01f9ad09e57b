//! Classifying the upstream's answer to a confirm (DESIGN §4).
//!
//! The question is never "did it work" but "may it have happened": only an
//! answer that proves the request was never acted on may release the
//! operation for a retry; anything ambiguous stays IN_FLIGHT for the reconciler.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Executed: record DONE and replay it.
    Done,
    /// Definitely rejected: record FAILED and replay it.
    Failed,
    /// Provably not executed: release, a retry may run it.
    Release,
    /// May or may not have executed: leave IN_FLIGHT for the reconciler.
    Unknown,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Done => "done",
            Outcome::Failed => "failed",
            Outcome::Release => "release",
            Outcome::Unknown => "unknown",
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
    overrides: &[(u16, Outcome)],
    keys_honoured: bool,
) -> Outcome {
    let via_upstream = code_details == Some("via_upstream");
    let from_route = match via_upstream {
        true => overrides.iter().find(|(s, _)| *s == status).map(|(_, o)| *o),
        false => None,
    };
    match from_route.unwrap_or_else(|| classify_attempt(status, code_details)) {
        Outcome::Release if attempts > 1 => Outcome::Unknown,
        Outcome::Release if via_upstream && !keys_honoured => Outcome::Unknown,
        outcome => outcome,
    }
}

fn classify_attempt(status: u16, code_details: Option<&str>) -> Outcome {
    match code_details {
        Some("via_upstream") => classify_upstream(status),
        Some(details) if never_sent(details) => Outcome::Release,
        // Timeouts and resets may come after the upstream acted on the request.
        _ => Outcome::Unknown,
    }
}

/// Parse a route's `outcomes` annotation: `"409:failed, 425:release"`.
/// Only non-2xx statuses may be re-read: a 2xx is always DONE.
pub fn parse_overrides(text: &str) -> Result<Vec<(u16, Outcome)>, String> {
    let mut out: Vec<(u16, Outcome)> = Vec::new();
    for item in text.split(|c: char| c == ',' || c.is_whitespace()).filter(|i| !i.is_empty()) {
        let (status, outcome) = item.split_once(':').ok_or_else(|| format!("{item:?} is not STATUS:OUTCOME"))?;
        let status: u16 = status.parse().map_err(|_| format!("{status:?} is not an HTTP status"))?;
        if !(300..=599).contains(&status) {
            return Err(format!("{status}: only statuses 300-599 can be re-read (2xx is always done)"));
        }
        let outcome = match outcome {
            "done" => Outcome::Done,
            "failed" => Outcome::Failed,
            "release" => Outcome::Release,
            "unknown" => Outcome::Unknown,
            other => return Err(format!("{other:?} is not one of done, failed, release, unknown")),
        };
        if out.iter().any(|(s, _)| *s == status) {
            return Err(format!("{status} is listed twice"));
        }
        out.push((status, outcome));
    }
    Ok(out)
}

fn classify_upstream(status: u16) -> Outcome {
    match status {
        200..=299 => Outcome::Done,
        // The upstream refused before doing anything (rate limit, overload).
        429 | 503 => Outcome::Release,
        // Timeout, conflict and too-early say nothing definite about execution.
        408 | 409 | 425 => Outcome::Unknown,
        400..=499 => Outcome::Failed,
        _ => Outcome::Unknown,
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
            assert_eq!(classify(status, up, 1, &[], false), Outcome::Unknown, "{status}");
        }
        // What it says it did, or refused, is as definite as ever.
        assert_eq!(classify(201, up, 1, &[], false), Outcome::Done);
        assert_eq!(classify(422, up, 1, &[], false), Outcome::Failed);
        // Envoy never sent it: nothing ran, whatever the upstream does with keys.
        let refused = Some("upstream_reset_before_response_started{connection_failure}");
        assert_eq!(classify(503, refused, 1, &[], false), Outcome::Release);
        assert_eq!(classify(503, Some("no_healthy_upstream"), 1, &[], false), Outcome::Release);
    }

    #[test]
    fn upstream_answers() {
        let up = Some("via_upstream");
        for (status, want) in [
            (200, Outcome::Done),
            (201, Outcome::Done),
            (204, Outcome::Done),
            (299, Outcome::Done),
            (400, Outcome::Failed),
            (402, Outcome::Failed),
            (404, Outcome::Failed),
            (422, Outcome::Failed),
            (499, Outcome::Failed),
            (408, Outcome::Unknown),
            (409, Outcome::Unknown),
            (425, Outcome::Unknown),
            (429, Outcome::Release),
            (503, Outcome::Release),
            (500, Outcome::Unknown),
            (502, Outcome::Unknown),
            (504, Outcome::Unknown),
            (100, Outcome::Unknown),
            (302, Outcome::Unknown),
            (0, Outcome::Unknown),
        ] {
            assert_eq!(classify(status, up, 1, &[], true), want, "{status}");
        }
    }

    #[test]
    fn envoy_generated_answers() {
        for (status, details, want) in [
            (503, Some("upstream_reset_before_response_started{connection_failure}"), Outcome::Release),
            (
                503,
                Some("upstream_reset_before_response_started{remote_connection_failure,delayed_connect_error:_111}"),
                Outcome::Release,
            ),
            (503, Some("no_healthy_upstream"), Outcome::Release),
            (503, Some("cluster_not_found"), Outcome::Release),
            (504, Some("upstream_response_timeout"), Outcome::Unknown),
            (503, Some("upstream_reset_before_response_started{remote_reset}"), Outcome::Unknown),
            (503, Some("upstream_reset_after_response_started{remote_reset}"), Outcome::Unknown),
            (200, Some("upstream_per_try_timeout"), Outcome::Unknown),
            (200, None, Outcome::Unknown),
            (503, None, Outcome::Unknown),
            (503, Some(""), Outcome::Unknown),
            (503, Some("no_healthy_upstream_x"), Outcome::Unknown),
        ] {
            assert_eq!(classify(status, details, 1, &[], true), want, "{status} {details:?}");
        }
    }

    #[test]
    fn a_retried_request_is_never_released() {
        assert_eq!(classify(503, Some("via_upstream"), 2, &[], true), Outcome::Unknown);
        assert_eq!(
            classify(503, Some("upstream_reset_before_response_started{connection_failure}"), 3, &[], true),
            Outcome::Unknown
        );
        assert_eq!(classify(201, Some("via_upstream"), 2, &[], true), Outcome::Done);
        assert_eq!(classify(422, Some("via_upstream"), 2, &[], true), Outcome::Failed);
    }

    #[test]
    fn routes_can_reread_upstream_statuses() -> Result<(), String> {
        let o = parse_overrides("409:failed, 425:release 500:failed")?;
        assert_eq!(classify(409, Some("via_upstream"), 1, &o, true), Outcome::Failed);
        assert_eq!(classify(425, Some("via_upstream"), 1, &o, true), Outcome::Release);
        assert_eq!(
            classify(425, Some("via_upstream"), 2, &o, true),
            Outcome::Unknown,
            "a retried confirm is never released"
        );
        assert_eq!(
            classify(408, Some("via_upstream"), 1, &o, true),
            Outcome::Unknown,
            "unlisted statuses keep the default"
        );
        // Envoy's own 500/503 is not the upstream's verdict.
        assert_eq!(classify(500, Some("upstream_response_timeout"), 1, &o, true), Outcome::Unknown);
        assert_eq!(parse_overrides("")?, vec![]);
        for bad in ["409", "201:failed", "409:maybe", "409:failed,409:done", "x:failed"] {
            assert!(parse_overrides(bad).is_err(), "{bad}");
        }
        Ok(())
    }
}
