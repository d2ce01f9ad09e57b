//! The reconciler: "did it happen?" gets an answer for every operation whose
//! executor went silent (crash, kill -9, a timeout that left the outcome
//! unknown).
//!
//! Each pass takes a batch of IN_FLIGHT rows whose lease has run out, claims
//! each one (a compare-and-set, so several replicas never decide the same
//! row), asks the scope's status endpoint (by key, or by business reference
//! where the upstream ignores keys: `target`), and writes the decision
//! (`decide`) owner-checked, with its audit line, then brings Redis in line.
//! A claim is a short lease of its own, so a reconciler that dies mid-row
//! only delays that row.

pub mod decide;
pub mod lookup;
pub mod settle;
pub mod target;

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tracing::{debug, info, warn, Instrument};

use self::decide::{Decision, Rules};
use self::lookup::StatusClient;
use self::settle::{RowOutcome, SettleSettings};
use crate::store::flow::{Call, Flow, Next, Reply};
use crate::store::record::Record;
use crate::store::sql::SqlError;
use crate::store::{now_ms, Store};

/// Rows looked up at the same time within one pass.
const CONCURRENCY: usize = 8;

/// The scopes' status endpoints and how their answers read: what decides whether an operation ran,
/// for the reconciler and for a person's release (`review`, which asks at that moment).
#[derive(Clone)]
pub struct Lookups {
    pub status: StatusClient,
    pub rules: Rules,
}

#[derive(Clone, Debug)]
pub struct ReconcileSettings {
    pub rules: Rules,
    /// Rows per pass.
    pub batch: u32,
    /// How long one claim holds a row: a lookup plus the SQL around it.
    pub claim_ms: u64,
    /// This process in the audit trail: `reconciler:<instance>`.
    pub instance: String,
}

/// What one pass did, by decision.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PassReport {
    pub done: usize,
    pub failed: usize,
    pub released: usize,
    pub needs_review: usize,
    pub retry: usize,
    pub skipped_grace: usize,
    /// Rows another reconciler (or a late complete) took first.
    pub taken_elsewhere: usize,
    /// Rows whose claim or decision hit a SQL error (tried again next pass).
    pub errors: usize,
}

impl PassReport {
    pub fn seen(&self) -> usize {
        self.done
            + self.failed
            + self.released
            + self.needs_review
            + self.retry
            + self.skipped_grace
            + self.taken_elsewhere
            + self.errors
    }

    /// Rows that left IN_FLIGHT in this pass.
    pub fn decided(&self) -> usize {
        self.done + self.failed + self.released + self.needs_review
    }

    fn count(&mut self, outcome: RowOutcome) {
        match outcome {
            RowOutcome::Decided(Decision::Done(_), _) => self.done += 1,
            RowOutcome::Decided(Decision::Failed(_), _) => self.failed += 1,
            RowOutcome::Decided(Decision::Release, _) => self.released += 1,
            RowOutcome::Decided(Decision::NeedsReview, _) => self.needs_review += 1,
            RowOutcome::Decided(Decision::Retry, _) => self.retry += 1,
            RowOutcome::Decided(Decision::SkipGrace, _) => self.skipped_grace += 1,
            RowOutcome::TakenElsewhere => self.taken_elsewhere += 1,
            RowOutcome::Error => self.errors += 1,
        }
    }
}

pub struct Reconciler {
    store: Arc<Store>,
    status: StatusClient,
    settings: ReconcileSettings,
    actor: String,
}

impl Reconciler {
    pub fn new(store: Arc<Store>, status: StatusClient, settings: ReconcileSettings) -> Self {
        for scope in status.scopes() {
            store.metrics().lookup_scope(scope);
        }
        let actor = format!("reconciler:{}", settings.instance);
        Self { store, status, settings, actor }
    }

    /// Reconcile every `interval` (with jitter, so replicas started together
    /// do not all wake at once) until the task is dropped.
    pub async fn run(self: Arc<Self>, interval: Duration) {
        tokio::time::sleep(jitter(interval, 0.0, 1.0)).await;
        loop {
            match self.pass().await {
                Ok(report) => {
                    if report.seen() > 0 {
                        info!(?report, "reconciler pass");
                    }
                    // A full batch that decided rows may mean a backlog: go on at once.
                    if report.decided() >= self.settings.batch as usize {
                        continue;
                    }
                }
                Err(e) => warn!(error = %e, "reconciler pass failed; trying again next interval"),
            }
            tokio::time::sleep(jitter(interval, 0.9, 1.1)).await;
        }
    }

    /// One pass over a batch of expired IN_FLIGHT rows, then the backlog gauge.
    pub async fn pass(self: &Arc<Self>) -> Result<PassReport, SqlError> {
        let stale = self.store.sql().stale_in_flight(now_ms(), self.settings.batch).await?;
        let mut report = PassReport::default();
        let mut rows = stale.into_iter();
        let mut running = JoinSet::new();
        loop {
            while running.len() < CONCURRENCY {
                let Some(rec) = rows.next() else { break };
                let me = Arc::clone(self);
                // One trace per row (DESIGN §8): the status lookup and the store calls are its children.
                let span = tracing::debug_span!(
                    "reconcile",
                    otel.name = "idemd reconcile",
                    key = %rec.key,
                    scope = %rec.scope,
                    decision = tracing::field::Empty,
                );
                running.spawn(async move { me.settle(rec).await }.instrument(span));
            }
            match running.join_next().await {
                Some(Ok(outcome)) => report.count(outcome),
                Some(Err(e)) => {
                    warn!(error = %e, "reconciler task failed");
                    report.errors += 1;
                }
                None => break,
            }
        }
        match self.store.sql().count_in_state("NEEDS_REVIEW").await {
            Ok(n) => self.store.metrics().set_needs_review(n),
            Err(e) => debug!(error = %e, "NEEDS_REVIEW count failed"),
        }
        Ok(report)
    }

    /// Claim one row, ask, decide, write: the flow of `settle`, its lookup carried out here,
    /// every store call by the store.
    async fn settle(&self, rec: Record) -> RowOutcome {
        let settings = SettleSettings {
            rules: self.settings.rules.clone(),
            claim_ms: self.settings.claim_ms,
            actor: self.actor.clone(),
            store: self.store.flow_settings(),
        };
        let (key, scope) = (rec.key.clone(), rec.scope.clone());
        let mut flow = Flow::new(|io| settle::settle(io, rec, settings));
        let mut reply = None;
        let outcome = loop {
            let next = flow.next(reply.take());
            for note in flow.notes() {
                self.store.noted(note);
            }
            match next {
                Next::Done(outcome) => break outcome,
                Next::Call(Call::Lookup { rec }) => reply = Some(Reply::Asked(self.status.ask(&rec).await)),
                Next::Call(call) => reply = Some(self.store.carry_out(call).await),
            }
        };
        if let RowOutcome::Decided(decision, why) = &outcome {
            tracing::Span::current().record("decision", decision.metric());
            self.store.metrics().reconciled(decision.metric());
            if matches!(decision, Decision::SkipGrace | Decision::Retry) {
                debug!(key = %key, scope = %scope, decision = decision.metric(), %why, "reconciler");
            } else {
                info!(key = %key, scope = %scope, decision = decision.metric(), %why, "reconciler decided");
            }
        }
        outcome
    }
}

/// `base` scaled by a random factor in [lo, hi).
pub(crate) fn jitter(base: Duration, lo: f64, hi: f64) -> Duration {
    let mut b = [0u8; 4];
    let unit = match getrandom::fill(&mut b) {
        Ok(()) => f64::from(u32::from_le_bytes(b)) / (f64::from(u32::MAX) + 1.0),
        Err(_) => 0.5,
    };
    base.mul_f64(lo + (hi - lo) * unit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_in_its_range() {
        let base = Duration::from_millis(1000);
        for _ in 0..100 {
            let d = jitter(base, 0.9, 1.1);
            assert!(d >= Duration::from_millis(900) && d < Duration::from_millis(1100), "{d:?}");
        }
        assert!(jitter(base, 0.0, 1.0) < base);
    }
}
