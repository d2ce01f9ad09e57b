//! Backends, found from the configured URLs (never from hard-coded ports):
//!
//! - Redis:    `IDEM_TEST_REDIS_URL`    (default `redis://127.0.0.1:6379`)
//! - Postgres: `IDEM_TEST_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`)
//! - MariaDB:  `IDEM_TEST_MYSQL_URL`    (default `mysql://root@127.0.0.1:3306/test`)
//!
//! A backend that cannot be reached skips its test with a loud line on stderr
//! and in the file `IDEM_SKIP_LOG` names (nextest hides passing tests' output;
//! `make test` lists that file at the end), unless `IDEM_REQUIRE_BACKENDS=1`
//! (CI), which turns the skip into a failure.

use crate::BoxError;
use std::time::Duration;

pub fn redis_url() -> String {
    std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

pub fn postgres_url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

pub fn mysql_url() -> String {
    std::env::var("IDEM_TEST_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

pub fn required() -> bool {
    std::env::var("IDEM_REQUIRE_BACKENDS").is_ok_and(|v| v == "1")
}

/// `host:port` of a URL (`scheme://[user@]host[:port][/…]`), with the scheme's default port.
pub fn address_of(url: &str) -> Option<String> {
    let Some((scheme, rest)) = url.split_once("://") else {
        // Already an address.
        return url
            .rsplit_once(':')
            .filter(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
            .map(|_| url.to_string());
    };
    let authority = rest.split(['/', '?']).next()?;
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if host_port.is_empty() {
        return None;
    }
    if host_port.rsplit_once(':').is_some_and(|(_, p)| p.bytes().all(|b| b.is_ascii_digit()) && !p.is_empty()) {
        return Some(host_port.to_string());
    }
    let port = match scheme {
        "redis" => 6379,
        "postgres" | "postgresql" => 5432,
        "mysql" | "mariadb" => 3306,
        _ => return None,
    };
    Some(format!("{host_port}:{port}"))
}

/// Whether something listens where `url` points (one second at most).
pub fn reachable(url: &str) -> bool {
    use std::net::ToSocketAddrs;
    address_of(url).and_then(|a| a.to_socket_addrs().ok()).is_some_and(|mut addrs| {
        addrs.any(|a| std::net::TcpStream::connect_timeout(&a, Duration::from_secs(1)).is_ok())
    })
}

/// Ok(true): reachable. Ok(false): skipped loudly. Err: required (CI) but missing.
pub fn available(name: &str, url: &str) -> Result<bool, BoxError> {
    if reachable(url) {
        return Ok(true);
    }
    let why = format!("nothing listens at {}", address_of(url).unwrap_or_else(|| url.to_string()));
    if required() {
        return Err(format!("backend {name} is required (IDEM_REQUIRE_BACKENDS=1) but unreachable: {why}").into());
    }
    skip(name, &why);
    Ok(false)
}

/// Say loudly that a backend is missing (the caller then returns early).
/// Panics when `IDEM_REQUIRE_BACKENDS=1`: in CI a skip is a failure.
pub fn skip(backend: &str, why: &str) {
    eprintln!("\n==================================================================");
    eprintln!("SKIPPED BACKEND {backend}: {why}");
    eprintln!("==================================================================\n");
    if let Some(path) = std::env::var_os("IDEM_SKIP_LOG") {
        use std::io::Write as _;
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
            let suite = std::env::var("CARGO_PKG_NAME").unwrap_or_default();
            let _ = writeln!(f, "{suite}: {backend}: {why}");
        }
    }
    assert!(!required(), "IDEM_REQUIRE_BACKENDS=1 but backend {backend} is unreachable: {why}");
}

/// A Postgres database of one test's own, dropped with it (tests that work on
/// whole tables, like the reconciler's, must not share one). Created with
/// `psql` on the configured server. Ok(None): skipped loudly.
pub struct OwnPostgres {
    pub url: String,
    admin_url: String,
    name: String,
}

pub fn own_postgres(prefix: &str) -> Result<Option<OwnPostgres>, BoxError> {
    let admin_url = postgres_url();
    if !available("postgres", &admin_url)? {
        return Ok(None);
    }
    let mut random = [0u8; 6];
    std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut random))?;
    let name = format!("{prefix}_{}", random.iter().map(|b| format!("{b:02x}")).collect::<String>());
    if let Err(e) = psql(&admin_url, &format!("CREATE DATABASE {name}")) {
        if required() {
            return Err(e);
        }
        skip("postgres (own database)", &e.to_string());
        return Ok(None);
    }
    Ok(Some(OwnPostgres { url: with_database(&admin_url, &name), admin_url, name }))
}

/// The same server URL with another database name.
pub fn with_database(url: &str, name: &str) -> String {
    let path_start = url.find("://").map(|s| s + 3).and_then(|s| url[s..].find('/').map(|p| s + p));
    match path_start {
        Some(i) => {
            let query = url[i..].find('?').map(|q| &url[i + q..]).unwrap_or("");
            format!("{}/{name}{query}", &url[..i])
        }
        None => format!("{url}/{name}"),
    }
}

fn psql(url: &str, sql: &str) -> Result<(), BoxError> {
    let out = std::process::Command::new("psql")
        .arg(url)
        .args(["-v", "ON_ERROR_STOP=1", "-qAtc", sql])
        .output()
        .map_err(|e| format!("cannot run psql: {e}"))?;
    if !out.status.success() {
        return Err(format!("psql {sql:?}: {}", String::from_utf8_lossy(&out.stderr).trim()).into());
    }
    Ok(())
}

impl Drop for OwnPostgres {
    fn drop(&mut self) {
        let _ = psql(&self.admin_url, &format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_come_from_the_urls() {
        assert_eq!(address_of("redis://127.0.0.1:6390").as_deref(), Some("127.0.0.1:6390"));
        assert_eq!(address_of("redis://10.0.0.5").as_deref(), Some("10.0.0.5:6379"));
        assert_eq!(address_of("postgres://postgres@db.local/test?sslmode=disable").as_deref(), Some("db.local:5432"));
        assert_eq!(address_of("mysql://root:pw@127.0.0.1:3307/test").as_deref(), Some("127.0.0.1:3307"));
        assert_eq!(address_of("sqlite://x.db"), None);
        assert_eq!(with_database("postgres://u@h:5432/test?x=1", "own"), "postgres://u@h:5432/own?x=1");
        assert_eq!(with_database("postgres://u@h:5432", "own"), "postgres://u@h:5432/own");
    }

    #[test]
    fn nothing_listens_on_a_closed_port() {
        let port =
            std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(1);
        assert!(!reachable(&format!("redis://127.0.0.1:{port}")));
    }
}
