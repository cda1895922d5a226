//! The `IDEM.MIRROR.PULL` reply: an array of records, each `[key, token,
//! fingerprint_hex, status, body, headers, created_at, completed_at,
//! expires_at]` (expires_at -1: the key has no TTL).

use super::{
    read_expiry, read_fingerprint, read_headers, read_status, read_uint, uint, write_expiry,
    write_headers, Frame, ReplySink, WireError,
};
use crate::{Completed, Fingerprint, MirrorState, Record, State};

/// Fields of one pulled record.
const FIELDS: usize = 9;

/// One pulled record: its key and the completed, pending record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PulledRecord {
    pub key: Vec<u8>,
    pub record: Record,
}

impl PulledRecord {
    /// The stored response (a pulled record is always completed).
    pub fn completed(&self) -> &Completed {
        self.record
            .completed()
            .expect("parse_pull_batch yields completed records only")
    }
}

/// Writes a batch; records that are not completed are skipped by the
/// caller (`batch` holds completed records only).
pub fn write_pull_batch<'a>(
    sink: &mut impl ReplySink,
    batch: impl ExactSizeIterator<Item = (&'a [u8], &'a Record)>,
) {
    sink.array(batch.len());
    for (key, r) in batch {
        let Some(c) = r.completed() else {
            // Never happens (see above); keep the array length honest.
            sink.null();
            continue;
        };
        sink.array(FIELDS);
        sink.bulk(key);
        uint(sink, r.token);
        sink.bulk(hex::encode(r.fingerprint.digest()).as_bytes());
        sink.int(c.status.into());
        sink.bulk(&c.body);
        write_headers(sink, &c.headers);
        uint(sink, r.created_at);
        uint(sink, c.completed_at);
        write_expiry(sink, r.expires_at);
    }
}

/// Reads a PULL reply: each entry parsed on its own, so one malformed entry
/// does not hide the others (the caller decides what to do with it).
pub fn parse_pull_batch(frame: &Frame) -> Result<Vec<Result<PulledRecord, WireError>>, WireError> {
    Ok(frame.array("PULL reply")?.iter().map(parse_entry).collect())
}

fn parse_entry(entry: &Frame) -> Result<PulledRecord, WireError> {
    let f = entry.array("PULL entry")?;
    if f.len() != FIELDS {
        return Err(WireError::new(format!("PULL entry has {} fields", f.len())));
    }
    Ok(PulledRecord {
        key: f[0].bytes("key")?.to_vec(),
        record: Record {
            token: read_uint(&f[1], "token")?,
            fingerprint: Fingerprint::Digest(read_fingerprint(&f[2])?),
            created_at: read_uint(&f[6], "created_at")?,
            expires_at: read_expiry(&f[8], "expires_at")?,
            state: State::Completed(Completed {
                status: read_status(&f[3])?,
                body: f[4].bytes("body")?.to_vec(),
                headers: read_headers(&f[5])?,
                completed_at: read_uint(&f[7], "completed_at")?,
                mirror: MirrorState::Pending,
            }),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::tests::arb_valid_record;
    use crate::wire::Recorder;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn write_then_parse_round_trips(
            batch in proptest::collection::vec(
                (proptest::collection::vec(any::<u8>(), 1..16), arb_valid_record()), 0..5)
        ) {
            let pending: Vec<PulledRecord> = batch
                .into_iter()
                .filter_map(|(key, mut record)| {
                    let State::Completed(c) = &mut record.state else { return None };
                    c.mirror = MirrorState::Pending;
                    Some(PulledRecord { key, record })
                })
                .collect();
            let mut sink = Recorder::default();
            write_pull_batch(&mut sink, pending.iter().map(|p| (&p.key[..], &p.record)));
            let frames = sink.into_frames();
            let parsed: Vec<PulledRecord> = parse_pull_batch(&frames[0])
                .unwrap()
                .into_iter()
                .collect::<Result<_, _>>()
                .unwrap();
            prop_assert_eq!(parsed, pending);
        }
    }

    #[test]
    fn a_bad_entry_does_not_hide_the_others() {
        let good = Frame::Array(vec![
            Frame::Bulk(b"k".to_vec()),
            Frame::Int(5),
            Frame::Bulk(hex::encode([1u8; 32]).into_bytes()),
            Frame::Int(200),
            Frame::Bulk(b"b".to_vec()),
            Frame::Array(vec![]),
            Frame::Int(1),
            Frame::Int(2),
            Frame::Int(-1),
        ]);
        let parsed = parse_pull_batch(&Frame::Array(vec![Frame::Int(3), good])).unwrap();
        assert!(parsed[0].is_err());
        let ok = parsed[1].as_ref().unwrap();
        assert_eq!(ok.record.expires_at, crate::record::NO_EXPIRY);
        assert_eq!(ok.completed().body, b"b");
    }
}
