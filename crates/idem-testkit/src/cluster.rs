//! Redis Cluster and Sentinel set-ups for failover tests: every node a
//! `redis-server` with the module on a free port, every sentinel a
//! `redis-server --sentinel`; all killed (and their directories removed) on
//! drop.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use redis::Value;

use crate::{eventually, free_port, scratch_dir, RedisConfig, RedisServer};

pub mod library;

/// A local Redis Cluster; `nodes[i]` may be killed or added while it runs.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
    node_timeout_ms: u64,
}

impl RedisCluster {
    /// `primaries` primaries with `replicas` replicas each (`redis-cli
    /// --cluster create`), with `cluster-node-timeout` `node_timeout_ms`;
    /// returns once every node agrees on the slots and every replica is in
    /// sync.
    pub fn start(primaries: usize, replicas: usize, node_timeout_ms: u64) -> Self {
        let mut cluster = RedisCluster {
            nodes: Vec::new(),
            node_timeout_ms,
        };
        for _ in 0..primaries * (1 + replicas) {
            cluster.nodes.push(cluster.new_node());
        }
        let addrs: Vec<String> = (0..cluster.nodes.len()).map(|i| cluster.addr(i)).collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed:\n{}",
            String::from_utf8_lossy(&out.stdout)
        );
        cluster.wait_healthy(Duration::from_secs(30));
        cluster
    }

    /// A cluster node; its bus port is a free port of its own (the default,
    /// port + 10000, does not exist for ports above 55535).
    fn new_node(&self) -> RedisServer {
        RedisConfig::default()
            .server_arg("cluster-enabled", "yes")
            .server_arg("cluster-node-timeout", &self.node_timeout_ms.to_string())
            .server_arg("cluster-port", &free_port().to_string())
            .start()
    }

    /// `127.0.0.1:port` of node `i`.
    pub fn addr(&self, i: usize) -> String {
        format!("127.0.0.1:{}", self.nodes[i].port)
    }

    /// Every node's URL (for seeds).
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    pub fn conn(&self, i: usize) -> redis::Connection {
        self.nodes[i].conn()
    }

    /// Nodes whose process is running.
    pub fn live(&mut self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| self.nodes[i].is_running())
            .collect()
    }

    pub fn node_id(&self, i: usize) -> String {
        redis::cmd("CLUSTER")
            .arg("MYID")
            .query(&mut self.conn(i))
            .expect("CLUSTER MYID")
    }

    /// `ROLE`'s first field of a running node (`master` or `slave`).
    pub fn role(&self, i: usize) -> String {
        let reply: Vec<Value> = redis::cmd("ROLE").query(&mut self.conn(i)).expect("ROLE");
        match reply.first() {
            Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
            other => panic!("ROLE: {other:?}"),
        }
    }

    /// Running nodes that are primaries owning at least one slot.
    pub fn primaries(&mut self) -> Vec<usize> {
        let owners = self.slot_owners();
        let mut primaries: Vec<usize> = owners.values().copied().collect();
        primaries.sort_unstable();
        primaries.dedup();
        primaries
    }

    /// The running replica of node `primary`.
    pub fn replica_of(&mut self, primary: usize) -> usize {
        let port = self.nodes[primary].port;
        self.live()
            .into_iter()
            .find(|&i| {
                i != primary && {
                    let info = info(&mut self.conn(i), "replication");
                    info.get("role").map(String::as_str) == Some("slave")
                        && info.get("master_port") == Some(&port.to_string())
                }
            })
            .unwrap_or_else(|| panic!("node {primary} has no running replica"))
    }

    /// The node serving slot `slot`, as the first running node sees it.
    pub fn owner_of_slot(&mut self, slot: u16) -> usize {
        *self
            .slot_owners()
            .get(&slot)
            .unwrap_or_else(|| panic!("slot {slot} is not served"))
    }

    /// Slot → node index, from `CLUSTER SLOTS` of the first running node.
    fn slot_owners(&mut self) -> HashMap<u16, usize> {
        let asked = *self.live().first().expect("a running node");
        let by_port: HashMap<u16, usize> = self
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (n.port, i))
            .collect();
        let mut owners = HashMap::new();
        for (from, to, port) in cluster_slots(&mut self.conn(asked)) {
            let owner = by_port[&port];
            for slot in from..=to {
                owners.insert(slot, owner);
            }
        }
        owners
    }

    /// Waits until every running node says `cluster_state:ok`, all of them
    /// see the same primary for every slot, and every running replica's link
    /// to its primary is up.
    pub fn wait_healthy(&mut self, timeout: Duration) {
        let live = self.live();
        let ok = eventually(timeout, || {
            let mut views = Vec::new();
            for &i in &live {
                let Ok(mut c) = self.nodes[i].client().get_connection() else {
                    return false;
                };
                let state: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query(&mut c)
                    .unwrap_or_default();
                if !state.contains("cluster_state:ok") {
                    return false;
                }
                let replication = info(&mut c, "replication");
                if replication.get("role").map(String::as_str) == Some("slave")
                    && replication.get("master_link_status").map(String::as_str) != Some("up")
                {
                    return false;
                }
                let mut slots = cluster_slots(&mut c);
                slots.sort_unstable();
                views.push(slots);
            }
            views.windows(2).all(|w| w[0] == w[1])
        });
        assert!(ok, "the cluster did not become healthy within {timeout:?}");
    }

    /// `CLUSTER FAILOVER` on replica `replica` (a manual failover: the
    /// primary hands over once the replica has caught up).
    pub fn manual_failover(&mut self, replica: usize) {
        let _: () = redis::cmd("CLUSTER")
            .arg("FAILOVER")
            .query(&mut self.conn(replica))
            .expect("CLUSTER FAILOVER");
        let promoted = eventually(Duration::from_secs(20), || self.role(replica) == "master");
        assert!(promoted, "replica {replica} was not promoted");
    }

    /// Starts an empty primary and introduces it to the cluster; its index.
    pub fn add_primary(&mut self) -> usize {
        let node = self.new_node();
        let port = node.port;
        self.nodes.push(node);
        let i = self.nodes.len() - 1;
        let (_, bus_port): (String, u16) = redis::cmd("CONFIG")
            .arg("GET")
            .arg("cluster-port")
            .query(&mut self.conn(i))
            .expect("CONFIG GET cluster-port");
        let first = self.live()[0];
        let _: () = redis::cmd("CLUSTER")
            .arg("MEET")
            .arg("127.0.0.1")
            .arg(port)
            .arg(bus_port)
            .query(&mut self.conn(first))
            .expect("CLUSTER MEET");
        let id = self.node_id(i);
        let live = self.live();
        let known = eventually(Duration::from_secs(20), || {
            live.iter().all(|&j| {
                let nodes: String = redis::cmd("CLUSTER")
                    .arg("NODES")
                    .query(&mut self.conn(j))
                    .unwrap_or_default();
                nodes.lines().filter(|l| !l.contains("handshake")).count() == live.len()
                    && nodes.contains(&id)
            })
        });
        assert!(known, "the new node did not join");
        self.wait_healthy(Duration::from_secs(30));
        i
    }

    /// Moves `slot`, with its keys (`MIGRATE`), from node `from` to node `to`.
    pub fn migrate_slot(&mut self, slot: u16, from: usize, to: usize) {
        let (from_id, to_id) = (self.node_id(from), self.node_id(to));
        let mut src = self.conn(from);
        let mut dst = self.conn(to);
        let setslot = |c: &mut redis::Connection, state: &str, id: &str| {
            let _: () = redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg(state)
                .arg(id)
                .query(c)
                .unwrap_or_else(|e| panic!("CLUSTER SETSLOT {slot} {state}: {e}"));
        };
        setslot(&mut dst, "IMPORTING", &from_id);
        setslot(&mut src, "MIGRATING", &to_id);
        loop {
            let keys: Vec<Vec<u8>> = redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(500)
                .query(&mut src)
                .expect("CLUSTER GETKEYSINSLOT");
            if keys.is_empty() {
                break;
            }
            let _: Value = redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(self.nodes[to].port)
                .arg("")
                .arg(0)
                .arg(10_000)
                .arg("KEYS")
                .arg(&keys)
                .query(&mut src)
                .expect("MIGRATE");
        }
        setslot(&mut dst, "NODE", &to_id);
        // A primary that just gave away its last slot may already have
        // turned into a replica of the receiver (replica migration).
        for i in self.live() {
            if i != to {
                let result: redis::RedisResult<()> = redis::cmd("CLUSTER")
                    .arg("SETSLOT")
                    .arg(slot)
                    .arg("NODE")
                    .arg(&to_id)
                    .query(&mut self.conn(i));
                if let Err(e) = result {
                    assert!(
                        self.role(i) == "slave",
                        "CLUSTER SETSLOT {slot} NODE on node {i}: {e}"
                    );
                }
            }
        }
    }

    /// Takes empty primary `i` out of the cluster (`CLUSTER FORGET` on
    /// every other node) and shuts it down.
    pub fn remove_node(&mut self, i: usize) {
        let id = self.node_id(i);
        for j in self.live() {
            if j != i {
                let _: () = redis::cmd("CLUSTER")
                    .arg("FORGET")
                    .arg(&id)
                    .query(&mut self.conn(j))
                    .expect("CLUSTER FORGET");
            }
        }
        self.nodes[i].shutdown();
    }
}

/// `(first slot, last slot, primary port)` of each range in `CLUSTER SLOTS`
/// (empty when the node does not answer).
pub fn cluster_slots(conn: &mut redis::Connection) -> Vec<(u16, u16, u16)> {
    let reply: Vec<Value> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query(conn)
        .unwrap_or_default();
    reply
        .iter()
        .filter_map(|range| {
            let Value::Array(items) = range else {
                return None;
            };
            let (Some(Value::Int(from)), Some(Value::Int(to)), Some(Value::Array(primary))) =
                (items.first(), items.get(1), items.get(2))
            else {
                return None;
            };
            let Some(Value::Int(port)) = primary.get(1) else {
                return None;
            };
            Some((*from as u16, *to as u16, *port as u16))
        })
        .collect()
}

/// An `INFO` section as field → value.
pub fn info(conn: &mut redis::Connection, section: &str) -> HashMap<String, String> {
    let text: String = redis::cmd("INFO")
        .arg(section)
        .query(conn)
        .unwrap_or_default();
    text.lines()
        .filter_map(|l| l.trim_end().split_once(':'))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A primary with the module, one replica of it, and `sentinels` sentinels
/// (quorum: a majority) watching it as service `name`.
pub struct SentinelSetup {
    pub name: String,
    pub primary: RedisServer,
    pub replica: RedisServer,
    pub sentinels: Vec<Sentinel>,
}

impl SentinelSetup {
    /// Returns once the replica is in sync and every sentinel knows the
    /// replica and the other sentinels. `down_after_ms`: how long a silent
    /// primary takes to be declared down.
    pub fn start(name: &str, sentinels: usize, down_after_ms: u64) -> Self {
        let primary = RedisServer::start();
        let replica = RedisServer::start_replica_of(&primary);
        let quorum = sentinels / 2 + 1;
        let sentinels: Vec<Sentinel> = (0..sentinels)
            .map(|_| Sentinel::start(name, primary.port, quorum, down_after_ms))
            .collect();
        let others = sentinels.len() - 1;
        for sentinel in &sentinels {
            let ready = eventually(Duration::from_secs(30), || {
                let fields = sentinel.master_fields(name);
                fields.get("num-slaves").map(String::as_str) == Some("1")
                    && fields.get("num-other-sentinels") == Some(&others.to_string())
            });
            assert!(
                ready,
                "sentinel {} never saw the whole set-up",
                sentinel.port
            );
        }
        SentinelSetup {
            name: name.to_string(),
            primary,
            replica,
            sentinels,
        }
    }

    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(Sentinel::url).collect()
    }

    /// The primary's port as every sentinel names it, once they agree.
    pub fn agreed_primary_port(&self) -> Option<u16> {
        let ports: Vec<Option<u16>> = self
            .sentinels
            .iter()
            .map(|s| s.primary_port(&self.name))
            .collect();
        ports
            .windows(2)
            .all(|w| w[0] == w[1])
            .then(|| ports[0])
            .flatten()
    }
}

/// A `redis-server --sentinel` on a free port.
pub struct Sentinel {
    pub port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl Sentinel {
    pub fn start(name: &str, primary_port: u16, quorum: usize, down_after_ms: u64) -> Self {
        let port = free_port();
        let dir = scratch_dir("sentinel");
        let config = dir.join("sentinel.conf");
        std::fs::write(
            &config,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {dir}\nlogfile {dir}/sentinel.log\n\
                 sentinel monitor {name} 127.0.0.1 {primary_port} {quorum}\n\
                 sentinel down-after-milliseconds {name} {down_after_ms}\n\
                 sentinel failover-timeout {name} 4000\n\
                 sentinel parallel-syncs {name} 1\n",
                dir = dir.display()
            ),
        )
        .expect("write sentinel.conf");
        let child = Command::new("redis-server")
            .arg(&config)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server --sentinel");
        let sentinel = Sentinel {
            port,
            dir,
            child: Some(child),
        };
        let up = eventually(Duration::from_secs(20), || {
            sentinel
                .client()
                .get_connection()
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
                .is_ok()
        });
        assert!(up, "sentinel did not start:\n{}", sentinel.log());
        sentinel
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub fn client(&self) -> redis::Client {
        redis::Client::open(self.url()).expect("sentinel url")
    }

    /// `SENTINEL MASTER name` as field → value (empty when unanswered).
    pub fn master_fields(&self, name: &str) -> HashMap<String, String> {
        let Ok(mut c) = self.client().get_connection() else {
            return HashMap::new();
        };
        let flat: Vec<String> = redis::cmd("SENTINEL")
            .arg("MASTER")
            .arg(name)
            .query(&mut c)
            .unwrap_or_default();
        flat.chunks(2)
            .filter_map(|kv| Some((kv.first()?.clone(), kv.get(1)?.clone())))
            .collect()
    }

    /// The port `SENTINEL GET-MASTER-ADDR-BY-NAME` names.
    pub fn primary_port(&self, name: &str) -> Option<u16> {
        sentinel_primary_port(self.port, name)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("sentinel.log")).unwrap_or_default()
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The primary's port that the sentinel on `sentinel_port` names for
/// `name` (`None` when it does not answer or does not know it).
pub fn sentinel_primary_port(sentinel_port: u16, name: &str) -> Option<u16> {
    let mut c = connect_local(sentinel_port)?;
    let addr: Option<(String, u16)> = redis::cmd("SENTINEL")
        .arg("GET-MASTER-ADDR-BY-NAME")
        .arg(name)
        .query(&mut c)
        .ok()?;
    addr.map(|(_, port)| port)
}

/// A connection to `127.0.0.1:port` within half a second, or `None`.
pub fn connect_local(port: u16) -> Option<redis::Connection> {
    redis::Client::open(format!("redis://127.0.0.1:{port}/"))
        .ok()?
        .get_connection_with_timeout(Duration::from_millis(500))
        .ok()
}
