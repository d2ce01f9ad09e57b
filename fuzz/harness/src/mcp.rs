//! The `mcp` target: the MCP machine (`core/src/machine/mcp.rs`) through its
//! public API, as the host drives it (`adapter/src/stream.rs`): `Machine::start`,
//! `on_request_data` + `on_request_body`, the sidecar's answers through
//! `on_callout`, then `on_response_head` / `on_response_data` /
//! `on_response_body` for a forwarded call.
//!
//! The route is the e2e one (`envoy/e2e.yaml`): a preview, a confirm and a
//! status tool, read with idem-core's own parsers. Each input runs twice:
//!
//! - raw ([`raw`]): the bytes are a request body, optionally preceded by a
//!   header line and followed by an upstream answer (see [`split_raw`]); the
//!   answer also goes to a fixed, valid preview and confirm call;
//! - structured ([`structured`]): `arbitrary` picks the tool, the id, the
//!   arguments, the fingerprint (valid, expired, tampered, foreign, garbage),
//!   the headers, the sidecar's answers and the upstream's answer and framing.
//!
//! What must hold: the request side either passes the request through
//! untouched or answers with one JSON-RPC 2.0 response carrying the request's
//! id; a confirm is forwarded exactly when its fingerprint verifies for these
//! arguments and this caller, with exactly one callout and no reply; on the
//! response side a confirm's answer is recorded (complete / release) or left
//! unknown, every rewritten answer is JSON-RPC with the request's id, and a
//! preview's rewritten answer carries a fingerprint that verifies.

use crate::json_gen::{self, Style};
use arbitrary::Unstructured;
use idem_core::canonical::{self, BodyError};
use idem_core::fingerprint::{self as fp, Claims, Expect};
use idem_core::machine::{
    CalloutAnswer, Ctx, Effect, Flow, Machine, RequestHead, ResponseHead, Step, FINGERPRINT_HEADER,
};
use idem_core::policy::{PluginConfig, Role, RoutePolicy};
use idem_core::protocol;
use idem_core::reply::Reply;
use idem_core::testing::{self, FixedEnv};
use serde_json::{json, Map, Value};
use std::rc::Rc;

/// Where a gateway answer's envelope rides in a tool result (DESIGN §11), spelled here, not imported.
const META_KEY: &str = "agent-idempotency/reply";

/// The tools table of `envoy/e2e.yaml`'s `/mcp` route.
pub const TOOLS: &str = r#"{"quote_transfer": {"role": "preview", "scope": "payments.transfer", "bind": "/amount:decimal, /currency, /payee_id"}, "execute_transfer": {"role": "confirm", "upstream_keys": "honoured", "scope": "payments.transfer", "bind": "/amount:decimal, /currency, /payee_id", "status_tool": "get_transfer_status", "result_ref": "/structuredContent/transfer_id"}, "get_transfer_status": {"role": "status", "scope": "payments.transfer", "status_tool": "get_transfer_status", "result_ref": "/structuredContent/transfer_id"}}"#;
pub const PREVIEW_TOOL: &str = "quote_transfer";
pub const CONFIRM_TOOL: &str = "execute_transfer";
pub const STATUS_TOOL: &str = "get_transfer_status";

/// Limits small enough for the fuzzer to cross (libFuzzer's inputs are a few KiB).
pub const MAX_BODY_BYTES: usize = 2048;
pub const MAX_RESPONSE_BYTES: usize = 1024;

/// The host's clock, the caller, and the owner idemd hands out.
pub const NOW: u64 = 1_800_000_000;
pub const SUBJECT: &str = "agent-7";
const OWNER: &str = "22222222222222222222222222222222";
const NONCE: [u8; 16] = [0x11; 16];

/// In a raw request body, these JSON strings are replaced by a fingerprint the
/// route's keyring mints for the body's tool and arguments (and [`SUBJECT`]):
/// valid for 300 s, and expired one second ago.
pub const PLACEHOLDER_VALID: &str = "\"@fp\"";
pub const PLACEHOLDER_EXPIRED: &str = "\"@old\"";

struct Setup {
    config: Rc<PluginConfig>,
    policy: Rc<RoutePolicy>,
}

thread_local! {
    static SETUP: Setup = setup();
}

fn setup() -> Setup {
    // "Z" is 0x5a: the same secret as the harness's `keyring("k1")`.
    let extra = format!(r#""max_body_bytes":{MAX_BODY_BYTES},"max_response_bytes":{MAX_RESPONSE_BYTES}"#);
    let config = match testing::plugin_config(&"Z".repeat(32), &extra) {
        Ok(c) => c,
        Err(e) => panic!("the fixed plugin configuration is valid: {e}"),
    };
    let policy = match testing::route(&[("role", "mcp"), ("tools", TOOLS)]) {
        Ok(p) => p,
        Err(e) => panic!("the fixed MCP route is valid: {e}"),
    };
    assert_eq!(policy.role, Role::Mcp);
    for (name, role) in [(PREVIEW_TOOL, Role::Preview), (CONFIRM_TOOL, Role::Confirm), (STATUS_TOOL, Role::Status)] {
        assert_eq!(policy.tool(name).map(|t| t.role), Some(role), "{name}");
    }
    Setup { config, policy }
}

fn ctx() -> Ctx {
    SETUP.with(|s| testing::ctx(&s.config, &s.policy, "trace-mcp"))
}

fn tool(name: &str) -> Option<Rc<RoutePolicy>> {
    SETUP.with(|s| s.policy.tool(name).cloned())
}

fn verify(token: &str, expect: &Expect) -> Result<Claims, fp::VerifyError> {
    SETUP.with(|s| fp::verify(&s.config.keyring, token, expect))
}

fn mint(exp: u64, subject: &str, scope: &str, param_hash: &str) -> String {
    SETUP.with(|s| fp::mint(&s.config.keyring, NONCE, exp, &fp::subject_hash(subject), scope, param_hash))
}

/// The target body: the bytes raw, then as `arbitrary`'s choices.
pub fn mcp(data: &[u8]) {
    raw(data);
    let _ = structured(&mut Unstructured::new(data));
}

// ---- one request, one host ---------------------------------------------------

#[derive(Debug, Clone)]
struct Request {
    head: RequestHead,
    body: Vec<u8>,
    /// The headers ended the stream: there is no body at all.
    end_of_stream: bool,
}

fn head(mcp_method: Option<String>, mcp_name: Option<String>) -> RequestHead {
    RequestHead {
        trace: idem_core::trace::Trace::of(Some("trace-mcp"), None, None),
        subject: Some(SUBJECT.into()),
        content_length: None,
        fingerprint: None,
        path: "/mcp".into(),
        method: "POST".into(),
        idempotency_key: None,
        mcp_method,
        mcp_name,
        repeated: None,
        not_text: None,
        headers: Vec::new(),
    }
}

/// Everything the machine did for one host callback sequence.
#[derive(Debug, Default)]
struct Trace {
    effects: Vec<Effect>,
    flow: Option<Flow>,
}

impl Trace {
    fn push(&mut self, step: Step) {
        self.effects.extend(step.effects);
        self.flow = Some(step.flow);
    }

    fn replies(&self) -> Vec<&Reply> {
        self.effects.iter().filter_map(|e| if let Effect::Reply(r) = e { Some(r) } else { None }).collect()
    }

    fn calls(&self) -> Vec<&idem_core::machine::Callout> {
        self.effects.iter().filter_map(|e| if let Effect::Call(c) = e { Some(c) } else { None }).collect()
    }

    fn replaced(&self) -> Vec<&Vec<u8>> {
        self.effects
            .iter()
            .filter_map(|e| match e {
                Effect::ReplaceResponseBody(b) => Some(b),
                Effect::Rewrite(r) => Some(&r.body),
                _ => None,
            })
            .collect()
    }

    /// A response header as the effects leave it (a rewrite sets its status and headers).
    fn response_header(&self, name: &str) -> Option<String> {
        self.effects.iter().rev().find_map(|e| match e {
            Effect::SetResponseHeader(n, v) if n == name => Some(v.clone()),
            Effect::Rewrite(r) if name == ":status" => Some(r.http_status.to_string()),
            Effect::Rewrite(r) => r.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()),
            _ => None,
        })
    }

    fn has(&self, effect: &Effect) -> bool {
        self.effects.contains(effect)
    }
}

/// The request as the host delivers it: headers, then the whole body.
fn send(req: &Request, env: &mut FixedEnv) -> (Machine, Trace) {
    let mut trace = Trace::default();
    let (mut machine, first) = Machine::start(ctx(), &req.head, req.end_of_stream, env);
    trace.push(first);
    if req.end_of_stream || matches!(machine, Machine::Pass) {
        return (machine, trace);
    }
    let data = machine.on_request_data(req.body.len(), true);
    let need = data.flow == Flow::NeedBody;
    trace.push(data);
    if need {
        match machine.on_request_body(&req.body, env) {
            Ok(step) => trace.push(step),
            Err(e) => panic!("the body the machine asked for is unexpected: {e}"),
        }
    }
    (machine, trace)
}

// ---- what the request side must do ---------------------------------------------

/// What the request should come to, by the MCP rules (module doc of core's mcp.rs).
#[derive(Debug)]
enum Want {
    /// No body and not a POST (an event stream's GET, a session's DELETE): nothing read, nothing done.
    NoBody,
    /// Not a guarded call (another method, an unlisted tool): passes untouched.
    Pass,
    /// A JSON-RPC error with this id (and this code, for the standard ones).
    Error { id: Value, code: Option<i64> },
    /// `tools/list` on a route with a guarded confirm tool: forwarded without `accept-encoding`, its
    /// answer held for the rewrite that declares the replay's property (core's machine tests and the
    /// MCP e2e suites check the rewrite itself).
    List,
    /// Over max_body_bytes: a JSON-RPC error with a null id (the id is unread), HTTP 413
    /// (fuzz/regressions/mcp/body-too-large-is-not-json-rpc).
    TooLarge,
    /// A guarded tool's call: its machine decides.
    Tool { id: Value, name: String, policy: Rc<RoutePolicy>, args: Value },
}

fn want(req: &Request) -> Want {
    let h = &req.head;
    // The headers never decide alone: whatever they claim, a body is read (DESIGN §6).
    if req.end_of_stream && !h.method.eq_ignore_ascii_case("POST") {
        return Want::NoBody;
    }
    let body: &[u8] = if req.end_of_stream { &[] } else { &req.body };
    if body.len() > MAX_BODY_BYTES {
        return Want::TooLarge;
    }
    let message = match canonical::parse_json_body(body, usize::MAX) {
        Ok(Value::Object(m)) => m,
        Err(BodyError::NotAnObject) if body.trim_ascii_start().starts_with(b"[") => {
            return Want::Error { id: Value::Null, code: Some(-32600) }
        }
        _ => return Want::Error { id: Value::Null, code: Some(-32700) },
    };
    let id = message.get("id").cloned().unwrap_or(Value::Null);
    let method = message.get("method").and_then(Value::as_str);
    let params = message.get("params").and_then(Value::as_object);
    // Mcp-Method / Mcp-Name, where sent, say exactly what the body says (trimmed), or -32020.
    if h.mcp_method.as_deref().is_some_and(|m| Some(m.trim()) != method) {
        return Want::Error { id, code: Some(-32020) };
    }
    let named = params.and_then(|p| p.get("name").or_else(|| p.get("uri"))).and_then(Value::as_str);
    if h.mcp_name.as_deref().is_some_and(|n| Some(n.trim()) != named) {
        return Want::Error { id, code: Some(-32020) };
    }
    // A lenient server could read these as the real thing: the gateway answers them itself.
    let near = |got: &str, wanted: &str| {
        got != wanted
            && got.chars().filter(|c| !c.is_control() && !c.is_whitespace()).collect::<String>().to_lowercase()
                == wanted.to_lowercase()
    };
    match method {
        Some("tools/call") => {}
        Some(m) if near(m, "tools/call") => return Want::Error { id, code: Some(-32601) },
        Some("tools/list") if tool(CONFIRM_TOOL).is_some_and(|p| p.role == Role::Confirm) => return Want::List,
        _ => return Want::Pass,
    }
    let Some(params) = params else { return Want::Error { id, code: None } };
    let Some(name) = params.get("name").and_then(Value::as_str) else { return Want::Error { id, code: None } };
    let Some(policy) = tool(name) else {
        let names = ["quote_transfer", "execute_transfer", "get_transfer_status"];
        if names.iter().any(|t| near(name, t)) {
            return Want::Error { id, code: Some(-32602) };
        }
        return Want::Pass;
    };
    if !matches!(message.get("id"), Some(Value::String(_))) && !message.get("id").is_some_and(Value::is_i64) {
        return Want::Error { id: Value::Null, code: Some(-32600) };
    }
    if params.contains_key("task") {
        return Want::Error { id, code: Some(-32602) };
    }
    let args = match params.get("arguments") {
        None => Value::Object(Map::new()),
        Some(a @ Value::Object(_)) => a.clone(),
        Some(_) => return Want::Error { id, code: None },
    };
    Want::Tool { id, name: name.to_string(), policy, args }
}

/// A body that is a JSON-RPC 2.0 response with this id.
fn rpc_value(body: &[u8], id: &Value, what: &str) -> Value {
    let v: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => panic!("{what}: the answer is not JSON ({e}): {}", String::from_utf8_lossy(body)),
    };
    assert_eq!(v.get("jsonrpc").and_then(Value::as_str), Some("2.0"), "{what}: {v}");
    assert_eq!(v.get("id"), Some(id), "{what}: the answer's id is not the request's: {v}");
    assert!(v.get("result").is_some() != v.get("error").is_some(), "{what}: not exactly one of result/error: {v}");
    v
}

/// The local reply: JSON, labelled so, a JSON-RPC 2.0 response with this id.
fn rpc_body(r: &Reply, id: &Value, what: &str) -> Value {
    let ct = r.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case("content-type")).map(|(_, v)| v.as_str());
    assert_eq!(ct, Some("application/json"), "{what}: {:?}", r.headers);
    rpc_value(&r.body, id, what)
}

/// A gateway tool result (DESIGN §11): the §7 envelope in `_meta`, `isError`, a text block;
/// `structuredContent` only where it is valid for the tool's output schema: a replay's own
/// (never the envelope) or, for the status tool's reports, the envelope. No result: `isError`.
fn check_tool_result(v: &Value, what: &str) -> String {
    let result = &v["result"];
    let envelope = &result["_meta"][META_KEY];
    let status = envelope["status"].as_str();
    let Some(status) = status else { panic!("{what}: no _meta[{META_KEY}].status: {v}") };
    let is_error = result["isError"].as_bool();
    let Some(is_error) = is_error else { panic!("{what}: isError is not a bool: {v}") };
    let structured = result.get("structuredContent");
    let replay = matches!(status, "already_completed" | "already_failed");
    if replay && status == "already_completed" {
        assert!(!is_error, "{what}: a replay of a success is a result: {v}");
        assert_ne!(structured, Some(envelope), "{what}: a replay's structuredContent is the tool's own: {v}");
    } else if let Some(s) = structured {
        // Only the status tool reports in structuredContent, and then it is the envelope.
        assert_eq!(s, envelope, "{what}: structuredContent that is neither the tool's nor the envelope: {v}");
        assert!(!is_error, "{what}: a report is not an error: {v}");
    } else if !replay {
        assert!(is_error, "{what}: an answer without a result must be isError: {v}");
    }
    let content = result["content"].as_array().map(Vec::as_slice).unwrap_or_default();
    assert!(
        content.iter().any(|b| b["type"] == "text" && b["text"].is_string()),
        "{what}: no text block in result.content: {v}"
    );
    status.to_string()
}

fn check_rpc_error(r: &Reply, v: &Value, code: Option<i64>, what: &str) {
    assert_eq!(r.http_status, 400, "{what}: a JSON-RPC error is a 400: {v}");
    let got = v["error"]["code"].as_i64();
    assert!(got.is_some(), "{what}: error.code is not an integer: {v}");
    if let Some(code) = code {
        assert_eq!(got, Some(code), "{what}: {v}");
    }
    assert!(v["error"]["message"].is_string(), "{what}: {v}");
}

/// A tool's reply: exactly one, a 200 tool result, nothing called alongside.
fn tool_reply(trace: &Trace, id: &Value, what: &str) -> String {
    let replies = trace.replies();
    let [r] = replies.as_slice() else { panic!("{what}: {} replies: {:?}", replies.len(), trace.effects) };
    assert!(trace.calls().is_empty(), "{what}: a reply and a callout: {:?}", trace.effects);
    assert_eq!(trace.flow, Some(Flow::Pause), "{what}: a reply, yet the request goes on");
    assert_eq!(r.http_status, 200, "{what}: a tool result is a 200");
    let v = rpc_body(r, id, what);
    assert!(v.get("result").is_some(), "{what}: a tool's answer is a result: {v}");
    check_tool_result(&v, what)
}

/// How a guarded call went out, when it did.
#[derive(Debug)]
enum Sent {
    /// Refused or answered locally.
    Replied,
    /// A preview, forwarded as it was; the bound fields hash to this.
    Preview { param_hash: String },
    /// A confirm whose acquire is out.
    Acquiring { claims: Claims },
    /// An expired confirm or a status tool: `GET /v1/operations/{nonce}` is out.
    LookingUp,
}

/// The request side's invariants; what was sent, for the later events.
fn check_request(req: &Request, machine: &Machine, trace: &Trace) -> (Want, Sent) {
    let want = want(req);
    let what = format!("request {:?} with {:?}", String::from_utf8_lossy(&req.body), req.head);
    let sent = match &want {
        Want::NoBody => {
            assert!(matches!(machine, Machine::Pass), "{what}: no body, nothing to judge");
            assert!(trace.effects.is_empty() && trace.flow == Some(Flow::Continue), "{what}: {trace:?}");
            Sent::Replied
        }
        Want::Pass => {
            assert!(matches!(machine, Machine::Pass), "{what}: not a guarded call, yet held");
            // The start held the headers until the body was read; the body step lets it go.
            assert!(trace.effects.is_empty() && trace.flow == Some(Flow::Continue), "{what}: {trace:?}");
            Sent::Replied
        }
        Want::List => {
            assert!(!matches!(machine, Machine::Pass), "{what}: a listing to rewrite, yet not held");
            assert!(trace.calls().is_empty() && trace.replies().is_empty(), "{what}: {trace:?}");
            assert_eq!(trace.flow, Some(Flow::Continue), "{what}: {trace:?}");
            assert!(trace.has(&Effect::RemoveRequestHeader("accept-encoding")), "{what}: {trace:?}");
            Sent::Replied
        }
        Want::TooLarge => {
            let replies = trace.replies();
            let [r] = replies.as_slice() else { panic!("{what}: {} replies: {:?}", replies.len(), trace.effects) };
            assert!(matches!(machine, Machine::Pass) && trace.calls().is_empty(), "{what}: {trace:?}");
            assert_eq!(r.http_status, 413, "{what}");
            let v = rpc_body(r, &Value::Null, &what);
            assert_eq!(v["error"]["code"].as_i64(), Some(-32600), "{what}: {v}");
            Sent::Replied
        }
        Want::Error { id, code } => {
            let replies = trace.replies();
            let [r] = replies.as_slice() else { panic!("{what}: {} replies: {:?}", replies.len(), trace.effects) };
            assert!(trace.calls().is_empty() && trace.flow == Some(Flow::Pause), "{what}: {trace:?}");
            let v = rpc_body(r, id, &what);
            assert!(v.get("error").is_some(), "{what}: expected a JSON-RPC error: {v}");
            check_rpc_error(r, &v, *code, &what);
            Sent::Replied
        }
        Want::Tool { id, name, policy, args } => check_tool_call(req, trace, id, name, policy, args, &what),
    };
    (want, sent)
}

fn check_tool_call(
    req: &Request,
    trace: &Trace,
    id: &Value,
    name: &str,
    policy: &RoutePolicy,
    args: &Value,
    what: &str,
) -> Sent {
    // What the tool's own machine sees: the arguments as its body, the route's caller,
    // and no fingerprint header (on MCP the fingerprint is an argument).
    let subject = req.head.subject.as_deref();
    let fits = req.head.content_length.is_none_or(|l| l <= MAX_BODY_BYTES as u64)
        && serde_json::to_vec(args).map(|b| b.len() <= MAX_BODY_BYTES).unwrap_or(false);
    let param_hash = canonical::param_hash(args, &policy.bound).ok();
    let token = args.get("fingerprint").and_then(Value::as_str).map(str::trim);
    let verified = |param_hash: Option<&str>| -> Option<Claims> {
        let sh = fp::subject_hash(subject?);
        verify(token?, &Expect { subject_hash: &sh, scope: &policy.scope, param_hash }).ok()
    };
    let calls = trace.calls();
    let replied = !trace.replies().is_empty();
    match policy.role {
        Role::Preview => match (subject, fits, param_hash) {
            (Some(_), true, Some(param_hash)) => {
                assert!(trace.effects.is_empty(), "{what}: a valid preview is forwarded untouched: {trace:?}");
                assert_eq!(trace.flow, Some(Flow::Continue), "{what}");
                Sent::Preview { param_hash }
            }
            _ => {
                tool_reply(trace, id, what);
                Sent::Replied
            }
        },
        Role::Confirm => {
            let claims = match (fits, param_hash.as_deref()) {
                (true, Some(ph)) => verified(Some(ph)),
                _ => None,
            };
            match claims {
                Some(claims) => {
                    assert!(!replied, "{what}: a verified confirm was answered locally: {:?}", trace.effects);
                    let [call] = calls.as_slice() else {
                        panic!("{what}: a forwarded confirm made {} callouts: {:?}", calls.len(), trace.effects)
                    };
                    assert_eq!(trace.flow, Some(Flow::Pause), "{what}: the request waits for idemd");
                    if claims.expired(NOW) {
                        assert_eq!(
                            (call.method, call.path.clone()),
                            ("GET", format!("/v1/operations/{}?exp={}", claims.nonce, claims.exp))
                        );
                        return Sent::LookingUp;
                    }
                    assert_eq!((call.method, call.path.as_str()), ("POST", "/v1/acquire"), "{what}");
                    let body: Value =
                        serde_json::from_slice(call.body.as_deref().unwrap_or_default()).unwrap_or_default();
                    let ph = param_hash.unwrap_or_default();
                    let sh = fp::subject_hash(subject.unwrap_or_default());
                    assert_eq!(body["key"].as_str(), Some(claims.nonce.to_string().as_str()), "{what}: {body}");
                    assert_eq!(body["param_hash"].as_str(), Some(ph.as_str()), "{what}: {body}");
                    assert_eq!(body["subject_hash"].as_str(), Some(sh.as_str()), "{what}: {body}");
                    assert_eq!(body["scope"].as_str(), Some(policy.scope.as_str()), "{what}: {body}");
                    Sent::Acquiring { claims }
                }
                None => {
                    let status = tool_reply(trace, id, what);
                    assert!(status != "already_completed" && status != "in_progress", "{what}: {status}");
                    Sent::Replied
                }
            }
        }
        Role::Status => match verified(None).filter(|_| fits) {
            Some(claims) => {
                assert!(!replied, "{what}: {:?}", trace.effects);
                let [call] = calls.as_slice() else { panic!("{what}: {} callouts: {:?}", calls.len(), trace.effects) };
                assert_eq!(
                    (call.method, call.path.clone()),
                    ("GET", format!("/v1/operations/{}?exp={}", claims.nonce, claims.exp))
                );
                assert_eq!(trace.flow, Some(Flow::Pause), "{what}");
                Sent::LookingUp
            }
            None => {
                tool_reply(trace, id, what);
                Sent::Replied
            }
        },
        other => panic!("{what}: tool {name} has role {other:?}"),
    }
}

// ---- the sidecar's answers -----------------------------------------------------

fn acquired() -> CalloutAnswer {
    answer(200, &json!({"outcome": "ACQUIRED", "owner": OWNER}))
}

fn answer(status: u16, body: &Value) -> CalloutAnswer {
    CalloutAnswer { status: Some(status), body: body.to_string().into_bytes() }
}

/// Feed ACQUIRED to a confirm whose acquire is out: the request goes upstream
/// with the nonce as its idempotency key, and nothing is answered.
fn acquire(machine: &mut Machine, claims: &Claims, env: &mut FixedEnv) {
    let step = match machine.on_callout(&acquired(), env) {
        Ok(s) => s,
        Err(e) => panic!("ACQUIRED is unexpected: {e}"),
    };
    let mut trace = Trace::default();
    trace.push(step);
    assert!(trace.replies().is_empty() && trace.calls().is_empty(), "{trace:?}");
    assert!(trace.has(&Effect::SetRequestHeader("idempotency-key", claims.nonce.to_string())), "{trace:?}");
    assert!(trace.has(&Effect::ResumeRequest), "{trace:?}");
    assert!(machine.response_needs_headers(), "a forwarded confirm records the upstream's headers");
}

/// Any other answer to a pending lookup or acquire: one tool result with the id, the request held.
fn other_answer(machine: &mut Machine, a: &CalloutAnswer, id: &Value, env: &mut FixedEnv) {
    let what = format!("callout answer {:?} {:?}", a.status, String::from_utf8_lossy(&a.body));
    let step = match machine.on_callout(a, env) {
        Ok(s) => s,
        Err(e) => panic!("{what}: unexpected: {e}"),
    };
    let mut trace = Trace::default();
    trace.push(step);
    if trace.has(&Effect::ResumeRequest) {
        // Only an ACQUIRED with an owner forwards.
        let v: Value = serde_json::from_slice(&a.body).unwrap_or_default();
        assert_eq!(v["outcome"], "ACQUIRED", "{what}: forwarded");
        assert!(v["owner"].is_string(), "{what}: forwarded without an owner");
        assert!(trace.replies().is_empty(), "{what}: forwarded and answered");
        return;
    }
    tool_reply(&trace, id, &what);
    assert!(matches!(machine, Machine::Pass), "{what}: answered, yet still held");
}

// ---- the response side -----------------------------------------------------------

#[derive(Debug, Clone)]
struct Upstream {
    status: u16,
    content_type: Option<String>,
    code_details: Option<String>,
    attempts: u32,
    body: Vec<u8>,
    /// The answer has no body at all (end of stream at the headers).
    end_of_stream: bool,
}

impl Upstream {
    fn ok(sse: bool, body: &[u8]) -> Upstream {
        let ct = if sse { "text/event-stream" } else { "application/json" };
        Upstream {
            status: 200,
            content_type: Some(ct.into()),
            code_details: Some("via_upstream".into()),
            attempts: 1,
            body: body.to_vec(),
            end_of_stream: false,
        }
    }

    fn sse(&self) -> bool {
        self.content_type.as_deref().is_some_and(|c| c.contains("text/event-stream"))
    }
}

/// The upstream's answer as the host delivers it.
fn respond(machine: &mut Machine, up: &Upstream, env: &mut FixedEnv) -> Trace {
    let what = format!("answer {up:?}");
    let head = ResponseHead {
        status: up.status,
        content_type: up.content_type.clone(),
        code_details: up.code_details.clone(),
        attempts: up.attempts,
        headers: up.content_type.iter().map(|c| ("content-type".to_string(), c.clone())).collect(),
        ..Default::default()
    };
    let mut trace = Trace::default();
    let body: &[u8] = if up.end_of_stream { &[] } else { &up.body };
    match machine.on_response_head(&head, up.end_of_stream, env) {
        Ok(step) => trace.push(step),
        Err(e) => panic!("{what}: response head unexpected: {e}"),
    }
    if up.end_of_stream || trace.flow != Some(Flow::Pause) {
        return trace;
    }
    let data = match machine.on_response_data(body.len(), true) {
        Ok(step) => step,
        Err(e) => panic!("{what}: response data unexpected: {e}"),
    };
    let need = data.flow == Flow::NeedBody;
    trace.push(data);
    if need {
        match machine.on_response_body(body, env) {
            Ok(step) => trace.push(step),
            Err(e) => panic!("{what}: response body unexpected: {e}"),
        }
    }
    trace
}

/// The JSON objects an answer carries: the body, or each SSE event's data.
fn messages(up: &Upstream) -> Vec<Value> {
    let body: &[u8] = if up.end_of_stream { &[] } else { &up.body };
    if !up.sse() {
        return serde_json::from_slice::<Value>(body).ok().filter(Value::is_object).into_iter().collect();
    }
    // Events split at blank lines, with and without CRLF folded (a reader may do either).
    let text = String::from_utf8_lossy(body).into_owned();
    let folded = text.replace("\r\n", "\n");
    [text.as_str(), folded.as_str()]
        .into_iter()
        .flat_map(|t| t.split("\n\n"))
        .filter_map(|event| {
            let data: Vec<&str> = event.lines().filter_map(|l| l.strip_prefix("data:")).map(str::trim_start).collect();
            serde_json::from_str::<Value>(&data.join("\n")).ok().filter(Value::is_object)
        })
        .collect()
}

/// A confirm holding the upstream's answer: it is recorded or left unknown, a
/// rewrite is the request's JSON-RPC, and the ack lets the answer go.
fn check_confirm_answer(machine: &mut Machine, up: &Upstream, id: &Value, claims: &Claims, env: &mut FixedEnv) {
    let what = format!("confirm answer {up:?}");
    let trace = respond(machine, up, env);
    assert!(trace.replies().is_empty(), "{what}: a local reply after forwarding: {:?}", trace.effects);
    let calls = trace.calls();
    let unknown = trace.has(&Effect::Count(idem_core::machine::Counter::UnknownOutcome));
    match calls.as_slice() {
        [] => assert!(unknown, "{what}: neither recorded nor unknown: {:?}", trace.effects),
        [call] => {
            assert!(!unknown, "{what}: recorded and unknown");
            assert_eq!(call.method, "POST", "{what}");
            let body: Value = serde_json::from_slice(call.body.as_deref().unwrap_or_default()).unwrap_or_default();
            assert_eq!(body["key"].as_str(), Some(claims.nonce.to_string().as_str()), "{what}: {body}");
            assert_eq!(body["owner"].as_str(), Some(OWNER), "{what}: {body}");
            match call.path.as_str() {
                "/v1/complete" => check_recorded(&body, up, &what),
                "/v1/release" => {}
                other => panic!("{what}: records with {other}"),
            }
        }
        more => panic!("{what}: {} callouts: {:?}", more.len(), trace.effects),
    }
    for b in trace.replaced() {
        let v = rpc_value(b, id, &format!("{what}: rewritten"));
        check_tool_result(&v, &what);
        assert_eq!(
            trace.response_header("content-type").as_deref(),
            Some("application/json"),
            "{what}: {:?}",
            trace.effects
        );
    }
    if let Some(status) = trace.response_header(":status") {
        assert_eq!(status, "200", "{what}: an MCP answer stays a 200");
    }
    if calls.is_empty() {
        assert!(matches!(machine, Machine::Pass), "{what}: unknown, yet still held");
        return;
    }
    // The ack lets the held answer go, as it is or as rewritten.
    let step = match machine.on_callout(&answer(200, &json!({"outcome": "OK"})), env) {
        Ok(s) => s,
        Err(e) => panic!("{what}: the ack is unexpected: {e}"),
    };
    let mut ack = Trace::default();
    ack.push(step);
    assert!(ack.has(&Effect::ResumeResponse) && ack.replies().is_empty(), "{what}: {ack:?}");
    assert!(matches!(machine, Machine::Pass), "{what}: acked, yet still held");
}

/// A DONE record keeps the JSON-RPC `result` of a successful tool call (or
/// nothing, when it is over max_response_bytes).
fn check_recorded(body: &Value, up: &Upstream, what: &str) {
    if body["state"] != "DONE" {
        return;
    }
    let stored = protocol::decode_body(body["result"]["body_b64"].as_str().unwrap_or_default());
    let Some(stored) = stored else { panic!("{what}: recorded body is not base64: {body}") };
    let results: Vec<Value> = messages(up).into_iter().filter_map(|m| m.get("result").cloned()).collect();
    assert!(
        results.iter().any(|r| r.get("isError") != Some(&Value::Bool(true))),
        "{what}: DONE without a successful result in the answer: {body}"
    );
    if stored.is_empty() {
        return;
    }
    let kept: Value = match serde_json::from_slice(&stored) {
        Ok(v) => v,
        Err(e) => panic!("{what}: recorded result is not JSON ({e}): {}", String::from_utf8_lossy(&stored)),
    };
    assert!(results.contains(&kept), "{what}: recorded {kept}, not a result of the answer");
}

/// A forwarded preview: a minted fingerprint verifies for this call, and a
/// rewritten answer carries it in `structuredContent`, in the upstream's framing.
fn check_preview_answer(machine: &mut Machine, up: &Upstream, param_hash: &str, subject: &str, env: &mut FixedEnv) {
    let what = format!("preview answer {up:?}");
    let trace = respond(machine, up, env);
    assert!(trace.replies().is_empty() && trace.calls().is_empty(), "{what}: {:?}", trace.effects);
    assert!(matches!(machine, Machine::Pass), "{what}: the preview is over, yet still held");
    let minted = trace.has(&Effect::Count(idem_core::machine::Counter::Minted));
    let header = trace.response_header(FINGERPRINT_HEADER);
    let header = header.as_deref();
    assert_eq!(minted, header.is_some(), "{what}: {:?}", trace.effects);
    let sh = fp::subject_hash(subject);
    let scope = tool(PREVIEW_TOOL).map(|p| p.scope.clone()).unwrap_or_default();
    let expect = Expect { subject_hash: &sh, scope: &scope, param_hash: Some(param_hash) };
    if let Some(token) = header {
        match verify(token, &expect) {
            Ok(c) => assert!(!c.expired(NOW), "{what}: minted expired"),
            Err(e) => panic!("{what}: the minted fingerprint does not verify: {e:?}"),
        }
    }
    if header.is_some() {
        // Only a successful tool call hands out something to confirm.
        let ok = messages(up)
            .iter()
            .any(|m| m.get("result").is_some_and(|r| r.is_object() && r.get("isError") != Some(&Value::Bool(true))));
        assert!(ok, "{what}: minted for an answer without a successful result");
    }
    let replaced = trace.replaced();
    assert!(replaced.len() <= 1, "{what}");
    for b in replaced {
        assert!(minted, "{what}: rewritten without a fingerprint");
        let text = String::from_utf8_lossy(b);
        let json_text = if up.sse() {
            let Some(inner) = text.strip_prefix("data: ").and_then(|t| t.strip_suffix("\n\n")) else {
                panic!("{what}: not one SSE data event: {text:?}")
            };
            assert!(!inner.contains('\n'), "{what}: the event's data spans lines: {text:?}");
            inner.to_string()
        } else {
            text.to_string()
        };
        let v: Value = match serde_json::from_str(&json_text) {
            Ok(v) => v,
            Err(e) => panic!("{what}: the rewritten answer is not JSON ({e}): {json_text}"),
        };
        let token = v["result"]["structuredContent"]["fingerprint"].as_str();
        let Some(token) = token else { panic!("{what}: no result.structuredContent.fingerprint: {v}") };
        assert_eq!(Some(token), header, "{what}: body and header fingerprints differ");
        assert!(v["result"]["structuredContent"]["fingerprint_expires_at"].is_u64(), "{what}: {v}");
    }
}

// ---- raw bytes ---------------------------------------------------------------------

/// `[@<Mcp-Method>\t<Mcp-Name>\n]<request body>[\0<upstream answer>]`: an empty
/// header field is an absent header. Without a NUL the whole input is also the answer.
pub fn split_raw(data: &[u8]) -> (Option<String>, Option<String>, &[u8], &[u8]) {
    let (mut method, mut name, mut rest) = (None, None, data);
    if let Some(line) = data.strip_prefix(b"@") {
        let end = line.iter().position(|&b| b == b'\n').unwrap_or(line.len());
        let fields = String::from_utf8_lossy(&line[..end]).into_owned();
        let (m, n) = fields.split_once('\t').unwrap_or((&fields, ""));
        method = Some(m.to_string()).filter(|s| !s.is_empty());
        name = Some(n.to_string()).filter(|s| !s.is_empty());
        rest = line.get(end + 1..).unwrap_or_default();
    }
    match rest.iter().position(|&b| b == 0) {
        Some(at) => (method, name, &rest[..at], &rest[at + 1..]),
        None => (method, name, rest, data),
    }
}

/// The placeholders replaced with fingerprints minted for the body's tool and arguments.
pub fn fill_placeholders(body: &[u8]) -> Vec<u8> {
    let text = String::from_utf8_lossy(body);
    if !text.contains(PLACEHOLDER_VALID) && !text.contains(PLACEHOLDER_EXPIRED) {
        return body.to_vec();
    }
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let params = parsed.as_ref().and_then(|m| m.get("params"));
    let name = params.and_then(|p| p.get("name")).and_then(Value::as_str).unwrap_or(CONFIRM_TOOL);
    let policy = tool(name).or_else(|| tool(CONFIRM_TOOL));
    let args = params.and_then(|p| p.get("arguments")).cloned().unwrap_or_else(|| json!({}));
    let Some(policy) = policy else { return body.to_vec() };
    let Ok(p) = canonical::param_hash(&args, &policy.bound) else { return body.to_vec() };
    let valid = format!("\"{}\"", mint(NOW + 300, SUBJECT, &policy.scope, &p));
    let expired = format!("\"{}\"", mint(NOW - 1, SUBJECT, &policy.scope, &p));
    text.replace(PLACEHOLDER_VALID, &valid).replace(PLACEHOLDER_EXPIRED, &expired).into_bytes()
}

/// A fixed, valid call of `tool` with id 41 and a minted fingerprint.
fn fixed_call(tool_name: &str) -> Vec<u8> {
    let args =
        json!({"amount": "12.50", "currency": "EUR", "payee_id": "payee_42", "memo": "rent", "fingerprint": "@fp"});
    let body =
        json!({"jsonrpc": "2.0", "id": 41, "method": "tools/call", "params": {"name": tool_name, "arguments": args}});
    fill_placeholders(body.to_string().as_bytes())
}

fn raw(data: &[u8]) {
    let (mcp_method, mcp_name, body, upstream) = split_raw(data);
    let body = fill_placeholders(body);
    let mut h = head(mcp_method, mcp_name);
    h.content_length = Some(body.len() as u64);
    let req = Request { head: h, body, end_of_stream: false };
    let mut env = FixedEnv { now: NOW, random: Some(NONCE) };
    let (mut machine, trace) = send(&req, &mut env);
    let (want, sent) = check_request(&req, &machine, &trace);
    let id = if let Want::Tool { id, .. } = &want { id.clone() } else { Value::Null };
    // The request's own call, when it went upstream, then the fixed ones; both framings.
    for sse in [false, true] {
        let up = Upstream::ok(sse, upstream);
        match &sent {
            Sent::Acquiring { claims } if sse => {
                let (mut m, _) = send(&req, &mut env);
                acquire(&mut m, claims, &mut env);
                check_confirm_answer(&mut m, &up, &id, claims, &mut env);
            }
            Sent::Acquiring { claims } => {
                acquire(&mut machine, claims, &mut env);
                check_confirm_answer(&mut machine, &up, &id, claims, &mut env);
            }
            Sent::Preview { param_hash } => {
                let (mut m, _) = send(&req, &mut env);
                check_preview_answer(&mut m, &up, param_hash, SUBJECT, &mut env);
            }
            Sent::Replied | Sent::LookingUp => {}
        }
        fixed_answer(CONFIRM_TOOL, &up);
        fixed_answer(PREVIEW_TOOL, &up);
    }
}

fn fixed_answer(tool_name: &str, up: &Upstream) {
    let mut env = FixedEnv { now: NOW, random: Some(NONCE) };
    let mut h = head(None, None);
    let body = fixed_call(tool_name);
    h.content_length = Some(body.len() as u64);
    let req = Request { head: h, body, end_of_stream: false };
    let (mut machine, trace) = send(&req, &mut env);
    match check_request(&req, &machine, &trace).1 {
        Sent::Acquiring { claims } => {
            acquire(&mut machine, &claims, &mut env);
            check_confirm_answer(&mut machine, up, &json!(41), &claims, &mut env);
        }
        Sent::Preview { param_hash } => check_preview_answer(&mut machine, up, &param_hash, SUBJECT, &mut env),
        other => panic!("the fixed {tool_name} call was not forwarded: {other:?}"),
    }
}

// ---- arbitrary's choices -------------------------------------------------------------

fn pick<'a>(u: &mut Unstructured, items: &[&'a str]) -> arbitrary::Result<&'a str> {
    Ok(*u.choose(items)?)
}

fn text(u: &mut Unstructured) -> arbitrary::Result<String> {
    let s: String = u.arbitrary()?;
    Ok(s.chars().take(40).collect())
}

/// A JSON value from the generator (numbers with all their spellings).
fn any_value(u: &mut Unstructured) -> arbitrary::Result<Value> {
    let node = json_gen::node(u, 2)?;
    let mut style = Style { seed: u.arbitrary()?, ..Style::plain() };
    let text = json_gen::render(&node, &mut style);
    Ok(serde_json::from_str(&text).unwrap_or(Value::Null))
}

fn number(literal: &str) -> Value {
    serde_json::from_str::<Value>(literal).ok().filter(Value::is_number).unwrap_or(Value::Null)
}

fn any_id(u: &mut Unstructured) -> arbitrary::Result<Option<Value>> {
    Ok(match u.int_in_range(0..=7)? {
        0 => None,
        1 => Some(Value::Null),
        2 => Some(Value::String(text(u)?)),
        3 => Some(number("123456789012345678901234567890")),
        4 => Some(number("1.50")),
        5 => Some(any_value(u)?),
        _ => Some(json!(u.arbitrary::<i64>()?)),
    })
}

fn amount(u: &mut Unstructured) -> arbitrary::Result<Value> {
    Ok(match u.int_in_range(0..=4)? {
        0 => json!("12.50"),
        1 => number("12.5"),
        2 => {
            let n = json_gen::num(u)?;
            let spellings = n.spellings();
            let s = u.choose(&spellings)?.clone();
            if u.arbitrary()? {
                Value::String(s)
            } else {
                number(&s)
            }
        }
        3 => Value::String(text(u)?),
        _ => any_value(u)?,
    })
}

fn arguments(u: &mut Unstructured, name: &str, subject: &str) -> arbitrary::Result<Option<Value>> {
    let mut args = Map::new();
    if u.ratio(7, 8)? {
        args.insert("amount".into(), amount(u)?);
    }
    if u.ratio(7, 8)? {
        let c = pick(u, &["EUR", "USD", "", "eur"])?;
        args.insert("currency".into(), if u.ratio(1, 8)? { any_value(u)? } else { json!(c) });
    }
    if u.ratio(3, 4)? {
        args.insert("payee_id".into(), json!(pick(u, &["payee_42", "payee_7"])?));
    }
    if u.ratio(1, 4)? {
        args.insert(text(u)?, any_value(u)?);
    }
    let args_value = Value::Object(args.clone());
    let policy = tool(name).or_else(|| tool(CONFIRM_TOOL));
    let p = policy.as_ref().and_then(|p| canonical::param_hash(&args_value, &p.bound).ok()).unwrap_or_default();
    let scope = policy.as_ref().map(|p| p.scope.clone()).unwrap_or_default();
    let exp = NOW.saturating_add_signed(u.int_in_range(-3..=600)?);
    let fingerprint = match u.int_in_range(0..=7)? {
        0 => None,
        1 => Some(json!(text(u)?)),
        2 => Some(json!(mint(exp, "someone-else", &scope, &p))),
        3 => Some(json!(mint(exp, subject, "other.scope", &p))),
        4 => Some(json!(mint(exp, subject, &scope, &"0".repeat(64)))),
        5 => Some(any_value(u)?),
        _ => Some(json!(mint(exp, subject, &scope, &p))),
    };
    if let Some(f) = fingerprint {
        args.insert("fingerprint".into(), f);
    }
    // Tamper after minting: the fingerprint no longer matches.
    if u.ratio(1, 8)? {
        args.insert("amount".into(), amount(u)?);
    }
    Ok(match u.int_in_range(0..=15)? {
        0 => None,
        1 => Some(any_value(u)?),
        _ => Some(Value::Object(args)),
    })
}

fn any_request(u: &mut Unstructured) -> arbitrary::Result<Request> {
    let name = match u.int_in_range(0..=7)? {
        0 | 1 => PREVIEW_TOOL.to_string(),
        2 => STATUS_TOOL.to_string(),
        3 => text(u)?,
        _ => CONFIRM_TOOL.to_string(),
    };
    let subject = if u.ratio(1, 10)? { None } else { Some(pick(u, &[SUBJECT, SUBJECT, SUBJECT, "someone-else"])?) };
    let mut message = Map::new();
    if u.ratio(15, 16)? {
        message.insert("jsonrpc".into(), json!("2.0"));
    }
    if let Some(id) = any_id(u)? {
        message.insert("id".into(), id);
    }
    let method = if u.ratio(7, 8)? { "tools/call".to_string() } else { pick(u, &["initialize", "tools/list"])?.into() };
    message.insert("method".into(), json!(method));
    let mut params = Map::new();
    if u.ratio(15, 16)? {
        params.insert("name".into(), if u.ratio(31, 32)? { json!(name) } else { any_value(u)? });
    }
    if let Some(args) = arguments(u, &name, subject.unwrap_or(SUBJECT))? {
        params.insert("arguments".into(), args);
    }
    if u.arbitrary()? {
        params.insert("_meta".into(), json!({"progressToken": 0}));
    }
    message.insert("params".into(), if u.ratio(15, 16)? { Value::Object(params) } else { any_value(u)? });
    let message = Value::Object(message);
    let body = match u.int_in_range(0..=15)? {
        0 => json!([message]).to_string().into_bytes(),
        1 => {
            let mut b = message.to_string().into_bytes();
            b.truncate(u.int_in_range(0..=b.len())?);
            b
        }
        _ => message.to_string().into_bytes(),
    };
    let mcp_method = match u.int_in_range(0..=5)? {
        0 => Some("tools/call".to_string()),
        1 => Some(text(u)?),
        _ => None,
    };
    let mcp_name = match u.int_in_range(0..=5)? {
        0 => Some(name.clone()),
        1 => Some(pick(u, &[PREVIEW_TOOL, CONFIRM_TOOL, STATUS_TOOL])?.to_string()),
        2 => Some(text(u)?),
        _ => None,
    };
    let mut h = head(mcp_method, mcp_name);
    h.subject = subject.map(str::to_string);
    h.method = pick(u, &["POST", "POST", "POST", "POST", "post", "GET"])?.into();
    h.content_length = match u.int_in_range(0..=7)? {
        0 => None,
        1 => Some(u.arbitrary()?),
        _ => Some(body.len() as u64),
    };
    if u.ratio(1, 8)? {
        // A valid fingerprint in the header: never used on MCP (the argument is the fingerprint).
        h.fingerprint = Some(mint(NOW + 60, SUBJECT, "payments.transfer", &"0".repeat(64)));
    }
    let end_of_stream = u.ratio(1, 32)?;
    Ok(Request { head: h, body, end_of_stream })
}

fn any_callout(u: &mut Unstructured) -> arbitrary::Result<CalloutAnswer> {
    let status = if u.ratio(1, 8)? { None } else { Some(*u.choose(&[200u16, 200, 200, 404, 500, 503])?) };
    let result = json!({
        "status": *u.choose(&[200u16, 201, 422, 500])?,
        "headers": [["content-type", "application/json"]],
        "body_b64": protocol::encode_body(&u.arbitrary::<Vec<u8>>()?),
    });
    let body = match u.int_in_range(0..=9)? {
        0 => u.arbitrary::<Vec<u8>>()?,
        1 => json!({"outcome": "ACQUIRED"}).to_string().into_bytes(),
        2 => json!({"outcome": "DONE", "result": result}).to_string().into_bytes(),
        3 => json!({"outcome": "FAILED", "result": result}).to_string().into_bytes(),
        4 => json!({"outcome": pick(u, &["IN_FLIGHT", "NEEDS_REVIEW", "PARAM_MISMATCH", "STORE_UNAVAILABLE"])?})
            .to_string()
            .into_bytes(),
        5 | 6 => {
            let state = pick(u, &["DONE", "FAILED", "IN_FLIGHT", "NEEDS_REVIEW"])?;
            json!({"key": "11111111111111111111111111111111", "state": state, "scope": "payments.transfer",
                "subject_hash": "x", "param_hash": "y", "created_at_ms": 1, "updated_at_ms": 2, "result": result})
            .to_string()
            .into_bytes()
        }
        _ => acquired().body,
    };
    Ok(CalloutAnswer { status, body })
}

fn any_upstream(u: &mut Unstructured, id: &Value) -> arbitrary::Result<Upstream> {
    let status = *u.choose(&[200u16, 200, 200, 200, 201, 202, 400, 404, 409, 422, 429, 500, 502, 503, 504])?;
    let content_type = match u.int_in_range(0..=9)? {
        0 => None,
        1 => Some("text/plain".to_string()),
        2..=5 => Some("text/event-stream".to_string()),
        _ => Some("application/json".to_string()),
    };
    let sse = content_type.as_deref().is_some_and(|c| c.contains("event-stream"));
    let structured = if u.arbitrary()? { any_value(u)? } else { json!({"transfer_id": "t_1", "status": "executed"}) };
    let answer_id = if u.ratio(7, 8)? { id.clone() } else { any_value(u)? };
    let message = match u.int_in_range(0..=7)? {
        0 => {
            let code = *u.choose(&[-32602i64, -32600, -32603, -32020, 7])?;
            json!({"jsonrpc": "2.0", "id": answer_id, "error": {"code": code, "message": "x"}})
        }
        1 => json!({"jsonrpc": "2.0", "id": answer_id, "result": any_value(u)?}),
        2 => {
            let result = json!({"content": [], "structuredContent": structured, "isError": true});
            json!({"jsonrpc": "2.0", "id": answer_id, "result": result})
        }
        3 => any_value(u)?,
        _ => {
            let content = json!([{"type": "text", "text": "{}"}]);
            let result = json!({"content": content, "structuredContent": structured, "isError": false});
            json!({"jsonrpc": "2.0", "id": answer_id, "result": result})
        }
    };
    let text = message.to_string();
    let body = match u.int_in_range(0..=7)? {
        0 => u.arbitrary::<Vec<u8>>()?,
        1 if sse => format!("data: \nid: 0\nretry: 3000\n\ndata: {text}\nid: 1/0\n\n").into_bytes(),
        2 if sse => format!("data: {text}\r\n\r\n").into_bytes(),
        3 if sse => format!(
            "event: message\ndata: {text}\n\ndata: {{\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\"}}\n\n"
        )
        .into_bytes(),
        _ if sse => format!("data: {text}\n\n").into_bytes(),
        _ => text.into_bytes(),
    };
    let code_details = Some(
        pick(
            u,
            &[
                "via_upstream",
                "via_upstream",
                "via_upstream",
                "upstream_reset_before_response_started{connection_failure}",
                "upstream_response_timeout",
            ],
        )?
        .to_string(),
    );
    let attempts = u.int_in_range(1..=2)?;
    let end_of_stream = u.ratio(1, 16)?;
    Ok(Upstream { status, content_type, code_details, attempts, body, end_of_stream })
}

fn structured(u: &mut Unstructured) -> arbitrary::Result<()> {
    let req = any_request(u)?;
    let mut env = FixedEnv { now: NOW, random: if u.ratio(1, 16)? { None } else { Some(u.arbitrary()?) } };
    let (mut machine, trace) = send(&req, &mut env);
    let (want, sent) = check_request(&req, &machine, &trace);
    let id = if let Want::Tool { id, .. } = &want { id.clone() } else { Value::Null };
    match sent {
        Sent::Replied => {}
        Sent::LookingUp => {
            let a = any_callout(u)?;
            other_answer(&mut machine, &a, &id, &mut env);
        }
        Sent::Acquiring { claims } => {
            let a = any_callout(u)?;
            other_answer(&mut machine, &a, &id, &mut env);
            if matches!(machine, Machine::Pass) {
                return Ok(());
            }
            let up = any_upstream(u, &id)?;
            check_confirm_answer(&mut machine, &up, &id, &claims, &mut env);
        }
        Sent::Preview { param_hash } => {
            let up = any_upstream(u, &id)?;
            let subject = req.head.subject.clone().unwrap_or_default();
            check_preview_answer(&mut machine, &up, &param_hash, &subject, &mut env);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How far the raw request of a seed gets: the checks above are not vacuous.
    fn stage(seed: &str) -> String {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../corpus/mcp").join(seed);
        let data = std::fs::read(&path).unwrap_or_default();
        assert!(!data.is_empty(), "{}", path.display());
        let (mcp_method, mcp_name, body, _) = split_raw(&data);
        let req = Request { head: head(mcp_method, mcp_name), body: fill_placeholders(body), end_of_stream: false };
        let (machine, trace) = send(&req, &mut FixedEnv { now: NOW, random: Some(NONCE) });
        let (want, sent) = check_request(&req, &machine, &trace);
        match (want, sent) {
            (Want::Tool { .. }, sent) => format!("{sent:?}").split([' ', '{']).next().unwrap_or_default().to_string(),
            (want, _) => format!("{want:?}").split([' ', '{']).next().unwrap_or_default().to_string(),
        }
    }

    #[test]
    fn seeds_reach_every_path() {
        for (seed, want) in [
            ("seed-confirm-json", "Acquiring"),
            ("seed-confirm-header-error", "Acquiring"),
            ("seed-confirm-expired", "LookingUp"),
            ("seed-status-tool", "LookingUp"),
            ("seed-preview-sse", "Preview"),
            ("seed-confirm-no-fingerprint", "Replied"),
            ("seed-confirm-no-id", "Error"),
            ("seed-mcp-name-mismatch", "Error"),
            ("seed-batch", "Error"),
            ("seed-initialize", "Pass"),
            ("seed-tools-list", "List"),
        ] {
            assert_eq!(stage(seed), want, "{seed}");
        }
    }

    /// The fixed calls are recorded and minted for: the response-side checks run.
    #[test]
    fn fixed_calls_record_and_mint() {
        let answer = br#"{"jsonrpc":"2.0","id":41,"result":{"content":[],"structuredContent":{"transfer_id":"t_1"},"isError":false}}"#;
        for sse in [false, true] {
            let framed = if sse { [b"data: ".as_slice(), answer, b"\n\n"].concat() } else { answer.to_vec() };
            let up = Upstream::ok(sse, &framed);
            let mut env = FixedEnv { now: NOW, random: Some(NONCE) };
            let req = Request { head: head(None, None), body: fixed_call(CONFIRM_TOOL), end_of_stream: false };
            let (mut m, trace) = send(&req, &mut env);
            let Sent::Acquiring { claims } = check_request(&req, &m, &trace).1 else { panic!("not acquiring") };
            acquire(&mut m, &claims, &mut env);
            let trace = respond(&mut m, &up, &mut env);
            let paths: Vec<&str> = trace.calls().iter().map(|c| c.path.as_str()).collect();
            assert_eq!(paths, ["/v1/complete"]);

            let req = Request { head: head(None, None), body: fixed_call(PREVIEW_TOOL), end_of_stream: false };
            let (mut m, trace) = send(&req, &mut env);
            let Sent::Preview { .. } = check_request(&req, &m, &trace).1 else { panic!("not forwarded") };
            let trace = respond(&mut m, &up, &mut env);
            assert_eq!(trace.replaced().len(), 1, "{trace:?}");
        }
    }
}
