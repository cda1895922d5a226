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

use std::borrow::Cow;
use std::cmp::Ordering;
use std::fmt;
use std::io::Write as _;

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// Canonical form of a JSON document, or `None` when `input` is not JSON.
pub fn canonicalize(input: &[u8]) -> Option<Vec<u8>> {
    // Parsed into a tree that borrows strings without escapes from `input`;
    // serde_json accepts and reads exactly what it accepts as a `Value`.
    let node: Node<'_> = serde_json::from_slice(input).ok()?;
    let mut out = Vec::with_capacity(input.len());
    node.write(&mut out);
    Some(out)
}

/// Whether `input` is JSON already in its canonical form, so that
/// `canonicalize(input)` would give it back unchanged: checked in one pass
/// without building a tree. Only the plainest form is recognized (no
/// whitespace, ASCII without escapes, integers of at most 15 digits, members
/// in strictly ascending order, at most 64 levels deep); anything else
/// answers `false`, whatever `canonicalize` makes of it.
pub fn is_canonical(input: &[u8]) -> bool {
    let mut at = 0;
    plain::value(input, &mut at, 0) && at == input.len()
}

/// The scanner behind `is_canonical`: each function reads one element at
/// `*at` and answers whether it is in the plain canonical form.
mod plain {
    /// Deeper documents go the full way (serde_json's own limit is 128).
    const MAX_DEPTH: usize = 64;
    /// Integers of up to 15 digits are exact doubles written as they are.
    const MAX_DIGITS: usize = 15;

    pub(super) fn value(b: &[u8], at: &mut usize, depth: usize) -> bool {
        match b.get(*at) {
            Some(b'{') => depth < MAX_DEPTH && object(b, at, depth + 1),
            Some(b'[') => depth < MAX_DEPTH && array(b, at, depth + 1),
            Some(b'"') => string(b, at).is_some(),
            Some(b't') => literal(b, at, b"true"),
            Some(b'f') => literal(b, at, b"false"),
            Some(b'n') => literal(b, at, b"null"),
            Some(b'-' | b'0'..=b'9') => integer(b, at),
            _ => false,
        }
    }

    fn object(b: &[u8], at: &mut usize, depth: usize) -> bool {
        let mut previous: Option<&[u8]> = None;
        items(b, at, b'}', |b, at| {
            // ASCII names: byte order is UTF-16 code unit order.
            let Some(name) = string(b, at) else {
                return false;
            };
            if previous.is_some_and(|p| p >= name) || b.get(*at) != Some(&b':') {
                return false;
            }
            previous = Some(name);
            *at += 1;
            value(b, at, depth)
        })
    }

    fn array(b: &[u8], at: &mut usize, depth: usize) -> bool {
        items(b, at, b']', |b, at| value(b, at, depth))
    }

    /// The items of an array or object opened at `*at`, each read by
    /// `item`, separated by commas, up to `close`.
    fn items<'a>(
        b: &'a [u8],
        at: &mut usize,
        close: u8,
        mut item: impl FnMut(&'a [u8], &mut usize) -> bool,
    ) -> bool {
        *at += 1;
        if b.get(*at) == Some(&close) {
            *at += 1;
            return true;
        }
        loop {
            if !item(b, at) {
                return false;
            }
            match b.get(*at) {
                Some(b',') => *at += 1,
                Some(&c) if c == close => {
                    *at += 1;
                    return true;
                }
                _ => return false,
            }
        }
    }

    /// A string of printable ASCII (and DEL) without escapes; its content.
    fn string<'a>(b: &'a [u8], at: &mut usize) -> Option<&'a [u8]> {
        if b.get(*at) != Some(&b'"') {
            return None;
        }
        let start = *at + 1;
        let len = b[start..]
            .iter()
            .position(|&c| !(0x20..=0x7f).contains(&c) || c == b'"' || c == b'\\')?;
        let end = start + len;
        if b[end] != b'"' {
            return None;
        }
        *at = end + 1;
        Some(&b[start..end])
    }

    fn literal(b: &[u8], at: &mut usize, word: &[u8]) -> bool {
        let found = b[*at..].starts_with(word);
        *at += word.len();
        found
    }

    /// `0` or a non-zero integer without leading zeros (not `-0`).
    fn integer(b: &[u8], at: &mut usize) -> bool {
        let negative = b[*at] == b'-';
        let start = *at + usize::from(negative);
        let digits = b[start..].iter().take_while(|c| c.is_ascii_digit()).count();
        *at = start + digits;
        match b.get(start) {
            Some(b'0') => digits == 1 && !negative,
            Some(b'1'..=b'9') => digits <= MAX_DIGITS,
            _ => false,
        }
    }
}

/// Canonical form of an already parsed value.
pub fn canonicalize_value(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    write_value(&mut out, value);
    out
}

/// A parsed JSON value as `canonicalize` needs it: numbers as the doubles
/// they stand for, members in input order (sorted when written).
enum Node<'a> {
    Null,
    Bool(bool),
    Number(f64),
    String(Cow<'a, str>),
    Array(Vec<Node<'a>>),
    Object(Vec<(Cow<'a, str>, Node<'a>)>),
}

impl Node<'_> {
    fn write(self, out: &mut Vec<u8>) {
        match self {
            Node::Null => out.extend_from_slice(b"null"),
            Node::Bool(true) => out.extend_from_slice(b"true"),
            Node::Bool(false) => out.extend_from_slice(b"false"),
            Node::Number(value) => write_double(out, value),
            Node::String(s) => write_string(out, &s),
            Node::Array(items) => {
                out.push(b'[');
                for (i, item) in items.into_iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    item.write(out);
                }
                out.push(b']');
            }
            Node::Object(mut members) => {
                // Stable: of members with the same name, the last one is kept
                // (as a `Value` keeps it).
                members.sort_by(|(a, _), (b, _)| utf16_order(a, b));
                out.push(b'{');
                let mut members = members.into_iter().peekable();
                let mut first = true;
                while let Some((name, value)) = members.next() {
                    if members.peek().is_some_and(|(next, _)| *next == name) {
                        continue;
                    }
                    if !first {
                        out.push(b',');
                    }
                    first = false;
                    write_string(out, &name);
                    out.push(b':');
                    value.write(out);
                }
                out.push(b'}');
            }
        }
    }
}

impl<'de> Deserialize<'de> for Node<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(NodeVisitor)
    }
}

struct NodeVisitor;

impl<'de> Visitor<'de> for NodeVisitor {
    type Value = Node<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<Node<'de>, E> {
        Ok(Node::Null)
    }

    fn visit_bool<E>(self, v: bool) -> Result<Node<'de>, E> {
        Ok(Node::Bool(v))
    }

    // The doubles `number_value` gives for a `Number`.
    fn visit_i64<E>(self, v: i64) -> Result<Node<'de>, E> {
        Ok(Node::Number(v as f64))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Node<'de>, E> {
        Ok(Node::Number(v as f64))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Node<'de>, E> {
        Ok(Node::Number(v))
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Node<'de>, E> {
        Ok(Node::String(Cow::Borrowed(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<Node<'de>, E> {
        Ok(Node::String(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E>(self, v: String) -> Result<Node<'de>, E> {
        Ok(Node::String(Cow::Owned(v)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Node<'de>, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Node::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node<'de>, A::Error> {
        let mut members = Vec::with_capacity(map.size_hint().unwrap_or(0));
        while let Some(Name(name)) = map.next_key()? {
            members.push((name, map.next_value()?));
        }
        Ok(Node::Object(members))
    }
}

/// A member name, borrowed from the input when it has no escapes.
struct Name<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Name<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_str(NameVisitor)
    }
}

struct NameVisitor;

impl<'de> Visitor<'de> for NameVisitor {
    type Value = Name<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a member name")
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Name<'de>, E> {
        Ok(Name(Cow::Borrowed(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<Name<'de>, E> {
        Ok(Name(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E>(self, v: String) -> Result<Name<'de>, E> {
        Ok(Name(Cow::Owned(v)))
    }
}

fn write_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(n) => write_double(out, number_value(n)),
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
    let bytes = s.as_bytes();
    // Runs of bytes that need no escape are copied whole.
    let mut start = 0;
    for (i, &byte) in bytes.iter().enumerate() {
        let escape: &[u8] = match byte {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x08 => b"\\b",
            0x09 => b"\\t",
            0x0A => b"\\n",
            0x0C => b"\\f",
            0x0D => b"\\r",
            0x00..=0x1F => {
                out.extend_from_slice(&bytes[start..i]);
                let _ = write!(out, "\\u{byte:04x}");
                start = i + 1;
                continue;
            }
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..i]);
        out.extend_from_slice(escape);
        start = i + 1;
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

/// The double a parsed number stands for.
fn number_value(n: &Number) -> f64 {
    match (n.as_i64(), n.as_u64(), n.as_f64()) {
        (Some(i), _, _) => i as f64,
        (_, Some(u), _) => u as f64,
        (_, _, Some(f)) => f,
        // Only reachable with arbitrary precision numbers, not enabled here.
        _ => f64::NAN,
    }
}

/// Below 2^53 every integer is a double of its own, so its shortest
/// round-tripping digits are its decimal digits: `format_double` gives the
/// same, with allocations.
const EXACT_INTEGERS: f64 = 9_007_199_254_740_992.0;

fn write_double(out: &mut Vec<u8>, value: f64) {
    if value.trunc() == value && value.abs() < EXACT_INTEGERS {
        // `-0` is `0`, as in `format_double`.
        let _ = write!(out, "{}", value as i64);
    } else {
        out.extend_from_slice(format_double(value).as_bytes());
    }
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
    fn borrowed_tree_writes_what_the_value_path_writes() {
        let inputs = [
            r#"{"b":1,"a":{"d":[1,2.5,-0,1e300],"c":null},"a":true}"#,
            "[1e400]",
            r#"{"z":"\u00e9\n\"x\"","y":[{"b":false,"a":"\ud83d\ude00"}],"\u0000":-1.5e-7}"#,
            r#"[9007199254740991,9007199254740993,-9007199254740991,18446744073709551615,1e21,0.1]"#,
            r#"{"a":1,"b":2,"a":3,"A":4,"€":5,"😀":6,"\ufb33":7}"#,
            r#"  "plain string with \\ and \/ and \u001f"  "#,
            "[]",
            "{}",
            "true",
            "-0.0",
        ];
        for input in inputs {
            let Ok(value) = serde_json::from_str::<Value>(input) else {
                assert!(canonicalize(input.as_bytes()).is_none(), "{input}");
                continue;
            };
            let expected = String::from_utf8(canonicalize_value(&value)).unwrap();
            assert_eq!(canon(input), expected, "input {input}");
        }
    }

    #[test]
    fn recognizes_the_plain_canonical_form() {
        let canonical = [
            r#"{"amount":1250,"currency":"EUR","recipient":"acct_bench"}"#,
            r#"{"a":[1,{"b":null},[]],"b":true,"c":{},"d":-12,"e":0}"#,
            "\"text with \u{7f} and /\"",
            "[]",
            "{}",
            "0",
            "-999999999999999",
            "false",
        ];
        for input in canonical {
            assert!(is_canonical(input.as_bytes()), "{input}");
            assert_eq!(canon(input), input, "{input}");
        }
        let deep = |levels: usize| "[".repeat(levels) + &"]".repeat(levels);
        assert!(is_canonical(deep(64).as_bytes()));
        let not_recognized = [
            r#"{"b":1,"a":2}"#,
            r#"{"a":1,"a":2}"#,
            r#"{"a": 1}"#,
            " 1",
            "1 ",
            "-0",
            "1.5",
            "1e3",
            "01",
            "1000000000000000",
            r#""\n""#,
            r#""\u0041""#,
            "\"\u{e9}\"",
            "\"\x01\"",
            r#"{"a":1"#,
            r#"{"a":1}x"#,
            "[1,]",
            "tru",
            "nul",
            "",
        ];
        for input in not_recognized {
            assert!(!is_canonical(input.as_bytes()), "{input}");
        }
        assert!(!is_canonical(deep(65).as_bytes()));
        // Not recognized is not refused: the full way still canonicalizes.
        assert_eq!(canon(&deep(65)), deep(65));
        assert_eq!(canon(r#"{"b":1,"a":2}"#), r#"{"a":2,"b":1}"#);
    }

    /// Random documents, written canonically or not: whatever `is_canonical`
    /// recognizes, `canonicalize` gives back unchanged, and the canonical
    /// form of a plain document is recognized.
    #[test]
    fn what_is_recognized_is_what_canonicalize_gives_back() {
        let mut rng = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let mut recognized = 0;
        for _ in 0..20_000 {
            let mut doc = String::new();
            let plain = write_random(&mut doc, &mut next, 0);
            let input = doc.as_bytes();
            if is_canonical(input) {
                recognized += 1;
                assert_eq!(canonicalize(input).as_deref(), Some(input), "{doc}");
            }
            if plain {
                let canonical = canonicalize(input).expect("generated JSON");
                let text = String::from_utf8(canonical.clone()).unwrap();
                assert!(is_canonical(&canonical), "{doc} -> {text}");
            }
        }
        assert!(recognized > 1_000, "only {recognized} recognized");
    }

    /// Writes a random JSON document (sometimes with whitespace, unsorted or
    /// repeated names, escapes, fractions, non-ASCII); answers whether its
    /// canonical form stays in what `is_canonical` recognizes.
    fn write_random(out: &mut String, next: &mut impl FnMut(u64) -> u64, depth: usize) -> bool {
        let space = |out: &mut String, next: &mut dyn FnMut(u64) -> u64| {
            if next(20) == 0 {
                out.push(' ');
            }
        };
        match next(if depth > 3 { 5 } else { 7 }) {
            0 => {
                out.push_str(["true", "false", "null"][next(3) as usize]);
                true
            }
            1 => {
                let n = next(2_000_001) as i64 - 1_000_000;
                out.push_str(&n.to_string());
                true
            }
            2 => {
                let (text, plain) = match next(8) {
                    0 => ("1.5", false),
                    1 => ("-0", true),
                    2 => ("1e2", true),
                    3 => ("12345678901234567", false),
                    _ => ("7", true),
                };
                out.push_str(text);
                plain
            }
            3 | 4 => {
                let (text, plain) = random_string(next);
                out.push_str(&text);
                plain
            }
            5 => {
                out.push('[');
                let mut plain = true;
                for i in 0..next(4) {
                    if i > 0 {
                        out.push(',');
                    }
                    space(out, next);
                    plain &= write_random(out, next, depth + 1);
                }
                out.push(']');
                plain
            }
            _ => {
                out.push('{');
                let mut plain = true;
                for i in 0..next(4) {
                    if i > 0 {
                        out.push(',');
                    }
                    let (name, plain_name) = random_string(next);
                    out.push_str(&name);
                    space(out, next);
                    out.push(':');
                    plain &= plain_name & write_random(out, next, depth + 1);
                }
                out.push('}');
                plain
            }
        }
    }

    /// A short JSON string literal; `false` when its canonical form has an
    /// escape or non-ASCII.
    fn random_string(next: &mut impl FnMut(u64) -> u64) -> (String, bool) {
        let mut text = String::from('"');
        let mut plain = true;
        for _ in 0..next(3) {
            match next(12) {
                0 => {
                    text.push_str("\\n");
                    plain = false;
                }
                1 => text.push_str("\\u0062"),
                2 => {
                    text.push('é');
                    plain = false;
                }
                3 => text.push_str("\\/"),
                n => text.push(char::from(b'a' + n as u8)),
            }
        }
        text.push('"');
        (text, plain)
    }

    #[test]
    fn rejects_non_json() {
        assert!(canonicalize(b"amount=1").is_none());
        assert!(canonicalize(b"{\"a\":1").is_none());
        assert!(canonicalize(b"").is_none());
    }
}
