//! The example's Postgres side: connection pool, its own migration (the
//! `payments` table) and its queries.

use std::time::Duration;

use anyhow::Context;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use serde::Serialize;
use tokio_postgres::NoTls;

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

/// A pool of up to `max_size` connections to `database_url`.
pub fn pool(database_url: &str, max_size: usize) -> anyhow::Result<Pool> {
    let mut config: tokio_postgres::Config =
        database_url.parse().context("invalid DATABASE_URL")?;
    config.connect_timeout(POOL_TIMEOUT);
    // A statement whose bytes the server stops acknowledging (its host or
    // the link gone) fails after this instead of waiting for TCP's
    // retransmissions (about 15 minutes), freeing the pooled connection.
    config.tcp_user_timeout(TCP_USER_TIMEOUT);
    let manager = Manager::from_config(
        config,
        NoTls,
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

/// Inserts a payment inside `tx` (the fenced path: it commits with the
/// idempotency row).
pub async fn insert_payment_in(
    tx: &deadpool_postgres::Transaction<'_>,
    amount: i64,
    currency: &str,
    recipient: &str,
) -> anyhow::Result<Payment> {
    let statement = tx.prepare_cached(&insert_sql()).await?;
    let row = tx
        .query_one(&statement, &[&amount, &currency, &recipient])
        .await?;
    payment_from_row(&row)
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
