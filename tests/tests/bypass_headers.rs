//! The standing attack suite, part 2: repeated and list-valued headers the guard reads (DESIGN §6: "a
//! 400, never first wins"). Each attack is sent over HTTP/1.1 (two header lines) and HTTP/2 (two header
//! fields); Envoy keeps both, and a guard that reads one of them while the upstream may read the other
//! decides on a value the request does not carry alone.

use idem_e2e::bypass::{
    assert_envelope, assert_problem, assert_rpc_error, fresh_key, mcp_args, seen, show, tools_call,
};
use idem_e2e::http2::{self, H2Request};
use idem_e2e::istio::{bearer, istio_opts, set_secret_env, ISTIO_IS_WASM_ONLY};
use idem_e2e::*;
use serde_json::{json, Value};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Proto {
    Http1,
    Http2,
}

const BOTH: [Proto; 2] = [Proto::Http1, Proto::Http2];

/// POST `body` to `path` with exactly `headers` (repeats kept, in order) and a JSON content type.
async fn post(
    stack: &Stack,
    proto: Proto,
    path: &str,
    headers: &[(&str, &str)],
    body: &Value,
) -> Result<Answer, BoxError> {
    match proto {
        Proto::Http1 => {
            let mut map = reqwest::header::HeaderMap::new();
            for (k, v) in headers {
                map.append(reqwest::header::HeaderName::from_bytes(k.as_bytes())?, v.parse()?);
            }
            let r = stack.http.post(stack.url(path)).headers(map).json(body).send().await?;
            let status = r.status().as_u16();
            let headers = r.headers().clone();
            let body = r.bytes().await?.to_vec();
            let json = serde_json::from_slice(&body).unwrap_or(Value::Null);
            Ok(Answer { status, headers, body, json })
        }
        Proto::Http2 => {
            let mut req = H2Request::post(path);
            for (k, v) in headers {
                req = req.header(k, v);
            }
            Ok(http2::send(stack.ports.listener, &req.json(body)).await?.answer)
        }
    }
}

const MCP_ACCEPT: (&str, &str) = ("accept", "application/json, text/event-stream");

// ---------------------------------------------------------------- Idempotency-Key (client-key routes)

/// `role: idempotent` (callers: programs): two keys, different or equal, are one invalid key.
#[tokio::test]
async fn two_idempotency_keys_are_a_problem_for_programs() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    for proto in BOTH {
        let (a, b) = (fresh_key("first"), fresh_key("second"));
        for pair in [[a.as_str(), b.as_str()], [a.as_str(), a.as_str()]] {
            let before = seen(&stack).await?;
            let h = [("x-agent-subject", SUBJECT), ("idempotency-key", pair[0]), ("idempotency-key", pair[1])];
            let r = post(&stack, proto, "/programs/v1/transfers", &h, &transfer(json!("31.00"), "m")).await?;
            assert_problem(&r, 400, "idempotency-key-invalid");
            seen(&stack).await?.assert_same(before, &format!("two Idempotency-Key {pair:?} over {proto:?}"));
        }
    }
    Ok(())
}

/// A list in one line is one invalid key too (the draft: exactly one sf-string).
#[tokio::test]
async fn a_list_of_idempotency_keys_in_one_line_is_a_problem() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    for proto in BOTH {
        let before = seen(&stack).await?;
        let h = [("x-agent-subject", SUBJECT), ("idempotency-key", "\"a\", \"b\"")];
        let r = post(&stack, proto, "/programs/v1/transfers", &h, &transfer(json!("32.00"), "m")).await?;
        assert_problem(&r, 400, "idempotency-key-invalid");
        seen(&stack).await?.assert_same(before, &format!("a list of keys over {proto:?}"));
    }
    Ok(())
}

/// Agents never make their own keys (article §2): a client-key route edited to `callers: agents` is
/// a configuration the filter refuses, so a confirm on it, with one key or two, is answered as a
/// misconfigured route (503 `status_unavailable`) and nothing reaches the upstream.
#[tokio::test]
async fn idempotency_keys_on_a_route_agents_call_execute_nothing() -> TestResult {
    let edits = vec![("callers: programs".to_owned(), "callers: agents".to_owned())];
    let stack = Stack::start(StackOpts { envoy_edits: edits, ..sqlite_only(false) }).await?;
    for proto in BOTH {
        let (a, b) = (fresh_key("first"), fresh_key("second"));
        for pair in [[a.as_str(), b.as_str()], [a.as_str(), a.as_str()]] {
            let before = seen(&stack).await?;
            let h = [("x-agent-subject", SUBJECT), ("idempotency-key", pair[0]), ("idempotency-key", pair[1])];
            let r = post(&stack, proto, "/both/v1/transfers", &h, &transfer(json!("33.00"), "m")).await?;
            assert_envelope(&r, 503, "status_unavailable");
            seen(&stack).await?.assert_same(before, &format!("two Idempotency-Key {pair:?} over {proto:?}"));
        }
        let before = seen(&stack).await?;
        let h = [("x-agent-subject", SUBJECT), ("idempotency-key", a.as_str())];
        let r = post(&stack, proto, "/both/v1/transfers", &h, &transfer(json!("33.00"), "m")).await?;
        assert_envelope(&r, 503, "status_unavailable");
        seen(&stack).await?.assert_same(before, &format!("one agent-made Idempotency-Key over {proto:?}"));
    }
    Ok(())
}

// ---------------------------------------------------------------- Agent-Fingerprint

/// Two fingerprint lines: one valid for this body and another (a different valid one, or itself again).
#[tokio::test]
async fn two_fingerprint_headers_are_invalid() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    for proto in BOTH {
        let (_, fp) = stack.preview(json!("34.00")).await?;
        let (_, other) = stack.preview(json!("9999.00")).await?;
        for pair in [[fp.as_str(), other.as_str()], [other.as_str(), fp.as_str()], [fp.as_str(), fp.as_str()]] {
            let before = seen(&stack).await?;
            let h = [("x-agent-subject", SUBJECT), ("agent-fingerprint", pair[0]), ("agent-fingerprint", pair[1])];
            let r = post(&stack, proto, "/v1/transfers", &h, &transfer(json!("34.00"), "m")).await?;
            assert_envelope(&r, 400, "fingerprint_invalid");
            seen(&stack).await?.assert_same(before, &format!("two fingerprint headers over {proto:?}"));
        }
    }
    Ok(())
}

/// A fingerprint in the header and a different one in the body: which one is "the" fingerprint depends
/// on who reads, so neither is.
#[tokio::test]
async fn a_header_and_a_different_body_fingerprint_are_invalid() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    for proto in BOTH {
        let (_, fp) = stack.preview(json!("35.00")).await?;
        let (_, other) = stack.preview(json!("35.00")).await?;
        let mut body = transfer(json!("35.00"), "m");
        body["fingerprint"] = json!(other);
        let before = seen(&stack).await?;
        let h = [("x-agent-subject", SUBJECT), ("agent-fingerprint", fp.as_str())];
        let r = post(&stack, proto, "/v1/transfers", &h, &body).await?;
        assert_envelope(&r, 400, "fingerprint_invalid");
        seen(&stack).await?.assert_same(before, &format!("header and body fingerprints over {proto:?}"));
    }
    Ok(())
}

/// The control: the same fingerprint in the header and the body is one fingerprint, and it runs once.
#[tokio::test]
async fn the_same_fingerprint_in_header_and_body_runs_once() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let (_, fp) = stack.preview(json!("36.00")).await?;
    let mut body = transfer(json!("36.00"), "m");
    body["fingerprint"] = json!(fp);
    let h = [("x-agent-subject", SUBJECT), ("agent-fingerprint", fp.as_str())];
    let first = post(&stack, Proto::Http2, "/v1/transfers", &h, &body).await?;
    assert_eq!(first.status, 201, "{}", show(&first));
    let again = post(&stack, Proto::Http1, "/v1/transfers", &h, &body).await?;
    assert_envelope(&again, 201, "already_completed");
    assert_eq!(stack.executions().await?["by_key"][&nonce_of(&fp)?], 1);
    assert_eq!(counts(&stack).await?, (1, 1));
    Ok(())
}

// ---------------------------------------------------------------- the subject header

#[tokio::test]
async fn two_subject_headers_are_invalid_for_agents() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    for proto in BOTH {
        let (_, fp) = stack.preview(json!("37.00")).await?;
        for pair in [[SUBJECT, "user-mallory"], ["user-mallory", SUBJECT], [SUBJECT, SUBJECT]] {
            let before = seen(&stack).await?;
            let h = [("x-agent-subject", pair[0]), ("x-agent-subject", pair[1]), ("agent-fingerprint", fp.as_str())];
            let r = post(&stack, proto, "/v1/transfers", &h, &transfer(json!("37.00"), "m")).await?;
            assert_envelope(&r, 400, "invalid_header");
            seen(&stack).await?.assert_same(before, &format!("two subjects {pair:?} over {proto:?}"));
        }
    }
    Ok(())
}

#[tokio::test]
async fn two_subject_headers_are_a_problem_for_programs() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    for proto in BOTH {
        let key = fresh_key("subjects");
        let before = seen(&stack).await?;
        let h = [("x-agent-subject", SUBJECT), ("x-agent-subject", "user-mallory"), ("idempotency-key", key.as_str())];
        let r = post(&stack, proto, "/programs/v1/transfers", &h, &transfer(json!("38.00"), "m")).await?;
        assert_problem(&r, 400, "invalid-header");
        seen(&stack).await?.assert_same(before, &format!("two subjects over {proto:?}"));
    }
    Ok(())
}

/// A preview binds the subject too: two subjects mint nothing.
#[tokio::test]
async fn two_subject_headers_on_a_preview_mint_nothing() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    for proto in BOTH {
        let h = [("x-agent-subject", SUBJECT), ("x-agent-subject", "user-mallory")];
        let r = post(&stack, proto, "/v1/transfers/preview", &h, &transfer(json!("39.00"), "m")).await?;
        assert_envelope(&r, 400, "invalid_header");
        assert!(r.json.get("fingerprint").is_none(), "{}", show(&r));
    }
    assert_eq!(stack.stat("wasmcustom.idem.minted").await?, 0);
    Ok(())
}

// ---------------------------------------------------------------- Mcp-Method / Mcp-Name

/// An unguarded execute (no fingerprint, a client key the demo would execute under) behind repeated
/// MCP routing headers: HTTP 400, JSON-RPC -32020, nothing forwarded.
#[tokio::test]
async fn two_mcp_method_or_name_headers_are_32020() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let call = tools_call(json!(11), "execute_transfer", mcp_args("9999.00", "payee-mallory", None));
    let repeats: [[(&str, &str); 2]; 4] = [
        [("mcp-method", "tools/list"), ("mcp-method", "tools/call")],
        [("mcp-method", "tools/call"), ("mcp-method", "tools/call")],
        [("mcp-name", "get_weather"), ("mcp-name", "execute_transfer")],
        [("mcp-name", "execute_transfer"), ("mcp-name", "execute_transfer")],
    ];
    for proto in BOTH {
        for pair in &repeats {
            let key = fresh_key("mcp-repeat");
            let before = seen(&stack).await?;
            let mut h = vec![("x-agent-subject", SUBJECT), MCP_ACCEPT, ("idempotency-key", key.as_str())];
            if pair[0].0 == "mcp-name" {
                h.push(("mcp-method", "tools/call"));
            }
            h.extend_from_slice(pair);
            let r = post(&stack, proto, "/mcp", &h, &call).await?;
            assert_rpc_error(&r, 400, -32020);
            seen(&stack).await?.assert_same(before, &format!("{pair:?} over {proto:?}"));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- `_` for `-`

/// Envoy forwards `idempotency_key`, `agent_fingerprint`, `x_agent_subject`, `mcp_method` (underscores are
/// allowed by default), and a CGI-style upstream (WSGI, Rack, PHP) reads each as the dashed header: one
/// more copy of a header the guard reads, alone or beside the dashed one. A 400, nothing forwarded.
#[tokio::test]
async fn an_underscore_spelling_of_a_guarded_header_is_refused() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let call = tools_call(json!(12), "execute_transfer", mcp_args("9999.00", "payee-mallory", None));
    for proto in BOTH {
        let (key, other) = (fresh_key("dashed"), fresh_key("underscored"));
        for h in [
            vec![("x-agent-subject", SUBJECT), ("idempotency-key", key.as_str()), ("idempotency_key", other.as_str())],
            vec![("x-agent-subject", SUBJECT), ("idempotency_key", other.as_str())],
        ] {
            let before = seen(&stack).await?;
            let r = post(&stack, proto, "/programs/v1/transfers", &h, &transfer(json!("41.00"), "m")).await?;
            assert_problem(&r, 400, "idempotency-key-invalid");
            seen(&stack).await?.assert_same(before, &format!("{h:?} over {proto:?}"));
        }
        let (_, fp) = stack.preview(json!("42.00")).await?;
        let (_, other_fp) = stack.preview(json!("9999.00")).await?;
        for (h, status) in [
            (
                vec![
                    ("x-agent-subject", SUBJECT),
                    ("agent-fingerprint", fp.as_str()),
                    ("agent_fingerprint", &other_fp),
                ],
                "fingerprint_invalid",
            ),
            (
                vec![("x-agent-subject", SUBJECT), ("x_agent_subject", "user-mallory"), ("agent-fingerprint", &fp)],
                "invalid_header",
            ),
        ] {
            let before = seen(&stack).await?;
            let r = post(&stack, proto, "/v1/transfers", &h, &transfer(json!("42.00"), "m")).await?;
            assert_envelope(&r, 400, status);
            seen(&stack).await?.assert_same(before, &format!("{h:?} over {proto:?}"));
        }
        let mcp_key = fresh_key("mcp-underscore");
        let before = seen(&stack).await?;
        let h = [
            ("x-agent-subject", SUBJECT),
            MCP_ACCEPT,
            ("idempotency-key", mcp_key.as_str()),
            ("mcp_method", "tools/list"),
        ];
        let r = post(&stack, proto, "/mcp", &h, &call).await?;
        assert_rpc_error(&r, 400, -32020);
        seen(&stack).await?.assert_same(before, &format!("mcp_method over {proto:?}"));
    }
    Ok(())
}

// ---------------------------------------------------------------- istio-like.yaml (route rules), .wasm only

#[tokio::test]
async fn repeated_fingerprints_on_istio_route_rules_are_invalid() -> TestResult {
    if wasm_only(ISTIO_IS_WASM_ONLY)? {
        return Ok(());
    }
    set_secret_env();
    let stack = Stack::start(istio_opts(Vec::new())?).await?;
    let alice = bearer("alice")?;
    let preview = |amount: &'static str| {
        let (stack, alice) = (&stack, alice.clone());
        async move {
            let h = [("authorization", alice.as_str())];
            let p = post(stack, Proto::Http1, "/v1/transfers/preview", &h, &transfer(json!(amount), "m")).await?;
            Ok::<String, BoxError>(p.json["fingerprint"].as_str().ok_or("no fingerprint")?.to_owned())
        }
    };
    for proto in BOTH {
        let (fp, other) = (preview("40.00").await?, preview("9999.00").await?);
        let before = seen(&stack).await?;
        let h = [("authorization", alice.as_str()), ("agent-fingerprint", fp.as_str()), ("agent-fingerprint", &other)];
        let r = post(&stack, proto, "/v1/transfers", &h, &transfer(json!("40.00"), "m")).await?;
        assert_envelope(&r, 400, "fingerprint_invalid");
        let mut body = transfer(json!("40.00"), "m");
        body["fingerprint"] = json!(other);
        let h = [("authorization", alice.as_str()), ("agent-fingerprint", fp.as_str())];
        let r = post(&stack, proto, "/v1/transfers", &h, &body).await?;
        assert_envelope(&r, 400, "fingerprint_invalid");
        seen(&stack).await?.assert_same(before, &format!("repeated fingerprints over {proto:?}"));
    }
    Ok(())
}
