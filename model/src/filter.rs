//! The filter instances: the real `core::machine`, driven as the adapter drives it (events in,
//! effects out), by a host that keeps nothing the machine does not tell it.
//!
//! A machine holds `Rc`s and is neither `Clone` nor `Hash`, so a model state cannot contain one.
//! A stream's state is instead the journal of the events it was fed (each with the clock reading
//! and the shared-data value the machine saw), and the machine is rebuilt by replaying that
//! journal: the machine is deterministic given its inputs, so the rebuilt one is the one that ran.

use std::cell::RefCell;
use std::rc::Rc;

use idem_core::fingerprint::subject_hash;
use idem_core::machine::{
    CalloutAnswer, Ctx, Effect, Env, Flow, Machine, RequestHead, ResponseHead, Step, FINGERPRINT_HEADER,
};
use idem_core::policy::{PluginConfig, RoutePolicy};
use idem_core::protocol::LeaseRenewal;
use idem_core::reply::{Reply, ReplyKind, Tells};
use idem_core::testing;

use crate::config::{world, UpstreamKeys};

const SECRET: &str = "0123456789abcdef0123456789abcdef";
/// The preview's nonce: the operation key of the one operation the model follows.
pub const NONCE: [u8; 16] = [0x5a; 16];
pub const SUBJECT: &str = "alice";
pub const SCOPE: &str = "pay";
/// The business reference the reconciler asks an upstream that ignores keys by.
pub const BUSINESS_REF: &str = "R-1";

struct Policies {
    config: Rc<PluginConfig>,
    preview: Rc<RoutePolicy>,
    confirm_honoured: Rc<RoutePolicy>,
    confirm_ignored: Rc<RoutePolicy>,
    /// The same confirm routes with `approval: always` (docs/approvals.md).
    ruled_honoured: Rc<RoutePolicy>,
    ruled_ignored: Rc<RoutePolicy>,
    status: Rc<RoutePolicy>,
}

fn policies() -> Result<Policies, String> {
    let extra = format!(
        r#""defaults":{{"fingerprint_ttl_s":{},"lease_ms":{}}},"replay_cache":{{"slots":4,"entry_bytes":4096,"ttl_s":{}}}"#,
        world::FINGERPRINT_TTL_S,
        world::LEASE_MS,
        world::RETENTION_MS / 1000
    );
    let config = testing::plugin_config(SECRET, &extra).map_err(|e| e.to_string())?;
    let defaults = config.defaults;
    let route = |leaves: &[(&str, &str)]| -> Result<Rc<RoutePolicy>, String> {
        let mut all = vec![
            ("scope", SCOPE),
            ("bind", "/amount:decimal, /currency, /ref"),
            ("status_tool", "get_status"),
            ("result_ref", "/id"),
        ];
        all.extend_from_slice(leaves);
        testing::route_with(&all, &defaults).map_err(|e| e.to_string())
    };
    Ok(Policies {
        preview: route(&[("role", "preview")])?,
        confirm_honoured: route(&[("role", "confirm"), ("upstream_keys", "honoured")])?,
        confirm_ignored: route(&[("role", "confirm"), ("upstream_keys", "ignored"), ("business_ref", "/ref")])?,
        ruled_honoured: route(&[("role", "confirm"), ("upstream_keys", "honoured"), ("approval", "always")])?,
        ruled_ignored: route(&[
            ("role", "confirm"),
            ("upstream_keys", "ignored"),
            ("business_ref", "/ref"),
            ("approval", "always"),
        ])?,
        status: route(&[("role", "status")])?,
        config,
    })
}

thread_local! {
    static POLICIES: RefCell<Option<Rc<Policies>>> = const { RefCell::new(None) };
}

fn with_policies<T>(f: impl FnOnce(&Policies) -> T) -> T {
    let p = POLICIES.with(|cell| {
        let mut cell = cell.borrow_mut();
        if cell.is_none() {
            // The configuration is the model's own constant text: a failure is a bug in the model.
            *cell = Some(Rc::new(policies().unwrap_or_else(|e| panic!("model configuration: {e}"))));
        }
        cell.as_ref().map(Rc::clone)
    });
    match p {
        Some(p) => f(&p),
        None => unreachable!("set above"),
    }
}

/// What the stream is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A confirm; `drifted`: its free-text memo was regenerated ("ASAP" → "please ASAP");
    /// `ruled`: on the route whose rule asks a person first (`approval: always`), else on the
    /// route of the same scope without it.
    Confirm {
        drifted: bool,
        ruled: bool,
    },
    Status,
}

/// One event fed to a stream's machine, with what the host read for it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Ev {
    /// Headers and the whole body; `cached`: the replay-cache slot's value at that moment.
    Start { now_s: u64, cached: Option<Vec<u8>> },
    /// idemd's answer (`status: None`: the callout failed or timed out).
    Callout { now_s: u64, status: Option<u16>, body: Vec<u8> },
    /// The upstream's (or Envoy's own) answer, head and whole body.
    Response { now_s: u64, status: u16, details: &'static str, body: Vec<u8> },
}

struct ReplayEnv {
    now_s: u64,
    cached: Option<Vec<u8>>,
}

impl Env for ReplayEnv {
    fn now_s(&self) -> u64 {
        self.now_s
    }
    fn random16(&mut self) -> Option<[u8; 16]> {
        Some(NONCE)
    }
    fn shared_get(&self, _key: &str) -> Option<Vec<u8>> {
        self.cached.clone()
    }
}

/// The fingerprint the agent got from its one preview, minted by the real preview machine.
pub fn preview_fingerprint() -> Result<String, String> {
    with_policies(|p| {
        let ctx = Ctx { config: Rc::clone(&p.config), policy: Rc::clone(&p.preview), trace_id: "preview".into() };
        let mut env = ReplayEnv { now_s: world::T0, cached: None };
        let (mut m, _) = Machine::start(ctx, &head(None), false, &mut env);
        m.on_request_data(64, true);
        m.on_request_body(&body(false), &mut env).map_err(|e| e.to_string())?;
        let answer = ResponseHead {
            status: 200,
            content_type: Some("application/json".into()),
            code_details: Some("via_upstream".into()),
            attempts: 1,
            headers: vec![],
            ..Default::default()
        };
        m.on_response_head(&answer, false, &mut env).map_err(|e| e.to_string())?;
        m.on_response_data(16, true).map_err(|e| e.to_string())?;
        let step = m.on_response_body(br#"{"quote":"10.00"}"#, &mut env).map_err(|e| e.to_string())?;
        let spliced = step.effects.iter().find_map(|e| match e {
            Effect::ReplaceResponseBody(b) => Some(b.clone()),
            _ => None,
        });
        let v: serde_json::Value =
            serde_json::from_slice(&spliced.ok_or("the preview minted nothing")?).map_err(|e| e.to_string())?;
        v["fingerprint"].as_str().map(str::to_string).ok_or_else(|| "no fingerprint in the preview".into())
    })
}

fn head(fingerprint: Option<String>) -> RequestHead {
    RequestHead {
        trace: Default::default(),
        subject: Some(SUBJECT.into()),
        content_length: None,
        fingerprint,
        path: "/v1/transfers".into(),
        method: "POST".into(),
        idempotency_key: None,
        mcp_method: None,
        mcp_name: None,
        repeated: None,
        not_text: None,
        headers: Vec::new(),
    }
}

/// The confirm's body; `drifted` regenerates the free-text field (not bound).
fn body(drifted: bool) -> Vec<u8> {
    let memo = if drifted { "please ASAP" } else { "ASAP" };
    serde_json::json!({"amount": "10.00", "currency": "EUR", "ref": BUSINESS_REF, "memo": memo})
        .to_string()
        .into_bytes()
}

pub fn subject() -> String {
    subject_hash(SUBJECT)
}

/// The bound fields' canonical JSON of the model's one confirm: what the filter sends beside its
/// business reference, and what the upstream's record carries (a row keeps it as it keeps the subject).
pub fn fields() -> String {
    let json = serde_json::from_slice(&body(false)).unwrap_or_default();
    with_policies(|p| idem_core::canonical::canonical_params(&json, &p.confirm_ignored.bound).unwrap_or_default())
}

/// The machine of a stream rebuilt from its journal, and the effects of the journal's last event.
pub struct Rebuilt {
    pub machine: Machine,
    pub last: Step,
}

pub fn rebuild(kind: Kind, fingerprint: &str, upstream: UpstreamKeys, journal: &[Ev]) -> Rebuilt {
    with_policies(|p| {
        let policy = match (kind, upstream) {
            (Kind::Status, _) => Rc::clone(&p.status),
            (Kind::Confirm { ruled: false, .. }, UpstreamKeys::Honoured) => Rc::clone(&p.confirm_honoured),
            (Kind::Confirm { ruled: false, .. }, UpstreamKeys::Ignored) => Rc::clone(&p.confirm_ignored),
            (Kind::Confirm { ruled: true, .. }, UpstreamKeys::Honoured) => Rc::clone(&p.ruled_honoured),
            (Kind::Confirm { ruled: true, .. }, UpstreamKeys::Ignored) => Rc::clone(&p.ruled_ignored),
        };
        let mut machine = Machine::Pass;
        let mut last = Step::go_on();
        for ev in journal {
            last = match ev {
                Ev::Start { now_s, cached } => {
                    let mut env = ReplayEnv { now_s: *now_s, cached: cached.clone() };
                    let ctx = Ctx { config: Rc::clone(&p.config), policy: Rc::clone(&policy), trace_id: "t".into() };
                    let (m, mut step) = Machine::start(ctx, &head(Some(fingerprint.to_string())), false, &mut env);
                    machine = m;
                    let b = match kind {
                        Kind::Confirm { drifted, .. } => body(drifted),
                        Kind::Status => Vec::new(),
                    };
                    let data = machine.on_request_data(b.len(), true);
                    append(&mut step, data.clone());
                    if data.flow == Flow::NeedBody {
                        append(&mut step, outcome(machine.on_request_body(&b, &mut env)));
                    }
                    step
                }
                Ev::Callout { now_s, status, body } => {
                    let mut env = ReplayEnv { now_s: *now_s, cached: None };
                    outcome(machine.on_callout(&CalloutAnswer { status: *status, body: body.clone() }, &mut env))
                }
                Ev::Response { now_s, status, details, body } => {
                    let mut env = ReplayEnv { now_s: *now_s, cached: None };
                    let head = ResponseHead {
                        status: *status,
                        content_type: Some("application/json".into()),
                        code_details: Some((*details).to_string()),
                        attempts: 1,
                        headers: vec![("content-type".into(), "application/json".into())],
                        ..Default::default()
                    };
                    let mut step = outcome(machine.on_response_head(&head, false, &mut env));
                    if step.flow == Flow::Pause {
                        let data = outcome(machine.on_response_data(body.len(), true));
                        append(&mut step, data);
                        if step.flow == Flow::NeedBody {
                            append(&mut step, outcome(machine.on_response_body(body, &mut env)));
                        }
                    }
                    step
                }
            };
        }
        Rebuilt { machine, last }
    })
}

/// An `Unexpected` event means the model fed the machine something a real host never would.
fn outcome(o: Result<Step, idem_core::machine::Unexpected>) -> Step {
    o.unwrap_or_else(|e| panic!("the model drove the machine wrong: {e}"))
}

fn append(step: &mut Step, mut next: Step) {
    step.effects.append(&mut next.effects);
    step.flow = next.flow;
}

/// The lease the rebuilt machine says it holds.
pub fn live_lease(r: &Rebuilt) -> Option<LeaseRenewal> {
    r.machine.live_lease()
}

/// What the host reads off a stream's rebuilt machine: the effects of its last event and the
/// lease it holds.
#[derive(Clone, Debug)]
pub struct Replayed {
    pub effects: Effects,
    pub lease: Option<LeaseRenewal>,
}

/// Replays remembered per thread: the machine is deterministic in its journal, and the same
/// journal recurs in many states of the world (docs/model.md, "Keeping the checker fast").
const REPLAYS_KEPT: usize = 200_000;

thread_local! {
    static REPLAYS: RefCell<std::collections::HashMap<u64, Replayed>> = RefCell::new(Default::default());
}

/// [`rebuild`], remembered: what the host reads off the machine after `journal`.
pub fn replayed(kind: Kind, fingerprint: &str, upstream: UpstreamKeys, journal: &[Ev]) -> Replayed {
    let key = crate::hash::hash(&(kind, fingerprint, upstream, journal));
    if let Some(r) = REPLAYS.with(|m| m.borrow().get(&key).cloned()) {
        return r;
    }
    let rebuilt = rebuild(kind, fingerprint, upstream, journal);
    let r = Replayed { effects: effects(&rebuilt.last), lease: live_lease(&rebuilt) };
    REPLAYS.with(|m| {
        let mut m = m.borrow_mut();
        if m.len() >= REPLAYS_KEPT {
            m.clear();
        }
        m.insert(key, r.clone());
    });
    r
}

/// Who answered the agent, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Said {
    /// A reply of the guard, by its kind (what it tells is the kind's row, `ReplyKind::tells`).
    Guard(ReplyKind),
    /// The upstream's own answer, passed through (or replayed byte for byte).
    Upstream,
    /// The connection dropped: the agent was told nothing.
    Reset,
    /// No answer was held where one was expected (never in a correct run).
    Nothing,
}

/// An answer the agent got, and what it says.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Answer {
    pub http: u16,
    pub said: Said,
    /// The execution the answer's result names (`T-<n>`), if any.
    pub execution: Option<u8>,
}

impl Answer {
    /// A reply of the guard, classified by the kind the core rendered it from; a reply without
    /// one is a recorded answer sent back as it was.
    pub fn from_reply(reply: &Reply) -> Answer {
        let said = reply.facts.as_ref().map_or(Said::Upstream, |f| Said::Guard(f.kind));
        Answer { http: reply.http_status, said, execution: execution_in(&reply.body) }
    }

    /// The upstream's own answer.
    pub fn upstream(http: u16, body: &[u8]) -> Answer {
        Answer { http, said: Said::Upstream, execution: execution_in(body) }
    }

    pub fn without(said: Said) -> Answer {
        Answer { http: 0, said, execution: None }
    }

    fn tells(&self) -> Option<Tells> {
        match self.said {
            Said::Guard(kind) => Some(kind.tells()),
            _ => None,
        }
    }

    /// "Nothing ran" (§7): the agent may run it again, or (a person refused, or nobody approved
    /// before `exp`) nothing will.
    pub fn says_nothing_ran(&self) -> bool {
        self.tells() == Some(Tells::NothingRan)
    }

    /// Says nothing about the operation either way: the agent could not be answered.
    pub fn is_unknowing(&self) -> bool {
        self.said == Said::Reset || self.tells() == Some(Tells::Unknowing)
    }

    /// A definite failure: a replayed FAILED (`already_failed`), or the upstream's own 4xx.
    pub fn says_failed(&self) -> bool {
        self.tells() == Some(Tells::Failed) || (self.said == Said::Upstream && (400..500).contains(&self.http))
    }

    /// A result the agent may report: the upstream's own, or a replay.
    pub fn is_result(&self) -> bool {
        (self.said == Said::Upstream && self.http < 300) || self.tells() == Some(Tells::Ran)
    }

    /// Definite (§7): a result, a definite failure, nothing ran, or a person decides.
    pub fn is_settled(&self) -> bool {
        self.is_result()
            || matches!(self.tells(), Some(Tells::NothingRan | Tells::Failed | Tells::Review | Tells::Forgotten))
            || (self.said == Said::Upstream && (400..500).contains(&self.http))
    }
}

/// `T-<n>` in a body: the upstream numbers its executions.
pub fn execution_in(body: &[u8]) -> Option<u8> {
    let text = String::from_utf8_lossy(body);
    let at = text.find("T-")?;
    text.get(at + 2..)?.chars().take_while(char::is_ascii_digit).collect::<String>().parse().ok()
}

/// What the host does with the effects of one event.
#[derive(Clone, Debug, Default)]
pub struct Effects {
    pub call: Option<idem_core::machine::Callout>,
    /// ResumeRequest with the operation key set: the request goes upstream.
    pub forward: Option<String>,
    pub reply: Option<Answer>,
    pub rewrite: Option<Answer>,
    pub resume_response: bool,
    pub shared_set: Option<Vec<u8>>,
    pub unknown_outcome: bool,
    /// The filter answered from its replay cache.
    pub replay_cache_hit: bool,
    pub flow: Option<Flow>,
}

pub fn effects(step: &Step) -> Effects {
    let mut out = Effects { flow: Some(step.flow), ..Effects::default() };
    let mut key = None;
    for e in &step.effects {
        match e {
            Effect::Call(c) => out.call = Some(c.clone()),
            Effect::SetRequestHeader(name, value) if name.eq_ignore_ascii_case("idempotency-key") => {
                key = Some(value.clone())
            }
            Effect::ResumeRequest => out.forward = key.clone().or(Some(String::new())),
            Effect::Reply(r) => out.reply = Some(Answer::from_reply(r)),
            Effect::Rewrite(r) => out.rewrite = Some(Answer::from_reply(r)),
            Effect::ResumeResponse => out.resume_response = true,
            Effect::SharedSet { value, .. } => out.shared_set = Some(value.clone()),
            Effect::Count(idem_core::machine::Counter::UnknownOutcome) => out.unknown_outcome = true,
            Effect::Count(idem_core::machine::Counter::ReplayCacheHits) => out.replay_cache_hit = true,
            _ => {}
        }
    }
    out
}

/// The header name the agent's fingerprint travels in (for the trace).
pub const FINGERPRINT: &str = FINGERPRINT_HEADER;
