//! The standing attack suite, part 4: the sweep — framing, methods, encodings and bodies that a guard and
//! an upstream might read differently. Each test sends the attack as a valid confirm (it must run exactly
//! once, with the nonce as its Idempotency-Key) and as a tampered or unreadable one (nothing may reach the
//! upstream), and checks Envoy's request count to the business cluster and the demo's ledger.
//! Path variants (normalisation, case, slashes) are tests/tests/paths.rs's.

use idem_e2e::bypass::{assert_envelope, assert_rpc_error, seen, show};
use idem_e2e::http2::{self, H2Request};
use idem_e2e::istio::{bearer, istio_opts, set_secret_env, ISTIO_IS_WASM_ONLY};
use idem_e2e::wire;
use idem_e2e::*;
use serde_json::{json, Value};
use std::io::Write as _;
use std::time::Duration;

/// Any method, any body bytes, exactly these headers (and the subject).
async fn send(
    stack: &Stack,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> Result<Answer, BoxError> {
    let mut req = stack.http.request(method.parse()?, stack.url(path)).header("x-agent-subject", SUBJECT);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let r = req.body(body).send().await?;
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    let body = r.bytes().await?.to_vec();
    let json = serde_json::from_slice(&body).unwrap_or(Value::Null);
    Ok(Answer { status, headers, body, json })
}

fn body(amount: &str) -> Vec<u8> {
    transfer(json!(amount), "sweep").to_string().into_bytes()
}

/// The valid confirm ran once, under its nonce, and nothing else ran.
async fn ran_once(stack: &Stack, fp: &str, a: &Answer) -> TestResult {
    assert_eq!(a.status, 201, "{}", show(a));
    let ledger = stack.executions().await?;
    assert_eq!(ledger["by_key"][&nonce_of(fp)?], 1, "executed under the nonce: {ledger}");
    assert_eq!(counts(stack).await?, (1, 1), "exactly one execution and one attempt: {ledger}");
    Ok(())
}

/// Header lines for a hand-written confirm.
fn lines(fp: &str, extra: &[&str]) -> Vec<String> {
    let mut l = vec![format!("x-agent-subject: {SUBJECT}"), format!("agent-fingerprint: {fp}")];
    l.extend(extra.iter().map(|s| (*s).to_owned()));
    l
}

// ---------------------------------------------------------------- encodings and framing

/// Envoy has no decompressor here: the filter sees gzip bytes, cannot read them as JSON, and forwards
/// nothing (an upstream that inflates would read a body the guard never judged).
#[tokio::test]
async fn a_gzipped_confirm_body_is_refused_unread() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let (_, fp) = stack.preview(json!("41.00")).await?;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&body("41.00"))?;
    let gzipped = gz.finish()?;
    let before = seen(&stack).await?;
    let h = [("agent-fingerprint", fp.as_str()), ("content-type", "application/json"), ("content-encoding", "gzip")];
    let a = send(&stack, "POST", "/v1/transfers", &h, gzipped).await?;
    assert_envelope(&a, 400, "invalid_json");
    seen(&stack).await?.assert_same(before, "a gzipped confirm");
    Ok(())
}

/// HTTP/1.1 chunked with chunk extensions and trailers (one of them an Idempotency-Key): Envoy's HTTP/1
/// codec ends the body at the last chunk; the confirm is judged whole, and the trailer key never arrives.
#[tokio::test]
async fn chunk_extensions_and_http1_trailers_are_guarded() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let (_, fp) = stack.preview(json!("42.00")).await?;
    let chunked = |b: &[u8]| {
        let (x, y) = b.split_at(b.len() / 2);
        let (y, z) = y.split_at(y.len() / 2);
        wire::chunked(&[x, y, z], ";ext=\"v\";n=1", &["x-checksum: 0", "idempotency-key: smuggled-trailer-key"])
    };
    let head = wire::head(
        "POST",
        "/v1/transfers",
        &lines(&fp, &["content-type: application/json", "transfer-encoding: chunked", "connection: close"]),
    );
    let before = seen(&stack).await?;
    let tampered = wire::exchange(
        stack.ports.listener,
        &[head.clone(), chunked(&body("9999.00"))].concat(),
        false,
        Duration::from_secs(10),
    )
    .await?;
    let tampered = tampered.answer.ok_or("no answer to the tampered chunked confirm")?;
    assert_envelope(&tampered, 422, "params_changed");
    seen(&stack).await?.assert_same(before, "a tampered chunked confirm");
    let valid =
        wire::exchange(stack.ports.listener, &[head, chunked(&body("42.00"))].concat(), false, Duration::from_secs(10))
            .await?;
    ran_once(&stack, &fp, &valid.answer.ok_or("no answer to the chunked confirm")?).await?;
    assert!(stack.executions().await?["attempts_by_key"].get("smuggled-trailer-key").is_none());
    Ok(())
}

#[tokio::test]
async fn expect_100_continue_confirms_are_guarded() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let (_, fp) = stack.preview(json!("43.00")).await?;
    let head = |b: &[u8]| {
        let extra = [
            "content-type: application/json".to_owned(),
            format!("content-length: {}", b.len()),
            "expect: 100-continue".to_owned(),
            "connection: close".to_owned(),
        ];
        wire::head("POST", "/v1/transfers", &lines(&fp, &extra.iter().map(String::as_str).collect::<Vec<_>>()))
    };
    let before = seen(&stack).await?;
    let evil = body("9999.00");
    let t = wire::exchange_in_two(stack.ports.listener, &head(&evil), &evil, Duration::from_secs(10)).await?;
    assert_eq!(t.interim, vec![100], "Envoy said 100 Continue: {t:?}");
    assert_envelope(&t.answer.ok_or("no answer")?, 422, "params_changed");
    seen(&stack).await?.assert_same(before, "a tampered confirm after 100-continue");
    let good = body("43.00");
    let v = wire::exchange_in_two(stack.ports.listener, &head(&good), &good, Duration::from_secs(10)).await?;
    ran_once(&stack, &fp, &v.answer.ok_or("no answer")?).await
}

/// A body over `max_body_bytes` with no Content-Length (chunked on HTTP/1.1, DATA frames on HTTP/2): the
/// limit holds while the body streams in, and nothing is forwarded.
#[tokio::test]
async fn an_oversized_body_without_content_length_is_413() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let (_, fp) = stack.preview(json!("44.00")).await?;
    let big = transfer(json!("44.00"), &"x".repeat(70 * 1024)).to_string().into_bytes();
    let before = seen(&stack).await?;
    for path in ["/v1/transfers", "/v1/transfers/preview"] {
        let head = wire::head(
            "POST",
            path,
            &lines(&fp, &["content-type: application/json", "transfer-encoding: chunked", "connection: close"]),
        );
        let pieces: Vec<&[u8]> = big.chunks(8 * 1024).collect();
        let x = wire::exchange(
            stack.ports.listener,
            &[head, wire::chunked(&pieces, "", &[])].concat(),
            false,
            Duration::from_secs(10),
        )
        .await?;
        assert_envelope(&x.answer.ok_or("no answer")?, 413, "body_too_large");

        let mut req = H2Request::post(path)
            .header("x-agent-subject", SUBJECT)
            .header("agent-fingerprint", &fp)
            .header("content-type", "application/json");
        for piece in big.chunks(8 * 1024) {
            req = req.data(piece.to_vec());
        }
        assert_envelope(&http2::send(stack.ports.listener, &req).await?.answer, 413, "body_too_large");
    }
    let mut req = H2Request::post("/mcp")
        .header("x-agent-subject", SUBJECT)
        .header("accept", "application/json, text/event-stream")
        .header("content-type", "application/json")
        .header("idempotency-key", "client-chosen-big");
    let call = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": "execute_transfer", "arguments": {"amount": "1", "currency": "EUR", "payee_id": "p", "memo": "x".repeat(70 * 1024)}}});
    for piece in call.to_string().into_bytes().chunks(8 * 1024) {
        req = req.data(piece.to_vec());
    }
    let a = http2::send(stack.ports.listener, &req).await?.answer;
    assert_rpc_error(&a, 413, -32600);
    seen(&stack).await?.assert_same(before, "oversized bodies without Content-Length");
    Ok(())
}

/// Content-Length shorter than the bytes sent: Envoy takes the declared body and parses the rest as the
/// next request, which meets the guard on its own. Here the rest is a tampered confirm with the same
/// fingerprint: the first runs once, the smuggled one is refused.
#[tokio::test]
async fn a_short_content_length_smuggles_no_second_confirm() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let (_, fp) = stack.preview(json!("45.00")).await?;
    let first = body("45.00");
    let evil = body("9999.00");
    let second = [
        wire::head(
            "POST",
            "/v1/transfers",
            &lines(
                &fp,
                &["content-type: application/json", &format!("content-length: {}", evil.len()), "connection: close"],
            ),
        ),
        evil,
    ]
    .concat();
    let head = wire::head(
        "POST",
        "/v1/transfers",
        &lines(&fp, &["content-type: application/json", &format!("content-length: {}", first.len())]),
    );
    let answers =
        wire::exchange_all(stack.ports.listener, &[head, first, second].concat(), Duration::from_secs(3)).await?;
    let statuses: Vec<String> = answers.iter().map(show).collect();
    assert_eq!(answers.len(), 2, "two requests, two answers: {statuses:?}");
    ran_once(&stack, &fp, &answers[0]).await?;
    assert_envelope(&answers[1], 422, "params_changed");
    assert_eq!(counts(&stack).await?, (1, 1), "{statuses:?}");

    // A declared body that cuts the JSON short is not JSON.
    let (_, fp2) = stack.preview(json!("45.00")).await?;
    let before = seen(&stack).await?;
    let whole = body("45.00");
    let head = wire::head(
        "POST",
        "/v1/transfers",
        &lines(
            &fp2,
            &["content-type: application/json", &format!("content-length: {}", whole.len() / 2), "connection: close"],
        ),
    );
    let answers = wire::exchange_all(stack.ports.listener, &[head, whole].concat(), Duration::from_secs(3)).await?;
    assert!(!answers.is_empty(), "an answer to the truncated body");
    assert_envelope(&answers[0], 400, "invalid_json");
    seen(&stack).await?.assert_same(before, "a truncated confirm");
    Ok(())
}

/// Content-Length longer than the bytes sent, then the client closes: the body never ends, so nothing is
/// forwarded and nothing acquired (the same fingerprint then runs normally). On HTTP/2 a content-length
/// that disagrees with the DATA is Envoy's protocol error.
#[tokio::test]
async fn a_long_content_length_forwards_and_acquires_nothing() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let (_, fp) = stack.preview(json!("46.00")).await?;
    let b = body("46.00");
    let before = seen(&stack).await?;
    let head = wire::head(
        "POST",
        "/v1/transfers",
        &lines(&fp, &["content-type: application/json", &format!("content-length: {}", b.len() + 100)]),
    );
    let x = wire::exchange(stack.ports.listener, &[head, b.clone()].concat(), true, Duration::from_secs(3)).await?;
    assert!(x.answer.as_ref().is_none_or(|a| a.status >= 400), "no success for an unfinished body: {x:?}");
    for declared in [b.len() + 100, b.len() / 2] {
        let req = H2Request::post("/v1/transfers")
            .header("x-agent-subject", SUBJECT)
            .header("agent-fingerprint", &fp)
            .header("content-type", "application/json")
            .header("content-length", &declared.to_string())
            .data(b.clone());
        if let Ok(r) = http2::send(stack.ports.listener, &req).await {
            assert!(r.answer.status >= 400, "content-length {declared} for {} bytes: {}", b.len(), show(&r.answer));
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    seen(&stack).await?.assert_same(before, "confirms whose body never matched its length");
    let a =
        send(&stack, "POST", "/v1/transfers", &[("agent-fingerprint", &fp), ("content-type", "application/json")], b)
            .await?;
    ran_once(&stack, &fp, &a).await
}

// ---------------------------------------------------------------- bodies that parse two ways

#[tokio::test]
async fn json_bodies_that_read_two_ways_are_refused() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let (_, fp) = stack.preview(json!("47.00")).await?;
    let (_, other) = stack.preview(json!("9999.00")).await?;
    let good = String::from_utf8(body("47.00"))?;
    let rest = r#""currency":"EUR","payee_id":"payee-42","memo":"m""#;
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("a byte-order mark", [b"\xEF\xBB\xBF".to_vec(), good.clone().into_bytes()].concat()),
        ("a duplicate amount", format!(r#"{{"amount":"47.00","amount":"9999.00",{rest}}}"#).into_bytes()),
        (
            "a duplicate amount, the other way",
            format!(r#"{{"amount":"9999.00","amount":"47.00",{rest}}}"#).into_bytes(),
        ),
    ];
    let before = seen(&stack).await?;
    for (what, b) in &cases {
        let h = [("agent-fingerprint", fp.as_str()), ("content-type", "application/json")];
        let a = send(&stack, "POST", "/v1/transfers", &h, b.clone()).await?;
        assert_eq!(a.status, 400, "{what}: {}", show(&a));
        assert_envelope(&a, 400, "invalid_json");
    }
    // The fingerprint twice in the body (two, or one twice), no header.
    for (f1, f2) in [(&fp, &other), (&other, &fp), (&fp, &fp)] {
        let b = format!(r#"{{"amount":"47.00",{rest},"fingerprint":"{f1}","fingerprint":"{f2}"}}"#).into_bytes();
        let a = send(&stack, "POST", "/v1/transfers", &[("content-type", "application/json")], b).await?;
        assert_envelope(&a, 400, "invalid_json");
    }
    // A preview with a duplicate bound field mints nothing.
    let b = format!(r#"{{"amount":"47.00","amount":"9999.00",{rest}}}"#).into_bytes();
    let a = send(&stack, "POST", "/v1/transfers/preview", &[("content-type", "application/json")], b).await?;
    assert_envelope(&a, 400, "invalid_json");
    seen(&stack).await?.assert_same(before, "bodies that read two ways");
    Ok(())
}

/// The filter judges the bytes whatever the content type says; the upstream gets exactly those bytes.
#[tokio::test]
async fn a_json_body_under_another_content_type_is_still_guarded() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let (_, fp) = stack.preview(json!("48.00")).await?;
    let before = seen(&stack).await?;
    for ct in [Some("text/plain"), None, Some("application/x-www-form-urlencoded")] {
        let mut h = vec![("agent-fingerprint", fp.as_str())];
        h.extend(ct.map(|c| ("content-type", c)));
        assert_envelope(&send(&stack, "POST", "/v1/transfers", &h, body("9999.00")).await?, 422, "params_changed");
    }
    let form = format!("amount=9999.00&currency=EUR&payee_id=payee-42&fingerprint={fp}").into_bytes();
    let a =
        send(&stack, "POST", "/v1/transfers", &[("content-type", "application/x-www-form-urlencoded")], form).await?;
    assert_envelope(&a, 400, "invalid_json");
    seen(&stack).await?.assert_same(before, "tampered and form-encoded confirms");
    let h = [("agent-fingerprint", fp.as_str()), ("content-type", "text/plain")];
    let a = send(&stack, "POST", "/v1/transfers", &h, body("48.00")).await?;
    ran_once(&stack, &fp, &a).await
}

// ---------------------------------------------------------------- methods

/// Every other method on the confirm path, and GET with the method-override headers frameworks honour:
/// nothing executes. (The confirm route matches POST only, so these reach the demo through the catch-all
/// unguarded; the demo serves POST alone there and answers 405.)
/// `rules`: the stack guards by route rules, which read an override as the method a framework would, and
/// refuse it at the gateway (`path_not_canonical`) instead of passing it.
async fn other_methods_execute_nothing(stack: &Stack, auth: &[(&str, &str)], rules: bool) -> TestResult {
    let fp = {
        let a = send(
            stack,
            "POST",
            "/v1/transfers/preview",
            &[auth, &[("content-type", "application/json")]].concat(),
            body("49.00"),
        )
        .await?;
        a.json["fingerprint"].as_str().ok_or_else(|| format!("no fingerprint: {}", show(&a)))?.to_owned()
    };
    let mut h = vec![
        ("agent-fingerprint", fp.as_str()),
        ("content-type", "application/json"),
        ("idempotency-key", "client-chosen-method"),
    ];
    h.extend_from_slice(auth);
    let before = seen(stack).await?;
    for method in ["GET", "PUT", "PATCH", "HEAD", "DELETE", "OPTIONS"] {
        let a = send(stack, method, "/v1/transfers", &h, body("9999.00")).await?;
        assert!(!(200..300).contains(&a.status), "{method}: {}", show(&a));
    }
    for header in [
        "x-http-method-override",
        "x-http-method",
        "x-method-override",
        // A CGI-style upstream reads these as the dashed ones.
        "x_http_method_override",
        "x_http_method",
        "x_method_override",
    ] {
        let mut h = h.clone();
        h.push((header, "POST"));
        let a = send(stack, "GET", "/v1/transfers", &h, body("9999.00")).await?;
        assert!(!(200..300).contains(&a.status), "GET + {header}: POST: {}", show(&a));
        if rules {
            // deploy/istio's rules take every method (a rule that named POST let a PUT through the mesh's
            // catch-all, and `idemd check` refuses that): the GET is judged as the confirm it is, and its amount
            // is not the fingerprint's.
            assert_eq!((a.status, a.json["status"].as_str()), (422, Some("params_changed")), "{header}: {}", show(&a));
        }
    }
    let after = seen(stack).await?;
    assert_eq!((after.executions, after.attempts), (before.executions, before.attempts), "nothing executed: {after:?}");
    Ok(())
}

#[tokio::test]
async fn other_methods_on_the_confirm_path_execute_nothing() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    other_methods_execute_nothing(&stack, &[], false).await
}

#[tokio::test]
async fn other_methods_on_istio_route_rules_execute_nothing() -> TestResult {
    if wasm_only(ISTIO_IS_WASM_ONLY)? {
        return Ok(());
    }
    set_secret_env();
    let stack = Stack::start(istio_opts(Vec::new())?).await?;
    let token = bearer("alice")?;
    other_methods_execute_nothing(&stack, &[("authorization", token.as_str())], true).await
}

// ---------------------------------------------------------------- headers in bulk

/// Past Envoy's limits (100 headers, 60 KiB of them) the request is refused before any filter runs;
/// below them the guard works as ever.
#[tokio::test]
async fn many_or_huge_headers_are_refused_or_guarded() -> TestResult {
    let stack = Stack::start(sqlite_only(false)).await?;
    let (_, fp) = stack.preview(json!("50.00")).await?;
    let junk: Vec<String> = (0..150).map(|i| format!("x-junk-{i}: {i}")).collect();
    let before = seen(&stack).await?;
    let head = wire::head(
        "POST",
        "/v1/transfers",
        &[lines(&fp, &["content-type: application/json", "connection: close"]), junk.clone()].concat(),
    );
    let b = body("9999.00");
    let head = [
        head.strip_suffix(b"\r\n").unwrap_or(&head).to_vec(),
        format!("content-length: {}\r\n\r\n", b.len()).into_bytes(),
    ]
    .concat();
    let x = wire::exchange(stack.ports.listener, &[head, b.clone()].concat(), false, Duration::from_secs(10)).await?;
    if FilterHost::current()?.is_ext_proc() {
        // Envoy sends its own 431 through the filters' answer path, and the ext_proc filter opens a stream to
        // idemd for it; the codec error closes the connection first: no answer, and nothing went upstream.
        assert!(x.answer.as_ref().is_none_or(|a| a.status == 431), "{x:?}");
    } else {
        assert_eq!(x.answer.as_ref().map(|a| a.status), Some(431), "{x:?}");
    }
    let mut req = H2Request::post("/v1/transfers").header("x-agent-subject", SUBJECT).header("agent-fingerprint", &fp);
    for i in 0..150 {
        req = req.header(&format!("x-junk-{i}"), &i.to_string());
    }
    if let Ok(r) = http2::send(stack.ports.listener, &req.json(&transfer(json!("9999.00"), "m"))).await {
        assert!(r.answer.status >= 400, "150 headers over HTTP/2: {}", show(&r.answer));
    }
    let huge = "v".repeat(70 * 1024);
    let huge_headers = [("agent-fingerprint", fp.as_str()), ("x-huge", huge.as_str())];
    match send(&stack, "POST", "/v1/transfers", &huge_headers, b).await {
        Ok(a) => assert_eq!(a.status, 431, "{}", show(&a)),
        // The same as above: on the ext_proc host the connection closes before Envoy's 431 is written.
        Err(e) if FilterHost::current()?.is_ext_proc() => eprintln!("70 KiB header, no answer: {e}"),
        Err(e) => return Err(e),
    }
    seen(&stack).await?.assert_same(before, "requests over the header limits");

    let many: Vec<(String, String)> = (0..80).map(|i| (format!("x-junk-{i}"), i.to_string())).collect();
    let mut h: Vec<(&str, &str)> = many.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    h.push(("agent-fingerprint", &fp));
    h.push(("content-type", "application/json"));
    assert_envelope(&send(&stack, "POST", "/v1/transfers", &h, body("9999.00")).await?, 422, "params_changed");
    let a = send(&stack, "POST", "/v1/transfers", &h, body("50.00")).await?;
    ran_once(&stack, &fp, &a).await
}
