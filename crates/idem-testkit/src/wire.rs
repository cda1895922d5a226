//! Reading the module's records in tests through `idem_core::wire` (the
//! same strict parser the client and the writer use).

use idem_core::wire::GetReply;
use idem_core::{Record, State};

/// `IDEM.GET key` on an async connection (`None`: no record).
pub async fn idem_get_async(
    conn: &mut impl redis::aio::ConnectionLike,
    key: &str,
) -> Option<Record> {
    let GetReply(record) = redis::cmd("IDEM.GET")
        .arg(key)
        .query_async(conn)
        .await
        .expect("IDEM.GET");
    record
}

/// The record's state word as `IDEM.GET` names it.
pub fn state_word(record: &Record) -> &'static str {
    match record.state {
        State::InProgress { .. } => "in_progress",
        State::Completed(_) => "completed",
    }
}
