//! `hostile [--listen ADDR] [--seed N] [--ttl-hint-s N]`: the hostile upstream as a process (point an Envoy
//! cluster at it); prints `hostile listening on ADDR` once it accepts connections.
//! `hostile --seed N --explain ROLE:DRAW` (ROLE preview, confirm or lookup) prints that draw's plan and exits: how
//! a soak violation that names its hostile draw is read.

#![forbid(unsafe_code)]

use std::io::Write;

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    for a in args.iter().filter(|a| a.starts_with("--")) {
        if !["--listen", "--seed", "--ttl-hint-s", "--explain"].contains(&a.as_str()) {
            let usage = "hostile [--listen ADDR] [--seed N] [--ttl-hint-s N] [--explain ROLE:DRAW]";
            return Err(format!("unknown option {a}; usage: {usage}").into());
        }
    }
    let listen = flag(&args, "--listen").unwrap_or_else(|| "127.0.0.1:8181".into());
    let mut config = idem_hostile::Config::new(flag(&args, "--seed").map(|s| s.parse()).transpose()?.unwrap_or(1));
    if let Some(t) = flag(&args, "--ttl-hint-s") {
        config.ttl_hint_s = t.parse()?;
    }
    if let Some(e) = flag(&args, "--explain") {
        let (role, draw) = e.split_once(':').ok_or("--explain ROLE:DRAW")?;
        let role = match role {
            "preview" => idem_hostile::Role::Preview,
            "confirm" => idem_hostile::Role::Confirm,
            "lookup" => idem_hostile::Role::Lookup,
            other => return Err(format!("--explain: {other} is not preview, confirm or lookup").into()),
        };
        let plan = idem_hostile::Grammar::new(config.seed).draw(role, draw.parse()?);
        println!("{plan:#?}\n{}", plan.branches().join("\n"));
        return Ok(());
    }
    let h = idem_hostile::Hostile::start(&listen, config).await?;
    let mut out = std::io::stdout();
    writeln!(out, "hostile listening on {} (seed {})", h.addr, config.seed)?;
    out.flush()?;
    std::future::pending::<()>().await;
    Ok(())
}
