//! [`RedisTls`]: the CA and client certificate for `rediss://` URLs.

use std::path::{Path, PathBuf};

use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo};

use crate::error::{Error, Result};

/// Certificates for `rediss://` connections beyond redis-rs' defaults.
///
/// A `rediss://` URL alone verifies the server's certificate and host name
/// against the platform's trusted roots (rustls-native-certs: the system
/// store, or `SSL_CERT_FILE` / `SSL_CERT_DIR` when set). `ca_cert` trusts
/// that CA instead (a private CA, as a self-hosted Redis has); `client_cert`
/// and `client_key` are presented to a server that asks for one
/// (`tls-auth-clients yes`). A `rediss://host/#insecure` URL (no
/// verification) is refused.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RedisTls {
    /// PEM file of the CA certificates to trust instead of the platform's.
    pub ca_cert: Option<PathBuf>,
    /// PEM file of the client certificate (chain).
    pub client_cert: Option<PathBuf>,
    /// PEM file of the client certificate's private key.
    pub client_key: Option<PathBuf>,
}

impl RedisTls {
    /// From `REDIS_CA_CERT`, `REDIS_CLIENT_CERT` and `REDIS_CLIENT_KEY`
    /// (file paths; unset or empty is none).
    pub fn from_env() -> RedisTls {
        let path = |name: &str| {
            std::env::var_os(name)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        RedisTls {
            ca_cert: path("REDIS_CA_CERT"),
            client_cert: path("REDIS_CLIENT_CERT"),
            client_key: path("REDIS_CLIENT_KEY"),
        }
    }

    /// Whether nothing is set (redis-rs' defaults).
    pub fn is_default(&self) -> bool {
        self == &RedisTls::default()
    }

    /// A Redis URL's connection settings, with these certificates when it
    /// is a `rediss://` URL. Certificates given for a URL without TLS, a
    /// file that cannot be read or parsed, or `#insecure` are configuration
    /// errors.
    pub fn connection_info(&self, url: &str) -> Result<ConnectionInfo> {
        let info = url.into_connection_info().map_err(|e| {
            Error::Config(format!("invalid Redis URL {}: {e}", super::redact_url(url)))
        })?;
        self.apply(info)
            .map_err(|e| Error::Config(format!("Redis URL {}: {e}", super::redact_url(url))))
    }

    /// A redis-rs client for `url` (see [`RedisTls::connection_info`]).
    pub fn client(&self, url: &str) -> Result<redis::Client> {
        let info = self.connection_info(url)?;
        redis::Client::open(info).map_err(|e| Error::Config(format!("Redis client: {e}")))
    }

    /// `info` with these certificates.
    pub fn apply(&self, info: ConnectionInfo) -> Result<ConnectionInfo> {
        super::install_crypto_provider();
        let tls = match info.addr() {
            ConnectionAddr::TcpTls { insecure: true, .. } => {
                return Err(Error::Config(
                    "#insecure (no certificate verification) is not allowed; give the CA with \
                     REDIS_CA_CERT instead"
                        .into(),
                ))
            }
            ConnectionAddr::TcpTls { .. } => true,
            _ => false,
        };
        if self.is_default() {
            return Ok(info);
        }
        if !tls {
            return Err(Error::Config(
                "TLS certificates are set (REDIS_CA_CERT, REDIS_CLIENT_CERT, REDIS_CLIENT_KEY) \
                 but the URL is not rediss://"
                    .into(),
            ));
        }
        let read = |path: &Path, what: &str| {
            std::fs::read(path)
                .map_err(|e| Error::Config(format!("{what} {}: {e}", path.display())))
        };
        let client_tls = match (&self.client_cert, &self.client_key) {
            (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
                client_cert: read(cert, "REDIS_CLIENT_CERT")?,
                client_key: read(key, "REDIS_CLIENT_KEY")?,
            }),
            (None, None) => None,
            _ => {
                return Err(Error::Config(
                    "REDIS_CLIENT_CERT and REDIS_CLIENT_KEY go together".into(),
                ))
            }
        };
        let root_cert = match &self.ca_cert {
            Some(path) => {
                let pem = read(path, "REDIS_CA_CERT")?;
                if !String::from_utf8_lossy(&pem).contains("-----BEGIN CERTIFICATE-----") {
                    return Err(Error::Config(format!(
                        "REDIS_CA_CERT {}: no PEM certificate in the file",
                        path.display()
                    )));
                }
                Some(pem)
            }
            None => None,
        };
        let certificates = redis::TlsCertificates {
            client_tls,
            root_cert,
        };
        let client = redis::Client::build_with_tls(info, certificates)
            .map_err(|e| Error::Config(format!("TLS certificates: {e}")))?;
        Ok(client.get_connection_info().clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certificates_need_rediss_and_readable_files() {
        let none = RedisTls::default();
        assert!(none.connection_info("redis://h:1/0").is_ok());
        assert!(none.connection_info("rediss://h:1/0").is_ok());
        let insecure = none
            .connection_info("rediss://:pw@h:1/0#insecure")
            .unwrap_err();
        assert!(insecure.to_string().contains("#insecure"), "{insecure}");
        assert!(!insecure.to_string().contains("pw@"), "{insecure}");
        let ca = RedisTls {
            ca_cert: Some("/nonexistent/ca.pem".into()),
            ..RedisTls::default()
        };
        let plain = ca.connection_info("redis://:pw@h:1/0").unwrap_err();
        assert!(plain.to_string().contains("not rediss://"), "{plain}");
        assert!(!plain.to_string().contains("pw@"), "{plain}");
        let missing = ca.connection_info("rediss://h:1/0").unwrap_err();
        assert!(
            missing.to_string().contains("/nonexistent/ca.pem"),
            "{missing}"
        );
        let half = RedisTls {
            client_cert: Some("/tmp/c.pem".into()),
            ..RedisTls::default()
        };
        assert!(half.connection_info("rediss://h:1/0").is_err());
        let bad = none.connection_info("http://:pw@h:1/").unwrap_err();
        assert!(!bad.to_string().contains(":pw@"), "{bad}");
    }
}
