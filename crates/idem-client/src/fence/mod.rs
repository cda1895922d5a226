//! The Postgres fence: the idempotency row of a key is claimed inside the
//! handler's own transaction and holds the completed response by commit time,
//! so the business effect and the authoritative record commit or roll back
//! together, whatever Redis forgets. See docs/fence.md.
//!
//! Needs the `postgres` feature. With only `middleware`, this module keeps
//! just [`Claim`] and the report the middleware reads, privately: the
//! middleware then never hands out a fence.

#![cfg_attr(not(feature = "postgres"), allow(dead_code))]

#[cfg(feature = "postgres")]
mod handle;
#[cfg(feature = "postgres")]
mod sql;

#[cfg(feature = "postgres")]
pub use handle::{Fence, FenceTransaction, TableLayout};
#[cfg(feature = "postgres")]
pub use sql::{CLAIM_SQL, COMPLETE_SQL, PARTITIONED_CLAIM_SQL, PARTITIONED_GATE_SQL, ROW_SQL};

use crate::StoredResponse;

/// What a claim found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// This transaction holds the key: run the business logic, then
    /// `complete` (or `commit`) in the same transaction.
    Proceed,
    /// The key was completed: answer this response; change nothing.
    Replay(StoredResponse),
    /// Another holder's transaction is still open, or a newer token holds
    /// the key: answer 409 and let the client retry. Change nothing.
    InFlight,
    /// The key is held or completed for another request fingerprint: 422.
    Mismatch,
}

/// What the handler did with its fence, as the middleware reads it after the
/// handler returned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) enum FenceReport {
    /// The fence was not used: the middleware's ordinary store policy applies.
    #[default]
    Unused,
    /// Claimed, but not committed through the fence (rolled back, failed, or
    /// committed by hand): nothing is known to be stored.
    Claimed,
    /// The claim found another answer.
    Decided(Claim),
    /// The transaction committed with this response in the row.
    Committed(StoredResponse),
}
