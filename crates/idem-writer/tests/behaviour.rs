//! The writer's smaller contracts: key reuse after expiry, the upsert never
//! going backwards, keys Postgres cannot hold, SIGTERM finishing the batch
//! in hand, concurrent migrations, and the cleanup job; on both layouts of
//! `idempotency_keys` where the layout matters.

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::*;
use idem_testkit::{PgDatabase, RedisServer};
use idem_writer::store::{upsert_records, UPSERT_SQL};
use idem_writer::{Layout, MirrorRecord};

fn sample(key: &str, token: i64, body: &[u8]) -> MirrorRecord {
    MirrorRecord {
        key: key.into(),
        token,
        fingerprint: "ab".repeat(32),
        status: 200,
        body: body.to_vec(),
        headers: vec![b"x-version".to_vec(), body.to_vec()],
        created_at_ms: 1_700_000_000_000,
        completed_at_ms: 1_700_000_000_100,
        expires_at_ms: 4_000_000_000_000,
    }
}

idem_testkit::both_layouts!(
    idem_writer::Layout,
    key_reused_after_expiry_ends_with_the_newer_version
);
async fn key_reused_after_expiry_ends_with_the_newer_version(layout: Layout) {
    let redis = RedisServer::start();
    let db = PgDatabase::create();
    let writer = WriterProcess::start(&[redis.url()], &db.url, &layout_args(layout));
    let mut conn = redis.conn();
    let key = "reused".to_string();

    // The first completion lives for TTL only and is mirrored only if it is
    // pulled before it expires. A writer just started is still migrating
    // (and, partitioned, making the days ahead: its first pull came 1.6 s
    // after the start on a loaded machine), so completing at once raced the
    // start against the TTL and lost as "no row after 30 s". Complete only
    // once the writer is pulling: then it is blocked in PULL and takes the
    // record within milliseconds; the 2 s TTL leaves room for a pull that
    // load delays and is short enough to wait out.
    const TTL: u64 = 2;
    let pulling = writer.wait_pulling(1, Duration::from_secs(30)).await;
    assert!(pulling, "the writer never pulled:\n{}", writer.log_tail());
    let first = complete_keys(&mut conn, std::slice::from_ref(&key), TTL);
    let pg_url = db.url.clone();
    let mirrored = wait_until(Duration::from_secs(30), || {
        let url = pg_url.clone();
        async move { row_count(&connect_pg(&url).await).await == 1 }
    })
    .await;
    assert!(mirrored, "{}", writer.log_tail());
    let pg = connect_pg(&db.url).await;
    assert_eq!(rows(&pg).await[&key].token, first[0].token);

    // After the TTL the key is gone from Redis and is begun afresh.
    let expired = wait_until(Duration::from_secs(TTL + 10), || {
        let gone = get_record(&mut conn, key.as_bytes()).is_none();
        async move { gone }
    })
    .await;
    assert!(expired, "{key} outlived its {TTL} s TTL");
    let second = complete_keys(&mut conn, std::slice::from_ref(&key), 3600);
    assert!(second[0].token > first[0].token);

    let replaced = wait_until(Duration::from_secs(30), || {
        let pg = &pg;
        let want = second[0].token;
        async move { rows(pg).await.get("reused").map(|r| r.token) == Some(want) }
    })
    .await;
    assert!(replaced, "{}", writer.log_tail());
    // The row commits before the writer's ACK reaches Redis: wait for both.
    let drained = wait_drained(&mut conn, &pg, 1, Duration::from_secs(30)).await;
    assert!(drained, "{}", writer.log_tail());
    assert_mirrored_exactly(&pg, &mut conn, &second).await;
}

idem_testkit::both_layouts!(
    idem_writer::Layout,
    upsert_keeps_the_largest_token_whatever_the_order
);
async fn upsert_keeps_the_largest_token_whatever_the_order(layout: Layout) {
    let db = PgDatabase::create();
    migrate_layout(&db.url, layout).await;
    let pg = connect_pg(&db.url).await;

    let written = upsert(&pg, layout, &[sample("k", 20, b"v20")]).await;
    assert_eq!(written.expect("upsert"), 1);
    // Older, equal, and a batch holding both an older and a newer copy.
    assert_eq!(
        upsert(&pg, layout, &[sample("k", 10, b"v10")])
            .await
            .expect("upsert"),
        0
    );
    assert_eq!(
        upsert(&pg, layout, &[sample("k", 20, b"again")])
            .await
            .expect("upsert"),
        0
    );
    let batch = [
        sample("k", 15, b"v15"),
        sample("k", 30, b"v30"),
        sample("k", 25, b"v25"),
    ];
    assert_eq!(upsert(&pg, layout, &batch).await.expect("upsert"), 1);
    // A newer version with another expiry (a shorter TTL: another partition).
    let mut moved = sample("k", 40, b"v40");
    moved.expires_at_ms = 3_900_000_000_000;
    assert_eq!(upsert(&pg, layout, &[moved]).await.expect("upsert"), 1);
    assert_eq!(
        upsert(&pg, layout, &[sample("k", 35, b"v35")])
            .await
            .expect("upsert"),
        0,
        "an older version with the old expiry must not come back"
    );
    assert_eq!(row_count(&pg).await, 1);
    let newest = sample("k", 50, b"v50");

    assert_eq!(upsert(&pg, layout, &[newest]).await.expect("upsert"), 1);

    assert_eq!(row_count(&pg).await, 1);
    let row = &rows(&pg).await["k"];
    assert_eq!(row.token, 50);
    assert_eq!(row.response_body.as_deref(), Some(&b"v50"[..]));
    assert_eq!(
        row.response_headers,
        vec![b"x-version".to_vec(), b"v50".to_vec()]
    );
    assert_eq!(row.created_at_ms, Some(1_700_000_000_000));
    assert_eq!(row.expires_at_ms, 4_000_000_000_000);
}

idem_testkit::both_layouts!(
    idem_writer::Layout,
    keys_postgres_cannot_hold_stay_pending_and_are_counted
);
async fn keys_postgres_cannot_hold_stay_pending_and_are_counted(layout: Layout) {
    let redis = RedisServer::start();
    let db = PgDatabase::create();
    let writer = WriterProcess::start(&[redis.url()], &db.url, &layout_args(layout));
    let mut conn = redis.conn();
    let bad_key: &[u8] = b"bad-\xff\xfe";
    let token: Vec<redis::Value> = redis::cmd("IDEM.BEGIN")
        .arg(bad_key)
        .arg("fp")
        .arg(3600)
        .query(&mut conn)
        .expect("BEGIN");
    let redis::Value::Int(token) = token[1] else {
        panic!("{token:?}")
    };
    let _: () = redis::cmd("IDEM.COMPLETE")
        .arg(bad_key)
        .arg(token)
        .arg(200)
        .arg("body")
        .query(&mut conn)
        .expect("COMPLETE");
    let good = complete_keys(&mut conn, &keys("good", 0..10), 3600);

    let pg = connect_pg(&db.url).await;
    let counted = wait_until(Duration::from_secs(30), || {
        let metrics = writer.http_get("/metrics").1;
        let pg = &pg;
        async move {
            row_count(pg).await == 10
                && metric(&metrics, "idem_writer_errors_total{kind=\"invalid_key\"}")
                    .is_some_and(|n| n >= 1.0)
        }
    })
    .await;
    assert!(counted, "{}", writer.log_tail());
    assert_mirrored_exactly(&pg, &mut conn, &good).await;
    let bad = get_record(&mut conn, bad_key).expect("still in Redis");
    assert_eq!(mirror_state(&bad), "pending");
    assert_eq!(info_field(&mut conn, "idem_mirror_pending"), 1);
}

/// A key that refuses its acknowledgement (here the writer's ACL user may
/// read it but not write it) is skipped and counted; the rest of its batch
/// and every later record are acknowledged. One such key used to fail the
/// whole batch's acknowledgement forever, so nothing more was mirrored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_that_refuses_its_ack_holds_up_nothing_else() {
    let redis = RedisServer::start();
    let db = PgDatabase::create();
    let mut conn = redis.conn();
    let _: () = redis::cmd("ACL")
        .arg(&[
            "SETUSER", "writer", "on", ">pw", "%R~*", "%RW~ok:*", "+@all",
        ])
        .query(&mut conn)
        .expect("ACL SETUSER");
    complete_keys(&mut conn, &keys("other:", 0..1), 3600);
    let first = complete_keys(&mut conn, &keys("ok:", 0..10), 3600);
    let url = format!("redis://writer:pw@127.0.0.1:{}/", redis.port);
    let writer = WriterProcess::start(&[url], &db.url, &[]);
    let pg = connect_pg(&db.url).await;
    let acked = wait_until(Duration::from_secs(30), || {
        let pending = info_field(&mut conn, "idem_mirror_pending");
        let metrics = writer.http_get("/metrics").1;
        let pg = &pg;
        async move {
            pending == 1
                && row_count(pg).await == 11
                && metric(&metrics, "idem_writer_errors_total{kind=\"redis_ack\"}")
                    .is_some_and(|n| n >= 1.0)
        }
    })
    .await;
    assert!(acked, "{}", writer.log_tail());
    assert_acknowledged(&mut conn, &first);

    let later = complete_keys(&mut conn, &keys("ok:", 10..20), 3600);
    let acked = wait_until(Duration::from_secs(30), || {
        let pending = info_field(&mut conn, "idem_mirror_pending");
        let pg = &pg;
        async move { pending == 1 && row_count(pg).await == 21 }
    })
    .await;
    assert!(acked, "{}", writer.log_tail());
    assert_acknowledged(&mut conn, &later);
    let refused = get_record(&mut conn, b"other:-000000").expect("still in Redis");
    assert_eq!(mirror_state(&refused), "pending");
}

fn assert_acknowledged(conn: &mut redis::Connection, completions: &[Completion]) {
    for c in completions {
        let record = get_record(conn, c.key.as_bytes()).expect("in Redis");
        assert_eq!(mirror_state(&record), "mirrored", "{}", c.key);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_commits_and_acknowledges_the_batch_in_hand_then_exits_zero() {
    let redis = RedisServer::start();
    let db = PgDatabase::create();
    migrate(&db.url).await;
    let mut writer = WriterProcess::start(&[redis.url()], &db.url, &["--claim-ms", "60000"]);
    let mut pg_lock = connect_pg(&db.url).await;
    let pg = connect_pg(&db.url).await;
    // Once the writer is up (healthy), block its upserts behind a lock.
    let up = wait_until(Duration::from_secs(20), || {
        let healthy = writer.is_running()
            && std::net::TcpStream::connect(writer.metrics_addr).is_ok()
            && writer.http_get("/healthz").0 == 200;
        async move { healthy }
    })
    .await;
    assert!(up, "{}", writer.log_tail());
    let lock = pg_lock.transaction().await.expect("begin");
    lock.batch_execute("LOCK TABLE idempotency_keys IN SHARE MODE")
        .await
        .expect("lock");

    let mut conn = redis.conn();
    let expected = complete_keys(&mut conn, &keys("term", 0..300), 3600);
    let blocked = wait_until(Duration::from_secs(20), || {
        let pg = &pg;
        async move {
            pg.query_one(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND wait_event_type = 'Lock'",
                &[],
            )
            .await
            .map(|r| r.get::<_, i64>(0) > 0)
            .unwrap_or(false)
        }
    })
    .await;
    assert!(
        blocked,
        "the writer never reached Postgres:\n{}",
        writer.log_tail()
    );

    writer.terminate();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(writer.is_running(), "exited with its batch uncommitted");
    lock.commit().await.expect("release the lock");
    let status = writer.wait(Duration::from_secs(20));
    assert_eq!(status.code(), Some(0), "{}", writer.log_tail());

    // What it had pulled is committed and acknowledged; the rest (if any)
    // is still pending, claimed, and not in Postgres.
    let in_pg = rows(&pg).await;
    assert!(!in_pg.is_empty());
    let in_redis = redis_records(
        &mut conn,
        &expected.iter().map(|c| c.key.clone()).collect::<Vec<_>>(),
    );
    for want in &expected {
        let state = mirror_state(&in_redis[&want.key]);
        assert_eq!(
            in_pg.contains_key(&want.key),
            state == "mirrored",
            "{}: in Postgres = {}, Redis says {state}",
            want.key,
            in_pg.contains_key(&want.key)
        );
    }
}

idem_testkit::both_layouts!(idem_writer::Layout, concurrent_migrations_apply_once);
async fn concurrent_migrations_apply_once(layout: Layout) {
    let db = PgDatabase::create();
    let runs: Vec<_> = (0..6)
        .map(|_| {
            let url = db.url.clone();
            tokio::spawn(async move { migrate_layout(&url, layout).await })
        })
        .collect();
    for run in runs {
        run.await.expect("migration task");
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem-writer"))
        .args(["migrate", "--database-url", &db.url])
        .output()
        .expect("run idem-writer migrate");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let pg = connect_pg(&db.url).await;
    let versions: Vec<i32> = pg
        .query(
            "SELECT version FROM idem_writer_migrations ORDER BY version",
            &[],
        )
        .await
        .expect("read migrations")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(versions, vec![1, 2, 3]);
    let body_type: String = pg
        .query_one(
            "SELECT data_type FROM information_schema.columns
             WHERE table_name = 'idempotency_keys' AND column_name = 'response_body'",
            &[],
        )
        .await
        .expect("column type")
        .get(0);
    assert_eq!(body_type, "bytea");

    // The other layout is refused with the way to it, and nothing changes.
    let other = match layout {
        Layout::Unpartitioned => "partitioned",
        Layout::Partitioned => "unpartitioned",
    };
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem-writer"))
        .args(["migrate", "--layout", other, "--database-url", &db.url])
        .output()
        .expect("run idem-writer migrate");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("exists with the {layout} layout"))
            && stderr.contains("Changing the layout"),
        "{stderr}"
    );
    assert_eq!(
        idem_writer::partitions::detect(&pg).await.expect("detect"),
        Some(layout)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_once_removes_exactly_the_expired_rows() {
    let db = PgDatabase::create();
    migrate(&db.url).await;
    let pg = connect_pg(&db.url).await;
    let upsert = pg.prepare(UPSERT_SQL).await.expect("prepare");
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_millis() as i64;
    let mut records = Vec::new();
    for i in 0..2_500 {
        let mut r = sample(&format!("expired-{i}"), 1, b"old");
        r.expires_at_ms = now_ms - 1_000 - i;
        records.push(r);
    }
    for i in 0..700 {
        let mut r = sample(&format!("live-{i}"), 1, b"new");
        r.expires_at_ms = now_ms + 3_600_000 + i;
        records.push(r);
    }
    for batch in records.chunks(1000) {
        upsert_records(&pg, &upsert, batch)
            .await
            .expect("seed rows");
    }

    let cleanup = |url: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem-writer"))
            .args([
                "cleanup",
                "--once",
                "--batch-size",
                "1000",
                "--database-url",
                url,
            ])
            .output()
            .expect("run idem-writer cleanup");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    assert_eq!(cleanup(&db.url), "removed 2500 expired rows");
    let mut left: Vec<String> = rows(&pg).await.into_keys().collect();
    left.sort();
    let mut want: Vec<String> = (0..700).map(|i| format!("live-{i}")).collect();
    want.sort();
    assert_eq!(left, want);
    assert_eq!(cleanup(&db.url), "removed 0 expired rows");
}
