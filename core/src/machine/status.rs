//! Status: what became of the operation a fingerprint names. Signature and
//! subject are checked; expiry is not (an agent may poll long after), but it
//! decides what "never confirmed" means: still possible, or too late.

use super::confirm::lookup_path;
use super::{body_fingerprint, Callout, CalloutAnswer, Counter, Ctx, Effect, Env, Outcome, Step, Unexpected};
use crate::protocol::{OpKey, OpState, OperationView, StoredResult};
use crate::reply::{ReplyContext, ReplyKind};
use crate::{canonical, client_key};

#[derive(Debug)]
pub struct Status {
    ctx: Ctx,
    subject_hash: String,
    phase: Phase,
}

#[derive(Debug)]
enum Phase {
    /// Every fingerprint the header and the query string name, and the caller's
    /// Idempotency-Key (client-key mode), if any.
    AwaitBody {
        named: Vec<String>,
        client_key: Option<String>,
    },
    /// `exp` is the fingerprint's; a client key has none.
    LookingUp {
        key: OpKey,
        exp: Option<u64>,
    },
    Finished,
}

impl Status {
    pub(super) fn new(ctx: Ctx, subject_hash: String, named: Vec<String>, client_key: Option<String>) -> Status {
        Status { ctx, subject_hash, phase: Phase::AwaitBody { named, client_key } }
    }

    pub(super) fn finished(&self) -> bool {
        matches!(self.phase, Phase::Finished)
    }

    pub(super) fn body_limit(&self) -> Option<(&Ctx, usize)> {
        matches!(self.phase, Phase::AwaitBody { .. }).then_some((&self.ctx, self.ctx.config.max_body_bytes))
    }

    fn phase_name(&self) -> &'static str {
        match self.phase {
            Phase::AwaitBody { .. } => "status.await_body",
            Phase::LookingUp { .. } => "status.looking_up",
            Phase::Finished => "status.finished",
        }
    }

    pub(super) fn on_request_body(&mut self, body: &[u8]) -> Outcome {
        let Phase::AwaitBody { named, client_key } = &self.phase else {
            return Err(Unexpected { event: "request_body", phase: self.phase_name() });
        };
        // A GET has no body; a POST may carry the fingerprint in it. A body that is JSON is read as
        // the confirm reads one (a key named twice is refused, not read as its last copy); one
        // that is not JSON names nothing.
        let mut named = named.clone();
        if !body.is_empty() {
            match canonical::parse_json_body(body, self.ctx.config.max_body_bytes) {
                Ok(json) => named.extend(body_fingerprint(&json)),
                Err(e) if serde_json::from_slice::<serde_json::Value>(body).is_ok() => {
                    self.phase = Phase::Finished;
                    return Ok(self.ctx.body_error(&e));
                }
                Err(_) => {}
            }
        }
        // Two fingerprints (header, query string, body, or one of them twice) that differ name two
        // operations: which one is meant depends on who reads, so neither is answered about.
        let token = named.first().cloned();
        if named.iter().any(|t| Some(t.trim()) != token.as_deref().map(str::trim)) {
            self.phase = Phase::Finished;
            let detail = "the lookup names more than one fingerprint (header, query string, body)";
            let ctx = ReplyContext { detail: Some(detail), ..Default::default() };
            return Ok(self
                .ctx
                .reply(ReplyKind::FingerprintInvalid, ctx)
                .with(Effect::Count(Counter::RejectedInvalid)));
        }
        let (key, exp) = match (token, client_key) {
            // Client-key mode: the caller's own key names its operation, for this subject and scope.
            (None, Some(k)) if self.ctx.policy.client_keys => match client_key::parse_header(Some(k)) {
                Ok(k) => (client_key::operation_key(&self.subject_hash, &self.ctx.policy.scope, &k), None),
                Err(_) => {
                    self.phase = Phase::Finished;
                    return Ok(self.ctx.simple(ReplyKind::KeyInvalid));
                }
            },
            (token, _) => match self.ctx.verify(token.as_deref(), &self.subject_hash, None) {
                Ok(c) => (c.nonce, Some(c.exp)),
                Err(refusal) => {
                    self.phase = Phase::Finished;
                    return Ok(refusal);
                }
            },
        };
        let call = Callout { method: "GET", path: lookup_path(&key, exp), body: None };
        self.phase = Phase::LookingUp { key, exp };
        Ok(Step::pause().with(Effect::Count(Counter::StatusLookups)).with(Effect::Call(call)))
    }

    pub(super) fn on_callout(&mut self, answer: &CalloutAnswer, env: &mut dyn Env) -> Outcome {
        let phase = std::mem::replace(&mut self.phase, Phase::Finished);
        let Phase::LookingUp { key, exp } = phase else {
            self.phase = phase;
            return Err(Unexpected { event: "callout", phase: self.phase_name() });
        };
        let view = answer.json::<OperationView>();
        Ok(match (answer.status, view) {
            // Not executed, and a person is (or was) asked: what they decided.
            (Some(404), _) if answer.approval().is_some_and(|v| v.key == key) => match answer.approval() {
                Some(view) => self.ctx.approval_reply(&view, env.now_s(), true),
                None => self.ctx.simple(ReplyKind::StatusUnavailable),
            },
            (Some(404), _) if answer.reaped_possible() => {
                // The record may have been kept and deleted: nothing is known about the operation.
                let ctx = ReplyContext { operation: Some(&key), status_query: true, ..Default::default() };
                self.ctx.reply(ReplyKind::RecordGone, ctx)
            }
            (Some(404), _) if exp.is_some_and(|exp| env.now_s() >= exp) => {
                // Never executed and can no longer be: a new preview is the only way on.
                self.ctx.simple(ReplyKind::FingerprintExpired)
            }
            (Some(404), _) => {
                let ctx = ReplyContext { fingerprint_expires_at: exp, ..Default::default() };
                self.ctx.reply(ReplyKind::NotYetExecuted, ctx)
            }
            (Some(200), Some(view)) => match view.state {
                OpState::Done => self.outcome(ReplyKind::AlreadyCompleted, view.result.as_ref()),
                OpState::Failed => self.outcome(ReplyKind::AlreadyFailed, view.result.as_ref()),
                OpState::InFlight => {
                    let ctx = ReplyContext { operation: Some(&key), ..self.ctx.polling() };
                    self.ctx.reply(ReplyKind::InProgress, ctx)
                }
                OpState::NeedsReview => {
                    let ctx = ReplyContext {
                        poll_with: self.ctx.policy.status_tool.as_deref(),
                        operation: Some(&key),
                        ..Default::default()
                    };
                    self.ctx.reply(ReplyKind::NeedsReview, ctx)
                }
            },
            _ => {
                let ctx = ReplyContext {
                    retry_after_ms: self.ctx.config.defaults.retry_after_ms,
                    operation: Some(&key),
                    status_query: true,
                    ..Default::default()
                };
                self.ctx.reply(ReplyKind::StatusUnavailable, ctx).with(Effect::Count(Counter::SidecarErrors))
            }
        })
    }

    fn outcome(&self, kind: ReplyKind, result: Option<&StoredResult>) -> Step {
        let result_ref_at = self.ctx.policy.result_ref.as_deref();
        self.ctx.reply(kind, ReplyContext { result, result_ref_at, status_query: true, ..Default::default() })
    }
}
