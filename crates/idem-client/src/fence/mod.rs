//! The Postgres fence: a key's idempotency row is claimed durably (a short
//! statement of its own, with a lease) before the handler calls anything
//! outside Postgres, and completed in the short transaction that writes the
//! business effect, only while it is still held with the claim's token; so
//! the effect and the authoritative record commit or roll back together,
//! whatever Redis forgets, and no transaction spans a foreign call. See
//! docs/fence.md.
//!
//! Needs the `postgres` feature. With only `middleware`, this module keeps
//! just [`Claim`] and the report the middleware reads, privately: the
//! middleware then never hands out a fence.

// The report is read by the middleware alone.
#![cfg_attr(
    not(all(feature = "postgres", feature = "middleware")),
    allow(dead_code)
)]

#[cfg(feature = "postgres")]
mod handle;
#[cfg(feature = "postgres")]
mod sql;

#[cfg(all(feature = "postgres", feature = "middleware"))]
pub(crate) use handle::release_with;
#[cfg(feature = "postgres")]
pub use handle::{Commit, Fence, FenceClient, FenceTransaction, Hold, TableLayout};
#[cfg(feature = "postgres")]
pub use sql::{
    CLAIM_SQL, COMPLETE_SQL, COMPLETE_WITH_EFFECT_SQL, EFFECT_FIRST_PARAM, NOT_HELD_MESSAGE,
    PARTITIONED_CLAIM_SQL, PARTITIONED_GATE_SQL, RELEASE_SQL, RENEW_SQL, ROW_SQL,
};

use crate::StoredResponse;

/// What a claim found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// This holder holds the key: run the business logic, then `commit` the
    /// effect with the key's response.
    Proceed,
    /// The key was completed: answer this response; change nothing.
    Replay(StoredResponse),
    /// Another holder's claim is live (its lease runs, or its statement or
    /// transaction on the key is open), or a newer token holds the key:
    /// answer 409 and let the client retry. Change nothing.
    InFlight,
    /// The key is held or completed for another request fingerprint: 422.
    Mismatch,
}

/// What the handler did with its fence, as the middleware reads it after the
/// handler returned.
#[derive(Debug, Default)]
pub(crate) enum FenceReport {
    /// The fence was not used: the middleware's ordinary store policy applies.
    #[default]
    Unused,
    /// Claimed durably by the middleware before the handler ran
    /// (`claim_up_front`), and not used by the handler: the middleware
    /// releases the claim, then its ordinary store policy applies. With
    /// when the claim was made.
    ClaimedUpFront(Release, std::time::Instant),
    /// Claimed, but not committed through the fence (rolled back, failed, or
    /// committed by hand): nothing is known to be stored. A durable claim
    /// made through a pool comes with it, for the middleware to release.
    Claimed(Release),
    /// The claim, or a fenced write that found the key lost, found another
    /// answer.
    Decided(Claim),
    /// The transaction committed with this response in the row.
    Committed(StoredResponse),
}

/// A durable claim the middleware may give up when the handler returns
/// without committing: the pool it was made through (none for a claim in
/// the handler's transaction, which its rollback undoes, or one made on a
/// connection the handler owns: that one ends with its lease).
#[derive(Debug, Default)]
pub(crate) struct Release {
    #[cfg(feature = "postgres")]
    pub(crate) pool: Option<deadpool_postgres::Pool>,
}

impl FenceReport {
    /// Gives up the durable claim this report holds, if any (see
    /// [`Release::run`]): for a handler that failed or panicked.
    pub(crate) async fn release_claim(self, key: &str, token: u64) {
        if let FenceReport::Claimed(release) | FenceReport::ClaimedUpFront(release, _) = self {
            release.run(key, token).await;
        }
    }
}

impl Release {
    /// Deletes the claim of `key` with `token`, if this holds a pool; errors
    /// are logged (the claim then ends with its lease).
    pub(crate) async fn run(self, key: &str, token: u64) {
        #[cfg(feature = "postgres")]
        if let Some(pool) = self.pool {
            // Bounded as a read-through lookup is: the response waits on it.
            let released = tokio::time::timeout(
                crate::DEFAULT_LOOKUP_TIMEOUT,
                handle::release_with(&pool, key, token),
            )
            .await;
            match released {
                Ok(Ok(())) => {}
                Ok(Err(err)) => {
                    tracing::warn!(key, error = %err, "could not release the fence's claim; it ends with its lease");
                }
                Err(_) => {
                    tracing::warn!(
                        key,
                        "the fence's claim was not released in time; it ends with its lease"
                    );
                }
            }
        }
        #[cfg(not(feature = "postgres"))]
        let _ = (key, token);
    }
}
