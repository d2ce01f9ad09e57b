//! Sets of request paths, as a route matches them and as its upstream receives
//! them after Envoy's rewrites, and whether two such sets may meet.
//!
//! "Meet" is read the way a lenient upstream reads a path (core's
//! `lenient_path`: no case, no trailing slash, dot segments and escapes
//! resolved), because the question is never whether two strings are equal but
//! whether an upstream may run the same handler for both: `/v1/Transfers/`
//! meets `/v1/transfers`. A set the check cannot compute (`Unknown`) meets
//! everything: the check denies by default.

use idem_core::policy::rules::lenient_path;
use regex::Regex;

/// A set of paths.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Space {
    /// One path.
    Exact(String),
    /// Every path that starts with it.
    Prefix(String),
    /// A URI template (`/v1/{account}/transfers`, `/static/**`), segment by segment.
    Template(Vec<Seg>),
    /// Paths this check cannot compute, and why (a pattern it cannot invert, say).
    Unknown(String),
}

/// One segment of a template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seg {
    Lit(String),
    /// Any one non-empty segment (`{name}`, `*`, or a segment mixing literals and a variable).
    One,
    /// Any number of segments, to the end (`**`, `{name=**}`).
    Rest,
}

impl std::fmt::Display for Space {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Space::Exact(p) => write!(f, "{p}"),
            Space::Prefix(p) => write!(f, "{p}*"),
            Space::Template(segs) => {
                let text: Vec<&str> = segs
                    .iter()
                    .map(|s| match s {
                        Seg::Lit(l) => l.as_str(),
                        Seg::One => "{…}",
                        Seg::Rest => "**",
                    })
                    .collect();
                write!(f, "/{}", text.join("/"))
            }
            Space::Unknown(why) => write!(f, "paths this check cannot compute ({why})"),
        }
    }
}

impl Space {
    /// More than one path, or paths unknown.
    pub fn is_broad(&self) -> bool {
        !matches!(self, Space::Exact(_))
    }

    /// Whether an upstream may read some path of `self` as a path of `other`.
    pub fn meets(&self, other: &Space) -> bool {
        use Space::*;
        match (self, other) {
            (Unknown(_), _) | (_, Unknown(_)) => true,
            (Exact(a), Exact(b)) => fold_path(a) == fold_path(b),
            (Exact(e), Prefix(p)) | (Prefix(p), Exact(e)) => fold_path(e).starts_with(&fold_prefix(p)),
            (Prefix(a), Prefix(b)) => {
                let (a, b) = (fold_prefix(a), fold_prefix(b));
                a.starts_with(&b) || b.starts_with(&a)
            }
            (Template(t), Exact(e)) | (Exact(e), Template(t)) => segments_match(t, &segments(&fold_path(e))),
            (Template(t), Prefix(p)) | (Prefix(p), Template(t)) => {
                let head = fold_prefix(&literal_head(t));
                let p = fold_prefix(p);
                head.starts_with(&p) || p.starts_with(&head)
            }
            (Template(a), Template(b)) => templates_meet(a, b),
        }
    }
}

/// A path as a lenient upstream reads it.
fn fold_path(p: &str) -> String {
    lenient_path(p).unwrap_or_else(|| p.to_string())
}

/// A prefix as a lenient upstream reads the paths under it: no case, and no trailing slash (`/v1/transfers/`
/// takes `/v1/transfers/`, which such an upstream reads as `/v1/transfers`).
fn fold_prefix(p: &str) -> String {
    let lower = p.to_lowercase();
    match lower.trim_end_matches('/') {
        "" => String::new(),
        t => t.to_string(),
    }
}

fn segments(path: &str) -> Vec<&str> {
    path.split('/').filter(|s| !s.is_empty()).collect()
}

fn segments_match(t: &[Seg], path: &[&str]) -> bool {
    match (t.split_first(), path.split_first()) {
        (Some((Seg::Rest, _)), _) => true,
        (None, None) => true,
        (Some((Seg::Lit(l), t)), Some((p, path))) => l.to_lowercase() == *p && segments_match(t, path),
        (Some((Seg::One, t)), Some((_, path))) => segments_match(t, path),
        _ => false,
    }
}

fn templates_meet(a: &[Seg], b: &[Seg]) -> bool {
    match (a.split_first(), b.split_first()) {
        (Some((Seg::Rest, _)), _) | (_, Some((Seg::Rest, _))) => true,
        (None, None) => true,
        (Some((x, a)), Some((y, b))) => {
            let same = match (x, y) {
                (Seg::Lit(l), Seg::Lit(m)) => l.eq_ignore_ascii_case(m),
                _ => true,
            };
            same && templates_meet(a, b)
        }
        _ => false,
    }
}

/// The literal segments a template starts with, as a path prefix (`/v1/accounts/` for `/v1/accounts/{id}`).
fn literal_head(t: &[Seg]) -> String {
    let mut head = String::new();
    for s in t {
        match s {
            Seg::Lit(l) => {
                head.push('/');
                head.push_str(l);
            }
            _ => {
                head.push('/');
                break;
            }
        }
    }
    head
}

/// An Envoy URI template (`path_match_policy`'s `path_template`, or a rewrite's `path_template_rewrite`), with
/// the variables that take several segments (`{name=**}`) listed in `rest_vars` when it is a rewrite.
pub fn template(text: &str, rest_vars: &[String]) -> Space {
    let mut segs = Vec::new();
    for s in text.split('/').skip(1) {
        let seg = if s == "**" || s.ends_with("=**}") {
            Seg::Rest
        } else if s == "*" || s.contains('{') {
            let whole_var = s.strip_prefix('{').and_then(|v| v.strip_suffix('}')).filter(|v| !v.contains('{'));
            match whole_var {
                Some(v) if rest_vars.iter().any(|r| r == v) => Seg::Rest,
                _ => Seg::One,
            }
        } else {
            Seg::Lit(s.to_string())
        };
        segs.push(seg);
    }
    if segs.iter().all(|s| matches!(s, Seg::Lit(_))) {
        return Space::Exact(text.to_string());
    }
    Space::Template(segs)
}

/// The variables of a URI template that take several segments (`{name=**}`).
pub fn rest_vars(text: &str) -> Vec<String> {
    text.split('/')
        .filter_map(|s| s.strip_prefix('{').and_then(|v| v.strip_suffix("=**}")))
        .map(str::to_string)
        .collect()
}

/// How Envoy rewrites a route's path before it goes upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rewrite {
    None,
    /// `prefix_rewrite`: the matched prefix (for a `path` match, the whole path) is replaced.
    Prefix(String),
    /// `regex_rewrite`: every match of `pattern` in the path is replaced by `substitution` (`\1` for groups).
    Regex {
        pattern: String,
        substitution: String,
    },
    /// `path_rewrite_policy` with a URI template.
    Template(String),
    /// A rewrite this check does not know (another path_rewrite_policy extension).
    Other(String),
}

impl std::fmt::Display for Rewrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rewrite::None => write!(f, "no rewrite"),
            Rewrite::Prefix(p) => write!(f, "prefix_rewrite {p}"),
            Rewrite::Regex { pattern, substitution } => write!(f, "regex_rewrite {pattern} → {substitution}"),
            Rewrite::Template(t) => write!(f, "path_template_rewrite {t}"),
            Rewrite::Other(what) => write!(f, "{what}"),
        }
    }
}

/// The paths the upstream receives for requests whose paths are `matched` (the route's match, or the part of
/// it a route rule takes) on a route whose own match is `route_match`, after `rewrite`.
pub fn upstream(route_match: &Space, matched: &Space, rewrite: &Rewrite) -> Space {
    match rewrite {
        Rewrite::None => matched.clone(),
        Rewrite::Prefix(new) => match (route_match, matched) {
            // A `path` match: prefix_rewrite replaces the whole path.
            (Space::Exact(_), _) => Space::Exact(new.clone()),
            (Space::Prefix(p), Space::Exact(e)) => match e.strip_prefix(p.as_str()) {
                Some(rest) => Space::Exact(format!("{new}{rest}")),
                None => Space::Unknown(format!("prefix_rewrite {new} of {e}, outside the route's prefix {p}")),
            },
            (Space::Prefix(p), Space::Prefix(q)) => match q.strip_prefix(p.as_str()) {
                Some(rest) => Space::Prefix(format!("{new}{rest}")),
                None => Space::Prefix(new.clone()),
            },
            (Space::Prefix(_), _) => Space::Prefix(new.clone()),
            _ => Space::Unknown(format!("prefix_rewrite {new} on a match that is not a path or a prefix")),
        },
        Rewrite::Regex { pattern, substitution } => match matched {
            Space::Exact(path) => match regex_rewrite(pattern, substitution, path) {
                Ok(p) => Space::Exact(p),
                Err(e) => Space::Unknown(e),
            },
            _ => Space::Unknown(format!(
                "regex_rewrite {pattern} on a route that matches more than one path: the check cannot invert it"
            )),
        },
        Rewrite::Template(t) => match route_match {
            Space::Template(_) | Space::Exact(_) => template(t, &[]),
            _ => Space::Unknown(format!("path_template_rewrite {t} without a template match")),
        },
        Rewrite::Other(what) => Space::Unknown(what.clone()),
    }
}

/// `path` after Envoy's `regex_rewrite` (RE2, every match replaced, `\N` for a group). Err: a pattern this
/// check's engine does not take the way RE2 does.
pub fn regex_rewrite(pattern: &str, substitution: &str, path: &str) -> Result<String, String> {
    let re = Regex::new(pattern)
        .map_err(|e| format!("regex_rewrite {pattern}: not a pattern this check can evaluate ({e})"))?;
    // RE2's `\N` is regex's `${N}`; a literal `$` must be doubled, `\\` is a backslash.
    let mut replacement = String::new();
    let mut chars = substitution.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.peek().copied() {
                Some(d) if d.is_ascii_digit() => {
                    chars.next();
                    replacement.push_str(&format!("${{{d}}}"));
                }
                Some('\\') => {
                    chars.next();
                    replacement.push('\\');
                }
                _ => return Err(format!("regex_rewrite substitution {substitution:?}: a stray backslash")),
            },
            '$' => replacement.push_str("$$"),
            c => replacement.push(c),
        }
    }
    Ok(re.replace_all(path, replacement.as_str()).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(p: &str) -> Space {
        Space::Exact(p.into())
    }
    fn p(p: &str) -> Space {
        Space::Prefix(p.into())
    }

    #[test]
    fn paths_meet_as_a_lenient_upstream_reads_them() {
        assert!(e("/v1/transfers").meets(&e("/v1/transfers")));
        assert!(e("/V1/Transfers/").meets(&e("/v1/transfers")), "case and a trailing slash");
        assert!(!e("/v1/transfers/preview").meets(&e("/v1/transfers")));
        assert!(p("/v1/").meets(&e("/v1/transfers")));
        assert!(p("/v1/transfers/").meets(&e("/v1/transfers")), "/v1/transfers/ is under it");
        assert!(!p("/v1/transfers/status").meets(&e("/v1/transfers")));
        assert!(p("/").meets(&p("/v1/transfers/status")));
        assert!(!p("/v2/").meets(&p("/v1/")));
        let t = template("/v1/{account}/transfers", &[]);
        assert!(t.meets(&e("/v1/acme/transfers")));
        assert!(!t.meets(&e("/v1/transfers")));
        assert!(t.meets(&p("/v1/")));
        assert!(template("/static/**", &[]).meets(&e("/static/a/b")));
        assert!(Space::Unknown("x".into()).meets(&e("/anything")));
    }

    #[test]
    fn rewrites_are_applied_as_envoy_applies_them() {
        let none = Rewrite::None;
        assert_eq!(upstream(&e("/a"), &e("/a"), &none), e("/a"));
        let to = Rewrite::Prefix("/v1/transfers".into());
        assert_eq!(upstream(&e("/plain/v1/transfers"), &e("/plain/v1/transfers"), &to), e("/v1/transfers"));
        let to = Rewrite::Prefix("/v1/".into());
        assert_eq!(upstream(&p("/api/"), &p("/api/"), &to), p("/v1/"));
        assert_eq!(upstream(&p("/api/"), &e("/api/transfers"), &to), e("/v1/transfers"));
        let regex = Rewrite::Regex { pattern: "^/legacy/(.*)$".into(), substitution: "/v1/\\1".into() };
        assert_eq!(upstream(&e("/legacy/transfers"), &e("/legacy/transfers"), &regex), e("/v1/transfers"));
        assert!(matches!(upstream(&p("/legacy/"), &p("/legacy/"), &regex), Space::Unknown(_)));
        let lookahead = Rewrite::Regex { pattern: "(?=x)".into(), substitution: "y".into() };
        assert!(matches!(upstream(&e("/x"), &e("/x"), &lookahead), Space::Unknown(_)));
        assert_eq!(regex_rewrite("transfers", "a$b", "/v1/transfers").as_deref(), Ok("/v1/a$b"));
        let rewrite = Rewrite::Template("/v1/{account}/transfers".into());
        let matched = template("/accounts/{account}", &[]);
        assert_eq!(upstream(&matched, &matched, &rewrite), template("/v1/{account}/transfers", &[]));
        let fixed = Rewrite::Template("/v1/transfers".into());
        assert_eq!(upstream(&matched, &matched, &fixed), e("/v1/transfers"));
    }
}
