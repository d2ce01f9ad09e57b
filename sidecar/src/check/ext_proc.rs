//! The ext_proc host (`idemd serve --ext-proc ADDR --ext-proc-config FILE`): Envoy's own
//! `envoy.filters.http.ext_proc` filter sends every stream to idemd, which runs the same machine as
//! the `.wasm` and the native module. The plugin configuration is not in the Envoy configuration but
//! in idemd's file, so `idemd check` is given the same file (`--ext-proc-config`, or
//! `IDEM_EXT_PROC_CONFIG` as `serve` reads it); where a chain runs no `.wasm` or native agent
//! filter, its ext_proc filter is then the agent filter, and every route rule applies to it.
//!
//! What makes the ext_proc filter itself a hole is refused here, deny by default (docs/deploy.md,
//! "What the ext_proc filter in front of idemd needs"):
//!
//! * `ext-proc-config`: the check was given no plugin configuration, or a chain has several ext_proc
//!   filters (it cannot tell which one is idemd's);
//! * `ext-proc-fail-open`: `failure_mode_allow: true` or `observability_mode: true` lets a request go
//!   upstream unjudged;
//! * `ext-proc-processing-mode`: headers not sent, trailers not sent, a body mode that cannot hold a
//!   stream;
//! * `ext-proc-message-timeout`: Envoy gives up before idemd's own store call may;
//! * `ext-proc-attributes`: the route's annotation or the answer's code details not sent;
//! * `ext-proc-cluster`: the gRPC service's cluster is missing or does not speak HTTP/2;
//! * `ext-proc-settings`: any other setting that changes what Envoy does with idemd's answers (and
//!   any the check does not know);
//! * `ext-proc-per-route`: a per-route `overrides` on a guarded route or its virtual host.
//!
//! `disabled: true` per route (ExtProcPerRoute or FilterConfig) is the existing rules' (the filter is
//! disabled on the route, as for the other hosts).
//!
//! The decisions are here, over the filter's settings as written; `rules` applies them to each
//! connection manager whose agent filter is an ext_proc filter (so this module reads nothing of the
//! parsed configuration, and `model` can read entries with it).

use serde_json::Value;

/// The ext_proc filter's `@type`.
pub const EXT_PROC_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor";

/// Envoy's `message_timeout` when unset.
const DEFAULT_MESSAGE_TIMEOUT_MS: u64 = 200;

/// The attribute that carries the route's metadata (its `agent_idempotency` annotation).
const ROUTE_METADATA: &str = "xds.route_metadata";
/// The attribute that tells the upstream's answer from Envoy's own.
const CODE_DETAILS: &str = "response.code_details";

/// Whether an `http_filters` entry is Envoy's ext_proc filter.
pub fn is_ext_proc(f: &Value) -> bool {
    f.pointer("/typed_config/@type").and_then(Value::as_str) == Some(EXT_PROC_TYPE)
}

/// What the rules read of the ext_proc filter that is the agent filter.
#[derive(Debug, Clone)]
pub struct ExtProcEntry {
    /// Its `typed_config`, as written.
    pub typed: Value,
    /// Why its gRPC service is not a static cluster that speaks HTTP/2 (None: it is).
    pub cluster_gap: Option<String>,
    /// How many more ext_proc filters the chain runs.
    pub others: usize,
    /// Whether the check was given the plugin configuration idemd serves it with.
    pub config_given: bool,
}

impl ExtProcEntry {
    pub fn read(entry: &Value, doc: &Value, others: usize, config_given: bool) -> ExtProcEntry {
        let typed = entry.get("typed_config").cloned().unwrap_or(Value::Null);
        ExtProcEntry { cluster_gap: cluster_gap(&typed, doc), typed, others, config_given }
    }
}

/// Why the plugin configuration is missing, as `config_error` says it.
pub fn no_config(name: &str) -> String {
    format!(
        "{name} is Envoy's ext_proc filter, and idemd check was given no plugin configuration for it: give it the \
         file idemd serve runs the ext_proc host with (`--ext-proc-config FILE`, or IDEM_EXT_PROC_CONFIG)"
    )
}

/// Why the gRPC service the filter calls is not one idemd's ext_proc host can be (None: it can).
fn cluster_gap(typed: &Value, doc: &Value) -> Option<String> {
    if typed.get("http_service").is_some() {
        return Some("calls its processor over HTTP (`http_service`): idemd serves ext_proc over gRPC only".into());
    }
    let Some(service) = typed.get("grpc_service") else {
        return Some("has no `grpc_service`".into());
    };
    if service.get("google_grpc").is_some() {
        // The gRPC library speaks HTTP/2 itself, without an Envoy cluster.
        return None;
    }
    let Some(name) = service.pointer("/envoy_grpc/cluster_name").and_then(Value::as_str) else {
        return Some("`grpc_service` names no `envoy_grpc.cluster_name` (nor `google_grpc`)".into());
    };
    let clusters = doc.pointer("/static_resources/clusters").and_then(Value::as_array);
    let Some(cluster) = clusters.into_iter().flatten().find(|c| c.get("name").and_then(Value::as_str) == Some(name))
    else {
        return Some(format!(
            "`grpc_service.envoy_grpc.cluster_name: {name}` is not a cluster of `static_resources.clusters` (a \
             cluster from CDS is one this check cannot read): Envoy cannot reach the processor"
        ));
    };
    if speaks_http2(cluster) {
        return None;
    }
    Some(format!(
        "its cluster {name} is not set to HTTP/2 (`typed_extension_protocol_options` \
         `envoy.extensions.upstreams.http.v3.HttpProtocolOptions` with `explicit_http_config: {{ \
         http2_protocol_options: {{}} }}`): gRPC needs HTTP/2, and a cluster that may speak HTTP/1.1 to idemd's \
         ext_proc port never reaches the processor"
    ))
}

/// Whether a cluster always speaks HTTP/2 to its endpoints (`auto_config` and
/// `use_downstream_protocol_config` may fall back to HTTP/1.1).
fn speaks_http2(cluster: &Value) -> bool {
    let options =
        cluster.pointer("/typed_extension_protocol_options/envoy.extensions.upstreams.http.v3.HttpProtocolOptions");
    cluster.get("http2_protocol_options").is_some()
        || options.and_then(|o| o.pointer("/explicit_http_config/http2_protocol_options")).is_some()
}

/// The settings that let a request past the processor unjudged.
pub fn fail_open_settings(typed: &Value) -> Vec<String> {
    let mut out = Vec::new();
    if typed.get("failure_mode_allow").is_some_and(|v| v != &Value::Bool(false)) {
        out.push(
            "`failure_mode_allow` set otherwise than `false`: when idemd cannot be reached (down, overloaded, the \
             stream broken) Envoy lets the request through unjudged, a confirm executes unguarded"
                .to_string(),
        );
    }
    if typed.get("observability_mode").is_some_and(|v| v != &Value::Bool(false)) {
        out.push(
            "`observability_mode` set otherwise than `false`: Envoy sends idemd copies and forwards every request \
             without waiting for its judgement"
                .to_string(),
        );
    }
    out
}

/// A header mode as written; unset is Envoy's default.
fn mode<'a>(pm: Option<&'a Value>, key: &str) -> Result<Option<&'a str>, String> {
    match pm.and_then(|p| p.get(key)) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.as_str())),
        Some(other) => Err(format!("`processing_mode.{key}: {other}` is not a mode name this check reads")),
    }
}

/// What is wrong with `processing_mode` (each naming its field), and what idemd does under it.
pub fn processing_mode_gaps(typed: &Value) -> Vec<String> {
    let pm = typed.get("processing_mode");
    let mut out = Vec::new();
    const KNOWN: [&str; 6] = [
        "request_header_mode",
        "response_header_mode",
        "request_body_mode",
        "response_body_mode",
        "request_trailer_mode",
        "response_trailer_mode",
    ];
    for key in pm.and_then(Value::as_object).into_iter().flat_map(|o| o.keys()) {
        if !KNOWN.contains(&key.as_str()) {
            out.push(format!("`processing_mode.{key}` is a setting this check does not know"));
        }
    }
    for (key, why) in [
        ("request_header_mode", "idemd never sees the request: every request, a confirm too, goes upstream unjudged"),
        (
            "response_header_mode",
            "idemd never sees the answer: nothing records it, the agent gets no envelope, and the operation stays \
             in flight until its lease lapses",
        ),
    ] {
        match mode(pm, key) {
            // DEFAULT (and unset) is SEND for headers.
            Ok(None | Some("SEND" | "DEFAULT")) => {}
            Ok(Some(m)) => out.push(format!("`processing_mode.{key}: {m}`: {why}; use SEND")),
            Err(e) => out.push(e),
        }
    }
    for key in ["request_trailer_mode", "response_trailer_mode"] {
        match mode(pm, key) {
            Ok(Some("SEND")) => {}
            Ok(m) => out.push(format!(
                "`processing_mode.{key}: {}`: the ext_proc host reads the trailers as the end of a body that has \
                 them (docs/deploy.md); use SEND",
                m.unwrap_or("unset (Envoy's default, SKIP)")
            )),
            Err(e) => out.push(e),
        }
    }
    for key in ["request_body_mode", "response_body_mode"] {
        let why = match mode(pm, key) {
            Ok(Some("BUFFERED" | "FULL_DUPLEX_STREAMED")) => continue,
            Ok(None | Some("NONE")) => "Envoy never shows idemd the body",
            Ok(Some("STREAMED")) => "Envoy sends the headers on before the body is judged",
            Ok(Some("BUFFERED_PARTIAL")) => "Envoy shows idemd only the first part of a large body",
            Ok(Some(_)) => "a body mode the ext_proc host does not hold a stream in",
            Err(e) => {
                out.push(e);
                continue;
            }
        };
        let written = mode(pm, key).ok().flatten().unwrap_or("unset (Envoy's default, NONE)");
        out.push(format!(
            "`processing_mode.{key}: {written}`: {why}, so idemd refuses every guarded request (503 \
             status_unavailable, nothing forwarded); use BUFFERED or FULL_DUPLEX_STREAMED in both directions"
        ));
    }
    out
}

/// Why `message_timeout` does not outlast idemd's own store call (`sidecar_timeout_ms`).
pub fn message_timeout_gap(typed: &Value, sidecar_timeout_ms: u64) -> Option<String> {
    let (ms, written) = match typed.get("message_timeout") {
        None => (DEFAULT_MESSAGE_TIMEOUT_MS, "unset (Envoy's default, 200 ms)".to_string()),
        Some(v) => match super::forward::duration_ms(v) {
            Ok(ms) => (ms, format!("{ms} ms")),
            Err(e) => return Some(format!("`message_timeout`: {e}")),
        },
    };
    (ms <= sidecar_timeout_ms).then(|| {
        format!(
            "`message_timeout` {written} does not exceed the plugin's `sidecar_timeout_ms` {sidecar_timeout_ms} ms: \
             Envoy ends the stream with its ext_proc error while idemd still waits for its store, and the agent \
             reads Envoy's error instead of idemd's answer about an operation whose acquire or record may have \
             been written"
        )
    })
}

/// The attribute names of `key` (`request_attributes`), Err when they are not a list of names.
fn attributes<'a>(typed: &'a Value, key: &str) -> Result<Vec<&'a str>, String> {
    match typed.get(key) {
        None => Ok(Vec::new()),
        Some(Value::Array(list)) => {
            list.iter().map(|v| v.as_str().ok_or_else(|| format!("`{key}` holds {v}, not an attribute name"))).collect()
        }
        Some(other) => Err(format!("`{key}: {other}` is not a list of attribute names")),
    }
}

/// What Envoy does not send idemd that it needs. `annotated`: routes where the filter runs carry the
/// `agent_idempotency` metadata.
pub fn attribute_gaps(typed: &Value, annotated: bool) -> Vec<String> {
    let mut out = Vec::new();
    match attributes(typed, "request_attributes") {
        Ok(list) if annotated && !list.contains(&ROUTE_METADATA) => out.push(format!(
            "`request_attributes` without {ROUTE_METADATA}, and routes carry the agent_idempotency metadata: idemd \
             never sees a route's annotation, so annotated routes pass unguarded (or as a route rule reads them)"
        )),
        Ok(_) => {}
        Err(e) => out.push(e),
    }
    match attributes(typed, "response_attributes") {
        Ok(list) if !list.contains(&CODE_DETAILS) => out.push(format!(
            "`response_attributes` without {CODE_DETAILS}: idemd cannot tell the upstream's answer from Envoy's own, \
             so every answer to a guarded request, a 201 too, is recorded as unknown (in flight to the agent, held \
             for review), and one Envoy made without reaching the upstream releases nothing"
        )),
        Ok(_) => {}
        Err(e) => out.push(e),
    }
    out
}

/// The fields of `ExternalProcessor` the check reads elsewhere, or that change nothing about what reaches the
/// upstream or the agent (names, stats, what metadata is forwarded, how long Envoy keeps a closed stream, which
/// mode overrides idemd may ask for: it asks only to skip an unguarded stream).
const KNOWN: &[&str] = &[
    "@type",
    "grpc_service",
    "http_service",
    "failure_mode_allow",
    "observability_mode",
    "processing_mode",
    "request_attributes",
    "response_attributes",
    "message_timeout",
    "max_message_timeout",
    "stat_prefix",
    "metadata_options",
    "allow_mode_override",
    "allowed_override_modes",
    "filter_metadata",
    "deferred_close_timeout",
    "send_body_without_waiting_for_header_response",
    "disable_clear_route_cache",
    "route_cache_action",
    "status_on_error",
];

/// What else in the filter's settings may let a request past idemd or change its answers.
pub fn settings_gaps(typed: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for key in typed.as_object().into_iter().flat_map(|o| o.keys()) {
        let why = match key.as_str() {
            "disable_immediate_response" if typed.get(key) == Some(&Value::Bool(false)) => continue,
            "disable_immediate_response" => "Envoy does not send idemd's own answers (refusals, replays) to the agent",
            "mutation_rules" => {
                "Envoy may drop or refuse idemd's header changes (the Idempotency-Key it sets, the client's it removes)"
            }
            "forward_rules" => {
                "Envoy may not show idemd the headers it judges by (Idempotency-Key, Agent-Fingerprint, the subject)"
            }
            "processing_request_modifier" | "on_processing_response" => {
                "an extension changes what Envoy sends idemd or does with its answers"
            }
            "route_cache_action" if typed.get(key) == Some(&Value::String("CLEAR".into())) => {
                "Envoy picks the route again after idemd changed the headers, and may send the judged request by \
                 another route"
            }
            "route_cache_action" => match typed.get(key).and_then(Value::as_str) {
                Some("DEFAULT" | "RETAIN") => continue,
                _ => "a route cache action this check does not know",
            },
            "status_on_error" => match status_on_error(typed.get(key)) {
                Some(code) if code >= 500 => continue,
                _ => "a processor failure answered otherwise than with a 5xx reads to the agent as the operation's answer",
            },
            k if KNOWN.contains(&k) => continue,
            _ => "a setting this check does not know, and one that may change what reaches the upstream or the agent",
        };
        out.push(format!("`{key}`: {why}"));
    }
    out
}

/// `status_on_error.code` as a number (Envoy's `StatusCode` enum, by number or name).
fn status_on_error(v: Option<&Value>) -> Option<u64> {
    let code = v?.get("code")?;
    if let Some(n) = code.as_u64() {
        return Some(n);
    }
    match code.as_str()? {
        "InternalServerError" => Some(500),
        "BadGateway" => Some(502),
        "ServiceUnavailable" => Some(503),
        "GatewayTimeout" => Some(504),
        _ => None,
    }
}

/// The fields of a per-route `ExtProcPerRoute` (inside a `FilterConfig`'s `config` too) that take the guard
/// away from a guarded route: every `overrides` field but the metadata idemd is sent with.
pub fn per_route_gaps(per_route: &Value) -> Vec<String> {
    let inner = match per_route.get("config") {
        Some(c) if per_route.get("@type").and_then(Value::as_str).is_some_and(|t| t.ends_with(".FilterConfig")) => c,
        _ => per_route,
    };
    let mut out = Vec::new();
    for (key, value) in inner.as_object().into_iter().flatten() {
        match key.as_str() {
            // `disabled: true` is the rules' that refuse a disabled filter on a guarded route.
            "@type" | "disabled" | "is_optional" => {}
            "overrides" => {
                for field in value.as_object().into_iter().flat_map(|o| o.keys()) {
                    if !["metadata_options", "grpc_initial_metadata"].contains(&field.as_str()) {
                        out.push(format!(
                            "`overrides.{field}`: the route's requests are processed otherwise than the filter's \
                             own settings, which this check judged (a processing mode that never shows idemd the \
                             request or its body, another processor, failing open)"
                        ));
                    }
                }
            }
            other => out.push(format!("`{other}`: a per-route setting this check does not know")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// What tests/src/ext_proc.rs converts the e2e configurations to.
    fn good() -> Value {
        json!({
            "@type": EXT_PROC_TYPE,
            "grpc_service": { "envoy_grpc": { "cluster_name": "idem_ext_proc" } },
            "failure_mode_allow": false,
            "message_timeout": "10s",
            "allow_mode_override": true,
            "processing_mode": {
                "request_header_mode": "SEND", "response_header_mode": "SEND",
                "request_body_mode": "BUFFERED", "response_body_mode": "BUFFERED",
                "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"
            },
            "request_attributes": ["xds.route_metadata", "xds.route_name"],
            "response_attributes": ["response.code_details"],
            "metadata_options": { "forwarding_namespaces": { "untyped": ["envoy.filters.http.jwt_authn"] } }
        })
    }

    fn with(path: &str, value: Value) -> Value {
        let mut v = good();
        let (parent, key) = path.rsplit_once('/').unwrap_or(("", path));
        let target = if parent.is_empty() { Some(&mut v) } else { v.pointer_mut(parent) };
        if let Some(obj) = target.and_then(Value::as_object_mut) {
            match value {
                Value::Null => obj.remove(key),
                other => obj.insert(key.to_string(), other),
            };
        }
        v
    }

    fn doc(cluster: Value) -> Value {
        json!({ "static_resources": { "clusters": [cluster] } })
    }

    fn h2_cluster() -> Value {
        json!({ "name": "idem_ext_proc", "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "explicit_http_config": { "http2_protocol_options": {} } } } })
    }

    #[test]
    fn the_converted_e2e_filter_passes_every_ext_proc_rule() {
        let typed = good();
        assert!(fail_open_settings(&typed).is_empty());
        assert!(processing_mode_gaps(&typed).is_empty(), "{:?}", processing_mode_gaps(&typed));
        let duplex = with("/processing_mode/request_body_mode", json!("FULL_DUPLEX_STREAMED"));
        let duplex = {
            let mut d = duplex;
            d["processing_mode"]["response_body_mode"] = json!("FULL_DUPLEX_STREAMED");
            d
        };
        assert!(processing_mode_gaps(&duplex).is_empty());
        assert_eq!(message_timeout_gap(&typed, 5_000), None);
        assert!(attribute_gaps(&typed, true).is_empty());
        assert!(settings_gaps(&typed).is_empty(), "{:?}", settings_gaps(&typed));
        assert_eq!(cluster_gap(&typed, &doc(h2_cluster())), None);
        assert!(per_route_gaps(&json!({ "@type": "x.ExtProcPerRoute", "overrides": { "grpc_initial_metadata": [] } }))
            .is_empty());
    }

    #[test]
    fn failing_open_is_refused_naming_the_field() {
        let open = fail_open_settings(&with("/failure_mode_allow", json!(true)));
        assert!(open.len() == 1 && open[0].contains("`failure_mode_allow`"), "{open:?}");
        let observing = fail_open_settings(&with("/observability_mode", json!(true)));
        assert!(observing.len() == 1 && observing[0].contains("`observability_mode`"), "{observing:?}");
        assert!(fail_open_settings(&with("/failure_mode_allow", Value::Null)).is_empty(), "unset is false");
    }

    #[test]
    fn a_processing_mode_that_cannot_hold_a_stream_is_refused_naming_the_field() {
        for (path, value, says) in [
            ("/processing_mode/request_header_mode", json!("SKIP"), "request_header_mode: SKIP"),
            ("/processing_mode/response_header_mode", json!("SKIP"), "response_header_mode: SKIP"),
            ("/processing_mode/request_trailer_mode", json!("SKIP"), "request_trailer_mode: SKIP"),
            ("/processing_mode/response_trailer_mode", Value::Null, "response_trailer_mode: unset"),
            ("/processing_mode/request_body_mode", json!("STREAMED"), "request_body_mode: STREAMED"),
            ("/processing_mode/response_body_mode", json!("NONE"), "response_body_mode: NONE"),
            ("/processing_mode/request_body_mode", json!("BUFFERED_PARTIAL"), "BUFFERED_PARTIAL"),
            ("/processing_mode/response_body_mode", Value::Null, "response_body_mode: unset"),
            ("/processing_mode/request_body_mode", json!(2), "is not a mode name"),
            ("/processing_mode/send_everything", json!(true), "does not know"),
        ] {
            let gaps = processing_mode_gaps(&with(path, value));
            assert!(gaps.len() == 1 && gaps[0].contains(says), "{path}: {gaps:?}");
        }
        let unset = processing_mode_gaps(&with("/processing_mode", Value::Null));
        assert_eq!(unset.len(), 4, "trailers and bodies (headers default to SEND): {unset:?}");
        assert!(processing_mode_gaps(&with("/processing_mode/request_header_mode", Value::Null)).is_empty());
    }

    #[test]
    fn a_message_timeout_within_the_sidecar_timeout_is_refused() {
        let unset = message_timeout_gap(&with("/message_timeout", Value::Null), 200);
        assert!(unset.is_some_and(|g| g.contains("unset (Envoy's default, 200 ms)")));
        assert_eq!(message_timeout_gap(&with("/message_timeout", Value::Null), 199), None);
        assert!(message_timeout_gap(&typed_timeout("5s"), 5_000).is_some_and(|g| g.contains("5000 ms")));
        assert_eq!(message_timeout_gap(&typed_timeout("5.001s"), 5_000), None);
        assert!(message_timeout_gap(&typed_timeout("5 seconds"), 5_000).is_some_and(|g| g.contains("message_timeout")));
    }

    fn typed_timeout(t: &str) -> Value {
        with("/message_timeout", json!(t))
    }

    #[test]
    fn attributes_idemd_needs_are_required() {
        let no_meta = with("/request_attributes", json!(["xds.route_name"]));
        let gaps = attribute_gaps(&no_meta, true);
        assert!(gaps.len() == 1 && gaps[0].contains("`request_attributes` without xds.route_metadata"), "{gaps:?}");
        assert!(attribute_gaps(&no_meta, false).is_empty(), "route rules need no metadata");
        let gaps = attribute_gaps(&with("/response_attributes", Value::Null), false);
        assert!(gaps.len() == 1 && gaps[0].contains("`response_attributes` without response.code_details"));
        let gaps = attribute_gaps(&with("/request_attributes", json!("xds.route_metadata")), true);
        assert!(gaps.len() == 1 && gaps[0].contains("not a list"), "{gaps:?}");
    }

    #[test]
    fn a_processor_cluster_that_is_missing_or_not_http2_is_refused() {
        let typed = good();
        let missing = cluster_gap(&typed, &doc(json!({ "name": "other" })));
        assert!(missing.is_some_and(|g| g.contains("is not a cluster of `static_resources.clusters`")));
        let http1 = cluster_gap(&typed, &doc(json!({ "name": "idem_ext_proc" })));
        assert!(http1.is_some_and(|g| g.contains("not set to HTTP/2")));
        let legacy = json!({ "name": "idem_ext_proc", "http2_protocol_options": {} });
        assert_eq!(cluster_gap(&typed, &doc(legacy)), None);
        let http = with("/http_service", json!({}));
        assert!(cluster_gap(&http, &doc(h2_cluster())).is_some_and(|g| g.contains("http_service")));
        let google = with("/grpc_service", json!({ "google_grpc": { "target_uri": "idemd:9191" } }));
        assert_eq!(cluster_gap(&google, &doc(json!({}))), None);
    }

    #[test]
    fn settings_that_change_idemds_answers_or_the_check_does_not_know_are_refused() {
        for (key, value, says) in [
            ("disable_immediate_response", json!(true), "idemd's own answers"),
            ("mutation_rules", json!({ "disallow_all": true }), "header changes"),
            ("forward_rules", json!({}), "headers it judges by"),
            ("route_cache_action", json!("CLEAR"), "picks the route again"),
            ("status_on_error", json!({ "code": 200 }), "5xx"),
            ("processing_request_modifier", json!({}), "an extension"),
            ("some_future_field", json!(1), "does not know"),
        ] {
            let gaps = settings_gaps(&with(&format!("/{key}"), value));
            assert!(gaps.len() == 1 && gaps[0].contains(&format!("`{key}`")) && gaps[0].contains(says), "{gaps:?}");
        }
        for (key, value) in [
            ("disable_immediate_response", json!(false)),
            ("route_cache_action", json!("RETAIN")),
            ("status_on_error", json!({ "code": "ServiceUnavailable" })),
        ] {
            assert!(settings_gaps(&with(&format!("/{key}"), value)).is_empty(), "{key}");
        }
    }

    mod rules {
        use super::super::super::testing::{findings, findings_given, flags, plugin, Fixture, CONFIRM_ROUTE as ROUTES};
        use super::super::super::{check_envoy, Report};

        const EXT_PROC_RULES: [&str; 8] = [
            "ext-proc-config",
            "ext-proc-fail-open",
            "ext-proc-processing-mode",
            "ext-proc-message-timeout",
            "ext-proc-attributes",
            "ext-proc-cluster",
            "ext-proc-settings",
            "ext-proc-per-route",
        ];

        /// The fixture's text with `from` replaced once, checked with the fixture's plugin configuration.
        fn edited(fixture: &Fixture, from: &str, to: &str) -> Report {
            let yaml = fixture.yaml();
            assert_eq!(yaml.matches(from).count(), 1, "{from:?} in\n{yaml}");
            let text = yaml.replacen(from, to, 1);
            check_envoy("test.yaml", &text, &flags(), Some(&fixture.plugin)).unwrap_or_else(|e| panic!("{e}"))
        }

        fn of(report: &Report, rule: &str) -> Vec<String> {
            report.findings.iter().filter(|f| f.rule == rule).map(|f| format!("{}: {}", f.at, f.message)).collect()
        }

        #[test]
        fn the_ext_proc_filter_is_the_agent_filter_and_passes_as_the_e2e_suite_writes_it() {
            let fixture = Fixture::ext_proc(ROUTES);
            for rule in EXT_PROC_RULES.iter().chain(&[
                "plugin-config",
                "route-annotation",
                "guarded-routes-exist",
                "wasm-reload",
            ]) {
                assert_eq!(findings(&fixture, &flags(), rule), Vec::<String>::new(), "{rule}");
            }
            let report = check_envoy("test.yaml", &fixture.yaml(), &flags(), Some(&fixture.plugin));
            assert_eq!(report.map(|r| r.managers_with_filter).ok(), Some(1), "the manager runs the agent filter");
            // A route rule's catch-all is guarded through it too: the rules read its plugin configuration.
            let catch_all = "- name: all\n  match: { prefix: / }\n  route: { cluster: demo }\n";
            let mut rules = Fixture::ext_proc(catch_all);
            rules.plugin = plugin(
                r#""routes": [{"name": "c", "match": {"path": "/v1/transfers"}, "role": "confirm", "scope": "s", "bind": "/amount", "upstream_keys": "honoured"}]"#,
            );
            assert!(findings(&rules, &flags(), "plugin-config").is_empty(), "the rules are read");
            assert!(findings(&rules, &flags(), "guarded-routes-exist").is_empty());
            assert!(findings(&rules, &flags(), "catch-all-to-guarded-cluster").is_empty());
        }

        #[test]
        fn an_ext_proc_filter_checked_without_its_plugin_configuration_is_refused_saying_so() {
            let fixture = Fixture::ext_proc(ROUTES);
            let found = findings_given(&fixture, &flags(), "ext-proc-config", None);
            assert!(found.len() == 1 && found[0].contains("--ext-proc-config FILE"), "{found:?}");
            assert!(findings_given(&fixture, &flags(), "plugin-config", None).is_empty(), "said once");
            // A chain that runs the `.wasm` does not make an ext_proc filter beside it idemd's.
            assert!(findings_given(&Fixture::new(ROUTES), &flags(), "ext-proc-config", None).is_empty());
        }

        #[test]
        fn each_setting_of_the_filter_is_refused_by_its_rule() {
            let fixture = Fixture::ext_proc(ROUTES);
            for (from, to, rule, says) in [
                ("failure_mode_allow: false", "failure_mode_allow: true", "ext-proc-fail-open", "`failure_mode_allow`"),
                ("request_body_mode: BUFFERED", "request_body_mode: STREAMED", "ext-proc-processing-mode", "STREAMED"),
                ("message_timeout: 10s", "message_timeout: 0.2s", "ext-proc-message-timeout", "200 ms"),
                (
                    "request_attributes: [xds.route_metadata]",
                    "request_attributes: []",
                    "ext-proc-attributes",
                    "xds.route_metadata",
                ),
                ("cluster_name: idem_ext_proc", "cluster_name: elsewhere", "ext-proc-cluster", "elsewhere"),
                ("http2_protocol_options: {}", "http_protocol_options: {}", "ext-proc-cluster", "HTTP/2"),
                ("failure_mode_allow: false", "mutation_rules: {}", "ext-proc-settings", "`mutation_rules`"),
            ] {
                let report = edited(&fixture, from, to);
                let found = of(&report, rule);
                assert!(found.len() == 1 && found[0].contains(says), "{to}: {found:?}");
                assert!(found[0].starts_with("test.yaml: listener agents: envoy.filters.http.ext_proc: "), "{found:?}");
            }
            let two = edited(
                &fixture,
                "          - name: envoy.filters.http.ext_proc\n",
                "          - name: other\n            typed_config: { \"@type\": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor }\n          - name: envoy.filters.http.ext_proc\n",
            );
            let found = of(&two, "ext-proc-config");
            assert!(found.len() == 1 && found[0].contains("runs 2 ext_proc filters"), "{found:?}");
        }

        #[test]
        fn per_route_overrides_or_disabled_on_a_guarded_route_are_refused() {
            let per_route = |fields: &str| {
                format!(
                    "{ROUTES}  typed_per_filter_config:\n    envoy.filters.http.ext_proc:\n      \"@type\": \
                     type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute\n      {fields}\n"
                )
            };
            let overrides =
                Fixture::ext_proc(&per_route("overrides: { processing_mode: { request_body_mode: NONE } }"));
            let found = findings(&overrides, &flags(), "ext-proc-per-route");
            assert!(found.len() == 1 && found[0].contains("route transfer_confirm: guarded"), "{found:?}");
            assert!(found[0].contains("`overrides.processing_mode`"), "{found:?}");
            let metadata = Fixture::ext_proc(&per_route("overrides: { grpc_initial_metadata: [] }"));
            assert!(findings(&metadata, &flags(), "ext-proc-per-route").is_empty());
            // ExtProcPerRoute's own `disabled: true` is the filter disabled on the route, as for the other hosts.
            let disabled = Fixture::ext_proc(&per_route("disabled: true"));
            let found = findings(&disabled, &flags(), "filter-disabled-on-annotated-route");
            assert!(
                found.len() == 1 && found[0].contains("envoy.filters.http.ext_proc filter is disabled"),
                "{found:?}"
            );
            // On a route nothing guards, an override changes nothing the check judged.
            let plain = "- name: health\n  match: { path: /healthz }\n  route: { cluster: demo }\n  typed_per_filter_config:\n    envoy.filters.http.ext_proc: { overrides: { processing_mode: {} } }\n";
            let unguarded = Fixture::ext_proc(&format!("{ROUTES}{plain}"));
            assert!(findings(&unguarded, &flags(), "ext-proc-per-route").is_empty());
        }
    }

    #[test]
    fn per_route_overrides_on_a_guarded_route_are_refused() {
        let mode = json!({ "@type": "x.ExtProcPerRoute", "overrides": { "processing_mode": { "request_body_mode": "NONE" } } });
        let gaps = per_route_gaps(&mode);
        assert!(gaps.len() == 1 && gaps[0].contains("`overrides.processing_mode`"), "{gaps:?}");
        let wrapped = json!({ "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig",
            "config": { "overrides": { "failure_mode_allow": true } } });
        let gaps = per_route_gaps(&wrapped);
        assert!(gaps.len() == 1 && gaps[0].contains("`overrides.failure_mode_allow`"), "{gaps:?}");
        assert!(per_route_gaps(&json!({ "disabled": true })).is_empty(), "the disabled rules' own");
    }
}
