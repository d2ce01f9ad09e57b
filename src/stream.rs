//! One HTTP stream through the filter: preview mints, confirm verifies and runs
//! the four-state machine through the sidecar, status looks the operation up.
//!
//! Envoy holds the request (headers and body) until the filter resumes it, so
//! nothing reaches the upstream before verification and acquire succeed; and it
//! holds the confirm's answer until the sidecar has recorded it, so a retry that
//! follows the first answer always finds the result to replay.

use crate::metrics::Counter;
use crate::root::Shared;
use crate::sidecar::{self, Call};
use crate::{host, routes};
use idem_core::canonical::{self, BodyError, CanonError};
use idem_core::fingerprint::{self, Claims, Expect, VerifyError};
use idem_core::outcome::{self, Outcome};
use idem_core::policy::{Role, RoutePolicy, SubjectSource};
use idem_core::protocol::{
    AckResponse, AcquireOutcome, AcquireRequest, AcquireResponse, CompleteRequest, OpState, OperationView,
    ReleaseRequest, StoredResult, TerminalState,
};
use idem_core::reply::{self, ReplyContext, ReplyKind};
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;
use std::rc::Rc;

pub const FINGERPRINT_HEADER: &str = "agent-fingerprint";
const FINGERPRINT_FIELD: &str = "fingerprint";

pub struct Stream {
    shared: Rc<Shared>,
    policy: Option<Rc<RoutePolicy>>,
    trace_id: String,
    subject_hash: String,
    /// Preview: the bound fields' hash, computed from the request.
    param_hash: Option<String>,
    /// Confirm/status: the verified fingerprint.
    claims: Option<Claims>,
    /// Confirm: the owner token from ACQUIRED; None means we never forwarded.
    owner: Option<String>,
    /// Preview: the minted fingerprint and its expiry, added to the answer.
    minted: Option<(String, u64)>,
    /// Confirm: the held upstream answer.
    held: Option<Held>,
    /// Confirm: complete/release was sent (once per stream).
    recorded: bool,
    pending: Option<(u32, Call)>,
    /// A local reply was sent: ignore the rest of the stream.
    finished: bool,
}

struct Held {
    status: u16,
    code_details: Option<String>,
    /// Envoy's `x-envoy-attempt-count` (virtual host `include_attempt_count_in_response`).
    attempts: u32,
    headers: Vec<(String, String)>,
}

impl Stream {
    pub fn new(shared: Rc<Shared>) -> Stream {
        Stream {
            shared,
            policy: None,
            trace_id: String::new(),
            subject_hash: String::new(),
            param_hash: None,
            claims: None,
            owner: None,
            minted: None,
            held: None,
            recorded: false,
            pending: None,
            finished: false,
        }
    }

    fn role(&self) -> Option<Role> {
        if self.finished {
            return None;
        }
        self.policy.as_ref().map(|p| p.role)
    }

    fn reply(&mut self, kind: ReplyKind, ctx: ReplyContext) {
        let cfg = &self.shared.config;
        let out = reply::render(kind, cfg.language, &ReplyContext { trace_id: &self.trace_id, ..ctx });
        host::send_reply(out.http_status, &out.headers, &out.body);
        self.finished = true;
    }

    fn reply_simple(&mut self, kind: ReplyKind) -> Action {
        let defaults = &self.shared.config.defaults;
        let ctx = ReplyContext { retry_after_ms: defaults.retry_after_ms, ..Default::default() };
        self.reply(kind, ctx);
        Action::Pause
    }

    fn count(&self, c: Counter) {
        self.shared.metrics.inc(c);
    }

    /// Param tampering and cross-subject use are security events: count them and
    /// log a structured line without the secret or the body.
    fn security_event(&self, kind: &str, nonce: &str) {
        self.count(Counter::SecurityEvents);
        let scope = self.policy.as_ref().map(|p| p.scope.as_str()).unwrap_or("");
        log::warn!(
            "agent_idempotency security_event={kind} trace_id={} scope={scope} nonce={nonce}",
            self.trace_id
        );
    }

    fn subject(&self) -> Option<String> {
        let raw = match &self.shared.config.subject {
            SubjectSource::Header(name) => host::request_header(name),
            SubjectSource::Property(path) => {
                let path: Vec<&str> = path.iter().map(String::as_str).collect();
                host::property_string(&path)
            }
        };
        raw.filter(|s| !s.trim().is_empty())
    }

    fn body_error(&mut self, e: &BodyError) -> Action {
        self.count(Counter::RejectedBody);
        let kind = match e {
            BodyError::TooLarge { .. } => ReplyKind::BodyTooLarge,
            BodyError::Invalid(_) | BodyError::NotAnObject => ReplyKind::InvalidJson,
        };
        self.reply_simple(kind)
    }

    fn field_error(&mut self, e: &CanonError) -> Action {
        self.count(Counter::RejectedBody);
        let detail = e.to_string();
        self.reply(ReplyKind::InvalidField, ReplyContext { detail: Some(&detail), ..Default::default() });
        Action::Pause
    }

    /// Verify a fingerprint against this route and caller; replies and returns
    /// None when it does not pass.
    fn verify(&mut self, token: Option<String>, check_expiry: bool) -> Option<Claims> {
        let Some(token) = token else {
            self.count(Counter::RejectedMissing);
            self.reply_simple(ReplyKind::FingerprintMissing);
            return None;
        };
        let scope = self.policy.as_ref().map(|p| p.scope.clone()).unwrap_or_default();
        let expect = Expect {
            now: host::now_unix_s(),
            check_expiry,
            subject_hash: &self.subject_hash,
            scope: &scope,
            param_hash: None,
        };
        match fingerprint::verify(&self.shared.config.keyring, token.trim(), &expect) {
            Ok(claims) => Some(claims),
            Err(e) => {
                let (counter, kind) = match e {
                    VerifyError::Expired { .. } => (Counter::RejectedExpired, ReplyKind::FingerprintExpired),
                    VerifyError::SubjectMismatch => {
                        self.security_event("cross_subject", "-");
                        (Counter::RejectedForbidden, ReplyKind::Forbidden)
                    }
                    _ => (Counter::RejectedInvalid, ReplyKind::FingerprintInvalid),
                };
                self.count(counter);
                self.reply_simple(kind);
                None
            }
        }
    }

    // ---- preview -------------------------------------------------------

    fn preview_request(&mut self, body: &[u8]) -> Action {
        let Some(policy) = self.policy.clone() else { return Action::Continue };
        let json = match canonical::parse_json_body(body, self.shared.config.max_body_bytes) {
            Ok(v) => v,
            Err(e) => return self.body_error(&e),
        };
        match canonical::param_hash(&json, &policy.bound) {
            Ok(h) => {
                self.param_hash = Some(h);
                Action::Continue
            }
            Err(e) => self.field_error(&e),
        }
    }

    /// Mint at response time, and only for a successful JSON answer: a failed
    /// preview must not hand out something to confirm.
    fn preview_response_headers(&mut self, end_of_stream: bool) -> Action {
        let status = host::response_status();
        let is_json = host::response_header("content-type").is_some_and(|c| c.contains("json"));
        let (Some(policy), Some(param_hash)) = (self.policy.clone(), self.param_hash.clone()) else {
            return Action::Continue;
        };
        if !(200..300).contains(&status) || !is_json {
            self.param_hash = None;
            return Action::Continue;
        }
        let mut nonce = [0u8; 16];
        if let Err(e) = getrandom::fill(&mut nonce) {
            log::error!("no randomness for a nonce ({e}); preview passes without a fingerprint");
            self.param_hash = None;
            return Action::Continue;
        }
        let exp = host::now_unix_s().saturating_add(policy.fingerprint_ttl_s);
        let token =
            fingerprint::mint(&self.shared.config.keyring, nonce, exp, &self.subject_hash, &policy.scope, &param_hash);
        self.count(Counter::Minted);
        host::set_response_header(FINGERPRINT_HEADER, &token);
        host::set_response_header("agent-fingerprint-expires-at", &exp.to_string());
        self.minted = Some((token, exp));
        if end_of_stream {
            return Action::Continue;
        }
        host::remove_response_header("content-length");
        Action::Pause
    }

    fn preview_response_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        let Some((token, exp)) = self.minted.clone() else { return Action::Continue };
        if !end_of_stream {
            return Action::Pause;
        }
        let body = host::response_body(size);
        // A body we cannot extend still carries the fingerprint in the header.
        let Ok(serde_json::Value::Object(mut obj)) = canonical::parse_json_body(&body, self.shared.config.max_response_bytes)
        else {
            return Action::Continue;
        };
        obj.insert(FINGERPRINT_FIELD.into(), serde_json::Value::String(token));
        obj.insert("fingerprint_expires_at".into(), serde_json::Value::from(exp));
        if let Ok(out) = serde_json::to_vec(&obj) {
            host::replace_response_body(size, &out);
        }
        Action::Continue
    }

    // ---- confirm -------------------------------------------------------

    fn confirm_request(&mut self, body: &[u8]) -> Action {
        let Some(policy) = self.policy.clone() else { return Action::Continue };
        let cfg = &self.shared.config;
        let json = match canonical::parse_json_body(body, cfg.max_body_bytes) {
            Ok(v) => v,
            Err(e) => return self.body_error(&e),
        };
        let token = host::request_header(FINGERPRINT_HEADER)
            .or_else(|| json.get(FINGERPRINT_FIELD).and_then(|v| v.as_str()).map(str::to_owned));
        let Some(claims) = self.verify(token, true) else { return Action::Pause };
        let param_hash = match canonical::param_hash(&json, &policy.bound) {
            Ok(h) => h,
            Err(e) => return self.field_error(&e),
        };
        if param_hash != claims.param_hash {
            self.count(Counter::RejectedParams);
            self.security_event("params_changed", &claims.nonce);
            return self.reply_simple(ReplyKind::ParamsChanged);
        }
        self.count(Counter::Verified);
        let req = AcquireRequest {
            key: claims.nonce.clone(),
            param_hash,
            subject_hash: claims.subject_hash.clone(),
            scope: claims.scope.clone(),
            lease_ms: policy.lease_ms,
        };
        self.claims = Some(claims);
        let token = sidecar::post(&self.shared.config, "/v1/acquire", &req);
        self.await_call(token, Call::Acquire, ReplyKind::NotExecuted)
    }

    /// Hold the request until a dispatched callout answers; if it could not
    /// even be dispatched, answer the agent with `on_failure` now.
    fn await_call(&mut self, token: Option<u32>, call: Call, on_failure: ReplyKind) -> Action {
        match token {
            Some(token) => {
                self.pending = Some((token, call));
                Action::Pause
            }
            None => {
                self.count(Counter::SidecarErrors);
                self.reply_simple(on_failure)
            }
        }
    }

    fn on_acquired(&mut self, num_headers: usize, body_size: usize) {
        let (_, answer) = sidecar::answer::<AcquireResponse>(num_headers, body_size);
        let Some(answer) = answer else {
            // Sidecar down, timed out or garbled: nothing was forwarded, so say so.
            self.count(Counter::SidecarErrors);
            self.reply_simple(ReplyKind::NotExecuted);
            return;
        };
        let nonce = self.claims.as_ref().map(|c| c.nonce.clone()).unwrap_or_default();
        match answer.outcome {
            AcquireOutcome::Acquired => {
                self.count(Counter::Acquired);
                self.owner = answer.owner;
                // The nonce is the downstream's idempotency key; Envoy's own retries resend these headers unchanged.
                host::set_request_header("idempotency-key", &nonce);
                host::resume_request();
            }
            AcquireOutcome::Done | AcquireOutcome::Failed => {
                self.count(Counter::Replayed);
                let kind =
                    if answer.outcome == AcquireOutcome::Done { ReplyKind::AlreadyCompleted } else { ReplyKind::AlreadyFailed };
                self.replay(kind, answer.result.as_ref(), false);
            }
            AcquireOutcome::InFlight => {
                self.count(Counter::InProgress);
                self.reply_in_progress();
            }
            AcquireOutcome::NeedsReview => {
                self.count(Counter::NeedsReview);
                self.reply_simple(ReplyKind::NeedsReview);
            }
            AcquireOutcome::ParamMismatch => {
                self.count(Counter::RejectedParams);
                self.security_event("params_changed", &nonce);
                self.reply_simple(ReplyKind::ParamsChanged);
            }
            AcquireOutcome::StoreUnavailable => {
                self.count(Counter::SidecarErrors);
                self.reply_simple(ReplyKind::NotExecuted);
            }
        }
    }

    fn replay(&mut self, kind: ReplyKind, result: Option<&StoredResult>, status_query: bool) {
        let result_ref = match (result, self.policy.as_ref().and_then(|p| p.result_ref.clone())) {
            (Some(r), Some(pointer)) => stored_body(r).and_then(|b| reply::result_ref(&b, &pointer)),
            _ => None,
        };
        self.reply(kind, ReplyContext { result, result_ref, status_query, ..Default::default() });
    }

    /// The route's status tool and polling interval, for in_progress replies.
    fn polling(&self) -> (Option<String>, u64) {
        let policy = self.policy.as_ref();
        let poll_with = policy.and_then(|p| p.status_tool.clone());
        let poll_after_ms = policy.map(|p| p.poll_after_ms).unwrap_or(self.shared.config.defaults.poll_after_ms);
        (poll_with, poll_after_ms)
    }

    fn reply_in_progress(&mut self) {
        let (poll_with, poll_after_ms) = self.polling();
        self.reply(ReplyKind::InProgress, ReplyContext { poll_with: poll_with.as_deref(), poll_after_ms, ..Default::default() });
    }

    /// Replace a held answer that is not the upstream's verdict with a reply for
    /// the model: `OutcomeUnknown` (crash, reset, timeout, 5xx: it may have run,
    /// here is how to find out) or `NotExecuted` (429/503 or a connect failure:
    /// nothing ran, retry after the upstream's Retry-After). The held headers
    /// are still ours to change.
    fn rewrite_held(&self, kind: ReplyKind, buffered: usize) {
        let (poll_with, poll_after_ms) = self.polling();
        let upstream_retry_after_ms = self
            .held
            .as_ref()
            .and_then(|h| h.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case("retry-after")))
            .and_then(|(_, v)| v.trim().parse::<u64>().ok())
            .map(|s| s.saturating_mul(1000));
        let ctx = ReplyContext {
            trace_id: &self.trace_id,
            poll_with: poll_with.as_deref(),
            poll_after_ms,
            retry_after_ms: upstream_retry_after_ms.unwrap_or(self.shared.config.defaults.retry_after_ms),
            ..Default::default()
        };
        let out = reply::render(kind, self.shared.config.language, &ctx);
        host::set_response_header(":status", &out.http_status.to_string());
        for (name, value) in &out.headers {
            host::set_response_header(name, value);
        }
        host::replace_response_body(buffered, &out.body);
    }

    fn confirm_response_headers(&mut self, end_of_stream: bool) -> Action {
        if self.owner.is_none() {
            return Action::Continue;
        }
        let status = host::response_status();
        let code_details = host::property_string(&["response", "code_details"]);
        let attempts = host::response_header("x-envoy-attempt-count").and_then(|a| a.parse().ok()).unwrap_or(1);
        self.held = Some(Held { status, code_details, attempts, headers: host::response_headers() });
        let nonce = self.claims.as_ref().map(|c| c.nonce.clone()).unwrap_or_default();
        host::set_response_header("idempotency-key", &nonce);
        host::set_response_header("idempotent-replayed", "false");
        if end_of_stream {
            return self.record(Vec::new(), None);
        }
        host::remove_response_header("content-length");
        Action::Pause
    }

    fn confirm_response_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        if self.held.is_none() || self.recorded {
            return Action::Continue;
        }
        if size > self.shared.config.max_response_bytes {
            // Too large to keep for replay: record the status and headers only.
            log::warn!("answer over max_response_bytes; recorded without its body (trace_id={})", self.trace_id);
            return self.record(Vec::new(), None);
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = host::response_body(size);
        self.record(body, Some(size))
    }

    /// Record before reply: complete/release, and hold the answer until the sidecar acks.
    /// `buffered`: the size of the complete held body, when there is one to replace.
    fn record(&mut self, body: Vec<u8>, buffered: Option<usize>) -> Action {
        let (Some(held), Some(owner), Some(claims)) = (self.held.as_ref(), self.owner.clone(), self.claims.as_ref()) else {
            return Action::Continue;
        };
        self.recorded = true;
        let key = claims.nonce.clone();
        let call = match outcome::classify(
            held.status,
            held.code_details.as_deref(),
            held.attempts,
            self.policy.as_ref().map(|p| p.outcomes.as_slice()).unwrap_or(&[]),
        ) {
            decided @ (Outcome::Done | Outcome::Failed) => {
                let state = if decided == Outcome::Done { TerminalState::Done } else { TerminalState::Failed };
                let result = StoredResult {
                    status: held.status,
                    headers: idem_core::protocol::replay_headers(&held.headers),
                    body_b64: idem_core::protocol::encode_body(&body),
                };
                let req = CompleteRequest { key, owner, state, result };
                sidecar::post(&self.shared.config, "/v1/complete", &req).map(|t| (t, Call::Complete))
            }
            Outcome::Release => {
                if let Some(size) = buffered {
                    self.rewrite_held(ReplyKind::NotExecuted, size);
                }
                let req = ReleaseRequest { key, owner };
                sidecar::post(&self.shared.config, "/v1/release", &req).map(|t| (t, Call::Release))
            }
            Outcome::Unknown => {
                // Executed or not, nobody can tell yet: the row stays IN_FLIGHT for the reconciler.
                self.count(Counter::UnknownOutcome);
                if let Some(size) = buffered {
                    self.rewrite_held(ReplyKind::OutcomeUnknown, size);
                }
                return Action::Continue;
            }
        };
        match call {
            Some(pending) => {
                self.pending = Some(pending);
                Action::Pause
            }
            None => {
                self.count(Counter::SidecarErrors);
                Action::Continue
            }
        }
    }

    fn on_recorded(&mut self, call: Call, num_headers: usize, body_size: usize) {
        match sidecar::answer::<AckResponse>(num_headers, body_size).1 {
            Some(ack) => {
                let c = if call == Call::Release { Counter::Released } else { Counter::Completed };
                self.count(c);
                if ack.outcome != idem_core::protocol::Ack::Ok {
                    log::warn!("{call:?} answered {:?} (trace_id={})", ack.outcome, self.trace_id);
                }
            }
            // The agent still gets the upstream's answer; the row stays IN_FLIGHT for the reconciler.
            None => self.count(Counter::SidecarErrors),
        }
        host::resume_response();
    }

    // ---- status --------------------------------------------------------

    fn status_request(&mut self, body: &[u8]) -> Action {
        let from_body = || {
            serde_json::from_slice::<serde_json::Value>(body)
                .ok()
                .and_then(|v| v.get(FINGERPRINT_FIELD).and_then(|f| f.as_str()).map(str::to_owned))
        };
        let token = host::request_header(FINGERPRINT_HEADER).or_else(query_fingerprint).or_else(from_body);
        // An agent may poll after the fingerprint expired: expiry is not checked here.
        let Some(claims) = self.verify(token, false) else { return Action::Pause };
        self.count(Counter::StatusLookups);
        let path = format!("/v1/operations/{}", claims.nonce);
        self.claims = Some(claims);
        let token = sidecar::get(&self.shared.config, &path);
        self.await_call(token, Call::Lookup, ReplyKind::StatusUnavailable)
    }

    fn on_looked_up(&mut self, num_headers: usize, body_size: usize) {
        let (status, view) = sidecar::answer::<OperationView>(num_headers, body_size);
        match (status, view) {
            (Some(404), _) => {
                let exp = self.claims.as_ref().map(|c| c.exp).unwrap_or(0);
                if host::now_unix_s() >= exp {
                    // Never executed and can no longer be: a new preview is the only way on.
                    self.reply_simple(ReplyKind::FingerprintExpired);
                } else {
                    let ctx = ReplyContext { fingerprint_expires_at: Some(exp), ..Default::default() };
                    self.reply(ReplyKind::NotYetExecuted, ctx);
                }
            }
            (Some(200), Some(view)) => match view.state {
                OpState::Done => self.replay(ReplyKind::AlreadyCompleted, view.result.as_ref(), true),
                OpState::Failed => self.replay(ReplyKind::AlreadyFailed, view.result.as_ref(), true),
                OpState::InFlight => self.reply_in_progress(),
                OpState::NeedsReview => {
                    self.reply_simple(ReplyKind::NeedsReview);
                }
            },
            _ => {
                self.count(Counter::SidecarErrors);
                self.reply_simple(ReplyKind::StatusUnavailable);
            }
        }
    }

    fn on_request_body_complete(&mut self, body: &[u8]) -> Action {
        match self.role() {
            Some(Role::Preview) => self.preview_request(body),
            Some(Role::Confirm) => self.confirm_request(body),
            Some(Role::Status) => self.status_request(body),
            None => Action::Continue,
        }
    }
}

fn stored_body(r: &StoredResult) -> Option<Vec<u8>> {
    idem_core::protocol::decode_body(&r.body_b64)
}

fn query_fingerprint() -> Option<String> {
    let path = host::request_header(":path")?;
    let query = path.split_once('?')?.1;
    query
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .find(|(k, _)| *k == FINGERPRINT_FIELD)
        .map(|(_, v)| v.to_owned())
}

fn trace_id() -> String {
    if let Some(id) = host::request_header("x-request-id") {
        return id;
    }
    // W3C traceparent: version-traceid-parentid-flags.
    host::request_header("traceparent")
        .and_then(|tp| tp.split('-').nth(1).map(str::to_owned))
        .unwrap_or_default()
}

impl Context for Stream {
    fn on_http_call_response(&mut self, token_id: u32, num_headers: usize, body_size: usize, _num_trailers: usize) {
        let Some((token, call)) = self.pending.take() else { return };
        if token != token_id {
            self.pending = Some((token, call));
            return;
        }
        match call {
            Call::Acquire => self.on_acquired(num_headers, body_size),
            Call::Complete | Call::Release => self.on_recorded(call, num_headers, body_size),
            Call::Lookup => self.on_looked_up(num_headers, body_size),
        }
    }
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let cfg = &self.shared.config;
        let lookup: routes::Lookup = self.shared.routes.lookup(&cfg.defaults, host::now_unix_s());
        let policy = match lookup {
            Ok(Some(p)) => p,
            Ok(None) => return Action::Continue,
            Err(_) => {
                // A confirm route with a broken annotation must not run unprotected.
                self.trace_id = trace_id();
                return self.reply_simple(ReplyKind::NotExecuted);
            }
        };
        self.policy = Some(policy);
        self.trace_id = trace_id();
        let Some(subject) = self.subject() else {
            self.count(Counter::RejectedSubject);
            return self.reply_simple(ReplyKind::SubjectMissing);
        };
        self.subject_hash = fingerprint::subject_hash(&subject);
        let too_large = host::request_header("content-length")
            .and_then(|l| l.parse::<usize>().ok())
            .is_some_and(|l| l > self.shared.config.max_body_bytes);
        if too_large {
            return self.body_error(&BodyError::TooLarge { limit: self.shared.config.max_body_bytes });
        }
        if end_of_stream {
            return self.on_request_body_complete(&[]);
        }
        // Hold the headers until the body is complete and checked.
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.role().is_none() {
            return Action::Continue;
        }
        if body_size > self.shared.config.max_body_bytes {
            return self.body_error(&BodyError::TooLarge { limit: self.shared.config.max_body_bytes });
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = host::request_body(body_size);
        self.on_request_body_complete(&body)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        match self.role() {
            Some(Role::Preview) => self.preview_response_headers(end_of_stream),
            Some(Role::Confirm) => self.confirm_response_headers(end_of_stream),
            _ => Action::Continue,
        }
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        match self.role() {
            Some(Role::Preview) => self.preview_response_body(body_size, end_of_stream),
            Some(Role::Confirm) => self.confirm_response_body(body_size, end_of_stream),
            _ => Action::Continue,
        }
    }
}
