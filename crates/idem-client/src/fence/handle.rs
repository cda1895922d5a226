//! The `Fence` a handler holds, the table layouts it claims on, and the
//! transactions it works in (tokio-postgres' and deadpool's).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio_postgres::types::Type;
use tokio_postgres::Statement;

use super::{sql, Claim, FenceReport};
use crate::fingerprint::{hex_of, stored_digest, stored_hex};
use crate::{IdemError, StoredResponse};

/// How the writer stored `idempotency_keys` (`idem-writer migrate --layout`):
/// the fence's claim differs (docs/fence.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TableLayout {
    /// `PRIMARY KEY (key)`: one statement claims (the default).
    #[default]
    Unpartitioned,
    /// Partitioned by `expires_at`: the per-key lock, then the claim.
    Partitioned,
}

/// The fence of one request: its key, the token Redis gave it, its request
/// fingerprint and the key's time to live. The middleware puts one into the
/// request extensions of every request it runs (`Extension<Fence>` in axum);
/// without the middleware, build it with [`Fence::new`].
#[derive(Clone)]
pub struct Fence {
    key: String,
    token: i64,
    fingerprint: FingerprintBytes,
    ttl: Duration,
    layout: TableLayout,
    report: Option<Arc<Mutex<FenceReport>>>,
}

/// The request fingerprint as the fence was given it. The row keeps the hex
/// of its SHA-256, made only when a claim or a downstream key needs it: most
/// handlers never use the fence they are handed.
#[derive(Clone, Copy)]
enum FingerprintBytes {
    /// The 32 bytes the middleware sends (its `Fingerprint`), as sent.
    Sent([u8; 32]),
    /// The SHA-256 of fingerprint bytes of any other length.
    Digest([u8; 32]),
}

impl FingerprintBytes {
    fn new(fingerprint: &[u8]) -> Self {
        match <[u8; 32]>::try_from(fingerprint) {
            Ok(sent) => FingerprintBytes::Sent(sent),
            Err(_) => FingerprintBytes::Digest(stored_digest(fingerprint)),
        }
    }

    /// Lowercase hex of the SHA-256 of the fingerprint: the row's.
    fn stored_hex(&self) -> String {
        match self {
            FingerprintBytes::Sent(sent) => stored_hex(sent),
            FingerprintBytes::Digest(digest) => hex_of(digest),
        }
    }
}

impl std::fmt::Debug for Fence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fence")
            .field("key", &self.key)
            .field("token", &self.token)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

/// A transaction the fence works in: tokio-postgres' and deadpool's (whose
/// statement cache keeps the fence's statements prepared per connection).
pub trait FenceTransaction<'a>: Send + Sync {
    /// The tokio-postgres transaction the fence's statements run in.
    fn transaction(&self) -> &tokio_postgres::Transaction<'a>;
    /// `sql` prepared, when the transaction's connection caches statements
    /// (deadpool); `None` runs it unprepared (one round trip, planned anew).
    fn cached_statement<'s>(
        &'s self,
        sql: &'static str,
        types: &'static [Type],
    ) -> BoxFuture<'s, Result<Option<Statement>, tokio_postgres::Error>>;
    /// Commits the transaction.
    fn commit(self) -> BoxFuture<'a, Result<(), tokio_postgres::Error>>;
}

impl<'a> FenceTransaction<'a> for tokio_postgres::Transaction<'a> {
    fn transaction(&self) -> &tokio_postgres::Transaction<'a> {
        self
    }
    fn cached_statement<'s>(
        &'s self,
        _sql: &'static str,
        _types: &'static [Type],
    ) -> BoxFuture<'s, Result<Option<Statement>, tokio_postgres::Error>> {
        Box::pin(std::future::ready(Ok(None)))
    }
    fn commit(self) -> BoxFuture<'a, Result<(), tokio_postgres::Error>> {
        Box::pin(tokio_postgres::Transaction::commit(self))
    }
}

impl<'a> FenceTransaction<'a> for deadpool_postgres::Transaction<'a> {
    fn transaction(&self) -> &tokio_postgres::Transaction<'a> {
        self
    }
    fn cached_statement<'s>(
        &'s self,
        sql: &'static str,
        types: &'static [Type],
    ) -> BoxFuture<'s, Result<Option<Statement>, tokio_postgres::Error>> {
        Box::pin(async move { self.prepare_typed_cached(sql, types).await.map(Some) })
    }
    fn commit(self) -> BoxFuture<'a, Result<(), tokio_postgres::Error>> {
        Box::pin(deadpool_postgres::Transaction::commit(self))
    }
}

impl Fence {
    /// A fence for `key` held with `token` (from `IDEM.BEGIN`, or any
    /// strictly growing number per key), `fingerprint` being the bytes sent
    /// to BEGIN (the row keeps their SHA-256, as the module and the writer do).
    ///
    /// # Panics
    /// When `token` is 0 or not below 2^63 (the module's are below 2^53).
    pub fn new(key: impl Into<String>, token: u64, fingerprint: &[u8], ttl: Duration) -> Self {
        let token = i64::try_from(token)
            .ok()
            .filter(|t| *t > 0)
            .expect("a fencing token is positive and below 2^63");
        Fence {
            key: key.into(),
            token,
            fingerprint: FingerprintBytes::new(fingerprint),
            ttl,
            layout: TableLayout::Unpartitioned,
            report: None,
        }
    }

    /// The same fence for a table of `layout`; every fenced participant of
    /// one table must use its layout. The middleware's fences come with the
    /// layer's `table_layout` already.
    pub fn with_layout(mut self, layout: TableLayout) -> Self {
        self.layout = layout;
        self
    }

    /// The fence the middleware attached to a request, if any.
    pub fn from_extensions(extensions: &http::Extensions) -> Option<Fence> {
        extensions.get::<Fence>().cloned()
    }

    #[cfg(feature = "middleware")]
    pub(crate) fn reporting(mut self) -> (Self, Arc<Mutex<FenceReport>>) {
        let report = Arc::new(Mutex::new(FenceReport::Unused));
        self.report = Some(report.clone());
        (self, report)
    }

    /// The Redis key, which is also the row's key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The fencing token the fence claims with.
    pub fn token(&self) -> u64 {
        self.token.unsigned_abs()
    }

    /// A key for a downstream API's own idempotency mechanism (a payment
    /// processor's `Idempotency-Key`): hex SHA-256 over this key and the
    /// request fingerprint. Every attempt at this request uses the same one,
    /// across retries and takeovers (a new holder after a crashed one finds
    /// the processor's first answer instead of charging again); the key
    /// reused for another request after expiry gets another. The token is
    /// deliberately not part of it: see docs/fence.md.
    pub fn downstream_key(&self) -> String {
        let mut framed = Vec::with_capacity(self.key.len() + 72);
        framed.extend_from_slice(&(self.key.len() as u64).to_be_bytes());
        framed.extend_from_slice(self.key.as_bytes());
        framed.extend_from_slice(self.fingerprint.stored_hex().as_bytes());
        stored_hex(&framed)
    }

    /// Claims the key inside `tx` (one round trip when the key is free). Only
    /// on [`Claim::Proceed`] may the transaction go on to its business effect;
    /// on any other answer, roll it back and answer what the claim says.
    /// Needs READ COMMITTED (Postgres' default). Under stricter isolation a
    /// concurrent claim fails with a serialization error instead (the
    /// unpartitioned layout), or every claim is refused with an error (the
    /// partitioned layout, where it could otherwise claim a key twice).
    pub async fn claim<'a, T: FenceTransaction<'a>>(&self, tx: &T) -> Result<Claim, IdemError> {
        let claim = sql::claim(
            tx,
            self.layout,
            &self.key,
            &self.fingerprint.stored_hex(),
            self.token,
            self.ttl.as_secs_f64(),
        )
        .await?;
        self.set_report(match &claim {
            Claim::Proceed => FenceReport::Claimed,
            other => FenceReport::Decided(other.clone()),
        });
        Ok(claim)
    }

    /// Writes the completed response into the claimed row, in `tx`; it
    /// becomes the key's answer when `tx` commits. `Stale` when `tx` holds no
    /// claim with this token: then roll back.
    pub async fn complete<'a, T: FenceTransaction<'a>>(
        &self,
        tx: &T,
        response: &StoredResponse,
    ) -> Result<(), IdemError> {
        sql::complete(tx, &self.key, self.token, response).await
    }

    /// [`Fence::complete`], then commits `tx` and tells the middleware, which
    /// then completes Redis with this response (`MIRRORED`). On an error the
    /// transaction is rolled back, or its fate is unknown (a failed COMMIT):
    /// either way the middleware stores nothing, and a retry's claim finds out.
    pub async fn commit<'a, T: FenceTransaction<'a>>(
        &self,
        tx: T,
        response: &StoredResponse,
    ) -> Result<(), IdemError> {
        self.complete(&tx, response).await?;
        tx.commit().await?;
        self.set_report(FenceReport::Committed(response.clone()));
        Ok(())
    }

    fn set_report(&self, report: FenceReport) {
        if let Some(slot) = &self.report {
            *slot.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = report;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn downstream_key_follows_the_request_not_the_holder() {
        let ttl = Duration::from_secs(60);
        let first = Fence::new("idem:{a:k}", 10, b"fp", ttl);
        let takeover = Fence::new("idem:{a:k}", 20, b"fp", ttl);
        assert_eq!(first.downstream_key(), takeover.downstream_key());
        assert_ne!(
            first.downstream_key(),
            Fence::new("idem:{a:k}", 30, b"other request", ttl).downstream_key()
        );
        assert_ne!(
            first.downstream_key(),
            Fence::new("idem:{b:k}", 10, b"fp", ttl).downstream_key()
        );
        assert_eq!(first.downstream_key().len(), 64);
    }

    #[test]
    fn the_rows_fingerprint_is_the_hex_sha256_of_any_length() {
        let ttl = Duration::from_secs(60);
        for fingerprint in [&[7u8; 32][..], b"fp", &[9u8; 33][..], b""] {
            let fence = Fence::new("k", 1, fingerprint, ttl);
            assert_eq!(fence.fingerprint.stored_hex(), stored_hex(fingerprint));
        }
    }

    #[test]
    #[should_panic(expected = "positive")]
    fn a_zero_token_is_refused() {
        let _ = Fence::new("k", 0, b"fp", Duration::from_secs(1));
    }
}
