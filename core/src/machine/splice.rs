//! The fingerprint's two fields, put into a preview's JSON answer (DESIGN §3, §9).
//!
//! Two ways, one rule: the answer never carries two fields of either name.
//!
//! - [`StreamSplice`], the common case: the answer's length is known and it is a JSON object, so the
//!   fields go in as it streams. Its `Content-Length` grows by a length fixed when the headers pass
//!   ([`StreamSplice::added`]), every chunk but the last goes on untouched, and the last is
//!   rewritten to put the fields before the object's closing brace. Whether the upstream already
//!   names either field is only known once every byte went by, so every chunk is scanned; an
//!   answer that may name it (or is not an object after all) gets the same number of spaces
//!   instead: still the JSON the upstream sent, the fingerprint in its header only.
//! - [`splice_whole`], when the answer is held whole (no length, a quote whose expiry is in the
//!   body, a route whose answers were seen to name the field): text after the opening brace when
//!   nothing could name the field, else a full parse that replaces it.

use serde_json::Value;

/// The two fields after a comma, as they are put before an object's closing brace. Base64url and
/// digits: nothing in them needs escaping.
fn fields(token: &str, exp: u64) -> Vec<u8> {
    format!(",\"{}\":\"{token}\",\"fingerprint_expires_at\":{exp}", super::FINGERPRINT_FIELD).into_bytes()
}

/// Whether `text` could spell a key `"fingerprint…"`: literally, or with any of its letters
/// written as a `\u` escape (`f i n g e r p t` are U+0065…U+0074, so every such escape starts
/// `\u006` or `\u007`). Conservative: a value mentioning the word counts too.
fn may_name(text: &[u8]) -> bool {
    const NAME: &[u8] = b"\"fingerprint";
    text.windows(NAME.len()).any(|w| w == NAME) || text.windows(5).any(|w| w == b"\\u006" || w == b"\\u007")
}

fn has_content(bytes: &[u8]) -> bool {
    bytes.iter().any(|b| !b.is_ascii_whitespace())
}

/// The longest pattern [`may_name`] looks for, less one: what a chunk boundary can cut.
const CARRY: usize = 11;

/// Where the object's opening brace is, in the bytes seen so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// Only whitespace so far.
    Start,
    /// The opening brace went by; `inner`: something other than whitespace followed it.
    Open { inner: bool },
    /// The first byte that is not whitespace is not `{`: no object to splice into.
    NotObject,
}

/// A preview's answer, spliced chunk by chunk (see the module's comment).
#[derive(Debug, Clone)]
pub struct StreamSplice {
    fields: Vec<u8>,
    /// The upstream's `Content-Length`, and how much of it went by.
    total: u64,
    seen: u64,
    shape: Shape,
    /// The answer may name a fingerprint field: pad, never splice.
    named: bool,
    /// The end of what went by, for a name cut across chunks.
    tail: Vec<u8>,
    /// A closing brace (and whitespace) held back from the chunks before: it may end the object.
    held: Vec<u8>,
}

/// What becomes of one chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chunk {
    /// Goes on as it is.
    Pass,
    /// Goes on as these bytes: the chunk with a possible closing brace held back, or with one
    /// held before it given back.
    Replace(Vec<u8>),
    /// The last chunk, rewritten; `spliced`: the fields went in (else the spaces).
    Last { body: Vec<u8>, spliced: bool },
}

impl StreamSplice {
    /// `total`: the upstream's `Content-Length` (more than 0).
    pub fn new(token: &str, exp: u64, total: u64) -> StreamSplice {
        StreamSplice {
            fields: fields(token, exp),
            total,
            seen: 0,
            shape: Shape::Start,
            named: false,
            tail: Vec::with_capacity(2 * CARRY),
            held: Vec::new(),
        }
    }

    /// How many bytes the answer grows by, whatever the chunks turn out to hold.
    pub fn added(&self) -> usize {
        self.fields.len()
    }

    /// Whether the scan found what may be the upstream's own fingerprint field.
    pub fn named(&self) -> bool {
        self.named
    }

    /// One chunk. The last is the one that completes the announced length (or ends the stream);
    /// an answer that ends with trailers has its last chunk before them.
    pub fn chunk(&mut self, chunk: &[u8], end_of_stream: bool) -> Chunk {
        self.scan(chunk);
        let last = end_of_stream || self.seen.saturating_add(chunk.len() as u64) >= self.total;
        self.seen = self.seen.saturating_add(chunk.len() as u64);
        let opened_here = self.open(chunk);
        if !last && self.held.is_empty() && !self.may_end_here(chunk) {
            // The common middle chunk: nothing to hold back, nothing to rewrite.
            if let Shape::Open { inner } = &mut self.shape {
                *inner |= chunk.get(opened_here.map_or(0, |i| i + 1)..).is_some_and(has_content);
            }
            return Chunk::Pass;
        }
        // What goes out now: the bytes held back from the chunks before, then this one.
        let mut data = std::mem::take(&mut self.held);
        let offset = data.len();
        data.extend_from_slice(chunk);
        let after_open = opened_here.map_or(0, |i| i + 1 + offset);
        if last {
            return self.last(data, after_open);
        }
        // A brace followed only by whitespace may close the object: held back until the next
        // chunk shows whether more follows (the fields must go before it).
        if let Shape::Open { inner } = &mut self.shape {
            if !self.named {
                if let Some(k) = data.iter().rposition(|b| !b.is_ascii_whitespace()) {
                    if data.get(k) == Some(&b'}') && k >= after_open {
                        self.held = data.split_off(k);
                    }
                }
            }
            *inner |= data.get(after_open..).is_some_and(has_content);
        }
        Chunk::Replace(data)
    }

    /// Note where the object opens if it does in this chunk; the brace's index.
    fn open(&mut self, chunk: &[u8]) -> Option<usize> {
        if self.shape != Shape::Start {
            return None;
        }
        let i = chunk.iter().position(|b| !b.is_ascii_whitespace())?;
        if chunk.get(i) == Some(&b'{') {
            self.shape = Shape::Open { inner: false };
            Some(i)
        } else {
            self.shape = Shape::NotObject;
            None
        }
    }

    /// Whether this chunk's bytes end in a brace and whitespace (or whitespace after a held brace):
    /// it may hold the object's end.
    fn may_end_here(&self, chunk: &[u8]) -> bool {
        matches!(self.shape, Shape::Open { .. })
            && !self.named
            && chunk.iter().rev().find(|b| !b.is_ascii_whitespace()) == Some(&b'}')
    }

    /// The last chunk (with what was held back before it): the fields before the closing brace,
    /// or the same number of spaces after the value.
    fn last(&mut self, data: Vec<u8>, after_open: usize) -> Chunk {
        match self.closing(&data, after_open) {
            Some((close, inner)) => {
                let mut body = Vec::with_capacity(data.len() + self.fields.len());
                body.extend_from_slice(data.get(..close).unwrap_or_default());
                if inner {
                    body.extend_from_slice(&self.fields);
                } else {
                    // `{}`: no comma before the first field; a space keeps the promised length.
                    body.extend_from_slice(self.fields.get(1..).unwrap_or_default());
                    body.push(b' ');
                }
                body.extend_from_slice(data.get(close..).unwrap_or_default());
                Chunk::Last { body, spliced: true }
            }
            None => {
                // Trailing whitespace is still the same JSON value.
                let mut body = data;
                body.resize(body.len() + self.fields.len(), b' ');
                Chunk::Last { body, spliced: false }
            }
        }
    }

    /// In the last chunk: the index of the object's closing brace and whether the object has
    /// members, or `None` when the fields cannot go in (named, or not an object).
    fn closing(&self, data: &[u8], after_open: usize) -> Option<(usize, bool)> {
        let Shape::Open { inner } = self.shape else { return None };
        if self.named {
            return None;
        }
        let close = data.iter().rposition(|b| !b.is_ascii_whitespace())?;
        if data.get(close) != Some(&b'}') || close < after_open {
            return None;
        }
        let inner = inner || data.get(after_open..close).is_some_and(has_content);
        Some((close, inner))
    }

    /// Look for a name in this chunk and across the boundary with the one before.
    fn scan(&mut self, chunk: &[u8]) {
        if self.named {
            return;
        }
        let head = chunk.get(..chunk.len().min(CARRY)).unwrap_or_default();
        self.tail.extend_from_slice(head);
        self.named = may_name(&self.tail) || may_name(chunk);
        let keep = if chunk.len() >= CARRY {
            chunk.get(chunk.len() - CARRY..).unwrap_or_default().to_vec()
        } else {
            let t = std::mem::take(&mut self.tail);
            t.get(t.len().saturating_sub(CARRY)..).unwrap_or_default().to_vec()
        };
        self.tail = keep;
    }
}

/// A held answer with the two fields; `None` if it is not a JSON object. The common case goes in
/// as text after the opening brace (no parse, no re-serialisation); an answer that may already
/// name the field goes through a full parse, so a field of that name is replaced, never doubled.
pub fn splice_whole(body: &[u8], token: &str, exp: u64, limit: usize) -> Option<Vec<u8>> {
    if let Some(out) = splice_text(body, token, exp) {
        return Some(out);
    }
    let Ok(Value::Object(mut obj)) = crate::canonical::parse_json_body(body, limit) else { return None };
    obj.insert(super::FINGERPRINT_FIELD.into(), Value::String(token.to_string()));
    obj.insert("fingerprint_expires_at".into(), Value::from(exp));
    serde_json::to_vec(&obj).ok()
}

fn splice_text(body: &[u8], token: &str, exp: u64) -> Option<Vec<u8>> {
    let start = body.iter().position(|b| !b.is_ascii_whitespace())?;
    let end = body.iter().rposition(|b| !b.is_ascii_whitespace())?;
    if body.get(start) != Some(&b'{') || body.get(end) != Some(&b'}') || end <= start || may_name(body) {
        return None;
    }
    let fields = fields(token, exp);
    let inner_empty = body.get(start + 1..end).is_some_and(|b| b.iter().all(u8::is_ascii_whitespace));
    // After the brace: the fields without their leading comma, and a comma after them when members follow.
    let mut out = Vec::with_capacity(body.len() + fields.len());
    out.extend_from_slice(body.get(..=start)?);
    out.extend_from_slice(fields.get(1..)?);
    if !inner_empty {
        out.push(b',');
    }
    out.extend_from_slice(body.get(start + 1..)?);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn stream(body: &[u8], cuts: &[usize], token: &str, exp: u64) -> (Vec<u8>, bool, usize) {
        let mut s = StreamSplice::new(token, exp, body.len() as u64);
        let mut out = Vec::new();
        let mut spliced_any = false;
        let mut at = 0;
        let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (body.len() + 1)).collect();
        bounds.sort_unstable();
        bounds.push(body.len());
        for end in bounds {
            let end = end.max(at);
            let piece = &body[at..end];
            match s.chunk(piece, false) {
                Chunk::Pass => out.extend_from_slice(piece),
                Chunk::Replace(bytes) => out.extend_from_slice(&bytes),
                Chunk::Last { body, spliced } => {
                    out.extend_from_slice(&body);
                    spliced_any = spliced;
                    return (out, spliced_any, s.added());
                }
            }
            at = end;
        }
        (out, spliced_any, s.added())
    }

    fn fingerprint_fields(out: &[u8]) -> usize {
        String::from_utf8_lossy(out).matches("\"fingerprint").count()
    }

    #[test]
    fn an_object_gets_the_fields_before_its_closing_brace_in_any_chunking() -> Result<(), Box<dyn std::error::Error>> {
        for (body, want) in [
            (r#"{"quote":1}"#, r#"{"quote":1,"fingerprint":"t.s","fingerprint_expires_at":9}"#),
            (" { } \n", r#" { "fingerprint":"t.s","fingerprint_expires_at":9 } "#),
            (
                "{\"a\":{\"b\":[1,{}]}}\n",
                "{\"a\":{\"b\":[1,{}]},\"fingerprint\":\"t.s\",\"fingerprint_expires_at\":9}\n",
            ),
        ] {
            for cut in 0..=body.len() {
                let (out, spliced, added) = stream(body.as_bytes(), &[cut], "t.s", 9);
                assert!(spliced, "{body:?} cut at {cut}");
                assert_eq!(String::from_utf8(out.clone())?.trim_end(), want.trim_end(), "cut at {cut}");
                assert_eq!(out.len(), body.len() + added);
            }
        }
        Ok(())
    }

    #[test]
    fn an_answer_that_may_name_the_field_or_is_no_object_gets_spaces() {
        for body in [
            r#"{"fingerprint":"theirs"}"#,
            r#"{"card":{"fingerprint":"x"}}"#,
            r#"{"\u0066ingerprint":1}"#,
            r#"{"f\u0069ngerprint_expires_at":1}"#,
            "[1,2]",
            "\"x\"",
        ] {
            for cut in 0..=body.len() {
                let (out, spliced, added) = stream(body.as_bytes(), &[cut], "t.s", 9);
                assert!(!spliced, "{body:?}");
                assert_eq!(out.len(), body.len() + added);
                assert_eq!(String::from_utf8_lossy(&out).trim_end(), body.trim_end());
            }
        }
    }

    #[test]
    fn a_name_cut_across_chunks_is_found() {
        let body = br#"{"a":1,"fingerprint":2}"#;
        for a in 0..=body.len() {
            for b in a..=body.len() {
                let (_, spliced, _) = stream(body, &[a, b], "t.s", 9);
                assert!(!spliced, "cuts {a} {b}");
            }
        }
    }

    #[test]
    fn a_held_answer_is_spliced_as_text_or_replaced_through_a_parse() -> Result<(), Box<dyn std::error::Error>> {
        for (body, want) in [
            (r#"{"quote":1}"#, r#"{"fingerprint":"t.s","fingerprint_expires_at":9,"quote":1}"#),
            (" { } \n", r#" {"fingerprint":"t.s","fingerprint_expires_at":9 }"#),
        ] {
            let out = splice_whole(body.as_bytes(), "t.s", 9, 1024).ok_or("not spliced")?;
            assert_eq!(String::from_utf8(out.clone())?.trim_end(), want.trim_end());
            assert!(serde_json::from_slice::<Value>(&out)?.is_object());
        }
        // A body that already has the field, plainly or escaped: replaced through a full parse, never doubled.
        for body in [
            &br#"{"fingerprint":"old","a":{"fingerprint":2}}"#[..],
            br#"{"\u0066ingerprint":"old","a":{"fingerprint":2}}"#,
        ] {
            let out = splice_whole(body, "t.s", 9, 1024).ok_or("not spliced")?;
            let v: Value = serde_json::from_slice(&out)?;
            assert_eq!((v["fingerprint"].as_str(), v["a"]["fingerprint"].as_i64()), (Some("t.s"), Some(2)));
            assert_eq!(String::from_utf8(out)?.matches("\"fingerprint\":").count(), 2);
        }
        for not_an_object in ["[1]", "\"x\"", "", "{", "}"] {
            assert_eq!(splice_whole(not_an_object.as_bytes(), "t.s", 9, 1024), None, "{not_an_object}");
        }
        Ok(())
    }

    fn json_object() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            any::<i64>().prop_map(serde_json::Value::from),
            "[a-z \\u{e9}\\u{4e2d}\"\\\\]{0,8}".prop_map(serde_json::Value::from),
            Just(serde_json::Value::Null),
        ];
        let value = leaf.prop_recursive(3, 16, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
                prop::collection::btree_map("[a-z]{1,6}|fingerprint", inner, 0..4)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        });
        prop::collection::btree_map("[a-z]{1,6}|fingerprint|fingerprint_expires_at", value, 0..5)
            .prop_map(|m| serde_json::Value::Object(m.into_iter().collect()))
    }

    proptest! {
        /// Every object, written compact, pretty or ASCII-escaped, in any chunks: the length grows by
        /// exactly what the headers announced, the answer is still JSON, and it never has two
        /// fingerprint fields; it has ours whenever the upstream named neither field anywhere.
        #[test]
        fn the_streamed_answer_is_the_announced_length_and_never_doubles_the_field(
            obj in json_object(),
            pretty in any::<bool>(),
            cuts in prop::collection::vec(any::<usize>(), 0..4),
        ) {
            let body = if pretty { serde_json::to_vec_pretty(&obj) } else { serde_json::to_vec(&obj) }.unwrap_or_default();
            let (out, spliced, added) = stream(&body, &cuts, "k1.abc_-9", 1_753_500_000);
            prop_assert_eq!(out.len(), body.len() + added);
            let parsed: serde_json::Value = serde_json::from_slice(&out).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let theirs = fingerprint_fields(&body);
            if spliced {
                prop_assert_eq!(theirs, 0);
                prop_assert_eq!(parsed.get("fingerprint").and_then(|v| v.as_str()), Some("k1.abc_-9"));
                prop_assert_eq!(parsed.get("fingerprint_expires_at").and_then(|v| v.as_u64()), Some(1_753_500_000));
                prop_assert_eq!(fingerprint_fields(&out), 2);
            } else {
                prop_assert!(theirs > 0);
                prop_assert_eq!(parsed, obj);
            }
        }
    }
}
