//! One Redis node: connecting with bounded waits, a key's record
//! (`IDEM.GET`, read by `idem_core::wire`), `IDEM.ABORT`, and `INFO`.

use std::time::Duration;

use anyhow::{anyhow, Context as _};
use idem_core::wire::GetReply;
use idem_core::{MirrorState, Record, State};
use idem_writer::secure::{redact_url, RedisTls};
use redis::aio::MultiplexedConnection;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::output::{age, now_ms, time};

/// How long connecting and each reply may take.
const TIMEOUT: Duration = Duration::from_secs(5);

/// A connection to the node at `url`: `rediss://` verified against the
/// platform's roots or `REDIS_CA_CERT`, with `REDIS_CLIENT_CERT` and
/// `REDIS_CLIENT_KEY` when set (docs/security.md). Errors name the node
/// with its password masked.
pub async fn connect(url: &str) -> anyhow::Result<MultiplexedConnection> {
    let client = RedisTls::from_env().client(url)?;
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(TIMEOUT))
        .set_response_timeout(Some(TIMEOUT));
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .with_context(|| format!("connect to Redis at {}", redact(url)))
}

/// `url` without its password, for messages and output.
pub fn redact(url: &str) -> String {
    redact_url(url)
}

/// The key's record, or `None`.
pub async fn record(conn: &mut MultiplexedConnection, key: &str) -> anyhow::Result<Option<Record>> {
    let reply: GetReply = redis::cmd(idem_core::args::name::GET)
        .arg(key)
        .query_async(conn)
        .await
        .map_err(|e| explain(e, key))?;
    Ok(reply.0)
}

/// `IDEM.ABORT key token`: whether the record was deleted.
pub async fn abort(
    conn: &mut MultiplexedConnection,
    key: &str,
    token: u64,
) -> anyhow::Result<bool> {
    let deleted: i64 = redis::cmd(idem_core::args::name::ABORT)
        .arg(key)
        .arg(token)
        .query_async(conn)
        .await
        .map_err(|e| explain(e, key))?;
    Ok(deleted == 1)
}

/// Redis errors an operator can act on, said plainly.
fn explain(error: redis::RedisError, key: &str) -> anyhow::Error {
    if let Some((slot_owner, _)) = error.redirect_node() {
        return anyhow!(
            "the key {key:?} lives on another node of the cluster: point --redis at {slot_owner}"
        );
    }
    if error.code() == Some("ERR") && error.to_string().contains("unknown command") {
        return anyhow!("this Redis has no idem module loaded ({error})");
    }
    anyhow::Error::from(error).context(format!("Redis, key {key:?}"))
}

/// The fields of an `INFO section` reply.
pub async fn info(
    conn: &mut MultiplexedConnection,
    section: &str,
) -> anyhow::Result<Vec<(String, String)>> {
    let text: String = redis::cmd("INFO")
        .arg(section)
        .query_async(conn)
        .await
        .with_context(|| format!("INFO {section}"))?;
    Ok(text
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| line.split_once(':'))
        .map(|(name, value)| (name.to_string(), value.trim().to_string()))
        .collect())
}

/// Bytes as a summary: their length and the start of their SHA-256.
pub fn digest(bytes: &[u8]) -> Value {
    json!({ "bytes": bytes.len(), "sha256": hex::encode(Sha256::digest(bytes)) })
}

/// The record as the JSON `inspect` prints: every field of `IDEM.GET`, the
/// response summarized.
pub fn describe(record: &Record) -> Value {
    let now = now_ms();
    let expires_at =
        (record.expires_at != idem_core::record::NO_EXPIRY).then_some(record.expires_at);
    let mut doc = json!({
        "state": match record.state { State::InProgress { .. } => "in_progress", State::Completed(_) => "completed" },
        "token": record.token,
        "fingerprint": hex::encode(record.fingerprint.digest()),
        "created_at": time(record.created_at),
        "expires_at": expires_at.map(time),
    });
    match &record.state {
        State::InProgress { lease_until } => {
            doc["lease_until"] = json!(time(*lease_until));
            doc["lease_left"] = json!(if *lease_until > now {
                age(lease_until - now)
            } else {
                "lapsed".into()
            });
        }
        State::Completed(c) => {
            doc["completed_at"] = json!(time(c.completed_at));
            doc["status"] = json!(c.status);
            doc["body"] = digest(&c.body);
            doc["headers"] = json!(c.headers.len());
            doc["mirror"] = json!(match c.mirror {
                MirrorState::Pending => "pending",
                MirrorState::Mirrored => "mirrored",
            });
        }
    }
    doc
}
