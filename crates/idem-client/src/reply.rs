//! The client's view of the module's replies: `idem_core::wire` reads them,
//! this file only converts into the client's types (`Outcome`, `Duration`,
//! `Bytes`); anything unexpected becomes `IdemError::UnexpectedReply`.

use std::time::Duration;

use bytes::Bytes;
use idem_core::wire::{BeginReply, Frame, WireError};
use redis::Value;

use crate::{IdemError, Outcome, StoredResponse};

/// Takes the reply by value: a replayed body moves into the outcome uncopied.
pub(crate) fn parse_begin(reply: Value) -> Result<Outcome, IdemError> {
    let outcome = match BeginReply::parse_owned(Frame::from(reply)).map_err(unexpected)? {
        BeginReply::New { token } => Outcome::New { token },
        BeginReply::InFlight { retry_after_ms } => Outcome::InFlight {
            retry_after: Duration::from_millis(retry_after_ms),
        },
        BeginReply::Replay(stored) => Outcome::Replay(stored.into()),
        BeginReply::Mismatch => Outcome::Mismatch,
    };
    Ok(outcome)
}

impl From<idem_core::wire::StoredResponse> for StoredResponse {
    fn from(stored: idem_core::wire::StoredResponse) -> Self {
        StoredResponse {
            status: stored.status,
            body: Bytes::from(stored.body),
            headers: stored
                .headers
                .into_iter()
                .map(|h| {
                    let name = String::from_utf8_lossy(&h.name).into_owned();
                    (name, Bytes::from(h.value))
                })
                .collect(),
        }
    }
}

/// `IDEM.TOUCH` answers the new remaining lease in ms.
pub(crate) fn parse_touch(reply: &Value) -> Result<Duration, IdemError> {
    let ms = Frame::from(reply).int("TOUCH reply").map_err(unexpected)?;
    u64::try_from(ms)
        .map(Duration::from_millis)
        .map_err(|_| IdemError::UnexpectedReply(format!("TOUCH reply {ms} is negative")))
}

/// `IDEM.ABORT` answers 1 (released) or 0 (no in-progress record with the token).
pub(crate) fn parse_abort(reply: &Value) -> Result<bool, IdemError> {
    match reply {
        Value::Int(1) => Ok(true),
        Value::Int(0) => Ok(false),
        other => Err(IdemError::UnexpectedReply(format!(
            "ABORT reply: {other:?}"
        ))),
    }
}

pub(crate) fn parse_ok(reply: &Value) -> Result<(), IdemError> {
    match Frame::from(reply) {
        Frame::Simple(s) if s == "OK" => Ok(()),
        other => Err(IdemError::UnexpectedReply(format!(
            "expected OK: {other:?}"
        ))),
    }
}

fn unexpected(err: WireError) -> IdemError {
    IdemError::UnexpectedReply(err.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn converts_every_begin_outcome() {
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
    fn malformed_begin_replies_are_unexpected() {
        for bad in [
            Value::Nil,
            Value::Array(vec![bulk("new"), Value::Int(-3)]),
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
        assert!(parse_abort(&Value::Int(1)).unwrap());
        assert!(!parse_abort(&Value::Int(0)).unwrap());
        assert!(parse_abort(&Value::Okay).is_err());
        assert_eq!(
            parse_touch(&Value::Int(500)).unwrap(),
            Duration::from_millis(500)
        );
        assert!(parse_touch(&Value::Int(-1)).is_err());
        assert!(parse_ok(&Value::Okay).is_ok());
        assert!(parse_ok(&Value::Int(1)).is_err());
    }
}
