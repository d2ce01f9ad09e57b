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
        use proxy_wasm::{hostcalls, types::MetricType};
        let ids = Counter::ALL
            .iter()
            .filter_map(|c| hostcalls::define_metric(MetricType::Counter, c.name()).ok().map(|id| (*c, id)))
            .collect();
        Metrics { ids }
    }

    #[cfg(target_arch = "wasm32")]
    pub fn inc(&self, counter: Counter) {
        self.add(counter, 1);
    }

    #[cfg(target_arch = "wasm32")]
    pub fn add(&self, counter: Counter, n: usize) {
        if let Some((_, id)) = self.ids.iter().find(|(c, _)| *c == counter) {
            let _ = proxy_wasm::hostcalls::increment_metric(*id, i64::try_from(n).unwrap_or(i64::MAX));
        }
    }
}
