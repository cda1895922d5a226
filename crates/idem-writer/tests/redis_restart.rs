//! 50,000 completions mirrored while Redis (AOF, appendfsync always) is
//! killed and restarted mid-stream, twice: the writer reconnects, pending
//! records survive the restart, nothing is lost or regressed.

mod common;

use std::time::Duration;

use common::*;
use idem_testkit::{PgDatabase, RedisConfig};

const CHUNK: usize = 500;

fn complete_range(conn: &mut redis::Connection, from: usize, to: usize) -> Vec<Completion> {
    (from..to)
        .step_by(CHUNK)
        .flat_map(|start| {
            complete_keys(
                conn,
                &keys("rrestart", start..(start + CHUNK).min(to)),
                3600,
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_completion_is_mirrored_across_redis_restarts() {
    let mut redis = RedisConfig::default().aof_always().start();
    let db = PgDatabase::create();
    migrate(&db.url).await;
    let pg = connect_pg(&db.url).await;
    install_regression_trap(&pg).await;

    let mut expected = complete_range(&mut redis.conn(), 0, 20_000);
    let mut writer = WriterProcess::start(&[redis.url()], &db.url, &["--batch-size", "300"]);

    let mirroring = wait_until(Duration::from_secs(30), || async {
        row_count(&pg).await > 1_000
    })
    .await;
    assert!(mirroring, "nothing mirrored:\n{}", writer.log_tail());
    redis.kill();
    tokio::time::sleep(Duration::from_millis(600)).await;
    redis.restart();

    expected.extend(complete_range(&mut redis.conn(), 20_000, 35_000));
    redis.kill();
    tokio::time::sleep(Duration::from_millis(300)).await;
    redis.restart();
    expected.extend(complete_range(&mut redis.conn(), 35_000, 50_000));
    assert_eq!(expected.len(), 50_000);

    let mut conn = redis.conn();
    let drained = wait_drained(&mut conn, &pg, 50_000, Duration::from_secs(120)).await;
    assert!(drained, "mirror did not drain:\n{}", writer.log_tail());

    assert_mirrored_exactly(&pg, &mut conn, &expected).await;
    assert_no_regressions(&pg).await;
    let (_, metrics) = writer.http_get("/metrics");
    let redis_errors: f64 = ["redis_connect", "redis_pull", "redis_ack"]
        .iter()
        .filter_map(|k| {
            metric(
                &metrics,
                &format!("idem_writer_errors_total{{kind=\"{k}\"}}"),
            )
        })
        .sum();
    assert!(
        redis_errors > 0.0,
        "the restarts went unnoticed:\n{metrics}"
    );
    assert!(writer.is_running());
}
