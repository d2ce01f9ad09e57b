//! A plan made into an answer: status, headers (repeated and non-UTF-8 ones included), the body's bytes and
//! how they travel. Pure: the server ([`crate::server`]) only sends what this returns.

use crate::grammar::{
    ConfirmPlan, Delivery, Garbage, LookupPlan, NamedValue, Outcome, PreviewPlan, PreviewStatus, QuoteHeader, Shape,
    Stated,
};
use crate::ledger::{Execution, Quote};
use serde_json::{json, Map, Value};

/// The header a preview states its quote's expiry in (`quote_expires: header:quote-expires-at`).
pub const QUOTE_HEADER: &str = "quote-expires-at";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    /// In order; a name may repeat.
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
    pub delivery: Delivery,
    /// No answer at all: the connection (HTTP/1.1) or stream (h2) is cut.
    pub reset: bool,
}

impl Answer {
    fn json(status: u16, body: Vec<u8>, delivery: Delivery) -> Answer {
        Answer {
            status,
            headers: vec![("content-type".into(), b"application/json".to_vec())],
            body,
            delivery,
            reset: false,
        }
    }

    /// A plain JSON answer, sent whole.
    pub fn plain(status: u16, body: &Value) -> Answer {
        Answer::json(status, body.to_string().into_bytes(), Delivery::Whole)
    }

    pub fn header_values(&self, name: &str) -> Vec<&[u8]> {
        self.headers.iter().filter(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_slice()).collect()
    }

    fn add(&mut self, name: &str, value: impl Into<Vec<u8>>) {
        self.headers.push((name.to_owned(), value.into()));
    }
}

/// What a handler knows besides the plan.
pub struct Context<'a> {
    /// The request's JSON body (Null when it is none).
    pub request: &'a Value,
    /// Real time, unix seconds.
    pub now_s: u64,
    /// The fingerprint TTL the upstream expects of its preview routes: `before`, `at` and `after` are
    /// relative to it.
    pub ttl_hint_s: u64,
    /// A fingerprint seen in an earlier request, for stale echoes.
    pub stale: Option<String>,
}

/// The value a stated expiry is written as, on a clock at `now` (None: not stated).
pub fn stated_value(s: Stated, now: i64, ttl: u64) -> Option<Value> {
    let ttl = ttl.max(2) as i64;
    Some(match s {
        Stated::Before => json!(now + ttl / 2),
        Stated::At => json!(now + ttl),
        Stated::After => json!(now + 10 * ttl),
        Stated::Past => json!((now - 10).max(0)),
        Stated::Digits => json!((now + 2 * ttl).to_string()),
        Stated::Rfc3339 => json!(rfc3339(now + 2 * ttl)),
        Stated::Garbage => json!("soon"),
        Stated::Missing => return None,
    })
}

fn header_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// `YYYY-MM-DDTHH:MM:SSZ` of unix seconds: the filter's own (`idem_core::utc`), the text it parses.
pub fn rfc3339(t: i64) -> String {
    idem_core::utc::iso_utc(u64::try_from(t).unwrap_or(0))
}

/// The object with `shape` applied, as JSON text. Echo: the request's top-level fields the answer has no
/// field of, and the whole request under `request`. Named: a `fingerprint` field written into the text with
/// the plan's spelling (so `\u0066ingerprint` stays escaped on the wire).
pub fn shaped(mut obj: Map<String, Value>, shape: Shape, ctx: &Context<'_>, garbage_value: &str) -> Vec<u8> {
    match shape {
        Shape::Plain => Value::Object(obj).to_string().into_bytes(),
        Shape::Echo => {
            if let Value::Object(req) = ctx.request {
                for (k, v) in req {
                    if !obj.contains_key(k) {
                        obj.insert(k.clone(), v.clone());
                    }
                }
            }
            obj.insert("request".into(), ctx.request.clone());
            Value::Object(obj).to_string().into_bytes()
        }
        Shape::Named { value, spelling, first } => {
            let v = match value {
                NamedValue::Stale => ctx.stale.clone().unwrap_or_else(|| garbage_value.to_owned()),
                NamedValue::Garbage => garbage_value.to_owned(),
            };
            let field = format!("{}:{}", spelling.raw_key(), Value::String(v));
            let text = Value::Object(obj).to_string();
            let inner = &text[1..text.len() - 1];
            let joined = match (inner.is_empty(), first) {
                (true, _) => field,
                (false, true) => format!("{field},{inner}"),
                (false, false) => format!("{inner},{field}"),
            };
            format!("{{{joined}}}").into_bytes()
        }
    }
}

fn add_garbage(a: &mut Answer, garbage: &[Garbage], ctx: &Context<'_>) {
    for g in garbage {
        match g {
            Garbage::RepeatedContentType => a.add("content-type", "text/plain"),
            Garbage::UpstreamFingerprintHeader => {
                a.add("agent-fingerprint", ctx.stale.clone().unwrap_or_else(|| "upstream.fingerprint".into()))
            }
            Garbage::ForeignKey => a.add("idempotency-key", "0000000000000000000000000000beef"),
            Garbage::Replayed => a.add("idempotent-replayed", "true"),
            Garbage::NonUtf8 => a.add("x-hostile-bytes", b"\xff\xfe\x80ok".to_vec()),
            Garbage::RetryAfterText => a.add("retry-after", "soon"),
        }
    }
}

/// A preview's answer and the quote it states (None: no quote was answered).
pub fn preview(plan: &PreviewPlan, ctx: &Context<'_>, quote_id: &str) -> (Answer, Option<Quote>) {
    let clock = ctx.now_s as i64 + plan.skew_s;
    let field = |k: &str| ctx.request.get(k).cloned().unwrap_or(Value::Null);
    let mut quote = Map::new();
    quote.insert("quote_id".into(), json!(quote_id));
    quote.insert("amount".into(), field("amount"));
    quote.insert("currency".into(), field("currency"));
    quote.insert("payee_id".into(), field("payee_id"));
    quote.insert("fee".into(), json!("1.00"));
    let expires_at = stated_value(plan.expires_at, clock, ctx.ttl_hint_s);
    if let Some(e) = &expires_at {
        quote.insert("expires_at".into(), e.clone());
    }
    let mut a = match plan.status {
        PreviewStatus::Quote => Answer::json(200, shaped(quote, plan.shape, ctx, "upstream-fp-0"), plan.delivery),
        PreviewStatus::Array => {
            Answer::json(200, json!([Value::Object(quote)]).to_string().into_bytes(), plan.delivery)
        }
        PreviewStatus::Text => Answer {
            status: 200,
            headers: vec![("content-type".into(), b"text/plain".to_vec())],
            body: format!("quote {quote_id}: fee 1.00, valid for a while").into_bytes(),
            delivery: plan.delivery,
            reset: false,
        },
        PreviewStatus::Error(s) => Answer {
            status: s,
            headers: vec![("content-type".into(), b"text/html".to_vec())],
            body: b"<html><body><h1>upstream error</h1></body></html>".to_vec(),
            delivery: plan.delivery,
            reset: false,
        },
    };
    let mut header_values = Vec::new();
    match plan.quote_header {
        QuoteHeader::Absent => {}
        QuoteHeader::Once(s) => header_values.extend(stated_value(s, clock, ctx.ttl_hint_s).map(|v| header_text(&v))),
        QuoteHeader::Twice(x, y) => {
            for s in [x, y] {
                // A `missing` one of two is the header present and empty.
                header_values.push(stated_value(s, clock, ctx.ttl_hint_s).map(|v| header_text(&v)).unwrap_or_default());
            }
        }
        QuoteHeader::Empty => header_values.push(String::new()),
    }
    for v in &header_values {
        a.add(QUOTE_HEADER, v.as_bytes());
    }
    add_garbage(&mut a, &plan.garbage, ctx);
    let answered = matches!(plan.status, PreviewStatus::Quote | PreviewStatus::Array);
    let q = answered.then(|| Quote {
        quote_id: quote_id.to_owned(),
        expires_at,
        header_values,
        skew_s: plan.skew_s,
        at_unix_s: ctx.now_s,
        complete: plan.delivery != Delivery::Truncated,
    });
    (a, q)
}

/// The fields of a transfer request the upstream needs; Err: the 400's detail (nothing executes).
pub fn transfer_fields(request: &Value) -> Result<(Value, String, String), String> {
    let amount = request.get("amount").filter(|a| a.is_number() || a.is_string()).cloned();
    let text = |k: &str| request.get(k).and_then(Value::as_str).filter(|s| !s.trim().is_empty()).map(str::to_owned);
    match (amount, text("currency"), text("payee_id")) {
        (Some(a), Some(c), Some(p)) => Ok((a, c, p)),
        _ => Err("amount, currency and payee_id are required".into()),
    }
}

/// The record of an execution, in the demo's shape (`transfer_id`, `status: executed`, the fields, the
/// `idempotency_key` and `client_ref` it came with, `executed_at`).
pub fn record(request: &Value, transfer_id: &str, key: Option<&str>, now_s: u64) -> Result<Map<String, Value>, String> {
    let (amount, currency, payee_id) = transfer_fields(request)?;
    let mut r = Map::new();
    r.insert("transfer_id".into(), json!(transfer_id));
    r.insert("status".into(), json!("executed"));
    r.insert("amount".into(), amount);
    r.insert("currency".into(), json!(currency));
    r.insert("payee_id".into(), json!(payee_id));
    r.insert("memo".into(), request.get("memo").cloned().unwrap_or(Value::Null));
    if let Some(k) = key {
        r.insert("idempotency_key".into(), json!(k));
    }
    if let Some(c) = request.get("client_ref").and_then(Value::as_str) {
        r.insert("client_ref".into(), json!(c));
    }
    r.insert("executed_at".into(), json!(now_s));
    Ok(r)
}

/// What a confirm does: `Some(record)` to execute (the caller commits it to the ledger before sending
/// anything), and the answer.
pub fn confirm(
    plan: &ConfirmPlan,
    ctx: &Context<'_>,
    transfer_id: &str,
    key: Option<&str>,
) -> (Option<Map<String, Value>>, Answer) {
    let record = match record(ctx.request, transfer_id, key, ctx.now_s) {
        Ok(r) => r,
        Err(detail) => return (None, Answer::plain(400, &json!({ "error": "invalid_request", "detail": detail }))),
    };
    let mut a = match plan.outcome {
        Outcome::Refuse(s) => {
            let error = if s == 422 { "limit_exceeded" } else { "invalid_request" };
            Answer::plain(s, &json!({ "error": error }))
        }
        Outcome::Busy => {
            let mut a = Answer::plain(429, &json!({ "error": "busy" }));
            a.add("retry-after", "1");
            a
        }
        Outcome::Execute(s) => Answer::json(s, shaped(record.clone(), plan.shape, ctx, "upstream-fp-1"), plan.delivery),
        Outcome::ExecuteSlow { ms } => {
            Answer::json(201, shaped(record.clone(), plan.shape, ctx, "upstream-fp-1"), Delivery::HeadPause { ms })
        }
        Outcome::ExecuteThenError(s) => Answer::plain(s, &json!({ "error": "internal_error" })),
        Outcome::ExecuteThenReset => Answer { reset: true, ..Answer::plain(500, &json!({})) },
    };
    add_garbage(&mut a, &plan.garbage, ctx);
    (plan.outcome.executes().then_some(record), a)
}

/// A lookup's answer about `found` (by key or by reference).
pub fn lookup(plan: LookupPlan, found: Option<&Execution>) -> Answer {
    let honest = || match found {
        Some(x) => Answer::json(200, x.record.clone().into_bytes(), Delivery::Whole),
        None => Answer::plain(404, &json!({ "error": "not_found" })),
    };
    match plan {
        LookupPlan::Honest => honest(),
        LookupPlan::Slow { ms } => Answer { delivery: Delivery::HeadPause { ms }, ..honest() },
        LookupPlan::Error(s) => Answer::plain(s, &json!({ "error": "unavailable" })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grammar::Spelling;

    fn ctx(request: &Value) -> Context<'_> {
        Context { request, now_s: 1_000_000, ttl_hint_s: 60, stale: Some("old.fp".into()) }
    }

    #[test]
    fn rfc3339_of_known_times() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_798_761_599), "2026-12-31T23:59:59Z");
    }

    #[test]
    fn a_named_field_keeps_its_spelling_on_the_wire_and_decodes_to_fingerprint() {
        let req = json!({});
        for spelling in Spelling::ALL {
            for first in [true, false] {
                let mut obj = Map::new();
                obj.insert("a".into(), json!(1));
                let shape = Shape::Named { value: NamedValue::Stale, spelling, first };
                let text = shaped(obj, shape, &ctx(&req), "garbage");
                let s = String::from_utf8(text.clone()).unwrap();
                assert!(s.contains(spelling.raw_key()), "{s}");
                let v: Value = serde_json::from_slice(&text).unwrap();
                let named: Vec<&String> =
                    v.as_object().unwrap().keys().filter(|k| k.eq_ignore_ascii_case("fingerprint")).collect();
                assert_eq!(named.len(), 1, "{s}");
                assert_eq!(v[named[0].as_str()], "old.fp");
                assert_eq!(v["a"], 1);
                assert_eq!(s.starts_with(&format!("{{{}", spelling.raw_key())), first, "{s}");
            }
        }
    }

    #[test]
    fn an_echo_hands_back_the_fingerprint_the_request_carried() {
        let req = json!({"amount": "5", "fingerprint": "agents.own", "quote_id": "theirs"});
        let mut obj = Map::new();
        obj.insert("quote_id".into(), json!("q_1"));
        let v: Value = serde_json::from_slice(&shaped(obj, Shape::Echo, &ctx(&req), "g")).unwrap();
        assert_eq!(v["fingerprint"], "agents.own");
        assert_eq!(v["quote_id"], "q_1", "the answer's own fields win");
        assert_eq!(v["request"], req);
    }

    #[test]
    fn a_twice_stated_quote_header_is_two_header_lines() {
        let req = json!({"amount": "5", "currency": "EUR", "payee_id": "p"});
        let plan = PreviewPlan {
            status: PreviewStatus::Quote,
            shape: Shape::Plain,
            expires_at: Stated::Past,
            quote_header: QuoteHeader::Twice(Stated::After, Stated::Before),
            skew_s: -10,
            delivery: Delivery::Whole,
            garbage: vec![Garbage::NonUtf8],
        };
        let (a, q) = preview(&plan, &ctx(&req), "q_1");
        let clock = 1_000_000 - 10;
        assert_eq!(
            a.header_values(QUOTE_HEADER),
            [format!("{}", clock + 600).as_bytes(), format!("{}", clock + 30).as_bytes()]
        );
        let body: Value = serde_json::from_slice(&a.body).unwrap();
        assert_eq!(body["expires_at"], clock - 10, "past on the upstream's own (skewed) clock");
        assert_eq!(body["amount"], "5");
        assert_eq!(a.header_values("x-hostile-bytes"), [b"\xff\xfe\x80ok".as_slice()]);
        let q = q.unwrap();
        assert_eq!(q.header_values.len(), 2);
        assert_eq!(q.expires_at, Some(json!(clock - 10)));
    }

    #[test]
    fn confirms_execute_only_on_the_branches_that_do() {
        let req = json!({"amount": 5, "currency": "EUR", "payee_id": "p", "client_ref": "inv-1"});
        let plan = |outcome| ConfirmPlan { outcome, shape: Shape::Plain, delivery: Delivery::Whole, garbage: vec![] };
        let (rec, a) = confirm(&plan(Outcome::Execute(201)), &ctx(&req), "t_1", Some("k"));
        let rec = rec.unwrap();
        assert_eq!(
            (rec["transfer_id"].as_str(), rec["idempotency_key"].as_str(), rec["client_ref"].as_str()),
            (Some("t_1"), Some("k"), Some("inv-1"))
        );
        assert_eq!(a.status, 201);
        let (rec, a) = confirm(&plan(Outcome::ExecuteThenError(502)), &ctx(&req), "t_2", Some("k"));
        assert!(rec.is_some() && a.status == 502);
        let (rec, a) = confirm(&plan(Outcome::ExecuteThenReset), &ctx(&req), "t_3", Some("k"));
        assert!(rec.is_some() && a.reset);
        for o in [Outcome::Refuse(422), Outcome::Busy] {
            let (rec, a) = confirm(&plan(o), &ctx(&req), "t_4", Some("k"));
            assert!(rec.is_none() && a.status >= 400, "{o:?}");
        }
        // Not a transfer: a 400, nothing executed, whatever the plan.
        let (rec, a) = confirm(&plan(Outcome::Execute(201)), &ctx(&json!({"amount": 5})), "t_5", None);
        assert!(rec.is_none() && a.status == 400);
    }
}
