//! The approvers' console (DESIGN §4, "Approval"): one server-rendered page, no front-end build.
//!
//! `GET /approvals` lists what waits for a person (the bound fields, scope, subject hash, age and
//! expiry) with an approve/reject form each, and the NEEDS_REVIEW operations with a resolve form
//! (`release`, `done` with the result the agent gets, or `failed` with a reason for it, checked and
//! written as `idemd ops resolve` does: `review::resolve`). An operation of the signed-in
//! approver's own subject gets no form, only a line saying another person decides it (and a posted
//! form for it is refused, `own_subject`); a release asks the scope's status endpoint at that moment
//! and is refused, saying what it found, unless the operation is absent there.
//! `POST /approvals/{key}` and `POST /approvals/review/{key}` take the forms and answer 303 back to
//! the page. Behind the approvers' credential (HTTP Basic in a browser, `crate::approvals`); every
//! value printed is HTML-escaped; every form carries a CSRF token bound to the approver, and a POST
//! without the right one changes nothing (403): a browser sends Basic credentials by itself, so a
//! credential alone proves nothing about who built the form.

use std::fmt::Write as _;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use idem_core::protocol::{Decision, OpKey, OpState};

use crate::approvals::{ApprovalsState, Approver};
use crate::review::{self, Ask, ResolveAs};
use crate::store::now_ms;

/// Text for HTML (element content and double-quoted attributes).
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[derive(serde::Deserialize, Default)]
pub struct Notice {
    #[serde(default)]
    done: Option<String>,
    #[serde(default)]
    error: Option<String>,
}

/// `GET /approvals`.
pub async fn page(
    State(state): State<ApprovalsState>,
    Extension(approver): Extension<Approver>,
    Query(notice): Query<Notice>,
) -> Response {
    let pending = state.store.pending_approvals(200).await;
    let review = state.store.sql().list_in_state(OpState::NeedsReview, 200).await;
    let (Ok(pending), Ok(review)) = (pending, review) else {
        return (StatusCode::SERVICE_UNAVAILABLE, html_page("<p>The store cannot be asked right now.</p>"))
            .into_response();
    };
    let csrf = escape(&state.csrf.token(&approver.0));
    let now = now_ms();
    let mut body = String::new();
    let _ = write!(body, "<p class=\"who\">Signed in as <b>{}</b></p>", escape(&approver.0));
    if let Some(done) = notice.done {
        let _ = write!(body, "<p class=\"notice\" id=\"notice\">{}</p>", escape(&done));
    }
    if let Some(error) = notice.error {
        let _ = write!(body, "<p class=\"error\" id=\"notice\">{}</p>", escape(&error));
    }
    let _ = write!(body, "<h2>Waiting for approval ({})</h2>", pending.len());
    if pending.is_empty() {
        body.push_str("<p id=\"no-pending\">Nothing waits for approval.</p>");
    }
    for row in &pending {
        let key = escape(&row.key);
        let _ = write!(
            body,
            "<section class=\"approval\" id=\"approval-{key}\"><h3>Operation <code>{key}</code></h3><table>\
             <tr><th>scope</th><td>{}</td></tr><tr><th>subject hash</th><td><code>{}</code></td></tr>\
             <tr><th>waiting</th><td>{} s</td></tr><tr><th>lapses in</th><td>{} s</td></tr></table>\
             <h4>Bound fields</h4><table class=\"fields\">{}</table>\
             <form method=\"post\" action=\"/approvals/{key}\">\
             <input type=\"hidden\" name=\"csrf\" value=\"{csrf}\">\
             <label>Reason <input type=\"text\" name=\"reason\" required maxlength=\"1000\"></label>\
             <button type=\"submit\" name=\"decision\" value=\"approve\" class=\"approve\">Approve</button>\
             <button type=\"submit\" name=\"decision\" value=\"reject\" class=\"reject\">Reject</button>\
             </form></section>",
            escape(&row.scope),
            escape(&row.subject_hash),
            (now - row.created_at_ms).max(0) / 1000,
            (row.fp_exp_ms - now).max(0) / 1000,
            fields_rows(&row.fields),
        );
    }
    let _ = write!(body, "<h2>Needs review ({})</h2>", review.len());
    if review.is_empty() {
        body.push_str("<p id=\"no-review\">No operation needs review.</p>");
    }
    let own = idem_core::fingerprint::subject_hash(&approver.0);
    for rec in &review {
        let key = escape(&rec.key);
        let _ = write!(
            body,
            "<section class=\"review\" id=\"review-{key}\"><h3>Operation <code>{key}</code></h3>\
             <p>scope {}, subject hash <code>{}</code>, unchanged for {} s</p>",
            escape(&rec.scope),
            escape(&rec.subject_hash),
            (now - rec.updated_at_ms).max(0) / 1000,
        );
        // The same rule the server applies when the form comes back (review).
        if crate::store::rules::own_subject(&rec.subject_hash, &own, state.approvers.allow_self) {
            body.push_str(
                "<p class=\"own\">This is an operation of your own subject: another person must resolve it.</p>\
                 </section>",
            );
            continue;
        }
        let _ = write!(
            body,
            "<form method=\"post\" action=\"/approvals/review/{key}\">\
             <input type=\"hidden\" name=\"csrf\" value=\"{csrf}\">\
             <label>Outcome <select name=\"outcome\"><option value=\"release\">never ran: release (the agent's \
             retry runs it; the upstream is asked now and must have no record of it)</option>\
             <option value=\"done\">it ran: done</option>\
             <option value=\"failed\">refused: failed</option></select></label>\
             <label>Result the agent gets (done: the upstream's JSON answer) <textarea name=\"result\" rows=\"3\" \
             maxlength=\"65536\"></textarea></label>\
             <label>Reason for the agent (failed) <input type=\"text\" name=\"reason\" maxlength=\"1000\"></label>\
             <label>Why (audit) <input type=\"text\" name=\"why\" required maxlength=\"1000\"></label>\
             <button type=\"submit\">Resolve</button></form></section>"
        );
    }
    html_page(&body).into_response()
}

/// The bound fields' canonical JSON as table rows: pointer, value, both escaped.
fn fields_rows(fields: &str) -> String {
    let mut out = String::new();
    match serde_json::from_str::<serde_json::Value>(fields) {
        Ok(serde_json::Value::Object(map)) => {
            for (pointer, value) in map {
                let text = match value {
                    serde_json::Value::String(s) => s,
                    other => other.to_string(),
                };
                let _ = write!(out, "<tr><th>{}</th><td class=\"value\">{}</td></tr>", escape(&pointer), escape(&text));
            }
        }
        _ => {
            let _ = write!(out, "<tr><td>{}</td></tr>", escape(fields));
        }
    }
    out
}

fn html_page(body: &str) -> impl IntoResponse {
    let page = format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>idemd approvals</title>\
         <style>body{{font-family:sans-serif;margin:2em;max-width:60em}}section{{border:1px solid #ccc;padding:1em;margin:1em 0}}\
         th{{text-align:left;padding-right:1em}}.approve{{background:#2a2;color:#fff}}.reject{{background:#c22;color:#fff}}\
         .notice{{background:#efe;padding:.5em}}.error{{background:#fee;padding:.5em}}</style></head>\
         <body><h1>Approvals</h1>{body}</body></html>"
    );
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
            (
                header::HeaderName::from_static("content-security-policy"),
                "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'",
            ),
            (header::HeaderName::from_static("x-frame-options"), "DENY"),
        ],
        page,
    )
}

fn back(done: Result<String, String>) -> Response {
    let (k, v) = match done {
        Ok(v) => ("done", v),
        Err(v) => ("error", v),
    };
    let q: String = url_encode(&v);
    (StatusCode::SEE_OTHER, [(header::LOCATION, format!("/approvals?{k}={q}"))]).into_response()
}

fn url_encode(text: &str) -> String {
    let mut out = String::new();
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// A form body: every field once (a repeated one refuses the form).
fn form(body: &[u8]) -> Option<std::collections::HashMap<String, String>> {
    let mut out = std::collections::HashMap::new();
    for (k, v) in form_urlencoded::parse(body) {
        if out.insert(k.into_owned(), v.into_owned()).is_some() {
            return None;
        }
    }
    Some(out)
}

fn forbidden() -> Response {
    (StatusCode::FORBIDDEN, html_page("<p>This form is stale or was not made here: nothing changed.</p>"))
        .into_response()
}

/// A posted form: its fields, if it carries this approver's CSRF token (else 403, nothing
/// changes), and the operation it names.
fn checked(
    state: &ApprovalsState,
    approver: &Approver,
    body: &[u8],
    key: &str,
) -> Result<(std::collections::HashMap<String, String>, OpKey), Box<Response>> {
    let f = form(body).ok_or_else(|| Box::new(forbidden()))?;
    if !f.get("csrf").is_some_and(|t| state.csrf.accepts(&approver.0, t)) {
        return Err(Box::new(forbidden()));
    }
    let key = OpKey::parse(key).map_err(|_| Box::new(back(Err("not an operation".into()))))?;
    Ok((f, key))
}

/// `POST /approvals/{key}`: `decision`, `reason`, `csrf`.
pub async fn decide(
    State(state): State<ApprovalsState>,
    Extension(approver): Extension<Approver>,
    Path(key): Path<String>,
    body: Bytes,
) -> Response {
    let (f, key) = match checked(&state, &approver, &body, &key) {
        Ok(v) => v,
        Err(refused) => return *refused,
    };
    let decision = match f.get("decision").map(String::as_str) {
        Some("approve") => Decision::Approve,
        Some("reject") => Decision::Reject,
        _ => return back(Err("choose approve or reject".into())),
    };
    let Some(reason) = f.get("reason").and_then(|r| crate::store::approval::checked_reason(r)) else {
        return back(Err("a reason is required (1 to 1000 characters, no control characters)".into()));
    };
    match crate::approvals::decide_as(&state, &approver, &key, decision, reason).await {
        Ok(row) => back(Ok(format!("{key}: {}", row.state.as_str()))),
        Err(crate::store::approval::DecideError::Refused(r)) => back(Err(format!("{key}: {r:?}"))),
        Err(crate::store::approval::DecideError::Unavailable) => {
            back(Err("the store cannot be asked; try again".into()))
        }
    }
}

/// `POST /approvals/review/{key}`: `outcome` (`release` | `done` | `failed`), `result` (done), `reason`
/// (failed), `why`, `csrf`.
pub async fn resolve(
    State(state): State<ApprovalsState>,
    Extension(approver): Extension<Approver>,
    Path(key): Path<String>,
    body: Bytes,
) -> Response {
    let (f, key) = match checked(&state, &approver, &body, &key) {
        Ok(v) => v,
        Err(refused) => return *refused,
    };
    // The same checks, rules and result as `idemd ops resolve` (review).
    let said = match f.get("outcome").map(String::as_str) {
        Some("release") => ResolveAs::Release,
        Some("done") => {
            ResolveAs::Done { status: None, body: f.get("result").map_or(&b""[..], |r| r.trim().as_bytes()) }
        }
        Some("failed") => ResolveAs::Failed { status: None, reason: f.get("reason").map_or("", String::as_str) },
        _ => return back(Err("choose release, done or failed".into())),
    };
    let ask = Ask {
        said,
        why: f.get("why").map_or("", String::as_str),
        person: &approver.0,
        allow_self: state.approvers.allow_self,
        force: false,
    };
    match review::resolve(state.store.sql(), state.lookups.as_deref(), &key, &ask).await {
        Ok(done) => {
            state.store.refresh_cache(&key, done.now.as_ref()).await;
            tracing::info!(key = %key, approver = %approver.0, action = done.action, "operation resolved");
            back(Ok(format!("{key}: {}", done.action)))
        }
        Err(refused) => {
            tracing::warn!(key = %key, approver = %approver.0, %refused, "resolve refused");
            back(Err(format!("{key}: {refused}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::approvals::CsrfKey;

    #[test]
    fn everything_printed_is_escaped() {
        assert_eq!(
            escape("<script>alert('x')</script>&\""),
            "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;&amp;&quot;"
        );
        let rows = fields_rows(r#"{"/payee":"<img src=x onerror=alert(1)>"}"#);
        assert!(!rows.contains("<img") && rows.contains("&lt;img"), "{rows}");
    }

    #[test]
    fn csrf_tokens_are_the_approvers_own() {
        let k = CsrfKey::random();
        let ann = k.token("ann");
        assert!(k.accepts("ann", &ann));
        assert!(!k.accepts("ben", &ann));
        assert!(!k.accepts("ann", ""));
        assert!(!CsrfKey::random().accepts("ann", &ann), "another process's form is stale");
    }

    #[test]
    fn forms_decode_and_refuse_repeated_fields() {
        let f = form(b"reason=ok+then%21&decision=approve&csrf=ab").unwrap_or_default();
        assert_eq!(f.get("reason").map(String::as_str), Some("ok then!"));
        assert!(form(b"csrf=a&csrf=b").is_none());
    }
}
