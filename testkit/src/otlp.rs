//! An OTLP/HTTP trace receiver inside a test: `POST /v1/traces` with an
//! `ExportTraceServiceRequest` in protobuf (the wire format idemd's exporter
//! and Envoy's OpenTelemetry tracer send), decoded with the
//! `opentelemetry-proto` types. No collector binary is installable here, and
//! a test wants the spans themselves: who sent them and who their parents are.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message;

use crate::BoxError;

/// One span as received, ids in lowercase hex (`parent` empty for a root span).
#[derive(Clone, Debug)]
pub struct ReceivedSpan {
    /// The resource's `service.name`.
    pub service: String,
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    pub parent: String,
    /// OTLP's `SpanKind` (2 server, 3 client).
    pub kind: i32,
    /// String, integer and boolean attributes, as text.
    pub attributes: Vec<(String, String)>,
}

impl ReceivedSpan {
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

#[derive(Default)]
struct Received {
    spans: Vec<ReceivedSpan>,
    /// Export requests that were not protobuf OTLP (answered 400/415).
    refused: Vec<String>,
}

pub struct OtlpReceiver {
    addr: SocketAddr,
    received: Arc<Mutex<Received>>,
    task: tokio::task::JoinHandle<()>,
}

impl OtlpReceiver {
    /// Listening on a free port of 127.0.0.1, on the current tokio runtime.
    pub async fn start() -> Result<OtlpReceiver, BoxError> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let received = Arc::new(Mutex::new(Received::default()));
        let app =
            axum::Router::new().route("/v1/traces", axum::routing::post(export)).with_state(Arc::clone(&received));
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(OtlpReceiver { addr, received, task })
    }

    /// The collector's base URL (`http://127.0.0.1:<port>`; traces go to `/v1/traces`).
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.received.lock().map(|r| r.spans.clone()).unwrap_or_default()
    }

    /// Why export requests were refused (a wrong content type or an undecodable body).
    pub fn refused(&self) -> Vec<String> {
        self.received.lock().map(|r| r.refused.clone()).unwrap_or_default()
    }

    /// The spans received once `done` holds for them, polled until `within` has passed.
    pub async fn wait_for(
        &self,
        within: Duration,
        what: &str,
        done: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> Result<Vec<ReceivedSpan>, BoxError> {
        let deadline = Instant::now() + within;
        loop {
            let spans = self.spans();
            if done(&spans) {
                return Ok(spans);
            }
            if Instant::now() >= deadline {
                let seen: Vec<String> = spans
                    .iter()
                    .map(|s| {
                        format!("{}:{} trace {} span {} parent {}", s.service, s.name, s.trace_id, s.span_id, s.parent)
                    })
                    .collect();
                return Err(format!(
                    "no {what} within {within:?}; received {} spans: {seen:#?}; refused: {:?}",
                    spans.len(),
                    self.refused()
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn export(State(received): State<Arc<Mutex<Received>>>, headers: HeaderMap, body: Bytes) -> Response {
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    if content_type != "application/x-protobuf" {
        if let Ok(mut r) = received.lock() {
            r.refused.push(format!("content-type {content_type:?}"));
        }
        return StatusCode::UNSUPPORTED_MEDIA_TYPE.into_response();
    }
    let request = match ExportTraceServiceRequest::decode(body) {
        Ok(r) => r,
        Err(e) => {
            if let Ok(mut r) = received.lock() {
                r.refused.push(format!("undecodable: {e}"));
            }
            return StatusCode::BAD_REQUEST.into_response();
        }
    };
    let spans = flatten(request);
    if let Ok(mut r) = received.lock() {
        r.spans.extend(spans);
    }
    let answer = ExportTraceServiceResponse { partial_success: None }.encode_to_vec();
    ([(header::CONTENT_TYPE, "application/x-protobuf")], answer).into_response()
}

fn flatten(request: ExportTraceServiceRequest) -> Vec<ReceivedSpan> {
    let mut out = Vec::new();
    for resource_spans in request.resource_spans {
        let resource = resource_spans.resource.map(|r| r.attributes).unwrap_or_default();
        let service =
            attributes(&resource).into_iter().find(|(k, _)| k == "service.name").map(|(_, v)| v).unwrap_or_default();
        for scope_spans in resource_spans.scope_spans {
            for span in scope_spans.spans {
                out.push(ReceivedSpan {
                    service: service.clone(),
                    name: span.name,
                    trace_id: hex::encode(&span.trace_id),
                    span_id: hex::encode(&span.span_id),
                    parent: hex::encode(&span.parent_span_id),
                    kind: span.kind,
                    attributes: attributes(&span.attributes),
                });
            }
        }
    }
    out
}

fn attributes(list: &[opentelemetry_proto::tonic::common::v1::KeyValue]) -> Vec<(String, String)> {
    list.iter()
        .filter_map(|kv| {
            let text = match kv.value.as_ref()?.value.as_ref()? {
                Value::StringValue(s) => s.clone(),
                Value::IntValue(i) => i.to_string(),
                Value::BoolValue(b) => b.to_string(),
                Value::DoubleValue(d) => d.to_string(),
                _ => return None,
            };
            Some((kv.key.clone(), text))
        })
        .collect()
}
