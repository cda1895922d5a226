//! The fence's SQL protocol against a real Postgres, in both shapes (a
//! durable claim then a short completing transaction; claim and completion
//! in one transaction): many concurrent claims of one key commit one effect,
//! a stale token never commits over a newer one, a live claim keeps retries
//! out until its lease lapses and a holder that lost its key commits
//! nothing, expired rows are reused, mismatches and open holders are
//! refused, and the writer's upsert and cleanup agree with fence rows; on
//! both layouts of `idempotency_keys`. On the partitioned one, the writer and the
//! fence racing on one key keep one row (and the naive `ON CONFLICT (key,
//! expires_at)` would not).

use std::time::{Duration, SystemTime};

use deadpool_postgres::{Manager, Pool};
use futures_util::future::join_all;
use idem_client::{Claim, Commit, Fence, Hold, StoredResponse, TableLayout};
use idem_testkit::PgDatabase;
use idem_writer::MirrorRecord;
use tokio_postgres::{Client, NoTls};

const TTL: Duration = Duration::from_secs(3600);

fn writer_layout(layout: TableLayout) -> idem_writer::Layout {
    match layout {
        TableLayout::Unpartitioned => idem_writer::Layout::Unpartitioned,
        TableLayout::Partitioned => idem_writer::Layout::Partitioned,
    }
}

async fn database(layout: TableLayout) -> (PgDatabase, Client) {
    let db = PgDatabase::create();
    let mut client = db.connect().await;
    idem_writer::migrate_with_layout(&mut client, writer_layout(layout))
        .await
        .expect("migrate");
    client
        .batch_execute("CREATE TABLE effects (key TEXT NOT NULL, token BIGINT NOT NULL)")
        .await
        .expect("effects table");
    (db, client)
}

fn new_fence(
    layout: TableLayout,
    key: &str,
    token: u64,
    fingerprint: &[u8],
    ttl: Duration,
) -> Fence {
    Fence::new(key, token, fingerprint, ttl).with_layout(layout)
}

/// The writer's batch upsert on `layout`, partitions created first.
async fn writer_upsert(client: &Client, layout: TableLayout, records: &[MirrorRecord]) -> u64 {
    use idem_writer::partitions::{day_of_ms, ensure_days};
    use idem_writer::store::{upsert_with, Statements};
    use idem_writer::store::{LOCK_KEYS_SQL, PARTITIONED_UPSERT_SQL, UPSERT_SQL};
    match layout {
        TableLayout::Unpartitioned => {
            let upsert = client.prepare(UPSERT_SQL).await.unwrap();
            upsert_with(client, Statements::Unpartitioned(&upsert), records).await
        }
        TableLayout::Partitioned => {
            ensure_days(client, records.iter().map(|r| day_of_ms(r.expires_at_ms)))
                .await
                .unwrap();
            let lock = client.prepare(LOCK_KEYS_SQL).await.unwrap();
            let upsert = client.prepare(PARTITIONED_UPSERT_SQL).await.unwrap();
            let statements = Statements::Partitioned {
                lock: &lock,
                upsert: &upsert,
            };
            upsert_with(client, statements, records).await
        }
    }
    .expect("writer upsert")
}

fn response(token: u64) -> StoredResponse {
    StoredResponse::new(201, format!("{{\"token\":{token}}}"))
        .with_header("content-type", "application/json")
}

/// One request in two phases: a durable claim, and on `Proceed` a short
/// transaction recording the effect and committing it with the response
/// through the fence. A holder that lost the key answers what it holds.
async fn attempt(client: &mut Client, fence: &Fence) -> Claim {
    let claim = fence.claim(&mut *client).await.expect("claim");
    if claim != Claim::Proceed {
        return claim;
    }
    let tx = client.transaction().await.expect("begin");
    record_effect(&tx, fence).await;
    match fence
        .commit(tx, &response(fence.token()))
        .await
        .expect("commit")
    {
        Commit::Committed => Claim::Proceed,
        Commit::Lost(claim) => claim,
    }
}

/// One request in one transaction: claim, effect and completion.
async fn attempt_in(client: &mut Client, fence: &Fence) -> Claim {
    let tx = client.transaction().await.expect("begin");
    let claim = fence.claim_in(&tx).await.expect("claim");
    if claim == Claim::Proceed {
        record_effect(&tx, fence).await;
        assert_eq!(
            fence
                .commit(tx, &response(fence.token()))
                .await
                .expect("commit"),
            Commit::Committed
        );
    }
    claim
}

async fn record_effect(tx: &tokio_postgres::Transaction<'_>, fence: &Fence) {
    let token = i64::try_from(fence.token()).unwrap();
    tx.execute(
        "INSERT INTO effects (key, token) VALUES ($1, $2)",
        &[&fence.key(), &token],
    )
    .await
    .expect("effect");
}

/// Whether `client`'s session is outside a transaction (idle), as `check`
/// sees it.
async fn outside_transaction(client: &Client, check: &Client) -> bool {
    let pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0);
    let state: String = check
        .query_one("SELECT state FROM pg_stat_activity WHERE pid = $1", &[&pid])
        .await
        .expect("state")
        .get(0);
    state == "idle"
}

async fn effects(client: &Client, key: &str) -> Vec<i64> {
    client
        .query("SELECT token FROM effects WHERE key = $1", &[&key])
        .await
        .expect("effects")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

async fn row(client: &Client, key: &str) -> Option<(String, i64, Option<i32>)> {
    client
        .query_opt(
            "SELECT status, token, response_status FROM idempotency_keys WHERE key = $1",
            &[&key],
        )
        .await
        .expect("row")
        .map(|r| (r.get(0), r.get(1), r.get(2)))
}

idem_testkit::both_layouts!(
    idem_client::TableLayout,
    concurrent_claims_commit_exactly_one_effect
);
async fn concurrent_claims_commit_exactly_one_effect(layout: TableLayout) {
    let (db, client) = database(layout).await;
    for round in 0..5 {
        let key = format!("k-{round}");
        // 24 holders with distinct tokens (as takeovers would hand out), each
        // on its own connection, retrying while the key is in flight; even
        // rounds in two phases, odd ones in one transaction.
        let tasks = (1..=24u64).map(|token| {
            let (url, key) = (db.url.clone(), key.clone());
            tokio::spawn(async move {
                let (mut client, conn) = tokio_postgres::connect(&url, NoTls).await.unwrap();
                tokio::spawn(conn);
                let fence = new_fence(layout, &key, 1000 + token, b"fp", TTL);
                loop {
                    let answer = if round % 2 == 0 {
                        attempt(&mut client, &fence).await
                    } else {
                        attempt_in(&mut client, &fence).await
                    };
                    match answer {
                        Claim::InFlight => tokio::time::sleep(Duration::from_millis(2)).await,
                        other => return other,
                    }
                }
            })
        });
        let answers: Vec<Claim> = join_all(tasks)
            .await
            .into_iter()
            .map(|r| r.unwrap())
            .collect();
        let winners = effects(&client, &key).await;
        assert_eq!(winners.len(), 1, "one effect per key: {winners:?}");
        let winner = u64::try_from(winners[0]).unwrap();
        let proceeded = answers.iter().filter(|a| **a == Claim::Proceed).count();
        assert_eq!(proceeded, 1);
        for answer in &answers {
            match answer {
                Claim::Proceed => {}
                Claim::Replay(stored) => assert_eq!(*stored, response(winner)),
                other => panic!("unexpected {other:?}"),
            }
        }
        let (status, token, response_status) = row(&client, &key).await.unwrap();
        assert_eq!(
            (status.as_str(), token, response_status),
            ("completed", winners[0], Some(201))
        );
    }
}

idem_testkit::both_layouts!(
    idem_client::TableLayout,
    an_open_holder_makes_others_in_flight_and_a_rollback_frees_the_key
);
async fn an_open_holder_makes_others_in_flight_and_a_rollback_frees_the_key(layout: TableLayout) {
    let (db, mut first) = database(layout).await;
    let mut second = db.connect().await;
    let older = new_fence(layout, "k", 10, b"fp", TTL);
    let newer = new_fence(layout, "k", 20, b"fp", TTL);

    let holding = first.transaction().await.unwrap();
    assert_eq!(older.claim_in(&holding).await.unwrap(), Claim::Proceed);
    // The older holder's transaction is open: the newer one is told at once.
    let started = std::time::Instant::now();
    assert_eq!(attempt(&mut second, &newer).await, Claim::InFlight);
    assert!(started.elapsed() < Duration::from_secs(1), "no waiting");
    // Claiming twice in one transaction is harmless.
    assert_eq!(older.claim_in(&holding).await.unwrap(), Claim::Proceed);
    holding.rollback().await.unwrap();
    assert_eq!(
        row(&second, "k").await,
        None,
        "the claim rolled back with it"
    );

    assert_eq!(attempt(&mut second, &newer).await, Claim::Proceed);
    assert_eq!(effects(&second, "k").await, vec![20]);
}

idem_testkit::both_layouts!(
    idem_client::TableLayout,
    a_stale_token_never_commits_over_a_newer_one
);
async fn a_stale_token_never_commits_over_a_newer_one(layout: TableLayout) {
    let (db, mut client) = database(layout).await;
    let mut other = db.connect().await;
    let stale = new_fence(layout, "k", 10, b"fp", TTL);
    let newer = new_fence(layout, "k", 20, b"fp", TTL);

    assert_eq!(attempt(&mut client, &newer).await, Claim::Proceed);
    // The stale holder wakes up: it gets the newer holder's answer.
    assert_eq!(
        attempt(&mut other, &stale).await,
        Claim::Replay(response(20))
    );
    // Completing without a claim of its own finds the key's answer.
    let tx = other.transaction().await.unwrap();
    assert_eq!(
        stale.complete(&tx, &response(10)).await.unwrap(),
        Commit::Lost(Claim::Replay(response(20)))
    );
    drop(tx);
    assert_eq!(effects(&client, "k").await, vec![20]);
    assert_eq!(row(&client, "k").await.unwrap().1, 20);

    // An uncompleted claim left behind (committed by hand) is taken over by
    // a newer token once its lease lapsed; a newer one is never taken by an
    // older.
    let tx = client.transaction().await.unwrap();
    let lease = Duration::from_millis(200);
    let left = new_fence(layout, "j", 30, b"fp", TTL).with_lease(lease);
    assert_eq!(left.claim_in(&tx).await.unwrap(), Claim::Proceed);
    tx.commit().await.unwrap();
    assert_eq!(
        attempt(&mut client, &new_fence(layout, "j", 40, b"fp", TTL)).await,
        Claim::InFlight,
        "its lease runs"
    );
    tokio::time::sleep(lease).await;
    assert_eq!(
        attempt(&mut client, &new_fence(layout, "j", 25, b"fp", TTL)).await,
        Claim::InFlight
    );
    assert_eq!(
        attempt(&mut client, &new_fence(layout, "j", 40, b"fp", TTL)).await,
        Claim::Proceed
    );
    assert_eq!(effects(&client, "j").await, vec![40]);
}

idem_testkit::both_layouts!(
    idem_client::TableLayout,
    expired_rows_are_reused_and_mismatches_refused
);
async fn expired_rows_are_reused_and_mismatches_refused(layout: TableLayout) {
    let (_db, mut client) = database(layout).await;
    // Completed for another request, expired: reusable by a larger token.
    let old = new_fence(layout, "k", 10, b"old request", Duration::from_millis(1));
    assert_eq!(attempt(&mut client, &old).await, Claim::Proceed);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let fresh = new_fence(layout, "k", 20, b"new request", TTL);
    assert_eq!(attempt(&mut client, &fresh).await, Claim::Proceed);
    assert_eq!(effects(&client, "k").await, vec![10, 20]);
    // But not by a smaller one: that holder is stale.
    let expired = new_fence(layout, "e", 50, b"x", Duration::from_millis(1));
    assert_eq!(attempt(&mut client, &expired).await, Claim::Proceed);
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        attempt(&mut client, &new_fence(layout, "e", 40, b"x", TTL)).await,
        Claim::InFlight
    );

    // Same key, another request: 422, completed or merely claimed.
    assert_eq!(
        attempt(&mut client, &new_fence(layout, "k", 30, b"other", TTL)).await,
        Claim::Mismatch
    );
    assert_eq!(
        new_fence(layout, "m", 30, b"a", TTL)
            .claim(&mut client)
            .await
            .unwrap(),
        Claim::Proceed
    );
    assert_eq!(
        attempt(&mut client, &new_fence(layout, "m", 40, b"b", TTL)).await,
        Claim::Mismatch
    );
    assert_eq!(effects(&client, "k").await, vec![10, 20]);
    assert!(effects(&client, "m").await.is_empty());
}

fn mirror_record(key: &str, token: i64, fingerprint: &[u8]) -> MirrorRecord {
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    MirrorRecord {
        key: key.into(),
        token,
        fingerprint: idem_client::fingerprint::stored_hex(fingerprint),
        status: 200,
        body: b"from the writer".to_vec(),
        headers: Vec::new(),
        created_at_ms: now,
        completed_at_ms: now,
        expires_at_ms: now + 3_600_000,
    }
}

idem_testkit::both_layouts!(
    idem_client::TableLayout,
    the_writer_upsert_and_cleanup_agree_with_fence_rows
);
async fn the_writer_upsert_and_cleanup_agree_with_fence_rows(layout: TableLayout) {
    let (db, mut client) = database(layout).await;
    let fence = new_fence(layout, "k", 20, b"fp", TTL);
    assert_eq!(attempt(&mut client, &fence).await, Claim::Proceed);
    // An older version from the mirror never overwrites the fence's row...
    let n = writer_upsert(&client, layout, &[mirror_record("k", 10, b"fp")]).await;
    assert_eq!(n, 0);
    assert_eq!(
        row(&client, "k").await.unwrap(),
        ("completed".into(), 20, Some(201))
    );
    // ...and a fence claim never overwrites a newer mirrored row.
    writer_upsert(&client, layout, &[mirror_record("w", 50, b"fp")]).await;
    let stale = new_fence(layout, "w", 40, b"fp", TTL);
    let Claim::Replay(stored) = attempt(&mut client, &stale).await else {
        panic!("a mirrored completion is replayed");
    };
    assert_eq!(stored.body, "from the writer");

    // Cleanup removes expired fence rows but not one a transaction holds.
    let short = new_fence(layout, "x", 5, b"fp", Duration::from_millis(1));
    assert_eq!(attempt(&mut client, &short).await, Claim::Proceed);
    let mut holder = db.connect().await;
    let tx = holder.transaction().await.unwrap();
    let held = new_fence(layout, "y", 5, b"fp", Duration::from_millis(1));
    assert_eq!(held.claim_in(&tx).await.unwrap(), Claim::Proceed);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let cleaned = idem_writer::cleanup::clean(&client, 100, 1).await.unwrap();
    match layout {
        TableLayout::Unpartitioned => {
            assert_eq!(cleaned.rows_deleted, 1);
            assert_eq!(row(&client, "x").await, None);
        }
        TableLayout::Partitioned => {
            // Today's partition stays until the day is over; the expired
            // row in it is reusable meanwhile.
            assert!(cleaned.partitions_dropped.is_empty());
            assert_eq!(
                attempt(&mut client, &new_fence(layout, "x", 6, b"other", TTL)).await,
                Claim::Proceed
            );
        }
    }
    fence_commit_after_cleanup(tx, &held).await;
    assert_eq!(row(&client, "y").await.unwrap().0, "completed");
}

idem_testkit::both_layouts!(
    idem_client::TableLayout,
    the_writer_completes_a_claim_left_behind_by_its_own_token
);
/// A claim the middleware made up front for a handler that did not use the
/// fence, and whose release failed, stays `in_progress` with the token Redis
/// then completed (not fenced, for the writer to mirror). The writer
/// completes it: otherwise the row would answer nobody until it expired and,
/// once Redis lost the key, a retry would take it over after its lease and
/// run the handler again. Before the fix the upsert wrote nothing (it only
/// replaced smaller tokens).
async fn the_writer_completes_a_claim_left_behind_by_its_own_token(layout: TableLayout) {
    let (_db, mut client) = database(layout).await;
    let fence = new_fence(layout, "left", 20, b"fp", TTL);
    assert_eq!(fence.claim(&mut client).await.unwrap(), Claim::Proceed);
    let n = writer_upsert(&client, layout, &[mirror_record("left", 20, b"fp")]).await;
    assert_eq!(n, 1, "the completion of the claim's own token is written");
    assert_eq!(
        row(&client, "left").await.unwrap(),
        ("completed".into(), 20, Some(200))
    );
    // The retry Redis lets in after losing the key replays it.
    let retry = new_fence(layout, "left", 30, b"fp", TTL);
    let Claim::Replay(stored) = retry.claim(&mut client).await.unwrap() else {
        panic!("the mirrored completion is replayed");
    };
    assert_eq!(stored.body, "from the writer");
    // Another holder's live claim (a smaller token) still stays untouched.
    let live = new_fence(layout, "live", 40, b"fp", TTL);
    assert_eq!(live.claim(&mut client).await.unwrap(), Claim::Proceed);
    let n = writer_upsert(&client, layout, &[mirror_record("live", 50, b"fp")]).await;
    assert_eq!(n, 0);
    assert_eq!(row(&client, "live").await.unwrap().0, "in_progress");
}

idem_testkit::both_layouts!(
    idem_client::TableLayout,
    a_later_redis_record_never_replaces_the_answer_committed_with_the_effect
);
/// Redis lost the key after the fence committed; a retry got a new, larger
/// token and answered before it claimed (a 402: the first run lowered the
/// balance). The writer mirrors that answer: the committed row stays, and
/// so does the effect it goes with, until the row expires.
async fn a_later_redis_record_never_replaces_the_answer_committed_with_the_effect(
    layout: TableLayout,
) {
    let (_db, mut client) = database(layout).await;
    let fence = new_fence(layout, "paid", 20, b"fp", TTL);
    assert_eq!(attempt(&mut client, &fence).await, Claim::Proceed);
    let mut retry = mirror_record("paid", 30, b"fp");
    retry.status = 402;
    let n = writer_upsert(&client, layout, &[retry.clone()]).await;
    assert_eq!(n, 0, "the retry's answer replaced the committed one");
    assert_eq!(
        row(&client, "paid").await.unwrap(),
        ("completed".into(), 20, Some(201))
    );
    assert_eq!(effects(&client, "paid").await, vec![20]);
    // Once the committed row has expired, the key is free for new answers,
    // and the row the writer leaves is an ordinary one.
    client
        .execute(
            "UPDATE idempotency_keys SET expires_at = now() - interval '1 second' WHERE key = 'paid'",
            &[],
        )
        .await
        .unwrap();
    retry.token = 40;
    assert_eq!(writer_upsert(&client, layout, &[retry]).await, 1);
    assert_eq!(
        row(&client, "paid").await.unwrap(),
        ("completed".into(), 40, Some(402))
    );
    let fenced: bool = client
        .query_one(
            "SELECT fenced FROM idempotency_keys WHERE key = 'paid'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!fenced);
}

async fn fence_commit_after_cleanup(tx: tokio_postgres::Transaction<'_>, fence: &Fence) {
    assert_eq!(
        fence
            .commit(tx, &response(fence.token()))
            .await
            .expect("commit"),
        Commit::Committed
    );
}

idem_testkit::both_layouts!(idem_client::TableLayout, works_with_deadpool_transactions);
async fn works_with_deadpool_transactions(layout: TableLayout) {
    let (db, _client) = database(layout).await;
    let config: tokio_postgres::Config = db.url.parse().unwrap();
    let pool = Pool::builder(Manager::new(config, NoTls))
        .max_size(2)
        .build()
        .unwrap();
    let mut conn = pool.get().await.unwrap();
    let cache_handles = std::sync::Arc::strong_count(&conn.statement_cache);
    let fence = new_fence(layout, "k", 7, b"fp", TTL);
    let tx = conn.transaction().await.unwrap();
    assert_eq!(fence.claim_in(&tx).await.unwrap(), Claim::Proceed);
    assert_eq!(
        fence.commit(tx, &response(7)).await.unwrap(),
        Commit::Committed
    );
    assert_eq!(
        std::sync::Arc::strong_count(&conn.statement_cache),
        cache_handles,
        "the commit keeps no handle on the connection's statement cache"
    );
    let tx = conn.transaction().await.unwrap();
    assert_eq!(
        new_fence(layout, "k", 8, b"fp", TTL)
            .claim_in(&tx)
            .await
            .unwrap(),
        Claim::Replay(response(7))
    );
    drop(tx);
    // Durable claims through the pool and through a pooled connection.
    let durable = new_fence(layout, "d", 9, b"fp", TTL);
    assert_eq!(durable.claim(&pool).await.unwrap(), Claim::Proceed);
    let tx = conn.transaction().await.unwrap();
    assert_eq!(
        durable.commit(tx, &response(9)).await.unwrap(),
        Commit::Committed
    );
    assert_eq!(
        new_fence(layout, "d", 10, b"fp", TTL)
            .claim(&mut conn)
            .await
            .unwrap(),
        Claim::Replay(response(9))
    );
}

/// Writer upserts (token 10, expiring in 2 h) and fence claims (token 20,
/// expiring in 1 h: another partition) racing on the same keys of the
/// partitioned table: each key ends with one row. With `naive`, both sides
/// use `ON CONFLICT (key, expires_at)` instead of the key's lock.
async fn writer_and_fence_race(naive: bool) -> (usize, i64) {
    let layout = TableLayout::Partitioned;
    let (db, client) = database(layout).await;
    let keys: Vec<String> = (0..40).map(|i| format!("race-{i}")).collect();
    let mut tasks = Vec::new();
    for name in &keys {
        let (url, key) = (db.url.clone(), name.clone());
        tasks.push(tokio::spawn(async move {
            let (client, conn) = tokio_postgres::connect(&url, NoTls).await.unwrap();
            tokio::spawn(conn);
            let mut record = mirror_record(&key, 10, b"fp");
            record.expires_at_ms += 3_600_000;
            if naive {
                let sql = idem_writer::store::UPSERT_SQL
                    .replace("ON CONFLICT (key)", "ON CONFLICT (key, expires_at)");
                let upsert = client.prepare(&sql).await.unwrap();
                idem_writer::store::upsert_records(&client, &upsert, &[record])
                    .await
                    .unwrap();
            } else {
                writer_upsert(&client, layout, &[record]).await;
            }
        }));
        let (url, key) = (db.url.clone(), name.clone());
        tasks.push(tokio::spawn(async move {
            let (mut client, conn) = tokio_postgres::connect(&url, NoTls).await.unwrap();
            tokio::spawn(conn);
            if naive {
                let sql = idem_client::fence::CLAIM_SQL
                    .replace("ON CONFLICT (key)", "ON CONFLICT (key, expires_at)");
                let tx = client.transaction().await.unwrap();
                let fp = idem_client::fingerprint::stored_hex(b"fp");
                let unset: Option<&str> = None;
                tx.query(
                    &sql,
                    &[&key, &fp, &20_i64, &3600.0_f64, &30.0_f64, &unset, &unset],
                )
                .await
                .unwrap();
                tx.commit().await.unwrap();
            } else {
                let fence = new_fence(layout, &key, 20, b"fp", TTL);
                while attempt(&mut client, &fence).await == Claim::InFlight {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
        }));
    }
    for task in join_all(tasks).await {
        task.expect("task");
    }
    let duplicated = client
        .query(
            "SELECT key FROM idempotency_keys GROUP BY key HAVING count(*) > 1",
            &[],
        )
        .await
        .unwrap()
        .len();
    let rows: i64 = client
        .query_one("SELECT count(*) FROM idempotency_keys", &[])
        .await
        .unwrap()
        .get(0);
    (duplicated, rows)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writer_and_fence_on_one_key_keep_one_row_when_partitioned() {
    let (duplicated, rows) = writer_and_fence_race(false).await;
    assert_eq!((duplicated, rows), (0, 40));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn teeth_naive_conflict_target_makes_two_rows_per_key_when_partitioned() {
    let (duplicated, rows) = writer_and_fence_race(true).await;
    assert!(
        duplicated > 0,
        "the naive conflict target kept one row per key"
    );
    assert_eq!(rows, 40 + duplicated as i64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unpartitioned_claim_on_a_partitioned_table_says_which_fence_to_use() {
    let (_db, mut client) = database(TableLayout::Partitioned).await;
    let tx = client.transaction().await.unwrap();
    let error = Fence::new("k", 7, b"fp", TTL)
        .claim_in(&tx)
        .await
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("Fence::with_layout(TableLayout::Partitioned)"),
        "{error}"
    );
    drop(tx);
    assert_eq!(row(&client, "k").await, None);
}

/// A holder (token 10) claims and records its payment; a retry (token 20)
/// opens its transaction at `level` and reads (taking its snapshot); the
/// holder commits; the retry claims. Answers the retry's claim, the
/// payments and the key's rows.
async fn claim_after_a_commit_at(
    layout: TableLayout,
    level: tokio_postgres::IsolationLevel,
) -> (Result<Claim, String>, usize, i64) {
    let (db, check) = database(layout).await;
    let (mut a, mut b) = (db.connect().await, db.connect().await);
    let holder = new_fence(layout, "k", 10, b"fp", TTL);
    let retry = new_fence(layout, "k", 20, b"fp", TTL);
    let ta = a.transaction().await.unwrap();
    assert_eq!(holder.claim_in(&ta).await.unwrap(), Claim::Proceed);
    ta.execute("INSERT INTO effects VALUES ('k', 10)", &[])
        .await
        .unwrap();
    let tb = b
        .build_transaction()
        .isolation_level(level)
        .start()
        .await
        .unwrap();
    tb.query("SELECT count(*) FROM effects", &[]).await.unwrap();
    assert_eq!(
        holder.commit(ta, &response(10)).await.unwrap(),
        Commit::Committed
    );
    let claim = retry.claim_in(&tb).await.map_err(|e| e.to_string());
    if claim == Ok(Claim::Proceed) {
        tb.execute("INSERT INTO effects VALUES ('k', 20)", &[])
            .await
            .unwrap();
        assert_eq!(
            retry.commit(tb, &response(20)).await.unwrap(),
            Commit::Committed
        );
    }
    let rows: i64 = check
        .query_one("SELECT count(*) FROM idempotency_keys WHERE key = 'k'", &[])
        .await
        .unwrap()
        .get(0);
    (claim, effects(&check, "k").await.len(), rows)
}

/// Under REPEATABLE READ or SERIALIZABLE the retry's claim is an error on
/// both layouts, and the key keeps one payment and one row. Before, the
/// partitioned claim's snapshot from before the gate missed the holder's
/// committed row: the retry proceeded and committed a second payment (and a
/// second row for the key).
#[tokio::test]
async fn a_claim_in_a_stricter_transaction_never_pays_twice() {
    use tokio_postgres::IsolationLevel::{ReadCommitted, RepeatableRead, Serializable};
    for layout in [TableLayout::Unpartitioned, TableLayout::Partitioned] {
        let (claim, payments, rows) = claim_after_a_commit_at(layout, ReadCommitted).await;
        assert!(
            matches!(claim, Ok(Claim::Replay(_))),
            "{layout:?}: {claim:?}"
        );
        assert_eq!((payments, rows), (1, 1), "{layout:?}");
        for level in [RepeatableRead, Serializable] {
            let (claim, payments, rows) = claim_after_a_commit_at(layout, level).await;
            assert!(claim.is_err(), "{layout:?} {level:?}: {claim:?}");
            assert_eq!((payments, rows), (1, 1), "{layout:?} {level:?}");
        }
    }
}

/// The writer's upsert on the partitioned layout, in a database whose
/// default isolation is REPEATABLE READ, waiting on a fence holder's lock:
/// once the holder commits, the key still has one row. Before, the upsert's
/// snapshot from before the wait missed the holder's row and added another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_writer_keeps_one_row_under_a_repeatable_read_default() {
    let (db, check) = database(TableLayout::Partitioned).await;
    let name: String = check
        .query_one("SELECT current_database()", &[])
        .await
        .unwrap()
        .get(0);
    check
        .batch_execute(&format!(
            "ALTER DATABASE \"{name}\" SET default_transaction_isolation = 'repeatable read'"
        ))
        .await
        .unwrap();
    let mut holder_conn = db.connect().await;
    let writer_conn = db.connect().await;
    let holder = new_fence(TableLayout::Partitioned, "k", 10, b"fp", TTL);
    let tx = holder_conn
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::ReadCommitted)
        .start()
        .await
        .unwrap();
    assert_eq!(holder.claim_in(&tx).await.unwrap(), Claim::Proceed);
    let record = mirror_record("k", 20, b"fp");
    let writer = tokio::spawn(async move {
        writer_upsert(&writer_conn, TableLayout::Partitioned, &[record]).await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        holder.commit(tx, &response(10)).await.unwrap(),
        Commit::Committed
    );
    writer.await.unwrap();
    let rows: i64 = check
        .query_one("SELECT count(*) FROM idempotency_keys WHERE key = 'k'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 1, "two rows for one key");
    // A durable claim runs its two statements at READ COMMITTED whatever
    // the database's default.
    let durable = new_fence(TableLayout::Partitioned, "d", 10, b"fp", TTL);
    assert_eq!(
        durable.claim(&mut holder_conn).await.unwrap(),
        Claim::Proceed
    );
}

idem_testkit::both_layouts!(
    idem_client::TableLayout,
    a_live_claim_keeps_retries_out_until_its_lease_lapses_and_a_holder_that_lost_commits_nothing
);
/// Redis forgot the key: the holder's durable claim (no transaction open)
/// makes a retry in flight while its lease runs; once it lapsed the retry
/// takes the key over and commits; the old holder, awake again, commits
/// nothing and gets the retry's answer. One effect.
async fn a_live_claim_keeps_retries_out_until_its_lease_lapses_and_a_holder_that_lost_commits_nothing(
    layout: TableLayout,
) {
    let (db, mut check) = database(layout).await;
    let (mut a, mut b) = (db.connect().await, db.connect().await);
    let lease = Duration::from_millis(400);
    // A live claim is not the writer's to replace: another request's answer
    // for the key (stored in Redis after it forgot the key, with a larger
    // token) would take the holder's key away after it charged.
    let live = new_fence(layout, "w", 10, b"fp", TTL);
    assert_eq!(live.claim(&mut a).await.unwrap(), Claim::Proceed);
    let n = writer_upsert(&check, layout, &[mirror_record("w", 20, b"other")]).await;
    assert_eq!(n, 0, "the writer replaced a live claim");
    let tx = a.transaction().await.unwrap();
    assert_eq!(
        live.commit(tx, &response(10)).await.unwrap(),
        Commit::Committed
    );
    assert!(outside_transaction(&a, &check).await, "the commit ended it");
    let holder = new_fence(layout, "k", 10, b"fp", TTL).with_lease(lease);
    let retry = new_fence(layout, "k", 20, b"fp", TTL).with_lease(lease);
    assert_eq!(holder.claim(&mut a).await.unwrap(), Claim::Proceed);
    let idle_in_transaction: i64 = check
        .query_one(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        idle_in_transaction, 0,
        "the claim holds no transaction open"
    );
    let started = std::time::Instant::now();
    assert_eq!(attempt(&mut b, &retry).await, Claim::InFlight);
    assert!(started.elapsed() < lease, "told at once");
    tokio::time::sleep(lease).await;
    assert_eq!(attempt(&mut b, &retry).await, Claim::Proceed);

    // The old holder wakes after the takeover.
    let tx = a.transaction().await.unwrap();
    record_effect(&tx, &holder).await;
    assert_eq!(
        holder.commit(tx, &response(10)).await.unwrap(),
        Commit::Lost(Claim::Replay(response(20)))
    );
    assert!(
        outside_transaction(&a, &check).await,
        "the lost commit rolled back"
    );
    assert_eq!(effects(&check, "k").await, vec![20]);
    // A release by the old holder leaves the newer row alone.
    holder.release(&mut check).await.unwrap();
    assert_eq!(
        row(&check, "k").await.unwrap(),
        ("completed".into(), 20, Some(201))
    );

    // Lost before the new holder committed: in flight.
    let first = new_fence(layout, "j", 10, b"fp", TTL).with_lease(lease);
    let second = new_fence(layout, "j", 20, b"fp", TTL).with_lease(lease);
    assert_eq!(first.claim(&mut a).await.unwrap(), Claim::Proceed);
    tokio::time::sleep(lease).await;
    assert_eq!(second.claim(&mut b).await.unwrap(), Claim::Proceed);
    let tx = a.transaction().await.unwrap();
    record_effect(&tx, &first).await;
    assert_eq!(
        first.commit(tx, &response(10)).await.unwrap(),
        Commit::Lost(Claim::InFlight)
    );
    assert!(effects(&check, "j").await.is_empty());
}

idem_testkit::both_layouts!(
    idem_client::TableLayout,
    a_released_claim_lets_a_retry_proceed_at_once
);
async fn a_released_claim_lets_a_retry_proceed_at_once(layout: TableLayout) {
    let (db, mut check) = database(layout).await;
    let config: tokio_postgres::Config = db.url.parse().unwrap();
    let pool = Pool::builder(Manager::new(config, NoTls))
        .max_size(1)
        .build()
        .unwrap();
    let holder = new_fence(layout, "k", 10, b"fp", TTL);
    assert_eq!(holder.claim(&pool).await.unwrap(), Claim::Proceed);
    assert_eq!(
        pool.status().available,
        1,
        "no connection is held between the phases"
    );
    let retry = new_fence(layout, "k", 20, b"fp", TTL);
    assert_eq!(retry.claim(&mut check).await.unwrap(), Claim::InFlight);
    holder.release(&pool).await.unwrap();
    assert_eq!(row(&check, "k").await, None);
    assert_eq!(attempt(&mut check, &retry).await, Claim::Proceed);
    assert_eq!(effects(&check, "k").await, vec![20]);
}

idem_testkit::both_layouts!(
    idem_client::TableLayout,
    a_handler_of_several_phases_holds_the_key_in_each
);
/// Each phase's transaction confirms the key is still held and renews the
/// lease; after a takeover, the stale holder's next phase commits nothing.
async fn a_handler_of_several_phases_holds_the_key_in_each(layout: TableLayout) {
    let (db, mut check) = database(layout).await;
    let mut a = db.connect().await;
    let lease = Duration::from_millis(600);
    let holder = new_fence(layout, "k", 10, b"fp", TTL).with_lease(lease);
    let retry = new_fence(layout, "k", 20, b"fp", TTL).with_lease(lease);
    assert_eq!(holder.claim(&mut a).await.unwrap(), Claim::Proceed);
    for _ in 0..3 {
        tokio::time::sleep(lease / 2).await;
        let tx = a.transaction().await.unwrap();
        assert_eq!(holder.hold(&tx).await.unwrap(), Hold::Held);
        record_effect(&tx, &holder).await;
        tx.commit().await.unwrap();
        assert_eq!(
            retry.claim(&mut check).await.unwrap(),
            Claim::InFlight,
            "the renewed lease runs"
        );
    }
    tokio::time::sleep(lease).await;
    assert_eq!(retry.claim(&mut check).await.unwrap(), Claim::Proceed);
    let tx = a.transaction().await.unwrap();
    assert_eq!(holder.hold(&tx).await.unwrap(), Hold::Lost(Claim::InFlight));
    tx.rollback().await.unwrap();
    assert_eq!(effects(&check, "k").await, vec![10, 10, 10]);
}

/// A `FenceTransaction` whose statement cache is cleared after its first
/// lookup, as another task's `statement_caches.clear()` could do: the
/// completion must still reach the server before the COMMIT.
struct CacheClearedAfterFirstLookup<'a> {
    inner: deadpool_postgres::Transaction<'a>,
    lookups: std::sync::atomic::AtomicUsize,
}

impl<'a> idem_client::FenceTransaction<'a> for CacheClearedAfterFirstLookup<'a> {
    fn transaction(&self) -> &tokio_postgres::Transaction<'a> {
        idem_client::FenceTransaction::transaction(&self.inner)
    }
    fn cached_statement<'s>(
        &'s self,
        sql: &'static str,
        types: &'static [tokio_postgres::types::Type],
    ) -> futures_util::future::BoxFuture<
        's,
        Result<Option<tokio_postgres::Statement>, tokio_postgres::Error>,
    > {
        if self
            .lookups
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            == 1
        {
            self.inner.statement_cache.clear();
        }
        idem_client::FenceTransaction::cached_statement(&self.inner, sql, types)
    }
    fn commit(self) -> futures_util::future::BoxFuture<'a, Result<(), tokio_postgres::Error>> {
        idem_client::FenceTransaction::commit(self.inner)
    }
    fn rollback(self) -> futures_util::future::BoxFuture<'a, Result<(), tokio_postgres::Error>> {
        idem_client::FenceTransaction::rollback(self.inner)
    }
    fn end_committed(self) {
        idem_client::FenceTransaction::end_committed(self.inner)
    }
}

idem_testkit::both_layouts!(
    idem_client::TableLayout,
    a_statement_cache_cleared_midway_never_lets_the_commit_go_first
);
/// The key lost, the cache cleared between the completion's lookup and any
/// later one: nothing of the holder's transaction commits.
async fn a_statement_cache_cleared_midway_never_lets_the_commit_go_first(layout: TableLayout) {
    let (db, check) = database(layout).await;
    let config: tokio_postgres::Config = db.url.parse().unwrap();
    let pool = Pool::builder(Manager::new(config, NoTls))
        .max_size(1)
        .build()
        .unwrap();
    let mut conn = pool.get().await.unwrap();
    let lease = Duration::from_millis(200);
    let holder = new_fence(layout, "race", 10, b"fp", TTL).with_lease(lease);
    assert_eq!(holder.claim(&mut conn).await.unwrap(), Claim::Proceed);
    tokio::time::sleep(lease).await;
    let mut other = db.connect().await;
    let retry = new_fence(layout, "race", 20, b"fp", TTL);
    assert_eq!(retry.claim(&mut other).await.unwrap(), Claim::Proceed);
    let tx = conn.transaction().await.unwrap();
    tx.execute("INSERT INTO effects (key, token) VALUES ('race', 10)", &[])
        .await
        .unwrap();
    let tx = CacheClearedAfterFirstLookup {
        inner: tx,
        lookups: Default::default(),
    };
    assert_eq!(
        holder.commit(tx, &response(10)).await.unwrap(),
        Commit::Lost(Claim::InFlight)
    );
    assert!(
        effects(&check, "race").await.is_empty(),
        "the lost holder's effect committed"
    );
    assert_eq!(
        row(&check, "race").await.unwrap(),
        ("in_progress".into(), 20, None)
    );
}

/// Partitioned layout: a takeover that moves the row to another partition
/// while the holder's completion waits for the gate makes the completion a
/// serialization failure (under READ COMMITTED too); `commit` answers what
/// the key holds, as for any lost key, and commits nothing.
#[tokio::test]
async fn a_takeover_moving_the_row_while_the_completion_waits_is_lost() {
    moved_while_completing(|mut a, holder| async move {
        let tx = a.transaction().await.unwrap();
        tx.execute("INSERT INTO effects (key, token) VALUES ('moved', 10)", &[])
            .await
            .unwrap();
        holder.commit(tx, &response(10)).await
    })
    .await;
}

/// The holder of key `moved` completes with `complete` (its effect a row of
/// `effects`) while a takeover that moves the row to another partition
/// holds the gate: the completion is lost and nothing is committed.
async fn moved_while_completing<F, Fut>(complete: F)
where
    F: FnOnce(Client, Fence) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<Commit, idem_client::IdemError>> + Send + 'static,
{
    use idem_writer::partitions::{day_of_ms, ensure_days};
    let layout = TableLayout::Partitioned;
    let (db, check) = database(layout).await;
    let now_ms = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let today = day_of_ms(now_ms);
    ensure_days(&check, today..=today + 3).await.unwrap();
    let (mut a, mut b) = (db.connect().await, db.connect().await);
    let lease = Duration::from_millis(200);
    let holder = new_fence(layout, "moved", 10, b"fp", TTL)
        .with_lease(lease)
        .with_idle_timeout(Some(Duration::from_secs(5)));
    assert_eq!(holder.claim(&mut a).await.unwrap(), Claim::Proceed);
    tokio::time::sleep(lease).await;
    // The takeover, its expiry two days later (another partition), holds
    // the gate in its open transaction.
    let takeover = new_fence(layout, "moved", 20, b"fp", Duration::from_secs(2 * 86_400));
    let tb = b.transaction().await.unwrap();
    assert_eq!(takeover.claim_in(&tb).await.unwrap(), Claim::Proceed);
    let completing = tokio::spawn(complete(a, holder));
    tokio::time::sleep(Duration::from_millis(300)).await;
    tb.commit().await.unwrap();
    assert_eq!(
        completing.await.unwrap().unwrap(),
        Commit::Lost(Claim::InFlight)
    );
    assert!(effects(&check, "moved").await.is_empty());
}

// ------------------------------------------------- the one-statement commit

/// The effect `Fence::commit_effect` runs in these tests: one row of
/// `effects` (`$7` key, `$8` token).
const EFFECT: &str = "INSERT INTO effects (key, token) VALUES ($7, $8)";

/// [`attempt`] with the completion and the effect in one statement.
async fn attempt_in_one_statement(client: &mut Client, fence: &Fence) -> Claim {
    let claim = fence.claim(&mut *client).await.expect("claim");
    if claim != Claim::Proceed {
        return claim;
    }
    let token = i64::try_from(fence.token()).unwrap();
    let committed = fence
        .commit_effect(
            &mut *client,
            &response(fence.token()),
            EFFECT,
            &[&fence.key(), &token],
        )
        .await
        .expect("commit_effect");
    match committed {
        Commit::Committed => Claim::Proceed,
        Commit::Lost(claim) => claim,
    }
}

idem_testkit::both_layouts!(
    idem_client::TableLayout,
    the_one_statement_commit_writes_the_effect_with_the_row_or_nothing
);
/// `commit_effect` commits the effect and the key's answer together; a
/// holder that lost the key (its lease lapsed, a retry took it over)
/// commits neither and answers what the key holds; concurrent holders of
/// one key commit one effect.
async fn the_one_statement_commit_writes_the_effect_with_the_row_or_nothing(layout: TableLayout) {
    let (db, check) = database(layout).await;
    let (mut a, mut b) = (db.connect().await, db.connect().await);
    let first = new_fence(layout, "k", 10, b"fp", TTL);
    assert_eq!(
        attempt_in_one_statement(&mut a, &first).await,
        Claim::Proceed
    );
    assert_eq!(effects(&check, "k").await, vec![10]);
    assert_eq!(
        row(&check, "k").await.unwrap(),
        ("completed".into(), 10, Some(201))
    );
    assert!(outside_transaction(&a, &check).await);
    let again = new_fence(layout, "k", 11, b"fp", TTL);
    assert_eq!(
        attempt_in_one_statement(&mut b, &again).await,
        Claim::Replay(response(10))
    );

    // The holder wakes after a takeover that committed: Lost, nothing written.
    let lease = Duration::from_millis(300);
    let holder = new_fence(layout, "t", 10, b"fp", TTL).with_lease(lease);
    let retry = new_fence(layout, "t", 20, b"fp", TTL).with_lease(lease);
    assert_eq!(holder.claim(&mut a).await.unwrap(), Claim::Proceed);
    tokio::time::sleep(lease).await;
    assert_eq!(
        attempt_in_one_statement(&mut b, &retry).await,
        Claim::Proceed
    );
    assert_eq!(
        holder
            .commit_effect(&mut a, &response(10), EFFECT, &[&"t", &10_i64])
            .await
            .unwrap(),
        Commit::Lost(Claim::Replay(response(20)))
    );
    assert_eq!(effects(&check, "t").await, vec![20]);

    // Lost before the new holder committed: in flight, nothing written.
    let first = new_fence(layout, "j", 10, b"fp", TTL).with_lease(lease);
    let second = new_fence(layout, "j", 20, b"fp", TTL).with_lease(lease);
    assert_eq!(first.claim(&mut a).await.unwrap(), Claim::Proceed);
    tokio::time::sleep(lease).await;
    assert_eq!(second.claim(&mut b).await.unwrap(), Claim::Proceed);
    assert_eq!(
        first
            .commit_effect(&mut a, &response(10), EFFECT, &[&"j", &10_i64])
            .await
            .unwrap(),
        Commit::Lost(Claim::InFlight)
    );
    assert!(effects(&check, "j").await.is_empty());

    // Holders racing on fresh keys, each on its own connection.
    for round in 0..3 {
        let key = format!("race-{round}");
        let mut clients = Vec::new();
        for _ in 0..4 {
            clients.push(db.connect().await);
        }
        let answers = join_all(clients.iter_mut().enumerate().map(|(i, client)| {
            let fence = new_fence(layout, &key, 100 + i as u64, b"fp", TTL);
            async move { attempt_in_one_statement(client, &fence).await }
        }))
        .await;
        let proceeded = answers.iter().filter(|a| **a == Claim::Proceed).count();
        assert!(proceeded <= 1, "{answers:?}");
        assert_eq!(effects(&check, &key).await.len(), proceeded, "{answers:?}");
    }
}

idem_testkit::both_layouts!(
    idem_client::TableLayout,
    a_failing_or_refused_effect_commits_nothing_and_keeps_the_claim
);
/// An effect that fails (a constraint) fails the completion with it; one
/// that is not an INSERT, UPDATE or DELETE is refused before anything is
/// sent. Either way nothing is committed and the claim stays the holder's,
/// which then commits through a pool.
async fn a_failing_or_refused_effect_commits_nothing_and_keeps_the_claim(layout: TableLayout) {
    let (db, check) = database(layout).await;
    let config: tokio_postgres::Config = db.url.parse().unwrap();
    let pool = Pool::builder(Manager::new(config, NoTls))
        .max_size(2)
        .build()
        .unwrap();
    let fence = new_fence(layout, "f", 10, b"fp", TTL);
    assert_eq!(fence.claim(&pool).await.unwrap(), Claim::Proceed);
    let null: Option<i64> = None;
    let failed = fence
        .commit_effect(&pool, &response(10), EFFECT, &[&"f", &null])
        .await;
    assert!(
        matches!(&failed, Err(idem_client::IdemError::Postgres(m)) if m.contains("23502")),
        "{failed:?}"
    );
    for refused in [
        "SELECT $7::text, $8::int8",
        "",
        "WITH x AS (SELECT 1) SELECT 1",
    ] {
        let answer = fence
            .commit_effect(&pool, &response(10), refused, &[&"f", &10_i64])
            .await;
        assert!(
            matches!(answer, Err(idem_client::IdemError::BadArg(_))),
            "{refused:?}: {answer:?}"
        );
    }
    assert!(effects(&check, "f").await.is_empty());
    assert_eq!(
        row(&check, "f").await.unwrap(),
        ("in_progress".into(), 10, None)
    );
    let with_semicolon = format!("{EFFECT};");
    assert_eq!(
        fence
            .commit_effect(&pool, &response(10), &with_semicolon, &[&"f", &10_i64])
            .await
            .unwrap(),
        Commit::Committed
    );
    assert_eq!(effects(&check, "f").await, vec![10]);

    // The completion commits whatever rows the effect wrote, none included
    // (documented: an effect that may write none belongs in a transaction).
    let none = new_fence(layout, "n", 10, b"fp", TTL);
    assert_eq!(none.claim(&pool).await.unwrap(), Claim::Proceed);
    let matches_nothing = "UPDATE effects SET token = $8 WHERE key = $7 AND false";
    assert_eq!(
        none.commit_effect(&pool, &response(10), matches_nothing, &[&"n", &10_i64])
            .await
            .unwrap(),
        Commit::Committed
    );
    assert_eq!(
        row(&check, "n").await.unwrap(),
        ("completed".into(), 10, Some(201))
    );
}

/// Partitioned layout: a takeover that moves the row to another partition
/// while the holder's one-statement commit waits for the gate is lost, as
/// with `commit`, and commits nothing.
#[tokio::test]
async fn a_takeover_moving_the_row_while_the_one_statement_commit_waits_is_lost() {
    moved_while_completing(|mut a, holder| async move {
        holder
            .commit_effect(&mut a, &response(10), EFFECT, &[&"moved", &10_i64])
            .await
    })
    .await;
}
