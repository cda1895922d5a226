//! The example's Postgres side: connection pool, its own migration (the
//! `payments` table) and its queries.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use idem_writer::secure::PgTarget;
use serde::Serialize;

/// Transaction-scoped advisory lock serialising concurrent migrations.
const MIGRATION_LOCK_ID: i64 = 0x7061_796d_656e_7473;

const CREATE_PAYMENTS: &str = "CREATE TABLE IF NOT EXISTS payments (
    id         BIGSERIAL   PRIMARY KEY,
    amount     BIGINT      NOT NULL CHECK (amount > 0),
    currency   TEXT        NOT NULL,
    recipient  TEXT        NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
)";

/// `created_at` as RFC 3339 UTC with microseconds, formatted by Postgres.
const CREATED_AT: &str =
    "to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')";

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Payment {
    pub id: i64,
    pub amount: i64,
    pub currency: String,
    pub recipient: String,
    pub created_at: String,
}

/// Bound on unacknowledged bytes to Postgres (`TCP_USER_TIMEOUT`).
const TCP_USER_TIMEOUT: Duration = Duration::from_secs(10);

/// Bound on opening a connection and on waiting for a free one.
const POOL_TIMEOUT: Duration = Duration::from_secs(5);

/// A pool of up to `max_size` connections to `database_url`, with libpq's
/// TLS settings (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`) read by the
/// writer's [`PgTarget`], as every Rust part of idem reads them.
pub fn pool(database_url: &str, max_size: usize) -> anyhow::Result<Pool> {
    let mut target = PgTarget::parse(database_url).context("DATABASE_URL")?;
    let config = target.config_mut();
    config.connect_timeout(POOL_TIMEOUT);
    // A statement whose bytes the server stops acknowledging (its host or
    // the link gone) fails after this instead of waiting for TCP's
    // retransmissions (about 15 minutes), freeing the pooled connection.
    config.tcp_user_timeout(TCP_USER_TIMEOUT);
    let manager = Manager::from_config(
        target.config().clone(),
        target.tls(),
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(max_size)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(POOL_TIMEOUT))
        .create_timeout(Some(POOL_TIMEOUT))
        .build()
        .context("build the Postgres pool")
}

/// Creates the `payments` table, the simulated processor's ledger and the
/// writer's `idempotency_keys` (the fence writes it too) when missing; safe
/// to run concurrently.
pub async fn migrate(pool: &Pool) -> anyhow::Result<()> {
    let mut client = pool.get().await.context("connect to Postgres")?;
    idem_writer::migrate(&mut client)
        .await
        .context("migrate idempotency_keys")?;
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK_ID])
        .await?;
    tx.batch_execute(CREATE_PAYMENTS)
        .await
        .context("create payments")?;
    tx.batch_execute(crate::processor::CREATE_CHARGES)
        .await
        .context("create processor_charges")?;
    tx.commit().await?;
    Ok(())
}

fn insert_sql() -> String {
    format!(
        "INSERT INTO payments (amount, currency, recipient) VALUES ($1, $2, $3) \
         RETURNING id, amount, currency, recipient, {CREATED_AT}"
    )
}

fn payment_from_row(row: &tokio_postgres::Row) -> anyhow::Result<Payment> {
    Ok(Payment {
        id: row.try_get(0)?,
        amount: row.try_get(1)?,
        currency: row.try_get(2)?,
        recipient: row.try_get(3)?,
        created_at: row.try_get(4)?,
    })
}

/// Inserts a payment in its own (implicit) transaction.
pub async fn insert_payment(
    pool: &Pool,
    amount: i64,
    currency: &str,
    recipient: &str,
) -> anyhow::Result<Payment> {
    let client = pool.get().await?;
    let statement = client.prepare_cached(&insert_sql()).await?;
    let row = client
        .query_one(&statement, &[&amount, &currency, &recipient])
        .await?;
    payment_from_row(&row)
}

/// The fenced payment's row, its values all known beforehand (the id
/// reserved, the time the application's), as the effect of
/// `Fence::commit_effect`: parameters from `$7`, the fence's own first.
pub const INSERT_FENCED: &str =
    "INSERT INTO payments (id, amount, currency, recipient, created_at) \
     VALUES ($7, $8, $9, $10, $11)";

/// How many ids [`PaymentIds`] reserves per round trip.
const RESERVED_IDS: i64 = 64;

/// Payment ids reserved ahead from the table's own sequence, `RESERVED_IDS`
/// per round trip, so a fenced payment's response (its id) is known before
/// its row is written. Ids are unique with every other writer of the table
/// (each is a `nextval`); ids reserved by a process that stops are never
/// used (gaps, as a rolled-back insert leaves).
#[derive(Debug, Default)]
pub struct PaymentIds {
    ready: Mutex<VecDeque<i64>>,
    /// Held by the one task reserving more; the others wait for it.
    reserving: tokio::sync::Mutex<()>,
}

impl PaymentIds {
    /// The next reserved id, reserving more when none is left.
    pub async fn next(&self, pool: &Pool) -> anyhow::Result<i64> {
        loop {
            if let Some(id) = self.pop() {
                return Ok(id);
            }
            let _reserving = self.reserving.lock().await;
            if self.has_any() {
                continue;
            }
            let client = pool.get().await.context("connect to Postgres")?;
            let statement = client
                .prepare_cached(
                    "SELECT nextval(pg_get_serial_sequence('payments', 'id')) \
                     FROM generate_series(1, $1::int8)",
                )
                .await?;
            let rows = client.query(&statement, &[&RESERVED_IDS]).await?;
            let ids = rows
                .iter()
                .map(|row| row.try_get::<_, i64>(0))
                .collect::<Result<Vec<_>, _>>()?;
            self.lock().extend(ids);
        }
    }

    fn pop(&self) -> Option<i64> {
        self.lock().pop_front()
    }

    fn has_any(&self) -> bool {
        !self.lock().is_empty()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<i64>> {
        self.ready
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A fenced payment's row and response, before it is written: `created_at`
/// is now on the application's clock, to the microsecond Postgres keeps.
pub fn new_payment(
    id: i64,
    amount: i64,
    currency: &str,
    recipient: &str,
) -> anyhow::Result<(Payment, SystemTime)> {
    let micros = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_micros();
    let at = UNIX_EPOCH + Duration::from_micros(u64::try_from(micros).unwrap_or(u64::MAX));
    let payment = Payment {
        id,
        amount,
        currency: currency.to_owned(),
        recipient: recipient.to_owned(),
        created_at: rfc3339_micros(at)?,
    };
    Ok((payment, at))
}

/// `at` as Postgres' [`CREATED_AT`] formats it: RFC 3339 UTC, microseconds.
fn rfc3339_micros(at: SystemTime) -> anyhow::Result<String> {
    let format = time::macros::format_description!(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:6]Z"
    );
    Ok(time::OffsetDateTime::from(at).format(&format)?)
}

pub async fn find_payment(pool: &Pool, id: i64) -> anyhow::Result<Option<Payment>> {
    let client = pool.get().await?;
    let sql =
        format!("SELECT id, amount, currency, recipient, {CREATED_AT} FROM payments WHERE id = $1");
    let statement = client.prepare_cached(&sql).await?;
    let Some(row) = client.query_opt(&statement, &[&id]).await? else {
        return Ok(None);
    };
    payment_from_row(&row).map(Some)
}
