//! Per-VM cache of route policies, keyed by route name.
//!
//! Unannotated routes must cost almost nothing (DESIGN §9): after the first
//! request on a named route, "not mine" is one property read and a map lookup.
//! Entries expire so a route updated over xDS under the same name is re-read.

use crate::host;
use idem_core::policy::{self, LeafValue, RouteDefaults, RoutePolicy, ROUTE_NAMESPACE};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

const REFRESH_S: u64 = 30;
/// Route names are operator-controlled but unbounded in principle; cap the cache.
const MAX_ENTRIES: usize = 4096;

/// What a route asks of the filter.
pub type Lookup = Result<Option<Rc<RoutePolicy>>, String>;

#[derive(Default)]
pub struct RouteCache {
    entries: RefCell<HashMap<String, (u64, Lookup)>>,
}

impl RouteCache {
    pub fn lookup(&self, defaults: &RouteDefaults, now_s: u64) -> Lookup {
        let name = host::property_string(&["xds", "route_name"]).unwrap_or_default();
        if name.is_empty() {
            return read_policy(defaults);
        }
        if let Some((at, hit)) = self.entries.borrow().get(&name) {
            if now_s.saturating_sub(*at) < REFRESH_S {
                return hit.clone();
            }
        }
        let fresh = read_policy(defaults);
        let mut entries = self.entries.borrow_mut();
        if entries.len() >= MAX_ENTRIES {
            entries.clear();
        }
        entries.insert(name, (now_s, fresh.clone()));
        fresh
    }
}

fn read_policy(defaults: &RouteDefaults) -> Lookup {
    let get = |key: &str| read_leaf(key);
    match policy::parse_route_policy(&get, defaults) {
        Ok(p) => Ok(p.map(Rc::new)),
        Err(e) => {
            log::error!("bad route annotation: {e}");
            Err(e.to_string())
        }
    }
}

/// Envoy returns a string leaf as raw UTF-8 and a number leaf as 8 bytes of a
/// little-endian double; the key tells which one we expect.
fn read_leaf(key: &str) -> Option<LeafValue> {
    let raw = host::property(&["xds", "route_metadata", "filter_metadata", ROUTE_NAMESPACE, key])?;
    let numeric = key.ends_with("_s") || key.ends_with("_ms");
    if numeric && raw.len() == 8 && !raw.iter().all(u8::is_ascii_digit) {
        if let Ok(bytes) = <[u8; 8]>::try_from(raw.as_slice()) {
            return Some(LeafValue::Num(f64::from_le_bytes(bytes)));
        }
    }
    // Anything else goes to the policy parser as text, which rejects "15m" loudly.
    String::from_utf8(raw).ok().map(LeafValue::Str)
}
