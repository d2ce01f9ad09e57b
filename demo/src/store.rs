//! The service's own SQLite database: one row per real execution
//! (`write_record`) and a per-key count of confirm requests (`attempt`).

use serde::Serialize;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Row, SqlitePool};
use std::collections::BTreeMap;
use std::str::FromStr;

/// `idem_key` carries the UNIQUE constraint that makes a duplicate confirm
/// a no-op; `request_key` is the caller's `Idempotency-Key` as sent (the two
/// differ only under `--no-dedup`; under `--no-keys` it is [`NO_KEY`] and
/// `idem_key` is the transfer's own id). `client_ref` is the confirm's own
/// reference, when it sent one (`GET /v1/transfers/by-ref/{ref}`).
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS write_record (
    id          INTEGER PRIMARY KEY,
    idem_key    TEXT NOT NULL UNIQUE,
    request_key TEXT NOT NULL,
    transfer_id TEXT NOT NULL,
    amount      TEXT NOT NULL,
    currency    TEXT NOT NULL,
    payee_id    TEXT NOT NULL,
    memo        TEXT,
    client_ref  TEXT,
    response    TEXT NOT NULL,
    created_at  INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS write_record_request_key ON write_record (request_key);
CREATE TABLE IF NOT EXISTS attempt (
    idem_key   TEXT PRIMARY KEY,
    count      INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
);
";

/// `client_ref` came with the no-key mode: a database file from before it gets the column here
/// (`CREATE TABLE IF NOT EXISTS` leaves an existing table as it was).
const CLIENT_REF_INDEX: &str = "CREATE INDEX IF NOT EXISTS write_record_client_ref ON write_record (client_ref)";

/// Attempts without an `Idempotency-Key` are counted under this key, which
/// a real header can never have (an empty header counts as no header); so
/// are the executions of `--no-keys`, which reads no key.
pub const NO_KEY: &str = "";

#[derive(Clone)]
pub struct Store {
    pool: SqlitePool,
}

/// A row to insert; `response` is the exact body every later replay returns.
pub struct NewRecord<'a> {
    pub idem_key: &'a str,
    pub request_key: &'a str,
    pub transfer_id: &'a str,
    pub amount: &'a str,
    pub currency: &'a str,
    pub payee_id: &'a str,
    pub memo: Option<&'a str>,
    pub client_ref: Option<&'a str>,
    pub response: &'a str,
    pub created_at: i64,
}

pub enum Inserted {
    /// This request performed the business action.
    Executed,
    /// The key was already used; here is the first execution's body.
    Duplicate(String),
}

#[derive(Serialize)]
pub struct Executions {
    pub total: i64,
    pub by_key: BTreeMap<String, i64>,
    pub attempts: i64,
    pub attempts_by_key: BTreeMap<String, i64>,
}

impl Store {
    /// Opens (creating file and directories if needed) `db`, given as a
    /// `sqlite:` URL or a plain path.
    pub async fn open(db: &str) -> Result<Store, sqlx::Error> {
        let options = if db.starts_with("sqlite:") {
            SqliteConnectOptions::from_str(db)?
        } else {
            SqliteConnectOptions::new().filename(db)
        };
        let in_memory = db.contains(":memory:") || db.contains("mode=memory");
        // NORMAL in WAL mode survives a process crash (only power loss could
        // drop the last commits), which is the crash the faults simulate.
        let options =
            options.create_if_missing(true).journal_mode(SqliteJournalMode::Wal).synchronous(SqliteSynchronous::Normal);
        if !in_memory {
            if let Some(dir) = options.get_filename().parent() {
                if !dir.as_os_str().is_empty() {
                    std::fs::create_dir_all(dir)?;
                }
            }
        }
        // SQLite has a single writer: queueing in the pool is cheaper than
        // several connections busy-waiting on the file lock. One connection
        // that never expires also keeps an in-memory database alive.
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_with(options)
            .await?;
        sqlx::raw_sql(SCHEMA).execute(&pool).await?;
        let has_client_ref: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM pragma_table_info('write_record') WHERE name = 'client_ref'")
                .fetch_one(&pool)
                .await?;
        if has_client_ref == 0 {
            sqlx::query("ALTER TABLE write_record ADD COLUMN client_ref TEXT").execute(&pool).await?;
        }
        sqlx::query(CLIENT_REF_INDEX).execute(&pool).await?;
        Ok(Store { pool })
    }

    /// Counts one confirm request and returns how many there have now been
    /// for `key` (1 = first).
    pub async fn count_attempt(&self, key: Option<&str>, now: i64) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(
            "INSERT INTO attempt (idem_key, count, updated_at) VALUES (?1, 1, ?2)
             ON CONFLICT (idem_key) DO UPDATE SET count = count + 1, updated_at = ?2
             RETURNING count",
        )
        .bind(key.unwrap_or(NO_KEY))
        .bind(now)
        .fetch_one(&self.pool)
        .await
    }

    /// Records an execution; the UNIQUE constraint, not a prior read, decides
    /// whether this request is the one that executes.
    pub async fn insert(&self, rec: &NewRecord<'_>) -> Result<Inserted, sqlx::Error> {
        let inserted = sqlx::query(
            "INSERT INTO write_record
               (idem_key, request_key, transfer_id, amount, currency, payee_id, memo, client_ref, response, created_at)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
             ON CONFLICT (idem_key) DO NOTHING",
        )
        .bind(rec.idem_key)
        .bind(rec.request_key)
        .bind(rec.transfer_id)
        .bind(rec.amount)
        .bind(rec.currency)
        .bind(rec.payee_id)
        .bind(rec.memo)
        .bind(rec.client_ref)
        .bind(rec.response)
        .bind(rec.created_at)
        .execute(&self.pool)
        .await?
        .rows_affected();
        if inserted == 1 {
            return Ok(Inserted::Executed);
        }
        let stored = sqlx::query_scalar("SELECT response FROM write_record WHERE idem_key = ?")
            .bind(rec.idem_key)
            .fetch_one(&self.pool)
            .await?;
        Ok(Inserted::Duplicate(stored))
    }

    /// The first execution's response body for a caller's key.
    pub async fn by_key(&self, key: &str) -> Result<Option<String>, sqlx::Error> {
        sqlx::query_scalar("SELECT response FROM write_record WHERE request_key = ? ORDER BY id LIMIT 1")
            .bind(key)
            .fetch_optional(&self.pool)
            .await
    }

    /// The first execution's response body sent with this `client_ref`.
    pub async fn by_client_ref(&self, client_ref: &str) -> Result<Option<String>, sqlx::Error> {
        sqlx::query_scalar("SELECT response FROM write_record WHERE client_ref = ? ORDER BY id LIMIT 1")
            .bind(client_ref)
            .fetch_optional(&self.pool)
            .await
    }

    /// `by_key` lists executions under their Idempotency-Key; `--no-keys` executions count in
    /// `total` only.
    pub async fn executions(&self) -> Result<Executions, sqlx::Error> {
        let mut by_key = BTreeMap::new();
        let mut total = 0;
        for row in sqlx::query("SELECT request_key, COUNT(*) FROM write_record GROUP BY request_key")
            .fetch_all(&self.pool)
            .await?
        {
            let (key, count): (String, i64) = (row.try_get(0)?, row.try_get(1)?);
            total += count;
            if key != NO_KEY {
                by_key.insert(key, count);
            }
        }
        let mut attempts_by_key = BTreeMap::new();
        let mut attempts = 0;
        for row in sqlx::query("SELECT idem_key, count FROM attempt").fetch_all(&self.pool).await? {
            let (key, count): (String, i64) = (row.try_get(0)?, row.try_get(1)?);
            attempts += count;
            if key != NO_KEY {
                attempts_by_key.insert(key, count);
            }
        }
        Ok(Executions { total, by_key, attempts, attempts_by_key })
    }
}
