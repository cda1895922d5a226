//! [`Error`]: what the library's functions fail with, by kind, each with a
//! message saying what was being done; and the crate's way of adding that
//! message to the errors of Postgres, Redis and the OS.

/// `Result` with [`Error`] as the error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a writer operation failed. The message (`Display`) says what was
/// being done; [`std::error::Error::source`] gives the underlying error where
/// there is one.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A setting or URL the writer cannot work with; found before anything
    /// runs.
    #[error("{0}")]
    Config(String),
    /// Postgres could not be reached, refused a statement, or did not answer
    /// in time (`source` is `None` for a timeout).
    #[error("{context}")]
    Postgres {
        /// What was being done.
        context: String,
        /// What Postgres (or the connection) said.
        #[source]
        source: Option<tokio_postgres::Error>,
    },
    /// A Redis node could not be reached, refused a command, or did not
    /// answer in time (`source` is `None` for a timeout).
    #[error("{context}")]
    Redis {
        /// What was being done.
        context: String,
        /// What Redis (or the connection) said.
        #[source]
        source: Option<redis::RedisError>,
    },
    /// The `idempotency_keys` table does not allow what was asked: it exists
    /// with the other layout, is not partitioned, or is missing.
    #[error("{0}")]
    Layout(String),
    /// Discovery found no usable primary, or a node answered it with a reply
    /// the writer does not understand.
    #[error("{0}")]
    Topology(String),
    /// An operating-system call failed (binding the metrics address).
    #[error("{context}")]
    Io {
        /// What was being done.
        context: String,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// One of the writer's tasks ended while it was running (a panic, or a
    /// loop that should not end); `run` stops.
    #[error("{0}")]
    TaskEnded(String),
}

impl Error {
    /// The message and every underlying error, joined by `": "` (for logs).
    pub(crate) fn report(&self) -> String {
        let mut text = self.to_string();
        let mut source = std::error::Error::source(self);
        while let Some(cause) = source {
            text.push_str(": ");
            text.push_str(&cause.to_string());
            source = cause.source();
        }
        text
    }

    /// Postgres did not answer within the time allowed.
    pub(crate) fn postgres_timeout(context: impl Into<String>) -> Self {
        Error::Postgres {
            context: context.into(),
            source: None,
        }
    }

    /// Redis did not answer within the time allowed.
    pub(crate) fn redis_timeout(context: impl Into<String>) -> Self {
        Error::Redis {
            context: context.into(),
            source: None,
        }
    }
}

/// An error that becomes an [`Error`] once told what was being done.
pub(crate) trait Cause {
    fn within(self, context: String) -> Error;
}

impl Cause for tokio_postgres::Error {
    fn within(self, context: String) -> Error {
        Error::Postgres {
            context,
            source: Some(self),
        }
    }
}

impl Cause for deadpool_postgres::PoolError {
    fn within(self, context: String) -> Error {
        match self {
            deadpool_postgres::PoolError::Backend(error) => error.within(context),
            other => Error::Postgres {
                context: format!("{context}: {other}"),
                source: None,
            },
        }
    }
}

impl Cause for redis::RedisError {
    fn within(self, context: String) -> Error {
        Error::Redis {
            context,
            source: Some(self),
        }
    }
}

impl Cause for std::io::Error {
    fn within(self, context: String) -> Error {
        Error::Io {
            context,
            source: self,
        }
    }
}

/// An [`Error`] told more: the outer context goes first, as in
/// `"discover the primaries: CLUSTER NODES of a:1: ..."`.
impl Cause for Error {
    fn within(self, outer: String) -> Error {
        let nest = |inner: String| format!("{outer}: {inner}");
        match self {
            Error::Config(m) => Error::Config(nest(m)),
            Error::Layout(m) => Error::Layout(nest(m)),
            Error::Topology(m) => Error::Topology(nest(m)),
            Error::TaskEnded(m) => Error::TaskEnded(nest(m)),
            Error::Postgres { context, source } => Error::Postgres {
                context: nest(context),
                source,
            },
            Error::Redis { context, source } => Error::Redis {
                context: nest(context),
                source,
            },
            Error::Io { context, source } => Error::Io {
                context: nest(context),
                source,
            },
        }
    }
}

/// Adds what was being done to a failed result.
pub(crate) trait Context<T> {
    fn context(self, context: &str) -> Result<T>;
    fn with_context(self, context: impl FnOnce() -> String) -> Result<T>;
}

impl<T, E: Cause> Context<T> for std::result::Result<T, E> {
    fn context(self, context: &str) -> Result<T> {
        self.map_err(|e| e.within(context.to_string()))
    }

    fn with_context(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| e.within(context()))
    }
}

/// Fails with [`Error::Config`] unless `condition` holds.
pub(crate) fn ensure_config(condition: bool, message: impl Into<String>) -> Result<()> {
    if condition {
        Ok(())
    } else {
        Err(Error::Config(message.into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_nests_and_report_walks_the_sources() {
        let io = std::io::Error::new(std::io::ErrorKind::AddrInUse, "in use");
        let error: Result<()> = Err(io).context("bind 127.0.0.1:1");
        let error = error.context("start").unwrap_err();
        assert_eq!(error.to_string(), "start: bind 127.0.0.1:1");
        assert_eq!(error.report(), "start: bind 127.0.0.1:1: in use");
        assert!(matches!(error, Error::Io { .. }));
    }
}
