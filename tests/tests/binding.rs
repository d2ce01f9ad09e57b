//! Binding outside the body (DESIGN §3), end to end: real Envoy (the `.wasm`, or the native module
//! with `IDEM_E2E_HOST=native`) + idemd + Redis + Postgres in front of the demo, on envoy/e2e.yaml's
//! `/accounts/{account}/v1/transfers` routes, which bind the account in the path (`path:account`).

use idem_e2e::*;
use serde_json::json;

const PREVIEW_A: &str = "/accounts/acct-a/v1/transfers/preview";
const CONFIRM_A: &str = "/accounts/acct-a/v1/transfers";
const CONFIRM_B: &str = "/accounts/acct-b/v1/transfers";

/// A fingerprint minted for account A's quote is refused on account B's path with the same body
/// (`params_changed`, nothing executed), and confirms once on account A's own path.
#[tokio::test]
async fn a_fingerprint_for_account_a_never_confirms_on_account_b() -> TestResult {
    let Some(opts) = real_stores(false)? else { return Ok(()) };
    let stack = Stack::start(opts).await?;
    let body = transfer(json!("61.00"), "rent");
    let quote = stack.post(PREVIEW_A, SUBJECT, &body, &[]).await?;
    assert_eq!(quote.status, 200, "{quote:?}");
    let fp = quote.json["fingerprint"].as_str().ok_or("no fingerprint")?.to_owned();
    let with_fp = [("agent-fingerprint", fp.as_str())];

    let other = stack.post(CONFIRM_B, SUBJECT, &body, &with_fp).await?;
    assert_eq!(other.status, 422, "{other:?}");
    other.assert_prompt("params_changed");
    assert_eq!(stack.stat("wasmcustom.idem.rejected.params_changed").await?, 1);
    assert_eq!(counts(&stack).await?.0, 0, "nothing reached the upstream for account B");

    let own = stack.post(CONFIRM_A, SUBJECT, &body, &with_fp).await?;
    assert_eq!(own.status, 201, "{own:?}");
    let again = stack.post(CONFIRM_A, SUBJECT, &transfer(json!("61.0"), "rent, again"), &with_fp).await?;
    again.assert_prompt("already_completed");
    // After the operation exists, account B's path is still refused: the fingerprint names account A.
    let later = stack.post(CONFIRM_B, SUBJECT, &body, &with_fp).await?;
    later.assert_prompt("params_changed");
    assert_eq!(counts(&stack).await?.0, 1, "one execution, on account A");
    Ok(())
}
