//! `run`: migrations, one mirror per Redis primary (following the
//! topology when it is a cluster or Sentinel-managed), the cleanup schedule
//! and the metrics server, until shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::backoff::sleep_unless;
use crate::backoff::Backoff;
use crate::config::WriterConfig;
use crate::error::{Cause, Context, Error, Result};
use crate::mirror::node::Shutdown;
use crate::mirror::Mirrors;
use crate::ops::metrics::{ErrorKind, Metrics};
use crate::postgres::cleanup::{clean, Cleaned};
use crate::postgres::migrate::migrate_to;
use crate::postgres::partitions::Layout;
use crate::secure::{redact_url, PgTarget};
use crate::topology::Discovery;

/// Longest wait before retrying a failed cleanup run.
const CLEANUP_RETRY: Duration = Duration::from_secs(60);
/// How long opening the migration connection may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Shortest time between two discoveries prompted by node failures.
const REDISCOVERY_GAP: Duration = Duration::from_millis(200);

/// Mirrors every Redis primary into Postgres until `shutdown` completes,
/// then finishes (commits and acknowledges) the batches in hand and returns
/// `Ok`. Applies the migrations first, waiting for Postgres.
pub async fn run(config: WriterConfig, shutdown: impl Future<Output = ()> + Send) -> Result<()> {
    config.validate()?;
    let mut discovery = Discovery::new(&config.topology, &config.redis_tls)?;
    let config = Arc::new(config);
    let metrics = Arc::new(Metrics::new());
    let pool = crate::postgres::pool(&config.database_url, config.topology.postgres_connections())?;
    let shutdown_stages = Shutdown {
        stop: CancellationToken::new(),
        abort: CancellationToken::new(),
    };
    let http = match config.metrics_addr {
        Some(addr) => {
            let (bound, task) =
                crate::ops::http::serve(addr, metrics.clone(), shutdown_stages.stop.clone())
                    .await?;
            info!(%bound, "serving /metrics and /healthz");
            Some(task)
        }
        None => None,
    };

    tokio::pin!(shutdown);
    let layout = tokio::select! {
        migrated = migrate_when_reachable(&config, &metrics) => migrated?,
        () = &mut shutdown => {
            shutdown_stages.stop.cancel();
            return Ok(());
        }
    };
    info!(%layout, "idempotency_keys layout");
    let mut config = Arc::unwrap_or_clone(config);
    config.layout = Some(layout);
    let config = Arc::new(config);

    let suspect_topology = Arc::new(Notify::new());
    let mut tasks = JoinSet::new();
    if let Discovery::Sentinel(sentinel) = &discovery {
        tasks.spawn(sentinel.watch(suspect_topology.clone(), shutdown_stages.stop.clone()));
    }
    if let Some(interval) = config.cleanup_interval {
        tasks.spawn(cleanup_schedule(
            pool.clone(),
            interval,
            config.cleanup_batch_size,
            config.partition_days_ahead,
            metrics.clone(),
            shutdown_stages.stop.clone(),
        ));
    }
    let mut mirrors = Mirrors::new(
        pool,
        config.clone(),
        metrics.clone(),
        shutdown_stages.clone(),
        suspect_topology.clone(),
    );

    let outcome = follow_topology(
        &mut discovery,
        &mut mirrors,
        &config,
        &metrics,
        &suspect_topology,
        &mut tasks,
        &mut shutdown,
    )
    .await;
    shutdown_stages.stop.cancel();
    let abort = shutdown_stages.abort.clone();
    let grace = config.shutdown_grace;
    let abort_timer = tokio::spawn(async move {
        tokio::time::sleep(grace).await;
        abort.cancel();
    });
    mirrors.finish().await;
    while let Some(ended) = tasks.join_next().await {
        if let Err(join_error) = ended {
            error!(%join_error, "a writer task failed");
        }
    }
    abort_timer.abort();
    if let Some(http) = http {
        let _ = http.await;
    }
    info!("stopped");
    outcome
}

/// Discovers the primaries and keeps the mirrors equal to them: again every
/// `topology_interval`, and soon after a node fails (a failover shows first
/// as errors from the old primary). Returns at shutdown (`Ok`) or when a
/// task ends unexpectedly (`Err`).
async fn follow_topology(
    discovery: &mut Discovery,
    mirrors: &mut Mirrors,
    config: &WriterConfig,
    metrics: &Metrics,
    suspect_topology: &Notify,
    tasks: &mut JoinSet<()>,
    shutdown: &mut (impl Future<Output = ()> + Unpin),
) -> Result<()> {
    let follows = discovery.follows();
    let mut retry = Backoff::new(config.retry_initial, config.topology_interval);
    loop {
        let found = tokio::select! {
            found = discovery.primaries() => found,
            () = &mut *shutdown => break,
        };
        let next = match found.and_then(|targets| mirrors.reconcile(targets)) {
            Ok(changed) => {
                retry.reset();
                if changed {
                    metrics.topology_changed();
                }
                follows.then_some(config.topology_interval)
            }
            Err(error) => {
                metrics.error(ErrorKind::Topology);
                warn!(error = error.report(), "discovering the primaries failed");
                Some(retry.next_delay())
            }
        };
        let wait = async {
            match next {
                Some(delay) => tokio::time::sleep(delay).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = wait => {}
            () = suspect_topology.notified(), if follows => {
                tokio::time::sleep(REDISCOVERY_GAP).await;
            }
            () = &mut *shutdown => break,
            error = mirrors.unexpected_end() => return Err(error),
            Some(ended) = tasks.join_next() => {
                return Err(Error::TaskEnded(format!("a writer task ended unexpectedly: {ended:?}")));
            }
        }
    }
    info!("shutting down: finishing the batches in hand");
    Ok(())
}

/// Applies the migrations, waiting (with backoff) while Postgres cannot be
/// reached; a migration that Postgres rejects is an error.
async fn migrate_when_reachable(config: &WriterConfig, metrics: &Metrics) -> Result<Layout> {
    let mut backoff = Backoff::new(config.retry_initial, config.retry_max);
    loop {
        let attempt = async {
            let mut client = connect(&config.database_url).await?;
            migrate_to(&mut client, config.layout).await
        };
        match attempt.await {
            Ok(layout) => {
                metrics.postgres_up.set(1);
                return Ok(layout);
            }
            Err(error) if is_unreachable(&error) => {
                metrics.error(ErrorKind::Postgres);
                warn!(
                    error = error.report(),
                    "Postgres unreachable; retrying the migrations"
                );
                tokio::time::sleep(backoff.next_delay()).await;
            }
            Err(error) => return Err(error),
        }
    }
}

/// Connects a single client (its connection driven on a task) to
/// `database_url`, a `postgres://` URL or key=value string with libpq's TLS
/// settings ([`PgTarget`]). A TLS failure of the configuration's making (a
/// server refusing TLS under `sslmode=require`, a certificate that does not
/// verify) is an [`Error::Config`], as is a bad `sslmode` or certificate
/// file; the error names the server with its password masked.
pub async fn connect(database_url: &str) -> Result<tokio_postgres::Client> {
    let mut target = PgTarget::parse(database_url)?;
    target.config_mut().connect_timeout(CONNECT_TIMEOUT);
    target
        .connect()
        .await
        .map_err(|error| error.within(format!("Postgres at {}", redact_url(database_url))))
}

/// Connection-level failures (no server, connection lost, server starting
/// or shutting down), as opposed to SQL that Postgres rejects.
fn is_unreachable(error: &Error) -> bool {
    match error {
        Error::Postgres {
            source: Some(pg), ..
        } => match pg.code() {
            None => true,
            Some(code) => code.code().starts_with("08") || code.code().starts_with("57P"),
        },
        _ => false,
    }
}

/// Deletes expired rows now and then every `interval` until `stop`.
async fn cleanup_schedule(
    pool: Pool,
    interval: Duration,
    batch_size: u32,
    days_ahead: u32,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
) {
    loop {
        let run = async {
            let client = pool.get().await.context("get a Postgres connection")?;
            clean(&client, batch_size, days_ahead).await
        };
        let delay = tokio::select! {
            result = run => match result {
                Ok(cleaned) => {
                    metrics.cleanup_rows_removed.inc_by(cleaned.rows_deleted);
                    metrics.cleanup_runs.inc();
                    info!(
                        dropped = ?cleaned.partitions_dropped,
                        created = ?cleaned.partitions_created,
                        "cleanup: {cleaned}"
                    );
                    interval
                }
                Err(error) => {
                    metrics.error(ErrorKind::Cleanup);
                    warn!(error = error.report(), "cleanup failed");
                    interval.min(CLEANUP_RETRY)
                }
            },
            () = stop.cancelled() => return,
        };
        if !sleep_unless(&stop, delay).await {
            return;
        }
    }
}

/// One cleanup pass against `database_url` (for `idem-writer cleanup
/// --once`): expired rows deleted, or on the partitioned layout expired
/// partitions dropped and `days_ahead` days of partitions created.
pub async fn cleanup_once(database_url: &str, batch_size: u32, days_ahead: u32) -> Result<Cleaned> {
    let client = connect(database_url).await?;
    clean(&client, batch_size, days_ahead).await
}
