//! Tampering as an operator sees it (DESIGN §8), in a real Envoy on both builds: a
//! tampered amount, another subject's fingerprint, a forged signature and an unknown key id are
//! each refused, counted by kind in Envoy's stats, logged as one warning line, and reported to
//! idemd, which writes one `idem_audit` line (`idemd ops events` lists them) and counts
//! `idem_security_events_total{kind}`. The refusal never waits for that report: with idemd
//! stopped it still comes at once.

use idem_core::fingerprint::{self, Key, Keyring};
use idem_e2e::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const MALLORY: &str = "user-mallory";
/// envoy/e2e.yaml's signing key (kid `dev1`).
const E2E_SECRET: &str = "dev-only-secret-change-me-0123456789abcdef";

/// A fingerprint with the claims of `fp` (nonce, expiry, subject, scope, parameters) signed by
/// `secret` under `kid`: a forgery when the secret is not the gateway's, unknown when the kid is.
fn resigned(fp: &str, kid: &str, secret: &str) -> Result<String, BoxError> {
    let c = fingerprint_claims(fp)?;
    let ring = Keyring::new(vec![Key { kid: kid.into(), secret: secret.as_bytes().to_vec() }], kid)?;
    let n = c["n"].as_str().ok_or("no nonce")?;
    let mut nonce = [0u8; 16];
    for (i, b) in nonce.iter_mut().enumerate() {
        *b = u8::from_str_radix(n.get(2 * i..2 * i + 2).ok_or("short nonce")?, 16)?;
    }
    let field = |name: &str| c[name].as_str().ok_or_else(|| format!("no {name} in {c}"));
    let exp = c["exp"].as_u64().ok_or("no exp")?;
    Ok(fingerprint::mint(&ring, nonce, exp, field("u")?, field("s")?, field("p")?))
}

/// A few random hex characters, so trace ids are this run's alone (Postgres is shared).
fn run_id() -> Result<String, BoxError> {
    let mut b = [0u8; 6];
    getrandom::fill(&mut b).map_err(|e| e.to_string())?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

struct Case {
    kind: &'static str,
    trace: String,
    subject: &'static str,
    fingerprint: String,
    amount: Value,
    /// The HTTP status and envelope `status` of the refusal.
    refusal: (u16, &'static str),
    /// The operation the audit line names: only where the signature proved it.
    names_key: bool,
}

/// The four attempts on one previewed transfer of 10.00 (its fingerprint is `fp`).
fn cases(fp: &str, run: &str) -> Result<Vec<Case>, BoxError> {
    let trace = |kind: &str| format!("sec-{run}-{kind}");
    Ok(vec![
        Case {
            kind: "params_changed",
            trace: trace("params"),
            subject: SUBJECT,
            fingerprint: fp.to_owned(),
            amount: json!("9999.00"),
            refusal: (422, "params_changed"),
            names_key: true,
        },
        Case {
            kind: "cross_subject",
            trace: trace("subject"),
            subject: MALLORY,
            fingerprint: fp.to_owned(),
            amount: json!("10.00"),
            refusal: (403, "forbidden"),
            names_key: true,
        },
        Case {
            kind: "bad_signature",
            trace: trace("forged"),
            subject: SUBJECT,
            fingerprint: resigned(fp, "dev1", "a-secret-that-is-not-the-gateways-0123456789")?,
            amount: json!("10.00"),
            refusal: (400, "fingerprint_invalid"),
            names_key: false,
        },
        Case {
            kind: "unknown_kid",
            trace: trace("kid"),
            subject: SUBJECT,
            fingerprint: resigned(fp, "dev9", E2E_SECRET)?,
            amount: json!("10.00"),
            refusal: (400, "fingerprint_invalid"),
            names_key: false,
        },
    ])
}

async fn attempt(stack: &Stack, c: &Case) -> Result<Answer, BoxError> {
    let headers = [("agent-fingerprint", c.fingerprint.as_str()), ("x-request-id", c.trace.as_str())];
    stack.post("/v1/transfers", c.subject, &transfer(c.amount.clone(), "tampered?"), &headers).await
}

/// `idemd ops events --json`, only this run's (by trace id), once `want` of them are there (at
/// most `within`): the reports are sent without waiting, so they land a moment after the refusal.
async fn audited(stack: &Stack, run: &str, want: usize, within: Duration) -> Result<Vec<Value>, BoxError> {
    let deadline = Instant::now() + within;
    loop {
        let (code, out, err) = idemd_ops(&stack.database_url(), &["events", "--json"])?;
        if code != 0 {
            return Err(format!("idemd ops events exited {code}: {out}{err}").into());
        }
        let all: Vec<Value> = serde_json::from_str(&out)?;
        let mine: Vec<Value> = all
            .into_iter()
            .filter(|e| e["trace_id"].as_str().is_some_and(|t| t.starts_with(&format!("sec-{run}-"))))
            .collect();
        if mine.len() >= want || Instant::now() > deadline {
            return Ok(mine);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Envoy's own record of its calls to idemd (the `idem_sidecar` cluster): sent, cancelled, reset.
async fn sidecar_calls(stack: &Stack) -> Result<String, BoxError> {
    let url = format!("http://127.0.0.1:{}/stats?filter=cluster.idem_sidecar.upstream_(rq|cx)", stack.ports.admin);
    let text = stack.http.get(url).send().await?.text().await?;
    Ok(text.lines().filter(|l| !l.ends_with(": 0")).collect::<Vec<_>>().join(", "))
}

async fn each_kind_is_counted_logged_and_audited(opts: StackOpts) -> TestResult {
    let stack = Stack::start(opts).await?;
    let (_, fp) = stack.preview(json!("10.00")).await?;
    let key = nonce_of(&fp)?;
    let scope = fingerprint_claims(&fp)?["s"].as_str().ok_or("no scope")?.to_owned();
    let run = run_id()?;
    let cases = cases(&fp, &run)?;
    for c in &cases {
        let a = attempt(&stack, c).await?;
        assert_eq!((a.status, a.json["status"].as_str()), (c.refusal.0, Some(c.refusal.1)), "{}: {a:?}", c.kind);
    }

    // Envoy: one count per kind, four in all.
    for c in &cases {
        assert_eq!(stack.stat(&format!("wasmcustom.idem.security.{}", c.kind)).await?, 1, "{}", c.kind);
    }
    assert_eq!(stack.stat("wasmcustom.idem.security_events").await?, 4);

    // Envoy's log: one warning line each, the nonce only where the signature proved it and it is
    // the caller's own (never for another subject's fingerprint).
    let log = stack.filter_log()?;
    for c in &cases {
        let nonce = if c.kind == "params_changed" { key.as_str() } else { "-" };
        let line =
            format!("agent_idempotency security_event={} trace_id={} scope={scope} nonce={nonce}", c.kind, c.trace);
        let found: Vec<&str> = log.lines().filter(|l| l.contains(&line)).collect();
        assert_eq!(found.len(), 1, "{line:?} once in Envoy's log:\n{log}");
        assert!(
            found[0].to_lowercase().contains("warn"),
            "a warning (Envoy's `[warning]`, idemd's `WARN`): {}",
            found[0]
        );
    }
    assert!(!log.contains(&fp), "the fingerprint is never logged");

    // idemd's audit: one line each, with kind, scope, key (where known), subject hash, trace id.
    let events = audited(&stack, &run, 4, Duration::from_secs(10)).await?;
    if events.len() != 4 {
        let calls = sidecar_calls(&stack).await?;
        let idemd = stack.sidecar.log_text();
        return Err(format!(
            "{} of 4 events reached idemd's audit: {events:?}\nEnvoy's calls to idemd: {calls}\nidemd:\n{idemd}\nEnvoy:\n{log}",
            events.len()
        )
        .into());
    }
    for c in &cases {
        let e = events.iter().find(|e| e["trace_id"] == c.trace.as_str()).ok_or(format!("no line for {}", c.kind))?;
        assert_eq!(e["kind"], c.kind, "{e}");
        assert_eq!(e["scope"], scope.as_str(), "{e}");
        assert_eq!(e["actor"], "filter", "{e}");
        assert_eq!(e["subject_hash"], fingerprint::subject_hash(c.subject).as_str(), "the sender's: {e}");
        let want_key = if c.names_key { json!(key) } else { Value::Null };
        assert_eq!(e["key"], want_key, "a forgery's claims are not taken for an operation: {e}");
    }
    // Newest first (by when idemd wrote them: reports that race each other may land in any order).
    let times: Vec<u64> = events.iter().filter_map(|e| e["at_ms"].as_u64()).collect();
    assert!(times.len() == 4 && times.windows(2).all(|w| w[0] >= w[1]), "{events:?}");

    // idemd counted them; nothing was acquired, nothing reached the upstream; the two lines
    // that name the operation are its only audit lines (there is no row).
    let m = stack.idemd_metrics().await?;
    for c in &cases {
        assert_eq!(metric(&m, "idem_security_events_total", &[("kind", c.kind)]), Some(1.0), "{}: {m}", c.kind);
    }
    assert_eq!(metric(&m, "idem_acquire_total", &[]), None, "{m}");
    assert_eq!(counts(&stack).await?, (0, 0));
    assert_eq!(stack.sql_rows(&key).await?, (0, 2));

    // The honest confirm still runs, once; its trail is its acquire and complete after the events.
    let ok = stack
        .post("/v1/transfers", SUBJECT, &transfer(json!("10.00"), "m"), &[("agent-fingerprint", fp.as_str())])
        .await?;
    assert_eq!(ok.status, 201, "{ok:?}");
    assert_eq!(counts(&stack).await?, (1, 1));
    assert_eq!(stack.sql_rows(&key).await?, (1, 4));
    Ok(())
}

#[tokio::test]
async fn each_kind_is_counted_logged_and_audited_on_sqlite() -> TestResult {
    each_kind_is_counted_logged_and_audited(sqlite_only(false)).await
}

#[tokio::test]
async fn each_kind_is_counted_logged_and_audited_on_redis_and_postgres() -> TestResult {
    let Some(opts) = real_stores(false)? else { return Ok(()) };
    each_kind_is_counted_logged_and_audited(opts).await
}

fn signal(stack: &Stack, sig: &str) -> TestResult {
    let pid = stack.sidecar.pid().ok_or("idemd is not running")?;
    let status = std::process::Command::new("kill").arg(format!("-{sig}")).arg(pid.to_string()).status()?;
    if !status.success() {
        return Err(format!("kill -{sig} {pid} failed").into());
    }
    Ok(())
}

/// Resumes a stopped idemd however the test ends (a stopped child would outlive the kill).
struct Resume<'a>(&'a Stack);

impl Drop for Resume<'_> {
    fn drop(&mut self) {
        let _ = signal(self.0, "CONT");
    }
}

/// Every attempt of `cases` with idemd stopped (SIGSTOP: its socket still accepts connections, it
/// answers nothing): each refusal must come at once, far inside the 5 s `sidecar_timeout_ms` a
/// call that waited would take. idemd is resumed before this returns.
async fn refused_at_once_with_idemd_stopped(stack: &Stack, cases: &[Case]) -> TestResult {
    signal(stack, "STOP")?;
    let _resume = Resume(stack);
    for c in cases {
        let started = Instant::now();
        let a = attempt(stack, c).await?;
        let took = started.elapsed();
        assert_eq!((a.status, a.json["status"].as_str()), (c.refusal.0, Some(c.refusal.1)), "{}: {a:?}", c.kind);
        assert!(took < Duration::from_millis(1500), "{} refused after {took:?} with idemd stopped", c.kind);
    }
    Ok(())
}

/// The report is fire and forget: with idemd stopped every refusal still comes at once, and the
/// events are counted in Envoy. (A connection to idemd is open when it stops: the first attempt
/// made one.)
#[tokio::test]
async fn the_refusal_does_not_wait_for_idemd() -> TestResult {
    if in_envoy_only("the filter refuses from its own check and reports later; on ext_proc idemd is the filter")? {
        return Ok(());
    }
    let stack = Stack::start(sqlite_only(false)).await?;
    let (_, fp) = stack.preview(json!("10.00")).await?;
    let cases = cases(&fp, &run_id()?)?;
    assert_eq!(attempt(&stack, &cases[0]).await?.status, 422);
    refused_at_once_with_idemd_stopped(&stack, &cases).await?;
    assert_eq!(stack.stat("wasmcustom.idem.security.params_changed").await?, 2);
    for kind in ["cross_subject", "bad_signature", "unknown_kid"] {
        assert_eq!(stack.stat(&format!("wasmcustom.idem.security.{kind}")).await?, 1, "{kind}");
    }
    assert_eq!(counts(&stack).await?, (0, 0));
    Ok(())
}

/// Not waiting is not dropping: the reports sent while idemd was stopped (for well under the
/// callout timeout) are written once it resumes, though every stream that sent one has ended.
#[tokio::test]
async fn reports_sent_while_idemd_was_stopped_are_audited_when_it_resumes() -> TestResult {
    if in_envoy_only("the filter queues its reports while idemd is stopped; on ext_proc idemd is the filter")? {
        return Ok(());
    }
    let stack = Stack::start(sqlite_only(false)).await?;
    let (_, fp) = stack.preview(json!("10.00")).await?;
    let run = run_id()?;
    let cases = cases(&fp, &run)?;
    refused_at_once_with_idemd_stopped(&stack, &cases).await?;
    let events = audited(&stack, &run, 4, Duration::from_secs(4)).await?;
    let calls = sidecar_calls(&stack).await?;
    assert_eq!(events.len(), 4, "audited after idemd resumed: {events:?}\nEnvoy's calls to idemd: {calls}");
    let m = stack.idemd_metrics().await?;
    assert_eq!(metric(&m, "idem_security_events_total", &[]), Some(4.0), "{m}");
    Ok(())
}
