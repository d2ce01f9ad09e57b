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
    /// `idem_approval` by key.
    pub approvals: HashMap<String, ApprovalRow>,
    /// The approver's decisions idemd accepted (200): key → "approve" | "reject".
    pub decided: HashMap<String, &'static str>,
    /// Keys whose decision idemd refused as lapsed (410).
    pub refused_lapsed: Vec<String>,
    /// Every execution's transfer id → the key it executed under (the demo's rows and the hostile upstream's).
    pub transfer_owner: HashMap<String, String>,
    /// The hostile upstream's quotes by id, with what each stated about its expiry.
    pub quotes: HashMap<String, idem_hostile::Quote>,
}

/// One `idem_approval` row after the run.
#[derive(Debug, Clone)]
pub struct ApprovalRow {
    pub state: String,
    pub decided_by: Option<String>,
    /// The fingerprint's `exp`, unix ms.
    pub fp_exp_ms: i64,
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
        // Nobody is told a result that belongs to another operation.
        for tid in &seen {
            if let Some(owner) = ev.transfer_owner.get(*tid).filter(|k| **k != op.nonce) {
                v("told_another_operations_result", format!("{who}: told {tid}, which executed under {owner}"));
            }
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
    check_approvals(log, ev, &events_of, &mut v);
    check_quotes(log, ev, &mut v);
    let stray = ev.sql.iter().filter(|(k, r)| r.state == "IN_FLIGHT" && !by_nonce.contains_key(k.as_str())).count();
    if stray > 0 {
        v("left_in_flight", format!("{stray} IN_FLIGHT rows of unknown operations"));
    }
    out
}

/// `exp` never outlives the quote (DESIGN §3), on the hostile routes that read it: a fingerprint minted from a
/// hostile quote had one readable expiry (one header line, or the body's field), not past when stated, and its
/// `exp` is not later. Read with the filter's own reader of a stated expiry (`QuoteExpiry::read`).
fn check_quotes(log: &Log, ev: &Evidence, v: &mut impl FnMut(&'static str, String)) {
    use crate::record::QuoteRead;
    use idem_core::policy::QuoteExpiry;
    for op in &log.ops {
        let Some(h) = &op.hostile else { continue };
        let Some(q) = h.quote_id.as_ref().and_then(|id| ev.quotes.get(id)) else { continue };
        let who = format!(
            "op {} agent {} ({}, quote {}, hostile preview draw {})",
            op.id, op.agent, op.nonce, q.quote_id, h.draw_base
        );
        let stated = match h.quote_read {
            QuoteRead::Free => continue,
            QuoteRead::Header => match q.header_values.as_slice() {
                [one] => QuoteExpiry::read(&serde_json::Value::String(one.clone()))
                    .ok_or_else(|| format!("quote-expires-at {one:?}")),
                more => Err(format!("{} quote-expires-at lines {more:?}", more.len())),
            },
            QuoteRead::Body => match &q.expires_at {
                Some(e) => QuoteExpiry::read(e).ok_or_else(|| format!("expires_at {e}")),
                None => Err("no expires_at".into()),
            },
        };
        match stated {
            Err(why) => v("minted_on_unusable_quote", format!("{who}: minted (exp {}) on {why}", op.exp)),
            // A second of leeway either side: the upstream's and the gateway's clocks read at slightly different
            // moments.
            Ok(t) if t + 1 < q.at_unix_s => {
                v("minted_on_unusable_quote", format!("{who}: minted (exp {}) on a quote past at {t}", op.exp))
            }
            Ok(t) if op.exp > t => {
                v("fingerprint_outlives_quote", format!("{who}: exp {} after the quote's stated expiry {t}", op.exp))
            }
            Ok(_) => {}
        }
    }
}

/// Approval (DESIGN §4): nothing runs unless its approval is APPROVED; rejected and lapsed never run; what the
/// agents were told agrees with the row; what the approver decided is what the row says.
fn check_approvals(
    log: &Log,
    ev: &Evidence,
    events_of: &HashMap<usize, Vec<&Event>>,
    v: &mut impl FnMut(&'static str, String),
) {
    let by_nonce: HashMap<&str, &Op> = log.ops.iter().map(|o| (o.nonce.as_str(), o)).collect();
    // The ledger against idem_approval: every execution of an operation a person was (or should have been) asked
    // about happened with its approval APPROVED.
    for (key, n) in &ev.ledger_counts {
        let op = by_nonce.get(key.as_str());
        let row = ev.approvals.get(key);
        let asked = op.is_some_and(|o| o.approval) || row.is_some();
        if *n == 0 || !asked {
            continue;
        }
        match row.map(|r| r.state.as_str()) {
            Some("APPROVED") => {}
            Some("REJECTED") => v("rejected_executed", format!("{key}: REJECTED in idem_approval, executed {n} times")),
            Some("LAPSED") => v("lapsed_executed", format!("{key}: LAPSED in idem_approval, executed {n} times")),
            other => v("executed_without_approval", format!("{key}: approval {other:?}, executed {n} times")),
        }
    }
    for op in log.ops.iter().filter(|o| o.approval) {
        let who = format!("approval op {} agent {} ({})", op.id, op.agent, op.nonce);
        let row = ev.approvals.get(&op.nonce);
        let state = row.map(|r| r.state.as_str());
        let executed = ev.ledger_counts.get(&op.nonce).copied().unwrap_or(0) > 0;
        let mut about: Vec<&Event> = events_of.get(&op.id).cloned().unwrap_or_default();
        about.retain(|e| e.req.about_the_operation() && e.kind != "transport_error");
        about.sort_by(|a, b| recv_ms(a).total_cmp(&recv_ms(b)));
        for e in &about {
            let bad = match e.kind.as_str() {
                // Told it ran: only an approved one may have.
                "executed" | "already_completed" | "already_failed" => state != Some("APPROVED"),
                // Acquired once approved; released later (proof it never ran) and then lapsed at exp is as true.
                "in_progress" => !(state == Some("APPROVED") || (state == Some("LAPSED") && !executed)),
                "rejected" => state != Some("REJECTED") || executed,
                // Lapsed: LAPSED by the sweep, or not yet swept but past exp; and never run.
                "approval_lapsed" => {
                    let past_exp = row.is_some_and(|r| e.sent_unix_ms as i64 >= r.fp_exp_ms);
                    executed
                        || !(state == Some("LAPSED")
                            || (past_exp && matches!(state, Some("AWAITING_APPROVAL" | "APPROVED"))))
                }
                // A person was asked: a row must say so; while it waits, nothing ran.
                "approval_required" | "awaiting_approval" | "approved" => row.is_none(),
                _ => false,
            };
            if bad {
                v(
                    "approval_answer_disagrees",
                    format!(
                        "{who}: {} at t={} ms → {}, idem_approval {state:?}, executed {executed}",
                        e.req.name(),
                        e.t_ms,
                        e.kind
                    ),
                );
            }
        }
        // A decided approval's last word says what was decided.
        let last = about.last().map(|e| e.kind.as_str());
        match state {
            Some("REJECTED") if last != Some("rejected") => {
                v("approval_last_answer", format!("{who}: REJECTED, last answer {last:?}"))
            }
            // `not_executed` (released, then nobody confirmed before exp) is as true.
            Some("LAPSED") if !matches!(last, Some("approval_lapsed" | "not_executed")) => {
                v("approval_last_answer", format!("{who}: LAPSED, last answer {last:?}"))
            }
            _ => {}
        }
    }
    // What idemd accepted from the approver is what the row holds (an approved one may lapse unused, never flip).
    for (key, decision) in &ev.decided {
        let state = ev.approvals.get(key).map(|r| r.state.as_str());
        let ok = match *decision {
            "approve" => matches!(state, Some("APPROVED" | "LAPSED")),
            _ => state == Some("REJECTED"),
        };
        if !ok {
            v("decision_lost", format!("{key}: the approver's {decision} was accepted (200), idem_approval {state:?}"));
        }
        if ev.approvals.get(key).and_then(|r| r.decided_by.as_deref()).is_none() {
            v("decision_lost", format!("{key}: the approver's {decision} was accepted, no decided_by in the row"));
        }
    }
    // A decision refused as lapsed left the approval undecided: it lapsed, and nothing ran.
    for key in &ev.refused_lapsed {
        let row = ev.approvals.get(key);
        let state = row.map(|r| r.state.as_str());
        if !ev.decided.contains_key(key) && row.is_some_and(|r| r.decided_by.is_some() || state != Some("LAPSED")) {
            v("late_decision_taken", format!("{key}: a decision refused as lapsed (410), idemd_approval {row:?}"));
        }
    }
}

/// Each invariant fires on the history that breaks it (a check that cannot fail is no check).
#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Req;

    const KEY: &str = "0123456789abcdef0123456789abcdef";

    fn op() -> Op {
        Op {
            id: 0,
            agent: 0,
            subject: "agent-0".into(),
            fingerprint: "fp".into(),
            nonce: KEY.into(),
            exp: 0,
            short_ttl: false,
            approval: false,
            amount: serde_json::json!("10.00"),
            hostile: None,
        }
    }

    fn ev(t_ms: u64, req: Req, kind: &str, tid: Option<&str>) -> Event {
        Event {
            t_ms,
            sent_unix_ms: 1_000_000 + t_ms,
            agent: 0,
            op: Some(0),
            req,
            kind: kind.into(),
            http: 200,
            latency_ms: 1.0,
            transfer_id: tid.map(str::to_owned),
        }
    }

    fn log(events: Vec<Event>) -> Log {
        Log { events, ops: vec![op()], ..Default::default() }
    }

    /// Executed once as t_1 (arrived at unix second 1000), DONE in SQL with it.
    /// The evidence of an operation that never ran: no ledger row, no execution, no `idem_record` row.
    fn unexecuted() -> Evidence {
        let mut e = evidence();
        e.ledger_counts.clear();
        e.executed.clear();
        e.sql.clear();
        e
    }

    fn evidence() -> Evidence {
        Evidence {
            ledger_counts: [(KEY.to_owned(), 1)].into(),
            executed: [(KEY.to_owned(), Executed { transfer_id: "t_1".into(), created_at_s: 1000 })].into(),
            sql: [(KEY.to_owned(), SqlRow { state: "DONE".into(), transfer_id: Some("t_1".into()) })].into(),
            review_reasons: HashMap::new(),
            approvals: HashMap::new(),
            decided: HashMap::new(),
            refused_lapsed: Vec::new(),
            transfer_owner: [("t_1".to_owned(), KEY.to_owned())].into(),
            quotes: HashMap::new(),
        }
    }

    #[test]
    fn a_result_of_another_operation() {
        // t_2 executed under another key: telling this operation about it is the violation, however it is worded.
        let l = log(vec![ev(0, Req::Confirm, "already_completed", Some("t_2"))]);
        let mut e = evidence();
        e.transfer_owner.insert("t_2".into(), "another-key".into());
        assert!(kinds(&check(&l, &e)).contains(&"told_another_operations_result"));
        let clean = log(vec![ev(0, Req::Confirm, "already_completed", Some("t_1"))]);
        assert!(!kinds(&check(&clean, &e)).contains(&"told_another_operations_result"));
    }

    fn quoted(read: crate::record::QuoteRead, exp: u64) -> Log {
        let hostile = crate::record::HostileOp {
            confirm_prefix: "/hostile",
            status_prefix: "/hostile",
            client_ref: None,
            quote_read: read,
            quote_id: Some("q_1".into()),
            draw_base: 0,
            next_draw: Default::default(),
        };
        Log { ops: vec![Op { exp, hostile: Some(std::sync::Arc::new(hostile)), ..op() }], ..Default::default() }
    }

    fn quote(expires_at: Option<serde_json::Value>, headers: &[&str]) -> idem_hostile::Quote {
        idem_hostile::Quote {
            quote_id: "q_1".into(),
            expires_at,
            header_values: headers.iter().map(|h| h.to_string()).collect(),
            skew_s: 0,
            at_unix_s: 1000,
            complete: true,
        }
    }

    #[test]
    fn a_fingerprint_never_outlives_its_quote_nor_comes_from_an_unusable_one() {
        use crate::record::QuoteRead;
        let with = |q: idem_hostile::Quote| {
            let mut e = unexecuted();
            e.quotes.insert("q_1".into(), q);
            e
        };
        let hostile_kinds = |l: &Log, e: &Evidence| -> Vec<&'static str> {
            kinds(&check(l, e)).into_iter().filter(|k| k.contains("quote")).collect()
        };
        let body = |v: serde_json::Value| with(quote(Some(v), &[]));
        // Within the quote: fine, stated as a number, digits or RFC 3339.
        assert!(hostile_kinds(&quoted(QuoteRead::Body, 1030), &body(serde_json::json!(1030))).is_empty());
        assert!(hostile_kinds(&quoted(QuoteRead::Body, 1030), &body(serde_json::json!("1600"))).is_empty());
        assert!(
            hostile_kinds(&quoted(QuoteRead::Body, 1030), &body(serde_json::json!("1970-01-01T00:30:00Z"))).is_empty()
        );
        // Past it.
        assert_eq!(
            hostile_kinds(&quoted(QuoteRead::Body, 1060), &body(serde_json::json!(1030))),
            ["fingerprint_outlives_quote"]
        );
        // From a quote without a usable expiry: garbage, none, already past.
        for bad in [serde_json::json!("soon"), serde_json::json!(990)] {
            assert_eq!(hostile_kinds(&quoted(QuoteRead::Body, 1030), &body(bad)), ["minted_on_unusable_quote"]);
        }
        assert_eq!(
            hostile_kinds(&quoted(QuoteRead::Body, 1030), &with(quote(None, &[]))),
            ["minted_on_unusable_quote"]
        );
        // The header route: one line is read, two are refused whatever they say, and the body is not its business.
        let header = |h: &[&str]| with(quote(Some(serde_json::json!("soon")), h));
        assert!(hostile_kinds(&quoted(QuoteRead::Header, 1030), &header(&["1600"])).is_empty());
        assert_eq!(
            hostile_kinds(&quoted(QuoteRead::Header, 1030), &header(&["1600", "1002"])),
            ["minted_on_unusable_quote"]
        );
        assert_eq!(hostile_kinds(&quoted(QuoteRead::Header, 1030), &header(&[""])), ["minted_on_unusable_quote"]);
        // The streamed route reads no quote.
        assert!(hostile_kinds(&quoted(QuoteRead::Free, 1030), &header(&["1600", "1002"])).is_empty());
    }

    fn kinds(v: &[Violation]) -> Vec<&'static str> {
        v.iter().map(|x| x.kind).collect()
    }

    #[test]
    fn a_clean_history_passes() {
        let l = log(vec![
            ev(0, Req::Confirm, "executed", Some("t_1")),
            ev(10, Req::Confirm, "already_completed", Some("t_1")),
        ]);
        assert_eq!(kinds(&check(&l, &evidence())), Vec::<&str>::new());
    }

    #[test]
    fn two_executions_of_one_key() {
        let l = log(vec![ev(0, Req::Confirm, "executed", Some("t_1"))]);
        let mut e = evidence();
        e.ledger_counts.insert(KEY.into(), 2);
        assert_eq!(kinds(&check(&l, &e)), ["executed_twice"]);
    }

    #[test]
    fn expired_or_not_executed_after_the_agent_saw_it_execute() {
        let l =
            log(vec![ev(0, Req::Confirm, "executed", Some("t_1")), ev(2000, Req::Late, "fingerprint_expired", None)]);
        assert_eq!(kinds(&check(&l, &evidence())), ["told_expired_but_executed"]);
        let l = log(vec![
            ev(0, Req::Confirm, "executed", Some("t_1")),
            ev(5, Req::Race, "not_executed", None),
            ev(9, Req::Status, "already_completed", Some("t_1")),
        ]);
        assert_eq!(kinds(&check(&l, &evidence())), ["told_not_executed_but_executed"]);
    }

    #[test]
    fn not_executed_before_the_execution_is_the_truth_unless_it_is_the_last_word() {
        // A status poll before the confirm: true then.
        let l = log(vec![ev(0, Req::Status, "not_executed", None), ev(10, Req::Confirm, "executed", Some("t_1"))]);
        assert_eq!(kinds(&check(&l, &evidence())), Vec::<&str>::new());
        // The agent's last word says nothing ran, and it did.
        let l = log(vec![ev(0, Req::Confirm, "transport_error", None), ev(10, Req::Status, "not_executed", None)]);
        assert_eq!(kinds(&check(&l, &evidence())), ["told_not_executed_but_executed"]);
    }

    #[test]
    fn told_executed_but_sql_or_ledger_disagree() {
        let l = log(vec![ev(0, Req::Confirm, "executed", Some("t_1"))]);
        let mut e = evidence();
        e.sql.insert(KEY.into(), SqlRow { state: "FAILED".into(), transfer_id: None });
        assert_eq!(kinds(&check(&l, &e)), ["told_executed_not_done", "executed_not_done"]);
        let mut e = evidence();
        e.executed.clear();
        e.ledger_counts.clear();
        assert_eq!(kinds(&check(&l, &e)), ["told_executed_not_in_ledger"]);
        let l = log(vec![
            ev(0, Req::Confirm, "executed", Some("t_1")),
            ev(9, Req::Confirm, "already_completed", Some("t_2")),
        ]);
        assert!(kinds(&check(&l, &evidence())).contains(&"different_results"));
    }

    #[test]
    fn in_flight_left_and_indefinite_last_answers() {
        let l = log(vec![ev(0, Req::Confirm, "in_progress", None)]);
        let mut e = evidence();
        e.sql.insert(KEY.into(), SqlRow { state: "IN_FLIGHT".into(), transfer_id: None });
        assert_eq!(kinds(&check(&l, &e)), ["executed_not_done", "left_in_flight", "indefinite_last_answer"]);
        let l = log(vec![ev(0, Req::Confirm, "transport_error", None)]);
        assert!(kinds(&check(&l, &evidence())).contains(&"no_answer"));
    }

    #[test]
    fn needs_review_needs_a_row_and_a_reason() {
        let l = log(vec![ev(0, Req::Confirm, "needs_review", None)]);
        let mut e = evidence();
        e.sql.insert(KEY.into(), SqlRow { state: "NEEDS_REVIEW".into(), transfer_id: None });
        assert_eq!(kinds(&check(&l, &e)), ["needs_review_without_reason"]);
        e.review_reasons.insert(KEY.into(), "status lookups failed past the retry budget".into());
        assert_eq!(kinds(&check(&l, &e)), Vec::<&str>::new());
    }

    fn approval_row(state: &str) -> ApprovalRow {
        ApprovalRow { state: state.into(), decided_by: Some("approver-soak".into()), fp_exp_ms: 1_006_000 }
    }

    fn approval_log(events: Vec<Event>) -> Log {
        Log { events, ops: vec![Op { approval: true, ..op() }], ..Default::default() }
    }

    #[test]
    fn an_approved_operation_runs_once_and_says_so() {
        let l = approval_log(vec![
            ev(0, Req::Confirm, "approval_required", None),
            ev(900, Req::Status, "approved", None),
            ev(1000, Req::Confirm, "executed", Some("t_1")),
        ]);
        let mut e = evidence();
        e.approvals.insert(KEY.into(), approval_row("APPROVED"));
        e.decided.insert(KEY.into(), "approve");
        assert_eq!(kinds(&check(&l, &e)), Vec::<&str>::new());
    }

    #[test]
    fn an_execution_whose_approval_is_not_approved() {
        let l = approval_log(vec![ev(0, Req::Confirm, "executed", Some("t_1"))]);
        let mut e = evidence();
        assert_eq!(kinds(&check(&l, &e)), ["executed_without_approval", "approval_answer_disagrees"]);
        e.approvals.insert(KEY.into(), approval_row("AWAITING_APPROVAL"));
        assert_eq!(kinds(&check(&l, &e)), ["executed_without_approval", "approval_answer_disagrees"]);
        e.approvals.insert(KEY.into(), approval_row("REJECTED"));
        assert!(kinds(&check(&l, &e)).contains(&"rejected_executed"));
        e.approvals.insert(KEY.into(), approval_row("LAPSED"));
        assert!(kinds(&check(&l, &e)).contains(&"lapsed_executed"));
    }

    #[test]
    fn a_rejected_operation_says_rejected_to_the_end() {
        let mut e = unexecuted();
        e.approvals.insert(KEY.into(), approval_row("REJECTED"));
        e.decided.insert(KEY.into(), "reject");
        let fine =
            approval_log(vec![ev(0, Req::Confirm, "approval_required", None), ev(9, Req::Confirm, "rejected", None)]);
        assert_eq!(kinds(&check(&fine, &e)), Vec::<&str>::new());
        let lapsed = approval_log(vec![
            ev(0, Req::Confirm, "approval_required", None),
            ev(9, Req::Status, "approval_lapsed", None),
        ]);
        assert_eq!(kinds(&check(&lapsed, &e)), ["approval_answer_disagrees", "approval_last_answer"]);
        // The approver's accepted approval turned into a rejection.
        e.decided.insert(KEY.into(), "approve");
        assert!(kinds(&check(&fine, &e)).contains(&"decision_lost"));
    }

    #[test]
    fn approved_in_flight_released_then_lapsed_is_consistent() {
        let mut e = unexecuted();
        e.approvals.insert(KEY.into(), approval_row("LAPSED"));
        e.decided.insert(KEY.into(), "approve");
        let l = approval_log(vec![
            ev(0, Req::Confirm, "approval_required", None),
            ev(900, Req::Status, "approved", None),
            ev(1000, Req::Confirm, "in_progress", None),
            ev(7000, Req::Status, "approval_lapsed", None),
        ]);
        assert_eq!(kinds(&check(&l, &e)), Vec::<&str>::new());
        // In progress about a rejected one is not.
        e.approvals.insert(KEY.into(), approval_row("REJECTED"));
        e.decided.insert(KEY.into(), "reject");
        assert!(kinds(&check(&l, &e)).contains(&"approval_answer_disagrees"));
    }

    #[test]
    fn a_decision_refused_as_lapsed_leaves_it_lapsed() {
        let mut e = unexecuted();
        e.refused_lapsed.push(KEY.into());
        e.approvals.insert(KEY.into(), ApprovalRow { decided_by: None, ..approval_row("LAPSED") });
        let l = approval_log(vec![
            ev(0, Req::Confirm, "approval_required", None),
            ev(9, Req::Status, "approval_lapsed", None),
        ]);
        assert_eq!(kinds(&check(&l, &e)), Vec::<&str>::new());
        e.approvals.insert(KEY.into(), approval_row("REJECTED"));
        assert!(kinds(&check(&l, &e)).contains(&"late_decision_taken"));
    }

    #[test]
    fn the_stored_result_is_read_back() {
        let body = base64::engine::general_purpose::STANDARD.encode(br#"{"transfer_id":"t_9","status":"executed"}"#);
        let stored = serde_json::json!({"status": 201, "headers": [], "body_b64": body}).to_string();
        assert_eq!(stored_transfer_id(&stored).as_deref(), Some("t_9"));
    }
}
