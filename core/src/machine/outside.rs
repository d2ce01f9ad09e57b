//! The bound values of a request outside its body (DESIGN §3, "Binding outside the body"): a
//! path template's parameters, named query parameters and headers, read from the request head
//! once, before the body, by the same rules as the guard's own headers (DESIGN §6): a value sent
//! twice, or in two spellings an upstream reads as one, is refused, never "first wins".

use super::{read_as, Counter, Ctx, Effect, RequestHead, Step};
use crate::canonical::{CanonError, Outside, Source};
use crate::policy::template;

/// The route's bound values outside the body, or the refusal to send: a 400 naming the value (sent
/// twice, not text), or the route's "misconfigured" answer where the path does not have the shape
/// of the route's template (the annotation and the route disagree: nothing is forwarded).
pub(super) fn read(ctx: &Ctx, head: &RequestHead) -> Result<Outside, Step> {
    let policy = &ctx.policy;
    let mut out = Outside::default();
    for field in policy.bound.iter().filter(|f| f.source != Source::Body) {
        let name = field.name();
        let value = match field.source {
            Source::Body => continue,
            Source::Path => {
                let value = policy.template.as_deref().and_then(|t| template::param_value(t, &head.path, name));
                match value {
                    Some(v) => Some(v.to_owned()),
                    None => {
                        let reply = super::misconfigured(&ctx.config, &ctx.trace_id);
                        return Err(Step::pause()
                            .with(Effect::Reply(reply))
                            .with(Effect::Count(Counter::RejectedMisconfigured))
                            .with(Effect::Warn(format!(
                                "agent_idempotency: {} does not fit the route's template {}: nothing forwarded",
                                head.path.split('?').next().unwrap_or_default(),
                                policy.template.as_deref().map(template::show).unwrap_or_default()
                            ))));
                    }
                }
            }
            Source::Query => one(query_values(&head.path, name), &field.pointer).map_err(|e| refuse(ctx, &e))?,
            Source::Header => {
                let copies: Vec<&[u8]> =
                    head.headers.iter().filter(|(k, _)| read_as(k, name)).map(|(_, v)| v.as_slice()).collect();
                let text = copies
                    .into_iter()
                    .map(|v| std::str::from_utf8(v).map(str::to_owned))
                    .collect::<Result<Vec<String>, _>>()
                    .map_err(|_| refuse(ctx, &CanonError::NotText { pointer: field.pointer.clone() }))?;
                one(text, &field.pointer).map_err(|e| refuse(ctx, &e))?
            }
        };
        if let Some(v) = value {
            out.0.push((field.pointer.clone(), v));
        }
    }
    Ok(out)
}

fn refuse(ctx: &Ctx, e: &CanonError) -> Step {
    ctx.field_error_as(e, ctx.for_programs())
}

/// The one value of a bound value, `None` where absent (an absent field is not bound, as in the
/// body); sent more than once, it is refused.
fn one(mut values: Vec<String>, pointer: &str) -> Result<Option<String>, CanonError> {
    match values.len() {
        0 => Ok(None),
        1 => Ok(values.pop()),
        _ => Err(CanonError::Repeated { pointer: pointer.to_owned() }),
    }
}

/// Every value of query parameter `name`, exactly as sent (`a=` is the empty value, a bare `a`
/// too). A parameter counts as `name` where any reader could take it for it: after `&` or `;`
/// (some split on both), its name percent-decoded, `+` read as a space, in any case (some
/// frameworks fold query names), so a second spelling of a bound parameter is a second value,
/// never one the guard did not see. A value runs to the next `&`: a reader that does not split on
/// `;` reads it whole, and every byte it could read is hashed.
pub fn query_values(path: &str, name: &str) -> Vec<String> {
    let Some((_, query)) = path.split_once('?') else { return Vec::new() };
    let query = query.split_once('#').map_or(query, |(q, _)| q);
    let mut out = Vec::new();
    let mut start = 0;
    while start <= query.len() {
        let rest = query.get(start..).unwrap_or_default();
        let end = rest.find(['&', ';']).map_or(query.len(), |i| start + i);
        let pair = query.get(start..end).unwrap_or_default();
        let (key, value_at) = match pair.split_once('=') {
            Some((k, _)) => (k, Some(start + k.len() + 1)),
            None => (pair, None),
        };
        if !pair.is_empty() && lenient_name(key).eq_ignore_ascii_case(name) {
            let value = match value_at {
                Some(at) => {
                    let tail = query.get(at..).unwrap_or_default();
                    tail.get(..tail.find('&').unwrap_or(tail.len())).unwrap_or_default()
                }
                None => "",
            };
            out.push(value.to_owned());
        }
        start = end + 1;
    }
    out
}

fn lenient_name(raw: &str) -> String {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        let hex = |at: usize| bytes.get(at).and_then(|c| (*c as char).to_digit(16));
        match (b, hex(i + 1), hex(i + 2)) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (b'+', _, _) => {
                out.push(b' ');
                i += 1;
            }
            _ => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_parameter_is_every_spelling_a_reader_could_take_for_it() {
        let p = "/t?currency=EUR&x=1&Currency=USD&curr%65ncy=GBP&currency&amount=1.00";
        assert_eq!(query_values(p, "currency"), ["EUR", "USD", "GBP", ""]);
        assert_eq!(query_values(p, "amount"), ["1.00"]);
        assert_eq!(query_values("/t?a=1;a=2", "a"), ["1;a=2", "2"], "a ; separates too, for some readers");
        assert_eq!(query_values("/t?x=1;a=2&b=3", "a"), ["2"]);
        assert_eq!(query_values("/t?a=EUR;evil&b=3", "a"), ["EUR;evil"], "every byte a reader may take");
        assert_eq!(query_values("/t?a%20b=1&a+b=2", "a b"), ["1", "2"]);
        assert!(query_values("/t", "a").is_empty());
        assert!(query_values("/t?ab=1#a=2", "a").is_empty(), "the fragment is never sent");
        assert_eq!(query_values("/t?a=%45UR", "a"), ["%45UR"], "values exactly as sent");
    }
}
