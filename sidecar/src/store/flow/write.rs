//! The filter's writes after an acquire: complete, release and renew, SQL first (owner-checked),
//! then Redis; and the operation as `GET /v1/operations/{key}` reads it.

use idem_core::protocol::{
    Ack, CompleteRequest, LeaseRenewal, NotFoundView, OperationView, ReleaseRequest, WithApproval,
};
use tracing::{debug, warn};

use super::acquire::{evict, Settings, FILTER};
use super::{Call, Note, Port, Said, SqlFail};
use crate::store::redis::WriteReply;
use crate::store::{retention, rules, view};

pub async fn complete(io: Port, req: CompleteRequest, s: Settings) -> Ack {
    let result_json = match serde_json::to_string(&req.result) {
        Ok(j) => j,
        Err(e) => {
            warn!(key = %req.key, error = %e, "result does not serialize");
            return Ack::StoreUnavailable;
        }
    };
    let now = io.now().await;
    let said = Said {
        actor: FILTER.into(),
        action: "complete",
        why: format!("upstream answered {}", req.result.status),
        trace_id: req.trace_id.clone(),
    };
    let call = Call::SqlComplete {
        key: req.key.to_string(),
        owner: req.owner.to_string(),
        state: req.state,
        result_json: result_json.clone(),
        now_ms: now,
        said,
    };
    match io.sql_changed(call).await {
        Ok(true) => {}
        Ok(false) => {
            // The filter may retry a complete whose answer it lost: the same owner with the same
            // outcome is a success, not a conflict.
            match io.sql_row(&req.key).await {
                Ok(Some(rec)) if rules::is_repeat(&rec, req.owner.as_str(), req.state, &req.result) => {}
                Ok(_) => return Ack::NotOwner,
                Err(_) => return Ack::StoreUnavailable,
            }
        }
        Err(e) => {
            warn!(key = %req.key, error = %e, "SQL complete failed: STORE_UNAVAILABLE");
            return Ack::StoreUnavailable;
        }
    }
    let call = Call::RedisComplete {
        key: req.key.to_string(),
        owner: req.owner.to_string(),
        state: req.state,
        result_json,
        retention_ms: s.store.terminal_retention_ms,
    };
    if let Some(WriteReply::NotOwner) = io.redis_write(call).await {
        // The cache holds some other attempt's view; SQL has the truth. Drop the copy so the
        // next acquire refills it from the row.
        debug!(key = %req.key, "Redis disagreed with SQL on complete; evicting");
        evict(&io, &req.key).await;
    }
    Ack::Ok
}

pub async fn release(io: Port, req: ReleaseRequest) -> Ack {
    let said = Said {
        actor: FILTER.into(),
        action: "release",
        why: "the request never reached the upstream".into(),
        trace_id: req.trace_id.clone(),
    };
    let call = Call::SqlRelease { key: req.key.to_string(), owner: req.owner.to_string(), said };
    match io.sql_changed(call).await {
        Ok(true) => {}
        Ok(false) => return Ack::NotOwner,
        Err(e) => {
            warn!(key = %req.key, error = %e, "SQL release failed: STORE_UNAVAILABLE");
            return Ack::StoreUnavailable;
        }
    }
    // NOT_OWNER here means the cache holds another attempt's gate or a stale copy; either
    // resolves against SQL on the next acquire.
    io.redis_write(Call::RedisRelease { key: req.key.to_string(), owner: req.owner.to_string() }).await;
    Ack::Ok
}

/// One lease of a `POST /v1/renew`: for the longer of the route's lease and the configured one,
/// as at acquire; SQL decides (the reconciler claims by SQL's lease), Redis follows. `Ok(false)`:
/// the owner no longer holds it. `Err`: SQL could not be asked.
pub async fn renew(io: Port, lease: LeaseRenewal, s: Settings) -> Result<bool, SqlFail> {
    let lease_ms = lease.lease_ms.max(s.store.lease_ms);
    let until = io.now().await.saturating_add(i64::try_from(lease_ms).unwrap_or(i64::MAX));
    let call = Call::SqlRenew { key: lease.key.to_string(), owner: lease.owner.to_string(), until_ms: until };
    let renewed = io.sql_changed(call).await?;
    io.note(Note::LeaseRenewal(renewed));
    if !renewed {
        debug!(key = %lease.key, "renewal for an owner that no longer holds the lease");
        return Ok(false);
    }
    io.redis_write(Call::RedisRenew { key: lease.key.to_string(), owner: lease.owner.to_string(), lease_ms }).await;
    Ok(true)
}

/// What `GET /v1/operations/{key}` answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// 200: the row as SQL (the truth) has it.
    Found(OperationView),
    /// 404: nothing executed (or it was reaped: `reaped_possible`, from the fingerprint's `exp`);
    /// with the approval row, where a person is (or was) asked.
    NotFound(WithApproval<NotFoundView>),
    /// 503: SQL could not answer.
    Unavailable,
}

pub async fn lookup(io: Port, key: String, exp: Option<u64>, s: Settings) -> Lookup {
    match io.sql_row(&key).await {
        Ok(Some(rec)) => Lookup::Found(view(rec)),
        Ok(None) => {
            let now = io.now().await;
            let reaped_possible =
                exp.is_some_and(|exp| retention::reaped_possible(exp, now, s.store.terminal_retention_ms));
            // Nothing executed; a person may be (or have been) asked about it.
            match io.sql_approval(&key).await {
                Ok(approval) => {
                    let answer = NotFoundView { error: "not_found".into(), reaped_possible };
                    let approval = approval.and_then(|r| r.view(s.console.as_deref()));
                    Lookup::NotFound(WithApproval { answer, approval })
                }
                Err(_) => Lookup::Unavailable,
            }
        }
        Err(_) => Lookup::Unavailable,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::flow::acquire::tests::{settings, KEY, OWNER};
    use crate::store::flow::{Flow, Reply, SqlAnswer};
    use crate::store::record::Record;
    use idem_core::protocol::{OpState, StoredResult};

    /// A renewal where SQL's owner-checked write answers `changed`: what it returned and every call.
    fn renew_with(changed: bool) -> (Result<bool, SqlFail>, Vec<Call>) {
        let mut calls = Vec::new();
        let lease: LeaseRenewal =
            serde_json::from_value(serde_json::json!({"key": KEY, "owner": OWNER, "lease_ms": 50_000}))
                .unwrap_or_else(|e| panic!("a lease: {e}"));
        let got = Flow::new(|io| async move { renew(io, lease, settings()).await }).run_with(|call| {
            let reply = match &call {
                Call::Now => Reply::Now(1_000),
                Call::SqlRenew { .. } => Reply::Sql(Ok(SqlAnswer::Changed(changed))),
                _ => Reply::Write(WriteReply::Ok),
            };
            calls.push(call);
            reply
        });
        (got, calls)
    }

    /// SQL decides a renewal (the reconciler claims by SQL's lease), for the longer of the route's and
    /// the configured lease; Redis follows only a renewal SQL took.
    #[test]
    fn a_renewal_is_sqls_and_redis_follows_it() {
        let (renewed, calls) = renew_with(true);
        assert_eq!(renewed, Ok(true));
        let until = calls.iter().find_map(|c| match c {
            Call::SqlRenew { until_ms, .. } => Some(*until_ms),
            _ => None,
        });
        assert_eq!(until, Some(1_000 + 50_000), "the route's lease, longer than the configured 30 s");
        assert!(calls.iter().any(|c| matches!(c, Call::RedisRenew { lease_ms: 50_000, .. })), "{calls:?}");
        let (renewed, calls) = renew_with(false);
        assert_eq!(renewed, Ok(false), "the owner no longer holds it");
        assert!(!calls.iter().any(|c| matches!(c, Call::RedisRenew { .. })), "{calls:?}");
    }

    /// A complete SQL did not take is a success only when it repeats what the row holds (the filter
    /// retried one whose answer it lost): the same owner, state and result. Anything else is NOT_OWNER.
    #[test]
    fn a_complete_not_taken_is_ok_only_as_a_repeat() {
        let result = StoredResult { status: 201, headers: vec![], body_b64: "e30=".into() };
        let req: CompleteRequest = serde_json::from_value(serde_json::json!({
            "key": KEY, "owner": OWNER, "state": "DONE", "result": result }))
        .unwrap_or_else(|e| panic!("a complete: {e}"));
        let done = Record {
            state: OpState::Done,
            owner: Some(OWNER.into()),
            result: Some(result.clone()),
            ..crate::reconcile::decide::tests::rec(0, 0)
        };
        let failed = Record { state: OpState::Failed, ..done.clone() };
        let another = Record { owner: Some("another".into()), ..done.clone() };
        for (row, want) in [(done, Ack::Ok), (failed, Ack::NotOwner), (another, Ack::NotOwner)] {
            let req = req.clone();
            let state = (row.state, row.owner.clone());
            let got = Flow::new(|io| async move { complete(io, req, settings()).await }).run_with(|call| match call {
                Call::Now => Reply::Now(1_000),
                Call::SqlComplete { .. } => Reply::Sql(Ok(SqlAnswer::Changed(false))),
                Call::SqlGet { .. } => Reply::Sql(Ok(SqlAnswer::Row(Some(row.clone())))),
                _ => Reply::Write(WriteReply::Ok),
            });
            assert_eq!(got, want, "{state:?}");
        }
    }
}
