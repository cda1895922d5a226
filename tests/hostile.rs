//! Defects found by a hostile run (issue 8): forged tokens via RESTORE, TTL
//! changes undone by replicas and AOF replay, the outbox lost by SWAPDB, and
//! a replay that looked like a write to WATCH.

mod common;

use std::time::Duration;

use common::*;
use idem_testkit::{eventually, RedisConfig, RedisServer};
use redis::{Connection, Value};

/// CRC-64/Jones as Redis computes it for DUMP payloads (reflected,
/// polynomial 0xad93d23594c935a9, no final xor).
fn crc64(bytes: &[u8]) -> u64 {
    let mut crc = 0u64;
    for &b in bytes {
        crc ^= u64::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x95ac_9329_ac4b_c9b5
            } else {
                crc >> 1
            };
        }
    }
    crc
}

/// DUMP of `key` (stored uncompressed) with the 8 bytes `from` replaced by
/// `to` and the checksum recomputed: a payload Redis accepts as intact.
fn forged_dump(c: &mut Connection, key: &str, from: u64, to: u64) -> Vec<u8> {
    ok(c, &["CONFIG", "SET", "rdbcompression", "no"]);
    let Value::BulkString(mut payload) = ok(c, &["DUMP", key]) else {
        panic!("DUMP {key}");
    };
    let body = payload.len() - 8;
    let at = payload[..body]
        .windows(8)
        .position(|w| w == from.to_le_bytes())
        .expect("the value is in the payload");
    payload[at..at + 8].copy_from_slice(&to.to_le_bytes());
    let crc = crc64(&payload[..body]);
    payload[body..].copy_from_slice(&crc.to_le_bytes());
    payload
}

#[test]
fn crc64_matches_redis() {
    assert_eq!(crc64(b"123456789"), 0xe9c6_d914_c4b8_d9ca);
}

/// One forged RESTORE used to pin every later token of the node at
/// i64::MAX and fence every holder out (COMPLETE answered STALE).
#[test]
fn restore_refuses_forged_tokens_and_the_clock_stays_sane() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let token = begin(&mut c, "src", "fp", 100).token();
    for forged in [u64::MAX, 1 << 63, (1 << 53) + 5, 0] {
        let payload = forged_dump(&mut c, "src", token, forged);
        let reply = redis::cmd("RESTORE")
            .arg("dst")
            .arg(0)
            .arg(payload)
            .query::<Value>(&mut c);
        assert!(reply.is_err(), "token {forged} was restored");
        assert!(get(&mut c, "dst").is_none());
    }
    // A plausible-looking token far in the future (valid, below 2^53) is
    // restored, but does not drag the node's clock along.
    let future = (now_ms() + 30 * 24 * 3600 * 1000) * 1000;
    let payload = forged_dump(&mut c, "src", token, future);
    let _: Value = redis::cmd("RESTORE")
        .arg("far")
        .arg(0)
        .arg(payload)
        .query(&mut c)
        .unwrap();
    assert_eq!(get_rec(&mut c, "far").token, future);
    let t = begin(&mut c, "fresh", "fp", 100).token();
    assert!(
        t < (now_ms() + 1_000) * 1000,
        "token {t} follows the forged one"
    );
    complete(&mut c, "fresh", t, 200, b"ok", &[]);
    // And the holder of the far key is still fenced exactly.
    assert_err(
        &mut c,
        &["IDEM.COMPLETE", "far", &t.to_string(), "200", "x"],
        "STALE",
    );
    let log = s.log();
    assert!(log.contains("CORRUPT"), "refusals are logged");
}

/// A TTL changed on the primary (PERSIST, EXPIRE) used to be undone by the
/// next IDEM._PUT on replicas and by AOF replay.
#[test]
fn ttl_changes_are_followed_by_replicas_and_aof_replay() {
    let primary = RedisConfig::default()
        .server_arg("appendonly", "yes")
        .start();
    let replica = start_replica(&primary);
    let (mut p, mut r) = (primary.conn(), replica.conn());

    let t = begin(&mut p, "k", "fp", 100).token();
    ok(&mut p, &["PERSIST", "k"]);
    complete(&mut p, "k", t, 200, b"x", &[]);
    let t2 = begin(&mut p, "e", "fp", 100).token();
    ok(&mut p, &["PEXPIRE", "e", "5000000"]);
    touch(&mut p, "e", t2, 60_000);
    let expiry_e = pexpiretime(&mut p, "e") as u64;
    sync_replica(&mut p);

    for (name, c) in [("primary", &mut p), ("replica", &mut r)] {
        assert_eq!(pttl(c, "k"), -1, "{name}");
        assert_eq!(get_rec(c, "k").expires_at, NO_TTL, "{name}");
        assert_eq!(pexpiretime(c, "e") as u64, expiry_e, "{name}");
        assert_eq!(get_rec(c, "e").expires_at, expiry_e, "{name}");
    }
    assert_eq!(digest(&mut p), digest(&mut r));
    let pulled = pull(&mut p, 10, None, None);
    assert_eq!(pulled[0].expires_at, NO_TTL, "the mirror is told: no TTL");

    let before = digest(&mut p);
    ok(&mut p, &["DEBUG", "LOADAOF"]);
    assert_eq!(pttl(&mut p, "k"), -1, "AOF replay keeps the PERSIST");
    assert_eq!(pexpiretime(&mut p, "e") as u64, expiry_e);
    assert_eq!(digest(&mut p), before);
    // After an AOF rewrite too.
    ok(&mut p, &["BGREWRITEAOF"]);
    wait_persistence_idle(&mut p);
    ok(&mut p, &["DEBUG", "LOADAOF"]);
    assert_eq!(pttl(&mut p, "k"), -1);
    assert_eq!(get_rec(&mut p, "e").expires_at, expiry_e);
}

/// SWAPDB used to leave the outbox behind in the old database number: the
/// completion would never reach Postgres.
#[test]
fn swapdb_moves_the_outbox_with_the_data() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let t = begin(&mut c, "sw", "fp", 100).token();
    complete(&mut c, "sw", t, 200, b"x", &[]);
    ok(&mut c, &["SWAPDB", "0", "1"]);
    assert!(
        pull(&mut c, 10, None, None).is_empty(),
        "db 0 has nothing now"
    );
    ok(&mut c, &["SELECT", "1"]);
    assert_eq!(get_rec(&mut c, "sw").mirror.as_deref(), Some("pending"));
    assert_eq!(pulled_keys(&pull(&mut c, 10, None, None)), ["sw"]);
    assert_eq!(ack(&mut c, "sw", t), 1);
    assert_eq!(idem_counter(&mut c, "idem_mirror_pending"), 0);
}

/// A waiter stays with its database number: after SWAPDB it is answered
/// from what that database holds now (here: nothing, so it takes over).
#[test]
fn a_waiter_is_answered_from_its_database_after_swapdb() {
    let s = RedisServer::start();
    let mut c = s.conn();
    begin_lease(&mut c, "w", "fp", 100, 60_000).token();
    let mut w = s.conn();
    let h = std::thread::spawn(move || {
        Outcome::parse(&ok(
            &mut w,
            &["IDEM.BEGIN", "w", "fp", "100", "WAIT", "5000"],
        ))
    });
    assert!(eventually(Duration::from_secs(2), || idem_counter(
        &mut c,
        "idem_waiters"
    ) == 1));
    ok(&mut c, &["SWAPDB", "0", "1"]);
    let outcome = h.join().unwrap();
    let Outcome::New(t) = outcome else {
        panic!("expected a takeover of the now empty key, got {outcome:?}");
    };
    assert_eq!(get_rec(&mut c, "w").token, t);
    ok(&mut c, &["SELECT", "1"]);
    assert_ne!(get_rec(&mut c, "w").token, t, "db 1 keeps the old holder");
}

/// A replay, a mismatch, an in-flight answer or a refused command change
/// nothing, so they must not abort another client's WATCH; a change must.
#[test]
fn only_changes_abort_a_watch() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let mut other = s.conn();
    completed(&mut c, "done", "fp", 100, b"x");
    begin(&mut c, "held", "fp", 100).token();

    let watch_survives = |c: &mut Connection, key: &str, act: &dyn Fn()| -> bool {
        ok(c, &["WATCH", key]);
        act();
        let r: Value = redis::pipe().atomic().cmd("PING").query(c).unwrap();
        r != Value::Nil
    };
    let run = |args: &[&str]| {
        let mut o = s.conn();
        let _ = raw(&mut o, args);
    };
    assert!(watch_survives(&mut c, "done", &|| run(&[
        "IDEM.BEGIN",
        "done",
        "fp",
        "100"
    ])));
    assert!(watch_survives(&mut c, "done", &|| run(&[
        "IDEM.BEGIN",
        "done",
        "other",
        "100"
    ])));
    assert!(watch_survives(&mut c, "held", &|| run(&[
        "IDEM.BEGIN",
        "held",
        "fp",
        "100"
    ])));
    assert!(watch_survives(&mut c, "held", &|| run(&[
        "IDEM.COMPLETE",
        "held",
        "1",
        "200",
        "x"
    ])));
    assert!(watch_survives(&mut c, "held", &|| run(&[
        "IDEM.ABORT",
        "held",
        "1"
    ])));
    assert!(watch_survives(&mut c, "done", &|| run(&[
        "IDEM.GET", "done"
    ])));
    // Changes do abort it.
    let t = get_rec(&mut other, "held").token.to_string();
    assert!(!watch_survives(&mut c, "held", &|| run(&[
        "IDEM.TOUCH",
        "held",
        &t,
        "9000"
    ])));
    assert!(!watch_survives(&mut c, "held", &|| run(&[
        "IDEM.COMPLETE",
        "held",
        &t,
        "200",
        "y"
    ])));
    assert!(!watch_survives(&mut c, "new", &|| run(&[
        "IDEM.BEGIN",
        "new",
        "fp",
        "100"
    ])));
    let tn = get_rec(&mut other, "new").token.to_string();
    assert!(!watch_survives(&mut c, "new", &|| run(&[
        "IDEM.ABORT",
        "new",
        &tn
    ])));
    let td = get_rec(&mut other, "done").token.to_string();
    assert!(!watch_survives(&mut c, "done", &|| run(&[
        "IDEM.MIRROR.ACK",
        "done",
        &td
    ])));
}

/// RESTORE of `payload` under `key`, which must answer OK.
fn restore_payload(c: &mut Connection, key: &str, payload: &[u8]) {
    let () = redis::cmd("RESTORE")
        .arg(key)
        .arg(0)
        .arg(payload)
        .query(c)
        .unwrap();
}

/// An hour of the token clock (microseconds).
const HOUR_OF_TOKENS: u64 = 3_600_000_000;

/// A node whose tokens ran ahead of its clock (a restored record an hour
/// ahead) and that restarts from a snapshot lacking the tail of what it
/// issued resumes past a gap: it never hands out a token twice. Before, the
/// first BEGIN after the restart got the token a holder had before it.
#[test]
fn a_restart_from_an_older_snapshot_never_reissues_a_token() {
    let mut s = RedisServer::start();
    let mut c = s.conn();
    let t = begin(&mut c, "src", "fp", 3600).token();
    let payload = forged_dump(&mut c, "src", t, t + HOUR_OF_TOKENS);
    restore_payload(&mut c, "ahead", &payload);
    ok(&mut c, &["SAVE"]);
    let issued = begin(&mut c, "k", "fp", 100).token();
    assert!(issued > t + HOUR_OF_TOKENS);
    s.kill();
    s.restart();
    let mut c = s.conn();
    let again = begin(&mut c, "k", "fp", 100).token();
    assert!(again > issued, "token {again} after {issued}");
}

/// A replica promoted while its primary's tokens ran ahead of the clock
/// does not go on from the last token it applied: the old primary issued
/// more it never saw. Before, both handed out the same next token.
#[test]
fn a_promoted_replica_never_reissues_its_primarys_tokens() {
    let primary = RedisServer::start();
    let mut p = primary.conn();
    let replica = start_replica(&primary);
    let mut r = replica.conn();
    wait_link_up(&mut r);
    let t = begin(&mut p, "src", "fp", 3600).token();
    let payload = forged_dump(&mut p, "src", t, t + HOUR_OF_TOKENS);
    restore_payload(&mut p, "ahead", &payload);
    sync_replica(&mut p);
    ok(&mut r, &["REPLICAOF", "NO", "ONE"]);
    // The old primary goes on (its tokens no longer reach the replica).
    let old = begin(&mut p, "k", "fp", 100).token();
    let new = begin(&mut r, "k", "fp", 100).token();
    assert!(
        new > old,
        "token {new} from the promoted replica, {old} before"
    );
}
