//! The `idem` binary against a real redis-server with the module and a real
//! Postgres database: every command, its JSON and exit codes, and its
//! refusals (which must change nothing).

use std::process::Command;
use std::time::Duration;

use idem_client::middleware::redis_key;
use idem_client::Fence;
use idem_core::wire::{BeginReply, Frame, GetReply};
use idem_core::{Record, State};
use idem_testkit::{PgDatabase, RedisServer};
use idem_writer::store::{upsert_records, UPSERT_SQL};
use idem_writer::{Layout, MirrorRecord, NEVER_EXPIRES_MS};
use serde_json::Value;

/// Runs `idem --json ARGS` with no URLs from the environment: (exit code,
/// stdout as JSON).
fn idem(args: &[&str]) -> (i32, Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("--json")
        .args(args)
        .env_remove("REDIS_URL")
        .env_remove("DATABASE_URL")
        .output()
        .expect("run idem");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let json = serde_json::from_str(&stdout).unwrap_or_else(|_| {
        panic!(
            "idem {args:?}: stdout is not JSON: {stdout}\nstderr: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().expect("an exit code"), json)
}

/// Runs `idem ARGS` for its text: (exit code, stdout, stderr).
fn idem_text(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .env_remove("REDIS_URL")
        .env_remove("DATABASE_URL")
        .output()
        .expect("run idem");
    (
        out.status.code().expect("an exit code"),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A redis-server without the module, killed on drop.
struct PlainRedis {
    child: std::process::Child,
    url: String,
}

impl PlainRedis {
    fn start() -> PlainRedis {
        let port = idem_testkit::free_port();
        let child = Command::new(idem_testkit::server_binary())
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("start redis-server");
        let url = format!("redis://127.0.0.1:{port}/");
        let client = redis::Client::open(url.as_str()).unwrap();
        assert!(
            idem_testkit::eventually(Duration::from_secs(10), || client.get_connection().is_ok()),
            "redis-server without the module did not start"
        );
        PlainRedis { child, url }
    }
}

impl Drop for PlainRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn migrated(db: &PgDatabase, layout: Layout) -> tokio_postgres::Client {
    let mut client = idem_writer::connect(&db.url).await.expect("connect");
    idem_writer::migrate_with_layout(&mut client, layout)
        .await
        .expect("migrate");
    client
}

fn begin(conn: &mut redis::Connection, key: &str, fingerprint: &[u8], ttl_secs: u64) -> u64 {
    let reply: redis::Value = redis::cmd("IDEM.BEGIN")
        .arg(key)
        .arg(fingerprint)
        .arg(ttl_secs)
        .query(conn)
        .expect("IDEM.BEGIN");
    match BeginReply::parse(&Frame::from(&reply)) {
        Ok(BeginReply::New { token }) => token,
        other => panic!("BEGIN {key}: {other:?}"),
    }
}

fn complete(conn: &mut redis::Connection, key: &str, token: u64, body: &[u8]) {
    let () = redis::cmd("IDEM.COMPLETE")
        .arg(key)
        .arg(token)
        .arg(201)
        .arg(body)
        .arg("HEADER")
        .arg("content-type")
        .arg("application/json")
        .query(conn)
        .expect("IDEM.COMPLETE");
}

fn get(conn: &mut redis::Connection, key: &str) -> Option<Record> {
    let reply: GetReply = redis::cmd("IDEM.GET").arg(key).query(conn).expect("GET");
    reply.0
}

fn ack(conn: &mut redis::Connection, key: &str, token: u64) {
    let _: redis::Value = redis::cmd("IDEM.MIRROR.ACK")
        .arg(key)
        .arg(token)
        .query(conn)
        .expect("ACK");
}

/// The row the writer stores for the completed record of `key` in Redis.
fn as_row(conn: &mut redis::Connection, key: &str) -> MirrorRecord {
    let record = get(conn, key).expect("a record");
    let State::Completed(c) = record.state else {
        panic!("{key} is not completed");
    };
    MirrorRecord {
        key: key.into(),
        token: record.token as i64,
        fingerprint: hex::encode(record.fingerprint.digest()),
        status: c.status.into(),
        body: c.body,
        headers: c
            .headers
            .into_iter()
            .flat_map(|h| [h.name, h.value])
            .collect(),
        created_at_ms: record.created_at as i64,
        completed_at_ms: c.completed_at as i64,
        expires_at_ms: (record.expires_at as i64).min(NEVER_EXPIRES_MS),
    }
}

/// Mirrors `key` as the writer does: the upsert, then the acknowledgement.
async fn mirror(pg: &tokio_postgres::Client, conn: &mut redis::Connection, key: &str) {
    let row = as_row(conn, key);
    let statement = pg.prepare(UPSERT_SQL).await.expect("prepare");
    upsert_records(pg, &statement, std::slice::from_ref(&row))
        .await
        .expect("upsert");
    ack(conn, key, row.token as u64);
}

async fn row_token(pg: &tokio_postgres::Client, key: &str) -> Option<(String, i64)> {
    pg.query_opt(
        "SELECT status, token FROM idempotency_keys WHERE key = $1",
        &[&key],
    )
    .await
    .expect("select")
    .map(|r| (r.get(0), r.get(1)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_shows_both_sides_and_whether_they_agree() {
    let server = RedisServer::start();
    let db = PgDatabase::create();
    let pg = migrated(&db, Layout::Unpartitioned).await;
    let mut conn = server.conn();
    let (redis, database) = (server.url(), db.url.clone());
    let key = redis_key("idem:", "acme", "order-1");
    let inspect = |extra: &[&str]| {
        let mut args = vec![
            "inspect",
            "order-1",
            "--tenant",
            "acme",
            "--redis",
            &redis,
            "--database",
            &database,
        ];
        args.extend_from_slice(extra);
        idem(&args)
    };

    let (code, doc) = inspect(&[]);
    assert_eq!(
        (code, doc["verdict"].as_str()),
        (4, Some("not_found")),
        "{doc}"
    );

    let token = begin(&mut conn, &key, b"POST /orders {}", 3600);
    let (code, doc) = inspect(&[]);
    assert_eq!(code, 0, "{doc}");
    assert_eq!(
        doc["key"],
        key.as_str(),
        "the tenant's key, named as the middleware names it"
    );
    assert_eq!(doc["verdict"], "in_flight");
    assert_eq!(doc["redis"]["state"], "in_progress");
    assert_eq!(doc["redis"]["token"], token);
    assert!(doc["redis"]["lease_until"].is_string());
    assert_eq!(doc["postgres"], Value::Null);

    complete(&mut conn, &key, token, br#"{"id":1}"#);
    let (code, doc) = inspect(&[]);
    assert_eq!(
        (code, doc["verdict"].as_str()),
        (0, Some("mirror_pending")),
        "{doc}"
    );
    assert_eq!(doc["redis"]["mirror"], "pending");
    assert_eq!(doc["redis"]["status"], 201);
    assert_eq!(doc["redis"]["body"]["bytes"], 8);

    mirror(&pg, &mut conn, &key).await;
    let (code, doc) = inspect(&[]);
    assert_eq!((code, doc["verdict"].as_str()), (0, Some("agree")), "{doc}");
    assert_eq!(doc["redis"]["mirror"], "mirrored");
    assert_eq!(doc["postgres"]["token"], token);
    assert_eq!(doc["postgres"]["body"], doc["redis"]["body"]);
    assert_eq!(doc["postgres"]["fingerprint"], doc["redis"]["fingerprint"]);
    assert_eq!(doc["postgres"]["headers"], 1);

    // The same key by its Redis name, as text.
    let (code, text, _) = idem_text(&[
        "inspect",
        "--raw",
        &key,
        "--redis",
        &redis,
        "--database",
        &database,
    ]);
    assert_eq!(code, 0);
    assert!(text.contains("verdict  agree"), "{text}");
    assert!(text.contains(&format!("token         {token}")), "{text}");

    // Postgres lost the row the writer had acknowledged.
    pg.execute("DELETE FROM idempotency_keys WHERE key = $1", &[&key])
        .await
        .unwrap();
    let (code, doc) = inspect(&[]);
    assert_eq!(
        (code, doc["verdict"].as_str()),
        (5, Some("missing_in_postgres")),
        "{doc}"
    );

    // A different response under the same token: they differ.
    let mut other = as_row(&mut conn, &key);
    other.body = b"{}".to_vec();
    let statement = pg.prepare(UPSERT_SQL).await.unwrap();
    upsert_records(&pg, &statement, &[other]).await.unwrap();
    let (code, doc) = inspect(&[]);
    assert_eq!(
        (code, doc["verdict"].as_str()),
        (5, Some("differ")),
        "{doc}"
    );

    // Redis forgot the key: Postgres alone answers.
    let _: () = redis::cmd("DEL").arg(&key).query(&mut conn).unwrap();
    let (code, doc) = inspect(&[]);
    assert_eq!(
        (code, doc["verdict"].as_str()),
        (0, Some("postgres_only")),
        "{doc}"
    );
    assert_eq!(doc["redis"], Value::Null);

    // Without Postgres, only when asked for.
    let (code, _, stderr) = idem_text(&["inspect", "order-1", "--redis", &redis]);
    assert_eq!(code, 2, "a missing --database is a usage error: {stderr}");
    assert!(stderr.contains("--database <URL>"), "{stderr}");
    let (code, doc) = idem(&["inspect", "x", "--redis", &redis, "--redis-only"]);
    assert_eq!(
        (code, doc["verdict"].as_str()),
        (4, Some("not_found")),
        "{doc}"
    );

    // Servers that are not there: exit 1, saying which.
    let (code, doc) = idem(&[
        "inspect",
        "k",
        "--redis",
        "redis://127.0.0.1:1",
        "--redis-only",
    ]);
    assert_eq!(code, 1, "{doc}");
    let message = doc["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("connect to Redis at redis://127.0.0.1:1"),
        "{message}"
    );
    let plain = PlainRedis::start();
    let (code, doc) = idem(&["inspect", "k", "--redis", &plain.url, "--redis-only"]);
    assert_eq!(code, 1, "{doc}");
    assert!(
        doc["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no idem module"),
        "{doc}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_frees_only_a_key_in_flight_with_its_token() {
    let server = RedisServer::start();
    let db = PgDatabase::create();
    let mut pg = migrated(&db, Layout::Unpartitioned).await;
    let mut conn = server.conn();
    let (redis, database) = (server.url(), db.url.clone());
    let release = |key: &str, token: u64| {
        let token = token.to_string();
        idem(&[
            "release",
            "--raw",
            key,
            "--token",
            &token,
            "--redis",
            &redis,
            "--database",
            &database,
        ])
    };

    // Stuck in flight in Redis, with its durable claim in Postgres.
    let fingerprint = b"POST /payments {\"amount\":5}";
    let token = begin(&mut conn, "idem:{:stuck}", fingerprint, 3600);
    let fence = Fence::new(
        "idem:{:stuck}",
        token,
        fingerprint,
        Duration::from_secs(3600),
    );
    assert_eq!(
        fence.claim(&mut pg).await.unwrap(),
        idem_client::Claim::Proceed
    );

    // Another token: refused, nothing changed on either side.
    let (code, doc) = release("idem:{:stuck}", token + 1);
    assert_eq!(
        (code, doc["error"]["kind"].as_str()),
        (3, Some("refused")),
        "{doc}"
    );
    let message = doc["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(&format!("under token {token}")),
        "{message}"
    );
    assert!(message.contains("nothing was changed"), "{message}");
    assert!(matches!(
        get(&mut conn, "idem:{:stuck}").unwrap().state,
        State::InProgress { .. }
    ));
    assert_eq!(
        row_token(&pg, "idem:{:stuck}").await,
        Some(("in_progress".into(), token as i64))
    );

    // Its own token: both released, and a new request proceeds at once.
    let (code, doc) = release("idem:{:stuck}", token);
    assert_eq!(code, 0, "{doc}");
    assert_eq!(doc["released"]["redis"], true);
    assert_eq!(doc["released"]["postgres"], true);
    assert!(get(&mut conn, "idem:{:stuck}").is_none());
    assert_eq!(row_token(&pg, "idem:{:stuck}").await, None);
    let retry = begin(&mut conn, "idem:{:stuck}", fingerprint, 3600);
    let retry_fence = Fence::new(
        "idem:{:stuck}",
        retry,
        fingerprint,
        Duration::from_secs(3600),
    );
    assert_eq!(
        retry_fence.claim(&mut pg).await.unwrap(),
        idem_client::Claim::Proceed
    );

    // Completed: refused, the stored response stays.
    complete(&mut conn, "idem:{:stuck}", retry, b"{}");
    let (code, doc) = release("idem:{:stuck}", retry);
    assert_eq!(code, 3, "{doc}");
    assert!(
        doc["error"]["message"]
            .as_str()
            .unwrap()
            .contains("completed"),
        "{doc}"
    );
    assert!(matches!(
        get(&mut conn, "idem:{:stuck}").unwrap().state,
        State::Completed(_)
    ));
    assert_eq!(
        row_token(&pg, "idem:{:stuck}").await,
        Some(("in_progress".into(), retry as i64))
    );

    // Redis in flight with the token, but Postgres holds a newer claim:
    // refused as a whole, Redis untouched too.
    let mine = begin(&mut conn, "idem:{:split}", fingerprint, 3600);
    Fence::new(
        "idem:{:split}",
        mine + 1_000,
        fingerprint,
        Duration::from_secs(3600),
    )
    .claim(&mut pg)
    .await
    .unwrap();
    let (code, doc) = release("idem:{:split}", mine);
    assert_eq!(code, 3, "{doc}");
    assert!(get(&mut conn, "idem:{:split}").is_some());
    assert_eq!(
        row_token(&pg, "idem:{:split}").await,
        Some(("in_progress".into(), (mine + 1_000) as i64))
    );

    // Redis forgot the key; its durable claim alone keeps retries out until
    // its lease lapses: released in Postgres.
    let lost = 7_000_000_000_000_000;
    Fence::new("idem:{:lost}", lost, fingerprint, Duration::from_secs(3600))
        .claim(&mut pg)
        .await
        .unwrap();
    let (code, doc) = release("idem:{:lost}", lost);
    assert_eq!(code, 0, "{doc}");
    assert_eq!(doc["released"]["redis"], Value::Null);
    assert_eq!(doc["released"]["postgres"], true);
    assert_eq!(row_token(&pg, "idem:{:lost}").await, None);

    // Stuck in Redis after the key's reuse; Postgres still holds the older
    // completion: Redis is released, the older row is not this holder's and
    // stays.
    let old = begin(&mut conn, "idem:{:reused}", fingerprint, 3600);
    complete(&mut conn, "idem:{:reused}", old, b"{}");
    mirror(&pg, &mut conn, "idem:{:reused}").await;
    let _: () = redis::cmd("DEL")
        .arg("idem:{:reused}")
        .query(&mut conn)
        .unwrap();
    let stuck = begin(&mut conn, "idem:{:reused}", fingerprint, 3600);
    let (code, doc) = release("idem:{:reused}", stuck);
    assert_eq!(code, 0, "{doc}");
    assert_eq!(doc["released"]["redis"], true);
    assert_eq!(doc["released"]["postgres"], Value::Null);
    assert_eq!(
        row_token(&pg, "idem:{:reused}").await,
        Some(("completed".into(), old as i64))
    );
    // ... but the older token's own completion is no stuck key.
    let again = begin(&mut conn, "idem:{:reused}", fingerprint, 3600);
    let (code, doc) = release("idem:{:reused}", old);
    assert_eq!(code, 3, "{doc}");
    assert!(get(&mut conn, "idem:{:reused}").is_some_and(|r| r.token == again));

    // Nothing anywhere.
    let (code, doc) = release("idem:{:lost}", lost);
    assert_eq!(
        (code, doc["error"]["kind"].as_str()),
        (4, Some("not_found")),
        "{doc}"
    );

    // Redis only, by the client's key and tenant, as text.
    let t = begin(
        &mut conn,
        &redis_key("idem:", "acme", "k 1"),
        fingerprint,
        60,
    );
    let (code, stdout, stderr) = idem_text(&[
        "release",
        "k 1",
        "--tenant",
        "acme",
        "--token",
        &t.to_string(),
        "--redis",
        &redis,
        "--redis-only",
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("Redis record aborted"), "{stdout}");
    assert!(get(&mut conn, &redis_key("idem:", "acme", "k 1")).is_none());
    let (code, _, stderr) = idem_text(&[
        "release",
        "k 1",
        "--tenant",
        "acme",
        "--token",
        "1",
        "--redis",
        &redis,
        "--redis-only",
    ]);
    assert_eq!(code, 4);
    assert!(stderr.starts_with("idem: not found: "), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_shows_each_nodes_outbox_and_its_oldest_keys() {
    let a = RedisServer::start();
    let b = RedisServer::start();
    let mut conn = a.conn();
    let mut tokens = Vec::new();
    for key in ["p-1", "p-2", "p-3"] {
        let token = begin(&mut conn, key, key.as_bytes(), 3600);
        complete(&mut conn, key, token, b"{}");
        tokens.push(token);
        std::thread::sleep(Duration::from_millis(5));
    }
    begin(&mut conn, "in-flight", b"x", 3600);
    let _: () = redis::cmd("SET")
        .arg("plain")
        .arg("1")
        .query(&mut conn)
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let urls = format!("{},{}", a.url(), b.url());

    let (code, doc) = idem(&["pending", "--redis", &urls, "--keys", "2"]);
    assert_eq!(code, 0, "{doc}");
    assert_eq!(doc["pending"], 3);
    let nodes = doc["nodes"].as_array().unwrap();
    assert_eq!(nodes[0]["pending"], 3);
    assert_eq!(nodes[0]["role"], "master");
    assert!(
        nodes[0]["oldest_pending_ms"].as_u64().unwrap() >= 50,
        "{doc}"
    );
    let listed: Vec<&str> = nodes[0]["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["key"].as_str().unwrap())
        .collect();
    assert_eq!(listed, ["p-1", "p-2"], "the oldest first");
    assert_eq!(nodes[0]["keys"][0]["token"], tokens[0]);
    assert_eq!(nodes[1]["pending"], 0);

    ack(&mut conn, "p-1", tokens[0]);
    let (code, text, _) = idem_text(&["pending", "--redis", &a.url(), "--redis", &b.url()]);
    assert_eq!(code, 0);
    let total = text.lines().last().unwrap();
    assert!(
        total.starts_with("total") && total.contains(" 2 "),
        "{text}"
    );

    // A node that is not there is reported as such; the others still are.
    let (code, doc) = idem(&[
        "pending",
        "--redis",
        &a.url(),
        "--redis",
        "redis://127.0.0.1:1",
    ]);
    assert_eq!(code, 1, "{doc}");
    assert_eq!(doc["nodes"][0]["pending"], 2);
    assert!(
        doc["nodes"][1]["error"]
            .as_str()
            .unwrap()
            .contains("127.0.0.1:1"),
        "{doc}"
    );
}

idem_testkit::both_layouts!(idem_writer::Layout, cleanup_runs_the_writers_cleanup_once);
async fn cleanup_runs_the_writers_cleanup_once(layout: Layout) {
    let db = PgDatabase::create();
    let pg = migrated(&db, layout).await;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let day = 86_400_000;
    let row = |key: &str, expires_at_ms: i64| MirrorRecord {
        key: key.into(),
        token: 1,
        fingerprint: "ab".repeat(32),
        status: 200,
        body: Vec::new(),
        headers: Vec::new(),
        created_at_ms: expires_at_ms - 3 * day,
        completed_at_ms: expires_at_ms - 3 * day,
        expires_at_ms,
    };
    let rows = [row("expired", now_ms - 2 * day), row("live", now_ms + day)];
    if layout == Layout::Partitioned {
        let days = rows
            .iter()
            .map(|r| idem_writer::partitions::day_of_ms(r.expires_at_ms));
        idem_writer::partitions::ensure_days(&pg, days)
            .await
            .unwrap();
        let lock = pg.prepare(idem_writer::store::LOCK_KEYS_SQL).await.unwrap();
        let upsert = pg
            .prepare(idem_writer::store::PARTITIONED_UPSERT_SQL)
            .await
            .unwrap();
        let statements = idem_writer::store::Statements::Partitioned {
            lock: &lock,
            upsert: &upsert,
        };
        idem_writer::store::upsert_with(&pg, statements, &rows)
            .await
            .unwrap();
    } else {
        let statement = pg.prepare(UPSERT_SQL).await.unwrap();
        upsert_records(&pg, &statement, &rows).await.unwrap();
    }

    let (code, doc) = idem(&["cleanup", "--database", &db.url, "--days-ahead", "2"]);
    assert_eq!(code, 0, "{doc}");
    assert_eq!(doc["layout"], layout.to_string());
    match layout {
        Layout::Unpartitioned => assert_eq!(doc["rows_deleted"], 1, "{doc}"),
        Layout::Partitioned => {
            assert_eq!(
                doc["partitions_dropped"].as_array().unwrap().len(),
                1,
                "{doc}"
            );
            assert!(doc["partitions_created"].is_array(), "{doc}");
        }
    }
    assert_eq!(row_token(&pg, "expired").await, None);
    assert_eq!(row_token(&pg, "live").await, Some(("completed".into(), 1)));

    let (code, doc) = idem(&["cleanup", "--database", &db.url, "--batch-size", "0"]);
    assert_eq!(code, 2, "{doc}");
    let (code, doc) = idem(&["cleanup", "--database", "postgres://postgres@127.0.0.1:1/x"]);
    assert_eq!(code, 1, "{doc}");
}

idem_testkit::both_layouts!(
    idem_writer::Layout,
    remirror_writes_back_what_postgres_lost_and_never_goes_backwards
);
async fn remirror_writes_back_what_postgres_lost_and_never_goes_backwards(layout: Layout) {
    let server = RedisServer::start();
    let db = PgDatabase::create();
    let mut pg = migrated(&db, layout).await;
    let mut conn = server.conn();
    let (redis, database) = (server.url(), db.url.clone());
    let completed = |conn: &mut redis::Connection, key: &str| {
        let token = begin(conn, key, key.as_bytes(), 3600);
        complete(
            conn,
            key,
            token,
            format!("{{\"key\":\"{key}\"}}").as_bytes(),
        );
        token
    };
    // Completed before the loss window: never written back.
    completed(&mut conn, "before");
    std::thread::sleep(Duration::from_millis(20));
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis()
        .to_string();
    std::thread::sleep(Duration::from_millis(5));
    for key in ["lost-1", "lost-2", "kept", "newer", "fenced"] {
        completed(&mut conn, key);
    }
    begin(&mut conn, "in-flight", b"x", 3600);
    let _: () = redis::cmd("SET")
        .arg("plain")
        .arg("1")
        .query(&mut conn)
        .unwrap();
    let mirror_all = async |pg: &tokio_postgres::Client, conn: &mut redis::Connection| {
        for key in ["before", "lost-1", "lost-2", "kept"] {
            let row = as_row(conn, key);
            if layout == Layout::Partitioned {
                idem_writer::partitions::ensure_days(
                    pg,
                    [idem_writer::partitions::day_of_ms(row.expires_at_ms)],
                )
                .await
                .unwrap();
                let lock = pg.prepare(idem_writer::store::LOCK_KEYS_SQL).await.unwrap();
                let upsert = pg
                    .prepare(idem_writer::store::PARTITIONED_UPSERT_SQL)
                    .await
                    .unwrap();
                idem_writer::store::upsert_with(
                    pg,
                    idem_writer::store::Statements::Partitioned {
                        lock: &lock,
                        upsert: &upsert,
                    },
                    std::slice::from_ref(&row),
                )
                .await
                .unwrap();
            } else {
                let statement = pg.prepare(UPSERT_SQL).await.unwrap();
                upsert_records(pg, &statement, std::slice::from_ref(&row))
                    .await
                    .unwrap();
            }
            ack(conn, key, row.token as u64);
        }
    };
    mirror_all(&pg, &mut conn).await;
    // "newer": Postgres holds a later version (a larger token) than Redis.
    let newer_token = get(&mut conn, "newer").unwrap().token + 1_000_000;
    let table = match layout {
        Layout::Unpartitioned => idem_client::TableLayout::Unpartitioned,
        Layout::Partitioned => idem_client::TableLayout::Partitioned,
    };
    let newer = Fence::new(
        "newer",
        newer_token,
        b"other request",
        Duration::from_secs(3600),
    )
    .with_layout(table);
    assert_eq!(
        newer.claim(&mut pg).await.unwrap(),
        idem_client::Claim::Proceed
    );
    // "fenced": a smaller token's answer the fence committed with its effect.
    let fenced_token = get(&mut conn, "fenced").unwrap().token - 1;
    let fence = Fence::new(
        "fenced",
        fenced_token,
        b"fenced request",
        Duration::from_secs(3600),
    )
    .with_layout(table);
    assert_eq!(
        fence.claim(&mut pg).await.unwrap(),
        idem_client::Claim::Proceed
    );
    {
        let tx = pg.transaction().await.unwrap();
        let stored = idem_client::StoredResponse::new(201, "{\"fenced\":true}");
        assert!(matches!(
            fence.complete(&tx, &stored).await.unwrap(),
            idem_client::Commit::Committed
        ));
        tx.commit().await.unwrap();
    }
    // The loss: a promotion dropped the last rows the writer had written.
    for key in ["before", "lost-1", "lost-2"] {
        pg.execute("DELETE FROM idempotency_keys WHERE key = $1", &[&key])
            .await
            .unwrap();
    }

    let run = |extra: &[&str]| {
        let mut args = vec![
            "remirror",
            "--since",
            &since,
            "--redis",
            &redis,
            "--database",
            &database,
        ];
        args.extend_from_slice(extra);
        idem(&args)
    };
    let (code, doc) = run(&["--dry-run"]);
    assert_eq!(code, 0, "{doc}");
    assert_eq!(doc["nodes"][0]["completed_since"], 5, "{doc}");
    assert_eq!(doc["nodes"][0]["written"], 0);
    assert_eq!(
        row_token(&pg, "lost-1").await,
        None,
        "a dry run writes nothing"
    );

    let (code, doc) = run(&[]);
    assert_eq!(code, 0, "{doc}");
    let node = &doc["nodes"][0];
    assert_eq!(node["completed_since"], 5, "{doc}");
    assert_eq!(node["written"], 2, "lost-1 and lost-2: {doc}");
    assert_eq!(node["unchanged"], 3, "kept, newer, fenced: {doc}");
    assert_eq!(node["failed"].as_array().unwrap().len(), 0);
    for key in ["lost-1", "lost-2", "kept"] {
        let (code, doc) = idem(&[
            "inspect",
            "--raw",
            key,
            "--redis",
            &redis,
            "--database",
            &database,
        ]);
        assert_eq!(
            (code, doc["verdict"].as_str()),
            (0, Some("agree")),
            "{key}: {doc}"
        );
    }
    assert_eq!(
        row_token(&pg, "before").await,
        None,
        "completed before --since"
    );
    assert_eq!(row_token(&pg, "in-flight").await, None);
    assert_eq!(
        row_token(&pg, "newer").await,
        Some(("in_progress".into(), newer_token as i64))
    );
    assert_eq!(
        row_token(&pg, "fenced").await,
        Some(("completed".into(), fenced_token as i64))
    );

    // Idempotent: a second run writes nothing.
    let (code, doc) = run(&[]);
    assert_eq!(code, 0, "{doc}");
    assert_eq!(doc["nodes"][0]["written"], 0, "{doc}");
    assert_eq!(doc["nodes"][0]["unchanged"], 5, "{doc}");

    // A key Postgres cannot index (too long even compressed): its batch is
    // written row by row, it alone is listed as failed, exit 6.
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let long: String = (0..8000)
        .map(|_| {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            char::from(b'a' + (seed >> 59) as u8 % 26)
        })
        .collect();
    completed(&mut conn, &long);
    let (code, doc) = run(&[]);
    assert_eq!(code, 6, "{doc}");
    let failed = doc["nodes"][0]["failed"].as_array().unwrap();
    assert_eq!(failed.len(), 1, "{doc}");
    assert_eq!(failed[0]["key"], long.as_str());
    assert_eq!(doc["nodes"][0]["unchanged"], 5, "{doc}");
    let _: () = redis::cmd("DEL").arg(&long).query(&mut conn).unwrap();

    // RFC 3339 works as well as Unix ms; nonsense is a usage error.
    let (code, doc) = idem(&[
        "remirror",
        "--since",
        "2000-01-01T00:00:00Z",
        "--redis",
        &redis,
        "--database",
        &database,
        "--dry-run",
    ]);
    assert_eq!(code, 0, "{doc}");
    assert_eq!(doc["nodes"][0]["completed_since"], 6, "{doc}");
    let (code, doc) = idem(&[
        "remirror",
        "--since",
        "last tuesday",
        "--redis",
        &redis,
        "--database",
        &database,
    ]);
    assert_eq!(
        (code, doc["error"]["kind"].as_str()),
        (2, Some("usage")),
        "{doc}"
    );

    // No table: a clear error, nothing done.
    let empty = PgDatabase::create();
    let (code, doc) = idem(&[
        "remirror",
        "--since",
        &since,
        "--redis",
        &redis,
        "--database",
        &empty.url,
    ]);
    assert_eq!(code, 1, "{doc}");
    assert!(
        doc["error"]["message"]
            .as_str()
            .unwrap()
            .contains("migrations"),
        "{doc}"
    );
}
