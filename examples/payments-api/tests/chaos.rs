//! Chaos test: the example service as real processes (with the writer), real
//! redis-server with the module and real Postgres, driven over HTTP by
//! well-behaved clients (an original and a retry per key, each retrying on
//! 409, 503 and connection errors) through the four ways Redis loses a key's
//! state. With the fence every key ends with exactly one payment, one charge
//! at the (simulated) processor and one payment id in all its 2xx answers;
//! with the fence off (the teeth) the same runs pay and charge twice.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use common::processes::{start_api, start_writer, ApiOptions};
use futures_util::future::join_all;
use idem_testkit::{PgDatabase, RedisConfig};
use serde_json::json;
use tokio::task::JoinHandle;

/// Keys per run; `IDEM_CHAOS_KEYS` sets another number.
const KEYS: usize = 12;
const PROCESSOR_DELAY: Duration = Duration::from_millis(1000);
/// Originals are inside the processor call this long after they were sent.
const INTO_THE_CALL: Duration = Duration::from_millis(300);
/// A client retrying on 409/503/connection errors gives up after this.
const CLIENT_PATIENCE: Duration = Duration::from_secs(30);
const CLIENT_BACKOFF: Duration = Duration::from_millis(200);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    /// FLUSHALL while the originals run; retries arrive.
    RedisForgetsInProgress,
    /// The writer is paused, the originals complete, FLUSHALL, retries arrive.
    RedisForgetsUnmirrored,
    /// redis-server (no AOF) is killed and restarted while the originals run.
    RedisRestarts,
    /// Two API instances: the one running the originals is frozen (SIGSTOP)
    /// inside the processor call, after the fence's first phase committed
    /// its claim, past its lease; the retries take the key over on the
    /// other, then it wakes and finds the key lost (its commit commits
    /// nothing).
    HolderFreezes,
}

/// What one run left behind.
#[derive(Debug)]
struct Tally {
    /// Keys with more than one payment row.
    doubled: usize,
    /// Keys charged more than once at the processor.
    double_charged: usize,
    /// Keys whose 2xx answers carry more than one payment id.
    inconsistent: usize,
    /// Keys with no payment at all.
    unpaid: usize,
    /// Client requests that ended without a 2xx (not a 409/503/conn error).
    failures: Vec<String>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_forgets_an_in_progress_record() {
    check(Scenario::RedisForgetsInProgress).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_forgets_completions_the_paused_writer_has_not_mirrored() {
    check(Scenario::RedisForgetsUnmirrored).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_is_killed_and_restarted_without_persistence() {
    check(Scenario::RedisRestarts).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_holder_freezes_past_its_lease_on_one_of_two_instances() {
    check(Scenario::HolderFreezes).await;
}

/// Runs `scenario` with the fence (no double payment, one id per key) and
/// without it (double payments must appear: the test has teeth).
async fn check(scenario: Scenario) {
    let fenced = run(scenario, true).await;
    println!("{scenario:?} with the fence: {fenced:?}");
    assert!(
        fenced.failures.is_empty(),
        "{scenario:?}: {:?}",
        fenced.failures
    );
    assert_eq!(
        (
            fenced.doubled,
            fenced.double_charged,
            fenced.inconsistent,
            fenced.unpaid
        ),
        (0, 0, 0, 0),
        "{scenario:?} with the fence: double payments, double charges, inconsistent ids, unpaid keys"
    );
    let unfenced = run(scenario, false).await;
    println!("{scenario:?} without the fence: {unfenced:?}");
    assert!(
        unfenced.doubled > 0 && unfenced.double_charged > 0,
        "{scenario:?} without the fence should pay and charge twice (teeth): {unfenced:?}"
    );
}

async fn run(scenario: Scenario, fence: bool) -> Tally {
    let mut redis = RedisConfig::default().start();
    let db = PgDatabase::create();
    let redis_url = redis.url();
    let options = ApiOptions {
        redis_url: &redis_url,
        database_url: &db.url,
        fence,
        processor_delay: PROCESSOR_DELAY,
        lease: match scenario {
            Scenario::HolderFreezes => Duration::from_millis(1000),
            _ => Duration::from_secs(30),
        },
    };
    let (api, base) = start_api(&options).await;
    let writer = start_writer(&redis_url, &db.url);
    let clients = Clients::new();

    let answers = match scenario {
        Scenario::RedisForgetsInProgress => {
            let originals = clients.spawn(&base);
            tokio::time::sleep(INTO_THE_CALL).await;
            flushall(&redis).await;
            let retries = clients.spawn(&base);
            [collect(originals).await, collect(retries).await].concat()
        }
        Scenario::RedisForgetsUnmirrored => {
            writer.freeze();
            let originals = collect(clients.spawn(&base)).await;
            flushall(&redis).await;
            let retries = collect(clients.spawn(&base)).await;
            writer.thaw();
            [originals, retries].concat()
        }
        Scenario::RedisRestarts => {
            let originals = clients.spawn(&base);
            tokio::time::sleep(INTO_THE_CALL).await;
            redis.kill();
            redis.restart();
            let retries = clients.spawn(&base);
            [collect(originals).await, collect(retries).await].concat()
        }
        Scenario::HolderFreezes => {
            let (other, other_base) = start_api(&options).await;
            let originals = clients.spawn(&base);
            tokio::time::sleep(INTO_THE_CALL).await;
            api.freeze();
            // Past the frozen holder's lease: Redis hands the key on.
            tokio::time::sleep(options.lease + Duration::from_millis(300)).await;
            let retries = clients.spawn(&other_base);
            tokio::time::sleep(PROCESSOR_DELAY + Duration::from_millis(500)).await;
            api.thaw();
            let answers = [collect(originals).await, collect(retries).await].concat();
            drop(other);
            answers
        }
    };
    let tally = tally(&db, answers).await;
    if !tally.failures.is_empty() {
        eprintln!("payments-api log:\n{}", api.log());
    }
    drop((api, writer));
    tally
}

async fn flushall(redis: &idem_testkit::RedisServer) {
    let mut conn = redis.async_conn().await;
    let _: () = redis::cmd("FLUSHALL")
        .query_async(&mut conn)
        .await
        .expect("FLUSHALL");
}

/// One answer a client ended with: the key's index and the payment id, or
/// what went wrong.
type Answer = (i64, Result<i64, String>);

struct Clients {
    http: reqwest::Client,
}

impl Clients {
    fn new() -> Self {
        Clients {
            http: reqwest::Client::builder()
                .timeout(CLIENT_PATIENCE)
                .build()
                .expect("http client"),
        }
    }

    /// One client per key, all at once, against `base`.
    fn spawn(&self, base: &str) -> Vec<JoinHandle<Answer>> {
        (0..keys())
            .map(|key| {
                let (http, base) = (self.http.clone(), base.to_string());
                tokio::spawn(async move { (key, pay(&http, &base, key).await) })
            })
            .collect()
    }
}

async fn collect(clients: Vec<JoinHandle<Answer>>) -> Vec<Answer> {
    join_all(clients)
        .await
        .into_iter()
        .map(|r| r.expect("client task"))
        .collect()
}

/// A well-behaved client: POSTs the key's payment until it gets a 2xx,
/// retrying on 409, 503 and connection errors; answers the payment id.
async fn pay(http: &reqwest::Client, base: &str, key: i64) -> Result<i64, String> {
    let body =
        json!({ "amount": 1000 + key, "currency": "EUR", "recipient": format!("chaos-{key}") });
    let deadline = Instant::now() + CLIENT_PATIENCE;
    loop {
        let sent = http
            .post(format!("{base}/payments"))
            .header("idempotency-key", format!("chaos-{key}"))
            .header("authorization", "Bearer tok_demo")
            .json(&body)
            .send()
            .await;
        match sent {
            Ok(reply) if reply.status().is_success() => {
                let json: serde_json::Value = reply.json().await.map_err(|e| e.to_string())?;
                return json["id"]
                    .as_i64()
                    .ok_or_else(|| format!("2xx without an id: {json}"));
            }
            Ok(reply) if matches!(reply.status().as_u16(), 409 | 503) => {}
            Ok(reply) => {
                let status = reply.status();
                let text = reply.text().await.unwrap_or_default();
                return Err(format!("key {key}: {status} {text}"));
            }
            Err(_) => {} // connection refused or reset: retry
        }
        if Instant::now() > deadline {
            return Err(format!("key {key}: no 2xx within {CLIENT_PATIENCE:?}"));
        }
        tokio::time::sleep(CLIENT_BACKOFF).await;
    }
}

async fn tally(db: &PgDatabase, answers: Vec<Answer>) -> Tally {
    let client = db.connect().await;
    let rows = client
        .query(
            "SELECT amount - 1000, count(*) FROM payments GROUP BY amount",
            &[],
        )
        .await
        .expect("count payments");
    let payments: HashMap<i64, i64> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let double_charged = client
        .query(
            "SELECT amount FROM processor_charges GROUP BY amount HAVING count(*) > 1",
            &[],
        )
        .await
        .expect("count charges")
        .len();
    let mut ids: HashMap<i64, BTreeSet<i64>> = HashMap::new();
    let mut failures = Vec::new();
    for (key, answer) in answers {
        match answer {
            Ok(id) => {
                ids.entry(key).or_default().insert(id);
            }
            Err(err) => failures.push(err),
        }
    }
    Tally {
        doubled: payments.values().filter(|n| **n > 1).count(),
        double_charged,
        inconsistent: ids.values().filter(|set| set.len() > 1).count(),
        unpaid: (0..keys()).filter(|k| !payments.contains_key(k)).count(),
        failures,
    }
}

fn keys() -> i64 {
    let keys = std::env::var("IDEM_CHAOS_KEYS").map_or(KEYS, |v| {
        v.parse()
            .unwrap_or_else(|_| panic!("IDEM_CHAOS_KEYS={v}: a whole number, please"))
    });
    i64::try_from(keys).expect("a key count")
}
