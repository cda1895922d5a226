//! The `idem-writer` command: `run` the mirror, `migrate` the schema, or
//! `cleanup` expired rows.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{ArgGroup, Args, Parser, Subcommand};
use idem_core::args::MAX_PULL;
use idem_writer::partitions::DEFAULT_DAYS_AHEAD;
use idem_writer::secure::{self, RedisTls};
use idem_writer::{parse_duration, Backend, Layout, Topology, WriterConfig};
use tokio::signal::unix::{signal, SignalKind};
use tracing_subscriber::EnvFilter;

#[derive(Parser)]
#[command(
    name = "idem-writer",
    version,
    about = "Mirrors completed idem records from Redis into Postgres"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Apply the migrations, then mirror every Redis primary (a fixed list, a
    /// cluster, or a Sentinel-managed primary) until SIGTERM/SIGINT.
    Run(Box<RunArgs>),
    /// Apply the migrations and exit.
    Migrate {
        #[command(flatten)]
        database: DatabaseArgs,
        /// Layout of a fresh idempotency_keys (unpartitioned | partitioned); an existing table of the other layout is refused.
        #[arg(long)]
        layout: Option<Layout>,
    },
    /// Delete expired rows (partitioned layout: drop expired partitions, create partitions ahead): once with --once, else on a schedule.
    Cleanup(CleanupArgs),
    /// Partitioned layout: create the daily partitions ahead of today (idempotent).
    Partitions {
        #[command(subcommand)]
        command: PartitionsCommand,
    },
}

#[derive(Subcommand)]
enum PartitionsCommand {
    /// Create the partitions from yesterday to --days-ahead days after today, and the one for keys without TTL.
    Ensure {
        #[command(flatten)]
        database: DatabaseArgs,
        /// Days of partitions to keep ahead of today (at least the longest TTL).
        #[arg(long, default_value_t = DEFAULT_DAYS_AHEAD)]
        days_ahead: u32,
    },
}

#[derive(Args)]
struct DatabaseArgs {
    /// Postgres URL, e.g. postgres://user@host:5432/db?sslmode=verify-full&sslrootcert=/etc/idem/pg-ca.pem (prefer DATABASE_URL or --database-url-file to keep a password off the command line).
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        required_unless_present = "database_url_file"
    )]
    database_url: Option<String>,
    /// A file holding the Postgres URL (a mounted secret).
    #[arg(long, env = "DATABASE_URL_FILE", conflicts_with = "database_url")]
    database_url_file: Option<PathBuf>,
}

impl DatabaseArgs {
    fn url(&self) -> anyhow::Result<String> {
        Ok(secure::value_or_file(
            self.database_url.clone(),
            self.database_url_file.as_deref(),
            "DATABASE_URL",
        )?
        .unwrap_or_default())
    }
}

/// The CA and client certificate for `rediss://` URLs (default: the
/// platform's trusted roots, `SSL_CERT_FILE` honoured).
#[derive(Args)]
struct RedisTlsArgs {
    /// PEM file of the CA to verify rediss:// servers against (instead of the platform's roots).
    #[arg(long, env = "REDIS_CA_CERT")]
    redis_ca_cert: Option<PathBuf>,
    /// PEM file of the client certificate for rediss:// servers that ask for one.
    #[arg(long, env = "REDIS_CLIENT_CERT", requires = "redis_client_key")]
    redis_client_cert: Option<PathBuf>,
    /// PEM file of the client certificate's key.
    #[arg(long, env = "REDIS_CLIENT_KEY", requires = "redis_client_cert")]
    redis_client_key: Option<PathBuf>,
}

#[derive(Args)]
#[command(group(ArgGroup::new("primaries").required(true).args(["redis_urls", "redis_url_file", "cluster_seeds", "sentinels"])))]
struct RunArgs {
    /// A Redis primary to mirror, for good (repeat for each primary; REDIS_URL may hold a comma-separated list).
    #[arg(
        long = "redis",
        env = "REDIS_URL",
        hide_env_values = true,
        value_delimiter = ','
    )]
    redis_urls: Vec<String>,
    /// A file holding the Redis URLs (comma-separated; a mounted secret).
    #[arg(long, env = "REDIS_URL_FILE", conflicts_with_all = ["redis_urls", "cluster_seeds", "sentinels"])]
    redis_url_file: Option<PathBuf>,
    /// Seed nodes of a Redis Cluster: its primaries are discovered and followed through failovers and reshards.
    #[arg(
        long = "redis-cluster",
        env = "REDIS_CLUSTER_URL",
        hide_env_values = true,
        value_delimiter = ',',
        conflicts_with = "redis_urls"
    )]
    cluster_seeds: Vec<String>,
    /// A Sentinel to ask for the primary of --service-name (repeat or comma-separate several).
    #[arg(
        long = "sentinel",
        env = "REDIS_SENTINEL_URL",
        hide_env_values = true,
        value_delimiter = ',',
        conflicts_with_all = ["redis_urls", "cluster_seeds"],
        requires = "service_name"
    )]
    sentinels: Vec<String>,
    /// The Sentinel service (`sentinel monitor <name> ...`) whose primary is mirrored.
    #[arg(
        long,
        env = "REDIS_SERVICE_NAME",
        conflicts_with_all = ["redis_urls", "cluster_seeds"]
    )]
    service_name: Option<String>,
    /// Scheme, credentials and /db for the Sentinel-named primary; its host:port is replaced (rediss:// for TLS).
    #[arg(
        long,
        env = "REDIS_SERVICE_URL",
        hide_env_values = true,
        default_value = "redis://primary/0",
        requires = "sentinels"
    )]
    service_url: String,
    /// A file holding --service-url (a mounted secret: it carries the primary's password).
    #[arg(long, env = "REDIS_SERVICE_URL_FILE", requires = "sentinels")]
    service_url_file: Option<PathBuf>,
    #[command(flatten)]
    redis_tls: RedisTlsArgs,
    /// How often a cluster's or Sentinel's primaries are discovered again (also soon after a node fails).
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    topology_interval: Duration,
    #[command(flatten)]
    database: DatabaseArgs,
    /// Records per pull and per upsert (1..=10000, the module's MAX_PULL).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=MAX_PULL as i64))]
    batch_size: u32,
    /// How long a pulled record stays claimed by this writer (ms).
    #[arg(long, default_value_t = 30_000)]
    claim_ms: u64,
    /// How long a pull waits when nothing is pending (ms).
    #[arg(long, default_value_t = 1_000)]
    block_ms: u64,
    /// How often expired rows are deleted (e.g. 24h, 30m, 30s).
    #[arg(long, default_value = "24h", value_parser = parse_duration)]
    cleanup_interval: Duration,
    /// Do not run the cleanup job in this process.
    #[arg(long)]
    no_cleanup: bool,
    /// Rows deleted per cleanup transaction.
    #[arg(long, default_value_t = 1000)]
    cleanup_batch_size: u32,
    /// Layout of a fresh idempotency_keys (unpartitioned | partitioned); without it an existing table keeps its own.
    #[arg(long)]
    layout: Option<Layout>,
    /// Partitioned layout: days of partitions each cleanup pass keeps ahead of today.
    #[arg(long, default_value_t = DEFAULT_DAYS_AHEAD)]
    partition_days_ahead: u32,
    /// Serve /metrics and /healthz here (e.g. 127.0.0.1:9187).
    #[arg(long, env = "METRICS_ADDR")]
    metrics_addr: Option<SocketAddr>,
    /// How often INFO idem is read for the pending gauges (e.g. 5s).
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    info_interval: Duration,
    /// After SIGTERM, how long the batch in hand may still be retried.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    shutdown_grace: Duration,
    /// What the nodes run: auto (asked per node), module, or functions (the Functions library, for a Redis that refuses MODULE LOAD).
    #[arg(long, env = "IDEM_BACKEND", default_value = "auto")]
    backend: Backend,
    /// Functions library: how often every slot's outbox is read; slots that had due records are read again at once.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    sweep_interval: Duration,
}

#[derive(Args)]
struct CleanupArgs {
    #[command(flatten)]
    database: DatabaseArgs,
    /// One pass, print the number of rows removed, exit.
    #[arg(long)]
    once: bool,
    /// Rows deleted per transaction.
    #[arg(long, default_value_t = 1000)]
    batch_size: u32,
    /// Schedule without --once.
    #[arg(long, default_value = "24h", value_parser = parse_duration)]
    interval: Duration,
    /// Partitioned layout: days of partitions to keep ahead of today.
    #[arg(long, default_value_t = DEFAULT_DAYS_AHEAD)]
    days_ahead: u32,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = Cli::parse();
    // Installed before any work, so a SIGTERM at any moment takes the
    // graceful path instead of killing the process.
    let shutdown = shutdown_signal()?;
    match cli.command {
        Command::Run(args) => Ok(idem_writer::run(writer_config(*args)?, shutdown).await?),
        Command::Migrate { database, layout } => {
            let mut client = idem_writer::connect(&database.url()?).await?;
            match layout {
                Some(layout) => idem_writer::migrate_with_layout(&mut client, layout).await?,
                None => idem_writer::migrate(&mut client).await?,
            }
            println!("migrations applied");
            Ok(())
        }
        Command::Cleanup(args) if args.once => {
            let cleaned =
                idem_writer::cleanup_once(&args.database.url()?, args.batch_size, args.days_ahead)
                    .await?;
            println!("{cleaned}");
            Ok(())
        }
        Command::Partitions {
            command:
                PartitionsCommand::Ensure {
                    database,
                    days_ahead,
                },
        } => {
            let client = idem_writer::connect(&database.url()?).await?;
            idem_writer::partitions::require_partitioned(&client).await?;
            let created = idem_writer::partitions::ensure_ahead(&client, days_ahead).await?;
            println!("created {} partitions", created.len());
            Ok(())
        }
        Command::Cleanup(args) => cleanup_forever(args, shutdown).await,
    }
}

fn writer_config(args: RunArgs) -> anyhow::Result<WriterConfig> {
    let redis_urls = match &args.redis_url_file {
        Some(file) => secure::read_secret_file(file)?
            .split(',')
            .map(|url| url.trim().to_string())
            .collect(),
        None => args.redis_urls,
    };
    let service_url = match &args.service_url_file {
        Some(file) => secure::read_secret_file(file)?,
        None => args.service_url,
    };
    let mut config = WriterConfig::new(redis_urls, args.database.url()?);
    config.redis_tls = RedisTls {
        ca_cert: args.redis_tls.redis_ca_cert,
        client_cert: args.redis_tls.redis_client_cert,
        client_key: args.redis_tls.redis_client_key,
    };
    if !args.cluster_seeds.is_empty() {
        config.topology = Topology::Cluster(args.cluster_seeds);
    } else if !args.sentinels.is_empty() {
        config.topology = Topology::Sentinel {
            sentinels: args.sentinels,
            service_name: args.service_name.unwrap_or_default(),
            service_url,
        };
    }
    config.topology_interval = args.topology_interval;
    config.batch_size = args.batch_size;
    config.claim = Duration::from_millis(args.claim_ms);
    config.block = Duration::from_millis(args.block_ms);
    config.cleanup_interval = (!args.no_cleanup).then_some(args.cleanup_interval);
    config.cleanup_batch_size = args.cleanup_batch_size;
    config.layout = args.layout;
    config.partition_days_ahead = args.partition_days_ahead;
    config.metrics_addr = args.metrics_addr;
    config.info_interval = args.info_interval;
    config.shutdown_grace = args.shutdown_grace;
    config.backend = args.backend;
    config.sweep_interval = args.sweep_interval;
    Ok(config)
}

/// Resolves on the first SIGTERM or SIGINT.
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()> + Send> {
    let mut terminate = signal(SignalKind::terminate()).context("install the SIGTERM handler")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("install the SIGINT handler")?;
    Ok(async move {
        tokio::select! {
            _ = terminate.recv() => tracing::info!("SIGTERM received"),
            _ = interrupt.recv() => tracing::info!("SIGINT received"),
        }
    })
}

/// `cleanup` without `--once`: a pass every interval until a signal.
async fn cleanup_forever(
    args: CleanupArgs,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    tokio::pin!(shutdown);
    let database_url = args.database.url()?;
    loop {
        let pass = idem_writer::cleanup_once(&database_url, args.batch_size, args.days_ahead);
        match pass.await {
            Ok(cleaned) => tracing::info!("cleanup: {cleaned}"),
            Err(error) => tracing::warn!(
                error = format!("{:#}", anyhow::Error::from(error)),
                "cleanup failed"
            ),
        }
        tokio::select! {
            () = tokio::time::sleep(args.interval) => {}
            () = &mut shutdown => return Ok(()),
        }
    }
}
