//! `idemd serve`: open both stores, start the reconciler and the reaper, then
//! answer the filter until SIGTERM/SIGINT.

use std::sync::Arc;

use tokio::net::TcpListener;
use tracing::info;

use crate::auth::Tokens;
use crate::config::{ReconcileArgs, ServeArgs, StoreArgs, TtlArgs};
use crate::metrics::Metrics;
use crate::probe::Probe;
use crate::reaper::Reaper;
use crate::reconcile::{Lookups, ReconcileSettings, Reconciler};
use crate::redact::redact_url;
use crate::store::redis::{RedisOptions, RedisStore};
use crate::store::sql::{SqlOptions, SqlStore};
use crate::store::{Store, StoreSettings};

/// Why idemd did not start or stopped. `Config` exits with 2 like a usage
/// error: restarting will not help until someone changes the configuration.
#[derive(Debug)]
pub enum Failure {
    Config(String),
    Runtime(String),
}

impl Failure {
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Config(_) => 2,
            Self::Runtime(_) => 1,
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Config(m) | Self::Runtime(m) => f.write_str(m),
        }
    }
}

/// Both stores, connected (SQL) and migrated; Redis connects on first use.
pub async fn open_store(stores: &StoreArgs, ttl: &TtlArgs) -> Result<Store, Failure> {
    if let Err(broken) = ttl.validate() {
        return Err(Failure::Config(broken.join("\n")));
    }
    let sql_opts = SqlOptions {
        max_connections: stores.sql_max_connections,
        timeout: stores.sql_timeout(),
        wait_for_standbys: !stores.accept_async_failover_risk,
    };
    let sql = SqlStore::connect(&stores.database_url, &sql_opts).await.map_err(|e| match e {
        crate::store::sql::SqlError::Config(m) => Failure::Config(m),
        other => Failure::Runtime(format!("SQL store {}: {other}", redact_url(&stores.database_url))),
    })?;
    let redis = match &stores.redis_url {
        None => None,
        Some(url) => Some(
            RedisStore::open(&RedisOptions {
                url: url.clone(),
                cluster: stores.redis_cluster,
                timeout: stores.redis_timeout(),
                retry: stores.redis_retry(),
            })
            .map_err(|e| Failure::Config(format!("--redis-url {}: {e}", redact_url(url))))?,
        ),
    };
    let settings = StoreSettings {
        lease_ms: ttl.lease_ms,
        terminal_retention_ms: ttl.terminal_retention_ms(),
        // A live acquirer inserts its row within one SQL call of taking the
        // Redis gate; twice that, plus slack, is certainly stale.
        stale_in_flight_ms: stores.sql_timeout_ms.saturating_mul(2).saturating_add(1_000),
    };
    let store = Store::new(sql, redis, settings, Arc::new(Metrics::new()))
        .accepting_async_failover_risk(stores.accept_async_failover_risk);
    Ok(store)
}

/// The start-up line that says what the database promises and what idemd therefore accepts.
pub fn replication_line(store: &Store) -> String {
    use crate::store::sql::replication::Mode;
    let r = store.sql().replication();
    let accepts = match (r.mode, store.accepts_async_failover_risk()) {
        (Mode::Single | Mode::Sync, _) => "every route".to_string(),
        (Mode::IdemdWaits, _) => {
            "every route (each write and each read is answered once its standbys have flushed it)".to_string()
        }
        (Mode::Standby, _) => "nothing (a standby takes no writes)".to_string(),
        (Mode::Async | Mode::Unknown, false) => {
            "routes whose upstream honours keys; acquires for upstreams that ignore keys are refused (a failover \
             could lose them)"
                .to_string()
        }
        (Mode::Async | Mode::Unknown, true) => "every route, with --accept-async-failover-risk: a failover may run \
             an operation of an upstream that ignores keys twice"
            .to_string(),
    };
    format!("idemd database replication: {} ({}); accepting {accepts}", r.mode.as_str(), r.detail)
}

/// The API's credentials, or why idemd must not start.
pub fn tokens(args: &ServeArgs) -> Result<Tokens, Failure> {
    let given: Vec<String> = args.auth_tokens.iter().filter(|t| !t.trim().is_empty()).cloned().collect();
    match (given.is_empty(), args.insecure_no_auth) {
        (true, false) => Err(Failure::Config(
            "no API token: set IDEM_AUTH_TOKENS (or --auth-tokens) and the same token in the filter's \
             sidecar_token; an idemd without one would let anyone read results and take over leases. \
             For local development only, --insecure-no-auth serves without a token."
                .into(),
        )),
        (false, true) => {
            Err(Failure::Config("--insecure-no-auth and --auth-tokens contradict each other: choose one".into()))
        }
        (true, true) => {
            tracing::warn!(
                "--insecure-no-auth: the API answers anyone who can reach it; never run like this in production"
            );
            eprintln!("WARNING: idemd --insecure-no-auth: the API answers anyone who can reach it");
            Ok(Tokens::default())
        }
        (false, false) => Tokens::new(&given).map_err(Failure::Config),
    }
}

pub async fn run(args: ServeArgs) -> Result<(), Failure> {
    args.validate().map_err(|broken| Failure::Config(broken.join("\n")))?;
    // One set of status endpoints: the reconciler's, and what a person's release asks (review).
    let lookups = args
        .reconcile
        .status
        .lookups(args.reconcile.reconcile_retry_budget)
        .map_err(|broken| Failure::Config(broken.join("\n")))?;
    let tokens = tokens(&args)?;
    let approvers = crate::approvals::Approvers::new(&args.approvers, &args.auth_tokens, args.allow_self_approval)
        .map_err(Failure::Config)?;
    let store = Arc::new(open_store(&args.stores, &args.ttl).await?.with_console(args.approval_console_url.clone()));
    // Every replica probes, reconciling or not: its own SQL and Redis health is its own.
    tokio::spawn(Probe::new(Arc::clone(&store)).run(args.probe_interval()));
    if args.reconcile.no_reconcile {
        info!("--no-reconcile: serving the API only (no reconciler, no reaper)");
    } else {
        start_background(&store, &args.stores, &args.ttl, &args.reconcile, &lookups);
    }
    let listener = TcpListener::bind(args.listen)
        .await
        .map_err(|e| Failure::Runtime(format!("cannot listen on {}: {e}", args.listen)))?;
    let addr = listener.local_addr().map_err(|e| Failure::Runtime(e.to_string()))?;
    let redis = args.stores.redis_url.as_deref().map(redact_url).unwrap_or_else(|| "off".to_string());
    println!("idemd listening on {addr} (redis: {redis}, sql: {})", store.sql().backend().name());
    // Not println!: a caller that read the first line and closed the pipe must not panic idemd.
    {
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{}", replication_line(&store)).and_then(|()| out.flush());
    }
    let replication = store.sql().replication();
    info!(mode = replication.mode.as_str(), detail = %replication.detail, "SQL replication");
    if store.accepts_async_failover_risk() {
        tracing::warn!(
            "--accept-async-failover-risk: on an asynchronous topology, operations of upstreams that ignore keys are \
             acquired although a failover can lose the acquire and run them twice"
        );
    }
    info!(%addr, lease_ms = args.ttl.lease_ms, retention_s = args.ttl.terminal_retention_s, "serving");

    // Small JSON answers on keep-alive connections: without NODELAY, Nagle
    // and delayed ACKs add tens of milliseconds per callout.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let metrics = Arc::clone(store.metrics());
    let api = crate::api::router_with(store, tokens, approvers, Some(lookups));
    let api = match &args.ext_proc.ext_proc {
        Some(addr) => start_ext_proc(*addr, &args.ext_proc, api, &metrics).await?,
        None => api,
    };
    axum::serve(listener, api)
        .with_graceful_shutdown(shutdown_signal())
        .await
        .map_err(|e| Failure::Runtime(format!("server: {e}")))
}

/// Bind and start the ext_proc host; the API gains its counters (`/ext-proc/stats`, and `/metrics`'s
/// `idem_ext_proc_filter_events_total`).
async fn start_ext_proc(
    addr: std::net::SocketAddr,
    args: &crate::config::ExtProcArgs,
    api: axum::Router,
    metrics: &Metrics,
) -> Result<axum::Router, Failure> {
    let path = args
        .ext_proc_config
        .as_ref()
        .ok_or_else(|| Failure::Config("--ext-proc needs --ext-proc-config (the plugin configuration JSON)".into()))?;
    let config = std::fs::read(path).map_err(|e| Failure::Config(format!("{}: {e}", path.display())))?;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| Failure::Runtime(format!("cannot listen on {addr} (ext_proc): {e}")))?;
    let counters = Arc::new(idem_extproc::Counters::default());
    metrics.ext_proc_counters(Arc::clone(&counters));
    let server = idem_extproc::start(
        listener,
        api.clone(),
        config,
        Arc::clone(&counters),
        args.ext_proc_threads,
        shutdown_signal(),
    )
    .map_err(Failure::Config)?;
    tokio::spawn(async move {
        if let Err(e) = server.await {
            tracing::error!("{e}");
        }
    });
    info!(%addr, "ext_proc serving");
    Ok(api.merge(idem_extproc::stats_router(counters)))
}

/// The reconciler and the reaper, as tasks of this runtime: they stop with it.
fn start_background(store: &Arc<Store>, stores: &StoreArgs, ttl: &TtlArgs, args: &ReconcileArgs, lookups: &Lookups) {
    let scopes: Vec<&str> = lookups.status.scopes().collect();
    let settings = ReconcileSettings {
        rules: lookups.rules.clone(),
        batch: args.reconcile_batch,
        // One lookup plus the claim before it and the decision after it.
        claim_ms: args
            .status
            .status_timeout_ms
            .saturating_add(stores.sql_timeout_ms.saturating_mul(2))
            .saturating_add(1_000),
        instance: args.instance(),
    };
    info!(
        instance = %settings.instance,
        interval_ms = args.reconcile_interval_ms,
        grace_ms = args.status.reconcile_grace_ms,
        retry_budget = args.reconcile_retry_budget,
        ?scopes,
        "reconciler started"
    );
    let reconciler = Arc::new(Reconciler::new(Arc::clone(store), lookups.status.clone(), settings));
    tokio::spawn(reconciler.run(args.interval()));
    let reaper = Reaper::new(Arc::clone(store), ttl.terminal_retention_ms(), args.reaper_batch);
    tokio::spawn(reaper.run(args.reaper_interval()));
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
    info!("shutting down");
}
