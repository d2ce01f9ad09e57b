//! Envoy configurations as data, for tests that derive one configuration from
//! another: `idemd check`'s regression tests (sidecar/tests/check.rs) and the
//! generated configurations (tests/src/configs/). A [`Doc`] is the parsed YAML;
//! its parts are found by JSON pointer (every connection manager, virtual host
//! and route of every listener and filter chain), and the edits here are the
//! ones both suites make: add a virtual host, a listener, a cluster, a route,
//! or change a route's action.

use serde_json::{json, Value};

pub type Error = Box<dyn std::error::Error>;

/// The agent filter's namespace: `root_id` of the `.wasm`, `filter_name` of the native module.
pub const AGENT: &str = "agent_idempotency";
/// The `@type` of Envoy's ext_proc filter (the agent filter on the ext_proc host).
pub const EXT_PROC_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor";

/// A parsed Envoy configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Doc(pub Value);

impl Doc {
    pub fn parse(yaml: &str) -> Result<Doc, Error> {
        Ok(Doc(serde_norway::from_str(yaml)?))
    }

    /// The configuration as text Envoy and `idemd check` read: JSON, which is YAML. (Serialised through a YAML
    /// writer, serde_json's exact numbers would come out as maps wherever its `arbitrary_precision` is on.)
    pub fn to_yaml(&self) -> Result<String, Error> {
        Ok(serde_json::to_string_pretty(&self.0)?)
    }

    pub fn at(&self, pointer: &str) -> Result<&Value, Error> {
        self.0.pointer(pointer).ok_or_else(|| format!("no {pointer} in the configuration").into())
    }

    pub fn at_mut(&mut self, pointer: &str) -> Result<&mut Value, Error> {
        self.0.pointer_mut(pointer).ok_or_else(|| format!("no {pointer} in the configuration").into())
    }

    /// An object at `pointer`, to edit its fields.
    pub fn object_mut(&mut self, pointer: &str) -> Result<&mut serde_json::Map<String, Value>, Error> {
        self.at_mut(pointer)?.as_object_mut().ok_or_else(|| format!("{pointer} is not an object").into())
    }

    /// An array at `pointer`, created empty when absent.
    pub fn array_mut(&mut self, pointer: &str) -> Result<&mut Vec<Value>, Error> {
        let (parent, key) = pointer.rsplit_once('/').ok_or("a pointer names a field")?;
        let obj = self.object_mut(parent)?;
        obj.entry(key.to_string())
            .or_insert_with(|| json!([]))
            .as_array_mut()
            .ok_or_else(|| format!("{pointer} is not an array").into())
    }

    /// The `typed_config` of every HTTP connection manager, in listener and filter chain order.
    pub fn managers(&self) -> Vec<String> {
        let mut out = Vec::new();
        let listeners = self.0.pointer("/static_resources/listeners").and_then(Value::as_array);
        for (i, l) in listeners.into_iter().flatten().enumerate() {
            let chains = l.get("filter_chains").and_then(Value::as_array);
            for (j, c) in chains.into_iter().flatten().enumerate() {
                for (k, f) in c.get("filters").and_then(Value::as_array).into_iter().flatten().enumerate() {
                    let hcm = f.pointer("/typed_config/@type").and_then(Value::as_str);
                    if hcm.is_some_and(|t| t.ends_with(".HttpConnectionManager")) {
                        out.push(format!("/static_resources/listeners/{i}/filter_chains/{j}/filters/{k}/typed_config"));
                    }
                }
            }
        }
        out
    }

    /// Every virtual host of an inline route table.
    pub fn virtual_hosts(&self) -> Vec<String> {
        let mut out = Vec::new();
        for m in self.managers() {
            let hosts = self.0.pointer(&format!("{m}/route_config/virtual_hosts")).and_then(Value::as_array);
            out.extend((0..hosts.map_or(0, Vec::len)).map(|n| format!("{m}/route_config/virtual_hosts/{n}")));
        }
        out
    }

    /// Every route of every inline route table.
    pub fn routes(&self) -> Vec<String> {
        let mut out = Vec::new();
        for h in self.virtual_hosts() {
            let routes = self.0.pointer(&format!("{h}/routes")).and_then(Value::as_array);
            out.extend((0..routes.map_or(0, Vec::len)).map(|n| format!("{h}/routes/{n}")));
        }
        out
    }

    /// The first route named `name`.
    pub fn route_named(&self, name: &str) -> Result<String, Error> {
        self.routes()
            .into_iter()
            .find(|r| self.0.pointer(&format!("{r}/name")).and_then(Value::as_str) == Some(name))
            .ok_or_else(|| format!("no route named {name}").into())
    }

    /// The agent filter's index in the manager's `http_filters`, and its name there (the `.wasm`, the native
    /// module, or the ext_proc filter in front of idemd's ext_proc host).
    pub fn agent_filter(&self, manager: &str) -> Option<(usize, String)> {
        let filters = self.0.pointer(&format!("{manager}/http_filters")).and_then(Value::as_array)?;
        filters.iter().enumerate().find_map(|(i, f)| {
            let typed = f.get("typed_config")?;
            let wasm = typed.pointer("/config/root_id").and_then(Value::as_str) == Some(AGENT);
            let native = typed.get("filter_name").and_then(Value::as_str) == Some(AGENT);
            // The ext_proc host: Envoy's own ext_proc filter sends every stream to idemd, which is the filter.
            let ext_proc = typed.get("@type").and_then(Value::as_str) == Some(EXT_PROC_TYPE);
            (wasm || native || ext_proc)
                .then(|| (i, f.get("name").and_then(Value::as_str).unwrap_or_default().to_string()))
        })
    }

    /// The clusters of the configuration, by name.
    pub fn clusters(&self) -> Vec<String> {
        let list = self.0.pointer("/static_resources/clusters").and_then(Value::as_array);
        list.into_iter().flatten().filter_map(|c| c.get("name").and_then(Value::as_str)).map(str::to_string).collect()
    }

    /// Add a virtual host to the manager's route table, first (a Host it names exactly wins anyway).
    pub fn add_virtual_host(&mut self, manager: &str, host: Value) -> Result<(), Error> {
        self.array_mut(&format!("{manager}/route_config/virtual_hosts"))?.insert(0, host);
        Ok(())
    }

    /// Insert `route` into a virtual host's routes at `index` (clamped to the end).
    pub fn insert_route(&mut self, host: &str, index: usize, route: Value) -> Result<(), Error> {
        let routes = self.array_mut(&format!("{host}/routes"))?;
        routes.insert(index.min(routes.len()), route);
        Ok(())
    }

    pub fn add_cluster(&mut self, cluster: Value) -> Result<(), Error> {
        self.array_mut("/static_resources/clusters")?.push(cluster);
        Ok(())
    }

    /// A copy of listener `index` named `name` on `port`, without the agent filter in any of its chains when
    /// `without_filter`.
    pub fn copy_listener(&self, index: usize, name: &str, port: u16, without_filter: bool) -> Result<Value, Error> {
        let mut copy = Doc(self.at(&format!("/static_resources/listeners/{index}"))?.clone());
        copy.0["name"] = json!(name);
        copy.0["address"] = json!({"socket_address": {"address": "127.0.0.1", "port_value": port}});
        if without_filter {
            let wrapped = Doc(json!({"static_resources": {"listeners": [copy.0.clone()]}}));
            let mut wrapped = wrapped;
            for m in wrapped.managers() {
                if let Some((i, _)) = wrapped.agent_filter(&m) {
                    wrapped.array_mut(&format!("{m}/http_filters"))?.remove(i);
                }
            }
            copy = Doc(wrapped.at("/static_resources/listeners/0")?.clone());
        }
        Ok(copy.0)
    }

    pub fn add_listener(&mut self, listener: Value) -> Result<(), Error> {
        self.array_mut("/static_resources/listeners")?.push(listener);
        Ok(())
    }
}

/// A STATIC cluster named `name` that sends to `address:port`.
pub fn static_cluster(name: &str, address: &str, port: u16) -> Value {
    json!({
        "name": name, "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": address, "port_value": port}}}}
        ]}]}
    })
}

/// `typed_per_filter_config` that disables the filter named `filter` on a route or virtual host.
pub fn filter_disabled(filter: &str) -> Value {
    json!({filter: {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "disabled": true}})
}

#[cfg(test)]
mod tests {
    use super::*;

    const YAML: &str = r#"
static_resources:
  listeners:
  - name: a
    filter_chains:
    - filters:
      - name: hcm
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          route_config:
            virtual_hosts:
            - name: v
              domains: ["*"]
              routes:
              - { name: r, match: { path: /x }, route: { cluster: c } }
          http_filters:
          - name: envoy.filters.http.wasm
            typed_config: { config: { root_id: agent_idempotency } }
          - name: envoy.filters.http.router
  clusters:
  - { name: c }
"#;

    #[test]
    fn parts_are_found_and_edited_by_pointer() -> Result<(), Error> {
        let mut doc = Doc::parse(YAML)?;
        let m = doc.managers();
        assert_eq!(m.len(), 1);
        assert_eq!(doc.routes().len(), 1);
        assert_eq!(doc.agent_filter(&m[0]), Some((0, "envoy.filters.http.wasm".to_string())));
        let r = doc.route_named("r")?;
        doc.object_mut(&format!("{r}/route"))?.insert("prefix_rewrite".into(), json!("/y"));
        doc.add_virtual_host(&m[0], json!({"name": "w", "domains": ["w.example"], "routes": []}))?;
        assert_eq!(doc.virtual_hosts().len(), 2);
        let copy = doc.copy_listener(0, "b", 10001, true)?;
        doc.add_listener(copy)?;
        let m = doc.managers();
        assert_eq!(m.len(), 2);
        assert!(doc.agent_filter(&m[1]).is_none() && doc.agent_filter(&m[0]).is_some());
        doc.add_cluster(static_cluster("d", "127.0.0.1", 8080))?;
        assert_eq!(doc.clusters(), vec!["c", "d"]);
        let again = Doc::parse(&doc.to_yaml()?)?;
        assert_eq!(again, doc);
        Ok(())
    }
}
