//! The fence at production latency (issue 28): the example API with the
//! fence against the same API without it, at simulated processor latencies
//! of 0, 50 and 200 ms, 200 concurrent clients on fresh keys, the default
//! pool (16 connections), served in-process on real TCP with the layer and
//! read-through as `payments-api` ships them; rounds alternate the two.
//! Prints requests per second (201s), p50/p99 latency, Postgres connections
//! checked out of the pool per request in flight (sampled every 5 ms), and
//! non-2xx answers, with the ratios against their targets.
//!
//! Settings (env): BENCH_SECONDS per variant and round (4), BENCH_ROUNDS
//! (2), BENCH_CONCURRENCY (200), BENCH_DELAYS_MS (0,50,200). Needs
//! redis-server, the built module and Postgres, like the tests.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use deadpool_postgres::Pool;
use idem_client::Transport;
use idem_example_payments::{app, db, idempotency_layer, serve, AppState, Settings};
use idem_testkit::{PgDatabase, RedisConfig};
use tokio::sync::oneshot;

#[derive(Default)]
struct Measured {
    latencies_us: Vec<u64>,
    elapsed: Duration,
    others: BTreeMap<String, u64>,
    /// Sum over samples of connections checked out, and the sample count.
    busy: (u64, u64),
}

impl Measured {
    fn absorb(&mut self, other: Measured) {
        self.latencies_us.extend(other.latencies_us);
        self.elapsed += other.elapsed;
        for (status, n) in other.others {
            *self.others.entry(status).or_default() += n;
        }
        self.busy.0 += other.busy.0;
        self.busy.1 += other.busy.1;
    }

    fn throughput(&self) -> f64 {
        self.latencies_us.len() as f64 / self.elapsed.as_secs_f64()
    }

    fn percentile_ms(&mut self, p: f64) -> f64 {
        if self.latencies_us.is_empty() {
            return f64::NAN;
        }
        self.latencies_us.sort_unstable();
        let index = ((self.latencies_us.len() as f64 - 1.0) * p).round() as usize;
        self.latencies_us[index] as f64 / 1000.0
    }

    fn busy_per_request(&self, concurrency: usize) -> f64 {
        self.busy.0 as f64 / self.busy.1.max(1) as f64 / concurrency as f64
    }

    fn others(&self) -> String {
        if self.others.is_empty() {
            return "none".into();
        }
        self.others
            .iter()
            .map(|(status, n)| format!("{n} x {status}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn server_errors(&self) -> u64 {
        self.others
            .iter()
            .filter(|(status, _)| status.starts_with('5') || status.as_str() == "error")
            .map(|(_, n)| n)
            .sum()
    }
}

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> anyhow::Result<()> {
    let server = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let load = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    load.block_on(run(server.handle().clone()))
}

async fn run(server: tokio::runtime::Handle) -> anyhow::Result<()> {
    let seconds = env_number("BENCH_SECONDS", 4);
    let rounds = env_number("BENCH_ROUNDS", 2);
    let concurrency = env_number("BENCH_CONCURRENCY", 200) as usize;
    let delays: Vec<u64> = std::env::var("BENCH_DELAYS_MS")
        .unwrap_or_else(|_| "0,50,200".into())
        .split(',')
        .map(|d| d.trim().parse())
        .collect::<Result<_, _>>()?;
    // The service's defaults, as `payments-api` reads them.
    let defaults = Settings::from_lookup(|name| (name == "DATABASE_URL").then(|| "x".into()))?;

    let redis = RedisConfig::default().start();
    let database = PgDatabase::create();
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()?;
    let sequence = AtomicU64::new(0);
    println!(
        "{concurrency} clients, fresh keys, pool {} per variant, {rounds} x {seconds} s per variant and latency",
        defaults.pool_size
    );
    println!(
        "{:>6} | {:<9} | {:>8} | {:>8} | {:>8} | {:>12} | other answers",
        "delay", "fence", "req/s", "p50 ms", "p99 ms", "pg conn/req"
    );
    let mut verdicts = Vec::new();
    for delay_ms in delays {
        let delay = Duration::from_millis(delay_ms);
        let mut bases = Vec::new();
        let mut pools = Vec::new();
        let mut stops = Vec::new();
        for fence in [false, true] {
            let pool = db::pool(&database.url, defaults.pool_size)?;
            let redis_url = redis.url();
            let layer = {
                let pool = pool.clone();
                server
                    .spawn(async move {
                        db::migrate(&pool).await?;
                        idempotency_layer(&redis_url, Some(pool), Transport::Pipe).await
                    })
                    .await??
            };
            let state = AppState::new(pool.clone())
                .with_fence(fence)
                .with_processor_delay(delay);
            let router = app(state, layer.lease(defaults.lease));
            let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
            listener.set_nonblocking(true)?;
            bases.push(format!("http://{}/payments", listener.local_addr()?));
            let (stop, stopped) = oneshot::channel::<()>();
            server.spawn(async move {
                let listener = tokio::net::TcpListener::from_std(listener)?;
                serve(listener, router, async move {
                    let _ = stopped.await;
                })
                .await
            });
            stops.push(stop);
            pools.push(pool);
        }
        // Warm both (connections, statements) before measuring.
        for base in &bases {
            load(
                &http,
                base,
                &pools[0],
                16,
                Duration::from_millis(500),
                &sequence,
            )
            .await;
        }
        let mut measured = [Measured::default(), Measured::default()];
        for _ in 0..rounds {
            for (i, base) in bases.iter().enumerate() {
                let m = load(
                    &http,
                    base,
                    &pools[i],
                    concurrency,
                    Duration::from_secs(seconds),
                    &sequence,
                )
                .await;
                measured[i].absorb(m);
            }
        }
        let [mut off, mut on] = measured;
        for (name, m) in [("off", &mut off), ("on", &mut on)] {
            println!(
                "{:>6} | {:<9} | {:>8.0} | {:>8.1} | {:>8.1} | {:>12.3} | {}",
                format!("{delay_ms} ms"),
                name,
                m.throughput(),
                m.percentile_ms(0.50),
                m.percentile_ms(0.99),
                m.busy_per_request(concurrency),
                m.others()
            );
        }
        let ratio = on.throughput() / off.throughput();
        let p99 = on.percentile_ms(0.99) / off.percentile_ms(0.99);
        let (throughput_target, p99_target) = match delay_ms {
            0 => (Some(0.8), None),
            200 => (Some(0.9), Some(1.25)),
            _ => (None, None),
        };
        verdicts.push(format!(
            "{delay_ms:>4} ms: fenced/unfenced throughput {ratio:.2}x{}, p99 {p99:.2}x{}, 5xx with the fence {}",
            throughput_target.map_or(String::new(), |t| format!(
                " (target >= {t}x: {})",
                if ratio >= t { "met" } else { "NOT met" }
            )),
            p99_target.map_or(String::new(), |t| format!(
                " (target <= {t}x: {})",
                if p99 <= t { "met" } else { "NOT met" }
            )),
            on.server_errors()
        ));
        for stop in stops {
            let _ = stop.send(());
        }
    }
    println!();
    for verdict in verdicts {
        println!("{verdict}");
    }
    Ok(())
}

/// `concurrency` clients posting fresh keys for `duration`, while the
/// pool's checked-out connections are sampled every 5 ms.
async fn load(
    http: &reqwest::Client,
    base: &str,
    pool: &Pool,
    concurrency: usize,
    duration: Duration,
    sequence: &AtomicU64,
) -> Measured {
    let started = Instant::now();
    let deadline = started + duration;
    let workers = (0..concurrency).map(|_| async move {
        let mut latencies = Vec::new();
        let mut others: BTreeMap<String, u64> = BTreeMap::new();
        while Instant::now() < deadline {
            let key = format!("fb-{}", sequence.fetch_add(1, Ordering::Relaxed));
            let sent = Instant::now();
            match post(http, base, &key).await {
                Some(201) => latencies.push(sent.elapsed().as_micros() as u64),
                Some(status) => *others.entry(status.to_string()).or_default() += 1,
                None => *others.entry("error".into()).or_default() += 1,
            }
        }
        (latencies, others)
    });
    let sampler = async {
        let mut busy = (0u64, 0u64);
        while Instant::now() < deadline {
            let status = pool.status();
            busy.0 += status.size.saturating_sub(status.available) as u64;
            busy.1 += 1;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        busy
    };
    let (results, busy) = tokio::join!(futures_util::future::join_all(workers), sampler);
    let mut measured = Measured {
        elapsed: started.elapsed(),
        busy,
        ..Measured::default()
    };
    for (latencies, others) in results {
        measured.latencies_us.extend(latencies);
        for (status, n) in others {
            *measured.others.entry(status).or_default() += n;
        }
    }
    measured
}

async fn post(http: &reqwest::Client, url: &str, key: &str) -> Option<u16> {
    let response = http
        .post(url)
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(r#"{"amount":1250,"currency":"EUR","recipient":"acct_bench"}"#)
        .send()
        .await
        .ok()?;
    let status = response.status().as_u16();
    response.bytes().await.ok()?;
    Some(status)
}
