//! The idem mirror writer: moves every completed record from the Redis
//! module's pending index into the Postgres `idempotency_keys` table
//! (pull → one upsert per batch → commit → acknowledge), and deletes expired
//! rows on a schedule. The primaries are a fixed list, or followed through
//! failovers and reshards of a Redis Cluster or a Sentinel-managed primary.

mod backoff;
pub mod cleanup;
mod cluster;
mod config;
pub mod duration;
mod http;
pub mod metrics;
mod migrate;
mod mirrors;
mod node;
pub mod partitions;
mod postgres;
pub mod record;
mod redis_node;
mod sentinel;
pub mod store;
mod target;
mod topology;
mod writer;

pub use config::WriterConfig;
pub use migrate::{migrate, migrate_with_layout};
pub use partitions::Layout;
pub use record::MirrorRecord;
pub use topology::Topology;
pub use writer::{cleanup_once, connect, run};
