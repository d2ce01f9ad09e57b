//! `idemd serve`, `idemd ops`, `idemd tools` and `idemd check` — everything else is in the library, so
//! tests and the bench drive exactly the code the binary runs.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use idemd::config::{Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Ops(args) => idemd::ops::main(args),
        Command::Tools(args) => idemd::tools::main(args),
        Command::Check(args) => idemd::check::main(args),
        Command::Serve(args) => {
            // Refuse a bad TTL or background setting before touching any store.
            if let Err(broken) = args.validate() {
                for rule in broken {
                    eprintln!("idemd: refusing to start: {rule}");
                }
                return ExitCode::from(2);
            }
            let telemetry = match idemd::telemetry::Telemetry::init(args.otlp_endpoint.as_deref()) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("idemd: refusing to start: {e}");
                    return ExitCode::from(2);
                }
            };
            let runtime = match tokio::runtime::Runtime::new() {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("idemd: cannot start the runtime: {e}");
                    return ExitCode::from(1);
                }
            };
            let code = match runtime.block_on(idemd::serve::run(args)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(failure) => {
                    eprintln!("idemd: {failure}");
                    ExitCode::from(failure.exit_code())
                }
            };
            // The server has stopped: end the background tasks (their open spans end with them), then export
            // every span still queued before exiting.
            runtime.shutdown_timeout(std::time::Duration::from_millis(500));
            telemetry.shutdown();
            code
        }
    }
}
