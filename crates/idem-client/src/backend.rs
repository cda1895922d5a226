//! Which of idem's implementations a client calls: the module's `IDEM.*`
//! commands, or, where Redis is managed and refuses `MODULE LOAD`, the
//! Functions library (`functions/idem.lua`, `spec/functions.json`) through
//! `FCALL`, or its scripts form through `EVALSHA` where there is no
//! `FUNCTION` (Redis 6). The client loads the library itself: at
//! construction when it is missing or older, and again when a call finds it
//! gone (a restart without persistence, a failover, `FUNCTION FLUSH`).

use std::sync::Arc;
use std::time::Duration;

use idem_core::args::Head;
use idem_core::functions;
use redis::aio::ConnectionLike;
use redis::Value;

use crate::call::bounded;
use crate::IdemError;

/// The library's source, as `FUNCTION LOAD` takes it (`#!lua name=idem`
/// first).
pub const LIBRARY_SOURCE: &str = include_str!("../../../functions/idem.lua");

/// Which implementation the client calls (`IdemClient::standalone_using`,
/// `cluster_using`, `resolve_backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// The module where `IDEM.BEGIN` exists, else the Functions library,
    /// else its scripts form: whichever the server allows, in that order.
    #[default]
    Auto,
    /// The module's `IDEM.*` commands (`MODULE LOAD`).
    Module,
    /// The Functions library (`FCALL`; Redis 7 and later).
    Functions,
    /// The library's scripts form (`EVALSHA`; Redis 6, no `FUNCTION`).
    Scripts,
}

impl Backend {
    /// `auto`, `module`, `functions` or `scripts`.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Auto => "auto",
            Backend::Module => "module",
            Backend::Functions => "functions",
            Backend::Scripts => "scripts",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Backend {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Backend::Auto),
            "module" => Ok(Backend::Module),
            "functions" => Ok(Backend::Functions),
            "scripts" => Ok(Backend::Scripts),
            other => Err(format!(
                "unknown backend {other:?}: one of auto, module, functions, scripts"
            )),
        }
    }
}

/// The backend a client settled on (never `Auto`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Resolved {
    Module,
    Functions,
    /// The SHA1 (hex) of the scripts form.
    Scripts(Arc<str>),
}

impl Resolved {
    pub(crate) fn backend(&self) -> Backend {
        match self {
            Resolved::Module => Backend::Module,
            Resolved::Functions => Backend::Functions,
            Resolved::Scripts(_) => Backend::Scripts,
        }
    }

    pub(crate) fn head(&self) -> Head<'_> {
        match self {
            Resolved::Module => Head::Module,
            Resolved::Functions => Head::Function,
            Resolved::Scripts(sha) => Head::Script(sha),
        }
    }

    /// Whether `BEGIN ... WAIT` blocks on the server (the module) rather
    /// than being polled for (the library answers at once).
    pub(crate) fn blocks(&self) -> bool {
        matches!(self, Resolved::Module)
    }
}

/// The scripts form: the source without its first line (the shebang).
pub fn script_source() -> &'static str {
    match LIBRARY_SOURCE.split_once('\n') {
        Some((first, rest)) if first.starts_with("#!") => rest,
        _ => LIBRARY_SOURCE,
    }
}

/// The SHA1 (hex) `EVALSHA` names the scripts form by.
pub fn script_sha() -> String {
    redis::Script::new(script_source()).get_hash().to_string()
}

/// Whether `error` says the library is not on the node that answered:
/// `ERR Function not found` or `NOSCRIPT`.
pub(crate) fn library_missing(error: &IdemError) -> bool {
    let IdemError::Redis(error) = error else {
        return false;
    };
    match error.code() {
        Some("NOSCRIPT") => true,
        Some("ERR") => error
            .detail()
            .is_some_and(|detail| detail.starts_with("Function not found")),
        _ => false,
    }
}

/// One command, bounded; an error reply is an error.
async fn ask<C: ConnectionLike + Clone>(
    conn: &C,
    cmd: &redis::Cmd,
    timeout: Duration,
) -> Result<Value, IdemError> {
    let mut conn = conn.clone();
    let value = bounded(timeout, conn.req_packed_command(cmd)).await?;
    value.extract_error().map_err(IdemError::from)
}

/// Settles `wanted` against the server behind `conn`, loading the library
/// where it is chosen. Fails when nothing of idem can run there, saying
/// what to do.
pub(crate) async fn resolve<C: ConnectionLike + Clone>(
    conn: &C,
    wanted: Backend,
    timeout: Duration,
) -> Result<Resolved, IdemError> {
    match wanted {
        Backend::Module => match has_module(conn, timeout).await? {
            true => Ok(Resolved::Module),
            false => Err(not_installed(&[(
                "module",
                "IDEM.BEGIN does not exist (the module is not loaded)".into(),
            )])),
        },
        Backend::Functions => match ensure_functions(conn, timeout).await {
            Ok(()) => Ok(Resolved::Functions),
            Err(error) if error.is_unavailable() => Err(error),
            Err(error) => Err(not_installed(&[("functions", error.to_string())])),
        },
        Backend::Scripts => match load_script(conn, timeout).await {
            Ok(sha) => Ok(Resolved::Scripts(sha.into())),
            Err(error) if error.is_unavailable() => Err(error),
            Err(error) => Err(not_installed(&[("scripts", error.to_string())])),
        },
        Backend::Auto => {
            if has_module(conn, timeout).await? {
                return Ok(Resolved::Module);
            }
            let mut refused = vec![(
                "module",
                "IDEM.BEGIN does not exist (the module is not loaded)".to_string(),
            )];
            match ensure_functions(conn, timeout).await {
                Ok(()) => return Ok(Resolved::Functions),
                Err(error) if error.is_unavailable() => return Err(error),
                Err(error) => refused.push(("functions", error.to_string())),
            }
            match load_script(conn, timeout).await {
                Ok(sha) => Ok(Resolved::Scripts(sha.into())),
                Err(error) if error.is_unavailable() => Err(error),
                Err(error) => {
                    refused.push(("scripts", error.to_string()));
                    Err(not_installed(&refused))
                }
            }
        }
    }
}

/// The error of a server where idem cannot run: each way tried and why it
/// failed, and what to do.
fn not_installed(refused: &[(&str, String)]) -> IdemError {
    let tried: Vec<String> = refused
        .iter()
        .map(|(backend, why)| format!("{backend}: {why}"))
        .collect();
    IdemError::NotInstalled(format!(
        "{}; load the idem module (MODULE LOAD / --loadmodule), or let this \
         connection's user run FUNCTION LOAD and FCALL (Redis 7), or SCRIPT \
         LOAD and EVALSHA (Redis 6)",
        tried.join("; ")
    ))
}

/// Whether the module's `IDEM.BEGIN` exists (`COMMAND INFO` answers an
/// entry for it). A refused `COMMAND` (ACL) counts as no module.
async fn has_module<C: ConnectionLike + Clone>(
    conn: &C,
    timeout: Duration,
) -> Result<bool, IdemError> {
    let mut cmd = redis::cmd("COMMAND");
    cmd.arg("INFO").arg(idem_core::args::name::BEGIN);
    match ask(conn, &cmd, timeout).await {
        Ok(Value::Array(entries)) => Ok(entries.iter().any(|e| !matches!(e, Value::Nil))),
        Ok(_) => Ok(false),
        Err(error) if error.is_unavailable() => Err(error),
        Err(error) => {
            tracing::debug!(%error, "COMMAND INFO refused: taking the module as absent");
            Ok(false)
        }
    }
}

/// The library's version on the server (`idem_version`), `None` when it is
/// not loaded.
async fn library_version<C: ConnectionLike + Clone>(
    conn: &C,
    timeout: Duration,
) -> Result<Option<i64>, IdemError> {
    let mut cmd = redis::cmd("FCALL");
    cmd.arg(functions::VERSION_FN).arg(0);
    match ask(conn, &cmd, timeout).await {
        Ok(Value::Int(version)) => Ok(Some(version)),
        Ok(other) => Err(IdemError::UnexpectedReply(format!(
            "{} answered {other:?}",
            functions::VERSION_FN
        ))),
        Err(error) if library_missing(&error) => Ok(None),
        Err(error) => Err(error),
    }
}

/// Loads the library unless this version or a newer one is there.
pub(crate) async fn ensure_functions<C: ConnectionLike + Clone>(
    conn: &C,
    timeout: Duration,
) -> Result<(), IdemError> {
    match library_version(conn, timeout).await? {
        Some(version) if version >= functions::VERSION as i64 => Ok(()),
        _ => load_functions(conn, timeout).await,
    }
}

/// `FUNCTION LOAD REPLACE` (on a cluster, redis-rs sends it to every
/// primary).
pub(crate) async fn load_functions<C: ConnectionLike + Clone>(
    conn: &C,
    timeout: Duration,
) -> Result<(), IdemError> {
    let mut cmd = redis::cmd("FUNCTION");
    cmd.arg("LOAD").arg("REPLACE").arg(LIBRARY_SOURCE);
    ask(conn, &cmd, timeout).await?;
    tracing::info!(
        library = functions::LIBRARY,
        version = functions::VERSION,
        "loaded the idem Functions library"
    );
    Ok(())
}

/// `SCRIPT LOAD` of the scripts form; its SHA1 as the server computed it.
pub(crate) async fn load_script<C: ConnectionLike + Clone>(
    conn: &C,
    timeout: Duration,
) -> Result<String, IdemError> {
    let mut cmd = redis::cmd("SCRIPT");
    cmd.arg("LOAD").arg(script_source());
    let sha = match ask(conn, &cmd, timeout).await? {
        Value::BulkString(sha) => String::from_utf8(sha).ok(),
        Value::SimpleString(sha) => Some(sha),
        _ => None,
    };
    let expected = script_sha();
    match sha {
        Some(sha) if sha.eq_ignore_ascii_case(&expected) => Ok(expected),
        other => Err(IdemError::UnexpectedReply(format!(
            "SCRIPT LOAD answered {other:?}, not {expected}"
        ))),
    }
}

/// Loads the library again after a call found it missing.
pub(crate) async fn reload<C: ConnectionLike + Clone>(
    conn: &C,
    backend: &Resolved,
    timeout: Duration,
) -> Result<(), IdemError> {
    tracing::warn!(backend = %backend.backend(), "the idem library is missing on the server: loading it again");
    match backend {
        Resolved::Module => Ok(()),
        Resolved::Functions => load_functions(conn, timeout).await,
        Resolved::Scripts(_) => load_script(conn, timeout).await.map(drop),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backends_parse_and_print() {
        for backend in [
            Backend::Auto,
            Backend::Module,
            Backend::Functions,
            Backend::Scripts,
        ] {
            assert_eq!(backend.as_str().parse::<Backend>(), Ok(backend));
        }
        assert_eq!(" Functions ".parse::<Backend>(), Ok(Backend::Functions));
        assert!("lua".parse::<Backend>().is_err());
    }

    #[test]
    fn the_scripts_form_drops_the_shebang() {
        assert!(LIBRARY_SOURCE.starts_with("#!lua"));
        assert!(!script_source().starts_with("#!"));
        assert_eq!(script_sha().len(), 40);
    }
}
