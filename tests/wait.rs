//! `IDEM.BEGIN ... WAIT ms` (issue 5): duplicates block until the holder's
//! answer exists, one waiter takes over when the holder goes away, and every
//! waiter is answered by its deadline, whatever happens to the key or client.

mod common;

use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use idem_testkit::{eventually, RedisConfig, RedisServer};
use redis::Connection;

fn begin_wait(con: &mut Connection, key: &str, fp: &str, wait_ms: u64) -> Outcome {
    Outcome::parse(&ok(
        con,
        &["IDEM.BEGIN", key, fp, "60", "WAIT", &wait_ms.to_string()],
    ))
}

/// As `begin_wait` with `PACKED`; the raw reply too.
fn begin_wait_packed(con: &mut Connection, key: &str, wait_ms: u64) -> (Outcome, redis::Value) {
    let args = [
        "IDEM.BEGIN",
        key,
        "fp",
        "60",
        "WAIT",
        &wait_ms.to_string(),
        "PACKED",
    ];
    let v = ok(con, &args);
    (Outcome::parse(&v), v)
}

/// Starts `n` clients that each BEGIN ... WAIT on `key`; returns their
/// outcomes and how long each waited, once all are answered.
fn waiters(
    server: &RedisServer,
    key: &str,
    n: usize,
    wait_ms: u64,
) -> thread::JoinHandle<Vec<(Outcome, Duration, Connection)>> {
    let barrier = Arc::new(Barrier::new(n));
    let handles: Vec<_> = (0..n)
        .map(|_| {
            let (mut con, key, barrier) = (server.conn(), key.to_string(), barrier.clone());
            thread::spawn(move || {
                barrier.wait();
                let start = Instant::now();
                let outcome = begin_wait(&mut con, &key, "fp", wait_ms);
                (outcome, start.elapsed(), con)
            })
        })
        .collect();
    thread::spawn(move || {
        handles
            .into_iter()
            .map(|h| h.join().expect("waiter thread"))
            .collect()
    })
}

/// (answers `new` with `token`, answers `replay`)
fn tally(answers: &[(Outcome, Duration, Connection)], token: u64) -> (usize, usize) {
    let news = answers
        .iter()
        .filter(|(o, _, _)| *o == Outcome::New(token))
        .count();
    let replays = answers
        .iter()
        .filter(|(o, _, _)| matches!(o, Outcome::Replay { .. }))
        .count();
    (news, replays)
}

fn wait_for_waiters(con: &mut Connection, n: i64) {
    let ok = eventually(Duration::from_secs(10), || {
        idem_counter(con, "idem_waiters") == n
    });
    assert!(
        ok,
        "expected {n} waiters, INFO says {}",
        idem_counter(con, "idem_waiters")
    );
}

#[test]
fn hundred_duplicates_get_the_replay_when_the_holder_completes() {
    let server = RedisServer::start();
    let mut holder = server.conn();
    let token = begin(&mut holder, "k", "fp", 60).token();
    let started = Instant::now();
    let waiting = waiters(&server, "k", 99, 10_000);
    wait_for_waiters(&mut holder, 99);
    thread::sleep(Duration::from_millis(300).saturating_sub(started.elapsed()));
    complete(
        &mut holder,
        "k",
        token,
        201,
        b"{\"id\":7}",
        &[("content-type", "application/json")],
    );
    let answers = waiting.join().unwrap();
    let total = started.elapsed();
    let expected = Outcome::Replay {
        status: 201,
        body: b"{\"id\":7}".to_vec(),
        headers: flat_headers(&[("content-type", "application/json")]),
    };
    assert_eq!(answers.len(), 99);
    for (outcome, _, _) in &answers {
        assert_eq!(outcome, &expected);
    }
    assert!(
        total < Duration::from_millis(300 + 700),
        "all answered by {total:?}"
    );
    let info = idem_info(&mut holder);
    assert_eq!(
        (
            info["idem_waits_replay"],
            info["idem_waiters"],
            info["idem_in_flight"]
        ),
        (99, 0, 0)
    );
}

#[test]
fn a_packed_waiter_is_woken_with_a_packed_replay() {
    let server = RedisServer::start();
    let mut holder = server.conn();
    let token = begin(&mut holder, "k", "fp", 60).token();
    let mut packed = server.conn();
    let waiting = thread::spawn(move || begin_wait_packed(&mut packed, "k", 10_000));
    let plain = waiters(&server, "k", 1, 10_000);
    wait_for_waiters(&mut holder, 2);
    let headers = [("content-type", "application/json")];
    complete(&mut holder, "k", token, 201, b"{\"id\":7}", &headers);
    let expected = Outcome::Replay {
        status: 201,
        body: b"{\"id\":7}".to_vec(),
        headers: flat_headers(&headers),
    };
    let (outcome, reply) = waiting.join().unwrap();
    assert_eq!(outcome, expected);
    assert_eq!(array(&reply).len(), 2, "packed: {reply:?}");
    let plain = plain.join().unwrap();
    assert_eq!(plain[0].0, expected);
    // A waiter that timed out answers in_flight whatever its layout.
    let token = begin(&mut holder, "k2", "fp", 60).token();
    let (outcome, _) = begin_wait_packed(&mut holder, "k2", 50);
    assert!(
        matches!(outcome, Outcome::InFlight(_)),
        "{outcome:?} for {token}"
    );
}

#[test]
fn abort_hands_the_key_to_exactly_one_waiter_and_the_rest_replay_its_result() {
    let server = RedisServer::start();
    let mut holder = server.conn();
    let token = begin(&mut holder, "k", "fp", 60).token();
    let waiting = waiters(&server, "k", 10, 10_000);
    wait_for_waiters(&mut holder, 10);
    assert_eq!(abort(&mut holder, "k", token), 1);

    // Exactly one waiter now holds the key; it finishes the work.
    assert!(eventually(Duration::from_secs(5), || idem_counter(
        &mut holder,
        "idem_waiters"
    ) == 9));
    let rec = get_rec(&mut holder, "k");
    assert!(rec.token > token, "the new holder has a larger token");
    complete(&mut holder, "k", rec.token, 200, b"second try", &[]);

    let answers = waiting.join().unwrap();
    let news: Vec<_> = answers
        .iter()
        .filter(|(o, _, _)| matches!(o, Outcome::New(_)))
        .collect();
    assert_eq!(
        news.len(),
        1,
        "{answers:?}",
        answers = answers.iter().map(|a| &a.0).collect::<Vec<_>>()
    );
    assert_eq!(news[0].0, Outcome::New(rec.token));
    let replays = answers
        .iter()
        .filter(|(o, _, _)| matches!(o, Outcome::Replay { body, .. } if body == b"second try"));
    assert_eq!(replays.count(), 9);
    assert_eq!(idem_counter(&mut holder, "idem_waits_takeover"), 1);
}

#[test]
fn a_crashed_holder_is_taken_over_by_one_waiter_when_its_lease_lapses() {
    let server = RedisServer::start();
    let mut holder = server.conn();
    let token = begin_lease(&mut holder, "k", "fp", 60, 400).token();
    let started = Instant::now();
    let waiting = waiters(&server, "k", 5, 10_000);
    // The holder never completes. After the lease, exactly one waiter is new.
    assert!(eventually(Duration::from_secs(5), || idem_counter(
        &mut holder,
        "idem_waits_takeover"
    ) == 1));
    assert!(eventually(Duration::from_secs(5), || idem_counter(
        &mut holder,
        "idem_waiters"
    ) == 4));
    assert!(
        started.elapsed() >= Duration::from_millis(350),
        "not before the lease lapsed"
    );
    let rec = get_rec(&mut holder, "k");
    assert!(rec.token > token);
    // The old holder is fenced off.
    assert_err(
        &mut holder,
        &["IDEM.COMPLETE", "k", &token.to_string(), "200", "late"],
        "STALE",
    );
    complete(&mut holder, "k", rec.token, 200, b"done", &[]);
    let answers = waiting.join().unwrap();
    let (news, replays) = tally(&answers, rec.token);
    assert_eq!((news, replays), (1, 4));
}

#[test]
fn wait_shorter_than_the_work_answers_in_flight_after_wait_ms() {
    let server = RedisServer::start();
    let mut holder = server.conn();
    begin(&mut holder, "k", "fp", 60).token();
    let mut dup = server.conn();
    let start = Instant::now();
    let outcome = begin_wait(&mut dup, "k", "fp", 250);
    let waited = start.elapsed();
    assert!(
        matches!(outcome, Outcome::InFlight(ms) if ms > 0 && ms <= 30_000),
        "{outcome:?}"
    );
    assert!(
        waited >= Duration::from_millis(240) && waited < Duration::from_millis(1500),
        "{waited:?}"
    );
    let info = idem_info(&mut holder);
    assert_eq!((info["idem_waits_timeout"], info["idem_waiters"]), (1, 0));
}

#[test]
fn mismatch_replay_and_new_answer_at_once_even_with_wait() {
    let server = RedisServer::start();
    let mut con = server.conn();
    let start = Instant::now();
    let token = begin_wait(&mut con, "k", "fp", 5_000).token();
    assert_eq!(begin_wait(&mut con, "k", "other", 5_000), Outcome::Mismatch);
    complete(&mut con, "k", token, 200, b"x", &[]);
    assert!(matches!(
        begin_wait(&mut con, "k", "fp", 5_000),
        Outcome::Replay { .. }
    ));
    assert!(start.elapsed() < Duration::from_millis(1000));
}

#[test]
fn a_killed_waiter_leaks_nothing_and_the_others_still_get_their_answer() {
    let server = RedisServer::start();
    let mut holder = server.conn();
    let token = begin(&mut holder, "k", "fp", 60).token();
    let mut victim = server.conn();
    let victim_id = int(&ok(&mut victim, &["CLIENT", "ID"]));
    let victim_thread = thread::spawn(move || {
        raw(
            &mut victim,
            &["IDEM.BEGIN", "k", "fp", "60", "WAIT", "10000"],
        )
    });
    let waiting = waiters(&server, "k", 3, 10_000);
    wait_for_waiters(&mut holder, 4);
    assert_eq!(
        int(&ok(
            &mut holder,
            &["CLIENT", "KILL", "ID", &victim_id.to_string()]
        )),
        1
    );
    assert!(
        victim_thread.join().unwrap().is_err(),
        "the killed client sees its connection close"
    );
    wait_for_waiters(&mut holder, 3);
    complete(&mut holder, "k", token, 200, b"ok", &[]);
    for (o, _, _) in waiting.join().unwrap() {
        assert!(matches!(o, Outcome::Replay { .. }), "{o:?}");
    }
    assert_eq!(idem_counter(&mut holder, "idem_waiters"), 0);
    assert_eq!(text(&ok(&mut holder, &["PING"])), "PONG");
}

/// Waiters that give up while the holder's lease runs on leave nothing
/// behind on their keys: no entry, no lease timer. Before, both stayed until
/// the lease ended, which may be a year away. Two equal batches of waits on
/// fresh keys: the second must not grow memory (the first warms Redis' own
/// pools of blocked-client state).
#[test]
fn waiters_gone_before_the_lease_ends_leave_no_memory_behind() {
    const KEYS: usize = 1_000;
    const CLIENTS: usize = 20;
    let server = RedisServer::start();
    let mut c = server.conn();
    let mut holders = redis::pipe();
    for i in 0..2 * KEYS {
        holders
            .cmd("IDEM.BEGIN")
            .arg(format!("k{i}"))
            .arg("fp")
            .arg(86_400)
            .arg("LEASE")
            .arg(86_400_000)
            .ignore();
    }
    holders.query::<()>(&mut c).unwrap();
    let batch = |c: &mut Connection, first: usize| -> i64 {
        let threads: Vec<_> = (0..CLIENTS)
            .map(|t| {
                let mut w = server.conn();
                thread::spawn(move || {
                    for i in (first + t..first + KEYS).step_by(CLIENTS) {
                        let o = begin_wait(&mut w, &format!("k{i}"), "fp", 1);
                        assert!(matches!(o, Outcome::InFlight(_)), "{o:?}");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(
            eventually(Duration::from_secs(5), || {
                info(c, "clients")["connected_clients"] == "1"
            }),
            "the waiters' connections are closed"
        );
        assert_eq!(idem_counter(c, "idem_waiters"), 0);
        info(c, "memory")["used_memory"].parse().unwrap()
    };
    let warm = batch(&mut c, 0);
    let grown = batch(&mut c, KEYS) - warm;
    assert!(
        grown < 64 * 1024,
        "{grown} bytes left behind by {KEYS} waiters that are gone"
    );
}

#[test]
fn del_and_flushall_while_clients_wait_hand_the_key_to_one_waiter() {
    for wipe in [&["DEL", "k"][..], &["FLUSHALL"][..]] {
        let server = RedisServer::start();
        let mut holder = server.conn();
        begin(&mut holder, "k", "fp", 60).token();
        let waiting = waiters(&server, "k", 4, 10_000);
        wait_for_waiters(&mut holder, 4);
        ok(&mut holder, wipe);
        assert!(
            eventually(Duration::from_secs(5), || idem_counter(
                &mut holder,
                "idem_waiters"
            ) == 3),
            "{wipe:?}: one waiter takes the key"
        );
        let rec = get_rec(&mut holder, "k");
        complete(&mut holder, "k", rec.token, 200, b"after wipe", &[]);
        let answers = waiting.join().unwrap();
        let (news, replays) = tally(&answers, rec.token);
        assert_eq!((news, replays), (1, 3), "{wipe:?}");
    }
}

#[test]
fn an_expiring_key_hands_over_to_a_waiter() {
    let server = RedisServer::start();
    let mut holder = server.conn();
    ok(
        &mut holder,
        &["IDEM.BEGIN", "k", "fp", "1", "LEASE", "60000"],
    );
    let waiting = waiters(&server, "k", 2, 10_000);
    let answers = waiting.join().unwrap();
    let news = answers
        .iter()
        .filter(|(o, _, _)| matches!(o, Outcome::New(_)))
        .count();
    let timeouts = answers
        .iter()
        .filter(|(o, _, _)| matches!(o, Outcome::InFlight(_)))
        .count();
    // One takes the expired key over; the other waits on it until WAIT ends.
    assert_eq!((news, timeouts), (1, 1));
    for (_, waited, _) in &answers {
        assert!(*waited < Duration::from_millis(11_000));
    }
}

#[test]
fn server_shutdown_answers_waiters_by_closing_their_connections() {
    let mut server = RedisServer::start();
    let mut holder = server.conn();
    begin(&mut holder, "k", "fp", 60).token();
    let handles: Vec<_> = (0..3)
        .map(|_| {
            let mut con = server.conn();
            thread::spawn(move || {
                let start = Instant::now();
                (
                    raw(&mut con, &["IDEM.BEGIN", "k", "fp", "60", "WAIT", "30000"]),
                    start.elapsed(),
                )
            })
        })
        .collect();
    wait_for_waiters(&mut holder, 3);
    server.shutdown();
    for h in handles {
        let (reply, waited) = h.join().unwrap();
        assert!(reply.is_err(), "connection closed, got {reply:?}");
        assert!(waited < Duration::from_secs(10), "no hang: {waited:?}");
    }
    server.restart();
    assert_eq!(text(&ok(&mut server.conn(), &["PING"])), "PONG");
}

#[test]
fn inside_multi_and_lua_wait_answers_at_once() {
    let server = RedisServer::start();
    let mut con = server.conn();
    begin(&mut con, "k", "fp", 60).token();
    let start = Instant::now();
    let lua = ok(
        &mut con,
        &[
            "EVAL",
            "return redis.call('IDEM.BEGIN', KEYS[1], 'fp', 60, 'WAIT', 5000)",
            "1",
            "k",
        ],
    );
    assert!(matches!(Outcome::parse(&lua), Outcome::InFlight(_)));
    let multi: Vec<redis::Value> = redis::pipe()
        .atomic()
        .cmd("IDEM.BEGIN")
        .arg("k")
        .arg("fp")
        .arg(60)
        .arg("WAIT")
        .arg(5000)
        .query(&mut con)
        .unwrap();
    assert!(matches!(Outcome::parse(&multi[0]), Outcome::InFlight(_)));
    assert!(start.elapsed() < Duration::from_millis(1000));
}

#[test]
fn replicas_receive_the_same_effects_when_a_waiter_takes_over() {
    let primary = RedisConfig::default().start();
    let replica = start_replica(&primary);
    let mut p = primary.conn();
    let mut r = replica.conn();
    let token = begin_lease(&mut p, "k", "fp", 60, 300).token();
    let waiting = waiters(&primary, "k", 1, 10_000);
    let (outcome, _, _) = waiting.join().unwrap().pop().unwrap();
    let new_token = outcome.token();
    assert!(new_token > token);
    sync_replica(&mut p);
    assert_eq!(get_rec(&mut r, "k"), get_rec(&mut p, "k"));
    assert_eq!(digest(&mut r), digest(&mut p));
    assert_eq!(idem_counter(&mut r, "idem_waiters"), 0);
}

#[test]
fn a_waiter_killed_after_its_answer_but_before_the_reply_is_freed_once() {
    // COMPLETE wakes the waiter and CLIENT KILL disconnects it in the same
    // EXEC, before Redis sends the reply: the module must not unblock it a
    // second time from the disconnect callback.
    let server = RedisServer::start();
    let mut holder = server.conn();
    for round in 0..30 {
        let key = format!("k{round}");
        let token = begin(&mut holder, &key, "fp", 60).token();
        let mut victim = server.conn();
        let id = int(&ok(&mut victim, &["CLIENT", "ID"]));
        let k = key.clone();
        let waiting = thread::spawn(move || {
            raw(
                &mut victim,
                &["IDEM.BEGIN", &k, "fp", "60", "WAIT", "10000"],
            )
        });
        wait_for_waiters(&mut holder, 1);
        complete_and_kill(&mut holder, &key, token, id);
        let _ = waiting.join().unwrap();
        assert_eq!(text(&ok(&mut holder, &["PING"])), "PONG", "round {round}");
    }
    assert_eq!(idem_counter(&mut holder, "idem_waiters"), 0);
    assert!(!server.log().contains("crashed"), "{}", server.log());
}
