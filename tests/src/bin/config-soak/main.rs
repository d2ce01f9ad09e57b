//! `config-soak [--count N] [--seed N] [--probes N]`: the long run of the generated configurations:
//! N Envoy configurations derived from the committed ones by mutation, each checked by `idemd check`, each one it
//! accepts run in a real Envoy with idemd and the demo and probed. Writes target/soak/configs.md; exit 1 when an
//! accepted configuration let a probe around the guard or ran a confirm twice. `make soak CONFIGS=500` runs it.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use idem_e2e::configs::{run, Config};
use idem_e2e::flag_number;

fn config() -> Result<Config, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    for a in args.iter().filter(|a| a.starts_with("--")) {
        if !["--count", "--seed", "--probes"].contains(&a.as_str()) {
            return Err(format!("unknown option {a}; usage: config-soak [--count N] [--seed N] [--probes N]"));
        }
    }
    let seed = match flag_number(&args, "--seed")? {
        Some(s) => s,
        None => std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(1),
    };
    let count = flag_number(&args, "--count")?.unwrap_or(200) as usize;
    let probes = flag_number(&args, "--probes")?.unwrap_or(400) as usize;
    Ok(Config { seed, count, probes })
}

#[tokio::main]
async fn main() -> ExitCode {
    let cfg = match config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("config-soak: {e}");
            return ExitCode::from(2);
        }
    };
    let summary = match run(&cfg, &mut |line| eprintln!("{line}")).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("config-soak: seed {}: {e}", cfg.seed);
            return ExitCode::FAILURE;
        }
    };
    let path = match summary.write() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("config-soak: cannot write the summary: {e}");
            return ExitCode::FAILURE;
        }
    };
    eprintln!(
        "config-soak: seed {}: {} generated, {} refused, {} probed ({} probes, {} confirms twice), {} violation(s); {}",
        cfg.seed,
        summary.generated,
        summary.refused,
        summary.probed,
        summary.probes,
        summary.confirms,
        summary.violations.len(),
        path.display()
    );
    if summary.violations.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
