//! The module's error replies: each starts with a code word of its own.

use std::fmt;

use crate::wire::ErrorCode;

/// Every failure a command can answer. `Display` gives the full error reply,
/// code word first (`STALE ...`), as clients see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A malformed or out-of-range argument.
    BadArg(String),
    /// The token is not the current holder's (another holder took over).
    Stale,
    /// No record under the key.
    NotFound,
    /// The record is already completed; it can no longer change.
    Completed,
    /// Body plus headers (each with `args::HEADER_OVERHEAD`) are larger
    /// than `max-body-bytes`.
    TooLarge { len: usize, max: u64 },
    /// More `HEADER`s than `max-headers`.
    TooManyHeaders { max: u64 },
    /// The key holds a value that is not an idem record.
    WrongType,
    /// A stored value could not be decoded.
    Corrupt(String),
    /// An internal command called by a client.
    NoPerm(String),
    /// A new record while used memory is above `maxmemory`.
    Oom,
    /// A panic was caught at the command boundary.
    Internal(String),
}

impl Error {
    pub fn bad_arg(msg: impl Into<String>) -> Self {
        Error::BadArg(msg.into())
    }

    /// The code word that starts the error reply.
    pub fn code(&self) -> ErrorCode {
        match self {
            Error::BadArg(_) => ErrorCode::BadArg,
            Error::Stale => ErrorCode::Stale,
            Error::NotFound => ErrorCode::NotFound,
            Error::Completed => ErrorCode::Completed,
            Error::TooLarge { .. } | Error::TooManyHeaders { .. } => ErrorCode::TooLarge,
            Error::WrongType => ErrorCode::WrongType,
            Error::Corrupt(_) => ErrorCode::Corrupt,
            Error::NoPerm(_) => ErrorCode::NoPerm,
            Error::Oom => ErrorCode::Oom,
            Error::Internal(_) => ErrorCode::Internal,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let code = self.code();
        match self {
            Error::BadArg(msg) => write!(f, "{code} {msg}"),
            Error::Stale => write!(f, "{code} token is not the current holder's"),
            Error::NotFound => write!(f, "{code} no idempotency record under this key"),
            Error::Completed => write!(f, "{code} the record is already completed"),
            Error::TooLarge { len, max } => {
                write!(f, "{code} body is {len} bytes, max-body-bytes is {max}")
            }
            Error::TooManyHeaders { max } => {
                write!(f, "{code} more than {max} headers (max-headers)")
            }
            Error::WrongType => write!(
                f,
                "{code} Operation against a key holding the wrong kind of value"
            ),
            Error::Oom => write!(
                f,
                "{code} command not allowed when used memory > 'maxmemory'."
            ),
            Error::Corrupt(msg) | Error::NoPerm(msg) => write!(f, "{code} {msg}"),
            Error::Internal(msg) => write!(f, "{code} {msg}"),
        }
    }
}

impl std::error::Error for Error {}
