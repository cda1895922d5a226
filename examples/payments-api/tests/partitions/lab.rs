//! The partition scenarios' shared parts: Postgres and Redis set up in
//! namespaces of a `Net`, well-behaved clients that record every request in
//! a `History`, and what the stores hold afterwards (`Observed`) for the
//! checker.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use idem_testkit::history::{Answer, History, Observed};
use idem_testkit::netns::{Host, Net};
use idem_testkit::partition::NsRedis;
use idem_testkit::postgres_server::PgServer;
use serde_json::json;
use tokio::task::JoinHandle;

/// The database the example API and the writer use on each cluster.
pub const DATABASE: &str = "payments";

/// A new network, or `None` after saying why the scenario is skipped (on
/// the process's stderr itself: the test harness's capture would hide it).
pub fn net(scenario: &str) -> Option<Net> {
    let net = Net::new();
    if net.is_none() {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED partition scenario {scenario}: network namespaces cannot be made here \
             (needs root and iproute2)"
        );
    }
    net
}

/// A Postgres primary in `host` with the `payments` database.
pub fn postgres(net: &Net, host: &Host) -> PgServer {
    let server = net.postgres(host);
    server.create_database(DATABASE);
    server
}

/// The URL of the `payments` database on `hosts` (all on `port`), with
/// `target_session_attrs=read-write`: a client tries them in order and
/// keeps the one that accepts writes, as with a Patroni or RDS cluster.
pub fn read_write_url(hosts: &[&Host], port: u16) -> String {
    let hosts: Vec<String> = hosts.iter().map(|h| format!("{}:{port}", h.ip())).collect();
    format!(
        "postgres://postgres@{}/{DATABASE}?target_session_attrs=read-write&connect_timeout=2",
        hosts.join(",")
    )
}

/// The client key of key number `i` of a scenario; no key's text contains
/// another's, so it is found inside Redis and mirror keys.
pub fn key(scenario: &str, i: usize) -> String {
    format!("{scenario}-{i:04}-z")
}

/// The amount key `i` pays: distinct per key, so payment rows and charges
/// map back to their key.
fn amount(i: usize) -> i64 {
    1000 + i as i64
}

/// Clients of one scenario: one task per key, each retrying until a 2xx or
/// its patience ends, every request recorded in `history`.
#[derive(Clone)]
pub struct Clients {
    pub scenario: &'static str,
    pub history: Arc<History>,
    http: reqwest::Client,
    /// Bound on one request: a request whose answer does not come in time
    /// is abandoned and retried, as a real client would.
    request_timeout: Duration,
}

impl Clients {
    pub fn new(scenario: &'static str, request_timeout: Duration) -> Self {
        Clients {
            scenario,
            history: Arc::new(History::new()),
            http: reqwest::Client::builder()
                .timeout(request_timeout)
                .build()
                .expect("http client"),
            request_timeout,
        }
    }

    /// One client per key in `keys` against `bases` (key `i` uses
    /// `bases[i % len]`), each giving up after `patience`.
    pub fn spawn(
        &self,
        bases: &[String],
        keys: std::ops::Range<usize>,
        patience: Duration,
    ) -> Vec<JoinHandle<()>> {
        keys.map(|i| {
            let (clients, base) = (self.clone(), bases[i % bases.len()].clone());
            tokio::spawn(async move { clients.pay(&base, i, patience).await })
        })
        .collect()
    }

    /// As `spawn`, but key number `n` of `keys` starts `n * gap` later:
    /// requests spread over a fault instead of all at its start.
    pub fn spawn_staggered(
        &self,
        bases: &[String],
        keys: std::ops::Range<usize>,
        gap: Duration,
        patience: Duration,
    ) -> Vec<JoinHandle<()>> {
        let first = keys.start;
        keys.map(|i| {
            let (clients, base) = (self.clone(), bases[i % bases.len()].clone());
            let delay = gap * (i - first) as u32;
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                clients.pay(&base, i, patience).await
            })
        })
        .collect()
    }

    /// A well-behaved client: POSTs key `i`'s payment until a 2xx, retrying
    /// on 409, 5xx and transport errors (a 4xx but 409 ends it).
    async fn pay(&self, base: &str, i: usize, patience: Duration) {
        let key = key(self.scenario, i);
        let body = json!({ "amount": amount(i), "currency": "EUR", "recipient": key });
        let deadline = Instant::now() + patience;
        for attempt in 1.. {
            let sent = self.history.now();
            let reply = self
                .http
                .post(format!("{base}/payments"))
                .header("idempotency-key", format!("\"{key}\""))
                .header("authorization", "Bearer tok_demo")
                .json(&body)
                .send()
                .await;
            let answer = match reply {
                Ok(reply) if reply.status().is_success() => {
                    let status = reply.status().as_u16();
                    match reply.json::<serde_json::Value>().await {
                        Ok(json) => match json["id"].as_i64() {
                            Some(payment) => Answer::Paid { status, payment },
                            None => Answer::Failed(format!("2xx without an id: {json}")),
                        },
                        Err(e) => Answer::Failed(format!("2xx body: {e}")),
                    }
                }
                Ok(reply) => Answer::Status(reply.status().as_u16()),
                Err(e) => Answer::Failed(e.to_string()),
            };
            let done = match &answer {
                Answer::Paid { .. } => true,
                Answer::Status(s) => (400..500).contains(s) && *s != 409,
                Answer::Failed(_) => false,
            };
            self.history.record(&key, attempt, sent, answer);
            if done || Instant::now() + self.request_timeout / 4 > deadline {
                return;
            }
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
    }
}

/// Waits for every client.
pub async fn collect(clients: Vec<JoinHandle<()>>) {
    for result in join_all(clients).await {
        result.expect("client task");
    }
}

/// What Postgres (at `database_url`) and Redis (`redis`: the servers whose
/// completed records count) hold for `keys` of `scenario`.
pub async fn observe(
    scenario: &str,
    keys: std::ops::Range<usize>,
    database_url: &str,
    redis: &[&NsRedis],
) -> Observed {
    let names: Vec<(usize, String)> = keys.map(|i| (i, key(scenario, i))).collect();
    let by_amount: BTreeMap<i64, String> =
        names.iter().map(|(i, k)| (amount(*i), k.clone())).collect();
    let client = idem_testkit::connect(database_url).await;
    let mut observed = Observed::default();
    for row in client
        .query("SELECT amount, id FROM payments", &[])
        .await
        .expect("read payments")
    {
        if let Some(key) = by_amount.get(&row.get::<_, i64>(0)) {
            observed
                .payments
                .entry(key.clone())
                .or_default()
                .push(row.get(1));
        }
    }
    for row in client
        .query(
            "SELECT amount, count(*) FROM processor_charges GROUP BY amount",
            &[],
        )
        .await
        .expect("read charges")
    {
        if let Some(key) = by_amount.get(&row.get::<_, i64>(0)) {
            let n: i64 = row.get(1);
            observed.charges.insert(key.clone(), n as u32);
        }
    }
    let mirror: Vec<String> = client
        .query(
            "SELECT key FROM idempotency_keys WHERE status = 'completed'",
            &[],
        )
        .await
        .expect("read the mirror")
        .iter()
        .map(|row| row.get(0))
        .collect();
    observed.mirrored = matching(&names, &mirror);
    let mut completed = Vec::new();
    for server in redis {
        completed.extend(redis_completed(server));
    }
    observed.redis_completed = matching(&names, &completed);
    observed
}

/// The client keys found inside `stored` keys.
fn matching(names: &[(usize, String)], stored: &[String]) -> BTreeSet<String> {
    names
        .iter()
        .filter(|(_, k)| stored.iter().any(|s| s.contains(k.as_str())))
        .map(|(_, k)| k.clone())
        .collect()
}

/// The keys `server` holds as completed (`IDEM.GET`'s `state`).
pub fn redis_completed(server: &NsRedis) -> Vec<String> {
    let keys: Vec<String> = server
        .query(redis::cmd("KEYS").arg("*"))
        .expect("KEYS on a test server");
    keys.into_iter()
        .filter(|key| {
            let fields: redis::RedisResult<Vec<redis::Value>> =
                server.query(redis::cmd("IDEM.GET").arg(key));
            let fields = fields.unwrap_or_default();
            fields.windows(2).any(|pair| {
                matches!((&pair[0], &pair[1]),
                    (redis::Value::BulkString(name), redis::Value::BulkString(value))
                        if name == b"state" && value == b"completed")
            })
        })
        .collect()
}

/// `observe` until Redis's completions are all mirrored or `timeout`
/// passes (the writer's time to catch up); the last observation.
pub async fn settle(
    scenario: &str,
    keys: std::ops::Range<usize>,
    database_url: &str,
    redis: &[&NsRedis],
    timeout: Duration,
) -> Observed {
    let deadline = Instant::now() + timeout;
    loop {
        let observed = observe(scenario, keys.clone(), database_url, redis).await;
        let behind = observed
            .redis_completed
            .difference(&observed.mirrored)
            .count();
        if behind == 0 || Instant::now() > deadline {
            return observed;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Prints how the requests were answered (by kind) and the end of the
/// API's log: what a failing scenario needs to be understood.
pub fn explain(clients: &Clients, api_log: &str) {
    let mut answers = BTreeMap::<String, usize>::new();
    for request in clients.history.requests() {
        let kind: String = format!("{:?}", request.answer).chars().take(160).collect();
        *answers.entry(kind).or_default() += 1;
    }
    eprintln!("{} answers: {answers:#?}", clients.scenario);
    let tail = api_log.len().saturating_sub(4000);
    let tail = (tail..api_log.len())
        .find(|i| api_log.is_char_boundary(*i))
        .unwrap_or(tail);
    eprintln!("payments-api log (end):\n{}", &api_log[tail..]);
}

/// Runs the operator's `idem remirror --since SINCE` (crates/idem-cli, built
/// next to `payments-api`) from Redis at `redis_url` into `database_url`;
/// its stdout, after asserting it succeeded.
pub fn remirror(since: std::time::SystemTime, redis_url: &str, database_url: &str) -> String {
    let api = std::path::Path::new(env!("CARGO_BIN_EXE_payments-api"));
    let idem = api.with_file_name("idem");
    assert!(
        idem.exists(),
        "{} is missing: cargo build --release -p idem-cli",
        idem.display()
    );
    let since_ms = since
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis()
        .to_string();
    let out = std::process::Command::new(&idem)
        .args(["remirror", "--since", &since_ms, "--redis", redis_url])
        .args(["--database", database_url])
        .env_remove("REDIS_URL")
        .env_remove("DATABASE_URL")
        .output()
        .expect("run idem remirror");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "idem remirror failed ({}):\n{stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}
