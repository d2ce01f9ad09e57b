//! The fingerprint the agent sees is the gateway's only (DESIGN §6), on both
//! builds: an upstream whose preview answer writes a top-level `fingerprint` of its own (in any
//! case, or JSON-escaped as `\u0066ingerprint`) never hands its value to the agent, whether the
//! answer streams (the first one on a worker) or is held (every one after, on that route). A
//! nested `fingerprint` (a card's) is the upstream's business and stays.

use idem_e2e::*;
use serde_json::json;

const PREVIEW: &str = "/v1/transfers/preview";
/// What the demo's `x-demo-self-fingerprint` puts in the field.
const UPSTREAMS: &str = "upstream_fp_0000";

/// The e2e stack, its preview route without `quote_expires: /expires_at`: answers of known length
/// stream (as in tests/tests/preview_stream.rs).
async fn streaming_stack() -> Result<Stack, BoxError> {
    let pointer = "                      quote_expires: /expires_at        \
                   # the demo's quote states its expiry: the fingerprint never outlives it\n";
    let mut opts = sqlite_only(true);
    opts.envoy_edits.push((pointer.into(), String::new()));
    Stack::start(opts).await
}

#[tokio::test]
async fn an_upstream_that_writes_its_own_fingerprint_never_reaches_the_agent_with_it() -> TestResult {
    let stack = streaming_stack().await?;
    let body = transfer(json!("21.00"), "self");
    let mut header_fps = Vec::new();
    // The first answer streams; from then on the route's answers are held: both ways, every spelling.
    for key in ["fingerprint", "Fingerprint", "\\u0066ingerprint", "FINGERPRINT", "fingerprint"] {
        let got = stack.post(PREVIEW, SUBJECT, &body, &[("x-demo-self-fingerprint", key)]).await?;
        assert_eq!(got.status, 200, "{key}: {got:?}");
        let text = String::from_utf8_lossy(&got.body).to_string();
        assert!(!text.contains(UPSTREAMS), "{key}: the upstream's fingerprint reached the agent: {text}");
        let fp = got.header("agent-fingerprint").ok_or_else(|| format!("{key}: no header: {got:?}"))?.to_owned();
        assert_eq!(got.json["fingerprint"].as_str(), Some(fp.as_str()), "{key}: {text}");
        let length = got.header("content-length").map(str::parse::<usize>).transpose()?;
        assert_eq!(length, announced_length(got.body.len())?, "{key}");
        assert!(got.json["quote_id"].is_string(), "{key}: the rest of the quote is kept: {text}");
        header_fps.push(fp);
    }
    // What the agent got confirms, once.
    let fp = header_fps.first().ok_or("no fingerprint")?;
    let done = stack.post("/v1/transfers", SUBJECT, &body, &[("agent-fingerprint", fp.as_str())]).await?;
    assert_eq!(done.status, 201, "{done:?}");
    assert_eq!(counts(&stack).await?, (1, 1));
    // A nested fingerprint is the card's: kept, beside the gateway's at the top.
    let card = stack.post(PREVIEW, SUBJECT, &body, &[("x-demo-card-fingerprint", "1")]).await?;
    assert_eq!(card.json["card"]["fingerprint"], "card_fp_7f3a", "{card:?}");
    assert_eq!(card.json["fingerprint"].as_str(), card.header("agent-fingerprint"), "{card:?}");
    Ok(())
}
