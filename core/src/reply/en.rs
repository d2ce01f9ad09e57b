//! The English wording table: one text per variant of `say`.

use super::say::{Instruction, Meaning};

pub(super) fn meaning(m: Meaning) -> String {
    use Meaning as M;
    match m {
        M::DoneAsked => "This operation was executed successfully.".into(),
        M::FailedAsked(status) => format!(
            "This operation failed definitively (original HTTP status {status}): the service refused it."
        ),
        M::Done => "This operation was already executed successfully by an earlier call. This call is a duplicate and did not execute it again.".into(),
        M::Failed(status) => format!(
            "This operation was already attempted with this fingerprint and it failed definitively (original HTTP status {status}). This call is a duplicate and did not execute anything."
        ),
        M::InProgress => "This operation is being processed by an earlier call; its outcome is not known yet.".into(),
        M::OutcomeUnknown => "The service gave no definite answer to this call (it timed out, failed or dropped the connection), so the operation may or may not have been executed. The gateway is finding out; it will never execute it a second time.".into(),
        M::NeedsReview => "The outcome of this operation could not be determined automatically: it may or may not have been executed. A person is checking it.".into(),
        M::NotExecuted => "This operation was NOT executed: the service that carries it out was temporarily unavailable and did not act on it. Nothing happened.".into(),
        M::NotYetExecuted => "This operation has not been executed: this fingerprint was never used to confirm it.".into(),
        M::UnavailableAsked => "The outcome of this operation cannot be looked up right now because a service is temporarily unavailable. It may or may not have been executed.".into(),
        M::UnavailableReplication => "This call did not execute anything: the gateway refused to start this operation, because the database that records operations replicates in a way that could lose the record in a failover, and this tool's service would then run the operation a second time. This is not a passing outage: it lasts until an operator changes the gateway's store. An earlier call with this fingerprint may or may not have executed the operation.".into(),
        M::Unavailable => "This call did not execute anything, but the gateway cannot check right now whether an earlier call with this fingerprint already executed the operation, because a service is temporarily unavailable. The operation may or may not have been executed.".into(),
        M::ParamsChanged => "The bound arguments of this call (such as amount, currency or recipient) differ from those the fingerprint was issued for in the preview. This call did not execute anything.".into(),
        M::FingerprintExpired => "The fingerprint has expired (a fingerprint from the preview is valid only for a limited time) and no operation was ever started with it: nothing was executed.".into(),
        M::FingerprintInvalid => "The fingerprint is not valid: it was altered, truncated, or not issued by this service. This call did not execute anything.".into(),
        M::FingerprintMissing => "This call requires the fingerprint issued by the preview tool, and none was sent. This call did not execute anything.".into(),
        M::Forbidden => "This fingerprint was issued to a different caller and cannot be used by you. This call did not execute anything.".into(),
        M::SubjectMissing => "The gateway could not identify who is making this call, so this call did not execute anything.".into(),
        M::BodyTooLarge => "The request body is larger than the gateway accepts. This call did not execute anything.".into(),
        M::InvalidJson => "The request body is not a valid JSON object (or it repeats a field name). This call did not execute anything.".into(),
        M::KeyMissing => "This call needs an Idempotency-Key header (or a fingerprint from the preview tool). This call did not execute anything.".into(),
        M::KeyInvalid(detail) => format!(
            "The Idempotency-Key header is not one valid key ({}). This call did not execute anything.",
            detail.unwrap_or("see `detail`")
        ),
        M::InvalidField(detail) => format!(
            "The field {} has the wrong type or a number out of range. This call did not execute anything.",
            detail.unwrap_or("named in `detail`")
        ),
        M::InvalidHeader(detail) => format!(
            "A header the gateway reads came more than once or is not text ({}), so it cannot tell what is meant. This call did not execute anything.",
            detail.unwrap_or("named in `detail`")
        ),
        M::QuoteUnusable => "The service answered the preview, but the quote's validity could not be read (or the quote has already expired), so no fingerprint was issued and nothing can be confirmed from this preview. This call did not execute anything.".into(),
        M::RecordGone => "This fingerprint has expired, and the gateway no longer keeps records that old, so it cannot tell whether an earlier call executed this operation. This call did not execute anything.".into(),
        M::ApprovalRequired => "This operation needs a person's approval before it runs. It was recorded for approval and was not executed: nothing happens until a person approves it.".into(),
        M::AwaitingApproval => "This operation is waiting for a person's approval. It was not executed.".into(),
        M::Approved => "A person approved this operation. It was not executed yet: it runs once, when it is confirmed again with the same fingerprint.".into(),
        M::Rejected(reason) => format!(
            "A person refused this operation (reason: {}). It was not executed, and it never will be with this fingerprint.",
            reason.unwrap_or("none given")
        ),
        M::ApprovalLapsed => "Nobody approved this operation before its fingerprint expired, so it was not executed and cannot be any more.".into(),
        M::ReferenceInUse(field) => format!(
            "Another operation already uses this business reference ({}), and a reference must name one operation only. This call did not execute anything.",
            field.map(|f| format!("the field {f}")).unwrap_or_else(|| "named in `detail`".into())
        ),
        M::PathNotCanonical => "The request's path or method is another spelling (letter case, escapes, extra slashes or a method-override header) or another method of an operation the gateway guards. This call did not execute anything.".into(),
    }
}

pub(super) fn instruction(i: Instruction) -> String {
    use Instruction as I;
    match i {
        I::ReportAsked => "Do not confirm it again. Report the outcome in `result` to the user.".into(),
        I::ReportAskedRef(r) => format!("Do not confirm it again. Report the outcome in `result` to the user; its reference is {r}."),
        I::ExplainAsked => "Do not confirm it again with this fingerprint. Tell the user why it failed, using `result`. If the user still wants the operation, call the preview tool again to get a new fingerprint.".into(),
        I::Report => "Do not call this tool again. Report the outcome in `result` to the user as the result of this operation.".into(),
        I::ReportRef(r) => format!("Do not call this tool again. Report the outcome in `result` to the user as the result of this operation; its reference is {r}."),
        I::Explain => "Do not call this tool again with this fingerprint. Tell the user why it failed, using `result`. If the user still wants the operation, call the preview tool again to get a new fingerprint, then confirm with that new fingerprint.".into(),
        I::Poll { tool, wait_ms } => format!(
            "Do not call this tool again. Wait {}, then call `{tool}` with the same fingerprint to learn the outcome, and report that outcome to the user.",
            wait(wait_ms)
        ),
        I::CallAgain { wait_ms } => format!(
            "Do not start a new preview and do not change any argument. Wait {}, then call this tool again with exactly the same arguments and the same fingerprint: it will not execute twice, it will report the outcome.",
            wait(wait_ms)
        ),
        I::TellOperator { reference } => format!(
            "Do not call this tool again and do not start a new preview for the same purpose: every call is refused the same way until an operator fixes the gateway's store. Do not tell the user it was done. Tell the user that this call did not start the operation because the gateway cannot record it safely right now, and give them the reference {reference} for the operator."
        ),
        I::Review { reference } => format!(
            "Do not retry and do not start a new preview for the same purpose. Tell the user that the operation is being reviewed by a person and that they will be told the outcome; give them the reference {reference}."
        ),
        I::RetrySame { wait_ms } => format!(
            "Wait {}, then call this tool again with exactly the same arguments and the same fingerprint. That is safe: it cannot execute twice.",
            wait(wait_ms)
        ),
        I::ConfirmBefore { at } => format!(
            "Do not report this operation as done. If the user still wants it, call the confirm tool with this fingerprint before {} (Unix time {at}); after that, call the preview tool again first.",
            crate::utc::iso_utc(at)
        ),
        I::ConfirmWhileValid => "Do not report this operation as done. If the user still wants it, call the confirm tool with this fingerprint while it is valid; once it has expired, call the preview tool again first.".into(),
        I::AskAgain { wait_ms } => format!(
            "Do not call the confirm tool again and do not start a new preview. Wait {}, then call this status tool again with the same fingerprint. Until then, tell the user the outcome is not known yet.",
            wait(wait_ms)
        ),
        I::CheckAgain { wait_ms } => check_again(wait_ms, ""),
        I::CheckAgainOrPoll { wait_ms, tool } => check_again(wait_ms, &format!(" (or call `{tool}` with the same fingerprint)")),
        I::Repreview => "Do not retry with this fingerprint and these arguments. If you already confirmed this fingerprint with its original arguments, that earlier call stands: check it with the status tool before anything else. Otherwise call the preview tool again with the arguments the user actually wants, show the user the new preview, then confirm with the new fingerprint.".into(),
        I::PreviewAgain => "Call the preview tool again with the same arguments to get a new fingerprint, tell the user if the preview changed, then confirm with the new fingerprint.".into(),
        I::CopyExactly => "Copy the fingerprint exactly, character for character, from the latest preview result and call again. If you no longer have it, call the preview tool again.".into(),
        I::PreviewFirst => "If you have not run the preview yet, call the preview tool first. Then call this tool again with the fingerprint copied exactly from the preview result.".into(),
        I::OwnFingerprint => "Do not retry. If the user wants this operation, call the preview tool yourself to get your own fingerprint, then confirm with it.".into(),
        I::FixAuthentication => "Do not retry this call as it is. Tell the user that the tool's authentication is missing or invalid and has to be fixed before the operation can be done.".into(),
        I::SmallerBody => "Send only the arguments the tool documents, without extra data, and call again.".into(),
        I::OneJsonObject => "Send the arguments as one valid JSON object in which every field name appears once, and call again.".into(),
        I::SendKey => "Send one Idempotency-Key header with a key that is unique to this operation (a UUID), and keep the same key when you retry it.".into(),
        I::OneKey => "Send exactly one key of at most 255 printable characters, quoted (\"key\") or bare, and keep it the same on every retry.".into(),
        I::FixField => "Correct that field (give amounts as a JSON number or a decimal string such as \"12.50\") and call again.".into(),
        I::OneHeader => "Send that header exactly once, with one plain-text value, and call again.".into(),
        I::NoConfirmForQuote => "Do not call the confirm tool for this preview. Call the preview tool again; if this keeps happening, tell the user that quotes cannot be confirmed right now.".into(),
        I::LookElsewhere { reference } => format!(
            "Do not tell the user it was not done, and do not confirm again with this fingerprint. Tell the user the outcome can no longer be looked up here and give them the reference {reference}, which an operator can check in the service's own records. If the user wants a new operation, call the preview tool again."
        ),
        I::AwaitApproval { tool, console, wait_ms } => format!(
            "Do not call this tool again until the status says approved, and do not start a new preview. Tell the user that this operation (the fields in `approval.fields`) needs a person's approval{}. Then wait {} and call {} to learn the decision.",
            console.map(|c| format!(", which an approver gives at {c}")).unwrap_or_default(),
            wait(wait_ms),
            tool.map_or("this tool again with exactly the same arguments and the same fingerprint (it only reports until a person approves, then executes once)".to_string(), |t| format!("`{t}` with the same fingerprint"))
        ),
        I::AwaitingAsked { console, wait_ms } => format!(
            "Do not call the confirm tool yet and do not start a new preview. Tell the user it is waiting for a person's approval{}; wait {}, then call this status tool again with the same fingerprint.",
            console.map(|c| format!(" (given at {c})")).unwrap_or_default(),
            wait(wait_ms)
        ),
        I::ConfirmNow { at } => format!(
            "Call the confirm tool again now with exactly the same arguments and the same fingerprint{}: it executes once. Do not start a new preview.",
            at.map(|at| format!(" before {}", crate::utc::iso_utc(at))).unwrap_or_default()
        ),
        I::ReportRefusal => "Do not retry and do not start a new preview to get around the decision. Tell the user that a person refused the operation, and give them the reason.".into(),
        I::PreviewForApproval => "Do not confirm again with this fingerprint. Tell the user that nobody approved it in time. If the user still wants it, call the preview tool again and confirm with the new fingerprint; it will need approval again.".into(),
        I::NewReference => "Do not call again with this fingerprint. If you meant the earlier operation that has this reference, it is that one: check its status with its own fingerprint, and do not execute it again. If this is a new operation, ask the user for a new reference, call the preview tool with it, and confirm with the new fingerprint.".into(),
        I::DocumentedPath(detail) => {
            format!("Send the call again to the operation's documented path ({}).", detail.unwrap_or("see `detail`"))
        }
    }
}

fn check_again(wait_ms: u64, or_poll: &str) -> String {
    format!(
        "Do not tell the user it was not done and do not start a new preview. Wait {}, then call this tool again with exactly the same arguments and the same fingerprint{or_poll}: that is safe, it cannot execute twice, and it reports the outcome if an earlier call already executed it.",
        wait(wait_ms)
    )
}

fn wait(ms: u64) -> String {
    match ms {
        1000 => "1 second".to_string(),
        ms if ms.is_multiple_of(1000) => format!("{} seconds", ms / 1000),
        ms => format!("{ms} ms"),
    }
}

/// The gateway's property in a guarded confirm tool's `outputSchema` (MCP): a model reads it there.
pub(super) const REPLAY_PROPERTY: &str = "Set only by the idempotency gateway, on an answer that is NOT this call's own execution: the result above is an earlier call's, and this call executed nothing. Holds status (such as already_completed), meaning and instruction: follow the instruction, do not call this tool again for it, and never report it as a second execution. Absent when this call executed the operation.";
