//! The store rules (`idemd::store::rules`, which the model checker's idemd runs) against the real
//! SQL statements and Lua scripts, step by step: after every call the rule's answer is compared
//! with the store's, and the row (or hash, with its TTL) with what the rule left.
//!
//! - Hand-written sequences of inserts, renewals, completes, releases, claims, reaps and approval
//!   decisions, on SQLite (always), Postgres and MariaDB, and of the scripts on Redis.
//! - Generated ones (proptest), on the same backends: sequences of every statement (`SqlOp`, two
//!   keys, three owners and a clock in whole seconds; 1 to 29 steps, a step one call or a few that
//!   go together, as a reconciler's claim and what follows it) and of every script (`LuaOp`, one
//!   key, three owners, short and long TTLs and pauses that outlast the short ones; 1 to 24 calls).
//!   A sequence that drifts is shrunk, and the test fails with the shortest one found and what
//!   differed. `PROPTEST_CASES` sets how many sequences each backend runs.
//!
//! Postgres, MariaDB and Redis are used when they are up and skipped loudly otherwise (a failure
//! with `IDEM_REQUIRE_BACKENDS=1`). A statement or script that drifts from its rule fails here.

mod common;

use idem_core::protocol::{ApprovalState, Decision, OpState, StoredResult, TerminalState};
use idemd::store::new_owner;
use idemd::store::record::{ApprovalRow, Record};
use idemd::store::rules::{self, Broken, Completion};
use idemd::store::sql::audit::Audit;
use idemd::store::sql::{NewInFlight, SqlStore};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestCaseError, TestRunner};

const AUDIT: Audit<'static> = Audit { actor: "test", action: "rules", why: "differential test", trace_id: "" };

fn result(status: u16) -> StoredResult {
    StoredResult { status, headers: vec![], body_b64: "e30".into() }
}

/// The fields a rule decides: state, owner, result, lease end, failed lookups (timestamps the SQL
/// takes from the wall clock are left out).
type Decided = (OpState, Option<String>, Option<StoredResult>, Option<i64>, i64);

fn decided(r: Option<&Record>) -> Option<Decided> {
    r.map(|r| (r.state, r.owner.clone(), r.result.clone(), r.lease_until_ms, r.reconcile_attempts))
}

struct Pair {
    sql: SqlStore,
    key: String,
    /// The row as the rules have it.
    model: Option<Record>,
}

impl Pair {
    async fn real(&self) -> Option<Record> {
        self.sql.get(&self.key).await.expect("get")
    }

    async fn same(&self, what: &str) {
        let real = self.real().await;
        assert_eq!(decided(real.as_ref()), decided(self.model.as_ref()), "after {what}");
    }

    async fn insert(&mut self, owner: &str, now: i64, fp_exp_ms: Option<i64>) -> bool {
        let new = in_flight(&self.key, owner, now, now + 1_000, fp_exp_ms);
        let real = self.sql.insert_in_flight(&new_in_flight(&new), &AUDIT).await.expect("insert");
        let ruled = rules::insert_in_flight(self.model.as_ref(), &new);
        assert_eq!(real, ruled.is_some(), "insert by {owner}");
        if let Some(r) = ruled {
            self.model = Some(r);
        }
        self.same("insert").await;
        real
    }

    async fn complete(&mut self, owner: &str, state: TerminalState, r: &StoredResult, now: i64) -> Completion {
        let json = serde_json::to_string(r).expect("json");
        let updated = self.sql.complete(&self.key, owner, state, &json, now, &AUDIT).await.expect("complete");
        // Store::complete: zero rows is a repeat only if the row already holds exactly this.
        let real = match (updated, self.real().await) {
            (true, _) => "applied",
            (false, Some(rec)) if rules::is_repeat(&rec, owner, state, r) => "repeated",
            (false, _) => "not_owner",
        };
        let ruled = rules::complete(self.model.as_ref(), owner, state, r, now, Broken::None);
        let name = match &ruled {
            Completion::Applied(rec) => {
                self.model = Some(rec.as_ref().clone());
                "applied"
            }
            Completion::Repeated => "repeated",
            Completion::NotOwner => "not_owner",
        };
        assert_eq!(real, name, "complete by {owner} as {state:?}");
        self.same("complete").await;
        ruled
    }

    async fn release(&mut self, owner: &str) -> bool {
        let real = self.sql.release(&self.key, owner, &AUDIT).await.expect("release");
        let ruled = rules::release(self.model.as_ref(), owner);
        assert_eq!(real, ruled, "release by {owner}");
        if ruled {
            self.model = None;
        }
        self.same("release").await;
        real
    }

    async fn renew(&mut self, owner: &str, until: i64) -> bool {
        let real = self.sql.renew(&self.key, owner, until).await.expect("renew");
        let ruled = rules::renew(self.model.as_ref(), owner, until, 0);
        assert_eq!(real, ruled.is_some(), "renew by {owner}");
        if let Some(r) = ruled {
            self.model = Some(r);
        }
        self.same("renew").await;
        real
    }

    async fn claim(&mut self, token: &str, until: i64, now: i64) -> bool {
        let as_read = self.real().await.expect("a row to claim");
        let real = self.sql.claim(&as_read, token, until, now).await.expect("claim");
        let ruled = rules::claim(self.model.as_ref(), &as_read, token, until, now);
        assert_eq!(real, ruled.is_some(), "claim at {now}");
        if let Some(r) = ruled {
            self.model = Some(r);
        }
        self.same("claim").await;
        real
    }
}

/// The IN_FLIGHT row an acquire inserts (binding `p`, `u`, `s`).
fn in_flight(key: &str, owner: &str, now: i64, lease_until_ms: i64, fp_exp_ms: Option<i64>) -> Record {
    Record {
        key: key.into(),
        state: OpState::InFlight,
        param_hash: "p".into(),
        subject_hash: "u".into(),
        scope: "s".into(),
        owner: Some(owner.into()),
        result: None,
        lease_until_ms: Some(lease_until_ms),
        created_at_ms: now,
        updated_at_ms: now,
        reconcile_attempts: 0,
        fp_exp_ms,
        upstream_ignores_keys: false,
        business_ref: None,
        bound_fields: None,
    }
}

/// What `SqlStore::insert_in_flight` is given for `r`.
fn new_in_flight(r: &Record) -> NewInFlight<'_> {
    NewInFlight {
        key: &r.key,
        param_hash: &r.param_hash,
        subject_hash: &r.subject_hash,
        scope: &r.scope,
        owner: r.owner.as_deref().unwrap_or_default(),
        lease_until_ms: r.lease_until_ms.unwrap_or_default(),
        now_ms: r.created_at_ms,
        fp_exp_ms: r.fp_exp_ms,
        upstream_ignores_keys: r.upstream_ignores_keys,
        business_ref: r.business_ref.as_deref(),
        bound_fields: r.bound_fields.as_deref(),
    }
}

/// The `idem_approval` row an approval acquire records at `now`, lapsing at `exp`.
fn awaiting(key: &str, exp: i64, now: i64) -> ApprovalRow {
    ApprovalRow {
        key: key.to_string(),
        state: ApprovalState::AwaitingApproval,
        param_hash: "p".into(),
        subject_hash: "u".into(),
        scope: "s".into(),
        fields: r#"{"/amount":5000}"#.into(),
        fp_exp_ms: exp,
        created_at_ms: now,
        updated_at_ms: now,
        decided_by: None,
        reason: None,
    }
}

async fn pair(sql: &SqlStore) -> Pair {
    Pair { sql: sql.clone(), key: new_owner(), model: None }
}

async fn every_rule_matches_its_statement(sql: SqlStore) {
    let (a, b, token) = (new_owner(), new_owner(), new_owner());
    let now = idemd::store::now_ms();

    // insert, renew, complete, the repeated and the conflicting complete, a stale release.
    let mut p = pair(&sql).await;
    assert!(p.insert(&a, now, Some(now + 10_000)).await);
    assert!(!p.insert(&b, now, None).await, "the key is taken");
    assert!(!p.renew(&b, now + 5_000).await, "not b's lease");
    assert!(p.renew(&a, now + 5_000).await);
    assert!(p.renew(&a, now + 2_000).await, "renewed, never shortened");
    assert_eq!(p.complete(&b, TerminalState::Done, &result(201), now).await, Completion::NotOwner);
    assert!(matches!(p.complete(&a, TerminalState::Done, &result(201), now).await, Completion::Applied(_)));
    assert_eq!(p.complete(&a, TerminalState::Done, &result(201), now).await, Completion::Repeated);
    assert_eq!(p.complete(&a, TerminalState::Failed, &result(201), now).await, Completion::NotOwner);
    assert_eq!(p.complete(&a, TerminalState::Done, &result(200), now).await, Completion::NotOwner);
    assert!(!p.release(&a).await, "a terminal row is never released");
    assert!(!p.renew(&a, now + 9_000).await, "a terminal row has no lease");

    // release: only the owner's IN_FLIGHT row, and the key is free again.
    let mut p = pair(&sql).await;
    assert!(p.insert(&a, now, None).await);
    assert!(!p.release(&b).await);
    assert!(p.release(&a).await);
    assert!(p.insert(&b, now, None).await, "released: acquirable again");

    // claim: only once the lease ran out, and only the row as read.
    let mut p = pair(&sql).await;
    assert!(p.insert(&a, now, None).await);
    assert!(!p.claim(&token, now + 9_000, now).await, "the lease is live");
    assert!(p.claim(&token, now + 9_000, now + 2_000).await, "the lease ran out");
    assert_eq!(p.complete(&a, TerminalState::Done, &result(201), now).await, Completion::NotOwner, "claimed");
    assert!(matches!(p.complete(&token, TerminalState::Done, &result(200), now).await, Completion::Applied(_)));
}

/// The reaper's `DELETE … WHERE` against `rules::reapable`, for rows just at either side of
/// their retention and their fingerprint's `exp`.
async fn reaping_matches_its_rule(sql: SqlStore) {
    let retention = 10_000u64;
    let now = idemd::store::now_ms();
    let owner = new_owner();
    let cases =
        [(now - 20_000, None), (now - 5_000, None), (now - 20_000, Some(now - 20_000)), (now - 20_000, Some(now))];
    let mut rows = Vec::new();
    for (at, fp) in cases {
        let mut p = pair(&sql).await;
        p.insert(&owner, at, fp).await;
        p.complete(&owner, TerminalState::Done, &result(201), at).await;
        rows.push(p);
    }
    sql.reap_terminal(now - i64::try_from(retention).expect("ms"), 1_000).await.expect("reap");
    for p in &rows {
        let model = p.model.as_ref().expect("completed");
        let reaped = rules::reapable(model, None, now, retention, Broken::None);
        assert_eq!(p.real().await.is_none(), reaped, "row changed {} fp {:?}", model.updated_at_ms, model.fp_exp_ms);
    }
}

/// The approval rows (`idem_approval`) against `rules::{insert_awaiting, decide, lapse,
/// acquire_allowed}`: record, decide once, lapse past exp, and the IN_FLIGHT insert refused until
/// APPROVED.
async fn approval_rules_match_their_statements(sql: SqlStore) {
    use idemd::store::rules::Refusal;
    let now = idemd::store::now_ms();
    let row = |key: &str, exp: i64| awaiting(key, exp, now);
    let decided =
        |r: Option<&ApprovalRow>| r.map(|r| (r.state, r.decided_by.clone(), r.reason.clone(), r.fields.clone()));

    // Approve: recorded once, the IN_FLIGHT insert refused until approved, decided once.
    let mut p = pair(&sql).await;
    let new = row(&p.key, now + 60_000);
    let mut model: Option<ApprovalRow> = None;
    for _ in 0..2 {
        let real = sql.insert_awaiting(&new, &AUDIT).await.expect("insert_awaiting");
        let ruled = rules::insert_awaiting(model.as_ref(), &new);
        assert_eq!(real, ruled.is_some());
        if let Some(r) = ruled {
            model = Some(r);
        }
        assert_eq!(decided(sql.approval(&p.key).await.expect("get").as_ref()), decided(model.as_ref()));
    }
    assert!(!rules::acquire_allowed(model.as_ref(), now));
    let a = new_owner();
    let refused_row = in_flight(&p.key, &a, now, now + 1_000, Some(now + 60_000));
    let refused = new_in_flight(&refused_row);
    assert!(!sql.insert_in_flight(&refused, &AUDIT).await.expect("insert"), "the insert's NOT EXISTS refuses it");
    assert!(p.real().await.is_none(), "no IN_FLIGHT row before the approval");
    // Self-approval is refused by the rule (the store never writes it).
    assert_eq!(
        rules::decide(model.as_ref(), Decision::Approve, ("alice", "u"), "mine", false, now),
        Err(Refusal::OwnSubject)
    );
    let next = rules::decide(model.as_ref(), Decision::Approve, ("ann", "h-ann"), "ok", false, now).expect("decide");
    assert!(sql.decide(&next, now, &AUDIT).await.expect("decide"));
    model = Some(next.clone());
    assert_eq!(decided(sql.approval(&p.key).await.expect("get").as_ref()), decided(model.as_ref()));
    // A second decision matches no row, as the rule refuses it.
    assert_eq!(
        rules::decide(model.as_ref(), Decision::Reject, ("ben", "h-ben"), "no", false, now),
        Err(Refusal::Decided(ApprovalState::Approved))
    );
    let second = ApprovalRow { state: ApprovalState::Rejected, ..next.clone() };
    assert!(!sql.decide(&second, now, &AUDIT).await.expect("decide"));
    assert!(rules::acquire_allowed(model.as_ref(), now));
    assert!(!rules::acquire_allowed(model.as_ref(), now + 60_000), "an approval past exp has lapsed");
    let late = NewInFlight { now_ms: now + 60_000, lease_until_ms: now + 61_000, ..refused };
    assert!(!sql.insert_in_flight(&late, &AUDIT).await.expect("insert"), "approved, but past its exp: lapsed, refused");
    assert!(p.insert(&a, now, Some(now + 60_000)).await, "approved: the insert wins once");
    let b = new_owner();
    assert!(!p.insert(&b, now, Some(now + 60_000)).await, "and only once");
    // An executed approval never lapses.
    assert!(!sql.lapse(&p.key, now + 120_000, &AUDIT).await.expect("lapse"));
    assert!(rules::lapse(model.as_ref(), true, now + 120_000).is_none());
    // Nor is it the sweep's work: the sweep takes a batch of the oldest due rows, and executed ones
    // (which stay APPROVED past exp) once filled it, so newer undecided ones never lapsed.
    let due = sql.approvals_due(now + 120_000, 10_000).await.expect("due");
    assert!(!due.iter().any(|r| r.key == p.key), "an executed approval is not due to lapse");

    // Lapse: past exp, an undecided approval cannot be decided and the sweep lapses it.
    let p = pair(&sql).await;
    let new = row(&p.key, now - 1);
    assert!(sql.insert_awaiting(&new, &AUDIT).await.expect("insert_awaiting"));
    let model = rules::insert_awaiting(None, &new);
    let late = rules::decide(model.as_ref(), Decision::Approve, ("ann", "h-ann"), "late", false, now);
    assert_eq!(late, Err(Refusal::Lapsed));
    let attempt = ApprovalRow { state: ApprovalState::Approved, decided_by: Some("ann".into()), ..new.clone() };
    assert!(!sql.decide(&attempt, now, &AUDIT).await.expect("decide"), "the statement refuses it too");
    let lapsed = rules::lapse(model.as_ref(), false, now).expect("lapses");
    assert!(sql.lapse(&p.key, now, &AUDIT).await.expect("lapse"));
    assert!(!sql.lapse(&p.key, now, &AUDIT).await.expect("lapse"), "once");
    assert_eq!(decided(sql.approval(&p.key).await.expect("get").as_ref()), decided(Some(&lapsed)));
    assert!(!rules::acquire_allowed(Some(&lapsed), now));
}

async fn sqlite() -> (tempfile::TempDir, SqlStore) {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("sqlite://{}/rules.db?mode=rwc", dir.path().display());
    let sql = SqlStore::connect(&url, &common::sql_opts()).await.expect("sqlite");
    (dir, sql)
}

async fn server(name: &str, url: &str) -> Option<SqlStore> {
    if !idem_testkit::backends::available(name, url).expect("backend") {
        return None;
    }
    Some(SqlStore::connect(url, &common::sql_opts()).await.expect("connect"))
}

/// A record whose approval row still says APPROVED is not reaped (`rules::reapable`); once the
/// approval row goes, it is. Times far in the past, so the reaper's statements touch only these rows
/// of a database other tests share.
async fn an_approved_record_outlives_its_approval_row(sql: SqlStore) {
    let t0 = idemd::store::now_ms() - 1_000_000_000;
    let mut p = pair(&sql).await;
    let new = awaiting(&p.key, t0 + 60_000, t0);
    assert!(sql.insert_awaiting(&new, &AUDIT).await.expect("insert_awaiting"));
    let approved = rules::decide(Some(&new), Decision::Approve, ("ann", "h-ann"), "ok", false, t0).expect("decide");
    assert!(sql.decide(&approved, t0, &AUDIT).await.expect("decide"));
    let a = new_owner();
    assert!(p.insert(&a, t0, Some(t0 + 60_000)).await, "approved: the insert wins");
    assert!(matches!(p.complete(&a, TerminalState::Done, &result(201), t0).await, Completion::Applied(_)));
    let record = p.model.clone().expect("completed");
    let (retention, now) = (10_000u64, t0 + 200_000);
    let before = now - i64::try_from(retention).expect("ms");
    sql.reap_terminal(before, 1_000).await.expect("reap");
    assert!(!rules::reapable(&record, Some(&approved), now, retention, Broken::None));
    assert!(p.real().await.is_some(), "kept while its approval row says APPROVED");
    assert!(sql.reap_approvals(before - 5_000).await.expect("reap approvals") >= 1);
    assert!(sql.approval(&p.key).await.expect("get").is_none());
    sql.reap_terminal(before, 1_000).await.expect("reap");
    assert!(rules::reapable(&record, None, now, retention, Broken::None));
    assert!(p.real().await.is_none(), "reaped once the approval row went");
}

#[tokio::test]
async fn sqlite_statements_follow_the_rules() {
    let (_dir, sql) = sqlite().await;
    every_rule_matches_its_statement(sql.clone()).await;
    approval_rules_match_their_statements(sql.clone()).await;
    an_approved_record_outlives_its_approval_row(sql.clone()).await;
    reaping_matches_its_rule(sql).await;
}

#[tokio::test]
async fn postgres_statements_follow_the_rules() {
    let Some(sql) = server("postgres", &common::postgres_test_url()).await else { return };
    every_rule_matches_its_statement(sql.clone()).await;
    approval_rules_match_their_statements(sql.clone()).await;
    an_approved_record_outlives_its_approval_row(sql).await;
}

#[tokio::test]
async fn mariadb_statements_follow_the_rules() {
    let Some(sql) = server("mariadb", &common::mysql_test_url()).await else { return };
    every_rule_matches_its_statement(sql.clone()).await;
    approval_rules_match_their_statements(sql.clone()).await;
    an_approved_record_outlives_its_approval_row(sql).await;
}

// ---- Generated sequences: every statement against its rule, step by step -----------------------

/// How many generated sequences a backend runs: `PROPTEST_CASES` when set.
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A runtime of the test's own: proptest's runner is synchronous, and each case blocks on it.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
}

/// Run `cases` sequences drawn from `ops` through `run`. A sequence that drifts is shrunk, and the
/// test fails with the shortest drifting sequence found and what differed at its last step.
fn sequences<Op: Clone + std::fmt::Debug>(
    what: &str,
    cases: u32,
    ops: impl Strategy<Value = Vec<Op>>,
    run: impl Fn(&[Op]) -> Result<(), String>,
) {
    let config =
        ProptestConfig { cases, failure_persistence: None, max_shrink_iters: 2_000, ..ProptestConfig::default() };
    let started = std::time::Instant::now();
    if let Err(e) = TestRunner::new(config).run(&ops, |seq| run(&seq).map_err(TestCaseError::fail)) {
        panic!("{what}: a generated sequence drifted from the rules: {e}");
    }
    eprintln!("{what}: {cases} generated sequences followed the rules in {:.1?}", started.elapsed());
}

/// What a failed step says: the step, the difference, and the sequence up to it.
fn drifted<Op: std::fmt::Debug>(ops: &[Op], i: usize, what: &str) -> String {
    format!("step {} of {} ({:?}): {what}\n  the sequence up to it: {:?}", i + 1, ops.len(), ops[i], &ops[..=i])
}

/// A difference between a store and its rule, as the step's error.
macro_rules! differ {
    ($same:expr, $($why:tt)+) => {
        if !$same {
            return Err(format!($($why)+));
        }
    };
}

/// A store's error, as the step's error.
fn failed<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> String {
    move |e| format!("{what} failed: {e}")
}

const KEYS: usize = 2;
const OWNERS: usize = 3;
/// More than a case's database ever holds: the scans and the reaper's batches never stop short.
const ALL: u32 = 100_000;

/// Whose decision an approver's is.
#[derive(Clone, Copy, Debug)]
enum Approver {
    Another,
    /// The operation's own subject: the rule refuses it, and `Store::decide` sends no statement.
    Own,
    /// The operation's own subject, where the deployment allows it.
    OwnAllowed,
}

/// Who makes an owner-checked call: whoever holds the key as it stands (the owner of its record
/// or of its cached copy; a claim's token once claimed), or one of the case's owners.
#[derive(Clone, Copy, Debug)]
enum Who {
    Holder,
    Owner(usize),
}

fn who() -> impl Strategy<Value = Who> {
    prop_oneof![2 => Just(Who::Holder), 1 => (0..OWNERS).prop_map(Who::Owner)]
}

/// One call of a generated sequence. Keys and owners (claim tokens too) are indices into the
/// case's fresh tokens; times are whole seconds from the case's clock, so the statements' `<` and
/// `<=` meet their edges often.
#[derive(Clone, Debug)]
enum SqlOp {
    /// The clock moves on.
    Tick(i64),
    Insert {
        key: usize,
        owner: usize,
        lease_s: i64,
        fp_exp_s: Option<i64>,
    },
    Complete {
        key: usize,
        who: Who,
        failed: bool,
        status: u16,
    },
    Release {
        key: usize,
        who: Who,
    },
    /// Past the lease or short of it (SQL never shortens one).
    Renew {
        key: usize,
        who: Who,
        until_s: i64,
    },
    /// The reconciler's scan (`stale_in_flight`, against `rules::claimable`); the row it finds is
    /// the row as read that the key's claim, unclaim and mark_needs_review then work from.
    Read {
        key: usize,
    },
    /// The reconciler's claim of the row as read: read by a scan just before (`scan`, as its pass
    /// does), or by an earlier one.
    Claim {
        key: usize,
        token: usize,
        until_s: i64,
        scan: bool,
    },
    Unclaim {
        key: usize,
        who: Who,
        failed: bool,
    },
    MarkNeedsReview {
        key: usize,
        who: Who,
    },
    /// The reaper's `reap_terminal`, `now` minus the retention, as `Reaper::pass` computes it.
    Reap {
        retention_s: i64,
    },
    InsertAwaiting {
        key: usize,
        exp_s: i64,
    },
    Decide {
        key: usize,
        approve: bool,
        approver: Approver,
    },
    /// The lapse sweep's scan (`approvals_due`) and its `lapse`.
    Lapse {
        key: usize,
    },
    /// The reaper's `reap_approvals`, as `Reaper::pass` computes its time.
    ReapApprovals {
        retention_s: i64,
    },
}

fn sql_ops() -> impl Strategy<Value = Vec<SqlOp>> {
    // The record's calls go to key 0 mostly and the approval's to key 1 mostly, so that calls meet
    // the rows the calls before them left, and both keys meet the other kind too.
    let k = || prop_oneof![3 => Just(0usize), 1 => Just(1usize)];
    let a = || prop_oneof![1 => Just(0usize), 3 => Just(1usize)];
    let o = || 0..OWNERS;
    let approver = prop_oneof![4 => Just(Approver::Another), 1 => Just(Approver::Own), 1 => Just(Approver::OwnAllowed)];
    let op = prop_oneof![
        5 => prop::sample::select(vec![1i64, 2, 8, 20]).prop_map(SqlOp::Tick),
        4 => (k(), o(), 0..=3i64, prop::option::of(0..=4i64))
            .prop_map(|(key, owner, lease_s, fp_exp_s)| SqlOp::Insert { key, owner, lease_s, fp_exp_s }),
        2 => (k(), who(), any::<bool>(), prop::sample::select(vec![200u16, 201]))
            .prop_map(|(key, who, failed, status)| SqlOp::Complete { key, who, failed, status }),
        1 => (k(), who()).prop_map(|(key, who)| SqlOp::Release { key, who }),
        2 => (k(), who(), -2..=4i64).prop_map(|(key, who, until_s)| SqlOp::Renew { key, who, until_s }),
        1 => k().prop_map(|key| SqlOp::Read { key }),
        3 => (k(), o(), 1..=3i64, prop::bool::weighted(0.7))
            .prop_map(|(key, token, until_s, scan)| SqlOp::Claim { key, token, until_s, scan }),
        2 => (k(), who(), any::<bool>()).prop_map(|(key, who, failed)| SqlOp::Unclaim { key, who, failed }),
        1 => (k(), who()).prop_map(|(key, who)| SqlOp::MarkNeedsReview { key, who }),
        2 => (0..=3i64).prop_map(|retention_s| SqlOp::Reap { retention_s }),
        2 => (a(), prop::sample::select(vec![0i64, 2, 6, 12]))
            .prop_map(|(key, exp_s)| SqlOp::InsertAwaiting { key, exp_s }),
        3 => (a(), any::<bool>(), approver)
            .prop_map(|(key, approve, approver)| SqlOp::Decide { key, approve, approver }),
        1 => a().prop_map(|key| SqlOp::Lapse { key }),
        1 => (0..=3i64).prop_map(|retention_s| SqlOp::ReapApprovals { retention_s }),
    ];
    // A reconciler's row, as its pass takes it: the scan and the claim, then the claim given back
    // (after a lookup that failed, or not) or the row handed to a person.
    let pass = (k(), o(), 1..=3i64, 0..3u8).prop_map(|(key, token, until_s, then)| {
        let (claim, who) = (SqlOp::Claim { key, token, until_s, scan: true }, Who::Owner(token));
        let then = match then {
            0 => SqlOp::Unclaim { key, who, failed: false },
            1 => SqlOp::Unclaim { key, who, failed: true },
            _ => SqlOp::MarkNeedsReview { key, who },
        };
        vec![claim, then]
    });
    let ticks = || prop::sample::select(vec![2i64, 8, 20]);
    // A row finished, and the reaper some time later.
    let reaped = (k(), any::<bool>(), ticks(), 0..=3i64).prop_map(|(key, failed, secs, retention_s)| {
        let done = SqlOp::Complete { key, who: Who::Holder, failed, status: 201 };
        vec![done, SqlOp::Tick(secs), SqlOp::Reap { retention_s }]
    });
    // An approval recorded and decided.
    let decided = (a(), prop::sample::select(vec![2i64, 6, 12]), any::<bool>()).prop_map(|(key, exp_s, approve)| {
        let decide = SqlOp::Decide { key, approve, approver: Approver::Another };
        vec![SqlOp::InsertAwaiting { key, exp_s }, decide]
    });
    // Time passes, the lapse sweep and the approval reaper run.
    let aged = (ticks(), a(), 0..=3i64).prop_map(|(secs, key, retention_s)| {
        vec![SqlOp::Tick(secs), SqlOp::Lapse { key }, SqlOp::ReapApprovals { retention_s }]
    });
    let chunk = prop_oneof![
        14 => op.prop_map(|op| vec![op]),
        2 => pass,
        1 => reaped,
        1 => decided,
        1 => aged,
    ];
    prop::collection::vec(chunk, 1..30).prop_map(|chunks| chunks.concat())
}

/// One case's keys, in SQL and as the rules have them.
struct Rows {
    sql: SqlStore,
    keys: Vec<String>,
    owners: Vec<String>,
    now: i64,
    records: Vec<Option<Record>>,
    approvals: Vec<Option<ApprovalRow>>,
    /// What the reconciler's last scan that found the key read of it.
    read: Vec<Option<Record>>,
}

impl Rows {
    fn new(sql: &SqlStore) -> Self {
        Rows {
            sql: sql.clone(),
            keys: (0..KEYS).map(|_| new_owner()).collect(),
            owners: (0..OWNERS).map(|_| new_owner()).collect(),
            now: idemd::store::now_ms(),
            records: vec![None; KEYS],
            approvals: vec![None; KEYS],
            read: vec![None; KEYS],
        }
    }

    /// Every key's `idem_record` and `idem_approval` row, in SQL and in the rules, whole.
    async fn same(&self) -> Result<(), String> {
        for (k, key) in self.keys.iter().enumerate() {
            let real = self.sql.get(key).await.map_err(failed("get"))?;
            differ!(real == self.records[k], "key {k}: SQL has the record {real:?}, the rules {:?}", self.records[k]);
            let real = self.sql.approval(key).await.map_err(failed("approval"))?;
            differ!(
                real == self.approvals[k],
                "key {k}: SQL has the approval {real:?}, the rules {:?}",
                self.approvals[k]
            );
        }
        Ok(())
    }

    /// The owner `who` names for `key`.
    fn owner(&self, key: usize, who: Who) -> String {
        match who {
            Who::Holder => self.records[key].as_ref().and_then(|r| r.owner.clone()),
            Who::Owner(i) => Some(self.owners[i].clone()),
        }
        .unwrap_or_else(|| self.owners[0].clone())
    }

    /// The reconciler's scan (`stale_in_flight`) against `rules::claimable`; what it found of `key`
    /// becomes the row as read.
    async fn scan(&mut self, key: usize) -> Result<(), String> {
        let stale = self.sql.stale_in_flight(self.now, ALL).await.map_err(failed("stale_in_flight"))?;
        let found = stale.into_iter().find(|r| r.key == self.keys[key]);
        let ruled = self.records[key].clone().filter(|r| rules::claimable(r, self.now));
        differ!(found == ruled, "the reconciler's scan found {found:?}; rules::claimable: {ruled:?}");
        if found.is_some() {
            self.read[key] = found;
        }
        Ok(())
    }

    /// A conditional `UPDATE` of the key's record against its rule: the row after it, or `None`
    /// when its `WHERE` matches nothing.
    fn updated(&mut self, key: usize, what: &str, real: bool, ruled: Option<Record>) -> Result<(), String> {
        differ!(real == ruled.is_some(), "{what}: the statement changed a row: {real}; the rule: {ruled:?}");
        if ruled.is_some() {
            self.records[key] = ruled;
        }
        Ok(())
    }

    async fn apply(&mut self, op: &SqlOp) -> Result<(), String> {
        let now = self.now;
        let at = |secs: i64| now + secs * 1_000;
        let sql = self.sql.clone();
        match *op {
            SqlOp::Tick(secs) => self.now = at(secs),
            SqlOp::Insert { key, owner, lease_s, fp_exp_s } => {
                let new = in_flight(&self.keys[key], &self.owners[owner], now, at(lease_s), fp_exp_s.map(at));
                let real = sql.insert_in_flight(&new_in_flight(&new), &AUDIT).await.map_err(failed("insert"))?;
                // The insert's `NOT EXISTS` over `idem_approval`, and its conflict on the key.
                let allowed = rules::acquire_allowed(self.approvals[key].as_ref(), now);
                let ruled = rules::insert_in_flight(self.records[key].as_ref(), &new).filter(|_| allowed);
                self.updated(key, "insert", real, ruled)?;
            }
            SqlOp::Complete { key, who, failed: f, status } => {
                let (owner, r) = (&self.owner(key, who), result(status));
                let state = if f { TerminalState::Failed } else { TerminalState::Done };
                let json = serde_json::to_string(&r).map_err(failed("json"))?;
                let real = sql.complete(&self.keys[key], owner, state, &json, now, &AUDIT).await;
                let ruled = match rules::complete(self.records[key].as_ref(), owner, state, &r, now, Broken::None) {
                    Completion::Applied(rec) => Some(*rec),
                    Completion::Repeated | Completion::NotOwner => None,
                };
                self.updated(key, "complete", real.map_err(failed("complete"))?, ruled)?;
            }
            SqlOp::Release { key, who } => {
                let owner = self.owner(key, who);
                let real = sql.release(&self.keys[key], &owner, &AUDIT).await.map_err(failed("release"))?;
                let ruled = rules::release(self.records[key].as_ref(), &owner);
                differ!(real == ruled, "release: the DELETE removed the row: {real}; the rule: {ruled}");
                if ruled {
                    self.records[key] = None;
                }
            }
            SqlOp::Renew { key, who, until_s } => {
                let owner = &self.owner(key, who);
                // `SqlStore::renew` stamps `updated_at` from the wall clock: the rule is given the
                // clock as read before the call, and the row must show a time between the readings.
                let before = idemd::store::now_ms();
                let real = sql.renew(&self.keys[key], owner, at(until_s)).await.map_err(failed("renew"))?;
                let after = idemd::store::now_ms();
                let mut ruled = rules::renew(self.records[key].as_ref(), owner, at(until_s), before);
                differ!(real == ruled.is_some(), "renew: the UPDATE matched: {real}; the rule: {ruled:?}");
                if let Some(r) = ruled.as_mut() {
                    let stamped = sql.get(&self.keys[key]).await.map_err(failed("get"))?.map(|r| r.updated_at_ms);
                    let Some(stamped) = stamped.filter(|t| (before..=after).contains(t)) else {
                        return Err(format!(
                            "renew: updated_at {stamped:?}, not the clock between {before} and {after}"
                        ));
                    };
                    r.updated_at_ms = stamped;
                }
                self.updated(key, "renew", real, ruled)?;
            }
            SqlOp::Read { key } => self.scan(key).await?,
            SqlOp::Claim { key, token, until_s, scan } => {
                if scan {
                    self.scan(key).await?;
                }
                let Some(as_read) = self.read[key].clone() else { return Ok(()) };
                let token = &self.owners[token];
                let real = sql.claim(&as_read, token, at(until_s), now).await.map_err(failed("claim"))?;
                let ruled = rules::claim(self.records[key].as_ref(), &as_read, token, at(until_s), now);
                self.updated(key, "claim", real, ruled)?;
            }
            SqlOp::Unclaim { key, who, failed: f } => {
                let Some(as_read) = self.read[key].clone() else { return Ok(()) };
                let token = &self.owner(key, who);
                // The reconciler audits a failed lookup's unclaim only: both statements are run.
                let real = sql.unclaim(&as_read, token, f, f.then_some(&AUDIT)).await.map_err(failed("unclaim"))?;
                let ruled = rules::unclaim(self.records[key].as_ref(), &as_read, token, f);
                self.updated(key, "unclaim", real, ruled)?;
            }
            SqlOp::MarkNeedsReview { key, who } => {
                let Some(as_read) = self.read[key].clone() else { return Ok(()) };
                let token = &self.owner(key, who);
                let real = sql.mark_needs_review(&as_read, token, now, &AUDIT).await.map_err(failed("mark"))?;
                let ruled = rules::mark_needs_review(self.records[key].as_ref(), &as_read, token, now);
                self.updated(key, "mark_needs_review", real, ruled)?;
            }
            SqlOp::Reap { retention_s } => {
                let retention = u64::try_from(retention_s * 1_000).map_err(failed("retention"))?;
                sql.reap_terminal(at(-retention_s), ALL).await.map_err(failed("reap_terminal"))?;
                for (record, approval) in self.records.iter_mut().zip(&self.approvals) {
                    let approval = approval.as_ref();
                    if record.as_ref().is_some_and(|r| rules::reapable(r, approval, now, retention, Broken::None)) {
                        *record = None;
                    }
                }
            }
            SqlOp::InsertAwaiting { key, exp_s } => {
                let new = awaiting(&self.keys[key], at(exp_s), now);
                let real = sql.insert_awaiting(&new, &AUDIT).await.map_err(failed("insert_awaiting"))?;
                let ruled = rules::insert_awaiting(self.approvals[key].as_ref(), &new);
                differ!(
                    real == ruled.is_some(),
                    "insert_awaiting: the statement inserted: {real}; the rule: {ruled:?}"
                );
                if ruled.is_some() {
                    self.approvals[key] = ruled;
                }
            }
            SqlOp::Decide { key, approve, approver } => {
                let decision = if approve { Decision::Approve } else { Decision::Reject };
                let (who, allow_self) = match approver {
                    Approver::Another => (("ann", "h-ann"), false),
                    Approver::Own => (("una", "u"), false),
                    Approver::OwnAllowed => (("una", "u"), true),
                };
                let row = self.approvals[key].as_ref();
                match rules::decide(row, decision, who, "generated", allow_self, now) {
                    Ok(next) => {
                        let real = sql.decide(&next, now, &AUDIT).await.map_err(failed("decide"))?;
                        differ!(real, "decide: the rule decides {next:?}, the UPDATE matched no row");
                        self.approvals[key] = Some(next);
                    }
                    // Refused before any statement (`Store::decide`).
                    Err(rules::Refusal::OwnSubject) => {}
                    // Sent anyway: the statement must refuse what the rule refuses.
                    Err(refusal) => {
                        let state = if approve { ApprovalState::Approved } else { ApprovalState::Rejected };
                        let base = row.cloned().unwrap_or_else(|| awaiting(&self.keys[key], now, now));
                        let attempt = ApprovalRow {
                            state,
                            decided_by: Some(who.0.into()),
                            reason: Some("generated".into()),
                            ..base
                        };
                        let real = sql.decide(&attempt, now, &AUDIT).await.map_err(failed("decide"))?;
                        differ!(!real, "decide: the rule refuses ({refusal:?}), the UPDATE matched the row");
                    }
                }
            }
            SqlOp::Lapse { key } => {
                let executed = self.records[key].is_some();
                let ruled = rules::lapse(self.approvals[key].as_ref(), executed, now);
                let due = sql.approvals_due(now, i64::from(ALL)).await.map_err(failed("approvals_due"))?;
                let due = due.iter().any(|r| r.key == self.keys[key]);
                differ!(due == ruled.is_some(), "the sweep's scan has the key: {due}; rules::lapse: {ruled:?}");
                let real = sql.lapse(&self.keys[key], now, &AUDIT).await.map_err(failed("lapse"))?;
                differ!(real == ruled.is_some(), "lapse: the UPDATE matched: {real}; the rule: {ruled:?}");
                if ruled.is_some() {
                    self.approvals[key] = ruled;
                }
            }
            SqlOp::ReapApprovals { retention_s } => {
                let retention = u64::try_from(retention_s * 1_000).map_err(failed("retention"))?;
                let before = at(-retention_s) - idemd::store::retention::CLOCK_SKEW_MS;
                sql.reap_approvals(before).await.map_err(failed("reap_approvals"))?;
                for approval in &mut self.approvals {
                    if approval.as_ref().is_some_and(|a| rules::approval_reapable(a, now, retention)) {
                        *approval = None;
                    }
                }
            }
        }
        Ok(())
    }
}

/// `cases` generated sequences on `sql`, a database of the test's own (the reaper's statements and
/// the scans work on whole tables), each with fresh keys and owners.
fn sql_sequences(what: &str, rt: &tokio::runtime::Runtime, sql: &SqlStore, cases: u32) {
    sequences(what, cases, sql_ops(), |ops| {
        rt.block_on(async {
            let mut rows = Rows::new(sql);
            for (i, op) in ops.iter().enumerate() {
                let step = async {
                    rows.apply(op).await?;
                    rows.same().await
                };
                step.await.map_err(|e| drifted(ops, i, &e))?;
            }
            Ok(())
        })
    });
}

/// A database of the test's own on the server at `url`; `None` when the server is down (skipped
/// loudly, or a failure with `IDEM_REQUIRE_BACKENDS=1`, as `server`).
async fn own_database(backend: common::Backend, url: &str) -> Option<(SqlStore, common::Fixture)> {
    if !idem_testkit::backends::available(backend.name(), url).expect("backend") {
        return None;
    }
    let fx = common::Fixture::isolated(backend, false).await?;
    let sql = SqlStore::connect(&fx.sql_url, &common::sql_opts()).await.expect("connect own database");
    Some((sql, fx))
}

#[test]
fn sqlite_statements_follow_the_rules_in_generated_sequences() {
    let rt = runtime();
    let (dir, sql) = rt.block_on(sqlite());
    sql_sequences("sqlite", &rt, &sql, cases(128));
    drop((sql, dir));
}

/// [`sql_sequences`] on a database of the test's own on the server at `url`.
fn server_sequences(backend: common::Backend, url: &str, cases: u32) {
    let rt = runtime();
    let Some((sql, own)) = rt.block_on(own_database(backend, url)) else { return };
    sql_sequences(backend.name(), &rt, &sql, cases);
    drop((sql, own));
}

#[test]
fn postgres_statements_follow_the_rules_in_generated_sequences() {
    server_sequences(common::Backend::Postgres, &common::postgres_test_url(), cases(96));
}

#[test]
fn mariadb_statements_follow_the_rules_in_generated_sequences() {
    server_sequences(common::Backend::MariaDb, &common::mysql_test_url(), cases(96));
}

// ---- Redis: the Lua scripts against the rules' mirror of them ----------------------------------

mod lua {
    use super::*;
    use common::RedisTarget;
    use idemd::store::redis::{redis_key, AcquireReply, Binding, RedisDown, RedisStore, WriteReply};
    use idemd::store::rules::{Cached, Ttl};
    use std::collections::HashMap;
    use std::future::Future;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    const BINDING: Binding<'static> = Binding { param_hash: "p", subject_hash: "u", scope: "s" };
    const TAMPERED: Binding<'static> = Binding { param_hash: "tampered", ..BINDING };
    /// A TTL that runs out within a sequence (a `Sleep` outlasts it), and one that does not.
    const SHORT: u64 = 25;
    const LONG: u64 = 60_000;
    /// Slack either side of a clock reading, in µs: Redis keeps time in whole milliseconds.
    const SLACK: i64 = 2_000;
    /// The fields the scripts write.
    const FIELDS: [&str; 7] = ["state", "param_hash", "subject_hash", "scope", "owner", "result", "lease_ms"];

    /// A moment known to lie between two readings of the clock (µs since the case began).
    #[derive(Clone, Copy, Debug)]
    struct Window {
        lo: i64,
        hi: i64,
    }

    impl Window {
        fn plus_ms(self, ms: u64) -> Window {
            let us = i64::try_from(ms).unwrap_or(i64::MAX / 2_000) * 1_000;
            Window { lo: self.lo + us, hi: self.hi + us }
        }
    }

    /// The key's entry with what the test knows of its TTL.
    #[derive(Clone, Debug)]
    struct Entry {
        cached: Cached,
        /// When it expires: its last `Ttl::Set` plus that TTL.
        expires: Window,
        /// When its TTL was last set, and to what: an IN_FLIGHT answer's age counts from then, and
        /// an IN_FLIGHT hash's `lease_ms` is that TTL.
        set: (Window, u64),
    }

    /// The hash and its PTTL, read in one MULTI.
    #[derive(Debug)]
    struct Look {
        at: Window,
        hash: HashMap<String, String>,
        pttl: i64,
    }

    impl Look {
        /// The hash in the rules' terms.
        fn cached(&self) -> Option<Cached> {
            let h = &self.hash;
            let state = h.get("state")?.parse::<OpState>().ok()?;
            Some(Cached {
                state,
                param_hash: h.get("param_hash").cloned().unwrap_or_default(),
                subject_hash: h.get("subject_hash").cloned().unwrap_or_default(),
                scope: h.get("scope").cloned().unwrap_or_default(),
                owner: h.get("owner").cloned(),
                result: h.get("result").cloned(),
            })
        }

        /// Whether this is `after` (or nothing, where its TTL may have run out by now): the same
        /// fields, a PTTL within its expiry, `lease_ms` the TTL last set on an IN_FLIGHT copy and
        /// absent on any other, and no field the scripts do not write.
        fn shows(&self, after: Option<&Entry>) -> bool {
            let Some(e) = after else { return self.hash.is_empty() && self.pttl == -2 };
            if self.hash.is_empty() {
                return self.pttl == -2 && e.expires.lo - SLACK <= self.at.hi;
            }
            let lease = (e.cached.state == OpState::InFlight).then(|| e.set.1.to_string());
            let pttl_us = self.pttl * 1_000;
            e.expires.hi + SLACK >= self.at.lo
                && self.cached().as_ref() == Some(&e.cached)
                && (e.expires.lo - self.at.hi - SLACK..=e.expires.hi - self.at.lo + SLACK).contains(&pttl_us)
                && self.hash.get("lease_ms") == lease.as_ref()
                && self.hash.keys().all(|f| FIELDS.contains(&f.as_str()))
        }
    }

    /// An IN_FLIGHT answer's holder is the rule's; its age (from the key's TTL) is the time since
    /// the lease was last set, within the windows of that and of the script's run.
    fn same_acquire(real: &AcquireReply, ruled: &AcquireReply, age: Option<Window>) -> bool {
        match (real, ruled) {
            (AcquireReply::InFlight { owner, age_ms }, AcquireReply::InFlight { owner: holder, .. }) => {
                owner == holder && age.is_some_and(|w| (w.lo - SLACK..=w.hi + SLACK).contains(&(age_ms * 1_000)))
            }
            _ => real == ruled,
        }
    }

    struct Cache {
        redis: Arc<RedisStore>,
        conn: redis::aio::MultiplexedConnection,
        key: String,
        epoch: Instant,
        model: Option<Entry>,
    }

    impl Cache {
        async fn new(target: &RedisTarget, redis: &Arc<RedisStore>) -> Cache {
            let client = redis::Client::open(target.url.as_str()).expect("redis url");
            let conn = client.get_multiplexed_async_connection().await.expect("redis connection");
            Cache { redis: redis.clone(), conn, key: new_owner(), epoch: Instant::now(), model: None }
        }

        fn clock(&self) -> i64 {
            i64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(i64::MAX)
        }

        async fn look(&mut self) -> Result<Look, String> {
            let k = redis_key(&self.key);
            let lo = self.clock();
            let (hash, pttl): (HashMap<String, String>, i64) = redis::pipe()
                .atomic()
                .cmd("HGETALL")
                .arg(&k)
                .cmd("PTTL")
                .arg(&k)
                .query_async(&mut self.conn)
                .await
                .map_err(failed("HGETALL, PTTL"))?;
            Ok(Look { at: Window { lo, hi: self.clock() }, hash, pttl })
        }

        /// Run a script and its rule, and compare the replies and the key after it. The rule is
        /// given the entry as the test has it, or nothing where its TTL may have run out before the
        /// script ran (the script saw one of the two): one of them must explain the reply and what
        /// the key holds after it.
        async fn step<T: Clone + std::fmt::Debug>(
            &mut self,
            what: &str,
            script: impl Future<Output = Result<T, RedisDown>>,
            rule: impl Fn(Option<&Cached>) -> (T, Option<Cached>, Ttl),
            same: impl Fn(&T, &T, Option<Window>) -> bool,
        ) -> Result<T, String> {
            let lo = self.clock();
            let real = script.await.map_err(|e| format!("{what}: {e}"))?;
            let ran = Window { lo, hi: self.clock() };
            let look = self.look().await?;
            let before: Vec<Option<Entry>> = match &self.model {
                None => vec![None],
                Some(e) if e.expires.hi + SLACK < ran.lo => vec![None],
                Some(e) if e.expires.lo - SLACK > ran.hi => vec![Some(e.clone())],
                Some(e) => vec![Some(e.clone()), None],
            };
            let mut tried = Vec::new();
            for pre in before {
                let (reply, next, ttl) = rule(pre.as_ref().map(|e| &e.cached));
                let after = next.map(|cached| {
                    let (expires, set) = match (ttl, &pre) {
                        (Ttl::Set(ms), _) => (ran.plus_ms(ms), (ran, ms)),
                        (Ttl::Kept, Some(p)) => (p.expires, p.set),
                        // A rule that makes an entry out of nothing sets its TTL.
                        (Ttl::Kept, None) => (Window { lo: i64::MIN / 2, hi: i64::MIN / 2 }, (ran, 0)),
                    };
                    Entry { cached, expires, set }
                });
                let age = pre.as_ref().map(|p| Window { lo: ran.lo - p.set.0.hi, hi: ran.hi - p.set.0.lo });
                if same(&real, &reply, age) && look.shows(after.as_ref()) {
                    self.model = after.filter(|_| !look.hash.is_empty());
                    return Ok(real);
                }
                tried.push((pre.map(|p| p.cached), reply, ttl));
            }
            Err(format!(
                "{what}: the script answered {real:?} and left {look:?}; the rule, from each entry the script may \
                 have seen: {tried:?} (the test had {:?})",
                self.model
            ))
        }

        async fn acquire_for(&mut self, owner: &str, binding: Binding<'_>, lease: u64) -> Result<AcquireReply, String> {
            let script = self.redis.clone();
            let key = self.key.clone();
            let b = (binding.param_hash, binding.subject_hash, binding.scope);
            self.step(
                "acquire",
                async move { script.acquire(&key, binding, owner, lease).await },
                |e| rules::redis_acquire(e, b, owner, 0, lease),
                same_acquire,
            )
            .await
        }

        async fn complete_for(
            &mut self,
            owner: &str,
            state: TerminalState,
            json: &str,
            retention: u64,
        ) -> Result<WriteReply, String> {
            let (script, key) = (self.redis.clone(), self.key.clone());
            self.step(
                "complete",
                async move { script.complete(&key, owner, state.as_str(), json, retention).await },
                |e| rules::redis_complete(e, owner, state, json, retention),
                |a, b, _| a == b,
            )
            .await
        }

        async fn release_for(&mut self, owner: &str) -> Result<WriteReply, String> {
            let (script, key) = (self.redis.clone(), self.key.clone());
            self.step(
                "release",
                async move { script.release(&key, owner).await },
                |e| {
                    let (reply, next) = rules::redis_release(e, owner);
                    (reply, next, Ttl::Kept)
                },
                |a, b, _| a == b,
            )
            .await
        }

        async fn renew_for(&mut self, owner: &str, lease: u64) -> Result<WriteReply, String> {
            let (script, key) = (self.redis.clone(), self.key.clone());
            self.step(
                "renew",
                async move { script.renew(&key, owner, lease).await },
                |e| rules::redis_renew(e, owner, lease),
                |a, b, _| a == b,
            )
            .await
        }

        async fn restore_for(&mut self, rec: &Record, ttl: u64) -> Result<(), String> {
            let script = self.redis.clone();
            self.step(
                "restore",
                async move { script.restore(rec, ttl).await },
                |e| {
                    let (_, next, ttl) = rules::redis_restore(e, rec, ttl);
                    ((), next, ttl)
                },
                |_, _, _| true,
            )
            .await
        }

        /// Time passes, long enough for a short TTL to run out.
        async fn sleep(&mut self) -> Result<(), String> {
            self.sleep_for(SHORT + 5).await
        }

        async fn sleep_for(&mut self, ms: u64) -> Result<(), String> {
            let pause = async move {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok::<(), RedisDown>(())
            };
            self.step("sleep", pause, |e| ((), e.cloned(), Ttl::Kept), |_, _, _| true).await
        }

        // The hand-written sequences' calls, with long TTLs.

        async fn acquire(&mut self, owner: &str, binding: Binding<'_>) -> AcquireReply {
            self.acquire_for(owner, binding, LONG).await.expect("acquire follows its rule")
        }

        async fn complete(&mut self, owner: &str, state: TerminalState, json: &str) -> WriteReply {
            self.complete_for(owner, state, json, LONG).await.expect("complete follows its rule")
        }

        async fn release(&mut self, owner: &str) -> WriteReply {
            self.release_for(owner).await.expect("release follows its rule")
        }

        async fn restore(&mut self, rec: &Record) {
            self.restore_for(rec, LONG).await.expect("restore follows its rule");
        }
    }

    fn row(key: &str, state: OpState, owner: &str, result: Option<StoredResult>) -> Record {
        Record { state, result, lease_until_ms: None, ..in_flight(key, owner, 0, 0, None) }
    }

    /// The shared Redis and one store on it; `None` when it is down (skipped loudly, or a failure
    /// with `IDEM_REQUIRE_BACKENDS=1`).
    fn shared() -> Option<(RedisTarget, Arc<RedisStore>)> {
        let url = common::redis_test_url();
        if !idem_testkit::backends::available("redis", &url).expect("backend") {
            return None;
        }
        let target = RedisTarget::single(url);
        let redis = Arc::new(target.open());
        Some((target, redis))
    }

    #[tokio::test]
    async fn redis_scripts_follow_the_rules() {
        let Some((target, redis)) = shared() else { return };
        let (a, b) = (new_owner(), new_owner());
        let json = serde_json::to_string(&result(201)).expect("json");

        let mut c = Cache::new(&target, &redis).await;
        assert_eq!(c.acquire(&a, BINDING).await, AcquireReply::Acquired);
        assert!(matches!(c.acquire(&b, BINDING).await, AcquireReply::InFlight { .. }));
        assert_eq!(c.acquire(&b, TAMPERED).await, AcquireReply::ParamMismatch);
        assert_eq!(c.complete(&b, TerminalState::Done, &json).await, WriteReply::NotOwner);
        assert_eq!(c.complete(&a, TerminalState::Done, &json).await, WriteReply::Ok);
        assert_eq!(c.complete(&a, TerminalState::Done, &json).await, WriteReply::Ok, "a repeat");
        assert_eq!(c.complete(&a, TerminalState::Failed, &json).await, WriteReply::NotOwner);
        assert_eq!(c.acquire(&b, BINDING).await, AcquireReply::Done(json.clone()));
        assert_eq!(c.release(&a).await, WriteReply::NotOwner, "a terminal copy is never released");
        let key = c.key.clone();
        c.restore(&row(&key, OpState::InFlight, &a, None)).await;
        assert_eq!(c.acquire(&b, BINDING).await, AcquireReply::Done(json.clone()), "restore never goes back");

        let mut c = Cache::new(&target, &redis).await;
        assert_eq!(c.release(&a).await, WriteReply::Missing);
        assert_eq!(c.complete(&a, TerminalState::Done, &json).await, WriteReply::Missing);
        assert_eq!(c.acquire(&a, BINDING).await, AcquireReply::Acquired);
        assert_eq!(c.release(&b).await, WriteReply::NotOwner);
        assert_eq!(c.release(&a).await, WriteReply::Ok);
        let key = c.key.clone();
        c.restore(&row(&key, OpState::NeedsReview, &a, None)).await;
        assert_eq!(c.acquire(&b, BINDING).await, AcquireReply::NeedsReview);
        c.restore(&row(&key, OpState::Done, &a, Some(result(201)))).await;
        assert_eq!(c.acquire(&b, BINDING).await, AcquireReply::Done(json));
    }

    /// Found by writing each script's TTL into the rules (`rules::Ttl`): the model gave a terminal
    /// copy the retention again on a repeated complete, but `complete.lua` answers a repeat OK
    /// before its PEXPIRE, so the copy keeps the TTL the first complete set.
    #[tokio::test]
    async fn a_repeated_complete_leaves_the_ttl_as_it_was() {
        let Some((target, redis)) = shared() else { return };
        let a = new_owner();
        let json = serde_json::to_string(&result(201)).expect("json");
        let mut c = Cache::new(&target, &redis).await;
        assert_eq!(c.acquire(&a, BINDING).await, AcquireReply::Acquired);
        assert_eq!(c.complete_for(&a, TerminalState::Done, &json, 500).await, Ok(WriteReply::Ok));
        assert_eq!(c.complete_for(&a, TerminalState::Done, &json, LONG).await, Ok(WriteReply::Ok), "a repeat");
        c.sleep_for(600).await.expect("the copy expires as the first complete said");
        assert!(c.look().await.expect("look").hash.is_empty(), "the repeat did not keep it longer");
        assert_eq!(c.renew_for(&a, LONG).await, Ok(WriteReply::Missing));
    }

    // ---- generated sequences of every script -----------------------------------------------------

    #[derive(Clone, Copy, Debug)]
    enum Span {
        Short,
        Long,
    }

    impl Span {
        fn ms(self) -> u64 {
            match self {
                Span::Short => SHORT,
                Span::Long => LONG,
            }
        }
    }

    /// One script call of a generated sequence, on one key; owners are indices into the case's
    /// fresh tokens. TTLs are short (a `Sleep` outlasts them) or long.
    #[derive(Clone, Debug)]
    enum LuaOp {
        Acquire {
            owner: usize,
            tampered: bool,
            lease: Span,
        },
        Complete {
            who: Who,
            failed: bool,
            status: u16,
            retention: Span,
        },
        Release {
            who: Who,
        },
        /// Longer or shorter than the lease it had.
        Renew {
            who: Who,
            lease: Span,
        },
        /// A SQL row copied in: any state, any binding, any owner or none.
        Restore {
            state: OpState,
            owner: Option<usize>,
            status: u16,
            tampered: bool,
            ttl: Span,
        },
        Sleep,
    }

    fn lua_ops() -> impl Strategy<Value = Vec<LuaOp>> {
        let o = || 0..OWNERS;
        let span = || prop::sample::select(vec![Span::Short, Span::Long]);
        let status = || prop::sample::select(vec![200u16, 201]);
        let states = vec![OpState::InFlight, OpState::Done, OpState::Failed, OpState::NeedsReview];
        let op = prop_oneof![
            4 => (o(), prop::bool::weighted(0.15), span())
                .prop_map(|(owner, tampered, lease)| LuaOp::Acquire { owner, tampered, lease }),
            3 => (who(), any::<bool>(), status(), span())
                .prop_map(|(who, failed, status, retention)| LuaOp::Complete { who, failed, status, retention }),
            1 => who().prop_map(|who| LuaOp::Release { who }),
            3 => (who(), span()).prop_map(|(who, lease)| LuaOp::Renew { who, lease }),
            2 => (prop::sample::select(states), prop::option::of(o()), status(), prop::bool::weighted(0.15), span())
                .prop_map(|(state, owner, status, tampered, ttl)| LuaOp::Restore { state, owner, status, tampered, ttl }),
            1 => Just(LuaOp::Sleep),
        ];
        prop::collection::vec(op, 1..25)
    }

    impl Cache {
        async fn apply(&mut self, op: &LuaOp, owners: &[String]) -> Result<(), String> {
            let holder = self.model.as_ref().and_then(|e| e.cached.owner.clone());
            let owner = |who: Who| match who {
                Who::Holder => holder.clone().unwrap_or_else(|| owners[0].clone()),
                Who::Owner(i) => owners[i].clone(),
            };
            match *op {
                LuaOp::Acquire { owner, tampered, lease } => {
                    let binding = if tampered { TAMPERED } else { BINDING };
                    self.acquire_for(&owners[owner], binding, lease.ms()).await.map(drop)
                }
                LuaOp::Complete { who, failed: f, status, retention } => {
                    let state = if f { TerminalState::Failed } else { TerminalState::Done };
                    let json = serde_json::to_string(&result(status)).map_err(failed("json"))?;
                    self.complete_for(&owner(who), state, &json, retention.ms()).await.map(drop)
                }
                LuaOp::Release { who } => self.release_for(&owner(who)).await.map(drop),
                LuaOp::Renew { who, lease } => self.renew_for(&owner(who), lease.ms()).await.map(drop),

                LuaOp::Restore { state, owner, status, tampered, ttl } => {
                    let terminal = matches!(state, OpState::Done | OpState::Failed);
                    let mut rec = row(&self.key, state, "", terminal.then(|| result(status)));
                    rec.owner = owner.map(|o| owners[o].clone());
                    if tampered {
                        rec.param_hash = TAMPERED.param_hash.into();
                    }
                    self.restore_for(&rec, ttl.ms()).await
                }
                LuaOp::Sleep => self.sleep().await,
            }
        }
    }

    #[test]
    fn redis_scripts_follow_the_rules_in_generated_sequences() {
        let rt = runtime();
        let Some((target, redis)) = rt.block_on(async { shared() }) else { return };
        sequences("redis", cases(128), lua_ops(), |ops| {
            rt.block_on(async {
                let owners: Vec<String> = (0..OWNERS).map(|_| new_owner()).collect();
                let mut c = Cache::new(&target, &redis).await;
                for (i, op) in ops.iter().enumerate() {
                    c.apply(op, &owners).await.map_err(|e| drifted(ops, i, &e))?;
                }
                Ok(())
            })
        });
    }
}
