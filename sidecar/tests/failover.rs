//! The truth never goes back in time (DESIGN §4): a replicated Postgres fails over under a
//! running idemd, in the worst window (the acquire committed on the primary, the standby not caught up).
//!
//! Real parts only: a private primary and a streaming standby made with `pg_basebackup -R`
//! (`idem_testkit::pg_server::Replicated`), the `idemd` binary on SQL alone, its HTTP API; the primary is
//! SIGKILLed, the standby promoted, and the one address idemd was given moves to it (as a Service does).
//!
//! - synchronous standby: the acquire survives, the retry is IN_FLIGHT with the first owner;
//! - asynchronous standby: idemd waits after each write until the standby has flushed it (`idemd_waits`), so
//!   the acquire survives as on a synchronous one; cut off, the standby never confirms and nothing is
//!   acknowledged (STORE_UNAVAILABLE: nothing ran);
//! - asynchronous with `--accept-async-failover-risk` (no wait): the measured cost, a second ACQUIRED with a new
//!   owner;
//! - pointed at a standby, idemd refuses to start.
//!
//! And the same for MariaDB (`idem_testkit::mariadb_server::MariaReplicated`: a private primary writing a binary
//! log and a `read_only` replica following it by GTID): semi-synchronous keeps the acquire; asynchronous, with
//! the replica cut off, is read as `async` and refuses what it cannot keep; a replica is refused at start.
//!
//! Each metric and /healthz detail says which topology idemd saw.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use idem_testkit::mariadb_server::{MariaReplicated, MariaReplication};
use idem_testkit::pg_server::{Replicated, Replication};
use idem_testkit::proc::Proc;
use serde_json::{json, Value};

const PARAM: &str = "7d865e959b2466918c9863afca942d0fb89d7c9ac0c99bafc3749504ded97730";
const SUBJECT: &str = "9f86d081884c7d659a2feaa0c55ad015";

struct Idemd {
    base: String,
    proc: Proc,
    http: reqwest::Client,
    rt: tokio::runtime::Runtime,
}

fn idemd_command(database_url: &str, extra: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_idemd"));
    for (k, _) in std::env::vars() {
        if k.starts_with("IDEM_") {
            c.env_remove(k);
        }
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("port").port();
    c.args(["serve", "--insecure-no-auth", "--no-reconcile", "--probe-interval-ms", "200", "--sql-timeout-ms", "2000"])
        .args(["--listen", &format!("127.0.0.1:{port}"), "--database-url", database_url])
        .args(extra);
    c
}

impl Idemd {
    fn start(dir: &Path, database_url: &str, extra: &[&str]) -> Idemd {
        let mut proc = Proc::spawn("idemd", &mut idemd_command(database_url, extra), dir).expect("spawn idemd");
        let deadline = Instant::now() + Duration::from_secs(30);
        let base = loop {
            let log = proc.log_text();
            if let Some(line) = log.lines().find(|l| l.starts_with("idemd listening on ")) {
                let addr = line["idemd listening on ".len()..].split(' ').next().expect("addr");
                break format!("http://{addr}");
            }
            assert!(!proc.exited(), "idemd exited:\n{log}");
            assert!(Instant::now() < deadline, "idemd did not start:\n{log}");
            std::thread::sleep(Duration::from_millis(50));
        };
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        Idemd { base, proc, http: reqwest::Client::new(), rt }
    }

    /// `POST /v1/acquire` as the filter sends it: (HTTP status, answer).
    fn acquire(&self, key: &str, upstream_ignores_keys: bool) -> (u16, Value) {
        let body = json!({
            "key": key, "param_hash": PARAM, "subject_hash": SUBJECT, "scope": "payments.transfer",
            "lease_ms": 60_000, "upstream_ignores_keys": upstream_ignores_keys,
        });
        self.rt.block_on(async {
            let r = self.http.post(format!("{}/v1/acquire", self.base)).json(&body).send().await.expect("acquire");
            (r.status().as_u16(), r.json().await.expect("json"))
        })
    }

    /// The acquire once the failover is behind idemd: its pool's connections to the dead primary fail
    /// (STORE_UNAVAILABLE: nothing ran, safe to retry) until it has reconnected through the moved address.
    fn acquire_after_failover(&self, key: &str, upstream_ignores_keys: bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (status, answer) = self.acquire(key, upstream_ignores_keys);
            if answer["outcome"] != "STORE_UNAVAILABLE" {
                assert_eq!(status, 200, "{answer}");
                return answer;
            }
            assert!(Instant::now() < deadline, "still STORE_UNAVAILABLE:\n{}", self.proc.log_text());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn get(&self, path: &str) -> (u16, String) {
        self.rt.block_on(async {
            let r = self.http.get(format!("{}{path}", self.base)).send().await.expect("get");
            (r.status().as_u16(), r.text().await.expect("text"))
        })
    }

    fn metrics(&self) -> String {
        self.get("/metrics").1
    }

    fn healthz(&self) -> Value {
        serde_json::from_str(&self.get("/healthz").1).expect("healthz json")
    }

    /// Wait until the probe has read `mode` (idem_sql_replication_info{mode} is 1).
    fn sees(&self, mode: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while metric(&self.metrics(), &format!("idem_sql_replication_info{{mode=\"{mode}\"}}")) != Some(1.0) {
            assert!(Instant::now() < deadline, "mode {mode} never read:\n{}", self.metrics());
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// After the failover, the retry of `k` is IN_FLIGHT under the owner of the first acquire (`first`): the
/// acquire survived it.
fn retry_finds_the_first_owner(idemd: &Idemd, k: &str, first: &Value) {
    let retry = idemd.acquire_after_failover(k, true);
    assert_eq!(retry["outcome"], "IN_FLIGHT", "{retry}");
    assert_eq!(retry["owner"], first["owner"], "the first owner still holds it");
}

/// One sample's value from the exposition (`name{labels}` exactly as written there).
fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

fn rows(db: &idem_testkit::pg_server::PostgresServer, key: &str) -> String {
    db.psql(&format!("SELECT count(*) FROM idem_record WHERE idem_key = '{key}'")).expect("count")
}

fn key() -> String {
    idemd::store::new_owner()
}

fn replicated(dir: &Path, mode: Replication) -> Option<Replicated> {
    Replicated::start(dir, mode).expect("replicated postgres")
}

/// An acquire (upstream ignores keys) while the standby's WAL receiver is stopped (SIGSTOP: connected, streaming,
/// flushing nothing), and a status lookup of it meanwhile: both are held, unanswered, until the standby has
/// flushed what the primary holds. The acquire waits for the standby's flush (the synchronous commit, or idemd's
/// own wait); the lookup because what it read may be on the primary alone (on `async` the row is committed and
/// visible there; on `sync` a commit is visible once its wait ends, or is cancelled), and an answer read from it
/// must not be one the failover undoes. Returns the acquire's answer and the lookup's.
fn acquire_held_until_the_standby_flushes(idemd: &Idemd, db: &Replicated, k: &str) -> ((u16, Value), (u16, String)) {
    let receiver = db.standby().psql("SELECT pid FROM pg_stat_wal_receiver").expect("wal receiver pid");
    let signal = |sig: &str| {
        let ok = Command::new("kill").args([sig, &receiver]).status().is_ok_and(|s| s.success());
        assert!(ok, "kill {sig} {receiver}");
    };
    signal("-STOP");
    let (first, lookup) = std::thread::scope(|s| {
        let acquire = s.spawn(|| idemd.acquire(k, true));
        std::thread::sleep(Duration::from_millis(400));
        let lookup = s.spawn(|| idemd.get(&format!("/v1/operations/{k}")));
        std::thread::sleep(Duration::from_millis(300));
        let held = (!acquire.is_finished(), !lookup.is_finished());
        signal("-CONT");
        assert_eq!(held, (true, true), "idemd answered (acquire, lookup) before the standby had flushed the row");
        (acquire.join().expect("acquire thread"), lookup.join().expect("lookup thread"))
    });
    (first, lookup)
}

/// Synchronous standby: the acquire was on the standby before idemd answered ACQUIRED, so after the failover
/// the retry is IN_FLIGHT with the first owner, whatever the upstream does with keys.
#[test]
fn sync_standby_keeps_the_acquire_through_failover() {
    let dir = tempfile::tempdir().expect("dir");
    let Some(mut db) = replicated(dir.path(), Replication::Sync) else { return };
    let idemd = Idemd::start(dir.path(), &db.url(), &[]);
    idemd.sees("sync");
    assert!(idemd.proc.log_text().contains("idemd database replication: sync"), "{}", idemd.proc.log_text());
    let h = idemd.healthz();
    assert_eq!((h["status"].as_str(), h["replication"]["mode"].as_str()), (Some("ok"), Some("sync")), "{h}");
    assert_eq!(h["replication"]["sync_standbys"], 1, "{h}");

    let k = key();
    let ((status, first), lookup) = acquire_held_until_the_standby_flushes(&idemd, &db, &k);
    assert_eq!((status, first["outcome"].as_str()), (200, Some("ACQUIRED")), "{first}");
    // The lookup read while the commit waited for the standby, before the row was visible anywhere.
    assert_eq!(lookup.0, 404, "{}", lookup.1);
    // No waiting for the standby: the commit already did.
    db.fail_over().expect("fail over");
    assert_eq!(rows(db.standby(), &k), "1", "the promoted standby has the acquire");

    retry_finds_the_first_owner(&idemd, &k, &first);
    // The new primary has no standby of its own: a single node, as idemd now reads.
    idemd.sees("single");
}

/// Synchronous, with its standby gone: a commit waits for a standby that never answers, so the acquire is never
/// acknowledged (STORE_UNAVAILABLE at idemd's SQL timeout: nothing ran). A failover to that standby then finds no
/// row, and the retry is the operation's first execution, not its second.
#[test]
fn sync_without_its_standby_acknowledges_nothing_it_could_lose() {
    let dir = tempfile::tempdir().expect("dir");
    let Some(mut db) = replicated(dir.path(), Replication::Sync) else { return };
    let idemd = Idemd::start(dir.path(), &db.url(), &[]);
    db.caught_up().expect("caught up");
    db.cut_replication().expect("cut");
    idemd.sees("sync");

    let k = key();
    let (status, first) = idemd.acquire(&k, true);
    assert_eq!((status, first["outcome"].as_str()), (503, Some("STORE_UNAVAILABLE")), "{first}");
    // The commit whose wait idemd gave up on is committed on the primary alone, and visible there: a lookup
    // must not answer from it (nor from its release, as uncertain), so it waits for the standby too, and times out.
    let (status, lookup) = idemd.get(&format!("/v1/operations/{k}"));
    assert_eq!(status, 503, "a lookup answered while no standby confirms: {lookup}");
    db.fail_over().expect("fail over");
    let retry = idemd.acquire_after_failover(&k, true);
    assert_eq!(retry["outcome"], "ACQUIRED", "the first attempt ran nothing: {retry}");
}

/// Asynchronous standby, idemd waiting for it (the default where the primary shows its standbys' positions): the
/// acquire is on the standby before idemd answers ACQUIRED, as with a synchronous standby, so after the failover
/// the retry is IN_FLIGHT with the first owner, even for an upstream that ignores keys.
#[test]
fn async_standby_is_waited_for_and_keeps_the_acquire_through_failover() {
    let dir = tempfile::tempdir().expect("dir");
    let Some(mut db) = replicated(dir.path(), Replication::Async) else { return };
    let idemd = Idemd::start(dir.path(), &db.url(), &[]);
    idemd.sees("idemd_waits");
    let log = idemd.proc.log_text();
    assert!(log.contains("idemd database replication: idemd_waits") && log.contains("accepting every route"), "{log}");
    let h = idemd.healthz();
    assert_eq!(
        (h["replication"]["mode"].as_str(), h["replication"]["refuses"].as_str()),
        (Some("idemd_waits"), Some("nothing")),
        "{h}"
    );

    let k = key();
    let ((status, first), lookup) = acquire_held_until_the_standby_flushes(&idemd, &db, &k);
    // The lookup read the row committed on the primary alone, and answered once the standby had it.
    assert_eq!(lookup.0, 200, "{}", lookup.1);
    assert!(lookup.1.contains("IN_FLIGHT"), "{}", lookup.1);
    assert_eq!((status, first["outcome"].as_str()), (200, Some("ACQUIRED")), "{first}");
    // No waiting here: idemd waited for the standby's flush before it answered.
    db.fail_over().expect("fail over");
    assert_eq!(rows(db.standby(), &k), "1", "the promoted standby has the acquire");
    retry_finds_the_first_owner(&idemd, &k, &first);
    let m = idemd.metrics();
    assert_eq!(metric(&m, r#"idem_replication_refused_total{mode="async"}"#), Some(0.0), "{m}");
}

/// Asynchronous standby cut off (the worst window: it lags from here on, and its slot still names it): idemd
/// waits for it and it never answers, so the acquire is never acknowledged (STORE_UNAVAILABLE at the SQL timeout:
/// nothing ran). The failover to it finds no row, and the retry is the operation's first execution.
#[test]
fn async_standby_cut_off_acknowledges_nothing_it_could_lose() {
    let dir = tempfile::tempdir().expect("dir");
    let Some(mut db) = replicated(dir.path(), Replication::Async) else { return };
    let idemd = Idemd::start(dir.path(), &db.url(), &[]);
    db.caught_up().expect("caught up");
    db.cut_replication().expect("cut");
    // Cut off, the standby is still known by its replication slot: waited for, not forgotten.
    idemd.sees("idemd_waits");

    for ignores_keys in [true, false] {
        let k = key();
        let (status, first) = idemd.acquire(&k, ignores_keys);
        assert_eq!((status, first["outcome"].as_str()), (503, Some("STORE_UNAVAILABLE")), "{first}");
        assert_eq!(rows(db.standby(), &k), "0", "the standby lags: the worst window");
    }
    let k = key();
    let (status, _) = idemd.acquire(&k, true);
    assert_eq!(status, 503);
    // Reads wait for the standby too (what they see may be committed on the primary alone), so while it is cut
    // off a status lookup answers nothing either.
    let (status, lookup) = idemd.get(&format!("/v1/operations/{k}"));
    assert_eq!(status, 503, "a lookup answered while no standby confirms: {lookup}");
    db.fail_over().expect("fail over");
    let retry = idemd.acquire_after_failover(&k, true);
    assert_eq!(retry["outcome"], "ACQUIRED", "the first attempt was never acknowledged: {retry}");
    idemd.sees("single");
}

/// Asynchronous standby that idemd cannot see (its role lacks `pg_read_all_stats`: the standby's state and
/// position read as NULL), so it cannot wait for it: `async`. An acquire for an upstream that ignores keys is
/// refused before anything ran; one for an upstream that honours keys is served, and after the failover that lost
/// it, ACQUIRED again under the same key: the upstream's deduplication is what protects it.
#[test]
fn unseen_async_standby_refuses_keyless_acquires_and_serves_honoured_keys() {
    let dir = tempfile::tempdir().expect("dir");
    let Some(mut db) = replicated(dir.path(), Replication::Async) else { return };
    db.primary().psql("CREATE ROLE idem_plain LOGIN; GRANT CREATE ON SCHEMA public TO idem_plain").expect("role");
    let idemd = Idemd::start(dir.path(), &db.url().replacen("postgres@", "idem_plain@", 1), &[]);
    // idemd's schema reaches the standby, then the standby is cut off: it lags from here on.
    db.caught_up().expect("caught up");
    db.cut_replication().expect("cut");
    idemd.sees("async");

    let keyless = key();
    let (status, refused) = idemd.acquire(&keyless, true);
    // Its own outcome, not an outage's: the filter tells the agent why and not to retry (core's
    // `a_replication_refusal_says_why_and_is_not_retried`).
    assert_eq!((status, refused["outcome"].as_str()), (503, Some("REPLICATION_REFUSED")), "{refused}");
    assert_eq!(rows(db.primary(), &keyless), "0", "refused before anything was recorded");
    let log = idemd.proc.log_text();
    assert!(log.contains("acquire refused") && log.contains("ignores Idempotency-Key"), "{log}");
    assert!(log.contains("idemd database replication: async"), "{log}");

    let keyed = key();
    let (status, first) = idemd.acquire(&keyed, false);
    assert_eq!((status, first["outcome"].as_str()), (200, Some("ACQUIRED")), "{first}\n{}", idemd.proc.log_text());
    assert_eq!(rows(db.primary(), &keyed), "1");
    assert_eq!(rows(db.standby(), &keyed), "0", "the standby lags: the worst window");

    let m = idemd.metrics();
    assert_eq!(metric(&m, r#"idem_replication_refused_total{mode="async"}"#), Some(1.0), "{m}");
    assert_eq!(metric(&m, "idem_async_failover_risk_accepted"), Some(0.0), "{m}");
    let h = idemd.healthz();
    assert_eq!(h["replication"]["refuses"], "acquires for upstreams that ignore keys", "{h}");

    db.fail_over().expect("fail over");
    // The failover lost the acquire: the retry, carrying the same key to an upstream that deduplicates by it,
    // is ACQUIRED again. Served, as the topology promises for such a route.
    let retry = idemd.acquire_after_failover(&keyed, false);
    assert_eq!(retry["outcome"], "ACQUIRED", "{retry}");
    assert_ne!(retry["owner"], first["owner"]);

    // The promoted standby has no standby: single, and the refused operation may run now, for the first time.
    idemd.sees("single");
    let now = idemd.acquire_after_failover(&keyless, true);
    assert_eq!(now["outcome"], "ACQUIRED", "{now}");
}

/// The operator accepted the risk: what an async standby costs when idemd does not know, now chosen and flagged.
/// An acquire for an upstream that ignores keys is lost by the failover, and the retry gets a new owner: a
/// second execution.
#[test]
fn async_with_the_risk_accepted_executes_twice_after_failover() {
    let dir = tempfile::tempdir().expect("dir");
    let Some(mut db) = replicated(dir.path(), Replication::Async) else { return };
    let idemd = Idemd::start(dir.path(), &db.url(), &["--accept-async-failover-risk"]);
    db.caught_up().expect("caught up");
    db.cut_replication().expect("cut");
    // Accepting the risk is not waiting for the standby: the database's own `async`.
    idemd.sees("async");
    let log = idemd.proc.log_text();
    assert!(log.contains("--accept-async-failover-risk"), "logged at start: {log}");
    assert_eq!(metric(&idemd.metrics(), "idem_async_failover_risk_accepted"), Some(1.0));

    let k = key();
    let (status, first) = idemd.acquire(&k, true);
    assert_eq!((status, first["outcome"].as_str()), (200, Some("ACQUIRED")), "{first}");
    db.fail_over().expect("fail over");
    let retry = idemd.acquire_after_failover(&k, true);
    assert_eq!(retry["outcome"], "ACQUIRED", "the failover lost the first acquire: {retry}");
    assert_ne!(retry["owner"], first["owner"], "a second owner: a second execution");
}

/// Pointed at a standby, idemd refuses to start: exit 2, and the error says why and what to do.
#[test]
fn idemd_refuses_to_start_on_a_standby() {
    let dir = tempfile::tempdir().expect("dir");
    let Some(db) = replicated(dir.path(), Replication::Async) else { return };
    let out = idemd_command(&db.standby().url(), &[]).output().expect("run idemd");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("is a standby, not the primary") && stderr.contains("pg_is_in_recovery"), "{stderr}");
    assert_eq!(db.standby().psql("SELECT to_regclass('idem_record') IS NULL").expect("psql"), "t", "nothing written");
}

/// The live queries on each backend: the shared single-node servers read as `single`, with the facts behind it
/// (a query that failed would read `unknown` and refuse every acquire for an upstream that ignores keys).
#[test]
fn single_node_servers_read_as_single_on_every_backend() {
    use idem_testkit::backends::{available, mysql_url, postgres_url};
    use idemd::store::sql::replication::Mode;
    use idemd::store::sql::{SqlOptions, SqlStore};
    let dir = tempfile::tempdir().expect("dir");
    let sqlite = format!("sqlite://{}/idem.db?mode=rwc", dir.path().display());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    for (name, url, says) in [
        ("postgres", postgres_url(), "synchronous_commit="),
        ("mariadb", mysql_url(), "semi-sync off"),
        ("sqlite", sqlite, "one file on one node"),
    ] {
        if name != "sqlite" && !available(name, &url).expect("backend") {
            continue;
        }
        let read = rt.block_on(async {
            let sql = SqlStore::connect(&url, &SqlOptions::default()).await.expect("connect");
            (sql.replication(), sql.refresh_replication().await)
        });
        assert_eq!(read.0, read.1, "{name}: read at connect and again");
        assert_eq!(read.0.mode, Mode::Single, "{name}: {}", read.0.detail);
        assert!(read.0.detail.contains(says), "{name}: {}", read.0.detail);
    }
}

fn maria_rows(db: &idem_testkit::mariadb_server::MariaDbServer, key: &str) -> String {
    db.sql(&format!("SELECT count(*) FROM test.idem_record WHERE idem_key = '{key}'")).expect("count")
}

fn maria(dir: &Path, mode: MariaReplication) -> Option<MariaReplicated> {
    MariaReplicated::start(dir, mode).expect("replicated mariadb")
}

/// MariaDB semi-synchronous: the commit returned once the replica acknowledged it, so the promoted replica has the
/// acquire and the retry is IN_FLIGHT with the first owner.
#[test]
fn mariadb_semi_sync_keeps_the_acquire_through_failover() {
    let dir = tempfile::tempdir().expect("dir");
    let Some(mut db) = maria(dir.path(), MariaReplication::SemiSync) else { return };
    let idemd = Idemd::start(dir.path(), &db.url(), &[]);
    idemd.sees("sync");
    let h = idemd.healthz();
    assert_eq!(h["replication"]["sync_standbys"], 1, "{h}");
    assert!(h["replication"]["detail"].as_str().is_some_and(|d| d.contains("semi-synchronous")), "{h}");

    let k = key();
    let (status, first) = idemd.acquire(&k, true);
    assert_eq!((status, first["outcome"].as_str()), (200, Some("ACQUIRED")), "{first}");
    db.fail_over().expect("fail over");
    assert_eq!(maria_rows(db.replica(), &k), "1", "the promoted replica has the acquire");
    retry_finds_the_first_owner(&idemd, &k, &first);
    // The promoted replica writes no binary log: nothing can follow it.
    idemd.sees("single");
}

/// MariaDB asynchronous, the replica cut off: idemd reads `async` and refuses an acquire for an upstream that
/// ignores keys; one for an upstream that honours keys is served, and the failover loses it (ACQUIRED again under
/// the same key).
#[test]
fn mariadb_async_replica_refuses_keyless_acquires_and_serves_honoured_keys() {
    let dir = tempfile::tempdir().expect("dir");
    let Some(mut db) = maria(dir.path(), MariaReplication::Async) else { return };
    let idemd = Idemd::start(dir.path(), &db.url(), &[]);
    idemd.sees("async");
    db.caught_up().expect("caught up");
    db.cut_replication();

    let keyless = key();
    let (status, refused) = idemd.acquire(&keyless, true);
    // Its own outcome, not an outage's: the filter tells the agent why and not to retry (core's
    // `a_replication_refusal_says_why_and_is_not_retried`).
    assert_eq!((status, refused["outcome"].as_str()), (503, Some("REPLICATION_REFUSED")), "{refused}");
    assert_eq!(maria_rows(db.primary(), &keyless), "0", "refused before anything was recorded");

    let keyed = key();
    let (status, first) = idemd.acquire(&keyed, false);
    assert_eq!((status, first["outcome"].as_str()), (200, Some("ACQUIRED")), "{first}");
    assert_eq!(maria_rows(db.primary(), &keyed), "1");
    assert_eq!(maria_rows(db.replica(), &keyed), "0", "the replica lags: the worst window");
    idemd.sees("async");
    let m = idemd.metrics();
    assert_eq!(metric(&m, r#"idem_replication_refused_total{mode="async"}"#), Some(1.0), "{m}");

    db.fail_over().expect("fail over");
    let retry = idemd.acquire_after_failover(&keyed, false);
    assert_eq!(retry["outcome"], "ACQUIRED", "the failover lost the acquire: {retry}");
    assert_ne!(retry["owner"], first["owner"]);
    idemd.sees("single");
    let now = idemd.acquire_after_failover(&keyless, true);
    assert_eq!(now["outcome"], "ACQUIRED", "its first execution: {now}");
}

/// Pointed at a MariaDB replica, idemd refuses to start, and writes nothing there.
#[test]
fn idemd_refuses_to_start_on_a_mariadb_replica() {
    let dir = tempfile::tempdir().expect("dir");
    let Some(db) = maria(dir.path(), MariaReplication::Async) else { return };
    let out = idemd_command(&db.replica().url(), &[]).output().expect("run idemd");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("is a standby, not the primary") && stderr.contains("mariadb replica"), "{stderr}");
    let tables = db.replica().sql("SELECT count(*) FROM information_schema.tables WHERE table_name = 'idem_record'");
    assert_eq!(tables.expect("count"), "0", "nothing written");
}

/// `idemd check` with the deployment's database: it says the topology it reads, refuses the routes whose upstream
/// ignores keys where idemd would refuse their confirms (not once the risk is accepted), refuses a standby, and
/// writes nothing to the database it reads.
#[test]
fn idemd_check_reports_the_topology_and_refuses_what_idemd_would() {
    let dir = tempfile::tempdir().expect("dir");
    let Some(db) = replicated(dir.path(), Replication::Async) else { return };
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../envoy/soak-hostile.yaml");
    let check = |url: &str, accept: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_idemd"))
            .args(["check", "--envoy", config])
            .env("IDEM_DATABASE_URL", url)
            .env("IDEM_ACCEPT_ASYNC_FAILOVER_RISK", accept)
            .output()
            .expect("idemd check");
        (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    // As a superuser it sees the standby's position: idemd would wait for it, and refuses nothing.
    let (stdout, stderr) = check(&db.url(), "");
    assert!(stdout.contains("idemd check: database replication: idemd_waits ("), "{stdout}");
    assert!(stdout.contains("accepting every route"), "{stdout}");
    assert!(!stderr.contains("[replication]"), "{stderr}");

    // A role without pg_read_all_stats sees a standby but not where it is: nothing to wait for, so `async`, and
    // every route whose upstream ignores keys is refused.
    db.primary().psql("CREATE ROLE idem_plain LOGIN").expect("role");
    let plain = db.url().replacen("postgres@", "idem_plain@", 1);
    let (stdout, stderr) = check(&plain, "");
    assert!(stdout.contains("idemd check: database replication: async ("), "{stdout}");
    assert!(stdout.contains("accepting routes whose upstream honours Idempotency-Key"), "{stdout}");
    assert!(stdout.contains("REFUSED"), "{stdout}\n{stderr}");
    let refused: Vec<&str> = stderr.lines().filter(|l| l.contains("[replication]")).collect();
    assert!(refused.iter().any(|l| l.contains("route hostile_nokey_confirm")), "{stderr}");
    assert!(refused.iter().all(|l| l.contains("upstream_keys: ignored")), "{stderr}");

    let (stdout, stderr) = check(&plain, "true");
    assert!(stdout.contains("risk accepted"), "{stdout}");
    assert!(!stderr.contains("[replication]"), "{stderr}");

    let (_, stderr) = check(&db.standby().url(), "true");
    assert!(stderr.contains("[replication]") && stderr.contains("refuses to start"), "{stderr}");
    assert_eq!(db.primary().psql("SELECT to_regclass('idem_record') IS NULL").expect("psql"), "t", "nothing written");
}
