//! Upstreams that ignore Idempotency-Key (DESIGN §4, "Classifying the upstream's answer"), end to
//! end: real Envoy + idemd (reconciler on) + Redis + Postgres in front of the demo in `--no-keys`
//! (a downstream without key support: it executes every request it gets and finds a transfer only
//! by the `client_ref` it was sent with), on the `/nokey` routes of envoy/e2e.yaml
//! (`upstream_keys: ignored`, `business_ref: /client_ref`, a 2 s lease).
//!
//! What may release such an operation is only proof that nothing ran: Envoy never sent the request,
//! or the upstream has no record under the operation's business reference after the grace. Each
//! test has a Postgres database of its own (the reconciler decides every stale row of it).

use idem_e2e::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const SCOPE: &str = "payments.nokey";
/// The demo's record by client reference; 127.0.0.1:8080 is this stack's demo (`SidecarOpts::for_ports`).
const BY_REF: &str = "payments.nokey=http://127.0.0.1:8080/v1/transfers/by-ref/{ref}";
/// A status endpoint that only knows keys, which this upstream never stores.
const BY_KEY: &str = "payments.nokey=http://127.0.0.1:8080/v1/transfers/by-key/{key}";
const READING: &str = "payments.nokey=pointer=/status;done=executed;failed=failed;done_status=201";

/// A reconciling sidecar (leases of at least 1.5 s, a pass every 200 ms, a 404 trusted 1 s after
/// the lease ended) asking `endpoint`, before the demo in `--no-keys --faults`.
fn no_key_stack(db: &str, instance: &str, endpoint: &str) -> StackOpts {
    let args = [
        ("--lease-ms", "1500"),
        ("--upstream-worst-case-ms", "500"),
        ("--gateway-timeout-ms", "500"),
        ("--retry-backoff-total-ms", "100"),
        ("--reconcile-interval-ms", "200"),
        ("--reconcile-grace-ms", "1000"),
        ("--status-timeout-ms", "1000"),
        ("--status-endpoint", endpoint),
        ("--status-reading", READING),
        ("--instance-id", instance),
    ];
    StackOpts {
        demo: DemoOpts { faults: true, no_keys: true, ..Default::default() },
        sidecar: SidecarOpts {
            redis_url: Some(backends::redis_url()),
            database_url: Some(db.to_owned()),
            extra_args: args.iter().flat_map(|(k, v)| [k.to_string(), v.to_string()]).collect(),
        },
        ..Default::default()
    }
}

/// Redis and a Postgres database of this test's own; None (loud skip) otherwise.
fn stores() -> Result<Option<backends::OwnPostgres>, BoxError> {
    if !backends::available("redis", &backends::redis_url())? {
        return Ok(None);
    }
    backends::own_postgres()
}

fn nokey_transfer(client_ref: &str) -> Value {
    let mut t = transfer(json!("25.00"), "rent");
    t["client_ref"] = json!(client_ref);
    t
}

/// Preview on the no-key route: the fingerprint binds the client reference too.
async fn preview(stack: &Stack, client_ref: &str) -> Result<String, BoxError> {
    let a = stack.post("/nokey/v1/transfers/preview", SUBJECT, &nokey_transfer(client_ref), &[]).await?;
    Ok(a.json["fingerprint"].as_str().ok_or_else(|| format!("no fingerprint: {a:?}"))?.to_owned())
}

async fn confirm(stack: &Stack, fp: &str, client_ref: &str, headers: &[(&str, &str)]) -> Result<Answer, BoxError> {
    let mut all = vec![("agent-fingerprint", fp)];
    all.extend_from_slice(headers);
    stack.post("/nokey/v1/transfers", SUBJECT, &nokey_transfer(client_ref), &all).await
}

/// Retry the same confirm until the answer's status is `want`; every answer before it is
/// `in_progress` pointing at the route's status tool (never an execution, never a raw error).
async fn retry_until(stack: &Stack, fp: &str, client_ref: &str, want: &str) -> Result<Answer, BoxError> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let a = confirm(stack, fp, client_ref, &[]).await?;
        if a.json["status"] == want {
            return Ok(a);
        }
        assert_eq!((a.status, a.json["status"].as_str()), (202, Some("in_progress")), "waiting for {want}: {a:?}");
        assert_eq!(a.json["poll_with"], "nokey_status", "{a:?}");
        if Instant::now() > deadline {
            return Err(format!("no {want} in time; last: {a:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// `idemd ops show <key> --json`: the stored row and its audit trail as ("actor action", why).
fn show(db: &str, key: &str) -> Result<(Value, Vec<(String, String)>), BoxError> {
    let (code, out, err) = idemd_ops(db, &["show", key, "--json"])?;
    assert_eq!(code, 0, "ops show: {err}");
    let v: Value = serde_json::from_str(&out)?;
    let lines = v["history"].as_array().ok_or("no history")?.iter().map(|h| {
        let at = |f: &str| h[f].as_str().unwrap_or("?").to_owned();
        (format!("{} {}", at("actor"), at("action")), at("why"))
    });
    Ok((v["operation"].clone(), lines.collect()))
}

fn steps(trail: &[(String, String)]) -> Vec<&str> {
    trail.iter().map(|(s, _)| s.as_str()).filter(|s| !s.ends_with("reconcile_retry")).collect()
}

/// The demo's answer to `GET <path>`, straight from the demo.
async fn demo_get(stack: &Stack, path: &str) -> Result<(u16, Value), BoxError> {
    let r = stack.http.get(format!("http://127.0.0.1:{}{path}", stack.ports.demo)).send().await?;
    Ok((r.status().as_u16(), r.json().await.unwrap_or(Value::Null)))
}

/// The upstream's 503 on a no-key route proves nothing about a second request, which it would
/// execute: the agent hears in_progress, the filter releases nothing and counts an unknown outcome;
/// the reconciler asks by the client reference, the upstream has no record under it after the grace
/// → released, and the same fingerprint then executes once. The same 503 on a route whose upstream
/// deduplicates by key is released at once (the contrast).
#[tokio::test]
async fn an_upstream_503_stays_unknown_until_the_reference_lookup_releases_it() -> TestResult {
    let Some(db) = stores()? else { return Ok(()) };
    let stack = Stack::start(no_key_stack(&db.url, "nokey503", BY_REF)).await?;
    let fp = preview(&stack, "inv-503").await?;
    let key = nonce_of(&fp)?;

    let a = confirm(&stack, &fp, "inv-503", &[("x-demo-fail", "503")]).await?;
    assert_eq!(a.status, 202, "{a:?}");
    a.assert_prompt("in_progress");
    assert_eq!(a.json["poll_with"], "nokey_status");
    assert_eq!(stack.stat("wasmcustom.idem.released").await?, 0, "nothing the upstream answered releases");
    assert_eq!(stack.stat("wasmcustom.idem.unknown_outcome").await?, 1);
    let (row, _) = show(&db.url, &key)?;
    assert_eq!((row["state"].as_str(), row["scope"].as_str()), (Some("IN_FLIGHT"), Some(SCOPE)), "{row}");
    assert_eq!((row["upstream_keys"].as_str(), row["business_ref"].as_str()), (Some("ignored"), Some("inv-503")));

    // Contrast: the same 503 where the route trusts the upstream to deduplicate by key.
    let (_, plain_fp) = stack.preview(json!("25.00")).await?;
    let plain = stack
        .post(
            "/fast/v1/transfers",
            SUBJECT,
            &transfer(json!("25.00"), "rent"),
            &[("agent-fingerprint", plain_fp.as_str()), ("x-demo-fail", "503")],
        )
        .await?;
    plain.assert_prompt("not_executed");
    assert_eq!(stack.stat("wasmcustom.idem.released").await?, 1, "the default releases on the upstream's 503");

    let ran = retry_until(&stack, &fp, "inv-503", "executed").await?;
    assert_eq!(ran.status, 201, "{ran:?}");
    assert_eq!(ran.json["client_ref"], "inv-503");
    let again = confirm(&stack, &fp, "inv-503", &[]).await?;
    again.assert_prompt("already_completed");
    assert_eq!(counts(&stack).await?, (1, 3), "one execution; the demo saw the two 503s and that one");
    let (_, trail) = show(&db.url, &key)?;
    assert_eq!(
        steps(&trail),
        ["filter acquire", "reconciler:nokey503 reconcile_release", "filter acquire", "filter complete"]
    );
    let why = &trail.iter().find(|(s, _)| s.ends_with("reconcile_release")).ok_or("no release line")?.1;
    assert!(why.contains("by business reference") && why.contains("no record under that reference"), "{why}");
    Ok(())
}

/// The demo commits and dies before answering: the reconciler finds the transfer by its client
/// reference → DONE, and every retry replays the demo's own record. One execution.
#[tokio::test]
async fn a_crash_after_commit_is_found_by_reference_and_replayed() -> TestResult {
    let Some(db) = stores()? else { return Ok(()) };
    let mut stack = Stack::start(no_key_stack(&db.url, "nokeycrash", BY_REF)).await?;
    let fp = preview(&stack, "inv-crash").await?;
    let key = nonce_of(&fp)?;

    let first = confirm(&stack, &fp, "inv-crash", &[("x-demo-crash-after-commit", "1")]).await?;
    assert_eq!(first.status, 202, "{first:?}");
    first.assert_prompt("in_progress");
    assert_eq!(stack.stat("wasmcustom.idem.released").await?, 0);
    stack.restart_demo().await?;
    let (found, record) = demo_get(&stack, "/v1/transfers/by-ref/inv-crash").await?;
    assert_eq!(found, 200, "the demo committed before it died: {record}");
    assert_eq!(demo_get(&stack, &format!("/v1/transfers/by-key/{key}")).await?.0, 404, "it never stored the key");

    let done = retry_until(&stack, &fp, "inv-crash", "already_completed").await?;
    assert_eq!(done.status, 201, "a reconciled DONE replays with the declared done_status");
    assert_eq!(done.json["result"], record, "the demo's own record");
    assert_eq!(done.json["result_ref"], record["transfer_id"]);
    let again = confirm(&stack, &fp, "inv-crash", &[]).await?;
    assert_eq!(again.json["result"], record);
    assert_eq!(counts(&stack).await?, (1, 1), "executed once; no retry reached the demo");
    let (_, trail) = show(&db.url, &key)?;
    assert_eq!(steps(&trail), ["filter acquire", "reconciler:nokeycrash reconcile_done"]);
    assert!(trail[trail.len() - 1].1.contains("by business reference"), "{trail:?}");
    Ok(())
}

/// Envoy cannot connect (the demo is down): the request provably never left, so even here the
/// operation is released (`not_executed`), nothing ran, and the same call runs once the upstream
/// is back.
#[tokio::test]
async fn a_request_envoy_never_sent_is_released() -> TestResult {
    let Some(db) = stores()? else { return Ok(()) };
    let mut stack = Stack::start(no_key_stack(&db.url, "nokeydown", BY_REF)).await?;
    let fp = preview(&stack, "inv-down").await?;
    let key = nonce_of(&fp)?;
    stack.demo.kill9();

    let a = confirm(&stack, &fp, "inv-down", &[]).await?;
    assert_eq!(a.status, 503, "{a:?}");
    a.assert_prompt("not_executed");
    assert_eq!(stack.stat("wasmcustom.idem.released").await?, 1);
    assert_eq!(stack.stat("wasmcustom.idem.unknown_outcome").await?, 0);
    let (row, trail) = show(&db.url, &key)?;
    assert_eq!(row, Value::Null, "released: no row");
    assert_eq!(steps(&trail), ["filter acquire", "filter release"]);

    stack.restart_demo().await?;
    assert_eq!(counts(&stack).await?, (0, 0), "nothing ran, nothing reached the demo");
    let ran = confirm(&stack, &fp, "inv-down", &[]).await?;
    assert_eq!(ran.status, 201, "{ran:?}");
    assert_eq!(counts(&stack).await?, (1, 1));
    Ok(())
}

/// A no-key scope whose status endpoint only knows keys: a by-key lookup would answer 404 (this
/// upstream never stored a key), which must not read as "never executed". The row goes to
/// NEEDS_REVIEW without a lookup, with the reason, and is never released.
#[tokio::test]
async fn a_key_only_status_endpoint_sends_it_to_review_never_released() -> TestResult {
    let Some(db) = stores()? else { return Ok(()) };
    let stack = Stack::start(no_key_stack(&db.url, "nokeyreview", BY_KEY)).await?;
    let fp = preview(&stack, "inv-review").await?;
    let key = nonce_of(&fp)?;

    let a = confirm(&stack, &fp, "inv-review", &[("x-demo-fail", "503")]).await?;
    a.assert_prompt("in_progress");
    assert_eq!(demo_get(&stack, &format!("/v1/transfers/by-key/{key}")).await?.0, 404, "what a by-key lookup hears");
    let review = retry_until(&stack, &fp, "inv-review", "needs_review").await?;
    assert_eq!(review.status, 202, "{review:?}");
    review.assert_prompt("needs_review");
    let status = stack.get(&format!("/nokey/v1/transfers/status?fingerprint={fp}"), SUBJECT, &[]).await?;
    status.assert_prompt("needs_review");

    assert_eq!(counts(&stack).await?, (0, 1), "nothing executed; no retry reached the demo");
    assert_eq!(stack.stat("wasmcustom.idem.released").await?, 0);
    let (row, trail) = show(&db.url, &key)?;
    assert_eq!(row["state"], "NEEDS_REVIEW");
    assert_eq!(steps(&trail), ["filter acquire", "reconciler:nokeyreview reconcile_needs_review"]);
    let why = &trail[1].1;
    assert!(why.starts_with("upstream ignores keys and no business-reference lookup: "), "{why}");
    assert!(why.contains("looks up by {key} only"), "{why}");
    let m = stack.idemd_metrics().await?;
    // Pre-created at 0 (an alert reads it with increase()): never counted up.
    assert_eq!(metric(&m, "idem_reconcile_total", &[("decision", "released")]).unwrap_or(0.0), 0.0, "{m}");
    assert_eq!(metric(&m, "idem_reconcile_total", &[("decision", "needs_review")]), Some(1.0), "{m}");
    Ok(())
}

/// A transfer of `amount` with the business reference `client_ref`.
fn nokey_transfer_of(amount: &str, client_ref: &str) -> Value {
    let mut t = transfer(json!(amount), "rent");
    t["client_ref"] = json!(client_ref);
    t
}

/// Preview and confirm `body` on the no-key route: (fingerprint, the confirm's answer).
async fn preview_and_confirm(
    stack: &Stack,
    body: &Value,
    headers: &[(&str, &str)],
) -> Result<(String, Answer), BoxError> {
    let p = stack.post("/nokey/v1/transfers/preview", SUBJECT, body, &[]).await?;
    let fp = p.json["fingerprint"].as_str().ok_or_else(|| format!("no fingerprint: {p:?}"))?.to_owned();
    let mut all = vec![("agent-fingerprint", fp.as_str())];
    all.extend_from_slice(headers);
    let a = stack.post("/nokey/v1/transfers", SUBJECT, body, &all).await?;
    Ok((fp, a))
}

/// DESIGN §4, "A reference proves only its own operation": two operations with one business
/// reference. Before, the second (refused by the upstream before it ran: a 503) was acquired and
/// forwarded, and the reconciler's by-reference lookup found the first's record under the same
/// `client_ref` and settled the second DONE with it: its agent heard `already_completed` with a
/// transfer that was not its own. Now the reference names one operation per scope: the second
/// confirm is a 409 `reference_in_use` naming the field, nothing recorded, nothing forwarded, the same
/// on every retry and after the reconciler's passes; the first replays its own record.
#[tokio::test]
async fn a_second_operation_with_the_same_reference_is_refused_before_it_runs() -> TestResult {
    let Some(db) = stores()? else { return Ok(()) };
    let stack = Stack::start(no_key_stack(&db.url, "nokeyshared", BY_REF)).await?;
    let (first_fp, first) = preview_and_confirm(&stack, &nokey_transfer_of("25.00", "inv-shared"), &[]).await?;
    assert_eq!(first.status, 201, "{first:?}");
    let second_body = nokey_transfer_of("30.00", "inv-shared");
    let (second_fp, second) = preview_and_confirm(&stack, &second_body, &[("x-demo-fail", "503")]).await?;
    assert_eq!(second.status, 409, "{second:?}");
    second.assert_prompt("reference_in_use");
    assert_eq!(
        (second.json["detail"].as_str(), second.json["retryable"].as_bool()),
        (Some("/client_ref"), Some(false))
    );
    assert_eq!(counts(&stack).await?, (1, 1), "the second never reached the upstream");
    let second_key = nonce_of(&second_fp)?;
    let (code, _, err) = idemd_ops(&db.url, &["show", &second_key])?;
    assert_eq!(code, 3, "nothing recorded for the second: {err}");

    // Past the lease and the grace, with the reconciler passing every 200 ms: still refused, never settled.
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    let again = stack.post("/nokey/v1/transfers", SUBJECT, &second_body, &[("agent-fingerprint", &second_fp)]).await?;
    assert_eq!(again.status, 409, "{again:?}");
    again.assert_prompt("reference_in_use");
    let replay = confirm(&stack, &first_fp, "inv-shared", &[]).await?;
    replay.assert_prompt("already_completed");
    assert_eq!(replay.json["result"]["amount"], "25.00", "the first replays its own transfer");
    assert_eq!(counts(&stack).await?, (1, 1));
    let m = stack.idemd_metrics().await?;
    assert_eq!(metric(&m, "idem_acquire_total", &[("outcome", "REFERENCE_IN_USE")]), Some(2.0), "{m}");
    Ok(())
}

/// A record under the reference that is not this operation's: a transfer with the same `client_ref`
/// made around the gateway (another client of the service), 99.00 where this confirm moves 25.00.
/// This confirm is refused by the upstream before it runs (a 503) and stays unknown; the reconciler's
/// by-reference lookup finds the other transfer. Before, it settled this operation DONE with it;
/// now the record does not carry this operation's bound fields, so it proves nothing: NEEDS_REVIEW,
/// the audit line saying which field differs, never `already_completed` with someone else's transfer.
#[tokio::test]
async fn a_record_under_the_reference_that_is_not_this_operation_settles_nothing() -> TestResult {
    let Some(db) = stores()? else { return Ok(()) };
    let stack = Stack::start(no_key_stack(&db.url, "nokeyforeign", BY_REF)).await?;
    let around = stack
        .http
        .post(format!("http://127.0.0.1:{}/v1/transfers", stack.ports.demo))
        .json(&nokey_transfer_of("99.00", "inv-foreign"))
        .send()
        .await?;
    assert_eq!(around.status().as_u16(), 201, "the service executes what reaches it directly");
    let (fp, a) =
        preview_and_confirm(&stack, &nokey_transfer_of("25.00", "inv-foreign"), &[("x-demo-fail", "503")]).await?;
    assert_eq!(a.status, 202, "{a:?}");
    a.assert_prompt("in_progress");
    let key = nonce_of(&fp)?;

    let deadline = Instant::now() + Duration::from_secs(15);
    let review = loop {
        let r = stack
            .post(
                "/nokey/v1/transfers",
                SUBJECT,
                &nokey_transfer_of("25.00", "inv-foreign"),
                &[("agent-fingerprint", &fp)],
            )
            .await?;
        if r.json["status"] == "needs_review" {
            break r;
        }
        assert_eq!(r.json["status"], "in_progress", "never another transfer's result: {r:?}");
        assert!(Instant::now() < deadline, "no needs_review in time: {r:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    review.assert_prompt("needs_review");
    assert_eq!(counts(&stack).await?, (1, 2), "only the transfer made around the gateway ran");
    let (row, trail) = show(&db.url, &key)?;
    assert_eq!(row["state"], "NEEDS_REVIEW", "{row}");
    assert_eq!(steps(&trail), ["filter acquire", "reconciler:nokeyforeign reconcile_needs_review"]);
    let why = &trail[trail.len() - 1].1;
    assert!(why.contains("a record not proven this operation's (/amount differs)"), "{why}");
    assert!(!why.contains("99"), "no parameter value in the audit trail: {why}");
    Ok(())
}
