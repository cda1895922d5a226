//! The idem mirror writer: moves every completed record from the Redis
//! module's pending index into the Postgres `idempotency_keys` table
//! (pull → one upsert per batch → commit → acknowledge), and deletes expired
//! rows on a schedule. The primaries are a fixed list, or followed through
//! failovers and reshards of a Redis Cluster or a Sentinel-managed primary.
//!
//! What a program embedding the writer uses:
//! - [`run`] with a [`WriterConfig`] (built by [`WriterConfig::new`], its
//!   public fields, [`Topology`], [`Layout`], [`parse_duration`]): the mirror
//!   until shutdown;
//! - [`connect`], then [`migrate`] or [`migrate_with_layout`]: the schema
//!   alone;
//! - [`cleanup_once`] (or [`cleanup::clean`] on a client of one's own): one
//!   cleanup pass, answering what it did ([`Cleaned`]);
//! - [`partitions`]: the partitioned layout's daily partitions;
//! - [`secure`]: connecting over TLS ([`secure::PgTarget`] for Postgres
//!   with libpq's `sslmode`, [`secure::RedisTls`] for `rediss://`) and
//!   URLs fit to print ([`secure::redact_url`]), shared by the CLI and the
//!   example API;
//! - [`store`]: the statements the writer writes rows with, for programs
//!   that must agree with them (the client's fence is tested against them)
//!   or seed the table the way the writer does, with [`MirrorRecord`]s.
//!
//! Every function fails with [`Error`].
//!
//! ```no_run
//! use std::time::Duration;
//!
//! # async fn example() -> idem_writer::Result<()> {
//! let mut config = idem_writer::WriterConfig::new(
//!     vec!["redis://127.0.0.1:6379/0".to_string()],
//!     "postgres://postgres@127.0.0.1/idem",
//! );
//! config.batch_size = 500;
//! config.cleanup_interval = Some(idem_writer::parse_duration("6h").expect("a duration"));
//! config.shutdown_grace = Duration::from_secs(5);
//! // Mirrors until Ctrl-C, then finishes the batches in hand.
//! idem_writer::run(config, async {
//!     let _ = tokio::signal::ctrl_c().await;
//! })
//! .await
//! # }
//! ```
#![warn(missing_docs)]

mod backoff;
mod config;
mod duration;
mod error;
mod mirror;
mod ops;
mod postgres;
pub mod secure;
mod topology;
mod writer;

pub use postgres::{cleanup, partitions, store};

pub use cleanup::Cleaned;
pub use config::{Backend, WriterConfig};
pub use duration::parse_duration;
pub use error::{Error, Result};
pub use mirror::record::{MirrorRecord, NEVER_EXPIRES_MS};
pub use partitions::Layout;
pub use postgres::migrate::{migrate, migrate_with_layout};
pub use topology::Topology;
pub use writer::{cleanup_once, connect, run};
