//! The filter the way Istio runs it (envoy/istio-like.yaml): no route metadata —
//! the guarded routes are rules in the plugin configuration, which is exactly the
//! string istiod makes of deploy/istio/wasmplugin.yaml's `pluginConfig`; the
//! subject is the `sub` of the JWT Istio's jwt_authn verified; the secrets come
//! from the proxy's environment; idemd is called through Istio's outbound cluster
//! name and with a bearer token.

use idem_e2e::istio::{
    guarded_preview_hangs, istio_opts, jwt_subject_walk, set_secret_env, HOLD_LINE, ISTIO_IS_WASM_ONLY,
};
use idem_e2e::*;
use serde_json::json;

#[test]

fn istio_like_config_validates() -> TestResult {
    if wasm_only(ISTIO_IS_WASM_ONLY)? {
        return Ok(());
    }
    set_secret_env();
    let (ok, out) = validate_envoy_config("istio-like.yaml")?;
    assert!(ok, "envoy --mode validate istio-like.yaml failed:\n{out}");
    Ok(())
}

#[tokio::test]

async fn preview_confirm_replay_and_tamper_the_istio_way() -> TestResult {
    if wasm_only(ISTIO_IS_WASM_ONLY)? {
        return Ok(());
    }
    set_secret_env();
    let stack = Stack::start(istio_opts(Vec::new())?).await?;
    let (_, fp) = jwt_subject_walk(&stack, &[]).await?;
    // Istio lets a request without a token through RequestAuthentication; the filter finds no subject.
    let anonymous = stack
        .post("/v1/transfers", "user-mallory", &transfer(json!("40.00"), "m"), &[("agent-fingerprint", &fp)])
        .await?;
    assert_eq!(anonymous.status, 401, "{anonymous:?}");
    anonymous.assert_prompt("unauthenticated");

    let ex = stack.executions().await?;
    assert_eq!((ex["total"].as_u64(), ex["attempts"].as_u64()), (Some(1), Some(1)), "exactly one transfer ran: {ex}");
    Ok(())
}

/// What a WasmPlugin gives the filter — the same config without `allow_on_headers_stop_iteration`, which istiod
/// never sets — holds a guarded request forever: Envoy stops delivering the body to the filter. This is why
/// deploy/ installs the filter with an EnvoyFilter; when this test fails, WasmPlugin works and docs/deploy.md
/// should switch back.
#[tokio::test]

async fn a_wasmplugin_shaped_filter_never_sees_the_body() -> TestResult {
    if wasm_only(ISTIO_IS_WASM_ONLY)? {
        return Ok(());
    }
    set_secret_env();
    let stack = Stack::start(istio_opts(vec![(HOLD_LINE.to_owned(), String::new())])?).await?;
    assert!(
        guarded_preview_hangs(&stack).await?,
        "the request completed: WasmPlugin may work now — revisit docs/deploy.md"
    );
    // An unguarded route is untouched either way.
    let passthrough = stack.get("/v1/executions", SUBJECT, &[]).await?;
    assert_eq!(passthrough.status, 200);
    assert_eq!(passthrough.json["total"], 0, "nothing ran");
    Ok(())
}
