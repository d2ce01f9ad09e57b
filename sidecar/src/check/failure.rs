//! What Envoy itself answers when the filter cannot (DESIGN §6: every host fails closed; §7: every
//! reply to an agent is the envelope), read from the Envoy configuration:
//!
//! * `local-reply`: an answer the filter holds (to record it before the agent sees it) that the
//!   upstream then cuts or resets goes out as Envoy's own local reply, straight to the client and
//!   past every filter. The connection manager must map those replies (response flags UR, UC, UPE,
//!   UT) to the §7 `in_progress` envelope, or the agent reads text/plain about an operation that may
//!   have run, and runs it again. On the ext_proc host, Envoy's ext_proc filter answers for idemd
//!   when idemd cannot be reached, breaks the stream or times out (500 or 504, no response flag, the
//!   code details `ext_proc_error_…`), at any point of the stream: before the request went on, or
//!   after the upstream ran it. Those replies must be mapped to the §7 `status_unavailable` envelope
//!   ("could not check; it may or may not have run"; a mapper with the CEL filter
//!   `response.code_details.startsWith('ext_proc_error')`): not `in_progress`, which would tell an
//!   agent the operation is under way when nothing may hold it.
//! * `wasm-reload`: a `.wasm` VM that traps fails its stream; `failure_policy: FAIL_RELOAD` gives
//!   the next request a fresh VM. FAIL_CLOSED (the default) answers 503 to every request of that
//!   worker until a restart; FAIL_OPEN (or `fail_open: true`) passes requests unguarded. The native
//!   module has no VM: its hooks refuse a stream they cannot serve, and this rule does not apply.

use super::Rule;
use super::{Finding, Inputs};
use serde_json::Value;

/// The response flags of Envoy's own reply to an answer cut after its headers.
const CUT_FLAGS: [&str; 4] = ["UR", "UC", "UPE", "UT"];

/// The code details of every reply Envoy's ext_proc filter makes when its processor fails.
const EXT_PROC_ERROR: &str = "ext_proc_error";

/// Why the connection manager `hcm` does not answer a cut answer with the envelope (`None`: it does);
/// `ext_proc`: its agent filter is Envoy's ext_proc filter, whose own failure replies count as cuts.
pub fn local_reply_gap(hcm: &Value, ext_proc: bool) -> Option<String> {
    let Some(config) = hcm.get("local_reply_config") else {
        return Some("no `local_reply_config`".into());
    };
    let mappers = config.get("mappers").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
    fn flags(m: &Value) -> Vec<&str> {
        let list = m.pointer("/filter/response_flag_filter/flags").and_then(Value::as_array);
        list.into_iter().flatten().filter_map(Value::as_str).collect()
    }
    // Envoy applies the first mapper whose filter matches: a cut must reach an envelope mapper first.
    let first = |flag: &str| mappers.iter().find(|m| flags(m).contains(&flag) || m.get("filter").is_none());
    let missing: Vec<&str> =
        CUT_FLAGS.iter().copied().filter(|f| !first(f).is_some_and(|m| answers(m, "in_progress", None))).collect();
    if !missing.is_empty() {
        return Some(format!(
            "`local_reply_config` answers Envoy's own replies with response flags {} otherwise than with the §7 \
             `in_progress` envelope (a mapper with `response_flag_filter: {{ flags: [UR, UC, UPE, UT] }}` and \
             `body_format_override.json_format.status: in_progress`)",
            missing.join(", ")
        ));
    }
    // The ext_proc filter's own replies carry no flag: only a CEL filter over the code details finds them.
    let cel = |m: &Value| {
        let expression = m.pointer("/filter/extension_filter/typed_config/expression").and_then(Value::as_str);
        expression.is_some_and(|e| e.contains(EXT_PROC_ERROR))
    };
    let first_error = mappers.iter().find(|m| cel(m) || m.get("filter").is_none());
    if ext_proc && !first_error.is_some_and(|m| answers(m, "status_unavailable", Some(503))) {
        return Some(
            "`local_reply_config` answers the ext_proc filter's own replies (idemd unreachable, its stream broken or \
             timed out: code details `ext_proc_error_…`, no response flag) otherwise than with the §7 \
             `status_unavailable` envelope (a mapper whose `extension_filter` is the CEL filter \
             `response.code_details.startsWith('ext_proc_error')`, with `status_code: 503` and \
             `body_format_override.json_format.status: status_unavailable`)"
                .into(),
        );
    }
    None
}

/// Whether the mapper `m` answers with the §7 envelope of `status` (and, where given, the HTTP
/// status `code`; unset keeps Envoy's own).
fn answers(m: &Value, status: &str, code: Option<u64>) -> bool {
    let word = m.pointer("/body_format_override/json_format/status").and_then(Value::as_str);
    word == Some(status) && code.is_none_or(|c| m.get("status_code").and_then(Value::as_u64) == Some(c))
}

/// What the agent filter's entry `entry` does when its VM fails: `None` for the native module (no
/// VM), else the policy in effect (`fail_open: true` is FAIL_OPEN; unset is Envoy's FAIL_CLOSED).
pub fn vm_failure(entry: &Value) -> Option<String> {
    let config = entry.pointer("/typed_config/config")?;
    if config.get("fail_open").and_then(Value::as_bool) == Some(true) {
        return Some("FAIL_OPEN".into());
    }
    let policy = config.get("failure_policy").and_then(Value::as_str).unwrap_or("FAIL_CLOSED");
    Some(policy.to_string())
}

pub fn local_reply(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    for m in input.envoy.managers.iter().filter(|m| m.filter.is_some()) {
        if let Some(gap) = &m.local_reply_gap {
            out.push(rule.finding(
                &m.at,
                format!(
                    "runs the agent filter with {gap}: an answer the upstream cuts after the filter holds it reaches \
                     the agent as Envoy's text/plain, about an operation that may have run"
                ),
            ));
        }
    }
}

pub fn wasm_reload(rule: &Rule, input: &Inputs, out: &mut Vec<Finding>) {
    for m in &input.envoy.managers {
        let Some(policy) = m.filter.as_ref().and_then(|f| f.vm_failure.as_deref()) else { continue };
        let why = match policy {
            "FAIL_RELOAD" => continue,
            "FAIL_OPEN" => "passes every request unguarded once the VM failed",
            _ => "answers 503 to every request of that worker once its VM failed, until Envoy restarts",
        };
        out.push(rule.finding(
            &m.at,
            format!("runs the agent `.wasm` with `failure_policy: {policy}`, which {why}; set FAIL_RELOAD"),
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{findings, flags, hcm, Fixture, CONFIRM_ROUTE as ROUTES};

    fn mapped(flags: &str, status: &str) -> String {
        format!(
            "local_reply_config:\n  mappers:\n  - filter:\n      response_flag_filter: {{ flags: [{flags}] }}\n    \
             body_format_override:\n      json_format: {{ status: {status}, trace_id: \"%REQ(X-REQUEST-ID)%\" }}\n"
        )
    }

    #[test]
    fn a_manager_without_the_envelope_for_cut_answers_is_refused() {
        let mut fixture = Fixture::new(ROUTES);
        let none = findings(&fixture, &flags(), "local-reply");
        assert_eq!(none.len(), 1, "{none:?}");
        assert!(none[0].contains("no `local_reply_config`"), "{none:?}");

        fixture.hcm = hcm(&mapped("UR, UC", "in_progress"));
        let partial = findings(&fixture, &flags(), "local-reply");
        assert!(partial.len() == 1 && partial[0].contains("flags UPE, UT"), "{partial:?}");

        fixture.hcm = hcm(&mapped("UR, UC, UPE, UT", "not_executed"));
        assert_eq!(findings(&fixture, &flags(), "local-reply").len(), 1, "a cut is never `not_executed`");

        fixture.hcm = hcm(&mapped("UR, UC, UPE, UT", "in_progress"));
        assert!(findings(&fixture, &flags(), "local-reply").is_empty());
    }

    /// Behind the ext_proc filter, its own failure replies (no flag, `ext_proc_error_…`) need the
    /// envelope too; a configuration of the other hosts does not.
    #[test]
    fn an_ext_proc_manager_without_the_envelope_for_the_processors_failure_is_refused() {
        let flagged = serde_json::json!({"mappers": [{
            "filter": {"response_flag_filter": {"flags": ["UR", "UC", "UPE", "UT"]}},
            "body_format_override": {"json_format": {"status": "in_progress"}}
        }]});
        let cel = |status: &str, expression: &str| {
            serde_json::json!({
                "filter": {"extension_filter": {
                    "name": "envoy.access_loggers.extension_filters.cel",
                    "typed_config": {"expression": expression}
                }},
                "status_code": 503,
                "body_format_override": {"json_format": {"status": status}}
            })
        };
        let with = |extra: Option<serde_json::Value>| {
            let mut config = flagged.clone();
            if let (Some(m), Some(list)) = (extra, config["mappers"].as_array_mut()) {
                list.insert(0, m);
            }
            serde_json::json!({ "local_reply_config": config })
        };
        assert_eq!(super::local_reply_gap(&with(None), false), None, "the filters' hosts need no more");
        let gap = super::local_reply_gap(&with(None), true);
        assert!(gap.as_deref().is_some_and(|g| g.contains("ext_proc_error")), "{gap:?}");
        let expression = "response.code_details.startsWith('ext_proc_error')";
        let wrong = super::local_reply_gap(&with(Some(cel("not_executed", expression))), true);
        assert!(wrong.is_some(), "a processor's failure is never `not_executed`");
        let pending = super::local_reply_gap(&with(Some(cel("in_progress", expression))), true);
        assert!(pending.is_some(), "nor `in_progress`: nothing may hold the operation");
        let other = super::local_reply_gap(&with(Some(cel("status_unavailable", "response.code == 500"))), true);
        assert!(other.is_some(), "a mapper that does not name the processor's failure");
        let mut as_500 = cel("status_unavailable", expression);
        as_500["status_code"] = 500.into();
        assert!(super::local_reply_gap(&with(Some(as_500)), true).is_some(), "the envelope is §7's 503");
        assert_eq!(super::local_reply_gap(&with(Some(cel("status_unavailable", expression))), true), None);
    }

    #[test]
    fn a_wasm_that_does_not_reload_its_vm_is_refused() {
        let fixture = Fixture::new(ROUTES);
        let closed = findings(&fixture, &flags(), "wasm-reload");
        assert!(closed.len() == 1 && closed[0].contains("FAIL_CLOSED"), "the default: {closed:?}");
        let yaml = fixture.yaml();
        for (line, policy) in [("fail_open: true", "FAIL_OPEN"), ("failure_policy: FAIL_RELOAD", "")] {
            let edited = yaml.replace(
                "root_id: agent_idempotency\n",
                &format!("root_id: agent_idempotency\n{}{line}\n", " ".repeat(16)),
            );
            assert_ne!(edited, yaml);
            let report = super::super::check_envoy("test.yaml", &edited, &flags(), None).map_err(|e| e.to_string());
            let found: Vec<String> = report
                .map(|r| r.findings.into_iter().filter(|f| f.rule == "wasm-reload").map(|f| f.message).collect())
                .unwrap_or_else(|e| vec![e]);
            if policy.is_empty() {
                assert!(found.is_empty(), "{line}: {found:?}");
            } else {
                assert!(found.len() == 1 && found[0].contains(policy), "{line}: {found:?}");
            }
        }
    }
}
