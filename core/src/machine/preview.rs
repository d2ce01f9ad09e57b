//! Preview: hash the bound fields of the request, and mint a fingerprint into
//! a successful JSON answer. No I/O: previews outnumber confirms, and most are
//! never confirmed (DESIGN §3).

use super::{parse_body, Counter, Ctx, Effect, Env, Flow, Outcome, ResponseHead, Step, Unexpected};
use crate::canonical;
use crate::fingerprint;
use crate::policy::QuoteExpiry;
use crate::reply::{ReplyContext, ReplyKind};
use serde_json::Value;

pub const FINGERPRINT_EXPIRES_HEADER: &str = "agent-fingerprint-expires-at";

#[derive(Debug)]
pub struct Preview {
    ctx: Ctx,
    subject_hash: String,
    phase: Phase,
}

#[derive(Debug)]
enum Phase {
    AwaitBody,
    /// Forwarded; the bound fields hash to this.
    Forwarded {
        param_hash: String,
    },
    /// The route's quote states its expiry in the answer's body: minted once it is read.
    AwaitQuote {
        param_hash: String,
    },
    /// Minted into the headers; the body gets it too once complete.
    Minted {
        token: String,
        exp: u64,
    },
    Finished,
}

impl Preview {
    pub(super) fn new(ctx: Ctx, subject_hash: String) -> Preview {
        Preview { ctx, subject_hash, phase: Phase::AwaitBody }
    }

    pub(super) fn finished(&self) -> bool {
        matches!(self.phase, Phase::Finished)
    }

    pub(super) fn body_limit(&self) -> Option<(&Ctx, usize)> {
        matches!(self.phase, Phase::AwaitBody).then_some((&self.ctx, self.ctx.config.max_body_bytes))
    }

    pub(super) fn on_request_body(&mut self, body: &[u8]) -> Outcome {
        if !matches!(self.phase, Phase::AwaitBody) {
            return Err(Unexpected { event: "request_body", phase: self.phase_name() });
        }
        let json = match parse_body(&self.ctx, body) {
            Ok(v) => v,
            Err(step) => return Ok(self.finish(step)),
        };
        match canonical::param_hash(&json, &self.ctx.policy.bound) {
            Ok(param_hash) => {
                self.phase = Phase::Forwarded { param_hash };
                Ok(Step::go_on())
            }
            Err(e) => {
                let step = self.ctx.field_error(&e);
                Ok(self.finish(step))
            }
        }
    }

    /// Mint at response time, and only for a successful JSON answer: a failed
    /// preview must not hand out something to confirm.
    pub(super) fn on_response_head(&mut self, head: &ResponseHead, end_of_stream: bool, env: &mut dyn Env) -> Step {
        let Phase::Forwarded { param_hash } = &self.phase else {
            return Step::go_on();
        };
        let is_json = head.content_type.as_deref().is_some_and(|c| c.contains("json"));
        if !(200..300).contains(&head.status) || !is_json {
            return self.finish(Step::go_on());
        }
        let param_hash = param_hash.clone();
        let quote = match &self.ctx.policy.quote_expires {
            None => None,
            Some(QuoteExpiry::Header(name)) => {
                let stated = head.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.trim());
                Some(stated.and_then(|v| QuoteExpiry::read(&Value::String(v.to_string()))))
            }
            Some(QuoteExpiry::Pointer(_)) if end_of_stream => Some(None),
            Some(QuoteExpiry::Pointer(_)) => {
                // The validity is in the body: hold the answer until it is read.
                self.phase = Phase::AwaitQuote { param_hash };
                return Step::pause().with(Effect::RemoveResponseHeader("content-length"));
            }
        };
        let mut step = match self.mint(&param_hash, quote, env) {
            Ok((step, token, exp)) => {
                self.phase = Phase::Minted { token, exp };
                step
            }
            Err(step) => return self.finish(step),
        };
        if end_of_stream {
            return self.finish(step);
        }
        // The body grows: its old length is wrong.
        step.effects.push(Effect::RemoveResponseHeader("content-length"));
        step.flow = Flow::Pause;
        step
    }

    /// Mint, with `exp = min(now + ttl, the quote's expiry)` where the route states one
    /// (`quote`: `None` without `quote_expires`; `Some(None)` when the answer's is unreadable).
    /// `Err` is the step to end with: no randomness (the answer passes without a fingerprint), or
    /// no usable quote expiry (the answer is replaced: nothing must be confirmable from it).
    fn mint(
        &self,
        param_hash: &str,
        quote: Option<Option<u64>>,
        env: &mut dyn Env,
    ) -> Result<(Step, String, u64), Step> {
        let policy = &self.ctx.policy;
        let now = env.now_s();
        let mut exp = now.saturating_add(policy.fingerprint_ttl_s);
        match quote {
            None => {}
            Some(Some(q)) if q > now => exp = exp.min(q),
            Some(_) => {
                let detail = "the quote's expiry is missing, unreadable or past";
                let ctx = ReplyContext { detail: Some(detail), ..Default::default() };
                return Err(Step::go_on().with(Effect::Rewrite(self.ctx.render(ReplyKind::QuoteUnusable, ctx))));
            }
        }
        let Some(nonce) = env.random16() else {
            let warn = Effect::Warn("no randomness for a nonce; preview passes without a fingerprint".into());
            return Err(Step::go_on().with(warn));
        };
        let token =
            fingerprint::mint(&self.ctx.config.keyring, nonce, exp, &self.subject_hash, &policy.scope, param_hash);
        let step = Step::go_on()
            .with(Effect::Count(Counter::Minted))
            .with(Effect::SetResponseHeader(super::FINGERPRINT_HEADER.into(), token.clone()))
            .with(Effect::SetResponseHeader(FINGERPRINT_EXPIRES_HEADER.into(), exp.to_string()));
        Ok((step, token, exp))
    }

    /// Whether the upstream's headers must be read (the quote states its expiry in one).
    pub(super) fn needs_headers(&self) -> bool {
        matches!(self.phase, Phase::Forwarded { .. })
            && matches!(self.ctx.policy.quote_expires, Some(QuoteExpiry::Header(_)))
    }

    pub(super) fn on_response_data(&mut self, end_of_stream: bool) -> Step {
        match (&self.phase, end_of_stream) {
            (Phase::Minted { .. } | Phase::AwaitQuote { .. }, false) => Step::pause(),
            (Phase::Minted { .. } | Phase::AwaitQuote { .. }, true) => Step::need_body(),
            _ => Step::go_on(),
        }
    }

    pub(super) fn on_response_body(&mut self, body: &[u8], env: &mut dyn Env) -> Outcome {
        let mut first = Step::go_on();
        if let Phase::AwaitQuote { param_hash } = &self.phase {
            let stated = match &self.ctx.policy.quote_expires {
                Some(QuoteExpiry::Pointer(p)) => canonical::parse_json_body(body, self.ctx.config.max_response_bytes)
                    .ok()
                    .and_then(|v| v.pointer(p).and_then(QuoteExpiry::read)),
                _ => None,
            };
            let param_hash = param_hash.clone();
            match self.mint(&param_hash, Some(stated), env) {
                Ok((step, token, exp)) => {
                    first = step;
                    self.phase = Phase::Minted { token, exp };
                }
                Err(step) => return Ok(self.finish(step)),
            }
        }
        let Phase::Minted { token, exp } = &self.phase else {
            return Err(Unexpected { event: "response_body", phase: self.phase_name() });
        };
        let step = match splice(body, token, *exp, self.ctx.config.max_response_bytes) {
            // The headers are still held: give them the new length, so the answer goes out as one
            // sized message instead of chunks.
            Some(out) => Step::go_on()
                .with(Effect::SetResponseHeader("content-length".into(), out.len().to_string()))
                .with(Effect::ReplaceResponseBody(out)),
            // A body we cannot extend still carries the fingerprint in the header.
            None => Step::go_on().with(Effect::SetResponseHeader("content-length".into(), body.len().to_string())),
        };
        Ok(self.finish(first.then(step)))
    }

    fn finish(&mut self, step: Step) -> Step {
        self.phase = Phase::Finished;
        step
    }

    fn phase_name(&self) -> &'static str {
        match self.phase {
            Phase::AwaitBody => "preview.await_body",
            Phase::Forwarded { .. } => "preview.forwarded",
            Phase::AwaitQuote { .. } => "preview.await_quote",
            Phase::Minted { .. } => "preview.minted",
            Phase::Finished => "preview.finished",
        }
    }
}

/// The upstream's JSON object with `fingerprint` and `fingerprint_expires_at`
/// added; `None` if it is not a JSON object. The common case is spliced as
/// text after the opening brace (no parse, no re-serialisation: the preview is
/// the hot path); a body that already mentions `"fingerprint"` anywhere goes
/// through a full parse, so a field of that name is replaced, never duplicated.
fn splice(body: &[u8], token: &str, exp: u64, limit: usize) -> Option<Vec<u8>> {
    if let Some(out) = splice_text(body, token, exp) {
        return Some(out);
    }
    let Ok(Value::Object(mut obj)) = canonical::parse_json_body(body, limit) else { return None };
    obj.insert(super::FINGERPRINT_FIELD.into(), Value::String(token.to_string()));
    obj.insert("fingerprint_expires_at".into(), Value::from(exp));
    serde_json::to_vec(&obj).ok()
}

fn splice_text(body: &[u8], token: &str, exp: u64) -> Option<Vec<u8>> {
    let start = body.iter().position(|b| !b.is_ascii_whitespace())?;
    let end = body.iter().rposition(|b| !b.is_ascii_whitespace())?;
    if body.get(start) != Some(&b'{') || body.get(end) != Some(&b'}') || end <= start {
        return None;
    }
    if body.windows(b"\"fingerprint".len()).any(|w| w == b"\"fingerprint") {
        return None;
    }
    // Base64url and digits: nothing in the inserted text needs escaping.
    let inner_empty = body.get(start + 1..end).is_some_and(|b| b.iter().all(u8::is_ascii_whitespace));
    let fields = format!(
        "\"{}\":\"{token}\",\"fingerprint_expires_at\":{exp}{}",
        super::FINGERPRINT_FIELD,
        if inner_empty { "" } else { "," }
    );
    let mut out = Vec::with_capacity(body.len() + fields.len());
    out.extend_from_slice(body.get(..=start)?);
    out.extend_from_slice(fields.as_bytes());
    out.extend_from_slice(body.get(start + 1..)?);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fingerprint_is_spliced_into_any_json_object() -> Result<(), Box<dyn std::error::Error>> {
        for (body, want) in [
            (r#"{"quote":1}"#, r#"{"fingerprint":"t.s","fingerprint_expires_at":9,"quote":1}"#),
            (" { } \n", r#" {"fingerprint":"t.s","fingerprint_expires_at":9 }"#),
        ] {
            let out = splice(body.as_bytes(), "t.s", 9, 1024).ok_or("not spliced")?;
            assert_eq!(String::from_utf8(out.clone())?.trim_end(), want.trim_end());
            assert!(serde_json::from_slice::<Value>(&out)?.is_object());
        }
        // A body that already has the field: replaced through a full parse, never duplicated.
        let out = splice(br#"{"fingerprint":"old","a":{"fingerprint":2}}"#, "t.s", 9, 1024).ok_or("not spliced")?;
        let v: Value = serde_json::from_slice(&out)?;
        assert_eq!((v["fingerprint"].as_str(), v["a"]["fingerprint"].as_i64()), (Some("t.s"), Some(2)));
        assert_eq!(String::from_utf8(out)?.matches("\"fingerprint\":").count(), 2);
        for not_an_object in ["[1]", "\"x\"", "", "{", "}"] {
            assert_eq!(splice(not_an_object.as_bytes(), "t.s", 9, 1024), None, "{not_an_object}");
        }
        Ok(())
    }
}
