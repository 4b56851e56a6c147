//! Wall-clock helpers producing Nomad's time encodings (unix ns ints, RFC3339Nano strings, Go durations).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Current time as unix nanoseconds (Nomad's `CreateTime`/`ModifyTime`/`TaskEvent.Time` unit).
pub fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// Current time as unix seconds (JWT `iat`/`nbf`, `Node.StatusUpdatedAt`).
pub fn now_secs() -> i64 {
    now_ns() / 1_000_000_000
}

/// Formats unix nanoseconds as Go's `time.RFC3339Nano` in UTC, e.g. `2026-08-20T14:03:13.31Z`
/// (trailing zeros of the fraction trimmed, no fraction when it is zero).
pub fn rfc3339_nano(ns: i64) -> String {
    let secs = ns.div_euclid(1_000_000_000);
    let frac = ns.rem_euclid(1_000_000_000);
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let mut out = format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}",
        sod / 3600,
        (sod % 3600) / 60,
        sod % 60
    );
    if frac != 0 {
        let f = format!("{frac:09}");
        out.push('.');
        out.push_str(f.trim_end_matches('0'));
    }
    out.push('Z');
    out
}

/// Current time as RFC3339Nano (see [`rfc3339_nano`]).
pub fn now_rfc3339() -> String {
    rfc3339_nano(now_ns())
}

fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// Error for a malformed Go duration string.
#[derive(Debug, thiserror::Error)]
#[error("invalid duration {0:?}")]
pub struct DurationError(pub String);

/// Parses a Go `time.ParseDuration` string ("300ms", "1m30s", "2h", "0") into a [`Duration`].
pub fn parse_go_duration(s: &str) -> Result<Duration, DurationError> {
    let err = || DurationError(s.to_string());
    let s = s.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    if s.is_empty() {
        return Err(err());
    }
    let mut total: f64 = 0.0;
    let mut rest = s;
    while !rest.is_empty() {
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(err)?;
        if num_end == 0 {
            return Err(err());
        }
        let num: f64 = rest[..num_end].parse().map_err(|_| err())?;
        rest = &rest[num_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let unit = &rest[..unit_end];
        rest = &rest[unit_end..];
        let mult = match unit {
            "ns" => 1.0,
            "us" | "µs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            _ => return Err(err()),
        };
        total += num * mult;
    }
    Ok(Duration::from_nanos(total as u64))
}

/// Formats a duration like Go's `time.Duration.String()` for whole-second values ("30m0s", "5s").
pub fn go_duration_string(d: Duration) -> String {
    let ms = d.as_millis();
    if !ms.is_multiple_of(1000) || ms == 0 {
        if ms == 0 {
            return "0s".into();
        }
        return format!("{}ms", ms);
    }
    let s = d.as_secs();
    let (h, m, s) = (s / 3600, (s % 3600) / 60, s % 60);
    if h > 0 {
        format!("{h}h{m}m{s}s")
    } else if m > 0 {
        format!("{m}m{s}s")
    } else {
        format!("{s}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_rfc3339_nano() {
        assert_eq!(
            rfc3339_nano(1_787_234_593_310_000_000),
            "2026-08-20T14:03:13.31Z"
        );
        assert_eq!(rfc3339_nano(0), "1970-01-01T00:00:00Z");
    }

    #[test]
    fn parses_go_durations() {
        assert_eq!(parse_go_duration("1m30s").unwrap(), Duration::from_secs(90));
        assert_eq!(
            parse_go_duration("250ms").unwrap(),
            Duration::from_millis(250)
        );
        assert!(parse_go_duration("5x").is_err());
        assert_eq!(go_duration_string(Duration::from_secs(1800)), "30m0s");
    }
}
