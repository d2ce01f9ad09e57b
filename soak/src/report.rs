//! The summary table (markdown, printed and written to target/soak/summary.md)
//! and the chart over time (target/soak/chart.svg; plotters' SVG backend only).

use crate::agents::Log;
use crate::faults::{Fault, Injected};
use crate::record::{Req, Violation};
use plotters::prelude::*;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::Path;

pub struct RunFacts {
    pub seed: u64,
    pub agents: usize,
    pub chaos_s: u64,
    pub commit: String,
    pub wall_s: f64,
    pub settle_ms: u64,
    pub polled_at_end: usize,
    pub executions: i64,
    pub sql_states: BTreeMap<String, u64>,
    /// `idem_approval` rows by state after the run.
    pub approval_states: BTreeMap<String, u64>,
    /// APPROVED operations the demo executed.
    pub approved_executed: usize,
    pub approver: crate::approver::ApproverLog,
    /// `--world`.
    pub world: &'static str,
    /// `--failover`: the replicated stores' topology (None: single nodes).
    pub failover: Option<&'static str>,
    /// The hostile upstream's grammar branches, as drawn (None: the demo world).
    pub hostile_branches: Option<BTreeMap<String, u64>>,
    pub hostile_executions: usize,
    pub filter_panics: usize,
    pub failed_streams: usize,
}

fn join_counts(m: &BTreeMap<String, u64>) -> String {
    if m.is_empty() {
        return "none".into();
    }
    m.iter().map(|(k, n)| format!("{k} {n}")).collect::<Vec<_>>().join(", ")
}

fn approval_ops(log: &Log) -> String {
    let ops: Vec<usize> = log.ops.iter().filter(|o| o.approval).map(|o| o.id).collect();
    let confirms = log.events.iter().filter(|e| e.req.is_confirm() && e.op.is_some_and(|o| ops.contains(&o))).count();
    format!("{} ({} confirms)", ops.len(), confirms)
}

fn approver_seen(a: &crate::approver::ApproverLog) -> String {
    use crate::approver::Intent;
    let n = |i: Intent| a.seen.values().filter(|x| **x == i).count();
    format!("{} ({} / {} / {})", a.seen.len(), n(Intent::Approve), n(Intent::Reject), n(Intent::Leave))
}

fn approver_sent(a: &crate::approver::ApproverLog) -> String {
    let n = |h: u16| a.sent.iter().filter(|s| s.http == h).count();
    let other = a.sent.iter().filter(|s| ![200, 409, 410, 0].contains(&s.http)).count();
    format!("{} ({} / {} / {} / {} / {})", a.sent.len(), n(200), n(409), n(410), other, n(0))
}

fn approval_answers(log: &Log) -> String {
    let ops: Vec<usize> = log.ops.iter().filter(|o| o.approval).map(|o| o.id).collect();
    let mut by: BTreeMap<String, u64> = BTreeMap::new();
    for e in log.events.iter().filter(|e| e.op.is_some_and(|o| ops.contains(&o)) && e.req != Req::Preview) {
        *by.entry(e.kind.clone()).or_default() += 1;
    }
    join_counts(&by)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

pub fn summary(log: &Log, faults: &[Injected], violations: &[Violation], f: &RunFacts) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "## Chaos soak: seed {}, {} s of chaos, {} agents, world {}{}, commit {}\n",
        f.seed,
        f.chaos_s,
        f.agents,
        f.world,
        f.failover.map(|t| format!(", replicated stores ({t} standby) failing over")).unwrap_or_default(),
        f.commit
    );
    let confirms: Vec<_> = log.events.iter().filter(|e| e.req.is_confirm()).collect();
    let mut per_op: HashMap<usize, u64> = HashMap::new();
    for e in &confirms {
        if let Some(op) = e.op {
            *per_op.entry(op).or_default() += 1;
        }
    }
    let retries: u64 = per_op.values().map(|n| n.saturating_sub(1)).sum();
    let count = |r: Req| log.events.iter().filter(|e| e.req == r).count();
    let states = f.sql_states.iter().map(|(k, n)| format!("{k} {n}")).collect::<Vec<_>>().join(", ");
    let _ = writeln!(s, "| | |\n|---|---|");
    for (k, val) in [
        ("operations (fingerprints minted)", log.ops.len().to_string()),
        ("previews that failed (faults)", log.previews_failed.to_string()),
        ("requests", log.events.len().to_string()),
        (
            "confirms (races, late retries after exp)",
            format!("{} ({}, {})", confirms.len(), count(Req::Race), count(Req::Late)),
        ),
        ("retries (confirms after an operation's first)", retries.to_string()),
        ("status polls (+ at the end)", format!("{} (+ {})", count(Req::Status), count(Req::Final))),
        ("tampered amounts / wrong subjects", format!("{} / {}", count(Req::Tamper), count(Req::WrongSubject))),
        ("executions (demo ledger and hostile upstream)", f.executions.to_string()),
        ("executions by the hostile upstream", f.hostile_executions.to_string()),
        (
            "filter panics / streams failed by the filter (Envoy's logs)",
            format!("{} / {}", f.filter_panics, f.failed_streams),
        ),
        ("approval operations (confirms on the approval route)", approval_ops(log)),
        ("approval rows after settling", join_counts(&f.approval_states)),
        ("approver: waiting operations seen (drawn approve / reject / leave)", approver_seen(&f.approver)),
        ("approver: decisions sent (200 / 409 decided / 410 lapsed / other / no answer)", approver_sent(&f.approver)),
        ("approved operations executed (demo ledger)", f.approved_executed.to_string()),
        ("approval answers to agents", approval_answers(log)),
        ("SQL rows after settling", states),
        (
            "settled (no IN_FLIGHT) after the run",
            format!("{} ms; {} operations polled to a definite answer", f.settle_ms, f.polled_at_end),
        ),
        ("wall time", format!("{:.0} s", f.wall_s)),
        ("invariant violations", violations.len().to_string()),
    ] {
        let _ = writeln!(s, "| {k} | {val} |");
    }

    let _ = writeln!(s, "\n| fault | injected |\n|---|---|");
    for kind in Fault::KINDS {
        let n = faults.iter().filter(|x| x.kind == kind).count();
        let _ = writeln!(s, "| {kind} | {n} |");
    }
    if let Some(topology) = f.failover {
        for kind in Fault::FAILOVER_KINDS {
            let n = faults.iter().filter(|x| x.kind == kind).count();
            let _ = writeln!(s, "| {kind} ({topology} standby) | {n} |");
        }
    }

    if let Some(branches) = &f.hostile_branches {
        // What the hostile upstream did: each axis of its grammar with the values drawn, most frequent first.
        let _ = writeln!(s, "\n| hostile upstream: grammar branch | drawn |\n|---|---:|");
        let mut rows: Vec<(&String, &u64)> = branches.iter().collect();
        rows.sort_by(|a, b| {
            let axis = |k: &str| k.split('=').next().unwrap_or("").to_owned();
            axis(a.0).cmp(&axis(b.0)).then(b.1.cmp(a.1))
        });
        for (k, n) in rows {
            let _ = writeln!(s, "| {k} | {n} |");
        }
    }

    let mut kinds: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for e in &log.events {
        kinds.entry(e.kind.as_str()).or_default().push(e.latency_ms);
    }
    let _ = writeln!(s, "\n| answer | count | p50 ms | p99 ms |\n|---|---:|---:|---:|");
    let mut rows: Vec<_> = kinds.into_iter().collect();
    rows.sort_by_key(|(_, v)| std::cmp::Reverse(v.len()));
    for (kind, mut l) in rows {
        l.sort_by(f64::total_cmp);
        let _ = writeln!(s, "| {kind} | {} | {:.1} | {:.1} |", l.len(), percentile(&l, 0.5), percentile(&l, 0.99));
    }

    let mut by_kind: BTreeMap<&str, usize> = BTreeMap::new();
    for x in violations {
        *by_kind.entry(x.kind).or_default() += 1;
    }
    let _ = writeln!(s, "\n| invariant violation | count |\n|---|---:|");
    if by_kind.is_empty() {
        let _ = writeln!(s, "| (none) | 0 |");
    }
    for (k, n) in &by_kind {
        let _ = writeln!(s, "| {k} | {n} |");
    }
    if !violations.is_empty() {
        let _ = writeln!(s, "\nFirst violations:\n");
        for x in violations.iter().take(25) {
            let _ = writeln!(s, "- **{}** {}", x.kind, x.detail);
        }
    }
    s
}

/// Requests/s, answer kinds per second and the faults over time.
pub fn chart(
    log: &Log,
    faults: &[Injected],
    chaos_ms: u64,
    title: &str,
    path: &Path,
) -> Result<(), Box<dyn std::error::Error>> {
    let secs = (log.events.iter().map(|e| e.t_ms).max().unwrap_or(0) / 1000 + 1) as usize;
    let mut total = vec![0u32; secs];
    let mut per_kind: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    for e in &log.events {
        let i = (e.t_ms / 1000) as usize;
        if let Some(t) = total.get_mut(i) {
            *t += 1;
        }
        if let Some(c) = per_kind.entry(e.kind.as_str()).or_insert_with(|| vec![0; secs]).get_mut(i) {
            *c += 1;
        }
    }
    let mut kinds: Vec<(&str, Vec<u32>)> = per_kind.into_iter().collect();
    kinds.sort_by_key(|(_, v)| std::cmp::Reverse(v.iter().sum::<u32>()));
    kinds.truncate(9);
    let ymax = total.iter().copied().max().unwrap_or(1).max(1) as f64 * 1.15;
    let kmax = kinds.iter().flat_map(|(_, v)| v.iter().copied()).max().unwrap_or(1).max(1) as f64 * 1.1;

    let root = SVGBackend::new(path, (1400, 900)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(430);
    let x = 0f64..secs as f64;

    let mut c = ChartBuilder::on(&top)
        .caption(format!("{title}: requests/s and faults"), ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(50)
        .build_cartesian_2d(x.clone(), 0f64..ymax)?;
    c.configure_mesh().x_desc("s").y_desc("requests/s").draw()?;
    c.draw_series(LineSeries::new(
        total.iter().enumerate().map(|(i, n)| (i as f64 + 0.5, *n as f64)),
        BLACK.stroke_width(2),
    ))?
    .label("requests/s")
    .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLACK.stroke_width(2)));
    for (i, f) in faults.iter().enumerate() {
        let t = f.t_ms as f64 / 1000.0;
        let color = fault_color(f.kind);
        c.draw_series(LineSeries::new(vec![(t, 0.0), (t, ymax)], color.stroke_width(1)))?;
        let y = ymax * (0.97 - 0.07 * (i % 5) as f64);
        c.draw_series(std::iter::once(Text::new(
            f.kind.to_owned(),
            (t + 0.1, y),
            ("sans-serif", 11).into_font().color(&color),
        )))?;
    }
    let end = chaos_ms as f64 / 1000.0;
    c.draw_series(DashedLineSeries::new(vec![(end, 0.0), (end, ymax)], 6, 4, BLACK.stroke_width(1)))?;
    let label = ("sans-serif", 11).into_font().color(&BLACK);
    c.draw_series(std::iter::once(Text::new("chaos ends: settle, final polls", (end + 0.1, ymax * 0.6), label)))?;
    c.configure_series_labels().border_style(BLACK).background_style(WHITE.mix(0.8)).draw()?;

    let mut c = ChartBuilder::on(&bottom)
        .caption("answers per second, by kind", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(50)
        .build_cartesian_2d(x, 0f64..kmax)?;
    c.configure_mesh().x_desc("s").y_desc("answers/s").draw()?;
    for (i, (kind, v)) in kinds.iter().enumerate() {
        let color = KIND_COLORS[i % KIND_COLORS.len()];
        c.draw_series(LineSeries::new(
            v.iter().enumerate().map(|(i, n)| (i as f64 + 0.5, *n as f64)),
            color.stroke_width(2),
        ))?
        .label(kind.to_string())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()?;
    root.present()?;
    Ok(())
}

/// Nine colours told apart at a glance (the answer kinds' lines).
const KIND_COLORS: [RGBColor; 9] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(23, 190, 207),
];

fn fault_color(kind: &str) -> RGBColor {
    match kind {
        "envoy_kill9" => RGBColor(200, 0, 0),
        "idemd_kill9" => RGBColor(230, 120, 0),
        "demo_kill9" | "demo_crash_after_commit" => RGBColor(140, 0, 160),
        "redis_flushdb" | "redis_sigstop" => RGBColor(0, 120, 200),
        "pg_terminate" => RGBColor(0, 140, 60),
        _ => RGBColor(120, 120, 120),
    }
}
