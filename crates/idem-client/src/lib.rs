//! Client for the idem Redis module: the IDEM.* commands over idem's lean
//! multiplexed connection ([`Pipe`]), redis-rs (standalone and cluster) or
//! an in-memory store, request fingerprints (with RFC 8785 JSON
//! canonicalization), read-through from the Postgres mirror, a tower/axum `Idempotency-Key` middleware, and the Postgres fence
//! for handlers whose effects live in Postgres.
//!
//! Cargo features, both on by default: `middleware` (the tower layer:
//! [`IdempotencyLayer`]) and `postgres` ([`ReadThrough`] and the [`Fence`]).
//! The middleware hands handlers a `Fence` and takes `read_through` only when
//! `postgres` is on too. Without either, the crate is the client,
//! fingerprints and [`MemoryStore`], and compiles neither tower nor
//! tokio-postgres.
//!
//! Start at [`IdemClient`] (begin and complete a key), [`Fingerprinter`]
//! (what makes two requests the same), and [`IdempotencyLayer`] (the HTTP
//! middleware); [`MemoryStore`] runs all of them without Redis.

#![warn(missing_docs)]

mod backend;
mod call;
pub mod canonical_json;
mod client;
mod error;
#[cfg(feature = "postgres")]
pub mod fence;
#[cfg(all(feature = "middleware", not(feature = "postgres")))]
mod fence;
pub mod fingerprint;
pub mod memory;
#[cfg(feature = "middleware")]
pub mod middleware;
mod outcome;
mod pipe;
#[cfg(feature = "postgres")]
mod read_through;
mod reply;
mod standalone;
mod wait_connections;

pub use backend::{script_sha, script_source, Backend, LIBRARY_SOURCE};
pub use call::DEFAULT_CALL_TIMEOUT;
pub use client::IdemClient;
pub use error::IdemError;
#[cfg(feature = "postgres")]
pub use fence::{Claim, Commit, Fence, FenceClient, FenceTransaction, Hold, TableLayout};
pub use fingerprint::{Fingerprint, Fingerprinter};
pub use memory::MemoryStore;
#[cfg(feature = "middleware")]
pub use middleware::{Idempotency, IdempotencyLayer};
pub use outcome::{BeginOptions, Origin, Outcome, StoredResponse};
pub use pipe::Pipe;
#[cfg(feature = "postgres")]
pub use read_through::{MirroredRecord, ReadThrough, DEFAULT_LOOKUP_TIMEOUT};
pub use standalone::{StandaloneConnection, Transport};
pub use wait_connections::{DedicatedConnections, WaitConnections, DEFAULT_MAX_IDLE};
