//! Every error code of the IDEM.* commands (BADARG per bad argument, STALE,
//! NOTFOUND, COMPLETED, TOOLARGE, WRONGTYPE), that nothing changes on an
//! error, that garbage never takes the server down, and the command table
//! (key positions, flags, ACL key patterns).

mod common;

use common::*;
use idem_core::args::HEADER_OVERHEAD;
use idem_testkit::RedisServer;
use rand::{RngExt, SeedableRng};
use redis::Value;

/// The whole dataset's digest plus the record: what "nothing changed" means.
fn snapshot(c: &mut redis::Connection, key: &str) -> (String, Option<Rec>, i64) {
    (digest(c), get(c, key), int(&ok(c, &["PEXPIRETIME", key])))
}

fn assert_all_badarg(c: &mut redis::Connection, key: &str, cases: &[Vec<String>]) {
    let before = snapshot(c, key);
    for args in cases {
        let (code, msg) = err(c, args);
        assert_eq!(code, "BADARG", "{args:?} -> {msg}");
        assert_eq!(snapshot(c, key), before, "{args:?} changed something");
    }
}

fn cases(prefix: &[&str], list: &[&str]) -> Vec<Vec<String>> {
    list.iter()
        .map(|rest| {
            prefix
                .iter()
                .map(|s| s.to_string())
                .chain(rest.split(' ').filter(|s| !s.is_empty()).map(String::from))
                .collect()
        })
        .collect()
}

#[test]
fn begin_badarg() {
    let s = RedisServer::start();
    let mut c = s.conn();
    begin(&mut c, "k", "fp", 60).token();
    assert_all_badarg(
        &mut c,
        "k",
        &cases(
            &["IDEM.BEGIN"],
            &[
                "",
                "k",
                "k fp",
                "k fp 0",
                "k fp -1",
                "k fp +5",
                "k fp 1.5",
                "k fp 1e3",
                "k fp abc",
                "k fp 2592001",
                "k fp 99999999999999999999999",
                "k fp 60 LEASE",
                "k fp 60 LEASE 0",
                "k fp 60 LEASE -5",
                "k fp 60 LEASE x",
                "k fp 60 LEASE 100 LEASE",
                "k fp 60 WAIT",
                "k fp 60 WAIT -1",
                "k fp 60 FOO 1",
                "k fp 60 extra",
                "new-key fp 0",
                "new-key fp 60 LEASE 0",
                "new-key fp 60 BOGUS",
            ],
        ),
    );
    // The key the bad BEGINs named was never created.
    assert_eq!(get(&mut c, "new-key"), None);
    // An empty ttl string is malformed too.
    assert_all_badarg(
        &mut c,
        "k",
        &[vec![
            "IDEM.BEGIN".into(),
            "k".into(),
            "fp".into(),
            String::new(),
        ]],
    );
}

#[test]
fn complete_badarg_and_toolarge() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let t = begin(&mut c, "k", "fp", 60).token().to_string();
    let tk = |rest: &str| rest.replace("TOK", &t);
    let list: Vec<String> = [
        "",
        "k",
        "k TOK",
        "k TOK 200",
        "k TOK 99 body",
        "k TOK 600 body",
        "k TOK 2000 body",
        "k TOK abc body",
        "k TOK -200 body",
        "k 0 200 body",
        "k -1 200 body",
        "k abc 200 body",
        "k 9223372036854775808 200 body",
        "k TOK 200 body HEADER",
        "k TOK 200 body HEADER name",
        "k TOK 200 body EXTRA",
        "k TOK 200 body HEADER a b EXTRA",
        "k TOK 200 body MIRRORED EXTRA",
    ]
    .iter()
    .map(|r| tk(r))
    .collect();
    let list: Vec<&str> = list.iter().map(String::as_str).collect();
    assert_all_badarg(&mut c, "k", &cases(&["IDEM.COMPLETE"], &list));
    // An empty header name.
    assert_all_badarg(
        &mut c,
        "k",
        &[vec![
            "IDEM.COMPLETE".into(),
            "k".into(),
            t.clone(),
            "200".into(),
            "b".into(),
            "HEADER".into(),
            String::new(),
            "v".into(),
        ]],
    );
    assert_eq!(get_rec(&mut c, "k").state, "in_progress");

    // TOOLARGE: body plus headers above max-body-bytes (1 MiB by default).
    let before = snapshot(&mut c, "k");
    let big = vec![b'x'; 1 << 20];
    let e: redis::RedisResult<Value> = redis::cmd("IDEM.COMPLETE")
        .arg("k")
        .arg(&t)
        .arg(200)
        .arg([&big[..], b"y"].concat())
        .query(&mut c);
    assert_eq!(e.unwrap_err().code(), Some("TOOLARGE"));
    let e: redis::RedisResult<Value> = redis::cmd("IDEM.COMPLETE")
        .arg("k")
        .arg(&t)
        .arg(200)
        .arg(&big[..(1 << 20) - 6 - HEADER_OVERHEAD])
        .arg("HEADER")
        .arg("abc")
        .arg("defg")
        .query(&mut c);
    assert_eq!(e.unwrap_err().code(), Some("TOOLARGE"));
    assert_eq!(snapshot(&mut c, "k"), before, "TOOLARGE changed something");

    // Exactly the limit is accepted (a header counts HEADER_OVERHEAD besides
    // its bytes), and the holder can still complete.
    let v: Value = redis::cmd("IDEM.COMPLETE")
        .arg("k")
        .arg(&t)
        .arg(200)
        .arg(&big[..(1 << 20) - 7 - HEADER_OVERHEAD])
        .arg("HEADER")
        .arg("abc")
        .arg("defg")
        .query(&mut c)
        .unwrap();
    assert_eq!(v, Value::Okay);
    assert_eq!(
        get_rec(&mut c, "k").body.unwrap().len(),
        (1 << 20) - 7 - HEADER_OVERHEAD
    );
}

/// A response of many tiny headers is bounded by `max-headers` (256 by
/// default): before the bound, 1,048,576 one-byte headers fit in
/// `max-body-bytes` and took 51 MB of Redis memory.
#[test]
fn headers_are_bounded_in_count() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let complete_with = |c: &mut redis::Connection, key: &str, t: u64, n: usize| {
        let mut cmd = redis::cmd("IDEM.COMPLETE");
        cmd.arg(key).arg(t).arg(200).arg("b");
        for _ in 0..n {
            cmd.arg("HEADER").arg("h").arg("v");
        }
        cmd.query::<Value>(c)
    };
    let t = begin(&mut c, "k", "fp", 60).token();
    let before = snapshot(&mut c, "k");
    let mut admin = s.conn();
    let mut used_memory = || -> i64 { info(&mut admin, "memory")["used_memory"].parse().unwrap() };
    let memory_before = used_memory();
    let e = complete_with(&mut c, "k", t, 100_000).unwrap_err();
    assert_eq!(e.code(), Some("TOOLARGE"));
    assert_eq!(
        e.detail(),
        Some("more than 256 headers (max-headers)"),
        "{e}"
    );
    assert_eq!(snapshot(&mut c, "k"), before, "TOOLARGE changed something");
    assert!(used_memory() < memory_before + (1 << 20));
    let e = complete_with(&mut c, "k", t, 257).unwrap_err();
    assert_eq!(e.code(), Some("TOOLARGE"));
    assert_eq!(complete_with(&mut c, "k", t, 256).unwrap(), Value::Okay);
    assert_eq!(get_rec(&mut c, "k").headers.unwrap().len(), 2 * 256);

    // The config moves the bound at once; 0 allows no header.
    ok(&mut c, &["CONFIG", "SET", "idem.max-headers", "0"]);
    let t = begin(&mut c, "k2", "fp", 60).token();
    assert_eq!(
        complete_with(&mut c, "k2", t, 1).unwrap_err().code(),
        Some("TOOLARGE")
    );
    assert_eq!(complete_with(&mut c, "k2", t, 0).unwrap(), Value::Okay);
}

#[test]
fn toolarge_follows_config_set() {
    let s = RedisServer::start();
    let mut c = s.conn();
    ok(&mut c, &["CONFIG", "SET", "idem.max-body-bytes", "100"]);
    let t = begin(&mut c, "k", "fp", 60).token();
    let before = snapshot(&mut c, "k");
    let (code, msg) = err(
        &mut c,
        &[
            "IDEM.COMPLETE",
            "k",
            &t.to_string(),
            "200",
            &"x".repeat(101),
        ],
    );
    assert_eq!(code, "TOOLARGE", "{msg}");
    let (code, _) = err(
        &mut c,
        &[
            "IDEM.COMPLETE",
            "k",
            &t.to_string(),
            "200",
            &"x".repeat(98),
            "HEADER",
            "a",
            "bc",
        ],
    );
    assert_eq!(code, "TOOLARGE");
    assert_eq!(snapshot(&mut c, "k"), before);
    complete(&mut c, "k", t, 200, &[b'x'; 100], &[]);

    ok(&mut c, &["CONFIG", "SET", "idem.max-body-bytes", "1000"]);
    let t = begin(&mut c, "k2", "fp", 60).token();
    complete(&mut c, "k2", t, 200, &[b'x'; 1000], &[]);
}

#[test]
fn abort_touch_get_pull_ack_badarg() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let t = begin(&mut c, "k", "fp", 60).token().to_string();
    let sub = |l: &[&str]| -> Vec<String> { l.iter().map(|r| r.replace("TOK", &t)).collect() };

    let abort = sub(&["", "k", "k TOK extra", "k 0", "k -1", "k abc", "k 1.5"]);
    let abort: Vec<&str> = abort.iter().map(String::as_str).collect();
    assert_all_badarg(&mut c, "k", &cases(&["IDEM.ABORT"], &abort));

    let touch = sub(&[
        "",
        "k",
        "k TOK",
        "k TOK 0",
        "k TOK -1",
        "k TOK x",
        "k TOK 10 extra",
        "k 0 10",
        "k x 10",
    ]);
    let touch: Vec<&str> = touch.iter().map(String::as_str).collect();
    assert_all_badarg(&mut c, "k", &cases(&["IDEM.TOUCH"], &touch));

    assert_all_badarg(&mut c, "k", &cases(&["IDEM.GET"], &["", "k extra"]));

    assert_all_badarg(
        &mut c,
        "k",
        &cases(
            &["IDEM.MIRROR.PULL"],
            &[
                "",
                "0",
                "-1",
                "x",
                "10001",
                "10 CLAIM",
                "10 CLAIM 0",
                "10 CLAIM x",
                "10 BLOCK",
                "10 BLOCK -1",
                "10 FOO 1",
                "10 extra",
            ],
        ),
    );

    let ack = sub(&["", "k", "k 0", "k x", "k TOK extra"]);
    let ack: Vec<&str> = ack.iter().map(String::as_str).collect();
    assert_all_badarg(&mut c, "k", &cases(&["IDEM.MIRROR.ACK"], &ack));

    // The record is intact and its holder still in charge.
    let t: u64 = t.parse().unwrap();
    assert_eq!(get_rec(&mut c, "k").token, t);
    complete(&mut c, "k", t, 200, b"ok", &[]);
}

#[test]
fn stale_notfound_completed() {
    let s = RedisServer::start();
    let mut c = s.conn();

    // NOTFOUND: no record.
    assert_err(
        &mut c,
        &["IDEM.COMPLETE", "none", "5", "200", "x"],
        "NOTFOUND",
    );
    assert_err(&mut c, &["IDEM.TOUCH", "none", "5", "100"], "NOTFOUND");
    assert_eq!(abort(&mut c, "none", 5), 0);
    assert_eq!(ack(&mut c, "none", 5), 0);
    assert_eq!(dbsize(&mut c), 0, "errors created nothing");

    // STALE: a token that is not the holder's (never issued, or taken over).
    let t = begin_lease(&mut c, "k", "fp", 60, 30).token();
    let before = snapshot(&mut c, "k");
    for wrong in [t - 1, t + 1] {
        assert_err(
            &mut c,
            &["IDEM.COMPLETE", "k", &wrong.to_string(), "200", "x"],
            "STALE",
        );
        assert_err(
            &mut c,
            &["IDEM.TOUCH", "k", &wrong.to_string(), "100"],
            "STALE",
        );
        assert_eq!(abort(&mut c, "k", wrong), 0);
    }
    assert_eq!(snapshot(&mut c, "k"), before);
    sleep_ms(50);
    let t2 = begin(&mut c, "k", "fp", 60).token();
    let before = snapshot(&mut c, "k");
    assert_err(
        &mut c,
        &["IDEM.COMPLETE", "k", &t.to_string(), "200", "x"],
        "STALE",
    );
    assert_err(&mut c, &["IDEM.TOUCH", "k", &t.to_string(), "100"], "STALE");
    assert_eq!(snapshot(&mut c, "k"), before);

    // COMPLETED: the holder's own token on a completed record.
    complete(&mut c, "k", t2, 200, b"first", &[]);
    let before = snapshot(&mut c, "k");
    assert_err(
        &mut c,
        &["IDEM.COMPLETE", "k", &t2.to_string(), "500", "second"],
        "COMPLETED",
    );
    assert_err(
        &mut c,
        &["IDEM.TOUCH", "k", &t2.to_string(), "100"],
        "COMPLETED",
    );
    // A wrong token on a completed record is stale, not completed.
    assert_err(
        &mut c,
        &["IDEM.COMPLETE", "k", &t.to_string(), "500", "second"],
        "STALE",
    );
    assert_eq!(abort(&mut c, "k", t2), 0);
    assert_eq!(snapshot(&mut c, "k"), before);
    assert_eq!(get_rec(&mut c, "k").body, Some(b"first".to_vec()));

    // Every message starts with its code word and says something more.
    let (_, msg) = err(&mut c, &["IDEM.COMPLETE", "k", &t2.to_string(), "200", "x"]);
    assert!(
        msg.starts_with("COMPLETED ") && msg.len() > "COMPLETED ".len() + 3,
        "{msg}"
    );
}

#[test]
fn wrongtype_on_other_values_and_nothing_changes() {
    let s = RedisServer::start();
    let mut c = s.conn();
    ok(&mut c, &["SET", "str", "value"]);
    ok(&mut c, &["HSET", "hash", "f", "v"]);
    let d = digest(&mut c);
    for key in ["str", "hash"] {
        for args in [
            vec!["IDEM.BEGIN", key, "fp", "60"],
            vec!["IDEM.COMPLETE", key, "1", "200", "x"],
            vec!["IDEM.TOUCH", key, "1", "100"],
            vec!["IDEM.ABORT", key, "1"],
            vec!["IDEM.GET", key],
            vec!["IDEM.MIRROR.ACK", key, "1"],
        ] {
            let (code, msg) = err(&mut c, &args);
            assert_eq!(code, "WRONGTYPE", "{args:?} -> {msg}");
        }
    }
    assert_eq!(digest(&mut c), d);
    assert_eq!(text(&ok(&mut c, &["GET", "str"])), "value");

    // And the other way round: plain commands refuse a record.
    begin(&mut c, "rec", "fp", 60).token();
    assert_err(&mut c, &["GET", "rec"], "WRONGTYPE");
    assert_err(&mut c, &["HGET", "rec", "state"], "WRONGTYPE");
    let ty = text(&ok(&mut c, &["TYPE", "rec"]));
    assert!(
        !["none", "string", "hash", "list", "set", "zset", "stream"].contains(&ty.as_str()),
        "TYPE {ty}"
    );
}

#[test]
fn garbage_never_takes_the_server_down() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let t = begin(&mut c, "k", "fp", 60).token();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x1de3);
    let commands = [
        "IDEM.BEGIN",
        "IDEM.COMPLETE",
        "IDEM.ABORT",
        "IDEM.TOUCH",
        "IDEM.GET",
        "IDEM.MIRROR.PULL",
        "IDEM.MIRROR.ACK",
        "IDEM._PUT",
    ];
    let words: [&[u8]; 16] = [
        b"k",
        b"LEASE",
        b"WAIT",
        b"HEADER",
        b"MIRRORED",
        b"CLAIM",
        b"BLOCK",
        b"0",
        b"-1",
        b"200",
        b"18446744073709551616",
        b"9223372036854775807",
        b"1",
        b"",
        b"\x00\xff",
        b"60",
    ];
    for _ in 0..3000 {
        let mut cmd = redis::cmd(commands[rng.random_range(0..commands.len())]);
        for _ in 0..rng.random_range(0..9) {
            match rng.random_range(0..4) {
                0 => {
                    let n = rng.random_range(0..40);
                    let junk: Vec<u8> = (0..n).map(|_| rng.random()).collect();
                    cmd.arg(junk);
                }
                1 => {
                    cmd.arg(rng.random::<i64>());
                }
                2 => {
                    cmd.arg(t);
                }
                _ => {
                    cmd.arg(words[rng.random_range(0..words.len())]);
                }
            }
        }
        // Blocking options are left out: a valid huge BLOCK would stall the loop.
        let args: Vec<Vec<u8>> = cmd
            .args_iter()
            .map(|a| match a {
                redis::Arg::Simple(b) => b.to_vec(),
                _ => vec![],
            })
            .collect();
        if args
            .iter()
            .any(|a| a.eq_ignore_ascii_case(b"BLOCK") || a.eq_ignore_ascii_case(b"WAIT"))
        {
            continue;
        }
        match cmd.query::<Value>(&mut c) {
            Ok(_) => {}
            Err(e) => {
                let code = e.code().unwrap_or("");
                assert!(
                    [
                        "BADARG",
                        "STALE",
                        "NOTFOUND",
                        "COMPLETED",
                        "TOOLARGE",
                        "WRONGTYPE"
                    ]
                    .contains(&code)
                        // The internal effect command refuses clients.
                        || (code == "NOPERM" && args[0] == b"IDEM._PUT"),
                    "unexpected error {e} for {args:?}"
                );
            }
        }
    }
    assert_eq!(ok(&mut c, &["PING"]), Value::SimpleString("PONG".into()));
    // The records garbage touched are still well-formed, INFO still answers.
    let _ = get(&mut c, "k");
    assert!(idem_counter(&mut c, "idem_new") >= 1);
}

#[test]
fn command_table_key_positions_and_flags() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let names = [
        "idem.begin",
        "idem.complete",
        "idem.abort",
        "idem.touch",
        "idem.get",
        "idem.mirror.ack",
        "idem.mirror.pull",
    ];
    let v = ok(&mut c, &[&["COMMAND", "INFO"][..], &names[..]].concat());
    let infos = array(&v);
    assert_eq!(infos.len(), names.len());
    for (name, info) in names.iter().zip(infos) {
        let a = array(info);
        assert_eq!(text(&a[0]).to_lowercase(), *name);
        let flags: Vec<String> = array(&a[2]).iter().map(text).collect();
        let (first, last, step) = (int(&a[3]), int(&a[4]), int(&a[5]));
        match *name {
            "idem.mirror.pull" => assert_eq!((first, last, step), (0, 0, 0), "{name} is keyless"),
            _ => assert_eq!((first, last, step), (1, 1, 1), "{name} key position"),
        }
        match *name {
            "idem.get" => {
                assert!(flags.contains(&"readonly".into()), "{name} {flags:?}");
                assert!(!flags.contains(&"write".into()), "{name} {flags:?}");
            }
            "idem.mirror.pull" => {}
            // COMPLETE grows memory, so it is refused under OOM; BEGIN refuses
            // only a new record itself (tests/oom.rs) so that replays still
            // answer; ABORT, TOUCH and ACK free or keep memory.
            "idem.complete" => {
                assert!(flags.contains(&"write".into()), "{name} {flags:?}");
                assert!(flags.contains(&"denyoom".into()), "{name} {flags:?}");
            }
            _ => {
                assert!(flags.contains(&"write".into()), "{name} {flags:?}");
                assert!(!flags.contains(&"denyoom".into()), "{name} {flags:?}");
            }
        }
    }

    for (args, key) in [
        (
            vec!["IDEM.BEGIN", "the-key", "fp", "60", "LEASE", "5"],
            "the-key",
        ),
        (
            vec!["IDEM.COMPLETE", "ck", "1", "200", "b", "HEADER", "a", "b"],
            "ck",
        ),
        (vec!["IDEM.ABORT", "ak", "1"], "ak"),
        (vec!["IDEM.TOUCH", "tk", "1", "5"], "tk"),
        (vec!["IDEM.GET", "gk"], "gk"),
        (vec!["IDEM.MIRROR.ACK", "mk", "1"], "mk"),
    ] {
        let v = ok(&mut c, &[&["COMMAND", "GETKEYS"][..], &args[..]].concat());
        assert_eq!(byte_list(&v), vec![key.as_bytes().to_vec()], "{args:?}");
    }
}

#[test]
fn acl_key_patterns_apply() {
    let s = RedisServer::start();
    let mut admin = s.conn();
    ok(
        &mut admin,
        &[
            "ACL",
            "SETUSER",
            "alice",
            "on",
            ">secret",
            "~allowed:*",
            "+@all",
        ],
    );
    let client =
        redis::Client::open(format!("redis://alice:secret@127.0.0.1:{}/", s.port)).unwrap();
    let mut c = client.get_connection().unwrap();

    let t = begin(&mut c, "allowed:1", "fp", 60).token();
    complete(&mut c, "allowed:1", t, 200, b"ok", &[]);
    assert!(get(&mut c, "allowed:1").is_some());

    begin(&mut admin, "other:1", "fp", 60).token();
    let before = digest(&mut admin);
    for args in [
        vec!["IDEM.BEGIN", "other:1", "fp", "60"],
        vec!["IDEM.BEGIN", "other:2", "fp", "60"],
        vec!["IDEM.COMPLETE", "other:1", "1", "200", "x"],
        vec!["IDEM.ABORT", "other:1", "1"],
        vec!["IDEM.TOUCH", "other:1", "1", "100"],
        vec!["IDEM.GET", "other:1"],
        vec!["IDEM.MIRROR.ACK", "other:1", "1"],
    ] {
        let (code, msg) = err(&mut c, &args);
        assert_eq!(code, "NOPERM", "{args:?} -> {msg}");
    }
    assert_eq!(digest(&mut admin), before);
    assert_eq!(get(&mut admin, "other:2"), None);
}

#[test]
fn out_of_memory_refuses_growth_but_lets_holders_finish_or_release() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let held = begin(&mut c, "held", "fp", 60).token();
    let released = begin(&mut c, "released", "fp", 60).token();
    ok(&mut c, &["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    ok(&mut c, &["CONFIG", "SET", "maxmemory", "1"]);
    let before = digest(&mut c);
    assert_err(&mut c, &["IDEM.BEGIN", "new", "fp", "60"], "OOM");
    assert_err(
        &mut c,
        &["IDEM.COMPLETE", "held", &held.to_string(), "200", "x"],
        "OOM",
    );
    assert_eq!(digest(&mut c), before);
    assert_eq!(touch(&mut c, "held", held, 100), 100);
    assert_eq!(abort(&mut c, "released", released), 1);
    assert!(get(&mut c, "held").is_some());
    ok(&mut c, &["CONFIG", "SET", "maxmemory", "0"]);
    complete(&mut c, "held", held, 200, b"x", &[]);
}

#[test]
fn clients_cannot_forge_records_with_the_internal_effect_command() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let token = begin(&mut c, "src", "fp", 60).token();
    let blob = bytes(&ok(&mut c, &["DUMP", "src"]));
    assert_err(&mut c, &["IDEM._PUT", "forged", "garbage"], "NOPERM");
    let mut cmd = redis::cmd("IDEM._PUT");
    cmd.arg("forged").arg(blob);
    let e = cmd.query::<Value>(&mut c).unwrap_err();
    assert_eq!(e.code(), Some("NOPERM"));
    assert_eq!(ok(&mut c, &["EXISTS", "forged"]), Value::Int(0));
    assert_eq!(get_rec(&mut c, "src").token, token);
}
