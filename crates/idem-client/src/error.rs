//! Typed errors: one variant per module error code, plus "the store is
//! unreachable" (connection, timeout, cluster unavailability) and Postgres.

use std::time::Duration;

use idem_core::wire::ErrorCode;

/// Everything a call to the module (or the read-through mirror) can fail with.
#[derive(Debug, thiserror::Error)]
pub enum IdemError {
    /// `BADARG`: malformed or out-of-range argument.
    #[error("BADARG: {0}")]
    BadArg(String),
    /// `STALE`: the token is no longer the holder's (the key was taken over).
    #[error("STALE: {0}")]
    Stale(String),
    /// `NOTFOUND`: no record under the key.
    #[error("NOTFOUND: {0}")]
    NotFound(String),
    /// `COMPLETED`: the record is completed and can no longer change.
    #[error("COMPLETED: {0}")]
    Completed(String),
    /// `TOOLARGE`: body plus headers exceed the module's `max-body-bytes`.
    #[error("TOOLARGE: {0}")]
    TooLarge(String),
    /// `WRONGTYPE`: the key holds a value that is not an idem record.
    #[error("WRONGTYPE: {0}")]
    WrongType(String),
    /// `CORRUPT`: the stored value could not be decoded.
    #[error("CORRUPT: {0}")]
    Corrupt(String),
    /// `NOPERM`: the connection's ACL user may not run the command.
    #[error("NOPERM: {0}")]
    NoPerm(String),
    /// `OOM`: Redis is above `maxmemory`; `IDEM.BEGIN` creates no new record
    /// (replays and in-flight answers still work), `IDEM.COMPLETE` stores nothing.
    #[error("OOM: {0}")]
    Oom(String),
    /// `INTERNAL`: the module caught a bug at its command boundary.
    #[error("INTERNAL: {0}")]
    Internal(String),
    /// Redis could not be reached or did not answer in time (I/O, timeout,
    /// cluster down, loading). Nothing is known about the command's effect.
    #[error("redis unavailable: {0}")]
    Unavailable(String),
    /// `NOREPLICAS` or `MISCONF`: the primary is up but refuses writes for
    /// now (fewer replicas than `min-replicas-to-write`, a failed disk
    /// write). Unavailable (503), yet `fail_open` does not run the handler
    /// on it: the keys are all there, a retry may be one already answered.
    #[error("redis refuses writes for now: {0}")]
    WritesRefused(String),
    /// Any other Redis error (an unknown error code; a connection's
    /// credentials or settings refused: redis-rs' `AuthenticationFailed` or
    /// `InvalidClientConfig`, `WRONGPASS`, `NOAUTH`, ...): 500, and never
    /// `fail_open`.
    #[error("redis error: {0}")]
    Redis(redis::RedisError),
    /// The module answered something this client does not understand.
    #[error("unexpected reply from the idem module: {0}")]
    UnexpectedReply(String),
    /// A `WAIT` was asked for but the client has no dedicated connections for
    /// blocking calls (see `IdemClient::with_wait_connections`).
    #[error("waiting needs dedicated connections; none are configured")]
    NoWaitConnections,
    /// Nothing of idem can run on the server: the module is not loaded and
    /// the Functions library can be neither found nor loaded (`FUNCTION` or
    /// `EVAL` refused). Construction fails with it; the text names each way
    /// tried and what to do.
    #[error("idem is not installed on the server: {0}")]
    NotInstalled(String),
    /// Postgres could not be read or written: the read-through mirror, or
    /// the fence's transaction (feature `postgres`).
    #[error("postgres mirror unavailable: {0}")]
    Postgres(String),
}

impl IdemError {
    /// True when the failure says nothing about the record: the store (Redis or
    /// the Postgres mirror) was unreachable or slow. The middleware answers 503
    /// for these (or runs the handler when configured fail-open).
    pub fn is_unavailable(&self) -> bool {
        self.is_unreachable() || matches!(self, IdemError::WritesRefused(_))
    }

    /// True when the store may take a write it refused a moment later: it
    /// was unavailable (`is_unavailable`) or full (`OOM`, above `maxmemory`).
    /// A response the handler produced is retried, never released, on these:
    /// releasing the key would let a retry run the handler again.
    pub fn is_transient(&self) -> bool {
        self.is_unavailable() || matches!(self, IdemError::Oom(_))
    }

    /// True when the store could not be reached or did not answer: the
    /// failures `fail_open` runs the handler on. Not a primary that answers
    /// but refuses writes (`WritesRefused`).
    pub fn is_unreachable(&self) -> bool {
        matches!(self, IdemError::Unavailable(_) | IdemError::Postgres(_))
    }

    /// The module's error code, for errors the module answered.
    pub fn code(&self) -> Option<ErrorCode> {
        Some(match self {
            IdemError::BadArg(_) => ErrorCode::BadArg,
            IdemError::Stale(_) => ErrorCode::Stale,
            IdemError::NotFound(_) => ErrorCode::NotFound,
            IdemError::Completed(_) => ErrorCode::Completed,
            IdemError::TooLarge(_) => ErrorCode::TooLarge,
            IdemError::WrongType(_) => ErrorCode::WrongType,
            IdemError::Corrupt(_) => ErrorCode::Corrupt,
            IdemError::NoPerm(_) => ErrorCode::NoPerm,
            IdemError::Oom(_) => ErrorCode::Oom,
            IdemError::Internal(_) => ErrorCode::Internal,
            _ => return None,
        })
    }

    pub(crate) fn timeout(after: Duration) -> Self {
        IdemError::Unavailable(format!("no answer within {} ms", after.as_millis()))
    }
}

impl From<redis::RedisError> for IdemError {
    fn from(err: redis::RedisError) -> Self {
        if let Some(code) = err.code().and_then(|c| c.parse::<ErrorCode>().ok()) {
            let detail = err.detail().unwrap_or_default().to_string();
            return match code {
                ErrorCode::BadArg => IdemError::BadArg(detail),
                ErrorCode::Stale => IdemError::Stale(detail),
                ErrorCode::NotFound => IdemError::NotFound(detail),
                ErrorCode::Completed => IdemError::Completed(detail),
                ErrorCode::TooLarge => IdemError::TooLarge(detail),
                ErrorCode::WrongType => IdemError::WrongType(detail),
                ErrorCode::Corrupt => IdemError::Corrupt(detail),
                ErrorCode::NoPerm => IdemError::NoPerm(detail),
                ErrorCode::Oom => IdemError::Oom(detail),
                ErrorCode::Internal => IdemError::Internal(detail),
            };
        }
        // A primary that may not take writes for now: too few replicas
        // (`min-replicas-to-write`), or a failed snapshot or AOF write
        // (`MISCONF`). redis-rs has no kinds for them.
        if matches!(err.code(), Some("NOREPLICAS" | "MISCONF")) {
            return IdemError::WritesRefused(err.to_string());
        }
        if is_unavailability(&err) {
            IdemError::Unavailable(err.to_string())
        } else {
            IdemError::Redis(err)
        }
    }
}

#[cfg(feature = "postgres")]
impl From<deadpool_postgres::PoolError> for IdemError {
    fn from(err: deadpool_postgres::PoolError) -> Self {
        IdemError::Postgres(err.to_string())
    }
}

#[cfg(feature = "postgres")]
impl From<tokio_postgres::Error> for IdemError {
    fn from(err: tokio_postgres::Error) -> Self {
        // tokio-postgres' own text of a server error is only "db error".
        IdemError::Postgres(match err.as_db_error() {
            Some(db) => format!("{} ({}): {}", db.severity(), db.code().code(), db.message()),
            None => err.to_string(),
        })
    }
}

fn is_unavailability(err: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    // The server refused the credentials: a configuration error, never an
    // outage (`fail_open` must not run every request on it).
    if err.kind() == ErrorKind::AuthenticationFailed {
        return false;
    }
    err.is_io_error()
        || err.is_timeout()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
        || err.is_unrecoverable_error()
        || matches!(
            err.kind(),
            ErrorKind::Server(
                ServerErrorKind::ClusterDown
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::TryAgain
                    | ServerErrorKind::BusyLoading
                    | ServerErrorKind::ReadOnly
            ) | ErrorKind::ClusterConnectionNotFound
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server_error(code: &str, detail: &str) -> redis::RedisError {
        let wire = format!("-{code} {detail}\r\n");
        match redis::parse_redis_value(wire.as_bytes()).and_then(|v| v.extract_error()) {
            Err(err) => err,
            Ok(value) => panic!("{wire:?} parsed as a value: {value:?}"),
        }
    }

    #[test]
    fn module_codes_map_to_variants() {
        assert!(
            matches!(IdemError::from(server_error("STALE", "t")), IdemError::Stale(d) if d == "t")
        );
        assert!(matches!(
            IdemError::from(server_error("NOTFOUND", "")),
            IdemError::NotFound(_)
        ));
        assert!(matches!(
            IdemError::from(server_error("COMPLETED", "")),
            IdemError::Completed(_)
        ));
        assert!(matches!(
            IdemError::from(server_error("TOOLARGE", "")),
            IdemError::TooLarge(_)
        ));
        assert!(matches!(
            IdemError::from(server_error("INTERNAL", "")),
            IdemError::Internal(_)
        ));
        assert!(matches!(
            IdemError::from(server_error("NOPE", "")),
            IdemError::Redis(_)
        ));
    }

    #[test]
    fn every_module_code_has_its_variant() {
        for code in ErrorCode::ALL {
            let err = IdemError::from(server_error(code.as_str(), "d"));
            assert_eq!(err.code(), Some(code), "{err:?}");
        }
    }

    #[test]
    fn io_errors_are_unavailability() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let err = IdemError::from(redis::RedisError::from(io));
        assert!(err.is_unavailable(), "{err:?}");
    }

    #[test]
    fn busy_loading_is_unavailability() {
        let err = redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::BusyLoading),
            "loading",
        ));
        assert!(IdemError::from(err).is_unavailable());
    }

    #[test]
    fn a_primary_refusing_writes_for_now_is_unavailability() {
        for code in ["NOREPLICAS", "MISCONF", "READONLY", "MASTERDOWN"] {
            let err = IdemError::from(server_error(code, "not now"));
            assert!(err.is_unavailable(), "{code}: {err:?}");
        }
        // Refusals from a primary that answers are not "unreachable": they
        // never run a handler unprotected.
        for code in ["NOREPLICAS", "MISCONF"] {
            let err = IdemError::from(server_error(code, "not now"));
            assert!(matches!(err, IdemError::WritesRefused(_)), "{err:?}");
            assert!(!err.is_unreachable(), "{code}");
        }
        let other = IdemError::from(server_error("ERR", "unknown command"));
        assert!(!other.is_unavailable(), "{other:?}");
    }

    #[test]
    fn refused_credentials_are_not_unavailability() {
        let auth = redis::RedisError::from((
            redis::ErrorKind::AuthenticationFailed,
            "refused",
            "WRONGPASS".to_owned(),
        ));
        let err = IdemError::from(auth);
        assert!(matches!(err, IdemError::Redis(_)), "{err:?}");
        assert!(!err.is_unavailable() && !err.is_unreachable());
        for code in ["WRONGPASS", "NOAUTH"] {
            let err = IdemError::from(server_error(code, "credentials"));
            assert!(!err.is_unavailable(), "{code}: {err:?}");
        }
    }

    #[test]
    fn client_errors_are_not_unavailability() {
        let err = IdemError::from(server_error("BADARG", "x"));
        assert!(!err.is_unavailable());
    }
}
