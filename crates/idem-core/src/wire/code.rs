//! The code words that start every error reply of the module.

use std::fmt;
use std::str::FromStr;

/// One code word per kind of failure (docs/module/commands.md, "Error codes").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    BadArg,
    Stale,
    NotFound,
    Completed,
    TooLarge,
    WrongType,
    Corrupt,
    NoPerm,
    Oom,
    Internal,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 10] = [
        ErrorCode::BadArg,
        ErrorCode::Stale,
        ErrorCode::NotFound,
        ErrorCode::Completed,
        ErrorCode::TooLarge,
        ErrorCode::WrongType,
        ErrorCode::Corrupt,
        ErrorCode::NoPerm,
        ErrorCode::Oom,
        ErrorCode::Internal,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadArg => "BADARG",
            ErrorCode::Stale => "STALE",
            ErrorCode::NotFound => "NOTFOUND",
            ErrorCode::Completed => "COMPLETED",
            ErrorCode::TooLarge => "TOOLARGE",
            ErrorCode::WrongType => "WRONGTYPE",
            ErrorCode::Corrupt => "CORRUPT",
            ErrorCode::NoPerm => "NOPERM",
            ErrorCode::Oom => "OOM",
            ErrorCode::Internal => "INTERNAL",
        }
    }

    /// The code of an error reply's text (`"STALE token is ..."`), if it is
    /// one of the module's. `NOPERM`, `OOM` and `WRONGTYPE` are also Redis' own.
    pub fn from_reply(text: &str) -> Option<ErrorCode> {
        text.split_whitespace().next()?.parse().ok()
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ErrorCode {
    type Err = ();

    fn from_str(s: &str) -> Result<Self, ()> {
        ErrorCode::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_round_trips() {
        for c in ErrorCode::ALL {
            assert_eq!(c.as_str().parse(), Ok(c));
            assert_eq!(ErrorCode::from_reply(&format!("{c} details")), Some(c));
        }
        assert_eq!(ErrorCode::from_reply("ERR unknown command"), None);
    }
}
