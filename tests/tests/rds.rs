//! Routes that change while Envoy runs (RDS from a watched file, envoy/e2e-rds.yaml):
//! a re-annotated route is guarded by its new annotation at once, never by the
//! one the filter cached before (DESIGN §6: the per-VM policy cache is keyed by
//! the annotation's bytes, never by the route's name).

use idem_e2e::*;
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};

/// e2e-rds.yaml as committed: its routes file (and the directory watched for it) are relative to
/// the repository's root, so Envoy validates it from there (the other configs name no relative path,
/// and every_envoy_config_validates does not list this one). Nothing else in this file depends on
/// the working directory.
#[test]
fn the_rds_config_validates_with_its_committed_routes() -> TestResult {
    std::env::set_current_dir(repo_root())?;
    let (ok, out) = validate_envoy_config("e2e-rds.yaml")?;
    assert!(ok, "envoy --mode validate e2e-rds.yaml failed:\n{out}");
    Ok(())
}

const BIND: &str = "/amount:decimal, /currency:string, /payee_id:string";

/// The route table envoy/e2e-rds.yaml loads, as a DiscoveryResponse: the same
/// routes as envoy/e2e-rds-routes.yaml (version 1), with `transfer_confirm` now
/// annotated as a confirm of `confirm_scope`. JSON, which Envoy's YAML loader reads.
fn route_table(version: u32, confirm_scope: &str) -> String {
    let table = json!({
        "version_info": version.to_string(),
        "resources": [{
            "@type": "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
            "name": "transfers",
            "virtual_hosts": [{
                "name": "transfers",
                "domains": ["*"],
                "include_attempt_count_in_response": true,
                "routes": [
                    {
                        "name": "rds_version",
                        "match": {"path": "/rds-version"},
                        "direct_response": {"status": 200, "body": {"inline_string": version.to_string()}}
                    },
                    {
                        "name": "transfer_preview",
                        "match": {"path": "/v1/transfers/preview"},
                        "route": {"cluster": "demo"},
                        "metadata": {"filter_metadata": {"agent_idempotency": {
                            "role": "preview", "scope": "payments.transfer", "bind": BIND
                        }}}
                    },
                    {
                        "name": "transfer_confirm",
                        "match": {"path": "/v1/transfers", "headers": [{"name": ":method", "string_match": {"exact": "POST"}}]},
                        "route": {"cluster": "demo", "timeout": "15s"},
                        "metadata": {"filter_metadata": {"agent_idempotency": {
                            "role": "confirm", "upstream_keys": "honoured", "scope": confirm_scope, "bind": BIND,
                            "status_tool": "get_transfer_status", "result_ref": "/transfer_id"
                        }}}
                    },
                    {
                        "name": "no_route",
                        "match": {"prefix": "/"},
                        "direct_response": {"status": 404, "body_format": {"json_format": {"status": "no_such_route"}}}
                    }
                ]
            }]
        }]
    });
    table.to_string()
}

/// Replace the routes file atomically (a temporary file in the watched
/// directory, renamed over it) and wait until Envoy's worker routes with it.
async fn publish(stack: &Stack, dir: &Path, version: u32, table: &str) -> TestResult {
    let next = dir.join(".routes.yaml.next");
    std::fs::write(&next, table)?;
    std::fs::rename(&next, dir.join("routes.yaml"))?;
    wait_for_version(stack, version).await
}

/// Until the admin's config dump shows `version` and the listener routes with
/// it (its `/rds-version` route answers `version`: the same route table, so the
/// same annotations, as every other request on that worker).
async fn wait_for_version(stack: &Stack, version: u32) -> TestResult {
    let want = version.to_string();
    let dump_url = format!("http://127.0.0.1:{}/config_dump?resource=dynamic_route_configs", stack.ports.admin);
    let deadline = Instant::now() + Duration::from_secs(20);
    let (mut dumped, mut served) = (Vec::new(), String::new());
    while Instant::now() < deadline {
        let dump: Value = stack.http.get(&dump_url).send().await?.json().await?;
        dumped = dump["configs"]
            .as_array()
            .map(|c| c.iter().filter_map(|c| c["version_info"].as_str().map(str::to_owned)).collect())
            .unwrap_or_default();
        if dumped.contains(&want) {
            served = stack.http.get(stack.url("/rds-version")).send().await?.text().await?;
            if served == want {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rejected = stack.stat("http.agents.rds.transfers.update_rejected").await?;
    Err(format!(
        "Envoy did not apply route table version {want} within 20 s: config_dump has {dumped:?}, \
         /rds-version answers {served:?}, rds update_rejected = {rejected}\n{}",
        stack.envoy.log_text()
    )
    .into())
}

async fn confirm(stack: &Stack, fp: &str, amount: Value, client_key: &str) -> Result<Answer, BoxError> {
    let headers = [("agent-fingerprint", fp), ("idempotency-key", client_key)];
    stack.post("/v1/transfers", SUBJECT, &transfer(amount, "confirm"), &headers).await
}

/// One route, `transfer_confirm`, re-annotated three times over RDS without
/// restarting Envoy: unannotated (passes untouched), a confirm of
/// `payments.transfer` (guarded at once), a confirm of `payments.refund` (the
/// fingerprint minted for the old scope is refused), and back.
#[tokio::test]
async fn a_reannotated_route_is_guarded_by_its_new_annotation_at_once() -> TestResult {
    // Version 1 is the committed routes file, in a directory of the test's own that Envoy watches.
    let routes = tempfile::tempdir()?;
    let routes_file = routes.path().join("routes.yaml");
    std::fs::copy(repo_root().join("envoy/e2e-rds-routes.yaml"), &routes_file)?;
    let mut opts = sqlite_only(false);
    opts.envoy_config = "e2e-rds.yaml";
    opts.envoy_edits = vec![
        ("path: envoy/e2e-rds-routes.yaml".into(), format!("path: {}", routes_file.display())),
        (
            "watched_directory: { path: envoy }".into(),
            format!("watched_directory: {{ path: {} }}", routes.path().display()),
        ),
    ];
    let stack = Stack::start(opts).await?;
    wait_for_version(&stack, 1).await?;

    // 1. Unannotated: the client's own key reaches the demo, which executes.
    let plain =
        stack.post("/v1/transfers", SUBJECT, &transfer(json!(1), "unguarded"), &[("idempotency-key", "k-1")]).await?;
    assert_eq!(plain.status, 201, "version 1 does not guard transfer_confirm: {plain:?}");
    assert_eq!(plain.json["idempotency_key"], "k-1", "{plain:?}");
    assert_eq!(counts(&stack).await?, (1, 1));

    // 2. The same route, now a confirm: guarded from the first request on.
    publish(&stack, routes.path(), 2, &route_table(2, "payments.transfer")).await?;
    let missing = stack.post("/v1/transfers", SUBJECT, &transfer(json!(2), "no fingerprint"), &[]).await?;
    assert_eq!(missing.status, 428, "version 2 guards transfer_confirm: {missing:?}");
    missing.assert_prompt("fingerprint_missing");
    let keyed =
        stack.post("/v1/transfers", SUBJECT, &transfer(json!(2), "own key"), &[("idempotency-key", "k-0")]).await?;
    assert_eq!(keyed.status, 428, "a client key is no fingerprint on a confirm route: {keyed:?}");
    assert_eq!(counts(&stack).await?, (1, 1), "nothing reached the demo");

    let (_, fp) = stack.preview(json!("3.00")).await?;
    assert_eq!(fingerprint_claims(&fp)?["s"], "payments.transfer");
    let first = confirm(&stack, &fp, json!(3), "k-2").await?;
    assert_eq!(first.status, 201, "{first:?}");
    let again = confirm(&stack, &fp, json!(3), "k-3").await?;
    assert_eq!(again.status, 201, "{again:?}");
    again.assert_prompt("already_completed");
    assert_eq!(again.json["result"], first.json);
    let ledger = stack.executions().await?;
    assert_eq!(ledger["attempts_by_key"][nonce_of(&fp)?.as_str()], 1, "{ledger}");
    assert_eq!(ledger["attempts_by_key"]["k-1"], 1, "{ledger}");
    for client in ["k-0", "k-2", "k-3"] {
        assert!(ledger["attempts_by_key"].get(client).is_none(), "a client key reached the demo: {ledger}");
    }
    assert_eq!(counts(&stack).await?, (2, 2));

    // 3. Re-annotated with another scope: the fingerprint minted for payments.transfer is refused,
    //    neither executed nor replayed.
    let invalid_before = stack.stat("wasmcustom.idem.rejected.fingerprint_invalid").await?;
    publish(&stack, routes.path(), 3, &route_table(3, "payments.refund")).await?;
    let refused = confirm(&stack, &fp, json!(3), "k-4").await?;
    assert_eq!(refused.status, 400, "the old scope's fingerprint on the re-scoped route: {refused:?}");
    refused.assert_prompt("fingerprint_invalid");
    assert_eq!(stack.stat("wasmcustom.idem.rejected.fingerprint_invalid").await?, invalid_before + 1);
    let missing = stack.post("/v1/transfers", SUBJECT, &transfer(json!(4), "no fingerprint"), &[]).await?;
    assert_eq!(missing.status, 428, "version 3 still guards transfer_confirm: {missing:?}");
    assert_eq!(counts(&stack).await?, (2, 2), "nothing executed under version 3");

    // 4. Back to payments.transfer: the scope was the only difference, and the operation is answered as done.
    publish(&stack, routes.path(), 4, &route_table(4, "payments.transfer")).await?;
    let back = confirm(&stack, &fp, json!(3), "k-5").await?;
    assert_eq!(back.status, 201, "{back:?}");
    back.assert_prompt("already_completed");
    assert_eq!(counts(&stack).await?, (2, 2));
    // The initial load and one reload per rename: Envoy neither missed a version nor applied one twice.
    assert_eq!(stack.stat("http.agents.rds.transfers.config_reload").await?, 4);
    Ok(())
}
