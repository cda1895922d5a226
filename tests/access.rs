//! ACL (issue 8): key specs say what each command does to its key, PULL
//! hands a caller only the records it may read, and docs/module/configuration.md's ready-made
//! users (application, writer) can do their job and nothing else.

mod common;

use common::*;
use idem_testkit::RedisServer;
use redis::Connection;
use std::time::{Duration, Instant};

fn login(s: &RedisServer, user: &str) -> Connection {
    let mut c = s.conn();
    ok(&mut c, &["AUTH", user, "pw"]);
    c
}

fn acl(c: &mut Connection, rules: &str) {
    let mut args = vec!["ACL", "SETUSER"];
    args.extend(rules.split_whitespace());
    ok(c, &args);
}

/// The attack of issue 8: a tenant limited to `~pay:*` pulled another
/// tenant's body and headers, and claimed it for a year to hide it.
#[test]
fn pull_hands_out_only_records_the_caller_may_read() {
    let s = RedisServer::start();
    let mut admin = s.conn();
    let t = begin(&mut admin, "secret:1", "fp", 100).token();
    complete(
        &mut admin,
        "secret:1",
        t,
        200,
        b"card",
        &[("authorization", "Bearer x")],
    );
    completed(&mut admin, "pay:1", "fp", 100, b"mine");
    acl(&mut admin, "pay on >pw ~pay:* +@all -@dangerous");

    let mut pay = login(&s, "pay");
    let got = pull(&mut pay, 100, Some(300_000), None);
    assert_eq!(pulled_keys(&got), ["pay:1"]);
    // Nothing hidden from the real writer.
    let got = pull(&mut admin, 100, None, None);
    assert_eq!(pulled_keys(&got), ["secret:1"]);
    // ACK needs write permission on the key.
    assert_err(
        &mut pay,
        &["IDEM.MIRROR.ACK", "secret:1", &t.to_string()],
        "NOPERM",
    );
    assert_eq!(
        get_rec(&mut admin, "secret:1").mirror.as_deref(),
        Some("pending")
    );
}

/// A blocked puller is filtered the same way when it is woken.
/// A record it may not read does not wake it at all (it used to answer an
/// empty array early); one it may read does, at once.
#[test]
fn a_blocked_puller_is_woken_only_with_what_it_may_read() {
    let s = RedisServer::start();
    let mut admin = s.conn();
    acl(&mut admin, "pay on >pw ~pay:* +@all -@dangerous");
    let pay = login(&s, "pay");
    let h = pull_in_thread(pay, 10, 1_000);
    sleep_ms(100);
    completed(&mut admin, "secret:2", "fp", 100, b"card");
    let (got, waited, pay) = h.join().unwrap();
    assert!(got.is_empty(), "woken puller saw {:?}", pulled_keys(&got));
    assert!(
        waited >= Duration::from_millis(990),
        "woken after {waited:?}"
    );
    assert_eq!(pulled_keys(&pull(&mut admin, 10, None, None)), ["secret:2"]);

    let h = pull_in_thread(pay, 10, 5_000);
    sleep_ms(100);
    completed(&mut admin, "pay:2", "fp", 100, b"mine");
    let (got, waited, _) = h.join().unwrap();
    assert_eq!(pulled_keys(&got), ["pay:2"]);
    assert!(
        waited < Duration::from_millis(2_000),
        "woken after {waited:?}"
    );
}

/// A restricted puller waits out its BLOCK when only records it may not read
/// are pending: they neither answer it nor shorten its wait. A claim on its
/// own record does, when it lapses.
#[test]
fn a_restricted_puller_waits_past_records_it_may_not_read() {
    let s = RedisServer::start();
    let mut admin = s.conn();
    completed(&mut admin, "secret:3", "fp", 100, b"card");
    acl(&mut admin, "pay on >pw ~pay:* +@all -@dangerous");
    let mut pay = login(&s, "pay");
    let start = Instant::now();
    assert!(pull(&mut pay, 10, None, Some(600)).is_empty());
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(590),
        "answered after {waited:?}"
    );

    completed(&mut admin, "pay:3", "fp", 100, b"mine");
    assert_eq!(
        pulled_keys(&pull(&mut admin, 10, Some(300), None)),
        ["pay:3", "secret:3"]
    );
    let start = Instant::now();
    let got = pull(&mut pay, 10, None, Some(5_000));
    let waited = start.elapsed();
    assert_eq!(pulled_keys(&got), ["pay:3"]);
    assert!(
        waited < Duration::from_millis(2_000),
        "answered after {waited:?}"
    );
}

/// Read-only key permissions allow IDEM.GET and refuse every writing command.
#[test]
fn read_only_key_permission_allows_get_and_refuses_writes() {
    let s = RedisServer::start();
    let mut admin = s.conn();
    let t = completed(&mut admin, "pay:r", "fp", 100, b"body");
    acl(&mut admin, "ro on >pw %R~pay:* +@all");
    let mut ro = login(&s, "ro");
    assert_eq!(
        get_rec(&mut ro, "pay:r").body.as_deref(),
        Some(&b"body"[..])
    );
    let t = t.to_string();
    for args in [
        vec!["IDEM.BEGIN", "pay:r", "fp", "100"],
        vec!["IDEM.COMPLETE", "pay:r", &t, "200", "x"],
        vec!["IDEM.ABORT", "pay:r", &t],
        vec!["IDEM.TOUCH", "pay:r", &t, "1000"],
        vec!["IDEM.MIRROR.ACK", "pay:r", &t],
    ] {
        assert_err(&mut ro, &args, "NOPERM");
    }
    // Write-only permission: COMPLETE-like writes pass the ACL, GET does not.
    acl(&mut admin, "wo on >pw %W~pay:* +@all");
    let mut wo = login(&s, "wo");
    assert_err(&mut wo, &["IDEM.GET", "pay:r"], "NOPERM");
    assert_eq!(abort(&mut wo, "pay:r", 1), 0);
}

/// Where the server puts module commands in ACL categories (7.2+), `-@write`
/// removes the writing commands and keeps IDEM.GET.
#[test]
fn acl_categories_where_the_server_supports_them() {
    let s = RedisServer::start();
    let mut admin = s.conn();
    let version = info(&mut admin, "server")["redis_version"].clone();
    let parts: Vec<u32> = version.split('.').filter_map(|p| p.parse().ok()).collect();
    if parts < vec![7, 2] {
        println!("Redis {version}: module commands have no ACL categories; skipped");
        return;
    }
    let write: Vec<String> = redis::cmd("ACL")
        .arg("CAT")
        .arg("write")
        .query(&mut admin)
        .unwrap();
    for c in [
        "idem.begin",
        "idem.complete",
        "idem.abort",
        "idem.touch",
        "idem.mirror.ack",
    ] {
        assert!(
            write.iter().any(|w| w.eq_ignore_ascii_case(c)),
            "{c} not in @write: {write:?}"
        );
    }
    acl(&mut admin, "rd on >pw ~* +@all -@write");
    let mut rd = login(&s, "rd");
    assert!(get(&mut rd, "nothing").is_none());
    assert_err(&mut rd, &["IDEM.BEGIN", "k", "fp", "10"], "NOPERM");
}

/// The ACL users docs/module/configuration.md shows, read from the page
/// itself, so the documented lines are the tested ones.
fn documented_users() -> Vec<String> {
    let page = include_str!("../docs/module/configuration.md");
    page.lines()
        .filter_map(|l| l.strip_prefix("ACL SETUSER "))
        .map(str::to_string)
        .collect()
}

/// The documented users on the middleware's key layout (`idem:{tenant:key}`):
/// the application runs the data commands and the replica acknowledgement,
/// the writer pulls, acknowledges and reads `INFO idem`, and neither more.
/// Before, the app user's `~tenant:*` refused every middleware key and the
/// writer's user could not read INFO.
#[test]
fn the_documented_users_do_their_job_and_nothing_else() {
    let s = RedisServer::start();
    let mut admin = s.conn();
    let users = documented_users();
    assert_eq!(users.len(), 2, "{users:?}");
    for user in &users {
        let user = user
            .replace(">app-secret", ">pw")
            .replace(">writer-secret", ">pw");
        acl(&mut admin, &user);
    }
    let (k1, k2) = ("idem:{t1:K1}", "idem:{t1:K2}");
    let mut app = login(&s, "app");
    let t = begin(&mut app, k1, "fp", 100).token();
    touch(&mut app, k1, t, 5_000);
    complete(&mut app, k1, t, 201, b"ok", &[]);
    assert!(get_rec(&mut app, k1).is_completed());
    let waited: i64 = redis::cmd("WAIT").arg(0).arg(10).query(&mut app).unwrap();
    assert_eq!(waited, 0);
    let t2 = begin(&mut app, k2, "fp", 100).token();
    assert_eq!(abort(&mut app, k2, t2), 1);
    assert_err(&mut app, &["IDEM.BEGIN", "other:1", "fp", "100"], "NOPERM");
    assert_err(&mut app, &["IDEM.MIRROR.PULL", "10"], "NOPERM");
    assert_err(&mut app, &["DEL", k1], "NOPERM");
    assert_err(&mut app, &["INFO", "idem"], "NOPERM");

    let mut writer = login(&s, "idem-writer");
    assert!(info(&mut writer, "idem").contains_key("idem_mirror_pending"));
    let got = pull(&mut writer, 10, None, None);
    assert_eq!(pulled_keys(&got), [k1]);
    assert_eq!(ack(&mut writer, k1, got[0].token), 1);
    assert_err(
        &mut writer,
        &["IDEM.BEGIN", "idem:{t1:K3}", "fp", "100"],
        "NOPERM",
    );
    assert_err(&mut writer, &["IDEM.GET", k1], "NOPERM");
    assert_err(&mut writer, &["GET", k1], "NOPERM");
}
