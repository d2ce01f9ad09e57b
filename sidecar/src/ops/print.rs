//! How `idemd ops` shows rows and audit lines: aligned text for people,
//! `--json` for scripts.

use idem_core::protocol::decode_body;
use idem_core::utc::iso_utc_ms as utc;
use serde_json::{json, Value};

use crate::store::record::Record;
use crate::store::sql::audit::{AuditLine, EventLine};

fn opt_utc(ms: Option<i64>) -> String {
    ms.map(utc).unwrap_or_else(|| "-".to_string())
}

/// The stored body as text, when it is UTF-8.
fn body_text(rec: &Record) -> Option<String> {
    let r = rec.result.as_ref()?;
    String::from_utf8(decode_body(&r.body_b64)?).ok()
}

pub fn table(rows: &[Record]) -> String {
    let mut out = format!(
        "{:<32}  {:<12}  {:<24}  {:<24}  {:<24}  {:>8}  {}\n",
        "KEY", "STATE", "SCOPE", "UPDATED (UTC)", "LEASE UNTIL (UTC)", "ATTEMPTS", "OWNER"
    );
    for r in rows {
        out.push_str(&format!(
            "{:<32}  {:<12}  {:<24}  {:<24}  {:<24}  {:>8}  {}\n",
            r.key,
            r.state.as_str(),
            r.scope,
            utc(r.updated_at_ms),
            opt_utc(r.lease_until_ms),
            r.reconcile_attempts,
            r.owner.as_deref().unwrap_or("-"),
        ));
    }
    out.push_str(&format!("({} row{})\n", rows.len(), if rows.len() == 1 { "" } else { "s" }));
    out
}

pub fn record_json(r: &Record) -> Value {
    json!({
        "key": r.key,
        "state": r.state.as_str(),
        "scope": r.scope,
        "param_hash": r.param_hash,
        "subject_hash": r.subject_hash,
        "owner": r.owner,
        "lease_until_ms": r.lease_until_ms,
        "created_at_ms": r.created_at_ms,
        "updated_at_ms": r.updated_at_ms,
        "reconcile_attempts": r.reconcile_attempts,
        "fingerprint_exp_ms": r.fp_exp_ms,
        "upstream_keys": if r.upstream_ignores_keys { "ignored" } else { "honoured" },
        "business_ref": r.business_ref,
        "result": r.result,
        "result_body": body_text(r),
    })
}

pub fn show(key: &str, rec: Option<&Record>, history: &[AuditLine]) -> String {
    let mut out = String::new();
    match rec {
        None => out.push_str(&format!("{key}: no row (never acquired, released, or reaped)\n")),
        Some(r) => {
            let field = |out: &mut String, name: &str, value: &str| out.push_str(&format!("{name:<13}{value}\n"));
            field(&mut out, "key", &r.key);
            field(&mut out, "state", r.state.as_str());
            field(&mut out, "scope", &r.scope);
            field(&mut out, "owner", r.owner.as_deref().unwrap_or("-"));
            field(&mut out, "lease until", &opt_utc(r.lease_until_ms));
            field(&mut out, "created", &utc(r.created_at_ms));
            field(&mut out, "updated", &utc(r.updated_at_ms));
            field(&mut out, "fp expires", &opt_utc(r.fp_exp_ms));
            field(&mut out, "upstream", if r.upstream_ignores_keys { "ignores keys" } else { "honours keys" });
            field(&mut out, "business ref", r.business_ref.as_deref().unwrap_or("-"));
            field(&mut out, "attempts", &r.reconcile_attempts.to_string());
            field(&mut out, "param_hash", &r.param_hash);
            field(&mut out, "subject_hash", &r.subject_hash);
            if let Some(res) = &r.result {
                let ct = res.headers.iter().find(|(k, _)| k == "content-type").map(|(_, v)| v.as_str()).unwrap_or("-");
                field(&mut out, "result", &format!("HTTP {} ({ct})", res.status));
                field(&mut out, "result body", &body_text(r).unwrap_or_else(|| "(binary)".to_string()));
            }
        }
    }
    out.push_str("\nhistory\n");
    if history.is_empty() {
        out.push_str("  (no audit lines)\n");
    }
    for h in history {
        out.push_str(&format!(
            "  {}  {:<36}  {:<24}  {:>12} -> {:<12}  {}{}\n",
            utc(h.at_ms),
            h.actor,
            h.action,
            h.from_state.as_deref().unwrap_or("(none)"),
            h.to_state.as_deref().unwrap_or("(none)"),
            h.why,
            h.trace_id.as_deref().map(|t| format!("  [trace {t}]")).unwrap_or_default()
        ));
    }
    out
}

pub fn events(events: &[EventLine]) -> String {
    let mut out = format!(
        "{:<24}  {:<14}  {:<24}  {:<32}  {:<32}  {:<8}  {}\n",
        "TIME (UTC)", "KIND", "SCOPE", "KEY", "SUBJECT HASH", "BY", "TRACE ID"
    );
    for e in events {
        out.push_str(&format!(
            "{:<24}  {:<14}  {:<24}  {:<32}  {:<32}  {:<8}  {}\n",
            utc(e.at_ms),
            e.kind,
            e.scope,
            e.key.as_deref().unwrap_or("-"),
            e.subject_hash,
            e.actor,
            e.trace_id.as_deref().unwrap_or("-"),
        ));
    }
    out.push_str(&format!("({} event{})\n", events.len(), if events.len() == 1 { "" } else { "s" }));
    out
}

pub fn event_json(e: &EventLine) -> Value {
    json!({
        "at_ms": e.at_ms,
        "at": utc(e.at_ms),
        "kind": e.kind,
        "scope": e.scope,
        "key": e.key,
        "subject_hash": e.subject_hash,
        "trace_id": e.trace_id,
        "actor": e.actor,
        "why": e.why,
    })
}
