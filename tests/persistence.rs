//! Records survive DEBUG RELOAD, RDB save + restart, AOF (with and without a
//! rewrite, with and without the RDB preamble, effects of either format) +
//! restart, and DUMP/RESTORE to
//! another key and another server: identical via IDEM.GET, expiry and
//! DEBUG DIGEST; and MEMORY USAGE is plausible and grows with the body.

mod common;

use common::*;
use idem_testkit::{RedisConfig, RedisServer};
use redis::{Connection, Value};

/// 32 bytes, as idem-client sends: kept as sent until written out.
const FP32: &str = "0123456789abcdef0123456789abcdef";
const OTHER32: &str = "fedcba9876543210fedcba9876543210";

const KEYS: [&str; 7] = [
    "inprog", "taken", "done", "mirrored", "acked", "big", "lapsed",
];

/// Records in every state: in progress, taken over, completed with headers
/// and a binary body, completed from Postgres, acknowledged, a large body,
/// and an in-progress record whose lease lapsed without a takeover.
fn populate(c: &mut Connection) {
    begin_lease(c, "inprog", "fp-a", 3600, 600_000).token();

    let old = begin_lease(c, "taken", "fp-b", 3600, 10).token();
    sleep_ms(20);
    assert!(begin_lease(c, "taken", "fp-b", 3600, 600_000).token() > old);

    let t = begin(c, "done", FP32, 3600).token();
    let body: Vec<u8> = (0..=255u8).collect();
    complete(
        c,
        "done",
        t,
        201,
        &body,
        &[("content-type", "application/octet-stream"), ("x", "")],
    );

    let t = begin(c, "mirrored", "fp-d", 3600).token();
    complete_mirrored(c, "mirrored", t, 200, b"from postgres");

    let t = completed(c, "acked", "fp-e", 3600, b"acked body");
    assert_eq!(ack(c, "acked", t), 1);

    let t = begin(c, "big", "fp-f", 3600).token();
    complete(c, "big", t, 200, &vec![7u8; 200_000], &[]);

    begin_lease(c, "lapsed", "fp-g", 3600, 1).token();
    sleep_ms(5);
}

type Snapshot = (String, Vec<(Option<Rec>, i64)>);

fn snapshot(c: &mut Connection) -> Snapshot {
    let recs = KEYS
        .iter()
        .map(|k| (get(c, k), pexpiretime(c, k)))
        .collect::<Vec<_>>();
    (digest(c), recs)
}

/// After a reload the records behave as before.
fn still_works(c: &mut Connection, snap: &Snapshot) {
    assert!(
        snap.1.iter().all(|(r, exp)| r.is_some() && *exp > 0),
        "{snap:?}"
    );
    assert!(matches!(
        begin(c, "inprog", "fp-a", 60),
        Outcome::InFlight(_)
    ));
    assert!(matches!(
        begin(c, "taken", "fp-b", 60),
        Outcome::InFlight(_)
    ));
    assert_eq!(begin(c, "done", OTHER32, 60), Outcome::Mismatch);
    assert_eq!(
        begin(c, "done", FP32, 60),
        Outcome::Replay {
            status: 201,
            body: (0..=255u8).collect(),
            headers: flat_headers(&[("content-type", "application/octet-stream"), ("x", "")]),
        }
    );
    assert_eq!(begin(c, "mirrored", "other", 60), Outcome::Mismatch);
    // The lapsed lease is taken over with a larger token than any stored.
    let max_stored = snap
        .1
        .iter()
        .filter_map(|(r, _)| r.as_ref())
        .map(|r| r.token)
        .max()
        .unwrap();
    let t = begin(c, "lapsed", "fp-g", 60).token();
    assert!(t > max_stored, "{t} > {max_stored}");
    // The taken-over holder is still the only one that can complete.
    let taken = snap.1[1].0.as_ref().unwrap().token;
    complete(c, "taken", taken, 200, b"after reload", &[]);
}

#[test]
fn debug_reload() {
    let s = RedisServer::start();
    let mut c = s.conn();
    populate(&mut c);
    let before = snapshot(&mut c);
    assert_eq!(ok(&mut c, &["DEBUG", "RELOAD"]), Value::Okay);
    assert_eq!(snapshot(&mut c), before);
    still_works(&mut c, &before);
}

#[test]
fn rdb_save_and_restart() {
    let mut s = RedisServer::start();
    let mut c = s.conn();
    populate(&mut c);
    let before = snapshot(&mut c);
    assert_eq!(ok(&mut c, &["SAVE"]), Value::Okay);
    // Changes after the save are lost on a crash, as RDB promises.
    begin(&mut c, "after-save", "fp", 60).token();
    s.kill();
    s.restart();
    let mut c = s.conn();
    assert_eq!(snapshot(&mut c), before);
    assert_eq!(get(&mut c, "after-save"), None);
    still_works(&mut c, &before);
}

#[test]
fn rdb_bgsave_and_restart() {
    let mut s = RedisServer::start();
    let mut c = s.conn();
    populate(&mut c);
    let before = snapshot(&mut c);
    ok(&mut c, &["BGSAVE"]);
    wait_persistence_idle(&mut c);
    assert_eq!(info(&mut c, "persistence")["rdb_last_bgsave_status"], "ok");
    s.kill();
    s.restart();
    let mut c = s.conn();
    assert_eq!(snapshot(&mut c), before);
    still_works(&mut c, &before);
}

#[test]
fn aof_without_rewrite_and_restart() {
    aof_without_rewrite("1");
}

#[test]
fn aof_of_effect_format_2_and_restart() {
    aof_without_rewrite("2");
}

/// Effects logged in `effect_format` are read back as the same records.
fn aof_without_rewrite(effect_format: &str) {
    let mut s = RedisConfig::default()
        .aof_always()
        .module_arg("effect-format", effect_format)
        .start();
    let mut c = s.conn();
    populate(&mut c);
    // An abort and a touch are in the log too.
    let t = begin(&mut c, "aborted", "fp", 60).token();
    assert_eq!(abort(&mut c, "aborted", t), 1);
    let t = begin_lease(&mut c, "inprog2", "fp", 3600, 100).token();
    assert_eq!(touch(&mut c, "inprog2", t, 600_000), 600_000);
    let touched = get_rec(&mut c, "inprog2");
    let before = snapshot(&mut c);
    // Format 2 effects carry the 32-byte fingerprint as sent (no hashing on
    // the write path), format 1 its digest; never the other.
    let log = aof_bytes(&s.dir);
    let sent = [&[2u8][..], FP32.as_bytes()].concat();
    let digest = [&[1u8][..], &idem_core::fingerprint::sha256(FP32.as_bytes())].concat();
    let (held, not) = if effect_format == "2" {
        (&sent, &digest)
    } else {
        (&digest, &sent)
    };
    assert!(contains(&log, held), "the log lacks {held:?}");
    assert!(!contains(&log, not), "the log holds {not:?}");
    // Replaying later must not re-decide: wait so the clock differs.
    sleep_ms(50);
    s.kill();
    s.restart();
    let mut c = s.conn();
    assert_eq!(snapshot(&mut c), before);
    assert_eq!(get(&mut c, "aborted"), None);
    assert_eq!(get_rec(&mut c, "inprog2"), touched);
    still_works(&mut c, &before);
}

fn aof_rewrite_restart(preamble: &str) {
    let mut s = RedisConfig::default()
        .aof_always()
        .server_arg("aof-use-rdb-preamble", preamble)
        .start();
    let mut c = s.conn();
    populate(&mut c);
    ok(&mut c, &["BGREWRITEAOF"]);
    wait_persistence_idle(&mut c);
    assert_eq!(
        info(&mut c, "persistence")["aof_last_bgrewrite_status"],
        "ok"
    );
    // More changes after the rewrite land in the incremental file.
    let t = begin(&mut c, "after", "fp", 3600).token();
    complete(&mut c, "after", t, 200, b"after rewrite", &[]);
    let after = get_rec(&mut c, "after");
    let before = snapshot(&mut c);
    sleep_ms(20);
    s.kill();
    s.restart();
    let mut c = s.conn();
    assert_eq!(snapshot(&mut c), before);
    assert_eq!(get_rec(&mut c, "after"), after);
    still_works(&mut c, &before);

    // A rewrite of the reloaded data, and another restart, still agree.
    let before = (snapshot(&mut c), get_rec(&mut c, "after"));
    ok(&mut c, &["BGREWRITEAOF"]);
    wait_persistence_idle(&mut c);
    s.kill();
    s.restart();
    let mut c = s.conn();
    assert_eq!((snapshot(&mut c), get_rec(&mut c, "after")), before);
}

#[test]
fn aof_rewrite_with_rdb_preamble_and_restart() {
    aof_rewrite_restart("yes");
}

#[test]
fn aof_rewrite_without_rdb_preamble_and_restart() {
    aof_rewrite_restart("no");
}

fn dump(c: &mut Connection, key: &str) -> Vec<u8> {
    bytes(&ok(c, &["DUMP", key]))
}

fn restore(c: &mut Connection, key: &str, abs_expiry: i64, payload: &[u8], replace: bool) {
    let mut cmd = redis::cmd("RESTORE");
    cmd.arg(key).arg(abs_expiry).arg(payload).arg("ABSTTL");
    if replace {
        cmd.arg("REPLACE");
    }
    let v: Value = cmd
        .query(c)
        .unwrap_or_else(|e| panic!("RESTORE {key}: {e}"));
    assert_eq!(v, Value::Okay);
}

#[test]
fn dump_restore_to_another_key_and_server() {
    let s = RedisServer::start();
    let other = RedisServer::start();
    let mut c = s.conn();
    let mut o = other.conn();
    populate(&mut c);
    for key in KEYS {
        let rec = get_rec(&mut c, key);
        let exp = pexpiretime(&mut c, key);
        let payload = dump(&mut c, key);

        let copy = format!("{key}-copy");
        restore(&mut c, &copy, exp, &payload, false);
        assert_eq!(get_rec(&mut c, &copy), rec, "{key}");
        assert_eq!(pexpiretime(&mut c, &copy), exp);

        restore(&mut o, key, exp, &payload, false);
        assert_eq!(get_rec(&mut o, key), rec, "{key} on another server");
        assert_eq!(pexpiretime(&mut o, key), exp);
        assert_eq!(
            ok(&mut o, &["DEBUG", "DIGEST-VALUE", key]),
            ok(&mut c, &["DEBUG", "DIGEST-VALUE", key]),
            "{key} value digest"
        );
    }
    // Same dataset on both servers after the copies are removed.
    for key in KEYS {
        ok(&mut c, &["DEL", &format!("{key}-copy")]);
    }
    assert_eq!(digest(&mut o), digest(&mut c));

    // RESTORE refuses to overwrite without REPLACE, and replaces with it.
    let payload = dump(&mut c, "done");
    let exp = pexpiretime(&mut c, "done");
    let mut cmd = redis::cmd("RESTORE");
    cmd.arg("inprog").arg(0).arg(&payload[..]);
    let e = cmd.query::<Value>(&mut c).unwrap_err();
    assert_eq!(e.code(), Some("BUSYKEY"));
    restore(&mut c, "inprog", exp, &payload, true);
    assert_eq!(get_rec(&mut c, "inprog"), get_rec(&mut c, "done"));

    // Restored records work: replay, and the holder of a restored
    // in-progress record can complete on the other server.
    assert!(matches!(
        begin(&mut o, "done", FP32, 60),
        Outcome::Replay { status: 201, .. }
    ));
    let holder = get_rec(&mut o, "taken").token;
    complete(&mut o, "taken", holder, 200, b"moved", &[]);
    // A corrupted payload is refused and creates nothing.
    let mut bad = dump(&mut c, "done");
    let mid = bad.len() / 2;
    bad[mid] ^= 0xff;
    let mut cmd = redis::cmd("RESTORE");
    cmd.arg("corrupt").arg(0).arg(&bad[..]);
    assert!(cmd.query::<Value>(&mut c).is_err());
    assert_eq!(get(&mut c, "corrupt"), None);
}

fn memory_usage(c: &mut Connection, key: &str) -> i64 {
    int(&ok(c, &["MEMORY", "USAGE", key, "SAMPLES", "0"]))
}

#[test]
fn memory_usage_is_plausible_and_grows_with_the_body() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let key = "0123456789abcdef0123456789abcdef0123"; // 36 bytes
    let t = begin(&mut c, key, "fp", 3600).token();
    let in_progress = memory_usage(&mut c, key);
    complete(&mut c, key, t, 200, &[b'x'; 256], &[]);
    let small = memory_usage(&mut c, key);
    assert!(
        (256 + 36..256 + 36 + 512).contains(&small),
        "MEMORY USAGE of a 256-byte record: {small}"
    );
    assert!(
        in_progress < small && in_progress >= 36,
        "in progress {in_progress}"
    );

    let t = begin(&mut c, "large", "fp", 3600).token();
    complete(
        &mut c,
        "large",
        t,
        200,
        &vec![b'x'; 65_536],
        &[("h", &"v".repeat(1000))],
    );
    let large = memory_usage(&mut c, "large");
    assert!(
        (65_536 + 1001..65_536 + 1001 + 4096).contains(&large),
        "MEMORY USAGE of a 64 KiB record: {large}"
    );
}

/// DUMP payloads written by the first release of the module (record format
/// byte 1, RDB encoding version 1) on Redis 7.0. Later versions of the module
/// must keep loading them: stored records outlive upgrades.
const GOLDEN_DONE: &str = "078189d7a6fab79c740105c3409740a91f0131cb0647e9e17aef3eb56d0bf8aca31090399d30006decfac5bbe4ac504e5e14c93086e30873610600bea4bc29a2010000be00e32e4007200a0300c9000e200540000e7b226964223a227061795f31227d0240122000000c200340000c636f6e74656e742d747970651040102000106170706c69636174696f6e2f6a736f6e032013400002782d6e405a40000137d2a07320000000000a006a20a58baac0d1e0";
const GOLDEN_HELD: &str = "078189d7a6fab79c740105404501cc877e2ef0d694b07bee3c19e6cc3124853df061fadd51fde116439e3a543f9d881ee40873610600e5a4bc29a2010000e500e32ea2010000000000006db8bc29a2010000000a000023503816564ec0";
const GOLDEN_MIRRORED: &str = "078189d7a6fab79c740105c3404b405b1f012c7f9141283c3b8002d81d9766397cd850e4237dbe4eb44c21ffb157a8cfef1492b0bee408736106000ea5bc29a20100000e01e32e4007200a0100c82003e005000019a025201d0000000a008d6bdc3dcb0e5a8c";

#[test]
fn first_format_payloads_still_restore() {
    let s = RedisServer::start();
    let mut c = s.conn();
    for (key, payload) in [
        ("done", GOLDEN_DONE),
        ("held", GOLDEN_HELD),
        ("mir", GOLDEN_MIRRORED),
    ] {
        let v: Value = redis::cmd("RESTORE")
            .arg(key)
            .arg(0)
            .arg(hex::decode(payload).unwrap())
            .query(&mut c)
            .unwrap_or_else(|e| panic!("RESTORE {key}: {e}"));
        assert_eq!(v, Value::Okay);
    }
    assert_eq!(
        get_rec(&mut c, "done"),
        Rec {
            state: "completed".into(),
            fingerprint: fp_hex(b"fp-golden"),
            token: 1_795_996_558_526_000,
            created_at: 1_795_996_558_526,
            expires_at: NO_TTL, // RESTORE ... 0: the key has no TTL
            lease_until: None,
            status: Some(201),
            body: Some(br#"{"id":"pay_1"}"#.to_vec()),
            headers: Some(flat_headers(&[
                ("content-type", "application/json"),
                ("x-n", "7")
            ])),
            completed_at: Some(1_795_996_558_546),
            mirror: Some("pending".into()),
        }
    );
    assert_eq!(
        get_rec(&mut c, "held"),
        Rec {
            state: "in_progress".into(),
            fingerprint: fp_hex(b"fp-held"),
            token: 1_795_996_558_565_000,
            created_at: 1_795_996_558_565,
            expires_at: NO_TTL,
            lease_until: Some(1_795_996_563_565),
            status: None,
            body: None,
            headers: None,
            completed_at: None,
            mirror: None,
        }
    );
    let mir = get_rec(&mut c, "mir");
    assert_eq!(
        (
            mir.fingerprint,
            mir.token,
            mir.status,
            mir.body,
            mir.headers,
            mir.mirror
        ),
        (
            fp_hex(b"fp-m"),
            1_795_996_558_606_000,
            Some(200),
            Some(vec![]),
            Some(vec![]),
            Some("mirrored".into())
        )
    );

    // They behave: replay, a pending record for the mirror, and the holder's
    // token still completes (the token decides, not the clock).
    assert_eq!(
        begin(&mut c, "done", "fp-golden", 60),
        Outcome::Replay {
            status: 201,
            body: br#"{"id":"pay_1"}"#.to_vec(),
            headers: flat_headers(&[("content-type", "application/json"), ("x-n", "7")]),
        }
    );
    assert_eq!(pulled_keys(&pull(&mut c, 10, None, None)), ["done"]);
    complete(&mut c, "held", 1_795_996_558_565_000, 200, b"late", &[]);
    assert!(matches!(
        begin(&mut c, "held", "fp-held", 60),
        Outcome::Replay { status: 200, .. }
    ));
    // New tokens exceed every restored one.
    assert!(begin(&mut c, "fresh", "fp", 60).token() > 1_795_996_558_606_000);
}
