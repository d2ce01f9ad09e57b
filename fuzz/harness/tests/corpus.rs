//! Replays the committed fuzz corpus (`fuzz/corpus/<target>/`) and the fixed
//! crashes (`fuzz/regressions/<target>/`) through the target bodies, so every
//! `cargo nextest run --workspace` re-checks them without a fuzzer.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(entries) => entries.filter_map(Result::ok).map(|e| e.path()).filter(|p| p.is_file()).collect(),
        Err(_) => Vec::new(),
    };
    out.sort();
    out
}

fn replay(target: &str, run: fn(&[u8])) -> Result<(), String> {
    let corpus = files(&fuzz_dir().join("corpus").join(target));
    if corpus.len() < 10 {
        return Err(format!("fuzz/corpus/{target}: {} files, expected a seeded corpus", corpus.len()));
    }
    let regressions = files(&fuzz_dir().join("regressions").join(target));
    let mut failures = Vec::new();
    for path in corpus.iter().chain(&regressions) {
        let data = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        if catch_unwind(AssertUnwindSafe(|| run(&data))).is_err() {
            failures.push(path.display().to_string());
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(format!("{target}: {} input(s) fail (panic message above): {failures:?}", failures.len()))
    }
}

macro_rules! corpus_tests {
    ($($name:ident),*) => {$(
        #[test]
        fn $name() -> Result<(), String> {
            replay(stringify!($name), idem_fuzz_harness::$name)
        }
    )*};
}

corpus_tests!(fingerprint, strict_json, param_hash, plugin_config, route_policy, protocol, mcp, splice, response);

#[test]
fn every_target_is_replayed() {
    let names: Vec<&str> = idem_fuzz_harness::TARGETS.iter().map(|(n, _)| *n).collect();
    assert_eq!(
        names,
        [
            "fingerprint",
            "strict_json",
            "param_hash",
            "plugin_config",
            "route_policy",
            "protocol",
            "mcp",
            "splice",
            "response"
        ]
    );
    for name in names {
        assert!(fuzz_dir().join("fuzz_targets").join(format!("{name}.rs")).is_file(), "{name}");
    }
}
