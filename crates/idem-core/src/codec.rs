//! Versioned binary encoding of a record (RDB, DUMP/RESTORE, AOF, replication).
//!
//! Layout: one format byte, then that format's fields. A new format gets a
//! new byte and keeps decoding every older one.
//!
//! v1 (the layout bincode 1.x wrote, now encoded and decoded here): integers
//! fixed-width little-endian; a byte string is a u64 length, then the bytes.
//! `fingerprint[32] token:u64 created_at:u64 expires_at:u64 state:u32`, then
//! for state 0 (in progress) `lease_until:u64`, for state 1 (completed)
//! `status:u16 body headers:u64 (name value)* completed_at:u64 mirror:u32`
//! (0 pending, 1 mirrored).
//!
//! v2 (`FORMAT_SENT`): v1's layout, but the fingerprint field holds the 32
//! bytes the client sent, not their SHA-256 (`Fingerprint::Sent`). Only
//! replication effects use it (`encode_effect_into`, under the module's
//! `effect-format 2`), so a write on a primary with replicas or an AOF
//! hashes nothing; RDB, DUMP, an AOF rewrite and DEBUG DIGEST always write
//! v1, the digest.
use crate::{Completed, Error, Fingerprint, Header, MirrorState, Record, State};

/// Format byte of an encoding whose fingerprint is the digest.
pub const FORMAT_V1: u8 = 1;
/// Format byte of an encoding whose fingerprint is the 32 bytes sent.
pub const FORMAT_SENT: u8 = 2;

/// The v1 encoding of `record` (its fingerprint as the digest).
pub fn encode(record: &Record) -> Vec<u8> {
    let mut out = Vec::new();
    encode_into(record, &mut out);
    out
}

/// Appends the v1 encoding of `record` to `out`.
pub fn encode_into(record: &Record, out: &mut Vec<u8>) {
    encode_fields(record, FORMAT_V1, &record.fingerprint.digest(), out);
}

/// Appends the encoding of `record` with its fingerprint in the form it is
/// held in (v2 for one kept as sent, else v1): what an effect carries, so
/// building it hashes nothing. The receiving node decodes the same form.
pub fn encode_effect_into(record: &Record, out: &mut Vec<u8>) {
    match &record.fingerprint {
        Fingerprint::Sent(bytes) => encode_fields(record, FORMAT_SENT, bytes, out),
        Fingerprint::Digest(digest) => encode_fields(record, FORMAT_V1, digest, out),
    }
}

fn encode_fields(record: &Record, format: u8, fingerprint: &[u8; 32], out: &mut Vec<u8>) {
    fn u64_le(out: &mut Vec<u8>, v: u64) {
        out.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(out: &mut Vec<u8>, b: &[u8]) {
        u64_le(out, b.len() as u64);
        out.extend_from_slice(b);
    }
    out.reserve(96 + record.memory_usage());
    out.push(format);
    out.extend_from_slice(fingerprint);
    u64_le(out, record.token);
    u64_le(out, record.created_at);
    u64_le(out, record.expires_at);
    match &record.state {
        State::InProgress { lease_until } => {
            out.extend_from_slice(&0u32.to_le_bytes());
            u64_le(out, *lease_until);
        }
        State::Completed(c) => {
            out.extend_from_slice(&1u32.to_le_bytes());
            out.extend_from_slice(&c.status.to_le_bytes());
            bytes(out, &c.body);
            u64_le(out, c.headers.len() as u64);
            for h in &c.headers {
                bytes(out, &h.name);
                bytes(out, &h.value);
            }
            u64_le(out, c.completed_at);
            let mirror: u32 = match c.mirror {
                MirrorState::Pending => 0,
                MirrorState::Mirrored => 1,
            };
            out.extend_from_slice(&mirror.to_le_bytes());
        }
    }
}

/// Decodes and validates (`Record::validate`) a record: everything decoded
/// comes from outside (RDB, RESTORE, AOF, replication).
pub fn decode(bytes: &[u8]) -> Result<Record, Error> {
    let (form, rest): (fn([u8; 32]) -> Fingerprint, _) = match bytes.split_first() {
        Some((&FORMAT_V1, rest)) => (Fingerprint::Digest, rest),
        Some((&FORMAT_SENT, rest)) => (Fingerprint::Sent, rest),
        Some((v, _)) => {
            return Err(Error::Corrupt(format!(
                "idem record format {v} is newer than this module"
            )))
        }
        None => return Err(Error::Corrupt("empty idem record".into())),
    };
    let record = decode_fields(rest, form).map_err(|why| {
        Error::Corrupt(format!("idem record v{} does not decode: {why}", bytes[0]))
    })?;
    record.validate()?;
    Ok(record)
}

/// The fields after the format byte, the fingerprint in the format's `form`:
/// every read is bounds-checked, no length may claim more bytes than remain,
/// and no byte may be left over.
fn decode_fields(bytes: &[u8], form: fn([u8; 32]) -> Fingerprint) -> Result<Record, String> {
    let mut r = Reader { rest: bytes };
    let fingerprint = form(*r.array::<32>("fingerprint")?);
    let token = r.u64("token")?;
    let created_at = r.u64("created_at")?;
    let expires_at = r.u64("expires_at")?;
    let state = match r.u32("state")? {
        0 => State::InProgress {
            lease_until: r.u64("lease_until")?,
        },
        1 => {
            let status = u16::from_le_bytes(*r.array("status")?);
            let body = r.bytes("body")?;
            let count = r.u64("header count")?;
            // Each header takes at least its two length prefixes.
            if count > (r.rest.len() / 16) as u64 {
                return Err(format!("{count} headers in {} bytes", r.rest.len()));
            }
            let mut headers = Vec::with_capacity(count as usize);
            for _ in 0..count {
                headers.push(Header {
                    name: r.bytes("header name")?,
                    value: r.bytes("header value")?,
                });
            }
            let completed_at = r.u64("completed_at")?;
            let mirror = match r.u32("mirror")? {
                0 => MirrorState::Pending,
                1 => MirrorState::Mirrored,
                other => return Err(format!("unknown mirror state {other}")),
            };
            State::Completed(Completed {
                status,
                body,
                headers,
                completed_at,
                mirror,
            })
        }
        other => return Err(format!("unknown state {other}")),
    };
    if !r.rest.is_empty() {
        return Err(format!("{} trailing bytes", r.rest.len()));
    }
    Ok(Record {
        fingerprint,
        token,
        created_at,
        expires_at,
        state,
    })
}

/// The unread bytes of an encoding.
struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn array<const N: usize>(&mut self, what: &str) -> Result<&'a [u8; N], String> {
        let (head, rest) = self
            .rest
            .split_first_chunk::<N>()
            .ok_or_else(|| format!("{what} cut short"))?;
        self.rest = rest;
        Ok(head)
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        self.array(what).map(|b| u32::from_le_bytes(*b))
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        self.array(what).map(|b| u64::from_le_bytes(*b))
    }

    /// A byte string: u64 length, then that many bytes.
    fn bytes(&mut self, what: &str) -> Result<Vec<u8>, String> {
        let len = self.u64(what)?;
        match usize::try_from(len) {
            Ok(len) if len <= self.rest.len() => {
                let (head, rest) = self.rest.split_at(len);
                self.rest = rest;
                Ok(head.to_vec())
            }
            _ => Err(format!(
                "{what} claims {len} bytes, {} remain",
                self.rest.len()
            )),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::wire::test_support::any_completed;
    use proptest::prelude::*;

    fn arb_record() -> impl Strategy<Value = Record> {
        let completed = (any_completed(300), any::<u64>(), any::<bool>()).prop_map(
            |(mut c, completed_at, pending)| {
                c.completed_at = completed_at;
                if !pending {
                    c.mirror = MirrorState::Mirrored;
                }
                State::Completed(c)
            },
        );
        let state = prop_oneof![
            any::<u64>().prop_map(|lease_until| State::InProgress { lease_until }),
            completed,
        ];
        (
            (any::<[u8; 32]>(), any::<bool>()).prop_map(|(bytes, sent)| {
                if sent {
                    Fingerprint::Sent(bytes)
                } else {
                    Fingerprint::Digest(bytes)
                }
            }),
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            state,
        )
            .prop_map(
                |(fingerprint, token, created_at, expires_at, state)| Record {
                    fingerprint,
                    token,
                    created_at,
                    expires_at,
                    state,
                },
            )
    }

    /// Records as a node could have written them: every field in range.
    pub(crate) fn arb_valid_record() -> impl Strategy<Value = Record> {
        use crate::record::{TIME_LIMIT_MS, TOKEN_LIMIT};
        (
            arb_record(),
            1..TOKEN_LIMIT,
            0..=TIME_LIMIT_MS,
            0..=TIME_LIMIT_MS,
            0..=TIME_LIMIT_MS,
        )
            .prop_map(|(mut r, token, t1, t2, t3)| {
                r.token = token;
                r.created_at = t1;
                r.expires_at = t2;
                match &mut r.state {
                    State::InProgress { lease_until } => *lease_until = t3,
                    State::Completed(c) => {
                        c.completed_at = t3;
                        c.headers.retain(|h| !h.name.is_empty());
                    }
                }
                r
            })
    }

    proptest! {
        #[test]
        fn roundtrips_or_refuses_invalid(r in arb_record()) {
            match r.validate() {
                Ok(()) => prop_assert_eq!(decode(&encode(&r)).unwrap(), r),
                Err(e) => prop_assert_eq!(decode(&encode(&r)), Err(e)),
            }
        }

        #[test]
        fn valid_records_roundtrip(r in arb_valid_record()) {
            prop_assert_eq!(decode(&encode(&r)).unwrap(), r);
        }

        #[test]
        fn every_truncation_and_extension_is_refused(
            r in arb_valid_record(),
            tail in proptest::collection::vec(any::<u8>(), 1..16),
        ) {
            let mut bytes = encode(&r);
            for keep in 0..bytes.len() {
                prop_assert!(matches!(decode(&bytes[..keep]), Err(Error::Corrupt(_))), "prefix {}", keep);
            }
            bytes.extend(tail);
            prop_assert!(matches!(decode(&bytes), Err(Error::Corrupt(_))));
        }

        #[test]
        fn garbage_is_an_error_not_a_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode(&bytes);
        }
    }

    #[test]
    fn v1_bytes_stay_decodable() {
        // Frozen v1 encodings (the layout bincode 1.x wrote before the decoder was
        // written by hand): later versions must keep decoding files written
        // with them.
        let header = |name: &[u8], value: &[u8]| Header {
            name: name.to_vec(),
            value: value.to_vec(),
        };
        let cases = [
            (
                Record {
                    fingerprint: Fingerprint::Digest([7; 32]),
                    token: 42,
                    created_at: 1,
                    expires_at: 2,
                    state: State::Completed(Completed {
                        status: 201,
                        body: b"ok".to_vec(),
                        headers: vec![header(b"a", b"b")],
                        completed_at: 3,
                        mirror: MirrorState::Pending,
                    }),
                },
                "0107070707070707070707070707070707070707070707070707070707070707072a00000000\
0000000100000000000000020000000000000001000000c90002000000000000006f6b010000\
0000000000010000000000000061010000000000000062030000000000000000000000",
            ),
            (
                Record {
                    fingerprint: Fingerprint::Digest([9; 32]),
                    token: 7,
                    created_at: 1,
                    expires_at: crate::record::NO_EXPIRY,
                    state: State::InProgress { lease_until: 5 },
                },
                "010909090909090909090909090909090909090909090909090909090909090909070000\
00000000000100000000000000ffffffffffffffff000000000500000000000000",
            ),
            (
                Record {
                    fingerprint: Fingerprint::Digest([3; 32]),
                    token: (1 << 53) - 1,
                    created_at: 10,
                    expires_at: 20,
                    state: State::Completed(Completed {
                        status: 599,
                        body: Vec::new(),
                        headers: Vec::new(),
                        completed_at: 30,
                        mirror: MirrorState::Mirrored,
                    }),
                },
                "010303030303030303030303030303030303030303030303030303030303030303ffffff\
ffffff1f000a000000000000001400000000000000010000005702000000000000000000\
000000000000001e0000000000000001000000",
            ),
        ];
        for (r, frozen) in cases {
            assert_eq!(hex::encode(encode(&r)), frozen);
            assert_eq!(decode(&hex::decode(frozen).unwrap()).unwrap(), r);
        }
    }

    /// An effect carries a fingerprint kept as sent as v2 (no hashing), the
    /// receiver holds the same form; one held as a digest stays v1.
    #[test]
    fn effects_carry_the_form_held() {
        let sent = Record {
            fingerprint: Fingerprint::Sent([9; 32]),
            token: 7,
            created_at: 1,
            expires_at: crate::record::NO_EXPIRY,
            state: State::InProgress { lease_until: 5 },
        };
        let mut effect = Vec::new();
        encode_effect_into(&sent, &mut effect);
        // v1's frozen in-progress case above, with format byte 2.
        assert_eq!(
            hex::encode(&effect),
            "020909090909090909090909090909090909090909090909090909090909090909070000\
00000000000100000000000000ffffffffffffffff000000000500000000000000"
        );
        let decoded = decode(&effect).unwrap();
        assert!(matches!(decoded.fingerprint, Fingerprint::Sent(b) if b == [9; 32]));
        assert_eq!(decoded, sent);
        // Written out for good (RDB, DUMP, DEBUG DIGEST): v1, the digest.
        let v1 = encode(&sent);
        assert_eq!(v1[0], FORMAT_V1);
        assert_eq!(v1[1..33], crate::fingerprint::sha256(&[9; 32]));
        assert_eq!(v1[33..], effect[33..]);

        let digest = Record {
            fingerprint: Fingerprint::Digest([9; 32]),
            ..sent
        };
        let mut effect = Vec::new();
        encode_effect_into(&digest, &mut effect);
        assert_eq!(effect, encode(&digest));
    }

    proptest! {
        #[test]
        fn effects_round_trip_in_their_form(r in arb_valid_record()) {
            let mut effect = Vec::new();
            encode_effect_into(&r, &mut effect);
            let decoded = decode(&effect).unwrap();
            prop_assert_eq!(
                std::mem::discriminant(&decoded.fingerprint),
                std::mem::discriminant(&r.fingerprint)
            );
            prop_assert_eq!(decoded, r);
        }
    }

    #[test]
    fn unknown_format_is_refused() {
        assert!(matches!(decode(&[9, 0, 0]), Err(Error::Corrupt(_))));
        assert!(matches!(decode(&[3, 0, 0]), Err(Error::Corrupt(_))));
        assert!(matches!(decode(&[]), Err(Error::Corrupt(_))));
    }
}
