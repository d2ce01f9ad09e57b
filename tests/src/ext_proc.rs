//! The ext_proc host in the e2e suite (`IDEM_E2E_HOST=extproc`): idemd serves Envoy's External
//! Processing protocol itself (`idemd serve --ext-proc ADDR --ext-proc-config FILE`), and each
//! Envoy config's proxy-wasm filter becomes Envoy's own `ext_proc` filter pointing at it, with
//! `failure_mode_allow: false`. The plugin configuration the `.wasm` would get goes to idemd.
//!
//! A stack's idemd and Envoy are tied by idemd's port: `prepare` records, for an idemd port, the
//! port its ext_proc service listens on and the plugin configuration it runs; the Envoy config
//! (which names that idemd port in its `idem_sidecar` cluster) is then pointed at the same
//! service, and a config whose plugin configuration differs from idemd's is an error, never a
//! silent mismatch.

use crate::filter_host::{block_end, plugin_configuration, replace_wasm_filters};
use crate::BoxError;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

const WASM_FILTER: &str = "envoy.filters.http.wasm";
const EXT_PROC_FILTER: &str = "envoy.filters.http.ext_proc";
/// The cluster the converted configs send ext_proc streams on.
pub const EXT_PROC_CLUSTER: &str = "idem_ext_proc";
/// Envoy waits this long for each answer; idemd's own store calls are bounded by the plugin's
/// `sidecar_timeout_ms` (5 s in the test configs) below it.
const MESSAGE_TIMEOUT: &str = "10s";

struct Registered {
    sidecar: u16,
    ext_proc: u16,
    config: String,
}

static REGISTERED: Mutex<Vec<Registered>> = Mutex::new(Vec::new());

fn registry() -> std::sync::MutexGuard<'static, Vec<Registered>> {
    REGISTERED.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The plugin configuration the idemd on `sidecar_port` was started with, if it runs the host.
pub fn runs(sidecar_port: u16) -> Option<String> {
    registry().iter().find(|r| r.sidecar == sidecar_port).map(|r| r.config.clone())
}

/// The plugin configuration (JSON text) of the first proxy-wasm filter in an Envoy config.
pub fn plugin_config_of(yaml: &str) -> Option<String> {
    let lines: Vec<&str> = yaml.lines().collect();
    let start = lines.iter().position(|l| l.trim_start() == format!("- name: {WASM_FILTER}"))?;
    let end = block_end(&lines, start);
    plugin_configuration(&lines[start + 1..end]).map(|c| c.join("\n"))
}

/// The plugin configuration file of the ext_proc host of the idemd on `sidecar_port` (`prepare` writes it
/// into `dir`): what `idemd serve --ext-proc-config` and `idemd check --ext-proc-config` read.
pub fn config_file(sidecar_port: u16, dir: &Path) -> PathBuf {
    dir.join(format!("ext-proc-config-{sidecar_port}.json"))
}

/// Record that the idemd on `sidecar_port` runs the ext_proc host with `config`; returns the
/// file to give it (`--ext-proc-config`) and the port it serves on.
pub fn prepare(sidecar_port: u16, config: &str, dir: &Path) -> Result<(PathBuf, u16), BoxError> {
    let path = config_file(sidecar_port, dir);
    std::fs::write(&path, config)?;
    let mut reg = registry();
    if let Some(r) = reg.iter_mut().find(|r| r.sidecar == sidecar_port) {
        r.config = config.to_owned();
        return Ok((path, r.ext_proc));
    }
    let ext_proc = crate::free_port()?;
    reg.push(Registered { sidecar: sidecar_port, ext_proc, config: config.to_owned() });
    Ok((path, ext_proc))
}

/// What `spawn_sidecar` adds for the idemd on `port`: the ext_proc flags, with the configuration
/// `prepare` recorded, or else the one of envoy/e2e.yaml (checked against Envoy's at its start).
pub fn sidecar_args(port: u16, dir: &Path) -> Result<Vec<String>, BoxError> {
    let known = registry().iter().find(|r| r.sidecar == port).map(|r| r.config.clone());
    let config = match known {
        Some(c) => c,
        None => {
            let text = std::fs::read_to_string(crate::repo_root().join("envoy/e2e.yaml"))?;
            plugin_config_of(&text).ok_or("envoy/e2e.yaml has no plugin configuration")?
        }
    };
    let (path, ext_proc) = prepare(port, &config, dir)?;
    Ok(vec![
        "--ext-proc".into(),
        format!("127.0.0.1:{ext_proc}"),
        "--ext-proc-config".into(),
        path.display().to_string(),
        // One thread, as the tests' Envoys run one worker: what a route learns (an answer that named
        // its own fingerprint) is per thread on every host.
        "--ext-proc-threads".into(),
        "1".into(),
    ])
}

/// The ports of the endpoints of the cluster the plugin configuration calls idemd on
/// (`sidecar_cluster`) in a rendered config: one idemd, or several replicas (the soak's two).
fn sidecar_ports(yaml: &str) -> Vec<u16> {
    let Some(config) = plugin_config_of(yaml).and_then(|c| serde_json::from_str::<serde_json::Value>(&c).ok()) else {
        return Vec::new();
    };
    let Some(cluster) = config.get("sidecar_cluster").and_then(|c| c.as_str()) else { return Vec::new() };
    let lines: Vec<&str> = yaml.lines().collect();
    let Some(start) = lines.iter().position(|l| {
        let l = l.trim_start();
        l == format!("- name: {cluster}")
            || l == format!("- name: \"{cluster}\"")
            || l == format!("- name: '{cluster}'")
    }) else {
        return Vec::new();
    };
    let end = block_end(&lines, start);
    lines[start..end]
        .iter()
        .filter_map(|l| {
            let (_, rest) = l.split_once("port_value:")?;
            let digits: String = rest.trim_start().chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
        .collect()
}

/// Rewrite every proxy-wasm filter into Envoy's `ext_proc` filter (BUFFERED both ways, trailers
/// sent, the route's metadata and the answer's code details as attributes, `failure_mode_allow:
/// false`), the per-route configs that name it, and add the cluster to idemd's ext_proc service.
/// `IDEM_E2E_EXT_PROC_BODY` chooses the body mode of both directions: `BUFFERED` (default) or
/// `FULL_DUPLEX_STREAMED` (what Google's Agent Gateway uses for every event).
pub fn to_ext_proc(yaml: &str) -> Result<String, BoxError> {
    to_ext_proc_with(yaml, &body_mode()?)
}

/// `IDEM_E2E_EXT_PROC_BODY`: the body mode the converted configs use, BUFFERED unless it says
/// FULL_DUPLEX_STREAMED or STREAMED.
pub fn body_mode() -> Result<String, BoxError> {
    let mode = std::env::var("IDEM_E2E_EXT_PROC_BODY").ok().filter(|m| !m.trim().is_empty());
    let mode = mode.as_deref().map(str::trim).unwrap_or("BUFFERED");
    if !["BUFFERED", "FULL_DUPLEX_STREAMED", "STREAMED"].contains(&mode) {
        return Err(
            format!("IDEM_E2E_EXT_PROC_BODY={mode}: expected BUFFERED, FULL_DUPLEX_STREAMED or STREAMED").into()
        );
    }
    Ok(mode.to_owned())
}

/// [`to_ext_proc`] with another body mode for both directions (`FULL_DUPLEX_STREAMED`, …).
pub fn to_ext_proc_with(yaml: &str, body_mode: &str) -> Result<String, BoxError> {
    with_processor_failure_envelope(&ext_proc_filters(yaml, body_mode)?)
}

/// The §7 `status_unavailable` envelope for the ext_proc filter's own failure replies (idemd unreachable, its stream broken
/// or timed out: no response flag, code details `ext_proc_error_…`), first among the mappers of
/// every `local_reply_config`: the mapper envoy/ext-proc.yaml ships (`idemd check`'s local-reply
/// rule), read from that file so the e2e suite runs what platform teams copy.
fn with_processor_failure_envelope(yaml: &str) -> Result<String, BoxError> {
    let shipped = std::fs::read_to_string(crate::repo_root().join("envoy/ext-proc.yaml"))?;
    let mapper = processor_failure_mapper(&shipped).ok_or("envoy/ext-proc.yaml has no mapper for `ext_proc_error`")?;
    let mut out = Vec::new();
    let mut after_local_reply = false;
    for line in yaml.lines() {
        out.push(line.to_string());
        let trimmed = line.trim_start();
        if after_local_reply && trimmed == "mappers:" {
            let pad = " ".repeat(line.len() - trimmed.len());
            out.extend(mapper.iter().map(|l| format!("{pad}{l}")));
        }
        if !trimmed.is_empty() {
            after_local_reply = trimmed == "local_reply_config:";
        }
    }
    Ok(out.join("\n") + "\n")
}

/// The list item of `yaml`'s `mappers:` whose filter names `ext_proc_error`, its lines without the
/// list's indentation (comments dropped).
fn processor_failure_mapper(yaml: &str) -> Option<Vec<String>> {
    let lines: Vec<&str> = yaml.lines().filter(|l| !l.trim_start().starts_with('#')).collect();
    let items = lines.iter().enumerate().filter(|(_, l)| l.trim_start().starts_with("- filter:"));
    items
        .map(|(i, l)| {
            let pad = l.len() - l.trim_start().len();
            let item = &lines[i..block_end(&lines, i)];
            item.iter().map(|l| l.get(pad..).unwrap_or("").trim_end().to_string()).collect::<Vec<_>>()
        })
        .find(|item| item.iter().any(|l| l.contains("ext_proc_error")))
}

fn ext_proc_filters(yaml: &str, body_mode: &str) -> Result<String, BoxError> {
    let sidecars = sidecar_ports(yaml);
    if sidecars.is_empty() {
        return Err("no cluster named by the plugin's sidecar_cluster to find idemd by".into());
    }
    let config = plugin_config_of(yaml).ok_or("a wasm filter without an inline `configuration.value`")?;
    // Every idemd the filter would call serves the ext_proc host: Envoy's cluster to it has each one.
    let mut ext_procs = Vec::new();
    {
        let reg = registry();
        for sidecar in &sidecars {
            match reg.iter().find(|r| r.sidecar == *sidecar) {
                Some(r) if r.config.trim() != config.trim() => {
                    return Err(format!(
                        "the ext_proc host on idemd :{sidecar} runs another plugin configuration than this Envoy \
                         config's; start its idemd with this one (ext_proc::prepare)"
                    )
                    .into())
                }
                Some(r) => ext_procs.push(r.ext_proc),
                None => {}
            }
        }
    }
    // No idemd of this stack (`--mode validate`): any port.
    if ext_procs.is_empty() {
        ext_procs.push(9191);
    }
    convert(yaml, EXT_PROC_CLUSTER, body_mode, Some(&ext_procs))
}

/// One listener block of a config (the bench's `agents`, `rules`) with its proxy-wasm filter made
/// Envoy's `ext_proc` filter sending its streams on `cluster` ([`cluster`] makes it), and the
/// processor's failure answered with the envelope, as [`to_ext_proc`] converts a whole config.
pub fn listener_to_ext_proc(block: &str, cluster: &str, body_mode: &str) -> Result<String, BoxError> {
    with_processor_failure_envelope(&convert(block, cluster, body_mode, None)?)
}

/// The cluster `name` of idemd's ext_proc services on `ports` (HTTP/2), as a list item of
/// `clusters:` indented by `pad`.
pub fn cluster(name: &str, ports: &[u16], pad: &str) -> Vec<String> {
    [
        format!("{pad}- name: {name}"),
        format!("{pad}  type: STATIC"),
        format!("{pad}  connect_timeout: 0.5s"),
        format!("{pad}  typed_extension_protocol_options:"),
        format!("{pad}    envoy.extensions.upstreams.http.v3.HttpProtocolOptions:"),
        format!("{pad}      \"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"),
        format!("{pad}      explicit_http_config: {{ http2_protocol_options: {{}} }}"),
        format!("{pad}  load_assignment:"),
        format!("{pad}    cluster_name: {name}"),
        format!("{pad}    endpoints:"),
        format!("{pad}    - lb_endpoints:"),
    ]
    .into_iter()
    .chain(ports.iter().map(|port| {
        format!(
            "{pad}      - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {port} }} }} }}"
        )
    }))
    .collect()
}

/// Every proxy-wasm filter of `yaml` made the `ext_proc` filter on `cluster`; with `ports`, the
/// cluster to them first among the clusters.
fn convert(yaml: &str, cluster_name: &str, body_mode: &str, ports: Option<&[u16]>) -> Result<String, BoxError> {
    replace_wasm_filters(
        yaml,
        EXT_PROC_FILTER,
        |line| {
            let pad = " ".repeat(line.len() - line.trim_start().len());
            ports.filter(|_| line.trim_start() == "clusters:").map(|ports| cluster(cluster_name, ports, &pad))
        },
        |pad, _block| {
            Ok(vec![
                format!("{pad}- name: {EXT_PROC_FILTER}"),
                format!("{pad}  typed_config:"),
                format!(
                    "{pad}    \"@type\": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
                ),
                format!("{pad}    grpc_service:"),
                format!("{pad}      envoy_grpc: {{ cluster_name: {cluster_name} }}"),
                format!("{pad}    failure_mode_allow: false"),
                format!("{pad}    message_timeout: {MESSAGE_TIMEOUT}"),
                format!("{pad}    allow_mode_override: true"),
                format!("{pad}    processing_mode:"),
                format!("{pad}      request_header_mode: SEND"),
                format!("{pad}      response_header_mode: SEND"),
                format!("{pad}      request_body_mode: {body_mode}"),
                format!("{pad}      response_body_mode: {body_mode}"),
                format!("{pad}      request_trailer_mode: SEND"),
                format!("{pad}      response_trailer_mode: SEND"),
                format!("{pad}    request_attributes: [xds.route_metadata, xds.route_name]"),
                format!("{pad}    response_attributes: [response.code_details]"),
                format!("{pad}    metadata_options:"),
                format!("{pad}      forwarding_namespaces: {{ untyped: [envoy.filters.http.jwt_authn] }}"),
            ])
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_test_configs_convert_with_their_plugin_configuration_moved_to_idemd() -> Result<(), BoxError> {
        for config in ["e2e.yaml", "envoy.yaml"] {
            let text = std::fs::read_to_string(crate::repo_root().join("envoy").join(config))?;
            let plugin = plugin_config_of(&text).ok_or("no plugin configuration")?;
            assert!(plugin.contains("\"sidecar_cluster\""), "{config}");
            let converted = to_ext_proc(&text)?;
            assert!(!converted.contains("envoy.extensions.filters.http.wasm.v3.Wasm"), "{config}");
            assert!(converted.contains("failure_mode_allow: false"), "{config}");
            assert!(converted.contains(&format!("- name: {EXT_PROC_CLUSTER}")), "{config}");
            assert!(!converted.contains("\"sidecar_cluster\""), "{config}: the plugin configuration is idemd's");
            assert_eq!(
                converted.matches("startsWith('ext_proc_error')").count(),
                text.matches("local_reply_config:").count(),
                "{config}: the processor's failure answered with the envelope"
            );
        }
        Ok(())
    }

    /// The mapper the conversion adds is envoy/ext-proc.yaml's, whole: its filter, status code and
    /// every field of the envelope, not the mapper before it (the cut's `in_progress`).
    #[test]
    fn the_processor_failure_mapper_is_the_shipped_one() -> Result<(), BoxError> {
        let shipped = std::fs::read_to_string(crate::repo_root().join("envoy/ext-proc.yaml"))?;
        let mapper = processor_failure_mapper(&shipped).ok_or("no mapper")?;
        assert_eq!(mapper.first().map(String::as_str), Some("- filter:"), "{mapper:?}");
        for line in
            ["status_code: 503", "status: status_unavailable", "instruction:", "poll_after_ms: 2000", "trace_id:"]
        {
            assert!(mapper.iter().any(|l| l.trim_start().starts_with(line)), "{line} in {mapper:?}");
        }
        assert!(!mapper.iter().any(|l| l.contains("in_progress") || l.contains("response_flag_filter")), "{mapper:?}");
        Ok(())
    }
}
