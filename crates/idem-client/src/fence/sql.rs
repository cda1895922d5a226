//! The fence's SQL protocol on `idempotency_keys` (the writer's table): the
//! claim (a non-blocking gate plus a token-guarded upsert of the
//! `in_progress` row), the look at a row the claim did not take, and the
//! completion. docs/fence.md describes the same statements for other languages.

use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Row;

use super::{Claim, FenceTransaction, TableLayout};
use crate::read_through::decode_response;
use crate::{IdemError, StoredResponse};

/// One round trip: take the key's transaction-scoped advisory lock without
/// waiting (the gate: a transaction of another holder still running means
/// "in flight", not a wait), then insert the `in_progress` row, or take over
/// an existing one that has expired or is an uncompleted claim of the same
/// request, only ever with a larger token. Answers `(gate_free, claimed)`.
///
/// The gate's lock id is `hashtextextended(key, 1768187245)` (the seed is
/// "idem" in ASCII): every fenced participant must use the same.
///
/// `$1` key, `$2` fingerprint (hex SHA-256), `$3` token, `$4` ttl in seconds.
pub const CLAIM_SQL: &str = "
WITH gate AS MATERIALIZED (
    SELECT pg_try_advisory_xact_lock(hashtextextended($1, 1768187245)) AS free
), claimed AS (
    INSERT INTO idempotency_keys AS t
        (key, fingerprint, status, token, created_at, expires_at)
    SELECT $1, $2, 'in_progress', $3, now(), now() + make_interval(secs => $4)
    FROM gate WHERE gate.free
    ON CONFLICT (key) DO UPDATE SET
        fingerprint      = EXCLUDED.fingerprint,
        status           = 'in_progress',
        token            = EXCLUDED.token,
        created_at       = EXCLUDED.created_at,
        expires_at       = EXCLUDED.expires_at,
        response_status  = NULL,
        response_body    = NULL,
        response_headers = '{}',
        completed_at     = NULL,
        fenced           = false
    WHERE t.token < EXCLUDED.token
      AND (t.expires_at <= now()
           OR (t.status = 'in_progress' AND t.fingerprint = EXCLUDED.fingerprint))
    RETURNING 1
)
SELECT (SELECT free FROM gate), EXISTS (SELECT 1 FROM claimed)
";

/// Partitioned layout, first statement: the gate (`$1` key), and the
/// transaction's isolation. On this layout the key's lock is also what keeps
/// one row per key (a unique index must include `expires_at`): every writer
/// of the row holds it, so the claim that follows, a new statement with a
/// new snapshot, sees the key's only row in whichever partition and nobody
/// adds another before commit. Only READ COMMITTED gives a statement a new
/// snapshot: under REPEATABLE READ or SERIALIZABLE the claim would not see
/// a row committed before the gate came free and would add a second one (a
/// second payment), so the claim refuses them.
pub const PARTITIONED_GATE_SQL: &str =
    "SELECT pg_try_advisory_xact_lock(hashtextextended($1, 1768187245)), \
     current_setting('transaction_isolation')";

/// Partitioned layout, second statement (the gate held): takes over the
/// key's row under the same rule as [`CLAIM_SQL`] (moving it to the partition
/// of its new expiry), or inserts it when the key has no row. Answers
/// `claimed`. Parameters as in [`CLAIM_SQL`].
pub const PARTITIONED_CLAIM_SQL: &str = "
WITH existing AS (
    SELECT 1 FROM idempotency_keys WHERE key = $1
), taken AS (
    UPDATE idempotency_keys AS t SET
        fingerprint      = $2,
        status           = 'in_progress',
        token            = $3,
        created_at       = now(),
        expires_at       = now() + make_interval(secs => $4),
        response_status  = NULL,
        response_body    = NULL,
        response_headers = '{}',
        completed_at     = NULL,
        fenced           = false
    WHERE t.key = $1 AND t.token < $3
      AND (t.expires_at <= now() OR (t.status = 'in_progress' AND t.fingerprint = $2))
    RETURNING 1
), added AS (
    INSERT INTO idempotency_keys (key, fingerprint, status, token, created_at, expires_at)
    SELECT $1, $2, 'in_progress', $3, now(), now() + make_interval(secs => $4)
    WHERE NOT EXISTS (SELECT 1 FROM existing)
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM taken) OR EXISTS (SELECT 1 FROM added)
";

/// The row a claim did not take. The claim's `ON CONFLICT DO UPDATE` locked
/// it even though its `WHERE` was false (partitioned layout: the gate keeps
/// every other writer off it), so it cannot change before this transaction
/// ends; a new statement sees its latest committed version.
pub const ROW_SQL: &str = "
SELECT fingerprint, status, token, expires_at > now(),
       response_status, response_body, response_headers
FROM idempotency_keys WHERE key = $1
";

/// Stores the response on the row this transaction claimed (token guard),
/// marked `fenced`: the writer's upsert leaves it as it is while it is
/// unexpired. `$1` key, `$2` token, `$3` status, `$4` body, `$5` headers
/// (flat).
pub const COMPLETE_SQL: &str = "
UPDATE idempotency_keys SET
    status = 'completed', response_status = $3, response_body = $4,
    response_headers = $5, completed_at = now(), fenced = true
WHERE key = $1 AND token = $2 AND status = 'in_progress'
RETURNING 1
";

/// The existing row, as [`ROW_SQL`] reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ExistingRow {
    pub fingerprint_hex: String,
    pub completed: bool,
    pub token: i64,
    pub alive: bool,
    pub response: Option<StoredResponse>,
}

/// The decision on a row the claim did not take (see docs/fence.md).
pub(crate) fn decide(row: ExistingRow, fingerprint_hex: &str, token: i64) -> Claim {
    if !row.completed && row.token == token {
        // Claimed by this very transaction before: claiming is idempotent.
        return Claim::Proceed;
    }
    if !row.alive {
        // Expired but not reusable: a larger token has it (this holder is stale).
        return Claim::InFlight;
    }
    if row.fingerprint_hex != fingerprint_hex {
        return Claim::Mismatch;
    }
    match row.response {
        Some(response) if row.completed => Claim::Replay(response),
        // An uncompleted claim with a larger token: a newer holder.
        _ => Claim::InFlight,
    }
}

const CLAIM_TYPES: &[Type] = &[Type::TEXT, Type::TEXT, Type::INT8, Type::FLOAT8];
const ROW_TYPES: &[Type] = &[Type::TEXT];
const GATE_TYPES: &[Type] = &[Type::TEXT];
const COMPLETE_TYPES: &[Type] = &[
    Type::TEXT,
    Type::INT8,
    Type::INT4,
    Type::BYTEA,
    Type::BYTEA_ARRAY,
];

/// Runs `sql` in `tx`: prepared once per connection when `tx` caches
/// statements, else unprepared (still one round trip).
async fn query<'a, T: FenceTransaction<'a>>(
    tx: &T,
    sql: &'static str,
    types: &'static [Type],
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Row>, tokio_postgres::Error> {
    match tx.cached_statement(sql, types).await? {
        Some(statement) => tx.transaction().query(&statement, params).await,
        None => {
            let typed: Vec<(&(dyn ToSql + Sync), Type)> =
                params.iter().copied().zip(types.iter().cloned()).collect();
            tx.transaction().query_typed(sql, &typed).await
        }
    }
}

/// Runs the claim in `tx`.
pub(crate) async fn claim<'a, T: FenceTransaction<'a>>(
    tx: &T,
    layout: TableLayout,
    key: &str,
    fingerprint_hex: &str,
    token: i64,
    ttl_secs: f64,
) -> Result<Claim, IdemError> {
    let params: [&(dyn ToSql + Sync); 4] = [&key, &fingerprint_hex, &token, &ttl_secs];
    let (free, claimed) = match layout {
        TableLayout::Unpartitioned => {
            let rows = query(tx, CLAIM_SQL, CLAIM_TYPES, &params)
                .await
                .map_err(claim_error)?;
            let row = rows
                .first()
                .ok_or_else(|| IdemError::Postgres("the claim answered no row".into()))?;
            (row.try_get::<_, bool>(0)?, row.try_get::<_, bool>(1)?)
        }
        TableLayout::Partitioned => {
            let gate = query(tx, PARTITIONED_GATE_SQL, GATE_TYPES, &[&key]).await?;
            let free: bool = first_column(&gate, "gate")?;
            let isolation: String = gate[0].try_get(1)?;
            if isolation != "read committed" {
                return Err(IdemError::Postgres(format!(
                    "the partitioned fence needs a READ COMMITTED transaction, not {isolation} \
                     (on this layout a stricter one could claim a key twice)"
                )));
            }
            if free {
                let rows = query(tx, PARTITIONED_CLAIM_SQL, CLAIM_TYPES, &params).await?;
                (true, first_column(&rows, "claim")?)
            } else {
                (false, false)
            }
        }
    };
    if claimed {
        return Ok(Claim::Proceed);
    }
    if !free {
        return Ok(Claim::InFlight);
    }
    let Some(row) = query(tx, ROW_SQL, ROW_TYPES, &[&key]).await?.pop() else {
        return Err(IdemError::Postgres(format!(
            "idempotency row for {key:?} vanished while locked"
        )));
    };
    let completed = row.try_get::<_, String>(1)? == "completed";
    let response = match (completed, row.try_get::<_, Option<i32>>(4)?) {
        (true, Some(status)) => Some(decode_response(
            key,
            status,
            row.try_get(5)?,
            row.try_get(6)?,
        )?),
        _ => None,
    };
    let existing = ExistingRow {
        fingerprint_hex: row.try_get::<_, String>(0)?.to_ascii_lowercase(),
        completed,
        token: row.try_get(2)?,
        alive: row.try_get(3)?,
        response,
    };
    Ok(decide(existing, fingerprint_hex, token))
}

fn first_column(rows: &[Row], what: &str) -> Result<bool, IdemError> {
    let row = rows
        .first()
        .ok_or_else(|| IdemError::Postgres(format!("the {what} answered no row")))?;
    Ok(row.try_get(0)?)
}

/// The unpartitioned claim's `ON CONFLICT (key)` on a partitioned table has
/// no unique index to use: say which fence to use.
fn claim_error(error: tokio_postgres::Error) -> IdemError {
    if error.code() == Some(&tokio_postgres::error::SqlState::INVALID_COLUMN_REFERENCE) {
        return IdemError::Postgres(format!(
            "{error}: idempotency_keys looks partitioned; use \
             Fence::with_layout(TableLayout::Partitioned)"
        ));
    }
    error.into()
}

/// Stores `response` on the row `token` claimed in `tx`. `Stale` when this
/// transaction does not hold an `in_progress` row with `token`.
pub(crate) async fn complete<'a, T: FenceTransaction<'a>>(
    tx: &T,
    key: &str,
    token: i64,
    response: &StoredResponse,
) -> Result<(), IdemError> {
    let status = i32::from(response.status);
    let body: &[u8] = &response.body;
    let headers: Vec<&[u8]> = response
        .headers
        .iter()
        .flat_map(|(name, value)| [name.as_bytes(), value.as_ref()])
        .collect();
    let updated = query(
        tx,
        COMPLETE_SQL,
        COMPLETE_TYPES,
        &[&key, &token, &status, &body, &headers],
    )
    .await?;
    if updated.len() == 1 {
        Ok(())
    } else {
        Err(IdemError::Stale(format!(
            "no in-progress row for {key:?} with token {token} in this transaction: claim first"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(fp: &str, completed: bool, token: i64, alive: bool) -> ExistingRow {
        ExistingRow {
            fingerprint_hex: fp.into(),
            completed,
            token,
            alive,
            response: completed.then(|| StoredResponse::new(201, "{}")),
        }
    }

    #[test]
    fn decisions() {
        assert_eq!(decide(row("a", false, 7, true), "a", 7), Claim::Proceed);
        assert_eq!(
            decide(row("a", true, 5, true), "a", 7),
            Claim::Replay(StoredResponse::new(201, "{}"))
        );
        assert_eq!(
            decide(row("a", true, 9, true), "a", 7),
            Claim::Replay(StoredResponse::new(201, "{}")),
            "a newer holder's answer is the key's answer"
        );
        assert_eq!(decide(row("b", true, 5, true), "a", 7), Claim::Mismatch);
        assert_eq!(decide(row("b", false, 9, true), "a", 7), Claim::Mismatch);
        assert_eq!(decide(row("a", false, 9, true), "a", 7), Claim::InFlight);
        assert_eq!(decide(row("b", true, 9, false), "a", 7), Claim::InFlight);
    }
}
