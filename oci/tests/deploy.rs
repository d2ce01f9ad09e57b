//! deploy/: every manifest parses, uses only the fields its API defines, and the
//! pieces agree with each other (secrets, env, cluster names, the filter's
//! configuration in every form it is shipped in).
//!
//! Field sets were read from github:istio/api at commit
//! b8f8791d9653b2edc77a071d48887e582cfe84bf (2026-07-21):
//! extensions/v1alpha1/wasm.proto, extensions/v1alpha1/traffic_extension.proto,
//! security/v1beta1/request_authentication.proto, security/v1beta1/authorization_policy.proto,
//! networking/v1alpha3/envoy_filter.proto, type/v1beta1/selector.proto
//! (proto field names in their JSON/CRD spelling, lowerCamelCase); Envoy Gateway's from
//! github:envoyproxy/gateway api/v1alpha1 at d32f28294245e454d20f81d323d626a90e660c1e (2026-08-21) and the
//! Gateway API's from github:kubernetes-sigs/gateway-api apis/v1 at 4564255ac2c35d582249b3cdf261bdf51c8bca32
//! (the Go types' json names); kgateway's from github:kgateway-dev/kgateway api/v1alpha1/kgateway (ext_proc_types.go,
//! gateway_extensions_types.go, traffic_policy_types.go) and agentgateway's from github:agentgateway/agentgateway
//! controller/api/v1alpha1/agentgateway/agentgateway_policy_types.go at 75b4e6ce6e0e1ac7959d5548ebe8dbeaede4f180.
//!
//! Files named `*.patch.yaml` are patches (a kustomize Component's), not whole objects: they are checked for their
//! API's fields like the rest, but `find` never returns them.
//!
//! deploy/observability/ holds Prometheus and Grafana files, not Kubernetes manifests: tests/tests/observability.rs
//! checks them.

use idem_oci::istio::{documents, plugin_config_json};
use serde_norway::Value;
use std::path::{Path, PathBuf};

type TestResult = Result<(), idem_oci::Error>;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(rel: &str) -> Result<String, idem_oci::Error> {
    let p = repo_root().join(rel);
    Ok(std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?)
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let p = entry?.path();
        if p.file_name().is_some_and(|n| n == "observability") {
            continue;
        }
        if p.is_dir() {
            yaml_files(&p, out)?;
        } else if p.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            out.push(p);
        }
    }
    Ok(())
}

/// Every document of every YAML file under deploy/, with its file (relative).
fn all_documents() -> Result<Vec<(String, Value)>, idem_oci::Error> {
    let root = repo_root().join("deploy");
    let mut files = Vec::new();
    yaml_files(&root, &mut files)?;
    files.sort();
    let mut docs = Vec::new();
    for f in files {
        let rel = f.strip_prefix(&root)?.to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&f)?;
        for d in documents(&text).map_err(|e| format!("deploy/{rel}: {e}"))? {
            docs.push((rel.clone(), d));
        }
    }
    Ok(docs)
}

fn find<'a>(docs: &'a [(String, Value)], kind: &str, name: &str) -> Result<&'a Value, String> {
    docs.iter()
        .filter(|(file, _)| !file.ends_with(".patch.yaml"))
        .map(|(_, d)| d)
        .find(|d| {
            s(d, "kind") == Some(kind)
                && d.get("metadata").and_then(|m| m.get("name")).and_then(Value::as_str) == Some(name)
        })
        .ok_or_else(|| format!("no {kind} {name} under deploy/"))
}

fn s<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

fn at<'a>(v: &'a Value, path: &[&str]) -> Result<&'a Value, String> {
    let mut cur = v;
    for k in path {
        cur = match k.parse::<usize>() {
            Ok(i) => cur.get(i),
            Err(_) => cur.get(*k),
        }
        .ok_or_else(|| format!("no {}", path.join(".")))?;
    }
    Ok(cur)
}

fn keys(v: &Value) -> Vec<&str> {
    v.as_mapping().map(|m| m.keys().filter_map(Value::as_str).collect()).unwrap_or_default()
}

/// `v`'s keys ⊆ `allowed` (and `v` is a mapping).
fn only_fields(v: &Value, allowed: &[&str], what: &str) {
    assert!(v.is_mapping(), "{what} is a mapping: {v:?}");
    for k in keys(v) {
        assert!(allowed.contains(&k), "{what}: `{k}` is not a field of the API (allowed: {allowed:?})");
    }
}

fn each(v: Option<&Value>) -> impl Iterator<Item = &Value> {
    v.and_then(Value::as_sequence).into_iter().flatten()
}

fn enum_value(v: Option<&Value>, allowed: &[&str], what: &str) {
    if let Some(v) = v {
        assert!(v.as_str().is_some_and(|x| allowed.contains(&x)), "{what}: {v:?} is not one of {allowed:?}");
    }
}

// istio/api type/v1beta1/selector.proto
const WORKLOAD_SELECTOR: &[&str] = &["matchLabels"];
const TARGET_REF: &[&str] = &["group", "kind", "name", "namespace"];
const WORKLOAD_MODE: &[&str] = &["UNDEFINED", "CLIENT", "SERVER", "CLIENT_AND_SERVER"];
// istio/api extensions/v1alpha1/wasm.proto
const WASM_PLUGIN: &[&str] = &[
    "selector",
    "targetRef",
    "targetRefs",
    "url",
    "sha256",
    "imagePullPolicy",
    "imagePullSecret",
    "verificationKey",
    "pluginConfig",
    "pluginName",
    "phase",
    "priority",
    "failStrategy",
    "vmConfig",
    "match",
    "type",
];
const TRAFFIC_SELECTOR: &[&str] = &["mode", "ports"];
const VM_CONFIG: &[&str] = &["env"];
const ENV_VAR: &[&str] = &["name", "valueFrom", "value"];
const ENV_VALUE_SOURCE: &[&str] = &["INLINE", "HOST"];
const PLUGIN_PHASE: &[&str] = &["UNSPECIFIED_PHASE", "AUTHN", "AUTHZ", "STATS"];
const PULL_POLICY: &[&str] = &["UNSPECIFIED_POLICY", "IfNotPresent", "Always"];
const FAIL_STRATEGY: &[&str] = &["FAIL_CLOSE", "FAIL_OPEN", "FAIL_RELOAD"];
const PLUGIN_TYPE: &[&str] = &["UNSPECIFIED_PLUGIN_TYPE", "HTTP", "NETWORK"];
// istio/api extensions/v1alpha1/traffic_extension.proto
const TRAFFIC_EXTENSION: &[&str] = &["selector", "targetRefs", "phase", "priority", "match", "wasm", "lua"];
const TRAFFIC_EXTENSION_PHASE: &[&str] = &["UNSPECIFIED", "AUTHN", "AUTHZ", "STATS"];
const WASM_CONFIG: &[&str] = &[
    "url",
    "sha256",
    "imagePullPolicy",
    "imagePullSecret",
    "verificationKey",
    "pluginConfig",
    "pluginName",
    "failStrategy",
    "vmConfig",
    "type",
];
// istio/api security/v1beta1/request_authentication.proto
const REQUEST_AUTHENTICATION: &[&str] = &["selector", "targetRef", "targetRefs", "jwtRules"];
const JWT_RULE: &[&str] = &[
    "issuer",
    "audiences",
    "jwksUri",
    "jwks",
    "fromHeaders",
    "fromParams",
    "outputPayloadToHeader",
    "fromCookies",
    "forwardOriginalToken",
    "outputClaimToHeaders",
    "timeout",
    "spaceDelimitedClaims",
];
// istio/api security/v1beta1/authorization_policy.proto
const AUTHORIZATION_POLICY: &[&str] = &["selector", "targetRef", "targetRefs", "rules", "action", "provider"];
const AUTHZ_ACTION: &[&str] = &["ALLOW", "DENY", "AUDIT", "CUSTOM"];
const RULE: &[&str] = &["from", "to", "when"];
const SOURCE: &[&str] = &[
    "principals",
    "notPrincipals",
    "requestPrincipals",
    "notRequestPrincipals",
    "namespaces",
    "notNamespaces",
    "serviceAccounts",
    "notServiceAccounts",
    "ipBlocks",
    "notIpBlocks",
    "remoteIpBlocks",
    "notRemoteIpBlocks",
    "trustDomains",
    "notTrustDomains",
];
const OPERATION: &[&str] = &["hosts", "notHosts", "ports", "notPorts", "methods", "notMethods", "paths", "notPaths"];
// istio/api networking/v1alpha3/envoy_filter.proto
const ENVOY_FILTER: &[&str] = &["workloadSelector", "targetRefs", "configPatches", "priority"];
const ENVOY_FILTER_SELECTOR: &[&str] = &["labels"];
const CONFIG_PATCH: &[&str] = &["applyTo", "match", "patch"];
const APPLY_TO: &[&str] = &[
    "INVALID",
    "LISTENER",
    "FILTER_CHAIN",
    "NETWORK_FILTER",
    "HTTP_FILTER",
    "ROUTE_CONFIGURATION",
    "VIRTUAL_HOST",
    "HTTP_ROUTE",
    "CLUSTER",
    "EXTENSION_CONFIG",
    "BOOTSTRAP",
    "LISTENER_FILTER",
];
const PATCH: &[&str] = &["operation", "value", "filterClass"];
const PATCH_OPERATION: &[&str] = &[
    "INVALID",
    "MERGE",
    "ADD",
    "REMOVE",
    "INSERT_BEFORE",
    "INSERT_AFTER",
    "INSERT_FIRST",
    "REPLACE",
    "MERGE_AND_REPLACE_LIST",
];
const FILTER_CLASS: &[&str] = &["UNSPECIFIED", "AUTHN", "AUTHZ", "STATS"];
const OBJECT_MATCH: &[&str] = &["context", "proxy", "listener", "routeConfiguration", "cluster", "waypoint"];
const PATCH_CONTEXT: &[&str] = &["ANY", "SIDECAR_INBOUND", "SIDECAR_OUTBOUND", "GATEWAY", "WAYPOINT"];
const LISTENER_MATCH: &[&str] = &["portNumber", "portName", "filterChain", "listenerFilter", "name"];
const FILTER_CHAIN_MATCH: &[&str] =
    &["name", "sni", "transportProtocol", "applicationProtocols", "filter", "destinationPort"];
const FILTER_MATCH: &[&str] = &["name", "subFilter"];
const ROUTE_CONFIGURATION_MATCH: &[&str] = &["portNumber", "portName", "gateway", "vhost", "name"];
const VIRTUAL_HOST_MATCH: &[&str] = &["name", "domainName", "route"];
const ROUTE_MATCH: &[&str] = &["name", "action"];
const ROUTE_ACTION: &[&str] = &["ANY", "ROUTE", "REDIRECT", "DIRECT_RESPONSE"];

/// The apiVersion/kind pairs deploy/ may use (the CRDs' served versions, from the protos' `+cue-gen:…:versions`).
const KINDS: &[(&str, &str)] = &[
    ("extensions.istio.io/v1alpha1", "WasmPlugin"),
    ("extensions.istio.io/v1alpha1", "TrafficExtension"),
    ("security.istio.io/v1", "RequestAuthentication"),
    ("security.istio.io/v1", "AuthorizationPolicy"),
    ("networking.istio.io/v1alpha3", "EnvoyFilter"),
    ("v1", "ServiceAccount"),
    ("v1", "Service"),
    ("v1", "Secret"),
    ("apps/v1", "Deployment"),
    ("policy/v1", "PodDisruptionBudget"),
    ("kustomize.config.k8s.io/v1beta1", "Kustomization"),
    ("kustomize.config.k8s.io/v1alpha1", "Component"),
    ("v1", "ConfigMap"),
    ("gateway.kgateway.dev/v1alpha1", "GatewayExtension"),
    ("gateway.kgateway.dev/v1alpha1", "TrafficPolicy"),
    ("agentgateway.dev/v1alpha1", "AgentgatewayPolicy"),
    ("gateway.networking.k8s.io/v1", "Gateway"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    ("gateway.envoyproxy.io/v1alpha1", "EnvoyProxy"),
    ("gateway.envoyproxy.io/v1alpha1", "EnvoyExtensionPolicy"),
    ("gateway.envoyproxy.io/v1alpha1", "EnvoyPatchPolicy"),
    ("gateway.envoyproxy.io/v1alpha1", "ClientTrafficPolicy"),
    ("gateway.envoyproxy.io/v1alpha1", "SecurityPolicy"),
];

// envoyproxy/gateway api/v1alpha1 (PolicyTargetReferences, i.e. targetRef/targetRefs/targetSelectors, is inlined
// into the policies' specs) and kubernetes-sigs/gateway-api apis/v1: (kind, path, the fields allowed there). A path
// walks mappings by key and lists by `[]`; parts a manifest does not have are skipped.
const EG_TARGETS: &[&str] = &["targetRef", "targetRefs", "targetSelectors"];
const GATEWAY_SCHEMA: &[(&str, &str, &[&str])] = &[
    (
        "EnvoyExtensionPolicy",
        "spec",
        &["targetRef", "targetRefs", "targetSelectors", "mergeType", "wasm", "extProc", "lua", "dynamicModule"],
    ),
    ("EnvoyExtensionPolicy", "spec.wasm[]", &["name", "rootID", "code", "config", "failOpen", "env"]),
    ("EnvoyExtensionPolicy", "spec.wasm[].code", &["type", "http", "image", "pullPolicy"]),
    ("EnvoyExtensionPolicy", "spec.wasm[].code.http", &["url", "sha256", "tls"]),
    ("EnvoyExtensionPolicy", "spec.wasm[].code.image", &["url", "sha256", "pullSecretRef", "tls"]),
    ("EnvoyExtensionPolicy", "spec.wasm[].env", &["hostKeys"]),
    ("EnvoyExtensionPolicy", "spec.dynamicModule[]", &["name", "filterName", "config", "terminalFilter"]),
    (
        "EnvoyExtensionPolicy",
        "spec.extProc[]",
        &[
            "backendRef",
            "backendRefs",
            "backendSettings",
            "messageTimeout",
            "failOpen",
            "processingMode",
            "shadowMode",
            "metadata",
            "statusOnError",
        ],
    ),
    ("EnvoyExtensionPolicy", "spec.extProc[].backendRefs[]", &["group", "kind", "name", "namespace", "port", "weight"]),
    ("EnvoyExtensionPolicy", "spec.extProc[].processingMode", &["request", "response", "allowModeOverride"]),
    ("EnvoyExtensionPolicy", "spec.extProc[].processingMode.request", &["body", "attributes"]),
    ("EnvoyExtensionPolicy", "spec.extProc[].processingMode.response", &["body", "attributes"]),
    ("EnvoyExtensionPolicy", "spec.extProc[].metadata", &["accessibleNamespaces", "writableNamespaces"]),
    ("GatewayExtension", "spec", &["type", "extAuth", "extProc", "rateLimit", "jwt", "oauth2"]),
    (
        "GatewayExtension",
        "spec.extProc",
        &[
            "grpcService",
            "failOpen",
            "processingMode",
            "allowProcessingModeOverride",
            "allowedProcessingModeOverrides",
            "messageTimeout",
            "maxMessageTimeout",
            "statPrefix",
            "routeCacheAction",
            "metadataOptions",
        ],
    ),
    ("GatewayExtension", "spec.extProc.grpcService", &["backendRef", "authority", "requestTimeout", "retry"]),
    (
        "GatewayExtension",
        "spec.extProc.grpcService.backendRef",
        &["group", "kind", "name", "namespace", "port", "weight"],
    ),
    ("GatewayExtension", "spec.extProc.processingMode", KGATEWAY_PROCESSING_MODE),
    (
        "TrafficPolicy",
        "spec",
        &[
            "targetRefs",
            "targetSelectors",
            "transformation",
            "extProc",
            "extAuth",
            "rateLimit",
            "cors",
            "csrf",
            "headerModifiers",
            "autoHostRewrite",
            "buffer",
            "timeouts",
            "retry",
            "internalRedirect",
            "rbac",
            "jwtAuth",
            "urlRewrite",
            "compression",
            "basicAuth",
            "apiKeyAuth",
            "oauth2",
            "tracing",
            "faultInjection",
            "acl",
            "statPrefix",
        ],
    ),
    ("TrafficPolicy", "spec.targetRefs[]", &["group", "kind", "name", "sectionName"]),
    ("TrafficPolicy", "spec.extProc", &["extensionRef", "processingMode", "disable"]),
    ("TrafficPolicy", "spec.extProc.extensionRef", &["name", "namespace"]),
    ("TrafficPolicy", "spec.extProc.processingMode", KGATEWAY_PROCESSING_MODE),
    ("AgentgatewayPolicy", "spec", &["targetRefs", "targetSelectors", "strategy", "frontend", "traffic", "backend"]),
    ("AgentgatewayPolicy", "spec.targetRefs[]", &["group", "kind", "name", "sectionName"]),
    (
        "AgentgatewayPolicy",
        "spec.traffic",
        &[
            "phase",
            "transformation",
            "extProc",
            "extAuth",
            "rateLimit",
            "cors",
            "csrf",
            "headerModifiers",
            "hostRewrite",
            "timeouts",
            "retry",
            "authorization",
            "jwtAuthentication",
            "basicAuthentication",
            "apiKeyAuthentication",
            "directResponse",
            "buffer",
            "delay",
        ],
    ),
    (
        "AgentgatewayPolicy",
        "spec.traffic.extProc",
        &[
            "backendRef",
            "url",
            "failureMode",
            "processingOptions",
            "metadataContext",
            "requestAttributes",
            "responseAttributes",
            "conditional",
        ],
    ),
    ("AgentgatewayPolicy", "spec.traffic.extProc.backendRef", &["group", "kind", "name", "namespace", "port"]),
    (
        "AgentgatewayPolicy",
        "spec.traffic.extProc.processingOptions",
        &[
            "requestBodyMode",
            "responseBodyMode",
            "requestHeaderMode",
            "responseHeaderMode",
            "requestTrailerMode",
            "responseTrailerMode",
            "allowModeOverride",
        ],
    ),
    ("EnvoyPatchPolicy", "spec", &["type", "jsonPatches", "targetRef", "priority"]),
    ("EnvoyPatchPolicy", "spec.jsonPatches[]", &["type", "name", "operation"]),
    ("EnvoyPatchPolicy", "spec.jsonPatches[].operation", &["op", "path", "jsonPath", "from", "value"]),
    (
        "EnvoyProxy",
        "spec",
        &[
            "provider",
            "logging",
            "telemetry",
            "bootstrap",
            "concurrency",
            "routingType",
            "extraArgs",
            "mergeGateways",
            "mergeBackends",
            "shutdown",
            "filterOrder",
            "backendTLS",
            "ipFamily",
            "preserveRouteOrder",
            "luaValidation",
            "lua",
            "dynamicModules",
            "geoIP",
            "mergeType",
        ],
    ),
    ("EnvoyProxy", "spec.provider", &["type", "kubernetes", "host"]),
    (
        "EnvoyProxy",
        "spec.provider.kubernetes",
        &[
            "envoyDeployment",
            "envoyDaemonSet",
            "envoyService",
            "envoyHpa",
            "useListenerPortAsContainerPort",
            "envoyPDB",
            "envoyServiceAccount",
        ],
    ),
    (
        "EnvoyProxy",
        "spec.provider.kubernetes.envoyDeployment",
        &["patch", "replicas", "strategy", "pod", "container", "initContainers", "name"],
    ),
    (
        "EnvoyProxy",
        "spec.provider.kubernetes.envoyDeployment.container",
        &["env", "resources", "securityContext", "image", "imageRepository", "volumeMounts"],
    ),
    ("EnvoyProxy", "spec.filterOrder[]", &["name", "before", "after"]),
    ("EnvoyProxy", "spec.dynamicModules[]", &["name", "source", "doNotClose", "loadGlobally"]),
    ("EnvoyProxy", "spec.dynamicModules[].source", &["type", "local", "remote"]),
    ("EnvoyProxy", "spec.dynamicModules[].source.local", &["path"]),
    (
        "ClientTrafficPolicy",
        "spec",
        &[
            "targetRef",
            "targetRefs",
            "targetSelectors",
            "tcpKeepalive",
            "enableProxyProtocol",
            "proxyProtocol",
            "clientIPDetection",
            "tls",
            "path",
            "headers",
            "timeout",
            "connection",
            "http1",
            "http2",
            "http3",
            "grpc",
            "healthCheck",
            "scheme",
        ],
    ),
    ("ClientTrafficPolicy", "spec.path", &["escapedSlashesAction", "disableMergeSlashes"]),
    (
        "SecurityPolicy",
        "spec",
        &[
            "targetRef",
            "targetRefs",
            "targetSelectors",
            "mergeType",
            "apiKeyAuth",
            "cors",
            "csrf",
            "basicAuth",
            "jwt",
            "oidc",
            "extAuth",
            "authorization",
        ],
    ),
    ("SecurityPolicy", "spec.jwt", &["optional", "failOpen", "providers"]),
    (
        "SecurityPolicy",
        "spec.jwt.providers[]",
        &["name", "issuer", "audiences", "remoteJWKS", "localJWKS", "claimToHeaders", "recomputeRoute", "extractFrom"],
    ),
    ("SecurityPolicy", "spec.jwt.providers[].claimToHeaders[]", &["header", "claim"]),
    (
        "Gateway",
        "spec",
        &["gatewayClassName", "listeners", "addresses", "infrastructure", "allowedListeners", "tls", "defaultScope"],
    ),
    ("Gateway", "spec.listeners[]", &["name", "hostname", "port", "protocol", "tls", "allowedRoutes"]),
    ("Gateway", "spec.infrastructure", &["labels", "annotations", "parametersRef"]),
    ("HTTPRoute", "spec", &["parentRefs", "useDefaultGateways", "hostnames", "rules"]),
    ("HTTPRoute", "spec.parentRefs[]", &["group", "kind", "namespace", "name", "sectionName", "port"]),
    (
        "HTTPRoute",
        "spec.rules[]",
        &["name", "matches", "filters", "backendRefs", "timeouts", "retry", "sessionPersistence"],
    ),
    ("HTTPRoute", "spec.rules[].matches[]", &["path", "headers", "queryParams", "method"]),
    ("HTTPRoute", "spec.rules[].matches[].path", &["type", "value"]),
    ("HTTPRoute", "spec.rules[].backendRefs[]", &["group", "kind", "name", "namespace", "port", "weight", "filters"]),
];
/// kgateway's ProcessingMode (GatewayExtension's and TrafficPolicy's): Envoy's field names in camelCase.
const KGATEWAY_PROCESSING_MODE: &[&str] = &[
    "requestHeaderMode",
    "responseHeaderMode",
    "requestBodyMode",
    "responseBodyMode",
    "requestTrailerMode",
    "responseTrailerMode",
];
const KGATEWAY_BODY_MODES: &[&str] = &["NONE", "STREAMED", "BUFFERED", "BUFFERED_PARTIAL", "FULL_DUPLEX_STREAMED"];
const KGATEWAY_HEADER_MODES: &[&str] = &["DEFAULT", "SEND", "SKIP"];
const AGENTGATEWAY_BODY_MODES: &[&str] = &["None", "Buffered", "BufferedPartial", "FullDuplexStreamed"];
const AGENTGATEWAY_SEND_MODES: &[&str] = &["Send", "Skip"];

/// (kind, path of a value, the values its enum allows).
const GATEWAY_ENUMS: &[(&str, &str, &[&str])] = &[
    ("EnvoyExtensionPolicy", "spec.wasm[].code.type", &["HTTP", "Image"]),
    (
        "EnvoyExtensionPolicy",
        "spec.extProc[].processingMode.request.body",
        &["Streamed", "Buffered", "BufferedPartial", "FullDuplexStreamed"],
    ),
    (
        "EnvoyExtensionPolicy",
        "spec.extProc[].processingMode.response.body",
        &["Streamed", "Buffered", "BufferedPartial", "FullDuplexStreamed"],
    ),
    ("GatewayExtension", "spec.extProc.processingMode.requestHeaderMode", KGATEWAY_HEADER_MODES),
    ("GatewayExtension", "spec.extProc.processingMode.responseHeaderMode", KGATEWAY_HEADER_MODES),
    ("GatewayExtension", "spec.extProc.processingMode.requestTrailerMode", KGATEWAY_HEADER_MODES),
    ("GatewayExtension", "spec.extProc.processingMode.responseTrailerMode", KGATEWAY_HEADER_MODES),
    ("GatewayExtension", "spec.extProc.processingMode.requestBodyMode", KGATEWAY_BODY_MODES),
    ("GatewayExtension", "spec.extProc.processingMode.responseBodyMode", KGATEWAY_BODY_MODES),
    ("GatewayExtension", "spec.extProc.routeCacheAction", &["FromResponse", "Clear", "Retain"]),
    ("AgentgatewayPolicy", "spec.traffic.extProc.failureMode", &["FailClosed", "FailOpen"]),
    ("AgentgatewayPolicy", "spec.traffic.extProc.processingOptions.requestBodyMode", AGENTGATEWAY_BODY_MODES),
    ("AgentgatewayPolicy", "spec.traffic.extProc.processingOptions.responseBodyMode", AGENTGATEWAY_BODY_MODES),
    ("AgentgatewayPolicy", "spec.traffic.extProc.processingOptions.requestHeaderMode", AGENTGATEWAY_SEND_MODES),
    ("AgentgatewayPolicy", "spec.traffic.extProc.processingOptions.responseHeaderMode", AGENTGATEWAY_SEND_MODES),
    ("AgentgatewayPolicy", "spec.traffic.extProc.processingOptions.requestTrailerMode", AGENTGATEWAY_SEND_MODES),
    ("AgentgatewayPolicy", "spec.traffic.extProc.processingOptions.responseTrailerMode", AGENTGATEWAY_SEND_MODES),
    ("EnvoyPatchPolicy", "spec.type", &["JSONPatch"]),
    (
        "EnvoyPatchPolicy",
        "spec.jsonPatches[].type",
        &[
            "type.googleapis.com/envoy.config.listener.v3.Listener",
            "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
            "type.googleapis.com/envoy.config.cluster.v3.Cluster",
            "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
            "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret",
        ],
    ),
    ("EnvoyPatchPolicy", "spec.jsonPatches[].operation.op", &["add", "remove", "replace", "move", "copy", "test"]),
    ("EnvoyProxy", "spec.dynamicModules[].source.type", &["Local", "Remote"]),
    (
        "ClientTrafficPolicy",
        "spec.path.escapedSlashesAction",
        &["KeepUnchanged", "RejectRequest", "UnescapeAndForward", "UnescapeAndRedirect"],
    ),
    ("HTTPRoute", "spec.rules[].matches[].path.type", &["Exact", "PathPrefix", "RegularExpression"]),
];

/// Every value at `path` in `v` (see GATEWAY_SCHEMA).
fn values_at<'a>(v: &'a Value, path: &str) -> Vec<&'a Value> {
    let mut found = vec![v];
    for part in path.split('.') {
        let (key, list) = part.strip_suffix("[]").map_or((part, false), |k| (k, true));
        found = found
            .into_iter()
            .filter_map(|c| c.get(key))
            .flat_map(|c| if list { each(Some(c)).collect() } else { vec![c] })
            .collect();
    }
    found
}

/// A Gateway API or Envoy Gateway document against GATEWAY_SCHEMA and GATEWAY_ENUMS.
fn check_schema(doc: &Value, kind: &str, what: &str) -> Result<(), String> {
    at(doc, &["spec"]).map_err(|_| format!("{what}: no spec"))?;
    for (_, path, allowed) in GATEWAY_SCHEMA.iter().filter(|(k, _, _)| *k == kind) {
        for v in values_at(doc, path) {
            only_fields(v, allowed, &format!("{what}.{path}"));
        }
    }
    for (_, path, allowed) in GATEWAY_ENUMS.iter().filter(|(k, _, _)| *k == kind) {
        for v in values_at(doc, path) {
            enum_value(Some(v), allowed, &format!("{what}.{path}"));
        }
    }
    Ok(())
}

fn check_selector_and_match(spec: &Value, what: &str) {
    if let Some(sel) = spec.get("selector") {
        only_fields(sel, WORKLOAD_SELECTOR, &format!("{what}.selector"));
    }
    for r in each(spec.get("targetRefs")) {
        only_fields(r, TARGET_REF, &format!("{what}.targetRefs[]"));
    }
    for m in each(spec.get("match")) {
        only_fields(m, TRAFFIC_SELECTOR, &format!("{what}.match[]"));
        enum_value(m.get("mode"), WORKLOAD_MODE, &format!("{what}.match[].mode"));
    }
}

fn check_wasm_fields(w: &Value, what: &str) {
    let url = s(w, "url").unwrap_or_default();
    assert!(url.starts_with("oci://"), "{what}.url pulls the OCI image: {url}");
    enum_value(w.get("imagePullPolicy"), PULL_POLICY, &format!("{what}.imagePullPolicy"));
    enum_value(w.get("failStrategy"), FAIL_STRATEGY, &format!("{what}.failStrategy"));
    assert_eq!(s(w, "failStrategy"), Some("FAIL_RELOAD"), "{what}: never open; a trapped VM is reloaded");
    enum_value(w.get("type"), PLUGIN_TYPE, &format!("{what}.type"));
    assert_eq!(s(w, "pluginName"), Some("agent_idempotency"), "{what}: the filter's root_id");
    if let Some(vm) = w.get("vmConfig") {
        only_fields(vm, VM_CONFIG, &format!("{what}.vmConfig"));
        for e in each(vm.get("env")) {
            only_fields(e, ENV_VAR, &format!("{what}.vmConfig.env[]"));
            enum_value(e.get("valueFrom"), ENV_VALUE_SOURCE, &format!("{what}.vmConfig.env[].valueFrom"));
            // The CRD's CEL rule: "value may only be set when valueFrom is INLINE".
            assert!(!(s(e, "valueFrom") == Some("HOST") && e.get("value").is_some()), "{what}: HOST env with a value");
        }
    }
}

#[test]
fn every_manifest_parses_and_uses_only_its_apis_fields() -> TestResult {
    let docs = all_documents()?;
    assert!(docs.len() >= 12, "deploy/ has its manifests: {}", docs.len());
    for (file, d) in &docs {
        let (api, kind) = (s(d, "apiVersion").unwrap_or_default(), s(d, "kind").unwrap_or_default());
        assert!(KINDS.contains(&(api, kind)), "deploy/{file}: unexpected {api} {kind}");
        if kind == "Kustomization" || kind == "Component" {
            continue;
        }
        let meta = d.get("metadata").ok_or_else(|| format!("deploy/{file}: no metadata"))?;
        assert!(s(meta, "name").is_some_and(|n| !n.is_empty()), "deploy/{file}: {kind} without a name");
        assert_eq!(s(meta, "namespace"), Some("payments"), "deploy/{file}: {kind} in the payments namespace");
        let what = format!("deploy/{file}: {kind}");
        let spec = d.get("spec");
        match kind {
            "WasmPlugin" => {
                let spec = spec.ok_or("no spec")?;
                only_fields(spec, WASM_PLUGIN, &what);
                check_selector_and_match(spec, &what);
                enum_value(spec.get("phase"), PLUGIN_PHASE, &format!("{what}.phase"));
                check_wasm_fields(spec, &what);
            }
            "TrafficExtension" => {
                let spec = spec.ok_or("no spec")?;
                only_fields(spec, TRAFFIC_EXTENSION, &what);
                check_selector_and_match(spec, &what);
                enum_value(spec.get("phase"), TRAFFIC_EXTENSION_PHASE, &format!("{what}.phase"));
                let wasm = spec.get("wasm").ok_or("TrafficExtension without wasm")?;
                only_fields(wasm, WASM_CONFIG, &format!("{what}.wasm"));
                check_wasm_fields(wasm, &format!("{what}.wasm"));
            }
            "RequestAuthentication" => {
                let spec = spec.ok_or("no spec")?;
                only_fields(spec, REQUEST_AUTHENTICATION, &what);
                check_selector_and_match(spec, &what);
                for r in each(spec.get("jwtRules")) {
                    only_fields(r, JWT_RULE, &format!("{what}.jwtRules[]"));
                    assert!(s(r, "issuer").is_some(), "{what}: a rule names its issuer");
                }
            }
            "AuthorizationPolicy" => {
                let spec = spec.ok_or("no spec")?;
                only_fields(spec, AUTHORIZATION_POLICY, &what);
                enum_value(spec.get("action"), AUTHZ_ACTION, &format!("{what}.action"));
                for r in each(spec.get("rules")) {
                    only_fields(r, RULE, &format!("{what}.rules[]"));
                    for f in each(r.get("from")) {
                        only_fields(f, &["source"], &format!("{what}.rules[].from[]"));
                        only_fields(at(f, &["source"])?, SOURCE, &format!("{what}.rules[].from[].source"));
                    }
                    for t in each(r.get("to")) {
                        only_fields(t, &["operation"], &format!("{what}.rules[].to[]"));
                        only_fields(at(t, &["operation"])?, OPERATION, &format!("{what}.rules[].to[].operation"));
                    }
                }
            }
            kind if GATEWAY_SCHEMA.iter().any(|(k, _, _)| *k == kind) => {
                check_schema(d, kind, &what)?;
                if kind == "EnvoyProxy" {
                    // The CRD's pattern for a module's name: Envoy Gateway refuses other names.
                    for name in values_at(d, "spec.dynamicModules[].name").into_iter().filter_map(Value::as_str) {
                        let edge = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
                        let inner = |c: char| edge(c) || c == '.' || c == '-';
                        assert!(
                            name.starts_with(edge) && name.ends_with(edge) && name.chars().all(inner),
                            "{what}: dynamic module name {name:?} is not ^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$"
                        );
                    }
                }
            }
            "EnvoyFilter" => {
                let spec = spec.ok_or("no spec")?;
                only_fields(spec, ENVOY_FILTER, &what);
                only_fields(at(spec, &["workloadSelector"])?, ENVOY_FILTER_SELECTOR, &what);
                for p in each(spec.get("configPatches")) {
                    only_fields(p, CONFIG_PATCH, &format!("{what}.configPatches[]"));
                    enum_value(p.get("applyTo"), APPLY_TO, &format!("{what}.applyTo"));
                    let patch = at(p, &["patch"])?;
                    only_fields(patch, PATCH, &format!("{what}.patch"));
                    enum_value(patch.get("operation"), PATCH_OPERATION, &format!("{what}.patch.operation"));
                    enum_value(patch.get("filterClass"), FILTER_CLASS, &format!("{what}.patch.filterClass"));
                    if let Some(m) = p.get("match") {
                        only_fields(m, OBJECT_MATCH, &format!("{what}.match"));
                        enum_value(m.get("context"), PATCH_CONTEXT, &format!("{what}.match.context"));
                        if let Some(l) = m.get("listener") {
                            only_fields(l, LISTENER_MATCH, &format!("{what}.match.listener"));
                            if let Some(fc) = l.get("filterChain") {
                                only_fields(fc, FILTER_CHAIN_MATCH, &format!("{what}.match.listener.filterChain"));
                                if let Some(f) = fc.get("filter") {
                                    only_fields(f, FILTER_MATCH, &format!("{what}.filterChain.filter"));
                                }
                            }
                        }
                        if let Some(rc) = m.get("routeConfiguration") {
                            only_fields(rc, ROUTE_CONFIGURATION_MATCH, &format!("{what}.match.routeConfiguration"));
                            if let Some(vh) = rc.get("vhost") {
                                only_fields(vh, VIRTUAL_HOST_MATCH, &format!("{what}.match.routeConfiguration.vhost"));
                                if let Some(r) = vh.get("route") {
                                    only_fields(r, ROUTE_MATCH, &format!("{what}.routeConfiguration.vhost.route"));
                                    enum_value(r.get("action"), ROUTE_ACTION, &format!("{what}.vhost.route.action"));
                                }
                            }
                        }
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// The filter's configuration reaches it in three shipped forms that must be one string: what istiod makes of
/// the WasmPlugin's (and TrafficExtension's) pluginConfig, the EnvoyFilter's StringValue, and
/// envoy/istio-like.yaml's (which the e2e test runs). Written to target/istio/plugin-config.json.
#[test]
fn the_plugin_configuration_is_one_string_everywhere() -> TestResult {
    let from_wasmplugin = plugin_config_json(&read("deploy/istio/wasmplugin.yaml")?, "WasmPlugin")?;
    let from_traffic_extension = plugin_config_json(&read("deploy/istio/trafficextension.yaml")?, "TrafficExtension")?;
    assert_eq!(from_traffic_extension, from_wasmplugin, "TrafficExtension and WasmPlugin configure the same filter");

    let config: serde_json::Value = serde_json::from_str(&from_wasmplugin)?;
    assert_eq!(config["defaults"]["lease_ms"].to_string(), "60000", "a Struct double prints without .0");
    let routes = config["routes"].as_array().ok_or("no routes")?;
    let roles: Vec<&str> = routes.iter().filter_map(|r| r["role"].as_str()).collect();
    assert_eq!(
        roles,
        ["preview", "confirm", "status", "mcp", "mcp", "mcp", "mcp"],
        "the demo's three routes and MCP endpoints"
    );
    let mcp_paths: Vec<&str> =
        routes.iter().filter(|r| r["role"] == "mcp").filter_map(|r| r["match"]["path"].as_str()).collect();
    assert_eq!(
        mcp_paths,
        ["/mcp", "/mcp/stream", "/mcp/sse", "/mcp/session"],
        "every MCP endpoint the demo serves has its rule"
    );

    let envoy_filter = documents(&read("deploy/istio/envoyfilter.yaml")?)?;
    let ecds = envoy_filter
        .first()
        .and_then(|d| at(d, &["spec", "configPatches", "0", "patch", "value", "typed_config", "config"]).ok())
        .ok_or("no EXTENSION_CONFIG patch")?;
    assert_eq!(
        s(at(ecds, &["configuration"])?, "value"),
        Some(from_wasmplugin.as_str()),
        "EnvoyFilter's configuration"
    );
    assert_eq!(at(ecds, &["allow_on_headers_stop_iteration"])?.as_bool(), Some(true), "the reason for the EnvoyFilter");

    let istio_like = documents(&read("envoy/istio-like.yaml")?)?;
    let listener_filters = istio_like
        .first()
        .and_then(|d| at(d, &["static_resources", "listeners", "0", "filter_chains", "0", "filters", "0"]).ok())
        .and_then(|f| at(f, &["typed_config", "http_filters"]).ok())
        .and_then(Value::as_sequence)
        .ok_or("no http_filters in envoy/istio-like.yaml")?;
    let wasm = listener_filters
        .iter()
        .find(|f| s(f, "name").is_some_and(|n| n.starts_with("extensions.istio.io/wasmplugin/")))
        .ok_or("no wasm filter in envoy/istio-like.yaml")?;
    let value = s(at(wasm, &["typed_config", "config", "configuration"])?, "value");
    assert_eq!(
        value,
        Some(from_wasmplugin.as_str()),
        "envoy/istio-like.yaml runs exactly the WasmPlugin's configuration"
    );

    let out = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| repo_root().join("target"));
    std::fs::create_dir_all(out.join("istio"))?;
    std::fs::write(out.join("istio/plugin-config.json"), &from_wasmplugin)?;
    Ok(())
}

/// Every `secret_env` a plugin configuration names (its keys' and its token's), sorted.
fn secret_envs(config: &serde_json::Value) -> Vec<String> {
    let mut names: Vec<String> = config["keys"]
        .as_array()
        .into_iter()
        .flatten()
        .chain([&config["sidecar_token"]])
        .filter_map(|k| k["secret_env"].as_str().map(str::to_owned))
        .collect();
    names.sort();
    names
}

/// The secrets' path: every `secret_env` the configuration names is a HOST variable of the Wasm VM in every form
/// (WasmPlugin env, EnvoyFilter host_env_keys, istio-like.yaml), and the guarded workload's istio-proxy container
/// sets each from a Secret key that the example Secret defines.
#[test]
fn every_secret_reaches_the_wasm_vm() -> TestResult {
    let docs = all_documents()?;
    let wasmplugin = find(&docs, "WasmPlugin", "agent-idempotency")?;
    let config: serde_json::Value =
        serde_json::from_str(&plugin_config_json(&read("deploy/istio/wasmplugin.yaml")?, "WasmPlugin")?)?;
    let secret_envs = secret_envs(&config);
    assert_eq!(secret_envs, ["IDEM_HMAC_K1", "IDEM_SIDECAR_TOKEN"]);
    assert!(config["keys"].as_array().into_iter().flatten().all(|k| k.get("secret").is_none()), "no inline secret");
    assert!(config["sidecar_token"].get("secret").is_none(), "no inline token");

    let mut host: Vec<String> = each(at(wasmplugin, &["spec", "vmConfig", "env"]).ok())
        .filter(|e| s(e, "valueFrom") == Some("HOST"))
        .filter_map(|e| s(e, "name").map(str::to_owned))
        .collect();
    host.sort();
    assert_eq!(host, secret_envs, "WasmPlugin passes every secret_env from the host");

    let envoy_filter = find(&docs, "EnvoyFilter", "agent-idempotency")?;
    let keys_of = |v: &Value| -> Vec<String> {
        let mut k: Vec<String> = each(Some(v)).filter_map(Value::as_str).map(str::to_owned).collect();
        k.sort();
        k
    };
    let ef_keys = at(
        envoy_filter,
        &[
            "spec",
            "configPatches",
            "0",
            "patch",
            "value",
            "typed_config",
            "config",
            "vm_config",
            "environment_variables",
            "host_env_keys",
        ],
    )?;
    assert_eq!(keys_of(ef_keys), secret_envs, "EnvoyFilter passes every secret_env from the host");

    let transfers = find(&docs, "Deployment", "transfers")?;
    let containers = at(transfers, &["spec", "template", "spec", "containers"])?;
    let proxy =
        each(Some(containers)).find(|c| s(c, "name") == Some("istio-proxy")).ok_or("no istio-proxy override")?;
    assert_eq!(s(proxy, "image"), Some("auto"), "merged into the injected proxy, not a second one");
    let example = find(&docs, "Secret", "idem-filter-secrets")?;
    for name in &secret_envs {
        let e = each(proxy.get("env"))
            .find(|e| s(e, "name") == Some(name))
            .ok_or_else(|| format!("istio-proxy lacks {name}"))?;
        let r = at(e, &["valueFrom", "secretKeyRef"])?;
        assert_eq!(s(r, "name"), Some("idem-filter-secrets"), "{name} comes from the filter's Secret");
        let key = s(r, "key").ok_or("no key")?;
        assert!(at(example, &["stringData", key]).is_ok(), "the example Secret defines {key}");
    }

    // The filter's token is one idemd accepts (in the example values).
    let idemd_secret = find(&docs, "Secret", "idemd-secrets")?;
    let token = s(at(example, &["stringData"])?, "sidecar-token").ok_or("no sidecar-token")?;
    let accepted = s(at(idemd_secret, &["stringData"])?, "auth-tokens").ok_or("no auth-tokens")?;
    assert!(accepted.split(',').any(|t| t.trim() == token), "idemd accepts the filter's token");
    for secret in [example, idemd_secret] {
        for v in at(secret, &["stringData"])?.as_mapping().into_iter().flat_map(|m| m.values()) {
            assert!(v.as_str().is_some_and(|v| v.contains("EXAMPLE")), "example Secret values say so: {v:?}");
        }
    }
    Ok(())
}

/// idemd's manifests: the Service the filter's `sidecar_cluster` names, non-root, probes, metrics, Secret env, PDB.
#[test]
fn idemd_runs_non_root_behind_the_cluster_the_filter_calls() -> TestResult {
    let docs = all_documents()?;
    let svc = find(&docs, "Service", "idemd")?;
    let port = at(svc, &["spec", "ports", "0"])?;
    let ns = s(at(svc, &["metadata"])?, "namespace").ok_or("no namespace")?;
    let port_number = at(port, &["port"])?.as_u64().ok_or("no port")?;
    let cluster = format!("outbound|{port_number}||idemd.{ns}.svc.cluster.local");
    let config: serde_json::Value =
        serde_json::from_str(&plugin_config_json(&read("deploy/istio/wasmplugin.yaml")?, "WasmPlugin")?)?;
    assert_eq!(config["sidecar_cluster"], cluster.as_str(), "Istio's outbound cluster name for the idemd Service");
    assert_eq!(s(port, "name"), Some("http"), "Istio detects HTTP by the port name");

    let dep = find(&docs, "Deployment", "idemd")?;
    let pod = at(dep, &["spec", "template", "spec"])?;
    let labels = at(dep, &["spec", "template", "metadata", "labels"])?;
    let svc_selector = at(svc, &["spec", "selector"])?;
    for (k, v) in svc_selector.as_mapping().ok_or("selector")? {
        assert_eq!(labels.get(k), Some(v), "the Service selects idemd's pods");
    }
    assert!(at(dep, &["spec", "replicas"])?.as_u64().is_some_and(|r| r >= 2), "more than one replica");
    assert_eq!(at(pod, &["securityContext", "runAsNonRoot"])?.as_bool(), Some(true));
    assert!(at(pod, &["securityContext", "runAsUser"])?.as_u64().is_some_and(|u| u > 0), "numeric non-root uid");
    let c = at(pod, &["containers", "0"])?;
    assert_eq!(at(c, &["securityContext", "allowPrivilegeEscalation"])?.as_bool(), Some(false));
    assert_eq!(at(c, &["securityContext", "readOnlyRootFilesystem"])?.as_bool(), Some(true));
    assert!(at(c, &["resources", "requests", "cpu"]).is_ok() && at(c, &["resources", "requests", "memory"]).is_ok());
    assert_eq!(s(at(c, &["readinessProbe", "httpGet"])?, "path"), Some("/healthz"));
    assert!(at(c, &["livenessProbe"]).is_ok(), "a liveness probe");
    let ann = at(dep, &["spec", "template", "metadata", "annotations"])?;
    assert_eq!(s(ann, "prometheus.io/scrape"), Some("true"));
    assert_eq!(s(ann, "prometheus.io/path"), Some("/metrics"));
    assert_eq!(s(ann, "prometheus.io/port"), Some(port_number.to_string().as_str()));
    let secret = find(&docs, "Secret", "idemd-secrets")?;
    for var in ["IDEM_AUTH_TOKENS", "IDEM_DATABASE_URL", "IDEM_REDIS_URL"] {
        let e = each(c.get("env")).find(|e| s(e, "name") == Some(var)).ok_or_else(|| format!("idemd lacks {var}"))?;
        let r = at(e, &["valueFrom", "secretKeyRef"]).map_err(|_| format!("{var} must come from a Secret"))?;
        assert_eq!(s(r, "name"), Some("idemd-secrets"));
        assert!(at(secret, &["stringData", s(r, "key").unwrap_or_default()]).is_ok(), "example Secret has {var}'s key");
    }
    assert!(!each(c.get("args")).any(|a| a.as_str() == Some("--insecure-no-auth")), "auth stays on");

    let pdb = find(&docs, "PodDisruptionBudget", "idemd")?;
    assert_eq!(at(pdb, &["spec", "selector", "matchLabels"])?, at(dep, &["spec", "selector", "matchLabels"])?);
    Ok(())
}

/// kustomization.yaml lists files that exist, installs the working filter form once, and never the example Secrets.
#[test]
fn the_kustomizations_apply_what_works() -> TestResult {
    for (dir, must, must_not) in [
        (
            "deploy",
            &["istio/envoyfilter.yaml", "idemd/idemd.yaml"][..],
            &["istio/wasmplugin.yaml", "istio/trafficextension.yaml", "idemd/secrets.example.yaml"][..],
        ),
        ("deploy/demo", &["transfers.yaml"][..], &[][..]),
    ] {
        let k = documents(&read(&format!("{dir}/kustomization.yaml"))?)?;
        let resources: Vec<&str> = each(k.first().and_then(|d| d.get("resources"))).filter_map(Value::as_str).collect();
        for r in &resources {
            assert!(repo_root().join(dir).join(r).exists(), "{dir}/kustomization.yaml: {r} exists");
        }
        for m in must {
            assert!(resources.contains(m), "{dir} applies {m}");
        }
        for m in must_not {
            assert!(!resources.contains(m), "{dir} must not apply {m}");
        }
    }
    Ok(())
}

/// deploy/istio/envoyfilter.yaml's patch that applies to `apply_to`.
fn envoy_filter_patch(apply_to: &str) -> Result<Value, idem_oci::Error> {
    let envoy_filter = documents(&read("deploy/istio/envoyfilter.yaml")?)?;
    let patches =
        envoy_filter.first().and_then(|d| at(d, &["spec", "configPatches"]).ok()).ok_or("no configPatches")?;
    let patch = each(Some(patches))
        .find(|p| s(p, "applyTo") == Some(apply_to))
        .ok_or_else(|| format!("no {apply_to} patch in deploy/istio/envoyfilter.yaml"))?;
    assert_eq!(s(at(patch, &["match"])?, "context"), Some("SIDECAR_INBOUND"), "the guarded side: inbound");
    assert_eq!(s(at(patch, &["patch"])?, "operation"), Some("MERGE"), "merged into what istiod builds");
    Ok(patch.clone())
}

/// envoy/istio-like.yaml's inbound connection manager (what the tests run).
fn istio_like_hcm() -> Result<Value, idem_oci::Error> {
    let istio_like = documents(&read("envoy/istio-like.yaml")?)?;
    let hcm = istio_like
        .first()
        .and_then(|d| at(d, &["static_resources", "listeners", "0", "filter_chains", "0", "filters", "0"]).ok())
        .and_then(|f| at(f, &["typed_config"]).ok())
        .ok_or("no connection manager in envoy/istio-like.yaml")?;
    Ok(hcm.clone())
}

/// DESIGN §6, no path around an annotation: the mesh route is a catch-all to the app, so the path must be normalised
/// before the filter matches its rules. The EnvoyFilter merges the three settings into the guarded workload's inbound
/// HTTP connection managers, and envoy/istio-like.yaml (what the tests run) carries the same three.
#[test]
fn the_inbound_connection_manager_normalises_paths_as_istio_like_yaml_does() -> TestResult {
    const FIELDS: [&str; 4] =
        ["normalize_path", "merge_slashes", "path_with_escaped_slashes_action", "local_reply_config"];
    let hcm_patch = envoy_filter_patch("NETWORK_FILTER")?;
    assert_eq!(
        s(at(&hcm_patch, &["match", "listener", "filterChain", "filter"])?, "name"),
        Some("envoy.filters.network.http_connection_manager")
    );
    let patched = at(&hcm_patch, &["patch", "value", "typed_config"])?;
    assert!(s(patched, "@type").is_some_and(|t| t.ends_with(".HttpConnectionManager")), "{patched:?}");
    assert_eq!(at(patched, &["normalize_path"])?.as_bool(), Some(true));
    assert_eq!(at(patched, &["merge_slashes"])?.as_bool(), Some(true));
    let action = s(patched, "path_with_escaped_slashes_action");
    assert!(
        matches!(action, Some("REJECT_REQUEST" | "UNESCAPE_AND_REDIRECT" | "UNESCAPE_AND_FORWARD")),
        "escaped slashes never pass unchanged: {action:?}"
    );

    let hcm = istio_like_hcm()?;
    for field in FIELDS {
        assert_eq!(hcm.get(field), patched.get(field), "envoy/istio-like.yaml's {field} is the EnvoyFilter's");
    }
    Ok(())
}

/// DESIGN §5, the lease outlasts Envoy's wait: istiod's inbound route has no timeout, so the EnvoyFilter merges one
/// into the guarded workload's inbound routes (route timeout and the gRPC header's maximum, which would otherwise
/// lift it), and envoy/istio-like.yaml (what the tests run and `idemd check` judges) carries the same values.
#[test]
fn the_inbound_route_has_the_timeout_istio_like_yaml_has() -> TestResult {
    let route_patch = envoy_filter_patch("HTTP_ROUTE")?;
    assert_eq!(s(at(&route_patch, &["match", "routeConfiguration", "vhost", "route"])?, "action"), Some("ROUTE"));
    let patched = at(&route_patch, &["patch", "value", "route"])?;
    let timeout = s(patched, "timeout").ok_or("the patch sets no route timeout")?;
    assert_ne!(timeout, "0s", "a timeout that bounds the wait");
    let grpc_max = s(at(patched, &["max_stream_duration"])?, "grpc_timeout_header_max");
    assert_eq!(grpc_max, Some(timeout), "a request sent as gRPC gets no longer");

    let hcm = istio_like_hcm()?;
    let route = at(&hcm, &["route_config", "virtual_hosts", "0", "routes", "0", "route"])?;
    assert_eq!(s(route, "timeout"), Some(timeout), "envoy/istio-like.yaml's route timeout is the EnvoyFilter's");
    assert_eq!(s(at(route, &["max_stream_duration"])?, "grpc_timeout_header_max"), grpc_max);
    Ok(())
}

// ---- Envoy Gateway (deploy/envoy-gateway/) ------------------------------------------------------------------

/// Every document of one file under deploy/envoy-gateway/.
fn eg_docs(rel: &str) -> Result<Vec<Value>, idem_oci::Error> {
    documents(&read(&format!("deploy/envoy-gateway/{rel}"))?)
}

fn eg_find<'a>(docs: &'a [Value], kind: &str) -> Result<&'a Value, String> {
    docs.iter().find(|d| s(d, "kind") == Some(kind)).ok_or_else(|| format!("no {kind}"))
}

/// The plugin configuration of a policy's filter (its `config`), as JSON.
fn policy_config(policy: &Value) -> Result<serde_json::Value, idem_oci::Error> {
    let spec = at(policy, &["spec"])?;
    let filter = at(spec, &["wasm", "0"]).or_else(|_| at(spec, &["dynamicModule", "0"]))?;
    Ok(serde_json::from_str(&serde_json::to_string(at(filter, &["config"])?)?)?)
}

/// The three policies (the native module's, the .wasm's from an image and over HTTP) configure one filter, with
/// the route rules and keys of the Istio deployment; its idemd cluster is the one the EnvoyPatchPolicy adds (idemd's
/// Service); its subject header is the one the SecurityPolicy's JWT fills; every secret it names reaches it.
#[test]
fn envoy_gateways_policies_configure_one_working_filter() -> TestResult {
    let native = eg_docs("native/native.yaml")?;
    let wasm = eg_docs("wasm/wasm.yaml")?;
    let http = eg_docs("wasm/wasm-http.yaml")?;
    let config = policy_config(eg_find(&native, "EnvoyExtensionPolicy")?)?;
    assert_eq!(policy_config(eg_find(&wasm, "EnvoyExtensionPolicy")?)?, config, "wasm.yaml's is native.yaml's");
    assert_eq!(policy_config(eg_find(&http, "EnvoyExtensionPolicy")?)?, config, "wasm-http.yaml's is native.yaml's");

    let istio: serde_json::Value =
        serde_json::from_str(&plugin_config_json(&read("deploy/istio/wasmplugin.yaml")?, "WasmPlugin")?)?;
    for same in ["routes", "keys", "active_kid", "defaults", "sidecar_token", "sidecar_timeout_ms"] {
        assert_eq!(config[same], istio[same], "{same}: as in the Istio deployment (numbers stay integers here)");
    }

    let base = eg_docs("base/gateway.yaml")?;
    let patch = eg_find(&base, "EnvoyPatchPolicy")?;
    let added = at(patch, &["spec", "jsonPatches", "0"])?;
    assert_eq!(s(added, "type"), Some("type.googleapis.com/envoy.config.cluster.v3.Cluster"));
    let cluster = at(added, &["operation", "value"])?;
    assert_eq!(s(cluster, "name"), config["sidecar_cluster"].as_str(), "the filter calls the cluster the patch adds");
    assert_eq!(s(added, "name"), config["sidecar_cluster"].as_str());
    let socket = at(
        cluster,
        &["load_assignment", "endpoints", "0", "lb_endpoints", "0", "endpoint", "address", "socket_address"],
    )?;
    let docs = all_documents()?;
    let svc = find(&docs, "Service", "idemd")?;
    let svc_ns = s(at(svc, &["metadata"])?, "namespace").ok_or("no namespace")?;
    assert_eq!(s(socket, "address").map(str::to_owned), Some(format!("idemd.{svc_ns}.svc.cluster.local")));
    assert_eq!(at(socket, &["port_value"])?.as_u64(), at(svc, &["spec", "ports", "0", "port"])?.as_u64());
    assert_eq!(
        config["sidecar_authority"].as_str().map(str::to_owned),
        Some(format!("idemd.{svc_ns}.svc.cluster.local"))
    );

    let jwt = eg_find(&base, "SecurityPolicy")?;
    let claim = at(jwt, &["spec", "jwt", "providers", "0", "claimToHeaders", "0"])?;
    assert_eq!(s(claim, "claim"), Some("sub"));
    assert_eq!(s(claim, "header"), config["subject"]["header"].as_str(), "the subject is the verified sub");

    // Secrets: every secret_env from the proxy's environment, set from the filter's Secret.
    let secret_envs = secret_envs(&config);
    let example = find(&docs, "Secret", "idem-filter-secrets")?;
    for variant in [&native, &wasm] {
        let proxy = eg_find(variant, "EnvoyProxy")?;
        let env = at(proxy, &["spec", "provider", "kubernetes", "envoyDeployment", "container", "env"])?;
        for name in &secret_envs {
            let e = each(Some(env)).find(|e| s(e, "name") == Some(name)).ok_or_else(|| format!("no {name}"))?;
            let r = at(e, &["valueFrom", "secretKeyRef"])?;
            assert_eq!(s(r, "name"), Some("idem-filter-secrets"));
            assert!(at(example, &["stringData", s(r, "key").unwrap_or_default()]).is_ok(), "the example Secret has it");
        }
    }
    let host_keys = at(eg_find(&wasm, "EnvoyExtensionPolicy")?, &["spec", "wasm", "0", "env", "hostKeys"])?;
    let mut keys: Vec<String> = each(Some(host_keys)).filter_map(Value::as_str).map(str::to_owned).collect();
    keys.sort();
    assert_eq!(keys, secret_envs, "the Wasm VM gets every secret_env from Envoy's environment");
    Ok(())
}

/// The routes: the HTTPRoute serves exactly what the filter's rules guard (no catch-all, nothing unguarded), the
/// policies target the Gateway (Envoy Gateway enables a policy's filter per route: every route of the Gateway gets
/// it), and the filter runs after authorization and rate limits.
#[test]
fn envoy_gateway_routes_only_what_the_rules_guard_and_guards_every_route() -> TestResult {
    let base = eg_docs("base/gateway.yaml")?;
    let gateway = eg_find(&base, "Gateway")?;
    let gw_name = s(at(gateway, &["metadata"])?, "name").ok_or("no name")?;
    let config = policy_config(eg_find(&eg_docs("native/native.yaml")?, "EnvoyExtensionPolicy")?)?;
    let route = eg_find(&base, "HTTPRoute")?;
    let matches: Vec<&Value> = each(at(route, &["spec", "rules"]).ok()).flat_map(|r| each(r.get("matches"))).collect();
    for m in &matches {
        let (kind, value) = (text(m, &["path", "type"]), text(m, &["path", "value"]));
        assert!(kind == "Exact" || (kind == "PathPrefix" && value != "/"), "no catch-all: {kind} {value}");
        let guarded = config["routes"].as_array().into_iter().flatten().any(|r| match kind {
            "Exact" => r["match"]["path"].as_str() == Some(value),
            _ => r["match"]["prefix"].as_str() == Some(value),
        });
        assert!(guarded, "{kind} {value} is routed but no rule guards it");
    }
    for rule in config["routes"].as_array().into_iter().flatten() {
        let routed = matches.iter().any(|m| {
            rule["match"]["path"].as_str().is_some_and(|p| text(m, &["path", "value"]) == p)
                || rule["match"]["prefix"].as_str().is_some_and(|p| text(m, &["path", "value"]) == p)
        });
        assert!(routed, "rule {} guards a path the HTTPRoute does not serve", rule["name"]);
    }
    for (file, kind) in [("native/native.yaml", "EnvoyExtensionPolicy"), ("wasm/wasm.yaml", "EnvoyExtensionPolicy")] {
        let policy = eg_docs(file)?;
        let spec = at(eg_find(&policy, kind)?, &["spec"])?;
        assert!(keys(spec).iter().filter(|k| EG_TARGETS.contains(k)).count() == 1, "{file}: one kind of target");
        let target = at(spec, &["targetRefs", "0"])?;
        assert_eq!((s(target, "kind"), s(target, "name")), (Some("Gateway"), Some(gw_name)), "{file}: the Gateway");
    }
    for (file, filter) in
        [("native/native.yaml", "envoy.filters.http.dynamic_modules"), ("wasm/wasm.yaml", "envoy.filters.http.wasm")]
    {
        let docs = eg_docs(file)?;
        let proxy = eg_find(&docs, "EnvoyProxy")?;
        let after: Vec<&str> = each(at(proxy, &["spec", "filterOrder"]).ok())
            .filter(|f| s(f, "name") == Some(filter))
            .filter_map(|f| s(f, "after"))
            .collect();
        assert_eq!(
            after,
            ["envoy.filters.http.rbac", "envoy.filters.http.local_ratelimit", "envoy.filters.http.ratelimit"],
            "{file}: after authorization and rate limits"
        );
    }
    let clients = eg_find(&base, "ClientTrafficPolicy")?;
    assert_eq!(text(clients, &["spec", "path", "escapedSlashesAction"]), "RejectRequest");
    assert!(at(clients, &["spec", "path", "disableMergeSlashes"]).is_err(), "slashes stay merged (the default)");
    let infra = at(gateway, &["spec", "infrastructure", "parametersRef"])?;
    for variant in ["native/native.yaml", "wasm/wasm.yaml"] {
        let docs = eg_docs(variant)?;
        let proxy = eg_find(&docs, "EnvoyProxy")?;
        assert_eq!(s(at(proxy, &["metadata"])?, "name"), s(infra, "name"), "{variant}: the Gateway's EnvoyProxy");
    }
    Ok(())
}

fn text<'a>(v: &'a Value, path: &[&str]) -> &'a str {
    at(v, path).ok().and_then(Value::as_str).unwrap_or_default()
}

/// The .wasm: code type Image (what `make oci` builds) and, in wasm-http.yaml, HTTP with a sha256; and the
/// EnvoyPatchPolicy that sets allow_on_headers_stop_iteration names the filter and listener Envoy Gateway
/// generates (envoy/gateway-like.yaml, which tests/tests/envoy_gateway.rs runs with and without it, uses them).
#[test]
fn the_wasm_comes_from_the_oci_image_or_http_and_its_hold_patch_finds_the_filter() -> TestResult {
    let wasm = eg_docs("wasm/wasm.yaml")?;
    let policy = eg_find(&wasm, "EnvoyExtensionPolicy")?;
    let filter = at(policy, &["spec", "wasm", "0"])?;
    assert_eq!(text(filter, &["code", "type"]), "Image");
    assert!(
        text(filter, &["code", "image", "url"]).starts_with("registry.example.com/agents/agent-idempotency-filter:")
    );
    assert_eq!(s(filter, "rootID"), Some("agent_idempotency"), "the filter's root_id");
    assert_eq!(at(filter, &["failOpen"])?.as_bool(), Some(false), "a filter that cannot load must not open the door");
    let http = eg_docs("wasm/wasm-http.yaml")?;
    let http_filter = at(eg_find(&http, "EnvoyExtensionPolicy")?, &["spec", "wasm", "0"])?;
    assert_eq!(text(http_filter, &["code", "type"]), "HTTP");
    assert!(text(http_filter, &["code", "http", "url"]).starts_with("https://"));
    let sha = text(http_filter, &["code", "http", "sha256"]);
    assert!(sha.len() == 64 && sha.bytes().all(|b| b.is_ascii_hexdigit()), "a sha256: {sha}");
    let http_meta = at(eg_find(&http, "EnvoyExtensionPolicy")?, &["metadata"])?;
    assert_eq!(s(http_meta, "name"), s(at(policy, &["metadata"])?, "name"), "the same policy: the patch fits both");

    let meta = at(policy, &["metadata"])?;
    let (ns, name) = (s(meta, "namespace").ok_or("ns")?, s(meta, "name").ok_or("name")?);
    let base = eg_docs("base/gateway.yaml")?;
    let gateway = eg_find(&base, "Gateway")?;
    let listener = format!(
        "{}/{}/{}",
        text(gateway, &["metadata", "namespace"]),
        text(gateway, &["metadata", "name"]),
        text(gateway, &["spec", "listeners", "0", "name"])
    );
    let hold = wasm.iter().find(|d| s(d, "kind") == Some("EnvoyPatchPolicy")).ok_or("no hold patch")?;
    let p = at(hold, &["spec", "jsonPatches", "0"])?;
    assert_eq!(s(p, "type"), Some("type.googleapis.com/envoy.config.listener.v3.Listener"));
    assert_eq!(s(p, "name"), Some(listener.as_str()), "Envoy Gateway's listener name");
    let eg_filter = format!("envoy.filters.http.wasm/envoyextensionpolicy/{ns}/{name}/wasm/0");
    assert_eq!(
        text(p, &["operation", "jsonPath"]),
        format!("..http_filters[?(@.name=='{eg_filter}')].typed_config.config"),
        "the filter Envoy Gateway generates for this policy"
    );
    assert_eq!(
        (text(p, &["operation", "op"]), text(p, &["operation", "path"])),
        ("add", "/allow_on_headers_stop_iteration")
    );
    assert_eq!(at(p, &["operation", "value"])?.as_bool(), Some(true));
    let like = read("envoy/gateway-like.yaml")?;
    assert!(like.contains(&format!("- name: {eg_filter}")) && like.contains(&format!("- name: {listener}")));
    Ok(())
}

/// The native module: allowlisted in the EnvoyProxy under the name the policy uses, loaded from where the
/// `envoy-native` image (Dockerfile) puts it, on the Envoy it was built for.
#[test]
fn the_native_module_is_allowlisted_and_shipped_with_its_envoy() -> TestResult {
    let native = eg_docs("native/native.yaml")?;
    let proxy = eg_find(&native, "EnvoyProxy")?;
    let policy = eg_find(&native, "EnvoyExtensionPolicy")?;
    let module = at(policy, &["spec", "dynamicModule", "0"])?;
    assert_eq!(s(module, "filterName"), Some("agent_idempotency"), "the module's filter_name");
    let entry = each(at(proxy, &["spec", "dynamicModules"]).ok())
        .find(|m| s(m, "name") == s(module, "name"))
        .ok_or("the policy's module is not in the EnvoyProxy's dynamicModules")?;
    assert_eq!(text(entry, &["source", "type"]), "Local");
    let path = text(entry, &["source", "local", "path"]);
    assert!(path.ends_with("/libagent_idempotency_native.so"), "{path}");

    let dockerfile = read("Dockerfile")?;
    let stage =
        dockerfile.split("\nFROM ").find(|st| st.contains(" AS envoy-native")).ok_or("no envoy-native stage")?;
    assert!(stage.starts_with("envoyproxy/envoy:v1.40."), "the Envoy the module is built for: {stage}");
    assert!(
        stage.lines().any(|l| l.starts_with("COPY --from=build")
            && l.contains("libagent_idempotency_native.so")
            && l.ends_with(path)),
        "the image puts the module where the EnvoyProxy loads it: {stage}"
    );
    let image = text(proxy, &["spec", "provider", "kubernetes", "envoyDeployment", "container", "image"]);
    assert!(image.ends_with(":1.40.0"), "the proxy runs the module's Envoy: {image}");
    let like = read("envoy/gateway-native-like.yaml")?;
    assert!(like.contains(&format!("filename: {path}")), "envoy/gateway-native-like.yaml loads the same path");
    Ok(())
}

#[test]
fn envoy_gateways_kustomizations_apply_one_filter_each() -> TestResult {
    for (dir, must, must_not) in [
        ("deploy/envoy-gateway/native", &["../base", "native.yaml"][..], &[][..]),
        ("deploy/envoy-gateway/wasm", &["../base", "wasm.yaml"][..], &["wasm-http.yaml"][..]),
        ("deploy/envoy-gateway/base", &["gateway.yaml"][..], &[][..]),
    ] {
        let k = documents(&read(&format!("{dir}/kustomization.yaml"))?)?;
        let resources: Vec<&str> = each(k.first().and_then(|d| d.get("resources"))).filter_map(Value::as_str).collect();
        for r in &resources {
            assert!(repo_root().join(dir).join(r).exists(), "{dir}/kustomization.yaml: {r} exists");
        }
        assert_eq!(resources, must, "{dir}");
        for m in must_not {
            assert!(!resources.contains(m), "{dir} must not apply {m}");
        }
    }
    Ok(())
}

/// DESIGN §6 and §7 on Envoy Gateway: its API maps no local reply by response flag and has only `failOpen`, so the
/// EnvoyPatchPolicy agent-replies adds the connection manager's `local_reply_config` (the mapper every committed
/// configuration has, envoy/gateway-like.yaml and gateway-native-like.yaml included) and the hold patch sets
/// `failure_policy: FAIL_RELOAD` on the filter Envoy Gateway generates, as envoy/gateway-like.yaml runs it.
#[test]
fn envoy_gateways_patches_map_envoys_own_replies_and_reload_a_failed_vm() -> TestResult {
    let base = eg_docs("base/gateway.yaml")?;
    let replies = base
        .iter()
        .find(|d| s(d, "kind") == Some("EnvoyPatchPolicy") && text(d, &["metadata", "name"]) == "agent-replies")
        .ok_or("no EnvoyPatchPolicy agent-replies")?;
    let p = at(replies, &["spec", "jsonPatches", "0"])?;
    assert_eq!(s(p, "name"), Some("payments/agents/http"), "Envoy Gateway's listener name");
    assert_eq!((text(p, &["operation", "op"]), text(p, &["operation", "path"])), ("add", "/local_reply_config"));
    let mapper = at(p, &["operation", "value"])?;
    for like in ["envoy/gateway-like.yaml", "envoy/gateway-native-like.yaml"] {
        let docs = documents(&read(like)?)?;
        let hcm = docs
            .first()
            .and_then(|d| at(d, &["static_resources", "listeners", "0", "default_filter_chain", "filters", "0"]).ok())
            .and_then(|f| at(f, &["typed_config", "local_reply_config"]).ok())
            .ok_or_else(|| format!("no local_reply_config in {like}"))?;
        assert_eq!(hcm, mapper, "{like} runs the patch's mapper");
    }

    let wasm = eg_docs("wasm/wasm.yaml")?;
    let hold = wasm.iter().find(|d| s(d, "kind") == Some("EnvoyPatchPolicy")).ok_or("no hold patch")?;
    let reload = at(hold, &["spec", "jsonPatches", "1"])?;
    let first = at(hold, &["spec", "jsonPatches", "0"])?;
    assert_eq!(text(reload, &["operation", "jsonPath"]), text(first, &["operation", "jsonPath"]), "the same filter");
    assert_eq!(
        (text(reload, &["operation", "path"]), text(reload, &["operation", "value"])),
        ("/failure_policy", "FAIL_RELOAD")
    );
    assert!(read("envoy/gateway-like.yaml")?.contains("failure_policy: FAIL_RELOAD"));
    Ok(())
}

// The ext_proc host: idemd serves Envoy's External Processing protocol itself (deploy/idemd/ext-proc), and each
// gateway's manifests point its ext_proc at idemd's port with what `idemd check`'s ext-proc rules require
// (sidecar/src/check/ext_proc.rs): never failing open, headers and trailers sent both ways, a body mode that holds the
// stream both ways, Envoy's wait for an answer above the plugin's sidecar_timeout_ms, the answer's code details sent.

/// The directories that deploy the ext_proc host, and the relative path of deploy/ from each.
const EXT_PROC_VARIANTS: &[(&str, &str)] =
    &[("istio/ext-proc", "../.."), ("envoy-gateway/extproc", "../.."), ("kgateway", ".."), ("agentgateway", "..")];

/// The documents of one file under deploy/.
fn deploy_docs(rel: &str) -> Result<Vec<Value>, idem_oci::Error> {
    documents(&read(&format!("deploy/{rel}"))?)
}

fn kind_in<'a>(docs: &'a [Value], kind: &str) -> Result<&'a Value, String> {
    docs.iter().find(|d| s(d, "kind") == Some(kind)).ok_or_else(|| format!("no {kind}"))
}

/// The plugin configuration a variant's ConfigMap idemd-ext-proc gives idemd (`config.json`).
fn ext_proc_config(dir: &str) -> Result<serde_json::Value, idem_oci::Error> {
    let docs = deploy_docs(&format!("{dir}/idemd-ext-proc.yaml"))?;
    let map = kind_in(&docs, "ConfigMap")?;
    assert_eq!(text(map, &["metadata", "name"]), "idemd-ext-proc", "{dir}: the ConfigMap the idemd patch mounts");
    Ok(serde_json::from_str(text(map, &["data", "config.json"]))?)
}

/// A Kubernetes/Envoy duration (`5s`, `1.5s`, `500ms`) in milliseconds.
fn duration_ms(v: &str) -> Option<u64> {
    if let Some(ms) = v.strip_suffix("ms") {
        return ms.parse().ok();
    }
    let secs: f64 = v.strip_suffix('s')?.parse().ok()?;
    Some((secs * 1000.0).round() as u64)
}

/// idemd's ext_proc port: what the Component's patch makes it listen on, expose and mount, checked against itself.
/// Returns (the Service's name, its namespace, the port).
fn idemd_ext_proc_port() -> Result<(String, String, u64), idem_oci::Error> {
    let patch = deploy_docs("idemd/ext-proc/idemd.patch.yaml")?;
    let deployment = kind_in(&patch, "Deployment")?;
    let service = kind_in(&patch, "Service")?;
    let container = at(deployment, &["spec", "template", "spec", "containers", "0"])?;
    let env = |name: &str| each(container.get("env")).find(|e| s(e, "name") == Some(name)).cloned();
    let listen = env("IDEM_EXT_PROC").ok_or("no IDEM_EXT_PROC: idemd would not serve ext_proc")?;
    let port: u64 = text(&listen, &["value"]).rsplit_once(':').and_then(|(_, p)| p.parse().ok()).ok_or("no port")?;
    let declared = each(container.get("ports")).find(|p| s(p, "name") == Some("grpc-ext-proc")).ok_or("no port")?;
    assert_eq!(at(declared, &["containerPort"])?.as_u64(), Some(port), "the container port is the one idemd serves");
    let svc_port = each(at(service, &["spec", "ports"]).ok()).find(|p| s(p, "name") == Some("grpc-ext-proc"));
    let svc_port = svc_port.ok_or("the Service has no grpc-ext-proc port")?;
    assert_eq!(text(svc_port, &["targetPort"]), "grpc-ext-proc");
    assert_eq!(text(svc_port, &["appProtocol"]), "grpc", "gRPC: Istio and the gateways speak HTTP/2 to it");
    // The configuration file: the ConfigMap idemd-ext-proc mounted where IDEM_EXT_PROC_CONFIG points.
    let file = env("IDEM_EXT_PROC_CONFIG").ok_or("no IDEM_EXT_PROC_CONFIG")?;
    let mount = each(container.get("volumeMounts")).find(|m| s(m, "name") == Some("ext-proc-config")).ok_or("mount")?;
    assert_eq!(text(&file, &["value"]), format!("{}/config.json", text(mount, &["mountPath"])));
    let volume = each(at(deployment, &["spec", "template", "spec", "volumes"]).ok())
        .find(|v| s(v, "name") == Some("ext-proc-config"))
        .ok_or("no volume")?;
    assert_eq!(text(volume, &["configMap", "name"]), "idemd-ext-proc");
    // idemd is the filter here: every secret_env of every variant's configuration is in its environment.
    let example = find(&all_documents()?, "Secret", "idem-filter-secrets")?.clone();
    for (dir, _) in EXT_PROC_VARIANTS {
        for name in secret_envs(&ext_proc_config(dir)?) {
            let e = env(&name).ok_or_else(|| format!("{dir}: idemd has no {name}"))?;
            let r = at(&e, &["valueFrom", "secretKeyRef"])?;
            assert_eq!(s(r, "name"), Some("idem-filter-secrets"));
            assert!(at(&example, &["stringData", text(r, &["key"])]).is_ok(), "the example Secret has {name}");
        }
    }
    let meta = at(service, &["metadata"])?;
    let name = s(meta, "name").ok_or("no name")?.to_owned();
    let docs = all_documents()?;
    let whole = find(&docs, "Service", &name)?;
    assert_eq!(s(at(whole, &["metadata"])?, "namespace"), s(meta, "namespace"), "the patch is of idemd's Service");
    Ok((name, s(meta, "namespace").ok_or("no namespace")?.to_owned(), port))
}

#[test]
fn every_ext_proc_variant_deploys_idemd_with_its_port_and_configuration() -> TestResult {
    let (_, _, port) = idemd_ext_proc_port()?;
    assert_eq!(port, 9191);
    let component = documents(&read("deploy/idemd/ext-proc/kustomization.yaml")?)?;
    let patches: Vec<&str> =
        each(component.first().and_then(|d| d.get("patches"))).filter_map(|p| s(p, "path")).collect();
    assert_eq!(patches, ["idemd.patch.yaml"]);
    for (dir, up) in EXT_PROC_VARIANTS {
        let k = documents(&read(&format!("deploy/{dir}/kustomization.yaml"))?)?;
        let k = k.first().ok_or("empty kustomization")?;
        let list =
            |key: &str| -> Vec<String> { each(k.get(key)).filter_map(Value::as_str).map(str::to_owned).collect() };
        let resources = list("resources");
        for r in &resources {
            assert!(repo_root().join("deploy").join(dir).join(r).exists(), "{dir}: {r} exists");
        }
        assert!(resources.contains(&format!("{up}/idemd")), "{dir} deploys idemd: {resources:?}");
        assert!(resources.contains(&"idemd-ext-proc.yaml".to_owned()), "{dir}: its configuration");
        assert_eq!(list("components"), [format!("{up}/idemd/ext-proc")], "{dir}: idemd serves ext_proc");
        let config = ext_proc_config(dir)?;
        for field in ["sidecar_cluster", "keys", "active_kid", "subject", "routes"] {
            assert!(!config[field].is_null(), "{dir}: config.json has {field}");
        }
    }
    Ok(())
}

/// The ext_proc filter's `processing_mode`, written in a gateway's spelling, as (header, body, trailer) per direction.
fn assert_holds_the_stream(what: &str, modes: [(&str, &str, &str); 2], send: &str, bodies: &[&str]) {
    for (header, body, trailer) in modes {
        assert_eq!(header, send, "{what}: headers are sent both ways");
        assert_eq!(trailer, send, "{what}: trailers are sent both ways (the end of a body that has them)");
        assert!(bodies.contains(&body), "{what}: body mode {body:?} cannot hold a stream (expected one of {bodies:?})");
    }
}

/// Envoy's own `processing_mode` (Istio's and kgateway's spelling of its enums), its six fields named in `keys`
/// (request header, body, trailer; response header, body, trailer).
fn assert_envoys_modes_hold_the_stream(what: &str, modes: &Value, keys: [&str; 6]) {
    let m = |i: usize| s(modes, keys[i]).unwrap_or("unset");
    let written = [(m(0), m(1), m(2)), (m(3), m(4), m(5))];
    assert_holds_the_stream(what, written, "SEND", &["BUFFERED", "FULL_DUPLEX_STREAMED"]);
}

/// Envoy's wait for each answer (`field`, Envoy's default 200 ms when unset) outlasts idemd's own store call, the
/// plugin configuration's sidecar_timeout_ms (`idemd check`'s ext-proc-message-timeout).
fn assert_outlasts_idemds_store_call(field: &str, written: Option<&Value>, config: &serde_json::Value) {
    let timeout = written.and_then(Value::as_str).map_or(Some(200), duration_ms);
    let timeout = timeout.unwrap_or_else(|| panic!("{field}: {written:?} is not a duration"));
    let sidecar = config["sidecar_timeout_ms"].as_u64().unwrap_or_else(|| panic!("no sidecar_timeout_ms"));
    assert!(timeout > sidecar, "{field} {timeout} ms must exceed sidecar_timeout_ms {sidecar} ms");
}

#[test]
fn istios_ext_proc_envoyfilter_reaches_idemd_and_never_fails_open() -> TestResult {
    let (svc, ns, port) = idemd_ext_proc_port()?;
    let docs = deploy_docs("istio/ext-proc/envoyfilter.yaml")?;
    let ef = kind_in(&docs, "EnvoyFilter")?;
    let patches = at(ef, &["spec", "configPatches"])?.as_sequence().ok_or("no patches")?;
    let filter_patch = patches.iter().find(|p| s(p, "applyTo") == Some("HTTP_FILTER")).ok_or("no HTTP_FILTER")?;
    assert_eq!(text(filter_patch, &["match", "context"]), "SIDECAR_INBOUND");
    assert_eq!(text(filter_patch, &["patch", "filterClass"]), "AUTHZ", "after authentication and authorization");
    let filter = at(filter_patch, &["patch", "value"])?;
    assert_eq!(s(filter, "name"), Some("envoy.filters.http.ext_proc"));
    let typed = at(filter, &["typed_config"])?;
    assert_eq!(
        text(typed, &["@type"]),
        "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
    );
    assert_eq!(at(typed, &["failure_mode_allow"])?.as_bool(), Some(false), "written out: never fail open");
    assert!(typed.get("observability_mode").is_none());
    let modes = [
        "request_header_mode",
        "request_body_mode",
        "request_trailer_mode",
        "response_header_mode",
        "response_body_mode",
        "response_trailer_mode",
    ];
    assert_envoys_modes_hold_the_stream("the EnvoyFilter", at(typed, &["processing_mode"])?, modes);
    let config = ext_proc_config("istio/ext-proc")?;
    assert_outlasts_idemds_store_call("message_timeout", typed.get("message_timeout"), &config);
    let attrs: Vec<&str> = each(typed.get("response_attributes")).filter_map(Value::as_str).collect();
    assert!(attrs.contains(&"response.code_details"), "{attrs:?}");
    // The subject is read from jwt_authn's metadata: the filter forwards that namespace.
    let subject_ns = config["subject"]["property"][2].as_str().ok_or("the subject is not a metadata property")?;
    let forwarded: Vec<&str> = each(at(typed, &["metadata_options", "forwarding_namespaces", "untyped"]).ok())
        .filter_map(Value::as_str)
        .collect();
    assert!(forwarded.contains(&subject_ns), "{subject_ns} is forwarded: {forwarded:?}");
    // Istio's outbound cluster for idemd's gRPC port (HTTP/2 by its appProtocol).
    assert_eq!(
        text(typed, &["grpc_service", "envoy_grpc", "cluster_name"]),
        format!("outbound|{port}||{svc}.{ns}.svc.cluster.local")
    );
    // Envoy's default :authority is that cluster name, which idemd's gRPC server refuses (`|`): name the Service.
    assert_eq!(text(typed, &["grpc_service", "envoy_grpc", "authority"]), format!("{svc}.{ns}.svc.cluster.local"));
    // The path normalisation, local replies and route timeout of the .wasm's EnvoyFilter, the same patches.
    let wasm = deploy_docs("istio/envoyfilter.yaml")?;
    let wasm_patches = at(kind_in(&wasm, "EnvoyFilter")?, &["spec", "configPatches"])?.as_sequence().ok_or("none")?;
    // The connection manager's local replies add one mapper here: Envoy's ext_proc filter's own failure replies
    // (idemd unreachable, its stream broken or timed out) as the §7 status_unavailable envelope.
    for apply in ["NETWORK_FILTER", "HTTP_ROUTE"] {
        let mut ours = patches.iter().find(|p| s(p, "applyTo") == Some(apply)).cloned();
        let theirs = wasm_patches.iter().find(|p| s(p, "applyTo") == Some(apply));
        if apply == "NETWORK_FILTER" {
            let mappers = ours
                .as_mut()
                .and_then(|p| p.get_mut("patch"))
                .and_then(|p| p.get_mut("value"))
                .and_then(|v| v.get_mut("typed_config"))
                .and_then(|t| t.get_mut("local_reply_config"))
                .and_then(|l| l.get_mut("mappers"))
                .and_then(Value::as_sequence_mut)
                .ok_or("NETWORK_FILTER: no local_reply_config mappers")?;
            let processor = |m: &Value| {
                m.get("filter")
                    .and_then(|f| f.get("extension_filter"))
                    .and_then(|f| f.get("typed_config"))
                    .and_then(|t| t.get("expression"))
                    .and_then(Value::as_str)
                    == Some("response.code_details.startsWith('ext_proc_error')")
            };
            let added: Vec<Value> = mappers.iter().filter(|m| processor(m)).cloned().collect();
            mappers.retain(|m| !processor(m));
            assert_eq!(added.len(), 1, "one mapper for the processor's failure replies");
            assert_eq!(added[0].get("status_code").and_then(Value::as_u64), Some(503));
            assert_eq!(text(&added[0], &["body_format_override", "json_format", "status"]), "status_unavailable");
        }
        assert!(ours.is_some() && ours.as_ref() == theirs, "{apply}: as in deploy/istio/envoyfilter.yaml");
    }
    // idemd runs the mesh's plugin configuration, and the processor is open to the guarded workload only.
    let wasmplugin: serde_json::Value =
        serde_json::from_str(&plugin_config_json(&read("deploy/istio/wasmplugin.yaml")?, "WasmPlugin")?)?;
    assert_eq!(config, wasmplugin, "config.json is the WasmPlugin's configuration");
    let all = all_documents()?;
    let authz = find(&all, "AuthorizationPolicy", "idemd-callers")?;
    let allowed = each(at(authz, &["spec", "rules"]).ok()).any(|r| {
        let op = r.get("to").and_then(|t| t.get(0)).and_then(|t| t.get("operation"));
        let ports: Vec<&str> = each(op.and_then(|o| o.get("ports"))).filter_map(Value::as_str).collect();
        let paths: Vec<&str> = each(op.and_then(|o| o.get("paths"))).filter_map(Value::as_str).collect();
        ports == [port.to_string().as_str()] && paths == ["/envoy.service.ext_proc.v3.ExternalProcessor/Process"]
    });
    assert!(allowed, "idemd-callers lets the transfers sidecar call the processor");
    Ok(())
}

/// The Gateway API route of a variant is Envoy Gateway's (exactly the service's paths, no catch-all).
fn same_route_as_envoy_gateways(file: &str) -> TestResult {
    let ours = deploy_docs(file)?;
    let eg = deploy_docs("envoy-gateway/base/gateway.yaml")?;
    assert_eq!(at(kind_in(&ours, "HTTPRoute")?, &["spec"])?, at(kind_in(&eg, "HTTPRoute")?, &["spec"])?, "{file}");
    let gw = kind_in(&ours, "Gateway")?;
    assert_eq!(text(gw, &["metadata", "name"]), "agents", "{file}: the Gateway the policy targets");
    Ok(())
}

#[test]
fn envoy_gateways_ext_proc_policy_reaches_idemd_and_never_fails_open() -> TestResult {
    let (svc, _, port) = idemd_ext_proc_port()?;
    let docs = deploy_docs("envoy-gateway/extproc/extproc.yaml")?;
    let policy = kind_in(&docs, "EnvoyExtensionPolicy")?;
    let target = at(policy, &["spec", "targetRefs", "0"])?;
    assert_eq!((s(target, "kind"), s(target, "name")), (Some("Gateway"), Some("agents")));
    let procs = at(policy, &["spec", "extProc"])?.as_sequence().ok_or("extProc is a list")?;
    assert_eq!(procs.len(), 1);
    let ep = &procs[0];
    let backend = at(ep, &["backendRefs", "0"])?;
    assert_eq!((s(backend, "name"), at(backend, &["port"])?.as_u64()), (Some(svc.as_str()), Some(port)));
    assert_eq!(at(ep, &["failOpen"])?.as_bool(), Some(false), "written out: never fail open");
    assert!(ep.get("shadowMode").is_none_or(|v| v.as_bool() == Some(false)));
    // Envoy Gateway sends headers for a direction that is present, and trailers only with FullDuplexStreamed.
    let body = |dir: &str| text(ep, &["processingMode", dir, "body"]);
    for dir in ["request", "response"] {
        assert_eq!(body(dir), "FullDuplexStreamed", "{dir}: the only mode Envoy Gateway sends trailers with");
    }
    let attrs: Vec<&str> =
        each(at(ep, &["processingMode", "response", "attributes"]).ok()).filter_map(Value::as_str).collect();
    assert!(attrs.contains(&"response.code_details"), "{attrs:?}");
    let config = ext_proc_config("envoy-gateway/extproc")?;
    assert_outlasts_idemds_store_call("messageTimeout", ep.get("messageTimeout"), &config);
    let native: serde_json::Value =
        serde_json::to_value(policy_config(eg_find(&eg_docs("native/native.yaml")?, "EnvoyExtensionPolicy")?)?)?;
    assert_eq!(config, native, "config.json is the native policy's configuration");
    let proxy = kind_in(&docs, "EnvoyProxy")?;
    let after: Vec<&str> = each(at(proxy, &["spec", "filterOrder"]).ok())
        .filter(|f| s(f, "name") == Some("envoy.filters.http.ext_proc"))
        .filter_map(|f| s(f, "after"))
        .collect();
    assert_eq!(
        after,
        ["envoy.filters.http.rbac", "envoy.filters.http.local_ratelimit", "envoy.filters.http.ratelimit"],
        "after authorization and rate limits"
    );
    let k = documents(&read("deploy/envoy-gateway/extproc/kustomization.yaml")?)?;
    let resources: Vec<&str> = each(k.first().and_then(|d| d.get("resources"))).filter_map(Value::as_str).collect();
    assert!(resources.contains(&"../base") && resources.contains(&"extproc.yaml"), "{resources:?}");
    Ok(())
}

#[test]
fn kgateways_ext_proc_extension_reaches_idemd_and_never_fails_open() -> TestResult {
    let (svc, _, port) = idemd_ext_proc_port()?;
    let docs = deploy_docs("kgateway/extproc.yaml")?;
    let ext = kind_in(&docs, "GatewayExtension")?;
    let ep = at(ext, &["spec", "extProc"])?;
    let backend = at(ep, &["grpcService", "backendRef"])?;
    assert_eq!((s(backend, "name"), at(backend, &["port"])?.as_u64()), (Some(svc.as_str()), Some(port)));
    // kgateway's default is failOpen: true.
    assert_eq!(at(ep, &["failOpen"])?.as_bool(), Some(false), "written out: kgateway fails open by default");
    let modes = [
        "requestHeaderMode",
        "requestBodyMode",
        "requestTrailerMode",
        "responseHeaderMode",
        "responseBodyMode",
        "responseTrailerMode",
    ];
    assert_envoys_modes_hold_the_stream("the GatewayExtension", at(ep, &["processingMode"])?, modes);
    let config = ext_proc_config("kgateway")?;
    assert_outlasts_idemds_store_call("messageTimeout", ep.get("messageTimeout"), &config);
    let policy = kind_in(&docs, "TrafficPolicy")?;
    assert_eq!(text(policy, &["spec", "extProc", "extensionRef", "name"]), text(ext, &["metadata", "name"]));
    assert!(at(policy, &["spec", "extProc", "processingMode"]).is_err(), "no per-policy override of the modes");
    let target = at(policy, &["spec", "targetRefs", "0"])?;
    assert_eq!((s(target, "kind"), s(target, "name")), (Some("Gateway"), Some("agents")));
    assert_eq!(config, ext_proc_config("envoy-gateway/extproc")?, "Envoy Gateway's configuration");
    same_route_as_envoy_gateways("kgateway/gateway.yaml")
}

#[test]
fn agentgateways_ext_proc_policy_reaches_idemd_and_never_fails_open() -> TestResult {
    let (svc, _, port) = idemd_ext_proc_port()?;
    let docs = deploy_docs("agentgateway/policy.yaml")?;
    let policy = kind_in(&docs, "AgentgatewayPolicy")?;
    let target = at(policy, &["spec", "targetRefs", "0"])?;
    assert_eq!((s(target, "kind"), s(target, "name")), (Some("Gateway"), Some("agents")));
    let ep = at(policy, &["spec", "traffic", "extProc"])?;
    let backend = at(ep, &["backendRef"])?;
    assert_eq!((s(backend, "name"), at(backend, &["port"])?.as_u64()), (Some(svc.as_str()), Some(port)));
    assert_eq!(text(ep, &["failureMode"]), "FailClosed", "written out: never fail open");
    let po = |k: &str| text(ep, &["processingOptions", k]);
    assert_holds_the_stream(
        "the AgentgatewayPolicy",
        [
            (po("requestHeaderMode"), po("requestBodyMode"), po("requestTrailerMode")),
            (po("responseHeaderMode"), po("responseBodyMode"), po("responseTrailerMode")),
        ],
        "Send",
        &["Buffered", "FullDuplexStreamed"],
    );
    // The subject: a metadata property the policy's metadataContext fills from the verified JWT.
    let config = ext_proc_config("agentgateway")?;
    let path: Vec<&str> =
        config["subject"]["property"].as_array().into_iter().flatten().filter_map(|v| v.as_str()).collect();
    let [_, _, ns, key] = path[..] else { panic!("the subject is not metadata.filter_metadata.<ns>.<key>: {path:?}") };
    assert_eq!(&path[..2], ["metadata", "filter_metadata"]);
    assert_eq!(text(ep, &["metadataContext", ns, key]), "jwt.sub", "the verified JWT's sub");
    let mut eg = ext_proc_config("envoy-gateway/extproc")?;
    eg["subject"] = config["subject"].clone();
    assert_eq!(config, eg, "Envoy Gateway's configuration but for the subject");
    same_route_as_envoy_gateways("agentgateway/gateway.yaml")
}
