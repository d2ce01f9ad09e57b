//! The trust rules, in a real Envoy with real stores: expiry never reopens an
//! operation that exists, a route's name never unguards a confirm, idemd
//! answers only its filter, every reply an operator may be asked about names
//! the operation, and programs can have the original answer back.

use idem_e2e::*;
use serde_json::{json, Value};
use std::time::Duration;

async fn preview_at(stack: &Stack, path: &str, amount: Value) -> Result<(String, u64), BoxError> {
    let a = stack.post(path, SUBJECT, &transfer(amount, "preview"), &[]).await?;
    let fp = a.json["fingerprint"].as_str().ok_or_else(|| format!("no fingerprint: {a:?}"))?.to_owned();
    let exp = a.json["fingerprint_expires_at"].as_u64().ok_or("no expiry")?;
    Ok((fp, exp))
}

async fn confirm_at(
    stack: &Stack,
    path: &str,
    fp: &str,
    amount: Value,
    headers: &[(&str, &str)],
) -> Result<Answer, BoxError> {
    let mut all = vec![("agent-fingerprint", fp)];
    all.extend_from_slice(headers);
    stack.post(path, SUBJECT, &transfer(amount, "drifted memo after a long pause"), &all).await
}

/// Sleep until the Unix second `exp` has passed (expired exactly at `exp`).
async fn until_expired(exp: u64) {
    loop {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        if now > exp {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// DESIGN §3: expiry only refuses to start. Done, failed and in-flight
/// operations answer after expiry exactly as before; only a fingerprint that
/// never started anything is `fingerprint_expired`.
#[tokio::test]
async fn after_expiry_what_exists_is_answered_and_only_nothing_is_expired() -> TestResult {
    let Some(opts) = real_stores(true)? else { return Ok(()) };
    let stack = Stack::start(opts).await?;
    let (done_fp, exp) = preview_at(&stack, "/ttl3/v1/transfers/preview", json!("10.00")).await?;
    let (failed_fp, _) = preview_at(&stack, "/ttl3/v1/transfers/preview", json!("20000.00")).await?;
    let (slow_fp, _) = preview_at(&stack, "/ttl3/v1/transfers/preview", json!("11.00")).await?;
    let (unused_fp, unused_exp) = preview_at(&stack, "/ttl3/v1/transfers/preview", json!("12.00")).await?;

    let first = confirm_at(&stack, "/v1/transfers", &done_fp, json!(10), &[]).await?;
    assert_eq!(first.status, 201, "{first:?}");
    let refused = confirm_at(&stack, "/v1/transfers", &failed_fp, json!(20000), &[]).await?;
    assert_eq!(refused.status, 422, "{refused:?}");
    let slow = stack.spawn_confirm("/v1/transfers", &slow_fp, transfer(json!("11.00"), "slow"), 7000);

    until_expired(exp.max(unused_exp)).await;
    let again = confirm_at(&stack, "/v1/transfers", &done_fp, json!("10.0"), &[]).await?;
    assert_eq!(again.status, 201, "an executed payment is reported, not re-invited: {again:?}");
    again.assert_prompt("already_completed");
    assert_eq!(again.json["result"], first.json);
    let failed = confirm_at(&stack, "/v1/transfers", &failed_fp, json!(20000), &[]).await?;
    assert_eq!(failed.status, 422);
    failed.assert_prompt("already_failed");
    let busy = confirm_at(&stack, "/v1/transfers", &slow_fp, json!(11), &[]).await?;
    assert_eq!(busy.status, 202, "{busy:?}");
    busy.assert_prompt("in_progress");
    assert_eq!(busy.json["operation"].as_str(), Some(nonce_of(&slow_fp)?.as_str()));
    assert_eq!(busy.json["poll_with"], "get_transfer_status");
    let never = confirm_at(&stack, "/v1/transfers", &unused_fp, json!(12), &[]).await?;
    assert_eq!(never.status, 410);
    never.assert_prompt("fingerprint_expired");
    let status = stack.get("/v1/transfers/status", SUBJECT, &[("agent-fingerprint", &done_fp)]).await?;
    status.assert_prompt("already_completed");

    assert_eq!(slow.await??.status().as_u16(), 201);
    let later = confirm_at(&stack, "/v1/transfers", &slow_fp, json!(11), &[]).await?;
    later.assert_prompt("already_completed");
    // Tampering after expiry is still tampering, and never a lookup.
    let tampered = confirm_at(&stack, "/v1/transfers", &done_fp, json!("10.01"), &[]).await?;
    assert_eq!(tampered.status, 422);
    tampered.assert_prompt("params_changed");
    assert_eq!(counts(&stack).await?, (2, 3), "two executions (done, slow); the upstream saw three confirms");
    // Done and failed operations were answered from Envoy's replay cache; the in-flight one and the
    // unused fingerprint were asked about at idemd.
    assert_eq!(stack.stat("wasmcustom.idem.replay_cache_hits").await?, 3);
    assert_eq!(stack.stat("wasmcustom.idem.expired_lookups").await?, 2);
    Ok(())
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Sleep until 50 ms into the Unix second `s` (at most 10 s ahead).
async fn until_second(s: u64) -> TestResult {
    let at = s * 1000 + 50;
    let now = unix_ms();
    if at > now + 10_000 {
        return Err(format!("second {s} is {} ms away", at - now).into());
    }
    tokio::time::sleep(Duration::from_millis(at.saturating_sub(now))).await;
    Ok(())
}

/// The expiry boundary on both sides, timed by the fingerprint's own `exp` claim: a confirm sent and
/// answered within the second before `exp` executes; one sent a second after `exp` is refused as
/// `fingerprint_expired` and reaches neither the upstream nor idemd's tables.
#[tokio::test]
async fn one_second_before_exp_executes_one_second_after_never_starts() -> TestResult {
    let Some(opts) = real_stores(false)? else { return Ok(()) };
    let stack = Stack::start(opts).await?;
    let (early, early_exp) = preview_at(&stack, "/ttl3/v1/transfers/preview", json!("13.00")).await?;
    let (late, late_exp) = preview_at(&stack, "/ttl3/v1/transfers/preview", json!("14.00")).await?;
    for (fp, exp) in [(&early, early_exp), (&late, late_exp)] {
        assert_eq!(fingerprint_claims(fp)?["exp"].as_u64(), Some(exp), "the reply states the claim's expiry");
    }

    // Sent in the second before exp: the filter checks no earlier (and, since it ran, before exp).
    until_second(early_exp - 1).await?;
    assert_eq!(unix_ms() / 1000, early_exp - 1);
    let ran = confirm_at(&stack, "/v1/transfers", &early, json!(13), &[]).await?;
    assert_eq!(ran.status, 201, "still valid: {ran:?}");
    assert_eq!(ran.json["idempotency_key"], nonce_of(&early)?.as_str());

    // Sent a second after exp: the filter checks no earlier.
    until_second(late_exp + 1).await?;
    assert_eq!(unix_ms() / 1000, late_exp + 1);
    let refused = confirm_at(&stack, "/v1/transfers", &late, json!(14), &[]).await?;
    assert_eq!(refused.status, 410, "{refused:?}");
    refused.assert_prompt("fingerprint_expired");
    assert_eq!(stack.stat("wasmcustom.idem.rejected.fingerprint_expired").await?, 1);
    assert_eq!(stack.stat("wasmcustom.idem.expired_lookups").await?, 1, "asked idemd, which knew of nothing");

    // Nothing of the late one reached the upstream, nor idemd's tables; the early one ran once.
    let ledger = stack.executions().await?;
    assert!(ledger["attempts_by_key"].get(nonce_of(&late)?).is_none(), "{ledger}");
    assert_eq!(counts(&stack).await?, (1, 1), "{ledger}");
    assert_eq!(stack.sql_rows(&nonce_of(&late)?).await?, (0, 0));
    assert_eq!(stack.sql_rows(&nonce_of(&early)?).await?, (1, 2));
    Ok(())
}

/// With idemd down, an expired fingerprint's reply must not say that nothing ran.
#[tokio::test]
async fn expired_while_idemd_is_down_is_unchecked_never_not_executed() -> TestResult {
    // Without the replay cache, so that the executed operation is known only to idemd.
    let mut opts = sqlite_only(false);
    opts.envoy_edits = vec![(
        "\"sidecar_timeout_ms\": 5000,".into(),
        "\"sidecar_timeout_ms\": 5000, \"replay_cache\": {\"slots\": 0},".into(),
    )];
    let mut stack = Stack::start(opts).await?;
    let (fp, exp) = preview_at(&stack, "/ttl3/v1/transfers/preview", json!("5.00")).await?;
    assert_eq!(confirm_at(&stack, "/v1/transfers", &fp, json!(5), &[]).await?.status, 201);
    stack.sidecar.kill9();
    until_expired(exp).await;
    let a = confirm_at(&stack, "/v1/transfers", &fp, json!(5), &[]).await?;
    assert_eq!(a.status, 503, "{a:?}");
    assert_eq!(a.json["retryable"], true);
    let meaning = a.json["meaning"].as_str().unwrap_or_default();
    assert!(!meaning.contains("Nothing was executed") && meaning.contains("may or may not"), "{meaning}");
    if FilterHost::current()?.is_ext_proc() {
        // idemd is the filter: Envoy's ext_proc filter answers for it with the envelope of a processor's failure.
        a.assert_prompt("status_unavailable");
    } else {
        a.assert_prompt("status_unavailable");
        assert_eq!(a.json["operation"].as_str(), Some(nonce_of(&fp)?.as_str()));
        assert!(a.json["instruction"].as_str().unwrap_or_default().contains("get_transfer_status"), "{a:?}");
    }
    stack.restart_sidecar().await?;
    let a = confirm_at(&stack, "/v1/transfers", &fp, json!(5), &[]).await?;
    a.assert_prompt("already_completed");
    assert_eq!(counts(&stack).await?, (1, 1));
    Ok(())
}

/// DESIGN §6: route names are not unique. An unannotated namesake of the confirm
/// route (in another virtual host, and in the same route table) is served first;
/// the confirm route stays guarded, an unnamed guarded route too, and a
/// client-chosen Idempotency-Key never reaches the upstream. The namesakes lead to
/// a path of the demo nothing guards (its ledger): one to the confirm's path would be
/// a way around the guard, which `idemd check` refuses (tests/tests/check_live.rs).
#[tokio::test]
async fn a_route_name_never_unguards_a_confirm() -> TestResult {
    let Some(opts) = real_stores(false)? else { return Ok(()) };
    let stack = Stack::start(opts).await?;
    // Unannotated namesakes: they pass untouched, as unannotated routes do (the demo's own answer, its ledger).
    let other = stack
        .http
        .get(stack.url("/v1/transfers"))
        .header("host", "other.example")
        .header("x-agent-subject", SUBJECT)
        .header("idempotency-key", "unguarded-1")
        .send()
        .await?;
    assert_eq!(other.status().as_u16(), 200);
    let ledger: serde_json::Value = other.json().await?;
    assert_eq!(ledger["total"], 0, "the demo's ledger, passed on untouched: {ledger}");
    let plain = stack.get("/plain/v1/transfers", SUBJECT, &[("idempotency-key", "unguarded-2")]).await?;
    assert_eq!(plain.status, 200, "{plain:?}");
    assert_eq!(plain.json["total"], 0, "{plain:?}");

    for path in ["/v1/transfers", "/unnamed/v1/transfers"] {
        let missing = stack.post(path, SUBJECT, &transfer(json!(3), "no fingerprint"), &[]).await?;
        assert_eq!(missing.status, 428, "{path} is guarded: {missing:?}");
        let (_, fp) = stack.preview(json!("3.00")).await?;
        let first = confirm_at(&stack, path, &fp, json!(3), &[("idempotency-key", "client-chosen-1")]).await?;
        assert_eq!(first.status, 201, "{path}: {first:?}");
        let again = confirm_at(&stack, path, &fp, json!(3), &[("idempotency-key", "client-chosen-2")]).await?;
        again.assert_prompt("already_completed");
        let ledger = stack.executions().await?;
        let nonce = nonce_of(&fp)?;
        assert_eq!(ledger["attempts_by_key"][&nonce], 1, "{path}: {ledger}");
        for client in ["client-chosen-1", "client-chosen-2"] {
            assert!(
                ledger["attempts_by_key"].get(client).is_none(),
                "{path}: a client key reached the upstream: {ledger}"
            );
        }
    }
    assert_eq!(counts(&stack).await?.0, 2, "one per guarded route");
    Ok(())
}

/// DESIGN §6: idemd answers only its filter. An Envoy with another token gets
/// 401s; the agent hears "could not check", and nothing runs.
#[tokio::test]
async fn an_idemd_with_another_token_refuses_the_filter_and_nothing_runs() -> TestResult {
    let mut opts = sqlite_only(false);
    opts.sidecar.extra_args = vec!["--auth-tokens".into(), "another-token-0123456789".into()];
    let stack = Stack::start(opts).await?;
    let (_, fp) = stack.preview(json!("7.00")).await?;
    let a = confirm_at(&stack, "/v1/transfers", &fp, json!(7), &[]).await?;
    assert_eq!(a.status, 503);
    a.assert_prompt("status_unavailable");
    assert_eq!(counts(&stack).await?, (0, 0));
    let metrics = stack.http.get(stack.sidecar_url("/metrics")).send().await?.text().await?;
    assert!(metrics.contains("idem_auth_rejected_total 1"), "{metrics}");
    Ok(())
}

/// DESIGN §8: the trace id a reply carries finds the operation: the filter
/// sends it on every callout, the audit trail keeps it, `idemd ops show` takes it.
#[tokio::test]
async fn a_reply_trace_id_finds_the_operation_in_the_audit_trail() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let (_, fp) = stack.preview(json!("8.00")).await?;
    let a = confirm_at(&stack, "/v1/transfers", &fp, json!(8), &[("x-request-id", "trace-e2e-0001")]).await?;
    assert_eq!(a.status, 201);
    let db = format!("sqlite://{}/idem.db", stack.dir.path().display());
    let (code, out, err) = idemd_ops(&db, &["show", "trace-e2e-0001"])?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains(&nonce_of(&fp)?), "{out}");
    assert!(out.contains("[trace trace-e2e-0001]"), "{out}");
    assert!(out.lines().filter(|l| l.contains("[trace trace-e2e-0001]")).count() >= 2, "acquire and complete: {out}");
    Ok(())
}

/// `replay: original` (DESIGN §7, for programs): the retry gets the upstream's
/// own status, headers and body, byte for byte, marked as a replay.
#[tokio::test]
async fn programs_get_the_original_answer_back() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let (_, fp) = stack.preview(json!("9.00")).await?;
    let first = confirm_at(&stack, "/program/v1/transfers", &fp, json!(9), &[]).await?;
    assert_eq!(first.status, 201);
    assert_eq!(first.header("idempotent-replayed"), Some("false"));
    let again = confirm_at(&stack, "/program/v1/transfers", &fp, json!(9), &[]).await?;
    assert_eq!(again.status, 201);
    assert_eq!(again.body, first.body, "byte for byte");
    assert_eq!(again.header("content-type"), first.header("content-type"));
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert!(again.json.get("status").is_none_or(|s| s != "already_completed"), "no envelope: {again:?}");
    // The same operation through the agents' route is the envelope.
    let envelope = confirm_at(&stack, "/v1/transfers", &fp, json!(9), &[]).await?;
    envelope.assert_prompt("already_completed");
    assert_eq!(envelope.json["result"], first.json);
    assert_eq!(counts(&stack).await?, (1, 1));
    Ok(())
}
