//! The baselines the filter is measured against: the raw single-row commit rate of
//! idemd's own database, and the plain-Envoy sides (the same request through a
//! listener without the filter, or with an empty proxy-wasm filter).

use crate::client::{confirm_request, Measured};
use idem_e2e::{repo_root, BoxError};
use std::time::{Duration, Instant};

/// idemd's default SQL pool (`--sql-max-connections`); the raw baseline uses the same.
pub(crate) const IDEMD_SQL_POOL: u32 = 16;

// ---- plain Envoy --------------------------------------------------------------

/// `n` confirms for plain Envoy, each with its own Idempotency-Key, so the demo
/// behind it commits a row per request: what a fresh confirm costs without the
/// filter. `tag` keeps the keys of different runs apart.
pub(crate) fn plain_fresh_confirms(fingerprint: &str, tag: &str, n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| confirm_request(fingerprint, Some(&format!("{tag:0<12.12}{i:020x}")))).collect()
}

/// One fixed Idempotency-Key for plain Envoy's duplicate confirm: the demo runs
/// it once and answers every repeat from its own database.
pub(crate) fn plain_duplicate_key() -> String {
    format!("bench{:027x}", std::process::id())
}

// ---- the raw single-row commit baseline ------------------------------------

pub(crate) enum RawDb {
    Pg { pool: sqlx::PgPool, table: String },
    Lite { pool: sqlx::SqlitePool, table: String },
}

/// idemd's own migration, for a table of our own in the same database: same
/// columns, same primary key, same index, so one raw commit costs what idemd's
/// IN_FLIGHT insert costs.
fn bench_table_ddl(dialect: &str, table: &str) -> Result<String, BoxError> {
    let path = repo_root().join(format!("sidecar/migrations/{dialect}/0001_idem_record.sql"));
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(text.replace("idem_record", table))
}

impl RawDb {
    pub(crate) async fn postgres(url: &str) -> Result<RawDb, BoxError> {
        let pool = sqlx::postgres::PgPoolOptions::new().max_connections(IDEMD_SQL_POOL).connect(url).await?;
        let table = format!("idem_bench_raw_{}", std::process::id());
        sqlx::raw_sql(&format!("DROP TABLE IF EXISTS {table}")).execute(&pool).await?;
        sqlx::raw_sql(&bench_table_ddl("postgres", &table)?).execute(&pool).await?;
        Ok(RawDb::Pg { pool, table })
    }

    /// The same file idemd uses, opened the way idemd opens it (WAL, busy timeout, pool size).
    pub(crate) async fn sqlite(url: &str) -> Result<RawDb, BoxError> {
        use std::str::FromStr;
        let o = sqlx::sqlite::SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(5));
        let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(IDEMD_SQL_POOL).connect_with(o).await?;
        let table = "idem_bench_raw".to_owned();
        sqlx::raw_sql(&bench_table_ddl("sqlite", &table)?).execute(&pool).await?;
        Ok(RawDb::Lite { pool, table })
    }

    pub(crate) async fn drop_table(&self) {
        let _ = match self {
            RawDb::Pg { pool, table } => {
                sqlx::raw_sql(&format!("DROP TABLE IF EXISTS {table}")).execute(pool).await.map(|_| ())
            }
            RawDb::Lite { pool, table } => {
                sqlx::raw_sql(&format!("DROP TABLE IF EXISTS {table}")).execute(pool).await.map(|_| ())
            }
        };
    }

    /// `conns` workers, each committing one single-row INSERT (autocommit) after another.
    pub(crate) async fn drive(&self, conns: usize, secs: f64, run: &str) -> Measured {
        let start = Instant::now();
        let deadline = start + Duration::from_secs_f64(secs);
        let mut set = tokio::task::JoinSet::new();
        for w in 0..conns {
            let prefix = format!("{run}{w:04x}");
            let db = match self {
                RawDb::Pg { pool, table } => RawDb::Pg { pool: pool.clone(), table: table.clone() },
                RawDb::Lite { pool, table } => RawDb::Lite { pool: pool.clone(), table: table.clone() },
            };
            set.spawn(async move {
                let mut m = Measured { lat: Vec::with_capacity(1 << 12), ..Default::default() };
                let mut i: u64 = 0;
                while Instant::now() < deadline {
                    i += 1;
                    // 32 chars, like a nonce.
                    let key = format!("{prefix:0<16.16}{i:016x}");
                    let t = Instant::now();
                    match db.insert(&key).await {
                        Ok(1) => {
                            m.ok += 1;
                            m.lat.push(t.elapsed());
                        }
                        Ok(_) => m.unexpected += 1,
                        Err(e) => {
                            m.errors += 1;
                            if m.sample.is_none() {
                                m.sample = Some(e.to_string());
                            }
                        }
                    }
                }
                m
            });
        }
        let mut total = Measured::default();
        while let Some(r) = set.join_next().await {
            if let Ok(m) = r {
                total.merge(m);
            }
        }
        total.secs = start.elapsed().as_secs_f64();
        total
    }

    /// The statement idemd issues for a fresh acquire (sidecar/src/store/sql/mod.rs).
    async fn insert(&self, key: &str) -> Result<u64, sqlx::Error> {
        let now = now_ms();
        let owner = "0123456789abcdef0123456789abcdef";
        let param_hash = "7d865e959b2466918c9863afca942d0fb89d7c9ac0c99bafc3749504ded97730";
        let subject_hash = "9f86d081884c7d659a2feaa0c55ad015";
        let cols = "(idem_key, state, param_hash, subject_hash, scope, owner, lease_until, created_at, updated_at)";
        match self {
            RawDb::Pg { pool, table } => {
                let sql = format!(
                    "INSERT INTO {table} {cols} VALUES (CAST($1 AS CHAR(32)), 'IN_FLIGHT', $2, $3, $4, $5, $6, $7, $8)"
                );
                let q = sqlx::query(&sql).bind(key).bind(param_hash).bind(subject_hash).bind("payments.transfer");
                Ok(q.bind(owner).bind(now + 60_000).bind(now).bind(now).execute(pool).await?.rows_affected())
            }
            RawDb::Lite { pool, table } => {
                let sql = format!("INSERT INTO {table} {cols} VALUES (?, 'IN_FLIGHT', ?, ?, ?, ?, ?, ?, ?)");
                let q = sqlx::query(&sql).bind(key).bind(param_hash).bind(subject_hash).bind("payments.transfer");
                Ok(q.bind(owner).bind(now + 60_000).bind(now).bind(now).execute(pool).await?.rows_affected())
            }
        }
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

/// What Postgres says about idemd's table: the fresh-confirm rate depends on it.
pub(crate) async fn pg_diagnostics(url: &str) -> Vec<String> {
    let mut out = Vec::new();
    let Ok(pool) = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(url).await else { return out };
    // The test database may run without autovacuum (CI's does): the rows earlier runs wrote and removed stay as dead
    // tuples, and the planner's statistics go stale (a run here once updated through idem_record_state_updated
    // instead of the primary key). A database in production vacuums; so does the bench, before it measures.
    if let Err(e) = sqlx::raw_sql("VACUUM ANALYZE idem_record").execute(&pool).await {
        out.push(format!("postgres: VACUUM ANALYZE idem_record failed: {e}"));
    }
    let autovacuum: Option<String> =
        sqlx::query_scalar("SELECT current_setting('autovacuum')").fetch_optional(&pool).await.ok().flatten();
    let tuples: Option<(i64, i64)> =
        sqlx::query_as("SELECT n_live_tup, n_dead_tup FROM pg_stat_user_tables WHERE relname = 'idem_record'")
            .fetch_optional(&pool)
            .await
            .ok()
            .flatten();
    let plan: Vec<String> = sqlx::query_scalar(
        "EXPLAIN UPDATE idem_record SET state = 'DONE', updated_at = 0 \
         WHERE idem_key = CAST('00000000000000000000000000000000' AS CHAR(32)) AND owner = 'x' AND state = 'IN_FLIGHT'",
    )
    .fetch_all(&pool)
    .await
    .unwrap_or_default();
    // The access path: "Index Scan using <index> on ...", "Bitmap Index Scan on <index>" or "Seq Scan".
    let index = plan.iter().find_map(|l| {
        let word_after =
            |pat: &str| l.split_once(pat).and_then(|(_, r)| r.split_whitespace().next()).map(str::to_owned);
        word_after("Index Scan using ")
            .or_else(|| word_after("Index Scan on "))
            .or_else(|| l.contains("Seq Scan").then(|| "a sequential scan".to_owned()))
    });
    if let Some((live, dead)) = tuples {
        out.push(format!(
            "postgres: autovacuum={}, idem_record has {live} live / {dead} dead tuples (after VACUUM ANALYZE); complete's UPDATE plan uses {}",
            autovacuum.as_deref().unwrap_or("?"),
            index.as_deref().unwrap_or("?")
        ));
    }
    pool.close().await;
    out
}
