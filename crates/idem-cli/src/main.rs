//! `idem`, the operator's CLI: a key's Redis record and Postgres row side by
//! side, the safe release of a key stuck in flight, the mirror's backlog per
//! node, one cleanup pass, and re-mirroring the completions Redis still
//! holds after Postgres lost rows. docs/operations/cli.md describes each
//! command, its output and its exit codes ([`exit::Code`]).

mod cleanup;
mod exit;
mod functions;
mod inspect;
mod output;
mod pending;
mod postgres;
mod redis_side;
mod release;
mod remirror;
mod scan;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use crate::exit::Failure;

#[derive(Parser)]
#[command(
    name = "idem",
    version,
    about = "Operate idem: inspect, release, pending, cleanup, remirror, functions"
)]
struct Cli {
    /// Print JSON instead of text (one document on stdout, also for errors).
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// A key's Redis record and Postgres row side by side.
    ///
    /// Says whether they agree (the verdict and exit code: 0 consistent,
    /// 4 found nowhere, 5 they disagree).
    Inspect {
        #[command(flatten)]
        key: KeyArgs,
        #[command(flatten)]
        redis: RedisNode,
        #[command(flatten)]
        postgres: OptionalPostgres,
    },
    /// Releases a key stuck in flight, only with its current token.
    ///
    /// Only an `in_progress` record held with TOKEN is released, in Redis
    /// (IDEM.ABORT) and its Postgres durable claim (the fence's release).
    /// Anything else is refused (exit 3) and nothing changes.
    Release {
        #[command(flatten)]
        key: KeyArgs,
        /// The token the stuck holder holds the key with (`idem inspect`
        /// shows it).
        #[arg(long)]
        token: u64,
        #[command(flatten)]
        redis: RedisNode,
        #[command(flatten)]
        postgres: OptionalPostgres,
    },
    /// What each node holds for the mirror, and how old the oldest is.
    Pending {
        #[command(flatten)]
        redis: RedisNodes,
        /// Also list up to this many pending keys per node, oldest first
        /// (scans the node's keys).
        #[arg(long, value_name = "N")]
        keys: Option<usize>,
        /// Which keys `--keys` scans (a SCAN MATCH pattern).
        #[arg(long = "match", value_name = "PATTERN", default_value = "*")]
        pattern: String,
    },
    /// One pass of the writer's cleanup.
    ///
    /// Expired rows deleted, or on the partitioned layout expired
    /// partitions dropped and partitions created ahead.
    Cleanup {
        #[command(flatten)]
        postgres: Postgres,
        /// Rows per DELETE (unpartitioned layout); the writer's default.
        #[arg(long)]
        batch_size: Option<u32>,
        /// Days of partitions created ahead (partitioned layout); the
        /// writer's default.
        #[arg(long)]
        days_ahead: Option<u32>,
    },
    /// Re-writes into Postgres what Redis completed since TIME.
    ///
    /// For a Postgres failover that lost rows the writer had written: the
    /// completed records Redis still holds, completed at or after TIME, go
    /// through the writer's upsert, so a row with a larger token, a fenced
    /// completion or a live durable claim is left as it is, and a second
    /// run changes nothing (exit 6 when some records could not be written).
    Remirror {
        /// Completion time to start from: RFC 3339 (`2026-12-04T12:00:00Z`)
        /// or Unix milliseconds.
        #[arg(long, value_name = "TIME")]
        since: String,
        #[command(flatten)]
        redis: RedisNodes,
        #[command(flatten)]
        postgres: Postgres,
        /// Which keys to scan (a SCAN MATCH pattern).
        #[arg(long = "match", value_name = "PATTERN", default_value = "*")]
        pattern: String,
        /// Report what would be written, write nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// The Functions library, for a Redis that refuses MODULE LOAD.
    Functions {
        #[command(subcommand)]
        command: FunctionsCommand,
    },
}

#[derive(Subcommand)]
enum FunctionsCommand {
    /// Loads (FUNCTION LOAD REPLACE) the library on every node; prints
    /// the version each now runs.
    Load {
        #[command(flatten)]
        redis: RedisNodes,
        /// The library's source.
        #[arg(long, value_name = "PATH", default_value = "functions/idem.lua")]
        file: std::path::PathBuf,
    },
    /// What each node runs: the module, the library (its version), or
    /// neither.
    Status {
        #[command(flatten)]
        redis: RedisNodes,
    },
}

/// How a key is named.
#[derive(Args)]
struct KeyArgs {
    /// The `Idempotency-Key` value as the client sent it (or, with `--raw`,
    /// the Redis key itself).
    key: String,
    /// The tenant the key was sent under (the middleware's tenant header);
    /// none is the anonymous scope.
    #[arg(long, conflicts_with = "raw")]
    tenant: Option<String>,
    /// The Redis key prefix the middleware was configured with (default:
    /// the middleware's, from spec/http.json).
    #[arg(long, conflicts_with = "raw")]
    prefix: Option<String>,
    /// KEY is the whole Redis key (as logs and Postgres rows name it).
    #[arg(long)]
    raw: bool,
}

impl KeyArgs {
    /// The Redis key (also the Postgres row's `key`).
    fn redis_key(&self) -> String {
        if self.raw {
            return self.key.clone();
        }
        let prefix = self.prefix.clone().unwrap_or_else(default_prefix);
        idem_client::middleware::redis_key(&prefix, self.tenant.as_deref().unwrap_or(""), &self.key)
    }
}

/// The middleware's default key prefix, from the spec every client reads.
fn default_prefix() -> String {
    let http: serde_json::Value =
        serde_json::from_str(include_str!("../../../spec/http.json")).expect("spec/http.json");
    http["defaults"]["key_prefix"]
        .as_str()
        .expect("spec/http.json defaults.key_prefix")
        .to_string()
}

/// One Redis node (the one holding the key).
#[derive(Args)]
struct RedisNode {
    /// The Redis primary holding the key (REDIS_URL or --redis-url-file keep
    /// a password off the command line).
    #[arg(
        id = "redis_url",
        long = "redis",
        env = "REDIS_URL",
        hide_env_values = true,
        value_name = "URL",
        required_unless_present = "redis_url_file"
    )]
    url: Option<String>,
    /// A file holding the Redis URL (a mounted secret).
    #[arg(
        long,
        env = "REDIS_URL_FILE",
        value_name = "FILE",
        conflicts_with = "redis_url"
    )]
    redis_url_file: Option<PathBuf>,
}

impl RedisNode {
    fn url(&self) -> Result<String, Failure> {
        secret(
            self.url.clone(),
            self.redis_url_file.as_deref(),
            "REDIS_URL",
        )
    }
}

/// One or more Redis primaries.
#[derive(Args)]
struct RedisNodes {
    /// A Redis primary; repeat the flag (or separate with commas) for
    /// every primary of a deployment.
    #[arg(
        id = "redis_urls",
        long = "redis",
        env = "REDIS_URL",
        hide_env_values = true,
        value_name = "URL",
        value_delimiter = ',',
        required_unless_present = "redis_url_file"
    )]
    urls: Vec<String>,
    /// A file holding the Redis URLs, comma-separated (a mounted secret).
    #[arg(
        long,
        env = "REDIS_URL_FILE",
        value_name = "FILE",
        conflicts_with = "redis_urls"
    )]
    redis_url_file: Option<PathBuf>,
}

impl RedisNodes {
    fn urls(&self) -> Result<Vec<String>, Failure> {
        match &self.redis_url_file {
            Some(_) => Ok(secret(None, self.redis_url_file.as_deref(), "REDIS_URL")?
                .split(',')
                .map(|url| url.trim().to_string())
                .collect()),
            None => Ok(self.urls.clone()),
        }
    }
}

#[derive(Args)]
struct Postgres {
    /// The Postgres database holding `idempotency_keys` (libpq's sslmode,
    /// sslrootcert, sslcert, sslkey apply).
    #[arg(
        id = "database_url",
        long = "database",
        env = "DATABASE_URL",
        hide_env_values = true,
        value_name = "URL",
        required_unless_present = "database_url_file"
    )]
    url: Option<String>,
    /// A file holding the Postgres URL (a mounted secret).
    #[arg(
        long,
        env = "DATABASE_URL_FILE",
        value_name = "FILE",
        conflicts_with = "database_url"
    )]
    database_url_file: Option<PathBuf>,
}

impl Postgres {
    fn url(&self) -> Result<String, Failure> {
        secret(
            self.url.clone(),
            self.database_url_file.as_deref(),
            "DATABASE_URL",
        )
    }
}

#[derive(Args)]
struct OptionalPostgres {
    /// The Postgres database holding `idempotency_keys` (libpq's sslmode,
    /// sslrootcert, sslcert, sslkey apply).
    #[arg(
        id = "database_url",
        long = "database",
        env = "DATABASE_URL",
        hide_env_values = true,
        value_name = "URL",
        required_unless_present_any = ["redis_only", "database_url_file"]
    )]
    url: Option<String>,
    /// A file holding the Postgres URL (a mounted secret).
    #[arg(
        long,
        env = "DATABASE_URL_FILE",
        value_name = "FILE",
        conflicts_with = "database_url"
    )]
    database_url_file: Option<PathBuf>,
    /// Look at Redis only (a deployment without the Postgres mirror).
    #[arg(long, conflicts_with_all = ["database_url", "database_url_file"])]
    redis_only: bool,
}

impl OptionalPostgres {
    fn url(&self) -> Result<Option<String>, Failure> {
        if self.redis_only {
            return Ok(None);
        }
        secret(
            self.url.clone(),
            self.database_url_file.as_deref(),
            "DATABASE_URL",
        )
        .map(Some)
    }
}

/// A URL given directly or in a file (`secure::value_or_file`).
fn secret(
    value: Option<String>,
    file: Option<&std::path::Path>,
    name: &str,
) -> Result<String, Failure> {
    match idem_writer::secure::value_or_file(value, file, name) {
        Ok(Some(value)) => Ok(value),
        Ok(None) => Err(Failure::Usage(format!("{name} is not given"))),
        Err(error) => Err(Failure::Usage(error.to_string())),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => return exit::report(cli.json, Failure::from(anyhow::Error::from(error))),
    };
    let json = cli.json;
    match runtime.block_on(run(cli)) {
        Ok(outcome) => outcome.finish(json),
        Err(failure) => exit::report(json, failure),
    }
}

async fn run(cli: Cli) -> Result<output::Outcome, Failure> {
    match cli.command {
        Command::Inspect {
            key,
            redis,
            postgres,
        } => inspect::run(&key.redis_key(), &redis.url()?, postgres.url()?.as_deref()).await,
        Command::Release {
            key,
            token,
            redis,
            postgres,
        } => {
            let (redis, postgres) = (redis.url()?, postgres.url()?);
            release::run(&key.redis_key(), token, &redis, postgres.as_deref()).await
        }
        Command::Pending {
            redis,
            keys,
            pattern,
        } => pending::run(&redis.urls()?, keys, &pattern).await,
        Command::Cleanup {
            postgres,
            batch_size,
            days_ahead,
        } => cleanup::run(&postgres.url()?, batch_size, days_ahead).await,
        Command::Remirror {
            since,
            redis,
            postgres,
            pattern,
            dry_run,
        } => {
            let since = output::parse_time(&since).map_err(Failure::Usage)?;
            remirror::run(since, &redis.urls()?, &postgres.url()?, &pattern, dry_run).await
        }
        Command::Functions {
            command: FunctionsCommand::Load { redis, file },
        } => functions::load(&redis.urls, &file).await,
        Command::Functions {
            command: FunctionsCommand::Status { redis },
        } => functions::status(&redis.urls).await,
    }
}
