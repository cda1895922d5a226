//! The batch upsert into `idempotency_keys`: one statement per batch (UNNEST
//! of column arrays) that is idempotent and never lets a smaller token
//! overwrite a larger one.

use std::collections::HashMap;
use std::time::SystemTime;

use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Statement};

use crate::record::MirrorRecord;

/// Inserts the batch, or updates a row only when the incoming token is larger
/// (at-least-once delivery, key reuse after expiry). Headers travel as two
/// flat arrays (owning row number, item) and are regrouped per row, because a
/// Postgres array cannot hold rows of different lengths. Rows are written in
/// key order so that concurrent writers lock them in the same order.
pub const UPSERT_SQL: &str = "
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
)
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
    expires_at       = EXCLUDED.expires_at
WHERE t.token < EXCLUDED.token
";

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
    client.execute(statement, &params).await
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
