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
pub fn classify(status: u16, code_details: Option<&str>, attempts: u32) -> Outcome {
    match classify_attempt(status, code_details) {
        Outcome::Release if attempts > 1 => Outcome::Unknown,
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
            assert_eq!(classify(status, up, 1), want, "{status}");
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
            assert_eq!(classify(status, details, 1), want, "{status} {details:?}");
        }
    }

    #[test]
    fn a_retried_request_is_never_released() {
        assert_eq!(classify(503, Some("via_upstream"), 2), Outcome::Unknown);
        assert_eq!(classify(503, Some("upstream_reset_before_response_started{connection_failure}"), 3), Outcome::Unknown);
        assert_eq!(classify(201, Some("via_upstream"), 2), Outcome::Done);
        assert_eq!(classify(422, Some("via_upstream"), 2), Outcome::Failed);
    }
}
