//! The short run of the generated configurations `make test` does: a fixed seed, a few dozen Envoy
//! configurations derived from the committed ones by mutation; `idemd check` refuses some, and every one it
//! accepts runs in a real Envoy with idemd and the demo and is probed for a way around the guard and a second
//! execution. `make soak` runs the same thing long (`config-soak`, `CONFIGS=`). Writes target/soak/configs.md.

use idem_e2e::configs::{run, Config};
use idem_e2e::TestResult;

/// The seed `make test` runs (any seed must pass; docs/soak.md shows this one's figures).
const SEED: u64 = 20_261_203;

#[tokio::test]
async fn no_configuration_idemd_check_accepts_lets_a_probe_around_the_guard() -> TestResult {
    let cfg = Config { seed: SEED, count: 40, probes: 300 };
    let summary = run(&cfg, &mut |line| eprintln!("{line}")).await?;
    let path = summary.write()?;
    assert!(
        summary.violations.is_empty(),
        "seed {SEED}: {} violation(s) (summary in {}):\n{}",
        summary.violations.len(),
        path.display(),
        summary.violations.join("\n")
    );
    // The run means something only if it both refused and probed: the mutations open ways, and some are harmless.
    assert!(summary.refused >= 5 && summary.probed >= 8, "{}", summary.markdown());
    assert!(summary.probes > 0 && summary.confirms > 0, "{}", summary.markdown());
    assert_eq!(summary.generated, cfg.count);
    Ok(())
}

/// The same seed draws the same configurations: a violation's seed and number reproduce it.
#[test]
fn the_same_seed_generates_the_same_configurations() -> TestResult {
    use idem_e2e::configs::mutate::{mutate, Ctx};
    use idem_testkit::envoy_config::Doc;
    use rand::SeedableRng;
    let text = std::fs::read_to_string(idem_e2e::repo_root().join("envoy/envoy.yaml"))?;
    let draw = |seed: u64| -> Result<(Doc, Vec<String>), idem_e2e::BoxError> {
        let mut doc = Doc::parse(&text)?;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let done = mutate(&mut doc, &mut rng, &Ctx { demo_port: 8080 }, 3)?;
        Ok((doc, done))
    };
    assert_eq!(draw(7)?, draw(7)?);
    assert_ne!(draw(7)?.1, draw(8)?.1);
    Ok(())
}
