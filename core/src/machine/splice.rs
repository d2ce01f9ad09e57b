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

/// Whether `text` could spell a key `"fingerprint…"` as some decoder reads it: literally in any
/// case, with any of its letters written as a `\u` escape (the letters of both field names are
/// U+0041…U+005A and U+0061…U+007A in either case: every such escape starts `\u004`…`\u007`),
/// or with `ſ` (U+017F), which case-insensitive decoders (Go's) read as `s`. Conservative: a
/// value mentioning the word, or a nested field, counts too.
fn may_name(text: &[u8]) -> bool {
    const NAME: &[u8] = b"\"fingerprint";
    let escape = |w: &[u8]| {
        w.get(..4).is_some_and(|h| h.eq_ignore_ascii_case(b"\\u00"))
            && w.get(4).is_some_and(|d| (b'4'..=b'7').contains(d))
            || w.eq_ignore_ascii_case(b"\\u017")
    };
    text.windows(NAME.len()).any(|w| w.eq_ignore_ascii_case(NAME))
        || text.windows(5).any(escape)
        || text.windows(2).any(|w| w == [0xC5, 0xBF])
}

/// Whether a decoded top-level key is one of the gateway's fields as any decoder may read it:
/// without regard to case, `ſ` as `s`, the Kelvin sign as `k` (Unicode simple case folding, as
/// Go's `encoding/json` matches fields).
pub fn names_field(key: &str) -> bool {
    let folded: String =
        key.chars().flat_map(char::to_lowercase).map(|c| if c == '\u{17f}' { 's' } else { c }).collect();
    folded == super::FINGERPRINT_FIELD || folded == "fingerprint_expires_at"
}

/// Finds, byte by byte across chunks, a key of the answer's top-level object that names the
/// gateway's field once decoded ([`names_field`]): the upstream writing the fingerprint itself.
/// Unlike [`may_name`] it is exact: a nested `card.fingerprint` is the card's, and a value
/// that mentions the word is a value.
#[derive(Debug, Clone, Default)]
struct TopKeys {
    depth: u32,
    /// The top level is an object (a top-level array has no keys).
    object: bool,
    in_string: bool,
    escaped: bool,
    /// At the top level, the next string is a key.
    expect_key: bool,
    /// The raw text of the top-level key being read (bounded: a longer one cannot decode to a field name).
    key: Option<Vec<u8>>,
    found: bool,
}

/// The longest raw key that can decode to `fingerprint_expires_at` (22 characters, each at most
/// a 12-byte surrogate pair escape).
const MAX_RAW_KEY: usize = 22 * 12;

impl TopKeys {
    fn feed(&mut self, chunk: &[u8]) {
        for &b in chunk {
            if self.found {
                return;
            }
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                    if let Some(raw) = self.key.take() {
                        self.found = raw_key_names_field(&raw);
                    }
                    continue;
                }
                if let Some(raw) = &mut self.key {
                    if raw.len() >= MAX_RAW_KEY {
                        self.key = None;
                    } else {
                        raw.push(b);
                    }
                }
                continue;
            }
            match b {
                b'"' => {
                    self.in_string = true;
                    if self.depth == 1 && self.object && self.expect_key {
                        self.key = Some(Vec::new());
                        self.expect_key = false;
                    }
                }
                b'{' | b'[' => {
                    self.depth = self.depth.saturating_add(1);
                    if self.depth == 1 {
                        self.object = b == b'{';
                        self.expect_key = self.object;
                    }
                }
                b'}' | b']' => self.depth = self.depth.saturating_sub(1),
                b',' if self.depth == 1 => self.expect_key = true,
                _ => {}
            }
        }
    }
}

/// A raw key's text (between its quotes) decoded as JSON: does it name the field? A key that does
/// not decode is taken to (the answer is not JSON a decoder agrees on).
fn raw_key_names_field(raw: &[u8]) -> bool {
    let mut quoted = Vec::with_capacity(raw.len() + 2);
    quoted.push(b'"');
    quoted.extend_from_slice(raw);
    quoted.push(b'"');
    serde_json::from_slice::<String>(&quoted).map_or(true, |k| names_field(&k))
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
    /// The top-level keys, for the upstream's own fingerprint field.
    keys: TopKeys,
    /// Bytes of the answer went on already (passed, or replaced by something not empty).
    passed: bool,
    /// The answer names the field and nothing of it went on yet: all of it is collected here and
    /// goes on rewritten (the field replaced) as the last chunk.
    collected: Option<Vec<u8>>,
    /// The answer names the field after some of it went on: every byte from here on is a space,
    /// so the upstream's value never reaches the agent (what arrives is no JSON: refused).
    blanking: bool,
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
            keys: TopKeys::default(),
            passed: false,
            collected: None,
            blanking: false,
        }
    }

    /// Whether the answer was refused: it named the field after part of it went on, and the rest
    /// of it became spaces.
    pub fn refused(&self) -> bool {
        self.blanking
    }

    /// Whether the answer's top-level object names the gateway's field itself.
    pub fn self_named(&self) -> bool {
        self.keys.found
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
        let out = self.chunk_inner(chunk, end_of_stream);
        match &out {
            Chunk::Pass => self.passed |= !chunk.is_empty(),
            Chunk::Replace(bytes) => self.passed |= !bytes.is_empty(),
            Chunk::Last { .. } => self.passed = true,
        }
        out
    }

    fn chunk_inner(&mut self, chunk: &[u8], end_of_stream: bool) -> Chunk {
        self.scan(chunk);
        let was_named = self.keys.found;
        self.keys.feed(chunk);
        let last = end_of_stream || self.seen.saturating_add(chunk.len() as u64) >= self.total;
        self.seen = self.seen.saturating_add(chunk.len() as u64);
        if self.keys.found && !was_named && self.collected.is_none() && !self.blanking {
            // The upstream writes the fingerprint itself: nothing of its value
            // may reach the agent. All of the answer still in hand: collect it and rewrite it
            // whole; some already went on: blank the rest.
            if self.passed {
                self.blanking = true;
            } else {
                self.collected = Some(std::mem::take(&mut self.held));
            }
        }
        if self.blanking {
            let mut spaces = vec![b' '; self.held.len() + chunk.len()];
            self.held.clear();
            if last {
                spaces.resize(spaces.len() + self.fields.len(), b' ');
                return Chunk::Last { body: spaces, spliced: false };
            }
            return Chunk::Replace(spaces);
        }
        if let Some(all) = &mut self.collected {
            all.extend_from_slice(chunk);
            if !last {
                return Chunk::Replace(Vec::new());
            }
            let all = std::mem::take(all);
            let want = all.len() + self.fields.len();
            return match rewrite_named(&all, &self.fields) {
                Some(mut body) if body.len() <= want => {
                    body.resize(want, b' ');
                    Chunk::Last { body, spliced: true }
                }
                // No JSON object to rewrite, or one that does not fit the announced length: refused.
                _ => {
                    self.blanking = true;
                    Chunk::Last { body: vec![b' '; want], spliced: false }
                }
            };
        }
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
/// name the field goes through a full parse, so every top-level key that names it (in any case,
/// any escaping: [`names_field`]) is dropped and the gateway's go in: never doubled, never the
/// upstream's value beside them.
pub fn splice_whole(body: &[u8], token: &str, exp: u64, limit: usize) -> Option<Vec<u8>> {
    if let Some(out) = splice_text(body, token, exp) {
        return Some(out);
    }
    let Ok(Value::Object(mut obj)) = crate::canonical::parse_json_body(body, limit) else { return None };
    obj.retain(|k, _| !names_field(k));
    obj.insert(super::FINGERPRINT_FIELD.into(), Value::String(token.to_string()));
    obj.insert("fingerprint_expires_at".into(), Value::from(exp));
    serde_json::to_vec(&obj).ok()
}

/// A streamed answer that names the field, held whole after all: its own fields dropped and
/// `fields` (`,"fingerprint":…,"fingerprint_expires_at":…`) put in, compact. `None` if it is not
/// one JSON object.
fn rewrite_named(body: &[u8], fields: &[u8]) -> Option<Vec<u8>> {
    let Ok(Value::Object(mut obj)) = serde_json::from_slice::<Value>(body) else { return None };
    obj.retain(|k, _| !names_field(k));
    let mut out = serde_json::to_vec(&obj).ok()?;
    // `{…}` becomes `{…,"fingerprint":…}`, or `{"fingerprint":…}` when it had no members left.
    let close = out.pop()?;
    let fields = if obj.is_empty() { fields.get(1..)? } else { fields };
    out.extend_from_slice(fields);
    out.push(close);
    Some(out)
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
        String::from_utf8_lossy(out).to_lowercase().matches("\"fingerprint").count()
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
        // (A top-level field of that name is the upstream writing ours: see the next test.)
        for body in [
            r#"{"card":{"fingerprint":"x"}}"#,
            r#"{"card":{"\u0066ingerprint":1}}"#,
            r#"{"note":"Fingerprint"}"#,
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

    /// The upstream writes the fingerprint itself, at the top level, in any case
    /// or escaping. In one chunk (nothing gone yet): rewritten, the gateway's field in its place,
    /// at the announced length. After part of it went: the rest is spaces, its value never sent.
    #[test]
    fn an_answer_that_writes_its_own_top_level_fingerprint_never_passes_its_value(
    ) -> Result<(), Box<dyn std::error::Error>> {
        for key in [
            "fingerprint",
            "Fingerprint",
            "FINGERPRINT",
            "\\u0066ingerprint",
            "F\\u0069ngerprint",
            "fingerprint_expire\\u017f_at",
        ] {
            let body = format!(r#"{{"{key}":"upstream_fp_0000","quote_id":"q_1","amount":"12.00"}}"#);
            let (out, spliced, added) = stream(body.as_bytes(), &[], "t.s", 9);
            assert!(spliced, "{key}");
            assert_eq!(out.len(), body.len() + added, "{key}");
            let text = String::from_utf8(out.clone())?;
            assert!(!text.contains("upstream_fp_0000"), "{key}: {text}");
            let v: Value = serde_json::from_slice(&out)?;
            assert_eq!((v["fingerprint"].as_str(), v["quote_id"].as_str()), (Some("t.s"), Some("q_1")), "{key}");
            // Cut after the key went by in an earlier chunk: blanked from the chunk that shows it.
            for at in [1, 3] {
                let (out, _, added) = stream(body.as_bytes(), &[at], "t.s", 9);
                assert_eq!(out.len(), body.len() + added, "{key} cut at {at}");
                let text = String::from_utf8(out.clone())?;
                assert!(!text.contains("upstream_fp"), "{key} cut at {at}: {text}");
                assert!(serde_json::from_slice::<Value>(&out).is_err(), "{key} cut at {at}: refused, no JSON");
            }
        }
        // A nested field, or a value naming the word, is nobody's fingerprint: never refused.
        for body in [r#"{"card":{"fingerprint":"c"},"q":1}"#, r#"{"note":"fingerprint","q":1}"#] {
            for cut in 0..=body.len() {
                let (out, _, _) = stream(body.as_bytes(), &[cut], "t.s", 9);
                let v: Value = serde_json::from_slice(&out)?;
                assert_eq!(v["q"], 1, "{body} cut at {cut}");
            }
        }
        Ok(())
    }

    /// The held splice drops every top-level key that names either field, as any decoder reads it.
    #[test]
    fn a_held_answer_keeps_no_field_of_the_upstreams_that_a_decoder_would_read_as_ours(
    ) -> Result<(), Box<dyn std::error::Error>> {
        let body = br#"{"fingerprint":"a","Fingerprint":"b","\u0046INGERPRINT":"c","fingerprint_expire\u017f_at":1,"card":{"Fingerprint":"x"}}"#;
        let out = splice_whole(body, "t.s", 9, 1024).ok_or("not spliced")?;
        let v: Value = serde_json::from_slice(&out)?;
        let keys: Vec<&String> = v.as_object().ok_or("no object")?.keys().collect();
        assert_eq!(keys, ["card", "fingerprint", "fingerprint_expires_at"], "{v}");
        assert_eq!((v["fingerprint"].as_str(), v["card"]["Fingerprint"].as_str()), (Some("t.s"), Some("x")));
        for key in ["Fingerprint", "FINGERPRINT_EXPIRES_AT", "fingerprint_expireſ_at", "fingerprint"] {
            assert!(names_field(key), "{key}");
        }
        for key in ["fingerprints", "card_fingerprint", "ﬁngerprint"] {
            assert!(!names_field(key), "{key}");
        }
        Ok(())
    }

    #[test]
    fn a_name_cut_across_chunks_is_found() {
        // Nested: found however it is cut (never spliced into an answer that may name it).
        let body = br#"{"a":{"fingerprint":2},"b":1}"#;
        for a in 0..=body.len() {
            for b in a..=body.len() {
                let (_, spliced, _) = stream(body, &[a, b], "t.s", 9);
                assert!(!spliced, "cuts {a} {b}");
            }
        }
        // At the top level: however it is cut, the upstream's value never goes on as a field.
        let body = br#"{"a":1,"Fingerprint":2}"#;
        for a in 0..=body.len() {
            for b in a..=body.len() {
                let (out, _, _) = stream(body, &[a, b], "t.s", 9);
                if let Ok(v) = serde_json::from_slice::<Value>(&out) {
                    assert_eq!((v["fingerprint"].as_str(), v.get("Fingerprint")), (Some("t.s"), None), "cuts {a} {b}");
                }
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
        prop::collection::btree_map(
            "[a-z]{1,6}|fingerprint|fingerprint_expires_at|Fingerprint|FINGERPRINT_expires_AT",
            value,
            0..5,
        )
        .prop_map(|m| serde_json::Value::Object(m.into_iter().collect()))
    }

    proptest! {
        /// Every object, written compact, pretty or ASCII-escaped, in any chunks: the length grows by
        /// exactly what the headers announced, and it never has two fingerprint fields. Where the
        /// upstream named neither field anywhere, it has ours. Where its top level names one (any
        /// case), its value never reaches the agent: the answer is rewritten with ours in its place,
        /// or (part of it gone already) the rest is spaces and it is no JSON at all.
        #[test]
        fn the_streamed_answer_is_the_announced_length_and_never_doubles_the_field(
            obj in json_object(),
            pretty in any::<bool>(),
            cuts in prop::collection::vec(any::<usize>(), 0..4),
        ) {
            let body = if pretty { serde_json::to_vec_pretty(&obj) } else { serde_json::to_vec(&obj) }.unwrap_or_default();
            let (out, spliced, added) = stream(&body, &cuts, "k1.abc_-9", 1_753_500_000);
            prop_assert_eq!(out.len(), body.len() + added);
            let self_named = obj.as_object().is_some_and(|o| o.keys().any(|k| names_field(k)));
            let theirs = fingerprint_fields(&body);
            let parsed = serde_json::from_slice::<serde_json::Value>(&out);
            if self_named {
                match parsed {
                    Ok(parsed) => {
                        prop_assert!(spliced);
                        let mut want = obj.as_object().cloned().unwrap_or_default();
                        want.retain(|k, _| !names_field(k));
                        want.insert("fingerprint".into(), "k1.abc_-9".into());
                        want.insert("fingerprint_expires_at".into(), 1_753_500_000u64.into());
                        prop_assert_eq!(parsed, serde_json::Value::Object(want));
                    }
                    Err(_) => {
                        // Refused: what went on is a prefix of the answer, the rest spaces. Compared as
                        // bytes: the cut may fall inside a character, which is no JSON either.
                        let kept = out.iter().rposition(|&b| b != b' ').map_or(&out[..0], |end| &out[..=end]);
                        prop_assert!(body.starts_with(kept), "{}", String::from_utf8_lossy(&out));
                    }
                }
                return Ok(());
            }
            let parsed = parsed.map_err(|e| TestCaseError::fail(e.to_string()))?;
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
