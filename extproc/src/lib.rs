//! The third host of `idem_core::machine`: Envoy's External Processing protocol
//! (`envoy.service.ext_proc.v3.ExternalProcessor`, gRPC), for gateways that load neither a
//! `.wasm` nor a dynamic module (Envoy Gateway's and kgateway's `extProc`, agentgateway, Istio's
//! `ext_proc` EnvoyFilter, plain Envoy).
//!
//! The same adapter (`idem_adapter::Stream`) drives the same machine as the two filter hosts; only
//! the host differs:
//!
//! - `host`: `idem_adapter::Host` over one ext_proc stream (header maps, bodies, attributes in;
//!   mutations, local replies, resumes collected for the driver);
//! - `driver`: the protocol: which message is answered when, per body mode (BUFFERED,
//!   FULL_DUPLEX_STREAMED), so that only the machine releases a held stream;
//! - `attributes`: the route's annotation and the properties the machine reads, from what
//!   Envoy sends beside the headers;
//! - `process`: what the streams share: idemd's own API, called in-process (the same handlers,
//!   auth and audit as over HTTP, without a network hop), counters, the replay cache, the leases;
//! - `service`: the gRPC service and the worker threads that run the streams.
//!
//! It runs inside idemd (`idemd serve --ext-proc ADDR --ext-proc-config FILE`).

#![forbid(unsafe_code)]

mod attributes;
mod driver;
mod host;
mod process;
mod service;
mod text_format;

pub use process::{Counters, Process};
pub use service::Processor;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use std::sync::Arc;

/// Start the ext_proc service on `listener`: the configuration is checked and the workers started
/// now (an `Err` stops idemd at start); the returned future serves until `shutdown` resolves.
/// `api` is idemd's own router; `config` the plugin configuration JSON (the same the `.wasm` takes).
pub fn start(
    listener: tokio::net::TcpListener,
    api: axum::Router,
    config: Vec<u8>,
    counters: Arc<Counters>,
    threads: usize,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<impl std::future::Future<Output = Result<(), String>>, String> {
    let parsed = idem_core::policy::parse_plugin_config(&config, &|n| std::env::var(n).ok())
        .map_err(|e| format!("ext_proc plugin configuration: {e}"))?;
    let process = Arc::new(Process::new(api, tokio::runtime::Handle::current(), counters, config));
    let processor = Processor::start(Arc::clone(&process), threads)?;
    tokio::spawn(Arc::clone(&process).renew_leases(idem_adapter::sidecar::Sidecar::of(&parsed)));
    Ok(async move {
        tonic::transport::Server::builder()
            .add_service(ExternalProcessorServer::new(processor))
            .serve_with_incoming_shutdown(incoming(listener), shutdown)
            .await
            .map_err(|e| format!("ext_proc server: {e}"))
    })
}

/// The connections `listener` accepts, each with `TCP_NODELAY`. Envoy sends each message of a stream
/// in its own small frame and waits for the answer: with Nagle on, every answer after the first
/// waits for Envoy's delayed ACK (40 ms on Linux). `Server::tcp_nodelay` does not apply to an
/// incoming stream handed to the server, so the accepted sockets get it here.
fn incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// `GET /ext-proc/stats`: the filter's counters on this host, `name: value` as Envoy's `/stats`
/// shows them for the two filters (open, like `/metrics`).
pub fn stats_router(counters: Arc<Counters>) -> axum::Router {
    axum::Router::new().route(
        "/ext-proc/stats",
        axum::routing::get(move || {
            let counters = Arc::clone(&counters);
            async move { counters.text() }
        }),
    )
}

#[cfg(test)]
mod tests {
    use tokio_stream::StreamExt;

    /// Every connection idemd's ext_proc service accepts has Nagle off (see `incoming`).
    #[tokio::test]
    async fn accepted_connections_have_nodelay() -> Result<(), Box<dyn std::error::Error>> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let mut incoming = super::incoming(listener);
        let _client = tokio::net::TcpStream::connect(addr).await?;
        let accepted = incoming.next().await.ok_or("no connection")??;
        assert!(accepted.nodelay()?, "the accepted socket has TCP_NODELAY");
        Ok(())
    }
}
