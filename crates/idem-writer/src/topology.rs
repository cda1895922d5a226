//! Where the primaries to mirror come from: a fixed list, Redis Cluster
//! discovery, or the primary Sentinel names; and how one discovery is made.

use std::time::Duration;

use anyhow::Context;
use redis::{
    AsyncConnectionConfig, Client, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, RedisResult,
    Value,
};

use crate::cluster::ClusterDiscovery;
use crate::sentinel::SentinelDiscovery;

/// How long one discovery query (connect, then reply) may take per server.
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(2);

/// The primaries a writer mirrors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Topology {
    /// These primaries, for good (`--redis`).
    Static(Vec<String>),
    /// The primaries of a Redis Cluster, discovered from any of these seed
    /// nodes and followed through failovers and reshards (`--redis-cluster`).
    Cluster(Vec<String>),
    /// The primary Sentinel names for `service_name`, followed through
    /// failovers (`--sentinel`, `--service-name`).
    Sentinel {
        sentinels: Vec<String>,
        service_name: String,
        /// Scheme, credentials and database for the primary; its host and
        /// port are replaced by the address Sentinel names.
        service_url: String,
    },
}

impl Topology {
    /// How many Postgres connections the mirrors may use at once (one per
    /// primary committing, plus one for cleanup). The pool opens them lazily.
    pub fn postgres_connections(&self) -> usize {
        match self {
            Topology::Static(urls) => urls.len() + 1,
            Topology::Cluster(_) => 17,
            Topology::Sentinel { .. } => 2,
        }
    }
}

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
            label: format!("{}/{}", info.addr, info.redis.db),
            info,
        }
    }
}

/// Finds the current primaries of a [`Topology`].
pub enum Discovery {
    Static(Vec<Target>),
    Cluster(ClusterDiscovery),
    Sentinel(SentinelDiscovery),
}

impl Discovery {
    /// Checks every URL now, so a bad one fails the start.
    pub fn new(topology: &Topology) -> anyhow::Result<Self> {
        Ok(match topology {
            Topology::Static(urls) => {
                anyhow::ensure!(!urls.is_empty(), "at least one Redis URL is needed");
                let targets = urls
                    .iter()
                    .map(|url| parse_url(url).map(Target::new))
                    .collect::<anyhow::Result<Vec<_>>>()?;
                Discovery::Static(targets)
            }
            Topology::Cluster(seeds) => Discovery::Cluster(ClusterDiscovery::new(seeds)?),
            Topology::Sentinel {
                sentinels,
                service_name,
                service_url,
            } => Discovery::Sentinel(SentinelDiscovery::new(
                sentinels,
                service_name,
                service_url,
            )?),
        })
    }

    /// Whether the primaries can change while running (so discovery is
    /// repeated periodically and when a node fails).
    pub fn follows(&self) -> bool {
        !matches!(self, Discovery::Static(_))
    }

    /// The primaries now. An error leaves the caller's current set in place.
    pub async fn primaries(&mut self) -> anyhow::Result<Vec<Target>> {
        match self {
            Discovery::Static(targets) => Ok(targets.clone()),
            Discovery::Cluster(cluster) => cluster.primaries().await,
            Discovery::Sentinel(sentinel) => sentinel.primary().await.map(|t| vec![t]),
        }
    }
}

/// A Redis URL's connection settings.
pub fn parse_url(url: &str) -> anyhow::Result<ConnectionInfo> {
    url.into_connection_info()
        .map_err(|e| anyhow::anyhow!("invalid Redis URL: {e}"))
}

/// `template` (scheme, TLS settings, credentials, database) at `host:port`.
pub fn with_address(
    template: &ConnectionInfo,
    host: &str,
    port: u16,
) -> anyhow::Result<ConnectionInfo> {
    let addr = match &template.addr {
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
        ConnectionAddr::Unix(_) => {
            anyhow::bail!("a unix socket URL cannot name other nodes; use redis:// or rediss://")
        }
    };
    Ok(ConnectionInfo {
        addr,
        redis: template.redis.clone(),
    })
}

/// The host of a TCP address (`None` for a unix socket).
pub fn host_of(info: &ConnectionInfo) -> Option<&str> {
    match &info.addr {
        ConnectionAddr::Tcp(host, _) | ConnectionAddr::TcpTls { host, .. } => Some(host),
        ConnectionAddr::Unix(_) => None,
    }
}

/// One command on a fresh connection, bounded by [`QUERY_TIMEOUT`] for the
/// connection and again for the reply.
pub async fn query_once(info: &ConnectionInfo, cmd: &redis::Cmd) -> RedisResult<Value> {
    let client = Client::open(info.clone())?;
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(QUERY_TIMEOUT)
        .set_response_timeout(QUERY_TIMEOUT);
    let mut conn = client
        .get_multiplexed_async_connection_with_config(&config)
        .await?;
    cmd.query_async(&mut conn).await
}

/// `ROLE`'s first field: `master`, `slave` or `sentinel`.
pub async fn role(info: &ConnectionInfo) -> anyhow::Result<String> {
    let reply = query_once(info, &redis::cmd("ROLE"))
        .await
        .context("ROLE")?;
    match reply {
        Value::Array(items) => match items.first() {
            Some(Value::BulkString(b)) => Ok(String::from_utf8_lossy(b).into_owned()),
            Some(Value::SimpleString(s)) => Ok(s.clone()),
            other => anyhow::bail!("unexpected ROLE reply {other:?}"),
        },
        other => anyhow::bail!("unexpected ROLE reply {other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_hide_credentials() {
        let target = Target::new(parse_url("redis://:secret@10.0.0.5:7001/2").unwrap());
        assert_eq!(target.label, "10.0.0.5:7001/2");
    }

    #[test]
    fn another_address_keeps_credentials_and_database() {
        let template = parse_url("redis://app:pw@seed:7000/0").unwrap();
        let info = with_address(&template, "10.0.0.9", 7005).unwrap();
        assert_eq!(info.addr, ConnectionAddr::Tcp("10.0.0.9".into(), 7005));
        assert_eq!(info.redis.username.as_deref(), Some("app"));
        assert_eq!(info.redis.password.as_deref(), Some("pw"));
        assert_eq!(Target::new(info).label, "10.0.0.9:7005/0");
        let unix = parse_url("unix:///run/redis.sock").unwrap();
        assert!(with_address(&unix, "h", 1).is_err());
    }

    #[test]
    fn bad_urls_fail_at_start() {
        for topology in [
            Topology::Static(vec!["http://x".into()]),
            Topology::Static(vec![]),
            Topology::Cluster(vec![]),
            Topology::Cluster(vec!["redis://seed:7000/3".into()]),
            Topology::Sentinel {
                sentinels: vec!["redis://s:26379".into()],
                service_name: String::new(),
                service_url: "redis://primary/0".into(),
            },
        ] {
            assert!(Discovery::new(&topology).is_err(), "{topology:?}");
        }
    }
}
