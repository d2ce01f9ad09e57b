//! The standing attack suite, part 3: MCP messages the guard must not misclassify (DESIGN §6: "never
//! route on a claim the body can contradict"; §11). Every attack is an `execute_transfer` the demo would
//! really run — amount 9999.00 to a new payee, no fingerprint, the caller's own Idempotency-Key (the demo
//! executes any call that carries a key) — dressed so that a guard that believes headers, or compares
//! strings the way the server does not, lets it through. The answer must be a JSON-RPC error from the
//! gateway (HTTP 400) and Envoy must have sent nothing to the demo.
//!
//! `MCP-Protocol-Version: 2025-06-18`: at that version the demo's rmcp server treats `Mcp-Method` and
//! `Mcp-Name` as hints it does not check (it checks them only from 2026-07-28 on), as many servers do.

use idem_e2e::bypass::{assert_rpc_error, assert_tool_error, fresh_key, mcp_args, seen, show, tools_call};
use idem_e2e::*;
use serde_json::{json, Value};

/// POST `body` (sent as is) to `path` as alice, with `headers` and the caller's own Idempotency-Key.
async fn mcp_raw(stack: &Stack, path: &str, headers: &[(&str, &str)], body: String) -> Result<Answer, BoxError> {
    let mut req = stack
        .http
        .post(stack.url(path))
        .header("x-agent-subject", SUBJECT)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2025-06-18")
        .header("idempotency-key", fresh_key("client-chosen"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let r = req.body(body).send().await?;
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    let body = r.bytes().await?.to_vec();
    let json = serde_json::from_slice(&body).unwrap_or(Value::Null);
    Ok(Answer { status, headers, body, json })
}

async fn mcp(stack: &Stack, headers: &[(&str, &str)], body: &Value) -> Result<Answer, BoxError> {
    mcp_raw(stack, "/mcp", headers, body.to_string()).await
}

/// The unguarded execute every attack carries.
fn evil_execute(id: i64) -> Value {
    tools_call(json!(id), "execute_transfer", mcp_args("9999.00", "payee-mallory", None))
}

/// A gateway JSON-RPC error about a header (`-32020`, the message naming it), and nothing forwarded.
async fn refused_for_header(stack: &Stack, headers: &[(&str, &str)], header: &str) -> TestResult {
    let before = seen(stack).await?;
    let a = mcp(stack, headers, &evil_execute(5)).await?;
    assert_rpc_error(&a, 400, -32020);
    let message = a.json["error"]["message"].as_str().unwrap_or_default().to_ascii_lowercase();
    assert!(message.contains(header), "the error names {header}: {}", show(&a));
    seen(stack).await?.assert_same(before, &format!("an execute behind {headers:?}"));
    Ok(())
}

// ---------------------------------------------------------------- headers that contradict the body

#[tokio::test]
async fn mcp_method_tools_list_over_a_tools_call_is_32020() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    refused_for_header(&stack, &[("mcp-method", "tools/list")], "mcp-method").await
}

#[tokio::test]
async fn mcp_method_notification_over_a_tools_call_is_32020() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    refused_for_header(&stack, &[("mcp-method", "notifications/initialized")], "mcp-method").await
}

#[tokio::test]
async fn mcp_name_of_an_unlisted_tool_over_execute_is_32020() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    refused_for_header(&stack, &[("mcp-method", "tools/call"), ("mcp-name", "some_unlisted_tool")], "mcp-name").await
}

/// A listed tool's name over another listed tool's call: today -32602, which refuses too but is not the
/// header-mismatch error the spec names.
#[tokio::test]
async fn mcp_name_of_another_listed_tool_is_32020() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    refused_for_header(&stack, &[("mcp-method", "tools/call"), ("mcp-name", "quote_transfer")], "mcp-name").await
}

/// The controls: truthful headers change nothing (the execute is refused as a tool error, tools/list
/// passes through to the server).
#[tokio::test]
async fn truthful_mcp_headers_are_guarded_as_without() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let before = seen(&stack).await?;
    let a = mcp(&stack, &[("mcp-method", "tools/call"), ("mcp-name", "execute_transfer")], &evil_execute(6)).await?;
    assert_tool_error(&a, "fingerprint_missing");
    seen(&stack).await?.assert_same(before, "an execute without a fingerprint");
    let list = json!({"jsonrpc": "2.0", "id": 7, "method": "tools/list"});
    let a = mcp(&stack, &[("mcp-method", "tools/list")], &list).await?;
    assert_eq!(a.status, 200, "{}", show(&a));
    assert_eq!(a.json["result"]["tools"].as_array().map(Vec::len), Some(3), "{}", show(&a));
    assert_eq!(seen(&stack).await?.forwarded, before.forwarded + 1, "tools/list reached the server");
    Ok(())
}

// ---------------------------------------------------------------- messages the guard must classify

#[tokio::test]
async fn a_tools_call_notification_is_refused() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let before = seen(&stack).await?;
    let mut call = evil_execute(0);
    call.as_object_mut().map(|m| m.remove("id"));
    let a = mcp(&stack, &[], &call).await?;
    assert_rpc_error(&a, 400, -32600);
    seen(&stack).await?.assert_same(before, "a tools/call notification");
    Ok(())
}

#[tokio::test]
async fn a_batch_holding_a_tools_call_is_refused() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let before = seen(&stack).await?;
    let a = mcp(&stack, &[], &json!([evil_execute(8)])).await?;
    assert_rpc_error(&a, 400, -32600);
    let a = mcp(&stack, &[], &json!([{"jsonrpc": "2.0", "id": 9, "method": "tools/list"}, evil_execute(10)])).await?;
    assert_rpc_error(&a, 400, -32600);
    seen(&stack).await?.assert_same(before, "batches");
    Ok(())
}

/// `tools/call` spelled so that a byte comparison says "another method" while a lenient server (case
/// folding, trimming, C strings) may still call the tool: the gateway cannot classify it, so it must not
/// forward it. Today the demo's rmcp refuses these itself; the gateway must not rely on that.
#[tokio::test]
async fn method_spellings_of_tools_call_are_refused_by_the_gateway() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    for method in ["Tools/Call", "TOOLS/CALL", "tools/call ", " tools/call", "tools/call\u{0}", "tools/call\n"] {
        let before = seen(&stack).await?;
        let mut call = evil_execute(12);
        call["method"] = json!(method);
        let a = mcp(&stack, &[], &call).await?;
        assert_eq!(a.status, 400, "{method:?}: {}", show(&a));
        assert!(a.json["error"]["code"].is_i64(), "{method:?}: a JSON-RPC error: {}", show(&a));
        seen(&stack).await?.assert_same(before, &format!("method {method:?}"));
    }
    Ok(())
}

#[tokio::test]
async fn name_spellings_of_a_guarded_tool_are_refused_by_the_gateway() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    for name in
        ["Execute_Transfer", "EXECUTE_TRANSFER", "execute_transfer ", " execute_transfer", "execute_transfer\u{0}"]
    {
        let before = seen(&stack).await?;
        let call = tools_call(json!(13), name, mcp_args("9999.00", "payee-mallory", None));
        let a = mcp(&stack, &[], &call).await?;
        assert_eq!(a.status, 400, "{name:?}: {}", show(&a));
        assert!(a.json["error"]["code"].is_i64(), "{name:?}: a JSON-RPC error: {}", show(&a));
        seen(&stack).await?.assert_same(before, &format!("tool name {name:?}"));
    }
    Ok(())
}

/// The control: a tool the route does not list, and that is no spelling of one it does, passes through
/// untouched (DESIGN §11), and the server answers it.
#[tokio::test]
async fn an_unrelated_unlisted_tool_passes_through() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let before = seen(&stack).await?;
    let a = mcp(&stack, &[], &tools_call(json!(14), "get_weather", json!({"city": "Berlin"}))).await?;
    assert_eq!(seen(&stack).await?.forwarded, before.forwarded + 1, "reached the server: {}", show(&a));
    assert!(a.json["error"].is_object() || a.json["result"]["isError"] == true, "the server refused: {}", show(&a));
    assert_eq!(counts(&stack).await?, (0, 0));
    Ok(())
}

/// Duplicate JSON keys: serde keeps the last, other parsers the first; whichever the server uses, the
/// gateway's reading must not be the other one.
#[tokio::test]
async fn duplicate_json_keys_in_an_mcp_message_are_refused() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let args = mcp_args("9999.00", "payee-mallory", None).to_string();
    let bodies = [
        format!(
            r#"{{"jsonrpc":"2.0","id":15,"method":"tools/list","method":"tools/call","params":{{"name":"execute_transfer","arguments":{args}}}}}"#
        ),
        format!(
            r#"{{"jsonrpc":"2.0","id":16,"method":"tools/call","params":{{"name":"get_weather","name":"execute_transfer","arguments":{args}}}}}"#
        ),
        format!(
            r#"{{"jsonrpc":"2.0","id":17,"method":"tools/call","params":{{"name":"execute_transfer","arguments":{{}},"arguments":{args}}}}}"#
        ),
    ];
    for body in bodies {
        let before = seen(&stack).await?;
        let a = mcp_raw(&stack, "/mcp", &[], body.clone()).await?;
        assert_rpc_error(&a, 400, -32700);
        seen(&stack).await?.assert_same(before, &body);
    }
    Ok(())
}

/// MCP task augmentation (`params.task`): the server answers with a task handle and runs the tool later,
/// so the gateway cannot hold and record the tool's result. A guarded tool refuses it.
#[tokio::test]
async fn a_task_augmented_call_of_a_guarded_tool_is_refused() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let quote = mcp(&stack, &[], &tools_call(json!(18), "quote_transfer", mcp_args("50.00", "payee-42", None))).await?;
    let fp = quote.json["result"]["structuredContent"]["fingerprint"]
        .as_str()
        .ok_or_else(|| format!("no fingerprint: {}", show(&quote)))?
        .to_owned();
    let before = seen(&stack).await?;
    let mut call = tools_call(json!(19), "execute_transfer", mcp_args("50.00", "payee-42", Some(&fp)));
    call["params"]["task"] = json!({"ttl": 60000});
    let a = mcp(&stack, &[], &call).await?;
    assert_eq!(a.status, 400, "{}", show(&a));
    assert!(a.json["error"]["code"].is_i64(), "a JSON-RPC error: {}", show(&a));
    seen(&stack).await?.assert_same(before, "a task-augmented execute");
    // The same call without the task runs once, as always.
    call["params"].as_object_mut().map(|p| p.remove("task"));
    let a = mcp(&stack, &[], &call).await?;
    assert_eq!(a.json["result"]["isError"], false, "{}", show(&a));
    assert_eq!(stack.executions().await?["by_key"][&nonce_of(&fp)?], 1);
    Ok(())
}

// ---------------------------------------------------------------- every MCP endpoint the demo serves

/// The JSON-RPC message of an answer framed as JSON or as an event stream (its last `data:` event).
fn message(a: &Answer) -> Value {
    if !a.json.is_null() {
        return a.json.clone();
    }
    let text = String::from_utf8_lossy(&a.body);
    text.lines()
        .rev()
        .filter_map(|l| l.strip_prefix("data:"))
        .find_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
        .unwrap_or(Value::Null)
}

/// An unguarded execute on `path`: through the stateful handshake (initialize, initialized, the call
/// under the session id) when `session`, else as one stateless POST.
async fn execute_on(stack: &Stack, path: &str, session: bool) -> Result<Answer, BoxError> {
    let mut headers: Vec<(&str, String)> = Vec::new();
    if session {
        let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18",
            "capabilities": {}, "clientInfo": {"name": "bypass", "version": "1"}}});
        let a = mcp_raw(stack, path, &[], init.to_string()).await?;
        let id = a.header("mcp-session-id").ok_or_else(|| format!("{path}: no session: {}", show(&a)))?.to_owned();
        headers.push(("mcp-session-id", id));
        let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let done = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        mcp_raw(stack, path, &h, done.to_string()).await?;
    }
    let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    mcp_raw(stack, path, &h, evil_execute(20).to_string()).await
}

/// Every MCP endpoint the demo serves (/mcp, /mcp/stream, /mcp/sse, /mcp/session, the SDK's stateful mode), through
/// `config`: an execute without a fingerprint is refused and nothing runs.
async fn every_mcp_endpoint_is_guarded(config: &'static str) -> TestResult {
    let stack = Stack::start(StackOpts { envoy_config: config, ..sqlite_only(false) }).await?;
    let mut unguarded = Vec::new();
    for path in ["/mcp", "/mcp/stream", "/mcp/sse", "/mcp/session"] {
        let before = counts(&stack).await?;
        let a = execute_on(&stack, path, path.ends_with("session")).await?;
        let refusal = &message(&a)["result"]["_meta"][idem_core::machine::META_KEY]["status"];
        if counts(&stack).await? != before || refusal != "fingerprint_missing" {
            unguarded.push(format!("{config} {path}: {}", show(&a)));
        }
    }
    assert!(
        unguarded.is_empty(),
        "unguarded MCP endpoints (an execute without a fingerprint ran):\n{}",
        unguarded.join("\n")
    );
    Ok(())
}

/// DESIGN §6: no route reaches a cluster that serves guarded routes around the guard. e2e.yaml annotates
/// /mcp, /mcp/stream and /mcp/sse; its catch-all takes /mcp/session to the demo unguarded.
#[tokio::test]
async fn e2e_yaml_guards_every_mcp_endpoint_the_demo_serves() -> TestResult {
    every_mcp_endpoint_is_guarded("e2e.yaml").await
}

/// The shipped envoy.yaml (`make run`) annotates no MCP route: its catch-all takes all three to the demo.
#[tokio::test]
async fn envoy_yaml_guards_every_mcp_endpoint_the_demo_serves() -> TestResult {
    every_mcp_endpoint_is_guarded("envoy.yaml").await
}
