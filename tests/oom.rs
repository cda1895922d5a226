//! `maxmemory` with `noeviction`, reached by real records: BEGIN of a new
//! key and COMPLETE get a clean OOM error and write nothing; replays, 409s and
//! 422s still answer (no key, no half record,
//! same TTL), also inside MULTI and Lua; holders can still TOUCH and ABORT,
//! the mirror can still PULL and ACK, a blocked waiter is answered once; and
//! everything works again once memory is available.

mod common;

use common::*;
use idem_testkit::RedisConfig;
use redis::{Connection, Value};

fn used_memory(c: &mut Connection) -> u64 {
    info(c, "memory")["used_memory"].parse().unwrap()
}

/// Fills the node with completed 4 KiB records until BEGIN answers OOM.
fn fill_until_oom(c: &mut Connection) -> usize {
    for i in 0..100_000 {
        let key = format!("fill:{i}");
        match raw(c, &["IDEM.BEGIN", &key, "fp", "600"]) {
            Ok(v) => {
                let t = Outcome::parse(&v).token();
                let r = redis::cmd("IDEM.COMPLETE")
                    .arg(&key)
                    .arg(t)
                    .arg(200)
                    .arg(vec![b'f'; 4096])
                    .query::<Value>(c);
                if let Err(e) = r {
                    assert_eq!(e.code(), Some("OOM"), "{e}");
                    assert_eq!(get_rec(c, &key).state, "in_progress", "half written");
                    assert_eq!(abort(c, &key, t), 1);
                    return i;
                }
            }
            Err(e) => {
                assert_eq!(e.code(), Some("OOM"), "{e}");
                return i;
            }
        }
    }
    panic!("maxmemory never reached");
}

#[test]
fn deny_oom_refuses_growth_cleanly_and_lets_holders_and_the_mirror_finish() {
    let s = RedisConfig::default()
        .server_arg("maxmemory-policy", "noeviction")
        .start();
    let mut c = s.conn();
    let held = begin_lease(&mut c, "held", "fp", 600, 60_000).token();
    let released = begin(&mut c, "released", "fp", 600).token();
    let done = completed(&mut c, "done", "fp", 600, b"body");
    let limit = used_memory(&mut c) + (2 << 20);
    ok(&mut c, &["CONFIG", "SET", "maxmemory", &limit.to_string()]);

    // A waiter blocked before the node fills up.
    let mut w = s.conn();
    let waiter = std::thread::spawn(move || {
        let v = ok(
            &mut w,
            &["IDEM.BEGIN", "released", "fp", "600", "WAIT", "10000"],
        );
        (Outcome::parse(&v), ok(&mut w, &["PING"]))
    });
    let blocked = idem_testkit::eventually(std::time::Duration::from_secs(5), || {
        idem_counter(&mut c, "idem_waiters") == 1
    });
    assert!(blocked, "the waiter never blocked");
    let filled = fill_until_oom(&mut c);
    assert!(filled > 100, "only {filled} records fit");
    println!("{filled} records of 4 KiB filled 2 MiB; BEGIN and COMPLETE now answer OOM");

    let before = (
        get(&mut c, "held"),
        pexpiretime(&mut c, "held"),
        dbsize(&mut c),
    );
    let digest_before = digest(&mut c);
    for args in [
        vec!["IDEM.BEGIN", "brand-new", "fp", "600"],
        vec!["IDEM.COMPLETE", "held", &held.to_string(), "201", "late"],
    ] {
        assert_err(&mut c, &args, "OOM");
    }
    // Inside MULTI and Lua the same, and nothing of the block applies.
    let r: redis::RedisResult<Value> = redis::pipe()
        .atomic()
        .cmd("IDEM.BEGIN")
        .arg("in-multi")
        .arg("fp")
        .arg(600)
        .cmd("IDEM.COMPLETE")
        .arg("held")
        .arg(held)
        .arg(200)
        .arg("x")
        .query(&mut c);
    assert!(r.is_err(), "{r:?}");
    let (code, msg) = err(
        &mut c,
        &[
            "EVAL",
            "return redis.call('IDEM.BEGIN', KEYS[1], 'fp', '600')",
            "1",
            "in-lua",
        ],
    );
    assert!(code == "OOM" || msg.contains("OOM"), "{msg}");
    assert_eq!(digest(&mut c), digest_before, "an OOM error changed data");
    // A replay, 409 and 422 allocate nothing: they still answer (BEGIN is
    // not `deny-oom`; only a new record is refused).
    assert!(matches!(
        begin(&mut c, "done", "fp", 600),
        Outcome::Replay { .. }
    ));
    assert!(matches!(
        begin(&mut c, "held", "fp", 600),
        Outcome::InFlight(_)
    ));
    assert!(matches!(
        begin(&mut c, "done", "other", 600),
        Outcome::Mismatch
    ));
    assert_eq!(
        digest(&mut c),
        digest_before,
        "answers at maxmemory changed data"
    );
    assert_eq!(
        (
            get(&mut c, "held"),
            pexpiretime(&mut c, "held"),
            dbsize(&mut c)
        ),
        before
    );

    // What frees or keeps memory still works.
    assert_eq!(touch(&mut c, "held", held, 60_000), 60_000);
    assert!(get(&mut c, "done").is_some());
    let pulled = pull(&mut c, 10_000, None, None);
    assert!(pulled.len() >= filled, "{} pulled", pulled.len());
    assert_eq!(ack(&mut c, "done", done), 1);
    assert_eq!(abort(&mut c, "released", released), 1);
    // The waiter is answered once: the key handed over as a normal BEGIN
    // would, which the node allows (the hand-over is not a new command).
    let (outcome, pong) = waiter.join().unwrap();
    let taken = outcome.token();
    assert!(taken > released, "{outcome:?}");
    assert_eq!(pong, Value::SimpleString("PONG".into()));
    assert_eq!(get_rec(&mut c, "released").token, taken);

    // Memory back: the holder completes, new keys work.
    ok(&mut c, &["CONFIG", "SET", "maxmemory", "0"]);
    complete(&mut c, "held", held, 201, b"finally", &[]);
    assert!(matches!(
        begin(&mut c, "held", "fp", 600),
        Outcome::Replay { status: 201, .. }
    ));
    completed(&mut c, "brand-new", "fp", 600, b"ok");
}
