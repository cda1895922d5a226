//! Embedded, versioned schema migrations, applied under an advisory lock so
//! that any number of writers may start (and migrate) at once.

use anyhow::Context;
use tracing::{info, warn};

/// One schema change, applied once, in version order.
struct Migration {
    version: i32,
    name: &'static str,
    sql: &'static str,
}

const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    name: "idempotency_keys",
    sql: include_str!("../migrations/0001_idempotency_keys.sql"),
}];

/// Transaction-scoped advisory lock serialising migrations ("idemwrit").
const MIGRATION_LOCK_ID: i64 = 0x6964_656d_7772_6974;

/// Applies every migration not yet recorded in `idem_writer_migrations`, all
/// in one transaction. Idempotent; concurrent callers wait for each other.
pub async fn migrate(client: &mut tokio_postgres::Client) -> anyhow::Result<()> {
    let tx = client
        .transaction()
        .await
        .context("begin migration transaction")?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK_ID])
        .await
        .context("take the migration lock")?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS idem_writer_migrations (
             version    INT         PRIMARY KEY,
             name       TEXT        NOT NULL,
             applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
         )",
    )
    .await
    .context("create idem_writer_migrations")?;
    let applied: Vec<i32> = tx
        .query(
            "SELECT version FROM idem_writer_migrations ORDER BY version",
            &[],
        )
        .await
        .context("read applied migrations")?
        .iter()
        .map(|row| row.get(0))
        .collect();

    for migration in MIGRATIONS {
        if applied.contains(&migration.version) {
            continue;
        }
        tx.batch_execute(migration.sql).await.with_context(|| {
            format!("apply migration {} ({})", migration.version, migration.name)
        })?;
        tx.execute(
            "INSERT INTO idem_writer_migrations (version, name) VALUES ($1, $2)",
            &[&migration.version, &migration.name],
        )
        .await
        .context("record migration")?;
        info!(
            version = migration.version,
            name = migration.name,
            "applied migration"
        );
    }

    let latest_known = MIGRATIONS.last().map_or(0, |m| m.version);
    if let Some(newer) = applied.iter().find(|v| **v > latest_known) {
        warn!(
            version = newer,
            latest_known, "database schema is newer than this writer; continuing"
        );
    }
    tx.commit().await.context("commit migrations")?;
    Ok(())
}
