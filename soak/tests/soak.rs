//! The short soak `make test` runs: a fixed seed, about a minute of wall time.
//! `make soak SECONDS=600 SEED=n` runs the same thing long.

use idem_e2e::{validate_envoy_config, TestResult};

/// The seed of the run `make test` does (any seed must pass; this one is printed in docs/soak.md's figures).
const SEED: u64 = 20_261_130;

/// A seeded minute of chaos in the mixed world (`make soak`'s): the demo's routes and the hostile upstream's
/// grammar on its own, every invariant of the demo world unchanged plus the hostile world's (docs/soak.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seeded_minute_in_the_mixed_world_breaks_no_invariant() -> TestResult {
    let cfg = idem_soak::Config::new(45, SEED, 32).in_world(idem_soak::World::Mixed);
    let Some(out) = idem_soak::run(&cfg).await? else { return Ok(()) };
    assert!(
        out.violations.is_empty(),
        "seed {SEED}, mixed world: {} invariant violations (logs in {:?}):\n{}",
        out.violations.len(),
        out.kept_dir,
        out.summary
    );
    assert!(out.chart_path.exists() && out.summary_path.exists());
    Ok(())
}

/// The truth never goes back in time (DESIGN §4): the stores are replicated, and the schedule opens with a
/// Postgres and a Redis failover in the worst window (the replica cut off, something executed since, then the
/// primary SIGKILLed and the lagging replica promoted). Synchronous standby: the demo executes every request that
/// reaches it, so a second forward would show as a second execution.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seconds_of_failovers_on_a_sync_standby_break_no_invariant() -> TestResult {
    failover_run(idem_soak::Failover::Sync).await
}

/// The same on an asynchronous standby: idemd reads the standby's position and waits for it after each of its
/// writes (`idemd_waits`), so nothing it answers is lost by the failover, with the demo again executing every
/// request that reaches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seconds_of_failovers_on_an_async_standby_break_no_invariant() -> TestResult {
    failover_run(idem_soak::Failover::Async).await
}

async fn failover_run(failover: idem_soak::Failover) -> TestResult {
    let mut cfg = idem_soak::Config::new(FAILOVER_SECONDS, SEED, 16).failing_over(failover);
    cfg.out_dir = cfg.out_dir.join(format!("failover-{}", failover.name()));
    let Some(out) = idem_soak::run(&cfg).await? else { return Ok(()) };
    assert!(
        out.violations.is_empty(),
        "seed {SEED}, {} standby failing over: {} invariant violations (logs in {:?}):\n{}",
        failover.name(),
        out.violations.len(),
        out.kept_dir,
        out.summary
    );
    for kind in idem_soak::faults::Fault::FAILOVER_KINDS {
        assert!(out.summary.contains(&format!("| {kind} ({} standby) | 1 |", failover.name())), "{}", out.summary);
    }
    // The worst window was the worst: cut off, the standby confirms nothing, so on either topology no confirm
    // that reached idemd could execute before the primary died (without idemd's wait, an async window executes).
    let md = std::fs::read_to_string(&out.summary_path)?;
    assert!(md.contains("pg_failover (replica cut off, no execution in the window, promoted"), "{md}");
    Ok(())
}

/// Seconds of chaos in each failover run `make test` does: both failovers and a few other faults.
const FAILOVER_SECONDS: u64 = 12;

#[test]
fn a_failover_schedule_opens_with_both_failovers() {
    use idem_soak::faults::{schedule, schedule_with_failovers, Fault};
    let s = schedule_with_failovers(SEED, 10_000);
    let first: std::collections::BTreeSet<&str> = s.iter().take(2).map(|x| x.fault.kind()).collect();
    assert_eq!(first, Fault::FAILOVER_KINDS.into_iter().collect());
    // The single-node soak's schedule never fails over (it has no replica to promote).
    let plain = schedule(SEED, 600_000);
    assert!(plain.iter().all(|x| !Fault::FAILOVER_KINDS.contains(&x.fault.kind())));
}

#[test]
fn the_soak_envoy_config_validates() -> TestResult {
    let (ok, out) = validate_envoy_config(idem_soak::stack::ENVOY_CONFIG)?;
    assert!(ok, "envoy --mode validate soak.yaml failed:\n{out}");
    let (ok, out) = validate_envoy_config(idem_soak::stack::HOSTILE_ENVOY_CONFIG)?;
    assert!(ok, "envoy --mode validate soak-hostile.yaml failed:\n{out}");
    Ok(())
}

/// soak-hostile.yaml is soak.yaml plus the hostile routes, clusters and an access log: the demo's part of the
/// hostile and mixed worlds is the demo world's, so a change to one file that is not made in the other fails here.
#[test]
fn the_hostile_config_is_the_soak_config_plus_the_hostile_upstream() -> TestResult {
    use serde_norway::Value;
    let read = |name: &str| -> Result<Value, Box<dyn std::error::Error>> {
        let text = std::fs::read_to_string(idem_e2e::repo_root().join("envoy").join(name))?;
        Ok(serde_norway::from_str(&text)?)
    };
    let (demo, hostile) = (read(idem_soak::stack::ENVOY_CONFIG)?, read(idem_soak::stack::HOSTILE_ENVOY_CONFIG)?);
    let hcm =
        |v: &Value| v["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"].clone();
    let named = |list: &Value, hostile: bool| -> Vec<Value> {
        list.as_sequence()
            .map(|l| {
                l.iter()
                    .filter(|r| r["name"].as_str().is_some_and(|n| n.starts_with("hostile")) == hostile)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    };
    let routes = |v: &Value| hcm(v)["route_config"]["virtual_hosts"][0]["routes"].clone();
    assert_eq!(named(&routes(&demo), false), named(&routes(&hostile), false), "the demo's routes");
    assert!(named(&routes(&hostile), true).len() >= 7, "the hostile routes");
    let clusters = |v: &Value| v["static_resources"]["clusters"].clone();
    assert_eq!(named(&clusters(&demo), false), named(&clusters(&hostile), false), "the demo's clusters");
    assert_eq!(hcm(&demo)["http_filters"], hcm(&hostile)["http_filters"], "the filter and its configuration");
    assert!(hcm(&hostile)["access_log"].as_sequence().is_some_and(|l| l.len() == 1));
    let text =
        std::fs::read_to_string(idem_e2e::repo_root().join("envoy").join(idem_soak::stack::HOSTILE_ENVOY_CONFIG))?;
    for placeholder in [idem_soak::stack::HOSTILE_PLACEHOLDER, idem_soak::stack::ACCESS_LOG_PLACEHOLDER] {
        assert!(text.contains(placeholder), "{placeholder}");
    }
    Ok(())
}

#[test]
fn the_world_flag() {
    use idem_soak::World;
    assert_eq!(World::parse("mixed"), Ok(World::Mixed));
    assert!(World::parse("hostiles").is_err());
    // The approval workload (agent 7) stays on the demo in every world; mixed splits the others.
    assert!(!World::Hostile.hostile_agent(7) && World::Hostile.hostile_agent(2));
    assert!(World::Mixed.hostile_agent(1) && !World::Mixed.hostile_agent(2));
    assert!(!(0..32).any(|a| World::Demo.hostile_agent(a)));
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

/// What the hostile world's agents hold against the gateway's header: every top-level field an agent or a
/// case-insensitive decoder reads as the fingerprint, escapes decoded.
#[test]
fn every_spelling_of_a_fingerprint_field_is_seen() -> TestResult {
    let body: serde_json::Value = serde_json::from_str(
        r#"{"\u0066ingerprint":"a","Fingerprint":"b","FINGERPRINT":"c","card":{"fingerprint":"d"}}"#,
    )?;
    let mut seen: Vec<String> =
        idem_soak::agents::named_fingerprints(&body).into_iter().map(|(k, v)| format!("{k}={v}")).collect();
    seen.sort();
    assert_eq!(seen, [r#"FINGERPRINT="c""#, r#"Fingerprint="b""#, r#"fingerprint="a""#]);
    assert!(idem_soak::agents::named_fingerprints(&serde_json::json!([{"fingerprint": "x"}])).is_empty());
    Ok(())
}
