//! The `Fence` a handler holds, the table layouts it claims on, the
//! connections its durable claims run on and the transactions it completes
//! in (tokio-postgres' and deadpool's).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Statement;

use super::sql::{self, ClaimArgs, Guard, Written};
use super::{Claim, FenceReport, Release};
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
    lease: Duration,
    idle_timeout: Option<Duration>,
    layout: TableLayout,
    report: Option<Arc<Mutex<FenceReport>>>,
}

/// What [`Fence::commit`] (or [`Fence::complete`]) found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Commit {
    /// The key's row holds the response: committed (by `commit`), or to
    /// commit with the transaction (by `complete`).
    Committed,
    /// This holder lost the key before it committed (its lease lapsed and a
    /// retry took it over, or the row was released): nothing was committed
    /// (`commit` rolled back; after `complete`, roll back). Answer what the
    /// key holds: `Replay` (another holder's response), `InFlight` or
    /// `Mismatch`.
    Lost(Claim),
}

/// What [`Fence::hold`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Hold {
    /// Still held with this token, the lease renewed; nobody can take the
    /// key over before the transaction ends.
    Held,
    /// Lost, as in [`Commit::Lost`]: roll back and answer this.
    Lost(Claim),
}

/// A connection a durable claim ([`Fence::claim`]) or a release runs on,
/// outside the caller's transactions: a deadpool pool (a connection is
/// taken for the call only), a pooled connection, or a tokio-postgres client.
/// Made with `From`: `fence.claim(&pool)`, `fence.claim(&mut client)`.
pub enum FenceClient<'c> {
    /// A connection from the pool for the call's length. Behind the
    /// middleware, a claim through a pool is released by the middleware
    /// when the handler returns without committing.
    Pool(&'c deadpool_postgres::Pool),
    /// A pooled connection (its statement cache keeps the fence's prepared).
    Pooled(&'c mut deadpool_postgres::Object),
    /// A tokio-postgres connection.
    Plain(&'c mut tokio_postgres::Client),
}

impl<'c> From<&'c deadpool_postgres::Pool> for FenceClient<'c> {
    fn from(pool: &'c deadpool_postgres::Pool) -> Self {
        FenceClient::Pool(pool)
    }
}

impl<'c> From<&'c mut deadpool_postgres::Object> for FenceClient<'c> {
    fn from(client: &'c mut deadpool_postgres::Object) -> Self {
        FenceClient::Pooled(client)
    }
}

impl<'c> From<&'c mut tokio_postgres::Client> for FenceClient<'c> {
    fn from(client: &'c mut tokio_postgres::Client) -> Self {
        FenceClient::Plain(client)
    }
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
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

/// A transaction the fence works in: tokio-postgres' and deadpool's (whose
/// statement cache keeps the fence's statements prepared per connection).
///
/// [`Fence::commit`] pipelines its completion and COMMIT: it awaits
/// `cached_statement` of the completion, polls the completion query on
/// `transaction()` once and, when that left it waiting for its answer (sent,
/// as tokio-postgres does at the first poll), sends COMMIT with
/// `transaction().batch_execute`; then it ends the value with
/// `end_committed`. An implementation of its own must keep this.
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
    /// Rolls the transaction back.
    fn rollback(self) -> BoxFuture<'a, Result<(), tokio_postgres::Error>>;
    /// Ends the value after [`Fence::commit`] sent COMMIT through
    /// `transaction()` itself: without the ROLLBACK a drop would send,
    /// releasing whatever else it holds.
    fn end_committed(self);
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
    fn rollback(self) -> BoxFuture<'a, Result<(), tokio_postgres::Error>> {
        Box::pin(tokio_postgres::Transaction::rollback(self))
    }
    fn end_committed(self) {
        // Its drop would send ROLLBACK; it owns nothing else (a savepoint's
        // name, which `commit` is not for).
        std::mem::forget(self);
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
    fn rollback(self) -> BoxFuture<'a, Result<(), tokio_postgres::Error>> {
        Box::pin(deadpool_postgres::Transaction::rollback(self))
    }
    fn end_committed(self) {
        // Its tokio-postgres transaction must not be dropped (that sends
        // ROLLBACK); its handle on the connection's statement cache must.
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped or used again, so the handle is
        // moved out of it exactly once.
        drop(unsafe { std::ptr::read(&this.statement_cache) });
    }
}

impl Fence {
    /// A fence for `key` held with `token` (from `IDEM.BEGIN`, or any
    /// strictly growing number per key), `fingerprint` being the bytes sent
    /// to BEGIN (the row keeps their SHA-256, as the module and the writer do),
    /// with the module's default lease (`idem.lease-ms`, 30 s).
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
            lease: DEFAULT_LEASE,
            idle_timeout: Some(DEFAULT_LEASE),
            layout: TableLayout::Unpartitioned,
            report: None,
        }
    }

    /// The same fence with `lease`: how long a durable claim keeps a retry
    /// out (409) when Redis no longer does, and the idle timeout the fence
    /// applies (unless set otherwise with [`Fence::with_idle_timeout`]). The
    /// middleware's fences come with the layer's lease.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        if self.idle_timeout == Some(self.lease) {
            self.idle_timeout = Some(lease);
        }
        self.lease = lease;
        self
    }

    /// How long a transaction the fence works in may stay idle
    /// (`idle_in_transaction_session_timeout`) or wait for a lock
    /// (`lock_timeout`), set with `SET LOCAL` semantics by the fence's first
    /// statement in it [the lease]: a caller whose machine vanished with the
    /// transaction open holds the key no longer than this (Postgres ends the
    /// session). `None` leaves the session's settings.
    pub fn with_idle_timeout(mut self, idle_timeout: Option<Duration>) -> Self {
        self.idle_timeout = idle_timeout;
        self
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

    /// The lease of a durable claim.
    pub fn lease(&self) -> Duration {
        self.lease
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

    /// Claims the key durably: its `in_progress` row, with this token and a
    /// lease, commits on its own before this returns (one statement, one
    /// round trip when the key is free; the partitioned layout's two in a
    /// short transaction). No connection or transaction is held afterwards:
    /// call anything outside Postgres now (with [`Fence::downstream_key`]),
    /// then [`Fence::commit`] the effect in a short transaction. Only on
    /// [`Claim::Proceed`] may the handler go on; on any other answer, answer
    /// what the claim says.
    ///
    /// While the lease runs, a retry's claim answers `InFlight`, even when
    /// Redis forgot the key; once it lapsed, a retry of the same request
    /// takes the key over with its larger token, and this holder's commit
    /// finds the key lost. Give a claim up with [`Fence::release`] (the
    /// middleware does it for a claim made through a pool).
    pub async fn claim<'c>(&self, client: impl Into<FenceClient<'c>>) -> Result<Claim, IdemError> {
        if self.take_claim_made_up_front() {
            return Ok(Claim::Proceed);
        }
        let args = self.claim_args();
        let (claim, pool) = match client.into() {
            FenceClient::Pool(pool) => {
                let mut client = pool.get().await?;
                (
                    sql::claim_durably(&mut client, &args, self.guard()).await?,
                    Some(pool.clone()),
                )
            }
            FenceClient::Pooled(client) => {
                (sql::claim_durably(client, &args, self.guard()).await?, None)
            }
            FenceClient::Plain(client) => {
                (sql::claim_durably(client, &args, self.guard()).await?, None)
            }
        };
        self.set_report(match &claim {
            Claim::Proceed => FenceReport::Claimed(Release { pool }),
            other => FenceReport::Decided(other.clone()),
        });
        Ok(claim)
    }

    /// Claims the key inside the caller's transaction `tx`: the shape for
    /// effects only in Postgres, where claim, effect and completion commit
    /// in one transaction (its rollback undoes the claim). Never keep `tx`
    /// open across a call outside Postgres: use [`Fence::claim`] then. The
    /// fence bounds how long `tx` may stay idle ([`Fence::with_idle_timeout`]).
    /// Needs READ COMMITTED (Postgres' default). Under stricter isolation a
    /// concurrent claim fails with a serialization error instead (the
    /// unpartitioned layout), or every claim is refused with an error (the
    /// partitioned layout, where it could otherwise claim a key twice).
    pub async fn claim_in<'a, T: FenceTransaction<'a>>(&self, tx: &T) -> Result<Claim, IdemError> {
        if self.take_claim_made_up_front() {
            return Ok(Claim::Proceed);
        }
        let claim = sql::claim_in(tx, &self.claim_args(), self.guard()).await?;
        self.set_report(match &claim {
            Claim::Proceed => FenceReport::Claimed(Release::default()),
            other => FenceReport::Decided(other.clone()),
        });
        Ok(claim)
    }

    /// Writes the completed response into the key's row in `tx`, if this
    /// holder still holds it (its `in_progress` row with this token); it
    /// becomes the key's answer when `tx` commits. From here until `tx` ends
    /// every claim of the key answers `InFlight`. On [`Commit::Lost`] roll
    /// back and answer what it says.
    pub async fn complete<'a, T: FenceTransaction<'a>>(
        &self,
        tx: &T,
        response: &StoredResponse,
    ) -> Result<Commit, IdemError> {
        let written = sql::complete(
            tx,
            &self.key,
            &self.fingerprint.stored_hex(),
            self.token,
            self.guard(),
            response,
        )
        .await?;
        Ok(match written {
            Written::Held => Commit::Committed,
            Written::Lost(claim) => Commit::Lost(self.decided(claim)),
        })
    }

    /// [`Fence::complete`] and COMMIT of `tx` in one round trip (write the
    /// business effect in `tx` first), then tells the middleware, which
    /// completes Redis with this response (`MIRRORED`). When the key was
    /// lost, the completion fails in `tx`, so the COMMIT rolls it back:
    /// nothing is committed, and the answer is what the key holds (the
    /// middleware answers it in place of the handler's response). On an
    /// error the transaction is rolled back, or its fate is unknown (a failed
    /// COMMIT): either way the middleware stores nothing, and a retry's claim
    /// finds out. `tx` is the transaction itself, not a savepoint (its COMMIT
    /// commits the whole transaction).
    pub async fn commit<'a, T: FenceTransaction<'a>>(
        &self,
        tx: T,
        response: &StoredResponse,
    ) -> Result<Commit, IdemError> {
        let written = sql::complete_and_commit(
            tx,
            &self.key,
            &self.fingerprint.stored_hex(),
            self.token,
            self.guard(),
            response,
        )
        .await?;
        Ok(self.committed(written, response))
    }

    /// [`Fence::commit`] without a transaction, for an effect that is one
    /// INSERT, UPDATE or DELETE and a response known before it runs (ids
    /// the application makes or reserved, its own clock): the completion
    /// and `effect` commit together in one autocommitted statement, one
    /// round trip instead of `BEGIN`, the effect, the completion and
    /// `COMMIT`. Number the effect's parameters from `$7`
    /// ([`EFFECT_FIRST_PARAM`](crate::fence::EFFECT_FIRST_PARAM)): the
    /// fence's own come first. When the key was lost nothing is committed,
    /// the effect neither, and the answer is what the key holds; an effect
    /// that fails (a constraint) fails the completion with it, and the error
    /// is returned. Through a pool, a connection is taken for the call only.
    ///
    /// The completion commits whatever rows the effect wrote, none
    /// included: an effect that may write none (an `UPDATE` whose `WHERE`
    /// checks a balance, `ON CONFLICT DO NOTHING`) belongs in [`Fence::commit`]'s
    /// transaction, where the handler sees its row count first. Keep
    /// `effect` a constant (values as parameters): each distinct text is
    /// prepared and cached on every connection it runs on. `client` must be
    /// outside any transaction (a `BEGIN` sent by hand is not detected: the
    /// statement would then commit only with it, while the middleware
    /// already stores the answer), and not after [`Fence::claim_in`] with
    /// that transaction still open (it would wait on its own gate). A plain
    /// client prepares the statement on every call (a round trip more).
    pub async fn commit_effect<'c>(
        &self,
        client: impl Into<FenceClient<'c>>,
        response: &StoredResponse,
        effect: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Commit, IdemError> {
        let args = sql::EffectArgs {
            sql: sql::effect_statement(effect)?,
            key: &self.key,
            fingerprint_hex: self.fingerprint.stored_hex(),
            token: self.token,
            guard: self.guard(),
            response,
            params,
        };
        let written = match client.into() {
            FenceClient::Pool(pool) => sql::complete_with_effect(&pool.get().await?, &args).await?,
            FenceClient::Pooled(client) => sql::complete_with_effect(&*client, &args).await?,
            FenceClient::Plain(client) => sql::complete_with_effect(&*client, &args).await?,
        };
        Ok(self.committed(written, response))
    }

    /// For a handler of several phases: confirms in `tx` that this holder
    /// still holds the key and renews its lease; the key then stays held
    /// until `tx` ends, so what `tx` writes commits only while the key is
    /// this holder's. Commit `tx` on [`Hold::Held`]; roll back on `Lost`.
    pub async fn hold<'a, T: FenceTransaction<'a>>(&self, tx: &T) -> Result<Hold, IdemError> {
        let written = sql::renew(
            tx,
            &self.key,
            &self.fingerprint.stored_hex(),
            self.token,
            self.guard(),
            self.lease.as_secs_f64(),
        )
        .await?;
        Ok(match written {
            Written::Held => {
                // A phase may commit effects: from here the middleware no
                // longer releases the claim (a retry waits for its lease).
                self.set_report(FenceReport::Claimed(Release::default()));
                Hold::Held
            }
            Written::Lost(claim) => Hold::Lost(self.decided(claim)),
        })
    }

    /// Gives up a durable claim that will not be committed (the handler
    /// failed or answered without an effect): deletes its `in_progress` row
    /// if it still holds this token, so a retry proceeds at once rather than
    /// after the lease. Whatever the handler called outside Postgres under
    /// [`Fence::downstream_key`] is found again by the retry's call.
    pub async fn release<'c>(&self, client: impl Into<FenceClient<'c>>) -> Result<(), IdemError> {
        match client.into() {
            FenceClient::Pool(pool) => release_with(pool, &self.key, self.token()).await?,
            FenceClient::Pooled(client) => sql::release(&*client, &self.key, self.token).await?,
            FenceClient::Plain(client) => sql::release(&*client, &self.key, self.token).await?,
        }
        self.set_report(FenceReport::Claimed(Release::default()));
        Ok(())
    }

    fn claim_args(&self) -> ClaimArgs<'_> {
        ClaimArgs {
            layout: self.layout,
            key: &self.key,
            fingerprint_hex: self.fingerprint.stored_hex(),
            token: self.token,
            ttl_secs: self.ttl.as_secs_f64(),
            lease_secs: self.lease.as_secs_f64(),
        }
    }

    fn guard(&self) -> Guard {
        Guard {
            idle_timeout_ms: self
                .idle_timeout
                .map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX)),
        }
    }

    /// Whether the middleware claimed the key durably before the handler
    /// ran (its `claim_up_front`) and the handler had not used the fence
    /// yet: the handler now holds that claim, reported as one made through
    /// a pool (released by the middleware unless committed).
    fn take_claim_made_up_front(&self) -> bool {
        let Some(slot) = &self.report else {
            return false;
        };
        let mut report = slot.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match std::mem::take(&mut *report) {
            FenceReport::ClaimedUpFront(release, at) => {
                *report = FenceReport::Claimed(release);
                // Made recently, the claim still holds (its lease runs);
                // an older one is claimed again (with the same token: it
                // answers what became of the key meanwhile).
                at.elapsed() < self.lease / 2
            }
            other => {
                *report = other;
                false
            }
        }
    }

    /// What a commit that wrote (or did not) `response` answers, told to
    /// the middleware.
    fn committed(&self, written: Written, response: &StoredResponse) -> Commit {
        match written {
            Written::Held => {
                self.set_report(FenceReport::Committed(response.clone()));
                Commit::Committed
            }
            Written::Lost(claim) => Commit::Lost(self.decided(claim)),
        }
    }

    /// Tells the middleware the key holds `claim`, and answers it.
    fn decided(&self, claim: Claim) -> Claim {
        self.set_report(FenceReport::Decided(claim.clone()));
        claim
    }

    fn set_report(&self, report: FenceReport) {
        if let Some(slot) = &self.report {
            *slot.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = report;
        }
    }
}

/// The module's default lease (`idem.lease-ms`).
const DEFAULT_LEASE: Duration =
    Duration::from_millis(idem_core::args::Limits::DEFAULT.default_lease_ms);

/// Deletes the durable claim of `key` with `token` through a connection of
/// `pool`.
pub(crate) async fn release_with(
    pool: &deadpool_postgres::Pool,
    key: &str,
    token: u64,
) -> Result<(), IdemError> {
    let token = i64::try_from(token).map_err(|_| IdemError::BadArg("token too large".into()))?;
    let client = pool.get().await?;
    sql::release(&client, key, token).await
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
