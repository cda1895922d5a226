//! Decoding of the module's replies into typed values; anything unexpected
//! becomes `IdemError::UnexpectedReply` instead of a panic.

use std::time::Duration;

use bytes::Bytes;
use redis::Value;

use crate::{IdemError, Outcome, StoredResponse};

pub(crate) fn parse_begin(reply: Value) -> Result<Outcome, IdemError> {
    let Value::Array(items) = reply else {
        return Err(unexpected("BEGIN reply is not an array", &reply));
    };
    let mut items = items.into_iter();
    let tag = match items.next() {
        Some(v) => text(v)?,
        None => return Err(IdemError::UnexpectedReply("empty BEGIN reply".into())),
    };
    let outcome = match tag.as_str() {
        "new" => Outcome::New {
            token: positive(next(&mut items, "token")?)?,
        },
        "in_flight" => Outcome::InFlight {
            retry_after: Duration::from_millis(non_negative(next(&mut items, "retry_after")?)?),
        },
        "replay" => {
            let status = status(next(&mut items, "status")?)?;
            let body = bytes(next(&mut items, "body")?)?;
            let headers = header_pairs(next(&mut items, "headers")?)?;
            Outcome::Replay(StoredResponse {
                status,
                body,
                headers,
            })
        }
        "mismatch" => Outcome::Mismatch,
        other => {
            return Err(IdemError::UnexpectedReply(format!(
                "unknown BEGIN outcome {other:?}"
            )))
        }
    };
    Ok(outcome)
}

/// `IDEM.TOUCH` answers the new remaining lease in ms.
pub(crate) fn parse_touch(reply: Value) -> Result<Duration, IdemError> {
    Ok(Duration::from_millis(non_negative(reply)?))
}

/// `IDEM.ABORT` answers 1 (released) or 0 (no in-progress record with the token).
pub(crate) fn parse_abort(reply: Value) -> Result<bool, IdemError> {
    match reply {
        Value::Int(1) => Ok(true),
        Value::Int(0) => Ok(false),
        other => Err(unexpected("ABORT reply", &other)),
    }
}

pub(crate) fn parse_ok(reply: Value) -> Result<(), IdemError> {
    match reply {
        Value::Okay => Ok(()),
        Value::SimpleString(s) if s == "OK" => Ok(()),
        other => Err(unexpected("expected OK", &other)),
    }
}

fn next(items: &mut impl Iterator<Item = Value>, what: &str) -> Result<Value, IdemError> {
    items
        .next()
        .ok_or_else(|| IdemError::UnexpectedReply(format!("BEGIN reply lacks {what}")))
}

fn text(value: Value) -> Result<String, IdemError> {
    match value {
        Value::SimpleString(s) => Ok(s),
        Value::BulkString(b) => {
            String::from_utf8(b).map_err(|_| IdemError::UnexpectedReply("non-UTF-8 tag".into()))
        }
        Value::Okay => Ok("OK".into()),
        other => Err(unexpected("expected a string", &other)),
    }
}

fn bytes(value: Value) -> Result<Bytes, IdemError> {
    match value {
        Value::BulkString(b) => Ok(Bytes::from(b)),
        Value::SimpleString(s) => Ok(Bytes::from(s)),
        Value::Nil => Ok(Bytes::new()),
        other => Err(unexpected("expected bytes", &other)),
    }
}

fn integer(value: Value) -> Result<i64, IdemError> {
    match value {
        Value::Int(i) => Ok(i),
        Value::BulkString(ref b) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| unexpected("expected an integer", &value)),
        other => Err(unexpected("expected an integer", &other)),
    }
}

fn non_negative(value: Value) -> Result<u64, IdemError> {
    let i = integer(value)?;
    u64::try_from(i).map_err(|_| IdemError::UnexpectedReply(format!("negative integer {i}")))
}

fn positive(value: Value) -> Result<u64, IdemError> {
    match non_negative(value)? {
        0 => Err(IdemError::UnexpectedReply("token 0".into())),
        n => Ok(n),
    }
}

fn status(value: Value) -> Result<u16, IdemError> {
    let i = integer(value)?;
    u16::try_from(i)
        .ok()
        .filter(|s| (100..=599).contains(s))
        .ok_or_else(|| IdemError::UnexpectedReply(format!("status {i} out of range")))
}

fn header_pairs(value: Value) -> Result<Vec<(String, Bytes)>, IdemError> {
    let items = match value {
        Value::Array(items) => items,
        Value::Nil => Vec::new(),
        other => return Err(unexpected("headers are not an array", &other)),
    };
    if items.len() % 2 == 1 {
        return Err(IdemError::UnexpectedReply(
            "odd number of header items".into(),
        ));
    }
    let mut pairs = Vec::with_capacity(items.len() / 2);
    let mut items = items.into_iter();
    while let (Some(name), Some(value)) = (items.next(), items.next()) {
        let name = String::from_utf8_lossy(&bytes(name)?).into_owned();
        pairs.push((name, bytes(value)?));
    }
    Ok(pairs)
}

fn unexpected(what: &str, value: &Value) -> IdemError {
    IdemError::UnexpectedReply(format!("{what}: {value:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn parses_every_begin_outcome() {
        let new = Value::Array(vec![bulk("new"), Value::Int(42)]);
        assert_eq!(parse_begin(new).unwrap(), Outcome::New { token: 42 });

        let in_flight = Value::Array(vec![bulk("in_flight"), Value::Int(1500)]);
        assert_eq!(
            parse_begin(in_flight).unwrap(),
            Outcome::InFlight {
                retry_after: Duration::from_millis(1500)
            }
        );

        let replay = Value::Array(vec![
            Value::SimpleString("replay".into()),
            Value::Int(201),
            bulk("{}"),
            Value::Array(vec![bulk("content-type"), bulk("application/json")]),
        ]);
        assert_eq!(
            parse_begin(replay).unwrap(),
            Outcome::Replay(
                StoredResponse::new(201, "{}").with_header("content-type", "application/json")
            )
        );

        let mismatch = Value::Array(vec![bulk("mismatch")]);
        assert_eq!(parse_begin(mismatch).unwrap(), Outcome::Mismatch);
    }

    #[test]
    fn rejects_malformed_begin_replies() {
        for bad in [
            Value::Nil,
            Value::Array(vec![]),
            Value::Array(vec![bulk("new")]),
            Value::Array(vec![bulk("new"), Value::Int(0)]),
            Value::Array(vec![bulk("new"), Value::Int(-3)]),
            Value::Array(vec![
                bulk("replay"),
                Value::Int(99),
                bulk(""),
                Value::Array(vec![]),
            ]),
            Value::Array(vec![
                bulk("replay"),
                Value::Int(200),
                bulk(""),
                Value::Array(vec![bulk("x")]),
            ]),
            Value::Array(vec![bulk("maybe")]),
        ] {
            assert!(
                matches!(parse_begin(bad.clone()), Err(IdemError::UnexpectedReply(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn parses_abort_and_touch() {
        assert!(parse_abort(Value::Int(1)).unwrap());
        assert!(!parse_abort(Value::Int(0)).unwrap());
        assert!(parse_abort(Value::Okay).is_err());
        assert_eq!(
            parse_touch(Value::Int(500)).unwrap(),
            Duration::from_millis(500)
        );
        assert!(parse_ok(Value::Okay).is_ok());
        assert!(parse_ok(Value::Int(1)).is_err());
    }
}
