//! Hostile storm: over 100,000 randomized malformed or hostile commands per
//! run (see storm/gen.rs), pipelined on several connections, then clients
//! killed while blocked in WAIT or PULL BLOCK. The server must stay up, every
//! error must be one of the code words of docs/module/commands.md or a known Redis error,
//! every successful IDEM.* reply must have its documented shape, and a set
//! of sentinel records must read back unchanged.

mod common;
#[path = "storm/dump.rs"]
mod dump;
#[path = "storm/gen.rs"]
mod gen;
#[path = "storm/resp.rs"]
mod resp;

use common::now_ms;
use gen::{Args, Gen, Item};
use idem_core::record::TOKEN_LIMIT;
use idem_core::wire::{parse_pull_batch, parse_record, BeginReply, Frame};
use idem_testkit::RedisServer;
use rand::{RngExt, SeedableRng};
use resp::{Conn, Resp};
use std::collections::BTreeMap;
use std::thread;
use std::time::Instant;

const THREADS: usize = 3;
const COMMANDS_PER_THREAD: usize = 100_000;
/// Commands sent before reading their replies.
const PIPELINE: usize = 400;

/// The module's documented error code words (docs/module/commands.md, error table).
const MODULE_CODES: [&str; 6] = [
    "BADARG",
    "STALE",
    "NOTFOUND",
    "COMPLETED",
    "TOOLARGE",
    "WRONGTYPE",
];

fn command_name(args: &[Vec<u8>]) -> String {
    String::from_utf8_lossy(args.first().map_or(&[][..], |a| a)).to_uppercase()
}

/// Why an error reply to `args` is not acceptable, if it is not.
fn bad_error(args: &[Vec<u8>], msg: &str) -> Option<String> {
    let name = command_name(args);
    let code = msg.split(' ').next().unwrap_or("");
    let ok = if code == "OOM" {
        // While the storm had maxmemory set: deny-oom commands, and any
        // command queued in MULTI.
        true
    } else if name == "EVAL" {
        // The inner command's error, with Lua's location appended.
        let inner = msg.split(" script: ").next().unwrap_or(msg);
        return bad_error(&args[3..], inner).map(|p| format!("EVAL: {p} ({msg})"));
    } else if name == "IDEM._PUT" {
        code == "NOPERM"
    } else if name.starts_with("IDEM.") {
        MODULE_CODES.contains(&code)
    } else if name == "RESTORE" {
        msg.starts_with("ERR Bad data format")
            || msg.starts_with("ERR DUMP payload version or checksum are wrong")
    } else {
        // Redis' own commands on the storm's keys: Redis' own errors.
        ["ERR", "WRONGTYPE", "NOPERM", "BUSYKEY"].contains(&code)
    };
    (!ok).then(|| format!("{} -> -{msg}", show(args)))
}

fn show(args: &[Vec<u8>]) -> String {
    args.iter()
        .map(|a| {
            let s = String::from_utf8_lossy(&a[..a.len().min(40)]).into_owned();
            if a.len() > 40 {
                format!("{s}...({} bytes)", a.len())
            } else {
                s
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn is_bulk(r: &Resp, want: &[u8]) -> bool {
    r.bulk() == Some(want)
}

/// The reply as the core's wire readers take it.
fn frame(r: &Resp) -> Frame {
    match r {
        Resp::Simple(s) => Frame::Simple(s.clone()),
        Resp::Error(e) => Frame::Simple(format!("-{e}")),
        Resp::Int(i) => Frame::Int(*i),
        Resp::Bulk(Some(b)) => Frame::Bulk(b.clone()),
        Resp::Array(Some(a)) => Frame::Array(a.iter().map(frame).collect()),
        Resp::Bulk(None) | Resp::Array(None) => Frame::Null,
    }
}

/// Why a successful reply to `args` is wrong, if it is: not the documented
/// shape (the core's wire readers) or a record that is not valid (the
/// core's validation).
fn bad_reply(args: &[Vec<u8>], r: &Resp) -> Option<String> {
    let f = frame(r);
    let valid = |rec: &idem_core::Record| rec.validate().err().map(|e| e.to_string());
    let shape = |ok: bool| (!ok).then(|| "not the documented reply".to_string());
    match command_name(args).as_str() {
        // Lua turns a nil bulk into false, which comes back as nil.
        "EVAL" => bad_reply(&args[3..], r),
        "IDEM.BEGIN" => match BeginReply::parse(&f) {
            Ok(BeginReply::New { token }) => shape(token < TOKEN_LIMIT),
            Ok(_) => None,
            Err(e) => Some(e.to_string()),
        },
        "IDEM.COMPLETE" => shape(*r == Resp::Simple("OK".into())),
        "IDEM.ABORT" | "IDEM.MIRROR.ACK" => shape(matches!(r, Resp::Int(0 | 1))),
        "IDEM.TOUCH" => shape(matches!(r, Resp::Int(n) if *n > 0)),
        "IDEM.GET" => match parse_record(&f) {
            Ok(rec) => rec.as_ref().and_then(valid),
            Err(e) => Some(e.to_string()),
        },
        "IDEM.MIRROR.PULL" => match parse_pull_batch(&f) {
            Ok(batch) => batch.iter().find_map(|p| match p {
                Ok(p) => valid(&p.record),
                Err(e) => Some(e.to_string()),
            }),
            Err(e) => Some(e.to_string()),
        },
        "IDEM._PUT" => shape(false),
        _ => None,
    }
}

/// Checks one reply; `Some(problem)` when it is wrong.
fn check(args: &[Vec<u8>], r: &Resp) -> Option<String> {
    match r {
        Resp::Error(msg) => bad_error(args, msg),
        _ => bad_reply(args, r).map(|why| format!("{} -> {why}: {r:?}", show(args))),
    }
}

/// Remembers tokens the storm's own BEGINs were given.
fn learn(g: &mut Gen, args: &[Vec<u8>], r: &Resp) {
    if command_name(args) == "IDEM.BEGIN" {
        if let Some([w, Resp::Int(t)]) = r.array() {
            if is_bulk(w, b"new") {
                if g.tokens.len() >= 4096 {
                    g.tokens.drain(..2048);
                }
                g.tokens.push((args[1].clone(), *t as u64));
            }
        }
    }
}

struct Outcome {
    commands: usize,
    problems: Vec<String>,
    /// Replies by command and outcome (`IDEM.BEGIN new`, `RESTORE -ERR`).
    tally: BTreeMap<String, usize>,
}

fn tally(t: &mut BTreeMap<String, usize>, args: &[Vec<u8>], r: &Resp) {
    let name = command_name(args);
    let what = match r {
        Resp::Error(m) => format!("-{}", m.split(' ').next().unwrap_or("")),
        Resp::Array(Some(a)) if name == "IDEM.BEGIN" => {
            String::from_utf8_lossy(a[0].bulk().unwrap_or(b"?")).into_owned()
        }
        _ => "ok".into(),
    };
    *t.entry(format!("{name} {what}")).or_default() += 1;
}

/// One storm connection: `n` commands in pipelined batches.
fn storm(port: u16, mut g: Gen, n: usize) -> Outcome {
    let mut c = Conn::open(port);
    let mut out = Outcome {
        commands: 0,
        problems: Vec::new(),
        tally: BTreeMap::new(),
    };
    while out.commands < n {
        // Sometimes the whole node runs out of memory for one batch.
        let oom = g.rng.random_range(0..40) == 0;
        if oom {
            c.send(&["CONFIG", "SET", "maxmemory", "1"]);
        }
        let mut batch: Vec<Item> = Vec::new();
        let mut queued = 0;
        while queued < PIPELINE {
            let item = match g.rng.random_range(0..100) {
                0..=54 => Item::Plain(g.idem()),
                55..=69 => Item::Plain(g.valid()),
                70..=77 => Item::Plain(g.other()),
                78..=85 => Item::Plain(g.restore()),
                86..=91 => g.multi(),
                92..=98 => Item::Plain(g.lua()),
                _ => Item::Plain(g.config()),
            };
            match &item {
                Item::Plain(a) => {
                    c.send(a);
                    queued += 1;
                }
                Item::Multi(cmds) => {
                    c.send(&["MULTI"]);
                    cmds.iter().for_each(|a| c.send(a));
                    c.send(&["EXEC"]);
                    queued += cmds.len() + 2;
                }
            }
            batch.push(item);
        }
        let mut replies = c.replies().into_iter();
        if oom {
            replies.next();
            c.call(&["CONFIG", "SET", "maxmemory", "0"]);
        }
        out.commands += queued + 2 * usize::from(oom);
        for item in batch {
            check_item(&mut g, &item, &mut replies, &mut out);
        }
    }
    out
}

fn check_item(
    g: &mut Gen,
    item: &Item,
    replies: &mut impl Iterator<Item = Resp>,
    out: &mut Outcome,
) {
    let Outcome {
        problems, tally: t, ..
    } = out;
    let mut note = |p: Option<String>| {
        if let Some(p) = p {
            if problems.len() < 50 {
                problems.push(p);
            }
        }
    };
    match item {
        Item::Plain(a) => {
            let r = replies.next().expect("a reply per command");
            learn(g, a, &r);
            tally(t, a, &r);
            note(check(a, &r));
        }
        Item::Multi(cmds) => {
            let multi = replies.next().unwrap();
            note((multi != Resp::Simple("OK".into())).then(|| format!("MULTI -> {multi:?}")));
            let mut aborted = false;
            for a in cmds {
                match replies.next().unwrap() {
                    Resp::Simple(s) if s == "QUEUED" => {}
                    Resp::Error(msg) => {
                        aborted = true;
                        note(bad_error(a, &msg));
                    }
                    other => note(Some(format!("queued {} -> {other:?}", show(a)))),
                }
            }
            match (replies.next().unwrap(), aborted) {
                // Another connection may set maxmemory between queuing and EXEC.
                (Resp::Error(msg), aborted)
                    if msg.starts_with("EXECABORT") && (aborted || msg.contains("OOM")) => {}
                (Resp::Array(Some(rs)), false) if rs.len() == cmds.len() => {
                    for (a, r) in cmds.iter().zip(&rs) {
                        learn(g, a, r);
                        tally(t, a, r);
                        note(check(a, r));
                    }
                }
                (other, _) => note(Some(format!("EXEC -> {other:?}"))),
            }
        }
    }
}

/// Records the storm must never change: completed (pending and mirrored)
/// and held (a lease of a year), with their tokens never handed out.
fn sentinels(s: &RedisServer) -> Vec<String> {
    let mut c = s.conn();
    let mut keys = Vec::new();
    for i in 0..6 {
        let done = format!("sentinel:done:{i}");
        let t = common::begin(&mut c, &done, "fp", 86_400).token();
        common::complete(
            &mut c,
            &done,
            t,
            201,
            b"{\"id\":1}",
            &[("content-type", "json")],
        );
        let mir = format!("sentinel:mirrored:{i}");
        let t = common::begin(&mut c, &mir, "fp", 86_400).token();
        common::complete_mirrored(&mut c, &mir, t, 200, b"m");
        let held = format!("sentinel:held:{i}");
        common::begin_lease(&mut c, &held, "fp", 86_400, 31_622_400_000).token();
        keys.extend([done, mir, held]);
    }
    keys
}

fn snapshot(s: &RedisServer, keys: &[String]) -> Vec<(Option<common::Rec>, i64)> {
    let mut c = s.conn();
    keys.iter()
        .map(|k| (common::get(&mut c, k), common::pexpiretime(&mut c, k)))
        .collect()
}

/// Real DUMPs of an in-progress and of completed records, uncompressed.
fn real_dumps(s: &RedisServer) -> Vec<dump::Dump> {
    let mut c = s.conn();
    common::ok(&mut c, &["CONFIG", "SET", "rdbcompression", "no"]);
    common::begin(&mut c, "d:held", "fp", 600).token();
    let t = common::begin(&mut c, "d:done", "fp", 600).token();
    common::complete(&mut c, "d:done", t, 200, b"body", &[("a", "b"), ("c", "")]);
    let t = common::begin(&mut c, "d:big", "fp", 600).token();
    common::complete(&mut c, "d:big", t, 201, &[7u8; 300], &[]);
    let dumps = ["d:held", "d:done", "d:big"]
        .iter()
        .map(|k| dump::Dump::parse(&common::bytes(&common::ok(&mut c, &["DUMP", k]))))
        .collect();
    common::ok(&mut c, &["CONFIG", "SET", "rdbcompression", "yes"]);
    dumps
}

#[test]
fn forged_payloads_with_valid_checksums_reach_the_decoder() {
    let s = RedisServer::start();
    let dumps = real_dumps(&s);
    let mut c = s.conn();
    // A payload rebuilt from the parsed parts restores the same record.
    let before = common::get_rec(&mut c, "d:done");
    let payload = dumps[1].build(&dumps[1].record);
    let r: redis::Value = redis::cmd("RESTORE")
        .arg("copy")
        .arg(common::pexpiretime(&mut c, "d:done"))
        .arg(payload)
        .arg("ABSTTL")
        .query(&mut c)
        .unwrap();
    assert_eq!(r, redis::Value::Okay);
    assert_eq!(common::get_rec(&mut c, "copy"), before);
    // A flipped format byte passes the checksum and is refused by the module.
    let mut bad = dumps[1].record.clone();
    bad[0] = 99;
    let e = redis::cmd("RESTORE")
        .arg("bad")
        .arg(0)
        .arg(dumps[1].build(&bad))
        .query::<redis::Value>(&mut c)
        .unwrap_err();
    assert!(e.to_string().contains("Bad data format"), "{e}");
    assert!(
        s.log().contains("newer than this module"),
        "the module saw it"
    );
}

/// Runs `THREADS` storm connections of `per_thread` commands against a
/// server holding the sentinels; asserts everything the storm promises.
fn run_storm(per_thread: usize, forge_fields: bool) -> usize {
    let s = RedisServer::start();
    let keys = sentinels(&s);
    let before = snapshot(&s, &keys);
    let dumps = real_dumps(&s);
    let seed = now_ms();
    let started = Instant::now();
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let mut g = Gen::new(
                rand::rngs::StdRng::seed_from_u64(seed + t as u64),
                t,
                keys.clone(),
                dumps.clone(),
            );
            g.forge_fields = forge_fields;
            let port = s.port;
            thread::spawn(move || storm(port, g, per_thread))
        })
        .collect();
    let outcomes: Vec<Outcome> = handles
        .into_iter()
        .map(|h| h.join().expect("storm thread"))
        .collect();
    let commands: usize = outcomes.iter().map(|o| o.commands).sum();
    let problems: Vec<&String> = outcomes.iter().flat_map(|o| &o.problems).collect();
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for (k, n) in outcomes.iter().flat_map(|o| &o.tally) {
        *seen.entry(k).or_default() += n;
    }
    println!("replies: {seen:?}");
    println!(
        "storm (seed {seed}, forged fields {forge_fields}): {commands} commands on {THREADS} \
         connections in {:.1} s, {} problems",
        started.elapsed().as_secs_f64(),
        problems.len()
    );

    let mut c = s.conn();
    assert_eq!(
        common::ok(&mut c, &["PING"]),
        redis::Value::SimpleString("PONG".into())
    );
    for (name, value) in [
        ("idem.lease-ms", "30000"),
        ("idem.max-ttl", "2592000"),
        ("idem.max-body-bytes", "1048576"),
        ("idem.mirror-claim-ms", "30000"),
    ] {
        common::ok(&mut c, &["CONFIG", "SET", name, value]);
    }
    assert!(problems.is_empty(), "seed {seed}: {problems:#?}");
    assert_eq!(snapshot(&s, &keys), before, "a sentinel record changed");
    // The node still issues tokens in range and behaves.
    let t = common::begin(&mut c, "after", "fp", 60).token();
    common::complete(&mut c, "after", t, 200, b"ok", &[]);
    assert!(matches!(
        common::begin(&mut c, "after", "fp", 60),
        common::Outcome::Replay { status: 200, .. }
    ));
    assert!(!s.log().contains("panic caught"), "{}", s.log());
    commands
}

/// The reply checks have teeth: an undocumented error, a token past 2^53,
/// a reply meant for another command, and a sentinel changed by a command
/// the storm never sends to one are all caught.
#[test]
fn storm_checks_catch_wrong_replies_and_changed_sentinels() {
    let a = |v: &[&str]| -> Args { v.iter().map(|s| s.as_bytes().to_vec()).collect() };
    let begin = a(&["IDEM.BEGIN", "k", "fp", "60"]);
    let new = |t: i64| Resp::Array(Some(vec![Resp::Bulk(Some(b"new".to_vec())), Resp::Int(t)]));
    assert_eq!(check(&begin, &new(5)), None);
    assert!(check(&begin, &new(TOKEN_LIMIT as i64)).is_some());
    assert!(check(&begin, &Resp::Error("INTERNAL command panicked".into())).is_some());
    assert!(check(&begin, &Resp::Error("ERR unknown".into())).is_some());
    assert!(check(&begin, &Resp::Simple("OK".into())).is_some());
    assert!(check(&a(&["IDEM.GET", "k"]), &Resp::Int(0)).is_some());
    assert!(check(&a(&["IDEM._PUT", "k", "x"]), &Resp::Simple("OK".into())).is_some());
    let eval = a(&[
        "EVAL",
        "return redis.call(unpack(ARGV))",
        "0",
        "IDEM.BEGIN",
        "k",
        "fp",
        "60",
    ]);
    assert_eq!(
        check(
            &eval,
            &Resp::Error("BADARG x script: 1, on @user_script:1.".into())
        ),
        None
    );
    assert!(check(&eval, &Resp::Error("INTERNAL x script: 1".into())).is_some());

    let s = RedisServer::start();
    let keys = sentinels(&s);
    let before = snapshot(&s, &keys);
    let mut c = s.conn();
    common::ok(&mut c, &["PEXPIRE", &keys[0], "99999999"]);
    assert_ne!(snapshot(&s, &keys), before);
}

#[test]
fn hostile_storm_leaves_the_server_up_and_records_unchanged() {
    // IDEM_STORM_COMMANDS: commands per connection.
    let per_thread = size("IDEM_STORM_COMMANDS", COMMANDS_PER_THREAD);
    let commands = run_storm(per_thread, false);
    assert!(commands >= per_thread, "{commands} commands");
}

/// RESTORE payloads whose record fields are forged (tokens at and past
/// 2^53, absurd times, statuses out of range, lying lengths) must be
/// refused or be harmless.
#[test]
fn storm_of_forged_restore_payloads() {
    run_storm(20_000, true);
}

/// Clients blocked in `IDEM.BEGIN ... WAIT` or `IDEM.MIRROR.PULL ... BLOCK`
/// are killed (CLIENT KILL, or their socket dropped) while the holder
/// completes or aborts and new records wake the pullers: the server stays
/// up, every surviving client gets exactly one well-formed reply (then its
/// PING's PONG), no waiter is left behind, and the sentinels are unchanged.
#[test]
fn clients_killed_while_blocked_in_wait_or_pull_block() {
    let s = RedisServer::start();
    let keys = sentinels(&s);
    let before = snapshot(&s, &keys);
    let mut admin = s.conn();
    let seed = now_ms();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (mut killed, mut dropped, mut answered) = (0, 0, 0);
    for round in 0..8 {
        let held = format!("w:{round}");
        let token = common::begin_lease(&mut admin, &held, "fp", 600, 60_000).token();
        // Claim every pending record, so PULL ... BLOCK blocks.
        common::pull(&mut admin, 10_000, Some(300_000), None);
        let mut blocked: Vec<(Conn, i64, Args)> = (0..24)
            .map(|i| {
                let mut c = Conn::open(s.port);
                let Resp::Int(id) = c.call(&["CLIENT", "ID"]) else {
                    panic!("CLIENT ID")
                };
                let ms = rng.random_range(1_000..2_500u64).to_string();
                let cmd: Args = if i % 2 == 0 {
                    ["IDEM.BEGIN", &held, "fp", "600", "WAIT", &ms]
                        .iter()
                        .map(|a| a.as_bytes().to_vec())
                        .collect()
                } else {
                    ["IDEM.MIRROR.PULL", "5", "CLAIM", "300000", "BLOCK", &ms]
                        .iter()
                        .map(|a| a.as_bytes().to_vec())
                        .collect()
                };
                c.send(&cmd);
                c.flush();
                (c, id, cmd)
            })
            .collect();
        let all_blocked = idem_testkit::eventually(std::time::Duration::from_secs(5), || {
            common::info(&mut admin, "clients")["blocked_clients"] == "24"
        });
        assert!(all_blocked, "{:?}", common::info(&mut admin, "clients"));

        // Kill a third through the server, drop the sockets of another third.
        let mut survivors = Vec::new();
        for (c, id, cmd) in blocked.drain(..) {
            match rng.random_range(0..3) {
                0 => {
                    common::ok(&mut admin, &["CLIENT", "KILL", "ID", &id.to_string()]);
                    killed += 1;
                }
                1 => {
                    c.stream().shutdown(std::net::Shutdown::Both).unwrap();
                    dropped += 1;
                }
                _ => survivors.push((c, cmd)),
            }
        }
        // Release: complete or abort the held key, and wake the pullers.
        if rng.random_bool(0.5) {
            common::complete(&mut admin, &held, token, 200, b"done", &[]);
        } else {
            assert_eq!(common::abort(&mut admin, &held, token), 1);
        }
        for i in 0..3 {
            common::completed(&mut admin, &format!("w:{round}:{i}"), "fp", 600, b"x");
        }
        for (mut c, cmd) in survivors {
            let r = c.read().expect("one reply");
            assert_eq!(check(&cmd, &r), None, "round {round}, seed {seed}");
            c.stream()
                .set_read_timeout(Some(std::time::Duration::from_secs(5)))
                .unwrap();
            c.send(&["PING"]);
            c.flush();
            assert_eq!(
                c.read().ok(),
                Some(Resp::Simple("PONG".into())),
                "exactly one reply to {} (got {r:?}), then PONG",
                show(&cmd),
            );
            answered += 1;
        }
        // A takeover left a new holder: release it for the next round.
        if let Some(r) = common::get(&mut admin, &held) {
            if !r.is_completed() {
                common::abort(&mut admin, &held, r.token);
            }
        }
    }
    println!(
        "blocked clients (seed {seed}): {killed} killed, {dropped} dropped, {answered} answered"
    );
    let settled = idem_testkit::eventually(std::time::Duration::from_secs(5), || {
        common::idem_counter(&mut admin, "idem_waiters") == 0
            && common::info(&mut admin, "clients")["blocked_clients"] == "0"
    });
    assert!(settled, "{:?}", common::idem_info(&mut admin));
    assert_eq!(
        common::ok(&mut admin, &["PING"]),
        redis::Value::SimpleString("PONG".into())
    );
    assert_eq!(snapshot(&s, &keys), before, "a sentinel record changed");
}

/// A size of this run: `${var}` when set (a soak raises it), else the size
/// scripts/test.sh runs with.
fn size(var: &str, ci_default: usize) -> usize {
    std::env::var(var).map_or(ci_default, |v| {
        v.parse()
            .unwrap_or_else(|_| panic!("{var}={v}: a whole number, please"))
    })
}
