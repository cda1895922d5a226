//! The `Idempotency-Key` header (a structured-field string such as `"abc"`,
//! or a bare token such as `abc`) and the Redis key derived from it and the
//! tenant.

use http::HeaderValue;

/// Longest key accepted, in bytes (after unquoting).
pub const MAX_KEY_BYTES: usize = 255;

/// Longest tenant accepted, in bytes (its UTF-8; a header value that is not
/// UTF-8 counts as its `tenant_of` form, NUL and hex). With [`MAX_KEY_BYTES`]
/// it bounds every Redis key the layer makes (`redis_key` at most triples a
/// byte): 1,157 bytes with the default prefix, under the 2,048 the writer's
/// mirror takes (spec/http.json).
pub const MAX_TENANT_BYTES: usize = 128;

/// Why a layer with a tenant source refused a request's tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TenantError {
    /// The source gave none, or an empty one (400 `missing_tenant`).
    Missing,
    /// Longer than [`MAX_TENANT_BYTES`] (400 `invalid_tenant`).
    TooLong,
}

/// The tenant a configured source gave, checked: absent and empty are
/// refused (they would share the anonymous scope), and so is one longer
/// than [`MAX_TENANT_BYTES`].
pub fn check_tenant(tenant: Option<String>) -> Result<String, TenantError> {
    match tenant {
        None => Err(TenantError::Missing),
        Some(tenant) if tenant.is_empty() => Err(TenantError::Missing),
        Some(tenant) if tenant.len() > MAX_TENANT_BYTES => Err(TenantError::TooLong),
        Some(tenant) => Ok(tenant),
    }
}

/// Why an `Idempotency-Key` value was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyError {
    /// The value is empty.
    Empty,
    /// Longer than [`MAX_KEY_BYTES`].
    TooLong,
    /// Neither an sf-string nor a bare token.
    Malformed,
    /// The header appears more than once.
    Repeated,
}

impl KeyError {
    /// The `detail` of the 400 problem answered for it.
    pub fn detail(&self) -> &'static str {
        match self {
            KeyError::Empty => "the Idempotency-Key header is empty",
            KeyError::TooLong => "the Idempotency-Key header is longer than 255 bytes",
            KeyError::Malformed => {
                "the Idempotency-Key header must be a structured-field string (\"...\") or a token"
            }
            KeyError::Repeated => "the Idempotency-Key header appears more than once",
        }
    }
}

impl std::fmt::Display for KeyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.detail())
    }
}

impl std::error::Error for KeyError {}

/// Parses every value of the header; exactly one must be present.
pub fn parse_key<'a>(
    mut values: impl Iterator<Item = &'a HeaderValue>,
) -> Result<Option<String>, KeyError> {
    let Some(first) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    parse_value(first.as_bytes()).map(Some)
}

/// One header value: `"sf-string"` (with `\"` and `\\` escapes) or a bare
/// run of visible ASCII without quotes, commas or semicolons.
pub fn parse_value(raw: &[u8]) -> Result<String, KeyError> {
    let value = trim_ows(raw);
    let key = match value.first() {
        Some(b'"') => unquote(value)?,
        Some(_) => bare(value)?,
        None => return Err(KeyError::Empty),
    };
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(KeyError::TooLong);
    }
    Ok(key)
}

fn trim_ows(raw: &[u8]) -> &[u8] {
    let start = raw
        .iter()
        .position(|b| !matches!(b, b' ' | b'\t'))
        .unwrap_or(raw.len());
    let end = raw
        .iter()
        .rposition(|b| !matches!(b, b' ' | b'\t'))
        .map_or(start, |i| i + 1);
    &raw[start..end]
}

fn unquote(value: &[u8]) -> Result<String, KeyError> {
    let mut out = String::with_capacity(value.len());
    let mut bytes = value[1..].iter();
    loop {
        match bytes.next() {
            None => return Err(KeyError::Malformed),
            Some(b'"') => break,
            Some(b'\\') => match bytes.next() {
                Some(&c @ (b'"' | b'\\')) => out.push(c as char),
                _ => return Err(KeyError::Malformed),
            },
            Some(&c) if (0x20..=0x7e).contains(&c) => out.push(c as char),
            Some(_) => return Err(KeyError::Malformed),
        }
    }
    // Nothing may follow the closing quote (no parameters).
    if bytes.next().is_some() {
        return Err(KeyError::Malformed);
    }
    Ok(out)
}

fn bare(value: &[u8]) -> Result<String, KeyError> {
    let ok = value
        .iter()
        .all(|&c| (0x21..=0x7e).contains(&c) && !matches!(c, b'"' | b',' | b';' | b'\\'));
    if !ok {
        return Err(KeyError::Malformed);
    }
    Ok(value.iter().map(|&c| c as char).collect())
}

/// `prefix{tenant:key}` with `%`, `:`, `{`, `}` and bytes outside visible
/// ASCII percent-encoded in both parts: distinct (tenant, key) pairs never
/// share a Redis key, and the hash tag is the whole pair, so a cluster spreads
/// keys by key, not by tenant.
pub fn redis_key(prefix: &str, tenant: &str, key: &str) -> String {
    let mut out = String::with_capacity(prefix.len() + tenant.len() + key.len() + 3);
    out.push_str(prefix);
    out.push('{');
    encode_into(&mut out, tenant);
    out.push(':');
    encode_into(&mut out, key);
    out.push('}');
    out
}

/// A header value as a tenant: the value itself when it is UTF-8, else a NUL
/// (which no header value holds) then its bytes in hex. Distinct values are
/// distinct tenants; a lossy decoding made `acct\xff` and `acct\xfe` one.
pub fn tenant_of(value: &HeaderValue) -> String {
    tenant_of_bytes(value.as_bytes())
}

/// A header field's lines as one tenant, combined as HTTP combines them
/// (`a, b`): a line a client sends ahead of the one a proxy appends makes a
/// tenant of its own, where the first line alone would have passed for the
/// proxy's. `None` when the field is absent.
pub fn tenant_of_lines<'a>(mut lines: impl Iterator<Item = &'a HeaderValue>) -> Option<String> {
    let first = lines.next()?;
    let Some(second) = lines.next() else {
        return Some(tenant_of(first));
    };
    let mut combined = first.as_bytes().to_vec();
    for line in std::iter::once(second).chain(lines) {
        combined.extend_from_slice(b", ");
        combined.extend_from_slice(line.as_bytes());
    }
    Some(tenant_of_bytes(&combined))
}

fn tenant_of_bytes(value: &[u8]) -> String {
    match std::str::from_utf8(value) {
        Ok(text) => text.to_owned(),
        Err(_) => format!("\0{}", hex::encode(value)),
    }
}

fn encode_into(out: &mut String, part: &str) {
    for &b in part.as_bytes() {
        if (0x21..=0x7e).contains(&b) && !matches!(b, b'%' | b':' | b'{' | b'}') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(s: &str) -> HeaderValue {
        HeaderValue::from_str(s).unwrap()
    }

    #[test]
    fn header_values_that_are_not_utf8_are_tenants_of_their_own() {
        let values: [&[u8]; 5] = [
            b"acct\xff",
            b"acct\xfe",
            "acct\u{fffd}".as_bytes(),
            b"acct",
            b"\xff",
        ];
        let tenants: Vec<String> = values
            .iter()
            .map(|v| tenant_of(&HeaderValue::from_bytes(v).unwrap()))
            .collect();
        for (i, a) in tenants.iter().enumerate() {
            for b in &tenants[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert_eq!(tenants[3], "acct", "UTF-8 values are unchanged");
    }

    #[test]
    fn tenants_are_present_non_empty_and_bounded() {
        assert_eq!(check_tenant(None), Err(TenantError::Missing));
        assert_eq!(check_tenant(Some(String::new())), Err(TenantError::Missing));
        let max = "a".repeat(MAX_TENANT_BYTES);
        assert_eq!(check_tenant(Some(max.clone())).as_deref(), Ok(&max[..]));
        let long = "a".repeat(MAX_TENANT_BYTES + 1);
        assert_eq!(check_tenant(Some(long)), Err(TenantError::TooLong));
        // Bytes, not characters: 64 two-byte characters and one more byte.
        let wide = format!("{}a", "\u{e9}".repeat(64));
        assert_eq!(check_tenant(Some(wide)), Err(TenantError::TooLong));
        let longest = redis_key(
            "idem:",
            &"%".repeat(MAX_TENANT_BYTES),
            &"{".repeat(MAX_KEY_BYTES),
        );
        assert_eq!(longest.len(), 1157);
    }

    #[test]
    fn a_repeated_tenant_header_is_one_combined_tenant() {
        let (a, b) = (header("acct_a"), header("acct_b"));
        assert_eq!(tenant_of_lines([&a].into_iter()).as_deref(), Some("acct_a"));
        assert_eq!(
            tenant_of_lines([&b, &a].into_iter()).as_deref(),
            Some("acct_b, acct_a"),
            "not acct_b's scope"
        );
        assert_eq!(tenant_of_lines(std::iter::empty()), None);
    }

    #[test]
    fn accepts_sf_strings_and_bare_tokens() {
        assert_eq!(parse_value(br#""abc-123""#).unwrap(), "abc-123");
        assert_eq!(parse_value(b"abc-123").unwrap(), "abc-123");
        assert_eq!(
            parse_value(b" 8e03978e-40d5-43e8-bc93-6894a57f9324 ").unwrap(),
            "8e03978e-40d5-43e8-bc93-6894a57f9324"
        );
        assert_eq!(parse_value(br#""a \"q\" \\ b""#).unwrap(), r#"a "q" \ b"#);
    }

    #[test]
    fn sf_string_and_bare_token_name_the_same_key() {
        assert_eq!(
            parse_value(br#""k1""#).unwrap(),
            parse_value(b"k1").unwrap()
        );
    }

    #[test]
    fn rejects_empty_long_and_malformed() {
        assert_eq!(parse_value(b""), Err(KeyError::Empty));
        assert_eq!(parse_value(b"   "), Err(KeyError::Empty));
        assert_eq!(parse_value(br#""""#), Err(KeyError::Empty));
        let long = "k".repeat(256);
        assert_eq!(parse_value(long.as_bytes()), Err(KeyError::TooLong));
        assert_eq!(
            parse_value(format!("\"{long}\"").as_bytes()),
            Err(KeyError::TooLong)
        );
        assert!(parse_value("k".repeat(255).as_bytes()).is_ok());
        assert_eq!(parse_value(br#""unterminated"#), Err(KeyError::Malformed));
        assert_eq!(parse_value(br#""a";x=1"#), Err(KeyError::Malformed));
        assert_eq!(parse_value(br#""bad \n escape""#), Err(KeyError::Malformed));
        assert_eq!(parse_value(b"two words"), Err(KeyError::Malformed));
        assert_eq!(parse_value(b"a,b"), Err(KeyError::Malformed));
    }

    #[test]
    fn one_header_only() {
        let (a, b) = (header("a"), header("b"));
        assert_eq!(parse_key([&a, &b].into_iter()), Err(KeyError::Repeated));
        assert_eq!(parse_key([&a].into_iter()), Ok(Some("a".into())));
        assert_eq!(parse_key(std::iter::empty()), Ok(None));
    }

    #[test]
    fn redis_keys_are_unambiguous() {
        assert_eq!(redis_key("idem:", "acct_1", "k"), "idem:{acct_1:k}");
        assert_ne!(
            redis_key("idem:", "a:b", "c"),
            redis_key("idem:", "a", "b:c")
        );
        assert_eq!(redis_key("idem:", "a:b", "c"), "idem:{a%3Ab:c}");
        assert_eq!(redis_key("idem:", "", "{x}"), "idem:{:%7Bx%7D}");
        assert_eq!(redis_key("idem:", "t é", "k"), "idem:{t%20%C3%A9:k}");
    }
}
