//! The writer on servers without the module, running the Functions library
//! (`functions/idem.lua`): it finds the library by itself, mirrors every
//! record completed through it, survives being killed between its commit
//! and its acknowledgement (the claim lapses and the records come back),
//! and follows a 3-primary cluster through a reshard. Built with the
//! `fault-injection` feature, a writer that acknowledges before it commits
//! is killed the same way and the loss is seen: the crash test has teeth.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::library::*;
use common::*;
use idem_core::functions::key_slot;
use idem_testkit::cluster::library::{start_library_cluster, start_with_library};
use idem_testkit::cluster::{cluster_slots, RedisCluster};
use idem_testkit::PgDatabase;
use rand::RngExt;

/// The tests start servers and writers of their own; one at a time keeps
/// the timings they wait on honest on a small machine.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Flags every writer here runs with: a short claim, so that records a
/// killed writer held come back quickly, and a short sweep interval.
const FLAGS: [&str; 6] = [
    "--claim-ms",
    "1500",
    "--sweep-interval",
    "200ms",
    "--topology-interval",
    "1s",
];

async fn wait_library_drained(
    conn: &mut redis::Connection,
    pg: &tokio_postgres::Client,
    rows: i64,
    timeout: Duration,
) -> bool {
    wait_until(timeout, || {
        let backlog = backlog(conn);
        async move { backlog == 0 && row_count(pg).await == rows }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mirrors_the_librarys_records_and_says_so() {
    let _serial = SERIAL.lock().await;
    let redis = start_with_library();
    let db = PgDatabase::create();
    migrate(&db.url).await;
    let pg = connect_pg(&db.url).await;
    let mut conn = redis.conn();

    let writer = WriterProcess::start(&[redis.url()], &db.url, &FLAGS);
    let mut expected = Vec::new();
    for chunk in 0..10 {
        let keys = keys("lib", chunk * 200..(chunk + 1) * 200);
        expected.extend(complete_keys_lib(&mut conn, &keys, 3600).expect("complete"));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let drained = wait_library_drained(&mut conn, &pg, 2000, Duration::from_secs(60)).await;
    assert!(drained, "not drained:\n{}", writer.log_tail());
    let keys: Vec<String> = expected.iter().map(|c| c.key.clone()).collect();
    assert_rows_match(&pg, &records_lib(&mut conn, &keys), &expected).await;

    let (code, text) = writer.http_get("/metrics");
    assert_eq!(code, 200);
    let node = format!("127.0.0.1:{}/0", redis.port);
    let series = |name: &str| format!("{name}{{node=\"{node}\"}}");
    assert_eq!(
        metric(
            &text,
            &format!("idem_writer_node_backend{{node=\"{node}\",backend=\"functions\"}}")
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &text,
            &format!("idem_writer_node_backend{{node=\"{node}\",backend=\"module\"}}")
        ),
        Some(0.0)
    );
    assert!(metric(&text, &series("idem_writer_functions_sweeps_total")).unwrap_or(0.0) >= 1.0);
    assert!(metric(&text, &series("idem_writer_functions_claimed_total")).unwrap_or(0.0) >= 2000.0);
    assert_eq!(
        metric(&text, &series("idem_writer_records_mirrored_total")),
        Some(2000.0)
    );
    assert_eq!(writer.http_get("/healthz").0, 200);
}

/// Holds `idempotency_keys` locked (so the writer's upsert waits), until
/// dropped or released.
struct TableLock {
    client: tokio_postgres::Client,
}

impl TableLock {
    async fn take(url: &str) -> Self {
        let client = connect_pg(url).await;
        client
            .batch_execute("BEGIN; LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE")
            .await
            .expect("lock idempotency_keys");
        TableLock { client }
    }

    /// Ends every other session of the database (a killed writer's upsert
    /// still waiting on the lock dies with it, as in a machine crash), then
    /// releases the lock.
    async fn release_after_crash(self) {
        self.client
            .batch_execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                 WHERE datname = current_database() AND pid <> pg_backend_pid();
                 COMMIT",
            )
            .await
            .expect("end the writer's sessions and unlock");
    }
}

/// Completes 300 records, runs a writer (with `env`) until it has claimed
/// some and is stuck committing them behind a table lock, SIGKILLs it,
/// then runs a sound writer: `(rows in Postgres, completions)` once the
/// outboxes are empty.
async fn kill_between_claim_and_commit(env: &[(&str, &str)]) -> (i64, usize, String) {
    let redis = start_with_library();
    let db = PgDatabase::create();
    migrate(&db.url).await;
    let mut conn = redis.conn();
    let keys = keys("crash", 0..300);
    let expected = complete_keys_lib(&mut conn, &keys, 3600).expect("complete");

    let lock = TableLock::take(&db.url).await;
    let mut flags = FLAGS.to_vec();
    flags.extend(["--batch-size", "100"]);
    let mut writer = WriterProcess::start_env(&[redis.url()], &db.url, &flags, env);
    let node = format!("127.0.0.1:{}/0", redis.port);
    let claimed = format!("idem_writer_functions_claimed_total{{node=\"{node}\"}}");
    let in_flight = wait_until(Duration::from_secs(20), || {
        let n = metric(&writer.http_get("/metrics").1, &claimed).unwrap_or(0.0);
        async move { n >= 200.0 }
    })
    .await;
    assert!(
        in_flight,
        "the writer claimed nothing:\n{}",
        writer.log_tail()
    );
    let log = writer.log_tail();
    writer.kill();
    lock.release_after_crash().await;
    let pg = connect_pg(&db.url).await;
    assert_eq!(row_count(&pg).await, 0, "a commit got through the lock");

    let writer = WriterProcess::start(&[redis.url()], &db.url, &FLAGS);
    let drained = wait_until(Duration::from_secs(30), || {
        let backlog = backlog(&mut conn);
        async move { backlog == 0 }
    })
    .await;
    assert!(drained, "outboxes not drained:\n{}", writer.log_tail());
    // The last batch acknowledged is committed first: nothing is in flight.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rows = row_count(&pg).await;
    if rows == expected.len() as i64 {
        assert_rows_match(&pg, &records_lib(&mut conn, &keys), &expected).await;
    }
    (rows, expected.len(), log)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_killed_before_its_ack_loses_nothing() {
    let _serial = SERIAL.lock().await;
    let (rows, expected, log) = kill_between_claim_and_commit(&[]).await;
    assert_eq!(rows, expected as i64, "records lost; first writer:\n{log}");
}

/// The same crash with the protection off: acknowledged before committed,
/// the records in flight are gone from the outbox and never reach Postgres.
#[cfg(feature = "fault-injection")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn teeth_acking_before_committing_loses_the_records_in_flight() {
    let _serial = SERIAL.lock().await;
    let fault = [("IDEM_WRITER_FAULT", "ack-before-commit")];
    let (rows, expected, _) = kill_between_claim_and_commit(&fault).await;
    eprintln!("teeth: {rows} of {expected} records reached Postgres");
    assert!(
        rows <= expected as i64 - 200,
        "{rows} of {expected}: the crash lost nothing, so the test cannot see a loss"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_completion_is_mirrored_across_writer_crashes() {
    const TOTAL: usize = 6000;
    let _serial = SERIAL.lock().await;
    let redis = start_with_library();
    let db = PgDatabase::create();
    migrate(&db.url).await;
    let pg = connect_pg(&db.url).await;
    install_regression_trap(&pg).await;

    let client = redis.client();
    let generator = std::thread::spawn(move || {
        let mut conn = client.get_connection().expect("connect");
        let mut done = Vec::with_capacity(TOTAL);
        for c in 0..TOTAL / 200 {
            let keys = keys("storm", c * 200..(c + 1) * 200);
            done.extend(complete_keys_lib(&mut conn, &keys, 3600).expect("complete"));
            std::thread::sleep(Duration::from_millis(40));
        }
        done
    });
    let mut flags = FLAGS.to_vec();
    flags.extend(["--batch-size", "300"]);
    let urls = [redis.url()];
    let mut writer = WriterProcess::start(&urls, &db.url, &flags);
    let mut kills = 0;
    while !generator.is_finished() || kills < 6 {
        let pause = rand::rng().random_range(100..600);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        writer.kill();
        kills += 1;
        writer = WriterProcess::start(&urls, &db.url, &flags);
    }
    let expected = generator.join().expect("generator");
    let mut conn = redis.conn();
    let drained = wait_library_drained(&mut conn, &pg, TOTAL as i64, Duration::from_secs(90)).await;
    assert!(drained, "not drained:\n{}", writer.log_tail());
    let keys: Vec<String> = expected.iter().map(|c| c.key.clone()).collect();
    assert_rows_match(&pg, &records_lib(&mut conn, &keys), &expected).await;
    assert_no_regressions(&pg).await;
}

/// Slot → port of the primary serving it, as node 0 sees it.
fn slot_ports(cluster: &RedisCluster) -> HashMap<u16, u16> {
    let mut owners = HashMap::new();
    for (from, to, port) in cluster_slots(&mut cluster.conn(0)) {
        for slot in from..=to {
            owners.insert(slot, port);
        }
    }
    owners
}

fn node_of_port(cluster: &RedisCluster, port: u16) -> usize {
    cluster
        .nodes
        .iter()
        .position(|n| n.port == port)
        .expect("a node on that port")
}

/// Completes `keys` on the primaries serving them.
fn complete_in_cluster(cluster: &RedisCluster, keys: &[String]) -> Vec<Completion> {
    let owners = slot_ports(cluster);
    let mut by_port: HashMap<u16, Vec<String>> = HashMap::new();
    for key in keys {
        let port = owners[&key_slot(key.as_bytes())];
        by_port.entry(port).or_default().push(key.clone());
    }
    let mut done = Vec::new();
    for (port, keys) in by_port {
        let mut conn = cluster.conn(node_of_port(cluster, port));
        done.extend(complete_keys_lib(&mut conn, &keys, 3600).expect("complete"));
    }
    done
}

/// Records and outbox backlog across the cluster, each read on its primary.
fn cluster_state(
    cluster: &RedisCluster,
    keys: &[String],
) -> (HashMap<String, idem_core::Record>, i64) {
    let owners = slot_ports(cluster);
    let mut by_port: HashMap<u16, Vec<String>> = HashMap::new();
    let mut slots_of: HashMap<u16, Vec<u16>> = HashMap::new();
    for (&slot, &port) in &owners {
        slots_of.entry(port).or_default().push(slot);
    }
    for key in keys {
        let port = owners[&key_slot(key.as_bytes())];
        by_port.entry(port).or_default().push(key.clone());
    }
    let mut records = HashMap::new();
    let mut backlog = 0;
    for (port, slots) in slots_of {
        let mut conn = cluster.conn(node_of_port(cluster, port));
        backlog += outbox_backlog(&mut conn, slots);
        if let Some(keys) = by_port.get(&port) {
            records.extend(records_lib(&mut conn, keys));
        }
    }
    (records, backlog)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_library_cluster_is_mirrored_through_a_reshard() {
    let _serial = SERIAL.lock().await;
    let mut cluster = start_library_cluster(3, 0, 3000);
    let db = PgDatabase::create();
    migrate(&db.url).await;
    let pg = connect_pg(&db.url).await;
    let seed = cluster.nodes[0].url();
    let mut flags = FLAGS.to_vec();
    flags.extend(["--redis-cluster", seed.as_str()]);
    let writer = WriterProcess::start(&[], &db.url, &flags);

    // Spread over every primary.
    let mut expected = complete_in_cluster(&cluster, &keys("spread", 0..3000));
    // Records of one slot, claimed by the writer and stuck behind a table
    // lock while their slot moves to another primary.
    let lock = TableLock::take(&db.url).await;
    let moving: Vec<String> = (0..200).map(|i| format!("{{mv}}:k{i:04}")).collect();
    expected.extend(complete_in_cluster(&cluster, &moving));
    let slot = key_slot(b"mv");
    let from = cluster.owner_of_slot(slot);
    let to = (from + 1) % 3;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    cluster.migrate_slot(slot, from, to);
    lock.client
        .batch_execute("COMMIT")
        .await
        .expect("unlock idempotency_keys");
    expected.extend(complete_in_cluster(&cluster, &keys("after", 0..1000)));

    let keys: Vec<String> = expected.iter().map(|c| c.key.clone()).collect();
    let total = expected.len() as i64;
    let pg_ref = &pg;
    let drained = wait_until(Duration::from_secs(60), || {
        let (_, backlog) = cluster_state(&cluster, &keys);
        async move { backlog == 0 && row_count(pg_ref).await == total }
    })
    .await;
    assert!(drained, "not drained:\n{}", writer.log_tail());
    let (records, _) = cluster_state(&cluster, &keys);
    assert_rows_match(&pg, &records, &expected).await;
    let text = writer.http_get("/metrics").1;
    for port in cluster.nodes.iter().map(|n| n.port) {
        let series = format!(
            "idem_writer_node_backend{{node=\"127.0.0.1:{port}/0\",backend=\"functions\"}}"
        );
        assert_eq!(metric(&text, &series), Some(1.0), "{series}");
    }
}

/// A node running neither is reported (`backend="none"`, `/healthz` 503)
/// and asked again; once the library is loaded it is mirrored. A node with
/// the module is found to run the module.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backend_is_asked_of_each_node_until_it_has_one() {
    let _serial = SERIAL.lock().await;
    let plain = idem_testkit::cluster::library::start_plain(&[]);
    let module = idem_testkit::RedisServer::start();
    let db = PgDatabase::create();
    migrate(&db.url).await;
    let pg = connect_pg(&db.url).await;
    let writer = WriterProcess::start(&[plain.url(), module.url()], &db.url, &FLAGS);
    let backend = |port: u16, backend: &str| {
        format!("idem_writer_node_backend{{node=\"127.0.0.1:{port}/0\",backend=\"{backend}\"}}")
    };
    let reported = wait_until(Duration::from_secs(20), || {
        let text = writer.http_get("/metrics").1;
        let none = metric(&text, &backend(plain.port, "none"));
        let found = metric(&text, &backend(module.port, "module"));
        async move { none == Some(1.0) && found == Some(1.0) }
    })
    .await;
    assert!(reported, "{}", writer.http_get("/metrics").1);
    assert_eq!(writer.http_get("/healthz").0, 503);

    let mut conn = plain.conn();
    idem_testkit::cluster::library::load_library(&mut conn);
    let expected = complete_keys_lib(&mut conn, &keys("late", 0..50), 3600).expect("complete");
    let drained = wait_library_drained(&mut conn, &pg, 50, Duration::from_secs(30)).await;
    assert!(drained, "not drained:\n{}", writer.log_tail());
    let keys: Vec<String> = expected.iter().map(|c| c.key.clone()).collect();
    assert_rows_match(&pg, &records_lib(&mut conn, &keys), &expected).await;
    let text = writer.http_get("/metrics").1;
    assert_eq!(metric(&text, &backend(plain.port, "functions")), Some(1.0));
    assert_eq!(metric(&text, &backend(plain.port, "none")), Some(0.0));
    // Health follows each node's next successful round, which can come a
    // sweep after the metrics above: wait for it rather than race it.
    let healthy = wait_until(Duration::from_secs(20), || {
        let status = writer.http_get("/healthz").0;
        async move { status == 200 }
    })
    .await;
    assert!(healthy, "{}", writer.log_tail());
}
