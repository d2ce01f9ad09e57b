//! idem-bench: one bounded run, side by side, of acquire+complete pairs per
//! second through idemd's store, next to the raw rates of the same Redis EVALs
//! and the same single-row SQL insert+update measured in the same run. Not a
//! test: numbers depend on the machine; the ratios are what to read.
//!
//! `cargo run --release -p idem-bench --bin idem-bench -- --seconds 3 --concurrency 16`

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use idem_core::protocol::{Ack, AcquireOutcome, AcquireRequest, CompleteRequest, OpKey, StoredResult, TerminalState};
use idemd::metrics::Metrics;
use idemd::store::redis::{RedisOptions, RedisStore, ACQUIRE_LUA, COMPLETE_LUA};
use idemd::store::sql::{Backend, SqlOptions, SqlStore};
use idemd::store::{now_ms, Store, StoreSettings};

#[derive(Parser, Debug, Clone)]
#[command(name = "idem-bench")]
struct Args {
    /// Length of each case.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Concurrent workers per case (each loops acquire → complete on fresh keys).
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    #[arg(long, env = "IDEM_TEST_REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    redis_url: String,
    #[arg(long, env = "IDEM_TEST_POSTGRES_URL", default_value = "postgres://postgres@127.0.0.1:5432/test")]
    postgres_url: String,
    #[arg(long, env = "IDEM_TEST_MYSQL_URL", default_value = "mysql://root@127.0.0.1:3306/test")]
    mysql_url: String,
    /// Run only the cases whose name contains this.
    #[arg(long)]
    only: Option<String>,
    /// SQL pool size of idemd's store in the idemd cases (idemd's `--sql-max-connections`); the raw
    /// cases keep one connection per worker. Default: as many as `--concurrency`.
    #[arg(long)]
    pool: Option<u32>,
}

const HTTP_CASE: &str = "idemd redis+postgres over HTTP";

struct Measured {
    name: String,
    pairs_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    errors: u64,
}

/// Keys of this run share an 8-hex prefix so the rows can be removed after.
struct Keys {
    prefix: String,
}

impl Keys {
    fn new() -> Self {
        Self { prefix: idemd::store::new_owner()[..8].to_string() }
    }

    fn next(&self) -> OpKey {
        let key = format!("{}{}", self.prefix, &idemd::store::new_owner()[..24]);
        // prefix (8 hex) + 24 hex: a well-formed key by construction.
        OpKey::parse(&key).unwrap_or_else(|_| OpKey::from_bytes(rand16()))
    }
}

fn result() -> StoredResult {
    StoredResult {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body_b64: "eyJ0cmFuc2Zlcl9pZCI6InRyXzEyMzQ1NiIsInN0YXR1cyI6ImRvbmUifQ==".into(),
    }
}

/// Run `pair` from `concurrency` workers for `seconds`; count successes.
async fn run<F, Fut>(name: &str, args: &Args, pair: F) -> Measured
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let pair = Arc::new(pair);
    // Warm-up: connections, prepared statements, script cache.
    for _ in 0..args.concurrency.min(8) {
        pair().await;
    }
    let deadline = Instant::now() + Duration::from_secs_f64(args.seconds);
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..args.concurrency {
        let pair = pair.clone();
        workers.spawn(async move {
            let mut lat = Vec::with_capacity(4096);
            let mut errors = 0u64;
            while Instant::now() < deadline {
                let t = Instant::now();
                if pair().await {
                    lat.push(t.elapsed());
                } else {
                    errors += 1;
                }
            }
            (lat, errors)
        });
    }
    let mut all = Vec::new();
    let mut errors = 0;
    while let Some(Ok((lat, e))) = workers.join_next().await {
        all.extend(lat);
        errors += e;
    }
    let elapsed = started.elapsed().as_secs_f64();
    all.sort();
    let pct = |p: f64| {
        if all.is_empty() {
            0.0
        } else {
            all[((all.len() - 1) as f64 * p) as usize].as_secs_f64() * 1000.0
        }
    };
    let m = Measured {
        name: name.to_string(),
        pairs_per_s: all.len() as f64 / elapsed,
        p50_ms: pct(0.50),
        p99_ms: pct(0.99),
        errors,
    };
    eprintln!("  {:<34} {:>9.0} pairs/s", m.name, m.pairs_per_s);
    m
}

// ---- raw baselines --------------------------------------------------------

async fn raw_redis(args: &Args, keys: Arc<Keys>) -> Option<Measured> {
    let client = redis::Client::open(args.redis_url.as_str()).ok()?;
    let conn = match tokio::time::timeout(Duration::from_secs(2), client.get_multiplexed_async_connection()).await {
        Ok(Ok(c)) => c,
        _ => {
            eprintln!("SKIPPED BACKEND redis ({}): unreachable", args.redis_url);
            return None;
        }
    };
    let acquire = Arc::new(redis::Script::new(ACQUIRE_LUA));
    let complete = Arc::new(redis::Script::new(COMPLETE_LUA));
    let result_json = serde_json::to_string(&result()).ok()?;
    Some(
        run("raw redis EVAL acquire+complete", args, move || {
            let (mut conn, acquire, complete, keys, result_json) =
                (conn.clone(), acquire.clone(), complete.clone(), keys.clone(), result_json.clone());
            async move {
                let key = idemd::store::redis::redis_key(&keys.next());
                let owner = idemd::store::new_owner();
                let a: redis::RedisResult<(String, String, i64)> =
                    acquire.key(&key).arg("p").arg("u").arg("s").arg(&owner).arg(60_000).invoke_async(&mut conn).await;
                let c: redis::RedisResult<String> = complete
                    .key(&key)
                    .arg(&owner)
                    .arg("DONE")
                    .arg(&result_json)
                    .arg(60_000)
                    .invoke_async(&mut conn)
                    .await;
                matches!(a, Ok((ref s, _, _)) if s == "ACQUIRED") && matches!(c, Ok(ref s) if s == "OK")
            }
        })
        .await,
    )
}

/// The same single-row insert and update idemd issues, straight on a pool.
async fn raw_sql(label: &str, url: &str, args: &Args, keys: Arc<Keys>) -> Option<Measured> {
    let backend = Backend::from_url(url)?;
    // Make sure the table exists (migrations) before the raw run.
    let opts = SqlOptions {
        max_connections: args.concurrency as u32,
        timeout: Duration::from_secs(5),
        ..SqlOptions::default()
    };
    if let Err(e) = SqlStore::connect(url, &opts).await {
        eprintln!("SKIPPED BACKEND {label}: {e}");
        return None;
    }
    let (insert, update) = match backend {
        Backend::Postgres => (
            "INSERT INTO idem_record (idem_key, state, param_hash, subject_hash, scope, owner, lease_until, created_at, updated_at) \
             VALUES (CAST($1 AS CHAR(32)), 'IN_FLIGHT', $2, $3, $4, $5, $6, $7, $8)",
            "UPDATE idem_record SET state = 'DONE', result = $1, lease_until = NULL, updated_at = $2 \
             WHERE idem_key = CAST($3 AS CHAR(32)) AND owner = $4 AND state = 'IN_FLIGHT'",
        ),
        Backend::MySql | Backend::Sqlite => (
            "INSERT INTO idem_record (idem_key, state, param_hash, subject_hash, scope, owner, lease_until, created_at, updated_at) \
             VALUES (?, 'IN_FLIGHT', ?, ?, ?, ?, ?, ?, ?)",
            "UPDATE idem_record SET state = 'DONE', result = ?, lease_until = NULL, updated_at = ? \
             WHERE idem_key = ? AND owner = ? AND state = 'IN_FLIGHT'",
        ),
    };
    let result_json = serde_json::to_string(&result()).ok()?;
    macro_rules! bench_pool {
        ($pool:expr) => {{
            let pool = $pool;
            run(&format!("raw {label} insert+update"), args, move || {
                let (pool, keys, result_json) = (pool.clone(), keys.clone(), result_json.clone());
                async move {
                    let key = keys.next();
                    let owner = idemd::store::new_owner();
                    let now = now_ms();
                    let i = sqlx::query(insert)
                        .bind(key.as_str())
                        .bind("p")
                        .bind("u")
                        .bind("s")
                        .bind(&owner)
                        .bind(now + 60_000)
                        .bind(now)
                        .bind(now)
                        .execute(&pool)
                        .await;
                    let u = sqlx::query(update)
                        .bind(&result_json)
                        .bind(now)
                        .bind(key.as_str())
                        .bind(&owner)
                        .execute(&pool)
                        .await;
                    i.is_ok_and(|r| r.rows_affected() == 1) && u.is_ok_and(|r| r.rows_affected() == 1)
                }
            })
            .await
        }};
    }
    let n = args.concurrency as u32;
    Some(match backend {
        Backend::Postgres => {
            bench_pool!(sqlx::postgres::PgPoolOptions::new().max_connections(n).connect(url).await.ok()?)
        }
        Backend::MySql => {
            bench_pool!(sqlx::mysql::MySqlPoolOptions::new().max_connections(n).connect(url).await.ok()?)
        }
        Backend::Sqlite => {
            use std::str::FromStr;
            let o = sqlx::sqlite::SqliteConnectOptions::from_str(url)
                .ok()?
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                .busy_timeout(Duration::from_secs(5));
            bench_pool!(sqlx::sqlite::SqlitePoolOptions::new().max_connections(n).connect_with(o).await.ok()?)
        }
    })
}

// ---- idemd's store --------------------------------------------------------

async fn open_store(args: &Args, sql_url: &str, redis: bool) -> Option<Arc<Store>> {
    let max_connections = args.pool.unwrap_or(args.concurrency as u32);
    let opts = SqlOptions { max_connections, timeout: Duration::from_secs(5), ..SqlOptions::default() };
    let sql = SqlStore::connect(sql_url, &opts).await.ok()?;
    let redis = if redis {
        Some(
            RedisStore::open(&RedisOptions {
                url: args.redis_url.clone(),
                cluster: false,
                timeout: Duration::from_millis(500),
                retry: Duration::from_millis(500),
            })
            .ok()?,
        )
    } else {
        None
    };
    let settings = StoreSettings { lease_ms: 60_000, terminal_retention_ms: 60_000, stale_in_flight_ms: 11_000 };
    Some(Arc::new(Store::new(sql, redis, settings, Arc::new(Metrics::new()))))
}

const BENCH_TOKEN: &str = "idem-bench-token-0123456789";

fn rand16() -> [u8; 16] {
    let mut b = [0u8; 16];
    let _ = getrandom::fill(&mut b);
    b
}

fn request(key: OpKey) -> AcquireRequest {
    AcquireRequest {
        key,
        param_hash: "7d865e959b2466918c9863afca942d0fb89d7c9ac0c99bafc3749504ded97730".into(),
        subject_hash: "9f86d081884c7d659a2feaa0c55ad015".into(),
        scope: "payments.transfer".into(),
        lease_ms: 0,
        trace_id: String::new(),
        mode: Default::default(),
        exp: None,
        upstream_ignores_keys: false,
        business_ref: None,
        fields: None,
        approval: None,
    }
}

async fn store_case(name: &str, args: &Args, store: Arc<Store>, keys: Arc<Keys>) -> Measured {
    run(name, args, move || {
        let (store, keys) = (store.clone(), keys.clone());
        async move {
            let key = keys.next();
            let a = store.acquire(&request(key.clone())).await;
            if a.outcome != AcquireOutcome::Acquired {
                return false;
            }
            let Some(owner) = a.owner else { return false };
            let c = store
                .complete(&CompleteRequest {
                    key,
                    owner,
                    state: TerminalState::Done,
                    result: result(),
                    trace_id: String::new(),
                })
                .await;
            c.outcome == Ack::Ok
        }
    })
    .await
}

/// The same, through the HTTP API on loopback with keep-alive clients.
async fn http_case(name: &str, args: &Args, store: Arc<Store>, keys: Arc<Keys>) -> Option<Measured> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.ok()?;
    let addr = listener.local_addr().ok()?;
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let server = tokio::spawn(async move {
        let _ = axum::serve(
            listener,
            idemd::api::router(store, idemd::auth::Tokens::new(&[BENCH_TOKEN.to_string()]).unwrap_or_default()),
        )
        .await;
    });
    // The API as it runs in production: with a token on every call.
    let mut auth = reqwest::header::HeaderMap::new();
    auth.insert(reqwest::header::AUTHORIZATION, format!("Bearer {BENCH_TOKEN}").parse().ok()?);
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(args.concurrency)
        .tcp_nodelay(true)
        .default_headers(auth)
        .build()
        .ok()?;
    let base = format!("http://{addr}");
    let m = run(name, args, move || {
        let (client, keys, base) = (client.clone(), keys.clone(), base.clone());
        async move {
            let key = keys.next();
            let Ok(r) = client.post(format!("{base}/v1/acquire")).json(&request(key.clone())).send().await else {
                return false;
            };
            let Ok(a) = r.json::<idem_core::protocol::AcquireResponse>().await else { return false };
            let Some(owner) = a.owner else { return false };
            let body =
                CompleteRequest { key, owner, state: TerminalState::Done, result: result(), trace_id: String::new() };
            match client.post(format!("{base}/v1/complete")).json(&body).send().await {
                Ok(r) => r.status().is_success(),
                Err(_) => false,
            }
        }
    })
    .await;
    server.abort();
    Some(m)
}

async fn cleanup(url: &str, prefix: &str) {
    sqlx::any::install_default_drivers();
    if let Ok(pool) = sqlx::any::AnyPoolOptions::new().max_connections(1).connect(url).await {
        for table in ["idem_record", "idem_audit"] {
            let _ = sqlx::query(&format!("DELETE FROM {table} WHERE idem_key LIKE '{prefix}%'")).execute(&pool).await;
        }
        pool.close().await;
    }
}

fn main() {
    let args = Args::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idem-bench: {e}");
            std::process::exit(1);
        }
    };
    rt.block_on(bench(args));
}

async fn bench(args: Args) {
    let wants = |name: &str| args.only.as_deref().is_none_or(|o| name.contains(o));
    let keys = Arc::new(Keys::new());
    let tmp = std::env::temp_dir().join(format!("idem-bench-{}", std::process::id()));
    let sqlite_url = format!("sqlite://{}/bench.db?mode=rwc", tmp.display());
    eprintln!(
        "idem-bench: {} s per case, {} concurrent workers, key prefix {}",
        args.seconds, args.concurrency, keys.prefix
    );

    let cases: [(&str, &str, &String, bool); 7] = [
        ("idemd redis+postgres", "postgres", &args.postgres_url, true),
        ("idemd redis+mariadb", "mariadb", &args.mysql_url, true),
        ("idemd sql-only postgres", "postgres", &args.postgres_url, false),
        ("idemd sql-only mariadb", "mariadb", &args.mysql_url, false),
        ("idemd sqlite (sql-only)", "sqlite", &sqlite_url, false),
        ("idemd redis+sqlite", "sqlite", &sqlite_url, true),
        (HTTP_CASE, "postgres", &args.postgres_url, true),
    ];
    let selected: Vec<_> = cases.iter().filter(|c| wants(c.0)).collect();

    // Only the baselines the selected cases are compared with.
    let raw_redis = if selected.iter().any(|c| c.3) { raw_redis(&args, keys.clone()).await } else { None };
    let mut raw_sql_rates: Vec<(&str, Option<Measured>)> = Vec::new();
    for (label, url) in [("postgres", &args.postgres_url), ("mariadb", &args.mysql_url), ("sqlite", &sqlite_url)] {
        let m =
            if selected.iter().any(|c| c.1 == label) { raw_sql(label, url, &args, keys.clone()).await } else { None };
        raw_sql_rates.push((label, m));
    }

    let mut rows: Vec<(Measured, Option<f64>, Option<f64>)> = Vec::new();
    let raw_of = |label: &str, rates: &[(&str, Option<Measured>)]| {
        rates.iter().find(|(l, _)| *l == label).and_then(|(_, m)| m.as_ref().map(|m| m.pairs_per_s))
    };
    for &&(name, label, url, redis) in &selected {
        let Some(raw) = raw_of(label, &raw_sql_rates) else { continue };
        if redis && raw_redis.is_none() {
            continue;
        }
        let Some(store) = open_store(&args, url, redis).await else {
            eprintln!("SKIPPED {name}: cannot open the store");
            continue;
        };
        let m = if name == HTTP_CASE {
            match http_case(name, &args, store, keys.clone()).await {
                Some(m) => m,
                None => continue,
            }
        } else {
            store_case(name, &args, store, keys.clone()).await
        };
        let vs_redis = if redis { raw_redis.as_ref().map(|r| m.pairs_per_s / r.pairs_per_s) } else { None };
        let vs_sql = Some(m.pairs_per_s / raw);
        rows.push((m, vs_sql, vs_redis));
    }
    println!();
    println!(
        "{:<34} {:>11} {:>9} {:>9} {:>7} {:>11} {:>13}",
        "case", "pairs/s", "p50 ms", "p99 ms", "errors", "vs raw SQL", "vs raw Redis"
    );
    println!("{}", "-".repeat(100));
    let fmt_ratio = |r: Option<f64>| r.map(|r| format!("{r:.2}x")).unwrap_or_else(|| "-".into());
    let print = |m: &Measured, sql: Option<f64>, redis: Option<f64>| {
        println!(
            "{:<34} {:>11.0} {:>9.2} {:>9.2} {:>7} {:>11} {:>13}",
            m.name,
            m.pairs_per_s,
            m.p50_ms,
            m.p99_ms,
            m.errors,
            fmt_ratio(sql),
            fmt_ratio(redis)
        )
    };
    if let Some(r) = &raw_redis {
        print(r, None, Some(1.0));
    }
    for (_, m) in &raw_sql_rates {
        if let Some(m) = m {
            print(m, Some(1.0), None);
        }
    }
    for (m, sql, redis) in &rows {
        print(m, *sql, *redis);
    }
    println!();
    println!("vs raw SQL: idemd pairs/s / raw insert+update pairs/s on the same database (DESIGN §9 goal for a fresh confirm: >= 0.5x)");
    println!("vs raw Redis: idemd pairs/s / raw EVAL acquire.lua+complete.lua pairs/s on the same Redis");

    for url in [&args.postgres_url, &args.mysql_url] {
        cleanup(url, &keys.prefix).await;
    }
    let _ = std::fs::remove_dir_all(&tmp);
}
