//! The domain record: one operation as idemd knows it (a row of `idem_record`). Its own module,
//! so what decides about a record (the reconciler, the ops printer, the cache) depends on the
//! record, not on the SQL store that reads it.

use idem_core::protocol::{OpState, StoredResult};

/// The most one stored result (or a status record read in its place) may be: replayed bodies
/// travel base64 inside JSON, and this bounds what one costs in Redis and SQL. The API's body
/// limit is the same bound.
pub const MAX_RESULT_BYTES: usize = 4 * 1024 * 1024;

/// One row of `idem_record`.
#[derive(Clone, Debug, PartialEq, Eq)]
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
    /// reconciler can look the operation up instead of by key.
    pub business_ref: Option<String>,
}
