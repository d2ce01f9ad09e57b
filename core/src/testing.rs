//! What drives the machine outside a host: a fixed clock and nonce, a plugin configuration and
//! routes built from their annotation leaves. The machine's own tests, the fuzz harness and the
//! model checker build their inputs here, so a change to what the machine is given is made once.
//! Behind the `testing` feature (and in core's own tests): the filter builds (`make wasm`, `make native`) leave it out.

use crate::machine::{Ctx, Env};
use crate::policy::{parse_plugin_config, parse_route_policy, LeafValue, PluginConfig, RouteDefaults, RoutePolicy};
use std::rc::Rc;

pub type Error = Box<dyn std::error::Error>;

/// The host's clock and random source, fixed: `random: None` is a host whose random source failed.
#[derive(Debug, Clone, Copy)]
pub struct FixedEnv {
    pub now: u64,
    pub random: Option<[u8; 16]>,
}

impl FixedEnv {
    pub const fn at(now: u64, nonce: [u8; 16]) -> FixedEnv {
        FixedEnv { now, random: Some(nonce) }
    }
}

impl Env for FixedEnv {
    fn now_s(&self) -> u64 {
        self.now
    }
    fn random16(&mut self) -> Option<[u8; 16]> {
        self.random
    }
    /// No shared data: every replay goes to idemd.
    fn shared_get(&self, _key: &str) -> Option<Vec<u8>> {
        None
    }
}

/// A plugin configuration calling idemd at cluster `idemd`, signing with one key `k1` of
/// `secret`, the caller named by `x-agent-subject`; `extra` adds JSON members
/// (`"max_response_bytes":64`) or is empty.
pub fn plugin_config(secret: &str, extra: &str) -> Result<Rc<PluginConfig>, Error> {
    let extra = if extra.is_empty() { String::new() } else { format!(",{extra}") };
    let text = format!(
        r#"{{"sidecar_cluster":"idemd","keys":[{{"kid":"k1","secret":"{secret}"}}],"active_kid":"k1","subject":{{"header":"x-agent-subject"}}{extra}}}"#
    );
    Ok(Rc::new(parse_plugin_config(text.as_bytes(), &|_| None)?))
}

/// A route from the leaves of its annotation, as Envoy's route metadata carries them, with the
/// default route settings; a leaf given twice counts the last time. An unannotated route is an
/// error here.
pub fn route(leaves: &[(&str, &str)]) -> Result<Rc<RoutePolicy>, Error> {
    route_with(leaves, &RouteDefaults::default())
}

/// [`route`] under a plugin configuration's route defaults (`PluginConfig::defaults`).
pub fn route_with(leaves: &[(&str, &str)], defaults: &RouteDefaults) -> Result<Rc<RoutePolicy>, Error> {
    let get = |k: &str| leaves.iter().rev().find(|(key, _)| *key == k).map(|(_, v)| LeafValue::Str((*v).to_string()));
    Ok(Rc::new(parse_route_policy(&get, defaults)?.ok_or("the leaves annotate no route")?))
}

/// The machine's context for one stream.
pub fn ctx(config: &Rc<PluginConfig>, policy: &Rc<RoutePolicy>, trace_id: &str) -> Ctx {
    Ctx { config: Rc::clone(config), policy: Rc::clone(policy), trace_id: trace_id.to_string() }
}
