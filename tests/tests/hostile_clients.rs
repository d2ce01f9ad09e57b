//! The standing attack suite, part 5: hostile clients, in a real Envoy on both builds
//! (`IDEM_E2E_HOST=native` for the native module). Odd but possible clients on every surface — REST
//! preview/confirm, MCP `tools/call` quote/execute, client keys (`Idempotency-Key` routes), approval,
//! status lookups — and for each what the agent hears (the DESIGN §7 envelope, a 4xx for bad input)
//! and what the demo's ledger shows (nothing executed, or executed once under the nonce).
//!
//! What the other parts already cover is not repeated here: HTTP/2 trailers on REST, MCP and client
//! keys (bypass.rs); repeated guarded headers on REST confirm/preview, client keys and MCP, `_`
//! spellings (bypass_headers.rs); MCP header/body disagreements and duplicate JSON-RPC keys
//! (bypass_mcp.rs); gzip on a REST confirm, chunked REST confirms, duplicate keys in a REST body
//! (bypass_sweep.rs). This part adds:
//!
//! * **odd request ids** (a space, non-ASCII UTF-8, a would-be log field, 4 KiB, empty; a non-UTF-8
//!   byte): a forged fingerprint under each is still audited and counted by idemd, its id made safe
//!   (percent-encoded, cut at 128) in the audit and in idemd's log line, on a
//!   confirm, a status lookup and an MCP execute; on every surface such an id changes no answer and
//!   no execution; and (open) a burst of forgeries leaves every one in the audit, and the filter's
//!   own warning line carries no field a client wrote;
//! * **mixed-case and comma-joined** guarded headers (`Agent-Fingerprint` + `AGENT-FINGERPRINT`, and
//!   the subject, `Idempotency-Key` and `Mcp-Method` likewise, written on the wire; `fp, other` in one
//!   line on confirm, approval and status; a subject with a comma is one subject, bound whole, never
//!   its first item);
//! * **two fingerprints on status lookups and approval confirms** (the header twice; the header and
//!   the query string, the query twice, the header and the body, the body twice);
//! * **content encodings** beyond bypass_sweep's gzipped REST confirm: gzip on a preview, an MCP
//!   execute and an approval confirm, deflate on a confirm (refused unread); `identity`, `br`,
//!   `x-unknown`, `gzip` labels on a plain JSON body (judged as the bytes the upstream gets);
//! * **HTTP/2 trailers** on the approval route and on a valid MCP execute; **chunked** HTTP/1.1
//!   bodies, cut inside the fingerprint and the amount, on MCP, client keys and approval;
//! * **duplicate JSON keys** where the second reading would change the decision: an approval
//!   threshold (10.00 or 5000.00), an MCP execute's amount (7777.77 asks a person), the MCP status
//!   tool's fingerprint;
//! * **empty guarded headers** (fingerprint, subject, `Idempotency-Key`, `Mcp-Method`): no value,
//!   never a pass.
//!
//! A client-key route binds no field, so its body is the upstream's to read (gzip, duplicate keys):
//! the tests assert it is forwarded once and the same bytes under the same key are replayed.
//!
//! Four cases failed when the file was written (a burst of forgeries, a raw request id in the
//! filter's log line, a non-UTF-8 request id on the `.wasm`, a status lookup naming two
//! fingerprints); each ran ignored until its fix, and all run now.

use idem_e2e::bypass::{
    assert_envelope, assert_problem, assert_rpc_error, assert_tool_error, fresh_key, mcp_args, seen, show, tools_call,
    Seen,
};
use idem_e2e::http2::{self, H2Request};
use idem_e2e::wire;
use idem_e2e::*;
use serde_json::{json, Value};
use std::io::Write as _;
use std::time::{Duration, Instant};

// ---------------------------------------------------------------- helpers

/// POST `body` bytes to `path` with exactly `headers` (values as bytes: a non-ASCII request id is
/// sent as its UTF-8), over HTTP/1.1.
async fn post_raw(stack: &Stack, path: &str, headers: &[(&str, &[u8])], body: Vec<u8>) -> Result<Answer, BoxError> {
    let mut map = reqwest::header::HeaderMap::new();
    for (k, v) in headers {
        map.append(
            reqwest::header::HeaderName::from_bytes(k.as_bytes())?,
            reqwest::header::HeaderValue::from_bytes(v)?,
        );
    }
    let r = stack.http.post(stack.url(path)).headers(map).body(body).send().await?;
    read(r).await
}

async fn get_raw(stack: &Stack, path: &str, headers: &[(&str, &[u8])]) -> Result<Answer, BoxError> {
    let mut map = reqwest::header::HeaderMap::new();
    for (k, v) in headers {
        map.append(
            reqwest::header::HeaderName::from_bytes(k.as_bytes())?,
            reqwest::header::HeaderValue::from_bytes(v)?,
        );
    }
    read(stack.http.get(stack.url(path)).headers(map).send().await?).await
}

async fn read(r: reqwest::Response) -> Result<Answer, BoxError> {
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    let body = r.bytes().await?.to_vec();
    let json = serde_json::from_slice(&body).unwrap_or(Value::Null);
    Ok(Answer { status, headers, body, json })
}

/// A JSON POST as alice with `extra` headers (string values).
async fn post(stack: &Stack, path: &str, extra: &[(&str, &str)], body: &Value) -> Result<Answer, BoxError> {
    let mut h: Vec<(&str, &[u8])> =
        vec![("x-agent-subject", SUBJECT.as_bytes()), ("content-type", b"application/json")];
    h.extend(extra.iter().map(|(k, v)| (*k, v.as_bytes())));
    post_raw(stack, path, &h, body.to_string().into_bytes()).await
}

const MCP_HEADERS: [(&str, &str); 2] =
    [("accept", "application/json, text/event-stream"), ("mcp-protocol-version", "2025-06-18")];

/// A JSON-RPC message to `/mcp` as alice (JSON answers), with `extra` headers and `body` as is.
async fn mcp_bytes(stack: &Stack, extra: &[(&str, &[u8])], body: Vec<u8>) -> Result<Answer, BoxError> {
    let mut h: Vec<(&str, &[u8])> =
        vec![("x-agent-subject", SUBJECT.as_bytes()), ("content-type", b"application/json")];
    h.extend(MCP_HEADERS.iter().map(|(k, v)| (*k, v.as_bytes())));
    h.extend_from_slice(extra);
    post_raw(stack, "/mcp", &h, body).await
}

async fn mcp(stack: &Stack, extra: &[(&str, &str)], body: &Value) -> Result<Answer, BoxError> {
    let extra: Vec<(&str, &[u8])> = extra.iter().map(|(k, v)| (*k, v.as_bytes())).collect();
    mcp_bytes(stack, &extra, body.to_string().into_bytes()).await
}

/// The fingerprint of an MCP quote's result.
fn quoted(a: &Answer) -> Result<String, BoxError> {
    Ok(a.json["result"]["structuredContent"]["fingerprint"]
        .as_str()
        .ok_or_else(|| format!("no fingerprint in the quote: {}", show(a)))?
        .to_owned())
}

/// The ledger's executions under `key` (the nonce, or the key a client key derives).
async fn ran(stack: &Stack, key: &str) -> Result<u64, BoxError> {
    Ok(stack.executions().await?["by_key"][key].as_u64().unwrap_or(0))
}

fn gzip(bytes: &[u8]) -> Result<Vec<u8>, BoxError> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(bytes)?;
    Ok(gz.finish()?)
}

fn zlib(bytes: &[u8]) -> Result<Vec<u8>, BoxError> {
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    z.write_all(bytes)?;
    Ok(z.finish()?)
}

/// A few random hex characters: this run's own trace ids.
fn run_id() -> String {
    fresh_key("r").trim_start_matches("r-").to_owned()
}

/// The same fingerprint with one character of its signature changed: a forgery (`bad_signature`).
fn forged(fp: &str) -> Result<String, BoxError> {
    let (payload, sig) = fp.split_once('.').ok_or("no signature")?;
    let mut s: Vec<char> = sig.chars().collect();
    let at = s.len() / 2;
    s[at] = if s[at] == 'A' { 'B' } else { 'A' };
    Ok(format!("{payload}.{}", s.into_iter().collect::<String>()))
}

/// Approvers of the approval stacks: ann (and the filter's token decides nothing).
const ANN: (&str, &str) = ("approver-ann", "ann-approval-credential-0123456789");

fn with_approvers(mut opts: StackOpts) -> StackOpts {
    opts.sidecar.extra_args.extend([
        "--approvers".to_owned(),
        format!("{}={}", ANN.0, ANN.1),
        "--approval-console-url".to_owned(),
        "https://idemd.example/approvals".to_owned(),
    ]);
    opts
}

/// The operations awaiting a person (idemd's `/v1/approvals`, as ann).
async fn pending(stack: &Stack) -> Result<Vec<Value>, BoxError> {
    let r = stack.http.get(stack.sidecar_url("/v1/approvals")).bearer_auth(ANN.1).send().await?;
    let v: Value = r.json().await?;
    Ok(v["pending"].as_array().cloned().unwrap_or_default())
}

async fn approve(stack: &Stack, key: &str) -> TestResult {
    let r = stack
        .http
        .post(stack.sidecar_url(&format!("/v1/approvals/{key}")))
        .bearer_auth(ANN.1)
        .json(&json!({"decision": "approve", "reason": "checked with the customer"}))
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 200, "approve: {}", r.text().await?);
    Ok(())
}

// ---------------------------------------------------------------- odd request ids: security events

/// `idemd ops events --json` of this stack (its own SQLite), once `want` are there (at most `within`).
async fn events(stack: &Stack, want: usize, within: Duration) -> Result<Vec<Value>, BoxError> {
    let deadline = Instant::now() + within;
    loop {
        let (code, out, err) = idemd_ops(&stack.database_url(), &["events", "--json"])?;
        if code != 0 {
            return Err(format!("idemd ops events exited {code}: {out}{err}").into());
        }
        let all: Vec<Value> = serde_json::from_str(&out)?;
        if all.len() >= want || Instant::now() > deadline {
            return Ok(all);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A forged fingerprint sent with an `x-request-id` holding a space, non-ASCII
/// characters, a would-be log field, or 4 KiB (on a confirm; and on a status lookup and an MCP
/// execute): each refusal is reported, and idemd records every one (an audit line, a count) with the
/// id made safe — percent-encoded, cut at 128 — in the audit and in its log line. It once refused the whole report (the id was not "printable ASCII without
/// spaces"), so the forgery left no trace in idemd.
#[tokio::test]
async fn a_forgery_under_an_odd_request_id_is_audited_and_counted() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let (_, fp) = stack.preview(json!("10.00")).await?;
    let fake = forged(&fp)?;
    let run = run_id();
    let long = format!("{run}-{}", "l".repeat(4096));
    // (x-request-id as sent, the envelope's trace_id, the audit's trace_id)
    let cases: Vec<(String, String, String)> = vec![
        (format!("{run} odd id"), format!("{run} odd id"), format!("{run}%20odd%20id")),
        (format!("{run}-café-中"), format!("{run}-café-中"), format!("{run}-caf%C3%A9-%E4%B8%AD")),
        (
            format!("{run} security_event=none scope=\"x\""),
            format!("{run} security_event=none scope=\"x\""),
            format!("{run}%20security_event=none%20scope=\"x\""),
        ),
        (long.clone(), long[..128].to_owned(), long[..128].to_owned()),
    ];
    let q = mcp(&stack, &[], &tools_call(json!(1), "quote_transfer", mcp_args("10.00", "payee-42", None))).await?;
    let mcp_fake = forged(&quoted(&q)?)?;
    let before = seen(&stack).await?;
    // One at a time: a burst is its own test (a_burst_of_forgeries_leaves_every_one_in_the_audit).
    let mut written = 0;
    for (rid, echoed, _) in &cases {
        let h: [(&str, &[u8]); 4] = [
            ("x-agent-subject", SUBJECT.as_bytes()),
            ("content-type", b"application/json"),
            ("agent-fingerprint", fake.as_bytes()),
            ("x-request-id", rid.as_bytes()),
        ];
        let a = post_raw(&stack, "/v1/transfers", &h, transfer(json!("10.00"), "m").to_string().into_bytes()).await?;
        assert_envelope(&a, 400, "fingerprint_invalid");
        assert_eq!(a.json["trace_id"], echoed.as_str(), "the agent's reference is its own id: {}", show(&a));
        written += 1;
        events(&stack, written, Duration::from_secs(10)).await?;
    }
    // The same on the other surfaces that verify a fingerprint: a status lookup, an MCP execute.
    let mut cases = cases;
    let rid = format!("{run} status lookup é");
    let h: [(&str, &[u8]); 3] = [
        ("x-agent-subject", SUBJECT.as_bytes()),
        ("agent-fingerprint", fake.as_bytes()),
        ("x-request-id", rid.as_bytes()),
    ];
    assert_envelope(&get_raw(&stack, "/v1/transfers/status", &h).await?, 400, "fingerprint_invalid");
    cases.push((rid.clone(), rid, format!("{run}%20status%20lookup%20%C3%A9")));
    events(&stack, written + 1, Duration::from_secs(10)).await?;
    let rid = format!("{run} mcp execute");
    let call = tools_call(json!(2), "execute_transfer", mcp_args("10.00", "payee-42", Some(&mcp_fake)));
    assert_tool_error(&mcp(&stack, &[("x-request-id", &rid)], &call).await?, "fingerprint_invalid");
    cases.push((rid.clone(), rid, format!("{run}%20mcp%20execute")));
    seen(&stack).await?.assert_same(before, "forgeries");
    let n = cases.len();
    assert_eq!(stack.stat("wasmcustom.idem.security.bad_signature").await?, n as u64);

    let all = events(&stack, n, Duration::from_secs(10)).await?;
    let mut audited: Vec<&str> = all.iter().filter_map(|e| e["trace_id"].as_str()).collect();
    let mut wanted: Vec<&str> = cases.iter().map(|(_, _, safe)| safe.as_str()).collect();
    audited.sort_unstable();
    wanted.sort_unstable();
    if audited != wanted {
        let url = format!("http://127.0.0.1:{}/stats?filter=cluster.idem_sidecar.upstream_(rq|cx)", stack.ports.admin);
        let calls = stack.http.get(url).send().await?.text().await?;
        let calls: Vec<&str> = calls.lines().filter(|l| !l.ends_with(": 0")).collect();
        let envoy = stack.envoy.log_text();
        let lines: Vec<&str> = envoy.lines().filter(|l| l.contains("security_event") || l.contains("error")).collect();
        return Err(format!(
            "one audit line each, the id made safe:\naudited {audited:?}\nwanted  {wanted:?}\nEnvoy's calls to idemd: \
             {calls:?}\nEnvoy:\n{}\nidemd:\n{}",
            lines.join("\n"),
            stack.sidecar.log_text()
        )
        .into());
    }
    assert!(all.iter().all(|e| e["kind"] == "bad_signature" && e["actor"] == "filter"), "{all:?}");
    let m = stack.idemd_metrics().await?;
    assert_eq!(metric(&m, "idem_security_events_total", &[("kind", "bad_signature")]), Some(n as f64), "{m}");

    // idemd's log line carries the safe id: no space, so no field a client wrote.
    let log = stack.sidecar.log_text();
    for (_, _, safe) in &cases {
        let line =
            log.lines().find(|l| l.contains("security event reported") && l.contains(&format!("trace_id={safe}")));
        assert!(line.is_some(), "trace_id={safe} in idemd's log:\n{log}");
    }
    assert!(!log.contains("security_event=none scope"), "a client's words never became log fields:\n{log}");
    Ok(())
}

/// The filter's own warning line (`agent_idempotency security_event=… trace_id=… scope=… nonce=…`)
/// once printed the request id raw: a client that sent `x-request-id: r1 security_event=none scope=x`
/// wrote fields into the line a log pipeline parses (Envoy's log, on both builds). It carries the id
/// in the form idemd's audit and log line use: one rule, `idem_core::trace::safe_id`, for both.
#[tokio::test]
async fn the_filters_warning_line_carries_no_field_a_client_wrote() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let (_, fp) = stack.preview(json!("10.00")).await?;
    let rid = format!("{} security_event=none scope=elsewhere nonce=0", run_id());
    let h = [("agent-fingerprint", forged(&fp)?), ("x-request-id", rid.clone())];
    let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
    assert_envelope(
        &post(&stack, "/v1/transfers", &h, &transfer(json!("10.00"), "m")).await?,
        400,
        "fingerprint_invalid",
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let log = stack.filter_log()?;
    let lines: Vec<&str> =
        log.lines().filter(|l| l.contains("agent_idempotency security_event=bad_signature")).collect();
    assert_eq!(lines.len(), 1, "one warning line:\n{log}");
    // Fields are space-separated: the client's words stay inside the one trace_id value (`%20…`).
    assert!(!lines[0].contains(" security_event=none"), "a client's words became fields: {}", lines[0]);
    assert!(lines[0].contains("%20security_event=none%20scope=elsewhere"), "the id, made safe: {}", lines[0]);
    Ok(())
}

/// A client never decides whether its forgeries are written: idemd writes at most `MAX_EVENT_WRITES`
/// (4) audit lines at once, and the rest wait their turn (`MAX_QUEUED_EVENTS`), where they were
/// only counted before (`idem_security_events_unrecorded_total`), so a few forgeries sent back to
/// back (each answered at once; the reports overlap while SQLite writes) left lines out of the
/// audit, and the one that matters could hide among junk ones (6 sequential forgeries in 20 ms on
/// the native module: 4 lines).
#[tokio::test]
async fn a_burst_of_forgeries_leaves_every_one_in_the_audit() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let (_, fp) = stack.preview(json!("10.00")).await?;
    let fake = forged(&fp)?;
    let n = 12;
    for i in 0..n {
        let rid = format!("burst-{i}");
        let a = post(
            &stack,
            "/v1/transfers",
            &[("agent-fingerprint", &fake), ("x-request-id", &rid)],
            &transfer(json!("10.00"), "m"),
        )
        .await?;
        assert_envelope(&a, 400, "fingerprint_invalid");
    }
    let all = events(&stack, n, Duration::from_secs(10)).await?;
    let m = stack.idemd_metrics().await?;
    assert_eq!(metric(&m, "idem_security_events_total", &[("kind", "bad_signature")]), Some(n as f64), "{m}");
    assert_eq!(
        all.len(),
        n,
        "every forgery in the audit; unrecorded: {:?}",
        metric(&m, "idem_security_events_unrecorded_total", &[])
    );
    Ok(())
}

/// An empty `x-request-id`: Envoy may replace it with its own; either way the forgery is recorded.
#[tokio::test]
async fn a_forgery_under_an_empty_request_id_is_audited_and_counted() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let (_, fp) = stack.preview(json!("10.00")).await?;
    let h = [("agent-fingerprint", forged(&fp)?), ("x-request-id", String::new())];
    let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let a = post(&stack, "/v1/transfers", &h, &transfer(json!("10.00"), "m")).await?;
    assert_envelope(&a, 400, "fingerprint_invalid");
    let all = events(&stack, 1, Duration::from_secs(10)).await?;
    assert_eq!(all.len(), 1, "{all:?}");
    let m = stack.idemd_metrics().await?;
    assert_eq!(metric(&m, "idem_security_events_total", &[("kind", "bad_signature")]), Some(1.0), "{m}");
    assert_eq!(counts(&stack).await?, (0, 0));
    Ok(())
}

/// A request id with a byte that is not UTF-8 (obs-text, which HTTP/1.1 allows in a value): the
/// filter must still refuse the forgery as `fingerprint_invalid`, report it, and keep serving.
/// idemd takes any report; the filter reads header values as bytes (a `.wasm` once panicked here:
/// proxy-wasm's getter decodes UTF-8 with an unwrap).
#[tokio::test]
async fn a_forgery_under_a_non_utf8_request_id_is_audited_and_counted() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let (_, fp) = stack.preview(json!("10.00")).await?;
    let fake = forged(&fp)?;
    let body = transfer(json!("10.00"), "m").to_string().into_bytes();
    let head = [
        b"POST /v1/transfers HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n".to_vec(),
        format!("x-agent-subject: {SUBJECT}\r\ncontent-type: application/json\r\nagent-fingerprint: {fake}\r\n")
            .into_bytes(),
        b"x-request-id: caf\xe9-\xff\xfe\r\n".to_vec(),
        format!("content-length: {}\r\n\r\n", body.len()).into_bytes(),
    ]
    .concat();
    let before = seen(&stack).await?;
    let x = wire::exchange(stack.ports.listener, &[head, body].concat(), false, Duration::from_secs(10)).await?;
    let a = x.answer.ok_or("no answer to the forgery")?;
    if a.status != 400 {
        let log = stack.envoy.log_text();
        let tail: Vec<&str> = log.lines().rev().take(15).collect::<Vec<_>>().into_iter().rev().collect();
        return Err(format!("{}\nEnvoy's log ends:\n{}", show(&a), tail.join("\n")).into());
    }
    assert_envelope(&a, 400, "fingerprint_invalid");
    seen(&stack).await?.assert_same(before, "a forgery under a non-UTF-8 id");
    let all = events(&stack, 1, Duration::from_secs(10)).await?;
    assert_eq!(all.len(), 1, "audited: {all:?}\nidemd:\n{}", stack.sidecar.log_text());
    let trace = all[0]["trace_id"].as_str().unwrap_or("");
    assert!(trace.bytes().all(|b| b.is_ascii_graphic()), "a safe id: {trace:?}");
    let m = stack.idemd_metrics().await?;
    assert_eq!(metric(&m, "idem_security_events_total", &[("kind", "bad_signature")]), Some(1.0), "{m}");
    // The worker still serves: a preview mints.
    stack.preview(json!("11.00")).await?;
    Ok(())
}

// ---------------------------------------------------------------- odd request ids on every surface

/// Under each odd request id, every surface answers as it does under a plain one, and the ledger
/// shows each confirm executed once: REST preview, confirm, retry and status; an MCP quote and
/// execute; a client key and its retry; an approval confirm (waits, executes nothing).
#[tokio::test]
async fn odd_request_ids_change_nothing_on_any_surface() -> TestResult {
    let stack = Stack::start(with_approvers(sqlite_only(false))).await?;
    let run = run_id();
    let ids = [
        format!("{run} with spaces"),
        format!("{run}-Grüße-日本"),
        format!("{run}-{}", "z".repeat(4096)),
        String::new(),
    ];
    for (i, rid) in ids.iter().enumerate() {
        let id = [("x-request-id", rid.as_str())];
        let amount = format!("{}.00", 100 + i);
        // REST
        let p = post(&stack, "/v1/transfers/preview", &id, &transfer(json!(amount), "m")).await?;
        assert_eq!(p.status, 200, "{rid:.40}: {}", show(&p));
        let fp = p.json["fingerprint"].as_str().ok_or_else(|| format!("no fingerprint: {}", show(&p)))?.to_owned();
        let with_fp = [("x-request-id", rid.as_str()), ("agent-fingerprint", fp.as_str())];
        let c = post(&stack, "/v1/transfers", &with_fp, &transfer(json!(amount), "m")).await?;
        assert_eq!(c.status, 201, "{rid:.40}: {}", show(&c));
        let again = post(&stack, "/v1/transfers", &with_fp, &transfer(json!(amount), "m")).await?;
        assert_envelope(&again, 201, "already_completed");
        let h: Vec<(&str, &[u8])> =
            with_fp.iter().map(|(k, v)| (*k, v.as_bytes())).chain([("x-agent-subject", SUBJECT.as_bytes())]).collect();
        let s = get_raw(&stack, "/v1/transfers/status", &h).await?;
        assert_envelope(&s, 200, "already_completed");
        assert_eq!(ran(&stack, &nonce_of(&fp)?).await?, 1, "{rid:.40}");
        if !rid.is_empty() {
            let echoed: String = rid
                .chars()
                .scan(0, |n, c| {
                    *n += c.len_utf8();
                    (*n <= 128).then_some(c)
                })
                .collect();
            assert_eq!(again.json["trace_id"], echoed.as_str(), "the reply names the caller's id (clipped)");
        }
        // MCP
        let q = mcp(&stack, &id, &tools_call(json!(1), "quote_transfer", mcp_args(&amount, "payee-42", None))).await?;
        let mfp = quoted(&q)?;
        let e = mcp(&stack, &id, &tools_call(json!(2), "execute_transfer", mcp_args(&amount, "payee-42", Some(&mfp))))
            .await?;
        assert_eq!(e.json["result"]["isError"], false, "{rid:.40}: {}", show(&e));
        assert_eq!(ran(&stack, &nonce_of(&mfp)?).await?, 1, "{rid:.40}");
        // Client key
        let key = fresh_key("odd-id");
        let with_key = [("x-request-id", rid.as_str()), ("idempotency-key", key.as_str())];
        let k1 = post(&stack, "/programs/v1/transfers", &with_key, &transfer(json!(amount), "invoice")).await?;
        assert_eq!(k1.status, 201, "{rid:.40}: {}", show(&k1));
        let k2 = post(&stack, "/programs/v1/transfers", &with_key, &transfer(json!(amount), "invoice")).await?;
        assert_eq!((k2.status, k2.body.clone()), (201, k1.body.clone()), "replayed: {}", show(&k2));
        // Approval: waits, nothing executes.
        let ap = post(&stack, "/approve/v1/transfers/preview", &id, &transfer(json!("5000.00"), "m")).await?;
        let afp = ap.json["fingerprint"].as_str().ok_or_else(|| format!("no fingerprint: {}", show(&ap)))?.to_owned();
        let with_afp = [("x-request-id", rid.as_str()), ("agent-fingerprint", afp.as_str())];
        let ac = post(&stack, "/approve/v1/transfers", &with_afp, &transfer(json!("5000.00"), "m")).await?;
        assert_envelope(&ac, 202, "approval_required");
        assert_eq!(ran(&stack, &nonce_of(&afp)?).await?, 0);
    }
    // Per id: a REST confirm, an MCP execute and a client key, once each.
    assert_eq!(counts(&stack).await?, (3 * ids.len() as u64, 3 * ids.len() as u64));
    assert_eq!(pending(&stack).await?.len(), ids.len());
    Ok(())
}

// ---------------------------------------------------------------- comma-joined and mixed-case headers

/// HTTP/1.1 written by hand (header names spelt as given), one request per connection.
async fn wire_post(stack: &Stack, path: &str, lines: &[String], body: &[u8]) -> Result<Answer, BoxError> {
    let mut l = lines.to_vec();
    l.push(format!("content-length: {}", body.len()));
    l.push("connection: close".to_owned());
    let bytes = [wire::head("POST", path, &l), body.to_vec()].concat();
    let x = wire::exchange(stack.ports.listener, &bytes, false, Duration::from_secs(10)).await?;
    x.answer.ok_or_else(|| format!("no answer on {path}").into())
}

/// Header names are case-insensitive: `Agent-Fingerprint` and `AGENT-FINGERPRINT` are one header
/// twice, and so are `X-Agent-Subject`/`x-agent-subject`, `Idempotency-Key`/`IDEMPOTENCY-KEY`,
/// `Mcp-Method`/`MCP-METHOD`. A 400, nothing forwarded.
#[tokio::test]
async fn mixed_case_spellings_of_a_guarded_header_are_one_header_twice() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let (_, fp) = stack.preview(json!("51.00")).await?;
    let (_, other) = stack.preview(json!("9999.00")).await?;
    let body = transfer(json!("51.00"), "m").to_string().into_bytes();
    let ct = "Content-Type: application/json".to_owned();
    let before = seen(&stack).await?;
    for (a, b) in [(&fp, &other), (&fp, &fp)] {
        let l = [
            format!("X-Agent-Subject: {SUBJECT}"),
            ct.clone(),
            format!("Agent-Fingerprint: {a}"),
            format!("AGENT-FINGERPRINT: {b}"),
        ];
        assert_envelope(&wire_post(&stack, "/v1/transfers", &l, &body).await?, 400, "fingerprint_invalid");
    }
    let l = [
        format!("X-Agent-Subject: {SUBJECT}"),
        "x-agent-SUBJECT: user-mallory".to_owned(),
        ct.clone(),
        format!("Agent-Fingerprint: {fp}"),
    ];
    assert_envelope(&wire_post(&stack, "/v1/transfers", &l, &body).await?, 400, "invalid_header");
    let l = [
        format!("X-Agent-Subject: {SUBJECT}"),
        ct.clone(),
        format!("Idempotency-Key: {}", fresh_key("a")),
        format!("IDEMPOTENCY-KEY: {}", fresh_key("b")),
    ];
    assert_problem(&wire_post(&stack, "/programs/v1/transfers", &l, &body).await?, 400, "idempotency-key-invalid");
    let call = tools_call(json!(3), "execute_transfer", mcp_args("9999.00", "payee-mallory", None)).to_string();
    let l = [
        format!("X-Agent-Subject: {SUBJECT}"),
        ct.clone(),
        "Accept: application/json, text/event-stream".to_owned(),
        format!("Idempotency-Key: {}", fresh_key("mcp")),
        "Mcp-Method: tools/call".to_owned(),
        "MCP-METHOD: tools/list".to_owned(),
    ];
    assert_rpc_error(&wire_post(&stack, "/mcp", &l, call.as_bytes()).await?, 400, -32020);
    seen(&stack).await?.assert_same(before, "mixed-case repeats");
    // The control: one header in any case is the header.
    let l = [format!("x-AGENT-subject: {SUBJECT}"), ct, format!("aGeNt-FiNgErPrInT: {fp}")];
    let a = wire_post(&stack, "/v1/transfers", &l, &body).await?;
    assert_eq!(a.status, 201, "{}", show(&a));
    assert_eq!(ran(&stack, &nonce_of(&fp)?).await?, 1);
    Ok(())
}

/// Two fingerprints joined in one line (`fp, other`, or `fp, fp`) are no fingerprint: 400, on the
/// confirm, the approval confirm and the status lookup. A subject with a comma is one subject, bound
/// whole: alice's fingerprint under `user-alice, user-mallory` (or the other order) is another
/// subject's (403), never read as its first item.
#[tokio::test]
async fn comma_joined_fingerprints_and_subjects_are_never_split() -> TestResult {
    let stack = Stack::start(with_approvers(sqlite_only(false))).await?;
    let (_, fp) = stack.preview(json!("52.00")).await?;
    let (_, other) = stack.preview(json!("9999.00")).await?;
    let ap = post(&stack, "/approve/v1/transfers/preview", &[], &transfer(json!("5000.00"), "m")).await?;
    let afp = ap.json["fingerprint"].as_str().ok_or("no approval fingerprint")?.to_owned();
    let before = seen(&stack).await?;
    for joined in [format!("{fp}, {other}"), format!("{fp}, {fp}"), format!("{fp},{fp}")] {
        let h = [("agent-fingerprint", joined.as_str())];
        assert_envelope(
            &post(&stack, "/v1/transfers", &h, &transfer(json!("52.00"), "m")).await?,
            400,
            "fingerprint_invalid",
        );
        let s = stack.get("/v1/transfers/status", SUBJECT, &h).await?;
        assert_envelope(&s, 400, "fingerprint_invalid");
    }
    let joined = format!("{afp}, {afp}");
    let a = post(&stack, "/approve/v1/transfers", &[("agent-fingerprint", &joined)], &transfer(json!("5000.00"), "m"))
        .await?;
    assert_envelope(&a, 400, "fingerprint_invalid");
    assert!(pending(&stack).await?.is_empty(), "no person asked about a request that named no fingerprint");
    for subject in
        [format!("{SUBJECT}, user-mallory"), format!("user-mallory, {SUBJECT}"), format!("{SUBJECT},{SUBJECT}")]
    {
        let a = stack
            .post("/v1/transfers", &subject, &transfer(json!("52.00"), "m"), &[("agent-fingerprint", &fp)])
            .await?;
        assert_envelope(&a, 403, "forbidden");
    }
    seen(&stack).await?.assert_same(before, "comma-joined fingerprints and subjects");
    // A preview under such a subject binds the whole string: alice alone cannot confirm it.
    let joint = format!("{SUBJECT}, user-mallory");
    let p = stack.post("/v1/transfers/preview", &joint, &transfer(json!("53.00"), "m"), &[]).await?;
    let jfp = p.json["fingerprint"].as_str().ok_or_else(|| format!("no fingerprint: {}", show(&p)))?.to_owned();
    let a =
        stack.post("/v1/transfers", SUBJECT, &transfer(json!("53.00"), "m"), &[("agent-fingerprint", &jfp)]).await?;
    assert_envelope(&a, 403, "forbidden");
    let a = stack.post("/v1/transfers", &joint, &transfer(json!("53.00"), "m"), &[("agent-fingerprint", &jfp)]).await?;
    assert_eq!(a.status, 201, "{}", show(&a));
    assert_eq!(counts(&stack).await?, (1, 1));
    Ok(())
}

// ---------------------------------------------------------------- status lookups and approval: two fingerprints

/// A status lookup with the fingerprint header twice (different, or the same twice; HTTP/1.1 and
/// HTTP/2; the plain and the approval status route) is refused (400), never answered about one.
#[tokio::test]
async fn a_status_lookup_with_two_header_fingerprints_is_refused() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let (_, done) = stack.preview(json!("54.00")).await?;
    let (_, fresh) = stack.preview(json!("55.00")).await?;
    let c =
        stack.post("/v1/transfers", SUBJECT, &transfer(json!("54.00"), "m"), &[("agent-fingerprint", &done)]).await?;
    assert_eq!(c.status, 201, "{}", show(&c));
    let before = seen(&stack).await?;
    for pair in [[&done, &fresh], [&fresh, &done], [&done, &done]] {
        let h: [(&str, &[u8]); 3] = [
            ("x-agent-subject", SUBJECT.as_bytes()),
            ("agent-fingerprint", pair[0].as_bytes()),
            ("agent-fingerprint", pair[1].as_bytes()),
        ];
        for path in ["/v1/transfers/status", "/approve/v1/transfers/status"] {
            assert_envelope(&get_raw(&stack, path, &h).await?, 400, "fingerprint_invalid");
        }
        let req = H2Request { method: "GET".into(), path: "/v1/transfers/status".into(), ..Default::default() }
            .header("x-agent-subject", SUBJECT)
            .header("agent-fingerprint", pair[0])
            .header("agent-fingerprint", pair[1]);
        assert_envelope(&http2::send(stack.ports.listener, &req).await?.answer, 400, "fingerprint_invalid");
    }
    seen(&stack).await?.assert_same(before, "status lookups naming two fingerprints");
    Ok(())
}

/// The fingerprint in the header and another in the query string or the body, the query naming two,
/// the body naming two (duplicate key): which operation is meant depends on who reads, so neither
/// is. The filter once picked one (header, else the query's first, else the body's last: serde's
/// lenient parse where the confirm path refuses duplicate keys) and told the agent about it, e.g.
/// `already_completed` for a lookup whose query named a fingerprint that never ran.
#[tokio::test]
async fn a_status_lookup_with_a_second_fingerprint_in_query_or_body_is_refused() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let (_, done) = stack.preview(json!("56.00")).await?;
    let (_, fresh) = stack.preview(json!("57.00")).await?;
    let c =
        stack.post("/v1/transfers", SUBJECT, &transfer(json!("56.00"), "m"), &[("agent-fingerprint", &done)]).await?;
    assert_eq!(c.status, 201, "{}", show(&c));
    let mut failures = Vec::new();
    for (a, b) in [(&done, &fresh), (&fresh, &done)] {
        let header =
            stack.get(&format!("/v1/transfers/status?fingerprint={b}"), SUBJECT, &[("agent-fingerprint", a)]).await?;
        let query = stack.get(&format!("/v1/transfers/status?fingerprint={a}&fingerprint={b}"), SUBJECT, &[]).await?;
        let body = stack
            .post("/v1/transfers/status", SUBJECT, &json!({"fingerprint": b}), &[("agent-fingerprint", a)])
            .await?;
        let dup = format!(r#"{{"fingerprint":"{a}","fingerprint":"{b}"}}"#).into_bytes();
        let h: [(&str, &[u8]); 2] = [("x-agent-subject", SUBJECT.as_bytes()), ("content-type", b"application/json")];
        let dup = post_raw(&stack, "/v1/transfers/status", &h, dup).await?;
        for (what, r) in
            [("header + query", header), ("query twice", query), ("header + body", body), ("body twice", dup)]
        {
            if r.status != 400 {
                failures.push(format!("{what}: {}", show(&r)));
            }
        }
    }
    assert!(failures.is_empty(), "answered about one of two fingerprints:\n{}", failures.join("\n"));
    Ok(())
}

/// Approval: two fingerprints (a small transfer's and a large one's) or two subjects on the
/// approval confirm are refused before any person is asked, and nothing runs.
#[tokio::test]
async fn repeated_guarded_headers_on_an_approval_confirm_ask_nobody() -> TestResult {
    let stack = Stack::start(with_approvers(sqlite_only(false))).await?;
    let small = post(&stack, "/approve/v1/transfers/preview", &[], &transfer(json!("10.00"), "m")).await?;
    let large = post(&stack, "/approve/v1/transfers/preview", &[], &transfer(json!("5000.00"), "m")).await?;
    let (small, large) = (
        small.json["fingerprint"].as_str().ok_or("no fingerprint")?.to_owned(),
        large.json["fingerprint"].as_str().ok_or("no fingerprint")?.to_owned(),
    );
    let before = seen(&stack).await?;
    for (amount, pair) in [("10.00", [&small, &large]), ("5000.00", [&large, &small]), ("5000.00", [&large, &large])] {
        let h: [(&str, &[u8]); 4] = [
            ("x-agent-subject", SUBJECT.as_bytes()),
            ("content-type", b"application/json"),
            ("agent-fingerprint", pair[0].as_bytes()),
            ("agent-fingerprint", pair[1].as_bytes()),
        ];
        let a = post_raw(&stack, "/approve/v1/transfers", &h, transfer(json!(amount), "m").to_string().into_bytes())
            .await?;
        assert_envelope(&a, 400, "fingerprint_invalid");
    }
    let h: [(&str, &[u8]); 4] = [
        ("x-agent-subject", SUBJECT.as_bytes()),
        ("x-agent-subject", b"user-mallory"),
        ("content-type", b"application/json"),
        ("agent-fingerprint", large.as_bytes()),
    ];
    let a =
        post_raw(&stack, "/approve/v1/transfers", &h, transfer(json!("5000.00"), "m").to_string().into_bytes()).await?;
    assert_envelope(&a, 400, "invalid_header");
    assert!(pending(&stack).await?.is_empty(), "nobody was asked");
    seen(&stack).await?.assert_same(before, "repeated headers on the approval confirm");
    Ok(())
}

// ---------------------------------------------------------------- content encodings

/// A gzipped body on every surface the REST confirm's test (bypass_sweep.rs) does not reach: the
/// filter cannot read it, so it refuses it (4xx) and forwards nothing — a preview mints nothing, an
/// MCP message is a JSON-RPC parse error, a client key and an approval confirm are refused. A
/// deflate (zlib) confirm too.
#[tokio::test]
async fn compressed_bodies_are_refused_unread_on_every_surface() -> TestResult {
    let stack = Stack::start(with_approvers(sqlite_only(false))).await?;
    let (_, fp) = stack.preview(json!("60.00")).await?;
    let ap = post(&stack, "/approve/v1/transfers/preview", &[], &transfer(json!("5000.00"), "m")).await?;
    let afp = ap.json["fingerprint"].as_str().ok_or("no approval fingerprint")?.to_owned();
    let before = seen(&stack).await?;
    let json_body = |amount: &str| transfer(json!(amount), "m").to_string().into_bytes();
    let headers = |extra: Vec<(&'static str, String)>, enc: &'static str| {
        let mut h: Vec<(&'static str, String)> = vec![
            ("x-agent-subject", SUBJECT.into()),
            ("content-type", "application/json".into()),
            ("content-encoding", enc.into()),
        ];
        h.extend(extra);
        h
    };
    let send = |h: Vec<(&'static str, String)>, path: &'static str, body: Vec<u8>| {
        let stack = &stack;
        async move {
            let h: Vec<(&str, &[u8])> = h.iter().map(|(k, v)| (*k, v.as_bytes())).collect();
            post_raw(stack, path, &h, body).await
        }
    };
    let p = send(headers(vec![], "gzip"), "/v1/transfers/preview", gzip(&json_body("60.00"))?).await?;
    assert_envelope(&p, 400, "invalid_json");
    assert!(p.json.get("fingerprint").is_none(), "{}", show(&p));
    let c = send(
        headers(vec![("agent-fingerprint", fp.clone())], "deflate"),
        "/v1/transfers",
        zlib(&json_body("9999.00"))?,
    )
    .await?;
    assert_envelope(&c, 400, "invalid_json");
    let a = send(
        headers(vec![("agent-fingerprint", afp.clone())], "gzip"),
        "/approve/v1/transfers",
        gzip(&json_body("5000.00"))?,
    )
    .await?;
    assert_envelope(&a, 400, "invalid_json");
    let call = tools_call(json!(4), "execute_transfer", mcp_args("9999.00", "payee-mallory", None)).to_string();
    let key = fresh_key("mcp-gz");
    let extra: Vec<(&str, &[u8])> = vec![("content-encoding", b"gzip"), ("idempotency-key", key.as_bytes())];
    let m = mcp_bytes(&stack, &extra, gzip(call.as_bytes())?).await?;
    assert_rpc_error(&m, 400, -32700);
    seen(&stack).await?.assert_same(before, "compressed bodies");
    assert!(pending(&stack).await?.is_empty(), "nobody was asked about an unread body");
    assert_eq!(stack.stat("wasmcustom.idem.minted").await?, 2, "the two plain previews only");

    // A client-key route binds no field: the body is the upstream's to read (the key names the
    // operation; the body's bytes are its payload hash). Forwarded once; the same bytes again are
    // the same operation, replayed, never forwarded again.
    let key = fresh_key("gz");
    let h = headers(vec![("idempotency-key", key.clone())], "gzip");
    let first = send(h.clone(), "/programs/v1/transfers", gzip(&json_body("90.00"))?).await?;
    let after_first = seen(&stack).await?;
    assert_eq!(after_first.forwarded, before.forwarded + 1, "{}", show(&first));
    let again = send(h, "/programs/v1/transfers", gzip(&json_body("90.00"))?).await?;
    assert_eq!((again.status, &again.body), (first.status, &first.body), "replayed: {}", show(&again));
    seen(&stack).await?.assert_same(after_first, "the same compressed client-key request again");
    assert_eq!(after_first.executions, 0, "the demo cannot read gzip: it ran nothing ({})", show(&first));
    Ok(())
}

/// A plain JSON body under a content-encoding label (`identity`, `br`, `x-unknown`, `gzip`): the
/// filter judges the bytes it holds, which are the bytes the upstream gets. A tampered one is
/// refused; the valid one runs once under the nonce and its retry replays. (The demo ignores the
/// label; an upstream that decodes would fail on these bytes and run nothing.)
#[tokio::test]
async fn an_encoding_label_on_a_plain_body_changes_no_decision() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    for (i, label) in ["identity", "br", "x-unknown", "gzip", "gzip, identity"].into_iter().enumerate() {
        let amount = format!("{}.00", 61 + i);
        let (_, fp) = stack.preview(json!(amount)).await?;
        let h = [("agent-fingerprint", fp.as_str()), ("content-encoding", label)];
        let before = seen(&stack).await?;
        let t = post(&stack, "/v1/transfers", &h, &transfer(json!("9999.00"), "m")).await?;
        assert_envelope(&t, 422, "params_changed");
        seen(&stack).await?.assert_same(before, &format!("a tampered confirm labelled {label}"));
        let a = post(&stack, "/v1/transfers", &h, &transfer(json!(amount), "m")).await?;
        assert_eq!(a.status, 201, "{label}: {}", show(&a));
        let again = post(&stack, "/v1/transfers", &h, &transfer(json!(amount), "m")).await?;
        assert_envelope(&again, 201, "already_completed");
        assert_eq!(ran(&stack, &nonce_of(&fp)?).await?, 1, "{label}");
    }
    assert_eq!(counts(&stack).await?, (5, 5));
    Ok(())
}

// ---------------------------------------------------------------- HTTP/2 trailers and chunked bodies

/// HTTP/2 requests that end in trailers on the approval route (bypass.rs covers REST, MCP and client
/// keys): the waiting confirm forwards nothing, the approved one runs once, the status lookup is the
/// gateway's; and a valid MCP execute ending in trailers runs once.
#[tokio::test]
async fn trailers_on_approval_and_a_valid_mcp_execute_run_once() -> TestResult {
    let stack = Stack::start(with_approvers(sqlite_only(false))).await?;
    let trailers = [("x-body-checksum", "0")];
    let h2 = |path: &str, fp: Option<&str>, body: &Value| {
        let mut req = H2Request::post(path).header("x-agent-subject", SUBJECT);
        if let Some(fp) = fp {
            req = req.header("agent-fingerprint", fp);
        }
        req.json(body).trailers(&trailers)
    };
    let p =
        http2::send(stack.ports.listener, &h2("/approve/v1/transfers/preview", None, &transfer(json!("5000.00"), "m")))
            .await?;
    let afp =
        p.answer.json["fingerprint"].as_str().ok_or_else(|| format!("no fingerprint: {}", show(&p.answer)))?.to_owned();
    let before = seen(&stack).await?;
    let confirm = h2("/approve/v1/transfers", Some(&afp), &transfer(json!("5000.00"), "m"));
    assert_envelope(&http2::send(stack.ports.listener, &confirm).await?.answer, 202, "approval_required");
    let tampered = h2("/approve/v1/transfers", Some(&afp), &transfer(json!("9000.00"), "m"));
    assert_envelope(&http2::send(stack.ports.listener, &tampered).await?.answer, 422, "params_changed");
    seen(&stack).await?.assert_same(before, "approval confirms ending in trailers, before the approval");
    approve(&stack, &nonce_of(&afp)?).await?;
    let a = http2::send(stack.ports.listener, &confirm).await?.answer;
    assert_eq!(a.status, 201, "{}", show(&a));
    let s =
        http2::send(stack.ports.listener, &h2("/approve/v1/transfers/status", Some(&afp), &json!({}))).await?.answer;
    assert_envelope(&s, 200, "already_completed");
    assert_eq!(ran(&stack, &nonce_of(&afp)?).await?, 1);

    let mcp_h2 = |body: &Value| {
        let mut req = H2Request::post("/mcp").header("x-agent-subject", SUBJECT);
        for (k, v) in MCP_HEADERS {
            req = req.header(k, v);
        }
        req.json(body).trailers(&trailers)
    };
    let q = http2::send(
        stack.ports.listener,
        &mcp_h2(&tools_call(json!(5), "quote_transfer", mcp_args("70.00", "payee-42", None))),
    )
    .await?;
    let mfp = quoted(&q.answer)?;
    let exec = mcp_h2(&tools_call(json!(6), "execute_transfer", mcp_args("70.00", "payee-42", Some(&mfp))));
    let e = http2::send(stack.ports.listener, &exec).await?.answer;
    assert_eq!(e.json["result"]["isError"], false, "{}", show(&e));
    let again = http2::send(stack.ports.listener, &exec).await?.answer;
    assert_eq!(again.json["result"]["isError"], false, "a replay: {}", show(&again));
    assert_eq!(ran(&stack, &nonce_of(&mfp)?).await?, 1);
    let evil = mcp_h2(&tools_call(json!(7), "execute_transfer", mcp_args("9999.00", "payee-42", Some(&mfp))));
    assert_tool_error(&http2::send(stack.ports.listener, &evil).await?.answer, "params_changed");
    assert_eq!(counts(&stack).await?, (2, 2));
    Ok(())
}

/// HTTP/1.1 chunked bodies (cut inside the fingerprint and the amount) on MCP, client keys and
/// approval: judged whole; the valid request runs once, the tampered one runs nothing.
#[tokio::test]
async fn chunked_bodies_on_mcp_client_keys_and_approval_are_judged_whole() -> TestResult {
    let stack = Stack::start(with_approvers(sqlite_only(false))).await?;
    let send = |path: &'static str, extra: Vec<String>, body: Vec<u8>| {
        let stack = &stack;
        async move {
            let cuts = [body.len() / 3, body.len() / 2, body.len() - 3];
            let pieces = [&body[..cuts[0]], &body[cuts[0]..cuts[1]], &body[cuts[1]..cuts[2]], &body[cuts[2]..]];
            let mut lines = vec![
                format!("x-agent-subject: {SUBJECT}"),
                "content-type: application/json".to_owned(),
                "transfer-encoding: chunked".to_owned(),
                "connection: close".to_owned(),
            ];
            lines.extend(extra);
            let bytes = [wire::head("POST", path, &lines), wire::chunked(&pieces, "", &[])].concat();
            let x = wire::exchange(stack.ports.listener, &bytes, false, Duration::from_secs(10)).await?;
            x.answer.ok_or_else(|| BoxError::from(format!("no answer on {path}")))
        }
    };
    let mcp_lines = || {
        vec!["accept: application/json, text/event-stream".to_owned(), "mcp-protocol-version: 2025-06-18".to_owned()]
    };
    // MCP
    let q = mcp(&stack, &[], &tools_call(json!(8), "quote_transfer", mcp_args("80.00", "payee-42", None))).await?;
    let mfp = quoted(&q)?;
    let before = seen(&stack).await?;
    let evil = tools_call(json!(9), "execute_transfer", mcp_args("9999.00", "payee-42", Some(&mfp))).to_string();
    assert_tool_error(&send("/mcp", mcp_lines(), evil.into_bytes()).await?, "params_changed");
    seen(&stack).await?.assert_same(before, "a tampered chunked MCP execute");
    let good = tools_call(json!(10), "execute_transfer", mcp_args("80.00", "payee-42", Some(&mfp))).to_string();
    let e = send("/mcp", mcp_lines(), good.into_bytes()).await?;
    assert_eq!(e.json["result"]["isError"], false, "{}", show(&e));
    assert_eq!(ran(&stack, &nonce_of(&mfp)?).await?, 1);
    // Client key
    let key = fresh_key("chunked");
    let body = transfer(json!("81.00"), "invoice 81").to_string().into_bytes();
    let k1 = send("/programs/v1/transfers", vec![format!("idempotency-key: {key}")], body.clone()).await?;
    assert_eq!(k1.status, 201, "{}", show(&k1));
    let k2 = send("/programs/v1/transfers", vec![format!("idempotency-key: {key}")], body).await?;
    assert_eq!((k2.status, &k2.body), (201, &k1.body), "replayed: {}", show(&k2));
    let other = transfer(json!("9999.00"), "invoice 81").to_string().into_bytes();
    let before = seen(&stack).await?;
    let k3 = send("/programs/v1/transfers", vec![format!("idempotency-key: {key}")], other).await?;
    assert!((400..500).contains(&k3.status), "the key with another body: {}", show(&k3));
    seen(&stack).await?.assert_same(before, "a chunked client key reused with another body");
    // Approval
    let ap = post(&stack, "/approve/v1/transfers/preview", &[], &transfer(json!("5000.00"), "m")).await?;
    let afp = ap.json["fingerprint"].as_str().ok_or("no approval fingerprint")?.to_owned();
    let before = seen(&stack).await?;
    let body = transfer(json!("5000.00"), "m").to_string().into_bytes();
    let a = send("/approve/v1/transfers", vec![format!("agent-fingerprint: {afp}")], body.clone()).await?;
    assert_envelope(&a, 202, "approval_required");
    seen(&stack).await?.assert_same(before, "a chunked approval confirm");
    approve(&stack, &nonce_of(&afp)?).await?;
    let a = send("/approve/v1/transfers", vec![format!("agent-fingerprint: {afp}")], body).await?;
    assert_eq!(a.status, 201, "{}", show(&a));
    assert_eq!(ran(&stack, &nonce_of(&afp)?).await?, 1);
    assert_eq!(counts(&stack).await?.0, 3);
    Ok(())
}

// ---------------------------------------------------------------- duplicate JSON keys

/// Duplicate keys where the second reading changes the decision: an approval confirm whose amount
/// reads 10.00 (no person asked) one way and 5000.00 the other; a client key's body; an MCP execute
/// whose arguments name two amounts. serde keeps the last value, other parsers the first: the
/// gateway refuses the body (4xx), nothing is forwarded, nobody is asked.
#[tokio::test]
async fn duplicate_keys_that_would_change_a_decision_are_refused() -> TestResult {
    let stack = Stack::start(with_approvers(sqlite_only(false))).await?;
    let small = post(&stack, "/approve/v1/transfers/preview", &[], &transfer(json!("10.00"), "m")).await?;
    let small = small.json["fingerprint"].as_str().ok_or("no fingerprint")?.to_owned();
    let rest = r#""currency":"EUR","payee_id":"payee-42","memo":"m""#;
    let q = mcp(&stack, &[], &tools_call(json!(11), "quote_transfer", mcp_args("10.00", "payee-42", None))).await?;
    let mfp = quoted(&q)?;
    let before = seen(&stack).await?;
    for body in [
        format!(r#"{{"amount":"10.00","amount":"5000.00",{rest}}}"#),
        format!(r#"{{"amount":"5000.00","amount":"10.00",{rest}}}"#),
    ] {
        let h: [(&str, &[u8]); 3] = [
            ("x-agent-subject", SUBJECT.as_bytes()),
            ("content-type", b"application/json"),
            ("agent-fingerprint", small.as_bytes()),
        ];
        assert_envelope(&post_raw(&stack, "/approve/v1/transfers", &h, body.into_bytes()).await?, 400, "invalid_json");
    }
    for amounts in [r#""amount":"10.00","amount":"7777.77""#, r#""amount":"7777.77","amount":"10.00""#] {
        let call = format!(
            r#"{{"jsonrpc":"2.0","id":12,"method":"tools/call","params":{{"name":"execute_transfer","arguments":{{{amounts},"currency":"EUR","payee_id":"payee-42","memo":"m","fingerprint":"{mfp}"}}}}}}"#
        );
        assert_rpc_error(&mcp_bytes(&stack, &[], call.into_bytes()).await?, 400, -32700);
    }
    // The MCP status tool: two fingerprints in its arguments name two operations.
    let q2 = mcp(&stack, &[], &tools_call(json!(13), "quote_transfer", mcp_args("11.00", "payee-42", None))).await?;
    let other = quoted(&q2)?;
    let status = format!(
        r#"{{"jsonrpc":"2.0","id":14,"method":"tools/call","params":{{"name":"get_transfer_status","arguments":{{"fingerprint":"{mfp}","fingerprint":"{other}"}}}}}}"#
    );
    assert_rpc_error(&mcp_bytes(&stack, &[], status.into_bytes()).await?, 400, -32700);
    seen(&stack).await?.assert_same(
        Seen { forwarded: before.forwarded + 1, ..before },
        "bodies with duplicate keys (and one more quote)",
    );
    assert!(pending(&stack).await?.is_empty(), "nobody was asked");

    // A client-key route binds no field, so the gateway decides nothing on the body: the upstream
    // reads it (the demo refuses duplicate keys) once, and the same bytes under the same key are the
    // same operation, replayed; another body under that key is refused (its payload hash differs).
    let key = fresh_key("dup");
    let h: [(&str, &[u8]); 3] = [
        ("x-agent-subject", SUBJECT.as_bytes()),
        ("content-type", b"application/json"),
        ("idempotency-key", key.as_bytes()),
    ];
    let dup = format!(r#"{{"amount":"1.00","amount":"9999.00",{rest}}}"#).into_bytes();
    let base = seen(&stack).await?;
    let first = post_raw(&stack, "/programs/v1/transfers", &h, dup.clone()).await?;
    let after_first = seen(&stack).await?;
    assert_eq!(after_first.forwarded, base.forwarded + 1, "{}", show(&first));
    let again = post_raw(&stack, "/programs/v1/transfers", &h, dup).await?;
    assert_eq!((again.status, &again.body), (first.status, &first.body), "replayed: {}", show(&again));
    let other =
        post(&stack, "/programs/v1/transfers", &[("idempotency-key", &key)], &transfer(json!("9999.00"), "m")).await?;
    assert_problem(&other, 422, "idempotency-key-reused");
    seen(&stack).await?.assert_same(after_first, "the key again, with the same or another body");
    assert!(after_first.executions <= 1, "at most once: {after_first:?}");
    Ok(())
}

// ---------------------------------------------------------------- empty guarded headers

/// Guarded headers present but empty (or blank): never a wildcard, never "no header, so pass". An
/// empty fingerprint header is an invalid fingerprint (400), and beside a valid body fingerprint the
/// two differ (400); an empty or blank subject is no caller (401, and a preview mints nothing); an
/// empty `Idempotency-Key` is a missing key (problem 400); an empty `Mcp-Method` over a `tools/call`
/// disagrees with the body (-32020). Nothing is forwarded for any of them.
#[tokio::test]
async fn empty_guarded_headers_are_no_value_never_a_pass() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let (_, fp) = stack.preview(json!("95.00")).await?;
    let before = seen(&stack).await?;
    let a = post(&stack, "/v1/transfers", &[("agent-fingerprint", "")], &transfer(json!("95.00"), "m")).await?;
    assert_envelope(&a, 400, "fingerprint_invalid");
    let mut body = transfer(json!("95.00"), "m");
    body["fingerprint"] = json!(fp);
    let a = post(&stack, "/v1/transfers", &[("agent-fingerprint", "")], &body).await?;
    assert_envelope(&a, 400, "fingerprint_invalid");
    for subject in ["", "   "] {
        let h: [(&str, &[u8]); 3] = [
            ("x-agent-subject", subject.as_bytes()),
            ("content-type", b"application/json"),
            ("agent-fingerprint", fp.as_bytes()),
        ];
        let a = post_raw(&stack, "/v1/transfers", &h, transfer(json!("95.00"), "m").to_string().into_bytes()).await?;
        assert_envelope(&a, 401, "unauthenticated");
        let h: [(&str, &[u8]); 2] = [("x-agent-subject", subject.as_bytes()), ("content-type", b"application/json")];
        let p = post_raw(&stack, "/v1/transfers/preview", &h, transfer(json!("95.00"), "m").to_string().into_bytes())
            .await?;
        assert_envelope(&p, 401, "unauthenticated");
        assert!(p.json.get("fingerprint").is_none(), "no fingerprint for no caller: {}", show(&p));
    }
    let k = post(&stack, "/programs/v1/transfers", &[("idempotency-key", "")], &transfer(json!("95.00"), "m")).await?;
    assert_problem(&k, 400, "idempotency-key-missing");
    let call = tools_call(json!(13), "execute_transfer", mcp_args("9999.00", "payee-mallory", None));
    let key = fresh_key("mcp-empty");
    let m = mcp(&stack, &[("idempotency-key", &key), ("mcp-method", "")], &call).await?;
    assert_rpc_error(&m, 400, -32020);
    seen(&stack).await?.assert_same(before, "empty guarded headers");
    assert_eq!(stack.stat("wasmcustom.idem.minted").await?, 1, "the one plain preview");
    Ok(())
}
