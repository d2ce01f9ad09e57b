//! One HTTP stream: proxy callbacks in, `idem_core::machine` decides, host
//! calls out. Nothing here chooses a reply or a state; it reads what the
//! machine needs, carries out the effects it returns, and matches callout
//! answers to the call that is pending.
//!
//! Envoy holds the request (headers and body) until the filter resumes it, so
//! nothing reaches the upstream before verification and acquire succeed; and
//! it holds a confirm's answer until idemd has recorded it, so a retry that
//! follows the first answer always finds the result to replay.

use crate::host::{Host, Level};
use crate::routes::{RouteCache, RouteLookup};
use crate::sidecar;
use idem_core::machine::{
    self, CalloutAnswer, Counter, Ctx, Effect, Flow, HeadNeeds, Machine, Outcome, RequestHead, ResponseHead, Step,
    Unexpected,
};
use idem_core::policy::{Language, PluginConfig, Role, RouteDefaults, RoutePolicy, SubjectSource};
use idem_core::protocol::LeaseRenewal;
use idem_core::reply::{self, Reply, ReplyContext, ReplyKind};
use idem_core::trace::Trace;
use std::rc::Rc;

/// What every stream of one filter configuration shares on one thread (a
/// proxy-wasm VM, or a worker of the native module).
pub struct Shared {
    pub config: Rc<PluginConfig>,
    pub routes: RouteCache,
}

impl Shared {
    pub fn new(config: PluginConfig) -> Shared {
        Shared { config: Rc::new(config), routes: RouteCache::default() }
    }
}

/// What a host keeps of its configuration to refuse a stream it has no usable filter for (DESIGN
/// §6: every host fails closed): the words of the refusal. Plain data, so a native module's
/// worker can read it from the configuration the main thread parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    language: Language,
    retry_after_ms: u64,
}

impl Refusal {
    pub fn of(config: &PluginConfig) -> Refusal {
        Refusal { language: config.language, retry_after_ms: config.defaults.retry_after_ms }
    }

    /// Where no configuration was ever parsed: English, the default retry.
    pub fn unconfigured() -> Refusal {
        Refusal { language: Language::En, retry_after_ms: RouteDefaults::default().retry_after_ms }
    }

    /// 503 `status_unavailable`: retryable, and it never claims that nothing ran (the words of
    /// `machine::misconfigured`, which a stream with a configuration sends).
    pub fn reply(self, trace_id: &str) -> Reply {
        let ctx = ReplyContext { trace_id, retry_after_ms: self.retry_after_ms, ..Default::default() };
        reply::render(ReplyKind::StatusUnavailable, self.language, &ctx)
    }
}

/// A request's trace id, from its headers as `header` reads them (`x-request-id`, `traceparent`):
/// not the guard's headers, so a value that is not text counts as absent.
pub fn trace_id(header: impl Fn(&str) -> Option<Vec<u8>>) -> String {
    let text = |name: &str| header(name).and_then(|v| String::from_utf8(v).ok());
    let (rid, tp) = (text("x-request-id"), text("traceparent"));
    Trace::of(rid.as_deref(), tp.as_deref(), None).id
}

/// What the proxy should do with the stream after a callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Continue,
    Pause,
}

pub struct Stream<H: Host> {
    shared: Rc<Shared>,
    host: H,
    machine: Machine,
    /// The callout whose answer the machine waits for.
    pending: Option<u64>,
    /// For log lines about this stream and the callouts it makes.
    trace: Trace,
    scope: String,
    /// The buffered body sizes, to read (request) or replace (response) them whole, also when
    /// the stream ends with trailers instead of a last body chunk.
    request_size: usize,
    response_size: usize,
    /// The lease the host keeps alive for this stream (what the machine's `live_lease` said last).
    lease: Option<LeaseRenewal>,
    /// The answer reached this filter: a refusal can no longer be a reply of ours.
    responding: bool,
}

impl<H: Host> Stream<H> {
    pub fn new(shared: Rc<Shared>, host: H) -> Stream<H> {
        Stream {
            shared,
            host,
            machine: Machine::Pass,
            pending: None,
            trace: Trace::default(),
            scope: String::new(),
            request_size: 0,
            response_size: 0,
            lease: None,
            responding: false,
        }
    }

    /// Nothing to do on this stream (an unannotated route, or a guarded one already decided):
    /// a host may skip reading what the next callback would need.
    pub fn passes(&self) -> bool {
        matches!(self.machine, Machine::Pass)
    }

    pub fn shared(&self) -> &Rc<Shared> {
        &self.shared
    }

    pub fn host(&self) -> &H {
        &self.host
    }

    pub fn host_mut(&mut self) -> &mut H {
        &mut self.host
    }

    pub fn on_request_headers(&mut self, end_of_stream: bool) -> Action {
        let cfg = &self.shared.config;
        let policy = match self.shared.routes.lookup(&self.host, cfg) {
            RouteLookup::NotMine => return Action::Continue,
            RouteLookup::Guarded(p) => p,
            RouteLookup::NotCanonical(canonical) => {
                let trace = self.read_trace_id();
                let reply = machine::not_canonical(cfg, &trace, &canonical);
                self.host.count(Counter::RejectedHeader);
                self.host.send_reply(reply.http_status, &reply.headers, &reply.body);
                return Action::Pause;
            }
            RouteLookup::MethodNotGuarded(why) => {
                let trace = self.read_trace_id();
                let reply = machine::method_not_guarded(cfg, &trace, &why);
                self.host.count(Counter::RejectedHeader);
                self.host.send_reply(reply.http_status, &reply.headers, &reply.body);
                return Action::Pause;
            }
            RouteLookup::Broken(_) => {
                // A guarded route with a broken annotation must not run unprotected.
                let trace = self.read_trace_id();
                let reply = machine::misconfigured(cfg, &trace);
                self.host.count(Counter::RejectedMisconfigured);
                self.host.send_reply(reply.http_status, &reply.headers, &reply.body);
                return Action::Pause;
            }
        };
        let head = self.read_head(&policy);
        // A preview makes no callout: it need not ask the host for the span.
        self.trace = match policy.role {
            Role::Preview => head.trace.clone(),
            _ => head.trace.clone().within(self.host.active_span()),
        };
        self.scope = policy.scope.clone();
        let ctx = Ctx { config: Rc::clone(&self.shared.config), policy, trace_id: head.trace.id.clone() };
        let (machine, step) = Machine::start(ctx, &head, end_of_stream, &mut self.host);
        self.machine = machine;
        self.apply(step)
    }

    pub fn on_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        self.request_size = size;
        let step = self.machine.on_request_data(size, end_of_stream);
        if step.flow != Flow::NeedBody {
            return self.apply(step);
        }
        let body = self.host.request_body(size);
        let next = self.machine.on_request_body(&body, &mut self.host);
        self.apply_outcome(next)
    }

    /// The request ended with trailers (HTTP/2, gRPC): that is its end of stream. A default
    /// that continues here would release a held request the machine has not judged (DESIGN §6).
    pub fn on_request_trailers(&mut self) -> Action {
        if matches!(self.machine, Machine::Pass) {
            return Action::Continue;
        }
        self.on_request_body(self.request_size, true)
    }

    /// The answer ended with trailers: its end of stream, as for the request.
    pub fn on_response_trailers(&mut self) -> Action {
        if matches!(self.machine, Machine::Pass) {
            return Action::Continue;
        }
        self.on_response_body(self.response_size, true)
    }

    pub fn on_response_headers(&mut self, end_of_stream: bool) -> Action {
        self.responding = true;
        if matches!(self.machine, Machine::Pass) {
            return Action::Continue;
        }
        let head = self.read_response_head();
        let next = self.machine.on_response_head(&head, end_of_stream, &mut self.host);
        self.apply_outcome(next)
    }

    pub fn on_response_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        if matches!(self.machine, Machine::Pass) {
            return Action::Continue;
        }
        self.response_size = size;
        let step = self.machine.on_response_data(size, end_of_stream);
        let step = match step {
            Ok(s) if s.flow == Flow::NeedBody => {
                let body = self.host.response_body(size);
                self.machine.on_response_body(&body, &mut self.host)
            }
            other => other,
        };
        self.apply_outcome(step)
    }

    pub fn on_callout_answer(&mut self, token: u64, num_headers: usize, body_size: usize) {
        if self.pending != Some(token) {
            return;
        }
        self.pending = None;
        let answer = self.host.call_answer(num_headers, body_size);
        let next = self.machine.on_callout(&answer, &mut self.host);
        self.apply_outcome(next);
    }

    fn read_trace_id(&self) -> String {
        trace_id(|name| self.host.request_header(name))
    }

    /// The request facts the route's role needs, from one read of the header map: every value
    /// of a header the guard reads is seen, so a repeated one is refused, never half-read.
    fn read_head(&self, policy: &RoutePolicy) -> RequestHead {
        // The role's reads, and the path or every header where the route binds a value there.
        let needs = HeadNeeds::for_policy(policy);
        let headers = self.host.request_headers();
        let subject_header = match &self.shared.config.subject {
            SubjectSource::Header(name) => Some(name.as_str()),
            SubjectSource::Property(_) => None,
        };
        let mut head = RequestHead::from_headers(&headers, needs, subject_header);
        if let SubjectSource::Property(path) = &self.shared.config.subject {
            let path: Vec<&str> = path.iter().map(String::as_str).collect();
            head.subject =
                self.host.property(&path).and_then(|b| String::from_utf8(b).ok()).filter(|s| !s.trim().is_empty());
        }
        head
    }

    /// The answer facts the machine needs, from one read of the header map: a read per header
    /// is a host crossing each (in the `.wasm`, two: the call, and the VM's allocation for its
    /// answer), and a preview reads four, a forwarded confirm five.
    fn read_response_head(&self) -> ResponseHead {
        let full = self.machine.response_needs_headers();
        let framing = self.machine.response_needs_framing();
        let mut head = ResponseHead::from_headers(&self.host.response_headers(), full, framing);
        if full {
            head.code_details =
                self.host.property(&["response", "code_details"]).and_then(|b| String::from_utf8(b).ok());
        }
        head
    }

    fn apply_outcome(&mut self, outcome: Outcome) -> Action {
        match outcome {
            Ok(step) => self.apply(step),
            Err(e) => self.refuse(&e),
        }
    }

    /// The machine refused an event it cannot take: the host and the machine disagree about where
    /// the stream is, and continuing would release whatever the machine holds (a request not yet
    /// judged, an answer not yet recorded). Fail closed (DESIGN §6): the stream is refused, and
    /// nothing more is decided on it: before the answer reached this filter with the §7 reply of a
    /// stream no filter can judge, after it with a reset (a reply is no longer ours to send; the
    /// client sees no answer, never "nothing ran").
    fn refuse(&mut self, e: &Unexpected) -> Action {
        self.host.log(
            Level::Error,
            &format!("agent_idempotency: {e}; the stream is refused (trace_id={})", self.trace.logged()),
        );
        // A refusal sent from here passes this filter's answer hooks as any reply of ours does.
        self.machine = Machine::Pass;
        self.pending = None;
        self.sync_lease();
        if self.responding {
            self.host.reset();
        } else {
            let reply = machine::misconfigured(&self.shared.config, &self.trace.id);
            self.host.send_reply(reply.http_status, &reply.headers, &reply.body);
        }
        Action::Pause
    }

    /// Carry out a step's effects in order and translate its flow.
    fn apply(&mut self, step: Step) -> Action {
        let mut flow = step.flow;
        for effect in step.effects {
            if let Some(overridden) = self.effect(effect) {
                flow = overridden;
            }
        }
        self.sync_lease();
        match flow {
            Flow::Continue => Action::Continue,
            Flow::Pause | Flow::NeedBody => Action::Pause,
        }
    }

    /// Hand the host the lease the machine holds now, and let go of the one it no longer holds.
    fn sync_lease(&mut self) {
        let now = self.machine.live_lease();
        if now == self.lease {
            return;
        }
        if let Some(old) = self.lease.take() {
            self.host.end_lease(&old.owner);
        }
        if let Some(new) = &now {
            self.host.hold_lease(new);
        }
        self.lease = now;
    }

    /// One effect; `Some(flow)` when a callout failed at once and its
    /// consequences decide how this callback ends.
    fn effect(&mut self, effect: Effect) -> Option<Flow> {
        match effect {
            Effect::Count(c) => self.host.count(c),
            Effect::SecurityEvent { kind, nonce } => self.host.log(
                Level::Warn,
                &format!(
                    "agent_idempotency security_event={kind} trace_id={} scope={} nonce={nonce}",
                    self.trace.logged(),
                    self.scope
                ),
            ),
            Effect::Warn(message) => {
                self.host.log(Level::Warn, &format!("{message} (trace_id={})", self.trace.logged()))
            }
            Effect::SetRequestHeader(name, value) => {
                self.host.remove_request_header(name);
                self.host.set_request_header(name, &value);
            }
            Effect::RemoveRequestHeader(name) => self.host.remove_request_header(name),
            Effect::SetResponseHeader(name, value) => self.host.set_response_header(&name, &value),
            Effect::RemoveResponseHeader(name) => self.host.remove_response_header(name),
            Effect::ReplaceResponseBody(body) => self.host.replace_response_body(self.response_size, &body),
            Effect::Rewrite(r) => {
                self.host.set_response_header(":status", &r.http_status.to_string());
                for (name, value) in &r.headers {
                    self.host.set_response_header(name, value);
                }
                self.host.replace_response_body(self.response_size, &r.body);
            }
            Effect::Reply(r) => self.host.send_reply(r.http_status, &r.headers, &r.body),
            Effect::ResumeRequest => self.host.resume_request(),
            Effect::ResumeResponse => self.host.resume_response(),
            Effect::SharedSet { key, value } => self.host.shared_set(&key, &value),
            Effect::Report(call) => {
                // Fire and forget: its answer matches no pending call and is dropped.
                let cfg = Rc::clone(&self.shared.config);
                if !self.host.report(&cfg, &call, &self.trace) {
                    self.host.count(Counter::SidecarErrors);
                }
            }
            Effect::Call(call) => {
                let cfg = Rc::clone(&self.shared.config);
                match sidecar::dispatch(&mut self.host, &cfg, &call, &self.trace) {
                    Some(token) => self.pending = Some(token),
                    None => return Some(self.callout_failed_now()),
                }
            }
        }
        None
    }

    /// The callout could not be dispatched: the machine hears "failed" at
    /// once, inside the current callback, where a resume is simply
    /// "continue" (resuming from within the callback is not allowed).
    fn callout_failed_now(&mut self) -> Flow {
        self.host.count(Counter::SidecarErrors);
        let next = match self.machine.on_callout(&CalloutAnswer::failed(), &mut self.host) {
            Ok(step) => step,
            Err(e) => {
                self.refuse(&e);
                return Flow::Pause;
            }
        };
        let mut flow = Flow::Pause;
        for effect in next.effects {
            match effect {
                Effect::ResumeRequest | Effect::ResumeResponse => flow = Flow::Continue,
                other => {
                    if let Some(f) = self.effect(other) {
                        flow = f;
                    }
                }
            }
        }
        flow
    }
}

/// A stream Envoy ends early (a reset, the client gone) stops renewing its lease: from then on
/// the lease runs out by itself, and the lease rule (DESIGN §5) protects.
impl<H: Host> Drop for Stream<H> {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            self.host.end_lease(&lease.owner);
        }
    }
}
