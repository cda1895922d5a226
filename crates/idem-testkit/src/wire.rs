//! Reading the module's records in tests through `idem_core::wire` (the
//! same strict parser the client and the writer use): `IDEM.GET` and
//! `IDEM.MIRROR.PULL` replies as typed records, and a record's fields by
//! the names `IDEM.GET` gives them.

use std::collections::HashMap;

use idem_core::args::name;
use idem_core::wire::{
    parse_pull_batch, parse_record, write_record, Frame, PulledRecord, Recorder,
};
use idem_core::{Header, MirrorState, Record, State};
use redis::Value;

/// An `IDEM.GET` reply (`None`: no record); panics on one that does not
/// have the documented shape.
pub fn parse_get(reply: &Value) -> Option<Record> {
    parse_record(&Frame::from(reply)).unwrap_or_else(|e| panic!("IDEM.GET: {e}: {reply:?}"))
}

/// An `IDEM.MIRROR.PULL` reply; panics on any entry that does not have the
/// documented shape.
pub fn parse_pull(reply: &Value) -> Vec<PulledRecord> {
    parse_pull_batch(&Frame::from(reply))
        .unwrap_or_else(|e| panic!("IDEM.MIRROR.PULL: {e}: {reply:?}"))
        .into_iter()
        .map(|entry| entry.unwrap_or_else(|e| panic!("IDEM.MIRROR.PULL entry: {e}")))
        .collect()
}

/// `IDEM.GET key` (`None`: no record).
pub fn idem_get(
    conn: &mut impl redis::ConnectionLike,
    key: impl redis::ToRedisArgs,
) -> Option<Record> {
    let reply: Value = redis::cmd(name::GET)
        .arg(key)
        .query(conn)
        .expect("IDEM.GET");
    parse_get(&reply)
}

/// `IDEM.GET key` on an async connection (`None`: no record).
pub async fn idem_get_async(
    conn: &mut impl redis::aio::ConnectionLike,
    key: &str,
) -> Option<Record> {
    let reply: Value = redis::cmd(name::GET)
        .arg(key)
        .query_async(conn)
        .await
        .expect("IDEM.GET");
    parse_get(&reply)
}

/// The record's state word as `IDEM.GET` names it.
pub fn state_word(record: &Record) -> &'static str {
    match record.state {
        State::InProgress { .. } => "in_progress",
        State::Completed(_) => "completed",
    }
}

/// The mirror state word of a completed record as `IDEM.GET` names it
/// (`None` in progress).
pub fn mirror_word(record: &Record) -> Option<&'static str> {
    record.completed().map(|c| match c.mirror {
        MirrorState::Pending => "pending",
        MirrorState::Mirrored => "mirrored",
    })
}

/// Headers as the flat `name, value, ...` list a reply carries.
pub fn flat_headers(headers: &[Header]) -> Vec<Vec<u8>> {
    headers
        .iter()
        .flat_map(|h| [h.name.clone(), h.value.clone()])
        .collect()
}

/// The record's `IDEM.GET` fields by name, as the module writes them
/// (`idem_core::wire::write_record`), strings and integers as text; the
/// `headers` array is left out.
pub fn get_fields(record: &Record) -> HashMap<String, String> {
    let mut sink = Recorder::default();
    write_record(&mut sink, Some(record));
    let Some(Frame::Array(items)) = sink.into_frames().pop() else {
        unreachable!("write_record writes one array for a record");
    };
    items
        .chunks(2)
        .filter_map(|pair| {
            let text = |f: &Frame| match f {
                Frame::Bulk(b) => Some(String::from_utf8_lossy(b).into_owned()),
                Frame::Simple(s) => Some(s.clone()),
                Frame::Int(i) => Some(i.to_string()),
                Frame::Array(_) | Frame::Null => None,
            };
            Some((text(&pair[0])?, text(&pair[1])?))
        })
        .collect()
}
