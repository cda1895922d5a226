//! Every TTL Redis accepts on an idem key leaves a record that saves and
//! loads again: the record follows the key's TTL, and loading validates its
//! times, so the two must agree on the far end (found by tests/storm.rs).

mod common;

use common::*;
use idem_testkit::RedisServer;

#[test]
fn far_ttls_survive_save_and_restart() {
    let mut s = RedisServer::start();
    let mut c = s.conn();
    let cases = [
        ["PEXPIRE", "held", "9000000000000000"],
        ["EXPIRE", "done", "9000000000000"],
        ["PEXPIREAT", "mirrored", "9007199254740991"],
    ];
    begin(&mut c, "held", "fp", 60).token();
    completed(&mut c, "done", "fp", 60, b"body");
    let t = begin(&mut c, "mirrored", "fp", 60).token();
    complete_mirrored(&mut c, "mirrored", t, 200, b"m");
    for cmd in &cases {
        assert_eq!(int(&ok(&mut c, cmd)), 1, "{cmd:?}");
    }
    let before: Vec<_> = cases.iter().map(|[_, k, _]| get(&mut c, k)).collect();
    ok(&mut c, &["SAVE"]);
    s.kill();
    s.restart();
    let mut c = s.conn();
    let after: Vec<_> = cases.iter().map(|[_, k, _]| get(&mut c, k)).collect();
    assert_eq!(after, before);
}
