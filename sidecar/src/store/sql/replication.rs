//! What the database promises (DESIGN §4, "The truth never goes back in time").
//!
//! The unique key in SQL is the truth only if a committed acquire survives whatever the database does
//! next. A single node keeps it; a primary whose commits wait for a synchronous standby keeps it across
//! a failover to that standby. A primary that replicates asynchronously does not: promote a standby that
//! had not caught up and the acquire is gone, so a retry is ACQUIRED again with a new owner (measured:
//! sidecar/tests/failover.rs). On a route whose upstream honours `Idempotency-Key` that second
//! execution is the same key reaching the upstream twice, and the upstream deduplicates it; on a route
//! whose upstream ignores keys it is a second payment.
//!
//! So idemd reads, at start and on every probe, the replication state its connection can see, and
//! decides per acquire ([`admits`]): a standby refuses everything (writes go to the primary only; at
//! start idemd refuses to run on one), an asynchronous (or unreadable) topology refuses acquires whose
//! upstream ignores keys unless the operator accepted that cost (`--accept-async-failover-risk`).
//!
//! What each backend shows:
//! - Postgres: `pg_is_in_recovery()`, this session's `synchronous_commit` and the server's
//!   `synchronous_standby_names` (what a commit waits for), `pg_stat_replication` (the standbys
//!   streaming now, and which acknowledge commits) and the physical replication slots (standbys
//!   that exist but are not connected now: Patroni and CloudNativePG keep a slot per member, and a
//!   standby that is cut off is exactly the one that lags).
//! - MariaDB/MySQL: `read_only` and running replica threads (this is a replica), semi-synchronous
//!   replication's state (`Rpl_semi_sync_master_status`: on, a commit waits for a replica's
//!   acknowledgement; it falls back to asynchronous after `rpl_semi_sync_master_timeout`), the replicas
//!   connected, and whether it writes a binary log. A primary forgets a replica once its connection is
//!   found dead (there is no slot), and a replica that lost its connection is exactly the one that lags, so a
//!   binary log counts as a replica that may follow unseen (in the failover test the primary still counted
//!   its cut-off replica 20 s later; the binary log is for when it no longer does); Galera is not
//!   classified (unknown).
//! - SQLite: one file on one node.
//!
//! What no query can show: storage-level replication (RDS Multi-AZ, a replicated volume) looks like a
//! single node, and that is what it promises; an asynchronous standby that has neither a connection nor a
//! slot on this primary is invisible. docs/operations.md ("Topologies") says what each setup keeps.

use serde::Serialize;

use super::dialect::{Backend, Pool, SqlError};
use super::SqlStore;

/// The topology an acquire is committed in, as far as idemd can see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// No replica that could be promoted: a commit is as durable as the node.
    Single,
    /// A commit returns only once a standby has it: a failover to that standby keeps it.
    Sync,
    /// Replicas exist but a commit does not wait for them: a failover can lose it.
    Async,
    /// Postgres replicates asynchronously, and idemd waits after each of its own writes, and each read it answers
    /// from, until every standby the primary knows (streaming, or holding a physical slot) has flushed it
    /// ([`SqlStore::standbys_flushed`]): what a synchronous standby gives, for idemd's rows only. A failover to any
    /// of them keeps what idemd answered.
    IdemdWaits,
    /// The connection reaches a read-only standby (in recovery, or a replica): nothing may be written.
    Standby,
    /// The state could not be read (no privilege, an error): treated as `Async`.
    Unknown,
}

impl Mode {
    pub const ALL: [Mode; 6] = [Mode::Single, Mode::Sync, Mode::IdemdWaits, Mode::Async, Mode::Standby, Mode::Unknown];

    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Single => "single",
            Mode::Sync => "sync",
            Mode::Async => "async",
            Mode::IdemdWaits => "idemd_waits",
            Mode::Standby => "standby",
            Mode::Unknown => "unknown",
        }
    }
}

/// The modes an acquire can be refused in (`idem_replication_refused_total{mode}`).
pub const REFUSING: [&str; 3] = ["async", "unknown", "standby"];

/// Put what was read into the metrics (`idem_sql_replication_info{mode}` and the standby gauges).
pub fn show(metrics: &crate::metrics::Metrics, r: &Replication) {
    metrics.set_replication(r.mode.as_str(), &Mode::ALL.map(Mode::as_str), r.standbys, r.sync_standbys);
}

/// What idemd read about its database's replication.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Replication {
    pub mode: Mode,
    /// Replicas streaming from this database now.
    pub standbys: i64,
    /// Of those, the ones a commit waits for (Postgres `sync`/`quorum`, MariaDB semi-sync clients).
    pub sync_standbys: i64,
    /// What was read, in words (the start-up line, `/healthz`).
    pub detail: String,
    /// Every standby's replicated position is readable here (Postgres, with `pg_read_all_stats` or as a
    /// superuser): idemd can wait for them ([`waited`]).
    #[serde(skip)]
    pub positions_visible: bool,
}

impl Replication {
    pub fn single(detail: &str) -> Self {
        Replication {
            mode: Mode::Single,
            standbys: 0,
            sync_standbys: 0,
            detail: detail.to_string(),
            positions_visible: false,
        }
    }

    pub fn unknown(why: String) -> Self {
        Replication { mode: Mode::Unknown, standbys: 0, sync_standbys: 0, detail: why, positions_visible: false }
    }
}

/// Whether a call must wait, before idemd answers from it, until every standby has flushed what the primary
/// holds ([`SqlStore::standbys_flushed`]). On [`Mode::IdemdWaits`] every call: a write to put it on the standbys,
/// a read because a commit is visible on the primary before any standby has it. On [`Mode::Sync`] reads only,
/// where the positions are readable: the commit already waited for the synchronous standby, but another session
/// sees it before then (a row whose commit is still waiting, or timed out waiting for a standby that is gone).
/// Nowhere else: nothing to wait for, or nothing idemd can see.
pub fn waits_for_standbys(r: &Replication, read: bool) -> bool {
    match r.mode {
        Mode::IdemdWaits => true,
        Mode::Sync => read && r.positions_visible,
        Mode::Single | Mode::Async | Mode::Standby | Mode::Unknown => false,
    }
}

/// What idemd makes of `read` when it may wait for standbys (`wait`: no `--accept-async-failover-risk`): an
/// asynchronous Postgres whose standbys' positions it can read becomes [`Mode::IdemdWaits`]. Everything else
/// is as read: a MariaDB replica's position cannot be read from its primary, nor a Postgres standby's without
/// `pg_read_all_stats`.
pub fn waited(read: Replication, wait: bool) -> Replication {
    if read.mode != Mode::Async || !read.positions_visible || !wait {
        return read;
    }
    Replication {
        mode: Mode::IdemdWaits,
        detail: format!(
            "{}; idemd waits after each of its writes and reads until every standby streaming or holding a \
             physical slot has flushed it",
            read.detail
        ),
        ..read
    }
}

/// Why an acquire may not start where the database is `mode` (`None`: it may). `upstream_ignores_keys`:
/// the route's upstream runs a request again whatever key it carries, so a lost acquire is a second
/// execution; on a route whose upstream honours keys the retry carries the same key, which protects it.
pub fn refusal(mode: Mode, accept_async_failover_risk: bool, upstream_ignores_keys: bool) -> Option<&'static str> {
    match mode {
        Mode::Single | Mode::Sync | Mode::IdemdWaits => None,
        Mode::Standby => Some(
            "the database idemd reaches is a read-only standby: operations are recorded on the primary only \
             (point --database-url at the primary's read-write address)",
        ),
        Mode::Async | Mode::Unknown if upstream_ignores_keys && !accept_async_failover_risk => Some(
            "the database replicates asynchronously (or idemd cannot read how it replicates): a failover can lose \
             this acquire, and this route's upstream ignores Idempotency-Key, so the retry after it would execute \
             the operation a second time; refused before anything ran (--accept-async-failover-risk accepts that \
             cost)",
        ),
        Mode::Async | Mode::Unknown => None,
    }
}

/// One streaming standby as `pg_stat_replication` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PgStandby {
    pub name: String,
    /// `streaming`, `catchup`, … (NULL for a role without `pg_read_all_stats`).
    pub state: Option<String>,
    /// `sync`, `quorum`, `potential`, `async` (NULL without `pg_read_all_stats`).
    pub sync_state: Option<String>,
}

/// What a Postgres session can read about replication.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PgFacts {
    pub in_recovery: bool,
    pub synchronous_commit: String,
    pub synchronous_standby_names: String,
    pub standbys: Vec<PgStandby>,
    pub physical_slots: i64,
    /// idemd's role may read every standby's position (`pg_read_all_stats`, or a superuser): without it
    /// `pg_stat_replication` shows a standby with its state and positions NULL, and idemd cannot wait for it.
    pub reads_positions: bool,
}

pub fn classify_postgres(f: &PgFacts) -> Replication {
    let standbys = i64::try_from(f.standbys.len()).unwrap_or(i64::MAX);
    let sync_standbys =
        i64::try_from(f.standbys.iter().filter(|s| matches!(s.sync_state.as_deref(), Some("sync" | "quorum"))).count())
            .unwrap_or(i64::MAX);
    let facts = format!(
        "synchronous_commit={}, synchronous_standby_names='{}', {standbys} standby(s) streaming ({sync_standbys} \
         synchronous), {} physical replication slot(s)",
        f.synchronous_commit, f.synchronous_standby_names, f.physical_slots
    );
    let (mode, words) = if f.in_recovery {
        (Mode::Standby, "postgres standby (pg_is_in_recovery() is true)")
    } else {
        // What this session's commit waits for: `local` and `off` never wait for a standby, whatever
        // synchronous_standby_names says.
        let commit_waits = matches!(f.synchronous_commit.as_str(), "on" | "remote_write" | "remote_apply");
        let named = !f.synchronous_standby_names.trim().is_empty();
        if named && commit_waits {
            // Commits wait for the named standbys; with none connected they wait (time out), never return
            // unreplicated.
            (Mode::Sync, "postgres primary, commits wait for a synchronous standby")
        } else if named || standbys > 0 || f.physical_slots > 0 {
            (Mode::Async, "postgres primary with standbys its commits do not wait for")
        } else {
            (Mode::Single, "postgres, no standby streaming and no replication slot")
        }
    };
    let positions_visible = f.reads_positions;
    Replication { mode, standbys, sync_standbys, detail: format!("{words}: {facts}"), positions_visible }
}

/// What a MariaDB/MySQL session can read about replication.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MyFacts {
    pub read_only: bool,
    /// Replica threads running on this server (`Slaves_running`): it replicates from a primary.
    pub replica_threads: i64,
    /// Replicas connected to this server (`Slaves_connected`).
    pub replicas_connected: i64,
    pub semi_sync_enabled: bool,
    /// `Rpl_semi_sync_master_status`: ON while commits wait for an acknowledgement (OFF after a fallback).
    pub semi_sync_active: bool,
    pub semi_sync_clients: i64,
    pub galera: bool,
    /// `log_bin`: it writes the binary log a replica follows (connected now or not).
    pub log_bin: bool,
}

pub fn classify_mysql(f: &MyFacts) -> Replication {
    let facts = format!(
        "read_only={}, log_bin={}, replica threads {}, {} replica(s) connected, semi-sync {} (active: {}, {} \
         client(s))",
        f.read_only,
        f.log_bin,
        f.replica_threads,
        f.replicas_connected,
        if f.semi_sync_enabled { "enabled" } else { "off" },
        f.semi_sync_active,
        f.semi_sync_clients
    );
    let sync_standbys = if f.semi_sync_active { f.semi_sync_clients } else { 0 };
    let (mode, words) = if f.read_only || f.replica_threads > 0 {
        (Mode::Standby, "mariadb replica (read_only, or replicating from a primary)")
    } else if f.galera {
        (Mode::Unknown, "mariadb Galera cluster (not classified)")
    } else if f.semi_sync_enabled && f.semi_sync_active {
        (Mode::Sync, "mariadb primary, commits wait for a semi-synchronous replica")
    } else if f.semi_sync_enabled || f.replicas_connected > 0 || f.log_bin {
        (
            Mode::Async,
            "mariadb primary with replicas (connected, or able to follow its binary log) its commits do not wait for",
        )
    } else {
        (Mode::Single, "mariadb, no binary log: no replica can follow it")
    };
    // A replica's position is not readable from its primary: idemd cannot wait for it.
    Replication {
        mode,
        standbys: f.replicas_connected,
        sync_standbys,
        detail: format!("{words}: {facts}"),
        positions_visible: false,
    }
}

impl SqlStore {
    /// Read the replication state now. Never fails: what cannot be read is [`Mode::Unknown`], with why.
    pub async fn read_replication(&self) -> Replication {
        let read = match &self.pool {
            Pool::Lite(_) => return Replication::single("sqlite: one file on one node"),
            Pool::Pg(p) => self.bounded(postgres_facts(p)).await.map(|f| classify_postgres(&f)),
            Pool::My(p) => self.bounded(mysql_facts(p)).await.map(|f| classify_mysql(&f)),
        };
        read.unwrap_or_else(|e| Replication::unknown(format!("cannot read the replication state: {e}")))
    }
}

/// What the database at `url` promises, read over one connection of its own within `timeout`, writing nothing
/// (no schema, no migration): `idemd check`'s look at a deployment's database. Never fails: what cannot be
/// reached or read is [`Mode::Unknown`], with why.
pub async fn read_url(url: &str, timeout: std::time::Duration) -> Replication {
    let unknown = |e: &dyn std::fmt::Display| Replication::unknown(format!("cannot read the replication state: {e}"));
    let read = async {
        match Backend::from_url(url) {
            Some(Backend::Sqlite) => Ok(Replication::single("sqlite: one file on one node")),
            Some(Backend::Postgres) => {
                let p = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(url).await?;
                let facts = postgres_facts(&p).await;
                p.close().await;
                Ok(classify_postgres(&facts?))
            }
            Some(Backend::MySql) => {
                let p = sqlx::mysql::MySqlPoolOptions::new().max_connections(1).connect(url).await?;
                let facts = mysql_facts(&p).await;
                p.close().await;
                Ok(classify_mysql(&facts?))
            }
            None => Err(SqlError::Config("not a postgres://, mysql:// or sqlite: URL".into())),
        }
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => unknown(&e),
        Err(_) => unknown(&format!("no answer within {} ms", timeout.as_millis())),
    }
}

async fn postgres_facts(p: &sqlx::PgPool) -> Result<PgFacts, SqlError> {
    let (in_recovery, synchronous_commit, synchronous_standby_names, physical_slots, reads_positions): (
        bool,
        String,
        String,
        i64,
        bool,
    ) = sqlx::query_as(
        "SELECT pg_is_in_recovery(), current_setting('synchronous_commit'), \
             current_setting('synchronous_standby_names'), \
             (SELECT count(*) FROM pg_replication_slots WHERE slot_type = 'physical'), \
             pg_has_role(current_user, 'pg_read_all_stats', 'USAGE')",
    )
    .fetch_one(p)
    .await?;
    let rows: Vec<(Option<String>, Option<String>, Option<String>)> =
        sqlx::query_as("SELECT application_name, state, sync_state FROM pg_stat_replication").fetch_all(p).await?;
    let standbys = rows
        .into_iter()
        .map(|(name, state, sync_state)| PgStandby { name: name.unwrap_or_default(), state, sync_state })
        .collect();
    Ok(PgFacts {
        in_recovery,
        synchronous_commit,
        synchronous_standby_names,
        standbys,
        physical_slots,
        reads_positions,
    })
}

async fn mysql_facts(p: &sqlx::MySqlPool) -> Result<MyFacts, SqlError> {
    use sqlx::Row as _;
    let (read_only, log_bin): (i64, i64) =
        sqlx::query_as("SELECT CAST(@@global.read_only AS SIGNED), CAST(@@global.log_bin AS SIGNED)")
            .fetch_one(p)
            .await?;
    let mut f = MyFacts { read_only: read_only != 0, log_bin: log_bin != 0, ..MyFacts::default() };
    // Status and variables readable by any user; an absent one (no semi-sync plugin, no Galera) is off.
    let rows = sqlx::query(
        "SHOW GLOBAL STATUS WHERE Variable_name IN ('Slaves_running', 'Slaves_connected', \
         'Rpl_semi_sync_master_status', 'Rpl_semi_sync_master_clients')",
    )
    .fetch_all(p)
    .await?;
    let vars = sqlx::query("SHOW GLOBAL VARIABLES WHERE Variable_name IN ('rpl_semi_sync_master_enabled', 'wsrep_on')")
        .fetch_all(p)
        .await?;
    for row in rows.iter().chain(vars.iter()) {
        let name: String = row.try_get::<String, _>(0).or_else(|_| bytes_text(row, 0))?;
        let value: String = row.try_get::<String, _>(1).or_else(|_| bytes_text(row, 1))?;
        let on = value.eq_ignore_ascii_case("ON");
        let n = value.parse::<i64>().unwrap_or(0);
        match name.to_ascii_lowercase().as_str() {
            "slaves_running" => f.replica_threads = n,
            "slaves_connected" => f.replicas_connected = n,
            "rpl_semi_sync_master_status" => f.semi_sync_active = on,
            "rpl_semi_sync_master_clients" => f.semi_sync_clients = n,
            "rpl_semi_sync_master_enabled" => f.semi_sync_enabled = on,
            "wsrep_on" => f.galera = on,
            _ => {}
        }
    }
    Ok(f)
}

/// A SHOW column MariaDB sends as binary text.
fn bytes_text(row: &sqlx::mysql::MySqlRow, i: usize) -> Result<String, sqlx::Error> {
    use sqlx::Row as _;
    row.try_get::<Vec<u8>, _>(i).map(|b| String::from_utf8_lossy(&b).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pg(names: &str, commit: &str, standbys: &[Option<&str>], slots: i64) -> PgFacts {
        PgFacts {
            in_recovery: false,
            synchronous_commit: commit.into(),
            synchronous_standby_names: names.into(),
            standbys: standbys
                .iter()
                .enumerate()
                .map(|(i, s)| PgStandby {
                    name: format!("s{i}"),
                    state: Some("streaming".into()),
                    sync_state: s.map(str::to_string),
                })
                .collect(),
            physical_slots: slots,
            reads_positions: true,
        }
    }

    #[test]
    fn postgres_topologies() {
        let mode = |f: &PgFacts| classify_postgres(f).mode;
        assert_eq!(mode(&pg("", "on", &[], 0)), Mode::Single);
        assert_eq!(mode(&pg("", "on", &[Some("async")], 1)), Mode::Async);
        // A standby cut off from its primary still has its slot: it lags, it is not gone.
        assert_eq!(mode(&pg("", "on", &[], 1)), Mode::Async);
        // Streaming without a slot, or the columns hidden from a role without pg_read_all_stats.
        assert_eq!(mode(&pg("", "on", &[None], 0)), Mode::Async);
        assert_eq!(mode(&pg("*", "on", &[Some("sync")], 1)), Mode::Sync);
        assert_eq!(mode(&pg("ANY 1 (a, b)", "remote_apply", &[Some("quorum"), Some("quorum")], 2)), Mode::Sync);
        // Commits wait even while no synchronous standby is connected (they block, never return unreplicated).
        assert_eq!(mode(&pg("*", "on", &[], 1)), Mode::Sync);
        // This session's commits do not wait: asynchronous whatever the server names.
        assert_eq!(mode(&pg("*", "local", &[Some("sync")], 1)), Mode::Async);
        assert_eq!(mode(&pg("*", "off", &[Some("sync")], 1)), Mode::Async);
        assert_eq!(mode(&PgFacts { in_recovery: true, ..pg("", "on", &[], 0) }), Mode::Standby);
        let r = classify_postgres(&pg("*", "on", &[Some("sync"), Some("potential")], 2));
        assert_eq!((r.standbys, r.sync_standbys), (2, 1));
        assert!(r.detail.contains("synchronous_standby_names='*'"), "{}", r.detail);
    }

    /// idemd waits for the standbys on an asynchronous Postgres whose standbys' positions it can read, unless the
    /// operator accepted the risk; nothing else changes.
    #[test]
    fn idemd_waits_where_it_can_see_the_standbys() {
        let waits = |f: &PgFacts, wait: bool| waited(classify_postgres(f), wait).mode;
        assert_eq!(waits(&pg("", "on", &[Some("async")], 1), true), Mode::IdemdWaits);
        assert_eq!(waits(&pg("", "on", &[], 1), true), Mode::IdemdWaits, "a cut-off standby's slot is waited for");
        assert_eq!(waits(&pg("*", "local", &[Some("sync")], 1), true), Mode::IdemdWaits);
        assert_eq!(waits(&pg("", "on", &[Some("async")], 1), false), Mode::Async, "the risk accepted: no wait");
        // A role without pg_read_all_stats sees no standby's state nor position: nothing to wait for, whether
        // the standby is streaming or cut off (then only its slot shows, and still no position to wait for).
        let hidden = PgFacts {
            standbys: vec![PgStandby { name: String::new(), state: None, sync_state: None }],
            reads_positions: false,
            ..pg("", "on", &[], 1)
        };
        assert_eq!(waits(&hidden, true), Mode::Async);
        assert_eq!(waits(&PgFacts { reads_positions: false, ..pg("", "on", &[], 1) }, true), Mode::Async);
        for f in [
            pg("", "on", &[], 0),
            pg("*", "on", &[Some("sync")], 1),
            PgFacts { in_recovery: true, ..pg("", "on", &[], 0) },
        ] {
            assert_eq!(waits(&f, true), classify_postgres(&f).mode, "only async changes");
        }
        assert_eq!(waited(classify_mysql(&MyFacts { log_bin: true, ..MyFacts::default() }), true).mode, Mode::Async);
        assert!(waited(classify_postgres(&pg("", "on", &[], 1)), true).detail.contains("idemd waits"));
    }

    /// Writes wait only where idemd waits for the standbys; reads also on a synchronous standby it can see.
    #[test]
    fn which_calls_wait_for_the_standbys() {
        let r =
            |mode: Mode, positions_visible: bool| Replication { mode, positions_visible, ..Replication::single("") };
        for read in [false, true] {
            assert!(waits_for_standbys(&r(Mode::IdemdWaits, true), read));
            assert_eq!(waits_for_standbys(&r(Mode::Sync, true), read), read, "a sync commit waited already");
            assert!(!waits_for_standbys(&r(Mode::Sync, false), read), "no position to wait for");
            for mode in [Mode::Single, Mode::Async, Mode::Standby, Mode::Unknown] {
                assert!(!waits_for_standbys(&r(mode, true), read), "{mode:?}");
            }
        }
    }

    #[test]
    fn mariadb_topologies() {
        let mode = |f: MyFacts| classify_mysql(&f).mode;
        assert_eq!(mode(MyFacts::default()), Mode::Single);
        assert_eq!(mode(MyFacts { replicas_connected: 1, ..MyFacts::default() }), Mode::Async);
        // A replica cut off is forgotten by its primary; the binary log it follows is not.
        assert_eq!(mode(MyFacts { log_bin: true, ..MyFacts::default() }), Mode::Async);
        let semi_active =
            MyFacts { log_bin: true, semi_sync_enabled: true, semi_sync_active: true, ..MyFacts::default() };
        assert_eq!(mode(semi_active), Mode::Sync);
        let semi = MyFacts { replicas_connected: 1, semi_sync_enabled: true, ..MyFacts::default() };
        // Enabled, but fallen back to asynchronous (no acknowledgement within its timeout).
        assert_eq!(mode(semi.clone()), Mode::Async);
        assert_eq!(mode(MyFacts { semi_sync_active: true, semi_sync_clients: 1, ..semi }), Mode::Sync);
        assert_eq!(mode(MyFacts { read_only: true, ..MyFacts::default() }), Mode::Standby);
        assert_eq!(mode(MyFacts { replica_threads: 1, ..MyFacts::default() }), Mode::Standby);
        assert_eq!(mode(MyFacts { galera: true, ..MyFacts::default() }), Mode::Unknown);
    }

    #[test]
    fn what_each_topology_admits() {
        for ignores in [false, true] {
            for accept in [false, true] {
                assert_eq!(refusal(Mode::Single, accept, ignores), None);
                assert_eq!(refusal(Mode::Sync, accept, ignores), None);
                assert_eq!(refusal(Mode::IdemdWaits, accept, ignores), None, "every write is on the standbys");
                assert!(refusal(Mode::Standby, accept, ignores).is_some(), "a standby takes no write");
                for mode in [Mode::Async, Mode::Unknown] {
                    // Only an upstream that ignores keys pays for a lost acquire, unless the operator accepted it.
                    assert_eq!(refusal(mode, accept, ignores).is_some(), ignores && !accept, "{mode:?}");
                }
            }
        }
        // The refused-acquire counter names exactly the modes that can refuse.
        for mode in Mode::ALL {
            let refuses = refusal(mode, false, true).is_some();
            assert_eq!(REFUSING.contains(&mode.as_str()), refuses, "{mode:?}");
        }
        let why = refusal(Mode::Async, false, true).unwrap_or_default();
        assert!(why.contains("--accept-async-failover-risk") && why.contains("ignores Idempotency-Key"), "{why}");
    }
}
