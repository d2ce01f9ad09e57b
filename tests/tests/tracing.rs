//! One trace across Envoy and idemd (DESIGN §8), on the committed example
//! configuration (`envoy/envoy.yaml`, converted to the native module with
//! `IDEM_E2E_HOST=native`): Envoy's own OpenTelemetry tracer and idemd
//! (`--otlp-endpoint`) export to an OTLP/HTTP receiver in the test
//! (`idem_testkit::otlp`, the real protobuf wire format).
//!
//! The agent sends a `traceparent` (a traced agent framework does). Envoy's
//! span is a child of it; the filter sends the trace context on its callouts,
//! so idemd's API spans are in the same trace: children of Envoy's span where
//! the host gives the filter that span (the native module), of the span the
//! request carried where it does not (the `.wasm`: proxy-wasm has no span
//! access; Envoy's HCM does not write its span into the request's headers
//! before the filter chain). Store calls are children of the API span.
//!
//! A replay is normally served from the filter's replay cache in Envoy: then
//! there is Envoy's span and no idemd span at all, and the cache's counter
//! says so. After an Envoy restart (an empty cache) the replay is idemd's
//! again, and its span is in the replay's trace.
//!
//! Both run on every store idemd accepts (SQLite, Postgres, MariaDB; the shared Redis in front or
//! not): on Postgres and MariaDB idemd's API spans used to be dropped from the exporter and its
//! store calls exported as traces of their own (`sidecar/src/telemetry.rs`, `Fresh`).

use idem_e2e::*;
use idem_testkit::otlp::{OtlpReceiver, ReceivedSpan};
use serde_json::json;
use std::time::Duration;

/// Envoy's `service_name` in envoy/envoy.yaml and envoy/native.yaml.
const ENVOY_SERVICE: &str = "envoy-agents";
/// Spans of one request are all in within this (both exporters flush within 100 ms here).
const WITHIN: Duration = Duration::from_secs(15);

/// The agent's span of one call: a trace of its own per call, so each call's spans are told apart.
struct AgentSpan {
    trace_id: String,
    span_id: String,
}

impl AgentSpan {
    fn new(n: u8) -> AgentSpan {
        let mut b = [0u8; 24];
        getrandom::fill(&mut b).expect("random");
        b[0] = n; // never all zero
        let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
        AgentSpan { trace_id: hex[..32].to_string(), span_id: hex[32..].to_string() }
    }

    fn traceparent(&self) -> String {
        format!("00-{}-{}-01", self.trace_id, self.span_id)
    }
}

fn in_trace<'a>(spans: &'a [ReceivedSpan], trace_id: &str, service: &str) -> Vec<&'a ReceivedSpan> {
    spans.iter().filter(|s| s.trace_id == trace_id && s.service == service).collect()
}

/// The span Envoy's ext_proc filter makes of its gRPC stream to idemd (the ext_proc host).
const EXT_PROC_CALL: &str = "async envoy.service.ext_proc.v3.ExternalProcessor.Process egress";

/// Envoy's one span of the agent's call: a child of the agent's span. On the ext_proc host Envoy also
/// traces its gRPC stream to idemd, as a child of that span.
fn envoy_span<'a>(spans: &'a [ReceivedSpan], agent: &AgentSpan) -> &'a ReceivedSpan {
    let all = in_trace(spans, &agent.trace_id, ENVOY_SERVICE);
    let (calls, envoy): (Vec<&ReceivedSpan>, Vec<&ReceivedSpan>) =
        all.into_iter().partition(|s| s.name == EXT_PROC_CALL);
    assert_eq!(envoy.len(), 1, "one Envoy span in the call's trace: {spans:#?}");
    let ext_proc = FilterHost::current().is_ok_and(|h| h.is_ext_proc());
    assert_eq!(
        !calls.is_empty(),
        ext_proc,
        "Envoy's gRPC streams to idemd are traced on the ext_proc host only: {calls:#?}"
    );
    assert!(
        calls.iter().all(|c| c.parent == envoy[0].span_id),
        "each stream to idemd is a child of Envoy's span: {calls:#?}"
    );
    assert_eq!(envoy[0].parent, agent.span_id, "Envoy's span is a child of the agent's: {:?}", envoy[0]);
    envoy[0]
}

/// Envoy's span of the call is in, and on the ext_proc host its span of the gRPC stream to idemd too
/// (Envoy exports each as it ends).
fn envoy_spans_in(spans: &[ReceivedSpan], trace_id: &str) -> bool {
    let envoy = in_trace(spans, trace_id, ENVOY_SERVICE);
    let ext_proc = FilterHost::current().is_ok_and(|h| h.is_ext_proc());
    envoy.iter().any(|s| s.name != EXT_PROC_CALL) && (!ext_proc || envoy.iter().any(|s| s.name == EXT_PROC_CALL))
}

/// The parent idemd's API spans must have: Envoy's span where the filter can see it (the native
/// module), Envoy's span of the gRPC stream that carried the request (the ext_proc host), else the
/// agent's (the `.wasm`).
fn callout_parent<'a>(
    spans: &'a [ReceivedSpan],
    envoy: &'a ReceivedSpan,
    agent: &'a AgentSpan,
) -> Result<&'a str, BoxError> {
    Ok(match FilterHost::current()? {
        FilterHost::Native => &envoy.span_id,
        FilterHost::ExtProc => ext_proc_call(spans, envoy)?,
        FilterHost::Wasm => &agent.span_id,
    })
}

/// The span id of Envoy's gRPC stream to idemd that is a child of `envoy` (the ext_proc host).
fn ext_proc_call<'a>(spans: &'a [ReceivedSpan], envoy: &ReceivedSpan) -> Result<&'a str, BoxError> {
    let calls: Vec<&ReceivedSpan> =
        spans.iter().filter(|s| s.name == EXT_PROC_CALL && s.parent == envoy.span_id).collect();
    match calls.as_slice() {
        [one] => Ok(&one.span_id),
        _ => Err(format!("one gRPC stream to idemd under Envoy's span {}: {calls:#?}", envoy.span_id).into()),
    }
}

/// idemd's `name` span in the agent's call trace, with its parent checked and its store calls as children.
fn idemd_span<'a>(
    spans: &'a [ReceivedSpan],
    name: &str,
    agent: &AgentSpan,
    parent: &str,
) -> Result<&'a ReceivedSpan, BoxError> {
    let api: Vec<&ReceivedSpan> =
        in_trace(spans, &agent.trace_id, "idemd").into_iter().filter(|s| s.name == name).collect();
    assert_eq!(api.len(), 1, "one {name:?} span in the call's trace: {spans:#?}");
    let api = api[0];
    let tree: Vec<String> = spans
        .iter()
        .filter(|s| s.trace_id == agent.trace_id)
        .map(|s| format!("{} {:?} {} <- {}", s.service, s.name, s.span_id, s.parent))
        .collect();
    assert_eq!(
        api.parent,
        parent,
        "{name}'s parent (the callout's traceparent): {api:?}\nthe trace:\n{}",
        tree.join("\n")
    );
    let store: Vec<&ReceivedSpan> = spans.iter().filter(|s| s.parent == api.span_id).collect();
    assert!(!store.is_empty(), "{name} has store calls as children: {spans:#?}");
    for s in &store {
        assert_eq!(s.trace_id, agent.trace_id, "{s:?}");
        assert!(s.attribute("db.operation.name").is_some(), "a store call's span: {s:?}");
    }
    Ok(api)
}

/// The SQL store a stack's idemd runs on.
#[derive(Clone, Copy)]
enum Sql {
    /// A fresh file in the stack's directory.
    Sqlite,
    /// The shared servers: these stacks do not reconcile (`SidecarOpts::reconciles`), so sharing is harmless.
    Postgres,
    MariaDb,
}

/// A stack's Redis URL (none: SQL alone) and database URL (none: SQLite in its directory).
type Stores = (Option<String>, Option<String>);

/// The stores of one run: `None` when a backend is missing (skipped loudly).
fn stores(sql: Sql, with_redis: bool) -> Result<Option<Stores>, BoxError> {
    let redis = match with_redis {
        true if !backends::available("redis", &backends::redis_url())? => return Ok(None),
        true => Some(backends::redis_url()),
        false => None,
    };
    let database = match sql {
        Sql::Sqlite => None,
        Sql::Postgres if !backends::available("postgres", &backends::postgres_url())? => return Ok(None),
        Sql::Postgres => Some(backends::postgres_url()),
        Sql::MariaDb if !backends::available("mariadb", &backends::mysql_url())? => return Ok(None),
        Sql::MariaDb => Some(backends::mysql_url()),
    };
    Ok(Some((redis, database)))
}

/// Each test on every store: SQLite, Postgres and MariaDB, with the shared Redis in front and without.
macro_rules! on_every_store {
    ($($test:ident),* $(,)?) => {
        $(
            mod $test {
                use super::*;

                #[tokio::test]
                async fn sqlite() -> TestResult { super::$test(Sql::Sqlite, false).await }
                #[tokio::test]
                async fn redis_sqlite() -> TestResult { super::$test(Sql::Sqlite, true).await }
                #[tokio::test]
                async fn postgres() -> TestResult { super::$test(Sql::Postgres, false).await }
                #[tokio::test]
                async fn redis_postgres() -> TestResult { super::$test(Sql::Postgres, true).await }
                #[tokio::test]
                async fn mariadb() -> TestResult { super::$test(Sql::MariaDb, false).await }
                #[tokio::test]
                async fn redis_mariadb() -> TestResult { super::$test(Sql::MariaDb, true).await }
            }
        )*
    };
}

on_every_store!(
    a_confirm_and_its_replays_are_one_trace_across_envoy_and_idemd,
    without_a_traceparent_the_request_id_names_idemds_trace,
);

async fn traced_stack(receiver: &OtlpReceiver, (redis, database): Stores) -> Result<Stack, BoxError> {
    // idemd's batch exporter: every 100 ms here (the default is 5 s). Inherited by the idemd the stack starts.
    std::env::set_var("OTEL_BSP_SCHEDULE_DELAY", "100");
    let opts = StackOpts {
        envoy_config: "envoy.yaml",
        demo: DemoOpts { no_dedup: true, ..Default::default() },
        sidecar: SidecarOpts {
            redis_url: redis,
            database_url: database,
            extra_args: vec!["--otlp-endpoint".into(), receiver.base_url()],
        },
        envoy_edits: vec![
            // The example's collector is this test's receiver.
            ("port_value: 4318".into(), format!("port_value: {}", receiver.port())),
            // Envoy exports each span as it ends, not every 5 s or 5 spans.
            (
                "\nadmin:\n".into(),
                "\nlayered_runtime:\n  layers:\n  - name: trace_flush\n    static_layer: \
                 { tracing.opentelemetry.min_flush_spans: 1, tracing.opentelemetry.flush_interval_ms: 100 }\nadmin:\n"
                    .into(),
            ),
            // The suite runs many stacks at once on two cores (as envoy/e2e.yaml).
            ("\"sidecar_timeout_ms\": 2000,".into(), "\"sidecar_timeout_ms\": 5000,".into()),
        ],
    };
    Stack::start(opts).await
}

async fn a_confirm_and_its_replays_are_one_trace_across_envoy_and_idemd(sql: Sql, with_redis: bool) -> TestResult {
    let Some(stores) = stores(sql, with_redis)? else { return Ok(()) };
    let receiver = OtlpReceiver::start().await?;
    let mut stack = traced_stack(&receiver, stores).await?;
    let (_, fp) = stack.preview(json!("70.00")).await?;
    let body = transfer(json!("70.00"), "traced");

    // A fresh confirm: acquire and complete, both in the agent's trace.
    let agent = AgentSpan::new(1);
    let tp = agent.traceparent();
    let first =
        stack.post("/v1/transfers", SUBJECT, &body, &[("agent-fingerprint", &fp), ("traceparent", &tp)]).await?;
    assert_eq!(first.status, 201, "{first:?}");
    let spans = receiver
        .wait_for(WITHIN, "Envoy's span and idemd's acquire and complete of the confirm", |s| {
            let idemd = in_trace(s, &agent.trace_id, "idemd");
            envoy_spans_in(s, &agent.trace_id)
                && ["idemd acquire", "idemd complete"].iter().all(|n| idemd.iter().any(|s| s.name == *n))
        })
        .await?;
    assert!(receiver.refused().is_empty(), "{:?}", receiver.refused());
    let envoy = envoy_span(&spans, &agent);
    let parent = callout_parent(&spans, envoy, &agent)?;
    let acquire = idemd_span(&spans, "idemd acquire", &agent, parent)?;
    assert_eq!(acquire.kind, 2, "idemd's API span is a server span");
    // The request id joins them too (docs/operations.md, "Traces"): Envoy's tag, idemd's `trace_id`.
    let request_id = envoy.attribute("guid:x-request-id");
    assert!(request_id.is_some() && request_id == acquire.attribute("trace_id"), "{envoy:?}\n{acquire:?}");
    idemd_span(&spans, "idemd complete", &agent, parent)?;

    // A replay from the filter's cache: Envoy's span, no callout, so no idemd span in its trace.
    let replay = AgentSpan::new(2);
    let tp = replay.traceparent();
    let cached =
        stack.post("/v1/transfers", SUBJECT, &body, &[("agent-fingerprint", &fp), ("traceparent", &tp)]).await?;
    cached.assert_prompt("already_completed");
    assert_eq!(stack.stat("wasmcustom.idem.replay_cache_hits").await?, 1, "the replay was the cache's");
    let spans =
        receiver.wait_for(WITHIN, "Envoy's span of the cached replay", |s| envoy_spans_in(s, &replay.trace_id)).await?;
    envoy_span(&spans, &replay);
    // idemd exports within 100 ms; give it ten times that to show up if it were called.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idemd = in_trace(&receiver.spans(), &replay.trace_id, "idemd").len();
    assert_eq!(idemd, 0, "a cached replay makes no callout: {:#?}", receiver.spans());
    let m = stack.idemd_metrics().await?;
    assert_eq!(metric(&m, "idem_acquire_total", &[("outcome", "DONE")]).unwrap_or(0.0), 0.0, "{m}");

    // A new Envoy has an empty cache: the replay is idemd's, in the replay's trace. On the ext_proc host the
    // cache is in idemd's host (idemd is the filter): a new idemd has an empty one.
    if FilterHost::current()?.is_ext_proc() {
        stack.restart_sidecar().await?;
    } else {
        stack.restart_envoy().await?;
    }
    let through = AgentSpan::new(3);
    let tp = through.traceparent();
    let again =
        stack.post("/v1/transfers", SUBJECT, &body, &[("agent-fingerprint", &fp), ("traceparent", &tp)]).await?;
    again.assert_prompt("already_completed");
    assert_eq!(stack.stat("wasmcustom.idem.replay_cache_hits").await?, 0, "the new cache was empty");
    let spans = receiver
        .wait_for(WITHIN, "Envoy's span and idemd's acquire of the replay", |s| {
            envoy_spans_in(s, &through.trace_id)
                && in_trace(s, &through.trace_id, "idemd").iter().any(|s| s.name == "idemd acquire")
        })
        .await?;
    let envoy = envoy_span(&spans, &through);
    idemd_span(&spans, "idemd acquire", &through, callout_parent(&spans, envoy, &through)?)?;
    let m = stack.idemd_metrics().await?;
    assert_eq!(metric(&m, "idem_acquire_total", &[("outcome", "DONE")]), Some(1.0), "idemd answered the replay: {m}");
    assert_eq!(counts(&stack).await?.0, 1, "one execution");
    Ok(())
}

/// An agent that sends no `traceparent`: Envoy starts the trace. With the native module idemd's spans are still
/// children of Envoy's, on the ext_proc host children of Envoy's span of its gRPC stream to idemd; the `.wasm`
/// cannot see Envoy's span, so its callouts start a trace named after the
/// request id the replies carry (`x-request-id` without its dashes), which Envoy's span names in its tag.
async fn without_a_traceparent_the_request_id_names_idemds_trace(sql: Sql, with_redis: bool) -> TestResult {
    let Some(stores) = stores(sql, with_redis)? else { return Ok(()) };
    let receiver = OtlpReceiver::start().await?;
    let stack = traced_stack(&receiver, stores).await?;
    let (_, fp) = stack.preview(json!("71.00")).await?;
    let confirm =
        stack.post("/v1/transfers", SUBJECT, &transfer(json!("71.00"), "m"), &[("agent-fingerprint", &fp)]).await?;
    assert_eq!(confirm.status, 201, "{confirm:?}");
    let spans = receiver
        .wait_for(WITHIN, "idemd's acquire and Envoy's span of the same request id", |s| {
            s.iter().filter(|a| a.name == "idemd acquire").any(|a| {
                s.iter()
                    .any(|e| e.service == ENVOY_SERVICE && e.attribute("guid:x-request-id") == a.attribute("trace_id"))
            })
        })
        .await?;
    let acquire = spans.iter().find(|s| s.name == "idemd acquire").ok_or("no acquire span")?;
    let request_id = acquire.attribute("trace_id").ok_or("no trace_id attribute")?;
    let envoy = spans
        .iter()
        .find(|e| e.service == ENVOY_SERVICE && e.attribute("guid:x-request-id") == Some(request_id))
        .ok_or("no Envoy span of the request")?;
    assert_eq!(envoy.parent, "", "Envoy started the trace: {envoy:?}");
    if FilterHost::current()?.is_native() {
        assert_eq!(
            (acquire.trace_id.as_str(), acquire.parent.as_str()),
            (envoy.trace_id.as_str(), envoy.span_id.as_str())
        );
    } else if FilterHost::current()?.is_ext_proc() {
        // A child of Envoy's span of the gRPC stream that carried the request, in Envoy's trace.
        let spans = receiver
            .wait_for(WITHIN, "Envoy's gRPC stream to idemd", |s| {
                s.iter().any(|c| c.name == EXT_PROC_CALL && c.parent == envoy.span_id)
            })
            .await?;
        let call = ext_proc_call(&spans, envoy)?;
        assert_eq!((acquire.trace_id.as_str(), acquire.parent.as_str()), (envoy.trace_id.as_str(), call));
    } else {
        assert_eq!(acquire.trace_id, request_id.replace('-', ""), "the trace is named after the request id");
        assert_ne!(acquire.trace_id, envoy.trace_id, "Envoy's own trace id is its tracer's");
    }
    Ok(())
}
