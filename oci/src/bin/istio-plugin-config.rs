//! `istio-plugin-config <file.yaml> [WasmPlugin|TrafficExtension]`: the JSON string
//! istiod hands the filter for that resource's `pluginConfig` (what the filter
//! logs as `invalid plugin configuration` when it refuses it).

#![forbid(unsafe_code)]

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (path, kind) = match args.as_slice() {
        [path] => (path, "WasmPlugin"),
        [path, kind] => (path, kind.as_str()),
        _ => {
            eprintln!("usage: istio-plugin-config <file.yaml> [WasmPlugin|TrafficExtension]");
            return ExitCode::from(2);
        }
    };
    match std::fs::read_to_string(path)
        .map_err(idem_oci::Error::from)
        .and_then(|t| idem_oci::istio::plugin_config_json(&t, kind))
    {
        Ok(json) => {
            println!("{json}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("istio-plugin-config: {path}: {e}");
            ExitCode::FAILURE
        }
    }
}
