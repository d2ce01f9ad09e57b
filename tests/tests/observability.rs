//! Day-one operations: the shipped alert rules, dashboard and runbook
//! (deploy/observability/, docs/operations.md), tested twice.
//!
//! - promtool: `promtool check rules` and the unit tests in alerts.test.yaml, and
//!   every alert has its annotations, a runbook entry, and a firing and a quiet
//!   unit test.
//! - A real Prometheus (Debian's `prometheus`) scraping a real stack on both
//!   builds (idemd's `/metrics`, Envoy's `/stats/prometheus`, process-exporter
//!   for Envoy's CPU), the shipped rules loaded with `for:` cut to 1 s: a
//!   tampered confirm fires IdemSecurityEvent, every rule evaluates without error
//!   on the real series, every dashboard query returns data after a short
//!   workload, and a stopped Postgres fires IdemSqlStoreDown. The Postgres is a
//!   server of this test's own (initdb in a temp dir), so stopping it harms no
//!   other test.
//!
//! promtool, prometheus and prometheus-process-exporter come from Debian
//! packages (`.ci/run` installs them): missing, the tests skip loudly, and fail
//! with IDEM_REQUIRE_BACKENDS=1.

use idem_e2e::prometheus::{on_path, Prometheus};
use idem_e2e::*;
use idem_testkit::pg_server::PostgresServer;
use serde_json::{json, Value};
use serde_norway::Value as Yaml;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

fn observability(file: &str) -> PathBuf {
    repo_root().join("deploy/observability").join(file)
}

/// An executable from a Debian package, or a loud skip (a failure in CI).
fn tool(name: &str, package: &str) -> Option<PathBuf> {
    let found = on_path(name);
    if found.is_none() {
        idem_testkit::backends::skip(name, &format!("not on PATH (Debian: apt-get install {package})"));
    }
    found
}

fn yaml(path: &Path) -> Result<Yaml, BoxError> {
    Ok(serde_norway::from_str(&std::fs::read_to_string(path)?)?)
}

fn seq(v: &Yaml, key: &str) -> Vec<Yaml> {
    v.get(key).and_then(Yaml::as_sequence).cloned().unwrap_or_default()
}

fn text<'a>(v: &'a Yaml, path: &[&str]) -> &'a str {
    let mut cur = v;
    for k in path {
        match cur.get(*k) {
            Some(next) => cur = next,
            None => return "",
        }
    }
    cur.as_str().unwrap_or_default()
}

/// Every alerting rule of alerts.yaml.
fn alert_rules() -> Result<Vec<Yaml>, BoxError> {
    let rules = yaml(&observability("alerts.yaml"))?;
    Ok(seq(&rules, "groups").iter().flat_map(|g| seq(g, "rules")).filter(|r| r.get("alert").is_some()).collect())
}

fn run(cmd: &mut Command) -> Result<String, BoxError> {
    let out = cmd.output()?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        return Err(format!("{cmd:?} failed:\n{text}").into());
    }
    Ok(text)
}

#[test]
fn promtool_checks_the_rules_and_runs_their_unit_tests() -> TestResult {
    let Some(promtool) = tool("promtool", "prometheus") else { return Ok(()) };
    let checked = run(Command::new(&promtool).arg("check").arg("rules").arg(observability("alerts.yaml")))?;
    assert!(checked.contains("SUCCESS"), "{checked}");
    let tested =
        run(Command::new(&promtool).current_dir(observability("")).args(["test", "rules", "alerts.test.yaml"]))?;
    assert!(tested.contains("SUCCESS"), "{tested}");
    Ok(())
}

/// Each alert says what happened and where its runbook entry is (an anchor that exists in
/// docs/operations.md), has a severity, and has a unit test where it fires and one where it does not.
#[test]
fn every_alert_has_its_runbook_entry_and_a_firing_and_a_quiet_unit_test() -> TestResult {
    let runbook = std::fs::read_to_string(repo_root().join("docs/operations.md"))?;
    let anchors = idem_e2e::markdown::anchors(&runbook);
    let tests = yaml(&observability("alerts.test.yaml"))?;
    let cases: Vec<Yaml> = seq(&tests, "tests").iter().flat_map(|t| seq(t, "alert_rule_test")).collect();
    let rules = alert_rules()?;
    assert!(rules.len() >= 11, "the day-one alerts: {}", rules.len());
    for rule in &rules {
        let name = text(rule, &["alert"]);
        assert!(matches!(text(rule, &["labels", "severity"]), "warning" | "critical"), "{name}: severity");
        for field in ["summary", "description"] {
            assert!(!text(rule, &["annotations", field]).is_empty(), "{name}: no {field}");
        }
        let url = text(rule, &["annotations", "runbook_url"]);
        let target = url.strip_prefix("docs/operations.md#").ok_or_else(|| format!("{name}: runbook_url {url:?}"))?;
        assert!(anchors.contains(target), "{name}: docs/operations.md has no heading for #{target}");
        assert!(runbook.contains(&format!("`{name}`")) || runbook.contains(name), "{name}: not in the runbook");
        let of_this: Vec<&Yaml> = cases.iter().filter(|c| text(c, &["alertname"]) == name).collect();
        assert!(of_this.iter().any(|c| !seq(c, "exp_alerts").is_empty()), "{name}: no unit test where it fires");
        assert!(of_this.iter().any(|c| seq(c, "exp_alerts").is_empty()), "{name}: no unit test where it is quiet");
    }
    // The SLO the burn-rate alerts measure is stated where operators read it.
    let rules_text = std::fs::read_to_string(observability("alerts.yaml"))?;
    for doc in [&rules_text, &runbook] {
        assert!(doc.contains("99.9%") && doc.contains("30 days") && doc.contains("status_unavailable"), "the SLO");
    }
    Ok(())
}

/// The dashboard's panels: the day-one ones, each with queries on the Prometheus datasource variable.
#[test]
fn the_dashboard_has_the_panels_an_operator_needs() -> TestResult {
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(observability("dashboard.json"))?)?;
    let panels = dash["panels"].as_array().ok_or("no panels")?;
    let titles: Vec<&str> = panels.iter().filter_map(|p| p["title"].as_str()).collect();
    for want in [
        "Answers by kind (filter)",
        "Replays vs executions",
        "In flight and NEEDS_REVIEW",
        "Store latency percentiles",
        "Redis fallback and refills",
        "Security events",
        "Reconciler decisions and lookups",
        "Envoy CPU per request",
    ] {
        assert!(titles.contains(&want), "no panel {want:?}: {titles:?}");
    }
    for p in panels {
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{}", p["title"]);
        let targets = p["targets"].as_array().ok_or("no targets")?;
        assert!(!targets.is_empty() && targets.iter().all(|t| t["expr"].as_str().is_some_and(|e| !e.is_empty())));
    }
    Ok(())
}

/// The panels' queries as Prometheus runs them: (panel, expression), Grafana's `$__rate_interval`
/// resolved to a minute (it is at least four scrape intervals).
fn dashboard_queries() -> Result<Vec<(String, String)>, BoxError> {
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(observability("dashboard.json"))?)?;
    let mut out = Vec::new();
    for p in dash["panels"].as_array().into_iter().flatten() {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().unwrap_or_default().replace("$__rate_interval", "1m");
            out.push((p["title"].as_str().unwrap_or_default().to_string(), expr));
        }
    }
    Ok(out)
}

/// alerts.yaml as the test loads it: every `for:` cut to 1 s (evaluation runs each second).
fn rules_with_short_for() -> Result<String, BoxError> {
    let text = std::fs::read_to_string(observability("alerts.yaml"))?;
    let lines: Vec<String> = text
        .lines()
        .map(|l| match l.trim_start().strip_prefix("for: ") {
            Some(_) => format!("{}for: 1s", &l[..l.len() - l.trim_start().len()]),
            None => l.to_string(),
        })
        .collect();
    Ok(lines.join("\n"))
}

fn regex_escaped(s: &str) -> String {
    s.chars().flat_map(|c| if "\\.+*?()|[]{}^$".contains(c) { vec!['\\', c] } else { vec![c] }).collect()
}

fn finite(sample: &Value) -> bool {
    sample["value"][1].as_str().and_then(|v| v.parse::<f64>().ok()).is_some_and(f64::is_finite)
}

/// What an hour of agents does, in a few seconds: previews and confirms, retries answered from the
/// record (the replay cache is off, so idemd answers them), a status lookup, a retry after Redis lost the
/// key (refilled from SQL), and a tampered confirm.
async fn workload(stack: &Stack) -> Result<(), BoxError> {
    let mut confirmed = Vec::new();
    for i in 0..3 {
        let amount = json!(format!("{}.00", 10 + i));
        let (_, fp) = stack.preview(amount.clone()).await?;
        let headers = [("agent-fingerprint", fp.as_str())];
        let first = stack.post("/v1/transfers", SUBJECT, &transfer(amount.clone(), "rent"), &headers).await?;
        assert_eq!(first.status, 201, "{first:?}");
        let again = stack.post("/v1/transfers", SUBJECT, &transfer(amount.clone(), "rent, again"), &headers).await?;
        again.assert_prompt("already_completed");
        confirmed.push((fp, amount));
    }
    let (fp, amount) = &confirmed[0];
    let status = stack.get(&format!("/v1/transfers/status?fingerprint={fp}"), SUBJECT, &[]).await?;
    status.assert_prompt("already_completed");

    let mut redis = redis::Client::open(backends::redis_url().as_str())?.get_multiplexed_async_connection().await?;
    let key = format!("idem:{{{}}}", nonce_of(fp)?);
    let _: i64 = redis::cmd("DEL").arg(&key).query_async(&mut redis).await?;
    let headers = [("agent-fingerprint", fp.as_str())];
    let refilled = stack.post("/v1/transfers", SUBJECT, &transfer(amount.clone(), "rent"), &headers).await?;
    refilled.assert_prompt("already_completed");

    let tampered = stack.post("/v1/transfers", SUBJECT, &transfer(json!("9999.00"), "rent"), &headers).await?;
    tampered.assert_prompt("params_changed");
    Ok(())
}

#[tokio::test]
async fn a_real_prometheus_fires_the_shipped_alerts_and_every_dashboard_query_returns_data() -> TestResult {
    let (Some(prometheus), Some(exporter)) =
        (tool("prometheus", "prometheus"), tool("prometheus-process-exporter", "prometheus-process-exporter"))
    else {
        return Ok(());
    };
    if !backends::available("redis", &backends::redis_url())? {
        return Ok(());
    }
    let pg_dir = tempfile::tempdir()?;
    let Some(mut postgres) = PostgresServer::start(pg_dir.path(), free_port()?)? else { return Ok(()) };

    // idemd on Redis and this test's Postgres, probing its stores every 200 ms, reconciling.
    let args = [
        "--probe-interval-ms",
        "200",
        "--reconcile-interval-ms",
        "500",
        "--status-endpoint",
        "payments.transfer=http://127.0.0.1:8080/v1/transfers/by-key/{key}",
        "--sql-timeout-ms",
        "500",
    ];
    let stack = Stack::start(StackOpts {
        demo: DemoOpts { no_dedup: true, faults: false, ..Default::default() },
        sidecar: SidecarOpts {
            redis_url: Some(backends::redis_url()),
            database_url: Some(postgres.url()),
            extra_args: args.iter().map(|a| a.to_string()).collect(),
        },
        envoy_edits: vec![without_replay_cache()],
        ..Default::default()
    })
    .await?;

    // Envoy's CPU, from process-exporter watching this stack's Envoy alone (by its configuration's path).
    let envoy_config = stack.dir.path().join("envoy-e2e.yaml");
    let exporter_port = free_port()?;
    let exporter_config = stack.dir.path().join("process-exporter.yml");
    let process_names = format!(
        "process_names:\n  - name: envoy\n    cmdline:\n      - '{}'\n",
        regex_escaped(&envoy_config.display().to_string())
    );
    std::fs::write(&exporter_config, process_names)?;
    let mut exporter = Proc::spawn(
        "process-exporter",
        Command::new(exporter)
            .arg(format!("-config.path={}", exporter_config.display()))
            .arg(format!("-web.listen-address=127.0.0.1:{exporter_port}"))
            .args(["-threads=false", "-gather-smaps=false"]),
        stack.dir.path(),
    )?;
    wait_ready(&format!("http://127.0.0.1:{exporter_port}/metrics"), &mut exporter).await?;

    let prom_dir = tempfile::tempdir()?;
    std::fs::write(prom_dir.path().join("alerts.yaml"), rules_with_short_for()?)?;
    let config = format!(
        "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
         rule_files: [alerts.yaml]\n\
         scrape_configs:\n\
         - {{job_name: idemd, static_configs: [{{targets: ['127.0.0.1:{}']}}]}}\n\
         - {{job_name: envoy, metrics_path: /stats/prometheus, static_configs: [{{targets: ['127.0.0.1:{}']}}]}}\n\
         - {{job_name: process, static_configs: [{{targets: ['127.0.0.1:{exporter_port}']}}]}}\n",
        stack.ports.sidecar, stack.ports.admin
    );
    let prom = Prometheus::start(&prometheus, prom_dir.path(), &config).await?;

    // Every target scraped, and the counters the security alert compares recorded at their starting
    // values, before anything happens.
    prom.until("all three targets up", Duration::from_secs(20), || async {
        let t = prom.targets().await?;
        Ok((t.len() == 3 && t.iter().all(|(_, h)| h == "up")).then_some(()))
    })
    .await?;
    prom.until("the starting values", Duration::from_secs(20), || async {
        let filter = prom.query(r#"idem:filter_events_total{event="security_params_changed"}"#).await?;
        let idemd = prom.query(r#"idem_security_events_total{kind="params_changed"}"#).await?;
        Ok((!filter.is_empty() && !idemd.is_empty()).then_some(()))
    })
    .await?;

    workload(&stack).await?;
    let m = stack.idemd_metrics().await?;
    assert!(metric(&m, "idem_redis_refill_total", &[("state", "DONE")]).is_some_and(|v| v >= 1.0), "{m}");

    // The tampered confirm fires the security alert, with its kind and runbook.
    let fired = prom
        .until("IdemSecurityEvent firing", Duration::from_secs(30), || async {
            let f = prom.firing("IdemSecurityEvent").await?;
            Ok(f.into_iter().find(|a| a["labels"]["kind"] == "params_changed"))
        })
        .await?;
    assert_eq!(fired["labels"]["severity"], "warning", "{fired}");
    assert_eq!(fired["annotations"]["runbook_url"], "docs/operations.md#idemsecurityevent", "{fired}");
    assert!(prom.firing("IdemSqlStoreDown").await?.is_empty(), "SQL is up");

    // Every rule evaluates on the real series without an error (a recording rule whose output
    // collided, a query Prometheus refuses).
    let rules = prom
        .until("every rule evaluated", Duration::from_secs(20), || async {
            let r = prom.rules().await?;
            Ok((!r.is_empty() && r.iter().all(|(_, _, health, _)| health != "unknown")).then_some(r))
        })
        .await?;
    for (group, name, health, error) in &rules {
        assert_eq!(health, "ok", "{group}/{name}: {error}");
    }

    // Every dashboard query returns data, and at least one finite number, after the workload.
    for (panel, expr) in dashboard_queries()? {
        prom.until(&format!("data for {panel:?}: {expr}"), Duration::from_secs(20), || async {
            Ok(prom.query(&expr).await?.iter().any(finite).then_some(()))
        })
        .await?;
    }

    // Postgres stops: the probe notices without any traffic, and the store alert fires.
    postgres.stop()?;
    let fired = prom
        .until("IdemSqlStoreDown firing", Duration::from_secs(30), || async {
            Ok(prom.firing("IdemSqlStoreDown").await?.into_iter().next())
        })
        .await?;
    assert_eq!(fired["labels"]["severity"], "critical", "{fired}");
    assert_eq!(fired["labels"]["instance"], format!("127.0.0.1:{}", stack.ports.sidecar), "{fired}");
    // What that means for an agent: this call ran nothing, and it is told so.
    let (_, fp) = stack.preview(json!("42.00")).await?;
    let a = stack.post("/v1/transfers", SUBJECT, &transfer(json!("42.00"), "m"), &[("agent-fingerprint", &fp)]).await?;
    a.assert_prompt("status_unavailable");
    drop(exporter);
    Ok(())
}
