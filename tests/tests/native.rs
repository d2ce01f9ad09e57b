//! What only the native module has: its own committed config (`envoy/native.yaml`)
//! with per-route configuration beside route metadata, checked when Envoy loads it.
//! These tests run the native module whatever `IDEM_E2E_HOST` says; the rest of
//! the suite runs on every host (`make test` runs it on the `.wasm`, the module and the ext_proc host).

use idem_e2e::*;
use serde_json::json;

fn native_stack() -> StackOpts {
    StackOpts { envoy_config: "native.yaml", ..sqlite_only(false) }
}

#[test]
fn the_native_config_validates() -> TestResult {
    std::env::set_var("IDEM_SIDECAR_TOKEN", "validate-only-sidecar-token-0123456789");
    let (ok, out) = validate_envoy_config("native.yaml")?;
    assert!(ok, "envoy --mode validate native.yaml failed:\n{out}");
    Ok(())
}

#[test]
fn a_broken_per_route_config_is_refused_when_envoy_loads_it() -> TestResult {
    std::env::set_var("IDEM_SIDECAR_TOKEN", "validate-only-sidecar-token-0123456789");
    let dir = tempfile::tempdir()?;
    let text = std::fs::read_to_string(repo_root().join("envoy/native.yaml"))?;
    // A typo'd field: on route metadata it refuses every request; as per-route config Envoy refuses the config.
    let broken = text.replacen(r#"{"role": "status","#, r#"{"rol": "status","#, 1);
    assert_ne!(broken, text);
    let path = dir.path().join("broken.yaml");
    std::fs::write(&path, broken.replace("target/release", "unused"))?;
    let out = std::process::Command::new(envoy_bin()?)
        .args(["--mode", "validate", "--disable-hot-restart", "-c"])
        .arg(&path)
        .env("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", idem_e2e::filter_host::native_module_dir()?)
        .output()?;
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "Envoy accepted a per-route config with an unknown field:\n{log}");
    assert!(log.contains("rol: unknown annotation field"), "the log says why:\n{log}");
    Ok(())
}

#[tokio::test]
async fn per_route_configs_guard_routes_as_route_metadata_does() -> TestResult {
    let stack = Stack::start(native_stack()).await?;
    // The preview is annotated with route metadata, the confirm and the status with per-route config.
    let (_, fp) = stack.preview(json!("30.00")).await?;
    let body = transfer(json!(30), "drifted memo");
    let first = stack.post("/v1/transfers", SUBJECT, &body, &[("agent-fingerprint", &fp)]).await?;
    assert_eq!(first.status, 201, "{first:?}");
    let again = stack.post("/v1/transfers", SUBJECT, &body, &[("agent-fingerprint", &fp)]).await?;
    again.assert_prompt("already_completed");
    assert_eq!(stack.executions().await?["total"], 1);
    let tampered =
        stack.post("/v1/transfers", SUBJECT, &transfer(json!(31), "m"), &[("agent-fingerprint", &fp)]).await?;
    assert_eq!(tampered.status, 422, "{tampered:?}");
    let status = stack.get("/v1/transfers/status", SUBJECT, &[("agent-fingerprint", &fp)]).await?;
    status.assert_prompt("already_completed");
    assert_eq!(status.json["original_status"], 201);
    // An unguarded route on the same filter passes untouched.
    let plain = stack.get("/healthz", SUBJECT, &[]).await?;
    assert_eq!(plain.status, 200, "{plain:?}");
    // The preview's route metadata has a number leaf (fingerprint_ttl_s): read as a number, never first as a
    // string, which Envoy answers with an error line in its log on every request.
    let log = stack.envoy.log_text();
    assert!(!log.contains("is not a string") && !log.contains("is not a number"), "{log}");
    Ok(())
}
