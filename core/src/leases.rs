//! The leases one filter instance keeps alive while their requests are upstream (DESIGN §4: a
//! lease cannot lapse under a live request).
//!
//! The reconciler takes an IN_FLIGHT row only once its lease ran out, and only then trusts a
//! status endpoint's 404 as "never executed". A confirm still upstream past its lease would be
//! judged while it runs, released, and its retry executed a second time. So the instance that
//! forwarded it renews the lease at a third of its length, until the answer is recorded or the
//! stream ends; only a dead filter (or a stream Envoy reset) stops renewing, and then the lease
//! rule of §5 (lease > the route's worst case) is what protects.
//!
//! Sans-IO like the machine: the host says when a stream holds or lets go of a lease and when
//! time passes ([`LeaseBook::due`] on every tick); the book answers with one `POST /v1/renew`
//! carrying every lease that is due, so the cost is one callout per tick, not per request.

use crate::machine::{Callout, CalloutAnswer};
use crate::protocol::{LeaseRenewal, OpKey, OwnerToken, RenewRequest, RenewResponse};
use std::collections::HashMap;

/// How often a host ticks the book: a quarter of the shortest lease a route may ask for
/// (`policy::LEASE_MS`), so even that lease is renewed twice before it could run out.
pub const TICK_MS: u64 = 250;

#[derive(Debug, Clone, PartialEq, Eq)]
struct Held {
    lease: LeaseRenewal,
    /// When the lease was acquired or last sent for renewal (host milliseconds).
    renewed_ms: u64,
}

/// The leases whose requests are still upstream, keyed by owner token (one per acquire).
#[derive(Debug, Default)]
pub struct LeaseBook {
    held: HashMap<OwnerToken, Held>,
}

impl LeaseBook {
    /// A stream forwarded its request under this lease (acquired at about `now_ms`).
    pub fn hold(&mut self, lease: LeaseRenewal, now_ms: u64) {
        self.held.insert(lease.owner.clone(), Held { lease, renewed_ms: now_ms });
    }

    /// The stream's answer is recorded, or the stream is gone: nothing to keep alive any more.
    pub fn end(&mut self, owner: &OwnerToken) {
        self.held.remove(owner);
    }

    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// The renewal to send now, if any lease is a third of its length past its last renewal.
    /// Every lease in it counts as renewed from `now_ms`: a renewal that fails is sent again a
    /// third of a lease later, still twice before the lease could run out.
    pub fn due(&mut self, now_ms: u64) -> Option<Callout> {
        self.renewal(now_ms).map(|r| r.call)
    }

    /// [`LeaseBook::due`], with the count a host puts on its `idem.lease_renewals` counter.
    pub fn renewal(&mut self, now_ms: u64) -> Option<Renewal> {
        let mut leases: Vec<LeaseRenewal> = Vec::new();
        for held in self.held.values_mut() {
            if now_ms.saturating_sub(held.renewed_ms) >= held.lease.lease_ms / 3 {
                held.renewed_ms = now_ms;
                leases.push(held.lease.clone());
            }
        }
        if leases.is_empty() {
            return None;
        }
        // One order for one set of leases: the call is the same whatever the map's order.
        leases.sort_by(|a, b| a.key.cmp(&b.key));
        let count = leases.len();
        Some(Renewal { call: Callout::post("/v1/renew", &RenewRequest { leases }), leases: count })
    }
}

/// A renewal, as the ticker sends it: the call and how many leases it carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Renewal {
    pub call: Callout,
    pub leases: usize,
}

/// What idemd said to a renewal: `Ok(lost)` with the keys whose owner no longer holds them (the
/// operation moved on: completed, released, or taken by the reconciler), `Err(())` when it
/// could not be asked (the next tick a third of a lease later sends the leases again).
#[allow(clippy::result_unit_err)]
pub fn renewal_answer(answer: &CalloutAnswer) -> Result<Vec<OpKey>, ()> {
    match answer.status {
        Some(200) => serde_json::from_slice::<RenewResponse>(&answer.body).map(|r| r.lost).map_err(|_| ()),
        _ => Err(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::OpKey;

    fn lease(n: u8, lease_ms: u64) -> LeaseRenewal {
        LeaseRenewal {
            key: OpKey::from_bytes([n; 16]),
            owner: OwnerToken::from_bytes([n.wrapping_add(100); 16]),
            lease_ms,
        }
    }

    fn renewed(call: Option<Callout>) -> Vec<LeaseRenewal> {
        call.and_then(|c| c.body)
            .and_then(|b| serde_json::from_slice::<RenewRequest>(&b).ok())
            .map(|r| r.leases)
            .unwrap_or_default()
    }

    #[test]
    fn a_renewal_counts_its_leases_and_its_answer_names_the_lost() {
        let mut book = LeaseBook::default();
        book.hold(lease(1, 3_000), 0);
        book.hold(lease(2, 3_000), 0);
        assert_eq!(book.renewal(1_000).map(|r| r.leases), Some(2));
        let lost = format!(r#"{{"lost":["{}"]}}"#, lease(2, 1).key);
        let ok = CalloutAnswer { status: Some(200), body: lost.into_bytes() };
        assert_eq!(renewal_answer(&ok), Ok(vec![lease(2, 1).key]));
        assert_eq!(renewal_answer(&CalloutAnswer::failed()), Err(()));
        assert_eq!(renewal_answer(&CalloutAnswer { status: Some(503), body: Vec::new() }), Err(()));
    }

    #[test]
    fn nothing_is_due_before_a_third_of_the_lease() {
        let mut book = LeaseBook::default();
        book.hold(lease(1, 3_000), 10_000);
        assert_eq!(book.due(10_999), None);
        assert_eq!(renewed(book.due(11_000)), vec![lease(1, 3_000)]);
    }

    #[test]
    fn a_renewed_lease_is_due_again_a_third_later() {
        let mut book = LeaseBook::default();
        book.hold(lease(1, 3_000), 0);
        assert_eq!(renewed(book.due(1_000)).len(), 1);
        assert_eq!(book.due(1_500), None);
        assert_eq!(renewed(book.due(2_000)).len(), 1);
    }

    #[test]
    fn one_call_carries_every_due_lease_and_no_other() {
        let mut book = LeaseBook::default();
        book.hold(lease(2, 3_000), 0);
        book.hold(lease(1, 3_000), 0);
        book.hold(lease(3, 60_000), 0);
        assert_eq!(renewed(book.due(1_000)), vec![lease(1, 3_000), lease(2, 3_000)]);
    }

    #[test]
    fn an_ended_lease_is_never_renewed() {
        let mut book = LeaseBook::default();
        book.hold(lease(1, 3_000), 0);
        book.end(&lease(1, 3_000).owner);
        assert!(book.is_empty());
        assert_eq!(book.due(100_000), None);
    }

    #[test]
    fn a_lease_is_renewed_more_than_twice_within_its_length_at_the_tick_rate() {
        // The design's promise, as arithmetic: ticking every TICK_MS, the shortest lease a route
        // may have is renewed at least twice before it could run out.
        let mut book = LeaseBook::default();
        let shortest = *crate::policy::LEASE_MS.start();
        book.hold(lease(1, shortest), 0);
        let renewals = (1..=shortest / TICK_MS).filter(|i| book.due(i * TICK_MS).is_some()).count();
        assert!(renewals >= 2, "{renewals} renewals within one lease");
    }
}
