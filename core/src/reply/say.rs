//! What a reply says, chosen once for every language: the meaning (what happened) and the
//! instruction (what to do next), each a variant carrying only the values its words need. The
//! wording tables (`en`, `zh`) then turn each variant into text without a condition of their
//! own, so a new case is added here once and a third language is one more table.

use super::{ReplyContext, ReplyKind};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Meaning<'a> {
    /// A status query found it executed.
    DoneAsked,
    /// A status query found it refused, with the upstream's status.
    FailedAsked(u16),
    /// A repeated confirm of an executed operation.
    Done,
    /// A repeated confirm of a refused operation.
    Failed(u16),
    InProgress,
    OutcomeUnknown,
    NeedsReview,
    NotExecuted,
    NotYetExecuted,
    /// A status query that could not be answered.
    UnavailableAsked,
    /// A confirm that could not be checked.
    Unavailable,
    /// A confirm idemd would not start: its database's replication could lose the record.
    UnavailableReplication,
    ParamsChanged,
    FingerprintExpired,
    FingerprintInvalid,
    FingerprintMissing,
    Forbidden,
    SubjectMissing,
    BodyTooLarge,
    InvalidJson,
    KeyMissing,
    /// The detail, if the reply has one (the tables name `detail` otherwise).
    KeyInvalid(Option<&'a str>),
    InvalidField(Option<&'a str>),
    InvalidHeader(Option<&'a str>),
    QuoteUnusable,
    RecordGone,
    PathNotCanonical,
    ApprovalRequired,
    AwaitingApproval,
    Approved,
    /// The approver's reason, if one was given.
    Rejected(Option<&'a str>),
    ApprovalLapsed,
    /// The business reference's field, if the reply names it.
    ReferenceInUse(Option<&'a str>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Instruction<'a> {
    /// Status query, executed: report `result` (and its reference).
    ReportAsked,
    ReportAskedRef(&'a str),
    /// Status query, refused: tell why; a new preview if the user still wants it.
    ExplainAsked,
    /// Repeated confirm, executed: do not call again; report `result` (and its reference).
    Report,
    ReportRef(&'a str),
    /// Repeated confirm, refused: do not call again with this fingerprint; explain; re-preview.
    Explain,
    /// Wait, then ask the status tool.
    Poll {
        tool: &'a str,
        wait_ms: u64,
    },
    /// Wait, then call this tool again unchanged: it reports, never executes twice.
    CallAgain {
        wait_ms: u64,
    },
    /// Do not retry; a person reviews it under this reference.
    Review {
        reference: &'a str,
    },
    /// Nothing ran: the same call again is safe after the wait.
    RetrySame {
        wait_ms: u64,
    },
    /// Not yet executed: confirm before `at` (unix seconds), else preview again.
    ConfirmBefore {
        at: u64,
    },
    ConfirmWhileValid,
    /// The status tool again after the wait.
    AskAgain {
        wait_ms: u64,
    },
    /// The confirm could not be checked: the same call again after the wait (or the status tool).
    CheckAgain {
        wait_ms: u64,
    },
    CheckAgainOrPoll {
        wait_ms: u64,
        tool: &'a str,
    },
    /// Refused by the store's replication: do not retry now; tell the user, give the operator the reference.
    TellOperator {
        reference: &'a str,
    },
    Repreview,
    PreviewAgain,
    CopyExactly,
    PreviewFirst,
    OwnFingerprint,
    FixAuthentication,
    SmallerBody,
    OneJsonObject,
    SendKey,
    OneKey,
    FixField,
    OneHeader,
    NoConfirmForQuote,
    LookElsewhere {
        reference: &'a str,
    },
    /// The documented path, if the reply names it.
    DocumentedPath(Option<&'a str>),
    /// A confirm that needs a person: tell the user what and where, do not call again until the
    /// status says approved (`tool` polls; without one, this tool with the same fingerprint).
    AwaitApproval {
        tool: Option<&'a str>,
        console: Option<&'a str>,
        wait_ms: u64,
    },
    /// A status query of an operation still waiting for a person.
    AwaitingAsked {
        console: Option<&'a str>,
        wait_ms: u64,
    },
    /// Approved: confirm again now, same arguments and fingerprint (before `at`, unix seconds).
    ConfirmNow {
        at: Option<u64>,
    },
    /// Refused by a person: do not retry; report the reason.
    ReportRefusal,
    /// Lapsed: a new preview if the user still wants it (it needs approval again).
    PreviewForApproval,
    /// The reference names an earlier operation: check that one, or a new reference and a new preview.
    NewReference,
}

/// The one place a reply's variant is chosen.
/// `result_ref`: the reference read from the recorded answer, where the route names one.
pub(super) fn say<'a>(
    kind: ReplyKind,
    ctx: &'a ReplyContext<'a>,
    result_ref: Option<&'a str>,
) -> (Meaning<'a>, Instruction<'a>) {
    use Instruction as I;
    use Meaning as M;
    let status = ctx.result.map_or(0, |r| r.status);
    let reference = ctx.operation.unwrap_or(ctx.trace_id);
    let poll = |wait_ms| match ctx.poll_with {
        Some(tool) => I::Poll { tool, wait_ms },
        None => I::CallAgain { wait_ms },
    };
    match kind {
        ReplyKind::AlreadyCompleted if ctx.status_query => {
            (M::DoneAsked, result_ref.map_or(I::ReportAsked, I::ReportAskedRef))
        }
        ReplyKind::AlreadyFailed if ctx.status_query => (M::FailedAsked(status), I::ExplainAsked),
        ReplyKind::AlreadyCompleted => (M::Done, result_ref.map_or(I::Report, I::ReportRef)),
        ReplyKind::AlreadyFailed => (M::Failed(status), I::Explain),
        ReplyKind::InProgress => (M::InProgress, poll(ctx.poll_after_ms)),
        ReplyKind::OutcomeUnknown => (M::OutcomeUnknown, poll(ctx.poll_after_ms)),
        ReplyKind::NeedsReview => (M::NeedsReview, I::Review { reference }),
        ReplyKind::NotExecuted => (M::NotExecuted, I::RetrySame { wait_ms: ctx.retry_after_ms }),
        ReplyKind::NotYetExecuted => {
            (M::NotYetExecuted, ctx.fingerprint_expires_at.map_or(I::ConfirmWhileValid, |at| I::ConfirmBefore { at }))
        }
        ReplyKind::StatusUnavailable if ctx.status_query => {
            (M::UnavailableAsked, I::AskAgain { wait_ms: ctx.retry_after_ms })
        }
        ReplyKind::ReplicationRefused => (M::UnavailableReplication, I::TellOperator { reference }),
        ReplyKind::StatusUnavailable => (
            M::Unavailable,
            match ctx.poll_with {
                Some(tool) => I::CheckAgainOrPoll { wait_ms: ctx.retry_after_ms, tool },
                None => I::CheckAgain { wait_ms: ctx.retry_after_ms },
            },
        ),
        ReplyKind::ParamsChanged => (M::ParamsChanged, I::Repreview),
        ReplyKind::FingerprintExpired => (M::FingerprintExpired, I::PreviewAgain),
        ReplyKind::FingerprintInvalid => (M::FingerprintInvalid, I::CopyExactly),
        ReplyKind::FingerprintMissing => (M::FingerprintMissing, I::PreviewFirst),
        ReplyKind::Forbidden => (M::Forbidden, I::OwnFingerprint),
        ReplyKind::SubjectMissing => (M::SubjectMissing, I::FixAuthentication),
        ReplyKind::BodyTooLarge => (M::BodyTooLarge, I::SmallerBody),
        ReplyKind::InvalidJson => (M::InvalidJson, I::OneJsonObject),
        ReplyKind::KeyMissing => (M::KeyMissing, I::SendKey),
        ReplyKind::KeyInvalid => (M::KeyInvalid(ctx.detail), I::OneKey),
        ReplyKind::InvalidField => (M::InvalidField(ctx.detail), I::FixField),
        ReplyKind::InvalidHeader => (M::InvalidHeader(ctx.detail), I::OneHeader),
        ReplyKind::QuoteUnusable => (M::QuoteUnusable, I::NoConfirmForQuote),
        ReplyKind::RecordGone => (M::RecordGone, I::LookElsewhere { reference }),
        ReplyKind::PathNotCanonical => (M::PathNotCanonical, I::DocumentedPath(ctx.detail)),
        ReplyKind::ApprovalRequired => (
            M::ApprovalRequired,
            I::AwaitApproval {
                tool: ctx.poll_with,
                console: ctx.approval.and_then(|a| a.console),
                wait_ms: ctx.poll_after_ms,
            },
        ),
        ReplyKind::AwaitingApproval => (
            M::AwaitingApproval,
            I::AwaitingAsked { console: ctx.approval.and_then(|a| a.console), wait_ms: ctx.poll_after_ms },
        ),
        ReplyKind::Approved => (M::Approved, I::ConfirmNow { at: ctx.approval.and_then(|a| a.expires_at) }),
        ReplyKind::Rejected => (M::Rejected(ctx.approval.and_then(|a| a.reason)), I::ReportRefusal),
        ReplyKind::ApprovalLapsed => (M::ApprovalLapsed, I::PreviewForApproval),
        ReplyKind::ReferenceInUse => (M::ReferenceInUse(ctx.detail), I::NewReference),
    }
}
