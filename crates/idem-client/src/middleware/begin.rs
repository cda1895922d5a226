//! `IDEM.BEGIN` with the layer's options, through read-through when it is
//! configured: the first step of every request with a key, and of the
//! second look after a `STALE` COMPLETE.

use redis::aio::ConnectionLike;

use super::config::Config;
use crate::{BeginOptions, Fingerprint, IdemError, Outcome};

/// BEGIN for `key` and `fingerprint` with the configured ttl, lease and wait.
pub(crate) async fn begin<C>(
    config: &Config<C>,
    key: &str,
    fingerprint: &Fingerprint,
) -> Result<Outcome, IdemError>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let options = BeginOptions {
        ttl: config.ttl,
        lease: Some(config.lease),
        wait: config.wait,
    };
    #[cfg(feature = "postgres")]
    if let Some(read_through) = &config.read_through {
        return read_through
            .begin(&config.client, key, fingerprint.as_bytes(), options)
            .await;
    }
    config
        .client
        .begin(key, fingerprint.as_bytes(), options)
        .await
}
