//! A request's trace, as its replies name it and as its callouts carry it (DESIGN §8).
//!
//! The filter makes no spans of its own: idemd's span for a callout is a child of the span the
//! request is in. Envoy's connection manager does not write its span into the request's headers
//! before the filter chain (its router does, for the upstream, after every filter), so:
//!
//! * the native module asks Envoy for the stream's active span (the dynamic-module ABI has it):
//!   idemd's spans are children of Envoy's;
//! * the `.wasm` cannot (proxy-wasm has no span access, envoy#22028): the request's own
//!   `traceparent` is continued, so idemd's spans share Envoy's trace id and are siblings of
//!   Envoy's span under the caller's;
//! * when nobody traces, the callouts start a trace whose id is the one the replies carry, so an
//!   operator who reads `trace_id` in an answer finds the same id in idemd's spans.

use sha2::{Digest, Sha256};
use std::fmt::Write;

/// Longest `tracestate` passed on (W3C: 32 members of at most 256 bytes, plus commas); a longer
/// one is dropped whole, as the spec allows, rather than cut mid-member.
const TRACESTATE_MAX: usize = 32 * 257;

/// Longest trace id a reply or log line carries.
const TRACE_ID_MAX: usize = 128;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Trace {
    /// What replies and log lines call `trace_id`: `x-request-id`, else the trace id of the
    /// request's `traceparent`.
    pub id: String,
    /// The request's `traceparent`, valid or not (checked when a callout needs it: a preview
    /// makes none and pays nothing).
    traceparent: Option<String>,
    tracestate: Option<String>,
    /// The span the host says the request is in (Envoy's, on the native module).
    span: Option<HostSpan>,
}

/// A span of the host's tracer, as its ids read: hex, a trace id of 32 digits (or 16, Zipkin's
/// short form) and a span id of 16.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSpan {
    pub trace_id: String,
    pub span_id: String,
}

impl Trace {
    pub fn of(x_request_id: Option<&str>, traceparent: Option<&str>, tracestate: Option<&str>) -> Trace {
        let id = match x_request_id.filter(|id| !id.is_empty()) {
            Some(id) => clip(id, TRACE_ID_MAX),
            None => traceparent.and_then(|tp| tp.split('-').nth(1)).map_or("", |id| clip(id, TRACE_ID_MAX)),
        };
        Trace {
            id: id.to_string(),
            traceparent: traceparent.map(str::to_string),
            tracestate: tracestate.filter(|s| !s.is_empty() && s.len() <= TRACESTATE_MAX).map(str::to_string),
            span: None,
        }
    }

    /// The id as a log line carries it ([`safe_id`]): a client's request id never writes a field
    /// or a line of its own into the filter's log (the reply, JSON, names the id as sent).
    pub fn logged(&self) -> String {
        safe_id(&self.id, TRACE_ID_MAX)
    }

    /// The request is in the host's `span`: callouts become its children. A span whose ids are
    /// not W3C ids is ignored.
    pub fn within(mut self, span: Option<HostSpan>) -> Trace {
        self.span = span.and_then(|s| {
            let trace_id = if s.trace_id.len() == 16 { format!("{:0>32}", s.trace_id) } else { s.trace_id };
            let ids = TraceParent::of_fields(
                "00",
                &trace_id.to_ascii_lowercase(),
                &s.span_id.to_ascii_lowercase(),
                "01",
                None,
            )?;
            Some(HostSpan { trace_id: ids.trace_id, span_id: ids.parent_id })
        });
        self
    }

    /// The headers every callout of this request carries: `x-request-id` (idemd's log lines),
    /// `traceparent` (a child of the host's span; else the request's own when it is valid; else a
    /// new trace named after `id`) and the request's `tracestate` when its `traceparent` is one
    /// to continue. None when the request has no id at all (a host's own calls: renewals).
    pub fn callout_headers(&self) -> Vec<(&'static str, String)> {
        let mut headers = Vec::with_capacity(3);
        if !self.id.is_empty() {
            headers.push(("x-request-id", self.id.clone()));
        }
        let request = self.traceparent.as_deref().and_then(TraceParent::parse);
        let traceparent = match (&self.span, &request) {
            (Some(span), _) => {
                // The request's sampling decision, when Envoy continued the request's trace.
                let flags =
                    request.as_ref().filter(|tp| tp.trace_id == span.trace_id).map_or("01", |tp| tp.flags.as_str());
                Some(format!("00-{}-{}-{flags}", span.trace_id, span.span_id))
            }
            (None, Some(tp)) => Some(tp.header()),
            (None, None) => (!self.id.is_empty()).then(|| new_traceparent(&self.id)),
        };
        if let Some(tp) = traceparent {
            headers.push(("traceparent", tp));
        }
        if let (Some(_), Some(ts)) = (&request, &self.tracestate) {
            headers.push(("tracestate", ts.clone()));
        }
        headers
    }
}

/// A `traceparent` the W3C spec says to continue, by its version-00 fields: a known layout,
/// lowercase hex, neither id all zeros, not version `ff`. A later version is read by its
/// version-00 fields, as the spec says, and passed on as 00.
#[derive(Debug, Clone, PartialEq, Eq)]
struct TraceParent {
    trace_id: String,
    parent_id: String,
    flags: String,
}

impl TraceParent {
    fn parse(tp: &str) -> Option<TraceParent> {
        let mut parts = tp.trim().splitn(5, '-');
        let (version, trace, parent, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        TraceParent::of_fields(version, trace, parent, flags, parts.next())
    }

    fn of_fields(version: &str, trace: &str, parent: &str, flags: &str, later: Option<&str>) -> Option<TraceParent> {
        let hex =
            |s: &str, len: usize| s.len() == len && s.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c));
        let zero = |s: &str| s.bytes().all(|c| c == b'0');
        let fields_ok = hex(version, 2) && hex(trace, 32) && hex(parent, 16) && hex(flags, 2);
        let version_ok = version != "ff" && (version != "00" || later.is_none());
        (fields_ok && version_ok && !zero(trace) && !zero(parent)).then(|| TraceParent {
            trace_id: trace.to_string(),
            parent_id: parent.to_string(),
            flags: flags.to_string(),
        })
    }

    /// As a version-00 header value.
    fn header(&self) -> String {
        format!("00-{}-{}-{}", self.trace_id, self.parent_id, self.flags)
    }
}

/// A new, sampled trace for a request nobody traces: its trace id is `id` itself when that is
/// one (a UUID `x-request-id` without its dashes), else a digest of it; the parent id (there is
/// no parent span) is a digest too, so retries of one request id name one trace.
fn new_traceparent(id: &str) -> String {
    let digest = Sha256::digest(id.as_bytes());
    let undashed = id.replace('-', "").to_ascii_lowercase();
    let is_trace_id =
        undashed.len() == 32 && undashed.bytes().all(|c| c.is_ascii_hexdigit()) && !undashed.bytes().all(|c| c == b'0');
    let trace = if is_trace_id { undashed } else { hex::encode(digest.iter().take(16).copied().collect::<Vec<u8>>()) };
    let mut parent: Vec<u8> = digest.iter().skip(16).take(8).copied().collect();
    if parent.iter().all(|b| *b == 0) {
        parent = vec![0, 0, 0, 0, 0, 0, 0, 1];
    }
    format!("00-{trace}-{}-01", hex::encode(parent))
}

/// At most `max` bytes, on a character boundary.
/// A trace id as replies, log lines, idemd and its audit carry it. It is the client's
/// `x-request-id`, so any text may arrive, and a client-chosen value never decides what is
/// recorded or forges a log field: printable ASCII stays as sent (every id Envoy or a tracer makes
/// is unchanged), every other character (space, control, non-ASCII) is percent-encoded byte by byte
/// of its UTF-8 (`a b` → `a%20b`, `é` → `%C3%A9`), and so is a `%` that does not already begin such an
/// escape (`100%` → `100%25`). The result has no space or line break, and making it safe again
/// changes nothing (the filter and idemd both apply it). Cut to `max` bytes at a whole escape.
pub fn safe_id(raw: &str, max: usize) -> String {
    let mut out = String::with_capacity(raw.len().min(max));
    let mut utf8 = [0u8; 4];
    let bytes = raw.as_bytes();
    for (i, c) in raw.char_indices() {
        let escape = c == '%'
            && bytes
                .get(i + 1..i + 3)
                .is_some_and(|h| h.iter().all(|b| b.is_ascii_digit() || (b'A'..=b'F').contains(b)));
        let kept = c.is_ascii_graphic() && (c != '%' || escape);
        let width = if kept { 1 } else { 3 * c.len_utf8() };
        if out.len() + width > max {
            break;
        }
        if kept {
            out.push(c);
        } else {
            for b in c.encode_utf8(&mut utf8).bytes() {
                let _ = write!(out, "%{b:02X}");
            }
        }
    }
    // An escape cut in two by the limit would read as a `%` to be escaped next time.
    if let Some(at) = out.get(out.len().saturating_sub(2)..).and_then(|tail| tail.find('%')) {
        out.truncate(out.len().saturating_sub(2) + at);
    }
    out
}

fn clip(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end = end.saturating_sub(1);
    }
    s.get(..end).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_id_is_made_safe_once_and_for_all() {
        for (raw, safe) in [
            ("6e1f0c7a-1b2c-4d5e-8f90-0123456789ab", "6e1f0c7a-1b2c-4d5e-8f90-0123456789ab"),
            ("a b", "a%20b"),
            ("r1 security_event=none\nx", "r1%20security_event=none%0Ax"),
            ("café", "caf%C3%A9"),
            ("100%", "100%25"),
            ("50%2x", "50%252x"),
            ("a%20b", "a%20b"),
        ] {
            assert_eq!(safe_id(raw, 128), safe, "{raw:?}");
            assert_eq!(safe_id(safe, 128), safe, "{raw:?}: safe again changes nothing");
        }
        // Cut at a whole escape, never inside one.
        assert_eq!(safe_id("ab é", 7), "ab%20");
        assert_eq!(safe_id("abcd%", 6), "abcd");
        let long = "x".repeat(300);
        assert_eq!(safe_id(&long, 128).len(), 128);
        // The reply names the caller's own id; a log line, its safe form.
        let t = Trace::of(Some("a b"), None, None);
        assert_eq!((t.id.as_str(), t.logged().as_str()), ("a b", "a%20b"));
    }

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn header<'a>(h: &'a [(&'static str, String)], name: &str) -> Option<&'a str> {
        h.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_str())
    }

    #[test]
    fn the_id_is_the_request_id_else_the_traceparents_trace() {
        assert_eq!(Trace::of(Some("abc"), Some(TP), None).id, "abc");
        assert_eq!(Trace::of(None, Some(TP), None).id, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(Trace::of(Some(""), None, None).id, "");
        assert_eq!(Trace::of(Some(&"é".repeat(100)), None, None).id.len(), 128);
    }

    #[test]
    fn a_valid_traceparent_is_continued_with_its_tracestate() {
        let h = Trace::of(Some("rid"), Some(TP), Some("vendor=x")).callout_headers();
        assert_eq!(header(&h, "traceparent"), Some(TP));
        assert_eq!(header(&h, "tracestate"), Some("vendor=x"));
        assert_eq!(header(&h, "x-request-id"), Some("rid"));
        // A later version is read by its 00 prefix and passed on as 00.
        let later = format!("cc{}-extra", &TP[2..]);
        let h = Trace::of(Some("rid"), Some(&later), None).callout_headers();
        assert_eq!(header(&h, "traceparent"), Some(TP));
    }

    #[test]
    fn an_invalid_traceparent_starts_a_trace_named_after_the_request_id() {
        let rid = "0AF7651916CD43DD-8448-EB211C80319C"; // not a UUID layout, but 32 hex undashed
        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "garbage",
        ] {
            let h = Trace::of(Some(rid), Some(bad), Some("vendor=x")).callout_headers();
            let tp = header(&h, "traceparent").unwrap_or_default();
            assert!(tp.starts_with("00-0af7651916cd43dd8448eb211c80319c-"), "{bad} → {tp}");
            assert!(TraceParent::parse(tp).is_some(), "{tp}");
            assert_eq!(header(&h, "tracestate"), None, "a tracestate without its traceparent is dropped");
        }
    }

    #[test]
    fn a_request_id_that_is_no_trace_id_names_one_by_digest() {
        let a = Trace::of(Some("req-1"), None, None).callout_headers();
        let b = Trace::of(Some("req-1"), None, None).callout_headers();
        let c = Trace::of(Some("req-2"), None, None).callout_headers();
        let tp = header(&a, "traceparent").unwrap_or_default();
        assert!(TraceParent::parse(tp).is_some(), "{tp}");
        assert!(tp.ends_with("-01"), "a new trace is sampled: {tp}");
        assert_eq!(header(&a, "traceparent"), header(&b, "traceparent"), "one request id, one trace");
        assert_ne!(header(&a, "traceparent"), header(&c, "traceparent"));
    }

    #[test]
    fn inside_the_hosts_span_callouts_are_its_children() {
        let envoy =
            HostSpan { trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(), span_id: "aaaabbbbccccdddd".into() };
        // Envoy continued the caller's trace: the caller's sampling decision and tracestate stay.
        let unsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
        let h = Trace::of(Some("rid"), Some(unsampled), Some("vendor=x")).within(Some(envoy.clone())).callout_headers();
        assert_eq!(header(&h, "traceparent"), Some("00-4bf92f3577b34da6a3ce929d0e0e4736-aaaabbbbccccdddd-00"));
        assert_eq!(header(&h, "tracestate"), Some("vendor=x"));
        // Envoy started the trace: sampled, and no tracestate without a traceparent to go with it.
        let h = Trace::of(Some("rid"), None, Some("vendor=x")).within(Some(envoy)).callout_headers();
        assert_eq!(header(&h, "traceparent"), Some("00-4bf92f3577b34da6a3ce929d0e0e4736-aaaabbbbccccdddd-01"));
        assert_eq!(header(&h, "tracestate"), None);
        // Zipkin's 64-bit trace ids are padded; ids that are not hex are no span at all.
        let short = HostSpan { trace_id: "00f067aa0ba902b7".into(), span_id: "AAAABBBBCCCCDDDD".into() };
        let h = Trace::of(Some("rid"), None, None).within(Some(short)).callout_headers();
        assert_eq!(header(&h, "traceparent"), Some("00-000000000000000000f067aa0ba902b7-aaaabbbbccccdddd-01"));
        let bogus = HostSpan { trace_id: "nothex".into(), span_id: "x".into() };
        let h = Trace::of(Some("rid"), Some(TP), None).within(Some(bogus)).callout_headers();
        assert_eq!(header(&h, "traceparent"), Some(TP));
    }

    #[test]
    fn no_id_no_headers() {
        assert!(Trace::default().callout_headers().is_empty());
        assert!(Trace::of(None, Some("garbage"), None).callout_headers().iter().all(|(n, _)| *n != "traceparent"));
    }
}
