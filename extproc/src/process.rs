//! What every ext_proc stream of one idemd shares, across its worker threads: idemd's own API
//! (called in-process), the runtime those calls run on, the counters, the replay cache's shared
//! data and the book of leases to renew.

use idem_core::leases::{self, LeaseBook, TICK_MS};
use idem_core::machine::{CalloutAnswer, Counter};
use idem_core::protocol::{LeaseRenewal, OwnerToken};
use idem_core::trace::Trace;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::task::JoinHandle;
use tower::ServiceExt as _;

/// The largest answer idemd gives the filter that is read back (a recorded result is bounded by
/// the plugin's `max_response_bytes`, far below this).
const MAX_ANSWER_BYTES: usize = 16 << 20;

/// The filter's counters (Envoy's `idem.*` stats on the two filter hosts), by `Counter::ALL` index.
#[derive(Debug)]
pub struct Counters {
    values: Vec<AtomicU64>,
}

impl Default for Counters {
    fn default() -> Counters {
        Counters { values: Counter::ALL.iter().map(|_| AtomicU64::new(0)).collect() }
    }
}

impl Counters {
    pub fn add(&self, counter: Counter, n: u64) {
        if let Some(i) = Counter::ALL.iter().position(|c| *c == counter) {
            if let Some(v) = self.values.get(i) {
                v.fetch_add(n, Ordering::Relaxed);
            }
        }
    }

    /// Every counter and its value.
    pub fn values(&self) -> impl Iterator<Item = (Counter, u64)> + '_ {
        Counter::ALL.iter().copied().zip(self.values.iter().map(|v| v.load(Ordering::Relaxed)))
    }

    /// `name: value` lines, as Envoy's `/stats` shows the filters' counters (the same names).
    pub fn text(&self) -> String {
        Counter::ALL
            .iter()
            .zip(&self.values)
            .map(|(c, v)| format!("{}: {}\n", c.name(), v.load(Ordering::Relaxed)))
            .collect()
    }
}

/// A poisoned lock only means a thread panicked holding it; a map of bytes or a book of leases
/// is still consistent: go on with it.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)).unwrap_or(0)
}

pub struct Process {
    api: axum::Router,
    runtime: tokio::runtime::Handle,
    pub counters: Arc<Counters>,
    /// The replay cache's slots (bounded by the plugin configuration, DESIGN §9).
    shared: Mutex<HashMap<String, Vec<u8>>>,
    leases: Mutex<LeaseBook>,
    /// The plugin configuration JSON, parsed once per worker thread.
    pub config: Vec<u8>,
}

impl Process {
    pub fn new(
        api: axum::Router,
        runtime: tokio::runtime::Handle,
        counters: Arc<Counters>,
        config: Vec<u8>,
    ) -> Process {
        Process {
            api,
            runtime,
            counters,
            shared: Mutex::new(HashMap::new()),
            leases: Mutex::new(LeaseBook::default()),
            config,
        }
    }

    pub fn shared_get(&self, key: &str) -> Option<Vec<u8>> {
        lock(&self.shared).get(key).cloned()
    }

    pub fn shared_set(&self, key: &str, value: &[u8]) {
        lock(&self.shared).insert(key.to_owned(), value.to_vec());
    }

    pub fn hold_lease(&self, lease: LeaseRenewal) {
        lock(&self.leases).hold(lease, now_ms());
    }

    pub fn end_lease(&self, owner: &OwnerToken) {
        lock(&self.leases).end(owner);
    }

    /// One call to idemd's API, as the filters' callouts make it (`sidecar::dispatch` headers:
    /// `:method`, `:path`, the bearer token, the trace context), through the same router and its
    /// middleware, on idemd's runtime. `None` if the headers do not make a request.
    pub fn call(
        &self,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> Option<JoinHandle<CalloutAnswer>> {
        let mut req = http::Request::builder();
        for (name, value) in headers {
            req = match *name {
                ":method" => req.method(*value),
                ":path" => req.uri(*value),
                ":authority" => req.header(http::header::HOST, *value),
                other => req.header(other, *value),
            };
        }
        let req = req.body(axum::body::Body::from(body.map(<[u8]>::to_vec).unwrap_or_default())).ok()?;
        let api = self.api.clone();
        Some(self.runtime.spawn(async move {
            let call = async {
                let Ok(answer) = api.oneshot(req).await;
                let status = answer.status().as_u16();
                let body = axum::body::to_bytes(answer.into_body(), MAX_ANSWER_BYTES).await.ok()?;
                Some(CalloutAnswer { status: Some(status), body: body.to_vec() })
            };
            tokio::time::timeout(timeout, call).await.ok().flatten().unwrap_or_else(CalloutAnswer::failed)
        }))
    }

    /// Renew the leases of requests still upstream, every tick, for as long as the runtime runs
    /// (DESIGN §4: a lease cannot lapse under a live request).
    pub async fn renew_leases(self: Arc<Process>, sidecar: idem_adapter::sidecar::Sidecar) {
        let mut tick = tokio::time::interval(Duration::from_millis(TICK_MS));
        loop {
            tick.tick().await;
            let Some(renewal) = lock(&self.leases).renewal(now_ms()) else { continue };
            self.counters.add(Counter::LeaseRenewals, renewal.leases as u64);
            let call = sidecar.with_headers(&renewal.call, &Trace::default(), |h| {
                self.call(h, renewal.call.body.as_deref(), sidecar.timeout)
            });
            let Some(call) = call else { continue };
            let answer = call.await.unwrap_or_else(|_| CalloutAnswer::failed());
            match leases::renewal_answer(&answer) {
                Ok(lost) if lost.is_empty() => {}
                Ok(lost) => {
                    self.counters.add(Counter::LeasesLost, lost.len() as u64);
                    tracing::warn!(target: "ext_proc", lost = lost.len(), "lease renewal: operations no longer owned");
                }
                Err(()) => tracing::warn!(target: "ext_proc", "a lease renewal failed"),
            }
        }
    }
}
