//! The deep run (`make model`): the design as built, both upstream kinds, with larger bounds
//! than `make test`'s (`IDEM_MODEL_FAULTS`, `IDEM_MODEL_CONFIRMS`, `IDEM_MODEL_POLLS`,
//! `IDEM_MODEL_HORIZON`), printing the figures docs/model.md quotes. `IDEM_MODEL_APPROVAL=1`: the
//! confirm route asks a person first; `IDEM_MODEL_ROUTES=ruled|any`: which routes of its scope a
//! confirm may take (`config::Routes`); `IDEM_MODEL_RECONCILERS=2`: two idemd replicas reconcile;
//! `IDEM_MODEL_STATUS_LAG`: seconds the upstream's status endpoint answers 404 for a record it wrote.

#![forbid(unsafe_code)]

use idem_model::config::{Config, Routes, UpstreamKeys};
use idem_model::report::check_telling;

fn env(name: &str, default: u8) -> u8 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() -> std::process::ExitCode {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut failed = false;
    for upstream in [UpstreamKeys::Honoured, UpstreamKeys::Ignored] {
        let cfg = Config {
            faults: env("IDEM_MODEL_FAULTS", 1),
            confirms: env("IDEM_MODEL_CONFIRMS", 1),
            polls: env("IDEM_MODEL_POLLS", 1),
            horizon_s: env("IDEM_MODEL_HORIZON", 8),
            approval: env("IDEM_MODEL_APPROVAL", 0) == 1,
            reconcilers: env("IDEM_MODEL_RECONCILERS", 1).max(1),
            status_lag_s: env("IDEM_MODEL_STATUS_LAG", idem_model::config::world::STATUS_LAG_S),
            routes: match std::env::var("IDEM_MODEL_ROUTES").as_deref() {
                Ok("ruled") => Routes::Ruled,
                Ok("any") => Routes::Any,
                _ => Routes::RuledFirst,
            },
            ..Config::bounded(upstream)
        };
        println!("== upstream keys {upstream:?}: {cfg:?}");
        match check_telling(cfg, threads, Some(std::time::Duration::from_secs(10))) {
            Ok(outcome) => {
                failed |= !outcome.violations.is_empty() || !outcome.unreached.is_empty();
                println!("{outcome}");
            }
            Err(e) => {
                eprintln!("model: {e}");
                failed = true;
            }
        }
    }
    if failed {
        std::process::ExitCode::FAILURE
    } else {
        std::process::ExitCode::SUCCESS
    }
}
