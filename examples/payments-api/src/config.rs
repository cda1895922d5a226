//! Settings from the environment: `REDIS_URL` (or `REDIS_URL_FILE`),
//! `DATABASE_URL` (or `DATABASE_URL_FILE`), `PORT`, `READ_THROUGH`,
//! `WAIT_MS`, `LEASE_MS`, `PG_POOL_SIZE`, `PROCESSOR_DELAY_MS`, `FENCE`,
//! `REPLICA_ACK`, `BACKEND`, `API_TOKENS`; for TLS, `REDIS_CA_CERT`, `REDIS_CLIENT_CERT`,
//! `REDIS_CLIENT_KEY` and the database URL's `sslmode` and certificates
//! (docs/security.md).

use std::time::Duration;

use anyhow::{bail, Context};
use idem_client::Backend;

use crate::auth::Tokens;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub redis_url: String,
    pub database_url: String,
    /// The API listens on 127.0.0.1:`port`.
    pub port: u16,
    pub read_through: bool,
    /// Duplicates wait this long for the original's answer (off when `None`).
    pub wait: Option<Duration>,
    pub lease: Duration,
    pub pool_size: usize,
    /// Simulated payment-processor latency per new payment (demo; 0 = none).
    pub processor_delay: Duration,
    /// Commit each new payment with its idempotency row (the fence) (default: on).
    pub fence: bool,
    /// `REPLICA_ACK=REPLICAS:TIMEOUT_MS`: answer a stored response only once
    /// that many replicas acknowledged it within the timeout, else 503
    /// (the layer's `replica_ack`; default: off).
    pub replica_ack: Option<(u32, Duration)>,
    /// `BACKEND=auto|module|functions|scripts`: how idem runs on Redis (the
    /// module, else the Functions library, else its scripts form; default
    /// auto).
    pub backend: Backend,
    /// `API_TOKENS="tok_a=acct_1,tok_b=acct_2"`: the bearer tokens callers
    /// authenticate with and the account each maps to (default: the demo
    /// table `auth::DEMO_TOKENS`, for scripts/up.sh and the conformance
    /// suite; never deploy it).
    pub tokens: Tokens,
}

impl Settings {
    pub fn from_env() -> anyhow::Result<Self> {
        Settings::from_lookup(|name| std::env::var(name).ok())
    }

    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> anyhow::Result<Self> {
        let redis_url =
            secret(&get, "REDIS_URL")?.unwrap_or_else(|| "redis://127.0.0.1:6390/".into());
        let Some(database_url) = secret(&get, "DATABASE_URL")? else {
            bail!("DATABASE_URL is not set (nor DATABASE_URL_FILE)");
        };
        let port = match get("PORT") {
            Some(p) => p
                .parse()
                .with_context(|| format!("PORT={p:?} is not a port"))?,
            None => 8080,
        };
        let read_through = switch(&get, "READ_THROUGH")?;
        let fence = switch(&get, "FENCE")?;
        let wait = millis(&get, "WAIT_MS")?.filter(|w| !w.is_zero());
        let lease = millis(&get, "LEASE_MS")?.unwrap_or(Duration::from_secs(30));
        let pool_size = match get("PG_POOL_SIZE") {
            Some(n) => n.parse().with_context(|| format!("PG_POOL_SIZE={n:?}"))?,
            None => 16,
        };
        let processor_delay = millis(&get, "PROCESSOR_DELAY_MS")?.unwrap_or(Duration::ZERO);
        let replica_ack = match get("REPLICA_ACK") {
            None => None,
            Some(value) => replica_ack(&value)?,
        };
        let backend = match get("BACKEND") {
            None => Backend::Auto,
            Some(value) => value
                .parse()
                .map_err(|err| anyhow::anyhow!("BACKEND={value:?}: {err}"))?,
        };
        let tokens = match get("API_TOKENS") {
            Some(table) => Tokens::parse(&table)?,
            None => Tokens::demo(),
        };
        Ok(Settings {
            backend,
            tokens,
            replica_ack,
            processor_delay,
            redis_url,
            database_url,
            port,
            read_through,
            wait,
            lease,
            pool_size,
            fence,
        })
    }
}

/// A secret given as `name` or in the file `name_FILE` (not both).
fn secret(get: &impl Fn(&str) -> Option<String>, name: &str) -> anyhow::Result<Option<String>> {
    let file = get(&format!("{name}_FILE")).map(std::path::PathBuf::from);
    Ok(idem_writer::secure::value_or_file(
        get(name),
        file.as_deref(),
        name,
    )?)
}

/// An on/off setting, on when unset.
fn switch(get: &impl Fn(&str) -> Option<String>, name: &str) -> anyhow::Result<bool> {
    match get(name).as_deref() {
        None | Some("1" | "true" | "on") => Ok(true),
        Some("0" | "false" | "off") => Ok(false),
        Some(other) => bail!("{name}={other:?}: use on or off"),
    }
}

/// `REPLICAS:TIMEOUT_MS` (both at least 1), or `off`.
fn replica_ack(value: &str) -> anyhow::Result<Option<(u32, Duration)>> {
    if value == "off" {
        return Ok(None);
    }
    let usage = || format!("REPLICA_ACK={value:?}: use REPLICAS:TIMEOUT_MS (e.g. 1:3000) or off");
    let (replicas, ms) = value.split_once(':').with_context(usage)?;
    let replicas: u32 = replicas.parse().with_context(usage)?;
    let ms: u64 = ms.parse().with_context(usage)?;
    if replicas == 0 || ms == 0 {
        bail!("{}: replicas and timeout must be at least 1", usage());
    }
    Ok(Some((replicas, Duration::from_millis(ms))))
}

fn millis(get: &impl Fn(&str) -> Option<String>, name: &str) -> anyhow::Result<Option<Duration>> {
    get(name)
        .map(|v| {
            v.parse::<u64>()
                .map(Duration::from_millis)
                .with_context(|| format!("{name}={v:?} is not a number of milliseconds"))
        })
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn settings(vars: &[(&str, &str)]) -> anyhow::Result<Settings> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Settings::from_lookup(|name| vars.get(name).cloned())
    }

    #[test]
    fn defaults() {
        let s = settings(&[("DATABASE_URL", "postgres://x/db")]).unwrap();
        assert_eq!(s.port, 8080);
        assert_eq!(s.redis_url, "redis://127.0.0.1:6390/");
        assert!(s.read_through);
        assert!(s.fence);
        assert_eq!(s.wait, None);
        assert_eq!(s.replica_ack, None);
        assert_eq!(s.backend, Backend::Auto);
        assert_eq!(s.tokens, Tokens::demo());
    }

    #[test]
    fn backend_is_one_of_four() {
        let with = |value| settings(&[("DATABASE_URL", "x"), ("BACKEND", value)]);
        assert_eq!(with("functions").unwrap().backend, Backend::Functions);
        assert_eq!(with("module").unwrap().backend, Backend::Module);
        assert_eq!(with("scripts").unwrap().backend, Backend::Scripts);
        assert_eq!(with("auto").unwrap().backend, Backend::Auto);
        let err = with("lua").unwrap_err().to_string();
        assert!(err.contains("BACKEND"), "{err}");
    }

    #[test]
    fn api_tokens_map_bearer_tokens_to_accounts() {
        let s = settings(&[("DATABASE_URL", "x"), ("API_TOKENS", "t1=acct_1,t2=acct_2")]).unwrap();
        assert_eq!(s.tokens.account(b"Bearer t2"), Some("acct_2"));
        assert_eq!(s.tokens.account(b"Bearer tok_demo"), None, "no demo token");
        assert!(settings(&[("DATABASE_URL", "x"), ("API_TOKENS", "t1")]).is_err());
    }

    #[test]
    fn replica_ack_is_replicas_and_a_timeout_or_off() {
        let with = |value| settings(&[("DATABASE_URL", "x"), ("REPLICA_ACK", value)]);
        assert_eq!(
            with("1:3000").unwrap().replica_ack,
            Some((1, Duration::from_secs(3)))
        );
        assert_eq!(with("off").unwrap().replica_ack, None);
        for bad in ["0:3000", "1:0", "1", "one:3000", "1:3s", ":", ""] {
            let err = with(bad).expect_err(bad).to_string();
            assert!(err.contains("REPLICAS:TIMEOUT_MS"), "{bad}: {err}");
        }
    }

    #[test]
    fn overrides_and_errors() {
        let s = settings(&[
            ("DATABASE_URL", "postgres://x/db"),
            ("PORT", "9000"),
            ("READ_THROUGH", "off"),
            ("WAIT_MS", "5000"),
            ("FENCE", "off"),
        ])
        .unwrap();
        assert!(!s.fence);
        assert_eq!(s.port, 9000);
        assert!(!s.read_through);
        assert_eq!(s.wait, Some(Duration::from_secs(5)));
        assert!(settings(&[]).is_err());
        assert!(settings(&[("DATABASE_URL", "x"), ("PORT", "http")]).is_err());
        assert!(settings(&[("DATABASE_URL", "x"), ("READ_THROUGH", "maybe")]).is_err());
        assert!(settings(&[("DATABASE_URL", "x"), ("FENCE", "maybe")]).is_err());
    }

    #[test]
    fn urls_can_come_from_files() {
        let dir = std::env::temp_dir().join(format!("idem-example-secrets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("database_url");
        std::fs::write(&file, "postgres://u:pw@db/idem\n").unwrap();
        let path = file.to_str().unwrap();
        let s = settings(&[("DATABASE_URL_FILE", path)]).unwrap();
        assert_eq!(s.database_url, "postgres://u:pw@db/idem");
        let both = settings(&[("DATABASE_URL_FILE", path), ("DATABASE_URL", "x")]);
        assert!(both.is_err());
        let missing = settings(&[("DATABASE_URL", "x"), ("REDIS_URL_FILE", "/nonexistent")]);
        assert!(missing.is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
