//! Versioned binary encoding of a record (RDB, DUMP/RESTORE, AOF, replication).
//!
//! Layout: one format byte, then the bincode encoding of that format's
//! struct. A new format gets a new byte and keeps decoding every older one.

use crate::{Error, Record};

/// Format byte of the current encoding.
pub const FORMAT_V1: u8 = 1;

pub fn encode(record: &Record) -> Vec<u8> {
    let mut out = Vec::with_capacity(96 + record.memory_usage());
    out.push(FORMAT_V1);
    // Serializing plain owned data into a Vec cannot fail.
    bincode::serialize_into(&mut out, record).expect("bincode into Vec");
    out
}

pub fn decode(bytes: &[u8]) -> Result<Record, Error> {
    match bytes.split_first() {
        Some((&FORMAT_V1, rest)) => bincode::deserialize(rest)
            .map_err(|e| Error::Corrupt(format!("idem record v1 does not decode: {e}"))),
        Some((v, _)) => Err(Error::Corrupt(format!(
            "idem record format {v} is newer than this module"
        ))),
        None => Err(Error::Corrupt("empty idem record".into())),
    }
}

#[cfg(test)]
mod tests {
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

    proptest! {
        #[test]
        fn roundtrips(r in arb_record()) {
            prop_assert_eq!(decode(&encode(&r)).unwrap(), r);
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
