//! The `IDEM.BEGIN` reply: `["new", token]`, `["in_flight", retry_after_ms]`,
//! `["replay", status, body, headers]` (or, with `PACKED`, `["replay",
//! packed]`) or `["mismatch"]`. Outcome words are bulk strings, so Lua
//! scripts compare them as plain strings.

use super::packed::{unpack, with_packed};
use super::{read_headers, read_status, uint, write_headers, Frame, ReplySink, WireError};
use crate::{Completed, Header};

/// How a replay is laid out; the caller picks it (`IDEM.BEGIN ... PACKED`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ReplayLayout {
    /// `["replay", status, body, headers]`: what every client understands.
    #[default]
    Fields,
    /// `["replay", packed]`, the response in one bulk string (`wire::packed`).
    Packed,
}

/// A BEGIN outcome as the module writes it (the replay borrows the record).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Begin<'a> {
    New { token: u64 },
    InFlight { retry_after_ms: u64 },
    Replay(&'a Completed),
    Mismatch,
}

/// A BEGIN outcome as a client reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BeginReply {
    New { token: u64 },
    InFlight { retry_after_ms: u64 },
    Replay(StoredResponse),
    Mismatch,
}

/// A stored response as a replay carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub status: u16,
    pub body: Vec<u8>,
    pub headers: Vec<Header>,
}

/// What `BeginReply::take_packed` found.
#[derive(Debug)]
pub enum Taken {
    /// A packed replay's bytes.
    Packed(Vec<u8>),
    /// Any other reply, untouched.
    Other(Frame),
}

fn is_replay(items: &[Frame]) -> bool {
    items.first().and_then(|f| f.bytes("BEGIN outcome").ok()) == Some(b"replay")
}

impl Begin<'_> {
    pub fn write(&self, sink: &mut impl ReplySink, layout: ReplayLayout) {
        match self {
            Begin::New { token } => {
                sink.array(2);
                sink.bulk(b"new");
                uint(sink, *token);
            }
            Begin::InFlight { retry_after_ms } => {
                sink.array(2);
                sink.bulk(b"in_flight");
                uint(sink, *retry_after_ms);
            }
            Begin::Replay(c) if layout == ReplayLayout::Packed => {
                sink.array(2);
                sink.bulk(b"replay");
                with_packed(c, |packed| sink.bulk(packed));
            }
            Begin::Replay(c) => {
                sink.array(4);
                sink.bulk(b"replay");
                sink.int(c.status.into());
                sink.bulk(&c.body);
                write_headers(sink, &c.headers);
            }
            Begin::Mismatch => {
                sink.array(1);
                sink.bulk(b"mismatch");
            }
        }
    }
}

impl BeginReply {
    /// As `parse`, but a replayed body is moved out of the frame, not copied.
    pub fn parse_owned(frame: Frame) -> Result<BeginReply, WireError> {
        match BeginReply::take_packed(frame)? {
            Taken::Packed(packed) => unpack(packed).map(BeginReply::Replay),
            Taken::Other(frame) => BeginReply::parse_unpacked(frame),
        }
    }

    /// `parse_owned` of what `take_packed` gave back (any reply but a packed
    /// replay).
    pub fn parse_unpacked(frame: Frame) -> Result<BeginReply, WireError> {
        let mut items = match frame {
            Frame::Array(items) if is_replay(&items) && items.len() == 4 => items,
            frame => return BeginReply::parse(&frame),
        };
        let status = read_status(&items[1])?;
        let headers = read_headers(&items[3])?;
        let body = std::mem::replace(&mut items[2], Frame::Null).into_bytes("body")?;
        Ok(BeginReply::Replay(StoredResponse {
            status,
            body,
            headers,
        }))
    }

    /// The packed replay's bytes, moved out of the frame (read them with
    /// `unpack` or `Packed::parse`), or the frame back when it is another
    /// reply or a four-field replay.
    pub fn take_packed(frame: Frame) -> Result<Taken, WireError> {
        match frame {
            Frame::Array(mut items) if is_replay(&items) && items.len() == 2 => {
                let packed =
                    std::mem::replace(&mut items[1], Frame::Null).into_bytes("packed replay")?;
                Ok(Taken::Packed(packed))
            }
            other => Ok(Taken::Other(other)),
        }
    }

    pub fn parse(frame: &Frame) -> Result<BeginReply, WireError> {
        let items = frame.array("BEGIN reply")?;
        let Some((tag, rest)) = items.split_first() else {
            return Err(WireError::new("empty BEGIN reply"));
        };
        let positive = |f: &Frame, what: &str| match f.int(what)? {
            n if n > 0 => Ok(n as u64),
            n => Err(WireError::new(format!("{what} {n} is not positive"))),
        };
        match (tag.text("BEGIN outcome")?, rest) {
            ("new", [token]) => Ok(BeginReply::New {
                token: positive(token, "token")?,
            }),
            ("in_flight", [ms]) => Ok(BeginReply::InFlight {
                retry_after_ms: positive(ms, "retry_after")?,
            }),
            ("replay", [packed]) => {
                unpack(packed.bytes("packed replay")?.to_vec()).map(BeginReply::Replay)
            }
            ("replay", [status, body, headers]) => Ok(BeginReply::Replay(StoredResponse {
                status: read_status(status)?,
                body: body.bytes("body")?.to_vec(),
                headers: read_headers(headers)?,
            })),
            ("mismatch", []) => Ok(BeginReply::Mismatch),
            (tag, _) => Err(WireError::new(format!(
                "BEGIN outcome {tag:?} with {} fields",
                rest.len()
            ))),
        }
    }
}

impl From<Begin<'_>> for BeginReply {
    fn from(b: Begin<'_>) -> BeginReply {
        match b {
            Begin::New { token } => BeginReply::New { token },
            Begin::InFlight { retry_after_ms } => BeginReply::InFlight { retry_after_ms },
            Begin::Replay(c) => BeginReply::Replay(StoredResponse {
                status: c.status,
                body: c.body.clone(),
                headers: c.headers.clone(),
            }),
            Begin::Mismatch => BeginReply::Mismatch,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::test_support::any_completed;
    use crate::wire::Recorder;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn write_then_parse_round_trips(
            kind in 0..4u8,
            packed: bool,
            n in 1..(1u64 << 53),
            c in any_completed(64),
        ) {
            let b = match kind {
                0 => Begin::New { token: n },
                1 => Begin::InFlight { retry_after_ms: n },
                2 => Begin::Replay(&c),
                _ => Begin::Mismatch,
            };
            let layout = if packed { ReplayLayout::Packed } else { ReplayLayout::Fields };
            let mut r = Recorder::default();
            b.write(&mut r, layout);
            let frames = r.into_frames();
            prop_assert_eq!(frames.len(), 1);
            prop_assert_eq!(BeginReply::parse(&frames[0]), Ok(BeginReply::from(b)));
            prop_assert_eq!(BeginReply::parse_owned(frames[0].clone()), Ok(BeginReply::from(b)));
        }
    }

    #[test]
    fn malformed_replies_are_errors() {
        let bulk = |s: &str| Frame::Bulk(s.as_bytes().to_vec());
        for bad in [
            Frame::Null,
            Frame::Array(vec![]),
            Frame::Array(vec![bulk("new")]),
            Frame::Array(vec![bulk("new"), Frame::Int(0)]),
            Frame::Array(vec![
                bulk("replay"),
                Frame::Int(99),
                bulk(""),
                Frame::Array(vec![]),
            ]),
            Frame::Array(vec![
                bulk("replay"),
                Frame::Int(200),
                bulk(""),
                Frame::Array(vec![bulk("x")]),
            ]),
            Frame::Array(vec![
                bulk("replay"),
                Frame::Int(200),
                Frame::Int(5),
                Frame::Array(vec![]),
            ]),
            Frame::Array(vec![bulk("replay"), Frame::Int(200), bulk("")]),
            Frame::Array(vec![bulk("replay"), Frame::Int(200)]),
            Frame::Array(vec![bulk("replay"), bulk("short")]),
            Frame::Array(vec![bulk("maybe")]),
            Frame::Array(vec![bulk("mismatch"), Frame::Int(1)]),
        ] {
            assert!(BeginReply::parse(&bad).is_err(), "{bad:?}");
            assert!(BeginReply::parse_owned(bad.clone()).is_err(), "{bad:?}");
        }
    }
}
