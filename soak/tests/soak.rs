//! The short soak `make test` runs: a fixed seed, about a minute of wall time.
//! `make soak SECONDS=600 SEED=n` runs the same thing long.

use idem_e2e::{validate_envoy_config, TestResult};

/// The seed of the run `make test` does (any seed must pass; this one is printed in docs/soak.md's figures).
const SEED: u64 = 20_261_130;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seeded_minute_of_chaos_breaks_no_invariant() -> TestResult {
    let cfg = idem_soak::Config::new(45, SEED, 32);
    let Some(out) = idem_soak::run(&cfg).await? else { return Ok(()) };
    assert!(
        out.violations.is_empty(),
        "seed {SEED}: {} invariant violations (logs in {:?}):\n{}",
        out.violations.len(),
        out.kept_dir,
        out.summary
    );
    assert!(out.chart_path.exists() && out.summary_path.exists());
    Ok(())
}

#[test]
fn the_soak_envoy_config_validates() -> TestResult {
    let (ok, out) = validate_envoy_config(idem_soak::stack::ENVOY_CONFIG)?;
    assert!(ok, "envoy --mode validate soak.yaml failed:\n{out}");
    Ok(())
}

#[test]
fn the_same_seed_draws_the_same_fault_schedule() {
    let a = idem_soak::faults::schedule(7, 600_000);
    let b = idem_soak::faults::schedule(7, 600_000);
    let c = idem_soak::faults::schedule(8, 600_000);
    let show = |s: &[idem_soak::faults::Scheduled]| format!("{s:?}");
    assert_eq!(show(&a), show(&b));
    assert_ne!(show(&a), show(&c));
    // Every kind of fault is in every schedule long enough to hold them.
    let kinds: std::collections::BTreeSet<&str> = a.iter().take(8).map(|s| s.fault.kind()).collect();
    assert_eq!(kinds.len(), idem_soak::faults::Fault::KINDS.len());
}
