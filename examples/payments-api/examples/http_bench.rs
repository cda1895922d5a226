//! HTTP load generator: the payments API without the idempotency layer, with
//! it (read-through off), with it and the Postgres fence, the same two with
//! read-through on, and replays of one key, served in-process on real TCP and
//! measured in one run, rounds interleaved. Every request carries a fresh key
//! (except the replay variant). Prints throughput ratios, added p50/p99
//! latency, and CPU per request of the server (its own runtime's threads),
//! of the load generator, and of redis-server.
//!
//! Settings (env): BENCH_SECONDS per variant and round (2), BENCH_ROUNDS (5),
//! BENCH_CONCURRENCY (32), BENCH_VARIANTS (all of plain,layer,fence,
//! read-through,fence-read-through,replay; a subset is for profiling),
//! BENCH_TRANSPORT (how the layer reaches Redis: pipe, the default, or
//! manager for redis-rs' `ConnectionManager`). Besides the totals, the median over rounds of the
//! per-round throughput ratio is printed: it resists bursts of load from
//! other processes on the machine. Needs redis-server, the built module and Postgres
//! (DATABASE_URL or the local one), like the tests.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_client::Transport;
use idem_example_payments::{app, db, idempotency_layer, routes, serve, AppState};
use idem_testkit::{PgDatabase, RedisConfig};
use tokio::sync::oneshot;

/// The service's allocator, as in `payments-api` (feature `mimalloc`).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Variant {
    Plain,
    Layer,
    Fence,
    LayerReadThrough,
    FenceReadThrough,
    Replay,
}

impl Variant {
    const ALL: [Variant; 6] = [
        Variant::Plain,
        Variant::Layer,
        Variant::Fence,
        Variant::LayerReadThrough,
        Variant::FenceReadThrough,
        Variant::Replay,
    ];

    fn name(self) -> &'static str {
        match self {
            Variant::Plain => "plain",
            Variant::Layer => "layer",
            Variant::Fence => "fence",
            Variant::LayerReadThrough => "read-through",
            Variant::FenceReadThrough => "fence-read-through",
            Variant::Replay => "replay",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Variant::Plain => "without layer",
            Variant::Layer => "layer, read-through off",
            Variant::Fence => "layer + fence, r-t off",
            Variant::LayerReadThrough => "layer, read-through on",
            Variant::FenceReadThrough => "layer + fence, r-t on",
            Variant::Replay => "layer, replay of one key",
        }
    }

    fn index(self) -> usize {
        Variant::ALL
            .iter()
            .position(|v| *v == self)
            .expect("listed")
    }
}

#[derive(Default)]
struct Measured {
    latencies_us: Vec<u64>,
    elapsed: Duration,
    errors: u64,
    /// CPU seconds used meanwhile by the server's threads, by the rest of
    /// this process (the load generator), and by redis-server.
    cpu_app: f64,
    cpu_load: f64,
    cpu_redis: f64,
}

impl Measured {
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
}

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Name of the server runtime's threads, whose CPU time is the app's.
const SERVER_THREAD: &str = "bench-server";

fn main() -> anyhow::Result<()> {
    // The servers run on a runtime of their own (as many workers as the
    // default one) so that their CPU time is told apart from the load
    // generator's.
    let server = tokio::runtime::Builder::new_multi_thread()
        .thread_name(SERVER_THREAD)
        .enable_all()
        .build()?;
    let load = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    load.block_on(run(server.handle().clone()))
}

async fn run(server: tokio::runtime::Handle) -> anyhow::Result<()> {
    let seconds = env_number("BENCH_SECONDS", 2);
    let rounds = env_number("BENCH_ROUNDS", 5);
    let concurrency = env_number("BENCH_CONCURRENCY", 32) as usize;

    // BENCH_REDIS=unix reaches Redis over a Unix socket (a sidecar on the
    // same host) instead of loopback TCP.
    let over_unix = std::env::var("BENCH_REDIS").is_ok_and(|v| v == "unix");
    let socket_dir = idem_testkit::scratch_dir("bench-sock");
    let socket = socket_dir.join("redis.sock");
    let mut redis_config = RedisConfig::default();
    if over_unix {
        redis_config = redis_config
            .server_arg("unixsocket", &socket.display().to_string())
            .server_arg("unixsocketperm", "700");
    }
    let redis = redis_config.start();
    let redis_url = if over_unix {
        format!("redis+unix://{}", socket.display())
    } else {
        redis.url()
    };
    let database = PgDatabase::create();
    let pool = db::pool(&database.url, 32)?;
    // Connections to Redis and Postgres drive their sockets in tasks spawned
    // where they are made: on the server runtime.
    let transport = match std::env::var("BENCH_TRANSPORT").as_deref() {
        Ok("manager") => Transport::Manager,
        Ok("pipe") | Err(_) => Transport::Pipe,
        Ok(other) => anyhow::bail!("BENCH_TRANSPORT={other}: pipe or manager"),
    };
    let (layer, layer_read_through) = {
        let (pool, redis_url) = (pool.clone(), redis_url.clone());
        server
            .spawn(async move {
                db::migrate(&pool).await?;
                anyhow::Ok((
                    idempotency_layer(&redis_url, None, transport).await?,
                    idempotency_layer(&redis_url, Some(pool), transport).await?,
                ))
            })
            .await??
    };
    let unfenced = AppState::new(pool.clone()).with_fence(false);
    let fenced = AppState::new(pool.clone()).with_fence(true);

    // In the order of Variant::ALL.
    let layered = app(unfenced.clone(), layer.clone());
    let routers = [
        routes(unfenced.clone()),
        layered.clone(),
        app(fenced.clone(), layer),
        app(unfenced, layer_read_through.clone()),
        app(fenced, layer_read_through),
        layered,
    ];
    let mut stops = Vec::new();
    let mut bases = Vec::new();
    for router in routers {
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
    }

    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()?;
    // The one key every replay request repeats.
    let seeded = post(&http, &bases[Variant::Replay.index()], Some("bench-replay")).await;
    anyhow::ensure!(seeded == Some(201), "seeding the replay key: {seeded:?}");

    println!(
        "HTTP bench: {concurrency} concurrent clients, {rounds} rounds x {seconds} s per variant, \
         POST /payments (one INSERT per new request), Redis over {}",
        if over_unix {
            "a Unix socket"
        } else {
            "loopback TCP"
        }
    );
    let mut results: Vec<Measured> = Variant::ALL.iter().map(|_| Measured::default()).collect();
    let selected = std::env::var("BENCH_VARIANTS").unwrap_or_default();
    let selected: Vec<&str> = selected.split(',').filter(|s| !s.is_empty()).collect();
    let wanted = |variant: Variant| selected.is_empty() || selected.contains(&variant.name());
    // Per variant, the throughput of each round.
    let mut round_rps: Vec<Vec<f64>> = Variant::ALL.iter().map(|_| Vec::new()).collect();
    let sequence = AtomicU64::new(0);
    for round in 0..rounds {
        for (index, variant) in Variant::ALL.into_iter().enumerate() {
            if !wanted(variant) {
                continue;
            }
            // Warm-up, not counted.
            let _ = load(
                &http,
                &bases[index],
                variant,
                concurrency,
                Duration::from_millis(300),
                &sequence,
            )
            .await;
            let (app_before, all_before, redis_before) =
                (server_cpu(), process_cpu(), redis_cpu(&redis_url).await);
            let mut measured = load(
                &http,
                &bases[index],
                variant,
                concurrency,
                Duration::from_secs(seconds),
                &sequence,
            )
            .await;
            measured.cpu_app = server_cpu() - app_before;
            measured.cpu_load = process_cpu() - all_before - measured.cpu_app;
            measured.cpu_redis = redis_cpu(&redis_url).await - redis_before;
            eprintln!(
                "  round {} {:<26} {:>8.0} req/s",
                round + 1,
                variant.label(),
                measured.throughput()
            );
            round_rps[index].push(measured.throughput());
            let total = &mut results[index];
            total.latencies_us.extend(measured.latencies_us);
            total.elapsed += measured.elapsed;
            total.errors += measured.errors;
            total.cpu_app += measured.cpu_app;
            total.cpu_load += measured.cpu_load;
            total.cpu_redis += measured.cpu_redis;
        }
    }

    println!(
        "\n{:<26} {:>10} {:>9} {:>9} {:>7} {:>10} {:>10} {:>10}",
        "variant", "req/s", "p50 ms", "p99 ms", "errors", "app us/r", "load us/r", "redis us/r"
    );
    let mut figures = Vec::new();
    for (variant, measured) in Variant::ALL.iter().zip(results.iter_mut()) {
        let (rps, p50, p99) = (
            measured.throughput(),
            measured.percentile_ms(0.50),
            measured.percentile_ms(0.99),
        );
        let requests = measured.latencies_us.len().max(1) as f64;
        println!(
            "{:<26} {:>10.0} {:>9.2} {:>9.2} {:>7} {:>10.1} {:>10.1} {:>10.1}",
            variant.label(),
            rps,
            p50,
            p99,
            measured.errors,
            measured.cpu_app / requests * 1e6,
            measured.cpu_load / requests * 1e6,
            measured.cpu_redis / requests * 1e6
        );
        figures.push((rps, p50, p99));
    }
    // Throughput of `a` relative to `b`: overall, and the median of the
    // per-round ratios.
    let ratio = |a: Variant, b: Variant| {
        let (a, b) = (a.index(), b.index());
        let mut per_round: Vec<f64> = round_rps[a]
            .iter()
            .zip(&round_rps[b])
            .map(|(x, y)| x / y)
            .collect();
        (figures[a].0 / figures[b].0, median(&mut per_round))
    };
    println!();
    for (variant, name, target) in [
        (
            Variant::Layer,
            "layer (read-through off)",
            "; target >= 0.8x",
        ),
        (Variant::LayerReadThrough, "layer (read-through on)", ""),
        (Variant::Fence, "layer + fence (read-through off)", ""),
        (
            Variant::FenceReadThrough,
            "layer + fence (read-through on)",
            "",
        ),
    ] {
        let (overall, rounds) = ratio(variant, Variant::Plain);
        let (_, p50, p99) = figures[variant.index()];
        let (_, base_p50, base_p99) = figures[0];
        println!(
            "{name}: throughput {overall:.2}x of without (median of rounds {rounds:.2}x{target}), \
             added latency p50 {:+.2} ms, p99 {:+.2} ms",
            p50 - base_p50,
            p99 - base_p99
        );
    }
    for (fence, layer, name) in [
        (Variant::Fence, Variant::Layer, "read-through off"),
        (
            Variant::FenceReadThrough,
            Variant::LayerReadThrough,
            "read-through on",
        ),
    ] {
        let (overall, rounds) = ratio(fence, layer);
        println!(
            "fence vs the same layer without it ({name}): throughput {overall:.2}x \
             (median of rounds {rounds:.2}x; target >= 0.85x), added latency p50 {:+.2} ms, p99 {:+.2} ms",
            figures[fence.index()].1 - figures[layer.index()].1,
            figures[fence.index()].2 - figures[layer.index()].2
        );
    }
    println!(
        "replay of one key: {:.2}x the throughput of a new payment without the layer",
        ratio(Variant::Replay, Variant::Plain).0
    );
    let rows: i64 = pool
        .get()
        .await?
        .query_one("SELECT count(*) FROM payments", &[])
        .await?
        .get(0);
    println!("payments rows written: {rows}");

    for stop in stops {
        let _ = stop.send(());
    }
    let _ = std::fs::remove_dir_all(&socket_dir);
    Ok(())
}

/// CPU seconds (user + system) this process has used so far, its exited
/// threads included (10 ms ticks).
fn process_cpu() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return f64::NAN;
    };
    // Fields after the command name: utime and stime are the 12th and 13th.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks: f64 = fields
        .get(11..13)
        .map(|t| t.iter().filter_map(|v| v.parse::<f64>().ok()).sum())
        .unwrap_or(f64::NAN);
    ticks / 100.0
}

/// CPU seconds the server runtime's threads have used so far (`schedstat`,
/// in nanoseconds; its workers live as long as the bench).
fn server_cpu() -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return f64::NAN;
    };
    let mut ns = 0.0;
    for task in tasks.flatten() {
        let path = task.path();
        let is_server = std::fs::read_to_string(path.join("comm"))
            .is_ok_and(|comm| comm.trim_end() == SERVER_THREAD);
        if is_server {
            let stat = std::fs::read_to_string(path.join("schedstat")).ok();
            ns += stat
                .and_then(|text| first_number(&text))
                .unwrap_or(f64::NAN);
        }
    }
    ns / 1e9
}

fn first_number(text: &str) -> Option<f64> {
    text.split_whitespace().next()?.parse().ok()
}

/// CPU seconds redis-server has used so far (`INFO cpu`).
async fn redis_cpu(url: &str) -> f64 {
    let info: redis::RedisResult<String> = async {
        let client = redis::Client::open(url)?;
        let mut conn = client.get_multiplexed_async_connection().await?;
        redis::cmd("INFO").arg("cpu").query_async(&mut conn).await
    }
    .await;
    let Ok(info) = info else {
        return f64::NAN;
    };
    info.lines()
        .filter(|line| line.starts_with("used_cpu_user:") || line.starts_with("used_cpu_sys:"))
        .filter_map(|line| line.split_once(':')?.1.trim().parse::<f64>().ok())
        .sum()
}

fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

/// `concurrency` workers posting for `duration`; fresh keys unless replaying.
async fn load(
    http: &reqwest::Client,
    base: &str,
    variant: Variant,
    concurrency: usize,
    duration: Duration,
    sequence: &AtomicU64,
) -> Measured {
    let started = Instant::now();
    let deadline = started + duration;
    let errors = Arc::new(AtomicU64::new(0));
    let workers = (0..concurrency).map(|_| {
        let errors = errors.clone();
        async move {
            let mut latencies = Vec::new();
            while Instant::now() < deadline {
                let key = match variant {
                    Variant::Plain => None,
                    Variant::Replay => Some("bench-replay".to_string()),
                    _ => Some(format!(
                        "bench-{}",
                        sequence.fetch_add(1, Ordering::Relaxed)
                    )),
                };
                let sent = Instant::now();
                let status = post(http, base, key.as_deref()).await;
                if status == Some(201) {
                    latencies.push(sent.elapsed().as_micros() as u64);
                } else {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
            }
            latencies
        }
    });
    let latencies_us = futures_util::future::join_all(workers)
        .await
        .into_iter()
        .flatten()
        .collect();
    Measured {
        latencies_us,
        elapsed: started.elapsed(),
        errors: errors.load(Ordering::Relaxed),
        ..Measured::default()
    }
}

async fn post(http: &reqwest::Client, url: &str, key: Option<&str>) -> Option<u16> {
    let mut request = http
        .post(url)
        .header("content-type", "application/json")
        .header("authorization", "Bearer tok_demo")
        .body(r#"{"amount":1250,"currency":"EUR","recipient":"acct_bench"}"#);
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let response = request.send().await.ok()?;
    let status = response.status().as_u16();
    response.bytes().await.ok()?;
    Some(status)
}
