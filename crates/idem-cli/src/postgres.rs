//! The Postgres side: a connection (the writer's `connect`, with its
//! timeout) and a key's `idempotency_keys` row as `inspect` shows it.

use std::time::SystemTime;

use anyhow::Context as _;
use serde_json::{json, Value};
use tokio_postgres::Client;

use crate::output::{age, now_ms, time};
use crate::redis_side::digest;

/// A connection to `url`; the error says which server.
pub async fn connect(url: &str) -> anyhow::Result<Client> {
    idem_writer::connect(url)
        .await
        .map_err(anyhow::Error::new)
        .context("Postgres")
}

/// A key's row: its columns, times in Unix ms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub status: String,
    pub token: i64,
    pub fingerprint: String,
    pub created_at: Option<u64>,
    pub completed_at: Option<u64>,
    pub expires_at: u64,
    pub lease_expires_at: Option<u64>,
    pub fenced: bool,
    pub response_status: Option<i32>,
    pub response_body: Option<Vec<u8>>,
    pub response_headers: Vec<Vec<u8>>,
}

/// Reads the key's row (one per key on both layouts).
pub async fn row(client: &Client, key: &str) -> anyhow::Result<Option<Row>> {
    let row = client
        .query_opt(
            "SELECT status, token, fingerprint, created_at, completed_at, expires_at,
                    lease_expires_at, fenced, response_status, response_body,
                    response_headers
             FROM idempotency_keys WHERE key = $1",
            &[&key],
        )
        .await
        .context("read the key's row from idempotency_keys")?;
    Ok(row.map(|r| Row {
        status: r.get(0),
        token: r.get(1),
        fingerprint: r.get(2),
        created_at: r.get::<_, Option<SystemTime>>(3).map(ms),
        completed_at: r.get::<_, Option<SystemTime>>(4).map(ms),
        expires_at: ms(r.get(5)),
        lease_expires_at: r.get::<_, Option<SystemTime>>(6).map(ms),
        fenced: r.get(7),
        response_status: r.get(8),
        response_body: r.get(9),
        response_headers: r.get(10),
    }))
}

fn ms(at: SystemTime) -> u64 {
    at.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The row as the JSON `inspect` prints.
pub fn describe(row: &Row) -> Value {
    let now = now_ms();
    let mut doc = json!({
        "state": row.status,
        "token": row.token,
        "fingerprint": row.fingerprint,
        "created_at": row.created_at.map(time),
        "expires_at": time(row.expires_at),
        "fenced": row.fenced,
    });
    if let Some(lease) = row.lease_expires_at.filter(|_| row.status == "in_progress") {
        doc["lease_until"] = json!(time(lease));
        doc["lease_left"] = json!(if lease > now {
            age(lease - now)
        } else {
            "lapsed".into()
        });
    }
    if row.status == "completed" {
        doc["completed_at"] = json!(row.completed_at.map(time));
        doc["status"] = json!(row.response_status);
        doc["body"] = digest(row.response_body.as_deref().unwrap_or_default());
        doc["headers"] = json!(row.response_headers.len() / 2);
    }
    doc
}
