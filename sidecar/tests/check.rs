//! `idemd check`, the binary itself (DESIGN §6, "No path around an annotation";
//! DESIGN §5, the TTL rules against Envoy's own settings): every committed
//! Envoy configuration passes with idemd's defaults (what `make run`, the
//! compose file and deploy/ run idemd with); for each rule, a copy of a
//! committed configuration broken the way that rule is about is refused (exit
//! status 1) with the rule, the listener and the route named; what a rule
//! allows (a catch-all to a cluster that serves no guarded route, Istio's
//! catch-all with route rules, UNESCAPE_AND_FORWARD) passes.

use std::path::{Path, PathBuf};
use std::process::Command;

use idem_testkit::envoy_config::{filter_disabled, static_cluster, Doc};
use serde_json::{json, Value};

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// The variables of idemd's TTL flags: none leaks in from the environment running the tests.
const IDEMD_VARS: [&str; 6] = [
    "IDEM_LEASE_MS",
    "IDEM_UPSTREAM_WORST_CASE_MS",
    "IDEM_GATEWAY_TIMEOUT_MS",
    "IDEM_RETRY_BACKOFF_TOTAL_MS",
    "IDEM_TERMINAL_RETENTION_S",
    "IDEM_RETRY_WINDOW_S",
];

/// The committed configuration of the ext_proc host (or an edited copy under its name), and the plugin
/// configuration idemd serves it with.
const EXT_PROC_CONFIGURATION: &str = "ext-proc.yaml";
const EXT_PROC_PLUGIN_CONFIG: &str = "envoy/ext-proc-config.json";

fn check(files: &[&Path]) -> Result<Run, Box<dyn std::error::Error>> {
    check_with(files, &[], &[])
}

/// `idemd check` on `files` with more arguments and variables (idemd's flags).
fn check_with(files: &[&Path], args: &[&str], vars: &[(&str, &str)]) -> Result<Run, Box<dyn std::error::Error>> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idemd"));
    cmd.arg("check").current_dir(repo());
    for var in IDEMD_VARS {
        cmd.env_remove(var);
    }
    cmd.envs(vars.iter().copied()).args(args);
    // envoy/ext-proc.yaml runs the ext_proc host: its plugin configuration is idemd's file, given as `serve` is.
    let ext_proc = files.iter().any(|f| f.file_name().is_some_and(|n| n == EXT_PROC_CONFIGURATION));
    if ext_proc && !args.iter().any(|a| a.starts_with("--ext-proc-config")) {
        cmd.arg("--ext-proc-config").arg(EXT_PROC_PLUGIN_CONFIG);
    }
    for f in files {
        cmd.arg("--envoy").arg(f);
    }
    let out = cmd.output()?;
    Ok(Run { code: out.status.code(), stdout: String::from_utf8(out.stdout)?, stderr: String::from_utf8(out.stderr)? })
}

fn committed(name: &str) -> Result<String, Box<dyn std::error::Error>> {
    Ok(std::fs::read_to_string(repo().join("envoy").join(name))?)
}

/// envoy/e2e.yaml without the route it holds misconfigured on purpose (same scope as an approval route, without
/// the rule: `approval-per-scope` refuses it, `every_committed_configuration_passes` checks that), so that an
/// edit of it tests one rule at a time.
fn committed_e2e() -> Result<String, Box<dyn std::error::Error>> {
    edit(&committed("e2e.yaml")?, &format!("{UNRULED_HEAD}{}", UNRULED_ROUTE.join("\n")), "")
}

const UNRULED_HEAD: &str = "              # The same scope without the rule (a route that forgot it): idemd's insert still refuses\n              # an operation whose approval a person has not given.\n";
const UNRULED_ROUTE: [&str; 12] = [
    "              - name: approval_confirm_unruled",
    "                match: { path: /unruled/v1/transfers, headers: [{ name: \":method\", string_match: { exact: POST } }] }",
    "                route: { cluster: demo, prefix_rewrite: /v1/transfers, timeout: 15s }",
    "                metadata:",
    "                  filter_metadata:",
    "                    agent_idempotency:",
    "                      role: confirm",
    "                      upstream_keys: honoured",
    "                      scope: payments.large_transfer",
    "                      bind: \"/amount:decimal, /currency:string, /payee_id:string\"",
    "                      status_tool: get_transfer_status",
    "",
];

/// `text` with `from` replaced (exactly once) by `to`: an edit that matches nothing must not test the unedited file.
fn edit(text: &str, from: &str, to: &str) -> Result<String, Box<dyn std::error::Error>> {
    match text.matches(from).count() {
        1 => Ok(text.replacen(from, to, 1)),
        n => Err(format!("expected one {from:?} to edit, found {n}").into()),
    }
}

/// Write `text` into `dir` as `name` and check it.
fn check_text(dir: &Path, name: &str, text: &str) -> Result<Run, Box<dyn std::error::Error>> {
    let path = dir.join(name);
    std::fs::write(&path, text)?;
    check(&[&path])
}

/// Refused: exit 1, and a finding line naming `rule` at `at` (a substring of where it is).
fn assert_refused(run: &Run, rule: &str, at: &str) {
    assert_eq!(run.code, Some(1), "refused:\n{}{}", run.stdout, run.stderr);
    let tag = format!("[{rule}]");
    assert!(
        run.stderr.lines().any(|l| l.contains(&tag) && l.contains(at)),
        "a finding [{rule}] at {at:?}:\n{}",
        run.stderr
    );
    assert!(run.stdout.contains("REFUSED"), "{}", run.stdout);
}

fn assert_ok(run: &Run) {
    assert_eq!(run.code, Some(0), "accepted:\n{}{}", run.stdout, run.stderr);
    assert!(!run.stderr.contains("] "), "no finding: {}", run.stderr);
}

/// envoy/bench.yaml with envoy/bench-empty.yaml spliced in at its marker, as filter-bench runs it.
fn bench_as_run() -> Result<String, Box<dyn std::error::Error>> {
    let marker = "  # @empty-listener (envoy/bench-empty.yaml, spliced in here by filter-bench)\n";
    let fragment: String =
        committed("bench-empty.yaml")?.lines().filter(|l| !l.starts_with('#')).map(|l| format!("{l}\n")).collect();
    edit(&committed("bench.yaml")?, marker, &fragment)
}

/// Every Envoy configuration under envoy/ (a new one is checked without being listed here), relative to the
/// repository. Two files are not whole configurations: bench-empty.yaml (a listener filter-bench splices into
/// bench.yaml, checked so) and e2e-rds-routes.yaml (the RDS file e2e-rds.yaml names, checked through it).
fn committed_configurations() -> Result<Vec<PathBuf>, Box<dyn std::error::Error>> {
    let fragments = ["bench-empty.yaml", "e2e-rds-routes.yaml"];
    let mut files: Vec<PathBuf> =
        std::fs::read_dir(repo().join("envoy"))?.map(|e| e.map(|e| e.path())).collect::<Result<_, _>>()?;
    files.retain(|p| p.extension().is_some_and(|e| e == "yaml"));
    files.retain(|p| !fragments.iter().any(|f| p.ends_with(f)));
    files.sort();
    let rel: Vec<PathBuf> =
        files.iter().map(|p| p.strip_prefix(repo()).map(Path::to_path_buf)).collect::<Result<_, _>>()?;
    assert!(rel.len() >= 8, "{rel:?}");
    Ok(rel)
}

/// With idemd's defaults: the settings `make run`, docker-compose.yml and deploy/ run idemd with.
#[test]
fn every_committed_configuration_passes() -> TestResult {
    let (fixture, rel): (Vec<PathBuf>, Vec<PathBuf>) = committed_configurations()?
        .into_iter()
        .filter(|p| !p.ends_with("bench.yaml"))
        .partition(|p| p.ends_with("e2e.yaml"));
    let refs: Vec<&Path> = rel.iter().map(PathBuf::as_path).collect();
    let run = check(&refs)?;
    assert_ok(&run);
    for f in &rel {
        assert!(run.stdout.contains(&format!("{}: ok", f.display())), "{}: {}", f.display(), run.stdout);
    }
    // The RDS file was read, not skipped.
    assert!(!run.stderr.contains("not checked"), "{}", run.stderr);

    // The e2e fixture holds one misconfiguration on purpose, for the defence behind this rule (idemd's
    // insert refuses an unapproved operation on a route that forgot the approval rule, tests/tests/approval.rs):
    // it is refused for that and for nothing else.
    let refs: Vec<&Path> = fixture.iter().map(PathBuf::as_path).collect();
    assert_eq!(refs.len(), 1, "{fixture:?}");
    let run = check(&refs)?;
    assert_refused(&run, "approval-per-scope", "route approval_confirm_unruled");
    let findings: Vec<&str> = run.stderr.lines().filter(|l| l.contains("] ")).collect();
    assert_eq!(findings.len(), 1, "{findings:?}");
    assert!(findings.iter().all(|l| l.contains("is confirmed at") && l.contains("approval_confirm")), "{findings:?}");

    // bench.yaml's baselines are plain Envoy on the same route table: listeners that reach the demo's confirm
    // without the filter, on purpose (make bench measures what the filter costs against them). It is refused for
    // them and for nothing else; it is a benchmark, never a deployment.
    let dir = tempfile::tempdir()?;
    let baselines = |run: &Run, listeners: &[&str]| {
        assert_eq!(run.code, Some(1), "{}{}", run.stdout, run.stderr);
        let findings: Vec<&str> = run.stderr.lines().filter(|l| l.contains("] ")).collect();
        assert!(findings.iter().all(|l| l.contains("[unfiltered-listener-to-guarded-path]")), "{findings:?}");
        for l in listeners {
            assert!(findings.iter().any(|f| f.contains(&format!("listener {l}: "))), "{l}: {findings:?}");
        }
        assert_eq!(findings.len(), listeners.len(), "{findings:?}");
    };
    baselines(&check(&[Path::new("envoy/bench.yaml")])?, &["plain", "buffered"]);
    baselines(&check_text(dir.path(), "bench-as-run.yaml", &bench_as_run()?)?, &["plain", "buffered", "empty"]);
    Ok(())
}

const NORMALIZE: &str = "          normalize_path: true\n";
const MERGE: &str = "          merge_slashes: true\n";
const ESCAPED: &str = "          path_with_escaped_slashes_action: REJECT_REQUEST\n";

#[test]
fn a_connection_manager_without_normalize_path_is_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let run = check_text(dir.path(), "e2e.yaml", &edit(&committed_e2e()?, NORMALIZE, "")?)?;
    assert_refused(&run, "normalize-path", "e2e.yaml: listener agents");
    let run = check_text(
        dir.path(),
        "native.yaml",
        &edit(&committed("native.yaml")?, NORMALIZE, "          normalize_path: false\n")?,
    )?;
    assert_refused(&run, "normalize-path", "native.yaml: listener agents");
    // Istio's shape: the mesh's catch-all only needs the normalisation and the rules.
    let run = check_text(dir.path(), "istio-like.yaml", &edit(&committed("istio-like.yaml")?, NORMALIZE, "")?)?;
    assert_refused(&run, "normalize-path", "istio-like.yaml: listener virtualInbound");
    Ok(())
}

#[test]
fn a_connection_manager_without_merge_slashes_is_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let run = check_text(dir.path(), "envoy.yaml", &edit(&committed("envoy.yaml")?, MERGE, "")?)?;
    assert_refused(&run, "merge-slashes", "envoy.yaml: listener agents");
    // Only the broken rule speaks.
    assert!(!run.stderr.contains("[normalize-path]") && !run.stderr.contains("[catch-all"), "{}", run.stderr);
    Ok(())
}

#[test]
fn escaped_slashes_passed_unchanged_are_refused_decoded_or_refused_they_pass() -> TestResult {
    let dir = tempfile::tempdir()?;
    let e2e = committed_e2e()?;
    let run = check_text(dir.path(), "unset.yaml", &edit(&e2e, ESCAPED, "")?)?;
    assert_refused(&run, "escaped-slashes", "unset.yaml: listener agents");
    for unsafe_action in ["KEEP_UNCHANGED", "IMPLEMENTATION_SPECIFIC_DEFAULT"] {
        let text = edit(&e2e, ESCAPED, &format!("          path_with_escaped_slashes_action: {unsafe_action}\n"))?;
        let run = check_text(dir.path(), "kept.yaml", &text)?;
        assert_refused(&run, "escaped-slashes", "kept.yaml: listener agents");
        assert!(run.stderr.contains(unsafe_action), "{}", run.stderr);
    }
    // Decoded (Istio's DECODE_AND_MERGE_SLASHES) or redirected: the route table sees the decoded path.
    for safe in ["UNESCAPE_AND_FORWARD", "UNESCAPE_AND_REDIRECT"] {
        let text = edit(&e2e, ESCAPED, &format!("          path_with_escaped_slashes_action: {safe}\n"))?;
        assert_ok(&check_text(dir.path(), "decoded.yaml", &text)?);
    }
    // bench.yaml's baselines are held to it too (the filter runs on `rules` as on `agents`).
    let bench = committed("bench.yaml")?;
    let broken = bench.replacen(ESCAPED, "", 4);
    assert_eq!(broken.matches(ESCAPED).count(), 0, "bench.yaml's four listeners all set it");
    let run = check_text(dir.path(), "bench.yaml", &broken)?;
    assert_refused(&run, "escaped-slashes", "bench.yaml: listener rules");
    Ok(())
}

/// The committed e2e.yaml's 404 route, and the same route sending everything to the demo instead.
const NO_ROUTE: &str = "              - name: no_route\n                match: { prefix: / }\n                direct_response: &no_route\n";
const PASSTHROUGH: &str = "              - name: passthrough\n                match: { prefix: / }\n                route: { cluster: demo }\n              - name: no_route\n                match: { prefix: / }\n                direct_response: &no_route\n";

#[test]
fn a_catch_all_to_a_cluster_that_serves_guarded_routes_is_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let e2e = committed_e2e()?;
    // The catch-all the configuration had: every near miss of an annotated route reached the demo.
    let run = check_text(dir.path(), "e2e.yaml", &edit(&e2e, NO_ROUTE, PASSTHROUGH)?)?;
    assert_refused(&run, "catch-all-to-guarded-cluster", "listener agents: virtual host transfers: route passthrough");
    assert!(run.stderr.contains("reaches cluster demo"), "{}", run.stderr);
    // In another virtual host (a client picks the Host), and as a mere prefix: refused just the same.
    let other = edit(
        &e2e,
        "              - name: transfer_confirm\n                match: { path: /v1/transfers }\n",
        "              - name: transfer_confirm\n                match: { prefix: /v1/ }\n",
    )?;
    let run = check_text(dir.path(), "other.yaml", &other)?;
    assert_refused(&run, "catch-all-to-guarded-cluster", "virtual host other: route transfer_confirm");
    // With the filter disabled on it, still a hole.
    let disabled = edit(
        &e2e,
        NO_ROUTE,
        &PASSTHROUGH.replacen(
            "route: { cluster: demo }\n",
            "route: { cluster: demo }\n                typed_per_filter_config:\n                  envoy.filters.http.wasm:\n                    \"@type\": type.googleapis.com/envoy.config.route.v3.FilterConfig\n                    disabled: true\n",
            1,
        ),
    )?;
    let run = check_text(dir.path(), "disabled.yaml", &disabled)?;
    assert_refused(&run, "catch-all-to-guarded-cluster", "route passthrough");
    assert!(run.stderr.contains("the agent filter is disabled on the route"), "{}", run.stderr);
    // A catch-all to a cluster that serves no guarded route is fine.
    let elsewhere = edit(&e2e, NO_ROUTE, &PASSTHROUGH.replacen("cluster: demo", "cluster: idem_sidecar", 1))?;
    assert_ok(&check_text(dir.path(), "elsewhere.yaml", &elsewhere)?);
    Ok(())
}

/// The routes of an RDS file are checked as an inline table (e2e-rds.yaml names envoy/e2e-rds-routes.yaml).
#[test]
fn a_catch_all_in_an_rds_file_is_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let routes = edit(
        &committed("e2e-rds-routes.yaml")?,
        "    - name: no_route\n      match: { prefix: / }\n      direct_response:\n",
        "    - name: passthrough\n      match: { prefix: / }\n      route: { cluster: demo }\n    - name: no_route\n      match: { prefix: / }\n      direct_response:\n",
    )?;
    let routes_path = dir.path().join("routes.yaml");
    std::fs::write(&routes_path, routes)?;
    let config = edit(
        &committed("e2e-rds.yaml")?,
        "path: envoy/e2e-rds-routes.yaml",
        &format!("path: {}", routes_path.display()),
    )?;
    let run = check_text(dir.path(), "e2e-rds.yaml", &config)?;
    assert_refused(&run, "catch-all-to-guarded-cluster", "route passthrough");
    // An RDS file that is not there is refused, not silently passed: the check cannot show its routes are safe.
    let gone = edit(&committed("e2e-rds.yaml")?, "path: envoy/e2e-rds-routes.yaml", "path: /nonexistent/routes.yaml")?;
    let run = check_text(dir.path(), "gone.yaml", &gone)?;
    assert_refused(&run, "unreadable-routes", "gone.yaml: listener agents");
    assert!(
        run.stderr.contains("RDS file /nonexistent/routes.yaml (routes transfers) cannot be read"),
        "{}",
        run.stderr
    );
    Ok(())
}

#[test]
fn the_filter_disabled_on_an_annotated_route_is_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let text = edit(
        &committed("envoy.yaml")?,
        "                route: { cluster: demo, timeout: 15s }\n                metadata:\n",
        "                route: { cluster: demo, timeout: 15s }\n                typed_per_filter_config:\n                  envoy.filters.http.wasm:\n                    \"@type\": type.googleapis.com/envoy.config.route.v3.FilterConfig\n                    disabled: true\n                metadata:\n",
    )?;
    let run = check_text(dir.path(), "envoy.yaml", &text)?;
    assert_refused(&run, "filter-disabled-on-annotated-route", "virtual host transfers: route transfer_confirm");
    Ok(())
}

/// Where the filter runs is decided as Envoy decides it: the most specific `typed_per_filter_config` (the
/// route's, its virtual host's, its route configuration's), else the filter's `http_filters` entry. Off on
/// the route configuration, or off on its entry and enabled nowhere, an annotated route passes unguarded; so
/// does the catch-all a route rule's requests take. Enabled on each route, as Envoy Gateway writes it, it runs.
#[test]
fn a_filter_off_where_it_guards_is_refused_however_it_is_turned_off() -> TestResult {
    let dir = tempfile::tempdir()?;
    let rule = "filter-disabled-on-annotated-route";
    // Off for the whole route configuration.
    let mut d = doc(&committed("envoy.yaml")?)?;
    let table = first_host(&d)?.rsplit_once("/virtual_hosts/").ok_or("a virtual host pointer")?.0.to_string();
    d.object_mut(&table)?.insert("typed_per_filter_config".into(), filter_disabled("envoy.filters.http.wasm"));
    let run = check_doc(dir.path(), "table-off.yaml", &d)?;
    assert_refused(&run, rule, "virtual host transfers: route transfer_confirm");
    assert!(run.stderr.contains("disabled on its route configuration"), "{}", run.stderr);
    // The route's own configuration wins over its route configuration's (Envoy's most specific one).
    let confirm = d.route_named("transfer_confirm")?;
    let on = serde_json::json!({"envoy.filters.http.wasm":
        {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {}}});
    d.object_mut(&confirm)?.insert("typed_per_filter_config".into(), on);
    let run = check_doc(dir.path(), "table-off-route-on.yaml", &d)?;
    assert!(!findings_of(&run, rule).iter().any(|f| f.contains("route transfer_confirm:")), "{}", run.stderr);
    // Off on its http_filters entry, and nothing enables it: Istio's catch-all, guarded by route rules.
    let mut d = doc(&committed("istio-like.yaml")?)?;
    let manager = d.managers().into_iter().next().ok_or("no connection manager")?;
    let (index, _) = d.agent_filter(&manager).ok_or("no agent filter")?;
    d.object_mut(&format!("{manager}/http_filters/{index}"))?.insert("disabled".into(), serde_json::json!(true));
    let run = check_doc(dir.path(), "entry-off.yaml", &d)?;
    assert_refused(&run, rule, "rule");
    assert!(run.stderr.contains("a route rule's requests take this route"), "{}", run.stderr);
    // Envoy Gateway's shape: off on the entry, on for every route it guards.
    let run = check_text(dir.path(), "gateway-like.yaml", &committed("gateway-like.yaml")?)?;
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    Ok(())
}

/// Istio's shape passes because of its rules: without them its catch-all would guard nothing.
#[test]
fn a_mesh_catch_all_without_route_rules_is_refused() -> TestResult {
    let text = committed("istio-like.yaml")?;
    let doc: Value = serde_norway::from_str(&text)?;
    let wasm = doc
        .pointer("/static_resources/listeners/0/filter_chains/0/filters/0/typed_config/http_filters/1")
        .ok_or("no wasm filter in istio-like.yaml")?;
    let value = wasm.pointer("/typed_config/config/configuration/value").and_then(Value::as_str).ok_or("no value")?;
    let mut config: Value = serde_json::from_str(value)?;
    assert!(config["routes"].as_array().is_some_and(|r| !r.is_empty()), "istio-like.yaml has route rules");
    config.as_object_mut().ok_or("not an object")?.remove("routes");
    let dir = tempfile::tempdir()?;
    let run = check_text(dir.path(), "istio-like.yaml", &edit(&text, value, &config.to_string())?)?;
    assert_refused(&run, "guarded-routes-exist", "istio-like.yaml: listener virtualInbound");
    assert!(run.stderr.contains("route default sends prefix / (a catch-all) upstream unguarded"), "{}", run.stderr);
    Ok(())
}

#[test]
fn a_plugin_configuration_the_filter_refuses_is_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let text = edit(&committed("soak.yaml")?, "\"active_kid\": \"dev1\"", "\"active_kid\": \"nope\"")?;
    let run = check_text(dir.path(), "soak.yaml", &text)?;
    assert_refused(&run, "plugin-config", "soak.yaml: listener agents");
    Ok(())
}

/// What every confirm route is asked (DESIGN §4, §6, §3): a committed route without `upstream_keys`, a confirm that
/// takes client keys from agents, and a template parameter left unbound are each refused, saying why.
#[test]
fn a_confirm_that_leaves_a_safety_setting_unsaid_is_refused_saying_why() -> TestResult {
    let dir = tempfile::tempdir()?;
    let confirm = "                      role: confirm\n                      upstream_keys: honoured\n                      scope: payments.transfer\n";
    let unsaid = edit(
        &committed("envoy.yaml")?,
        confirm,
        "                      role: confirm\n                      scope: payments.transfer\n",
    )?;
    let run = check_text(dir.path(), "envoy.yaml", &unsaid)?;
    assert_refused(&run, "route-annotation", "upstream_keys: required for role confirm");
    assert!(run.stderr.contains("a 503 sent after the work was done"), "says why: {}", run.stderr);

    let both = "                      client_keys: \"true\"\n                      callers: programs\n";
    let agents = edit(&committed_e2e()?, both, "                      client_keys: \"true\"\n")?;
    let run = check_text(dir.path(), "e2e.yaml", &agents)?;
    assert_refused(&run, "route-annotation", "client_keys: a route agents call never accepts an agent-made");

    // Account B's confirm (the one annotation both account confirms share) without its path value bound.
    let bind = |fields: &str| {
        format!("                      bind: \"{fields}\"\n              - name: account_transfer_confirm_b")
    };
    let fields = "/amount:decimal, /currency:string, /payee_id:string";
    let unbound = edit(&committed_e2e()?, &bind(&format!("path:account, {fields}")), &bind(fields))?;
    let run = check_text(dir.path(), "e2e.yaml", &unbound)?;
    assert_refused(
        &run,
        "route-annotation",
        "template: {account} of /accounts/{account}/v1/transfers is neither bound",
    );
    Ok(())
}

#[test]
fn an_unreadable_input_exits_2() -> TestResult {
    let run = check(&[Path::new("envoy/no-such.yaml")])?;
    assert_eq!(run.code, Some(2));
    assert!(run.stderr.contains("envoy/no-such.yaml: cannot read"), "{}", run.stderr);
    let run = Command::new(env!("CARGO_BIN_EXE_idemd")).arg("check").output()?;
    assert_eq!(run.status.code(), Some(2), "an input is required");
    Ok(())
}

/// `text` (a configuration) with `edit` applied to every route action that forwards to a cluster (those of its
/// RDS file are not reached: e2e-rds.yaml's first table annotates no confirm route).
fn every_forwarding_route(
    text: &str,
    edit: &dyn Fn(&mut serde_json::Map<String, Value>),
) -> Result<String, Box<dyn std::error::Error>> {
    fn walk(v: &mut Value, edit: &dyn Fn(&mut serde_json::Map<String, Value>), edited: &mut usize) {
        match v {
            Value::Object(map) => {
                if let Some(Value::Object(action)) = map.get_mut("route") {
                    if action.contains_key("cluster") || action.contains_key("weighted_clusters") {
                        edit(action);
                        *edited += 1;
                    }
                }
                map.values_mut().for_each(|v| walk(v, edit, edited));
            }
            Value::Array(items) => items.iter_mut().for_each(|v| walk(v, edit, edited)),
            _ => {}
        }
    }
    let mut doc: Value = serde_norway::from_str(text)?;
    let mut edited = 0;
    walk(&mut doc, edit, &mut edited);
    if edited == 0 {
        return Err("no forwarding route to edit".into());
    }
    Ok(serde_norway::to_string(&doc)?)
}

/// The committed configurations that guard a confirm (e2e-rds.yaml's first RDS table annotates only a preview).
fn with_confirm_routes() -> Result<Vec<PathBuf>, Box<dyn std::error::Error>> {
    let mut files = committed_configurations()?;
    files.retain(|p| !p.ends_with("e2e-rds.yaml"));
    Ok(files)
}

/// DESIGN §5: a route timeout the lease does not outlast (the issue's 3-s lease behind 15 s, here 120 s behind
/// idemd's default 60 s) is refused in every committed configuration, naming the route and the shortfall.
#[test]
fn a_short_lease_behind_a_long_route_timeout_is_refused_in_every_configuration() -> TestResult {
    let dir = tempfile::tempdir()?;
    for file in with_confirm_routes()? {
        let name = file.file_name().and_then(|n| n.to_str()).ok_or("a file name")?;
        let text = every_forwarding_route(&std::fs::read_to_string(repo().join(&file))?, &|action| {
            action.insert("timeout".into(), Value::String("120s".into()));
        })?;
        let run = check_text(dir.path(), name, &text)?;
        assert_refused(&run, "lease-outlasts-envoy", &format!("{name}: listener"));
        assert!(run.stderr.contains("Envoy's longest wait 120000 ms"), "{name}: {}", run.stderr);
        assert!(run.stderr.contains("(short by "), "{name}: {}", run.stderr);
        // idemd's own lease, when longer, covers it: the same file passes the rule.
        let longer = check_with(&[&dir.path().join(name)], &["--lease-ms", "200000"], &[])?;
        assert!(!longer.stderr.contains("[lease-outlasts-envoy]"), "{name}: {}", longer.stderr);
    }
    Ok(())
}

/// DESIGN §4: an Envoy retry on 5xx on a confirm route is refused in every committed configuration.
#[test]
fn a_retry_on_5xx_on_a_confirm_route_is_refused_in_every_configuration() -> TestResult {
    let dir = tempfile::tempdir()?;
    for file in with_confirm_routes()? {
        let name = file.file_name().and_then(|n| n.to_str()).ok_or("a file name")?;
        let text = every_forwarding_route(&std::fs::read_to_string(repo().join(&file))?, &|action| {
            action.insert("retry_policy".into(), serde_json::json!({"retry_on": "5xx", "num_retries": 1}));
        })?;
        let run = check_text(dir.path(), name, &text)?;
        assert_refused(&run, "retry-on-possible-execution", &format!("{name}: listener"));
        assert!(run.stderr.contains("5xx (an answer"), "{name}: {}", run.stderr);
    }
    Ok(())
}

/// DESIGN §5: a retention shorter than a fingerprint's life plus the callers' retry window is refused in every
/// committed configuration; the flags come from idemd serve's variables.
#[test]
fn a_short_retention_is_refused_in_every_configuration() -> TestResult {
    let files = committed_configurations()?;
    let refs: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    let vars = [("IDEM_TERMINAL_RETENTION_S", "3600"), ("IDEM_RETRY_WINDOW_S", "3600")];
    let run = check_with(&refs, &[], &vars)?;
    assert_eq!(run.code, Some(1), "{}{}", run.stdout, run.stderr);
    for f in &files {
        let label = f.display().to_string();
        assert!(run.stdout.contains(&format!("{label}: REFUSED")), "{label}: {}", run.stdout);
        assert!(
            run.stderr.lines().any(|l| l.starts_with(&format!("idemd check: {label}: "))
                && l.contains("[retention-outlasts-fingerprints]")
                && l.contains("--terminal-retention-s 3600")),
            "{label}: {}",
            run.stderr
        );
    }
    // The replay cache (3600 s by default) may not outlive a shorter retention either.
    let run = check_with(
        &[Path::new("envoy/envoy.yaml")],
        &["--terminal-retention-s", "3000", "--retry-window-s", "600"],
        &[],
    )?;
    assert_refused(&run, "replay-cache-within-retention", "envoy.yaml: listener agents");
    Ok(())
}

/// idemd serve's own start-up rule over the same flags: a deployment that would not start is refused here.
#[test]
fn flags_idemd_serve_refuses_are_refused() -> TestResult {
    let run = check_with(&[Path::new("envoy/envoy.yaml")], &["--lease-ms", "20000"], &[])?;
    assert_refused(&run, "idemd-start", "envoy/envoy.yaml: idemd's flags");
    assert!(run.stderr.contains("short by 30001 ms"), "{}", run.stderr);
    Ok(())
}

/// e2e.yaml's retried confirm route (Envoy retries on reset) passes only because its virtual host reports the
/// attempt count, and only because its upstream deduplicates by the key.
#[test]
fn a_retried_confirm_needs_the_attempt_count_and_an_upstream_that_honours_keys() -> TestResult {
    let dir = tempfile::tempdir()?;
    let e2e = committed_e2e()?;
    let without = edit(&e2e, "              include_attempt_count_in_response: true\n", "")?;
    let run = check_text(dir.path(), "e2e.yaml", &without)?;
    assert_refused(&run, "retry-needs-attempt-count", "virtual host transfers: route transfer_confirm_retrying");
    let keyless = edit(
        &e2e,
        "                  retry_policy: { retry_on: \"reset,connect-failure\", num_retries: 2 }\n                metadata:\n                  filter_metadata:\n                    agent_idempotency:\n                      role: confirm\n                      upstream_keys: honoured\n",
        "                  retry_policy: { retry_on: \"reset,connect-failure\", num_retries: 2 }\n                metadata:\n                  filter_metadata:\n                    agent_idempotency:\n                      role: confirm\n                      upstream_keys: ignored\n",
    )?;
    let run = check_text(dir.path(), "e2e.yaml", &keyless)?;
    assert_refused(&run, "no-retry-without-upstream-keys", "route transfer_confirm_retrying");
    Ok(())
}

// Every way to a guarded upstream path that does not pass the guard. Each configuration below is a committed
// one changed the way it was found live (tests/tests/check_live.rs runs them in Envoy).

fn doc(text: &str) -> Result<Doc, Box<dyn std::error::Error>> {
    Doc::parse(text)
}

fn check_doc(dir: &Path, name: &str, doc: &Doc) -> Result<Run, Box<dyn std::error::Error>> {
    check_text(dir, name, &doc.to_yaml()?)
}

/// The route `name`'s action, to change.
fn action<'a>(
    doc: &'a mut Doc,
    name: &str,
) -> Result<&'a mut serde_json::Map<String, Value>, Box<dyn std::error::Error>> {
    let r = doc.route_named(name)?;
    doc.object_mut(&format!("{r}/route"))
}

/// A route to `cluster` for exactly `path`, unannotated, with `extra` fields in its action.
fn exact_route(name: &str, path: &str, cluster: &str, extra: Value) -> Value {
    let mut action = json!({ "cluster": cluster });
    if let (Some(a), Some(e)) = (action.as_object_mut(), extra.as_object()) {
        a.extend(e.clone());
    }
    json!({ "name": name, "match": { "path": path }, "route": action })
}

/// The first virtual host of the first connection manager.
fn first_host(doc: &Doc) -> Result<String, Box<dyn std::error::Error>> {
    Ok(doc.virtual_hosts().into_iter().next().ok_or("no virtual host")?)
}

/// Only `rule`'s findings, and exactly one per `at`.
fn findings_of(run: &Run, rule: &str) -> Vec<String> {
    run.stderr.lines().filter(|l| l.contains(&format!("[{rule}]"))).map(str::to_string).collect()
}

#[test]
fn a_mirror_on_a_confirm_is_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let rule = "request-mirror";
    // The issue's: a confirm whose upstream ignores keys, mirrored to the same upstream: executed twice.
    let mut d = doc(&committed_e2e()?)?;
    action(&mut d, "nokey_confirm")?.insert("request_mirror_policies".into(), json!([{ "cluster": "demo" }]));
    let run = check_doc(dir.path(), "mirror.yaml", &d)?;
    assert_refused(&run, rule, "virtual host transfers: route nokey_confirm");
    assert!(run.stderr.contains("every confirm is sent twice"), "{}", run.stderr);
    // To another upstream, on an upstream that honours keys, from the virtual host: refused all the same.
    let mut d = doc(&committed("envoy.yaml")?)?;
    let host = first_host(&d)?;
    d.object_mut(&host)?.insert("request_mirror_policies".into(), json!([{ "cluster": "idem_sidecar" }]));
    let run = check_doc(dir.path(), "vhost-mirror.yaml", &d)?;
    assert_refused(&run, rule, "route transfer_confirm");
    assert_refused(&run, rule, "route mcp");
    // A mirror of an unguarded route that copies its requests onto a guarded path.
    let mut d = doc(&committed("envoy.yaml")?)?;
    let host = first_host(&d)?;
    let shadow = exact_route(
        "shadow",
        "/shadow/v1/transfers",
        "idem_sidecar",
        json!({ "prefix_rewrite": "/v1/transfers", "request_mirror_policies": [{ "cluster": "demo" }] }),
    );
    d.insert_route(&host, 0, shadow)?;
    let run = check_doc(dir.path(), "shadow.yaml", &d)?;
    assert_refused(&run, rule, "route shadow: its request mirror");
    assert_eq!(findings_of(&run, rule).len(), 1, "{}", run.stderr);
    // A mirror that reaches no guarded path is none of this rule's business.
    let mut d = doc(&committed("envoy.yaml")?)?;
    action(&mut d, "healthz")?.insert("request_mirror_policies".into(), json!([{ "cluster": "demo" }]));
    assert_ok(&check_doc(dir.path(), "healthz-mirror.yaml", &d)?);
    Ok(())
}

#[test]
fn an_unannotated_route_to_a_guarded_path_in_another_virtual_host_is_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let rule = "exact-route-to-guarded-path";
    // What envoy/e2e.yaml had: `other.example` sent /v1/transfers straight to the demo.
    let e2e = committed_e2e()?;
    let namesake = "                route: { cluster: demo, prefix_rewrite: /v1/executions }\n              - name: no_route\n                match: { prefix: / }\n                direct_response: *no_route\n";
    let run = check_text(
        dir.path(),
        "other.yaml",
        &edit(&e2e, namesake, &namesake.replacen(", prefix_rewrite: /v1/executions", "", 1))?,
    )?;
    assert_refused(&run, rule, "virtual host other: route transfer_confirm");
    assert!(run.stderr.contains("sends path /v1/transfers to /v1/transfers on cluster demo"), "{}", run.stderr);
    assert!(
        run.stderr.contains("the path route transfer_confirm guards")
            || run.stderr.contains("virtual host transfers: route transfer_confirm guards"),
        "{}",
        run.stderr
    );
    // A near miss the demo's router would not take, but a lenient upstream does.
    let mut d = doc(&committed("envoy.yaml")?)?;
    let host = first_host(&d)?;
    d.insert_route(&host, 0, exact_route("shouting", "/V1/Transfers/", "demo", json!({})))?;
    assert_refused(&check_doc(dir.path(), "case.yaml", &d)?, rule, "route shouting");
    // Another cluster with the demo's address is the demo.
    let mut d = doc(&committed("envoy.yaml")?)?;
    d.add_cluster(static_cluster("demo_again", "127.0.0.1", 8080))?;
    let host = first_host(&d)?;
    d.insert_route(
        &host,
        0,
        exact_route("again", "/again/v1/transfers", "demo_again", json!({ "prefix_rewrite": "/v1/transfers" })),
    )?;
    let run = check_doc(dir.path(), "same-address.yaml", &d)?;
    assert_refused(&run, rule, "route again");
    assert!(
        run.stderr.contains("cluster demo_again, the same upstream as cluster demo (127.0.0.1:8080)"),
        "{}",
        run.stderr
    );
    // The filter disabled on such a route changes nothing; an exact route to a path nothing guards passes.
    let mut d = doc(&committed("envoy.yaml")?)?;
    let host = first_host(&d)?;
    let mut off = exact_route("off", "/off/v1/transfers", "demo", json!({ "prefix_rewrite": "/v1/transfers" }));
    off["typed_per_filter_config"] = filter_disabled("envoy.filters.http.wasm");
    d.insert_route(&host, 0, off)?;
    d.insert_route(&host, 0, exact_route("ledger", "/ledger", "demo", json!({ "prefix_rewrite": "/v1/executions" })))?;
    let run = check_doc(dir.path(), "off.yaml", &d)?;
    assert_refused(&run, rule, "route off");
    assert_eq!(findings_of(&run, rule).len(), 1, "route ledger passes: {}", run.stderr);
    Ok(())
}

#[test]
fn a_rewrite_onto_a_guarded_path_is_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let rule = "exact-route-to-guarded-path";
    // What envoy/e2e.yaml had: /plain/v1/transfers, prefix_rewrite /v1/transfers.
    let mut d = doc(&committed_e2e()?)?;
    let plain = d.route_named("transfer_confirm").and_then(|_| {
        // The unannotated namesake is the second route of that name.
        d.routes()
            .into_iter()
            .find(|r| d.0.pointer(&format!("{r}/match/path")).and_then(Value::as_str) == Some("/plain/v1/transfers"))
            .ok_or_else(|| "no /plain/v1/transfers route".into())
    })?;
    d.object_mut(&format!("{plain}/route"))?.insert("prefix_rewrite".into(), json!("/v1/transfers"));
    let run = check_doc(dir.path(), "prefix.yaml", &d)?;
    assert_refused(&run, rule, "virtual host transfers: route transfer_confirm");
    assert!(
        run.stderr.contains("sends path /plain/v1/transfers after prefix_rewrite /v1/transfers to /v1/transfers"),
        "{}",
        run.stderr
    );
    // The same with regex_rewrite: the check applies the pattern to the route's path.
    let route = d.object_mut(&format!("{plain}/route"))?;
    route.remove("prefix_rewrite");
    route.insert("regex_rewrite".into(), json!({ "pattern": { "regex": "^/plain(/.*)$" }, "substitution": "\\1" }));
    let run = check_doc(dir.path(), "regex.yaml", &d)?;
    assert_refused(&run, rule, "virtual host transfers: route transfer_confirm");
    assert!(run.stderr.contains("regex_rewrite ^/plain(/.*)$"), "{}", run.stderr);
    // A regex rewrite that lands elsewhere is followed too, and passes.
    d.object_mut(&format!("{plain}/route"))?.insert(
        "regex_rewrite".into(),
        json!({ "pattern": { "regex": "^/plain/v1/transfers$" }, "substitution": "/v1/executions" }),
    );
    assert_ok(&check_doc(dir.path(), "regex-elsewhere.yaml", &d)?);
    // A prefix rewrite on a prefix route to the guarded upstream is a catch-all there.
    let mut d = doc(&committed("envoy.yaml")?)?;
    let host = first_host(&d)?;
    let legacy = json!({ "name": "legacy", "match": { "prefix": "/legacy/" }, "route": { "cluster": "demo", "prefix_rewrite": "/v1/" } });
    d.insert_route(&host, 0, legacy)?;
    assert_refused(&check_doc(dir.path(), "legacy.yaml", &d)?, "catch-all-to-guarded-cluster", "route legacy");
    Ok(())
}

#[test]
fn a_listener_without_the_filter_to_a_guarded_upstream_is_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let rule = "unfiltered-listener-to-guarded-path";
    // The issue's: a second listener, the same routes, no agent filter.
    let mut d = doc(&committed("envoy.yaml")?)?;
    let copy = d.copy_listener(0, "side_door", 10009, true)?;
    d.add_listener(copy)?;
    let run = check_doc(dir.path(), "side-door.yaml", &d)?;
    assert_refused(&run, rule, "listener side_door: virtual host transfers: route transfer_confirm");
    assert_refused(&run, rule, "listener side_door: virtual host transfers: route mcp");
    assert!(run.stderr.contains("listener side_door does not run the agent filter"), "{}", run.stderr);
    // With a catch-all to the demo there instead: the whole upstream.
    let side_door = |hosts: Value| -> Result<Doc, Box<dyn std::error::Error>> {
        let mut d = doc(&committed("envoy.yaml")?)?;
        let copy = d.copy_listener(0, "side_door", 10009, true)?;
        d.add_listener(copy)?;
        let m = d.managers().pop().ok_or("no manager")?;
        *d.at_mut(&format!("{m}/route_config/virtual_hosts"))? = hosts;
        Ok(d)
    };
    let d = side_door(json!([{ "name": "all", "domains": ["*"], "routes": [
        { "match": { "prefix": "/" }, "route": { "cluster": "demo" } }
    ] }]))?;
    let run = check_doc(dir.path(), "side-catch-all.yaml", &d)?;
    assert_refused(&run, rule, "listener side_door: virtual host all: route #0 (unnamed)");
    // Without the filter, only what nothing guards: accepted.
    let d = side_door(json!([{ "name": "health", "domains": ["*"], "routes": [
        { "match": { "path": "/healthz" }, "route": { "cluster": "demo" } },
        { "match": { "prefix": "/" }, "direct_response": { "status": 404 } }
    ] }]))?;
    assert_ok(&check_doc(dir.path(), "side-health.yaml", &d)?);
    Ok(())
}

#[test]
fn a_route_the_check_cannot_follow_is_refused_unless_stated_safe() -> TestResult {
    let dir = tempfile::tempdir()?;
    let rule = "undecidable-route";
    let base = doc(&committed("envoy.yaml")?)?;
    let host = first_host(&base)?;
    // The cluster a header names: any cluster, the demo too.
    let mut d = base.clone();
    let dynamic =
        json!({ "name": "dynamic", "match": { "path": "/v1/transfers" }, "route": { "cluster_header": "x-cluster" } });
    d.insert_route(&host, 0, dynamic.clone())?;
    let run = check_doc(dir.path(), "header.yaml", &d)?;
    assert_refused(&run, rule, "route dynamic");
    assert!(run.stderr.contains("reaches_no_guarded_path"), "the way to state it: {}", run.stderr);
    // A regex rewrite the check cannot evaluate (RE2 would refuse look-around too; the check cannot tell).
    let mut d = base.clone();
    let odd = exact_route(
        "odd",
        "/odd",
        "demo",
        json!({ "regex_rewrite": { "pattern": { "regex": "(?=o)odd" }, "substitution": "v1/transfers" } }),
    );
    d.insert_route(&host, 0, odd)?;
    assert_refused(&check_doc(dir.path(), "odd.yaml", &d)?, rule, "route odd");
    // Stated safe by the operator: accepted, and said.
    let mut d = base.clone();
    let mut stated = dynamic.clone();
    stated["metadata"] = json!({ "filter_metadata": { "idemd_check": { "reaches_no_guarded_path": "x-cluster is set by ext_authz to reports or archive" } } });
    d.insert_route(&host, 0, stated)?;
    let run = check_doc(dir.path(), "stated.yaml", &d)?;
    assert_ok(&run);
    assert!(
        run.stderr.contains("accepted on the operator's statement") && run.stderr.contains("set by ext_authz"),
        "{}",
        run.stderr
    );
    // A statement never covers what the check can follow.
    let mut d = base.clone();
    let mut wrong = exact_route("wrong", "/wrong", "demo", json!({ "prefix_rewrite": "/v1/transfers" }));
    wrong["metadata"] = json!({ "filter_metadata": { "idemd_check": { "reaches_no_guarded_path": "trust me" } } });
    d.insert_route(&host, 0, wrong)?;
    let run = check_doc(dir.path(), "wrong.yaml", &d)?;
    assert_refused(&run, "exact-route-to-guarded-path", "route wrong");
    assert!(run.stderr.contains("is contradicted"), "{}", run.stderr);
    Ok(())
}

#[test]
fn hedging_and_internal_redirects_on_a_confirm_are_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut d = doc(&committed("envoy.yaml")?)?;
    action(&mut d, "transfer_confirm")?.insert(
        "hedge_policy".into(),
        json!({ "initial_requests": 1, "additional_request_chance": { "numerator": 50 } }),
    );
    assert_refused(&check_doc(dir.path(), "hedge.yaml", &d)?, "hedge-on-guarded-route", "route transfer_confirm");
    let mut d = doc(&committed("envoy.yaml")?)?;
    action(&mut d, "transfer_confirm")?
        .insert("internal_redirect_policy".into(), json!({ "max_internal_redirects": 1 }));
    assert_refused(
        &check_doc(dir.path(), "redirect.yaml", &d)?,
        "internal-redirect-on-guarded-route",
        "route transfer_confirm",
    );
    // On a preview neither sends a confirm twice.
    let mut d = doc(&committed("envoy.yaml")?)?;
    action(&mut d, "transfer_preview")?
        .insert("internal_redirect_policy".into(), json!({ "max_internal_redirects": 1 }));
    assert_ok(&check_doc(dir.path(), "preview-redirect.yaml", &d)?);
    Ok(())
}

#[test]
fn a_preview_or_mcp_route_rewritten_onto_a_confirm_path_is_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let rule = "role-on-guarded-path";
    let mut d = doc(&committed_e2e()?)?;
    action(&mut d, "manual_preview")?.insert("prefix_rewrite".into(), json!("/v1/transfers"));
    let run = check_doc(dir.path(), "preview.yaml", &d)?;
    assert_refused(&run, rule, "route manual_preview");
    assert!(run.stderr.contains("annotated as preview"), "{}", run.stderr);
    let mut d = doc(&committed("envoy.yaml")?)?;
    action(&mut d, "mcp_sse")?.insert("prefix_rewrite".into(), json!("/v1/transfers"));
    assert_refused(&check_doc(dir.path(), "mcp.yaml", &d)?, rule, "route mcp_sse");
    Ok(())
}

#[test]
fn a_filter_that_may_reroute_after_the_agent_filter_is_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let lua = json!({ "name": "envoy.filters.http.lua", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
        "default_source_code": { "inline_string": "function envoy_on_request(h) h:headers():replace(':path', '/v1/transfers') end" } } });
    let mut d = doc(&committed("envoy.yaml")?)?;
    let m = d.managers().into_iter().next().ok_or("no manager")?;
    let (i, _) = d.agent_filter(&m).ok_or("no agent filter")?;
    d.array_mut(&format!("{m}/http_filters"))?.insert(i + 1, lua.clone());
    let run = check_doc(dir.path(), "lua-after.yaml", &d)?;
    assert_refused(&run, "filter-after-agent", "lua-after.yaml: listener agents");
    assert!(
        run.stderr.contains("envoy.extensions.filters.http.lua.v3.Lua runs after the agent filter"),
        "{}",
        run.stderr
    );
    // Before it, the agent filter judges what the other one made.
    let mut d = doc(&committed("envoy.yaml")?)?;
    d.array_mut(&format!("{m}/http_filters"))?.insert(i, lua);
    assert_ok(&check_doc(dir.path(), "lua-before.yaml", &d)?);
    Ok(())
}

/// A route rule guards its path for every method: its own method runs the role, the others are refused, except
/// the `pass_methods`, which reach the upstream unguarded (the mesh's catch-all takes a PUT to /v1/transfers as
/// it takes the POST): only safe methods may be listed there.
#[test]
fn a_route_rule_guards_its_path_for_every_method_but_the_safe_ones_it_lets_pass() -> TestResult {
    let dir = tempfile::tempdir()?;
    let istio = committed("istio-like.yaml")?;
    let post_only =
        edit(&istio, r#""match":{"path":"/v1/transfers"}"#, r#""match":{"method":"POST","path":"/v1/transfers"}"#)?;
    assert_ok(&check_text(dir.path(), "istio-post.yaml", &post_only)?);
    let put = edit(
        &istio,
        r#""match":{"path":"/v1/transfers"}"#,
        r#""match":{"method":"POST","path":"/v1/transfers"},"pass_methods":["PUT"]"#,
    )?;
    let run = check_text(dir.path(), "istio-put.yaml", &put)?;
    assert_refused(&run, "catch-all-to-guarded-cluster", "istio-put.yaml: listener virtualInbound");
    assert!(run.stderr.contains("rule transfer_confirm"), "{}", run.stderr);
    // A rewrite on the mesh's catch-all lands paths no rule matched (`/`) on a rule's upstream path: the rules
    // judge the path the client sent, the upstream runs the one Envoy wrote (found by the generated configurations,
    // seed 11, #47).
    let rewritten = edit(
        &istio,
        "                  cluster: \"inbound|8080||\"\n",
        "                  cluster: \"inbound|8080||\"\n                  prefix_rewrite: /v1/transfers\n",
    )?;
    let run = check_text(dir.path(), "istio-rewrite.yaml", &rewritten)?;
    assert_refused(&run, "catch-all-to-guarded-cluster", "istio-rewrite.yaml: listener virtualInbound");
    // A rule guards its path for every method: a POST-only rule refuses the other methods,
    // so a route that lets every method through to that rule's path is accepted; so is a rule that lets a GET
    // list endpoint pass beside its POST-only confirm; one that lets a mutating method pass is refused.
    let gateway = committed("gateway-like.yaml")?;
    let post_rule =
        edit(&gateway, r#""match":{"path":"/v1/transfers"}"#, r#""match":{"method":"POST","path":"/v1/transfers"}"#)?;
    assert_ok(&check_text(dir.path(), "gateway-post.yaml", &post_rule)?);
    let confirm_route = "                match: { path: /v1/transfers, headers: [{ name: \":method\", string_match: { exact: POST } }] }\n";
    let any = edit(&post_rule, confirm_route, "                match: { path: /v1/transfers }\n")?;
    assert_ok(&check_text(dir.path(), "gateway-any.yaml", &any)?);
    let list = edit(
        &any,
        r#""match":{"method":"POST","path":"/v1/transfers"}"#,
        r#""match":{"method":"POST","path":"/v1/transfers"},"pass_methods":["GET","HEAD"]"#,
    )?;
    assert_ok(&check_text(dir.path(), "gateway-list.yaml", &list)?);
    let put = edit(
        &any,
        r#""match":{"method":"POST","path":"/v1/transfers"}"#,
        r#""match":{"method":"POST","path":"/v1/transfers"},"pass_methods":["GET","PUT"]"#,
    )?;
    let run = check_text(dir.path(), "gateway-put.yaml", &put)?;
    assert_refused(&run, "exact-route-to-guarded-path", "route httproute/payments/transfers/rule/0/match/1/*");
    assert!(run.stderr.contains("route rule transfer_confirm lets PUT pass unguarded"), "{}", run.stderr);
    Ok(())
}

#[test]
fn routes_from_an_xds_server_are_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let text = edit(
        &committed("e2e-rds.yaml")?,
        "              path_config_source:\n                path: envoy/e2e-rds-routes.yaml\n                # Reload when an entry is moved into this directory (the rename that replaces the file).\n                watched_directory: { path: envoy }\n",
        "              ads: {}\n",
    )?;
    let run = check_text(dir.path(), "ads.yaml", &text)?;
    assert_refused(&run, "unreadable-routes", "ads.yaml: listener agents");
    assert!(run.stderr.contains("come from an xDS server"), "{}", run.stderr);
    Ok(())
}

/// docs/operations.md says what every rule refuses and why, and names no rule the check does not have.
#[test]
fn every_rule_is_in_the_operations_table() -> TestResult {
    let page = std::fs::read_to_string(repo().join("docs/operations.md"))?;
    let section = page.split("## What `idemd check` refuses").nth(1).ok_or("no section")?;
    let section = section.split("\n## ").next().unwrap_or_default();
    let documented: Vec<&str> =
        section.lines().filter_map(|l| l.strip_prefix("| `")).filter_map(|l| l.split('`').next()).collect();
    for rule in idemd::check::rules::RULES {
        assert!(documented.contains(&rule.name), "docs/operations.md has no row for {}", rule.name);
    }
    for name in &documented {
        assert!(idemd::check::rules::RULES.iter().any(|r| r.name == *name), "{name} is not a rule");
    }
    Ok(())
}
