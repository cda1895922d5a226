//! The CLI's exit codes and how a failure is reported (stderr as text, or
//! one JSON document on stdout with `--json`). docs/operations/cli.md shows
//! the codes from here (the `// ANCHOR` lines).

use std::process::ExitCode;

use serde_json::json;

// ANCHOR: codes
/// What `idem` exits with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// Done; for `inspect`, the two sides are consistent.
    Ok = 0,
    /// A server could not be reached or answered something unexpected.
    Error = 1,
    /// Bad arguments (clap's own usage errors exit 2 too).
    Usage = 2,
    /// `release` refused: the key is not in flight with that token; nothing
    /// was changed.
    Refused = 3,
    /// The key is in neither Redis nor Postgres.
    NotFound = 4,
    /// `inspect`: Redis and Postgres disagree about the key.
    Disagree = 5,
    /// `remirror`: some records could not be written (listed).
    Incomplete = 6,
}
// ANCHOR_END: codes

impl From<Code> for ExitCode {
    fn from(code: Code) -> ExitCode {
        ExitCode::from(code as u8)
    }
}

/// Why a command did not do its work.
#[derive(Debug)]
pub enum Failure {
    Usage(String),
    /// Refused, with what was found (for the JSON report).
    Refused {
        reason: String,
        found: serde_json::Value,
    },
    NotFound(String),
    Error(anyhow::Error),
}

impl From<anyhow::Error> for Failure {
    fn from(error: anyhow::Error) -> Failure {
        Failure::Error(error)
    }
}

impl Failure {
    fn code(&self) -> Code {
        match self {
            Failure::Usage(_) => Code::Usage,
            Failure::Refused { .. } => Code::Refused,
            Failure::NotFound(_) => Code::NotFound,
            Failure::Error(_) => Code::Error,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Failure::Usage(_) => "usage",
            Failure::Refused { .. } => "refused",
            Failure::NotFound(_) => "not_found",
            Failure::Error(_) => "error",
        }
    }

    fn message(&self) -> String {
        match self {
            Failure::Usage(m) | Failure::NotFound(m) => m.clone(),
            Failure::Refused { reason, .. } => format!("{reason}; nothing was changed"),
            // The whole chain: "connect to Redis at ...: Connection refused".
            Failure::Error(e) => format!("{e:#}"),
        }
    }
}

/// Prints `failure` and answers its exit code.
pub fn report(json: bool, failure: Failure) -> ExitCode {
    if json {
        let mut doc = json!({
            "error": { "kind": failure.kind(), "message": failure.message() }
        });
        if let Failure::Refused { found, .. } = &failure {
            doc["error"]["found"] = found.clone();
        }
        println!("{doc:#}");
    } else {
        eprintln!(
            "idem: {}: {}",
            failure.kind().replace('_', " "),
            failure.message()
        );
    }
    failure.code().into()
}
