//! `IDEM.BEGIN` with the layer's options, through read-through when it is
//! configured: the first step of every request with a key, and of the
//! second look after a `STALE` COMPLETE. With `claim_up_front`, the first
//! BEGIN's read-through lookup is the fence's durable claim instead.

use std::time::Duration;

use redis::aio::ConnectionLike;

use super::config::{Config, RequestFence};
use super::metrics::Observer;
use crate::{BeginOptions, Fingerprint, IdemError, Outcome};

/// `Retry-After` of a 409 the fence answers (another holder has the key).
pub(crate) const FENCE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// BEGIN for `key` and `fingerprint` with the configured ttl, lease and wait.
pub(crate) async fn begin<C>(
    config: &Config<C>,
    key: &str,
    fingerprint: &Fingerprint,
) -> Result<Outcome, IdemError>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    #[cfg(feature = "postgres")]
    if let Some(read_through) = &config.read_through {
        return read_through
            .begin(&config.client, key, fingerprint.as_bytes(), options(config))
            .await;
    }
    config
        .client
        .begin(key, fingerprint.as_bytes(), options(config))
        .await
}

/// A request's first BEGIN: [`begin`], or with `claim_up_front` (and
/// read-through) BEGIN and then the fence's durable claim in place of the
/// lookup. On `New` with the claim made, the request's fence holding it.
pub(crate) async fn begin_request<C>(
    config: &Config<C>,
    key: &str,
    fingerprint: &Fingerprint,
    observer: &Observer,
) -> Result<(Outcome, Option<RequestFence>), IdemError>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    #[cfg(feature = "postgres")]
    if let (true, Some(read_through)) = (config.claim_up_front, &config.read_through) {
        return Box::pin(claim_up_front(
            config,
            read_through,
            key,
            fingerprint,
            observer,
        ))
        .await;
    }
    #[cfg(not(feature = "postgres"))]
    let _ = observer;
    Ok((begin(config, key, fingerprint).await?, None))
}

fn options<C>(config: &Config<C>) -> BeginOptions {
    BeginOptions {
        ttl: config.ttl,
        lease: Some(config.lease),
        wait: config.wait,
    }
}

/// BEGIN, then on `new` the fence's durable claim through read-through's
/// pool, bounded by its timeout. What the claim finds is answered as
/// read-through answers a mirror row (a completed row refills Redis and is
/// replayed; another request's row is a mismatch) and, beyond it, a live
/// claim is in flight; in each the key is given back to Redis but for the
/// refill. When Postgres does not answer, the key is released in Redis and
/// the claim, which may have committed, in Postgres (in the background),
/// and the error returned (`is_unavailable`: 503).
#[cfg(feature = "postgres")]
async fn claim_up_front<C>(
    config: &Config<C>,
    read_through: &crate::ReadThrough,
    key: &str,
    fingerprint: &Fingerprint,
    observer: &Observer,
) -> Result<(Outcome, Option<RequestFence>), IdemError>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    use super::metrics::FenceAnswer;
    use crate::fence::Claim;

    let client = &config.client;
    let token = match client
        .begin(key, fingerprint.as_bytes(), options(config))
        .await?
    {
        Outcome::New { token } => token,
        other => return Ok((other, None)),
    };
    let request_fence = config.request_fence(key, token, fingerprint);
    let pool = read_through.pool();
    let timeout = read_through.timeout();
    // When the claim outlasts `timeout`, or fails with its fate unknown, it
    // is given up only once it has ended (a release sent meanwhile on
    // another connection could run before the claim commits, and the key
    // would answer 409 for the whole lease): a claim timed out moves into a
    // task that finishes it, then releases. (Polled here, not spawned: the
    // request's flow itself finishes in a task of its own when dropped.)
    let mut claiming: ClaimFuture = {
        let (fence, pool) = (request_fence.fence.clone(), pool.clone());
        Box::pin(async move { fence.claim(&pool).await })
    };
    let claim = match tokio::time::timeout(timeout, &mut claiming).await {
        Ok(Ok(claim)) => Ok(claim),
        Ok(Err(err)) => {
            release_in_background(pool, key, token, None);
            Err(err)
        }
        Err(_) => {
            release_in_background(pool, key, token, Some(claiming));
            Err(IdemError::Postgres(format!(
                "the fence's claim had no answer within {} ms",
                timeout.as_millis()
            )))
        }
    };
    let outcome = match claim {
        Ok(Claim::Proceed) => {
            request_fence.claimed_up_front(pool.clone());
            return Ok((Outcome::New { token }, Some(request_fence)));
        }
        Ok(Claim::Replay(stored)) => {
            observer.fence(FenceAnswer::Replay);
            crate::read_through::refill(client, key, token, &stored).await;
            return Ok((Outcome::Replay(stored), None));
        }
        Ok(Claim::Mismatch) => {
            observer.fence(FenceAnswer::Mismatch);
            Ok(Outcome::Mismatch)
        }
        Ok(Claim::InFlight) => {
            observer.fence(FenceAnswer::InFlight);
            Ok(Outcome::InFlight {
                retry_after: FENCE_RETRY_AFTER,
            })
        }
        Err(err) => Err(err),
    };
    crate::read_through::release(client, key, token).await;
    outcome.map(|outcome| (outcome, None))
}

/// A durable claim under way.
#[cfg(feature = "postgres")]
type ClaimFuture = futures_util::future::BoxFuture<'static, Result<crate::fence::Claim, IdemError>>;

/// Gives up the claim of `key` with `token` in a task of its own, once the
/// claim (when still running) has ended.
#[cfg(feature = "postgres")]
fn release_in_background(
    pool: &deadpool_postgres::Pool,
    key: &str,
    token: u64,
    claiming: Option<ClaimFuture>,
) {
    let (pool, key) = (pool.clone(), key.to_owned());
    tokio::spawn(async move {
        if let Some(claiming) = claiming {
            let _ = claiming.await;
        }
        if let Err(err) = crate::fence::release_with(&pool, &key, token).await {
            tracing::warn!(key, error = %err, "could not release the fence's claim; it ends with its lease");
        }
    });
}
