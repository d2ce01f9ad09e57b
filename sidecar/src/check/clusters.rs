//! Which clusters are one upstream. A guarded path is a path of a process, not
//! of a cluster name: a second cluster with the demo's address reaches the same
//! handler as `demo`. So a cluster is read as the endpoints it sends to
//! (`address:port` of its `load_assignment`, hostnames included), an aggregate
//! cluster as its members, and a cluster that may send anywhere
//! (`ORIGINAL_DST`, the dynamic forward proxy) as every upstream. A cluster
//! whose endpoints come from elsewhere (EDS, CDS) is known by its name only.
//! The Host header a request is sent with does not make another upstream.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

/// What a cluster name stands for.
#[derive(Debug, Clone, Default)]
pub struct Clusters {
    /// By name: the endpoints (`127.0.0.1:8080`) or, when unknown, `cluster <name>`.
    identity: BTreeMap<String, BTreeSet<String>>,
    /// Clusters that may send a request to any address, and why.
    anywhere: BTreeMap<String, String>,
}

impl Clusters {
    /// The clusters of `static_resources.clusters`.
    pub fn parse(doc: &Value) -> Clusters {
        let mut raw: BTreeMap<String, &Value> = BTreeMap::new();
        for c in doc.pointer("/static_resources/clusters").and_then(Value::as_array).into_iter().flatten() {
            if let Some(name) = c.get("name").and_then(Value::as_str) {
                raw.insert(name.to_string(), c);
            }
        }
        let mut out = Clusters::default();
        for name in raw.keys() {
            let mut seen = BTreeSet::new();
            let (tokens, anywhere) = resolve(name, &raw, &mut seen);
            out.identity.insert(name.clone(), tokens);
            if let Some(why) = anywhere {
                out.anywhere.insert(name.clone(), why);
            }
        }
        out
    }

    fn tokens(&self, name: &str) -> BTreeSet<String> {
        self.identity.get(name).cloned().unwrap_or_else(|| BTreeSet::from([format!("cluster {name}")]))
    }

    /// Why `name` may send anywhere, if it may.
    pub fn anywhere(&self, name: &str) -> Option<&str> {
        self.anywhere.get(name).map(String::as_str)
    }

    /// Whether clusters `a` and `b` may send to one upstream, and how to say so.
    pub fn same_upstream(&self, a: &str, b: &str) -> Option<String> {
        if a == b {
            return Some(format!("cluster {a}"));
        }
        if let Some(why) = self.anywhere(a) {
            return Some(format!("cluster {a} ({why}), which may reach cluster {b}'s upstream"));
        }
        if let Some(why) = self.anywhere(b) {
            return Some(format!("cluster {a}, which cluster {b} ({why}) may reach"));
        }
        let shared: Vec<String> = self.tokens(a).intersection(&self.tokens(b)).cloned().collect();
        (!shared.is_empty()).then(|| format!("cluster {a}, the same upstream as cluster {b} ({})", shared.join(", ")))
    }
}

fn resolve(
    name: &str,
    raw: &BTreeMap<String, &Value>,
    seen: &mut BTreeSet<String>,
) -> (BTreeSet<String>, Option<String>) {
    let own = || BTreeSet::from([format!("cluster {name}")]);
    if !seen.insert(name.to_string()) {
        return (BTreeSet::new(), None);
    }
    let Some(c) = raw.get(name) else { return (own(), None) };
    let custom = c.pointer("/cluster_type/name").and_then(Value::as_str).unwrap_or_default();
    if custom.contains("aggregate") {
        let members = c.pointer("/cluster_type/typed_config/clusters").and_then(Value::as_array);
        let mut tokens = BTreeSet::new();
        let mut anywhere = None;
        for m in members.into_iter().flatten().filter_map(Value::as_str) {
            let (t, a) = resolve(m, raw, seen);
            tokens.extend(t);
            anywhere = anywhere.or(a);
        }
        tokens.extend(own());
        return (tokens, anywhere);
    }
    if custom.contains("dynamic_forward_proxy") {
        return (own(), Some("a dynamic forward proxy: the request's Host picks the address".into()));
    }
    if !custom.is_empty() {
        return (own(), Some(format!("cluster type {custom}, which this check does not know")));
    }
    if c.get("type").and_then(Value::as_str) == Some("ORIGINAL_DST") {
        return (own(), Some("ORIGINAL_DST: the connection's own destination picks the address".into()));
    }
    let mut tokens = BTreeSet::new();
    let endpoints = c.pointer("/load_assignment/endpoints").and_then(Value::as_array).into_iter().flatten();
    for lb in endpoints.filter_map(|e| e.get("lb_endpoints").and_then(Value::as_array)).flatten() {
        let Some(addr) = lb.pointer("/endpoint/address/socket_address") else { continue };
        let host = addr.get("address").and_then(Value::as_str).unwrap_or_default();
        let port = addr.get("port_value").map(|p| p.to_string()).unwrap_or_default();
        tokens.insert(format!("{}:{port}", host.to_lowercase()));
    }
    if tokens.is_empty() {
        tokens = own();
    }
    (tokens, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(name: &str, port: u16) -> Value {
        serde_json::json!({"name": name, "type": "STATIC", "load_assignment": {"cluster_name": name, "endpoints": [
            {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}
        ]}})
    }

    #[test]
    fn clusters_with_one_address_are_one_upstream() {
        let doc = serde_json::json!({"static_resources": {"clusters": [
            cluster("demo", 8080), cluster("demo_copy", 8080), cluster("idem", 9090),
            {"name": "both", "cluster_type": {"name": "envoy.clusters.aggregate", "typed_config": {"clusters": ["idem", "demo"]}}},
            {"name": "passthrough", "type": "ORIGINAL_DST"},
            {"name": "eds", "type": "EDS"}
        ]}});
        let c = Clusters::parse(&doc);
        assert!(c.same_upstream("demo", "demo").is_some());
        assert!(c.same_upstream("demo_copy", "demo").is_some_and(|how| how.contains("127.0.0.1:8080")));
        assert!(c.same_upstream("idem", "demo").is_none());
        assert!(c.same_upstream("both", "demo").is_some());
        assert!(c.same_upstream("passthrough", "demo").is_some());
        assert!(c.same_upstream("eds", "demo").is_none());
        assert!(c.same_upstream("eds", "eds").is_some());
        assert!(c.same_upstream("undefined", "demo").is_none());
    }
}
