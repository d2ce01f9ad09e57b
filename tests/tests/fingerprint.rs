//! Preview mints, confirm verifies: the walking skeleton through a real Envoy.
//! Every rejection is a DESIGN §7 reply and leaves the demo untouched.

use base64::Engine as _;
use idem_e2e::*;
use serde_json::{json, Value};
use std::time::Duration;

fn nonce_of(fingerprint: &str) -> Result<String, BoxError> {
    let payload = fingerprint.split('.').next().ok_or("no payload")?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(payload)?;
    let claims: Value = serde_json::from_slice(&bytes)?;
    Ok(claims["n"].as_str().ok_or("no nonce")?.to_owned())
}

async fn assert_nothing_executed(stack: &Stack) -> TestResult {
    let ex = stack.executions().await?;
    assert_eq!(ex["total"], 0, "executions: {ex}");
    assert_eq!(ex["attempts"], 0, "nothing may reach the upstream: {ex}");
    Ok(())
}

#[test]
fn every_envoy_config_validates() -> TestResult {
    // compose.yaml takes idemd's bearer token from the environment too (validate_envoy_config sets IDEM_HMAC_K1).
    std::env::set_var("IDEM_SIDECAR_TOKEN", "validate-only-sidecar-token-0123456789");
    for config in ["envoy.yaml", "e2e.yaml", "compose.yaml", "bench.yaml"] {
        let (ok, out) = validate_envoy_config(config)?;
        assert!(ok, "envoy --mode validate {config} failed:\n{out}");
    }
    Ok(())
}

/// There is no Docker engine here: check that the compose file and the
/// Dockerfile it builds agree with each other and with the repository.
#[test]
fn docker_compose_matches_the_repository() -> TestResult {
    let root = repo_root();
    let compose = std::fs::read_to_string(root.join("docker-compose.yml"))?;
    let dockerfile = std::fs::read_to_string(root.join("Dockerfile"))?;
    for target in ["idemd", "demo", "envoy"] {
        assert!(compose.contains(&format!("target: {target}")), "compose builds {target}");
        assert!(dockerfile.contains(&format!(" AS {target}")), "Dockerfile has a stage {target}");
    }
    assert!(dockerfile.contains("COPY envoy/compose.yaml"));
    assert!(dockerfile.contains("envoyproxy/envoy:v1.40.0"), "same Envoy version as the tests");
    let envoy = std::fs::read_to_string(root.join("envoy/compose.yaml"))?;
    assert!(envoy.contains("address: idemd, port_value: 9090") && envoy.contains("address: demo, port_value: 8080"));
    assert!(compose.contains("IDEM_REDIS_URL: redis://redis:6379"));
    assert!(compose.contains("IDEM_DATABASE_URL: postgres://"));
    assert!(envoy.contains("secret_env") && !envoy.contains("\"secret\":"), "no inline secret in the compose config");

    // idemd: auth on, the filter's token from the environment on both sides.
    assert!(envoy.contains(r#""sidecar_token": {"secret_env": "IDEM_SIDECAR_TOKEN"}"#), "the filter sends a token");
    assert!(envoy.contains("host_env_keys: [IDEM_HMAC_K1, IDEM_SIDECAR_TOKEN]"), "the token reaches the Wasm VM");
    assert!(compose.contains("IDEM_AUTH_TOKENS: ${IDEM_SIDECAR_TOKEN:?"), "idemd accepts exactly the filter's token");
    assert!(compose.contains("IDEM_SIDECAR_TOKEN: ${IDEM_SIDECAR_TOKEN:?"), "Envoy gets the token");
    for text in [&compose, &dockerfile] {
        assert!(!text.contains("insecure-no-auth") && !text.contains("IDEM_INSECURE_NO_AUTH"), "auth stays on");
    }

    // The idemd image: its own stage, the binary alone, a numeric non-root user.
    let stage = dockerfile.split("\nFROM ").find(|s| s.contains(" AS idemd")).ok_or("no idemd stage")?;
    let user = stage.lines().find_map(|l| l.strip_prefix("USER ")).ok_or("the idemd stage sets no USER")?;
    let uid = user.split(':').next().unwrap_or_default();
    assert!(uid.parse::<u32>().is_ok_and(|u| u > 0), "USER is a numeric non-root uid, not {user:?}");
    let copies: Vec<&str> = stage.lines().filter(|l| l.starts_with("COPY")).collect();
    assert_eq!(copies, ["COPY --from=build /src/target/release/idemd /usr/local/bin/idemd"], "only the binary");
    assert!(stage.contains("ENTRYPOINT [\"/usr/local/bin/idemd\", \"serve\""));
    Ok(())
}

#[tokio::test]
async fn preview_mints_a_fingerprint_in_body_and_header() -> TestResult {
    let stack = Stack::start(StackOpts::default()).await?;
    let (a, fp) = stack.preview(json!("100.00")).await?;
    assert_eq!(a.status, 200);
    assert_eq!(a.header("agent-fingerprint"), Some(fp.as_str()));
    assert!(a.json["quote_id"].is_string(), "the upstream's answer is kept: {a:?}");
    assert_eq!(a.json["amount"], json!("100.00"));
    let exp = a.json["fingerprint_expires_at"].as_u64().ok_or("no fingerprint_expires_at")?;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs();
    assert!(exp > now + 800 && exp <= now + 901, "route ttl is 900 s, got exp {exp} at {now}");
    assert_eq!(nonce_of(&fp)?.len(), 32);
    assert_eq!(a.body.len(), serde_json::to_vec(&a.json)?.len(), "content-length matches the rewritten body");
    assert_nothing_executed(&stack).await
}

#[tokio::test]
async fn confirm_with_drifted_memo_executes_with_the_nonce_as_idempotency_key() -> TestResult {
    let stack = Stack::start(StackOpts::default()).await?;
    let (_, fp) = stack.preview(json!("100.00")).await?;
    let mut body = transfer(json!("100.00"), "please ASAP");
    body["fingerprint"] = json!(fp);
    let a = stack.post("/v1/transfers", SUBJECT, &body, &[]).await?;
    assert_eq!(a.status, 201, "{a:?}");
    assert_eq!(a.json["status"], "executed");
    let nonce = nonce_of(&fp)?;
    assert_eq!(a.header("idempotency-key"), Some(nonce.as_str()));
    let ex = stack.executions().await?;
    assert_eq!(ex["total"], 1);
    assert_eq!(ex["by_key"][&nonce], 1, "the demo saw Idempotency-Key = nonce: {ex}");
    Ok(())
}

#[tokio::test]
async fn fingerprint_in_the_header_works_too_and_equal_decimals_match() -> TestResult {
    let stack = Stack::start(StackOpts::default()).await?;
    let (_, fp) = stack.preview(json!(100)).await?;
    // 100 at preview, "100.00" at confirm: the amount is declared decimal.
    let a =
        stack.post("/v1/transfers", SUBJECT, &transfer(json!("100.00"), "m"), &[("agent-fingerprint", &fp)]).await?;
    assert_eq!(a.status, 201, "{a:?}");
    Ok(())
}

#[tokio::test]
async fn changed_amount_is_params_changed_and_nothing_runs() -> TestResult {
    let stack = Stack::start(StackOpts::default()).await?;
    let (_, fp) = stack.preview(json!("100.00")).await?;
    let a =
        stack.post("/v1/transfers", SUBJECT, &transfer(json!("100.01"), "m"), &[("agent-fingerprint", &fp)]).await?;
    assert_eq!(a.status, 422);
    a.assert_prompt("params_changed");
    assert_eq!(stack.stat("wasmcustom.idem.security_events").await?, 1);
    assert_nothing_executed(&stack).await
}

#[tokio::test]
async fn another_subject_is_forbidden() -> TestResult {
    let stack = Stack::start(StackOpts::default()).await?;
    let (_, fp) = stack.preview(json!("100.00")).await?;
    let a = stack
        .post("/v1/transfers", "user-mallory", &transfer(json!("100.00"), "m"), &[("agent-fingerprint", &fp)])
        .await?;
    assert_eq!(a.status, 403);
    a.assert_prompt("forbidden");
    assert_eq!(a.json["retryable"], false);
    assert_nothing_executed(&stack).await
}

#[tokio::test]
async fn missing_subject_is_unauthenticated() -> TestResult {
    let stack = Stack::start(StackOpts::default()).await?;
    let r = stack.http.post(stack.url("/v1/transfers/preview")).json(&transfer(json!(1), "m")).send().await?;
    assert_eq!(r.status().as_u16(), 401);
    assert_nothing_executed(&stack).await
}

#[tokio::test]
async fn expired_fingerprint_is_gone() -> TestResult {
    let stack = Stack::start(StackOpts::default()).await?;
    let a = stack.post("/short/v1/transfers/preview", SUBJECT, &transfer(json!("5"), "m"), &[]).await?;
    let fp = a.json["fingerprint"].as_str().ok_or("no fingerprint")?.to_owned();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let a = stack.post("/v1/transfers", SUBJECT, &transfer(json!("5"), "m"), &[("agent-fingerprint", &fp)]).await?;
    assert_eq!(a.status, 410);
    a.assert_prompt("fingerprint_expired");
    assert_nothing_executed(&stack).await
}

#[tokio::test]
async fn one_flipped_character_is_invalid() -> TestResult {
    let stack = Stack::start(StackOpts::default()).await?;
    let (_, fp) = stack.preview(json!("100.00")).await?;
    let mut chars: Vec<char> = fp.chars().collect();
    let i = chars.len() / 3;
    chars[i] = if chars[i] == 'A' { 'B' } else { 'A' };
    let forged: String = chars.into_iter().collect();
    let a = stack
        .post("/v1/transfers", SUBJECT, &transfer(json!("100.00"), "m"), &[("agent-fingerprint", &forged)])
        .await?;
    assert_eq!(a.status, 400);
    a.assert_prompt("fingerprint_invalid");
    assert_nothing_executed(&stack).await
}

#[tokio::test]
async fn no_fingerprint_is_missing() -> TestResult {
    let stack = Stack::start(StackOpts::default()).await?;
    let a = stack.post("/v1/transfers", SUBJECT, &transfer(json!("100.00"), "m"), &[]).await?;
    assert_eq!(a.status, 428);
    a.assert_prompt("fingerprint_missing");
    assert_nothing_executed(&stack).await
}

#[tokio::test]
async fn oversized_and_broken_bodies_are_rejected() -> TestResult {
    let stack = Stack::start(StackOpts::default()).await?;
    let big = transfer(json!("1"), &"x".repeat(70 * 1024));
    let a = stack.post("/v1/transfers", SUBJECT, &big, &[]).await?;
    assert_eq!(a.status, 413, "{a:?}");
    a.assert_prompt("body_too_large");
    let a = stack.post("/v1/transfers/preview", SUBJECT, &big, &[]).await?;
    assert_eq!(a.status, 413);

    for path in ["/v1/transfers", "/v1/transfers/preview"] {
        let r = stack
            .http
            .post(stack.url(path))
            .header("x-agent-subject", SUBJECT)
            .header("content-type", "application/json")
            .body("{\"amount\": 1,,")
            .send()
            .await?;
        assert_eq!(r.status().as_u16(), 400, "{path}");
        let j: Value = r.json().await?;
        assert_eq!(j["status"], "invalid_json");
    }
    // A bound field of the wrong type is a clear 400, not a hash of garbage.
    let a = stack.post("/v1/transfers/preview", SUBJECT, &transfer(json!({"x": 1}), "m"), &[]).await?;
    assert_eq!(a.status, 400);
    a.assert_prompt("invalid_field");
    let ex = stack.executions().await?;
    assert_eq!(ex["total"], 0);
    Ok(())
}

#[tokio::test]
async fn replies_speak_chinese_when_configured() -> TestResult {
    let edit = ("\"language\": \"en\"".to_string(), "\"language\": \"zh\"".to_string());
    let stack = Stack::start(StackOpts { envoy_edits: vec![edit], ..Default::default() }).await?;
    let (_, fp) = stack.preview(json!("100.00")).await?;
    let a =
        stack.post("/v1/transfers", SUBJECT, &transfer(json!("100.01"), "m"), &[("agent-fingerprint", &fp)]).await?;
    assert_eq!(a.status, 422);
    a.assert_prompt("params_changed");
    let meaning = a.json["meaning"].as_str().unwrap_or_default();
    assert!(meaning.chars().any(|c| ('\u{4e00}'..='\u{9fff}').contains(&c)), "Chinese text expected: {meaning}");
    assert_nothing_executed(&stack).await
}

#[tokio::test]
async fn unannotated_routes_pass_through() -> TestResult {
    let stack = Stack::start(StackOpts::default()).await?;
    let a = stack.get("/v1/executions", SUBJECT, &[]).await?;
    assert_eq!(a.status, 200);
    assert_eq!(a.json["total"], 0);
    assert!(a.header("agent-fingerprint").is_none());
    Ok(())
}

#[tokio::test]
async fn envoy_refuses_a_bad_plugin_configuration() -> TestResult {
    let dir = tempfile::tempdir()?;
    let ports = Ports { listener: free_port()?, admin: free_port()?, demo: free_port()?, sidecar: free_port()? };
    let good = render_envoy_config("envoy.yaml", &ports)?;
    let bad = good.replace("\"active_kid\": \"dev1\"", "\"active_kid\": \"nope\"");
    assert_ne!(good, bad);
    let path = dir.path().join("bad.yaml");
    std::fs::write(&path, bad)?;
    let out = std::process::Command::new(envoy_bin()?)
        .args(["--disable-hot-restart", "--concurrency", "1", "-c"])
        .arg(&path)
        .output()?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "Envoy must not start:\n{text}");
    assert!(text.contains("invalid plugin configuration"), "Envoy's log says why:\n{text}");
    Ok(())
}
