//! Plugin configuration and route annotations (DESIGN §5, §6).
//!
//! Both are validated completely when loaded: a typo in a field name or a TTL
//! out of range must refuse the configuration, never fall back to a default
//! that quietly weakens idempotency. Every message names the field.

use crate::canonical::{BoundField, FieldType};
use crate::fingerprint::{Key, Keyring, MIN_SECRET_LEN};
use crate::json_text::is_json_pointer;
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteDefaults {
    pub fingerprint_ttl_s: u64,
    pub lease_ms: u64,
    pub poll_after_ms: u64,
    pub retry_after_ms: u64,
}

impl Default for RouteDefaults {
    fn default() -> Self {
        RouteDefaults { fingerprint_ttl_s: 900, lease_ms: 60_000, poll_after_ms: 2_000, retry_after_ms: 1_000 }
    }
}

/// A day at most: a preview older than that quotes a price nobody honours.
pub const FINGERPRINT_TTL_S: RangeInclusive<u64> = 1..=86_400;
/// The lease must outlast the upstream's worst case plus the gateway timeout
/// plus retry backoff (DESIGN §5); below a second it cannot, for any upstream.
pub const LEASE_MS: RangeInclusive<u64> = 1_000..=86_400_000;
pub const POLL_AFTER_MS: RangeInclusive<u64> = 1..=3_600_000;
pub const RETRY_AFTER_MS: RangeInclusive<u64> = 1..=3_600_000;
pub const SIDECAR_TIMEOUT_MS: RangeInclusive<u64> = 1..=60_000;
pub const BODY_BYTES: RangeInclusive<u64> = 1..=16 * 1024 * 1024;
/// Far above any real configuration; keeps a runaway file from being parsed.
const MAX_CONFIG_BYTES: usize = 1024 * 1024;

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
    pub routes: crate::route_rules::RouteRules,
    /// Terminal results served from Envoy's shared data (`replay_cache`).
    pub replay_cache: crate::machine::replay_cache::CacheConfig,
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

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

fn err<T>(msg: impl Into<String>) -> Result<T, ConfigError> {
    Err(ConfigError(msg.into()))
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
pub fn parse_plugin_config(json: &[u8], env: &dyn Fn(&str) -> Option<String>) -> Result<PluginConfig, ConfigError> {
    if json.iter().all(u8::is_ascii_whitespace) {
        return err("configuration: empty (at least sidecar_cluster, keys, active_kid and subject are required)");
    }
    if json.len() > MAX_CONFIG_BYTES {
        return err(format!("configuration: larger than {MAX_CONFIG_BYTES} bytes"));
    }
    let root = strict_json::from_slice(json).map_err(|e| ConfigError(format!("configuration: not valid JSON: {e}")))?;
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
        Some(v) => crate::route_rules::parse_rules(v, &defaults).map_err(|e| ConfigError(e.0))?,
        None => crate::route_rules::RouteRules::default(),
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
fn parse_replay_cache(top: &Obj) -> Result<crate::machine::replay_cache::CacheConfig, ConfigError> {
    let base = crate::machine::replay_cache::CacheConfig::default();
    let Some(value) = top.get("replay_cache") else { return Ok(base) };
    let c = Obj::new(value, "replay_cache".into())?;
    c.only(&["slots", "entry_bytes", "ttl_s"])?;
    Ok(crate::machine::replay_cache::CacheConfig {
        slots: u32::try_from(c.int("slots", 0..=65_536)?.unwrap_or(u64::from(base.slots))).unwrap_or(base.slots),
        entry_bytes: usize::try_from(c.int("entry_bytes", 256..=1_048_576)?.unwrap_or(base.entry_bytes as u64))
            .unwrap_or(base.entry_bytes),
        ttl_s: c.int("ttl_s", 1..=2_592_000)?.unwrap_or(base.ttl_s),
    })
}

fn parse_token(top: &Obj, env: &dyn Fn(&str) -> Option<String>) -> Result<Option<Secret>, ConfigError> {
    let Some(value) = top.get("sidecar_token") else { return Ok(None) };
    let t = Obj::new(value, "sidecar_token".into())?;
    t.only(TOKEN_FIELDS)?;
    let token = match (t.string("secret")?, t.string("secret_env")?) {
        (Some(inline), None) => inline,
        (None, Some(var)) => env(&var).filter(|v| !v.is_empty()).ok_or_else(|| {
            ConfigError(format!("sidecar_token.secret_env: environment variable {var} is not set or empty"))
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

fn parse_keys(top: &Obj, env: &dyn Fn(&str) -> Option<String>) -> Result<Keyring, ConfigError> {
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
                    ConfigError(format!("keys[{i}].secret_env: environment variable {var} is not set or empty"))
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
    Keyring::new(keys, &active).map_err(ConfigError)
}

fn parse_subject(top: &Obj) -> Result<SubjectSource, ConfigError> {
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

fn parse_defaults(top: &Obj) -> Result<RouteDefaults, ConfigError> {
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
    fn new(value: &'a Value, path: String) -> Result<Obj<'a>, ConfigError> {
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

    fn missing(&self, name: &str) -> ConfigError {
        ConfigError(format!("{}: required", self.field(name)))
    }

    fn only(&self, allowed: &[&str]) -> Result<(), ConfigError> {
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
    fn string(&self, name: &str) -> Result<Option<String>, ConfigError> {
        match self.map.get(name) {
            None => Ok(None),
            Some(Value::String(s)) if !s.is_empty() => Ok(Some(s.clone())),
            Some(_) => err(format!("{}: expected a non-empty string", self.field(name))),
        }
    }

    fn int(&self, name: &str, range: RangeInclusive<u64>) -> Result<Option<u64>, ConfigError> {
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

// ---- route annotations -------------------------------------------------

pub const ROUTE_NAMESPACE: &str = "agent_idempotency";
/// Every annotation leaf a route may carry; any other refuses the route (a typo
/// must never quietly weaken a guard).
pub const ROUTE_KEYS: &[&str] = &[
    "role",
    "scope",
    "bind",
    "fingerprint_ttl_s",
    "lease_ms",
    "poll_after_ms",
    "status_tool",
    "result_ref",
    "outcomes",
    "replay",
    "client_keys",
    "callers",
    "protocol",
    "tools",
    "tool",
    "quote_expires",
    "upstream_keys",
    "business_ref",
];

const MAX_SCOPE_LEN: usize = 128;
const MAX_BOUND_FIELDS: usize = 64;
const MAX_POINTER_LEN: usize = 256;
const MAX_TOOL_NAME_LEN: usize = 128;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Preview,
    Confirm,
    Status,
    /// Client-key mode: the caller's own `Idempotency-Key` (IETF draft), no fingerprint.
    Idempotent,
    /// An MCP endpoint (Streamable HTTP): each listed tool has a role of its own.
    Mcp,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Preview => "preview",
            Role::Confirm => "confirm",
            Role::Status => "status",
            Role::Idempotent => "idempotent",
            Role::Mcp => "mcp",
        }
    }
}

/// Envoy hands string leaves as bytes and number leaves as doubles.
#[derive(Debug, Clone, PartialEq)]
pub enum LeafValue {
    Str(String),
    Num(f64),
}

/// Envoy's answer to `get_property` on a metadata struct (the route's whole
/// `agent_idempotency` annotation): proxy-wasm's pairs encoding — a little-endian
/// u32 count, then a (key length, value length) u32 pair per entry, then each key
/// and value followed by a NUL. String leaves are UTF-8, number leaves 8 bytes of
/// a double (see [`leaf_value`]). `None` if the bytes are not that shape.
pub fn decode_pairs(bytes: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
    let u32_at = |at: usize| -> Option<usize> {
        let b: [u8; 4] = bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
        usize::try_from(u32::from_le_bytes(b)).ok()
    };
    let count = u32_at(0)?;
    // Every entry costs at least 10 bytes: two lengths and two NULs.
    if count > bytes.len() / 10 + 1 {
        return None;
    }
    let mut sizes = Vec::with_capacity(count);
    let mut at = 4usize;
    for _ in 0..count {
        sizes.push((u32_at(at)?, u32_at(at.checked_add(4)?)?));
        at = at.checked_add(8)?;
    }
    let mut out = Vec::with_capacity(count);
    for (key_len, value_len) in sizes {
        let key = bytes.get(at..at.checked_add(key_len)?)?;
        at = at.checked_add(key_len)?;
        if bytes.get(at) != Some(&0) {
            return None;
        }
        at = at.checked_add(1)?;
        let value = bytes.get(at..at.checked_add(value_len)?)?;
        at = at.checked_add(value_len)?;
        if bytes.get(at) != Some(&0) {
            return None;
        }
        at = at.checked_add(1)?;
        out.push((String::from_utf8(key.to_vec()).ok()?, value.to_vec()));
    }
    (at == bytes.len()).then_some(out)
}

/// The pairs encoding of `entries` (the inverse of [`decode_pairs`]), for tests and tools.
pub fn encode_pairs(entries: &[(&str, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&u32::try_from(entries.len()).unwrap_or(u32::MAX).to_le_bytes());
    for (k, v) in entries {
        out.extend_from_slice(&u32::try_from(k.len()).unwrap_or(u32::MAX).to_le_bytes());
        out.extend_from_slice(&u32::try_from(v.len()).unwrap_or(u32::MAX).to_le_bytes());
    }
    for (k, v) in entries {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
    out
}

/// Decode one annotation leaf as Envoy returns it from `get_property`: a
/// string leaf as raw UTF-8, a number leaf as 8 bytes of a little-endian
/// double. The key tells which one to expect; anything else goes to the
/// parser as text, which rejects "15m" loudly.
/// Whether an annotation field holds a number (a TTL or a delay: `…_s`, `…_ms`).
pub fn is_numeric_key(key: &str) -> bool {
    key.ends_with("_s") || key.ends_with("_ms")
}

pub fn leaf_value(key: &str, raw: Vec<u8>) -> LeafValue {
    let numeric = is_numeric_key(key);
    if numeric && raw.len() == 8 && !raw.iter().all(u8::is_ascii_digit) {
        if let Ok(bytes) = <[u8; 8]>::try_from(raw.as_slice()) {
            return LeafValue::Num(f64::from_le_bytes(bytes));
        }
    }
    LeafValue::Str(String::from_utf8_lossy(&raw).into_owned())
}

/// How a confirm route answers a repeated call with a recorded result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayMode {
    /// The DESIGN §7 envelope for models: what happened, what to do next,
    /// the original body under `result`.
    Envelope,
    /// Stripe's convention for programs: the original status, recorded
    /// headers and body byte for byte, with `Idempotent-Replayed: true`.
    Original,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutePolicy {
    pub role: Role,
    pub scope: String,
    pub bound: Vec<BoundField>,
    pub fingerprint_ttl_s: u64,
    pub lease_ms: u64,
    pub poll_after_ms: u64,
    pub status_tool: Option<String>,
    pub result_ref: Option<String>,
    /// The route's readings of upstream statuses, e.g. `409:failed` (core::outcome).
    pub outcomes: Vec<(u16, crate::outcome::Outcome)>,
    pub replay: ReplayMode,
    /// Requests may name their operation with their own `Idempotency-Key`
    /// (client-key mode) instead of a fingerprint.
    pub client_keys: bool,
    /// Who reads this route's refusals: models (the DESIGN §7 envelope) or
    /// programs (RFC 9457 problem+json, 409 while in flight).
    pub callers: Callers,
    /// Role `mcp`: the guarded tools, by name (`tools/call` of any other passes through).
    pub tools: Vec<(String, std::rc::Rc<RoutePolicy>)>,
    /// `tool`: how agents see this action (`idemd tools` generates definitions from it).
    pub tool: Option<ToolSpec>,
    /// Preview: where the answer states its quote's own expiry; the fingerprint never outlives it.
    pub quote_expires: Option<QuoteExpiry>,
    /// Confirm: whether the upstream deduplicates by `Idempotency-Key`.
    pub upstream_keys: UpstreamKeys,
    /// Confirm: a bound field the upstream stores (a client reference), by which the reconciler
    /// can look the operation up where the upstream ignores keys.
    pub business_ref: Option<String>,
}

/// `quote_expires`: a JSON pointer into the preview's answer (`/expires_at`) or a response header
/// (`header:quote-expires-at`), holding unix seconds or an RFC 3339 time (DESIGN §3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QuoteExpiry {
    Pointer(String),
    Header(String),
}

impl QuoteExpiry {
    fn parse(text: &str) -> Result<QuoteExpiry, PolicyError> {
        if let Some(name) = text.strip_prefix("header:") {
            let name = name.trim().to_ascii_lowercase();
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b)) {
                return perr(format!("quote_expires: {text:?} does not name a header (header:quote-expires-at)"));
            }
            return Ok(QuoteExpiry::Header(name));
        }
        if !text.starts_with('/') || !is_json_pointer(text) || text.len() > MAX_POINTER_LEN {
            return perr(format!("quote_expires: {text:?} is neither a JSON pointer (/expires_at) nor header:NAME"));
        }
        Ok(QuoteExpiry::Pointer(text.to_string()))
    }

    /// The expiry a value states: unix seconds (a JSON number or digits) or an RFC 3339 time.
    pub fn read(value: &Value) -> Option<u64> {
        match value {
            Value::Number(n) => n.as_u64(),
            Value::String(s) if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) => s.parse().ok(),
            Value::String(s) => crate::utc::parse_rfc3339(s),
            _ => None,
        }
    }
}

/// The `tool` annotation: `{"name", "description", "parameters"}`, where
/// `parameters` is the JSON Schema (an object schema) of the arguments that are
/// not bound fields. Only checked here; the filter never uses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolSpec {
    pub name: Option<String>,
    pub description: Option<String>,
    pub parameters: Option<Value>,
}

fn parse_tool_spec(text: &str) -> Result<ToolSpec, PolicyError> {
    let Ok(Value::Object(map)) = strict_json::from_slice(text.as_bytes()) else {
        return perr("tool: expected a JSON object {\"name\", \"description\", \"parameters\"}");
    };
    if let Some(k) = map.keys().find(|k| !["name", "description", "parameters"].contains(&k.as_str())) {
        return perr(format!("tool.{k}: unknown field (expected name, description, parameters)"));
    }
    let text_field = |k: &str, max: usize| -> Result<Option<String>, PolicyError> {
        match map.get(k) {
            None => Ok(None),
            Some(Value::String(s)) if !s.is_empty() && s.len() <= max => Ok(Some(s.clone())),
            Some(_) => perr(format!("tool.{k}: expected a string of 1 to {max} characters")),
        }
    };
    let name = text_field("name", MAX_TOOL_NAME_LEN)?;
    if let Some(n) = &name {
        if !n.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-')) {
            return perr(format!("tool.name: {n:?} may use letters, digits, _ and - only"));
        }
    }
    let description = text_field("description", 4096)?;
    let parameters = match map.get("parameters") {
        None => None,
        Some(p @ Value::Object(o)) if o.get("type").and_then(Value::as_str).is_none_or(|t| t == "object") => {
            Some(p.clone())
        }
        Some(_) => return perr("tool.parameters: expected a JSON Schema object with \"type\": \"object\""),
    };
    Ok(ToolSpec { name, description, parameters })
}

impl RoutePolicy {
    pub fn tool(&self, name: &str) -> Option<&std::rc::Rc<RoutePolicy>> {
        self.tools.iter().find(|(n, _)| n == name).map(|(_, p)| p)
    }

    /// The names of an MCP route's listed tools.
    pub fn tool_names(&self) -> impl Iterator<Item = &str> {
        self.tools.iter().map(|(n, _)| n.as_str())
    }
}

/// Whether the route's upstream deduplicates by `Idempotency-Key` (DESIGN §4, "release needs
/// proof nothing ran").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UpstreamKeys {
    /// The default: a retry carries the same key to an upstream that keeps it, so an answer that
    /// says "not done" (429, 503) may release the operation.
    #[default]
    Honoured,
    /// The upstream ignores keys: a second request is a second execution. Only "Envoy never sent
    /// it" releases; everything else is left for the reconciler (by `business_ref`), else a person.
    Ignored,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Callers {
    Agents,
    Programs,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyError(pub String);

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PolicyError {}

fn perr<T>(msg: impl Into<String>) -> Result<T, PolicyError> {
    Err(PolicyError(msg.into()))
}

/// `Ok(None)` when there is no `role` leaf: the route is not ours.
pub fn parse_route_policy(
    get: &dyn Fn(&str) -> Option<LeafValue>,
    defaults: &RouteDefaults,
) -> Result<Option<RoutePolicy>, PolicyError> {
    let protocol = leaf_string(get, "protocol")?;
    let role = match (get("role"), protocol.as_deref()) {
        (_, Some("mcp")) => return parse_mcp(get, defaults).map(Some),
        (_, Some(other)) if other != "http" => return perr(format!("protocol: {other:?} is not one of http, mcp")),
        (None, _) => return Ok(None),
        (Some(role), _) => role,
    };
    let role = match role {
        LeafValue::Str(s) if s == "mcp" => return parse_mcp(get, defaults).map(Some),
        LeafValue::Str(s) => match s.as_str() {
            "preview" => Role::Preview,
            "confirm" => Role::Confirm,
            "status" => Role::Status,
            "idempotent" => Role::Idempotent,
            other => return perr(format!("role: {other:?} is not one of preview, confirm, status, idempotent, mcp")),
        },
        LeafValue::Num(_) => return perr("role: expected a string (preview, confirm, status, idempotent or mcp)"),
    };

    let scope = leaf_string(get, "scope")?.ok_or_else(|| PolicyError("scope: required".into()))?;
    if scope.len() > MAX_SCOPE_LEN
        || !scope.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'))
    {
        return perr(format!("scope: {scope:?} must be at most {MAX_SCOPE_LEN} characters of A-Z a-z 0-9 _ . : -"));
    }

    let bound = match leaf_string(get, "bind")? {
        Some(text) => parse_bind(&text)?,
        None => Vec::new(),
    };
    if bound.is_empty() && matches!(role, Role::Preview | Role::Confirm) {
        return perr(format!(
            "bind: required for role {}: list the JSON pointers of the fields that decide the outcome (amount, currency, payee)",
            role.as_str()
        ));
    }

    let status_tool = leaf_string(get, "status_tool")?;
    if let Some(tool) = &status_tool {
        if tool.len() > MAX_TOOL_NAME_LEN || tool.chars().any(char::is_control) {
            return perr(format!("status_tool: must be at most {MAX_TOOL_NAME_LEN} printable characters"));
        }
    }
    let result_ref = leaf_string(get, "result_ref")?;
    if let Some(pointer) = &result_ref {
        if !pointer.starts_with('/') || !is_json_pointer(pointer) || pointer.len() > MAX_POINTER_LEN {
            return perr(format!("result_ref: {pointer:?} is not a JSON pointer such as /transfer_id"));
        }
    }

    let outcomes = match leaf_string(get, "outcomes")? {
        Some(text) => crate::outcome::parse_overrides(&text).map_err(|e| PolicyError(format!("outcomes: {e}")))?,
        None => Vec::new(),
    };
    let replay = match leaf_string(get, "replay")?.as_deref() {
        None | Some("envelope") => ReplayMode::Envelope,
        Some("original") => ReplayMode::Original,
        Some(other) => return perr(format!("replay: {other:?} is not one of envelope, original")),
    };
    let client_keys = match leaf_string(get, "client_keys")?.as_deref() {
        None | Some("false") => role == Role::Idempotent,
        Some("true") if matches!(role, Role::Confirm | Role::Status | Role::Idempotent) => true,
        Some("true") => return perr(format!("client_keys: not for role {}", role.as_str())),
        Some(other) => return perr(format!("client_keys: {other:?} is not true or false")),
    };
    if role == Role::Idempotent && !client_keys {
        return perr("client_keys: role idempotent always takes the caller's Idempotency-Key");
    }
    let quote_expires = match leaf_string(get, "quote_expires")? {
        None => None,
        Some(_) if role != Role::Preview => {
            return perr(format!("quote_expires: only for role preview, not {}", role.as_str()))
        }
        Some(text) => Some(QuoteExpiry::parse(&text)?),
    };
    let tool = match leaf_string(get, "tool")? {
        Some(text) => Some(parse_tool_spec(&text)?),
        None => None,
    };
    let executes = matches!(role, Role::Confirm | Role::Idempotent);
    let upstream_keys = match leaf_string(get, "upstream_keys")?.as_deref() {
        None | Some("honoured") => UpstreamKeys::Honoured,
        Some("ignored") if executes => UpstreamKeys::Ignored,
        Some("ignored") => {
            return perr(format!("upstream_keys: only for the roles that execute, not {}", role.as_str()))
        }
        Some(other) => return perr(format!("upstream_keys: {other:?} is not one of honoured, ignored")),
    };
    if upstream_keys == UpstreamKeys::Ignored {
        if let Some((status, _)) = outcomes.iter().find(|(_, o)| *o == crate::outcome::Outcome::Release) {
            return perr(format!(
                "outcomes: {status}:release with upstream_keys ignored: an upstream that ignores Idempotency-Key \
                 cannot prove by its answer that nothing ran"
            ));
        }
    }
    let business_ref = leaf_string(get, "business_ref")?;
    if let Some(pointer) = &business_ref {
        if !executes {
            return perr(format!("business_ref: only for the roles that execute, not {}", role.as_str()));
        }
        // Bound, so the fingerprint proves the retry names the same reference (a whole-request
        // hash in client-key mode binds every field).
        let bound_here = bound.iter().any(|f| f.pointer == *pointer) || (role == Role::Idempotent && bound.is_empty());
        if !is_json_pointer(pointer) || !pointer.starts_with('/') || !bound_here {
            return perr(format!("business_ref: {pointer:?} must be one of the route's bound fields (bind)"));
        }
    }
    let callers = match leaf_string(get, "callers")?.as_deref() {
        None if role == Role::Idempotent => Callers::Programs,
        None => Callers::Agents,
        Some("agents") => Callers::Agents,
        Some("programs") => Callers::Programs,
        Some(other) => return perr(format!("callers: {other:?} is not one of agents, programs")),
    };

    Ok(Some(RoutePolicy {
        role,
        scope,
        bound,
        fingerprint_ttl_s: leaf_int(get, "fingerprint_ttl_s", FINGERPRINT_TTL_S)?.unwrap_or(defaults.fingerprint_ttl_s),
        lease_ms: leaf_int(get, "lease_ms", LEASE_MS)?.unwrap_or(defaults.lease_ms),
        poll_after_ms: leaf_int(get, "poll_after_ms", POLL_AFTER_MS)?.unwrap_or(defaults.poll_after_ms),
        status_tool,
        result_ref,
        outcomes,
        replay,
        client_keys,
        callers,
        tools: Vec::new(),
        tool,
        quote_expires,
        upstream_keys,
        business_ref,
    }))
}

/// `role: mcp` (or `protocol: mcp`): `tools` is a JSON object (a JSON string in
/// route metadata) from tool name to that tool's annotation, whose bound fields
/// point into `params.arguments`.
fn parse_mcp(get: &dyn Fn(&str) -> Option<LeafValue>, defaults: &RouteDefaults) -> Result<RoutePolicy, PolicyError> {
    if let Some(LeafValue::Str(role)) = get("role") {
        if role != "mcp" {
            return perr(format!("role: {role:?} with protocol mcp: the roles belong to the tools"));
        }
    }
    let text = leaf_string(get, "tools")?.ok_or_else(|| PolicyError("tools: required for an MCP route".into()))?;
    let table = match strict_json::from_slice(text.as_bytes()) {
        Ok(Value::Object(map)) if !map.is_empty() && map.len() <= MAX_TOOLS => map,
        Ok(_) => return perr(format!("tools: expected an object of 1 to {MAX_TOOLS} tools")),
        Err(e) => return perr(format!("tools: not valid JSON: {e}")),
    };
    let mut tools = Vec::with_capacity(table.len());
    for (name, spec) in &table {
        if name.is_empty() || name.len() > MAX_TOOL_NAME_LEN || name.chars().any(char::is_control) {
            return perr(format!("tools: {name:?} is not a tool name"));
        }
        let Value::Object(fields) = spec else { return perr(format!("tools.{name}: expected an object")) };
        if let Some(k) = fields.keys().find(|k| !is_tool_key(k)) {
            let allowed: Vec<&str> = ROUTE_KEYS.iter().copied().filter(|k| is_tool_key(k)).collect();
            return perr(format!("tools.{name}.{k}: unknown field (expected one of: {})", allowed.join(", ")));
        }
        let leaf = |k: &str| match fields.get(k)? {
            Value::String(s) => Some(LeafValue::Str(s.clone())),
            Value::Number(n) => n.as_f64().map(LeafValue::Num),
            other => Some(LeafValue::Str(other.to_string())),
        };
        let mut policy = match parse_route_policy(&leaf, defaults) {
            Ok(Some(p)) if matches!(p.role, Role::Preview | Role::Confirm | Role::Status) => p,
            Ok(Some(p)) => return perr(format!("tools.{name}.role: {} is not for a tool", p.role.as_str())),
            Ok(None) => return perr(format!("tools.{name}.role: required (preview, confirm or status)")),
            Err(PolicyError(e)) => return perr(format!("tools.{name}.{e}")),
        };
        // An MCP tool always has a name: `in_progress` without a status tool polls by calling it again.
        let spec = policy.tool.get_or_insert(ToolSpec { name: None, description: None, parameters: None });
        spec.name.get_or_insert_with(|| name.clone());
        tools.push((name.clone(), std::rc::Rc::new(policy)));
    }
    Ok(RoutePolicy {
        role: Role::Mcp,
        scope: String::new(),
        bound: Vec::new(),
        fingerprint_ttl_s: defaults.fingerprint_ttl_s,
        lease_ms: defaults.lease_ms,
        poll_after_ms: defaults.poll_after_ms,
        status_tool: None,
        result_ref: None,
        outcomes: Vec::new(),
        replay: ReplayMode::Envelope,
        client_keys: false,
        callers: Callers::Agents,
        tools,
        tool: None,
        quote_expires: None,
        upstream_keys: UpstreamKeys::Honoured,
        business_ref: None,
    })
}

const MAX_TOOLS: usize = 64;
/// A tool's annotation is a route annotation less these route-level fields.
const ROUTE_ONLY_KEYS: &[&str] = &["replay", "client_keys", "callers", "protocol", "tools"];

fn is_tool_key(k: &str) -> bool {
    ROUTE_KEYS.contains(&k) && !ROUTE_ONLY_KEYS.contains(&k)
}

/// `"/amount:decimal, /currency /payee_id"`: separated by commas and/or whitespace.
pub fn parse_bind(text: &str) -> Result<Vec<BoundField>, PolicyError> {
    let mut fields: Vec<BoundField> = Vec::new();
    for token in text.split(|c: char| c == ',' || c.is_whitespace()).filter(|t| !t.is_empty()) {
        let (pointer, ty) = match token.rsplit_once(':') {
            Some((p, suffix)) if p.starts_with('/') && !suffix.contains('/') => match FieldType::from_suffix(suffix) {
                Some(ty) => (p, ty),
                None => {
                    return perr(format!(
                        "bind: {token:?}: the suffix may be :decimal, :string, :integer, :number or :boolean"
                    ))
                }
            },
            _ => (token, FieldType::Any),
        };
        if !pointer.starts_with('/') || !is_json_pointer(pointer) {
            return perr(format!("bind: {token:?} is not a JSON pointer such as /amount"));
        }
        // A mistyped suffix would otherwise become a pointer to a field that is
        // never present, and an absent field is silently left unbound.
        if pointer.contains(':') {
            return perr(format!("bind: {token:?}: one type suffix at most (:decimal, :string, …)"));
        }
        if pointer.len() > MAX_POINTER_LEN {
            return perr(format!("bind: {token:?} is longer than {MAX_POINTER_LEN} characters"));
        }
        if fields.iter().any(|f| f.pointer == pointer) {
            return perr(format!("bind: {pointer:?} is listed twice"));
        }
        if fields.len() == MAX_BOUND_FIELDS {
            return perr(format!("bind: more than {MAX_BOUND_FIELDS} fields"));
        }
        fields.push(BoundField::typed(pointer, ty));
    }
    Ok(fields)
}

fn leaf_string(get: &dyn Fn(&str) -> Option<LeafValue>, key: &str) -> Result<Option<String>, PolicyError> {
    match get(key) {
        None => Ok(None),
        Some(LeafValue::Str(s)) if !s.trim().is_empty() => Ok(Some(s.trim().to_string())),
        Some(LeafValue::Str(_)) => perr(format!("{key}: empty")),
        Some(LeafValue::Num(n)) => perr(format!("{key}: expected a string, got the number {n}")),
    }
}

fn leaf_int(
    get: &dyn Fn(&str) -> Option<LeafValue>,
    key: &str,
    range: RangeInclusive<u64>,
) -> Result<Option<u64>, PolicyError> {
    let value = match get(key) {
        None => return Ok(None),
        // Every bound is far below 2^53, so an in-range double is exact.
        Some(LeafValue::Num(n)) if n.is_finite() && n.fract() == 0.0 && n >= 0.0 && n <= *range.end() as f64 => {
            Some(n as u64)
        }
        Some(LeafValue::Str(s)) if !s.is_empty() && s.len() <= 15 && s.bytes().all(|b| b.is_ascii_digit()) => {
            s.parse::<u64>().ok()
        }
        Some(_) => None,
    };
    match value {
        Some(n) if range.contains(&n) => Ok(Some(n)),
        _ => perr(format!("{key}: expected an integer from {} to {}", range.start(), range.end())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const SECRET: &str = "0123456789abcdef0123456789abcdef";

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn config(extra: &str) -> String {
        format!(
            r#"{{"sidecar_cluster":"idem_sidecar","keys":[{{"kid":"k1","secret":"{SECRET}"}}],"active_kid":"k1","subject":{{"header":"X-Agent-Subject"}}{extra}}}"#
        )
    }

    fn parse(text: &str) -> Result<PluginConfig, ConfigError> {
        parse_plugin_config(text.as_bytes(), &no_env)
    }

    fn error_of(text: &str) -> String {
        match parse(text) {
            Ok(_) => String::from("<accepted>"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn minimal_config_gets_defaults() -> Result<(), ConfigError> {
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
    fn full_config() -> Result<(), ConfigError> {
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
        assert_eq!(
            got,
            Err(ConfigError("keys[0].secret_env: environment variable K1 holds fewer than 32 bytes".into()))
        );
    }

    fn leaves(pairs: &[(&str, LeafValue)]) -> HashMap<String, LeafValue> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
    }

    fn route(pairs: &[(&str, LeafValue)]) -> Result<Option<RoutePolicy>, PolicyError> {
        let map = leaves(pairs);
        parse_route_policy(&|k| map.get(k).cloned(), &RouteDefaults::default())
    }

    fn s(v: &str) -> LeafValue {
        LeafValue::Str(v.into())
    }

    #[test]
    fn unannotated_route_passes_through() -> Result<(), PolicyError> {
        assert_eq!(route(&[])?, None);
        assert_eq!(route(&[("scope", s("x"))])?, None);
        Ok(())
    }

    #[test]
    fn confirm_route() -> Result<(), PolicyError> {
        let p = route(&[
            ("role", s("confirm")),
            ("scope", s("payments.transfer:v1")),
            ("bind", s("/amount:decimal, /currency\n/payee/id\t/a~1b")),
            ("lease_ms", LeafValue::Num(120_000.0)),
            ("poll_after_ms", s("1500")),
            ("status_tool", s("get_transfer_status")),
            ("result_ref", s("/transfer_id")),
            ("outcomes", s("409:failed")),
            ("replay", s("original")),
        ])?;
        let want = RoutePolicy {
            role: Role::Confirm,
            scope: "payments.transfer:v1".into(),
            bound: vec![
                BoundField::new("/amount", true),
                BoundField::new("/currency", false),
                BoundField::new("/payee/id", false),
                BoundField::new("/a~1b", false),
            ],
            fingerprint_ttl_s: 900,
            lease_ms: 120_000,
            poll_after_ms: 1500,
            status_tool: Some("get_transfer_status".into()),
            result_ref: Some("/transfer_id".into()),
            outcomes: vec![(409, crate::outcome::Outcome::Failed)],
            replay: ReplayMode::Original,
            client_keys: false,
            callers: Callers::Agents,
            tools: Vec::new(),
            tool: None,
            quote_expires: None,
            upstream_keys: UpstreamKeys::Honoured,
            business_ref: None,
        };
        assert_eq!(p, Some(want));
        Ok(())
    }

    #[test]
    fn status_route_needs_no_bind() -> Result<(), PolicyError> {
        let p = route(&[("role", s("status")), ("scope", s("payments.transfer"))])?;
        assert!(matches!(p, Some(RoutePolicy { role: Role::Status, ref bound, .. }) if bound.is_empty()));
        Ok(())
    }

    #[test]
    fn an_upstream_without_keys_is_declared_with_what_proves_nothing_ran() -> Result<(), PolicyError> {
        let confirm = |extra: &[(&str, LeafValue)]| {
            let mut v = vec![("role", s("confirm")), ("scope", s("pay")), ("bind", s("/amount, /ref"))];
            v.extend(extra.iter().map(|(k, val)| (*k, val.clone())));
            route(&v)
        };
        let p = confirm(&[("upstream_keys", s("ignored")), ("business_ref", s("/ref"))])?
            .ok_or(PolicyError("none".into()))?;
        assert_eq!((p.upstream_keys, p.business_ref.as_deref()), (UpstreamKeys::Ignored, Some("/ref")));
        let p = confirm(&[])?.ok_or(PolicyError("none".into()))?;
        assert_eq!((p.upstream_keys, p.business_ref), (UpstreamKeys::Honoured, None), "keys are honoured by default");
        for (extra, want) in [
            (vec![("business_ref", s("/memo"))], "business_ref: \"/memo\" must be one of the route's bound fields"),
            (vec![("business_ref", s("ref"))], "business_ref: \"ref\" must be one of"),
            (
                vec![("upstream_keys", s("ignored")), ("outcomes", s("429:release"))],
                "outcomes: 429:release with upstream_keys ignored",
            ),
        ] {
            let got = confirm(&extra).map(|_| String::from("<accepted>")).unwrap_or_else(|e| e.0);
            assert!(got.starts_with(want), "want {want:?}, got {got:?}");
        }
        Ok(())
    }

    #[test]
    fn route_errors_name_the_key() {
        let base = |extra: &[(&str, LeafValue)]| {
            let mut v = vec![("role", s("preview")), ("scope", s("pay")), ("bind", s("/amount"))];
            for (k, val) in extra {
                v.retain(|(key, _)| key != k);
                v.push((k, val.clone()));
            }
            match route(&v) {
                Ok(_) => String::from("<accepted>"),
                Err(e) => e.0,
            }
        };
        let cases: Vec<((&str, LeafValue), &str)> = vec![
            (("role", s("execute")), "role: \"execute\" is not one of"),
            (("role", LeafValue::Num(1.0)), "role: expected a string"),
            (("scope", s("")), "scope: empty"),
            (("scope", s("pay ment")), "scope: \"pay ment\" must be"),
            (("scope", s(&"a".repeat(129))), "scope:"),
            (("bind", s(" , ")), "bind: required for role preview"),
            (("bind", s("amount")), "bind: \"amount\" is not a JSON pointer"),
            (("bind", s("/amount:decimall")), "bind: \"/amount:decimall\": the suffix may be"),
            (("bind", s("/amount, /amount:decimal")), "bind: \"/amount\" is listed twice"),
            (("bind", s("/a~2")), "bind: \"/a~2\" is not a JSON pointer"),
            (("fingerprint_ttl_s", LeafValue::Num(0.0)), "fingerprint_ttl_s: expected an integer from 1 to 86400"),
            (("fingerprint_ttl_s", LeafValue::Num(86_401.0)), "fingerprint_ttl_s: expected"),
            (("fingerprint_ttl_s", LeafValue::Num(1.5)), "fingerprint_ttl_s: expected"),
            (("fingerprint_ttl_s", LeafValue::Num(f64::NAN)), "fingerprint_ttl_s: expected"),
            (("fingerprint_ttl_s", LeafValue::Num(-5.0)), "fingerprint_ttl_s: expected"),
            (("fingerprint_ttl_s", s("15m")), "fingerprint_ttl_s: expected"),
            (("lease_ms", LeafValue::Num(86_400_001.0)), "lease_ms: expected an integer from 1000 to 86400000"),
            (("poll_after_ms", s("")), "poll_after_ms: expected"),
            (("result_ref", s("transfer_id")), "result_ref: \"transfer_id\" is not a JSON pointer"),
            (("outcomes", s("200:failed")), "outcomes: 200: only statuses 300-599"),
            (("status_tool", LeafValue::Num(3.0)), "status_tool: expected a string"),
            (("replay", s("stripe")), "replay: \"stripe\" is not one of envelope, original"),
            (("upstream_keys", s("none")), "upstream_keys: \"none\" is not one of honoured, ignored"),
            (("upstream_keys", s("ignored")), "upstream_keys: only for the roles that execute, not preview"),
            (("business_ref", s("/amount")), "business_ref: only for the roles that execute, not preview"),
        ];
        for ((key, value), want) in cases {
            let got = base(&[(key, value)]);
            assert!(got.starts_with(want), "{key}: want {want:?}, got {got:?}");
        }
        assert_eq!(base(&[("scope", s("a"))]), "<accepted>");
    }

    #[test]
    fn sidecar_token_from_config_or_environment() -> Result<(), ConfigError> {
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

    #[test]
    fn bound_fields_may_declare_their_type() -> Result<(), Box<dyn std::error::Error>> {
        let f = parse_bind("/amount:decimal, /currency:string, /count:integer, /rate:number, /urgent:boolean, /memo")?;
        let types: Vec<FieldType> = f.iter().map(|b| b.ty).collect();
        use FieldType::*;
        assert_eq!(types, [Decimal, String, Integer, Number, Boolean, Any]);
        let hash = |body: serde_json::Value| crate::canonical::param_hash(&body, &f);
        assert!(hash(
            serde_json::json!({"amount": "1.00", "currency": "EUR", "count": 3, "rate": 1.5, "urgent": true})
        )
        .is_ok());
        for bad in [
            serde_json::json!({"currency": 978}),
            serde_json::json!({"count": 3.5}),
            serde_json::json!({"count": "3"}),
            serde_json::json!({"rate": "1.5"}),
            serde_json::json!({"urgent": "yes"}),
        ] {
            assert!(hash(bad.clone()).is_err(), "{bad}");
        }
        Ok(())
    }

    #[test]
    fn bind_limits() {
        let many: Vec<String> = (0..65).map(|i| format!("/f{i}")).collect();
        assert!(parse_bind(&many.join(",")).is_err());
        assert!(matches!(parse_bind(&many[..64].join(" ")), Ok(f) if f.len() == 64));
        assert!(parse_bind(&format!("/{}", "a".repeat(256))).is_err());
    }

    /// The bytes Envoy 1.40 returned for a route's annotation struct (recorded in a
    /// real run): a number leaf is 8 bytes of a double, strings are UTF-8.
    #[test]
    fn the_annotation_struct_decodes_as_envoy_sends_it() -> Result<(), Box<dyn std::error::Error>> {
        let ttl = 900f64.to_le_bytes();
        let bytes = encode_pairs(&[("fingerprint_ttl_s", &ttl), ("role", b"preview"), ("scope", b"payments.transfer")]);
        let pairs = decode_pairs(&bytes).ok_or("does not decode")?;
        assert_eq!(pairs.len(), 3);
        let get = |k: &str| pairs.iter().find(|(key, _)| key == k).map(|(_, v)| leaf_value(k, v.clone()));
        assert_eq!(get("fingerprint_ttl_s"), Some(LeafValue::Num(900.0)));
        assert_eq!(get("role"), Some(LeafValue::Str("preview".into())));
        for bad in [&bytes[..bytes.len() - 1], &bytes[..3], b"\xff\xff\xff\xff".as_slice(), b"".as_slice()] {
            assert_eq!(decode_pairs(bad), None);
        }
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert_eq!(decode_pairs(&trailing), None);
        Ok(())
    }
}
