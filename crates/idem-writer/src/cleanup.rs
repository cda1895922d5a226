//! Deletes rows past `expires_at`, a small batch per short transaction so
//! the job never holds many locks or blocks the mirror for long.

use tokio_postgres::Client;

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
pub async fn delete_expired(
    client: &Client,
    batch_size: u32,
) -> Result<u64, tokio_postgres::Error> {
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
