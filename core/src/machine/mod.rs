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
mod mcp;
mod outside;
mod preview;
pub mod replay_cache;
pub mod splice;
mod status;
#[cfg(test)]
mod tests;

use crate::canonical::{self, BodyError, CanonError};
use crate::fingerprint::{self, Claims, Expect, VerifyError};
use crate::policy::{PluginConfig, Role, RoutePolicy};
use crate::protocol::{OpKey, SecurityEventReport, SecurityKind};
use crate::reply::{self, Reply, ReplyContext, ReplyKind};
use crate::trace::Trace;
use std::fmt;
use std::rc::Rc;

pub use self::confirm::Confirm;
pub use self::counter::Counter;
pub use self::mcp::{Mcp, HEADER_MISMATCH, MCP_METHOD_HEADER, MCP_NAME_HEADER, META_KEY};
pub use self::preview::Preview;
pub use self::status::Status;

/// The header an agent may carry the fingerprint in (instead of the body).
pub const FINGERPRINT_HEADER: &str = "agent-fingerprint";
/// The body field (and query parameter) it may come in.
pub const FINGERPRINT_FIELD: &str = "fingerprint";
/// The header that carries the operation key to the upstream, and that a
/// client may never choose on a guarded route.
pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";

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

/// The request facts an annotated route needs, read once by the host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestHead {
    /// The request's trace: its id for replies, its context for callouts.
    pub trace: Trace,
    /// The caller's identity from the configured source; `None` if absent or blank.
    pub subject: Option<String>,
    pub content_length: Option<u64>,
    /// The `agent-fingerprint` header.
    pub fingerprint: Option<String>,
    /// `:path`, for a fingerprint in the query string (status routes).
    pub path: String,
    /// `:method` (client-key mode hashes it with the path when nothing is bound).
    pub method: String,
    /// The caller's `Idempotency-Key` header (client-key mode); never forwarded.
    pub idempotency_key: Option<String>,
    /// MCP routes: the `Mcp-Method` / `Mcp-Name` headers, when the client sends them.
    pub mcp_method: Option<String>,
    pub mcp_name: Option<String>,
    /// A header the guard reads that came more than once (DESIGN §6: a 400, never "first wins").
    pub repeated: Option<&'static str>,
    /// A header the guard reads whose value is not text (not UTF-8): a 400, never a guess at what
    /// its bytes mean (two different byte strings must never read as one subject or key).
    pub not_text: Option<&'static str>,
    /// Every header, names in lower case, only where the route binds a header (`header:NAME`):
    /// the bound one is found among them in every spelling an upstream reads as it.
    pub headers: Vec<(String, Vec<u8>)>,
}

impl RequestHead {
    /// The head from the request's header pairs (pseudo-headers included, names in lower case as
    /// Envoy gives them), reading what `needs` asks for and the subject from `subject_header`
    /// (`None` when the subject comes from a property). A header the guard reads that appears
    /// twice is noted in `repeated`; the host never chooses one of the values.
    ///
    /// Values are the bytes the client sent: a header the guard reads must be text (else
    /// `not_text` names it); one it does not read (the request id, the trace context, the length)
    /// is used only when it is text and otherwise decides nothing.
    pub fn from_headers(headers: &[(String, Vec<u8>)], needs: HeadNeeds, subject_header: Option<&str>) -> RequestHead {
        let mut head = RequestHead::default();
        let mut seen: Vec<&'static str> = Vec::new();
        let mut note = |head: &mut RequestHead, name: &'static str| {
            if seen.contains(&name) {
                head.repeated = head.repeated.or(Some(name));
            } else {
                seen.push(name);
            }
        };
        let (mut rid, mut tp, mut ts) = (None, None, None);
        // A value the guard reads: its text, or (not UTF-8) noted and read as nothing.
        let guarded = |head: &mut RequestHead, label: &'static str, value: &[u8]| match std::str::from_utf8(value) {
            Ok(text) => Some(text.to_owned()),
            Err(_) => {
                head.not_text = head.not_text.or(Some(label));
                None
            }
        };
        if needs.headers {
            head.headers = headers.iter().map(|(k, v)| (k.to_ascii_lowercase(), v.clone())).collect();
        }
        for (name, value) in headers {
            let name = name.as_str();
            let text = std::str::from_utf8(value).ok();
            if subject_header.is_some_and(|s| s.eq_ignore_ascii_case(name)) {
                note(&mut head, SUBJECT_HEADER_LABEL);
                head.subject = guarded(&mut head, SUBJECT_HEADER_LABEL, value);
                continue;
            }
            match name {
                // Not the guard's: used when text, else as if absent.
                "x-request-id" => rid = rid.or(text),
                "traceparent" => tp = tp.or(text),
                "tracestate" => ts = ts.or(text),
                "content-length" => head.content_length = text.and_then(|t| t.trim().parse().ok()),
                FINGERPRINT_HEADER if needs.fingerprint => {
                    note(&mut head, FINGERPRINT_HEADER);
                    head.fingerprint = guarded(&mut head, FINGERPRINT_HEADER, value);
                }
                ":path" if needs.path => head.path = guarded(&mut head, ":path", value).unwrap_or_default(),
                ":method" if needs.method => head.method = guarded(&mut head, ":method", value).unwrap_or_default(),
                // Without regard to case, as Envoy removes it: whether a removal is due is read here.
                n if needs.idempotency_key && n.eq_ignore_ascii_case(IDEMPOTENCY_KEY_HEADER) => {
                    note(&mut head, IDEMPOTENCY_KEY_HEADER);
                    // Present, text or not: a client's key is removed either way.
                    head.idempotency_key = Some(guarded(&mut head, IDEMPOTENCY_KEY_HEADER, value).unwrap_or_default());
                }
                MCP_METHOD_HEADER if needs.mcp => {
                    note(&mut head, MCP_METHOD_HEADER);
                    head.mcp_method = guarded(&mut head, MCP_METHOD_HEADER, value);
                }
                MCP_NAME_HEADER if needs.mcp => {
                    note(&mut head, MCP_NAME_HEADER);
                    head.mcp_name = guarded(&mut head, MCP_NAME_HEADER, value);
                }
                // `idempotency_key` for `idempotency-key`: Envoy forwards it (underscores are allowed
                // unless a listener says otherwise), and a CGI-style server (WSGI, Rack, PHP) reads both
                // spellings as one variable, so the upstream could read a value the guard never saw.
                // It is one more copy of the header, whether or not the dashed one came too.
                n if n.contains('_') => {
                    if let Some(label) = underscore_alias(n, needs, subject_header) {
                        head.repeated = head.repeated.or(Some(label));
                    }
                }
                // The same the other way round: a subject header configured with `_` (`x_agent_subject`)
                // has its dashed spelling as the alias.
                n if subject_header.is_some_and(|s| s.contains('_') && read_as(n, s)) => {
                    head.repeated = head.repeated.or(Some(SUBJECT_HEADER_LABEL));
                }
                _ => {}
            }
        }
        head.trace = Trace::of(rid, tp, ts);
        head.subject = head.subject.filter(|s| !s.trim().is_empty());
        head
    }
}

/// The guarded header (as `RequestHead::repeated` names it) that `name` spells with `_` for `-`,
/// among those the role reads.
fn underscore_alias(name: &str, needs: HeadNeeds, subject_header: Option<&str>) -> Option<&'static str> {
    let is = |header: &str| read_as(name, header);
    if subject_header.is_some_and(is) {
        return Some(SUBJECT_HEADER_LABEL);
    }
    [
        (FINGERPRINT_HEADER, needs.fingerprint),
        (IDEMPOTENCY_KEY_HEADER, needs.idempotency_key),
        (MCP_METHOD_HEADER, needs.mcp),
        (MCP_NAME_HEADER, needs.mcp),
    ]
    .into_iter()
    .find(|(header, read)| *read && is(header))
    .map(|(header, _)| header)
}

/// Whether a server that reads headers CGI-style (WSGI, Rack, PHP: case folded, `-` and `_` one
/// character) reads header `name` as `header`.
pub fn read_as(name: &str, header: &str) -> bool {
    let fold = |c: u8| if c == b'_' { b'-' } else { c.to_ascii_lowercase() };
    name.len() == header.len() && name.bytes().zip(header.bytes()).all(|(a, b)| fold(a) == fold(b))
}

/// How a repeated subject header is named in `RequestHead::repeated` (its real name is the
/// configuration's).
pub const SUBJECT_HEADER_LABEL: &str = "the subject header";

/// Which request headers a role reads (the trace id, subject and content
/// length are always read): a preview, the hot path, reads no more.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HeadNeeds {
    pub fingerprint: bool,
    pub path: bool,
    pub method: bool,
    pub idempotency_key: bool,
    pub mcp: bool,
    /// Every header (the route binds one: `header:NAME`).
    pub headers: bool,
}

impl HeadNeeds {
    pub fn for_role(role: Role) -> HeadNeeds {
        let all = HeadNeeds {
            fingerprint: true,
            path: true,
            method: true,
            idempotency_key: true,
            mcp: false,
            headers: false,
        };
        match role {
            Role::Preview => HeadNeeds::default(),
            Role::Confirm | Role::Idempotent => all,
            Role::Status => HeadNeeds { method: false, ..all },
            Role::Mcp => HeadNeeds { fingerprint: false, idempotency_key: false, mcp: true, ..all },
        }
    }

    /// What a route's policy reads: its role's, and the path or every header where it binds a
    /// value there (a preview that binds none still reads no more).
    pub fn for_policy(policy: &RoutePolicy) -> HeadNeeds {
        use crate::canonical::Source;
        let role = HeadNeeds::for_role(policy.role);
        let binds = |source: Source| policy.bound.iter().any(|f| f.source == source);
        HeadNeeds {
            path: role.path || binds(Source::Path) || binds(Source::Query),
            headers: binds(Source::Header),
            ..role
        }
    }
}

/// The upstream's answer head, as the host sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResponseHead {
    /// 0 if the host cannot tell.
    pub status: u16,
    pub content_type: Option<String>,
    /// Envoy's `response.code_details` (`via_upstream`, or why Envoy answered itself).
    pub code_details: Option<String>,
    /// Envoy's `x-envoy-attempt-count` (1 when absent).
    pub attempts: u32,
    /// Every header, only when [`Machine::response_needs_headers`] asked for them.
    pub headers: Vec<(String, String)>,
    /// `content-length` and `content-encoding`, only when [`Machine::response_needs_framing`]
    /// asked for them (a preview streams a JSON answer of known length with the fingerprint in it).
    pub content_length: Option<u64>,
    pub content_encoding: Option<String>,
    /// With `headers`: the names (lower case) of the headers whose value is not text (not
    /// UTF-8); `headers` has them decoded leniently, which the guard never reads as a fact.
    pub not_text: Vec<String>,
}

impl ResponseHead {
    /// The head from the answer's header pairs as the client would get them (values as bytes),
    /// reading the full map only when `full` and the framing only when `framing` (a preview).
    /// Where a header the guard reads came more than once, no copy is picked: a length counts
    /// only if every copy agrees, the codings are one list (RFC 9110 §5.3), and a content type
    /// that disagrees with itself is no type at all (nothing is minted into such an answer).
    pub fn from_headers(headers: &[(String, Vec<u8>)], full: bool, framing: bool) -> ResponseHead {
        let texts = |name: &'static str| {
            headers.iter().filter(move |(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| std::str::from_utf8(v).ok())
        };
        // The one value of a header, when every copy is text and says the same.
        let single = |name: &'static str| {
            let mut all = texts(name);
            let first = all.next()??;
            all.all(|o| o == Some(first)).then(|| first.to_owned())
        };
        let mut head = ResponseHead {
            status: single(":status").and_then(|s| s.parse().ok()).unwrap_or(0),
            content_type: single("content-type"),
            attempts: 1,
            ..ResponseHead::default()
        };
        if framing {
            let mut lengths = texts("content-length").map(|l| l.and_then(|l| l.trim().parse::<u64>().ok()));
            head.content_length = match lengths.next().flatten() {
                Some(l) if lengths.all(|o| o == Some(l)) => Some(l),
                _ => None,
            };
            let codings: Vec<String> =
                texts("content-encoding").map(|c| c.map_or_else(|| "unreadable".to_owned(), str::to_owned)).collect();
            head.content_encoding = (!codings.is_empty()).then(|| codings.join(", "));
        }
        if full {
            head.attempts = single("x-envoy-attempt-count").and_then(|a| a.parse().ok()).unwrap_or(1);
            head.headers = headers
                .iter()
                .map(|(k, v)| match std::str::from_utf8(v) {
                    Ok(text) => (k.clone(), text.to_owned()),
                    Err(_) => {
                        head.not_text.push(k.to_ascii_lowercase());
                        (k.clone(), String::from_utf8_lossy(v).into_owned())
                    }
                })
                .collect();
        }
        head
    }

    /// Every value of header `name` the answer carries, as text; `None` if one is not text.
    pub fn values(&self, name: &str) -> Option<Vec<&str>> {
        if self.not_text.iter().any(|n| n.eq_ignore_ascii_case(name)) {
            return None;
        }
        Some(self.headers.iter().filter(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str()).collect())
    }
}

/// The answer to a [`Callout`]. A callout that failed, timed out or could not
/// even be dispatched arrives with `status: None`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CalloutAnswer {
    pub status: Option<u16>,
    pub body: Vec<u8>,
}

impl CalloutAnswer {
    pub fn failed() -> CalloutAnswer {
        CalloutAnswer { status: None, body: Vec::new() }
    }

    fn json<T: serde::de::DeserializeOwned>(&self) -> Option<T> {
        self.status?;
        serde_json::from_slice(&self.body).ok()
    }

    /// A lookup's 404 that says a row could have existed and been reaped (DESIGN §4).
    fn reaped_possible(&self) -> bool {
        self.json::<crate::protocol::NotFoundView>().is_some_and(|v| v.reaped_possible)
    }

    /// The approval record idemd sent beside its answer (an acquire, or a lookup's 404).
    fn approval(&self) -> Option<crate::protocol::ApprovalView> {
        self.json::<crate::protocol::WithApproval<serde_json::Value>>()?.approval
    }
}

/// A call to idemd. The host adds the cluster, authority, credential, trace id
/// and timeout from the plugin configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Callout {
    pub method: &'static str,
    pub path: String,
    /// JSON; `None` for a GET.
    pub body: Option<Vec<u8>>,
}

impl Callout {
    /// A `POST` of a protocol body. Serializing these plain structs cannot fail; an empty body
    /// would be a 400 from idemd, never a guess.
    pub fn post<T: serde::Serialize>(path: &str, body: &T) -> Callout {
        Callout { method: "POST", path: path.to_string(), body: Some(serde_json::to_vec(body).unwrap_or_default()) }
    }
}

/// One thing the host must do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    Count(Counter),
    /// Param tampering, cross-subject use, a forged signature or an unknown key id: a
    /// structured warning with the trace id, scope and nonce — never the secret, never the body.
    SecurityEvent {
        kind: &'static str,
        nonce: String,
    },
    /// Dispatch and forget: the answer is never waited for (nothing the stream does depends on
    /// it), so a report never delays the reply it accompanies.
    Report(Callout),
    Warn(String),
    SetRequestHeader(&'static str, String),
    RemoveRequestHeader(&'static str),
    SetResponseHeader(String, String),
    RemoveResponseHeader(&'static str),
    /// Replace the buffered response body (its size is the host's to know).
    ReplaceResponseBody(Vec<u8>),
    /// Replace the held answer with this reply: its status, its headers and its body.
    Rewrite(Reply),
    /// Answer locally; nothing more of this stream reaches either side.
    Reply(Reply),
    /// Dispatch, and feed the answer to [`Machine::on_callout`].
    Call(Callout),
    ResumeRequest,
    ResumeResponse,
    /// Store a value in the process-wide shared data (the replay cache).
    SharedSet {
        key: String,
        value: Vec<u8>,
    },
}

/// What the host returns to its proxy for the current callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Pause,
    /// Pause, read the complete body of this direction (the size the host was
    /// told at end of stream) and hand it to the matching `*_body` event.
    NeedBody,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub effects: Vec<Effect>,
    pub flow: Flow,
}

impl Step {
    pub fn go_on() -> Step {
        Step { effects: Vec::new(), flow: Flow::Continue }
    }

    pub fn pause() -> Step {
        Step { effects: Vec::new(), flow: Flow::Pause }
    }

    fn need_body() -> Step {
        Step { effects: Vec::new(), flow: Flow::NeedBody }
    }

    fn with(mut self, effect: Effect) -> Step {
        self.effects.push(effect);
        self
    }

    fn then(mut self, mut other: Step) -> Step {
        self.effects.append(&mut other.effects);
        self.flow = other.flow;
        self
    }

    /// The local reply this step sends, if any (tests and hosts use it).
    pub fn reply(&self) -> Option<&Reply> {
        self.effects.iter().find_map(|e| match e {
            Effect::Reply(r) => Some(r),
            _ => None,
        })
    }
}

/// An event the machine cannot take in its current phase. The host logs it
/// and lets the stream continue; the machine's state is unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unexpected {
    pub event: &'static str,
    pub phase: &'static str,
}

impl fmt::Display for Unexpected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "event {} in phase {}", self.event, self.phase)
    }
}

impl std::error::Error for Unexpected {}

pub type Outcome = Result<Step, Unexpected>;

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
    fn render(&self, kind: ReplyKind, ctx: ReplyContext) -> Reply {
        self.render_as(kind, ctx, false)
    }

    fn render_as(&self, kind: ReplyKind, ctx: ReplyContext, problem: bool) -> Reply {
        let ctx = ReplyContext { trace_id: &self.trace_id, ..ctx };
        if problem {
            reply::problem(kind, &ctx)
        } else {
            reply::render(kind, self.config.language, &ctx)
        }
    }

    /// A route for programs that take only client keys answers in problems from the first byte.
    fn speaks_problem(&self) -> bool {
        self.policy.role == Role::Idempotent && self.policy.callers == crate::policy::Callers::Programs
    }

    /// A route whose callers are programs sending their own keys (only keys, or keys beside
    /// fingerprints): what is wrong before the body is read is told to them as a problem.
    fn for_programs(&self) -> bool {
        self.policy.callers == crate::policy::Callers::Programs
            && (self.policy.role == Role::Idempotent || self.policy.client_keys)
    }

    /// A header the guard reads came more than once: which value is meant is unknowable, and
    /// choosing one ("first wins") is how a proxy and an upstream come to disagree (DESIGN §6).
    fn repeated_header(&self, name: &str) -> Step {
        let kind = match name {
            FINGERPRINT_HEADER => ReplyKind::FingerprintInvalid,
            IDEMPOTENCY_KEY_HEADER => ReplyKind::KeyInvalid,
            _ => ReplyKind::InvalidHeader,
        };
        let detail = format!("{name} was sent more than once (a spelling with `_` for `-` counts as another copy)");
        let ctx = ReplyContext { detail: Some(&detail), ..Default::default() };
        Step::pause()
            .with(Effect::Reply(self.render_as(kind, ctx, self.for_programs())))
            .with(Effect::Count(Counter::RejectedHeader))
    }

    /// A header the guard reads is not text: what its bytes mean is a guess (decoded leniently,
    /// two different values may read as one), so it is refused like a repeated one.
    fn header_not_text(&self, name: &str) -> Step {
        let kind = match name {
            FINGERPRINT_HEADER => ReplyKind::FingerprintInvalid,
            IDEMPOTENCY_KEY_HEADER => ReplyKind::KeyInvalid,
            _ => ReplyKind::InvalidHeader,
        };
        let detail = format!("{name} is not text (its value is not UTF-8)");
        let ctx = ReplyContext { detail: Some(&detail), ..Default::default() };
        Step::pause()
            .with(Effect::Reply(self.render_as(kind, ctx, self.for_programs())))
            .with(Effect::Count(Counter::RejectedHeader))
    }

    /// A reply that needs nothing but the defaults.
    fn simple(&self, kind: ReplyKind) -> Step {
        let ctx = ReplyContext { retry_after_ms: self.config.defaults.retry_after_ms, ..Default::default() };
        Step::pause().with(Effect::Reply(self.render_as(kind, ctx, self.speaks_problem())))
    }

    fn reply(&self, kind: ReplyKind, ctx: ReplyContext) -> Step {
        Step::pause().with(Effect::Reply(self.render(kind, ctx)))
    }

    /// A security event: counted (in all and by kind), logged, and reported to idemd's audit.
    /// `key`: the operation, where the signature proved it (the log line shows it only then).
    fn security_event(&self, kind: SecurityKind, key: Option<&OpKey>, subject_hash: &str) -> Vec<Effect> {
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

    fn body_error(&self, e: &BodyError) -> Step {
        self.body_error_as(e, self.speaks_problem())
    }

    /// A body that cannot be read, as an envelope or (client-key mode for programs) a problem.
    fn body_error_as(&self, e: &BodyError, problem: bool) -> Step {
        let kind = match e {
            BodyError::TooLarge { .. } => ReplyKind::BodyTooLarge,
            BodyError::Invalid(_) | BodyError::NotAnObject => ReplyKind::InvalidJson,
        };
        let ctx = ReplyContext { retry_after_ms: self.config.defaults.retry_after_ms, ..Default::default() };
        Step::pause().with(Effect::Reply(self.render_as(kind, ctx, problem))).with(Effect::Count(Counter::RejectedBody))
    }

    fn field_error(&self, e: &CanonError) -> Step {
        self.field_error_as(e, false)
    }

    fn field_error_as(&self, e: &CanonError, problem: bool) -> Step {
        let detail = e.to_string();
        let ctx = ReplyContext { detail: Some(&detail), ..Default::default() };
        Step::pause()
            .with(Effect::Reply(self.render_as(ReplyKind::InvalidField, ctx, problem)))
            .with(Effect::Count(Counter::RejectedBody))
    }

    /// Verify a fingerprint against this route and caller (everything but
    /// expiry, which each role weighs itself). `Err` is the refusal to send.
    fn verify(&self, token: Option<&str>, subject_hash: &str, param_hash: Option<&str>) -> Result<Claims, Step> {
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

    /// Where and when `in_progress` polls: the status tool, else this call's own tool (by its
    /// `tool.name`; an MCP tool always has one), after the route's interval.
    /// The reply about an operation a person is asked about (DESIGN §4, "Approval"): what the
    /// approval record says as of `now_s`, for a confirm or (`status_query`) a status lookup.
    fn approval_reply(&self, view: &crate::protocol::ApprovalView, now_s: u64, status_query: bool) -> Step {
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

    fn polling(&self) -> ReplyContext<'_> {
        ReplyContext {
            poll_with: self.policy.status_tool.as_deref(),
            own_tool: self.policy.tool.as_ref().and_then(|t| t.name.as_deref()),
            poll_after_ms: self.policy.poll_after_ms,
            ..Default::default()
        }
    }
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

    pub fn role(&self) -> Option<Role> {
        match self {
            Machine::Pass => None,
            Machine::Preview(_) => Some(Role::Preview),
            Machine::Confirm(_) => Some(Role::Confirm),
            Machine::Status(_) => Some(Role::Status),
            Machine::Mcp(_) => Some(Role::Mcp),
        }
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

/// A raw query parameter from a request path (`/status?fingerprint=...`).
/// Fingerprints are base64url and need no percent-decoding.
pub fn query_param(path: &str, name: &str) -> Option<String> {
    query_params(path, name).into_iter().next()
}

/// Every value of a query parameter, in order: a parameter named twice is two values, and which
/// one a reader takes is not ours to guess.
pub fn query_params(path: &str, name: &str) -> Vec<String> {
    let Some((_, query)) = path.split_once('?') else { return Vec::new() };
    let query = query.split_once('#').map_or(query, |(q, _)| q);
    query
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .filter(|(k, _)| *k == name)
        .map(|(_, v)| v.to_owned())
        .collect()
}

/// The upstream's `Retry-After` in milliseconds (delta-seconds form only).
/// Repeated, it counts only if every copy says the same (none is picked).
pub fn retry_after_ms(headers: &[(String, String)]) -> Option<u64> {
    let mut all = headers.iter().filter(|(k, _)| k.eq_ignore_ascii_case("retry-after")).map(|(_, v)| v.trim());
    let first = all.next()?;
    if !all.all(|v| v == first) {
        return None;
    }
    first.parse::<u64>().ok().map(|s| s.saturating_mul(1000))
}

/// The fingerprint of a confirm or status body: the header wins, else the
/// body's `fingerprint` string.
fn body_fingerprint(json: &serde_json::Value) -> Option<String> {
    json.get(FINGERPRINT_FIELD).and_then(|v| v.as_str()).map(str::to_owned)
}

fn parse_body(ctx: &Ctx, body: &[u8]) -> Result<serde_json::Value, Step> {
    canonical::parse_json_body(body, ctx.config.max_body_bytes).map_err(|e| ctx.body_error(&e))
}
