//! Reading the repository's Markdown pages the way GitHub renders them: which lines are prose
//! (outside fenced code blocks) and which `#anchor`s their headings get. The tests that hold the
//! pages to the code (tests/docs.rs, the runbook links of tests/observability.rs) share it.

use std::collections::{BTreeMap, BTreeSet};

/// The lines outside fenced code blocks (a `#` in a shell block is no heading, a `[x](y)` in a
/// YAML block no link).
pub fn prose(text: &str) -> Vec<&str> {
    let mut fenced = false;
    text.lines()
        .filter(|l| {
            if l.trim_start().starts_with("```") {
                fenced = !fenced;
                return false;
            }
            !fenced
        })
        .collect()
}

/// GitHub's anchor of one heading's text: lower case, inline code marks and punctuation
/// dropped, each space a hyphen.
pub fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// Every anchor a page's headings get; a repeated heading gets `-1`, `-2`, …
pub fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for line in prose(text) {
        let hashes = line.chars().take_while(|c| *c == '#').count();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let slug = slug(&line[hashes..]);
        let n = seen.entry(slug.clone()).or_insert(0);
        out.insert(if *n == 0 { slug.clone() } else { format!("{slug}-{n}") });
        *n += 1;
    }
    out
}
