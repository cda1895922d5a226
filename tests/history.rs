//! History check under crashes: concurrent clients run BEGIN (some with
//! WAIT), TOUCH, COMPLETE and ABORT over a small, sliding set of keys while
//! redis-server (AOF on, `appendfsync always`) is SIGKILLed at random moments
//! and restarted on its data directory. Every invocation and reply is
//! recorded, and `history/checker.rs` verifies that no acknowledged
//! completion was lost, no key answered `new` to two holders within one
//! lease, and tokens never went backwards. The teeth run does the same
//! without persistence and must see lost completions.
//!
//! SIGKILL ends the process, not the machine: what was written to the OS
//! survives either way, so this proves that every reply follows its write
//! to the AOF and that reloading restores it; `appendfsync always` adds the
//! same for power loss (docs/writer.md).

#[path = "history/checker.rs"]
mod checker;
mod common;

use checker::{Event, Final, Op, Reply};
use common::{now_ms, Rec};
use idem_testkit::RedisConfig;
use rand::{RngExt, SeedableRng};
use redis::Value;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

const CLIENTS: usize = 16;
const FP: &str = "fp";
const TTL_SECS: u64 = 3600;
/// Keys live in a window that slides every this many ms, so keys keep being
/// created, contended, completed and replayed.
const KEY_EPOCH_MS: u128 = 25;
const KEY_WINDOW: u128 = 4;

struct Run {
    events: Vec<Event>,
    finals: HashMap<String, Final>,
    kills: usize,
    /// Commands whose reply never came although the connection stayed
    /// open (read timeouts).
    timeouts: Vec<String>,
}

/// Runs the workload for `kills` random SIGKILLs (plus one at the end, before
/// the final read).
fn run_history(config: RedisConfig, kills: usize, seed: u64) -> Run {
    let mut server = config.start();
    let port = server.port;
    let start = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let stop = stop.clone();
            thread::spawn(move || client(i, port, start, &stop, seed ^ (i as u64 + 1)))
        })
        .collect();

    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for _ in 0..kills {
        thread::sleep(Duration::from_millis(rng.random_range(150..650)));
        server.kill();
        thread::sleep(Duration::from_millis(rng.random_range(0..60)));
        server.restart();
    }
    thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::SeqCst);
    let mut events = Vec::new();
    let mut timeouts = Vec::new();
    for c in clients {
        let (ev, t) = c.join().expect("client panicked");
        events.extend(ev);
        timeouts.extend(t);
    }
    // One more crash: the final state is what the disk holds.
    server.kill();
    server.restart();
    let mut con = server.conn();
    let mut finals = HashMap::new();
    for e in &events {
        if !finals.contains_key(&e.key) {
            finals.insert(e.key.clone(), read_final(&mut con, &e.key));
        }
    }
    assert_eq!(
        common::ok(&mut con, &["PING"]),
        Value::SimpleString("PONG".into())
    );
    Run {
        events,
        finals,
        kills: kills + 1,
        timeouts,
    }
}

fn read_final(con: &mut redis::Connection, key: &str) -> Final {
    match Rec::parse(&common::ok(con, &["IDEM.GET", key])) {
        None => Final::Missing,
        Some(r) if r.is_completed() => Final::Completed {
            token: r.token,
            body: r.body.expect("completed body"),
        },
        Some(r) => Final::InProgress { token: r.token },
    }
}

/// One client: its own connection, reconnecting after each crash.
fn client(
    id: usize,
    port: u16,
    start: Instant,
    stop: &AtomicBool,
    seed: u64,
) -> (Vec<Event>, Vec<String>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut con: Option<redis::Connection> = None;
    let mut events = Vec::new();
    let mut timeouts = Vec::new();
    let mut seq = 0u64;
    let elapsed = || start.elapsed().as_secs_f64() * 1000.0;
    while !stop.load(Ordering::SeqCst) {
        if con.is_none() {
            con = connect(port);
            if con.is_none() {
                thread::sleep(Duration::from_millis(10));
                continue;
            }
        }
        let epoch = start.elapsed().as_millis() / KEY_EPOCH_MS;
        let key = format!(
            "h:{}",
            epoch.saturating_sub(rng.random_range(0..KEY_WINDOW))
        );
        let mut call = |op: Op, cmd: redis::Cmd, con: &mut Option<redis::Connection>| {
            let invoke = elapsed();
            let result = cmd.query::<Value>(con.as_mut().expect("connected"));
            let reply_at = elapsed();
            let reply = match result {
                Ok(v) => parse_reply(&op, &v),
                Err(e) if e.code().is_some() => Reply::Error(e.code().unwrap().to_string()),
                Err(e) => {
                    if e.is_timeout() {
                        timeouts.push(format!("{op:?} on {key} at {invoke:.0} ms"));
                    }
                    *con = None;
                    Reply::Unknown
                }
            };
            events.push(Event {
                client: id,
                key: key.clone(),
                op,
                invoke,
                reply_at,
                reply: reply.clone(),
            });
            reply
        };

        let lease_ms = [40u64, 80, 150][rng.random_range(0..3)];
        let wait_ms = rng.random_bool(0.3).then(|| rng.random_range(20..250u64));
        let mut cmd = redis::cmd("IDEM.BEGIN");
        cmd.arg(&key)
            .arg(FP)
            .arg(TTL_SECS)
            .arg("LEASE")
            .arg(lease_ms);
        if let Some(ms) = wait_ms {
            cmd.arg("WAIT").arg(ms);
        }
        let op = Op::Begin {
            lease_ms,
            wait: wait_ms.is_some(),
        };
        let token = match call(op, cmd, &mut con) {
            Reply::New(t) => t,
            Reply::InFlight => {
                thread::sleep(Duration::from_millis(rng.random_range(0..20)));
                continue;
            }
            _ => {
                thread::sleep(Duration::from_millis(rng.random_range(0..4)));
                continue;
            }
        };
        // The holder works, sometimes past its lease, sometimes touching it.
        thread::sleep(Duration::from_millis(
            rng.random_range(0..lease_ms * 13 / 10),
        ));
        if con.is_some() && rng.random_bool(0.25) {
            let lease = rng.random_range(30..200u64);
            let mut cmd = redis::cmd("IDEM.TOUCH");
            cmd.arg(&key).arg(token).arg(lease);
            call(
                Op::Touch {
                    token,
                    lease_ms: lease,
                },
                cmd,
                &mut con,
            );
            thread::sleep(Duration::from_millis(rng.random_range(0..lease / 2)));
        }
        if con.is_none() {
            continue;
        }
        if rng.random_bool(0.75) {
            seq += 1;
            let body = format!("{key}|{token}|c{id}|{seq}").into_bytes();
            let mut cmd = redis::cmd("IDEM.COMPLETE");
            cmd.arg(&key).arg(token).arg(201).arg(&body);
            call(Op::Complete { token, body }, cmd, &mut con);
        } else {
            let mut cmd = redis::cmd("IDEM.ABORT");
            cmd.arg(&key).arg(token);
            call(Op::Abort { token }, cmd, &mut con);
        }
    }
    (events, timeouts)
}

fn connect(port: u16) -> Option<redis::Connection> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).ok()?;
    let con = client
        .get_connection_with_timeout(Duration::from_millis(500))
        .ok()?;
    // Far longer than any WAIT: a missing reply shows as a timeout.
    con.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    Some(con)
}

fn parse_reply(op: &Op, v: &Value) -> Reply {
    match op {
        Op::Begin { .. } => match common::Outcome::parse(v) {
            common::Outcome::New(t) => Reply::New(t),
            common::Outcome::InFlight(_) => Reply::InFlight,
            common::Outcome::Replay { body, .. } => Reply::Replay(body),
            common::Outcome::Mismatch => Reply::Mismatch,
        },
        Op::Complete { .. } => {
            assert_eq!(*v, Value::Okay, "COMPLETE reply");
            Reply::Ok
        }
        Op::Abort { .. } | Op::Touch { .. } => Reply::Int(common::int(v)),
    }
}

fn summary(run: &Run, report: &checker::Report) -> String {
    format!(
        "kills {}, operations {} ({} without reply, {} read timeouts), grants {}, \
         acknowledged completions {}, lost {}, double new {}, token regressions {}, \
         foreign replays {}",
        run.kills,
        report.operations,
        report.unknown,
        run.timeouts.len(),
        report.grants,
        report.acked_completions,
        report.lost_completions.len(),
        report.double_new.len(),
        report.token_regressions.len(),
        report.foreign_replays.len(),
    )
}

#[test]
fn history_survives_sigkill_with_aof_always() {
    let seed = now_ms();
    // IDEM_HISTORY_KILLS: how many SIGKILLs the run survives.
    let kills = size("IDEM_HISTORY_KILLS", 24);
    let run = run_history(RedisConfig::default().aof_always(), kills, seed);
    let report = checker::check(&run.events, &run.finals);
    println!("history (seed {seed}): {}", summary(&run, &report));
    // Every command is answered while the server is up (issue 8 item 2).
    assert!(
        run.timeouts.is_empty(),
        "seed {seed}: no reply to {:?}",
        run.timeouts
    );
    assert!(run.kills >= 20);
    assert!(
        report.acked_completions >= 200 && report.grants >= 300,
        "too little happened: {}",
        summary(&run, &report)
    );
    assert_eq!(
        report.violations(),
        0,
        "seed {seed}: {}\nlost: {:?}\ndouble new: {:?}\nregressions: {:?}\nforeign: {:?}",
        summary(&run, &report),
        &report.lost_completions[..report.lost_completions.len().min(10)],
        &report.double_new[..report.double_new.len().min(10)],
        &report.token_regressions[..report.token_regressions.len().min(10)],
        &report.foreign_replays[..report.foreign_replays.len().min(10)],
    );
}

/// Teeth: without persistence the same crashes lose acknowledged
/// completions, and the checker must say so.
#[test]
fn history_checker_finds_losses_without_persistence() {
    let seed = now_ms();
    let run = run_history(RedisConfig::default(), 6, seed);
    let report = checker::check(&run.events, &run.finals);
    println!(
        "history without persistence (seed {seed}): {}",
        summary(&run, &report)
    );
    assert!(
        !report.lost_completions.is_empty(),
        "the checker missed the losses: {}",
        summary(&run, &report)
    );
}

/// A size of this run: `${var}` when set (a soak raises it), else the size
/// scripts/test.sh runs with.
fn size(var: &str, ci_default: usize) -> usize {
    std::env::var(var).map_or(ci_default, |v| {
        v.parse()
            .unwrap_or_else(|_| panic!("{var}={v}: a whole number, please"))
    })
}
