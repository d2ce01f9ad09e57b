//! The business contract: preview, confirm, deduplication, status by key.

mod support;

use serde_json::{json, Value};
use support::{json, transfer, Demo};

#[tokio::test]
async fn healthz() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &[]);
    assert_eq!(demo.get("/healthz").await, (200, json!({ "ok": true })));
}

#[tokio::test]
async fn preview_echoes_the_amount_literal() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &[]);
    for (amount, echoed) in [("12.50", "12.50"), (r#""0012.50""#, r#""0012.50""#), ("100.000", "100.000")] {
        let body = format!(r#"{{"amount":{amount},"currency":"EUR","payee_id":"p1","memo":"x"}}"#);
        let resp = demo
            .client
            .post(demo.url("/v1/transfers/preview"))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        let quote = json(&resp.text().await.unwrap());
        assert_eq!(quote["amount"].to_string(), echoed);
        assert_eq!(quote["currency"], "EUR");
        assert_eq!(quote["payee_id"], "p1");
        assert_eq!(quote["fee"], "1.00");
        let id = quote["quote_id"].as_str().unwrap();
        assert!(id.starts_with("q_") && id.len() == 18, "{id}");
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        let expires = quote["expires_at"].as_u64().unwrap();
        assert!((now + 890..=now + 910).contains(&expires), "{expires}");
    }
}

#[tokio::test]
async fn preview_rejects_invalid_requests() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &[]);
    for body in [
        "not json",
        r#"{"currency":"EUR","payee_id":"p1"}"#,
        r#"{"amount":"12,50","currency":"EUR","payee_id":"p1"}"#,
        r#"{"amount":10,"currency":7,"payee_id":"p1"}"#,
    ] {
        let resp = demo.client.post(demo.url("/v1/transfers/preview")).body(body).send().await.unwrap();
        assert_eq!(resp.status().as_u16(), 400, "{body}");
        let err: Value = resp.json().await.unwrap();
        assert_eq!(err["error"], "invalid_request");
        assert!(err["detail"].is_string());
    }
}

#[tokio::test]
async fn confirm_executes_once_and_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &[]);
    let (status, body) = demo
        .confirm(Some("k1"), &[], &json("{\"amount\":\"12.50\",\"currency\":\"EUR\",\"payee_id\":\"p1\",\"memo\":\"rent\",\"fingerprint\":\"abc.def\"}"))
        .await
        .unwrap();
    assert_eq!(status, 201);
    let record = json(&body);
    assert_eq!(record["status"], "executed");
    assert_eq!(record["amount"], "12.50");
    assert_eq!(record["currency"], "EUR");
    assert_eq!(record["payee_id"], "p1");
    assert_eq!(record["memo"], "rent");
    assert_eq!(record["idempotency_key"], "k1");
    assert!(record["executed_at"].is_u64());
    let id = record["transfer_id"].as_str().unwrap();
    assert!(id.starts_with("t_") && id.len() == 18, "{id}");

    assert_eq!(
        demo.executions().await,
        json!({ "total": 1, "by_key": { "k1": 1 }, "attempts": 1, "attempts_by_key": { "k1": 1 } })
    );
}

#[tokio::test]
async fn duplicate_key_replays_the_stored_record() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &[]);
    let first = demo.confirm(Some("dup"), &[], &transfer(json("100"))).await.unwrap();
    // Different memo on the retry: the stored record still wins.
    let mut drifted = transfer(json("100"));
    drifted["memo"] = json!("rent, please ASAP");
    let second = demo.confirm(Some("dup"), &[], &drifted).await.unwrap();
    assert_eq!(first.0, 201);
    assert_eq!(second, first);
    assert_eq!(
        demo.executions().await,
        json!({ "total": 1, "by_key": { "dup": 1 }, "attempts": 2, "attempts_by_key": { "dup": 2 } })
    );
}

#[tokio::test]
async fn concurrent_duplicates_execute_once() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &[]);
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let request =
            demo.client.post(demo.url("/v1/transfers")).header("Idempotency-Key", "race").json(&transfer(json("5")));
        calls.spawn(async move {
            let resp = request.send().await.unwrap();
            (resp.status().as_u16(), resp.text().await.unwrap())
        });
    }
    let results = calls.join_all().await;
    assert_eq!(results[0].0, 201);
    assert!(results.iter().all(|r| r == &results[0]));
    let exec = demo.executions().await;
    assert_eq!(exec["total"], 1);
    assert_eq!(exec["attempts_by_key"]["race"], 8);
}

#[tokio::test]
async fn no_dedup_executes_every_confirm() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &["--no-dedup"]);
    let (s1, b1) = demo.confirm(Some("k"), &[], &transfer(json("7"))).await.unwrap();
    let (s2, b2) = demo.confirm(Some("k"), &[], &transfer(json("7"))).await.unwrap();
    assert_eq!((s1, s2), (201, 201));
    assert_ne!(json(&b1)["transfer_id"], json(&b2)["transfer_id"]);
    assert_eq!(
        demo.executions().await,
        json!({ "total": 2, "by_key": { "k": 2 }, "attempts": 2, "attempts_by_key": { "k": 2 } })
    );
    // Status by key reports the first execution.
    assert_eq!(demo.get("/v1/transfers/by-key/k").await, (200, json(&b1)));
    // Keys are still required.
    let (status, _) = demo.confirm(None, &[], &transfer(json("7"))).await.unwrap();
    assert_eq!(status, 428);
}

#[tokio::test]
async fn no_dedup_from_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let db = support::db_path(dir.path());
    let demo = Demo::start_with(&db, &[], &[("DEMO_NO_DEDUP", "1")]);
    demo.confirm(Some("k"), &[], &transfer(json("7"))).await.unwrap();
    demo.confirm(Some("k"), &[], &transfer(json("7"))).await.unwrap();
    assert_eq!(demo.executions().await["total"], 2);
}

/// `--no-keys`, a downstream without key support: the header is never read (no 428 without one,
/// a repeated key executes again, nothing is found by key); the confirm's `client_ref` finds the
/// first transfer sent with it.
#[tokio::test]
async fn no_keys_executes_every_confirm_and_finds_it_by_client_ref() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &["--no-keys"]);
    let mut body = transfer(json("7"));
    body["client_ref"] = json!("inv/7 2026");
    let (s1, b1) = demo.confirm(Some("k"), &[], &body).await.unwrap();
    let (s2, b2) = demo.confirm(Some("k"), &[], &body).await.unwrap();
    let (s3, b3) = demo.confirm(None, &[], &transfer(json("7"))).await.unwrap();
    assert_eq!((s1, s2, s3), (201, 201, 201), "{b1} {b2} {b3}");
    let first = json(&b1);
    assert_ne!(first["transfer_id"], json(&b2)["transfer_id"], "the same key executed twice");
    assert_eq!(first["client_ref"], "inv/7 2026");
    assert!(first.get("idempotency_key").is_none(), "a service without keys knows none: {first}");
    assert!(json(&b3).get("client_ref").is_none(), "{b3}");
    assert_eq!(demo.executions().await, json!({ "total": 3, "by_key": {}, "attempts": 3, "attempts_by_key": {} }));
    assert_eq!(demo.get("/v1/transfers/by-ref/inv%2F7%202026").await, (200, first));
    assert_eq!(demo.get("/v1/transfers/by-ref/inv-8").await, (404, json!({ "error": "not_found" })));
    assert_eq!(demo.get("/v1/transfers/by-key/k").await.0, 404, "it never stored the key");
    // What it refuses, it refuses as always.
    let mut bad = transfer(json("7"));
    bad["client_ref"] = json!("");
    assert_eq!(demo.confirm(None, &[], &bad).await.unwrap().0, 400);
    assert_eq!(demo.executions().await["total"], 3);
}

#[tokio::test]
async fn client_ref_is_stored_with_keys_too() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &[]);
    let mut body = transfer(json("7"));
    body["client_ref"] = json!("inv-1");
    let (status, record) = demo.confirm(Some("k1"), &[], &body).await.unwrap();
    assert_eq!(status, 201);
    assert_eq!(json(&record)["idempotency_key"], "k1");
    assert_eq!(demo.get("/v1/transfers/by-ref/inv-1").await, (200, json(&record)));
}

/// A ledger written before `client_ref` existed keeps its transfers and gains the column.
#[tokio::test]
async fn a_ledger_from_before_client_ref_gains_the_column() {
    let dir = tempfile::tempdir().unwrap();
    let db = support::db_path(dir.path());
    let url = format!("sqlite://{db}?mode=rwc");
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE write_record (id INTEGER PRIMARY KEY, idem_key TEXT NOT NULL UNIQUE, request_key TEXT NOT NULL,
           transfer_id TEXT NOT NULL, amount TEXT NOT NULL, currency TEXT NOT NULL, payee_id TEXT NOT NULL, memo TEXT,
           response TEXT NOT NULL, created_at INTEGER NOT NULL);
         INSERT INTO write_record VALUES (1, 'old', 'old', 't_0', '1', 'EUR', 'p', NULL, '{\"transfer_id\":\"t_0\"}', 0);",
    )
    .execute(&pool)
    .await
    .unwrap();
    pool.close().await;
    let demo = Demo::start_with(&db, &[], &[]);
    assert_eq!(demo.get("/v1/transfers/by-key/old").await, (200, json!({ "transfer_id": "t_0" })));
    let mut body = transfer(json("7"));
    body["client_ref"] = json!("inv-2");
    let (status, record) = demo.confirm(Some("new"), &[], &body).await.unwrap();
    assert_eq!(status, 201);
    assert_eq!(demo.get("/v1/transfers/by-ref/inv-2").await, (200, json(&record)));
}

#[tokio::test]
async fn confirm_without_key_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &[]);
    let (status, body) = demo.confirm(None, &[], &transfer(json("7"))).await.unwrap();
    assert_eq!(status, 428);
    assert_eq!(json(&body), json!({ "error": "idempotency_key_required" }));
    let (status, _) = demo.confirm(Some(""), &[], &transfer(json("7"))).await.unwrap();
    assert_eq!(status, 428);
    // Counted as attempts, under no key; nothing executed.
    assert_eq!(demo.executions().await, json!({ "total": 0, "by_key": {}, "attempts": 2, "attempts_by_key": {} }));
}

#[tokio::test]
async fn over_the_limit_is_refused_and_not_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &[]);
    let (status, body) = demo.confirm(Some("big"), &[], &transfer(json("\"10000.01\""))).await.unwrap();
    assert_eq!(status, 422);
    assert_eq!(json(&body), json!({ "error": "limit_exceeded" }));
    assert_eq!(demo.get("/v1/transfers/by-key/big").await.0, 404);
    let exec = demo.executions().await;
    assert_eq!(exec["total"], 0);
    assert_eq!(exec["attempts_by_key"]["big"], 1);
    // The limit itself is allowed.
    let (status, _) = demo.confirm(Some("max"), &[], &transfer(json("10000"))).await.unwrap();
    assert_eq!(status, 201);
}

#[tokio::test]
async fn invalid_confirm_is_refused_and_not_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &[]);
    let (status, body) = demo.confirm(Some("bad"), &[], &json!({ "amount": "1", "currency": "EUR" })).await.unwrap();
    assert_eq!(status, 400);
    assert_eq!(json(&body)["error"], "invalid_request");
    assert_eq!(demo.executions().await["total"], 0);
}

#[tokio::test]
async fn status_by_key() {
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &[]);
    assert_eq!(demo.get("/v1/transfers/by-key/nope").await, (404, json!({ "error": "not_found" })));
    let (_, body) = demo.confirm(Some("abc123"), &[], &transfer(json("3.10"))).await.unwrap();
    let resp = demo.client.get(demo.url("/v1/transfers/by-key/abc123")).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    // Byte for byte the original answer.
    assert_eq!(resp.text().await.unwrap(), body);
}

#[tokio::test]
async fn creates_the_database_directory_and_keeps_data_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/nested/deeper/demo.db", dir.path().display());
    let body = {
        let demo = Demo::start_with(&url, &[], &[]);
        demo.confirm(Some("keep"), &[], &transfer(json("1"))).await.unwrap().1
    };
    let demo = Demo::start_with(&url, &[], &[]);
    assert_eq!(demo.get("/v1/transfers/by-key/keep").await, (200, json(&body)));
    assert_eq!(
        demo.executions().await,
        json!({ "total": 1, "by_key": { "keep": 1 }, "attempts": 1, "attempts_by_key": { "keep": 1 } })
    );
}

#[test]
fn keep_alive_serves_several_requests_on_one_connection() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let demo = Demo::start(dir.path(), &[]);
    let mut conn = std::net::TcpStream::connect(&demo.addr).unwrap();
    for _ in 0..3 {
        let body = r#"{"amount":1,"currency":"EUR","payee_id":"p"}"#;
        write!(
            conn,
            "POST /v1/transfers/preview HTTP/1.1\r\nHost: demo\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let head = support::read_head(&mut conn);
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        let len: usize = head
            .lines()
            .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse().unwrap()))
            .unwrap();
        let mut body = vec![0; len];
        conn.read_exact(&mut body).unwrap();
        assert_eq!(json(std::str::from_utf8(&body).unwrap())["amount"], 1);
    }
}
