//! Terminal results served inside Envoy (DESIGN §9): a replay needs no callout.
//!
//! DONE and FAILED never change, so the filter keeps them in Envoy's shared
//! data (process-wide, shared by every worker) and answers a retry from there.
//! Only terminal states are ever stored; IN_FLIGHT and NEEDS_REVIEW always go
//! to idemd. A cached replay makes the checks idemd makes: the same operation
//! key, subject and scope, and the same `param_hash` — a tampered retry is
//! still `params_changed` and a security event.
//!
//! Shared data is never evicted, so the key space is bounded: a fixed number
//! of slots, the slot chosen by the operation key; a new entry overwrites
//! whatever held its slot. Entries larger than the slot size are not cached.
//! An entry expires `ttl_s` after it was stored (at most idemd's retention).

use super::Effect;
use crate::protocol::{OpKey, StoredResult, TerminalState};
use serde::{Deserialize, Serialize};

pub use crate::policy::CacheConfig;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub key: OpKey,
    pub state: TerminalState,
    pub param_hash: String,
    pub subject_hash: String,
    pub scope: String,
    pub result: StoredResult,
    /// Unix seconds after which the entry is ignored.
    pub until: u64,
}

/// What a lookup found for this request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hit {
    Replay(TerminalState, StoredResult),
    /// The same operation, other bound fields: tampering.
    ParamMismatch,
}

/// The shared-data key of an operation's slot.
pub fn slot_key(cfg: &CacheConfig, key: &OpKey) -> Option<String> {
    if cfg.slots == 0 {
        return None;
    }
    // The operation key is uniformly random (or a SHA-256 prefix): its first 8 hex digits spread the slots.
    let head = key.as_str().get(..8).and_then(|h| u32::from_str_radix(h, 16).ok()).unwrap_or(0);
    Some(format!("idem.replay.{}", head % cfg.slots))
}

/// Look an operation up: a hit only for this very key, subject and scope, not expired.
pub fn lookup(
    raw: Option<&[u8]>,
    key: &OpKey,
    subject_hash: &str,
    scope: &str,
    param_hash: &str,
    now_s: u64,
) -> Option<Hit> {
    let entry: Entry = serde_json::from_slice(raw?).ok()?;
    if entry.key != *key || entry.subject_hash != subject_hash || entry.scope != scope || now_s >= entry.until {
        return None;
    }
    if entry.param_hash != param_hash {
        return Some(Hit::ParamMismatch);
    }
    Some(Hit::Replay(entry.state, entry.result))
}

/// The effect that stores a terminal result, if it fits.
pub fn store(cfg: &CacheConfig, entry: &Entry) -> Option<Effect> {
    let slot = slot_key(cfg, &entry.key)?;
    let value = serde_json::to_vec(entry).ok()?;
    (value.len() <= cfg.entry_bytes).then_some(Effect::SharedSet { key: slot, value })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: &OpKey) -> Entry {
        Entry {
            key: key.clone(),
            state: TerminalState::Done,
            param_hash: "p".into(),
            subject_hash: "u".into(),
            scope: "s".into(),
            result: StoredResult { status: 201, headers: vec![], body_b64: "e30".into() },
            until: 100,
        }
    }

    #[test]
    fn only_the_same_operation_subject_and_scope_hit_until_expiry() {
        let cfg = CacheConfig::default();
        let key = OpKey::from_bytes([0xab; 16]);
        let Some(Effect::SharedSet { key: slot, value }) = store(&cfg, &entry(&key)) else { panic!("not stored") };
        assert!(slot.starts_with("idem.replay."));
        let hit = |k: &OpKey, u: &str, s: &str, p: &str, now: u64| lookup(Some(&value), k, u, s, p, now);
        assert!(matches!(hit(&key, "u", "s", "p", 99), Some(Hit::Replay(TerminalState::Done, _))));
        assert_eq!(hit(&key, "u", "s", "other", 99), Some(Hit::ParamMismatch));
        assert_eq!(hit(&key, "u", "s", "p", 100), None, "expired exactly at until");
        assert_eq!(hit(&key, "mallory", "s", "p", 99), None);
        assert_eq!(hit(&key, "u", "refunds", "p", 99), None);
        assert_eq!(hit(&OpKey::from_bytes([0xac; 16]), "u", "s", "p", 99), None, "a slot shared by another key");
        assert_eq!(lookup(Some(b"garbage"), &key, "u", "s", "p", 1), None);
        assert_eq!(lookup(None, &key, "u", "s", "p", 1), None);
    }

    #[test]
    fn bounded_slots_and_entry_size() {
        let off = CacheConfig { slots: 0, ..CacheConfig::default() };
        let key = OpKey::from_bytes([1; 16]);
        assert_eq!(store(&off, &entry(&key)), None);
        let small = CacheConfig { entry_bytes: 10, ..CacheConfig::default() };
        assert_eq!(store(&small, &entry(&key)), None, "too large to cache");
        let four = CacheConfig { slots: 4, ..CacheConfig::default() };
        let slots: std::collections::BTreeSet<String> =
            (0..=255u8).filter_map(|b| slot_key(&four, &OpKey::from_bytes([b; 16]))).collect();
        assert_eq!(slots.len(), 4);
    }
}
