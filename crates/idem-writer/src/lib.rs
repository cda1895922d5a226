//! The idem mirror writer: moves every completed record from the Redis
//! module's pending index into the Postgres `idempotency_keys` table
//! (pull → one upsert per batch → commit → acknowledge), and deletes expired
//! rows on a schedule.

mod backoff;
pub mod cleanup;
mod config;
pub mod duration;
mod http;
pub mod metrics;
mod migrate;
mod node;
mod postgres;
pub mod record;
mod redis_node;
pub mod store;
mod writer;

pub use config::WriterConfig;
pub use migrate::migrate;
pub use record::MirrorRecord;
pub use writer::{cleanup_once, connect, run};
