//! The layout shows the architecture (issue 21): within each crate, the top-level modules depend on
//! one another in one direction. A module that reaches `crate::x` while `x` reaches back is an import
//! circle; this finds every one (the mutually reachable modules over the `crate::` references outside
//! comments and test modules) and fails on any not listed below as known, so no new circle creeps in
//! and a fixed one cannot come back.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

type Graph = BTreeMap<String, BTreeSet<String>>;

/// Circles known today, to cut (each entry is one circle's modules, sorted): none left.
const KNOWN: &[(&str, &[&str])] = &[];

const CRATES: &[&str] = &["core/src", "adapter/src", "src", "native/src", "sidecar/src", "demo/src", "model/src"];

fn root() -> &'static Path {
    // tests/ is one level below the workspace.
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap_or(Path::new("."))
}

/// The code of a file without comments and without its trailing `mod tests { … }`.
fn code(text: &str) -> String {
    let text = text.find("#[cfg(test)]\nmod tests {").map_or(text, |i| &text[..i]);
    text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
}

fn refs(code: &str) -> BTreeSet<String> {
    code.match_indices("crate::")
        .map(|(i, m)| code[i + m.len()..].chars().take_while(|c| c.is_ascii_lowercase() || *c == '_').collect())
        .filter(|s: &String| !s.is_empty())
        .collect()
}

fn graph(dir: &Path, top: Option<&str>, g: &mut Graph) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_stem().and_then(|n| n.to_str()).unwrap_or("").to_string();
        if path.is_dir() {
            graph(&path, Some(top.unwrap_or(&name)), g)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            let module = top.unwrap_or(&name).to_string();
            // The crate roots declare every module; a module's own tests (`tests.rs`) are not layered.
            if (top.is_none() && matches!(name.as_str(), "lib" | "main")) || name == "tests" {
                continue;
            }
            let deps = refs(&code(&std::fs::read_to_string(&path)?));
            g.entry(module.clone()).or_default().extend(deps.into_iter().filter(|d| *d != module));
        }
    }
    Ok(())
}

/// Modules that reach each other: each module with every module it reaches that reaches it back.
fn circles(g: &Graph) -> Vec<Vec<String>> {
    let reach = |from: &str| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_string()];
        while let Some(m) = todo.pop() {
            for d in g.get(&m).into_iter().flatten().filter(|d| g.contains_key(*d)) {
                if seen.insert(d.clone()) {
                    todo.push(d.clone());
                }
            }
        }
        seen
    };
    let all: BTreeMap<&String, BTreeSet<String>> = g.keys().map(|m| (m, reach(m))).collect();
    let mut out: BTreeSet<Vec<String>> = BTreeSet::new();
    for (m, from_m) in &all {
        let mut circle: Vec<String> =
            from_m.iter().filter(|o| all.get(o).is_some_and(|r| r.contains(*m))).cloned().collect();
        if !circle.is_empty() {
            if !circle.contains(m) {
                circle.push((*m).clone());
            }
            circle.sort();
            out.insert(circle);
        }
    }
    out.into_iter().collect()
}

#[test]
fn no_import_circle_beyond_the_known_ones() -> Result<(), Box<dyn std::error::Error>> {
    for krate in CRATES {
        let mut g = Graph::new();
        graph(&root().join(krate), None, &mut g)?;
        let known: Vec<Vec<String>> = KNOWN
            .iter()
            .filter(|(k, _)| k == krate)
            .map(|(_, ms)| ms.iter().map(|m| m.to_string()).collect())
            .collect();
        assert_eq!(circles(&g), known, "{krate}: import circles among top-level modules (graph: {g:?})");
    }
    Ok(())
}

#[test]
fn the_check_sees_a_circle() {
    let mut g = Graph::new();
    g.insert("a".into(), ["b".to_string()].into());
    g.insert("b".into(), ["c".to_string()].into());
    g.insert("c".into(), ["a".to_string()].into());
    g.insert("d".into(), ["a".to_string()].into());
    assert_eq!(circles(&g), vec![vec!["a".to_string(), "b".into(), "c".into()]]);
    assert_eq!(refs(&code("use crate::x::Y; // crate::z\n")), ["x".to_string()].into());
}

/// Only the native module's ABI needs `unsafe` (and the `.wasm` host's `abi.rs`, by its own `allow`
/// under the crate's `deny`): every other crate root forbids it, so no `unsafe` block can creep in.
#[test]
fn every_crate_but_the_native_module_forbids_unsafe_code() -> Result<(), Box<dyn std::error::Error>> {
    fn roots(dir: &Path, out: &mut Vec<std::path::PathBuf>) -> std::io::Result<()> {
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            if path.is_dir() {
                if !matches!(name, "target" | "node_modules" | "native" | "fuzz_targets" | ".git" | ".venv") {
                    roots(&path, out)?;
                }
            } else if let Some(parent) = path.parent() {
                let in_src = parent.ends_with("src");
                let bin = parent.ends_with("src/bin") || parent.parent().is_some_and(|p| p.ends_with("src/bin"));
                let root = (in_src && matches!(name, "lib.rs" | "main.rs"))
                    || (parent.ends_with("src/bin") && name.ends_with(".rs"))
                    || (bin && !parent.ends_with("src/bin") && name == "main.rs");
                if root {
                    out.push(path);
                }
            }
        }
        Ok(())
    }
    let mut found = Vec::new();
    roots(root(), &mut found)?;
    assert!(found.len() >= 20, "{found:?}");
    let mut missing = Vec::new();
    for path in found {
        let text = std::fs::read_to_string(&path)?;
        let wasm_host = path == root().join("src/lib.rs");
        let attr = if wasm_host { "#![deny(unsafe_code)]" } else { "#![forbid(unsafe_code)]" };
        if !text.lines().any(|l| l.trim() == attr) {
            missing.push(path);
        }
    }
    assert!(missing.is_empty(), "crate roots without the unsafe_code lint: {missing:?}");
    Ok(())
}
