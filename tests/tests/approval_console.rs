//! The approvers' console in a real headless Chromium (Debian's `chromium` driven over WebDriver by
//! Debian's `chromedriver`, with the fantoccini client): an agent previews and confirms a large
//! transfer through Envoy → the page shows it, its bound fields escaped → a click on approve → the
//! agent's next confirm executes once (the demo's ledger); a click on reject → `rejected`, nothing
//! executed; a form posted without the page's CSRF token changes nothing. A screenshot of the page
//! is saved under target/ and its path printed.
//!
//! And the NEEDS_REVIEW form (DESIGN §4, "No person decides their own operation"): an approver whose
//! identity is the operation's own subject gets no form for it and a form posted anyway is refused,
//! so they cannot release the operation they ran and have their agent's retry execute it a second
//! time; another approver's release asks the upstream at that moment and is refused while it has a
//! record, and their "done" with that record is what the agent's retry replays. One execution.
//!
//! Without chromium and chromedriver the test says so and skips; with IDEM_REQUIRE_BACKENDS=1 it
//! fails instead (`.ci/run` installs both).

use fantoccini::{ClientBuilder, Locator};
use idem_e2e::*;
use serde_json::{json, Value};
use std::process::{Command, Stdio};
use std::time::Duration;

const ANN: (&str, &str) = ("approver-ann", "ann-approval-credential-0123456789");
/// An approver whose identity is the agent's own subject.
const SELF: (&str, &str) = (SUBJECT, "alice-approval-credential-0123456789");

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

/// A headless Chromium session on `driver`.
async fn session(chromium: &std::path::Path, driver: &Driver) -> Result<fantoccini::Client, BoxError> {
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({"binary": chromium, "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,1600"]}),
    );
    Ok(ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{}", driver.1))
        .await?)
}

/// The console's page as `who` (HTTP Basic in the URL, as a browser keeps it).
async fn open_console(browser: &fantoccini::Client, stack: &Stack, who: (&str, &str)) -> TestResult {
    let page = stack.sidecar_url("/approvals").replacen("http://", &format!("http://{}:{}@", who.0, who.1), 1);
    browser.goto(&page).await?;
    Ok(())
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
    let browser = session(&chromium, &driver).await?;
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
    open_console(browser, stack, ANN).await?;
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

/// The demo's record of `key` (its by-key endpoint, straight to the demo).
async fn demo_record(stack: &Stack, key: &str) -> Result<Value, BoxError> {
    let url = format!("http://127.0.0.1:{}/v1/transfers/by-key/{key}", stack.ports.demo);
    let r = stack.http.get(url).send().await?;
    assert_eq!(r.status().as_u16(), 200, "the demo committed the transfer");
    Ok(r.json().await?)
}

/// Retry the confirm on the 2-s lease route until its answer is `want` (every answer before it
/// `in_progress`, never an execution).
async fn retry_until(stack: &Stack, fp: &str, want: &str) -> Result<Answer, BoxError> {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let a = stack
            .post("/fast/v1/transfers", SUBJECT, &transfer(json!("25.00"), "rent"), &[("agent-fingerprint", fp)])
            .await?;
        if a.json["status"] == want {
            return Ok(a);
        }
        assert_eq!(a.json["status"], "in_progress", "waiting for {want}: {a:?}");
        if std::time::Instant::now() > deadline {
            return Err(format!("no {want} in time; last: {a:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test]
async fn nobody_settles_their_own_operation_and_a_release_needs_the_upstream_to_have_no_record() -> TestResult {
    let Some((chromium, chromedriver)) = browser()? else { return Ok(()) };
    let mut opts = sqlite_only(true);
    let approvers = format!("{}={},{}={}", ANN.0, ANN.1, SELF.0, SELF.1);
    // A reconciler whose upstream's record reads neither done nor failed (its `executed` is not the
    // declared `settled`), with one lookup of budget: the committed transfer goes to a person.
    let args = [
        ("--approvers", approvers.as_str()),
        ("--lease-ms", "1500"),
        ("--upstream-worst-case-ms", "500"),
        ("--gateway-timeout-ms", "500"),
        ("--retry-backoff-total-ms", "100"),
        ("--reconcile-interval-ms", "200"),
        ("--reconcile-grace-ms", "1000"),
        ("--reconcile-retry-budget", "1"),
        ("--status-endpoint", "payments.transfer=http://127.0.0.1:8080/v1/transfers/by-key/{key}"),
        ("--status-reading", "payments.transfer=pointer=/status;done=settled;failed=failed"),
    ];
    opts.sidecar.extra_args.extend(args.iter().flat_map(|(k, v)| [k.to_string(), v.to_string()]));
    let mut stack = Stack::start(opts).await?;
    let (_, fp) = stack.preview(json!("25.00")).await?;
    let key = nonce_of(&fp)?;
    let first = stack
        .post(
            "/fast/v1/transfers",
            SUBJECT,
            &transfer(json!("25.00"), "rent"),
            &[("agent-fingerprint", &fp), ("x-demo-crash-after-commit", "1")],
        )
        .await?;
    first.assert_prompt("in_progress");
    stack.restart_demo().await?;
    retry_until(&stack, &fp, "needs_review").await?;
    let record = demo_record(&stack, &key).await?;
    assert_eq!(counts(&stack).await?, (1, 1), "it ran once; the agent was told needs_review");
    // Someone else's approval waits too: its form carries the approver's CSRF token.
    let p = stack.post("/approve/v1/transfers/preview", "user-bob", &transfer(json!("5000.00"), "m"), &[]).await?;
    let other = p.json["fingerprint"].as_str().ok_or("no fingerprint")?.to_string();
    let a = stack
        .post("/approve/v1/transfers", "user-bob", &transfer(json!("5000.00"), "m"), &[("agent-fingerprint", &other)])
        .await?;
    a.assert_prompt("approval_required");

    let driver = start_driver(&chromedriver).await?;
    let (own, ann) = (session(&chromium, &driver).await?, session(&chromium, &driver).await?);
    let result = settle(&own, &ann, &stack, &fp, &key, &record).await;
    let _ = own.close().await;
    let _ = ann.close().await;
    result
}

async fn settle(
    own: &fantoccini::Client,
    ann: &fantoccini::Client,
    stack: &Stack,
    fp: &str,
    key: &str,
    record: &Value,
) -> TestResult {
    // The agent's own subject sees the operation, and no form to settle it.
    open_console(own, stack, SELF).await?;
    let section = own.find(Locator::Id(&format!("review-{key}"))).await?;
    let text = section.text().await?;
    assert!(text.contains("your own subject: another person must resolve it"), "{text}");
    assert!(section.find(Locator::Css("form")).await.is_err(), "no form for their own operation");
    // A release posted anyway, with their own valid form token: refused.
    let source = own.source().await?;
    let csrf = source.split("name=\"csrf\" value=\"").nth(1).and_then(|r| r.split('"').next()).ok_or("no csrf")?;
    let no_redirects = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build()?;
    let forged = no_redirects
        .post(stack.sidecar_url(&format!("/approvals/review/{key}")))
        .basic_auth(SELF.0, Some(SELF.1))
        .form(&[("outcome", "release"), ("why", "it never ran, trust me"), ("csrf", csrf)])
        .send()
        .await?;
    assert_eq!(forged.status().as_u16(), 303);
    let location = forged.headers().get("location").and_then(|l| l.to_str().ok()).unwrap_or("").to_string();
    assert!(location.contains("error=") && location.contains("own_subject"), "{location}");
    retry_until(stack, fp, "needs_review").await?;
    assert_eq!(counts(stack).await?, (1, 1), "the agent's retry did not run it again");

    // Another approver's release: the upstream is asked now, and it has the transfer.
    open_console(ann, stack, ANN).await?;
    let section = ann.find(Locator::Id(&format!("review-{key}"))).await?;
    section.find(Locator::Css("select[name=outcome]")).await?.select_by_value("release").await?;
    section.find(Locator::Css("input[name=why]")).await?.send_keys("looks like it never went out").await?;
    section.find(Locator::Css("button[type=submit]")).await?.click().await?;
    let notice = notice_saying(ann, "has a record of it").await?;
    assert!(notice.contains("status endpoint answered 200 with /status = \"executed\""), "{notice}");
    let shot = target_dir().join("approval-console-review.png");
    std::fs::write(&shot, ann.screenshot().await?)?;
    println!("screenshot of a refused release: {}", shot.display());
    retry_until(stack, fp, "needs_review").await?;

    // Done, with the upstream's record: what the agent is told from now on.
    let section = ann.find(Locator::Id(&format!("review-{key}"))).await?;
    section.find(Locator::Css("select[name=outcome]")).await?.select_by_value("done").await?;
    section.find(Locator::Css("textarea[name=result]")).await?.send_keys(&record.to_string()).await?;
    section.find(Locator::Css("input[name=why]")).await?.send_keys("the demo's ledger has it").await?;
    section.find(Locator::Css("button[type=submit]")).await?.click().await?;
    notice_saying(ann, "resolve_done").await?;
    let done = retry_until(stack, fp, "already_completed").await?;
    assert_eq!(done.json["result"], *record);
    assert_eq!(counts(stack).await?, (1, 1), "executed once");
    let (_, out, _) = idemd_ops(&stack.database_url(), &["show", key])?;
    assert!(out.contains("operator:approver-ann") && out.contains("resolve_done"), "{out}");
    assert!(!out.contains("resolve_release"), "{out}");
    Ok(())
}
