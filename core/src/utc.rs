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
}
