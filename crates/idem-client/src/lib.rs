//! Client for the idem Redis module: the IDEM.* commands over redis-rs
//! (standalone and cluster) or an in-memory store, request fingerprints
//! (with RFC 8785 JSON canonicalization), read-through from the Postgres
//! mirror, a tower/axum `Idempotency-Key` middleware, and the Postgres fence
//! for handlers whose effects live in Postgres.
//!
//! Cargo features, both on by default: `middleware` (the tower layer:
//! [`IdempotencyLayer`]) and `postgres` ([`ReadThrough`] and the [`Fence`]).
//! The middleware hands handlers a `Fence` and takes `read_through` only when
//! `postgres` is on too. Without either, the crate is the client,
//! fingerprints and [`MemoryStore`], and compiles neither tower nor
//! tokio-postgres.
//!
//! ```
//! use std::time::Duration;
//! use idem_client::{BeginOptions, IdemClient, MemoryStore, Origin, Outcome, StoredResponse};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), idem_client::IdemError> {
//! // `IdemClient::standalone(redis::Client::open(url)?)` for a real server.
//! let client = IdemClient::memory(MemoryStore::new());
//! let options = BeginOptions::new(Duration::from_secs(3600));
//! let Outcome::New { token } = client.begin("idem:{order-1}", b"request", options).await? else {
//!     unreachable!("a fresh key is new");
//! };
//! let response = StoredResponse::new(201, "created");
//! client.complete("idem:{order-1}", token, &response, Origin::Handler).await?;
//! // The same request again gets the stored response.
//! let again = client.begin("idem:{order-1}", b"request", options).await?;
//! assert_eq!(again, Outcome::Replay(response));
//! // Another request under the same key is a mismatch.
//! let other = client.begin("idem:{order-1}", b"other", options).await?;
//! assert_eq!(other, Outcome::Mismatch);
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

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
#[cfg(feature = "postgres")]
mod read_through;
mod reply;
mod wait_connections;

pub use call::DEFAULT_CALL_TIMEOUT;
pub use client::IdemClient;
pub use error::IdemError;
#[cfg(feature = "postgres")]
pub use fence::{Claim, Fence, FenceTransaction, TableLayout};
pub use fingerprint::{Fingerprint, Fingerprinter};
pub use memory::MemoryStore;
#[cfg(feature = "middleware")]
pub use middleware::{Idempotency, IdempotencyLayer};
pub use outcome::{BeginOptions, Origin, Outcome, StoredResponse};
#[cfg(feature = "postgres")]
pub use read_through::{MirroredRecord, ReadThrough, DEFAULT_LOOKUP_TIMEOUT};
pub use wait_connections::{DedicatedConnections, WaitConnections, DEFAULT_MAX_IDLE};
