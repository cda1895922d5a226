//! Redis Cluster discovery: the primaries, from `CLUSTER NODES` as the most
//! up-to-date reachable node sees them.

use futures_util::future::join_all;
use redis::{ConnectionInfo, Value};

use crate::error::{ensure_config, Context, Error, Result};
use crate::secure::RedisTls;
use crate::topology::target::{host_of, parse_url, query_once, with_address, Target};

/// One line of `CLUSTER NODES`, as far as discovery needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ClusterNode {
    host: String,
    port: u16,
    primary: bool,
    /// Not failed, not in handshake, has an address.
    usable: bool,
    config_epoch: u64,
    /// The line of the node that answered.
    myself: bool,
}

pub struct ClusterDiscovery {
    /// Scheme, credentials and database for every node.
    template: ConnectionInfo,
    seeds: Vec<ConnectionInfo>,
    /// Every usable node of the last view, replicas included: the next
    /// discovery asks them too, so it works when every seed is gone.
    known: Vec<ConnectionInfo>,
}

impl ClusterDiscovery {
    pub fn new(seed_urls: &[String], tls: &RedisTls) -> Result<Self> {
        ensure_config(
            !seed_urls.is_empty(),
            "at least one Redis Cluster seed URL is needed",
        )?;
        let seeds = seed_urls
            .iter()
            .map(|url| parse_url(url, tls))
            .collect::<Result<Vec<_>>>()?;
        for seed in &seeds {
            ensure_config(
                seed.redis_settings().db() == 0,
                format!(
                    "Redis Cluster has only database 0 (seed URL names database {})",
                    seed.redis_settings().db()
                ),
            )?;
            with_address(seed, "check", 1)?;
        }
        Ok(ClusterDiscovery {
            template: seeds[0].clone(),
            seeds,
            known: Vec::new(),
        })
    }

    /// Asks every seed and known node at once, and returns the primaries
    /// (see [`choose`]).
    pub async fn primaries(&mut self) -> Result<Vec<Target>> {
        let mut asked: Vec<ConnectionInfo> = Vec::new();
        for info in self.seeds.iter().chain(&self.known) {
            if !asked.iter().any(|a| a.addr() == info.addr()) {
                asked.push(info.clone());
            }
        }
        let mut views = Vec::new();
        let mut failures = Vec::new();
        ask_all(&asked, &mut views, &mut failures).await;
        if views.is_empty() {
            return Err(Error::Topology(format!(
                "no cluster node answered CLUSTER NODES ({})",
                failures.join("; ")
            )));
        }
        // Nodes first seen now (all of them at start) are asked too, so
        // that each can speak for its own role.
        let address = |n: &ClusterNode| with_address(&self.template, &n.host, n.port);
        let (usable, _) = choose(&views);
        let unasked = usable
            .iter()
            .map(address)
            .filter(|info| match info {
                Ok(info) => !asked.iter().any(|a| a.addr() == info.addr()),
                Err(_) => true,
            })
            .collect::<Result<Vec<_>>>()?;
        ask_all(&unasked, &mut views, &mut failures).await;
        let (usable, primaries) = choose(&views);
        self.known = usable.iter().map(address).collect::<Result<_>>()?;
        let primaries = primaries
            .iter()
            .map(|n| address(n).map(Target::new))
            .collect::<Result<Vec<_>>>()?;
        if primaries.is_empty() {
            return Err(Error::Topology(
                "the cluster lists no usable primary".to_string(),
            ));
        }
        Ok(primaries)
    }
}

/// `CLUSTER NODES` of every node in `nodes` at once: the views into
/// `views`, the failures into `failures`.
async fn ask_all(
    nodes: &[ConnectionInfo],
    views: &mut Vec<Vec<ClusterNode>>,
    failures: &mut Vec<String>,
) {
    let replies = join_all(nodes.iter().map(|info| async move {
        let reply = query_once(info, redis::cmd("CLUSTER").arg("NODES")).await;
        (info, reply)
    }))
    .await;
    for (info, reply) in replies {
        match reply
            .context("CLUSTER NODES")
            .and_then(|v| parse_cluster_nodes(&v, host_of(info).unwrap_or_default()))
        {
            Ok(view) => views.push(view),
            Err(error) => failures.push(format!("{}: {}", info.addr(), error.report())),
        }
    }
}

/// From the answers: the usable nodes and the primaries of the view whose
/// largest config epoch is highest (the one that has seen the latest
/// failover; the first of equals), except that a node that answered itself
/// is taken at its own word on its role (gossip about a role change, such as
/// a replica just attached, can lag behind).
fn choose(views: &[Vec<ClusterNode>]) -> (Vec<ClusterNode>, Vec<ClusterNode>) {
    let mut best: Option<&Vec<ClusterNode>> = None;
    for view in views {
        match best {
            Some(b) if max_epoch(view) <= max_epoch(b) => {}
            _ => best = Some(view),
        }
    }
    let own_word = |node: &ClusterNode| {
        views
            .iter()
            .flatten()
            .find(|n| n.myself && n.host == node.host && n.port == node.port)
            .map_or(node.primary, |n| n.primary)
    };
    let usable: Vec<ClusterNode> = best
        .into_iter()
        .flatten()
        .filter(|n| n.usable)
        .cloned()
        .collect();
    let primaries = usable.iter().filter(|n| own_word(n)).cloned().collect();
    (usable, primaries)
}

fn max_epoch(view: &[ClusterNode]) -> u64 {
    view.iter().map(|n| n.config_epoch).max().unwrap_or(0)
}

/// Parses a `CLUSTER NODES` reply; `asked_host` stands in for a node that
/// does not know its own address yet (`:7000@17000`).
fn parse_cluster_nodes(reply: &Value, asked_host: &str) -> Result<Vec<ClusterNode>> {
    let text = match reply {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::VerbatimString { text, .. } => text.clone(),
        Value::SimpleString(s) => s.clone(),
        other => {
            return Err(Error::Topology(format!(
                "unexpected CLUSTER NODES reply {other:?}"
            )))
        }
    };
    let nodes = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            parse_line(line, asked_host)
                .map_err(|e| Error::Topology(format!("CLUSTER NODES line {line:?}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    if nodes.is_empty() {
        return Err(Error::Topology("empty CLUSTER NODES reply".to_string()));
    }
    Ok(nodes)
}

/// `<id> <ip:port@cport[,hostname]> <flags> <primary> <ping> <pong> <epoch> <link> <slot>...`
fn parse_line(line: &str, asked_host: &str) -> Result<ClusterNode, &'static str> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    if fields.len() < 8 {
        return Err("too few fields");
    }
    let address = fields[1].split(['@', ',']).next().unwrap_or_default();
    let (host, port) = address.rsplit_once(':').ok_or("no port")?;
    let port: u16 = port.parse().map_err(|_| "bad port")?;
    let flags: Vec<&str> = fields[2].split(',').collect();
    let config_epoch = fields[6].parse().map_err(|_| "bad config epoch")?;
    let has = |flag: &str| flags.contains(&flag);
    Ok(ClusterNode {
        host: if host.is_empty() { asked_host } else { host }.to_string(),
        port,
        primary: has("master"),
        usable: port != 0 && !has("fail") && !has("noaddr") && !has("handshake"),
        config_epoch,
        myself: has("myself"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const NODES: &str = "\
07c37dfeb235213a872192d90877d0cd55635b91 127.0.0.1:30004@31004,host-4 slave e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 0 1426238317239 4 connected
67ed2db8d677e59ec4a4cefb06858cf2a1a89fa1 127.0.0.1:30002@31002 master - 0 1426238316232 2 connected 5461-10922
292f8b365bb7edb5e285caf0b7e6ddc7265d2f4f 127.0.0.1:30003@31003 master - 0 1426238318243 3 connected 10923-16383
6ec23923021cf3ffec47632106199cb7f496ce01 127.0.0.1:30005@31005 master,fail - 1426238316232 1426238315000 5 disconnected
824fe116063bc5fcf9f4ffd895bc17aee7731ac3 127.0.0.1:30006@31006 slave 292f8b365bb7edb5e285caf0b7e6ddc7265d2f4f 0 1426238317741 6 connected
e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca :30001@31001 myself,master - 0 0 7 connected 0-5460
aa11 127.0.0.1:30007@31007 handshake - 0 0 0 connected
";

    #[test]
    fn reads_primaries_and_their_state() {
        let nodes = parse_cluster_nodes(&Value::BulkString(NODES.into()), "10.1.1.1").unwrap();
        let primaries: Vec<(String, u16)> = nodes
            .iter()
            .filter(|n| n.primary && n.usable)
            .map(|n| (n.host.clone(), n.port))
            .collect();
        assert_eq!(
            primaries,
            vec![
                ("127.0.0.1".to_string(), 30002),
                ("127.0.0.1".to_string(), 30003),
                ("10.1.1.1".to_string(), 30001),
            ]
        );
        assert_eq!(max_epoch(&nodes), 7);
        assert_eq!(nodes.iter().filter(|n| n.usable).count(), 5);
    }

    fn node(port: u16, primary: bool, epoch: u64, myself: bool) -> ClusterNode {
        ClusterNode {
            host: "h".into(),
            port,
            primary,
            usable: true,
            config_epoch: epoch,
            myself,
        }
    }

    #[test]
    fn newest_view_wins_and_nodes_speak_for_themselves() {
        // A stale view (epoch 3: node 2 still primary), a newer one (epoch 4:
        // node 3 promoted), and node 4 reporting itself a replica while the
        // newer view still lists it as a primary.
        let stale = vec![
            node(1, true, 1, true),
            node(2, true, 3, false),
            node(3, false, 2, false),
        ];
        let newer = vec![
            node(1, true, 1, false),
            node(2, false, 3, false),
            node(3, true, 4, true),
            node(4, true, 0, false),
        ];
        let replica = vec![node(4, false, 0, true)];
        let (usable, primaries) = choose(&[stale, newer, replica]);
        assert_eq!(usable.len(), 4);
        let ports: Vec<u16> = primaries.iter().map(|n| n.port).collect();
        assert_eq!(ports, vec![1, 3]);
    }

    #[test]
    fn rejects_garbage() {
        assert!(parse_cluster_nodes(&Value::Int(1), "h").is_err());
        assert!(parse_cluster_nodes(&Value::BulkString(b"abc def".to_vec()), "h").is_err());
        assert!(parse_cluster_nodes(&Value::BulkString(b"".to_vec()), "h").is_err());
    }

    #[test]
    fn cluster_seeds_must_use_database_0() {
        assert!(
            ClusterDiscovery::new(&["redis://seed:7000/0".into()], &RedisTls::default()).is_ok()
        );
        assert!(
            ClusterDiscovery::new(&["redis://seed:7000/3".into()], &RedisTls::default()).is_err()
        );
        assert!(ClusterDiscovery::new(&[], &RedisTls::default()).is_err());
    }
}
