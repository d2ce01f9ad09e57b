//! MCP mode: `tools/call` over Streamable HTTP through the same guard.
//!
//! An MCP route lists its tools, each with a role (preview, confirm, status)
//! whose bound fields point into `params.arguments`. This machine unwraps the
//! JSON-RPC envelope, runs the tool's own machine on the arguments (the
//! fingerprint travels as `arguments.fingerprint`), and wraps what comes back:
//!
//! - the upstream's answer (JSON, or one `data:` event of `text/event-stream`)
//!   is read whole before anything is decided, because an SSE answer's status
//!   line goes out before the tool runs; the tool's verdict is the JSON-RPC
//!   message: a result is DONE, `isError` FAILED, a request error before the
//!   tool ran FAILED, any other error unknown;
//! - what is recorded is the JSON-RPC `result`, replayed with the retry's `id`;
//! - every gateway answer is a JSON-RPC response with the request's `id`: a
//!   normal tool result whose `structuredContent` is the DESIGN §7 envelope,
//!   with `isError: true` for refusals, so the model can correct itself; only
//!   a batch or a malformed envelope gets a JSON-RPC error.
//!
//! `tools/call` of unlisted tools, every other method and notifications pass
//! through untouched; the `Mcp-Method`/`Mcp-Name` headers, when present, decide
//! that before the body is read.

use super::{Ctx, Effect, Env, Flow, Machine, Outcome, RequestHead, ResponseHead, Step, Unexpected};
use crate::policy::Role;
use crate::reply::Reply;
use crate::strict_json;
use serde_json::{json, Map, Value};
use std::rc::Rc;

pub const MCP_METHOD_HEADER: &str = "mcp-method";
pub const MCP_NAME_HEADER: &str = "mcp-name";

#[derive(Debug)]
pub struct Mcp {
    ctx: Ctx,
    head: RequestHead,
    phase: Phase,
}

#[derive(Debug)]
enum Phase {
    AwaitBody,
    /// A guarded tool's call: its machine, the request's id, and the upstream
    /// head held until the answer is complete.
    Tool {
        id: Value,
        role: Role,
        inner: Box<Machine>,
        held: Option<ResponseHead>,
        framing: Framing,
        message: Value,
    },
    Finished,
}

/// How the upstream framed its answer; a rewritten answer keeps it where it can.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Json,
    EventStream,
}

impl Mcp {
    /// `None` when the headers already say it is not a guarded `tools/call`.
    pub(super) fn start(ctx: Ctx, head: &RequestHead) -> Option<Mcp> {
        if !head.method.eq_ignore_ascii_case("POST") {
            return None;
        }
        if head.mcp_method.as_deref().is_some_and(|m| m != "tools/call") {
            return None;
        }
        if head.mcp_name.as_deref().is_some_and(|n| ctx.policy.tool(n).is_none()) {
            return None;
        }
        Some(Mcp { ctx, head: head.clone(), phase: Phase::AwaitBody })
    }

    pub(super) fn finished(&self) -> bool {
        match &self.phase {
            Phase::Finished => true,
            // The tool's machine is done and nothing is held: the rest passes.
            Phase::Tool { inner, held, .. } => matches!(**inner, Machine::Pass) && held.is_none(),
            Phase::AwaitBody => false,
        }
    }

    pub(super) fn body_limit(&self) -> Option<(&Ctx, usize)> {
        matches!(self.phase, Phase::AwaitBody).then_some((&self.ctx, self.ctx.config.max_body_bytes))
    }

    pub(super) fn on_request_body(&mut self, body: &[u8], env: &mut dyn Env) -> Outcome {
        if !matches!(self.phase, Phase::AwaitBody) {
            return Err(Unexpected { event: "request_body", phase: "mcp.tool" });
        }
        let message = match strict_json::from_slice(body) {
            Ok(Value::Object(m)) => m,
            Ok(Value::Array(_)) => {
                return Ok(self.finish(rpc_error(
                    Value::Null,
                    -32600,
                    "JSON-RPC batches are not accepted on a guarded MCP endpoint: send one request per POST",
                )))
            }
            Ok(_) | Err(_) => {
                return Ok(self.finish(rpc_error(Value::Null, -32700, "the body is not one JSON-RPC request object")))
            }
        };
        let id = message.get("id").cloned().unwrap_or(Value::Null);
        if message.get("method").and_then(Value::as_str) != Some("tools/call") {
            return Ok(self.finish(Step::go_on()));
        }
        let Some(params) = message.get("params").and_then(Value::as_object) else {
            return Ok(self.finish(rpc_error(id, -32602, "tools/call needs params with a name and arguments")));
        };
        let Some(name) = params.get("name").and_then(Value::as_str) else {
            return Ok(self.finish(rpc_error(id, -32602, "tools/call needs params.name")));
        };
        if self.head.mcp_name.as_deref().is_some_and(|n| n != name) {
            return Ok(self.finish(rpc_error(id, -32602, "the Mcp-Name header and params.name differ")));
        }
        let Some(policy) = self.ctx.policy.tool(name).cloned() else { return Ok(self.finish(Step::go_on())) };
        if message.get("id").is_none() {
            return Ok(self.finish(rpc_error(Value::Null, -32600, "a guarded tools/call must have an id")));
        }
        let arguments = match params.get("arguments") {
            None => Value::Object(Map::new()),
            Some(Value::Object(a)) => Value::Object(a.clone()),
            Some(_) => return Ok(self.finish(rpc_error(id, -32602, "params.arguments must be an object"))),
        };
        let role = policy.role;
        let ctx = Ctx { config: Rc::clone(&self.ctx.config), policy, trace_id: self.ctx.trace_id.clone() };
        let head = RequestHead { fingerprint: None, idempotency_key: None, ..self.head.clone() };
        let (mut inner, first) = Machine::start(ctx, &head, false, env);
        // The tool machine reads the arguments as its request body.
        let bytes = serde_json::to_vec(&arguments).unwrap_or_default();
        let next = match inner {
            Machine::Pass => Step::pause(),
            _ => inner.on_request_body(&bytes, env).unwrap_or_else(|e| Step::go_on().with(Effect::Warn(e.to_string()))),
        };
        let step = first.then(next);
        self.phase =
            Phase::Tool { id, role, inner: Box::new(inner), held: None, framing: Framing::Json, message: Value::Null };
        Ok(self.translate(step))
    }

    pub(super) fn on_callout(&mut self, answer: &super::CalloutAnswer, env: &mut dyn Env) -> Outcome {
        let Phase::Tool { inner, .. } = &mut self.phase else {
            return Err(Unexpected { event: "callout", phase: "mcp.await_body" });
        };
        let step = inner.on_callout(answer, env)?;
        Ok(self.translate(step))
    }

    pub(super) fn response_needs_headers(&self) -> bool {
        matches!(&self.phase, Phase::Tool { inner, .. } if inner.response_needs_headers())
    }

    /// Hold the upstream's head while its tool machine waits for the answer.
    pub(super) fn on_response_head(&mut self, head: &ResponseHead, end_of_stream: bool, env: &mut dyn Env) -> Outcome {
        let Phase::Tool { inner, held, .. } = &mut self.phase else { return Ok(Step::go_on()) };
        if matches!(**inner, Machine::Pass) {
            return Ok(Step::go_on());
        }
        *held = Some(head.clone());
        if end_of_stream {
            return self.on_response_body(&[], env);
        }
        Ok(Step::pause().with(Effect::RemoveResponseHeader("content-length")))
    }

    pub(super) fn on_response_data(&mut self, end_of_stream: bool) -> Step {
        match &self.phase {
            Phase::Tool { held: Some(_), .. } if end_of_stream => Step { effects: Vec::new(), flow: Flow::NeedBody },
            Phase::Tool { held: Some(_), .. } => Step::pause(),
            _ => Step::go_on(),
        }
    }

    /// The whole answer: read the JSON-RPC message, then run the tool machine's
    /// response events with the message's verdict and payload.
    pub(super) fn on_response_body(&mut self, body: &[u8], env: &mut dyn Env) -> Outcome {
        let Phase::Tool { inner, held, framing, message, role, .. } = &mut self.phase else {
            return Err(Unexpected { event: "response_body", phase: "mcp.await_body" });
        };
        let Some(real) = held.take() else { return Ok(Step::go_on()) };
        let (frame, parsed) = read_message(body, real.content_type.as_deref());
        *framing = frame;
        *message = parsed.clone().unwrap_or(Value::Null);
        let (status, payload) = verdict(real.status, parsed.as_ref(), *role);
        let synthetic = ResponseHead {
            status,
            content_type: Some("application/json".into()),
            code_details: real.code_details.clone(),
            attempts: real.attempts,
            headers: real.headers.clone(),
        };
        let size = payload.len();
        let mut step = inner.on_response_head(&synthetic, false, env)?;
        let data = inner.on_response_data(size, true)?;
        step = step.then(data.clone());
        if data.flow == Flow::NeedBody {
            step = step.then(inner.on_response_body(&payload, env)?);
        }
        Ok(self.translate(step))
    }

    fn finish(&mut self, step: Step) -> Step {
        self.phase = Phase::Finished;
        step
    }

    /// The tool machine's effects, in JSON-RPC terms.
    fn translate(&self, step: Step) -> Step {
        let Phase::Tool { id, role, framing, message, .. } = &self.phase else { return step };
        let mut out = Step { effects: Vec::with_capacity(step.effects.len()), flow: step.flow };
        // The tool machine sized its own body; the JSON-RPC message around it gets its own length.
        let sized = step.effects.iter().any(|e| matches!(e, Effect::SetResponseHeader(n, _) if n == "content-length"));
        for effect in step.effects {
            let translated = match effect {
                Effect::SetResponseHeader(name, _) if name == "content-length" => continue,
                Effect::Reply(r) => Effect::Reply(tool_reply(id, &r)),
                Effect::SetResponseHeader(name, _) if name == ":status" => {
                    Effect::SetResponseHeader(name, "200".into())
                }
                Effect::SetResponseHeader(name, _) if name == "content-type" => {
                    Effect::SetResponseHeader(name, "application/json".into())
                }
                Effect::ReplaceResponseBody(b) if *role == Role::Preview => {
                    let body = splice_preview(message, &b, *framing);
                    if sized {
                        out.effects.push(Effect::SetResponseHeader("content-length".into(), body.len().to_string()));
                    }
                    Effect::ReplaceResponseBody(body)
                }
                Effect::ReplaceResponseBody(b) => {
                    // A rewritten confirm answer (in_progress, not_executed): JSON, whatever the upstream framed.
                    let r = Reply { http_status: 200, headers: Vec::new(), body: b };
                    Effect::ReplaceResponseBody(tool_reply(id, &r).body)
                }
                other => other,
            };
            out.effects.push(translated);
        }
        out
    }
}

/// The JSON-RPC message of an answer, and how it was framed. An event stream
/// holds it in its last `data:` event with a JSON body (priming events are empty).
fn read_message(body: &[u8], content_type: Option<&str>) -> (Framing, Option<Value>) {
    if content_type.is_some_and(|c| c.contains("text/event-stream")) {
        let text = String::from_utf8_lossy(body);
        let mut last = None;
        for event in text.split("\n\n") {
            let data: Vec<&str> = event.lines().filter_map(|l| l.strip_prefix("data:")).map(str::trim_start).collect();
            let joined = data.join("\n");
            if let Ok(v @ Value::Object(_)) = serde_json::from_str::<Value>(&joined) {
                last = Some(v);
            }
        }
        return (Framing::EventStream, last);
    }
    (Framing::Json, serde_json::from_slice::<Value>(body).ok().filter(Value::is_object))
}

/// The tool's verdict as an HTTP status the confirm/preview machines already
/// classify (DESIGN §4), and what they record or splice: the `result`.
fn verdict(http: u16, message: Option<&Value>, role: Role) -> (u16, Vec<u8>) {
    // Not a JSON-RPC answer (a proxy's or the server's plain HTTP error): the HTTP status speaks.
    let message = message.filter(|m| m.get("jsonrpc").and_then(Value::as_str) == Some("2.0"));
    let Some(m) = message else {
        // No JSON-RPC answer at all: whatever the status says, nothing definite.
        return (if http >= 400 { http } else { 502 }, Vec::new());
    };
    if let Some(result) = m.get("result") {
        if !result.is_object() {
            // A tool result is an object; anything else is no definite answer (and mints nothing).
            return (502, serde_json::to_vec(result).unwrap_or_default());
        }
        let failed = result.get("isError").and_then(Value::as_bool).unwrap_or(false);
        let payload = match role {
            // The preview splices into what the model reads.
            Role::Preview => {
                result.get("structuredContent").cloned().filter(Value::is_object).unwrap_or_else(|| json!({}))
            }
            _ => result.clone(),
        };
        let status = if failed {
            422
        } else if (200..300).contains(&http) {
            200
        } else {
            http
        };
        return (status, serde_json::to_vec(&payload).unwrap_or_default());
    }
    let code = m.get("error").and_then(|e| e.get("code")).and_then(Value::as_i64).unwrap_or(-32603);
    let payload = serde_json::to_vec(m.get("error").unwrap_or(&Value::Null)).unwrap_or_default();
    // Refused before the tool ran (bad request, unknown method or params): definite.
    let status = if (-32602..=-32600).contains(&code) { 400 } else { 500 };
    (status, payload)
}

/// A gateway answer as a tool result: `structuredContent` is the §7 envelope,
/// a text block says what to do, `isError` marks refusals.
fn tool_reply(id: &Value, r: &Reply) -> Reply {
    let envelope: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
    let kind = envelope.get("status").and_then(Value::as_str).unwrap_or_default();
    // Reports are results; refusals, failures and "could not" are errors the model should act on.
    let is_error = !(matches!(kind, "already_completed" | "in_progress" | "needs_review")
        || (kind == "not_executed" && r.http_status == 200));
    let text =
        match (envelope.get("meaning").and_then(Value::as_str), envelope.get("instruction").and_then(Value::as_str)) {
            (Some(m), Some(i)) => format!("{m} {i}"),
            _ => String::from_utf8_lossy(&r.body).into_owned(),
        };
    let body = json!({
        "jsonrpc": "2.0",
        "id": id,
        "result": {
            "content": [{"type": "text", "text": text}],
            "structuredContent": envelope,
            "isError": is_error,
        }
    });
    Reply {
        http_status: 200,
        headers: vec![
            ("content-type".to_string(), "application/json".to_string()),
            ("cache-control".to_string(), "no-store".to_string()),
        ],
        body: body.to_string().into_bytes(),
    }
}

/// A request body over `max_body_bytes` on an MCP route: its id is unknown.
pub(super) fn too_large() -> Step {
    let mut step =
        rpc_error(Value::Null, -32600, "the request body is larger than the gateway accepts: nothing was executed");
    if let Some(Effect::Reply(r)) = step.effects.first_mut() {
        r.http_status = 413;
    }
    step
}

fn rpc_error(id: Value, code: i64, message: &str) -> Step {
    let body = json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}});
    let reply = Reply {
        http_status: 400,
        headers: vec![("content-type".to_string(), "application/json".to_string())],
        body: body.to_string().into_bytes(),
    };
    Step::pause().with(Effect::Reply(reply))
}

/// The preview's answer with the fingerprint where the model reads it:
/// `structuredContent.fingerprint` (+ `fingerprint_expires_at`) and a text line.
fn splice_preview(message: &Value, spliced_structured: &[u8], framing: Framing) -> Vec<u8> {
    let mut message = message.clone();
    let Ok(structured) = serde_json::from_slice::<Value>(spliced_structured) else {
        return serde_json::to_vec(&message).unwrap_or_default();
    };
    let fp = structured.get("fingerprint").and_then(Value::as_str).unwrap_or_default().to_string();
    let exp = structured.get("fingerprint_expires_at").cloned().unwrap_or(Value::Null);
    if let Some(result) = message.get_mut("result").and_then(Value::as_object_mut) {
        result.insert("structuredContent".into(), structured);
        let line = format!(
            "fingerprint: {fp} (valid until Unix time {exp}). To execute, pass it unchanged as the `fingerprint` argument of the confirm tool; never invent or edit one."
        );
        match result.get_mut("content").and_then(Value::as_array_mut) {
            Some(content) => content.push(json!({"type": "text", "text": line})),
            None => {
                result.insert("content".into(), json!([{"type": "text", "text": line}]));
            }
        }
    }
    let text = serde_json::to_string(&message).unwrap_or_default();
    match framing {
        Framing::Json => text.into_bytes(),
        Framing::EventStream => format!("data: {text}\n\n").into_bytes(),
    }
}
