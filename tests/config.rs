//! Configs: defaults, module arguments at load, CONFIG GET/SET of
//! idem.lease-ms, idem.max-ttl, idem.max-body-bytes, idem.mirror-claim-ms,
//! idem.effect-format and their effect on the commands; invalid values are refused (at load, the
//! server does not start; at runtime, the old value stays).

mod common;

use common::*;
use idem_testkit::{free_port, module_path, scratch_dir, server_binary, RedisConfig, RedisServer};
use redis::Connection;
use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn config_get(c: &mut Connection, pattern: &str) -> HashMap<String, String> {
    let v = ok(c, &["CONFIG", "GET", pattern]);
    let a = byte_list(&v);
    a.chunks(2)
        .map(|kv| {
            (
                String::from_utf8(kv[0].clone()).unwrap(),
                String::from_utf8(kv[1].clone()).unwrap(),
            )
        })
        .collect()
}

fn config_value(c: &mut Connection, name: &str) -> String {
    config_get(c, name)
        .remove(name)
        .unwrap_or_else(|| panic!("CONFIG GET {name} answered nothing"))
}

fn expected(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn defaults() {
    let s = RedisServer::start();
    let mut c = s.conn();
    assert_eq!(
        config_get(&mut c, "idem.*"),
        expected(&[
            ("idem.lease-ms", "30000"),
            ("idem.max-ttl", "2592000"),
            ("idem.max-body-bytes", "1048576"),
            ("idem.mirror-claim-ms", "30000"),
            ("idem.mirror-max-claim-ms", "300000"),
            ("idem.max-headers", "256"),
            ("idem.effect-format", "1"),
        ])
    );
}

#[test]
fn module_arguments_at_load_and_their_effect() {
    let s = RedisConfig::default()
        .module_arg("lease-ms", "5000")
        .module_arg("max-ttl", "86400")
        .module_arg("max-body-bytes", "1000")
        .module_arg("mirror-claim-ms", "800")
        .module_arg("effect-format", "2")
        .start();
    let mut c = s.conn();
    assert_eq!(
        config_get(&mut c, "idem.*"),
        expected(&[
            ("idem.lease-ms", "5000"),
            ("idem.max-ttl", "86400"),
            ("idem.max-body-bytes", "1000"),
            ("idem.mirror-claim-ms", "800"),
            ("idem.mirror-max-claim-ms", "300000"),
            ("idem.max-headers", "256"),
            ("idem.effect-format", "2"),
        ])
    );

    // lease-ms is the default lease.
    let t = begin(&mut c, "k", "fp", 60).token();
    let r = get_rec(&mut c, "k");
    assert_eq!(r.lease_until, Some(r.created_at + 5000));

    // max-ttl bounds the ttl.
    assert_err(&mut c, &["IDEM.BEGIN", "long", "fp", "86401"], "BADARG");
    assert_eq!(get(&mut c, "long"), None);
    begin(&mut c, "long", "fp", 86400).token();

    // max-body-bytes bounds the body.
    assert_err(
        &mut c,
        &[
            "IDEM.COMPLETE",
            "k",
            &t.to_string(),
            "200",
            &"x".repeat(1001),
        ],
        "TOOLARGE",
    );
    complete(&mut c, "k", t, 200, &[b'x'; 1000], &[]);

    // mirror-claim-ms is the default claim.
    assert_eq!(pulled_keys(&pull(&mut c, 10, None, None)), ["k"]);
    assert!(pull(&mut c, 10, None, None).is_empty(), "claimed");
    sleep_ms(850);
    assert_eq!(
        pulled_keys(&pull(&mut c, 10, None, None)),
        ["k"],
        "claim lapsed"
    );
}

/// `IDEM.MIRROR.PULL`'s claim is bounded by `mirror-max-claim-ms` (five
/// minutes by default): a caller allowed to pull can no longer hide records
/// from the writer for a year.
#[test]
fn pull_claims_are_bounded_by_a_config() {
    let s = RedisServer::start();
    let mut c = s.conn();
    assert_eq!(config_value(&mut c, "idem.mirror-max-claim-ms"), "300000");
    completed(&mut c, "k", "fp", 60, b"x");
    let (code, msg) = err(&mut c, &["IDEM.MIRROR.PULL", "10", "CLAIM", "300001"]);
    assert_eq!(
        (code.as_str(), msg.as_str()),
        ("BADARG", "BADARG CLAIM must be between 1 and 300000")
    );
    assert_eq!(pulled_keys(&pull(&mut c, 10, Some(300_000), None)), ["k"]);

    // The default claim is cut to the bound.
    ok(
        &mut c,
        &["CONFIG", "SET", "idem.mirror-max-claim-ms", "300"],
    );
    completed(&mut c, "k2", "fp", 60, b"x");
    assert_eq!(pulled_keys(&pull(&mut c, 10, None, None)), ["k2"]);
    sleep_ms(400);
    assert_eq!(
        pulled_keys(&pull(&mut c, 10, None, None)),
        ["k2"],
        "claim lapsed"
    );
}

#[test]
fn config_set_takes_effect_at_once() {
    let s = RedisServer::start();
    let mut c = s.conn();

    ok(&mut c, &["CONFIG", "SET", "idem.lease-ms", "777"]);
    assert_eq!(config_value(&mut c, "idem.lease-ms"), "777");
    begin(&mut c, "a", "fp", 60).token();
    let r = get_rec(&mut c, "a");
    assert_eq!(r.lease_until, Some(r.created_at + 777));
    // An explicit LEASE still wins.
    begin_lease(&mut c, "b", "fp", 60, 50).token();
    let r = get_rec(&mut c, "b");
    assert_eq!(r.lease_until, Some(r.created_at + 50));

    ok(&mut c, &["CONFIG", "SET", "idem.max-ttl", "10"]);
    assert_eq!(config_value(&mut c, "idem.max-ttl"), "10");
    assert_err(&mut c, &["IDEM.BEGIN", "c", "fp", "11"], "BADARG");
    begin(&mut c, "c", "fp", 10).token();
    // Existing records keep their expiry.
    let r = get_rec(&mut c, "a");
    assert_eq!(r.expires_at, r.created_at + 60_000);

    ok(&mut c, &["CONFIG", "SET", "idem.max-body-bytes", "3"]);
    let t = get_rec(&mut c, "a").token;
    assert_err(
        &mut c,
        &["IDEM.COMPLETE", "a", &t.to_string(), "200", "abcd"],
        "TOOLARGE",
    );
    complete(&mut c, "a", t, 200, b"abc", &[]);

    ok(&mut c, &["CONFIG", "SET", "idem.mirror-claim-ms", "600"]);
    assert_eq!(config_value(&mut c, "idem.mirror-claim-ms"), "600");
    assert_eq!(pull(&mut c, 10, None, None).len(), 1);
    assert!(pull(&mut c, 10, None, None).is_empty());
    sleep_ms(650);
    assert_eq!(pull(&mut c, 10, None, None).len(), 1);
    // An explicit CLAIM still wins.
    sleep_ms(650);
    assert_eq!(pull(&mut c, 10, Some(60_000), None).len(), 1);
    sleep_ms(650);
    assert!(pull(&mut c, 10, None, None).is_empty());

    // Several at once, and back to the defaults.
    ok(
        &mut c,
        &[
            "CONFIG",
            "SET",
            "idem.lease-ms",
            "30000",
            "idem.max-ttl",
            "2592000",
            "idem.max-body-bytes",
            "1048576",
            "idem.mirror-claim-ms",
            "30000",
        ],
    );
    assert_eq!(config_value(&mut c, "idem.max-ttl"), "2592000");
    begin(&mut c, "d", "fp", 2_592_000).token();
}

#[test]
fn invalid_values_are_refused_at_runtime() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let before = config_get(&mut c, "idem.*");
    for (name, bad) in [
        ("idem.lease-ms", "0"),
        ("idem.lease-ms", "-1"),
        ("idem.lease-ms", "abc"),
        ("idem.lease-ms", "1.5"),
        ("idem.lease-ms", ""),
        ("idem.max-ttl", "0"),
        ("idem.max-ttl", "-5"),
        ("idem.max-ttl", "x"),
        ("idem.max-body-bytes", "-1"),
        ("idem.max-body-bytes", "big"),
        ("idem.mirror-claim-ms", "0"),
        ("idem.mirror-claim-ms", "-3"),
        ("idem.effect-format", "0"),
        ("idem.effect-format", "3"),
        ("idem.no-such-config", "1"),
    ] {
        let r = raw(&mut c, &["CONFIG", "SET", name, bad]);
        assert!(r.is_err(), "CONFIG SET {name} {bad:?} accepted");
    }
    // A batch with one bad value changes nothing.
    let r = raw(
        &mut c,
        &[
            "CONFIG",
            "SET",
            "idem.lease-ms",
            "1234",
            "idem.max-ttl",
            "0",
        ],
    );
    assert!(r.is_err());
    assert_eq!(config_get(&mut c, "idem.*"), before);
    let r = get_rec_after_begin(&mut c);
    assert_eq!(r.lease_until, Some(r.created_at + 30_000));
}

fn get_rec_after_begin(c: &mut Connection) -> Rec {
    begin(c, "probe", "fp", 60).token();
    get_rec(c, "probe")
}

/// Starts redis-server with the module and `args`; true when it came up.
fn loads_with(args: &[&str]) -> bool {
    let dir = scratch_dir("cfg");
    let port = free_port();
    let mut child = Command::new(server_binary())
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
        ])
        .arg("--dir")
        .arg(&dir)
        .arg("--loadmodule")
        .arg(module_path())
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn redis-server");
    let deadline = Instant::now() + Duration::from_secs(10);
    let up = loop {
        if child.try_wait().unwrap().is_some() {
            break false;
        }
        let ping = redis::Client::open(format!("redis://127.0.0.1:{port}/"))
            .and_then(|cl| cl.get_connection())
            .and_then(|mut con| redis::cmd("PING").query::<String>(&mut con));
        if ping.is_ok() {
            break true;
        }
        assert!(
            Instant::now() < deadline,
            "redis-server neither up nor exited"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    up
}

#[test]
fn invalid_module_arguments_stop_the_load() {
    assert!(loads_with(&["lease-ms", "5000"]), "a valid argument loads");
    for bad in [
        &["lease-ms", "0"][..],
        &["lease-ms", "abc"],
        &["lease-ms"],
        &["max-ttl", "-1"],
        &["max-body-bytes", "x"],
        &["mirror-claim-ms", "0"],
        &["effect-format", "0"],
        &["effect-format", "3"],
        &["no-such-option", "1"],
    ] {
        assert!(!loads_with(bad), "module loaded with {bad:?}");
    }
}
