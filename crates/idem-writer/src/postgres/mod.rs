//! The Postgres side of the mirror: the schema and its migrations
//! (`migrate`), the daily partitions of the partitioned layout
//! (`partitions`), the statements rows are written with (`store`), the
//! cleanup job (`cleanup`); and here the connection pool and one attempt at
//! storing a batch, isolating rows Postgres refuses so that one bad record
//! cannot block the rest.

pub mod cleanup;
pub(crate) mod migrate;
pub mod partitions;
pub mod store;

use std::collections::HashSet;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};
use tokio_postgres::error::SqlState;

use crate::error::{Cause, Context, Error, Result};
use crate::mirror::record::MirrorRecord;
use crate::postgres::partitions::{day_of_ms, ensure_days, Layout};
use crate::postgres::store::{
    latest_per_key, upsert_with, Statements, LOCK_KEYS_SQL, PARTITIONED_UPSERT_SQL, UPSERT_SQL,
};
use crate::secure::PgTarget;

/// How long opening one Postgres connection may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A pool for `database_url` (a `postgres://` URL or key=value string,
/// TLS settings as libpq reads them: [`PgTarget`]) holding up to `size`
/// connections.
pub fn pool(database_url: &str, size: usize) -> Result<Pool> {
    let mut target = PgTarget::parse(database_url)?;
    let config = target.config_mut();
    config.connect_timeout(CONNECT_TIMEOUT);
    if config.get_application_name().is_none() {
        config.application_name("idem-writer");
    }
    let manager = Manager::from_config(
        target.config().clone(),
        target.tls(),
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(size)
        .runtime(Runtime::Tokio1)
        .create_timeout(Some(CONNECT_TIMEOUT))
        .wait_timeout(Some(CONNECT_TIMEOUT))
        .build()
        .map_err(|e| Error::Config(format!("build the Postgres pool: {e}")))
}

/// A batch that is committed: what to acknowledge, and what Postgres refused.
#[derive(Debug, Default)]
pub struct Stored {
    /// Rows inserted or moved forward.
    pub written: u64,
    /// Every `(key, token)` whose key is now in Postgres at this token or a
    /// newer one.
    pub acks: Vec<(String, i64)>,
    /// Records Postgres refused on their own; left pending in Redis.
    pub refused: Vec<(String, String)>,
}

/// One attempt to commit `records`. An error means nothing can be known to
/// be committed (the batch must be retried as a whole).
pub async fn store_batch(
    pool: &Pool,
    records: &[MirrorRecord],
    timeout: Duration,
    layout: Layout,
) -> Result<Stored> {
    let client = pool.get().await.context("get a Postgres connection")?;
    let result = match upsert_in_time(&client, records, timeout, layout).await {
        Ok(written) => Ok(Stored {
            written,
            acks: all_acks(records, &HashSet::new()),
            refused: Vec::new(),
        }),
        Err(UpsertError::Row(_)) => store_row_by_row(&client, records, timeout, layout).await,
        Err(UpsertError::Other(error)) => Err(error),
    };
    if result.is_err() {
        discard(client);
    }
    result
}

/// Rare path: a row-level error failed the batch; store each row alone to
/// find the refused ones.
async fn store_row_by_row(
    client: &Object,
    records: &[MirrorRecord],
    timeout: Duration,
    layout: Layout,
) -> Result<Stored> {
    let mut stored = Stored::default();
    let mut refused_keys = HashSet::new();
    for row in latest_per_key(records) {
        match upsert_in_time(client, std::slice::from_ref(row), timeout, layout).await {
            Ok(written) => stored.written += written,
            Err(UpsertError::Row(reason)) => {
                refused_keys.insert(row.key.clone());
                stored.refused.push((row.key.clone(), reason));
            }
            Err(UpsertError::Other(error)) => return Err(error),
        }
    }
    stored.acks = all_acks(records, &refused_keys);
    Ok(stored)
}

enum UpsertError {
    /// Postgres refused a row's data (data exception, constraint, limit).
    Row(String),
    Other(Error),
}

async fn upsert_in_time(
    client: &Object,
    records: &[MirrorRecord],
    timeout: Duration,
    layout: Layout,
) -> Result<u64, UpsertError> {
    let attempt = async {
        match layout {
            Layout::Unpartitioned => {
                let statement = client.prepare_cached(UPSERT_SQL).await?;
                upsert_with(client, Statements::Unpartitioned(&statement), records).await
            }
            Layout::Partitioned => {
                let days = records.iter().map(|r| day_of_ms(r.expires_at_ms));
                ensure_days(client, days)
                    .await
                    .map_err(AttemptError::Partitions)?;
                let lock = client.prepare_cached(LOCK_KEYS_SQL).await?;
                let upsert = client.prepare_cached(PARTITIONED_UPSERT_SQL).await?;
                let statements = Statements::Partitioned {
                    lock: &lock,
                    upsert: &upsert,
                };
                upsert_with(client, statements, records).await
            }
        }
        .map_err(AttemptError::from)
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(Err(AttemptError::Partitions(error))) => Err(UpsertError::Other(error)),
        Ok(Err(AttemptError::Postgres(error))) if is_row_level(&error) => {
            Err(UpsertError::Row(error.to_string()))
        }
        Ok(Err(AttemptError::Postgres(error))) => Err(UpsertError::Other(
            error.within("upsert the batch".to_string()),
        )),
        Ok(Ok(written)) => Ok(written),
        Err(_) => Err(UpsertError::Other(Error::postgres_timeout(format!(
            "the upsert took longer than {timeout:?}"
        )))),
    }
}

/// What failed in one attempt at a batch.
enum AttemptError {
    /// Creating the batch's partitions (not a row's fault).
    Partitions(Error),
    Postgres(tokio_postgres::Error),
}

impl From<tokio_postgres::Error> for AttemptError {
    fn from(error: tokio_postgres::Error) -> Self {
        AttemptError::Postgres(error)
    }
}

/// Errors caused by a row's content: classes 22 (data exception), 23
/// (integrity constraint) and 54 (program limit, e.g. index row too large).
fn is_row_level(error: &tokio_postgres::Error) -> bool {
    error.code().is_some_and(|code: &SqlState| {
        let class = &code.code()[..2];
        matches!(class, "22" | "23" | "54")
    })
}

/// Every record of the batch whose key was stored, including older
/// duplicates of a key (Postgres holds a newer version of them).
fn all_acks(records: &[MirrorRecord], refused: &HashSet<String>) -> Vec<(String, i64)> {
    records
        .iter()
        .filter(|r| !refused.contains(&r.key))
        .map(|r| (r.key.clone(), r.token))
        .collect()
}

/// Drops a connection that failed instead of returning it to the pool.
fn discard(client: Object) {
    drop(Object::take(client));
}
