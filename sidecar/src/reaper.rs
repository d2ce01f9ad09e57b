//! The retention reaper: DONE and FAILED rows older than the terminal
//! retention are deleted in bounded batches, and with them the audit lines of
//! operations that have no row any more. A row a fingerprint created is kept
//! until its fingerprint's `exp` (plus the clock skew) is older than the
//! retention too (`store::retention`): no retry with a live fingerprint finds
//! it gone. Redis forgets a terminal copy after the retention; a retry that
//! misses there is answered by the SQL row (the insert's conflict), which is
//! copied back for as long as the row is kept.
//!
//! Several replicas may reap at once: a row deleted twice is deleted once.

use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn};

use crate::store::sql::SqlError;
use crate::store::{now_ms, Store};

/// Batches per pass at most, so one pass over a huge backlog still ends and
/// the next interval carries on.
const MAX_BATCHES: u32 = 100;

pub struct Reaper {
    store: Arc<Store>,
    retention_ms: u64,
    batch: u32,
}

/// Rows and audit lines one pass deleted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reaped {
    pub rows: u64,
    pub audit_lines: u64,
}

impl Reaper {
    pub fn new(store: Arc<Store>, retention_ms: u64, batch: u32) -> Self {
        Self { store, retention_ms, batch }
    }

    pub async fn run(self, interval: Duration) {
        tokio::time::sleep(crate::reconcile::jitter(interval, 0.0, 1.0)).await;
        loop {
            match self.pass().await {
                Ok(r) if r != Reaped::default() => info!(rows = r.rows, audit_lines = r.audit_lines, "reaped"),
                Ok(_) => {}
                Err(e) => warn!(error = %e, "reaper pass failed; trying again next interval"),
            }
            tokio::time::sleep(crate::reconcile::jitter(interval, 0.9, 1.1)).await;
        }
    }

    pub async fn pass(&self) -> Result<Reaped, SqlError> {
        let before = now_ms().saturating_sub(i64::try_from(self.retention_ms).unwrap_or(i64::MAX));
        let sql = self.store.sql();
        let mut reaped = Reaped::default();
        // Decided approvals go once their fingerprint's exp plus the retention has passed
        // (`rules::approval_reapable`): a rejection replays until then. They go first: a record
        // stays while its approval row says APPROVED (`rules::reapable`), so the lapse sweep never
        // sees an approval that ran without the record that shows it ran.
        let approvals_before = before.saturating_sub(crate::store::retention::CLOCK_SKEW_MS);
        reaped.rows += sql.reap_approvals(approvals_before).await?;
        for _ in 0..MAX_BATCHES {
            let n = sql.reap_terminal(before, self.batch).await?;
            reaped.rows += n;
            self.store.metrics().reaped(n);
            if n < u64::from(self.batch) {
                break;
            }
        }
        for _ in 0..MAX_BATCHES {
            let n = sql.prune_audit(before, self.batch).await?;
            reaped.audit_lines += n;
            if n < u64::from(self.batch) {
                break;
            }
        }
        Ok(reaped)
    }
}
