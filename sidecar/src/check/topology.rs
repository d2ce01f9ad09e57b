//! `idemd check` and the database: what it promises across a failover (DESIGN §4, "The truth never goes
//! back in time"; docs/operations.md, "Topologies").
//!
//! Run in the deployment's environment, the check reads the database `idemd serve` would use
//! (`IDEM_DATABASE_URL`, and `IDEM_ACCEPT_ASYNC_FAILOVER_RISK`, as `serve` reads them) over one
//! connection of its own, writing nothing, and says the topology it sees. Against each configuration it
//! refuses what idemd would refuse at run time: every guarded route (and route rule) whose upstream ignores
//! `Idempotency-Key`, on a database that replicates asynchronously or whose replication it cannot read,
//! unless the risk was accepted (idemd would answer every confirm there `status_unavailable`); and a
//! standby (idemd would not start). The rule is the store's own ([`refusal`]): no second copy of it here.
//! Without a database URL it says so and judges nothing.

use std::time::Duration;

use idem_core::policy::UpstreamKeys;

use super::guard::acquiring;
use super::model::EnvoyConfig;
use super::Finding;
use crate::store::sql::replication::{read_url, refusal, waited, Mode, Replication};

/// The rule name the findings carry.
pub const RULE: &str = "replication";

/// How long the check waits for the database.
const READ_WITHIN: Duration = Duration::from_secs(5);

/// What the check read of the database, and whether the operator accepted the asynchronous risk.
pub struct Topology {
    pub replication: Replication,
    pub accept_async_failover_risk: bool,
}

/// The database `idemd serve` would use, from its variables. None: no `IDEM_DATABASE_URL`.
pub fn read_from_env() -> Option<Topology> {
    let url = std::env::var("IDEM_DATABASE_URL").ok().filter(|u| !u.trim().is_empty())?;
    // clap's reading of a boolean flag's variable: empty, 0, false, no, off, n, f are false.
    let accept = std::env::var("IDEM_ACCEPT_ASYNC_FAILOVER_RISK").is_ok_and(|v| {
        !matches!(v.trim().to_ascii_lowercase().as_str(), "" | "0" | "false" | "no" | "off" | "n" | "f")
    });
    let replication = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => waited(rt.block_on(read_url(&url, READ_WITHIN)), !accept),
        Err(e) => Replication::unknown(format!("cannot start a runtime to read it: {e}")),
    };
    Some(Topology { replication, accept_async_failover_risk: accept })
}

/// The line `idemd check` prints about the database.
pub fn describe(t: &Topology) -> String {
    let accepts = match t.replication.mode {
        Mode::Single | Mode::Sync => "every route",
        Mode::IdemdWaits => "every route (idemd waits for the standbys' flush after each write and read)",
        Mode::Standby => "nothing (idemd refuses to start on a standby)",
        Mode::Async | Mode::Unknown if t.accept_async_failover_risk => {
            "every route, with the asynchronous failover risk accepted (IDEM_ACCEPT_ASYNC_FAILOVER_RISK)"
        }
        Mode::Async | Mode::Unknown => "routes whose upstream honours Idempotency-Key",
    };
    format!("database replication: {} ({}); accepting {accepts}", t.replication.mode.as_str(), t.replication.detail)
}

/// What idemd would refuse of this configuration on this database: one finding per guarded route or route rule
/// (and MCP tool) whose upstream ignores keys, or one for a standby.
pub fn findings(config: &EnvoyConfig, t: &Topology) -> Vec<Finding> {
    let mode = t.replication.mode;
    if mode == Mode::Standby {
        return vec![Finding {
            rule: RULE,
            at: "database (IDEM_DATABASE_URL)".into(),
            message: format!(
                "a read-only standby ({}): idemd refuses to start on it; point IDEM_DATABASE_URL at the primary's \
                 read-write address",
                t.replication.detail
            ),
        }];
    }
    let Some(why) = refusal(mode, t.accept_async_failover_risk, true) else { return Vec::new() };
    let mut out = Vec::new();
    let mut refuse = |at: String, tool: Option<&str>| {
        let at = match tool {
            Some(tool) => format!("{at}: tool {tool}"),
            None => at,
        };
        out.push(Finding {
            rule: RULE,
            at,
            message: format!(
                "upstream_keys: ignored on a database idemd reads as `{}`: every confirm here would be refused \
                 (status_unavailable, nothing runs): {why}. Make commits wait for a standby, declare the route's \
                 upstream as honouring keys once it deduplicates on Idempotency-Key, or accept the risk",
                mode.as_str()
            ),
        });
    };
    for m in config.managers.iter().filter(|m| m.filter.is_some()) {
        let hosts = m.routes.as_ref().map(|t| t.hosts.as_slice()).unwrap_or(&[]);
        for host in hosts {
            for route in &host.routes {
                let Some(Ok(policy)) = &route.guard else { continue };
                for (tool, p) in acquiring(policy) {
                    if p.upstream_keys == UpstreamKeys::Ignored {
                        refuse(format!("{}: virtual host {}: {}", m.at, host.name, route.label), tool);
                    }
                }
            }
        }
        let rules = m.filter.as_ref().and_then(|f| f.settings.as_ref()).map(|s| s.rules.as_slice()).unwrap_or(&[]);
        for rule in rules {
            for (tool, p) in acquiring(&rule.policy) {
                if p.upstream_keys == UpstreamKeys::Ignored {
                    refuse(format!("{}: route rule {}", m.at, rule.name), tool);
                }
            }
        }
    }
    out
}

/// Whether any guarded route of the configuration has an upstream that ignores keys (worth a note when no
/// database was given).
pub fn any_ignores_keys(config: &EnvoyConfig) -> bool {
    let all = Topology { replication: Replication::unknown(String::new()), accept_async_failover_risk: false };
    !findings(config, &all).is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: &str = "envoy/e2e.yaml";

    fn config() -> EnvoyConfig {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let text = std::fs::read_to_string(root.join(CONFIG)).unwrap_or_default();
        EnvoyConfig::parse(CONFIG, &text, None).unwrap_or_else(|e| panic!("{CONFIG}: {e}"))
    }

    fn topology(mode: Mode, accept: bool) -> Topology {
        let replication = Replication { mode, ..Replication::single("read in a test") };
        Topology { replication, accept_async_failover_risk: accept }
    }

    #[test]
    fn an_async_database_refuses_the_routes_whose_upstream_ignores_keys() {
        let config = config();
        assert!(any_ignores_keys(&config), "{CONFIG} has a route whose upstream ignores keys");
        for mode in [Mode::Async, Mode::Unknown] {
            let found = findings(&config, &topology(mode, false));
            assert!(!found.is_empty(), "{mode:?}");
            assert!(found.iter().all(|f| f.rule == RULE && f.message.contains("upstream_keys: ignored")), "{found:?}");
            assert!(findings(&config, &topology(mode, true)).is_empty(), "the risk accepted: {mode:?}");
        }
        for mode in [Mode::Single, Mode::Sync, Mode::IdemdWaits] {
            assert!(findings(&config, &topology(mode, false)).is_empty(), "{mode:?}");
        }
        let standby = findings(&config, &topology(Mode::Standby, true));
        assert_eq!(standby.len(), 1, "{standby:?}");
        assert!(standby[0].message.contains("refuses to start"), "{standby:?}");
    }

    #[test]
    fn the_line_says_what_is_accepted() {
        assert!(describe(&topology(Mode::Sync, false)).starts_with("database replication: sync (read in a test)"));
        assert!(describe(&topology(Mode::Async, false)).ends_with("routes whose upstream honours Idempotency-Key"));
        assert!(describe(&topology(Mode::Async, true)).contains("risk accepted"));
        assert!(describe(&topology(Mode::IdemdWaits, false)).contains("accepting every route (idemd waits"));
    }
}
