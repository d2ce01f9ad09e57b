//! Path templates: `/v1/accounts/{account}/transfers`, a route rule's `match.path` or a route
//! annotation's `template`. A `{name}` is one whole, non-empty segment; its value is what the
//! request's path has there, exactly as sent (DESIGN §3: strings exact), so a template parameter
//! can be bound into the fingerprint like a body field (`bind: "path:account"`).

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    Literal(String),
    /// `{name}`: one non-empty segment.
    Param(String),
}

/// Bounds a template's parameters (a path has few).
const MAX_PARAMS: usize = 16;

/// `/v1/accounts/{account}/transfers` → its segments (the first is the empty one before `/`).
pub fn parse_template(path: &str) -> Result<Vec<Segment>, String> {
    if !path.starts_with('/') {
        return Err(format!("{path:?} must start with /"));
    }
    if path.contains(['?', '#']) {
        return Err(format!("{path:?}: query strings and fragments are never matched"));
    }
    let mut out: Vec<Segment> = Vec::new();
    for s in path.split('/') {
        if let Some(inner) = s.strip_prefix('{').and_then(|r| r.strip_suffix('}')) {
            if inner.is_empty() || !inner.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                return Err(format!("{{{inner}}}: a parameter is {{name}} with letters, digits or _"));
            }
            if out.iter().any(|seg| matches!(seg, Segment::Param(n) if n == inner)) {
                return Err(format!("{{{inner}}} appears twice: which segment it names would be a guess"));
            }
            out.push(Segment::Param(inner.to_string()));
        } else if s.contains(['{', '}', '*']) {
            return Err(format!("segment {s:?}: only whole-segment {{name}} parameters; no wildcards"));
        } else {
            out.push(Segment::Literal(s.to_string()));
        }
    }
    if params(&out).count() > MAX_PARAMS {
        return Err(format!("more than {MAX_PARAMS} parameters"));
    }
    Ok(out)
}

/// The names of a template's parameters, in order.
pub fn params(template: &[Segment]) -> impl Iterator<Item = &str> {
    template.iter().filter_map(|s| match s {
        Segment::Param(n) => Some(n.as_str()),
        Segment::Literal(_) => None,
    })
}

/// The value of parameter `name` in `path` (query and fragment cut), or `None` where the path does
/// not have the template's shape.
pub fn param_value<'p>(template: &[Segment], path: &'p str, name: &str) -> Option<&'p str> {
    let path = path.split(['?', '#']).next().unwrap_or_default();
    let mut got = path.split('/');
    let mut found = None;
    for want in template {
        let g = got.next()?;
        match want {
            Segment::Literal(w) if g == w => {}
            Segment::Param(n) if !g.is_empty() => {
                if n == name {
                    found = Some(g);
                }
            }
            _ => return None,
        }
    }
    match got.next() {
        None => found,
        Some(_) => None,
    }
}

/// The template as written (`/v1/accounts/{account}/transfers`).
pub fn show(template: &[Segment]) -> String {
    let parts: Vec<String> = template
        .iter()
        .map(|s| match s {
            Segment::Literal(l) => l.clone(),
            Segment::Param(n) => format!("{{{n}}}"),
        })
        .collect();
    parts.join("/")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parameter_is_one_whole_segment_read_exactly() -> Result<(), String> {
        let t = parse_template("/v1/accounts/{account}/transfers/{id}")?;
        assert_eq!(params(&t).collect::<Vec<_>>(), ["account", "id"]);
        assert_eq!(show(&t), "/v1/accounts/{account}/transfers/{id}");
        let at = |path: &str, name: &str| param_value(&t, path, name).map(str::to_owned);
        assert_eq!(at("/v1/accounts/A-1/transfers/7?x=1", "account").as_deref(), Some("A-1"));
        assert_eq!(at("/v1/accounts/A%2D1/transfers/7", "account").as_deref(), Some("A%2D1"), "as sent");
        assert_eq!(at("/v1/accounts/A-1/transfers/7", "id").as_deref(), Some("7"));
        for off in ["/v1/accounts//transfers/7", "/v1/accounts/A/B/transfers/7", "/v1/accounts/A/transfers/7/x"] {
            assert_eq!(at(off, "account"), None, "{off}");
        }
        assert_eq!(at("/v1/accounts/A/transfers/7", "other"), None);
        for bad in ["v1/x", "/x/{a-b}", "/x/{}", "/x/a{b}", "/x/*", "/x?y=1", "/{a}/{a}"] {
            assert!(parse_template(bad).is_err(), "{bad}");
        }
        Ok(())
    }
}
