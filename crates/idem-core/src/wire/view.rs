//! The `IDEM.GET` reply: nil, or a flat field/value array: `state`,
//! `fingerprint` (hex), `token`, `created_at`, `expires_at` (-1: no TTL),
//! then `lease_until` (in progress) or `status`, `body`, `headers`,
//! `completed_at`, `mirror` (`pending` | `mirrored`).

use super::{
    read_expiry, read_fingerprint, read_headers, read_status, read_uint, uint, write_expiry,
    write_headers, Frame, ReplySink, WireError,
};
use crate::{Completed, Fingerprint, MirrorState, Record, State};

const IN_PROGRESS: [&str; 6] = [
    "state",
    "fingerprint",
    "token",
    "created_at",
    "expires_at",
    "lease_until",
];
const COMPLETED: [&str; 10] = [
    "state",
    "fingerprint",
    "token",
    "created_at",
    "expires_at",
    "status",
    "body",
    "headers",
    "completed_at",
    "mirror",
];

/// Writes `record` (or nil) as `IDEM.GET` answers it.
pub fn write_record(sink: &mut impl ReplySink, record: Option<&Record>) {
    let Some(r) = record else {
        sink.null();
        return;
    };
    let (state, fields): (&[u8], usize) = match r.state {
        State::InProgress { .. } => (b"in_progress", IN_PROGRESS.len()),
        State::Completed(_) => (b"completed", COMPLETED.len()),
    };
    sink.array(fields * 2);
    sink.bulk(b"state");
    sink.bulk(state);
    sink.bulk(b"fingerprint");
    sink.bulk(hex::encode(r.fingerprint.digest()).as_bytes());
    sink.bulk(b"token");
    uint(sink, r.token);
    sink.bulk(b"created_at");
    uint(sink, r.created_at);
    sink.bulk(b"expires_at");
    write_expiry(sink, r.expires_at);
    match &r.state {
        State::InProgress { lease_until } => {
            sink.bulk(b"lease_until");
            uint(sink, *lease_until);
        }
        State::Completed(c) => {
            sink.bulk(b"status");
            sink.int(c.status.into());
            sink.bulk(b"body");
            sink.bulk(&c.body);
            sink.bulk(b"headers");
            write_headers(sink, &c.headers);
            sink.bulk(b"completed_at");
            uint(sink, c.completed_at);
            sink.bulk(b"mirror");
            sink.bulk(match c.mirror {
                MirrorState::Pending => b"pending",
                MirrorState::Mirrored => b"mirrored",
            });
        }
    }
}

/// Reads an `IDEM.GET` reply, strictly: the documented fields in order.
pub fn parse_record(frame: &Frame) -> Result<Option<Record>, WireError> {
    if *frame == Frame::Null {
        return Ok(None);
    }
    let items = frame.array("IDEM.GET reply")?;
    let names: Vec<&str> = items
        .iter()
        .step_by(2)
        .map(|f| f.text("field name"))
        .collect::<Result<_, _>>()?;
    let value = |i: usize| &items[2 * i + 1];
    if items.len() % 2 == 1 || names.len() < IN_PROGRESS.len() {
        return Err(WireError::new("IDEM.GET reply has too few fields"));
    }
    let state = match value(0).text("state")? {
        "in_progress" if names == IN_PROGRESS => State::InProgress {
            lease_until: read_uint(value(5), "lease_until")?,
        },
        "completed" if names == COMPLETED => State::Completed(Completed {
            status: read_status(value(5))?,
            body: value(6).bytes("body")?.to_vec(),
            headers: read_headers(value(7))?,
            completed_at: read_uint(value(8), "completed_at")?,
            mirror: match value(9).text("mirror")? {
                "pending" => MirrorState::Pending,
                "mirrored" => MirrorState::Mirrored,
                other => return Err(WireError::new(format!("mirror {other:?}"))),
            },
        }),
        other => {
            return Err(WireError::new(format!(
                "IDEM.GET state {other:?} with fields {names:?}"
            )))
        }
    };
    Ok(Some(Record {
        fingerprint: Fingerprint::Digest(read_fingerprint(value(1))?),
        token: read_uint(value(2), "token")?,
        created_at: read_uint(value(3), "created_at")?,
        expires_at: read_expiry(value(4), "expires_at")?,
        state,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::tests::arb_valid_record;
    use crate::wire::Recorder;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn write_then_parse_round_trips(r in proptest::option::of(arb_valid_record())) {
            let mut sink = Recorder::default();
            write_record(&mut sink, r.as_ref());
            let frames = sink.into_frames();
            prop_assert_eq!(parse_record(&frames[0]), Ok(r));
        }
    }
}
