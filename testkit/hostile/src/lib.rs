//! `idem-hostile`: a test upstream that is not the demo.
//!
//! It serves the demo's paths (`POST /v1/transfers/preview`, `/v1/transfers` for any method,
//! `GET /v1/transfers/by-key/{key}` and `/by-ref/{ref}`, `GET /v1/executions`, `/healthz`) over HTTP/1.1 and
//! h2c on one port, so a committed Envoy configuration can point its cluster at it. Each answer is drawn from
//! a seeded grammar ([`grammar`]): echoes of the request, self-named `fingerprint` fields in any spelling,
//! repeated and garbage headers the guard reads (`quote-expires-at` twice, in the past, unparseable), quotes
//! expiring before, at and after the fingerprint, a clock ahead or behind, 5xx or a cut connection after
//! committing, chunked, streamed and truncated bodies, long pauses. Business references are shared the way
//! the requests share them: a lookup by reference answers the first execution that used it.
//!
//! Its [`Ledger`] is the witness: every execution (per `Idempotency-Key`), every quote and the expiry it
//! stated, and how often each grammar branch was drawn; in process, and over HTTP (`GET /v1/executions` in the
//! demo's shape, `GET /v1/hostile/ledger` for everything).

#![forbid(unsafe_code)]

pub mod answer;
pub mod grammar;
pub mod ledger;
mod server;

pub use grammar::{Grammar, Plan, Role};
pub use ledger::{Execution, Ledger, Quote};
pub use server::{DRAW_HEADER, PLAN_HEADER};

use grammar::{ConfirmPlan, Delivery, LookupPlan, Outcome, PreviewPlan, PreviewStatus, QuoteHeader, Shape, Stated};
use std::net::SocketAddr;
use std::sync::Arc;

#[derive(Debug, Clone, Copy)]
pub struct Config {
    pub seed: u64,
    /// The fingerprint TTL the routes in front of it mint with: quotes expire `before` (half of it), `at` and
    /// `after` (ten times) relative to it.
    pub ttl_hint_s: u64,
}

impl Config {
    pub fn new(seed: u64) -> Config {
        Config { seed, ttl_hint_s: 60 }
    }
}

/// The demo's own answer for a role (`x-hostile-plan: honest`): a quote valid well past the fingerprint, an
/// execution answered 201, an honest lookup.
pub fn honest(role: Role) -> Plan {
    match role {
        Role::Preview => Plan::Preview(PreviewPlan {
            status: PreviewStatus::Quote,
            shape: Shape::Plain,
            expires_at: Stated::After,
            quote_header: QuoteHeader::Once(Stated::After),
            skew_s: 0,
            delivery: Delivery::Whole,
            garbage: Vec::new(),
        }),
        Role::Confirm => Plan::Confirm(ConfirmPlan {
            outcome: Outcome::Execute(201),
            shape: Shape::Plain,
            delivery: Delivery::Whole,
            garbage: Vec::new(),
        }),
        Role::Lookup => Plan::Lookup(LookupPlan::Honest),
    }
}

/// A running hostile upstream; dropped, it stops (every connection with it).
pub struct Hostile {
    pub addr: SocketAddr,
    pub ledger: Arc<Ledger>,
    pub config: Config,
    task: tokio::task::JoinHandle<()>,
}

impl Hostile {
    /// Listens on `addr` (`127.0.0.1:0` for a free port) and serves from this tokio runtime.
    pub async fn start(addr: &str, config: Config) -> std::io::Result<Hostile> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let ledger = Arc::new(Ledger::new());
        let state = Arc::new(server::State::new(config, ledger.clone()));
        let task = tokio::spawn(server::serve(listener, state));
        Ok(Hostile { addr, ledger, config, task })
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn grammar(&self) -> Grammar {
        Grammar::new(self.config.seed)
    }
}

impl Drop for Hostile {
    fn drop(&mut self) {
        self.task.abort();
    }
}
