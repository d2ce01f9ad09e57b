//! Unix time as ISO 8601 UTC text, without a date library: models (and
//! operators) read dates better than epochs, and the filter must stay small.

/// Unix seconds as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn iso_utc(unix_s: u64) -> String {
    let secs = i64::try_from(unix_s).unwrap_or(i64::MAX / 1000);
    let text = iso_utc_ms(secs.saturating_mul(1000));
    // Drop the ".000" of whole seconds.
    format!("{}Z", text.get(..19).unwrap_or(&text))
}

/// Unix milliseconds as `YYYY-MM-DDTHH:MM:SS.mmmZ`.
pub fn iso_utc_ms(ms: i64) -> String {
    let (secs, milli) = (ms.div_euclid(1000), ms.rem_euclid(1000));
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{milli:03}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// An RFC 3339 date-time (`2026-12-01T10:00:00Z`, `…T11:00:00.5+01:00`) as unix seconds,
/// fractions cut (an expiry read this way is never later than stated). `None` for anything
/// else, or a time before 1970.
pub fn parse_rfc3339(text: &str) -> Option<u64> {
    let b = text.trim().as_bytes();
    let num = |from: usize, len: usize| -> Option<i64> {
        let digits = b.get(from..from + len)?;
        digits.iter().all(u8::is_ascii_digit).then(|| digits.iter().fold(0i64, |n, d| n * 10 + i64::from(d - b'0')))
    };
    let sep = |at: usize, want: &[u8]| b.get(at).is_some_and(|c| want.contains(c));
    if !(sep(4, b"-") && sep(7, b"-") && sep(10, b"Tt ") && sep(13, b":") && sep(16, b":")) {
        return None;
    }
    let (y, mo, d, h, mi, s) = (num(0, 4)?, num(5, 2)?, num(8, 2)?, num(11, 2)?, num(14, 2)?, num(17, 2)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || s > 60 {
        return None;
    }
    let mut at = 19;
    if b.get(at) == Some(&b'.') {
        at += 1;
        let start = at;
        while b.get(at).is_some_and(u8::is_ascii_digit) {
            at += 1;
        }
        if at == start {
            return None;
        }
    }
    let offset = match b.get(at..)? {
        [b'Z' | b'z'] => 0,
        [sign @ (b'+' | b'-'), _, _, b':', _, _] => {
            let (oh, om) = (num(at + 1, 2)?, num(at + 4, 2)?);
            if oh > 23 || om > 59 {
                return None;
            }
            let minutes = oh * 60 + om;
            if *sign == b'+' {
                minutes * 60
            } else {
                -minutes * 60
            }
        }
        _ => return None,
    };
    let days = days_from_civil(y, mo, d);
    if civil_from_days(days) != (y, mo, d) {
        return None; // 2026-02-30 and the like
    }
    let unix = days * 86_400 + h * 3600 + mi * 60 + s - offset;
    u64::try_from(unix).ok()
}

/// (year, month, day) → days since 1970-01-01 (Howard Hinnant's `days_from_civil`).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Days since 1970-01-01 → (year, month, day), proleptic Gregorian
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_dates() {
        assert_eq!(iso_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(iso_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(iso_utc_ms(1_753_500_000_250), "2025-07-26T03:20:00.250Z");
        assert_eq!(iso_utc_ms(-1), "1969-12-31T23:59:59.999Z");
        assert_eq!(iso_utc_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(iso_utc_ms(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(iso_utc_ms(1_767_225_599_999), "2025-12-31T23:59:59.999Z");
    }

    #[test]
    fn rfc3339_round_trips_and_refuses_what_it_is_not() {
        for unix in [0u64, 951_782_400, 1_753_500_000, 1_796_044_551] {
            assert_eq!(parse_rfc3339(&iso_utc(unix)), Some(unix));
        }
        assert_eq!(parse_rfc3339("2025-07-26T04:20:00.999+01:00"), Some(1_753_500_000));
        assert_eq!(parse_rfc3339("2025-07-26t03:20:00z"), Some(1_753_500_000));
        assert_eq!(parse_rfc3339("2025-07-25T22:20:00-05:00"), Some(1_753_500_000));
        for bad in [
            "",
            "2025-07-26",
            "2025-07-26T03:20:00",
            "2025-02-30T00:00:00Z",
            "2025-13-01T00:00:00Z",
            "1969-12-31T23:59:59Z",
            "2025-07-26T03:20:00.Z",
            "2025-07-26T03:20:00+0100",
            "1753500000",
        ] {
            assert_eq!(parse_rfc3339(bad), None, "{bad}");
        }
    }
}
