//! Terminal results served from Envoy's shared data (DESIGN §9): a replay needs
//! no callout, equals the stored one, keeps every check idemd makes, and nothing
//! non-terminal is ever served from it.

use idem_e2e::*;
use serde_json::{json, Value};
use std::time::Duration;

async fn confirm_at(stack: &Stack, path: &str, fp: &str, amount: Value) -> Result<Answer, BoxError> {
    stack.post(path, SUBJECT, &transfer(amount, "drifted"), &[("agent-fingerprint", fp)]).await
}

#[tokio::test]
async fn a_cached_replay_equals_the_stored_one_and_needs_no_idemd() -> TestResult {
    if in_envoy_only("the replay cache is Envoy's shared data of an in-Envoy filter")? {
        return Ok(());
    }
    let mut stack = Stack::start(sqlite_only(false)).await?;
    // Programs' route: the replay is the original answer, so "equal" is byte for byte.
    let (_, fp) = stack.preview(json!("50.00")).await?;
    let first = confirm_at(&stack, "/program/v1/transfers", &fp, json!(50)).await?;
    assert_eq!(first.status, 201);
    let from_cache = confirm_at(&stack, "/program/v1/transfers", &fp, json!("50.0")).await?;
    assert_eq!((from_cache.status, &from_cache.body), (201, &first.body));
    assert_eq!(from_cache.header("idempotent-replayed"), Some("true"));
    assert_eq!(stack.stat("wasmcustom.idem.replay_cache_hits").await?, 1);
    // The agents' envelope from the cache carries the same result as idemd's.
    let (_, fp2) = stack.preview(json!("51.00")).await?;
    assert_eq!(confirm_at(&stack, "/v1/transfers", &fp2, json!(51)).await?.status, 201);
    let cached = confirm_at(&stack, "/v1/transfers", &fp2, json!(51)).await?;
    cached.assert_prompt("already_completed");

    // With idemd gone, replays still come from the cache; a tampered retry is still refused.
    stack.sidecar.kill9();
    let again = confirm_at(&stack, "/program/v1/transfers", &fp, json!(50)).await?;
    assert_eq!((again.status, &again.body), (201, &first.body));
    let envelope = confirm_at(&stack, "/v1/transfers", &fp2, json!(51)).await?;
    envelope.assert_prompt("already_completed");
    assert_eq!(envelope.json["result"], cached.json["result"]);
    assert_eq!(envelope.json["original_status"], cached.json["original_status"]);
    let tampered = confirm_at(&stack, "/v1/transfers", &fp2, json!(52)).await?;
    assert_eq!(tampered.status, 422);
    tampered.assert_prompt("params_changed");
    assert_eq!(stack.stat("wasmcustom.idem.security_events").await?, 1);
    assert_eq!(stack.stat("wasmcustom.idem.replay_cache_hits").await?, 4);
    assert_eq!(counts(&stack).await?, (2, 2));
    Ok(())
}

#[tokio::test]
async fn nothing_in_flight_is_ever_served_from_the_cache() -> TestResult {
    let Some(opts) = real_stores(true)? else { return Ok(()) };
    let stack = Stack::start(opts).await?;
    let (_, fp) = stack.preview(json!("60.00")).await?;
    let slow = stack.spawn_confirm("/v1/transfers", &fp, transfer(json!("60.00"), "m"), 2500);
    tokio::time::sleep(Duration::from_millis(700)).await;
    for _ in 0..3 {
        let a = confirm_at(&stack, "/v1/transfers", &fp, json!(60)).await?;
        a.assert_prompt("in_progress");
    }
    assert_eq!(stack.stat("wasmcustom.idem.replay_cache_hits").await?, 0);
    assert_eq!(slow.await??.status().as_u16(), 201);
    let done = confirm_at(&stack, "/v1/transfers", &fp, json!(60)).await?;
    done.assert_prompt("already_completed");
    // The retries during the flight reached idemd; the first one after it the cache.
    let again = confirm_at(&stack, "/v1/transfers", &fp, json!(60)).await?;
    again.assert_prompt("already_completed");
    assert_eq!(again.json["result"], done.json["result"]);
    assert!(stack.stat("wasmcustom.idem.replay_cache_hits").await? >= 1);
    assert_eq!(counts(&stack).await?.0, 1);
    Ok(())
}
