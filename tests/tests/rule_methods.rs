//! A guarded path is guarded for every method (DESIGN §6), under route rules
//! (envoy/istio-like.yaml's shape, both builds): with `match.method: POST` on the confirm, a PUT,
//! PATCH or DELETE on the same path is refused (400 `path_not_canonical`), and nothing reaches the
//! upstream; a method the rule lists in `pass_methods` passes unguarded. The mesh's catch-all
//! sends every method on the path to the same upstream, which may execute any of them.

use idem_e2e::bypass::{assert_envelope, seen};
use idem_e2e::*;
use serde_json::{json, Value};

/// The rule shape with the confirm rule taking only POST, and `pass` as its `pass_methods`.
async fn post_only_stack(pass: Option<Value>) -> Result<Stack, BoxError> {
    let opts = istio::route_rules_shape(sqlite_only(true), |config| {
        if let Some(rules) = config["routes"].as_array_mut() {
            for rule in rules.iter_mut().filter(|r| r["name"] == "transfer_confirm") {
                rule["match"]["method"] = json!("POST");
                if let Some(pass) = &pass {
                    rule["pass_methods"] = pass.clone();
                }
            }
        }
    })?;
    Stack::start(opts).await
}

async fn send(stack: &Stack, method: &str, fp: &str) -> Result<Answer, BoxError> {
    let req = stack
        .http
        .request(reqwest::Method::from_bytes(method.as_bytes())?, stack.url("/v1/transfers"))
        .header("x-agent-subject", SUBJECT)
        .header("agent-fingerprint", fp)
        .json(&transfer(json!("15.00"), "method"));
    let r = req.send().await?;
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    let body = r.bytes().await?.to_vec();
    let json = serde_json::from_slice(&body).unwrap_or(Value::Null);
    Ok(Answer { status, headers, body, json })
}

#[tokio::test]
async fn other_methods_on_a_post_only_guarded_path_never_reach_the_upstream() -> TestResult {
    let stack = post_only_stack(None).await?;
    let (_, fp) = stack.preview(json!("15.00")).await?;
    let before = seen(&stack).await?;
    for method in ["PUT", "PATCH", "DELETE", "GET", "OPTIONS"] {
        let got = send(&stack, method, &fp).await?;
        assert_envelope(&got, 400, "path_not_canonical");
        assert!(got.json["detail"].as_str().is_some_and(|d| d.contains("guarded for POST")), "{method}: {got:?}");
    }
    before.assert_same(seen(&stack).await?, "other methods on the guarded confirm path");
    // The guarded method itself runs as ever, once.
    let done = send(&stack, "POST", &fp).await?;
    assert_eq!(done.status, 201, "{done:?}");
    assert_eq!(counts(&stack).await?, (1, 1));
    Ok(())
}

#[tokio::test]
async fn a_method_the_rule_lets_pass_reaches_the_upstream_and_no_other() -> TestResult {
    let stack = post_only_stack(Some(json!(["GET", "HEAD"]))).await?;
    let (_, fp) = stack.preview(json!("15.00")).await?;
    let before = seen(&stack).await?;
    // GET passes unguarded (the demo has no GET on the path: its own 405 comes back).
    let got = send(&stack, "GET", &fp).await?;
    assert_eq!(got.status, 405, "{got:?}");
    let after = seen(&stack).await?;
    assert_eq!(after.forwarded, before.forwarded + 1, "the GET reached the upstream");
    for method in ["PUT", "PATCH", "DELETE"] {
        assert_envelope(&send(&stack, method, &fp).await?, 400, "path_not_canonical");
    }
    after.assert_same(seen(&stack).await?, "methods the rule does not let pass");
    assert_eq!(counts(&stack).await?, (0, 0));
    Ok(())
}
