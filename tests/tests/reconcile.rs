//! Crash safety end to end: real Envoy + idemd (reconciler on) + Redis +
//! Postgres, in front of the demo with `--faults` and `--no-dedup` (so every
//! execution the demo counts is one the gateway let through).
//!
//! Each test has a Postgres database of its own: a reconciler decides every
//! stale row of its database, asking its own demo, so stacks must not share
//! a table. Short leases (the `/fast` and `/manual` routes, 2 s) and a fast
//! reconciler keep every test to a few seconds.

use idem_e2e::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// The demo's by-key endpoint, as scripts/run.sh configures it (the harness
/// points 127.0.0.1:8080 at this stack's demo).
const STATUS_ENDPOINT: &str = "payments.transfer=http://127.0.0.1:8080/v1/transfers/by-key/{key}";
/// How the demo's record reads: its `status` says "executed", and a replay
/// carries the 201 the confirm route answers.
const STATUS_READING: &str = "payments.transfer=pointer=/status;done=executed;failed=failed;done_status=201";

/// A reconciling sidecar on Redis and `db`: leases of at least 1.5 s, a pass
/// every 200 ms, a 404 trusted 1 s after the lease ended.
fn reconciling(db: &str, instance: &str) -> StackOpts {
    let args = [
        "--lease-ms",
        "1500",
        "--upstream-worst-case-ms",
        "500",
        "--gateway-timeout-ms",
        "500",
        "--retry-backoff-total-ms",
        "100",
        "--reconcile-interval-ms",
        "200",
        "--reconcile-grace-ms",
        "1000",
        "--status-timeout-ms",
        "1000",
        "--status-endpoint",
        STATUS_ENDPOINT,
        "--status-reading",
        STATUS_READING,
        "--instance-id",
        instance,
    ];
    StackOpts {
        demo: DemoOpts { no_dedup: true, faults: true, ..Default::default() },
        sidecar: SidecarOpts {
            redis_url: Some(backends::redis_url()),
            database_url: Some(db.to_owned()),
            extra_args: args.iter().map(|a| a.to_string()).collect(),
        },
        ..Default::default()
    }
}

/// Acquire a fingerprint's operation at idemd itself, as the filter does, and
/// forward nothing: what an Envoy killed between acquire and forwarding leaves.
async fn acquire_directly(stack: &Stack, fp: &str, lease_ms: u64) -> TestResult {
    let claims = fingerprint_claims(fp)?;
    let acquire = json!({"key": nonce_of(fp)?, "param_hash": claims["p"], "subject_hash": claims["u"], "scope": claims["s"], "lease_ms": lease_ms});
    let r: Value = stack
        .http
        .post(stack.sidecar_url("/v1/acquire"))
        .bearer_auth(SIDECAR_TOKEN)
        .json(&acquire)
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(r["outcome"], "ACQUIRED", "{r}");
    Ok(())
}

/// Redis and a Postgres database of this test's own; None (loud skip) otherwise.
fn stores() -> Result<Option<backends::OwnPostgres>, BoxError> {
    if !backends::available("redis", &backends::redis_url())? {
        return Ok(None);
    }
    backends::own_postgres()
}

async fn confirm(stack: &Stack, path: &str, fp: &str, headers: &[(&str, &str)]) -> Result<Answer, BoxError> {
    let mut all = vec![("agent-fingerprint", fp)];
    all.extend_from_slice(headers);
    stack.post(path, SUBJECT, &transfer(json!("25.00"), "rent"), &all).await
}

/// Retry the same confirm until the answer's status is `want`; every answer
/// before it must be `in_progress` (never a second execution, never a raw error).
async fn retry_until(stack: &Stack, path: &str, fp: &str, want: &str, within: Duration) -> Result<Answer, BoxError> {
    let deadline = Instant::now() + within;
    loop {
        let a = confirm(stack, path, fp, &[]).await?;
        let status = a.json["status"].as_str().unwrap_or("");
        if status == want {
            return Ok(a);
        }
        assert_eq!((a.status, status), (202, "in_progress"), "while waiting for {want}: {a:?}");
        assert_eq!(a.json["poll_with"], "get_transfer_status", "{a:?}");
        if Instant::now() > deadline {
            return Err(format!("no {want} within {within:?}; last: {a:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The `/fast` confirm with one demo fault header, sent in the background: its answer comes later.
fn spawn_confirm(
    stack: &Stack,
    fp: &str,
    fault: (&str, &str),
) -> tokio::task::JoinHandle<Result<reqwest::Response, reqwest::Error>> {
    let req = stack
        .http
        .post(stack.url("/fast/v1/transfers"))
        .header("x-agent-subject", SUBJECT)
        .header("agent-fingerprint", fp)
        .header(fault.0, fault.1)
        .json(&transfer(json!("25.00"), "rent"));
    tokio::spawn(req.send())
}

async fn executions(stack: &Stack) -> Result<(u64, u64), BoxError> {
    let ex = stack.executions().await?;
    Ok((ex["total"].as_u64().unwrap_or(u64::MAX), ex["attempts"].as_u64().unwrap_or(u64::MAX)))
}

/// The demo's own record of a key, straight from the demo.
async fn demo_record(stack: &Stack, key: &str) -> Result<(u16, Value), BoxError> {
    let url = format!("http://127.0.0.1:{}/v1/transfers/by-key/{key}", stack.ports.demo);
    let r = stack.http.get(url).send().await?;
    Ok((r.status().as_u16(), r.json().await.unwrap_or(Value::Null)))
}

/// `idemd ops show <key> --json`: the audit trail as "actor action" lines.
fn trail(db: &str, key: &str) -> Result<Vec<String>, BoxError> {
    let (code, out, err) = idemd_ops(db, &["show", key, "--json"])?;
    assert_eq!(code, 0, "ops show: {err}");
    let v: Value = serde_json::from_str(&out)?;
    Ok(v["history"]
        .as_array()
        .ok_or("no history")?
        .iter()
        .map(|h| format!("{} {}", h["actor"].as_str().unwrap_or("?"), h["action"].as_str().unwrap_or("?")))
        .collect())
}

#[tokio::test]
async fn crash_after_the_downstream_committed_is_reconciled_to_done() -> TestResult {
    let Some(db) = stores()? else { return Ok(()) };
    let mut stack = Stack::start(reconciling(&db.url, "crash")).await?;
    let (_, fp) = stack.preview(json!("25.00")).await?;
    let key = nonce_of(&fp)?;

    // The demo commits, then dies before answering.
    let first = confirm(&stack, "/fast/v1/transfers", &fp, &[("x-demo-crash-after-commit", "1")]).await?;
    assert_eq!(first.status, 202, "{first:?}");
    first.assert_prompt("in_progress");
    assert_eq!(first.json["poll_with"], "get_transfer_status");
    let retry = confirm(&stack, "/fast/v1/transfers", &fp, &[]).await?;
    retry.assert_prompt("in_progress");
    assert_eq!(retry.json["poll_with"], "get_transfer_status");

    stack.restart_demo().await?;
    let (found, record) = demo_record(&stack, &key).await?;
    assert_eq!(found, 200, "the demo committed before it died: {record}");

    let done = retry_until(&stack, "/fast/v1/transfers", &fp, "already_completed", Duration::from_secs(10)).await?;
    done.assert_prompt("already_completed");
    assert_eq!(done.status, 201, "a reconciled DONE replays like the original (declared done_status)");
    assert_eq!(done.json["original_status"], 201);
    assert_eq!(done.json["result"], record, "the result is the demo's own record");
    assert_eq!(done.json["result_ref"], record["transfer_id"]);
    assert_eq!(executions(&stack).await?, (1, 1), "executed once; the retries never reached the demo");
    // A pass that found the demo still restarting may add a reconcile_retry line.
    let steps: Vec<String> = trail(&db.url, &key)?.into_iter().filter(|s| !s.ends_with("reconcile_retry")).collect();
    assert_eq!(steps, ["filter acquire", "reconciler:crash reconcile_done"]);
    Ok(())
}

/// The seed's kill -9 "between the downstream's answer and the terminal write", hit exactly: the demo
/// commits and holds its answer (`x-demo-hold-after-commit`), idemd is SIGKILLed, then the answer goes
/// out, so the filter's `/v1/complete` finds no idemd. The agent still gets the answer; after the
/// restart, retries hear `in_progress` until the reconciler reads the demo's record, then the
/// original result: one execution, never a second one.
#[tokio::test]
async fn idemd_killed_after_the_downstream_answered_before_complete_settles_once() -> TestResult {
    let Some(db) = stores()? else { return Ok(()) };
    let mut stack = Stack::start(reconciling(&db.url, "window")).await?;
    let (_, fp) = stack.preview(json!("25.00")).await?;
    let key = nonce_of(&fp)?;

    let first = spawn_confirm(&stack, &fp, ("x-demo-hold-after-commit", "window"));
    let record = stack.wait_committed("window", Duration::from_secs(10)).await?;
    // The demo has executed and not answered: nothing but the acquire is recorded.
    assert_eq!(record["idempotency_key"], key.as_str());
    assert_eq!(trail(&db.url, &key)?, ["filter acquire"]);
    stack.sidecar.kill9();
    stack.release_hold("window")?;

    let first = first.await??;
    if FilterHost::current()?.is_ext_proc() {
        // idemd is the filter and held the answer: Envoy's ext_proc filter answers for it, "could not check".
        assert_eq!(first.status().as_u16(), 503, "{first:?}");
        let said = first.json::<Value>().await?;
        let unavailable = (Some("status_unavailable"), Some(true));
        assert_eq!((said["status"].as_str(), said["retryable"].as_bool()), unavailable, "{said}");
    } else {
        assert_eq!(first.status().as_u16(), 201, "the downstream's answer still reaches the agent");
        assert_eq!(first.json::<Value>().await?, record);
        assert!(stack.stat("wasmcustom.idem.sidecar_errors").await? >= 1, "the complete found no idemd");
        assert_eq!(stack.stat("wasmcustom.idem.completed").await?, 0);
    }

    stack.restart_sidecar().await?;
    let done = retry_until(&stack, "/fast/v1/transfers", &fp, "already_completed", Duration::from_secs(15)).await?;
    assert_eq!(done.status, 201);
    assert_eq!(done.json["result"], record, "the original result, read from the demo by the reconciler");
    assert_eq!(executions(&stack).await?, (1, 1), "executed once; no retry reached the demo");
    assert_eq!(trail(&db.url, &key)?, ["filter acquire", "reconciler:window reconcile_done"]);
    Ok(())
}

#[tokio::test]
async fn envoy_killed_mid_confirm_is_reconciled_after_restart() -> TestResult {
    let Some(db) = stores()? else { return Ok(()) };
    let mut stack = Stack::start(reconciling(&db.url, "kill9")).await?;
    let (_, fp) = stack.preview(json!("25.00")).await?;
    let key = nonce_of(&fp)?;

    let in_flight = stack.spawn_confirm("/fast/v1/transfers", &fp, transfer(json!("25.00"), "rent"), 2000);
    // Kill Envoy once the demo has the request (it keeps executing without a caller).
    let deadline = Instant::now() + Duration::from_secs(5);
    while executions(&stack).await?.1 == 0 {
        assert!(Instant::now() < deadline, "the confirm never reached the demo");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stack.restart_envoy().await?;
    assert!(in_flight.await?.is_err(), "the caller lost its connection with Envoy");

    // The lease (2 s) is live unless the restart outlasted it and the grace (a loaded machine):
    // then the reconciler has decided already. Either way, never a second execution.
    let a = confirm(&stack, "/fast/v1/transfers", &fp, &[]).await?;
    assert!(matches!(a.json["status"].as_str(), Some("in_progress" | "already_completed")), "{a:?}");
    let done = retry_until(&stack, "/fast/v1/transfers", &fp, "already_completed", Duration::from_secs(10)).await?;
    let (_, record) = demo_record(&stack, &key).await?;
    assert_eq!(done.json["result"], record);
    assert_eq!(executions(&stack).await?, (1, 1), "the demo finished the first request and saw no other");
    let steps = trail(&db.url, &key)?;
    assert_eq!(steps, ["filter acquire", "reconciler:kill9 reconcile_done"]);
    Ok(())
}

#[tokio::test]
async fn acquired_but_never_forwarded_is_released_then_runs_once() -> TestResult {
    let Some(db) = stores()? else { return Ok(()) };
    let stack = Stack::start(reconciling(&db.url, "never")).await?;
    let (_, fp) = stack.preview(json!("25.00")).await?;
    let key = nonce_of(&fp)?;

    // What an Envoy killed between acquire and forwarding leaves behind.
    acquire_directly(&stack, &fp, 2000).await?;

    let a = confirm(&stack, "/fast/v1/transfers", &fp, &[]).await?;
    a.assert_prompt("in_progress");
    // The lease (2 s) and the grace (1 s) pass, the demo says 404: released,
    // and the agent's next retry executes it.
    let ran = retry_until(&stack, "/fast/v1/transfers", &fp, "executed", Duration::from_secs(10)).await?;
    assert_eq!(ran.status, 201, "{ran:?}");
    assert_eq!(ran.json["idempotency_key"], key.as_str(), "still keyed by the same nonce");
    let again = confirm(&stack, "/fast/v1/transfers", &fp, &[]).await?;
    again.assert_prompt("already_completed");
    assert_eq!(executions(&stack).await?, (1, 1), "exactly once, and the demo saw only that request");
    assert_eq!(
        trail(&db.url, &key)?,
        ["filter acquire", "reconciler:never reconcile_release", "filter acquire", "filter complete"]
    );
    Ok(())
}

#[tokio::test]
async fn no_status_endpoint_needs_review_until_an_operator_resolves_it() -> TestResult {
    let Some(db) = stores()? else { return Ok(()) };
    let mut stack = Stack::start(reconciling(&db.url, "manual")).await?;
    let p = stack.post("/manual/v1/transfers/preview", SUBJECT, &transfer(json!("25.00"), "rent"), &[]).await?;
    let fp = p.json["fingerprint"].as_str().ok_or("no fingerprint")?.to_owned();
    let key = nonce_of(&fp)?;

    let first = confirm(&stack, "/manual/v1/transfers", &fp, &[("x-demo-crash-after-commit", "1")]).await?;
    first.assert_prompt("in_progress");
    stack.restart_demo().await?;
    // payments.manual has no status endpoint: after the lease, a person decides.
    let review = retry_until(&stack, "/manual/v1/transfers", &fp, "needs_review", Duration::from_secs(10)).await?;
    assert_eq!(review.status, 202);
    review.assert_prompt("needs_review");
    let status = stack.get(&format!("/manual/v1/transfers/status?fingerprint={fp}"), SUBJECT, &[]).await?;
    status.assert_prompt("needs_review");

    // The operator finds the transfer in the demo's books and records it.
    let (found, record) = demo_record(&stack, &key).await?;
    assert_eq!(found, 200);
    let file = stack.dir.path().join("record.json");
    std::fs::write(&file, serde_json::to_vec(&record)?)?;
    let file = file.display().to_string();
    let why = "found the transfer in the demo ledger";
    let (code, out, err) =
        idemd_ops(&db.url, &["resolve", &key, "--done", "--result-file", &file, "--why", why, "--actor", "carol"])?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("NEEDS_REVIEW -> DONE"), "{out}");

    let done = confirm(&stack, "/manual/v1/transfers", &fp, &[]).await?;
    done.assert_prompt("already_completed");
    assert_eq!(done.json["result"], record);
    assert_eq!(executions(&stack).await?, (1, 1));
    assert_eq!(
        trail(&db.url, &key)?,
        ["filter acquire", "reconciler:manual reconcile_needs_review", "operator:carol resolve_done"]
    );
    let (code, _, err) =
        idemd_ops(&db.url, &["resolve", &key, "--release", "--why", "second thoughts", "--actor", "carol"])?;
    assert_eq!(code, 3, "a decided operation stays decided: {err}");
    Ok(())
}

#[tokio::test]
async fn two_sidecars_reconciling_one_database_decide_each_row_once() -> TestResult {
    let Some(db) = stores()? else { return Ok(()) };
    let stack = Stack::start(reconciling(&db.url, "a")).await?;
    let replica_opts = reconciling(&db.url, "b").sidecar.for_ports(&stack.ports);
    let replica_port = free_port()?;
    let mut replica = spawn_sidecar("idemd-b", &replica_opts, replica_port, stack.dir.path())?;
    wait_ready(&format!("http://127.0.0.1:{replica_port}/healthz"), &mut replica).await?;

    // Twelve operations left IN_FLIGHT by executors that vanished; the demo
    // has executed every other one.
    let mut keys = Vec::new();
    for i in 0..12 {
        let (_, fp) = stack.preview(json!("25.00")).await?;
        let key = nonce_of(&fp)?;
        acquire_directly(&stack, &fp, 0).await?;
        if i % 2 == 0 {
            let url = format!("http://127.0.0.1:{}/v1/transfers", stack.ports.demo);
            let done = stack
                .http
                .post(url)
                .header("idempotency-key", &key)
                .json(&transfer(json!("25.00"), "m"))
                .send()
                .await?;
            assert_eq!(done.status().as_u16(), 201);
        }
        keys.push(key);
    }

    let deadline = Instant::now() + Duration::from_secs(10);
    for (i, key) in keys.iter().enumerate() {
        let want = if i % 2 == 0 { 200 } else { 404 };
        loop {
            let r = stack
                .http
                .get(stack.sidecar_url(&format!("/v1/operations/{key}")))
                .bearer_auth(SIDECAR_TOKEN)
                .send()
                .await?;
            let status = r.status().as_u16();
            let view: Value = r.json().await?;
            if status == want && (want == 404 || view["state"] == "DONE") {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!("{key} not decided in time: {status} {view}").into());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let mut deciders = std::collections::BTreeSet::new();
    for (i, key) in keys.iter().enumerate() {
        let decisions: Vec<String> =
            trail(&db.url, key)?.into_iter().filter(|s| s.starts_with("reconciler:")).collect();
        assert_eq!(decisions.len(), 1, "{key}: {decisions:?}");
        let expected = if i % 2 == 0 { "reconcile_done" } else { "reconcile_release" };
        assert!(decisions[0].ends_with(expected), "{key}: {decisions:?}");
        deciders.insert(decisions[0].split(' ').next().unwrap_or("").to_owned());
    }
    eprintln!("rows decided by: {deciders:?}");
    assert_eq!(executions(&stack).await?.0, 6);
    Ok(())
}

#[test]
fn a_lease_shorter_than_the_upstream_worst_case_refuses_to_start() -> TestResult {
    let out = std::process::Command::new(bin("idemd")?)
        .args(["serve", "--listen", "127.0.0.1:0", "--lease-ms", "1000"])
        .args(["--upstream-worst-case-ms", "800", "--gateway-timeout-ms", "500", "--retry-backoff-total-ms", "100"])
        .args(["--status-endpoint", STATUS_ENDPOINT])
        .env_remove("IDEM_LEASE_MS")
        .output()?;
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("IN_FLIGHT lease 1000 ms must exceed upstream worst case 800 + gateway timeout 500 + retry backoff 100 = 1400 ms (short by 401 ms)"),
        "{err}"
    );
    Ok(())
}

/// DESIGN §4, "a lease cannot lapse under a live request": a 2 s lease (the `/fast`
/// route; idemd's own is 1.5 s) behind Envoy's 15 s route timeout, and an upstream that takes 6 s. The
/// filter renews the lease while it waits, so the reconciler never takes the row: a retry past the
/// lease and the reconciler's grace hears `in_progress` (without renewal the reconciler's 404 would
/// have released the operation by then, and the retry executed a second transfer), and once the
/// first answer is in, the retry gets it.
#[tokio::test]
async fn a_confirm_upstream_past_its_lease_is_renewed_and_executes_once() -> TestResult {
    let Some(db) = stores()? else { return Ok(()) };
    let stack = Stack::start(reconciling(&db.url, "renew")).await?;
    let (_, fp) = stack.preview(json!("25.00")).await?;
    let key = nonce_of(&fp)?;

    let first = spawn_confirm(&stack, &fp, ("x-demo-delay-ms", "6000"));
    // Past the lease (2 s) and the grace after it (1 s), with the reconciler passing every 200 ms.
    tokio::time::sleep(Duration::from_millis(4_000)).await;
    let retry = confirm(&stack, "/fast/v1/transfers", &fp, &[]).await?;
    assert_eq!(retry.status, 202, "{retry:?}");
    retry.assert_prompt("in_progress");

    let first = first.await??;
    assert_eq!(first.status().as_u16(), 201, "the slow upstream's answer reaches the agent");
    let record: Value = first.json().await?;
    let replay = confirm(&stack, "/fast/v1/transfers", &fp, &[]).await?;
    replay.assert_prompt("already_completed");
    assert_eq!(replay.json["result"]["transfer_id"], record["transfer_id"], "{replay:?}");
    assert_eq!(executions(&stack).await?, (1, 1), "executed once; the retries never reached the demo");

    let m = stack.idemd_metrics().await?;
    let renewed = metric(&m, "idem_lease_renewals_total", &[("outcome", "renewed")]).unwrap_or(0.0);
    assert!(renewed >= 3.0, "renewed every third of the 2 s lease for 6 s: {renewed}\n{m}");
    assert_eq!(metric(&m, "idem_lease_renewals_total", &[("outcome", "lost")]).unwrap_or(0.0), 0.0, "{m}");
    assert_eq!(trail(&db.url, &key)?, ["filter acquire", "filter complete"], "the reconciler never judged it");
    if FilterHost::current()? == FilterHost::Wasm {
        // The native module renews from Envoy's main thread, which has no stream to count on.
        assert!(stack.stat("wasmcustom.idem.lease_renewals").await? >= 3);
    }
    Ok(())
}
