//! Walking a node's idem records: `SCAN` over the keys matching a pattern,
//! each batch's records read with pipelined `IDEM.GET` (keys of other types
//! answer WRONGTYPE and are skipped).

use anyhow::Context as _;
use idem_core::wire::GetReply;
use idem_core::Record;
use redis::aio::MultiplexedConnection;

/// Keys asked for per SCAN step (a hint to Redis).
const SCAN_COUNT: usize = 1000;

/// Calls `visit` with every idem record whose key matches `pattern`.
/// Answers how many keys were looked at. A key may be visited twice when
/// the keyspace is resized during the scan (SCAN's guarantee); callers
/// that count must tolerate it.
pub async fn records(
    conn: &mut MultiplexedConnection,
    pattern: &str,
    mut visit: impl FnMut(Vec<u8>, Record),
) -> anyhow::Result<u64> {
    let mut cursor: u64 = 0;
    let mut seen = 0;
    loop {
        let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(SCAN_COUNT)
            .query_async(conn)
            .await
            .context("SCAN")?;
        seen += keys.len() as u64;
        if !keys.is_empty() {
            let mut pipe = redis::pipe();
            for key in &keys {
                pipe.cmd(idem_core::args::name::GET).arg(key);
            }
            let replies: Vec<redis::RedisResult<GetReply>> = pipe
                .ignore_errors()
                .query_async(conn)
                .await
                .context("IDEM.GET of scanned keys")?;
            for (key, reply) in keys.into_iter().zip(replies) {
                match reply {
                    Ok(GetReply(Some(record))) => visit(key, record),
                    // Expired or deleted since the scan saw it.
                    Ok(GetReply(None)) => {}
                    Err(e) if e.code() == Some("WRONGTYPE") => {}
                    Err(e) => {
                        return Err(anyhow::Error::new(e)
                            .context(format!("IDEM.GET {:?}", String::from_utf8_lossy(&key))))
                    }
                }
            }
        }
        cursor = next;
        if cursor == 0 {
            return Ok(seen);
        }
    }
}
