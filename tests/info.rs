//! The `INFO idem` section: every documented field is present, starts at
//! zero, and each counter moves by exactly one per event (outcomes,
//! takeovers, completes, aborts, touches, stale tokens, mirror fields).

mod common;

use common::*;
use idem_testkit::RedisServer;
use redis::Connection;
use std::collections::HashMap;

const FIELDS: [&str; 18] = [
    "idem_new",
    "idem_in_flight",
    "idem_replay",
    "idem_mismatch",
    "idem_takeovers",
    "idem_completes",
    "idem_aborts",
    "idem_touches",
    "idem_stale_tokens",
    "idem_mirror_pending",
    "idem_mirror_oldest_pending_ms",
    "idem_mirror_acks",
    "idem_waiters",
    "idem_waits_replay",
    "idem_waits_takeover",
    "idem_waits_timeout",
    "idem_effects_consumed",
    "idem_effects_unconsumed",
];

/// Fields that follow the node's replication and persistence, not the
/// commands run (`tests/consumers.rs`).
const NODE_STATE: [&str; 3] = [
    "idem_mirror_oldest_pending_ms",
    "idem_effects_consumed",
    "idem_effects_unconsumed",
];

/// Runs `f` and returns the counters that changed, with their deltas.
fn delta(c: &mut Connection, f: impl FnOnce(&mut Connection)) -> HashMap<String, i64> {
    let before = idem_info(c);
    f(c);
    let after = idem_info(c);
    after
        .iter()
        .filter(|(k, _)| !NODE_STATE.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0)))
        .filter(|(_, d)| *d != 0)
        .collect()
}

fn d(pairs: &[(&str, i64)]) -> HashMap<String, i64> {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

#[test]
fn every_field_is_present_and_starts_at_zero() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let i = idem_info(&mut c);
    let mut names: Vec<&str> = i.keys().map(String::as_str).collect();
    names.sort();
    let mut want = FIELDS.to_vec();
    want.sort();
    assert_eq!(names, want);
    assert!(
        i.iter()
            .all(|(k, v)| *v == 0 || k == "idem_effects_consumed" && *v == 1),
        "{i:?}"
    );
    // The section is part of INFO everything / INFO modules too.
    let all = text(&ok(&mut c, &["INFO", "everything"]));
    assert!(all.contains("idem_new:0"), "INFO everything lacks idem");
}

#[test]
fn each_event_moves_its_counter_by_one() {
    let s = RedisServer::start();
    let mut c = s.conn();

    let mut t = 0;
    assert_eq!(
        delta(&mut c, |c| t = begin(c, "k", "fp", 60).token()),
        d(&[("idem_new", 1)])
    );
    assert_eq!(
        delta(&mut c, |c| assert!(matches!(
            begin(c, "k", "fp", 60),
            Outcome::InFlight(_)
        ))),
        d(&[("idem_in_flight", 1)])
    );
    assert_eq!(
        delta(&mut c, |c| assert_eq!(
            begin(c, "k", "x", 60),
            Outcome::Mismatch
        )),
        d(&[("idem_mismatch", 1)])
    );
    assert_eq!(
        delta(&mut c, |c| assert_eq!(touch(c, "k", t, 10), 10)),
        d(&[("idem_touches", 1)])
    );
    sleep_ms(20);
    let old = t;
    // A takeover answers `new` and is also counted as a takeover.
    assert_eq!(
        delta(&mut c, |c| t = begin(c, "k", "fp", 60).token()),
        d(&[("idem_new", 1), ("idem_takeovers", 1)])
    );
    assert_eq!(
        delta(&mut c, |c| {
            assert_err(
                c,
                &["IDEM.COMPLETE", "k", &old.to_string(), "200", "x"],
                "STALE",
            )
        }),
        d(&[("idem_stale_tokens", 1)])
    );
    assert_eq!(
        delta(&mut c, |c| assert_err(
            c,
            &["IDEM.TOUCH", "k", &old.to_string(), "5"],
            "STALE"
        )),
        d(&[("idem_stale_tokens", 1)])
    );
    assert_eq!(
        delta(&mut c, |c| complete(c, "k", t, 200, b"x", &[])),
        d(&[("idem_completes", 1), ("idem_mirror_pending", 1)])
    );
    assert_eq!(
        delta(&mut c, |c| assert!(matches!(
            begin(c, "k", "fp", 60),
            Outcome::Replay { .. }
        ))),
        d(&[("idem_replay", 1)])
    );
    assert_eq!(
        delta(&mut c, |c| assert_eq!(ack(c, "k", t), 1)),
        d(&[("idem_mirror_acks", 1), ("idem_mirror_pending", -1)])
    );

    let t2 = begin(&mut c, "a", "fp", 60).token();
    assert_eq!(
        delta(&mut c, |c| assert_eq!(abort(c, "a", t2 + 1), 0)),
        d(&[("idem_stale_tokens", 1)]),
        "an abort with another token is a stale token, not an abort"
    );
    assert_eq!(
        delta(&mut c, |c| assert_eq!(abort(c, "none", 5), 0)),
        d(&[]),
        "an abort of nothing counts nothing"
    );
    assert_eq!(
        delta(&mut c, |c| assert_eq!(abort(c, "a", t2), 1)),
        d(&[("idem_aborts", 1)])
    );

    // Errors other than stale tokens count nothing.
    assert_eq!(
        delta(&mut c, |c| {
            assert_err(c, &["IDEM.BEGIN", "k", "fp", "0"], "BADARG");
            assert_err(c, &["IDEM.COMPLETE", "none", "1", "200", "x"], "NOTFOUND");
            assert_err(
                c,
                &["IDEM.COMPLETE", "k", &t.to_string(), "200", "x"],
                "COMPLETED",
            );
        }),
        d(&[])
    );

    // COMPLETE ... MIRRORED is a complete that never becomes pending.
    let t3 = begin(&mut c, "m", "fp", 60).token();
    assert_eq!(
        delta(&mut c, |c| complete_mirrored(c, "m", t3, 200, b"pg")),
        d(&[("idem_completes", 1)])
    );
}

#[test]
fn counters_add_up_over_many_calls() {
    let s = RedisServer::start();
    let mut c = s.conn();
    for i in 0..50 {
        let key = format!("k{i}");
        let t = begin(&mut c, &key, "fp", 60).token();
        begin(&mut c, &key, "fp", 60);
        if i % 2 == 0 {
            complete(&mut c, &key, t, 200, b"x", &[]);
            begin(&mut c, &key, "fp", 60);
        } else {
            abort(&mut c, &key, t);
        }
    }
    let i = idem_info(&mut c);
    assert_eq!(i["idem_new"], 50);
    assert_eq!(i["idem_in_flight"], 50);
    assert_eq!(i["idem_completes"], 25);
    assert_eq!(i["idem_replay"], 25);
    assert_eq!(i["idem_aborts"], 25);
    assert_eq!(i["idem_mirror_pending"], 25);
    // Counters are per process: CONFIG RESETSTAT is not required to clear
    // them, but they survive a DEBUG RELOAD's data reload unchanged.
    ok(&mut c, &["DEBUG", "RELOAD"]);
    let j = idem_info(&mut c);
    assert_eq!(j["idem_new"], 50);
    assert_eq!(
        j["idem_mirror_pending"], 25,
        "pending is recomputed from the data"
    );
}
