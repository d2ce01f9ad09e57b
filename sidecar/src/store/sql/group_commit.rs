//! SQLite's writes, committed in groups by one writer.
//!
//! SQLite has one writer at a time and, in WAL mode with `synchronous=FULL`, one fsync per
//! commit. With every pooled connection writing for itself, concurrent writers meet SQLite's
//! busy handler, which sleeps between tries (1, 2, 5 … 100 ms), and each commit pays its own
//! fsync: a fresh confirm's two commits took 25 ms of store time at 16 connections
//! (docs/performance.md). Here one task writes: it takes every write queued at that moment
//! (at most [`MAX_BATCH`]), runs them in order in one transaction and commits once, then
//! answers each caller with its own row count. Nothing waits for company: a lone write is
//! committed at once, so grouping never delays a request beyond the write ahead of it.
//!
//! What each write keeps:
//! - its statement and, when that changed exactly one row, its audit line, in the same commit
//!   (`SqlStore::change`): a group commits whole or not at all;
//! - its own answer: a group that fails (a statement's error, or the commit's) is rolled back
//!   and its writes are run again one transaction each, so one bad write fails alone;
//! - its caller's time budget: a write whose caller has stopped waiting (the SQL timeout) and
//!   that has not started is dropped, as a statement that never reached the database; one
//!   already running may commit, which is what `SqlError::Timeout` already means.
//!
//! Reads do not come here: WAL readers never wait for the writer.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use sqlx::sqlite::{SqliteArguments, SqlitePool};
use sqlx::Sqlite;
use tokio::sync::{mpsc, oneshot};

use super::dialect::{bind_all, Bind, SqlError};

/// The most writes one commit carries.
const MAX_BATCH: usize = 64;

/// A bind value the writer task owns (the callers' [`Bind`]s borrow).
#[derive(Debug)]
pub(super) enum Value {
    Text(String),
    OptText(Option<String>),
    Int(i64),
    OptInt(Option<i64>),
}

impl From<&Bind<'_>> for Value {
    fn from(b: &Bind<'_>) -> Value {
        match *b {
            Bind::Text(v) => Value::Text(v.to_owned()),
            Bind::OptText(v) => Value::OptText(v.map(str::to_owned)),
            Bind::Int(v) => Value::Int(v),
            Bind::OptInt(v) => Value::OptInt(v),
        }
    }
}

impl Value {
    fn as_bind(&self) -> Bind<'_> {
        match self {
            Value::Text(v) => Bind::Text(v),
            Value::OptText(v) => Bind::OptText(v.as_deref()),
            Value::Int(v) => Bind::Int(*v),
            Value::OptInt(v) => Bind::OptInt(*v),
        }
    }
}

/// One statement with its values.
#[derive(Debug)]
pub(super) struct Statement {
    pub text: String,
    pub values: Vec<Value>,
}

impl Statement {
    pub fn new(text: &str, binds: &[Bind<'_>]) -> Statement {
        Statement { text: text.to_owned(), values: binds.iter().map(Value::from).collect() }
    }
}

/// One write: `first`, then `if_one_row` when `first` changed exactly one row.
#[derive(Debug)]
pub(super) struct Write {
    pub first: Statement,
    pub if_one_row: Option<Statement>,
}

struct Job {
    write: Write,
    answer: oneshot::Sender<Result<u64, SqlError>>,
}

/// How many commits carried how many writes, since the start.
#[derive(Debug, Default)]
pub(super) struct Grouped {
    commits: AtomicU64,
    writes: AtomicU64,
}

impl Grouped {
    /// (commits, writes committed).
    pub fn get(&self) -> (u64, u64) {
        (self.commits.load(Ordering::Relaxed), self.writes.load(Ordering::Relaxed))
    }

    fn add(&self, writes: usize) {
        self.commits.fetch_add(1, Ordering::Relaxed);
        self.writes.fetch_add(u64::try_from(writes).unwrap_or(u64::MAX), Ordering::Relaxed);
    }
}

/// The handle the store writes through; the writer task ends when the last handle goes.
#[derive(Clone, Debug)]
pub(super) struct GroupCommit {
    jobs: mpsc::UnboundedSender<Job>,
    grouped: Arc<Grouped>,
}

impl GroupCommit {
    /// Start the writer on the current tokio runtime.
    pub fn start(pool: SqlitePool) -> GroupCommit {
        let (jobs, queue) = mpsc::unbounded_channel();
        let grouped = Arc::new(Grouped::default());
        tokio::spawn(writer(pool, queue, Arc::clone(&grouped)));
        GroupCommit { jobs, grouped }
    }

    pub fn grouped(&self) -> &Grouped {
        &self.grouped
    }

    /// Queue `write` and wait for its commit: how many rows `first` changed.
    pub async fn write(&self, write: Write) -> Result<u64, SqlError> {
        let (answer, answered) = oneshot::channel();
        self.jobs.send(Job { write, answer }).map_err(|_| gone())?;
        answered.await.map_err(|_| gone())?
    }
}

fn gone() -> SqlError {
    SqlError::Config("the SQLite writer has stopped".into())
}

async fn writer(pool: SqlitePool, mut queue: mpsc::UnboundedReceiver<Job>, grouped: Arc<Grouped>) {
    let mut batch: Vec<Job> = Vec::with_capacity(MAX_BATCH);
    while let Some(job) = queue.recv().await {
        batch.push(job);
        while batch.len() < MAX_BATCH {
            match queue.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        // Callers that stopped waiting were told "timed out": their writes never start.
        batch.retain(|job| !job.answer.is_closed());
        if batch.is_empty() {
            continue;
        }
        let writes: Vec<&Write> = batch.iter().map(|job| &job.write).collect();
        match commit(&pool, &writes, &grouped).await {
            Ok(counts) => {
                for (job, n) in batch.drain(..).zip(counts) {
                    let _ = job.answer.send(Ok(n));
                }
            }
            Err(e) if batch.len() == 1 => {
                if let Some(job) = batch.pop() {
                    let _ = job.answer.send(Err(SqlError::Db(e)));
                }
            }
            // The group was rolled back: each write again in a commit of its own, so only a
            // write that fails by itself is told so.
            Err(_) => {
                for job in batch.drain(..) {
                    let answer =
                        commit(&pool, &[&job.write], &grouped).await.map_err(SqlError::Db).and_then(|counts| {
                            counts.first().copied().ok_or_else(|| SqlError::Config("no row count".into()))
                        });
                    let _ = job.answer.send(answer);
                }
            }
        }
    }
}

/// Run `writes` in order in one transaction; each one's row count, once committed.
async fn commit(pool: &SqlitePool, writes: &[&Write], grouped: &Grouped) -> Result<Vec<u64>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let mut counts = Vec::with_capacity(writes.len());
    for w in writes {
        let n = query(&w.first).execute(&mut *tx).await?.rows_affected();
        if n == 1 {
            if let Some(then) = &w.if_one_row {
                query(then).execute(&mut *tx).await?;
            }
        }
        counts.push(n);
    }
    tx.commit().await?;
    grouped.add(writes.len());
    Ok(counts)
}

fn query(s: &Statement) -> sqlx::query::Query<'_, Sqlite, SqliteArguments<'_>> {
    let binds: Vec<Bind<'_>> = s.values.iter().map(Value::as_bind).collect();
    bind_all!(sqlx::query(&s.text), binds)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::str::FromStr;

    async fn pool(dir: &tempfile::TempDir) -> SqlitePool {
        let url = format!("sqlite://{}/g.db?mode=rwc", dir.path().display());
        let options = sqlx::sqlite::SqliteConnectOptions::from_str(&url)
            .map(|o| o.journal_mode(sqlx::sqlite::SqliteJournalMode::Wal))
            .map_err(|e| e.to_string());
        let pool = match options {
            Ok(o) => sqlx::sqlite::SqlitePoolOptions::new().max_connections(4).connect_with(o).await,
            Err(e) => panic!("options: {e}"),
        };
        let pool = pool.unwrap_or_else(|e| panic!("pool: {e}"));
        sqlx::raw_sql("CREATE TABLE t (k TEXT PRIMARY KEY, v INTEGER NOT NULL); CREATE TABLE a (k TEXT NOT NULL)")
            .execute(&pool)
            .await
            .unwrap_or_else(|e| panic!("schema: {e}"));
        pool
    }

    fn insert(k: &str, v: Option<i64>) -> Write {
        Write {
            first: Statement::new(
                "INSERT INTO t (k, v) VALUES (?, ?) ON CONFLICT (k) DO NOTHING",
                &[Bind::Text(k), Bind::OptInt(v)],
            ),
            if_one_row: Some(Statement::new("INSERT INTO a (k) VALUES (?)", &[Bind::Text(k)])),
        }
    }

    async fn count(pool: &SqlitePool, sql: &str) -> i64 {
        sqlx::query_scalar::<_, i64>(sql).fetch_one(pool).await.unwrap_or(-1)
    }

    /// Jobs queued before the writer starts: it finds them all at its first look, as writes
    /// that arrive while a commit runs.
    fn queued(writes: Vec<Write>) -> (mpsc::UnboundedReceiver<Job>, Vec<oneshot::Receiver<Result<u64, SqlError>>>) {
        let (jobs, queue) = mpsc::unbounded_channel();
        let mut answers = Vec::new();
        for write in writes {
            let (answer, answered) = oneshot::channel();
            assert!(jobs.send(Job { write, answer }).is_ok());
            answers.push(answered);
        }
        drop(jobs);
        (queue, answers)
    }

    async fn answers(answers: Vec<oneshot::Receiver<Result<u64, SqlError>>>) -> Vec<Option<u64>> {
        let mut out = Vec::new();
        for a in answers {
            out.push(a.await.ok().and_then(Result::ok));
        }
        out
    }

    #[tokio::test]
    async fn queued_writes_share_one_commit_and_each_hears_its_own_row_count() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let pool = pool(&dir).await;
        // k1 twice: the second changes no row, and so writes no audit line.
        let (queue, rx) = queued(vec![insert("k1", Some(1)), insert("k2", Some(2)), insert("k1", Some(3))]);
        let grouped = Arc::new(Grouped::default());
        writer(pool.clone(), queue, Arc::clone(&grouped)).await;
        assert_eq!(answers(rx).await, vec![Some(1), Some(1), Some(0)]);
        assert_eq!(grouped.get(), (1, 3), "one commit for the three writes");
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM t").await, 2);
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM a").await, 2, "an audit line for each changed row only");
        assert_eq!(count(&pool, "SELECT v FROM t WHERE k = 'k1'").await, 1);
    }

    #[tokio::test]
    async fn a_write_that_fails_fails_alone_and_its_group_commits_without_it() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let pool = pool(&dir).await;
        // v NOT NULL: the middle write fails, and with it the group's transaction.
        let (queue, rx) = queued(vec![insert("k1", Some(1)), insert("bad", None), insert("k2", Some(2))]);
        let grouped = Arc::new(Grouped::default());
        writer(pool.clone(), queue, Arc::clone(&grouped)).await;
        assert_eq!(answers(rx).await, vec![Some(1), None, Some(1)]);
        assert_eq!(grouped.get(), (2, 2), "the group rolled back, then each good write in its own commit");
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM t").await, 2);
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM a WHERE k = 'bad'").await, 0);
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM a").await, 2);
    }

    #[tokio::test]
    async fn a_write_whose_caller_stopped_waiting_never_starts() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let pool = pool(&dir).await;
        let (queue, mut rx) = queued(vec![insert("gone", Some(1)), insert("k1", Some(1))]);
        // The first caller's SQL timeout fired: it dropped its answer.
        drop(rx.remove(0));
        let grouped = Arc::new(Grouped::default());
        writer(pool.clone(), queue, Arc::clone(&grouped)).await;
        assert_eq!(answers(rx).await, vec![Some(1)]);
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM t WHERE k = 'gone'").await, 0);
        assert_eq!(grouped.get(), (1, 1));
    }

    #[tokio::test]
    async fn concurrent_writers_through_the_handle_all_commit_in_fewer_commits() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let pool = pool(&dir).await;
        let group = GroupCommit::start(pool.clone());
        let mut set = tokio::task::JoinSet::new();
        for i in 0..200 {
            let group = group.clone();
            // 100 keys, each written twice: exactly one of each pair changes the row.
            set.spawn(async move { group.write(insert(&format!("k{}", i % 100), Some(i))).await });
        }
        let mut changed = 0;
        while let Some(r) = set.join_next().await {
            match r {
                Ok(Ok(n)) => changed += n,
                other => panic!("a write failed: {other:?}"),
            }
        }
        assert_eq!(changed, 100);
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM a").await, 100);
        let (commits, writes) = group.grouped().get();
        assert_eq!(writes, 200);
        assert!(commits < writes, "concurrent writes were grouped: {commits} commits for {writes} writes");
    }
}
