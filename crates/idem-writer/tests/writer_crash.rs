//! 50,000 completions mirrored while the writer binary is SIGKILLed at
//! random moments and restarted: Postgres ends up with exactly those rows,
//! every record is acknowledged, and no row ever went backwards.

mod common;

use std::time::Duration;

use common::*;
use idem_testkit::{PgDatabase, RedisServer};
use rand::RngExt;

const TOTAL: usize = 50_000;
const CHUNK: usize = 500;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_completion_is_mirrored_across_writer_crashes() {
    let redis = RedisServer::start();
    let db = PgDatabase::create();
    migrate(&db.url).await;
    let pg = connect_pg(&db.url).await;
    install_regression_trap(&pg).await;

    // IDEM_CRASH_COMPLETIONS: how many (the writer is killed at least 8
    // times whatever the number).
    let total = size("IDEM_CRASH_COMPLETIONS", TOTAL);
    let generator = spawn_generator(
        redis.client(),
        "crash",
        total,
        CHUNK,
        Duration::from_millis(25),
    );

    let urls = [redis.url()];
    let mut writer = WriterProcess::start(&urls, &db.url, &["--batch-size", "400"]);
    let mut kills = 0;
    while !generator.is_finished() || kills < 8 {
        let pause = rand::rng().random_range(100..600);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        writer.kill();
        kills += 1;
        writer = WriterProcess::start(&urls, &db.url, &["--batch-size", "400"]);
    }
    let expected = generator.join().expect("generator");
    assert_eq!(expected.len(), total);

    let mut conn = redis.conn();
    let drained = wait_drained(&mut conn, &pg, total as i64, Duration::from_secs(120)).await;
    assert!(drained, "mirror did not drain:\n{}", writer.log_tail());

    assert_mirrored_exactly(&pg, &mut conn, &expected).await;
    assert_no_regressions(&pg).await;
    assert!(kills >= 8);
    assert_eq!(writer.http_get("/healthz").0, 200);
}

/// A size of this run: `${var}` when set (a soak raises it), else the size
/// scripts/test.sh runs with.
fn size(var: &str, ci_default: usize) -> usize {
    std::env::var(var).map_or(ci_default, |v| {
        v.parse()
            .unwrap_or_else(|_| panic!("{var}={v}: a whole number, please"))
    })
}
