//! A completed record as `IDEM.MIRROR.PULL` hands it out, and the checks that
//! decide whether it can be stored in Postgres.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redis::Value;

/// Keys longer than this cannot be stored: a btree index entry must fit in a
/// third of an 8 KiB page. Such records are reported and left pending.
pub const MAX_KEY_BYTES: usize = 2048;

/// One completed record, ready for the upsert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirrorRecord {
    pub key: String,
    pub token: i64,
    /// Lowercase hex SHA-256 of the request fingerprint.
    pub fingerprint: String,
    pub status: i32,
    pub body: Vec<u8>,
    /// Flat `name, value, name, value, ...` as the module stores them.
    pub headers: Vec<Vec<u8>>,
    pub created_at_ms: i64,
    pub completed_at_ms: i64,
    pub expires_at_ms: i64,
}

impl MirrorRecord {
    pub fn created_at(&self) -> SystemTime {
        unix_ms(self.created_at_ms)
    }

    pub fn completed_at(&self) -> SystemTime {
        unix_ms(self.completed_at_ms)
    }

    pub fn expires_at(&self) -> SystemTime {
        unix_ms(self.expires_at_ms)
    }
}

/// Why a pulled record cannot be mirrored. It is left pending (never
/// acknowledged) so the loss stays visible in the node's pending count.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RecordError {
    #[error("the key is not UTF-8 text without NUL bytes (Postgres TEXT cannot hold it)")]
    KeyNotText,
    #[error("the key is longer than {MAX_KEY_BYTES} bytes")]
    KeyTooLong,
    #[error("malformed record: {0}")]
    Malformed(String),
}

/// A pulled record that cannot be mirrored, with its key's bytes (empty when
/// unreadable) for the log line.
#[derive(Debug)]
pub struct Rejected {
    pub key: Vec<u8>,
    pub error: RecordError,
}

/// Parses the `IDEM.MIRROR.PULL` reply: good records and rejected ones.
pub fn parse_pull_reply(reply: Value) -> Result<(Vec<MirrorRecord>, Vec<Rejected>), RecordError> {
    let Value::Array(items) = reply else {
        return Err(malformed("PULL reply is not an array"));
    };
    let mut records = Vec::with_capacity(items.len());
    let mut rejected = Vec::new();
    for item in items {
        let Value::Array(fields) = item else {
            rejected.push(Rejected {
                key: Vec::new(),
                error: malformed("record is not an array"),
            });
            continue;
        };
        match parse_record(fields) {
            Ok(record) => records.push(record),
            Err(bad) => rejected.push(bad),
        }
    }
    Ok((records, rejected))
}

/// Parses one record; a rejection keeps the key's bytes for the log line.
fn parse_record(fields: Vec<Value>) -> Result<MirrorRecord, Rejected> {
    let reject = |key: Vec<u8>, error: RecordError| Rejected { key, error };
    let fields: [Value; 9] = fields
        .try_into()
        .map_err(|_| reject(Vec::new(), malformed("record does not have 9 fields")))?;
    let [key, token, fingerprint, status, body, headers, created, completed, expires] = fields;
    let key = bytes(key, "key").map_err(|e| reject(Vec::new(), e))?;
    let key = match String::from_utf8(key) {
        Ok(key) if !key.contains('\0') => key,
        Ok(key) => return Err(reject(key.into_bytes(), RecordError::KeyNotText)),
        Err(e) => return Err(reject(e.into_bytes(), RecordError::KeyNotText)),
    };
    if key.len() > MAX_KEY_BYTES {
        return Err(reject(key.into_bytes(), RecordError::KeyTooLong));
    }
    match parse_response([
        token,
        fingerprint,
        status,
        body,
        headers,
        created,
        completed,
        expires,
    ]) {
        Ok(r) => Ok(MirrorRecord {
            key,
            token: r.token,
            fingerprint: r.fingerprint,
            status: r.status,
            body: r.body,
            headers: r.headers,
            created_at_ms: r.created_at_ms,
            completed_at_ms: r.completed_at_ms,
            expires_at_ms: r.expires_at_ms,
        }),
        Err(error) => Err(reject(key.into_bytes(), error)),
    }
}

/// Every field of a record but the key.
struct Response {
    token: i64,
    fingerprint: String,
    status: i32,
    body: Vec<u8>,
    headers: Vec<Vec<u8>>,
    created_at_ms: i64,
    completed_at_ms: i64,
    expires_at_ms: i64,
}

fn parse_response(fields: [Value; 8]) -> Result<Response, RecordError> {
    let [token, fingerprint, status, body, headers, created, completed, expires] = fields;
    let token = int(token, "token")?;
    if token <= 0 {
        return Err(malformed("token is not positive"));
    }
    let fingerprint = String::from_utf8(bytes(fingerprint, "fingerprint")?)
        .map_err(|_| malformed("fingerprint is not hex"))?;
    if !is_sha256_hex(&fingerprint) {
        return Err(malformed("fingerprint is not 64 lowercase hex digits"));
    }
    let status = i32::try_from(int(status, "status")?)
        .ok()
        .filter(|s| (100..=599).contains(s))
        .ok_or_else(|| malformed("status is not 100..599"))?;
    let Value::Array(headers) = headers else {
        return Err(malformed("headers is not an array"));
    };
    if headers.len() % 2 != 0 {
        return Err(malformed("headers has an odd length"));
    }
    let headers = headers
        .into_iter()
        .map(|h| bytes(h, "header"))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Response {
        token,
        fingerprint,
        status,
        body: bytes(body, "body")?,
        headers,
        created_at_ms: timestamp(created, "created_at")?,
        completed_at_ms: timestamp(completed, "completed_at")?,
        expires_at_ms: expiry(expires)?,
    })
}

/// Rows of records whose Redis key has no TTL (the module reports -1 after
/// `PERSIST`) are kept until 9999-12-31: cleanup never reaches them.
pub const NEVER_EXPIRES_MS: i64 = 253_402_300_799_000;

fn expiry(value: Value) -> Result<i64, RecordError> {
    match int(value.clone(), "expires_at")? {
        -1 => Ok(NEVER_EXPIRES_MS),
        _ => timestamp(value, "expires_at"),
    }
}

fn malformed(what: impl Into<String>) -> RecordError {
    RecordError::Malformed(what.into())
}

fn bytes(value: Value, field: &str) -> Result<Vec<u8>, RecordError> {
    match value {
        Value::BulkString(b) => Ok(b),
        Value::SimpleString(s) => Ok(s.into_bytes()),
        _ => Err(malformed(format!("{field} is not a string"))),
    }
}

fn int(value: Value, field: &str) -> Result<i64, RecordError> {
    let parsed = match value {
        Value::Int(i) => Some(i),
        Value::BulkString(b) => std::str::from_utf8(&b).ok().and_then(|s| s.parse().ok()),
        _ => None,
    };
    parsed.ok_or_else(|| malformed(format!("{field} is not an integer")))
}

fn timestamp(value: Value, field: &str) -> Result<i64, RecordError> {
    let ms = int(value, field)?;
    if ms < 0 {
        return Err(malformed(format!("{field} is negative")));
    }
    Ok(ms)
}

fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn unix_ms(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &[u8]) -> Value {
        Value::BulkString(s.to_vec())
    }

    fn record(key: &[u8], fingerprint: &str, headers: Vec<Value>) -> Value {
        Value::Array(vec![
            bulk(key),
            Value::Int(7),
            bulk(fingerprint.as_bytes()),
            Value::Int(201),
            bulk(&[0, 159, 146, 150]),
            Value::Array(headers),
            Value::Int(1_000),
            Value::Int(2_000),
            Value::Int(3_000),
        ])
    }

    const FP: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

    #[test]
    fn a_record_without_ttl_never_expires() {
        assert_eq!(expiry(Value::Int(-1)), Ok(NEVER_EXPIRES_MS));
        assert_eq!(expiry(Value::Int(5)), Ok(5));
        assert!(expiry(Value::Int(-2)).is_err());
    }

    #[test]
    fn parses_a_record_with_binary_body_and_headers() {
        let reply = Value::Array(vec![record(
            b"k1",
            FP,
            vec![bulk(b"content-type"), bulk(b"application/json")],
        )]);
        let (records, rejected) = parse_pull_reply(reply).expect("array");
        assert!(rejected.is_empty());
        assert_eq!(
            records,
            vec![MirrorRecord {
                key: "k1".into(),
                token: 7,
                fingerprint: FP.into(),
                status: 201,
                body: vec![0, 159, 146, 150],
                headers: vec![b"content-type".to_vec(), b"application/json".to_vec()],
                created_at_ms: 1_000,
                completed_at_ms: 2_000,
                expires_at_ms: 3_000,
            }]
        );
    }

    #[test]
    fn rejects_keys_postgres_text_cannot_hold_and_keeps_the_rest() {
        let reply = Value::Array(vec![
            record(&[0xff, 0xfe], FP, vec![]),
            record(b"a\0b", FP, vec![]),
            record(&vec![b'x'; MAX_KEY_BYTES + 1], FP, vec![]),
            record(b"good", FP, vec![]),
        ]);
        let (records, rejected) = parse_pull_reply(reply).expect("array");
        assert_eq!(records.len(), 1);
        assert_eq!(records[0].key, "good");
        let errors: Vec<_> = rejected.into_iter().map(|r| r.error).collect();
        assert_eq!(
            errors,
            vec![
                RecordError::KeyNotText,
                RecordError::KeyNotText,
                RecordError::KeyTooLong
            ]
        );
    }

    #[test]
    fn rejects_malformed_fields() {
        let uppercase = FP.to_uppercase();
        let reply = Value::Array(vec![
            record(b"k", &uppercase, vec![]),
            record(b"k", FP, vec![bulk(b"lonely-name")]),
            Value::Array(vec![bulk(b"short")]),
            Value::Int(3),
        ]);
        let (records, rejected) = parse_pull_reply(reply).expect("array");
        assert!(records.is_empty());
        assert_eq!(rejected.len(), 4);
        assert!(rejected
            .iter()
            .all(|r| matches!(r.error, RecordError::Malformed(_))));
        assert!(parse_pull_reply(Value::Okay).is_err());
    }
}
