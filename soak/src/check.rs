//! After the run: what the agents were told against what happened — the demo's
//! ledger (the witness of real executions) and the SQL truth.

use crate::agents::{last_answer, settled, Log};
use crate::record::{Event, Op, Violation};
use base64::Engine as _;
use idem_core::protocol::StoredResult;
use std::collections::{BTreeMap, HashMap};

/// One real execution, from the demo's own database.
#[derive(Debug, Clone)]
pub struct Executed {
    pub transfer_id: String,
    pub created_at_s: i64,
}

#[derive(Debug, Clone)]
pub struct SqlRow {
    pub state: String,
    pub transfer_id: Option<String>,
}

pub struct Evidence {
    /// GET /v1/executions `by_key`: executions per Idempotency-Key.
    pub ledger_counts: BTreeMap<String, i64>,
    /// The demo's write_record rows by request key (first one).
    pub executed: HashMap<String, Executed>,
    pub sql: HashMap<String, SqlRow>,
    /// Why each NEEDS_REVIEW row went there (the audit trail).
    pub review_reasons: HashMap<String, String>,
}

/// The transfer id in a stored result (the body the replay sends back).
pub fn stored_transfer_id(result: &str) -> Option<String> {
    let r: StoredResult = serde_json::from_str(result).ok()?;
    let body = base64::engine::general_purpose::STANDARD.decode(r.body_b64).ok()?;
    let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
    v["transfer_id"].as_str().map(str::to_owned)
}

/// How long after the demo stamped a transfer its commit is surely over (the slow-upstream delays are < 2.4 s).
const COMMIT_WITHIN_S: i64 = 4;

fn recv_ms(e: &Event) -> f64 {
    e.t_ms as f64 + e.latency_ms
}

pub fn check(log: &Log, ev: &Evidence) -> Vec<Violation> {
    let mut out = Vec::new();
    let mut v = |kind: &'static str, detail: String| out.push(Violation { kind, detail });
    let by_nonce: HashMap<&str, &Op> = log.ops.iter().map(|o| (o.nonce.as_str(), o)).collect();
    let mut events_of: HashMap<usize, Vec<&Event>> = HashMap::new();
    for e in &log.events {
        if let Some(op) = e.op {
            events_of.entry(op).or_default().push(e);
        }
    }
    let describe = |e: &Event| format!("{} at t={} ms → {} {}", e.req.name(), e.t_ms, e.http, e.kind);

    // At most once in the physical world.
    for (key, n) in &ev.ledger_counts {
        if *n > 1 {
            let op = by_nonce.get(key.as_str()).map(|o| format!("op {} agent {}", o.id, o.agent)).unwrap_or_default();
            v("executed_twice", format!("{key} ({op}): the demo executed it {n} times"));
        }
        if !by_nonce.contains_key(key.as_str()) {
            v("unknown_execution", format!("the demo executed {key}, which no agent was given"));
        }
    }

    for op in &log.ops {
        let events = events_of.get(&op.id).cloned().unwrap_or_default();
        let who =
            format!("op {} agent {} ({}{})", op.id, op.agent, op.nonce, if op.short_ttl { ", 2 s TTL" } else { "" });
        let sql = ev.sql.get(&op.nonce);
        let executed = ev.executed.get(&op.nonce);

        // What the agent was told executed is DONE in SQL with the same result, and is in the ledger.
        let mut seen: Vec<&str> = events.iter().filter_map(|e| e.transfer_id.as_deref()).collect();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() > 1 {
            v("different_results", format!("{who}: told of transfers {seen:?}"));
        }
        if let Some(tid) = seen.first() {
            match sql {
                Some(row) if row.state == "DONE" && row.transfer_id.as_deref() == Some(*tid) => {}
                Some(row) => v(
                    "told_executed_not_done",
                    format!("{who}: told {tid}, SQL has {} {:?}", row.state, row.transfer_id),
                ),
                None => v("told_executed_not_done", format!("{who}: told {tid}, SQL has no row")),
            }
            if executed.map(|x| x.transfer_id.as_str()) != Some(*tid) {
                v("told_executed_not_in_ledger", format!("{who}: told {tid}, the demo's ledger has {executed:?}"));
            }
        }
        // What executed is DONE in SQL (or waits for a person), with the ledger's result.
        if let Some(x) = executed {
            match sql {
                Some(row) if row.state == "DONE" && row.transfer_id.as_deref() == Some(x.transfer_id.as_str()) => {}
                Some(row) if row.state == "NEEDS_REVIEW" => {}
                Some(row) => v(
                    "executed_not_done",
                    format!("{who}: the demo executed {}, SQL has {} {:?}", x.transfer_id, row.state, row.transfer_id),
                ),
                None => v("executed_not_done", format!("{who}: the demo executed {}, SQL has no row", x.transfer_id)),
            }
        }
        if sql.is_some_and(|r| r.state == "IN_FLIGHT") {
            v("left_in_flight", format!("{who}: still IN_FLIGHT after the reconciler settled"));
        }

        // The last word is definite, or a person reviews it for a stated reason.
        match last_answer(&log.events, op.id) {
            None => v("no_answer", format!("{who}: never got an answer about its operation")),
            Some(k) if !settled(&k) => v("indefinite_last_answer", format!("{who}: last answer {k}")),
            Some(k) if k == "needs_review" => {
                let reason = ev.review_reasons.get(&op.nonce).filter(|r| !r.trim().is_empty());
                if sql.map(|r| r.state.as_str()) != Some("NEEDS_REVIEW") || reason.is_none() {
                    v(
                        "needs_review_without_reason",
                        format!("{who}: SQL {:?}, audit reason {reason:?}", sql.map(|r| &r.state)),
                    );
                }
            }
            Some(_) => {}
        }

        // Never "nothing was executed" about an operation that executed.
        if let Some(x) = executed {
            let mut about: Vec<&Event> = events.iter().copied().filter(|e| e.req.about_the_operation()).collect();
            about.sort_by(|a, b| recv_ms(a).total_cmp(&recv_ms(b)));
            let last = about.iter().rev().find(|e| e.kind != "transport_error").map(|e| (e.t_ms, e.req));
            for e in &about {
                if e.kind != "not_executed" && e.kind != "fingerprint_expired" {
                    continue;
                }
                let told_before = about.iter().any(|p| p.transfer_id.is_some() && recv_ms(p) < e.t_ms as f64);
                // The demo stamps a transfer when the request arrives (floored to the second) and commits after the
                // injected delay (< 2.4 s): 5 s later the commit was surely over.
                let committed_before = e.sent_unix_ms as i64 > (x.created_at_s + 1 + COMMIT_WITHIN_S) * 1000;
                let is_last = last == Some((e.t_ms, e.req));
                if told_before || committed_before || is_last {
                    let why = [
                        (told_before, "after the agent was told it executed"),
                        (committed_before, "sent well after the commit"),
                        (is_last, "as its last answer"),
                    ]
                    .iter()
                    .filter(|(b, _)| *b)
                    .map(|(_, s)| *s)
                    .collect::<Vec<_>>()
                    .join(", ");
                    let history: Vec<String> = about.iter().map(|e| describe(e)).collect();
                    let kind = if e.kind == "fingerprint_expired" {
                        "told_expired_but_executed"
                    } else {
                        "told_not_executed_but_executed"
                    };
                    v(
                        kind,
                        format!(
                            "{who}: {} ({why}); executed as {}; history: {}",
                            describe(e),
                            x.transfer_id,
                            history.join("; ")
                        ),
                    );
                }
            }
        }
    }
    let stray = ev.sql.iter().filter(|(k, r)| r.state == "IN_FLIGHT" && !by_nonce.contains_key(k.as_str())).count();
    if stray > 0 {
        v("left_in_flight", format!("{stray} IN_FLIGHT rows of unknown operations"));
    }
    out
}
