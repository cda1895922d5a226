//! The batch upsert into `idempotency_keys`: one statement per batch (UNNEST
//! of column arrays) that is idempotent and never lets a smaller token
//! overwrite a larger one.

use std::collections::HashMap;
use std::time::SystemTime;

use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Statement};

use crate::mirror::record::MirrorRecord;

/// The batch as rows: the column arrays unnested, headers regrouped per row.
macro_rules! incoming_rows {
    () => {
        "
WITH incoming AS (
    SELECT *
    FROM UNNEST($1::text[], $2::text[], $3::int4[], $4::bytea[], $5::int8[],
                $6::timestamptz[], $7::timestamptz[], $8::timestamptz[])
         WITH ORDINALITY
         AS r(key, fingerprint, response_status, response_body, token,
              created_at, completed_at, expires_at, row_no)
), incoming_headers AS (
    SELECT h.row_no, array_agg(h.item ORDER BY h.item_no) AS items
    FROM UNNEST($9::int8[], $10::bytea[]) WITH ORDINALITY AS h(row_no, item, item_no)
    GROUP BY h.row_no
)"
    };
}

/// Inserts the batch, or updates a row only when the incoming token is larger
/// (at-least-once delivery, key reuse after expiry) and the row is not an
/// unexpired answer the fence committed with its effect (`fenced`) nor a
/// claim whose lease runs; or when the row is the `in_progress` claim of the
/// very token completed (a claim the middleware made up front, which its
/// handler did not use and whose release failed: the completion is its
/// answer). Headers
/// travel as two flat arrays (owning row number, item) and are regrouped per
/// row, because a Postgres array cannot hold rows of different lengths. Rows are written in
/// key order so that concurrent writers lock them in the same order.
pub const UPSERT_SQL: &str = concat!(
    incoming_rows!(),
    "
INSERT INTO idempotency_keys AS t
    (key, fingerprint, response_status, response_body, response_headers,
     status, token, created_at, completed_at, expires_at)
SELECT i.key, i.fingerprint, i.response_status, i.response_body,
       COALESCE(h.items, '{}'::bytea[]), 'completed', i.token,
       i.created_at, i.completed_at, i.expires_at
FROM incoming i
LEFT JOIN incoming_headers h ON h.row_no = i.row_no
ORDER BY i.row_no
ON CONFLICT (key) DO UPDATE SET
    fingerprint      = EXCLUDED.fingerprint,
    response_status  = EXCLUDED.response_status,
    response_body    = EXCLUDED.response_body,
    response_headers = EXCLUDED.response_headers,
    status           = EXCLUDED.status,
    token            = EXCLUDED.token,
    created_at       = EXCLUDED.created_at,
    completed_at     = EXCLUDED.completed_at,
    expires_at       = EXCLUDED.expires_at,
    fenced           = false
WHERE (t.token < EXCLUDED.token
       AND NOT (t.fenced AND t.status = 'completed' AND t.expires_at > now())
       AND NOT (t.status = 'in_progress' AND coalesce(t.lease_expires_at > now(), false)))
   OR (t.token = EXCLUDED.token AND t.status = 'in_progress')
"
);

/// Partitioned layout, first statement of the batch's transaction: the
/// per-key locks (the fence's gate lock ids), blocking, in key order. Every
/// writer of a key's row holds this lock, so a later statement of the
/// transaction (a new snapshot) sees the key's only row, wherever its
/// partition, and nobody adds another. `$1` the keys, sorted.
pub const LOCK_KEYS_SQL: &str = "
SELECT count(pg_advisory_xact_lock(hashtextextended(k, 1768187245)))
FROM (SELECT k FROM UNNEST($1::text[]) WITH ORDINALITY AS u(k, n) ORDER BY n) AS sorted
";

/// Partitioned layout, second statement (keys locked): moves an existing row
/// forward only to a larger token (into another partition when its expiry
/// changed), inserts the keys that have no row. Answers the rows written.
pub const PARTITIONED_UPSERT_SQL: &str = concat!(
    incoming_rows!(),
    ", batch AS (
    SELECT i.key, i.fingerprint, i.response_status, i.response_body,
           COALESCE(h.items, '{}'::bytea[]) AS response_headers, i.token,
           i.created_at, i.completed_at, i.expires_at
    FROM incoming i
    LEFT JOIN incoming_headers h ON h.row_no = i.row_no
), moved AS (
    UPDATE idempotency_keys AS t SET
        fingerprint      = b.fingerprint,
        response_status  = b.response_status,
        response_body    = b.response_body,
        response_headers = b.response_headers,
        status           = 'completed',
        token            = b.token,
        created_at       = b.created_at,
        completed_at     = b.completed_at,
        expires_at       = b.expires_at,
        fenced           = false
    FROM batch b
    WHERE t.key = b.key
      AND ((t.token < b.token
            AND NOT (t.fenced AND t.status = 'completed' AND t.expires_at > now())
            AND NOT (t.status = 'in_progress'
                     AND coalesce(t.lease_expires_at > now(), false)))
           OR (t.token = b.token AND t.status = 'in_progress'))
    RETURNING 1
), added AS (
    INSERT INTO idempotency_keys
        (key, fingerprint, response_status, response_body, response_headers,
         status, token, created_at, completed_at, expires_at)
    SELECT b.key, b.fingerprint, b.response_status, b.response_body,
           b.response_headers, 'completed', b.token, b.created_at,
           b.completed_at, b.expires_at
    FROM batch b
    WHERE NOT EXISTS (SELECT 1 FROM idempotency_keys t WHERE t.key = b.key)
    RETURNING 1
)
SELECT (SELECT count(*) FROM moved) + (SELECT count(*) FROM added)
"
);

/// The statements a batch runs with, per layout.
pub enum Statements<'s> {
    /// [`UPSERT_SQL`] prepared.
    Unpartitioned(&'s Statement),
    /// [`LOCK_KEYS_SQL`] and [`PARTITIONED_UPSERT_SQL`] prepared.
    Partitioned {
        /// [`LOCK_KEYS_SQL`] prepared.
        lock: &'s Statement,
        /// [`PARTITIONED_UPSERT_SQL`] prepared.
        upsert: &'s Statement,
    },
}

/// The newest version (largest token) of each key in `records`, sorted by
/// key. Postgres refuses to touch one row twice in a statement, and an older
/// version must never win.
pub fn latest_per_key(records: &[MirrorRecord]) -> Vec<&MirrorRecord> {
    let mut latest: HashMap<&str, &MirrorRecord> = HashMap::with_capacity(records.len());
    for record in records {
        latest
            .entry(record.key.as_str())
            .and_modify(|kept| {
                if record.token > kept.token {
                    *kept = record;
                }
            })
            .or_insert(record);
    }
    let mut rows: Vec<&MirrorRecord> = latest.into_values().collect();
    rows.sort_unstable_by(|a, b| a.key.cmp(&b.key));
    rows
}

/// Runs the upsert (`statement` prepared from [`UPSERT_SQL`]) for `records`
/// in one statement, hence one transaction, committed when it returns.
/// Returns how many rows were inserted or moved forward; rows Postgres
/// already held at the same or a larger token are left as they are.
pub async fn upsert_records(
    client: &Client,
    statement: &Statement,
    records: &[MirrorRecord],
) -> Result<u64, tokio_postgres::Error> {
    upsert_with(client, Statements::Unpartitioned(statement), records).await
}

/// [`upsert_records`] for either layout. The partitioned layout runs one
/// transaction: the keys' locks, then the upsert, then COMMIT (rolled back
/// on an error, so the connection stays usable). The partitions the rows
/// need must exist ([`crate::postgres::partitions::ensure_days`]).
pub async fn upsert_with(
    client: &Client,
    statements: Statements<'_>,
    records: &[MirrorRecord],
) -> Result<u64, tokio_postgres::Error> {
    let rows = latest_per_key(records);
    if rows.is_empty() {
        return Ok(0);
    }
    let keys: Vec<&str> = rows.iter().map(|r| r.key.as_str()).collect();
    let fingerprints: Vec<&str> = rows.iter().map(|r| r.fingerprint.as_str()).collect();
    let statuses: Vec<i32> = rows.iter().map(|r| r.status).collect();
    let bodies: Vec<&[u8]> = rows.iter().map(|r| r.body.as_slice()).collect();
    let tokens: Vec<i64> = rows.iter().map(|r| r.token).collect();
    let created: Vec<SystemTime> = rows.iter().map(|r| r.created_at()).collect();
    let completed: Vec<SystemTime> = rows.iter().map(|r| r.completed_at()).collect();
    let expires: Vec<SystemTime> = rows.iter().map(|r| r.expires_at()).collect();
    let mut header_rows: Vec<i64> = Vec::new();
    let mut header_items: Vec<&[u8]> = Vec::new();
    for (row_no, row) in (1_i64..).zip(&rows) {
        for item in &row.headers {
            header_rows.push(row_no);
            header_items.push(item.as_slice());
        }
    }
    let params: [&(dyn ToSql + Sync); 10] = [
        &keys,
        &fingerprints,
        &statuses,
        &bodies,
        &tokens,
        &created,
        &completed,
        &expires,
        &header_rows,
        &header_items,
    ];
    match statements {
        Statements::Unpartitioned(statement) => client.execute(statement, &params).await,
        Statements::Partitioned { lock, upsert } => {
            // READ COMMITTED whatever the database's default: the upsert
            // must see a row a fence committed while this waited for the
            // keys' locks (a REPEATABLE READ snapshot from before the wait
            // does not, and a second row for the key was added).
            client
                .batch_execute("BEGIN ISOLATION LEVEL READ COMMITTED")
                .await?;
            let attempt = async {
                client.query_one(lock, &[&keys]).await?;
                let written: i64 = client.query_one(upsert, &params).await?.get(0);
                client.batch_execute("COMMIT").await?;
                Ok(written.unsigned_abs())
            };
            let result = attempt.await;
            if result.is_err() {
                let _ = client.batch_execute("ROLLBACK").await;
            }
            result
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(key: &str, token: i64) -> MirrorRecord {
        MirrorRecord {
            key: key.into(),
            token,
            fingerprint: "0".repeat(64),
            status: 200,
            body: Vec::new(),
            headers: Vec::new(),
            created_at_ms: 0,
            completed_at_ms: 0,
            expires_at_ms: 0,
        }
    }

    #[test]
    fn keeps_the_largest_token_per_key_sorted_by_key() {
        let batch = [
            record("b", 5),
            record("a", 3),
            record("b", 9),
            record("b", 7),
            record("a", 1),
        ];
        let kept: Vec<(&str, i64)> = latest_per_key(&batch)
            .into_iter()
            .map(|r| (r.key.as_str(), r.token))
            .collect();
        assert_eq!(kept, vec![("a", 3), ("b", 9)]);
    }
}
