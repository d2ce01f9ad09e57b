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
//! - every gateway answer is a JSON-RPC response with the request's `id`, valid
//!   against the tool's `outputSchema` (DESIGN §7, §11): a replay is the
//!   recorded result itself (its `structuredContent` is the tool's own) with
//!   the §7 envelope in words, in an embedded JSON resource and in `_meta`; an answer that carries no
//!   result is `isError: true` with the envelope in text and `_meta`; a status
//!   tool's reports are results whose `structuredContent` is the envelope.
//!   Only a batch or a malformed message gets a JSON-RPC error.
//!
//! Every request with a body is read before anything is forwarded: the
//! `Mcp-Method`/`Mcp-Name` headers are a claim the body can contradict, so they
//! must agree with it (else JSON-RPC `-32020`, HTTP 400) and never decide
//! alone. `tools/call` of unlisted tools and every other method then pass
//! through untouched.

use super::{Ctx, Effect, Env, Flow, Machine, Outcome, RequestHead, ResponseHead, Step, Unexpected};
use crate::policy::Role;
use crate::reply::{Facts, Reply};
use crate::strict_json;
use serde_json::{json, Map, Value};
use std::rc::Rc;

pub const MCP_METHOD_HEADER: &str = "mcp-method";
pub const MCP_NAME_HEADER: &str = "mcp-name";
/// Where a gateway answer's §7 envelope rides in a tool result's `_meta` (MCP's
/// `prefix/name` form for keys of an extension's own).
pub const META_KEY: &str = "agent-idempotency/reply";
/// The embedded resource a replay carries its envelope in (`tool_result`).
pub const REPLY_URI: &str = "agent-idempotency://reply";
/// The property of a replay's `structuredContent` that carries its envelope, which the gateway
/// declares (optional) in every guarded confirm tool's `outputSchema` as `tools/list` passes.
pub const REPLAY_PROPERTY: &str = "agent_idempotency";
/// JSON-RPC error of MCP 2026-07-28 for a request whose `Mcp-*` headers and body disagree.
pub const HEADER_MISMATCH: i64 = -32020;

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
        held: Option<Box<ResponseHead>>,
        framing: Framing,
        message: Value,
    },
    /// `tools/list` on a route with a guarded confirm tool: the answer is held whole, and each
    /// such tool's `outputSchema` declares [`REPLAY_PROPERTY`] before the client caches it.
    List {
        /// Set once the answer's head is held: how the answer is framed.
        held: Option<Framing>,
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
    /// `None` only for a request without a body that is not a POST (the event stream a GET
    /// opens, a DELETE ending a session): nothing else can carry a JSON-RPC message. Whatever
    /// its method or headers, a request with a body is read and judged by its body.
    pub(super) fn start(ctx: Ctx, head: &RequestHead, end_of_stream: bool) -> Option<Mcp> {
        if end_of_stream && !head.method.eq_ignore_ascii_case("POST") {
            return None;
        }
        Some(Mcp { ctx, head: head.clone(), phase: Phase::AwaitBody })
    }

    pub(super) fn finished(&self) -> bool {
        match &self.phase {
            Phase::Finished => true,
            // The tool's machine is done and nothing is held: the rest passes.
            Phase::Tool { inner, held, .. } => matches!(**inner, Machine::Pass) && held.is_none(),
            Phase::AwaitBody | Phase::List { .. } => false,
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
        let method = message.get("method").and_then(Value::as_str);
        let params = message.get("params").and_then(Value::as_object);
        if let Some(refusal) = self.headers_disagree(&id, method, params) {
            return Ok(self.finish(refusal));
        }
        let Some(method) = method else {
            // No method: a client's answer to a request of the server's (sampling, elicitation).
            return Ok(self.finish(Step::go_on()));
        };
        if method == "tools/list" && self.guards_results() {
            // Its answer is rewritten: ask for it unencoded, so it can be read.
            self.phase = Phase::List { held: None };
            return Ok(Step::go_on().with(Effect::RemoveRequestHeader("accept-encoding")));
        }
        if method != "tools/call" {
            if spelled_like(method, "tools/call") {
                // A server may be lenient where the gateway is exact: never let one through unjudged.
                return Ok(self.finish(rpc_error(
                    id,
                    -32601,
                    &format!("unknown method {method:?}: send exactly \"tools/call\""),
                )));
            }
            return Ok(self.finish(Step::go_on()));
        }
        let Some(params) = params else {
            return Ok(self.finish(rpc_error(id, -32602, "tools/call needs params with a name and arguments")));
        };
        let Some(name) = params.get("name").and_then(Value::as_str) else {
            return Ok(self.finish(rpc_error(id, -32602, "tools/call needs params.name")));
        };
        let Some(policy) = self.ctx.policy.tool(name).cloned() else {
            let listed = self.ctx.policy.tool_names().find(|t| spelled_like(name, t)).map(str::to_owned);
            if let Some(listed) = listed {
                let msg = format!("unknown tool {name:?}: the guarded tool is named {listed:?}");
                return Ok(self.finish(rpc_error(id, -32602, &msg)));
            }
            return Ok(self.finish(Step::go_on()));
        };
        if !matches!(message.get("id"), Some(Value::String(_))) && !message.get("id").is_some_and(Value::is_i64) {
            return Ok(self.finish(rpc_error(
                Value::Null,
                -32600,
                "a guarded tools/call must be a request with a string or integer id",
            )));
        }
        if params.contains_key("task") {
            // A task-augmented call answers with a task handle, not the result: nothing to record.
            return Ok(self.finish(rpc_error(
                id,
                -32602,
                "a guarded tool cannot be called as a task: call it without params.task",
            )));
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

    pub(super) fn live_lease(&self) -> Option<crate::protocol::LeaseRenewal> {
        match &self.phase {
            Phase::Tool { inner, .. } => inner.live_lease(),
            _ => None,
        }
    }

    pub(super) fn response_needs_headers(&self) -> bool {
        matches!(&self.phase, Phase::Tool { inner, .. } if inner.response_needs_headers())
    }

    /// Hold the upstream's head while its tool machine waits for the answer.
    pub(super) fn on_response_head(&mut self, head: &ResponseHead, end_of_stream: bool, env: &mut dyn Env) -> Outcome {
        if let Phase::List { held } = &mut self.phase {
            let media = head.content_type.as_deref().map(str::to_ascii_lowercase).unwrap_or_default();
            let framing = if media.contains("text/event-stream") {
                Framing::EventStream
            } else if media.contains("application/json") {
                Framing::Json
            } else {
                return Ok(self.finish(Step::go_on()));
            };
            if end_of_stream || !(200..300).contains(&head.status) {
                return Ok(self.finish(Step::go_on()));
            }
            *held = Some(framing);
            // The listing grows: its old length is wrong (the new one is set with the body).
            return Ok(Step::pause().with(Effect::RemoveResponseHeader("content-length")));
        }
        let Phase::Tool { inner, held, .. } = &mut self.phase else { return Ok(Step::go_on()) };
        if matches!(**inner, Machine::Pass) {
            return Ok(Step::go_on());
        }
        *held = Some(Box::new(head.clone()));
        if end_of_stream {
            return self.on_response_body(&[], env);
        }
        Ok(Step::pause().with(Effect::RemoveResponseHeader("content-length")))
    }

    pub(super) fn on_response_data(&mut self, end_of_stream: bool) -> Step {
        match &self.phase {
            Phase::Tool { held: Some(_), .. } | Phase::List { held: Some(_) } if end_of_stream => {
                Step { effects: Vec::new(), flow: Flow::NeedBody }
            }
            Phase::Tool { held: Some(_), .. } | Phase::List { held: Some(_) } => Step::pause(),
            _ => Step::go_on(),
        }
    }

    /// The whole answer: read the JSON-RPC message, then run the tool machine's
    /// response events with the message's verdict and payload.
    pub(super) fn on_response_body(&mut self, body: &[u8], env: &mut dyn Env) -> Outcome {
        if let Phase::List { held: Some(framing) } = self.phase {
            let step = self.declare_replay_property(body, framing);
            return Ok(self.finish(step));
        }
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
            not_text: real.not_text.clone(),
            // No length: the tool's answer is held (its JSON-RPC framing is rebuilt around it).
            ..ResponseHead::default()
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

    /// Whether a tool of this route replays recorded results (confirm, idempotent).
    fn guards_results(&self) -> bool {
        self.ctx.policy.tool_names().any(|name| self.replays(name))
    }

    fn replays(&self, name: &str) -> bool {
        self.ctx.policy.tool(name).is_some_and(|p| matches!(p.role, Role::Confirm | Role::Idempotent))
    }

    /// The `tools/list` answer with [`REPLAY_PROPERTY`] declared in each guarded confirm tool's
    /// `outputSchema` (DESIGN §11): a replay's `structuredContent` carries the envelope there, and
    /// a client validates it against the schema it cached from this listing, strict or not. An
    /// answer that is not a listing (an error, bytes that do not parse) goes on as sent.
    fn declare_replay_property(&self, body: &[u8], framing: Framing) -> Step {
        let content_type = match framing {
            Framing::Json => "application/json",
            Framing::EventStream => "text/event-stream",
        };
        let (_, message) = read_message(body, Some(content_type));
        let Some(mut message) = message else {
            let why = "an MCP tools/list answer is not a JSON-RPC message: passed as sent, so a replay's \
                       agent_idempotency property may fail a strict outputSchema the client cached from it";
            return Step::go_on()
                .with(Effect::SetResponseHeader("content-length".into(), body.len().to_string()))
                .with(Effect::Warn(why.into()));
        };
        let description = crate::reply::replay_property_description(self.ctx.config.language);
        let mut changed = false;
        let tools = message.pointer_mut("/result/tools").and_then(Value::as_array_mut);
        for tool in tools.into_iter().flatten() {
            let guarded = tool.get("name").and_then(Value::as_str).is_some_and(|n| self.replays(n));
            let Some(schema) = tool.get_mut("outputSchema").and_then(Value::as_object_mut).filter(|_| guarded) else {
                continue;
            };
            let properties = schema.entry("properties").or_insert_with(|| json!({}));
            if let Some(properties) = properties.as_object_mut() {
                // A tool that declares the name itself keeps its own (and its replays keep its value).
                if !properties.contains_key(REPLAY_PROPERTY) {
                    properties.insert(REPLAY_PROPERTY.into(), json!({"type": "object", "description": description}));
                    changed = true;
                }
            }
        }
        if !changed {
            return Step::go_on().with(Effect::SetResponseHeader("content-length".into(), body.len().to_string()));
        }
        let out = frame(&message, framing);
        Step::go_on()
            .with(Effect::SetResponseHeader("content-length".into(), out.len().to_string()))
            .with(Effect::ReplaceResponseBody(out))
    }

    /// The `Mcp-Method`/`Mcp-Name` headers, where sent, must say what the body says (MCP
    /// 2026-07-28): the gateway is a party that could route on them, so a disagreement is
    /// refused here, never left to the server.
    fn headers_disagree(&self, id: &Value, method: Option<&str>, params: Option<&Map<String, Value>>) -> Option<Step> {
        if let Some(claimed) = self.head.mcp_method.as_deref() {
            if Some(claimed.trim()) != method {
                let msg = format!(
                    "the Mcp-Method header ({claimed:?}) does not match the body's method ({}): nothing was forwarded",
                    method.map_or_else(|| "none".to_string(), |m| format!("{m:?}"))
                );
                return Some(rpc_error(id.clone(), HEADER_MISMATCH, &msg));
            }
        }
        if let Some(claimed) = self.head.mcp_name.as_deref() {
            // What Mcp-Name mirrors: a tool's or prompt's name, a resource's URI.
            let named = params.and_then(|p| p.get("name").or_else(|| p.get("uri"))).and_then(Value::as_str);
            if Some(claimed.trim()) != named {
                let msg = format!(
                    "the Mcp-Name header ({claimed:?}) does not match the body ({}): nothing was forwarded",
                    named.map_or_else(|| "no name".to_string(), |n| format!("{n:?}"))
                );
                return Some(rpc_error(id.clone(), HEADER_MISMATCH, &msg));
            }
        }
        None
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
                Effect::Reply(r) => Effect::Reply(tool_reply(id, &r, *role)),
                Effect::Rewrite(r) => Effect::Rewrite(tool_reply(id, &r, *role)),
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

/// A gateway answer as a JSON-RPC response to `tools/call`, valid against the tool's
/// `outputSchema` (DESIGN §11): the official SDKs reject a non-error result whose
/// `structuredContent` does not conform, and today's TypeScript SDK checks it on errors too.
/// - a replay of the confirm tool is the recorded result (its `structuredContent` is the tool's
///   own), plus the gateway's words in a text block and the envelope in `_meta`; a recorded
///   failure keeps `isError` and drops `structuredContent` (it rides in the envelope's `result`);
/// - a status tool's reports are results whose `structuredContent` is the envelope (a status
///   tool the gateway answers declares the envelope as its output);
/// - everything else carries no result: `isError: true`, the envelope in text and `_meta`.
fn tool_reply(id: &Value, r: &Reply, role: Role) -> Reply {
    let result = match &r.facts {
        // The recorded result as it was (`replay: original`): the JSON-RPC result itself.
        None => serde_json::from_slice::<Value>(&r.body).ok().filter(Value::is_object).unwrap_or_else(
            || json!({"content": [{"type": "text", "text": String::from_utf8_lossy(&r.body)}], "isError": true}),
        ),
        Some(facts) => tool_result(facts, role),
    };
    let body = json!({"jsonrpc": "2.0", "id": id, "result": result});
    Reply::raw(
        200,
        vec![
            ("content-type".to_string(), "application/json".to_string()),
            ("cache-control".to_string(), "no-store".to_string()),
        ],
        body.to_string().into_bytes(),
    )
}

fn tool_result(facts: &Facts, role: Role) -> Value {
    let envelope = Value::Object(facts.envelope.clone());
    let said = |key: &str| facts.envelope.get(key).and_then(Value::as_str).unwrap_or_default();
    let words = json!({"type": "text", "text": format!("{} {}", said("meaning"), said("instruction"))});
    let meta = |mut result: Map<String, Value>| {
        let mut m = result.remove("_meta").and_then(|v| v.as_object().cloned()).unwrap_or_default();
        m.insert(META_KEY.into(), envelope.clone());
        result.insert("_meta".into(), Value::Object(m));
        // MCP 2026-07-28 requires it on every result (its SDKs refuse one without); older
        // clients ignore it. A replay recorded from an older call gets it too.
        result.entry("resultType").or_insert_with(|| "complete".into());
        Value::Object(result)
    };
    let recorded = facts.envelope.get("result").and_then(Value::as_object);
    match (facts.kind, role, recorded) {
        (kind, Role::Confirm | Role::Idempotent, Some(original)) if kind.is_replay() => {
            let mut result = original.clone();
            if result.get("isError").and_then(Value::as_bool).unwrap_or(false) {
                result.remove("structuredContent");
            } else if let Some(structured) = result.get_mut("structuredContent").and_then(Value::as_object_mut) {
                // For frameworks that hand the model `structuredContent` alone (the OpenAI Agents
                // SDK's `use_structured_content`): the envelope beside the original fields, under
                // the name `tools/list` declared optional in the tool's `outputSchema`, so a strict
                // schema still validates. Its `result` is the rest of this object: left out.
                if !structured.contains_key(REPLAY_PROPERTY) {
                    let mut said = facts.envelope.clone();
                    said.remove("result");
                    structured.insert(REPLAY_PROPERTY.into(), Value::Object(said));
                }
            }
            // The envelope as an embedded resource beside the words: a client that shows the model
            // only `structuredContent` while every block is text (pydantic-ai, and others mapping
            // "the JSON-encoded structured content" blocks) maps the content instead once one block
            // is not text, so the model reads the original result AND that this call ran nothing.
            // `structuredContent` stays the tool's own: a strict `outputSchema` still validates.
            let resource = json!({"type": "resource", "resource": {
                "uri": REPLY_URI, "mimeType": "application/json", "text": envelope.to_string(),
            }});
            match result.get_mut("content").and_then(Value::as_array_mut) {
                Some(content) => content.extend([words, resource]),
                None => {
                    result.insert("content".into(), json!([words, resource]));
                }
            }
            meta(result)
        }
        (kind, Role::Status, _) if kind.is_report() => {
            let text = json!({"type": "text", "text": envelope.to_string()});
            let mut result = Map::new();
            result.insert("content".into(), json!([words, text]));
            result.insert("structuredContent".into(), envelope.clone());
            result.insert("isError".into(), false.into());
            meta(result)
        }
        _ => {
            let text = json!({"type": "text", "text": envelope.to_string()});
            let mut result = Map::new();
            result.insert("content".into(), json!([words, text]));
            result.insert("isError".into(), true.into());
            meta(result)
        }
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
    let headers = vec![("content-type".to_string(), "application/json".to_string())];
    Step::pause().with(Effect::Reply(Reply::raw(400, headers, body.to_string().into_bytes())))
}

/// A header the guard reads came twice on an MCP route: a JSON-RPC error before the body is
/// read (so without the request's id).
pub(super) fn repeated_header(name: &str) -> Step {
    let code = if name.starts_with("mcp-") { HEADER_MISMATCH } else { -32600 };
    let message = format!(
        "the {name} header was sent more than once (`_` for `-` counts as another copy): nothing was forwarded"
    );
    rpc_error(Value::Null, code, &message)
}

/// A header the guard reads is not text (not UTF-8): refused as a repeated one is.
pub(super) fn header_not_text(name: &str) -> Step {
    let code = if name.starts_with("mcp-") { HEADER_MISMATCH } else { -32600 };
    let message = format!("the {name} header is not text (its value is not UTF-8): nothing was forwarded");
    rpc_error(Value::Null, code, &message)
}

/// `name` is not `wanted` but would be read as it by a lenient server: other case, spaces
/// around it, or control characters in it.
fn spelled_like(name: &str, wanted: &str) -> bool {
    let folded: String = name.chars().filter(|c| !c.is_control() && !c.is_whitespace()).collect();
    name != wanted && folded.eq_ignore_ascii_case(wanted)
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
    frame(&message, framing)
}

/// A JSON-RPC message in the upstream's framing (an event stream keeps only its one message).
fn frame(message: &Value, framing: Framing) -> Vec<u8> {
    let text = serde_json::to_string(message).unwrap_or_default();
    match framing {
        Framing::Json => text.into_bytes(),
        Framing::EventStream => format!("data: {text}\n\n").into_bytes(),
    }
}
