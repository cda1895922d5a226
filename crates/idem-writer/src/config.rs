//! The writer's settings, with defaults suited to production.

use std::net::SocketAddr;
use std::time::Duration;

use idem_core::args::MAX_PULL;

use crate::error::{ensure_config, Result};
use crate::postgres::partitions::{Layout, DEFAULT_DAYS_AHEAD};
use crate::secure::RedisTls;
use crate::topology::Topology;

/// Everything `run` needs. Build with [`WriterConfig::new`] and adjust the
/// public fields.
#[derive(Debug, Clone)]
pub struct WriterConfig {
    /// The primaries to mirror: a fixed list (the database number in a URL
    /// selects the database the pull serves), a cluster, or a Sentinel-managed
    /// primary.
    pub topology: Topology,
    /// The CA and client certificate for `rediss://` primaries, cluster
    /// nodes and Sentinels (default: the platform's trusted roots, no
    /// client certificate).
    pub redis_tls: RedisTls,
    /// How often the primaries of a cluster or Sentinel are discovered again
    /// (also soon after any node failure).
    pub topology_interval: Duration,
    /// The Postgres database holding `idempotency_keys` (a `postgres://`
    /// URL or a `key=value` connection string, with libpq's `sslmode`,
    /// `sslrootcert`, `sslcert` and `sslkey`: [`crate::secure::PgTarget`]).
    pub database_url: String,
    /// Records per `IDEM.MIRROR.PULL` (1..=`MAX_PULL`), hence per upsert.
    pub batch_size: u32,
    /// How long a pulled record stays claimed by this writer.
    pub claim: Duration,
    /// How long a pull waits when nothing is pending.
    pub block: Duration,
    /// How often expired rows are deleted; `None` disables the job.
    pub cleanup_interval: Option<Duration>,
    /// Rows deleted per cleanup transaction.
    pub cleanup_batch_size: u32,
    /// The layout asked for: a fresh database is migrated to it, an existing
    /// table of the other layout is refused. `None` keeps the existing table's
    /// layout (a fresh database gets the unpartitioned one). `run` sets it to
    /// the table's layout once migrated.
    pub layout: Option<Layout>,
    /// Partitioned layout: days of partitions each cleanup pass keeps ahead.
    pub partition_days_ahead: u32,
    /// Where `/metrics` and `/healthz` are served; `None` serves nothing.
    pub metrics_addr: Option<SocketAddr>,
    /// How often `INFO idem` is read from each node for the pending gauges.
    pub info_interval: Duration,
    /// First delay between retries against a failing server (growing up
    /// to `retry_max`).
    pub retry_initial: Duration,
    /// Largest delay between retries against a failing server.
    pub retry_max: Duration,
    /// Longest wait for one Postgres upsert before the connection is dropped
    /// and the batch retried.
    pub statement_timeout: Duration,
    /// After shutdown is requested, how long the batch in hand may still be
    /// retried (commit and acknowledge) before the writer gives up on it;
    /// given-up records stay pending in Redis and are mirrored later.
    pub shutdown_grace: Duration,
    /// What each node runs: detected per node (`Auto`), or forced.
    pub backend: Backend,
    /// Functions library: how often every slot a node serves is read for
    /// due outbox members; slots that had some are read again at once.
    pub sweep_interval: Duration,
}

/// How a node keeps its records: the module (`IDEM.MIRROR.PULL`), or the
/// Functions library (`functions/idem.lua`, a per-slot outbox).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// Asks each node: the module when `IDEM.MIRROR.PULL` exists, else the
    /// library when `idem_version` answers.
    #[default]
    Auto,
    /// Every node runs the module.
    Module,
    /// Every node runs the Functions library.
    Functions,
}

impl std::str::FromStr for Backend {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Backend::Auto),
            "module" => Ok(Backend::Module),
            "functions" => Ok(Backend::Functions),
            other => Err(format!(
                "unknown backend {other:?} (auto | module | functions)"
            )),
        }
    }
}

impl WriterConfig {
    /// Mirrors the fixed list of primaries `redis_urls`; set `topology` to
    /// follow a cluster or Sentinel instead.
    pub fn new(redis_urls: Vec<String>, database_url: impl Into<String>) -> Self {
        WriterConfig {
            topology: Topology::Static(redis_urls),
            redis_tls: RedisTls::default(),
            topology_interval: Duration::from_secs(5),
            database_url: database_url.into(),
            batch_size: 1000,
            claim: Duration::from_secs(30),
            block: Duration::from_secs(1),
            cleanup_interval: Some(Duration::from_secs(24 * 60 * 60)),
            cleanup_batch_size: 1000,
            layout: None,
            partition_days_ahead: DEFAULT_DAYS_AHEAD,
            metrics_addr: None,
            info_interval: Duration::from_secs(5),
            retry_initial: Duration::from_millis(50),
            retry_max: Duration::from_secs(5),
            statement_timeout: Duration::from_secs(30),
            shutdown_grace: Duration::from_secs(10),
            backend: Backend::Auto,
            sweep_interval: Duration::from_secs(1),
        }
    }

    /// Rejects settings the module or the loop cannot work with.
    pub fn validate(&self) -> Result<()> {
        ensure_config(
            !self.topology_interval.is_zero(),
            "the topology interval must be positive",
        )?;
        ensure_config(
            (1..=MAX_PULL).contains(&(self.batch_size as usize)),
            format!("batch size must be 1..={MAX_PULL}"),
        )?;
        ensure_config(!self.claim.is_zero(), "the claim must be positive")?;
        ensure_config(
            self.block < self.claim,
            "the pull's block time must be shorter than the claim",
        )?;
        ensure_config(
            !self.sweep_interval.is_zero(),
            "the sweep interval must be positive",
        )?;
        ensure_config(
            self.cleanup_batch_size > 0,
            "cleanup batch size must be positive",
        )?;
        ensure_config(
            !self.retry_initial.is_zero() && self.retry_initial <= self.retry_max,
            "retry delays must satisfy 0 < initial <= max",
        )?;
        Ok(())
    }
}
