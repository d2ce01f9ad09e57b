//! One route's annotation: its role, scope, bound fields, TTLs and how its answers read
//! (`RoutePolicy`), from route metadata leaves, a per-route configuration or a route rule.

use super::error::Error;
use super::pairs::LeafValue;
use super::template::{self, Segment};
use crate::canonical::{BoundField, FieldType, Source};
use crate::json_text::is_json_pointer;
use crate::strict_json;
use serde_json::Value;
use std::ops::RangeInclusive;

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
    "approval",
    "template",
    "not_money_relevant",
];

const MAX_SCOPE_LEN: usize = 128;
/// The header a fingerprint may ride in (`machine::FINGERPRINT_HEADER`; policy comes first).
const FINGERPRINT_HEADER_NAME: &str = "agent-fingerprint";
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
    pub outcomes: Vec<(u16, crate::outcome::Verdict)>,
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
    /// Confirm: when a person must approve the operation before it runs (DESIGN §4, "Approval").
    pub approval: Option<super::approval::Approval>,
    /// The route's path template (`template`, or a route rule's `match.path`): where `path:NAME`
    /// bound values are read.
    pub template: Option<Vec<Segment>>,
    /// Template parameters the annotation declares not money-relevant (`not_money_relevant`):
    /// left unbound on purpose.
    pub not_money_relevant: Vec<String>,
    /// Preview: seen, not configured: this route's answers were found to name a fingerprint
    /// field, so they are held whole (the held splice replaces it) instead of streamed.
    pub answers_named_fingerprint: Observed,
}

/// A fact a filter thread learned about a route at run time. Not part of the configuration: two
/// policies that differ only in what was seen are the same policy.
#[derive(Debug, Clone, Default)]
pub struct Observed(std::cell::Cell<bool>);

impl Observed {
    pub fn get(&self) -> bool {
        self.0.get()
    }

    pub fn set(&self, seen: bool) {
        self.0.set(seen);
    }
}

impl PartialEq for Observed {
    fn eq(&self, _: &Observed) -> bool {
        true
    }
}

impl Eq for Observed {}

/// `quote_expires`: a JSON pointer into the preview's answer (`/expires_at`) or a response header
/// (`header:quote-expires-at`), holding unix seconds or an RFC 3339 time (DESIGN §3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QuoteExpiry {
    Pointer(String),
    Header(String),
}

impl QuoteExpiry {
    fn parse(text: &str) -> Result<QuoteExpiry, Error> {
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

fn parse_tool_spec(text: &str) -> Result<ToolSpec, Error> {
    let Ok(Value::Object(map)) = strict_json::from_slice(text.as_bytes()) else {
        return perr("tool: expected a JSON object {\"name\", \"description\", \"parameters\"}");
    };
    if let Some(k) = map.keys().find(|k| !["name", "description", "parameters"].contains(&k.as_str())) {
        return perr(format!("tool.{k}: unknown field (expected name, description, parameters)"));
    }
    let text_field = |k: &str, max: usize| -> Result<Option<String>, Error> {
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
    /// The policies here that verify a fingerprint and start an operation: this route's own on a
    /// confirm route, each confirm tool's on an MCP route (with the tool's name).
    pub fn fingerprint_confirms(&self) -> Vec<(Option<&str>, &RoutePolicy)> {
        match self.role {
            Role::Confirm => vec![(None, self)],
            Role::Mcp => self
                .tools
                .iter()
                .filter(|(_, p)| p.role == Role::Confirm)
                .map(|(name, p)| (Some(name.as_str()), p.as_ref()))
                .collect(),
            Role::Preview | Role::Status | Role::Idempotent => Vec::new(),
        }
    }

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

fn perr<T>(msg: impl Into<String>) -> Result<T, Error> {
    Err(Error(msg.into()))
}

/// `Ok(None)` when there is no `role` leaf: the route is not ours.
/// One scope, one approval rule (DESIGN §4, "Approval"). A fingerprint names its scope, not its
/// route, so it verifies at every confirm of that scope; were two of them to disagree, a confirm
/// sent to the one without the rule would run what the other holds for a person. `confirms` are
/// the fingerprint confirms of one configuration, each with where it is; `Err` is where the second
/// is and what is wrong, naming the first.
pub fn one_approval_rule_per_scope<'a>(
    confirms: impl IntoIterator<Item = (String, &'a RoutePolicy)>,
) -> Result<(), (String, String)> {
    let mut seen: Vec<(String, &RoutePolicy)> = Vec::new();
    for (at, policy) in confirms {
        if let Some((first, _)) = seen.iter().find(|(_, p)| p.scope == policy.scope && p.approval != policy.approval) {
            let message = format!(
                "scope {:?} is confirmed at {first} too, with another approval rule; a fingerprint verifies at \
                 every confirm of its scope, so give them the same approval rule (or separate scopes)",
                policy.scope
            );
            return Err((at, message));
        }
        seen.push((at, policy));
    }
    Ok(())
}

pub fn parse_route_policy(
    get: &dyn Fn(&str) -> Option<LeafValue>,
    defaults: &RouteDefaults,
) -> Result<Option<RoutePolicy>, Error> {
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

    let scope = leaf_string(get, "scope")?.ok_or_else(|| Error("scope: required".into()))?;
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
        Some(text) => crate::outcome::parse_overrides(&text).map_err(|e| Error(format!("outcomes: {e}")))?,
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
    let upstream_keys = parse_upstream_keys(leaf_string(get, "upstream_keys")?.as_deref(), role)?;
    if upstream_keys == UpstreamKeys::Ignored {
        if let Some((status, _)) = outcomes.iter().find(|(_, o)| *o == crate::outcome::Verdict::Release) {
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
    let approval = match leaf_string(get, "approval")? {
        None => None,
        Some(_) if role != Role::Confirm => {
            return perr(format!("approval: only for role confirm, not {}", role.as_str()))
        }
        // A client key has no `exp`, so its approval could never lapse; and a confirm that names its
        // operation by a key would bypass the rule. One or the other.
        Some(_) if client_keys => {
            return perr(
                "approval: not with client_keys: true (an approval belongs to a fingerprint and lapses at its exp)",
            )
        }
        Some(text) => Some(super::approval::parse(&text, &bound)?),
    };
    let stated_callers = match leaf_string(get, "callers")?.as_deref() {
        None => None,
        Some("agents") => Some(Callers::Agents),
        Some("programs") => Some(Callers::Programs),
        Some(other) => return perr(format!("callers: {other:?} is not one of agents, programs")),
    };
    let callers = client_key_callers(role, client_keys, stated_callers)?;
    let template = match leaf_string(get, "template")? {
        Some(text) => Some(template::parse_template(&text).map_err(|why| Error(format!("template: {why}")))?),
        None => None,
    };
    let not_money_relevant = match leaf_string(get, "not_money_relevant")? {
        Some(text) => {
            text.split(|c: char| c == ',' || c.is_whitespace()).filter(|t| !t.is_empty()).map(str::to_owned).collect()
        }
        None => Vec::new(),
    };
    check_binding_outside_body(role, &bound, template.as_deref(), &not_money_relevant)?;

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
        approval,
        template,
        not_money_relevant,
        answers_named_fingerprint: Observed::default(),
    }))
}

/// `role: mcp` (or `protocol: mcp`): `tools` is a JSON object (a JSON string in
/// route metadata) from tool name to that tool's annotation, whose bound fields
/// point into `params.arguments`.
fn parse_mcp(get: &dyn Fn(&str) -> Option<LeafValue>, defaults: &RouteDefaults) -> Result<RoutePolicy, Error> {
    if let Some(LeafValue::Str(role)) = get("role") {
        if role != "mcp" {
            return perr(format!("role: {role:?} with protocol mcp: the roles belong to the tools"));
        }
    }
    let text = leaf_string(get, "tools")?.ok_or_else(|| Error("tools: required for an MCP route".into()))?;
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
            Err(Error(e)) => return perr(format!("tools.{name}.{e}")),
        };
        if let Some(f) = policy.bound.iter().find(|f| f.source != Source::Body) {
            return perr(format!(
                "tools.{name}.bind: {}: path:, query: and header: values are for HTTP routes; a tool's \
                 arguments are its body (point into them)",
                f.pointer
            ));
        }
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
        approval: None,
        template: None,
        not_money_relevant: Vec::new(),
        answers_named_fingerprint: Observed::default(),
    })
}

const MAX_TOOLS: usize = 64;
/// A tool's annotation is a route annotation less these route-level fields.
const ROUTE_ONLY_KEYS: &[&str] =
    &["replay", "client_keys", "callers", "protocol", "tools", "template", "not_money_relevant"];

fn is_tool_key(k: &str) -> bool {
    ROUTE_KEYS.contains(&k) && !ROUTE_ONLY_KEYS.contains(&k)
}

/// Binding outside the body (DESIGN §3): a `path:` value is a parameter of the route's template;
/// on a route that executes by its bound fields, every template parameter is bound or declared
/// not money-relevant: an API whose account sits in its path (`/v1/accounts/{account}/transfers`)
/// would otherwise confirm account A's quote on account B's path with the same body.
fn check_binding_outside_body(
    role: Role,
    bound: &[BoundField],
    template: Option<&[Segment]>,
    not_money_relevant: &[String],
) -> Result<(), Error> {
    let params: Vec<&str> = template.map(|t| template::params(t).collect()).unwrap_or_default();
    for field in bound.iter().filter(|f| f.source == Source::Path) {
        if template.is_none() {
            return perr(format!(
                "bind: {}: a path value needs the route's template (template: /v1/accounts/{{{}}}/transfers; a \
                 route rule's template is its match.path)",
                field.pointer,
                field.name()
            ));
        }
        if !params.contains(&field.name()) {
            return perr(format!(
                "bind: {}: the route's template {} has no {{{}}}",
                field.pointer,
                template.map(template::show).unwrap_or_default(),
                field.name()
            ));
        }
    }
    for name in not_money_relevant {
        if !params.contains(&name.as_str()) {
            return perr(format!("not_money_relevant: {name:?} is not a parameter of the route's template"));
        }
        if bound.iter().any(|f| f.source == Source::Path && f.name() == name) {
            return perr(format!("not_money_relevant: {name:?} is bound (bind: path:{name}); it cannot be both"));
        }
    }
    // Role idempotent without bound fields hashes the whole request, its path included.
    let executes_by_fields = role == Role::Confirm || (role == Role::Idempotent && !bound.is_empty());
    if executes_by_fields {
        let open = params.iter().find(|p| {
            !bound.iter().any(|f| f.source == Source::Path && f.name() == **p)
                && !not_money_relevant.iter().any(|n| n == *p)
        });
        if let Some(p) = open {
            return perr(format!(
                "template: {{{p}}} of {} is neither bound (bind: path:{p}) nor declared not money-relevant \
                 (not_money_relevant: {p}): a fingerprint minted for one {p} would confirm on another's path",
                template.map(template::show).unwrap_or_default()
            ));
        }
    }
    Ok(())
}

/// `upstream_keys` has no default on the roles that execute (DESIGN §4, "Release needs proof nothing
/// ran"): releasing on an upstream 429/503 is safe only where the upstream deduplicates by the key,
/// and a default would decide that for an owner who never heard of the setting.
fn parse_upstream_keys(text: Option<&str>, role: Role) -> Result<UpstreamKeys, Error> {
    let executes = matches!(role, Role::Confirm | Role::Idempotent);
    match text {
        Some(other) if !matches!(other, "honoured" | "ignored") => {
            perr(format!("upstream_keys: {other:?} is not one of honoured, ignored"))
        }
        Some(_) if !executes => perr(format!("upstream_keys: only for the roles that execute, not {}", role.as_str())),
        Some("ignored") => Ok(UpstreamKeys::Ignored),
        Some(_) => Ok(UpstreamKeys::Honoured),
        None if executes => perr(format!(
            "upstream_keys: required for role {}: state whether the upstream deduplicates by Idempotency-Key \
             (honoured) or not (ignored). An upstream 429 or 503 releases the operation for a retry only where \
             the upstream keeps the key; on one that ignores it, a 503 sent after the work was done would let \
             the retry run it a second time, and no check can see that from outside",
            role.as_str()
        )),
        // Nothing forwarded here carries a key to execute by.
        None => Ok(UpstreamKeys::Honoured),
    }
}

/// Who calls a route, where it takes client keys (DESIGN §6, "Client keys are for programs"): a key
/// the model invents is new on every attempt (the article's §2), so a route agents call never
/// accepts one. A confirm route that takes keys beside fingerprints must be named for what it is,
/// `callers: programs`; role `idempotent` is for programs unless it says otherwise, and may not.
fn client_key_callers(role: Role, client_keys: bool, stated: Option<Callers>) -> Result<Callers, Error> {
    let agents_refused = || {
        perr(format!(
            "client_keys: a route agents call never accepts an agent-made Idempotency-Key: a key the model \
             invents is new on every attempt, so agents carry the server-issued fingerprint instead. Client keys \
             are for programs: state callers: programs on this {} route (or drop client_keys)",
            role.as_str()
        ))
    };
    match (client_keys, role, stated) {
        (true, Role::Status, stated) => Ok(stated.unwrap_or(Callers::Agents)),
        (true, _, Some(Callers::Agents)) => agents_refused(),
        (true, Role::Idempotent, None) | (true, _, Some(Callers::Programs)) => Ok(Callers::Programs),
        (true, _, None) => agents_refused(),
        (false, _, stated) => Ok(stated.unwrap_or(Callers::Agents)),
    }
}

/// `"/amount:decimal, /currency /payee_id"`: separated by commas and/or whitespace. A value
/// outside the body is `path:NAME`, `query:NAME` or `header:NAME`, typed `:string` or `:decimal`
/// at most (it arrives as text).
pub fn parse_bind(text: &str) -> Result<Vec<BoundField>, Error> {
    let mut fields: Vec<BoundField> = Vec::new();
    for token in text.split(|c: char| c == ',' || c.is_whitespace()).filter(|t| !t.is_empty()) {
        let field = match Source::OUTSIDE.iter().find(|(_, prefix)| token.starts_with(prefix)) {
            Some((source, prefix)) => parse_outside(token, *source, prefix)?,
            None => parse_pointer(token)?,
        };
        if fields.iter().any(|f| f.pointer == field.pointer) {
            return perr(format!("bind: {:?} is listed twice", field.pointer));
        }
        if fields.len() == MAX_BOUND_FIELDS {
            return perr(format!("bind: more than {MAX_BOUND_FIELDS} fields"));
        }
        fields.push(field);
    }
    Ok(fields)
}

fn parse_pointer(token: &str) -> Result<BoundField, Error> {
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
        return perr(format!(
            "bind: {token:?} is not a JSON pointer such as /amount (nor path:NAME, query:NAME or header:NAME)"
        ));
    }
    // A mistyped suffix would otherwise become a pointer to a field that is
    // never present, and an absent field is silently left unbound.
    if pointer.contains(':') {
        return perr(format!("bind: {token:?}: one type suffix at most (:decimal, :string, …)"));
    }
    if pointer.len() > MAX_POINTER_LEN {
        return perr(format!("bind: {token:?} is longer than {MAX_POINTER_LEN} characters"));
    }
    Ok(BoundField::typed(pointer, ty))
}

/// `path:account`, `query:currency:decimal`, `header:X-Tenant-Id`.
fn parse_outside(token: &str, source: Source, prefix: &str) -> Result<BoundField, Error> {
    let rest = token.get(prefix.len()..).unwrap_or_default();
    let (name, ty) = match rest.split_once(':') {
        None => (rest, FieldType::Any),
        Some((name, "string")) => (name, FieldType::String),
        Some((name, "decimal")) => (name, FieldType::Decimal),
        Some(_) => {
            return perr(format!("bind: {token:?}: a value outside the body is text: :string or :decimal at most"))
        }
    };
    let allowed = |b: u8| match source {
        Source::Path => b.is_ascii_alphanumeric() || b == b'_',
        Source::Header => b.is_ascii_alphanumeric() || b == b'-' || b == b'_',
        Source::Query | Source::Body => b.is_ascii_alphanumeric() || b"-_.[]".contains(&b),
    };
    if name.is_empty() || name.len() > MAX_POINTER_LEN || !name.bytes().all(allowed) {
        return perr(format!(
            "bind: {token:?}: {prefix} needs a name (letters, digits and - _ . [ ] as the source allows)"
        ));
    }
    let name = if source == Source::Header { name.to_ascii_lowercase() } else { name.to_string() };
    // The guard's own headers are never a business value: the confirm's fingerprint is not the
    // preview's, and a client's Idempotency-Key never reaches the upstream.
    if source == Source::Header && [FINGERPRINT_HEADER_NAME, "idempotency-key"].contains(&name.as_str()) {
        return perr(format!("bind: {token:?}: the guard's own header, not a business value"));
    }
    Ok(BoundField::outside(source, &name, ty))
}

fn leaf_string(get: &dyn Fn(&str) -> Option<LeafValue>, key: &str) -> Result<Option<String>, Error> {
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
) -> Result<Option<u64>, Error> {
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

    fn leaves(pairs: &[(&str, LeafValue)]) -> HashMap<String, LeafValue> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
    }

    fn route(pairs: &[(&str, LeafValue)]) -> Result<Option<RoutePolicy>, Error> {
        let map = leaves(pairs);
        parse_route_policy(&|k| map.get(k).cloned(), &RouteDefaults::default())
    }

    fn s(v: &str) -> LeafValue {
        LeafValue::Str(v.into())
    }

    #[test]
    fn unannotated_route_passes_through() -> Result<(), Error> {
        assert_eq!(route(&[])?, None);
        assert_eq!(route(&[("scope", s("x"))])?, None);
        Ok(())
    }

    #[test]
    fn confirm_route() -> Result<(), Error> {
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
            ("upstream_keys", s("honoured")),
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
            outcomes: vec![(409, crate::outcome::Verdict::Failed)],
            replay: ReplayMode::Original,
            client_keys: false,
            callers: Callers::Agents,
            tools: Vec::new(),
            tool: None,
            quote_expires: None,
            upstream_keys: UpstreamKeys::Honoured,
            business_ref: None,
            approval: None,
            template: None,
            not_money_relevant: Vec::new(),
            answers_named_fingerprint: Observed::default(),
        };
        assert_eq!(p, Some(want));
        Ok(())
    }

    #[test]
    fn approval_is_a_confirm_condition_over_bound_fields() -> Result<(), Error> {
        use super::super::approval::Approval;
        let confirm = |approval: &str| {
            route(&[
                ("role", s("confirm")),
                ("upstream_keys", s("honoured")),
                ("scope", s("pay")),
                ("bind", s("/amount:decimal, /currency:string")),
                ("approval", s(approval)),
            ])
        };
        let p = confirm("always")?.ok_or(Error("none".into()))?;
        assert_eq!(p.approval, Some(Approval::Always));
        let p = confirm(r#"{"field":"/amount","gte":"1000"}"#)?.ok_or(Error("none".into()))?;
        assert!(matches!(p.approval, Some(Approval::When(_))));
        let err = confirm(r#"{"field":"/memo","gte":"1000"}"#).err().map(|e| e.0).unwrap_or_default();
        assert!(err.starts_with("approval.field") && err.contains("/memo"), "{err}");
        let preview =
            route(&[("role", s("preview")), ("scope", s("pay")), ("bind", s("/a")), ("approval", s("always"))]);
        assert!(preview.is_err_and(|e| e.0.contains("only for role confirm")));
        Ok(())
    }

    #[test]
    fn status_route_needs_no_bind() -> Result<(), Error> {
        let p = route(&[("role", s("status")), ("scope", s("payments.transfer"))])?;
        assert!(matches!(p, Some(RoutePolicy { role: Role::Status, ref bound, .. }) if bound.is_empty()));
        Ok(())
    }

    #[test]
    fn an_upstream_without_keys_is_declared_with_what_proves_nothing_ran() -> Result<(), Error> {
        let confirm = |extra: &[(&str, LeafValue)]| {
            let mut v = vec![("role", s("confirm")), ("scope", s("pay")), ("bind", s("/amount, /ref"))];
            v.extend(extra.iter().map(|(k, val)| (*k, val.clone())));
            route(&v)
        };
        let p =
            confirm(&[("upstream_keys", s("ignored")), ("business_ref", s("/ref"))])?.ok_or(Error("none".into()))?;
        assert_eq!((p.upstream_keys, p.business_ref.as_deref()), (UpstreamKeys::Ignored, Some("/ref")));
        let p = confirm(&[("upstream_keys", s("honoured"))])?.ok_or(Error("none".into()))?;
        assert_eq!((p.upstream_keys, p.business_ref), (UpstreamKeys::Honoured, None));
        for (extra, want) in [
            (
                vec![("upstream_keys", s("honoured")), ("business_ref", s("/memo"))],
                "business_ref: \"/memo\" must be one of the route's bound fields",
            ),
            (
                vec![("upstream_keys", s("honoured")), ("business_ref", s("ref"))],
                "business_ref: \"ref\" must be one of",
            ),
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

    /// DESIGN §4, "Release needs proof nothing ran": no default; the refusal says why it is asked.
    #[test]
    fn every_route_that_executes_states_what_its_upstream_does_with_keys() -> Result<(), Error> {
        for (role, extra) in [("confirm", vec![("bind", s("/amount"))]), ("idempotent", vec![])] {
            let mut leaves = vec![("role", s(role)), ("scope", s("pay"))];
            leaves.extend(extra.iter().cloned());
            let err = route(&leaves).err().map(|e| e.0).unwrap_or_default();
            assert!(err.starts_with(&format!("upstream_keys: required for role {role}")), "{err}");
            assert!(err.contains("503") && err.contains("second time"), "the error says why: {err}");
            for (said, want) in [("honoured", UpstreamKeys::Honoured), ("ignored", UpstreamKeys::Ignored)] {
                let mut stated = leaves.clone();
                stated.push(("upstream_keys", s(said)));
                assert_eq!(route(&stated)?.map(|p| p.upstream_keys), Some(want), "{role} {said}");
            }
        }
        // A preview or a status route forwards nothing to execute: the setting is not theirs.
        let preview = route(&[("role", s("preview")), ("scope", s("pay")), ("bind", s("/a"))])?;
        assert!(preview.is_some());
        let said = route(&[("role", s("status")), ("scope", s("pay")), ("upstream_keys", s("honoured"))]);
        assert!(said.is_err_and(|e| e.0.starts_with("upstream_keys: only for the roles that execute, not status")));
        Ok(())
    }

    /// DESIGN §6, "Client keys are for programs" (the article's §2): an agent-made key is new on
    /// every attempt, so a route agents call never takes one.
    #[test]
    fn a_route_agents_call_never_takes_an_agent_made_key() -> Result<(), Error> {
        let with = |role: &str, extra: &[(&str, LeafValue)]| {
            let mut v = vec![("role", s(role)), ("scope", s("pay")), ("upstream_keys", s("honoured"))];
            if role == "confirm" {
                v.push(("bind", s("/amount")));
            }
            v.extend(extra.iter().cloned());
            route(&v)
        };
        for extra in [vec![("client_keys", s("true"))], vec![("client_keys", s("true")), ("callers", s("agents"))]] {
            let err = with("confirm", &extra).err().map(|e| e.0).unwrap_or_default();
            assert!(err.starts_with("client_keys: a route agents call never accepts an agent-made"), "{err}");
            assert!(err.contains("callers: programs"), "the error says what to write: {err}");
        }
        let err = with("idempotent", &[("callers", s("agents"))]).err().map(|e| e.0).unwrap_or_default();
        assert!(err.starts_with("client_keys: a route agents call never"), "{err}");
        // Named for what it is: programs.
        let named = with("confirm", &[("client_keys", s("true")), ("callers", s("programs"))])?;
        assert_eq!(named.map(|p| (p.client_keys, p.callers)), Some((true, Callers::Programs)));
        let keys_only = with("idempotent", &[])?;
        assert_eq!(keys_only.map(|p| p.callers), Some(Callers::Programs));
        // Without client keys an agents' confirm is what it always was.
        assert_eq!(with("confirm", &[])?.map(|p| (p.client_keys, p.callers)), Some((false, Callers::Agents)));
        Ok(())
    }

    /// Binding outside the body (DESIGN §3): every parameter of a confirm's template is bound or
    /// declared not money-relevant; what is bound outside the body is named by its source.
    #[test]
    fn a_confirm_template_parameter_is_bound_or_declared_not_money_relevant() -> Result<(), Error> {
        let confirm = |extra: &[(&str, LeafValue)]| {
            let mut v = vec![("role", s("confirm")), ("scope", s("pay")), ("upstream_keys", s("honoured"))];
            for (k, val) in extra {
                v.retain(|(key, _)| key != k);
                v.push((k, val.clone()));
            }
            route(&v).map(|p| p.map(|p| (p.bound, p.not_money_relevant))).map_err(|e| e.0)
        };
        let template = ("template", s("/v1/accounts/{account}/transfers/{request}"));
        let (bound, free) = confirm(&[
            template.clone(),
            ("bind", s("path:account, query:currency:string, header:X-Tenant-Id, /amount:decimal")),
            ("not_money_relevant", s("request")),
        ])
        .map_err(Error)?
        .ok_or(Error("none".into()))?;
        let named: Vec<(&str, Source, FieldType)> =
            bound.iter().map(|f| (f.pointer.as_str(), f.source, f.ty)).collect();
        assert_eq!(
            named,
            [
                ("path:account", Source::Path, FieldType::Any),
                ("query:currency", Source::Query, FieldType::String),
                ("header:x-tenant-id", Source::Header, FieldType::Any),
                ("/amount", Source::Body, FieldType::Decimal),
            ]
        );
        assert_eq!(free, ["request"]);
        for (extra, want) in [
            (vec![template.clone(), ("bind", s("/amount"))], "template: {account} of /v1/accounts/{account}/transfers/{request} is neither bound (bind: path:account) nor declared not money-relevant"),
            (vec![template.clone(), ("bind", s("path:account, /amount"))], "template: {request} of"),
            (vec![("bind", s("path:account, /amount"))], "bind: path:account: a path value needs the route's template"),
            (vec![template.clone(), ("bind", s("path:acct, path:account, /a")), ("not_money_relevant", s("request"))], "bind: path:acct: the route's template"),
            (vec![template.clone(), ("bind", s("path:account")), ("not_money_relevant", s("request, other"))], "not_money_relevant: \"other\" is not a parameter"),
            (vec![template.clone(), ("bind", s("path:account, path:request"))  , ("not_money_relevant", s("request"))], "not_money_relevant: \"request\" is bound"),
            (vec![("bind", s("query:amount:integer"))], "bind: \"query:amount:integer\": a value outside the body is text"),
            (vec![("bind", s("header:"))], "bind: \"header:\": header: needs a name"),
            (vec![("bind", s("header:agent-fingerprint, /a"))], "bind: \"header:agent-fingerprint\": the guard's own header"),
            (vec![("bind", s("query:a, query:a"))], "bind: \"query:a\" is listed twice"),
            (vec![("template", s("/v1/{a}/{a}")), ("bind", s("/a"))], "template: {a} appears twice"),
        ] {
            let got = confirm(&extra).map(|_| String::from("<accepted>")).unwrap_or_else(|e| e);
            assert!(got.starts_with(want), "want {want:?}, got {got:?}");
        }
        // A preview binds what it binds (its confirm refuses a changed value); an idempotent route
        // without bound fields hashes its whole path.
        let preview = route(&[("role", s("preview")), ("scope", s("p")), template.clone(), ("bind", s("/amount"))])?;
        assert!(preview.is_some());
        let keys = route(&[("role", s("idempotent")), ("scope", s("p")), ("upstream_keys", s("honoured")), template])?;
        assert!(keys.is_some());
        // An MCP tool's arguments are its body.
        let tools =
            r#"{"pay": {"role": "confirm", "scope": "p", "bind": "header:x-tenant, /a", "upstream_keys": "honoured"}}"#;
        let err = route(&[("role", s("mcp")), ("tools", s(tools))]).err().map(|e| e.0).unwrap_or_default();
        assert!(
            err.starts_with("tools.pay.bind: header:x-tenant: path:, query: and header: values are for HTTP"),
            "{err}"
        );
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
}
