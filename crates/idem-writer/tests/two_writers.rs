//! Two writers mirroring one Redis at once: every record mirrored exactly
//! once in effect (none lost, none regressed), and both report through
//! /metrics and /healthz.

mod common;

use std::time::Duration;

use common::*;
use idem_testkit::{PgDatabase, RedisServer};
use idem_writer::Layout;

const TOTAL: usize = 20_000;
const CHUNK: usize = 250;

idem_testkit::both_layouts!(
    idem_writer::Layout,
    two_writers_share_one_redis_without_loss
);
async fn two_writers_share_one_redis_without_loss(layout: Layout) {
    let redis = RedisServer::start();
    let db = PgDatabase::create();
    let urls = [redis.url()];
    // Both migrate at once on a fresh database.
    let [flag, value] = layout_args(layout);
    let args = ["--batch-size", "200", flag, value];
    let first = WriterProcess::start(&urls, &db.url, &args);
    let second = WriterProcess::start(&urls, &db.url, &args);

    let mut conn = redis.conn();
    let mut expected = Vec::with_capacity(TOTAL);
    for chunk in 0..TOTAL / CHUNK {
        expected.extend(complete_keys(
            &mut conn,
            &keys("two", chunk * CHUNK..(chunk + 1) * CHUNK),
            3600,
        ));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let pg = connect_pg(&db.url).await;
    let drained = wait_drained(&mut conn, &pg, TOTAL as i64, Duration::from_secs(60)).await;
    assert!(
        drained,
        "not drained:\n{}\n{}",
        first.log_tail(),
        second.log_tail()
    );
    assert_mirrored_exactly(&pg, &mut conn, &expected).await;

    let mut mirrored_total = 0.0;
    for writer in [&first, &second] {
        assert_eq!(writer.http_get("/healthz"), (200, "ok\n".to_string()));
        let (code, text) = writer.http_get("/metrics");
        assert_eq!(code, 200);
        let series = format!(
            "idem_writer_records_mirrored_total{{node=\"127.0.0.1:{}/0\"}}",
            redis.port
        );
        mirrored_total += metric(&text, &series).unwrap_or_else(|| panic!("{series}:\n{text}"));
        assert!(text.contains("# TYPE idem_writer_batch_duration_seconds histogram"));
    }
    // Every record was acknowledged by one writer or the other (a record
    // whose claim lapsed may have been mirrored by both).
    assert!(mirrored_total >= TOTAL as f64, "{mirrored_total}");
}
