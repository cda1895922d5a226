//! Concurrency: many clients (each its own connection, released together)
//! racing BEGIN on one key get exactly one `new`; racing holders across
//! takeovers never both complete; many keys in parallel each behave alone.

mod common;

use common::*;
use idem_testkit::RedisServer;
use redis::Value;
use std::collections::HashMap;
use std::sync::{Arc, Barrier};
use std::thread;

/// Runs `f(i, conn)` on `n` threads, each with its own connection, all
/// released at the same instant; returns their results in thread order.
fn race<T: Send + 'static>(
    s: &RedisServer,
    n: usize,
    f: impl Fn(usize, &mut redis::Connection) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let barrier = Arc::new(Barrier::new(n));
    let f = Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|i| {
            let mut c = s.conn();
            let (barrier, f) = (barrier.clone(), f.clone());
            thread::spawn(move || {
                barrier.wait();
                f(i, &mut c)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("racer panicked"))
        .collect()
}

#[test]
fn hundred_clients_racing_one_key_get_exactly_one_new() {
    let s = RedisServer::start();
    for round in 0..5 {
        let key = format!("race:{round}");
        let outcomes = race(&s, 100, move |_, c| begin(c, &key, "fp", 60));
        let new: Vec<_> = outcomes
            .iter()
            .filter(|o| matches!(o, Outcome::New(_)))
            .collect();
        assert_eq!(new.len(), 1, "round {round}: {outcomes:?}");
        assert!(
            outcomes.iter().all(|o| match o {
                Outcome::New(_) => true,
                Outcome::InFlight(ms) => *ms <= 30_000,
                _ => false,
            }),
            "{outcomes:?}"
        );
        let mut c = s.conn();
        assert_eq!(
            get_rec(&mut c, &format!("race:{round}")).token,
            new[0].token()
        );
    }
    let mut c = s.conn();
    let i = idem_info(&mut c);
    assert_eq!((i["idem_new"], i["idem_in_flight"]), (5, 495));
}

#[test]
fn racing_fingerprints_one_new_the_rest_in_flight_or_mismatch() {
    let s = RedisServer::start();
    let outcomes = race(&s, 60, |i, c| {
        let fp = if i % 2 == 0 { "even" } else { "odd" };
        (fp, begin(c, "k", fp, 60))
    });
    let winners: Vec<_> = outcomes
        .iter()
        .filter(|(_, o)| matches!(o, Outcome::New(_)))
        .collect();
    assert_eq!(winners.len(), 1);
    let winning_fp = winners[0].0;
    for (fp, o) in &outcomes {
        match o {
            Outcome::New(_) => {}
            Outcome::InFlight(_) => assert_eq!(*fp, winning_fp),
            Outcome::Mismatch => assert_ne!(*fp, winning_fp),
            other => panic!("{other:?}"),
        }
    }
    let mut c = s.conn();
    assert_eq!(
        get_rec(&mut c, "k").fingerprint,
        fp_hex(winning_fp.as_bytes())
    );
}

#[test]
fn racing_holders_across_takeovers_complete_once() {
    let s = RedisServer::start();
    const KEYS: usize = 150;
    // Every thread tries to own each key with a 1 ms lease, so takeovers
    // happen constantly; whoever holds it tries to complete with its name.
    let results = race(&s, 12, |i, c| {
        let mut wins = Vec::new();
        for k in 0..KEYS {
            let key = format!("k{k}");
            if let Outcome::New(t) = begin_lease(c, &key, "fp", 60, 1) {
                let body = format!("thread-{i}");
                let r: redis::RedisResult<Value> = redis::cmd("IDEM.COMPLETE")
                    .arg(&key)
                    .arg(t)
                    .arg(200)
                    .arg(&body)
                    .query(c);
                match r {
                    Ok(Value::Okay) => wins.push((key, body)),
                    Ok(v) => panic!("{v:?}"),
                    Err(e) => assert!(matches!(e.code(), Some("STALE") | Some("COMPLETED")), "{e}"),
                }
            }
        }
        wins
    });
    let mut winners: HashMap<String, Vec<String>> = HashMap::new();
    for (key, body) in results.into_iter().flatten() {
        winners.entry(key).or_default().push(body);
    }
    let mut c = s.conn();
    for k in 0..KEYS {
        let key = format!("k{k}");
        let w = winners.get(&key).cloned().unwrap_or_default();
        assert_eq!(w.len(), 1, "{key}: completed by {w:?}");
        let r = get_rec(&mut c, &key);
        assert_eq!(r.body, Some(w[0].clone().into_bytes()), "{key}");
    }
    assert_eq!(idem_counter(&mut c, "idem_completes"), KEYS as i64);
}

#[test]
fn many_keys_in_parallel() {
    let s = RedisServer::start();
    const PER: usize = 400;
    let results = race(&s, 16, |i, c| {
        let mut p = redis::pipe();
        for k in 0..PER {
            p.cmd("IDEM.BEGIN")
                .arg(format!("t{i}:{k}"))
                .arg(format!("fp{k}"))
                .arg(60);
        }
        let tokens: Vec<u64> = p
            .query::<Vec<Value>>(c)
            .unwrap()
            .iter()
            .map(|v| Outcome::parse(v).token())
            .collect();
        let mut p = redis::pipe();
        for (k, t) in tokens.iter().enumerate() {
            p.cmd("IDEM.COMPLETE")
                .arg(format!("t{i}:{k}"))
                .arg(t)
                .arg(200)
                .arg(format!("body {i} {k}"));
        }
        let oks: Vec<Value> = p.query(c).unwrap();
        assert!(oks.iter().all(|v| *v == Value::Okay));
        for k in (0..PER).step_by(37) {
            assert_eq!(
                begin(c, &format!("t{i}:{k}"), &format!("fp{k}"), 60),
                Outcome::Replay {
                    status: 200,
                    body: format!("body {i} {k}").into_bytes(),
                    headers: vec![]
                }
            );
        }
        tokens
    });
    let mut all: Vec<u64> = results.into_iter().flatten().collect();
    let n = all.len();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), n, "tokens are unique across the node");
    let mut c = s.conn();
    assert_eq!(dbsize(&mut c), (16 * PER) as i64);
    let i = idem_info(&mut c);
    assert_eq!(
        (i["idem_new"], i["idem_completes"]),
        ((16 * PER) as i64, (16 * PER) as i64)
    );
    assert_eq!(i["idem_mirror_pending"], (16 * PER) as i64);
}
