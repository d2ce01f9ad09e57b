//! The cases: each runs its sides (a baseline and the filter's variants)
//! interleaved `--reps` times, in an order rotated per rep, and makes report
//! rows of chosen pairs of sides (the median of the per-rep ratios). Around each
//! timed run: Envoy's and idemd's CPU from /proc and idemd's store time from its
//! `/metrics`, all per request.

use crate::baselines::{plain_duplicate_key, plain_fresh_confirms, RawDb};
use crate::client::{
    confirm_request, confirm_request_to, drive, mint, nonce_of, once, preview_request, Measured, Requests,
};
use crate::report::{median, Row, StoreShare};
use crate::stack::{
    cpu_ticks, host_name, replay_hits, replay_hits_counter, server_ticks, store_delta, store_times, BenchStack, HOSTS,
};
use crate::standalone::{self, Standalone};
use crate::Opts;
use idem_e2e::{BoxError, FilterHost};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Bounds the fingerprints minted (or plain keys made) for one fresh-confirm run.
const MAX_MINT: usize = 60_000;
/// Fresh requests prepared for a warm-up run, which also measures the first rate.
const WARMUP_FRESH: usize = 400;
/// What a replay is measured against: the demo's own dedup behind plain Envoy.
pub(crate) const DEDUP_BASELINE: &str = "plain Envoy, same confirm, demo dedup";
/// A path no route serves but the catch-all direct_response (envoy/bench.yaml's `no_route`).
const OWN_ANSWER_PATH: &str = "/no-route/v1/transfers";

/// What one side sends.
pub(crate) enum Load<'a> {
    /// The same (or each-once) requests to a listener.
    Http { port: u16, reqs: Requests, expect: u16 },
    /// Fresh confirms through the filter: fingerprints minted (untimed) before each run.
    FilterFresh { port: u16 },
    /// Fresh confirms through plain Envoy: a new Idempotency-Key per request, made before each run.
    PlainFresh { port: u16, fingerprint: String },
    /// Raw single-row commits into idemd's database, no HTTP at all.
    Raw(&'a RawDb),
}

pub(crate) struct Side<'a> {
    pub(crate) label: String,
    pub(crate) load: Load<'a>,
    /// The process proxying this side's requests when it is not the bench's Envoy (the
    /// standalone proxy): its CPU goes in the Envoy column, and idemd has no part in it.
    pub(crate) proxy_pid: Option<u32>,
}

impl<'a> Side<'a> {
    pub(crate) fn new(label: impl Into<String>, load: Load<'a>) -> Side<'a> {
        Side { label: label.into(), load, proxy_pid: None }
    }
}

/// One timed run of one side.
#[derive(Default)]
struct Sample {
    rate: f64,
    p50_ms: f64,
    ok: u64,
    /// CPU µs per request; None when the side does not go through the process.
    envoy_us: Option<f64>,
    idemd_us: Option<f64>,
    /// The Redis server's, for a side proxied by another process (the standalone proxy's store).
    redis_us: Option<f64>,
    /// idemd's store calls during the run: (store op, seconds, calls).
    store: Vec<(String, f64, u64)>,
    replay_hits: u64,
    problems: String,
    /// Unix seconds when the timed requests started and stopped: the window to cut a profile of
    /// the Envoy worker to (`perf record -k CLOCK_REALTIME`, then `perf report --time a,b`).
    window: (f64, f64),
}

/// All timed runs of one side.
#[derive(Default)]
pub(crate) struct SideStats {
    samples: Vec<Sample>,
    notes: String,
}

impl SideStats {
    fn rates(&self) -> Vec<f64> {
        self.samples.iter().map(|s| s.rate).collect()
    }

    fn med(&self, f: impl Fn(&Sample) -> Option<f64>) -> Option<f64> {
        let v: Vec<f64> = self.samples.iter().filter_map(f).collect();
        (!v.is_empty()).then(|| median(&v))
    }

    /// idemd's store time per request over all runs, by store op.
    fn store_per_request(&self) -> Vec<StoreShare> {
        let requests: u64 = self.samples.iter().map(|s| s.ok).sum();
        let mut by_op: BTreeMap<&str, (f64, u64)> = BTreeMap::new();
        for (op, secs, calls) in self.samples.iter().flat_map(|s| &s.store) {
            let e = by_op.entry(op.as_str()).or_default();
            e.0 += secs;
            e.1 += calls;
        }
        by_op
            .into_iter()
            .map(|(op, (secs, calls))| StoreShare {
                op: op.to_owned(),
                us_per_request: secs * 1e6 / requests.max(1) as f64,
                calls_per_request: calls as f64 / requests.max(1) as f64,
            })
            .collect()
    }

    /// The Redis server's CPU µs per request (median over the runs), for a side that measures it.
    pub(crate) fn redis_us(&self) -> Option<f64> {
        self.med(|s| s.redis_us)
    }

    pub(crate) fn replay_hits_per_request(&self) -> f64 {
        let requests: u64 = self.samples.iter().map(|s| s.ok).sum();
        self.samples.iter().map(|s| s.replay_hits).sum::<u64>() as f64 / requests.max(1) as f64
    }
}

/// A report row: side `num` against side `den` of the same run.
pub(crate) struct Pair {
    pub(crate) num: usize,
    pub(crate) den: usize,
    pub(crate) case: String,
    pub(crate) baseline: String,
    pub(crate) target: Option<f64>,
}

pub(crate) fn row(stats: &[SideStats], p: &Pair) -> Row {
    let (Some(n), Some(d)) = (stats.get(p.num), stats.get(p.den)) else {
        return Row { case: p.case.clone(), baseline: p.baseline.clone(), ..Default::default() };
    };
    let ratios = n.rates().iter().zip(d.rates()).map(|(f, b)| if b > 0.0 { f / b } else { 0.0 }).collect::<Vec<_>>();
    let notes = [&n.notes, &d.notes].into_iter().filter(|s| !s.is_empty()).cloned().collect::<Vec<_>>().join("; ");
    Row {
        case: p.case.clone(),
        baseline: p.baseline.clone(),
        base_rate: median(&d.rates()),
        rate: median(&n.rates()),
        p50_ms: n.med(|s| Some(s.p50_ms)).unwrap_or(0.0),
        base_envoy_us: d.med(|s| s.envoy_us),
        envoy_us: n.med(|s| s.envoy_us),
        base_idemd_us: d.med(|s| s.idemd_us),
        idemd_us: n.med(|s| s.idemd_us),
        store: n.store_per_request(),
        ratios,
        target: p.target,
        notes,
        unmeasured: None,
    }
}

/// Everything a side's run needs from the stack.
pub(crate) struct Probe {
    envoy: Option<u32>,
    idemds: Vec<u32>,
    admin: u16,
    sidecar_port: u16,
}

impl Probe {
    pub(crate) fn of(st: &BenchStack) -> Probe {
        Probe { envoy: st.envoy.pid(), idemds: st.idemd_pids(), admin: st.admin, sidecar_port: st.sidecar_port }
    }

    /// Every host's replay-cache hits: only the host a side runs through adds to them during its run.
    async fn replay_hits(&self) -> u64 {
        let mut hits = 0;
        for host in HOSTS {
            hits += replay_hits(host, self.admin, self.sidecar_port).await;
        }
        hits
    }
}

/// Prepared requests for a fresh run: enough for the fastest rate seen, with headroom.
fn fresh_count(fastest: f64, secs: f64) -> usize {
    ((fastest * secs * 1.5) as usize + 300).min(MAX_MINT)
}

/// One run of a side for `secs` (warm-up or timed). Minting and key-making happen before the clock starts.
async fn run_side(
    side: &Side<'_>,
    probe: &Probe,
    o: &Opts,
    secs: f64,
    fastest: f64,
    run_tag: &str,
    nonces: &mut Vec<String>,
) -> Result<Sample, BoxError> {
    let warmup = fastest <= 0.0;
    let n = if warmup { WARMUP_FRESH } else { fresh_count(fastest, secs) };
    // (port, requests, expected status) for an HTTP side; None for the raw database.
    let http = match &side.load {
        Load::Http { port, reqs, expect } => Some((*port, reqs.clone(), *expect)),
        Load::FilterFresh { port } => {
            let fps = mint(*port, n, o.conns).await?;
            nonces.extend(fps.iter().filter_map(|f| nonce_of(f)));
            let all = fps.iter().map(|f| confirm_request(f, None)).collect();
            Some((*port, Requests::EachOnce(Arc::new(all), Arc::default()), 201))
        }
        Load::PlainFresh { port, fingerprint } => {
            let all = plain_fresh_confirms(fingerprint, run_tag, n);
            Some((*port, Requests::EachOnce(Arc::new(all), Arc::default()), 201))
        }
        Load::Raw(_) => None,
    };
    // A fresh warm-up runs until its requests run out, which measures the first rate.
    let secs = if warmup && !matches!(side.load, Load::Http { .. }) { secs.max(5.0) } else { secs };
    let proxy = side.proxy_pid.or(probe.envoy);
    let idemd = (side.proxy_pid.is_none() && !probe.idemds.is_empty()).then_some(&probe.idemds);
    let idemd_ticks = |pids: &Vec<u32>| pids.iter().copied().map(cpu_ticks).sum::<u64>();
    let redis = || side.proxy_pid.map(|_| server_ticks(&["redis-server"]));
    let (envoy0, idemd0, redis0) = (proxy.map(cpu_ticks), idemd.map(idemd_ticks), redis());
    let (store0, hits0) = (store_times(probe.sidecar_port).await, probe.replay_hits().await);
    let started = unix_now();
    let mut m: Measured = match (&side.load, http) {
        (Load::Raw(db), _) => db.drive(o.conns, secs, run_tag).await,
        (_, Some((port, reqs, expect))) => drive(port, &reqs, expect, o.conns, secs).await,
        (_, None) => Measured::default(),
    };
    let stopped = unix_now();
    let (envoy1, idemd1, redis1) = (proxy.map(cpu_ticks), idemd.map(idemd_ticks), redis());
    let (store1, hits1) = (store_times(probe.sidecar_port).await, probe.replay_hits().await);
    if warmup {
        // A fresh warm-up runs its requests out on purpose.
        m.exhausted = false;
    }
    let ok = m.ok;
    let per_req = |a: Option<u64>, b: Option<u64>| match (a, b) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 * 10_000.0 / ok.max(1) as f64),
        _ => None,
    };
    let through_envoy = !matches!(side.load, Load::Raw(_));
    Ok(Sample {
        rate: m.rate(),
        p50_ms: m.p50_ms(),
        ok: m.ok,
        envoy_us: per_req(envoy0, envoy1).filter(|_| through_envoy),
        idemd_us: per_req(idemd0, idemd1).filter(|_| through_envoy),
        redis_us: per_req(redis0, redis1),
        store: if through_envoy { store_delta(&store0, &store1) } else { Vec::new() },
        replay_hits: hits1.saturating_sub(hits0),
        problems: m.problems(),
        window: (started, stopped),
    })
}

fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// Every side warmed up once, then `--reps` timed runs each, the order rotated per rep
/// so drift hits all sides alike.
pub(crate) async fn run_sides(
    title: &str,
    sides: &[Side<'_>],
    probe: &Probe,
    o: &Opts,
    nonces: &mut Vec<String>,
) -> Result<Vec<SideStats>, BoxError> {
    eprintln!("\n== {title}");
    let run_tag = format!("{:06x}", std::process::id() & 0xff_ffff);
    let mut stats: Vec<SideStats> = sides.iter().map(|_| SideStats::default()).collect();
    let mut fastest = vec![0.0f64; sides.len()];
    for (i, s) in sides.iter().enumerate() {
        let m = run_side(s, probe, o, o.warmup, 0.0, &format!("{run_tag}w{i:x}"), nonces).await?;
        eprintln!("   warm-up {:<46} {:>9.0} req/s{}", s.label, m.rate, m.problems);
        if m.ok == 0 {
            return Err(format!("{title}: {} answers nothing as expected:{}", s.label, m.problems).into());
        }
        fastest[i] = m.rate;
    }
    let n = sides.len();
    let windows = std::env::var_os("IDEM_BENCH_WINDOWS").is_some();
    for rep in 0..o.reps {
        for k in 0..n {
            let i = (k + rep) % n;
            let (Some(s), Some(st)) = (sides.get(i), stats.get_mut(i)) else { continue };
            let f = fastest.get(i).copied().unwrap_or(0.0).max(1.0);
            let m = run_side(s, probe, o, o.seconds, f, &format!("{run_tag}{rep:x}{i:x}"), nonces).await?;
            let us = |v: Option<f64>| v.map(|v| format!("{v:>5.0}")).unwrap_or_else(|| "    -".into());
            let store_us = m.store.iter().map(|(_, secs, _)| secs).fold(0.0, |a, b| a + b) * 1e6 / m.ok.max(1) as f64;
            // IDEM_BENCH_WINDOWS=1: each run's time window, to cut a profile of Envoy to one side.
            let window = if windows { format!("  window {:.3},{:.3}", m.window.0, m.window.1) } else { String::new() };
            eprintln!(
                "   rep {} {:<46} {:>9.0} req/s  p50 {:>6.2} ms  envoy {} idemd {} store {store_us:>5.0} us/req{}{window}",
                rep + 1,
                s.label,
                m.rate,
                m.p50_ms,
                us(m.envoy_us),
                us(m.idemd_us),
                m.problems
            );
            if st.notes.is_empty() && !m.problems.is_empty() {
                st.notes = format!("{}:{}", s.label, m.problems);
            }
            if let Some(f) = fastest.get_mut(i) {
                *f = f.max(m.rate);
            }
            st.samples.push(m);
        }
    }
    Ok(stats)
}

pub(crate) async fn check(
    what: &str,
    port: u16,
    req: &[u8],
    status: u16,
    must: &[&str],
    must_not: &[&str],
) -> Result<(), BoxError> {
    let (s, _, text) = once(port, req).await?;
    let ok = s == status && must.iter().all(|m| text.contains(m)) && !must_not.iter().any(|m| text.contains(m));
    if !ok {
        return Err(format!("bench setup check failed: {what}: HTTP {s} {text}").into());
    }
    Ok(())
}

fn same(port: u16, req: &Arc<Vec<u8>>, expect: u16) -> Load<'static> {
    Load::Http { port, reqs: Requests::Same(req.clone()), expect }
}

/// Report rows of pairs of sides: (num, den, case, baseline, target).
fn push_rows(rows: &mut Vec<Row>, stats: &[SideStats], pairs: Vec<(usize, usize, String, &str, Option<f64>)>) {
    for (num, den, case, baseline, target) in pairs {
        rows.push(row(stats, &Pair { num, den, case, baseline: baseline.into(), target }));
    }
}

/// The two baselines of a preview-shaped request: plain Envoy and the empty proxy-wasm filter
/// (sides 0 and 1), each checked to answer it without a fingerprint.
async fn baseline_sides(st: &BenchStack, what: &str, req: &Arc<Vec<u8>>) -> Result<Vec<Side<'static>>, BoxError> {
    let mut sides = Vec::new();
    for (label, port) in [("plain Envoy", st.plain), ("empty proxy-wasm filter", st.empty)] {
        check(&format!("{what} via {label}"), port, req, 200, &["quote_id"], &["fingerprint"]).await?;
        sides.push(Side::new(label, same(port, req, 200)));
    }
    Ok(sides)
}

/// The unannotated route (plain Envoy, empty proxy-wasm filter, and on each host: the filter,
/// the filter with 20 route rules, the filter disabled on the route) and the preview (plain
/// Envoy, empty filter, the filter on each host).
pub(crate) async fn proxy_cases(st: &mut BenchStack, o: &Opts, rows: &mut Vec<Row>) -> Result<(), BoxError> {
    let probe = Probe::of(st);
    let unannotated = Arc::new(preview_request("/plain/v1/transfers/preview"));
    let opted_out = Arc::new(preview_request("/plain-optout/v1/transfers/preview"));
    let mut sides = baseline_sides(st, "unannotated", &unannotated).await?;
    for host in HOSTS {
        let (f, h) = (st.filter(host), host_name(host));
        for (what, port, req) in [
            ("unannotated via filter", f.agents, &unannotated),
            ("unannotated via filter with 20 route rules", f.rules, &unannotated),
            ("opted-out via filter", f.agents, &opted_out),
        ] {
            check(&format!("{what} ({h})"), port, req, 200, &["quote_id"], &["fingerprint"]).await?;
        }
        sides.push(Side::new(format!("filter ({h}), unannotated"), same(f.agents, &unannotated, 200)));
        sides.push(Side::new(format!("filter ({h}) + 20 route rules, unannotated"), same(f.rules, &unannotated, 200)));
        sides.push(Side::new(format!("filter ({h}), disabled on the route"), same(f.agents, &opted_out, 200)));
    }
    let stats = run_sides("unannotated route", &sides, &probe, o, &mut st.nonces).await?;
    // Sides: 0 plain, 1 empty filter, then per host (wasm at 2, native at 5, ext_proc at 8): filter,
    // 20 rules, disabled.
    let (w, n, e) = (2, 5, 8);
    let (empty, plain) = ("empty proxy-wasm filter, same request", "plain Envoy, same request");
    push_rows(
        rows,
        &stats,
        vec![
            (w, 1, "unannotated route (wasm)".into(), empty, Some(0.97)),
            (w, 0, "unannotated route (wasm)".into(), plain, None),
            (n, 0, "unannotated route (native)".into(), plain, Some(0.95)),
            (w + 1, 1, "unannotated route, 20 route rules (wasm)".into(), empty, Some(0.97)),
            (n + 1, 0, "unannotated route, 20 route rules (native)".into(), plain, Some(0.95)),
            (w + 2, 0, "unannotated route, filter disabled on it (wasm)".into(), plain, Some(0.97)),
            (n + 2, 0, "unannotated route, filter disabled on it (native)".into(), plain, Some(0.97)),
            (e, 0, "unannotated route (ext_proc)".into(), plain, None),
            (e + 1, 0, "unannotated route, 20 route rules (ext_proc)".into(), plain, None),
            (e + 2, 0, "unannotated route, filter disabled on it (ext_proc)".into(), plain, None),
            (1, 0, "(reference) empty proxy-wasm filter".into(), plain, None),
        ],
    );

    let preview = Arc::new(preview_request("/v1/transfers/preview"));
    let mut sides = baseline_sides(st, "preview", &preview).await?;
    check("preview via plain Envoy + buffer filter", st.buffered, &preview, 200, &["quote_id"], &["fingerprint"])
        .await?;
    sides.push(Side::new("plain Envoy + buffer filter, preview", same(st.buffered, &preview, 200)));
    for host in HOSTS {
        let (port, h) = (st.filter(host).agents, host_name(host));
        check(&format!("preview via filter ({h})"), port, &preview, 200, &["quote_id", "\"fingerprint\""], &[]).await?;
        sides.push(Side::new(format!("filter ({h}), preview (mint)"), same(port, &preview, 200)));
    }
    let stats = run_sides("preview", &sides, &probe, o, &mut st.nonces).await?;
    let plain = "plain Envoy, same preview";
    push_rows(
        rows,
        &stats,
        vec![
            (3, 0, "preview (wasm)".into(), plain, Some(0.7)),
            (4, 0, "preview (native)".into(), plain, Some(0.9)),
            (5, 0, "preview (ext_proc)".into(), plain, None),
            (1, 0, "(reference) preview, empty proxy-wasm filter".into(), plain, None),
            (2, 0, "(reference) preview, Envoy's buffer filter holding the request".into(), plain, None),
        ],
    );
    Ok(())
}

/// A DONE fingerprint replayed through the filter on each host (served from its replay cache)
/// against plain Envoy forwarding the same confirm with a fixed Idempotency-Key (the demo's
/// dedup answers), and, when given, the same confirm through a standalone idempotency proxy.
pub(crate) async fn duplicate_case(
    st: &mut BenchStack,
    o: &Opts,
    standalone: Option<&Standalone>,
    rows: &mut Vec<Row>,
) -> Result<(), BoxError> {
    let probe = Probe::of(st);
    let mut confirms = Vec::new();
    for host in HOSTS {
        let (port, h) = (st.filter(host).agents, host_name(host));
        let fp = mint(port, 1, 1).await?.pop().ok_or("no fingerprint")?;
        st.nonces.extend(nonce_of(&fp));
        let confirm = Arc::new(confirm_request(&fp, None));
        check(&format!("first confirm via filter ({h})"), port, &confirm, 201, &["\"executed\""], &[]).await?;
        check(&format!("duplicate via filter ({h})"), port, &confirm, 201, &["already_completed"], &[]).await?;
        confirms.push((host, port, fp, confirm));
    }
    let fp = confirms.first().map(|c| c.2.clone()).unwrap_or_default();
    let key = plain_duplicate_key();
    let plain_confirm = Arc::new(confirm_request(&fp, Some(&key)));
    check("first confirm via plain", st.plain, &plain_confirm, 201, &["\"executed\""], &[]).await?;
    check("duplicate via plain", st.plain, &plain_confirm, 201, &["\"executed\"", key.as_str()], &[]).await?;
    let mut sides = vec![Side::new("plain Envoy -> demo dedup", same(st.plain, &plain_confirm, 201))];
    for (host, port, _, confirm) in &confirms {
        sides.push(Side::new(format!("filter ({}) replay", host_name(*host)), same(*port, confirm, 201)));
    }
    // Envoy's own floor for a replay: the same confirm (headers and body) held whole by Envoy's buffer
    // filter, as the filter holds it, then answered by Envoy itself (the catch-all direct_response).
    let itself = Arc::new(confirm_request_to(OWN_ANSWER_PATH, &fp, None));
    check("Envoy answering itself", st.buffered, &itself, 404, &["no_such_route"], &[]).await?;
    sides.push(Side::new("Envoy buffer filter -> its own answer", same(st.buffered, &itself, 404)));
    let own_answer = sides.len() - 1;
    let proxy = match standalone {
        Some(Standalone::Running(p)) => {
            let req = Arc::new(p.confirm(&fp));
            p.check(&req).await?;
            sides.push(Side {
                proxy_pid: p.proc.pid(),
                ..Side::new("standalone proxy replay", same(p.port, &req, 201))
            });
            Some(sides.len() - 1)
        }
        _ => None,
    };
    let case = format!("duplicate confirm (replay) [{}]", st.label);
    let stats = run_sides(&case, &sides, &probe, o, &mut st.nonces).await?;
    for (i, host) in HOSTS.into_iter().enumerate() {
        let case = format!("{case} ({})", host_name(host));
        let mut r = row(
            &stats,
            &Pair { num: i + 1, den: 0, case: case.clone(), baseline: DEDUP_BASELINE.into(), target: Some(1.0) },
        );
        if let Some(filter) = stats.get(i + 1) {
            let hits = fmt_share(filter.replay_hits_per_request());
            prepend_note(&mut r, format!("{}: {hits} per request", replay_hits_counter(host)));
        }
        rows.push(r);
        if let Some(den) = proxy {
            let baseline = format!("{}, same confirm", standalone::NAME);
            rows.push(row(&stats, &Pair { num: i + 1, den, case, baseline, target: Some(1.0) }));
        }
    }
    rows.push(row(
        &stats,
        &Pair {
            num: own_answer,
            den: 0,
            case: format!(
                "(reference) the same confirm held by Envoy's buffer filter, answered by Envoy itself [{}]",
                st.label
            ),
            baseline: DEDUP_BASELINE.into(),
            target: None,
        },
    ));
    match (proxy, standalone) {
        (Some(num), _) => {
            let (case, baseline) = (standalone::row_case(), DEDUP_BASELINE.into());
            let mut r = row(&stats, &Pair { num, den: 0, case, baseline, target: None });
            if let Some(redis) = stats.get(num).and_then(SideStats::redis_us) {
                prepend_note(&mut r, format!("Redis server CPU during its runs: {redis:.0} µs per request"));
            }
            rows.push(r);
        }
        (None, Some(Standalone::NotMeasured(why))) => rows.push(standalone::unmeasured_row(why)),
        (None, _) => {}
    }
    Ok(())
}

fn prepend_note(r: &mut Row, note: String) {
    r.notes = if r.notes.is_empty() { note } else { format!("{note}; {}", r.notes) };
}

fn fmt_share(x: f64) -> String {
    format!("{x:.2}")
}

/// Fresh confirms (fingerprints minted before each timed run) against plain Envoy
/// forwarding fresh confirms (a new Idempotency-Key each, so the demo commits its own
/// row), and against the raw single-row commit rate of idemd's database; interleaved.
pub(crate) async fn fresh_case(
    st: &mut BenchStack,
    raw: &RawDb,
    dbname: &str,
    o: &Opts,
    rows: &mut Vec<Row>,
) -> Result<(), BoxError> {
    let probe = Probe::of(st);
    let fp = mint(st.filter(FilterHost::Wasm).agents, 1, 1).await?.pop().ok_or("no fingerprint")?;
    for req in plain_fresh_confirms(&fp, "check", 1) {
        check("fresh confirm via plain", st.plain, &req, 201, &["\"executed\""], &[]).await?;
    }
    let mut sides = vec![
        Side::new("plain Envoy -> demo, fresh key", Load::PlainFresh { port: st.plain, fingerprint: fp }),
        Side::new("raw single-row commit", Load::Raw(raw)),
    ];
    for host in HOSTS {
        let port = st.filter(host).agents;
        sides.push(Side::new(format!("filter ({}), fresh confirm", host_name(host)), Load::FilterFresh { port }));
    }
    let case = format!("fresh confirm [{}]", st.label);
    let stats = run_sides(&case, &sides, &probe, o, &mut st.nonces).await?;
    // Sides: 0 plain, 1 raw commit, then the filter per host (wasm at 2, native at 3, ext_proc at 4).
    let raw_baseline = format!("raw single-row commit, {dbname}");
    let plain = "plain Envoy, fresh confirm (demo commits)";
    let mut pairs = Vec::new();
    for (i, host) in HOSTS.into_iter().enumerate() {
        let case = format!("{case} ({})", host_name(host));
        pairs.push((i + 2, 0, case.clone(), plain, Some(0.5)));
        pairs.push((i + 2, 1, format!("(reference) {case}"), raw_baseline.as_str(), None));
    }
    push_rows(rows, &stats, pairs);
    Ok(())
}
