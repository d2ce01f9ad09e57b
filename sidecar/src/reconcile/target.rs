//! Which URL asks the upstream about one row: by its key (`{key}`), by its
//! business reference (`{ref}`), or none, when nothing the endpoint could say
//! would be evidence. Pure: the template and the row decide.
//!
//! * A row whose upstream ignores `Idempotency-Key` is asked only by
//!   reference: that upstream never stored the key, so a by-key 404 would
//!   "prove" that every such operation never ran.
//! * A row with a stored reference is asked by reference wherever the
//!   template has `{ref}` (and by key too, if it also has `{key}`).
//! * A row without a reference on a template with both placeholders is asked
//!   by key, `{ref}` empty (the configuration keeps `{ref}` in the query, so
//!   the request still names the same resource); on a `{ref}`-only template
//!   it cannot be asked.

use std::collections::BTreeMap;

use crate::store::record::Record;

/// Scope → URL template (with `{key}`, `{ref}` or both), validated by `idemd serve`'s
/// configuration.
pub type StatusEndpoints = BTreeMap<String, String>;

pub const KEY_PLACEHOLDER: &str = "{key}";
pub const REF_PLACEHOLDER: &str = "{ref}";

pub use crate::evidence::By;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub by: By,
    pub url: String,
}

/// The reason a row whose upstream ignores keys cannot be looked up goes to NEEDS_REVIEW
/// (each audit line starts with it, so an operator can search for it).
pub const NO_REF_LOOKUP: &str = "upstream ignores keys and no business-reference lookup";

/// The URL for `rec` on `template` (a validated `--status-endpoint` URL), or why there is none.
pub fn target(template: &str, rec: &Record) -> Result<Target, String> {
    let has_key = template.contains(KEY_PLACEHOLDER);
    let has_ref = template.contains(REF_PLACEHOLDER);
    let fill =
        |reference: &str| template.replace(REF_PLACEHOLDER, &encode(reference)).replace(KEY_PLACEHOLDER, &rec.key);
    let scope = &rec.scope;
    match (rec.business_ref.as_deref(), has_ref) {
        (Some(reference), true) => Ok(Target { by: By::Ref, url: fill(reference) }),
        _ if rec.upstream_ignores_keys => Err(match has_ref {
            true => {
                format!("{NO_REF_LOOKUP}: the operation has no business reference (its route names no business_ref)")
            }
            false => format!(
                "{NO_REF_LOOKUP}: the status endpoint of scope {scope} looks up by {KEY_PLACEHOLDER} only, \
                 which this upstream never stored"
            ),
        }),
        (None, true) if !has_key => Err(format!(
            "the status endpoint of scope {scope} looks up by {REF_PLACEHOLDER} only, and the operation has \
             no business reference"
        )),
        _ => Ok(Target { by: By::Key, url: fill("") }),
    }
}

/// Percent-encode everything but RFC 3986's unreserved characters: the reference is one path
/// segment or query value, whatever it contains (`/`, `?`, `&`, spaces, non-ASCII).
fn encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::protocol::OpState;

    const KEY: &str = "0123456789abcdef0123456789abcdef";

    fn rec(ignores_keys: bool, business_ref: Option<&str>) -> Record {
        Record {
            key: KEY.into(),
            state: OpState::InFlight,
            param_hash: "p".into(),
            subject_hash: "u".into(),
            scope: "payments.nokey".into(),
            owner: Some("o".into()),
            result: None,
            lease_until_ms: Some(0),
            created_at_ms: 0,
            updated_at_ms: 0,
            reconcile_attempts: 0,
            fp_exp_ms: None,
            upstream_ignores_keys: ignores_keys,
            business_ref: business_ref.map(str::to_string),
            bound_fields: None,
        }
    }

    const BY_KEY: &str = "http://h/v1/transfers/by-key/{key}";
    const BY_REF: &str = "http://h/v1/transfers/by-ref/{ref}";
    const BOTH: &str = "http://h/v1/transfers/status?key={key}&ref={ref}";

    /// (how, the URL) or (None, why not).
    fn url(t: &Result<Target, String>) -> (Option<By>, String) {
        match t {
            Ok(t) => (Some(t.by), t.url.clone()),
            Err(why) => (None, why.clone()),
        }
    }

    #[test]
    fn a_deduplicating_upstream_is_asked_by_key_or_by_its_reference() {
        let plain = rec(false, None);
        let with_ref = rec(false, Some("inv-7"));
        assert_eq!(
            url(&target(BY_KEY, &plain)),
            (Some(By::Key), "http://h/v1/transfers/by-key/0123456789abcdef0123456789abcdef".to_string())
        );
        assert_eq!(url(&target(BY_KEY, &with_ref)).0, Some(By::Key), "no {{ref}}: the key it keeps");
        assert_eq!(url(&target(BY_REF, &with_ref)), (Some(By::Ref), "http://h/v1/transfers/by-ref/inv-7".to_string()));
        assert_eq!(
            url(&target(BOTH, &with_ref)),
            (Some(By::Ref), "http://h/v1/transfers/status?key=0123456789abcdef0123456789abcdef&ref=inv-7".to_string())
        );
        // No reference stored: by key where the URL has it ({ref} empty, in the query) ...
        assert_eq!(
            url(&target(BOTH, &plain)),
            (Some(By::Key), "http://h/v1/transfers/status?key=0123456789abcdef0123456789abcdef&ref=".to_string())
        );
        // ... and nothing to ask where it has not.
        let (by, why) = url(&target(BY_REF, &plain));
        assert_eq!(by, None);
        assert_eq!(why, "the status endpoint of scope payments.nokey looks up by {ref} only, and the operation has no business reference");
    }

    #[test]
    fn an_upstream_that_ignores_keys_is_asked_only_by_reference() {
        assert_eq!(
            url(&target(BY_REF, &rec(true, Some("inv-7")))),
            (Some(By::Ref), "http://h/v1/transfers/by-ref/inv-7".to_string())
        );
        assert_eq!(url(&target(BOTH, &rec(true, Some("inv-7")))).0, Some(By::Ref));
        for (template, reference, tail) in [
            (
                BY_KEY,
                Some("inv-7"),
                "the status endpoint of scope payments.nokey looks up by {key} only, which this upstream never stored",
            ),
            (
                BY_KEY,
                None,
                "the status endpoint of scope payments.nokey looks up by {key} only, which this upstream never stored",
            ),
            (BY_REF, None, "the operation has no business reference (its route names no business_ref)"),
            (BOTH, None, "the operation has no business reference (its route names no business_ref)"),
        ] {
            let (by, why) = url(&target(template, &rec(true, reference)));
            assert_eq!(by, None, "{template} {reference:?}");
            assert_eq!(why, format!("{NO_REF_LOOKUP}: {tail}"));
        }
    }

    #[test]
    fn a_reference_is_one_percent_encoded_component() {
        let t = target(BY_REF, &rec(true, Some("a/b?c=d&e f#g%ü~._-"))).map(|t| t.url);
        assert_eq!(t.as_deref(), Ok("http://h/v1/transfers/by-ref/a%2Fb%3Fc%3Dd%26e%20f%23g%25%C3%BC~._-"));
        // A reference that looks like a placeholder stays what it is.
        let t = target(BOTH, &rec(false, Some("{key}"))).map(|t| t.url);
        assert_eq!(t.as_deref(), Ok("http://h/v1/transfers/status?key=0123456789abcdef0123456789abcdef&ref=%7Bkey%7D"));
    }
}
