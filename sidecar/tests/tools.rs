//! `idemd tools`, the binary itself: definitions generated from envoy/envoy.yaml,
//! envoy/e2e.yaml and plugin configurations are valid JSON Schemas that accept a
//! real transfer and refuse a broken one, the MCP entries agree with what the
//! demo MCP server lists, and a bound field without a type is warned about,
//! never guessed.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use serde_json::{json, Value};

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

struct Run {
    code: Option<i32>,
    stdout: Value,
    stderr: String,
}

fn tools(args: &[&str]) -> Result<Run, Box<dyn std::error::Error>> {
    let out = Command::new(env!("CARGO_BIN_EXE_idemd")).arg("tools").args(args).current_dir(repo()).output()?;
    let stderr = String::from_utf8(out.stderr)?;
    let stdout = if out.status.success() { serde_json::from_slice(&out.stdout)? } else { Value::Null };
    Ok(Run { code: out.status.code(), stdout, stderr })
}

fn names(list: &Value, key: &[&str]) -> Vec<String> {
    let each = |d: &Value| key.iter().fold(d.clone(), |v, k| v[*k].clone()).as_str().unwrap_or("?").to_string();
    list.as_array().map(|a| a.iter().map(each).collect()).unwrap_or_default()
}

/// The argument schema of `name` in the MCP list, checked against the JSON
/// Schema meta-schema and compiled.
fn validator(mcp: &Value, name: &str) -> Result<(Value, jsonschema::Validator), Box<dyn std::error::Error>> {
    let entry = mcp
        .as_array()
        .and_then(|a| a.iter().find(|t| t["name"] == name))
        .ok_or_else(|| format!("no tool {name} in {mcp:#}"))?;
    let schema = entry["inputSchema"].clone();
    jsonschema::meta::validate(&schema).map_err(|e| format!("{name}: not a valid JSON Schema: {e}"))?;
    let compiled = jsonschema::validator_for(&schema).map_err(|e| format!("{name}: {e}"))?;
    Ok((entry.clone(), compiled))
}

/// Every schema of every format is a valid JSON Schema, and the three
/// formats list the same tools with the same schemas and descriptions.
fn check_formats(all: &Value) -> TestResult {
    let (openai, anthropic, mcp) = (&all["openai"], &all["anthropic"], &all["mcp"]);
    let n = mcp.as_array().map_or(0, Vec::len);
    assert!(n > 0, "{all:#}");
    let mcp_names = names(mcp, &["name"]);
    assert_eq!(names(openai, &["function", "name"]), mcp_names);
    assert_eq!(names(anthropic, &["name"]), mcp_names);
    let mut unique = mcp_names.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), n, "tool names are unique: {mcp_names:?}");
    for i in 0..n {
        let (o, a, m) = (&openai[i], &anthropic[i], &mcp[i]);
        assert_eq!(o["type"], "function");
        assert_eq!(o["function"]["parameters"], m["inputSchema"]);
        assert_eq!(a["input_schema"], m["inputSchema"]);
        assert_eq!(o["function"]["description"], m["description"]);
        assert_eq!(a["description"], m["description"]);
        for schema in [&o["function"]["parameters"], &a["input_schema"], &m["inputSchema"]] {
            jsonschema::meta::validate(schema).map_err(|e| format!("{}: {e}: {schema:#}", m["name"]))?;
            jsonschema::validator_for(schema).map_err(|e| format!("{}: {e}", m["name"]))?;
            assert_eq!(schema["type"], "object");
        }
    }
    Ok(())
}

#[test]
fn envoy_yaml_gives_its_rest_and_mcp_tools_whose_schemas_accept_a_transfer_and_refuse_a_broken_one() -> TestResult {
    let run = tools(&["--envoy", "envoy/envoy.yaml"])?;
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert!(!run.stderr.contains("warning"), "every bound field of envoy.yaml is typed or described: {}", run.stderr);
    // The agent builder hears, once per money-moving MCP tool, which framework settings it needs.
    let needs = format!("tool execute_transfer: {}", idemd::tools::MONEY_MOVING_MCP_TOOL);
    assert!(run.stderr.contains(&needs), "{}", run.stderr);
    assert!(run.stderr.contains("tool_error_behavior='failed'"), "{}", run.stderr);
    check_formats(&run.stdout)?;
    let mcp = &run.stdout["mcp"];
    // The REST routes, then the MCP route's tools (its status tool is the REST one's namesake and agrees with it).
    assert_eq!(
        names(mcp, &["name"]),
        ["transfer_preview", "transfer_confirm", "get_transfer_status", "execute_transfer", "quote_transfer"]
    );

    let transfer = json!({"amount": "12.50", "currency": "EUR", "payee_id": "payee_42", "memo": "rent"});
    let with = |extra: Value| {
        let mut v = transfer.clone();
        if let (Some(v), Value::Object(extra)) = (v.as_object_mut(), extra) {
            v.extend(extra);
        }
        v
    };
    let without = |key: &str| {
        let mut v = with(json!({"fingerprint": "fp.v1.x"}));
        v.as_object_mut().map(|m| m.remove(key));
        v
    };

    let (preview, schema) = validator(mcp, "transfer_preview")?;
    assert!(schema.is_valid(&transfer));
    assert!(schema.is_valid(&with(json!({"amount": 12.5}))), "a JSON number is a decimal too");
    assert!(!schema.is_valid(&with(json!({"amount": true}))));
    assert!(!schema.is_valid(&with(json!({"currency": 978}))), "/currency:string");
    assert!(!schema.is_valid(&with(json!({"memo": 1}))), "tool.parameters is merged in");
    assert!(!schema.is_valid(&without("payee_id")), "bound fields are required");
    let text = preview["description"].as_str().unwrap_or_default();
    assert!(text.starts_with("Quote a transfer: fee and validity. Moves no money.\n"), "{text}");
    assert!(text.contains("call `transfer_confirm` with the same arguments and this fingerprint unchanged"), "{text}");
    assert!(text.contains("valid for 900 seconds"), "{text}");
    assert_eq!(preview["annotations"]["readOnlyHint"], true);

    let (confirm, schema) = validator(mcp, "transfer_confirm")?;
    assert!(schema.is_valid(&with(json!({"fingerprint": "fp.v1.x"}))));
    assert!(!schema.is_valid(&transfer), "a confirm without its fingerprint");
    assert!(!schema.is_valid(&with(json!({"fingerprint": 7}))));
    assert!(!schema.is_valid(&without("amount")));
    assert!(!schema.is_valid(&with(json!({"fingerprint": "fp.v1.x", "amount": ["12.50"]}))));
    let text = confirm["description"].as_str().unwrap_or_default();
    for part in [
        "Executes exactly once per fingerprint.",
        "Pass `fingerprint` exactly as `transfer_preview` returned it; never invent or edit one.",
        "If the answer is `in_progress`, call `get_transfer_status`",
        "`already_completed` means it was done earlier: report it, do not call again.",
    ] {
        assert!(text.contains(part), "{part:?} in {text}");
    }
    assert_eq!(confirm["annotations"], json!({"readOnlyHint": false, "idempotentHint": true}));

    let (status, schema) = validator(mcp, "get_transfer_status")?;
    assert!(schema.is_valid(&json!({"fingerprint": "fp.v1.x"})));
    assert!(!schema.is_valid(&json!({})));
    assert!(status["description"].as_str().is_some_and(|t| t.starts_with("Reports what became of a fingerprint's")));
    Ok(())
}

#[test]
fn one_format_alone_is_that_part_of_the_whole() -> TestResult {
    let all = tools(&["--envoy", "envoy/envoy.yaml"])?.stdout;
    for format in ["openai", "anthropic", "mcp"] {
        let run = tools(&["--envoy", "envoy/envoy.yaml", "--format", format])?;
        assert_eq!(run.code, Some(0), "{}", run.stderr);
        assert_eq!(run.stdout, all[format], "{format}");
    }
    let run = tools(&["--envoy", "envoy/envoy.yaml", "--format", "gemini"])?;
    assert_eq!(run.code, Some(2));
    let run = tools(&[])?;
    assert_eq!(run.code, Some(2), "an input is required");
    assert!(run.stderr.contains("--envoy"), "{}", run.stderr);
    Ok(())
}

#[test]
fn e2e_yaml_every_annotated_route_and_mcp_tool() -> TestResult {
    let run = tools(&["--envoy", "envoy/e2e.yaml"])?;
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    check_formats(&run.stdout)?;
    let got = names(&run.stdout["mcp"], &["name"]);
    for name in ["transfer_preview", "transfer_confirm", "get_transfer_status", "manual_status", "quote_transfer"] {
        assert!(got.iter().any(|n| n == name), "{name} in {got:?}");
    }
    // Role idempotent is for programs; an unnamed route has no tool name to give.
    assert!(!got.iter().any(|n| n == "transfer_idempotent"), "{got:?}");
    assert!(run.stderr.contains("route transfer_idempotent: role idempotent is for programs"), "{}", run.stderr);
    assert!(run.stderr.contains("(unnamed): no route name and no tool.name: skipped"), "{}", run.stderr);
    // Each confirm names its own status tool; the MCP quote pairs with the MCP confirm.
    let mcp = &run.stdout["mcp"];
    let (quote, _) = validator(mcp, "quote_transfer")?;
    assert!(quote["description"].as_str().is_some_and(|t| t.contains("call `execute_transfer`")), "{quote:#}");
    let (manual, _) = validator(mcp, "manual_preview")?;
    assert!(manual["description"].as_str().is_some_and(|t| t.contains("call `manual_confirm`")), "{manual:#}");
    let (_, schema) = validator(mcp, "execute_transfer")?;
    let call = json!({"amount": "12.50", "currency": "EUR", "memo": "rent", "payee_id": "payee_42"});
    assert!(!schema.is_valid(&call), "no fingerprint");
    let mut with_fp = call.clone();
    with_fp["fingerprint"] = json!("fp.v1.x");
    assert!(schema.is_valid(&with_fp));
    with_fp["amount"] = json!(null);
    assert!(!schema.is_valid(&with_fp), "amount is :decimal");
    Ok(())
}

/// Values bound outside the body are arguments that say where they are sent; a confirm that takes
/// programs' keys tells the agent never to make one up (DESIGN §3, §6).
#[test]
fn values_outside_the_body_and_client_keys_are_said_in_the_definitions() -> TestResult {
    let run = tools(&["--envoy", "envoy/e2e.yaml"])?;
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let mcp = &run.stdout["mcp"];
    let (confirm, schema) = validator(mcp, "account_transfer_confirm_a")?;
    let account = &confirm["inputSchema"]["properties"]["account"];
    assert_eq!(account["x-agent-idempotency-in"], "path", "{confirm:#}");
    assert!(account["description"].as_str().is_some_and(|d| d.contains("{account} segment of the path")), "{account}");
    let call =
        json!({"account": "acct-a", "amount": "12.50", "currency": "EUR", "payee_id": "p", "fingerprint": "x.y"});
    assert!(schema.is_valid(&call));
    let mut without = call.clone();
    without.as_object_mut().map(|m| m.remove("account"));
    assert!(!schema.is_valid(&without), "a bound path value is required");
    let (both, _) = validator(mcp, "transfer_confirm_or_key")?;
    let text = both["description"].as_str().unwrap_or_default();
    assert!(text.contains("Never send an `Idempotency-Key` of your own"), "{text}");
    assert!(
        run.stderr.contains("route transfer_confirm_or_key: takes programs' own Idempotency-Key"),
        "{}",
        run.stderr
    );
    let (plain, _) = validator(mcp, "transfer_confirm")?;
    assert!(!plain["description"].as_str().unwrap_or_default().contains("Idempotency-Key"), "{plain:#}");
    Ok(())
}

struct Demo(Child);

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// target/debug/demo (the lead's `make build`), built here if missing.
fn start_demo(db: &Path) -> Result<(Demo, String), Box<dyn std::error::Error>> {
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| repo().join("target"), PathBuf::from);
    let bin = target.join("debug").join("demo");
    if !bin.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status =
            Command::new(cargo).args(["build", "-p", "idem-demo", "--bin", "demo"]).current_dir(repo()).status()?;
        assert!(status.success(), "cargo build -p idem-demo --bin demo");
    }
    let mut child = Command::new(bin)
        .args(["--listen", "127.0.0.1:0", "--db"])
        .arg(db)
        .env_remove("DEMO_NO_MCP")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let demo = Demo(child);
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    let addr = line.trim().strip_prefix("demo listening on ").ok_or_else(|| format!("demo said {line:?}"))?;
    Ok((demo, addr.to_string()))
}

/// A raw JSON-RPC `tools/list` on the demo's `/mcp` (demo/MCP-WIRE.md).
fn demo_tools_list(addr: &str) -> Result<Value, Box<dyn std::error::Error>> {
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let answer = reqwest::Client::new()
            .post(format!("http://{addr}/mcp"))
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{}}"#)
            .send()
            .await?;
        assert_eq!(answer.status(), 200);
        let body: Value = answer.json().await?;
        Ok(body["result"]["tools"].clone())
    })
}

#[test]
fn mcp_entries_match_what_the_demo_mcp_server_lists() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (_demo, addr) = start_demo(&dir.path().join("demo.db"))?;
    let listed = demo_tools_list(&addr)?;
    let listed_names = names(&listed, &["name"]);
    assert_eq!(listed_names.len(), 3, "{listed:#}");

    let run = tools(&["--envoy", "envoy/e2e.yaml", "--format", "mcp"])?;
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    // The MCP route's tools table names exactly the server's tools, and each is generated.
    let e2e: Value = serde_norway::from_str(&std::fs::read_to_string(repo().join("envoy/e2e.yaml"))?)?;
    let hosts = e2e["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        ["route_config"]["virtual_hosts"]
        .clone();
    let mcp_route = hosts
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|h| h["routes"].as_array().cloned().unwrap_or_default())
        .find(|r| r["name"] == "mcp")
        .ok_or("no route mcp in envoy/e2e.yaml")?;
    let table: Value = serde_json::from_str(
        mcp_route["metadata"]["filter_metadata"]["agent_idempotency"]["tools"].as_str().ok_or("no tools")?,
    )?;
    let mut annotated: Vec<String> = table.as_object().map(|t| t.keys().cloned().collect()).unwrap_or_default();
    annotated.sort();
    let mut want = listed_names.clone();
    want.sort();
    assert_eq!(annotated, want);
    let generated = names(&run.stdout, &["name"]);
    assert!(want.iter().all(|n| generated.contains(n)), "{want:?} in {generated:?}");

    for tool in listed.as_array().into_iter().flatten() {
        let name = tool["name"].as_str().unwrap_or_default();
        let (ours, schema) = validator(&run.stdout, name)?;
        let required = tool["inputSchema"]["required"].as_array().cloned().unwrap_or_default();
        for field in &required {
            let field = field.as_str().unwrap_or_default();
            assert!(ours["inputSchema"]["properties"].get(field).is_some(), "{name}: {field} in {ours:#}");
            assert!(
                ours["inputSchema"]["required"].as_array().is_some_and(|r| r.iter().any(|f| f == field)),
                "{name}: {field} is required by the server, so by us"
            );
        }
        // An argument set the server's schema accepts, plus the fingerprint the gateway needs.
        if let Some(example) = tool["inputSchema"]["properties"].as_object().map(|p| {
            let mut args = serde_json::Map::new();
            for key in p.keys() {
                let value = match key.as_str() {
                    "amount" => json!("12.50"),
                    "currency" => json!("EUR"),
                    "fingerprint" => json!("fp.v1.x"),
                    other => json!(format!("{other}-1")),
                };
                args.insert(key.clone(), value);
            }
            Value::Object(args)
        }) {
            assert!(jsonschema::is_valid(&tool["inputSchema"], &example), "{name}: the server takes {example}");
            assert!(schema.is_valid(&example), "{name}: our schema takes what the server takes: {example}");
        }
        assert_eq!(ours["annotations"]["readOnlyHint"], tool["annotations"]["readOnlyHint"], "{name}");
    }
    Ok(())
}

fn plugin_config(routes: Value) -> Value {
    json!({
        "sidecar_cluster": "idem_sidecar",
        "sidecar_token": {"secret_env": "NOT_SET_ANYWHERE_TOKEN"},
        "keys": [{"kid": "k1", "secret_env": "NOT_SET_ANYWHERE_K1"}],
        "active_kid": "k1",
        "subject": {"header": "x-agent-subject"},
        "defaults": {"fingerprint_ttl_s": 600},
        "routes": routes,
    })
}

fn tools_on(config: &Value) -> Result<Run, Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("plugin.json");
    std::fs::write(&path, serde_json::to_vec(config)?)?;
    tools(&["--plugin-config", path.to_str().ok_or("path")?])
}

#[test]
fn plugin_config_rules_nested_pointers_and_an_untyped_field_is_warned_not_guessed() -> TestResult {
    let tool = json!({
        "name": "quote_payout",
        "description": "Quote a payout.",
        "parameters": {"type": "object", "properties": {
            "payee": {"type": "object", "properties": {"name": {"type": "string"}}},
            "note": {"type": "string"}
        }}
    });
    let run = tools_on(&plugin_config(json!([
        {"name": "payout_preview", "match": {"path": "/payouts/preview"}, "role": "preview", "scope": "payouts",
         "bind": "/amount:decimal, /currency, /payee/id:string, /count:integer, /urgent:boolean, /rate:number",
         "tool": tool.to_string()},
        {"name": "payout_confirm", "match": {"path": "/payouts"}, "role": "confirm", "upstream_keys": "honoured", "scope": "payouts",
         "bind": "/amount:decimal, /currency, /payee/id:string, /count:integer, /urgent:boolean, /rate:number"},
    ])))?;
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    check_formats(&run.stdout)?;
    assert_eq!(names(&run.stdout["mcp"], &["name"]), ["quote_payout", "payout_confirm"]);
    assert!(
        run.stderr.contains(
            "rule payout_preview: bind /currency has no type; add a type suffix such as :string or describe it in tool.parameters"
        ),
        "{}",
        run.stderr
    );
    assert!(run.stderr.contains("rule payout_confirm: bind /currency has no type"), "{}", run.stderr);

    let (quote, schema) = validator(&run.stdout["mcp"], "quote_payout")?;
    let input = &quote["inputSchema"];
    assert_eq!(input["properties"]["currency"], json!({}), "no guess");
    assert_eq!(input["properties"]["payee"]["properties"]["id"], json!({"type": "string"}));
    assert_eq!(input["properties"]["payee"]["properties"]["name"], json!({"type": "string"}), "merged");
    assert_eq!(input["properties"]["payee"]["required"], json!(["id"]));
    assert_eq!(input["properties"]["count"], json!({"type": "integer"}));
    assert!(quote["description"].as_str().is_some_and(|t| t.contains("valid for 600 seconds")), "the defaults");
    let good =
        json!({"amount": 10, "currency": "EUR", "payee": {"id": "p1"}, "count": 2, "urgent": false, "rate": 0.5});
    assert!(schema.is_valid(&good));
    for (key, bad) in [
        ("payee", json!({"name": "x"})),
        ("count", json!(2.5)),
        ("urgent", json!("yes")),
        ("rate", json!("0.5")),
        ("note", json!(3)),
    ] {
        let mut v = good.clone();
        v[key] = bad;
        assert!(!schema.is_valid(&v), "{v}");
    }
    Ok(())
}

#[test]
fn refused_annotations_and_clashing_names_exit_2_naming_them() -> TestResult {
    let rule = |name: &str, path: &str, extra: Value| {
        let mut r = json!({"name": name, "match": {"path": path}, "scope": "s", "bind": "/a:string"});
        if let (Some(r), Value::Object(extra)) = (r.as_object_mut(), extra) {
            r.extend(extra);
        }
        r
    };
    let bad = tools_on(&plugin_config(json!([rule("p", "/p", json!({"role": "preview", "bind": "/a:strin"}))])))?;
    assert_eq!(bad.code, Some(2));
    assert!(bad.stderr.contains("routes[0] (p).bind: \"/a:strin\""), "{}", bad.stderr);

    let same = json!({"name": "do_it"}).to_string();
    let clash = tools_on(&plugin_config(json!([
        rule("p", "/p", json!({"role": "preview", "tool": same})),
        rule("c", "/c", json!({"role": "confirm", "upstream_keys": "honoured", "tool": same})),
    ])))?;
    assert_eq!(clash.code, Some(2));
    assert!(clash.stderr.contains("tool do_it:") && clash.stderr.contains("define it differently"), "{}", clash.stderr);

    let missing = tools(&["--envoy", "envoy/no-such.yaml"])?;
    assert_eq!(missing.code, Some(2));
    assert!(missing.stderr.contains("envoy/no-such.yaml: cannot read"), "{}", missing.stderr);
    Ok(())
}

#[test]
fn route_rules_inside_an_envoy_configuration() -> TestResult {
    // envoy/istio-like.yaml: no route metadata, the rules in the plugin configuration (secrets from env): the REST
    // routes' and the MCP endpoints' (whose tools are listed once for the three endpoints).
    let run = tools(&["--envoy", "envoy/istio-like.yaml", "--format", "mcp"])?;
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert_eq!(
        names(&run.stdout, &["name"]),
        ["transfer_preview", "transfer_confirm", "get_transfer_status", "execute_transfer", "quote_transfer"]
    );
    Ok(())
}

/// DESIGN §9's per-route pattern (the filter disabled on hot unannotated routes)
/// must never reach an annotated route: the check an operator runs over a config.
#[test]
fn an_annotated_route_with_the_filter_disabled_is_refused() -> TestResult {
    let text = std::fs::read_to_string(repo().join("envoy/envoy.yaml"))?;
    let disable = "                typed_per_filter_config:\n                  envoy.filters.http.wasm:\n                    \"@type\": type.googleapis.com/envoy.config.route.v3.FilterConfig\n                    disabled: true\n";
    let dir = tempfile::tempdir()?;
    // On an unannotated route: the intended use, accepted.
    let ok_text = text.replacen(
        "              - name: healthz\n                match: { path: /healthz }\n                route: { cluster: demo }\n",
        &format!("              - name: healthz\n                match: {{ path: /healthz }}\n                route: {{ cluster: demo }}\n{disable}"),
        1,
    );
    assert_ne!(ok_text, text, "envoy.yaml has no healthz route to edit");
    let ok_path = dir.path().join("ok.yaml");
    std::fs::write(&ok_path, &ok_text)?;
    let ok = tools(&["--envoy", ok_path.to_str().ok_or("path")?])?;
    assert_eq!(ok.code, Some(0), "{}", ok.stderr);
    // On the confirm route: a hole, refused with the route named.
    let bad_text = text.replacen(
        "                route: { cluster: demo, timeout: 15s }\n",
        &format!("                route: {{ cluster: demo, timeout: 15s }}\n{disable}"),
        1,
    );
    assert_ne!(bad_text, text, "envoy.yaml has no confirm route to edit");
    let bad_path = dir.path().join("bad.yaml");
    std::fs::write(&bad_path, &bad_text)?;
    let bad = tools(&["--envoy", bad_path.to_str().ok_or("path")?])?;
    assert_eq!(bad.code, Some(2), "{}", bad.stderr);
    assert!(
        bad.stderr
            .contains("route transfer_confirm: annotated, but the envoy.filters.http.wasm filter is disabled on it"),
        "{}",
        bad.stderr
    );
    Ok(())
}

/// The native module's configuration (envoy/native.yaml): its filter entry, and routes annotated
/// with its per-route configuration as well as with route metadata, give the same actions.
#[test]
fn the_native_modules_config_and_per_route_annotations_are_read_too() -> TestResult {
    let run = tools(&["--envoy", "envoy/native.yaml", "--format", "mcp"])?;
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert_eq!(
        names(&run.stdout, &["name"]),
        ["transfer_preview", "transfer_confirm", "get_transfer_status", "execute_transfer", "quote_transfer"]
    );
    // A typo'd field in a per-route configuration: the module refuses it at load, and so does this check.
    let text = std::fs::read_to_string(repo().join("envoy/native.yaml"))?;
    let bad_text = text.replacen(r#"{"role": "status","#, r#"{"role": "status", "polll_after_ms": 5,"#, 1);
    assert_ne!(bad_text, text, "native.yaml has no per-route status annotation to edit");
    let dir = tempfile::tempdir()?;
    let bad_path = dir.path().join("bad.yaml");
    std::fs::write(&bad_path, &bad_text)?;
    let bad = tools(&["--envoy", bad_path.to_str().ok_or("path")?])?;
    assert_eq!(bad.code, Some(2), "{}", bad.stderr);
    assert!(bad.stderr.contains("polll_after_ms: unknown annotation field"), "{}", bad.stderr);
    Ok(())
}
