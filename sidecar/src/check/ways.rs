//! Every way a request can reach a guarded upstream path, and whether it passes
//! the guard (DESIGN §6, "No path around an annotation"). Deny by default: a
//! way is safe only when the check can show it is.
//!
//! A **guarded path** is what the upstream of a route that acquires (confirm,
//! idempotent, an MCP route with a confirm tool; by annotation or by a route
//! rule) receives: its cluster — read as the endpoints it sends to
//! (`clusters`) — and its path after Envoy's rewrites (`paths`). Annotated
//! routes in a listener that does not run the filter count too: their
//! annotation says what the path is.
//!
//! A **way** is every forwarding route of every connection manager (every
//! listener and filter chain, every virtual host: a client picks the listener
//! and the Host), and every cluster it mirrors to, with the paths its upstream
//! receives. A way that may meet a guarded path on the same upstream passes the
//! guard only when the agent filter runs in its chain (not disabled on the
//! route or its virtual host) and guards it the same way: annotated for the
//! same kind of acquiring role (a REST confirm's path by a REST confirm or
//! idempotent route, an MCP endpoint's by an MCP route), or, unannotated, taken
//! by a route rule of that kind for every method the route lets through.
//!
//! What the check cannot decide — a cluster chosen per request
//! (`cluster_header`, a specifier plugin, a cluster that sends anywhere) or a
//! path it cannot compute (a regex rewrite of many paths, a pattern it cannot
//! evaluate) — is refused with the reason; for an exact route the operator may
//! state it safe in the route's metadata
//! (`idemd_check: { reaches_no_guarded_path: "<why>" }`), which the check
//! prints and never applies to a way it can show reaches a guarded path.

use idem_core::policy::rules::{PathMatch, RouteMatch, Segment};
use idem_core::policy::{Role, RouteDefaults, RoutePolicy};

use super::guard::{acquiring, guarded, may_meet};
use super::model::{filter_off, EnvoyConfig, Manager, Matcher, Route, Target, VirtualHost};
use super::paths::{self, Space};
use super::settings::{from_annotation, FilterSettings, RuleGuard};
use super::Rule;
use super::{Finding, Inputs};

/// Which acquiring requests a path takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A REST confirm or client-key route.
    Rest,
    /// An MCP endpoint with a confirm tool.
    Mcp,
}

impl Kind {
    fn of(policy: &RoutePolicy) -> Option<Kind> {
        if acquiring(policy).is_empty() {
            return None;
        }
        Some(if policy.role == Role::Mcp { Kind::Mcp } else { Kind::Rest })
    }

    fn what(self) -> &'static str {
        match self {
            Kind::Rest => "a confirm (or idempotent) route",
            Kind::Mcp => "an MCP route with a confirm tool",
        }
    }
}

/// A path the upstream of an acquiring route receives.
#[derive(Debug)]
pub struct GuardedPath<'a> {
    /// The route (or the rule via the route) it comes from.
    pub at: String,
    pub target: &'a Target,
    pub space: Space,
    pub kind: Kind,
    /// The rule it comes from, when a route rule guards it.
    pub rule: Option<&'a RuleGuard>,
}

/// A forwarding route (or one of its mirrors) and the paths its upstream receives.
pub struct Way<'a> {
    pub at: String,
    pub manager: &'a Manager,
    pub host: &'a VirtualHost,
    pub route: &'a Route,
    pub target: &'a Target,
    pub space: Space,
    /// A copy of the route's requests (`request_mirror_policies`), not the route's own forwarding.
    pub mirror: bool,
}

fn at(m: &Manager, host: &VirtualHost, r: &Route) -> String {
    format!("{}: virtual host {}: {}", m.at, host.name, r.label)
}

/// The paths a route rule takes, as a set.
fn rule_space(rule: &RouteMatch) -> Space {
    match &rule.path {
        PathMatch::Prefix(p) => Space::Prefix(p.clone()),
        PathMatch::Exact(segments) => {
            let segs: Vec<paths::Seg> = segments
                .iter()
                .map(|s| match s {
                    Segment::Literal(l) => paths::Seg::Lit(l.clone()),
                    Segment::Param(_) => paths::Seg::One,
                })
                .collect();
            if segs.iter().all(|s| matches!(s, paths::Seg::Lit(_))) {
                let text: Vec<&str> = segments
                    .iter()
                    .map(|s| match s {
                        Segment::Literal(l) => l.as_str(),
                        Segment::Param(_) => "",
                    })
                    .collect();
                Space::Exact(text.join("/"))
            } else {
                // The exact form starts with an empty segment (the leading `/`).
                Space::Template(segs.into_iter().skip_while(|s| *s == paths::Seg::Lit(String::new())).collect())
            }
        }
    }
}

/// Every guarded path of the configuration.
pub fn guarded_paths(config: &EnvoyConfig) -> Vec<GuardedPath<'_>> {
    let mut out = Vec::new();
    for g in guarded(config) {
        let Some(kind) = Kind::of(g.policy) else { continue };
        let r = g.route;
        let matched = match g.rule {
            Some(rule) => match &r.downstream {
                Space::Exact(d) => Space::Exact(d.clone()),
                _ => rule_space(&rule.matcher),
            },
            None => r.downstream.clone(),
        };
        let space = paths::upstream(&r.downstream, &matched, &r.rewrite);
        out.push(GuardedPath { at: g.at, target: &r.target, space, kind, rule: g.rule });
    }
    // Annotated routes where the filter does not read them (no filter, or one it cannot load): the annotation
    // still says what their upstream path is.
    let defaults = RouteDefaults::default();
    for m in config.managers.iter().filter(|m| m.filter.as_ref().and_then(|f| f.settings.as_ref()).is_none()) {
        for host in m.routes.iter().flat_map(|t| &t.hosts) {
            for r in &host.routes {
                let Some(meta) = &r.annotation else { continue };
                let Ok(Some(policy)) = from_annotation(meta, &defaults) else { continue };
                let Some(kind) = Kind::of(&policy) else { continue };
                let space = paths::upstream(&r.downstream, &r.downstream, &r.rewrite);
                out.push(GuardedPath { at: at(m, host, r), target: &r.target, space, kind, rule: None });
            }
        }
    }
    out
}

/// Every way to an upstream: each forwarding route, and each of its mirrors.
pub fn ways(config: &EnvoyConfig) -> Vec<Way<'_>> {
    let mut out = Vec::new();
    for m in &config.managers {
        for host in m.routes.iter().flat_map(|t| &t.hosts) {
            for r in &host.routes {
                let space = paths::upstream(&r.downstream, &r.downstream, &r.rewrite);
                if !matches!(r.target, Target::Local) {
                    let at = at(m, host, r);
                    out.push(Way {
                        at,
                        manager: m,
                        host,
                        route: r,
                        target: &r.target,
                        space: space.clone(),
                        mirror: false,
                    });
                }
                for mirror in &r.mirrors {
                    let at = format!("{}: its request mirror", at(m, host, r));
                    out.push(Way {
                        at,
                        manager: m,
                        host,
                        route: r,
                        target: mirror,
                        space: space.clone(),
                        mirror: true,
                    });
                }
            }
        }
    }
    out
}

/// Whether two targets may send to one upstream, and how to say so.
pub fn reach(config: &EnvoyConfig, a: &Target, b: &Target) -> Option<String> {
    match (a, b) {
        (Target::Local, _) | (_, Target::Local) => None,
        (Target::AnyCluster(why), _) => Some(format!("may reach any cluster ({why})")),
        (_, Target::AnyCluster(why)) => Some(format!("sends where a route that may reach any cluster ({why}) does")),
        (Target::Clusters(xs), Target::Clusters(ys)) => xs
            .iter()
            .flat_map(|x| ys.iter().map(move |y| (x, y)))
            .find_map(|(x, y)| config.clusters.same_upstream(x, y)),
    }
}

/// The filter's settings where it judges the way's requests, or why it does not.
pub fn filter_on<'a>(way: &Way<'a>) -> Result<&'a FilterSettings, String> {
    let m = way.manager;
    let Some(filter) = &m.filter else {
        return Err(format!("{} does not run the agent filter", m.at.rsplit(": ").next().unwrap_or(&m.at)));
    };
    let Some(settings) = &filter.settings else {
        if filter.ext_proc.as_ref().is_some_and(|e| !e.config_given) {
            return Err("the check was given no plugin configuration for the ext_proc filter there".into());
        }
        return Err("the agent filter there refuses its plugin configuration".into());
    };
    match filter_off(filter, way.host, way.route) {
        Some(why) => Err(format!("the agent filter is {why}")),
        None => Ok(settings),
    }
}

/// Methods that change nothing (RFC 9110 §9.2.1): the only ones a rule may let pass its path.
const SAFE_METHODS: [&str; 4] = ["GET", "HEAD", "OPTIONS", "TRACE"];

/// The methods `rule` lets pass its path unguarded that may change something (not safe): a rule
/// that lists one leaves a way to the guarded upstream path around the guard.
pub fn mutating_pass_methods(rule: &RuleGuard) -> Vec<&str> {
    rule.pass_methods.iter().map(String::as_str).filter(|m| !SAFE_METHODS.contains(m)).collect()
}

/// Whether `rule` guards every method `methods` lets through (None: every method) that could
/// change something. The filter guards a rule's path for every method (DESIGN §6): the rule's
/// own method runs its role, every other method is refused, except those in `pass_methods`,
/// which reach the upstream unguarded; only safe ones may (a GET list endpoint beside a
/// POST-only confirm), so a rule that lets a mutating method pass, where the route lets it
/// through, takes nothing.
pub fn rule_takes_every_method(rule: &RuleGuard, methods: &Option<Vec<String>>) -> bool {
    let mutating = mutating_pass_methods(rule);
    match methods {
        None => mutating.is_empty(),
        Some(ms) => !ms.iter().any(|m| mutating.iter().any(|x| x.eq_ignore_ascii_case(m))),
    }
}

/// A way that meets a guarded path without passing the guard, and why.
pub struct Hole<'a> {
    pub way: &'a Way<'a>,
    pub guarded: &'a GuardedPath<'a>,
    /// How the two meet on one upstream (`cluster demo`).
    pub upstream: String,
    pub why: String,
}

/// Why `way` does not pass the guard for `g`; None: it passes.
fn unguarded(way: &Way, g: &GuardedPath) -> Option<String> {
    if way.mirror {
        return Some("a mirrored copy never passes the guard".into());
    }
    let settings = match filter_on(way) {
        Ok(s) => s,
        Err(why) => return Some(why),
    };
    match &way.route.guard {
        Some(Ok(policy)) => match Kind::of(policy) {
            Some(k) if k == g.kind => None,
            _ => Some(format!("the route is annotated as {}, not as {}", policy.role.as_str(), g.kind.what())),
        },
        // The filter refuses every request to the route (route-annotation says so).
        Some(Err(_)) => None,
        None if way.route.annotation.is_some() => None,
        None => {
            let takes = |rule: &RuleGuard| {
                Kind::of(&rule.policy) == Some(g.kind)
                    && rule.matcher.host.is_none()
                    && rule_takes_every_method(rule, &way.route.methods)
            };
            let covered = match &way.route.downstream {
                Space::Exact(d) => {
                    settings.rules.iter().any(|r| takes(r) && may_meet(&r.matcher, &Matcher::Exact(d.clone())))
                }
                // A broad route carries a rule's requests, and the filter refuses their near misses: it passes for
                // the paths that rule guards, as long as the upstream receives the path the rule judged (a rewrite
                // would land paths the rule never matched on the rule's upstream path).
                _ => {
                    way.route.rewrite == paths::Rewrite::None
                        && g.rule.is_some_and(|gr| {
                            settings.rules.iter().any(|r| r.name == gr.name && r.matcher == gr.matcher && takes(r))
                        })
                }
            };
            if covered {
                return None;
            }
            let partly = settings
                .rules
                .iter()
                .find(|r| Kind::of(&r.policy) == Some(g.kind) && may_meet(&r.matcher, &way.route.matcher));
            Some(match partly {
                Some(r) if r.matcher.host.is_some() => {
                    format!("route rule {} takes only Host {}", r.name, r.matcher.host.as_deref().unwrap_or_default())
                }
                Some(r) if !rule_takes_every_method(r, &way.route.methods) => format!(
                    "route rule {} lets {} pass unguarded (pass_methods), and the route lets it through: only safe \
                     methods (GET, HEAD, OPTIONS, TRACE) may pass a guarded path",
                    r.name,
                    mutating_pass_methods(r).join(", ")
                ),
                _ => "the route is not annotated and no route rule takes its requests".into(),
            })
        }
    }
}

/// Every way that may meet a guarded path on the same upstream without passing the guard.
pub fn holes<'a>(ways: &'a [Way<'a>], guarded: &'a [GuardedPath<'a>], config: &EnvoyConfig) -> Vec<Hole<'a>> {
    let mut out = Vec::new();
    for way in ways {
        for g in guarded {
            let Some(upstream) = reach(config, way.target, g.target) else { continue };
            if !way.space.meets(&g.space) {
                continue;
            }
            if let Some(why) = unguarded(way, g) {
                out.push(Hole { way, guarded: g, upstream, why });
                break;
            }
        }
    }
    out
}

/// The analysis every rule of this module reads.
fn with_holes(input: &Inputs, each: &mut dyn FnMut(&Hole)) {
    let config = input.envoy;
    let ways = ways(config);
    let guarded = guarded_paths(config);
    for hole in holes(&ways, &guarded, config) {
        each(&hole);
    }
}

fn describe(hole: &Hole) -> String {
    let r = hole.way.route;
    let rewrite = match &r.rewrite {
        paths::Rewrite::None => String::new(),
        other => format!(" after {other}"),
    };
    format!(
        "{} sends {}{rewrite} to {} on {}, the path {} guards ({}), and {}",
        r.label,
        r.matcher,
        hole.way.space,
        hole.upstream,
        relative(hole.way, &hole.guarded.at),
        hole.guarded.space,
        hole.why
    )
}

/// The kind of hole a rule reports.
#[derive(PartialEq, Eq)]
enum HoleKind {
    Unfiltered,
    /// An annotated route the filter is disabled on: filter-disabled-on-annotated-route reports it.
    Disabled,
    Mirror,
    Role,
    Broad,
    Undecidable,
    Exact,
}

fn kind_of(hole: &Hole) -> HoleKind {
    let way = hole.way;
    let filtered = way.manager.filter.as_ref().is_some_and(|f| f.settings.is_some());
    if !filtered {
        HoleKind::Unfiltered
    } else if way.mirror {
        HoleKind::Mirror
    } else if way.route.annotation.is_some()
        && way.manager.filter.as_ref().is_some_and(|f| filter_off(f, way.host, way.route).is_some())
    {
        HoleKind::Disabled
    } else if way.route.annotation.is_some() {
        HoleKind::Role
    } else if way.route.matcher.is_broad() {
        HoleKind::Broad
    } else if matches!(way.space, Space::Unknown(_))
        || matches!(way.target, Target::AnyCluster(_))
        || matches!(hole.guarded.target, Target::AnyCluster(_))
        || matches!(hole.guarded.space, Space::Unknown(_))
        || hole.upstream.contains("may reach")
    {
        HoleKind::Undecidable
    } else {
        HoleKind::Exact
    }
}

pub(super) fn exact_route_to_guarded_path(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    with_holes(input, &mut |hole| {
        if kind_of(hole) != HoleKind::Exact {
            return;
        }
        let stated = match &hole.way.route.stated_safe {
            Some(why) => format!(
                " The route's idemd_check.reaches_no_guarded_path statement ({why:?}) is contradicted: the check \
                 follows this route."
            ),
            None => String::new(),
        };
        out.push(rule.finding(
            &hole.way.at,
            format!(
                "{}: a request there reaches the guarded upstream path unguarded (no fingerprint, no record: it \
                 executes). Annotate the route as {} for it, remove it, or send it elsewhere.{stated}",
                describe(hole),
                hole.guarded.kind.what()
            ),
        ));
    });
}

pub(super) fn unfiltered_listener_to_guarded_path(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    with_holes(input, &mut |hole| {
        if kind_of(hole) != HoleKind::Unfiltered {
            return;
        }
        out.push(rule.finding(
            &hole.way.at,
            format!(
                "{}: every request there reaches the guarded upstream unguarded. Add the agent filter to this \
                 connection manager's http_filters, or route nothing there to that upstream's guarded paths",
                describe(hole)
            ),
        ));
    });
    // A broad route in a chain without the filter reaches every path of a guarded upstream.
    let config = input.envoy;
    let clusters = guarded_clusters(config);
    for way in ways(config) {
        let r = way.route;
        if way.mirror || r.annotation.is_some() || !r.matcher.is_broad() || filtered(way.manager) {
            continue;
        }
        let Some((how, c)) = clusters.iter().find_map(|c| reach(config, way.target, c.target).map(|how| (how, c)))
        else {
            continue;
        };
        out.push(rule.finding(
            &way.at,
            format!(
                "{} sends {} to {how}, which serves {} ({}), and {}: any path there, the guarded ones too, reaches \
                 the upstream unguarded. Add the agent filter to this connection manager, or route only what the \
                 upstream serves unguarded, explicitly",
                r.label,
                r.matcher,
                short(config, &c.at),
                c.role,
                filter_on(&way).err().unwrap_or_default()
            ),
        ));
    }
}

/// `at` as seen from `way`: without its listener and virtual host when they are the way's.
fn relative<'a>(way: &Way, at: &'a str) -> &'a str {
    let Some(rest) = at.strip_prefix(way.manager.at.as_str()).and_then(|r| r.strip_prefix(": ")) else {
        // Another listener: from it on.
        return at.find(": listener ").and_then(|i| at.get(i + 2..)).unwrap_or(at);
    };
    rest.strip_prefix(&format!("virtual host {}: ", way.host.name)).unwrap_or(rest)
}

/// `at` without the configuration's own label.
fn short<'a>(config: &EnvoyConfig, at: &'a str) -> &'a str {
    at.strip_prefix(config.label.as_str()).map(|s| s.trim_start_matches(": ")).unwrap_or(at)
}

pub(super) fn role_on_guarded_path(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    with_holes(input, &mut |hole| {
        if kind_of(hole) != HoleKind::Role {
            return;
        }
        out.push(rule.finding(
            &hole.way.at,
            format!(
                "{}: the filter guards its requests as the route says, so a request there reaches the guarded \
                 upstream path without what {} asks (a fingerprint verified and an operation acquired). Give the \
                 route the role its upstream path has, or rewrite it elsewhere",
                describe(hole),
                hole.guarded.kind.what()
            ),
        ));
    });
}

pub(super) fn undecidable_route(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    with_holes(input, &mut |hole| {
        if kind_of(hole) != HoleKind::Undecidable || hole.way.route.stated_safe.is_some() {
            return;
        }
        out.push(rule.finding(
            &hole.way.at,
            format!(
                "{}: the check cannot tell whether it reaches the guarded path, so it refuses it. Route it \
                 explicitly (a cluster and a path the check can follow), or, if you know it reaches no guarded \
                 path, say so in the route's metadata: `filter_metadata: {{ idemd_check: {{ \
                 reaches_no_guarded_path: \"<why>\" }} }}`",
                describe(hole)
            ),
        ));
    });
}

/// Undecidable routes the operator stated safe: said, never silently passed.
pub fn stated_safe_notes(config: &EnvoyConfig) -> Vec<String> {
    let ways = ways(config);
    let guarded = guarded_paths(config);
    let mut notes = Vec::new();
    for hole in holes(&ways, &guarded, config) {
        if kind_of(&hole) == HoleKind::Undecidable {
            if let Some(why) = &hole.way.route.stated_safe {
                notes.push(format!(
                    "{}: not followed ({}); accepted on the operator's statement that it reaches no guarded path: {why:?}",
                    hole.way.at, hole.way.space
                ));
            }
        }
    }
    notes
}

pub(super) fn request_mirror(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    // A mirror of an acquiring request: one confirm sent twice.
    for g in guarded(input.envoy) {
        if Kind::of(g.policy).is_none() || g.route.mirrors.is_empty() {
            continue;
        }
        out.push(rule.finding(
            &g.at,
            format!(
                "the route mirrors its requests (request_mirror_policies of the route or its virtual host), and it \
                 acquires: every confirm is sent twice, and an upstream that does not deduplicate by \
                 Idempotency-Key (or a mirror that reaches another copy of it) executes it twice. Remove the mirror \
                 from {}",
                g.route.label
            ),
        ));
    }
    // A mirror of any other route that lands on a guarded path.
    with_holes(input, &mut |hole| {
        if kind_of(hole) != HoleKind::Mirror {
            return;
        }
        let acquiring_route =
            hole.way.route.guard.as_ref().is_some_and(|p| p.as_ref().is_ok_and(|p| Kind::of(p).is_some()));
        if acquiring_route {
            return;
        }
        out.push(rule.finding(
            &hole.way.at,
            format!("{}: the copy reaches the guarded upstream path unguarded. Remove the mirror", describe(hole)),
        ));
    });
}

pub(super) fn hedge_on_guarded_route(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    for g in guarded(input.envoy) {
        let (Some(_), Some(hedge)) = (Kind::of(g.policy), &g.route.hedge_policy) else { continue };
        out.push(rule.finding(
            &g.at,
            format!(
                "a hedge_policy ({hedge}) on a route that acquires: Envoy may send a second attempt while the first \
                 still runs, and only one answer reaches the filter. Remove the hedge policy (the route's, or its \
                 virtual host's)"
            ),
        ));
    }
}

pub(super) fn internal_redirect_on_guarded_route(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    for g in guarded(input.envoy) {
        if Kind::of(g.policy).is_none() || !g.route.internal_redirect {
            continue;
        }
        out.push(rule.finding(
            &g.at,
            "internal_redirect_policy on a route that acquires: when the upstream answers a redirect, Envoy sends \
             the confirm again itself, and the filter never sees the first answer (it may have executed). Remove \
             the internal redirect policy",
        ));
    }
}

pub(super) fn unreadable_routes(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    let config = input.envoy;
    let anything_guarded = !guarded_clusters(config).is_empty();
    for m in &config.managers {
        let Some(why) = &m.routes_unread else { continue };
        if m.filter.is_none() && !anything_guarded {
            continue;
        }
        out.push(rule.finding(
            &m.at,
            format!(
                "its routes cannot be read ({why}), so the check cannot show that none of them reaches a guarded \
                 path around the filter. Give the check the route table: inline, or an RDS file \
                 (path_config_source), or scoped routes listed inline with their route configurations in a file"
            ),
        ));
    }
}

/// The HTTP filters that may run after the agent filter: none of them changes the path or picks another route.
const AFTER_FILTER_SAFE: &[&str] = &[
    "envoy.extensions.filters.http.router.v3.Router",
    "envoy.extensions.filters.http.upstream_codec.v3.UpstreamCodec",
    "envoy.extensions.filters.http.buffer.v3.Buffer",
    "envoy.extensions.filters.http.cors.v3.Cors",
    "envoy.extensions.filters.http.compressor.v3.Compressor",
    "envoy.extensions.filters.http.grpc_stats.v3.FilterConfig",
    "envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
    "envoy.extensions.filters.http.fault.v3.HTTPFault",
    "envoy.extensions.filters.http.rbac.v3.RBAC",
    "envoy.extensions.filters.http.health_check.v3.HealthCheck",
];

pub(super) fn filter_after_agent(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    for m in input.envoy.managers.iter().filter(|m| m.filter.is_some()) {
        for kind in m.after_filter.iter().filter(|k| !AFTER_FILTER_SAFE.contains(&k.as_str())) {
            out.push(rule.finding(
                &m.at,
                format!(
                    "{kind} runs after the agent filter: a filter there may change the path or headers and make \
                     Envoy pick another route after the agent filter judged the request, so a guarded confirm could \
                     leave by a route the filter never saw. Put it before the agent filter"
                ),
            ));
        }
    }
}

/// A cluster that serves an annotated route or a route rule's requests (any role), where the filter runs.
pub struct GuardedCluster<'a> {
    pub at: String,
    pub target: &'a Target,
    pub role: &'static str,
    /// The rule it comes from, when a route rule guards it.
    pub rule: Option<&'a RuleGuard>,
}

/// What the catch-all rule protects: every upstream an annotated route (any role, any listener) or a route
/// rule sends to. A broad route to one reaches its near misses.
pub fn guarded_clusters(config: &EnvoyConfig) -> Vec<GuardedCluster<'_>> {
    let mut out: Vec<GuardedCluster> = guarded(config)
        .into_iter()
        .map(|g| GuardedCluster { at: g.at, target: &g.route.target, role: g.policy.role.as_str(), rule: g.rule })
        .collect();
    for m in &config.managers {
        for host in m.routes.iter().flat_map(|t| &t.hosts) {
            for r in host.routes.iter().filter(|r| r.annotation.is_some() && !matches!(r.target, Target::Local)) {
                if r.guard.is_none() {
                    out.push(GuardedCluster { at: at(m, host, r), target: &r.target, role: "annotated", rule: None });
                }
            }
        }
    }
    out
}

pub(super) fn catch_all_to_guarded_cluster(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    let config = input.envoy;
    let clusters = guarded_clusters(config);
    for way in ways(config) {
        let r = way.route;
        // A chain without the filter is unfiltered-listener-to-guarded-path's.
        if way.mirror || r.annotation.is_some() || !r.matcher.is_broad() || !filtered(way.manager) {
            continue;
        }
        let (settings, filter_off) = match filter_on(&way) {
            Ok(s) => (Some(s), String::new()),
            Err(e) => (None, format!(" ({e})")),
        };
        report_catch_all(rule, config, &way, &clusters, &filter_off, settings, out);
    }
}

/// The agent filter runs in the chain with a configuration it accepts.
fn filtered(m: &Manager) -> bool {
    m.filter.as_ref().is_some_and(|f| f.settings.is_some())
}

fn report_catch_all(
    rule: &Rule,
    config: &EnvoyConfig,
    way: &Way,
    clusters: &[GuardedCluster],
    filter_off: &str,
    settings: Option<&FilterSettings>,
    out: &mut Vec<Finding>,
) {
    let r = way.route;
    let mut hits: Vec<(String, Vec<&str>)> = Vec::new();
    for c in clusters {
        let Some(how) = reach(config, way.target, c.target) else { continue };
        // The filter applies its route rules to every route of its chain and refuses their near misses and
        // every method on their paths but the pass_methods; a mutating method a rule lets pass matters only where
        // the route's paths meet the rule's; a rewrite sends paths no rule matched onto the upstream paths the
        // rules guard.
        let covered = r.rewrite == paths::Rewrite::None
            && c.rule.is_some_and(|cr| {
                settings.is_some_and(|s| {
                    s.rules.iter().any(|x| x.name == cr.name && x.matcher == cr.matcher)
                        && (rule_takes_every_method(cr, &r.methods) || !r.downstream.meets(&rule_space(&cr.matcher)))
                })
            });
        if covered {
            continue;
        }
        let label = relative(way, &c.at);
        match hits.iter_mut().find(|(h, _)| *h == how) {
            Some((_, labels)) if !labels.contains(&label) => labels.push(label),
            Some(_) => {}
            None => hits.push((how, vec![label])),
        }
    }
    for (how, labels) in hits {
        let shown: Vec<&str> = labels.iter().copied().take(4).collect();
        let more = if labels.len() > shown.len() { ", …" } else { "" };
        let how = match &r.target {
            Target::AnyCluster(_) => how,
            _ => format!("reaches {how}"),
        };
        out.push(rule.finding(
            &way.at,
            format!(
                "{} is not annotated{filter_off} and {how}, which also serves guarded routes ({}{more}): a path \
                 that misses a guarded route by a byte (/v1/transfers/, /V1/transfers), or another method, reaches \
                 the upstream unguarded. Route what the upstream serves explicitly, answer the rest with a \
                 direct_response (404), or send it to a cluster that serves no guarded route",
                r.matcher,
                shown.join(", ")
            ),
        ));
    }
}
