//! The standing attack suite, part 1: HTTP/2 requests that end in trailers (DESIGN §6: "only the machine
//! releases a held guarded stream"). HEADERS, DATA without END_STREAM, then a trailers frame with
//! END_STREAM: the body callbacks never see the end of the stream, the end arrives in the trailers
//! callback, and a filter that lets that callback continue releases the held headers and body to the
//! router unverified. Every role must answer exactly as it does without trailers, and the upstream
//! (Envoy's request count to the business cluster, the demo's ledger) must see exactly that.
//!
//! The response side cannot be attacked here: the demo is an HTTP/1.1 server that never sends trailers,
//! and Envoy's HTTP/1 codec drops upstream trailers unless `enable_trailers` is set.

use idem_e2e::bypass::{
    assert_envelope, assert_problem, assert_tool_error, fresh_key, mcp_args, seen, show, tools_call,
};
use idem_e2e::http2::{self, H2Request};
use idem_e2e::istio::{bearer, istio_opts, set_secret_env, ISTIO_IS_WASM_ONLY};
use idem_e2e::*;
use serde_json::{json, Value};

/// What an HTTP/2 caller ends its stream with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// END_STREAM on the last DATA frame (the control).
    Data,
    /// DATA without END_STREAM, then trailers with END_STREAM.
    Trailers,
}

fn ending(req: H2Request, end: End) -> H2Request {
    match end {
        End::Data => req,
        End::Trailers => req.trailers(&[("x-body-checksum", "0"), ("x-end", "trailers")]),
    }
}

async fn h2(stack: &Stack, req: H2Request) -> Result<Answer, BoxError> {
    Ok(http2::send(stack.ports.listener, &req).await?.answer)
}

/// Who the caller is on each config: e2e.yaml trusts a header, istio-like.yaml a verified JWT.
#[derive(Clone)]
enum Caller {
    Header(&'static str),
    Jwt(String),
}

impl Caller {
    fn on(&self, req: H2Request) -> H2Request {
        match self {
            Caller::Header(s) => req.header("x-agent-subject", s),
            Caller::Jwt(token) => req.header("authorization", token),
        }
    }
}

async fn preview(stack: &Stack, who: &Caller, amount: &str, end: End) -> Result<Answer, BoxError> {
    let req = who.on(H2Request::post("/v1/transfers/preview")).json(&transfer(json!(amount), "preview memo"));
    h2(stack, ending(req, end)).await
}

async fn confirm(stack: &Stack, who: &Caller, fp: Option<&str>, amount: &str, end: End) -> Result<Answer, BoxError> {
    let mut req = who.on(H2Request::post("/v1/transfers"));
    if let Some(fp) = fp {
        req = req.header("agent-fingerprint", fp);
    }
    h2(stack, ending(req.json(&transfer(json!(amount), "confirm memo")), end)).await
}

fn fingerprint(a: &Answer) -> Result<String, BoxError> {
    Ok(a.json["fingerprint"].as_str().ok_or_else(|| format!("no fingerprint minted: {}", show(a)))?.to_owned())
}

// ---------------------------------------------------------------- e2e.yaml (route metadata), both builds

const ALICE: Caller = Caller::Header(SUBJECT);

/// The control: the same HTTP/2 client without trailers gets the guarded answers (so a failure below is
/// the trailers' doing, not HTTP/2's).
#[tokio::test]
async fn h2_without_trailers_is_guarded_as_http1() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let p = preview(&stack, &ALICE, "15.00", End::Data).await?;
    assert_eq!(p.status, 200, "{}", show(&p));
    let fp = fingerprint(&p)?;
    let before = seen(&stack).await?;
    let tampered = confirm(&stack, &ALICE, Some(&fp), "9999.00", End::Data).await?;
    assert_envelope(&tampered, 422, "params_changed");
    seen(&stack).await?.assert_same(before, "a tampered confirm over HTTP/2");
    let first = confirm(&stack, &ALICE, Some(&fp), "15.00", End::Data).await?;
    assert_eq!(first.status, 201, "{}", show(&first));
    assert_eq!(stack.executions().await?["by_key"][&nonce_of(&fp)?], 1);
    Ok(())
}

#[tokio::test]
async fn trailers_on_a_preview_still_mint_as_without() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let plain = preview(&stack, &ALICE, "16.00", End::Data).await?;
    let trailed = preview(&stack, &ALICE, "16.00", End::Trailers).await?;
    assert_eq!(trailed.status, 200, "{}", show(&trailed));
    let (a, b) = (fingerprint_claims(&fingerprint(&plain)?)?, fingerprint_claims(&fingerprint(&trailed)?)?);
    assert_eq!((&b["s"], &b["p"], &b["u"]), (&a["s"], &a["p"], &a["u"]), "same scope, params and subject");
    assert_ne!(a["n"], b["n"], "a fresh nonce");
    assert_eq!(trailed.json["fingerprint_expires_at"].is_u64(), plain.json["fingerprint_expires_at"].is_u64());
    // The fingerprint minted under trailers confirms like any other.
    let fp = fingerprint(&trailed)?;
    assert_eq!(confirm(&stack, &ALICE, Some(&fp), "16.00", End::Data).await?.status, 201);
    assert!(stack.stat("wasmcustom.idem.minted").await? >= 2);
    Ok(())
}

#[tokio::test]
async fn trailers_on_a_tampered_confirm_are_params_changed() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let fp = fingerprint(&preview(&stack, &ALICE, "17.00", End::Data).await?)?;
    let before = seen(&stack).await?;
    let a = confirm(&stack, &ALICE, Some(&fp), "9999.00", End::Trailers).await?;
    assert_envelope(&a, 422, "params_changed");
    seen(&stack).await?.assert_same(before, "a tampered confirm ending in trailers");
    assert_eq!(stack.stat("wasmcustom.idem.security_events").await?, 1);
    Ok(())
}

#[tokio::test]
async fn trailers_on_a_confirm_without_fingerprint_are_428() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let before = seen(&stack).await?;
    let a = confirm(&stack, &ALICE, None, "18.00", End::Trailers).await?;
    assert_envelope(&a, 428, "fingerprint_missing");
    seen(&stack).await?.assert_same(before, "a confirm without a fingerprint ending in trailers");
    Ok(())
}

#[tokio::test]
async fn trailers_on_a_valid_confirm_execute_once_and_replay() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let fp = fingerprint(&preview(&stack, &ALICE, "19.00", End::Data).await?)?;
    let first = confirm(&stack, &ALICE, Some(&fp), "19.00", End::Trailers).await?;
    assert_eq!(first.status, 201, "{}", show(&first));
    assert_eq!(first.header("idempotent-replayed"), Some("false"));
    let ledger = stack.executions().await?;
    assert_eq!(ledger["by_key"][&nonce_of(&fp)?], 1, "the nonce reached the upstream as Idempotency-Key: {ledger}");
    let again = confirm(&stack, &ALICE, Some(&fp), "19.00", End::Trailers).await?;
    assert_envelope(&again, 201, "already_completed");
    assert_eq!(again.json["result"]["transfer_id"], first.json["transfer_id"]);
    assert_eq!(counts(&stack).await?, (1, 1), "one execution, one attempt");
    Ok(())
}

#[tokio::test]
async fn trailers_on_a_status_query_are_answered_by_the_gateway() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let fp = fingerprint(&preview(&stack, &ALICE, "20.00", End::Data).await?)?;
    assert_eq!(confirm(&stack, &ALICE, Some(&fp), "20.00", End::Data).await?.status, 201);
    let before = seen(&stack).await?;
    let req = ALICE.on(H2Request::post("/v1/transfers/status")).json(&json!({"fingerprint": fp}));
    let s = h2(&stack, ending(req, End::Trailers)).await?;
    assert_envelope(&s, 200, "already_completed");
    assert_eq!(s.json["original_status"], 201);
    seen(&stack).await?.assert_same(before, "a status query ending in trailers");
    Ok(())
}

fn mcp_post(body: &Value, key: Option<&str>) -> H2Request {
    let mut req = ALICE
        .on(H2Request::post("/mcp"))
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2025-06-18");
    if let Some(k) = key {
        req = req.header("idempotency-key", k);
    }
    req.json(body)
}

#[tokio::test]
async fn trailers_on_an_mcp_execute_without_fingerprint_are_a_tool_error() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let before = seen(&stack).await?;
    let call = tools_call(json!(7), "execute_transfer", mcp_args("9999.00", "payee-mallory", None));
    // A client Idempotency-Key, so that an unguarded call would really execute on the demo.
    let a = h2(&stack, ending(mcp_post(&call, Some("client-chosen-key")), End::Trailers)).await?;
    assert_tool_error(&a, "fingerprint_missing");
    assert_eq!(a.json["id"], 7);
    seen(&stack).await?.assert_same(before, "an MCP execute without a fingerprint ending in trailers");
    Ok(())
}

#[tokio::test]
async fn trailers_on_client_key_requests_run_once() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let key = fresh_key("h2-trailers");
    let send = || {
        let req = ALICE
            .on(H2Request::post("/programs/v1/transfers"))
            .header("idempotency-key", &key)
            .json(&transfer(json!("21.00"), "invoice 21"));
        h2(&stack, ending(req, End::Trailers))
    };
    let first = send().await?;
    assert_eq!(first.status, 201, "{}", show(&first));
    let again = send().await?;
    assert_eq!((again.status, &again.body), (201, &first.body), "the replay is the first answer: {}", show(&again));
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(counts(&stack).await?, (1, 1), "one execution, one attempt");
    let ledger = stack.executions().await?;
    assert!(ledger["by_key"].get(&key).is_none(), "the client's key never reaches the upstream: {ledger}");
    Ok(())
}

/// HEADERS without END_STREAM, then trailers: no DATA at all. The same answer as a confirm whose HEADERS
/// end the stream (an empty body is not JSON), and nothing forwarded.
#[tokio::test]
async fn a_trailers_only_confirm_is_answered_as_an_empty_body() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let fp = fingerprint(&preview(&stack, &ALICE, "22.00", End::Data).await?)?;
    let bare = || {
        ALICE
            .on(H2Request::post("/v1/transfers"))
            .header("agent-fingerprint", &fp)
            .header("content-type", "application/json")
    };
    let before = seen(&stack).await?;
    let headers_only = h2(&stack, bare()).await?;
    assert_envelope(&headers_only, 400, "invalid_json");
    let trailers_only = h2(&stack, bare().trailers(&[("x-end", "trailers")])).await?;
    assert_envelope(&trailers_only, 400, "invalid_json");
    seen(&stack).await?.assert_same(before, "confirms without a body");
    Ok(())
}

#[tokio::test]
async fn a_trailers_only_mcp_post_is_a_json_rpc_error() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let before = seen(&stack).await?;
    let req = ALICE
        .on(H2Request::post("/mcp"))
        .header("accept", "application/json, text/event-stream")
        .header("content-type", "application/json")
        .header("idempotency-key", "client-chosen-key")
        .trailers(&[("x-end", "trailers")]);
    let a = h2(&stack, req).await?;
    idem_e2e::bypass::assert_rpc_error(&a, 400, -32700);
    seen(&stack).await?.assert_same(before, "an MCP POST without a body");
    Ok(())
}

#[tokio::test]
async fn trailers_on_a_client_key_request_without_key_are_a_problem() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let before = seen(&stack).await?;
    let req = ALICE.on(H2Request::post("/programs/v1/transfers")).json(&transfer(json!("23.00"), "no key"));
    let a = h2(&stack, ending(req, End::Trailers)).await?;
    assert_problem(&a, 400, "idempotency-key-missing");
    seen(&stack).await?.assert_same(before, "a client-key request without a key ending in trailers");
    Ok(())
}

/// The control: an unannotated route is untouched by the trailers rule (nothing held, the request reaches
/// the upstream and its answer comes back).
#[tokio::test]
async fn trailers_on_an_unannotated_route_pass_through() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let before = seen(&stack).await?;
    let req = H2Request { method: "GET".into(), path: "/v1/executions".into(), ..Default::default() }
        .header("content-type", "application/json")
        .data(b"{}".to_vec());
    let a = h2(&stack, ending(req, End::Trailers)).await?;
    assert_eq!(a.status, 200, "{}", show(&a));
    assert_eq!(a.json["total"], 0, "{}", show(&a));
    assert_eq!(seen(&stack).await?.forwarded, before.forwarded + 1, "it reached the upstream");
    Ok(())
}

// ---------------------------------------------------------------- istio-like.yaml (route rules), .wasm only

/// Every role of istio-like.yaml's rules, ending in trailers: the same guard as route metadata.
#[tokio::test]
async fn trailers_on_istio_route_rules_are_guarded() -> TestResult {
    if wasm_only(ISTIO_IS_WASM_ONLY)? {
        return Ok(());
    }
    set_secret_env();
    let stack = Stack::start(istio_opts(Vec::new())?).await?;
    let alice = Caller::Jwt(bearer("alice")?);
    let p = preview(&stack, &alice, "24.00", End::Trailers).await?;
    assert_eq!(p.status, 200, "the preview rule under trailers: {}", show(&p));
    let fp = fingerprint(&p)?;
    assert_eq!(fingerprint_claims(&fp)?["s"], "payments.transfer");

    let before = seen(&stack).await?;
    assert_envelope(&confirm(&stack, &alice, Some(&fp), "9999.00", End::Trailers).await?, 422, "params_changed");
    assert_envelope(&confirm(&stack, &alice, None, "24.00", End::Trailers).await?, 428, "fingerprint_missing");
    seen(&stack).await?.assert_same(before, "refused confirms ending in trailers");

    let first = confirm(&stack, &alice, Some(&fp), "24.00", End::Trailers).await?;
    assert_eq!(first.status, 201, "{}", show(&first));
    assert_eq!(stack.executions().await?["by_key"][&nonce_of(&fp)?], 1);
    let again = confirm(&stack, &alice, Some(&fp), "24.00", End::Trailers).await?;
    assert_envelope(&again, 201, "already_completed");

    let before = seen(&stack).await?;
    let req = alice.on(H2Request::post("/v1/transfers/status")).json(&json!({"fingerprint": fp}));
    assert_envelope(&h2(&stack, ending(req, End::Trailers)).await?, 200, "already_completed");
    seen(&stack).await?.assert_same(before, "a status query ending in trailers");
    assert_eq!(counts(&stack).await?, (1, 1));
    Ok(())
}
