//! The hostile upstream over real sockets: each branch goes on the wire as drawn (repeated headers, escaped
//! keys, chunks, cuts), HTTP/1.1 and h2c, and the ledger says what executed.

use idem_hostile::grammar::{Delivery, Outcome, PreviewPlan, QuoteHeader, Shape, Spelling};
use idem_hostile::{Config, Hostile, Plan, Role, DRAW_HEADER, PLAN_HEADER};
use serde_json::{json, Value};

type R = Result<(), Box<dyn std::error::Error>>;

const SEED: u64 = 35;

async fn start() -> Result<Hostile, Box<dyn std::error::Error>> {
    Ok(Hostile::start("127.0.0.1:0", Config::new(SEED)).await?)
}

fn transfer() -> Value {
    json!({"amount": "10.00", "currency": "EUR", "payee_id": "p-1", "memo": "rent"})
}

/// The draw of `role` whose plan `want`s.
fn draw(h: &Hostile, role: Role, want: impl Fn(&Plan) -> bool) -> String {
    h.grammar().find(role, 20_000, want).expect("the grammar draws it").to_string()
}

#[tokio::test]
async fn a_repeated_quote_header_goes_out_as_two_lines() -> R {
    let h = start().await?;
    let d = draw(&h, Role::Preview, |p| {
        matches!(p, Plan::Preview(PreviewPlan { quote_header: QuoteHeader::Twice(..), delivery: Delivery::Whole, .. }))
    });
    let r = reqwest::Client::new()
        .post(h.url("/v1/transfers/preview"))
        .header(DRAW_HEADER, &d)
        .json(&transfer())
        .send()
        .await?;
    let values: Vec<String> =
        r.headers().get_all("quote-expires-at").iter().map(|v| String::from_utf8_lossy(v.as_bytes()).into()).collect();
    assert_eq!(values.len(), 2, "{values:?}");
    assert_ne!(values[0], values[1]);
    // The ledger keeps what was stated, under the quote's id.
    let body = r.text().await?;
    if let Ok(v) = serde_json::from_str::<Value>(&body) {
        if let Some(id) = v["quote_id"].as_str() {
            assert_eq!(h.ledger.quotes()[id].header_values, values);
        }
    }
    Ok(())
}

#[tokio::test]
async fn an_escaped_self_named_field_reaches_the_wire_escaped() -> R {
    let h = start().await?;
    let d = draw(&h, Role::Preview, |p| {
        matches!(
            p,
            Plan::Preview(PreviewPlan {
                status: idem_hostile::grammar::PreviewStatus::Quote,
                shape: Shape::Named { spelling: Spelling::Escaped, .. },
                delivery: Delivery::Whole | Delivery::Sized { .. } | Delivery::Chunked { .. },
                ..
            })
        )
    });
    let body = reqwest::Client::new()
        .post(h.url("/v1/transfers/preview"))
        .header(DRAW_HEADER, &d)
        .json(&transfer())
        .send()
        .await?
        .text()
        .await?;
    assert!(body.contains(r#""\u0066ingerprint":"#), "{body}");
    let v: Value = serde_json::from_str(&body)?;
    assert!(v["fingerprint"].is_string(), "a JSON decoder reads it as `fingerprint`: {body}");
    Ok(())
}

#[tokio::test]
async fn an_echo_hands_the_agent_its_previous_fingerprint() -> R {
    let h = start().await?;
    let d = draw(&h, Role::Preview, |p| {
        matches!(
            p,
            Plan::Preview(PreviewPlan {
                status: idem_hostile::grammar::PreviewStatus::Quote,
                shape: Shape::Echo,
                delivery: Delivery::Whole,
                ..
            })
        )
    });
    let mut req = transfer();
    req["fingerprint"] = json!("previous.operation");
    let v: Value = reqwest::Client::new()
        .post(h.url("/v1/transfers/preview"))
        .header(DRAW_HEADER, &d)
        .json(&req)
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(v["fingerprint"], "previous.operation");
    assert!(v["quote_id"].as_str().is_some_and(|q| q.starts_with("q_")));
    Ok(())
}

#[tokio::test]
async fn the_ledger_counts_executions_per_key_and_lookups_answer_them() -> R {
    let h = start().await?;
    let http = reqwest::Client::new();
    let confirm = |key: &'static str, plan: Option<&'static str>, draw: Option<String>| {
        let mut rb = http.post(h.url("/v1/transfers")).header("idempotency-key", key).json(&transfer());
        if let Some(p) = plan {
            rb = rb.header(PLAN_HEADER, p);
        }
        if let Some(d) = draw {
            rb = rb.header(DRAW_HEADER, d);
        }
        rb.send()
    };
    let r = confirm("k1", Some("honest"), None).await?;
    assert_eq!(r.status(), 201);
    let first: Value = r.json().await?;
    // Executes again: this upstream never deduplicates, so its ledger sees every forward.
    assert_eq!(confirm("k1", Some("honest"), None).await?.status(), 201);
    // Executed, then a 502: the ledger has it though the caller was told an error.
    let d = draw(&h, Role::Confirm, |p| matches!(p, Plan::Confirm(c) if c.outcome == Outcome::ExecuteThenError(502)));
    assert_eq!(confirm("k2", None, Some(d)).await?.status(), 502);
    // Executed, then cut without an answer.
    let d = draw(&h, Role::Confirm, |p| matches!(p, Plan::Confirm(c) if c.outcome == Outcome::ExecuteThenReset));
    assert!(confirm("k3", None, Some(d)).await.is_err());
    // Refused before executing.
    let d = draw(&h, Role::Confirm, |p| matches!(p, Plan::Confirm(c) if c.outcome == Outcome::Busy));
    assert_eq!(confirm("k4", None, Some(d)).await?.status(), 429);

    let by_key = h.ledger.executions_by_key();
    assert_eq!(by_key.get("k1"), Some(&2));
    assert_eq!(by_key.get("k2"), Some(&1));
    assert_eq!(by_key.get("k3"), Some(&1));
    assert_eq!(by_key.get("k4"), None);
    let over_http: Value = http.get(h.url("/v1/executions")).send().await?.json().await?;
    assert_eq!(over_http["by_key"]["k1"], 2);
    assert_eq!(over_http["attempts_by_key"]["k4"], 1);
    let full: Value = http.get(h.url("/v1/hostile/ledger")).send().await?.json().await?;
    assert_eq!(full["executions"].as_array().map(Vec::len), Some(4));

    // The reconciler's question, answered honestly: the first execution's record, byte for byte.
    let r = http.get(h.url("/v1/transfers/by-key/k1")).header(PLAN_HEADER, "honest").send().await?;
    assert_eq!(r.status(), 200);
    let found: Value = r.json().await?;
    assert_eq!(found["transfer_id"], first["transfer_id"]);
    let r = http.get(h.url("/v1/transfers/by-key/nope")).header(PLAN_HEADER, "honest").send().await?;
    assert_eq!(r.status(), 404);
    Ok(())
}

#[tokio::test]
async fn a_shared_reference_names_the_first_operation_that_used_it() -> R {
    let h = start().await?;
    let http = reqwest::Client::new();
    let mut ids = Vec::new();
    for key in ["a", "b"] {
        let mut body = transfer();
        body["client_ref"] = json!("inv 7/2026");
        let v: Value = http
            .post(h.url("/v1/transfers"))
            .header("idempotency-key", key)
            .header(PLAN_HEADER, "honest")
            .json(&body)
            .send()
            .await?
            .json()
            .await?;
        ids.push(v["transfer_id"].clone());
    }
    let found: Value = http
        .get(h.url("/v1/transfers/by-ref/inv%207%2F2026"))
        .header(PLAN_HEADER, "honest")
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(found["transfer_id"], ids[0], "b's lookup by reference finds a's transfer");
    assert_eq!(found["idempotency_key"], "a");
    Ok(())
}

#[tokio::test]
async fn chunked_and_truncated_bodies() -> R {
    let h = start().await?;
    let http = reqwest::Client::new();
    let chunked = draw(
        &h,
        Role::Confirm,
        |p| matches!(p, Plan::Confirm(c) if c.outcome == Outcome::Execute(201) && matches!(c.delivery, Delivery::Chunked { .. })),
    );
    let r = http.post(h.url("/v1/transfers")).header(DRAW_HEADER, chunked).json(&transfer()).send().await?;
    assert!(r.headers().get("content-length").is_none(), "chunked: no length");
    let v: Value = serde_json::from_slice(&r.bytes().await?)?;
    assert_eq!(v["status"], "executed");

    let cut = draw(
        &h,
        Role::Confirm,
        |p| matches!(p, Plan::Confirm(c) if c.outcome == Outcome::Execute(201) && c.delivery == Delivery::Truncated),
    );
    let r = http.post(h.url("/v1/transfers")).header(DRAW_HEADER, cut).json(&transfer()).send().await?;
    assert_eq!(r.status(), 201);
    assert!(r.bytes().await.is_err(), "the body ends before its length");
    assert_eq!(h.ledger.executions().len(), 2, "both executed");
    Ok(())
}

#[tokio::test]
async fn h2c_with_prior_knowledge() -> R {
    let h = start().await?;
    let tcp = tokio::net::TcpStream::connect(h.addr).await?;
    let (client, conn) = h2::client::handshake(tcp).await?;
    tokio::spawn(conn);
    let mut client = client.ready().await?;
    let req = http::Request::builder()
        .method("POST")
        .uri(h.url("/v1/transfers"))
        .header("idempotency-key", "h2-key")
        .header(PLAN_HEADER, "honest")
        .body(())?;
    let (resp, mut send) = client.send_request(req, false)?;
    send.send_data(bytes::Bytes::from(transfer().to_string()), true)?;
    let resp = resp.await?;
    assert_eq!(resp.status(), 201);
    let mut body = resp.into_body();
    let mut buf = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk?;
        let _ = body.flow_control().release_capacity(chunk.len());
        buf.extend_from_slice(&chunk);
    }
    let v: Value = serde_json::from_slice(&buf)?;
    assert_eq!(v["idempotency_key"], "h2-key");
    assert_eq!(h.ledger.executions_by_key().get("h2-key"), Some(&1));
    Ok(())
}
