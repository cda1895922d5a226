//! Redis Cluster: every IDEM.* command that takes a key is routed by its key
//! (MOVED from the wrong node), a cluster client reaches all four outcomes on
//! any slot, and each primary's mirror index holds exactly its own records.

mod common;

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use common::*;
use idem_testkit::{eventually, RedisConfig, RedisServer};
use redis::cluster::ClusterClient;
use redis::Value;

fn begin_on(cluster: &mut redis::cluster::ClusterConnection, key: &str, fp: &str) -> Value {
    redis::cmd("IDEM.BEGIN")
        .arg(key)
        .arg(fp)
        .arg(600)
        .query(cluster)
        .unwrap()
}

fn start_cluster() -> Vec<RedisServer> {
    let nodes: Vec<RedisServer> = (0..3)
        .map(|_| {
            RedisConfig::default()
                .server_arg("cluster-enabled", "yes")
                .server_arg("cluster-node-timeout", "5000")
                .start()
        })
        .collect();
    let addrs: Vec<String> = nodes
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port))
        .collect();
    let out = Command::new("redis-cli")
        .arg("--cluster")
        .arg("create")
        .args(&addrs)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .output()
        .expect("redis-cli --cluster create");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    for node in &nodes {
        let mut c = node.conn();
        let ok = eventually(Duration::from_secs(20), || {
            info(&mut c, "cluster")
                .get("cluster_enabled")
                .map(String::as_str)
                == Some("1")
                && text(&ok(&mut c, &["CLUSTER", "INFO"])).contains("cluster_state:ok")
        });
        assert!(ok, "cluster never became ok");
    }
    nodes
}

#[test]
fn commands_route_by_key_and_each_primary_mirrors_its_own_records() {
    let nodes = start_cluster();
    let urls: Vec<String> = nodes.iter().map(|n| n.url()).collect();
    let client = ClusterClient::new(urls).unwrap();
    let mut cluster = client.get_connection().unwrap();

    let keys: Vec<String> = (0..200)
        .map(|i| format!("idem:{{tenant-{}}}:key-{i}", i % 20))
        .collect();
    for key in &keys {
        let v = begin_on(&mut cluster, key, "fp");
        let token = Outcome::parse(&v).token();
        let v = begin_on(&mut cluster, key, "other");
        assert_eq!(Outcome::parse(&v), Outcome::Mismatch);
        let v = begin_on(&mut cluster, key, "fp");
        assert!(matches!(Outcome::parse(&v), Outcome::InFlight(_)));
        let _: () = redis::cmd("IDEM.COMPLETE")
            .arg(key)
            .arg(token)
            .arg(201)
            .arg(key.as_bytes())
            .query(&mut cluster)
            .unwrap();
        let v = begin_on(&mut cluster, key, "fp");
        assert!(
            matches!(Outcome::parse(&v), Outcome::Replay { ref body, .. } if body == key.as_bytes())
        );
    }

    // A node that does not own a key's slot answers MOVED, for every keyed command.
    let mut moved = 0;
    for node in &nodes {
        let mut c = node.conn();
        for key in &keys[..20] {
            if let Err(e) = raw(&mut c, &["IDEM.GET", key.as_str()]) {
                assert_eq!(e.code(), Some("MOVED"), "{e}");
                let e = raw(&mut c, &["IDEM.BEGIN", key.as_str(), "fp", "60"]).unwrap_err();
                assert_eq!(e.code(), Some("MOVED"));
                let e = raw(&mut c, &["IDEM.MIRROR.ACK", key.as_str(), "1"]).unwrap_err();
                assert_eq!(e.code(), Some("MOVED"));
                moved += 1;
            }
        }
    }
    assert_eq!(
        moved,
        20 * 2,
        "each key is owned by exactly one of three nodes"
    );

    // PULL is keyless: each primary hands out exactly the records of its slots.
    let mut seen = BTreeSet::new();
    for node in &nodes {
        let mut c = node.conn();
        let pulled = pull(&mut c, 1000, None, None);
        for p in &pulled {
            let key = String::from_utf8(p.key.clone()).unwrap();
            let slot = int(&ok(&mut c, &["CLUSTER", "KEYSLOT", key.as_str()]));
            let owner = int(&ok(
                &mut c,
                &["CLUSTER", "COUNTKEYSINSLOT", &slot.to_string()],
            ));
            assert!(
                owner > 0,
                "{key} pulled from a node that does not own slot {slot}"
            );
            assert!(seen.insert(key));
        }
    }
    assert_eq!(seen, keys.iter().cloned().collect::<BTreeSet<_>>());
}

/// A key moves to another node with its slot (`MIGRATE`) while a client
/// waits on it (`BEGIN ... WAIT`) on the old node: the waiter is answered
/// `in_flight`, to ask again where routing sends it, and the holder's record
/// on the new node stays the key's only one. Before, MIGRATE's `del` made
/// the waiter a second holder on the old node (a payment could run twice),
/// and its record there stopped the slot's hand-over.
#[test]
fn a_waiter_on_a_key_that_moves_with_its_slot_is_told_to_ask_again() {
    let mut cluster = idem_testkit::cluster::RedisCluster::start(3, 0, 5000);
    let slot: u16 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg("k")
        .query(&mut cluster.conn(0))
        .unwrap();
    let from = cluster.owner_of_slot(slot);
    let to = (from + 1) % 3;
    let mut source = cluster.conn(from);
    let Outcome::New(token) = begin_lease(&mut source, "k", "fp", 600, 60_000) else {
        panic!("the holder's BEGIN is new");
    };
    let mut waiting = cluster.conn(from);
    let waiter = std::thread::spawn(move || {
        Outcome::parse(&ok(
            &mut waiting,
            &["IDEM.BEGIN", "k", "fp", "600", "WAIT", "10000"],
        ))
    });
    assert!(eventually(Duration::from_secs(5), || idem_counter(
        &mut source,
        "idem_waiters"
    ) == 1));
    cluster.migrate_slot(slot, from, to);
    assert!(matches!(waiter.join().unwrap(), Outcome::InFlight(_)));
    let moved = get_rec(&mut cluster.conn(to), "k");
    assert_eq!((moved.state.as_str(), moved.token), ("in_progress", token));
    let left: i64 = redis::cmd("CLUSTER")
        .arg("COUNTKEYSINSLOT")
        .arg(slot)
        .query(&mut source)
        .unwrap();
    assert_eq!(left, 0, "no record stays behind on the old node");
    assert_eq!(idem_counter(&mut source, "idem_waiters"), 0);
}
