//! What the module does on Envoy's main thread, outside every stream:
//!
//! - renewing the leases of requests still upstream (DESIGN §4: a lease cannot lapse under a
//!   live request). Worker threads have no timers in this ABI, so one ticker thread per filter
//!   configuration wakes the main thread (the configuration's scheduler) whenever a lease is
//!   held, and the main thread sends one `POST /v1/renew` for every lease that is due;
//! - sending security-event reports. A callout a stream makes is cancelled when the stream
//!   ends, and a refused confirm ends at once; the main thread's callouts belong to the
//!   configuration, so a report outlives the stream it came from.
//!
//! Workers only lock the book or the outbox and commit an event; the callouts, and their
//! answers, happen on the main thread, where Envoy allows configuration callouts.

use crate::abi::{self, module_buffer, module_http_header, ConfigSchedulerPtr, FilterConfigEnvoyPtr};
use crate::log::log;
use idem_adapter::sidecar::Sidecar;
use idem_core::leases::{self, LeaseBook, TICK_MS};
use idem_core::machine::{Callout, CalloutAnswer};
use idem_core::trace::Trace;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Scheduler events.
const TICK: u64 = 1;
const OUTBOX: u64 = 2;

/// The configuration's scheduler. Envoy allows `commit` from any thread while it exists; it is
/// deleted on the main thread after the ticker has stopped.
struct Scheduler(ConfigSchedulerPtr);

// SAFETY: commit is thread-safe by the ABI's contract; the pointer is deleted once, after the
// only other thread using it has been joined (`MainThread::drop`).
unsafe impl Send for Scheduler {}
// SAFETY: as above.
unsafe impl Sync for Scheduler {}

impl Scheduler {
    fn commit(&self, event: u64) {
        // SAFETY: alive until `MainThread::drop`, which joins every committer first.
        unsafe { abi::envoy_dynamic_module_callback_http_filter_config_scheduler_commit(self.0, event) };
    }
}

/// What the workers, the ticker and the main thread share.
struct Inner {
    scheduler: Scheduler,
    leases: Mutex<LeaseBook>,
    /// Reports waiting for the main thread, with the trace context of the request each is about.
    outbox: Mutex<Vec<(Callout, Trace)>>,
    stop: Mutex<bool>,
    wake: Condvar,
}

/// A poisoned lock only means another thread panicked while holding it (caught at its hook);
/// the data is a book of leases or a list of reports, still consistent: go on with it.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub struct MainThread {
    /// Envoy's filter configuration: used only on the main thread (hooks and `drop`).
    envoy: FilterConfigEnvoyPtr,
    sidecar: Sidecar,
    inner: Arc<Inner>,
    ticker: Option<JoinHandle<()>>,
    /// Renewals out from the main thread, by callout id: their answers name the leases lost.
    renewals: Mutex<Vec<u64>>,
}

pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)).unwrap_or(0)
}

impl MainThread {
    /// On the main thread, in the configuration hook. `Err` refuses the configuration: without
    /// a ticker no lease would be renewed.
    pub fn start(envoy: FilterConfigEnvoyPtr, sidecar: Sidecar) -> Result<MainThread, String> {
        // SAFETY: the configuration hook's own pointer, on the main thread.
        let raw = unsafe { abi::envoy_dynamic_module_callback_http_filter_config_scheduler_new(envoy) };
        if raw.is_null() {
            return Err("Envoy gave the filter configuration no scheduler".into());
        }
        let inner = Arc::new(Inner {
            scheduler: Scheduler(raw),
            leases: Mutex::new(LeaseBook::default()),
            outbox: Mutex::new(Vec::new()),
            stop: Mutex::new(false),
            wake: Condvar::new(),
        });
        let shared = Arc::clone(&inner);
        let ticker =
            std::thread::Builder::new().name("idem-leases".into()).spawn(move || tick(&shared)).map_err(|e| {
                // SAFETY: made above, never committed to.
                unsafe { abi::envoy_dynamic_module_callback_http_filter_config_scheduler_delete(raw) };
                format!("cannot start the lease ticker: {e}")
            })?;
        Ok(MainThread { envoy, sidecar, inner, ticker: Some(ticker), renewals: Mutex::new(Vec::new()) })
    }

    // ---- from the workers

    pub fn hold_lease(&self, lease: idem_core::protocol::LeaseRenewal) {
        lock(&self.inner.leases).hold(lease, now_ms());
    }

    pub fn end_lease(&self, owner: &idem_core::protocol::OwnerToken) {
        lock(&self.inner.leases).end(owner);
    }

    /// Queue a report for the main thread.
    pub fn report(&self, call: Callout, trace: Trace) {
        lock(&self.inner.outbox).push((call, trace));
        self.inner.scheduler.commit(OUTBOX);
    }

    // ---- on the main thread

    /// A scheduled event: send the queued reports, or the renewal that is due.
    pub fn on_event(&self, event: u64) {
        match event {
            OUTBOX => {
                let queued = std::mem::take(&mut *lock(&self.inner.outbox));
                for (call, trace) in queued {
                    if self.send(&call, &trace).is_none() {
                        log(abi::LogLevel::WARN, "agent_idempotency: a security-event report could not be sent");
                    }
                }
            }
            TICK => {
                let renewal = lock(&self.inner.leases).renewal(now_ms());
                if let Some(renewal) = renewal {
                    match self.send(&renewal.call, &Trace::default()) {
                        Some(id) => lock(&self.renewals).push(id),
                        None => log(abi::LogLevel::WARN, "agent_idempotency: a lease renewal could not be sent"),
                    }
                }
            }
            _ => {}
        }
    }

    /// The answer to a callout of ours.
    pub fn on_answer(&self, id: u64, answer: &CalloutAnswer) {
        let renewal = {
            let mut out = lock(&self.renewals);
            let found = out.iter().position(|r| *r == id);
            found.map(|i| out.swap_remove(i)).is_some()
        };
        if !renewal {
            if answer.status.is_none() {
                log(abi::LogLevel::WARN, "agent_idempotency: a security-event report was not answered");
            }
            return;
        }
        match leases::renewal_answer(answer) {
            Ok(lost) => {
                for key in lost {
                    log(abi::LogLevel::WARN, &format!("agent_idempotency: lease of {key} not renewed: no longer ours"));
                }
            }
            // Sent again a third of a lease later, still twice before the lease could run out.
            Err(()) => log(abi::LogLevel::WARN, "agent_idempotency: a lease renewal failed"),
        }
    }

    fn send(&self, call: &Callout, trace: &Trace) -> Option<u64> {
        let body = call.body.as_deref().unwrap_or_default();
        let timeout_ms = u64::try_from(self.sidecar.timeout.as_millis()).unwrap_or(u64::MAX);
        self.sidecar.with_headers(call, trace, |headers| {
            let raw: Vec<module_http_header> =
                headers.iter().map(|(k, v)| module_http_header::new(k.as_bytes(), v.as_bytes())).collect();
            let mut id = 0u64;
            // SAFETY: the configuration's pointer, on the main thread; every buffer outlives the call.
            let result = unsafe {
                abi::envoy_dynamic_module_callback_http_filter_config_http_callout(
                    self.envoy,
                    &mut id,
                    module_buffer::new(self.sidecar.cluster.as_bytes()),
                    raw.as_ptr(),
                    raw.len(),
                    module_buffer::new(body),
                    timeout_ms,
                )
            };
            (result == abi::HttpCalloutInitResult::SUCCESS).then_some(id)
        })
    }
}

/// The ticker: wake the main thread every tick while any lease is held.
fn tick(inner: &Inner) {
    let mut stopped = lock(&inner.stop);
    while !*stopped {
        stopped = match inner.wake.wait_timeout(stopped, Duration::from_millis(TICK_MS)) {
            Ok((guard, _)) => guard,
            Err(poisoned) => poisoned.into_inner().0,
        };
        if !*stopped && !lock(&inner.leases).is_empty() {
            inner.scheduler.commit(TICK);
        }
    }
}

impl Drop for MainThread {
    /// On the main thread, when Envoy destroys the configuration: stop the ticker, then delete
    /// the scheduler nobody commits to any more.
    fn drop(&mut self) {
        *lock(&self.inner.stop) = true;
        self.inner.wake.notify_all();
        if let Some(t) = self.ticker.take() {
            let _ = t.join();
        }
        // SAFETY: the ticker is joined and no stream of this configuration is left (Envoy
        // destroys a configuration after its streams), so nothing commits to it any more.
        unsafe { abi::envoy_dynamic_module_callback_http_filter_config_scheduler_delete(self.inner.scheduler.0) };
    }
}
