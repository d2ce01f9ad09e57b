//! Who may call the API (DESIGN §6): only the filter, which proves it with a
//! bearer token. An open idemd would let anyone who can reach it read any
//! operation's result or take over its lease: the nonce, scope and param hash
//! are all readable from a fingerprint.
//!
//! Several tokens are accepted at once so a token can be rotated without
//! downtime: add the new one, move the filters to it, remove the old one.
//! `/healthz` and `/metrics` stay open (probes and scrapers carry no secret,
//! and neither answer names an operation).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use subtle::ConstantTimeEq;

use crate::store::Store;

/// Shortest token idemd accepts: guessing must be hopeless.
pub const MIN_TOKEN_LEN: usize = idem_core::policy::MIN_TOKEN_LEN;

/// The accepted credentials; empty means `--insecure-no-auth`.
#[derive(Clone, Default)]
pub struct Tokens(Vec<Vec<u8>>);

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokens({} accepted)", self.0.len())
    }
}

impl Tokens {
    /// Every token must be at least [`MIN_TOKEN_LEN`] printable ASCII characters.
    pub fn new(tokens: &[String]) -> Result<Tokens, String> {
        let mut out = Vec::with_capacity(tokens.len());
        for (i, t) in tokens.iter().map(|t| t.trim()).enumerate() {
            if t.len() < MIN_TOKEN_LEN || !t.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(format!(
                    "--auth-tokens: token #{} must be at least {MIN_TOKEN_LEN} printable ASCII characters without spaces",
                    i + 1
                ));
            }
            out.push(t.as_bytes().to_vec());
        }
        Ok(Tokens(out))
    }

    pub fn is_open(&self) -> bool {
        self.0.is_empty()
    }

    /// Constant time in the presented token's content; every accepted token is compared.
    pub fn accepts(&self, presented: &[u8]) -> bool {
        let mut ok = subtle::Choice::from(0u8);
        for t in &self.0 {
            ok |= t.as_slice().ct_eq(presented);
        }
        bool::from(ok)
    }
}

#[derive(Clone)]
pub struct AuthState {
    pub tokens: Arc<Tokens>,
    pub store: Arc<Store>,
}

/// The layer in front of `/v1/*`: 401 and nothing read or changed without a
/// valid `Authorization: Bearer <token>`.
pub async fn require_token(State(auth): State<AuthState>, req: Request, next: Next) -> Response {
    if auth.tokens.is_open() {
        return next.run(req).await;
    }
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(str::trim);
    match presented {
        Some(token) if auth.tokens.accepts(token.as_bytes()) => next.run(req).await,
        _ => {
            auth.store.metrics().auth_rejected();
            let trace_id = req.headers().get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("-");
            tracing::warn!(
                path = %req.uri().path(),
                trace_id,
                credential = if presented.is_some() { "wrong" } else { "missing" },
                "refused an API call without a valid token"
            );
            (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer")],
                Json(json!({"error": "unauthorized", "detail": "a valid Authorization: Bearer token is required"})),
            )
                .into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_checked_and_rotation_accepts_two() {
        assert!(Tokens::new(&["short".into()]).is_err());
        assert!(Tokens::new(&["has a space 0123456789".into()]).is_err());
        let t = Tokens::new(&["old-token-0123456789".into(), "new-token-0123456789".into()]).unwrap_or_default();
        assert!(t.accepts(b"old-token-0123456789"));
        assert!(t.accepts(b"new-token-0123456789"));
        assert!(!t.accepts(b"new-token-012345678"));
        assert!(!t.accepts(b""));
        assert!(!t.is_open());
        assert!(Tokens::new(&[]).map(|t| t.is_open()).unwrap_or(false));
        assert!(!format!("{t:?}").contains("token-0123"));
    }
}
