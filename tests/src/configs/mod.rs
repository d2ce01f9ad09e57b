//! Generated configurations: Envoy configurations derived from the
//! committed ones by mutation ([`mutate`]), each judged by `idemd check`, and
//! each one it accepts run in a real Envoy with idemd and the demo and probed
//! for a way around the guard and a second execution ([`probe`]). Seeded and
//! reproducible: configuration `n` of seed `s` is the same configuration on
//! every run. `make test` runs a short series (tests/tests/generated_configs.rs),
//! `make soak` a long one (`config-soak`); both write target/soak/configs.md.

pub mod mutate;
pub mod probe;
pub mod rig;

use std::collections::BTreeMap;
use std::time::Instant;

use idem_testkit::envoy_config::Doc;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::{BoxError, DemoOpts, FilterHost};
use rig::Rig;

/// One run's size.
#[derive(Debug, Clone)]
pub struct Config {
    pub seed: u64,
    /// Mutated configurations to generate (the unmutated bases are probed besides).
    pub count: usize,
    /// Probes sent to each accepted configuration (a seeded sample of all it offers).
    pub probes: usize,
}

/// What one run found.
#[derive(Debug, Default)]
pub struct Summary {
    pub seed: u64,
    pub host: String,
    pub generated: usize,
    pub refused: usize,
    /// How many refused configurations each rule refused.
    pub by_rule: BTreeMap<String, usize>,
    pub accepted: usize,
    /// Accepted, but Envoy would not load them (a mutation Envoy itself refuses): not probed.
    pub unloadable: usize,
    pub probed: usize,
    pub probes: usize,
    pub confirms: usize,
    pub violations: Vec<String>,
    /// One line per configuration: its number, base, mutations and verdict.
    pub log: Vec<String>,
    pub seconds: u64,
}

/// The committed configurations mutations start from, on the filter host the tests run.
fn bases() -> Result<Vec<&'static str>, BoxError> {
    Ok(match FilterHost::current()? {
        // istio-like.yaml is the .wasm's only (tests/tests/istio.rs).
        FilterHost::Wasm => vec!["e2e.yaml", "envoy.yaml", "istio-like.yaml"],
        FilterHost::Native | FilterHost::ExtProc => vec!["e2e.yaml", "envoy.yaml"],
    })
}

/// A base as data; e2e.yaml without the route it holds misconfigured on purpose for one test
/// (`approval_confirm_unruled`: `idemd check` refuses it, and would refuse every mutation of it).
pub async fn base(rig: &mut Rig, name: &str) -> Result<Doc, BoxError> {
    let mut doc = rig.base(name).await?;
    if name == "e2e.yaml" {
        let r = doc.route_named("approval_confirm_unruled")?;
        let (routes, index) = r.rsplit_once('/').ok_or("a route pointer")?;
        doc.array_mut(routes)?.remove(index.parse()?);
    }
    Ok(doc)
}

/// Generate, check, run and probe; `progress` hears one line per configuration.
pub async fn run(cfg: &Config, progress: &mut dyn FnMut(&str)) -> Result<Summary, BoxError> {
    let started = Instant::now();
    let mut rig = Rig::start(DemoOpts { no_dedup: true, ..Default::default() }).await?;
    let bases = bases()?;
    let ctx = mutate::Ctx { demo_port: rig.ports.demo };
    let mut summary =
        Summary { seed: cfg.seed, host: format!("{:?}", FilterHost::current()?).to_lowercase(), ..Default::default() };
    progress(&format!(
        "generated configurations: seed {} ({} host), {} to generate",
        cfg.seed, summary.host, cfg.count
    ));
    for n in 0..bases.len() + cfg.count {
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ (n as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let (name, mutations) = match bases.get(n) {
            Some(b) => (*b, 0),
            None => (bases[rng.gen_range(0..bases.len())], rng.gen_range(1..=2)),
        };
        let mut doc = base(&mut rig, name).await?;
        let applied = mutate::mutate(&mut doc, &mut rng, &ctx, mutations)?;
        if mutations > 0 {
            summary.generated += 1;
        }
        let tag = format!("c{n}");
        let (logged, log) = rig.with_access_log(&doc, &tag)?;
        let path = rig.write(&tag, &logged)?;
        let verdict = rig.check(&path)?;
        let what = format!("#{n} {name}{}", applied.iter().map(|m| format!("; {m}")).collect::<String>());
        if !verdict.accepted {
            if mutations == 0 {
                return Err(format!("idemd check refuses the unmutated base {name}:\n{}", verdict.output).into());
            }
            summary.refused += 1;
            let mut rules = verdict.rules.clone();
            rules.sort();
            rules.dedup();
            for r in &rules {
                *summary.by_rule.entry(r.clone()).or_default() += 1;
            }
            let line = format!("{what} → refused ({})", rules.join(", "));
            progress(&line);
            summary.log.push(line);
            continue;
        }
        summary.accepted += 1;
        let envoy = match rig.envoy(&path).await {
            Ok(e) => e,
            Err(e) => {
                summary.unloadable += 1;
                let text = e.to_string();
                let first = text.lines().rfind(|l| l.contains("[critical]")).unwrap_or_default().to_string();
                let line =
                    format!("{what} → accepted, Envoy refuses it: {}", first.chars().take(200).collect::<String>());
                progress(&line);
                summary.log.push(line);
                continue;
            }
        };
        let mut found = probe::Found::default();
        let all = probe::probes(&rig, &logged).await?;
        probe::around_the_guard(&rig, &all, cfg.probes, &tag, &log, &mut rng, &mut found).await?;
        for (i, pair) in probe::pairs(&rig, &logged).await?.iter().take(3).enumerate() {
            probe::twice(&rig, pair, &format!("{tag}-twice-{i}"), &mut found).await?;
        }
        drop(envoy);
        summary.probed += 1;
        summary.probes += found.probes;
        summary.confirms += found.confirms;
        let line = format!(
            "{what} → accepted, probed: {} probes, {} confirms twice, {} violation(s)",
            found.probes,
            found.confirms,
            found.violations.len()
        );
        progress(&line);
        summary.log.push(line);
        for v in found.violations {
            summary.violations.push(format!("seed {} {what}: {v}", cfg.seed));
        }
    }
    summary.seconds = started.elapsed().as_secs();
    Ok(summary)
}

impl Summary {
    /// target/soak/configs.md.
    pub fn markdown(&self) -> String {
        let mut md = format!(
            "# Generated configurations\n\nSeed {} on the {} host, {} s.\n\n| | |\n|---|---|\n\
             | generated (mutated) | {} |\n| refused by `idemd check` | {} |\n| accepted (the unmutated bases too) | {} |\n\
             | accepted, but Envoy refuses to load | {} |\n| probed in Envoy (the unmutated bases too) | {} |\n\
             | probes around the guard | {} |\n| confirms sent twice with one fingerprint | {} |\n\
             | violations (a way around the guard, a second execution) | {} |\n\n",
            self.seed,
            self.host,
            self.seconds,
            self.generated,
            self.refused,
            self.accepted,
            self.unloadable,
            self.probed,
            self.probes,
            self.confirms,
            self.violations.len()
        );
        md.push_str("## Refusals by rule\n\n| rule | configurations |\n|---|---|\n");
        for (rule, n) in &self.by_rule {
            md.push_str(&format!("| `{rule}` | {n} |\n"));
        }
        md.push_str("\n## Violations\n\n");
        if self.violations.is_empty() {
            md.push_str("None: no accepted configuration let a probe around the guard or ran a confirm twice.\n");
        }
        for v in &self.violations {
            md.push_str(&format!("- {v}\n"));
        }
        md.push_str("\n## Every configuration\n\n");
        for l in &self.log {
            md.push_str(&format!("- {l}\n"));
        }
        md
    }

    /// Write the summary to target/soak/configs.md; its path.
    pub fn write(&self) -> Result<std::path::PathBuf, BoxError> {
        let dir = crate::target_dir().join("soak");
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("configs.md");
        std::fs::write(&path, self.markdown())?;
        Ok(path)
    }
}
