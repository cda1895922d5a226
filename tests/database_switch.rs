//! MOVE and COPY ... DB leave the client in its own database. Valkey 8.1
//! (fixed in 9.1.1) switches the client to the destination database when a
//! module subscribes to generic keyspace events, as idem does for its
//! pending index, so loading idem there would change what MOVE and COPY do
//! for every client. This runs on every server (see scripts/compat.sh) and
//! fails on an affected one until the module works around it.

mod common;

use common::*;
use idem_testkit::RedisServer;
use redis::{Connection, Value};

/// The client's selected database, as the server sees it.
fn client_db(c: &mut Connection) -> i64 {
    let info = text(&ok(c, &["CLIENT", "INFO"]));
    info.split(' ')
        .find_map(|f| f.strip_prefix("db="))
        .and_then(|d| d.parse().ok())
        .unwrap_or_else(|| panic!("no db= in {info}"))
}

/// `valkey 8.1.1` or `redis 7.0.15`.
fn server_name(c: &mut Connection) -> String {
    let i = info(c, "server");
    match i.get("valkey_version") {
        Some(v) => format!("valkey {v}"),
        None => format!("redis {}", i["redis_version"]),
    }
}

#[test]
fn move_and_copy_to_another_database_keep_the_clients_database() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let server = server_name(&mut c);
    let t = begin(&mut c, "rec", "fp", 60).token();
    complete(&mut c, "rec", t, 200, b"x", &[]);
    ok(&mut c, &["SET", "plain", "v"]);
    for (cmd, key) in [
        (vec!["MOVE", "plain", "1"], "plain"),
        (vec!["COPY", "rec", "rec-copy", "DB", "2"], "rec-copy"),
        (vec!["MOVE", "rec", "3"], "rec"),
    ] {
        assert_eq!(ok(&mut c, &cmd), Value::Int(1), "{cmd:?}");
        assert_eq!(
            client_db(&mut c),
            0,
            "{server}: {cmd:?} switched the client to another database"
        );
        assert_eq!(ok(&mut c, &["EXISTS", key]), Value::Int(0), "{cmd:?}");
    }
    // The records went where they were sent, intact and still pending.
    for (db, key) in [(2, "rec-copy"), (3, "rec")] {
        ok(&mut c, &["SELECT", &db.to_string()]);
        let r = get_rec(&mut c, key);
        assert_eq!((r.token, r.mirror.as_deref()), (t, Some("pending")));
        assert_eq!(pulled_keys(&pull(&mut c, 10, None, None)), [key]);
    }
}

/// On a server with the database-switch bug the module says so at load,
/// with the fix; on others it says nothing.
#[test]
fn an_affected_server_is_named_in_the_log_at_load() {
    let s = RedisServer::start();
    let mut c = s.conn();
    let i = info(&mut c, "server");
    let affected = i.get("valkey_version").is_some_and(|v| {
        let p: Vec<u32> = v.split('.').map_while(|x| x.parse().ok()).collect();
        let v = [0, 1, 2].map(|k| p.get(k).copied().unwrap_or(0));
        ([8, 0, 0]..[9, 1, 1]).contains(&v)
    });
    let warned = s
        .log()
        .contains("stays switched to the destination database");
    assert_eq!(warned, affected, "{}", server_name(&mut c));
}
