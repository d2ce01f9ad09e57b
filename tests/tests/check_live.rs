//! Live: the configurations `idemd check` once accepted that skip the guard or run a confirm
//! twice, each run in a real Envoy (both builds: `IDEM_E2E_HOST=native` runs the native module) with idemd and
//! the demo, the bypass or double execution shown by the demo's ledger and Envoy's access log, and the check's
//! verdict on the very file Envoy ran: refused, by the rule named for that way. The generated configurations'
//! prober finds each of them too (so it would have caught them had the check accepted them).

use idem_e2e::configs::probe::{self, Found};
use idem_e2e::configs::rig::Rig;
use idem_e2e::configs::{self, rig::Verdict};
use idem_e2e::*;
use idem_testkit::envoy_config::Doc;
use rand::SeedableRng;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Check `doc` as Envoy will run it, then start Envoy on it: the verdict, the access log, the running Envoy.
async fn run(rig: &Rig, name: &str, doc: &Doc) -> Result<(Verdict, std::path::PathBuf, Proc, Doc), BoxError> {
    let (logged, log) = rig.with_access_log(doc, name)?;
    let path = rig.write(name, &logged)?;
    let verdict = rig.check(&path)?;
    let envoy = rig.envoy(&path).await?;
    Ok((verdict, log, envoy, logged))
}

/// Refused, by `rule` and nothing else.
fn refused_by(verdict: &Verdict, rule: &str) {
    assert!(!verdict.accepted, "idemd check accepts it:\n{}", verdict.output);
    assert!(verdict.rules.iter().all(|r| r == rule), "only [{rule}]:\n{}", verdict.output);
    assert!(!verdict.rules.is_empty(), "{}", verdict.output);
}

/// The generated configurations' prober, on every probe the configuration offers: it finds the way too.
async fn prober_finds_it(rig: &Rig, doc: &Doc, log: &std::path::Path, tag: &str) -> Result<Found, BoxError> {
    let all = probe::probes(rig, doc).await?;
    let mut found = Found::default();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    probe::around_the_guard(rig, &all, all.len(), tag, log, &mut rng, &mut found).await?;
    assert!(!found.violations.is_empty(), "the prober sent {} probes and found nothing", found.probes);
    Ok(found)
}

fn route(doc: &Doc, path: &str) -> Result<String, BoxError> {
    doc.routes()
        .into_iter()
        .find(|r| doc.0.pointer(&format!("{r}/match/path")).and_then(Value::as_str) == Some(path))
        .ok_or_else(|| format!("no route for {path}").into())
}

/// POST a transfer at `port` with `host`, no fingerprint, the client's own key.
async fn unguarded(rig: &Rig, port: u16, host: &str, path: &str, key: &str) -> Result<u16, BoxError> {
    let r = rig
        .http
        .post(format!("http://127.0.0.1:{port}{path}"))
        .header("host", host)
        .header("x-agent-subject", SUBJECT)
        .header("idempotency-key", key)
        .json(&transfer(json!("9.00"), key))
        .send()
        .await?;
    Ok(r.status().as_u16())
}

/// How many times the demo ran a confirm with `key`.
async fn ran(rig: &Rig, key: &str) -> Result<u64, BoxError> {
    Ok(rig.ledger().await?["attempts_by_key"][key].as_u64().unwrap_or(0))
}

#[tokio::test]
async fn an_unannotated_route_to_the_confirm_in_another_virtual_host_runs_it_unguarded_and_is_refused() -> TestResult {
    let mut rig = Rig::start(DemoOpts { no_dedup: true, ..Default::default() }).await?;
    let mut doc = configs::base(&mut rig, "e2e.yaml").await?;
    // What envoy/e2e.yaml had: `other.example` sent /v1/transfers straight to the demo.
    let other = doc
        .routes()
        .into_iter()
        .find(|r| {
            r.contains("/virtual_hosts/1/")
                && doc.0.pointer(&format!("{r}/match/path")) == Some(&json!("/v1/transfers"))
        })
        .ok_or("no other.example route")?;
    doc.object_mut(&format!("{other}/route"))?.remove("prefix_rewrite");
    let (verdict, log, _envoy, logged) = run(&rig, "other", &doc).await?;
    assert_eq!(unguarded(&rig, rig.ports.listener, "other.example", "/v1/transfers", "around-other").await?, 201);
    assert_eq!(ran(&rig, "around-other").await?, 1, "executed with no fingerprint: {}", rig.ledger().await?);
    refused_by(&verdict, "exact-route-to-guarded-path");
    assert!(verdict.output.contains("virtual host other: route transfer_confirm"), "{}", verdict.output);
    prober_finds_it(&rig, &logged, &log, "other").await?;
    Ok(())
}

#[tokio::test]
async fn a_rewrite_onto_the_confirm_path_runs_it_unguarded_and_is_refused() -> TestResult {
    let mut rig = Rig::start(DemoOpts { no_dedup: true, ..Default::default() }).await?;
    let mut doc = configs::base(&mut rig, "e2e.yaml").await?;
    // What envoy/e2e.yaml had: /plain/v1/transfers, prefix_rewrite /v1/transfers; and the same by regex_rewrite.
    let plain = route(&doc, "/plain/v1/transfers")?;
    doc.object_mut(&format!("{plain}/route"))?.insert("prefix_rewrite".into(), json!("/v1/transfers"));
    let host = plain.rsplit_once("/routes/").ok_or("a route pointer")?.0.to_string();
    doc.insert_route(
        &host,
        0,
        json!({ "name": "legacy", "match": { "path": "/legacy/transfers" }, "route": { "cluster": "demo",
            "regex_rewrite": { "pattern": { "regex": "^/legacy/(.*)$" }, "substitution": "/v1/\\1" } } }),
    )?;
    let (verdict, log, _envoy, logged) = run(&rig, "rewrite", &doc).await?;
    let port = rig.ports.listener;
    assert_eq!(unguarded(&rig, port, "probe.example", "/plain/v1/transfers", "around-prefix").await?, 201);
    assert_eq!(unguarded(&rig, port, "probe.example", "/legacy/transfers", "around-regex").await?, 201);
    assert_eq!(ran(&rig, "around-prefix").await?, 1, "{}", rig.ledger().await?);
    assert_eq!(ran(&rig, "around-regex").await?, 1, "{}", rig.ledger().await?);
    let deadline = Instant::now() + Duration::from_secs(5);
    let line = loop {
        // Envoy writes its access log every 20 ms here.
        if let Some(l) = rig.access(&log)?.into_iter().find(|l| l["key"] == "around-regex") {
            break l;
        }
        if Instant::now() > deadline {
            return Err("no access log line for around-regex".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(
        (line["original_path"].as_str(), line["path"].as_str()),
        (Some("/legacy/transfers"), Some("/v1/transfers"))
    );
    refused_by(&verdict, "exact-route-to-guarded-path");
    assert!(verdict.output.contains("after prefix_rewrite /v1/transfers to /v1/transfers"), "{}", verdict.output);
    assert!(verdict.output.contains("route legacy: [exact-route-to-guarded-path]"), "{}", verdict.output);
    prober_finds_it(&rig, &logged, &log, "rewrite").await?;
    Ok(())
}

#[tokio::test]
async fn a_second_listener_without_the_filter_runs_confirms_unguarded_and_is_refused() -> TestResult {
    let mut rig = Rig::start(DemoOpts { no_dedup: true, ..Default::default() }).await?;
    let mut doc = configs::base(&mut rig, "e2e.yaml").await?;
    // The same routes on another port, without the agent filter (port 0: Envoy picks it).
    let copy = doc.copy_listener(0, "side_door", 0, true)?;
    doc.add_listener(copy)?;
    let (verdict, log, _envoy, logged) = run(&rig, "side-door", &doc).await?;
    let port =
        rig.listeners().await?.into_iter().find(|(n, _)| n == "side_door").map(|(_, p)| p).ok_or("no side_door")?;
    assert_eq!(unguarded(&rig, port, "probe.example", "/v1/transfers", "around-listener").await?, 201);
    assert_eq!(ran(&rig, "around-listener").await?, 1, "{}", rig.ledger().await?);
    // The filter's own listener still refuses the same request.
    assert_eq!(unguarded(&rig, rig.ports.listener, "probe.example", "/v1/transfers", "guarded").await?, 428);
    assert_eq!(ran(&rig, "guarded").await?, 0);
    refused_by(&verdict, "unfiltered-listener-to-guarded-path");
    assert!(
        verdict.output.contains("listener side_door: virtual host transfers: route transfer_confirm"),
        "{}",
        verdict.output
    );
    prober_finds_it(&rig, &logged, &log, "side").await?;
    Ok(())
}

/// The agent filter's `http_filters` entry says `disabled: true`, as Envoy Gateway writes its filters, and no
/// route enables it: Envoy runs the filter nowhere. The check read only a route's or virtual host's `disabled`
/// and accepted the file; the filter's settings and annotations were all still there to read.
#[tokio::test]
async fn a_filter_disabled_on_its_entry_and_enabled_nowhere_runs_confirms_unguarded_and_is_refused() -> TestResult {
    let mut rig = Rig::start(DemoOpts { no_dedup: true, ..Default::default() }).await?;
    let mut doc = configs::base(&mut rig, "e2e.yaml").await?;
    let manager = doc.managers().into_iter().next().ok_or("no connection manager")?;
    let (index, _) = doc.agent_filter(&manager).ok_or("no agent filter")?;
    doc.object_mut(&format!("{manager}/http_filters/{index}"))?.insert("disabled".into(), json!(true));
    let (verdict, log, _envoy, logged) = run(&rig, "entry-disabled", &doc).await?;
    assert_eq!(unguarded(&rig, rig.ports.listener, "probe.example", "/v1/transfers", "around-entry").await?, 201);
    assert_eq!(ran(&rig, "around-entry").await?, 1, "executed with no fingerprint: {}", rig.ledger().await?);
    refused_by(&verdict, "filter-disabled-on-annotated-route");
    assert!(verdict.output.contains("disabled on its http_filters entry"), "{}", verdict.output);
    prober_finds_it(&rig, &logged, &log, "entry").await?;
    Ok(())
}

#[tokio::test]
async fn a_mirrored_confirm_whose_upstream_ignores_keys_runs_twice_and_is_refused() -> TestResult {
    // The demo as an upstream without key support: every confirm that arrives executes.
    let mut rig = Rig::start(DemoOpts { no_keys: true, ..Default::default() }).await?;
    let mut doc = configs::base(&mut rig, "e2e.yaml").await?;
    let confirm = doc.route_named("nokey_confirm")?;
    doc.object_mut(&format!("{confirm}/route"))?
        .insert("request_mirror_policies".into(), json!([{ "cluster": "demo" }]));
    let (verdict, _log, _envoy, _) = run(&rig, "mirror", &doc).await?;
    let url = |p: &str| format!("http://127.0.0.1:{}{p}", rig.ports.listener);
    let mut body = transfer(json!("15.00"), "mirrored");
    body["client_ref"] = json!("ref-mirrored-1");
    let preview: Value = rig
        .http
        .post(url("/nokey/v1/transfers/preview"))
        .header("x-agent-subject", SUBJECT)
        .json(&body)
        .send()
        .await?
        .json()
        .await?;
    let fp = preview["fingerprint"].as_str().ok_or("no fingerprint")?;
    let first = rig
        .http
        .post(url("/nokey/v1/transfers"))
        .header("x-agent-subject", SUBJECT)
        .header("agent-fingerprint", fp)
        .json(&body)
        .send()
        .await?;
    assert_eq!(first.status().as_u16(), 201, "{}", first.text().await?);
    // The mirror's copy arrives on its own time.
    let deadline = Instant::now() + Duration::from_secs(5);
    while rig.ledger().await?["total"] != 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ledger = rig.ledger().await?;
    assert_eq!(ledger["total"], 2, "one confirm, one fingerprint, two transfers: {ledger}");
    refused_by(&verdict, "request-mirror");
    assert!(verdict.output.contains("route nokey_confirm: [request-mirror]"), "{}", verdict.output);
    Ok(())
}
