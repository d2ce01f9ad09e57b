//! Envoy stats for the filter (they appear in /stats as `wasmcustom.idem.*`);
//! the counters and their names are `idem_core::machine::Counter`.

use idem_core::machine::Counter;

/// Metric ids, defined once per VM.
#[derive(Debug, Default)]
pub struct Metrics {
    ids: Vec<(Counter, u32)>,
}

impl Metrics {
    #[cfg(target_arch = "wasm32")]
    pub fn define() -> Metrics {
        let ids =
            Counter::ALL.iter().filter_map(|c| crate::abi::define_counter(c.name()).ok().map(|id| (*c, id))).collect();
        Metrics { ids }
    }

    #[cfg(target_arch = "wasm32")]
    pub fn inc(&self, counter: Counter) {
        self.add(counter, 1);
    }

    #[cfg(target_arch = "wasm32")]
    pub fn add(&self, counter: Counter, n: usize) {
        if let Some((_, id)) = self.ids.iter().find(|(c, _)| *c == counter) {
            let _ = crate::abi::increment_metric(*id, i64::try_from(n).unwrap_or(i64::MAX));
        }
    }
}
