//! A primary to mirror, and how the writer reaches Redis servers by URL:
//! parsing, re-addressing with the same credentials, one-shot queries.

use std::time::Duration;

use redis::{AsyncConnectionConfig, Client, ConnectionAddr, ConnectionInfo, RedisResult, Value};

use crate::error::{Context, Error, Result};
use crate::secure::RedisTls;

/// How long one discovery query (connect, then reply) may take per server.
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(2);

/// A primary to mirror.
#[derive(Debug, Clone)]
pub struct Target {
    /// `host:port/db`, never credentials: the node's name in logs and metrics.
    pub label: String,
    pub info: ConnectionInfo,
}

impl Target {
    pub fn new(info: ConnectionInfo) -> Self {
        Target {
            label: format!("{}/{}", info.addr(), info.redis_settings().db()),
            info,
        }
    }
}

/// A Redis URL's connection settings, with `tls`'s certificates for a
/// `rediss://` URL (they travel with the settings to every node
/// [`with_address`] derives from them).
pub fn parse_url(url: &str, tls: &RedisTls) -> Result<ConnectionInfo> {
    tls.connection_info(url)
}

/// `template` (scheme, TLS settings, credentials, database) at `host:port`.
pub fn with_address(template: &ConnectionInfo, host: &str, port: u16) -> Result<ConnectionInfo> {
    let addr = match template.addr() {
        ConnectionAddr::Tcp(_, _) => ConnectionAddr::Tcp(host.to_string(), port),
        ConnectionAddr::TcpTls {
            insecure,
            tls_params,
            ..
        } => ConnectionAddr::TcpTls {
            host: host.to_string(),
            port,
            insecure: *insecure,
            tls_params: tls_params.clone(),
        },
        _ => {
            return Err(Error::Config(
                "a unix socket URL cannot name other nodes; use redis:// or rediss://".to_string(),
            ))
        }
    };
    Ok(template.clone().set_addr(addr))
}

/// The host of a TCP address (`None` for a unix socket).
pub fn host_of(info: &ConnectionInfo) -> Option<&str> {
    match info.addr() {
        ConnectionAddr::Tcp(host, _) | ConnectionAddr::TcpTls { host, .. } => Some(host),
        _ => None,
    }
}

/// One command on a fresh connection, bounded by [`QUERY_TIMEOUT`] for the
/// connection and again for the reply.
pub async fn query_once(info: &ConnectionInfo, cmd: &redis::Cmd) -> RedisResult<Value> {
    let client = Client::open(info.clone())?;
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(QUERY_TIMEOUT))
        .set_response_timeout(Some(QUERY_TIMEOUT));
    let mut conn = client
        .get_multiplexed_async_connection_with_config(&config)
        .await?;
    cmd.query_async(&mut conn).await
}

/// `ROLE`'s first field: `master`, `slave` or `sentinel`.
pub async fn role(info: &ConnectionInfo) -> Result<String> {
    let reply = query_once(info, &redis::cmd("ROLE"))
        .await
        .context("ROLE")?;
    match reply {
        Value::Array(items) => match items.first() {
            Some(Value::BulkString(b)) => Ok(String::from_utf8_lossy(b).into_owned()),
            Some(Value::SimpleString(s)) => Ok(s.clone()),
            other => Err(Error::Topology(format!("unexpected ROLE reply {other:?}"))),
        },
        other => Err(Error::Topology(format!("unexpected ROLE reply {other:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_hide_credentials() {
        let target = Target::new(
            parse_url("redis://:secret@10.0.0.5:7001/2", &RedisTls::default()).unwrap(),
        );
        assert_eq!(target.label, "10.0.0.5:7001/2");
    }

    #[test]
    fn another_address_keeps_credentials_and_database() {
        let template = parse_url("redis://app:pw@seed:7000/0", &RedisTls::default()).unwrap();
        let info = with_address(&template, "10.0.0.9", 7005).unwrap();
        assert_eq!(info.addr(), &ConnectionAddr::Tcp("10.0.0.9".into(), 7005));
        assert_eq!(info.redis_settings().username(), Some("app"));
        assert_eq!(info.redis_settings().password(), Some("pw"));
        assert_eq!(Target::new(info).label, "10.0.0.9:7005/0");
        let unix = parse_url("unix:///run/redis.sock", &RedisTls::default()).unwrap();
        assert!(with_address(&unix, "h", 1).is_err());
    }
}
