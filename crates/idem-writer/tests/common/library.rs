//! The Functions library's side of the writer's tests: completions made
//! through `FCALL`, records read through `idem_get`, the outboxes' backlog,
//! and the check of Postgres against them.

use std::collections::HashMap;

use idem_core::functions::{self as lib, outbox_for_slot, outbox_key, SLOTS};
use idem_core::wire::{BeginReply, Frame};
use idem_core::Record;
use rand::RngExt;
use redis::Value;
use sha2::{Digest, Sha256};

use super::{mirror_state, rows, Completion};

/// `FCALL idem_begin` + `FCALL idem_complete` for each key, as two
/// pipelines, like [`super::complete_keys`] does with the module.
pub fn complete_keys_lib(
    conn: &mut redis::Connection,
    keys: &[String],
    ttl_secs: u64,
) -> redis::RedisResult<Vec<Completion>> {
    let mut rng = rand::rng();
    let fingerprints: Vec<Vec<u8>> = keys
        .iter()
        .map(|k| format!("POST /payments {k} {}", rng.random::<u32>()).into_bytes())
        .collect();
    let mut begin = redis::pipe();
    for (key, fp) in keys.iter().zip(&fingerprints) {
        begin
            .cmd("FCALL")
            .arg(lib::BEGIN)
            .arg(1)
            .arg(key)
            .arg(fp)
            .arg(ttl_secs);
    }
    let replies: Vec<Value> = begin.query(conn)?;
    let mut complete = redis::pipe();
    let mut done = Vec::with_capacity(keys.len());
    for ((key, fp), reply) in keys.iter().zip(&fingerprints).zip(replies) {
        let token = match BeginReply::parse(&Frame::from(&reply)) {
            Ok(BeginReply::New { token }) => token as i64,
            other => panic!("idem_begin {key}: {other:?} ({reply:?})"),
        };
        let status = [200, 201, 400, 409, 500][rng.random_range(0..5)];
        let body: Vec<u8> = (0..rng.random_range(0..400))
            .map(|_| rng.random())
            .collect();
        let mut headers = Vec::new();
        let cmd = complete
            .cmd("FCALL")
            .arg(lib::COMPLETE)
            .arg(2)
            .arg(key)
            .arg(outbox_key(key.as_bytes()))
            .arg(token)
            .arg(status)
            .arg(&body);
        for h in 0..rng.random_range(0..=2) {
            let name = format!("x-h{h}").into_bytes();
            let value: Vec<u8> = (0..rng.random_range(1..30)).map(|_| rng.random()).collect();
            cmd.arg("HEADER").arg(&name).arg(&value);
            headers.push(name);
            headers.push(value);
        }
        done.push(Completion {
            key: key.clone(),
            token,
            fingerprint_hex: hex::encode(Sha256::digest(fp)),
            status,
            body,
            headers,
        });
    }
    let _: Vec<Value> = complete.query(conn)?;
    Ok(done)
}

/// Each key's record as the library has it (`FCALL idem_get`).
pub fn records_lib(conn: &mut redis::Connection, keys: &[String]) -> HashMap<String, Record> {
    let mut out = HashMap::with_capacity(keys.len());
    for chunk in keys.chunks(1000) {
        let mut pipe = redis::pipe();
        for key in chunk {
            pipe.cmd("FCALL").arg(lib::GET).arg(1).arg(key);
        }
        let replies: Vec<Value> = pipe.query(conn).expect("pipelined idem_get");
        for (key, reply) in chunk.iter().zip(replies) {
            if let Some(record) = idem_testkit::wire::parse_get(&reply) {
                out.insert(key.clone(), record);
            }
        }
    }
    out
}

/// Members of every outbox of `slots` on this node (records completed and
/// not yet acknowledged).
pub fn outbox_backlog(conn: &mut redis::Connection, slots: impl IntoIterator<Item = u16>) -> i64 {
    let slots: Vec<u16> = slots.into_iter().collect();
    let mut total = 0;
    for chunk in slots.chunks(4096) {
        let mut pipe = redis::pipe();
        for &slot in chunk {
            pipe.cmd("ZCARD").arg(outbox_for_slot(slot));
        }
        let counts: Vec<i64> = pipe.query(conn).expect("pipelined ZCARD");
        total += counts.iter().sum::<i64>();
    }
    total
}

/// [`outbox_backlog`] of a standalone server (every slot).
pub fn backlog(conn: &mut redis::Connection) -> i64 {
    outbox_backlog(conn, 0..SLOTS)
}

/// Postgres holds exactly `expected`, with the timestamps Redis has, and
/// every record in `in_redis` is acknowledged (`mirror` = mirrored).
pub async fn assert_rows_match(
    pg: &tokio_postgres::Client,
    in_redis: &HashMap<String, Record>,
    expected: &[Completion],
) {
    let rows = rows(pg).await;
    let missing: Vec<&str> = expected
        .iter()
        .filter(|c| !rows.contains_key(&c.key))
        .map(|c| c.key.as_str())
        .take(10)
        .collect();
    assert!(missing.is_empty(), "missing from Postgres: {missing:?}...");
    assert_eq!(rows.len(), expected.len(), "row count");
    for want in expected {
        let row = &rows[&want.key];
        let record = in_redis
            .get(&want.key)
            .unwrap_or_else(|| panic!("{} missing from Redis", want.key));
        assert_eq!(row.token, want.token, "{} token", want.key);
        assert_eq!(
            row.fingerprint, want.fingerprint_hex,
            "{} fingerprint",
            want.key
        );
        assert_eq!(row.status, "completed", "{} status", want.key);
        assert_eq!(
            row.response_status,
            Some(want.status),
            "{} status",
            want.key
        );
        assert_eq!(
            row.response_body.as_deref(),
            Some(&want.body[..]),
            "{} body",
            want.key
        );
        assert_eq!(row.response_headers, want.headers, "{} headers", want.key);
        assert_eq!(
            mirror_state(record),
            "mirrored",
            "{} not acknowledged",
            want.key
        );
        assert_eq!(
            row.created_at_ms,
            Some(record.created_at as i64),
            "{} created_at",
            want.key
        );
        assert_eq!(
            row.completed_at_ms,
            record.completed().map(|c| c.completed_at as i64),
            "{} completed_at",
            want.key
        );
        // MIGRATE restores a key with its remaining TTL: a record whose slot
        // moved expires a few ms later than the row a writer took from the
        // old primary says (an equal token leaves the row as it is).
        assert!(
            (row.expires_at_ms - record.expires_at as i64).abs() <= 1000,
            "{} expires_at: row {}, Redis {}",
            want.key,
            row.expires_at_ms,
            record.expires_at
        );
    }
}
