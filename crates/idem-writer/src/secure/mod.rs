//! Connecting safely, for every Rust part of idem (the writer, the CLI, the
//! example API): Postgres with libpq's `sslmode`, `sslrootcert`, `sslcert`
//! and `sslkey` ([`PgTarget`]); Redis over `rediss://` with an explicit CA
//! or client certificate ([`RedisTls`]); URLs with their password masked
//! for anything printed ([`redact_url`]); and secrets read from a file
//! ([`read_secret_file`]). docs/security.md describes the settings.
//!
//! Both TLS stacks are rustls with the ring provider: redis-rs' own
//! `tls-rustls` and `tokio-postgres-rustls`, so the process has one crypto
//! provider and no OpenSSL.

mod postgres_tls;
mod redact;
mod redis_tls;

pub use postgres_tls::{is_tls_configuration_error, PgTarget, SslMode};
pub use redact::redact_url;
pub use redis_tls::RedisTls;

use crate::error::{Error, Result};

/// Installs ring as the process's rustls provider (redis-rs builds its TLS
/// settings with the process default); a provider already installed stays.
pub(crate) fn install_crypto_provider() {
    let _ = provider().install_default();
}

/// The rustls provider: ring. It builds from crates.io with a C compiler
/// alone (aws-lc-rs needs more of the build host); rustls 0.23.48 marks it
/// deprecated because it offers no post-quantum key exchange, which
/// docs/security.md states.
#[allow(deprecated)]
pub(crate) fn provider() -> rustls::crypto::CryptoProvider {
    rustls::crypto::ring::default_provider()
}

/// A secret kept in a file (a URL with its password, mounted by the
/// orchestrator): its text without the trailing line break.
pub fn read_secret_file(path: &std::path::Path) -> Result<String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::Config(format!("read the secret file {}: {e}", path.display())))?;
    let text = text.trim_end_matches(['\n', '\r']).to_string();
    if text.is_empty() {
        return Err(Error::Config(format!(
            "the secret file {} is empty",
            path.display()
        )));
    }
    Ok(text)
}

/// The value of a setting given either directly (a flag or the variable
/// `name`) or through a file (`name_FILE`); both at once is an error, so a
/// forgotten variable cannot silently win over the file.
pub fn value_or_file(
    value: Option<String>,
    file: Option<&std::path::Path>,
    name: &str,
) -> Result<Option<String>> {
    match (value, file) {
        (Some(_), Some(_)) => Err(Error::Config(format!(
            "{name} is given both directly and as {name}_FILE; give one"
        ))),
        (Some(value), None) => Ok(Some(value)),
        (None, Some(path)) => read_secret_file(path).map(Some),
        (None, None) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_files_lose_their_line_break_and_must_not_be_empty() {
        let dir = std::env::temp_dir().join(format!("idem-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("url");
        std::fs::write(&file, "redis://:pw@h:1/0\n").unwrap();
        assert_eq!(read_secret_file(&file).unwrap(), "redis://:pw@h:1/0");
        assert_eq!(
            value_or_file(None, Some(&file), "REDIS_URL").unwrap(),
            Some("redis://:pw@h:1/0".to_string())
        );
        assert!(value_or_file(Some("x".into()), Some(&file), "REDIS_URL").is_err());
        std::fs::write(&file, "\n").unwrap();
        assert!(read_secret_file(&file).is_err());
        let missing = read_secret_file(&dir.join("missing")).unwrap_err();
        assert!(missing.to_string().contains("missing"), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
