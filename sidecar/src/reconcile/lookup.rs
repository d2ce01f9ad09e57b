//! Asking an upstream's status endpoint about one operation.
//!
//! `GET <url>` (the template filled in by `target`: the nonce for `{key}`, the
//! business reference for `{ref}`) with `Idempotency-Key: <key>`: 200 and the
//! upstream's record, or 404. Everything else is "no evidence" and costs one
//! attempt of the retry budget.

use std::time::Duration;

use tracing::Instrument;

use super::decide::{Asked, StatusAnswer};
use super::target::{self, StatusEndpoints};
use crate::store::record::{Record, MAX_RESULT_BYTES};

/// The largest record accepted: the same bound as a stored result.
const MAX_RECORD_BYTES: usize = MAX_RESULT_BYTES;

#[derive(Clone)]
pub struct StatusClient {
    http: reqwest::Client,
    endpoints: StatusEndpoints,
    timeout: Duration,
}

impl StatusClient {
    pub fn new(endpoints: StatusEndpoints, timeout: Duration) -> Result<Self, String> {
        let http = reqwest::Client::builder()
            .connect_timeout(timeout)
            // The answer is evidence about one key, never a link to follow.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| format!("status client: {e}"))?;
        Ok(Self { http, endpoints, timeout })
    }

    /// The scopes that have an endpoint.
    pub fn scopes(&self) -> impl Iterator<Item = &str> {
        self.endpoints.keys().map(String::as_str)
    }

    /// The URL template for a scope, if one is configured.
    pub fn endpoint(&self, scope: &str) -> Option<&str> {
        self.endpoints.get(scope).map(String::as_str)
    }

    /// What the scope's endpoint says about `rec` now: it has none, it cannot be asked anything that
    /// would be evidence about this row (`target` says why), or its answer. The reconciler and a
    /// person's release (`review`) ask this one way.
    pub async fn ask(&self, rec: &Record) -> Asked {
        match self.endpoint(&rec.scope).map(|template| target::target(template, rec)) {
            None => Asked::NoEndpoint,
            Some(Err(why)) => Asked::Unaskable(why),
            Some(Ok(t)) => Asked::Answered(t.by, self.lookup(&t.url, &rec.key).await),
        }
    }

    /// `url`: the scope's template filled in for this row (`target::target`).
    /// In a span of its own (DESIGN §8) whose trace context the request carries (`traceparent`), so the
    /// upstream's trace of the lookup joins the reconciler's.
    pub async fn lookup(&self, url: &str, key: &str) -> StatusAnswer {
        let span = tracing::debug_span!(
            "status_lookup",
            otel.name = "reconciler status lookup",
            otel.kind = "client",
            answer = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        );
        let answer =
            match tokio::time::timeout(self.timeout, self.fetch(url, key, &span)).instrument(span.clone()).await {
                Ok(l) => l,
                Err(_) => StatusAnswer::Failed(format!("no answer within {} ms", self.timeout.as_millis())),
            };
        span.record("answer", answer.metric());
        if matches!(answer, StatusAnswer::Failed(_)) {
            span.record("otel.status_code", "ERROR");
        }
        answer
    }

    async fn fetch(&self, url: &str, key: &str, span: &tracing::Span) -> StatusAnswer {
        let mut context = reqwest::header::HeaderMap::new();
        crate::telemetry::propagate(span, &mut context);
        let mut resp = match self.http.get(url).header("idempotency-key", key).headers(context).send().await {
            Ok(r) => r,
            Err(e) => return StatusAnswer::Failed(format!("request failed: {}", without_url(&e))),
        };
        let status = resp.status().as_u16();
        match status {
            200 => {}
            404 => return StatusAnswer::NotFound,
            other => return StatusAnswer::Failed(format!("answered {other}")),
        }
        let content_type =
            resp.headers().get(reqwest::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).map(str::to_string);
        let mut body = Vec::new();
        loop {
            match resp.chunk().await {
                Ok(Some(chunk)) => {
                    if body.len() + chunk.len() > MAX_RECORD_BYTES {
                        return StatusAnswer::Failed(format!("record larger than {MAX_RECORD_BYTES} bytes"));
                    }
                    body.extend_from_slice(&chunk);
                }
                Ok(None) => return StatusAnswer::Found { content_type, body },
                Err(e) => return StatusAnswer::Failed(format!("reading the answer failed: {}", without_url(&e))),
            }
        }
    }
}

/// reqwest puts the URL into its messages; the audit trail needs the cause.
fn without_url(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    if let Some(url) = e.url() {
        text = text.replace(&format!(" ({url})"), "").replace(url.as_str(), "<endpoint>");
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
