//! Replication with a real replica (REPLICAOF): after every kind of command,
//! takeovers included, with effects of either format (switched at runtime
//! too), the replica holds identical records (IDEM.GET,
//! expiry, DEBUG DIGEST); read-only outcomes replicate nothing; the replica
//! refuses writes but serves IDEM.GET; a promoted replica keeps working.

mod common;

use common::*;
use idem_testkit::{eventually, RedisConfig, RedisServer};
use redis::{Connection, Value};
use std::time::Duration;

/// 32 bytes, as idem-client sends: the primary keeps it as sent, and so does
/// a replica that receives it in an effect of format 2; one that receives it
/// in a format 1 effect or a full sync (RDB) holds its SHA-256
/// (`idem_core::Fingerprint`).
const FP32: &str = "0123456789abcdef0123456789abcdef";
const OTHER32: &str = "fedcba9876543210fedcba9876543210";

/// A primary (no periodic pings, so the replication offset only moves with
/// real writes; effects in format 2, so replicas hold 32-byte fingerprints
/// as sent) and a synced replica.
fn pair() -> (RedisServer, RedisServer) {
    pair_with("2")
}

/// `pair` with the primary's effects in `effect_format`.
fn pair_with(effect_format: &str) -> (RedisServer, RedisServer) {
    let primary = RedisConfig::default()
        .server_arg("repl-ping-replica-period", "3600")
        .module_arg("effect-format", effect_format)
        .start();
    let replica = start_replica(&primary);
    (primary, replica)
}

/// Waits for the replica, then compares every key, its expiry, each value's
/// digest and the whole dataset's digest.
fn assert_same(p: &mut Connection, r: &mut Connection, keys: &[&str]) {
    sync_replica(p);
    for key in keys {
        assert_eq!(get(r, key), get(p, key), "IDEM.GET {key}");
        assert_eq!(pexpiretime(r, key), pexpiretime(p, key), "expiry of {key}");
        assert_eq!(
            ok(r, &["DEBUG", "DIGEST-VALUE", key]),
            ok(p, &["DEBUG", "DIGEST-VALUE", key]),
            "value digest of {key}"
        );
    }
    assert_eq!(digest(r), digest(p), "DEBUG DIGEST");
    assert_eq!(dbsize(r), dbsize(p));
}

fn repl_offset(c: &mut Connection) -> String {
    info(c, "replication")["master_repl_offset"].clone()
}

#[test]
fn replica_matches_after_every_command() {
    matches_after_every_command("2");
}

#[test]
fn replica_matches_after_every_command_with_effects_of_format_1() {
    matches_after_every_command("1");
}

fn matches_after_every_command(effect_format: &str) {
    let (primary, replica) = pair_with(effect_format);
    let mut p = primary.conn();
    let mut r = replica.conn();
    let keys = ["a", "b", "c", "m"];

    let ta = begin(&mut p, "a", FP32, 3600).token();
    assert_same(&mut p, &mut r, &keys);
    assert_eq!(get_rec(&mut r, "a").token, ta);

    // Takeover: the primary's decision and absolute times are replicated.
    let old = begin_lease(&mut p, "b", "fp", 3600, 20).token();
    assert_same(&mut p, &mut r, &keys);
    sleep_ms(40);
    let tb = begin_lease(&mut p, "b", "fp", 60, 5000).token();
    assert!(tb > old);
    assert_same(&mut p, &mut r, &keys);
    assert_eq!(get_rec(&mut r, "b").token, tb);

    // Touch.
    assert_eq!(touch(&mut p, "a", ta, 123_456), 123_456);
    assert_same(&mut p, &mut r, &keys);

    // Complete with headers.
    complete(&mut p, "a", ta, 201, b"body-a", &[("k", "v"), ("k2", "v2")]);
    assert_same(&mut p, &mut r, &keys);
    assert!(get_rec(&mut r, "a").is_completed());

    // Complete MIRRORED, then ACK of another record.
    complete_mirrored(&mut p, "b", tb, 200, b"pg");
    assert_same(&mut p, &mut r, &keys);
    assert_eq!(get_rec(&mut r, "b").mirror.as_deref(), Some("mirrored"));
    assert_eq!(ack(&mut p, "a", ta), 1);
    assert_same(&mut p, &mut r, &keys);
    assert_eq!(get_rec(&mut r, "a").mirror.as_deref(), Some("mirrored"));

    // Abort deletes on the replica too.
    let tc = begin(&mut p, "c", "fp", 3600).token();
    assert_same(&mut p, &mut r, &keys);
    assert_eq!(abort(&mut p, "c", tc), 1);
    assert_same(&mut p, &mut r, &keys);
    assert_eq!(get(&mut r, "c"), None);

    // Answers that change nothing replicate nothing.
    begin(&mut p, "m", "fp", 3600).token();
    sync_replica(&mut p);
    let offset = repl_offset(&mut p);
    assert!(matches!(
        begin(&mut p, "m", "fp", 3600),
        Outcome::InFlight(_)
    ));
    assert_eq!(begin(&mut p, "m", "other", 3600), Outcome::Mismatch);
    assert!(matches!(
        begin(&mut p, "a", FP32, 3600),
        Outcome::Replay { .. }
    ));
    assert_eq!(begin(&mut p, "a", OTHER32, 3600), Outcome::Mismatch);
    get(&mut p, "a");
    assert_eq!(abort(&mut p, "m", 1), 0);
    assert_eq!(ack(&mut p, "m", 1), 0);
    assert_err(&mut p, &["IDEM.COMPLETE", "m", "1", "200", "x"], "STALE");
    assert_err(&mut p, &["IDEM.BEGIN", "m", "fp", "0"], "BADARG");
    assert_eq!(
        repl_offset(&mut p),
        offset,
        "read-only outcomes must not replicate"
    );
    assert_same(&mut p, &mut r, &keys);
}

/// The effect format switched at runtime (CONFIG SET) while records of
/// both forms live on: the replica stays identical, and once promoted it
/// answers each record's fingerprint as the primary did.
#[test]
fn switching_the_effect_format_keeps_the_replica_identical() {
    // The primary logs its effects too: the log shows which format each had.
    let primary = RedisConfig::default()
        .server_arg("repl-ping-replica-period", "3600")
        .aof_always()
        .start();
    let replica = start_replica(&primary);
    let mut p = primary.conn();
    let mut r = replica.conn();
    let set_format = |c: &mut Connection, f: &str| {
        ok(c, &["CONFIG", "SET", "idem.effect-format", f]);
    };
    let keys = ["one", "two", "both"];
    let t_one = begin(&mut p, "one", FP32, 3600).token();
    let t_both = begin(&mut p, "both", FP32, 3600).token();
    assert_same(&mut p, &mut r, &keys);
    let sent = [&[2u8][..], FP32.as_bytes()].concat();
    let digest = [&[1u8][..], &idem_core::fingerprint::sha256(FP32.as_bytes())].concat();
    let log = || aof_bytes(&primary.dir);
    assert!(contains(&log(), &digest) && !contains(&log(), &sent));
    set_format(&mut p, "2");
    let t_two = begin(&mut p, "two", FP32, 3600).token();
    // Begun under format 1, completed under format 2.
    complete(&mut p, "both", t_both, 201, b"both", &[]);
    assert_same(&mut p, &mut r, &keys);
    assert!(contains(&log(), &sent), "format 2 not in effect");
    set_format(&mut p, "1");
    complete(&mut p, "one", t_one, 201, b"one", &[]);
    complete(&mut p, "two", t_two, 201, b"two", &[]);
    assert_same(&mut p, &mut r, &keys);
    drop(primary);

    assert_eq!(ok(&mut r, &["REPLICAOF", "NO", "ONE"]), Value::Okay);
    for key in keys {
        assert!(
            matches!(
                begin(&mut r, key, FP32, 60),
                Outcome::Replay { status: 201, .. }
            ),
            "{key}"
        );
        assert_eq!(begin(&mut r, key, OTHER32, 60), Outcome::Mismatch, "{key}");
    }
}

#[test]
fn value_digest_reflects_the_record() {
    let (primary, replica) = pair();
    let mut p = primary.conn();
    let mut r = replica.conn();
    let t = begin(&mut p, "k", "fp", 3600).token();
    let d1 = ok(&mut p, &["DEBUG", "DIGEST-VALUE", "k"]);
    assert_eq!(touch(&mut p, "k", t, 99_999), 99_999);
    let d2 = ok(&mut p, &["DEBUG", "DIGEST-VALUE", "k"]);
    complete(&mut p, "k", t, 200, b"x", &[]);
    let d3 = ok(&mut p, &["DEBUG", "DIGEST-VALUE", "k"]);
    assert_ne!(d1, d2, "lease change must change the digest");
    assert_ne!(d2, d3, "completion must change the digest");
    let zero = ok(&mut p, &["DEBUG", "DIGEST-VALUE", "absent"]);
    assert_ne!(d3, zero);
    assert_same(&mut p, &mut r, &["k"]);
}

#[test]
fn full_sync_carries_existing_records() {
    let primary = RedisServer::start();
    let mut p = primary.conn();
    let t = completed(&mut p, "done", "fp", 3600, b"before the replica");
    completed(&mut p, "done32", FP32, 3600, b"synced32");
    begin_lease(&mut p, "held", "fp", 3600, 600_000).token();
    let tm = begin(&mut p, "mirrored", "fp", 3600).token();
    complete_mirrored(&mut p, "mirrored", tm, 200, b"pg");
    for i in 0..500 {
        completed(&mut p, &format!("bulk:{i}"), "fp", 3600, &[b'b'; 300]);
    }
    let replica = start_replica(&primary);
    let mut r = replica.conn();
    assert_same(
        &mut p,
        &mut r,
        &["done", "held", "mirrored", "bulk:0", "bulk:499"],
    );
    assert_eq!(get_rec(&mut r, "done").token, t);

    // Promoted, the replica answers the fingerprint it got as a digest.
    assert_eq!(ok(&mut r, &["REPLICAOF", "NO", "ONE"]), Value::Okay);
    replays_fp32_only(&mut r, "done32", b"synced32");
}

/// `key`, completed with `body` for FP32, replays for FP32 and mismatches
/// for other bytes of that length.
fn replays_fp32_only(c: &mut Connection, key: &str, body: &[u8]) {
    assert_eq!(
        begin(c, key, FP32, 60),
        Outcome::Replay {
            status: 200,
            body: body.to_vec(),
            headers: vec![]
        }
    );
    assert_eq!(begin(c, key, OTHER32, 60), Outcome::Mismatch);
}

#[test]
fn expiry_is_replicated() {
    let (primary, replica) = pair();
    let mut p = primary.conn();
    let mut r = replica.conn();
    completed(&mut p, "short", "fp", 3, b"x");
    assert_same(&mut p, &mut r, &["short"]);
    let pr = pexpiretime(&mut r, "short");
    assert!(pr > 0);
    assert!(eventually(Duration::from_secs(10), || {
        int(&ok(&mut p, &["EXISTS", "short"])) == 0
    }));
    assert_same(&mut p, &mut r, &["short"]);
    assert_eq!(int(&ok(&mut r, &["DBSIZE"])), 0);
}

#[test]
fn replica_refuses_writes_and_serves_get() {
    let (primary, replica) = pair();
    let mut p = primary.conn();
    let mut r = replica.conn();
    let t = begin(&mut p, "k", "fp", 60).token();
    sync_replica(&mut p);
    assert_eq!(get_rec(&mut r, "k").token, t);
    assert_eq!(get(&mut r, "absent"), None);
    let ts = t.to_string();
    for args in [
        vec!["IDEM.BEGIN", "k2", "fp", "60"],
        vec!["IDEM.BEGIN", "k", "fp", "60"],
        vec!["IDEM.COMPLETE", "k", &ts, "200", "x"],
        vec!["IDEM.ABORT", "k", &ts],
        vec!["IDEM.TOUCH", "k", &ts, "100"],
        vec!["IDEM.MIRROR.ACK", "k", &ts],
    ] {
        let (code, msg) = err(&mut r, &args);
        assert_eq!(code, "READONLY", "{args:?} -> {msg}");
    }
    assert_same(&mut p, &mut r, &["k", "k2"]);
}

#[test]
fn promoted_replica_keeps_working() {
    let (primary, replica) = pair();
    let mut p = primary.conn();
    let mut r = replica.conn();

    // A holder mid-work, a lapsed holder, a completed record.
    let held = begin_lease(&mut p, "held", "fp", 3600, 600_000).token();
    let lapsed = begin_lease(&mut p, "lapsed", "fp", 3600, 30).token();
    let done = completed(&mut p, "done", "fp", 3600, b"done");
    completed(&mut p, "done32", FP32, 3600, b"done32");
    let mut max_token = 0;
    for i in 0..200 {
        max_token = begin(&mut p, &format!("t{i}"), "fp", 3600).token();
    }
    assert_same(&mut p, &mut r, &["held", "lapsed", "done", "done32"]);
    drop(primary);

    assert_eq!(ok(&mut r, &["REPLICAOF", "NO", "ONE"]), Value::Okay);
    assert_eq!(info(&mut r, "replication")["role"], "master");
    sleep_ms(40);

    assert!(matches!(
        begin(&mut r, "held", "fp", 60),
        Outcome::InFlight(_)
    ));
    assert_eq!(
        begin(&mut r, "done", "fp", 60),
        Outcome::Replay {
            status: 200,
            body: b"done".to_vec(),
            headers: vec![]
        }
    );
    // The replica holds a 32-byte fingerprint as sent, from the format 2
    // effect; the same bytes replay, other bytes of that length mismatch.
    replays_fp32_only(&mut r, "done32", b"done32");
    let taken = begin(&mut r, "lapsed", "fp", 60).token();
    assert!(
        taken > lapsed && taken > max_token,
        "takeover token {taken}"
    );
    assert_err(
        &mut r,
        &["IDEM.COMPLETE", "lapsed", &lapsed.to_string(), "200", "x"],
        "STALE",
    );
    // The holder that began on the old primary completes on the new one.
    complete(&mut r, "held", held, 201, b"finished after failover", &[]);
    assert!(matches!(
        begin(&mut r, "held", "fp", 60),
        Outcome::Replay { status: 201, .. }
    ));
    let fresh = begin(&mut r, "fresh", "fp", 60).token();
    assert!(fresh > max_token && fresh > taken);
    assert_err(
        &mut r,
        &["IDEM.COMPLETE", "done", &done.to_string(), "200", "x"],
        "COMPLETED",
    );
}
