//! The `idemd` binary itself: TTL validation refuses to start (exit 2, the
//! rule and the shortfall), options come from the environment too, and
//! `serve` prints where it listens and answers /healthz.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

fn idemd() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_idemd"));
    // Nothing from the developer's shell leaks into these runs.
    for (k, _) in std::env::vars() {
        if k.starts_with("IDEM_") {
            c.env_remove(k);
        }
    }
    c
}

#[test]
fn short_lease_refuses_to_start_with_the_rule_and_the_shortfall() {
    let out = idemd().args(["serve", "--lease-ms", "20000"]).output().expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("IN_FLIGHT lease 20000 ms must exceed upstream worst case 30000 + gateway timeout 15000 + retry backoff 5000 = 50000 ms (short by 30001 ms)"),
        "{err}"
    );
}

#[test]
fn both_rules_from_environment_variables() {
    let out = idemd()
        .arg("serve")
        .env("IDEM_LEASE_MS", "1000")
        .env("IDEM_UPSTREAM_WORST_CASE_MS", "500")
        .env("IDEM_GATEWAY_TIMEOUT_MS", "400")
        .env("IDEM_RETRY_BACKOFF_TOTAL_MS", "100")
        .env("IDEM_TERMINAL_RETENTION_S", "3600")
        .env("IDEM_RETRY_WINDOW_S", "7200")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("= 1000 ms (short by 1 ms)"), "{err}");
    assert!(
        err.contains("terminal retention 3600 s must be at least the retry window 7200 s (short by 3600 s)"),
        "{err}"
    );
}

#[test]
fn unknown_database_scheme_is_a_configuration_error() {
    let out = idemd()
        .args(["serve", "--listen", "127.0.0.1:0", "--database-url", "oracle://x/y"])
        .env("IDEM_AUTH_TOKENS", "cli-test-token-0123456789")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unsupported database URL"));
}

#[test]
fn serve_prints_where_it_listens_and_answers_healthz() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut child = idemd()
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env("IDEM_DATABASE_URL", format!("sqlite://{}/sub/idem.db?mode=rwc", dir.path().display()))
        .env("IDEM_REDIS_CLUSTER", "false")
        .env("IDEM_AUTH_TOKENS", "cli-test-token-0123456789")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let stdout = child.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("read");
    let guard = KillOnDrop(child);

    assert!(line.starts_with("idemd listening on 127.0.0.1:"), "{line}");
    assert!(line.trim_end().ends_with("(redis: off, sql: sqlite)"), "{line}");
    let addr = line["idemd listening on ".len()..].split(' ').next().expect("addr").to_string();

    let rt = tokio::runtime::Runtime::new().expect("rt");
    let health: serde_json::Value = rt.block_on(async {
        let r = reqwest::Client::new()
            .get(format!("http://{addr}/healthz"))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .expect("healthz");
        assert_eq!(r.status().as_u16(), 200);
        r.json().await.expect("json")
    });
    assert_eq!(health["replication"]["mode"], "single", "{health}");
    assert_eq!(health["replication"]["refuses"], "nothing", "{health}");
    let mut health = health;
    health.as_object_mut().expect("object").remove("replication");
    assert_eq!(health, serde_json::json!({"status": "ok", "redis": "off", "sql": "up"}));
    assert!(dir.path().join("sub/idem.db").exists(), "the SQLite directory is created");
    drop(guard);
}

/// DESIGN §6: an idemd without a credential would answer anyone.
#[test]
fn serve_without_a_token_refuses_to_start_unless_told_it_is_insecure() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = format!("sqlite://{}/idem.db?mode=rwc", dir.path().display());
    let out = idemd().args(["serve", "--listen", "127.0.0.1:0", "--database-url", &db]).output().expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no API token: set IDEM_AUTH_TOKENS"), "{err}");
    let out = idemd()
        .args(["serve", "--listen", "127.0.0.1:0", "--database-url", &db, "--auth-tokens", "short"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 16 printable"), "{:?}", out);

    let mut child = idemd()
        .args(["serve", "--listen", "127.0.0.1:0", "--database-url", &db, "--insecure-no-auth"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let stdout = child.stdout.take().expect("stdout");
    let stderr = child.stderr.take().expect("stderr");
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("read");
    let mut warning = String::new();
    BufReader::new(stderr).read_line(&mut warning).expect("read");
    let _guard = KillOnDrop(child);
    assert!(line.starts_with("idemd listening on"), "{line}");
    assert!(warning.contains("--insecure-no-auth"), "{warning}");
}

struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn bad_reconciler_settings_refuse_to_start_naming_each_rule() {
    let out = idemd()
        .args(["serve", "--reconcile-interval-ms", "0", "--reaper-batch", "0"])
        .args(["--status-endpoint", "payments.transfer=http://127.0.0.1:8080/v1/transfers/by-key"])
        .args(["--terminal-retention-s", "86400", "--reconcile-grace-ms", "86400001"])
        .env("IDEM_STATUS_ENDPOINTS", "ignored=http://h/{key}")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    for rule in [
        "--reconcile-interval-ms must be greater than 0",
        "--reaper-batch must be greater than 0",
        "the URL must contain {key}",
        "reconcile grace 86400001 ms must not exceed the terminal retention 86400 s",
    ] {
        assert!(err.contains(&format!("idemd: refusing to start: {rule}")) || err.contains(rule), "{rule}: {err}");
    }
    assert!(!err.contains("ignored"), "flags win over the environment: {err}");
}

#[test]
fn status_endpoints_from_the_environment_are_checked_too() {
    let out =
        idemd().arg("serve").env("IDEM_STATUS_ENDPOINTS", "a=http://h/{key},b=https://h/{key}").output().expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--status-endpoint \"b=https://h/{key}\": https is not supported"), "{err}");
    assert!(!err.contains("\"a="), "{err}");
}

mod ops_cli {
    use super::idemd;
    use idem_core::protocol::{AcquireOutcome, AcquireRequest};
    use std::process::Output;

    /// `idemd ops` as operator bob (`IDEM_ACTOR`), on `db`.
    fn ops(db: &str, args: &[&str]) -> Output {
        ops_as(Some("bob"), db, args)
    }

    fn ops_as(actor: Option<&str>, db: &str, args: &[&str]) -> Output {
        let mut cmd = idemd();
        cmd.args(["ops", "--database-url", db]).args(args).env("USER", "bob").env_remove("IDEM_ACTOR");
        if let Some(a) = actor {
            cmd.env("IDEM_ACTOR", a);
        }
        cmd.output().expect("run")
    }

    fn text(o: &Output) -> String {
        format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
    }

    /// An operation that needs review, in a fresh SQLite file; its subject is `u`'s hash.
    fn needs_review(dir: &std::path::Path) -> (String, String) {
        needs_review_of(dir, "u")
    }

    /// The request id of the operation `needs_review_of` makes, as the client sent it.
    const AS_SENT: &str = "trace cli-1 é";

    fn needs_review_of(dir: &std::path::Path, subject_hash: &str) -> (String, String) {
        let db = format!("sqlite://{}/idem.db?mode=rwc", dir.display());
        let key = idemd::store::new_owner();
        let rt = tokio::runtime::Runtime::new().expect("rt");
        rt.block_on(async {
            let opts = idemd::store::sql::SqlOptions::default();
            let sql = idemd::store::sql::SqlStore::connect(&db, &opts).await.expect("sqlite");
            let settings =
                idemd::store::StoreSettings { lease_ms: 1, terminal_retention_ms: 60_000, stale_in_flight_ms: 1_000 };
            let store = idemd::store::Store::new(sql, None, settings, Default::default());
            let req = AcquireRequest {
                key: idem_core::protocol::OpKey::parse(&key).expect("key"),
                param_hash: "p".into(),
                subject_hash: subject_hash.into(),
                scope: "payments.manual".into(),
                lease_ms: 0,
                // As idemd's API keeps the request id an agent's reply carried (`api::safe_trace_id`).
                trace_id: idemd::api::safe_trace_id(AS_SENT),
                mode: Default::default(),
                exp: None,
                upstream_ignores_keys: false,
                business_ref: None,
                fields: None,
                approval: None,
            };
            assert_eq!(store.acquire(&req).await.outcome, AcquireOutcome::Acquired);
            let rec = store.sql().get(&key).await.expect("get").expect("row");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            let token = idemd::store::new_owner();
            let now = idemd::store::now_ms();
            assert!(store.sql().claim(&rec, &token, now + 1_000, now).await.expect("claim"));
            let audit = idemd::store::sql::audit::Audit {
                actor: "reconciler:test",
                action: "reconcile_needs_review",
                why: "no endpoint",
                trace_id: "",
            };
            assert!(store.sql().mark_needs_review(&rec, &token, now, &audit).await.expect("review"));
        });
        (db, key)
    }

    #[test]
    fn list_show_resolve_and_their_exit_codes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (db, key) = needs_review(dir.path());

        let o = ops(&db, &["list", "--state", "needs_review"]);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        let t = text(&o);
        assert!(t.starts_with("KEY "), "{t}");
        assert!(t.contains(&key) && t.contains("NEEDS_REVIEW") && t.contains("(1 row)"), "{t}");
        let o = ops(&db, &["list", "--state", "done"]);
        assert!(text(&o).contains("(0 rows)"));

        let o = ops(&db, &["resolve", &key, "--release"]);
        assert_eq!(o.status.code(), Some(2), "--why is required: {}", text(&o));
        assert!(text(&o).contains("--why"));
        let o = ops(&db, &["resolve", &key, "--done", "--why", "x"]);
        assert_eq!(o.status.code(), Some(2), "--done needs --result-file: {}", text(&o));
        let o = ops(&db, &["resolve", &key, "--done", "--release", "--why", "x"]);
        assert_eq!(o.status.code(), Some(2), "one decision at a time: {}", text(&o));
        let o = ops(&db, &["show", "not\na key"]);
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        let o = ops(&db, &["show", "not a key"]);
        assert_eq!(o.status.code(), Some(3), "a trace id with spaces, unknown: {}", text(&o));
        let o = ops(&db, &["show", "NOT-A-KEY"]);
        assert_eq!(o.status.code(), Some(3), "an unknown trace id: {}", text(&o));
        assert!(text(&o).contains("no operation with trace id NOT-A-KEY"), "{}", text(&o));
        let o = ops(&db, &["show", &idemd::store::new_owner()]);
        assert_eq!(o.status.code(), Some(3), "unknown key: {}", text(&o));

        let body = dir.path().join("result.json");
        std::fs::write(&body, "not json").expect("write");
        let body_arg = body.display().to_string();
        let o = ops(&db, &["resolve", &key, "--done", "--result-file", &body_arg, "--why", "ledger"]);
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        assert!(text(&o).contains("is not JSON"));

        std::fs::write(&body, r#"{"transfer_id":"t_7"}"#).expect("write");
        let o = ops(
            &db,
            &[
                "resolve",
                &key,
                "--done",
                "--result-file",
                &body_arg,
                "--status",
                "201",
                "--why",
                "found t_7 in the ledger",
            ],
        );
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        assert!(text(&o).contains(&format!("{key}: NEEDS_REVIEW -> DONE")), "{}", text(&o));

        let o = ops(&db, &["resolve", &key, "--release", "--why", "again"]);
        assert_eq!(o.status.code(), Some(3), "{}", text(&o));
        assert!(text(&o).contains("is DONE"));

        let o = ops(&db, &["show", &key]);
        assert_eq!(o.status.code(), Some(0));
        let t = text(&o);
        assert!(t.contains("state        DONE"), "{t}");
        assert!(t.contains("HTTP 201 (application/json)") && t.contains(r#"{"transfer_id":"t_7"}"#), "{t}");
        let lines: Vec<&str> = t.lines().skip_while(|l| *l != "history").skip(1).collect();
        assert_eq!(lines.len(), 3, "{t}");
        assert!(
            lines[0].contains("filter") && lines[0].contains("acquire") && lines[0].contains("(none) -> IN_FLIGHT")
        );
        assert!(lines[1].contains("reconciler:test") && lines[1].contains("IN_FLIGHT -> NEEDS_REVIEW"));
        assert!(lines[2].contains("operator:bob") && lines[2].contains("resolve_done"));
        assert!(lines[2].contains("NEEDS_REVIEW -> DONE") && lines[2].ends_with("found t_7 in the ledger"));
        // The trace id a reply carried finds the same operation, and the filter's line names it.
        // A request id with a space and a non-ASCII letter is kept percent-encoded; the operator finds
        // the operation by either spelling: as the agent's reply said it, or as the audit shows it.
        assert!(lines[0].ends_with("[trace trace%20cli-1%20%C3%A9]"), "{t}");
        for spelling in [AS_SENT, "trace%20cli-1%20%C3%A9"] {
            let by_trace = ops(&db, &["show", spelling]);
            assert_eq!(by_trace.status.code(), Some(0), "{spelling}: {}", text(&by_trace));
            assert_eq!(text(&by_trace), t);
        }
    }

    /// A person never settles an operation of their own subject, whichever surface they use: the
    /// operator names themselves (no $USER: often a shared account), and `--actor` is compared,
    /// hashed as the gateway hashes subjects, with the operation's subject (DESIGN §4).
    #[test]
    fn an_operator_names_themselves_and_never_settles_their_own_operation() {
        let dir = tempfile::tempdir().expect("tempdir");
        let own = idem_core::fingerprint::subject_hash("user-bob");
        let (db, key) = needs_review_of(dir.path(), &own);
        let release = ["resolve", key.as_str(), "--release", "--why", "not in the ledger"];

        let o = ops_as(None, &db, &release);
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        assert!(text(&o).contains("resolve needs --actor"), "{}", text(&o));

        let failed = ["resolve", key.as_str(), "--failed", "--reason", "payee closed", "--why", "bank said so"];
        for args in [&release[..], &failed[..]] {
            let o = ops_as(Some("user-bob"), &db, args);
            assert_eq!(o.status.code(), Some(3), "{args:?}: {}", text(&o));
            assert!(text(&o).contains("own_subject"), "{}", text(&o));
        }
        let o = ops(&db, &["show", &key, "--json"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
        assert_eq!(v["operation"]["state"], "NEEDS_REVIEW", "nothing changed: {v}");
        assert_eq!(v["history"].as_array().map(Vec::len), Some(2), "no resolve line: {v}");

        // Another person may; the trail names them.
        let o = ops_as(Some("user-carol"), &db, &release);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        let o = ops(&db, &["show", &key]);
        let t = text(&o);
        assert!(t.contains("operator:user-carol") && t.contains("resolve_release"), "{t}");
        assert!(t.contains("no status endpoint for scope payments.manual: released on the person's word"), "{t}");
    }

    /// Security events in a fresh SQLite file, as the filter's reports and
    /// idemd's own PARAM_MISMATCH write them; one backdated by two hours.
    fn security_events(dir: &std::path::Path) -> (String, String) {
        use idem_core::protocol::SecurityKind;
        use idemd::store::sql::audit::SecurityEvent;
        let db = format!("sqlite://{}/idem.db?mode=rwc", dir.display());
        let key = idemd::store::new_owner();
        let rt = tokio::runtime::Runtime::new().expect("rt");
        rt.block_on(async {
            let sql = idemd::store::sql::SqlStore::connect(&db, &Default::default()).await.expect("sqlite");
            let event = |kind, key: Option<&str>, trace: &str| SecurityEvent {
                actor: "filter",
                kind,
                scope: "payments.transfer".into(),
                key: key.map(str::to_string),
                subject_hash: "5f2b0c1e9d8a7b6c5f2b0c1e9d8a7b6c".into(),
                trace_id: trace.into(),
                why: format!("{kind} on scope payments.transfer: test"),
            };
            let now = idemd::store::now_ms();
            let old = event(SecurityKind::UnknownKid, None, "trace-old");
            sql.record_event(&old, now - 2 * 3_600_000).await.expect("old");
            sql.record_event(&event(SecurityKind::ParamsChanged, Some(&key), "trace-tamper"), now - 2_000)
                .await
                .expect("tamper");
            sql.record_event(&event(SecurityKind::BadSignature, None, ""), now - 1_000).await.expect("forged");
        });
        (db, key)
    }

    #[test]
    fn events_newest_first_by_kind_and_since() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (db, key) = security_events(dir.path());

        let o = ops(&db, &["events"]);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        let t = text(&o);
        let lines: Vec<&str> = t.lines().collect();
        assert!(
            lines[0].starts_with("TIME (UTC)") && lines[0].contains("KIND") && lines[0].contains("TRACE ID"),
            "{t}"
        );
        assert_eq!(lines.len(), 5, "a header, three events, a count: {t}");
        assert!(lines[1].contains("bad_signature") && lines[1].contains(" - ") && lines[1].ends_with(" -"), "{t}");
        assert!(lines[2].contains("params_changed") && lines[2].contains(&key), "{t}");
        assert!(lines[2].contains("payments.transfer") && lines[2].ends_with("trace-tamper"), "{t}");
        assert!(lines[3].contains("unknown_kid") && lines[3].ends_with("trace-old"), "{t}");
        assert_eq!(lines[4], "(3 events)");

        let o = ops(&db, &["events", "--since", "1h", "--json"]);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
        let kinds: Vec<&str> = v.as_array().expect("array").iter().filter_map(|e| e["kind"].as_str()).collect();
        assert_eq!(kinds, ["bad_signature", "params_changed"], "the two-hour-old one is left out: {v}");
        assert_eq!(v[0]["key"], serde_json::Value::Null, "a forgery names no operation: {v}");
        assert_eq!(v[1]["key"], key.as_str());
        assert_eq!(v[1]["trace_id"], "trace-tamper");
        assert_eq!(v[1]["subject_hash"], "5f2b0c1e9d8a7b6c5f2b0c1e9d8a7b6c");
        assert_eq!(v[1]["scope"], "payments.transfer");
        assert_eq!(v[1]["actor"], "filter");
        assert!(v[1]["at"].as_str().is_some_and(|a| a.ends_with('Z')), "{v}");

        let o = ops(&db, &["events", "--kind", "unknown_kid", "--json"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
        assert_eq!(v.as_array().map(Vec::len), Some(1), "{v}");
        assert_eq!(v[0]["trace_id"], "trace-old");
        let o = ops(&db, &["events", "--kind", "bad_signature", "--since", "90s"]);
        assert!(text(&o).contains("(1 event)"), "{}", text(&o));

        // The event is in its operation's history; `show` by a forgery's (empty) trace finds nothing.
        let o = ops(&db, &["show", &key]);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        assert!(text(&o).contains("no row") && text(&o).contains("security_event"), "{}", text(&o));

        for bad in [&["events", "--kind", "tampering"][..], &["events", "--since", "ten minutes"][..]] {
            let o = ops(&db, bad);
            assert_eq!(o.status.code(), Some(2), "{bad:?}: {}", text(&o));
        }
        let o = ops(&db, &["events", "--kind", "tampering"]);
        assert!(text(&o).contains("params_changed, cross_subject, bad_signature, unknown_kid"), "{}", text(&o));
    }
}
