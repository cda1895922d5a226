//! The partitioned layout's own jobs: cleanup drops whole expired partitions
//! and keeps every live row (and rows without TTL), and creating partitions
//! ahead is idempotent, also when several writers do it at once.

mod common;

use std::time::{SystemTime, UNIX_EPOCH};

use common::*;
use idem_testkit::PgDatabase;
use idem_writer::partitions::{day_of_ms, ensure_days, partition_name, NEVER_PARTITION};
use idem_writer::{Layout, MirrorRecord, NEVER_EXPIRES_MS};

const DAY_MS: i64 = 86_400_000;

fn record(key: String, expires_at_ms: i64) -> MirrorRecord {
    MirrorRecord {
        key,
        token: 7,
        fingerprint: "cd".repeat(32),
        status: 201,
        body: b"{}".to_vec(),
        headers: Vec::new(),
        created_at_ms: 1_700_000_000_000,
        completed_at_ms: 1_700_000_000_100,
        expires_at_ms,
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_millis() as i64
}

fn writer(args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem-writer"))
        .args(args)
        .output()
        .expect("run idem-writer");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

async fn partitions(pg: &tokio_postgres::Client) -> Vec<String> {
    pg.query(
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'idempotency_keys'::regclass ORDER BY 1",
        &[],
    )
    .await
    .expect("list partitions")
    .iter()
    .map(|r| r.get(0))
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_drops_expired_partitions_and_keeps_live_rows() {
    let db = PgDatabase::create();
    migrate_layout(&db.url, Layout::Partitioned).await;
    let pg = connect_pg(&db.url).await;
    let now = now_ms();
    let mut records = Vec::new();
    for day in 1..=3 {
        for i in 0..300 {
            records.push(record(format!("expired-{day}-{i}"), now - day * DAY_MS - i));
        }
    }
    let live: Vec<MirrorRecord> = (0..400)
        .map(|i| record(format!("live-{i}"), now + 3_600_000 + i * 60_000))
        .chain((0..5).map(|i| record(format!("forever-{i}"), NEVER_EXPIRES_MS)))
        .collect();
    records.extend(live.iter().cloned());
    for batch in records.chunks(500) {
        upsert(&pg, Layout::Partitioned, batch)
            .await
            .expect("seed rows");
    }
    let past: Vec<String> = (1..=3)
        .map(|day| partition_name(day_of_ms(now - day * DAY_MS)))
        .collect();
    assert!(past.iter().all(|p| partitions_contains(p)(&records)));
    let before = partitions(&pg).await;
    assert!(past.iter().all(|p| before.contains(p)), "{before:?}");
    assert!(before.contains(&NEVER_PARTITION.to_string()));

    let (ok, out, err) = writer(&["cleanup", "--once", "--database-url", &db.url]);
    assert!(ok, "{err}");
    assert!(out.starts_with("dropped 3 expired partitions"), "{out}");
    let after = partitions(&pg).await;
    assert!(past.iter().all(|p| !after.contains(p)), "{after:?}");
    let mut left: Vec<String> = rows(&pg).await.into_keys().collect();
    left.sort();
    let mut want: Vec<String> = live.iter().map(|r| r.key.clone()).collect();
    want.sort();
    assert_eq!(
        left, want,
        "exactly the live rows (and those without TTL) stay"
    );

    let (ok, out, err) = writer(&["cleanup", "--once", "--database-url", &db.url]);
    assert!(ok, "{err}");
    assert!(out.starts_with("dropped 0 expired partitions"), "{out}");
    assert_eq!(row_count(&pg).await, want.len() as i64);
}

/// Whether some record falls in partition `name`.
fn partitions_contains(name: &str) -> impl Fn(&[MirrorRecord]) -> bool + '_ {
    move |records| {
        records
            .iter()
            .any(|r| partition_name(day_of_ms(r.expires_at_ms)) == name)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creating_partitions_ahead_is_idempotent() {
    let db = PgDatabase::create();
    migrate_layout(&db.url, Layout::Partitioned).await;
    let pg = connect_pg(&db.url).await;
    let migrated = partitions(&pg).await;
    // Today, 35 days ahead, and the one for rows without TTL.
    assert_eq!(migrated.len(), 37, "{migrated:?}");

    let ensure = [
        "partitions",
        "ensure",
        "--days-ahead",
        "40",
        "--database-url",
        &db.url,
    ];
    let (ok, out, err) = writer(&ensure);
    assert!(ok, "{err}");
    assert_eq!(out, "created 5 partitions");
    let (ok, out, err) = writer(&ensure);
    assert!(ok, "{err}");
    assert_eq!(out, "created 0 partitions");
    assert_eq!(partitions(&pg).await.len(), 42);

    // Writers creating the same new days at once: each partition once.
    let far = day_of_ms(now_ms()) + 100;
    let runs: Vec<_> = (0..4)
        .map(|_| {
            let url = db.url.clone();
            tokio::spawn(async move {
                let client = connect_pg(&url).await;
                ensure_days(&client, far..far + 3).await.expect("ensure")
            })
        })
        .collect();
    let mut created = 0;
    for run in runs {
        created += run.await.expect("task").len();
    }
    assert!((3..=12).contains(&created));
    assert_eq!(partitions(&pg).await.len(), 45);

    // Not on the unpartitioned layout: refused, nothing created.
    let plain = PgDatabase::create();
    migrate(&plain.url).await;
    let (ok, _, err) = writer(&["partitions", "ensure", "--database-url", &plain.url]);
    assert!(!ok);
    assert!(err.contains("idempotency_keys is not partitioned"), "{err}");
}

/// Creating a partition stops no traffic: while a transaction holds the
/// table open (a fence around a slow handler), a new day's partition is
/// created at once, and reads and writes on the table go on. `CREATE TABLE
/// ... PARTITION OF` waited for that transaction (up to its 10 s lock
/// timeout) and queued every later query on the table behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creating_a_partition_waits_for_no_open_transaction() {
    let db = PgDatabase::create();
    migrate_layout(&db.url, Layout::Partitioned).await;
    let holder = connect_pg(&db.url).await;
    holder
        .batch_execute("BEGIN; SELECT count(*) FROM idempotency_keys;")
        .await
        .expect("open a transaction on the table");

    let far = day_of_ms(now_ms()) + 200;
    let ddl = connect_pg(&db.url).await;
    let started = std::time::Instant::now();
    let created = tokio::time::timeout(std::time::Duration::from_secs(5), ensure_days(&ddl, [far]))
        .await
        .expect("the partition was created while the transaction was open")
        .expect("ensure");
    assert_eq!(created, [partition_name(far)]);
    let pg = connect_pg(&db.url).await;
    let far_ms = far * DAY_MS + 1_000;
    upsert(&pg, Layout::Partitioned, &[record("k".into(), far_ms)])
        .await
        .expect("upsert into the new partition");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert!(partitions(&pg).await.contains(&partition_name(far)));
    holder.batch_execute("COMMIT").await.expect("commit");
    assert_eq!(row_count(&pg).await, 1);
}
