//! Nothing an upstream or a client sends may panic the filter (DESIGN §6),
//! on both builds (`IDEM_E2E_HOST=native` for the module), in real Envoy with one worker: a panic
//! of the `.wasm` would leave that worker's VM dead, and the request after it is the witness.
//!
//! - An upstream's quote header (`quote_expires: header:quote-expires-at`) that is past,
//!   unparseable or not text: the preview is answered `quote_unusable` (502), no fingerprint.
//! - The same header twice (+600 s and +2 s): refused, never one picked.
//! - A client header whose value is not UTF-8: one the guard reads is a 400, one it does not read
//!   (`x-request-id`) decides nothing.

use idem_e2e::bypass::seen;
use idem_e2e::*;
use reqwest::header::HeaderValue;
use serde_json::json;

const PREVIEW: &str = "/v1/transfers/preview";

/// The e2e stack, its preview route reading the quote's expiry from the answer's
/// `quote-expires-at` header (the demo sends it with `x-demo-quote-expires-at`).
async fn header_quote_stack() -> Result<Stack, BoxError> {
    let pointer =
        "quote_expires: /expires_at        # the demo's quote states its expiry: the fingerprint never outlives it";
    let mut opts = sqlite_only(true);
    opts.envoy_edits.push((pointer.into(), "quote_expires: header:quote-expires-at".into()));
    Stack::start(opts).await
}

/// A preview whose upstream states `quote-expires-at` as `spec` says (see the demo's fault).
async fn preview_with_quote(stack: &Stack, spec: &str) -> Result<Answer, BoxError> {
    stack.post(PREVIEW, SUBJECT, &transfer(json!("12.00"), "quote"), &[("x-demo-quote-expires-at", spec)]).await
}

/// The worker still serves: a preview with a usable quote gets its fingerprint.
async fn assert_worker_serves(stack: &Stack, after: &str) -> Result<String, BoxError> {
    let ok = preview_with_quote(stack, "+600").await?;
    assert_eq!(ok.status, 200, "after {after}, the next preview was not served: {ok:?}");
    let fp = ok.header("agent-fingerprint").ok_or_else(|| format!("after {after}: no fingerprint: {ok:?}"))?;
    Ok(fp.to_owned())
}

#[tokio::test]
async fn an_unusable_quote_header_is_quote_unusable_and_the_worker_lives() -> TestResult {
    let stack = header_quote_stack().await?;
    for spec in ["-10", "+0", "soon", "bytes"] {
        let minted = stack.stat("wasmcustom.idem.minted").await?;
        let got = preview_with_quote(&stack, spec).await?;
        assert_eq!(got.status, 502, "{spec}: {got:?}");
        got.assert_prompt("quote_unusable");
        assert!(got.json.get("quote_id").is_none(), "{spec}: the upstream's quote reached the agent: {got:?}");
        assert!(got.header("agent-fingerprint").is_none(), "{spec}: {got:?}");
        assert_eq!(stack.stat("wasmcustom.idem.minted").await?, minted, "{spec}");
        assert_worker_serves(&stack, spec).await?;
    }
    Ok(())
}

/// Two quote headers, `+600` beside `+2`, in either order: no fingerprint, so nothing can be confirmed after
/// the 2-second quote expired.
#[tokio::test]
async fn a_repeated_quote_header_is_refused_never_one_picked() -> TestResult {
    let stack = header_quote_stack().await?;
    for spec in ["+600,+2", "+2,+600", "+600,+600"] {
        let got = preview_with_quote(&stack, spec).await?;
        assert_eq!(got.status, 502, "{spec}: {got:?}");
        got.assert_prompt("quote_unusable");
        assert!(got.header("agent-fingerprint").is_none() && got.json.get("fingerprint").is_none(), "{spec}");
    }
    // One copy: minted, and it confirms once.
    let fp = assert_worker_serves(&stack, "the repeated quotes").await?;
    let done = stack
        .post("/v1/transfers", SUBJECT, &transfer(json!("12.00"), "quote"), &[("agent-fingerprint", fp.as_str())])
        .await?;
    assert_eq!(done.status, 201, "{done:?}");
    assert_eq!(counts(&stack).await?, (1, 1));
    Ok(())
}

/// A request with one header set to raw bytes (`\xE9\xFF`, not UTF-8).
async fn send_with_bytes(stack: &Stack, path: &str, name: &str, fp: Option<&str>) -> Result<Answer, BoxError> {
    let mut req = stack.http.post(stack.url(path)).json(&transfer(json!("12.00"), "bytes"));
    if name != "x-agent-subject" {
        req = req.header("x-agent-subject", SUBJECT);
    }
    if let Some(fp) = fp {
        req = req.header("agent-fingerprint", fp);
    }
    req = req.header(name, HeaderValue::from_bytes(&[0xE9, 0xFF])?);
    answer(req.send().await?).await
}

async fn answer(r: reqwest::Response) -> Result<Answer, BoxError> {
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    let body = r.bytes().await?.to_vec();
    let json = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    Ok(Answer { status, headers, body, json })
}

#[tokio::test]
async fn a_client_header_that_is_not_text_never_panics_and_never_decides() -> TestResult {
    let stack = sqlite_only(true);
    let stack = Stack::start(stack).await?;
    // Not the guard's header: the preview is served as any other, and so is the next request.
    let got = send_with_bytes(&stack, PREVIEW, "x-request-id", None).await?;
    assert_eq!(got.status, 200, "{got:?}");
    let fp = got.json["fingerprint"].as_str().ok_or_else(|| format!("no fingerprint: {got:?}"))?.to_owned();
    // The guard's headers: a 400 before anything is forwarded.
    let before = seen(&stack).await?;
    let refused = stack.stat("wasmcustom.idem.rejected.invalid_header").await?;
    for (name, status) in [("x-agent-subject", "invalid_header"), ("idempotency-key", "idempotency_key_invalid")] {
        let got = send_with_bytes(&stack, "/v1/transfers", name, Some(&fp)).await?;
        assert_eq!(got.status, 400, "{name}: {got:?}");
        got.assert_prompt(status);
    }
    let got = send_with_bytes(&stack, PREVIEW, "x-agent-subject", None).await?;
    assert_eq!(got.status, 400, "a preview's subject: {got:?}");
    before.assert_same(seen(&stack).await?, "requests whose guarded headers are not text");
    assert_eq!(stack.stat("wasmcustom.idem.rejected.invalid_header").await?, refused + 3);
    // The confirm with an odd request id executes once: it decided nothing.
    let done = send_with_bytes(&stack, "/v1/transfers", "x-request-id", Some(&fp)).await?;
    assert_eq!(done.status, 201, "{done:?}");
    assert_eq!(counts(&stack).await?, (1, 1));
    Ok(())
}

/// The committed configurations that load the `.wasm` (the bench's aside), and those that load only
/// the native module.
const WASM_CONFIGS: [&str; 8] = [
    "compose.yaml",
    "e2e-rds.yaml",
    "e2e.yaml",
    "envoy.yaml",
    "gateway-like.yaml",
    "istio-like.yaml",
    "soak-hostile.yaml",
    "soak.yaml",
];
const NATIVE_CONFIGS: [&str; 2] = ["gateway-native-like.yaml", "native.yaml"];
/// The committed configurations whose agent filter is Envoy's ext_proc filter in front of idemd.
const EXT_PROC_CONFIGS: [&str; 1] = ["ext-proc.yaml"];

/// A `.wasm` that traps anyway fails one stream, never the worker: every committed configuration
/// that loads the `.wasm` through Envoy's own filter reloads a failed VM for the next request
/// (`failure_policy: FAIL_RELOAD`; checked against a real trap of the filter before this fix:
/// FAIL_CLOSED answered 503 to every later request, FAIL_RELOAD served them).
/// Every file in envoy/ that loads it, the mirrors of Istio and Envoy Gateway included (their
/// EnvoyFilter sets it; Envoy Gateway's `failOpen` cannot, its EnvoyPatchPolicy does).
#[test]
fn every_committed_wasm_configuration_reloads_a_failed_vm() -> TestResult {
    let mut seen = Vec::new();
    for entry in std::fs::read_dir(repo_root().join("envoy"))? {
        let path = entry?.path();
        let config = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_owned();
        let text = std::fs::read_to_string(&path)?;
        // The bench's filters (the project's and an empty one) are measured, not guarding anything.
        let filters = text.matches("extensions.filters.http.wasm.v3.Wasm").count();
        if filters == 0 || config.starts_with("bench") {
            continue;
        }
        seen.push(config.clone());
        assert_eq!(text.matches("failure_policy: FAIL_RELOAD").count(), filters, "{config}");
        assert!(
            !text.contains("failure_policy: FAIL_OPEN") && !text.contains("fail_open: true"),
            "{config}: unguarded"
        );
    }
    seen.sort();
    assert_eq!(seen, WASM_CONFIGS);
    Ok(())
}

/// Envoy sends its local reply for an answer the upstream cuts after its headers straight to the
/// client once the filter holds them (past every filter): every committed configuration with the
/// filter, `.wasm` or native, maps those replies to the §7 `in_progress` envelope (DESIGN §12;
/// the mixed-world soak is where the cut answers happen), the mirrors of what Istio (its
/// EnvoyFilter's patch) and Envoy Gateway (its EnvoyPatchPolicy) generate included.
#[test]
fn every_committed_configuration_answers_a_cut_answer_with_the_envelope() -> TestResult {
    let mut seen = Vec::new();
    for entry in std::fs::read_dir(repo_root().join("envoy"))? {
        let path = entry?.path();
        let config = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_owned();
        let text = std::fs::read_to_string(&path)?;
        let guarded = text.contains("agent_idempotency");
        if !guarded || config.starts_with("bench") || config.contains("routes") {
            continue;
        }
        seen.push(config.clone());
        let listeners = text.matches("http_connection_manager.v3.HttpConnectionManager").count();
        assert_eq!(text.matches("local_reply_config:").count(), listeners, "{config}");
        assert_eq!(text.matches("flags: [UR, UC, UPE, UT]").count(), listeners, "{config}");
        assert_eq!(text.matches("status: in_progress").count(), listeners, "{config}");
    }
    seen.sort();
    let mut expected: Vec<&str> = WASM_CONFIGS.iter().copied().chain(NATIVE_CONFIGS).chain(EXT_PROC_CONFIGS).collect();
    expected.sort();
    assert_eq!(seen, expected);
    Ok(())
}

/// A stream with no usable filter is refused, never passed (DESIGN §6: every host fails closed).
/// The fault is real, in real Envoy with the real module: the native module's worker rebuilds its
/// configuration with its environment gone (`IDEM_FAULT_WORKER_ENV_GONE`, so the plugin
/// configuration's `secret_env` is not set there and the rebuild fails, as after an environment
/// changed since Envoy loaded it); the `.wasm`'s VM keeps no stream configuration
/// (`IDEM_FAULT_NO_STREAM_CONFIG` in its environment, as when its lease tick cannot be set). Every
/// stream on it, guarded or not, gets the §7 refusal, and nothing reaches the upstream.
#[tokio::test]
async fn a_stream_without_a_usable_filter_is_refused_and_nothing_reaches_the_upstream() -> TestResult {
    if in_envoy_only("the fault is in the filter's VM or module inside Envoy; idemd's host refuses to start on a configuration it cannot use")? {
        return Ok(());
    }
    let mut opts = sqlite_only(false);
    if FilterHost::current()?.is_native() {
        // Envoy inherits this process's environment (each test runs in a process of its own).
        std::env::set_var("IDEM_FAULT_WORKER_ENV_GONE", "1");
    } else {
        opts.envoy_edits.push((
            "environment_variables: { host_env_keys: [IDEM_SIDECAR_TOKEN] }".into(),
            "environment_variables: { host_env_keys: [IDEM_SIDECAR_TOKEN], key_values: { IDEM_FAULT_NO_STREAM_CONFIG: \"1\" } }"
                .into(),
        ));
    }
    let stack = Stack::start(opts).await?;
    let before = seen(&stack).await?;
    let fp = "eyJ2IjoxfQ.c2lnbmF0dXJl";
    let requests = [
        stack.post(PREVIEW, SUBJECT, &transfer(json!("12.00"), "no filter"), &[]).await?,
        stack
            .post("/v1/transfers", SUBJECT, &transfer(json!("12.00"), "no filter"), &[("agent-fingerprint", fp)])
            .await?,
        stack.get("/healthz", SUBJECT, &[("x-request-id", "trace-no-filter")]).await?,
    ];
    for got in &requests {
        assert_eq!(got.status, 503, "{got:?}");
        got.assert_prompt("status_unavailable");
        assert_eq!(got.json["retryable"], true, "{got:?}");
    }
    assert_eq!(requests[2].json["trace_id"], "trace-no-filter", "{:?}", requests[2]);
    before.assert_same(seen(&stack).await?, "streams without a usable filter");
    assert_eq!(before.forwarded, 0, "nothing reached the upstream at all");
    Ok(())
}
