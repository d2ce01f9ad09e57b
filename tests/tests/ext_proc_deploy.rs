//! The ext_proc host as it is shipped, run with a real Envoy and idemd serving ext_proc with the committed plugin
//! configuration file, and accepted by `idemd check` with that same file:
//!
//! - envoy/ext-proc.yaml (plain Envoy) with envoy/ext-proc-config.json;
//! - deploy/istio/ext-proc: the EnvoyFilter's `envoy.filters.http.ext_proc` filter, exactly as written, in the
//!   inbound listener Istio builds (envoy/istio-like.yaml, in place of the `.wasm`), the outbound cluster Istio gives
//!   idemd's Service port grpc-ext-proc, and the ConfigMap's `config.json` as idemd's file.
//!
//! Both start their own ext_proc host (`--ext-proc`), so they run on the default build only: under
//! `IDEM_E2E_HOST=extproc` the harness converts `.wasm` configurations itself, and these have none.

use idem_e2e::istio::{jwt_subject_walk, set_secret_env};
use idem_e2e::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;

const WHY: &str = "these tests start their own ext_proc host beside the committed configurations";

/// The ext_proc flags of an idemd serving on 127.0.0.1:`port` with the plugin configuration `config`.
fn ext_proc_args(port: u16, config: &Path) -> Vec<String> {
    vec![
        "--ext-proc".into(),
        format!("127.0.0.1:{port}"),
        "--ext-proc-config".into(),
        config.display().to_string(),
        // One thread, as the tests' Envoys run one worker.
        "--ext-proc-threads".into(),
        "1".into(),
    ]
}

/// `idemd check --envoy envoy --ext-proc-config config` from the repository: (success, its output).
fn idemd_check(envoy: &Path, config: &Path) -> Result<(bool, String), BoxError> {
    let out = Command::new(bin("idemd")?)
        .arg("check")
        .arg("--envoy")
        .arg(envoy)
        .arg("--ext-proc-config")
        .arg(config)
        .current_dir(repo_root())
        .output()?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    Ok((out.status.success(), text))
}

#[tokio::test]
async fn plain_envoy_runs_the_ext_proc_host_with_the_committed_files() -> TestResult {
    if wasm_only(WHY)? {
        return Ok(());
    }
    // The configuration's sidecar_token: what idemd's in-process calls present to its own API.
    std::env::set_var("IDEM_SIDECAR_TOKEN", SIDECAR_TOKEN);
    let port = free_port()?;
    let config = repo_root().join("envoy/ext-proc-config.json");
    let opts = StackOpts {
        envoy_config: "ext-proc.yaml",
        envoy_edits: vec![("port_value: 9191".into(), format!("port_value: {port}"))],
        sidecar: SidecarOpts { extra_args: ext_proc_args(port, &config), ..Default::default() },
        ..Default::default()
    };
    let stack = Stack::start(opts).await?;
    let (preview, fp) = stack.preview(json!("25.00")).await?;
    assert_eq!(preview.status, 200, "{preview:?}");
    let body = transfer(json!("25.00"), "preview memo");
    let first = stack.post("/v1/transfers", SUBJECT, &body, &[("agent-fingerprint", &fp)]).await?;
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(first.header("idempotent-replayed"), Some("false"));
    let again = stack.post("/v1/transfers", SUBJECT, &body, &[("agent-fingerprint", &fp)]).await?;
    assert_eq!(again.status, 201, "the replay keeps the original status: {again:?}");
    again.assert_prompt("already_completed");
    let changed = transfer(json!("25.01"), "preview memo");
    let tampered = stack.post("/v1/transfers", SUBJECT, &changed, &[("agent-fingerprint", &fp)]).await?;
    assert_eq!(tampered.status, 422, "{tampered:?}");
    assert_eq!(counts(&stack).await?, (1, 1), "exactly one transfer ran");
    // idemd's host served them (Envoy has no agent filter of its own here).
    let stats = stack.http.get(stack.sidecar_url("/ext-proc/stats")).send().await?;
    assert_eq!(stats.status(), 200, "idemd serves its ext_proc counters");

    let (ok, out) = idemd_check(Path::new("envoy/ext-proc.yaml"), Path::new("envoy/ext-proc-config.json"))?;
    assert!(ok, "idemd check refuses envoy/ext-proc.yaml:\n{out}");
    Ok(())
}

/// The YAML documents of a file under deploy/, as JSON.
fn deploy_docs(rel: &str) -> Result<Vec<Value>, BoxError> {
    let text = std::fs::read_to_string(repo_root().join("deploy").join(rel))?;
    let docs = idem_oci::istio::documents(&text).map_err(|e| e.to_string())?;
    docs.iter().map(|d| Ok(serde_json::to_value(d)?)).collect()
}

/// The ext_proc filter deploy/istio/ext-proc/envoyfilter.yaml inserts, as written.
fn istio_ext_proc_filter() -> Result<Value, BoxError> {
    istio_ext_proc_patch("HTTP_FILTER")
}

/// The value of the EnvoyFilter's patch that applies to `applies_to`.
fn istio_ext_proc_patch(applies_to: &str) -> Result<Value, BoxError> {
    let docs = deploy_docs("istio/ext-proc/envoyfilter.yaml")?;
    let patches = docs.first().and_then(|d| d.pointer("/spec/configPatches")).and_then(Value::as_array);
    let patch = patches
        .into_iter()
        .flatten()
        .find(|p| p["applyTo"] == applies_to)
        .ok_or_else(|| format!("no {applies_to} patch in deploy/istio/ext-proc/envoyfilter.yaml"))?;
    Ok(patch["patch"]["value"].clone())
}

/// envoy/istio-like.yaml with the EnvoyFilter's ext_proc filter where the `.wasm` was, and the outbound cluster Istio
/// builds for idemd's grpc-ext-proc port (HTTP/2, as istiod makes a gRPC port's cluster) on 127.0.0.1:`port`.
fn istio_ext_proc_edits(port: u16) -> Result<Vec<(String, String)>, BoxError> {
    let filter = istio_ext_proc_filter()?;
    let cluster = filter
        .pointer("/typed_config/grpc_service/envoy_grpc/cluster_name")
        .and_then(Value::as_str)
        .ok_or("the filter names no envoy_grpc cluster")?
        .to_owned();
    let text = std::fs::read_to_string(repo_root().join("envoy/istio-like.yaml"))?;
    let start = text
        .find("          - name: extensions.istio.io/wasmplugin/")
        .ok_or("no .wasm filter in envoy/istio-like.yaml")?;
    let end = start
        + text[start..].find("          - name: envoy.filters.http.router").ok_or("no router in istio-like.yaml")?;
    // As the harness renders it (the module's path), so the edit finds it.
    let wasm = text[start..end]
        .replace("target/wasm32-wasip1/wasm/agent_idempotency_filter.wasm", &idem_e2e::wasm()?.display().to_string());
    let ext_proc = format!("          - {}\n", serde_json::to_string(&filter)?);
    let h2_cluster = format!(
        "  clusters:\n  - name: \"{cluster}\"\n    type: STATIC\n    connect_timeout: 1s\n    \
         typed_extension_protocol_options:\n      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:\n        \
         \"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions\n        \
         explicit_http_config: {{ http2_protocol_options: {{}} }}\n    load_assignment:\n      \
         cluster_name: \"{cluster}\"\n      endpoints:\n      - lb_endpoints:\n        - endpoint: {{ address: {{ \
         socket_address: {{ address: 127.0.0.1, port_value: {port} }} }} }}\n"
    );
    // The connection manager's local replies as the EnvoyFilter's MERGE patch sets them (istiod's own manager has
    // none): Envoy's ext_proc failures are answered by them.
    let manager = istio_ext_proc_patch("NETWORK_FILTER")?;
    let local_reply = manager
        .pointer("/typed_config/local_reply_config")
        .ok_or("the EnvoyFilter's NETWORK_FILTER patch sets no local_reply_config")?;
    let indent = "          ";
    let from =
        text.find(&format!("{indent}local_reply_config:\n")).ok_or("no local_reply_config in istio-like.yaml")?;
    let block_end = text[from + indent.len()..]
        .find(&format!("\n{indent}normalize_path:"))
        .ok_or("istio-like.yaml's local_reply_config is not followed by normalize_path")?;
    let block = &text[from..from + indent.len() + block_end + 1];
    let merged = format!("{indent}local_reply_config: {}\n", serde_json::to_string(local_reply)?);
    Ok(vec![(wasm, ext_proc), ("  clusters:\n".into(), h2_cluster), (block.to_owned(), merged)])
}

/// The ConfigMap's config.json of deploy/istio/ext-proc, written to `dir`.
fn istio_ext_proc_config(dir: &Path) -> Result<PathBuf, BoxError> {
    let docs = deploy_docs("istio/ext-proc/idemd-ext-proc.yaml")?;
    let config = docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap")
        .and_then(|d| d.pointer("/data/config.json"))
        .and_then(Value::as_str)
        .ok_or("no ConfigMap with config.json")?;
    let path = dir.join("config.json");
    std::fs::write(&path, config)?;
    Ok(path)
}

#[tokio::test]
async fn istios_ext_proc_envoyfilter_runs_with_idemd_the_mesh_way() -> TestResult {
    if wasm_only(WHY)? {
        return Ok(());
    }
    set_secret_env();
    std::env::set_var("IDEM_SIDECAR_TOKEN", SIDECAR_TOKEN);
    let files = tempfile::tempdir()?;
    let config = istio_ext_proc_config(files.path())?;
    let port = free_port()?;
    let edits = istio_ext_proc_edits(port)?;
    let opts = StackOpts {
        envoy_config: "istio-like.yaml",
        envoy_edits: edits.clone(),
        sidecar: SidecarOpts { extra_args: ext_proc_args(port, &config), ..Default::default() },
        ..Default::default()
    };
    let stack = Stack::start(opts).await?;
    // A first guarded request, with the processes' logs should it fail.
    let body = transfer(json!("1.00"), "probe");
    let auth = idem_e2e::istio::bearer("carol")?;
    let probe = stack.post("/v1/transfers/preview", "user-mallory", &body, &[("authorization", &auth)]).await?;
    if probe.status != 200 {
        let config = std::fs::read_to_string(stack.dir.path().join("envoy-istio-like.yaml")).unwrap_or_default();
        let clusters = config.split("  clusters:").nth(1).unwrap_or_default();
        panic!(
            "{probe:?}\nenvoy:\n{}\nidemd:\n{}\nclusters:{clusters}",
            stack.envoy.log_text(),
            stack.sidecar.log_text()
        );
    }
    let (_, fp) = jwt_subject_walk(&stack, &[]).await?;
    // A request without a token passes RequestAuthentication; idemd finds no subject in the forwarded metadata.
    let body = transfer(json!("40.00"), "m");
    let anonymous = stack.post("/v1/transfers", "user-mallory", &body, &[("agent-fingerprint", &fp)]).await?;
    assert_eq!(anonymous.status, 401, "{anonymous:?}");
    anonymous.assert_prompt("unauthenticated");
    let ex = stack.executions().await?;
    assert_eq!((ex["total"].as_u64(), ex["attempts"].as_u64()), (Some(1), Some(1)), "exactly one transfer ran: {ex}");

    // The configuration Envoy ran, as `idemd check` reads it with the ConfigMap's file.
    let envoy = files.path().join("istio-ext-proc.yaml");
    std::fs::write(&envoy, envoy_text("istio-like.yaml", &stack.ports, &edits)?)?;
    let (ok, out) = idemd_check(&envoy, &config)?;
    assert!(ok, "idemd check refuses the EnvoyFilter's filter:\n{out}");
    assert!(out.contains("1 connection manager(s) running the filter"), "{out}");
    Ok(())
}
