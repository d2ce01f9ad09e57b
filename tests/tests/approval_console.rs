//! The approvers' console in a real headless Chromium (Debian's `chromium` driven over WebDriver by
//! Debian's `chromedriver`, with the fantoccini client): an agent previews and confirms a large
//! transfer through Envoy → the page shows it, its bound fields escaped → a click on approve → the
//! agent's next confirm executes once (the demo's ledger); a click on reject → `rejected`, nothing
//! executed; a form posted without the page's CSRF token changes nothing. A screenshot of the page
//! is saved under target/ and its path printed.
//!
//! Without chromium and chromedriver the test says so and skips; with IDEM_REQUIRE_BACKENDS=1 it
//! fails instead (`.ci/run` installs both).

use fantoccini::{ClientBuilder, Locator};
use idem_e2e::*;
use serde_json::{json, Value};
use std::process::{Command, Stdio};
use std::time::Duration;

const ANN: (&str, &str) = ("approver-ann", "ann-approval-credential-0123456789");

fn tool(name: &str) -> Option<std::path::PathBuf> {
    ["/usr/bin", "/usr/local/bin", "/usr/lib/chromium"]
        .iter()
        .map(|d| std::path::Path::new(d).join(name))
        .find(|p| p.exists())
}

/// chromium and chromedriver, or why not (a loud skip, or a failure when backends are required).
fn browser() -> Result<Option<(std::path::PathBuf, std::path::PathBuf)>, BoxError> {
    match (tool("chromium"), tool("chromedriver")) {
        (Some(c), Some(d)) => Ok(Some((c, d))),
        _ if std::env::var("IDEM_REQUIRE_BACKENDS").is_ok_and(|v| v == "1") => Err(
            "chromium or chromedriver is missing (apt-get install chromium chromium-driver) and IDEM_REQUIRE_BACKENDS=1"
                .into(),
        ),
        _ => {
            backends::skipped("chromium");
            Ok(None)
        }
    }
}

/// A chromedriver on its own port, killed when dropped.
struct Driver(std::process::Child, u16);

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn start_driver(path: &std::path::Path) -> Result<Driver, BoxError> {
    let port = free_port()?;
    let child = Command::new(path).arg(format!("--port={port}")).stdout(Stdio::null()).stderr(Stdio::null()).spawn()?;
    let driver = Driver(child, port);
    let http = reqwest::Client::new();
    for _ in 0..100 {
        if http.get(format!("http://127.0.0.1:{port}/status")).send().await.is_ok() {
            return Ok(driver);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err("chromedriver did not start".into())
}

async fn confirm(stack: &Stack, fp: &str, body: &Value) -> Result<Answer, BoxError> {
    stack.post("/approve/v1/transfers", SUBJECT, body, &[("agent-fingerprint", fp)]).await
}

/// Preview and confirm `body` on the approval route: (fingerprint, operation), awaiting.
async fn awaiting(stack: &Stack, body: &Value) -> Result<(String, String), BoxError> {
    let p = stack.post("/approve/v1/transfers/preview", SUBJECT, body, &[]).await?;
    let fp = p.json["fingerprint"].as_str().ok_or_else(|| format!("no fingerprint: {p:?}"))?.to_string();
    let a = confirm(stack, &fp, body).await?;
    assert_eq!(a.status, 202, "{a:?}");
    a.assert_prompt("approval_required");
    let key = nonce_of(&fp)?;
    Ok((fp, key))
}

#[tokio::test]
async fn an_approver_approves_and_rejects_in_a_real_browser() -> TestResult {
    let Some((chromium, chromedriver)) = browser()? else { return Ok(()) };
    let mut opts = sqlite_only(false);
    opts.sidecar.extra_args.extend(["--approvers".to_string(), format!("{}={}", ANN.0, ANN.1)]);
    let stack = Stack::start(opts).await?;
    // A payee that is markup: the page must print it as text.
    let large =
        json!({"amount": "5000.00", "currency": "EUR", "payee_id": "<img src=x onerror=alert(1)>", "memo": "m"});
    let (fp, key) = awaiting(&stack, &large).await?;
    let refused = json!({"amount": "2000.00", "currency": "EUR", "payee_id": "payee-42", "memo": "m"});
    let (fp2, key2) = awaiting(&stack, &refused).await?;
    assert_eq!(counts(&stack).await?, (0, 0));

    let driver = start_driver(&chromedriver).await?;
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({"binary": chromium, "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,1600"]}),
    );
    let browser = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{}", driver.1))
        .await?;
    let result = drive(&browser, &stack, (&fp, &key), (&fp2, &key2), &large, &refused).await;
    let _ = browser.close().await;
    result
}

async fn drive(
    browser: &fantoccini::Client,
    stack: &Stack,
    (fp, key): (&str, &str),
    (fp2, key2): (&str, &str),
    large: &Value,
    refused: &Value,
) -> TestResult {
    let sidecar = stack.sidecar_url("/approvals");
    let page = sidecar.replacen("http://", &format!("http://{}:{}@", ANN.0, ANN.1), 1);
    browser.goto(&page).await?;
    let section = browser.find(Locator::Id(&format!("approval-{key}"))).await?;
    let text = section.text().await?;
    assert!(text.contains("payments.large_transfer") && text.contains("5000"), "{text}");
    assert!(text.contains("<img src=x onerror=alert(1)>"), "the payee is shown as text: {text}");
    let source = browser.source().await?;
    assert!(!source.contains("<img src=x"), "markup from a bound field never reaches the page as markup");
    assert!(browser.find(Locator::Id(&format!("approval-{key2}"))).await.is_ok());

    let shot = target_dir().join("approval-console.png");
    std::fs::write(&shot, browser.screenshot().await?)?;
    println!("screenshot of the approvers' console: {}", shot.display());

    // A form posted without the page's token (another site's form, with the browser's credentials).
    let forged = stack
        .http
        .post(stack.sidecar_url(&format!("/approvals/{key}")))
        .basic_auth(ANN.0, Some(ANN.1))
        .form(&[("decision", "approve"), ("reason", "forged"), ("csrf", "0")])
        .send()
        .await?;
    assert_eq!(forged.status().as_u16(), 403);
    confirm(stack, fp, large).await?.assert_prompt("approval_required");

    // Approve the first: type a reason, click.
    section.find(Locator::Css("input[name=reason]")).await?.send_keys("checked with the payee").await?;
    section.find(Locator::Css("button.approve")).await?.click().await?;
    let notice = notice_saying(browser, "APPROVED").await?;
    assert!(notice.contains("APPROVED"), "{notice}");
    let done = confirm(stack, fp, large).await?;
    assert_eq!(done.status, 201, "{done:?}");
    confirm(stack, fp, large).await?.assert_prompt("already_completed");
    assert_eq!(counts(stack).await?, (1, 1), "the approved transfer executed once");

    // Reject the second.
    let section = browser.find(Locator::Id(&format!("approval-{key2}"))).await?;
    section.find(Locator::Css("input[name=reason]")).await?.send_keys("over the monthly limit").await?;
    section.find(Locator::Css("button.reject")).await?.click().await?;
    let notice = notice_saying(browser, "REJECTED").await?;
    assert!(notice.contains("REJECTED"), "{notice}");
    let r = confirm(stack, fp2, refused).await?;
    assert_eq!(r.status, 403);
    r.assert_prompt("rejected");
    assert_eq!(r.json["approval"]["reason"], "over the monthly limit");
    assert!(browser.find(Locator::Id("no-pending")).await.is_ok(), "nothing waits any more");
    assert_eq!(counts(stack).await?, (1, 1), "the rejected one never ran");
    let (_, out, _) = idemd_ops(&stack.database_url(), &["show", key2])?;
    assert!(out.contains("approver:approver-ann") && out.contains("over the monthly limit"), "{out}");
    Ok(())
}

/// The page's notice once it says `word`. After a click the old page (with the last action's notice) may still be
/// there, or go stale while it is read: look again until the new page's notice says it (10 s at most).
async fn notice_saying(browser: &fantoccini::Client, word: &str) -> Result<String, BoxError> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut last = String::new();
    while std::time::Instant::now() < deadline {
        if let Ok(el) = browser.find(Locator::Id("notice")).await {
            if let Ok(text) = el.text().await {
                if text.contains(word) {
                    return Ok(text);
                }
                last = text;
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    Err(format!("the notice never said {word}: {last:?}").into())
}
