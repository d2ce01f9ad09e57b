//! MCP through the guard: a real MCP client (rmcp, the official Rust SDK) talks
//! Streamable HTTP to the demo's MCP server through Envoy and the filter. The
//! fingerprint rides in the tool result and the tool arguments; the nonce
//! reaches the MCP server as the Idempotency-Key header; every gateway answer
//! is a tool result the model can read.

use idem_e2e::*;
use rmcp::model::{CallToolRequestParams, CallToolResult};
use rmcp::service::RunningService;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::{RoleClient, ServiceExt};
use serde_json::{json, Value};
use std::collections::HashMap;

type Client = RunningService<RoleClient, ()>;

/// rmcp's client on `path`, as `subject` (the gateway's identity header).
async fn client(stack: &Stack, path: &str, subject: &str) -> Result<Client, BoxError> {
    let mut headers = HashMap::new();
    headers.insert(
        reqwest13::header::HeaderName::from_static("x-agent-subject"),
        reqwest13::header::HeaderValue::from_str(subject)?,
    );
    let config = StreamableHttpClientTransportConfig::with_uri(stack.url(path)).custom_headers(headers);
    Ok(().serve(StreamableHttpClientTransport::from_config(config)).await?)
}

async fn call(client: &Client, tool: &str, arguments: Value) -> Result<CallToolResult, BoxError> {
    let Value::Object(arguments) = arguments else { return Err("arguments must be an object".into()) };
    Ok(client.call_tool(CallToolRequestParams::new(tool.to_string()).with_arguments(arguments)).await?)
}

fn structured(r: &CallToolResult) -> Value {
    r.structured_content.clone().unwrap_or(Value::Null)
}

/// The gateway's §7 envelope, where every gateway answer carries it (DESIGN §11).
fn envelope(r: &CallToolResult) -> Value {
    r.meta.as_ref().and_then(|m| m.0.get("agent-idempotency/reply")).cloned().unwrap_or(Value::Null)
}

fn args(amount: Value, memo: &str, fp: Option<&str>) -> Value {
    let mut a = json!({"amount": amount, "currency": "EUR", "payee_id": "payee-42", "memo": memo});
    if let Some(fp) = fp {
        a["fingerprint"] = json!(fp);
    }
    a
}

/// initialize → tools/list → quote → execute (drifted memo) → retry → status,
/// on the JSON and the SSE endpoint.
async fn the_agent_flow(path: &str) -> TestResult {
    let Some(opts) = real_stores(false)? else { return Ok(()) };
    let stack = Stack::start(opts).await?;
    let alice = client(&stack, path, SUBJECT).await?;
    let tools = alice.list_all_tools().await?;
    assert_eq!(tools.len(), 3, "tools/list passes through untouched: {tools:?}");

    let quote = call(&alice, "quote_transfer", args(json!("12.50"), "rent", None)).await?;
    let fp = structured(&quote)["fingerprint"].as_str().ok_or_else(|| format!("no fingerprint: {quote:?}"))?.to_owned();
    assert!(structured(&quote)["fingerprint_expires_at"].is_u64());
    let said = serde_json::to_string(&quote.content)?;
    assert!(said.contains(&fp), "the model reads the fingerprint in a text block too: {said}");

    let first = call(&alice, "execute_transfer", args(json!(12.5), "rent, ASAP", Some(&fp))).await?;
    assert_eq!(first.is_error, Some(false), "{first:?}");
    let transfer_id = structured(&first)["transfer_id"].as_str().ok_or("no transfer_id")?.to_owned();
    let ledger = stack.executions().await?;
    assert_eq!(ledger["by_key"][&nonce_of(&fp)?], 1, "the nonce reached the MCP server as Idempotency-Key: {ledger}");

    let again = call(&alice, "execute_transfer", args(json!("12.50"), "please rent ASAP", Some(&fp))).await?;
    assert_eq!(again.is_error, Some(false));
    // The replay is the recorded result: its structuredContent is the tool's own plus the property the
    // gateway declared in the listed output schema (the envelope less its `result`), and the gateway's
    // words ride in `_meta` and a text block.
    let said = envelope(&again);
    let mut expected = structured(&first);
    let mut reply = said.clone();
    reply.as_object_mut().ok_or("no envelope")?.remove("result");
    expected["agent_idempotency"] = reply;
    assert_eq!(structured(&again), expected, "{again:?}");
    assert_eq!(said["status"], "already_completed", "{again:?}");
    assert_eq!(said["result"]["structuredContent"]["transfer_id"], transfer_id.as_str());
    assert_eq!(said["result_ref"], transfer_id.as_str());

    let status = call(&alice, "get_transfer_status", json!({"fingerprint": fp})).await?;
    assert_eq!(status.is_error, Some(false));
    assert_eq!(
        structured(&status)["status"],
        "already_completed",
        "the status tool's output is the envelope: {status:?}"
    );
    assert_eq!(counts(&stack).await?.0, 1);
    alice.cancel().await?;
    Ok(())
}

#[tokio::test]
async fn an_mcp_agent_quotes_executes_once_and_replays_json() -> TestResult {
    the_agent_flow("/mcp").await
}

#[tokio::test]
async fn an_mcp_agent_quotes_executes_once_and_replays_sse() -> TestResult {
    the_agent_flow("/mcp/stream").await
}

/// The SSE-framed endpoint under its first name, kept for configurations that use it.
#[tokio::test]
async fn an_mcp_agent_quotes_executes_once_and_replays_sse_first_name() -> TestResult {
    the_agent_flow("/mcp/sse").await
}

#[tokio::test]
async fn fifty_parallel_executes_of_one_fingerprint_run_once() -> TestResult {
    let Some(opts) = real_stores(false)? else { return Ok(()) };
    let stack = Stack::start(opts).await?;
    let alice = std::sync::Arc::new(client(&stack, "/mcp", SUBJECT).await?);
    let quote = call(&alice, "quote_transfer", args(json!("30.00"), "x", None)).await?;
    let fp = structured(&quote)["fingerprint"].as_str().ok_or("no fingerprint")?.to_owned();
    let mut tasks = Vec::new();
    for i in 0..50 {
        let (alice, fp) = (alice.clone(), fp.clone());
        tasks.push(tokio::spawn(async move {
            call(&alice, "execute_transfer", args(json!(30), &format!("try {i}"), Some(&fp)))
                .await
                .map_err(|e| e.to_string())
        }));
    }
    let mut kinds = HashMap::new();
    for t in tasks {
        let r = t.await?.map_err(|e| -> BoxError { e.into() })?;
        let kind = envelope(&r)["status"].as_str().unwrap_or("executed").to_owned();
        *kinds.entry(kind).or_insert(0) += 1;
    }
    assert_eq!(counts(&stack).await?.0, 1, "one execution: {kinds:?}");
    assert_eq!(kinds.get("executed"), Some(&1), "{kinds:?}");
    Ok(())
}

#[tokio::test]
async fn refusals_are_tool_errors_the_model_can_act_on() -> TestResult {
    let Some(opts) = real_stores(false)? else { return Ok(()) };
    let stack = Stack::start(opts).await?;
    let alice = client(&stack, "/mcp", SUBJECT).await?;
    let quote = call(&alice, "quote_transfer", args(json!("40.00"), "x", None)).await?;
    let fp = structured(&quote)["fingerprint"].as_str().ok_or("no fingerprint")?.to_owned();

    let tampered = call(&alice, "execute_transfer", args(json!("4000.00"), "x", Some(&fp))).await?;
    assert_eq!(tampered.is_error, Some(true));
    assert_eq!(tampered.structured_content, None, "no result, nothing for the output schema to reject");
    assert_eq!(envelope(&tampered)["status"], "params_changed");
    let missing = call(&alice, "execute_transfer", args(json!("40.00"), "x", None)).await?;
    assert_eq!(envelope(&missing)["status"], "fingerprint_missing");
    let bob = client(&stack, "/mcp", "user-bob").await?;
    let stolen = call(&bob, "execute_transfer", args(json!("40.00"), "x", Some(&fp))).await?;
    assert_eq!(stolen.is_error, Some(true));
    assert_eq!(envelope(&stolen)["status"], "forbidden");
    assert_eq!(counts(&stack).await?, (0, 0), "nothing ran, nothing reached the MCP server's execute");
    assert_eq!(stack.stat("wasmcustom.idem.security_events").await?, 2);
    Ok(())
}

/// Garbage at the protocol level is a JSON-RPC error; a batch is refused clearly.
#[tokio::test]
async fn batches_and_broken_envelopes_get_json_rpc_errors() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let post = |body: String| {
        stack
            .http
            .post(stack.url("/mcp"))
            .header("x-agent-subject", SUBJECT)
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(body)
            .send()
    };
    let batch = post(
        json!([{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "execute_transfer"}}])
            .to_string(),
    )
    .await?;
    assert_eq!(batch.status().as_u16(), 400);
    let v: Value = batch.json().await?;
    assert_eq!(v["error"]["code"], -32600);
    let broken = post("{not json".into()).await?;
    let v: Value = broken.json().await?;
    assert_eq!(v["error"]["code"], -32700);
    Ok(())
}
