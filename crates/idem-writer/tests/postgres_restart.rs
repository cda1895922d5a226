//! 50,000 completions mirrored while Postgres (a private cluster) is down at
//! the writer's start, crashed and restarted mid-stream, and shut down and
//! restarted again: nothing lost, nothing regressed.

mod common;

use std::time::Duration;

use common::*;
use idem_testkit::postgres_server::PgServer;
use idem_testkit::RedisServer;

const TOTAL: usize = 50_000;
const CHUNK: usize = 500;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_completion_is_mirrored_across_postgres_restarts() {
    let redis = RedisServer::start();
    let mut postgres = PgServer::start();
    let url = postgres.create_database("mirror");
    migrate(&url).await;
    install_regression_trap(&connect_pg(&url).await).await;

    // The writer starts while Postgres is down and must wait for it.
    postgres.shutdown();
    let urls = [redis.url()];
    let mut writer = WriterProcess::start(&urls, &url, &["--batch-size", "400"]);

    let generator = spawn_generator(
        redis.client(),
        "pgrestart",
        TOTAL,
        CHUNK,
        Duration::from_millis(40),
    );

    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(
        writer.is_running(),
        "the writer gave up:\n{}",
        writer.log_tail()
    );
    let (code, body) = writer.http_get("/healthz");
    assert_eq!(code, 503, "{body}");
    postgres.restart();

    let pg = connect_pg(&url).await;
    let started = wait_until(Duration::from_secs(30), || async {
        row_count(&pg).await > 2_000
    })
    .await;
    assert!(started, "nothing mirrored:\n{}", writer.log_tail());
    drop(pg);
    // A crash mid-stream (no checkpoint, crash recovery on start).
    postgres.kill();
    tokio::time::sleep(Duration::from_millis(700)).await;
    postgres.restart();
    tokio::time::sleep(Duration::from_millis(400)).await;
    // A clean shutdown mid-stream.
    postgres.shutdown();
    tokio::time::sleep(Duration::from_millis(500)).await;
    postgres.restart();

    let expected = generator.join().expect("generator");
    let pg = connect_pg(&url).await;
    let mut conn = redis.conn();
    let drained = wait_drained(&mut conn, &pg, TOTAL as i64, Duration::from_secs(120)).await;
    assert!(drained, "mirror did not drain:\n{}", writer.log_tail());

    assert_mirrored_exactly(&pg, &mut conn, &expected).await;
    assert_no_regressions(&pg).await;
    let (_, metrics) = writer.http_get("/metrics");
    let postgres_errors = metric(&metrics, "idem_writer_errors_total{kind=\"postgres\"}");
    assert!(postgres_errors.is_some_and(|n| n > 0.0), "{metrics}");
    assert_eq!(writer.http_get("/healthz").0, 200);
    assert!(writer.is_running());
}
