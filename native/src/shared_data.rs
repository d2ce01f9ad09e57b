//! The process-wide key/value store behind `Env::shared_get` / `Host::shared_set`:
//! what proxy-wasm's shared data is to the `.wasm`. Envoy's workers are threads
//! of one process, so a mutex-guarded map is shared by all of them; its key
//! space is bounded by its only user, the replay cache (a fixed number of slots).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

fn store() -> &'static Mutex<HashMap<String, Vec<u8>>> {
    static STORE: OnceLock<Mutex<HashMap<String, Vec<u8>>>> = OnceLock::new();
    STORE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// A poisoned lock (a panic while holding it) reads as a miss: the cache is an optimisation.
pub fn get(key: &str) -> Option<Vec<u8>> {
    store().lock().ok()?.get(key).cloned()
}

pub fn set(key: &str, value: &[u8]) {
    if let Ok(mut map) = store().lock() {
        map.insert(key.to_owned(), value.to_vec());
    }
}
