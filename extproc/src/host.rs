//! `idem_adapter::Host` over one ext_proc stream: what Envoy sent us is held here (the header
//! maps, the body so far, the attributes), and what the adapter asks Envoy to do is collected
//! as pending mutations, a local reply or a resume, which `driver` turns into
//! `ProcessingResponse`s. Callouts go to idemd's own API in-process (`process::Process::call`).

use crate::process::Process;
use idem_adapter::{Host, Level};
use idem_core::machine::{Callout, CalloutAnswer, Counter, Env};
use idem_core::policy::PluginConfig;
use idem_core::protocol::{LeaseRenewal, OwnerToken};
use idem_core::trace::{HostSpan, Trace};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::task::JoinHandle;

/// Header changes for one direction, not yet sent to Envoy. A set wins over an earlier remove of
/// the same name and the other way round, as Envoy would apply them one after the other.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct HeaderChanges {
    pub set: Vec<(String, String)>,
    pub remove: Vec<String>,
}

impl HeaderChanges {
    fn set(&mut self, name: &str, value: &str) {
        let name = name.to_ascii_lowercase();
        self.remove.retain(|n| *n != name);
        self.set.retain(|(n, _)| *n != name);
        self.set.push((name, value.to_owned()));
    }

    fn remove(&mut self, name: &str) {
        let name = name.to_ascii_lowercase();
        self.set.retain(|(n, _)| *n != name);
        if !self.remove.contains(&name) {
            self.remove.push(name);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.set.is_empty() && self.remove.is_empty()
    }
}

/// A local reply the machine asked for (an `ImmediateResponse`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// What the adapter asked for since the driver last answered Envoy.
#[derive(Debug, Default)]
pub struct Pending {
    pub request_headers: HeaderChanges,
    pub response_headers: HeaderChanges,
    /// The response body (held, plus the chunk in hand) becomes this.
    pub response_body: Option<Vec<u8>>,
    pub reply: Option<LocalReply>,
    /// The adapter refused a stream whose answer had begun: the driver ends the gRPC stream with an
    /// error, which Envoy (`failure_mode_allow: false`) turns into a reset of the HTTP stream.
    pub reset: bool,
    pub resume_request: bool,
    pub resume_response: bool,
}

/// One direction's body as the adapter sees it: what is held, then the chunk in hand.
#[derive(Debug, Default)]
pub struct Body {
    pub bytes: Vec<u8>,
}

pub struct ExtProcHost {
    process: Arc<Process>,
    pub request_headers: Vec<(String, Vec<u8>)>,
    pub response_headers: Vec<(String, Vec<u8>)>,
    /// The route's annotation (`policy::encode_pairs` bytes), from the `xds.route_metadata` attribute.
    pub annotation: Option<Vec<u8>>,
    /// Attributes Envoy sent (`response.code_details`, `xds.route_name`), as text.
    pub attributes: Vec<(String, Vec<u8>)>,
    /// Dynamic metadata forwarded by Envoy (`metadata_options`).
    pub metadata: Option<envoy_types::pb::envoy::config::core::v3::Metadata>,
    pub request_body: Body,
    pub response_body: Body,
    pub pending: Pending,
    pub answer: Option<CalloutAnswer>,
    /// Callouts dispatched since the driver last collected them.
    pub calls: Vec<(u64, JoinHandle<CalloutAnswer>)>,
    next_token: u64,
    /// Envoy's span of its gRPC stream to idemd, from the stream's `traceparent` metadata (Envoy's gRPC client
    /// sends it when it traces): idemd's callout spans become its children, as on the native module.
    pub span: Option<HostSpan>,
}

impl ExtProcHost {
    pub fn new(process: Arc<Process>) -> ExtProcHost {
        ExtProcHost {
            process,
            request_headers: Vec::new(),
            response_headers: Vec::new(),
            annotation: None,
            attributes: Vec::new(),
            metadata: None,
            request_body: Body::default(),
            response_body: Body::default(),
            pending: Pending::default(),
            answer: None,
            calls: Vec::new(),
            next_token: 1,
            span: None,
        }
    }
}

/// The span a W3C `traceparent` names (`00-<trace id>-<span id>-<flags>`); `Trace::within` checks
/// the fields before a callout uses them.
pub fn span_of_traceparent(value: &str) -> Option<HostSpan> {
    let mut fields = value.trim().split('-');
    let (_version, trace_id, span_id) = (fields.next()?, fields.next()?, fields.next()?);
    Some(HostSpan { trace_id: trace_id.to_string(), span_id: span_id.to_string() })
}

/// Apply a change to the copy of a header map the host reads back (so a later read sees it).
fn apply(map: &mut Vec<(String, Vec<u8>)>, name: &str, value: Option<&str>) {
    map.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
    if let Some(v) = value {
        map.push((name.to_ascii_lowercase(), v.as_bytes().to_vec()));
    }
}

impl Env for ExtProcHost {
    fn now_s(&self) -> u64 {
        SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
    }

    fn random16(&mut self) -> Option<[u8; 16]> {
        let mut bytes = [0u8; 16];
        getrandom::fill(&mut bytes).ok().map(|()| bytes)
    }

    fn shared_get(&self, key: &str) -> Option<Vec<u8>> {
        self.process.shared_get(key)
    }
}

impl Host for ExtProcHost {
    fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        self.request_headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.clone())
    }

    fn request_headers(&self) -> Vec<(String, Vec<u8>)> {
        self.request_headers.clone()
    }

    fn set_request_header(&mut self, name: &str, value: &str) {
        self.pending.request_headers.set(name, value);
        apply(&mut self.request_headers, name, Some(value));
    }

    fn remove_request_header(&mut self, name: &str) {
        self.pending.request_headers.remove(name);
        apply(&mut self.request_headers, name, None);
    }

    fn response_headers(&self) -> Vec<(String, Vec<u8>)> {
        self.response_headers.clone()
    }

    fn set_response_header(&mut self, name: &str, value: &str) {
        self.pending.response_headers.set(name, value);
        apply(&mut self.response_headers, name, Some(value));
    }

    fn remove_response_header(&mut self, name: &str) {
        self.pending.response_headers.remove(name);
        apply(&mut self.response_headers, name, None);
    }

    fn route_annotation(&self) -> Option<Vec<u8>> {
        self.annotation.clone()
    }

    /// Envoy's span of the gRPC stream that carries this request, when Envoy traces it; else
    /// callouts continue the request's own `traceparent` (as the `.wasm` does).
    fn active_span(&self) -> Option<HostSpan> {
        self.span.clone()
    }

    /// `response.code_details` and `xds.route_name` from the attributes Envoy was told to send;
    /// dynamic metadata (nested structs too) from `metadata_context` (what `metadata_options` forwards).
    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        match path {
            ["metadata", "filter_metadata", rest @ ..] => {
                crate::attributes::dynamic_metadata(self.metadata.as_ref(), rest).map(String::into_bytes)
            }
            _ => {
                let name = path.join(".");
                self.attributes.iter().find(|(n, _)| *n == name).map(|(_, v)| v.clone())
            }
        }
    }

    fn request_body(&self, _size: usize) -> Vec<u8> {
        self.request_body.bytes.clone()
    }

    fn response_body(&self, _size: usize) -> Vec<u8> {
        self.response_body.bytes.clone()
    }

    fn replace_response_body(&mut self, _old_size: usize, body: &[u8]) {
        self.response_body.bytes = body.to_vec();
        self.pending.response_body = Some(body.to_vec());
    }

    fn send_reply(&mut self, status: u16, headers: &[(String, String)], body: &[u8]) {
        self.pending.reply = Some(LocalReply { status, headers: headers.to_vec(), body: body.to_vec() });
    }

    fn reset(&mut self) {
        self.pending.reset = true;
    }

    fn resume_request(&mut self) {
        self.pending.resume_request = true;
    }

    fn resume_response(&mut self) {
        self.pending.resume_response = true;
    }

    /// In-process: the call runs on idemd's runtime, and keeps running if this stream goes away
    /// (a complete whose stream Envoy broke still records the answer).
    fn dispatch(
        &mut self,
        _cluster: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> Option<u64> {
        let handle = self.process.call(headers, body, timeout)?;
        let token = self.next_token;
        self.next_token = self.next_token.wrapping_add(1);
        self.calls.push((token, handle));
        Some(token)
    }

    fn call_answer(&self, num_headers: usize, _body_size: usize) -> CalloutAnswer {
        match (&self.answer, num_headers) {
            (Some(answer), n) if n > 0 => answer.clone(),
            _ => CalloutAnswer::failed(),
        }
    }

    fn count(&mut self, counter: Counter) {
        self.process.counters.add(counter, 1);
    }

    fn log(&self, level: Level, message: &str) {
        match level {
            Level::Warn => tracing::warn!(target: "ext_proc", "{message}"),
            Level::Error => tracing::error!(target: "ext_proc", "{message}"),
        }
    }

    fn shared_set(&mut self, key: &str, value: &[u8]) {
        self.process.shared_set(key, value);
    }

    fn hold_lease(&mut self, lease: &LeaseRenewal) {
        self.process.hold_lease(lease.clone());
    }

    fn end_lease(&mut self, owner: &OwnerToken) {
        self.process.end_lease(owner);
    }

    /// A report outlives the stream: the call is spawned on idemd's runtime and nobody waits for it.
    fn report(&mut self, cfg: &PluginConfig, call: &Callout, trace: &Trace) -> bool {
        let process = Arc::clone(&self.process);
        let sent = idem_adapter::sidecar::Sidecar::of(cfg).with_headers(call, trace, |headers| {
            process.call(headers, call.body.as_deref(), Duration::from_millis(cfg.sidecar_timeout_ms))
        });
        sent.is_some()
    }
}
