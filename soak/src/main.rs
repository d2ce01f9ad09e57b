//! `soak [--seconds N] [--seed N] [--agents N] [--world demo|hostile|mixed] [--failover sync|async]`: one
//! chaos soak run (see the library's docs); exit 1 on a violation. `make soak SECONDS=600 SEED=7` runs it long, in the mixed world.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use idem_e2e::flag_number;

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parsed = (|| -> Result<idem_soak::Config, String> {
        for a in args.iter().filter(|a| a.starts_with("--")) {
            if !["--seconds", "--seed", "--agents", "--world", "--failover"].contains(&a.as_str()) {
                return Err(format!(
                    "unknown option {a}; usage: soak [--seconds N] [--seed N] [--agents N] \
                     [--world demo|hostile|mixed] [--failover sync|async]"
                ));
            }
        }
        let seed = match flag_number(&args, "--seed")? {
            Some(s) => s,
            None => {
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(1)
            }
        };
        let seconds = flag_number(&args, "--seconds")?.unwrap_or(60).max(5);
        let agents = flag_number(&args, "--agents")?.unwrap_or(32).max(1) as usize;
        let world = match args.iter().position(|a| a == "--world") {
            Some(i) => idem_soak::World::parse(args.get(i + 1).map(String::as_str).unwrap_or(""))?,
            None => idem_soak::World::Demo,
        };
        let cfg = idem_soak::Config::new(seconds, seed, agents).in_world(world);
        match args.iter().position(|a| a == "--failover") {
            Some(i) => {
                if args.iter().any(|a| a == "--world") && world != idem_soak::World::Demo {
                    return Err("--failover runs in the demo world only".into());
                }
                Ok(cfg.failing_over(idem_soak::Failover::parse(args.get(i + 1).map(String::as_str).unwrap_or(""))?))
            }
            None => Ok(cfg),
        }
    })();
    let cfg = match parsed {
        Ok(c) => c,
        Err(e) => {
            eprintln!("soak: {e}");
            return ExitCode::from(2);
        }
    };
    match idem_soak::run(&cfg).await {
        Ok(None) => {
            eprintln!("soak: SKIPPED (a backend is missing; IDEM_REQUIRE_BACKENDS=1 makes this a failure)");
            ExitCode::SUCCESS
        }
        Ok(Some(out)) if out.violations.is_empty() => ExitCode::SUCCESS,
        Ok(Some(out)) => {
            eprintln!(
                "soak: seed {}: {} invariant violations (see {})",
                cfg.seed,
                out.violations.len(),
                out.summary_path.display()
            );
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("soak: seed {}: {e}", cfg.seed);
            ExitCode::FAILURE
        }
    }
}
