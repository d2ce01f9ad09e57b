//! Every reply kind, one row each (DESIGN §7's table): its `status` word, HTTP status, the problem
//! a program gets, whether repeating the call helps, and what it tells about the operation.
//! Adding a kind is one row here and its wording in `say.rs`, `en.rs` and `zh.rs`.

/// What an answer tells the agent about the *operation* (not about this call). The model judges
/// every answer by it: "nothing ran" must be true over the whole run, a result must be the one
/// execution's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tells {
    /// It ran: here is its result.
    Ran,
    /// It ran and failed definitively.
    Failed,
    /// It did not run (a release, an expiry before any start, a person's refusal, a lapse).
    NothingRan,
    /// Not decided yet: in flight, or waiting for a person's approval.
    Pending,
    /// A person decides what became of it (`needs_review`).
    Review,
    /// Its record is gone: whether it ran is no longer known here.
    Forgotten,
    /// Nothing either way: the store could not be asked, or would not start it.
    Unknowing,
    /// This call was refused before anything: nothing about the operation.
    Refused,
}

/// One kind's facts. Built with the `const fn`s below so each row reads as a sentence.
#[derive(Debug, Clone, Copy)]
pub(super) struct Row {
    pub status: &'static str,
    /// The envelope's HTTP status (a replay's is the recorded one where usable; a status query
    /// that reports an outcome is 200: `http_status`).
    pub http: u16,
    pub tells: Tells,
    /// Repeating the same call is safe and may get another answer.
    pub retryable: bool,
    /// A report of what became of the operation (a status tool answers it as a result).
    pub report: bool,
    /// One of the approval replies (DESIGN §4, "Approval").
    pub approval: bool,
    /// The problem's status where it is not the envelope's (a pending operation is 409 to programs).
    pub problem_status: Option<u16>,
    pub slug: &'static str,
    pub title: &'static str,
}

impl Row {
    const fn new(status: &'static str, http: u16, tells: Tells) -> Row {
        Row {
            status,
            http,
            tells,
            retryable: false,
            report: false,
            approval: false,
            problem_status: None,
            slug: "",
            title: "",
        }
    }
    const fn problem(self, slug: &'static str, title: &'static str) -> Row {
        Row { slug, title, ..self }
    }
    const fn problem_status(self, status: u16) -> Row {
        Row { problem_status: Some(status), ..self }
    }
    const fn retryable(self) -> Row {
        Row { retryable: true, ..self }
    }
    const fn report(self) -> Row {
        Row { report: true, ..self }
    }
    const fn approval(self) -> Row {
        Row { approval: true, ..self }
    }
}

macro_rules! reply_kinds {
    ($( $(#[$doc:meta])* $kind:ident => $row:expr, )*) => {
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum ReplyKind {
            $( $(#[$doc])* $kind, )*
        }

        impl ReplyKind {
            pub const ALL: [ReplyKind; <[&str]>::len(&[$(stringify!($kind)),*])] = [$(ReplyKind::$kind),*];

            pub(super) const fn row(self) -> Row {
                match self {
                    $( ReplyKind::$kind => $row, )*
                }
            }
        }
    };
}

use Tells as T;

reply_kinds! {
    AlreadyCompleted => Row::new("already_completed", 200, T::Ran).report()
        .problem("already-recorded", "This request was already processed; its result was recorded"),
    AlreadyFailed => Row::new("already_failed", 409, T::Failed).report()
        .problem("already-recorded", "This request was already processed; its result was recorded"),
    InProgress => Row::new("in_progress", 202, T::Pending).report().problem_status(409)
        .problem("request-in-progress", "A request with this Idempotency-Key is still being processed"),
    /// This very call got no definite answer from the upstream (timeout, crash, reset, 5xx): it
    /// may have executed; the reconciler will find out. Same status and next step as `InProgress`.
    OutcomeUnknown => Row::new("in_progress", 202, T::Pending).report().problem_status(409)
        .problem("request-in-progress", "A request with this Idempotency-Key is still being processed"),
    NeedsReview => Row::new("needs_review", 202, T::Review).report().problem_status(409)
        .problem("needs-review", "The outcome of the request with this Idempotency-Key is being reviewed by a person"),
    /// The operation provably did not run: the upstream said 429/503 or could not be reached, and
    /// the operation was released. 503 + Retry-After; the same call is safe to repeat. Never used
    /// where an earlier call may have executed it (that is `StatusUnavailable`).
    NotExecuted => Row::new("not_executed", 503, T::NothingRan).retryable().problem(
        "not-executed",
        "The request was not executed (the upstream refused it or could not be reached); retry with the same Idempotency-Key",
    ),
    /// Status route: this fingerprint was never confirmed and may still be, until
    /// `fingerprint_expires_at` (HTTP 200).
    NotYetExecuted => Row::new("not_executed", 200, T::NothingRan).report()
        .problem("not-yet-executed", "This operation has not been executed"),
    /// The store cannot be asked right now (503 + Retry-After): this call ran nothing, but an
    /// earlier call with the same fingerprint may have. Unlike `NotExecuted` it claims nothing about
    /// the operation. On a confirm route repeating the same call is safe (it replays or runs
    /// once); on a status route repeating the lookup is.
    StatusUnavailable => Row::new("status_unavailable", 503, T::Unknowing).retryable()
        .problem("store-unavailable", "The idempotency store is unavailable; retry with the same Idempotency-Key"),
    /// idemd refused to start the operation (`REPLICATION_REFUSED`): its database replicates in a
    /// way that could lose the record in a failover. The wire word is `status_unavailable`, but it
    /// is an operator's matter, not a passing outage: no Retry-After, not retryable.
    ReplicationRefused => Row::new("status_unavailable", 503, T::Unknowing).problem(
        "replication-refused",
        "The gateway refuses to start this request: its idempotency store's replication could lose the record in a failover; nothing was executed, and retrying is refused the same way until an operator changes the store",
    ),
    ParamsChanged => Row::new("params_changed", 422, T::Refused)
        .problem("idempotency-key-reused", "This Idempotency-Key was already used with a different request payload"),
    FingerprintExpired => Row::new("fingerprint_expired", 410, T::NothingRan)
        .problem("fingerprint-expired", "The fingerprint has expired and nothing ran with it"),
    FingerprintInvalid => Row::new("fingerprint_invalid", 400, T::Refused)
        .problem("fingerprint-invalid", "The fingerprint is not one this gateway issued"),
    FingerprintMissing => Row::new("fingerprint_missing", 428, T::Refused).problem(
        "fingerprint-missing",
        "This operation requires a fingerprint from its preview, or an Idempotency-Key",
    ),
    Forbidden => Row::new("forbidden", 403, T::Refused)
        .problem("forbidden", "This fingerprint or key belongs to another caller"),
    /// 401: the gateway could not identify the caller.
    SubjectMissing => Row::new("unauthenticated", 401, T::Refused)
        .problem("unauthenticated", "The caller could not be identified"),
    BodyTooLarge => Row::new("body_too_large", 413, T::Refused)
        .problem("body-too-large", "The request body is larger than the gateway accepts"),
    InvalidJson => Row::new("invalid_json", 400, T::Refused)
        .problem("invalid-json", "The request body is not a valid JSON object"),
    /// A bound field has the wrong type or an out-of-range number; `detail` names it.
    InvalidField => Row::new("invalid_field", 400, T::Refused)
        .problem("invalid-field", "A bound field has the wrong type or is out of range"),
    /// Client-key mode and no `Idempotency-Key` (nor a fingerprint).
    KeyMissing => Row::new("idempotency_key_missing", 400, T::Refused)
        .problem("idempotency-key-missing", "This operation requires an Idempotency-Key header"),
    /// The `Idempotency-Key` is not one valid key; `detail` says why.
    KeyInvalid => Row::new("idempotency_key_invalid", 400, T::Refused)
        .problem("idempotency-key-invalid", "The Idempotency-Key header is not one valid key"),
    /// A header the guard reads came more than once (DESIGN §6); `detail` names it.
    InvalidHeader => Row::new("invalid_header", 400, T::Refused)
        .problem("invalid-header", "A header the gateway reads was sent more than once or is not text"),
    /// Another spelling of a guarded path or method (case, escapes, slashes, an override header)
    /// that an upstream may read as the guarded one; `detail` names the path to use.
    PathNotCanonical => Row::new("path_not_canonical", 400, T::Refused)
        .problem("path-not-canonical", "The path or method is another spelling of a guarded operation"),
    /// Expired, no row, and one may have been kept and reaped after the retention: whether the
    /// operation ran is no longer known here. Never "nothing ran".
    RecordGone => Row::new("record_expired", 410, T::Forgotten)
        .problem("record-expired", "The record of this request is older than the retention and no longer kept"),
    /// The preview succeeded upstream, but its quote's stated expiry (the route's `quote_expires`)
    /// is missing, unreadable or past: no fingerprint, nothing to confirm. A preview reads only:
    /// asking again is always safe.
    QuoteUnusable => Row::new("quote_unusable", 502, T::Refused).retryable()
        .problem("quote-unusable", "The preview's quote states no usable expiry"),
    /// A person must approve this confirm first; it is recorded, nothing was forwarded.
    ApprovalRequired => Row::new("approval_required", 202, T::Pending).approval()
        .problem("approval-required", "A person must approve this request before it is executed"),
    /// Status route: the operation waits for a person's approval.
    AwaitingApproval => Row::new("awaiting_approval", 200, T::Pending).approval().report()
        .problem("awaiting-approval", "This request is waiting for a person's approval"),
    /// Status route: a person approved it; the next confirm executes it, once.
    Approved => Row::new("approved", 200, T::Pending).approval().report()
        .problem("approved", "A person approved this request; it has not been executed yet"),
    /// A person refused the operation: 403 to a confirm (200 to a status query), replayed forever.
    Rejected => Row::new("rejected", 403, T::NothingRan).approval().report()
        .problem("rejected", "A person refused this request; it was not executed"),
    /// Nobody approved before the fingerprint's `exp`; nothing executed.
    ApprovalLapsed => Row::new("approval_lapsed", 410, T::NothingRan).approval().report()
        .problem("approval-lapsed", "Nobody approved this request in time; it was not executed"),
    /// Another operation of this scope already holds the confirm's business reference (the route's
    /// `business_ref`, named in `detail`); nothing recorded, nothing forwarded.
    ReferenceInUse => Row::new("reference_in_use", 409, T::Refused).problem(
        "reference-in-use",
        "Another request already uses this business reference; this one was not executed",
    ),
}

impl ReplyKind {
    /// The body's `status` value (also a good stats/log label).
    pub fn status(self) -> &'static str {
        self.row().status
    }

    /// What the answer tells about the operation.
    pub fn tells(self) -> Tells {
        self.row().tells
    }

    /// A report of what became of an operation (a status tool answers these as results), as
    /// opposed to a refusal of this call or "cannot tell now".
    pub fn is_report(self) -> bool {
        self.row().report
    }

    /// One of the approval replies (DESIGN §4, "Approval").
    pub fn is_approval(self) -> bool {
        self.row().approval
    }

    /// A replay of a recorded result.
    pub fn is_replay(self) -> bool {
        matches!(self.tells(), Tells::Ran | Tells::Failed)
    }
}
