//! [`PgTarget`]: a Postgres URL or `key=value` string read the way libpq
//! reads it, TLS settings included, and the connector they make.
//!
//! tokio-postgres knows `sslmode` `disable`, `prefer` and `require` only,
//! and no `sslrootcert`, `sslcert` or `sslkey`; those are taken out of the
//! string here (and from `PGSSLMODE`, `PGSSLROOTCERT`, `PGSSLCERT`,
//! `PGSSLKEY` when the string does not set them, as libpq does) before
//! tokio-postgres parses the rest. The connector is rustls (ring):
//!
//! | `sslmode` | TLS | certificate checked |
//! |---|---|---|
//! | `disable` | never | - |
//! | `allow`, `prefer` (default) | when the server offers it | against `sslrootcert` when there is one, else not |
//! | `require` | always | against `sslrootcert` when there is one (libpq's compatibility rule), else not |
//! | `verify-ca` | always | chain against `sslrootcert` |
//! | `verify-full` | always | chain and host name against `sslrootcert` |
//!
//! `allow` tries TLS first, like `prefer` (libpq tries plaintext first).
//! `sslrootcert=system` trusts the platform's store (honouring
//! `SSL_CERT_FILE` and `SSL_CERT_DIR`) and implies `verify-full`. Without
//! `sslrootcert`, libpq's `~/.postgresql/root.crt` is used when it exists;
//! likewise `~/.postgresql/postgresql.crt` and `.key` for the client
//! certificate. A certificate file that cannot be read, an unknown
//! `sslmode`, a server refusing TLS under `require`, or a certificate that
//! does not verify is a configuration error ([`Error::Config`]): never
//! retried as an outage, never downgraded to plaintext.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::error::{Cause, Error, Result};

/// libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SslMode {
    /// Plaintext only.
    Disable,
    /// TLS when the server offers it (idem tries TLS first, as `prefer`).
    Allow,
    /// TLS when the server offers it (libpq's default).
    Prefer,
    /// TLS or nothing; the certificate is checked only against an
    /// `sslrootcert` given.
    Require,
    /// TLS, the certificate chain checked against `sslrootcert`.
    VerifyCa,
    /// TLS, the chain and the host name checked against `sslrootcert`.
    VerifyFull,
}

impl SslMode {
    /// The mode `value` names; anything else is a configuration error.
    pub fn parse(value: &str) -> Result<SslMode> {
        Ok(match value {
            "disable" => SslMode::Disable,
            "allow" => SslMode::Allow,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(Error::Config(format!(
                    "invalid sslmode {other:?}: use disable, allow, prefer, require, verify-ca \
                     or verify-full"
                )))
            }
        })
    }

    /// Its name in a connection string.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Allow => "allow",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The settings taken out of the string for the TLS connector.
const TLS_KEYS: [&str; 5] = ["sslmode", "sslrootcert", "sslcert", "sslkey", "sslpassword"];

/// A Postgres database to connect to: tokio-postgres' settings, the
/// `sslmode`, and the TLS connector built from the certificate settings.
/// Cheap to clone.
#[derive(Clone)]
pub struct PgTarget {
    config: tokio_postgres::Config,
    mode: SslMode,
    tls: MakeRustlsConnect,
}

impl fmt::Debug for PgTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // tokio-postgres' Config debug masks the password.
        f.debug_struct("PgTarget")
            .field("config", &self.config)
            .field("sslmode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl PgTarget {
    /// Reads a `postgres://` URL or a `key=value` string (libpq's
    /// `PGSSL*` variables filling in TLS settings it does not give) and
    /// loads the certificates it names.
    pub fn parse(database_url: &str) -> Result<PgTarget> {
        PgTarget::parse_with_env(database_url, |name| std::env::var(name).ok())
    }

    /// `parse` with the environment read through `env`.
    fn parse_with_env(
        database_url: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<PgTarget> {
        super::install_crypto_provider();
        let (rest, tls_params) = split_tls_params(database_url)?;
        let param = |key: &str, var: &str| {
            tls_params
                .iter()
                .rev()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.clone())
                .or_else(|| env(var).filter(|v| !v.is_empty()))
        };
        if param("sslpassword", "PGSSLPASSWORD").is_some() {
            return Err(Error::Config(
                "sslpassword (an encrypted client key) is not supported: give an unencrypted \
                 sslkey, readable by this user only"
                    .into(),
            ));
        }
        let root = param("sslrootcert", "PGSSLROOTCERT");
        let mode = match param("sslmode", "PGSSLMODE") {
            Some(mode) => SslMode::parse(&mode)?,
            None if root.as_deref() == Some("system") => SslMode::VerifyFull,
            None => SslMode::Prefer,
        };
        let mut config: tokio_postgres::Config = rest
            .parse()
            .map_err(|e| Error::Config(format!("invalid database URL: {e}")))?;
        config.ssl_mode(match mode {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Allow | SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
                tokio_postgres::config::SslMode::Require
            }
        });
        let home = env("HOME").map(PathBuf::from);
        let default_file = |name: &str| {
            home.as_ref()
                .map(|home| home.join(".postgresql").join(name))
                .filter(|path| path.exists())
        };
        let tls = if mode == SslMode::Disable {
            client_config(Verify::Nothing, None)?
        } else {
            let roots = match root.as_deref() {
                Some("system") if mode != SslMode::VerifyFull => {
                    return Err(Error::Config(format!(
                        "sslrootcert=system needs sslmode=verify-full, not {mode}"
                    )))
                }
                Some("system") => Some(system_roots()?),
                Some(path) => Some(roots_from_file(Path::new(path))?),
                None => default_file("root.crt")
                    .map(|path| roots_from_file(&path))
                    .transpose()?,
            };
            let verify = match (mode, roots) {
                (SslMode::VerifyFull, Some(roots)) => Verify::Full(roots),
                (_, Some(roots)) => Verify::Chain(roots),
                (SslMode::VerifyCa | SslMode::VerifyFull, None) => {
                    return Err(Error::Config(format!(
                        "sslmode={mode} needs the CA certificate to check the server against: \
                         set sslrootcert to its file (or sslrootcert=system for the platform's \
                         trusted roots)"
                    )))
                }
                (_, None) => Verify::Nothing,
            };
            let cert = param("sslcert", "PGSSLCERT")
                .map(PathBuf::from)
                .or_else(|| default_file("postgresql.crt"));
            let key = param("sslkey", "PGSSLKEY")
                .map(PathBuf::from)
                .or_else(|| default_file("postgresql.key"));
            let identity = match (cert, key) {
                (Some(cert), Some(key)) => Some(identity(&cert, &key)?),
                (None, None) => None,
                (Some(cert), None) => {
                    return Err(Error::Config(format!(
                        "sslcert {} is given without sslkey",
                        cert.display()
                    )))
                }
                (None, Some(key)) => {
                    return Err(Error::Config(format!(
                        "sslkey {} is given without sslcert",
                        key.display()
                    )))
                }
            };
            client_config(verify, identity)?
        };
        Ok(PgTarget {
            config,
            mode,
            tls: MakeRustlsConnect::new(tls),
        })
    }

    /// tokio-postgres' settings (everything but the TLS ones).
    pub fn config(&self) -> &tokio_postgres::Config {
        &self.config
    }

    /// The settings to adjust (timeouts, application name).
    pub fn config_mut(&mut self) -> &mut tokio_postgres::Config {
        &mut self.config
    }

    /// The `sslmode` in force.
    pub fn ssl_mode(&self) -> SslMode {
        self.mode
    }

    /// The TLS connector, for `tokio_postgres::Config::connect` or a
    /// deadpool `Manager`.
    pub fn tls(&self) -> MakeRustlsConnect {
        self.tls.clone()
    }

    /// A client, its connection driven on a task. A TLS failure that is
    /// the configuration's ([`is_tls_configuration_error`]) is an
    /// [`Error::Config`]; other failures are [`Error::Postgres`].
    pub async fn connect(&self) -> Result<tokio_postgres::Client> {
        let (client, connection) = self
            .config
            .connect(self.tls())
            .await
            .map_err(|e| self.connect_error(e, "connect to Postgres"))?;
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "Postgres connection ended");
            }
        });
        Ok(client)
    }

    /// `error` from connecting, told `context`: a configuration error when
    /// TLS failed for the configuration's sake.
    pub fn connect_error(&self, error: tokio_postgres::Error, context: &str) -> Error {
        if is_tls_configuration_error(&error) {
            let mut text = format!("{context} (sslmode={}): {error}", self.mode);
            let mut source = std::error::Error::source(&error);
            while let Some(cause) = source {
                text.push_str(": ");
                text.push_str(&cause.to_string());
                source = cause.source();
            }
            Error::Config(text)
        } else {
            error.within(context.to_string())
        }
    }
}

/// Whether a failed connection failed because of the TLS configuration (a
/// server refusing TLS under `require`, a certificate that does not
/// verify, a certificate the server refuses) rather than the network: such
/// a failure does not go away by retrying.
pub fn is_tls_configuration_error(error: &tokio_postgres::Error) -> bool {
    if !error
        .to_string()
        .starts_with("error performing TLS handshake")
    {
        return false;
    }
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        if cause.is::<rustls::Error>() {
            return true;
        }
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            if io
                .get_ref()
                .is_some_and(|inner| inner.is::<rustls::Error>())
            {
                return true;
            }
            // The connection broke during the handshake: the network's.
            return false;
        }
        if cause.to_string().contains("does not support TLS")
            || cause.to_string().contains("no hostname")
        {
            return true;
        }
        source = cause.source();
    }
    false
}

/// What the server's certificate is checked for.
enum Verify {
    Nothing,
    Chain(RootCertStore),
    Full(RootCertStore),
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(super::provider())
}

fn client_config(
    verify: Verify,
    identity: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
) -> Result<ClientConfig> {
    let provider = provider();
    let verifier: Arc<dyn ServerCertVerifier> = match verify {
        Verify::Nothing => Arc::new(AnyCertificate(provider.clone())),
        Verify::Chain(roots) => Arc::new(ChainOnly(webpki(roots, &provider)?)),
        Verify::Full(roots) => webpki(roots, &provider)?,
    };
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Config(format!("TLS settings: {e}")))?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    match identity {
        Some((certs, key)) => builder
            .with_client_auth_cert(certs, key)
            .map_err(|e| Error::Config(format!("the client certificate (sslcert, sslkey): {e}"))),
        None => Ok(builder.with_no_client_auth()),
    }
}

fn webpki(
    roots: RootCertStore,
    provider: &Arc<CryptoProvider>,
) -> Result<Arc<WebPkiServerVerifier>> {
    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| Error::Config(format!("TLS certificate verifier: {e}")))
}

/// The CA certificates of a PEM file; none, or one that is not a
/// certificate, is a configuration error.
fn roots_from_file(path: &Path) -> Result<RootCertStore> {
    let bad = |e: &dyn fmt::Display| Error::Config(format!("sslrootcert {}: {e}", path.display()));
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(path).map_err(|e| bad(&e))? {
        roots.add(cert.map_err(|e| bad(&e))?).map_err(|e| bad(&e))?;
    }
    if roots.is_empty() {
        return Err(bad(&"no certificate in the file"));
    }
    Ok(roots)
}

/// The platform's trusted roots (`SSL_CERT_FILE`, `SSL_CERT_DIR` or the
/// system store).
fn system_roots() -> Result<RootCertStore> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        let why = found
            .errors
            .first()
            .map_or_else(|| "none found".to_string(), ToString::to_string);
        return Err(Error::Config(format!(
            "sslrootcert=system: no trusted root certificates could be loaded ({why})"
        )));
    }
    Ok(roots)
}

/// The client certificate chain and its key.
fn identity(
    cert: &Path,
    key: &Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)> {
    let certs = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<std::result::Result<Vec<_>, _>>())
        .map_err(|e| Error::Config(format!("sslcert {}: {e}", cert.display())))?;
    if certs.is_empty() {
        return Err(Error::Config(format!(
            "sslcert {}: no certificate in the file",
            cert.display()
        )));
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| Error::Config(format!("sslkey {}: {e}", key.display())))?;
    Ok((certs, key))
}

/// `prefer`, `require` without a CA: the connection is encrypted, the
/// server's identity is not checked (libpq's behaviour). The handshake's
/// signatures are still verified.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca`: the chain must lead to a trusted root; the host name is
/// not compared.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        // webpki checks the chain first and the name last: a name error
        // means the chain verified.
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// The string without its TLS settings, and those settings (decoded), in
/// order. A `postgres://` URL's query parameters or a `key=value` string's
/// pairs.
fn split_tls_params(database_url: &str) -> Result<(String, Vec<(String, String)>)> {
    let is_tls_key = |key: &str| TLS_KEYS.contains(&key);
    if database_url.starts_with("postgres://") || database_url.starts_with("postgresql://") {
        let Some((base, query)) = database_url.split_once('?') else {
            return Ok((database_url.to_string(), Vec::new()));
        };
        let mut kept = Vec::new();
        let mut taken = Vec::new();
        for param in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = param.split_once('=').unwrap_or((param, ""));
            let key_decoded = percent_decode(key);
            if is_tls_key(&key_decoded) {
                taken.push((key_decoded, percent_decode(value)));
            } else {
                kept.push(param);
            }
        }
        let rest = if kept.is_empty() {
            base.to_string()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        return Ok((rest, taken));
    }
    let mut kept = Vec::new();
    let mut taken = Vec::new();
    for (key, value) in conninfo_pairs(database_url)? {
        if is_tls_key(&key) {
            taken.push((key, value));
        } else {
            kept.push(format!(
                "{key}='{}'",
                value.replace('\\', "\\\\").replace('\'', "\\'")
            ));
        }
    }
    Ok((kept.join(" "), taken))
}

/// The pairs of a libpq `key=value` string (values unquoted).
fn conninfo_pairs(conninfo: &str) -> Result<Vec<(String, String)>> {
    let invalid = |why: &str| Error::Config(format!("invalid database connection string: {why}"));
    let mut pairs = Vec::new();
    let mut chars = conninfo.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            return Ok(pairs);
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') {
            return Err(invalid(&format!("{key:?} is not followed by \"=\"")));
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            loop {
                match chars.next() {
                    Some('\\') => {
                        value.push(chars.next().ok_or_else(|| invalid("unterminated quote"))?)
                    }
                    Some('\'') => break,
                    Some(c) => value.push(c),
                    None => return Err(invalid("unterminated quote")),
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    if let Some(escaped) = chars.next() {
                        value.push(escaped);
                    }
                } else {
                    value.push(c);
                }
            }
        }
        pairs.push((key, value));
    }
}

/// `%XX` sequences decoded (a URL's query parameter).
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    let hex = |b: u8| (b as char).to_digit(16);
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(high), Some(low)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push((high * 16 + low) as u8);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn tls_settings_are_taken_out_of_urls_and_conninfo() {
        let (rest, taken) = split_tls_params(
            "postgres://u:p@db:5432/idem?sslmode=verify-full&application_name=x&sslrootcert=%2Fetc%2Fca.pem",
        )
        .unwrap();
        assert_eq!(rest, "postgres://u:p@db:5432/idem?application_name=x");
        assert_eq!(
            taken,
            vec![
                ("sslmode".to_string(), "verify-full".to_string()),
                ("sslrootcert".to_string(), "/etc/ca.pem".to_string())
            ]
        );
        let (rest, taken) = split_tls_params("postgres://db/idem?sslmode=require").unwrap();
        assert_eq!(rest, "postgres://db/idem");
        assert_eq!(taken.len(), 1);
        let (rest, taken) = split_tls_params(
            "host=db user=u password='a \\' b' sslmode = verify-ca sslrootcert='/c a.pem'",
        )
        .unwrap();
        assert_eq!(rest, "host='db' user='u' password='a \\' b'");
        assert_eq!(
            taken,
            vec![
                ("sslmode".to_string(), "verify-ca".to_string()),
                ("sslrootcert".to_string(), "/c a.pem".to_string())
            ]
        );
        let config: tokio_postgres::Config = rest.parse().unwrap();
        assert_eq!(config.get_password(), Some("a ' b".as_bytes()));
        assert!(split_tls_params("host=db user").is_err());
        assert!(split_tls_params("host='db").is_err());
    }

    #[test]
    fn sslmodes_and_their_requirements() {
        let parse = |url: &str| PgTarget::parse_with_env(url, no_env);
        assert_eq!(
            parse("postgres://db/x").unwrap().ssl_mode(),
            SslMode::Prefer
        );
        for mode in ["disable", "allow", "prefer", "require"] {
            let target = parse(&format!("postgres://db/x?sslmode={mode}")).unwrap();
            assert_eq!(target.ssl_mode().as_str(), mode);
        }
        let bogus = parse("postgres://db/x?sslmode=verify").unwrap_err();
        assert!(matches!(bogus, Error::Config(_)));
        assert!(bogus.to_string().contains("invalid sslmode"), "{bogus}");
        for mode in ["verify-ca", "verify-full"] {
            let missing = parse(&format!("postgres://db/x?sslmode={mode}")).unwrap_err();
            assert!(matches!(missing, Error::Config(_)));
            assert!(missing.to_string().contains("sslrootcert"), "{missing}");
        }
        let unreadable =
            parse("postgres://db/x?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem")
                .unwrap_err();
        assert!(matches!(unreadable, Error::Config(_)));
        assert!(
            unreadable.to_string().contains("/nonexistent/ca.pem"),
            "{unreadable}"
        );
        let weak_system = parse("postgres://db/x?sslmode=require&sslrootcert=system").unwrap_err();
        assert!(
            weak_system.to_string().contains("verify-full"),
            "{weak_system}"
        );
        let encrypted = parse("postgres://db/x?sslpassword=k").unwrap_err();
        assert!(encrypted.to_string().contains("sslpassword"), "{encrypted}");
        let half = parse("postgres://db/x?sslmode=require&sslcert=/tmp/c.pem").unwrap_err();
        assert!(half.to_string().contains("without sslkey"), "{half}");
    }

    #[test]
    fn pgssl_variables_fill_in_what_the_url_does_not_say() {
        let env = |name: &str| (name == "PGSSLMODE").then(|| "disable".to_string());
        let target = PgTarget::parse_with_env("postgres://db/x", env).unwrap();
        assert_eq!(target.ssl_mode(), SslMode::Disable);
        let target = PgTarget::parse_with_env("postgres://db/x?sslmode=require", env).unwrap();
        assert_eq!(target.ssl_mode(), SslMode::Require);
        let bad = |name: &str| (name == "PGSSLMODE").then(|| "sometimes".to_string());
        assert!(PgTarget::parse_with_env("postgres://db/x", bad).is_err());
    }

    #[test]
    fn percent_decoding() {
        assert_eq!(percent_decode("%2Fa%20b"), "/a b");
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz"), "%zz");
    }
}
