//! `idemd tools`: the tool definitions an agent builder needs, generated from
//! the annotations the filter enforces, so the schema an agent is given and
//! the fields the gateway binds cannot drift apart.
//!
//! Every annotation is parsed by idem-core (`parse_route_policy`,
//! `parse_plugin_config`), exactly as the filter parses it; this module only
//! finds the annotations (Envoy route metadata, route rules of a plugin
//! configuration, the `tools` table of an MCP route), names the actions,
//! pairs preview, confirm and status by scope, and writes the descriptions
//! that teach the protocol. `schema` builds the argument schemas, `formats`
//! the OpenAI, Anthropic and MCP shapes.

pub mod formats;
pub mod schema;

use std::collections::HashMap;
use std::process::ExitCode;
use std::rc::Rc;

use idem_core::policy::{
    parse_plugin_config, parse_route_policy, LeafValue, Role, RouteDefaults, RoutePolicy, ROUTE_KEYS, ROUTE_NAMESPACE,
};
use serde_json::Value;

use crate::config::tools::ToolsArgs;
use formats::Definition;

/// One annotated action an agent may call.
#[derive(Debug, Clone)]
pub struct Action {
    /// Where it was found, for messages: `envoy.yaml: route transfer_preview`.
    pub origin: String,
    /// The tool name: `tool.name`, else the MCP tool name, else (status) `status_tool`, else the route name.
    pub name: String,
    pub policy: Rc<RoutePolicy>,
    group: Group,
}

/// What belongs together when pairing preview, confirm and status of one scope:
/// the same input, virtual host (or rule list) and MCP route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Group {
    source: usize,
    block: usize,
    mcp: Option<usize>,
}

/// What an agent framework needs to call a money-moving MCP tool through the gateway: measured by
/// tests/tests/frameworks.rs, explained in docs/agents.md ("What agent frameworks hand the model").
pub const MONEY_MOVING_MCP_TOOL: &str = "moves money through MCP; per agent framework: \
pydantic-ai needs MCPToolset(..., tool_error_behavior='failed') (its default 'retry' ends the run at the second \
refusal in one run, e.g. not_executed twice as instructed); the OpenAI Agents SDK needs nothing (with \
use_structured_content=True a replay's reply rides in structuredContent.agent_idempotency, which the gateway \
declares in the tool's outputSchema as tools/list passes: clients must list tools through the gateway); \
give clients a URL that does not end in /sse (FastMCP takes one for the legacy HTTP+SSE transport) or name \
Streamable HTTP explicitly";

/// What the inputs hold, and what the reader should hear about on stderr.
#[derive(Debug, Default)]
pub struct Collected {
    pub actions: Vec<Action>,
    pub warnings: Vec<String>,
    pub notes: Vec<String>,
    blocks: usize,
    mcp_routes: usize,
}

/// `idemd tools`: exit 0 with the definitions on stdout (warnings on stderr),
/// 2 when an input cannot be read or an annotation is refused.
pub fn main(args: ToolsArgs) -> ExitCode {
    let mut collected = Collected::default();
    let definitions = collected.read(&args).and_then(|()| collected.definitions());
    for note in &collected.notes {
        eprintln!("idemd tools: note: {note}");
    }
    for warning in &collected.warnings {
        eprintln!("idemd tools: warning: {warning}");
    }
    let definitions = match definitions {
        Ok(d) => d,
        Err(e) => {
            eprintln!("idemd tools: {e}");
            return ExitCode::from(2);
        }
    };
    if definitions.is_empty() {
        eprintln!("idemd tools: warning: no annotated preview, confirm or status action found");
    }
    match serde_json::to_string_pretty(&formats::render(&definitions, args.format)) {
        Ok(text) => {
            println!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("idemd tools: {e}");
            ExitCode::from(1)
        }
    }
}

/// Any `secret_env` resolves to a placeholder: the definitions need the
/// annotations, never the secrets, and parsing must not fail for want of them.
pub(crate) fn placeholder_secret(_: &str) -> Option<String> {
    Some("x".repeat(64))
}

impl Collected {
    /// Every input, Envoy configurations first.
    pub fn read(&mut self, args: &ToolsArgs) -> Result<(), String> {
        let inputs = args.envoy.iter().map(|p| (p, true)).chain(args.plugin_config.iter().map(|p| (p, false)));
        for (source, (path, envoy)) in inputs.enumerate() {
            let label = path.display().to_string();
            let bytes = std::fs::read(path).map_err(|e| format!("{label}: cannot read: {e}"))?;
            if envoy {
                let text = String::from_utf8(bytes).map_err(|_| format!("{label}: not UTF-8"))?;
                self.envoy(&label, &text, source)?;
            } else {
                self.plugin_config(&label, &bytes, source)?;
            }
        }
        Ok(())
    }

    /// An Envoy configuration: static listeners → HTTP connection managers →
    /// virtual hosts → routes with `agent_idempotency` metadata, and the
    /// filter's plugin configuration in the same manager.
    pub fn envoy(&mut self, label: &str, yaml: &str, source: usize) -> Result<(), String> {
        let doc: Value = serde_norway::from_str(yaml).map_err(|e| format!("{label}: not valid YAML: {e}"))?;
        let Some(listeners) = doc.pointer("/static_resources/listeners").and_then(Value::as_array) else {
            return Err(format!("{label}: no static_resources.listeners"));
        };
        for listener in listeners {
            let listener_name = listener.get("name").and_then(Value::as_str).unwrap_or("(unnamed)");
            let chains = listener
                .get("filter_chains")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .chain(listener.get("default_filter_chain"));
            for filter in chains.filter_map(|c| c.get("filters").and_then(Value::as_array)).flatten() {
                let Some(hcm) = filter.get("typed_config").filter(|t| is_hcm(t)) else { continue };
                let at = format!("{label}: listener {listener_name}");
                self.connection_manager(&at, hcm, source)?;
            }
        }
        Ok(())
    }

    fn connection_manager(&mut self, at: &str, hcm: &Value, source: usize) -> Result<(), String> {
        // The agent filter's entry (the .wasm or the native module), and its name: what
        // typed_per_filter_config disables it by, and the native module's per-route configuration is keyed by.
        let entry = hcm
            .get("http_filters")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .find_map(|f| agent_filter(f).map(|c| (f, c)));
        let filter_name = entry.and_then(|(f, _)| f.get("name")).and_then(Value::as_str).map(str::to_owned);
        let plugin = entry.map(|(_, config)| config);
        let defaults = match plugin {
            Some(config) => {
                let Some(text) = config else {
                    return Err(format!("{at}: the {ROUTE_NAMESPACE} filter has no plugin configuration string value"));
                };
                let label = format!("{at}: plugin configuration");
                self.plugin_config(&label, text.as_bytes(), source)?
            }
            None => RouteDefaults::default(),
        };
        if hcm.get("rds").is_some() {
            self.notes.push(format!("{at}: routes come from RDS; only static route_config is read"));
        }
        let hosts = hcm.pointer("/route_config/virtual_hosts").and_then(Value::as_array).into_iter().flatten();
        for host in hosts {
            self.blocks += 1;
            let group = Group { source, block: self.blocks, mcp: None };
            let host_name = host.get("name").and_then(Value::as_str).unwrap_or("(unnamed)");
            let routes = host.get("routes").and_then(Value::as_array).into_iter().flatten();
            for (i, route) in routes.enumerate() {
                // The native module's per-route configuration wins over route metadata, as in the module.
                let per_route = filter_name.as_deref().and_then(|f| per_route_annotation(route, f));
                let per_route = match per_route.transpose() {
                    Ok(v) => v,
                    Err(e) => return Err(format!("{at}: virtual host {host_name}: route #{i}: {e}")),
                };
                let Some(meta) = per_route
                    .as_ref()
                    .or_else(|| route.pointer(&format!("/metadata/filter_metadata/{ROUTE_NAMESPACE}")))
                else {
                    continue;
                };
                let name = route.get("name").and_then(Value::as_str);
                let origin = match name {
                    Some(n) => format!("{at}: route {n}"),
                    None => format!("{at}: virtual host {host_name}: route #{i} (unnamed)"),
                };
                if plugin.is_none() {
                    self.warnings.push(format!(
                        "{origin}: annotated, but this connection manager has no {ROUTE_NAMESPACE} filter: nothing enforces it"
                    ));
                }
                // The per-route pattern for hot unannotated routes must never reach an annotated one.
                if let Some(filter) = &filter_name {
                    let disabled = |v: &Value| {
                        v.pointer(&format!(
                            "/typed_per_filter_config/{}/disabled",
                            filter.replace('~', "~0").replace('/', "~1")
                        ))
                        .and_then(Value::as_bool)
                            == Some(true)
                    };
                    if disabled(route) || disabled(host) {
                        return Err(format!(
                            "{origin}: annotated, but the {filter} filter is disabled on it (typed_per_filter_config): its requests pass unguarded"
                        ));
                    }
                }
                let leaves = annotation_leaves(&origin, meta)?;
                let policy =
                    parse_route_policy(&|k| leaves.get(k).cloned(), &defaults).map_err(|e| format!("{origin}: {e}"))?;
                match policy {
                    Some(policy) => self.add(&origin, name, policy, group),
                    None => {
                        self.notes.push(format!("{origin}: {ROUTE_NAMESPACE} metadata without a role: not guarded"))
                    }
                }
            }
        }
        Ok(())
    }

    /// A plugin configuration: validated whole by idem-core, then its route
    /// rules become actions. Returns its route defaults.
    pub fn plugin_config(&mut self, label: &str, json: &[u8], source: usize) -> Result<RouteDefaults, String> {
        let config = parse_plugin_config(json, &placeholder_secret).map_err(|e| format!("{label}: {e}"))?;
        if config.routes.is_empty() {
            return Ok(config.defaults);
        }
        self.blocks += 1;
        let group = Group { source, block: self.blocks, mcp: None };
        for rule in config.routes.iter() {
            let origin = format!("{label}: rule {}", rule.name);
            self.add(&origin, Some(&rule.name), (*rule.policy).clone(), group);
        }
        Ok(config.defaults)
    }

    fn add(&mut self, origin: &str, route_name: Option<&str>, policy: RoutePolicy, group: Group) {
        let explicit = policy.tool.as_ref().and_then(|t| t.name.clone());
        let name = match policy.role {
            Role::Idempotent => {
                self.notes.push(format!(
                    "{origin}: role idempotent is for programs (their own Idempotency-Key): no agent tool"
                ));
                return;
            }
            Role::Mcp => {
                self.mcp_routes += 1;
                let group = Group { mcp: Some(self.mcp_routes), ..group };
                for (tool, p) in &policy.tools {
                    let name = match p.tool.as_ref().and_then(|t| t.name.clone()) {
                        Some(n) if n != *tool => {
                            self.warnings.push(format!(
                                "{origin}: tool {tool}: tool.name {n:?} differs from the tools key; the gateway guards tools/call of {tool:?}"
                            ));
                            n
                        }
                        _ => tool.clone(),
                    };
                    let origin = format!("{origin}: tool {tool}");
                    if p.role == Role::Confirm {
                        let note = format!("{origin}: {MONEY_MOVING_MCP_TOOL}");
                        if !self.notes.contains(&note) {
                            self.notes.push(note);
                        }
                    }
                    self.actions.push(Action { origin, name, policy: Rc::clone(p), group });
                }
                return;
            }
            Role::Status => explicit.or_else(|| policy.status_tool.clone()),
            Role::Confirm if policy.client_keys => {
                self.notes.push(format!(
                    "{origin}: takes programs' own Idempotency-Key beside fingerprints (callers: programs); the agent \
                     tool carries the fingerprint and is told never to make a key up"
                ));
                explicit
            }
            Role::Preview | Role::Confirm => explicit,
        };
        match name.or_else(|| route_name.map(str::to_string)) {
            Some(name) => {
                self.actions.push(Action { origin: origin.to_string(), name, policy: Rc::new(policy), group })
            }
            None => self.warnings.push(format!("{origin}: no route name and no tool.name: skipped (add tool.name)")),
        }
    }

    /// One definition per tool name. The same name from two places (a REST
    /// route and an MCP tool, two MCP endpoints) is listed once when the
    /// definitions agree, and refused when they differ.
    pub fn definitions(&mut self) -> Result<Vec<Definition>, String> {
        let mut out: Vec<(Definition, &str)> = Vec::new();
        for action in &self.actions {
            let mut warnings = Vec::new();
            let def = Definition {
                name: action.name.clone(),
                description: describe(action, &self.actions, &mut warnings),
                parameters: schema::arguments(&action.policy, &action.origin, &mut warnings),
                read_only: action.policy.role != Role::Confirm,
            };
            match out.iter().find(|(d, _)| d.name == def.name) {
                // Its warnings were given for the first.
                Some((same, _)) if *same == def => {}
                Some((_, first)) => {
                    return Err(format!(
                        "tool {}: {first} and {} define it differently; give one of them another tool.name",
                        def.name, action.origin
                    ))
                }
                None => {
                    self.warnings.extend(warnings);
                    out.push((def, &action.origin));
                }
            }
        }
        Ok(out.into_iter().map(|(d, _)| d).collect())
    }
}

/// Route metadata leaves as the filter reads them: strings and numbers (`idemd check` reads them so too).
pub(crate) fn annotation_leaves(origin: &str, meta: &Value) -> Result<HashMap<String, LeafValue>, String> {
    let Value::Object(map) = meta else {
        return Err(format!("{origin}: {ROUTE_NAMESPACE}: expected a map of annotation leaves"));
    };
    let mut leaves = HashMap::new();
    for (key, value) in map {
        if !ROUTE_KEYS.contains(&key.as_str()) {
            // The filter refuses such a route (every request gets 503) rather than guess what was meant.
            return Err(format!(
                "{origin}: {ROUTE_NAMESPACE}.{key}: unknown annotation field (expected one of: {}); the filter refuses the route",
                ROUTE_KEYS.join(", ")
            ));
        }
        let leaf = match value {
            Value::String(s) => LeafValue::Str(s.clone()),
            Value::Number(n) => match n.as_f64() {
                Some(f) => LeafValue::Num(f),
                None => return Err(format!("{origin}: {ROUTE_NAMESPACE}.{key}: {n} is not a number Envoy keeps")),
            },
            other => {
                return Err(format!(
                    "{origin}: {ROUTE_NAMESPACE}.{key}: {other} is neither a string nor a number (the filter reads only those; quote it)"
                ))
            }
        };
        leaves.insert(key.clone(), leaf);
    }
    Ok(leaves)
}

/// The agent filter's plugin configuration text if `f` is the agent filter: as proxy-wasm
/// (`config.root_id` or `config.name` is the namespace; `config.configuration.value`) or as the
/// native dynamic module (`filter_name` is the namespace; `filter_config.value`). `Some(None)`:
/// the filter, without a string configuration.
pub(crate) fn agent_filter(f: &Value) -> Option<Option<&str>> {
    let typed = f.get("typed_config")?;
    if let Some(c) = typed.get("config") {
        if [c.get("root_id"), c.get("name")].iter().any(|v| v.and_then(Value::as_str) == Some(ROUTE_NAMESPACE)) {
            return Some(c.pointer("/configuration/value").and_then(Value::as_str));
        }
    }
    let native = typed.get("@type").and_then(Value::as_str).is_some_and(|t| t.ends_with(".DynamicModuleFilter"));
    if native && typed.get("filter_name").and_then(Value::as_str) == Some(ROUTE_NAMESPACE) {
        return Some(typed.pointer("/filter_config/value").and_then(Value::as_str));
    }
    None
}

/// A route's annotation in the native module's per-route configuration (a JSON object of the
/// annotation fields in `filter_config.value`), if it has one for the filter named `filter`.
pub(crate) fn per_route_annotation(route: &Value, filter: &str) -> Option<Result<Value, String>> {
    let at = format!("/typed_per_filter_config/{}", filter.replace('~', "~0").replace('/', "~1"));
    let config = route.pointer(&at)?;
    let text = config.pointer("/filter_config/value").and_then(Value::as_str)?;
    Some(serde_json::from_str(text).map_err(|e| format!("per-route configuration of {filter}: not JSON: {e}")))
}

pub(crate) fn is_hcm(typed_config: &Value) -> bool {
    typed_config.get("@type").and_then(Value::as_str).is_some_and(|t| t.ends_with(".HttpConnectionManager"))
}

/// The action of `role` in the same scope, nearest first: the same MCP route
/// or virtual host, then the same kind (REST or MCP) of the same input, then
/// any; among equals the first listed.
fn partner<'a>(me: &Action, role: Role, actions: &'a [Action]) -> Option<&'a Action> {
    let rank = |a: &Action| {
        let kind = a.group.mcp.is_some() == me.group.mcp.is_some();
        match (a.group == me.group, kind && a.group.source == me.group.source, kind) {
            (true, _, _) => 0,
            (_, true, _) => 1,
            (_, _, true) => 2,
            _ => 3,
        }
    };
    actions
        .iter()
        .enumerate()
        .filter(|(_, a)| a.policy.role == role && a.policy.scope == me.policy.scope)
        .min_by_key(|(i, a)| (rank(a), *i))
        .map(|(_, a)| a)
}

/// When a route's approval rule asks a person, in words for the tool's description.
fn approval_when(rule: &idem_core::policy::approval::Approval) -> String {
    use idem_core::policy::approval::{Approval, CompareOp, Condition};
    fn words(c: &Condition) -> String {
        match c {
            Condition::All(items) => items.iter().map(words).collect::<Vec<_>>().join(" and "),
            Condition::Any(items) => format!("({})", items.iter().map(words).collect::<Vec<_>>().join(" or ")),
            Condition::Compare { pointer, op, value } => {
                let op = match op {
                    CompareOp::Gt => ">",
                    CompareOp::Gte => ">=",
                    CompareOp::Lt => "<",
                    CompareOp::Lte => "<=",
                    CompareOp::Eq => "=",
                };
                format!("`{}` {op} {value}", pointer.trim_start_matches('/'))
            }
            Condition::OneOf { pointer, values } => {
                format!("`{}` in {}", pointer.trim_start_matches('/'), values.join(", "))
            }
        }
    }
    match rule {
        Approval::Always => "Every call".to_string(),
        Approval::When(c) => format!("A call where {}", words(c)),
    }
}

/// The protocol in a few lines, after the annotation's own `tool.description`.
fn describe(action: &Action, actions: &[Action], warnings: &mut Vec<String>) -> String {
    let p = &action.policy;
    let quoted = |a: &Action| format!("`{}`", a.name);
    let protocol = match p.role {
        Role::Preview => {
            let confirm = partner(action, Role::Confirm, actions).map(quoted).unwrap_or_else(|| {
                warnings.push(format!("{}: no confirm route or tool has scope {}", action.origin, p.scope));
                "the confirm tool".to_string()
            });
            format!(
                "Returns a quote and a `fingerprint`. Show the quote to the user; to execute, call {confirm} with the \
                 same arguments and this fingerprint unchanged. The fingerprint is valid for {} seconds; after that, \
                 call this tool again.",
                p.fingerprint_ttl_s
            )
        }
        Role::Confirm => {
            let status = match &p.status_tool {
                Some(tool) => {
                    if !actions.iter().any(|a| a.name == *tool) {
                        warnings.push(format!(
                            "{}: status_tool {tool} is not an annotated status route or tool here",
                            action.origin
                        ));
                    }
                    Some(format!("`{tool}`"))
                }
                None => partner(action, Role::Status, actions).map(quoted),
            };
            let poll = match status {
                Some(tool) => format!("call {tool} with the fingerprint after `poll_after_ms`"),
                None => "call this tool again with the same arguments and fingerprint after `poll_after_ms`".into(),
            };
            let from_preview = match partner(action, Role::Preview, actions) {
                Some(tool) => format!("as {} returned it", quoted(tool)),
                None => "as the preview returned it".to_string(),
            };
            let approval = match &p.approval {
                None => String::new(),
                Some(rule) => format!(
                    " {} needs a person's approval first: the answer is then `approval_required` (nothing was \
                     executed); tell the user what awaits approval and where, and do not call this tool again until \
                     the status says `approved`; `rejected` means a person refused: do not retry.",
                    approval_when(rule)
                ),
            };
            // DESIGN §6, "Client keys are for programs": where the route takes programs' keys too, the
            // agent is told never to make one up (the article's §2).
            let keys = if p.client_keys {
                " Never send an `Idempotency-Key` of your own: a key you make up is new on every attempt and \
                 protects nothing; this route takes keys from programs only, and the fingerprint is what makes \
                 your retries safe."
            } else {
                ""
            };
            format!(
                "Executes exactly once per fingerprint. Pass `fingerprint` exactly {from_preview}; never invent or \
                 edit one.{keys} If the answer is `in_progress`, {poll}; `already_completed` means it was done \
                 earlier: report it, do not call again.{approval} Every answer has a `status` and an `instruction`: \
                 follow the instruction."
            )
        }
        _ => String::from(
            "Reports what became of a fingerprint's operation: `already_completed` (with its result), \
             `already_failed`, `in_progress` (ask again after `poll_after_ms`), `needs_review`, `not_executed` \
             (never confirmed), or where a person must approve it `awaiting_approval`, `approved` (confirm it \
             again now), `rejected`, `approval_lapsed`. Read-only: it never executes anything. Pass `fingerprint` exactly as the preview returned it.",
        ),
    };
    match p.tool.as_ref().and_then(|t| t.description.as_deref()) {
        Some(own) => format!("{own}\n{protocol}"),
        None => protocol,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_approval_rule_is_said_in_words() -> Result<(), idem_core::policy::Error> {
        use idem_core::canonical::{BoundField, FieldType};
        let bound =
            [BoundField::typed("/amount", FieldType::Decimal), BoundField::typed("/currency", FieldType::String)];
        let rule = idem_core::policy::approval::parse(
            r#"{"any": [{"field": "/amount", "gte": "1000"}, {"field": "/currency", "in": ["JPY", "KRW"]}]}"#,
            &bound,
        )?;
        assert_eq!(approval_when(&rule), "A call where (`amount` >= 1000 or `currency` in JPY, KRW)");
        let always = idem_core::policy::approval::parse("always", &bound)?;
        assert_eq!(approval_when(&always), "Every call");
        Ok(())
    }
}
