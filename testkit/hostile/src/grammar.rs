//! The grammar the hostile upstream draws its answers from.
//!
//! Every answer is a [`Plan`] drawn from a ChaCha8 RNG seeded by the run's seed, the role (preview, confirm,
//! lookup) and a draw number: the same `(seed, role, draw)` is the same plan on every run and every machine.
//! A caller that wants its requests' answers reproducible whatever the timing (the soak's agents) names the
//! draw in the `x-hostile-draw` header; without one the upstream counts draws per role (reproducible for a
//! sequential caller, such as a test or the reconciler of a quiet stack).
//!
//! Each plan names its branches (`axis=value`, [`Plan::branches`]); the ledger counts them, so a run can say
//! what the upstream did to the guard.

use rand::Rng;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// What a request asks of the upstream, by path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// `POST /v1/transfers/preview`: a quote.
    Preview,
    /// `/v1/transfers`, any method: an execution.
    Confirm,
    /// `GET /v1/transfers/by-key/{key}` and `/by-ref/{ref}`: the reconciler asking "did it happen?".
    Lookup,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Preview => "preview",
            Role::Confirm => "confirm",
            Role::Lookup => "lookup",
        }
    }

    fn tag(self) -> u64 {
        match self {
            Role::Preview => 0x7072_6576,
            Role::Confirm => 0x636f_6e66,
            Role::Lookup => 0x6c6f_6f6b,
        }
    }
}

/// How a field named `fingerprint` is spelled in the answer's raw JSON text (a case-insensitive decoder, or
/// any JSON decoder for the escaped one, reads each as the field).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spelling {
    Lower,
    Capital,
    /// `"\u0066ingerprint"`: the same key once decoded.
    Escaped,
    Upper,
}

impl Spelling {
    pub const ALL: [Spelling; 4] = [Spelling::Lower, Spelling::Capital, Spelling::Escaped, Spelling::Upper];

    /// The key as it appears in the JSON text, quotes included.
    pub fn raw_key(self) -> &'static str {
        match self {
            Spelling::Lower => "\"fingerprint\"",
            Spelling::Capital => "\"Fingerprint\"",
            Spelling::Escaped => "\"\\u0066ingerprint\"",
            Spelling::Upper => "\"FINGERPRINT\"",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Spelling::Lower => "lower",
            Spelling::Capital => "capital",
            Spelling::Escaped => "escaped",
            Spelling::Upper => "upper",
        }
    }
}

/// What a self-named field holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NamedValue {
    /// Something that is no fingerprint at all.
    Garbage,
    /// A fingerprint the upstream saw in an earlier request (another operation's, most likely): the echo of an
    /// upstream that writes the fingerprint itself (DESIGN §6). Garbage when it has seen none yet.
    Stale,
}

/// The shape of an answer's JSON body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// What the demo answers.
    Plain,
    /// The answer plus the request echoed: its top-level fields where the answer has none of that name (a
    /// `fingerprint` the agent sent comes back), and the whole request under `request`.
    Echo,
    /// The answer with a top-level field of its own named `fingerprint`, first or last in the object.
    Named { value: NamedValue, spelling: Spelling, first: bool },
}

impl Shape {
    fn name(self) -> String {
        match self {
            Shape::Plain => "plain".into(),
            Shape::Echo => "echo".into(),
            Shape::Named { value, spelling, first } => {
                let v = if value == NamedValue::Stale { "stale" } else { "garbage" };
                format!("named.{}.{v}.{}", spelling.name(), if first { "first" } else { "last" })
            }
        }
    }
}

/// A quote's expiry as the upstream states it, relative to its own clock and the fingerprint TTL it expects of
/// the route (`Config::ttl_hint_s`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stated {
    /// Expires before the fingerprint would (half its TTL): the gateway must cut `exp` to it.
    Before,
    /// Expires exactly when the fingerprint would.
    At,
    /// Outlives the fingerprint (ten TTLs).
    After,
    /// Already expired: no fingerprint may be minted.
    Past,
    /// Unix seconds as a string of digits (two TTLs).
    Digits,
    /// An RFC 3339 time (two TTLs).
    Rfc3339,
    /// Text that is no time.
    Garbage,
    /// Not stated at all.
    Missing,
}

impl Stated {
    pub fn name(self) -> &'static str {
        match self {
            Stated::Before => "before",
            Stated::At => "at",
            Stated::After => "after",
            Stated::Past => "past",
            Stated::Digits => "digits",
            Stated::Rfc3339 => "rfc3339",
            Stated::Garbage => "garbage",
            Stated::Missing => "missing",
        }
    }
}

/// The `quote-expires-at` header(s) of a preview answer (read by routes with `quote_expires: header:…`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuoteHeader {
    Absent,
    Once(Stated),
    /// The header twice, with two different values: the guard must refuse, never pick one.
    Twice(Stated, Stated),
    /// Present and empty.
    Empty,
}

impl QuoteHeader {
    fn name(self) -> String {
        match self {
            QuoteHeader::Absent => "absent".into(),
            QuoteHeader::Once(s) => format!("once.{}", s.name()),
            QuoteHeader::Twice(a, b) => format!("twice.{}.{}", a.name(), b.name()),
            QuoteHeader::Empty => "empty".into(),
        }
    }
}

/// How the answer travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// One sized body.
    Whole,
    /// Chunked transfer (no length), in `parts` with `pause_ms` between them.
    Chunked { parts: u8, pause_ms: u64 },
    /// A `Content-Length`, then the body in `parts` with pauses: a body that streams.
    Sized { parts: u8, pause_ms: u64 },
    /// A `Content-Length`, half the body, then the connection (HTTP/1.1) or stream (h2) is cut.
    Truncated,
    /// Nothing for `ms`, then the whole answer.
    HeadPause { ms: u64 },
}

impl Delivery {
    fn name(self) -> &'static str {
        match self {
            Delivery::Whole => "whole",
            Delivery::Chunked { .. } => "chunked",
            Delivery::Sized { .. } => "sized_parts",
            Delivery::Truncated => "truncated",
            Delivery::HeadPause { .. } => "head_pause",
        }
    }
}

/// Headers an odd upstream adds, some of them headers the guard writes or reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Garbage {
    /// `content-type` twice (JSON and text).
    RepeatedContentType,
    /// `agent-fingerprint` of the upstream's own (the header the gateway mints into).
    UpstreamFingerprintHeader,
    /// `idempotency-key` naming another key.
    ForeignKey,
    /// `idempotent-replayed: true` on a first answer.
    Replayed,
    /// A header value with bytes that are not UTF-8.
    NonUtf8,
    /// `retry-after: soon`.
    RetryAfterText,
}

impl Garbage {
    pub const ALL: [Garbage; 6] = [
        Garbage::RepeatedContentType,
        Garbage::UpstreamFingerprintHeader,
        Garbage::ForeignKey,
        Garbage::Replayed,
        Garbage::NonUtf8,
        Garbage::RetryAfterText,
    ];

    fn name(self) -> &'static str {
        match self {
            Garbage::RepeatedContentType => "repeated_content_type",
            Garbage::UpstreamFingerprintHeader => "upstream_fingerprint_header",
            Garbage::ForeignKey => "foreign_idempotency_key",
            Garbage::Replayed => "idempotent_replayed_true",
            Garbage::NonUtf8 => "non_utf8_value",
            Garbage::RetryAfterText => "retry_after_text",
        }
    }
}

/// What a preview answers instead of a quote, sometimes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreviewStatus {
    /// 200 and a quote.
    Quote,
    /// This 5xx with an HTML body.
    Error(u16),
    /// 200 with a body that is not JSON.
    Text,
    /// 200 with a JSON array, not an object.
    Array,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreviewPlan {
    pub status: PreviewStatus,
    pub shape: Shape,
    /// `expires_at` in the body (routes with `quote_expires: /expires_at`).
    pub expires_at: Stated,
    pub quote_header: QuoteHeader,
    /// The upstream's clock against the real one, seconds (ahead > 0).
    pub skew_s: i64,
    pub delivery: Delivery,
    pub garbage: Vec<Garbage>,
}

/// What a confirm does and answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Executes, answers this 2xx with the record.
    Execute(u16),
    /// Executes (committed), then answers this 5xx: the guard cannot know it ran.
    ExecuteThenError(u16),
    /// Executes, then cuts the connection (or stream) without an answer.
    ExecuteThenReset,
    /// Executes, then waits `ms` before answering (past the route's timeout, often).
    ExecuteSlow { ms: u64 },
    /// Refuses with this 4xx before executing: a definite failure.
    Refuse(u16),
    /// 429 with `retry-after`, before executing.
    Busy,
}

impl Outcome {
    pub fn name(self) -> String {
        match self {
            Outcome::Execute(s) => format!("execute_{s}"),
            Outcome::ExecuteThenError(s) => format!("execute_then_{s}"),
            Outcome::ExecuteThenReset => "execute_then_reset".into(),
            Outcome::ExecuteSlow { .. } => "execute_slow".into(),
            Outcome::Refuse(s) => format!("refuse_{s}"),
            Outcome::Busy => "busy_429".into(),
        }
    }

    /// Whether the business action happens.
    pub fn executes(self) -> bool {
        !matches!(self, Outcome::Refuse(_) | Outcome::Busy)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfirmPlan {
    pub outcome: Outcome,
    pub shape: Shape,
    pub delivery: Delivery,
    pub garbage: Vec<Garbage>,
}

/// How a lookup (by key or by reference) answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LookupPlan {
    /// The first record with that key or reference (another operation's, where two share a reference), or 404.
    Honest,
    /// Honest, after `ms`.
    Slow { ms: u64 },
    /// This 5xx.
    Error(u16),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    Preview(PreviewPlan),
    Confirm(ConfirmPlan),
    Lookup(LookupPlan),
}

impl Plan {
    /// `role.axis=value` for every axis of this plan: what the ledger counts.
    pub fn branches(&self) -> Vec<String> {
        let garbage = |role: &str, g: &[Garbage]| -> Vec<String> {
            if g.is_empty() {
                vec![format!("{role}.headers=clean")]
            } else {
                g.iter().map(|g| format!("{role}.headers={}", g.name())).collect()
            }
        };
        match self {
            Plan::Preview(p) => {
                let status = match p.status {
                    PreviewStatus::Quote => "quote".to_owned(),
                    PreviewStatus::Error(s) => format!("error_{s}"),
                    PreviewStatus::Text => "text".to_owned(),
                    PreviewStatus::Array => "array".to_owned(),
                };
                let mut out = vec![format!("preview.answer={status}")];
                if p.status == PreviewStatus::Quote {
                    out.push(format!("preview.shape={}", p.shape.name()));
                    out.push(format!("preview.expires_at={}", p.expires_at.name()));
                }
                out.push(format!("preview.quote_header={}", p.quote_header.name()));
                out.push(format!("preview.clock={:+}s", p.skew_s));
                out.push(format!("preview.delivery={}", p.delivery.name()));
                out.extend(garbage("preview", &p.garbage));
                out
            }
            Plan::Confirm(c) => {
                let mut out = vec![format!("confirm.outcome={}", c.outcome.name())];
                out.push(format!("confirm.shape={}", c.shape.name()));
                out.push(format!("confirm.delivery={}", c.delivery.name()));
                out.extend(garbage("confirm", &c.garbage));
                out
            }
            Plan::Lookup(l) => vec![match l {
                LookupPlan::Honest => "lookup.answer=honest".to_owned(),
                LookupPlan::Slow { .. } => "lookup.answer=slow".to_owned(),
                LookupPlan::Error(s) => format!("lookup.answer=error_{s}"),
            }],
        }
    }
}

/// The seeded grammar.
#[derive(Debug, Clone, Copy)]
pub struct Grammar {
    pub seed: u64,
}

/// Picks by weight: `(weight, value)`; the weights need not sum to anything.
fn pick<T: Copy>(rng: &mut ChaCha8Rng, table: &[(u32, T)]) -> T {
    let total: u32 = table.iter().map(|(w, _)| *w).sum();
    let mut x = rng.gen_range(0..total.max(1));
    for (w, v) in table {
        if x < *w {
            return *v;
        }
        x -= *w;
    }
    // Unreachable with a non-empty table; the last entry otherwise.
    table[table.len() - 1].1
}

impl Grammar {
    pub fn new(seed: u64) -> Grammar {
        Grammar { seed }
    }

    fn rng(&self, role: Role, draw: u64) -> ChaCha8Rng {
        let mix =
            role.tag().wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ draw.wrapping_add(1).wrapping_mul(0xD6E8_FEB8_6659_FD93);
        ChaCha8Rng::seed_from_u64(self.seed ^ mix)
    }

    /// Plan number `draw` of `role`.
    pub fn draw(&self, role: Role, draw: u64) -> Plan {
        let mut rng = self.rng(role, draw);
        match role {
            Role::Preview => Plan::Preview(preview(&mut rng)),
            Role::Confirm => Plan::Confirm(confirm(&mut rng)),
            Role::Lookup => Plan::Lookup(lookup(&mut rng)),
        }
    }

    /// The first draw of `role` (below `limit`) whose plan satisfies `want`: how a test asks for a branch.
    pub fn find(&self, role: Role, limit: u64, want: impl Fn(&Plan) -> bool) -> Option<u64> {
        (0..limit).find(|d| want(&self.draw(role, *d)))
    }
}

fn shape(rng: &mut ChaCha8Rng) -> Shape {
    match pick(rng, &[(40, 0u8), (25, 1), (35, 2)]) {
        0 => Shape::Plain,
        1 => Shape::Echo,
        _ => Shape::Named {
            value: if rng.gen_bool(0.5) { NamedValue::Stale } else { NamedValue::Garbage },
            spelling: Spelling::ALL[rng.gen_range(0..Spelling::ALL.len())],
            first: rng.gen_bool(0.5),
        },
    }
}

fn stated(rng: &mut ChaCha8Rng) -> Stated {
    pick(
        rng,
        &[
            (40, Stated::After),
            (15, Stated::Before),
            (10, Stated::At),
            (8, Stated::Past),
            (7, Stated::Digits),
            (10, Stated::Rfc3339),
            (5, Stated::Garbage),
            (5, Stated::Missing),
        ],
    )
}

fn delivery(rng: &mut ChaCha8Rng) -> Delivery {
    match pick(rng, &[(55, 0u8), (15, 1), (15, 2), (5, 3), (10, 4)]) {
        0 => Delivery::Whole,
        1 => Delivery::Chunked { parts: rng.gen_range(2..6), pause_ms: rng.gen_range(0..300) },
        2 => Delivery::Sized { parts: rng.gen_range(2..6), pause_ms: rng.gen_range(0..300) },
        3 => Delivery::Truncated,
        _ => Delivery::HeadPause { ms: rng.gen_range(200..2500) },
    }
}

fn garbage(rng: &mut ChaCha8Rng) -> Vec<Garbage> {
    Garbage::ALL.iter().copied().filter(|_| rng.gen_bool(0.08)).collect()
}

fn preview(rng: &mut ChaCha8Rng) -> PreviewPlan {
    let status = match pick(rng, &[(85, 0u8), (6, 1), (2, 2), (2, 3), (5, 4)]) {
        0 => PreviewStatus::Quote,
        1 => PreviewStatus::Error([500, 502, 503][rng.gen_range(0..3)]),
        2 => PreviewStatus::Text,
        3 => PreviewStatus::Array,
        _ => PreviewStatus::Quote,
    };
    let shape = shape(rng);
    let expires_at = stated(rng);
    let quote_header = match pick(rng, &[(30, 0u8), (50, 1), (15, 2), (5, 3)]) {
        0 => QuoteHeader::Absent,
        1 => QuoteHeader::Once(stated(rng)),
        2 => {
            let a = stated(rng);
            // Two different values, so no reading of "the" value is right.
            let b = match stated(rng) {
                b if b != a => b,
                _ if a == Stated::After => Stated::Before,
                _ => Stated::After,
            };
            QuoteHeader::Twice(a, b)
        }
        _ => QuoteHeader::Empty,
    };
    let skew_s = pick(rng, &[(60, 0i64), (15, 30), (15, -10), (10, -120)]);
    PreviewPlan { status, shape, expires_at, quote_header, skew_s, delivery: delivery(rng), garbage: garbage(rng) }
}

fn confirm(rng: &mut ChaCha8Rng) -> ConfirmPlan {
    let outcome = match pick(rng, &[(55, 0u8), (5, 1), (10, 2), (5, 3), (8, 4), (7, 5), (5, 6)]) {
        0 => Outcome::Execute(201),
        1 => Outcome::Execute(200),
        2 => Outcome::ExecuteThenError([500, 502, 504][rng.gen_range(0..3)]),
        3 => Outcome::ExecuteThenReset,
        4 => Outcome::ExecuteSlow { ms: rng.gen_range(500..3500) },
        5 => Outcome::Refuse(if rng.gen_bool(0.7) { 422 } else { 400 }),
        _ => Outcome::Busy,
    };
    ConfirmPlan { outcome, shape: shape(rng), delivery: delivery(rng), garbage: garbage(rng) }
}

fn lookup(rng: &mut ChaCha8Rng) -> LookupPlan {
    match pick(rng, &[(75, 0u8), (10, 1), (15, 2)]) {
        0 => LookupPlan::Honest,
        1 => LookupPlan::Slow { ms: rng.gen_range(1200..2500) },
        _ => LookupPlan::Error(if rng.gen_bool(0.5) { 500 } else { 503 }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn the_same_seed_and_draw_is_the_same_plan() {
        let (a, b, c) = (Grammar::new(7), Grammar::new(7), Grammar::new(8));
        for role in [Role::Preview, Role::Confirm, Role::Lookup] {
            let first: Vec<Plan> = (0..200).map(|d| a.draw(role, d)).collect();
            let again: Vec<Plan> = (0..200).map(|d| b.draw(role, d)).collect();
            let other: Vec<Plan> = (0..200).map(|d| c.draw(role, d)).collect();
            assert_eq!(first, again, "{role:?}");
            assert_ne!(first, other, "{role:?}: another seed draws other plans");
        }
        // Draws do not depend on the order they are made in (a caller names its draw).
        assert_eq!(a.draw(Role::Confirm, 41), Grammar::new(7).draw(Role::Confirm, 41));
    }

    #[test]
    fn the_roles_draw_independently() {
        let g = Grammar::new(3);
        let p: Vec<String> = (0..50).flat_map(|d| g.draw(Role::Preview, d).branches()).collect();
        assert!(p.iter().all(|b| b.starts_with("preview.")));
        let c: Vec<String> = (0..50).flat_map(|d| g.draw(Role::Confirm, d).branches()).collect();
        assert!(c.iter().all(|b| b.starts_with("confirm.")));
    }

    /// Every branch the issue names is drawn within a few thousand requests, for any seed tried.
    #[test]
    fn every_branch_is_reachable() {
        for seed in [1, 20_261_130, u64::MAX] {
            let g = Grammar::new(seed);
            let seen: BTreeSet<String> = [Role::Preview, Role::Confirm, Role::Lookup]
                .iter()
                .flat_map(|r| (0..3000).flat_map(move |d| g.draw(*r, d).branches()))
                .collect();
            let has = |p: &str| seen.iter().any(|b| b.starts_with(p));
            for want in [
                "preview.answer=quote",
                "preview.answer=error_5",
                "preview.answer=text",
                "preview.answer=array",
                "preview.shape=echo",
                "preview.shape=named.lower.stale",
                "preview.shape=named.capital",
                "preview.shape=named.escaped",
                "preview.shape=named.upper",
                "preview.expires_at=before",
                "preview.expires_at=at",
                "preview.expires_at=after",
                "preview.expires_at=past",
                "preview.expires_at=garbage",
                "preview.quote_header=twice.",
                "preview.quote_header=once.past",
                "preview.quote_header=once.garbage",
                "preview.quote_header=empty",
                "preview.clock=+30s",
                "preview.clock=-10s",
                "preview.clock=-120s",
                "preview.delivery=chunked",
                "preview.delivery=sized_parts",
                "preview.delivery=truncated",
                "preview.delivery=head_pause",
                "preview.headers=non_utf8_value",
                "confirm.outcome=execute_201",
                "confirm.outcome=execute_then_5",
                "confirm.outcome=execute_then_reset",
                "confirm.outcome=execute_slow",
                "confirm.outcome=refuse_422",
                "confirm.outcome=busy_429",
                "confirm.shape=echo",
                "confirm.headers=upstream_fingerprint_header",
                "lookup.answer=honest",
                "lookup.answer=slow",
                "lookup.answer=error_5",
            ] {
                assert!(has(want), "seed {seed}: no {want} in 3000 draws");
            }
        }
    }

    #[test]
    fn a_repeated_quote_header_never_repeats_one_value() {
        let g = Grammar::new(11);
        for d in 0..3000 {
            if let Plan::Preview(PreviewPlan { quote_header: QuoteHeader::Twice(a, b), .. }) = g.draw(Role::Preview, d)
            {
                assert_ne!(a, b, "draw {d}");
            }
        }
    }

    #[test]
    fn find_names_the_draw_of_a_branch() {
        let g = Grammar::new(5);
        let d = g.find(Role::Confirm, 1000, |p| matches!(p, Plan::Confirm(c) if c.outcome == Outcome::Busy));
        let d = d.expect("a busy confirm within 1000 draws");
        assert!(matches!(g.draw(Role::Confirm, d), Plan::Confirm(c) if c.outcome == Outcome::Busy));
    }
}
