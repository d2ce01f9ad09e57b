//! What every role answers with: the context (configuration, route policy, trace id) and the replies
//! built from it, including the ones a host sends before any role runs.

use crate::canonical::{self, BodyError, CanonError};
use crate::fingerprint::{self, Claims, Expect, VerifyError};
use crate::policy::{PluginConfig, Role, RoutePolicy};
use crate::protocol::{OpKey, SecurityEventReport, SecurityKind};
use crate::reply::{self, Reply, ReplyContext, ReplyKind};
use std::rc::Rc;

use super::{Callout, Counter, Effect, Step, FINGERPRINT_FIELD, FINGERPRINT_HEADER, IDEMPOTENCY_KEY_HEADER};

/// What every role needs to answer: the configuration, the route's policy,
/// and the request's trace id.
#[derive(Debug, Clone)]
pub struct Ctx {
    pub config: Rc<PluginConfig>,
    pub policy: Rc<RoutePolicy>,
    pub trace_id: String,
}

impl Ctx {
    /// Programs get RFC 9457 problems in client-key mode (see [`Ctx::speaks_problem`]).
    pub(super) fn render(&self, kind: ReplyKind, ctx: ReplyContext) -> Reply {
        self.render_as(kind, ctx, false)
    }

    pub(super) fn render_as(&self, kind: ReplyKind, ctx: ReplyContext, problem: bool) -> Reply {
        let ctx = ReplyContext { trace_id: &self.trace_id, ..ctx };
        if problem {
            reply::problem(kind, &ctx)
        } else {
            reply::render(kind, self.config.language, &ctx)
        }
    }

    /// A route for programs that take only client keys answers in problems from the first byte.
    pub(super) fn speaks_problem(&self) -> bool {
        self.policy.role == Role::Idempotent && self.policy.callers == crate::policy::Callers::Programs
    }

    /// A route whose callers are programs sending their own keys (only keys, or keys beside
    /// fingerprints): what is wrong before the body is read is told to them as a problem.
    pub(super) fn for_programs(&self) -> bool {
        self.policy.callers == crate::policy::Callers::Programs
            && (self.policy.role == Role::Idempotent || self.policy.client_keys)
    }

    /// A header the guard reads came more than once: which value is meant is unknowable, and
    /// choosing one ("first wins") is how a proxy and an upstream come to disagree (DESIGN §6).
    pub(super) fn repeated_header(&self, name: &str) -> Step {
        self.header_refusal(
            name,
            &format!("{name} was sent more than once (a spelling with `_` for `-` counts as another copy)"),
        )
    }

    /// A header the guard reads is not text: what its bytes mean is a guess (decoded leniently,
    /// two different values may read as one), so it is refused like a repeated one.
    pub(super) fn header_not_text(&self, name: &str) -> Step {
        self.header_refusal(name, &format!("{name} is not text (its value is not UTF-8)"))
    }

    /// A header the guard reads refused before anything is read or forwarded, in the words of what
    /// the header carries, to the callers the route names.
    fn header_refusal(&self, name: &str, detail: &str) -> Step {
        let kind = match name {
            FINGERPRINT_HEADER => ReplyKind::FingerprintInvalid,
            IDEMPOTENCY_KEY_HEADER => ReplyKind::KeyInvalid,
            _ => ReplyKind::InvalidHeader,
        };
        let ctx = ReplyContext { detail: Some(detail), ..Default::default() };
        Step::pause()
            .with(Effect::Reply(self.render_as(kind, ctx, self.for_programs())))
            .with(Effect::Count(Counter::RejectedHeader))
    }

    /// A reply that needs nothing but the defaults.
    pub(super) fn simple(&self, kind: ReplyKind) -> Step {
        let ctx = ReplyContext { retry_after_ms: self.config.defaults.retry_after_ms, ..Default::default() };
        Step::pause().with(Effect::Reply(self.render_as(kind, ctx, self.speaks_problem())))
    }

    pub(super) fn reply(&self, kind: ReplyKind, ctx: ReplyContext) -> Step {
        Step::pause().with(Effect::Reply(self.render(kind, ctx)))
    }

    /// A security event: counted (in all and by kind), logged, and reported to idemd's audit.
    /// `key`: the operation, where the signature proved it (the log line shows it only then).
    pub(super) fn security_event(&self, kind: SecurityKind, key: Option<&OpKey>, subject_hash: &str) -> Vec<Effect> {
        let counter = match kind {
            SecurityKind::ParamsChanged => Counter::SecurityParamsChanged,
            SecurityKind::CrossSubject => Counter::SecurityCrossSubject,
            SecurityKind::BadSignature => Counter::SecurityBadSignature,
            SecurityKind::UnknownKid => Counter::SecurityUnknownKid,
        };
        let report = SecurityEventReport {
            kind,
            scope: self.policy.scope.clone(),
            key: key.cloned(),
            subject_hash: subject_hash.to_string(),
            trace_id: self.trace_id.clone(),
        };
        // The cross-subject nonce is its owner's to know: the audit keeps it, the log line does not.
        let logged = match (kind, key) {
            (SecurityKind::CrossSubject, _) | (_, None) => "-".to_string(),
            (_, Some(k)) => k.to_string(),
        };
        vec![
            Effect::Count(Counter::SecurityEvents),
            Effect::Count(counter),
            Effect::SecurityEvent { kind: kind.as_str(), nonce: logged },
            Effect::Report(Callout::post("/v1/security-events", &report)),
        ]
    }

    pub(super) fn body_error(&self, e: &BodyError) -> Step {
        self.body_error_as(e, self.speaks_problem())
    }

    /// A body that cannot be read, as an envelope or (client-key mode for programs) a problem.
    pub(super) fn body_error_as(&self, e: &BodyError, problem: bool) -> Step {
        let kind = match e {
            BodyError::TooLarge { .. } => ReplyKind::BodyTooLarge,
            BodyError::Invalid(_) | BodyError::NotAnObject => ReplyKind::InvalidJson,
        };
        // Neither kind says when to retry: the same body is refused again.
        let ctx = ReplyContext::default();
        Step::pause().with(Effect::Reply(self.render_as(kind, ctx, problem))).with(Effect::Count(Counter::RejectedBody))
    }

    pub(super) fn field_error(&self, e: &CanonError) -> Step {
        self.field_error_as(e, false)
    }

    pub(super) fn field_error_as(&self, e: &CanonError, problem: bool) -> Step {
        let detail = e.to_string();
        let ctx = ReplyContext { detail: Some(&detail), ..Default::default() };
        Step::pause()
            .with(Effect::Reply(self.render_as(ReplyKind::InvalidField, ctx, problem)))
            .with(Effect::Count(Counter::RejectedBody))
    }

    /// Verify a fingerprint against this route and caller (everything but
    /// expiry, which each role weighs itself). `Err` is the refusal to send.
    pub(super) fn verify(
        &self,
        token: Option<&str>,
        subject_hash: &str,
        param_hash: Option<&str>,
    ) -> Result<Claims, Step> {
        let Some(token) = token else {
            return Err(self.simple(ReplyKind::FingerprintMissing).with(Effect::Count(Counter::RejectedMissing)));
        };
        let expect = Expect { subject_hash, scope: &self.policy.scope, param_hash };
        fingerprint::verify(&self.config.keyring, token.trim(), &expect).map_err(|e| match e {
            VerifyError::SubjectMismatch { nonce } => {
                let mut step = self.simple(ReplyKind::Forbidden).with(Effect::Count(Counter::RejectedForbidden));
                step.effects.extend(self.security_event(
                    SecurityKind::CrossSubject,
                    OpKey::parse(&nonce).ok().as_ref(),
                    subject_hash,
                ));
                step
            }
            VerifyError::ParamMismatch { nonce } => {
                let mut step = self.simple(ReplyKind::ParamsChanged).with(Effect::Count(Counter::RejectedParams));
                step.effects.extend(self.security_event(
                    SecurityKind::ParamsChanged,
                    OpKey::parse(&nonce).ok().as_ref(),
                    subject_hash,
                ));
                step
            }
            e @ (VerifyError::BadSignature | VerifyError::UnknownKid) => {
                let kind =
                    if e == VerifyError::UnknownKid { SecurityKind::UnknownKid } else { SecurityKind::BadSignature };
                let mut step = self.simple(ReplyKind::FingerprintInvalid).with(Effect::Count(Counter::RejectedInvalid));
                step.effects.extend(self.security_event(kind, None, subject_hash));
                step
            }
            _ => self.simple(ReplyKind::FingerprintInvalid).with(Effect::Count(Counter::RejectedInvalid)),
        })
    }

    /// The reply about an operation a person is asked about (DESIGN §4, "Approval"): what the
    /// approval record says as of `now_s`, for a confirm or (`status_query`) a status lookup.
    pub(super) fn approval_reply(&self, view: &crate::protocol::ApprovalView, now_s: u64, status_query: bool) -> Step {
        use crate::protocol::ApprovalState;
        let now_ms = i64::try_from(now_s.saturating_mul(1000)).unwrap_or(i64::MAX);
        let (kind, counter) = match (view.state_at(now_ms), status_query) {
            (ApprovalState::AwaitingApproval, false) => (ReplyKind::ApprovalRequired, Counter::ApprovalRequired),
            (ApprovalState::AwaitingApproval, true) => (ReplyKind::AwaitingApproval, Counter::StatusLookups),
            // A confirm never hears "approved": idemd acquires an approved operation for it.
            (ApprovalState::Approved, _) => (ReplyKind::Approved, Counter::StatusLookups),
            (ApprovalState::Rejected, _) => (ReplyKind::Rejected, Counter::ApprovalRejected),
            (ApprovalState::Lapsed, _) => (ReplyKind::ApprovalLapsed, Counter::ApprovalLapsed),
        };
        let facts = crate::reply::ApprovalFacts {
            fields: &view.fields,
            scope: &view.scope,
            console: view.console.as_deref(),
            reason: view.reason.as_deref(),
            expires_at: u64::try_from(view.expires_at_ms / 1000).ok(),
        };
        let ctx = ReplyContext { operation: Some(&view.key), approval: Some(facts), status_query, ..self.polling() };
        let step = self.reply(kind, ctx);
        if status_query && counter == Counter::StatusLookups {
            // The lookup was counted when it went out.
            return step;
        }
        step.with(Effect::Count(counter))
    }

    /// Where and when `in_progress` polls: the status tool, else this call's own tool (by its
    /// `tool.name`; an MCP tool always has one), after the route's interval.
    pub(super) fn polling(&self) -> ReplyContext<'_> {
        ReplyContext {
            poll_with: self.policy.status_tool.as_deref(),
            own_tool: self.policy.tool.as_ref().and_then(|t| t.name.as_deref()),
            poll_after_ms: self.policy.poll_after_ms,
            ..Default::default()
        }
    }
}

/// The answer on a guarded route whose annotation does not parse: the route
/// must not run unprotected, and nothing is known about the operation.
pub fn misconfigured(config: &PluginConfig, trace_id: &str) -> Reply {
    let ctx = ReplyContext { trace_id, retry_after_ms: config.defaults.retry_after_ms, ..Default::default() };
    reply::render(ReplyKind::StatusUnavailable, config.language, &ctx)
}

/// The answer to a request a route rule would guard if its path or method were spelled as the
/// rule spells them (DESIGN §6): nothing is forwarded; `canonical` is the path to send.
pub fn not_canonical(config: &PluginConfig, trace_id: &str, canonical: &str) -> Reply {
    let detail = format!("send the request to {canonical} with the method in upper case and no method-override header");
    let ctx = ReplyContext { trace_id, detail: Some(&detail), ..Default::default() };
    reply::render(ReplyKind::PathNotCanonical, config.language, &ctx)
}

/// The answer to a method a route rule's path is not guarded for and does not let pass (DESIGN
/// §6): nothing is forwarded; `why` names the guarded and the passing methods.
pub fn method_not_guarded(config: &PluginConfig, trace_id: &str, why: &str) -> Reply {
    let ctx = ReplyContext { trace_id, detail: Some(why), ..Default::default() };
    reply::render(ReplyKind::PathNotCanonical, config.language, &ctx)
}

/// The fingerprint of a confirm or status body: the header wins, else the
/// body's `fingerprint` string.
pub(super) fn body_fingerprint(json: &serde_json::Value) -> Option<String> {
    json.get(FINGERPRINT_FIELD).and_then(|v| v.as_str()).map(str::to_owned)
}

pub(super) fn parse_body(ctx: &Ctx, body: &[u8]) -> Result<serde_json::Value, Step> {
    canonical::parse_json_body(body, ctx.config.max_body_bytes).map_err(|e| ctx.body_error(&e))
}
