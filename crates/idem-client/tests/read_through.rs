//! Read-through from the Postgres mirror (the writer's `idempotency_keys`
//! table) when Redis has lost a key: replay and refill, mismatch, expired
//! rows, and an unreachable mirror; on both layouts of the table.

mod common;

use std::time::Duration;

use common::{idem_get, state_of, text, LONG};
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use idem_client::fingerprint::stored_hex;
use idem_client::{BeginOptions, IdemClient, Outcome, ReadThrough, StoredResponse};
use idem_testkit::{free_port, PgDatabase, RedisServer};
use idem_writer::Layout;

fn pool(url: &str) -> Pool {
    let config: tokio_postgres::Config = url.parse().expect("database url");
    let manager = Manager::from_config(
        config,
        tokio_postgres::NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(4)
        .wait_timeout(Some(Duration::from_secs(2)))
        .create_timeout(Some(Duration::from_secs(2)))
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .build()
        .expect("pool")
}

async fn mirror_db(layout: Layout) -> (PgDatabase, Pool) {
    let db = PgDatabase::create();
    let mut client = db.connect().await;
    idem_writer::migrate_with_layout(&mut client, layout)
        .await
        .expect("mirror migration");
    if layout == Layout::Partitioned {
        // Rows expired a moment ago may fall on yesterday (UTC).
        let yesterday = idem_writer::partitions::day_of_ms(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis() as i64
                - 86_400_000,
        );
        idem_writer::partitions::ensure_days(&client, [yesterday])
            .await
            .expect("partition");
    }
    let pool = pool(&db.url);
    (db, pool)
}

/// A completed mirror row, as the writer leaves it.
async fn insert_row(pool: &Pool, key: &str, fingerprint: &[u8], expires_in_secs: f64) {
    let client = pool.get().await.unwrap();
    let headers: Vec<Vec<u8>> = vec![
        b"content-type".to_vec(),
        b"application/json".to_vec(),
        b"location".to_vec(),
        b"/payments/9".to_vec(),
    ];
    client
        .execute(
            "INSERT INTO idempotency_keys (key, fingerprint, response_body, response_status, status, \
             expires_at, response_headers, token, created_at, completed_at) \
             VALUES ($1, $2, $3, 201, 'completed', now() + make_interval(secs => $4), $5, 1, now(), now())",
            &[&key, &stored_hex(fingerprint), &b"{\"id\":9}".to_vec(), &expires_in_secs, &headers],
        )
        .await
        .expect("insert mirror row");
}

fn expected_response() -> StoredResponse {
    StoredResponse::new(201, &b"{\"id\":9}"[..])
        .with_header("content-type", "application/json")
        .with_header("location", "/payments/9")
}

idem_testkit::both_layouts!(
    idem_writer::Layout,
    a_key_only_the_mirror_knows_is_replayed_and_refilled
);
async fn a_key_only_the_mirror_knows_is_replayed_and_refilled(layout: Layout) {
    let server = RedisServer::start();
    let (_db, pool) = mirror_db(layout).await;
    insert_row(&pool, "lost", b"fp", 3600.0).await;
    let client = IdemClient::new(server.async_conn().await);
    let read_through = ReadThrough::new(pool.clone());

    let outcome = read_through
        .begin(&client, "lost", b"fp", BeginOptions::new(LONG))
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Replay(expected_response()));

    let mut conn = server.async_conn().await;
    let record = idem_get(&mut conn, "lost").await.expect("refilled");
    assert_eq!(text(&record["state"]), "completed");
    assert_eq!(text(&record["mirror"]), "mirrored");
    assert_eq!(text(&record["status"]), "201");

    // Redis now answers by itself, even without the row.
    pool.get()
        .await
        .unwrap()
        .execute("DELETE FROM idempotency_keys", &[])
        .await
        .unwrap();
    let again = read_through
        .begin(&client, "lost", b"fp", BeginOptions::new(LONG))
        .await
        .unwrap();
    assert_eq!(again, Outcome::Replay(expected_response()));
}

idem_testkit::both_layouts!(
    idem_writer::Layout,
    another_fingerprint_is_a_mismatch_and_the_key_is_released
);
async fn another_fingerprint_is_a_mismatch_and_the_key_is_released(layout: Layout) {
    let server = RedisServer::start();
    let (_db, pool) = mirror_db(layout).await;
    insert_row(&pool, "lost", b"fp", 3600.0).await;
    let client = IdemClient::new(server.async_conn().await);
    let read_through = ReadThrough::new(pool);

    let outcome = read_through
        .begin(&client, "lost", b"other", BeginOptions::new(LONG))
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Mismatch);
    let mut conn = server.async_conn().await;
    assert_eq!(state_of(&mut conn, "lost").await, None);
}

idem_testkit::both_layouts!(idem_writer::Layout, expired_or_absent_rows_mean_new);
async fn expired_or_absent_rows_mean_new(layout: Layout) {
    let server = RedisServer::start();
    let (_db, pool) = mirror_db(layout).await;
    insert_row(&pool, "old", b"fp", -1.0).await;
    let client = IdemClient::new(server.async_conn().await);
    let read_through = ReadThrough::new(pool);

    for key in ["old", "never-seen"] {
        let outcome = read_through
            .begin(&client, key, b"fp", BeginOptions::new(LONG))
            .await
            .unwrap();
        assert!(matches!(outcome, Outcome::New { .. }), "{key}: {outcome:?}");
        let mut conn = server.async_conn().await;
        assert_eq!(
            state_of(&mut conn, key).await.as_deref(),
            Some("in_progress")
        );
    }
}

#[tokio::test]
async fn an_unreachable_mirror_is_unavailable_and_releases_the_key() {
    let server = RedisServer::start();
    let dead = pool(&format!(
        "postgres://postgres@127.0.0.1:{}/none",
        free_port()
    ));
    let client = IdemClient::new(server.async_conn().await);
    let read_through = ReadThrough::new(dead);

    let err = read_through
        .begin(&client, "k", b"fp", BeginOptions::new(LONG))
        .await
        .unwrap_err();
    assert!(err.is_unavailable(), "{err:?}");
    let mut conn = server.async_conn().await;
    assert_eq!(state_of(&mut conn, "k").await, None);
}
