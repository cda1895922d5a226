//! Helpers shared by the module's integration tests: typed wrappers around the
//! IDEM.* replies, error capture, `INFO idem` parsing, replica setup and AOF bytes.
#![allow(dead_code)]

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_core::record::TOKEN_LIMIT;
use idem_core::wire::{BeginReply, Frame, PulledRecord};
use idem_core::{Record, State};
use idem_testkit::{eventually, wire, RedisServer};
use redis::{Connection, Value};
use sha2::{Digest, Sha256};

/// Lowercase hex SHA-256 of a fingerprint argument, as the module reports it.
pub fn fp_hex(fingerprint: &[u8]) -> String {
    hex::encode(Sha256::digest(fingerprint))
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after epoch")
        .as_millis() as u64
}

pub fn sleep_ms(ms: u64) {
    std::thread::sleep(Duration::from_millis(ms));
}

/// A string-ish reply (bulk or simple) as bytes.
pub fn bytes(v: &Value) -> Vec<u8> {
    match v {
        Value::BulkString(b) => b.clone(),
        Value::SimpleString(s) => s.clone().into_bytes(),
        Value::Okay => b"OK".to_vec(),
        Value::VerbatimString { text, .. } => text.clone().into_bytes(),
        other => panic!("expected a string reply, got {other:?}"),
    }
}

pub fn text(v: &Value) -> String {
    String::from_utf8(bytes(v)).expect("utf-8 reply")
}

/// An integer reply.
pub fn int(v: &Value) -> i64 {
    match v {
        Value::Int(i) => *i,
        other => panic!("expected an integer reply, got {other:?}"),
    }
}

pub fn array(v: &Value) -> &[Value] {
    match v {
        Value::Array(a) => a,
        other => panic!("expected an array reply, got {other:?}"),
    }
}

/// A flat array of bulk strings (headers: name, value, ...).
pub fn byte_list(v: &Value) -> Vec<Vec<u8>> {
    array(v).iter().map(bytes).collect()
}

/// Headers as the flat `name, value, ...` byte list a reply carries.
pub fn flat_headers(headers: &[(&str, &str)]) -> Vec<Vec<u8>> {
    headers
        .iter()
        .flat_map(|(n, v)| [n.as_bytes().to_vec(), v.as_bytes().to_vec()])
        .collect()
}

/// The four outcomes of IDEM.BEGIN.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    New(u64),
    InFlight(u64),
    Replay {
        status: u64,
        body: Vec<u8>,
        headers: Vec<Vec<u8>>,
    },
    Mismatch,
}

impl Outcome {
    /// Strict parse of a BEGIN reply (`idem_core::wire`: exact arity and
    /// types per outcome), tokens below 2^53.
    pub fn parse(v: &Value) -> Outcome {
        let reply = BeginReply::parse(&Frame::from(v))
            .unwrap_or_else(|e| panic!("unexpected BEGIN reply {v:?}: {e}"));
        match reply {
            BeginReply::New { token } => {
                assert!(token < TOKEN_LIMIT, "token out of range: {token}");
                Outcome::New(token)
            }
            BeginReply::InFlight { retry_after_ms } => Outcome::InFlight(retry_after_ms),
            BeginReply::Replay(r) => Outcome::Replay {
                status: u64::from(r.status),
                body: r.body,
                headers: wire::flat_headers(&r.headers),
            },
            BeginReply::Mismatch => Outcome::Mismatch,
        }
    }

    pub fn token(&self) -> u64 {
        match self {
            Outcome::New(t) => *t,
            other => panic!("expected new, got {other:?}"),
        }
    }
}

/// Runs a command built from string-ish args and returns the raw reply.
pub fn raw<T: redis::ToRedisArgs>(con: &mut Connection, args: &[T]) -> redis::RedisResult<Value> {
    let mut c = redis::Cmd::new();
    for a in args {
        c.arg(a);
    }
    c.query(con)
}

/// Runs a command that must succeed.
pub fn ok<T: redis::ToRedisArgs + std::fmt::Debug>(con: &mut Connection, args: &[T]) -> Value {
    raw(con, args).unwrap_or_else(|e| panic!("{args:?} failed: {e}"))
}

/// Runs a command that must fail; returns (code, full message).
pub fn err<T: redis::ToRedisArgs + std::fmt::Debug>(
    con: &mut Connection,
    args: &[T],
) -> (String, String) {
    match raw(con, args) {
        Ok(v) => panic!("{args:?} should fail, got {v:?}"),
        Err(e) => (
            e.code().unwrap_or("<no code>").to_string(),
            format!("{} {}", e.code().unwrap_or(""), e.detail().unwrap_or("")),
        ),
    }
}

/// Asserts the error code of a failing command.
pub fn assert_err<T: redis::ToRedisArgs + std::fmt::Debug>(
    con: &mut Connection,
    args: &[T],
    code: &str,
) {
    let (got, msg) = err(con, args);
    assert_eq!(got, code, "{args:?} -> {msg}");
}

pub fn begin(con: &mut Connection, key: &str, fp: &str, ttl: u64) -> Outcome {
    Outcome::parse(&ok(con, &["IDEM.BEGIN", key, fp, &ttl.to_string()]))
}

pub fn begin_lease(con: &mut Connection, key: &str, fp: &str, ttl: u64, lease_ms: u64) -> Outcome {
    Outcome::parse(&ok(
        con,
        &[
            "IDEM.BEGIN",
            key,
            fp,
            &ttl.to_string(),
            "LEASE",
            &lease_ms.to_string(),
        ],
    ))
}

/// IDEM.COMPLETE with headers; asserts the `OK` reply.
pub fn complete(
    con: &mut Connection,
    key: &str,
    token: u64,
    status: u16,
    body: &[u8],
    headers: &[(&str, &str)],
) {
    let mut c = redis::cmd("IDEM.COMPLETE");
    c.arg(key).arg(token).arg(status).arg(body);
    for (n, v) in headers {
        c.arg("HEADER").arg(*n).arg(*v);
    }
    let v: Value = c
        .query(con)
        .unwrap_or_else(|e| panic!("COMPLETE {key}: {e}"));
    assert_eq!(v, Value::Okay, "COMPLETE reply");
}

/// IDEM.COMPLETE ... MIRRORED
pub fn complete_mirrored(con: &mut Connection, key: &str, token: u64, status: u16, body: &[u8]) {
    let v: Value = redis::cmd("IDEM.COMPLETE")
        .arg(key)
        .arg(token)
        .arg(status)
        .arg(body)
        .arg("MIRRORED")
        .query(con)
        .unwrap_or_else(|e| panic!("COMPLETE MIRRORED {key}: {e}"));
    assert_eq!(v, Value::Okay);
}

/// BEGIN a fresh key and complete it; returns the token.
pub fn completed(con: &mut Connection, key: &str, fp: &str, ttl: u64, body: &[u8]) -> u64 {
    let token = begin(con, key, fp, ttl).token();
    complete(con, key, token, 200, body, &[]);
    token
}

pub fn abort(con: &mut Connection, key: &str, token: u64) -> i64 {
    int(&ok(con, &["IDEM.ABORT", key, &token.to_string()]))
}

pub fn touch(con: &mut Connection, key: &str, token: u64, lease_ms: u64) -> i64 {
    int(&ok(
        con,
        &["IDEM.TOUCH", key, &token.to_string(), &lease_ms.to_string()],
    ))
}

pub fn ack(con: &mut Connection, key: &str, token: u64) -> i64 {
    int(&ok(con, &["IDEM.MIRROR.ACK", key, &token.to_string()]))
}

/// `expires_at` of a record whose key has no TTL (the wire says -1).
pub const NO_TTL: u64 = idem_core::record::NO_EXPIRY;

/// An IDEM.GET reply, parsed strictly by `idem_core::wire` (the documented
/// fields in the documented order, and no others), flattened for
/// assertions: `None` for the fields the record's state lacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rec {
    pub state: String,
    pub fingerprint: String,
    pub token: u64,
    pub created_at: u64,
    pub expires_at: u64,
    pub lease_until: Option<u64>,
    pub status: Option<u64>,
    pub body: Option<Vec<u8>>,
    pub headers: Option<Vec<Vec<u8>>>,
    pub completed_at: Option<u64>,
    pub mirror: Option<String>,
}

impl From<Record> for Rec {
    fn from(r: Record) -> Rec {
        let (lease_until, completed) = match &r.state {
            State::InProgress { lease_until } => (Some(*lease_until), None),
            State::Completed(c) => (None, Some(c)),
        };
        Rec {
            state: wire::state_word(&r).to_string(),
            fingerprint: hex::encode(r.fingerprint.digest()),
            token: r.token,
            created_at: r.created_at,
            expires_at: r.expires_at,
            lease_until,
            status: completed.map(|c| u64::from(c.status)),
            body: completed.map(|c| c.body.clone()),
            headers: completed.map(|c| wire::flat_headers(&c.headers)),
            completed_at: completed.map(|c| c.completed_at),
            mirror: wire::mirror_word(&r).map(str::to_string),
        }
    }
}

impl Rec {
    pub fn parse(v: &Value) -> Option<Rec> {
        wire::parse_get(v).map(Rec::from)
    }

    pub fn is_completed(&self) -> bool {
        self.state == "completed"
    }
}

pub fn get(con: &mut Connection, key: &str) -> Option<Rec> {
    Rec::parse(&ok(con, &["IDEM.GET", key]))
}

pub fn get_rec(con: &mut Connection, key: &str) -> Rec {
    get(con, key).unwrap_or_else(|| panic!("no record under {key}"))
}

pub fn pttl(con: &mut Connection, key: &str) -> i64 {
    int(&ok(con, &["PTTL", key]))
}

pub fn pexpiretime(con: &mut Connection, key: &str) -> i64 {
    int(&ok(con, &["PEXPIRETIME", key]))
}

pub fn digest(con: &mut Connection) -> String {
    text(&ok(con, &["DEBUG", "DIGEST"]))
}

pub fn dbsize(con: &mut Connection) -> i64 {
    int(&ok(con, &["DBSIZE"]))
}

/// All `name:value` lines of `INFO <section>`.
pub fn info(con: &mut Connection, section: &str) -> HashMap<String, String> {
    idem_testkit::info::info_fields(&text(&ok(con, &["INFO", section])))
}

/// The numeric fields of `INFO idem`.
pub fn idem_info(con: &mut Connection) -> HashMap<String, i64> {
    info(con, "idem")
        .into_iter()
        .map(|(k, v)| {
            let n = v
                .parse()
                .unwrap_or_else(|_| panic!("INFO idem field {k} is not a number: {v}"));
            (k, n)
        })
        .collect()
}

pub fn idem_counter(con: &mut Connection, name: &str) -> i64 {
    *idem_info(con)
        .get(name)
        .unwrap_or_else(|| panic!("INFO idem lacks {name}"))
}

/// One entry of an IDEM.MIRROR.PULL reply (parsed by `idem_core::wire`),
/// flattened for assertions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pulled {
    pub key: Vec<u8>,
    pub token: u64,
    pub fingerprint: String,
    pub status: u64,
    pub body: Vec<u8>,
    pub headers: Vec<Vec<u8>>,
    pub created_at: u64,
    pub completed_at: u64,
    pub expires_at: u64,
}

impl From<PulledRecord> for Pulled {
    fn from(p: PulledRecord) -> Pulled {
        let c = p.completed();
        Pulled {
            token: p.record.token,
            fingerprint: hex::encode(p.record.fingerprint.digest()),
            status: u64::from(c.status),
            body: c.body.clone(),
            headers: wire::flat_headers(&c.headers),
            created_at: p.record.created_at,
            completed_at: c.completed_at,
            expires_at: p.record.expires_at,
            key: p.key,
        }
    }
}

pub fn parse_pull(v: &Value) -> Vec<Pulled> {
    wire::parse_pull(v).into_iter().map(Pulled::from).collect()
}

/// IDEM.MIRROR.PULL with optional CLAIM / BLOCK.
pub fn pull(
    con: &mut Connection,
    count: u64,
    claim: Option<u64>,
    block: Option<u64>,
) -> Vec<Pulled> {
    let mut c = redis::cmd("IDEM.MIRROR.PULL");
    c.arg(count);
    if let Some(ms) = claim {
        c.arg("CLAIM").arg(ms);
    }
    if let Some(ms) = block {
        c.arg("BLOCK").arg(ms);
    }
    let v: Value = c.query(con).unwrap_or_else(|e| panic!("PULL: {e}"));
    parse_pull(&v)
}

/// `IDEM.MIRROR.PULL count BLOCK block_ms` on a thread of its own; joining
/// it gives the reply, how long the call took, and the connection back.
pub fn pull_in_thread(
    mut con: Connection,
    count: u64,
    block_ms: u64,
) -> std::thread::JoinHandle<(Vec<Pulled>, Duration, Connection)> {
    std::thread::spawn(move || {
        let start = std::time::Instant::now();
        let got = pull(&mut con, count, None, Some(block_ms));
        (got, start.elapsed(), con)
    })
}

/// Sorted keys of a PULL reply, as strings.
pub fn pulled_keys(p: &[Pulled]) -> Vec<String> {
    let mut k: Vec<String> = p
        .iter()
        .map(|e| String::from_utf8(e.key.clone()).unwrap())
        .collect();
    k.sort();
    k
}

/// Starts a replica of `primary` and waits for the initial sync.
pub fn start_replica(primary: &RedisServer) -> RedisServer {
    let replica = RedisServer::start();
    let mut c = replica.conn();
    ok(
        &mut c,
        &["REPLICAOF", "127.0.0.1", &primary.port.to_string()],
    );
    wait_link_up(&mut c);
    replica
}

pub fn wait_link_up(c: &mut Connection) {
    let up = eventually(Duration::from_secs(20), || {
        let i = info(c, "replication");
        i.get("master_link_status").map(String::as_str) == Some("up")
            && i.get("master_sync_in_progress").map(String::as_str) == Some("0")
    });
    assert!(up, "replica never synced: {:?}", info(c, "replication"));
}

/// Waits until the (one) replica has applied everything the primary has
/// propagated so far, whichever connection wrote it: `WAIT 1 5000` covers
/// only this connection's own writes, so the offset the replica acknowledged
/// is then compared with the primary's (replicas acknowledge every second).
pub fn sync_replica(primary: &mut Connection) {
    let n = int(&ok(primary, &["WAIT", "1", "5000"]));
    assert_eq!(n, 1, "replica did not acknowledge in time");
    let replication = info(primary, "replication");
    let target: i64 = replication["master_repl_offset"].parse().unwrap();
    let acked = |primary: &mut Connection| -> Option<i64> {
        let replica = info(primary, "replication").remove("slave0")?;
        let offset = replica.split(',').find_map(|f| f.strip_prefix("offset="))?;
        offset.parse().ok()
    };
    let caught_up = eventually(Duration::from_secs(10), || {
        acked(primary).is_some_and(|offset| offset >= target)
    });
    assert!(caught_up, "replica at {:?} of {target}", acked(primary));
}

/// Waits for a background rewrite or save to finish.
pub fn wait_persistence_idle(con: &mut Connection) {
    let idle = eventually(Duration::from_secs(20), || {
        let i = info(con, "persistence");
        [
            "aof_rewrite_in_progress",
            "aof_rewrite_scheduled",
            "rdb_bgsave_in_progress",
        ]
        .iter()
        .all(|f| !matches!(i.get(*f), Some(v) if v != "0"))
    });
    assert!(idle, "background persistence never finished");
}

/// COMPLETE `key` and kill client `victim` in one EXEC: the victim, woken by
/// the completion, disconnects before Redis sends it anything.
pub fn complete_and_kill(con: &mut Connection, key: &str, token: u64, victim: i64) {
    let _: Vec<Value> = redis::pipe()
        .atomic()
        .cmd("IDEM.COMPLETE")
        .arg(key)
        .arg(token)
        .arg(200)
        .arg(vec![b'x'; 4096])
        .cmd("CLIENT")
        .arg("KILL")
        .arg("ID")
        .arg(victim)
        .query(con)
        .unwrap();
}

/// Every file of the AOF (Redis 7's `appendonlydir`), concatenated.
pub fn aof_bytes(dir: &std::path::Path) -> Vec<u8> {
    let mut files: Vec<_> = std::fs::read_dir(dir.join("appendonlydir"))
        .expect("appendonlydir")
        .map(|entry| entry.unwrap().path())
        .collect();
    files.sort();
    files
        .iter()
        .flat_map(|f| std::fs::read(f).unwrap())
        .collect()
}

pub fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}
