//! The four outcomes of IDEM.BEGIN (every row of the decision table, takeover
//! and fencing, expiry, token growth) and the holder's commands (COMPLETE,
//! ABORT, TOUCH, GET), over RESP2 and RESP3, inside MULTI and from Lua.

mod common;

use common::*;
use idem_testkit::{eventually, RedisServer};
use redis::Value;
use std::time::Duration;

#[test]
fn new_in_flight_replay_and_get_for_both_states() {
    let s = RedisServer::start();
    let mut c = s.conn();

    assert_eq!(get(&mut c, "k"), None, "no record yet");
    let before = now_ms();
    let token = begin(&mut c, "k", "fp-1", 60).token();
    let after = now_ms();

    let r = get_rec(&mut c, "k");
    assert_eq!(r.state, "in_progress");
    assert_eq!(r.fingerprint, fp_hex(b"fp-1"));
    assert_eq!(r.token, token);
    assert!((before..=after).contains(&r.created_at), "{r:?}");
    assert_eq!(r.expires_at, r.created_at + 60_000);
    assert_eq!(
        r.lease_until,
        Some(r.created_at + 30_000),
        "default lease-ms"
    );
    assert_eq!(
        (r.status, r.body.clone(), r.headers.clone()),
        (None, None, None)
    );

    // Same fingerprint, lease alive: in_flight with the remaining lease.
    let t0 = now_ms();
    let Outcome::InFlight(retry) = begin(&mut c, "k", "fp-1", 60) else {
        panic!("expected in_flight")
    };
    let t1 = now_ms();
    let lease_until = r.lease_until.unwrap();
    assert!(
        retry <= lease_until - t0 && retry >= lease_until - t1,
        "retry {retry} vs lease_until {lease_until}"
    );
    assert_eq!(get_rec(&mut c, "k"), r, "in_flight changes nothing");

    let headers = [
        ("content-type", "application/json"),
        ("x-request-id", "abc"),
    ];
    complete(&mut c, "k", token, 201, br#"{"id":1}"#, &headers);
    assert_eq!(
        begin(&mut c, "k", "fp-1", 60),
        Outcome::Replay {
            status: 201,
            body: br#"{"id":1}"#.to_vec(),
            headers: flat_headers(&headers),
        }
    );

    let done = get_rec(&mut c, "k");
    assert_eq!(done.state, "completed");
    assert_eq!(done.fingerprint, r.fingerprint);
    assert_eq!(done.token, token);
    assert_eq!(
        (done.created_at, done.expires_at),
        (r.created_at, r.expires_at)
    );
    assert_eq!(done.lease_until, None);
    assert_eq!(done.status, Some(201));
    assert_eq!(done.body.as_deref(), Some(&br#"{"id":1}"#[..]));
    assert_eq!(done.headers, Some(flat_headers(&headers)));
    let completed_at = done.completed_at.unwrap();
    assert!(completed_at >= done.created_at && completed_at <= now_ms());
    assert_eq!(done.mirror.as_deref(), Some("pending"));
}

#[test]
fn mismatch_is_checked_first_and_changes_nothing() {
    let s = RedisServer::start();
    let mut c = s.conn();

    // In progress, lease alive.
    let t = begin(&mut c, "live", "a", 60).token();
    let snap = get_rec(&mut c, "live");
    assert_eq!(begin(&mut c, "live", "b", 60), Outcome::Mismatch);
    assert_eq!(get_rec(&mut c, "live"), snap);

    // In progress, lease lapsed: a different fingerprint must not take over.
    begin_lease(&mut c, "lapsed", "a", 60, 20);
    let snap = get_rec(&mut c, "lapsed");
    sleep_ms(40);
    assert_eq!(
        begin_lease(&mut c, "lapsed", "b", 60, 1000),
        Outcome::Mismatch
    );
    assert_eq!(get_rec(&mut c, "lapsed"), snap);

    // Completed.
    complete(&mut c, "live", t, 200, b"ok", &[]);
    let snap = get_rec(&mut c, "live");
    assert_eq!(begin(&mut c, "live", "b", 60), Outcome::Mismatch);
    assert_eq!(begin(&mut c, "live", "", 60), Outcome::Mismatch);
    assert_eq!(get_rec(&mut c, "live"), snap);
    let pexp = pexpiretime(&mut c, "live");
    assert_eq!(pexp, snap.expires_at as i64);
}

#[test]
fn takeover_after_lease_lapses_fences_the_old_holder() {
    let s = RedisServer::start();
    let mut c = s.conn();

    let old = begin_lease(&mut c, "k", "fp", 60, 300).token();
    let first = get_rec(&mut c, "k");
    let first_pexp = pexpiretime(&mut c, "k");
    assert!(matches!(begin(&mut c, "k", "fp", 60), Outcome::InFlight(ms) if ms <= 300));
    sleep_ms(320);

    // The ttl of the taking-over request does not change the expiry.
    let before = now_ms();
    let new = begin_lease(&mut c, "k", "fp", 3600, 10_000).token();
    assert!(new > old, "takeover token {new} must exceed {old}");
    let r = get_rec(&mut c, "k");
    assert_eq!(r.state, "in_progress");
    assert_eq!(r.token, new);
    assert_eq!(
        (r.created_at, r.expires_at),
        (first.created_at, first.expires_at)
    );
    let lease_until = r.lease_until.unwrap();
    assert!(lease_until >= before + 10_000 && lease_until <= now_ms() + 10_000);
    assert_eq!(
        pexpiretime(&mut c, "k"),
        first_pexp,
        "takeover keeps the expiry"
    );
    assert!(pttl(&mut c, "k") <= 60_000);

    // The old holder is fenced: nothing it does changes the record.
    assert_err(
        &mut c,
        &["IDEM.COMPLETE", "k", &old.to_string(), "200", "x"],
        "STALE",
    );
    assert_err(
        &mut c,
        &["IDEM.TOUCH", "k", &old.to_string(), "5000"],
        "STALE",
    );
    assert_eq!(abort(&mut c, "k", old), 0);
    assert_eq!(get_rec(&mut c, "k"), r);

    // The new holder completes; the replay is its response.
    complete(&mut c, "k", new, 202, b"second", &[]);
    assert_eq!(
        begin(&mut c, "k", "fp", 60),
        Outcome::Replay {
            status: 202,
            body: b"second".to_vec(),
            headers: vec![]
        }
    );
    assert_err(
        &mut c,
        &["IDEM.COMPLETE", "k", &old.to_string(), "200", "x"],
        "STALE",
    );
}

#[test]
fn repeated_takeovers_keep_growing_tokens() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let mut last = begin_lease(&mut c, "k", "fp", 60, 10).token();
    let expires = get_rec(&mut c, "k").expires_at;
    for _ in 0..5 {
        sleep_ms(20);
        let t = begin_lease(&mut c, "k", "fp", 60, 10).token();
        assert!(t > last);
        last = t;
    }
    assert_eq!(get_rec(&mut c, "k").expires_at, expires);
    complete(&mut c, "k", last, 200, b"", &[]);
    assert_eq!(
        begin(&mut c, "k", "fp", 60),
        Outcome::Replay {
            status: 200,
            body: vec![],
            headers: vec![]
        }
    );
}

#[test]
fn lapsed_lease_without_takeover_still_completes() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let t = begin_lease(&mut c, "k", "fp", 60, 20).token();
    sleep_ms(50);
    complete(&mut c, "k", t, 200, b"late", &[]);
    assert!(matches!(
        begin(&mut c, "k", "fp", 60),
        Outcome::Replay { status: 200, .. }
    ));
}

#[test]
fn expiry_comes_from_ttl() {
    let s = RedisServer::start();
    let mut c = s.conn();
    begin(&mut c, "k", "fp", 60);
    let ttl = pttl(&mut c, "k");
    assert!(ttl > 59_000 && ttl <= 60_000, "PTTL {ttl}");
    let r = get_rec(&mut c, "k");
    assert_eq!(pexpiretime(&mut c, "k"), r.expires_at as i64);

    // Completing keeps the expiry.
    complete(&mut c, "k", r.token, 200, b"x", &[]);
    assert_eq!(pexpiretime(&mut c, "k"), r.expires_at as i64);

    // The maximum ttl (30 days by default) is accepted.
    begin(&mut c, "long", "fp", 2_592_000);
    let r = get_rec(&mut c, "long");
    assert_eq!(r.expires_at - r.created_at, 2_592_000_000);
    assert_eq!(pexpiretime(&mut c, "long"), r.expires_at as i64);
}

#[test]
fn records_expire_even_while_in_progress() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let t1 = begin_lease(&mut c, "k", "fp", 1, 60_000).token();
    assert!(eventually(Duration::from_secs(5), || get(&mut c, "k").is_none()));
    assert_eq!(int(&ok(&mut c, &["EXISTS", "k"])), 0);
    // The old holder finds nothing; a new request starts afresh.
    assert_err(
        &mut c,
        &["IDEM.COMPLETE", "k", &t1.to_string(), "200", "x"],
        "NOTFOUND",
    );
    let t2 = begin(&mut c, "k", "other-fp", 60).token();
    assert!(t2 > t1);
}

#[test]
fn tokens_grow_across_expiry_abort_and_delete() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let t1 = completed(&mut c, "k", "fp", 1, b"v1");
    assert!(eventually(Duration::from_secs(5), || {
        int(&ok(&mut c, &["EXISTS", "k"])) == 0
    }));
    let t2 = begin(&mut c, "k", "fp", 60).token();
    assert!(t2 > t1, "{t2} > {t1} after expiry");
    assert_eq!(abort(&mut c, "k", t2), 1);
    let t3 = begin(&mut c, "k", "fp", 60).token();
    assert!(t3 > t2, "after abort");
    assert_eq!(int(&ok(&mut c, &["DEL", "k"])), 1);
    let t4 = begin(&mut c, "k", "fp", 60).token();
    assert!(t4 > t3, "after DEL");
    assert!(t4 < 1 << 53);
}

#[test]
fn tokens_strictly_increase_within_a_millisecond() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let mut p = redis::pipe();
    for i in 0..2000 {
        p.cmd("IDEM.BEGIN").arg(format!("k{i}")).arg("fp").arg(60);
    }
    let replies: Vec<Value> = p.query(&mut c).unwrap();
    let tokens: Vec<u64> = replies.iter().map(|v| Outcome::parse(v).token()).collect();
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens not increasing"
    );
    // max(last + 1, now_ms * 1000): close to the clock.
    let now = now_ms() * 1000;
    assert!(tokens[0] <= now && tokens[0] > now - 60_000_000);
}

#[test]
fn replay_shape_binary_bodies_and_headers() {
    let s = RedisServer::start();
    let mut c = s.conn();

    // No headers: an empty array. Empty body.
    let t = begin(&mut c, "empty", "fp", 60).token();
    complete(&mut c, "empty", t, 204, b"", &[]);
    let raw_reply = ok(&mut c, &["IDEM.BEGIN", "empty", "fp", "60"]);
    assert_eq!(
        raw_reply,
        Value::Array(vec![
            Value::BulkString(b"replay".to_vec()),
            Value::Int(204),
            Value::BulkString(vec![]),
            Value::Array(vec![]),
        ])
    );
    assert_eq!(get_rec(&mut c, "empty").headers, Some(vec![]));

    // Binary body and header values, duplicate header names kept in order.
    let body: Vec<u8> = (0..=255u8).chain([0, 0, 255]).collect();
    let t = begin(&mut c, "bin", "fp", 60).token();
    let v: Value = redis::cmd("IDEM.COMPLETE")
        .arg("bin")
        .arg(t)
        .arg(599)
        .arg(&body)
        .arg("HEADER")
        .arg("set-cookie")
        .arg("a=1")
        .arg("header") // options are case-insensitive
        .arg("set-cookie")
        .arg(&b"b=\x00\xff"[..])
        .arg("HEADER")
        .arg("x-empty")
        .arg("")
        .query(&mut c)
        .unwrap();
    assert_eq!(v, Value::Okay);
    let expected_headers = vec![
        b"set-cookie".to_vec(),
        b"a=1".to_vec(),
        b"set-cookie".to_vec(),
        b"b=\x00\xff".to_vec(),
        b"x-empty".to_vec(),
        vec![],
    ];
    assert_eq!(
        begin(&mut c, "bin", "fp", 60),
        Outcome::Replay {
            status: 599,
            body: body.clone(),
            headers: expected_headers.clone()
        }
    );
    let r = get_rec(&mut c, "bin");
    assert_eq!(r.body, Some(body));
    assert_eq!(r.headers, Some(expected_headers));
    assert_eq!(r.status, Some(599));

    // Status bounds are inclusive.
    let t = begin(&mut c, "s100", "fp", 60).token();
    complete(&mut c, "s100", t, 100, b"", &[]);
    assert!(matches!(
        begin(&mut c, "s100", "fp", 60),
        Outcome::Replay { status: 100, .. }
    ));
}

#[test]
fn packed_replays_carry_the_same_response_in_one_string() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let t = begin(&mut c, "empty", "fp", 60).token();
    complete(&mut c, "empty", t, 204, b"", &[]);
    // body | status | header count | body length (docs/module/commands.md: IDEM.BEGIN).
    assert_eq!(
        ok(&mut c, &["IDEM.BEGIN", "empty", "fp", "60", "PACKED"]),
        Value::Array(vec![
            Value::BulkString(b"replay".to_vec()),
            Value::BulkString(b"\0\xcc\0\0\0\0\0\0\0\0".to_vec()),
        ])
    );

    let body: Vec<u8> = (0..=255u8).chain([0, 0, 255]).collect();
    let t = begin(&mut c, "bin", "fp", 60).token();
    let headers = [
        ("set-cookie", "a=1"),
        ("set-cookie", "b=2"),
        ("x-empty", ""),
    ];
    complete(&mut c, "bin", t, 201, &body, &headers);
    let fields = begin(&mut c, "bin", "fp", 60);
    let v = ok(&mut c, &["IDEM.BEGIN", "bin", "fp", "60", "packed"]);
    assert_eq!(array(&v).len(), 2, "{v:?}");
    assert_eq!(Outcome::parse(&v), fields);
    assert_eq!(
        fields,
        Outcome::Replay {
            status: 201,
            body,
            headers: flat_headers(&headers),
        }
    );

    // The other outcomes do not change shape.
    let v = ok(&mut c, &["IDEM.BEGIN", "k", "fp", "60", "PACKED"]);
    assert_eq!(array(&v).len(), 2);
    assert_eq!(array(&v)[0], Value::BulkString(b"new".to_vec()));
    let v = ok(&mut c, &["IDEM.BEGIN", "k", "fp", "60", "PACKED"]);
    assert_eq!(array(&v)[0], Value::BulkString(b"in_flight".to_vec()));
    assert_eq!(
        ok(&mut c, &["IDEM.BEGIN", "k", "other", "60", "PACKED"]),
        Value::Array(vec![Value::BulkString(b"mismatch".to_vec())])
    );
    assert_err(
        &mut c,
        &["IDEM.BEGIN", "k", "fp", "60", "PACKED", "1"],
        "BADARG",
    );
}

#[test]
fn reply_types_are_exact() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let v = ok(&mut c, &["IDEM.BEGIN", "k", "fp", "60"]);
    let a = array(&v);
    // Outcome words are bulk strings (plain strings in Lua); numbers are integers.
    assert_eq!(a[0], Value::BulkString(b"new".to_vec()));
    assert!(matches!(a[1], Value::Int(_)));
    let v = ok(&mut c, &["IDEM.BEGIN", "k", "fp", "60"]);
    assert_eq!(array(&v)[0], Value::BulkString(b"in_flight".to_vec()));
    assert!(matches!(array(&v)[1], Value::Int(_)));
    let v = ok(&mut c, &["IDEM.BEGIN", "k", "other", "60"]);
    assert_eq!(
        v,
        Value::Array(vec![Value::BulkString(b"mismatch".to_vec())])
    );
    assert_eq!(ok(&mut c, &["IDEM.GET", "nothing"]), Value::Nil);
}

#[test]
fn fingerprints_of_any_length_are_hashed() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let big = vec![b'z'; 1 << 20];
    let v: Value = redis::cmd("IDEM.BEGIN")
        .arg("big")
        .arg(&big)
        .arg(60)
        .query(&mut c)
        .unwrap();
    Outcome::parse(&v).token();
    assert_eq!(get_rec(&mut c, "big").fingerprint, fp_hex(&big));
    let v: Value = redis::cmd("IDEM.BEGIN")
        .arg("big")
        .arg(&big)
        .arg(60)
        .query(&mut c)
        .unwrap();
    assert!(matches!(Outcome::parse(&v), Outcome::InFlight(_)));

    begin(&mut c, "empty", "", 60).token();
    assert_eq!(get_rec(&mut c, "empty").fingerprint, fp_hex(b""));
    assert!(matches!(
        begin(&mut c, "empty", "", 60),
        Outcome::InFlight(_)
    ));
    assert_eq!(begin(&mut c, "empty", " ", 60), Outcome::Mismatch);

    // Binary-safe keys.
    let key = b"a key\x00with\xffbytes";
    let v: Value = redis::cmd("IDEM.BEGIN")
        .arg(&key[..])
        .arg("fp")
        .arg(60)
        .query(&mut c)
        .unwrap();
    let t = Outcome::parse(&v).token();
    let v: Value = redis::cmd("IDEM.GET").arg(&key[..]).query(&mut c).unwrap();
    assert_eq!(Rec::parse(&v).unwrap().token, t);
}

#[test]
fn lease_option_sets_the_lease() {
    let s = RedisServer::start();
    let mut c = s.conn();
    begin_lease(&mut c, "a", "fp", 60, 1234);
    let r = get_rec(&mut c, "a");
    assert_eq!(r.lease_until, Some(r.created_at + 1234));
    let v = ok(&mut c, &["IDEM.BEGIN", "b", "fp", "60", "lease", "1"]);
    Outcome::parse(&v).token();
    let r = get_rec(&mut c, "b");
    assert_eq!(r.lease_until, Some(r.created_at + 1));
}

#[test]
fn abort_deletes_the_in_progress_record() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let t = begin(&mut c, "k", "fp", 60).token();
    assert_eq!(abort(&mut c, "k", t + 1), 0, "not the holder");
    assert_eq!(get_rec(&mut c, "k").token, t);
    assert_eq!(abort(&mut c, "k", t), 1);
    assert_eq!(get(&mut c, "k"), None);
    assert_eq!(int(&ok(&mut c, &["EXISTS", "k"])), 0);
    assert_eq!(abort(&mut c, "k", t), 0, "already gone");

    // The next request starts afresh, even with another fingerprint.
    let t2 = begin(&mut c, "k", "other", 60).token();
    assert!(t2 > t);

    // A completed record cannot be aborted.
    complete(&mut c, "k", t2, 200, b"x", &[]);
    let snap = get_rec(&mut c, "k");
    assert_eq!(abort(&mut c, "k", t2), 0);
    assert_eq!(get_rec(&mut c, "k"), snap);
}

#[test]
fn touch_extends_the_lease() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let t = begin_lease(&mut c, "k", "fp", 60, 100).token();
    let before = now_ms();
    assert_eq!(touch(&mut c, "k", t, 20_000), 20_000);
    let lease_until = get_rec(&mut c, "k").lease_until.unwrap();
    assert!(lease_until >= before + 20_000 && lease_until <= now_ms() + 20_000);
    sleep_ms(150); // past the original lease: still in flight
    assert!(matches!(begin(&mut c, "k", "fp", 60), Outcome::InFlight(ms) if ms > 19_000));

    // Shortening works too; a lapsed but untaken lease can still be touched.
    assert_eq!(touch(&mut c, "k", t, 10), 10);
    sleep_ms(30);
    assert_eq!(touch(&mut c, "k", t, 5000), 5000);
    assert!(matches!(begin(&mut c, "k", "fp", 60), Outcome::InFlight(_)));
    let r = get_rec(&mut c, "k");
    assert_eq!(r.token, t, "touch keeps the token");
    complete(&mut c, "k", t, 200, b"", &[]);
}

#[test]
fn resp3_replies() {
    let s = RedisServer::start();
    let client = redis::Client::open(format!("{}?protocol=resp3", s.url())).unwrap();
    let mut c = client.get_connection().unwrap();
    let hello: Value = redis::cmd("HELLO").arg(3).query(&mut c).unwrap();
    let Value::Map(fields) = hello else {
        panic!("HELLO 3 should answer a map")
    };
    assert!(fields.contains(&(Value::BulkString(b"proto".to_vec()), Value::Int(3))));

    assert_eq!(ok(&mut c, &["IDEM.GET", "k"]), Value::Nil);
    let t = begin(&mut c, "k", "fp", 60).token();
    assert!(matches!(begin(&mut c, "k", "fp", 60), Outcome::InFlight(_)));
    assert_eq!(begin(&mut c, "k", "x", 60), Outcome::Mismatch);
    let r = get_rec(&mut c, "k");
    assert_eq!(r.token, t);
    complete(&mut c, "k", t, 201, b"body", &[("a", "b")]);
    assert_eq!(
        begin(&mut c, "k", "fp", 60),
        Outcome::Replay {
            status: 201,
            body: b"body".to_vec(),
            headers: flat_headers(&[("a", "b")])
        }
    );
    let r3 = get_rec(&mut c, "k");
    let mut c2 = s.conn();
    assert_eq!(get_rec(&mut c2, "k"), r3, "RESP2 and RESP3 GET agree");
    assert_eq!(abort(&mut c, "k", t), 0);
    let t2 = begin(&mut c, "k2", "fp", 60).token();
    assert_eq!(touch(&mut c, "k2", t2, 500), 500);
    assert_eq!(abort(&mut c, "k2", t2), 1);
}

#[test]
fn inside_multi() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let replies: Vec<Value> = redis::pipe()
        .atomic()
        .cmd("IDEM.BEGIN")
        .arg("k")
        .arg("fp")
        .arg(60)
        .cmd("IDEM.BEGIN")
        .arg("k")
        .arg("fp")
        .arg(60)
        .cmd("IDEM.BEGIN")
        .arg("k")
        .arg("other")
        .arg(60)
        .cmd("IDEM.GET")
        .arg("k")
        .query(&mut c)
        .unwrap();
    let t = Outcome::parse(&replies[0]).token();
    assert!(matches!(Outcome::parse(&replies[1]), Outcome::InFlight(_)));
    assert_eq!(Outcome::parse(&replies[2]), Outcome::Mismatch);
    assert_eq!(Rec::parse(&replies[3]).unwrap().token, t);

    let replies: Vec<Value> = redis::pipe()
        .atomic()
        .cmd("IDEM.COMPLETE")
        .arg("k")
        .arg(t)
        .arg(200)
        .arg("done")
        .cmd("IDEM.BEGIN")
        .arg("k")
        .arg("fp")
        .arg(60)
        .query(&mut c)
        .unwrap();
    assert_eq!(replies[0], Value::Okay);
    assert!(matches!(
        Outcome::parse(&replies[1]),
        Outcome::Replay { status: 200, .. }
    ));
    assert!(matches!(
        begin(&mut c, "k", "fp", 60),
        Outcome::Replay { status: 200, .. }
    ));

    // A transaction that aborts and begins again sees its own writes.
    let t2 = begin(&mut c, "a", "fp", 60).token();
    let replies: Vec<Value> = redis::pipe()
        .atomic()
        .cmd("IDEM.ABORT")
        .arg("a")
        .arg(t2)
        .cmd("IDEM.BEGIN")
        .arg("a")
        .arg("fp2")
        .arg(60)
        .query(&mut c)
        .unwrap();
    assert_eq!(replies[0], Value::Int(1));
    assert!(Outcome::parse(&replies[1]).token() > t2);
}

#[test]
fn from_lua_scripts() {
    let s = RedisServer::start();
    let mut c = s.conn();
    // Outcome words are bulk strings: Lua compares them as plain strings.
    let script = r#"
        local r = redis.call('IDEM.BEGIN', KEYS[1], ARGV[1], ARGV[2])
        if r[1] ~= 'new' then return r end
        local again = redis.call('IDEM.BEGIN', KEYS[1], ARGV[1], ARGV[2])
        assert(again[1] == 'in_flight', 'second BEGIN in flight')
        redis.call('IDEM.COMPLETE', KEYS[1], r[2], 201, 'from-lua', 'HEADER', 'h', 'v')
        return redis.call('IDEM.BEGIN', KEYS[1], ARGV[1], ARGV[2])
    "#;
    let v = ok(&mut c, &["EVAL", script, "1", "k", "fp", "60"]);
    assert_eq!(
        Outcome::parse(&v),
        Outcome::Replay {
            status: 201,
            body: b"from-lua".to_vec(),
            headers: flat_headers(&[("h", "v")])
        }
    );
    let v = ok(&mut c, &["EVAL", script, "1", "k", "nope", "60"]);
    assert_eq!(Outcome::parse(&v), Outcome::Mismatch);

    // Errors surface to the script as error replies with their code.
    let v = ok(
        &mut c,
        &[
            "EVAL",
            "return redis.pcall('IDEM.COMPLETE', KEYS[1], '1', '200', 'x')['err']",
            "1",
            "k",
        ],
    );
    assert!(text(&v).starts_with("STALE"), "{v:?}");
    let v = ok(
        &mut c,
        &["EVAL", "return redis.call('IDEM.GET', KEYS[1])", "1", "k"],
    );
    assert_eq!(Rec::parse(&v).unwrap().body, Some(b"from-lua".to_vec()));
}
