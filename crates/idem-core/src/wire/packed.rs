//! A stored response packed into one bulk string, the replay of
//! `IDEM.BEGIN ... PACKED`: one frame for a client to read instead of four
//! plus two per header.
//!
//! ```text
//! body | (name-len name value-len value)... | status | header-count | body-len
//! ```
//! Lengths and the count are 4-byte, the status 2-byte, all big-endian. The
//! body comes first so that a reader keeps it by truncating the buffer; the
//! fixed trailer (`TRAILER` bytes) says where it ends.

use super::{StoredResponse, WireError};
use crate::{Completed, Header};

/// status (2) + header count (4) + body length (4).
const TRAILER: usize = 10;

/// Responses up to this size are packed on the stack: an allocation and its
/// free through Redis' allocator cost more than the packing itself.
const ON_STACK: usize = 2048;
/// Most responses fit a smaller buffer, which costs less to clear.
const ON_STACK_SMALL: usize = 512;

/// Hands the packed form of `c` to `f` (the module writes it as one bulk
/// string).
pub fn with_packed<R>(c: &Completed, f: impl FnOnce(&[u8]) -> R) -> R {
    match packed_len(c) {
        len if len <= ON_STACK_SMALL => on_stack::<ON_STACK_SMALL, R>(c, len, f),
        len if len <= ON_STACK => on_stack::<ON_STACK, R>(c, len, f),
        _ => f(&pack(c)),
    }
}

/// Packs `c` (`len` bytes) into a stack buffer of `N` bytes.
fn on_stack<const N: usize, R>(c: &Completed, len: usize, f: impl FnOnce(&[u8]) -> R) -> R {
    let mut buf = [0u8; N];
    pack_into(c, &mut buf[..len]);
    f(&buf[..len])
}

/// The packed form of `c`.
pub fn pack(c: &Completed) -> Vec<u8> {
    let mut out = vec![0; packed_len(c)];
    pack_into(c, &mut out);
    out
}

fn packed_len(c: &Completed) -> usize {
    let headers: usize = c
        .headers
        .iter()
        .map(|h| 8 + h.name.len() + h.value.len())
        .sum();
    c.body.len() + headers + TRAILER
}

/// Writes the packed form into `out`, exactly `packed_len(c)` bytes.
fn pack_into(c: &Completed, out: &mut [u8]) {
    let mut at = 0;
    let mut put = |bytes: &[u8]| {
        out[at..at + bytes.len()].copy_from_slice(bytes);
        at += bytes.len();
    };
    put(&c.body);
    for h in &c.headers {
        put(&len32(h.name.len()));
        put(&h.name);
        put(&len32(h.value.len()));
        put(&h.value);
    }
    put(&c.status.to_be_bytes());
    put(&len32(c.headers.len()));
    put(&len32(c.body.len()));
}

/// A packed response, checked and read in place: `unpack` turns it into
/// owned headers, a reader that keeps `bytes` shared (the client, with
/// `Bytes`) slices it instead.
#[derive(Debug, Clone, Copy)]
pub struct Packed<'a> {
    pub status: u16,
    pub body: &'a [u8],
    /// The header fields, checked to hold exactly `count` name-value pairs.
    fields: &'a [u8],
    count: usize,
}

impl<'a> Packed<'a> {
    /// Checks the whole packing: status, lengths, and every header.
    pub fn parse(bytes: &'a [u8]) -> Result<Packed<'a>, WireError> {
        let bad = |what: &str| WireError::new(format!("packed replay: {what}"));
        let Some(fields_end) = bytes.len().checked_sub(TRAILER) else {
            return Err(bad("shorter than its trailer"));
        };
        let trailer = &bytes[fields_end..];
        let status = u16::from_be_bytes([trailer[0], trailer[1]]);
        let count = u32_at(trailer, 2);
        let body_len = u32_at(trailer, 6);
        if !crate::record::STATUS_RANGE.contains(&status) {
            return Err(bad(&format!("status {status} out of range")));
        }
        if body_len > fields_end {
            return Err(bad("body runs past the headers"));
        }
        // Each header takes at least its two length prefixes: a count beyond
        // that is a lie, and must not size an allocation.
        if count > (fields_end - body_len) / 8 {
            return Err(bad("more headers than bytes"));
        }
        let fields = &bytes[body_len..fields_end];
        let mut rest = fields;
        for _ in 0..count {
            take(&mut rest).ok_or_else(|| bad("header name cut short"))?;
            take(&mut rest).ok_or_else(|| bad("header value cut short"))?;
        }
        if !rest.is_empty() {
            return Err(bad("bytes left after the headers"));
        }
        Ok(Packed {
            status,
            body: &bytes[..body_len],
            fields,
            count,
        })
    }

    /// The headers' `(name, value)` pairs, in stored order.
    pub fn headers(&self) -> impl ExactSizeIterator<Item = (&'a [u8], &'a [u8])> {
        let mut rest = self.fields;
        (0..self.count).map(move |_| {
            // `parse` checked every pair; `unwrap_or_default` is never taken.
            let name = take(&mut rest).unwrap_or_default();
            let value = take(&mut rest).unwrap_or_default();
            (name, value)
        })
    }
}

/// Reads a packed response; the body stays in `bytes`' allocation.
pub fn unpack(mut bytes: Vec<u8>) -> Result<StoredResponse, WireError> {
    let packed = Packed::parse(&bytes)?;
    let (status, body_len) = (packed.status, packed.body.len());
    let headers = packed
        .headers()
        .map(|(name, value)| Header {
            name: name.to_vec(),
            value: value.to_vec(),
        })
        .collect();
    bytes.truncate(body_len);
    Ok(StoredResponse {
        status,
        body: bytes,
        headers,
    })
}

fn len32(n: usize) -> [u8; 4] {
    // Responses are bounded by `RESPONSE_LIMIT` (512 MiB), far below 4 GiB.
    u32::try_from(n).unwrap_or(u32::MAX).to_be_bytes()
}

fn u32_at(b: &[u8], at: usize) -> usize {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) as usize
}

/// One length-prefixed string off the front of `rest`.
fn take<'a>(rest: &mut &'a [u8]) -> Option<&'a [u8]> {
    let len = u32_at(rest.get(..4)?, 0);
    let end = len.checked_add(4)?;
    let s = rest.get(4..end)?;
    *rest = &rest[end..];
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::test_support::{any_completed, completed};
    use crate::MirrorState;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(20_000))]

        #[test]
        fn pack_then_unpack_round_trips(c in any_completed(300)) {
            prop_assert_eq!(with_packed(&c, <[u8]>::to_vec), pack(&c));
            let got = unpack(pack(&c)).unwrap();
            prop_assert_eq!(got.status, c.status);
            prop_assert_eq!(got.body, c.body);
            prop_assert_eq!(got.headers, c.headers);
        }

        /// A valid packing with one byte changed and its end maybe cut:
        /// an error, or a response that packs back to exactly those bytes.
        #[test]
        fn damaged_packs_fail_or_round_trip(
            c in any_completed(40),
            at in any::<prop::sample::Index>(),
            byte: u8,
            cut in 0usize..12,
        ) {
            let mut bytes = pack(&c);
            let i = at.index(bytes.len());
            bytes[i] = byte;
            bytes.truncate(bytes.len().saturating_sub(cut));
            if let Ok(r) = unpack(bytes.clone()) {
                let again = Completed {
                    status: r.status,
                    body: r.body,
                    headers: r.headers,
                    completed_at: 1,
                    mirror: MirrorState::Pending,
                };
                prop_assert_eq!(pack(&again), bytes);
            }
        }
    }

    #[test]
    fn layout_is_as_documented() {
        let c = completed(201, b"{}".to_vec(), vec![(b"a".to_vec(), b"bc".to_vec())]);
        assert_eq!(
            pack(&c),
            b"{}\0\0\0\x01a\0\0\0\x02bc\0\xc9\0\0\0\x01\0\0\0\x02".to_vec()
        );
    }

    #[test]
    fn every_buffer_size_packs_the_same() {
        for len in [
            0,
            ON_STACK_SMALL - TRAILER,
            ON_STACK_SMALL - TRAILER + 1,
            ON_STACK - TRAILER,
            ON_STACK - TRAILER + 1,
            3 * ON_STACK,
        ] {
            let c = completed(200, vec![7; len], vec![]);
            let packed = with_packed(&c, <[u8]>::to_vec);
            assert_eq!(packed.len(), len + TRAILER);
            assert_eq!(unpack(packed).unwrap().body, c.body);
        }
    }

    #[test]
    fn malformed_packs_are_errors() {
        let good = pack(&completed(
            200,
            b"body".to_vec(),
            vec![(b"n".to_vec(), b"v".to_vec())],
        ));
        let mut cases = vec![Vec::new(), good[..9].to_vec(), good[1..].to_vec()];
        let mut with = |at_end: usize, bytes: &[u8]| {
            let mut b = good.clone();
            let at = b.len() - at_end;
            b[at..at + bytes.len()].copy_from_slice(bytes);
            cases.push(b);
        };
        with(10, &99u16.to_be_bytes()); // status
        with(8, &2u32.to_be_bytes()); // one header more than there is
        with(8, &0u32.to_be_bytes()); // bytes left over
        with(8, &u32::MAX.to_be_bytes()); // absurd count
        with(4, &100u32.to_be_bytes()); // body past the end
        with(4, &5u32.to_be_bytes()); // body overlaps the header
        for bad in cases {
            assert!(unpack(bad.clone()).is_err(), "{bad:?}");
        }
    }
}
