//! The SQL truth: table `idem_record`, one row per nonce, on Postgres,
//! MySQL/MariaDB or SQLite.
//!
//! Each operation is written once. What differs between the dialects
//! (placeholders, the conflict-ignoring insert, migration locks) is decided
//! here when the store is opened, and the same statement text then runs on the
//! backend's own pool. The concrete pools are used instead of `sqlx::Any`
//! because Any cannot read Postgres `CHAR(n)`, and the typed drivers keep
//! their prepared-statement caches.
//!
//! All queries are runtime queries with binds: no database at build time.
//!
//! The store's parts are its children: `dialect` (what differs between the backends, and the
//! tools every statement runs through), `audit` (the audit trail, written in the change's own
//! commit), `replication` (what the database's topology guarantees) and `group_commit`
//! (SQLite's one writer).

use std::path::Path;
use std::str::FromStr;
use std::time::{Duration, Instant};

use idem_core::protocol::TerminalState;
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::Row;

use super::now_ms;
use super::record::Record;
use audit::Audit;
use group_commit::{GroupCommit, Statement, Write};
use replication::{Mode, Replication};

pub mod audit;
mod dialect;
mod group_commit;
pub mod replication;

pub(super) use dialect::{bind_all, on_pool, render, Bind, Pool};
pub use dialect::{Backend, SqlError};

#[derive(Clone, Debug)]
pub struct SqlOptions {
    pub max_connections: u32,
    /// Budget for one call, connection wait included (and, on [`Mode::IdemdWaits`], the wait for the standbys).
    pub timeout: Duration,
    /// On an asynchronously replicated Postgres whose standbys idemd can see, wait after each write and read
    /// until they have flushed what it answers from ([`Mode::IdemdWaits`]). Off only with
    /// `--accept-async-failover-risk`.
    pub wait_for_standbys: bool,
}

impl Default for SqlOptions {
    fn default() -> Self {
        Self { max_connections: 16, timeout: Duration::from_secs(2), wait_for_standbys: true }
    }
}

/// The audit line a state change carries.
pub(super) struct Change<'a, 'b> {
    pub key: &'a str,
    pub from: Option<&'a str>,
    pub to: Option<&'a str>,
    pub at_ms: i64,
    pub audit: &'a Audit<'b>,
}

/// The row written when an operation is acquired.
#[derive(Clone, Copy, Debug)]
pub struct NewInFlight<'a> {
    pub key: &'a str,
    pub param_hash: &'a str,
    pub subject_hash: &'a str,
    pub scope: &'a str,
    pub owner: &'a str,
    pub lease_until_ms: i64,
    pub now_ms: i64,
    /// The fingerprint's `exp` in unix ms; `None` for a client key.
    pub fp_exp_ms: Option<i64>,
    pub upstream_ignores_keys: bool,
    pub business_ref: Option<&'a str>,
    /// The bound fields' canonical JSON, kept with a business reference.
    pub bound_fields: Option<&'a str>,
}

/// Decode one `idem_record` row selected with [`COLUMNS`], inside one `on_pool!` arm.
macro_rules! read_record {
    ($row:expr) => {{
        let row = $row;
        let key: String = row.try_get::<String, _>("idem_key")?.trim_end().to_string();
        let state: String = row.try_get("state")?;
        let result: Option<String> = row.try_get("result")?;
        let attempts: i32 = row.try_get("reconcile_attempts")?;
        // NULL: a row from before migration 0006, when every upstream was taken to keep keys.
        let ignores: Option<i32> = row.try_get("upstream_ignores_keys")?;
        Ok::<_, $crate::store::sql::SqlError>($crate::store::record::Record {
            state: state
                .parse::<idem_core::protocol::OpState>()
                .ok()
                .ok_or_else(|| $crate::store::sql::SqlError::Corrupt(format!("state {state:?} of {key}")))?,
            param_hash: row.try_get("param_hash")?,
            subject_hash: row.try_get("subject_hash")?,
            scope: row.try_get("scope")?,
            owner: row.try_get("owner")?,
            result: match result {
                None => None,
                Some(text) => Some(
                    serde_json::from_str(&text)
                        .map_err(|e| $crate::store::sql::SqlError::Corrupt(format!("result of {key}: {e}")))?,
                ),
            },
            lease_until_ms: row.try_get("lease_until")?,
            created_at_ms: row.try_get("created_at")?,
            updated_at_ms: row.try_get("updated_at")?,
            reconcile_attempts: i64::from(attempts),
            fp_exp_ms: row.try_get("fp_exp_ms")?,
            upstream_ignores_keys: ignores.is_some_and(|v| v != 0),
            business_ref: row.try_get("business_ref")?,
            bound_fields: row.try_get("bound_fields")?,
            key,
        })
    }};
}

/// Statement texts, rendered for the dialect once at open. The three writes
/// of the filter's path carry their audit line: on Postgres as one statement
/// (a data-modifying CTE), elsewhere as the second statement of a transaction.
#[derive(Clone)]
struct Queries {
    insert: String,
    select: String,
    complete: String,
    release: String,
    renew: String,
    audit: String,
}

pub(super) const COLUMNS: &str = "idem_key, state, param_hash, subject_hash, scope, owner, result, lease_until, \
     created_at, updated_at, reconcile_attempts, fp_exp_ms, upstream_ignores_keys, business_ref, bound_fields";

const AUDIT_COLUMNS: &str = "idem_key, at_ms, actor, action, from_state, to_state, why, trace_id";

impl Queries {
    fn new(backend: Backend) -> Self {
        // The NOT EXISTS is `rules::acquire_allowed`: no IN_FLIGHT row for an operation whose
        // approval a person has not given (DESIGN §4, "Approval"), whichever route acquires it.
        // One primary-key probe in the same statement, no round trip.
        let from_dual = if backend == Backend::MySql { " FROM DUAL" } else { "" };
        let insert_values = format!(
            "(idem_key, state, param_hash, subject_hash, scope, owner, lease_until, created_at, updated_at, fp_exp_ms, \
             upstream_ignores_keys, business_ref, bound_fields) SELECT ?k, 'IN_FLIGHT', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, \
             ?{from_dual} WHERE NOT EXISTS (SELECT 1 FROM idem_approval WHERE idem_key = ?k \
             AND (state <> 'APPROVED' OR fp_exp_ms <= ?))"
        );
        // Two unique keys meet here: the operation's (its key) and its business reference's
        // (scope, business_ref; migration 0008). Either conflict inserts nothing, and the store reads
        // which one it was (`SqlStore::reference_holder`).
        let insert = match backend {
            // INSERT IGNORE also downgrades data errors to warnings; every value
            // is validated before it gets here, so only the duplicate keys are left.
            Backend::MySql => format!("INSERT IGNORE INTO idem_record {insert_values}"),
            Backend::Postgres | Backend::Sqlite => {
                format!("INSERT INTO idem_record {insert_values} ON CONFLICT DO NOTHING")
            }
        };
        Self {
            insert: audited(backend, &insert),
            select: render(backend, &format!("SELECT {COLUMNS} FROM idem_record WHERE idem_key = ?k")),
            complete: audited(
                backend,
                "UPDATE idem_record SET state = ?, result = ?, lease_until = NULL, updated_at = ? \
                 WHERE idem_key = ?k AND owner = ? AND state = 'IN_FLIGHT'",
            ),
            release: audited(
                backend,
                "DELETE FROM idem_record WHERE idem_key = ?k AND owner = ? AND state = 'IN_FLIGHT'",
            ),
            // Not audited: a renewal changes no state, and comes every third of a lease.
            // `updated_at` always moves, so MariaDB (which counts changed rows, not matched
            // ones) reports the row as renewed even when the lease already ran further.
            renew: render(
                backend,
                "UPDATE idem_record SET lease_until = CASE WHEN lease_until < ? THEN ? ELSE lease_until END, \
                 updated_at = ? WHERE idem_key = ?k AND owner = ? AND state = 'IN_FLIGHT'",
            ),
            audit: render(
                backend,
                &format!("INSERT INTO idem_audit ({AUDIT_COLUMNS}) VALUES (?k, ?, ?, ?, ?, ?, ?, ?)"),
            ),
        }
    }
}

/// The text that changes one `idem_record` row and, when a row changed,
/// appends its audit line (see [`SqlStore::change`]). `template` touches at
/// most one row (it selects by primary key).
pub(super) fn audited(backend: Backend, template: &str) -> String {
    match backend {
        Backend::Postgres => render(
            backend,
            &format!(
                "WITH changed AS ({template} RETURNING idem_key) \
                 INSERT INTO idem_audit ({AUDIT_COLUMNS}) SELECT idem_key, ?, ?, ?, ?, ?, ?, ? FROM changed"
            ),
        ),
        Backend::MySql | Backend::Sqlite => render(backend, template),
    }
}

struct Migration {
    version: i64,
    description: &'static str,
    postgres: &'static str,
    mysql: &'static str,
    sqlite: &'static str,
}

/// Applied in order, each once, recorded in `idem_schema_migrations`. Not
/// sqlx's `_sqlx_migrations`: idemd often shares a database with the
/// operator's own application, whose migrator would reject versions it does
/// not know.
const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "idem_record",
        postgres: include_str!("../../../migrations/postgres/0001_idem_record.sql"),
        mysql: include_str!("../../../migrations/mysql/0001_idem_record.sql"),
        sqlite: include_str!("../../../migrations/sqlite/0001_idem_record.sql"),
    },
    Migration {
        version: 2,
        description: "reconcile_attempts, idem_audit",
        postgres: include_str!("../../../migrations/postgres/0002_reconcile_audit.sql"),
        mysql: include_str!("../../../migrations/mysql/0002_reconcile_audit.sql"),
        sqlite: include_str!("../../../migrations/sqlite/0002_reconcile_audit.sql"),
    },
    Migration {
        version: 3,
        description: "idem_audit.trace_id",
        postgres: include_str!("../../../migrations/postgres/0003_audit_trace_id.sql"),
        mysql: include_str!("../../../migrations/mysql/0003_audit_trace_id.sql"),
        sqlite: include_str!("../../../migrations/sqlite/0003_audit_trace_id.sql"),
    },
    Migration {
        version: 4,
        description: "idem_record.fp_exp_ms",
        postgres: include_str!("../../../migrations/postgres/0004_fingerprint_exp.sql"),
        mysql: include_str!("../../../migrations/mysql/0004_fingerprint_exp.sql"),
        sqlite: include_str!("../../../migrations/sqlite/0004_fingerprint_exp.sql"),
    },
    Migration {
        version: 5,
        description: "idem_audit security events",
        postgres: include_str!("../../../migrations/postgres/0005_security_events.sql"),
        mysql: include_str!("../../../migrations/mysql/0005_security_events.sql"),
        sqlite: include_str!("../../../migrations/sqlite/0005_security_events.sql"),
    },
    Migration {
        version: 6,
        description: "idem_record.upstream_ignores_keys, business_ref",
        postgres: include_str!("../../../migrations/postgres/0006_upstream_keys.sql"),
        mysql: include_str!("../../../migrations/mysql/0006_upstream_keys.sql"),
        sqlite: include_str!("../../../migrations/sqlite/0006_upstream_keys.sql"),
    },
    Migration {
        version: 7,
        description: "idem_approval",
        postgres: include_str!("../../../migrations/postgres/0007_approvals.sql"),
        mysql: include_str!("../../../migrations/mysql/0007_approvals.sql"),
        sqlite: include_str!("../../../migrations/sqlite/0007_approvals.sql"),
    },
    Migration {
        version: 8,
        description: "idem_record.bound_fields, one business reference per scope",
        postgres: include_str!("../../../migrations/postgres/0008_reference_per_scope.sql"),
        mysql: include_str!("../../../migrations/mysql/0008_reference_per_scope.sql"),
        sqlite: include_str!("../../../migrations/sqlite/0008_reference_per_scope.sql"),
    },
];

const MIGRATIONS_TABLE: &str = "CREATE TABLE IF NOT EXISTS idem_schema_migrations (\
     version BIGINT NOT NULL PRIMARY KEY, description VARCHAR(255) NOT NULL, applied_at BIGINT NOT NULL)";

/// Cheap to clone: the pool and the statement texts are shared.
#[derive(Clone)]
pub struct SqlStore {
    pub(super) pool: Pool,
    backend: Backend,
    q: std::sync::Arc<Queries>,
    timeout: Duration,
    /// SQLite's writes go through one writer that commits them in groups (`group_commit`);
    /// `None` for Postgres and MySQL, whose writers lock rows, not the database, and whose
    /// commits already share a log flush.
    group: Option<GroupCommit>,
    /// What the database promised when last read (`replication`): read at connect, refreshed by the
    /// store probe; every clone shares it.
    replication: std::sync::Arc<std::sync::RwLock<Replication>>,
    /// [`SqlOptions::wait_for_standbys`].
    wait_for_standbys: bool,
}

impl SqlStore {
    /// Open the pool and bring the schema up to date.
    pub async fn connect(url: &str, opts: &SqlOptions) -> Result<Self, SqlError> {
        let backend = Backend::from_url(url).ok_or_else(|| {
            SqlError::Config(format!(
                "unsupported database URL {:?}: expected postgres://, mysql:// or sqlite:",
                crate::redact::redact_url(url)
            ))
        })?;
        let max = opts.max_connections.max(1);
        let pool = match backend {
            Backend::Postgres => {
                Pool::Pg(PgPoolOptions::new().max_connections(max).acquire_timeout(opts.timeout).connect(url).await?)
            }
            Backend::MySql => {
                Pool::My(MySqlPoolOptions::new().max_connections(max).acquire_timeout(opts.timeout).connect(url).await?)
            }
            Backend::Sqlite => {
                let options = SqliteConnectOptions::from_str(url)?
                    .create_if_missing(true)
                    // WAL: readers never wait for the writer. busy_timeout: a
                    // writer waits for the lock instead of failing with BUSY.
                    .journal_mode(SqliteJournalMode::Wal)
                    .busy_timeout(Duration::from_secs(5));
                let filename = options.get_filename();
                let in_memory = filename.as_os_str().is_empty() || filename == Path::new(":memory:");
                if !in_memory {
                    if let Some(dir) = filename.parent().filter(|d| !d.as_os_str().is_empty()) {
                        std::fs::create_dir_all(dir)
                            .map_err(|e| SqlError::Config(format!("cannot create {}: {e}", dir.display())))?;
                    }
                }
                // Every connection to `:memory:` is its own empty database.
                let max = if in_memory { 1 } else { max };
                Pool::Lite(
                    SqlitePoolOptions::new()
                        .max_connections(max)
                        .acquire_timeout(opts.timeout)
                        .idle_timeout(None)
                        .max_lifetime(None)
                        .connect_with(options)
                        .await?,
                )
            }
        };
        let mut store = Self {
            pool,
            backend,
            q: std::sync::Arc::new(Queries::new(backend)),
            timeout: opts.timeout,
            group: None,
            replication: std::sync::Arc::new(std::sync::RwLock::new(Replication::unknown("not read yet".into()))),
            wait_for_standbys: opts.wait_for_standbys,
        };
        // Before the migrations, which would fail on a read-only standby with a less useful error: writes go
        // to the primary only (DESIGN §4, "The truth never goes back in time").
        let replication = store.refresh_replication().await;
        if replication.mode == Mode::Standby {
            return Err(SqlError::Config(format!(
                "refusing to start: {} is a standby, not the primary ({}). idemd records operations on the \
                 primary only: point --database-url at the primary's read-write address (a Patroni or \
                 CloudNativePG -rw Service, the cluster endpoint of a managed database)",
                crate::redact::redact_url(url),
                replication.detail
            )));
        }
        store.migrate().await?;
        if let Pool::Lite(p) = &store.pool {
            store.group = Some(GroupCommit::start(p.clone()));
        }
        Ok(store)
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The replication state as last read (at connect, or by the last [`refresh_replication`](Self::refresh_replication)).
    pub fn replication(&self) -> Replication {
        self.replication.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// The mode alone, as last read: what every acquire asks (no copy of the words).
    pub fn replication_mode(&self) -> Mode {
        self.replication.read().unwrap_or_else(std::sync::PoisonError::into_inner).mode
    }

    /// Read the replication state now and keep it for [`replication`](Self::replication).
    pub async fn refresh_replication(&self) -> Replication {
        let now = replication::waited(self.read_replication().await, self.wait_for_standbys);
        *self.replication.write().unwrap_or_else(std::sync::PoisonError::into_inner) = now.clone();
        now
    }

    pub(super) async fn bounded<T>(
        &self,
        fut: impl std::future::Future<Output = Result<T, SqlError>>,
    ) -> Result<T, SqlError> {
        tokio::time::timeout(self.timeout, fut).await.map_err(|_| SqlError::Timeout)?
    }

    /// SQLite's group commit so far: (commits, writes they carried); `None` on Postgres and MySQL.
    pub fn commit_groups(&self) -> Option<(u64, u64)> {
        self.group.as_ref().map(|g| g.grouped().get())
    }

    /// Insert the IN_FLIGHT row. `false`: a row with this key already exists.
    pub async fn insert_in_flight(&self, row: &NewInFlight<'_>, audit: &Audit<'_>) -> Result<bool, SqlError> {
        let binds = [
            Bind::Text(row.key),
            Bind::Text(row.param_hash),
            Bind::Text(row.subject_hash),
            Bind::Text(row.scope),
            Bind::Text(row.owner),
            Bind::Int(row.lease_until_ms),
            Bind::Int(row.now_ms),
            Bind::Int(row.now_ms),
            Bind::OptInt(row.fp_exp_ms),
            Bind::Int(i64::from(row.upstream_ignores_keys)),
            Bind::OptText(row.business_ref),
            Bind::OptText(row.bound_fields),
            // The approval gate's key, and its clock (an approval past exp has lapsed).
            Bind::Text(row.key),
            Bind::Int(row.now_ms),
        ];
        let change = Change { key: row.key, from: None, to: Some("IN_FLIGHT"), at_ms: row.now_ms, audit };
        self.change(&self.q.insert, &binds, &change).await
    }

    /// The operation of `scope` that holds `reference` (its key), if any: why an insert with that
    /// reference inserted nothing (DESIGN §4, "A reference proves only its own operation").
    pub async fn reference_holder(&self, scope: &str, reference: &str) -> Result<Option<String>, SqlError> {
        let text = render(self.backend, "SELECT idem_key FROM idem_record WHERE scope = ? AND business_ref = ?");
        self.bounded(async {
            on_pool!(&self.pool, p => {
                let key: Option<String> =
                    sqlx::query_scalar(&text).bind(scope).bind(reference).fetch_optional(p).await?;
                self.standbys_flushed(true).await?;
                Ok(key.map(|k| k.trim_end().to_string()))
            })
        })
        .await
    }

    pub async fn get(&self, key: &str) -> Result<Option<Record>, SqlError> {
        let sql = self.q.select.as_str();
        self.bounded(async {
            on_pool!(&self.pool, p => {
                let row = sqlx::query(sql).bind(key).fetch_optional(p).await?;
                self.standbys_flushed(true).await?;
                match row {
                    None => Ok(None),
                    Some(row) => Ok(Some(read_record!(row)?)),
                }
            })
        })
        .await
    }

    /// Owner-checked IN_FLIGHT → DONE/FAILED. `false`: not this owner's
    /// IN_FLIGHT row (any more).
    pub async fn complete(
        &self,
        key: &str,
        owner: &str,
        state: TerminalState,
        result_json: &str,
        now_ms: i64,
        audit: &Audit<'_>,
    ) -> Result<bool, SqlError> {
        let to = state.as_str();
        let binds = [Bind::Text(to), Bind::Text(result_json), Bind::Int(now_ms), Bind::Text(key), Bind::Text(owner)];
        let change = Change { key, from: Some("IN_FLIGHT"), to: Some(to), at_ms: now_ms, audit };
        self.change(&self.q.complete, &binds, &change).await
    }

    /// Owner-checked delete of an IN_FLIGHT row. `false`: nothing of this
    /// owner's was in flight.
    pub async fn release(&self, key: &str, owner: &str, audit: &Audit<'_>) -> Result<bool, SqlError> {
        let binds = [Bind::Text(key), Bind::Text(owner)];
        let change = Change { key, from: Some("IN_FLIGHT"), to: None, at_ms: now_ms(), audit };
        self.change(&self.q.release, &binds, &change).await
    }

    /// Extend an IN_FLIGHT lease to `until_ms` (never shorten it) if `owner` still holds it;
    /// `false` when it does not (completed, released, or claimed by the reconciler).
    pub async fn renew(&self, key: &str, owner: &str, until_ms: i64) -> Result<bool, SqlError> {
        let now = now_ms();
        let binds = [Bind::Int(until_ms), Bind::Int(until_ms), Bind::Int(now), Bind::Text(key), Bind::Text(owner)];
        Ok(self.execute(&self.q.renew, &binds).await? == 1)
    }

    /// Run `text` (from [`audited`]) and, when it changed the row, append the
    /// audit line in the same commit: a state change is never on record
    /// without who made it, nor the other way round. One commit, not two,
    /// because a confirm's fresh path pays for every commit.
    pub(super) async fn change(&self, text: &str, binds: &[Bind<'_>], c: &Change<'_, '_>) -> Result<bool, SqlError> {
        let trail = [
            Bind::Int(c.at_ms),
            Bind::Text(c.audit.actor),
            Bind::Text(c.audit.action),
            Bind::OptText(c.from),
            Bind::OptText(c.to),
            Bind::Text(c.audit.why),
            Bind::OptText(Some(c.audit.trace_id).filter(|t| !t.is_empty())),
        ];
        let audit_sql = self.q.audit.as_str();
        if let Some(group) = &self.group {
            let audit: Vec<Bind<'_>> = std::iter::once(Bind::Text(c.key)).chain(trail.iter().copied()).collect();
            let write =
                Write { first: Statement::new(text, binds), if_one_row: Some(Statement::new(audit_sql, &audit)) };
            return self.bounded(group.write(write)).await.map(|n| n == 1);
        }
        self.bounded(async {
            on_pool!(&self.pool, p => {
                if self.backend == Backend::Postgres {
                    let all: Vec<Bind<'_>> = binds.iter().chain(trail.iter()).copied().collect();
                    let n = bind_all!(sqlx::query(text), all).execute(p).await?.rows_affected();
                    self.standbys_flushed(false).await?;
                    return Ok(n == 1);
                }
                let mut tx = p.begin().await?;
                let n = bind_all!(sqlx::query(text), binds).execute(&mut *tx).await?.rows_affected();
                if n == 1 {
                    bind_all!(sqlx::query(audit_sql).bind(c.key), trail).execute(&mut *tx).await?;
                }
                tx.commit().await?;
                Ok(n == 1)
            })
        })
        .await
    }

    /// One statement on the pool; how many rows it touched.
    pub(super) async fn execute(&self, text: &str, binds: &[Bind<'_>]) -> Result<u64, SqlError> {
        if let Some(group) = &self.group {
            return self.bounded(group.write(Write { first: Statement::new(text, binds), if_one_row: None })).await;
        }
        self.bounded(async {
            let n = on_pool!(&self.pool, p => bind_all!(sqlx::query(text), binds).execute(p).await?.rows_affected());
            self.standbys_flushed(false).await?;
            Ok(n)
        })
        .await
    }

    /// Where [`waits_for_standbys`](replication::waits_for_standbys) says so (`read`: the call read what
    /// idemd will answer from), return once every standby the primary knows has flushed everything committed so
    /// far: a write idemd answers is then on every standby a failover could promote, as on a synchronous standby,
    /// and so is whatever a read saw (an approver's decision, a DONE row, a released key's absence), which a
    /// failover must not undo. "Knows": streaming now (`pg_stat_replication`, logical subscribers aside), or
    /// cut off with a physical slot that has been used (`pg_replication_slots`: the standby that lags is
    /// exactly the one whose connection is gone). A standby still catching up is not waited for, as Postgres'
    /// own synchronous replication does not. Runs inside the caller's [`bounded`](Self::bounded) budget: a
    /// standby that does not confirm in time makes the write [`SqlError::Timeout`], which already means "may
    /// have committed, and nothing was acknowledged" (the commit is on the primary, not promised to survive).
    pub(super) async fn standbys_flushed(&self, read: bool) -> Result<(), SqlError> {
        // The first pass reads the position to wait for (the WAL inserted so far: at or past this
        // session's commit, which has returned) and how many standbys are behind it; later passes ask
        // again about that position. One round trip when the standbys are already there.
        const BEHIND: &str = "WITH at AS (SELECT COALESCE($1::text::pg_lsn, pg_current_wal_insert_lsn()) AS lsn) \
             SELECT at.lsn::text, \
               (SELECT count(*) FROM pg_stat_replication r WHERE r.state = 'streaming' \
                  AND (r.flush_lsn IS NULL OR r.flush_lsn < at.lsn) \
                  AND NOT EXISTS (SELECT 1 FROM pg_replication_slots s \
                                  WHERE s.active_pid = r.pid AND s.slot_type = 'logical')) \
             + (SELECT count(*) FROM pg_replication_slots s WHERE s.slot_type = 'physical' AND NOT s.active \
                  AND s.restart_lsn IS NOT NULL AND s.restart_lsn < at.lsn) \
             FROM at";
        let Pool::Pg(p) = &self.pool else { return Ok(()) };
        let waits = replication::waits_for_standbys(
            &self.replication.read().unwrap_or_else(std::sync::PoisonError::into_inner),
            read,
        );
        if !waits {
            return Ok(());
        }
        let mut at: Option<String> = None;
        let mut pause = Duration::from_micros(250);
        loop {
            let (lsn, behind): (String, i64) = sqlx::query_as(BEHIND).bind(at.as_deref()).fetch_one(p).await?;
            if behind == 0 {
                return Ok(());
            }
            at = Some(lsn);
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(10));
        }
    }

    /// Rows of `idem_record` selected with [`COLUMNS`].
    pub(super) async fn records(&self, text: &str, binds: &[Bind<'_>]) -> Result<Vec<Record>, SqlError> {
        self.bounded(async {
            on_pool!(&self.pool, p => {
                let rows = bind_all!(sqlx::query(text), binds).fetch_all(p).await?;
                self.standbys_flushed(true).await?;
                let mut out = Vec::with_capacity(rows.len());
                for row in rows {
                    out.push(read_record!(row)?);
                }
                Ok(out)
            })
        })
        .await
    }

    /// A single integer (a COUNT).
    pub(super) async fn scalar(&self, text: &str, binds: &[Bind<'_>]) -> Result<i64, SqlError> {
        self.bounded(async {
            on_pool!(&self.pool, p => Ok(bind_all!(sqlx::query_scalar::<_, i64>(text), binds).fetch_one(p).await?))
        })
        .await
    }

    pub async fn ping(&self) -> Result<(), SqlError> {
        self.bounded(async {
            on_pool!(&self.pool, p => {
                sqlx::query("SELECT 1").execute(p).await?;
            });
            Ok(())
        })
        .await
    }

    async fn migrate(&self) -> Result<(), SqlError> {
        // Several replicas may start at once: the first migrates, the others
        // wait on the lock and then find nothing left to do. SQLite is a
        // single node's file and needs no lock.
        let (lock, unlock) = match self.backend {
            Backend::Postgres => {
                (Some("SELECT pg_advisory_lock(7274302531)"), Some("SELECT pg_advisory_unlock(7274302531)"))
            }
            Backend::MySql => {
                (Some("SELECT GET_LOCK('idemd_migrations', 60)"), Some("SELECT RELEASE_LOCK('idemd_migrations')"))
            }
            Backend::Sqlite => (None, None),
        };
        let record = render(
            self.backend,
            "INSERT INTO idem_schema_migrations (version, description, applied_at) VALUES (?, ?, ?)",
        );
        let started = Instant::now();
        on_pool!(&self.pool, p => {
            let mut conn = p.acquire().await?;
            if let Some(lock) = lock {
                sqlx::query(lock).execute(&mut *conn).await?;
            }
            let mut outcome: Result<usize, SqlError> = Ok(0);
            if let Err(e) = sqlx::raw_sql(MIGRATIONS_TABLE).execute(&mut *conn).await {
                outcome = Err(e.into());
            }
            let applied: Vec<i64> = if outcome.is_ok() {
                match sqlx::query_scalar("SELECT version FROM idem_schema_migrations").fetch_all(&mut *conn).await {
                    Ok(v) => v,
                    Err(e) => {
                        outcome = Err(e.into());
                        Vec::new()
                    }
                }
            } else {
                Vec::new()
            };
            for m in MIGRATIONS.iter().filter(|m| !applied.contains(&m.version)) {
                if outcome.is_err() {
                    break;
                }
                let text = match self.backend {
                    Backend::Postgres => m.postgres,
                    Backend::MySql => m.mysql,
                    Backend::Sqlite => m.sqlite,
                };
                let step = async {
                    sqlx::raw_sql(text).execute(&mut *conn).await?;
                    sqlx::query(&record)
                        .bind(m.version)
                        .bind(m.description)
                        .bind(now_ms())
                        .execute(&mut *conn)
                        .await?;
                    Ok::<_, sqlx::Error>(())
                };
                match step.await {
                    Ok(()) => {
                        tracing::info!(version = m.version, description = m.description, "applied migration");
                        outcome = outcome.map(|n| n + 1);
                    }
                    Err(e) => outcome = Err(e.into()),
                }
            }
            if let Some(unlock) = unlock {
                // Dropping the connection would release it too; say so explicitly.
                let _ = sqlx::query(unlock).execute(&mut *conn).await;
            }
            let applied_now = outcome?;
            tracing::debug!(applied_now, elapsed_ms = started.elapsed().as_millis() as u64, "schema up to date");
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_per_dialect() {
        let t = "UPDATE t SET a = ? WHERE idem_key = ?k AND b = ?";
        assert_eq!(render(Backend::MySql, t), "UPDATE t SET a = ? WHERE idem_key = ? AND b = ?");
        assert_eq!(render(Backend::Sqlite, t), "UPDATE t SET a = ? WHERE idem_key = ? AND b = ?");
        assert_eq!(
            render(Backend::Postgres, t),
            "UPDATE t SET a = $1 WHERE idem_key = CAST($2 AS CHAR(32)) AND b = $3"
        );
    }

    #[test]
    fn backend_from_url() {
        assert_eq!(Backend::from_url("postgres://u@h/db"), Some(Backend::Postgres));
        assert_eq!(Backend::from_url("postgresql://h/db"), Some(Backend::Postgres));
        assert_eq!(Backend::from_url("mysql://root@h/db"), Some(Backend::MySql));
        assert_eq!(Backend::from_url("sqlite://./data/idem.db?mode=rwc"), Some(Backend::Sqlite));
        assert_eq!(Backend::from_url("sqlite::memory:"), Some(Backend::Sqlite));
        assert_eq!(Backend::from_url("redis://h"), None);
    }

    #[test]
    fn state_check_constraint_lists_every_state() {
        for m in MIGRATIONS {
            for text in [m.postgres, m.mysql, m.sqlite]
                .into_iter()
                .filter(|t| t.contains("CREATE TABLE IF NOT EXISTS idem_record"))
            {
                for s in ["IN_FLIGHT", "DONE", "FAILED", "NEEDS_REVIEW"] {
                    assert!(text.contains(&format!("'{s}'")), "{s} missing");
                }
            }
        }
    }
}
