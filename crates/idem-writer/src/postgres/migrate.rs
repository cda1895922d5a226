//! Embedded, versioned schema migrations, applied under an advisory lock so
//! that any number of writers may start (and migrate) at once.

use tracing::{info, warn};

use crate::error::{Context, Error, Result};
use crate::postgres::partitions::{self, Layout, DEFAULT_DAYS_AHEAD};

/// One schema change, applied once, in version order.
struct Migration {
    version: i32,
    name: &'static str,
    sql: &'static str,
}

const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "idempotency_keys",
        sql: include_str!("../../migrations/0001_idempotency_keys.sql"),
    },
    Migration {
        version: 2,
        name: "fenced",
        sql: include_str!("../../migrations/0002_fenced.sql"),
    },
    Migration {
        version: 3,
        name: "lease",
        sql: include_str!("../../migrations/0003_lease.sql"),
    },
];

/// Migration 1 for the partitioned layout (same columns and checks).
const PARTITIONED_TABLE_SQL: &str =
    include_str!("../../migrations/0001_idempotency_keys_partitioned.sql");

/// Transaction-scoped advisory lock serialising migrations ("idemwrit").
const MIGRATION_LOCK_ID: i64 = 0x6964_656d_7772_6974;

/// Applies every migration not yet recorded in `idem_writer_migrations`, all
/// in one transaction. Idempotent; concurrent callers wait for each other.
/// A fresh database gets the unpartitioned layout; an existing table keeps
/// its layout.
///
/// ```no_run
/// # async fn example() -> idem_writer::Result<()> {
/// let mut client = idem_writer::connect("postgres://postgres@127.0.0.1/idem").await?;
/// idem_writer::migrate(&mut client).await?;
/// // Or, for a fresh database, the partitioned layout:
/// idem_writer::migrate_with_layout(&mut client, idem_writer::Layout::Partitioned).await?;
/// # Ok(())
/// # }
/// ```
pub async fn migrate(client: &mut tokio_postgres::Client) -> Result<()> {
    migrate_to(client, None).await.map(|_| ())
}

/// [`migrate`] asking for `layout`: a fresh database gets it (the
/// partitioned one with [`DEFAULT_DAYS_AHEAD`] days of partitions); an
/// existing table of the other layout is refused, with the steps to convert
/// it, and nothing changes.
pub async fn migrate_with_layout(
    client: &mut tokio_postgres::Client,
    layout: Layout,
) -> Result<()> {
    migrate_to(client, Some(layout)).await.map(|_| ())
}

/// Migrates, then answers the table's layout.
pub(crate) async fn migrate_to(
    client: &mut tokio_postgres::Client,
    wanted: Option<Layout>,
) -> Result<Layout> {
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

    let existing = partitions::detect(&tx).await?;
    if let (Some(have), Some(want)) = (existing, wanted) {
        if have != want {
            return Err(Error::Layout(format!(
                "idempotency_keys exists with the {have} layout; it is not converted in place \
                 (rows and keys stay as they are). To move to the {want} layout, see \
                 docs/writer.md, \"Changing the layout\""
            )));
        }
    }
    for migration in MIGRATIONS {
        if applied.contains(&migration.version) {
            continue;
        }
        let partitioned = migration.version == 1 && wanted == Some(Layout::Partitioned);
        let sql = if partitioned {
            PARTITIONED_TABLE_SQL
        } else {
            migration.sql
        };
        tx.batch_execute(sql).await.with_context(|| {
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
    let layout = partitions::detect(client).await?.ok_or_else(|| {
        Error::Layout("idempotency_keys is missing after the migrations".to_string())
    })?;
    if layout == Layout::Partitioned {
        partitions::ensure_ahead(client, DEFAULT_DAYS_AHEAD).await?;
    }
    Ok(layout)
}
