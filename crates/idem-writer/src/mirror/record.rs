//! A completed record as the writer stores it in Postgres, and the checks
//! that decide whether a pulled record (read by `idem_core::wire`) can be
//! stored there: the key must be TEXT within `MAX_KEY_BYTES`, and an expiry
//! of -1 (no TTL) becomes `NEVER_EXPIRES_MS`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_core::record::NO_EXPIRY;
use idem_core::wire::{parse_pull_batch, Frame, PulledRecord};
use idem_core::State;
use redis::Value;

/// Keys longer than this cannot be stored: a btree index entry must fit in a
/// third of an 8 KiB page. Such records are reported and left pending.
pub const MAX_KEY_BYTES: usize = 2048;

/// One completed record, ready for the upsert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirrorRecord {
    /// The Redis key (a pulled key that is not UTF-8, or too long, is not
    /// mirrored).
    pub key: String,
    /// The fencing token the record was completed under; a row only moves
    /// to a larger one.
    pub token: i64,
    /// Lowercase hex SHA-256 of the request fingerprint.
    pub fingerprint: String,
    /// The HTTP status of the stored response.
    pub status: i32,
    /// The stored response body.
    pub body: Vec<u8>,
    /// Flat `name, value, name, value, ...` as the module stores them.
    pub headers: Vec<Vec<u8>>,
    /// When the key was first begun (Unix ms).
    pub created_at_ms: i64,
    /// When the response was stored (Unix ms).
    pub completed_at_ms: i64,
    /// When the Redis key expires (Unix ms); [`NEVER_EXPIRES_MS`] for a key
    /// without TTL.
    pub expires_at_ms: i64,
}

impl MirrorRecord {
    /// `created_at_ms` as a time.
    pub fn created_at(&self) -> SystemTime {
        unix_ms(self.created_at_ms)
    }

    /// `completed_at_ms` as a time.
    pub fn completed_at(&self) -> SystemTime {
        unix_ms(self.completed_at_ms)
    }

    /// `expires_at_ms` as a time.
    pub fn expires_at(&self) -> SystemTime {
        unix_ms(self.expires_at_ms)
    }

    /// About the bytes the record adds to an upsert: its variable-length
    /// fields, and 64 for the fixed ones and the framing.
    pub fn size(&self) -> usize {
        let headers: usize = self.headers.iter().map(|h| h.len() + 4).sum();
        self.key.len() + self.fingerprint.len() + self.body.len() + headers + 64
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

/// Parses the `IDEM.MIRROR.PULL` reply (through `idem_core::wire`): good
/// records and rejected ones.
pub fn parse_pull_reply(reply: &Value) -> Result<(Vec<MirrorRecord>, Vec<Rejected>), RecordError> {
    let frame = Frame::from(reply);
    let parsed = parse_pull_batch(&frame).map_err(|e| malformed(e.to_string()))?;
    let entries = frame.array("PULL reply").unwrap_or_default();
    let mut records = Vec::with_capacity(parsed.len());
    let mut rejected = Vec::new();
    for (entry, result) in entries.iter().zip(parsed) {
        let checked = result
            .map_err(|e| Rejected {
                key: raw_key(entry),
                error: malformed(e.to_string()),
            })
            .and_then(to_row);
        match checked {
            Ok(record) => records.push(record),
            Err(bad) => rejected.push(bad),
        }
    }
    Ok((records, rejected))
}

/// The key's bytes of an entry that did not parse, if they are readable.
fn raw_key(entry: &Frame) -> Vec<u8> {
    entry
        .array("PULL entry")
        .ok()
        .and_then(|fields| fields.first())
        .and_then(|key| key.bytes("key").ok())
        .map(<[u8]>::to_vec)
        .unwrap_or_default()
}

/// Applies the Postgres rules to one pulled record; a rejection keeps the
/// key's bytes for the log line.
fn to_row(pulled: PulledRecord) -> Result<MirrorRecord, Rejected> {
    let reject = |key: Vec<u8>, error: RecordError| Rejected { key, error };
    let PulledRecord { key, record } = pulled;
    let key = match String::from_utf8(key) {
        Ok(key) if !key.contains('\0') => key,
        Ok(key) => return Err(reject(key.into_bytes(), RecordError::KeyNotText)),
        Err(e) => return Err(reject(e.into_bytes(), RecordError::KeyNotText)),
    };
    if key.len() > MAX_KEY_BYTES {
        return Err(reject(key.into_bytes(), RecordError::KeyTooLong));
    }
    let State::Completed(c) = record.state else {
        return Err(reject(
            key.into_bytes(),
            malformed("record is not completed"),
        ));
    };
    let numbers = (|| {
        Ok::<_, RecordError>([
            signed(record.token, "token")?,
            signed(record.created_at, "created_at")?,
            signed(c.completed_at, "completed_at")?,
            expiry(record.expires_at)?,
        ])
    })();
    let [token, created_at_ms, completed_at_ms, expires_at_ms] = match numbers {
        Ok(numbers) => numbers,
        Err(error) => return Err(reject(key.into_bytes(), error)),
    };
    Ok(MirrorRecord {
        key,
        token,
        fingerprint: hex::encode(record.fingerprint.digest()),
        status: c.status.into(),
        body: c.body,
        headers: c
            .headers
            .into_iter()
            .flat_map(|h| [h.name, h.value])
            .collect(),
        created_at_ms,
        completed_at_ms,
        expires_at_ms,
    })
}

/// Rows of records whose Redis key has no TTL (the module reports -1 after
/// `PERSIST`), or one beyond this date, are kept until 9999-12-31: cleanup
/// never reaches them.
pub const NEVER_EXPIRES_MS: i64 = 253_402_300_799_000;

/// A key may carry any TTL Redis accepts (up to 2^63 ms); later than
/// 9999-12-31 it is stored as that date, which Postgres' timestamps and both
/// layouts hold (passed on as it was, it wrapped around to a past date, and
/// cleanup deleted the row of a live key).
fn expiry(at: u64) -> Result<i64, RecordError> {
    match at {
        NO_EXPIRY => Ok(NEVER_EXPIRES_MS),
        at => Ok(signed(at, "expires_at")?.min(NEVER_EXPIRES_MS)),
    }
}

/// Postgres `bigint` columns hold what the module writes (below 2^53).
fn signed(v: u64, field: &str) -> Result<i64, RecordError> {
    i64::try_from(v).map_err(|_| malformed(format!("{field} {v} does not fit a bigint")))
}

fn malformed(what: impl Into<String>) -> RecordError {
    RecordError::Malformed(what.into())
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
        assert_eq!(expiry(NO_EXPIRY), Ok(NEVER_EXPIRES_MS));
        assert_eq!(expiry(5), Ok(5));
        assert!(expiry(u64::MAX - 1).is_err());
        let mut reply = record(b"k", FP, vec![]);
        if let Value::Array(fields) = &mut reply {
            fields[8] = Value::Int(-1);
        }
        let (records, _) = parse_pull_reply(&Value::Array(vec![reply])).expect("array");
        assert_eq!(records[0].expires_at_ms, NEVER_EXPIRES_MS);
    }

    #[test]
    fn an_expiry_past_9999_is_kept_as_9999() {
        for far in [
            NEVER_EXPIRES_MS as u64 + 1,
            18_448_321_910_510_000,
            i64::MAX as u64,
        ] {
            assert_eq!(expiry(far), Ok(NEVER_EXPIRES_MS), "{far}");
        }
        let mut reply = record(b"k", FP, vec![]);
        if let Value::Array(fields) = &mut reply {
            fields[8] = Value::Int(18_448_321_910_510_000);
        }
        let (records, _) = parse_pull_reply(&Value::Array(vec![reply])).expect("array");
        assert_eq!(records[0].expires_at_ms, NEVER_EXPIRES_MS);
    }

    #[test]
    fn parses_a_record_with_binary_body_and_headers() {
        let reply = Value::Array(vec![record(
            b"k1",
            FP,
            vec![bulk(b"content-type"), bulk(b"application/json")],
        )]);
        let (records, rejected) = parse_pull_reply(&reply).expect("array");
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
        let (records, rejected) = parse_pull_reply(&reply).expect("array");
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
        let not_hex = "z".repeat(64);
        let reply = Value::Array(vec![
            record(b"k", &not_hex, vec![]),
            record(b"k", FP, vec![bulk(b"lonely-name")]),
            Value::Array(vec![bulk(b"short")]),
            Value::Int(3),
        ]);
        let (records, rejected) = parse_pull_reply(&reply).expect("array");
        assert!(records.is_empty());
        assert_eq!(rejected.len(), 4);
        assert!(rejected
            .iter()
            .all(|r| matches!(r.error, RecordError::Malformed(_))));
        assert_eq!(rejected[0].key, b"k", "the log line names a readable key");
        assert!(parse_pull_reply(&Value::Okay).is_err());
    }
}
