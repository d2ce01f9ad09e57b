//! What waits in SQL, for the gauges the store probe keeps (`crate::probe`): the
//! IN_FLIGHT rows and how long ago the earliest of their leases ran out (the
//! reconciler's lag: it decides a row soon after its lease ends), and the
//! NEEDS_REVIEW rows a person has to decide. Each question is answered from the
//! (state, lease_until) index, not by reading rows.

use super::sql::{render, Bind, SqlError, SqlStore};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backlog {
    pub in_flight: i64,
    /// How long ago the earliest IN_FLIGHT lease ended; 0 when none has.
    pub overdue_ms: i64,
    pub needs_review: i64,
}

impl SqlStore {
    pub async fn backlog(&self, now_ms: i64) -> Result<Backlog, SqlError> {
        let in_flight = self.count_in_state("IN_FLIGHT").await?;
        // No IN_FLIGHT row: MIN is NULL, and `now` says "nothing overdue".
        let earliest =
            render(self.backend(), "SELECT COALESCE(MIN(lease_until), ?) FROM idem_record WHERE state = 'IN_FLIGHT'");
        let earliest_lease_end = self.scalar(&earliest, &[Bind::Int(now_ms)]).await?;
        let needs_review = self.count_in_state("NEEDS_REVIEW").await?;
        Ok(Backlog { in_flight, overdue_ms: now_ms.saturating_sub(earliest_lease_end).max(0), needs_review })
    }
}
