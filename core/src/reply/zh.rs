//! 中文措辞表：`say` 的每个变体对应一段文字。

use super::say::{Instruction, Meaning};

pub(super) fn meaning(m: Meaning) -> String {
    use Meaning as M;
    match m {
        M::DoneAsked => "该操作已经成功执行。".into(),
        M::FailedAsked(status) => format!("该操作已经明确失败（原始 HTTP 状态码 {status}）：服务拒绝了它。"),
        M::Done => "该操作在此前的调用中已经成功执行，本次为重复调用，没有再次执行。".into(),
        M::Failed(status) => format!(
            "该操作此前已用同一个指纹执行过，并且已经明确失败（原始 HTTP 状态码 {status}）。本次为重复调用，没有执行任何操作。"
        ),
        M::InProgress => "该操作正在处理中，结果尚未确定。".into(),
        M::OutcomeUnknown => "下游服务没有给出确定的答复（超时、出错或连接中断），这笔操作可能已经执行，也可能没有。网关正在核实，绝不会重复执行。".into(),
        M::NeedsReview => "该操作的结果无法自动确定：可能已经执行，也可能没有执行，正在由人工核查。".into(),
        M::NotExecuted => "该操作没有被执行：负责执行它的服务暂时不可用，没有处理这次请求，什么都没有发生。".into(),
        M::NotYetExecuted => "该操作尚未执行：这个指纹从未被用于确认。".into(),
        M::UnavailableAsked => "由于服务暂时不可用，现在无法查询该操作的结果：它可能已经执行，也可能没有执行。".into(),
        M::UnavailableReplication => "本次调用没有执行任何操作：网关拒绝启动该操作，因为记录操作的数据库的复制方式可能在故障切换时丢失这条记录，而此工具的服务届时会再执行一次。这不是暂时的故障，要等运维人员调整网关的存储后才会恢复。此前使用同一指纹的调用可能已经执行了该操作，也可能没有。".into(),
        M::Unavailable => "本次调用没有执行任何操作，但由于服务暂时不可用，网关现在无法核实此前使用同一指纹的调用是否已经执行了该操作：它可能已经执行，也可能没有。".into(),
        M::ParamsChanged => "本次调用中的关键参数（如金额、币种、收款方）与预览时签发指纹的参数不一致，本次调用没有执行任何操作。".into(),
        M::FingerprintExpired => "指纹已过期（预览签发的指纹只在有限时间内有效），并且从未用它发起过操作：什么都没有执行。".into(),
        M::FingerprintInvalid => "指纹无效：它被改动、截断，或者不是本服务签发的。本次调用没有执行任何操作。".into(),
        M::FingerprintMissing => "本次调用需要预览工具签发的指纹，但没有携带。本次调用没有执行任何操作。".into(),
        M::Forbidden => "这个指纹是签发给其他调用方的，你不能使用。本次调用没有执行任何操作。".into(),
        M::SubjectMissing => "网关无法识别本次调用的身份，本次调用没有执行任何操作。".into(),
        M::BodyTooLarge => "请求体超过了网关允许的大小，本次调用没有执行任何操作。".into(),
        M::InvalidJson => "请求体不是合法的 JSON 对象（或者有重复的字段名），本次调用没有执行任何操作。".into(),
        M::KeyMissing => "本次调用需要 Idempotency-Key 请求头（或预览工具签发的指纹），本次调用没有执行任何操作。".into(),
        M::KeyInvalid(detail) => {
            format!("Idempotency-Key 请求头不是一个有效的键（{}），本次调用没有执行任何操作。", detail.unwrap_or("见 detail"))
        }
        M::InvalidField(detail) => {
            format!("字段 {} 的类型错误或数值超出范围，本次调用没有执行任何操作。", detail.unwrap_or("（见 detail）"))
        }
        M::InvalidHeader(detail) => format!(
            "网关读取的某个请求头出现了不止一次或不是文本（{}），无法判断其含义，本次调用没有执行任何操作。",
            detail.unwrap_or("见 detail")
        ),
        M::QuoteUnusable => "服务已返回预览结果，但无法读取报价的有效期（或报价已经过期），因此没有签发指纹，这次预览无法被确认。本次调用没有执行任何操作。".into(),
        M::RecordGone => "该指纹已过期，网关不再保存这么久之前的记录，无法判断之前的调用是否已经执行了该操作。本次调用没有执行任何操作。".into(),
        M::ApprovalRequired => "该操作需要人工批准后才能执行。它已被记录等待批准，没有被执行：在有人批准之前什么都不会发生。".into(),
        M::AwaitingApproval => "该操作正在等待人工批准，没有被执行。".into(),
        M::Approved => "该操作已获人工批准，但还没有被执行：用同一个指纹再次确认时会执行一次。".into(),
        M::Rejected(reason) => format!(
            "该操作被人工拒绝（原因：{}）。它没有被执行，用这个指纹也永远不会执行。",
            reason.unwrap_or("未说明")
        ),
        M::ApprovalLapsed => "在指纹过期之前没有人批准该操作，因此它没有被执行，也不能再执行。".into(),
        M::ReferenceInUse(field) => format!(
            "另一个操作已经使用了这个业务引用（{}），而一个引用只能对应一个操作。本次调用没有执行任何操作。",
            field.map(|f| format!("字段 {f}")).unwrap_or_else(|| "见 `detail`".into())
        ),
        M::PathNotCanonical => "请求的路径或方法是网关所保护操作的另一种写法（大小写、转义、多余的斜杠或方法覆盖请求头）或另一种方法，本次调用没有执行任何操作。".into(),
    }
}

pub(super) fn instruction(i: Instruction) -> String {
    use Instruction as I;
    match i {
        I::ReportAsked => "不要再次确认。直接向用户播报 result 中的结果。".into(),
        I::ReportAskedRef(r) => format!("不要再次确认。直接向用户播报 result 中的结果，业务单号为 {r}。"),
        I::ExplainAsked => "不要再用这个指纹确认。根据 result 把失败原因告诉用户。如果用户仍想完成这笔操作，先重新调用预览工具获取新的指纹。".into(),
        I::Report => "不要再次调用本工具。直接向用户播报下方 result 中的结果。".into(),
        I::ReportRef(r) => format!("不要再次调用本工具。直接向用户播报下方 result 中的结果，业务单号为 {r}。"),
        I::Explain => "不要再用这个指纹调用本工具。根据 result 把失败原因告诉用户。如果用户仍想完成这笔操作，先重新调用预览工具获取新的指纹，再用新指纹确认。".into(),
        I::Poll { tool, wait_ms } => format!(
            "不要重新调用本工具。等待 {} 后调用状态查询工具 {tool}（带上同一个指纹）确认结果，再把结果告诉用户。",
            wait(wait_ms)
        ),
        I::CallAgain { wait_ms } => format!(
            "不要重新预览，也不要改动任何参数。等待 {} 后，用完全相同的参数和同一个指纹再调用一次本工具：它不会重复执行，只会返回这次操作的结果。",
            wait(wait_ms)
        ),
        I::TellOperator { reference } => format!(
            "不要再调用本工具，也不要为同一目的重新预览：在运维人员修复网关的存储之前，每次调用都会以同样的原因被拒绝。不要告诉用户操作已完成。告诉用户本次调用没有启动这笔操作，因为网关目前无法安全地记录它，并把查询编号 {reference} 告诉用户，以便转交运维人员。"
        ),
        I::Review { reference } => format!(
            "不要重试，也不要为同一目的重新预览。告诉用户这笔操作正在人工核查，结果确定后会另行通知，查询编号为 {reference}。"
        ),
        I::RetrySame { wait_ms } => format!(
            "等待 {} 后，用完全相同的参数和同一个指纹重新调用本工具。这是安全的，不会重复执行。",
            wait(wait_ms)
        ),
        I::ConfirmBefore { at } => format!(
            "不要告诉用户该操作已完成。如果用户仍要执行，请在 {}（Unix 时间 {at}）之前用这个指纹调用确认工具；过期后需先重新调用预览工具。",
            crate::utc::iso_utc(at)
        ),
        I::ConfirmWhileValid => "不要告诉用户该操作已完成。如果用户仍要执行，请在指纹有效期内用它调用确认工具；过期后需先重新调用预览工具。".into(),
        I::AskAgain { wait_ms } => format!(
            "不要再次调用确认工具，也不要重新预览。等待 {} 后，用同一个指纹再次调用本状态查询工具；在此之前告诉用户结果暂时未知。",
            wait(wait_ms)
        ),
        I::CheckAgain { wait_ms } => check_again(wait_ms, ""),
        I::CheckAgainOrPoll { wait_ms, tool } => check_again(wait_ms, &format!("（或用同一个指纹调用 {tool}）")),
        I::Repreview => "不要用这个指纹和这些参数重试。如果此前已经用这个指纹和原来的参数确认过，那次调用依然有效：先用状态查询工具核实。否则用用户真正想要的参数重新调用预览工具，把新的预览结果告诉用户，再用新的指纹确认。".into(),
        I::PreviewAgain => "用相同的参数重新调用预览工具获取新的指纹；如果预览结果有变化，先告诉用户，再用新指纹确认。".into(),
        I::CopyExactly => "从最近一次预览结果中逐字符原样复制指纹后重新调用；如果已经找不到，就重新调用预览工具。".into(),
        I::PreviewFirst => "如果还没有预览，先调用预览工具；然后把预览结果中的指纹原样带上，再调用本工具。".into(),
        I::OwnFingerprint => "不要重试。如果用户确实要执行这笔操作，请自己调用预览工具获取属于你的指纹，再用它确认。".into(),
        I::FixAuthentication => "不要原样重试。告诉用户该工具的身份认证缺失或无效，需要先修复后才能执行这笔操作。".into(),
        I::SmallerBody => "只发送工具要求的参数，去掉多余的数据，然后重新调用。".into(),
        I::OneJsonObject => "把参数作为一个合法的 JSON 对象发送，每个字段名只出现一次，然后重新调用。".into(),
        I::SendKey => "发送一个只属于这笔操作的 Idempotency-Key（例如 UUID），重试时保持同一个键。".into(),
        I::OneKey => "只发送一个键，最多 255 个可打印字符，可加引号（\"key\"）或不加，每次重试保持不变。".into(),
        I::FixField => "修正该字段（金额请使用 JSON 数字或十进制字符串，例如 \"12.50\"），然后重新调用。".into(),
        I::OneHeader => "该请求头只发送一次、只带一个纯文本值，然后重新调用。".into(),
        I::NoConfirmForQuote => "不要为这次预览调用确认工具。请重新调用预览工具；如果反复出现，告诉用户目前报价无法确认。".into(),
        I::LookElsewhere { reference } => format!(
            "不要告诉用户操作没有完成，也不要用这个指纹再次确认。告诉用户这里已无法查询结果，并给出参考号 {reference}，运维人员可以在业务系统自己的记录中核对。如果用户想要新的操作，请先重新调用预览工具。"
        ),
        I::AwaitApproval { tool, console, wait_ms } => format!(
            "在状态显示已批准之前，不要再次调用此工具，也不要重新预览。告诉用户该操作（见 `approval.fields` 中的字段）需要人工批准{}。然后等待 {}，再{}以了解审批结果。",
            console.map(|c| format!("，审批人在 {c} 批准")).unwrap_or_default(),
            wait(wait_ms),
            tool.map_or("用完全相同的参数和同一个指纹再次调用此工具（在批准之前它只报告状态，批准后只执行一次）".to_string(), |t| format!("用同一个指纹调用 `{t}`"))
        ),
        I::AwaitingAsked { console, wait_ms } => format!(
            "暂时不要调用确认工具，也不要重新预览。告诉用户该操作正在等待人工批准{}；等待 {} 后，用同一个指纹再次调用此状态工具。",
            console.map(|c| format!("（在 {c} 批准）")).unwrap_or_default(),
            wait(wait_ms)
        ),
        I::ConfirmNow { at } => format!(
            "现在用完全相同的参数和同一个指纹再次调用确认工具{}：它只会执行一次。不要重新预览。",
            at.map(|at| format!("（在 {} 之前）", crate::utc::iso_utc(at))).unwrap_or_default()
        ),
        I::ReportRefusal => "不要重试，也不要为绕过这个决定而重新预览。告诉用户该操作被人工拒绝，并告诉他们原因。".into(),
        I::PreviewForApproval => "不要再用这个指纹确认。告诉用户没有人及时批准。如果用户仍然需要，请重新调用预览工具，并用新的指纹确认；它仍需要批准。".into(),
        I::NewReference => "不要再用这个指纹调用。如果你指的是之前使用该引用的那个操作，那就是它：请用它自己的指纹查询它的状态，不要再执行一次。如果这是一个新的操作，请向用户要一个新的引用，用它重新调用预览工具，并用新的指纹确认。".into(),
        I::DocumentedPath(detail) => format!("请按文档中的路径重新发送（调用）该操作（{}）。", detail.unwrap_or("见 detail")),
    }
}

fn check_again(wait_ms: u64, or_poll: &str) -> String {
    format!(
        "不要告诉用户操作没有完成，也不要重新预览。等待 {} 后，用完全相同的参数和同一个指纹再次调用本工具{or_poll}：这是安全的，不会重复执行；如果此前已经执行，它会返回那次的结果。",
        wait(wait_ms)
    )
}

fn wait(ms: u64) -> String {
    if ms.is_multiple_of(1000) {
        format!("{} 秒", ms / 1000)
    } else {
        format!("{ms} 毫秒")
    }
}

/// 网关在受保护的确认工具 `outputSchema` 中声明的属性（MCP）：模型会读到它。
pub(super) const REPLAY_PROPERTY: &str = "仅由幂等网关设置，出现在并非本次调用自身执行结果的回答中：上面的结果来自之前的一次调用，本次调用没有执行任何操作。包含 status（例如 already_completed）、meaning 和 instruction：请按 instruction 行事，不要为此再次调用该工具，也绝不要把它报告为第二次执行。本次调用确实执行了操作时，此属性不存在。";
