//! Versioned binary encoding of a record (RDB, DUMP/RESTORE, AOF, replication).
//!
//! Layout: one format byte, then the bincode (1.x, default options)
//! encoding of that format's struct. A new format gets a new byte and keeps
//! decoding every older one.
//!
//! Encoding runs on every write (replication), so `encode_into` writes the
//! v1 bytes directly; a property test holds it byte-equal to bincode, which
//! does all decoding.

use crate::{Error, MirrorState, Record, State};

/// Format byte of the current encoding.
pub const FORMAT_V1: u8 = 1;

pub fn encode(record: &Record) -> Vec<u8> {
    let mut out = Vec::new();
    encode_into(record, &mut out);
    out
}

/// Appends the encoding of `record` to `out`.
pub fn encode_into(record: &Record, out: &mut Vec<u8>) {
    fn u64_le(out: &mut Vec<u8>, v: u64) {
        out.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(out: &mut Vec<u8>, b: &[u8]) {
        u64_le(out, b.len() as u64);
        out.extend_from_slice(b);
    }
    out.reserve(96 + record.memory_usage());
    out.push(FORMAT_V1);
    out.extend_from_slice(&record.fingerprint);
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
    use bincode::Options;
    match bytes.split_first() {
        Some((&FORMAT_V1, rest)) => {
            // bincode 1.x defaults (fixed-width integers), plus: no length
            // prefix may claim more bytes than there are, no trailing bytes.
            let record: Record = bincode::DefaultOptions::new()
                .with_fixint_encoding()
                .with_limit(rest.len() as u64)
                .reject_trailing_bytes()
                .deserialize(rest)
                .map_err(|e| Error::Corrupt(format!("idem record v1 does not decode: {e}")))?;
            record.validate()?;
            Ok(record)
        }
        Some((v, _)) => Err(Error::Corrupt(format!(
            "idem record format {v} is newer than this module"
        ))),
        None => Err(Error::Corrupt("empty idem record".into())),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::{Completed, Header, MirrorState, State};
    use proptest::prelude::*;

    fn arb_record() -> impl Strategy<Value = Record> {
        let completed = (
            100u16..600,
            proptest::collection::vec(any::<u8>(), 0..300),
            proptest::collection::vec(
                (
                    proptest::collection::vec(any::<u8>(), 0..20),
                    proptest::collection::vec(any::<u8>(), 0..20),
                ),
                0..4,
            ),
            any::<u64>(),
            any::<bool>(),
        )
            .prop_map(|(status, body, headers, completed_at, pending)| {
                State::Completed(Completed {
                    status,
                    body,
                    headers: headers
                        .into_iter()
                        .map(|(name, value)| Header { name, value })
                        .collect(),
                    completed_at,
                    mirror: if pending {
                        MirrorState::Pending
                    } else {
                        MirrorState::Mirrored
                    },
                })
            });
        let state = prop_oneof![
            any::<u64>().prop_map(|lease_until| State::InProgress { lease_until }),
            completed,
        ];
        (
            any::<[u8; 32]>(),
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
        fn trailing_bytes_are_refused(r in arb_valid_record(), junk in proptest::collection::vec(any::<u8>(), 1..8)) {
            let mut bytes = encode(&r);
            bytes.extend(junk);
            prop_assert!(matches!(decode(&bytes), Err(Error::Corrupt(_))));
        }

        #[test]
        fn hand_written_encoder_is_byte_equal_to_bincode(r in arb_record()) {
            let mut reference = vec![FORMAT_V1];
            reference.extend(bincode::serialize(&r).unwrap());
            prop_assert_eq!(encode(&r), reference);
        }

        #[test]
        fn garbage_is_an_error_not_a_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn truncation_is_an_error(r in arb_record(), cut in 1usize..64) {
            let bytes = encode(&r);
            let keep = bytes.len().saturating_sub(cut);
            prop_assert!(decode(&bytes[..keep]).is_err());
        }
    }

    #[test]
    fn v1_bytes_stay_decodable() {
        // Frozen v1 encoding of a small completed record: later versions must
        // keep decoding files written today.
        let r = Record {
            fingerprint: [7; 32],
            token: 42,
            created_at: 1,
            expires_at: 2,
            state: State::Completed(Completed {
                status: 201,
                body: b"ok".to_vec(),
                headers: vec![Header {
                    name: b"a".to_vec(),
                    value: b"b".to_vec(),
                }],
                completed_at: 3,
                mirror: MirrorState::Pending,
            }),
        };
        let frozen = "0107070707070707070707070707070707070707070707070707070707070707072a00000000\
0000000100000000000000020000000000000001000000c90002000000000000006f6b010000\
0000000000010000000000000061010000000000000062030000000000000000000000";
        assert_eq!(hex::encode(encode(&r)), frozen);
        assert_eq!(decode(&hex::decode(frozen).unwrap()).unwrap(), r);
    }

    #[test]
    fn unknown_format_is_refused() {
        assert!(matches!(decode(&[9, 0, 0]), Err(Error::Corrupt(_))));
        assert!(matches!(decode(&[]), Err(Error::Corrupt(_))));
    }
}
