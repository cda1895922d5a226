//! RFC 8785 JSON Canonicalization Scheme (JCS): object members sorted by
//! their names' UTF-16 code units, no insignificant whitespace, strings with
//! the minimal escapes, numbers in ECMAScript `Number.prototype.toString`
//! form.
//!
//! Limits (as RFC 8785 itself, which assumes I-JSON): numbers are IEEE-754
//! doubles, so integers beyond 2^53 lose precision exactly as in JavaScript
//! (`9007199254740993` becomes `9007199254740992`); duplicate member names
//! keep the last value; input that is not JSON is an error (callers fall back
//! to the raw bytes).

use std::cmp::Ordering;

use serde_json::{Map, Number, Value};

/// Canonical form of a JSON document, or `None` when `input` is not JSON.
pub fn canonicalize(input: &[u8]) -> Option<Vec<u8>> {
    let value: Value = serde_json::from_slice(input).ok()?;
    let mut out = Vec::with_capacity(input.len());
    write_value(&mut out, &value);
    Some(out)
}

/// Canonical form of an already parsed value.
pub fn canonicalize_value(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    write_value(&mut out, value);
    out
}

fn write_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(n) => out.extend_from_slice(format_number(n).as_bytes()),
        Value::String(s) => write_string(out, s),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_value(out, item);
            }
            out.push(b']');
        }
        Value::Object(map) => write_object(out, map),
    }
}

fn write_object(out: &mut Vec<u8>, map: &Map<String, Value>) {
    let mut members: Vec<(&String, &Value)> = map.iter().collect();
    members.sort_by(|(a, _), (b, _)| utf16_order(a, b));
    out.push(b'{');
    for (i, (name, value)) in members.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_string(out, name);
        out.push(b':');
        write_value(out, value);
    }
    out.push(b'}');
}

fn utf16_order(a: &str, b: &str) -> Ordering {
    a.encode_utf16().cmp(b.encode_utf16())
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    for ch in s.chars() {
        match ch {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            '\u{08}' => out.extend_from_slice(b"\\b"),
            '\u{09}' => out.extend_from_slice(b"\\t"),
            '\u{0A}' => out.extend_from_slice(b"\\n"),
            '\u{0C}' => out.extend_from_slice(b"\\f"),
            '\u{0D}' => out.extend_from_slice(b"\\r"),
            c if (c as u32) < 0x20 => {
                out.extend_from_slice(format!("\\u{:04x}", c as u32).as_bytes());
            }
            c => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out.push(b'"');
}

/// ECMAScript `Number::toString` of the number taken as a double.
fn format_number(n: &Number) -> String {
    let value = match (n.as_i64(), n.as_u64(), n.as_f64()) {
        (Some(i), _, _) => i as f64,
        (_, Some(u), _) => u as f64,
        (_, _, Some(f)) => f,
        // Only reachable with arbitrary precision numbers, not enabled here.
        _ => f64::NAN,
    };
    format_double(value)
}

/// ECMAScript Number::toString(x) for a finite double (RFC 8785 §3.2.2.3).
pub fn format_double(value: f64) -> String {
    if value == 0.0 {
        return "0".to_string();
    }
    if !value.is_finite() {
        // JSON cannot carry these; never produced from parsed input.
        return "null".to_string();
    }
    let (digits, exponent) = shortest_digits(value.abs());
    let sign = if value < 0.0 { "-" } else { "" };
    format!("{sign}{}", layout(&digits, exponent))
}

/// The shortest round-tripping decimal digits `d1 d2 ... dk` (no leading or
/// trailing zeros) and `n` such that value = 0.d1d2...dk × 10^n.
fn shortest_digits(value: f64) -> (String, i32) {
    let mut buffer = ryu::Buffer::new();
    let text = buffer.format_finite(value);
    let (mantissa, exp) = match text.split_once(['e', 'E']) {
        Some((m, e)) => (m, e.parse::<i32>().unwrap_or(0)),
        None => (text, 0),
    };
    let (int_part, frac_part) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let all: String = format!("{int_part}{frac_part}");
    // value = 0.<all> × 10^(len(int_part) + exp)
    let mut point = int_part.len() as i32 + exp;
    let leading_zeros = all.bytes().take_while(|&b| b == b'0').count();
    point -= leading_zeros as i32;
    let digits = all[leading_zeros..].trim_end_matches('0').to_string();
    (digits, point)
}

fn layout(digits: &str, n: i32) -> String {
    let k = digits.len() as i32;
    if k <= n && n <= 21 {
        format!("{digits}{}", "0".repeat((n - k) as usize))
    } else if 0 < n && n <= 21 {
        let (int, frac) = digits.split_at(n as usize);
        format!("{int}.{frac}")
    } else if -6 < n && n <= 0 {
        format!("0.{}{digits}", "0".repeat((-n) as usize))
    } else {
        let e = n - 1;
        let sign = if e < 0 { '-' } else { '+' };
        let (first, rest) = digits.split_at(1);
        if rest.is_empty() {
            format!("{first}e{sign}{}", e.abs())
        } else {
            format!("{first}.{rest}e{sign}{}", e.abs())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(s: &str) -> String {
        String::from_utf8(canonicalize(s.as_bytes()).expect("valid JSON")).unwrap()
    }

    #[test]
    fn sorts_members_and_drops_whitespace() {
        assert_eq!(
            canon(r#" { "b" : [1, 2, {"z":null, "a":true}], "a": "x" } "#),
            r#"{"a":"x","b":[1,2,{"a":true,"z":null}]}"#
        );
    }

    #[test]
    fn key_order_and_whitespace_do_not_matter() {
        assert_eq!(
            canon(r#"{"amount":100,"currency":"EUR"}"#),
            canon("{\n  \"currency\": \"EUR\",\n  \"amount\": 100\n}")
        );
    }

    #[test]
    fn sorts_by_utf16_code_units_not_code_points() {
        // U+1F600 (surrogates D83D DE00) sorts before U+FB33 in UTF-16,
        // although its code point is larger.
        let out = canon(r#"{"\ufb33":1,"😀":2,"a":3}"#);
        assert_eq!(out, "{\"a\":3,\"😀\":2,\"\u{fb33}\":1}");
    }

    #[test]
    fn rfc8785_sorting_example() {
        // RFC 8785 §3.2.3.
        let input = r#"{"\u20ac":"Euro Sign","\r":"Carriage Return","\ufb33":"Hebrew Letter Dalet With Dagesh","1":"One","\ud83d\ude00":"Emoji: Grinning Face","\u0080":"Control","\u00f6":"Latin Small Letter O With Diaeresis"}"#;
        let out = canon(input);
        let order = [
            "Carriage Return",
            "One",
            "Control",
            "Latin Small Letter O With Diaeresis",
            "Euro Sign",
            "Emoji: Grinning Face",
            "Hebrew Letter Dalet With Dagesh",
        ];
        let positions: Vec<usize> = order.iter().map(|v| out.find(v).unwrap()).collect();
        assert!(positions.windows(2).all(|w| w[0] < w[1]), "{out}");
    }

    #[test]
    fn escapes_strings_minimally() {
        assert_eq!(
            canon(r#""\u0041\/\b\f\n\r\t\"\\\u001f\u00e9\u20ac""#),
            "\"A/\\b\\f\\n\\r\\t\\\"\\\\\\u001fé€\""
        );
    }

    #[test]
    fn formats_numbers_as_ecmascript() {
        let cases = [
            ("0", "0"),
            ("-0", "0"),
            ("-0.0", "0"),
            ("1", "1"),
            ("1.0", "1"),
            ("100", "100"),
            ("1e2", "100"),
            ("-1.5", "-1.5"),
            ("0.1", "0.1"),
            ("0.000001", "0.000001"),
            ("0.0000001", "1e-7"),
            ("1.5e-7", "1.5e-7"),
            ("123456789012345680000", "123456789012345680000"),
            ("1e21", "1e+21"),
            ("1.2345e22", "1.2345e+22"),
            ("9007199254740993", "9007199254740992"),
            ("9223372036854775807", "9223372036854776000"),
            ("18446744073709551615", "18446744073709552000"),
            ("333333333.33333329", "333333333.3333333"),
            ("1E30", "1e+30"),
            ("4.50", "4.5"),
            ("2e-3", "0.002"),
            ("0.000001000", "0.000001"),
            ("1.7976931348623157e308", "1.7976931348623157e+308"),
            ("5e-324", "5e-324"),
            ("-5e-324", "-5e-324"),
        ];
        for (input, expected) in cases {
            assert_eq!(canon(input), expected, "input {input}");
        }
    }

    #[test]
    fn rfc8785_number_samples() {
        // RFC 8785 Appendix B (IEEE-754 hex → expected ECMAScript string).
        let samples: [(u64, &str); 12] = [
            (0x0000000000000000, "0"),
            (0x8000000000000000, "0"),
            (0x0000000000000001, "5e-324"),
            (0x8000000000000001, "-5e-324"),
            (0x7fefffffffffffff, "1.7976931348623157e+308"),
            (0x4340000000000000, "9007199254740992"),
            (0xc340000000000000, "-9007199254740992"),
            (0x4430000000000000, "295147905179352830000"),
            (0x44b52d02c7e14af5, "9.999999999999997e+22"),
            (0x44b52d02c7e14af6, "1e+23"),
            (0x3eb0c6f7a0b5ed8d, "0.000001"),
            (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
        ];
        for (bits, expected) in samples {
            assert_eq!(
                format_double(f64::from_bits(bits)),
                expected,
                "bits {bits:#x}"
            );
        }
    }

    #[test]
    fn rejects_non_json() {
        assert!(canonicalize(b"amount=1").is_none());
        assert!(canonicalize(b"{\"a\":1").is_none());
        assert!(canonicalize(b"").is_none());
    }
}
