//! The per-request decision machine, sans I/O (DESIGN §4, §7).
//!
//! A host (the proxy-wasm filter, or any other) turns its callbacks into the
//! events below and carries out the [`Effect`]s each one returns; it never
//! decides anything itself. Every role (preview, confirm, status) is an enum of
//! phases, so a state that makes no sense cannot be represented, and an event
//! that arrives in the wrong phase is an [`Unexpected`] value for the host to
//! log — never a panic.
//!
//! Reads that only some roles need (the request body, the upstream's full
//! header map) are asked for with [`Flow::NeedBody`] and the role's
//! [`Machine::response_needs_headers`], so an unannotated or preview request
//! does not pay for them.

mod confirm;
mod counter;
mod ctx;
mod effect;
mod head;
mod mcp;
mod outside;
mod preview;
pub mod replay_cache;
pub mod splice;
mod status;
#[cfg(test)]
mod tests;

use crate::canonical::{self, BodyError};
use crate::fingerprint;
use crate::policy::Role;
use crate::reply::ReplyKind;

pub use self::confirm::Confirm;
pub use self::counter::Counter;
use self::ctx::{body_fingerprint, parse_body};
pub use self::ctx::{method_not_guarded, misconfigured, not_canonical, Ctx};
pub use self::effect::{Callout, CalloutAnswer, Effect, Flow, Outcome, Step, Unexpected};
pub use self::head::*;
pub use self::mcp::{Mcp, HEADER_MISMATCH, MCP_METHOD_HEADER, MCP_NAME_HEADER, META_KEY};
pub use self::preview::Preview;
pub use self::status::Status;

/// What the host must give the machine that it cannot compute itself.
pub trait Env {
    /// Unix seconds by the host's clock (0 if unknown: everything looks expired, which fails safe).
    fn now_s(&self) -> u64;
    /// 16 random bytes for a nonce; `None` if the host has no randomness.
    fn random16(&mut self) -> Option<[u8; 16]>;
    /// A value of the process-wide shared data (the replay cache); `None` where it has none or the host
    /// keeps no shared data. Every host says which (no default): a host that forgot would silently run
    /// without its replay cache.
    fn shared_get(&self, key: &str) -> Option<Vec<u8>>;
}

/// One stream's machine. `Pass` is every stream the filter does not guard.
#[derive(Debug)]
pub enum Machine {
    Pass,
    Preview(Preview),
    Confirm(Confirm),
    Status(Status),
    Mcp(Box<Mcp>),
}

impl Machine {
    /// Start a machine for a request on an annotated route; `head` is read by
    /// the host only for such routes.
    pub fn start(ctx: Ctx, head: &RequestHead, end_of_stream: bool, env: &mut dyn Env) -> (Machine, Step) {
        if let Some(name) = head.repeated {
            let step =
                if ctx.policy.role == Role::Mcp { mcp::repeated_header(name) } else { ctx.repeated_header(name) };
            return (Machine::Pass, step);
        }
        if let Some(name) = head.not_text {
            let step =
                if ctx.policy.role == Role::Mcp { mcp::header_not_text(name) } else { ctx.header_not_text(name) };
            return (Machine::Pass, step);
        }
        if ctx.policy.role == Role::Mcp {
            // Whose call it is, and whether it is guarded at all, is in the JSON-RPC body: every
            // request that carries one is read, whatever its headers claim.
            let Some(mcp) = Mcp::start(ctx, head, end_of_stream) else { return (Machine::Pass, Step::go_on()) };
            let mut machine = Machine::Mcp(Box::new(mcp));
            let step = if end_of_stream {
                machine.on_request_body(&[], env).unwrap_or_else(|e| Step::go_on().with(Effect::Warn(e.to_string())))
            } else {
                Step::pause()
            };
            return (machine.settle(), step);
        }
        let Some(subject) = head.subject.as_deref() else {
            let step = ctx.simple(ReplyKind::SubjectMissing).with(Effect::Count(Counter::RejectedSubject));
            return (Machine::Pass, step);
        };
        let subject_hash = fingerprint::subject_hash(subject);
        let limit = ctx.config.max_body_bytes;
        if head.content_length.is_some_and(|l| l > limit as u64) {
            let step = ctx.body_error(&BodyError::TooLarge { limit });
            return (Machine::Pass, step);
        }
        // The bound values outside the body are read before it, and a bad one is refused before it.
        let outside = match ctx.policy.role {
            Role::Preview | Role::Confirm | Role::Idempotent => match outside::read(&ctx, head) {
                Ok(o) => o,
                Err(step) => return (Machine::Pass, step),
            },
            Role::Status | Role::Mcp => canonical::Outside::default(),
        };
        let mut machine = match ctx.policy.role {
            Role::Preview => Machine::Preview(Preview::new(ctx, subject_hash, outside)),
            Role::Confirm | Role::Idempotent => Machine::Confirm(Confirm::new(ctx, subject_hash, head, outside)),
            // Handled above; a tool is never an MCP endpoint itself.
            Role::Mcp => return (Machine::Pass, Step::go_on()),
            Role::Status => {
                let named =
                    head.fingerprint.iter().cloned().chain(query_params(&head.path, FINGERPRINT_FIELD)).collect();
                Machine::Status(Status::new(ctx, subject_hash, named, head.idempotency_key.clone()))
            }
        };
        // A client-chosen Idempotency-Key never reaches a guarded upstream: only the nonce may. The
        // head saw every header, so a confirm without one spends no host call removing nothing.
        let first = match machine {
            Machine::Confirm(_) if head.idempotency_key.is_some() => {
                Step::pause().with(Effect::RemoveRequestHeader(IDEMPOTENCY_KEY_HEADER))
            }
            _ => Step::pause(),
        };
        let next = if end_of_stream {
            match machine.on_request_body(&[], env) {
                Ok(step) => step,
                Err(e) => Step::go_on().with(Effect::Warn(e.to_string())),
            }
        } else {
            // Hold the headers until the body is complete and checked: a preview too. It gates
            // nothing, but Envoy sends held headers and the buffered body upstream together, which
            // costs less than headers first and the body later (filter-bench: the preview's Envoy CPU
            // over plain Envoy fell from +66 to +52 µs as .wasm, +27 to +23 µs native), and a bad
            // preview then never reaches the upstream at all.
            Step::pause()
        };
        (machine, first.then(next))
    }

    /// A role whose stream has ended (replied, or passing through) becomes `Pass`.
    fn settle(self) -> Machine {
        let finished = match &self {
            Machine::Pass => false,
            Machine::Preview(p) => p.finished(),
            Machine::Confirm(c) => c.finished(),
            Machine::Status(s) => s.finished(),
            Machine::Mcp(m) => m.finished(),
        };
        if finished {
            Machine::Pass
        } else {
            self
        }
    }

    fn with_role(&mut self, f: impl FnOnce(&mut Machine) -> Outcome) -> Outcome {
        let out = f(self);
        let current = std::mem::replace(self, Machine::Pass);
        *self = current.settle();
        out
    }

    /// A chunk of the request body arrived; `size` is all that is buffered so far.
    pub fn on_request_data(&mut self, size: usize, end_of_stream: bool) -> Step {
        let limit = match self {
            Machine::Pass => return Step::go_on(),
            Machine::Preview(p) => p.body_limit(),
            Machine::Confirm(c) => c.body_limit(),
            Machine::Status(s) => s.body_limit(),
            Machine::Mcp(m) => m.body_limit(),
        };
        let Some((ctx, limit)) = limit else { return Step::go_on() };
        if size > limit {
            // Every answer on an MCP route is JSON-RPC.
            let step = if ctx.policy.role == Role::Mcp {
                mcp::too_large()
            } else {
                ctx.body_error(&BodyError::TooLarge { limit })
            };
            *self = Machine::Pass;
            return step;
        }
        if end_of_stream {
            Step::need_body()
        } else {
            Step::pause()
        }
    }

    /// The complete request body (after [`Flow::NeedBody`]).
    pub fn on_request_body(&mut self, body: &[u8], env: &mut dyn Env) -> Outcome {
        self.with_role(|m| match m {
            Machine::Pass => Err(Unexpected { event: "request_body", phase: "pass" }),
            Machine::Preview(p) => p.on_request_body(body),
            Machine::Confirm(c) => c.on_request_body(body, env),
            Machine::Status(s) => s.on_request_body(body),
            Machine::Mcp(m) => m.on_request_body(body, env),
        })
    }

    pub fn on_callout(&mut self, answer: &CalloutAnswer, env: &mut dyn Env) -> Outcome {
        self.with_role(|m| match m {
            Machine::Pass | Machine::Preview(_) => Err(Unexpected { event: "callout", phase: "no call pending" }),
            Machine::Confirm(c) => c.on_callout(answer, env),
            Machine::Status(s) => s.on_callout(answer, env),
            Machine::Mcp(m) => m.on_callout(answer, env),
        })
    }

    /// The IN_FLIGHT lease this stream holds while its request is upstream: the host keeps it
    /// in its [`crate::leases::LeaseBook`] for as long as this says so (DESIGN §4).
    pub fn live_lease(&self) -> Option<crate::protocol::LeaseRenewal> {
        match self {
            Machine::Confirm(c) => c.live_lease(),
            Machine::Mcp(m) => m.live_lease(),
            _ => None,
        }
    }

    /// Whether [`ResponseHead::headers`] must be filled (a confirm records them).
    pub fn response_needs_headers(&self) -> bool {
        match self {
            Machine::Confirm(c) => c.forwarded(),
            Machine::Preview(p) => p.needs_headers(),
            Machine::Mcp(m) => m.response_needs_headers(),
            _ => false,
        }
    }

    /// Whether [`ResponseHead::content_length`] and `content_encoding` must be filled.
    pub fn response_needs_framing(&self) -> bool {
        matches!(self, Machine::Preview(p) if p.forwarded())
    }

    pub fn on_response_head(&mut self, head: &ResponseHead, end_of_stream: bool, env: &mut dyn Env) -> Outcome {
        self.with_role(|m| match m {
            Machine::Pass | Machine::Status(_) => Ok(Step::go_on()),
            Machine::Preview(p) => Ok(p.on_response_head(head, end_of_stream, env)),
            Machine::Confirm(c) => c.on_response_head(head, end_of_stream),
            Machine::Mcp(m) => m.on_response_head(head, end_of_stream, env),
        })
    }

    /// A chunk of the response body; `size` is all that is buffered so far.
    pub fn on_response_data(&mut self, size: usize, end_of_stream: bool) -> Outcome {
        self.with_role(|m| match m {
            Machine::Pass | Machine::Status(_) => Ok(Step::go_on()),
            Machine::Preview(p) => Ok(p.on_response_data(end_of_stream)),
            Machine::Confirm(c) => c.on_response_data(size, end_of_stream),
            Machine::Mcp(m) => Ok(m.on_response_data(end_of_stream)),
        })
    }

    /// The complete response body (after [`Flow::NeedBody`]).
    pub fn on_response_body(&mut self, body: &[u8], env: &mut dyn Env) -> Outcome {
        self.with_role(|m| match m {
            Machine::Pass | Machine::Status(_) => Err(Unexpected { event: "response_body", phase: "pass" }),
            Machine::Preview(p) => p.on_response_body(body, env),
            Machine::Confirm(c) => c.on_response_body(body),
            Machine::Mcp(m) => m.on_response_body(body, env),
        })
    }
}
