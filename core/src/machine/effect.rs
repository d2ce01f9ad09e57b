//! The machine's vocabulary towards its host: the calls to idemd and their answers, the effects to
//! carry out in order, the flow to return to the proxy, and the out-of-order event.

use crate::reply::Reply;
use std::fmt;

use super::Counter;

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

    pub(super) fn json<T: serde::de::DeserializeOwned>(&self) -> Option<T> {
        self.status?;
        serde_json::from_slice(&self.body).ok()
    }

    /// A lookup's 404 that says a row could have existed and been reaped (DESIGN §4).
    pub(super) fn reaped_possible(&self) -> bool {
        self.json::<crate::protocol::NotFoundView>().is_some_and(|v| v.reaped_possible)
    }

    /// The approval record idemd sent beside its answer (an acquire, or a lookup's 404).
    pub(super) fn approval(&self) -> Option<crate::protocol::ApprovalView> {
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

    pub(super) fn need_body() -> Step {
        Step { effects: Vec::new(), flow: Flow::NeedBody }
    }

    pub(super) fn with(mut self, effect: Effect) -> Step {
        self.effects.push(effect);
        self
    }

    pub(super) fn then(mut self, mut other: Step) -> Step {
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
