//! What the machine reads of a request and of the upstream's answer: the guarded headers (and the
//! `_`-for-`-` alias rule that keeps a CGI-style upstream from reading a second copy), which of them a
//! role needs, the query parameters and `Retry-After`.

use crate::policy::{Role, RoutePolicy};
use crate::trace::Trace;

use super::{MCP_METHOD_HEADER, MCP_NAME_HEADER};

/// The header an agent may carry the fingerprint in (instead of the body).
pub const FINGERPRINT_HEADER: &str = "agent-fingerprint";
/// The body field (and query parameter) it may come in.
pub const FINGERPRINT_FIELD: &str = "fingerprint";
/// The header that carries the operation key to the upstream, and that a
/// client may never choose on a guarded route.
pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";

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
pub(super) fn underscore_alias(name: &str, needs: HeadNeeds, subject_header: Option<&str>) -> Option<&'static str> {
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
