//! Who may approve, and the decision route (DESIGN §4, "Approval"; §6: approvers authenticate
//! separately from the filter).
//!
//! | route                          | answers                                                        |
//! |--------------------------------|----------------------------------------------------------------|
//! | `POST /v1/approvals/{key}`     | 200 the decided `ApprovalView`; 403 own subject; 404 unknown;  |
//! |                                | 409 decided already; 410 lapsed; 400 bad input; 503            |
//! | `GET /v1/approvals`            | 200 `{"pending":[ApprovalView…]}`, oldest first                 |
//! | either without an approver     | 401; nothing read or changed                                   |
//!
//! Approvers are listed by identity with a credential of their own (`--approvers
//! alice=<token>,bob=<token>`), never the filter's token: the filter can record an operation but
//! never decide it, and an approver can decide but never acquire. The identity is what the audit
//! line names (`approver:alice`), and it is hashed as a subject is: an approver may not decide an
//! operation of their own subject unless `--allow-self-approval`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use base64::Engine as _;
use hmac::{Hmac, Mac};
use idem_core::protocol::{ApprovalDecision, ApprovalState, OpKey};
use serde_json::json;
use sha2::Sha256;
use subtle::ConstantTimeEq;

use crate::store::approval::{checked_reason, DecideError, MAX_REASON};
use crate::store::record::ApprovalRow;
use crate::store::rules::Refusal;
use crate::store::Store;

/// The approvers and what they may do.
#[derive(Clone, Default)]
pub struct Approvers {
    /// (identity, credential).
    list: Vec<(String, Vec<u8>)>,
    /// `--allow-self-approval`: an approver may decide an operation of their own subject.
    pub allow_self: bool,
}

impl std::fmt::Debug for Approvers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.list.iter().map(|(n, _)| n.as_str()).collect();
        write!(f, "Approvers({names:?}, allow_self: {})", self.allow_self)
    }
}

/// The identity of the approver a request authenticated as.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Approver(pub String);

const MAX_IDENTITY: usize = 128;

impl Approvers {
    /// `identity=credential` entries. Credentials follow the filter token's rules and must differ
    /// from every filter token and from each other: one secret never has both powers.
    pub fn new(entries: &[String], filter_tokens: &[String], allow_self: bool) -> Result<Approvers, String> {
        let mut list: Vec<(String, Vec<u8>)> = Vec::with_capacity(entries.len());
        for (i, entry) in entries.iter().map(|e| e.trim()).filter(|e| !e.is_empty()).enumerate() {
            let Some((identity, token)) = entry.split_once('=') else {
                return Err(format!("--approvers: entry #{} must be identity=credential", i + 1));
            };
            let (identity, token) = (identity.trim(), token.trim());
            if identity.is_empty()
                || identity.len() > MAX_IDENTITY
                || !identity.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.@:-".contains(&b))
            {
                return Err(format!(
                    "--approvers: entry #{}: the identity must be 1 to {MAX_IDENTITY} of A-Z a-z 0-9 _ . @ : -",
                    i + 1
                ));
            }
            if token.len() < crate::auth::MIN_TOKEN_LEN || !token.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(format!(
                    "--approvers: {identity}'s credential must be at least {} printable ASCII characters without spaces",
                    crate::auth::MIN_TOKEN_LEN
                ));
            }
            if filter_tokens.iter().any(|t| t.trim() == token) {
                return Err(format!(
                    "--approvers: {identity}'s credential is also a filter token (--auth-tokens): an approver's \
                     credential must be its own"
                ));
            }
            if list.iter().any(|(n, t)| n == identity || t.as_slice() == token.as_bytes()) {
                return Err(format!("--approvers: {identity} is listed twice, or shares a credential"));
            }
            list.push((identity.to_string(), token.as_bytes().to_vec()));
        }
        Ok(Approvers { list, allow_self })
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The approver holding `credential` (constant time in its content; every entry compared).
    pub fn identify(&self, credential: &[u8]) -> Option<Approver> {
        let mut found = None;
        for (name, token) in &self.list {
            if bool::from(token.as_slice().ct_eq(credential)) {
                found = Some(Approver(name.clone()));
            }
        }
        found
    }

    /// `Authorization: Bearer <credential>` (programs) or `Basic <identity:credential>` (the
    /// console in a browser); for Basic the identity must be the credential's.
    pub fn authenticate(&self, headers: &HeaderMap) -> Option<Approver> {
        let mut values = headers.get_all(header::AUTHORIZATION).iter();
        let value = values.next()?.to_str().ok()?.trim();
        if values.next().is_some() {
            return None;
        }
        if let Some(token) = value.strip_prefix("Bearer ") {
            return self.identify(token.trim().as_bytes());
        }
        let encoded = value.strip_prefix("Basic ")?;
        let decoded = base64::engine::general_purpose::STANDARD.decode(encoded.trim()).ok()?;
        let text = String::from_utf8(decoded).ok()?;
        let (user, token) = text.split_once(':')?;
        self.identify(token.as_bytes()).filter(|a| a.0 == user)
    }
}

#[derive(Clone)]
pub struct ApprovalsState {
    pub approvers: Arc<Approvers>,
    pub store: Arc<Store>,
    /// The console's CSRF tokens (`crate::console`).
    pub csrf: Arc<CsrfKey>,
    /// What a release from the console asks at that moment (`review`).
    pub lookups: Option<Arc<crate::reconcile::Lookups>>,
}

/// The CSRF secret: random per process (a restart only makes open forms stale).
pub struct CsrfKey([u8; 32]);

impl CsrfKey {
    pub fn random() -> CsrfKey {
        let mut k = [0u8; 32];
        if getrandom::fill(&mut k).is_err() {
            // Without OS randomness, a per-start token is still unguessable enough from outside
            // only if mixed with time and pid; forms still need the approver's credential.
            let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
            k[..16].copy_from_slice(&(t ^ u128::from(std::process::id())).to_le_bytes());
        }
        CsrfKey(k)
    }

    /// The token of `approver`'s forms.
    pub fn token(&self, approver: &str) -> String {
        let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(&self.0) else { return String::new() };
        mac.update(b"idemd-console-csrf:");
        mac.update(approver.as_bytes());
        hex::encode(mac.finalize().into_bytes())
    }

    pub fn accepts(&self, approver: &str, presented: &str) -> bool {
        let want = self.token(approver);
        !want.is_empty() && bool::from(want.as_bytes().ct_eq(presented.as_bytes()))
    }
}

/// The layer in front of the approval routes: 401 (with a Basic challenge, so a browser asks)
/// and nothing read or changed without an approver's credential.
pub async fn require_approver(State(auth): State<ApprovalsState>, mut req: Request, next: Next) -> Response {
    match auth.approvers.authenticate(req.headers()) {
        Some(approver) => {
            req.extensions_mut().insert(approver);
            next.run(req).await
        }
        None => {
            auth.store.metrics().auth_rejected();
            tracing::warn!(path = %req.uri().path(), "refused an approval call without an approver's credential");
            (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Basic realm=\"idemd approvals\", charset=\"UTF-8\"")],
                Json(json!({"error": "unauthorized", "detail": "an approver's credential is required"})),
            )
                .into_response()
        }
    }
}

/// `POST /v1/approvals/{key}`: `{"decision": "approve"|"reject", "reason": "…"}`.
pub async fn decide(
    State(auth): State<ApprovalsState>,
    Extension(approver): Extension<Approver>,
    Path(key): Path<String>,
    body: Bytes,
) -> Response {
    let Ok(key) = OpKey::parse(&key) else {
        return error(StatusCode::BAD_REQUEST, "bad_request", "the operation must be 32 lowercase hex characters");
    };
    let Ok(decision) = serde_json::from_slice::<ApprovalDecision>(&body) else {
        return error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "expected {\"decision\": \"approve\" or \"reject\", \"reason\": \"…\"}",
        );
    };
    let Some(reason) = checked_reason(&decision.reason) else {
        return error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            &format!("reason: required, 1 to {MAX_REASON} characters without control characters"),
        );
    };
    match decide_as(&auth, &approver, &key, decision.decision, reason).await {
        Ok(row) => (StatusCode::OK, Json(row.view(auth.store.console()))).into_response(),
        Err(DecideError::Unavailable) => error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", "try again"),
        Err(DecideError::Refused(r)) => refusal(r),
    }
}

/// The decision route's and the console's one path to a decision: the store's transition (audited there),
/// then the log line. Each caller answers in its own form.
pub async fn decide_as(
    auth: &ApprovalsState,
    approver: &Approver,
    key: &OpKey,
    decision: idem_core::protocol::Decision,
    reason: &str,
) -> Result<ApprovalRow, DecideError> {
    let row = auth.store.decide(key, decision, &approver.0, reason, auth.approvers.allow_self).await?;
    tracing::info!(key = %key, approver = %approver.0, decision = decision.as_str(), "approval decided");
    Ok(row)
}

pub fn refusal(r: Refusal) -> Response {
    match r {
        Refusal::Unknown => error(StatusCode::NOT_FOUND, "not_found", "no approval is waiting under this operation"),
        Refusal::Decided(ApprovalState::Lapsed) | Refusal::Lapsed => {
            error(StatusCode::GONE, "lapsed", "the fingerprint expired before a decision: nothing was executed")
        }
        Refusal::Decided(state) => error(StatusCode::CONFLICT, "decided", &format!("already {}", state.as_str())),
        Refusal::OwnSubject => {
            error(StatusCode::FORBIDDEN, "own_subject", "an approver may not decide an operation of their own subject")
        }
    }
}

/// `GET /v1/approvals`: what waits for a person, oldest first.
pub async fn pending(State(auth): State<ApprovalsState>) -> Response {
    match auth.store.pending_approvals(500).await {
        Ok(rows) => {
            let views: Vec<_> = rows.iter().filter_map(|r| r.view(auth.store.console())).collect();
            (StatusCode::OK, Json(json!({ "pending": views }))).into_response()
        }
        Err(_) => error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", "try again"),
    }
}

fn error(status: StatusCode, error: &str, detail: &str) -> Response {
    (status, Json(json!({"error": error, "detail": detail}))).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn approvers_have_credentials_of_their_own() {
        let filter = vec!["filter-token-0123456789".to_string()];
        assert!(Approvers::new(&["alice".into()], &filter, false).is_err());
        assert!(Approvers::new(&["alice=short".into()], &filter, false).is_err());
        assert!(Approvers::new(&["alice=filter-token-0123456789".into()], &filter, false).is_err());
        assert!(Approvers::new(&["al ice=alice-token-0123456789".into()], &filter, false).is_err());
        let two = ["alice=alice-token-0123456789".into(), "alice=other-token-0123456789".into()];
        assert!(Approvers::new(&two, &filter, false).is_err());
        let a =
            Approvers::new(&["alice=alice-token-0123456789".into(), "bob=bob-token-0123456789".into()], &filter, false)
                .unwrap_or_default();
        assert_eq!(a.identify(b"bob-token-0123456789"), Some(Approver("bob".into())));
        assert_eq!(a.identify(b"filter-token-0123456789"), None);
        let mut h = HeaderMap::new();
        let basic = base64::engine::general_purpose::STANDARD.encode("alice:alice-token-0123456789");
        h.insert(
            header::AUTHORIZATION,
            format!("Basic {basic}").parse().unwrap_or(header::HeaderValue::from_static("")),
        );
        assert_eq!(a.authenticate(&h), Some(Approver("alice".into())));
        // Another identity with alice's credential is nobody.
        let wrong = base64::engine::general_purpose::STANDARD.encode("bob:alice-token-0123456789");
        h.insert(
            header::AUTHORIZATION,
            format!("Basic {wrong}").parse().unwrap_or(header::HeaderValue::from_static("")),
        );
        assert_eq!(a.authenticate(&h), None);
        // Two Authorization headers are nobody.
        h.insert(header::AUTHORIZATION, header::HeaderValue::from_static("Bearer bob-token-0123456789"));
        h.append(header::AUTHORIZATION, header::HeaderValue::from_static("Bearer bob-token-0123456789"));
        assert_eq!(a.authenticate(&h), None);
        assert!(!format!("{a:?}").contains("token"));
    }
}
