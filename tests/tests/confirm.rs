//! The confirm state machine in the data plane: real Envoy + idemd + Redis +
//! Postgres (and one SQLite-only run) in front of the demo in `--no-dedup`
//! mode, so "exactly once" is the gateway's doing alone.

use idem_e2e::*;
use serde_json::{json, Value};
use std::time::Duration;

async fn confirm(
    stack: &Stack,
    fp: &str,
    amount: Value,
    memo: &str,
    headers: &[(&str, &str)],
) -> Result<Answer, BoxError> {
    let mut all = vec![("agent-fingerprint", fp)];
    all.extend_from_slice(headers);
    stack.post("/v1/transfers", SUBJECT, &transfer(amount, memo), &all).await
}

async fn fifty_parallel_confirms_execute_once(opts: StackOpts) -> TestResult {
    let stack = Stack::start(opts).await?;
    let (_, fp) = stack.preview(json!("250.00")).await?;
    let mut tasks = Vec::new();
    for i in 0..50 {
        let (http, url, fp) = (stack.http.clone(), stack.url("/v1/transfers"), fp.clone());
        tasks.push(tokio::spawn(async move {
            let r = http
                .post(url)
                .header("x-agent-subject", SUBJECT)
                .header("agent-fingerprint", fp)
                .json(&transfer(json!("250.00"), &format!("attempt {i}")))
                .send()
                .await?;
            let status = r.status().as_u16();
            let body: Value = r.json().await?;
            Ok::<_, reqwest::Error>((status, body))
        }));
    }
    let mut executed = Vec::new();
    let mut replayed_ids = Vec::new();
    let mut in_progress = 0;
    for t in tasks {
        let (status, body) = t.await??;
        match body["status"].as_str() {
            Some("executed") => executed.push(body["transfer_id"].clone()),
            Some("already_completed") => replayed_ids.push(body["result"]["transfer_id"].clone()),
            Some("in_progress") => {
                assert_eq!(status, 202);
                assert_eq!(body["poll_with"], "get_transfer_status");
                in_progress += 1;
            }
            other => panic!("unexpected answer {status} {other:?}: {body}"),
        }
    }
    assert_eq!(executed.len(), 1, "exactly one confirm executes");
    assert!(replayed_ids.iter().all(|id| *id == executed[0]), "every replay carries the same transfer_id");
    assert_eq!(1 + replayed_ids.len() + in_progress, 50);
    assert_eq!(counts(&stack).await?, (1, 1), "one execution, one attempt upstream");
    // idemd handed out one operation: one ACQUIRED among all the acquires it answered, every
    // confirm was answered by idemd or by Envoy's replay cache, and SQL holds one row.
    let m = stack.idemd_metrics().await?;
    assert_eq!(metric(&m, "idem_acquire_total", &[("outcome", "ACQUIRED"), ("mode", "fingerprint")]), Some(1.0), "{m}");
    let acquires = metric(&m, "idem_acquire_total", &[]).unwrap_or(0.0);
    let cached = stack.stat("wasmcustom.idem.replay_cache_hits").await? as f64;
    assert_eq!(acquires + cached, 50.0, "{acquires} acquires at idemd + {cached} cache hits: {m}");
    let key = idem_testkit::fingerprint::nonce(&fp)?;
    assert_eq!(stack.sql_rows(&key).await?, (1, 2), "one idem_record row; its audit: one acquire, one complete");
    Ok(())
}

#[tokio::test]
async fn parallel_confirms_execute_once_on_redis_and_postgres() -> TestResult {
    let Some(opts) = real_stores(false)? else { return Ok(()) };
    fifty_parallel_confirms_execute_once(opts).await
}

#[tokio::test]
async fn parallel_confirms_execute_once_on_sqlite_only() -> TestResult {
    fifty_parallel_confirms_execute_once(sqlite_only(false)).await
}

#[tokio::test]
async fn retry_replays_the_first_body_byte_for_byte() -> TestResult {
    let Some(opts) = real_stores(false)? else { return Ok(()) };
    let stack = Stack::start(opts).await?;
    let (_, fp) = stack.preview(json!("10.00")).await?;
    let first = confirm(&stack, &fp, json!("10.00"), "first", &[]).await?;
    assert_eq!(first.status, 201);
    assert_eq!(first.header("idempotent-replayed"), Some("false"));
    // Right after the first answer, with a drifted memo: a replay, never in_progress.
    let again = confirm(&stack, &fp, json!(10), "second, ASAP", &[]).await?;
    assert_eq!(again.status, 201, "the replay keeps the original status");
    again.assert_prompt("already_completed");
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.json["retryable"], false);
    assert_eq!(serde_json::to_vec(&again.json["result"])?, first.body, "result is the first body, byte for byte");
    assert_eq!(again.json["result_ref"], first.json["transfer_id"]);
    assert_eq!(counts(&stack).await?, (1, 1));
    assert!(stack.stat("wasmcustom.idem.replayed").await? >= 1);
    Ok(())
}

#[tokio::test]
async fn tampered_amount_on_retry_is_a_security_event() -> TestResult {
    let Some(opts) = real_stores(false)? else { return Ok(()) };
    let stack = Stack::start(opts).await?;
    let (_, fp) = stack.preview(json!("10.00")).await?;
    assert_eq!(confirm(&stack, &fp, json!("10.00"), "m", &[]).await?.status, 201);
    let a = confirm(&stack, &fp, json!("9999.00"), "m", &[]).await?;
    assert_eq!(a.status, 422);
    a.assert_prompt("params_changed");
    assert_eq!(stack.stat("wasmcustom.idem.security_events").await?, 1);
    assert_eq!(counts(&stack).await?, (1, 1));
    Ok(())
}

#[tokio::test]
async fn a_definite_failure_replays_as_already_failed() -> TestResult {
    let Some(opts) = real_stores(false)? else { return Ok(()) };
    let stack = Stack::start(opts).await?;
    let (_, fp) = stack.preview(json!("20000.00")).await?;
    let first = confirm(&stack, &fp, json!("20000.00"), "m", &[]).await?;
    assert_eq!(first.status, 422);
    assert_eq!(first.json["error"], "limit_exceeded");
    let again = confirm(&stack, &fp, json!("20000.00"), "m", &[]).await?;
    assert_eq!(again.status, 422);
    again.assert_prompt("already_failed");
    assert_eq!(again.json["result"]["error"], "limit_exceeded");
    assert_eq!(counts(&stack).await?, (0, 1), "the upstream saw the confirm once and never executed it");
    Ok(())
}

#[tokio::test]
async fn upstream_503_releases_and_the_same_call_then_executes_once() -> TestResult {
    let Some(opts) = real_stores(true)? else { return Ok(()) };
    let stack = Stack::start(opts).await?;
    let (_, fp) = stack.preview(json!("30.00")).await?;
    let a = confirm(&stack, &fp, json!("30.00"), "m", &[("x-demo-fail", "503")]).await?;
    assert_eq!(a.status, 503);
    a.assert_prompt("not_executed");
    assert_eq!(a.json["retryable"], true);
    assert!(a.header("retry-after").is_some());
    assert_eq!(counts(&stack).await?, (0, 1));
    assert_eq!(stack.stat("wasmcustom.idem.released").await?, 1);
    let a = confirm(&stack, &fp, json!("30.00"), "m", &[]).await?;
    assert_eq!(a.status, 201, "released: the same fingerprint may run: {a:?}");
    let a = confirm(&stack, &fp, json!("30.00"), "m", &[]).await?;
    a.assert_prompt("already_completed");
    assert_eq!(counts(&stack).await?, (1, 2));
    Ok(())
}

#[tokio::test]
async fn a_slow_confirm_is_in_progress_for_retries_and_status() -> TestResult {
    let Some(opts) = real_stores(true)? else { return Ok(()) };
    let stack = Stack::start(opts).await?;
    let (_, fp) = stack.preview(json!("40.00")).await?;
    let slow = stack.spawn_confirm("/v1/transfers", &fp, transfer(json!("40.00"), "m"), 3000);
    tokio::time::sleep(Duration::from_millis(800)).await;
    let a = confirm(&stack, &fp, json!("40.00"), "m", &[]).await?;
    assert_eq!(a.status, 202);
    a.assert_prompt("in_progress");
    assert_eq!(a.json["poll_with"], "get_transfer_status");
    assert!(a.json["poll_after_ms"].as_u64().is_some());
    let s = stack.get(&format!("/v1/transfers/status?fingerprint={fp}"), SUBJECT, &[]).await?;
    s.assert_prompt("in_progress");
    let first = slow.await??;
    assert_eq!(first.status().as_u16(), 201);
    let s = stack.get("/v1/transfers/status", SUBJECT, &[("agent-fingerprint", &fp)]).await?;
    s.assert_prompt("already_completed");
    assert_eq!(s.status, 200, "the status query itself succeeded");
    assert_eq!(s.json["original_status"], 201);
    assert!(s.json["result"]["transfer_id"].is_string());
    assert_eq!(counts(&stack).await?, (1, 1));
    Ok(())
}

#[tokio::test]
async fn status_before_confirm_says_not_executed_and_until_when() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let (p, fp) = stack.preview(json!("1.00")).await?;
    let s = stack.get(&format!("/v1/transfers/status?fingerprint={fp}"), SUBJECT, &[]).await?;
    assert_eq!(s.status, 200);
    s.assert_prompt("not_executed");
    assert_eq!(s.json["fingerprint_expires_at"], p.json["fingerprint_expires_at"]);
    Ok(())
}

#[tokio::test]
async fn status_of_someone_elses_fingerprint_is_forbidden() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let (_, fp) = stack.preview(json!("1.00")).await?;
    let s = stack.get(&format!("/v1/transfers/status?fingerprint={fp}"), "user-mallory", &[]).await?;
    assert_eq!(s.status, 403);
    s.assert_prompt("forbidden");
    Ok(())
}

fn throwaway_redis(dir: &std::path::Path) -> Result<(Proc, u16), BoxError> {
    let port = free_port()?;
    let mut cmd = std::process::Command::new("redis-server");
    cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]);
    Ok((Proc::spawn(&format!("redis-{port}"), &mut cmd, dir)?, port))
}

async fn wait_redis(port: u16) -> Result<(), BoxError> {
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(format!("throwaway redis on {port} did not start").into())
}

#[tokio::test]
async fn flushdb_after_success_replays_from_sql() -> TestResult {
    if !backends::available("postgres", &backends::postgres_url())? {
        return Ok(());
    }
    let scratch = tempfile::tempdir()?;
    let (_redis, port) = throwaway_redis(scratch.path())?;
    wait_redis(port).await?;
    let redis_url = format!("redis://127.0.0.1:{port}");
    let opts = StackOpts {
        demo: DemoOpts { no_dedup: true, faults: false, ..Default::default() },
        sidecar: SidecarOpts {
            redis_url: Some(redis_url.clone()),
            database_url: Some(backends::postgres_url()),
            ..Default::default()
        },
        ..Default::default()
    };
    // Envoy's replay cache off: the replay after the flush must come from idemd.
    let stack = Stack::start(StackOpts { envoy_edits: vec![without_replay_cache()], ..opts }).await?;
    let (_, fp) = stack.preview(json!("50.00")).await?;
    let redis_key = format!("idem:{{{}}}", nonce_of(&fp)?);
    let first = confirm(&stack, &fp, json!("50.00"), "m", &[]).await?;
    assert_eq!(first.status, 201);
    let mut con = redis::Client::open(redis_url.as_str())?.get_multiplexed_async_connection().await?;
    let state: Option<String> = redis::cmd("HGET").arg(&redis_key).arg("state").query_async(&mut con).await?;
    assert_eq!(state.as_deref(), Some("DONE"), "the complete reached Redis");
    let _: () = redis::cmd("FLUSHDB").query_async(&mut con).await?;
    let exists: i64 = redis::cmd("EXISTS").arg(&redis_key).query_async(&mut con).await?;
    assert_eq!(exists, 0);

    let again = confirm(&stack, &fp, json!("50.00"), "m", &[]).await?;
    again.assert_prompt("already_completed");
    assert_eq!(serde_json::to_vec(&again.json["result"])?, first.body);
    assert_eq!(counts(&stack).await?, (1, 1));
    // Not Envoy's cache: idemd answered DONE from the SQL row (Redis, up all along, had lost the key)
    // and copied the row back to Redis.
    assert_eq!(stack.stat("wasmcustom.idem.replay_cache_hits").await?, 0);
    let m = stack.idemd_metrics().await?;
    assert_eq!(metric(&m, "idem_acquire_total", &[("outcome", "ACQUIRED")]), Some(1.0), "{m}");
    assert_eq!(metric(&m, "idem_acquire_total", &[("outcome", "DONE"), ("mode", "fingerprint")]), Some(1.0), "{m}");
    assert_eq!(metric(&m, "idem_redis_refill_total", &[("state", "DONE")]), Some(1.0), "{m}");
    assert_eq!(metric(&m, "idem_redis_fallback_total", &[]), Some(0.0), "Redis was never bypassed: {m}");
    let state: Option<String> = redis::cmd("HGET").arg(&redis_key).arg("state").query_async(&mut con).await?;
    assert_eq!(state.as_deref(), Some("DONE"), "the row was copied back to Redis");
    Ok(())
}

#[tokio::test]
async fn redis_killed_before_the_confirm_still_executes_once_on_sql() -> TestResult {
    if !backends::available("postgres", &backends::postgres_url())? {
        return Ok(());
    }
    let scratch = tempfile::tempdir()?;
    let (mut redis, port) = throwaway_redis(scratch.path())?;
    wait_redis(port).await?;
    let opts = StackOpts {
        demo: DemoOpts { no_dedup: true, faults: false, ..Default::default() },
        sidecar: SidecarOpts {
            redis_url: Some(format!("redis://127.0.0.1:{port}")),
            database_url: Some(backends::postgres_url()),
            ..Default::default()
        },
        ..Default::default()
    };
    let stack = Stack::start(opts).await?;
    let (_, fp) = stack.preview(json!("60.00")).await?;
    redis.kill9();
    let first = confirm(&stack, &fp, json!("60.00"), "m", &[]).await?;
    assert_eq!(first.status, 201, "{first:?}");
    let again = confirm(&stack, &fp, json!("60.00"), "m", &[]).await?;
    again.assert_prompt("already_completed");
    assert_eq!(counts(&stack).await?, (1, 1));
    let health: Value =
        stack.http.get(format!("http://127.0.0.1:{}/healthz", stack.ports.sidecar)).send().await?.json().await?;
    assert_eq!(health["redis"], "down", "healthz: {health}");
    Ok(())
}

#[tokio::test]
async fn sidecar_down_means_outcome_unchecked_then_the_same_call_runs_once() -> TestResult {
    let mut stack = Stack::start(sqlite_only(false)).await?;
    let (_, fp) = stack.preview(json!("70.00")).await?;
    stack.sidecar.kill9();
    let a = confirm(&stack, &fp, json!("70.00"), "m", &[]).await?;
    // This call ran nothing, but with idemd down nobody can say whether an earlier one did:
    // the reply says "could not check", never "nothing was executed" (DESIGN §3).
    assert_eq!(a.status, 503);
    assert_eq!(a.json["retryable"], true);
    assert!(!a.json["meaning"].as_str().unwrap_or_default().contains("Nothing was executed"), "{a:?}");
    if FilterHost::current()?.is_ext_proc() {
        // idemd is the filter: Envoy's ext_proc filter answers for it, with the connection manager's
        // envelope for a processor's failure (it cannot know where the stream was: "could not check").
        a.assert_prompt("status_unavailable");
        assert!(a.json["meaning"].as_str().unwrap_or_default().contains("may or may not have been executed"), "{a:?}");
    } else {
        a.assert_prompt("status_unavailable");
        assert!(a.header("retry-after").is_some());
        assert_eq!(a.json["operation"].as_str().map(str::len), Some(32));
    }
    assert_eq!(counts(&stack).await?, (0, 0));
    stack.restart_sidecar().await?;
    let a = confirm(&stack, &fp, json!("70.00"), "m", &[]).await?;
    assert_eq!(a.status, 201);
    assert_eq!(counts(&stack).await?, (1, 1));
    Ok(())
}

#[tokio::test]
async fn envoy_retries_keep_the_idempotency_key() -> TestResult {
    let stack = Stack::start(sqlite_only(true)).await?;
    let (_, fp) = stack.preview(json!("80.00")).await?;
    let a = stack
        .post(
            "/retry/v1/transfers",
            SUBJECT,
            &transfer(json!("80.00"), "m"),
            &[("agent-fingerprint", &fp), ("x-demo-reset", "first")],
        )
        .await?;
    assert_eq!(a.status, 201, "Envoy retried the reset attempt: {a:?}");
    let key = a.header("idempotency-key").ok_or("no idempotency-key")?.to_owned();
    let ex = stack.executions().await?;
    assert_eq!(ex["attempts_by_key"][&key], 2, "both attempts carried the same key: {ex}");
    assert_eq!(ex["attempts"], 2, "{ex}");
    assert_eq!(ex["total"], 1);
    Ok(())
}

#[tokio::test]
async fn the_agent_gets_the_answer_even_when_the_sidecar_dies_before_recording_it() -> TestResult {
    let mut stack = Stack::start(sqlite_only(true)).await?;
    let (_, fp) = stack.preview(json!("90.00")).await?;
    let req = stack
        .http
        .post(stack.url("/v1/transfers"))
        .header("x-agent-subject", SUBJECT)
        .header("agent-fingerprint", &fp)
        .header("x-demo-hold-after-commit", "unrecorded")
        .json(&transfer(json!("90.00"), "m"));
    let slow = tokio::spawn(req.send());
    // Once the demo has committed (and holds its answer), the sidecar goes away: the complete callout will fail.
    let record = stack.wait_committed("unrecorded", Duration::from_secs(10)).await?;
    stack.sidecar.kill9();
    stack.release_hold("unrecorded")?;
    let first = slow.await??;
    if FilterHost::current()?.is_ext_proc() {
        // idemd is the filter and held the answer to record it: Envoy's ext_proc filter answers for it,
        // and the envelope says the outcome is not known (never "not executed"), so the agent asks again.
        assert_eq!(first.status().as_u16(), 503, "{first:?}");
        let said = first.json::<Value>().await?;
        let unavailable = (Some("status_unavailable"), Some(true));
        assert_eq!((said["status"].as_str(), said["retryable"].as_bool()), unavailable, "{said}");
        assert!(said["meaning"].as_str().is_some_and(|m| m.contains("may or may not")), "{said}");
        assert_ne!(said, record, "the answer idemd held died with it");
    } else {
        assert_eq!(first.status().as_u16(), 201, "the upstream's answer still reaches the agent");
        assert_eq!(first.json::<Value>().await?, record);
        assert!(stack.stat("wasmcustom.idem.sidecar_errors").await? >= 1);
    }
    // Nothing recorded the outcome: the row stays IN_FLIGHT (for the reconciler), never re-executes.
    stack.restart_sidecar().await?;
    let again = confirm(&stack, &fp, json!("90.00"), "m", &[]).await?;
    assert_eq!(again.status, 202, "{again:?}");
    again.assert_prompt("in_progress");
    assert_eq!(counts(&stack).await?, (1, 1));
    Ok(())
}

#[tokio::test]
async fn upstream_unreachable_is_released_as_not_executed() -> TestResult {
    let mut stack = Stack::start(sqlite_only(false)).await?;
    let (_, fp) = stack.preview(json!("95.00")).await?;
    stack.demo.kill9();
    // Envoy cannot connect: the request never left, so the operation is released.
    let a = confirm(&stack, &fp, json!("95.00"), "m", &[]).await?;
    assert_eq!(a.status, 503, "{a:?}");
    a.assert_prompt("not_executed");
    assert_eq!(stack.stat("wasmcustom.idem.released").await?, 1);
    stack.restart_demo().await?;
    let a = confirm(&stack, &fp, json!("95.00"), "m", &[]).await?;
    assert_eq!(a.status, 201, "the same call runs once the upstream is back: {a:?}");
    assert_eq!(counts(&stack).await?, (1, 1));
    Ok(())
}

#[tokio::test]
async fn a_route_decides_what_an_upstream_409_means() -> TestResult {
    let stack = Stack::start(sqlite_only(true)).await?;
    // By default a 409 says nothing definite: the agent is told to poll, the row stays IN_FLIGHT.
    let (_, fp) = stack.preview(json!("11.00")).await?;
    let a = confirm(&stack, &fp, json!("11.00"), "m", &[("x-demo-fail", "409")]).await?;
    assert_eq!(a.status, 202, "{a:?}");
    a.assert_prompt("in_progress");
    // The strict route annotates `outcomes: "409:failed"`: a definite failure, replayed.
    let (_, fp) = stack.preview(json!("12.00")).await?;
    let body = transfer(json!("12.00"), "m");
    let a = stack
        .post("/strict/v1/transfers", SUBJECT, &body, &[("agent-fingerprint", &fp), ("x-demo-fail", "409")])
        .await?;
    assert_eq!(a.status, 409, "{a:?}");
    let again = stack.post("/strict/v1/transfers", SUBJECT, &body, &[("agent-fingerprint", &fp)]).await?;
    assert_eq!(again.status, 409);
    again.assert_prompt("already_failed");
    assert_eq!(counts(&stack).await?, (0, 2), "two confirms reached the demo, none executed");
    Ok(())
}
