//! The production subject source: `jwt_authn` verifies the caller's JWT and
//! puts its payload into dynamic metadata; the filter binds fingerprints to the
//! `sub` it reads from there (plugin config `"subject": {"property": [...]}`),
//! and a client-supplied `x-agent-subject` header means nothing.
//!
//! The native module reads dynamic metadata only one level deep (Envoy 1.40's
//! ABI has no getter for a field inside a struct), so there `jwt_authn` copies
//! the verified `sub` into a header (`claim_to_headers`) and the filter reads
//! that header; a client's own copy of that header is overwritten by jwt_authn,
//! which this test checks by sending a forged one.

use base64::Engine as _;
use hmac::{Hmac, Mac};
use idem_e2e::*;
use serde_json::json;

const JWT_SECRET: &[u8] = b"e2e-only-jwt-secret-0123456789abcdef";

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// An HS256 JWT for `sub`, signed with the key the test's JWKS holds.
fn jwt(sub: &str) -> Result<String, BoxError> {
    let exp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs() + 600;
    let header = b64(br#"{"alg":"HS256","typ":"JWT"}"#);
    let payload = b64(serde_json::to_string(&json!({"iss": "e2e-issuer", "sub": sub, "exp": exp}))?.as_bytes());
    let signing_input = format!("{header}.{payload}");
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(JWT_SECRET)?;
    mac.update(signing_input.as_bytes());
    Ok(format!("{signing_input}.{}", b64(&mac.finalize().into_bytes())))
}

/// e2e.yaml with `jwt_authn` in front of the filter, and the filter reading the subject from its metadata.
fn jwt_stack_opts() -> Result<StackOpts, BoxError> {
    let jwks = json!({"keys": [{"kty": "oct", "alg": "HS256", "k": b64(JWT_SECRET)}]}).to_string();
    let jwt_filter = format!(
        r#"          http_filters:
          - name: envoy.filters.http.jwt_authn
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication
              providers:
                agents:
                  issuer: e2e-issuer
                  local_jwks: {{ inline_string: '{jwks}' }}
                  payload_in_metadata: jwt_payload
                  claim_to_headers: [{{ header_name: {VERIFIED_SUB}, claim_name: sub }}]
              rules:
              - match: {{ prefix: /v1/transfers }}
                requires: {{ provider_name: agents }}
          - name: envoy.filters.http.wasm
"#
    );
    let subject = if FilterHost::current()?.is_native() {
        format!(r#""subject": {{"header": "{VERIFIED_SUB}"}}"#)
    } else {
        r#""subject": {"property": ["metadata", "filter_metadata", "envoy.filters.http.jwt_authn", "jwt_payload", "sub"]}"#
            .to_string()
    };
    let edits = vec![
        ("          http_filters:\n          - name: envoy.filters.http.wasm\n".to_string(), jwt_filter),
        (r#""subject": {"header": "x-agent-subject"}"#.to_string(), subject),
    ];
    Ok(StackOpts { envoy_edits: edits, ..Default::default() })
}

/// The header jwt_authn writes the verified `sub` into (the native module's subject source).
const VERIFIED_SUB: &str = "x-verified-sub";

#[tokio::test]
async fn fingerprints_bind_to_the_verified_jwt_subject() -> TestResult {
    let stack = Stack::start(jwt_stack_opts()?).await?;
    let alice = format!("Bearer {}", jwt("alice")?);
    let bob = format!("Bearer {}", jwt("bob")?);

    let body = transfer(json!("12.00"), "m");
    // `Stack::post` also sends x-agent-subject: user-alice, which must not matter here.
    let p = stack.post("/v1/transfers/preview", "user-alice", &body, &[("authorization", &alice)]).await?;
    assert_eq!(p.status, 200, "{p:?}");
    let fp = p.json["fingerprint"].as_str().ok_or("no fingerprint")?.to_owned();

    let stolen = stack
        .post(
            "/v1/transfers",
            "user-alice",
            &body,
            &[("authorization", &bob), ("agent-fingerprint", &fp), (VERIFIED_SUB, "alice")],
        )
        .await?;
    assert_eq!(stolen.status, 403, "bob cannot use alice's fingerprint, whatever header he sends: {stolen:?}");
    stolen.assert_prompt("forbidden");

    let own = stack
        .post("/v1/transfers", "user-bob", &body, &[("authorization", &alice), ("agent-fingerprint", &fp)])
        .await?;
    assert_eq!(own.status, 201, "alice's JWT confirms, the header is ignored: {own:?}");

    let anonymous = stack.post("/v1/transfers", "user-alice", &body, &[("agent-fingerprint", &fp)]).await?;
    assert_eq!(anonymous.status, 401, "jwt_authn rejects a call without a token");
    assert_eq!(stack.executions().await?["total"], 1);
    Ok(())
}
