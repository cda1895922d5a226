//! Removes rows past `expires_at`: on the unpartitioned layout a small batch
//! per short transaction, so the job never holds many locks or blocks the
//! mirror for long; on the partitioned layout whole expired partitions.

use tokio_postgres::Client;

use crate::error::{Context, Result};
use crate::postgres::partitions::{self, Layout};

/// Deletes up to `$1` expired rows; rows another transaction holds (a
/// concurrent upsert reviving the key) are skipped, and re-checked on delete.
const DELETE_EXPIRED_BATCH_SQL: &str = "
WITH doomed AS (
    SELECT key FROM idempotency_keys
    WHERE expires_at < now()
    ORDER BY expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
DELETE FROM idempotency_keys t
USING doomed
WHERE t.key = doomed.key AND t.expires_at < now()
";

/// Deletes every row that has expired, `batch_size` rows per statement
/// (each its own transaction), until a batch comes back short. Returns how
/// many rows were removed.
async fn delete_expired(client: &Client, batch_size: u32) -> Result<u64, tokio_postgres::Error> {
    let statement = client.prepare(DELETE_EXPIRED_BATCH_SQL).await?;
    let limit = i64::from(batch_size.max(1));
    let mut removed = 0;
    loop {
        let deleted = client.execute(&statement, &[&limit]).await?;
        removed += deleted;
        if deleted < limit.unsigned_abs() {
            return Ok(removed);
        }
    }
}

/// What one cleanup pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Cleaned {
    /// The layout the pass found.
    pub layout: Layout,
    /// Rows deleted one by one (unpartitioned layout).
    pub rows_deleted: u64,
    /// Whole expired partitions dropped (partitioned layout), oldest first.
    pub partitions_dropped: Vec<String>,
    /// Partitions created ahead (partitioned layout).
    pub partitions_created: Vec<String>,
}

impl std::fmt::Display for Cleaned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.layout {
            Layout::Unpartitioned => write!(f, "removed {} expired rows", self.rows_deleted),
            Layout::Partitioned => write!(
                f,
                "dropped {} expired partitions, created {} ahead",
                self.partitions_dropped.len(),
                self.partitions_created.len()
            ),
        }
    }
}

/// One cleanup pass on either layout: unpartitioned, delete the expired
/// rows, `batch_size` per transaction; partitioned, drop the expired
/// partitions and create `days_ahead` days of partitions ahead.
pub async fn clean(client: &Client, batch_size: u32, days_ahead: u32) -> Result<Cleaned> {
    match partitions::detect(client).await? {
        Some(Layout::Partitioned) => Ok(Cleaned {
            layout: Layout::Partitioned,
            partitions_dropped: partitions::drop_expired(client).await?,
            partitions_created: partitions::ensure_ahead(client, days_ahead).await?,
            ..Cleaned::default()
        }),
        _ => Ok(Cleaned {
            rows_deleted: delete_expired(client, batch_size)
                .await
                .context("delete expired rows")?,
            ..Cleaned::default()
        }),
    }
}
