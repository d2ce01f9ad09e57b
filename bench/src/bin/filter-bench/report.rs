//! The report: a markdown table (stdout and target/bench/summary.md) and a chart
//! (target/bench/chart.svg; plotters' SVG backend only): each case's ratio
//! against its target, and the CPU per request in Envoy and idemd. A case runs on
//! the three hosts: its rows end in "(wasm)", "(native)" and "(ext_proc)", next to each other.

use crate::Opts;
use idem_e2e::BoxError;
use plotters::prelude::*;
use std::fmt::Write as _;
use std::path::Path;

/// idemd's store time for one store op, per request of a side.
#[derive(Debug, Clone, Default)]
pub(crate) struct StoreShare {
    pub(crate) op: String,
    pub(crate) us_per_request: f64,
    pub(crate) calls_per_request: f64,
}

/// A goal against the reps of one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Met {
    /// Every rep reached it.
    Yes,
    /// No rep reached it.
    No,
    /// Some reps did: the spread crosses the goal, so the run cannot say.
    Straddled,
}

/// One case against one baseline, from the same run.
#[derive(Debug, Clone, Default)]
pub(crate) struct Row {
    pub(crate) case: String,
    pub(crate) baseline: String,
    pub(crate) base_rate: f64,
    pub(crate) rate: f64,
    /// The measured side's median latency.
    pub(crate) p50_ms: f64,
    /// CPU µs per request, baseline side and measured side (None: that side does not run through it).
    pub(crate) base_envoy_us: Option<f64>,
    pub(crate) envoy_us: Option<f64>,
    pub(crate) base_idemd_us: Option<f64>,
    pub(crate) idemd_us: Option<f64>,
    pub(crate) store: Vec<StoreShare>,
    /// Measured / baseline, one per rep.
    pub(crate) ratios: Vec<f64>,
    pub(crate) target: Option<f64>,
    pub(crate) notes: String,
    /// Why the case has no numbers (an optional side that was not run).
    pub(crate) unmeasured: Option<String>,
}

impl Row {
    pub(crate) fn ratio(&self) -> f64 {
        median(&self.ratios)
    }

    /// Whether the goal is met, judged on every rep, not the median alone: the machine's noise moves
    /// a ratio between reps, and a goal the reps straddle is neither met nor missed.
    fn met(&self) -> Option<Met> {
        let t = self.target.filter(|_| self.unmeasured.is_none() && !self.ratios.is_empty())?;
        Some(if self.ratios.iter().all(|r| *r >= t) {
            Met::Yes
        } else if self.ratios.iter().all(|r| *r < t) {
            Met::No
        } else {
            Met::Straddled
        })
    }

    fn store_us(&self) -> f64 {
        self.store.iter().map(|s| s.us_per_request).fold(0.0, |a, b| a + b)
    }
}

pub(crate) fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v.get(n / 2).copied().unwrap_or(0.0),
        n => (v.get(n / 2 - 1).copied().unwrap_or(0.0) + v.get(n / 2).copied().unwrap_or(0.0)) / 2.0,
    }
}

/// What the report says about the run besides the rows.
pub(crate) struct Context {
    pub(crate) commit: String,
    pub(crate) wasm_bytes: u64,
    pub(crate) empty_wasm_bytes: u64,
    pub(crate) native_bytes: u64,
    pub(crate) lines: Vec<String>,
}

fn us(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.0}")).unwrap_or_else(|| "–".into())
}

/// The summary in markdown.
pub(crate) fn markdown(rows: &[Row], o: &Opts, ctx: &Context) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# filter-bench: DESIGN §9, measured side by side in one run");
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "Commit {}; {} s per run × {} interleaved reps (median of the per-rep ratios), {} keep-alive connections, \
         Envoy `--concurrency 1`. Chart: `target/bench/chart.svg`.",
        ctx.commit, o.seconds, o.reps, o.conns
    );
    let _ = writeln!(s);
    for line in &ctx.lines {
        let _ = writeln!(s, "- {line}");
    }
    let _ = writeln!(s);
    let _ = writeln!(s, "| case | baseline | baseline req/s | req/s | ratio | per rep | target | met | p50 ms |");
    let _ = writeln!(s, "|---|---|---:|---:|---:|---|---:|---|---:|");
    for r in rows {
        if let Some(why) = &r.unmeasured {
            let _ = writeln!(s, "| {} | {} | | | {why} | | | | |", r.case, r.baseline);
            continue;
        }
        let reps = r.ratios.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join(" / ");
        let target = r.target.map(|t| format!("≥ {t:.2}×")).unwrap_or_else(|| "–".into());
        let met = match r.met() {
            Some(Met::Yes) => "yes",
            Some(Met::No) => "**no**",
            Some(Met::Straddled) => "the reps straddle it",
            None => "",
        };
        let _ = writeln!(
            s,
            "| {} | {} | {:.0} | {:.0} | {:.2}× | {reps} | {target} | {met} | {:.2} |",
            r.case,
            r.baseline,
            r.base_rate,
            r.rate,
            r.ratio(),
            r.p50_ms
        );
    }
    let kb = |b: u64| b as f64 / 1024.0;
    let _ = writeln!(
        s,
        "| `.wasm` size | hundreds of KB | | {:.0} KB | | (the empty filter: {:.0} KB) | < 1 MB | {} | |",
        kb(ctx.wasm_bytes),
        kb(ctx.empty_wasm_bytes),
        if ctx.wasm_bytes < 1024 * 1024 { "yes" } else { "**no**" }
    );
    let _ = writeln!(s, "| native module `.so` size | – | | {:.0} KB | | | – | | |", kb(ctx.native_bytes));
    let _ = writeln!(s);
    let _ = writeln!(s, "## Where the time goes (per request)");
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "| case | Envoy CPU µs (baseline → this) | idemd CPU µs (baseline → this) | idemd store time µs | by store op: µs (calls) |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---|");
    // A side measured against two baselines is listed once.
    let mut seen = std::collections::BTreeSet::new();
    for r in rows.iter().filter(|r| r.unmeasured.is_none()) {
        if !seen.insert(r.case.trim_start_matches("(reference) ")) {
            continue;
        }
        let ops = r
            .store
            .iter()
            .map(|x| format!("{} {:.0} ({:.2})", x.op, x.us_per_request, x.calls_per_request))
            .collect::<Vec<_>>()
            .join(", ");
        let store = if r.store.is_empty() { "–".to_owned() } else { format!("{:.0}", r.store_us()) };
        let _ = writeln!(
            s,
            "| {} | {} → {} | {} → {} | {store} | {} |",
            r.case,
            us(r.base_envoy_us),
            us(r.envoy_us),
            us(r.base_idemd_us),
            us(r.idemd_us),
            if ops.is_empty() { "–".to_owned() } else { ops }
        );
    }
    let notes: Vec<&Row> = rows.iter().filter(|r| !r.notes.is_empty()).collect();
    if !notes.is_empty() {
        let _ = writeln!(s);
        for r in notes {
            let _ = writeln!(s, "- {}: {}", r.case, r.notes);
        }
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "ratio: median over the reps of (this side's rate / the baseline's rate in the same rep); met: yes when every \
         rep reaches the target, **no** when none does, \"the reps straddle it\" otherwise. CPU per request \
         from /proc (utime+stime, 10 ms ticks) of the Envoy and idemd processes over each timed run; store time \
         from idemd's `idem_store_latency_seconds` sum/count, scraped before and after each run (wall time inside \
         store calls, overlapping across connections). (wasm): the proxy-wasm filter; (native): the same filter as \
         the Envoy dynamic module; (ext_proc): Envoy's ext_proc filter (BUFFERED) in front of idemd's ext_proc \
         service, whose filter runs in idemd (its CPU is in the idemd column); all in the same Envoy, \
         interleaved with each other and the baselines. The \
         standalone proxy's row counts its own process's CPU in the Envoy column (not Redis's). Fresh-confirm fingerprints are minted before the clock \
         starts. Client, Envoy, demo, idemd and the stores share this machine's cores: foreign CPU above ~0.1 \
         cores makes the numbers noisy; re-run when the machine is quiet. The bench never asserts timings."
    );
    s
}

const GREEN: RGBColor = RGBColor(44, 160, 44);
const RED: RGBColor = RGBColor(214, 39, 40);
const GREY: RGBColor = RGBColor(150, 150, 150);
const LIGHT: RGBColor = RGBColor(200, 200, 200);
const BLUE: RGBColor = RGBColor(31, 119, 180);
const ORANGE: RGBColor = RGBColor(255, 127, 14);
/// The names of the native module's rows.
const PURPLE: RGBColor = RGBColor(118, 42, 131);
/// The names of the ext_proc host's rows.
const TEAL: RGBColor = RGBColor(1, 102, 94);

/// Ratio per case with its target marker; CPU µs per request per case.
pub(crate) fn chart(rows: &[Row], title: &str, path: &Path) -> Result<(), BoxError> {
    let n = rows.len().max(1);
    let height = 110 + 36 * n as u32;
    let root = SVGBackend::new(path, (1500, height)).into_drawing_area();
    root.fill(&WHITE)?;
    let (labels, rest) = root.split_horizontally(430);
    let (left, right) = rest.split_horizontally(520);
    let y = 0f64..n as f64;
    // Row i is drawn from the top.
    let band = |i: usize| (n - 1 - i) as f64;

    let xmax = rows.iter().map(|r| r.ratio().max(r.target.unwrap_or(0.0))).fold(1.2f64, f64::max) * 1.08;
    let mut c = ChartBuilder::on(&left)
        .caption(format!("{title}: ratio (bar) vs target (|)"), ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(0)
        .build_cartesian_2d(0f64..xmax, y.clone())?;
    c.configure_mesh().disable_y_mesh().disable_y_axis().x_desc("× baseline").draw()?;
    for (i, r) in rows.iter().enumerate() {
        let b = band(i);
        // The case's name, in the label column, level with its bar; the native module's in purple,
        // the ext_proc host's in teal.
        let (_, py) = c.backend_coord(&(0.0, b + 0.5));
        let name: String = r.case.chars().take(60).collect();
        let versus: String = format!("vs {}", r.baseline).chars().take(70).collect();
        let host_color = match r.case.rsplit_once('(').map(|(_, host)| host) {
            Some("native)") => PURPLE,
            Some("ext_proc)") => TEAL,
            _ => BLACK,
        };
        labels.draw(&Text::new(name, (8, py - 12), ("sans-serif", 12).into_font().color(&host_color)))?;
        labels.draw(&Text::new(versus, (16, py + 3), ("sans-serif", 10).into_font().color(&GREY)))?;
        if let Some(why) = &r.unmeasured {
            c.draw_series(std::iter::once(Text::new(why.clone(), (xmax * 0.01, b + 0.65), ("sans-serif", 11))))?;
            continue;
        }
        let color = match r.met() {
            Some(Met::Yes) => GREEN,
            Some(Met::No) => RED,
            Some(Met::Straddled) => ORANGE,
            None => GREY,
        };
        c.draw_series(std::iter::once(Rectangle::new([(0.0, b + 0.2), (r.ratio(), b + 0.8)], color.filled())))?;
        c.draw_series(std::iter::once(Text::new(
            format!("{:.2}", r.ratio()),
            (r.ratio().max(r.target.unwrap_or(0.0)) + xmax * 0.01, b + 0.65),
            ("sans-serif", 11).into_font(),
        )))?;
        if let Some(t) = r.target {
            c.draw_series(std::iter::once(PathElement::new(
                vec![(t, b + 0.05), (t, b + 0.95)],
                BLACK.stroke_width(3),
            )))?;
        }
    }
    c.draw_series(std::iter::once(PathElement::new(vec![(1.0, 0.0), (1.0, n as f64)], GREY.stroke_width(1))))?;

    let cmax = rows
        .iter()
        .map(|r| {
            let ours = r.envoy_us.unwrap_or(0.0) + r.idemd_us.unwrap_or(0.0);
            ours.max(r.base_envoy_us.unwrap_or(0.0) + r.base_idemd_us.unwrap_or(0.0))
        })
        .fold(10.0f64, f64::max)
        * 1.1;
    let mut c = ChartBuilder::on(&right)
        .caption("CPU µs per request: Envoy + idemd (baseline side: grey)", ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(0)
        .build_cartesian_2d(0f64..cmax, y)?;
    c.configure_mesh().disable_y_mesh().disable_y_axis().x_desc("µs / request").draw()?;
    for (i, r) in rows.iter().enumerate().filter(|(_, r)| r.unmeasured.is_none()) {
        let b = band(i);
        let (e, d) = (r.envoy_us.unwrap_or(0.0), r.idemd_us.unwrap_or(0.0));
        let (be, bd) = (r.base_envoy_us.unwrap_or(0.0), r.base_idemd_us.unwrap_or(0.0));
        c.draw_series(std::iter::once(Rectangle::new([(0.0, b + 0.1), (be + bd, b + 0.3)], LIGHT.filled())))?;
        c.draw_series(std::iter::once(Rectangle::new([(0.0, b + 0.35), (e, b + 0.85)], BLUE.filled())))?;
        c.draw_series(std::iter::once(Rectangle::new([(e, b + 0.35), (e + d, b + 0.85)], ORANGE.filled())))?;
        c.draw_series(std::iter::once(Text::new(
            format!("{e:.0} + {d:.0}"),
            (e + d + cmax * 0.01, b + 0.75),
            ("sans-serif", 11).into_font(),
        )))?;
    }
    root.present()?;
    Ok(())
}

/// Print the summary, and write it and the chart under target/bench/.
pub(crate) fn write(rows: &[Row], o: &Opts, ctx: &Context, dir: &Path) -> Result<(), BoxError> {
    let md = markdown(rows, o, ctx);
    println!("\n{md}");
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("summary.md"), &md)?;
    chart(rows, &format!("filter-bench @ {}", ctx.commit), &dir.join("chart.svg"))?;
    eprintln!("filter-bench: wrote {} and {}", dir.join("summary.md").display(), dir.join("chart.svg").display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{Met, Row};

    /// A goal is met when every rep reaches it, missed when none does, and neither when the reps
    /// straddle it: the median alone would call a run on either side of the noise.
    #[test]
    fn a_goal_is_judged_on_every_rep() {
        let row = |ratios: &[f64]| Row { ratios: ratios.to_vec(), target: Some(0.95), ..Row::default() };
        assert_eq!(row(&[0.96, 0.97, 1.2]).met(), Some(Met::Yes));
        assert_eq!(row(&[0.5, 0.6, 0.94]).met(), Some(Met::No));
        assert_eq!(row(&[0.90, 0.96, 0.97]).met(), Some(Met::Straddled), "the median passes, one rep does not");
        assert_eq!(row(&[0.90, 0.91, 0.97]).met(), Some(Met::Straddled), "the median fails, one rep passes");
        assert_eq!(Row { target: None, ..row(&[1.0]) }.met(), None);
        assert_eq!(row(&[]).met(), None, "no reps, no verdict");
    }
}
