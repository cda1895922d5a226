//! The writer following a Redis Cluster (`--redis-cluster`) without a
//! restart: a manual failover (`CLUSTER FAILOVER`), a primary killed with
//! SIGKILL, a shard added and a slot with pending records resharded onto it
//! and the shard removed again; with following off (`--redis` of the original
//! primaries) the same kill leaves records unmirrored. Also runs
//! `scripts/cluster.sh` once. The tests run one at a time: each starts its
//! own cluster, and failure detection wants the two cores.

mod common;

use std::time::Duration;

use common::failover::*;
use common::*;
use idem_testkit::cluster::{cluster_slots, connect_local, RedisCluster};
use idem_testkit::{eventually, PgDatabase};

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `cluster-node-timeout`: small, so a killed primary is replaced in a few seconds.
const NODE_TIMEOUT_MS: u64 = 1500;

/// A hash tag whose slot node `primary` serves.
fn tag_on(cluster: &mut RedisCluster, primary: usize, prefix: &str) -> String {
    (0..)
        .map(|i| format!("{prefix}{i}"))
        .find(|tag| cluster.owner_of_slot(slot_of(tag)) == primary)
        .expect("some tag lands on every primary")
}

/// The cluster slot of keys tagged `{tag}`: CRC16 (XMODEM) of the tag.
fn slot_of(tag: &str) -> u16 {
    crc16::State::<crc16::XMODEM>::calculate(tag.as_bytes()) % 16384
}

/// Routes a tag's shard to whichever node serves its slot now, asking the
/// nodes on `ports` (any that answers) with `CLUSTER SLOTS`.
fn cluster_route(ports: Vec<u16>, tags: Vec<String>) -> Route {
    Box::new(move |shard| {
        let slot = slot_of(&tags[shard]);
        let owner = ports.iter().find_map(|port| {
            cluster_slots(&mut connect_local(*port)?)
                .into_iter()
                .find_map(|(from, to, owner)| (from..=to).contains(&slot).then_some(owner))
        })?;
        connect_local(owner).map(|c| (owner, c))
    })
}

fn pending(cluster: &RedisCluster, node: usize) -> i64 {
    info_field(&mut cluster.conn(node), "idem_mirror_pending")
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Failover {
    /// `CLUSTER FAILOVER` on the replica: the old primary becomes its replica.
    Manual,
    /// SIGKILL of the primary: the cluster promotes its replica.
    Kill,
}

/// The cluster as a failover test drives it.
struct ClusterSetup {
    cluster: RedisCluster,
    kind: Failover,
    victim: usize,
    replica: usize,
}

impl FailoverSetup for ClusterSetup {
    fn replica_pending(&mut self) -> i64 {
        pending(&self.cluster, self.replica)
    }

    fn fail_over(&mut self) {
        let replica = self.replica;
        match self.kind {
            Failover::Manual => self.cluster.manual_failover(replica),
            Failover::Kill => {
                self.cluster.nodes[self.victim].kill();
                let promoted = eventually(Duration::from_secs(30), || {
                    self.cluster.role(replica) == "master"
                });
                assert!(promoted, "the replica was not promoted");
            }
        }
    }

    fn pending_on_primaries(&mut self) -> i64 {
        self.cluster.wait_healthy(Duration::from_secs(30));
        let primaries = self.cluster.primaries();
        assert!(primaries.contains(&self.replica), "{primaries:?}");
        primaries.iter().map(|&p| pending(&self.cluster, p)).sum()
    }
}

/// A 3+3 cluster, the writer following it (or a fixed list of its
/// primaries), load on every shard, and `kind` of failover of one shard.
async fn failover_run(kind: Failover, follow: bool) -> Run {
    let mut cluster = RedisCluster::start(3, 1, NODE_TIMEOUT_MS);
    let db = PgDatabase::create();
    migrate(&db.url).await;

    let primaries = cluster.primaries();
    assert_eq!(primaries.len(), 3);
    let victim = primaries[0];
    let replica = cluster.replica_of(victim);
    let urls = cluster.urls();
    let mut args: Vec<&str> = vec!["--batch-size", "100", "--shutdown-grace", "3s"];
    if follow {
        args.extend(["--redis-cluster", urls[primaries[1]].as_str()]);
    } else {
        for &p in &primaries {
            args.extend(["--redis", urls[p].as_str()]);
        }
    }
    let writer = WriterProcess::start(&[], &db.url, &args);
    let tags: Vec<String> = primaries
        .iter()
        .map(|&p| tag_on(&mut cluster, p, "shard"))
        .collect();
    let ports: Vec<u16> = cluster.nodes.iter().map(|n| n.port).collect();
    let route = cluster_route(ports, tags.clone());
    let (victim_port, promoted_port) = (cluster.nodes[victim].port, cluster.nodes[replica].port);
    let mut setup = ClusterSetup {
        cluster,
        kind,
        victim,
        replica,
    };
    drive(
        &mut setup,
        writer,
        &db.url,
        tags,
        route,
        follow,
        (victim_port, promoted_port),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writer_follows_a_manual_cluster_failover() {
    let _serial = SERIAL.lock().await;
    let mut run = failover_run(Failover::Manual, true).await;
    assert_followed(&mut run);
    // A manual failover waits for the replica to catch up: nothing is lost.
    assert_eq!(
        run.outcome.survived, run.outcome.completed,
        "{:?}",
        run.outcome
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writer_follows_a_killed_primary() {
    let _serial = SERIAL.lock().await;
    let mut run = failover_run(Failover::Kill, true).await;
    assert_followed(&mut run);
}

/// Teeth: the same kill with a fixed list of the original primaries strands
/// the records of the promoted replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_following_a_killed_primary_strands_records() {
    let _serial = SERIAL.lock().await;
    let run = failover_run(Failover::Kill, false).await;
    assert_stranded(&run);
}

/// A shard added while running, a slot whose records are pending (some
/// already claimed by the writer) moved onto it, then moved back and the
/// shard removed: the writer starts and retires the new primary's mirror,
/// the records moved are mirrored once from where they are, and the source
/// node's mirror keeps going (its acknowledgements for moved keys answer
/// MOVED).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writer_follows_added_and_removed_shards() {
    let _serial = SERIAL.lock().await;
    let mut cluster = RedisCluster::start(3, 0, 5000);
    let db = PgDatabase::create();
    migrate(&db.url).await;
    let pg = connect_pg(&db.url).await;
    install_regression_trap(&pg).await;
    let seed = cluster.urls()[0].clone();
    let args = [
        "--redis-cluster",
        seed.as_str(),
        "--batch-size",
        "50",
        "--topology-interval",
        "300ms",
    ];
    let writer = WriterProcess::start(&[], &db.url, &args);
    let source = cluster.primaries()[0];
    let moving = tag_on(&mut cluster, source, "moving");
    let staying = tag_on(&mut cluster, source, "staying");
    let metrics_show = |port: u16, value: f64| {
        eventually(Duration::from_secs(20), || {
            let (_, text) = writer.http_get("/metrics");
            metric(&text, &node_series("idem_writer_node_mirrored", port)) == Some(value)
        })
    };
    assert!(metrics_show(cluster.nodes[source].port, 1.0));

    let lock = TableLock::take(&db.url).await;
    let batch = |tag: &str, from: usize| keys(&format!("{{{tag}}}:k"), from..from + 300);
    let mut expected = complete_keys(&mut cluster.conn(source), &batch(&moving, 0), 3600);
    tokio::time::sleep(Duration::from_millis(500)).await; // the writer claims two batches
    let added = cluster.add_primary();
    let added_port = cluster.nodes[added].port;
    assert!(metrics_show(added_port, 1.0), "{}", writer.log_tail());
    cluster.migrate_slot(slot_of(&moving), source, added);
    assert_eq!(pending(&cluster, added), 300);
    lock.release().await;

    expected.extend(complete_keys(
        &mut cluster.conn(source),
        &batch(&staying, 0),
        3600,
    ));
    expected.extend(complete_keys(
        &mut cluster.conn(added),
        &batch(&moving, 300),
        3600,
    ));
    let drained = eventually(Duration::from_secs(30), || {
        pending(&cluster, source) == 0 && pending(&cluster, added) == 0
    });
    assert!(drained, "pending records left:\n{}", writer.log_tail());

    cluster.migrate_slot(slot_of(&moving), added, source);
    cluster.remove_node(added);
    assert!(metrics_show(added_port, 0.0), "{}", writer.log_tail());
    expected.extend(complete_keys(
        &mut cluster.conn(source),
        &batch(&moving, 600),
        3600,
    ));
    let drained = eventually(Duration::from_secs(30), || pending(&cluster, source) == 0);
    assert!(drained, "pending records left:\n{}", writer.log_tail());

    // Not `assert_mirrored_exactly`: MIGRATE carries a key's TTL relative,
    // so Redis' `expires_at` moves by the migration's milliseconds while the
    // row (same token) keeps the one it was mirrored with.
    let source_port = cluster.nodes[source].port;
    let done: Vec<Done> = expected
        .into_iter()
        .map(|completion| Done {
            completion,
            port: source_port,
            replicated: false,
        })
        .collect();
    let tags = vec![moving, staying];
    let mut route = cluster_route(vec![source_port], tags.clone());
    let outcome = check(&done, &tags, &mut route, &pg).await;
    assert_eq!(row_count(&pg).await, 1200);
    assert_eq!(outcome.survived, 1200, "{outcome:?}");
    assert_eq!(outcome.unmirrored, 0, "{outcome:?}");
    assert_eq!(outcome.unacknowledged, 0, "{outcome:?}");
    assert_no_regressions(&pg).await;
    let (_, text) = writer.http_get("/metrics");
    assert!(
        metric(&text, "idem_writer_topology_changes_total") >= Some(3.0),
        "{text}"
    );
    assert_eq!(writer.http_get("/healthz"), (200, "ok\n".to_string()));
}

/// `scripts/cluster.sh start|status|stop|purge` on ports of its own: the
/// client routes through it and the writer mirrors it from one seed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_script_starts_a_cluster_the_writer_mirrors() {
    let _serial = SERIAL.lock().await;
    let base = free_port_range();
    let data = idem_testkit::scratch_dir("cluster-sh");
    let script = |command: &str| {
        let out =
            std::process::Command::new(idem_testkit::workspace_root().join("scripts/cluster.sh"))
                .arg(command)
                .env("CLUSTER_PORT_BASE", base.to_string())
                .env("CLUSTER_DATA", &data)
                .env("IDEM_MODULE", idem_testkit::module_path())
                .output()
                .expect("run scripts/cluster.sh");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let _stop = Defer(|| {
        script("purge");
    });
    let (ok, out) = script("start");
    assert!(ok, "{out}");
    let (ok, status) = script("status");
    assert!(ok && status.contains("cluster_state:ok"), "{status}");
    assert_eq!(status.matches(": master").count(), 3, "{status}");
    assert_eq!(status.matches(": slave").count(), 3, "{status}");

    let db = PgDatabase::create();
    let seed = format!("redis://127.0.0.1:{base}/");
    let writer = WriterProcess::start(&[], &db.url, &["--redis-cluster", &seed]);
    let client = redis::cluster::ClusterClient::new(vec![seed.clone()]).unwrap();
    let mut conn = client.get_connection().unwrap();
    let mut tokens = std::collections::HashMap::new();
    for i in 0..60 {
        let key = format!("{{tenant-{}}}:pay-{i}", i % 12);
        let reply: (String, i64) = redis::cmd("IDEM.BEGIN")
            .arg(&key)
            .arg("fp")
            .arg(600)
            .query(&mut conn)
            .unwrap();
        assert_eq!(reply.0, "new");
        let _: () = redis::cmd("IDEM.COMPLETE")
            .arg(&key)
            .arg(reply.1)
            .arg(201)
            .arg("{}")
            .query(&mut conn)
            .unwrap();
        tokens.insert(key, reply.1);
    }
    let pg = connect_pg(&db.url).await;
    let mirrored = wait_until(Duration::from_secs(30), || async {
        row_count(&pg).await == 60
    })
    .await;
    assert!(mirrored, "{}", writer.log_tail());
    let rows = rows(&pg).await;
    assert!(tokens.iter().all(|(k, t)| rows[k].token == *t));
    let mirrored_nodes = |text: &str| {
        text.lines()
            .filter(|l| l.starts_with("idem_writer_node_mirrored{") && l.ends_with(" 1"))
            .count()
    };
    let (_, text) = writer.http_get("/metrics");
    assert_eq!(mirrored_nodes(&text), 3, "{text}\n{}", writer.log_tail());
    drop(writer);

    let (ok, out) = script("stop");
    assert!(ok, "{out}");
    let (up, status) = script("status");
    assert!(!up && status.matches(": down").count() == 6, "{status}");
}

/// Runs the closure on drop (cleanup that must happen when a test fails).
struct Defer<F: FnMut()>(F);

impl<F: FnMut()> Drop for Defer<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// A base port with the six ports after it and their bus ports (+10000)
/// free, away from the default 7101.
fn free_port_range() -> u16 {
    (7400..9000)
        .step_by(10)
        .find(|base| {
            (0..6).all(|i| {
                [base + i, base + i + 10_000]
                    .iter()
                    .all(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok())
            })
        })
        .expect("a free port range")
}
