//! The store probe: every `--probe-interval-ms`, whether or not traffic flows,
//! ask both stores and read the backlog, so what an alert reads is current on a
//! quiet replica too. Without it `idem_sql_up` is only as fresh as the last
//! call, and a reconciler that is stuck (or runs nowhere: every replica with
//! `--no-reconcile`) cannot report its own lag. Runs on every replica; the
//! backlog is the same database's, so the rules take the `max` over replicas.
//! It also reads what the database promises across a failover
//! (`store::sql::replication`): a topology that changes under a running idemd (a
//! synchronous standby dropped, a failover to a node with no standby, a Service
//! now pointing at a standby) changes what the next acquires accept within one
//! interval.

use std::sync::Arc;
use std::time::Duration;

use tracing::debug;

use crate::store::backlog::Backlog;

/// Approvals lapsed per probe, at most: a backlog drains over a few probes.
const LAPSE_BATCH: i64 = 100;
use crate::store::{now_ms, Health, Store};

pub struct Probe {
    store: Arc<Store>,
}

impl Probe {
    pub fn new(store: Arc<Store>) -> Self {
        Self { store }
    }

    /// One round: each store's health (which sets `idem_sql_up` and
    /// `idem_redis_up`), then, if SQL answered, the backlog gauges. While SQL
    /// is down they keep their last values: nothing newer is known.
    pub async fn once(&self) -> (Health, Option<Backlog>) {
        let health = self.store.health().await;
        if health.sql != "up" {
            return (health, None);
        }
        self.store.refresh_replication().await;
        match self.store.sql().backlog(now_ms()).await {
            Ok(b) => {
                let metrics = self.store.metrics();
                metrics.set_in_flight(b.in_flight, b.overdue_ms / 1000);
                metrics.set_needs_review(b.needs_review);
                // Approvals nobody gave before exp lapse here, on every replica (a lapse is one
                // compare-and-set: two replicas lapse a row once), reconciling or not.
                if let Err(e) = self.store.lapse_due(LAPSE_BATCH).await {
                    debug!(error = %e, "approval lapse sweep failed");
                }
                match self.store.sql().count_awaiting(now_ms()).await {
                    Ok(n) => metrics.set_approvals_awaiting(n),
                    Err(e) => debug!(error = %e, "awaiting approvals count failed"),
                }
                (health, Some(b))
            }
            Err(e) => {
                debug!(error = %e, "backlog query failed");
                (health, None)
            }
        }
    }

    /// Probe every `interval` until the task is dropped.
    pub async fn run(self, interval: Duration) {
        loop {
            self.once().await;
            tokio::time::sleep(interval).await;
        }
    }
}
