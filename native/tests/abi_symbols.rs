//! The ABI contract, checked from the binaries' symbol tables: Envoy checks
//! names when it loads the module but never argument lists, so a renamed or
//! removed callback fails at load and a changed one corrupts memory. This test
//! catches the first kind before Envoy does, and pins the ABI version the
//! bindings were written for (`abi.rs`); the upgrade procedure in docs/performance.md
//! ("Upgrading Envoy with the native module") covers the second kind (re-read abi.h for
//! every binding on an Envoy upgrade).

use agent_idempotency_native::abi;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The pinned Envoy's real binary (the venv's `envoy` is a launcher script).
fn envoy_binary() -> Result<PathBuf, Box<dyn std::error::Error>> {
    let lib = repo().join(".venv/lib");
    for python in std::fs::read_dir(&lib)? {
        let candidate = python?.path().join("site-packages/envoy/_bin/envoy");
        if candidate.exists() {
            return Ok(candidate);
        }
    }
    Err(format!("no Envoy binary under {}: run `make bootstrap`", lib.display()).into())
}

fn module() -> Result<PathBuf, Box<dyn std::error::Error>> {
    let dir = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| repo().join("target"));
    let so = dir.join("release/libagent_idempotency_native.so");
    if !so.exists() {
        return Err(format!("{} is missing: run `make native`", so.display()).into());
    }
    Ok(so)
}

/// Dynamic symbols of `file`: `defined` ones (exports) or the undefined ones (imports).
fn symbols(file: &Path, defined: bool) -> Result<BTreeSet<String>, Box<dyn std::error::Error>> {
    let out = Command::new("nm")
        .arg("-D")
        .arg(if defined { "--defined-only" } else { "--undefined-only" })
        .arg(file)
        .output()?;
    if !out.status.success() {
        return Err(format!("nm {}: {}", file.display(), String::from_utf8_lossy(&out.stderr)).into());
    }
    Ok(String::from_utf8(out.stdout)?.lines().filter_map(|l| l.split_whitespace().last()).map(str::to_owned).collect())
}

#[test]
fn every_callback_the_module_imports_is_exported_by_the_pinned_envoy() -> TestResult {
    let envoy = symbols(&envoy_binary()?, true)?;
    let imported = symbols(&module()?, false)?;
    let callbacks: Vec<&String> = imported.iter().filter(|s| s.starts_with("envoy_dynamic_module_callback_")).collect();
    assert!(!callbacks.is_empty(), "the module imports no callback: wrong file?");
    for name in &callbacks {
        assert!(envoy.contains(name.as_str()), "{name}: imported by the module, not exported by Envoy");
        assert!(abi::IMPORTED_CALLBACKS.contains(&name.as_str()), "{name}: imported but not listed in abi.rs");
    }
    for name in abi::IMPORTED_CALLBACKS {
        assert!(envoy.contains(*name), "{name}: declared in abi.rs, not exported by Envoy");
    }
    Ok(())
}

#[test]
fn every_hook_envoy_requires_is_exported_by_the_module() -> TestResult {
    let exported = symbols(&module()?, true)?;
    for name in abi::REQUIRED_HOOKS {
        assert!(exported.contains(*name), "{name}: required by Envoy 1.40, not exported");
    }
    // The pinned binary links a module of its own (hooks prefixed `hickory_dns_static_`): the HTTP filter
    // hooks it exports are the ones this Envoy build looks up, so a new required hook shows up here.
    let envoy = symbols(&envoy_binary()?, true)?;
    let prefix = "hickory_dns_static_";
    let wanted: Vec<&str> = envoy
        .iter()
        .filter_map(|s| s.strip_prefix(prefix))
        .filter(|s| {
            s.starts_with("envoy_dynamic_module_on_http_filter_") || *s == "envoy_dynamic_module_on_program_init"
        })
        .filter(|s| {
            !s.starts_with("envoy_dynamic_module_on_http_filter_config_http_") && !s.contains("config_scheduled")
        })
        .collect();
    assert!(wanted.len() >= abi::REQUIRED_HOOKS.len(), "Envoy's own module lists fewer hooks than abi.rs requires");
    for name in wanted {
        assert!(
            abi::REQUIRED_HOOKS.contains(&name) || abi::OPTIONAL_HOOKS.contains(&name),
            "{name}: an HTTP filter hook of this Envoy that abi.rs does not know"
        );
    }
    Ok(())
}

#[test]
fn the_abi_version_is_the_pinned_envoys() -> TestResult {
    let binary = std::fs::read(envoy_binary()?)?;
    let wanted = [b"\0".as_slice(), abi::ABI_VERSION_NUL].concat();
    assert!(
        binary.windows(wanted.len()).any(|w| w == wanted.as_slice()),
        "the pinned Envoy does not carry the ABI version string {:?}: re-read abi.h",
        abi::ABI_VERSION
    );
    assert_eq!(agent_idempotency_native::abi::ABI_VERSION_NUL, [abi::ABI_VERSION.as_bytes(), b"\0"].concat());
    Ok(())
}
