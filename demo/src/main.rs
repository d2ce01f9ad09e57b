//! `demo`: the stand-in business service (transfers) behind Envoy in the
//! walkthrough and the end-to-end tests. See `api` for the endpoints,
//! `mcp` for the MCP server and `router` for how they are served together.

#![forbid(unsafe_code)]

mod api;
mod app;
mod mcp;
mod router;
mod server;
mod store;
mod transfer;

use clap::builder::BoolishValueParser;
use clap::{ArgAction, Parser};
use std::io::{IsTerminal, Write};
use tokio::net::TcpListener;
use tracing_subscriber::EnvFilter;

#[derive(Parser, Debug)]
#[command(name = "demo", version, about = "Demo transfers service (stand-in upstream)")]
struct Cli {
    /// Address to listen on (port 0 picks a free port; the line printed at
    /// start says which).
    #[arg(long, env = "DEMO_LISTEN", default_value = "127.0.0.1:8080")]
    listen: String,

    /// SQLite database: a `sqlite:` URL or a file path (created if missing).
    #[arg(long, env = "DEMO_DB", default_value = "sqlite://./data/demo.db")]
    db: String,

    /// Do not deduplicate on Idempotency-Key: every confirm executes.
    #[arg(long, env = "DEMO_NO_DEDUP", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    no_dedup: bool,

    /// A downstream without key support: Idempotency-Key is ignored entirely (not required, not
    /// stored, not deduplicated on), every confirm executes, and a transfer is found again only by
    /// the `client_ref` it was sent with (`GET /v1/transfers/by-ref/{ref}`).
    #[arg(long, env = "DEMO_NO_KEYS", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    no_keys: bool,

    /// Honour the x-demo-* fault injection headers.
    #[arg(long, env = "DEMO_FAULTS", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    faults: bool,

    /// Where the `x-demo-hold-after-commit` fault writes `<name>.committed` and waits for
    /// `<name>.release` (default: the system's temp dir).
    #[arg(long, env = "DEMO_FAULT_DIR")]
    fault_dir: Option<std::path::PathBuf>,

    /// Do not serve the MCP endpoints (`/mcp`, `/mcp/sse`, `/mcp/session`).
    #[arg(long, env = "DEMO_NO_MCP", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    no_mcp: bool,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = Cli::parse();

    let store = store::Store::open(&cli.db).await?;
    let router = router::router(
        store,
        app::Config {
            dedup: !cli.no_dedup,
            keys: !cli.no_keys,
            faults: cli.faults,
            fault_dir: cli.fault_dir.unwrap_or_else(std::env::temp_dir),
            mcp: !cli.no_mcp,
        },
    );
    let listener = TcpListener::bind(&cli.listen).await?;
    let addr = listener.local_addr()?;
    tracing::info!(
        %addr, db = %cli.db, dedup = !cli.no_dedup, keys = !cli.no_keys, faults = cli.faults, mcp = !cli.no_mcp,
        "started"
    );
    // Scripts and tests wait for this exact line.
    let mut stdout = std::io::stdout();
    writeln!(stdout, "demo listening on {addr}")?;
    stdout.flush()?;

    server::run(listener, router).await;
    Ok(())
}
