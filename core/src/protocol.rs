//! The wire contract between the filter and `idemd` (JSON over HTTP/1.1).
//!
//! One definition serves both sides: the filter serializes requests and parses
//! answers with these types, and the sidecar's axum handlers use the same ones,
//! so the two cannot drift apart.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// One spelling per wire token: `as_str` and `FromStr` for a protocol enum, the
/// same words serde uses, so SQL columns, Redis hashes, metrics labels and JSON
/// can never disagree.
macro_rules! wire_names {
    ($ty:ident { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl $ty {
            pub const ALL: &'static [$ty] = &[$($ty::$variant),+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $($ty::$variant => $name),+
                }
            }
        }

        impl FromStr for $ty {
            type Err = UnknownName;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($name => Ok($ty::$variant),)+
                    _ => Err(UnknownName { what: stringify!($ty), name: s.chars().take(32).collect() }),
                }
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

/// 128 bits as 32 lowercase hex characters: checked once, where the value is
/// built or read off the wire, and never confused with the other kind.
macro_rules! hex_token {
    ($(#[$doc:meta])* $ty:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $ty(String);

        impl $ty {
            pub fn parse(s: &str) -> Result<$ty, BadToken> {
                if is_hex_token(s) {
                    Ok($ty(s.to_string()))
                } else {
                    Err(BadToken { what: stringify!($ty) })
                }
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// 16 bytes (a nonce, or fresh randomness) in the canonical spelling.
            pub fn from_bytes(bytes: [u8; 16]) -> $ty {
                $ty(hex::encode(bytes))
            }
        }

        impl TryFrom<String> for $ty {
            type Error = BadToken;
            fn try_from(s: String) -> Result<$ty, BadToken> {
                $ty::parse(&s)
            }
        }

        impl From<$ty> for String {
            fn from(t: $ty) -> String {
                t.0
            }
        }

        impl std::ops::Deref for $ty {
            type Target = str;
            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl PartialEq<str> for $ty {
            fn eq(&self, other: &str) -> bool {
                self.0 == other
            }
        }

        impl PartialEq<&str> for $ty {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }
    };
}

hex_token!(
    /// The operation key: the fingerprint's nonce, the SQL primary key, the
    /// Redis hash tag and the upstream's `Idempotency-Key`.
    OpKey
);
hex_token!(
    /// Who owns an IN_FLIGHT operation (handed out by ACQUIRED): only its holder
    /// may complete or release it.
    OwnerToken
);

/// 32 lowercase hex characters.
pub fn is_hex_token(s: &str) -> bool {
    s.len() == 32 && s.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'))
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadToken {
    pub what: &'static str,
}

impl fmt::Display for BadToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} must be 32 lowercase hex characters", self.what)
    }
}

impl std::error::Error for BadToken {}

/// A wire token that names no variant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownName {
    pub what: &'static str,
    pub name: String,
}

impl fmt::Display for UnknownName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} is not a {}", self.name, self.what)
    }
}

impl std::error::Error for UnknownName {}

/// `POST /v1/acquire`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AcquireRequest {
    /// The fingerprint nonce.
    pub key: OpKey,
    pub param_hash: String,
    pub subject_hash: String,
    pub scope: String,
    /// How long the new owner holds the IN_FLIGHT lease.
    pub lease_ms: u64,
    /// The filter's trace id: logged with the call and kept in the audit trail.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub trace_id: String,
    /// How the caller named the operation (a metrics label).
    #[serde(default, skip_serializing_if = "KeyMode::is_fingerprint")]
    pub mode: KeyMode,
    /// The fingerprint's `exp` (unix seconds): the record is kept until `exp` plus the
    /// retention at least, so no retry with a live fingerprint finds it reaped (DESIGN §4).
    /// `None` for client keys (their window is the retention alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exp: Option<u64>,
    /// The route's upstream ignores `Idempotency-Key` (`upstream_keys: ignored`): the reconciler
    /// must not read a by-key 404 as "never executed", and looks up by `business_ref` instead.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub upstream_ignores_keys: bool,
    /// The value of the route's `business_ref` field in this confirm (a client reference the
    /// upstream stores), for the reconciler's lookup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub business_ref: Option<String>,
    /// The route's `approval` rule says a person must approve this confirm first (DESIGN §4,
    /// "Approval"): idemd records it AWAITING_APPROVAL, and only an approved operation acquires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<ApprovalAsk>,
    /// The bound fields' canonical JSON (`canonical::canonical_params`, whose SHA-256 is
    /// `param_hash`), sent with a `business_ref`: a record the upstream answers under that reference
    /// settles this operation only if it carries these values (DESIGN §4, "A reference proves only
    /// its own operation").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fields: Option<String>,
}

/// What an approver is shown of an operation: the canonical JSON of its bound fields (the
/// fingerprint covers exactly these; never free text, never a secret).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApprovalAsk {
    pub fields: String,
}

/// Where an operation that needs a person stands (`idem_approval.state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ApprovalState {
    /// Recorded, nothing forwarded: a person has to decide before the fingerprint's `exp`.
    AwaitingApproval,
    /// A person approved: the next confirm with this fingerprint acquires (once).
    Approved,
    /// A person refused: terminal, replayed, nothing executed.
    Rejected,
    /// Nobody decided before `exp` (or the approved confirm came after it): nothing executed.
    Lapsed,
}

wire_names!(ApprovalState {
    AwaitingApproval => "AWAITING_APPROVAL",
    Approved => "APPROVED",
    Rejected => "REJECTED",
    Lapsed => "LAPSED",
});

/// An approval record as idemd answers it (acquire, lookups, the decision route).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApprovalView {
    pub key: OpKey,
    pub state: ApprovalState,
    pub scope: String,
    pub subject_hash: String,
    /// The bound fields' canonical JSON.
    pub fields: String,
    pub created_at_ms: i64,
    /// The fingerprint's `exp` in unix ms: past it the approval lapses.
    pub expires_at_ms: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_at_ms: Option<i64>,
    /// The approver's identity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_by: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Where a person approves (idemd's `--approval-console-url`), for the agent to tell the user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub console: Option<String>,
}

impl ApprovalView {
    /// The state as of `now_ms`: awaiting or approved (not yet executed) past `exp` is lapsed.
    pub fn state_at(&self, now_ms: i64) -> ApprovalState {
        match self.state {
            ApprovalState::AwaitingApproval | ApprovalState::Approved if now_ms >= self.expires_at_ms => {
                ApprovalState::Lapsed
            }
            s => s,
        }
    }
}

/// `POST /v1/approvals/{key}`: an approver's decision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApprovalDecision {
    pub decision: Decision,
    pub reason: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    Approve,
    Reject,
}

wire_names!(Decision { Approve => "approve", Reject => "reject" });

/// The body of `GET /v1/operations/{key}?exp=…` when there is no row. `reaped_possible`: a row
/// for a fingerprint with that `exp` could have existed and been deleted after the retention,
/// so "never started" is not known (idemd knows its retention, the caller knows `exp`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NotFoundView {
    #[serde(default)]
    pub error: String,
    #[serde(default)]
    pub reaped_possible: bool,
}

/// An answer with the operation's approval record beside it: the acquire's on AWAITING_APPROVAL,
/// REJECTED and LAPSED, and a lookup's 404 (nothing executed yet, but a person is or was asked).
/// A wrapper rather than one more field, so the answers without approval keep their shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WithApproval<T> {
    #[serde(flatten)]
    pub answer: T,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<ApprovalView>,
}

/// How an operation was named: a server-issued fingerprint, or the caller's
/// own `Idempotency-Key` (client-key mode).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyMode {
    #[default]
    Fingerprint,
    ClientKey,
}

impl KeyMode {
    pub fn is_fingerprint(&self) -> bool {
        *self == KeyMode::Fingerprint
    }

    pub fn as_str(self) -> &'static str {
        match self {
            KeyMode::Fingerprint => "fingerprint",
            KeyMode::ClientKey => "client_key",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum AcquireOutcome {
    /// The caller owns the operation now and must execute it.
    Acquired,
    /// Someone else owns it and the result is not known yet.
    InFlight,
    Done,
    Failed,
    /// The reconciler could not tell whether it executed: a person decides.
    NeedsReview,
    /// Same key, different param_hash: a security event.
    ParamMismatch,
    /// The SQL truth cannot be reached: nothing was recorded, nothing may run.
    StoreUnavailable,
    /// A person must approve first: recorded, nothing forwarded (`approval` says what).
    AwaitingApproval,
    /// A person refused: nothing executed, ever (`approval.reason` says why).
    Rejected,
    /// Another operation of this scope holds the same business reference (`business_ref`): a reference
    /// that named two operations would prove neither, so this one is refused: nothing recorded, nothing
    /// forwarded.
    ReferenceInUse,
    /// Nobody approved before the fingerprint's `exp`: nothing executed.
    Lapsed,
    /// idemd refused to start the operation where its database's replication could lose the record in a
    /// failover (an asynchronous standby it cannot wait for, on a route whose upstream ignores keys; or a
    /// read-only standby): nothing recorded, nothing may run. Not a passing outage: it lasts until an
    /// operator changes the database or accepts the risk (docs/operations.md, "Topologies").
    ReplicationRefused,
}

wire_names!(AcquireOutcome {
    Acquired => "ACQUIRED",
    InFlight => "IN_FLIGHT",
    Done => "DONE",
    Failed => "FAILED",
    NeedsReview => "NEEDS_REVIEW",
    ParamMismatch => "PARAM_MISMATCH",
    StoreUnavailable => "STORE_UNAVAILABLE",
    AwaitingApproval => "AWAITING_APPROVAL",
    Rejected => "REJECTED",
    Lapsed => "LAPSED",
    ReferenceInUse => "REFERENCE_IN_USE",
    ReplicationRefused => "REPLICATION_REFUSED",
});

/// Answer to `POST /v1/acquire`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AcquireResponse {
    pub outcome: AcquireOutcome,
    /// Set on ACQUIRED (the caller's owner token) and on IN_FLIGHT (the holder).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<OwnerToken>,
    /// Set on DONE and FAILED: what a replay sends back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<StoredResult>,
}

/// What a replay needs: the upstream's status, a safe subset of its headers,
/// and its body (base64 so any bytes survive JSON).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StoredResult {
    pub status: u16,
    #[serde(default)]
    pub headers: Vec<(String, String)>,
    #[serde(default)]
    pub body_b64: String,
}

/// Upstream headers worth replaying. Everything else (hop-by-hop, cookies,
/// server timing, content-length that the replay envelope changes) stays out
/// of the store.
const REPLAY_HEADERS: &[&str] = &["content-type", "location", "content-language"];

/// The safe subset of an upstream answer's headers, lowercased, in order.
pub fn replay_headers(headers: &[(String, String)]) -> Vec<(String, String)> {
    headers
        .iter()
        .filter(|(k, _)| REPLAY_HEADERS.contains(&k.to_ascii_lowercase().as_str()))
        .map(|(k, v)| (k.to_ascii_lowercase(), v.clone()))
        .collect()
}

pub fn encode_body(body: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(body)
}

pub fn decode_body(body_b64: &str) -> Option<Vec<u8>> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.decode(body_b64).ok()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum TerminalState {
    Done,
    Failed,
}

wire_names!(TerminalState { Done => "DONE", Failed => "FAILED" });

impl TerminalState {
    pub fn op_state(self) -> OpState {
        match self {
            TerminalState::Done => OpState::Done,
            TerminalState::Failed => OpState::Failed,
        }
    }
}

/// `POST /v1/complete`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompleteRequest {
    pub key: OpKey,
    pub owner: OwnerToken,
    pub state: TerminalState,
    pub result: StoredResult,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub trace_id: String,
}

/// A security event the filter saw (DESIGN §8): tampered bound fields, another subject's
/// fingerprint, a forged signature, an unknown key id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SecurityKind {
    ParamsChanged,
    CrossSubject,
    BadSignature,
    UnknownKid,
}

wire_names!(SecurityKind {
    ParamsChanged => "params_changed",
    CrossSubject => "cross_subject",
    BadSignature => "bad_signature",
    UnknownKid => "unknown_kid",
});

/// `POST /v1/security-events`: reported by the filter without waiting for the answer, so the
/// refusal is never delayed; idemd writes it to `idem_audit` (`idemd ops events` lists them).
/// Never the fingerprint, never the body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecurityEventReport {
    pub kind: SecurityKind,
    /// The route's scope.
    pub scope: String,
    /// The operation the fingerprint names, where its signature proved it (tampering, another
    /// subject's); `None` for a forgery or an unknown key, whose claims are the sender's words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<OpKey>,
    /// The caller's subject hash (who sent it).
    pub subject_hash: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub trace_id: String,
}

/// `POST /v1/release`: the request provably never reached the upstream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseRequest {
    pub key: OpKey,
    pub owner: OwnerToken,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub trace_id: String,
}

/// `POST /v1/renew`: leases whose request is still upstream, kept by the filter that forwarded
/// it (DESIGN §4: a lease cannot lapse under a live request). One call carries every lease a
/// filter instance holds, so the cost is per tick, not per request.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RenewRequest {
    pub leases: Vec<LeaseRenewal>,
}

/// One held lease: extend `key`'s IN_FLIGHT lease to `now + lease_ms` if `owner` still holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRenewal {
    pub key: OpKey,
    pub owner: OwnerToken,
    pub lease_ms: u64,
}

/// Answer to `POST /v1/renew`: the keys whose lease was not renewed because the owner no longer
/// holds them (completed, released, or claimed by the reconciler after the lease ran out).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RenewResponse {
    #[serde(default)]
    pub lost: Vec<OpKey>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Ack {
    Ok,
    /// The caller no longer owns the operation; its write was ignored.
    NotOwner,
    StoreUnavailable,
}

wire_names!(Ack { Ok => "OK", NotOwner => "NOT_OWNER", StoreUnavailable => "STORE_UNAVAILABLE" });

/// Answer to `POST /v1/complete` and `POST /v1/release`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AckResponse {
    pub outcome: Ack,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum OpState {
    InFlight,
    Done,
    Failed,
    NeedsReview,
}

wire_names!(OpState { InFlight => "IN_FLIGHT", Done => "DONE", Failed => "FAILED", NeedsReview => "NEEDS_REVIEW" });

/// `GET /v1/operations/{key}` (404 when the key was never acquired or was released).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperationView {
    pub key: String,
    pub state: OpState,
    pub scope: String,
    pub subject_hash: String,
    pub param_hash: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<OwnerToken>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<StoredResult>,
    /// Unix milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_until_ms: Option<i64>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_use_the_documented_spelling() -> Result<(), serde_json::Error> {
        let r = AcquireResponse { outcome: AcquireOutcome::ParamMismatch, owner: None, result: None };
        assert_eq!(serde_json::to_string(&r)?, r#"{"outcome":"PARAM_MISMATCH"}"#);
        let a: AckResponse = serde_json::from_str(r#"{"outcome":"NOT_OWNER"}"#)?;
        assert_eq!(a.outcome, Ack::NotOwner);
        Ok(())
    }

    /// The names `as_str`/`FromStr` give are exactly serde's: one spelling per token.
    #[test]
    fn wire_names_are_serdes_names() -> Result<(), Box<dyn std::error::Error>> {
        fn check<T>(all: &[T]) -> Result<(), Box<dyn std::error::Error>>
        where
            T: Copy + Serialize + FromStr + PartialEq + fmt::Debug + fmt::Display,
            <T as FromStr>::Err: fmt::Debug,
        {
            for v in all {
                let json = serde_json::to_string(v)?;
                assert_eq!(json, format!("\"{v}\""));
                assert_eq!(v.to_string().parse::<T>().ok(), Some(*v));
            }
            Ok(())
        }
        check(AcquireOutcome::ALL)?;
        check(TerminalState::ALL)?;
        check(Ack::ALL)?;
        check(OpState::ALL)?;
        check(ApprovalState::ALL)?;
        check(Decision::ALL)?;
        assert!("done".parse::<OpState>().is_err());
        Ok(())
    }

    #[test]
    fn only_safe_headers_are_kept() {
        let kept = replay_headers(&[
            ("Content-Type".into(), "application/json".into()),
            ("set-cookie".into(), "s=1".into()),
            ("content-length".into(), "10".into()),
            ("location".into(), "/v1/transfers/t_1".into()),
        ]);
        assert_eq!(
            kept,
            vec![
                ("content-type".to_string(), "application/json".to_string()),
                ("location".to_string(), "/v1/transfers/t_1".to_string())
            ]
        );
    }

    #[test]
    fn bodies_survive_base64() {
        let bytes = [0u8, 159, 146, 150, b'{', b'}'];
        assert_eq!(decode_body(&encode_body(&bytes)), Some(bytes.to_vec()));
        assert_eq!(decode_body("not base64!"), None);
    }

    #[test]
    fn stored_result_round_trips() -> Result<(), serde_json::Error> {
        let r = StoredResult {
            status: 201,
            headers: vec![("content-type".into(), "application/json".into())],
            body_b64: "e30".into(),
        };
        let text = serde_json::to_string(&r)?;
        assert_eq!(serde_json::from_str::<StoredResult>(&text)?, r);
        Ok(())
    }
}
