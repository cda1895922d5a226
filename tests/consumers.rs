//! Effects nobody receives are not built (`src/consumers.rs`): a standalone
//! primary without AOF counts its changes towards the `save` points and
//! builds no effect; a replica that attaches mid-traffic, and an AOF switched
//! on mid-traffic, still receive every change made after their snapshot; a
//! cluster node always builds them.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use idem_testkit::{eventually, RedisConfig, RedisServer};
use redis::{Connection, Value};

/// 32 bytes, as idem-client sends.
const FP: &str = "0123456789abcdef0123456789abcdef";

fn consumed(c: &mut Connection) -> i64 {
    idem_info(c)["idem_effects_consumed"]
}

/// Waits for the node's first check to find nothing consuming its effects.
fn wait_unconsumed(c: &mut Connection) {
    assert!(
        eventually(Duration::from_secs(10), || consumed(c) == 0),
        "effects still consumed: {:?}",
        info(c, "replication")
    );
}

fn changes_since_save(c: &mut Connection) -> i64 {
    info(c, "persistence")["rdb_changes_since_last_save"]
        .parse()
        .unwrap()
}

#[test]
fn a_standalone_node_builds_no_effect_and_still_counts_its_changes() {
    let s = RedisServer::start();
    let mut c = s.conn();
    wait_unconsumed(&mut c);
    let (effects, changes) = (
        idem_info(&mut c)["idem_effects_unconsumed"],
        changes_since_save(&mut c),
    );
    let t = begin(&mut c, "a", FP, 60).token();
    assert_eq!(touch(&mut c, "a", t, 60_000), 60_000);
    complete(&mut c, "a", t, 201, b"paid", &[]);
    let t = begin(&mut c, "b", FP, 60).token();
    assert_eq!(abort(&mut c, "b", t), 1);
    // Answers that change nothing count nothing.
    assert!(matches!(begin(&mut c, "a", FP, 60), Outcome::Replay { .. }));
    assert_eq!(
        begin(&mut c, "a", "fedcba9876543210fedcba9876543210", 60),
        Outcome::Mismatch
    );
    assert_eq!(
        idem_info(&mut c)["idem_effects_unconsumed"] - effects,
        5,
        "BEGIN, TOUCH, COMPLETE, BEGIN, ABORT"
    );
    assert_eq!(changes_since_save(&mut c) - changes, 5);
    assert_eq!(consumed(&mut c), 0);

    // A fork (here BGSAVE) turns effects on before anything else runs.
    ok(&mut c, &["BGSAVE"]);
    assert_eq!(consumed(&mut c), 1);
    wait_persistence_idle(&mut c);
    wait_unconsumed(&mut c);
}

/// A cluster node always builds its effects: Valkey 9 streams the slots it
/// migrates to their new node as it propagates (`CLUSTER MIGRATESLOTS`),
/// with no replica, backlog or lasting child process to show for it.
#[test]
fn a_cluster_node_always_builds_its_effects() {
    let s = RedisConfig::default()
        .server_arg("cluster-enabled", "yes")
        .start();
    let mut c = s.conn();
    // Three checks' worth of time, each of which would have turned it off.
    sleep_ms(3 * 1000 + 500);
    assert_eq!(consumed(&mut c), 1);
    assert_eq!(idem_info(&mut c)["idem_effects_unconsumed"], 0);
}

/// Writes BEGIN + COMPLETE pairs on fresh keys until told to stop; returns
/// how many.
fn traffic(s: &RedisServer, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<usize> {
    let mut c = s.conn();
    std::thread::spawn(move || {
        let mut n = 0;
        while !stop.load(Ordering::Relaxed) {
            let key = format!("t{n}");
            let t = begin(&mut c, &key, FP, 3600).token();
            complete(&mut c, &key, t, 200, key.as_bytes(), &[]);
            n += 1;
        }
        n
    })
}

/// The primary decides BEGIN; a replica that re-ran it would issue its own
/// tokens and times, which the digests below would show.
#[test]
fn a_replica_attaching_mid_traffic_receives_every_change() {
    let primary = RedisServer::start();
    let mut p = primary.conn();
    wait_unconsumed(&mut p);
    let done = completed(&mut p, "before", FP, 3600, b"before the replica");

    let stop = Arc::new(AtomicBool::new(false));
    let writer = traffic(&primary, stop.clone());
    sleep_ms(100);
    // The testkit's servers sync without delay: the fork follows REPLICAOF
    // at once, well inside the primary's check period.
    let replica = start_replica(&primary);
    sleep_ms(300);
    stop.store(true, Ordering::Relaxed);
    let n = writer.join().unwrap();
    assert!(n > 50, "only {n} writes");

    sync_replica(&mut p);
    let mut r = replica.conn();
    assert_eq!(dbsize(&mut r), dbsize(&mut p));
    for i in 0..n {
        let key = format!("t{i}");
        assert_eq!(get(&mut r, &key), get(&mut p, &key), "{key}");
    }
    assert_eq!(get_rec(&mut r, "before").token, done);
    assert_eq!(digest(&mut r), digest(&mut p), "DEBUG DIGEST");
    assert_eq!(consumed(&mut p), 1);
}

/// `CONFIG SET appendonly yes` starts a rewrite (a fork); what follows it is
/// logged as effects, so loading the AOF back re-decides nothing.
#[test]
fn an_aof_switched_on_mid_traffic_logs_every_change_as_its_effect() {
    let s = RedisServer::start();
    let mut c = s.conn();
    wait_unconsumed(&mut c);
    completed(&mut c, "before", FP, 3600, b"before the AOF");

    let stop = Arc::new(AtomicBool::new(false));
    let writer = traffic(&s, stop.clone());
    sleep_ms(100);
    assert_eq!(
        ok(&mut c, &["CONFIG", "SET", "appendonly", "yes"]),
        Value::Okay
    );
    sleep_ms(300);
    stop.store(true, Ordering::Relaxed);
    let n = writer.join().unwrap();
    assert!(n > 50, "only {n} writes");
    wait_persistence_idle(&mut c);

    let before = digest(&mut c);
    // Loading later must not re-decide: wait so the clock differs.
    sleep_ms(50);
    assert_eq!(ok(&mut c, &["DEBUG", "LOADAOF"]), Value::Okay);
    assert_eq!(digest(&mut c), before, "DEBUG DIGEST after loading the AOF");
    assert_eq!(consumed(&mut c), 1);
}
