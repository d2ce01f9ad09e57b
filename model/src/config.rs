//! What one check explores: the bounds of the world and, for the mutation check, which rule is
//! broken.

pub use idemd::store::rules::Broken;

/// Whether the upstream deduplicates by `Idempotency-Key` (a route's `upstream_keys`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UpstreamKeys {
    /// A retry with the same key gets the first answer; nothing runs twice.
    Honoured,
    /// Every request that reaches it runs (`upstream_keys: ignored`); the reconciler asks by
    /// business reference.
    Ignored,
}

/// A deliberately broken variant: each must be refuted by the checker with a counterexample.
/// `Store` breaks one of idemd's store rules (`sidecar/src/store/rules.rs`); the others break a
/// decision the host makes (the filter glue or idemd's orchestration in this model).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mutation {
    Store(Broken),
    /// The filter refuses an expired fingerprint before asking idemd about its operation.
    ExpiryBeforeLookup,
    /// An answer whose outcome is unknown (a reset, a timeout) releases the operation.
    ReleaseOnUnknown,
    /// idemd answers ACQUIRED when Redis does, without the SQL insert.
    AcquiredByRedisAlone,
    /// The filter caches a non-terminal answer (the `in_progress` of an unknown outcome) as the
    /// operation's result.
    CacheNonTerminal,
    /// A configuration `idemd check` refuses: Envoy waits for the upstream longer than the lease
    /// (the filter's renewals are then all that keeps the lease, and a SQL outage stops them).
    LeaseShorterThanEnvoyWait,
    /// idemd's IN_FLIGHT insert without its `NOT EXISTS` over `idem_approval`
    /// (`rules::acquire_allowed`): only the filter's rule keeps an unapproved operation back.
    /// Checked with approval on.
    AcquireIgnoresApproval,
    /// The approver's decision without its `fp_exp_ms > now` (`rules::decide` given a row whose
    /// `exp` it cannot see): a person decides an approval that lapsed but was not yet swept.
    /// Checked with approval on.
    DecideAfterLapse,
    /// A status reading that does not know the upstream's word for a refusal
    /// (`--status-reading pay=failed=declined` where the endpoint says `"failed"`): the reconciler
    /// reads a committed refusal as executed (`Reading::parse`, `decide`'s default "anything not
    /// failed is done").
    MisdeclaredReading,
}

impl Mutation {
    /// Every variant the mutation check runs.
    pub const ALL: [Mutation; 8] = [
        Mutation::Store(Broken::CompleteWithoutOwnerCheck),
        Mutation::Store(Broken::ReapBeforeExp),
        Mutation::ExpiryBeforeLookup,
        Mutation::ReleaseOnUnknown,
        Mutation::AcquiredByRedisAlone,
        Mutation::CacheNonTerminal,
        Mutation::LeaseShorterThanEnvoyWait,
        Mutation::MisdeclaredReading,
    ];

    /// The mutations of approval, checked with [`Config::approval`] on.
    pub const APPROVAL: [Mutation; 2] = [Mutation::AcquireIgnoresApproval, Mutation::DecideAfterLapse];
}

#[derive(Clone, Debug)]
pub struct Config {
    /// Agent sessions holding the one fingerprint (2: an agent and its re-planned copy).
    pub agents: u8,
    /// Confirms each agent sends (the first and its retries).
    pub confirms: u8,
    /// Status polls each agent may make.
    pub polls: u8,
    /// Faults per run: crashes, outages, lost writes, upstream errors (then the world behaves).
    pub faults: u8,
    /// The clock stops here (seconds since the preview).
    pub horizon_s: u8,
    pub upstream: UpstreamKeys,
    /// `None`: the design as built.
    pub mutation: Option<Mutation>,
    /// Steps the fault-free completion may take from any reachable state to settle.
    pub settle_steps: usize,
    /// Whether the bounded settle check runs on every state (it multiplies the cost per state).
    pub check_settle: bool,
    /// Approval (DESIGN §4, docs/approvals.md): the confirm route asks a person first
    /// (`approval: always`), an approver approves or rejects at any moment (late ones too), and
    /// idemd's lapse sweep runs. `IDEM_MODEL_APPROVAL=1` in the deep run.
    pub approval: bool,
    /// With approval: which route of the scope a confirm may take (`IDEM_MODEL_ROUTES`).
    pub routes: Routes,
    /// Whether the paths of the design must each be reached (`props::REACHES_*`): on in the
    /// checks of the design, off in the mutation runs (they look for one counterexample).
    pub reachability: bool,
    /// idemd replicas that reconcile (each with its own pass, claiming rows against the others).
    pub reconcilers: u8,
    /// How far the second reconciler's replica's clock runs ahead of the others' (seconds): what it
    /// calls now, for its claim, its reading of the lease and the grace, and its writes.
    pub clock_ahead_s: u8,
    /// The reaper's clock-skew allowance (`world::SKEW_MS`, or idemd's own 5 s where reaping must
    /// stay past the horizon: with approval, docs/model.md "What the check found").
    pub skew_ms: i64,
    /// How long the upstream's status endpoint answers 404 for a record it already wrote (seconds;
    /// its index lags). The design assumes a record shows within the reconciler's grace
    /// (`world::STATUS_LAG_S`); `IDEM_MODEL_STATUS_LAG` in the deep run.
    pub status_lag_s: u8,
}

/// The routes of the approval scope a confirm may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Routes {
    /// The route with the rule; once the operation waits (its approval row exists), also a route
    /// of the same scope without it: the case the insert's `NOT EXISTS` defends (the default).
    RuledFirst,
    /// The route with the rule only (`IDEM_MODEL_ROUTES=ruled`).
    Ruled,
    /// Either route at any time (`IDEM_MODEL_ROUTES=any`): a scope with two rules, which the
    /// filter and `idemd check` refuse, or the rule added to a route while an operation of its scope
    /// is live (a reload).
    Any,
}

impl Config {
    /// The bounded check `make test` runs.
    pub fn bounded(upstream: UpstreamKeys) -> Config {
        Config {
            agents: 2,
            confirms: 1,
            polls: 0,
            faults: 1,
            horizon_s: 7,
            upstream,
            mutation: None,
            settle_steps: 200,
            check_settle: true,
            approval: false,
            routes: Routes::RuledFirst,
            reachability: true,
            skew_ms: world::SKEW_MS,
            reconcilers: 1,
            clock_ahead_s: 0,
            status_lag_s: world::STATUS_LAG_S,
        }
    }

    /// The bounded check with approval on.
    pub fn bounded_approval(upstream: UpstreamKeys) -> Config {
        Config { approval: true, skew_ms: idemd::store::retention::CLOCK_SKEW_MS, ..Config::bounded(upstream) }
    }

    pub fn mutated(self, m: Mutation) -> Config {
        Config { mutation: Some(m), reachability: false, ..self }
    }

    pub fn broken(&self) -> Broken {
        match self.mutation {
            Some(Mutation::Store(b)) => b,
            _ => Broken::None,
        }
    }

    pub fn is(&self, m: Mutation) -> bool {
        self.mutation == Some(m)
    }
}

/// The fixed facts of the world (seconds and milliseconds as idemd and the filter see them).
pub mod world {
    /// The fingerprint's lifetime (the route's `fingerprint_ttl_s`).
    pub const FINGERPRINT_TTL_S: u64 = 3;
    /// The IN_FLIGHT lease (the route's `lease_ms`, idemd's `--lease-ms`).
    pub const LEASE_MS: u64 = 3_000;
    /// idemd's terminal retention; also the replay cache's `ttl_s` (never longer).
    pub const RETENTION_MS: u64 = 2_000;
    /// The reconciler's grace after a lease ended before a 404 proves "never ran".
    pub const GRACE_MS: u64 = 1_000;
    /// The status endpoint's lag in the checks of the design (`Config::status_lag_s`): a record
    /// shows within the grace, as the design assumes (a record younger than this is a 404).
    pub const STATUS_LAG_S: u8 = 1;
    const _: () = assert!(STATUS_LAG_S as u64 * 1_000 <= GRACE_MS, "the design's lag is within the grace");
    /// Failed status lookups before NEEDS_REVIEW: one, so that the bounded check (one fault)
    /// reaches NEEDS_REVIEW (a failed lookup after a complete that never arrived).
    pub const RETRY_BUDGET: u32 = 1;
    /// The reaper's clock-skew allowance in the checks without approval (`Config::skew_ms`;
    /// `retention::CLOCK_SKEW_MS` is 5 s): the model's replicas share one clock, so any allowance
    /// is enough, and 1 s brings reaping within the bounded check's horizon.
    pub const SKEW_MS: i64 = 1_000;
    /// Envoy's longest wait for the upstream (the route timeout). §5's lease rule: the lease
    /// exceeds it plus the sidecar timeout (under a second here) plus the upstream worst case.
    pub const ENVOY_WAIT_S: u8 = 1;
    /// Envoy's wait in the configuration [`super::Mutation::LeaseShorterThanEnvoyWait`].
    pub const ENVOY_WAIT_TOO_LONG_S: u8 = 4;
    /// How long the upstream may still act on a request Envoy gave up on or lost (a timeout, a
    /// killed Envoy): §5's upstream worst case, which the lease exceeds.
    pub const UPSTREAM_WORST_S: u8 = 1;
    /// How long a callout that timed out at the filter may still be on its way to idemd.
    pub const ORPHAN_S: u8 = 3;
    /// The preview's clock: unix seconds at model time 0.
    pub const T0: u64 = 1_000;
    /// The approver (`--approvers`): not the operation's subject.
    pub const APPROVER: &str = "approver-ann";
}
