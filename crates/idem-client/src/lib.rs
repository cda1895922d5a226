//! Client for the idem Redis module: the IDEM.* commands over redis-rs
//! (standalone and cluster), request fingerprints (with RFC 8785 JSON
//! canonicalization), read-through from the Postgres mirror, a tower/axum
//! `Idempotency-Key` middleware, and the Postgres fence for handlers whose
//! effects live in Postgres.

mod call;
pub mod canonical_json;
mod client;
mod error;
pub mod fence;
pub mod fingerprint;
pub mod middleware;
mod outcome;
mod read_through;
mod reply;
mod wait_connections;

pub use call::DEFAULT_CALL_TIMEOUT;
pub use client::IdemClient;
pub use error::IdemError;
pub use fence::{Claim, Fence, FenceTransaction, TableLayout};
pub use fingerprint::{Fingerprint, Fingerprinter};
pub use middleware::{Idempotency, IdempotencyLayer};
pub use outcome::{BeginOptions, Origin, Outcome, StoredResponse};
pub use read_through::{MirroredRecord, ReadThrough, DEFAULT_LOOKUP_TIMEOUT};
pub use wait_connections::{DedicatedConnections, WaitConnections, DEFAULT_MAX_IDLE};
