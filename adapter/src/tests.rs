//! The adapter driven through a fake host: what it reads, what it calls, in
//! which order — without Envoy. The real-Envoy suite (tests/) covers the rest.

#![allow(clippy::type_complexity)]

use crate::host::{Host, Level};
use crate::stream::{Action, Shared, Stream};
use idem_core::leases::LeaseBook;
use idem_core::machine::{Callout, CalloutAnswer, Counter, Env};
use idem_core::policy::{encode_pairs, parse_plugin_config, PluginConfig};
use idem_core::protocol::{LeaseRenewal, OwnerToken};
use idem_core::trace::{HostSpan, Trace};
use serde_json::{json, Value};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

type TestResult = Result<(), Box<dyn std::error::Error>>;

#[derive(Default)]
struct Fake {
    request_headers: Vec<(String, String)>,
    response_headers: Vec<(String, String)>,
    properties: HashMap<String, Vec<u8>>,
    property_reads: Cell<usize>,
    header_reads: Cell<usize>,
    response_header_reads: Cell<usize>,
    request_body: Vec<u8>,
    response_body: Vec<u8>,
    calls: Vec<(Vec<(String, String)>, Option<Vec<u8>>)>,
    refuse_dispatch: bool,
    answer: CalloutAnswer,
    replies: Vec<(u16, Vec<(String, String)>, Vec<u8>)>,
    resets: usize,
    resumed_request: usize,
    resumed_response: usize,
    counters: Vec<Counter>,
    now: u64,
    shared: HashMap<String, Vec<u8>>,
    annotation: Vec<(String, String)>,
    /// The host's lease book, shared as a real host's is (it outlives the stream).
    leases: Rc<RefCell<LeaseBook>>,
    /// The tracer's span the stream is in, as the native host reads Envoy's.
    span: Option<HostSpan>,
}

impl Fake {
    /// Route metadata as Envoy hands it over: the whole struct in one property, pairs-encoded.
    fn annotate(&mut self, leaves: &[(&str, &str)]) {
        for (k, v) in leaves {
            self.annotation.retain(|(key, _)| key != k);
            self.annotation.push((k.to_string(), v.to_string()));
        }
        let pairs: Vec<(&str, &[u8])> = self.annotation.iter().map(|(k, v)| (k.as_str(), v.as_bytes())).collect();
        self.properties.insert("xds.route_metadata.filter_metadata.agent_idempotency".into(), encode_pairs(&pairs));
    }
    fn header(list: &[(String, String)], name: &str) -> Option<String> {
        list.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.clone())
    }

    fn last_call_header(&self, name: &str) -> Option<String> {
        self.calls.last().and_then(|(h, _)| Fake::header(h, name))
    }

    fn last_reply_json(&self) -> Value {
        self.replies.last().and_then(|(_, _, b)| serde_json::from_slice(b).ok()).unwrap_or(Value::Null)
    }
}

impl Env for Fake {
    fn now_s(&self) -> u64 {
        self.now
    }
    fn random16(&mut self) -> Option<[u8; 16]> {
        Some([0xab; 16])
    }
    fn shared_get(&self, key: &str) -> Option<Vec<u8>> {
        self.shared.get(key).cloned()
    }
}

impl Host for Fake {
    fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        self.header_reads.set(self.header_reads.get() + 1);
        Fake::header(&self.request_headers, name).map(String::into_bytes)
    }
    fn request_headers(&self) -> Vec<(String, Vec<u8>)> {
        self.header_reads.set(self.header_reads.get() + 1);
        self.request_headers.iter().map(|(k, v)| (k.clone(), v.clone().into_bytes())).collect()
    }
    fn set_request_header(&mut self, name: &str, value: &str) {
        self.request_headers.push((name.into(), value.into()));
    }
    fn remove_request_header(&mut self, name: &str) {
        self.request_headers.retain(|(k, _)| !k.eq_ignore_ascii_case(name));
    }
    fn response_headers(&self) -> Vec<(String, Vec<u8>)> {
        self.response_header_reads.set(self.response_header_reads.get() + 1);
        self.response_headers.iter().map(|(k, v)| (k.clone(), v.clone().into_bytes())).collect()
    }
    fn set_response_header(&mut self, name: &str, value: &str) {
        self.remove_response_header(name);
        self.response_headers.push((name.into(), value.into()));
    }
    fn remove_response_header(&mut self, name: &str) {
        self.response_headers.retain(|(k, _)| !k.eq_ignore_ascii_case(name));
    }
    fn route_annotation(&self) -> Option<Vec<u8>> {
        self.property(&crate::ROUTE_ANNOTATION_PATH)
    }
    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.property_reads.set(self.property_reads.get() + 1);
        self.properties.get(&path.join(".")).cloned()
    }
    fn request_body(&self, size: usize) -> Vec<u8> {
        self.request_body.iter().take(size).copied().collect()
    }
    fn response_body(&self, size: usize) -> Vec<u8> {
        self.response_body.iter().take(size).copied().collect()
    }
    fn replace_response_body(&mut self, old_size: usize, body: &[u8]) {
        assert_eq!(old_size, self.response_body.len(), "the whole buffered body is replaced");
        self.response_body = body.to_vec();
    }
    fn send_reply(&mut self, status: u16, headers: &[(String, String)], body: &[u8]) {
        self.replies.push((status, headers.to_vec(), body.to_vec()));
    }
    fn reset(&mut self) {
        self.resets += 1;
    }
    fn resume_request(&mut self) {
        self.resumed_request += 1;
    }
    fn resume_response(&mut self) {
        self.resumed_response += 1;
    }
    fn dispatch(&mut self, cluster: &str, headers: &[(&str, &str)], body: Option<&[u8]>, _t: Duration) -> Option<u64> {
        assert_eq!(cluster, "idem_sidecar");
        if self.refuse_dispatch {
            return None;
        }
        self.calls
            .push((headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(), body.map(<[u8]>::to_vec)));
        u64::try_from(self.calls.len()).ok()
    }
    fn call_answer(&self, num_headers: usize, _body_size: usize) -> CalloutAnswer {
        if num_headers == 0 {
            return CalloutAnswer::failed();
        }
        self.answer.clone()
    }
    fn count(&mut self, counter: Counter) {
        self.counters.push(counter);
    }
    fn shared_set(&mut self, key: &str, value: &[u8]) {
        self.shared.insert(key.to_string(), value.to_vec());
    }
    fn report(&mut self, cfg: &PluginConfig, call: &Callout, trace: &Trace) -> bool {
        crate::sidecar::dispatch(self, cfg, call, trace).is_some()
    }
    fn active_span(&self) -> Option<HostSpan> {
        self.span.clone()
    }
    fn hold_lease(&mut self, lease: &LeaseRenewal) {
        self.leases.borrow_mut().hold(lease.clone(), self.now * 1000);
    }
    fn end_lease(&mut self, owner: &OwnerToken) {
        self.leases.borrow_mut().end(owner);
    }
    fn log(&self, _level: Level, message: &str) {
        // Logs are checked through the counters; keep the text for failing-test output.
        let _ = message;
    }
}

fn shared() -> Result<Rc<Shared>, Box<dyn std::error::Error>> {
    let text = r#"{"sidecar_cluster":"idem_sidecar","keys":[{"kid":"k1","secret":"0123456789abcdef0123456789abcdef"}],
        "active_kid":"k1","subject":{"header":"x-agent-subject"},"max_response_bytes":100,
        "sidecar_token":{"secret":"test-token-0123456789"}}"#;
    let config = parse_plugin_config(text.as_bytes(), &|_| None)?;
    Ok(Rc::new(Shared::new(config)))
}

const CONFIRM: &[(&str, &str)] = &[
    ("role", "confirm"),
    ("upstream_keys", "honoured"),
    ("scope", "pay"),
    ("bind", "/amount:decimal, /currency"),
    ("status_tool", "get_status"),
];
const PREVIEW: &[(&str, &str)] = &[("role", "preview"), ("scope", "pay"), ("bind", "/amount:decimal, /currency")];

fn request(fake: &mut Fake, body: &Value, extra: &[(&str, &str)]) {
    fake.request_headers = vec![
        (":path".into(), "/x".into()),
        ("x-agent-subject".into(), "alice".into()),
        ("x-request-id".into(), "trace-7".into()),
    ];
    fake.request_headers.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    fake.request_body = body.to_string().into_bytes();
}

fn respond(s: &mut Stream<Fake>, status: u16, body: &[u8]) {
    let h = s.host_mut();
    h.response_headers = vec![
        (":status".into(), status.to_string()),
        ("content-type".into(), "application/json".into()),
        ("content-length".into(), body.len().to_string()),
    ];
    h.response_body = body.to_vec();
    h.properties.insert("response.code_details".into(), b"via_upstream".to_vec());
}

/// Preview through the adapter; returns the fingerprint it minted into the body.
fn preview(shared: &Rc<Shared>) -> Result<String, Box<dyn std::error::Error>> {
    let mut fake = Fake { now: 100, ..Default::default() };
    fake.annotate(PREVIEW);
    request(&mut fake, &json!({"amount": 10, "currency": "EUR"}), &[]);
    let mut s = Stream::new(Rc::clone(shared), fake);
    // The headers wait for the body (hashed, checked), then go upstream together with it.
    assert_eq!(s.on_request_headers(false), Action::Pause);
    assert_eq!(s.on_request_body(5, false), Action::Pause);
    let size = s.host().request_body.len();
    assert_eq!(s.on_request_body(size, true), Action::Continue);
    respond(&mut s, 200, br#"{"quote":"ok"}"#);
    // A JSON answer of known length streams: its headers go on at once, with the length the
    // spliced body will have.
    assert_eq!(s.on_response_headers(false), Action::Continue);
    let length = Fake::header(&s.host().response_headers, "content-length");
    let n = s.host().response_body.len();
    assert_eq!(s.on_response_body(n, true), Action::Continue);
    let body: Value = serde_json::from_slice(&s.host().response_body)?;
    assert_eq!(body["quote"], "ok");
    assert_eq!(length, Some(s.host().response_body.len().to_string()), "the headers announced the spliced length");
    assert_eq!(Fake::header(&s.host().response_headers, "agent-fingerprint").as_deref(), body["fingerprint"].as_str());
    assert!(s.host().calls.is_empty(), "a preview does no I/O");
    Ok(body["fingerprint"].as_str().ok_or("no fingerprint")?.to_string())
}

/// A preview's answer head comes from one read of the header map; a coding or a length sent twice
/// is read whole: two codings are a list (the body is not spliced), two lengths that disagree are
/// no length (the answer is held), never the first value alone.
#[test]
fn a_preview_reads_its_answer_head_once_and_repeats_whole() -> TestResult {
    let shared = shared()?;
    let answer = br#"{"quote":"ok"}"#;
    let codings = [("content-encoding", "identity"), ("content-encoding", "gzip")];
    let lengths = [("content-length", "999")];
    for (extra, streamed, spliced) in [(&[][..], true, true), (&codings[..], true, false), (&lengths[..], false, true)]
    {
        let mut fake = Fake { now: 100, ..Default::default() };
        fake.annotate(PREVIEW);
        request(&mut fake, &json!({"amount": 10, "currency": "EUR"}), &[]);
        let mut s = Stream::new(Rc::clone(&shared), fake);
        assert_eq!(s.on_request_headers(false), Action::Pause);
        let size = s.host().request_body.len();
        assert_eq!(s.on_request_body(size, true), Action::Continue);
        respond(&mut s, 200, answer);
        s.host_mut().response_headers.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let action = s.on_response_headers(false);
        assert_eq!(s.host().response_header_reads.get(), 1, "{extra:?}: one read of the answer's head");
        assert_eq!(action == Action::Continue, streamed, "{extra:?}");
        let n = s.host().response_body.len();
        assert_eq!(s.on_response_body(n, true), Action::Continue);
        let body: Value = serde_json::from_slice(&s.host().response_body)?;
        assert_eq!(body.get("fingerprint").is_some(), spliced, "{extra:?}");
        assert!(Fake::header(&s.host().response_headers, "agent-fingerprint").is_some(), "{extra:?}");
    }
    Ok(())
}

/// A confirm stream whose request body has been seen (acquire pending).
fn confirm(shared: &Rc<Shared>, fp: &str, now: u64) -> Stream<Fake> {
    let mut fake = Fake { now, ..Default::default() };
    fake.annotate(CONFIRM);
    request(
        &mut fake,
        &json!({"amount": "10.00", "currency": "EUR", "memo": "x"}),
        &[("agent-fingerprint", fp), ("idempotency-key", "client-chosen")],
    );
    let mut s = Stream::new(Rc::clone(shared), fake);
    assert_eq!(s.on_request_headers(false), Action::Pause);
    s
}

/// Feed an answer for the pending call.
fn answer(s: &mut Stream<Fake>, status: u16, body: Value) {
    let token = u64::try_from(s.host().calls.len()).unwrap_or(0);
    s.host_mut().answer = CalloutAnswer { status: Some(status), body: body.to_string().into_bytes() };
    s.on_callout_answer(token, 1, 0);
}

#[test]
fn unannotated_route_costs_one_property_read() -> TestResult {
    let mut fake = Fake::default();
    request(&mut fake, &json!({}), &[]);
    let mut s = Stream::new(shared()?, fake);
    assert_eq!(s.on_request_headers(false), Action::Continue);
    assert_eq!(s.on_request_body(2, true), Action::Continue);
    assert_eq!(s.on_response_headers(false), Action::Continue);
    assert_eq!(s.on_response_body(2, true), Action::Continue);
    assert_eq!(s.host().property_reads.get(), 1);
    assert_eq!(s.host().header_reads.get(), 0);
    assert!(s.host().counters.is_empty());
    Ok(())
}

#[test]
fn confirm_end_to_end_through_the_adapter() -> TestResult {
    let shared = shared()?;
    let fp = preview(&shared)?;
    let mut s = confirm(&shared, &fp, 200);
    assert_eq!(Fake::header(&s.host().request_headers, "idempotency-key"), None, "a client key never goes upstream");
    // The body arrives in three chunks; it is read once, at the end.
    assert_eq!(s.on_request_body(10, false), Action::Pause);
    assert_eq!(s.on_request_body(20, false), Action::Pause);
    let size = s.host().request_body.len();
    assert_eq!(s.on_request_body(size, true), Action::Pause);
    assert_eq!(s.host().calls.len(), 1);
    assert_eq!(s.host().last_call_header(":path").as_deref(), Some("/v1/acquire"));
    assert_eq!(s.host().last_call_header("authorization").as_deref(), Some("Bearer test-token-0123456789"));
    assert_eq!(s.host().last_call_header("x-request-id").as_deref(), Some("trace-7"));

    answer(&mut s, 200, json!({"outcome": "ACQUIRED", "owner": "22222222222222222222222222222222"}));
    assert_eq!(s.host().resumed_request, 1);
    let key = Fake::header(&s.host().request_headers, "idempotency-key").ok_or("no key")?;
    assert_eq!(key, "ab".repeat(16));

    respond(&mut s, 201, br#"{"id":"T-1"}"#);
    assert_eq!(s.on_response_headers(false), Action::Pause);
    let n = s.host().response_body.len();
    assert_eq!(s.on_response_body(n, true), Action::Pause);
    assert_eq!(s.host().last_call_header(":path").as_deref(), Some("/v1/complete"));
    let (_, body) = s.host().calls.last().ok_or("no call")?;
    let sent: Value = serde_json::from_slice(body.as_deref().unwrap_or_default())?;
    assert_eq!(
        (sent["key"].as_str(), sent["state"].as_str(), sent["trace_id"].as_str()),
        (Some(key.as_str()), Some("DONE"), Some("trace-7"))
    );
    assert_eq!(s.host().resumed_response, 0, "held until the record is acked");
    answer(&mut s, 200, json!({"outcome": "OK"}));
    assert_eq!(s.host().resumed_response, 1);
    assert_eq!(s.host().response_body, br#"{"id":"T-1"}"#, "the agent gets the upstream's answer");
    assert_eq!(s.host().counters, vec![Counter::Verified, Counter::Acquired, Counter::Completed]);
    Ok(())
}

/// A confirm forwarded under an acquired lease, with the host's book.
/// Every callout of a request continues the request's trace (DESIGN §8): idemd's spans are
/// children of the span it arrived in (Envoy's own, when Envoy traces), and when nobody traces,
/// all of one request's callouts name one new trace.
#[test]
fn every_callout_carries_the_requests_trace_context() -> TestResult {
    let shared = shared()?;
    let fp = preview(&shared)?;
    let traced = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let envoy = HostSpan { trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(), span_id: "1111222233334444".into() };
    let in_envoy = "00-4bf92f3577b34da6a3ce929d0e0e4736-1111222233334444-01";
    for (span, extra, want) in [
        (None, vec![("traceparent", traced), ("tracestate", "envoy=1")], Some((traced, Some("envoy=1")))),
        (Some(envoy), vec![("traceparent", traced), ("tracestate", "envoy=1")], Some((in_envoy, Some("envoy=1")))),
        (None, vec![("traceparent", "00-not-a-trace-01")], None),
        (None, vec![], None),
    ] {
        let mut fake = Fake { now: 200, span, ..Default::default() };
        fake.annotate(CONFIRM);
        let mut headers = vec![("agent-fingerprint", fp.as_str())];
        headers.extend(extra);
        request(&mut fake, &json!({"amount": "10.00", "currency": "EUR"}), &headers);
        let mut s = Stream::new(Rc::clone(&shared), fake);
        assert_eq!(s.on_request_headers(false), Action::Pause);
        let size = s.host().request_body.len();
        assert_eq!(s.on_request_body(size, true), Action::Pause);
        let acquire = (s.host().last_call_header("traceparent"), s.host().last_call_header("tracestate"));
        answer(&mut s, 200, json!({"outcome": "ACQUIRED", "owner": "22222222222222222222222222222222"}));
        respond(&mut s, 201, br#"{"id":"T-1"}"#);
        assert_eq!(s.on_response_headers(false), Action::Pause);
        let n = s.host().response_body.len();
        assert_eq!(s.on_response_body(n, true), Action::Pause);
        assert_eq!(s.host().last_call_header(":path").as_deref(), Some("/v1/complete"));
        let complete = (s.host().last_call_header("traceparent"), s.host().last_call_header("tracestate"));
        assert_eq!(acquire, complete, "one request, one trace context on all its callouts");
        let (tp, ts) = acquire;
        let tp = tp.ok_or("a callout without traceparent")?;
        match want {
            Some((parent, state)) => assert_eq!((tp.as_str(), ts.as_deref()), (parent, state)),
            None => {
                // A new trace, sampled, named by the request id "trace-7" (not itself a trace id).
                let parts: Vec<&str> = tp.split('-').collect();
                assert_eq!((parts.len(), parts[0], parts[1].len(), parts[2].len(), parts[3]), (4, "00", 32, 16, "01"));
                assert_eq!(ts, None, "a tracestate travels only with the traceparent it belongs to");
            }
        }
    }
    Ok(())
}

fn forwarded(shared: &Rc<Shared>) -> Result<(Stream<Fake>, Rc<RefCell<LeaseBook>>), Box<dyn std::error::Error>> {
    let fp = preview(shared)?;
    let mut s = confirm(shared, &fp, 200);
    let book = Rc::clone(&s.host().leases);
    let size = s.host().request_body.len();
    s.on_request_body(size, true);
    answer(&mut s, 200, json!({"outcome": "ACQUIRED", "owner": "22222222222222222222222222222222"}));
    assert_eq!(s.host().resumed_request, 1);
    Ok((s, book))
}

#[test]
fn the_host_keeps_the_lease_while_the_request_is_upstream() -> TestResult {
    let shared = shared()?;
    let (mut s, book) = forwarded(&shared)?;
    assert_eq!(book.borrow().len(), 1, "forwarded: the lease is renewed from now on");
    let renewal = book.borrow_mut().due(200_000 + 20_000).ok_or("a third of the lease passed, nothing due")?;
    assert_eq!(renewal.path, "/v1/renew");
    respond(&mut s, 201, br#"{"id":"T-1"}"#);
    assert_eq!(s.on_response_headers(false), Action::Pause);
    assert_eq!(book.borrow().len(), 1, "the answer's body is still upstream");
    let n = s.host().response_body.len();
    s.on_response_body(n, true);
    assert!(book.borrow().is_empty(), "the answer is whole");
    Ok(())
}

#[test]
fn a_stream_gone_mid_request_stops_renewing() -> TestResult {
    // Envoy destroys a stream the client reset; from then on the lease runs out by itself.
    let shared = shared()?;
    let (s, book) = forwarded(&shared)?;
    assert_eq!(book.borrow().len(), 1);
    drop(s);
    assert!(book.borrow().is_empty());
    Ok(())
}

#[test]
fn a_callout_that_cannot_be_dispatched_is_answered_at_once() -> TestResult {
    let shared = shared()?;
    let fp = preview(&shared)?;
    let mut s = confirm(&shared, &fp, 200);
    s.host_mut().refuse_dispatch = true;
    let size = s.host().request_body.len();
    assert_eq!(s.on_request_body(size, true), Action::Pause);
    let (status, _, _) = s.host().replies.last().ok_or("no reply")?.clone();
    assert_eq!(status, 503);
    assert_eq!(s.host().last_reply_json()["status"], "status_unavailable");
    assert_eq!(s.host().resumed_request, 0);
    assert!(s.host().counters.contains(&Counter::SidecarErrors));
    Ok(())
}

/// An event the machine cannot take where it stands (Envoy's own reply, e.g. a request timeout,
/// passing this filter while the acquire is still out) refuses the stream: continuing would let
/// the request go on unjudged (DESIGN §6: fail closed). Once the answer reached the filter, the
/// refusal is a reset: a reply is no longer ours to send.
#[test]
fn an_event_the_machine_cannot_take_refuses_the_stream() -> TestResult {
    let shared = shared()?;
    let fp = preview(&shared)?;
    let mut s = confirm(&shared, &fp, 200);
    let size = s.host().request_body.len();
    assert_eq!(s.on_request_body(size, true), Action::Pause);
    assert_eq!(s.host().calls.len(), 1, "the acquire is out");
    // An answer while the acquire is out: the machine has forwarded nothing.
    respond(&mut s, 504, b"upstream request timeout");
    assert_eq!(s.on_response_headers(false), Action::Pause);
    assert_eq!((s.host().replies.len(), s.host().resets), (0, 1), "the answer began: a reset");
    assert_eq!(s.host().resumed_request, 0);
    // The acquire's late answer finds nothing pending: nothing is forwarded.
    answer(&mut s, 200, json!({"outcome": "ACQUIRED", "owner": "22222222222222222222222222222222"}));
    assert_eq!(s.host().resumed_request, 0);
    assert_eq!(Fake::header(&s.host().request_headers, "idempotency-key"), None);

    Ok(())
}

#[test]
fn a_failed_callout_answer_is_not_a_claim_that_nothing_ran() -> TestResult {
    let shared = shared()?;
    let fp = preview(&shared)?;
    let mut s = confirm(&shared, &fp, 200);
    let size = s.host().request_body.len();
    s.on_request_body(size, true);
    s.on_callout_answer(1, 0, 0);
    assert_eq!(s.host().last_reply_json()["status"], "status_unavailable");
    assert_eq!(s.host().resumed_request, 0);
    // A stale token (another stream's, or late) changes nothing.
    s.on_callout_answer(99, 1, 0);
    assert_eq!(s.host().replies.len(), 1);
    Ok(())
}

#[test]
fn an_answer_too_large_to_record_passes_after_a_headers_only_record() -> TestResult {
    let shared = shared()?;
    let fp = preview(&shared)?;
    let mut s = confirm(&shared, &fp, 200);
    let size = s.host().request_body.len();
    s.on_request_body(size, true);
    answer(&mut s, 200, json!({"outcome": "ACQUIRED", "owner": "22222222222222222222222222222222"}));
    respond(&mut s, 201, &[b'x'; 150]);
    assert_eq!(s.on_response_headers(false), Action::Pause);
    assert_eq!(s.on_response_body(150, false), Action::Pause);
    let (_, body) = s.host().calls.last().ok_or("no call")?;
    let sent: Value = serde_json::from_slice(body.as_deref().unwrap_or_default())?;
    assert_eq!(sent["result"]["body_b64"], "");
    answer(&mut s, 200, json!({"outcome": "OK"}));
    assert_eq!(s.host().resumed_response, 1);
    assert_eq!(s.on_response_body(150, true), Action::Continue);
    Ok(())
}

#[test]
fn expired_confirm_asks_before_it_answers() -> TestResult {
    let shared = shared()?;
    let fp = preview(&shared)?;
    let mut s = confirm(&shared, &fp, 100 + 900);
    let size = s.host().request_body.len();
    s.on_request_body(size, true);
    assert_eq!(s.host().last_call_header(":method").as_deref(), Some("GET"));
    assert_eq!(s.host().last_call_header(":path"), Some(format!("/v1/operations/{}?exp=1000", "ab".repeat(16))));
    answer(&mut s, 404, json!({"error": "not_found"}));
    assert_eq!(s.host().last_reply_json()["status"], "fingerprint_expired");
    Ok(())
}

#[test]
fn route_policies_are_keyed_by_annotation_not_by_name() -> TestResult {
    let shared = shared()?;
    let fp = preview(&shared)?;
    // Same route name, one unannotated: it passes, and the confirm route is still guarded.
    let mut plain = Fake::default();
    plain.properties.insert("xds.route_name".into(), b"default".to_vec());
    request(&mut plain, &json!({}), &[]);
    let mut s = Stream::new(Rc::clone(&shared), plain);
    assert_eq!(s.on_request_headers(false), Action::Continue);
    let mut guarded = confirm(&shared, &fp, 200);
    guarded.host_mut().properties.insert("xds.route_name".into(), b"default".to_vec());
    let size = guarded.host().request_body.len();
    assert_eq!(guarded.on_request_body(size, true), Action::Pause);
    assert_eq!(guarded.host().last_call_header(":path").as_deref(), Some("/v1/acquire"));
    // A route re-annotated (another scope) gets its own policy at once: the old fingerprint no longer fits.
    let mut moved = Fake { now: 200, ..Default::default() };
    moved.annotate(CONFIRM);
    moved.annotate(&[("scope", "refunds")]);
    request(&mut moved, &json!({"amount": 10, "currency": "EUR"}), &[("agent-fingerprint", &fp)]);
    let mut s = Stream::new(Rc::clone(&shared), moved);
    assert_eq!(s.on_request_headers(false), Action::Pause);
    let size = s.host().request_body.len();
    s.on_request_body(size, true);
    assert_eq!(s.host().last_reply_json()["status"], "fingerprint_invalid");
    assert_eq!(shared.routes.len(), 3);
    Ok(())
}

#[test]
fn a_broken_annotation_never_runs_unguarded() -> TestResult {
    let mut fake = Fake::default();
    fake.annotate(&[("role", "confirm"), ("scope", "pay")]);
    request(&mut fake, &json!({}), &[]);
    let mut s = Stream::new(shared()?, fake);
    assert_eq!(s.on_request_headers(false), Action::Pause);
    assert_eq!(s.host().replies.first().map(|r| r.0), Some(503));
    assert_eq!(s.host().counters, vec![Counter::RejectedMisconfigured], "an operator sees it (IdemRouteMisconfigured)");
    Ok(())
}

#[test]
fn route_rules_guard_routes_without_metadata_and_metadata_wins() -> TestResult {
    let text = r#"{"sidecar_cluster":"idem_sidecar","keys":[{"kid":"k1","secret":"0123456789abcdef0123456789abcdef"}],
        "active_kid":"k1","subject":{"header":"x-agent-subject"},
        "routes":[{"name":"confirm","match":{"method":"POST","path":"/v1/transfers"},"role":"confirm","upstream_keys":"honoured","scope":"pay","bind":"/amount"}]}"#;
    let config = parse_plugin_config(text.as_bytes(), &|_| None)?;
    let shared = Rc::new(Shared::new(config));
    let start = |method: &str, path: &str, annotate: bool| {
        let mut fake = Fake::default();
        request(&mut fake, &json!({"amount": 1}), &[(":method", method), (":authority", "pay.example")]);
        fake.request_headers.retain(|(k, _)| k != ":path");
        fake.request_headers.push((":path".into(), path.into()));
        if annotate {
            fake.annotate(&[("role", "preview"), ("scope", "pay"), ("bind", "/amount")]);
        }
        let mut s = Stream::new(Rc::clone(&shared), fake);
        let action = s.on_request_headers(false);
        (action, s)
    };
    // A rule guards the route: the confirm waits for its body and then wants a fingerprint.
    let (action, mut s) = start("POST", "/v1/transfers?trace=1", false);
    assert_eq!(action, Action::Pause);
    let size = s.host().request_body.len();
    s.on_request_body(size, true);
    assert_eq!(s.host().last_reply_json()["status"], "fingerprint_missing");
    // Other methods on the guarded path are refused, nothing forwarded (unguarded, a PUT would reach
    // an upstream that serves any method); other paths pass, and a path no rule has is told from the path alone
    // (one header read).
    for method in ["GET", "PUT", "PATCH", "DELETE"] {
        let (action, s) = start(method, "/v1/transfers", false);
        assert_eq!(action, Action::Pause, "{method}");
        assert_eq!(s.host().last_reply_json()["status"], "path_not_canonical", "{method}");
        assert_eq!((s.host().resumed_request, s.host().counters.as_slice()), (0, &[Counter::RejectedHeader][..]));
    }
    let (action, s) = start("POST", "/v1/transfers/x", false);
    assert_eq!((action, s.host().header_reads.get()), (Action::Continue, 1));
    // Another spelling of the guarded request is refused, never passed (DESIGN §6).
    for (method, path) in [("POST", "/V1/Transfers"), ("post", "/v1/transfers"), ("POST", "/v1//transfers/")] {
        let (action, s) = start(method, path, false);
        assert_eq!(action, Action::Pause, "{method} {path}");
        assert_eq!(s.host().last_reply_json()["status"], "path_not_canonical", "{method} {path}");
    }
    // An override header in either spelling: a CGI-style server reads `x_http_method_override` as
    // `X-HTTP-Method-Override`.
    for header in ["x-http-method-override", "x_http_method_override", "x_method_override"] {
        let (action, s) = {
            let mut fake = Fake::default();
            request(&mut fake, &json!({"amount": 1}), &[(":method", "GET"), (":authority", "pay.example")]);
            fake.request_headers.push((header.into(), "POST".into()));
            fake.request_headers.retain(|(k, _)| k != ":path");
            fake.request_headers.push((":path".into(), "/v1/transfers".into()));
            let mut s = Stream::new(Rc::clone(&shared), fake);
            (s.on_request_headers(false), s)
        };
        let status = s.host().last_reply_json()["status"].as_str().map(str::to_owned);
        assert_eq!((action, status.as_deref()), (Action::Pause, Some("path_not_canonical")), "{header}");
    }
    // A method the rule lets pass goes on unguarded; the others stay refused.
    let text = text.replace(
        r#""match":{"method":"POST","path":"/v1/transfers"},"#,
        r#""match":{"method":"POST","path":"/v1/transfers"},"pass_methods":["GET"],"#,
    );
    let passing = Rc::new(Shared::new(parse_plugin_config(text.as_bytes(), &|_| None)?));
    for (method, want) in [("GET", Action::Continue), ("PUT", Action::Pause)] {
        let mut fake = Fake::default();
        request(&mut fake, &json!({"amount": 1}), &[(":method", method), (":authority", "pay.example")]);
        fake.request_headers.retain(|(k, _)| k != ":path");
        fake.request_headers.push((":path".into(), "/v1/transfers".into()));
        let mut s = Stream::new(Rc::clone(&passing), fake);
        assert_eq!(s.on_request_headers(false), want, "{method}");
    }
    // Route metadata wins over a rule: this route is a preview, which needs no fingerprint.
    let (action, mut s) = start("POST", "/v1/transfers", true);
    assert_eq!(action, Action::Pause);
    let size = s.host().request_body.len();
    assert_eq!(s.on_request_body(size, true), Action::Continue);
    assert!(s.host().replies.is_empty(), "no fingerprint asked for: the body goes on with its headers");
    Ok(())
}

/// A host without a usable filter says what a stream with one says of a broken route: one rule.
#[test]
fn a_refusal_without_a_filter_is_the_misconfigured_reply() -> TestResult {
    let shared = shared()?;
    let with = idem_core::machine::misconfigured(&shared.config, "trace-9");
    let without = crate::Refusal::of(&shared.config).reply("trace-9");
    assert_eq!((with.http_status, &with.headers, &with.body), (without.http_status, &without.headers, &without.body));
    let unconfigured = crate::Refusal::unconfigured().reply("trace-9");
    assert_eq!(unconfigured.http_status, 503);
    let body: Value = serde_json::from_slice(&unconfigured.body)?;
    assert_eq!((body["status"].as_str(), body["trace_id"].as_str()), (Some("status_unavailable"), Some("trace-9")));
    Ok(())
}
