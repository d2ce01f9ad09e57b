//! A preview's answer streams through the real Envoy with the fingerprint spliced in (DESIGN §3,
//! §9): its headers and first bytes reach the agent while the upstream is still sending, the length
//! Envoy announces is the spliced body's, and an answer that names a `fingerprint` of its own is
//! never given a second one. Both builds (`IDEM_E2E_HOST=native` for the module).

use idem_e2e::http2::{self, H2Request};
use idem_e2e::*;
use serde_json::{json, Value};
use std::time::Duration;

const PREVIEW: &str = "/v1/transfers/preview";

/// The e2e stack, its preview route without `quote_expires: /expires_at`: a quote whose expiry is in
/// the body is held (the fingerprint's `exp`, and the 502 for an unusable quote, need the whole
/// body); every other JSON answer of known length streams.
async fn streaming_stack() -> Result<Stack, BoxError> {
    let pointer = "                      quote_expires: /expires_at        \
                   # the demo's quote states its expiry: the fingerprint never outlives it\n";
    let mut opts = sqlite_only(true);
    opts.envoy_edits.push((pointer.into(), String::new()));
    Stack::start(opts).await
}

/// How long a test waits for what must come before the upstream's release: the demo sends the
/// rest of its answer only after `release_hold`, and on its own after 20 s. Waiting longer than
/// this for the head means the gateway held the answer.
const BEFORE_RELEASE: Duration = Duration::from_secs(10);

#[tokio::test]
async fn a_preview_answer_streams_through_with_the_fingerprint_spliced() -> TestResult {
    if in_envoy_only("Envoy's ext_proc filter holds a BUFFERED answer whole (the fingerprint is spliced, not streamed); FULL_DUPLEX_STREAMED streams it without content-length")? {
        return Ok(());
    }
    let stack = streaming_stack().await?;
    let minted_before = stack.stat("wasmcustom.idem.minted").await?;
    let req = stack
        .http
        .post(stack.url(PREVIEW))
        .header("x-agent-subject", SUBJECT)
        .header("x-demo-split", "halves")
        .json(&transfer(json!("25.00"), "streamed"));
    // The head arrives while the upstream still holds half its body: nothing waits for the whole.
    let mut resp = tokio::time::timeout(BEFORE_RELEASE, req.send())
        .await
        .map_err(|_| "the preview's headers did not arrive before the upstream finished: the answer was held")??;
    assert_eq!(resp.status().as_u16(), 200);
    let header = |name: &str| resp.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let announced: usize = header("content-length").ok_or("no content-length")?.parse()?;
    let fp = header("agent-fingerprint").ok_or("no agent-fingerprint header")?;
    let first = tokio::time::timeout(BEFORE_RELEASE, resp.chunk())
        .await
        .map_err(|_| "the first half did not arrive before the upstream sent the rest")??
        .ok_or("the body ended at once")?;
    assert!(!first.is_empty() && first.len() < announced, "{} of {announced} bytes before the release", first.len());
    stack.release_hold("halves")?;
    let mut body = first.to_vec();
    while let Some(more) = resp.chunk().await? {
        body.extend_from_slice(&more);
    }
    assert_eq!(body.len(), announced, "the announced length is the spliced body's");
    let v: Value = serde_json::from_slice(&body)?;
    assert_eq!(v["fingerprint"].as_str(), Some(fp.as_str()), "{v}");
    assert!(v["quote_id"].is_string() && v["fingerprint_expires_at"].is_u64(), "{v}");
    assert_eq!(String::from_utf8_lossy(&body).matches("\"fingerprint\"").count(), 1);
    assert_eq!(stack.stat("wasmcustom.idem.minted").await?, minted_before + 1);
    // What was spliced confirms: it executes once.
    let confirm = stack
        .post("/v1/transfers", SUBJECT, &transfer(json!("25.00"), "streamed"), &[("agent-fingerprint", &fp)])
        .await?;
    assert_eq!(confirm.status, 201, "{confirm:?}");
    assert_eq!(counts(&stack).await?, (1, 1));
    Ok(())
}

/// HTTP/2 to the agent, HTTP/1 to the upstream: the same splice, the same length.
#[tokio::test]
async fn a_preview_over_http2_gets_the_spliced_answer_at_its_announced_length() -> TestResult {
    let stack = streaming_stack().await?;
    let req = H2Request::post(PREVIEW).header("x-agent-subject", SUBJECT).json(&transfer(json!("9.50"), "h2"));
    let got = http2::send(stack.ports.listener, &req).await?.answer;
    assert_eq!(got.status, 200, "{got:?}");
    let fp = got.header("agent-fingerprint").ok_or("no agent-fingerprint header")?;
    assert_eq!(got.json["fingerprint"].as_str(), Some(fp), "{got:?}");
    if let Some(length) = got.header("content-length") {
        assert_eq!(length.parse::<usize>()?, got.body.len());
    }
    Ok(())
}

/// The upstream's quote names a card with its own `fingerprint`: the first answer keeps the
/// upstream's JSON as sent (the fingerprint only in its header, no second field); from then on that
/// route's answers are held and get the field at the top level, the card's left alone. Either way
/// the header's fingerprint confirms once.
#[tokio::test]
async fn an_answer_naming_its_own_fingerprint_is_never_given_a_second_one() -> TestResult {
    let stack = streaming_stack().await?;
    let body = transfer(json!("31.00"), "card");
    let card = [("x-demo-card-fingerprint", "1")];
    let first = stack.post(PREVIEW, SUBJECT, &body, &card).await?;
    assert_eq!(first.status, 200, "{first:?}");
    let header_fp = first.header("agent-fingerprint").ok_or("no agent-fingerprint header")?.to_owned();
    assert_eq!(first.json["card"]["fingerprint"], "card_fp_7f3a", "{first:?}");
    assert!(first.json.get("fingerprint").is_none(), "a second fingerprint field: {first:?}");
    assert_eq!(
        first.header("content-length").map(str::parse::<usize>).transpose()?,
        announced_length(first.body.len())?
    );
    let second = stack.post(PREVIEW, SUBJECT, &body, &card).await?;
    let fp = second.json["fingerprint"].as_str().ok_or("the held answer has no fingerprint")?;
    assert_eq!(Some(fp), second.header("agent-fingerprint"));
    assert_eq!(second.json["card"]["fingerprint"], "card_fp_7f3a");
    assert_eq!(String::from_utf8_lossy(&second.body).matches("\"fingerprint\"").count(), 2, "{second:?}");
    let confirm = stack.post("/v1/transfers", SUBJECT, &body, &[("agent-fingerprint", &header_fp)]).await?;
    assert_eq!(confirm.status, 201, "{confirm:?}");
    assert_eq!(counts(&stack).await?, (1, 1));
    Ok(())
}
