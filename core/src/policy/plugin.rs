//! The plugin configuration: where idemd is, the HMAC keys, where the subject comes from, the
//! defaults every route starts from, the replay cache and the route rules.

use super::error::Error;
use super::route::{RouteDefaults, FINGERPRINT_TTL_S, LEASE_MS, POLL_AFTER_MS, RETRY_AFTER_MS};
use super::rules::{self, RouteRules};
use crate::fingerprint::{Key, Keyring, MIN_SECRET_LEN};
use crate::strict_json;
use serde_json::{Map, Value};
use std::fmt;
use std::ops::RangeInclusive;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Language {
    En,
    Zh,
}

/// Where the caller's identity comes from. It must be something the gateway
/// establishes (a header `jwt_authn` sets, or its dynamic metadata), never a
/// value the agent chooses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubjectSource {
    /// Lowercased header name.
    Header(String),
    /// An Envoy property path.
    Property(Vec<String>),
}

pub const SIDECAR_TIMEOUT_MS: RangeInclusive<u64> = 1..=60_000;
pub const BODY_BYTES: RangeInclusive<u64> = 1..=16 * 1024 * 1024;
/// Far above any real configuration; keeps a runaway file from being parsed.
const MAX_CONFIG_BYTES: usize = 1024 * 1024;

/// The cache's shape, from the plugin configuration (`replay_cache`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheConfig {
    /// 0 turns the cache off.
    pub slots: u32,
    pub entry_bytes: usize,
    pub ttl_s: u64,
}

impl Default for CacheConfig {
    /// 1024 slots of at most 4 KiB: at most 4 MiB per Envoy process.
    fn default() -> Self {
        CacheConfig { slots: 1024, entry_bytes: 4096, ttl_s: 3600 }
    }
}

#[derive(Debug, Clone)]
pub struct PluginConfig {
    pub sidecar_cluster: String,
    pub sidecar_authority: String,
    pub sidecar_timeout_ms: u64,
    pub keyring: Keyring,
    pub subject: SubjectSource,
    pub language: Language,
    pub max_body_bytes: usize,
    /// The held upstream answer that is recorded for replay.
    pub max_response_bytes: usize,
    pub defaults: RouteDefaults,
    /// The credential every callout to idemd carries (`authorization: Bearer …`);
    /// `None` only for an idemd started with `--insecure-no-auth`.
    pub sidecar_token: Option<Secret>,
    /// Guarded routes named in the configuration (for routes without metadata).
    pub routes: RouteRules,
    /// Terminal results served from Envoy's shared data (`replay_cache`).
    pub replay_cache: CacheConfig,
}

/// A secret that never appears in `Debug` output or logs.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// idemd's tokens: long enough that guessing is hopeless, and printable
/// ASCII so they travel in a header unchanged.
pub const MIN_TOKEN_LEN: usize = 16;

fn err<T>(msg: impl Into<String>) -> Result<T, Error> {
    Err(Error(msg.into()))
}

const TOP_FIELDS: &[&str] = &[
    "sidecar_cluster",
    "sidecar_authority",
    "sidecar_timeout_ms",
    "keys",
    "active_kid",
    "subject",
    "language",
    "max_body_bytes",
    "max_response_bytes",
    "defaults",
    "sidecar_token",
    "routes",
    "replay_cache",
];
const TOKEN_FIELDS: &[&str] = &["secret", "secret_env"];
const KEY_FIELDS: &[&str] = &["kid", "secret", "secret_env"];
const SUBJECT_FIELDS: &[&str] = &["header", "property"];
const DEFAULT_FIELDS: &[&str] = &["fingerprint_ttl_s", "lease_ms", "poll_after_ms", "retry_after_ms"];

/// `env` resolves `secret_env` names (the glue passes `std::env::var`).
pub fn parse_plugin_config(json: &[u8], env: &dyn Fn(&str) -> Option<String>) -> Result<PluginConfig, Error> {
    if json.iter().all(u8::is_ascii_whitespace) {
        return err("configuration: empty (at least sidecar_cluster, keys, active_kid and subject are required)");
    }
    if json.len() > MAX_CONFIG_BYTES {
        return err(format!("configuration: larger than {MAX_CONFIG_BYTES} bytes"));
    }
    let root = strict_json::from_slice(json).map_err(|e| Error(format!("configuration: not valid JSON: {e}")))?;
    let top = Obj::new(&root, "configuration".into())?;
    top.only(TOP_FIELDS)?;

    let sidecar_cluster = top.string("sidecar_cluster")?.ok_or_else(|| top.missing("sidecar_cluster"))?;
    let sidecar_authority = top.string("sidecar_authority")?.unwrap_or_else(|| "idemd".into());
    let sidecar_timeout_ms = top.int("sidecar_timeout_ms", SIDECAR_TIMEOUT_MS)?.unwrap_or(2_000);
    let keyring = parse_keys(&top, env)?;
    let subject = parse_subject(&top)?;
    let language = match top.string("language")?.as_deref() {
        None | Some("en") => Language::En,
        Some("zh") => Language::Zh,
        Some(other) => return err(format!("language: {other:?} is not supported (expected \"en\" or \"zh\")")),
    };
    let max_body_bytes = top.int("max_body_bytes", BODY_BYTES)?.unwrap_or(65_536);
    let max_response_bytes = top.int("max_response_bytes", BODY_BYTES)?.unwrap_or(1_048_576);
    let defaults = parse_defaults(&top)?;
    let sidecar_token = parse_token(&top, env)?;
    let replay_cache = parse_replay_cache(&top)?;
    let routes = match top.get("routes") {
        Some(v) => rules::parse_rules(v, &defaults)?,
        None => RouteRules::default(),
    };

    Ok(PluginConfig {
        sidecar_cluster,
        sidecar_authority,
        sidecar_timeout_ms,
        keyring,
        subject,
        language,
        // Bounded by BODY_BYTES (16 MiB), so this fits every usize.
        max_body_bytes: usize::try_from(max_body_bytes).unwrap_or(usize::MAX),
        max_response_bytes: usize::try_from(max_response_bytes).unwrap_or(usize::MAX),
        defaults,
        sidecar_token,
        routes,
        replay_cache,
    })
}

/// `{"slots": 1024, "entry_bytes": 4096, "ttl_s": 3600}`; `slots: 0` turns it off.
/// `ttl_s` must not exceed idemd's terminal retention (a cached replay of a
/// reaped row would outlive it).
fn parse_replay_cache(top: &Obj) -> Result<CacheConfig, Error> {
    let base = CacheConfig::default();
    let Some(value) = top.get("replay_cache") else { return Ok(base) };
    let c = Obj::new(value, "replay_cache".into())?;
    c.only(&["slots", "entry_bytes", "ttl_s"])?;
    Ok(CacheConfig {
        slots: u32::try_from(c.int("slots", 0..=65_536)?.unwrap_or(u64::from(base.slots))).unwrap_or(base.slots),
        entry_bytes: usize::try_from(c.int("entry_bytes", 256..=1_048_576)?.unwrap_or(base.entry_bytes as u64))
            .unwrap_or(base.entry_bytes),
        ttl_s: c.int("ttl_s", 1..=2_592_000)?.unwrap_or(base.ttl_s),
    })
}

fn parse_token(top: &Obj, env: &dyn Fn(&str) -> Option<String>) -> Result<Option<Secret>, Error> {
    let Some(value) = top.get("sidecar_token") else { return Ok(None) };
    let t = Obj::new(value, "sidecar_token".into())?;
    t.only(TOKEN_FIELDS)?;
    let token = match (t.string("secret")?, t.string("secret_env")?) {
        (Some(inline), None) => inline,
        (None, Some(var)) => env(&var).filter(|v| !v.is_empty()).ok_or_else(|| {
            Error(format!("sidecar_token.secret_env: environment variable {var} is not set or empty"))
        })?,
        _ => return err("sidecar_token: exactly one of \"secret\" or \"secret_env\" is required"),
    };
    if token.len() < MIN_TOKEN_LEN || !token.bytes().all(|b| b.is_ascii_graphic()) {
        return err(format!(
            "sidecar_token: expected at least {MIN_TOKEN_LEN} printable ASCII characters without spaces"
        ));
    }
    Ok(Some(Secret(token)))
}

fn parse_keys(top: &Obj, env: &dyn Fn(&str) -> Option<String>) -> Result<Keyring, Error> {
    let items = match top.get("keys") {
        None => return Err(top.missing("keys")),
        Some(Value::Array(items)) if !items.is_empty() => items,
        Some(_) => return err("keys: expected a non-empty array of {\"kid\", \"secret\" | \"secret_env\"}"),
    };
    let mut keys = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let key = Obj::new(item, format!("keys[{i}]"))?;
        key.only(KEY_FIELDS)?;
        let kid = key.string("kid")?.ok_or_else(|| key.missing("kid"))?;
        let secret = match (key.string("secret")?, key.string("secret_env")?) {
            (Some(inline), None) => {
                if inline.len() < MIN_SECRET_LEN {
                    return err(format!("keys[{i}].secret: shorter than {MIN_SECRET_LEN} bytes"));
                }
                inline.into_bytes()
            }
            (None, Some(var)) => {
                let value = env(&var).filter(|v| !v.is_empty()).ok_or_else(|| {
                    Error(format!("keys[{i}].secret_env: environment variable {var} is not set or empty"))
                })?;
                if value.len() < MIN_SECRET_LEN {
                    return err(format!(
                        "keys[{i}].secret_env: environment variable {var} holds fewer than {MIN_SECRET_LEN} bytes"
                    ));
                }
                value.into_bytes()
            }
            _ => return err(format!("keys[{i}]: exactly one of \"secret\" or \"secret_env\" is required")),
        };
        keys.push(Key { kid, secret });
    }
    let active = top.string("active_kid")?.ok_or_else(|| top.missing("active_kid"))?;
    Keyring::new(keys, &active).map_err(Error)
}

fn parse_subject(top: &Obj) -> Result<SubjectSource, Error> {
    let Some(value) = top.get("subject") else { return Err(top.missing("subject")) };
    let subject = Obj::new(value, "subject".into())?;
    subject.only(SUBJECT_FIELDS)?;
    match (subject.get("header"), subject.get("property")) {
        (Some(_), None) => {
            let name = subject.string("header")?.unwrap_or_default().to_ascii_lowercase();
            if name.is_empty() || !name.bytes().all(is_header_char) {
                return err(format!("subject.header: {name:?} is not a valid HTTP header name"));
            }
            Ok(SubjectSource::Header(name))
        }
        (None, Some(Value::Array(parts))) if !parts.is_empty() && parts.len() <= 16 => {
            let mut path = Vec::with_capacity(parts.len());
            for (i, part) in parts.iter().enumerate() {
                match part {
                    Value::String(s) if !s.is_empty() => path.push(s.clone()),
                    _ => return err(format!("subject.property[{i}]: expected a non-empty string")),
                }
            }
            Ok(SubjectSource::Property(path))
        }
        (None, Some(_)) => err("subject.property: expected an array of 1 to 16 strings (an Envoy property path)"),
        _ => err("subject: exactly one of \"header\" or \"property\" is required"),
    }
}

/// RFC 9110 `tchar`; pseudo-headers (`:path`) are not an identity source.
fn is_header_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn parse_defaults(top: &Obj) -> Result<RouteDefaults, Error> {
    let base = RouteDefaults::default();
    let Some(value) = top.get("defaults") else { return Ok(base) };
    let d = Obj::new(value, "defaults".into())?;
    d.only(DEFAULT_FIELDS)?;
    Ok(RouteDefaults {
        fingerprint_ttl_s: d.int("fingerprint_ttl_s", FINGERPRINT_TTL_S)?.unwrap_or(base.fingerprint_ttl_s),
        lease_ms: d.int("lease_ms", LEASE_MS)?.unwrap_or(base.lease_ms),
        poll_after_ms: d.int("poll_after_ms", POLL_AFTER_MS)?.unwrap_or(base.poll_after_ms),
        retry_after_ms: d.int("retry_after_ms", RETRY_AFTER_MS)?.unwrap_or(base.retry_after_ms),
    })
}

/// A JSON object plus its path, so every message can say where it points.
struct Obj<'a> {
    map: &'a Map<String, Value>,
    path: String,
}

impl<'a> Obj<'a> {
    fn new(value: &'a Value, path: String) -> Result<Obj<'a>, Error> {
        match value {
            Value::Object(map) => Ok(Obj { map, path }),
            _ => err(format!("{path}: expected a JSON object")),
        }
    }

    fn field(&self, name: &str) -> String {
        if self.path == "configuration" {
            name.to_string()
        } else {
            format!("{}.{name}", self.path)
        }
    }

    fn missing(&self, name: &str) -> Error {
        Error(format!("{}: required", self.field(name)))
    }

    fn only(&self, allowed: &[&str]) -> Result<(), Error> {
        match self.map.keys().find(|k| !allowed.contains(&k.as_str())) {
            Some(unknown) => {
                err(format!("{}: unknown field (expected one of: {})", self.field(unknown), allowed.join(", ")))
            }
            None => Ok(()),
        }
    }

    fn get(&self, name: &str) -> Option<&'a Value> {
        self.map.get(name)
    }

    /// `None` when absent; an empty string is an error, not "absent".
    fn string(&self, name: &str) -> Result<Option<String>, Error> {
        match self.map.get(name) {
            None => Ok(None),
            Some(Value::String(s)) if !s.is_empty() => Ok(Some(s.clone())),
            Some(_) => err(format!("{}: expected a non-empty string", self.field(name))),
        }
    }

    fn int(&self, name: &str, range: RangeInclusive<u64>) -> Result<Option<u64>, Error> {
        let Some(value) = self.map.get(name) else { return Ok(None) };
        match value.as_u64() {
            Some(n) if range.contains(&n) => Ok(Some(n)),
            _ => err(format!(
                "{}: expected an integer from {} to {}, got {value}",
                self.field(name),
                range.start(),
                range.end()
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "0123456789abcdef0123456789abcdef";

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn config(extra: &str) -> String {
        format!(
            r#"{{"sidecar_cluster":"idem_sidecar","keys":[{{"kid":"k1","secret":"{SECRET}"}}],"active_kid":"k1","subject":{{"header":"X-Agent-Subject"}}{extra}}}"#
        )
    }

    fn parse(text: &str) -> Result<PluginConfig, Error> {
        parse_plugin_config(text.as_bytes(), &no_env)
    }

    fn error_of(text: &str) -> String {
        match parse(text) {
            Ok(_) => String::from("<accepted>"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn minimal_config_gets_defaults() -> Result<(), Error> {
        let c = parse(&config(""))?;
        assert_eq!(c.sidecar_cluster, "idem_sidecar");
        assert_eq!(c.sidecar_authority, "idemd");
        assert_eq!(c.sidecar_timeout_ms, 2000);
        assert_eq!(c.subject, SubjectSource::Header("x-agent-subject".into()));
        assert_eq!(c.language, Language::En);
        assert_eq!(c.max_body_bytes, 65536);
        assert_eq!(c.max_response_bytes, 1_048_576);
        assert_eq!(c.defaults, RouteDefaults::default());
        assert_eq!(c.keyring.active_kid(), "k1");
        Ok(())
    }

    #[test]
    fn full_config() -> Result<(), Error> {
        let text = format!(
            r#"{{"sidecar_cluster":"c","sidecar_authority":"idemd.internal","sidecar_timeout_ms":500,
            "keys":[{{"kid":"k1","secret":"{SECRET}"}},{{"kid":"k0","secret_env":"IDEM_HMAC_K0"}}],
            "active_kid":"k0",
            "subject":{{"property":["metadata","filter_metadata","envoy.filters.http.jwt_authn","jwt_payload","sub"]}},
            "language":"zh","max_body_bytes":1024,"max_response_bytes":2048,
            "defaults":{{"fingerprint_ttl_s":600,"lease_ms":120000,"poll_after_ms":500,"retry_after_ms":1500}}}}"#
        );
        let env = |name: &str| (name == "IDEM_HMAC_K0").then(|| "k0-secret-from-the-environment-xyz".to_string());
        let c = parse_plugin_config(text.as_bytes(), &env)?;
        assert_eq!(c.keyring.active_kid(), "k0");
        assert_eq!(c.language, Language::Zh);
        assert_eq!(c.sidecar_timeout_ms, 500);
        assert_eq!((c.max_body_bytes, c.max_response_bytes), (1024, 2048));
        assert_eq!(
            c.defaults,
            RouteDefaults { fingerprint_ttl_s: 600, lease_ms: 120_000, poll_after_ms: 500, retry_after_ms: 1500 }
        );
        assert!(matches!(c.subject, SubjectSource::Property(ref p) if p.len() == 5 && p[4] == "sub"));
        assert!(!format!("{c:?}").contains(SECRET));
        Ok(())
    }

    #[test]
    fn errors_name_the_field() {
        let short = r#"{"sidecar_cluster":"c","keys":[{"kid":"k1","secret":"0123456789abcdef0123456789abcdef"},{"kid":"k2","secret":"short"}],"active_kid":"k1","subject":{"header":"x"}}"#;
        let cases: Vec<(String, &str)> = vec![
            (short.to_string(), "keys[1].secret: shorter than 32 bytes"),
            (config(r#","sidcar_timeout_ms":5"#), "sidcar_timeout_ms: unknown field"),
            (config(r#","defaults":{"lease":5}"#), "defaults.lease: unknown field"),
            (config(r#","sidecar_timeout_ms":0"#), "sidecar_timeout_ms: expected an integer from 1 to 60000"),
            (config(r#","sidecar_timeout_ms":"2000""#), "sidecar_timeout_ms: expected an integer"),
            (config(r#","max_body_bytes":16777217"#), "max_body_bytes: expected an integer from 1 to 16777216"),
            (config(r#","max_response_bytes":1.5"#), "max_response_bytes: expected an integer"),
            (config(r#","language":"fr""#), "language: \"fr\" is not supported"),
            (
                config(r#","defaults":{"fingerprint_ttl_s":86401}"#),
                "defaults.fingerprint_ttl_s: expected an integer from 1 to 86400",
            ),
            (config(r#","defaults":{"lease_ms":10}"#), "defaults.lease_ms: expected an integer from 1000"),
            (config(r#","sidecar_authority":"""#), "sidecar_authority: expected a non-empty string"),
            (config(r#","sidecar_cluster":"x""#), "configuration: not valid JSON: duplicate key"),
            ("".into(), "configuration: empty"),
            ("[]".into(), "configuration: expected a JSON object"),
            ("{".into(), "configuration: not valid JSON"),
            (r#"{"keys":[]}"#.into(), "sidecar_cluster: required"),
            (r#"{"sidecar_cluster":"c"}"#.into(), "keys: required"),
            (r#"{"sidecar_cluster":"c","keys":[]}"#.into(), "keys: expected a non-empty array"),
            (r#"{"sidecar_cluster":"c","keys":[{"kid":"k1"}]}"#.into(), "keys[0]: exactly one of"),
            (
                format!(r#"{{"sidecar_cluster":"c","keys":[{{"kid":"k1","secret":"{SECRET}","secret_env":"X"}}]}}"#),
                "keys[0]: exactly one of",
            ),
            (
                r#"{"sidecar_cluster":"c","keys":[{"kid":"k1","secret_env":"IDEM_K"}]}"#.into(),
                "keys[0].secret_env: environment variable IDEM_K is not set",
            ),
            (r#"{"sidecar_cluster":"c","keys":[{"secret":"x"}]}"#.into(), "keys[0].kid: required"),
            (r#"{"sidecar_cluster":"c","keys":[{"kid":"k","secret":"x","id":1}]}"#.into(), "keys[0].id: unknown field"),
            (
                format!(r#"{{"sidecar_cluster":"c","keys":[{{"kid":"k 1","secret":"{SECRET}"}}],"active_kid":"k"}}"#),
                "keys[0].kid: may only contain",
            ),
            (
                format!(r#"{{"sidecar_cluster":"c","keys":[{{"kid":"k1","secret":"{SECRET}"}}]}}"#),
                "active_kid: required",
            ),
            (
                format!(r#"{{"sidecar_cluster":"c","keys":[{{"kid":"k1","secret":"{SECRET}"}}],"active_kid":"k2"}}"#),
                "active_kid: \"k2\" is not one of",
            ),
            (
                format!(r#"{{"sidecar_cluster":"c","keys":[{{"kid":"k1","secret":"{SECRET}"}}],"active_kid":"k1"}}"#),
                "subject: required",
            ),
        ];
        for (text, want) in cases {
            let got = error_of(&text);
            assert!(got.starts_with(want), "want {want:?}, got {got:?}");
        }
    }

    #[test]
    fn subject_errors() {
        let with = |subject: &str| {
            format!(
                r#"{{"sidecar_cluster":"c","keys":[{{"kid":"k1","secret":"{SECRET}"}}],"active_kid":"k1","subject":{subject}}}"#
            )
        };
        let cases = [
            (r#"{}"#, "subject: exactly one of"),
            (r#"{"header":"a","property":["b"]}"#, "subject: exactly one of"),
            (r#"{"header":"x agent"}"#, "subject.header: \"x agent\" is not a valid"),
            (r#"{"header":":path"}"#, "subject.header:"),
            (r#"{"header":""}"#, "subject.header: expected a non-empty string"),
            (r#"{"property":[]}"#, "subject.property: expected an array"),
            (r#"{"property":["a",""]}"#, "subject.property[1]: expected a non-empty string"),
            (r#"{"cookie":"a"}"#, "subject.cookie: unknown field"),
            (r#""x-agent""#, "subject: expected a JSON object"),
        ];
        for (subject, want) in cases {
            let got = error_of(&with(subject));
            assert!(got.starts_with(want), "want {want:?}, got {got:?}");
        }
    }

    #[test]
    fn env_secret_too_short_names_the_variable() {
        let text = r#"{"sidecar_cluster":"c","keys":[{"kid":"k1","secret_env":"K1"}],"active_kid":"k1","subject":{"header":"x"}}"#;
        let env = |_: &str| Some("short".to_string());
        let got = parse_plugin_config(text.as_bytes(), &env).map(|_| ());
        assert_eq!(got, Err(Error("keys[0].secret_env: environment variable K1 holds fewer than 32 bytes".into())));
    }

    #[test]
    fn sidecar_token_from_config_or_environment() -> Result<(), Error> {
        assert_eq!(parse(&config(""))?.sidecar_token, None);
        let inline = parse(&config(r#","sidecar_token":{"secret":"0123456789abcdefXYZ"}"#))?;
        assert_eq!(inline.sidecar_token.as_ref().map(Secret::expose), Some("0123456789abcdefXYZ"));
        assert!(!format!("{inline:?}").contains("0123456789abcdefXYZ"));
        let env = |name: &str| (name == "TOK").then(|| "from-the-environment-0001".to_string());
        let text = config(r#","sidecar_token":{"secret_env":"TOK"}"#);
        let from_env = parse_plugin_config(text.as_bytes(), &env)?;
        assert_eq!(from_env.sidecar_token.as_ref().map(Secret::expose), Some("from-the-environment-0001"));
        for (extra, want) in [
            (r#","sidecar_token":{"secret":"short"}"#, "sidecar_token: expected at least 16"),
            (r#","sidecar_token":{"secret":"has a space in it, long"}"#, "sidecar_token: expected at least 16"),
            (r#","sidecar_token":{"secret_env":"NOPE"}"#, "sidecar_token.secret_env: environment variable NOPE"),
            (r#","sidecar_token":{}"#, "sidecar_token: exactly one of"),
            (r#","sidecar_token":{"token":"x"}"#, "sidecar_token.token: unknown field"),
        ] {
            let got = error_of(&config(extra));
            assert!(got.starts_with(want), "{extra}: {got}");
        }
        Ok(())
    }
}
