//! Every client blocked in `IDEM.BEGIN ... WAIT` or `IDEM.MIRROR.PULL ...
//! BLOCK` gets exactly one reply, on every path (issue 8): released by the
//! module around its deadline, timed out, killed, paused, and the server
//! never aborts when a lease lapses while clients are paused.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use idem_testkit::{eventually, RedisConfig, RedisServer};
use rand::RngExt;
use redis::{Connection, Value};

/// Sends `blocking` and a `ECHO marker` in one pipeline; true when both
/// replies arrive, in order (the blocking command's own reply first).
fn answered_in_step(con: &mut Connection, blocking: &redis::Cmd, marker: &str) -> bool {
    let replies: redis::RedisResult<(Value, Value)> = redis::pipe()
        .add_command(blocking.clone())
        .cmd("ECHO")
        .arg(marker)
        .query(con);
    match replies {
        Ok((first, Value::BulkString(echo))) => {
            echo == marker.as_bytes() && !matches!(first, Value::BulkString(_))
        }
        _ => false,
    }
}

fn conn_with_timeout(s: &RedisServer) -> Connection {
    let c = s.conn();
    c.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    c
}

/// The module releases a waiter just after its WAIT deadline, before Redis'
/// cron would have timed it out: the reply must still arrive, in step.
#[test]
fn a_waiter_released_right_after_its_deadline_gets_its_reply() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let mut lost = 0;
    for i in 0..60 {
        let key = format!("k{i}");
        let token = begin_lease(&mut c, &key, "fp", 100, 60_000).token();
        let mut w = conn_with_timeout(&s);
        let handle = thread::spawn(move || {
            let mut cmd = redis::cmd("IDEM.BEGIN");
            cmd.arg(&key).arg("fp").arg(100).arg("WAIT").arg(20);
            answered_in_step(&mut w, &cmd, "after-begin")
        });
        sleep_ms(25);
        complete(&mut c, &format!("k{i}"), token, 200, b"x", &[]);
        lost += usize::from(!handle.join().unwrap());
    }
    assert_eq!(lost, 0, "waiters left without their reply");
    assert_eq!(idem_counter(&mut c, "idem_waiters"), 0);
}

/// The same for a puller woken by a completion just after its BLOCK
/// deadline.
#[test]
fn a_puller_woken_right_after_its_deadline_gets_its_reply() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let mut lost = 0;
    for i in 0..60 {
        let key = format!("p{i}");
        let token = begin(&mut c, &key, "fp", 100).token();
        let mut w = conn_with_timeout(&s);
        let handle = thread::spawn(move || {
            let mut cmd = redis::cmd("IDEM.MIRROR.PULL");
            cmd.arg(10).arg("BLOCK").arg(20);
            answered_in_step(&mut w, &cmd, "after-pull")
        });
        sleep_ms(25);
        complete(&mut c, &key, token, 200, b"x", &[]);
        lost += usize::from(!handle.join().unwrap());
        ack(&mut c, &key, token);
    }
    assert_eq!(lost, 0, "pullers left without their reply");
}

/// A lease lapsing at about the waiter's own deadline.
#[test]
fn a_waiter_whose_deadline_meets_the_lease_end_gets_one_reply() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let mut lost = 0;
    for i in 0..40 {
        let key = format!("l{i}");
        begin_lease(&mut c, &key, "fp", 100, 30).token();
        let mut w = conn_with_timeout(&s);
        let mut cmd = redis::cmd("IDEM.BEGIN");
        cmd.arg(&key).arg("fp").arg(100).arg("WAIT").arg(30);
        lost += usize::from(!answered_in_step(&mut w, &cmd, "after"));
    }
    assert_eq!(lost, 0);
}

/// The crash of issue 8: a waiter's lease timer fires while clients are
/// paused and the hand-over would be propagated (AOF on). The hand-over waits
/// for the pause to end; the server stays up.
#[test]
fn a_lease_lapsing_while_clients_are_paused_hands_over_after_the_pause() {
    for pause in ["WRITE", "ALL"] {
        let s = RedisConfig::default()
            .server_arg("appendonly", "yes")
            .start();
        let mut c = s.conn();
        begin_lease(&mut c, "k", "fp", 100, 300).token();
        let mut w = conn_with_timeout(&s);
        let waiter = thread::spawn(move || {
            let v = ok(&mut w, &["IDEM.BEGIN", "k", "fp", "100", "WAIT", "5000"]);
            (Outcome::parse(&v), Instant::now())
        });
        assert!(eventually(Duration::from_secs(2), || idem_counter(
            &mut c,
            "idem_waiters"
        ) == 1));
        ok(&mut c, &["CLIENT", "PAUSE", "1000", pause]);
        let paused_at = Instant::now();
        let (outcome, at) = waiter.join().unwrap();
        assert!(matches!(outcome, Outcome::New(_)), "{pause}: {outcome:?}");
        assert!(
            at.duration_since(paused_at) >= Duration::from_millis(900),
            "{pause}: the hand-over must wait for the pause to end"
        );
        let mut c = s.conn();
        assert_eq!(text(&ok(&mut c, &["PING"])), "PONG");
        assert_eq!(get_rec(&mut c, "k").state, "in_progress");
    }
}

/// Many clients blocking with random deadlines around releases, pauses and
/// kills: each blocking command gets exactly one reply, in step.
#[test]
fn randomized_blocked_clients_are_each_answered_exactly_once() {
    let s = RedisServer::start();
    let keys = 6;
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicUsize::new(0));
    let out_of_step = Arc::new(AtomicUsize::new(0));

    // Holders: begin with short leases, complete/abort/lapse at random.
    let driver = {
        let (s_url, stop) = (s.client(), stop.clone());
        thread::spawn(move || {
            let mut c = s_url.get_connection().unwrap();
            let mut rng = rand::rng();
            while !stop.load(Ordering::Relaxed) {
                let key = format!("r{}", rng.random_range(0..keys));
                let reply = raw(&mut c, &["IDEM.BEGIN", &key, "fp", "2", "LEASE", "40"]);
                if let Ok(v) = reply {
                    if let Outcome::New(t) = Outcome::parse(&v) {
                        sleep_ms(rng.random_range(0..40));
                        let t = t.to_string();
                        match rng.random_range(0..3) {
                            0 => drop(raw(&mut c, &["IDEM.COMPLETE", &key, &t, "200", "b"])),
                            1 => drop(raw(&mut c, &["IDEM.ABORT", &key, &t])),
                            _ => {} // let the lease lapse
                        }
                    }
                }
                if rng.random_ratio(1, 40) {
                    let _ = raw(&mut c, &["CLIENT", "PAUSE", "30", "WRITE"]);
                }
                if rng.random_ratio(1, 10) {
                    let _ = raw(
                        &mut c,
                        &["CLIENT", "KILL", "USER", "default", "SKIPME", "yes"],
                    );
                }
                sleep_ms(rng.random_range(0..10));
            }
        })
    };

    let clients: Vec<_> = (0..24)
        .map(|n| {
            let (client, stop) = (s.client(), stop.clone());
            let (answered, out_of_step) = (answered.clone(), out_of_step.clone());
            thread::spawn(move || {
                let mut rng = rand::rng();
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let Ok(mut con) = client.get_connection() else {
                        continue;
                    };
                    con.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                    loop {
                        i += 1;
                        let deadline = rng.random_range(1..60);
                        let cmd = if rng.random_bool(0.7) {
                            let key = format!("r{}", rng.random_range(0..keys));
                            let mut cmd = redis::cmd("IDEM.BEGIN");
                            cmd.arg(key).arg("fp").arg(2).arg("LEASE").arg(40);
                            cmd.arg("WAIT").arg(deadline);
                            cmd
                        } else {
                            let mut cmd = redis::cmd("IDEM.MIRROR.PULL");
                            cmd.arg(5).arg("CLAIM").arg(1).arg("BLOCK").arg(deadline);
                            cmd
                        };
                        let marker = format!("c{n}-{i}");
                        let replies: redis::RedisResult<(Value, Value)> = redis::pipe()
                            .add_command(cmd)
                            .cmd("ECHO")
                            .arg(&marker)
                            .query(&mut con);
                        match replies {
                            Ok((first, Value::BulkString(echo)))
                                if echo == marker.as_bytes()
                                    && !matches!(first, Value::BulkString(_)) =>
                            {
                                answered.fetch_add(1, Ordering::Relaxed);
                            }
                            Ok(other) => {
                                eprintln!("out of step: {other:?}");
                                out_of_step.fetch_add(1, Ordering::Relaxed);
                                break;
                            }
                            Err(e) if e.is_connection_dropped() || e.is_io_error() => {
                                if e.is_timeout() {
                                    eprintln!("no reply: {e}");
                                    out_of_step.fetch_add(1, Ordering::Relaxed);
                                }
                                break; // killed: reconnect
                            }
                            Err(_) => {} // an error reply for the blocking command, in step
                        }
                        if stop.load(Ordering::Relaxed) {
                            return;
                        }
                    }
                }
            })
        })
        .collect();

    thread::sleep(Duration::from_secs(6));
    stop.store(true, Ordering::Relaxed);
    driver.join().unwrap();
    for c in clients {
        c.join().unwrap();
    }
    let mut c = s.conn();
    assert_eq!(text(&ok(&mut c, &["PING"])), "PONG");
    assert_eq!(
        out_of_step.load(Ordering::Relaxed),
        0,
        "replies lost or shifted"
    );
    let n = answered.load(Ordering::Relaxed);
    assert!(n > 500, "too few blocking commands ran: {n}");
    assert!(eventually(Duration::from_secs(2), || idem_counter(
        &mut c,
        "idem_waiters"
    ) == 0));
    println!("{n} blocking commands, each answered once");
}
