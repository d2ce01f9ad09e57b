//! `hostile [--listen ADDR] [--seed N] [--ttl-hint-s N]`: the hostile upstream as a process (point an Envoy
//! cluster at it); prints `hostile listening on ADDR` once it accepts connections.

use std::io::Write;

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    for a in args.iter().filter(|a| a.starts_with("--")) {
        if !["--listen", "--seed", "--ttl-hint-s"].contains(&a.as_str()) {
            return Err(
                format!("unknown option {a}; usage: hostile [--listen ADDR] [--seed N] [--ttl-hint-s N]").into()
            );
        }
    }
    let listen = flag(&args, "--listen").unwrap_or_else(|| "127.0.0.1:8181".into());
    let mut config = idem_hostile::Config::new(flag(&args, "--seed").map(|s| s.parse()).transpose()?.unwrap_or(1));
    if let Some(t) = flag(&args, "--ttl-hint-s") {
        config.ttl_hint_s = t.parse()?;
    }
    let h = idem_hostile::Hostile::start(&listen, config).await?;
    let mut out = std::io::stdout();
    writeln!(out, "hostile listening on {} (seed {})", h.addr, config.seed)?;
    out.flush()?;
    std::future::pending::<()>().await;
    Ok(())
}
