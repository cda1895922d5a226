//! The module side of the Postgres mirror: IDEM.MIRROR.PULL (shape, count,
//! CLAIM hiding, BLOCK), IDEM.MIRROR.ACK, COMPLETE ... MIRRORED, the pending
//! index rebuilt on every load path (DEBUG RELOAD, RDB, AOF, replica
//! promotion, RESTORE), records leaving it when expired or deleted, and the
//! INFO idem mirror fields.

mod common;

use common::*;
use idem_testkit::{eventually, RedisConfig, RedisServer};
use redis::{Connection, Value};
use std::time::{Duration, Instant};

fn pending(c: &mut Connection) -> i64 {
    idem_counter(c, "idem_mirror_pending")
}

fn oldest_ms(c: &mut Connection) -> i64 {
    idem_counter(c, "idem_mirror_oldest_pending_ms")
}

/// Everything pullable now, with a long claim.
fn pull_all(c: &mut Connection) -> Vec<String> {
    pulled_keys(&pull(c, 10_000, Some(60_000), None))
}

/// Three pending records, one acknowledged, one stored as mirrored, one in
/// progress. Returns the pending keys.
fn populate(c: &mut Connection) -> Vec<String> {
    for k in ["p1", "p2", "p3"] {
        completed(c, k, "fp", 3600, format!("body of {k}").as_bytes());
    }
    let t = completed(c, "acked", "fp", 3600, b"acked");
    assert_eq!(ack(c, "acked", t), 1);
    let t = begin(c, "mirrored", "fp", 3600).token();
    complete_mirrored(c, "mirrored", t, 200, b"pg");
    begin(c, "inprog", "fp", 3600).token();
    vec!["p1".into(), "p2".into(), "p3".into()]
}

#[test]
fn pull_shape() {
    let s = RedisServer::start();
    let mut c = s.conn();
    assert_eq!(
        ok(&mut c, &["IDEM.MIRROR.PULL", "10"]),
        Value::Array(vec![])
    );
    let t = begin(&mut c, "k", "the-fp", 120).token();
    let body: Vec<u8> = (0..=255u8).collect();
    complete(&mut c, "k", t, 201, &body, &[("a", "1"), ("b", "")]);
    let r = get_rec(&mut c, "k");

    let got = pull(&mut c, 10, None, None);
    assert_eq!(
        got,
        vec![Pulled {
            key: b"k".to_vec(),
            token: t,
            fingerprint: fp_hex(b"the-fp"),
            status: 201,
            body,
            headers: flat_headers(&[("a", "1"), ("b", "")]),
            created_at: r.created_at,
            completed_at: r.completed_at.unwrap(),
            expires_at: r.expires_at,
        }]
    );
    // Pulling neither changes nor acknowledges the record.
    assert_eq!(get_rec(&mut c, "k"), r);
    assert_eq!(pending(&mut c), 1);
}

#[test]
fn count_limits_and_only_completed_pending_records() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let mut want = populate(&mut c);
    for i in 0..22 {
        let k = format!("x{i:02}");
        completed(&mut c, &k, "fp", 3600, b"x");
        want.push(k);
    }
    want.sort();
    assert_eq!(pending(&mut c), 25);
    let mut seen = Vec::new();
    for expect in [10, 10, 5, 0] {
        let got = pull(&mut c, 10, Some(60_000), None);
        assert_eq!(got.len(), expect);
        seen.extend(pulled_keys(&got));
    }
    seen.sort();
    assert_eq!(seen, want, "every pending record exactly once");
    assert_eq!(pull(&mut c, 1, None, None), vec![]);
}

#[test]
fn claims_hide_records_until_they_lapse() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let mut c2 = s.conn();
    for i in 0..10 {
        completed(&mut c, &format!("k{i}"), "fp", 3600, b"x");
    }
    // Two writers side by side get disjoint records.
    let a = pulled_keys(&pull(&mut c, 6, Some(800), None));
    let b = pulled_keys(&pull(&mut c2, 6, Some(800), None));
    assert_eq!((a.len(), b.len()), (6, 4));
    assert!(a.iter().all(|k| !b.contains(k)));
    assert!(pull(&mut c, 10, None, None).is_empty());
    assert!(pull(&mut c2, 10, None, None).is_empty());
    // Claims lapse; unacknowledged records come back.
    sleep_ms(850);
    let mut again = pull_all(&mut c);
    again.sort();
    let mut all: Vec<String> = a.into_iter().chain(b).collect();
    all.sort();
    assert_eq!(again, all);
    assert_eq!(pending(&mut c), 10, "claims are not acknowledgements");
}

#[test]
fn block_waits_then_answers_an_empty_array() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let start = Instant::now();
    assert!(pull(&mut c, 10, None, Some(300)).is_empty());
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(290) && waited < Duration::from_secs(2),
        "{waited:?}"
    );
    // BLOCK 0 answers at once.
    let start = Instant::now();
    assert!(pull(&mut c, 10, None, Some(0)).is_empty());
    assert!(start.elapsed() < Duration::from_millis(1000));
    // A record already pending answers at once despite BLOCK.
    completed(&mut c, "ready", "fp", 3600, b"x");
    let start = Instant::now();
    assert_eq!(pulled_keys(&pull(&mut c, 10, None, Some(5000))), ["ready"]);
    assert!(start.elapsed() < Duration::from_millis(1000));
    // The server keeps serving other clients while one blocks.
    let mut other = s.conn();
    let h = pull_in_thread(c, 10, 400);
    sleep_ms(50);
    assert_eq!(
        ok(&mut other, &["PING"]),
        Value::SimpleString("PONG".into())
    );
    let (got, waited, _) = h.join().unwrap();
    assert!(got.is_empty());
    assert!(waited >= Duration::from_millis(390), "{waited:?}");
}

#[test]
fn block_wakes_when_a_record_completes() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let t = begin(&mut c, "k", "fp", 3600).token();
    let h = pull_in_thread(s.conn(), 10, 5000);
    sleep_ms(150);
    complete(&mut c, "k", t, 200, b"woke", &[]);
    let (got, waited, _) = h.join().unwrap();
    assert_eq!(pulled_keys(&got), ["k"]);
    assert_eq!(got[0].body, b"woke");
    assert!(
        waited < Duration::from_millis(2000),
        "woken late: {waited:?}"
    );
}

#[test]
fn block_returns_records_whose_claim_lapses() {
    let s = RedisServer::start();
    let mut c = s.conn();
    completed(&mut c, "k", "fp", 3600, b"x");
    assert_eq!(pull(&mut c, 10, Some(200), None).len(), 1);
    let start = Instant::now();
    let got = pull(&mut c, 10, None, Some(1000));
    assert_eq!(pulled_keys(&got), ["k"], "the lapsed claim within BLOCK");
    assert!(start.elapsed() < Duration::from_millis(1500));
}

#[test]
fn ack_replies_and_removes_for_good() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let t = completed(&mut c, "k", "fp", 3600, b"x");
    assert_eq!(pull(&mut c, 10, Some(100), None).len(), 1);
    assert_eq!(ack(&mut c, "k", t + 1), 0, "another token");
    assert_eq!(ack(&mut c, "absent", t), 0, "no key");
    assert_eq!(pending(&mut c), 1);
    assert_eq!(ack(&mut c, "k", t), 1);
    assert_eq!(pending(&mut c), 0);
    assert_eq!(get_rec(&mut c, "k").mirror.as_deref(), Some("mirrored"));
    // Delivery is at least once: a repeated ACK still matches.
    assert_eq!(ack(&mut c, "k", t), 1);
    sleep_ms(150);
    assert!(
        pull(&mut c, 10, None, None).is_empty(),
        "acked records never return"
    );
    // The record itself is unchanged apart from the mirror field.
    assert!(matches!(
        begin(&mut c, "k", "fp", 60),
        Outcome::Replay { .. }
    ));

    // An in-progress record is not acknowledged by its token.
    let t2 = begin(&mut c, "held", "fp", 3600).token();
    assert_eq!(ack(&mut c, "held", t2), 0);
    assert_eq!(get_rec(&mut c, "held").state, "in_progress");

    // Acknowledged survives a reload.
    ok(&mut c, &["DEBUG", "RELOAD"]);
    assert!(pull(&mut c, 10, None, None).is_empty());
    assert_eq!(get_rec(&mut c, "k").mirror.as_deref(), Some("mirrored"));
}

#[test]
fn mirrored_completions_are_never_pulled() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let t = begin(&mut c, "m", "fp", 3600).token();
    complete_mirrored(&mut c, "m", t, 200, b"from pg");
    assert_eq!(get_rec(&mut c, "m").mirror.as_deref(), Some("mirrored"));
    assert_eq!(pending(&mut c), 0);
    assert!(pull(&mut c, 10, None, None).is_empty());
    assert_eq!(
        begin(&mut c, "m", "fp", 60),
        Outcome::Replay {
            status: 200,
            body: b"from pg".to_vec(),
            headers: vec![]
        }
    );
    ok(&mut c, &["DEBUG", "RELOAD"]);
    assert!(pull(&mut c, 10, None, None).is_empty());
    assert_eq!(pending(&mut c), 0);
}

#[test]
fn pending_index_rebuilt_after_debug_reload() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let want = populate(&mut c);
    ok(&mut c, &["DEBUG", "RELOAD"]);
    assert_eq!(pending(&mut c), 3);
    assert_eq!(pull_all(&mut c), want);
    // The index holds no stale duplicates: ack them all and nothing is left.
    for k in &want {
        let t = get_rec(&mut c, k).token;
        assert_eq!(ack(&mut c, k, t), 1);
    }
    assert_eq!(pending(&mut c), 0);
    ok(&mut c, &["DEBUG", "RELOAD"]);
    assert_eq!(pending(&mut c), 0);
    assert!(pull_all(&mut c).is_empty());
}

#[test]
fn pending_index_rebuilt_after_rdb_restart() {
    let mut s = RedisServer::start();
    let mut c = s.conn();
    let want = populate(&mut c);
    ok(&mut c, &["SAVE"]);
    s.kill();
    s.restart();
    let mut c = s.conn();
    assert_eq!(pending(&mut c), 3);
    assert_eq!(pull_all(&mut c), want);
}

#[test]
fn pending_index_rebuilt_after_aof_restart() {
    let mut s = RedisConfig::default().aof_always().start();
    let mut c = s.conn();
    let want = populate(&mut c);
    s.kill();
    s.restart();
    let mut c = s.conn();
    assert_eq!(pending(&mut c), 3);
    assert_eq!(pull_all(&mut c), want);

    // And after a rewrite plus another acknowledgement.
    ok(&mut c, &["BGREWRITEAOF"]);
    wait_persistence_idle(&mut c);
    let t = get_rec(&mut c, "p1").token;
    assert_eq!(ack(&mut c, "p1", t), 1);
    s.kill();
    s.restart();
    let mut c = s.conn();
    assert_eq!(pending(&mut c), 2);
    assert_eq!(pull_all(&mut c), ["p2", "p3"]);
}

#[test]
fn pending_index_on_replica_and_after_promotion() {
    let primary = RedisServer::start();
    let mut p = primary.conn();
    // Some records reach the replica by full sync, some by the stream.
    completed(&mut p, "early", "fp", 3600, b"x");
    let replica = start_replica(&primary);
    let mut r = replica.conn();
    let mut want = populate(&mut p);
    want.insert(0, "early".into());
    let t = completed(&mut p, "late-acked", "fp", 3600, b"x");
    assert_eq!(ack(&mut p, "late-acked", t), 1);
    sync_replica(&mut p);
    assert_eq!(pending(&mut r), 4, "the replica tracks pending records too");
    drop(primary);
    ok(&mut r, &["REPLICAOF", "NO", "ONE"]);
    assert_eq!(pending(&mut r), 4);
    assert_eq!(pull_all(&mut r), want);
    let t = get_rec(&mut r, "p2").token;
    assert_eq!(ack(&mut r, "p2", t), 1);
    assert_eq!(pending(&mut r), 3);
}

/// `RESTORE key ttl payload options...`, which must answer OK.
fn restore_with(c: &mut Connection, key: &str, ttl: i64, payload: &[u8], options: &[&str]) {
    let v: Value = redis::cmd("RESTORE")
        .arg(key)
        .arg(ttl)
        .arg(payload)
        .arg(options)
        .query(c)
        .unwrap();
    assert_eq!(v, Value::Okay);
}

fn restore(c: &mut Connection, key: &str, payload: &[u8]) {
    restore_with(c, key, 0, payload, &[]);
}

#[test]
fn pending_index_after_restore() {
    let s = RedisServer::start();
    let other = RedisServer::start();
    let mut c = s.conn();
    let mut o = other.conn();
    populate(&mut c);
    let payload = bytes(&ok(&mut c, &["DUMP", "p1"]));
    let mirrored = bytes(&ok(&mut c, &["DUMP", "mirrored"]));
    assert_eq!(int(&ok(&mut c, &["DEL", "p1"])), 1);
    assert_eq!(pending(&mut c), 2);

    restore(&mut c, "p1-moved", &payload);
    assert_eq!(pending(&mut c), 3);
    restore(&mut o, "p1", &payload);
    restore(&mut o, "mirrored", &mirrored);
    assert_eq!(pending(&mut o), 1);
    let got = pull(&mut o, 10, None, None);
    assert_eq!(pulled_keys(&got), ["p1"]);
    assert_eq!(got[0].body, b"body of p1");
    assert_eq!(pull_all(&mut c), ["p1-moved", "p2", "p3"]);

    // RESTORE ... REPLACE over a pending record with a mirrored one.
    restore_with(&mut c, "p2", 0, &mirrored, &["REPLACE"]);
    assert_eq!(pending(&mut c), 2);
}

/// A record Redis throws away right after reading it, without telling the
/// module, is not pending: a primary's load drops keys already expired, and
/// RESTORE drops a value whose TTL has passed.
#[test]
fn records_discarded_after_loading_are_not_pending() {
    let mut s = RedisServer::start();
    let mut c = s.conn();
    completed(&mut c, "lives", "fp", 3600, b"x");
    completed(&mut c, "dies", "fp", 3600, b"x");
    ok(&mut c, &["PEXPIRE", "dies", "1000"]);
    let payload = bytes(&ok(&mut c, &["DUMP", "lives"]));
    ok(&mut c, &["SAVE"]);
    s.kill();
    sleep_ms(1_100);
    s.restart();
    let mut c = s.conn();
    assert_eq!(dbsize(&mut c), 1, "the load dropped the expired key");
    assert_eq!(pending(&mut c), 1, "and its record is not pending");

    restore_with(&mut c, "ghost", 1, &payload, &["ABSTTL"]);
    assert_eq!(int(&ok(&mut c, &["EXISTS", "ghost"])), 0);
    assert_eq!(pending(&mut c), 1, "RESTORE stored nothing");
    assert_eq!(pull_all(&mut c), ["lives"]);
}

#[test]
fn expired_and_deleted_records_drop_out() {
    let s = RedisServer::start();
    let mut c = s.conn();
    for k in ["del", "unlink", "flushed"] {
        completed(&mut c, k, "fp", 3600, b"x");
    }
    completed(&mut c, "short", "fp", 1, b"x");
    assert_eq!(pending(&mut c), 4);

    assert_eq!(int(&ok(&mut c, &["DEL", "del"])), 1);
    assert_eq!(int(&ok(&mut c, &["UNLINK", "unlink"])), 1);
    assert_eq!(pending(&mut c), 2);
    let keys = pulled_keys(&pull(&mut c, 10, Some(1), None));
    assert_eq!(keys, ["flushed", "short"]);
    sleep_ms(5);

    // Expiry, found by the active expire cycle.
    assert!(
        eventually(Duration::from_secs(5), || pending(&mut c) == 1),
        "expired record still pending"
    );
    assert_eq!(pulled_keys(&pull(&mut c, 10, Some(1), None)), ["flushed"]);
    ok(&mut c, &["FLUSHALL"]);
    assert_eq!(pending(&mut c), 0);
    assert!(pull(&mut c, 10, None, None).is_empty());
    assert_eq!(oldest_ms(&mut c), 0);

    // FLUSHDB of another database leaves this one's pending records alone.
    completed(&mut c, "kept", "fp", 3600, b"x");
    ok(&mut c, &["SELECT", "1"]);
    completed(&mut c, "gone", "fp", 3600, b"x");
    assert_eq!(pending(&mut c), 2);
    ok(&mut c, &["FLUSHDB"]);
    assert_eq!(pending(&mut c), 1);
    ok(&mut c, &["SELECT", "0"]);
    assert_eq!(pulled_keys(&pull(&mut c, 10, None, None)), ["kept"]);
}

#[test]
fn overwritten_records_drop_out() {
    let s = RedisServer::start();
    let mut c = s.conn();
    for k in ["set", "hset", "restored"] {
        completed(&mut c, k, "fp", 3600, b"x");
    }
    ok(&mut c, &["SET", "plain", "v"]);
    let payload = bytes(&ok(&mut c, &["DUMP", "plain"]));
    assert_eq!(pending(&mut c), 3);
    // SET replaces the record with a string; the pending entry goes with it.
    ok(&mut c, &["SET", "set", "now a string"]);
    assert_eq!(pending(&mut c), 2, "SET over a pending record");
    ok(&mut c, &["DEL", "hset"]);
    ok(&mut c, &["HSET", "hset", "f", "v"]);
    assert_eq!(pending(&mut c), 1);
    let v: Value = redis::cmd("RESTORE")
        .arg("restored")
        .arg(0)
        .arg(&payload[..])
        .arg("REPLACE")
        .query(&mut c)
        .unwrap();
    assert_eq!(v, Value::Okay);
    assert_eq!(
        pending(&mut c),
        0,
        "RESTORE REPLACE of a string over a pending record"
    );
    assert!(pull(&mut c, 10, None, None).is_empty());
}

#[test]
fn expired_record_is_not_pulled_even_before_it_is_reclaimed() {
    let s = RedisServer::start();
    let mut c = s.conn();
    // Stop the active expire cycle from finding it first.
    ok(&mut c, &["DEBUG", "SET-ACTIVE-EXPIRE", "0"]);
    completed(&mut c, "short", "fp", 1, b"x");
    sleep_ms(1100);
    assert!(
        pull(&mut c, 10, None, None).is_empty(),
        "an expired record was pulled"
    );
    assert_eq!(pending(&mut c), 0);
}

#[test]
fn renamed_copied_moved_and_reused_keys() {
    let s = RedisServer::start();
    let mut c = s.conn();
    completed(&mut c, "a", "fp", 3600, b"x");
    ok(&mut c, &["RENAME", "a", "b"]);
    assert_eq!(pending(&mut c), 1);
    assert_eq!(pulled_keys(&pull(&mut c, 10, Some(1), None)), ["b"]);

    // COPY makes a second pending record; MOVE takes one to another database.
    assert_eq!(int(&ok(&mut c, &["COPY", "b", "copy"])), 1);
    assert_eq!(get_rec(&mut c, "copy"), get_rec(&mut c, "b"));
    assert_eq!(pending(&mut c), 2);
    assert_eq!(int(&ok(&mut c, &["MOVE", "copy", "3"])), 1);
    assert_eq!(pending(&mut c), 2);
    sleep_ms(5);
    assert_eq!(pulled_keys(&pull(&mut c, 10, Some(1), None)), ["b"]);
    ok(&mut c, &["SELECT", "3"]);
    assert_eq!(pulled_keys(&pull(&mut c, 10, Some(1), None)), ["copy"]);
    ok(&mut c, &["FLUSHDB"]);
    ok(&mut c, &["SELECT", "0"]);
    assert_eq!(pending(&mut c), 1);

    // A key reused after its record went away: only the new version is due.
    let t1 = get_rec(&mut c, "b").token;
    ok(&mut c, &["DEL", "b"]);
    let t2 = completed(&mut c, "b", "fp2", 3600, b"v2");
    assert!(t2 > t1);
    sleep_ms(5);
    let got = pull(&mut c, 10, None, None);
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].token, got[0].body.clone()), (t2, b"v2".to_vec()));
    assert_eq!(ack(&mut c, "b", t1), 0, "the old version's ack is refused");
    assert_eq!(pending(&mut c), 1);
}

/// A completion wakes only the pullers blocked in its database: the others
/// could not receive the record and wait on.
#[test]
fn a_completion_in_another_database_does_not_wake_a_puller() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let h = pull_in_thread(s.conn(), 10, 1_000);
    sleep_ms(150);
    ok(&mut c, &["SELECT", "1"]);
    completed(&mut c, "elsewhere", "fp", 3600, b"x");
    let (got, waited, _) = h.join().unwrap();
    assert!(got.is_empty());
    assert!(
        waited >= Duration::from_millis(990),
        "woken early: {waited:?}"
    );
}

#[test]
fn pull_serves_the_selected_database() {
    let s = RedisServer::start();
    let mut c = s.conn();
    ok(&mut c, &["SELECT", "1"]);
    let t = completed(&mut c, "k1", "fp", 3600, b"db1");
    ok(&mut c, &["SELECT", "0"]);
    completed(&mut c, "k0", "fp", 3600, b"db0");
    assert_eq!(pulled_keys(&pull(&mut c, 10, None, None)), ["k0"]);
    assert_eq!(ack(&mut c, "k1", t), 0, "not in this database");
    ok(&mut c, &["SELECT", "1"]);
    let got = pull(&mut c, 10, None, None);
    assert_eq!(pulled_keys(&got), ["k1"]);
    assert_eq!(got[0].body, b"db1");
    assert_eq!(ack(&mut c, "k1", t), 1);
}

#[test]
fn info_pending_and_oldest_age() {
    let s = RedisServer::start();
    let mut c = s.conn();
    assert_eq!((pending(&mut c), oldest_ms(&mut c)), (0, 0));
    let t1 = completed(&mut c, "first", "fp", 3600, b"x");
    sleep_ms(300);
    let t2 = completed(&mut c, "second", "fp", 3600, b"x");
    let c1 = get_rec(&mut c, "first").completed_at.unwrap();
    let c2 = get_rec(&mut c, "second").completed_at.unwrap();
    assert_eq!(pending(&mut c), 2);
    // The age is measured from the oldest completion to now.
    let age_of = |c: &mut Connection, completed_at: u64| {
        let lo = now_ms() - completed_at;
        let age = oldest_ms(c) as u64;
        let hi = now_ms() - completed_at;
        assert!((lo..=hi).contains(&age), "age {age} not in {lo}..={hi}");
        age
    };
    assert!(age_of(&mut c, c1) >= 300);
    // Claiming does not change it; acknowledging the oldest does.
    pull(&mut c, 10, None, None);
    age_of(&mut c, c1);
    assert_eq!(ack(&mut c, "first", t1), 1);
    age_of(&mut c, c2);
    assert_eq!(pending(&mut c), 1);
    assert_eq!(ack(&mut c, "second", t2), 1);
    assert_eq!((pending(&mut c), oldest_ms(&mut c)), (0, 0));
    assert_eq!(idem_counter(&mut c, "idem_mirror_acks"), 2);
}

#[test]
fn a_puller_killed_after_its_wake_up_but_before_the_reply_is_freed_once() {
    // COMPLETE wakes the blocked PULL and CLIENT KILL disconnects it in the
    // same EXEC: the module must not unblock it a second time.
    let s = RedisServer::start();
    let mut c = s.conn();
    for round in 0..30 {
        let key = format!("k{round}");
        let token = begin(&mut c, &key, "fp", 60).token();
        let mut victim = s.conn();
        let id = int(&ok(&mut victim, &["CLIENT", "ID"]));
        let waiting = std::thread::spawn(move || {
            raw(&mut victim, &["IDEM.MIRROR.PULL", "10", "BLOCK", "10000"])
        });
        assert!(eventually(Duration::from_secs(5), || {
            text(&ok(&mut c, &["CLIENT", "LIST"]))
                .to_ascii_lowercase()
                .contains("cmd=idem.mirror.pull")
        }));
        complete_and_kill(&mut c, &key, token, id);
        let _ = waiting.join().unwrap();
        assert_eq!(text(&ok(&mut c, &["PING"])), "PONG", "round {round}");
        // The killed puller never got the record: it is still pending.
        assert_eq!(pending(&mut c), 1);
        assert_eq!(ack(&mut c, &key, token), 1);
    }
    assert_eq!(pending(&mut c), 0);
    assert!(!s.log().contains("crashed"), "{}", s.log());
}

/// A mirrored record renamed or copied to another name is pending again:
/// Postgres has no row under the new name. Before, it kept saying
/// "mirrored" and was never pulled.
#[test]
fn a_mirrored_record_under_a_new_name_is_pending_again() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let t = completed(&mut c, "a", "fp", 3600, b"x");
    assert_eq!(ack(&mut c, "a", t), 1);
    assert_eq!(pending(&mut c), 0);
    ok(&mut c, &["RENAME", "a", "b"]);
    assert_eq!(get_rec(&mut c, "b").mirror.as_deref(), Some("pending"));
    assert_eq!(pull_all(&mut c), ["b"]);
    assert_eq!(ack(&mut c, "b", t), 1);
    assert_eq!(int(&ok(&mut c, &["COPY", "b", "c"])), 1);
    assert_eq!(get_rec(&mut c, "b").mirror.as_deref(), Some("mirrored"));
    assert_eq!(get_rec(&mut c, "c").mirror.as_deref(), Some("pending"));
    assert_eq!(pending(&mut c), 1);
    assert_eq!(pull_all(&mut c), ["c"]);
}

/// A pending record that an AOF's RDB preamble kept although expired is put
/// in the outbox when the AOF's tail gives it a TTL again (PERSIST). Before,
/// it stayed pending with no TTL and was never pulled.
#[test]
fn a_pending_record_a_load_kept_expired_is_pulled_once_its_ttl_is_back() {
    let mut s = RedisConfig::default().aof_always().start();
    let mut c = s.conn();
    completed(&mut c, "k", "fp", 1, b"x");
    ok(&mut c, &["BGREWRITEAOF"]);
    wait_persistence_idle(&mut c);
    assert_eq!(int(&ok(&mut c, &["PERSIST", "k"])), 1);
    s.kill();
    sleep_ms(1500); // past the TTL the preamble holds
    s.restart();
    let mut c = s.conn();
    assert_eq!(pttl(&mut c, "k"), -1);
    assert_eq!(pending(&mut c), 1);
    assert_eq!(pull_all(&mut c), ["k"]);
}
