//! Read-through from the Postgres mirror: when Redis answers `new` for a key
//! the mirror still holds as completed, Redis lost it; refill Redis from the
//! mirror (`IDEM.COMPLETE ... MIRRORED`) and answer the stored response, so a
//! request never runs twice because Redis lost data.

use std::time::Duration;

use bytes::Bytes;
use deadpool_postgres::Pool;
use redis::aio::ConnectionLike;

use crate::fingerprint::stored_hex;
use crate::{BeginOptions, IdemClient, IdemError, Origin, Outcome, StoredResponse};

/// The writer's table (see `idem-writer`'s migration).
const LOOKUP: &str = "SELECT fingerprint, response_status, response_body, response_headers \
     FROM idempotency_keys \
     WHERE key = $1 AND status = 'completed' AND expires_at > now()";

/// A completed, unexpired row of the mirror.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirroredRecord {
    /// Lowercase hex SHA-256 of the fingerprint bytes sent to BEGIN.
    pub fingerprint_hex: String,
    /// The stored response.
    pub response: StoredResponse,
}

/// Default bound on one mirror lookup (connection checkout included).
pub const DEFAULT_LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

/// Looks keys up in the mirror's `idempotency_keys` table.
#[derive(Clone)]
pub struct ReadThrough {
    pool: Pool,
    timeout: Duration,
}

impl std::fmt::Debug for ReadThrough {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadThrough").finish_non_exhaustive()
    }
}

impl ReadThrough {
    /// Read-through on the writer's database through `pool`.
    pub fn new(pool: Pool) -> Self {
        ReadThrough {
            pool,
            timeout: DEFAULT_LOOKUP_TIMEOUT,
        }
    }

    /// Bound on one lookup [2 s]; past it the lookup is `Postgres` (unavailable).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The pool lookups run through.
    #[cfg(feature = "middleware")]
    pub(crate) fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The bound on one lookup.
    #[cfg(feature = "middleware")]
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The completed, unexpired mirror row for `key`, if any.
    pub async fn lookup(&self, key: &str) -> Result<Option<MirroredRecord>, IdemError> {
        match tokio::time::timeout(self.timeout, self.query(key)).await {
            Ok(result) => result,
            Err(_) => Err(IdemError::Postgres(format!(
                "no answer within {} ms",
                self.timeout.as_millis()
            ))),
        }
    }

    async fn query(&self, key: &str) -> Result<Option<MirroredRecord>, IdemError> {
        let client = self.pool.get().await?;
        let statement = client.prepare_cached(LOOKUP).await?;
        let Some(row) = client.query_opt(&statement, &[&key]).await? else {
            return Ok(None);
        };
        let fingerprint_hex: String = row.try_get(0)?;
        let response = decode_response(key, row.try_get(1)?, row.try_get(2)?, row.try_get(3)?)?;
        Ok(Some(MirroredRecord {
            fingerprint_hex: fingerprint_hex.to_ascii_lowercase(),
            response,
        }))
    }

    /// `IDEM.BEGIN`, then on `new` the mirror lookup:
    /// - no row: `New` (the caller runs the request);
    /// - a row with the same fingerprint: Redis is refilled with the row
    ///   (`MIRRORED`, under the token just obtained) and the answer is `Replay`;
    /// - a row with another fingerprint: the key is released and the answer
    ///   is `Mismatch`.
    ///
    /// When the mirror cannot be read the key is released and the error
    /// returned (`is_unavailable`): the mirror may hold the answer.
    pub async fn begin<C>(
        &self,
        client: &IdemClient<C>,
        key: &str,
        fingerprint: &[u8],
        options: BeginOptions,
    ) -> Result<Outcome, IdemError>
    where
        C: ConnectionLike + Clone + Send + Sync + 'static,
    {
        let token = match client.begin(key, fingerprint, options).await? {
            Outcome::New { token } => token,
            other => return Ok(other),
        };
        // Boxed: the lookup's future is large, and only a new key awaits it;
        // inline, it would size every request's future.
        let record = match Box::pin(self.lookup(key)).await {
            Ok(record) => record,
            Err(err) => {
                release(client, key, token).await;
                return Err(err);
            }
        };
        let Some(record) = record else {
            return Ok(Outcome::New { token });
        };
        if record.fingerprint_hex != stored_hex(fingerprint) {
            release(client, key, token).await;
            return Ok(Outcome::Mismatch);
        }
        refill(client, key, token, &record.response).await;
        Ok(Outcome::Replay(record.response))
    }
}

/// A stored response from its `idempotency_keys` columns: status, body and
/// the flat `name, value, ...` header array.
pub(crate) fn decode_response(
    key: &str,
    status: i32,
    body: Option<Vec<u8>>,
    flat_headers: Option<Vec<Vec<u8>>>,
) -> Result<StoredResponse, IdemError> {
    let status = u16::try_from(status)
        .ok()
        .filter(|s| idem_core::record::STATUS_RANGE.contains(s))
        .ok_or_else(|| IdemError::Postgres(format!("row for {key:?} has status {status}")))?;
    let flat_headers = flat_headers.unwrap_or_default();
    if flat_headers.len() % 2 == 1 {
        return Err(IdemError::Postgres(format!(
            "row for {key:?} has an odd number of header items"
        )));
    }
    let headers = flat_headers
        .chunks_exact(2)
        .map(|pair| {
            (
                String::from_utf8_lossy(&pair[0]).into_owned(),
                Bytes::copy_from_slice(&pair[1]),
            )
        })
        .collect();
    Ok(StoredResponse {
        status,
        body: Bytes::from(body.unwrap_or_default()),
        headers,
    })
}

/// Puts the answer Postgres holds for `key` into Redis under `token`
/// (`MIRRORED`: the writer has nothing to write); when that fails, the key
/// is released (the answer stands, Redis just stays without it).
pub(crate) async fn refill<C>(
    client: &IdemClient<C>,
    key: &str,
    token: u64,
    response: &StoredResponse,
) where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    if let Err(err) = client.complete(key, token, response, Origin::Mirror).await {
        tracing::warn!(key, error = %err, "could not refill redis from postgres");
        release(client, key, token).await;
    }
}

/// Releases `key` held with `token` (`IDEM.ABORT`); a failure is logged
/// (the key then frees itself when its lease lapses).
pub(crate) async fn release<C>(client: &IdemClient<C>, key: &str, token: u64)
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    if let Err(err) = client.abort(key, token).await {
        tracing::warn!(key, error = %err, "could not release an idempotency key");
    }
}
