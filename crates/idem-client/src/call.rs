//! The bound on one call to Redis: `DEFAULT_CALL_TIMEOUT` and `bounded`,
//! shared by the client and its dedicated wait connections.

use std::future::Future;
use std::time::Duration;

use crate::IdemError;

/// Default bound on one non-blocking call.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// Runs `call` for at most `timeout`; a timeout is `Unavailable`.
pub(crate) async fn bounded<T>(
    timeout: Duration,
    call: impl Future<Output = redis::RedisResult<T>>,
) -> Result<T, IdemError> {
    match tokio::time::timeout(timeout, call).await {
        Ok(result) => result.map_err(IdemError::from),
        Err(_) => Err(IdemError::timeout(timeout)),
    }
}
