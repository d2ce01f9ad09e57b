//! Logs and traces (DESIGN §8).
//!
//! Logs go to stderr as they always did (`RUST_LOG`, default `info`). Traces are
//! on only with `--otlp-endpoint`: then tracing's spans are also exported with
//! OpenTelemetry, OTLP over HTTP/protobuf, and the W3C trace context
//! (`traceparent`/`tracestate`) the filter sends on each callout becomes the
//! parent of that call's span. Without it there is no exporter and no
//! propagator: the store and reconciler spans (`debug`) are disabled callsites,
//! and extracting or injecting a context is the no-op propagator's.
//!
//! The batch span processor exports from a thread of its own (a blocking HTTP
//! client there); a request's task only hands a finished span to its queue, so
//! a slow or absent collector never slows an answer. A full queue drops spans.
//!
//! Each layer's filter is wrapped in [`Fresh`]: tracing-subscriber's per-layer
//! filters hand their verdict from `enabled` to `new_span` through a
//! thread-local, and a callsite every filter accepts is cached as "always", so
//! its spans skip `enabled` and read whatever the last `enabled` on that thread
//! left there (tokio-rs/tracing#2519). sqlx asks `tracing::enabled!` after
//! every statement it runs, which leaves "disabled" behind: on Postgres and
//! MariaDB, whose statements run on the request's own thread, the next API span
//! was dropped from the exporter (and from the log lines' context), so its
//! store calls were exported as traces of their own. SQLite's statements run on
//! a thread of their own, which hid it.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing::subscriber::Interest;
use tracing::{span, Event, Metadata};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::{EnvFilter, LevelFilter, Targets};
use tracing_subscriber::layer::{Context, Filter, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// The OTLP/HTTP path for traces, appended to a collector's base URL.
const TRACES_PATH: &str = "/v1/traces";

/// What `idemd serve` exports to, if anything; [`Telemetry::shutdown`] flushes it.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Install the process's subscriber: stderr logs, and with `otlp_endpoint`
    /// (a collector's OTLP/HTTP base URL such as `http://collector:4318`, or its
    /// full `…/v1/traces` URL) the span exporter and the W3C propagator.
    pub fn init(otlp_endpoint: Option<&str>) -> Result<Telemetry, String> {
        let logs = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_filter(Fresh(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"))));
        let Some(endpoint) = otlp_endpoint.map(str::trim).filter(|e| !e.is_empty()) else {
            tracing_subscriber::registry().with(logs).try_init().map_err(|e| e.to_string())?;
            return Ok(Telemetry { provider: None });
        };
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(traces_url(endpoint))
            .build()
            .map_err(|e| format!("--otlp-endpoint {endpoint}: {e}"))?;
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(Resource::builder().with_service_name("idemd").build())
            .build();
        // idemd's own spans, store calls and reconciler lookups included (debug); not the libraries' spans.
        let traced = Targets::new().with_target("idemd", LevelFilter::DEBUG);
        let traces = tracing_opentelemetry::layer().with_tracer(provider.tracer("idemd")).with_filter(Fresh(traced));
        tracing_subscriber::registry().with(logs).with(traces).try_init().map_err(|e| e.to_string())?;
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        tracing::info!(endpoint = %traces_url(endpoint), "exporting traces (OTLP/HTTP)");
        Ok(Telemetry { provider: Some(provider) })
    }

    /// Export what is still queued and stop the exporter (on exit, after the
    /// server has stopped answering).
    pub fn shutdown(self) {
        if let Some(provider) = self.provider {
            if let Err(e) = provider.shutdown() {
                eprintln!("idemd: flushing traces on exit failed: {e}");
            }
        }
    }
}

/// A per-layer filter whose verdict is asked for every span and event: it never tells a callsite
/// "always" (only "sometimes" or "never"), so `enabled` runs right before each `new_span`/`event`
/// and the thread-local it leaves is this span's, never a stale one (the module's comment; the
/// same cap as tokio-rs/tracing#3572, not released). One filter call more per span.
struct Fresh<F>(F);

impl<S, F: Filter<S>> Filter<S> for Fresh<F> {
    fn enabled(&self, meta: &Metadata<'_>, cx: &Context<'_, S>) -> bool {
        self.0.enabled(meta, cx)
    }

    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> Interest {
        let interest = self.0.callsite_enabled(meta);
        if interest.is_always() {
            Interest::sometimes()
        } else {
            interest
        }
    }

    fn event_enabled(&self, event: &Event<'_>, cx: &Context<'_, S>) -> bool {
        self.0.event_enabled(event, cx)
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        self.0.max_level_hint()
    }

    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, cx: Context<'_, S>) {
        self.0.on_new_span(attrs, id, cx)
    }

    fn on_record(&self, id: &span::Id, values: &span::Record<'_>, cx: Context<'_, S>) {
        self.0.on_record(id, values, cx)
    }

    fn on_enter(&self, id: &span::Id, cx: Context<'_, S>) {
        self.0.on_enter(id, cx)
    }

    fn on_exit(&self, id: &span::Id, cx: Context<'_, S>) {
        self.0.on_exit(id, cx)
    }

    fn on_close(&self, id: span::Id, cx: Context<'_, S>) {
        self.0.on_close(id, cx)
    }
}

/// The collector's traces URL: `…/v1/traces` as given, else appended to the base URL.
pub fn traces_url(endpoint: &str) -> String {
    if endpoint.ends_with(TRACES_PATH) {
        endpoint.to_string()
    } else {
        format!("{}{TRACES_PATH}", endpoint.trim_end_matches('/'))
    }
}

/// Make the caller's trace context (`traceparent`/`tracestate` in `headers`)
/// the parent of `span`; nothing without an exporter.
pub fn continue_trace(span: &tracing::Span, headers: &axum::http::HeaderMap) {
    let parent =
        opentelemetry::global::get_text_map_propagator(|p| p.extract(&opentelemetry_http::HeaderExtractor(headers)));
    // Fails only when no OpenTelemetry layer is installed, i.e. tracing is off.
    let _ = span.set_parent(parent);
}

/// Put `span`'s trace context into an outbound request's `headers`, so the
/// upstream's own trace of the call joins this one; nothing without an exporter.
pub fn propagate(span: &tracing::Span, headers: &mut axum::http::HeaderMap) {
    let context = span.context();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&context, &mut opentelemetry_http::HeaderInjector(headers))
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_traces_path_is_appended_once() {
        assert_eq!(traces_url("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/v1/traces"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("https://gw/otlp"), "https://gw/otlp/v1/traces");
    }
}
