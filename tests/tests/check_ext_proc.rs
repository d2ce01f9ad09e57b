//! `idemd check` on the ext_proc host: every committed Envoy configuration the e2e suite runs on the
//! ext_proc host (`IDEM_E2E_HOST=extproc`: its `.wasm` filter converted to Envoy's ext_proc filter by
//! tests/src/ext_proc.rs, in both body modes) gets the verdict its `.wasm` original gets, checked with the plugin
//! configuration idemd's ext_proc host runs (`--ext-proc-config`, the file `idemd serve --ext-proc-config`
//! reads). The same conversion with `failure_mode_allow: true`, or a STREAMED body, is refused by the rule about
//! it; checked without the plugin configuration, it is refused saying so.

use idem_e2e::ext_proc::{plugin_config_of, to_ext_proc_with};
use idem_e2e::{bin, repo_root, BoxError, TestResult};
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Debug)]
struct Verdict {
    code: Option<i32>,
    /// The rules of its findings, sorted.
    rules: Vec<String>,
    output: String,
}

/// `idemd check --envoy <file> [--ext-proc-config <config>]` from the repository (RDS files are read from there),
/// with idemd serve's defaults.
fn check(file: &Path, ext_proc_config: Option<&Path>) -> Result<Verdict, BoxError> {
    let mut cmd = Command::new(bin("idemd")?);
    cmd.arg("check").arg("--envoy").arg(file).current_dir(repo_root());
    for var in ["IDEM_LEASE_MS", "IDEM_TERMINAL_RETENTION_S", "IDEM_RETRY_WINDOW_S", "IDEM_EXT_PROC_CONFIG"] {
        cmd.env_remove(var);
    }
    if let Some(config) = ext_proc_config {
        cmd.arg("--ext-proc-config").arg(config);
    }
    let out = cmd.output()?;
    let output = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let mut rules: Vec<String> = output
        .lines()
        .filter_map(|l| l.split_once(": [").and_then(|(_, r)| r.split_once(']')).map(|(r, _)| r.to_string()))
        .collect();
    rules.sort();
    if !matches!(out.status.code(), Some(0 | 1)) {
        return Err(format!("idemd check failed on {}: {output}", file.display()).into());
    }
    Ok(Verdict { code: out.status.code(), rules, output })
}

/// The committed configurations with a `.wasm` filter the e2e suite's conversion takes (an inline plugin
/// configuration), by name, with their text.
fn convertible() -> Result<Vec<(String, String)>, BoxError> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(repo_root().join("envoy"))? {
        let path: PathBuf = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_owned();
        // A listener filter-bench splices into bench.yaml, not a configuration of its own.
        if !name.ends_with(".yaml") || name == "bench-empty.yaml" {
            continue;
        }
        let text = std::fs::read_to_string(&path)?;
        if text.contains("envoy.filters.http.wasm") && plugin_config_of(&text).is_some() {
            out.push((name, text));
        }
    }
    out.sort();
    let names: Vec<&str> = out.iter().map(|(n, _)| n.as_str()).collect();
    for expected in ["e2e.yaml", "e2e-rds.yaml", "envoy.yaml", "compose.yaml", "soak.yaml"] {
        assert!(names.contains(&expected), "{expected} converts: {names:?}");
    }
    Ok(out)
}

/// `text` converted to the ext_proc host with `body` both ways, written into `dir` with its plugin
/// configuration: (the Envoy configuration, the plugin configuration).
fn converted(dir: &Path, name: &str, text: &str, body: &str) -> Result<(PathBuf, PathBuf), BoxError> {
    let config = plugin_config_of(text).ok_or("no plugin configuration")?;
    let plugin = dir.join(format!("{name}.json"));
    std::fs::write(&plugin, config)?;
    let envoy = dir.join(format!("{body}-{name}"));
    std::fs::write(&envoy, to_ext_proc_with(text, body)?)?;
    Ok((envoy, plugin))
}

#[test]
fn every_converted_configuration_gets_its_wasm_originals_verdict() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut accepted = 0;
    for (name, text) in convertible()? {
        let original = check(&repo_root().join("envoy").join(&name), None)?;
        for body in ["BUFFERED", "FULL_DUPLEX_STREAMED"] {
            let (envoy, plugin) = converted(dir.path(), &name, &text, body)?;
            let verdict = check(&envoy, Some(&plugin))?;
            assert_eq!(
                (verdict.code, &verdict.rules),
                (original.code, &original.rules),
                "{name} ({body}):\n{}\nthe .wasm original:\n{}",
                verdict.output,
                original.output
            );
            assert!(verdict.output.contains("connection manager(s) running the filter") || verdict.code == Some(1));
            accepted += usize::from(verdict.code == Some(0));
        }
    }
    // e2e.yaml (one route misconfigured on purpose) and bench.yaml (its baselines) are refused; the rest pass.
    assert!(accepted >= 8, "{accepted}");
    Ok(())
}

#[test]
fn a_converted_configuration_that_fails_open_or_streams_or_lacks_its_plugin_configuration_is_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let text = std::fs::read_to_string(repo_root().join("envoy/envoy.yaml"))?;
    let (envoy, plugin) = converted(dir.path(), "envoy.yaml", &text, "BUFFERED")?;
    let good = std::fs::read_to_string(&envoy)?;
    assert_eq!(check(&envoy, Some(&plugin))?.code, Some(0));

    let open = dir.path().join("open.yaml");
    std::fs::write(&open, good.replacen("failure_mode_allow: false", "failure_mode_allow: true", 1))?;
    let verdict = check(&open, Some(&plugin))?;
    assert_eq!(
        (verdict.code, verdict.rules.as_slice()),
        (Some(1), &["ext-proc-fail-open".to_string()][..]),
        "{}",
        verdict.output
    );
    assert!(verdict.output.contains("`failure_mode_allow`"), "{}", verdict.output);

    let (streamed, _) = converted(dir.path(), "envoy.yaml", &text, "STREAMED")?;
    let verdict = check(&streamed, Some(&plugin))?;
    assert_eq!(verdict.code, Some(1), "{}", verdict.output);
    assert!(verdict.rules.iter().all(|r| r == "ext-proc-processing-mode"), "{}", verdict.output);
    assert!(verdict.output.contains("request_body_mode: STREAMED"), "{}", verdict.output);

    // Without the plugin configuration the check cannot tell what is guarded: refused, saying so (and the annotated
    // routes of that listener read as unguarded ways, since nothing shows they are not).
    let verdict = check(&envoy, None)?;
    assert_eq!(verdict.code, Some(1), "{}", verdict.output);
    assert!(verdict.rules.contains(&"ext-proc-config".to_string()), "{}", verdict.output);
    assert!(
        verdict.rules.iter().all(|r| ["ext-proc-config", "unfiltered-listener-to-guarded-path"].contains(&r.as_str())),
        "{}",
        verdict.output
    );
    assert!(verdict.output.contains("--ext-proc-config FILE"), "{}", verdict.output);
    assert!(
        verdict.output.contains("given no plugin configuration for the ext_proc filter there"),
        "{}",
        verdict.output
    );
    Ok(())
}
