//! Confirm: verify → acquire → forward with the nonce as `Idempotency-Key` →
//! hold the answer → classify → complete or release → reply (DESIGN §4).
//!
//! Two rules shape this file. Expiry only refuses to *start*: an expired but
//! authentic fingerprint asks idemd what became of its operation and answers
//! exactly as before expiry. And no reply says "nothing was executed" unless
//! that is known at that point; when the store cannot be asked, the reply
//! says so instead.
//!
//! The same machine serves client-key mode (`crate::client_key`): a route that
//! allows it names the operation by the caller's own `Idempotency-Key` when no
//! fingerprint is sent; from acquire on, nothing differs but the replies'
//! style (problems for programs, the envelope for agents).

use super::replay_cache::{self, Hit};
use super::{
    body_fingerprint, retry_after_ms, Callout, CalloutAnswer, Counter, Ctx, Effect, Env, Flow, Outcome, RequestHead,
    ResponseHead, Step, Unexpected, IDEMPOTENCY_KEY_HEADER,
};
use crate::canonical::{self, BodyError, CanonError};
use crate::client_key::{self, KeyError};
use crate::outcome::{self, Verdict};
use crate::policy::{Callers, ReplayMode, Role, UpstreamKeys};
use crate::protocol::{
    replay_headers, AckResponse, AcquireOutcome, AcquireRequest, AcquireResponse, ApprovalAsk, CompleteRequest,
    KeyMode, LeaseRenewal, OpKey, OpState, OperationView, OwnerToken, ReleaseRequest, SecurityKind, StoredResult,
    TerminalState,
};
use crate::reply::{self, ReplyContext, ReplyKind};
use std::rc::Rc;

#[derive(Debug)]
pub struct Confirm {
    ctx: Ctx,
    subject_hash: String,
    /// The request's bound values outside its body.
    outside: canonical::Outside,
    /// Client-key mode for programs: problems instead of the envelope, the
    /// upstream's own answer instead of a rewrite.
    problem: bool,
    /// What a replay-cache entry of this operation must match: (param_hash, subject_hash, scope).
    binding: Option<(String, String, String)>,
    phase: Phase,
}

#[derive(Debug)]
enum Phase {
    AwaitBody {
        header_token: Option<String>,
        client_key: Option<String>,
        method: String,
        path: String,
    },
    /// `POST /v1/acquire` is out.
    Acquiring {
        key: OpKey,
    },
    /// Expired: `GET /v1/operations/{nonce}` is out, to answer about what exists.
    CheckingExpired {
        key: OpKey,
    },
    /// We own the operation and the request went upstream.
    Forwarded {
        key: OpKey,
        owner: OwnerToken,
    },
    /// The upstream's head is held until its body is complete.
    Holding {
        key: OpKey,
        owner: OwnerToken,
        head: ResponseHead,
    },
    /// `complete` or `release` is out; the answer is held until it is acked.
    /// A completed result is cached once the store has taken it.
    Recording {
        call: RecordCall,
        recorded: Option<(OpKey, TerminalState, StoredResult)>,
    },
    Finished,
}

/// What an acquire names: the operation and its binding.
struct Operation {
    key: OpKey,
    param_hash: String,
    subject_hash: String,
    scope: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RecordCall {
    Complete,
    Release,
}

impl Confirm {
    pub(super) fn new(ctx: Ctx, subject_hash: String, head: &RequestHead, outside: canonical::Outside) -> Confirm {
        let problem = ctx.speaks_problem();
        let phase = Phase::AwaitBody {
            header_token: head.fingerprint.clone(),
            client_key: head.idempotency_key.clone(),
            method: head.method.clone(),
            path: head.path.clone(),
        };
        Confirm { ctx, subject_hash, outside, problem, binding: None, phase }
    }

    pub(super) fn finished(&self) -> bool {
        matches!(self.phase, Phase::Finished)
    }

    pub(super) fn forwarded(&self) -> bool {
        matches!(self.phase, Phase::Forwarded { .. })
    }

    /// The lease to keep alive: from the forward until the answer is whole (its record is then
    /// one bounded callout away, well inside the lease's last renewal).
    pub(super) fn live_lease(&self) -> Option<LeaseRenewal> {
        match &self.phase {
            Phase::Forwarded { key, owner } | Phase::Holding { key, owner, .. } => {
                Some(LeaseRenewal { key: key.clone(), owner: owner.clone(), lease_ms: self.ctx.policy.lease_ms })
            }
            _ => None,
        }
    }

    pub(super) fn body_limit(&self) -> Option<(&Ctx, usize)> {
        matches!(self.phase, Phase::AwaitBody { .. }).then_some((&self.ctx, self.ctx.config.max_body_bytes))
    }

    fn unexpected(&self, event: &'static str) -> Outcome {
        Err(Unexpected { event, phase: self.phase_name() })
    }

    fn finish(&mut self, step: Step) -> Step {
        self.phase = Phase::Finished;
        step
    }

    pub(super) fn on_request_body(&mut self, body: &[u8], env: &mut dyn Env) -> Outcome {
        let Phase::AwaitBody { header_token, client_key, method, path } = &self.phase else {
            return self.unexpected("request_body");
        };
        let policy = Rc::clone(&self.ctx.policy);
        let json = canonical::parse_json_body(body, self.ctx.config.max_body_bytes);
        // A fingerprint wins; role `idempotent` never takes one. One in the header and another in
        // the body is no fingerprint at all: which one is meant is not ours to guess.
        let token = match policy.role {
            Role::Idempotent => None,
            _ => {
                let in_body = json.as_ref().ok().and_then(body_fingerprint);
                if let (Some(h), Some(b)) = (header_token.as_deref(), in_body.as_deref()) {
                    if h.trim() != b.trim() {
                        let detail = "the Agent-Fingerprint header and the body's fingerprint differ";
                        let ctx = ReplyContext { detail: Some(detail), ..Default::default() };
                        let step = self.reply(ReplyKind::FingerprintInvalid, ctx);
                        return Ok(self.finish(step.with(Effect::Count(Counter::RejectedInvalid))));
                    }
                }
                header_token.clone().or(in_body)
            }
        };
        if token.is_none() && policy.client_keys {
            let (client_key, method, path) = (client_key.clone(), method.clone(), path.clone());
            return Ok(self.client_key_request(body, json, client_key.as_deref(), (&method, &path), env));
        }
        let json = match json {
            Ok(v) => v,
            Err(e) => {
                let step = self.ctx.body_error(&e);
                return Ok(self.finish(step));
            }
        };
        let param_hash = match canonical::request_hash(&json, &self.outside, &policy.bound) {
            Ok(h) => h,
            Err(e) => {
                let step = self.ctx.field_error(&e);
                return Ok(self.finish(step));
            }
        };
        let claims = match self.ctx.verify(token.as_deref(), &self.subject_hash, Some(&param_hash)) {
            Ok(c) => c,
            Err(refusal) => return Ok(self.finish(refusal)),
        };
        let reference = match business_ref(&json, policy.business_ref.as_deref()) {
            Ok(r) => r,
            Err(e) => {
                let step = self.ctx.field_error(&e);
                return Ok(self.finish(step));
            }
        };
        self.binding = Some((param_hash.clone(), claims.subject_hash.clone(), claims.scope.clone()));
        if let Some(step) = self.cached(&claims.nonce, env) {
            return Ok(step);
        }
        // The route's rule reads only bound fields, which the fingerprint just proved: whether a
        // person is asked is decided by the same bytes that name the operation.
        let approval = match policy.approval.as_ref().filter(|a| a.required(&json)) {
            None => None,
            Some(_) => match canonical::canonical_request(&json, &self.outside, &policy.bound) {
                Ok(fields) => Some(ApprovalAsk { fields }),
                Err(e) => {
                    let step = self.ctx.field_error(&e);
                    return Ok(self.finish(step));
                }
            },
        };
        if claims.expired(env.now_s()) {
            // Expiry refuses to start an operation, never to report one that exists.
            let call = Callout { method: "GET", path: lookup_path(&claims.nonce, Some(claims.exp)), body: None };
            self.phase = Phase::CheckingExpired { key: claims.nonce };
            return Ok(Step::pause().with(Effect::Count(Counter::ExpiredLookups)).with(Effect::Call(call)));
        }
        let reference = match self.with_fields(&json, reference) {
            Ok(r) => r,
            Err(refusal) => return Ok(self.finish(refusal)),
        };
        let op = Operation { key: claims.nonce, param_hash, subject_hash: claims.subject_hash, scope: claims.scope };
        Ok(self.acquire(op, Some(claims.exp), reference, approval).with(Effect::Count(Counter::Verified)))
    }

    /// Client-key mode: the operation is named by the caller's key, bound to
    /// its subject and the route's scope; "same payload" is the bound fields,
    /// or the whole request where the route binds none.
    fn client_key_request(
        &mut self,
        body: &[u8],
        json: Result<serde_json::Value, BodyError>,
        header: Option<&str>,
        (method, path): (&str, &str),
        env: &mut dyn Env,
    ) -> Step {
        self.problem = self.ctx.policy.callers == Callers::Programs;
        let key = match client_key::parse_header(header) {
            Ok(k) => k,
            Err(e) => {
                // Client keys are for programs only (the policy refuses them on a route agents call): they
                // are told about the key they can send (docs/programs.md's table).
                let (kind, detail) = match e {
                    KeyError::Missing => (ReplyKind::KeyMissing, None),
                    KeyError::Invalid(why) => (ReplyKind::KeyInvalid, Some(why)),
                };
                let refusal = self.reply(kind, ReplyContext { detail, ..Default::default() });
                return self.finish(refusal.with(Effect::Count(Counter::RejectedMissing)));
            }
        };
        let policy = Rc::clone(&self.ctx.policy);
        let param_hash = if policy.bound.is_empty() {
            client_key::request_hash(method, path, body, json.as_ref().ok())
        } else {
            let hashed = json.as_ref().map_err(|e| self.ctx.body_error_as(e, self.problem)).and_then(|v| {
                canonical::request_hash(v, &self.outside, &policy.bound)
                    .map_err(|e| self.ctx.field_error_as(&e, self.problem))
            });
            match hashed {
                Ok(h) => h,
                Err(refusal) => return self.finish(refusal),
            }
        };
        let reference = match (policy.business_ref.as_deref(), json.as_ref()) {
            (None, _) => None,
            (Some(pointer), Err(_)) => {
                let e = CanonError::WrongType { pointer: pointer.to_string(), expected: BUSINESS_REF_TYPE };
                return self.finish(self.ctx.field_error_as(&e, self.problem));
            }
            (Some(pointer), Ok(v)) => match business_ref(v, Some(pointer)).map(|r| (r, v)) {
                Ok((r, v)) => match self.with_fields(v, r) {
                    Ok(r) => r,
                    Err(refusal) => return self.finish(refusal),
                },
                Err(e) => {
                    let refusal = self.ctx.field_error_as(&e, self.problem);
                    return self.finish(refusal);
                }
            },
        };
        let op = client_key::operation_key(&self.subject_hash, &policy.scope, &key);
        let subject_hash = self.subject_hash.clone();
        self.binding = Some((param_hash.clone(), subject_hash.clone(), policy.scope.clone()));
        if let Some(step) = self.cached(&op, env) {
            return step.with(Effect::Count(Counter::ClientKeyRequests));
        }
        let op = Operation { key: op, param_hash, subject_hash, scope: policy.scope.clone() };
        self.acquire(op, None, reference, None).with(Effect::Count(Counter::ClientKeyRequests))
    }

    /// A terminal result of this very operation in Envoy's shared data: replay
    /// it without a callout, with the checks idemd would make (DESIGN §9).
    fn cached(&mut self, key: &OpKey, env: &mut dyn Env) -> Option<Step> {
        let (param_hash, subject_hash, scope) = self.binding.as_ref()?;
        let slot = replay_cache::slot_key(&self.ctx.config.replay_cache, key)?;
        let raw = env.shared_get(&slot);
        let hit = replay_cache::lookup(raw.as_deref(), key, subject_hash, scope, param_hash, env.now_s())?;
        let step = match hit {
            Hit::Replay(state, result) => {
                self.replay(replay_kind(state), Some(&result)).with(Effect::Count(Counter::ReplayCacheHits))
            }
            Hit::ParamMismatch => self.tampered(key, true),
        };
        Some(self.finish(step))
    }

    /// Remember a terminal result (never anything else) for the next retry.
    fn cache_fill(
        &self,
        key: &OpKey,
        state: TerminalState,
        result: &StoredResult,
        env: &mut dyn Env,
    ) -> Option<Effect> {
        let (param_hash, subject_hash, scope) = self.binding.clone()?;
        let cfg = &self.ctx.config.replay_cache;
        let entry = replay_cache::Entry {
            key: key.clone(),
            state,
            param_hash,
            subject_hash,
            scope,
            result: result.clone(),
            until: env.now_s().saturating_add(cfg.ttl_s),
        };
        replay_cache::store(cfg, &entry)
    }

    /// A business reference with the bound fields' canonical JSON beside it: idemd holds a record the
    /// upstream answers under the reference against them (DESIGN §4, "A reference proves only its own
    /// operation").
    fn with_fields(
        &self,
        json: &serde_json::Value,
        reference: Option<String>,
    ) -> Result<Option<(String, String)>, Step> {
        let Some(reference) = reference else { return Ok(None) };
        match canonical::canonical_request(json, &self.outside, &self.ctx.policy.bound) {
            Ok(fields) => Ok(Some((reference, fields))),
            Err(e) => Err(self.ctx.field_error_as(&e, self.problem)),
        }
    }

    /// `exp`: the fingerprint's, or `None` for a client key; `business_ref`: the confirm's value of
    /// the route's `business_ref` field, for the reconciler, with the bound fields' canonical JSON;
    /// `approval`: what a person must approve first, where the route's rule says so.
    fn acquire(
        &mut self,
        op: Operation,
        exp: Option<u64>,
        business_ref: Option<(String, String)>,
        approval: Option<ApprovalAsk>,
    ) -> Step {
        let Operation { key, param_hash, subject_hash, scope } = op;
        let mode = if exp.is_some() { KeyMode::Fingerprint } else { KeyMode::ClientKey };
        let (business_ref, fields) = business_ref.unzip();
        let req = AcquireRequest {
            key: key.clone(),
            param_hash,
            subject_hash,
            scope,
            approval,
            lease_ms: self.ctx.policy.lease_ms,
            trace_id: self.ctx.trace_id.clone(),
            mode,
            exp,
            upstream_ignores_keys: self.ctx.policy.upstream_keys == UpstreamKeys::Ignored,
            business_ref,
            fields,
        };
        self.phase = Phase::Acquiring { key };
        Step::pause().with(Effect::Call(post("/v1/acquire", &req)))
    }

    /// A reply in this request's style.
    fn reply(&self, kind: ReplyKind, ctx: ReplyContext) -> Step {
        Step::pause().with(Effect::Reply(self.ctx.render_as(kind, ctx, self.problem)))
    }

    pub(super) fn on_callout(&mut self, answer: &CalloutAnswer, env: &mut dyn Env) -> Outcome {
        let phase = std::mem::replace(&mut self.phase, Phase::Finished);
        let step = match phase {
            Phase::Acquiring { key } => self.on_acquired(answer, key, env),
            Phase::CheckingExpired { key } => self.on_expired_lookup(answer, &key, env),
            Phase::Recording { call, recorded } => self.on_recorded(call, recorded, answer, env),
            other => {
                self.phase = other;
                return self.unexpected("callout");
            }
        };
        Ok(step)
    }

    fn on_acquired(&mut self, raw: &CalloutAnswer, key: OpKey, env: &mut dyn Env) -> Step {
        let Some(answer) = raw.json::<AcquireResponse>() else {
            // The acquire may or may not have reached the store; nothing went upstream from here.
            return self.unchecked(&key);
        };
        match answer.outcome {
            AcquireOutcome::Acquired => match answer.owner {
                Some(owner) => {
                    // The operation key is the downstream's idempotency key; Envoy's own retries resend it unchanged.
                    let step = Step::go_on()
                        .with(Effect::Count(Counter::Acquired))
                        .with(Effect::SetRequestHeader(IDEMPOTENCY_KEY_HEADER, key.to_string()))
                        .with(Effect::ResumeRequest);
                    self.phase = Phase::Forwarded { key, owner };
                    step
                }
                // Acquired for an owner we cannot name: never forward; the lease and the reconciler settle it.
                None => self.unchecked(&key),
            },
            AcquireOutcome::Done => self.replay_terminal(&key, TerminalState::Done, answer.result.as_ref(), env),
            AcquireOutcome::Failed => self.replay_terminal(&key, TerminalState::Failed, answer.result.as_ref(), env),
            AcquireOutcome::InFlight => self.in_progress(ReplyKind::InProgress, &key),
            AcquireOutcome::NeedsReview => self.needs_review(&key),
            AcquireOutcome::ParamMismatch => self.tampered(&key, false),
            AcquireOutcome::StoreUnavailable => self.unchecked(&key),
            AcquireOutcome::ReplicationRefused => self.replication_refused(&key),
            // Another operation holds this business reference: nothing recorded, nothing forwarded.
            AcquireOutcome::ReferenceInUse => {
                let ctx = ReplyContext { detail: self.ctx.policy.business_ref.as_deref(), ..Default::default() };
                self.reply(ReplyKind::ReferenceInUse, ctx)
            }
            AcquireOutcome::AwaitingApproval | AcquireOutcome::Rejected | AcquireOutcome::Lapsed => {
                match raw.approval().filter(|v| v.key == key) {
                    Some(view) => self.ctx.approval_reply(&view, env.now_s(), false),
                    // An approval answer without its record: say nothing we cannot back; nothing ran here.
                    None => self.unchecked(&key),
                }
            }
        }
    }

    fn on_expired_lookup(&mut self, answer: &CalloutAnswer, key: &OpKey, env: &mut dyn Env) -> Step {
        match answer.status {
            // Never executed, and a person was asked: what they decided (past exp, lapsed).
            Some(404) if answer.approval().is_some_and(|v| v.key == *key) => match answer.approval() {
                Some(view) => self.ctx.approval_reply(&view, env.now_s(), false),
                None => self.unchecked(key),
            },
            // No row, and none could have been reaped: never started (or released, which means it
            // never ran), and now it cannot start.
            Some(404) if !answer.reaped_possible() => {
                self.ctx.simple(ReplyKind::FingerprintExpired).with(Effect::Count(Counter::RejectedExpired))
            }
            // No row any more, and one may have been: nothing is known, and nothing may be claimed.
            Some(404) => self.record_gone(key),
            Some(200) => match answer.json::<OperationView>() {
                Some(view) => match view.state {
                    OpState::Done => self.replay_terminal(key, TerminalState::Done, view.result.as_ref(), env),
                    OpState::Failed => self.replay_terminal(key, TerminalState::Failed, view.result.as_ref(), env),
                    OpState::InFlight => self.in_progress(ReplyKind::InProgress, key),
                    OpState::NeedsReview => self.needs_review(key),
                },
                None => self.unchecked(key),
            },
            _ => self.unchecked(key),
        }
    }

    fn record_gone(&self, key: &OpKey) -> Step {
        let ctx = ReplyContext { operation: Some(key), ..Default::default() };
        self.reply(ReplyKind::RecordGone, ctx).with(Effect::Count(Counter::RejectedExpired))
    }

    /// A recorded terminal result, replayed and remembered in the replay cache.
    fn replay_terminal(
        &self,
        key: &OpKey,
        state: TerminalState,
        result: Option<&StoredResult>,
        env: &mut dyn Env,
    ) -> Step {
        let mut step = self.replay(replay_kind(state), result);
        step.effects.extend(result.and_then(|r| self.cache_fill(key, state, r, env)));
        step
    }

    /// The same operation with other bound fields: refused, and a security event.
    /// The bound fields differ from the operation's. idemd's PARAM_MISMATCH is its own audit
    /// line; a replay-cache hit is the filter's alone to report.
    fn tampered(&self, key: &OpKey, report: bool) -> Step {
        let mut step = self.reply(ReplyKind::ParamsChanged, ReplyContext::default());
        step.effects.push(Effect::Count(Counter::RejectedParams));
        let events = self.ctx.security_event(SecurityKind::ParamsChanged, Some(key), &self.subject_hash);
        step.effects.extend(events.into_iter().filter(|e| report || !matches!(e, Effect::Report(_))));
        step
    }

    /// The store could not be asked: this call ran nothing, but an earlier one may have.
    fn unchecked(&self, key: &OpKey) -> Step {
        let ctx = ReplyContext {
            retry_after_ms: self.ctx.config.defaults.retry_after_ms,
            poll_with: self.ctx.policy.status_tool.as_deref(),
            operation: Some(key),
            ..Default::default()
        };
        self.reply(ReplyKind::StatusUnavailable, ctx).with(Effect::Count(Counter::SidecarErrors))
    }

    /// idemd would not start the operation where its database could lose the record in a failover: the
    /// agent hears `status_unavailable` with that reason, not retryable (only an operator changes it).
    fn replication_refused(&self, key: &OpKey) -> Step {
        let ctx = ReplyContext { operation: Some(key), ..Default::default() };
        self.reply(ReplyKind::ReplicationRefused, ctx).with(Effect::Count(Counter::SidecarErrors))
    }

    /// Programs always get the original answer back (Stripe's convention); agents
    /// the envelope unless the route says `replay: original`.
    fn replay(&self, kind: ReplyKind, result: Option<&StoredResult>) -> Step {
        let step = match (self.problem || self.ctx.policy.replay == ReplayMode::Original, result) {
            (true, Some(result)) => Step::pause().with(Effect::Reply(reply::original(result))),
            _ => {
                let result_ref_at = self.ctx.policy.result_ref.as_deref();
                self.ctx.reply(kind, ReplyContext { result, result_ref_at, ..Default::default() })
            }
        };
        step.with(Effect::Count(Counter::Replayed))
    }

    fn in_progress(&self, kind: ReplyKind, key: &OpKey) -> Step {
        let ctx = ReplyContext { operation: Some(key), ..self.ctx.polling() };
        self.reply(kind, ctx).with(Effect::Count(Counter::InProgress))
    }

    fn needs_review(&self, key: &OpKey) -> Step {
        let ctx = ReplyContext {
            poll_with: self.ctx.policy.status_tool.as_deref(),
            operation: Some(key),
            ..Default::default()
        };
        self.reply(ReplyKind::NeedsReview, ctx).with(Effect::Count(Counter::NeedsReview))
    }

    pub(super) fn on_response_head(&mut self, head: &ResponseHead, end_of_stream: bool) -> Outcome {
        let phase = std::mem::replace(&mut self.phase, Phase::Finished);
        // A finished confirm is never asked: the machine hands the stream to `Pass` as it finishes.
        let Phase::Forwarded { key, owner } = phase else {
            self.phase = phase;
            return self.unexpected("response_head");
        };
        let mut step = Step::pause()
            .with(Effect::SetResponseHeader(IDEMPOTENCY_KEY_HEADER.into(), key.to_string()))
            .with(Effect::SetResponseHeader("idempotent-replayed".into(), "false".into()));
        self.phase = Phase::Holding { key, owner, head: head.clone() };
        if end_of_stream {
            return Ok(step.then(self.record(&[], false)));
        }
        // Record before reply: hold the answer; its length may change if it is rewritten.
        step.effects.push(Effect::RemoveResponseHeader("content-length"));
        Ok(step)
    }

    pub(super) fn on_response_data(&mut self, size: usize, end_of_stream: bool) -> Outcome {
        if !matches!(self.phase, Phase::Holding { .. }) {
            return Ok(Step::go_on());
        }
        if size > self.ctx.config.max_response_bytes {
            // Too large to keep for replay: record the status and headers only. (The host's log
            // line names the trace, in its safe form.)
            let warn = Effect::Warn("answer over max_response_bytes; recorded without its body".into());
            return Ok(Step::go_on().with(warn).then(self.record(&[], false)));
        }
        Ok(if end_of_stream { Step::need_body() } else { Step::pause() })
    }

    pub(super) fn on_response_body(&mut self, body: &[u8]) -> Outcome {
        if !matches!(self.phase, Phase::Holding { .. }) {
            return self.unexpected("response_body");
        }
        Ok(self.record(body, true))
    }

    /// Classify the held answer and record it. `buffered`: the whole body is
    /// held, so the answer can still be rewritten for the model.
    fn record(&mut self, body: &[u8], buffered: bool) -> Step {
        let phase = std::mem::replace(&mut self.phase, Phase::Finished);
        let Phase::Holding { key, owner, head } = phase else {
            self.phase = phase;
            return Step::go_on();
        };
        let trace_id = self.ctx.trace_id.clone();
        let policy = &self.ctx.policy;
        let keys_honoured = policy.upstream_keys == UpstreamKeys::Honoured;
        match outcome::classify(
            head.status,
            head.code_details.as_deref(),
            head.attempts,
            &policy.outcomes,
            keys_honoured,
        ) {
            decided @ (Verdict::Done | Verdict::Failed) => {
                let state = if decided == Verdict::Done { TerminalState::Done } else { TerminalState::Failed };
                let result = StoredResult {
                    status: head.status,
                    headers: replay_headers(&head.headers),
                    body_b64: crate::protocol::encode_body(body),
                };
                let recorded = Some((key.clone(), state, result.clone()));
                let req = CompleteRequest { key, owner, state, result, trace_id };
                self.phase = Phase::Recording { call: RecordCall::Complete, recorded };
                Step::pause().with(Effect::Call(post("/v1/complete", &req)))
            }
            Verdict::Release => {
                let mut step = Step::pause();
                if buffered {
                    step = step.then(self.rewrite(ReplyKind::NotExecuted, &head, &key));
                    step.flow = Flow::Pause;
                }
                let req = ReleaseRequest { key, owner, trace_id };
                self.phase = Phase::Recording { call: RecordCall::Release, recorded: None };
                step.with(Effect::Call(post("/v1/release", &req)))
            }
            Verdict::Unknown => {
                // Executed or not, nobody can tell yet: the row stays IN_FLIGHT for the reconciler.
                let mut step = Step::go_on().with(Effect::Count(Counter::UnknownOutcome));
                if buffered {
                    step = step.then(self.rewrite(ReplyKind::OutcomeUnknown, &head, &key));
                }
                step.flow = Flow::Continue;
                step
            }
        }
    }

    /// Replace a held answer that is not the upstream's verdict with a reply
    /// for the model: `OutcomeUnknown` (it may have run; here is how to find
    /// out) or `NotExecuted` (released: nothing ran; retry after the upstream's
    /// Retry-After). The held headers are still ours to change.
    fn rewrite(&self, kind: ReplyKind, head: &ResponseHead, nonce: &str) -> Step {
        if self.problem {
            // Programs read the upstream's own 429/503/5xx; their retry gets 409 until it is settled.
            return Step::go_on();
        }
        let ctx = ReplyContext {
            retry_after_ms: retry_after_ms(&head.headers).unwrap_or(self.ctx.config.defaults.retry_after_ms),
            operation: Some(nonce),
            ..self.ctx.polling()
        };
        Step::go_on().with(Effect::Rewrite(self.ctx.render(kind, ctx)))
    }

    /// The ack of complete/release: count it and let the held answer go. If the
    /// store did not take it, the agent still gets the upstream's answer and the
    /// row stays IN_FLIGHT for the reconciler. A result the store took is cached.
    fn on_recorded(
        &mut self,
        call: RecordCall,
        recorded: Option<(OpKey, TerminalState, StoredResult)>,
        answer: &CalloutAnswer,
        env: &mut dyn Env,
    ) -> Step {
        let mut step = Step::go_on();
        match answer.json::<AckResponse>() {
            Some(ack) => {
                let counter = if call == RecordCall::Release { Counter::Released } else { Counter::Completed };
                step.effects.push(Effect::Count(counter));
                if ack.outcome != crate::protocol::Ack::Ok {
                    step.effects.push(Effect::Warn(format!("{call:?} answered {:?}", ack.outcome)));
                } else if let Some((key, state, result)) = recorded {
                    step.effects.extend(self.cache_fill(&key, state, &result, env));
                }
            }
            None => step.effects.push(Effect::Count(Counter::SidecarErrors)),
        }
        step.with(Effect::ResumeResponse)
    }

    fn phase_name(&self) -> &'static str {
        match self.phase {
            Phase::AwaitBody { .. } => "confirm.await_body",
            Phase::Acquiring { .. } => "confirm.acquiring",
            Phase::CheckingExpired { .. } => "confirm.checking_expired",
            Phase::Forwarded { .. } => "confirm.forwarded",
            Phase::Holding { .. } => "confirm.holding",
            Phase::Recording { .. } => "confirm.recording",
            Phase::Finished => "confirm.finished",
        }
    }
}

fn replay_kind(state: TerminalState) -> ReplyKind {
    match state {
        TerminalState::Done => ReplyKind::AlreadyCompleted,
        TerminalState::Failed => ReplyKind::AlreadyFailed,
    }
}

/// `GET /v1/operations/{key}`, with the fingerprint's `exp` when there is one, so that idemd can
/// say whether a missing row may have been reaped.
pub(super) fn lookup_path(key: &str, exp: Option<u64>) -> String {
    match exp {
        Some(exp) => format!("/v1/operations/{key}?exp={exp}"),
        None => format!("/v1/operations/{key}"),
    }
}

fn post<T: serde::Serialize>(path: &str, body: &T) -> Callout {
    Callout::post(path, body)
}

/// What a business reference must be: the upstream looks it up as text.
const BUSINESS_REF_TYPE: &str = "string or integer (the route's business_ref, at most 256 characters)";

/// The confirm's `business_ref` value (`None` where the route has none). It is a bound field, so
/// the fingerprint already proved it; it must be text the upstream can look up.
fn business_ref(json: &serde_json::Value, pointer: Option<&str>) -> Result<Option<String>, CanonError> {
    let Some(pointer) = pointer else { return Ok(None) };
    let text = match json.pointer(pointer) {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Number(n)) if n.is_i64() || n.is_u64() => Some(n.to_string()),
        _ => None,
    };
    match text {
        Some(t) if !t.is_empty() && t.len() <= 256 && !t.chars().any(char::is_control) => Ok(Some(t)),
        _ => Err(CanonError::WrongType { pointer: pointer.to_string(), expected: BUSINESS_REF_TYPE }),
    }
}
