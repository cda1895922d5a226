//! Request fingerprints: SHA-256 over a length-prefixed framing of method,
//! path and query, a configured list of headers, and the body (optionally
//! RFC 8785-canonical JSON), so that no two different requests share a
//! framing.

use std::borrow::Cow;

use http::header::{HeaderMap, HeaderName, CONTENT_TYPE};
use http::{Method, Uri};
use sha2::{Digest, Sha256};

use crate::canonical_json;

/// Version tag at the start of every framing; changing the framing changes it.
const FRAMING_TAG: &[u8] = b"idem-fingerprint-v1";
const BODY_RAW: u8 = 0;
const BODY_CANONICAL_JSON: u8 = 1;

/// The 32 bytes sent to `IDEM.BEGIN` as the fingerprint.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// A fingerprint from its 32 bytes.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Fingerprint(bytes)
    }

    /// The 32 bytes sent to `IDEM.BEGIN`.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// What the module and the Postgres mirror keep: lowercase hex of the
    /// SHA-256 of these bytes.
    pub fn stored_hex(&self) -> String {
        stored_hex(&self.0)
    }
}

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fingerprint({})", hex::encode(self.0))
    }
}

/// Lowercase hex SHA-256 of any fingerprint bytes sent to `IDEM.BEGIN`.
pub fn stored_hex(fingerprint: &[u8]) -> String {
    hex_of(&stored_digest(fingerprint))
}

/// SHA-256 of fingerprint bytes: what the module and Postgres keep.
pub(crate) fn stored_digest(fingerprint: &[u8]) -> [u8; 32] {
    Sha256::digest(fingerprint).into()
}

/// Lowercase hex of a digest.
pub(crate) fn hex_of(digest: &[u8; 32]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut hex = Vec::with_capacity(2 * digest.len());
    for &byte in digest {
        hex.extend_from_slice(&[
            DIGITS[usize::from(byte >> 4)],
            DIGITS[usize::from(byte & 15)],
        ]);
    }
    String::from_utf8(hex).expect("hex digits are ASCII")
}

/// Which parts of a request go into its fingerprint.
///
/// ```
/// use http::{HeaderMap, HeaderValue, Method};
/// use idem_client::Fingerprinter;
///
/// let fingerprinter = Fingerprinter::new().canonical_json(true);
/// let mut headers = HeaderMap::new();
/// headers.insert("content-type", HeaderValue::from_static("application/json"));
/// let uri = "/payments?v=1".parse().unwrap();
/// let fp = |body: &[u8]| fingerprinter.fingerprint(&Method::POST, &uri, &headers, body);
/// // Member order and whitespace do not matter in canonical JSON ...
/// assert_eq!(fp(br#"{"amount":10,"to":"bob"}"#), fp(br#"{ "to": "bob", "amount": 10 }"#));
/// // ... values do.
/// assert_ne!(fp(br#"{"amount":10,"to":"bob"}"#), fp(br#"{"amount":11,"to":"bob"}"#));
/// // `as_bytes()` goes to IDEM.BEGIN; the module keeps SHA-256 of them.
/// assert_eq!(fp(b"{}").stored_hex().len(), 64);
/// ```
#[derive(Debug, Clone, Default)]
pub struct Fingerprinter {
    headers: Vec<HeaderName>,
    canonical_json: bool,
}

impl Fingerprinter {
    /// Method, path and query, and the raw body; no headers.
    pub fn new() -> Self {
        Fingerprinter::default()
    }

    /// Also fingerprint this header (all its values, in order; absent and
    /// empty differ).
    pub fn header(mut self, name: HeaderName) -> Self {
        if !self.headers.contains(&name) {
            self.headers.push(name);
        }
        self
    }

    /// Canonicalize JSON bodies (content type `application/json` or
    /// `*/*+json`) with RFC 8785 so that member order and whitespace do not
    /// change the fingerprint. A body that does not parse is taken raw.
    pub fn canonical_json(mut self, enabled: bool) -> Self {
        self.canonical_json = enabled;
        self
    }

    /// The fingerprint of a request: `uri` contributes its path and query,
    /// `headers` only the configured names, `body` the bytes as sent (or
    /// their canonical JSON).
    pub fn fingerprint(
        &self,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Fingerprint {
        let mut hasher = Sha256::new();
        hasher.update(FRAMING_TAG);
        field(&mut hasher, method.as_str().as_bytes());
        let path_and_query = uri.path_and_query().map_or("/", |pq| pq.as_str());
        field(&mut hasher, path_and_query.as_bytes());
        count(&mut hasher, self.headers.len());
        for name in &self.headers {
            field(&mut hasher, name.as_str().as_bytes());
            let values = headers.get_all(name);
            count(&mut hasher, values.iter().count());
            for value in values {
                field(&mut hasher, value.as_bytes());
            }
        }
        match self.canonical_body(headers, body) {
            Some(canonical) => {
                hasher.update([BODY_CANONICAL_JSON]);
                field(&mut hasher, &canonical);
            }
            None => {
                hasher.update([BODY_RAW]);
                field(&mut hasher, body);
            }
        }
        Fingerprint(hasher.finalize().into())
    }

    /// The body's canonical JSON; a body already canonical is taken as it
    /// is (the same bytes, without a tree built to find out).
    fn canonical_body<'b>(&self, headers: &HeaderMap, body: &'b [u8]) -> Option<Cow<'b, [u8]>> {
        if !self.canonical_json || !is_json(headers) {
            return None;
        }
        if canonical_json::is_canonical(body) {
            return Some(Cow::Borrowed(body));
        }
        canonical_json::canonicalize(body).map(Cow::Owned)
    }
}

fn is_json(headers: &HeaderMap) -> bool {
    let Some(content_type) = headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let essence = content_type.split(';').next().unwrap_or_default().trim();
    let suffix = essence
        .len()
        .checked_sub(5)
        .and_then(|at| essence.get(at..));
    essence.eq_ignore_ascii_case("application/json")
        || (essence.contains('/') && suffix.is_some_and(|s| s.eq_ignore_ascii_case("+json")))
}

fn field(hasher: &mut Sha256, bytes: &[u8]) {
    count(hasher, bytes.len());
    hasher.update(bytes);
}

fn count(hasher: &mut Sha256, n: usize) {
    hasher.update((n as u64).to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn json_headers() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/json; charset=utf-8"),
        );
        h
    }

    fn fp(
        f: &Fingerprinter,
        method: Method,
        uri: &str,
        headers: &HeaderMap,
        body: &str,
    ) -> Fingerprint {
        f.fingerprint(&method, &uri.parse().unwrap(), headers, body.as_bytes())
    }

    #[test]
    fn same_request_same_fingerprint() {
        let f = Fingerprinter::new();
        let h = HeaderMap::new();
        assert_eq!(
            fp(&f, Method::POST, "/p?x=1", &h, "{}"),
            fp(&f, Method::POST, "/p?x=1", &h, "{}")
        );
    }

    #[test]
    fn each_part_changes_the_fingerprint() {
        let f = Fingerprinter::new();
        let h = HeaderMap::new();
        let base = fp(&f, Method::POST, "/p?x=1", &h, "{}");
        assert_ne!(base, fp(&f, Method::PATCH, "/p?x=1", &h, "{}"));
        assert_ne!(base, fp(&f, Method::POST, "/p?x=2", &h, "{}"));
        assert_ne!(base, fp(&f, Method::POST, "/q?x=1", &h, "{}"));
        assert_ne!(base, fp(&f, Method::POST, "/p?x=1", &h, "{ }"));
    }

    #[test]
    fn framing_is_unambiguous() {
        // Moving bytes between path and body must not collide.
        let f = Fingerprinter::new();
        let h = HeaderMap::new();
        assert_ne!(
            fp(&f, Method::POST, "/ab", &h, "c"),
            fp(&f, Method::POST, "/a", &h, "bc")
        );
    }

    #[test]
    fn configured_headers_count_and_others_do_not() {
        let account = HeaderName::from_static("x-account-id");
        let f = Fingerprinter::new().header(account.clone());
        let mut a = HeaderMap::new();
        a.insert(&account, HeaderValue::from_static("acct_1"));
        let mut b = a.clone();
        b.insert(&account, HeaderValue::from_static("acct_2"));
        let mut c = a.clone();
        c.insert("x-request-id", HeaderValue::from_static("r1"));
        let empty = HeaderMap::new();
        let mut blank = HeaderMap::new();
        blank.insert(&account, HeaderValue::from_static(""));

        let base = fp(&f, Method::POST, "/p", &a, "{}");
        assert_ne!(base, fp(&f, Method::POST, "/p", &b, "{}"));
        assert_eq!(base, fp(&f, Method::POST, "/p", &c, "{}"));
        assert_ne!(
            fp(&f, Method::POST, "/p", &empty, "{}"),
            fp(&f, Method::POST, "/p", &blank, "{}")
        );
    }

    #[test]
    fn canonical_json_ignores_member_order_and_whitespace() {
        let f = Fingerprinter::new().canonical_json(true);
        let h = json_headers();
        let a = fp(
            &f,
            Method::POST,
            "/p",
            &h,
            r#"{"amount":100,"currency":"EUR"}"#,
        );
        let b = fp(
            &f,
            Method::POST,
            "/p",
            &h,
            "{ \"currency\": \"EUR\",\n \"amount\": 1e2 }",
        );
        assert_eq!(a, b);
        let c = fp(
            &f,
            Method::POST,
            "/p",
            &h,
            r#"{"amount":101,"currency":"EUR"}"#,
        );
        assert_ne!(a, c);
    }

    #[test]
    fn canonical_json_needs_json_content_type() {
        let f = Fingerprinter::new().canonical_json(true);
        let text = HeaderMap::new();
        assert_ne!(
            fp(&f, Method::POST, "/p", &text, r#"{"a":1,"b":2}"#),
            fp(&f, Method::POST, "/p", &text, r#"{"b":2,"a":1}"#)
        );
        let mut problem = HeaderMap::new();
        problem.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/merge-patch+json"),
        );
        assert_eq!(
            fp(&f, Method::POST, "/p", &problem, r#"{"a":1,"b":2}"#),
            fp(&f, Method::POST, "/p", &problem, r#"{"b":2,"a":1}"#)
        );
    }

    #[test]
    fn unparsable_json_is_taken_raw_and_differs_from_canonical() {
        let f = Fingerprinter::new().canonical_json(true);
        let h = json_headers();
        assert_ne!(
            fp(&f, Method::POST, "/p", &h, "{bad"),
            fp(&f, Method::POST, "/p", &h, "{bad ")
        );
        // The raw/canonical tag keeps a raw body from colliding with a
        // canonical one of the same bytes.
        let raw = Fingerprinter::new();
        assert_ne!(
            fp(&f, Method::POST, "/p", &h, "{}"),
            fp(&raw, Method::POST, "/p", &h, "{}")
        );
    }

    #[test]
    fn stored_hex_is_sha256_of_the_fingerprint_bytes() {
        let f = Fingerprint::from_bytes([7u8; 32]);
        assert_eq!(f.stored_hex(), hex::encode(Sha256::digest([7u8; 32])));
        assert_eq!(f.stored_hex().len(), 64);
    }
}
