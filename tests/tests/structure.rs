//! The layout shows the architecture: within each crate, the top-level modules depend on
//! one another in one direction. A module that reaches `crate::x` while `x` reaches back is an import
//! circle; this finds every one (the mutually reachable modules over the `crate::` references outside
//! comments and test modules) and fails on any not listed below as known, so no new circle creeps in
//! and a fixed one cannot come back.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

type Graph = BTreeMap<String, BTreeSet<String>>;

/// Circles known today, to cut: (crate, the module whose children they are, the children, sorted). Both
/// `crate::` and `super::` paths count, so a circle between siblings (`policy::route` ↔ `policy::approval`,
/// cut since) is seen as well as one between top-level modules. None is left; a new one fails.
const KNOWN: &[(&str, &str, &[&str])] = &[];

const CRATES: &[&str] = &["core/src", "adapter/src", "src", "native/src", "sidecar/src", "demo/src", "model/src"];

fn root() -> &'static Path {
    // tests/ is one level below the workspace.
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap_or(Path::new("."))
}

/// The code of a file without comments and without its trailing `mod tests { … }`.
fn code(text: &str) -> String {
    // The unit tests' module, private or shared with other tests (`pub(crate) mod tests`).
    let tests = text.match_indices("#[cfg(test)]\n").map(|(i, _)| i).find(|&i| {
        let next = text[i..].lines().nth(1).unwrap_or_default();
        next.ends_with("mod tests {") && matches!(next.split_whitespace().next(), Some("mod" | "pub" | "pub(crate)"))
    });
    let text = tests.map_or(text, |i| &text[..i]);
    text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
}

/// A module's path in its crate: `policy/route.rs` is `["policy", "route"]`, `policy/mod.rs` is `["policy"]`.
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel.with_extension("").iter().map(|p| p.to_string_lossy().into_owned()).collect();
    if parts.last().is_some_and(|l| matches!(l.as_str(), "mod" | "lib" | "main")) {
        parts.pop();
    }
    parts
}

fn ident(text: &str) -> String {
    text.chars().take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_').collect()
}

/// A path's leading segments (`a::b::Item` → `["a", "b", "Item"]`'s module-looking part).
fn segments(mut text: &str) -> Vec<String> {
    let mut out = Vec::new();
    loop {
        let id = ident(text.trim_start());
        if id.is_empty() {
            return out;
        }
        text = &text.trim_start()[id.len()..];
        out.push(id);
        match text.strip_prefix("::") {
            Some(rest) => text = rest,
            None => return out,
        }
    }
}

/// Every path a module's code names through `crate::` or `super::` (`use super::{a, b::C}` counts both),
/// resolved to a path from the crate root.
fn refs(code: &str, here: &[String]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find(['c', 's']) {
        let after_boundary = i == 0 || !rest[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_');
        rest = &rest[i..];
        let (base, tail) = if let (true, Some(tail)) = (after_boundary, rest.strip_prefix("crate::")) {
            (Some(Vec::new()), tail)
        } else if let (true, Some(mut tail)) = (after_boundary, rest.strip_prefix("super::")) {
            let mut up = 1;
            while let Some(t) = tail.strip_prefix("super::") {
                up += 1;
                tail = t;
            }
            (here.len().checked_sub(up).map(|n| here[..n].to_vec()), tail)
        } else {
            rest = &rest[1..];
            continue;
        };
        rest = tail;
        let Some(base) = base else { continue };
        match tail.strip_prefix('{') {
            // A group: the leading path of each entry at its own depth.
            Some(group) => {
                let (mut depth, mut start) = (0usize, 0usize);
                for (j, c) in group.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => {
                            out.push([base.clone(), segments(&group[start..j])].concat());
                            break;
                        }
                        '}' => depth -= 1,
                        ',' if depth == 0 => {
                            out.push([base.clone(), segments(&group[start..j])].concat());
                            start = j + 1;
                        }
                        _ => {}
                    }
                }
            }
            None => out.push([base, segments(tail)].concat()),
        }
    }
    out
}

fn files(dir: &Path, out: &mut Vec<std::path::PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// The dependency graphs of a crate, one per module with children (the crate root is `""`): an edge
/// from child `a` to child `b` when code in `a` (or below it) names `b` (or something in it) by
/// `crate::` or `super::`. A module's own tests (`tests.rs`) are not layered.
fn graphs(dir: &Path) -> std::io::Result<BTreeMap<String, Graph>> {
    let mut found = Vec::new();
    files(dir, &mut found)?;
    let mut modules = Vec::new();
    for path in &found {
        let rel = path.strip_prefix(dir).map_err(std::io::Error::other)?;
        if rel.file_stem().is_some_and(|s| s == "tests") {
            continue;
        }
        modules.push((module_path(rel), code(&std::fs::read_to_string(path)?)));
    }
    let known: BTreeSet<Vec<String>> = modules.iter().map(|(m, _)| m.clone()).collect();
    let mut out: BTreeMap<String, Graph> = BTreeMap::new();
    for (here, code) in &modules {
        for target in refs(code, here) {
            // The module the path ends in (`policy::RoutePolicy` is in `policy`).
            let len = (0..=target.len()).rev().find(|n| known.contains(&target[..*n])).unwrap_or(0);
            let target = &target[..len];
            let common = here.iter().zip(target).take_while(|(a, b)| a == b).count();
            if let (Some(from), Some(to)) = (here.get(common), target.get(common)) {
                let parent = here[..common].join("::");
                out.entry(parent).or_default().entry(from.clone()).or_default().insert(to.clone());
            }
        }
    }
    Ok(out)
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
        for (parent, g) in graphs(&root().join(krate))? {
            let known: Vec<Vec<String>> = KNOWN
                .iter()
                .filter(|(k, p, _)| k == krate && *p == parent)
                .map(|(_, _, ms)| ms.iter().map(|m| m.to_string()).collect())
                .collect();
            assert_eq!(circles(&g), known, "{krate} {parent}: import circles among its modules (graph: {g:?})");
        }
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
    let here = ["policy".to_string(), "route".to_string()];
    let found = refs(
        &code(
            "use crate::x::Y; // crate::z
use super::{approval::A, pairs};
supercrate::w;
",
        ),
        &here,
    );
    let want: Vec<Vec<String>> =
        vec![vec!["x".into()], vec!["policy".into(), "approval".into()], vec!["policy".into(), "pairs".into()]];
    assert_eq!(found, want);
}

/// A circle between two files of one directory, through `super::`, is seen (as the known ones are).
#[test]
fn the_check_sees_a_circle_between_siblings() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    std::fs::create_dir(dir.path().join("policy"))?;
    std::fs::write(dir.path().join("lib.rs"), "pub mod policy;\n")?;
    std::fs::write(dir.path().join("policy/mod.rs"), "pub mod approval;\npub mod route;\n")?;
    std::fs::write(dir.path().join("policy/route.rs"), "use super::approval::Gate;\n")?;
    std::fs::write(dir.path().join("policy/approval.rs"), "use crate::policy::route::Route;\n")?;
    let graphs = graphs(dir.path())?;
    let g = graphs.get("policy").ok_or("no graph for policy")?;
    assert_eq!(circles(g), vec![vec!["approval".to_string(), "route".into()]]);
    Ok(())
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
