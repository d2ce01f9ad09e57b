//! Every transition of the machine, including the impossible ones.

use super::mcp::REPLAY_PROPERTY;
use super::*;
use crate::fingerprint::{mint, subject_hash, Key, Keyring};
use crate::policy::{parse_route_policy, LeafValue, PluginConfig, RouteDefaults, RoutePolicy};
use crate::protocol::{encode_body, AcquireRequest, CompleteRequest, ReleaseRequest};
use crate::testing::{self, FixedEnv};
use serde_json::{json, Value};
use std::rc::Rc;

type TestResult = Result<(), Box<dyn std::error::Error>>;

const SECRET: &str = "0123456789abcdef0123456789abcdef";
const NONCE: [u8; 16] = [0x11; 16];
const KEY: &str = "11111111111111111111111111111111";
const OWNER: &str = "22222222222222222222222222222222";

fn config() -> Result<Rc<PluginConfig>, Box<dyn std::error::Error>> {
    testing::plugin_config(SECRET, r#""max_response_bytes":64"#)
}

fn policy(role: &str, replay: &str) -> Result<Rc<RoutePolicy>, Box<dyn std::error::Error>> {
    policy_with(role, replay, &[])
}

fn policy_with(
    role: &str,
    replay: &str,
    extra: &[(&str, &str)],
) -> Result<Rc<RoutePolicy>, Box<dyn std::error::Error>> {
    let mut leaves = vec![
        ("role", role),
        ("scope", "pay"),
        ("bind", "/amount:decimal, /currency"),
        ("status_tool", "get_status"),
        ("result_ref", "/id"),
        ("replay", replay),
    ];
    if matches!(role, "confirm" | "idempotent") {
        leaves.push(("upstream_keys", "honoured"));
    }
    leaves.extend_from_slice(extra);
    testing::route(&leaves)
}

fn ctx(role: &str) -> Result<Ctx, Box<dyn std::error::Error>> {
    Ok(Ctx { config: config()?, policy: policy(role, "envelope")?, trace_id: "trace-1".into() })
}

fn keyring() -> Result<Keyring, String> {
    Keyring::new(vec![Key { kid: "k1".into(), secret: SECRET.as_bytes().to_vec() }], "k1")
}

/// A fingerprint for alice over `{"amount": 10, "currency": "EUR"}`, valid until `exp`.
fn token(exp: u64) -> Result<String, Box<dyn std::error::Error>> {
    let body = json!({"amount": 10, "currency": "EUR"});
    let bound = policy("confirm", "envelope")?.bound.clone();
    let p = canonical::param_hash(&body, &bound)?;
    Ok(mint(&keyring()?, NONCE, exp, &subject_hash("alice"), "pay", &p))
}

fn head(fp: Option<String>) -> RequestHead {
    RequestHead {
        trace: crate::trace::Trace::of(Some("trace-1"), None, None),
        subject: Some("alice".into()),
        content_length: None,
        fingerprint: fp,
        path: "/confirm".into(),
        method: "POST".into(),
        idempotency_key: None,
        mcp_method: None,
        mcp_name: None,
        repeated: None,
        not_text: None,
        headers: Vec::new(),
    }
}

fn body(amount: Value) -> Vec<u8> {
    json!({"amount": amount, "currency": "EUR", "memo": "asap"}).to_string().into_bytes()
}

fn reply_json(step: &Step) -> Result<Value, Box<dyn std::error::Error>> {
    let r = step.reply().ok_or("no reply")?;
    Ok(serde_json::from_slice(&r.body)?)
}

fn reply_status(step: &Step) -> Result<(u16, String), Box<dyn std::error::Error>> {
    let r = step.reply().ok_or("no reply")?;
    let v: Value = serde_json::from_slice(&r.body)?;
    Ok((r.http_status, v["status"].as_str().unwrap_or_default().to_string()))
}

fn call(step: &Step) -> Option<&Callout> {
    step.effects.iter().find_map(|e| match e {
        Effect::Call(c) => Some(c),
        _ => None,
    })
}

fn counted(step: &Step, c: Counter) -> bool {
    step.effects.contains(&Effect::Count(c))
}

fn answer(status: u16, body: Value) -> CalloutAnswer {
    CalloutAnswer { status: Some(status), body: body.to_string().into_bytes() }
}

/// A confirm that has sent its acquire.
fn acquiring(env: &mut FixedEnv) -> Result<(Machine, Step), Box<dyn std::error::Error>> {
    let (mut m, first) = Machine::start(ctx("confirm")?, &head(Some(token(1000)?)), false, env);
    assert_eq!(first.flow, Flow::Pause);
    // No Idempotency-Key came: nothing to remove (the forward sets the nonce in its place).
    assert!(!first.effects.contains(&Effect::RemoveRequestHeader(IDEMPOTENCY_KEY_HEADER)));
    assert_eq!(m.on_request_data(10, true), Step::need_body());
    let step = m.on_request_body(&body(json!("10.00")), env)?;
    Ok((m, step))
}

fn forwarded(env: &mut FixedEnv) -> Result<Machine, Box<dyn std::error::Error>> {
    let (mut m, _) = acquiring(env)?;
    let step = m.on_callout(&answer(200, json!({"outcome": "ACQUIRED", "owner": OWNER})), env)?;
    assert!(step.effects.contains(&Effect::SetRequestHeader(IDEMPOTENCY_KEY_HEADER, KEY.into())));
    assert!(step.effects.contains(&Effect::ResumeRequest));
    assert!(m.response_needs_headers());
    Ok(m)
}

fn upstream(status: u16, details: &str) -> ResponseHead {
    ResponseHead {
        status,
        content_type: Some("application/json".into()),
        code_details: Some(details.into()),
        attempts: 1,
        headers: vec![("content-type".into(), "application/json".into()), ("retry-after".into(), "7".into())],
        ..Default::default()
    }
}

// ---- confirm ---------------------------------------------------------------

#[test]
fn confirm_acquires_with_the_verified_claims() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    let (_, step) = acquiring(&mut env)?;
    let c = call(&step).ok_or("no call")?;
    assert_eq!((c.method, c.path.as_str()), ("POST", "/v1/acquire"));
    let req: AcquireRequest = serde_json::from_slice(c.body.as_deref().unwrap_or_default())?;
    assert_eq!(req.key, KEY);
    assert_eq!(req.scope, "pay");
    assert_eq!(req.trace_id, "trace-1");
    assert_eq!(req.lease_ms, 60_000);
    assert!(counted(&step, Counter::Verified));
    Ok(())
}

#[test]
fn confirm_done_path_completes_then_releases_the_answer() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    let mut m = forwarded(&mut env)?;
    let step = m.on_response_head(&upstream(201, "via_upstream"), false, &mut env)?;
    assert_eq!(step.flow, Flow::Pause);
    assert!(step.effects.contains(&Effect::RemoveResponseHeader("content-length")));
    assert!(step.effects.contains(&Effect::SetResponseHeader("idempotency-key".into(), KEY.into())));
    assert_eq!(m.on_response_data(5, false)?, Step::pause());
    assert_eq!(m.on_response_data(12, true)?, Step::need_body());
    let step = m.on_response_body(br#"{"id":"T-1"}"#, &mut env)?;
    let c = call(&step).ok_or("no complete")?;
    assert_eq!(c.path, "/v1/complete");
    let req: CompleteRequest = serde_json::from_slice(c.body.as_deref().unwrap_or_default())?;
    assert_eq!((req.key.as_str(), req.owner.as_str(), req.result.status), (KEY, OWNER, 201));
    assert_eq!(crate::protocol::decode_body(&req.result.body_b64), Some(br#"{"id":"T-1"}"#.to_vec()));
    let step = m.on_callout(&answer(200, json!({"outcome": "OK"})), &mut env)?;
    assert!(step.effects.contains(&Effect::ResumeResponse));
    assert!(counted(&step, Counter::Completed));
    assert!(matches!(m, Machine::Pass));
    Ok(())
}

/// A confirm on a route with `extra` leaves, its body read: the machine and the acquire it sent.
fn acquiring_on(
    extra: &[(&str, &str)],
    env: &mut FixedEnv,
) -> Result<(Machine, AcquireRequest), Box<dyn std::error::Error>> {
    let ctx = Ctx { config: config()?, policy: policy_with("confirm", "envelope", extra)?, trace_id: "t".into() };
    let (mut m, _) = Machine::start(ctx, &head(Some(token(1000)?)), false, env);
    m.on_request_data(10, true);
    let step = m.on_request_body(&body(json!("10.00")), env)?;
    let req = serde_json::from_slice(call(&step).and_then(|c| c.body.as_deref()).unwrap_or_default())?;
    Ok((m, req))
}

#[test]
fn an_upstream_that_ignores_keys_is_never_released_on_its_own_answer() -> TestResult {
    // DESIGN §4, "release needs proof nothing ran": the upstream's 503 says nothing about a second
    // request, which it would execute; the operation stays IN_FLIGHT for the reconciler.
    let mut env = FixedEnv::at(999, NONCE);
    let (mut m, req) = acquiring_on(&[("upstream_keys", "ignored"), ("business_ref", "/currency")], &mut env)?;
    assert!(req.upstream_ignores_keys);
    assert_eq!(req.business_ref.as_deref(), Some("EUR"), "the reconciler looks it up by this");
    m.on_callout(&answer(200, json!({"outcome": "ACQUIRED", "owner": OWNER})), &mut env)?;
    m.on_response_head(&upstream(503, "via_upstream"), false, &mut env)?;
    m.on_response_data(2, true)?;
    let step = m.on_response_body(b"{}", &mut env)?;
    assert_eq!(call(&step), None, "no release: the row stays IN_FLIGHT");
    assert!(counted(&step, Counter::UnknownOutcome));
    Ok(())
}

#[test]
fn an_upstream_that_ignores_keys_still_releases_what_envoy_never_sent() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    let extra = [("upstream_keys", "ignored")];
    let ctx = Ctx { config: config()?, policy: policy_with("confirm", "envelope", &extra)?, trace_id: "t".into() };
    let (mut m, _) = Machine::start(ctx, &head(Some(token(1000)?)), false, &mut env);
    m.on_request_data(10, true);
    m.on_request_body(&body(json!("10.00")), &mut env)?;
    m.on_callout(&answer(200, json!({"outcome": "ACQUIRED", "owner": OWNER})), &mut env)?;
    let refused = upstream(503, "upstream_reset_before_response_started{connection_failure}");
    m.on_response_head(&refused, false, &mut env)?;
    m.on_response_data(2, true)?;
    let step = m.on_response_body(b"{}", &mut env)?;
    assert_eq!(call(&step).map(|c| c.path.as_str()), Some("/v1/release"));
    Ok(())
}

/// DESIGN §4, "A reference proves only its own operation": the acquire carries the bound fields'
/// canonical JSON beside the reference (idemd holds a by-reference record against it, and its hash
/// is the fingerprint's `p`); idemd's REFERENCE_IN_USE is a 409 that names the reference's field and
/// forwards nothing.
#[test]
fn a_business_ref_travels_with_its_bound_fields_and_a_taken_one_is_refused() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    let (mut m, req) = acquiring_on(&[("upstream_keys", "ignored"), ("business_ref", "/currency")], &mut env)?;
    let fields = req.fields.as_deref().ok_or("no bound fields beside the reference")?;
    assert_eq!(fields, r#"{"/amount":10,"/currency":"EUR"}"#);
    assert_eq!(hex::encode(<sha2::Sha256 as sha2::Digest>::digest(fields.as_bytes())), req.param_hash);
    let step = m.on_callout(&answer(200, json!({"outcome": "REFERENCE_IN_USE"})), &mut env)?;
    let reply = step.reply().ok_or("no reply")?;
    assert_eq!(reply.http_status, 409);
    let v = reply_json(&step)?;
    assert_eq!((v["status"].as_str(), v["detail"].as_str()), (Some("reference_in_use"), Some("/currency")));
    assert_eq!(v["retryable"], false);
    assert!(!step.effects.contains(&Effect::ResumeRequest), "nothing forwarded");
    // Without a business_ref, no fields travel.
    let (_, req) = acquiring_on(&[], &mut FixedEnv::at(999, NONCE))?;
    assert_eq!((req.business_ref, req.fields), (None, None));
    Ok(())
}

/// A business reference is text the upstream looks up: a string or an integer (either sign, up to
/// u64), non-empty, at most 256 characters, no control characters. Anything else is a 400 before
/// anything is acquired.
#[test]
fn a_business_ref_that_is_not_text_is_refused_before_anything_runs() -> TestResult {
    let long = "r".repeat(256);
    let cases: [(Value, Option<&str>); 10] = [
        (json!("T-1"), Some("T-1")),
        (json!(42), Some("42")),
        (json!(-5), Some("-5")),
        (json!(u64::MAX), Some("18446744073709551615")),
        (json!(long), Some(long.as_str())),
        (json!("r".repeat(257)), None),
        (json!(""), None),
        (json!("a\u{7}b"), None),
        (json!(1.5), None),
        (json!({"nested": 1}), None),
    ];
    for (value, taken) in cases {
        let mut env = FixedEnv::at(999, NONCE);
        let extra = [("bind", "/amount:decimal, /currency, /ref"), ("business_ref", "/ref")];
        let policy = policy_with("confirm", "envelope", &extra)?;
        let sent = json!({"amount": "10.00", "currency": "EUR", "ref": value});
        let p = canonical::param_hash(&sent, &policy.bound)?;
        let fp = mint(&keyring()?, NONCE, 1000, &subject_hash("alice"), "pay", &p);
        let ctx = Ctx { config: config()?, policy, trace_id: "t".into() };
        let (mut m, _) = Machine::start(ctx, &head(Some(fp)), false, &mut env);
        m.on_request_data(10, true);
        let step = m.on_request_body(sent.to_string().as_bytes(), &mut env)?;
        match taken {
            Some(text) => {
                let req: AcquireRequest =
                    serde_json::from_slice(call(&step).and_then(|c| c.body.as_deref()).unwrap_or_default())?;
                assert_eq!(req.business_ref.as_deref(), Some(text), "{value}");
            }
            None => {
                assert_eq!(call(&step), None, "nothing acquired for {value}");
                assert_eq!(step.reply().map(|r| r.http_status), Some(400), "{value}: {:?}", reply_json(&step));
            }
        }
    }
    Ok(())
}

#[test]
fn confirm_holds_its_lease_from_the_forward_until_the_answer_is_whole() -> TestResult {
    // DESIGN §4: a lease cannot lapse under a live request. The host renews what this names.
    let mut env = FixedEnv::at(999, NONCE);
    let (m, _) = acquiring(&mut env)?;
    assert_eq!(m.live_lease(), None, "nothing is upstream before the acquire is answered");
    let mut m = forwarded(&mut env)?;
    let held = m.live_lease().ok_or("no lease while upstream")?;
    assert_eq!((held.key.as_str(), held.owner.as_str(), held.lease_ms), (KEY, OWNER, 60_000));
    m.on_response_head(&upstream(201, "via_upstream"), false, &mut env)?;
    assert_eq!(m.live_lease(), Some(held.clone()), "the answer's body is still coming");
    m.on_response_data(2, true)?;
    m.on_response_body(b"{}", &mut env)?;
    assert_eq!(m.live_lease(), None, "the answer is whole: its record is one bounded callout away");
    Ok(())
}

#[test]
fn confirm_release_rewrites_to_not_executed_with_the_upstream_retry_after() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    let mut m = forwarded(&mut env)?;
    m.on_response_head(&upstream(503, "via_upstream"), false, &mut env)?;
    m.on_response_data(2, true)?;
    let step = m.on_response_body(b"{}", &mut env)?;
    assert_eq!(call(&step).map(|c| c.path.as_str()), Some("/v1/release"));
    let req: ReleaseRequest = serde_json::from_slice(call(&step).and_then(|c| c.body.as_deref()).unwrap_or_default())?;
    assert_eq!(req.owner, OWNER);
    let rewrite = rewritten(&step).ok_or("no rewrite")?;
    assert_eq!(rewrite.http_status, 503);
    assert!(rewrite.headers.contains(&("retry-after".into(), "7".into())));
    let v: Value = serde_json::from_slice(&rewrite.body)?;
    assert_eq!(v["status"], "not_executed");
    let step = m.on_callout(&answer(200, json!({"outcome": "OK"})), &mut env)?;
    assert!(counted(&step, Counter::Released) && step.effects.contains(&Effect::ResumeResponse));
    Ok(())
}

#[test]
fn confirm_unknown_outcome_stays_in_flight_and_tells_the_model_to_poll() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    let mut m = forwarded(&mut env)?;
    m.on_response_head(&upstream(504, "upstream_response_timeout"), false, &mut env)?;
    m.on_response_data(2, true)?;
    let step = m.on_response_body(b"{}", &mut env)?;
    assert!(call(&step).is_none(), "nothing is recorded: the reconciler decides");
    assert!(counted(&step, Counter::UnknownOutcome));
    assert_eq!(step.flow, Flow::Continue);
    let rewrite = rewritten(&step).ok_or("no rewrite")?;
    assert_eq!(rewrite.http_status, 202);
    // The model polls by the operation it is told.
    let v: Value = serde_json::from_slice(&rewrite.body)?;
    assert_eq!((v["status"].as_str(), v["operation"].as_str()), (Some("in_progress"), Some(KEY)), "{v}");
    assert!(matches!(m, Machine::Pass));
    Ok(())
}

/// The reply a step rewrites the held answer into.
fn rewritten(step: &Step) -> Option<&crate::reply::Reply> {
    step.effects.iter().find_map(|e| match e {
        Effect::Rewrite(r) => Some(r),
        _ => None,
    })
}

#[test]
fn confirm_answer_without_body_is_recorded_at_the_head() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    let mut m = forwarded(&mut env)?;
    let step = m.on_response_head(&upstream(204, "via_upstream"), true, &mut env)?;
    assert_eq!(call(&step).map(|c| c.path.as_str()), Some("/v1/complete"));
    assert_eq!(step.flow, Flow::Pause);
    Ok(())
}

#[test]
fn confirm_answer_too_large_is_recorded_without_its_body() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    let mut m = forwarded(&mut env)?;
    m.on_response_head(&upstream(201, "via_upstream"), false, &mut env)?;
    let step = m.on_response_data(65, false)?;
    let c = call(&step).ok_or("no complete")?;
    let req: CompleteRequest = serde_json::from_slice(c.body.as_deref().unwrap_or_default())?;
    assert_eq!(req.result.body_b64, "");
    assert!(step.effects.iter().any(|e| matches!(e, Effect::Warn(_))));
    // Later chunks pass while the ack is awaited.
    assert_eq!(m.on_response_data(200, true)?, Step::go_on());
    Ok(())
}

#[test]
fn confirm_answer_at_the_limit_is_recorded_whole() -> TestResult {
    // max_response_bytes is 64 here: an answer of exactly 64 bytes is kept for replay.
    let mut env = FixedEnv::at(999, NONCE);
    let mut m = forwarded(&mut env)?;
    m.on_response_head(&upstream(201, "via_upstream"), false, &mut env)?;
    assert_eq!(m.on_response_data(64, false)?, Step::pause());
    assert_eq!(m.on_response_data(64, true)?, Step::need_body());
    let answer_body = format!(r#"{{"id":"{}"}}"#, "x".repeat(55));
    assert_eq!(answer_body.len(), 64);
    let step = m.on_response_body(answer_body.as_bytes(), &mut env)?;
    let req: CompleteRequest = serde_json::from_slice(call(&step).and_then(|c| c.body.as_deref()).unwrap_or_default())?;
    assert_eq!(req.result.body_b64, encode_body(answer_body.as_bytes()));
    Ok(())
}

#[test]
fn confirm_complete_not_acked_still_releases_the_answer() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    let mut m = forwarded(&mut env)?;
    m.on_response_head(&upstream(201, "via_upstream"), true, &mut env)?;
    let step = m.on_callout(&CalloutAnswer::failed(), &mut env)?;
    assert!(counted(&step, Counter::SidecarErrors));
    assert!(step.effects.contains(&Effect::ResumeResponse));
    Ok(())
}

#[test]
fn confirm_acquire_answers_become_replies() -> TestResult {
    let done = json!({"outcome": "DONE", "result": {"status": 201, "headers": [["location", "/t/1"]], "body_b64": encode_body(br#"{"id":"T-9"}"#)}});
    let cases = [
        (done, 201, "already_completed", Counter::Replayed),
        (
            json!({"outcome": "FAILED", "result": {"status": 402, "body_b64": ""}}),
            402,
            "already_failed",
            Counter::Replayed,
        ),
        (json!({"outcome": "IN_FLIGHT", "owner": OWNER}), 202, "in_progress", Counter::InProgress),
        (json!({"outcome": "NEEDS_REVIEW"}), 202, "needs_review", Counter::NeedsReview),
        (json!({"outcome": "PARAM_MISMATCH"}), 422, "params_changed", Counter::SecurityEvents),
        (json!({"outcome": "STORE_UNAVAILABLE"}), 503, "status_unavailable", Counter::SidecarErrors),
        (json!({"outcome": "REPLICATION_REFUSED"}), 503, "status_unavailable", Counter::SidecarErrors),
        (json!({"outcome": "ACQUIRED"}), 503, "status_unavailable", Counter::SidecarErrors),
    ];
    for (body, http, status, counter) in cases {
        let mut env = FixedEnv::at(999, NONCE);
        let (mut m, _) = acquiring(&mut env)?;
        let step = m.on_callout(&answer(200, body.clone()), &mut env)?;
        assert_eq!(reply_status(&step)?, (http, status.to_string()), "{body}");
        assert!(counted(&step, counter), "{body}: {counter:?}");
        assert!(!step.effects.contains(&Effect::ResumeRequest), "{body}");
        assert!(matches!(m, Machine::Pass));
    }
    Ok(())
}

/// What the confirm's non-replay answers carry for the agent to act on beyond their status word (survivors
/// of a mutation run over `confirm.rs`: nothing looked at these fields).
#[test]
fn confirm_answers_carry_what_the_agent_acts_on() -> TestResult {
    let retry_after_ms = ctx("confirm")?.config.defaults.retry_after_ms;
    let mut env = FixedEnv::at(999, NONCE);
    let (mut m, _) = acquiring(&mut env)?;
    let v = reply_json(&m.on_callout(&CalloutAnswer::failed(), &mut env)?)?;
    assert_eq!(v["status"], "status_unavailable", "{v}");
    assert_eq!(v["retry_after_ms"].as_u64(), Some(retry_after_ms), "{v}");
    assert!(v["instruction"].as_str().is_some_and(|i| i.contains("get_status")), "the status tool: {v}");
    let (mut m, _) = acquiring(&mut env)?;
    let v = reply_json(&m.on_callout(&answer(200, json!({"outcome": "NEEDS_REVIEW"})), &mut env)?)?;
    assert_eq!(v["poll_with"].as_str(), Some("get_status"), "{v}");
    let (mut m, _, mut env) = expired(5000)?;
    let gone = answer(404, json!({"error": "not_found", "reaped_possible": true}));
    let v = reply_json(&m.on_callout(&gone, &mut env)?)?;
    assert_eq!((v["status"].as_str(), v["operation"].as_str()), (Some("record_expired"), Some(KEY)), "{v}");
    Ok(())
}

#[test]
fn replays_carry_the_result_and_its_reference_and_in_progress_the_operation() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    let (mut m, _) = acquiring(&mut env)?;
    let done = json!({"outcome": "DONE", "result": {"status": 201, "body_b64": encode_body(br#"{"id":"T-9"}"#)}});
    let v = reply_json(&m.on_callout(&answer(200, done), &mut env)?)?;
    assert_eq!((v["result"]["id"].as_str(), v["result_ref"].as_str()), (Some("T-9"), Some("T-9")));
    let (mut m, _) = acquiring(&mut env)?;
    let v = reply_json(&m.on_callout(&answer(200, json!({"outcome": "IN_FLIGHT"})), &mut env)?)?;
    assert_eq!((v["operation"].as_str(), v["poll_with"].as_str()), (Some(KEY), Some("get_status")));
    let (mut m, _) = acquiring(&mut env)?;
    let v = reply_json(&m.on_callout(&answer(200, json!({"outcome": "NEEDS_REVIEW"})), &mut env)?)?;
    assert_eq!(v["operation"].as_str(), Some(KEY));
    assert!(v["instruction"].as_str().unwrap_or_default().contains(KEY));
    Ok(())
}

#[test]
fn a_replication_refusal_says_why_and_is_not_retried() -> TestResult {
    // An outage is retried after a wait; a refusal by the database's topology lasts until an operator
    // acts, so the agent is told the reason, no wait, and to stop: in both languages.
    let mut env = FixedEnv::at(999, NONCE);
    let (mut m, _) = acquiring(&mut env)?;
    let outage = reply_json(&m.on_callout(&answer(503, json!({"outcome": "STORE_UNAVAILABLE"})), &mut env)?)?;
    assert_eq!((outage["retryable"].as_bool(), outage["retry_after_ms"].is_u64()), (Some(true), true));
    for (lang, language) in [("en", crate::policy::Language::En), ("zh", crate::policy::Language::Zh)] {
        let c = Ctx { config: Rc::new(PluginConfig { language, ..(*config()?).clone() }), ..ctx("confirm")? };
        let (mut m, _) = Machine::start(c, &head(Some(token(1000)?)), false, &mut env);
        m.on_request_body(&body(json!(10)), &mut env)?;
        let step = m.on_callout(&answer(503, json!({"outcome": "REPLICATION_REFUSED"})), &mut env)?;
        let r = step.reply().ok_or("no reply")?;
        assert!(!r.headers.iter().any(|(k, _)| k == "retry-after"), "{lang}: {:?}", r.headers);
        let v = reply_json(&step)?;
        assert_eq!(v["status"].as_str(), Some("status_unavailable"), "{lang}");
        assert_eq!((v["retryable"].as_bool(), v.get("retry_after_ms")), (Some(false), None), "{lang}: {v}");
        assert_eq!(v["operation"].as_str(), Some(KEY), "{lang}");
        let (meaning, instruction) = (v["meaning"].as_str().unwrap_or(""), v["instruction"].as_str().unwrap_or(""));
        assert!(instruction.contains(KEY), "{lang}: the operator's reference: {instruction}");
        assert_ne!(meaning, outage["meaning"].as_str().unwrap_or(""), "{lang}: the reason is said");
        let why = if lang == "en" {
            ["replicates", "failover", "operator"]
        } else {
            ["复制", "故障切换", "运维人员"]
        };
        for word in why {
            assert!(meaning.contains(word), "{lang}: {word} in {meaning}");
        }
        assert!(!step.effects.contains(&Effect::ResumeRequest));
    }
    Ok(())
}

#[test]
fn replay_original_mode_sends_the_stored_answer() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    let c = Ctx { policy: policy("confirm", "original")?, ..ctx("confirm")? };
    let (mut m, _) = Machine::start(c, &head(Some(token(1000)?)), false, &mut env);
    m.on_request_body(&body(json!(10)), &mut env)?;
    let done = json!({"outcome": "DONE", "result": {"status": 201, "headers": [["content-type", "application/json"]], "body_b64": encode_body(br#"{"id":"T-9"}"#)}});
    let step = m.on_callout(&answer(200, done), &mut env)?;
    let r = step.reply().ok_or("no reply")?;
    assert_eq!((r.http_status, r.body.as_slice()), (201, br#"{"id":"T-9"}"#.as_slice()));
    assert!(r.headers.contains(&("idempotent-replayed".into(), "true".into())));
    Ok(())
}

#[test]
fn acquire_callout_failure_never_claims_nothing_ran() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    let (mut m, _) = acquiring(&mut env)?;
    let step = m.on_callout(&CalloutAnswer::failed(), &mut env)?;
    assert_eq!(reply_status(&step)?, (503, "status_unavailable".into()));
    let v = reply_json(&step)?;
    assert_eq!(v["retryable"], true);
    assert_eq!(v["operation"].as_str(), Some(KEY));
    Ok(())
}

// ---- confirm after expiry --------------------------------------------------

fn expired(now: u64) -> Result<(Machine, Step, FixedEnv), Box<dyn std::error::Error>> {
    let mut env = FixedEnv::at(now, NONCE);
    let (mut m, _) = Machine::start(ctx("confirm")?, &head(Some(token(1000)?)), false, &mut env);
    let step = m.on_request_body(&body(json!(10)), &mut env)?;
    Ok((m, step, env))
}

#[test]
fn expiry_boundary_is_exact() -> TestResult {
    let (_, step, _) = expired(999)?;
    assert_eq!(call(&step).map(|c| c.path.as_str()), Some("/v1/acquire"));
    let (_, step, _) = expired(1000)?;
    let c = call(&step).ok_or("no lookup")?;
    assert_eq!((c.method, c.path.clone()), ("GET", format!("/v1/operations/{KEY}?exp=1000")));
    assert!(counted(&step, Counter::ExpiredLookups));
    Ok(())
}

#[test]
fn expired_confirm_answers_from_what_exists() -> TestResult {
    let done = json!({"key": KEY, "state": "DONE", "scope": "pay", "subject_hash": "x", "param_hash": "y", "created_at_ms": 1, "updated_at_ms": 2,
        "result": {"status": 201, "body_b64": encode_body(br#"{"id":"T-1"}"#)}});
    let mut failed = done.clone();
    failed["state"] = json!("FAILED");
    failed["result"]["status"] = json!(402);
    let mut in_flight = done.clone();
    in_flight["state"] = json!("IN_FLIGHT");
    let mut review = done.clone();
    review["state"] = json!("NEEDS_REVIEW");
    let cases = [
        (answer(200, done), 201, "already_completed"),
        (answer(200, failed), 402, "already_failed"),
        (answer(200, in_flight), 202, "in_progress"),
        (answer(200, review), 202, "needs_review"),
        (answer(404, json!({"error": "not_found"})), 410, "fingerprint_expired"),
        // No row, and one may have been reaped: not "expired, never ran", but "gone, ask elsewhere".
        (answer(404, json!({"error": "not_found", "reaped_possible": true})), 410, "record_expired"),
        (answer(503, json!({"error": "store_unavailable"})), 503, "status_unavailable"),
        (CalloutAnswer::failed(), 503, "status_unavailable"),
        (answer(200, json!({"garbled": true})), 503, "status_unavailable"),
    ];
    for (a, http, status) in cases {
        let (mut m, _, mut env) = expired(5000)?;
        let step = m.on_callout(&a, &mut env)?;
        assert_eq!(reply_status(&step)?, (http, status.to_string()), "{a:?}");
        assert!(!step.effects.contains(&Effect::ResumeRequest));
        if status == "status_unavailable" {
            let v = reply_json(&step)?;
            assert!(!v["meaning"].as_str().unwrap_or_default().contains("Nothing was executed"));
        }
    }
    Ok(())
}

#[test]
fn expired_and_tampered_is_params_changed_without_a_lookup() -> TestResult {
    let mut env = FixedEnv::at(5000, NONCE);
    let (mut m, _) = Machine::start(ctx("confirm")?, &head(Some(token(1000)?)), false, &mut env);
    let step = m.on_request_body(&body(json!(11)), &mut env)?;
    assert_eq!(reply_status(&step)?, (422, "params_changed".into()));
    assert!(call(&step).is_none());
    assert!(step.effects.contains(&Effect::SecurityEvent { kind: "params_changed", nonce: KEY.into() }));
    Ok(())
}

// ---- refusals --------------------------------------------------------------

#[test]
fn refusals_before_anything_is_called() -> TestResult {
    let good = token(1000)?;
    let forged = format!("{}x", &good[..good.len() - 1]);
    let cases: Vec<(Option<String>, Vec<u8>, u16, &str)> = vec![
        (None, body(json!(10)), 428, "fingerprint_missing"),
        (Some(forged), body(json!(10)), 400, "fingerprint_invalid"),
        (Some(good.clone()), body(json!(10.01)), 422, "params_changed"),
        (Some(good.clone()), body(json!(true)), 400, "invalid_field"),
        (Some(good.clone()), b"{not json".to_vec(), 400, "invalid_json"),
        (Some(good.clone()), br#"{"amount":10,"amount":11}"#.to_vec(), 400, "invalid_json"),
    ];
    for (fp, b, http, status) in cases {
        let mut env = FixedEnv::at(999, NONCE);
        let (mut m, _) = Machine::start(ctx("confirm")?, &head(fp.clone()), false, &mut env);
        let step = m.on_request_body(&b, &mut env)?;
        assert_eq!(reply_status(&step)?, (http, status.to_string()), "{fp:?} {}", String::from_utf8_lossy(&b));
        assert!(call(&step).is_none());
        assert!(matches!(m, Machine::Pass));
    }
    Ok(())
}

#[test]
fn another_subject_is_forbidden_and_a_security_event() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    let h = RequestHead { subject: Some("mallory".into()), ..head(Some(token(1000)?)) };
    let (mut m, _) = Machine::start(ctx("confirm")?, &h, false, &mut env);
    let step = m.on_request_body(&body(json!(10)), &mut env)?;
    assert_eq!(reply_status(&step)?, (403, "forbidden".into()));
    assert!(counted(&step, Counter::SecurityEvents));
    Ok(())
}

/// Every security event is counted by kind and reported to idemd's audit without a callout
/// the stream waits for (DESIGN §8); the refusal goes out in the same step.
#[test]
fn security_events_are_counted_by_kind_and_reported_without_waiting() -> TestResult {
    let good = token(1000)?;
    let signed_by = |kid: &str, secret: &str| -> Result<String, Box<dyn std::error::Error>> {
        let ring = Keyring::new(vec![Key { kid: kid.into(), secret: secret.as_bytes().to_vec() }], kid)?;
        let p =
            canonical::param_hash(&json!({"amount": 10, "currency": "EUR"}), &policy("confirm", "envelope")?.bound)?;
        Ok(mint(&ring, NONCE, 1000, &subject_hash("alice"), "pay", &p))
    };
    // Right shape, right kid, another key: a forgery. A key id nobody configured: unknown.
    let forged = signed_by("k1", "another-secret-0123456789abcdef-0123")?;
    let unknown_kid = signed_by("k9", SECRET)?;
    let cases = [
        ("alice", good.clone(), json!(10.01), Counter::SecurityParamsChanged, "params_changed", Some(KEY)),
        ("mallory", good.clone(), json!(10), Counter::SecurityCrossSubject, "cross_subject", Some(KEY)),
        ("alice", forged, json!(10), Counter::SecurityBadSignature, "bad_signature", None),
        ("alice", unknown_kid, json!(10), Counter::SecurityUnknownKid, "unknown_kid", None),
    ];
    for (who, fp, amount, counter, kind, key) in cases {
        let mut env = FixedEnv::at(999, NONCE);
        let h = RequestHead { subject: Some(who.into()), ..head(Some(fp)) };
        let (mut m, _) = Machine::start(ctx("confirm")?, &h, false, &mut env);
        let step = m.on_request_body(&body(amount), &mut env)?;
        assert!(step.reply().is_some() && call(&step).is_none(), "{kind}: refused at once");
        assert!(counted(&step, Counter::SecurityEvents) && counted(&step, counter), "{kind}");
        let report = step.effects.iter().find_map(|e| match e {
            Effect::Report(c) => Some(c.clone()),
            _ => None,
        });
        let report = report.ok_or_else(|| format!("{kind}: not reported"))?;
        assert_eq!((report.method, report.path.as_str()), ("POST", "/v1/security-events"));
        let v: Value = serde_json::from_slice(report.body.as_deref().unwrap_or_default())?;
        assert_eq!((v["kind"].as_str(), v["scope"].as_str(), v["key"].as_str()), (Some(kind), Some("pay"), key), "{v}");
        assert_eq!(v["subject_hash"].as_str(), Some(subject_hash(who).as_str()));
        assert!(!v.to_string().contains("amount"), "never the body: {v}");
    }
    Ok(())
}

#[test]
fn no_subject_or_declared_oversize_is_refused_at_the_head() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    let h = RequestHead { subject: None, ..head(None) };
    let (m, step) = Machine::start(ctx("confirm")?, &h, false, &mut env);
    assert_eq!(reply_status(&step)?, (401, "unauthenticated".into()));
    assert!(matches!(m, Machine::Pass));
    let h = RequestHead { content_length: Some(65_537), ..head(None) };
    let (_, step) = Machine::start(ctx("confirm")?, &h, false, &mut env);
    assert_eq!(reply_status(&step)?, (413, "body_too_large".into()));
    Ok(())
}

#[test]
fn body_in_several_chunks_is_held_then_read_once() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    let (mut m, _) = Machine::start(ctx("confirm")?, &head(Some(token(1000)?)), false, &mut env);
    assert_eq!(m.on_request_data(10, false), Step::pause());
    assert_eq!(m.on_request_data(20, false), Step::pause());
    assert_eq!(m.on_request_data(30, true), Step::need_body());
    let step = m.on_request_data(65_537, false);
    assert_eq!(reply_status(&step)?, (413, "body_too_large".into()));
    assert!(matches!(m, Machine::Pass));
    Ok(())
}

// ---- impossible events -----------------------------------------------------

#[test]
fn events_in_the_wrong_phase_are_errors_and_change_nothing() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    let (mut m, _) = Machine::start(ctx("confirm")?, &head(Some(token(1000)?)), false, &mut env);
    // The error names the event and the phase, for the host's log line.
    let err = m.on_callout(&CalloutAnswer::failed(), &mut env).err();
    assert_eq!(err.map(|e| (e.event, e.phase)), Some(("callout", "confirm.await_body")));
    assert_eq!(err.map(|e| e.to_string()).as_deref(), Some("event callout in phase confirm.await_body"));
    assert!(m.on_response_body(b"{}", &mut env).is_err());
    assert!(m.on_response_head(&upstream(201, "via_upstream"), false, &mut env).is_err());
    // Still waiting for its body.
    assert_eq!(call(&m.on_request_body(&body(json!(10)), &mut env)?).map(|c| c.path.as_str()), Some("/v1/acquire"));
    assert!(m.on_request_body(&body(json!(10)), &mut env).is_err());
    let mut pass = Machine::Pass;
    assert!(pass.on_request_body(b"{}", &mut env).is_err());
    assert!(pass.on_callout(&CalloutAnswer::failed(), &mut env).is_err());
    assert_eq!(pass.on_request_data(10, true), Step::go_on());
    assert_eq!(pass.on_response_head(&upstream(200, "via_upstream"), true, &mut env)?, Step::go_on());
    let mut preview = Machine::start(ctx("preview")?, &head(None), false, &mut env).0;
    assert!(preview.on_callout(&CalloutAnswer::failed(), &mut env).is_err());
    Ok(())
}

// ---- preview ---------------------------------------------------------------

#[test]
fn preview_mints_into_a_successful_json_answer() -> TestResult {
    let mut env = FixedEnv::at(100, NONCE);
    let (mut m, step) = Machine::start(ctx("preview")?, &head(None), false, &mut env);
    assert!(!step.effects.contains(&Effect::RemoveRequestHeader(IDEMPOTENCY_KEY_HEADER)));
    assert_eq!(m.on_request_body(&body(json!(10)), &mut env)?, Step::go_on());
    let step = m.on_response_head(&upstream(200, "via_upstream"), false, &mut env)?;
    assert!(counted(&step, Counter::Minted));
    assert_eq!(step.flow, Flow::Pause);
    assert_eq!(m.on_response_data(5, false)?, Step::pause());
    assert_eq!(m.on_response_data(10, true)?, Step::need_body());
    let step = m.on_response_body(br#"{"quote":1}"#, &mut env)?;
    let v: Value = serde_json::from_slice(&replaced_body(&step).ok_or("no body")?)?;
    assert_eq!(v["quote"], 1);
    assert_eq!(v["fingerprint_expires_at"], 100 + 900);
    // The minted token confirms with these very fields.
    let fp = v["fingerprint"].as_str().ok_or("no fingerprint")?.to_string();
    let (mut c, _) = Machine::start(ctx("confirm")?, &head(Some(fp)), false, &mut env);
    assert_eq!(call(&c.on_request_body(&body(json!("10.0")), &mut env)?).map(|c| c.path.as_str()), Some("/v1/acquire"));
    Ok(())
}

/// Binding outside the body (DESIGN §3): a route's template parameter, a named query parameter
/// and a header are bound like body fields. A fingerprint minted for account A's quote is refused
/// on account B's path with the same body, as it is with another tenant header or currency; a
/// bound value sent twice (in any spelling a reader takes for it) is a 400; a path that does not
/// fit the route's template is never forwarded.
#[test]
fn values_outside_the_body_are_bound_like_body_fields() -> TestResult {
    let bind = ("bind", "path:account, query:currency, header:x-tenant, /amount:decimal");
    let route = |role: &str, template: &str| -> Result<Ctx, Box<dyn std::error::Error>> {
        let mut leaves = vec![("role", role), ("scope", "pay"), ("template", template), bind];
        if role == "confirm" {
            leaves.push(("upstream_keys", "honoured"));
        }
        Ok(testing::ctx(&config()?, &testing::route(&leaves)?, "trace-1"))
    };
    let preview = || route("preview", "/v1/accounts/{account}/quotes");
    let confirm = || route("confirm", "/v1/accounts/{account}/transfers");
    let on = |path: &str, tenant: &[&str], fp: Option<String>| {
        let mut h = head(fp);
        h.path = path.to_string();
        h.headers = tenant.iter().map(|t| ("x-tenant".to_string(), t.as_bytes().to_vec())).collect();
        h
    };
    // The preview reads the path and the headers only because the route binds them.
    let needs = HeadNeeds::for_policy(&preview()?.policy);
    assert!(needs.path && needs.headers && !HeadNeeds::for_role(Role::Preview).path);
    let mut env = FixedEnv::at(100, NONCE);
    let (mut m, _) =
        Machine::start(preview()?, &on("/v1/accounts/A/quotes?currency=EUR", &["t1"], None), false, &mut env);
    assert_eq!(m.on_request_body(&body(json!(10)), &mut env)?, Step::go_on());
    let step = m.on_response_head(&upstream(200, "via_upstream"), false, &mut env)?;
    assert!(counted(&step, Counter::Minted));
    m.on_response_data(2, true)?;
    let v: Value = serde_json::from_slice(&replaced_body(&m.on_response_body(b"{}", &mut env)?).ok_or("no body")?)?;
    let fp = v["fingerprint"].as_str().ok_or("no fingerprint")?.to_string();
    let confirm_at = |path: &str, tenant: &[&str]| -> Result<Step, Box<dyn std::error::Error>> {
        let mut env = FixedEnv::at(200, NONCE);
        let (mut c, first) = Machine::start(confirm()?, &on(path, tenant, Some(fp.clone())), false, &mut env);
        if first.reply().is_some() {
            return Ok(first);
        }
        Ok(c.on_request_body(&body(json!("10.00")), &mut env)?)
    };
    // The same account, currency and tenant: acquired.
    let same = confirm_at("/v1/accounts/A/transfers?currency=EUR", &["t1"])?;
    assert_eq!(call(&same).map(|c| c.path.as_str()), Some("/v1/acquire"));
    // Account B's path, another currency, another tenant, a value dropped: the same body, refused.
    for (path, tenant) in [
        ("/v1/accounts/B/transfers?currency=EUR", &["t1"][..]),
        ("/v1/accounts/A/transfers?currency=USD", &["t1"][..]),
        ("/v1/accounts/A/transfers", &["t1"][..]),
        ("/v1/accounts/A/transfers?currency=EUR", &["t2"][..]),
        ("/v1/accounts/A/transfers?currency=EUR", &[][..]),
    ] {
        let step = confirm_at(path, tenant)?;
        assert_eq!(reply_status(&step)?, (422, "params_changed".into()), "{path} {tenant:?}");
        assert!(call(&step).is_none() && counted(&step, Counter::RejectedParams));
    }
    // Sent twice, or in a second spelling: which one the upstream reads is not ours to guess.
    for (path, tenant) in [
        ("/v1/accounts/A/transfers?currency=EUR&currency=USD", &["t1"][..]),
        ("/v1/accounts/A/transfers?currency=EUR&Curr%65ncy=USD", &["t1"][..]),
        ("/v1/accounts/A/transfers?currency=EUR", &["t1", "t2"][..]),
    ] {
        let step = confirm_at(path, tenant)?;
        let (http, status) = reply_status(&step)?;
        assert_eq!((http, status.as_str()), (400, "invalid_field"), "{path} {tenant:?}");
        assert!(reply_json(&step)?.to_string().contains("sent more than once"), "{path}");
    }
    let mut underscored = on("/v1/accounts/A/transfers?currency=EUR", &["t1"], Some(fp.clone()));
    underscored.headers.push(("x_tenant".into(), b"t2".to_vec()));
    let (_, step) = Machine::start(confirm()?, &underscored, false, &mut FixedEnv::at(200, NONCE));
    assert_eq!(reply_status(&step)?.0, 400, "x_tenant is x-tenant to a CGI-style upstream");
    // A path the template does not fit: the annotation and the route disagree; nothing forwarded.
    let step = confirm_at("/v1/other/A/transfers", &["t1"])?;
    assert_eq!(reply_status(&step)?.0, 503);
    assert!(counted(&step, Counter::RejectedMisconfigured) && call(&step).is_none());
    Ok(())
}

/// An answer of known length streams: its headers go on at once with the grown length, every
/// chunk is read, only the last is rewritten, and the answer is what the held splice would give
/// less the order of its fields.
/// On an MCP route too, a body over the limit is refused as it arrives, with a JSON-RPC error
/// (every answer there is JSON-RPC), and the rest of the stream passes nothing on.
#[test]
fn an_mcp_body_over_the_limit_is_refused_before_it_is_read() -> TestResult {
    let mut env = FixedEnv::at(100, NONCE);
    let (mut m, _) = Machine::start(mcp_ctx()?, &head(None), false, &mut env);
    let limit = mcp_ctx()?.config.max_body_bytes;
    assert_eq!(m.on_request_data(limit, false).flow, Flow::Pause, "up to the limit it is held");
    let step = m.on_request_data(limit + 1, false);
    let r = step.reply().ok_or("no reply")?;
    let v: Value = serde_json::from_slice(&r.body)?;
    assert_eq!((r.http_status, v["error"]["code"].as_i64()), (413, Some(-32600)), "{v}");
    assert!(matches!(m, Machine::Pass) && call(&step).is_none());
    Ok(())
}

#[test]
fn a_preview_body_over_the_limit_is_refused_before_it_is_read() -> TestResult {
    let mut env = FixedEnv::at(100, NONCE);
    let (mut m, _) = Machine::start(ctx("preview")?, &head(None), false, &mut env);
    let limit = ctx("preview")?.config.max_body_bytes;
    assert_eq!(reply_status(&m.on_request_data(limit + 1, false))?, (413, "body_too_large".into()));
    assert!(matches!(m, Machine::Pass));
    Ok(())
}

#[test]
fn a_preview_answer_of_known_length_streams_with_the_fingerprint_spliced() -> TestResult {
    let mut env = FixedEnv::at(100, NONCE);
    let (mut m, _) = Machine::start(ctx("preview")?, &head(None), false, &mut env);
    assert!(!m.response_needs_framing(), "nothing forwarded yet: the hosts read no framing");
    m.on_request_body(&body(json!(10)), &mut env)?;
    assert!(m.response_needs_framing());
    let answer = br#"{"quote":1,"payee":{"id":"p-9"}}"#;
    let sized = ResponseHead { content_length: Some(answer.len() as u64), ..upstream(200, "via_upstream") };
    let step = m.on_response_head(&sized, false, &mut env)?;
    assert!(counted(&step, Counter::Minted));
    assert_eq!(step.flow, Flow::Continue, "the answer's headers are not held");
    assert!(!step.effects.contains(&Effect::RemoveResponseHeader("content-length")));
    let grown = step
        .effects
        .iter()
        .find_map(|e| match e {
            Effect::SetResponseHeader(n, v) if n == "content-length" => v.parse::<usize>().ok(),
            _ => None,
        })
        .ok_or("no new length")?;
    // Three chunks: a plain middle one, one that ends in a brace (held back: it may close the
    // object), and the last.
    let (first, rest) = answer.split_at(20);
    let (second, rest) = rest.split_at(rest.len() - 1);
    assert!(second.ends_with(b"}") && rest == b"}");
    assert_eq!(m.on_response_data(first.len(), false)?, Step::need_body());
    assert_eq!(m.on_response_body(first, &mut env)?, Step::go_on(), "a middle chunk goes on as it is");
    assert_eq!(m.on_response_data(second.len(), false)?, Step::need_body());
    let step = m.on_response_body(second, &mut env)?;
    let second = replaced_body(&step).ok_or("the brace is not held back")?;
    assert_eq!(second, &answer[20..answer.len() - 2]);
    assert_eq!(m.on_response_data(rest.len(), false)?, Step::need_body());
    let step = m.on_response_body(rest, &mut env)?;
    assert_eq!(step.flow, Flow::Continue);
    let last = replaced_body(&step).ok_or("the last chunk is not rewritten")?;
    let whole = [first, &second[..], &last[..]].concat();
    assert_eq!(whole.len(), grown);
    let v: Value = serde_json::from_slice(&whole)?;
    assert_eq!((v["quote"].as_i64(), v["payee"]["id"].as_str()), (Some(1), Some("p-9")));
    assert_eq!(v["fingerprint_expires_at"], 100 + 900);
    let fp = v["fingerprint"].as_str().ok_or("no fingerprint")?.to_string();
    assert!(matches!(m, Machine::Pass), "the stream is done with");
    let (mut c, _) = Machine::start(ctx("confirm")?, &head(Some(fp)), false, &mut env);
    assert_eq!(call(&c.on_request_body(&body(json!("10.0")), &mut env)?).map(|c| c.path.as_str()), Some("/v1/acquire"));
    Ok(())
}

/// A declared length of 0 whose end comes in a later, empty frame (HTTP/2 allows it): there is no
/// object to splice into, so the answer is held and its length never promised.
#[test]
fn a_preview_answer_declared_empty_is_held_not_streamed() -> TestResult {
    let mut env = FixedEnv::at(100, NONCE);
    let (mut m, _) = Machine::start(ctx("preview")?, &head(None), false, &mut env);
    m.on_request_body(&body(json!(10)), &mut env)?;
    let empty = ResponseHead { content_length: Some(0), ..upstream(200, "via_upstream") };
    let step = m.on_response_head(&empty, false, &mut env)?;
    assert_eq!(step.flow, Flow::Pause, "held: {step:?}");
    assert!(step.effects.contains(&Effect::RemoveResponseHeader("content-length")), "{step:?}");
    assert!(
        !step.effects.iter().any(|e| matches!(e, Effect::SetResponseHeader(n, _) if n == "content-length")),
        "a length is promised: {step:?}"
    );
    Ok(())
}

/// An upstream answer that names a fingerprint field itself is never given a second one: the
/// streamed answer gets spaces (the fingerprint is in its header), and that route's answers are
/// held from then on, where the held splice replaces the field. An encoded answer goes on untouched.
#[test]
fn a_preview_answer_that_names_the_field_is_held_from_then_on_and_an_encoded_one_is_untouched() -> TestResult {
    let policy_ctx = ctx("preview")?;
    let theirs = br#"{"quote":1,"card":{"fingerprint":"c-1"}}"#;
    let sized = ResponseHead { content_length: Some(theirs.len() as u64), ..upstream(200, "via_upstream") };
    let mut env = FixedEnv::at(100, NONCE);
    let (mut m, _) = Machine::start(policy_ctx.clone(), &head(None), false, &mut env);
    m.on_request_body(&body(json!(10)), &mut env)?;
    assert_eq!(m.on_response_head(&sized, false, &mut env)?.flow, Flow::Continue);
    m.on_response_data(theirs.len(), true)?;
    let step = m.on_response_body(theirs, &mut env)?;
    let out = replaced_body(&step).ok_or("no last chunk")?;
    assert_eq!(serde_json::from_slice::<Value>(&out)?, serde_json::from_slice::<Value>(theirs)?);
    assert!(step.effects.iter().any(|e| matches!(e, Effect::Warn(w) if w.contains("held"))));
    assert!(policy_ctx.policy.answers_named_fingerprint.get());
    // The next preview on the route: held, and the field replaced at the top level only.
    let (mut m, _) = Machine::start(policy_ctx.clone(), &head(None), false, &mut env);
    m.on_request_body(&body(json!(10)), &mut env)?;
    let step = m.on_response_head(&sized, false, &mut env)?;
    assert_eq!(step.flow, Flow::Pause);
    assert!(step.effects.contains(&Effect::RemoveResponseHeader("content-length")));
    assert_eq!(m.on_response_data(theirs.len(), true)?, Step::need_body());
    let step = m.on_response_body(theirs, &mut env)?;
    let held = replaced_body(&step).ok_or("not spliced")?;
    let v: Value = serde_json::from_slice(&held)?;
    assert!(v["fingerprint"].as_str().is_some_and(|f| f.contains('.')));
    assert_eq!(v["card"]["fingerprint"], "c-1");
    // Compressed bytes: the fingerprint in the header, the body as sent, nothing held.
    let mut env = FixedEnv::at(100, NONCE);
    let (mut m, _) = Machine::start(ctx("preview")?, &head(None), false, &mut env);
    m.on_request_body(&body(json!(10)), &mut env)?;
    let gzip = ResponseHead { content_encoding: Some("gzip".into()), ..sized };
    let step = m.on_response_head(&gzip, false, &mut env)?;
    assert!(counted(&step, Counter::Minted));
    assert_eq!(step.flow, Flow::Continue);
    assert!(!step.effects.iter().any(|e| matches!(e, Effect::SetResponseHeader(n, _) if n == "content-length")));
    assert!(matches!(m, Machine::Pass));
    Ok(())
}

/// The body a step puts in place of the answer's (or of the chunk in hand).
fn replaced_body(step: &Step) -> Option<Vec<u8>> {
    step.effects.iter().find_map(|e| match e {
        Effect::ReplaceResponseBody(b) => Some(b.clone()),
        _ => None,
    })
}

/// A preview route whose quote states its expiry (`quote_expires`).
fn quoting_ctx(quote_expires: &str) -> Result<Ctx, Box<dyn std::error::Error>> {
    let leaves = [
        ("role", "preview"),
        ("scope", "pay"),
        ("bind", "/amount:decimal, /currency"),
        ("quote_expires", quote_expires),
    ];
    Ok(testing::ctx(&config()?, &testing::route(&leaves)?, "trace-1"))
}

/// The fingerprint's `exp` never outlives the quote (DESIGN §3): `min(now + ttl, the quote's expiry)`,
/// and an answer whose expiry is missing, unreadable or past gets no fingerprint at all.
#[test]
fn a_fingerprint_never_outlives_the_quote() -> TestResult {
    for (quote_body, want) in [
        (json!({"quote": 1, "expires_at": 160}), Some(160)),
        (json!({"quote": 1, "expires_at": "1970-01-01T00:03:00Z"}), Some(180)),
        (json!({"quote": 1, "expires_at": 5000}), Some(100 + 900)),
        (json!({"quote": 1}), None),
        (json!({"quote": 1, "expires_at": "soon"}), None),
        (json!({"quote": 1, "expires_at": 100}), None),
    ] {
        let mut env = FixedEnv::at(100, NONCE);
        let (mut m, _) = Machine::start(quoting_ctx("/expires_at")?, &head(None), false, &mut env);
        m.on_request_body(&body(json!(10)), &mut env)?;
        let step = m.on_response_head(&upstream(200, "via_upstream"), false, &mut env)?;
        assert!(!counted(&step, Counter::Minted) && step.flow == Flow::Pause, "minted only once the quote is read");
        let bytes = quote_body.to_string().into_bytes();
        assert_eq!(m.on_response_data(bytes.len(), true)?, Step::need_body());
        let step = m.on_response_body(&bytes, &mut env)?;
        match want {
            Some(exp) => {
                assert!(counted(&step, Counter::Minted), "{quote_body}");
                let header = Effect::SetResponseHeader(
                    crate::machine::preview::FINGERPRINT_EXPIRES_HEADER.into(),
                    exp.to_string(),
                );
                assert!(step.effects.contains(&header), "{quote_body}: {:?}", step.effects);
            }
            None => {
                let r = rewritten(&step).ok_or("no rewrite")?;
                let v: Value = serde_json::from_slice(&r.body)?;
                assert_eq!((r.http_status, v["status"].as_str()), (502, Some("quote_unusable")), "{quote_body}");
                assert!(!counted(&step, Counter::Minted));
            }
        }
        assert!(matches!(m, Machine::Pass));
    }
    // The expiry is to be read from a body that is not coming: refused at once, nothing to confirm.
    let mut env = FixedEnv::at(100, NONCE);
    let (mut m, _) = Machine::start(quoting_ctx("/expires_at")?, &head(None), false, &mut env);
    m.on_request_body(&body(json!(10)), &mut env)?;
    let step = m.on_response_head(&upstream(200, "via_upstream"), true, &mut env)?;
    let v = reply_json(&step)?;
    assert_eq!((step.reply().map(|r| r.http_status), v["status"].as_str()), (Some(502), Some("quote_unusable")));
    assert!(!counted(&step, Counter::Minted) && matches!(m, Machine::Pass));
    // The expiry in a header: read with the head, minted at once.
    let mut env = FixedEnv::at(100, NONCE);
    let (mut m, _) = Machine::start(quoting_ctx("header:quote-expires-at")?, &head(None), false, &mut env);
    m.on_request_body(&body(json!(10)), &mut env)?;
    assert!(m.response_needs_headers());
    let mut h = upstream(200, "via_upstream");
    h.headers.push(("Quote-Expires-At".into(), "150".into()));
    let step = m.on_response_head(&h, false, &mut env)?;
    let header = Effect::SetResponseHeader(crate::machine::preview::FINGERPRINT_EXPIRES_HEADER.into(), "150".into());
    assert!(counted(&step, Counter::Minted) && step.effects.contains(&header), "{:?}", step.effects);
    // Only a preview states a quote.
    let leaves = [("role", "confirm"), ("scope", "pay"), ("quote_expires", "/x")];
    let get = |k: &str| leaves.iter().find(|(key, _)| *key == k).map(|(_, v)| LeafValue::Str((*v).to_string()));
    assert!(parse_route_policy(&get, &RouteDefaults::default()).is_err());
    Ok(())
}

/// The body effects a step asks for (a body can only be replaced from a body callback: asked
/// for in a headers callback, the `.wasm`'s host call failed and the SDK panicked the VM).
fn touches_body(step: &Step) -> bool {
    step.effects.iter().any(|e| matches!(e, Effect::Rewrite(_) | Effect::ReplaceResponseBody(_)))
}

/// A quote header that is past, unreadable, not text or missing, read with the
/// answer's head. The answer is held and replaced once whole (`quote_unusable`), never from the
/// headers callback; an answer with no body is answered locally. Two copies of the header
/// (+600 s and +2 s) are refused, never one picked, in either order.
#[test]
fn an_unusable_or_repeated_quote_header_holds_the_answer_and_replaces_it_whole() -> TestResult {
    let header = |v: &[u8]| ("Quote-Expires-At".to_string(), v.to_vec());
    type Headers = Vec<(String, Vec<u8>)>;
    let cases: Vec<(&str, Headers)> = vec![
        ("past", vec![header(b"90")]),
        ("now", vec![header(b"100")]),
        ("unparseable", vec![header(b"soon")]),
        ("not text", vec![header(&[0xE9, 0xFF])]),
        ("missing", vec![]),
        ("repeated, long first", vec![header(b"700"), header(b"102")]),
        ("repeated, short first", vec![header(b"102"), header(b"700")]),
        ("repeated, same", vec![header(b"700"), header(b"700")]),
    ];
    for (what, quote) in cases {
        for end_of_stream in [false, true] {
            let mut env = FixedEnv::at(100, NONCE);
            let (mut m, _) = Machine::start(quoting_ctx("header:quote-expires-at")?, &head(None), false, &mut env);
            m.on_request_body(&body(json!(10)), &mut env)?;
            let mut raw =
                vec![(":status".to_string(), b"200".to_vec()), ("content-type".into(), b"application/json".to_vec())];
            raw.extend(quote.clone());
            let h = ResponseHead::from_headers(&raw, m.response_needs_headers(), m.response_needs_framing());
            let step = m.on_response_head(&h, end_of_stream, &mut env)?;
            assert!(!counted(&step, Counter::Minted), "{what}: minted");
            assert!(!touches_body(&step), "{what}: the body is replaced from the headers callback: {step:?}");
            let reply = if end_of_stream {
                // No body to replace: a local reply takes the answer's place.
                step.reply().cloned().ok_or(format!("{what}: no reply"))?
            } else {
                assert_eq!(step.flow, Flow::Pause, "{what}: the answer is held");
                assert!(step.effects.contains(&Effect::RemoveResponseHeader("content-length")), "{what}");
                assert_eq!(m.on_response_data(20, true)?, Step::need_body(), "{what}");
                let step = m.on_response_body(br#"{"quote":1}"#, &mut env)?;
                rewritten(&step).cloned().ok_or(format!("{what}: no rewrite"))?
            };
            let v: Value = serde_json::from_slice(&reply.body)?;
            assert_eq!((reply.http_status, v["status"].as_str()), (502, Some("quote_unusable")), "{what}: {v}");
            assert!(matches!(m, Machine::Pass), "{what}");
        }
    }
    // One copy, in time: minted at once, as ever.
    let mut env = FixedEnv::at(100, NONCE);
    let (mut m, _) = Machine::start(quoting_ctx("header:quote-expires-at")?, &head(None), false, &mut env);
    m.on_request_body(&body(json!(10)), &mut env)?;
    let raw = vec![
        (":status".to_string(), b"200".to_vec()),
        ("content-type".into(), b"application/json".to_vec()),
        header(b"700"),
    ];
    let h = ResponseHead::from_headers(&raw, true, true);
    assert!(counted(&m.on_response_head(&h, false, &mut env)?, Counter::Minted));
    Ok(())
}

/// The answer's head as core reads it from the bytes a host hands over: a header the guard reads
/// that came twice and disagrees is no value at all; values that are not text are noted.
#[test]
fn the_answer_head_picks_no_copy_of_a_header_the_guard_reads() {
    let raw = |list: &[(&str, &[u8])]| -> Vec<(String, Vec<u8>)> {
        list.iter().map(|(k, v)| ((*k).to_string(), v.to_vec())).collect()
    };
    let h = ResponseHead::from_headers(
        &raw(&[(":status", b"200"), ("content-type", b"application/json"), ("content-type", b"text/html")]),
        true,
        true,
    );
    assert_eq!(h.content_type, None);
    let h = ResponseHead::from_headers(
        &raw(&[(":status", b"200"), ("content-length", b"10"), ("content-length", b"12"), ("x", &[0xff])]),
        true,
        true,
    );
    assert_eq!((h.status, h.content_length), (200, None));
    assert_eq!(h.not_text, vec!["x".to_string()]);
    assert!(h.values("x").is_none());
    // One length, or copies that agree, is the length; no coding is none, several are one list.
    for lengths in [&[&b"10"[..]][..], &[b"10", b"10"]] {
        let list: Vec<(&str, &[u8])> = lengths.iter().map(|l| ("content-length", *l)).collect();
        assert_eq!(ResponseHead::from_headers(&raw(&list), false, true).content_length, Some(10), "{lengths:?}");
    }
    let coded = |codings: &[&[u8]]| {
        let list: Vec<(&str, &[u8])> = codings.iter().map(|c| ("content-encoding", *c)).collect();
        ResponseHead::from_headers(&raw(&list), false, true).content_encoding
    };
    assert_eq!(coded(&[]), None);
    assert_eq!(coded(&[b"gzip", b"br"]).as_deref(), Some("gzip, br"));
    // Without the full map, the answer is one attempt (Envoy's count is read only with it).
    assert_eq!(ResponseHead::from_headers(&raw(&[(":status", b"200")]), false, false).attempts, 1);
    let twice = vec![("retry-after".to_string(), "7".to_string()), ("retry-after".to_string(), "3600".to_string())];
    assert_eq!(retry_after_ms(&twice), None);
    assert_eq!(retry_after_ms(&twice[..1]), Some(7000));
}

/// A header value that is not UTF-8. One the guard reads (the subject, the fingerprint,
/// a client's key, the MCP headers) is a 400 before anything is read or forwarded; one it does
/// not read (the request id, the trace context) decides nothing and is as if absent.
#[test]
fn a_header_value_that_is_not_text_is_refused_where_the_guard_reads_it_and_ignored_elsewhere() -> TestResult {
    let bytes = |list: &[(&str, &[u8])]| -> Vec<(String, Vec<u8>)> {
        list.iter().map(|(k, v)| ((*k).to_string(), v.to_vec())).collect()
    };
    let bad: &[u8] = &[0xE9, 0xFF];
    let confirm = HeadNeeds::for_role(Role::Confirm);
    let subject = Some("x-agent-subject");
    for (name, label) in [
        ("x-agent-subject", SUBJECT_HEADER_LABEL),
        ("agent-fingerprint", FINGERPRINT_HEADER),
        ("idempotency-key", IDEMPOTENCY_KEY_HEADER),
    ] {
        let mut list: Vec<(&str, &[u8])> = vec![("x-agent-subject", b"alice")];
        list.retain(|(k, _)| *k != name);
        list.push((name, bad));
        let h = RequestHead::from_headers(&bytes(&list), confirm, subject);
        assert_eq!(h.not_text, Some(label), "{name}");
        let mut env = FixedEnv::at(999, NONCE);
        let (m, step) = Machine::start(ctx("confirm")?, &h, false, &mut env);
        let r = step.reply().ok_or(format!("{name}: no reply"))?;
        assert_eq!(r.http_status, 400, "{name}");
        // In the words of what the header carries, as a repeated one is.
        let word = match label {
            FINGERPRINT_HEADER => "fingerprint_invalid",
            IDEMPOTENCY_KEY_HEADER => "idempotency_key_invalid",
            _ => "invalid_header",
        };
        assert_eq!(serde_json::from_slice::<Value>(&r.body)?["status"], word, "{name}");
        assert!(counted(&step, Counter::RejectedHeader) && matches!(m, Machine::Pass), "{name}");
        assert!(!step.effects.iter().any(|e| matches!(e, Effect::Call(_) | Effect::ResumeRequest)), "{name}");
    }
    let mcp = HeadNeeds::for_role(Role::Mcp);
    for name in [MCP_METHOD_HEADER, MCP_NAME_HEADER] {
        assert_eq!(RequestHead::from_headers(&bytes(&[(name, bad)]), mcp, None).not_text, Some(name));
    }
    // Not the guard's: never refused, never read.
    for name in ["x-request-id", "traceparent", "tracestate", "content-length", "x-anything"] {
        let h = RequestHead::from_headers(&bytes(&[("x-agent-subject", b"alice"), (name, bad)]), confirm, subject);
        assert_eq!((h.not_text, h.repeated, h.content_length), (None, None, None), "{name}");
        assert!(!h.trace.id.contains('\u{fffd}'), "{name}");
        let mut env = FixedEnv::at(999, NONCE);
        let (_, step) = Machine::start(ctx("confirm")?, &h, false, &mut env);
        assert!(step.reply().is_none(), "{name}: refused");
    }
    // A preview reads no key: a client's odd key there is nobody's business.
    let preview = HeadNeeds::for_role(Role::Preview);
    let h =
        RequestHead::from_headers(&bytes(&[("x-agent-subject", b"alice"), ("idempotency-key", bad)]), preview, subject);
    assert_eq!(h.not_text, None);
    Ok(())
}

#[test]
fn preview_failure_or_non_json_mints_nothing() -> TestResult {
    for (status, ct) in [(500, "application/json"), (200, "text/html")] {
        let mut env = FixedEnv::at(100, NONCE);
        let (mut m, _) = Machine::start(ctx("preview")?, &head(None), false, &mut env);
        m.on_request_body(&body(json!(10)), &mut env)?;
        let h = ResponseHead { status, content_type: Some(ct.into()), ..Default::default() };
        let step = m.on_response_head(&h, false, &mut env)?;
        assert_eq!(step, Step::go_on());
        assert!(matches!(m, Machine::Pass));
    }
    Ok(())
}

// ---- status ----------------------------------------------------------------

#[test]
fn status_reports_what_exists_and_what_never_ran() -> TestResult {
    let fp = token(1000)?;
    let done = json!({"key": KEY, "state": "DONE", "scope": "pay", "subject_hash": "x", "param_hash": "y", "created_at_ms": 1, "updated_at_ms": 2,
        "result": {"status": 201, "body_b64": encode_body(br#"{"id":"T-1"}"#)}});
    let cases = [
        (999, answer(200, done), 200, "already_completed"),
        (999, answer(404, json!({})), 200, "not_executed"),
        (1000, answer(404, json!({})), 410, "fingerprint_expired"),
        (1000, answer(404, json!({"error": "not_found", "reaped_possible": true})), 410, "record_expired"),
        (999, CalloutAnswer::failed(), 503, "status_unavailable"),
    ];
    for (now, a, http, status) in cases {
        let mut env = FixedEnv::at(now, NONCE);
        let h = RequestHead { path: format!("/status?x=1&fingerprint={fp}"), ..head(None) };
        let (mut m, step) = Machine::start(ctx("status")?, &h, true, &mut env);
        let c = call(&step).ok_or("no lookup")?;
        assert_eq!(c.path, format!("/v1/operations/{KEY}?exp=1000"));
        let step = m.on_callout(&a, &mut env)?;
        assert_eq!(reply_status(&step)?, (http, status.to_string()), "{now} {a:?}");
    }
    Ok(())
}

/// What each status answer carries for the agent to act on, beyond its status word: the operation it is
/// about, when the fingerprint runs out, when to retry (surviving mutants of `status.rs` showed none of it
/// was checked).
#[test]
fn status_answers_carry_what_the_agent_acts_on() -> TestResult {
    let fp = token(1000)?;
    let view = |state: &str| {
        json!({"key": KEY, "state": state, "scope": "pay", "subject_hash": "x", "param_hash": "y",
            "created_at_ms": 1, "updated_at_ms": 2})
    };
    let gone = json!({"error": "not_found", "reaped_possible": true});
    let retry_after_ms = ctx("status")?.config.defaults.retry_after_ms;
    assert_ne!(retry_after_ms, 0, "a default that tells the agent when to retry");
    let cases = [
        (answer(404, gone), "record_expired", json!({"operation": KEY})),
        (answer(404, json!({})), "not_executed", json!({"fingerprint_expires_at": 1000})),
        (answer(200, view("IN_FLIGHT")), "in_progress", json!({"operation": KEY})),
        (answer(200, view("NEEDS_REVIEW")), "needs_review", json!({"operation": KEY})),
        (CalloutAnswer::failed(), "status_unavailable", json!({"operation": KEY, "retry_after_ms": retry_after_ms})),
    ];
    for (a, status, fields) in cases {
        let mut env = FixedEnv::at(999, NONCE);
        let h = RequestHead { path: format!("/status?fingerprint={fp}"), ..head(None) };
        let (mut m, _) = Machine::start(ctx("status")?, &h, true, &mut env);
        let reply = reply_json(&m.on_callout(&a, &mut env)?)?;
        assert_eq!(reply["status"], status, "{reply}");
        for (name, value) in fields.as_object().ok_or("fields")? {
            assert_eq!(&reply[name], value, "{status}: {name} in {reply}");
        }
    }
    // Two fingerprints: the refusal says why.
    let h = RequestHead { path: format!("/status?fingerprint={}", token(2000)?), ..head(Some(fp.clone())) };
    let (_, step) = Machine::start(ctx("status")?, &h, true, &mut FixedEnv::at(999, NONCE));
    let reply = reply_json(&step)?;
    assert!(reply["detail"].as_str().is_some_and(|d| d.contains("more than one fingerprint")), "{reply}");
    // A POST body that is not JSON names nothing: the header's fingerprint is looked up.
    let mut env = FixedEnv::at(999, NONCE);
    let h = RequestHead { path: "/status".into(), method: "POST".into(), ..head(Some(fp.clone())) };
    let (mut m, _) = Machine::start(ctx("status")?, &h, false, &mut env);
    let step = m.on_request_body(b"fingerprint please", &mut env)?;
    assert_eq!(call(&step).map(|c| c.path.clone()), Some(format!("/v1/operations/{KEY}?exp=1000")));
    // Answered, the stream is done with: the machine passes whatever comes next.
    let step = m.on_callout(&answer(404, json!({})), &mut env)?;
    assert!(step.reply().is_some() && matches!(m, Machine::Pass), "{m:?}");
    // A body past the limit is refused before it is read.
    let (mut m, _) = Machine::start(ctx("status")?, &h, false, &mut env);
    let limit = ctx("status")?.config.max_body_bytes;
    let step = m.on_request_data(limit + 1, false);
    assert!(step.reply().is_some() && call(&step).is_none(), "{step:?}");
    Ok(())
}

/// On a status route, a caller's own Idempotency-Key names its operation only where the route takes client keys
/// (for programs); elsewhere it names nothing, and a lookup without a fingerprint is refused.
#[test]
fn a_client_key_names_a_status_lookup_only_where_client_keys_are_on() -> TestResult {
    let key = "8e03978e-40d5-43e8-bc93-6894a57f9324";
    let h = RequestHead { path: "/status".into(), idempotency_key: Some(key.into()), ..head(None) };
    let programs = policy_with("status", "envelope", &[("client_keys", "true"), ("callers", "programs")])?;
    let keyed = Ctx { policy: programs, ..ctx("status")? };
    let (_, step) = Machine::start(keyed, &h, true, &mut FixedEnv::at(999, NONCE));
    let derived = crate::client_key::operation_key(&subject_hash("alice"), "pay", key);
    assert_eq!(call(&step).map(|c| c.path.clone()), Some(format!("/v1/operations/{derived}")));
    let (_, step) = Machine::start(ctx("status")?, &h, true, &mut FixedEnv::at(999, NONCE));
    assert!(call(&step).is_none(), "a key is not a fingerprint here");
    assert!(step.reply().is_some());
    Ok(())
}

/// A lookup naming two fingerprints (header and query string, the query twice, header and body, the
/// body's key twice) names two operations: refused, never answered about one, nothing asked of idemd.
/// The same fingerprint twice is one.
#[test]
fn a_status_lookup_naming_two_fingerprints_is_refused() -> TestResult {
    let (a, b) = (token(1000)?, token(2000)?);
    let mut env = FixedEnv::at(999, NONCE);
    let cases: [(Option<&str>, String, Vec<u8>, &str); 5] = [
        (Some(&a), format!("/status?fingerprint={b}"), vec![], "fingerprint_invalid"),
        (None, format!("/status?fingerprint={a}&fingerprint={b}"), vec![], "fingerprint_invalid"),
        (Some(&a), "/status".into(), json!({"fingerprint": b}).to_string().into_bytes(), "fingerprint_invalid"),
        (
            None,
            "/status".into(),
            format!(r#"{{"fingerprint":"{a}","fingerprint":"{b}"}}"#).into_bytes(),
            "invalid_json",
        ),
        (
            None,
            format!("/status?fingerprint={a}"),
            json!({"fingerprint": b}).to_string().into_bytes(),
            "fingerprint_invalid",
        ),
    ];
    for (header, path, body, status) in cases {
        let h = RequestHead { path: path.clone(), method: "POST".into(), ..head(header.map(str::to_owned)) };
        let (mut m, first) = Machine::start(ctx("status")?, &h, false, &mut env);
        assert!(call(&first).is_none(), "{path}: nothing asked before the body");
        let step = m.on_request_body(&body, &mut env)?;
        assert!(call(&step).is_none(), "{path} {}: idemd is not asked", String::from_utf8_lossy(&body));
        assert_eq!(reply_status(&step)?.1, status, "{path} {}", String::from_utf8_lossy(&body));
    }
    // One fingerprint named twice alike is one lookup.
    let h = RequestHead { path: format!("/status?fingerprint={a}"), ..head(Some(a.clone())) };
    let (_, step) = Machine::start(ctx("status")?, &h, true, &mut env);
    assert_eq!(call(&step).map(|c| c.path.clone()), Some(format!("/v1/operations/{KEY}?exp=1000")));
    Ok(())
}

// ---- helpers ---------------------------------------------------------------

#[test]
fn query_parameters_and_retry_after() {
    assert_eq!(query_param("/s?a=1&fingerprint=x.y#frag", "fingerprint").as_deref(), Some("x.y"));
    assert_eq!(query_param("/s", "fingerprint"), None);
    assert_eq!(retry_after_ms(&[("Retry-After".into(), " 3 ".into())]), Some(3000));
    assert_eq!(retry_after_ms(&[("retry-after".into(), "Wed, 21 Oct 2015".into())]), None);
}

// ---- client-key mode -------------------------------------------------------

fn idempotent_ctx(extra: &[(&str, &str)]) -> Result<Ctx, Box<dyn std::error::Error>> {
    let mut leaves: Vec<(&str, &str)> = vec![("role", "idempotent"), ("scope", "pay"), ("upstream_keys", "honoured")];
    leaves.extend_from_slice(extra);
    Ok(testing::ctx(&config()?, &testing::route(&leaves)?, "trace-1"))
}

fn program(key: Option<&str>, c: Ctx) -> Result<(Machine, Step), Box<dyn std::error::Error>> {
    let mut env = FixedEnv::at(999, NONCE);
    let h = RequestHead { idempotency_key: key.map(str::to_owned), path: "/v1/charges".into(), ..head(None) };
    let (mut m, first) = Machine::start(c, &h, false, &mut env);
    assert_eq!(
        first.effects.contains(&Effect::RemoveRequestHeader(IDEMPOTENCY_KEY_HEADER)),
        key.is_some(),
        "the client's key never goes up as is"
    );
    let step = m.on_request_body(br#"{"amount": 5, "note": "x"}"#, &mut env)?;
    Ok((m, step))
}

fn problem_of(step: &Step) -> Result<(u16, String, Option<String>), Box<dyn std::error::Error>> {
    let r = step.reply().ok_or("no reply")?;
    let v: Value = serde_json::from_slice(&r.body)?;
    assert!(r.headers.contains(&("content-type".into(), "application/problem+json".into())), "{r:?}");
    let retry = r.headers.iter().find(|(k, _)| k == "retry-after").map(|(_, v)| v.clone());
    Ok((r.http_status, v["type"].as_str().unwrap_or_default().to_string(), retry))
}

#[test]
fn client_keys_name_operations_per_subject_and_scope() -> TestResult {
    let (_, step) = program(Some(r#""8e03978e-40d5-43e8-bc93-6894a57f9324""#), idempotent_ctx(&[])?)?;
    let c = call(&step).ok_or("no acquire")?;
    let req: AcquireRequest = serde_json::from_slice(c.body.as_deref().unwrap_or_default())?;
    assert_eq!(
        req.key,
        crate::client_key::operation_key(&subject_hash("alice"), "pay", "8e03978e-40d5-43e8-bc93-6894a57f9324")
    );
    assert_eq!(req.mode, crate::protocol::KeyMode::ClientKey);
    assert!(counted(&step, Counter::ClientKeyRequests));
    // The bare form names the same operation; the derived key is what goes upstream.
    let (mut m, bare) = program(Some("8e03978e-40d5-43e8-bc93-6894a57f9324"), idempotent_ctx(&[])?)?;
    let bare_req: AcquireRequest =
        serde_json::from_slice(call(&bare).and_then(|c| c.body.as_deref()).unwrap_or_default())?;
    assert_eq!(bare_req.key, req.key);
    assert_eq!(bare_req.param_hash, req.param_hash, "the whole request is the payload when nothing is bound");
    let mut env = FixedEnv::at(999, NONCE);
    let step = m.on_callout(&answer(200, json!({"outcome": "ACQUIRED", "owner": OWNER})), &mut env)?;
    assert!(step.effects.contains(&Effect::SetRequestHeader(IDEMPOTENCY_KEY_HEADER, req.key.to_string())));
    Ok(())
}

#[test]
fn programs_get_the_drafts_answers_as_problems() -> TestResult {
    let (_, step) = program(None, idempotent_ctx(&[])?)?;
    assert_eq!(problem_of(&step)?.0, 400);
    assert!(problem_of(&step)?.1.ends_with("idempotency-key-missing"));
    let (_, step) = program(Some(r#""a", "b""#), idempotent_ctx(&[])?)?;
    assert!(problem_of(&step)?.1.ends_with("idempotency-key-invalid"));
    let (_, step) = program(Some(&"k".repeat(300)), idempotent_ctx(&[])?)?;
    assert_eq!(problem_of(&step)?.0, 400);

    let cases = [
        (json!({"outcome": "IN_FLIGHT"}), 409, "request-in-progress", true),
        (json!({"outcome": "PARAM_MISMATCH"}), 422, "idempotency-key-reused", false),
        (json!({"outcome": "NEEDS_REVIEW"}), 409, "needs-review", false),
        (json!({"outcome": "STORE_UNAVAILABLE"}), 503, "store-unavailable", true),
        // Not a passing outage: no Retry-After invites a retry that is refused the same way.
        (json!({"outcome": "REPLICATION_REFUSED"}), 503, "replication-refused", false),
    ];
    for (a, http, kind, retry_after) in cases {
        let (mut m, _) = program(Some("k-1"), idempotent_ctx(&[])?)?;
        let step = m.on_callout(&answer(200, a.clone()), &mut FixedEnv::at(999, NONCE))?;
        let (status, t, retry) = problem_of(&step)?;
        assert_eq!((status, t.ends_with(kind), retry.is_some()), (http, true, retry_after), "{a}: {t}");
    }
    // A completed operation is its original answer, byte for byte.
    let (mut m, _) = program(Some("k-1"), idempotent_ctx(&[])?)?;
    let done = json!({"outcome": "DONE", "result": {"status": 201, "headers": [["content-type", "application/json"]], "body_b64": encode_body(br#"{"id":"ch_1"}"#)}});
    let step = m.on_callout(&answer(200, done), &mut FixedEnv::at(999, NONCE))?;
    let r = step.reply().ok_or("no replay")?;
    assert_eq!((r.http_status, r.body.as_slice()), (201, br#"{"id":"ch_1"}"#.as_slice()));
    Ok(())
}

#[test]
fn a_confirm_route_with_client_keys_serves_both_callers() -> TestResult {
    // Named for what it is (DESIGN §6, "Client keys are for programs"): its callers are programs.
    let c = || -> Result<Ctx, Box<dyn std::error::Error>> {
        let policy = policy_with("confirm", "envelope", &[("client_keys", "true"), ("callers", "programs")])?;
        Ok(Ctx { policy, ..ctx("confirm")? })
    };
    // A fingerprint caller: verified as always.
    let mut env = FixedEnv::at(999, NONCE);
    let (mut m, _) = Machine::start(c()?, &head(Some(token(1000)?)), false, &mut env);
    let step = m.on_request_body(&body(json!(10)), &mut env)?;
    let req: AcquireRequest = serde_json::from_slice(call(&step).and_then(|c| c.body.as_deref()).unwrap_or_default())?;
    assert_eq!((req.key.as_str(), req.mode), (KEY, crate::protocol::KeyMode::Fingerprint));
    // A client-key caller on the same route: its bound fields are the payload.
    let h = RequestHead { idempotency_key: Some("order-77".into()), ..head(None) };
    let (mut m, _) = Machine::start(c()?, &h, false, &mut env);
    let step = m.on_request_body(&body(json!(10)), &mut env)?;
    let req: AcquireRequest = serde_json::from_slice(call(&step).and_then(|c| c.body.as_deref()).unwrap_or_default())?;
    assert_eq!(req.mode, crate::protocol::KeyMode::ClientKey);
    assert_eq!(req.param_hash, canonical::param_hash(&json!({"amount": 10, "currency": "EUR"}), &c()?.policy.bound)?);
    // Neither: the key they can send (docs/programs.md's table).
    let (mut m, _) = Machine::start(c()?, &head(None), false, &mut env);
    let (status, kind, _) = problem_of(&m.on_request_body(&body(json!(10)), &mut env)?)?;
    assert_eq!((status, kind.as_str()), (400, "urn:agent-idempotency:problem:idempotency-key-missing"));
    Ok(())
}

#[test]
fn an_invalid_client_key_is_refused_with_the_reason() -> TestResult {
    let (m, step) = program(Some(&"k".repeat(300)), idempotent_ctx(&[])?)?;
    let problem = reply_json(&step)?;
    assert!(problem["detail"].as_str().is_some_and(|d| !d.is_empty()), "{problem}");
    assert!(counted(&step, Counter::RejectedMissing));
    assert!(matches!(m, Machine::Pass));
    Ok(())
}

#[test]
fn a_route_for_client_keys_only_never_reads_a_fingerprint() -> TestResult {
    // Role `idempotent` takes no fingerprint: one in the header or the body is payload, the key decides.
    let mut env = FixedEnv::at(999, NONCE);
    let h = RequestHead {
        idempotency_key: Some("order-77".into()),
        path: "/v1/charges".into(),
        ..head(Some("not-a-fingerprint".into()))
    };
    let (mut m, _) = Machine::start(idempotent_ctx(&[])?, &h, false, &mut env);
    let step = m.on_request_body(br#"{"amount": 5, "fingerprint": "also-not-one"}"#, &mut env)?;
    let req: AcquireRequest = serde_json::from_slice(call(&step).and_then(|c| c.body.as_deref()).ok_or("no acquire")?)?;
    assert_eq!(req.mode, crate::protocol::KeyMode::ClientKey);
    Ok(())
}

#[test]
fn two_different_fingerprints_are_refused_and_the_reply_says_why() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    let (mut m, _) = Machine::start(ctx("confirm")?, &head(Some(token(1000)?)), false, &mut env);
    let other = token(2000)?;
    let body = json!({"amount": 10, "currency": "EUR", "fingerprint": other}).to_string();
    let step = m.on_request_body(body.as_bytes(), &mut env)?;
    let v = reply_json(&step)?;
    assert_eq!(v["status"].as_str(), Some("fingerprint_invalid"), "{v}");
    assert!(v["detail"].as_str().is_some_and(|d| d.contains("differ")), "{v}");
    assert!(counted(&step, Counter::RejectedInvalid));
    Ok(())
}

#[test]
fn only_a_forwarded_confirm_asks_for_the_answers_headers() -> TestResult {
    // The hosts read the upstream's headers only where the machine records them (a cost on every answer).
    let mut env = FixedEnv::at(999, NONCE);
    let (m, _) = Machine::start(ctx("confirm")?, &head(Some(token(1000)?)), false, &mut env);
    assert!(!m.response_needs_headers(), "waiting for the body");
    let (m, _) = acquiring(&mut env)?;
    assert!(!m.response_needs_headers(), "waiting for idemd");
    assert!(forwarded(&mut env)?.response_needs_headers());
    Ok(())
}

// ---- MCP -------------------------------------------------------------------

const TOOLS: &str = r#"{"quote_transfer":{"role":"preview","scope":"pay","bind":"/amount:decimal, /currency"},
  "execute_transfer":{"role":"confirm","scope":"pay","bind":"/amount:decimal, /currency","status_tool":"get_transfer_status","upstream_keys":"honoured"},
  "get_transfer_status":{"role":"status","scope":"pay"}}"#;

fn mcp_ctx() -> Result<Ctx, Box<dyn std::error::Error>> {
    let leaves = [("role", "mcp"), ("tools", TOOLS)];
    Ok(testing::ctx(&config()?, &testing::route(&leaves)?, "trace-1"))
}

fn rpc(id: Value, method: &str, params: Value) -> Vec<u8> {
    json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).to_string().into_bytes()
}

fn call_tool(id: Value, name: &str, args: Value) -> Vec<u8> {
    rpc(id, "tools/call", json!({"name": name, "arguments": args, "_meta": {"progressToken": 0}}))
}

fn mcp_start(body: &[u8], env: &mut FixedEnv) -> Result<(Machine, Step), Box<dyn std::error::Error>> {
    let (mut m, first) = Machine::start(mcp_ctx()?, &head(None), false, env);
    assert_eq!(first.flow, Flow::Pause);
    let step = m.on_request_body(body, env)?;
    Ok((m, step))
}

fn rpc_result(step: &Step) -> Result<Value, Box<dyn std::error::Error>> {
    let r = step.reply().ok_or("no reply")?;
    assert_eq!(r.http_status, 200);
    Ok(serde_json::from_slice(&r.body)?)
}

#[test]
fn mcp_passes_what_is_not_a_guarded_tool_call() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    // Only a request without a body that is not a POST passes unread (a GET's event stream).
    let h = RequestHead { method: "GET".into(), ..head(None) };
    let (m, step) = Machine::start(mcp_ctx()?, &h, true, &mut env);
    assert!(matches!(m, Machine::Pass) && step == Step::go_on(), "{h:?}");
    // Headers alone never let a request through: it is held until its body is read.
    for h in [
        RequestHead { mcp_method: Some("initialize".into()), ..head(None) },
        RequestHead { mcp_method: Some("tools/call".into()), mcp_name: Some("other".into()), ..head(None) },
        RequestHead { method: "GET".into(), ..head(None) },
    ] {
        let (m, step) = Machine::start(mcp_ctx()?, &h, false, &mut env);
        assert!(matches!(m, Machine::Mcp(_)) && step.flow == Flow::Pause, "{h:?}");
    }
    for body in [rpc(json!(0), "initialize", json!({})), call_tool(json!(2), "other", json!({}))] {
        let (m, step) = mcp_start(&body, &mut env)?;
        assert_eq!(step, Step::go_on());
        assert!(matches!(m, Machine::Pass));
    }
    // Batches and garbage are refused clearly, with a JSON-RPC error.
    let (_, step) = mcp_start(br#"[{"jsonrpc":"2.0","id":1,"method":"tools/call"}]"#, &mut env)?;
    let r = step.reply().ok_or("no reply")?;
    let v: Value = serde_json::from_slice(&r.body)?;
    assert_eq!((r.http_status, v["error"]["code"].as_i64()), (400, Some(-32600)));
    let (_, step) = mcp_start(b"not json", &mut env)?;
    assert_eq!(serde_json::from_slice::<Value>(&step.reply().ok_or("no reply")?.body)?["error"]["code"], -32700);
    Ok(())
}

/// Quote through MCP: the fingerprint lands in `structuredContent` and a text
/// line, in the upstream's framing; the `id` is the request's.
#[test]
fn mcp_preview_mints_into_the_tool_result() -> TestResult {
    for sse in [false, true] {
        let mut env = FixedEnv::at(100, NONCE);
        let (mut m, step) =
            mcp_start(&call_tool(json!(7), "quote_transfer", json!({"amount": "10.00", "currency": "EUR"})), &mut env)?;
        assert_eq!(step.flow, Flow::Continue, "a preview is forwarded at once");
        let answer = json!({"jsonrpc": "2.0", "id": 7, "result": {"content": [{"type": "text", "text": "{}"}], "structuredContent": {"quote_id": "q_1"}, "isError": false}});
        let (ct, body) = if sse {
            ("text/event-stream", format!("data: \nid: 0\n\ndata: {answer}\n\n").into_bytes())
        } else {
            ("application/json", answer.to_string().into_bytes())
        };
        let h = ResponseHead { status: 200, content_type: Some(ct.into()), ..Default::default() };
        assert_eq!(m.on_response_head(&h, false, &mut env)?.flow, Flow::Pause);
        assert_eq!(m.on_response_data(body.len(), true)?.flow, Flow::NeedBody);
        let step = m.on_response_body(&body, &mut env)?;
        let out = String::from_utf8(replaced_body(&step).ok_or("no body")?)?;
        let lengths: Vec<&String> = step
            .effects
            .iter()
            .filter_map(|e| match e {
                Effect::SetResponseHeader(n, v) if n == "content-length" => Some(v),
                _ => None,
            })
            .collect();
        assert_eq!(lengths, vec![&out.len().to_string()], "one length, the JSON-RPC message's");
        let json_text = if sse { out.strip_prefix("data: ").ok_or("not sse")?.trim_end().to_string() } else { out };
        let v: Value = serde_json::from_str(&json_text)?;
        assert_eq!(v["id"], 7);
        let fp = v["result"]["structuredContent"]["fingerprint"].as_str().ok_or("no fingerprint")?;
        assert_eq!(v["result"]["structuredContent"]["quote_id"], "q_1");
        assert!(v["result"]["content"][1]["text"].as_str().unwrap_or_default().contains(fp), "{v}");
        // The minted fingerprint confirms the same arguments.
        let (_, step) = mcp_start(
            &call_tool(
                json!(8),
                "execute_transfer",
                json!({"amount": 10, "currency": "EUR", "fingerprint": fp, "memo": "x"}),
            ),
            &mut env,
        )?;
        assert_eq!(call(&step).map(|c| c.path.as_str()), Some("/v1/acquire"));
    }
    Ok(())
}

#[test]
fn mcp_confirm_records_the_result_and_replays_it_with_the_retrys_id() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    let args = json!({"amount": "10.00", "currency": "EUR", "fingerprint": token(1000)?, "memo": "asap"});
    let (mut m, step) = mcp_start(&call_tool(json!(3), "execute_transfer", args.clone()), &mut env)?;
    assert_eq!(call(&step).map(|c| c.path.as_str()), Some("/v1/acquire"));
    let step = m.on_callout(&answer(200, json!({"outcome": "ACQUIRED", "owner": OWNER})), &mut env)?;
    assert!(step.effects.contains(&Effect::SetRequestHeader(IDEMPOTENCY_KEY_HEADER, KEY.into())));
    assert!(m.response_needs_headers());
    // The tool's call is upstream: its lease is the host's to renew, as a confirm's is.
    let lease = m.live_lease().ok_or("no lease while the tool call is upstream")?;
    assert_eq!((lease.key.as_str(), lease.owner.as_str()), (KEY, OWNER));
    // Small enough for the test config's max_response_bytes (64).
    let result = json!({"structuredContent": {"id": "t_1"}, "isError": false});
    let body = json!({"jsonrpc": "2.0", "id": 3, "result": result}).to_string().into_bytes();
    let h = ResponseHead {
        status: 200,
        content_type: Some("application/json".into()),
        code_details: Some("via_upstream".into()),
        attempts: 1,
        headers: vec![],
        ..Default::default()
    };
    m.on_response_head(&h, false, &mut env)?;
    m.on_response_data(body.len(), true)?;
    let step = m.on_response_body(&body, &mut env)?;
    let c = call(&step).ok_or("no complete")?;
    let req: CompleteRequest = serde_json::from_slice(c.body.as_deref().unwrap_or_default())?;
    assert_eq!(req.state, crate::protocol::TerminalState::Done);
    let recorded: Value =
        serde_json::from_slice(&crate::protocol::decode_body(&req.result.body_b64).unwrap_or_default())?;
    assert_eq!(recorded, result, "the JSON-RPC result is what is kept");
    assert!(
        !step.effects.iter().any(|e| matches!(e, Effect::ReplaceResponseBody(_))),
        "the first answer goes through as sent"
    );
    let step = m.on_callout(&answer(200, json!({"outcome": "OK"})), &mut env)?;
    assert!(step.effects.contains(&Effect::ResumeResponse));

    // The retry, with another id: the recorded result itself (its structuredContent is the
    // tool's own, so it conforms to the tool's output schema), the envelope in `_meta`.
    let (mut m, _) = mcp_start(&call_tool(json!("retry-9"), "execute_transfer", args), &mut env)?;
    let done =
        json!({"outcome": "DONE", "result": {"status": 200, "body_b64": encode_body(result.to_string().as_bytes())}});
    let v = rpc_result(&m.on_callout(&answer(200, done), &mut env)?)?;
    assert_eq!(v["id"], "retry-9");
    assert_eq!(v["result"]["isError"], false);
    let envelope = &v["result"]["_meta"][META_KEY];
    assert_eq!(envelope["status"], "already_completed");
    assert_eq!(envelope["result"], result);
    // The tool's own fields, and the envelope (less its `result`, which is the rest) under the
    // property tools/list declared: what a framework showing only structuredContent shows.
    let mut said = envelope.clone();
    said.as_object_mut().ok_or("no envelope")?.remove("result");
    let mut structured = result["structuredContent"].clone();
    structured[REPLAY_PROPERTY] = said;
    assert_eq!(v["result"]["structuredContent"], structured);
    let said = v["result"]["content"].to_string();
    assert!(said.contains("Do not call this tool again"), "the gateway's words ride in a text block: {said}");
    assert_replay_resource(&v["result"], "already_completed")
}

/// `tools/list` is held and every guarded confirm tool's `outputSchema` declares the optional
/// property a replay carries its envelope in, strict or not, in the upstream's framing; other
/// tools, a schema that already names it and an answer that is not a listing are left alone.
#[test]
fn mcp_tools_list_declares_the_replay_property_in_confirm_schemas() -> TestResult {
    let strict = json!({"type": "object", "properties": {"id": {"type": "string"}}, "additionalProperties": false});
    let own = json!({"type": "object", "properties": {REPLAY_PROPERTY: {"type": "string"}}});
    let listing = json!({"jsonrpc": "2.0", "id": 4, "result": {"tools": [
        {"name": "quote_transfer", "inputSchema": {"type": "object"}, "outputSchema": strict},
        {"name": "execute_transfer", "inputSchema": {"type": "object"}, "outputSchema": strict},
        {"name": "get_transfer_status", "inputSchema": {"type": "object"}, "outputSchema": {"type": "object"}},
        {"name": "unlisted", "inputSchema": {"type": "object"}, "outputSchema": strict},
    ]}});
    for sse in [false, true] {
        let mut env = FixedEnv::at(999, NONCE);
        let (mut m, step) = mcp_start(&rpc(json!(4), "tools/list", json!({})), &mut env)?;
        assert_eq!(step, Step::go_on().with(Effect::RemoveRequestHeader("accept-encoding")), "read unencoded");
        let (ct, body) = if sse {
            ("text/event-stream", format!("id: 0\ndata: \n\ndata: {listing}\n\n").into_bytes())
        } else {
            ("application/json", listing.to_string().into_bytes())
        };
        let h = ResponseHead { status: 200, content_type: Some(ct.into()), ..Default::default() };
        let step = m.on_response_head(&h, false, &mut env)?;
        assert_eq!(step, Step::pause().with(Effect::RemoveResponseHeader("content-length")));
        assert_eq!(m.on_response_data(body.len(), true)?.flow, Flow::NeedBody);
        let step = m.on_response_body(&body, &mut env)?;
        assert!(matches!(m, Machine::Pass) && step.flow == Flow::Continue);
        let out = String::from_utf8(replaced_body(&step).ok_or("not rewritten")?)?;
        assert!(step.effects.contains(&Effect::SetResponseHeader("content-length".into(), out.len().to_string())));
        let text = if sse { out.strip_prefix("data: ").ok_or("not sse")?.trim_end().to_string() } else { out };
        let v: Value = serde_json::from_str(&text)?;
        let tools = &v["result"]["tools"];
        let declared = &tools[1]["outputSchema"]["properties"][REPLAY_PROPERTY];
        assert_eq!(declared["type"], "object", "{v}");
        assert!(declared["description"].as_str().unwrap_or_default().contains("executed nothing"), "{v}");
        assert_eq!(tools[1]["outputSchema"]["additionalProperties"], false, "strict stays strict");
        for (i, schema) in [(0, &strict), (2, &json!({"type": "object"})), (3, &strict)] {
            assert_eq!(&tools[i]["outputSchema"], schema, "only guarded confirm tools: {v}");
        }
    }
    // A schema that already names the property keeps its own; an error or no JSON passes as sent.
    let mut env = FixedEnv::at(999, NONCE);
    for answer in [
        json!({"jsonrpc": "2.0", "id": 4, "result": {"tools": [{"name": "execute_transfer", "outputSchema": own}]}})
            .to_string(),
        json!({"jsonrpc": "2.0", "id": 4, "error": {"code": -32603, "message": "no"}}).to_string(),
        "not json".to_string(),
    ] {
        let (mut m, _) = mcp_start(&rpc(json!(4), "tools/list", json!({})), &mut env)?;
        let h = ResponseHead { status: 200, content_type: Some("application/json".into()), ..Default::default() };
        m.on_response_head(&h, false, &mut env)?;
        m.on_response_data(answer.len(), true)?;
        let step = m.on_response_body(answer.as_bytes(), &mut env)?;
        assert!(replaced_body(&step).is_none(), "{answer}");
        assert!(step.effects.contains(&Effect::SetResponseHeader("content-length".into(), answer.len().to_string())));
    }
    // An error status or another media type is not held at all.
    for h in [
        ResponseHead { status: 500, content_type: Some("application/json".into()), ..Default::default() },
        ResponseHead { status: 200, content_type: Some("text/plain".into()), ..Default::default() },
    ] {
        let (mut m, _) = mcp_start(&rpc(json!(4), "tools/list", json!({})), &mut env)?;
        assert_eq!(m.on_response_head(&h, false, &mut env)?, Step::go_on(), "{h:?}");
        assert!(matches!(m, Machine::Pass));
    }
    Ok(())
}

/// A replay's last content block is the envelope as an embedded JSON resource: a framework
/// that hands the model `structuredContent` only while every block is text maps the content
/// once one is not, so the model reads that this call ran nothing (pydantic-ai is one).
fn assert_replay_resource(result: &Value, status: &str) -> TestResult {
    let content = result["content"].as_array().ok_or("no content")?;
    let last = content.last().ok_or("empty content")?;
    assert_eq!(last["type"], "resource", "{result}");
    assert_eq!(last["resource"]["uri"], crate::machine::mcp::REPLY_URI);
    assert_eq!(last["resource"]["mimeType"], "application/json");
    let envelope: Value = serde_json::from_str(last["resource"]["text"].as_str().ok_or("no text")?)?;
    assert_eq!(envelope, result["_meta"][META_KEY], "the resource is the envelope");
    assert_eq!(envelope["status"], status);
    Ok(())
}

/// A recorded failure replays as an error result without structuredContent: today's
/// TypeScript SDK checks structuredContent against the output schema even on errors.
#[test]
fn mcp_replay_of_a_failure_is_an_error_without_structured_content() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    let args = json!({"amount": "10.00", "currency": "EUR", "fingerprint": token(1000)?});
    let (mut m, _) = mcp_start(&call_tool(json!(3), "execute_transfer", args), &mut env)?;
    let failed =
        json!({"content": [{"type": "text", "text": "no"}], "structuredContent": {"error": "limit"}, "isError": true});
    let rec =
        json!({"outcome": "FAILED", "result": {"status": 422, "body_b64": encode_body(failed.to_string().as_bytes())}});
    let v = rpc_result(&m.on_callout(&answer(200, rec), &mut env)?)?;
    assert_eq!(v["result"]["isError"], true);
    assert!(v["result"].get("structuredContent").is_none(), "{v}");
    assert_eq!(v["result"]["resultType"], "complete", "MCP 2026-07-28 clients require it: {v}");
    assert_eq!(v["result"]["_meta"][META_KEY]["status"], "already_failed");
    assert_eq!(v["result"]["_meta"][META_KEY]["result"], failed);
    assert_replay_resource(&v["result"], "already_failed")
}

/// The headers are a claim the body must agree with (MCP 2026-07-28): a lie is -32020,
/// HTTP 400, and nothing is forwarded, whatever the body asks for.
#[test]
fn mcp_headers_that_contradict_the_body_are_refused_before_anything_is_forwarded() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    let transfer = call_tool(json!(7), "execute_transfer", json!({"amount": "9999.00", "currency": "EUR"}));
    for (method, name) in [
        (Some("tools/list"), None),
        (Some("notifications/initialized"), None),
        (Some("tools/call"), Some("some_unlisted_tool")),
        (None, Some("quote_transfer")),
    ] {
        let h = RequestHead { mcp_method: method.map(str::to_owned), mcp_name: name.map(str::to_owned), ..head(None) };
        let (mut m, first) = Machine::start(mcp_ctx()?, &h, false, &mut env);
        assert_eq!(first.flow, Flow::Pause, "{h:?}: held until the body is read");
        let step = m.on_request_body(&transfer, &mut env)?;
        let r = step.reply().ok_or("no reply")?;
        let v: Value = serde_json::from_slice(&r.body)?;
        assert_eq!((r.http_status, v["error"]["code"].as_i64(), v["id"].as_i64()), (400, Some(-32020), Some(7)), "{v}");
        assert!(call(&step).is_none() && !step.effects.contains(&Effect::ResumeRequest), "{h:?}");
    }
    // Headers that agree change nothing.
    let h =
        RequestHead { mcp_method: Some("tools/call".into()), mcp_name: Some("execute_transfer".into()), ..head(None) };
    let (mut m, _) = Machine::start(mcp_ctx()?, &h, false, &mut env);
    let step = m.on_request_body(&transfer, &mut env)?;
    assert_eq!(rpc_result(&step)?["result"]["_meta"][META_KEY]["status"], "fingerprint_missing");
    Ok(())
}

/// What a lenient server might read as a guarded call gets the gateway's own answer:
/// near-spellings, notifications, ids that are not ids, task-augmented calls, repeated headers.
#[test]
fn mcp_what_could_reach_a_listed_tool_is_answered_never_passed() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    let args = json!({"amount": "1.00", "currency": "EUR"});
    let cases: Vec<(Vec<u8>, i64)> = vec![
        (rpc(json!(1), "Tools/Call", json!({"name": "execute_transfer", "arguments": args})), -32601),
        (rpc(json!(1), "tools/call ", json!({"name": "execute_transfer", "arguments": args})), -32601),
        (rpc(json!(1), "tools/call\u{0}", json!({"name": "execute_transfer", "arguments": args})), -32601),
        (call_tool(json!(1), "Execute_Transfer", args.clone()), -32602),
        (call_tool(json!(1), "execute_transfer ", args.clone()), -32602),
        (call_tool(json!(null), "execute_transfer", args.clone()), -32600),
        (call_tool(json!(1.5), "execute_transfer", args.clone()), -32600),
        (
            rpc(json!(1), "tools/call", json!({"name": "execute_transfer", "arguments": args, "task": {"ttl": 60}})),
            -32602,
        ),
        (
            br#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"execute_transfer","arguments":{}}}"#.to_vec(),
            -32600,
        ),
        (br#"{"jsonrpc":"2.0","id":1,"method":"tools/list","method":"tools/call"}"#.to_vec(), -32700),
        // A call that names no tool is refused, never passed for the server to guess.
        (br#"{"jsonrpc":"2.0","id":1,"method":"tools/call"}"#.to_vec(), -32602),
        (rpc(json!(1), "tools/call", json!({"arguments": args})), -32602),
    ];
    for (body, code) in cases {
        let (_, step) = mcp_start(&body, &mut env)?;
        let r = step.reply().ok_or_else(|| format!("no reply to {}", String::from_utf8_lossy(&body)))?;
        let v: Value = serde_json::from_slice(&r.body)?;
        assert_eq!(
            (r.http_status, v["error"]["code"].as_i64()),
            (400, Some(code)),
            "{}: {v}",
            String::from_utf8_lossy(&body)
        );
        assert!(call(&step).is_none() && !step.effects.contains(&Effect::ResumeRequest));
    }
    let h = RequestHead { repeated: Some("mcp-method"), ..head(None) };
    let (_, step) = Machine::start(mcp_ctx()?, &h, false, &mut env);
    let v: Value = serde_json::from_slice(&step.reply().ok_or("no reply")?.body)?;
    assert_eq!(v["error"]["code"].as_i64(), Some(-32020));
    Ok(())
}

#[test]
fn mcp_refusals_and_tool_errors() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    // Tampered amount: a tool result with isError and the envelope, nothing called.
    let tampered = json!({"amount": "10.01", "currency": "EUR", "fingerprint": token(1000)?});
    let (_, step) = mcp_start(&call_tool(json!(4), "execute_transfer", tampered), &mut env)?;
    let v = rpc_result(&step)?;
    assert_eq!((v["id"].as_i64(), v["result"]["isError"].as_bool()), (Some(4), Some(true)));
    assert!(v["result"].get("structuredContent").is_none(), "no result, so nothing to validate: {v}");
    assert_eq!(v["result"]["_meta"][META_KEY]["status"], "params_changed");
    assert!(call(&step).is_none());
    let (_, step) =
        mcp_start(&call_tool(json!(5), "execute_transfer", json!({"amount": 1, "currency": "EUR"})), &mut env)?;
    assert_eq!(rpc_result(&step)?["result"]["_meta"][META_KEY]["status"], "fingerprint_missing");
    // The tool answered isError: a definite failure, recorded FAILED.
    let args = json!({"amount": "10.00", "currency": "EUR", "fingerprint": token(1000)?});
    let (mut m, _) = mcp_start(&call_tool(json!(6), "execute_transfer", args), &mut env)?;
    m.on_callout(&answer(200, json!({"outcome": "ACQUIRED", "owner": OWNER})), &mut env)?;
    let body = br#"{"jsonrpc":"2.0","id":6,"result":{"content":[],"structuredContent":{"error":"limit_exceeded"},"isError":true}}"#;
    let h = ResponseHead {
        status: 200,
        content_type: Some("application/json".into()),
        code_details: Some("via_upstream".into()),
        attempts: 1,
        headers: vec![],
        ..Default::default()
    };
    m.on_response_head(&h, false, &mut env)?;
    m.on_response_data(body.len(), true)?;
    let step = m.on_response_body(body, &mut env)?;
    let req: CompleteRequest = serde_json::from_slice(call(&step).and_then(|c| c.body.as_deref()).unwrap_or_default())?;
    assert_eq!(req.state, crate::protocol::TerminalState::Failed);
    Ok(())
}

// ---- replay cache ------------------------------------------------------------

/// An env whose shared data the test fills from the steps' `SharedSet` effects.
struct SharedEnv {
    now: u64,
    data: std::collections::HashMap<String, Vec<u8>>,
}

impl Env for SharedEnv {
    fn now_s(&self) -> u64 {
        self.now
    }
    fn random16(&mut self) -> Option<[u8; 16]> {
        Some(NONCE)
    }
    fn shared_get(&self, key: &str) -> Option<Vec<u8>> {
        self.data.get(key).cloned()
    }
}

impl SharedEnv {
    fn keep(&mut self, step: &Step) -> usize {
        let mut n = 0;
        for e in &step.effects {
            if let Effect::SharedSet { key, value } = e {
                self.data.insert(key.clone(), value.clone());
                n += 1;
            }
        }
        n
    }
}

fn confirm_with(env: &mut SharedEnv, amount: Value) -> Result<(Machine, Step), Box<dyn std::error::Error>> {
    let (mut m, _) = Machine::start(ctx("confirm")?, &head(Some(token(1000)?)), false, env);
    let step = m.on_request_body(&body(amount), env)?;
    Ok((m, step))
}

#[test]
fn terminal_results_are_replayed_from_shared_data_without_a_callout() -> TestResult {
    let mut env = SharedEnv { now: 999, data: Default::default() };
    // The first confirm runs and its complete is acked: the result is cached.
    let (mut m, _) = confirm_with(&mut env, json!(10))?;
    m.on_callout(&answer(200, json!({"outcome": "ACQUIRED", "owner": OWNER})), &mut env)?;
    m.on_response_head(&upstream(201, "via_upstream"), false, &mut env)?;
    m.on_response_data(12, true)?;
    m.on_response_body(br#"{"id":"T-1"}"#, &mut env)?;
    let ack = m.on_callout(&answer(200, json!({"outcome": "OK"})), &mut env)?;
    assert_eq!(env.keep(&ack), 1, "stored once the store took it");

    // A retry: replayed at once, no acquire.
    let (_, step) = confirm_with(&mut env, json!("10.00"))?;
    assert!(call(&step).is_none(), "no callout for a cached terminal result");
    assert!(counted(&step, Counter::ReplayCacheHits));
    let v = reply_json(&step)?;
    assert_eq!((v["status"].as_str(), v["result"]["id"].as_str()), (Some("already_completed"), Some("T-1")));
    // A tampered retry is still params_changed and a security event.
    let (_, step) = confirm_with(&mut env, json!(11))?;
    assert_eq!(reply_status(&step)?, (422, "params_changed".into()));
    assert!(step.effects.contains(&Effect::SecurityEvent { kind: "params_changed", nonce: KEY.into() }));
    // After the cache's ttl, idemd is asked again.
    env.now = 999 + 3600;
    let (_, step) = confirm_with(&mut env, json!(10))?;
    assert!(call(&step).is_some(), "an expired entry is never served");
    Ok(())
}

#[test]
fn nothing_but_terminal_states_is_ever_cached() -> TestResult {
    for outcome in
        [json!({"outcome": "IN_FLIGHT"}), json!({"outcome": "NEEDS_REVIEW"}), json!({"outcome": "STORE_UNAVAILABLE"})]
    {
        let mut env = SharedEnv { now: 999, data: Default::default() };
        let (mut m, _) = confirm_with(&mut env, json!(10))?;
        let step = m.on_callout(&answer(200, outcome.clone()), &mut env)?;
        assert_eq!(env.keep(&step), 0, "{outcome}");
    }
    // An unknown outcome (no complete) and a release are not cached either.
    for status in [504, 503] {
        let mut env = SharedEnv { now: 999, data: Default::default() };
        let (mut m, _) = confirm_with(&mut env, json!(10))?;
        m.on_callout(&answer(200, json!({"outcome": "ACQUIRED", "owner": OWNER})), &mut env)?;
        let d = if status == 504 { "upstream_response_timeout" } else { "via_upstream" };
        m.on_response_head(&upstream(status, d), false, &mut env)?;
        m.on_response_data(2, true)?;
        let step = m.on_response_body(b"{}", &mut env)?;
        let mut n = env.keep(&step);
        if call(&step).is_some() {
            let acked = m.on_callout(&answer(200, json!({"outcome": "OK"})), &mut env)?;
            n += env.keep(&acked);
        }
        assert_eq!(n, 0, "{status}");
    }
    // A DONE from idemd is cached.
    let mut env = SharedEnv { now: 999, data: Default::default() };
    let (mut m, _) = confirm_with(&mut env, json!(10))?;
    let done = json!({"outcome": "DONE", "result": {"status": 201, "body_b64": encode_body(b"{}")}});
    let step = m.on_callout(&answer(200, done), &mut env)?;
    assert_eq!(env.keep(&step), 1);
    Ok(())
}

// ---- headers the guard reads -------------------------------------------------

fn pairs(list: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
    list.iter().map(|(k, v)| ((*k).to_string(), v.as_bytes().to_vec())).collect()
}

#[test]
fn the_head_is_read_from_every_header_entry_and_repeats_are_noted() {
    let all = HeadNeeds::for_role(Role::Confirm);
    let h = RequestHead::from_headers(
        &pairs(&[
            (":method", "POST"),
            (":path", "/v1/transfers"),
            ("x-agent-subject", "alice"),
            ("agent-fingerprint", "fp"),
            ("x-request-id", "rid-1"),
            ("content-length", "12"),
        ]),
        all,
        Some("x-agent-subject"),
    );
    assert_eq!(
        (h.method.as_str(), h.path.as_str(), h.subject.as_deref(), h.fingerprint.as_deref(), h.trace.id.as_str()),
        ("POST", "/v1/transfers", Some("alice"), Some("fp"), "rid-1")
    );
    assert_eq!((h.content_length, h.repeated), (Some(12), None));
    for (name, label) in [
        ("agent-fingerprint", "agent-fingerprint"),
        ("idempotency-key", "idempotency-key"),
        ("x-agent-subject", SUBJECT_HEADER_LABEL),
    ] {
        let h = RequestHead::from_headers(&pairs(&[(name, "a"), (name, "a")]), all, Some("x-agent-subject"));
        assert_eq!(h.repeated, Some(label), "{name}: the same value twice is still two");
    }
    // What a role does not read cannot be refused for repeating (a preview reads no key).
    let h = RequestHead::from_headers(
        &pairs(&[("idempotency-key", "a"), ("idempotency-key", "b")]),
        HeadNeeds::for_role(Role::Preview),
        Some("x-agent-subject"),
    );
    assert_eq!(h.repeated, None);
    let mcp = HeadNeeds::for_role(Role::Mcp);
    let h = RequestHead::from_headers(&pairs(&[("mcp-name", "a"), ("mcp-name", "b")]), mcp, None);
    assert_eq!(h.repeated, Some(MCP_NAME_HEADER));
}

/// `_` for `-` is another copy of a header the guard reads (a CGI-style upstream reads both as one),
/// alone or beside the dashed one; only for the headers the role reads.
#[test]
fn an_underscore_spelling_of_a_guarded_header_is_another_copy() {
    let subject = Some("x-agent-subject");
    let confirm = HeadNeeds::for_role(Role::Confirm);
    for (name, label) in [
        ("agent_fingerprint", FINGERPRINT_HEADER),
        ("idempotency_key", IDEMPOTENCY_KEY_HEADER),
        ("Idempotency_Key", IDEMPOTENCY_KEY_HEADER),
        ("x_agent_subject", SUBJECT_HEADER_LABEL),
        ("x-agent_subject", SUBJECT_HEADER_LABEL),
    ] {
        let alone = RequestHead::from_headers(&pairs(&[("x-agent-subject", "alice"), (name, "b")]), confirm, subject);
        assert_eq!(alone.repeated, Some(label), "{name}");
        assert!(alone.idempotency_key.is_none() && alone.fingerprint.is_none(), "{name}: never read as the header");
    }
    let mcp = HeadNeeds::for_role(Role::Mcp);
    for (name, label) in [("mcp_method", MCP_METHOD_HEADER), ("mcp_name", MCP_NAME_HEADER)] {
        assert_eq!(RequestHead::from_headers(&pairs(&[(name, "tools/call")]), mcp, None).repeated, Some(label));
    }
    // What the role does not read is not refused, and other underscores are nobody's business.
    let preview = HeadNeeds::for_role(Role::Preview);
    for name in ["idempotency_key", "agent_fingerprint"] {
        assert_eq!(RequestHead::from_headers(&pairs(&[(name, "x")]), preview, subject).repeated, None, "{name}");
    }
    let h = RequestHead::from_headers(&pairs(&[("x_agent_subject", "bob")]), preview, subject);
    assert_eq!(h.repeated, Some(SUBJECT_HEADER_LABEL));
    assert_eq!(RequestHead::from_headers(&pairs(&[("x_custom_thing", "1")]), confirm, subject).repeated, None);
    // A subject header configured with `_`: its dashed spelling, alone or beside it, is the other copy.
    let underscored = Some("x_agent_subject");
    for headers in [vec![("x_agent_subject", "alice"), ("X-Agent-Subject", "mallory")], vec![("x-agent-subject", "m")]]
    {
        let h = RequestHead::from_headers(&pairs(&headers), preview, underscored);
        assert_eq!(h.repeated, Some(SUBJECT_HEADER_LABEL), "{headers:?}");
        assert_ne!(h.subject.as_deref(), Some("mallory"), "{headers:?}: never read as the subject");
    }
    let h = RequestHead::from_headers(&pairs(&[("X_Agent_Subject", "alice")]), preview, underscored);
    assert_eq!((h.repeated, h.subject.as_deref()), (None, Some("alice")));
}

/// The start removes a client's Idempotency-Key only when one came, however its name is spelled
/// (Envoy's removal ignores case): the head decides, and it reads every entry.
#[test]
fn a_client_key_is_removed_when_it_came_in_any_case_and_only_then() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    for (headers, removed) in [
        (vec![("x-agent-subject", "alice")], false),
        (vec![("x-agent-subject", "alice"), ("idempotency-key", "k")], true),
        (vec![("x-agent-subject", "alice"), ("Idempotency-Key", "k")], true),
    ] {
        let h =
            RequestHead::from_headers(&pairs(&headers), HeadNeeds::for_role(Role::Confirm), Some("x-agent-subject"));
        let (_, first) = Machine::start(ctx("confirm")?, &h, false, &mut env);
        let removes = first.effects.contains(&Effect::RemoveRequestHeader(IDEMPOTENCY_KEY_HEADER));
        assert_eq!(removes, removed, "{headers:?}");
    }
    Ok(())
}

/// What is refused before the body is read is told to the callers the route names: programs get
/// docs/programs.md's problem, agents the §7 envelope (with the stream's trace id). A missing
/// subject is a problem only where the route takes nothing but client keys; a bad header wherever
/// programs send their own keys.
#[test]
fn the_first_refusals_speak_to_the_callers_the_route_names() -> TestResult {
    let with = |role: &str, extra: &[(&str, &str)]| -> Result<Ctx, Box<dyn std::error::Error>> {
        Ok(Ctx { config: config()?, policy: policy_with(role, "envelope", extra)?, trace_id: "trace-1".into() })
    };
    let cases: Vec<(&str, Ctx, bool, bool)> = vec![
        // (route, ctx, a missing subject is a problem, a repeated header is a problem)
        ("idempotent", idempotent_ctx(&[])?, true, true),
        (
            "confirm, client keys, programs",
            with("confirm", &[("client_keys", "true"), ("callers", "programs")])?,
            false,
            true,
        ),
        ("confirm, programs, no client keys", with("confirm", &[("callers", "programs")])?, false, false),
        ("status, client keys, agents", with("status", &[("client_keys", "true")])?, false, false),
        ("confirm", ctx("confirm")?, false, false),
    ];
    let problem =
        |step: &Step| step.reply().is_some_and(|r| r.headers.iter().any(|(_, v)| v == "application/problem+json"));
    for (label, c, subject_problem, header_problem) in cases {
        let mut env = FixedEnv::at(999, NONCE);
        let (_, missing) = Machine::start(c.clone(), &RequestHead { subject: None, ..head(None) }, false, &mut env);
        let (_, repeated) =
            Machine::start(c, &RequestHead { repeated: Some(SUBJECT_HEADER_LABEL), ..head(None) }, false, &mut env);
        assert_eq!((problem(&missing), problem(&repeated)), (subject_problem, header_problem), "{label}");
        for step in [&missing, &repeated] {
            let r = step.reply().ok_or(format!("{label}: no reply"))?;
            let v: Value = serde_json::from_slice(&r.body)?;
            if !problem(step) {
                assert_eq!(v["trace_id"], "trace-1", "{label}: {v}");
            }
        }
    }
    Ok(())
}

/// A declared length up to the limit is read; one past it is refused before a byte is.
#[test]
fn a_declared_length_at_the_limit_is_read_and_one_past_it_refused() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    let limit = ctx("confirm")?.config.max_body_bytes as u64;
    let at = RequestHead { content_length: Some(limit), ..head(None) };
    let (m, step) = Machine::start(ctx("confirm")?, &at, false, &mut env);
    assert!(step.reply().is_none() && !matches!(m, Machine::Pass), "{step:?}");
    let past = RequestHead { content_length: Some(limit + 1), ..head(None) };
    let (m, step) = Machine::start(ctx("confirm")?, &past, false, &mut env);
    assert_eq!(reply_status(&step)?, (413, "body_too_large".into()));
    assert!(matches!(m, Machine::Pass));
    Ok(())
}

#[test]
fn a_repeated_header_is_a_400_before_anything_is_read_or_forwarded() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    for (label, status) in [
        (FINGERPRINT_HEADER, "fingerprint_invalid"),
        (IDEMPOTENCY_KEY_HEADER, "idempotency_key_invalid"),
        (SUBJECT_HEADER_LABEL, "invalid_header"),
    ] {
        let h = RequestHead { repeated: Some(label), ..head(None) };
        let (m, step) = Machine::start(ctx("confirm")?, &h, false, &mut env);
        let r = step.reply().ok_or("no reply")?;
        let v: Value = serde_json::from_slice(&r.body)?;
        assert_eq!((r.http_status, v["status"].as_str()), (400, Some(status)), "{label}: {v}");
        assert!(v["detail"].as_str().is_some_and(|d| d.contains(label)), "{v}");
        assert!(matches!(m, Machine::Pass) && counted(&step, Counter::RejectedHeader));
    }
    // Programs get docs/programs.md's problem.
    let h = RequestHead { repeated: Some(IDEMPOTENCY_KEY_HEADER), ..head(None) };
    let (_, step) = Machine::start(idempotent_ctx(&[("callers", "programs")])?, &h, false, &mut env);
    let (status, kind, _) = problem_of(&step)?;
    assert_eq!((status, kind.as_str()), (400, "urn:agent-idempotency:problem:idempotency-key-invalid"));
    Ok(())
}

#[test]
fn a_fingerprint_in_the_header_and_another_in_the_body_is_no_fingerprint() -> TestResult {
    let mut env = FixedEnv::at(999, NONCE);
    let fp = token(1000)?;
    let (mut m, _) = Machine::start(ctx("confirm")?, &head(Some(fp.clone())), false, &mut env);
    let body = json!({"amount": 10, "currency": "EUR", "fingerprint": format!("{fp}x")});
    let step = m.on_request_body(body.to_string().as_bytes(), &mut env)?;
    let v: Value = serde_json::from_slice(&step.reply().ok_or("no reply")?.body)?;
    assert_eq!(v["status"], "fingerprint_invalid");
    assert!(call(&step).is_none());
    // The same one in both places is one fingerprint.
    let (mut m, _) = Machine::start(ctx("confirm")?, &head(Some(fp.clone())), false, &mut env);
    let body = json!({"amount": 10, "currency": "EUR", "fingerprint": fp});
    let step = m.on_request_body(body.to_string().as_bytes(), &mut env)?;
    assert_eq!(call(&step).map(|c| c.path.as_str()), Some("/v1/acquire"));
    Ok(())
}

#[test]
fn every_problem_type_is_a_slug_and_every_title_a_sentence() {
    for kind in crate::reply::ReplyKind::ALL {
        let r = crate::reply::problem(kind, &crate::reply::ReplyContext::default());
        let v: Value = serde_json::from_slice(&r.body).unwrap_or_default();
        let slug = v["type"].as_str().and_then(|t| t.strip_prefix(crate::reply::PROBLEM_BASE)).unwrap_or_default();
        assert!(!slug.is_empty() && slug.chars().all(|c| c.is_ascii_lowercase() || c == '-'), "{kind:?}: {slug}");
        let title = v["title"].as_str().unwrap_or_default();
        assert!(title.split(' ').count() >= 4 && title.starts_with(char::is_uppercase), "{kind:?}: {title}");
    }
}

// ---- approval (DESIGN §4, "Approval") ----------------------------------------

fn approval_ctx(rule: &str) -> Result<Ctx, Box<dyn std::error::Error>> {
    let policy = policy_with("confirm", "envelope", &[("approval", rule)])?;
    Ok(Ctx { config: config()?, policy, trace_id: "trace-1".into() })
}

fn approval_view(state: &str, exp_ms: i64) -> Value {
    json!({"key": KEY, "state": state, "scope": "pay", "subject_hash": subject_hash("alice"),
        "fields": r#"{"/amount":10,"/currency":"EUR"}"#, "created_at_ms": 1, "expires_at_ms": exp_ms,
        "reason": "not this month", "console": "https://idemd.example/approvals"})
}

/// A confirm on an approval route, its acquire sent; `rule` decides over the body `amount`.
fn approval_acquiring(rule: &str, now: u64) -> Result<(Machine, Step, FixedEnv), Box<dyn std::error::Error>> {
    let mut env = FixedEnv::at(now, NONCE);
    let (mut m, _) = Machine::start(approval_ctx(rule)?, &head(Some(token(1000)?)), false, &mut env);
    let step = m.on_request_body(&body(json!("10.00")), &mut env)?;
    Ok((m, step, env))
}

#[test]
fn an_approval_route_asks_idemd_to_record_the_bound_fields_for_a_person() -> TestResult {
    let (_, step, _) = approval_acquiring("always", 999)?;
    let c = call(&step).ok_or("no call")?;
    let req: AcquireRequest = serde_json::from_slice(c.body.as_deref().unwrap_or_default())?;
    // The canonical bound fields: never the memo.
    assert_eq!(req.approval.map(|a| a.fields), Some(r#"{"/amount":10,"/currency":"EUR"}"#.to_string()));
    // Under the threshold the rule does not ask.
    let (_, step, _) = approval_acquiring(r#"{"field":"/amount","gte":"1000"}"#, 999)?;
    let req: AcquireRequest = serde_json::from_slice(call(&step).and_then(|c| c.body.as_deref()).unwrap_or_default())?;
    assert!(req.approval.is_none());
    Ok(())
}

#[test]
fn approval_answers_become_replies_and_nothing_is_forwarded() -> TestResult {
    let awaiting = json!({"outcome": "AWAITING_APPROVAL", "approval": approval_view("AWAITING_APPROVAL", 1_000_000)});
    let rejected = json!({"outcome": "REJECTED", "approval": approval_view("REJECTED", 1_000_000)});
    let lapsed = json!({"outcome": "LAPSED", "approval": approval_view("AWAITING_APPROVAL", 1_000_000)});
    let cases = [
        (answer(200, awaiting), 202, "approval_required", Counter::ApprovalRequired),
        (answer(200, rejected), 403, "rejected", Counter::ApprovalRejected),
        // The outcome is idemd's word; the record as of now is what the reply reads (still awaiting
        // before exp would be approval_required: idemd said lapsed because its clock is past exp).
        (answer(200, json!({"outcome": "AWAITING_APPROVAL"})), 503, "status_unavailable", Counter::SidecarErrors),
    ];
    for (a, http, status, counter) in cases {
        let (mut m, _, mut env) = approval_acquiring("always", 999)?;
        let step = m.on_callout(&a, &mut env)?;
        assert_eq!(reply_status(&step)?, (http, status.to_string()), "{a:?}");
        assert!(!step.effects.contains(&Effect::ResumeRequest), "nothing forwarded");
        assert!(counted(&step, counter), "{status}");
    }
    let (mut m, _, mut env) = approval_acquiring("always", 999)?;
    let step = m.on_callout(&answer(200, lapsed), &mut env)?;
    assert!(!step.effects.contains(&Effect::ResumeRequest));
    let v = reply_json(&step)?;
    assert_eq!(v["status"], "approval_required", "before exp the record reads as awaiting");
    assert_eq!(v["approval"]["fields"]["/amount"], 10);
    assert_eq!(v["approval"]["approve_at"], "https://idemd.example/approvals");
    assert_eq!(v["approval"]["expires_at"], 1000, "the record's exp, in seconds: {v}");
    assert_eq!(v["poll_with"], "get_status");
    assert_eq!(v["operation"], KEY);
    // A rejection carries the approver's reason.
    let (mut m, _, mut env) = approval_acquiring("always", 999)?;
    let step = m.on_callout(
        &answer(200, json!({"outcome": "REJECTED", "approval": approval_view("REJECTED", 1_000_000)})),
        &mut env,
    )?;
    assert_eq!(reply_json(&step)?["approval"]["reason"], "not this month");
    // An approval answer about another operation is not believed.
    let mut other = approval_view("REJECTED", 1_000_000);
    other["key"] = json!("33333333333333333333333333333333");
    let (mut m, _, mut env) = approval_acquiring("always", 999)?;
    let step = m.on_callout(&answer(200, json!({"outcome": "REJECTED", "approval": other})), &mut env)?;
    assert_eq!(reply_status(&step)?.1, "status_unavailable");
    Ok(())
}

/// A status lookup that finds a person's approval answers what they decided, and counts each
/// lookup once (when it went out) plus, for a verdict, the verdict's own counter.
#[test]
fn a_status_lookup_answers_the_approval_and_counts_it_once() -> TestResult {
    let fp = token(1000)?;
    for (state, status, verdict) in [
        ("AWAITING_APPROVAL", "awaiting_approval", None),
        ("APPROVED", "approved", None),
        ("REJECTED", "rejected", Some(Counter::ApprovalRejected)),
        ("LAPSED", "approval_lapsed", Some(Counter::ApprovalLapsed)),
    ] {
        let mut env = FixedEnv::at(999, NONCE);
        let h = RequestHead { path: format!("/status?fingerprint={fp}"), ..head(None) };
        let (mut m, first) = Machine::start(ctx("status")?, &h, true, &mut env);
        let sent = first.effects.iter().filter(|e| **e == Effect::Count(Counter::StatusLookups)).count();
        let step = m.on_callout(&answer(404, json!({"approval": approval_view(state, 1_000_000)})), &mut env)?;
        assert_eq!(reply_status(&step)?.1, status, "{state}");
        let lookups = step.effects.iter().filter(|e| **e == Effect::Count(Counter::StatusLookups)).count();
        assert_eq!(sent + lookups, 1, "{state}: one lookup, counted once");
        let counts: Vec<&Effect> = step.effects.iter().filter(|e| matches!(e, Effect::Count(_))).collect();
        assert_eq!(counts, verdict.map(Effect::Count).iter().collect::<Vec<_>>(), "{state}");
    }
    Ok(())
}

/// `in_progress` polls the status tool, else the call's own tool (by `tool.name`), after the
/// route's own interval.
#[test]
fn polling_names_the_status_tool_else_the_calls_own_tool_and_the_routes_interval() -> TestResult {
    let leaves = [
        ("role", "confirm"),
        ("scope", "pay"),
        ("bind", "/amount:decimal"),
        ("upstream_keys", "honoured"),
        ("poll_after_ms", "1500"),
        ("tool", r#"{"name": "execute_transfer"}"#),
    ];
    let own = Ctx { config: config()?, policy: testing::route(&leaves)?, trace_id: "trace-1".into() };
    let p = own.polling();
    assert_eq!((p.poll_with, p.own_tool, p.poll_after_ms), (None, Some("execute_transfer"), 1500));
    let with_status = [&leaves[..], &[("status_tool", "get_status")]].concat();
    let status = Ctx { policy: testing::route(&with_status)?, ..own };
    let p = status.polling();
    assert_eq!((p.poll_with, p.own_tool, p.poll_after_ms), (Some("get_status"), Some("execute_transfer"), 1500));
    Ok(())
}

/// The answers a host gives from the route table itself (a route whose annotation does not parse,
/// a path or method spelled otherwise than a rule's) carry the stream's trace id and what to do.
#[test]
fn the_hosts_route_answers_carry_the_trace_and_what_to_do() -> TestResult {
    let c = config()?;
    let json = |r: crate::reply::Reply| serde_json::from_slice::<Value>(&r.body);
    let v = json(super::misconfigured(&c, "trace-9"))?;
    assert_eq!((v["status"].as_str(), v["trace_id"].as_str()), (Some("status_unavailable"), Some("trace-9")), "{v}");
    assert_eq!(v["retry_after_ms"].as_u64(), Some(c.defaults.retry_after_ms), "{v}");
    let v = json(super::not_canonical(&c, "trace-9", "/v1/transfers"))?;
    assert_eq!(v["trace_id"], "trace-9", "{v}");
    assert!(v["detail"].as_str().is_some_and(|d| d.contains("/v1/transfers")), "{v}");
    let v = json(super::method_not_guarded(&c, "trace-9", "POST is guarded here"))?;
    assert_eq!((v["trace_id"].as_str(), v["detail"].as_str()), (Some("trace-9"), Some("POST is guarded here")), "{v}");
    Ok(())
}

/// The head reads what the role needs and nothing else: a header a role does not read is never
/// refused there, however odd (twice, not text), and never read into the head. The trace context is
/// read on every role.
#[test]
fn the_head_reads_only_what_the_role_needs_and_always_the_trace() -> TestResult {
    let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let odd = |name: &str| vec![(name.to_string(), vec![0xE9, 0xFF]), (name.to_string(), b"x".to_vec())];
    let nothing = HeadNeeds::default();
    for name in [FINGERPRINT_HEADER, MCP_METHOD_HEADER, MCP_NAME_HEADER, ":path", ":method"] {
        let h = RequestHead::from_headers(&odd(name), nothing, None);
        assert_eq!((h.repeated, h.not_text), (None, None), "{name}");
        assert!(h.fingerprint.is_none() && h.mcp_method.is_none() && h.mcp_name.is_none(), "{name}");
        assert!(h.path.is_empty() && h.method.is_empty(), "{name}");
    }
    let traced = pairs(&[("traceparent", tp), ("tracestate", "vendor=1")]);
    for needs in [nothing, HeadNeeds::for_role(Role::Confirm), HeadNeeds::for_role(Role::Mcp)] {
        let h = RequestHead::from_headers(&traced, needs, None);
        assert_eq!(h.trace, crate::trace::Trace::of(None, Some(tp), Some("vendor=1")));
    }
    Ok(())
}

/// Each role's own headers: an MCP call carries its fingerprint in the call's arguments and takes
/// no client key, a status lookup reads no method, a preview that binds only body fields reads
/// neither its path nor every header. What a role does not read, it never refuses.
#[test]
fn each_role_reads_its_own_headers() -> TestResult {
    let odd = |name: &str| vec![(name.to_string(), vec![0xE9, 0xFF]), (name.to_string(), b"x".to_vec())];
    for name in [FINGERPRINT_HEADER, IDEMPOTENCY_KEY_HEADER] {
        let h = RequestHead::from_headers(&odd(name), HeadNeeds::for_role(Role::Mcp), None);
        assert_eq!((h.repeated, h.not_text, h.fingerprint, h.idempotency_key), (None, None, None, None), "{name}");
    }
    let h = RequestHead::from_headers(&odd(":method"), HeadNeeds::for_role(Role::Status), None);
    assert_eq!((h.repeated, h.not_text, h.method.as_str()), (None, None, ""));
    // A value bound in the path or the query is read from the path, whatever the role.
    for bind in ["path:account, /amount:decimal", "query:currency, /amount:decimal"] {
        let leaves =
            [("role", "preview"), ("scope", "pay"), ("template", "/v1/accounts/{account}/quotes"), ("bind", bind)];
        assert!(HeadNeeds::for_policy(&*testing::route(&leaves)?).path, "{bind}");
    }
    assert!(HeadNeeds::for_policy(&*policy("confirm", "envelope")?).path, "a confirm reads its path");
    let preview = HeadNeeds::for_policy(&*policy("preview", "envelope")?);
    assert!(!preview.path && !preview.headers, "{preview:?}");
    let h = RequestHead::from_headers(&odd(":path"), preview, None);
    assert_eq!((h.repeated, h.not_text), (None, None));
    Ok(())
}

/// A subject header configured with `_` has its dashed spelling as a second copy; no other header
/// is one.
#[test]
fn a_subject_header_spelled_with_underscores_has_its_dashed_alias_and_no_other() -> TestResult {
    let needs = HeadNeeds::for_role(Role::Confirm);
    let subject = Some("x_agent_subject");
    let h = RequestHead::from_headers(&pairs(&[("x_agent_subject", "alice"), ("accept", "*/*")]), needs, subject);
    assert_eq!((h.repeated, h.subject.as_deref()), (None, Some("alice")));
    let h = RequestHead::from_headers(&pairs(&[("x-agent-subject", "mallory")]), needs, subject);
    assert_eq!(h.repeated, Some(SUBJECT_HEADER_LABEL));
    Ok(())
}

/// The replies that need nothing but the defaults say when to retry where their kind does.
#[test]
fn a_simple_reply_carries_the_configured_retry_interval() -> TestResult {
    let c = ctx("status")?;
    let wait = c.config.defaults.retry_after_ms;
    let r = c.simple(ReplyKind::StatusUnavailable).reply().cloned().ok_or("no reply")?;
    let v: Value = serde_json::from_slice(&r.body)?;
    assert_eq!(v["retry_after_ms"].as_u64(), Some(wait), "{v}");
    Ok(())
}

#[test]
fn an_approved_operation_acquires_and_forwards_once() -> TestResult {
    let (mut m, _, mut env) = approval_acquiring("always", 999)?;
    let step = m.on_callout(&answer(200, json!({"outcome": "ACQUIRED", "owner": OWNER})), &mut env)?;
    assert!(step.effects.contains(&Effect::ResumeRequest));
    assert!(step.effects.contains(&Effect::SetRequestHeader(IDEMPOTENCY_KEY_HEADER, KEY.into())));
    Ok(())
}

#[test]
fn past_exp_an_approval_lapses_and_a_rejection_stays() -> TestResult {
    let cases = [
        (approval_view("AWAITING_APPROVAL", 1_000_000), 410, "approval_lapsed"),
        (approval_view("APPROVED", 1_000_000), 410, "approval_lapsed"),
        (approval_view("LAPSED", 1_000_000), 410, "approval_lapsed"),
        (approval_view("REJECTED", 1_000_000), 403, "rejected"),
    ];
    for (view, http, status) in cases {
        let mut env = FixedEnv::at(1000, NONCE);
        let (mut m, _) = Machine::start(approval_ctx("always")?, &head(Some(token(1000)?)), false, &mut env);
        let step = m.on_request_body(&body(json!(10)), &mut env)?;
        assert_eq!(call(&step).map(|c| c.method), Some("GET"), "expired: a lookup, never an acquire");
        let a = answer(404, json!({"error": "not_found", "reaped_possible": false, "approval": view}));
        let step = m.on_callout(&a, &mut env)?;
        assert_eq!(reply_status(&step)?, (http, status.to_string()));
        assert!(!step.effects.contains(&Effect::ResumeRequest));
    }
    Ok(())
}

#[test]
fn the_status_route_reports_awaiting_approved_rejected_and_lapsed() -> TestResult {
    let fp = token(1000)?;
    let cases = [
        (999, "AWAITING_APPROVAL", 200, "awaiting_approval"),
        (999, "APPROVED", 200, "approved"),
        (999, "REJECTED", 200, "rejected"),
        (1000, "AWAITING_APPROVAL", 410, "approval_lapsed"),
        (1000, "APPROVED", 410, "approval_lapsed"),
    ];
    for (now, state, http, status) in cases {
        let mut env = FixedEnv::at(now, NONCE);
        let h = RequestHead { path: format!("/status?fingerprint={fp}"), ..head(None) };
        let (mut m, _) = Machine::start(ctx("status")?, &h, true, &mut env);
        let a = answer(404, json!({"error": "not_found", "approval": approval_view(state, 1_000_000)}));
        let step = m.on_callout(&a, &mut env)?;
        assert_eq!(reply_status(&step)?, (http, status.to_string()), "{now} {state}");
        assert_eq!(reply_json(&step)?["operation"], KEY);
    }
    Ok(())
}
