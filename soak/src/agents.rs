//! Simulated agents: each draws its operations from its own seeded RNG (the
//! same seed gives every agent the same sequence of plans, whatever the
//! timing) and plays them through Envoy: preview → confirm, retries with a
//! drifted memo, duplicate confirms racing, status polls, late retries after
//! `exp`, tampered amounts and someone else's fingerprint.

use crate::record::{classify, definite, since_ms, unix_ms, Event, HostileOp, Op, QuoteRead, Reply, Req, Violation};
use crate::World;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Everything the agents and the fault task share.
pub struct Ctx {
    pub http: reqwest::Client,
    /// Envoy's listener, `http://127.0.0.1:N`.
    pub base: String,
    pub start: Instant,
    /// No new operation starts after this.
    pub deadline: Instant,
    /// While `since_ms(start) < slow_until_ms`, confirms ask the demo to answer slowly.
    pub slow_until_ms: AtomicU64,
    /// Which agents meet the hostile upstream.
    pub world: World,
    next_op: AtomicUsize,
    pub log: Mutex<Log>,
}

#[derive(Default)]
pub struct Log {
    pub events: Vec<Event>,
    pub ops: Vec<Op>,
    pub violations: Vec<Violation>,
    pub previews_failed: u64,
}

impl Ctx {
    pub fn new(base: String, start: Instant, deadline: Instant, world: World) -> Result<Ctx, reqwest::Error> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .pool_idle_timeout(Duration::from_secs(2))
            .build()?;
        Ok(Ctx {
            http,
            base,
            start,
            deadline,
            slow_until_ms: AtomicU64::new(0),
            world,
            next_op: AtomicUsize::new(0),
            log: Mutex::new(Log::default()),
        })
    }

    fn slow(&self) -> bool {
        since_ms(self.start) < self.slow_until_ms.load(Ordering::Relaxed)
    }

    pub fn violation(&self, kind: &'static str, detail: String) {
        if let Ok(mut log) = self.log.lock() {
            log.violations.push(Violation { kind, detail });
        }
    }
}

/// Amounts as the preview sends them and an equal amount written differently (`:decimal` binds both).
const AMOUNTS: &[(&str, f64)] =
    &[("10.00", 10.0), ("25.50", 25.5), ("99.99", 99.99), ("250.00", 250.0), ("9999.99", 9999.99)];
/// Over the demo's limit: a definite failure (422 limit_exceeded), replayed as already_failed.
const OVER_LIMIT: (&str, f64) = ("20000.00", 20000.0);
const MEMOS: &[&str] =
    &["rent", "rent ASAP", "please ASAP", "rent for March", "as discussed", "retry: rent", "pay now pls"];

#[derive(Debug, Clone)]
enum Step {
    Confirm { memo: String, number_amount: bool, in_body: bool, delay_ms: u64 },
    Race { k: usize, delay_ms: u64 },
    Status,
    Tamper,
    WrongSubject,
    Sleep(u64),
    Late,
}

#[derive(Debug, Clone)]
struct Plan {
    short_ttl: bool,
    /// On the routes whose rule asks a person first (`/approve/…`, scope payments.large_transfer).
    approval: bool,
    amount: (&'static str, f64),
    payee: String,
    steps: Vec<Step>,
    think_ms: u64,
    /// On the hostile upstream (`--world hostile|mixed`).
    hostile: Option<HostilePlan>,
}

/// How an operation meets the hostile upstream (soak-hostile.yaml's routes).
#[derive(Debug, Clone)]
struct HostilePlan {
    quote_read: QuoteRead,
    /// Preview and confirm over h2c to the upstream (the preview only where it reads the body's expiry).
    h2: bool,
    /// The preview's body carries this agent's previous fingerprint (an echoing upstream hands it back).
    echo_previous: bool,
    draw_base: u64,
    /// On the routes whose upstream ignores keys (`/hostile-nokey`): the business reference, bound and sent.
    client_ref: Option<String>,
}

fn draw_hostile(rng: &mut ChaCha8Rng) -> HostilePlan {
    let quote_read = [QuoteRead::Body, QuoteRead::Header, QuoteRead::Free][rng.gen_range(0..3)];
    // One operation in four where the upstream ignores keys; three references in ten from a pool all agents
    // share, so two operations name one reference now and then.
    let client_ref = rng.gen_bool(0.25).then(|| match rng.gen_bool(0.3) {
        true => format!("inv-shared-{}", rng.gen_range(0..8)),
        false => format!("inv-{:08x}", rng.gen::<u32>()),
    });
    HostilePlan {
        quote_read: if client_ref.is_some() { QuoteRead::Free } else { quote_read },
        client_ref,
        h2: rng.gen_bool(0.3),
        echo_previous: rng.gen_bool(0.3),
        // Room for every request of an operation after it.
        draw_base: rng.gen::<u64>() >> 8 << 8,
    }
}

impl HostilePlan {
    fn preview_path(&self) -> &'static str {
        if self.client_ref.is_some() {
            return "/hostile-nokey/v1/transfers/preview";
        }
        match (self.quote_read, self.h2) {
            (QuoteRead::Body, true) => "/hostile2/v1/transfers/preview",
            (QuoteRead::Body, false) => "/hostile/v1/transfers/preview",
            (QuoteRead::Header, _) => "/hostile-h/v1/transfers/preview",
            (QuoteRead::Free, _) => "/hostile-free/v1/transfers/preview",
        }
    }
}

fn draw_confirm(rng: &mut ChaCha8Rng) -> Step {
    let memo = format!("{} #{}", MEMOS.choose(rng).copied().unwrap_or("rent"), rng.gen_range(0..100));
    Step::Confirm {
        memo,
        number_amount: rng.gen_bool(0.4),
        in_body: rng.gen_bool(0.3),
        delay_ms: rng.gen_range(300..2400),
    }
}

fn draw_plan(rng: &mut ChaCha8Rng) -> Plan {
    let short_ttl = rng.gen_bool(0.2);
    let amount = if rng.gen_bool(0.08) { OVER_LIMIT } else { *AMOUNTS.choose(rng).unwrap_or(&AMOUNTS[0]) };
    let payee = format!("payee-{}", rng.gen_range(1..6));
    let mut steps = Vec::new();
    if short_ttl {
        // Confirm in time (usually), then come back after `exp`: the late retry must replay, never "expired".
        if rng.gen_bool(0.8) {
            steps.push(draw_confirm(rng));
        }
        steps.push(Step::Late);
        if rng.gen_bool(0.5) {
            steps.push(Step::Status);
        }
    } else {
        steps.push(if rng.gen_bool(0.9) { draw_confirm(rng) } else { Step::Status });
        for _ in 0..rng.gen_range(0..5) {
            let step = match rng.gen_range(0..100) {
                0..=34 => draw_confirm(rng),
                35..=49 => Step::Race { k: rng.gen_range(2..6), delay_ms: rng.gen_range(300..2400) },
                50..=64 => Step::Status,
                65..=72 => Step::Tamper,
                73..=78 => Step::WrongSubject,
                _ => Step::Sleep(rng.gen_range(50..1500)),
            };
            steps.push(step);
        }
    }
    Plan { short_ttl, approval: false, amount, payee, steps, think_ms: rng.gen_range(20..400), hostile: None }
}

/// Amounts of the approval workload: each at or over the rule's 1000 (and under the demo's limit).
const APPROVAL_AMOUNTS: &[(&str, f64)] = &[("1000.00", 1000.0), ("2500.00", 2500.0), ("9999.99", 9999.99)];

/// The agents that run the approval workload (one in eight; the others' plans stay as they were).
pub fn runs_approvals(agent: usize) -> bool {
    agent % 8 == 7
}

/// The seed of agent `id` (and of the fault schedule, `id = usize::MAX`).
pub fn rng_for(seed: u64, id: usize) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed ^ (id as u64).wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

pub fn subject_of(agent: usize) -> String {
    format!("agent-{agent}")
}

fn transfer(amount: Value, payee: &str, memo: &str) -> Value {
    json!({"amount": amount, "currency": "EUR", "payee_id": payee, "memo": memo})
}

pub async fn agent(ctx: Arc<Ctx>, id: usize, seed: u64) {
    let mut rng = rng_for(seed, id);
    let subject = subject_of(id);
    let hostile = ctx.world.hostile_agent(id);
    let mut previous: Option<String> = None;
    while Instant::now() < ctx.deadline {
        if runs_approvals(id) {
            approval_op(&ctx, id, &subject, &mut rng).await;
            continue;
        }
        let mut plan = draw_plan(&mut rng);
        if hostile {
            // The hostile routes mint 60 s fingerprints: a "late" retry there is just a later one.
            plan.short_ttl = false;
            plan.hostile = Some(draw_hostile(&mut rng));
        }
        let op = preview_with(&ctx, id, &subject, &plan, previous.as_deref()).await;
        if let Some(op) = op {
            previous = Some(op.fingerprint.clone());
            for step in &plan.steps {
                run_step(&ctx, &op, &plan, step).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(plan.think_ms)).await;
    }
}

async fn preview(ctx: &Arc<Ctx>, agent: usize, subject: &str, plan: &Plan) -> Option<Op> {
    preview_with(ctx, agent, subject, plan, None).await
}

/// The fields named `fingerprint` in any case (escapes decoded) at the top of an answer: what an agent, or a
/// case-insensitive decoder, reads as the fingerprint.
pub fn named_fingerprints(body: &Value) -> Vec<(String, Value)> {
    body.as_object()
        .map(|o| o.iter().filter(|(k, _)| k.eq_ignore_ascii_case("fingerprint")).map(|(k, v)| (k.clone(), v.clone())))
        .into_iter()
        .flatten()
        .collect()
}

/// `previous`: the agent's last fingerprint, sent along in the preview's body where the plan says so.
async fn preview_with(ctx: &Arc<Ctx>, agent: usize, subject: &str, plan: &Plan, previous: Option<&str>) -> Option<Op> {
    let path = match (&plan.hostile, plan.approval, plan.short_ttl) {
        (Some(h), _, _) => h.preview_path(),
        (None, true, _) => "/approve/v1/transfers/preview",
        (None, false, true) => "/short/v1/transfers/preview",
        (None, false, false) => "/v1/transfers/preview",
    };
    let mut body = transfer(json!(plan.amount.0), &plan.payee, "preview");
    let mut headers = Vec::new();
    if let Some(h) = &plan.hostile {
        headers.push((idem_hostile::DRAW_HEADER, h.draw_base.to_string()));
        if let (true, Some(fp)) = (h.echo_previous, previous) {
            body["fingerprint"] = json!(fp);
        }
        if let Some(r) = &h.client_ref {
            body["client_ref"] = json!(r);
        }
    }
    let r = send(ctx, agent, None, Req::Preview, path, subject, Some(&body), &headers).await;
    if let (Some(h), Some((reply, _))) = (&plan.hostile, &r) {
        // The fingerprint the agent sees is the gateway's only: every field an agent or a case-insensitive
        // decoder reads as the fingerprint holds the value the gateway minted into its header, or there is none.
        let gateway = reply.fingerprint_headers.first();
        for (key, value) in named_fingerprints(&reply.json) {
            if reply.fingerprint_headers.len() > 1 || value.as_str() != gateway.map(String::as_str) {
                let shown: String = value.to_string().chars().take(60).collect();
                ctx.violation(
                    "upstream_fingerprint_to_agent",
                    format!(
                        "agent {agent} {path} (draw {}): the answer's {key:?} is {shown} where the gateway minted {:?}",
                        h.draw_base,
                        reply
                            .fingerprint_headers
                            .iter()
                            .map(|f| f.chars().take(24).collect::<String>())
                            .collect::<Vec<_>>()
                    ),
                );
                return None;
            }
        }
    }
    let op = r.as_ref().and_then(|(r, _)| {
        let fp = r.json["fingerprint"].as_str()?.to_owned();
        let claims = idem_e2e::fingerprint_claims(&fp).ok()?;
        let hostile = plan.hostile.as_ref().map(|h| {
            std::sync::Arc::new(HostileOp {
                confirm_prefix: match (&h.client_ref, h.h2) {
                    (Some(_), _) => "/hostile-nokey",
                    (None, true) => "/hostile2",
                    (None, false) => "/hostile",
                },
                status_prefix: if h.client_ref.is_some() { "/hostile-nokey" } else { "/hostile" },
                client_ref: h.client_ref.clone(),
                quote_read: h.quote_read,
                quote_id: r.json["quote_id"].as_str().map(str::to_owned),
                draw_base: h.draw_base,
                next_draw: AtomicU64::new(1),
            })
        });
        Some(Op {
            id: ctx.next_op.fetch_add(1, Ordering::Relaxed),
            agent,
            subject: subject.to_owned(),
            nonce: claims["n"].as_str()?.to_owned(),
            exp: claims["exp"].as_u64()?,
            fingerprint: fp,
            short_ttl: plan.short_ttl,
            approval: plan.approval,
            amount: json!(plan.amount.0),
            hostile,
        })
    });
    if let Ok(mut log) = ctx.log.lock() {
        match &op {
            // A fingerprint names one operation: one minted again (an upstream's echo passed on) is another's.
            Some(op) if log.ops.iter().any(|o| o.nonce == op.nonce) => {
                let detail =
                    format!("agent {agent} {path}: handed the fingerprint of an earlier operation ({})", op.nonce);
                log.violations.push(Violation { kind: "fingerprint_of_another_operation", detail });
                return None;
            }
            Some(op) => log.ops.push(op.clone()),
            None => log.previews_failed += 1,
        }
    }
    op
}

async fn run_step(ctx: &Arc<Ctx>, op: &Op, plan: &Plan, step: &Step) {
    match step {
        Step::Confirm { memo, number_amount, in_body, delay_ms } => {
            let amount = if *number_amount { json!(plan.amount.1) } else { json!(plan.amount.0) };
            confirm(ctx, op, Req::Confirm, amount, &plan.payee, memo, *in_body, *delay_ms, &op.subject).await;
        }
        Step::Race { k, delay_ms } => {
            let mut set = tokio::task::JoinSet::new();
            for i in 0..*k {
                let (ctx, op, payee, delay) = (ctx.clone(), op.clone(), plan.payee.clone(), *delay_ms);
                let amount = json!(plan.amount.0);
                set.spawn(async move {
                    let subject = op.subject.clone();
                    confirm(&ctx, &op, Req::Race, amount, &payee, &format!("race {i}"), false, delay, &subject).await;
                });
            }
            while set.join_next().await.is_some() {}
        }
        Step::Status => {
            send(ctx, op.agent, Some(op), Req::Status, &status_path(op), &op.subject, None, &[]).await;
        }
        Step::Tamper => {
            let tampered = json!(format!("{:.2}", plan.amount.1 + 1.0));
            let r = confirm(ctx, op, Req::Tamper, tampered, &plan.payee, "rent", false, 0, &op.subject).await;
            expect_refusal(ctx, op, "tamper", r, 422, "params_changed");
        }
        Step::WrongSubject => {
            let thief = format!("{}-other", op.subject);
            let r =
                confirm(ctx, op, Req::WrongSubject, json!(plan.amount.0), &plan.payee, "rent", false, 0, &thief).await;
            expect_refusal(ctx, op, "wrong subject", r, 403, "forbidden");
        }
        Step::Sleep(ms) => tokio::time::sleep(Duration::from_millis(*ms)).await,
        Step::Late => {
            // Exactly at `exp` it is expired: come back a little after it.
            let wake = (op.exp * 1000 + 300).saturating_sub(unix_ms()).min(5_000);
            tokio::time::sleep(Duration::from_millis(wake)).await;
            confirm(ctx, op, Req::Late, json!(plan.amount.0), &plan.payee, "late retry", false, 0, &op.subject).await;
        }
    }
}

fn expect_refusal(ctx: &Ctx, op: &Op, what: &str, r: Option<(Reply, String)>, http: u16, status: &str) {
    if let Some((reply, kind)) = r {
        // On the ext_proc host idemd is the filter: while it is down (a fault), Envoy answers every request
        // "could not check" (503 status_unavailable) and nothing goes upstream; the filters inside Envoy refuse
        // a forgery without idemd.
        let ext_proc = idem_e2e::FilterHost::current().is_ok_and(|h| h.is_ext_proc());
        if ext_proc && reply.status == 503 && kind == "status_unavailable" {
            return;
        }
        if reply.status != http || kind != status {
            ctx.violation(
                "wrong_refusal",
                format!(
                    "op {} ({}): {what} answered {} {kind}, expected {http} {status}",
                    op.id, op.nonce, reply.status
                ),
            );
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn confirm(
    ctx: &Arc<Ctx>,
    op: &Op,
    req: Req,
    amount: Value,
    payee: &str,
    memo: &str,
    in_body: bool,
    delay_ms: u64,
    subject: &str,
) -> Option<(Reply, String)> {
    let mut body = transfer(amount, payee, memo);
    if let Some(r) = op.hostile.as_ref().and_then(|h| h.client_ref.as_ref()) {
        body["client_ref"] = json!(r);
    }
    let mut headers: Vec<(&str, String)> = Vec::new();
    if in_body {
        body["fingerprint"] = json!(op.fingerprint);
    } else {
        headers.push(("agent-fingerprint", op.fingerprint.clone()));
    }
    if delay_ms > 0 && ctx.slow() {
        headers.push(("x-demo-delay-ms", delay_ms.to_string()));
    }
    let path = match (&op.hostile, op.approval) {
        (Some(h), _) => format!("{}/v1/transfers", h.confirm_prefix),
        (None, true) => "/approve/v1/transfers".to_owned(),
        (None, false) => "/v1/transfers".to_owned(),
    };
    send(ctx, op.agent, Some(op), req, &path, subject, Some(&body), &headers).await
}

/// The status route of the operation's scope.
fn status_path(op: &Op) -> String {
    let prefix = match (&op.hostile, op.approval) {
        (Some(h), _) => h.status_prefix,
        (None, true) => "/approve",
        (None, false) => "",
    };
    format!("{prefix}/v1/transfers/status?fingerprint={}", op.fingerprint)
}

/// One operation of the approval workload: the confirm waits for a person (`approval_required`); the agent polls
/// the status route (and now and then confirms again, which must not run it) until it hears `approved`, then
/// confirms (sometimes several at once: one executes), or until it hears a definite answer (`rejected`,
/// `approval_lapsed` once `exp` passed, the execution or its replay). Then, sometimes, one more confirm (the
/// replay of what it was told).
async fn approval_op(ctx: &Arc<Ctx>, agent: usize, subject: &str, rng: &mut ChaCha8Rng) {
    let amount = *APPROVAL_AMOUNTS.choose(rng).unwrap_or(&APPROVAL_AMOUNTS[0]);
    let payee = format!("payee-{}", rng.gen_range(1..6));
    let plan = Plan { short_ttl: false, approval: true, amount, payee, steps: Vec::new(), think_ms: 0, hostile: None };
    let Some(op) = preview(ctx, agent, subject, &plan).await else {
        tokio::time::sleep(Duration::from_millis(200)).await;
        return;
    };
    let confirm_now = |req: Req, memo: String| {
        let (ctx, op, payee) = (ctx.clone(), op.clone(), plan.payee.clone());
        async move {
            let subject = op.subject.clone();
            confirm(&ctx, &op, req, json!(amount.0), &payee, &memo, false, 0, &subject).await.map(|(_, k)| k)
        }
    };
    let mut last = confirm_now(Req::Confirm, "large transfer".into()).await;
    // The fingerprint lives 6 s: past it every answer is definite (lapsed, rejected, or the execution's).
    let give_up = Instant::now() + Duration::from_millis((op.exp * 1000 + 8_000).saturating_sub(unix_ms()));
    // `not_executed` is definite, and says "safe to retry": this agent does (it executes, or hears it lapsed).
    let done = |k: &Option<String>| k.as_deref().is_some_and(|k| settled(k) && k != "not_executed");
    while !done(&last) && Instant::now() < give_up {
        if last.as_deref() == Some("approved") {
            let k = if rng.gen_bool(0.3) { rng.gen_range(2..4) } else { 1 };
            let mut set = tokio::task::JoinSet::new();
            for i in 0..k {
                let req = if k > 1 { Req::Race } else { Req::Confirm };
                set.spawn(confirm_now(req, format!("approved, go {i}")));
            }
            last = None;
            while let Some(r) = set.join_next().await {
                if let Ok(Some(kind)) = r {
                    if last.as_deref().is_none_or(|l| !settled(l)) {
                        last = Some(kind);
                    }
                }
            }
            continue;
        }
        tokio::time::sleep(Duration::from_millis(rng.gen_range(250..700))).await;
        last = if last.as_deref() == Some("not_executed") || rng.gen_bool(0.25) {
            confirm_now(Req::Confirm, "again, while it waits".into()).await
        } else {
            send(ctx, op.agent, Some(&op), Req::Status, &status_path(&op), &op.subject, None, &[]).await.map(|(_, k)| k)
        };
    }
    if rng.gen_bool(0.5) {
        confirm_now(Req::Confirm, "once more".into()).await;
    }
    tokio::time::sleep(Duration::from_millis(rng.gen_range(20..400))).await;
}

/// The crash-after-commit fault: an operation of its own whose confirm makes the demo exit right after it committed.
pub async fn crash_confirm(ctx: &Arc<Ctx>, agent: usize) -> Option<Op> {
    let plan = Plan {
        short_ttl: false,
        approval: false,
        amount: AMOUNTS[1],
        payee: "payee-crash".into(),
        steps: Vec::new(),
        think_ms: 0,
        hostile: None,
    };
    let subject = subject_of(agent);
    let op = preview(ctx, agent, &subject, &plan).await?;
    let body = transfer(json!(plan.amount.0), &plan.payee, "crash after commit");
    let headers = [("agent-fingerprint", op.fingerprint.clone()), ("x-demo-crash-after-commit", "1".to_owned())];
    send(ctx, agent, Some(&op), Req::Crash, "/v1/transfers", &subject, Some(&body), &headers).await;
    Some(op)
}

/// After the run: every operation whose last answer was not definite polls its status until it is (bounded).
pub async fn resolve_open(ctx: &Arc<Ctx>, within: Duration) -> usize {
    let open: Vec<Op> = {
        let Ok(log) = ctx.log.lock() else { return 0 };
        // A request whose answer was lost (transport error) after a definite answer reopens the question: the
        // confirm it was may have executed.
        log.ops
            .iter()
            .filter(|op| !last_outcome(&log.events, op.id, true).is_some_and(|k| settled(&k)))
            .cloned()
            .collect()
    };
    let n = open.len();
    let deadline = Instant::now() + within;
    let mut set = tokio::task::JoinSet::new();
    for op in open {
        let ctx = ctx.clone();
        set.spawn(async move {
            let path = status_path(&op);
            loop {
                let r = send(&ctx, op.agent, Some(&op), Req::Final, &path, &op.subject, None, &[]).await;
                let kind = r.map(|(_, kind)| kind).unwrap_or_default();
                if settled(&kind) || Instant::now() > deadline {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(400)).await;
            }
        });
    }
    while set.join_next().await.is_some() {}
    n
}

/// Definite, or needs_review (a person decides; the checker wants the reason).
pub fn settled(kind: &str) -> bool {
    definite(kind) || kind == "needs_review"
}

/// The last answer (by arrival) about operation `op`, transport errors aside.
pub fn last_answer(events: &[Event], op: usize) -> Option<String> {
    last_outcome(events, op, false)
}

/// The last answer (by arrival) about operation `op`, or a transport error if that came last and `lost` is set.
fn last_outcome(events: &[Event], op: usize, lost: bool) -> Option<String> {
    events
        .iter()
        .filter(|e| e.op == Some(op) && e.req.about_the_operation() && (lost || e.kind != "transport_error"))
        .max_by(|a, b| (a.t_ms as f64 + a.latency_ms).total_cmp(&(b.t_ms as f64 + b.latency_ms)))
        .map(|e| e.kind.clone())
}

/// Sends one request through Envoy, records it; None on a transport error (Envoy killed, timeout).
#[allow(clippy::too_many_arguments)]
async fn send(
    ctx: &Ctx,
    agent: usize,
    op: Option<&Op>,
    req: Req,
    path: &str,
    subject: &str,
    body: Option<&Value>,
    headers: &[(&str, String)],
) -> Option<(Reply, String)> {
    let url = format!("{}{path}", ctx.base);
    let mut rb = match body {
        Some(b) => ctx.http.post(url).json(b),
        None => ctx.http.get(url),
    };
    rb = rb.header("x-agent-subject", subject);
    for (k, v) in headers {
        rb = rb.header(*k, v);
    }
    // The draw this request names, in a violation's detail: `Grammar::new(seed).draw(role, draw)` is its plan.
    let mut draw = headers.iter().find(|(k, _)| *k == idem_hostile::DRAW_HEADER).map(|(_, v)| v.clone());
    if let Some(h) = op.and_then(|o| o.hostile.as_ref()) {
        let d = h.draw().to_string();
        rb = rb.header(idem_hostile::DRAW_HEADER, &d);
        draw = Some(d);
    }
    let t_ms = since_ms(ctx.start);
    let sent_unix_ms = unix_ms();
    let t0 = Instant::now();
    let reply = match rb.send().await {
        Ok(r) => {
            let status = r.status().as_u16();
            let header = |n: &str| r.headers().get(n).and_then(|v| v.to_str().ok()).map(str::to_owned);
            let content_type = header("content-type").unwrap_or_default();
            let replayed = header("idempotent-replayed");
            let fingerprint_headers = r
                .headers()
                .get_all("agent-fingerprint")
                .iter()
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                .collect();
            match r.bytes().await {
                Ok(b) => {
                    let json = serde_json::from_slice(&b).unwrap_or(Value::Null);
                    Some(Reply { status, content_type, replayed, fingerprint_headers, body: b.to_vec(), json })
                }
                Err(_) => None,
            }
        }
        Err(_) => None,
    };
    let latency_ms = t0.elapsed().as_secs_f64() * 1000.0;
    let (kind, transfer_id, problem) = match &reply {
        Some(r) => classify(req, op.map(|o| o.nonce.as_str()), r),
        None => ("transport_error".to_owned(), None, None),
    };
    if let Ok(mut log) = ctx.log.lock() {
        if let Some(p) = problem {
            let what = op.map(|o| format!("op {} ({})", o.id, o.nonce)).unwrap_or_else(|| format!("agent {agent}"));
            let draw = draw.map(|d| format!(" (hostile draw {d})")).unwrap_or_default();
            let detail = format!("{what} {}{draw}: {p}", req.name());
            log.violations.push(Violation { kind: "malformed_reply", detail });
        }
        log.events.push(Event {
            t_ms,
            sent_unix_ms,
            agent,
            op: op.map(|o| o.id),
            req,
            kind: kind.clone(),
            http: reply.as_ref().map_or(0, |r| r.status),
            latency_ms,
            transfer_id,
        });
    }
    reply.map(|r| (r, kind))
}
