//! A record outlives every fingerprint that can name it (DESIGN §4), end to end:
//! real Envoy (replay cache off, as on another pod or after a restart), idemd
//! with a retention far shorter than the fingerprint's life and its reaper on,
//! Redis and a Postgres database of this test's own (the reaper works on the
//! whole table), the demo without its own dedup (a second execution would show).

use idem_e2e::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// idemd's terminal retention in this test.
const RETENTION_S: u64 = 2;
/// The fingerprint's life on the preview route used here: longer than the
/// retention, so a retry with a still-valid fingerprint comes after it.
const FINGERPRINT_TTL_S: u64 = 6;
/// idemd keeps a fingerprint's row this much past `exp` + retention
/// (`idemd::store::retention::CLOCK_SKEW_MS`).
const SKEW_MS: u64 = 5_000;

/// Client keys outlive a test run in the shared Redis: every run uses one of its own.
fn fresh_key() -> String {
    let mut b = [0u8; 8];
    let _ = getrandom::fill(&mut b);
    format!("ret-{}", b.iter().map(|x| format!("{x:02x}")).collect::<String>())
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Retention 2 s (and the retry window and grace that must not exceed it), a
/// reaper pass every second; the plugin's replay cache off; the 3-s preview
/// route's fingerprints living 6 s.
fn opts(db: &str) -> StackOpts {
    let retention = RETENTION_S.to_string();
    let args = [
        "--terminal-retention-s",
        retention.as_str(),
        "--retry-window-s",
        retention.as_str(),
        "--reconcile-grace-ms",
        "1000",
        "--reconcile-interval-ms",
        "200",
        "--reaper-interval-s",
        "1",
    ];
    StackOpts {
        demo: DemoOpts { no_dedup: true, faults: false, ..Default::default() },
        sidecar: SidecarOpts {
            redis_url: Some(backends::redis_url()),
            database_url: Some(db.to_owned()),
            extra_args: args.iter().map(|a| a.to_string()).collect(),
        },
        envoy_edits: vec![
            (
                "\"sidecar_timeout_ms\": 5000,".into(),
                "\"sidecar_timeout_ms\": 5000, \"replay_cache\": {\"slots\": 0},".into(),
            ),
            ("fingerprint_ttl_s: 3\n".into(), format!("fingerprint_ttl_s: {FINGERPRINT_TTL_S}\n")),
        ],
        ..Default::default()
    }
}

/// One line of idemd's own /metrics (0 when absent).
async fn idemd_metric(stack: &Stack, name: &str) -> Result<u64, BoxError> {
    let text = stack.http.get(stack.sidecar_url("/metrics")).send().await?.text().await?;
    Ok(text
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .map(|v| v.trim().parse::<f64>().map(|f| f as u64))
        .transpose()?
        .unwrap_or(0))
}

async fn wait_for_reaped(stack: &Stack, rows: u64, within: Duration) -> Result<(), BoxError> {
    let deadline = Instant::now() + within;
    while idemd_metric(stack, "idem_reaped_total").await? < rows {
        if Instant::now() > deadline {
            return Err(format!("idemd reaped fewer than {rows} rows within {within:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// idemd's row for `key`, asked directly (not through Envoy): the HTTP status and the state.
async fn row_state(stack: &Stack, key: &str) -> Result<(u16, Value), BoxError> {
    let r =
        stack.http.get(stack.sidecar_url(&format!("/v1/operations/{key}"))).bearer_auth(SIDECAR_TOKEN).send().await?;
    let status = r.status().as_u16();
    Ok((status, r.json::<Value>().await?["state"].clone()))
}

async fn confirm(stack: &Stack, fp: &str) -> Result<Answer, BoxError> {
    stack.post("/v1/transfers", SUBJECT, &transfer(json!("31.00"), "rent"), &[("agent-fingerprint", fp)]).await
}

/// The reproduction (retention 3 s, fingerprint TTL 60 s, a retry on an Envoy without the
/// cached replay executed a second transfer), and the answers after the fingerprint expired.
#[tokio::test]
async fn a_retention_shorter_than_the_fingerprint_never_lets_it_run_twice() -> TestResult {
    if !backends::available("redis", &backends::redis_url())? {
        return Ok(());
    }
    let Some(db) = backends::own_postgres()? else { return Ok(()) };
    let stack = Stack::start(opts(&db.url)).await?;

    let preview = stack.post("/ttl3/v1/transfers/preview", SUBJECT, &transfer(json!("31.00"), "rent"), &[]).await?;
    let fp = preview.json["fingerprint"].as_str().ok_or_else(|| format!("no fingerprint: {preview:?}"))?.to_owned();
    let exp = preview.json["fingerprint_expires_at"].as_u64().ok_or("no expiry")?;
    let key = nonce_of(&fp)?;
    let first = confirm(&stack, &fp).await?;
    assert_eq!(first.status, 201, "{first:?}");
    // A client key's row, done just after: it has no fingerprint, so the retention alone keeps it.
    // Its reaping proves a reaper pass ran after the fingerprint's row, too, was past the retention.
    let client_key = format!("\"{}\"", fresh_key());
    let program = stack
        .post("/programs/v1/transfers", SUBJECT, &transfer(json!("2.00"), "decoy"), &[("idempotency-key", &client_key)])
        .await?;
    assert_eq!(program.status, 201, "{program:?}");
    wait_for_reaped(&stack, 1, Duration::from_secs(10)).await?;
    assert!(now_ms() < exp * 1000, "the fingerprint must still be valid here; the machine is too slow for this test");
    assert_eq!(row_state(&stack, &key).await?, (200, json!("DONE")), "past the retention, before exp: kept");

    // Still valid, past the retention: Redis has forgotten the copy, SQL answers with the original.
    let valid = confirm(&stack, &fp).await?;
    assert_eq!(valid.status, 201, "{valid:?}");
    valid.assert_prompt("already_completed");
    assert_eq!(valid.json["result"], first.json, "the original result");
    assert_eq!(idemd_metric(&stack, "idem_acquire_total{outcome=\"ACQUIRED\",mode=\"fingerprint\"}").await?, 1);
    assert_eq!(idemd_metric(&stack, "idem_acquire_total{outcome=\"DONE\",mode=\"fingerprint\"}").await?, 1);

    // Expired, before exp + retention: the lookup finds the row and replays it.
    while now_ms() < exp * 1000 + 100 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let late = confirm(&stack, &fp).await?;
    assert_eq!(late.status, 201, "{late:?}");
    late.assert_prompt("already_completed");
    assert_eq!(late.json["result"], first.json, "the original result");
    assert_eq!(stack.stat("wasmcustom.idem.expired_lookups").await?, 1);

    // Past exp + retention (+ skew) and a reaper pass: the row is gone, and nothing is known any more.
    wait_for_reaped(&stack, 2, Duration::from_secs(RETENTION_S + FINGERPRINT_TTL_S + 10)).await?;
    let earliest = (exp + RETENTION_S) * 1000 + SKEW_MS;
    assert!(now_ms() >= earliest, "reaped {} ms before exp + retention + skew", earliest - now_ms());
    assert_eq!(row_state(&stack, &key).await?.0, 404);
    let gone = confirm(&stack, &fp).await?;
    assert_eq!(gone.status, 410, "{gone:?}");
    gone.assert_prompt("record_expired");
    assert_eq!(gone.json["operation"].as_str(), Some(key.as_str()), "{gone:?}");
    let meaning = gone.json["meaning"].as_str().unwrap_or_default().to_lowercase();
    assert!(
        !meaning.contains("nothing was executed"),
        "never 'nothing ran' about a record that may have run: {meaning}"
    );

    assert_eq!(stack.stat("wasmcustom.idem.replay_cache_hits").await?, 0, "every answer came from idemd");
    let ex = stack.executions().await?;
    assert_eq!(ex["by_key"][key.as_str()], 1, "the fingerprint's transfer ran once: {ex}");
    assert_eq!(ex["total"], 2, "that transfer and the client key's: {ex}");
    Ok(())
}
