//! Preview: hash the bound fields of the request, and mint a fingerprint into
//! a successful JSON answer. No I/O: previews outnumber confirms, and most are
//! never confirmed (DESIGN §3).

use super::splice::{splice_whole, Chunk, StreamSplice};
use super::{parse_body, Counter, Ctx, Effect, Env, Flow, Outcome, ResponseHead, Step, Unexpected};
use crate::canonical;
use crate::fingerprint;
use crate::policy::QuoteExpiry;
use crate::reply::{Reply, ReplyContext, ReplyKind};
use serde_json::Value;

pub const FINGERPRINT_EXPIRES_HEADER: &str = "agent-fingerprint-expires-at";

#[derive(Debug)]
pub struct Preview {
    ctx: Ctx,
    subject_hash: String,
    /// The request's bound values outside its body.
    outside: canonical::Outside,
    phase: Phase,
    /// While streaming: whether the chunk the host reads next ends the stream.
    chunk_ends_stream: bool,
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
    /// Minted into the headers; the held body gets it too once complete.
    Minted {
        token: String,
        exp: u64,
    },
    /// Minted into the headers, which went on with the grown length; the body streams.
    Streaming(StreamSplice),
    /// No fingerprint for this answer (its quote is unusable): the held answer becomes this reply
    /// once it is whole (a body can be replaced only from a body callback).
    Refusing(Reply),
    Finished,
}

impl Preview {
    pub(super) fn new(ctx: Ctx, subject_hash: String, outside: canonical::Outside) -> Preview {
        Preview { ctx, subject_hash, outside, phase: Phase::AwaitBody, chunk_ends_stream: false }
    }

    /// Forwarded, its answer not yet seen.
    pub(super) fn forwarded(&self) -> bool {
        matches!(self.phase, Phase::Forwarded { .. })
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
        match canonical::request_hash(&json, &self.outside, &self.ctx.policy.bound) {
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
            Some(QuoteExpiry::Header(name)) => Some(quote_header(head, name)),
            Some(QuoteExpiry::Pointer(_)) if end_of_stream => Some(Err("the answer has no body to state it in")),
            Some(QuoteExpiry::Pointer(_)) => {
                // The validity is in the body: hold the answer until it is read.
                self.phase = Phase::AwaitQuote { param_hash };
                return Step::pause().with(Effect::RemoveResponseHeader("content-length"));
            }
        };
        let (mut step, token, exp) = match self.mint(&param_hash, quote, env) {
            Ok(minted) => minted,
            Err(Refusal::Pass(step)) => return self.finish(step),
            // The answer's headers are in hand, its body is not: a reply replaces it now where
            // it has no body, else once the body is whole. Nothing of it reaches the agent.
            Err(Refusal::Replace(reply)) if end_of_stream => {
                return self.finish(Step::pause().with(Effect::Reply(reply)))
            }
            Err(Refusal::Replace(reply)) => {
                self.phase = Phase::Refusing(reply);
                return Step::pause().with(Effect::RemoveResponseHeader("content-length"));
            }
        };
        if end_of_stream {
            return self.finish(step);
        }
        match self.answer_form(head) {
            AnswerForm::Stream(total) => {
                // The fields go in as the body streams: the length they add is known now.
                let splice = StreamSplice::new(&token, exp, total);
                let grown = total.saturating_add(splice.added() as u64);
                self.phase = Phase::Streaming(splice);
                step.then(Step::go_on().with(Effect::SetResponseHeader("content-length".into(), grown.to_string())))
            }
            // Encoded bytes cannot be spliced: the fingerprint is in the header, the body goes on as sent.
            AnswerForm::Untouched => self.finish(step),
            AnswerForm::Hold => {
                self.phase = Phase::Minted { token, exp };
                // The body grows: its old length is wrong.
                step.effects.push(Effect::RemoveResponseHeader("content-length"));
                step.flow = Flow::Pause;
                step
            }
        }
    }

    /// How the answer's body gets the fingerprint: streamed when the splice can prove its
    /// result (a JSON object of known length, sent as is), held when it cannot.
    fn answer_form(&self, head: &ResponseHead) -> AnswerForm {
        if head.content_encoding.as_deref().is_some_and(|e| !e.trim().eq_ignore_ascii_case("identity")) {
            return AnswerForm::Untouched;
        }
        let plain_json = head.content_type.as_deref().is_some_and(is_json_media_type);
        match head.content_length {
            Some(total) if total > 0 && plain_json && !self.ctx.policy.answers_named_fingerprint.get() => {
                AnswerForm::Stream(total)
            }
            _ => AnswerForm::Hold,
        }
    }

    /// Mint, with `exp = min(now + ttl, the quote's expiry)` where the route states one
    /// (`quote`: `None` without `quote_expires`; `Some(Err(why))` when the answer's is not one
    /// usable value). `Err` says how to end: no randomness (the answer passes without a
    /// fingerprint), or no usable quote expiry (the answer is replaced by this reply: nothing
    /// must be confirmable from it).
    fn mint(
        &self,
        param_hash: &str,
        quote: Option<Result<u64, &'static str>>,
        env: &mut dyn Env,
    ) -> Result<(Step, String, u64), Refusal> {
        let policy = &self.ctx.policy;
        let now = env.now_s();
        let mut exp = now.saturating_add(policy.fingerprint_ttl_s);
        let unusable = match quote {
            None => None,
            Some(Ok(q)) if q > now => {
                exp = exp.min(q);
                None
            }
            Some(Ok(_)) => Some("the quote's expiry is past"),
            Some(Err(why)) => Some(why),
        };
        if let Some(why) = unusable {
            let ctx = ReplyContext { detail: Some(why), ..Default::default() };
            return Err(Refusal::Replace(self.ctx.render(ReplyKind::QuoteUnusable, ctx)));
        }
        let Some(nonce) = env.random16() else {
            let warn = Effect::Warn("no randomness for a nonce; preview passes without a fingerprint".into());
            return Err(Refusal::Pass(Step::go_on().with(warn)));
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
            (Phase::Minted { .. } | Phase::AwaitQuote { .. } | Phase::Refusing(_), false) => Step::pause(),
            (Phase::Minted { .. } | Phase::AwaitQuote { .. } | Phase::Refusing(_), true) => Step::need_body(),
            // Every chunk is read: the last one's splice depends on all of them.
            (Phase::Streaming(_), eos) => {
                self.chunk_ends_stream = eos;
                Step::need_body()
            }
            _ => Step::go_on(),
        }
    }

    /// The held body at its end, or, while streaming, the chunk in hand.
    pub(super) fn on_response_body(&mut self, body: &[u8], env: &mut dyn Env) -> Outcome {
        if let Phase::Streaming(splice) = &mut self.phase {
            let (body, spliced) = match splice.chunk(body, self.chunk_ends_stream) {
                Chunk::Pass => return Ok(Step::go_on()),
                // A closing brace held back (or given back): the chunk goes on as these bytes.
                Chunk::Replace(bytes) => return Ok(Step::go_on().with(Effect::ReplaceResponseBody(bytes))),
                Chunk::Last { body, spliced } => (body, spliced),
            };
            let mut step = Step::go_on().with(Effect::ReplaceResponseBody(body));
            if splice.refused() {
                // Part of it went on before its own fingerprint field showed: the rest became
                // spaces, so the upstream's value never reached the agent (DESIGN §6).
                self.ctx.policy.answers_named_fingerprint.set(true);
                let why = "the preview's answer wrote a fingerprint field of its own after part of it had gone on: \
                           the rest was blanked (the agent gets no usable answer and previews again), and this \
                           route's answers are held (and the field replaced) from now on";
                step = step.with(Effect::Warn(why.into()));
            } else if splice.self_named() {
                self.ctx.policy.answers_named_fingerprint.set(true);
                let why = "the preview's answer wrote a fingerprint field of its own: replaced by the gateway's, \
                           and this route's answers are held from now on";
                step = step.with(Effect::Warn(why.into()));
            } else if splice.named() {
                // Seen once, held from now on: the held splice replaces such a field.
                self.ctx.policy.answers_named_fingerprint.set(true);
                let why = "the preview's answer may name a fingerprint field: this one has the fingerprint in the \
                           agent-fingerprint header only, and this route's answers are held (and the field replaced) from now on";
                step = step.with(Effect::Warn(why.into()));
            } else if !spliced {
                let why = "the preview's answer is not one JSON object: the fingerprint is in the agent-fingerprint header only";
                step = step.with(Effect::Warn(why.into()));
            }
            return Ok(self.finish(step));
        }
        if let Phase::Refusing(reply) = &self.phase {
            let rewrite = Effect::Rewrite(reply.clone());
            return Ok(self.finish(Step::go_on().with(rewrite)));
        }
        let mut first = Step::go_on();
        if let Phase::AwaitQuote { param_hash } = &self.phase {
            let stated = match &self.ctx.policy.quote_expires {
                Some(QuoteExpiry::Pointer(p)) => canonical::parse_json_body(body, self.ctx.config.max_response_bytes)
                    .ok()
                    .and_then(|v| v.pointer(p).and_then(QuoteExpiry::read)),
                _ => None,
            };
            let stated = stated.ok_or("the quote's expiry is missing or unreadable");
            let param_hash = param_hash.clone();
            match self.mint(&param_hash, Some(stated), env) {
                Ok((step, token, exp)) => {
                    first = step;
                    self.phase = Phase::Minted { token, exp };
                }
                Err(Refusal::Pass(step)) => return Ok(self.finish(step)),
                Err(Refusal::Replace(reply)) => return Ok(self.finish(Step::go_on().with(Effect::Rewrite(reply)))),
            }
        }
        let Phase::Minted { token, exp } = &self.phase else {
            return Err(Unexpected { event: "response_body", phase: self.phase_name() });
        };
        let step = match splice_whole(body, token, *exp, self.ctx.config.max_response_bytes) {
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
            Phase::Streaming(_) => "preview.streaming",
            Phase::Refusing(_) => "preview.refusing",
            Phase::Finished => "preview.finished",
        }
    }
}

/// Why a preview's answer gets no fingerprint.
enum Refusal {
    /// It passes as the upstream sent it (no randomness: nothing to mint with).
    Pass(Step),
    /// It is replaced by this reply (no usable quote: nothing may be confirmable from it).
    Replace(Reply),
}

/// The quote's expiry from the answer's header `name` (DESIGN §3): exactly one copy, text, and a
/// time. Two copies are refused, never one picked (DESIGN §6): `+600 s` beside `+2 s` cannot say
/// which quote the upstream will honour.
fn quote_header(head: &ResponseHead, name: &str) -> Result<u64, &'static str> {
    match head.values(name).ok_or("the quote's expiry header is not text")?.as_slice() {
        [] => Err("the quote's expiry header is missing"),
        [one] => QuoteExpiry::read(&Value::String(one.trim().to_string())).ok_or("the quote's expiry is unreadable"),
        _ => Err("the quote's expiry header came more than once"),
    }
}

enum AnswerForm {
    /// The upstream's `Content-Length`.
    Stream(u64),
    Hold,
    Untouched,
}

/// `application/json` or a `+json` type (RFC 6839), parameters aside: one JSON text. Other types
/// that mention JSON (`application/x-ndjson`, `json-seq`) are held, where only a whole object is
/// spliced.
fn is_json_media_type(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or_default().trim();
    essence.eq_ignore_ascii_case("application/json")
        || essence.len() > 5 && essence.get(essence.len() - 5..).is_some_and(|s| s.eq_ignore_ascii_case("+json"))
}
