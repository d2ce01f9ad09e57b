//! The official MCP SDKs as real clients, through Envoy and the filter: the Python SDK (PyPI `mcp`,
//! pinned in tests/mcp-sdk/requirements.txt, from `.venv`) and the TypeScript SDK (npm
//! `@modelcontextprotocol/sdk`, pinned in tests/mcp-sdk/package-lock.json, from
//! tests/mcp-sdk/node_modules), each on the JSON endpoint (`/mcp`) and the event-stream one
//! (`/mcp/stream`). `make mcp-sdk` installs both.
//!
//! Each driver (tests/mcp-sdk/driver.py, driver.mjs) runs the scenarios with the SDK's own
//! output-schema validation on, as an agent would, and prints one JSON line per step; this file
//! judges them against DESIGN §7's MCP contract: every answer is accepted by the SDK (no
//! exception), a non-error result conforms to the tool's `outputSchema` as the gateway listed it (the
//! demo's record schema is strict, `additionalProperties: false`; the gateway declares its optional
//! `agent_idempotency` property in it, and a replay's `structuredContent` is the original's plus the
//! envelope there), every other gateway answer is `isError: true` with no
//! `structuredContent`, its envelope in `_meta["agent-idempotency/reply"]` and in a text block;
//! and the demo's ledger shows exactly one execution per fingerprint.

use idem_e2e::*;
use serde_json::Value;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

const REPLY_META: &str = "agent-idempotency/reply";
/// The property of a replay's `structuredContent` the gateway declares in a confirm tool's `outputSchema`.
const REPLAY_PROPERTY: &str = "agent_idempotency";

#[derive(Clone, Copy, Debug, PartialEq)]
enum Sdk {
    /// ClientSession with protocol 2025-11-25's `initialize`.
    Python,
    /// ClientSession with 2026-07-28's `server/discover`: every request carries `Mcp-Method` (SEP-2243).
    PythonDiscover,
    Node,
}

fn sdk_dir() -> PathBuf {
    repo_root().join("tests/mcp-sdk")
}

const INSTALL: &str = "run `make mcp-sdk` (it runs `.venv/bin/pip install -r tests/mcp-sdk/requirements.txt` and \
                       `npm ci` in tests/mcp-sdk)";

/// The version a pin file names: `mcp==X` in requirements.txt, the lock's `node_modules/@modelcontextprotocol/sdk`.
fn pinned(sdk: Sdk) -> Result<String, BoxError> {
    match sdk {
        Sdk::Python | Sdk::PythonDiscover => {
            let text = std::fs::read_to_string(sdk_dir().join("requirements.txt"))?;
            text.lines()
                .find_map(|l| l.trim().strip_prefix("mcp=="))
                .map(|v| v.trim().to_owned())
                .ok_or_else(|| "tests/mcp-sdk/requirements.txt pins no mcp==…".into())
        }
        Sdk::Node => {
            let lock: Value = serde_json::from_str(&std::fs::read_to_string(sdk_dir().join("package-lock.json"))?)?;
            lock["packages"]["node_modules/@modelcontextprotocol/sdk"]["version"]
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| "tests/mcp-sdk/package-lock.json locks no @modelcontextprotocol/sdk".into())
        }
    }
}

/// The SDK as installed, or a failure that says how to install it (never a skip).
fn installed(sdk: Sdk) -> Result<String, BoxError> {
    let want = pinned(sdk)?;
    let have = match sdk {
        Sdk::Python | Sdk::PythonDiscover => {
            let python = repo_root().join(".venv/bin/python");
            let out = std::process::Command::new(&python)
                .args(["-c", "import importlib.metadata as m; print(m.version('mcp'))"])
                .output()
                .map_err(|e| format!("{}: {e}: {INSTALL}", python.display()))?;
            if !out.status.success() {
                return Err(format!(
                    "the MCP Python SDK is not installed in .venv ({}): {INSTALL}",
                    String::from_utf8_lossy(&out.stderr).trim().lines().last().unwrap_or_default()
                )
                .into());
            }
            String::from_utf8_lossy(&out.stdout).trim().to_owned()
        }
        Sdk::Node => {
            let node = std::process::Command::new("node").arg("--version").output();
            if !node.is_ok_and(|o| o.status.success()) {
                return Err(format!("node is not on PATH (Debian: apt-get install nodejs npm), then {INSTALL}").into());
            }
            let manifest = sdk_dir().join("node_modules/@modelcontextprotocol/sdk/package.json");
            let text = std::fs::read_to_string(&manifest).map_err(|e| {
                format!("{}: {e}: the MCP TypeScript SDK is not installed: {INSTALL}", manifest.display())
            })?;
            let v: Value = serde_json::from_str(&text)?;
            v["version"].as_str().unwrap_or_default().to_owned()
        }
    };
    if have != want {
        return Err(format!("{sdk:?} SDK {have} is installed, the pin says {want}: {INSTALL}").into());
    }
    Ok(have)
}

/// Runs the driver against `url`; its lines, parsed.
async fn run_driver(sdk: Sdk, url: &str) -> Result<Vec<Value>, BoxError> {
    installed(sdk)?;
    let mut cmd = match sdk {
        Sdk::Python | Sdk::PythonDiscover => {
            let mut c = tokio::process::Command::new(repo_root().join(".venv/bin/python"));
            c.arg(sdk_dir().join("driver.py"));
            c
        }
        Sdk::Node => {
            let mut c = tokio::process::Command::new("node");
            c.arg(sdk_dir().join("driver.mjs"));
            c
        }
    };
    cmd.arg(url);
    if sdk == Sdk::PythonDiscover {
        cmd.arg("discover");
    }
    cmd.current_dir(sdk_dir()).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd.kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(180), cmd.output())
        .await
        .map_err(|_| format!("the {sdk:?} driver did not finish in 180 s"))??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let mut lines = Vec::new();
    for line in stdout.lines().filter(|l| !l.trim().is_empty()) {
        lines.push(
            serde_json::from_str(line)
                .map_err(|e| format!("the {sdk:?} driver printed a line that is not JSON ({e}): {line}"))?,
        );
    }
    if !out.status.success() {
        return Err(format!("the {sdk:?} driver exited {}:\n{stdout}\nstderr:\n{stderr}", out.status).into());
    }
    Ok(lines)
}

/// What the steps say, and what is wrong with them.
struct Judge<'a> {
    label: String,
    steps: HashMap<&'a str, &'a Value>,
    failures: Vec<String>,
}

impl<'a> Judge<'a> {
    fn new(label: String, lines: &'a [Value]) -> Self {
        let steps = lines.iter().filter_map(|l| Some((l["step"].as_str()?, l))).collect();
        Judge { label, steps, failures: Vec::new() }
    }

    /// A failure, with a one-line digest of the step (the driver's full lines follow them all).
    fn fail(&mut self, step: &str, what: String) {
        let seen = match self.steps.get(step) {
            None => "(no such step)".to_owned(),
            Some(l) if l["ok"] != true => {
                format!("SDK error: {}", l["error"].as_str().unwrap_or("?").lines().next().unwrap_or(""))
            }
            Some(l) => {
                let keys: Vec<&str> = l["structuredContent"]
                    .as_object()
                    .map(|o| o.keys().map(String::as_str).collect())
                    .unwrap_or_default();
                format!(
                    "isError {}, status {}, structuredContent keys {keys:?}, _meta {}",
                    l["isError"], l["status"], l["meta"]
                )
            }
        };
        self.failures.push(format!("{} {step}: {what}\n    got: {seen}", self.label));
    }

    /// The step's line if the SDK accepted the answer; a failure otherwise.
    fn accepted(&mut self, step: &str) -> Option<&'a Value> {
        let Some(line) = self.steps.get(step).copied() else {
            self.fail(step, "the driver never got here".into());
            return None;
        };
        if line["ok"] != true {
            self.fail(step, "the SDK rejected the answer".into());
            return None;
        }
        Some(line)
    }

    fn envelope(&mut self, step: &str, line: &Value, status: &str) -> Option<Value> {
        let envelope = line["meta"][REPLY_META].clone();
        if envelope["status"] != status {
            self.fail(step, format!("_meta[{REPLY_META:?}].status should be {status:?}"));
            return None;
        }
        for field in ["meaning", "instruction", "trace_id"] {
            if !envelope[field].is_string() {
                self.fail(step, format!("the envelope has no {field}"));
            }
        }
        if !envelope["retryable"].is_boolean() {
            self.fail(step, "the envelope has no retryable".into());
        }
        Some(envelope)
    }

    /// A preview: the upstream's quote, plus the fingerprint in structuredContent and in a text block.
    fn preview(&mut self, step: &str) -> Option<String> {
        let line = self.accepted(step)?;
        let sc = &line["structuredContent"];
        if line["isError"] != false || !sc["quote_id"].is_string() {
            self.fail(step, "should be the upstream's quote (isError false, structuredContent.quote_id)".into());
        }
        if !sc["fingerprint_expires_at"].is_u64() {
            self.fail(step, "structuredContent.fingerprint_expires_at should be an integer".into());
        }
        let Some(fp) = sc["fingerprint"].as_str() else {
            self.fail(step, "structuredContent.fingerprint should be a string".into());
            return None;
        };
        let said = line["content"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|b| b["text"].as_str().is_some_and(|t| t.contains(fp)));
        if !said {
            self.fail(step, "no text block carries the fingerprint".into());
        }
        Some(fp.to_owned())
    }

    /// A first execution: the upstream's own record.
    fn executed(&mut self, step: &str) -> Option<&'a Value> {
        let line = self.accepted(step)?;
        if line["isError"] != false || !line["structuredContent"]["transfer_id"].is_string() {
            self.fail(step, "should be the upstream's record (isError false, structuredContent.transfer_id)".into());
            return None;
        }
        Some(line)
    }

    /// A replay of a DONE operation: the original result, then the gateway's words and the envelope as an
    /// embedded JSON resource (what frameworks that map content show the model), the envelope in `_meta`.
    fn replay(&mut self, step: &str, original: Option<&Value>) {
        let Some(line) = self.accepted(step) else { return };
        if line["isError"] != false {
            self.fail(step, "a replay of a completed operation is not an error".into());
        }
        let Some(envelope) = self.envelope(step, line, "already_completed") else { return };
        let Some(original) = original else { return };
        let mut said = envelope.clone();
        if let Some(e) = said.as_object_mut() {
            e.remove("result");
        }
        let mut structured = original["structuredContent"].clone();
        structured[REPLAY_PROPERTY] = said;
        if line["structuredContent"] != structured {
            self.fail(
                step,
                format!(
                    "structuredContent should be the original's plus the envelope (less `result`) as {REPLAY_PROPERTY}"
                ),
            );
        }
        if envelope["result_ref"] != original["structuredContent"]["transfer_id"] {
            self.fail(step, "the envelope's result_ref should be the original transfer_id".into());
        }
        let (now, then) = (line["content"].as_array(), original["content"].as_array());
        let extended = match (now, then) {
            (Some(now), Some(then)) => {
                now.len() == then.len() + 2
                    && now[..then.len()] == then[..]
                    && now[then.len()]["type"] == "text"
                    && now[then.len() + 1]["resource"]["text"].as_str().and_then(|t| serde_json::from_str(t).ok())
                        == Some(envelope.clone())
            }
            _ => false,
        };
        if !extended {
            self.fail(step, "content should be the original's blocks, a text block, the envelope as a resource".into());
        }
    }

    /// The upstream's own refusal, passed through: an error whose text is the demo's REST error body.
    fn upstream_refusal(&mut self, step: &str, error: &str) {
        let Some(line) = self.accepted(step) else { return };
        let text = line["content"][0]["text"].as_str().and_then(|t| serde_json::from_str::<Value>(t).ok());
        if line["isError"] != true || text.as_ref().map(|t| &t["error"]) != Some(&Value::from(error)) {
            self.fail(step, format!("should be the upstream's own refusal (isError, text {{\"error\":{error:?}}})"));
        }
    }

    /// An answer the SDK must refuse (its validation at work): an exception naming `needle`.
    fn rejected(&mut self, step: &str, needle: &str) {
        let Some(line) = self.steps.get(step).copied() else {
            self.fail(step, "the driver never got here".into());
            return;
        };
        if line["ok"] != false || !line["error"].as_str().is_some_and(|e| e.contains(needle)) {
            self.fail(step, format!("the SDK should refuse this answer, naming {needle:?}"));
        }
    }

    /// A replay of a FAILED operation: an error without structuredContent, the envelope in `_meta`.
    fn failed_replay(&mut self, step: &str) {
        let Some(line) = self.accepted(step) else { return };
        if line["isError"] != true || !line["structuredContent"].is_null() {
            self.fail(step, "a replay of a failed operation is isError: true without structuredContent".into());
        }
        self.envelope(step, line, "already_failed");
    }

    /// A status-tool report: a result whose structuredContent is the envelope (its schema is the envelope's).
    fn report(&mut self, step: &str, status: &str) {
        let Some(line) = self.accepted(step) else { return };
        if line["isError"] != false {
            self.fail(step, format!("a status report ({status}) is not an error"));
        }
        if line["structuredContent"]["status"] != status {
            self.fail(step, format!("structuredContent.status should be {status:?}"));
        }
        if let Some(envelope) = self.envelope(step, line, status) {
            if line["structuredContent"] != envelope {
                self.fail(step, "structuredContent and _meta should carry the same envelope".into());
            }
        }
    }

    /// Any other gateway answer: isError, no structuredContent, the envelope in `_meta` and in text.
    fn refusal(&mut self, step: &str, status: &str) {
        let Some(line) = self.accepted(step) else { return };
        if line["isError"] != true {
            self.fail(step, format!("{status} should be isError: true"));
        }
        if !line["structuredContent"].is_null() {
            self.fail(step, "a refusal should carry no structuredContent".into());
        }
        let Some(envelope) = self.envelope(step, line, status) else { return };
        let texts: Vec<&str> =
            line["content"].as_array().into_iter().flatten().filter_map(|b| b["text"].as_str()).collect();
        let first_says = texts.first().is_some_and(|t| {
            [&envelope["meaning"], &envelope["instruction"]].iter().all(|f| f.as_str().is_some_and(|f| t.contains(f)))
        });
        if !first_says {
            self.fail(step, "the first text block should say the envelope's meaning and instruction".into());
        }
        if texts.get(1).and_then(|t| serde_json::from_str::<Value>(t).ok()).as_ref() != Some(&envelope) {
            self.fail(step, "the second text block should be the envelope as JSON".into());
        }
    }
}

/// One SDK on one endpoint: every scenario, every step judged, then the ledger.
async fn sdk_against_the_gateway(sdk: Sdk, path: &str) -> TestResult {
    installed(sdk)?;
    let Some(opts) = real_stores(true)? else { return Ok(()) };
    let stack = Stack::start(opts).await?;
    let lines = run_driver(sdk, &stack.url(path)).await?;
    // nextest shows this only for a failing test, or with --no-capture.
    for line in &lines {
        eprintln!("{line}");
    }
    let mut j = Judge::new(format!("{sdk:?} on {path}"), &lines);

    for step in ["initialize", "validation_armed", "done"] {
        j.accepted(step);
    }
    if let Some(list) = j.accepted("list_tools") {
        for tool in ["quote_transfer", "execute_transfer", "get_transfer_status"] {
            if list["tools"][tool] != true {
                j.fail("list_tools", format!("{tool} should be listed with its outputSchema"));
            }
        }
        // The confirm tool's schema as the client cached it: the demo's strict record, plus the
        // gateway's optional property; the other tools' as the demo wrote them.
        let execute = &list["schemas"]["execute_transfer"];
        let strict = execute["additionalProperties"] == false
            && execute["required"].as_array().is_some_and(|r| !r.iter().any(|f| f == REPLAY_PROPERTY));
        if !strict || execute["properties"][REPLAY_PROPERTY]["type"] != "object" {
            j.fail("list_tools", format!("execute_transfer's outputSchema should be strict and declare an optional {REPLAY_PROPERTY}: {execute}"));
        }
        for tool in ["quote_transfer", "get_transfer_status"] {
            if !list["schemas"][tool]["properties"][REPLAY_PROPERTY].is_null() {
                j.fail("list_tools", format!("{tool} is not a confirm tool: its schema is the demo's"));
            }
        }
    }

    let fp = j.preview("quote");
    let original = j.executed("execute");
    j.replay("replay", original);
    j.report("status_done", "already_completed");
    for status in ["params_changed", "fingerprint_missing", "fingerprint_invalid", "forbidden"] {
        j.refusal(status, status);
    }

    let fp2 = j.preview("quote_slow");
    j.report("status_in_flight", "in_progress");
    j.refusal("in_progress", "in_progress");
    j.executed("execute_slow");

    let fp3 = j.preview("quote_503");
    j.refusal("not_executed", "not_executed");
    j.executed("execute_after_503");

    let fp5 = j.preview("quote_over_limit");
    j.upstream_refusal("execute_over_limit", "limit_exceeded");
    j.failed_replay("replay_failed");
    j.report("status_failed", "already_failed");

    // The upstream leaves its outputSchema: a quote without quote_id is refused by both SDKs (the gateway
    // adds its fingerprint, it does not mend the upstream's answer); a refusal whose structuredContent is
    // the error body is refused by the TypeScript SDK only (it validates errors' structuredContent too).
    j.rejected("off_schema_quote", "quote_id");
    let fp6 = j.preview("quote_off_schema");
    match sdk {
        Sdk::Node => j.rejected("execute_off_schema", "-32602"),
        Sdk::Python | Sdk::PythonDiscover => {
            if j.accepted("execute_off_schema").is_some_and(|l| l["isError"] != true) {
                j.fail("execute_off_schema", "the upstream's refusal should be isError: true".into());
            }
        }
    }
    // Its replay is the gateway's: no structuredContent, whatever the recorded result carried.
    j.failed_replay("replay_failed_off_schema");

    let fp4 = j.preview("quote_unused");
    j.report("status_not_yet", "not_executed");

    // Approval (the tool's rule: amount 7777.77): an error result the SDKs accept; the status tool reports it.
    let fp7 = j.preview("quote_approval");
    j.refusal("execute_approval", "approval_required");
    j.report("status_approval", "awaiting_approval");

    // The ledger: one execution per executed fingerprint, none for the unused one, nothing else.
    let ledger = stack.executions().await?;
    for (name, fp) in [("quote", &fp), ("quote_slow", &fp2), ("quote_503", &fp3)] {
        let Some(fp) = fp else { continue };
        let nonce = nonce_of(fp)?;
        if ledger["by_key"][&nonce] != 1 {
            j.failures.push(format!("{} {name}: its fingerprint should have executed exactly once: {ledger}", j.label));
        }
        // The duplicate never reached the tool; the 503 was the transport's, before the tool.
        if ledger["attempts_by_key"][&nonce] != 1 {
            j.failures.push(format!("{} {name}: one attempt reached the tool: {ledger}", j.label));
        }
    }
    for (name, fp) in [("quote_unused", &fp4), ("quote_approval", &fp7)] {
        let Some(fp) = fp else { continue };
        let nonce = nonce_of(fp)?;
        if !ledger["by_key"][&nonce].is_null() || !ledger["attempts_by_key"][&nonce].is_null() {
            j.failures.push(format!("{} {name}: its fingerprint reached the tool: {ledger}", j.label));
        }
    }
    // Refused by the upstream once; the retry was answered by the gateway.
    for (name, fp) in [("quote_over_limit", &fp5), ("quote_off_schema", &fp6)] {
        let Some(fp) = fp else { continue };
        let nonce = nonce_of(fp)?;
        if !ledger["by_key"][&nonce].is_null() || ledger["attempts_by_key"][&nonce] != 1 {
            j.failures.push(format!("{} {name}: one attempt, no execution: {ledger}", j.label));
        }
    }
    if ledger["total"] != 3 {
        j.failures.push(format!("{}: three executions in all, nothing from the refusals: {ledger}", j.label));
    }
    // params_changed and forbidden are security events (DESIGN §8).
    let security = stack.stat("wasmcustom.idem.security_events").await?;
    if security < 2 {
        j.failures.push(format!("{}: security_events is {security}, params_changed and forbidden make 2", j.label));
    }

    // The driver's lines are above.
    if !j.failures.is_empty() {
        panic!("{} step(s) wrong:\n{}", j.failures.len(), j.failures.join("\n"));
    }
    Ok(())
}

#[tokio::test]
async fn the_python_sdk_accepts_every_answer_json() -> TestResult {
    sdk_against_the_gateway(Sdk::Python, "/mcp").await
}

#[tokio::test]
async fn the_python_sdk_accepts_every_answer_sse() -> TestResult {
    sdk_against_the_gateway(Sdk::Python, "/mcp/stream").await
}

#[tokio::test]
async fn the_typescript_sdk_accepts_every_answer_json() -> TestResult {
    sdk_against_the_gateway(Sdk::Node, "/mcp").await
}

#[tokio::test]
async fn the_typescript_sdk_accepts_every_answer_sse() -> TestResult {
    sdk_against_the_gateway(Sdk::Node, "/mcp/stream").await
}

#[tokio::test]
async fn the_python_sdk_accepts_every_answer_discover_json() -> TestResult {
    sdk_against_the_gateway(Sdk::PythonDiscover, "/mcp").await
}

#[tokio::test]
async fn the_python_sdk_accepts_every_answer_discover_sse() -> TestResult {
    sdk_against_the_gateway(Sdk::PythonDiscover, "/mcp/stream").await
}
