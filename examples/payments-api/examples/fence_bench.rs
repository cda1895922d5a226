//! The fence at production latency (issue 28): the example API with the
//! fence against the same API without it, at simulated processor latencies
//! of 0, 50 and 200 ms, 200 concurrent clients on fresh keys, the default
//! pool (16 connections), served in-process on real TCP with the layer and
//! read-through as `payments-api` ships them; rounds alternate the two.
//! Prints requests per second (201s), p50/p99 latency, Postgres connections
//! checked out of the pool per request in flight (sampled every 5 ms),
//! non-2xx answers, and CPU time per request by process (this process: the
//! API and the load; redis-server; the Postgres backends of the bench's
//! database; the writer), with the ratios against their targets.
//!
//! Both variants run as the stack ships: with the mirror writer
//! (`idem-writer run`, built next to this example), which writes every
//! response the unfenced API stores into `idempotency_keys`; the fenced
//! API's rows are written by the fence itself (its Redis COMPLETE is
//! `MIRRORED`), so the writer has nothing to do for them.
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

/// CPU time used (user + system), in seconds, per process.
#[derive(Default, Clone, Copy)]
struct Cpu {
    /// This process: the API (both variants' servers; one runs at a time)
    /// and the load.
    app: f64,
    redis: f64,
    postgres: f64,
    writer: f64,
}

impl Cpu {
    fn total(&self) -> f64 {
        self.app + self.redis + self.postgres + self.writer
    }
}

#[derive(Default)]
struct Measured {
    latencies_us: Vec<u64>,
    elapsed: Duration,
    others: BTreeMap<String, u64>,
    /// Sum over samples of connections checked out, and the sample count.
    busy: (u64, u64),
    cpu: Cpu,
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
        self.cpu.app += other.cpu.app;
        self.cpu.redis += other.cpu.redis;
        self.cpu.postgres += other.cpu.postgres;
        self.cpu.writer += other.cpu.writer;
    }

    /// CPU milliseconds per 201, by process.
    fn cpu_per_request_ms(&self) -> Cpu {
        let n = self.latencies_us.len().max(1) as f64 / 1000.0;
        Cpu {
            app: self.cpu.app / n,
            redis: self.cpu.redis / n,
            postgres: self.cpu.postgres / n,
            writer: self.cpu.writer / n,
        }
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
    {
        let pool = db::pool(&database.url, 1)?;
        server
            .spawn(async move { db::migrate(&pool).await })
            .await??;
    }
    let writer = Writer::start(&redis.url(), &database.url)?;
    let meter = Meter {
        redis: redis::Client::open(redis.url())?,
        database: db::pool(&database.url, 1)?,
        writer_pid: writer.pid(),
        ticks_per_second: ticks_per_second(),
    };
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()?;
    let sequence = AtomicU64::new(0);
    println!(
        "{concurrency} clients, fresh keys, pool {} per variant, {rounds} x {seconds} s per variant and latency",
        defaults.pool_size
    );
    println!(
        "{:>6} | {:<5} | {:>6} | {:>6} | {:>6} | {:>11} | {:>29} | other answers",
        "delay",
        "fence",
        "req/s",
        "p50 ms",
        "p99 ms",
        "pg conn/req",
        "CPU ms/req: api redis pg wr ="
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
            let router = app(state, layer.lease(defaults.lease).claim_up_front(fence));
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
                // The writer catches up between windows: each is charged
                // what it made the writer do.
                meter.settle().await?;
                let before = meter.read().await?;
                let mut m = load(
                    &http,
                    base,
                    &pools[i],
                    concurrency,
                    Duration::from_secs(seconds),
                    &sequence,
                )
                .await;
                meter.settle().await?;
                let after = meter.read().await?;
                m.cpu = Cpu {
                    app: after.app - before.app,
                    redis: after.redis - before.redis,
                    postgres: after.postgres - before.postgres,
                    writer: after.writer - before.writer,
                };
                measured[i].absorb(m);
            }
        }
        let [mut off, mut on] = measured;
        for (name, m) in [("off", &mut off), ("on", &mut on)] {
            let cpu = m.cpu_per_request_ms();
            println!(
                "{:>6} | {:<5} | {:>6.0} | {:>6.1} | {:>6.1} | {:>11.3} | {:>4.2} {:>4.2} {:>4.2} {:>4.2} = {:>4.2} | {}",
                format!("{delay_ms} ms"),
                name,
                m.throughput(),
                m.percentile_ms(0.50),
                m.percentile_ms(0.99),
                m.busy_per_request(concurrency),
                cpu.app,
                cpu.redis,
                cpu.postgres,
                cpu.writer,
                cpu.total(),
                m.others()
            );
        }
        let ratio = on.throughput() / off.throughput();
        let cpu_ratio = on.cpu_per_request_ms().total() / off.cpu_per_request_ms().total();
        let p99 = on.percentile_ms(0.99) / off.percentile_ms(0.99);
        let (throughput_target, p99_target) = match delay_ms {
            0 => (Some(0.8), None),
            200 => (Some(0.9), Some(1.25)),
            _ => (None, None),
        };
        verdicts.push(format!(
            "{delay_ms:>4} ms: fenced/unfenced throughput {ratio:.2}x{}, p99 {p99:.2}x{}, CPU per request {cpu_ratio:.2}x, 5xx with the fence {}",
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

/// The mirror writer as `scripts/up.sh` runs it, killed on drop.
struct Writer(std::process::Child);

impl Writer {
    fn start(redis_url: &str, database_url: &str) -> anyhow::Result<Writer> {
        let binary = std::env::current_exe()?
            .parent()
            .and_then(|examples| examples.parent())
            .map(|release| release.join("idem-writer"))
            .ok_or_else(|| anyhow::anyhow!("no directory above this example"))?;
        anyhow::ensure!(
            binary.exists(),
            "{} is missing: cargo build --release -p idem-writer",
            binary.display()
        );
        let child = std::process::Command::new(binary)
            .args(["run", "--redis", redis_url, "--database-url", database_url])
            .env_remove("REDIS_URL")
            .env_remove("DATABASE_URL")
            .env("RUST_LOG", "warn")
            .spawn()?;
        Ok(Writer(child))
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Reads the CPU time each process of the stack has used.
struct Meter {
    redis: redis::Client,
    database: Pool,
    writer_pid: u32,
    ticks_per_second: f64,
}

impl Meter {
    async fn read(&self) -> anyhow::Result<Cpu> {
        let mut redis = self.redis.get_multiplexed_async_connection().await?;
        let info: String = redis::cmd("INFO")
            .arg("cpu")
            .query_async(&mut redis)
            .await?;
        let field = |name: &str| -> f64 {
            info.lines()
                .find_map(|line| {
                    line.strip_prefix(name)?
                        .strip_prefix(':')?
                        .trim()
                        .parse()
                        .ok()
                })
                .unwrap_or(0.0)
        };
        let client = self.database.get().await?;
        // Every backend of the bench's database, this one included (the
        // pools keep theirs for the whole run).
        let pids = client
            .query(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database()",
                &[],
            )
            .await?;
        let postgres = pids
            .iter()
            .map(|row| self.process_cpu(row.get::<_, i32>(0) as u32))
            .sum();
        Ok(Cpu {
            app: self.process_cpu(std::process::id()),
            redis: field("used_cpu_user") + field("used_cpu_sys"),
            postgres,
            writer: self.process_cpu(self.writer_pid),
        })
    }

    /// Waits until the writer has nothing pending (at most 10 s).
    async fn settle(&self) -> anyhow::Result<()> {
        let mut redis = self.redis.get_multiplexed_async_connection().await?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            let info: String = redis::cmd("INFO")
                .arg("idem")
                .query_async(&mut redis)
                .await?;
            let pending = info
                .lines()
                .find_map(|line| line.strip_prefix("idem_mirror_pending:"))
                .and_then(|v| v.trim().parse::<u64>().ok());
            if pending == Some(0) {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// User + system CPU seconds of `pid` (0 when it is gone).
    fn process_cpu(&self, pid: u32) -> f64 {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            return 0.0;
        };
        // Fields after the command (in parentheses, which may hold spaces):
        // utime and stime are the 12th and 13th.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            return 0.0;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let ticks: f64 = [11, 12]
            .iter()
            .filter_map(|&i| fields.get(i)?.parse::<f64>().ok())
            .sum();
        ticks / self.ticks_per_second
    }
}

/// The kernel's clock ticks per second (`getconf CLK_TCK`; 100 on Linux).
fn ticks_per_second() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok()?.trim().parse().ok())
        .unwrap_or(100.0)
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
        .header("authorization", "Bearer tok_demo")
        .body(r#"{"amount":1250,"currency":"EUR","recipient":"acct_bench"}"#)
        .send()
        .await
        .ok()?;
    let status = response.status().as_u16();
    response.bytes().await.ok()?;
    Some(status)
}
