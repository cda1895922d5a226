//! The bound on one call to Redis: `DEFAULT_CALL_TIMEOUT` and `bounded`,
//! shared by the client and its dedicated wait connections.

use std::future::Future;
use std::time::Duration;

use futures_util::FutureExt;

use crate::IdemError;

/// Default bound on one non-blocking call.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// Runs `call` for at most `timeout`; a timeout is `Unavailable`. A plain
/// combinator, not an `async fn`: it adds nothing to the size of the futures
/// that embed it. The deadline starts when `bounded` is called (inside the
/// runtime), so call it where its future is awaited.
pub(crate) fn bounded<T>(
    timeout: Duration,
    call: impl Future<Output = redis::RedisResult<T>>,
) -> impl Future<Output = Result<T, IdemError>> {
    tokio::time::timeout(timeout, call).map(move |result| match result {
        Ok(result) => result.map_err(IdemError::from),
        Err(_) => Err(IdemError::timeout(timeout)),
    })
}
