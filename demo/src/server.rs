//! Accept loop and per-connection HTTP/1.1 serving.
//!
//! Done by hand rather than with `axum::serve` so that a handler can make
//! its own connection end in a TCP reset with no response at all: the
//! upstream failure Envoy's `retry_on: reset` reacts to.

use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::Request;
use hyper_util::rt::TokioIo;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tower::ServiceExt;
use tracing::{debug, error};

/// Put in every request's extensions: lets the handler ask the task serving
/// its connection to drop the connection abortively.
#[derive(Clone, Default)]
pub struct Hangup(Arc<Notify>);

impl Hangup {
    pub fn reset(&self) {
        self.0.notify_one();
    }
}

pub async fn run(listener: TcpListener, router: Router) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(serve_connection(stream, router.clone()));
            }
            Err(e) => {
                // Typically out of file descriptors: back off instead of spinning.
                error!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn serve_connection(stream: TcpStream, router: Router) {
    let _ = stream.set_nodelay(true);
    let hangup = Hangup::default();
    let service = {
        let hangup = hangup.clone();
        service_fn(move |mut req: Request<Incoming>| {
            req.extensions_mut().insert(hangup.clone());
            router.clone().oneshot(req)
        })
    };
    let mut conn = http1::Builder::new().serve_connection(TokioIo::new(stream), service);
    tokio::select! {
        // Checked first: the resetting handler never completes, so the
        // connection can have nothing else to say.
        biased;
        () = hangup.0.notified() => {
            let stream = conn.into_parts().io.into_inner();
            // Linger 0 makes the close send RST instead of FIN.
            if let Err(e) = stream.set_zero_linger() {
                error!(error = %e, "could not set SO_LINGER");
            }
            drop(stream);
        }
        result = &mut conn => {
            if let Err(e) = result {
                debug!(error = %e, "connection ended with an error");
            }
        }
    }
}
