//! The MCP server (`/mcp`, `/mcp/stream` also named `/mcp/sse`, `/mcp/session`) against the real
//! binary: through rmcp's own Streamable HTTP client, and byte for byte with
//! plain HTTP, the way the gateway's filter will see it (demo/MCP-WIRE.md).

mod support;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use rmcp::model::{CallToolRequestParams, CallToolResult, ClientConfig, ProtocolVersion};
use rmcp::service::RunningService;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::{ClientLifecycleMode, ClientServiceExt, RoleClient, ServiceExt};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::{json, Demo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ACCEPT_BOTH: &str = "application/json, text/event-stream";

type Client = RunningService<RoleClient, ()>;

/// rmcp's client (the `initialize` lifecycle, as `serve` does) on `path`,
/// sending `headers` with every request.
async fn client(url: &str, headers: &[(&str, &str)]) -> Client {
    ().serve(transport(url, headers)).await.expect("MCP initialize")
}

fn transport(url: &str, headers: &[(&str, &str)]) -> StreamableHttpClientTransport<reqwest13::Client> {
    let custom: HashMap<HeaderName, HeaderValue> = headers
        .iter()
        .map(|(k, v)| (HeaderName::from_bytes(k.as_bytes()).unwrap(), HeaderValue::from_str(v).unwrap()))
        .collect();
    StreamableHttpClientTransport::from_config(
        StreamableHttpClientTransportConfig::with_uri(url).custom_headers(custom),
    )
}

async fn call<S: rmcp::Service<RoleClient>>(
    client: &RunningService<RoleClient, S>,
    tool: &str,
    arguments: Value,
) -> CallToolResult {
    let Value::Object(arguments) = arguments else { panic!("arguments must be an object") };
    client.call_tool(CallToolRequestParams::new(tool.to_string()).with_arguments(arguments)).await.expect("tools/call")
}

fn transfer() -> Value {
    json!({ "amount": "12.50", "currency": "EUR", "payee_id": "payee_42", "memo": "rent" })
}

/// The one text block of a result, parsed.
fn text_json(result: &CallToolResult) -> Value {
    assert_eq!(result.content.len(), 1, "{result:?}");
    json(&result.content[0].as_text().expect("a text block").text)
}

fn tools_call(id: u64, tool: &str, arguments: Value) -> Value {
    json!({ "jsonrpc": "2.0", "id": id, "method": "tools/call", "params": { "name": tool, "arguments": arguments } })
}

/// One raw MCP POST, as a client that accepts both framings sends it.
async fn send(demo: &Demo, path: &str, headers: &[(&str, &str)], body: &Value) -> reqwest::Result<reqwest::Response> {
    let mut req = demo
        .client
        .post(demo.url(path))
        .header("content-type", "application/json")
        .header("accept", ACCEPT_BOTH)
        .body(body.to_string());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.send().await
}

/// One raw POST that gets an answer: status, headers, body text.
async fn post(demo: &Demo, path: &str, headers: &[(&str, &str)], body: &Value) -> (u16, HeaderMap, String) {
    let resp = send(demo, path, headers, body).await.expect("POST");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    (status, headers, resp.text().await.expect("body"))
}

fn content_type(headers: &HeaderMap) -> &str {
    headers.get("content-type").map(|v| v.to_str().unwrap()).unwrap_or_default()
}

/// The events of a `text/event-stream` body: each a list of (field, value).
fn sse_events(body: &str) -> Vec<Vec<(String, String)>> {
    body.split("\n\n")
        .filter(|event| !event.is_empty())
        .map(|event| {
            event
                .lines()
                .map(|line| {
                    let (field, value) = line.split_once(':').unwrap_or((line, ""));
                    (field.to_string(), value.strip_prefix(' ').unwrap_or(value).to_string())
                })
                .collect()
        })
        .collect()
}

// ---- through rmcp's client ----

#[tokio::test]
async fn lists_three_tools_with_input_and_output_schemas() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &[]);
    let client = client(&demo.url("/mcp"), &[]).await;
    let server = client.peer_info().expect("initialize result");
    assert_eq!(server.server_info.as_ref().unwrap().name, "idem-demo");
    assert!(server.capabilities.tools.is_some());

    let tools = client.list_all_tools().await.unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    assert_eq!(names, ["quote_transfer", "execute_transfer", "get_transfer_status"]);
    for tool in &tools {
        let input = Value::Object((*tool.input_schema).clone());
        assert_eq!(input["type"], "object", "{}", tool.name);
        let output = Value::Object((**tool.output_schema.as_ref().expect("outputSchema")).clone());
        assert_eq!(output["type"], "object", "{}", tool.name);
        assert!(output["required"].as_array().is_some_and(|r| !r.is_empty()), "{}", tool.name);
    }
    for tool in &tools[..2] {
        let input = Value::Object((*tool.input_schema).clone());
        assert_eq!(input["required"], json!(["amount", "currency", "payee_id"]), "{}", tool.name);
        assert_eq!(input["properties"]["amount"]["type"], json!(["string", "number"]));
    }
    let execute = Value::Object((*tools[1].input_schema).clone());
    assert_eq!(execute["properties"]["fingerprint"]["type"], "string");
    assert_eq!(tools[0].annotations.as_ref().and_then(|a| a.read_only_hint), Some(true));
    assert_eq!(tools[1].annotations.as_ref().and_then(|a| a.read_only_hint), Some(false));
    client.cancel().await.unwrap();
}

/// Quote, execute twice with one key (one execution, the same result),
/// execute with another key (a second execution), and the ledger counts
/// them all: on each of the three endpoints.
async fn executes_once_per_key(path: &str) {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &[]);

    let anonymous = client(&demo.url(path), &[]).await;
    let quote = call(&anonymous, "quote_transfer", transfer()).await;
    assert_eq!(quote.is_error, Some(false));
    let q = quote.structured_content.clone().expect("structuredContent");
    assert_eq!(text_json(&quote), q);
    assert_eq!(q["amount"], "12.50");
    assert_eq!(
        (q["currency"].as_str(), q["payee_id"].as_str(), q["fee"].as_str()),
        (Some("EUR"), Some("payee_42"), Some("1.00"))
    );
    assert!(q["quote_id"].as_str().unwrap().starts_with("q_"));
    assert!(q["expires_at"].is_u64());

    let first_key = client(&demo.url(path), &[("Idempotency-Key", "mcp-k1")]).await;
    let mut args = transfer();
    args["fingerprint"] = json!("fp.ignored-by-the-service");
    let first = call(&first_key, "execute_transfer", args.clone()).await;
    assert_eq!(first.is_error, Some(false), "{first:?}");
    let record = first.structured_content.clone().unwrap();
    assert_eq!(text_json(&first), record);
    assert_eq!(record["status"], "executed");
    assert_eq!(record["amount"], "12.50");
    assert_eq!(record["memo"], "rent");
    assert_eq!(record["idempotency_key"], "mcp-k1");
    assert!(record["transfer_id"].as_str().unwrap().starts_with("t_"));

    // The retry regenerated its memo: the stored record still wins.
    args["memo"] = json!("rent, please ASAP");
    let again = call(&first_key, "execute_transfer", args).await;
    assert_eq!(again, first);

    let second_key = client(&demo.url(path), &[("Idempotency-Key", "mcp-k2")]).await;
    let other = call(&second_key, "execute_transfer", transfer()).await;
    assert_eq!(other.is_error, Some(false));
    assert_ne!(other.structured_content.as_ref().unwrap()["transfer_id"], record["transfer_id"]);

    // The same ledger the REST confirm writes to.
    assert_eq!(
        demo.executions().await,
        json!({
            "total": 2, "by_key": { "mcp-k1": 1, "mcp-k2": 1 },
            "attempts": 3, "attempts_by_key": { "mcp-k1": 2, "mcp-k2": 1 },
        })
    );
    let (status, by_key) = demo.get("/v1/transfers/by-key/mcp-k1").await;
    assert_eq!((status, by_key), (200, record));
    for client in [anonymous, first_key, second_key] {
        client.cancel().await.unwrap();
    }
}

#[tokio::test]
async fn executes_once_per_key_json_endpoint() {
    executes_once_per_key("/mcp").await;
}

#[tokio::test]
async fn executes_once_per_key_sse_endpoint() {
    executes_once_per_key("/mcp/stream").await;
}

/// The SSE-framed endpoint's first name, kept for configurations that still use it.
#[tokio::test]
async fn executes_once_per_key_sse_endpoint_by_its_first_name() {
    executes_once_per_key("/mcp/sse").await;
}

#[tokio::test]
async fn executes_once_per_key_session_endpoint() {
    executes_once_per_key("/mcp/session").await;
}

#[tokio::test]
async fn mcp_and_rest_share_one_key_space() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &[]);
    let (status, rest) = demo.confirm(Some("shared"), &[], &transfer()).await.unwrap();
    assert_eq!(status, 201);
    let client = client(&demo.url("/mcp"), &[("Idempotency-Key", "shared")]).await;
    let mcp = call(&client, "execute_transfer", transfer()).await;
    // Replayed byte for byte, text block included.
    assert_eq!(mcp.content[0].as_text().unwrap().text, rest);
    assert_eq!(demo.executions().await["total"], 1);
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn without_a_key_execute_is_refused_like_rest() {
    let dir = tempfile::tempdir().unwrap();
    // --no-dedup too: the REST confirm refuses a keyless call either way.
    for flags in [&[][..], &["--no-dedup"][..]] {
        let demo = Demo::start(dir.path().join(flags.len().to_string()).as_path(), flags);
        let client = client(&demo.url("/mcp"), &[]).await;
        let refused = call(&client, "execute_transfer", transfer()).await;
        assert_eq!(refused.is_error, Some(true));
        assert_eq!(refused.structured_content, None);
        assert_eq!(text_json(&refused), json!({ "error": "idempotency_key_required" }));
        let exec = demo.executions().await;
        assert_eq!((exec["total"].as_i64(), exec["attempts"].as_i64()), (Some(0), Some(1)), "{flags:?}");
        client.cancel().await.unwrap();
    }
}

#[tokio::test]
async fn no_dedup_executes_every_call() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &["--no-dedup"]);
    let client = client(&demo.url("/mcp"), &[("Idempotency-Key", "again")]).await;
    let first = call(&client, "execute_transfer", transfer()).await;
    let second = call(&client, "execute_transfer", transfer()).await;
    assert_eq!((first.is_error, second.is_error), (Some(false), Some(false)));
    assert_ne!(first.structured_content.unwrap()["transfer_id"], second.structured_content.unwrap()["transfer_id"]);
    assert_eq!(demo.executions().await["by_key"], json!({ "again": 2 }));
    client.cancel().await.unwrap();
}

/// `--no-keys`: the tool executes without a key, and its record (no `idempotency_key`) keeps to the
/// output schema this mode lists (rmcp's client validates it).
#[tokio::test]
async fn no_keys_executes_without_a_key_and_keeps_to_its_schema() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &["--no-keys"]);
    let client = client(&demo.url("/mcp"), &[]).await;
    let tools = client.list_all_tools().await.unwrap();
    let execute = tools.iter().find(|t| t.name == "execute_transfer").unwrap();
    let required = execute.output_schema.as_ref().unwrap()["required"].clone();
    assert!(!required.as_array().unwrap().contains(&json!("idempotency_key")), "{required}");
    let mut args = transfer();
    args["client_ref"] = json!("inv-3");
    let done = call(&client, "execute_transfer", args).await;
    assert_eq!(done.is_error, Some(false), "{done:?}");
    let record = done.structured_content.unwrap();
    assert_eq!((record.get("idempotency_key"), &record["client_ref"]), (None, &json!("inv-3")));
    assert_eq!(demo.executions().await["total"], 1);
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn refusals_are_tool_errors_with_the_rest_bodies() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &[]);
    let client = client(&demo.url("/mcp"), &[("Idempotency-Key", "bad")]).await;
    let mut over = transfer();
    over["amount"] = json!("10000.01");
    let limit = call(&client, "execute_transfer", over).await;
    // The REST body as the text block, and no structuredContent: it would not conform to the outputSchema.
    assert_eq!((limit.is_error, &limit.structured_content), (Some(true), &None));
    assert_eq!(text_json(&limit), json!({ "error": "limit_exceeded" }));
    for tool in ["quote_transfer", "execute_transfer"] {
        let invalid = call(&client, tool, json!({ "amount": "12,50", "currency": "EUR", "payee_id": "p" })).await;
        assert_eq!((invalid.is_error, &invalid.structured_content), (Some(true), &None), "{tool}");
        let body = text_json(&invalid);
        assert_eq!(body["error"], "invalid_request", "{tool}");
        assert!(body["detail"].as_str().is_some_and(|d| d.contains("plain decimal")), "{body}");
    }
    let status = call(&client, "get_transfer_status", json!({ "fingerprint": "fp" })).await;
    assert_eq!((status.is_error, &status.structured_content), (Some(true), &None));
    assert_eq!(text_json(&status)["error"], "not_found");
    let unknown = client.call_tool(CallToolRequestParams::new("wire_money")).await.unwrap_err();
    assert!(unknown.to_string().contains("unknown tool: wire_money"), "{unknown}");
    assert_eq!(demo.executions().await["total"], 0);
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn off_schema_answers_leave_the_output_schema() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &["--faults"]);
    let client = client(&demo.url("/mcp"), &[("x-demo-off-schema", "1")]).await;
    let quote = call(&client, "quote_transfer", transfer()).await;
    let q = quote.structured_content.clone().expect("structuredContent");
    assert!(q.get("quote_id").is_none() && q["fee"] == "1.00", "{q}");
    let refused = call(&client, "execute_transfer", transfer()).await;
    assert_eq!(refused.is_error, Some(true));
    assert_eq!(refused.structured_content, Some(json!({ "error": "idempotency_key_required" })));
    assert_eq!(text_json(&refused), json!({ "error": "idempotency_key_required" }));
    // Without --faults the header is ignored.
    let plain = Demo::start(&dir.path().join("plain"), &[]);
    let client = self::client(&plain.url("/mcp"), &[("x-demo-off-schema", "1")]).await;
    let quote = call(&client, "quote_transfer", transfer()).await;
    assert!(quote.structured_content.unwrap()["quote_id"].is_string());
}

#[tokio::test]
async fn no_mcp_serves_no_endpoint() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &["--no-mcp"]);
    for path in ["/mcp", "/mcp/stream", "/mcp/sse", "/mcp/session"] {
        let (status, _, _) = post(&demo, path, &[], &tools_call(1, "quote_transfer", transfer())).await;
        assert_eq!(status, 404, "{path}");
    }
}

// ---- the wire, as the filter will read it ----

/// The stateless JSON endpoint needs no `initialize` and no session: one
/// POST, one `application/json` JSON-RPC response.
#[tokio::test]
async fn wire_json_response() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &[]);
    // Parsed (arbitrary_precision), not `json!`: the literal 12.50 stays 12.50.
    let request = tools_call(7, "execute_transfer", json(r#"{"amount":12.50,"currency":"EUR","payee_id":"p1"}"#));
    let headers = [("Idempotency-Key", "wire-1"), ("MCP-Protocol-Version", "2025-06-18")];
    let (status, head, body) = post(&demo, "/mcp", &headers, &request).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(content_type(&head), "application/json");
    assert!(head.get("mcp-session-id").is_none());
    let answer = json(&body);
    assert_eq!(answer["jsonrpc"], "2.0");
    assert_eq!(answer["id"], 7);
    let result = &answer["result"];
    assert_eq!(result["isError"], false);
    assert_eq!(result["content"][0]["type"], "text");
    let record = &result["structuredContent"];
    assert_eq!(json(result["content"][0]["text"].as_str().unwrap()), *record);
    // The number literal survives the JSON-RPC envelope, both copies of it.
    assert!(body.contains(r#""amount":12.50"#), "{body}");
    assert_eq!(record["idempotency_key"], "wire-1");

    // A replay is the same body except the JSON-RPC id.
    let (_, _, replay) =
        post(&demo, "/mcp", &headers, &tools_call(8, "execute_transfer", request["params"]["arguments"].clone())).await;
    assert_eq!(json(&replay)["result"], *result);
    assert_eq!(json(&replay)["id"], 8);

    // String ids are echoed as strings.
    let (_, _, by_string) = post(
        &demo,
        "/mcp",
        &headers,
        &json!({ "jsonrpc": "2.0", "id": "call-9", "method": "tools/call", "params": request["params"] }),
    )
    .await;
    assert_eq!(json(&by_string)["id"], "call-9");
}

#[tokio::test]
async fn wire_sse_response_is_one_data_event() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &[]);
    let request = tools_call(3, "quote_transfer", transfer());
    let (status, head, body) = post(&demo, "/mcp/stream", &[], &request).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(content_type(&head), "text/event-stream");
    assert!(head.get("mcp-session-id").is_none());
    let events = sse_events(&body);
    assert_eq!(events.len(), 1, "{body:?}");
    assert_eq!(events[0].len(), 1, "{body:?}");
    assert_eq!(events[0][0].0, "data");
    assert!(body.starts_with("data: {") && body.ends_with("}\n\n"), "{body:?}");
    let answer = json(&events[0][0].1);
    assert_eq!(answer["id"], 3);
    assert_eq!(answer["result"]["structuredContent"]["amount"], "12.50");
}

/// The SDK's stateful mode: a session from `initialize` on, every answer an
/// SSE stream that opens with an empty priming event.
#[tokio::test]
async fn wire_session_mode() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &[]);
    let initialize = json!({
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": { "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": { "name": "raw", "version": "1" } },
    });
    let (status, head, body) = post(&demo, "/mcp/session", &[], &initialize).await;
    assert_eq!((status, content_type(&head)), (200, "text/event-stream"), "{body}");
    let session = head.get("mcp-session-id").expect("Mcp-Session-Id").to_str().unwrap().to_string();
    let events = sse_events(&body);
    assert_eq!(events.len(), 2, "{body:?}");
    assert_eq!(events[0], [("data".into(), "".into()), ("id".into(), "0".into()), ("retry".into(), "3000".into())]);
    assert_eq!(json(&events[1][0].1)["result"]["protocolVersion"], "2025-06-18");

    let call = tools_call(2, "execute_transfer", transfer());
    let (status, _, body) = post(&demo, "/mcp/session", &[("Idempotency-Key", "sess")], &call).await;
    assert_eq!((status, body.as_str()), (400, "Bad Request: Session ID is required"));

    let with_session = [("Mcp-Session-Id", session.as_str()), ("MCP-Protocol-Version", "2025-06-18")];
    let initialized = json!({ "jsonrpc": "2.0", "method": "notifications/initialized" });
    let (status, _, body) = post(&demo, "/mcp/session", &with_session, &initialized).await;
    assert_eq!((status, body.as_str()), (202, ""));

    let headers = [with_session[0], with_session[1], ("Idempotency-Key", "sess")];
    let (status, head, body) = post(&demo, "/mcp/session", &headers, &call).await;
    assert_eq!((status, content_type(&head)), (200, "text/event-stream"), "{body}");
    let events = sse_events(&body);
    assert_eq!(events.len(), 2, "{body:?}");
    assert_eq!(events[0][0], ("data".into(), "".into()));
    let (data, id) = (&events[1][0], &events[1][1]);
    assert_eq!((data.0.as_str(), id.0.as_str()), ("data", "id"));
    assert_eq!(json(&data.1)["result"]["structuredContent"]["idempotency_key"], "sess");
    assert_eq!(demo.executions().await["total"], 1);
}

#[tokio::test]
async fn wire_refusals_before_the_tool() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &[]);
    let call = tools_call(1, "quote_transfer", transfer());
    // Both media types must be acceptable, even on the JSON endpoint.
    let resp = demo
        .client
        .post(demo.url("/mcp"))
        .header("content-type", "application/json")
        .header("accept", "application/json")
        .body(call.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 406);
    let (status, head, _) = post(&demo, "/mcp", &[("MCP-Protocol-Version", "1999-01-01")], &call).await;
    assert_eq!(status, 400);
    assert!(head.get("content-type").is_none_or(|v| v != "application/json"));
    for (content_type, body) in [("text/plain", call.to_string()), ("application/json", "not json".to_string())] {
        let resp = demo
            .client
            .post(demo.url("/mcp"))
            .header("content-type", content_type)
            .header("accept", ACCEPT_BOTH)
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 415, "{content_type}");
    }
    let notification = json!({ "jsonrpc": "2.0", "method": "notifications/initialized" });
    assert_eq!(post(&demo, "/mcp", &[], &notification).await.0, 202);
    let resp = demo.client.get(demo.url("/mcp")).header("accept", ACCEPT_BOTH).send().await.unwrap();
    assert_eq!((resp.status().as_u16(), resp.headers()["allow"].to_str().unwrap()), (405, "POST"));
    // An unknown tool is a JSON-RPC error, not a tool result.
    let (status, _, body) = post(&demo, "/mcp", &[], &tools_call(4, "wire_money", json!({}))).await;
    let answer = json(&body);
    assert_eq!(
        (status, answer["id"].as_i64(), answer["error"]["code"].as_i64()),
        (200, Some(4), Some(-32602)),
        "{body}"
    );
}

/// Protocol 2026-07-28 (no `initialize`; version and client in `params._meta`):
/// results carry `resultType`, and the SEP-2243 headers must match the body.
#[tokio::test]
async fn wire_2026_07_28_request_metadata_and_headers() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &[]);
    let mut call = tools_call(5, "execute_transfer", transfer());
    call["params"]["_meta"] = json!({
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientInfo": { "name": "raw", "version": "1" },
        "io.modelcontextprotocol/clientCapabilities": {},
    });
    let version = ("MCP-Protocol-Version", "2026-07-28");
    let key = ("Idempotency-Key", "new-1");
    let headers = [version, key, ("Mcp-Method", "tools/call"), ("Mcp-Name", "execute_transfer")];
    let (status, head, body) = post(&demo, "/mcp", &headers, &call).await;
    assert_eq!((status, content_type(&head)), (200, "application/json"), "{body}");
    let result = &json(&body)["result"];
    assert_eq!(result["resultType"], "complete");
    assert_eq!(result["structuredContent"]["idempotency_key"], "new-1");

    // Refused before the tool runs: HTTP 400, JSON-RPC error -32020.
    let lying = [version, key, ("Mcp-Method", "tools/call"), ("Mcp-Name", "quote_transfer")];
    let missing = [version, key];
    for (label, headers) in [("Mcp-Name mismatch", &lying[..]), ("no Mcp-Method", &missing[..])] {
        let (status, head, body) = post(&demo, "/mcp", headers, &call).await;
        assert_eq!((status, content_type(&head)), (400, "application/json"), "{label}: {body}");
        let error = &json(&body)["error"];
        assert_eq!(error["code"], -32020, "{label}: {body}");
    }
    assert_eq!(demo.executions().await["attempts"], 1);
}

// ---- what rmcp's client puts on the wire ----

/// The bytes a client sent on one connection.
type Sent = Arc<Mutex<Vec<u8>>>;

/// A TCP relay in front of the demo that keeps what clients send, per connection.
struct Recorder {
    url: String,
    connections: Arc<Mutex<Vec<Sent>>>,
}

impl Recorder {
    async fn start(upstream: &str) -> Recorder {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let connections: Arc<Mutex<Vec<Sent>>> = Arc::default();
        let (upstream, all) = (upstream.to_string(), connections.clone());
        tokio::spawn(async move {
            loop {
                let (inbound, _) = listener.accept().await.unwrap();
                let outbound = tokio::net::TcpStream::connect(&upstream).await.unwrap();
                let log = Sent::default();
                all.lock().unwrap().push(log.clone());
                let (mut client_read, mut client_write) = inbound.into_split();
                let (mut server_read, mut server_write) = outbound.into_split();
                tokio::spawn(async move {
                    let mut buf = vec![0; 16 * 1024];
                    while let Ok(n @ 1..) = client_read.read(&mut buf).await {
                        log.lock().unwrap().extend_from_slice(&buf[..n]);
                        if server_write.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
                tokio::spawn(async move { tokio::io::copy(&mut server_read, &mut client_write).await });
            }
        });
        Recorder { url, connections }
    }

    /// Every request received so far: (lower-cased headers, body).
    fn requests(&self) -> Vec<(HashMap<String, String>, Value)> {
        let mut requests = Vec::new();
        for log in self.connections.lock().unwrap().iter() {
            let bytes = log.lock().unwrap().clone();
            let mut rest = &bytes[..];
            while let Some(end) = rest.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = std::str::from_utf8(&rest[..end]).unwrap();
                let headers: HashMap<String, String> = head
                    .lines()
                    .skip(1)
                    .filter_map(|l| l.split_once(':'))
                    .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
                    .collect();
                assert!(!headers.contains_key("transfer-encoding"), "chunked request: {head}");
                let len: usize = headers.get("content-length").map_or(0, |l| l.parse().unwrap());
                let body = &rest[end + 4..end + 4 + len];
                let body = if body.is_empty() { Value::Null } else { serde_json::from_slice(body).unwrap() };
                requests.push((headers, body));
                rest = &rest[end + 4 + len..];
            }
        }
        requests
    }

    fn tools_call(&self) -> (HashMap<String, String>, Value) {
        let calls: Vec<_> = self.requests().into_iter().filter(|(_, body)| body["method"] == "tools/call").collect();
        assert_eq!(calls.len(), 1, "{calls:?}");
        calls.into_iter().next().unwrap()
    }
}

#[tokio::test]
async fn rmcp_client_initialize_lifecycle_on_the_wire() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &[]);
    let recorder = Recorder::start(&demo.addr).await;
    let client = client(&format!("{}/mcp", recorder.url), &[("Idempotency-Key", "rec-1")]).await;
    let result = call(&client, "execute_transfer", transfer()).await;
    assert_eq!(result.is_error, Some(false));
    client.cancel().await.unwrap();

    let methods: Vec<Value> = recorder.requests().into_iter().map(|(_, body)| body["method"].clone()).collect();
    assert_eq!(
        methods[..3],
        [json!("initialize"), json!("notifications/initialized"), json!("tools/call")],
        "{methods:?}"
    );
    // It asks for the newest version in `initialize` (no version header
    // yet); the server settles on the newest one that has a handshake.
    let (init_headers, initialize) = &recorder.requests()[0];
    assert_eq!(initialize["params"]["protocolVersion"], ProtocolVersion::LATEST.to_string());
    assert!(!init_headers.contains_key("mcp-protocol-version"));

    let (headers, body) = recorder.tools_call();
    assert_eq!(headers["content-type"], "application/json");
    assert_eq!(headers["accept"], "text/event-stream, application/json");
    assert_eq!(headers["mcp-protocol-version"], ProtocolVersion::LATEST_WITH_INITIALIZE.to_string());
    assert_eq!(ProtocolVersion::LATEST_WITH_INITIALIZE.to_string(), "2025-11-25");
    assert_eq!(headers["idempotency-key"], "rec-1");
    // Stateless server: no session to carry; below 2026-07-28: no SEP-2243 headers.
    for absent in ["mcp-session-id", "mcp-method", "mcp-name"] {
        assert!(!headers.contains_key(absent), "{absent}: {headers:?}");
    }
    // Ids count from 0 (initialize); rmcp adds a progress token to every call.
    assert_eq!(body["jsonrpc"], "2.0");
    assert_eq!(body["id"], 1, "{body}");
    assert_eq!(body["params"]["_meta"], json!({ "progressToken": 0 }), "{body}");
    assert_eq!(body["params"]["name"], "execute_transfer");
    assert_eq!(body["params"]["arguments"], transfer());
}

#[tokio::test]
async fn rmcp_client_discover_lifecycle_on_the_wire() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &[]);
    let recorder = Recorder::start(&demo.addr).await;
    let lifecycle = ClientLifecycleMode::Discover { preferred_versions: vec![ProtocolVersion::V_2026_07_28] };
    let client = ClientConfig::default()
        .serve_with_lifecycle(transport(&format!("{}/mcp", recorder.url), &[("Idempotency-Key", "rec-2")]), lifecycle)
        .await
        .expect("server/discover");
    // The client learns tool schemas (for Mcp-Param-*) from tools/list.
    assert_eq!(client.list_all_tools().await.unwrap().len(), 3);
    let result = call(&client, "execute_transfer", transfer()).await;
    assert_eq!(result.structured_content.unwrap()["idempotency_key"], "rec-2");
    client.cancel().await.unwrap();

    let methods: Vec<Value> = recorder.requests().into_iter().map(|(_, body)| body["method"].clone()).collect();
    assert_eq!(methods, [json!("server/discover"), json!("tools/list"), json!("tools/call")]);
    let (headers, body) = recorder.tools_call();
    assert_eq!(headers["mcp-protocol-version"], "2026-07-28");
    assert_eq!(headers["mcp-method"], "tools/call");
    assert_eq!(headers["mcp-name"], "execute_transfer");
    assert!(!headers.contains_key("mcp-session-id"));
    let meta = &body["params"]["_meta"];
    assert_eq!(meta["io.modelcontextprotocol/protocolVersion"], "2026-07-28", "{body}");
    assert!(meta["io.modelcontextprotocol/clientInfo"]["name"].is_string(), "{body}");
    assert_eq!(body["params"]["arguments"], transfer());
    assert_eq!(demo.executions().await["total"], 1);
}

// ---- fault headers ----

#[tokio::test]
async fn fail_answers_the_http_status_before_the_tool() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &["--faults"]);
    let fail = [("Idempotency-Key", "f1"), ("x-demo-fail", "503")];
    let (status, head, body) = post(&demo, "/mcp", &fail, &tools_call(1, "execute_transfer", transfer())).await;
    assert_eq!(
        (status, content_type(&head), json(&body)),
        (503, "application/json", json!({ "error": "injected_failure" }))
    );
    let (status, _, _) = post(&demo, "/mcp/stream", &fail, &tools_call(1, "quote_transfer", transfer())).await;
    assert_eq!(status, 503);
    // Not a business call: served as usual.
    let (status, _, body) =
        post(&demo, "/mcp", &fail, &json!({ "jsonrpc": "2.0", "id": 2, "method": "tools/list" })).await;
    assert_eq!(status, 200, "{body}");
    let (status, _, body) = post(&demo, "/mcp", &fail, &tools_call(3, "get_transfer_status", json!({}))).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(demo.executions().await, json!({ "total": 0, "by_key": {}, "attempts": 0, "attempts_by_key": {} }));

    // Without --faults the header means nothing.
    let plain = Demo::start(&dir.path().join("plain"), &[]);
    let (status, _, _) = post(&plain, "/mcp", &fail, &tools_call(1, "execute_transfer", transfer())).await;
    assert_eq!(status, 200);
    assert_eq!(plain.executions().await["total"], 1);
}

#[tokio::test]
async fn delay_holds_the_answer() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &["--faults"]);
    for (path, tool) in [("/mcp", "execute_transfer"), ("/mcp/stream", "quote_transfer")] {
        let started = Instant::now();
        let headers = [("Idempotency-Key", "slow"), ("x-demo-delay-ms", "400")];
        let (status, _, body) = post(&demo, path, &headers, &tools_call(1, tool, transfer())).await;
        assert_eq!(status, 200, "{body}");
        assert!(started.elapsed() >= Duration::from_millis(400), "{path}: {:?}", started.elapsed());
    }
}

#[tokio::test]
async fn a_caller_that_hangs_up_does_not_stop_the_execution() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &["--faults"]);
    for (path, key) in [("/mcp", "late-json"), ("/mcp/stream", "late-sse")] {
        let impatient = reqwest::Client::builder().timeout(Duration::from_millis(100)).build().unwrap();
        let request = impatient
            .post(demo.url(path))
            .header("content-type", "application/json")
            .header("accept", ACCEPT_BOTH)
            .header("Idempotency-Key", key)
            .header("x-demo-delay-ms", "400")
            .body(tools_call(1, "execute_transfer", transfer()).to_string());
        // On SSE the 200 and its headers come at once, before the tool has run:
        // only the body waits.
        let head = request.send().await;
        if path == "/mcp/stream" {
            let head = head.unwrap();
            assert_eq!((head.status().as_u16(), content_type(head.headers())), (200, "text/event-stream"));
            assert!(head.text().await.unwrap_err().is_timeout());
        } else {
            assert!(head.unwrap_err().is_timeout());
        }
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(demo.executions().await["by_key"], json!({ "late-json": 1, "late-sse": 1 }));
}

#[tokio::test]
async fn crash_after_commit_keeps_the_row() {
    let dir = tempfile::tempdir().unwrap();
    let db = support::db_path(dir.path());
    let mut demo = Demo::start_with(&db, &["--faults"], &[]);
    let headers = [("Idempotency-Key", "crash"), ("x-demo-crash-after-commit", "1")];
    let sent = send(&demo, "/mcp", &headers, &tools_call(1, "execute_transfer", transfer())).await;
    assert!(sent.is_err(), "answered: {sent:?}");
    assert!(demo.wait_exit(Duration::from_secs(5)).success());
    drop(demo);
    let demo = Demo::start_with(&db, &[], &[]);
    assert_eq!(demo.executions().await["by_key"], json!({ "crash": 1 }));
}

#[tokio::test]
async fn reset_first_drops_only_the_first_attempt() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &["--faults"]);
    let headers = [("Idempotency-Key", "reset"), ("x-demo-reset", "first")];
    let call = tools_call(1, "execute_transfer", transfer());
    let first = send(&demo, "/mcp", &headers, &call).await;
    assert!(first.is_err(), "answered: {first:?}");
    let (status, _, body) = post(&demo, "/mcp", &headers, &call).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(json(&body)["result"]["isError"], false);
    assert_eq!(demo.executions().await["attempts_by_key"], json!({ "reset": 2 }));
    assert_eq!(demo.executions().await["total"], 1);
}
