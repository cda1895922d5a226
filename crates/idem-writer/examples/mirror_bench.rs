//! Mirror benchmark: writer throughput against the raw cost of the same
//! upserts issued straight to Postgres (same run, same rows), and the lag
//! from COMPLETE to the committed row at a steady completion rate.
//! Run through `scripts/bench-mirror.sh`. With `--functions` the server
//! runs the Functions library instead of the module (no throughput rounds:
//! only the lag phase, completing through FCALL).

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::Parser;
use futures_util::StreamExt;
use idem_testkit::{PgDatabase, RedisConfig, RedisServer};
use idem_writer::store::{upsert_records, UPSERT_SQL};
use idem_writer::{MirrorRecord, WriterConfig};
use rand::RngExt;
use redis::aio::MultiplexedConnection;
use redis::Value;
use sha2::{Digest, Sha256};
use tokio_postgres::AsyncMessage;

#[derive(Parser)]
#[command(about = "Mirror throughput vs raw upserts, and COMPLETE → row lag")]
struct Args {
    /// Rows per throughput round.
    #[arg(long, default_value_t = 50_000)]
    rows: usize,
    /// Response body size in bytes.
    #[arg(long, default_value_t = 256)]
    body_bytes: usize,
    /// Records per pull / upsert, for the writer and the raw baseline alike.
    #[arg(long, default_value_t = 1000)]
    batch_size: u32,
    /// Throughput rounds (raw and writer each round, alternating which goes
    /// first); medians are reported.
    #[arg(long, default_value_t = 7)]
    rounds: usize,
    /// Completions per second in the lag phase.
    #[arg(long, default_value_t = 5000)]
    lag_rate: u32,
    /// Length of the lag phase.
    #[arg(long, default_value_t = 10)]
    lag_seconds: u64,
    /// Redis appendfsync: `no` (no AOF), `everysec` or `always`.
    #[arg(long, default_value = "no")]
    appendfsync: String,
    /// A server without the module, running functions/idem.lua; lag phase only.
    #[arg(long)]
    functions: bool,
    /// With --functions: the writer's sweep interval (ms).
    #[arg(long, default_value_t = 1000)]
    sweep_interval_ms: u64,
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.functions {
        return functions_lag(&args).await;
    }
    let redis = match args.appendfsync.as_str() {
        "no" => RedisServer::start(),
        "always" => RedisConfig::default().aof_always().start(),
        other => RedisConfig::default()
            .server_arg("appendonly", "yes")
            .server_arg("appendfsync", other)
            .start(),
    };
    let db = PgDatabase::create();
    let pg = idem_writer::connect(&db.url).await?;
    let mut migrate_client = idem_writer::connect(&db.url).await?;
    idem_writer::migrate(&mut migrate_client).await?;
    let mut conn = redis.async_conn().await;

    println!("idem mirror benchmark");
    println!(
        "  redis-server {} (module {}), appendfsync {}",
        redis.url(),
        idem_testkit::module_path().display(),
        args.appendfsync
    );
    println!("  postgres database {} (throwaway)", db.name);
    println!(
        "  {} rows per round, {}-byte bodies, batches of {}",
        args.rows, args.body_bytes, args.batch_size
    );

    println!("\nthroughput (rows/s)");
    let mut raw_rates = Vec::new();
    let mut writer_rates = Vec::new();
    let mut ratios = Vec::new();
    for round in 1..=args.rounds {
        let prefix = format!("r{round}");
        let records = complete_many(&mut conn, &prefix, args.rows, args.body_bytes).await?;

        // Alternate which side goes first, so neither always meets a
        // freshly checkpointed server or a warm cache.
        let (raw, mirrored) = if round % 2 == 1 {
            reset_table(&pg).await?;
            let raw = raw_upserts(&pg, &records, args.batch_size).await?;
            reset_table(&pg).await?;
            (
                raw,
                writer_drain(&redis, &db.url, args.batch_size, args.rows).await?,
            )
        } else {
            reset_table(&pg).await?;
            let mirrored = writer_drain(&redis, &db.url, args.batch_size, args.rows).await?;
            reset_table(&pg).await?;
            (raw_upserts(&pg, &records, args.batch_size).await?, mirrored)
        };
        let count: i64 = pg
            .query_one("SELECT count(*) FROM idempotency_keys", &[])
            .await?
            .get(0);
        anyhow::ensure!(count as usize == args.rows, "left {count} rows");

        let raw_rate = args.rows as f64 / raw.as_secs_f64();
        let writer_rate = args.rows as f64 / mirrored.as_secs_f64();
        let ratio = writer_rate / raw_rate;
        println!(
            "  round {round}: raw upserts {raw_rate:>9.0}   writer {writer_rate:>9.0}   ratio {ratio:.2}"
        );
        raw_rates.push(raw_rate);
        writer_rates.push(writer_rate);
        ratios.push(ratio);
    }
    println!(
        "  THROUGHPUT median: raw {:.0} rows/s, writer {:.0} rows/s, ratio {:.2} (median of the rounds' ratios; target >= 0.70)",
        median(&mut raw_rates),
        median(&mut writer_rates),
        median(&mut ratios)
    );

    reset_table(&pg).await?;
    let config = writer_config(&redis, &db.url, args.batch_size);
    let lags = lag_phase(config, &mut conn, &db.url, &args).await?;
    print_lags(&args, &lags);
    Ok(())
}

/// `--functions`: the lag phase against a server running the library.
async fn functions_lag(args: &Args) -> anyhow::Result<()> {
    let redis = idem_testkit::cluster::library::start_with_library();
    let db = PgDatabase::create();
    let mut migrate_client = idem_writer::connect(&db.url).await?;
    idem_writer::migrate(&mut migrate_client).await?;
    let mut conn = redis.async_conn().await;
    println!("idem mirror benchmark, Functions library");
    println!(
        "  redis-server {} without the module, {}, sweep interval {} ms",
        redis.url(),
        idem_testkit::cluster::library::library_path().display(),
        args.sweep_interval_ms
    );
    let mut config = writer_config(&redis, &db.url, args.batch_size);
    config.backend = idem_writer::Backend::Functions;
    config.sweep_interval = Duration::from_millis(args.sweep_interval_ms);
    let lags = lag_phase(config, &mut conn, &db.url, args).await?;
    print_lags(args, &lags);
    Ok(())
}

fn print_lags(args: &Args, lags: &[f64]) {
    println!(
        "\nlag COMPLETE -> committed row at {} completions/s for {} s ({} completions)",
        args.lag_rate,
        args.lag_seconds,
        lags.len()
    );
    println!(
        "  LAG p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms (target <= 100 ms), max {:.1} ms",
        percentile(lags, 0.50),
        percentile(lags, 0.90),
        percentile(lags, 0.99),
        percentile(lags, 1.0)
    );
}

/// Empties the table and checkpoints, so each phase starts alike.
async fn reset_table(pg: &tokio_postgres::Client) -> anyhow::Result<()> {
    pg.batch_execute("TRUNCATE idempotency_keys; CHECKPOINT")
        .await
        .context("reset the table")
}

/// BEGIN + COMPLETE `n` keys through pipelines; the equivalent records.
async fn complete_many(
    conn: &mut MultiplexedConnection,
    prefix: &str,
    n: usize,
    body_bytes: usize,
) -> anyhow::Result<Vec<MirrorRecord>> {
    let mut records = Vec::with_capacity(n);
    for start in (0..n).step_by(1000) {
        let keys: Vec<String> = (start..(start + 1000).min(n))
            .map(|i| format!("{prefix}-{i:08}"))
            .collect();
        records.extend(complete_keys(conn, &keys, body_bytes).await?);
    }
    Ok(records)
}

async fn complete_keys(
    conn: &mut MultiplexedConnection,
    keys: &[String],
    body_bytes: usize,
) -> anyhow::Result<Vec<MirrorRecord>> {
    let mut begin = redis::pipe();
    for key in keys {
        begin.cmd("IDEM.BEGIN").arg(key).arg(key).arg(3600);
    }
    let replies: Vec<Value> = begin.query_async(conn).await.context("BEGIN")?;
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as i64;
    let mut complete = redis::pipe();
    let mut records = Vec::with_capacity(keys.len());
    let mut rng = rand::rng();
    for (key, reply) in keys.iter().zip(replies) {
        let token = match &reply {
            Value::Array(items) => match items.as_slice() {
                [_, Value::Int(token)] => *token,
                _ => anyhow::bail!("BEGIN {key}: {reply:?}"),
            },
            _ => anyhow::bail!("BEGIN {key}: {reply:?}"),
        };
        let body: Vec<u8> = (0..body_bytes).map(|_| rng.random()).collect();
        complete
            .cmd("IDEM.COMPLETE")
            .arg(key)
            .arg(token)
            .arg(201)
            .arg(&body)
            .arg("HEADER")
            .arg("content-type")
            .arg("application/json");
        records.push(MirrorRecord {
            key: key.clone(),
            token,
            fingerprint: hex::encode(Sha256::digest(key.as_bytes())),
            status: 201,
            body,
            headers: vec![b"content-type".to_vec(), b"application/json".to_vec()],
            created_at_ms: now_ms,
            completed_at_ms: now_ms,
            expires_at_ms: now_ms + 3_600_000,
        });
    }
    let _: Vec<Value> = complete.query_async(conn).await.context("COMPLETE")?;
    Ok(records)
}

/// The same upserts straight to Postgres, one batch after another.
async fn raw_upserts(
    pg: &tokio_postgres::Client,
    records: &[MirrorRecord],
    batch_size: u32,
) -> anyhow::Result<Duration> {
    let statement = pg.prepare(UPSERT_SQL).await?;
    let started = Instant::now();
    for batch in records.chunks(batch_size as usize) {
        upsert_records(pg, &statement, batch).await?;
    }
    Ok(started.elapsed())
}

/// Starts the writer and times it until the node has nothing pending.
async fn writer_drain(
    redis: &RedisServer,
    database_url: &str,
    batch_size: u32,
    rows: usize,
) -> anyhow::Result<Duration> {
    let mut info = redis.async_conn().await;
    anyhow::ensure!(
        pending(&mut info).await? == rows as i64,
        "pending before start"
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let config = writer_config(redis, database_url, batch_size);
    let started = Instant::now();
    let writer = tokio::spawn(idem_writer::run(config, async {
        let _ = stopped.await;
    }));
    while pending(&mut info).await? > 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = started.elapsed();
    let _ = stop.send(());
    writer.await??;
    Ok(elapsed)
}

fn writer_config(redis: &RedisServer, database_url: &str, batch_size: u32) -> WriterConfig {
    let mut config = WriterConfig::new(vec![redis.url()], database_url);
    config.batch_size = batch_size;
    config.cleanup_interval = None;
    config.block = Duration::from_millis(500);
    config
}

async fn pending(conn: &mut MultiplexedConnection) -> anyhow::Result<i64> {
    let text: String = redis::cmd("INFO").arg("idem").query_async(conn).await?;
    text.lines()
        .find_map(|l| {
            l.trim_end()
                .strip_prefix("idem_mirror_pending:")?
                .parse()
                .ok()
        })
        .context("INFO idem has no idem_mirror_pending")
}

/// Completions at a steady rate with the writer running; for each, the time
/// from sending COMPLETE to Postgres announcing the committed row (NOTIFY
/// is delivered at commit). Lags in ms.
async fn lag_phase(
    config: WriterConfig,
    conn: &mut MultiplexedConnection,
    database_url: &str,
    args: &Args,
) -> anyhow::Result<Vec<f64>> {
    let (listener, mut connection) =
        tokio_postgres::connect(database_url, tokio_postgres::NoTls).await?;
    let (notify_tx, mut notify_rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(message)) = messages.next().await {
            if let AsyncMessage::Notification(n) = message {
                let _ = notify_tx.send((n.payload().to_string(), Instant::now()));
            }
        }
    });
    listener
        .batch_execute(
            "CREATE FUNCTION bench_notify_mirrored() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN PERFORM pg_notify('idem_mirrored', NEW.key); RETURN NEW; END $$;
             CREATE TRIGGER bench_notify_mirrored AFTER INSERT OR UPDATE ON idempotency_keys
                 FOR EACH ROW EXECUTE FUNCTION bench_notify_mirrored();
             LISTEN idem_mirrored;",
        )
        .await?;

    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let writer = tokio::spawn(idem_writer::run(config, async {
        let _ = stopped.await;
    }));
    tokio::time::sleep(Duration::from_millis(500)).await;

    let ticks_per_second = 100;
    let per_tick = (args.lag_rate / ticks_per_second).max(1) as usize;
    let mut ticker =
        tokio::time::interval(Duration::from_millis(1000 / u64::from(ticks_per_second)));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut sent_at: HashMap<String, Instant> = HashMap::new();
    let ticks = args.lag_seconds * u64::from(ticks_per_second);
    let started = Instant::now();
    for tick in 0..ticks {
        ticker.tick().await;
        let keys: Vec<String> = (0..per_tick)
            .map(|i| format!("lag-{tick:06}-{i:04}"))
            .collect();
        let mut begin = redis::pipe();
        for key in &keys {
            if args.functions {
                begin.cmd("FCALL").arg("idem_begin").arg(1);
            } else {
                begin.cmd("IDEM.BEGIN");
            }
            begin.arg(key).arg(key).arg(3600);
        }
        let replies: Vec<Value> = begin.query_async(conn).await?;
        let mut complete = redis::pipe();
        for (key, reply) in keys.iter().zip(&replies) {
            let Value::Array(items) = reply else {
                anyhow::bail!("BEGIN {key}: {reply:?}")
            };
            let Some(Value::Int(token)) = items.get(1) else {
                anyhow::bail!("BEGIN {key}: {reply:?}")
            };
            if args.functions {
                let outbox = idem_core::functions::outbox_key(key.as_bytes());
                complete
                    .cmd("FCALL")
                    .arg("idem_complete")
                    .arg(2)
                    .arg(key)
                    .arg(outbox);
            } else {
                complete.cmd("IDEM.COMPLETE").arg(key);
            }
            complete
                .arg(*token)
                .arg(201)
                .arg(vec![b'x'; args.body_bytes]);
        }
        let now = Instant::now();
        for key in keys {
            sent_at.insert(key, now);
        }
        let _: Vec<Value> = complete.query_async(conn).await?;
    }
    let generated_in = started.elapsed();

    let mut lags = Vec::with_capacity(sent_at.len());
    let deadline = Instant::now() + Duration::from_secs(30);
    while lags.len() < sent_at.len() && Instant::now() < deadline {
        match tokio::time::timeout(Duration::from_secs(1), notify_rx.recv()).await {
            Ok(Some((key, at))) => {
                if let Some(sent) = sent_at.get(&key) {
                    lags.push(at.duration_since(*sent).as_secs_f64() * 1000.0);
                }
            }
            Ok(None) => break,
            Err(_) => {}
        }
    }
    let _ = stop.send(());
    writer.await??;
    anyhow::ensure!(
        lags.len() == sent_at.len(),
        "only {} of {} rows were announced",
        lags.len(),
        sent_at.len()
    );
    println!(
        "\n  (generated {} completions in {:.2} s: {:.0}/s)",
        sent_at.len(),
        generated_in.as_secs_f64(),
        sent_at.len() as f64 / generated_in.as_secs_f64()
    );
    lags.sort_by(f64::total_cmp);
    Ok(lags)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The `q` quantile of sorted `values` (nearest rank).
fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}
