//! The client's view of the module's replies: `idem_core::wire` reads them,
//! this file only converts into the client's types (`Outcome`, `Duration`,
//! `Bytes`); anything unexpected becomes `IdemError::UnexpectedReply`.

use std::time::Duration;

use bytes::Bytes;
use idem_core::wire::{BeginReply, Frame, Packed, Taken, WireError};
use redis::Value;

use crate::{IdemError, Outcome, StoredResponse};

/// Takes the reply by value: a replayed body moves into the outcome uncopied
/// (a packed replay's body and header values share its one buffer).
pub(crate) fn parse_begin(reply: Value) -> Result<Outcome, IdemError> {
    let frame = match BeginReply::take_packed(Frame::from(reply)).map_err(unexpected)? {
        Taken::Packed(packed) => return unpack_shared(Bytes::from(packed)).map(Outcome::Replay),
        Taken::Other(frame) => frame,
    };
    let outcome = match BeginReply::parse_unpacked(frame).map_err(unexpected)? {
        BeginReply::New { token } => Outcome::New { token },
        BeginReply::InFlight { retry_after_ms } => Outcome::InFlight {
            retry_after: Duration::from_millis(retry_after_ms),
        },
        BeginReply::Replay(stored) => Outcome::Replay(stored.into()),
        BeginReply::Mismatch => Outcome::Mismatch,
    };
    Ok(outcome)
}

/// A packed replay read in place: the body and the header values are slices
/// of `packed`, not copies.
fn unpack_shared(packed: Bytes) -> Result<StoredResponse, IdemError> {
    let view = Packed::parse(&packed).map_err(unexpected)?;
    Ok(StoredResponse {
        status: view.status,
        body: packed.slice_ref(view.body),
        headers: view
            .headers()
            .map(|(name, value)| (header_name(name), packed.slice_ref(value)))
            .collect(),
    })
}

/// A stored header name as the client's `String` (the module stores only
/// names that were valid HTTP; anything else is read lossily, never refused).
fn header_name(name: &[u8]) -> String {
    String::from_utf8_lossy(name).into_owned()
}

impl From<idem_core::wire::StoredResponse> for StoredResponse {
    fn from(stored: idem_core::wire::StoredResponse) -> Self {
        StoredResponse {
            status: stored.status,
            body: Bytes::from(stored.body),
            headers: stored
                .headers
                .into_iter()
                .map(|h| (header_name(&h.name), Bytes::from(h.value)))
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

    /// The reply the module writes for a packed replay of `c`.
    fn packed_reply(c: &idem_core::Completed) -> Value {
        use idem_core::wire::{Begin, Recorder, ReplayLayout};
        let mut recorder = Recorder::default();
        Begin::Replay(c).write(&mut recorder, ReplayLayout::Packed);
        match recorder.into_frames().pop() {
            Some(Frame::Array(items)) => match &items[..] {
                [_, Frame::Bulk(packed)] => {
                    Value::Array(vec![bulk("replay"), Value::BulkString(packed.clone())])
                }
                other => panic!("not a packed replay: {other:?}"),
            },
            other => panic!("not a packed replay: {other:?}"),
        }
    }

    #[test]
    fn a_packed_replay_is_read_in_place_as_the_response_stored() {
        let header = |name: &[u8], value: &[u8]| idem_core::Header {
            name: name.to_vec(),
            value: value.to_vec(),
        };
        let cases = [
            (204, Vec::new(), Vec::new()),
            (
                201,
                br#"{"id":"pay_1"}"#.to_vec(),
                vec![
                    header(b"content-type", b"application/json"),
                    header(b"set-cookie", b"a=1"),
                    header(b"set-cookie", b""),
                    header(b"x-\xff", b"\x00\xfe"),
                ],
            ),
            (599, vec![0, 255, 13, 10], vec![header(b"", b"v")]),
        ];
        for (status, body, headers) in cases {
            let stored = idem_core::Completed {
                status,
                body,
                headers,
                completed_at: 1,
                mirror: idem_core::MirrorState::Pending,
            };
            // What the four-field replay of the same record reads as.
            let owned = idem_core::wire::StoredResponse {
                status,
                body: stored.body.clone(),
                headers: stored.headers.clone(),
            };
            let expected = Outcome::Replay(StoredResponse::from(owned));
            let reply = packed_reply(&stored);
            let Value::Array(items) = &reply else {
                unreachable!()
            };
            let Value::BulkString(packed) = &items[1] else {
                unreachable!()
            };
            let buffer = packed.as_ptr_range();
            let got = parse_begin(reply).unwrap();
            assert_eq!(got, expected);
            // Read in place: the body and the header values point into the
            // buffer the reply arrived in.
            let Outcome::Replay(got) = got else {
                unreachable!()
            };
            let inside = |b: &Bytes| b.is_empty() || buffer.contains(&b.as_ptr());
            assert!(inside(&got.body), "the body was copied");
            assert!(
                got.headers.iter().all(|(_, v)| inside(v)),
                "a value was copied"
            );

            // A damaged packing is refused, not read.
            let Value::Array(mut items) = packed_reply(&stored) else {
                unreachable!()
            };
            let Value::BulkString(packed) = &mut items[1] else {
                unreachable!()
            };
            // One more body byte than there is room for before the headers.
            let last = packed.last_mut().expect("a trailer");
            *last = last.wrapping_add(1);
            assert!(matches!(
                parse_begin(Value::Array(items)),
                Err(IdemError::UnexpectedReply(_))
            ));
        }
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
