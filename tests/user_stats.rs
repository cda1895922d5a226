//! Loading idem changes no user's statistics: the lookups idem makes on its
//! own behalf (following every key's TTL changes, re-reading renamed
//! records, PULL, waiters) count no `keyspace_hits`/`keyspace_misses`. They
//! used to: every `SET ... EX`, `EXPIRE` or `PERSIST` on any key counted a
//! hit on a server with idem loaded, so its cache hit ratio was wrong.

mod common;

use common::*;
use idem_testkit::RedisServer;
use redis::Connection;

fn lookups(c: &mut Connection) -> (i64, i64) {
    let stats = info(c, "stats");
    let field = |name: &str| stats[name].parse::<i64>().unwrap();
    (field("keyspace_hits"), field("keyspace_misses"))
}

#[test]
fn idems_own_lookups_count_no_hits_or_misses() {
    let s = RedisServer::start();
    let mut c = s.conn();
    completed(&mut c, "rec", "fp", 600, b"body");
    ok(&mut c, &["SET", "plain", "v"]);
    ok(&mut c, &["CONFIG", "RESETSTAT"]);

    // TTL changes of keys that hold no record, and of a record.
    ok(&mut c, &["SET", "a", "v", "EX", "100"]);
    ok(&mut c, &["SET", "b", "v", "PX", "100000"]);
    ok(&mut c, &["EXPIRE", "plain", "200"]);
    ok(&mut c, &["PERSIST", "plain"]);
    ok(&mut c, &["PEXPIRE", "rec", "5000000"]);
    // A record under a new name is looked at again; a waiter-free BEGIN, a
    // replay and the mirror's PULL read records too.
    ok(&mut c, &["RENAME", "rec", "moved"]);
    begin(&mut c, "new", "fp", 600);
    begin(&mut c, "moved", "fp", 600);
    let pulled = pull(&mut c, 10, None, None);
    assert_eq!(pulled_keys(&pulled), ["moved"]);
    assert_eq!(lookups(&mut c), (0, 0), "idem counted lookups of its own");

    // The TTL was still followed, and a client's reads still count
    // (PEXPIRETIME, IDEM.GET, GET; and GET of a missing key as a miss).
    let expiry = pexpiretime(&mut c, "moved") as u64;
    assert_eq!(get_rec(&mut c, "moved").expires_at, expiry);
    ok(&mut c, &["GET", "a"]);
    ok(&mut c, &["GET", "missing"]);
    assert_eq!(lookups(&mut c), (3, 1), "a client's reads count");
}
