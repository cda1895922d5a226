//! The module's wire protocol, owned in one place: each reply shape has one
//! writer (the module writes through `ReplySink`) and one reader (clients
//! read `Frame`s, or `redis::Value`s with the `redis` feature), and the two
//! are held together by round-trip property tests.
//!
//! | reply | writer | reader |
//! |---|---|---|
//! | `IDEM.BEGIN` outcome | `Begin::write` | `BeginReply::parse` |
//! | a replay with `PACKED` | `packed::with_packed` | `packed::unpack` (`Packed` in place) |
//! | `IDEM.GET` record | `write_record` | `parse_record` |
//! | `IDEM.MIRROR.PULL` batch | `write_pull_batch` | `parse_pull_batch` |
//! | error replies | `Error` (`Display`) | `ErrorCode::from_reply` |

mod begin;
mod code;
mod frame;
mod packed;
mod pulled;
#[cfg(feature = "redis")]
mod redis_value;
mod view;

pub use begin::{Begin, BeginReply, ReplayLayout, StoredResponse, Taken};
pub use code::ErrorCode;
pub use frame::{Frame, Recorder, WireError};
pub use packed::Packed;
pub use pulled::{parse_pull_batch, write_pull_batch, PulledRecord};
#[cfg(feature = "redis")]
pub use redis_value::{GetReply, PullReply};
pub use view::{parse_record, write_record};

/// Where a reply is written: the module's reply context, or a `Recorder`.
pub trait ReplySink {
    /// Starts an array of `len` elements (the next `len` values).
    fn array(&mut self, len: usize);
    fn int(&mut self, v: i64);
    fn bulk(&mut self, b: &[u8]);
    /// A status reply such as `OK` (no CR, LF or NUL).
    fn simple(&mut self, s: &'static std::ffi::CStr);
    fn null(&mut self);
}

/// Unsigned values are written as integers, saturating at `i64::MAX`.
fn uint(sink: &mut impl ReplySink, v: u64) {
    sink.int(i64::try_from(v).unwrap_or(i64::MAX));
}

/// An absolute expiry on the wire: Unix ms, or -1 for a key without TTL.
fn write_expiry(sink: &mut impl ReplySink, at: u64) {
    if at == crate::record::NO_EXPIRY {
        sink.int(-1);
    } else {
        uint(sink, at);
    }
}

fn read_expiry(f: &Frame, what: &str) -> Result<u64, WireError> {
    match f.int(what)? {
        -1 => Ok(crate::record::NO_EXPIRY),
        at => u64::try_from(at).map_err(|_| WireError::new(format!("{what} is negative"))),
    }
}

/// Headers as a flat `name, value, ...` array.
fn write_headers(sink: &mut impl ReplySink, headers: &[crate::Header]) {
    sink.array(headers.len() * 2);
    for h in headers {
        sink.bulk(&h.name);
        sink.bulk(&h.value);
    }
}

fn read_headers(f: &Frame) -> Result<Vec<crate::Header>, WireError> {
    let items = match f {
        Frame::Null => return Ok(Vec::new()),
        f => f.array("headers")?,
    };
    if items.len() % 2 == 1 {
        return Err(WireError::new("headers: odd number of items"));
    }
    items
        .chunks(2)
        .map(|p| {
            Ok(crate::Header {
                name: p[0].bytes("header name")?.to_vec(),
                value: p[1].bytes("header value")?.to_vec(),
            })
        })
        .collect()
}

fn read_status(f: &Frame) -> Result<u16, WireError> {
    let s = f.int("status")?;
    u16::try_from(s)
        .ok()
        .filter(|s| crate::record::STATUS_RANGE.contains(s))
        .ok_or_else(|| WireError::new(format!("status {s} out of range")))
}

fn read_fingerprint(f: &Frame) -> Result<[u8; 32], WireError> {
    let text = f.bytes("fingerprint")?;
    let bytes = hex::decode(text).map_err(|_| WireError::new("fingerprint is not hex"))?;
    bytes
        .try_into()
        .map_err(|_| WireError::new("fingerprint is not 32 bytes"))
}

fn read_uint(f: &Frame, what: &str) -> Result<u64, WireError> {
    u64::try_from(f.int(what)?).map_err(|_| WireError::new(format!("{what} is negative")))
}

/// Test data shared by the wire's and the codec's tests.
#[cfg(test)]
pub(crate) mod test_support {
    use crate::{Completed, Header, MirrorState};
    use proptest::prelude::*;

    pub fn completed(status: u16, body: Vec<u8>, headers: Vec<(Vec<u8>, Vec<u8>)>) -> Completed {
        Completed {
            status,
            body,
            headers: headers
                .into_iter()
                .map(|(name, value)| Header { name, value })
                .collect(),
            completed_at: 1,
            mirror: MirrorState::Pending,
        }
    }

    /// Any storable response: status 100..=599, a body of up to `max_body`
    /// bytes, up to 4 headers.
    pub fn any_completed(max_body: usize) -> impl Strategy<Value = Completed> {
        let bytes = |range| proptest::collection::vec(any::<u8>(), range);
        (
            100u16..600,
            bytes(0..max_body),
            proptest::collection::vec((bytes(0..12), bytes(0..12)), 0..5),
        )
            .prop_map(|(status, body, headers)| completed(status, body, headers))
    }
}
