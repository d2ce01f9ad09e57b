//! The gRPC `ExternalProcessor` service and the threads that run its streams.
//!
//! The adapter's `Stream` is single-threaded (`Rc`s inside, as on Envoy's workers), so each
//! ext_proc stream runs on one of a few worker threads, each a current-thread runtime with its own
//! parsed copy of the plugin configuration and route cache. The callouts a stream makes run on
//! idemd's own runtime (`Process::call`).
//!
//! Envoy reads a clean end of the gRPC stream as "go on without the processor", which would release
//! a held request unjudged. So a stream ends cleanly only after Envoy ended its side; any other end
//! (a panic, a worker gone) is a gRPC error, which `failure_mode_allow: false` turns into a refusal.

use crate::driver::Driver;
use crate::host::ExtProcHost;
use crate::process::Process;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt as _;
use idem_adapter::Shared;
use idem_core::machine::CalloutAnswer;
use idem_core::policy;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

type Reply = Result<ProcessingResponse, Status>;

/// One stream handed to a worker: Envoy's messages, and where the answers go.
struct Job {
    inbound: Streaming<ProcessingRequest>,
    outbound: mpsc::Sender<Reply>,
    /// Envoy's span of this gRPC stream (its `traceparent` metadata), when Envoy traces.
    span: Option<idem_core::trace::HostSpan>,
}

pub struct Processor {
    workers: Vec<mpsc::UnboundedSender<Job>>,
    next: AtomicUsize,
}

impl Processor {
    /// Start `threads` workers. `Err` if a thread cannot start or the configuration does not parse.
    pub fn start(process: Arc<Process>, threads: usize) -> Result<Processor, String> {
        // Checked here, on the caller's thread, so a bad configuration stops idemd at start.
        policy::parse_plugin_config(&process.config, &env)
            .map_err(|e| format!("ext_proc plugin configuration: {e}"))?;
        let mut workers = Vec::new();
        for i in 0..threads.max(1) {
            let (tx, rx) = mpsc::unbounded_channel::<Job>();
            let process = Arc::clone(&process);
            std::thread::Builder::new()
                .name(format!("ext-proc-{i}"))
                .spawn(move || worker(process, rx))
                .map_err(|e| format!("ext_proc worker: {e}"))?;
            workers.push(tx);
        }
        Ok(Processor { workers, next: AtomicUsize::new(0) })
    }
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

fn worker(process: Arc<Process>, mut jobs: mpsc::UnboundedReceiver<Job>) {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(target: "ext_proc", "worker runtime: {e}");
            return;
        }
    };
    let shared = match policy::parse_plugin_config(&process.config, &env) {
        Ok(config) => Rc::new(Shared::new(config)),
        Err(e) => {
            tracing::error!(target: "ext_proc", "plugin configuration: {e}");
            return;
        }
    };
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, async move {
        while let Some(job) = jobs.recv().await {
            tokio::task::spawn_local(drive(Rc::clone(&shared), Arc::clone(&process), job));
        }
    });
}

/// The outbound side: an end other than Envoy's own is an error, never a clean close.
struct Outbound {
    tx: mpsc::Sender<Reply>,
    clean: bool,
}

impl Drop for Outbound {
    fn drop(&mut self) {
        if !self.clean {
            let _ = self.tx.try_send(Err(Status::internal("agent_idempotency: the processor stopped")));
        }
    }
}

async fn drive(shared: Rc<Shared>, process: Arc<Process>, job: Job) {
    let Job { mut inbound, outbound, span } = job;
    let mut out = Outbound { tx: outbound, clean: false };
    let mut host = ExtProcHost::new(process);
    host.span = span;
    let mut driver = Driver::new(shared, host);
    let mut calls = FuturesUnordered::new();
    loop {
        tokio::select! {
            msg = inbound.message() => match msg {
                Ok(Some(msg)) => driver.on_message(msg),
                // Envoy ended its side (the HTTP stream is over, or it gave up on us): nothing more to
                // hold. Callouts still in flight finish on idemd's runtime (a complete still records).
                Ok(None) => {
                    out.clean = true;
                    return;
                }
                Err(status) => {
                    tracing::debug!(target: "ext_proc", "stream from Envoy ended: {status}");
                    out.clean = true;
                    return;
                }
            },
            Some((token, answer)) = calls.next(), if !calls.is_empty() => driver.on_callout(token, answer),
        }
        for (token, handle) in driver.host_mut().calls.drain(..) {
            calls.push(async move {
                let answer: CalloutAnswer = handle.await.unwrap_or_else(|_| CalloutAnswer::failed());
                (token, answer)
            });
        }
        if driver.reset_asked() {
            // Dropping `out` unclean ends the gRPC stream with an error: Envoy resets the HTTP stream.
            tracing::warn!(target: "ext_proc", "the machine refused a stream whose answer had begun: reset");
            return;
        }
        for reply in driver.take_out() {
            if out.tx.send(Ok(reply)).await.is_err() {
                out.clean = true;
                return;
            }
        }
    }
}

#[tonic::async_trait]
impl ExternalProcessor for Processor {
    type ProcessStream = ReceiverStream<Reply>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let (tx, rx) = mpsc::channel(16);
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let worker = self.workers.get(n % self.workers.len().max(1)).ok_or_else(|| Status::unavailable("no worker"))?;
        let span = request
            .metadata()
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .and_then(crate::host::span_of_traceparent);
        worker
            .send(Job { inbound: request.into_inner(), outbound: tx, span })
            .map_err(|_| Status::unavailable("agent_idempotency: the processor's worker is gone"))?;
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}
