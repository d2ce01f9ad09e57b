//! The `x-demo-*` fault headers: honoured with `--faults`, ignored without.

mod support;

use serde_json::json;
use std::time::{Duration, Instant};
use support::{json, transfer, Demo};

const ALL_FAULTS: [(&str, &str); 5] = [
    ("x-demo-delay-ms", "1500"),
    ("x-demo-fail", "503"),
    ("x-demo-crash-after-commit", "1"),
    ("x-demo-reset", "first"),
    ("x-demo-hold-after-commit", "held"),
];

#[tokio::test]
async fn ignored_without_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &[]);
    let started = Instant::now();
    let (status, _) = demo.confirm(Some("k"), &ALL_FAULTS, &transfer(json("1"))).await.unwrap();
    assert_eq!(status, 201);
    assert!(started.elapsed() < Duration::from_millis(1500));
    assert_eq!(demo.get("/healthz").await.0, 200, "still running");
    assert_eq!(demo.executions().await["total"], 1);
}

#[tokio::test]
async fn delay() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &["--faults"]);
    let delay = [("x-demo-delay-ms", "300")];
    let started = Instant::now();
    let (status, _) = demo.confirm(Some("slow"), &delay, &transfer(json("1"))).await.unwrap();
    assert_eq!(status, 201);
    assert!(started.elapsed() >= Duration::from_millis(300));

    let started = Instant::now();
    let resp = demo
        .client
        .post(demo.url("/v1/transfers/preview"))
        .header("x-demo-delay-ms", "300")
        .json(&transfer(json("1")))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    assert!(started.elapsed() >= Duration::from_millis(300));
}

#[tokio::test]
async fn a_caller_that_hangs_up_does_not_stop_the_execution() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &["--faults"]);
    let impatient = reqwest::Client::builder().timeout(Duration::from_millis(100)).build().unwrap();
    let err = impatient
        .post(demo.url("/v1/transfers"))
        .header("Idempotency-Key", "late")
        .header("x-demo-delay-ms", "400")
        .json(&transfer(json("1")))
        .send()
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err}");
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(demo.get("/v1/transfers/by-key/late").await.0, 200);
}

#[tokio::test]
async fn fail_answers_the_status_without_executing() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &["--faults"]);
    let (status, body) = demo.confirm(Some("f"), &[("x-demo-fail", "503")], &transfer(json("1"))).await.unwrap();
    assert_eq!(status, 503);
    assert_eq!(json(&body), json!({ "error": "injected_failure" }));
    let (status, _) = demo.confirm(Some("f"), &[("x-demo-fail", "500")], &transfer(json("1"))).await.unwrap();
    assert_eq!(status, 500);
    assert_eq!(demo.get("/v1/transfers/by-key/f").await.0, 404);
    // Without the header the same key then executes.
    let (status, _) = demo.confirm(Some("f"), &[], &transfer(json("1"))).await.unwrap();
    assert_eq!(status, 201);
    let exec = demo.executions().await;
    assert_eq!(exec["total"], 1);
    assert_eq!(exec["attempts_by_key"]["f"], 3);
}

#[tokio::test]
async fn crash_after_commit_keeps_the_row() {
    let dir = tempfile::tempdir().unwrap();
    let db = support::db_path(dir.path());
    let mut demo = Demo::start_with(&db, &["--faults"], &[]);
    let result = demo.confirm(Some("boom"), &[("x-demo-crash-after-commit", "1")], &transfer(json("9.99"))).await;
    assert!(result.is_err(), "no answer expected, got {result:?}");
    assert!(demo.wait_exit(Duration::from_secs(5)).success());

    let demo = Demo::start_with(&db, &["--faults"], &[]);
    let (status, record) = demo.get("/v1/transfers/by-key/boom").await;
    assert_eq!(status, 200);
    assert_eq!(record["amount"], json("9.99"));
    assert_eq!(record["status"], "executed");
    // A retry after the restart replays instead of executing again.
    let (status, body) = demo.confirm(Some("boom"), &[], &transfer(json("9.99"))).await.unwrap();
    assert_eq!((status, json(&body)), (201, record));
    assert_eq!(
        demo.executions().await,
        json!({ "total": 1, "by_key": { "boom": 1 }, "attempts": 2, "attempts_by_key": { "boom": 2 } })
    );
}

#[tokio::test]
async fn reset_first_drops_only_the_first_attempt() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &["--faults"]);
    let reset = [("x-demo-reset", "first")];
    let first = demo.confirm(Some("r"), &reset, &transfer(json("2"))).await;
    assert!(first.is_err(), "connection error expected, got {first:?}");
    assert_eq!(demo.get("/v1/transfers/by-key/r").await.0, 404, "not executed");

    let (status, _) = demo.confirm(Some("r"), &reset, &transfer(json("2"))).await.unwrap();
    assert_eq!(status, 201);
    let exec = demo.executions().await;
    assert_eq!(exec["total"], 1);
    assert_eq!(exec["attempts_by_key"]["r"], 2);
}

/// Envoy's `retry_on: reset` needs a real RST, not a clean close.
#[test]
fn reset_is_a_tcp_reset() {
    use std::io::{ErrorKind, Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &["--faults"]);
    let mut conn = std::net::TcpStream::connect(&demo.addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let body = r#"{"amount":1,"currency":"EUR","payee_id":"p"}"#;
    write!(
        conn,
        "POST /v1/transfers HTTP/1.1\r\nHost: demo\r\nIdempotency-Key: rst\r\nx-demo-reset: first\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut buf = [0; 64];
    let err = conn.read(&mut buf).expect_err("no bytes, no clean EOF");
    assert_eq!(err.kind(), ErrorKind::ConnectionReset);
}

/// `x-demo-hold-after-commit: <name>`: committed and said so in `<name>.committed` (the record it
/// will answer), and no answer until `<name>.release` exists.
#[tokio::test]
async fn hold_after_commit_answers_only_once_released() {
    let dir = tempfile::tempdir().unwrap();
    let faults = tempfile::tempdir().unwrap();
    let fault_dir = faults.path().display().to_string();
    let demo = Demo::start(dir.path(), &["--faults", "--fault-dir", &fault_dir]);
    let req = demo
        .client
        .post(demo.url("/v1/transfers"))
        .header("Idempotency-Key", "held")
        .header("x-demo-hold-after-commit", "h-1")
        .json(&transfer(json("3")))
        .send();
    let answer = tokio::spawn(req);
    let committed = faults.path().join("h-1.committed");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !committed.exists() {
        assert!(Instant::now() < deadline, "never committed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let record = json(&std::fs::read_to_string(&committed).unwrap());
    assert_eq!(demo.get("/v1/transfers/by-key/held").await, (200, record.clone()), "executed before answering");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!answer.is_finished(), "held until released");

    std::fs::write(faults.path().join("h-1.release"), "go").unwrap();
    let resp = answer.await.unwrap().unwrap();
    assert_eq!(resp.status().as_u16(), 201);
    assert_eq!(json(&resp.text().await.unwrap()), record);
    assert_eq!(demo.executions().await["total"], 1);

    // A name that is not a plain file name is ignored: answered at once, nothing written.
    let started = Instant::now();
    let (status, _) =
        demo.confirm(Some("other"), &[("x-demo-hold-after-commit", "../escape")], &transfer(json("4"))).await.unwrap();
    assert_eq!(status, 201);
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(std::fs::read_dir(faults.path()).unwrap().count(), 2, "only h-1's two files");
}
