//! Approval (DESIGN §4, "Approval") on real Envoy, idemd and the demo in `--no-dedup` mode (so
//! every execution the ledger shows is the gateway's doing): a confirm of 1000 or more on
//! `/approve/v1/transfers` waits for a person; approve → the next confirm executes once; reject →
//! `rejected`, replayed; no decision before `exp` → lapsed; an approver may not approve their own
//! subject's operation; a tampered retry while waiting is `params_changed` and changes nothing;
//! concurrent confirms after the approval execute once; idemd killed and restarted while waiting
//! keeps the approval; the same on route rules (the plugin configuration's, istio-like.yaml). Every test
//! asserts what reached the upstream (the demo's ledger).

use idem_e2e::*;
use serde_json::{json, Value};
use std::time::Duration;

/// Approvers: ann and ben, and one whose identity is the agent's own subject.
const ANN: (&str, &str) = ("approver-ann", "ann-approval-credential-0123456789");
const BEN: (&str, &str) = ("approver-ben", "ben-approval-credential-0123456789");
const SELF: (&str, &str) = (SUBJECT, "alice-approval-credential-0123456789");

fn approvers() -> Vec<String> {
    let list = [ANN, BEN, SELF].iter().map(|(n, t)| format!("{n}={t}")).collect::<Vec<_>>().join(",");
    vec![
        "--approvers".into(),
        list,
        "--approval-console-url".into(),
        "https://idemd.example/approvals".into(),
        "--probe-interval-ms".into(),
        "200".into(),
    ]
}

fn with_approvers(mut opts: StackOpts) -> StackOpts {
    opts.sidecar.extra_args.extend(approvers());
    opts
}

async fn preview(stack: &Stack, path: &str, amount: Value) -> Result<String, BoxError> {
    let a = stack.post(path, SUBJECT, &transfer(amount, "preview memo"), &[]).await?;
    Ok(a.json["fingerprint"].as_str().ok_or_else(|| format!("no fingerprint: {a:?}"))?.to_string())
}

async fn confirm_on(stack: &Stack, path: &str, fp: &str, amount: Value, subject: &str) -> Result<Answer, BoxError> {
    stack.post(path, subject, &transfer(amount, "please, ASAP"), &[("agent-fingerprint", fp)]).await
}

async fn confirm(stack: &Stack, fp: &str, amount: Value) -> Result<Answer, BoxError> {
    confirm_on(stack, "/approve/v1/transfers", fp, amount, SUBJECT).await
}

async fn status(stack: &Stack, fp: &str) -> Result<Answer, BoxError> {
    stack.get("/approve/v1/transfers/status", SUBJECT, &[("agent-fingerprint", fp)]).await
}

/// `POST /v1/approvals/{key}` on idemd as `who` (a bearer credential).
async fn decide(stack: &Stack, who: &str, key: &str, decision: &str, reason: &str) -> Result<(u16, Value), BoxError> {
    let r = stack
        .http
        .post(stack.sidecar_url(&format!("/v1/approvals/{key}")))
        .bearer_auth(who)
        .json(&json!({"decision": decision, "reason": reason}))
        .send()
        .await?;
    let status = r.status().as_u16();
    Ok((status, r.json().await.unwrap_or(Value::Null)))
}

async fn awaiting(stack: &Stack, fp: &str, amount: Value) -> Result<String, BoxError> {
    let a = confirm(stack, fp, amount).await?;
    assert_eq!(a.status, 202, "{a:?}");
    a.assert_prompt("approval_required");
    nonce_of(fp)
}

/// A stack (SQLite) with one confirm of `amount` awaiting approval: (stack, fingerprint, key).
async fn one_awaiting(amount: &str) -> Result<(Stack, String, String), BoxError> {
    let stack = Stack::start(with_approvers(sqlite_only(false))).await?;
    let fp = preview(&stack, "/approve/v1/transfers/preview", json!(amount)).await?;
    let key = awaiting(&stack, &fp, json!(amount)).await?;
    Ok((stack, fp, key))
}

/// `n` confirms of `fp` at once; each one's (HTTP status, body).
async fn parallel_confirms(stack: &Stack, fp: &str, amount: &str, n: usize) -> Result<Vec<(u16, Value)>, BoxError> {
    let mut tasks = Vec::new();
    for i in 0..n {
        let (http, url, fp) = (stack.http.clone(), stack.url("/approve/v1/transfers"), fp.to_string());
        let body = transfer(json!(amount), &format!("attempt {i}"));
        tasks.push(tokio::spawn(async move {
            let r = http
                .post(url)
                .header("x-agent-subject", SUBJECT)
                .header("agent-fingerprint", fp)
                .json(&body)
                .send()
                .await?;
            let status = r.status().as_u16();
            Ok::<_, reqwest::Error>((status, r.json().await?))
        }));
    }
    let mut out = Vec::with_capacity(n);
    for t in tasks {
        out.push(t.await??);
    }
    Ok(out)
}

#[tokio::test]
async fn approve_then_the_next_confirm_executes_once() -> TestResult {
    let stack = Stack::start(with_approvers(sqlite_only(false))).await?;
    // Under the threshold the rule does not ask: it executes at once.
    let small = preview(&stack, "/approve/v1/transfers/preview", json!("10.00")).await?;
    assert_eq!(confirm(&stack, &small, json!("10.00")).await?.status, 201);
    assert_eq!(counts(&stack).await?, (1, 1));

    let fp = preview(&stack, "/approve/v1/transfers/preview", json!("5000.00")).await?;
    let a = confirm(&stack, &fp, json!("5000.00")).await?;
    assert_eq!(a.status, 202);
    a.assert_prompt("approval_required");
    let key = nonce_of(&fp)?;
    assert_eq!(a.json["operation"], key.as_str());
    assert_eq!(a.json["poll_with"], "get_transfer_status");
    assert_eq!(a.json["retryable"], false);
    // What awaits approval: the bound fields, canonical; never the memo.
    assert_eq!(a.json["approval"]["fields"], json!({"/amount": 5000, "/currency": "EUR", "/payee_id": "payee-42"}));
    assert_eq!(a.json["approval"]["scope"], "payments.large_transfer");
    assert_eq!(a.json["approval"]["approve_at"], "https://idemd.example/approvals");
    assert!(!a.body.windows(4).any(|w| w == b"ASAP"), "free text never reaches the approver: {a:?}");
    assert_eq!(counts(&stack).await?, (1, 1), "nothing forwarded while awaiting");
    // Retries while waiting get the same answer; the status route says so.
    for _ in 0..3 {
        confirm(&stack, &fp, json!(5000)).await?.assert_prompt("approval_required");
    }
    let s = status(&stack, &fp).await?;
    assert_eq!(s.status, 200);
    s.assert_prompt("awaiting_approval");
    assert_eq!(counts(&stack).await?, (1, 1));
    assert_eq!(stack.sql_rows(&key).await?.0, 0, "no idem_record row before the approval");

    let (code, view) = decide(&stack, ANN.1, &key, "approve", "within the quarterly budget").await?;
    assert_eq!((code, view["state"].as_str()), (200, Some("APPROVED")), "{view}");
    assert_eq!(view["decided_by"], ANN.0);
    // Decided once: a second decision is a conflict, and changes nothing.
    let (code, _) = decide(&stack, BEN.1, &key, "reject", "too late").await?;
    assert_eq!(code, 409);
    status(&stack, &fp).await?.assert_prompt("approved");

    let done = confirm(&stack, &fp, json!("5000.00")).await?;
    assert_eq!(done.status, 201, "{done:?}");
    assert_eq!(done.json["status"], "executed");
    let again = confirm(&stack, &fp, json!("5000.00")).await?;
    again.assert_prompt("already_completed");
    assert_eq!(counts(&stack).await?, (2, 2), "the approved transfer executed once");
    status(&stack, &fp).await?.assert_prompt("already_completed");

    // The audit names the approver; the metrics count the decision.
    let (code, out, err) = idemd_ops(&stack.database_url(), &["show", &key])?;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("approver:approver-ann") && out.contains("AWAITING_APPROVAL"), "{out}");
    let m = stack.idemd_metrics().await?;
    assert_eq!(metric(&m, "idem_approvals_total", &[("event", "awaiting")]), Some(1.0), "{m}");
    assert_eq!(metric(&m, "idem_approvals_total", &[("event", "approved")]), Some(1.0), "{m}");
    assert!(metric(&m, "idem_approval_decision_seconds_count", &[]).is_some_and(|n| n >= 1.0), "{m}");
    assert!(stack.stat("wasmcustom.idem.approval_required").await? >= 4);
    Ok(())
}

#[tokio::test]
async fn reject_is_a_terminal_rejected_replayed_and_nothing_runs() -> TestResult {
    let (stack, fp, key) = one_awaiting("2500.00").await?;
    let (code, view) = decide(&stack, BEN.1, &key, "reject", "payee not on the allow list").await?;
    assert_eq!((code, view["state"].as_str()), (200, Some("REJECTED")), "{view}");
    for _ in 0..3 {
        let a = confirm(&stack, &fp, json!("2500.00")).await?;
        assert_eq!(a.status, 403);
        a.assert_prompt("rejected");
        assert_eq!(a.json["approval"]["reason"], "payee not on the allow list");
        assert_eq!(a.json["retryable"], false);
    }
    let s = status(&stack, &fp).await?;
    assert_eq!(s.status, 200);
    s.assert_prompt("rejected");
    // An approval after the rejection changes nothing.
    assert_eq!(decide(&stack, ANN.1, &key, "approve", "changed my mind").await?.0, 409);
    confirm(&stack, &fp, json!("2500.00")).await?.assert_prompt("rejected");
    assert_eq!(counts(&stack).await?, (0, 0), "nothing reached the upstream");
    assert!(stack.stat("wasmcustom.idem.approval_rejected").await? >= 4);
    Ok(())
}

#[tokio::test]
async fn an_approval_not_given_before_exp_lapses() -> TestResult {
    let stack = Stack::start(with_approvers(sqlite_only(false))).await?;
    let fp = preview(&stack, "/approve/short/v1/transfers/preview", json!("1200.00")).await?;
    let key = awaiting(&stack, &fp, json!("1200.00")).await?;
    tokio::time::sleep(Duration::from_millis(2_600)).await;
    let a = confirm(&stack, &fp, json!("1200.00")).await?;
    assert_eq!(a.status, 410, "{a:?}");
    a.assert_prompt("approval_lapsed");
    assert_eq!(status(&stack, &fp).await?.json["status"], "approval_lapsed");
    // Too late to approve.
    assert_eq!(decide(&stack, ANN.1, &key, "approve", "sorry, I was out").await?.0, 410);
    confirm(&stack, &fp, json!("1200.00")).await?.assert_prompt("approval_lapsed");
    assert_eq!(counts(&stack).await?, (0, 0));
    // The probe's sweep writes the lapse (audited, counted).
    let mut lapsed = None;
    for _ in 0..50 {
        let m = stack.idemd_metrics().await?;
        lapsed = metric(&m, "idem_approvals_total", &[("event", "lapsed")]);
        if lapsed == Some(1.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(lapsed, Some(1.0));
    let (_, out, _) = idemd_ops(&stack.database_url(), &["show", &key])?;
    assert!(out.contains("LAPSED"), "{out}");
    Ok(())
}

#[tokio::test]
async fn an_approver_may_not_approve_their_own_subject_and_the_filter_token_decides_nothing() -> TestResult {
    let (stack, fp, key) = one_awaiting("3000.00").await?;
    let (code, body) = decide(&stack, SELF.1, &key, "approve", "it is mine").await?;
    assert_eq!((code, body["error"].as_str()), (403, Some("own_subject")), "{body}");
    // The filter's token is not an approver's credential; nor is nothing.
    assert_eq!(decide(&stack, SIDECAR_TOKEN, &key, "approve", "the filter says so").await?.0, 401);
    let r = stack
        .http
        .post(stack.sidecar_url(&format!("/v1/approvals/{key}")))
        .json(&json!({"decision": "approve", "reason": "x"}))
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 401);
    // Nor is an approver's credential the filter's: it cannot acquire.
    let r = stack.http.post(stack.sidecar_url("/v1/acquire")).bearer_auth(ANN.1).body("{}").send().await?;
    assert_eq!(r.status().as_u16(), 401);
    // A bad decision is a 400 and decides nothing.
    assert_eq!(decide(&stack, ANN.1, &key, "maybe", "x").await?.0, 400);
    assert_eq!(decide(&stack, ANN.1, &key, "approve", "").await?.0, 400);
    confirm(&stack, &fp, json!("3000.00")).await?.assert_prompt("approval_required");
    assert_eq!(counts(&stack).await?, (0, 0));
    Ok(())
}

#[tokio::test]
async fn nothing_reaches_the_upstream_before_approval_whatever_the_agent_tries() -> TestResult {
    let (stack, fp, key) = one_awaiting("4000.00").await?;
    // A changed amount while waiting: params_changed, and nothing recorded.
    let before = stack.sql_rows(&key).await?;
    let t = confirm(&stack, &fp, json!("400.00")).await?;
    assert_eq!(t.status, 422);
    t.assert_prompt("params_changed");
    assert_eq!(stack.sql_rows(&key).await?.0, before.0, "no idem_record row");
    // Another subject replaying the fingerprint.
    let other = confirm_on(&stack, "/approve/v1/transfers", &fp, json!("4000.00"), "user-mallory").await?;
    assert_eq!(other.status, 403);
    other.assert_prompt("forbidden");
    // The same scope on a route without the rule: idemd's insert refuses the unapproved operation.
    let unruled = confirm_on(&stack, "/unruled/v1/transfers", &fp, json!("4000.00"), SUBJECT).await?;
    assert_eq!(unruled.status, 202, "{unruled:?}");
    unruled.assert_prompt("approval_required");
    // A client's own Idempotency-Key, a repeated fingerprint header.
    let keyed = stack
        .post(
            "/approve/v1/transfers",
            SUBJECT,
            &transfer(json!("4000.00"), "m"),
            &[("agent-fingerprint", &fp), ("idempotency-key", "mine")],
        )
        .await?;
    keyed.assert_prompt("approval_required");
    let twice = stack
        .post(
            "/approve/v1/transfers",
            SUBJECT,
            &transfer(json!("4000.00"), "m"),
            &[("agent-fingerprint", &fp), ("agent-fingerprint", &fp)],
        )
        .await?;
    assert_eq!(twice.status, 400);
    // Parallel confirms while waiting.
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let (http, url, fp) = (stack.http.clone(), stack.url("/approve/v1/transfers"), fp.clone());
        tasks.push(tokio::spawn(async move {
            let r = http
                .post(url)
                .header("x-agent-subject", SUBJECT)
                .header("agent-fingerprint", fp)
                .json(&transfer(json!("4000.00"), "m"))
                .send()
                .await?;
            Ok::<_, reqwest::Error>(r.status().as_u16())
        }));
    }
    for t in tasks {
        assert_eq!(t.await??, 202);
    }
    assert_eq!(counts(&stack).await?, (0, 0), "nothing reached the upstream");
    assert_eq!(stack.sql_rows(&key).await?.0, 0);
    Ok(())
}

/// An operation that already ran before its route asked a person (here the scope's route without
/// the rule, envoy/e2e.yaml's deliberate fixture; in production, a rule added by a reload) is
/// answered from its row on the ruled route: the first result, never "approval required" about a
/// payment that happened, and no approval row for anyone to reject (the model found this).
#[tokio::test]
async fn an_operation_that_ran_before_its_rule_is_answered_from_its_row_never_asked_about() -> TestResult {
    // Without Envoy's replay cache, so the ruled confirm reaches idemd's approval gate.
    let mut opts = with_approvers(sqlite_only(false));
    opts.envoy_edits.push(without_replay_cache());
    let stack = Stack::start(opts).await?;
    let fp = preview(&stack, "/approve/v1/transfers/preview", json!("4200.00")).await?;
    let key = nonce_of(&fp)?;
    let ran = confirm_on(&stack, "/unruled/v1/transfers", &fp, json!("4200.00"), SUBJECT).await?;
    assert_eq!(ran.status, 201, "the route without the rule ran it: {ran:?}");
    assert_eq!(counts(&stack).await?, (1, 1));
    let again = confirm(&stack, &fp, json!("4200.00")).await?;
    assert_eq!((again.status, again.header("idempotent-replayed")), (201, Some("true")), "{again:?}");
    again.assert_prompt("already_completed");
    assert_eq!(stack.stat("wasmcustom.idem.replay_cache_hits").await?, 0, "idemd answered, not the cache");
    let (code, body) = decide(&stack, ANN.1, &key, "reject", "too late to ask").await?;
    assert_eq!(code, 404, "no approval exists to decide: {body}");
    assert_eq!(counts(&stack).await?, (1, 1), "ran once, and only once");
    Ok(())
}

async fn concurrent_confirms_after_approval_execute_once(opts: StackOpts) -> TestResult {
    let stack = Stack::start(with_approvers(opts)).await?;
    let fp = preview(&stack, "/approve/v1/transfers/preview", json!("7500.00")).await?;
    let key = awaiting(&stack, &fp, json!("7500.00")).await?;
    assert_eq!(decide(&stack, ANN.1, &key, "approve", "ok").await?.0, 200);
    let mut executed = 0;
    for (status, body) in parallel_confirms(&stack, &fp, "7500.00", 30).await? {
        match body["status"].as_str() {
            Some("executed") => executed += 1,
            Some("already_completed" | "in_progress") => {}
            other => panic!("unexpected answer {status} {other:?}: {body}"),
        }
    }
    assert_eq!(executed, 1, "exactly one confirm executes");
    assert_eq!(counts(&stack).await?, (1, 1), "one execution, one attempt upstream");
    let m = stack.idemd_metrics().await?;
    assert_eq!(metric(&m, "idem_acquire_total", &[("outcome", "ACQUIRED"), ("mode", "fingerprint")]), Some(1.0), "{m}");
    Ok(())
}

#[tokio::test]
async fn concurrent_confirms_after_approval_execute_once_on_redis_and_postgres() -> TestResult {
    let Some(opts) = real_stores(false)? else { return Ok(()) };
    concurrent_confirms_after_approval_execute_once(opts).await
}

#[tokio::test]
async fn concurrent_confirms_after_approval_execute_once_on_sqlite_only() -> TestResult {
    concurrent_confirms_after_approval_execute_once(sqlite_only(false)).await
}

#[tokio::test]
async fn idemd_killed_and_restarted_while_awaiting_keeps_the_approval() -> TestResult {
    let mut stack = Stack::start(with_approvers(sqlite_only(false))).await?;
    let fp = preview(&stack, "/approve/v1/transfers/preview", json!("6000.00")).await?;
    let key = awaiting(&stack, &fp, json!("6000.00")).await?;
    // A real kill (SIGKILL), then a new process on the same database.
    stack.restart_sidecar().await?;
    confirm(&stack, &fp, json!("6000.00")).await?.assert_prompt("approval_required");
    assert_eq!(decide(&stack, BEN.1, &key, "approve", "after the restart").await?.0, 200);
    stack.restart_sidecar().await?;
    let done = confirm(&stack, &fp, json!("6000.00")).await?;
    assert_eq!(done.status, 201, "{done:?}");
    confirm(&stack, &fp, json!("6000.00")).await?.assert_prompt("already_completed");
    assert_eq!(counts(&stack).await?, (1, 1));
    Ok(())
}

/// Route rules (the plugin configuration's `routes`, the mesh shape of envoy/istio-like.yaml) ask a person just as
/// route metadata does: every fingerprint confirm of the scope carries the rule (one scope, one rule: the HTTP
/// confirm and each MCP route's `execute_transfer`), a large confirm waits with nothing forwarded, and once
/// approved the next confirm executes once.
#[tokio::test]
async fn a_route_rule_asks_a_person_and_the_approved_confirm_executes_once() -> TestResult {
    let rule = json!({"field": "/amount", "gte": "1000"});
    let opts = istio::route_rules_shape(with_approvers(sqlite_only(false)), |config| {
        for r in config["routes"].as_array_mut().into_iter().flatten() {
            if r["role"] == "confirm" {
                r["approval"] = rule.clone();
            }
            for tool in r.get_mut("tools").and_then(Value::as_object_mut).into_iter().flat_map(|t| t.values_mut()) {
                if tool["role"] == "confirm" {
                    tool["approval"] = rule.clone();
                }
            }
        }
    })?;
    let stack = Stack::start(opts).await?;
    let ran = stack.ran("envoy-istio-like.yaml")?;
    assert!(ran.contains("\"routes\":[") && ran.contains("\"approval\":{"), "the rules carry the approval rule");
    assert_eq!(ran.contains("DynamicModuleFilter"), FilterHost::current()?.is_native(), "the build under test runs");

    let fp = preview(&stack, "/v1/transfers/preview", json!("5000.00")).await?;
    let key = nonce_of(&fp)?;
    for _ in 0..2 {
        let a = confirm_on(&stack, "/v1/transfers", &fp, json!("5000.00"), SUBJECT).await?;
        assert_eq!(a.status, 202, "{a:?}");
        a.assert_prompt("approval_required");
        assert_eq!(a.json["approval"]["scope"], "payments.transfer");
    }
    assert_eq!(counts(&stack).await?, (0, 0), "nothing forwarded while awaiting");
    assert_eq!(stack.sql_rows(&key).await?.0, 0, "no idem_record row before the approval");

    let (code, view) = decide(&stack, ANN.1, &key, "approve", "expected invoice").await?;
    assert_eq!((code, view["state"].as_str()), (200, Some("APPROVED")), "{view}");
    let done = confirm_on(&stack, "/v1/transfers", &fp, json!("5000.00"), SUBJECT).await?;
    assert_eq!(done.status, 201, "{done:?}");
    confirm_on(&stack, "/v1/transfers", &fp, json!("5000.00"), SUBJECT).await?.assert_prompt("already_completed");
    assert_eq!(counts(&stack).await?, (1, 1), "the approved transfer executed once");
    Ok(())
}
