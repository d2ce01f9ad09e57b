//! One ext_proc stream: Envoy's messages in, the adapter's `Stream` decides, `ProcessingResponse`s
//! out. This is where the filter hosts' "pause" and "resume" become ext_proc's protocol:
//!
//! - **BUFFERED** (a direction's body mode): Envoy sends the headers and waits; then the whole body
//!   (at its end, or when trailers arrive) and waits; then the trailers and waits. Envoy holds the
//!   headers until the body's answer (header mutations in a body answer apply only in this mode), so
//!   answering the headers while the machine waits for the body is the filters' pause. Every other
//!   message is answered when the machine no longer waits for idemd: an acquire holds the body's
//!   answer, a complete holds the answer's.
//! - **FULL_DUPLEX_STREAMED**: Envoy sends headers, chunks and trailers without waiting; the processor
//!   answers in order when it likes, and sends the body back itself (`streamed_response`). A paused
//!   direction is held here (headers unanswered, chunks kept) and released, headers first, when the
//!   machine continues or resumes.
//! - **STREAMED** and **NONE** cannot hold a guarded stream (Envoy sends the headers upstream before
//!   the body is judged, or never shows the body): a guarded route under them is refused 503
//!   `status_unavailable`, nothing forwarded. Unguarded streams pass in every mode.
//!
//! Only the machine releases a held stream (DESIGN §6): a message that arrives while the machine
//! waits is queued, never answered early, and the trailers are the end of a body that has them.

use crate::attributes;
use crate::host::{ExtProcHost, HeaderChanges, LocalReply};
use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderValue, HeaderValueOption,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::{BodySendMode, HeaderSendMode};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::ProcessingMode;
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Msg;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Answer;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders, ImmediateResponse,
    ProcessingRequest, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use idem_adapter::{Action, Shared, Stream};
use idem_core::machine::{self, CalloutAnswer};
use std::rc::Rc;

/// Envoy recommends streamed body chunks of at most 64 KiB.
const CHUNK: usize = 64 << 10;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    Request,
    Response,
}

/// How Envoy sends one direction's body to this processor (`ProtocolConfiguration`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Buffered,
    Duplex,
    /// STREAMED, BUFFERED_PARTIAL, NONE, or not told: no way to hold a guarded stream.
    CannotHold,
}

impl Mode {
    fn of(mode: i32) -> Mode {
        match BodySendMode::try_from(mode) {
            Ok(BodySendMode::Buffered) => Mode::Buffered,
            Ok(BodySendMode::FullDuplexStreamed) => Mode::Duplex,
            _ => Mode::CannotHold,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Headers,
    Body,
    Trailers,
}

/// One direction's progress.
#[derive(Debug, Default)]
struct Side {
    /// BUFFERED: the messages Envoy waits for answers to, in order.
    owed: Vec<Kind>,
    /// FULL_DUPLEX: the headers' answer went out (the direction flows).
    headers_answered: bool,
    body_seen: bool,
    /// The body ended (`end_of_stream` on the headers or a chunk).
    eos: bool,
    trailers: bool,
    /// The machine was told this direction's end.
    ended: bool,
}

pub struct Driver {
    stream: Stream<ExtProcHost>,
    modes: Option<(Mode, Mode)>,
    request: Side,
    response: Side,
    /// An `ImmediateResponse` went out: Envoy ends the stream, nothing more is answered.
    done: bool,
    /// The callout the machine waits for is in flight.
    pub waiting: bool,
    out: Vec<ProcessingResponse>,
}

fn answer(a: Answer) -> ProcessingResponse {
    ProcessingResponse { response: Some(a), ..Default::default() }
}

fn header_map(h: &HttpHeaders) -> Vec<(String, Vec<u8>)> {
    h.headers
        .iter()
        .flat_map(|m| m.headers.iter())
        .map(|h| {
            let v = if h.raw_value.is_empty() { h.value.as_bytes().to_vec() } else { h.raw_value.clone() };
            (h.key.to_ascii_lowercase(), v)
        })
        .collect()
}

fn mutation(changes: HeaderChanges) -> Option<HeaderMutation> {
    if changes.is_empty() {
        return None;
    }
    let set_headers = changes
        .set
        .into_iter()
        .map(|(key, value)| HeaderValueOption {
            header: Some(HeaderValue { key, value: String::new(), raw_value: value.into_bytes() }),
            append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
            ..Default::default()
        })
        .collect();
    Some(HeaderMutation { set_headers, remove_headers: changes.remove })
}

fn common(header_mutation: Option<HeaderMutation>, body: Option<Vec<u8>>) -> Option<CommonResponse> {
    Some(CommonResponse {
        header_mutation,
        body_mutation: body.map(|b| BodyMutation { mutation: Some(Mutation::Body(b)) }),
        ..Default::default()
    })
}

impl Driver {
    pub fn new(shared: Rc<Shared>, host: ExtProcHost) -> Driver {
        Driver {
            stream: Stream::new(shared, host),
            modes: None,
            request: Side::default(),
            response: Side::default(),
            done: false,
            waiting: false,
            out: Vec::new(),
        }
    }

    /// What to send Envoy now, in order.
    pub fn take_out(&mut self) -> Vec<ProcessingResponse> {
        std::mem::take(&mut self.out)
    }

    pub fn host_mut(&mut self) -> &mut ExtProcHost {
        self.stream.host_mut()
    }

    fn mode(&self, dir: Dir) -> Mode {
        match (self.modes, dir) {
            (Some((m, _)), Dir::Request) => m,
            (Some((_, m)), Dir::Response) => m,
            (None, _) => Mode::CannotHold,
        }
    }

    fn side(&mut self, dir: Dir) -> &mut Side {
        match dir {
            Dir::Request => &mut self.request,
            Dir::Response => &mut self.response,
        }
    }

    pub fn on_message(&mut self, msg: ProcessingRequest) {
        if self.modes.is_none() {
            if let Some(p) = &msg.protocol_config {
                self.modes = Some((Mode::of(p.request_body_mode), Mode::of(p.response_body_mode)));
            }
        }
        if self.done {
            return;
        }
        let Some(request) = msg.request else { return };
        match request {
            Msg::RequestHeaders(h) => {
                let host = self.stream.host_mut();
                host.request_headers = header_map(&h);
                host.annotation = attributes::annotation(&msg.attributes);
                host.attributes = attributes::flatten(&msg.attributes);
                host.metadata = msg.metadata_context.clone();
                self.on_headers(Dir::Request, h.end_of_stream);
            }
            Msg::ResponseHeaders(h) => {
                let host = self.stream.host_mut();
                host.response_headers = header_map(&h);
                host.attributes.extend(attributes::flatten(&msg.attributes));
                self.on_headers(Dir::Response, h.end_of_stream);
            }
            Msg::RequestBody(b) => self.on_body(Dir::Request, b.body, b.end_of_stream),
            Msg::ResponseBody(b) => self.on_body(Dir::Response, b.body, b.end_of_stream),
            Msg::RequestTrailers(_) => self.on_trailers(Dir::Request),
            Msg::ResponseTrailers(_) => self.on_trailers(Dir::Response),
        }
    }

    fn on_headers(&mut self, dir: Dir, eos: bool) {
        let side = self.side(dir);
        side.eos = eos;
        side.ended = eos;
        let action = match dir {
            Dir::Request => self.stream.on_request_headers(eos),
            Dir::Response => self.stream.on_response_headers(eos),
        };
        if dir == Dir::Request && !self.stream.passes() && self.stream.host_mut().pending.reply.is_none() {
            // Guarded: both directions must be held where the machine needs them.
            if self.mode(Dir::Request) == Mode::CannotHold || self.mode(Dir::Response) == Mode::CannotHold {
                tracing::error!(
                    target: "ext_proc",
                    "a guarded route under a body mode that cannot hold it (STREAMED, BUFFERED_PARTIAL or NONE, or \
                     an Envoy that does not say): refused; use BUFFERED or FULL_DUPLEX_STREAMED for both directions"
                );
                self.refuse();
                return;
            }
        }
        self.settle(dir, Kind::Headers, action);
    }

    fn on_body(&mut self, dir: Dir, chunk: Vec<u8>, eos: bool) {
        let mode = self.mode(dir);
        let side = self.side(dir);
        side.body_seen = true;
        side.eos = eos;
        let body = match dir {
            Dir::Request => &mut self.stream.host_mut().request_body,
            Dir::Response => &mut self.stream.host_mut().response_body,
        };
        body.bytes.extend_from_slice(&chunk);
        let size = body.bytes.len();
        if self.stream.passes() && !self.waiting {
            self.settle(dir, Kind::Body, Action::Continue);
            return;
        }
        // A BUFFERED body that does not end the stream is whole: trailers follow, and they are its
        // end. The body's answer is the last that can change the headers, so the machine is told now.
        let ends = eos || mode == Mode::Buffered;
        self.side(dir).ended |= ends;
        let mut action = match dir {
            Dir::Request => self.stream.on_request_body(size, eos),
            Dir::Response => self.stream.on_response_body(size, eos),
        };
        if ends && !eos && !self.stream.passes() && self.stream.host_mut().pending.reply.is_none() {
            action = match dir {
                Dir::Request => self.stream.on_request_trailers(),
                Dir::Response => self.stream.on_response_trailers(),
            };
        }
        self.settle(dir, Kind::Body, action);
    }

    fn on_trailers(&mut self, dir: Dir) {
        let side = self.side(dir);
        side.trailers = true;
        let already = side.ended;
        side.ended = true;
        let action = if already || self.stream.passes() {
            Action::Continue
        } else {
            match dir {
                Dir::Request => self.stream.on_request_trailers(),
                Dir::Response => self.stream.on_response_trailers(),
            }
        };
        self.settle(dir, Kind::Trailers, action);
    }

    /// The answer to the callout the machine waited for.
    pub fn on_callout(&mut self, token: u64, answer: CalloutAnswer) {
        let answered = usize::from(answer.status.is_some());
        self.stream.host_mut().answer = Some(answer);
        self.waiting = false;
        self.stream.on_callout_answer(token, answered, 0);
        self.stream.host_mut().answer = None;
        self.note_calls();
        if self.reply_sent() || self.waiting {
            return;
        }
        let pending = &mut self.stream.host_mut().pending;
        let (req, resp) = (std::mem::take(&mut pending.resume_request), std::mem::take(&mut pending.resume_response));
        if req {
            self.release(Dir::Request);
        }
        if resp {
            self.release(Dir::Response);
        }
    }

    /// Whether the adapter dispatched a callout it waits for (reports are not collected here).
    pub fn note_calls(&mut self) {
        if !self.stream.host_mut().calls.is_empty() {
            self.waiting = true;
        }
    }

    /// After a message: a local reply ends the stream; a callout holds the answer; otherwise the
    /// message is answered (BUFFERED) or the direction released when the machine continues
    /// (FULL_DUPLEX).
    fn settle(&mut self, dir: Dir, kind: Kind, action: Action) {
        self.note_calls();
        if self.reply_sent() {
            return;
        }
        match self.mode(dir) {
            Mode::Duplex => {
                if !self.waiting && action == Action::Continue {
                    self.release(dir);
                }
            }
            // Unguarded streams under any mode: Envoy waits for each message's answer.
            Mode::Buffered | Mode::CannotHold => {
                self.side(dir).owed.push(kind);
                if self.waiting {
                    return;
                }
                let at_end = kind != Kind::Headers && !self.stream.passes();
                if action == Action::Pause && at_end && self.mode(dir) == Mode::Buffered {
                    // The machine has the whole body and neither decided nor asked idemd: answering
                    // would release what it holds. Never: refuse instead.
                    tracing::error!(target: "ext_proc", "the machine held a whole body without a decision: refused");
                    self.refuse();
                    return;
                }
                self.release(dir);
                if dir == Dir::Request && kind == Kind::Headers && self.stream.passes() {
                    if let Some(last) = self.out.last_mut() {
                        last.mode_override = Some(skip_the_rest());
                    }
                }
            }
        }
    }

    /// Send a local reply if the adapter asked for one; `true` if the stream is answered.
    /// Whether the adapter asked for a reset: the stream must end with an error, never cleanly.
    pub fn reset_asked(&mut self) -> bool {
        self.stream.host_mut().pending.reset
    }

    fn reply_sent(&mut self) -> bool {
        if self.done {
            return true;
        }
        let Some(reply) = self.stream.host_mut().pending.reply.take() else { return false };
        self.immediate(reply);
        true
    }

    fn immediate(&mut self, reply: LocalReply) {
        let headers = HeaderChanges { set: reply.headers, remove: Vec::new() };
        self.out.push(answer(Answer::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus { code: i32::from(reply.status) }),
            headers: mutation(headers),
            body: reply.body,
            details: "agent_idempotency".into(),
            ..Default::default()
        })));
        self.done = true;
    }

    /// 503 `status_unavailable`: retryable, and it never claims that nothing ran.
    fn refuse(&mut self) {
        let cfg = Rc::clone(&self.stream.shared().config);
        let reply = machine::misconfigured(&cfg, "");
        self.stream.host_mut().pending = Default::default();
        self.immediate(LocalReply { status: reply.http_status, headers: reply.headers, body: reply.body });
    }

    /// Let the direction go on: answer what Envoy waits for (BUFFERED), or send what is held,
    /// headers first (FULL_DUPLEX), with the machine's header and body changes.
    fn release(&mut self, dir: Dir) {
        let pending = &mut self.stream.host_mut().pending;
        let mut headers = match dir {
            Dir::Request => std::mem::take(&mut pending.request_headers),
            Dir::Response => std::mem::take(&mut pending.response_headers),
        };
        let replaced = match dir {
            Dir::Request => None,
            Dir::Response => pending.response_body.take(),
        };
        let held = match dir {
            Dir::Request => std::mem::take(&mut self.stream.host_mut().request_body.bytes),
            Dir::Response => std::mem::take(&mut self.stream.host_mut().response_body.bytes),
        };
        let header_answer = |m: Option<HeaderMutation>, c: Option<CommonResponse>| match dir {
            Dir::Request => Answer::RequestHeaders(HeadersResponse { response: c.or(common(m, None)) }),
            Dir::Response => Answer::ResponseHeaders(HeadersResponse { response: c.or(common(m, None)) }),
        };
        let body_answer = |c: Option<CommonResponse>| match dir {
            Dir::Request => Answer::RequestBody(BodyResponse { response: c }),
            Dir::Response => Answer::ResponseBody(BodyResponse { response: c }),
        };
        let trailer_answer = || match dir {
            Dir::Request => Answer::RequestTrailers(TrailersResponse::default()),
            Dir::Response => Answer::ResponseTrailers(TrailersResponse::default()),
        };
        match self.mode(dir) {
            Mode::Buffered | Mode::CannotHold => {
                let owed = std::mem::take(&mut self.side(dir).owed);
                let mut body = replaced;
                for kind in owed {
                    let m = mutation(std::mem::take(&mut headers));
                    let a = match kind {
                        Kind::Headers => header_answer(m, None),
                        Kind::Body => body_answer(common(m, body.take())),
                        Kind::Trailers if m.is_some() => {
                            // Headers can no longer change once the trailers are all that is left.
                            tracing::error!(target: "ext_proc", "header changes after the body's answer: refused");
                            self.refuse();
                            return;
                        }
                        Kind::Trailers => trailer_answer(),
                    };
                    self.out.push(answer(a));
                }
                if !headers.is_empty() && dir == Dir::Request && !self.stream.passes() {
                    self.refuse();
                }
            }
            Mode::Duplex => {
                let side = self.side(dir);
                let first = !side.headers_answered;
                side.headers_answered = true;
                let (body_seen, eos, trailers) = (side.body_seen, side.eos, side.trailers);
                let m = mutation(headers);
                if first {
                    self.out.push(answer(header_answer(m, None)));
                } else if m.is_some() {
                    tracing::error!(target: "ext_proc", "header changes after the headers went on: refused");
                    self.refuse();
                    return;
                }
                if body_seen {
                    let body = replaced.unwrap_or(held);
                    let end = eos && !trailers;
                    let mut chunks: Vec<&[u8]> = body.chunks(CHUNK).collect();
                    if chunks.is_empty() && end {
                        chunks.push(&[]);
                    }
                    let last = chunks.len().saturating_sub(1);
                    for (i, chunk) in chunks.into_iter().enumerate() {
                        let streamed = StreamedBodyResponse {
                            body: chunk.to_vec(),
                            end_of_stream: end && i == last,
                            ..Default::default()
                        };
                        let c = Some(CommonResponse {
                            body_mutation: Some(BodyMutation { mutation: Some(Mutation::StreamedResponse(streamed)) }),
                            ..Default::default()
                        });
                        self.out.push(answer(body_answer(c)));
                    }
                }
                if trailers {
                    self.out.push(answer(trailer_answer()));
                }
            }
        }
    }
}

/// A pass-through stream need not send Envoy anything more (`allow_mode_override`): no body, no
/// answer. Envoy ignores it where overrides are not allowed; the stream then passes message by message.
pub fn skip_the_rest() -> ProcessingMode {
    ProcessingMode {
        request_body_mode: BodySendMode::None as i32,
        request_trailer_mode: HeaderSendMode::Skip as i32,
        response_header_mode: HeaderSendMode::Skip as i32,
        response_body_mode: BodySendMode::None as i32,
        response_trailer_mode: HeaderSendMode::Skip as i32,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process::{Counters, Process};
    use envoy_types::pb::envoy::config::core::v3::HeaderMap;
    use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, ProtocolConfiguration};
    use std::sync::Arc;

    /// A preview route rule (no callout: the API is empty, nothing is asked of idemd).
    const CONFIG: &str = r#"{"sidecar_cluster":"idem","keys":[{"kid":"k1","secret":"test-secret-0123456789abcdef-0123456789"}],
        "active_kid":"k1","subject":{"header":"x-agent-subject"},
        "routes":[{"name":"p","match":{"path":"/preview"},"role":"preview","scope":"s","bind":"/amount:decimal"}]}"#;

    fn driver(rt: &tokio::runtime::Runtime) -> Driver {
        let config = idem_core::policy::parse_plugin_config(CONFIG.as_bytes(), &|_| None).unwrap();
        let process = Arc::new(Process::new(
            axum::Router::new(),
            rt.handle().clone(),
            Arc::new(Counters::default()),
            CONFIG.into(),
        ));
        Driver::new(Rc::new(Shared::new(config)), ExtProcHost::new(process))
    }

    fn headers(pairs: &[(&str, &str)]) -> Option<HeaderMap> {
        let headers = pairs
            .iter()
            .map(|(k, v)| HeaderValue { key: (*k).into(), raw_value: v.as_bytes().to_vec(), ..Default::default() })
            .collect();
        Some(HeaderMap { headers })
    }

    fn msg(request: Msg, mode: Option<BodySendMode>) -> ProcessingRequest {
        ProcessingRequest {
            request: Some(request),
            protocol_config: mode.map(|m| ProtocolConfiguration {
                request_body_mode: m as i32,
                response_body_mode: m as i32,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn request_headers(path: &str, mode: BodySendMode) -> ProcessingRequest {
        let h = headers(&[
            (":method", "POST"),
            (":path", path),
            ("x-agent-subject", "alice"),
            ("content-type", "application/json"),
        ]);
        msg(Msg::RequestHeaders(HttpHeaders { headers: h, end_of_stream: false, ..Default::default() }), Some(mode))
    }

    fn body(dir: Dir, bytes: &str, eos: bool) -> ProcessingRequest {
        let b = HttpBody { body: bytes.as_bytes().to_vec(), end_of_stream: eos, ..Default::default() };
        msg(if dir == Dir::Request { Msg::RequestBody(b) } else { Msg::ResponseBody(b) }, None)
    }

    fn response_headers(len: usize) -> ProcessingRequest {
        let len = len.to_string();
        let h = headers(&[(":status", "200"), ("content-type", "application/json"), ("content-length", &len)]);
        msg(Msg::ResponseHeaders(HttpHeaders { headers: h, end_of_stream: false, ..Default::default() }), None)
    }

    fn kinds(out: &[ProcessingResponse]) -> Vec<&'static str> {
        out.iter()
            .map(|r| match &r.response {
                Some(Answer::RequestHeaders(_)) => "request_headers",
                Some(Answer::RequestBody(_)) => "request_body",
                Some(Answer::ResponseHeaders(_)) => "response_headers",
                Some(Answer::ResponseBody(_)) => "response_body",
                Some(Answer::ImmediateResponse(_)) => "immediate",
                _ => "other",
            })
            .collect()
    }

    /// Every body byte the answers hand back (streamed or replaced).
    fn body_out(out: &[ProcessingResponse]) -> String {
        let mut all = Vec::new();
        for r in out {
            if let Some(Answer::ResponseBody(b)) = &r.response {
                match b.response.as_ref().and_then(|c| c.body_mutation.as_ref()).and_then(|m| m.mutation.as_ref()) {
                    Some(Mutation::Body(x)) => all.extend_from_slice(x),
                    Some(Mutation::StreamedResponse(s)) => all.extend_from_slice(&s.body),
                    _ => {}
                }
            }
        }
        String::from_utf8(all).unwrap()
    }

    #[test]
    fn buffered_answers_each_message_and_splices_the_fingerprint_into_the_body() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let mut d = driver(&rt);
        d.on_message(request_headers("/preview", BodySendMode::Buffered));
        assert_eq!(kinds(&d.take_out()), ["request_headers"], "Envoy holds the headers until the body's answer");
        d.on_message(body(Dir::Request, r#"{"amount":"10.00"}"#, true));
        assert_eq!(kinds(&d.take_out()), ["request_body"]);
        let answer = r#"{"quote":"q1"}"#;
        d.on_message(response_headers(answer.len()));
        assert_eq!(kinds(&d.take_out()), ["response_headers"]);
        d.on_message(body(Dir::Response, answer, true));
        let out = d.take_out();
        assert_eq!(kinds(&out), ["response_body"]);
        assert!(body_out(&out).contains("\"fingerprint\""), "{}", body_out(&out));
    }

    #[test]
    fn full_duplex_holds_the_headers_until_the_body_is_judged() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let mut d = driver(&rt);
        d.on_message(request_headers("/preview", BodySendMode::FullDuplexStreamed));
        assert!(d.take_out().is_empty(), "the headers are held: nothing reaches the upstream yet");
        d.on_message(body(Dir::Request, r#"{"amount":"#, false));
        assert!(d.take_out().is_empty(), "half a body decides nothing");
        d.on_message(body(Dir::Request, r#""10.00"}"#, true));
        let out = d.take_out();
        assert_eq!(kinds(&out), ["request_headers", "request_body"]);
        let Some(Answer::RequestBody(b)) = &out[1].response else { panic!() };
        let Some(Mutation::StreamedResponse(s)) =
            b.response.as_ref().unwrap().body_mutation.as_ref().unwrap().mutation.as_ref()
        else {
            panic!()
        };
        assert_eq!(s.body, br#"{"amount":"10.00"}"#.to_vec());
        assert!(s.end_of_stream);
        let answer = r#"{"quote":"q1"}"#;
        d.on_message(response_headers(answer.len()));
        d.on_message(body(Dir::Response, answer, true));
        let out = d.take_out();
        assert!(body_out(&out).contains("\"fingerprint\""), "{}", body_out(&out));
    }

    #[test]
    fn a_guarded_route_under_streamed_is_refused_and_an_unguarded_one_passes() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let mut d = driver(&rt);
        d.on_message(request_headers("/preview", BodySendMode::Streamed));
        let out = d.take_out();
        assert_eq!(kinds(&out), ["immediate"]);
        let Some(Answer::ImmediateResponse(r)) = &out[0].response else { panic!() };
        assert_eq!(r.status.as_ref().map(|s| s.code), Some(503));
        let mut d = driver(&rt);
        d.on_message(request_headers("/elsewhere", BodySendMode::Streamed));
        let out = d.take_out();
        assert_eq!(kinds(&out), ["request_headers"]);
        assert!(out[0].mode_override.is_some(), "an unguarded stream asks for nothing more");
    }

    #[test]
    fn a_bad_preview_body_is_answered_locally_and_never_forwarded() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let mut d = driver(&rt);
        d.on_message(request_headers("/preview", BodySendMode::Buffered));
        d.take_out();
        d.on_message(body(Dir::Request, "{not json", true));
        assert_eq!(kinds(&d.take_out()), ["immediate"]);
    }
}
