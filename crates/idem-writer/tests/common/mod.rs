//! Shared by the writer's integration tests: generating completions through
//! pipelines, running the `idem-writer` binary, and checking Postgres
//! against what Redis completed.
#![allow(dead_code)]

pub mod failover;
pub mod library;

use std::collections::HashMap;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idem_core::wire::{BeginReply, Frame};
use idem_core::Record;
use rand::RngExt;
use redis::Value;
use sha2::{Digest, Sha256};

/// What a test completed in Redis: the truth Postgres must end up holding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    pub key: String,
    pub token: i64,
    pub fingerprint_hex: String,
    pub status: i32,
    pub body: Vec<u8>,
    pub headers: Vec<Vec<u8>>,
}

/// A thread completing `total` keys named `prefix-N`, `chunk` at a time
/// with `pause` between chunks; joins to every completion it made.
pub fn spawn_generator(
    client: redis::Client,
    prefix: &'static str,
    total: usize,
    chunk: usize,
    pause: Duration,
) -> std::thread::JoinHandle<Vec<Completion>> {
    std::thread::spawn(move || {
        let mut conn = client.get_connection().expect("connect");
        let mut done = Vec::with_capacity(total);
        for c in 0..total / chunk {
            done.extend(complete_keys(
                &mut conn,
                &keys(prefix, c * chunk..(c + 1) * chunk),
                3600,
            ));
            std::thread::sleep(pause);
        }
        done
    })
}

/// BEGIN + COMPLETE for each key, as two pipelines (all BEGINs, then all
/// COMPLETEs). Bodies are random bytes (not UTF-8), headers 0..=2 pairs.
pub fn complete_keys(
    conn: &mut redis::Connection,
    keys: &[String],
    ttl_secs: u64,
) -> Vec<Completion> {
    try_complete_keys(conn, keys, ttl_secs, None)
        .expect("pipelined IDEM.BEGIN / IDEM.COMPLETE")
        .0
}

/// [`complete_keys`] that returns Redis errors, with an optional `WAIT
/// numreplicas timeout-ms` after the COMPLETEs (its reply is the second
/// value; 0 without it).
pub fn try_complete_keys(
    conn: &mut redis::Connection,
    keys: &[String],
    ttl_secs: u64,
    wait: Option<(u32, u64)>,
) -> redis::RedisResult<(Vec<Completion>, i64)> {
    let mut rng = rand::rng();
    let mut begin = redis::pipe();
    let fingerprints: Vec<Vec<u8>> = keys
        .iter()
        .map(|k| format!("POST /payments {k} {}", rng.random::<u32>()).into_bytes())
        .collect();
    for (key, fp) in keys.iter().zip(&fingerprints) {
        begin.cmd("IDEM.BEGIN").arg(key).arg(fp).arg(ttl_secs);
    }
    let replies: Vec<Value> = begin.query(conn)?;
    let mut complete = redis::pipe();
    let mut done = Vec::with_capacity(keys.len());
    for ((key, fp), reply) in keys.iter().zip(&fingerprints).zip(replies) {
        let token = new_token(&reply).unwrap_or_else(|| panic!("BEGIN {key}: {reply:?}"));
        let status = [200, 201, 202, 400, 404, 409, 422, 500][rng.random_range(0..8)];
        let body_len = rng.random_range(0..600);
        let body: Vec<u8> = (0..body_len).map(|_| rng.random()).collect();
        let header_pairs = rng.random_range(0..=2);
        let mut headers = Vec::new();
        let cmd = complete
            .cmd("IDEM.COMPLETE")
            .arg(key)
            .arg(token)
            .arg(status)
            .arg(&body);
        for h in 0..header_pairs {
            let name = format!("x-h{h}").into_bytes();
            let value: Vec<u8> = (0..rng.random_range(1..40)).map(|_| rng.random()).collect();
            cmd.arg("HEADER").arg(&name).arg(&value);
            headers.push(name);
            headers.push(value);
        }
        done.push(Completion {
            key: key.clone(),
            token,
            fingerprint_hex: hex::encode(Sha256::digest(fp)),
            status,
            body,
            headers,
        });
    }
    if let Some((replicas, timeout_ms)) = wait {
        complete.cmd("WAIT").arg(replicas).arg(timeout_ms);
    }
    let replies: Vec<Value> = complete.query(conn)?;
    let acked = match (wait, replies.last()) {
        (Some(_), Some(Value::Int(n))) => *n,
        _ => 0,
    };
    Ok((done, acked))
}

/// The token of a `["new", token]` BEGIN reply (`idem_core::wire`).
fn new_token(reply: &Value) -> Option<i64> {
    match BeginReply::parse(&Frame::from(reply)) {
        Ok(BeginReply::New { token }) => i64::try_from(token).ok(),
        _ => None,
    }
}

pub fn keys(prefix: &str, range: std::ops::Range<usize>) -> Vec<String> {
    range.map(|i| format!("{prefix}-{i:06}")).collect()
}

/// An `INFO idem` integer field.
pub fn info_field(conn: &mut redis::Connection, name: &str) -> i64 {
    let text = idem_testkit::info::idem_info_text(conn);
    idem_testkit::info::info_int(&text, name)
        .unwrap_or_else(|| panic!("INFO idem has no {name}:\n{text}"))
}

use idem_testkit::wire::mirror_word;

/// `IDEM.GET key`, parsed (`None`: no record).
pub fn get_record(conn: &mut redis::Connection, key: &[u8]) -> Option<Record> {
    idem_testkit::wire::idem_get(conn, key)
}

/// The mirror state word (`pending` | `mirrored`) of a completed record.
pub fn mirror_state(record: &Record) -> &'static str {
    mirror_word(record).expect("a completed record")
}

/// Each key's record as Redis has it, read through pipelined `IDEM.GET`s
/// (keys without a record left out).
pub fn redis_records(conn: &mut redis::Connection, keys: &[String]) -> HashMap<String, Record> {
    let mut out = HashMap::with_capacity(keys.len());
    for chunk in keys.chunks(1000) {
        let mut pipe = redis::pipe();
        for key in chunk {
            pipe.cmd("IDEM.GET").arg(key);
        }
        let replies: Vec<Value> = pipe.query(conn).expect("pipelined IDEM.GET");
        for (key, reply) in chunk.iter().zip(replies) {
            if let Some(record) = idem_testkit::wire::parse_get(&reply) {
                out.insert(key.clone(), record);
            }
        }
    }
    out
}

/// A row of `idempotency_keys`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub token: i64,
    pub fingerprint: String,
    pub response_status: Option<i32>,
    pub response_body: Option<Vec<u8>>,
    pub response_headers: Vec<Vec<u8>>,
    pub status: String,
    pub created_at_ms: Option<i64>,
    pub completed_at_ms: Option<i64>,
    pub expires_at_ms: i64,
}

fn ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as i64
}

pub async fn rows(pg: &tokio_postgres::Client) -> HashMap<String, Row> {
    pg.query(
        "SELECT key, token, fingerprint, response_status, response_body, response_headers,
                status, created_at, completed_at, expires_at
         FROM idempotency_keys",
        &[],
    )
    .await
    .expect("read idempotency_keys")
    .into_iter()
    .map(|r| {
        (
            r.get::<_, String>(0),
            Row {
                token: r.get(1),
                fingerprint: r.get(2),
                response_status: r.get(3),
                response_body: r.get(4),
                response_headers: r.get(5),
                status: r.get(6),
                created_at_ms: r.get::<_, Option<SystemTime>>(7).map(ms),
                completed_at_ms: r.get::<_, Option<SystemTime>>(8).map(ms),
                expires_at_ms: ms(r.get(9)),
            },
        )
    })
    .collect()
}

pub async fn row_count(pg: &tokio_postgres::Client) -> i64 {
    pg.query_one("SELECT count(*) FROM idempotency_keys", &[])
        .await
        .map(|r| r.get(0))
        .unwrap_or(-1)
}

/// Postgres holds exactly `expected` (key set, token, fingerprint, status,
/// body, headers), with the timestamps Redis has, and Redis marks every one
/// of them mirrored (acknowledged).
pub async fn assert_mirrored_exactly(
    pg: &tokio_postgres::Client,
    redis: &mut redis::Connection,
    expected: &[Completion],
) {
    let rows = rows(pg).await;
    assert_eq!(rows.len(), expected.len(), "row count");
    let keys: Vec<String> = expected.iter().map(|c| c.key.clone()).collect();
    let in_redis = redis_records(redis, &keys);
    for want in expected {
        let row = rows
            .get(&want.key)
            .unwrap_or_else(|| panic!("{} missing from Postgres", want.key));
        assert_eq!(row.token, want.token, "{} token", want.key);
        assert_eq!(
            row.fingerprint, want.fingerprint_hex,
            "{} fingerprint",
            want.key
        );
        assert_eq!(row.status, "completed", "{} status", want.key);
        assert_eq!(
            row.response_status,
            Some(want.status),
            "{} response_status",
            want.key
        );
        if row.response_body.as_deref() != Some(want.body.as_slice()) {
            let in_redis = in_redis.get(&want.key);
            panic!(
                "{} body differs: Postgres {:?} bytes, expected {} bytes, Redis has {:?}; \
                 Postgres {:?}\n expected {:?}",
                want.key,
                row.response_body.as_ref().map(Vec::len),
                want.body.len(),
                in_redis.and_then(Record::completed).map(|c| &c.body),
                row.response_body,
                want.body
            );
        }
        assert_eq!(row.response_headers, want.headers, "{} headers", want.key);
        let record = in_redis
            .get(&want.key)
            .unwrap_or_else(|| panic!("{} missing from Redis", want.key));
        assert_eq!(
            mirror_state(record),
            "mirrored",
            "{} not acknowledged",
            want.key
        );
        assert_eq!(
            row.created_at_ms,
            Some(record.created_at as i64),
            "{} created_at",
            want.key
        );
        assert_eq!(
            row.completed_at_ms,
            record.completed().map(|c| c.completed_at as i64),
            "{} completed_at",
            want.key
        );
        assert_eq!(
            row.expires_at_ms as u64, record.expires_at,
            "{} expires_at",
            want.key
        );
    }
}

/// Records every update that does not move a row's token forward.
pub async fn install_regression_trap(pg: &tokio_postgres::Client) {
    pg.batch_execute(
        "CREATE TABLE token_regressions (key TEXT, old_token BIGINT, new_token BIGINT);
         CREATE FUNCTION note_token_regression() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.token <= OLD.token THEN
                 INSERT INTO token_regressions VALUES (OLD.key, OLD.token, NEW.token);
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER idempotency_keys_regression_trap BEFORE UPDATE ON idempotency_keys
             FOR EACH ROW EXECUTE FUNCTION note_token_regression();",
    )
    .await
    .expect("install the regression trap");
}

pub async fn assert_no_regressions(pg: &tokio_postgres::Client) {
    let regressions: i64 = pg
        .query_one("SELECT count(*) FROM token_regressions", &[])
        .await
        .expect("read token_regressions")
        .get(0);
    assert_eq!(regressions, 0, "an update did not move a token forward");
}

/// Applies the writer's migrations through the library.
pub async fn migrate(url: &str) {
    let mut client = idem_writer::connect(url).await.expect("connect");
    idem_writer::migrate(&mut client).await.expect("migrate");
}

pub async fn connect_pg(url: &str) -> tokio_postgres::Client {
    idem_writer::connect(url)
        .await
        .expect("connect to Postgres")
}

pub use idem_testkit::eventually_async as wait_until;

/// Waits up to `timeout` for the node's pending index to empty and
/// Postgres to hold `rows` rows; whether they did.
pub async fn wait_drained(
    conn: &mut redis::Connection,
    pg: &tokio_postgres::Client,
    rows: i64,
    timeout: Duration,
) -> bool {
    wait_until(timeout, || {
        let pending = info_field(conn, "idem_mirror_pending");
        async move { pending == 0 && row_count(pg).await == rows }
    })
    .await
}

/// The `idem-writer` binary running as a child process, its log in a file.
pub struct WriterProcess {
    child: Option<Child>,
    log: PathBuf,
    pub metrics_addr: SocketAddr,
}

impl WriterProcess {
    /// `idem-writer run` with a short claim (so records a killed writer held
    /// come back quickly) unless `extra` sets one, and a metrics address on a
    /// free port.
    pub fn start(redis_urls: &[String], database_url: &str, extra: &[&str]) -> Self {
        Self::start_env(redis_urls, database_url, extra, &[])
    }

    /// [`WriterProcess::start`] with extra environment variables.
    pub fn start_env(
        redis_urls: &[String],
        database_url: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let metrics_addr: SocketAddr = format!("127.0.0.1:{}", idem_testkit::free_port())
            .parse()
            .expect("socket address");
        let log = std::env::temp_dir().join(format!(
            "idem-writer-test-{}-{}.log",
            std::process::id(),
            rand::random::<u64>()
        ));
        let log_file = std::fs::File::create(&log).expect("create the writer log");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem-writer"));
        cmd.arg("run");
        for url in redis_urls {
            cmd.arg("--redis").arg(url);
        }
        let defaults = [
            ("--claim-ms", "1500"),
            ("--block-ms", "200"),
            ("--info-interval", "200ms"),
        ];
        for (flag, value) in defaults {
            if !extra.contains(&flag) {
                cmd.args([flag, value]);
            }
        }
        cmd.arg("--database-url")
            .arg(database_url)
            .arg("--metrics-addr")
            .arg(metrics_addr.to_string())
            .args(extra)
            .env_remove("REDIS_URL")
            .env_remove("DATABASE_URL")
            .env("RUST_LOG", "idem_writer=info")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(log_file);
        let child = cmd.spawn().expect("spawn idem-writer");
        WriterProcess {
            child: Some(child),
            log,
            metrics_addr,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// SIGKILL, as in a crash.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM: the graceful path.
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM");
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    /// Waits for the process to exit (at most `timeout`).
    pub fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        let child = self.child.as_mut().expect("running");
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                self.child = None;
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "idem-writer did not exit:\n{}",
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits up to `timeout` for the writer to be pulling from `nodes` Redis
    /// nodes: `idem_writer_node_up` is 1 once a node's first
    /// `IDEM.MIRROR.PULL` has come back, so the migrations, the partitions
    /// made ahead and the discovery are behind it and a record completed
    /// from now on is pulled at once. Whether it was.
    pub async fn wait_pulling(&self, nodes: usize, timeout: Duration) -> bool {
        wait_until(timeout, || {
            let metrics = self.http_get("/metrics").1;
            let up = metrics
                .lines()
                .filter(|l| l.starts_with("idem_writer_node_up{") && l.ends_with(" 1"))
                .count();
            async move { up >= nodes }
        })
        .await
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// `GET path` on the metrics address: (status code, body).
    pub fn http_get(&self, path: &str) -> (u16, String) {
        http_get(self.metrics_addr, path)
    }
}

impl Drop for WriterProcess {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// A minimal HTTP/1.0 GET: (status code, body).
pub fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    use std::io::Read as _;
    // A writer that was just started may not listen yet (creating partitions
    // ahead first, say): retry the connection for a while.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut stream = loop {
        match std::net::TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => panic!("connect to the metrics address {addr}: {e}"),
        }
    };
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").expect("send request");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read response");
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("bad response: {head}"));
    (code, body.to_string())
}

/// The value of one sample line `name{labels} value` in Prometheus text.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// Applies the writer's migrations with `layout` through the library.
pub async fn migrate_layout(url: &str, layout: idem_writer::Layout) {
    let mut client = idem_writer::connect(url).await.expect("connect");
    idem_writer::migrate_with_layout(&mut client, layout)
        .await
        .expect("migrate");
}

/// The `run` flags that give a fresh database `layout`.
pub fn layout_args(layout: idem_writer::Layout) -> [&'static str; 2] {
    match layout {
        idem_writer::Layout::Unpartitioned => ["--layout", "unpartitioned"],
        idem_writer::Layout::Partitioned => ["--layout", "partitioned"],
    }
}

/// The writer's batch upsert on `layout` (creating the partitions the rows
/// need first, as the writer does).
pub async fn upsert(
    pg: &tokio_postgres::Client,
    layout: idem_writer::Layout,
    records: &[idem_writer::MirrorRecord],
) -> Result<u64, tokio_postgres::Error> {
    use idem_writer::partitions::{day_of_ms, ensure_days};
    use idem_writer::store::{
        upsert_with, Statements, LOCK_KEYS_SQL, PARTITIONED_UPSERT_SQL, UPSERT_SQL,
    };
    match layout {
        idem_writer::Layout::Unpartitioned => {
            let upsert = pg.prepare(UPSERT_SQL).await?;
            upsert_with(pg, Statements::Unpartitioned(&upsert), records).await
        }
        idem_writer::Layout::Partitioned => {
            ensure_days(pg, records.iter().map(|r| day_of_ms(r.expires_at_ms)))
                .await
                .expect("create partitions");
            let lock = pg.prepare(LOCK_KEYS_SQL).await?;
            let upsert = pg.prepare(PARTITIONED_UPSERT_SQL).await?;
            let statements = Statements::Partitioned {
                lock: &lock,
                upsert: &upsert,
            };
            upsert_with(pg, statements, records).await
        }
    }
}
