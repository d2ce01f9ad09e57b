//! The domain record: one operation as idemd knows it (a row of `idem_record`). Its own module,
//! so what decides about a record (the reconciler, the ops printer, the cache) depends on the
//! record, not on the SQL store that reads it.

use idem_core::protocol::{OpState, StoredResult};

/// The most one stored result (or a status record read in its place) may be: replayed bodies
/// travel base64 inside JSON, and this bounds what one costs in Redis and SQL. The API's body
/// limit is the same bound.
pub const MAX_RESULT_BYTES: usize = 4 * 1024 * 1024;

/// One row of `idem_record`. `Hash` for the model checker, which keeps records in its states.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Record {
    pub key: String,
    pub state: OpState,
    pub param_hash: String,
    pub subject_hash: String,
    pub scope: String,
    pub owner: Option<String>,
    pub result: Option<StoredResult>,
    pub lease_until_ms: Option<i64>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    /// Failed status lookups so far (the reconciler's retry budget).
    pub reconcile_attempts: i64,
    /// The expiry of the fingerprint that created the row (unix ms); `None` for
    /// client keys. The row is kept until this plus the retention at least.
    pub fp_exp_ms: Option<i64>,
    /// The route's upstream ignores `Idempotency-Key` (`upstream_keys: ignored`): a by-key
    /// lookup proves nothing about this row (the reconciler, DESIGN §4).
    pub upstream_ignores_keys: bool,
    /// The confirm's business reference (the route's `business_ref` field), by which the
    /// reconciler can look the operation up instead of by key. One operation per scope holds it.
    pub business_ref: Option<String>,
    /// The bound fields' canonical JSON, kept with a business reference: a record the upstream
    /// answers under the reference is this operation's only if it carries these values
    /// (`reconcile::decide::proof`). `None` for rows acquired without it (an older filter).
    pub bound_fields: Option<String>,
}

/// One row of `idem_approval` (DESIGN §4, "Approval"): an operation a person must approve before
/// it runs. Nothing of it is in `idem_record` until it is APPROVED and a confirm acquires it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ApprovalRow {
    pub key: String,
    pub state: idem_core::protocol::ApprovalState,
    pub param_hash: String,
    pub subject_hash: String,
    pub scope: String,
    /// The bound fields' canonical JSON: what the approver sees.
    pub fields: String,
    /// The fingerprint's `exp` (unix ms): the approval lapses then.
    pub fp_exp_ms: i64,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    /// The approver's identity, once decided.
    pub decided_by: Option<String>,
    pub reason: Option<String>,
}

impl ApprovalRow {
    /// The row an approval acquire records: `req`'s operation, AWAITING_APPROVAL until `exp_ms`,
    /// showing `ask`'s bound fields (idemd's gate and the model's both record this one).
    pub fn awaiting(
        req: &idem_core::protocol::AcquireRequest,
        ask: &idem_core::protocol::ApprovalAsk,
        exp_ms: i64,
        now_ms: i64,
    ) -> ApprovalRow {
        ApprovalRow {
            key: req.key.to_string(),
            state: idem_core::protocol::ApprovalState::AwaitingApproval,
            param_hash: req.param_hash.clone(),
            subject_hash: req.subject_hash.clone(),
            scope: req.scope.clone(),
            fields: ask.fields.clone(),
            fp_exp_ms: exp_ms,
            created_at_ms: now_ms,
            updated_at_ms: now_ms,
            decided_by: None,
            reason: None,
        }
    }

    /// The row as the API answers it; `console` is where a person approves.
    pub fn view(&self, console: Option<&str>) -> Option<idem_core::protocol::ApprovalView> {
        let decided = !matches!(self.state, idem_core::protocol::ApprovalState::AwaitingApproval);
        Some(idem_core::protocol::ApprovalView {
            key: idem_core::protocol::OpKey::parse(&self.key).ok()?,
            state: self.state,
            scope: self.scope.clone(),
            subject_hash: self.subject_hash.clone(),
            fields: self.fields.clone(),
            created_at_ms: self.created_at_ms,
            expires_at_ms: self.fp_exp_ms,
            decided_at_ms: decided.then_some(self.updated_at_ms),
            decided_by: self.decided_by.clone(),
            reason: self.reason.clone(),
            console: console.map(str::to_string),
        })
    }
}
