//! Small Envoy configurations for the rules' unit tests: one listener whose
//! connection manager runs the agent filter, one virtual host, the routes a
//! test gives, and the plugin configuration (with whatever fields a test adds).

use crate::config::TtlArgs;

use super::check_envoy;

/// One guarded confirm route, annotated as the filter accepts it: what most rules' tests guard.
pub const CONFIRM_ROUTE: &str = r#"
- name: transfer_confirm
  match: { path: /v1/transfers }
  route: { cluster: demo }
  metadata:
    filter_metadata:
      agent_idempotency: { role: confirm, scope: payments.transfer, bind: /amount, upstream_keys: honoured }
"#;

/// The pieces of the configuration a test varies.
pub struct Fixture {
    /// Route entries (`- name: …`), at any indentation.
    pub routes: String,
    /// Extra fields of the virtual host, one per line.
    pub vhost: String,
    /// Extra fields of the connection manager, one per line.
    pub hcm: String,
    /// The plugin configuration (JSON).
    pub plugin: String,
    /// Run the ext_proc host instead of the `.wasm`: Envoy's ext_proc filter with these extra fields (one per
    /// line), and its cluster; the plugin configuration is then the check's `--ext-proc-config`.
    pub ext_proc: Option<String>,
}

impl Fixture {
    pub fn new(routes: &str) -> Fixture {
        Fixture {
            routes: routes.to_string(),
            vhost: String::new(),
            hcm: String::new(),
            plugin: plugin(""),
            ext_proc: None,
        }
    }

    /// The same on the ext_proc host, its filter as tests/src/ext_proc.rs converts the e2e configurations.
    pub fn ext_proc(routes: &str) -> Fixture {
        Fixture { ext_proc: Some(String::new()), ..Fixture::new(routes) }
    }

    /// The filter's entry (the `.wasm`, or the ext_proc filter) in `http_filters`, and the clusters.
    fn filter_and_clusters(&self) -> (String, &'static str) {
        let Some(extra) = &self.ext_proc else {
            let wasm = format!(
                r#"          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: agent_idempotency
                root_id: agent_idempotency
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: '{}'
"#,
                self.plugin
            );
            return (wasm, "");
        };
        let filter = format!(
            r#"          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: {{ envoy_grpc: {{ cluster_name: idem_ext_proc }} }}
              failure_mode_allow: false
              message_timeout: 10s
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: BUFFERED
                response_body_mode: BUFFERED
                request_trailer_mode: SEND
                response_trailer_mode: SEND
              request_attributes: [xds.route_metadata]
              response_attributes: [response.code_details]
{}"#,
            indent(extra, 14)
        );
        let clusters = r#"  clusters:
  - name: idem_ext_proc
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: { http2_protocol_options: {} }
"#;
        (filter, clusters)
    }

    pub fn yaml(&self) -> String {
        let (filter, clusters) = self.filter_and_clusters();
        format!(
            r#"static_resources:
  listeners:
  - name: agents
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          normalize_path: true
          merge_slashes: true
          path_with_escaped_slashes_action: REJECT_REQUEST
{hcm}          route_config:
            name: transfers
            virtual_hosts:
            - name: transfers
              domains: ["*"]
{vhost}              routes:
{routes}          http_filters:
{filter}{clusters}"#,
            hcm = indent(&self.hcm, 10),
            vhost = indent(&self.vhost, 14),
            routes = indent(&self.routes, 14),
        )
    }
}

/// `text` with its common indentation replaced by `by` spaces, a newline after each line.
fn indent(text: &str, by: usize) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let common = lines.iter().map(|l| l.len() - l.trim_start().len()).min().unwrap_or(0);
    lines.iter().map(|l| format!("{}{}\n", " ".repeat(by), &l[common..])).collect()
}

/// Connection manager fields.
pub fn hcm(fields: &str) -> String {
    fields.to_string()
}

/// Virtual host fields.
pub fn vhost(fields: &str) -> String {
    fields.to_string()
}

/// A plugin configuration the filter accepts, with `fields` (`"name": value, …`) added.
pub fn plugin(fields: &str) -> String {
    let extra = if fields.is_empty() { String::new() } else { format!(", {fields}") };
    format!(
        r#"{{"sidecar_cluster": "idem_sidecar", "keys": [{{"kid": "k1", "secret": "test-only-secret-0123456789abcdef0123"}}], "active_kid": "k1", "subject": {{"header": "x-agent-subject"}}{extra}}}"#
    )
}

/// idemd serve's defaults.
pub fn flags() -> TtlArgs {
    TtlArgs {
        lease_ms: 60_000,
        upstream_worst_case_ms: 30_000,
        gateway_timeout_ms: 15_000,
        retry_backoff_total_ms: 5_000,
        terminal_retention_s: 7 * 24 * 3600,
        retry_window_s: 24 * 3600,
    }
}

/// The findings of `rule` on the fixture, as `at: message` (on the ext_proc host, checked with its plugin
/// configuration).
pub fn findings(fixture: &Fixture, flags: &TtlArgs, rule: &str) -> Vec<String> {
    let given = fixture.ext_proc.as_ref().map(|_| fixture.plugin.as_str());
    findings_given(fixture, flags, rule, given)
}

/// The findings of `rule` on the fixture, checked with `ext_proc_config` (`--ext-proc-config`).
pub fn findings_given(fixture: &Fixture, flags: &TtlArgs, rule: &str, ext_proc_config: Option<&str>) -> Vec<String> {
    let yaml = fixture.yaml();
    let report = match check_envoy("test.yaml", &yaml, flags, ext_proc_config) {
        Ok(r) => r,
        Err(e) => panic!("{e}\n{yaml}"),
    };
    assert!(super::rules::RULES.iter().any(|r| r.name == rule), "{rule} is a rule's name");
    report.findings.iter().filter(|f| f.rule == rule).map(|f| format!("{}: {}", f.at, f.message)).collect()
}
