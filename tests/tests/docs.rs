//! The documentation stays true where a machine can tell: every relative link in the
//! Markdown pages points at a file that exists and, for `#anchor` links into a page, at one of its
//! headings; and the reference pages name every reply status, problem type, filter counter,
//! `idemd serve` option and make target the code has, each in the page where that reference lives.

use idem_core::machine::Counter;
use idem_core::reply::{self, ReplyContext, ReplyKind};
use idem_e2e::markdown::{anchors, prose, slug};
use idem_e2e::{bin, repo_root, TestResult};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The pages: README.md, docs/, and the Markdown next to the code it describes.
fn pages() -> Result<Vec<PathBuf>, std::io::Error> {
    let root = repo_root();
    let mut pages = vec![root.join("README.md")];
    for entry in std::fs::read_dir(root.join("docs"))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path);
        }
    }
    for page in ["sidecar/README.md", "native/ABI-NOTES.md", "demo/MCP-WIRE.md"] {
        pages.push(root.join(page));
    }
    pages.sort();
    Ok(pages)
}

fn read(page: &str) -> Result<String, std::io::Error> {
    std::fs::read_to_string(repo_root().join(page))
}

/// A line without its inline code spans (`` `[a](b)` `` is text, not a link).
fn without_code(line: &str) -> String {
    line.split('`').step_by(2).collect::<Vec<_>>().join(" ")
}

/// What a page shows as commands: its fenced blocks and its inline code spans.
fn code(text: &str) -> String {
    let mut fenced = false;
    let mut out = String::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if fenced {
            out.push_str(line);
        } else {
            out.extend(line.split('`').skip(1).step_by(2).flat_map(|span| [span, " "]));
        }
        out.push('\n');
    }
    out
}

/// The targets of the inline links and images of a page's prose: `[text](target)`.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in prose(text) {
        let line = without_code(line);
        let mut rest = line.as_str();
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].trim().to_string());
            rest = &after[end..];
        }
    }
    out
}

/// What is wrong with one link of `page`, if anything.
fn broken(page: &Path, target: &str) -> Option<String> {
    if target.contains("://") || target.starts_with("mailto:") {
        return None;
    }
    let (path, anchor) = target.split_once('#').map_or((target, None), |(p, a)| (p, Some(a)));
    let file = if path.is_empty() { page.to_path_buf() } else { page.parent()?.join(path) };
    if !file.exists() {
        return Some(format!("{target}: no file {}", file.display()));
    }
    let anchor = anchor?;
    if file.extension().is_none_or(|e| e != "md") {
        return None;
    }
    let text = std::fs::read_to_string(&file).ok()?;
    (!anchors(&text).contains(anchor)).then(|| format!("{target}: {} has no heading #{anchor}", file.display()))
}

#[test]
fn every_relative_link_in_the_docs_resolves() -> TestResult {
    let mut problems = Vec::new();
    let mut count = 0;
    for page in pages()? {
        let text = std::fs::read_to_string(&page)?;
        for target in links(&text) {
            count += 1;
            if let Some(why) = broken(&page, &target) {
                problems.push(format!("{}: {why}", page.strip_prefix(repo_root()).unwrap_or(&page).display()));
            }
        }
    }
    assert!(problems.is_empty(), "broken links:\n{}", problems.join("\n"));
    assert!(count > 50, "only {count} links found: the link reader is broken");
    Ok(())
}

#[test]
fn the_link_check_sees_a_broken_link_and_a_missing_heading() -> TestResult {
    let dir = tempfile::tempdir()?;
    std::fs::write(
        dir.path().join("other.md"),
        "# Other page\n\n## Crash safety: \"did it happen?\"\n## Twice\n## Twice\n",
    )?;
    let page = dir.path().join("page.md");
    let text = "# A page\n\n[ok](other.md#crash-safety-did-it-happen) [ok](other.md#twice-1) [ok](#a-page) \
                [gone](missing.md) [no heading](other.md#nowhere) `[code](not-a-link.md)`\n\
                ```\n[fenced](also-not-a-link.md)\n# not a heading\n```\n";
    std::fs::write(&page, text)?;
    let found: Vec<Option<String>> = links(text).iter().map(|t| broken(&page, t)).collect();
    assert_eq!(found.len(), 5, "{found:?}");
    assert!(found[..3].iter().all(Option::is_none), "{found:?}");
    assert!(found[3].as_deref().is_some_and(|w| w.contains("no file")), "{found:?}");
    assert!(found[4].as_deref().is_some_and(|w| w.contains("no heading #nowhere")), "{found:?}");
    assert_eq!(slug("The filter ⇄ idemd API (`core/src/protocol.rs`)"), "the-filter--idemd-api-coresrcprotocolrs");
    Ok(())
}

/// Every `status` a reply can carry is in docs/agents.md (the table of what the agent sees).
#[test]
fn every_reply_status_is_in_the_agents_page() -> TestResult {
    let page = read("docs/agents.md")?;
    let missing: Vec<&str> =
        ReplyKind::ALL.iter().map(|k| k.status()).filter(|s| !page.contains(&format!("`{s}`"))).collect();
    assert!(missing.is_empty(), "docs/agents.md does not name the statuses {missing:?}");
    Ok(())
}

/// Every RFC 9457 problem `type` is in docs/programs.md, where programs look it up.
#[test]
fn every_problem_type_is_in_the_programs_page() -> TestResult {
    let page = read("docs/programs.md")?;
    let mut missing = BTreeSet::new();
    for kind in ReplyKind::ALL {
        let problem = reply::problem(kind, &ReplyContext::default());
        let body: serde_json::Value = serde_json::from_slice(&problem.body)?;
        let uri = body["type"].as_str().ok_or("a problem without a type")?;
        let slug = uri.strip_prefix(reply::PROBLEM_BASE).ok_or_else(|| format!("type {uri}"))?;
        if !page.contains(&format!("`{slug}`")) {
            missing.insert(slug.to_string());
        }
    }
    assert!(missing.is_empty(), "docs/programs.md does not name the problem types {missing:?}");
    Ok(())
}

/// `a.{b,c}.d` → `a.b.d`, `a.c.d` (how the pages name families of counters).
fn expand(name: &str) -> Vec<String> {
    let (Some(open), Some(close)) = (name.find('{'), name.find('}')) else { return vec![name.to_string()] };
    if close < open {
        return vec![name.to_string()];
    }
    name[open + 1..close]
        .split(',')
        .flat_map(|alt| expand(&format!("{}{}{}", &name[..open], alt.trim(), &name[close + 1..])))
        .collect()
}

/// Every counter the filter keeps is listed in docs/operations.md ("What each part counts").
#[test]
fn every_filter_counter_is_in_the_operations_page() -> TestResult {
    let page = read("docs/operations.md")?;
    let named: BTreeSet<String> = page.replace('\n', "").split('`').skip(1).step_by(2).flat_map(expand).collect();
    let missing: Vec<&str> =
        Counter::ALL.iter().map(|c| c.name().trim_start_matches("idem.")).filter(|n| !named.contains(*n)).collect();
    assert!(missing.is_empty(), "docs/operations.md does not list the filter counters {missing:?}");
    assert_eq!(expand("rejected.{a,b}"), ["rejected.a", "rejected.b"]);
    Ok(())
}

/// Every option `idemd serve --help` shows is in sidecar/README.md's table, which
/// docs/configuration.md links for the full list.
#[test]
fn every_idemd_serve_option_is_in_the_sidecar_readme() -> TestResult {
    let out = Command::new(bin("idemd")?).args(["serve", "--help"]).output()?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let help = String::from_utf8(out.stdout)?;
    let flags: BTreeSet<&str> = help
        .split(|c: char| c.is_whitespace() || c == ',' || c == '=' || c == '[')
        .filter(|w| w.starts_with("--") && w.len() > 2 && !matches!(*w, "--help" | "--version"))
        .collect();
    assert!(flags.len() >= 25, "{flags:?}");
    let readme = read("sidecar/README.md")?;
    let missing: Vec<&&str> = flags.iter().filter(|f| !readme.contains(&format!("`{f}"))).collect();
    assert!(missing.is_empty(), "sidecar/README.md does not list {missing:?}");
    assert!(read("docs/configuration.md")?.contains("(../sidecar/README.md#run)"));
    Ok(())
}

/// Every `make <target>` the pages tell a reader to run is a target of the Makefile.
#[test]
fn every_make_target_the_docs_name_exists() -> TestResult {
    let makefile = read("Makefile")?;
    let targets: BTreeSet<&str> = makefile
        .lines()
        .filter_map(|l| l.split_once(':').map(|(t, _)| t))
        .filter(|t| !t.is_empty() && t.chars().all(|c| c.is_ascii_lowercase() || c == '-'))
        .collect();
    let mut named = BTreeSet::new();
    for page in pages()? {
        let text = std::fs::read_to_string(&page)?;
        let code = code(&text);
        let words: Vec<&str> = code.split(|c: char| c.is_whitespace() || c == '(').collect();
        for pair in words.windows(2) {
            if pair[0] == "make" && pair[1].chars().next().is_some_and(|c| c.is_ascii_lowercase()) {
                let target = pair[1].trim_end_matches(|c: char| !c.is_ascii_alphanumeric());
                named.insert((page.clone(), target.to_string()));
            }
        }
    }
    let unknown: Vec<String> = named
        .iter()
        .filter(|(_, t)| !targets.contains(t.as_str()))
        .map(|(p, t)| format!("{}: make {t}", p.strip_prefix(repo_root()).unwrap_or(p).display()))
        .collect();
    assert!(unknown.is_empty(), "no such make targets: {unknown:?} (targets: {targets:?})");
    let readme = read("README.md")?;
    for command in ["make run", "make run WALKTHROUGH=1", "make test"] {
        assert!(readme.contains(command), "README.md does not show `{command}`");
    }
    Ok(())
}

/// sidecar/README.md's file map: its first fenced block, one entry per line (`src/store/sql/mod.rs  what it
/// holds`, continued on indented lines), each under `src/` naming one file. The paths it names, in order.
fn map_paths(readme: &str) -> Result<Vec<&str>, &'static str> {
    let map = readme.split("```").nth(1).ok_or("sidecar/README.md has no file map")?;
    Ok(map.lines().filter(|line| !line.starts_with(' ')).filter_map(|line| line.split_whitespace().next()).collect())
}

/// The files without an entry of their own on the map.
fn unmapped(paths: &[&str], files: &[String]) -> Vec<String> {
    files.iter().filter(|file| !paths.contains(&file.as_str())).cloned().collect()
}

/// The map's entries under `src/` that name no file: one moved, renamed or removed, or a directory
/// standing in for its files.
fn unknown<'a>(paths: &[&'a str], files: &[String]) -> Vec<&'a str> {
    paths.iter().copied().filter(|path| path.starts_with("src/") && !files.iter().any(|f| f == path)).collect()
}

/// idemd's source files as the map names them, from sidecar/ (`src/store/sql/mod.rs`), sorted.
fn idemd_sources() -> std::io::Result<Vec<String>> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<String>) -> std::io::Result<()> {
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            if path.is_dir() {
                walk(&path, root, out)?;
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path.strip_prefix(root).map_err(std::io::Error::other)?;
                out.push(rel.to_string_lossy().into_owned());
            }
        }
        Ok(())
    }
    let sidecar = repo_root().join("sidecar");
    let mut files = Vec::new();
    walk(&sidecar.join("src"), &sidecar, &mut files)?;
    files.sort();
    Ok(files)
}

/// Every source file of idemd has its own line on sidecar/README.md's map, so the map a new engineer
/// reads first is the territory.
#[test]
fn every_idemd_source_file_is_on_the_sidecar_readme_map() -> TestResult {
    let files = idemd_sources()?;
    assert!(files.len() > 40, "{files:?}");
    let readme = read("sidecar/README.md")?;
    let missing = unmapped(&map_paths(&readme)?, &files);
    assert!(missing.is_empty(), "sidecar/README.md's file map does not name {missing:?}");
    Ok(())
}

/// Everything sidecar/README.md's map names is there, once: no entry outlives its file.
#[test]
fn every_file_the_sidecar_readme_map_names_exists() -> TestResult {
    let files = idemd_sources()?;
    let readme = read("sidecar/README.md")?;
    let paths = map_paths(&readme)?;
    assert!(paths.len() > 40, "{paths:?}");
    let gone = unknown(&paths, &files);
    assert!(gone.is_empty(), "sidecar/README.md's file map names {gone:?}: no such file under sidecar/src/");
    // Outside src/ an entry is a directory, perhaps a pattern (`migrations/<dialect>/`): its fixed part exists.
    let sidecar = repo_root().join("sidecar");
    let absent: Vec<&&str> =
        paths.iter().filter(|p| !sidecar.join(p.split('<').next().unwrap_or_default()).exists()).collect();
    assert!(absent.is_empty(), "sidecar/README.md's file map names {absent:?}: not in sidecar/");
    let twice: BTreeSet<&&str> = paths.iter().filter(|p| paths.iter().filter(|q| q == p).count() > 1).collect();
    assert!(twice.is_empty(), "sidecar/README.md's file map names {twice:?} twice");
    Ok(())
}

#[test]
fn the_map_check_sees_a_file_left_off_and_one_that_is_gone() -> TestResult {
    let readme = "# idemd\n\n```\nsrc/api.rs       handlers\nsrc/check/       (model: what is read;\n                 \
                  ways: the rules)\nsrc/gone.rs      moved\nmigrations/      schema\n```\n\n```\nsrc/lib.rs\n```\n";
    let paths = map_paths(readme)?;
    assert_eq!(paths, ["src/api.rs", "src/check/", "src/gone.rs", "migrations/"]);
    let files: Vec<String> =
        ["src/api.rs", "src/check/mod.rs", "src/check/ways.rs", "src/lib.rs"].map(String::from).to_vec();
    // A directory's entry names none of its files, however its text reads.
    assert_eq!(unmapped(&paths, &files), ["src/check/mod.rs", "src/check/ways.rs", "src/lib.rs"]);
    assert_eq!(unknown(&paths, &files), ["src/check/", "src/gone.rs"]);
    Ok(())
}

/// The pages that describe the design as built: the pages above and every `*/README.md`. Not CHANGELOG.md,
/// which keeps the history.
fn design_pages() -> Result<Vec<PathBuf>, std::io::Error> {
    let root = repo_root();
    let mut found: BTreeSet<PathBuf> = pages()?.into_iter().collect();
    for entry in std::fs::read_dir(&root)? {
        let readme = entry?.path().join("README.md");
        if readme.is_file() {
            found.insert(readme);
        }
    }
    found.remove(&root.join("CHANGELOG.md"));
    Ok(found.into_iter().collect())
}

/// A page's pointers into the project's history, each with its line: an issue, a stop or an issue's hole by
/// number ("issue 35", "Issue #20's", "stop 32", "hole 9"), even across a line break.
fn history_citations(text: &str) -> Vec<String> {
    let words: Vec<(usize, &str)> =
        text.lines().enumerate().flat_map(|(i, line)| line.split_whitespace().map(move |w| (i + 1, w))).collect();
    words
        .windows(2)
        .filter(|pair| {
            let word = pair[0].1.trim_start_matches(|c: char| !c.is_alphanumeric()).to_lowercase();
            let number = pair[1].1.trim_start_matches('#');
            matches!(word.as_str(), "issue" | "issues" | "stop" | "stops" | "hole" | "holes")
                && number.starts_with(|c: char| c.is_ascii_digit())
        })
        .map(|pair| format!("{}: {} {}", pair[0].0, pair[0].1, pair[1].1))
        .collect()
}

/// The docs state the design as built; which issue or stop found what, and when, is CHANGELOG.md's.
#[test]
fn no_page_cites_an_issue_or_a_stop() -> TestResult {
    let mut found = Vec::new();
    for page in design_pages()? {
        let name = page.strip_prefix(repo_root()).unwrap_or(&page).display().to_string();
        let text = std::fs::read_to_string(&page)?;
        found.extend(history_citations(&text).into_iter().map(|citation| format!("{name}:{citation}")));
    }
    assert!(found.is_empty(), "history belongs in CHANGELOG.md, not the docs:\n{}", found.join("\n"));
    assert!(read("README.md")?.contains("(CHANGELOG.md)"), "README.md does not link CHANGELOG.md");
    Ok(())
}

#[test]
fn the_citation_check_sees_issues_stops_and_holes() -> TestResult {
    let text = "Fixed (issue 35, hole 9).\nIssue #20's incident; until stop\n32. Not: envoy#22028, seed 11's #47, \
                the issues, stop. `make soak` stops.";
    assert_eq!(history_citations(text), ["1: (issue 35,", "1: hole 9).", "2: Issue #20's", "2: stop 32."]);
    let pages = design_pages()?;
    assert!(pages.contains(&repo_root().join("sidecar/README.md")), "{pages:?}");
    assert!(!pages.iter().any(|p| p.ends_with("CHANGELOG.md")), "{pages:?}");
    Ok(())
}
