//! idemd's orchestration as sans-IO step machines: one flow, two drivers.
//!
//! Each operation of the store (acquire with the approval gate and its retry loop, complete,
//! release, renew, the reconciler's row) is written once, as an `async fn` over a [`Port`]
//! whose only await point is a store call ([`Call`]) answered by a [`Reply`]. [`Flow`] wraps it
//! as a step machine: [`Flow::next`] takes the reply to the last call and gives the next call
//! (an effect) or the answer. Nothing in a flow touches a socket, a clock or a random source:
//! the time and fresh owner tokens are calls too.
//!
//! Two drivers run the same flows: `Store` (`store/mod.rs`) carries each call out against Redis
//! and SQL with async I/O, timed and metered; the model checker (`model/`) carries each call out
//! against its in-model stores, one store call per model step, so other replicas, the clock and
//! faults act between any two of them (docs/model.md).

pub mod acquire;
pub mod write;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use idem_core::protocol::TerminalState;

use super::record::{ApprovalRow, Record};
use super::redis::{AcquireReply, WriteReply};
use crate::evidence::Asked;

/// An audit line's words, owned (the flow decides them; the SQL driver writes them).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Said {
    pub actor: String,
    pub action: &'static str,
    pub why: String,
    pub trace_id: String,
}

/// The IN_FLIGHT row an acquire inserts (owned `sql::NewInFlight`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct InFlightRow {
    pub key: String,
    pub param_hash: String,
    pub subject_hash: String,
    pub scope: String,
    pub owner: String,
    pub lease_until_ms: i64,
    pub now_ms: i64,
    pub fp_exp_ms: Option<i64>,
    pub upstream_ignores_keys: bool,
    pub business_ref: Option<String>,
    pub bound_fields: Option<String>,
}

/// One effect of a flow: a store call (a Lua script, a SQL statement), the status lookup, or one
/// of the two inputs a flow may not take from the world itself (the time, a fresh owner token).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    /// `lua/acquire.lua`.
    RedisAcquire {
        key: String,
        param_hash: String,
        subject_hash: String,
        scope: String,
        owner: String,
        lease_ms: u64,
    },
    /// `lua/complete.lua`.
    RedisComplete {
        key: String,
        owner: String,
        state: TerminalState,
        result_json: String,
        retention_ms: u64,
    },
    /// `lua/release.lua`.
    RedisRelease {
        key: String,
        owner: String,
    },
    /// `lua/renew.lua`.
    RedisRenew {
        key: String,
        owner: String,
        lease_ms: u64,
    },
    /// `lua/restore.lua`.
    RedisRestore {
        rec: Record,
        ttl_ms: u64,
    },
    /// `DEL`.
    RedisEvict {
        key: String,
    },
    SqlInsertInFlight {
        row: InFlightRow,
        said: Said,
    },
    SqlGet {
        key: String,
    },
    SqlApproval {
        key: String,
    },
    SqlReferenceHolder {
        scope: String,
        reference: String,
    },
    SqlInsertAwaiting {
        row: ApprovalRow,
        said: Said,
    },
    SqlComplete {
        key: String,
        owner: String,
        state: TerminalState,
        result_json: String,
        now_ms: i64,
        said: Said,
    },
    SqlRelease {
        key: String,
        owner: String,
        said: Said,
    },
    /// The release of a row whose insert timed out, off the request path: the driver starts it
    /// and answers at once.
    SqlReleaseDetached {
        key: String,
        owner: String,
        said: Said,
    },
    SqlRenew {
        key: String,
        owner: String,
        until_ms: i64,
    },
    SqlClaim {
        rec: Record,
        token: String,
        until_ms: i64,
        now_ms: i64,
    },
    SqlUnclaim {
        rec: Record,
        token: String,
        failed: bool,
        said: Option<Said>,
    },
    SqlMarkNeedsReview {
        rec: Record,
        token: String,
        now_ms: i64,
        said: Said,
    },
    /// The scope's status endpoint about a row (the reconciler).
    Lookup {
        rec: Record,
    },
    /// The time now, unix ms.
    Now,
    /// A fresh owner token (32 lowercase hex).
    NewOwner,
}

impl Call {
    /// A call to Redis or SQL (or the status endpoint): what the model runs as a step of its own.
    /// The time and a fresh token are not: they are inputs taken where the flow stands.
    pub fn is_store(&self) -> bool {
        !matches!(self, Call::Now | Call::NewOwner)
    }
}

/// Why SQL gave no answer, as a flow tells the cases apart.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum SqlFail {
    /// It did not answer in time: it may still have committed.
    Timeout,
    /// A row this version cannot read: not an outage.
    Corrupt(String),
    Down(String),
}

impl std::fmt::Display for SqlFail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Timeout => write!(f, "SQL call timed out"),
            Self::Corrupt(what) => write!(f, "unreadable row: {what}"),
            Self::Down(what) => write!(f, "{what}"),
        }
    }
}

/// The answer to a [`Call`]. One is alive at a time in idemd (boxing the rows would cost an
/// allocation per call to save stack nobody uses).
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Reply {
    /// Redis gave no answer (down, timed out, the breaker open): SQL answers alone.
    RedisDown,
    Acquire(AcquireReply),
    Write(WriteReply),
    /// A call with nothing to say (a restore, an evict, a detached release).
    Done,
    Sql(Result<SqlAnswer, SqlFail>),
    Asked(Asked),
    Now(i64),
    Owner(String),
}

/// What a SQL statement answered.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum SqlAnswer {
    /// A conditional write: whether it changed the row.
    Changed(bool),
    Row(Option<Record>),
    Approval(Option<ApprovalRow>),
    Holder(Option<String>),
}

/// What a flow noted on its way (metrics and log-worthy events): not effects on the world, so
/// they are no calls; the async driver counts them, the model ignores them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Note {
    /// Redis had lost a key SQL holds: the row was copied back (its state).
    RedisRefill(&'static str),
    /// One lease renewal: renewed or lost.
    LeaseRenewal(bool),
    /// The approval gate recorded an operation AWAITING_APPROVAL.
    Awaiting,
    /// The status endpoint answered the reconciler (its scope, the answer's metric label).
    Lookup(String, &'static str),
}

#[derive(Default)]
struct Chan {
    call: Option<Call>,
    reply: Option<Reply>,
    notes: Vec<Note>,
}

/// The flow's side of the channel: every store call goes through [`Port::call`].
#[derive(Clone)]
pub struct Port(Arc<Mutex<Chan>>);

fn lock(chan: &Mutex<Chan>) -> MutexGuard<'_, Chan> {
    chan.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Port {
    /// Hand `call` to the driver and wait for its reply.
    pub fn call(&self, call: Call) -> Ask {
        Ask { chan: Arc::clone(&self.0), call: Some(call) }
    }

    pub fn note(&self, note: Note) {
        lock(&self.0).notes.push(note);
    }

    pub async fn now(&self) -> i64 {
        match self.call(Call::Now).await {
            Reply::Now(t) => t,
            _ => 0,
        }
    }

    pub async fn new_owner(&self) -> String {
        match self.call(Call::NewOwner).await {
            Reply::Owner(o) => o,
            _ => String::new(),
        }
    }

    /// A SQL call; a reply of another kind (a driver's mistake) reads as SQL down.
    pub async fn sql(&self, call: Call) -> Result<SqlAnswer, SqlFail> {
        match self.call(call).await {
            Reply::Sql(r) => r,
            other => Err(SqlFail::Down(format!("not a SQL reply: {other:?}"))),
        }
    }

    pub async fn sql_row(&self, key: &str) -> Result<Option<Record>, SqlFail> {
        match self.sql(Call::SqlGet { key: key.to_string() }).await? {
            SqlAnswer::Row(r) => Ok(r),
            other => Err(SqlFail::Down(format!("not a row: {other:?}"))),
        }
    }

    pub async fn sql_approval(&self, key: &str) -> Result<Option<ApprovalRow>, SqlFail> {
        match self.sql(Call::SqlApproval { key: key.to_string() }).await? {
            SqlAnswer::Approval(r) => Ok(r),
            other => Err(SqlFail::Down(format!("not an approval row: {other:?}"))),
        }
    }

    pub async fn sql_changed(&self, call: Call) -> Result<bool, SqlFail> {
        match self.sql(call).await? {
            SqlAnswer::Changed(c) => Ok(c),
            other => Err(SqlFail::Down(format!("not a write's answer: {other:?}"))),
        }
    }

    /// A Redis write script: `None` when Redis gave no answer.
    pub async fn redis_write(&self, call: Call) -> Option<WriteReply> {
        match self.call(call).await {
            Reply::Write(w) => Some(w),
            _ => None,
        }
    }

    /// A Redis call whose answer says nothing (restore, evict): `false` when Redis gave none.
    pub async fn redis_done(&self, call: Call) -> bool {
        matches!(self.call(call).await, Reply::Done)
    }
}

/// One store call in flight: pending until the driver has put its reply in the channel.
pub struct Ask {
    chan: Arc<Mutex<Chan>>,
    call: Option<Call>,
}

impl Future for Ask {
    type Output = Reply;

    fn poll(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Reply> {
        let call = self.call.take();
        let mut chan = lock(&self.chan);
        if let Some(call) = call {
            chan.call = Some(call);
            chan.reply = None;
            return Poll::Pending;
        }
        match chan.reply.take() {
            Some(r) => Poll::Ready(r),
            None => Poll::Pending,
        }
    }
}

/// What a flow wants next (one at a time, as [`Reply`]).
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Next<T> {
    /// Carry this out and give [`Flow::next`] its reply.
    Call(Call),
    /// The flow's answer.
    Done(T),
}

/// One run of a flow as a step machine.
pub struct Flow<T> {
    fut: Pin<Box<dyn Future<Output = T> + Send>>,
    chan: Arc<Mutex<Chan>>,
}

impl<T> Flow<T> {
    /// The flow `f` builds over a fresh port.
    pub fn new<F>(f: impl FnOnce(Port) -> F) -> Flow<T>
    where
        F: Future<Output = T> + Send + 'static,
    {
        let chan = Arc::new(Mutex::new(Chan::default()));
        let fut = Box::pin(f(Port(Arc::clone(&chan))));
        Flow { fut, chan }
    }

    /// Feed the reply to the last call (`None` at the start) and run the flow to its next call
    /// or its answer.
    pub fn next(&mut self, reply: Option<Reply>) -> Next<T> {
        {
            let mut chan = lock(&self.chan);
            chan.reply = reply;
            chan.call = None;
        }
        match self.fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(t) => Next::Done(t),
            // A flow awaits nothing but its port, so a pending flow has put a call in the channel.
            Poll::Pending => Next::Call(lock(&self.chan).call.take().unwrap_or(Call::Now)),
        }
    }

    /// The notes taken since the last time they were asked for.
    pub fn notes(&mut self) -> Vec<Note> {
        std::mem::take(&mut lock(&self.chan).notes)
    }

    /// Run the flow with its calls answered by `answer`, synchronously, to its answer.
    pub fn run_with(mut self, mut answer: impl FnMut(Call) -> Reply) -> T {
        let mut reply = None;
        loop {
            match self.next(reply.take()) {
                Next::Done(t) => return t,
                Next::Call(c) => reply = Some(answer(c)),
            }
        }
    }

    /// Replay the flow over `replies` (the answers its calls got so far, in order) and give what
    /// it wants after them. The flows are deterministic in their replies, so this is how a
    /// driver that cannot hold a flow (the model's states must be hashable) resumes one.
    pub fn replayed(mut self, replies: &[Reply]) -> (Flow<T>, Next<T>) {
        let mut next = self.next(None);
        for r in replies {
            if matches!(next, Next::Done(_)) {
                break;
            }
            next = self.next(Some(r.clone()));
        }
        (self, next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn two_reads(port: Port) -> (i64, Option<Record>) {
        let t = port.now().await;
        let row = port.sql_row("k").await.ok().flatten();
        (t, row)
    }

    #[test]
    fn a_flow_yields_its_calls_in_order_and_answers_from_the_replies() {
        let mut flow = Flow::new(two_reads);
        assert!(matches!(flow.next(None), Next::Call(Call::Now)));
        assert!(matches!(flow.next(Some(Reply::Now(7))), Next::Call(Call::SqlGet { ref key }) if key == "k"));
        match flow.next(Some(Reply::Sql(Ok(SqlAnswer::Row(None))))) {
            Next::Done((7, None)) => {}
            other => panic!("{other:?}"),
        }
    }

    /// The model runs each store call as a step of its own, and takes the time and a fresh owner where
    /// the flow stands: which calls are which is that contract.
    #[test]
    fn only_the_time_and_a_fresh_owner_are_not_store_calls() {
        assert!(!Call::Now.is_store() && !Call::NewOwner.is_store());
        assert!(Call::SqlGet { key: "k".into() }.is_store());
        assert!(Call::RedisRelease { key: "k".into(), owner: "o".into() }.is_store());
    }

    /// Each typed call gives back what its reply holds; a reply of another kind (Redis giving none, a
    /// driver's mistake) reads as no answer, never as a made-up value.
    #[test]
    fn each_typed_call_reads_its_own_reply_and_nothing_else() {
        let owner = |reply: Reply| Flow::new(|io| async move { io.new_owner().await }).run_with(|_| reply.clone());
        assert_eq!(owner(Reply::Owner("0123".into())), "0123");
        assert_eq!(owner(Reply::RedisDown), "");
        let release = || Call::RedisRelease { key: "k".into(), owner: "o".into() };
        let write =
            |reply: Reply| Flow::new(|io| async move { io.redis_write(release()).await }).run_with(|_| reply.clone());
        assert_eq!(write(Reply::Write(WriteReply::NotOwner)), Some(WriteReply::NotOwner));
        assert_eq!(write(Reply::RedisDown), None);
        let row = ApprovalRow {
            decided_by: Some("carol".into()),
            ..acquire::tests::approval_row(idem_core::protocol::ApprovalState::Approved)
        };
        let approval =
            |reply: Reply| Flow::new(|io| async move { io.sql_approval("k").await }).run_with(|_| reply.clone());
        assert_eq!(approval(Reply::Sql(Ok(SqlAnswer::Approval(Some(row.clone()))))), Ok(Some(row)));
        assert!(matches!(approval(Reply::Sql(Ok(SqlAnswer::Changed(true)))), Err(SqlFail::Down(_))));
    }

    /// Notes reach the driver (idemd counts them in its metrics) once each, as the flow takes them.
    #[test]
    fn a_flows_notes_are_handed_to_its_driver_once() {
        let mut flow = Flow::new(|io| async move {
            io.note(Note::Awaiting);
            let t = io.now().await;
            io.note(Note::LeaseRenewal(false));
            t
        });
        assert!(matches!(flow.next(None), Next::Call(Call::Now)));
        assert_eq!(flow.notes(), vec![Note::Awaiting]);
        assert!(flow.notes().is_empty(), "taken once");
        assert!(matches!(flow.next(Some(Reply::Now(4))), Next::Done(4)));
        assert_eq!(flow.notes(), vec![Note::LeaseRenewal(false)]);
    }

    /// What an operator reads in idemd's log when SQL gives no answer.
    #[test]
    fn a_sql_failure_says_what_happened() {
        assert_eq!(SqlFail::Timeout.to_string(), "SQL call timed out");
        assert_eq!(SqlFail::Corrupt("state \"X\" of k".into()).to_string(), "unreadable row: state \"X\" of k");
        assert_eq!(SqlFail::Down("connection refused".into()).to_string(), "connection refused");
    }

    #[test]
    fn a_replayed_flow_stands_where_its_replies_left_it() {
        let (_, next) = Flow::new(two_reads).replayed(&[Reply::Now(3)]);
        assert!(matches!(next, Next::Call(Call::SqlGet { .. })));
        let (_, next) = Flow::new(two_reads).replayed(&[Reply::Now(3), Reply::RedisDown]);
        assert!(matches!(next, Next::Done((3, None))), "a reply of the wrong kind reads as SQL down");
    }
}
