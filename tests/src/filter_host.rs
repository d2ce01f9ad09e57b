//! Which host of the filter a stack runs: the proxy-wasm `.wasm` (default), the
//! native Envoy dynamic module (`IDEM_E2E_HOST=native`), or the ext_proc host
//! inside idemd behind Envoy's own `ext_proc` filter (`IDEM_E2E_HOST=extproc`).
//! The committed configs load the `.wasm`; for the other two the harness
//! rewrites each wasm filter into the dynamic-module filter, or into an
//! `ext_proc` filter (and idemd gets the plugin configuration JSON instead), so
//! every host runs the very same routes and tests.

use crate::BoxError;
use std::path::PathBuf;

/// The dynamic module's name: Envoy loads `lib<NAME>.so` from `ENVOY_DYNAMIC_MODULES_SEARCH_PATH`.
pub const NATIVE_MODULE: &str = "agent_idempotency_native";
/// The filter's name in the chain (and under `typed_per_filter_config`) for both hosts' configs.
const WASM_FILTER: &str = "envoy.filters.http.wasm";
const NATIVE_FILTER: &str = "envoy.filters.http.dynamic_modules";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilterHost {
    Wasm,
    Native,
    ExtProc,
}

impl FilterHost {
    /// `IDEM_E2E_HOST`: `wasm` (default), `native` or `extproc`; anything else is an error, never a silent default.
    pub fn current() -> Result<FilterHost, BoxError> {
        match std::env::var("IDEM_E2E_HOST").ok().as_deref().map(str::trim) {
            None | Some("") | Some("wasm") => Ok(FilterHost::Wasm),
            Some("native") => Ok(FilterHost::Native),
            Some("extproc") => Ok(FilterHost::ExtProc),
            Some(other) => Err(format!("IDEM_E2E_HOST={other}: expected `wasm`, `native` or `extproc`").into()),
        }
    }

    pub fn is_native(self) -> bool {
        self == FilterHost::Native
    }

    pub fn is_ext_proc(self) -> bool {
        self == FilterHost::ExtProc
    }
}

/// A rendered config as the current host runs it, and `cmd` (an `envoy`) told where the module is
/// when the config loads it: a committed native config (`envoy/native.yaml`) runs as it is, on any host.
pub fn for_current_host(yaml: &str, cmd: &mut std::process::Command) -> Result<String, BoxError> {
    let host = FilterHost::current()?;
    let text = if host.is_native() && yaml.contains(WASM_FILTER) {
        to_native(yaml)?
    } else if host.is_ext_proc() && yaml.contains(WASM_FILTER) {
        crate::ext_proc::to_ext_proc(yaml)?
    } else {
        yaml.to_owned()
    };
    if text.contains("DynamicModuleFilter") {
        cmd.env("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", native_module_dir()?);
    }
    Ok(text)
}

/// Where `make native` puts the module (`target/release/libagent_idempotency_native.so`).
pub fn native_module_dir() -> Result<PathBuf, BoxError> {
    let dir = crate::target_dir().join("release");
    let lib = dir.join(format!("lib{NATIVE_MODULE}.so"));
    if !lib.exists() {
        return Err(format!("{} is missing: run `make native` first", lib.display()).into());
    }
    Ok(dir)
}

/// Rewrite every proxy-wasm filter of an Envoy config into the native module's
/// filter carrying the same plugin configuration (`configuration.value`), and
/// the per-route filter configs that name it. An Envoy config without a wasm
/// filter, or one whose filter has no inline configuration, is an error.
pub fn to_native(yaml: &str) -> Result<String, BoxError> {
    replace_wasm_filters(
        yaml,
        NATIVE_FILTER,
        |_| None,
        |pad, block| {
            let config = plugin_configuration(block).ok_or("a wasm filter without an inline `configuration.value`")?;
            let mut out = vec![
                format!("{pad}- name: {NATIVE_FILTER}"),
                format!("{pad}  typed_config:"),
                format!(
                    "{pad}    \"@type\": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter"
                ),
                format!("{pad}    dynamic_module_config: {{ name: {NATIVE_MODULE} }}"),
                format!("{pad}    filter_name: agent_idempotency"),
                format!("{pad}    filter_config:"),
                format!("{pad}      \"@type\": type.googleapis.com/google.protobuf.StringValue"),
                format!("{pad}      value: |"),
            ];
            out.extend(config.iter().map(|c| format!("{pad}        {c}")));
            Ok(out)
        },
    )
}

/// The walk every host's conversion shares: each proxy-wasm filter's list item becomes what `filter`
/// makes of its block (given the item's indentation), the per-route configs that name the wasm
/// filter name `new_name` instead, and `extra` may put lines after any other line (`None`: none).
/// A config without a wasm filter is an error.
pub(crate) fn replace_wasm_filters(
    yaml: &str,
    new_name: &str,
    mut extra: impl FnMut(&str) -> Option<Vec<String>>,
    mut filter: impl FnMut(&str, &[&str]) -> Result<Vec<String>, BoxError>,
) -> Result<String, BoxError> {
    let lines: Vec<&str> = yaml.lines().collect();
    let mut out: Vec<String> = Vec::with_capacity(lines.len());
    let mut converted = 0;
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        if line.trim_start() != format!("- name: {WASM_FILTER}") {
            out.push(line.replace(&format!("{WASM_FILTER}:"), &format!("{new_name}:")));
            out.extend(extra(line).into_iter().flatten());
            i += 1;
            continue;
        }
        let end = block_end(&lines, i);
        let pad = " ".repeat(line.len() - line.trim_start().len());
        out.extend(filter(&pad, &lines[i + 1..end])?);
        converted += 1;
        i = end;
    }
    if converted == 0 {
        return Err("no proxy-wasm filter to convert".into());
    }
    let mut text = out.join("\n");
    text.push('\n');
    Ok(text)
}

/// Where the block of the list item at `start` (`- name: …`) ends: the first following line that is
/// not indented deeper than it.
pub(crate) fn block_end(lines: &[&str], start: usize) -> usize {
    let indent = lines.get(start).map_or(0, |l| l.len() - l.trim_start().len());
    (start + 1..lines.len())
        .find(|&j| {
            let l = lines[j];
            !l.trim().is_empty() && l.len() - l.trim_start().len() <= indent
        })
        .unwrap_or(lines.len())
}

/// The lines of `configuration: { value: | … }` in a wasm filter block, unindented.
pub(crate) fn plugin_configuration(block: &[&str]) -> Option<Vec<String>> {
    let start = block.iter().position(|l| l.trim_start().starts_with("configuration:"))?;
    let value = (start + 1..block.len()).find(|&j| block[j].trim_start().starts_with("value: |"))?;
    let value_indent = block[value].len() - block[value].trim_start().len();
    let body: Vec<&str> = block[value + 1..]
        .iter()
        .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > value_indent)
        .copied()
        .collect();
    let strip = body.iter().filter(|l| !l.trim().is_empty()).map(|l| l.len() - l.trim_start().len()).min()?;
    Some(body.iter().map(|l| l.get(strip..).unwrap_or("").trim_end().to_string()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_committed_test_config_converts_with_its_plugin_configuration() -> Result<(), BoxError> {
        for config in ["e2e.yaml", "e2e-rds.yaml", "bench.yaml", "envoy.yaml", "soak.yaml"] {
            let text = std::fs::read_to_string(crate::repo_root().join("envoy").join(config))?;
            let native = to_native(&text)?;
            assert!(!native.contains("envoy.extensions.filters.http.wasm.v3.Wasm"), "{config}");
            assert!(native.contains("\"sidecar_cluster\""), "{config}: the plugin configuration moved along");
            assert!(native.contains(&format!("dynamic_module_config: {{ name: {NATIVE_MODULE} }}")), "{config}");
        }
        Ok(())
    }

    #[test]
    fn a_config_without_a_wasm_filter_is_an_error() {
        assert!(to_native("static_resources: {}\n").is_err());
    }
}
