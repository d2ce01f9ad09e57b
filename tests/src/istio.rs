//! The filter the way Istio runs it (envoy/istio-like.yaml): the plugin configuration istiod makes of
//! deploy/istio/wasmplugin.yaml, the subject from the JWT Istio's jwt_authn verified, the secrets from the
//! proxy's environment. Shared by tests/tests/istio.rs and the bypass suite.

use crate::{repo_root, BoxError, StackOpts};
use base64::Engine as _;
use hmac::{Hmac, Mac};
use serde_json::json;

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
