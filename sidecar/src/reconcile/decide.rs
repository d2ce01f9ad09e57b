//! What to do with one expired IN_FLIGHT row, given what its upstream's
//! status endpoint said (asked by key or by business reference, `target`).
//! Pure: no I/O, no clock.

use idem_core::protocol::{encode_body, StoredResult};

pub use crate::evidence::{Asked, StatusAnswer};

use super::target::{By, NO_REF_LOOKUP};
use crate::store::record::Record;

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

    /// The audit trail's action; none for SkipGrace: waiting out the grace changes nothing.
    pub fn action(&self) -> Option<&'static str> {
        match self {
            Self::Done(_) => Some("reconcile_done"),
            Self::Failed(_) => Some("reconcile_failed"),
            Self::Release => Some("reconcile_release"),
            Self::NeedsReview => Some("reconcile_needs_review"),
            Self::Retry => Some("reconcile_retry"),
            Self::SkipGrace => None,
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct Rules {
    /// A 404 proves "never executed" only this long after the lease ended.
    pub grace_ms: u64,
    /// Failed lookups before NEEDS_REVIEW.
    pub retry_budget: u32,
    /// How each scope's status record reads; scopes not listed read [`Reading::default`].
    pub readings: std::sync::Arc<std::collections::BTreeMap<String, Reading>>,
}

/// How one scope's status-by-key record says what happened
/// (`--status-reading SCOPE=SPEC`), and how a reconciled result replays.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reading {
    /// JSON pointer to the field that holds the state.
    pub pointer: String,
    /// Values that mean "executed"; `None`: anything not in `failed`.
    pub done: Option<Vec<String>>,
    /// Values that mean "refused, did not take effect".
    pub failed: Vec<String>,
    /// The HTTP status a replay of a reconciled DONE carries (the route's success status).
    pub done_status: u16,
    /// The HTTP status a replay of a reconciled FAILED carries.
    pub failed_status: u16,
}

/// Without a declaration: `/status` of `"failed"` is FAILED, anything else
/// DONE, replayed as 200 (what the status endpoint answered).
impl Default for Reading {
    fn default() -> Self {
        Reading {
            pointer: "/status".into(),
            done: None,
            failed: vec!["failed".into()],
            done_status: 200,
            failed_status: 200,
        }
    }
}

impl Reading {
    /// `pointer=/state;done=EXECUTED|SETTLED;failed=REJECTED;done_status=201;failed_status=422`:
    /// every part optional, the defaults as in [`Reading::default`].
    pub fn parse(spec: &str) -> Result<Reading, String> {
        let mut r = Reading::default();
        for part in spec.split(';').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = part.split_once('=').ok_or_else(|| format!("{part:?}: expected key=value"))?;
            let values = || -> Result<Vec<String>, String> {
                let v: Vec<String> = value.split('|').map(|v| v.trim().to_string()).collect();
                if v.iter().any(|x| x.is_empty() || x.len() > 64) {
                    return Err(format!("{key}: values are 1 to 64 characters, separated by |"));
                }
                Ok(v)
            };
            let status = || -> Result<u16, String> {
                match value.trim().parse::<u16>() {
                    Ok(s) if (200..=599).contains(&s) => Ok(s),
                    _ => Err(format!("{key}: expected an HTTP status from 200 to 599, got {value:?}")),
                }
            };
            match key.trim() {
                "pointer" => {
                    let p = value.trim();
                    if !p.starts_with('/') || p.len() > 256 {
                        return Err(format!("pointer: {p:?} is not a JSON pointer such as /state"));
                    }
                    r.pointer = p.to_string();
                }
                "done" => r.done = Some(values()?),
                "failed" => r.failed = values()?,
                "done_status" => r.done_status = status()?,
                "failed_status" => r.failed_status = status()?,
                other => {
                    return Err(format!("{other:?} is not one of pointer, done, failed, done_status, failed_status"))
                }
            }
        }
        if let Some(done) = &r.done {
            if let Some(both) = done.iter().find(|d| r.failed.contains(d)) {
                return Err(format!("{both:?} is listed as both done and failed"));
            }
        }
        Ok(r)
    }

    /// What the record says: `Some(true)` executed, `Some(false)` refused,
    /// `None` neither (still pending, or a value nobody declared).
    fn read(&self, body: &[u8]) -> (Option<bool>, String) {
        let value = serde_json::from_slice::<serde_json::Value>(body).ok().and_then(|v| {
            v.pointer(&self.pointer).and_then(|x| match x {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Number(n) => Some(n.to_string()),
                serde_json::Value::Bool(b) => Some(b.to_string()),
                _ => None,
            })
        });
        let shown = value.clone().map_or_else(|| "absent".to_string(), |v| format!("{v:?}"));
        let verdict = match (&value, &self.done) {
            (Some(v), _) if self.failed.contains(v) => Some(false),
            (_, None) => Some(true),
            (Some(v), Some(done)) if done.contains(v) => Some(true),
            _ => None,
        };
        (verdict, shown)
    }
}

/// What a lookup proves about one row, before the retry budget counts: the one reading of a status
/// answer, for the reconciler's decision ([`decide`]) and for a person's release (`review`,
/// which may release only on [`Proof::Absent`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Proof {
    /// It executed: this is its result.
    Done(StoredResult),
    /// It executed and the upstream refused it: this is its result.
    Failed(StoredResult),
    /// The upstream has no record of it, and the lease ended long enough ago to trust that.
    Absent,
    /// No record, but the lease ended too recently: the request may still be on its way.
    TooSoon,
    /// No evidence this time (a failed lookup, a record that reads neither way): ask again.
    Unknown,
    /// Nothing this lookup could say is evidence about this row: a person decides.
    Never,
}

/// What `asked` proves about `rec` at `now_ms`, and the evidence in words for the audit trail.
pub fn proof(rec: &Record, asked: &Asked, now_ms: i64, rules: &Rules) -> (Proof, String) {
    let (by, answer) = match asked {
        Asked::NoEndpoint if rec.upstream_ignores_keys => {
            let why = format!("{NO_REF_LOOKUP}: no status endpoint is configured for scope {}", rec.scope);
            return (Proof::Never, why);
        }
        Asked::NoEndpoint => {
            return (Proof::Never, format!("no status endpoint is configured for scope {}", rec.scope))
        }
        Asked::Unaskable(why) => return (Proof::Never, why.clone()),
        // `target` never asks such a row by key; should it, the answer is still no evidence.
        Asked::Answered(By::Key, _) if rec.upstream_ignores_keys => {
            let why = format!("{NO_REF_LOOKUP}: a by-key answer says nothing about an upstream that ignores keys");
            return (Proof::Never, why);
        }
        Asked::Answered(by, answer) => (*by, answer),
    };
    // The evidence names what was looked up; the reference itself is on the row.
    let looked_up = match by {
        By::Key => "status endpoint answered",
        By::Ref => "status endpoint (by business reference) answered",
    };
    match answer {
        StatusAnswer::Found { body, .. } if by == By::Ref && same_operation(rec, body).is_err() => {
            let why = same_operation(rec, body).err().unwrap_or_default();
            // A reference names one operation among those idemd knows, not among the upstream's
            // records (one made around the gateway, one reaped here): only the bound fields tell.
            (Proof::Never, format!("{looked_up} 200 with a record not proven this operation's ({why}): a reference alone proves nothing"))
        }
        StatusAnswer::Found { content_type, body } => {
            let reading = rules.readings.get(&rec.scope).cloned().unwrap_or_default();
            let result = |status: u16| StoredResult {
                status,
                headers: content_type.iter().map(|c| ("content-type".to_string(), c.clone())).collect(),
                body_b64: encode_body(body),
            };
            match reading.read(body) {
                (Some(true), v) => (
                    Proof::Done(result(reading.done_status)),
                    format!("{looked_up} 200 with {} = {v}: the upstream executed it", reading.pointer),
                ),
                (Some(false), v) => (
                    Proof::Failed(result(reading.failed_status)),
                    format!("{looked_up} 200 with {} = {v}: the upstream refused it", reading.pointer),
                ),
                (None, v) => {
                    (Proof::Unknown, format!("{looked_up} 200 with {} = {v}, neither done nor failed", reading.pointer))
                }
            }
        }
        StatusAnswer::NotFound => {
            let lease_end = rec.lease_until_ms.unwrap_or(rec.updated_at_ms);
            let since = now_ms.saturating_sub(lease_end);
            // By reference: the upstream has no record under it, as a deduplicating upstream
            // has none under a key it was never sent.
            let unknown = match by {
                By::Key => "never executed",
                By::Ref => "no record under that reference, never executed",
            };
            if since >= i64::try_from(rules.grace_ms).unwrap_or(i64::MAX) {
                (
                    Proof::Absent,
                    format!(
                        "{looked_up} 404 {since} ms after the lease ended (grace {} ms): {unknown}",
                        rules.grace_ms
                    ),
                )
            } else {
                (
                    Proof::TooSoon,
                    format!("{looked_up} 404 only {since} ms after the lease ended (grace {} ms)", rules.grace_ms),
                )
            }
        }
        StatusAnswer::Failed(what) => (Proof::Unknown, format!("status lookup failed: {what}")),
    }
}

/// Whether a record the upstream answered under `rec`'s business reference is `rec`'s operation:
/// every bound field the confirm carried (the canonical JSON kept with the reference) is at the same
/// pointer of the record with the same value, read by the fingerprint's own canonical rule (so a
/// decimal `10.00` and `"10.0"` are one value). `Err` says what is missing or differs, by pointer only
/// (never a value: the audit trail keeps no parameter).
pub fn same_operation(rec: &Record, body: &[u8]) -> Result<(), String> {
    use idem_core::canonical::{canonical_params, BoundField};
    let Some(fields) = rec.bound_fields.as_deref() else {
        return Err("the operation keeps no bound fields to compare: its filter sent none".into());
    };
    let Ok(serde_json::Value::Object(expected)) = serde_json::from_str::<serde_json::Value>(fields) else {
        return Err("the operation's bound fields do not read".into());
    };
    let Ok(record) = serde_json::from_slice::<serde_json::Value>(body) else {
        return Err("the record is not JSON".into());
    };
    // One value as the fingerprint's canonical rule writes it (a number expected: any decimal spelling).
    let canonical = |value: &serde_json::Value, decimal: bool| {
        canonical_params(&serde_json::json!({ "v": value }), &[BoundField::new("/v", decimal)]).ok()
    };
    let differ: Vec<String> = expected
        .iter()
        .filter_map(|(pointer, want)| match record.pointer(pointer) {
            None | Some(serde_json::Value::Null) => Some(format!("{pointer} absent")),
            Some(got)
                if canonical(got, want.is_number()).is_some_and(|g| Some(g) == canonical(want, want.is_number())) =>
            {
                None
            }
            Some(_) => Some(format!("{pointer} differs")),
        })
        .collect();
    if differ.is_empty() {
        Ok(())
    } else {
        Err(differ.join(", "))
    }
}

/// The decision and the evidence for the audit trail: what the lookup proves ([`proof`]), with the
/// retry budget counted where it proves nothing this time.
pub fn decide(rec: &Record, asked: &Asked, now_ms: i64, rules: &Rules) -> (Decision, String) {
    match proof(rec, asked, now_ms, rules) {
        (Proof::Done(result), why) => (Decision::Done(result), why),
        (Proof::Failed(result), why) => (Decision::Failed(result), why),
        (Proof::Absent, why) => (Decision::Release, why),
        (Proof::TooSoon, why) => (Decision::SkipGrace, why),
        (Proof::Unknown, why) => retry_or_review(rec, rules, &why),
        (Proof::Never, why) => (Decision::NeedsReview, why),
    }
}

/// No evidence this time: one attempt of the retry budget is used.
fn retry_or_review(rec: &Record, rules: &Rules, what: &str) -> (Decision, String) {
    let attempt = rec.reconcile_attempts.saturating_add(1);
    if attempt >= i64::from(rules.retry_budget) {
        (
            Decision::NeedsReview,
            format!("no answer after {attempt} attempts (budget {}); last: {what}", rules.retry_budget),
        )
    } else {
        (Decision::Retry, format!("attempt {attempt} of {}: {what}", rules.retry_budget))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use idem_core::protocol::{decode_body, OpState};

    #[test]
    fn every_label_is_listed_up_front() {
        let result = StoredResult { status: 200, headers: vec![], body_b64: String::new() };
        let all = [
            Decision::Done(result.clone()),
            Decision::Failed(result),
            Decision::Release,
            Decision::NeedsReview,
            Decision::Retry,
            Decision::SkipGrace,
        ];
        assert_eq!(all.map(|d| d.metric()), crate::metrics::RECONCILE_DECISIONS);
        let answers = [
            StatusAnswer::Found { content_type: None, body: vec![] },
            StatusAnswer::NotFound,
            StatusAnswer::Failed("x".into()),
        ];
        assert_eq!(answers.map(|a| a.metric()), crate::metrics::LOOKUP_RESULTS);
    }

    /// An IN_FLIGHT row of `payments.transfer` (also the settle tests' row).
    pub(crate) fn rec(lease_until_ms: i64, attempts: i64) -> Record {
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
            fp_exp_ms: None,
            upstream_ignores_keys: false,
            business_ref: None,
            bound_fields: None,
        }
    }

    /// What a by-key lookup said.
    fn key(a: &StatusAnswer) -> Asked {
        Asked::Answered(By::Key, a.clone())
    }

    fn rules() -> Rules {
        Rules { grace_ms: 1_000, retry_budget: 3, readings: Default::default() }
    }

    #[test]
    fn found_is_done_with_the_record_as_the_result() {
        let body = br#"{"transfer_id":"t_1","status":"executed"}"#.to_vec();
        let l = StatusAnswer::Found { content_type: Some("application/json".into()), body: body.clone() };
        let (d, why) = decide(&rec(0, 0), &key(&l), 10, &rules());
        let Decision::Done(r) = d else { panic!("{d:?}") };
        assert_eq!(r.status, 200);
        assert_eq!(r.headers, vec![("content-type".to_string(), "application/json".to_string())]);
        assert_eq!(decode_body(&r.body_b64), Some(body));
        assert!(why.contains("200"));
    }

    #[test]
    fn found_with_status_failed_is_failed() {
        let l = StatusAnswer::Found { content_type: None, body: br#"{"status":"failed","error":"x"}"#.to_vec() };
        assert_eq!(decide(&rec(0, 0), &key(&l), 10, &rules()).0.metric(), "failed");
        // Only the top level counts, and only the exact word.
        let l = StatusAnswer::Found {
            content_type: None,
            body: br#"{"inner":{"status":"failed"},"status":"FAILED"}"#.to_vec(),
        };
        assert_eq!(decide(&rec(0, 0), &key(&l), 10, &rules()).0.metric(), "done");
        let l = StatusAnswer::Found { content_type: None, body: b"not json".to_vec() };
        assert_eq!(decide(&rec(0, 0), &key(&l), 10, &rules()).0.metric(), "done");
    }

    #[test]
    fn not_found_releases_only_after_the_grace() {
        let r = rec(5_000, 0);
        assert_eq!(decide(&r, &key(&StatusAnswer::NotFound), 5_999, &rules()).0, Decision::SkipGrace);
        let (d, why) = decide(&r, &key(&StatusAnswer::NotFound), 6_000, &rules());
        assert_eq!(d, Decision::Release);
        assert!(why.contains("404 1000 ms after the lease ended"), "{why}");
    }

    #[test]
    fn failures_retry_until_the_budget_then_need_review() {
        let l = StatusAnswer::Failed("answered 500".into());
        let (d, why) = decide(&rec(0, 0), &key(&l), 10, &rules());
        assert_eq!(d, Decision::Retry);
        assert_eq!(why, "attempt 1 of 3: status lookup failed: answered 500");
        assert_eq!(decide(&rec(0, 1), &key(&l), 10, &rules()).0, Decision::Retry);
        let (d, why) = decide(&rec(0, 2), &key(&l), 10, &rules());
        assert_eq!(d, Decision::NeedsReview);
        assert_eq!(why, "no answer after 3 attempts (budget 3); last: status lookup failed: answered 500");
    }

    #[test]
    fn no_endpoint_needs_review_at_once() {
        let (d, why) = decide(&rec(0, 0), &Asked::NoEndpoint, 10, &rules());
        assert_eq!(d, Decision::NeedsReview);
        assert_eq!(why, "no status endpoint is configured for scope payments.transfer");
    }

    /// The bound fields a no-key row's confirm carried: the amount and its client reference.
    const FIELDS: &str = r#"{"/amount":10.5,"/ref":"inv-7"}"#;

    /// A row whose route says `upstream_keys: ignored`, with client reference `inv-7`.
    fn no_key_row(lease_until_ms: i64, attempts: i64) -> Record {
        Record {
            upstream_ignores_keys: true,
            business_ref: Some("inv-7".into()),
            bound_fields: Some(FIELDS.into()),
            ..rec(lease_until_ms, attempts)
        }
    }

    fn by_ref(a: &StatusAnswer) -> Asked {
        Asked::Answered(By::Ref, a.clone())
    }

    #[test]
    fn a_by_reference_404_after_the_grace_releases() {
        let r = no_key_row(5_000, 0);
        let (d, why) = decide(&r, &by_ref(&StatusAnswer::NotFound), 5_999, &rules());
        assert_eq!(d, Decision::SkipGrace, "{why}");
        let (d, why) = decide(&r, &by_ref(&StatusAnswer::NotFound), 6_000, &rules());
        assert_eq!(d, Decision::Release);
        assert_eq!(
            why,
            "status endpoint (by business reference) answered 404 1000 ms after the lease ended (grace 1000 ms): \
             no record under that reference, never executed"
        );
        // The same for a deduplicating upstream looked up by its reference.
        let plain = Record { business_ref: Some("inv-7".into()), ..rec(5_000, 0) };
        assert_eq!(decide(&plain, &by_ref(&StatusAnswer::NotFound), 6_000, &rules()).0, Decision::Release);
    }

    #[test]
    fn a_by_reference_record_reads_as_done_or_failed() {
        let found = |body: &str| StatusAnswer::Found { content_type: None, body: body.as_bytes().to_vec() };
        let record = r#"{"status":"executed","amount":"10.50","ref":"inv-7","id":"t_1"}"#;
        let (d, why) = decide(&no_key_row(0, 0), &by_ref(&found(record)), 10, &rules());
        assert_eq!(d.metric(), "done", "{why}");
        assert!(why.starts_with("status endpoint (by business reference) answered 200 with /status"), "{why}");
        let record = r#"{"status":"failed","amount":10.5,"ref":"inv-7"}"#;
        let (d, _) = decide(&no_key_row(0, 0), &by_ref(&found(record)), 10, &rules());
        assert_eq!(d.metric(), "failed");
        // No evidence costs an attempt, as by key.
        let (d, _) = decide(&no_key_row(0, 2), &by_ref(&StatusAnswer::Failed("answered 500".into())), 10, &rules());
        assert_eq!(d, Decision::NeedsReview);
    }

    /// DESIGN §4, "A reference proves only its own operation": a record under the reference settles
    /// the row only if it carries the row's bound fields; another operation's record (another amount,
    /// one without the reference, one made around the gateway) or a row that keeps no fields to compare
    /// goes to a person at once, never DONE with someone else's result.
    #[test]
    fn a_record_under_the_reference_settles_only_its_own_operation() {
        let found = |body: &str| by_ref(&StatusAnswer::Found { content_type: None, body: body.as_bytes().to_vec() });
        for (body, says) in [
            (r#"{"status":"executed","amount":"99.00","ref":"inv-7"}"#, "/amount differs"),
            (r#"{"status":"executed","ref":"inv-7"}"#, "/amount absent"),
            (r#"{"status":"executed","amount":"10.5","ref":"INV-7"}"#, "/ref differs"),
            (r#"{"status":"executed","amount":"10.5","ref":null}"#, "/ref absent"),
            (r#"{"status":"executed","amount":{"v":"10.5"},"ref":"inv-7"}"#, "/amount differs"),
            ("executed", "the record is not JSON"),
        ] {
            let (d, why) = decide(&no_key_row(0, 0), &found(body), 10, &rules());
            assert_eq!(d, Decision::NeedsReview, "{body}: {why}");
            assert!(why.contains("a record not proven this operation's") && why.contains(says), "{body}: {why}");
            assert!(!why.contains("99"), "no parameter value in the audit line: {why}");
        }
        let legacy = Record { bound_fields: None, ..no_key_row(0, 0) };
        let (d, why) = decide(&legacy, &found(r#"{"status":"executed","amount":"10.5","ref":"inv-7"}"#), 10, &rules());
        assert_eq!(d, Decision::NeedsReview);
        assert!(why.contains("keeps no bound fields"), "{why}");
        // Decimals by value, other fields of the record ignored.
        let spelled = r#"{"ref":"inv-7","amount":"10.500","status":"executed","memo":"x"}"#;
        assert_eq!(decide(&no_key_row(0, 0), &found(spelled), 10, &rules()).0.metric(), "done");
        // A by-key answer (a deduplicating upstream's own key) needs no fields.
        let keyed = Record { business_ref: Some("inv-7".into()), ..rec(0, 0) };
        let answer = StatusAnswer::Found { content_type: None, body: br#"{"status":"executed"}"#.to_vec() };
        assert_eq!(decide(&keyed, &key(&answer), 10, &rules()).0.metric(), "done");
    }

    #[test]
    fn an_upstream_that_ignores_keys_without_a_reference_lookup_needs_review_at_once() {
        // No endpoint at all, or one that cannot ask by reference (`target` says why).
        let (d, why) = decide(&no_key_row(0, 0), &Asked::NoEndpoint, 10, &rules());
        assert_eq!(d, Decision::NeedsReview);
        assert_eq!(
            why,
            "upstream ignores keys and no business-reference lookup: no status endpoint is configured for scope \
             payments.transfer"
        );
        let unaskable = Asked::Unaskable(format!("{NO_REF_LOOKUP}: the status endpoint looks up by {{key}} only"));
        let (d, why) = decide(&no_key_row(0, 0), &unaskable, 10, &rules());
        assert_eq!(d, Decision::NeedsReview);
        assert!(why.starts_with(NO_REF_LOOKUP), "{why}");
        // A by-key answer is never evidence here, least of all its 404: that upstream never stored a key.
        for answer in [StatusAnswer::NotFound, StatusAnswer::Found { content_type: None, body: b"{}".to_vec() }] {
            let (d, why) = decide(&no_key_row(0, 0), &key(&answer), 1_000_000, &rules());
            assert_eq!(d, Decision::NeedsReview, "{answer:?}");
            assert!(why.starts_with(NO_REF_LOOKUP), "{why}");
        }
    }

    fn declared(spec: &str) -> Rules {
        let reading = Reading::parse(spec).unwrap();
        let readings = [("payments.transfer".to_string(), reading)].into_iter().collect();
        Rules { readings: std::sync::Arc::new(readings), ..rules() }
    }

    #[test]
    fn a_declared_reading_decides_and_sets_the_replay_status() {
        let r = declared("pointer=/state;done=EXECUTED|SETTLED;failed=REJECTED;done_status=201;failed_status=422");
        let found = |body: &str| StatusAnswer::Found { content_type: None, body: body.as_bytes().to_vec() };
        let (d, why) = decide(&rec(0, 0), &key(&found(r#"{"state":"SETTLED"}"#)), 10, &r);
        let Decision::Done(result) = d else { panic!("{d:?}") };
        assert_eq!(result.status, 201);
        assert!(why.contains("/state = \"SETTLED\""), "{why}");
        let (d, _) = decide(&rec(0, 0), &key(&found(r#"{"state":"REJECTED"}"#)), 10, &r);
        let Decision::Failed(result) = d else { panic!("{d:?}") };
        assert_eq!(result.status, 422);
        // Neither: no evidence, like a failed lookup; the budget ends in review.
        let (d, why) = decide(&rec(0, 0), &key(&found(r#"{"state":"PENDING"}"#)), 10, &r);
        assert_eq!(d, Decision::Retry, "{why}");
        assert_eq!(decide(&rec(0, 2), &key(&found(r#"{"other":1}"#)), 10, &r).0, Decision::NeedsReview);
        // Another scope keeps the default reading.
        let mut other = rec(0, 0);
        other.scope = "payments.refund".into();
        assert_eq!(decide(&other, &key(&found(r#"{"state":"PENDING"}"#)), 10, &r).0.metric(), "done");
    }

    #[test]
    fn readings_that_do_not_parse_say_why() {
        for (spec, want) in [
            ("pointer=state", "pointer: \"state\" is not a JSON pointer"),
            ("done_status=99", "done_status: expected an HTTP status"),
            ("done=A|;failed=B", "done: values are 1 to 64"),
            ("done=A;failed=A", "\"A\" is listed as both"),
            ("colour=red", "\"colour\" is not one of"),
            ("done", "\"done\": expected key=value"),
        ] {
            let got = Reading::parse(spec).unwrap_err();
            assert!(got.starts_with(want), "{spec}: {got}");
        }
        assert_eq!(Reading::parse("").unwrap(), Reading::default());
    }

    #[test]
    fn a_reading_takes_values_and_pointers_up_to_their_limits() {
        let value = |n: usize| format!("done={}", "V".repeat(n));
        assert!(Reading::parse(&value(64)).is_ok());
        assert!(Reading::parse(&value(65)).unwrap_err().starts_with("done: values are 1 to 64"));
        let pointer = |n: usize| format!("pointer=/{}", "p".repeat(n - 1));
        assert!(Reading::parse(&pointer(256)).is_ok());
        assert!(Reading::parse(&pointer(257)).unwrap_err().starts_with("pointer:"));
    }

    #[test]
    fn a_reading_matches_numbers_and_booleans_by_their_json_text() {
        let r = declared("pointer=/ok;done=true|1;failed=false|0");
        let found = |body: &str| StatusAnswer::Found { content_type: None, body: body.as_bytes().to_vec() };
        for (body, done) in
            [(r#"{"ok":true}"#, true), (r#"{"ok":1}"#, true), (r#"{"ok":false}"#, false), (r#"{"ok":0}"#, false)]
        {
            let (d, why) = decide(&rec(0, 0), &key(&found(body)), 10, &r);
            assert_eq!(d.metric(), if done { "done" } else { "failed" }, "{body}: {why}");
        }
    }
}
