//! Client-key mode (draft-ietf-httpapi-idempotency-key-header-07): programs name
//! their operations with their own `Idempotency-Key`, on the same state machine,
//! stores and upstream as the agents' fingerprints. Real Envoy, Redis, Postgres.

use idem_e2e::*;
use serde_json::{json, Value};

const PATH: &str = "/programs/v1/transfers";

/// Client keys name operations for as long as the retention keeps them, and the
/// stores outlive a test run: every run uses keys of its own.
fn fresh(prefix: &str) -> String {
    let mut b = [0u8; 8];
    let _ = getrandom::fill(&mut b);
    format!("{prefix}-{}", b.iter().map(|x| format!("{x:02x}")).collect::<String>())
}

async fn charge(
    stack: &Stack,
    subject: &str,
    key: Option<&str>,
    body: &Value,
    extra: &[(&str, &str)],
) -> Result<Answer, BoxError> {
    let mut headers: Vec<(&str, &str)> = key.map(|k| vec![("idempotency-key", k)]).unwrap_or_default();
    headers.extend_from_slice(extra);
    stack.post(PATH, subject, body, &headers).await
}

fn problem(a: &Answer, status: u16, kind: &str) {
    assert_eq!(a.status, status, "{a:?}");
    assert_eq!(a.header("content-type"), Some("application/problem+json"), "{a:?}");
    assert_eq!(a.json["status"], status);
    assert_eq!(a.json["type"], format!("urn:agent-idempotency:problem:{kind}"), "{a:?}");
    assert!(a.json["title"].is_string());
}

#[tokio::test]
async fn one_key_runs_once_and_replays_byte_for_byte() -> TestResult {
    let Some(opts) = real_stores(true)? else { return Ok(()) };
    let stack = Stack::start(opts).await?;
    let body = transfer(json!("70.00"), "invoice 7");
    let key = fresh("8e03978e-40d5-43e8-bc93");
    let quoted = format!("\"{key}\"");
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let (http, url, body, quoted) = (stack.http.clone(), stack.url(PATH), body.clone(), quoted.clone());
        tasks.push(tokio::spawn(async move {
            let r = http
                .post(url)
                .header("x-agent-subject", SUBJECT)
                .header("idempotency-key", quoted)
                .json(&body)
                .send()
                .await?;
            Ok::<u16, reqwest::Error>(r.status().as_u16())
        }));
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await??);
    }
    assert!(statuses.iter().all(|s| *s == 201 || *s == 409), "{statuses:?}");
    assert_eq!(counts(&stack).await?.0, 1, "one execution for one key: {statuses:?}");

    let first = charge(&stack, SUBJECT, Some(&quoted), &body, &[]).await?;
    let again = charge(&stack, SUBJECT, Some(&key), &body, &[]).await?;
    assert_eq!((first.status, again.status), (201, 201), "quoted and bare name the same operation");
    assert_eq!(again.body, first.body, "byte for byte");
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.header("content-type"), Some("application/json"));
    // The upstream saw the derived key, not the client's.
    let ledger = stack.executions().await?;
    assert!(ledger["attempts_by_key"].get(&key).is_none(), "{ledger}");
    assert_eq!(counts(&stack).await?.0, 1);
    assert!(stack.stat("wasmcustom.idem.client_key_requests").await? >= 22);
    Ok(())
}

#[tokio::test]
async fn the_drafts_refusals_are_problems() -> TestResult {
    let Some(opts) = real_stores(true)? else { return Ok(()) };
    let stack = Stack::start(opts).await?;
    let body = transfer(json!("71.00"), "invoice 8");
    problem(&charge(&stack, SUBJECT, None, &body, &[]).await?, 400, "idempotency-key-missing");
    problem(&charge(&stack, SUBJECT, Some(&"k".repeat(256)), &body, &[]).await?, 400, "idempotency-key-invalid");
    problem(&charge(&stack, SUBJECT, Some("\"a\", \"b\""), &body, &[]).await?, 400, "idempotency-key-invalid");
    assert_eq!(counts(&stack).await?, (0, 0), "refusals execute nothing");

    let k8 = fresh("k-8");
    assert_eq!(charge(&stack, SUBJECT, Some(&k8), &body, &[]).await?.status, 201);
    let changed = charge(&stack, SUBJECT, Some(&k8), &transfer(json!("71.00"), "invoice 8, edited"), &[]).await?;
    problem(&changed, 422, "idempotency-key-reused");

    // In flight: 409 with Retry-After, while the first is still running.
    let k9 = fresh("k-9");
    let slow = {
        let req = stack
            .http
            .post(stack.url(PATH))
            .header("x-agent-subject", SUBJECT)
            .header("idempotency-key", k9.clone())
            .header("x-demo-delay-ms", "2500")
            .json(&body);
        tokio::spawn(req.send())
    };
    tokio::time::sleep(std::time::Duration::from_millis(700)).await;
    let busy = charge(&stack, SUBJECT, Some(&k9), &body, &[]).await?;
    problem(&busy, 409, "request-in-progress");
    assert_eq!(busy.header("retry-after"), Some("1"));
    assert_eq!(slow.await??.status().as_u16(), 201);
    assert_eq!(counts(&stack).await?.0, 2);
    Ok(())
}

#[tokio::test]
async fn two_callers_with_the_same_key_are_two_operations() -> TestResult {
    let Some(opts) = real_stores(false)? else { return Ok(()) };
    let stack = Stack::start(opts).await?;
    let body = transfer(json!("72.00"), "same key, other caller");
    let shared = fresh("shared-key");
    let alice = charge(&stack, SUBJECT, Some(&shared), &body, &[]).await?;
    let bob = charge(&stack, "user-bob", Some(&shared), &body, &[]).await?;
    assert_eq!((alice.status, bob.status), (201, 201));
    assert_ne!(alice.json["transfer_id"], bob.json["transfer_id"]);
    assert_eq!(counts(&stack).await?.0, 2);
    Ok(())
}

async fn both(stack: &Stack, amount: Value, memo: &str, header: (&str, String)) -> Result<Answer, BoxError> {
    stack.post("/both/v1/transfers", SUBJECT, &transfer(amount, memo), &[(header.0, header.1.as_str())]).await
}

/// One confirm route, two kinds of callers: an agent with a fingerprint, a
/// program with its own key; each runs once and replays in its own way.
#[tokio::test]
async fn one_route_serves_fingerprints_and_client_keys() -> TestResult {
    let Some(opts) = real_stores(false)? else { return Ok(()) };
    let stack = Stack::start(opts).await?;
    let (_, fp) = stack.preview(json!("73.00")).await?;
    let agent = |memo: &'static str| both(&stack, json!("73.00"), memo, ("agent-fingerprint", fp.clone()));
    assert_eq!(agent("first").await?.status, 201);
    let replay = agent("drifted memo").await?;
    replay.assert_prompt("already_completed");
    let order = fresh("order-73");
    let program = |memo: &'static str| both(&stack, json!("73.00"), memo, ("idempotency-key", order.clone()));
    let first = program("a").await?;
    assert_eq!(first.status, 201);
    let again = program("b: not bound, so not a change").await?;
    assert_eq!((again.status, again.body.clone()), (201, first.body.clone()));
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    let other = stack
        .post("/both/v1/transfers", SUBJECT, &transfer(json!("74.00"), "a"), &[("idempotency-key", order.as_str())])
        .await?;
    problem(&other, 422, "idempotency-key-reused");
    assert_eq!(counts(&stack).await?.0, 2);
    Ok(())
}
