//! The `response` target: the answer path of every REST role, as a host drives it
//! (`adapter/src/stream.rs`): the upstream's header map as bytes (`ResponseHead::from_headers`,
//! names and values the fuzzer's, repeats and bytes that are not UTF-8 included), then its body in
//! chunks, into a preview (plain, a quote expiry in a header, a quote expiry in the body), a
//! forwarded confirm and a status lookup (nothing an upstream sends may panic the filter: DESIGN §6).
//!
//! Input: `[role, flags, header count, (name len, name, value len, value)*, body…]`.
//!
//! What must hold, beyond "no panic": the headers step never asks for the body to be replaced (a
//! body is replaced only from a body callback: asked from the headers one, the `.wasm`'s host call
//! failed and the SDK panicked the VM); a quote header that is not exactly one readable value never
//! mints; and no answer that goes out carries a top-level field of the upstream's that names the
//! gateway's fingerprint.

use idem_core::machine::splice::names_field;
use idem_core::machine::{CalloutAnswer, Counter, Effect, Flow, Machine, RequestHead, ResponseHead, Step};
use idem_core::testing::{self, FixedEnv};
use serde_json::{json, Value};
use std::rc::Rc;

const NOW: u64 = 1_800_000_000;
const SECRET: &str = "0123456789abcdef0123456789abcdef";
const OWNER: &str = "22222222222222222222222222222222";
const QUOTE_HEADER: &str = "quote-expires-at";

pub fn response(data: &[u8]) {
    let mut bytes = data.iter().copied();
    let (Some(role), Some(flags), Some(count)) = (bytes.next(), bytes.next(), bytes.next()) else { return };
    let mut rest: Vec<u8> = bytes.collect();
    let mut headers = vec![(":status".to_string(), status_for(flags).to_vec())];
    if flags & 0x10 == 0 {
        headers.push(("content-type".into(), b"application/json".to_vec()));
    }
    for _ in 0..(count % 8) {
        let Some((name, tail)) = take(&rest) else { break };
        let Some((value, tail)) = take(tail) else { break };
        // A name from a small set (the guard's and some others), so repeats meet: the byte picks it.
        let name = match name.first().copied().unwrap_or(0) % 6 {
            0 => QUOTE_HEADER.to_string(),
            1 => "content-type".into(),
            2 => "content-length".into(),
            3 => "content-encoding".into(),
            4 => "retry-after".into(),
            _ => String::from_utf8_lossy(name).to_ascii_lowercase(),
        };
        headers.push((name, value.to_vec()));
        rest = tail.to_vec();
    }
    let body = rest;
    let eos_at_head = flags & 0x20 != 0;
    let leaves: &[(&str, &str)] = match role % 5 {
        0 => &[("role", "preview"), ("scope", "pay"), ("bind", "/amount")],
        1 => {
            &[("role", "preview"), ("scope", "pay"), ("bind", "/amount"), ("quote_expires", "header:quote-expires-at")]
        }
        2 => &[("role", "preview"), ("scope", "pay"), ("bind", "/amount"), ("quote_expires", "/expires_at")],
        3 => &[
            ("role", "confirm"),
            ("upstream_keys", "honoured"),
            ("scope", "pay"),
            ("bind", "/amount"),
            ("status_tool", "s"),
            ("result_ref", "/id"),
        ],
        _ => &[("role", "status"), ("scope", "pay"), ("status_tool", "s"), ("result_ref", "/id")],
    };
    let Ok(config) = testing::plugin_config(SECRET, r#""max_response_bytes":1024"#) else { return };
    let Ok(policy) = testing::route(leaves) else { return };
    let ctx = testing::ctx(&config, &policy, "trace-fuzz");
    let mut env = FixedEnv::at(NOW, [0x11; 16]);
    let mut machine = match forwarded(ctx, &config, &mut env) {
        Some(m) => m,
        None => return,
    };
    let head = ResponseHead::from_headers(&headers, machine.response_needs_headers(), machine.response_needs_framing());
    let quote_values = headers.iter().filter(|(k, _)| k == QUOTE_HEADER).count();
    let quote_role = role % 5 == 1;
    let Ok(step) = machine.on_response_head(&head, eos_at_head, &mut env) else { return };
    assert!(!touches_body(&step), "the headers step replaces the body: {step:?}");
    assert!(!(quote_role && quote_values != 1 && minted(&step)), "minted on {quote_values} quote headers");
    let token = token_of(&step);
    if eos_at_head || matches!(machine, Machine::Pass) {
        return;
    }
    // The body in two chunks, each as the host hands it over: what is held stays in the buffer
    // until the machine asks for it, what goes on is what the agent gets.
    let cut = usize::from(flags) % (body.len() + 1);
    let (mut out, mut start) = (Vec::new(), 0);
    for (end, last) in [(cut, false), (body.len(), true)] {
        let Ok(step) = machine.on_response_data(end, last) else { return };
        let step = match step.flow {
            Flow::Pause => continue,
            Flow::Continue => step,
            Flow::NeedBody => match machine.on_response_body(&body[start..end], &mut env) {
                Ok(s) => s,
                Err(_) => return,
            },
        };
        assert!(!(quote_role && quote_values != 1 && minted(&step)), "minted on {quote_values} quote headers");
        let given = &body[start..end];
        start = end;
        match step.effects.iter().rev().find_map(replaced) {
            Some((true, whole)) => out = whole,
            Some((false, part)) => out.extend_from_slice(&part),
            None => out.extend_from_slice(given),
        }
        if matches!(machine, Machine::Pass) {
            break;
        }
    }
    if start < body.len() && matches!(machine, Machine::Pass) {
        out.extend_from_slice(&body[start..]);
    }
    if let Some(token) = token {
        check_out(&token, &out);
    }
    let _ = machine.on_callout(&CalloutAnswer::failed(), &mut env);
}

/// A length-prefixed slice and what follows it.
fn take(data: &[u8]) -> Option<(&[u8], &[u8])> {
    let (&n, tail) = data.split_first()?;
    let n = usize::from(n % 32).min(tail.len());
    Some(tail.split_at(n))
}

fn status_for(flags: u8) -> &'static [u8] {
    match flags % 4 {
        0 | 1 => b"200",
        2 => b"503",
        _ => b"4x2",
    }
}

/// The machine of `ctx`'s role with its request forwarded: a preview's body read, a confirm
/// acquired, a status lookup answered by idemd with a 404 (its answer then passes).
fn forwarded(
    ctx: idem_core::machine::Ctx,
    config: &Rc<idem_core::policy::PluginConfig>,
    env: &mut FixedEnv,
) -> Option<Machine> {
    let role = ctx.policy.role;
    let body = json!({"amount": "10.00"});
    let fingerprint = {
        let p = idem_core::canonical::param_hash(&body, &ctx.policy.bound).ok()?;
        let subject = idem_core::fingerprint::subject_hash("alice");
        idem_core::fingerprint::mint(&config.keyring, [0x22; 16], NOW + 300, &subject, &ctx.policy.scope, &p)
    };
    let head = RequestHead {
        subject: Some("alice".into()),
        fingerprint: Some(fingerprint),
        path: "/x".into(),
        method: "POST".into(),
        ..RequestHead::default()
    };
    let (mut machine, _) = Machine::start(ctx, &head, false, env);
    machine.on_request_data(16, true);
    let step = machine.on_request_body(body.to_string().as_bytes(), env).ok()?;
    if matches!(role, idem_core::policy::Role::Confirm) {
        let acquired = json!({"outcome": "ACQUIRED", "owner": OWNER});
        let answer = CalloutAnswer { status: Some(200), body: acquired.to_string().into_bytes() };
        machine.on_callout(&answer, env).ok()?;
    } else if step.effects.iter().any(|e| matches!(e, Effect::Call(_))) {
        let answer = CalloutAnswer { status: Some(404), body: b"{}".to_vec() };
        machine.on_callout(&answer, env).ok()?;
    }
    Some(machine)
}

fn touches_body(step: &Step) -> bool {
    step.effects.iter().any(|e| matches!(e, Effect::Rewrite(_) | Effect::ReplaceResponseBody(_)))
}

fn minted(step: &Step) -> bool {
    step.effects.contains(&Effect::Count(Counter::Minted))
}

/// What a step puts in the body's place: `(true, …)` the whole answer, `(false, …)` this chunk.
fn replaced(e: &Effect) -> Option<(bool, Vec<u8>)> {
    match e {
        Effect::Rewrite(r) => Some((true, r.body.clone())),
        Effect::ReplaceResponseBody(b) => Some((false, b.clone())),
        _ => None,
    }
}

fn token_of(step: &Step) -> Option<String> {
    step.effects.iter().find_map(|e| match e {
        Effect::SetResponseHeader(k, v) if k == "agent-fingerprint" => Some(v.clone()),
        _ => None,
    })
}

/// A JSON object going out carries no field of the upstream's naming the fingerprint: the only
/// ones are the gateway's (its token, and a number for its expiry).
fn check_out(token: &str, out: &[u8]) {
    if let Ok(Value::Object(o)) = serde_json::from_slice::<Value>(out) {
        for (k, v) in &o {
            if names_field(k) {
                let ours = v.as_str() == Some(token) || v.is_u64();
                assert!(ours, "the upstream's {k}: {v} went out beside the gateway's fingerprint");
            }
        }
    }
}
