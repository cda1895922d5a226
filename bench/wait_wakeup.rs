//! Benchmark for `IDEM.BEGIN ... WAIT` (issue 5): waking N waiters on one key
//! costs one pass over them when the holder completes, not a poll each.
//!
//! For N = 10, 100, 1000 it blocks N clients with WAIT, completes the key and
//! measures the time until the last waiter has its replay, plus the server's
//! command count. For contrast, N clients polling `IDEM.BEGIN` every 10 ms
//! for the same 300 ms of work. Run by scripts/bench.sh.

use std::time::{Duration, Instant};

use idem_testkit::RedisServer;
use redis::aio::MultiplexedConnection;
use redis::Value;

const WORK: Duration = Duration::from_millis(300);

async fn calls(con: &mut MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(con)
        .await
        .unwrap();
    info.lines()
        .find(|l| l.to_ascii_lowercase().starts_with("cmdstat_idem.begin:"))
        .and_then(|l| l.split("calls=").nth(1))
        .and_then(|v| v.split(',').next())
        .map_or(0, |v| v.parse().unwrap())
}

async fn info_field(con: &mut MultiplexedConnection, field: &str) -> u64 {
    let info = idem_testkit::info::idem_info_text_async(con).await;
    idem_testkit::info::info_int(&info, field).map_or(0, |v| v as u64)
}

async fn begin_token(con: &mut MultiplexedConnection, key: &str) -> i64 {
    let v: Vec<Value> = redis::cmd("IDEM.BEGIN")
        .arg(key)
        .arg("fp")
        .arg(60)
        .query_async(con)
        .await
        .unwrap();
    match &v[1] {
        Value::Int(t) => *t,
        other => panic!("not new: {other:?}"),
    }
}

async fn complete(con: &mut MultiplexedConnection, key: &str, token: i64) {
    let _: () = redis::cmd("IDEM.COMPLETE")
        .arg(key)
        .arg(token)
        .arg(201)
        .arg(vec![b'x'; 256])
        .query_async(con)
        .await
        .unwrap();
}

/// N waiters blocked with WAIT; returns (wake time, BEGIN calls per waiter).
async fn waiting(server: &RedisServer, n: usize) -> (Duration, f64) {
    let key = format!("wait:{n}");
    let mut holder = server.async_conn().await;
    let token = begin_token(&mut holder, &key).await;
    let before = calls(&mut holder).await;
    let mut tasks = Vec::with_capacity(n);
    for _ in 0..n {
        let mut con = server.async_conn().await;
        let key = key.clone();
        tasks.push(tokio::spawn(async move {
            let v: Vec<Value> = redis::cmd("IDEM.BEGIN")
                .arg(&key)
                .arg("fp")
                .arg(60)
                .arg("WAIT")
                .arg(60_000)
                .query_async(&mut con)
                .await
                .unwrap();
            assert_eq!(v[0], Value::BulkString(b"replay".to_vec()), "{v:?}");
            Instant::now()
        }));
    }
    while info_field(&mut holder, "idem_waiters").await < n as u64 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let start = Instant::now();
    complete(&mut holder, &key, token).await;
    let mut last = start;
    for t in tasks {
        last = last.max(t.await.unwrap());
    }
    let begins = calls(&mut holder).await - before;
    (last - start, begins as f64 / n as f64)
}

/// N clients polling BEGIN every 10 ms while the holder works.
async fn polling(server: &RedisServer, n: usize) -> f64 {
    let key = format!("poll:{n}");
    let mut holder = server.async_conn().await;
    let token = begin_token(&mut holder, &key).await;
    let before = calls(&mut holder).await;
    let mut tasks = Vec::with_capacity(n);
    for _ in 0..n {
        let mut con = server.async_conn().await;
        let key = key.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                let v: Vec<Value> = redis::cmd("IDEM.BEGIN")
                    .arg(&key)
                    .arg("fp")
                    .arg(60)
                    .query_async(&mut con)
                    .await
                    .unwrap();
                if v[0] == Value::BulkString(b"replay".to_vec()) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }));
    }
    tokio::time::sleep(WORK).await;
    complete(&mut holder, &key, token).await;
    for t in tasks {
        t.await.unwrap();
    }
    (calls(&mut holder).await - before) as f64 / n as f64
}

#[tokio::main]
async fn main() {
    let server = idem_testkit::RedisConfig::default()
        .server_arg("maxclients", "4000")
        .start();
    println!("WAIT wake-up: N clients blocked on one key, holder completes");
    println!(
        "{:>6} {:>14} {:>16} {:>18} {:>22}",
        "N", "wake all (ms)", "per waiter (us)", "BEGIN calls/client", "polling calls/client*"
    );
    for n in [10usize, 100, 1000] {
        let (wake, per_client) = waiting(&server, n).await;
        let polled = polling(&server, n).await;
        println!(
            "{:>6} {:>14.2} {:>16.1} {:>18.2} {:>22.1}",
            n,
            wake.as_secs_f64() * 1e3,
            wake.as_secs_f64() * 1e6 / n as f64,
            per_client,
            polled
        );
    }
    println!(
        "* polling every 10 ms during {} ms of work, for contrast",
        WORK.as_millis()
    );
}
