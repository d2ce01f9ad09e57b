//! The module's two configurations, both checked when Envoy loads them (a bad
//! one is refused there, never discovered on a request):
//!
//! - the filter configuration: the same plugin configuration JSON as the
//!   `.wasm`'s (`filter_config`), parsed by `idem_core::policy`;
//! - the per-route configuration (`DynamicModuleFilterPerRoute`): a route's
//!   annotation as a JSON object of the same fields as route metadata
//!   (`{"role": "confirm", "scope": …}`), turned into the same bytes the
//!   adapter's route cache is keyed by.
//!
//! Envoy creates configurations on its main thread and runs streams on worker
//! threads; the parsed configuration holds `Rc`s, so each worker parses its
//! own copy once, on its first stream (a thread-local keyed by configuration).

use crate::abi;
use crate::main_thread::MainThread;
use idem_adapter::sidecar::Sidecar;
use idem_adapter::{Refusal, RouteLookup, Shared};
use idem_core::machine::Counter;
use idem_core::policy::{self, RouteDefaults, SubjectSource};
use serde_json::Value;
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};

/// One filter configuration, shared by every worker.
pub struct FilterConfig {
    /// The plugin configuration JSON, parsed again (identically) by each worker.
    raw: Vec<u8>,
    /// Distinguishes this configuration from any other in the per-worker map.
    id: u64,
    /// Envoy's ids of the counters, defined once in the config hook (the only place the ABI allows it).
    counters: Vec<(Counter, usize)>,
    /// Lease renewals and reports, sent from Envoy's main thread.
    pub main: MainThread,
    /// The words of the refusal a stream gets when its worker has no usable filter.
    pub refusal: Refusal,
}

// Made on the main thread, read by every worker.
const _: fn() = || {
    fn shared_across_threads<T: Send + Sync>() {}
    shared_across_threads::<Refusal>();
};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Configurations a worker keeps parsed; an xDS update adds one, so the map is cleared past this bound.
const MAX_PER_WORKER: usize = 64;

thread_local! {
    static PER_WORKER: RefCell<HashMap<u64, Rc<Shared>>> = RefCell::new(HashMap::new());
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// Fault injection for the tests (`tests/tests/native.rs`): set in Envoy's environment, a worker
/// rebuilds its configuration with every other variable unset, as if the environment had changed
/// since Envoy loaded it; a configuration with a `secret_env` then fails there for real, and every
/// stream of that worker has no usable filter.
pub const FAULT_WORKER_ENV: &str = "IDEM_FAULT_WORKER_ENV_GONE";

impl FilterConfig {
    /// Parse and check the plugin configuration; `define` registers one counter and returns its id.
    /// On the main thread, in the configuration hook (`envoy` is its pointer).
    pub fn new(
        config: &[u8],
        define: &mut dyn FnMut(&str) -> Option<usize>,
        envoy: abi::FilterConfigEnvoyPtr,
    ) -> Result<FilterConfig, String> {
        let raw = config.to_vec();
        let parsed = policy::parse_plugin_config(&raw, &env).map_err(|e| e.to_string())?;
        if let SubjectSource::Property(path) = &parsed.subject {
            if !matches!(path.as_slice(), [m, f, _, _] if m == "metadata" && f == "filter_metadata") {
                return Err(format!(
                    "subject.property {path:?}: the native module reads dynamic metadata one level deep \
                     ([\"metadata\", \"filter_metadata\", namespace, key]; Envoy 1.40's ABI has no getter inside a \
                     struct); for jwt_authn, copy the claim with claim_to_headers and use subject.header"
                ));
            }
        }
        let counters = Counter::ALL.iter().filter_map(|c| define(c.name()).map(|id| (*c, id))).collect();
        let main = MainThread::start(envoy, Sidecar::of(&parsed))?;
        let refusal = Refusal::of(&parsed);
        Ok(FilterConfig { raw, id: NEXT_ID.fetch_add(1, Ordering::Relaxed), counters, main, refusal })
    }

    pub fn counter(&self, counter: Counter) -> Option<usize> {
        self.counters.iter().find(|(c, _)| *c == counter).map(|(_, id)| *id)
    }

    /// This worker's parsed copy (parsed on its first stream).
    pub fn shared(&self) -> Option<Rc<Shared>> {
        PER_WORKER.with(|map| {
            let mut map = map.try_borrow_mut().ok()?;
            if let Some(shared) = map.get(&self.id) {
                return Some(Rc::clone(shared));
            }
            // Checked when Envoy loaded it; only an environment changed since then can fail here.
            let gone = |name: &str| if env(FAULT_WORKER_ENV).is_some() { None } else { env(name) };
            let parsed = match policy::parse_plugin_config(&self.raw, &gone) {
                Ok(p) => p,
                Err(e) => {
                    crate::log::log(abi::LogLevel::ERROR, &format!("agent_idempotency: plugin configuration: {e}"));
                    return None;
                }
            };
            if map.len() >= MAX_PER_WORKER {
                map.clear();
            }
            let shared = Rc::new(Shared::new(parsed));
            map.insert(self.id, Rc::clone(&shared));
            Some(shared)
        })
    }
}

/// A per-route configuration: the route's annotation, as the adapter's cache keys it.
pub struct RouteConfig {
    pub annotation: Vec<u8>,
}

/// A JSON annotation (`{"role": "confirm", "scope": "payments", "lease_ms": 2000}`) as
/// `policy::encode_pairs` bytes, the encoding route metadata reaches the `.wasm` in:
/// strings as their bytes, numbers as 8 little-endian bytes of a double. The
/// annotation is checked with the default TTLs (the plugin configuration's own
/// defaults apply on the worker); anything the route cache would call broken is refused.
pub fn annotation_pairs(json: &[u8]) -> Result<Vec<u8>, String> {
    let value: Value = serde_json::from_slice(json).map_err(|e| format!("per-route config: not JSON: {e}"))?;
    let Value::Object(fields) = value else {
        return Err("per-route config: expected a JSON object of annotation fields".into());
    };
    let mut leaves: Vec<(String, Vec<u8>)> = Vec::with_capacity(fields.len());
    for (key, value) in fields {
        let bytes = match value {
            Value::String(s) => s.into_bytes(),
            Value::Number(n) => {
                let f: f64 = n.to_string().parse().map_err(|_| format!("per-route config: {key}: not a number"))?;
                f.to_le_bytes().to_vec()
            }
            other => return Err(format!("per-route config: {key}: expected a string or a number, got {other}")),
        };
        leaves.push((key, bytes));
    }
    let pairs: Vec<(&str, &[u8])> = leaves.iter().map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    let encoded = policy::encode_pairs(&pairs);
    match RouteLookup::from_annotation(&encoded, &RouteDefaults::default()) {
        RouteLookup::Broken(why) => Err(format!("per-route config: {why}")),
        RouteLookup::NotMine => Err("per-route config: no `role`: nothing to guard".into()),
        RouteLookup::Guarded(_) => Ok(encoded),
        // Only a request's spelling is ever not canonical, never an annotation.
        RouteLookup::NotCanonical(_) | RouteLookup::MethodNotGuarded(_) => {
            Err("per-route config: not an annotation".into())
        }
    }
}
