//! What a status endpoint told about one operation: the evidence the reconciler decides on and a
//! person's release is checked against. Its own module, so the store's flows (which carry the
//! reconciler's lookup as one of their calls) and the reconciler both depend on it, not on each other.

/// What a lookup is keyed by, for the evidence in the audit line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum By {
    Key,
    Ref,
}

/// What the reconciler could learn about one row.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Asked {
    /// The row's scope has no status endpoint.
    NoEndpoint,
    /// The endpoint could give no evidence about this row (`target` says why).
    Unaskable(String),
    /// Looked up by key or by business reference; what the endpoint said.
    Answered(By, StatusAnswer),
}

/// What the status endpoint said about one key or business reference.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum StatusAnswer {
    /// 200: the upstream has a record of this key.
    Found { content_type: Option<String>, body: Vec<u8> },
    /// 404: the upstream has no record of this key.
    NotFound,
    /// Anything else (another status, a timeout, a refused connection, a
    /// body too large): no evidence either way.
    Failed(String),
}

impl StatusAnswer {
    /// The `result` label of `idem_reconcile_lookups_total` (one of `metrics::LOOKUP_RESULTS`).
    pub fn metric(&self) -> &'static str {
        match self {
            Self::Found { .. } => "found",
            Self::NotFound => "not_found",
            Self::Failed(_) => "failed",
        }
    }
}
