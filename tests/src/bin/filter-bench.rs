//! filter-bench: DESIGN §9's performance budget, measured as ratios in ONE run.
//!
//! Not a test and never an assertion: the numbers depend on the machine and on
//! what else runs on it; the ratios against plain Envoy (or the raw database)
//! measured in the same run are what to read. `make bench` runs it:
//!
//! ```text
//! cargo build --release -p idem-demo -p idemd
//! IDEM_E2E_PROFILE=release cargo run --release -p idem-e2e --bin filter-bench -- [--seconds 2] [--reps 3] [--conns 16]
//! ```
//!
//! One Envoy (`--concurrency 1`) runs envoy/bench.yaml: listener `agents` with the
//! wasm filter and listener `plain` without it, same routes, the demo as upstream.
//! Cases run one at a time from a small hand-rolled HTTP/1.1 keep-alive client
//! (one thread, `--conns` connections). The sides of a case (baseline, filter, ...)
//! are interleaved `--reps` times in an order rotated per rep, and the median of the
//! per-rep ratios is reported, next to Envoy's own CPU per request (from /proc).
//! The duplicate and fresh confirms run on idemd with Redis + Postgres and on SQLite
//! alone; a fresh confirm is compared with the raw single-row commit rate of the same
//! database, measured in the same run with idemd's pool size. An unreachable backend
//! is skipped loudly. Rows written to the shared Postgres/Redis are removed at the end.

use base64::Engine as _;
use idem_e2e::{
    backends, bench_plain_listener, free_port, repo_root, start_demo, start_envoy_with, start_sidecar, transfer,
    wait_ready, wasm, BoxError, DemoOpts, Ports, Proc, SidecarOpts, SUBJECT,
};
use serde_json::Value;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// idemd's default SQL pool (`--sql-max-connections`); the raw baseline uses the same.
const IDEMD_SQL_POOL: u32 = 16;
/// Bounds the fingerprints minted for one fresh-confirm repetition.
const MAX_MINT: usize = 60_000;
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
struct Opts {
    seconds: f64,
    reps: usize,
    conns: usize,
    warmup: f64,
}

fn parse_args() -> Result<Opts, BoxError> {
    let mut o = Opts { seconds: 2.0, reps: 3, conns: 16, warmup: 0.5 };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--seconds" => o.seconds = val()?.parse()?,
            "--reps" => o.reps = val()?.parse()?,
            "--conns" => o.conns = val()?.parse()?,
            "--warmup" => o.warmup = val()?.parse()?,
            "-h" | "--help" => {
                println!("filter-bench [--seconds 2] [--reps 3] [--conns 16] [--warmup 0.5]");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other} (see --help)").into()),
        }
    }
    if o.reps == 0 || o.conns == 0 || o.seconds <= 0.0 {
        return Err("--reps, --conns and --seconds must be positive".into());
    }
    Ok(o)
}

// ---- a minimal HTTP/1.1 keep-alive client ----------------------------------
//
// Hand-rolled so the load generator costs little CPU next to Envoy on a 2-core
// machine: requests are pre-serialized, responses are framed (content-length
// or chunked) and their body kept for the few checks that need it.

fn request(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: bench\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() {
        head.push_str(&format!("content-type: application/json\r\ncontent-length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    out.extend_from_slice(body);
    out
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn bad_data(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_owned())
}

struct Conn {
    port: u16,
    stream: Option<TcpStream>,
    buf: Vec<u8>,
    body: Vec<u8>,
}

impl Conn {
    fn new(port: u16) -> Conn {
        Conn { port, stream: None, buf: Vec::with_capacity(16 * 1024), body: Vec::with_capacity(4096) }
    }

    /// Send one request and read one response; the body is in `self.body`.
    async fn exchange(&mut self, req: &[u8]) -> io::Result<u16> {
        let r = match tokio::time::timeout(EXCHANGE_TIMEOUT, self.exchange_inner(req)).await {
            Ok(r) => r,
            Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, "no answer in time")),
        };
        if r.is_err() {
            self.stream = None;
        }
        r
    }

    async fn exchange_inner(&mut self, req: &[u8]) -> io::Result<u16> {
        if self.stream.is_none() {
            let s = TcpStream::connect(("127.0.0.1", self.port)).await?;
            s.set_nodelay(true)?;
            self.stream = Some(s);
        }
        let Some(stream) = self.stream.as_mut() else { return Err(bad_data("no connection")) };
        stream.write_all(req).await?;
        let (status, close) = read_response(stream, &mut self.buf, &mut self.body).await?;
        if close {
            self.stream = None;
        }
        Ok(status)
    }
}

async fn read_more(stream: &mut TcpStream, buf: &mut Vec<u8>) -> io::Result<()> {
    buf.reserve(8192);
    if stream.read_buf(buf).await? == 0 {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed mid-response"));
    }
    Ok(())
}

/// One response: (status, connection closes after it).
async fn read_response(stream: &mut TcpStream, buf: &mut Vec<u8>, body: &mut Vec<u8>) -> io::Result<(u16, bool)> {
    buf.clear();
    body.clear();
    let head_end = loop {
        if let Some(i) = find(buf, b"\r\n\r\n") {
            break i + 4;
        }
        read_more(stream, buf).await?;
    };
    let head = std::str::from_utf8(buf.get(..head_end).unwrap_or_default()).map_err(|_| bad_data("head not UTF-8"))?;
    let status: u16 =
        head.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| bad_data("no status in the response"))?;
    let (mut length, mut chunked, mut close) = (None, false, false);
    for line in head.split("\r\n").skip(1) {
        let Some((k, v)) = line.split_once(':') else { continue };
        let (k, v) = (k.trim(), v.trim());
        if k.eq_ignore_ascii_case("content-length") {
            length = v.parse::<usize>().ok();
        } else if k.eq_ignore_ascii_case("transfer-encoding") {
            chunked = v.to_ascii_lowercase().contains("chunked");
        } else if k.eq_ignore_ascii_case("connection") {
            close = v.eq_ignore_ascii_case("close");
        }
    }
    if chunked {
        let mut pos = head_end;
        loop {
            let line_end = loop {
                if let Some(i) = buf.get(pos..).and_then(|b| find(b, b"\r\n")) {
                    break pos + i;
                }
                read_more(stream, buf).await?;
            };
            let line = std::str::from_utf8(buf.get(pos..line_end).unwrap_or_default()).unwrap_or_default();
            let size = usize::from_str_radix(line.split(';').next().unwrap_or_default().trim(), 16)
                .map_err(|_| bad_data("bad chunk size"))?;
            let data = line_end + 2;
            if size == 0 {
                // No trailers expected: the last chunk ends with an empty line.
                while buf.len() < data + 2 {
                    read_more(stream, buf).await?;
                }
                break;
            }
            while buf.len() < data + size + 2 {
                read_more(stream, buf).await?;
            }
            body.extend_from_slice(buf.get(data..data + size).unwrap_or_default());
            pos = data + size + 2;
        }
    } else if let Some(n) = length {
        while buf.len() < head_end + n {
            read_more(stream, buf).await?;
        }
        body.extend_from_slice(buf.get(head_end..head_end + n).unwrap_or_default());
    } else if !(status < 200 || status == 204 || status == 304) {
        // Close-delimited body.
        loop {
            match read_more(stream, buf).await {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
                Err(e) => return Err(e),
            }
        }
        body.extend_from_slice(buf.get(head_end..).unwrap_or_default());
        close = true;
    }
    Ok((status, close))
}

// ---- load ------------------------------------------------------------------

#[derive(Clone)]
enum Requests {
    /// The same request, over and over.
    Same(Arc<Vec<u8>>),
    /// Each request once (fresh confirms); the run ends early when they run out.
    EachOnce(Arc<Vec<Vec<u8>>>, Arc<AtomicUsize>),
}

#[derive(Default)]
struct Measured {
    ok: u64,
    unexpected: u64,
    errors: u64,
    secs: f64,
    exhausted: bool,
    lat: Vec<Duration>,
    sample: Option<String>,
}

impl Measured {
    fn rate(&self) -> f64 {
        if self.secs > 0.0 {
            self.ok as f64 / self.secs
        } else {
            0.0
        }
    }

    fn p50_ms(&mut self) -> f64 {
        if self.lat.is_empty() {
            return 0.0;
        }
        self.lat.sort_unstable();
        self.lat.get(self.lat.len() / 2).map(|d| d.as_secs_f64() * 1000.0).unwrap_or(0.0)
    }

    fn merge(&mut self, o: Measured) {
        self.ok += o.ok;
        self.unexpected += o.unexpected;
        self.errors += o.errors;
        self.exhausted |= o.exhausted;
        self.lat.extend(o.lat);
        if self.sample.is_none() {
            self.sample = o.sample;
        }
    }

    fn problems(&self) -> String {
        let mut s = String::new();
        if self.unexpected > 0 || self.errors > 0 {
            s = format!("  [{} unexpected, {} errors", self.unexpected, self.errors);
            if let Some(sample) = &self.sample {
                s.push_str(&format!("; e.g. {sample}"));
            }
            s.push(']');
        }
        if self.exhausted {
            s.push_str("  [ran out of fingerprints before the deadline]");
        }
        s
    }
}

async fn http_worker(port: u16, reqs: Requests, expect: u16, deadline: Instant) -> Measured {
    let mut conn = Conn::new(port);
    let mut m = Measured { lat: Vec::with_capacity(1 << 14), ..Default::default() };
    while Instant::now() < deadline {
        let req = match &reqs {
            Requests::Same(r) => r.as_slice(),
            Requests::EachOnce(all, next) => match all.get(next.fetch_add(1, Ordering::Relaxed)) {
                Some(r) => r.as_slice(),
                None => {
                    m.exhausted = true;
                    break;
                }
            },
        };
        let t = Instant::now();
        match conn.exchange(req).await {
            Ok(s) if s == expect => {
                m.ok += 1;
                m.lat.push(t.elapsed());
            }
            Ok(s) => {
                m.unexpected += 1;
                if m.sample.is_none() {
                    let body: String = String::from_utf8_lossy(&conn.body).chars().take(240).collect();
                    m.sample = Some(format!("HTTP {s} {body}"));
                }
            }
            Err(e) => {
                m.errors += 1;
                if m.sample.is_none() {
                    m.sample = Some(format!("{e}"));
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    m
}

/// `conns` keep-alive connections send `reqs` to `port` for `secs`.
async fn drive(port: u16, reqs: &Requests, expect: u16, conns: usize, secs: f64) -> Measured {
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(secs);
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..conns {
        set.spawn(http_worker(port, reqs.clone(), expect, deadline));
    }
    let mut total = Measured::default();
    while let Some(r) = set.join_next().await {
        match r {
            Ok(m) => total.merge(m),
            Err(e) => total.sample = Some(format!("worker failed: {e}")),
        }
    }
    total.secs = start.elapsed().as_secs_f64();
    total
}

/// One exchange on a fresh connection, for the checks before the timed phases.
async fn once(port: u16, req: &[u8]) -> Result<(u16, Value, String), BoxError> {
    let mut c = Conn::new(port);
    let status = c.exchange(req).await?;
    let text = String::from_utf8_lossy(&c.body).into_owned();
    Ok((status, serde_json::from_slice(&c.body).unwrap_or(Value::Null), text))
}

/// Preview through the filter `n` times and keep the fingerprints (untimed).
async fn mint(port: u16, n: usize, conns: usize) -> Result<Vec<String>, BoxError> {
    let req = Arc::new(preview_request("/v1/transfers/preview"));
    let issued = Arc::new(AtomicUsize::new(0));
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..conns {
        let (req, issued) = (req.clone(), issued.clone());
        set.spawn(async move {
            let mut conn = Conn::new(port);
            let mut out = Vec::new();
            while issued.fetch_add(1, Ordering::Relaxed) < n {
                let status = conn.exchange(&req).await.map_err(|e| e.to_string())?;
                let v: Value = serde_json::from_slice(&conn.body).unwrap_or(Value::Null);
                match (status, v["fingerprint"].as_str()) {
                    (200, Some(fp)) => out.push(fp.to_owned()),
                    _ => return Err(format!("preview answered {status}: {}", String::from_utf8_lossy(&conn.body))),
                }
            }
            Ok::<_, String>(out)
        });
    }
    let mut all = Vec::with_capacity(n);
    while let Some(r) = set.join_next().await {
        all.extend(r??);
    }
    Ok(all)
}

fn body() -> Vec<u8> {
    serde_json::to_vec(&transfer(Value::String("100.00".into()), "bench")).unwrap_or_default()
}

fn preview_request(path: &str) -> Vec<u8> {
    request("POST", path, &[("x-agent-subject", SUBJECT)], &body())
}

fn confirm_request(fingerprint: &str, idempotency_key: Option<&str>) -> Vec<u8> {
    let mut h = vec![("x-agent-subject", SUBJECT), ("agent-fingerprint", fingerprint)];
    if let Some(k) = idempotency_key {
        h.push(("idempotency-key", k));
    }
    request("POST", "/v1/transfers", &h, &body())
}

fn nonce_of(fingerprint: &str) -> Option<String> {
    let payload = fingerprint.split('.').next()?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(payload).ok()?;
    let claims: Value = serde_json::from_slice(&bytes).ok()?;
    claims["n"].as_str().map(str::to_owned)
}

// ---- the raw single-row commit baseline ------------------------------------

enum RawDb {
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
    async fn postgres(url: &str) -> Result<RawDb, BoxError> {
        let pool = sqlx::postgres::PgPoolOptions::new().max_connections(IDEMD_SQL_POOL).connect(url).await?;
        let table = format!("idem_bench_raw_{}", std::process::id());
        sqlx::raw_sql(&format!("DROP TABLE IF EXISTS {table}")).execute(&pool).await?;
        sqlx::raw_sql(&bench_table_ddl("postgres", &table)?).execute(&pool).await?;
        Ok(RawDb::Pg { pool, table })
    }

    /// The same file idemd uses, opened the way idemd opens it (WAL, busy timeout, pool size).
    async fn sqlite(url: &str) -> Result<RawDb, BoxError> {
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

    async fn drop_table(&self) {
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
    async fn drive(&self, conns: usize, secs: f64, run: &str) -> Measured {
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

    /// The statement idemd issues for a fresh acquire (sidecar/src/store/sql.rs).
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

// ---- the stack ---------------------------------------------------------------

struct BenchStack {
    label: &'static str,
    _dir: tempfile::TempDir,
    agents: u16,
    plain: u16,
    admin: u16,
    sql_url: String,
    redis_url: Option<String>,
    demo: Proc,
    sidecar: Proc,
    envoy: Proc,
    /// Nonces this run wrote into shared stores, removed at the end.
    nonces: Vec<String>,
}

async fn start_stack(
    label: &'static str,
    redis_url: Option<String>,
    sql_url: Option<String>,
) -> Result<BenchStack, BoxError> {
    let dir = tempfile::tempdir()?;
    let ports = Ports { listener: free_port()?, admin: free_port()?, demo: free_port()?, sidecar: free_port()? };
    let plain = free_port()?;
    let sql_url = sql_url.unwrap_or_else(|| format!("sqlite://{}/idem.db?mode=rwc", dir.path().display()));
    let mut demo = start_demo(&DemoOpts::default(), ports.demo, dir.path())?;
    wait_ready(&format!("http://127.0.0.1:{}/healthz", ports.demo), &mut demo).await?;
    let sopts = SidecarOpts { redis_url: redis_url.clone(), database_url: Some(sql_url.clone()), extra_args: vec![] };
    let mut sidecar = start_sidecar(&sopts, ports.sidecar, dir.path())?;
    wait_ready(&format!("http://127.0.0.1:{}/healthz", ports.sidecar), &mut sidecar).await?;
    let mut envoy = start_envoy_with("bench.yaml", &ports, &[bench_plain_listener(plain)], dir.path())?;
    wait_ready(&format!("http://127.0.0.1:{}/ready", ports.admin), &mut envoy).await?;
    Ok(BenchStack {
        label,
        _dir: dir,
        agents: ports.listener,
        plain,
        admin: ports.admin,
        sql_url,
        redis_url,
        demo,
        sidecar,
        envoy,
        nonces: Vec::new(),
    })
}

impl BenchStack {
    /// Upstream requests and connections per cluster (a pool that reconnects per request costs a lot).
    async fn upstream_summary(&self) -> String {
        let url = format!(
            "http://127.0.0.1:{}/stats?filter=^cluster%5C.(demo|idem_sidecar)%5C.upstream_(rq|cx)_total$",
            self.admin
        );
        let text = match reqwest::get(url).await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => return String::new(),
        };
        let get = |name: &str| {
            text.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(": "))).unwrap_or("?").to_owned()
        };
        let mut out = Vec::new();
        for c in ["demo", "idem_sidecar"] {
            let (rq, cx) =
                (get(&format!("cluster.{c}.upstream_rq_total")), get(&format!("cluster.{c}.upstream_cx_total")));
            out.push(format!("{c} {rq} requests over {cx} connections"));
        }
        format!("upstreams of the {} stack: {}", self.label, out.join(", "))
    }

    fn pids(&self) -> Vec<u32> {
        [self.demo.pid(), self.sidecar.pid(), self.envoy.pid()].into_iter().flatten().collect()
    }

    /// Remove this run's rows from the shared Postgres and keys from Redis.
    async fn cleanup(&mut self) {
        if self.nonces.is_empty() || !self.sql_url.starts_with("postgres") {
            return;
        }
        if let Ok(pool) = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&self.sql_url).await {
            for chunk in self.nonces.chunks(5000) {
                let _ = sqlx::query("DELETE FROM idem_record WHERE idem_key::text = ANY($1)")
                    .bind(chunk.to_vec())
                    .execute(&pool)
                    .await;
            }
            pool.close().await;
        }
        if let Some(url) = &self.redis_url {
            if let Ok(client) = redis::Client::open(url.as_str()) {
                if let Ok(mut con) = client.get_multiplexed_async_connection().await {
                    for chunk in self.nonces.chunks(1000) {
                        let keys: Vec<String> = chunk.iter().map(|n| format!("idem:{{{n}}}")).collect();
                        let _: Result<i64, _> = redis::cmd("DEL").arg(keys).query_async(&mut con).await;
                    }
                }
            }
        }
        self.nonces.clear();
    }
}

// ---- CPU accounting ----------------------------------------------------------

/// utime + stime of a process, in clock ticks (USER_HZ, 100/s on Linux).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit_once(')').map(|r| r.1).unwrap_or("").split_whitespace().collect();
    let at = |i: usize| fields.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    at(11) + at(12)
}

/// Busy ticks of the whole machine, and of the processes this bench drives
/// (itself, the stack, and the Postgres/Redis servers it loads).
fn cpu_sample(stack_pids: &[u32]) -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let line = stat.lines().next().unwrap_or("");
    let v: Vec<u64> = line.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal
    let busy = [0usize, 1, 2, 5, 6, 7].iter().filter_map(|&i| v.get(i)).sum();
    let mut ours = cpu_ticks(std::process::id()) + stack_pids.iter().map(|&p| cpu_ticks(p)).sum::<u64>();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let name = e.file_name();
            let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            if matches!(comm.trim(), "postgres" | "redis-server") {
                ours += cpu_ticks(pid);
            }
        }
    }
    (busy, ours)
}

/// CPU used by everything else on the machine (other builds and tests) while a stack ran.
struct Foreign {
    start: (u64, u64),
    at: Instant,
}

impl Foreign {
    fn start(stack_pids: &[u32]) -> Foreign {
        Foreign { start: cpu_sample(stack_pids), at: Instant::now() }
    }

    /// Average cores busy with foreign work.
    fn cores(&self, stack_pids: &[u32]) -> f64 {
        let (busy, ours) = cpu_sample(stack_pids);
        let foreign = busy.saturating_sub(self.start.0).saturating_sub(ours.saturating_sub(self.start.1));
        foreign as f64 / 100.0 / self.at.elapsed().as_secs_f64().max(0.001)
    }
}

// ---- cases -------------------------------------------------------------------

struct Row {
    case: String,
    baseline: String,
    base_rate: f64,
    filter_rate: f64,
    filter_p50_ms: f64,
    /// Envoy CPU per request (µs): baseline side (None: not through Envoy) and filter side.
    base_envoy_us: Option<f64>,
    filter_envoy_us: Option<f64>,
    ratios: Vec<f64>,
    budget: Option<f64>,
    notes: String,
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v.get(n / 2).copied().unwrap_or(0.0),
        n => (v.get(n / 2 - 1).copied().unwrap_or(0.0) + v.get(n / 2).copied().unwrap_or(0.0)) / 2.0,
    }
}

struct Side {
    label: &'static str,
    port: u16,
    reqs: Requests,
    expect: u16,
}

/// What one variant is compared as: its row's name, baseline text and budget.
struct Variant<'a> {
    side: &'a Side,
    case: String,
    baseline: &'static str,
    budget: Option<f64>,
}

/// One timed run of a side: (rate, p50 ms, Envoy µs per request, problems).
async fn timed(side: &Side, envoy: Option<u32>, o: &Opts) -> (f64, f64, f64, String) {
    let before = envoy.map(cpu_ticks).unwrap_or(0);
    let mut m = drive(side.port, &side.reqs, side.expect, o.conns, o.seconds).await;
    let after = envoy.map(cpu_ticks).unwrap_or(0);
    let envoy_us = after.saturating_sub(before) as f64 * 10_000.0 / m.ok.max(1) as f64;
    (m.rate(), m.p50_ms(), envoy_us, m.problems())
}

/// The baseline against each variant, all interleaved: every rep runs each side
/// once, in an order rotated per rep, so drift hits all sides alike.
async fn compare(title: &str, base: &Side, variants: &[Variant<'_>], envoy: Option<u32>, o: &Opts) -> Vec<Row> {
    eprintln!("\n== {title}");
    let sides: Vec<&Side> = std::iter::once(base).chain(variants.iter().map(|v| v.side)).collect();
    for s in &sides {
        let m = drive(s.port, &s.reqs, s.expect, o.conns, o.warmup).await;
        eprintln!("   warm-up {:<28} {:>9.0} req/s{}", s.label, m.rate(), m.problems());
    }
    let n = sides.len();
    let mut rate = vec![Vec::new(); n];
    let mut p50 = vec![Vec::new(); n];
    let mut cpu = vec![Vec::new(); n];
    let mut notes = vec![String::new(); n];
    for rep in 0..o.reps {
        for k in 0..n {
            let i = (k + rep) % n;
            let Some(s) = sides.get(i) else { continue };
            let (r, p, us, problems) = timed(s, envoy, o).await;
            eprintln!(
                "   rep {} {:<28} {:>9.0} req/s  p50 {:>6.2} ms  envoy {:>4.0} us/req{problems}",
                rep + 1,
                s.label,
                r,
                p,
                us
            );
            if let Some(note) = notes.get_mut(i).filter(|n| n.is_empty() && !problems.is_empty()) {
                *note = format!("{}:{problems}", s.label);
            }
            rate[i].push(r);
            p50[i].push(p);
            cpu[i].push(us);
        }
    }
    let base_notes = notes.first().cloned().unwrap_or_default();
    variants
        .iter()
        .enumerate()
        .map(|(j, v)| {
            let i = j + 1;
            let ratios = rate[i].iter().zip(&rate[0]).map(|(f, b)| if *b > 0.0 { f / b } else { 0.0 }).collect();
            let mut note = notes.get(i).cloned().unwrap_or_default();
            if note.is_empty() {
                note.clone_from(&base_notes);
            }
            Row {
                case: v.case.clone(),
                baseline: v.baseline.to_owned(),
                base_rate: median(&rate[0]),
                filter_rate: median(&rate[i]),
                filter_p50_ms: median(&p50[i]),
                base_envoy_us: Some(median(&cpu[0])),
                filter_envoy_us: Some(median(&cpu[i])),
                ratios,
                budget: v.budget,
                notes: note,
            }
        })
        .collect()
}

async fn check(
    what: &str,
    port: u16,
    req: &[u8],
    status: u16,
    must: &[&str],
    must_not: &[&str],
) -> Result<(), BoxError> {
    let (s, _, text) = once(port, req).await?;
    let ok = s == status && must.iter().all(|m| text.contains(m)) && !must_not.iter().any(|m| text.contains(m));
    if !ok {
        return Err(format!("bench setup check failed: {what}: HTTP {s} {text}").into());
    }
    Ok(())
}

async fn proxy_cases(st: &BenchStack, o: &Opts, rows: &mut Vec<Row>) -> Result<(), BoxError> {
    let envoy = st.envoy.pid();
    // Unannotated route: the same request on both listeners; plus the same endpoint on a
    // route that turns the filter off (FilterConfig disabled), which Envoy then never calls.
    let unannotated = Arc::new(preview_request("/plain/v1/transfers/preview"));
    let opted_out = Arc::new(preview_request("/plain-optout/v1/transfers/preview"));
    for (what, port, req) in [
        ("unannotated via filter", st.agents, &unannotated),
        ("unannotated via plain", st.plain, &unannotated),
        ("opted-out via filter", st.agents, &opted_out),
    ] {
        check(what, port, req, 200, &["quote_id"], &["fingerprint"]).await?;
    }
    let base = Side { label: "plain Envoy", port: st.plain, reqs: Requests::Same(unannotated.clone()), expect: 200 };
    let filt = Side { label: "filter, unannotated", port: st.agents, reqs: Requests::Same(unannotated), expect: 200 };
    let off = Side { label: "filter, route opted out", port: st.agents, reqs: Requests::Same(opted_out), expect: 200 };
    let variants = [
        Variant {
            side: &filt,
            case: "unannotated route".into(),
            baseline: "plain Envoy, same request",
            budget: Some(0.97),
        },
        Variant {
            side: &off,
            case: "  same, filter disabled on the route".into(),
            baseline: "plain Envoy, same request",
            budget: Some(0.97),
        },
    ];
    rows.extend(compare("unannotated route", &base, &variants, envoy, o).await);

    // Preview: mints on the filter listener, forwards on the plain one.
    let preview = Arc::new(preview_request("/v1/transfers/preview"));
    check("preview via filter", st.agents, &preview, 200, &["quote_id", "\"fingerprint\""], &[]).await?;
    check("preview via plain", st.plain, &preview, 200, &["quote_id"], &["fingerprint"]).await?;
    let base = Side { label: "plain Envoy", port: st.plain, reqs: Requests::Same(preview.clone()), expect: 200 };
    let filt = Side { label: "filter, preview (mint)", port: st.agents, reqs: Requests::Same(preview), expect: 200 };
    let variants =
        [Variant { side: &filt, case: "preview".into(), baseline: "plain Envoy, same preview", budget: Some(0.85) }];
    rows.extend(compare("preview", &base, &variants, envoy, o).await);
    Ok(())
}

/// A DONE fingerprint replayed through the filter against plain Envoy
/// forwarding the same confirm with a fixed Idempotency-Key (the demo's dedup answers).
async fn duplicate_case(st: &mut BenchStack, o: &Opts, rows: &mut Vec<Row>) -> Result<(), BoxError> {
    let fp = mint(st.agents, 1, 1).await?.pop().ok_or("no fingerprint")?;
    st.nonces.extend(nonce_of(&fp));
    let confirm = Arc::new(confirm_request(&fp, None));
    check("first confirm via filter", st.agents, &confirm, 201, &["\"executed\""], &[]).await?;
    check("duplicate via filter", st.agents, &confirm, 201, &["already_completed"], &[]).await?;
    let key = format!("bench{:027x}", std::process::id());
    let plain_confirm = Arc::new(confirm_request(&fp, Some(&key)));
    check("first confirm via plain", st.plain, &plain_confirm, 201, &["\"executed\""], &[]).await?;
    check("duplicate via plain", st.plain, &plain_confirm, 201, &["\"executed\"", key.as_str()], &[]).await?;
    let base =
        Side { label: "plain Envoy -> demo dedup", port: st.plain, reqs: Requests::Same(plain_confirm), expect: 201 };
    let filt = Side { label: "filter replay", port: st.agents, reqs: Requests::Same(confirm), expect: 201 };
    let case = format!("duplicate confirm [{}]", st.label);
    let variants = [Variant {
        side: &filt,
        case: case.clone(),
        baseline: "plain Envoy, same confirm, demo dedup",
        budget: Some(0.60),
    }];
    rows.extend(compare(&case, &base, &variants, st.envoy.pid(), o).await);
    Ok(())
}

/// Fresh confirms (fingerprints minted before each timed phase) against the raw
/// single-row commit rate of idemd's database, interleaved.
async fn fresh_case(
    st: &mut BenchStack,
    raw: &RawDb,
    dbname: &str,
    o: &Opts,
    rows: &mut Vec<Row>,
) -> Result<(), BoxError> {
    let case = format!("fresh confirm [{}]", st.label);
    eprintln!("\n== {case}");
    let envoy = st.envoy.pid();
    let run_tag = format!("{:08x}", std::process::id());
    let w = raw.drive(o.conns, o.warmup, &format!("{run_tag}w")).await;
    eprintln!("   warm-up raw {dbname} commit {:>20.0} commits/s{}", w.rate(), w.problems());
    let fps = mint(st.agents, 400, o.conns).await?;
    st.nonces.extend(fps.iter().filter_map(|f| nonce_of(f)));
    let reqs = Requests::EachOnce(Arc::new(fps.iter().map(|f| confirm_request(f, None)).collect()), Arc::default());
    let m = drive(st.agents, &reqs, 201, o.conns, o.warmup.max(5.0)).await;
    eprintln!("   warm-up fresh confirm ({} of them) {:>9.0} req/s{}", fps.len(), m.rate(), m.problems());
    if m.ok == 0 {
        return Err(format!("fresh confirms fail on {}:{}", st.label, m.problems()).into());
    }
    // Enough fingerprints for the fastest rate seen so far, with headroom.
    let mut fastest = m.rate();
    let (mut rr, mut rf, mut ratios, mut p50s, mut cpu, mut notes) =
        (vec![], vec![], vec![], vec![], vec![], String::new());
    for rep in 0..o.reps {
        let mut rates = [0.0f64; 2];
        for step in if rep % 2 == 0 { [0, 1] } else { [1, 0] } {
            if step == 0 {
                let m = raw.drive(o.conns, o.seconds, &format!("{run_tag}{rep:x}")).await;
                eprintln!("   rep {} raw {dbname} commit {:>22.0} commits/s{}", rep + 1, m.rate(), m.problems());
                rates[0] = m.rate();
            } else {
                let n = ((fastest * o.seconds * 1.5) as usize + 300).min(MAX_MINT);
                let t = Instant::now();
                let fps = mint(st.agents, n, o.conns).await?;
                let minted_in = t.elapsed().as_secs_f64();
                st.nonces.extend(fps.iter().filter_map(|f| nonce_of(f)));
                let all = Arc::new(fps.iter().map(|f| confirm_request(f, None)).collect::<Vec<_>>());
                let side = Side {
                    label: "fresh",
                    port: st.agents,
                    reqs: Requests::EachOnce(all, Arc::default()),
                    expect: 201,
                };
                let (r, p50, us, p) = timed(&side, envoy, o).await;
                eprintln!(
                    "   rep {} fresh confirm {:>25.0} req/s  p50 {p50:>6.2} ms  envoy {us:>4.0} us/req  (minted {n} in {minted_in:.1} s){p}",
                    rep + 1,
                    r,
                );
                if !p.is_empty() && notes.is_empty() {
                    notes = p;
                }
                rates[1] = r;
                p50s.push(p50);
                cpu.push(us);
                fastest = fastest.max(r);
            }
        }
        rr.push(rates[0]);
        rf.push(rates[1]);
        ratios.push(if rates[0] > 0.0 { rates[1] / rates[0] } else { 0.0 });
    }
    rows.push(Row {
        case,
        baseline: format!("raw single-row commit, {dbname}"),
        base_rate: median(&rr),
        filter_rate: median(&rf),
        filter_p50_ms: median(&p50s),
        base_envoy_us: None,
        filter_envoy_us: Some(median(&cpu)),
        ratios,
        budget: Some(0.5),
        notes,
    });
    Ok(())
}

/// What Postgres says about idemd's table: the fresh-confirm rate depends on it.
async fn pg_diagnostics(url: &str) -> Vec<String> {
    let mut out = Vec::new();
    let Ok(pool) = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(url).await else { return out };
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
            "postgres: autovacuum={}, idem_record has {live} live / {dead} dead tuples; complete's UPDATE plan uses {}",
            autovacuum.as_deref().unwrap_or("?"),
            index.as_deref().unwrap_or("?")
        ));
    }
    pool.close().await;
    out
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

fn print_table(rows: &[Row], o: &Opts, wasm_bytes: u64, context: &[String]) {
    println!();
    println!(
        "DESIGN §9 performance budget: {} s per case x {} interleaved reps (median), {} keep-alive connections, Envoy --concurrency 1",
        o.seconds, o.reps, o.conns
    );
    for line in context {
        println!("{line}");
    }
    println!();
    println!(
        "{:<38} {:<38} {:>9} {:>9} {:>7} {:>13} {:>7} {:>15} {:>7} {:>4}",
        "case", "baseline", "base/s", "filter/s", "p50 ms", "envoy us/req", "ratio", "reps", "budget", "met"
    );
    println!("{}", "-".repeat(160));
    for r in rows {
        let ratio = median(&r.ratios);
        let reps = r.ratios.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join("/");
        let cpu = match (r.base_envoy_us, r.filter_envoy_us) {
            (Some(b), Some(f)) => format!("{b:.0} -> {f:.0}"),
            (None, Some(f)) => format!("- -> {f:.0}"),
            _ => "-".into(),
        };
        let (budget, met) = match r.budget {
            Some(b) => (format!(">={b:.2}x"), if ratio >= b { "yes" } else { "NO" }),
            None => ("-".into(), ""),
        };
        println!(
            "{:<38} {:<38} {:>9.0} {:>9.0} {:>7.2} {:>13} {:>6.2}x {:>15} {:>7} {:>4}",
            r.case, r.baseline, r.base_rate, r.filter_rate, r.filter_p50_ms, cpu, ratio, reps, budget, met
        );
        if !r.notes.is_empty() {
            println!("{:<38} note: {}", "", r.notes);
        }
    }
    println!(
        "{:<38} {:<38} {:>9} {:>9} {:>7} {:>13} {:>7} {:>15} {:>7} {:>4}",
        ".wasm size",
        "hundreds of KB",
        "",
        format!("{:.0} KB", wasm_bytes as f64 / 1024.0),
        "",
        "",
        "",
        "",
        "<1 MB",
        if wasm_bytes < 1024 * 1024 { "yes" } else { "NO" }
    );
    println!();
    println!("ratio: median over the reps of (filter rate / baseline rate in the same rep); reps: each rep's ratio.");
    println!("base/s, filter/s: median rates; p50 ms: the filter side's median latency; envoy us/req: Envoy's CPU per");
    println!("request, baseline -> filter side (less sensitive to other load than the rates). Fresh-confirm baselines");
    println!(
        "are single-row INSERT commits/s into a copy of idem_record in the same database, with idemd's pool size."
    );
    println!(
        "Client, Envoy, demo, idemd and the stores share this machine's cores: foreign CPU above ~0.1 cores makes"
    );
    println!("the numbers noisy; re-run when the machine is quiet.");
}

async fn bench(o: Opts) -> Result<(), BoxError> {
    // Per-request log lines would cost the demo more than Envoy: production-like logging.
    if std::env::var_os("RUST_LOG").is_none() {
        std::env::set_var("RUST_LOG", "warn");
    }
    let wasm_bytes = std::fs::metadata(wasm()?)?.len();
    let load_start = loadavg();
    eprintln!(
        "filter-bench: load average at start {load_start}; {} s x {} reps, {} connections",
        o.seconds, o.reps, o.conns
    );
    let mut rows = Vec::new();
    let mut context = vec![format!("load average (1/5/15 min) at start: {load_start}")];
    let mut proxied = false;

    // 1) idemd on Redis + Postgres.
    let pg_up = backends::available("redis", "127.0.0.1:6379")? && backends::available("postgres", "127.0.0.1:5432")?;
    if pg_up {
        let mut st = start_stack("redis+postgres", Some(backends::redis_url()), Some(backends::postgres_url())).await?;
        let pids = st.pids();
        let foreign = Foreign::start(&pids);
        let raw = RawDb::postgres(&backends::postgres_url()).await?;
        context.extend(pg_diagnostics(&backends::postgres_url()).await);
        let r = async {
            proxy_cases(&st, &o, &mut rows).await?;
            proxied = true;
            duplicate_case(&mut st, &o, &mut rows).await?;
            fresh_case(&mut st, &raw, "postgres", &o, &mut rows).await
        }
        .await;
        context.push(format!("foreign CPU during the redis+postgres stack: {:.2} cores", foreign.cores(&pids)));
        context.push(st.upstream_summary().await);
        raw.drop_table().await;
        st.cleanup().await;
        if let Err(e) = r {
            eprintln!("envoy log:\n{}", st.envoy.log_text());
            return Err(e);
        }
    } else {
        context.push("SKIPPED BACKEND: idemd on redis+postgres (unreachable, see above)".into());
    }

    // 2) idemd on SQLite alone.
    let mut st = start_stack("sqlite-only", None, None).await?;
    let pids = st.pids();
    let foreign = Foreign::start(&pids);
    let raw = RawDb::sqlite(&st.sql_url).await?;
    let r = async {
        if !proxied {
            proxy_cases(&st, &o, &mut rows).await?;
        }
        duplicate_case(&mut st, &o, &mut rows).await?;
        fresh_case(&mut st, &raw, "sqlite", &o, &mut rows).await
    }
    .await;
    context.push(format!("foreign CPU during the sqlite-only stack: {:.2} cores", foreign.cores(&pids)));
    context.push(st.upstream_summary().await);
    raw.drop_table().await;
    if let Err(e) = r {
        eprintln!("envoy log:\n{}", st.envoy.log_text());
        return Err(e);
    }
    context.push(format!("load average at end: {}", loadavg()));
    print_table(&rows, &o, wasm_bytes, &context);
    Ok(())
}

fn main() {
    let result = parse_args().and_then(|o| {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        rt.block_on(bench(o))
    });
    if let Err(e) = result {
        eprintln!("filter-bench: {e}");
        std::process::exit(1);
    }
}
