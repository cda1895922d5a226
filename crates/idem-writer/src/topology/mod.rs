//! Where the primaries to mirror come from: a fixed list, Redis Cluster
//! discovery (`cluster`), or the primary Sentinel names (`sentinel`), each
//! a `target` to connect to; and how one discovery is made.

pub(crate) mod cluster;
pub(crate) mod sentinel;
pub(crate) mod target;

use crate::error::{ensure_config, Result};
use crate::secure::RedisTls;
use crate::topology::cluster::ClusterDiscovery;
use crate::topology::sentinel::SentinelDiscovery;
use crate::topology::target::{parse_url, Target};

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
        /// Sentinel URLs, asked in turn.
        sentinels: Vec<String>,
        /// The service (primary) name Sentinel monitors.
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

/// Finds the current primaries of a [`Topology`].
pub enum Discovery {
    Static(Vec<Target>),
    Cluster(ClusterDiscovery),
    Sentinel(SentinelDiscovery),
}

impl Discovery {
    /// Checks every URL now, so a bad one fails the start.
    pub fn new(topology: &Topology, tls: &RedisTls) -> Result<Self> {
        Ok(match topology {
            Topology::Static(urls) => {
                ensure_config(!urls.is_empty(), "at least one Redis URL is needed")?;
                let targets = urls
                    .iter()
                    .map(|url| parse_url(url, tls).map(Target::new))
                    .collect::<Result<Vec<_>>>()?;
                Discovery::Static(targets)
            }
            Topology::Cluster(seeds) => Discovery::Cluster(ClusterDiscovery::new(seeds, tls)?),
            Topology::Sentinel {
                sentinels,
                service_name,
                service_url,
            } => Discovery::Sentinel(SentinelDiscovery::new(
                sentinels,
                service_name,
                service_url,
                tls,
            )?),
        })
    }

    /// Whether the primaries can change while running (so discovery is
    /// repeated periodically and when a node fails).
    pub fn follows(&self) -> bool {
        !matches!(self, Discovery::Static(_))
    }

    /// The primaries now. An error leaves the caller's current set in place.
    pub async fn primaries(&mut self) -> Result<Vec<Target>> {
        match self {
            Discovery::Static(targets) => Ok(targets.clone()),
            Discovery::Cluster(cluster) => cluster.primaries().await,
            Discovery::Sentinel(sentinel) => sentinel.primary().await.map(|t| vec![t]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            assert!(
                Discovery::new(&topology, &RedisTls::default()).is_err(),
                "{topology:?}"
            );
        }
    }
}
