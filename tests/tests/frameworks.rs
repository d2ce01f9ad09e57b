//! Real agent frameworks show the model what happened (DESIGN §7, §11). An agent never reads the
//! wire: it reads what its framework hands the model. tests/frameworks/agent.py drives pydantic-ai
//! (`pydantic-ai-slim`, a `FunctionModel`, its default and `tool_error_behavior='failed'`) and the
//! OpenAI Agents SDK (`openai-agents`, a scripted `Model`, `use_structured_content` off and on) and
//! LangGraph's prebuilt agent over langchain-mcp-adapters (a scripted chat model)
//! through their own MCP clients against the guarded demo, on `/mcp` (JSON answers) and
//! `/mcp/stream` (SSE-framed answers), each client choosing its transport as it does for a user
//! (pydantic-ai infers it from the URL), and prints what each framework put in front of the model
//! for every call. This file judges it: every gateway answer's status and instruction reach the
//! model, a replay never reads as a fresh execution (with `use_structured_content=True` the
//! envelope rides in the `agent_idempotency` property the gateway declared in the tool's
//! `outputSchema`), the run goes on, and the demo's ledger shows one execution per fingerprint.
//! Pinned in tests/mcp-sdk/requirements.txt (and LangGraph's, which needs the MCP SDK 1.x, in
//! tests/frameworks/requirements-langchain.txt); `make mcp-sdk` installs them into `.venv` (and
//! `.venv-langchain`).

use idem_e2e::*;
use serde_json::Value;
use std::collections::HashMap;
use std::process::Stdio;
use std::time::Duration;

/// Where a framework is installed: its venv, its pins, and the distributions (with the module
/// each is imported as) whose versions must be the pinned ones.
struct Install {
    venv: &'static str,
    pins: &'static str,
    dists: &'static [(&'static str, &'static str)],
}

fn install(framework: &str) -> Install {
    if framework == "langgraph" {
        Install {
            venv: ".venv-langchain",
            pins: "tests/frameworks/requirements-langchain.txt",
            dists: &[("langgraph", "langgraph"), ("langchain-mcp-adapters", "langchain_mcp_adapters"), ("mcp", "mcp")],
        }
    } else {
        Install {
            venv: ".venv",
            pins: "tests/mcp-sdk/requirements.txt",
            dists: &[("pydantic-ai-slim", "pydantic_ai"), ("openai-agents", "agents")],
        }
    }
}

/// The framework's lines, after checking it is installed as pinned.
async fn run_agent(framework: &str, url: &str) -> Result<Vec<Value>, BoxError> {
    let Install { venv, pins: pins_file, dists } = install(framework);
    let hint = format!("run `make mcp-sdk` (it installs {pins_file} into {venv})");
    let python = repo_root().join(venv).join("bin/python");
    let pins = std::fs::read_to_string(repo_root().join(pins_file))?;
    for &(dist, module) in dists {
        let want = pins
            .lines()
            .find_map(|l| l.split_once("==").filter(|(n, _)| n.split('[').next() == Some(dist)).map(|(_, v)| v.trim()))
            .ok_or_else(|| format!("{pins_file} pins no {dist}"))?;
        let out = std::process::Command::new(&python)
            .args(["-c", &format!("import {module}, importlib.metadata as m; print(m.version('{dist}'))")])
            .output()
            .map_err(|e| format!("{}: {e}: {hint}", python.display()))?;
        let have = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if !out.status.success() || have != want {
            return Err(format!("{dist} {want} is not installed in {venv} (found {have:?}): {hint}").into());
        }
    }
    let mut cmd = tokio::process::Command::new(python);
    cmd.arg(repo_root().join("tests/frameworks/agent.py")).arg(framework).arg(url);
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(240), cmd.output())
        .await
        .map_err(|_| format!("{framework}: the agent did not finish in 240 s"))??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<Value> = stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).map_err(|e| format!("{framework}: not JSON ({e}): {l}")))
        .collect::<Result<_, _>>()?;
    if !out.status.success() {
        return Err(format!(
            "{framework}: the agent exited {}:\n{stdout}\nstderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    Ok(lines)
}

/// What the model was shown at each step, judged.
struct Seen<'a> {
    label: String,
    steps: HashMap<&'a str, &'a Value>,
    failures: Vec<String>,
}

impl<'a> Seen<'a> {
    fn new(label: String, lines: &'a [Value]) -> Self {
        Seen { label, steps: lines.iter().filter_map(|l| Some((l["step"].as_str()?, l))).collect(), failures: vec![] }
    }

    /// The text the model saw, if the run went on.
    fn ran(&mut self, step: &str) -> Option<&'a str> {
        let Some(line) = self.steps.get(step).copied() else {
            self.failures.push(format!("{} {step}: the agent never got here", self.label));
            return None;
        };
        if line["ran"] != true {
            self.failures.push(format!("{} {step}: the framework ended the run: {}", self.label, line["error"]));
            return None;
        }
        line["seen"].as_str()
    }

    /// The model saw every one of `words`.
    fn shows(&mut self, step: &str, words: &[&str]) {
        let Some(seen) = self.ran(step) else { return };
        let missing: Vec<&&str> = words.iter().filter(|w| !seen.contains(**w)).collect();
        if !missing.is_empty() {
            self.failures.push(format!("{} {step}: the model never saw {missing:?}; it saw:\n    {seen}", self.label));
        }
    }

    /// A gateway answer: its status and an instruction (the §7 envelope's, in words the model reads).
    fn answer(&mut self, step: &str, status: &str) {
        self.shows(step, &[status, "instruction"]);
    }

    /// A first execution: the upstream's record, and nothing that says "already".
    fn fresh(&mut self, step: &str) {
        self.shows(step, &["transfer_id"]);
        if self.steps.get(step).and_then(|l| l["seen"].as_str()).is_some_and(|s| s.contains("already_")) {
            self.failures.push(format!("{} {step}: a first execution reads as a replay", self.label));
        }
    }
}

async fn framework_against_the_gateway(framework: &str, path: &str) -> TestResult {
    let Some(opts) = real_stores(true)? else { return Ok(()) };
    let stack = Stack::start(opts).await?;
    let lines = run_agent(framework, &stack.url(path)).await?;
    for line in &lines {
        eprintln!("{line}");
    }
    let mut s = Seen::new(format!("{framework} on {path}"), &lines);
    // The fingerprint is in what the model reads (a field of the quote, or the gateway's line).
    for step in ["quote", "quote_slow", "quote_503", "quote_over_limit", "quote_brief"] {
        s.shows(step, &["fingerprint"]);
    }
    s.fresh("execute");
    // A replay: the original record and the gateway's word that it did not run again.
    for step in ["replan", "context_loss"] {
        s.shows(step, &["transfer_id", "already_completed", "instruction"]);
    }
    s.answer("tamper", "params_changed");
    s.answer("in_progress", "in_progress");
    s.fresh("execute_slow");
    if framework == "pydantic-ai" {
        // Its default turns every `isError` into a ModelRetry against the tool's budget (1): a second
        // refusal in one run ends it. MCP lets a tool with an outputSchema answer without a result only
        // as an error, so the guard cannot answer otherwise; docs/agents.md asks money-moving tools for
        // `tool_error_behavior='failed'` (which the other configuration runs). This proves that advice.
        for step in ["not_executed_twice", "failure_then_replay"] {
            let ended = s.steps.get(step).is_some_and(|l| {
                l["ran"] == false && l["error"].as_str().is_some_and(|e| e.contains("exceeded max retries"))
            });
            if !ended {
                s.failures.push(format!("{} {step}: docs/agents.md says the default ends this run", s.label));
            }
        }
    } else {
        // Twice in one run, as told: the run goes on, and the model read both.
        s.answer("not_executed_twice", "not_executed");
        let read = s.steps.get("not_executed_twice").and_then(|l| l["seen"].as_str());
        if read.map(|t| t.matches("not_executed").count()) < Some(2) {
            s.failures.push(format!("{} not_executed_twice: the model did not read both answers", s.label));
        }
        s.shows("failure_then_replay", &["limit_exceeded", "already_failed", "instruction"]);
    }
    s.fresh("execute_after_503");
    s.shows("server_failure", &["limit_exceeded"]);
    s.answer("failure_replay", "already_failed");
    s.answer("expired", "fingerprint_expired");
    s.answer("forbidden", "forbidden");
    s.ran("done");

    // One execution per fingerprint: the replays, the duplicate and the refusals ran nothing.
    let ledger = stack.executions().await?;
    if ledger["total"] != 3 {
        s.failures.push(format!("{}: three executions in all: {ledger}", s.label));
    }
    if let Some(counts) = ledger["by_key"].as_object() {
        if counts.values().any(|n| n != 1) {
            s.failures.push(format!("{}: a fingerprint executed more than once: {ledger}", s.label));
        }
    }
    if !s.failures.is_empty() {
        panic!("{} step(s) wrong:\n{}", s.failures.len(), s.failures.join("\n"));
    }
    Ok(())
}

macro_rules! frameworks {
    ($($name:ident: $framework:literal on $path:literal;)*) => {$(
        #[tokio::test]
        async fn $name() -> TestResult {
            framework_against_the_gateway($framework, $path).await
        }
    )*};
}

frameworks! {
    pydantic_ai_failed_json: "pydantic-ai-failed" on "/mcp";
    pydantic_ai_failed_stream: "pydantic-ai-failed" on "/mcp/stream";
    pydantic_ai_default_json: "pydantic-ai" on "/mcp";
    pydantic_ai_default_stream: "pydantic-ai" on "/mcp/stream";
    openai_agents_json: "openai-agents" on "/mcp";
    openai_agents_stream: "openai-agents" on "/mcp/stream";
    openai_agents_structured_json: "openai-agents-structured" on "/mcp";
    openai_agents_structured_stream: "openai-agents-structured" on "/mcp/stream";
    langgraph_json: "langgraph" on "/mcp";
    langgraph_stream: "langgraph" on "/mcp/stream";
}
