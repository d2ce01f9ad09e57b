//! The store rules (`idemd::store::rules`, which the model checker's idemd runs) against the real
//! SQL statements: the same sequences of inserts, renewals, completes, releases, claims and reaps
//! on SQLite (always), Postgres and MariaDB (when they are up; skipped loudly otherwise), with the
//! row after each step compared field by field. A statement that drifts from its rule fails here.

mod common;

use idem_core::protocol::{OpState, StoredResult, TerminalState};
use idemd::store::audit::Audit;
use idemd::store::new_owner;
use idemd::store::record::Record;
use idemd::store::rules::{self, Broken, Completion};
use idemd::store::sql::{NewInFlight, SqlStore};

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
        let row = NewInFlight {
            key: &self.key,
            param_hash: "p",
            subject_hash: "u",
            scope: "s",
            owner,
            lease_until_ms: now + 1_000,
            now_ms: now,
            fp_exp_ms,
            upstream_ignores_keys: false,
            business_ref: None,
            bound_fields: None,
        };
        let real = self.sql.insert_in_flight(&row, &AUDIT).await.expect("insert");
        let new = Record {
            key: self.key.clone(),
            state: OpState::InFlight,
            param_hash: "p".into(),
            subject_hash: "u".into(),
            scope: "s".into(),
            owner: Some(owner.into()),
            result: None,
            lease_until_ms: Some(now + 1_000),
            created_at_ms: now,
            updated_at_ms: now,
            reconcile_attempts: 0,
            fp_exp_ms,
            upstream_ignores_keys: false,
            business_ref: None,
            bound_fields: None,
        };
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
    use idem_core::protocol::{ApprovalState, Decision};
    use idemd::store::record::ApprovalRow;
    use idemd::store::rules::Refusal;
    let now = idemd::store::now_ms();
    let row = |key: &str, exp: i64| ApprovalRow {
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
    };
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
    let refused = NewInFlight {
        key: &p.key,
        param_hash: "p",
        subject_hash: "u",
        scope: "s",
        owner: &a,
        lease_until_ms: now + 1_000,
        now_ms: now,
        fp_exp_ms: Some(now + 60_000),
        upstream_ignores_keys: false,
        business_ref: None,
        bound_fields: None,
    };
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
    use idem_core::protocol::{ApprovalState, Decision};
    use idemd::store::record::ApprovalRow;
    let t0 = idemd::store::now_ms() - 1_000_000_000;
    let mut p = pair(&sql).await;
    let new = ApprovalRow {
        key: p.key.clone(),
        state: ApprovalState::AwaitingApproval,
        param_hash: "p".into(),
        subject_hash: "u".into(),
        scope: "s".into(),
        fields: r#"{"/amount":5000}"#.into(),
        fp_exp_ms: t0 + 60_000,
        created_at_ms: t0,
        updated_at_ms: t0,
        decided_by: None,
        reason: None,
    };
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

// ---- Redis: the Lua scripts against the rules' mirror of them ----------------------------------

mod lua {
    use super::*;
    use common::RedisTarget;
    use idemd::store::redis::{AcquireReply, Binding, RedisStore, WriteReply};
    use idemd::store::rules::Cached;

    const BINDING: Binding<'static> = Binding { param_hash: "p", subject_hash: "u", scope: "s" };

    struct Cache {
        target: RedisTarget,
        redis: RedisStore,
        key: String,
        model: Option<Cached>,
    }

    impl Cache {
        /// The hash as the scripts left it, in the rules' terms.
        async fn real(&self) -> Option<Cached> {
            let h = self.target.hgetall(&self.key).await;
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

        async fn same(&self, what: &str) {
            assert_eq!(self.real().await, self.model, "after {what}");
        }

        async fn acquire(&mut self, owner: &str, binding: Binding<'_>) -> AcquireReply {
            let real = self.redis.acquire(&self.key, binding, owner, 60_000).await.expect("acquire");
            let (ruled, next) = rules::redis_acquire(
                self.model.as_ref(),
                (binding.param_hash, binding.subject_hash, binding.scope),
                owner,
                0,
            );
            // The age of an IN_FLIGHT comes from the key's TTL: compare the holder only.
            let holder = |r: &AcquireReply| match r {
                AcquireReply::InFlight { owner, .. } => AcquireReply::InFlight { owner: owner.clone(), age_ms: 0 },
                other => other.clone(),
            };
            assert_eq!(holder(&real), holder(&ruled), "acquire by {owner}");
            self.model = next;
            self.same("acquire").await;
            real
        }

        async fn complete(&mut self, owner: &str, state: TerminalState, json: &str) -> WriteReply {
            let real = self.redis.complete(&self.key, owner, state.as_str(), json, 60_000).await.expect("complete");
            let (ruled, next) = rules::redis_complete(self.model.as_ref(), owner, state, json);
            assert_eq!(real, ruled, "complete by {owner}");
            self.model = next;
            self.same("complete").await;
            real
        }

        async fn release(&mut self, owner: &str) -> WriteReply {
            let real = self.redis.release(&self.key, owner).await.expect("release");
            let (ruled, next) = rules::redis_release(self.model.as_ref(), owner);
            assert_eq!(real, ruled, "release by {owner}");
            self.model = next;
            self.same("release").await;
            real
        }

        async fn restore(&mut self, rec: &Record) {
            self.redis.restore(rec, 60_000).await.expect("restore");
            let (_, next) = rules::redis_restore(self.model.as_ref(), rec);
            self.model = next;
            self.same("restore").await;
        }
    }

    fn row(key: &str, state: OpState, owner: &str, result: Option<StoredResult>) -> Record {
        Record {
            key: key.into(),
            state,
            param_hash: "p".into(),
            subject_hash: "u".into(),
            scope: "s".into(),
            owner: Some(owner.into()),
            result,
            lease_until_ms: None,
            created_at_ms: 0,
            updated_at_ms: 0,
            reconcile_attempts: 0,
            fp_exp_ms: None,
            upstream_ignores_keys: false,
            business_ref: None,
            bound_fields: None,
        }
    }

    #[tokio::test]
    async fn redis_scripts_follow_the_rules() {
        let url = common::redis_test_url();
        if !idem_testkit::backends::available("redis", &url).expect("backend") {
            return;
        }
        let target = RedisTarget::single(url);
        let fresh = || Cache { target: target.clone(), redis: target.open(), key: new_owner(), model: None };
        let (a, b) = (new_owner(), new_owner());
        let json = serde_json::to_string(&result(201)).expect("json");

        let mut c = fresh();
        assert_eq!(c.acquire(&a, BINDING).await, AcquireReply::Acquired);
        assert!(matches!(c.acquire(&b, BINDING).await, AcquireReply::InFlight { .. }));
        let other = Binding { param_hash: "tampered", ..BINDING };
        assert_eq!(c.acquire(&b, other).await, AcquireReply::ParamMismatch);
        assert_eq!(c.complete(&b, TerminalState::Done, &json).await, WriteReply::NotOwner);
        assert_eq!(c.complete(&a, TerminalState::Done, &json).await, WriteReply::Ok);
        assert_eq!(c.complete(&a, TerminalState::Done, &json).await, WriteReply::Ok, "a repeat");
        assert_eq!(c.complete(&a, TerminalState::Failed, &json).await, WriteReply::NotOwner);
        assert_eq!(c.acquire(&b, BINDING).await, AcquireReply::Done(json.clone()));
        assert_eq!(c.release(&a).await, WriteReply::NotOwner, "a terminal copy is never released");
        let key = c.key.clone();
        c.restore(&row(&key, OpState::InFlight, &a, None)).await;
        assert_eq!(c.acquire(&b, BINDING).await, AcquireReply::Done(json.clone()), "restore never goes back");

        let mut c = fresh();
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
}
