//! SQLite's group commit under a SIGKILL (`store/sql/group_commit.rs`): idemd answers a write only after the commit
//! that carries it, so a process killed in the middle of a load has lost nothing it said it had written. A real
//! idemd process, a real SQLite file, 32 callers acquiring and completing fresh operations over HTTP until the
//! kill; then a new idemd on the same file is asked about every operation the killed ones answered.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::protocol::{
    AcquireOutcome, AcquireResponse, CompleteRequest, OpKey, OpState, OperationView, OwnerToken, TerminalState,
};
use tokio::sync::Mutex;

const TOKEN: &str = "sqlite-kill-test-token-0123456789";

struct Idemd {
    child: Child,
    addr: String,
}

impl Idemd {
    fn start(db: &str) -> Idemd {
        let mut child = Command::new(env!("CARGO_BIN_EXE_idemd"))
            .args(["serve", "--listen", "127.0.0.1:0", "--database-url", db, "--no-reconcile"])
            .env("IDEM_AUTH_TOKENS", TOKEN)
            .env_remove("IDEM_REDIS_URL")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn idemd");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("read");
        assert!(line.starts_with("idemd listening on "), "{line}");
        let addr = line["idemd listening on ".len()..].split(' ').next().expect("addr").to_string();
        Idemd { child, addr }
    }

    /// SIGKILL, like an OOM kill: no shutdown, no flush.
    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Idemd {
    fn drop(&mut self) {
        self.kill9();
    }
}

#[derive(Default)]
struct Told {
    /// Keys idemd answered ACQUIRED, with the owner it handed out.
    acquired: Vec<(String, String)>,
    /// Keys whose complete idemd answered OK.
    completed: Vec<String>,
    /// Calls that got no answer: the kill landed while they were in flight.
    unanswered: usize,
}

async fn post(http: &reqwest::Client, addr: &str, path: &str, body: String) -> Option<String> {
    let r = http
        .post(format!("http://{addr}{path}"))
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .body(body)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?;
    if !r.status().is_success() {
        return None;
    }
    r.text().await.ok()
}

async fn caller(http: reqwest::Client, addr: String, told: Arc<Mutex<Told>>, until: Instant) {
    while Instant::now() < until {
        let key = idemd::store::new_owner();
        let acquire = serde_json::to_string(&common::acq(&key)).expect("json");
        let Some(body) = post(&http, &addr, "/v1/acquire", acquire).await else {
            told.lock().await.unanswered += 1;
            return;
        };
        let answer: AcquireResponse = serde_json::from_str(&body).expect("acquire answer");
        assert_eq!(answer.outcome, AcquireOutcome::Acquired, "a fresh key: {body}");
        let owner = answer.owner.expect("owner").to_string();
        told.lock().await.acquired.push((key.clone(), owner.clone()));
        let complete = CompleteRequest {
            key: OpKey::parse(&key).expect("key"),
            owner: OwnerToken::parse(&owner).expect("owner"),
            state: TerminalState::Done,
            result: common::simple_result("tr_kill"),
            trace_id: String::new(),
        };
        match post(&http, &addr, "/v1/complete", serde_json::to_string(&complete).expect("json")).await {
            Some(body) if body.contains("\"OK\"") => told.lock().await.completed.push(key),
            Some(body) => panic!("complete of a key this caller owns: {body}"),
            None => {
                told.lock().await.unanswered += 1;
                return;
            }
        }
    }
}

/// Four rounds on one file, each killed after 0.7 s of load at whatever point its writer had reached, then a new
/// idemd answers for every operation of every round. (Checked against a writer that answered before its commit:
/// a single round caught it about every other run, four rounds nearly always.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_idemd_on_sqlite_lost_no_write_it_had_answered() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = format!("sqlite://{}/idem.db?mode=rwc", dir.path().display());
    let http = reqwest::Client::new();
    let told = Arc::new(Mutex::new(Told::default()));
    for round in 1..=4 {
        let mut idemd = Idemd::start(&db);
        // The callers would run for a minute: the kill ends them.
        let until = Instant::now() + Duration::from_secs(60);
        let mut callers = tokio::task::JoinSet::new();
        for _ in 0..32 {
            callers.spawn(caller(http.clone(), idemd.addr.clone(), Arc::clone(&told), until));
        }
        tokio::time::sleep(Duration::from_millis(700)).await;
        idemd.kill9();
        while let Some(r) = callers.join_next().await {
            r.expect("caller");
        }
        assert_eq!(told.lock().await.unanswered, 32 * round, "round {round}: every caller's last call went unanswered");
    }
    let told = std::mem::take(&mut *told.lock().await);
    assert!(told.completed.len() >= 4 * 32, "load before the kills: {} completed", told.completed.len());

    let last = Idemd::start(&db);
    let completed: std::collections::HashSet<&str> = told.completed.iter().map(String::as_str).collect();
    for (key, owner) in &told.acquired {
        let r = http
            .get(format!("http://{}/v1/operations/{key}", last.addr))
            .bearer_auth(TOKEN)
            .send()
            .await
            .expect("lookup");
        assert_eq!(r.status().as_u16(), 200, "{key} was answered ACQUIRED before a kill and must have its row");
        let view: OperationView = r.json().await.expect("view");
        if completed.contains(key.as_str()) {
            assert_eq!(view.state, OpState::Done, "{key}: its complete was answered OK");
        } else {
            assert!(matches!(view.state, OpState::InFlight | OpState::Done), "{key}: {:?}", view.state);
            if view.state == OpState::InFlight {
                assert_eq!(view.owner.map(|o| o.to_string()).as_deref(), Some(owner.as_str()), "{key}");
            }
        }
    }
}
