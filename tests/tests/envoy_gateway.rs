//! The filter the way Envoy Gateway runs it: envoy/gateway-like.yaml (the `.wasm`) and
//! envoy/gateway-native-like.yaml (the native module) are what Envoy Gateway's translator makes of
//! deploy/envoy-gateway/ — the policy's filter disabled in the connection manager and enabled on every route,
//! the routes as rules in the plugin configuration (the EnvoyExtensionPolicy's `config`, exactly), the subject
//! from the JWT its SecurityPolicy verified, idemd through the cluster its EnvoyPatchPolicy adds. Each build
//! runs its own file (`make test` runs the suite on both).
//!
//! And why deploy/envoy-gateway/wasm needs an EnvoyPatchPolicy for the `.wasm`: without
//! `allow_on_headers_stop_iteration`, which Envoy Gateway's Wasm API cannot set, a guarded request hangs.

use idem_e2e::istio::{guarded_preview_hangs, jwt_subject_walk, set_secret_env, HOLD_LINE};
use idem_e2e::*;
use serde_json::{json, Value};

/// Where the EnvoyProxy's dynamicModules entry puts the module (deploy/envoy-gateway/native/native.yaml).
const MODULE_PATH: &str = "/usr/lib/envoy/modules/libagent_idempotency_native.so";

/// The EnvoyExtensionPolicy's `config` as Envoy Gateway hands it to the filter: the JSON the API server
/// stores (compact, keys sorted). The three policies of deploy/envoy-gateway/ carry the same one (the oci
/// crate's deploy tests check that).
fn policy_config() -> Result<String, BoxError> {
    let text = std::fs::read_to_string(repo_root().join("deploy/envoy-gateway/native/native.yaml"))?;
    let docs = idem_oci::istio::documents(&text).map_err(|e| e.to_string())?;
    let policy = docs
        .iter()
        .find(|d| d.get("kind").and_then(|k| k.as_str()) == Some("EnvoyExtensionPolicy"))
        .ok_or("no EnvoyExtensionPolicy in native.yaml")?;
    let config = policy
        .get("spec")
        .and_then(|s| s.get("dynamicModule"))
        .and_then(|m| m.get(0))
        .and_then(|m| m.get("config"))
        .ok_or("the policy has no config")?;
    // serde_json's maps are sorted; the YAML's numbers are integers, as the API server keeps them.
    let value: Value = serde_json::from_str(&serde_json::to_string(config)?)?;
    Ok(serde_json::to_string(&value)?)
}

/// This build's Envoy Gateway file, which must carry the policy's configuration: the harness refuses an edit
/// that matches nothing, so replacing the derived string by itself proves the running config is it.
fn gateway_opts(extra: Vec<(String, String)>) -> Result<StackOpts, BoxError> {
    let config = policy_config()?;
    let mut edits = vec![(format!("value: '{config}'"), format!("value: '{config}'"))];
    let envoy_config = if FilterHost::current()?.is_native() {
        let module = filter_host::native_module_dir()?.join(format!("lib{}.so", filter_host::NATIVE_MODULE));
        edits.push((MODULE_PATH.to_owned(), module.display().to_string()));
        "gateway-native-like.yaml"
    } else {
        "gateway-like.yaml"
    };
    edits.extend(extra);
    Ok(StackOpts { envoy_config, envoy_edits: edits, ..Default::default() })
}

#[tokio::test]
async fn preview_confirm_replay_and_tamper_the_envoy_gateway_way() -> TestResult {
    if in_envoy_only("Envoy Gateway's translation of the extProc policy was not run here (docs/deploy.md); the .wasm and native policies are this test's, on their hosts")? {
        return Ok(());
    }
    set_secret_env();
    let stack = Stack::start(gateway_opts(Vec::new())?).await?;
    // A client's own x-verified-sub is overwritten by jwt_authn: it never names the subject.
    let (alice, fp) = jwt_subject_walk(&stack, &[("x-verified-sub", "user-mallory")]).await?;
    // The SecurityPolicy requires a JWT: without one, jwt_authn answers before the filter.
    let body = transfer(json!("40.00"), "m");
    let anonymous = stack.post("/v1/transfers", "user-mallory", &body, &[("agent-fingerprint", &fp)]).await?;
    assert_eq!(anonymous.status, 401, "{anonymous:?}");
    // What the HTTPRoute does not name never reaches the service.
    let unrouted = stack.get("/v1/executions", SUBJECT, &[("authorization", alice.as_str())]).await?;
    assert_eq!(unrouted.status, 404, "no catch-all route: {unrouted:?}");

    let ex = stack.executions().await?;
    assert_eq!((ex["total"].as_u64(), ex["attempts"].as_u64()), (Some(1), Some(1)), "exactly one transfer ran: {ex}");
    Ok(())
}

/// What Envoy Gateway's own API gives the `.wasm` (its translator never sets `allow_on_headers_stop_iteration`)
/// holds a guarded request forever: Envoy stops handing the body to the filter. This is why
/// deploy/envoy-gateway/wasm carries the EnvoyPatchPolicy agent-idempotency-hold; when this test fails, Envoy
/// Gateway sets the flag itself and the patch can go (docs/deploy.md).
#[tokio::test]
async fn without_the_patch_envoy_gateways_wasm_filter_never_sees_the_body() -> TestResult {
    if wasm_only("the native module holds the request without allow_on_headers_stop_iteration")? {
        return Ok(());
    }
    set_secret_env();
    let stack = Stack::start(gateway_opts(vec![(HOLD_LINE.to_owned(), String::new())])?).await?;
    assert!(guarded_preview_hangs(&stack).await?, "the request completed: Envoy Gateway's Wasm may work unpatched now");
    let ex = stack.executions().await?;
    assert_eq!(ex["total"], 0, "nothing ran: {ex}");
    Ok(())
}
