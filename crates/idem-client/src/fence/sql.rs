//! The fence's SQL protocol on `idempotency_keys` (the writer's table): the
//! claim (a non-blocking gate plus a token-guarded upsert of the
//! `in_progress` row and its lease), the look at a row the claim did not
//! take, the completion and the lease's renewal (each taking the gate,
//! waiting), and the release. docs/fence.md describes the same statements for other
//! languages and shows them from here: the `// ANCHOR` lines mark what it
//! includes.

use futures_util::future::BoxFuture;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{IsolationLevel, Row};

use super::{Claim, FenceTransaction, TableLayout};
use crate::read_through::decode_response;
use crate::{IdemError, StoredResponse};

// ANCHOR: claim
/// One round trip: take the key's transaction-scoped advisory lock without
/// waiting (the gate: another holder's statement or transaction on the key
/// still running means "in flight", not a wait), then insert the
/// `in_progress` row with its lease, or take over an existing one that has
/// expired, or is an uncompleted claim of the same request whose lease
/// lapsed, only ever with a larger token. Answers `(gate_free, claimed)`.
///
/// The gate's lock id is `hashtextextended(key, 1768187245)` (the seed is
/// "idem" in ASCII): every fenced participant must use the same.
///
/// `$1` key, `$2` fingerprint (hex SHA-256), `$3` token, `$4` ttl and `$5`
/// lease in seconds; `$6` and `$7` set `synchronous_commit` and
/// `idle_in_transaction_session_timeout` for the transaction when not NULL
/// (a durable claim commits asynchronously; a claim inside the caller's
/// transaction bounds how long a vanished caller keeps it open).
pub const CLAIM_SQL: &str = "
WITH gate AS MATERIALIZED (
    SELECT CASE WHEN $6::text IS NOT NULL
                THEN set_config('synchronous_commit', $6, true) END,
           CASE WHEN $7::text IS NOT NULL
                THEN set_config('idle_in_transaction_session_timeout', $7, true) END,
           pg_try_advisory_xact_lock(hashtextextended($1, 1768187245)) AS free
), claimed AS (
    INSERT INTO idempotency_keys AS t
        (key, fingerprint, status, token, created_at, expires_at, lease_expires_at)
    SELECT $1, $2, 'in_progress', $3, now(), now() + make_interval(secs => $4),
           now() + make_interval(secs => $5)
    FROM gate WHERE gate.free
    ON CONFLICT (key) DO UPDATE SET
        fingerprint      = EXCLUDED.fingerprint,
        status           = 'in_progress',
        token            = EXCLUDED.token,
        created_at       = EXCLUDED.created_at,
        expires_at       = EXCLUDED.expires_at,
        lease_expires_at = EXCLUDED.lease_expires_at,
        response_status  = NULL,
        response_body    = NULL,
        response_headers = '{}',
        completed_at     = NULL,
        fenced           = false
    WHERE t.token < EXCLUDED.token
      AND (t.expires_at <= now()
           OR (t.status = 'in_progress' AND t.fingerprint = EXCLUDED.fingerprint
               AND coalesce(t.lease_expires_at <= now(), true)))
    RETURNING 1
)
SELECT (SELECT free FROM gate), EXISTS (SELECT 1 FROM claimed)
";
// ANCHOR_END: claim

// ANCHOR: partitioned_gate
/// Partitioned layout, first statement: the session settings of
/// [`CLAIM_SQL`] (`$2`, `$3`), the gate (`$1` key), and the transaction's
/// isolation. On this layout the key's lock is also what keeps one row per
/// key (a unique index must include `expires_at`): every writer of the row
/// holds it, so the claim that follows, a new statement with a new snapshot,
/// sees the key's only row in whichever partition and nobody adds another
/// before commit. Only READ COMMITTED gives a statement a new snapshot: under
/// REPEATABLE READ or SERIALIZABLE the claim would not see a row committed
/// before the gate came free and would add a second one (a second payment),
/// so the claim refuses them. A durable claim runs both statements in one
/// short transaction of its own.
pub const PARTITIONED_GATE_SQL: &str = "
SELECT pg_try_advisory_xact_lock(hashtextextended($1, 1768187245)),
       current_setting('transaction_isolation'),
       CASE WHEN $2::text IS NOT NULL THEN set_config('synchronous_commit', $2, true) END,
       CASE WHEN $3::text IS NOT NULL
            THEN set_config('idle_in_transaction_session_timeout', $3, true) END
";
// ANCHOR_END: partitioned_gate

// ANCHOR: partitioned_claim
/// Partitioned layout, second statement (the gate held): takes over the
/// key's row under the same rule as [`CLAIM_SQL`] (moving it to the partition
/// of its new expiry), or inserts it when the key has no row. Answers
/// `claimed`. `$1` to `$5` as in [`CLAIM_SQL`].
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
        lease_expires_at = now() + make_interval(secs => $5),
        response_status  = NULL,
        response_body    = NULL,
        response_headers = '{}',
        completed_at     = NULL,
        fenced           = false
    WHERE t.key = $1 AND t.token < $3
      AND (t.expires_at <= now()
           OR (t.status = 'in_progress' AND t.fingerprint = $2
               AND coalesce(t.lease_expires_at <= now(), true)))
    RETURNING 1
), added AS (
    INSERT INTO idempotency_keys
        (key, fingerprint, status, token, created_at, expires_at, lease_expires_at)
    SELECT $1, $2, 'in_progress', $3, now(), now() + make_interval(secs => $4),
           now() + make_interval(secs => $5)
    WHERE NOT EXISTS (SELECT 1 FROM existing)
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM taken) OR EXISTS (SELECT 1 FROM added)
";
// ANCHOR_END: partitioned_claim

// ANCHOR: row
/// The row a claim did not take (or a completion did not find), read in a
/// new statement: its latest committed version.
pub const ROW_SQL: &str = "
SELECT fingerprint, status, token, expires_at > now(),
       response_status, response_body, response_headers
FROM idempotency_keys WHERE key = $1
";
// ANCHOR_END: row

// ANCHOR: complete
/// A fenced completion in the caller's transaction, one statement: bounds
/// how long the transaction may wait for a lock (`lock_timeout`) and stay
/// idle (`idle_in_transaction_session_timeout`) by `$6` (milliseconds; NULL
/// leaves the session's), takes the key's gate, waiting (claims hold it for
/// one statement; from here to commit or rollback every claim of the key
/// answers "in flight" at once, and a caller that vanished holds it no
/// longer than `$6`), then stores the response on the key's `in_progress`
/// row held with this token, marked `fenced` (the writer's upsert leaves it
/// as it is while it is unexpired). The gate is a join input of the update,
/// so it is taken before the row is locked, as a claim takes them.
///
/// Answers `held`. With `$7` true, a row not held fails the statement
/// instead (a cast error naming the fence): the transaction is aborted, so
/// a COMMIT sent behind it in the same round trip rolls back.
///
/// `$1` key, `$2` token, `$3` status, `$4` body, `$5` headers (flat),
/// `$6` timeouts, `$7` fail when not held.
pub const COMPLETE_SQL: &str = "
WITH gate AS MATERIALIZED (
    SELECT CASE WHEN $6::text IS NOT NULL THEN set_config('lock_timeout', $6, true) END,
           CASE WHEN $6::text IS NOT NULL
                THEN set_config('idle_in_transaction_session_timeout', $6, true) END,
           pg_advisory_xact_lock(hashtextextended($1, 1768187245))
), done AS (
    UPDATE idempotency_keys AS t SET
        status = 'completed', response_status = $3, response_body = $4,
        response_headers = $5, completed_at = now(), fenced = true
    FROM gate
    WHERE t.key = $1 AND t.token = $2 AND t.status = 'in_progress'
    RETURNING 1
)
SELECT CASE WHEN held OR NOT $7 THEN held
            ELSE ('idem fence: the key is not held with this token: ' || held)::boolean END
FROM (SELECT count(*) = 1 AS held FROM done) AS d
";
// ANCHOR_END: complete

// ANCHOR: complete_with_effect
/// [`COMPLETE_SQL`] (failing when not held) and the caller's business
/// effect in one autocommitted statement: no BEGIN or COMMIT, one round
/// trip. `{effect}` stands for one INSERT, UPDATE or DELETE whose
/// parameters are numbered from `$7` ([`EFFECT_FIRST_PARAM`]); `$1` to `$6`
/// as [`COMPLETE_SQL`]'s. The effect is a data-modifying CTE the main query
/// does not read, so Postgres runs it after the main query, which fails
/// when the row is not held: then the statement, effect and all, commits
/// nothing. An effect that fails fails the completion with it.
pub const COMPLETE_WITH_EFFECT_SQL: &str = "
WITH gate AS MATERIALIZED (
    SELECT CASE WHEN $6::text IS NOT NULL THEN set_config('lock_timeout', $6, true) END,
           pg_advisory_xact_lock(hashtextextended($1, 1768187245))
), done AS (
    UPDATE idempotency_keys AS t SET
        status = 'completed', response_status = $3, response_body = $4,
        response_headers = $5, completed_at = now(), fenced = true
    FROM gate
    WHERE t.key = $1 AND t.token = $2 AND t.status = 'in_progress'
    RETURNING 1
), effect AS (
{effect}
)
SELECT CASE WHEN held THEN held
            ELSE ('idem fence: the key is not held with this token: ' || held)::boolean END
FROM (SELECT count(*) = 1 AS held FROM done) AS d
";
// ANCHOR_END: complete_with_effect

/// The number of [`COMPLETE_WITH_EFFECT_SQL`]'s first parameter of the
/// caller's effect (`$7`): the fence's own come first.
pub const EFFECT_FIRST_PARAM: usize = 7;

/// What the message of [`COMPLETE_SQL`]'s failure (SQLSTATE `22P02`)
/// contains when the row is not held.
pub const NOT_HELD_MESSAGE: &str = "idem fence: the key is not held";

// ANCHOR: renew
/// Extends the lease of the key's `in_progress` row held with this token,
/// the gate taken first as [`COMPLETE_SQL`] takes it (so nobody takes the
/// key over before the transaction ends): `$1` key, `$2` token, `$3` lease
/// in seconds from now, `$4` timeouts as `COMPLETE_SQL`'s `$6`. Answers
/// `held`.
pub const RENEW_SQL: &str = "
WITH gate AS MATERIALIZED (
    SELECT CASE WHEN $4::text IS NOT NULL THEN set_config('lock_timeout', $4, true) END,
           CASE WHEN $4::text IS NOT NULL
                THEN set_config('idle_in_transaction_session_timeout', $4, true) END,
           pg_advisory_xact_lock(hashtextextended($1, 1768187245))
), renewed AS (
    UPDATE idempotency_keys AS t SET lease_expires_at = now() + make_interval(secs => $3)
    FROM gate
    WHERE t.key = $1 AND t.token = $2 AND t.status = 'in_progress'
    RETURNING 1
)
SELECT count(*) = 1 FROM renewed
";
// ANCHOR_END: renew

// ANCHOR: release
/// Gives up a claim that will not complete: deletes the key's `in_progress`
/// row held with this token (`$1` key, `$2` token), so a retry proceeds at
/// once instead of after the lease.
pub const RELEASE_SQL: &str = "
DELETE FROM idempotency_keys WHERE key = $1 AND token = $2 AND status = 'in_progress'
";
// ANCHOR_END: release

/// The existing row, as [`ROW_SQL`] reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ExistingRow {
    pub fingerprint_hex: String,
    pub completed: bool,
    pub token: i64,
    pub alive: bool,
    pub response: Option<StoredResponse>,
}

/// The decision on a row the claim did not take, or that a completion did
/// not find held with its token (see docs/fence.md).
pub(crate) fn decide(row: ExistingRow, fingerprint_hex: &str, token: i64) -> Claim {
    if !row.completed && row.token == token {
        // Claimed with this very token before: claiming is idempotent.
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
        // An uncompleted claim: a newer holder, or one whose lease still runs.
        _ => Claim::InFlight,
    }
}

/// What a fenced write (completion, renewal) found.
pub(crate) enum Written {
    /// The row held with the token was written.
    Held,
    /// It is not held with the token: what the key holds instead.
    Lost(Claim),
}

/// The settings a fence applies to the transactions it works in, as
/// `set_config` values (milliseconds; `None` leaves the session's).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Guard {
    /// `idle_in_transaction_session_timeout` and `lock_timeout`.
    pub idle_timeout_ms: Option<u64>,
}

impl Guard {
    fn idle(&self) -> Option<String> {
        self.idle_timeout_ms.map(|ms| ms.max(1).to_string())
    }
}

/// The claim's inputs.
pub(crate) struct ClaimArgs<'k> {
    pub layout: TableLayout,
    pub key: &'k str,
    pub fingerprint_hex: String,
    pub token: i64,
    pub ttl_secs: f64,
    pub lease_secs: f64,
}

const CLAIM_TYPES: &[Type] = &[
    Type::TEXT,
    Type::TEXT,
    Type::INT8,
    Type::FLOAT8,
    Type::FLOAT8,
    Type::TEXT,
    Type::TEXT,
];
const PARTITIONED_CLAIM_TYPES: &[Type] = &[
    Type::TEXT,
    Type::TEXT,
    Type::INT8,
    Type::FLOAT8,
    Type::FLOAT8,
];
const GATE_TYPES: &[Type] = &[Type::TEXT, Type::TEXT, Type::TEXT];
const KEY_TYPES: &[Type] = &[Type::TEXT];
const KEY_TOKEN_TYPES: &[Type] = &[Type::TEXT, Type::INT8];
const RENEW_TYPES: &[Type] = &[Type::TEXT, Type::INT8, Type::FLOAT8, Type::TEXT];
const COMPLETE_TYPES: &[Type] = &[
    Type::TEXT,
    Type::INT8,
    Type::INT4,
    Type::BYTEA,
    Type::BYTEA_ARRAY,
    Type::TEXT,
    Type::BOOL,
];

/// Where the fence's statements run: a transaction or a connection, with a
/// statement cache (deadpool's) or without (one round trip, planned anew).
pub(crate) trait Exec: Send + Sync {
    /// Sends `sql` on the first poll of the future (after a statement-cache
    /// hit, which needs no round trip), so futures polled in turn pipeline
    /// in that order.
    fn query<'s>(
        &'s self,
        sql: &'static str,
        types: &'static [Type],
        params: &'s [&'s (dyn ToSql + Sync)],
    ) -> BoxFuture<'s, Result<Vec<Row>, tokio_postgres::Error>>;
}

/// Runs `sql` on `client`: prepared once per connection through `cache`
/// when given, else unprepared.
async fn run(
    client: &tokio_postgres::Client,
    cache: Option<&deadpool_postgres::ClientWrapper>,
    sql: &'static str,
    types: &'static [Type],
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Row>, tokio_postgres::Error> {
    match cache {
        Some(cache) => {
            let statement = cache.prepare_typed_cached(sql, types).await?;
            client.query(&statement, params).await
        }
        None => {
            let typed: Vec<(&(dyn ToSql + Sync), Type)> =
                params.iter().copied().zip(types.iter().cloned()).collect();
            client.query_typed(sql, &typed).await
        }
    }
}

impl<'a, T: FenceTransaction<'a>> Exec for T {
    fn query<'s>(
        &'s self,
        sql: &'static str,
        types: &'static [Type],
        params: &'s [&'s (dyn ToSql + Sync)],
    ) -> BoxFuture<'s, Result<Vec<Row>, tokio_postgres::Error>> {
        Box::pin(async move {
            match self.cached_statement(sql, types).await? {
                Some(statement) => self.transaction().query(&statement, params).await,
                None => {
                    let typed: Vec<(&(dyn ToSql + Sync), Type)> =
                        params.iter().copied().zip(types.iter().cloned()).collect();
                    self.transaction().query_typed(sql, &typed).await
                }
            }
        })
    }
}

impl Exec for tokio_postgres::Client {
    fn query<'s>(
        &'s self,
        sql: &'static str,
        types: &'static [Type],
        params: &'s [&'s (dyn ToSql + Sync)],
    ) -> BoxFuture<'s, Result<Vec<Row>, tokio_postgres::Error>> {
        Box::pin(run(self, None, sql, types, params))
    }
}

impl Exec for deadpool_postgres::Object {
    fn query<'s>(
        &'s self,
        sql: &'static str,
        types: &'static [Type],
        params: &'s [&'s (dyn ToSql + Sync)],
    ) -> BoxFuture<'s, Result<Vec<Row>, tokio_postgres::Error>> {
        let wrapper: &deadpool_postgres::ClientWrapper = self;
        Box::pin(run(wrapper, Some(wrapper), sql, types, params))
    }
}

/// A connection a durable claim or a release runs on, outside the caller's
/// transactions: its statements commit on their own.
pub(crate) trait Conn: Exec {
    type Tx<'t>: FenceTransaction<'t>
    where
        Self: 't;
    /// A transaction of its own (the partitioned claim's two statements), at
    /// READ COMMITTED whatever the database's default.
    fn begin(&mut self) -> BoxFuture<'_, Result<Self::Tx<'_>, tokio_postgres::Error>>;
    /// The client, and its statement cache if it has one.
    fn parts(
        &self,
    ) -> (
        &tokio_postgres::Client,
        Option<&deadpool_postgres::ClientWrapper>,
    );
}

impl Conn for tokio_postgres::Client {
    type Tx<'t> = tokio_postgres::Transaction<'t>;
    fn begin(&mut self) -> BoxFuture<'_, Result<Self::Tx<'_>, tokio_postgres::Error>> {
        Box::pin(
            self.build_transaction()
                .isolation_level(IsolationLevel::ReadCommitted)
                .start(),
        )
    }
    fn parts(
        &self,
    ) -> (
        &tokio_postgres::Client,
        Option<&deadpool_postgres::ClientWrapper>,
    ) {
        (self, None)
    }
}

impl Conn for deadpool_postgres::Object {
    type Tx<'t> = deadpool_postgres::Transaction<'t>;
    fn begin(&mut self) -> BoxFuture<'_, Result<Self::Tx<'_>, tokio_postgres::Error>> {
        Box::pin(
            deadpool_postgres::ClientWrapper::build_transaction(self)
                .isolation_level(IsolationLevel::ReadCommitted)
                .start(),
        )
    }
    fn parts(
        &self,
    ) -> (
        &tokio_postgres::Client,
        Option<&deadpool_postgres::ClientWrapper>,
    ) {
        let wrapper: &deadpool_postgres::ClientWrapper = self;
        (wrapper, Some(wrapper))
    }
}

/// A claim in the caller's transaction `tx` (the one-transaction shape):
/// with the guard's idle timeout on `tx`, its commit as configured.
pub(crate) async fn claim_in<E: Exec>(
    tx: &E,
    args: &ClaimArgs<'_>,
    guard: Guard,
) -> Result<Claim, IdemError> {
    let idle = guard.idle();
    let (free, claimed) = match args.layout {
        TableLayout::Unpartitioned => claim_statement(tx, args, None, idle.as_deref()).await?,
        TableLayout::Partitioned => partitioned_claim(tx, args, None, idle.as_deref()).await?,
    };
    settle_claim(tx, args, free, claimed).await
}

/// A durable claim: committed on its own before the call returns (one
/// statement; the partitioned layout's two in a transaction of their own),
/// asynchronously (`synchronous_commit = off`): a claim a crash loses only
/// lets a retry run beside its holder, and the completion's token check keeps
/// the effect single (docs/fence.md).
pub(crate) async fn claim_durably<C: Conn>(
    conn: &mut C,
    args: &ClaimArgs<'_>,
    guard: Guard,
) -> Result<Claim, IdemError> {
    let (free, claimed) = match args.layout {
        TableLayout::Unpartitioned => claim_statement(&*conn, args, Some("off"), None).await?,
        TableLayout::Partitioned => {
            // The gate is held until this short transaction ends: bounded
            // like any other the fence works in, should its caller vanish.
            let tx = conn.begin().await?;
            let idle = guard.idle();
            let decided = partitioned_claim(&tx, args, Some("off"), idle.as_deref()).await?;
            tx.commit().await?;
            decided
        }
    };
    settle_claim(&*conn, args, free, claimed).await
}

/// The unpartitioned claim: `(free, claimed)`.
async fn claim_statement<E: Exec + ?Sized>(
    exec: &E,
    args: &ClaimArgs<'_>,
    synchronous_commit: Option<&str>,
    idle: Option<&str>,
) -> Result<(bool, bool), IdemError> {
    let params: [&(dyn ToSql + Sync); 7] = [
        &args.key,
        &args.fingerprint_hex,
        &args.token,
        &args.ttl_secs,
        &args.lease_secs,
        &synchronous_commit,
        &idle,
    ];
    let rows = exec
        .query(CLAIM_SQL, CLAIM_TYPES, &params)
        .await
        .map_err(claim_error)?;
    let row = rows
        .first()
        .ok_or_else(|| IdemError::Postgres("the claim answered no row".into()))?;
    Ok((row.try_get::<_, bool>(0)?, row.try_get::<_, bool>(1)?))
}

/// The partitioned claim's two statements in `tx`: `(free, claimed)`.
async fn partitioned_claim<E: Exec + ?Sized>(
    tx: &E,
    args: &ClaimArgs<'_>,
    synchronous_commit: Option<&str>,
    idle: Option<&str>,
) -> Result<(bool, bool), IdemError> {
    let gate = tx
        .query(
            PARTITIONED_GATE_SQL,
            GATE_TYPES,
            &[&args.key, &synchronous_commit, &idle],
        )
        .await?;
    let free: bool = first_column(&gate, "gate")?;
    let isolation: String = gate[0].try_get(1)?;
    if isolation != "read committed" {
        return Err(IdemError::Postgres(format!(
            "the partitioned fence needs a READ COMMITTED transaction, not {isolation} \
             (on this layout a stricter one could claim a key twice)"
        )));
    }
    if !free {
        return Ok((false, false));
    }
    let params: [&(dyn ToSql + Sync); 5] = [
        &args.key,
        &args.fingerprint_hex,
        &args.token,
        &args.ttl_secs,
        &args.lease_secs,
    ];
    let rows = tx
        .query(PARTITIONED_CLAIM_SQL, PARTITIONED_CLAIM_TYPES, &params)
        .await?;
    Ok((true, first_column(&rows, "claim")?))
}

/// The claim's answer from `(free, claimed)`, reading the row when needed.
async fn settle_claim<E: Exec + ?Sized>(
    exec: &E,
    args: &ClaimArgs<'_>,
    free: bool,
    claimed: bool,
) -> Result<Claim, IdemError> {
    if claimed {
        return Ok(Claim::Proceed);
    }
    if !free {
        return Ok(Claim::InFlight);
    }
    Ok(match existing(exec, args.key).await? {
        Some(row) => decide(row, &args.fingerprint_hex, args.token),
        // Deleted since (released, or expired and cleaned up): ask again.
        None => Claim::InFlight,
    })
}

/// The key's row as [`ROW_SQL`] reads it, if any.
async fn existing<E: Exec + ?Sized>(exec: &E, key: &str) -> Result<Option<ExistingRow>, IdemError> {
    let Some(row) = exec.query(ROW_SQL, KEY_TYPES, &[&key]).await?.pop() else {
        return Ok(None);
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
    Ok(Some(ExistingRow {
        fingerprint_hex: row.try_get::<_, String>(0)?.to_ascii_lowercase(),
        completed,
        token: row.try_get(2)?,
        alive: row.try_get(3)?,
        response,
    }))
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

/// What the key holds for `token`, as [`decide`] answers on its row (no
/// row: `InFlight`).
async fn key_holds<E: Exec + ?Sized>(
    exec: &E,
    key: &str,
    fingerprint_hex: &str,
    token: i64,
) -> Result<Claim, IdemError> {
    Ok(match existing(exec, key).await? {
        Some(row) => decide(row, fingerprint_hex, token),
        None => Claim::InFlight,
    })
}

/// After a fenced write found no row held with `token`: what the key holds.
async fn lost<E: Exec + ?Sized>(
    exec: &E,
    key: &str,
    fingerprint_hex: &str,
    token: i64,
) -> Result<Written, IdemError> {
    Ok(Written::Lost(
        match key_holds(exec, key, fingerprint_hex, token).await? {
            // Completed with this very token: an earlier completion of ours.
            Claim::Proceed => Claim::InFlight,
            other => other,
        },
    ))
}

/// [`COMPLETE_SQL`]'s parameters, owned for the call.
struct Completion<'r> {
    key: &'r str,
    token: i64,
    status: i32,
    body: &'r [u8],
    headers: Vec<&'r [u8]>,
    idle: Option<String>,
    fail_when_not_held: bool,
}

impl<'r> Completion<'r> {
    fn new(
        key: &'r str,
        token: i64,
        guard: Guard,
        response: &'r StoredResponse,
        fail_when_not_held: bool,
    ) -> Self {
        Completion {
            key,
            token,
            status: i32::from(response.status),
            body: &response.body,
            headers: response
                .headers
                .iter()
                .flat_map(|(name, value)| [name.as_bytes(), value.as_ref()])
                .collect(),
            idle: guard.idle(),
            fail_when_not_held,
        }
    }

    /// `$1` to `$7`, in [`COMPLETE_TYPES`]' order.
    fn params(&self) -> [&(dyn ToSql + Sync); 7] {
        [
            &self.key,
            &self.token,
            &self.status,
            &self.body,
            &self.headers,
            &self.idle,
            &self.fail_when_not_held,
        ]
    }
}

/// Stores `response` on the row held with `token`, in `tx` (the gate taken
/// first); `Lost` with what the key holds when it is not held so.
pub(crate) async fn complete<E: Exec>(
    tx: &E,
    key: &str,
    fingerprint_hex: &str,
    token: i64,
    guard: Guard,
    response: &StoredResponse,
) -> Result<Written, IdemError> {
    let completion = Completion::new(key, token, guard, response, false);
    let rows = tx
        .query(COMPLETE_SQL, COMPLETE_TYPES, &completion.params())
        .await?;
    if first_column(&rows, "completion")? {
        Ok(Written::Held)
    } else {
        lost(tx, key, fingerprint_hex, token).await
    }
}

/// [`complete`], then COMMIT, sent together: one round trip. The
/// completion fails when the row is not held (`$7`), which aborts `tx`, so
/// the COMMIT behind it rolls back and nothing of `tx` is committed; the
/// key's row is then read outside it. COMMIT is sent only once the
/// completion was sent (its first poll left it waiting for the answer);
/// after that COMMIT, `tx` is ended without the ROLLBACK its drop would
/// send. `tx` must be the transaction itself, not a savepoint: its COMMIT
/// commits the whole transaction.
pub(crate) async fn complete_and_commit<'a, T: FenceTransaction<'a>>(
    tx: T,
    key: &str,
    fingerprint_hex: &str,
    token: i64,
    guard: Guard,
    response: &StoredResponse,
) -> Result<Written, IdemError> {
    // Prepared first (a connection's first use of a statement prepares it
    // in a round trip of its own), and held: nothing between here and the
    // send can turn the completion into a prepare behind the COMMIT.
    let statement = tx.cached_statement(COMPLETE_SQL, COMPLETE_TYPES).await?;
    let args = Completion::new(key, token, guard, response, true);
    let params = args.params();
    let typed: Vec<(&(dyn ToSql + Sync), Type)> = match statement {
        Some(_) => Vec::new(),
        None => params
            .iter()
            .copied()
            .zip(COMPLETE_TYPES.iter().cloned())
            .collect(),
    };
    let mut completion: BoxFuture<'_, Result<Vec<Row>, tokio_postgres::Error>> = match &statement {
        Some(statement) => Box::pin(tx.transaction().query(statement, &params)),
        None => Box::pin(tx.transaction().query_typed(COMPLETE_SQL, &typed)),
    };
    // tokio-postgres sends a query at its first poll, and answers it there
    // only when it could not send it (parameters it cannot encode, a closed
    // connection): then no COMMIT follows.
    let first =
        std::future::poll_fn(|cx| std::task::Poll::Ready(completion.as_mut().poll(cx))).await;
    let (completion, commit) = match first {
        std::task::Poll::Pending => {
            let commit = tx.transaction().batch_execute("COMMIT");
            futures_util::future::join(completion, commit).await
        }
        std::task::Poll::Ready(answer) => {
            drop(completion);
            return match answer {
                Ok(rows) if first_column(&rows, "completion")? => {
                    tx.commit().await?;
                    Ok(Written::Held)
                }
                Ok(_) => Err(IdemError::Postgres(
                    "the completion answered not held instead of failing".into(),
                )),
                Err(err) => {
                    tx.rollback().await?;
                    Err(err.into())
                }
            };
        }
    };
    // COMMIT was sent: `tx` has ended, committed or (its completion failed)
    // rolled back.
    let outcome = match (completion, commit) {
        (_, Err(err)) => Err(err.into()),
        (Ok(rows), Ok(())) => first_column(&rows, "completion").map(|_| Written::Held),
        (Err(err), Ok(())) => failed_completion(&tx, err, key, fingerprint_hex, token).await,
    };
    tx.end_committed();
    outcome
}

/// After a completion that failed and committed nothing: `Lost` with what
/// the key holds when it failed as not held or (on the partitioned layout)
/// moved by a takeover; else the error.
async fn failed_completion<E: Exec + ?Sized>(
    exec: &E,
    err: tokio_postgres::Error,
    key: &str,
    fingerprint_hex: &str,
    token: i64,
) -> Result<Written, IdemError> {
    if !is_not_held(&err) && !is_moved(&err) {
        return Err(err.into());
    }
    match key_holds(exec, key, fingerprint_hex, token).await? {
        // Still this holder's: a serialization failure of its own
        // transaction, not a takeover.
        Claim::Proceed if !is_not_held(&err) => Err(err.into()),
        // Completed with this very token: an earlier completion.
        Claim::Proceed => Ok(Written::Lost(Claim::InFlight)),
        other => Ok(Written::Lost(other)),
    }
}

/// [`complete_with_effect`]'s inputs.
pub(crate) struct EffectArgs<'r> {
    pub key: &'r str,
    pub fingerprint_hex: String,
    pub token: i64,
    pub guard: Guard,
    pub response: &'r StoredResponse,
    /// [`COMPLETE_WITH_EFFECT_SQL`] with the effect in it ([`effect_statement`]).
    pub sql: String,
    /// The effect's parameters (`$7` onward).
    pub params: &'r [&'r (dyn ToSql + Sync)],
}

/// [`COMPLETE_WITH_EFFECT_SQL`] with its effect: the completion and the
/// effect commit together in one autocommitted statement, or neither does
/// (then `Lost` with what the key holds, as [`complete_and_commit`]
/// answers). Prepared once per connection through its statement cache (a
/// plain client prepares it on every call: one round trip more).
pub(crate) async fn complete_with_effect<C: Conn>(
    conn: &C,
    args: &EffectArgs<'_>,
) -> Result<Written, IdemError> {
    let completion = Completion::new(args.key, args.token, args.guard, args.response, true);
    let own = completion.params();
    let params: Vec<&(dyn ToSql + Sync)> = own[..EFFECT_FIRST_PARAM - 1]
        .iter()
        .chain(args.params)
        .copied()
        .collect();
    let (client, cache) = conn.parts();
    let types = &COMPLETE_TYPES[..EFFECT_FIRST_PARAM - 1];
    let statement = match cache {
        Some(cache) => cache.prepare_typed_cached(&args.sql, types).await?,
        None => client.prepare_typed(&args.sql, types).await?,
    };
    match client.query(&statement, &params).await {
        Ok(rows) => first_column(&rows, "completion").map(|_| Written::Held),
        Err(err) => failed_completion(conn, err, args.key, &args.fingerprint_hex, args.token).await,
    }
}

/// [`COMPLETE_WITH_EFFECT_SQL`] around `effect`, which must be one INSERT,
/// UPDATE or DELETE (a SELECT there would never run); a trailing semicolon
/// is dropped.
pub(crate) fn effect_statement(effect: &str) -> Result<String, IdemError> {
    let trimmed = effect.trim().trim_end_matches(';').trim_end();
    let verb = trimmed
        .split(|c: char| !c.is_ascii_alphabetic())
        .next()
        .unwrap_or_default();
    if !["insert", "update", "delete"]
        .iter()
        .any(|allowed| verb.eq_ignore_ascii_case(allowed))
    {
        return Err(IdemError::BadArg(format!(
            "the fenced effect must be one INSERT, UPDATE or DELETE statement, not {:?}",
            trimmed.chars().take(40).collect::<String>()
        )));
    }
    Ok(COMPLETE_WITH_EFFECT_SQL.replacen("{effect}", trimmed, 1))
}

/// The failure [`COMPLETE_SQL`] makes when asked to (`$7`) and the row is
/// not held with the token.
fn is_not_held(error: &tokio_postgres::Error) -> bool {
    error.as_db_error().is_some_and(|db| {
        *db.code() == tokio_postgres::error::SqlState::INVALID_TEXT_REPRESENTATION
            && db.message().contains(NOT_HELD_MESSAGE)
    })
}

/// A serialization failure: on the partitioned layout, what a completion
/// waiting for the gate meets when a takeover moved the row to another
/// partition meanwhile (under READ COMMITTED too).
fn is_moved(error: &tokio_postgres::Error) -> bool {
    error.code() == Some(&tokio_postgres::error::SqlState::T_R_SERIALIZATION_FAILURE)
}

/// Extends the lease of the row held with `token`, in `tx` (the gate taken
/// first, so nobody takes the key over before `tx` ends).
pub(crate) async fn renew<E: Exec>(
    tx: &E,
    key: &str,
    fingerprint_hex: &str,
    token: i64,
    guard: Guard,
    lease_secs: f64,
) -> Result<Written, IdemError> {
    let idle = guard.idle();
    let params: [&(dyn ToSql + Sync); 4] = [&key, &token, &lease_secs, &idle];
    let rows = tx.query(RENEW_SQL, RENEW_TYPES, &params).await?;
    if first_column(&rows, "renewal")? {
        Ok(Written::Held)
    } else {
        lost(tx, key, fingerprint_hex, token).await
    }
}

/// Deletes the `in_progress` row held with `token`, if any.
pub(crate) async fn release<C: Conn>(conn: &C, key: &str, token: i64) -> Result<(), IdemError> {
    conn.query(RELEASE_SQL, KEY_TOKEN_TYPES, &[&key, &token])
        .await?;
    Ok(())
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
    fn the_effect_must_be_one_write() {
        for effect in [
            "INSERT INTO t VALUES ($7)",
            "  update t SET a = $7 ;\n",
            "Delete FROM t WHERE a = $7",
            "INSERT INTO t VALUES ($7);",
        ] {
            let sql = effect_statement(effect).expect(effect);
            assert!(!sql.contains(';'), "{sql}");
            assert!(sql.contains(effect.trim().trim_end_matches(';').trim_end()));
            assert!(!sql.contains("{effect}"));
        }
        for effect in [
            "",
            ";",
            "SELECT 1",
            "WITH x AS (SELECT 1) INSERT INTO t SELECT * FROM x",
            "-- note\nINSERT INTO t VALUES ($7)",
            "inserts",
        ] {
            assert!(
                matches!(effect_statement(effect), Err(IdemError::BadArg(_))),
                "{effect:?}"
            );
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
        assert_eq!(
            decide(row("a", false, 5, true), "a", 7),
            Claim::InFlight,
            "an older holder whose lease runs"
        );
        assert_eq!(decide(row("b", true, 9, false), "a", 7), Claim::InFlight);
    }
}
