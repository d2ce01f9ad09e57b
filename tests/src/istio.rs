//! The filter the way Istio runs it (envoy/istio-like.yaml): the plugin configuration istiod makes of
//! deploy/istio/wasmplugin.yaml, the subject from the JWT Istio's jwt_authn verified, the secrets from the
//! proxy's environment. Shared by tests/tests/istio.rs and the bypass suite.

use crate::{fingerprint_claims, repo_root, transfer, Answer, BoxError, Stack, StackOpts};
use base64::Engine as _;
use hmac::{Hmac, Mac};
use serde_json::{json, Value};

/// The test-only key of envoy/istio-like.yaml's JWKS.
const JWT_SECRET: &[u8] = b"e2e-only-jwt-secret-0123456789abcdef";
const HMAC_KEY: &str = "istio-e2e-only-hmac-key-0123456789abcdef-0123";
/// idemd's token and the filter's, should the harness not set its own (it overrides these for both processes).
const FALLBACK_SIDECAR_TOKEN: &str = "istio-e2e-only-sidecar-token-0123456789";

/// Why the Istio tests run on the `.wasm` alone.
pub const ISTIO_IS_WASM_ONLY: &str = "Istio loads filters as .wasm only (it has no dynamic-module API)";

/// The Secrets of deploy/: the istio-proxy's IDEM_HMAC_K1 and IDEM_SIDECAR_TOKEN (passed into the VM by
/// `host_env_keys`), idemd's IDEM_AUTH_TOKENS. Envoy and idemd inherit this process's environment.
pub fn set_secret_env() {
    std::env::set_var("IDEM_HMAC_K1", HMAC_KEY);
    std::env::set_var("IDEM_SIDECAR_TOKEN", FALLBACK_SIDECAR_TOKEN);
    std::env::set_var("IDEM_AUTH_TOKENS", FALLBACK_SIDECAR_TOKEN);
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// `Bearer <HS256 JWT>` for `sub`, from the issuer and audience of deploy/istio/requestauthentication.yaml.
pub fn bearer(sub: &str) -> Result<String, BoxError> {
    let exp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs() + 600;
    let header = b64(br#"{"alg":"HS256","typ":"JWT"}"#);
    let claims = json!({"iss": "https://auth.example.com/", "aud": "payments-api", "sub": sub, "exp": exp});
    let signing_input = format!("{header}.{}", b64(serde_json::to_string(&claims)?.as_bytes()));
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(JWT_SECRET)?;
    mac.update(signing_input.as_bytes());
    Ok(format!("Bearer {signing_input}.{}", b64(&mac.finalize().into_bytes())))
}

/// The WasmPlugin's configuration as istiod serializes it.
pub fn wasmplugin_config() -> Result<String, BoxError> {
    let text = std::fs::read_to_string(repo_root().join("deploy/istio/wasmplugin.yaml"))?;
    idem_oci::istio::plugin_config_json(&text, "WasmPlugin").map_err(|e| e.to_string().into())
}

/// istio-like.yaml, whose configuration must be the WasmPlugin's: the harness refuses an edit that matches
/// nothing, so replacing the derived string by itself proves the running config carries it.
pub fn istio_opts(extra_edits: Vec<(String, String)>) -> Result<StackOpts, BoxError> {
    let config = wasmplugin_config()?;
    let mut edits = vec![(format!("value: '{config}'"), format!("value: '{config}'"))];
    edits.extend(extra_edits);
    Ok(StackOpts { envoy_config: "istio-like.yaml", envoy_edits: edits, ..Default::default() })
}

/// The walk a gateway whose subject is a verified JWT's `sub` must pass (Istio's, Envoy Gateway's): alice previews
/// and confirms once, a retry with a drifted memo replays with the rule's `result_ref`, a changed amount is
/// `params_changed`, bob with alice's fingerprint is `forbidden`. Every request also carries `forged` (subject
/// headers a client made up, which must change nothing). Returns alice's `Authorization` and a fingerprint of hers
/// that nothing ran for.
pub async fn jwt_subject_walk(stack: &Stack, forged: &[(&str, &str)]) -> Result<(String, String), BoxError> {
    let alice = bearer("alice")?;
    // Stack::post also sends `x-agent-subject: user-mallory`: with the subject from the JWT it means nothing.
    let post = |path: &'static str, body: Value, auth: String, fp: Option<String>| async move {
        let mut h: Vec<(&str, &str)> = forged.to_vec();
        h.push(("authorization", auth.as_str()));
        if let Some(fp) = fp.as_deref() {
            h.push(("agent-fingerprint", fp));
        }
        stack.post(path, "user-mallory", &body, &h).await
    };
    let fingerprint = |a: &Answer| a.json["fingerprint"].as_str().map(str::to_owned).ok_or("no fingerprint");

    let p = post("/v1/transfers/preview", transfer(json!("25.00"), "rent"), alice.clone(), None).await?;
    assert_eq!(p.status, 200, "the preview rule matched by its path: {p:?}");
    let fp = fingerprint(&p)?;
    assert_eq!(fingerprint_claims(&fp)?["s"], "payments.transfer", "the rule's scope");
    let first = post("/v1/transfers", transfer(json!("25.00"), "rent"), alice.clone(), Some(fp.clone())).await?;
    assert_eq!(first.status, 201, "confirmed through idemd's cluster with the token: {first:?}");
    assert_eq!(first.header("idempotent-replayed"), Some("false"));
    let again = post("/v1/transfers", transfer(json!(25), "rent, ASAP"), alice.clone(), Some(fp)).await?;
    assert_eq!(again.status, 201, "the replay keeps the original status");
    again.assert_prompt("already_completed");
    assert_eq!(again.json["result_ref"], first.json["transfer_id"], "the rule's result_ref");

    let p2 = post("/v1/transfers/preview", transfer(json!("40.00"), "m"), alice.clone(), None).await?;
    let fp2 = fingerprint(&p2)?;
    let tampered = post("/v1/transfers", transfer(json!("40.01"), "m"), alice.clone(), Some(fp2.clone())).await?;
    assert_eq!(tampered.status, 422);
    tampered.assert_prompt("params_changed");
    let bob = post("/v1/transfers", transfer(json!("40.00"), "m"), bearer("bob")?, Some(fp2.clone())).await?;
    assert_eq!(bob.status, 403, "alice's fingerprint is not bob's: {bob:?}");
    bob.assert_prompt("forbidden");
    Ok((alice, fp2))
}

/// The line of a `.wasm` filter's configuration that lets it hold a request while it reads the body.
pub const HOLD_LINE: &str = "                allow_on_headers_stop_iteration: true\n";

/// Whether alice's guarded preview stays unanswered for 3 s (`true`): what a `.wasm` filter without
/// `allow_on_headers_stop_iteration` does to every guarded request, since Envoy then never hands it the body.
pub async fn guarded_preview_hangs(stack: &Stack) -> Result<bool, BoxError> {
    let req = stack
        .http
        .post(stack.url("/v1/transfers/preview"))
        .header("authorization", bearer("alice")?)
        .json(&transfer(json!("25.00"), "rent"))
        .timeout(std::time::Duration::from_secs(3))
        .send()
        .await;
    match req {
        Err(e) if e.is_timeout() => Ok(true),
        Ok(_) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// The test-only HMAC key of [`route_rules_shape`].
const RULES_HMAC_KEY: &str = "paths-e2e-only-hmac-key-0123456789abcdef-0123";

/// istio-like.yaml as the route-rule shape on either build, over `base`'s stores: the subject from the harness's
/// header (the native module reads no JWT metadata; the subject is not what the shape is about), the filter under
/// the name and in the layout the harness converts to the native module, and the committed plugin configuration
/// as `edit` leaves it. Everything else — the connection manager, the mesh's catch-all route, the route rules —
/// is the committed file's.
pub fn route_rules_shape(mut base: StackOpts, edit: impl FnOnce(&mut Value)) -> Result<StackOpts, BoxError> {
    std::env::set_var("IDEM_HMAC_K1", RULES_HMAC_KEY);
    let text = std::fs::read_to_string(repo_root().join("envoy/istio-like.yaml"))?;
    let start = text.find("value: '{").ok_or("no plugin configuration in istio-like.yaml")? + "value: '".len();
    let end = start + text[start..].find("}'\n").ok_or("unterminated plugin configuration")? + 1;
    let committed = &text[start..end];
    let mut config: Value = serde_json::from_str(committed)?;
    config["subject"] = json!({"header": "x-agent-subject"});
    edit(&mut config);
    let pad = " ".repeat(20);
    base.envoy_config = "istio-like.yaml";
    base.envoy_edits = vec![
        (format!("value: '{committed}'"), format!("value: |\n{pad}{config}")),
        (
            "- name: extensions.istio.io/wasmplugin/payments.agent-idempotency\n".into(),
            "- name: envoy.filters.http.wasm\n".into(),
        ),
    ];
    Ok(base)
}
