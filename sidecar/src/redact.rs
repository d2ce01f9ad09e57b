//! What of a store URL may reach a log line or an error: everything but the password. Its own
//! module, so the stores, `serve` and `ops` use it without depending on the CLI's configuration.

/// A URL fit for logs: the password replaced, the rest kept.
pub fn redact_url(url: &str) -> String {
    url.split(',').map(redact_one).collect::<Vec<_>>().join(",")
}

fn redact_one(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else { return url.to_string() };
    let rest = &url[scheme_end + 3..];
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else { return url.to_string() };
    let userinfo = &authority[..at];
    let user = userinfo.split(':').next().unwrap_or("");
    let masked = if userinfo.contains(':') { format!("{user}:***") } else { "***".to_string() };
    format!("{}{}{}", &url[..scheme_end + 3], masked, &rest[at..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_reach_the_log() {
        assert_eq!(redact_url("redis://:s3cret@10.0.0.1:6379/0"), "redis://:***@10.0.0.1:6379/0");
        assert_eq!(redact_url("postgres://app:pw@db/idem"), "postgres://app:***@db/idem");
        assert_eq!(redact_url("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(redact_url("redis://a:1@h1:1,redis://h2:2"), "redis://a:***@h1:1,redis://h2:2");
    }
}
