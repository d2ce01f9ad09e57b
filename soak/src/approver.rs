//! The approver: a person at idemd's approval API (`GET /v1/approvals`, `POST /v1/approvals/{key}` with the
//! approver's own credential, `--approvers`), while the faults run. Each operation waiting is drawn once (seeded by
//! the run's seed and the key): approve, reject, or leave it to lapse at its fingerprint's `exp` (6 s on the soak's
//! approval route). A decision comes 0–2.5 s after the approver first saw it waiting, or, one in six, 5–8 s after: late,
//! past `exp` mostly (idemd refuses those, 410, and the operation lapses).

use crate::agents::Ctx;
use crate::record::since_ms;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the approver meant to do with one waiting operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Intent {
    Approve,
    Reject,
    /// Left alone: it lapses at `exp`.
    Leave,
}

impl Intent {
    pub fn name(self) -> &'static str {
        match self {
            Intent::Approve => "approve",
            Intent::Reject => "reject",
            Intent::Leave => "leave",
        }
    }
}

/// One decision sent, and idemd's answer (0: no answer, the replica was down or killed).
#[derive(Debug, Clone)]
pub struct Sent {
    pub t_ms: u64,
    pub key: String,
    pub intent: Intent,
    pub http: u16,
}

/// Everything the approver did.
#[derive(Debug, Clone, Default)]
pub struct ApproverLog {
    /// Operations seen waiting, with what was drawn for each.
    pub seen: HashMap<String, Intent>,
    pub sent: Vec<Sent>,
    /// Listings that failed (a replica down, SQL away).
    pub list_failures: u64,
}

/// How long the approver keeps looking after the chaos (what waits then is decided, or lapses).
pub const AFTER_CHAOS: Duration = Duration::from_secs(3);

fn draw(seed: u64, key: &str) -> (Intent, u64) {
    let k = u64::from_str_radix(key.get(..16).unwrap_or("0"), 16).unwrap_or(0);
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ k ^ 0xA77_2011);
    let intent = match rng.gen_range(0..100) {
        0..=59 => Intent::Approve,
        60..=84 => Intent::Reject,
        _ => Intent::Leave,
    };
    let wait_ms = if rng.gen_bool(1.0 / 6.0) { rng.gen_range(5_000..8_000) } else { rng.gen_range(0..2_500) };
    (intent, wait_ms)
}

/// Runs until `ctx.deadline + AFTER_CHAOS`; `sidecars`: the two replicas' base URLs.
pub async fn approver(ctx: Arc<Ctx>, sidecars: [String; 2], seed: u64, credential: String) -> ApproverLog {
    let mut log = ApproverLog::default();
    // key → when the decision is due (after first seen), for those not left alone.
    let mut due: HashMap<String, Instant> = HashMap::new();
    let mut replica = 0usize;
    let until = ctx.deadline + AFTER_CHAOS;
    while Instant::now() < until {
        let listed = list(&ctx, &sidecars[replica % 2], &credential).await;
        let pending = match listed {
            Some(p) => p,
            None => {
                log.list_failures += 1;
                replica += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        for key in pending {
            if log.seen.contains_key(&key) {
                continue;
            }
            let (intent, wait_ms) = draw(seed, &key);
            log.seen.insert(key.clone(), intent);
            if intent != Intent::Leave {
                due.insert(key, Instant::now() + Duration::from_millis(wait_ms));
            }
        }
        let now = Instant::now();
        let ready: Vec<String> = due.iter().filter(|(_, at)| **at <= now).map(|(k, _)| k.clone()).collect();
        for key in ready {
            let intent = log.seen.get(&key).copied().unwrap_or(Intent::Leave);
            let http = decide(&ctx, &sidecars[replica % 2], &credential, &key, intent).await;
            log.sent.push(Sent { t_ms: since_ms(ctx.start), key: key.clone(), intent, http });
            match http {
                // No answer, or SQL away: try again on the other replica next round (the decision may have
                // committed; then the retry hears 409).
                0 | 503 => replica += 1,
                _ => {
                    due.remove(&key);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    log
}

/// The keys waiting now, or `None` when the listing failed.
async fn list(ctx: &Ctx, base: &str, credential: &str) -> Option<Vec<String>> {
    let r = ctx.http.get(format!("{base}/v1/approvals")).bearer_auth(credential).send().await.ok()?;
    if !r.status().is_success() {
        return None;
    }
    let v: Value = r.json().await.ok()?;
    let items = v["pending"].as_array()?;
    Some(items.iter().filter_map(|p| p["key"].as_str().map(str::to_owned)).collect())
}

async fn decide(ctx: &Ctx, base: &str, credential: &str, key: &str, intent: Intent) -> u16 {
    let reason = match intent {
        Intent::Approve => "soak: within budget",
        _ => "soak: payee not on the list",
    };
    let body = json!({"decision": intent.name(), "reason": reason});
    match ctx.http.post(format!("{base}/v1/approvals/{key}")).bearer_auth(credential).json(&body).send().await {
        Ok(r) => r.status().as_u16(),
        Err(_) => 0,
    }
}
