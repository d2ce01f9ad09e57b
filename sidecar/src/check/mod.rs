//! `idemd check`: refuse an Envoy configuration that leaves a path to a
//! guarded upstream around the annotations, or sends a confirm twice (DESIGN
//! §6, "No path around an annotation"), before it is deployed.
//!
//! The filter guards what Envoy routes to an annotated route (or what a route
//! rule matches). Anything else reaches the upstream untouched, so the check
//! denies by default (`ways`): for every listener and filter chain, virtual host
//! and route (and every mirror), it computes which upstream (`clusters`: a
//! cluster is the endpoints it sends to) and which upstream path (`paths`:
//! after prefix_rewrite, regex_rewrite, path templates) a request reaches, and
//! refuses every way to a guarded path that does not pass an annotated route
//! of the same kind with the filter in its chain:
//!
//! * the path is normalised before routing (`normalize_path`, `merge_slashes`,
//!   escaped slashes refused or decoded), so `//v1/transfers`, `/v1/./transfers`
//!   or `/v1%2Ftransfers` cannot miss the route annotated for `/v1/transfers`;
//! * no unannotated exact route lands on a guarded path (another virtual host,
//!   a rewrite, another cluster with the same endpoints), no listener without
//!   the filter reaches one, no preview or status route is rewritten onto one;
//! * no unannotated catch-all, prefix or pattern route reaches an upstream that
//!   serves a guarded route (a path that misses it by a byte reaches the same
//!   upstream), unless the filter's route rules take its requests;
//! * no mirror, hedge or internal redirect sends a confirm twice;
//! * what the check cannot follow (a cluster chosen per request, a rewrite it
//!   cannot compute, routes it cannot read, a filter after the agent filter that
//!   may re-route) is refused, saying why.
//!
//! There is no opt-out for what the check can follow: the fixes are always
//! available — explicit routes, a `direct_response`, another cluster, or route
//! rules. For an exact route it cannot follow, the operator may state in the
//! route's metadata that it reaches no guarded path
//! (`idemd_check: { reaches_no_guarded_path: "<why>" }`): printed, and never
//! applied to a way the check can show reaches one.
//!
//! The TTL rules (DESIGN §5) are checked against Envoy's own settings and
//! idemd's flags, which `idemd check` takes with the same variables and
//! defaults as `idemd serve` (`ttl`, `forward`); Envoy's retries against what
//! a retry may repeat (`retries`).
//!
//! Each rule is an entry of [`rules::RULES`] with a name every finding carries.
//!
//! On the ext_proc host the plugin configuration is idemd's (`--ext-proc-config`, as `idemd serve` takes
//! it): Envoy's ext_proc filter is then the agent filter, and its own settings are checked (`ext_proc`).
//!
//! Given the deployment's database (`IDEM_DATABASE_URL`), the check also says the replication
//! topology it sees and refuses what idemd would refuse on it (`topology`).

pub mod clusters;
pub mod ext_proc;
mod failure;
pub mod forward;
pub mod guard;
pub mod model;
pub mod paths;
mod retries;
pub mod rules;
pub mod settings;
#[cfg(test)]
mod testing;
pub mod topology;
mod ttl;
pub mod ways;

use std::process::ExitCode;

use crate::config::{CheckArgs, TtlArgs};
use model::EnvoyConfig;

/// What the rules read: one Envoy configuration, and idemd's flags.
pub struct Inputs<'a> {
    pub envoy: &'a EnvoyConfig,
    pub idemd: &'a TtlArgs,
}

/// One rule of `idemd check` (the table is `rules::RULES`; each rule's check lives with its kind:
/// `failure`, `retries`, `ttl`, `ways`, `ext_proc`, or `rules` itself).
pub struct Rule {
    /// The name a finding carries (and the docs use).
    pub name: &'static str,
    /// What the rule insists on, in one line.
    pub summary: &'static str,
    pub check: fn(&Rule, &Inputs, &mut Vec<Finding>),
}

impl Rule {
    pub(crate) fn finding(&self, at: impl Into<String>, message: impl Into<String>) -> Finding {
        Finding { rule: self.name, at: at.into(), message: message.into() }
    }
}

/// One reason to refuse a configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// The rule's name (`rules::RULES`).
    pub rule: &'static str,
    /// Where: `envoy/e2e.yaml: listener agents: virtual host transfers: route passthrough`.
    pub at: String,
    pub message: String,
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: [{}] {}", self.at, self.rule, self.message)
    }
}

/// What checking one file found.
#[derive(Debug)]
pub struct Report {
    pub findings: Vec<Finding>,
    /// What was not checked and why, and what deserves a look without refusing.
    pub notes: Vec<String>,
    /// Connection managers that run the filter, and routes read.
    pub managers_with_filter: usize,
    pub routes: usize,
}

/// Every rule over one configuration's text (`label` names it in findings) and idemd's flags;
/// `ext_proc_config`: the plugin configuration idemd's ext_proc host runs with (`--ext-proc-config`).
pub fn check_envoy(label: &str, yaml: &str, idemd: &TtlArgs, ext_proc_config: Option<&str>) -> Result<Report, String> {
    let config = EnvoyConfig::parse(label, yaml, ext_proc_config)?;
    let mut findings = Vec::new();
    let input = Inputs { envoy: &config, idemd };
    for rule in rules::RULES {
        (rule.check)(rule, &input, &mut findings);
    }
    let mut notes = config.notes.clone();
    notes.extend(ways::stated_safe_notes(&config));
    for m in config.managers.iter().filter(|m| m.filter.is_none()) {
        let annotated = m.routes.iter().flat_map(|t| &t.hosts).flat_map(|h| &h.routes).any(|r| r.annotation.is_some());
        if annotated {
            notes.push(format!("{}: annotated routes, but no agent filter runs here: they pass unguarded", m.at));
        }
    }
    Ok(Report {
        findings,
        notes,
        managers_with_filter: config.managers.iter().filter(|m| m.filter.is_some()).count(),
        routes: config.managers.iter().flat_map(|m| &m.routes).flat_map(|t| &t.hosts).map(|h| h.routes.len()).sum(),
    })
}

/// `idemd check`: exit 0 when every file passes every rule, 1 when a finding
/// refuses one (each printed with its rule), 2 when a file cannot be read.
pub fn main(args: CheckArgs) -> ExitCode {
    let mut refused = false;
    let ext_proc_config = match &args.ext_proc_config {
        Some(path) => match std::fs::read_to_string(path) {
            Ok(text) => Some(text),
            Err(e) => {
                eprintln!("idemd check: --ext-proc-config {}: cannot read: {e}", path.display());
                return ExitCode::from(2);
            }
        },
        None => None,
    };
    let database = topology::read_from_env();
    if let Some(t) = &database {
        println!("idemd check: {}", topology::describe(t));
    }
    for path in &args.envoy {
        let label = path.display().to_string();
        let report = std::fs::read_to_string(path).map_err(|e| format!("{label}: cannot read: {e}")).and_then(|text| {
            let mut report = check_envoy(&label, &text, &args.idemd, ext_proc_config.as_deref())?;
            let config = EnvoyConfig::parse(&label, &text, ext_proc_config.as_deref())?;
            match &database {
                Some(t) => report.findings.extend(topology::findings(&config, t)),
                None if topology::any_ignores_keys(&config) => report.notes.push(format!(
                    "{label}: a route's upstream ignores Idempotency-Key, and without IDEM_DATABASE_URL the \
                         check cannot say whether the database keeps its acquires through a failover"
                )),
                None => {}
            }
            Ok(report)
        });
        let report = match report {
            Ok(r) => r,
            Err(e) => {
                eprintln!("idemd check: {e}");
                return ExitCode::from(2);
            }
        };
        for note in &report.notes {
            eprintln!("idemd check: note: {note}");
        }
        for finding in &report.findings {
            eprintln!("idemd check: {finding}");
        }
        if report.findings.is_empty() {
            println!(
                "idemd check: {label}: ok ({} connection manager(s) running the filter, {} route(s), {} rules)",
                report.managers_with_filter,
                report.routes,
                rules::RULES.len()
            );
        } else {
            refused = true;
            println!("idemd check: {label}: REFUSED ({} finding(s))", report.findings.len());
        }
    }
    if refused {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
