//! The fingerprint never outlives the quote (DESIGN §3): the demo states its quote's expiry in
//! `expires_at`, the preview routes of the committed configurations point `quote_expires` at
//! it, and `exp = min(now + fingerprint_ttl_s, expires_at)`. A confirm after the quote's expiry
//! but well inside `fingerprint_ttl_s` is refused as expired and never reaches the service.

use idem_e2e::bypass::{assert_envelope, seen};
use idem_e2e::*;
use serde_json::json;
use std::time::Duration;

#[tokio::test]
async fn a_confirm_after_the_quote_expired_is_refused_though_the_fingerprint_ttl_is_long() -> TestResult {
    let Some(opts) = real_stores(true)? else { return Ok(()) };
    let stack = Stack::start(opts).await?;
    // A quote valid for 2 s on a route whose fingerprints live 900 s.
    let body = transfer(json!("20.00"), "rent");
    let quote = stack.post("/v1/transfers/preview", SUBJECT, &body, &[("x-demo-quote-ttl-s", "2")]).await?;
    assert_eq!(quote.status, 200, "{quote:?}");
    let stated = quote.json["expires_at"].as_u64().ok_or("the demo states no expiry")?;
    let exp = quote.json["fingerprint_expires_at"].as_u64().ok_or("no fingerprint_expires_at")?;
    assert_eq!(exp, stated, "exp is the quote's expiry, not now + 900 s: {:?}", quote.json);
    assert_eq!(fingerprint_claims(quote.json["fingerprint"].as_str().unwrap_or_default())?["exp"], stated);
    let fp = quote.json["fingerprint"].as_str().ok_or("no fingerprint")?.to_owned();

    // Past the quote's expiry (and so the fingerprint's): refused, nothing reaches the service.
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs();
    let wait = stated.saturating_sub(now) + 1;
    tokio::time::sleep(Duration::from_secs(wait)).await;
    let before = seen(&stack).await?;
    let late = stack.post("/v1/transfers", SUBJECT, &body, &[("agent-fingerprint", fp.as_str())]).await?;
    assert_envelope(&late, 410, "fingerprint_expired");
    before.assert_same(seen(&stack).await?, "a confirm after the quote expired");
    assert_eq!(counts(&stack).await?, (0, 0));

    // A quote that states a usable expiry and is confirmed in time executes as ever.
    let quote = stack.post("/v1/transfers/preview", SUBJECT, &body, &[]).await?;
    let fp = quote.json["fingerprint"].as_str().ok_or("no fingerprint")?.to_owned();
    let done = stack.post("/v1/transfers", SUBJECT, &body, &[("agent-fingerprint", fp.as_str())]).await?;
    assert_eq!(done.status, 201, "{done:?}");
    assert_eq!(counts(&stack).await?.0, 1);
    Ok(())
}

/// A quote whose stated expiry is missing or past hands out no fingerprint: the answer is
/// replaced by a clear 502 `quote_unusable`, so nothing can be confirmed from it.
#[tokio::test]
async fn a_quote_without_a_usable_expiry_gets_no_fingerprint() -> TestResult {
    let Some(opts) = real_stores(true)? else { return Ok(()) };
    let stack = Stack::start(opts).await?;
    let body = transfer(json!("20.00"), "rent");
    let past = stack.post("/v1/transfers/preview", SUBJECT, &body, &[("x-demo-quote-ttl-s", "0")]).await?;
    assert_eq!(past.status, 502, "{past:?}");
    past.assert_prompt("quote_unusable");
    assert!(past.json.get("fingerprint").is_none() && past.header("agent-fingerprint").is_none(), "{past:?}");
    assert_eq!(stack.stat("wasmcustom.idem.minted").await?, 0);
    Ok(())
}
