//! What a command answers: a JSON document and its text form, and the exit
//! code; times as RFC 3339 and byte sizes for people.

use std::process::ExitCode;

use crate::exit::Code;

/// A command's result, printed by `finish`.
pub struct Outcome {
    pub json: serde_json::Value,
    pub text: String,
    pub code: Code,
}

impl Outcome {
    pub fn ok(json: serde_json::Value, text: String) -> Outcome {
        Outcome {
            json,
            text,
            code: Code::Ok,
        }
    }

    pub fn finish(self, json: bool) -> ExitCode {
        if json {
            println!("{:#}", self.json);
        } else {
            print!("{}", self.text);
        }
        self.code.into()
    }
}

/// Unix milliseconds as RFC 3339 (UTC, milliseconds).
pub fn time(ms: u64) -> String {
    i64::try_from(ms)
        .ok()
        .and_then(|ms| jiff::Timestamp::from_millisecond(ms).ok())
        .map_or_else(|| format!("{ms} ms"), |t| format!("{t:.3}"))
}

/// A duration in ms as people read it: `850 ms`, `12.3 s`, `4 min 05 s`,
/// `3 h 02 min`.
pub fn age(ms: u64) -> String {
    match ms {
        0..1_000 => format!("{ms} ms"),
        1_000..60_000 => format!("{:.1} s", ms as f64 / 1000.0),
        60_000..3_600_000 => format!("{} min {:02} s", ms / 60_000, ms % 60_000 / 1000),
        _ => format!("{} h {:02} min", ms / 3_600_000, ms % 3_600_000 / 60_000),
    }
}

/// `--since`: RFC 3339 or Unix milliseconds, as Unix milliseconds.
pub fn parse_time(text: &str) -> Result<u64, String> {
    if let Ok(ms) = text.parse::<u64>() {
        return Ok(ms);
    }
    let at: jiff::Timestamp = text.parse().map_err(|e| {
        format!("--since {text:?} is neither RFC 3339 (2026-12-04T12:00:00Z) nor Unix ms: {e}")
    })?;
    u64::try_from(at.as_millisecond()).map_err(|_| format!("--since {text:?} is before 1970"))
}

/// The current time in Unix milliseconds.
pub fn now_ms() -> u64 {
    u64::try_from(jiff::Timestamp::now().as_millisecond()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_read_and_print() {
        assert_eq!(parse_time("1764849600000"), Ok(1_764_849_600_000));
        assert_eq!(parse_time("2025-12-04T12:00:00Z"), Ok(1_764_849_600_000));
        assert_eq!(
            parse_time("2025-12-04T13:00:00+01:00"),
            Ok(1_764_849_600_000)
        );
        assert!(parse_time("yesterday").is_err());
        assert!(parse_time("1969-12-31T23:59:59Z").is_err());
        assert_eq!(time(1_764_849_600_123), "2025-12-04T12:00:00.123Z");
        assert_eq!(age(61_500), "1 min 01 s");
        assert_eq!(age(7_380_000), "2 h 03 min");
    }
}
