//! Parses human durations for flags: `500ms`, `30s`, `15m`, `24h`, `7d`,
//! and sums of them such as `1h30m`.

use std::time::Duration;

/// A duration as the command line takes it: whole numbers with a unit
/// (`ms`, `s`, `m`, `h`, `d`), summed (`1h30m`). The message says what is
/// wrong.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("empty duration".into());
    }
    let mut total = Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(format!("{text:?}: expected a number before {rest:?}"));
        }
        let (number, tail) = rest.split_at(digits);
        let value: u64 = number
            .parse()
            .map_err(|_| format!("{text:?}: number too large"))?;
        let unit_len = tail.bytes().take_while(u8::is_ascii_alphabetic).count();
        let (unit, tail) = tail.split_at(unit_len);
        let unit_ms: u64 = match unit {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            "" => return Err(format!("{text:?}: missing unit (ms, s, m, h, d)")),
            other => return Err(format!("{text:?}: unknown unit {other:?}")),
        };
        let ms = value
            .checked_mul(unit_ms)
            .ok_or_else(|| format!("{text:?}: too long"))?;
        total = total
            .checked_add(Duration::from_millis(ms))
            .ok_or_else(|| format!("{text:?}: too long"))?;
        rest = tail;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units_and_sums() {
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5_400)));
        assert_eq!(parse_duration("2d"), Ok(Duration::from_secs(172_800)));
    }

    #[test]
    fn rejects_missing_or_unknown_units() {
        assert!(parse_duration("30").is_err());
        assert!(parse_duration("3 weeks").is_err());
        assert!(parse_duration("h").is_err());
        assert!(parse_duration("").is_err());
        assert!(parse_duration("5y").is_err());
    }
}
