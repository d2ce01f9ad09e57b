//! What to do with one expired IN_FLIGHT row, given what its upstream's
//! status-by-key endpoint said. Pure: no I/O, no clock.

use idem_core::protocol::{encode_body, StoredResult};

use crate::store::sql::Record;

/// What the status endpoint said about one key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// 200: the upstream has a record of this key.
    Found { content_type: Option<String>, body: Vec<u8> },
    /// 404: the upstream has no record of this key.
    NotFound,
    /// Anything else (another status, a timeout, a refused connection, a
    /// body too large): no evidence either way.
    Failed(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// It executed: replay this.
    Done(StoredResult),
    /// It executed and the upstream says it failed: replay this as a failure.
    Failed(StoredResult),
    /// It provably never executed: forget the row; a confirm may run it.
    Release,
    /// Nobody can tell: a person decides.
    NeedsReview,
    /// No evidence this time: ask again next pass (one attempt used).
    Retry,
    /// 404, but the lease ended too recently to be sure: ask again later.
    SkipGrace,
}

impl Decision {
    /// The `decision` label of `idem_reconcile_total`.
    pub fn metric(&self) -> &'static str {
        match self {
            Self::Done(_) => "done",
            Self::Failed(_) => "failed",
            Self::Release => "released",
            Self::NeedsReview => "needs_review",
            Self::Retry => "retry",
            Self::SkipGrace => "skipped_grace",
        }
    }

    /// The audit trail's action (none for SkipGrace: nothing changed).
    pub fn action(&self) -> &'static str {
        match self {
            Self::Done(_) => "reconcile_done",
            Self::Failed(_) => "reconcile_failed",
            Self::Release => "reconcile_release",
            Self::NeedsReview => "reconcile_needs_review",
            Self::Retry => "reconcile_retry",
            Self::SkipGrace => "reconcile_wait",
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Rules {
    /// A 404 proves "never executed" only this long after the lease ended.
    pub grace_ms: u64,
    /// Failed lookups before NEEDS_REVIEW.
    pub retry_budget: u32,
}

/// The decision and the evidence for the audit trail. `lookup` is `None`
/// when the row's scope has no status endpoint.
pub fn decide(rec: &Record, lookup: Option<&Lookup>, now_ms: i64, rules: Rules) -> (Decision, String) {
    let Some(lookup) = lookup else {
        return (Decision::NeedsReview, format!("no status endpoint is configured for scope {}", rec.scope));
    };
    match lookup {
        Lookup::Found { content_type, body } => {
            let result = StoredResult {
                status: 200,
                headers: content_type.iter().map(|c| ("content-type".to_string(), c.clone())).collect(),
                body_b64: encode_body(body),
            };
            if says_failed(body) {
                (Decision::Failed(result), "status endpoint answered 200 with status \"failed\"".to_string())
            } else {
                (Decision::Done(result), "status endpoint answered 200: the upstream executed it".to_string())
            }
        }
        Lookup::NotFound => {
            let lease_end = rec.lease_until_ms.unwrap_or(rec.updated_at_ms);
            let since = now_ms.saturating_sub(lease_end);
            if since >= i64::try_from(rules.grace_ms).unwrap_or(i64::MAX) {
                (
                    Decision::Release,
                    format!(
                        "status endpoint answered 404 {since} ms after the lease ended (grace {} ms): never executed",
                        rules.grace_ms
                    ),
                )
            } else {
                (
                    Decision::SkipGrace,
                    format!(
                        "status endpoint answered 404 only {since} ms after the lease ended (grace {} ms)",
                        rules.grace_ms
                    ),
                )
            }
        }
        Lookup::Failed(what) => {
            let attempt = rec.reconcile_attempts.saturating_add(1);
            if attempt >= i64::from(rules.retry_budget) {
                (
                    Decision::NeedsReview,
                    format!("status lookup failed {attempt} times (budget {}); last: {what}", rules.retry_budget),
                )
            } else {
                (Decision::Retry, format!("status lookup failed (attempt {attempt} of {}): {what}", rules.retry_budget))
            }
        }
    }
}

/// The upstream's own word that the operation failed: a top-level
/// `"status": "failed"` in its record.
fn says_failed(body: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("status").and_then(|s| s.as_str().map(|s| s == "failed")))
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::protocol::{decode_body, OpState};

    fn rec(lease_until_ms: i64, attempts: i64) -> Record {
        Record {
            key: "0123456789abcdef0123456789abcdef".into(),
            state: OpState::InFlight,
            param_hash: "p".into(),
            subject_hash: "u".into(),
            scope: "payments.transfer".into(),
            owner: Some("o".into()),
            result: None,
            lease_until_ms: Some(lease_until_ms),
            created_at_ms: 0,
            updated_at_ms: 0,
            reconcile_attempts: attempts,
        }
    }

    const RULES: Rules = Rules { grace_ms: 1_000, retry_budget: 3 };

    #[test]
    fn found_is_done_with_the_record_as_the_result() {
        let body = br#"{"transfer_id":"t_1","status":"executed"}"#.to_vec();
        let l = Lookup::Found { content_type: Some("application/json".into()), body: body.clone() };
        let (d, why) = decide(&rec(0, 0), Some(&l), 10, RULES);
        let Decision::Done(r) = d else { panic!("{d:?}") };
        assert_eq!(r.status, 200);
        assert_eq!(r.headers, vec![("content-type".to_string(), "application/json".to_string())]);
        assert_eq!(decode_body(&r.body_b64), Some(body));
        assert!(why.contains("200"));
    }

    #[test]
    fn found_with_status_failed_is_failed() {
        let l = Lookup::Found { content_type: None, body: br#"{"status":"failed","error":"x"}"#.to_vec() };
        assert_eq!(decide(&rec(0, 0), Some(&l), 10, RULES).0.metric(), "failed");
        // Only the top level counts, and only the exact word.
        let l =
            Lookup::Found { content_type: None, body: br#"{"inner":{"status":"failed"},"status":"FAILED"}"#.to_vec() };
        assert_eq!(decide(&rec(0, 0), Some(&l), 10, RULES).0.metric(), "done");
        let l = Lookup::Found { content_type: None, body: b"not json".to_vec() };
        assert_eq!(decide(&rec(0, 0), Some(&l), 10, RULES).0.metric(), "done");
    }

    #[test]
    fn not_found_releases_only_after_the_grace() {
        let r = rec(5_000, 0);
        assert_eq!(decide(&r, Some(&Lookup::NotFound), 5_999, RULES).0, Decision::SkipGrace);
        let (d, why) = decide(&r, Some(&Lookup::NotFound), 6_000, RULES);
        assert_eq!(d, Decision::Release);
        assert!(why.contains("404 1000 ms after the lease ended"), "{why}");
    }

    #[test]
    fn failures_retry_until_the_budget_then_need_review() {
        let l = Lookup::Failed("answered 500".into());
        let (d, why) = decide(&rec(0, 0), Some(&l), 10, RULES);
        assert_eq!(d, Decision::Retry);
        assert_eq!(why, "status lookup failed (attempt 1 of 3): answered 500");
        assert_eq!(decide(&rec(0, 1), Some(&l), 10, RULES).0, Decision::Retry);
        let (d, why) = decide(&rec(0, 2), Some(&l), 10, RULES);
        assert_eq!(d, Decision::NeedsReview);
        assert_eq!(why, "status lookup failed 3 times (budget 3); last: answered 500");
    }

    #[test]
    fn no_endpoint_needs_review_at_once() {
        let (d, why) = decide(&rec(0, 0), None, 10, RULES);
        assert_eq!(d, Decision::NeedsReview);
        assert_eq!(why, "no status endpoint is configured for scope payments.transfer");
    }
}
