//! The transfers service as an MCP server (Streamable HTTP, `rmcp`): the
//! same three operations as the REST routes, as tools an agent calls with
//! JSON-RPC `tools/call`.
//!
//! | tool | REST twin |
//! |---|---|
//! | `quote_transfer` | `POST /v1/transfers/preview` |
//! | `execute_transfer` | `POST /v1/transfers` (same store, same `Idempotency-Key` rules, same ledger) |
//! | `get_transfer_status` | `/v1/transfers/status`, which the gateway answers; the service itself has nothing |
//!
//! Three endpoints, one server, so tests can pick the framing:
//!
//! * `/mcp`: stateless, answers `application/json` (what the gateway is meant to parse),
//! * `/mcp/stream`: stateless, answers a `text/event-stream` carrying the one JSON-RPC response.
//!   Also served as `/mcp/sse`, its first name, kept for configurations that use it: a client
//!   that infers the transport from the URL (FastMCP, under pydantic-ai) takes a path ending in
//!   `/sse` for the legacy HTTP+SSE transport and gets 405 before any call,
//! * `/mcp/session`: the SDK's stateful mode (`Mcp-Session-Id` from `initialize` on), SSE answers.
//!
//! Tool results carry `structuredContent` (the JSON object the REST route
//! would answer) and one text block with the same JSON. Refusals are tool
//! errors (`isError: true`) whose one text block is the REST error body, with
//! no `structuredContent` (it would not conform to the tool's `outputSchema`).
//! See `demo/MCP-WIRE.md` for the bytes on the wire.

use crate::api::{self, Confirmed, Faults};
use crate::app::App;
use crate::server::Hangup;
use crate::transfer::TransferRequest;
use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::request::Parts;
use axum::http::{HeaderMap, Method};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, MethodRouter};
use axum::Router;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation, JsonObject, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool, ToolAnnotations,
};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::streamable_http_server::session::SessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, RoleServer, ServerHandler};
use serde_json::{json, Value};
use std::sync::Arc;

pub const QUOTE: &str = "quote_transfer";
pub const EXECUTE: &str = "execute_transfer";
pub const STATUS: &str = "get_transfer_status";

/// rmcp's own default bound on a POST body.
const MAX_BODY_BYTES: usize = 4 * 1024 * 1024;

pub fn router(app: App) -> Router {
    let stateless = |json_response: bool| {
        let config = config().with_legacy_session_mode(false).with_json_response(json_response);
        endpoint(app.clone(), Arc::new(NeverSessionManager::default()), config)
    };
    let stateful = endpoint(app.clone(), Arc::new(LocalSessionManager::default()), config());
    Router::new()
        .route("/mcp", stateless(true))
        .route("/mcp/stream", stateless(false))
        .route("/mcp/sse", stateless(false))
        .route("/mcp/session", stateful)
}

fn config() -> StreamableHttpServerConfig {
    // The demo sits behind the gateway, whose listener is the edge: the Host
    // it forwards is whatever the agent used (`localhost:10000`, a cluster
    // name), so rmcp's loopback-only DNS-rebinding guard would refuse it.
    StreamableHttpServerConfig::default().disable_allowed_hosts()
}

fn endpoint<M: SessionManager>(app: App, sessions: Arc<M>, config: StreamableHttpServerConfig) -> MethodRouter {
    let service = StreamableHttpService::new(
        {
            let app = app.clone();
            move || Ok(Transfers { app: app.clone() })
        },
        sessions,
        config,
    );
    any(move |request: Request| {
        let app = app.clone();
        let service = service.clone();
        async move {
            let request = match injected_failure(&app, request).await {
                Ok(request) => request,
                Err(response) => return response,
            };
            service.handle(request).await.map(Body::new)
        }
    })
}

/// `x-demo-fail: <status>` on a `tools/call` of `quote_transfer` or
/// `execute_transfer`: the HTTP answer is that status with the REST body
/// `{"error":"injected_failure"}`, before the MCP layer (after
/// `x-demo-delay-ms`), so nothing executes and, unlike the REST confirm, no
/// attempt is counted. Other MCP messages pass untouched.
async fn injected_failure(app: &App, request: Request) -> Result<Request, Response> {
    let faults = Faults::read(request.headers(), app.config.faults);
    let Some(status) = faults.fail.filter(|_| request.method() == Method::POST) else {
        return Ok(request);
    };
    let (parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(|e| (axum::http::StatusCode::PAYLOAD_TOO_LARGE, e.to_string()).into_response())?;
    if calls_a_business_tool(&bytes) {
        faults.delay().await;
        return Err(api::injected_failure(status));
    }
    Ok(Request::from_parts(parts, Body::from(bytes)))
}

fn calls_a_business_tool(body: &Bytes) -> bool {
    let Ok(message) = serde_json::from_slice::<Value>(body) else {
        return false;
    };
    message["method"] == "tools/call" && [QUOTE, EXECUTE].iter().any(|tool| message["params"]["name"] == *tool)
}

/// One per MCP request (stateless) or session (stateful): cheap, it only
/// holds the shared store and configuration.
#[derive(Clone)]
pub struct Transfers {
    app: App,
}

impl ServerHandler for Transfers {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("idem-demo", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Transfers: quote_transfer first, then execute_transfer with the same amount, currency and \
                 payee_id; get_transfer_status tells what happened to an execution.",
            )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(tools(self.app.config.keys)))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        tools(self.app.config.keys).into_iter().find(|tool| tool.name == name)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        // Streamable HTTP puts the HTTP request head into the extensions.
        let parts = context.extensions.get::<Parts>();
        let headers = parts.map(|p| p.headers.clone()).unwrap_or_default();
        let arguments = serde_json::to_vec(&Value::Object(request.arguments.unwrap_or_default()))
            .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
        let off_schema = Faults::read(&headers, self.app.config.faults).off_schema;
        let mut result = match request.name.as_ref() {
            QUOTE => self.quote(&headers, &arguments).await,
            EXECUTE => {
                let hangup = parts.and_then(|p| p.extensions.get::<Hangup>().cloned());
                self.execute(headers, arguments, hangup).await?
            }
            STATUS => tool_error(json!({
                "error": "not_found",
                "detail": "this service keeps no status by fingerprint: the gateway answers get_transfer_status",
            })),
            other => return Err(ErrorData::invalid_params(format!("unknown tool: {other}"), None)),
        };
        if off_schema {
            off_its_schema(&mut result);
        }
        Ok(result.into())
    }
}

/// `x-demo-off-schema: 1`: a server that does not keep to its `outputSchema`, as many do. A refusal
/// carries its REST error body as `structuredContent` too (the TypeScript SDK refuses that); a quote
/// loses its required `quote_id` (both official SDKs refuse that): so a test sees their validation act.
fn off_its_schema(result: &mut CallToolResult) {
    if result.is_error == Some(true) {
        let text = result.content.first().and_then(|c| c.as_text()).map(|t| t.text.clone());
        result.structured_content = text.and_then(|t| serde_json::from_str(&t).ok());
    } else if let Some(Value::Object(structured)) = result.structured_content.as_mut() {
        structured.remove("quote_id");
    }
}

impl Transfers {
    async fn quote(&self, headers: &HeaderMap, arguments: &[u8]) -> CallToolResult {
        // x-demo-fail was answered before the MCP layer.
        let faults = Faults::read(headers, self.app.config.faults);
        faults.delay().await;
        match TransferRequest::parse(arguments) {
            Ok(req) => tool_result(api::quote(&req, faults.quote_ttl_s)),
            Err(detail) => tool_error(json!({ "error": "invalid_request", "detail": detail })),
        }
    }

    async fn execute(
        &self,
        headers: HeaderMap,
        arguments: Vec<u8>,
        hangup: Option<Hangup>,
    ) -> Result<CallToolResult, ErrorData> {
        let confirmed = api::execute_detached(self.app.clone(), headers, arguments.into())
            .await
            .map_err(|()| ErrorData::internal_error("internal_error", None))?;
        Ok(match confirmed {
            Confirmed::Record(text) => {
                let record = serde_json::from_str(&text).map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
                // The stored text as is: a replay's text block equals the first one's.
                let mut result = CallToolResult::success(vec![ContentBlock::text(text)]);
                result.structured_content = Some(record);
                result
            }
            Confirmed::KeyRequired => tool_error(json!({ "error": "idempotency_key_required" })),
            Confirmed::Injected(status) => {
                tool_error(json!({ "error": "injected_failure", "status": status.as_u16() }))
            }
            Confirmed::Invalid(detail) => tool_error(json!({ "error": "invalid_request", "detail": detail })),
            Confirmed::LimitExceeded => tool_error(json!({ "error": "limit_exceeded" })),
            Confirmed::Reset => match hangup {
                Some(hangup) => {
                    hangup.reset();
                    // Never answer: the connection task drops the socket instead.
                    std::future::pending().await
                }
                None => return Err(ErrorData::internal_error("no connection to reset", None)),
            },
        })
    }
}

fn tool_result(value: Value) -> CallToolResult {
    CallToolResult::structured(value)
}

/// A refusal: `isError: true` and the REST error body as the text block, without `structuredContent`.
/// The body does not conform to the tool's `outputSchema`, and the official TypeScript SDK validates an
/// error's `structuredContent` against it too (modelcontextprotocol/typescript-sdk#1943): a client on it
/// would get an exception instead of the refusal. (The Python SDK validates results that are not errors only.)
fn tool_error(value: Value) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(value.to_string())])
}

/// The three tools, as `tools/list` shows them. `keys`: off under `--no-keys`, whose records carry
/// no `idempotency_key`.
pub fn tools(keys: bool) -> Vec<Tool> {
    let transfer = |extra: Value| {
        let mut properties = json!({
            "amount": {
                "type": ["string", "number"],
                "description": "Amount as a decimal string like \"12.50\" (preferred) or a JSON number",
            },
            "currency": { "type": "string", "description": "ISO 4217 code, e.g. EUR" },
            "payee_id": { "type": "string" },
            "memo": { "type": "string", "description": "Free text for the payee" },
        });
        if let (Some(properties), Value::Object(extra)) = (properties.as_object_mut(), extra) {
            properties.extend(extra);
        }
        object(json!({
            "type": "object",
            "properties": properties,
            "required": ["amount", "currency", "payee_id"],
        }))
    };
    let amount = json!({ "type": ["string", "number"] });
    let quote_output = object(json!({
        "type": "object",
        "properties": {
            "quote_id": { "type": "string" },
            "amount": amount,
            "currency": { "type": "string" },
            "payee_id": { "type": "string" },
            "fee": { "type": "string" },
            "expires_at": { "type": "integer", "description": "Unix seconds" },
            "fingerprint": { "type": "string", "description": "Added by the gateway: pass it to execute_transfer" },
            "fingerprint_expires_at": { "type": "integer" },
        },
        "required": ["quote_id", "amount", "currency", "payee_id", "fee", "expires_at"],
    }));
    let record_output = object(json!({
        "type": "object",
        "properties": {
            "transfer_id": { "type": "string" },
            "status": { "type": "string", "enum": ["executed"] },
            "amount": amount,
            "currency": { "type": "string" },
            "payee_id": { "type": "string" },
            "memo": { "type": ["string", "null"] },
            "idempotency_key": { "type": "string" },
            "executed_at": { "type": "integer", "description": "Unix seconds" },
            "client_ref": { "type": "string" },
        },
        "required": ["transfer_id", "status", "amount", "currency", "payee_id", "idempotency_key", "executed_at"],
        // Strict, as many servers write it: a gateway that added a field the schema does not declare
        // would make the official SDKs refuse the result (tests/tests/mcp_sdk.rs).
        "additionalProperties": false,
    }));
    let record_output = if keys { record_output } else { without_required(record_output, "idempotency_key") };
    // What the gateway answers (DESIGN §7 reply); the service has no status of its own.
    let status_output = object(json!({
        "type": "object",
        "properties": {
            "status": { "type": "string" },
            "meaning": { "type": "string" },
            "instruction": { "type": "string" },
            "retryable": { "type": "boolean" },
            "trace_id": { "type": "string" },
            "result": { "type": ["object", "null"] },
            "result_ref": { "type": "string" },
        },
        "required": ["status"],
    }));
    vec![
        Tool::new(QUOTE, "Quote a transfer: fee and validity. Moves no money.", transfer(json!({})))
            .with_title("Quote a transfer")
            .with_raw_output_schema(Arc::new(quote_output))
            .with_annotations(ToolAnnotations::new().read_only(true)),
        Tool::new(
            EXECUTE,
            "Execute a quoted transfer: moves money. Pass the quote's fingerprint.",
            transfer(json!({ "fingerprint": { "type": "string", "description": "From quote_transfer" } })),
        )
        .with_title("Execute a transfer")
        .with_raw_output_schema(Arc::new(record_output))
        .with_annotations(ToolAnnotations::new().read_only(false).destructive(false).idempotent(true)),
        Tool::new(
            STATUS,
            "What happened to an execution, by the quote's fingerprint.",
            object(json!({
                "type": "object",
                "properties": { "fingerprint": { "type": "string", "description": "From quote_transfer" } },
            })),
        )
        .with_title("Transfer status")
        .with_raw_output_schema(Arc::new(status_output))
        .with_annotations(ToolAnnotations::new().read_only(true)),
    ]
}

fn without_required(mut schema: JsonObject, field: &str) -> JsonObject {
    if let Some(Value::Array(required)) = schema.get_mut("required") {
        required.retain(|r| r != field);
    }
    schema
}

fn object(value: Value) -> JsonObject {
    match value {
        Value::Object(map) => map,
        _ => JsonObject::new(),
    }
}
