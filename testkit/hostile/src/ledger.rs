//! What the hostile upstream did: every execution (the witness a test holds the guard's answers against),
//! every confirm delivered per key, every quote with the expiry it stated, and how often each grammar branch
//! was drawn. Read in process ([`Ledger`]) or over HTTP (`GET /v1/executions`, `GET /v1/hostile/ledger`).

use serde_json::{json, Value};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;

/// One real execution.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Execution {
    /// The `Idempotency-Key` it came with (None: none).
    pub key: Option<String>,
    pub transfer_id: String,
    pub client_ref: Option<String>,
    pub method: String,
    /// The record as stored (what a lookup answers, byte for byte).
    pub record: String,
    /// The confirm branch that executed it (`Outcome`'s name).
    pub outcome: String,
    pub at_unix_ms: u64,
}

/// One quote answered, with what it stated about its expiry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quote {
    pub quote_id: String,
    /// `expires_at` as written in the body (None: absent).
    pub expires_at: Option<Value>,
    /// Every `quote-expires-at` header value, in order.
    pub header_values: Vec<String>,
    /// The upstream's clock against the real one, seconds.
    pub skew_s: i64,
    /// Real time it was answered, unix seconds.
    pub at_unix_s: u64,
    /// Whether its body was sent whole (a truncated one may never have reached anyone).
    pub complete: bool,
}

#[derive(Default)]
struct Inner {
    executions: Vec<Execution>,
    /// Confirms delivered per key ("" for none), executed or not.
    attempts: BTreeMap<String, u64>,
    branches: BTreeMap<String, u64>,
    quotes: BTreeMap<String, Quote>,
    /// Fingerprints seen in requests (header or body), newest last: what a stale answer echoes.
    seen: VecDeque<String>,
    draws: BTreeMap<&'static str, u64>,
}

/// How many fingerprints the upstream remembers for its echoes.
const REMEMBER: usize = 64;

#[derive(Default)]
pub struct Ledger {
    inner: Mutex<Inner>,
}

impl Ledger {
    pub fn new() -> Ledger {
        Ledger::default()
    }

    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        // A poisoned lock only means a handler panicked mid-update; the ledger stays readable.
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g)
    }

    /// Records an execution and returns its position.
    pub fn execute(&self, x: Execution) -> usize {
        self.with(|i| {
            i.executions.push(x);
            i.executions.len() - 1
        })
    }

    /// A confirm arrived with this key (None: without one).
    pub fn attempt(&self, key: Option<&str>) -> u64 {
        self.with(|i| {
            let n = i.attempts.entry(key.unwrap_or("").to_owned()).or_default();
            *n += 1;
            *n
        })
    }

    pub fn count_branches(&self, branches: &[String]) {
        self.with(|i| {
            for b in branches {
                *i.branches.entry(b.clone()).or_default() += 1;
            }
        })
    }

    /// The next draw number of a role for requests that name none.
    pub fn next_draw(&self, role: &'static str) -> u64 {
        self.with(|i| {
            let n = i.draws.entry(role).or_default();
            *n += 1;
            *n - 1
        })
    }

    pub fn quote(&self, q: Quote) {
        self.with(|i| {
            i.quotes.insert(q.quote_id.clone(), q);
        })
    }

    /// A fingerprint seen in a request, remembered for stale echoes.
    pub fn saw_fingerprint(&self, fp: &str) {
        self.with(|i| {
            if i.seen.back().is_some_and(|l| l == fp) {
                return;
            }
            i.seen.push_back(fp.to_owned());
            if i.seen.len() > REMEMBER {
                i.seen.pop_front();
            }
        })
    }

    /// The `n`-th most recent fingerprint seen (0: the newest), if any.
    pub fn stale_fingerprint(&self, n: usize) -> Option<String> {
        self.with(|i| {
            let len = i.seen.len();
            (len > 0).then(|| i.seen[len - 1 - n % len].clone())
        })
    }

    pub fn executions(&self) -> Vec<Execution> {
        self.with(|i| i.executions.clone())
    }

    /// Executions per `Idempotency-Key` (executions without one are in `executions()` only).
    pub fn executions_by_key(&self) -> BTreeMap<String, u64> {
        self.with(|i| {
            let mut m = BTreeMap::new();
            for x in &i.executions {
                if let Some(k) = &x.key {
                    *m.entry(k.clone()).or_default() += 1;
                }
            }
            m
        })
    }

    /// The first execution under this key.
    pub fn first_by_key(&self, key: &str) -> Option<Execution> {
        self.with(|i| i.executions.iter().find(|x| x.key.as_deref() == Some(key)).cloned())
    }

    /// The first execution sent with this business reference, whichever operation it was.
    pub fn first_by_ref(&self, client_ref: &str) -> Option<Execution> {
        self.with(|i| i.executions.iter().find(|x| x.client_ref.as_deref() == Some(client_ref)).cloned())
    }

    /// The execution whose record names this transfer.
    pub fn by_transfer(&self, transfer_id: &str) -> Option<Execution> {
        self.with(|i| i.executions.iter().find(|x| x.transfer_id == transfer_id).cloned())
    }

    pub fn branch_counts(&self) -> BTreeMap<String, u64> {
        self.with(|i| i.branches.clone())
    }

    pub fn quotes(&self) -> BTreeMap<String, Quote> {
        self.with(|i| i.quotes.clone())
    }

    pub fn attempts_by_key(&self) -> BTreeMap<String, u64> {
        self.with(|i| i.attempts.clone())
    }

    /// The demo's `GET /v1/executions` shape (`total`, `by_key`, `attempts`, `attempts_by_key`), so a test
    /// written against the demo reads this upstream unchanged.
    pub fn executions_json(&self) -> Value {
        let by_key = self.executions_by_key();
        let attempts = self.attempts_by_key();
        let total = self.with(|i| i.executions.len());
        let attempts_total: u64 = attempts.values().sum();
        let attempts_by_key: BTreeMap<&String, &u64> = attempts.iter().filter(|(k, _)| !k.is_empty()).collect();
        json!({ "total": total, "by_key": by_key, "attempts": attempts_total, "attempts_by_key": attempts_by_key })
    }

    /// Everything: the executions, the quotes, the branch counts.
    pub fn to_json(&self) -> Value {
        let mut v = self.executions_json();
        let executions: Vec<Value> = self
            .executions()
            .iter()
            .map(|x| {
                json!({
                    "key": x.key, "transfer_id": x.transfer_id, "client_ref": x.client_ref, "method": x.method,
                    "outcome": x.outcome, "at_unix_ms": x.at_unix_ms, "record": x.record,
                })
            })
            .collect();
        let quotes: BTreeMap<String, Value> = self
            .quotes()
            .into_iter()
            .map(|(id, q)| {
                let q = json!({
                    "expires_at": q.expires_at, "header_values": q.header_values, "skew_s": q.skew_s,
                    "at_unix_s": q.at_unix_s, "complete": q.complete,
                });
                (id, q)
            })
            .collect();
        v["executions"] = json!(executions);
        v["quotes"] = json!(quotes);
        v["branches"] = json!(self.branch_counts());
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exec(key: Option<&str>, tid: &str, client_ref: Option<&str>) -> Execution {
        Execution {
            key: key.map(str::to_owned),
            transfer_id: tid.into(),
            client_ref: client_ref.map(str::to_owned),
            method: "POST".into(),
            record: format!(r#"{{"transfer_id":"{tid}"}}"#),
            outcome: "execute_201".into(),
            at_unix_ms: 1,
        }
    }

    #[test]
    fn executions_are_counted_per_key_and_found_by_key_and_reference() {
        let l = Ledger::new();
        l.execute(exec(Some("k1"), "t_1", Some("inv-1")));
        l.execute(exec(Some("k2"), "t_2", Some("inv-1")));
        l.execute(exec(Some("k1"), "t_3", None));
        l.execute(exec(None, "t_4", None));
        let by_key = l.executions_by_key();
        assert_eq!(by_key.get("k1"), Some(&2), "a key executed twice shows as 2");
        assert_eq!(by_key.get("k2"), Some(&1));
        assert_eq!(by_key.len(), 2, "an execution without a key is in no key's count");
        assert_eq!(l.first_by_key("k1").map(|x| x.transfer_id), Some("t_1".into()));
        // A shared reference names the first operation that used it, whichever asks.
        assert_eq!(l.first_by_ref("inv-1").map(|x| x.transfer_id), Some("t_1".into()));
        assert_eq!(l.by_transfer("t_3").and_then(|x| x.key), Some("k1".into()));
        assert!(l.first_by_key("k9").is_none());
        let v = l.executions_json();
        assert_eq!(v["total"], 4);
        assert_eq!(v["by_key"]["k1"], 2);
    }

    #[test]
    fn attempts_count_every_delivery() {
        let l = Ledger::new();
        assert_eq!(l.attempt(Some("k")), 1);
        assert_eq!(l.attempt(Some("k")), 2);
        assert_eq!(l.attempt(None), 1);
        let v = l.executions_json();
        assert_eq!(v["attempts"], 3);
        assert_eq!(v["attempts_by_key"]["k"], 2);
        assert!(v["attempts_by_key"].get("").is_none());
    }

    #[test]
    fn branches_and_draws_are_counted() {
        let l = Ledger::new();
        l.count_branches(&["a=1".into(), "b=2".into()]);
        l.count_branches(&["a=1".into()]);
        assert_eq!(l.branch_counts().get("a=1"), Some(&2));
        assert_eq!((l.next_draw("preview"), l.next_draw("preview"), l.next_draw("confirm")), (0, 1, 0));
        assert_eq!(l.to_json()["branches"]["b=2"], 1);
    }

    #[test]
    fn stale_fingerprints_are_the_ones_seen_most_recently() {
        let l = Ledger::new();
        assert_eq!(l.stale_fingerprint(0), None);
        for i in 0..70 {
            l.saw_fingerprint(&format!("fp{i}"));
        }
        l.saw_fingerprint("fp69");
        assert_eq!(l.stale_fingerprint(0).as_deref(), Some("fp69"));
        assert_eq!(l.stale_fingerprint(1).as_deref(), Some("fp68"));
        // Only the last REMEMBER are kept; the index wraps.
        assert_eq!(l.stale_fingerprint(REMEMBER).as_deref(), Some("fp69"));
    }

    #[test]
    fn quotes_keep_what_they_stated() {
        let l = Ledger::new();
        l.quote(Quote {
            quote_id: "q_1".into(),
            expires_at: Some(json!(100)),
            header_values: vec!["100".into(), "soon".into()],
            skew_s: -10,
            at_unix_s: 50,
            complete: true,
        });
        let q = &l.quotes()["q_1"];
        assert_eq!(q.header_values, ["100", "soon"]);
        assert_eq!(l.to_json()["quotes"]["q_1"]["skew_s"], -10);
    }
}
