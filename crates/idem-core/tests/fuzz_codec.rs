//! Property fuzzing of the record decoder (`idem_core::codec`), the code that
//! reads RDB files, RESTORE payloads and the replication stream: records
//! round-trip, and mutated, truncated, extended or random bytes decode to an
//! error or to a record whose own encoding is what was read, never a panic
//! or a runaway allocation, in both formats (v1, the digest; v2, a
//! fingerprint as sent, which effects carry).

use idem_core::codec::{decode, encode, encode_effect_into, FORMAT_SENT, FORMAT_V1};
use idem_core::wire::ErrorCode;
use idem_core::{Completed, Fingerprint, Header, MirrorState, Record, State};
use proptest::prelude::*;

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Times as the module writes them: Unix ms before 2255, where the decoder's
/// validation draws the line.
fn time() -> impl Strategy<Value = u64> {
    0u64..8_993_721_600_000
}

/// Records as the module creates them (tokens below 2^53).
fn record() -> impl Strategy<Value = Record> {
    let header = (
        proptest::collection::vec(any::<u8>(), 1..16),
        proptest::collection::vec(any::<u8>(), 0..16),
    )
        .prop_map(|(name, value)| Header { name, value });
    let completed = (
        100u16..600,
        proptest::collection::vec(any::<u8>(), 0..256),
        proptest::collection::vec(header, 0..5),
        time(),
        any::<bool>(),
    )
        .prop_map(|(status, body, headers, completed_at, pending)| {
            State::Completed(Completed {
                status,
                body,
                headers,
                completed_at,
                mirror: if pending {
                    MirrorState::Pending
                } else {
                    MirrorState::Mirrored
                },
            })
        });
    let state = prop_oneof![
        time().prop_map(|lease_until| State::InProgress { lease_until }),
        completed,
    ];
    (
        (any::<[u8; 32]>(), any::<bool>()),
        1u64..1 << 53,
        time(),
        time(),
        state,
    )
        .prop_map(
            |((bytes, sent), token, created_at, expires_at, state)| Record {
                // Either form: `encode` carries the digest, an effect the form held.
                fingerprint: if sent {
                    Fingerprint::Sent(bytes)
                } else {
                    Fingerprint::Digest(bytes)
                },
                token,
                created_at,
                expires_at,
                state,
            },
        )
}

/// A record's encoding as an effect: in the form its fingerprint is held.
fn effect(r: &Record) -> Vec<u8> {
    let mut out = Vec::new();
    encode_effect_into(r, &mut out);
    out
}

/// What the decoder may do with any input: refuse it as CORRUPT, or return a
/// record that re-encodes (in the form decoded) to exactly the input, so
/// nothing invented survives a decode/encode cycle.
fn decode_is_sound(bytes: &[u8]) -> Result<(), TestCaseError> {
    match decode(bytes) {
        Err(e) => prop_assert_eq!(e.code(), ErrorCode::Corrupt),
        Ok(r) => {
            let again = effect(&r);
            prop_assert!(
                bytes.starts_with(&again),
                "decoded {:?} from other bytes",
                r
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(20_000))]

    #[test]
    fn records_round_trip(r in record()) {
        prop_assert_eq!(decode(&encode(&r)).unwrap(), r.clone());
        prop_assert_eq!(decode(&effect(&r)).unwrap(), r);
    }

    #[test]
    fn mutated_encodings_never_panic(
        r in record(),
        as_effect in any::<bool>(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        let mut bytes = if as_effect { effect(&r) } else { encode(&r) };
        for (at, b) in flips {
            let i = at.index(bytes.len());
            bytes[i] = b;
        }
        decode_is_sound(&bytes)?;
    }

    #[test]
    fn truncated_or_extended_encodings_never_panic(
        r in record(),
        as_effect in any::<bool>(),
        cut in any::<prop::sample::Index>(),
        tail in proptest::collection::vec(any::<u8>(), 0..16),
    ) {
        let bytes = if as_effect { effect(&r) } else { encode(&r) };
        let short = &bytes[..cut.index(bytes.len())];
        prop_assert!(decode(short).is_err(), "a strict prefix decoded");
        let mut long = bytes.clone();
        long.extend(&tail);
        decode_is_sound(&long)?;
    }

    #[test]
    fn random_bytes_never_panic(
        mut bytes in proptest::collection::vec(any::<u8>(), 0..160),
        format in prop_oneof![Just(None), Just(Some(FORMAT_V1)), Just(Some(FORMAT_SENT))],
    ) {
        if let (Some(format), Some(first)) = (format, bytes.first_mut()) {
            *first = format;
        }
        decode_is_sound(&bytes)?;
    }
}

/// Length prefixes claiming up to 2^64-1 bytes of body or headers must be an
/// error, not an attempt to allocate that much.
#[test]
fn huge_length_prefixes_are_refused_without_allocating() {
    let r = Record {
        fingerprint: Fingerprint::Digest([1; 32]),
        token: 5,
        created_at: 1,
        expires_at: 2,
        state: State::Completed(Completed {
            status: 200,
            body: b"body".to_vec(),
            headers: vec![Header {
                name: b"n".to_vec(),
                value: b"v".to_vec(),
            }],
            completed_at: 3,
            mirror: MirrorState::Pending,
        }),
    };
    let bytes = encode(&r);
    // format + fingerprint + token + created + expires + variant + status
    let body_len_at = 1 + 32 + 8 * 3 + 4 + 2;
    let headers_len_at = body_len_at + 8 + 4;
    for at in [body_len_at, headers_len_at] {
        for len in [u64::MAX, 1 << 62, 1 << 40, 1 << 31] {
            let mut b = bytes.clone();
            b[at..at + 8].copy_from_slice(&len.to_le_bytes());
            assert!(decode(&b).is_err(), "length {len} at {at} decoded");
        }
    }
}
