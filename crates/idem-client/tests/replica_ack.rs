//! The replica acknowledgement after COMPLETE, against a real primary with
//! the module and a real replica: `IdemClient::complete_replicated` and the
//! layer's `replica_ack`. Met with one replica in sync; missed with the
//! replica frozen (SIGSTOP), where the layer answers 503 and keeps the key
//! completed, so the retry replays it; with the fence, a committed answer
//! not acknowledged is 503 too, and after Redis lost it the retry replays
//! the fence's row; settings that cannot work refused before anything is
//! sent.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Extension, Router};
use common::{idem_get, new_token, post as http_post, state_of, Server};
use idem_client::middleware::prometheus_client::registry::Registry;
use idem_client::middleware::{metric_names, LayerMetrics};
use idem_client::{
    BeginOptions, Claim, Commit, Fence, IdemClient, IdemError, IdempotencyLayer, Origin,
    ReadThrough, StoredResponse,
};
use idem_testkit::{PgDatabase, RedisServer};

const TTL: Duration = Duration::from_secs(3600);

/// A primary and a replica in sync with it.
fn primary_and_replica() -> (RedisServer, RedisServer) {
    let primary = RedisServer::start();
    let replica = RedisServer::start_replica_of(&primary);
    (primary, replica)
}

async fn client_of(server: &RedisServer) -> IdemClient<idem_client::StandaloneConnection> {
    IdemClient::standalone(server.client()).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_replicated_answers_the_replicas_that_hold_the_response() {
    let (primary, replica) = primary_and_replica();
    let client = client_of(&primary).await;
    let options = BeginOptions::new(TTL);
    let token = new_token(&client, "k", b"fp", options).await;
    let response = StoredResponse::new(201, "{\"id\":1}");
    let started = Instant::now();
    let acked = client
        .complete_replicated(
            "k",
            token,
            &response,
            Origin::Handler,
            1,
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    assert_eq!(acked, 1);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "WAIT returned at once: {:?}",
        started.elapsed()
    );
    // WAIT answered 1: the replica has the completed record already.
    let mut on_replica = replica.async_conn().await;
    assert_eq!(
        state_of(&mut on_replica, "k").await.as_deref(),
        Some("completed")
    );
    // Asking for more replicas than there are: the one there, after the wait.
    let token = new_token(&client, "k2", b"fp", options).await;
    let acked = client
        .complete_replicated(
            "k2",
            token,
            &response,
            Origin::Handler,
            2,
            Duration::from_millis(200),
        )
        .await
        .unwrap();
    assert_eq!(acked, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_replicated_with_the_replica_frozen_stores_but_answers_zero() {
    let (primary, replica) = primary_and_replica();
    let client = client_of(&primary).await;
    let token = new_token(&client, "k", b"fp", BeginOptions::new(TTL)).await;
    replica.freeze();
    let started = Instant::now();
    let acked = client
        .complete_replicated(
            "k",
            token,
            &StoredResponse::new(201, "paid"),
            Origin::Handler,
            1,
            Duration::from_millis(300),
        )
        .await;
    let took = started.elapsed();
    replica.thaw();
    assert_eq!(acked.unwrap(), 0);
    assert!(
        took >= Duration::from_millis(290) && took < Duration::from_secs(2),
        "WAIT waited its timeout: {took:?}"
    );
    // Stored on the primary all the same (the record is never undone).
    let mut conn = primary.async_conn().await;
    assert_eq!(state_of(&mut conn, "k").await.as_deref(), Some("completed"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_replicated_refuses_settings_that_cannot_work_and_sends_nothing() {
    let primary = RedisServer::start();
    let client = client_of(&primary).await;
    let token = new_token(&client, "k", b"fp", BeginOptions::new(TTL)).await;
    let response = StoredResponse::new(201, "paid");
    let zero_replicas = client
        .complete_replicated(
            "k",
            token,
            &response,
            Origin::Handler,
            0,
            Duration::from_secs(1),
        )
        .await;
    match zero_replicas {
        Err(IdemError::BadArg(detail)) => assert!(detail.contains("at least 1"), "{detail}"),
        other => panic!("0 replicas: {other:?}"),
    }
    let zero_timeout = client
        .complete_replicated("k", token, &response, Origin::Handler, 1, Duration::ZERO)
        .await;
    match zero_timeout {
        Err(IdemError::BadArg(detail)) => {
            assert!(detail.contains("more than zero"), "{detail}")
        }
        other => panic!("zero timeout: {other:?}"),
    }
    // Without dedicated connections a WAIT would block the shared one.
    let shared = IdemClient::new(primary.async_conn().await);
    let no_wait = shared
        .complete_replicated(
            "k",
            token,
            &response,
            Origin::Handler,
            1,
            Duration::from_secs(1),
        )
        .await;
    assert!(
        matches!(no_wait, Err(IdemError::NoWaitConnections)),
        "{no_wait:?}"
    );
    // None of them touched the key.
    let mut conn = primary.async_conn().await;
    assert_eq!(
        state_of(&mut conn, "k").await.as_deref(),
        Some("in_progress")
    );
}

#[derive(Clone, Default)]
struct Calls(Arc<AtomicUsize>);

/// `POST /pay`: 201 with the number of the call, counted.
fn routes(calls: Calls) -> Router {
    Router::new().route(
        "/pay",
        post(move || async move {
            let n = calls.0.fetch_add(1, Ordering::SeqCst) + 1;
            (StatusCode::CREATED, format!("{{\"n\":{n}}}"))
        }),
    )
}

/// The value of a sample line of `name` with `labels`, 0 when absent.
fn sample(registry: &Registry, name: &str, labels: &str) -> u64 {
    let mut text = String::new();
    idem_client::middleware::prometheus_client::encoding::text::encode(&mut text, registry)
        .unwrap();
    let prefix = format!("{name}{{{labels}}} ");
    text.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .map_or(0, |value| value.parse().unwrap())
}

/// The layer's ack timeout where it must be met: ample on a loaded machine
/// (a healthy acknowledgement takes about 0.1 ms here).
const ACK: Duration = Duration::from_secs(2);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_answers_once_a_replica_acknowledged_and_503_when_none_did() {
    let (primary, replica) = primary_and_replica();
    let mut registry = Registry::default();
    let metrics = LayerMetrics::new(&mut registry);
    let layer = IdempotencyLayer::new(client_of(&primary).await)
        .replica_ack(1, ACK)
        .metrics(metrics);
    let calls = Calls::default();
    let server = Server::start(routes(calls.clone()).layer(layer)).await;
    let failures = |reason: &str| {
        sample(
            &registry,
            metric_names::REPLICA_ACK_FAILURES,
            &format!("route=\"\",reason=\"{reason}\""),
        )
    };

    // Met: the handler's response, stored on both.
    let started = Instant::now();
    let first = http_post(&server.base, "/pay", Some("met"), "{}").await;
    assert_eq!(
        first.status,
        201,
        "after {:?}: missed {}, wait_failed {}, not_stored {}",
        started.elapsed(),
        failures("missed"),
        failures("wait_failed"),
        failures("not_stored")
    );
    assert_eq!(first.body, "{\"n\":1}");
    let mut on_replica = replica.async_conn().await;
    assert_eq!(
        state_of(&mut on_replica, "idem:{:met}").await.as_deref(),
        Some("completed")
    );
    assert_eq!(failures("missed"), 0);

    // Missed: the replica hears nothing; the client gets 503, not the
    // response, and the key stays completed on the primary (not released:
    // a retry must not run the handler again).
    replica.freeze();
    let started = Instant::now();
    let missed = http_post(&server.base, "/pay", Some("missed"), "{}").await;
    let took = started.elapsed();
    assert_eq!(missed.status, 503, "{:?}", missed.body);
    assert_eq!(missed.header("retry-after"), Some("1"));
    assert_eq!(
        missed.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(
        missed.json()["type"],
        "urn:idem:problem:idempotency-store-unavailable"
    );
    assert!(took >= ACK, "answered after the WAIT: {took:?}");
    assert_eq!(calls.0.load(Ordering::SeqCst), 2);
    let mut conn = primary.async_conn().await;
    let record = idem_get(&mut conn, "idem:{:missed}")
        .await
        .expect("the key is kept");
    assert_eq!(record["state"], "completed");
    assert_eq!(record["status"], "201");
    assert_eq!(failures("missed"), 1);

    // The retry, once the replica is back, replays the stored response: the
    // handler ran once for the key.
    replica.thaw();
    let retry = http_post(&server.base, "/pay", Some("missed"), "{}").await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert!(retry.replayed());
    assert_eq!(retry.body, "{\"n\":2}");
    assert_eq!(calls.0.load(Ordering::SeqCst), 2);
    let synced = idem_testkit::eventually_async(Duration::from_secs(10), || {
        let mut conn = on_replica.clone();
        async move { state_of(&mut conn, "idem:{:missed}").await.as_deref() == Some("completed") }
    })
    .await;
    assert!(synced, "the replica caught up with the kept record");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_replica_ack_the_frozen_replica_changes_nothing() {
    // The control: the same layer without the option answers 201 at once.
    let (primary, replica) = primary_and_replica();
    let layer = IdempotencyLayer::new(client_of(&primary).await);
    let server = Server::start(routes(Calls::default()).layer(layer)).await;
    replica.freeze();
    let reply = http_post(&server.base, "/pay", Some("k"), "{}").await;
    replica.thaw();
    assert_eq!(reply.status, 201, "{:?}", reply.body);
}

/// `CONFIG SET min-replicas-to-write n` on the server at `url`, on a
/// connection of its own (a handler's, mid-request).
async fn set_min_replicas_to_write(url: String, n: u32) {
    let mut conn = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("min-replicas-to-write")
        .arg(n)
        .query_async(&mut conn)
        .await
        .unwrap();
}
/// A COMPLETE the primary refuses for now (`NOREPLICAS`: it turns
/// `min-replicas-to-write 2` on, with one replica, while the handler runs)
/// has nothing to acknowledge: 503, the key held (409 to a retry) while
/// storing goes on in the background, then the replay once the primary
/// takes writes again. The handler runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_that_cannot_be_stored_for_now_is_503_and_replayed_once_stored() {
    let (primary, _replica) = primary_and_replica();
    let mut registry = Registry::default();
    let metrics = LayerMetrics::new(&mut registry);
    let layer = IdempotencyLayer::new(client_of(&primary).await)
        .replica_ack(1, ACK)
        .metrics(metrics);
    let calls = Calls::default();
    let url = primary.url();
    let counted = calls.clone();
    let router = Router::new()
        .route(
            "/pay",
            post(move || {
                let (calls, url) = (counted.clone(), url.clone());
                async move {
                    let n = calls.0.fetch_add(1, Ordering::SeqCst) + 1;
                    set_min_replicas_to_write(url, 2).await;
                    (StatusCode::CREATED, format!("{{\"n\":{n}}}"))
                }
            }),
        )
        .layer(layer);
    let server = Server::start(router).await;
    let refused = http_post(&server.base, "/pay", Some("k"), "{}").await;
    assert_eq!(refused.status, 503, "{:?}", refused.body);
    assert_eq!(refused.header("retry-after"), Some("1"));
    let not_stored = sample(
        &registry,
        metric_names::REPLICA_ACK_FAILURES,
        "route=\"\",reason=\"not_stored\"",
    );
    assert_eq!(not_stored, 1);
    let mut conn = primary.async_conn().await;
    assert_eq!(
        state_of(&mut conn, "idem:{:k}").await.as_deref(),
        Some("in_progress"),
        "held, not released"
    );
    // min-replicas-to-write 2 refuses BEGIN too: 503, nothing runs.
    let still = http_post(&server.base, "/pay", Some("k"), "{}").await;
    assert_eq!(still.status, 503, "{:?}", still.body);
    set_min_replicas_to_write(primary.url(), 0).await;
    let stored = idem_testkit::eventually_async(Duration::from_secs(10), || {
        let mut conn = conn.clone();
        async move { state_of(&mut conn, "idem:{:k}").await.as_deref() == Some("completed") }
    })
    .await;
    assert!(stored, "the background store never landed");
    let retry = http_post(&server.base, "/pay", Some("k"), "{}").await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert!(retry.replayed());
    assert_eq!(retry.body, "{\"n\":1}");
    assert_eq!(calls.0.load(Ordering::SeqCst), 1);
}

/// A store retried in the background has no client waiting: when it finds
/// the key gone and stores the response under a new token, it does not
/// wait for replicas nor count a failure (its client has its 503 already).
/// The handler's COMPLETE is refused (`min-replicas-to-write 2`); then, in
/// one pipeline, the primary takes writes again and loses the key; the
/// replica is frozen, so a WAIT there would miss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_retried_in_the_background_waits_for_no_replica() {
    let (primary, replica) = primary_and_replica();
    let mut registry = Registry::default();
    let metrics = LayerMetrics::new(&mut registry);
    let layer = IdempotencyLayer::new(client_of(&primary).await)
        .replica_ack(1, Duration::from_millis(300))
        .metrics(metrics);
    let url = primary.url();
    let router = Router::new()
        .route(
            "/pay",
            post(move || {
                let url = url.clone();
                async move {
                    set_min_replicas_to_write(url, 2).await;
                    (StatusCode::CREATED, "{\"n\":1}")
                }
            }),
        )
        .layer(layer);
    let server = Server::start(router).await;
    let refused = http_post(&server.base, "/pay", Some("k"), "{}").await;
    assert_eq!(refused.status, 503, "{:?}", refused.body);
    replica.freeze();
    let mut conn = primary.async_conn().await;
    let () = redis::pipe()
        .cmd("CONFIG")
        .arg("SET")
        .arg("min-replicas-to-write")
        .arg("0")
        .ignore()
        .cmd("FLUSHALL")
        .ignore()
        .query_async(&mut conn)
        .await
        .unwrap();
    let stored = idem_testkit::eventually_async(Duration::from_secs(10), || {
        let mut conn = conn.clone();
        async move { state_of(&mut conn, "idem:{:k}").await.as_deref() == Some("completed") }
    })
    .await;
    // Longer than a WAIT the background would have made after it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    replica.thaw();
    assert!(stored, "the background store never landed");
    let failures = |reason: &str| {
        sample(
            &registry,
            metric_names::REPLICA_ACK_FAILURES,
            &format!("route=\"\",reason=\"{reason}\""),
        )
    };
    assert_eq!((failures("not_stored"), failures("missed")), (1, 0));
    let retry = http_post(&server.base, "/pay", Some("k"), "{}").await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert!(retry.replayed());
}

#[derive(Clone)]
struct Fenced {
    pool: deadpool_postgres::Pool,
    calls: Calls,
}

/// `POST /pay` through the fence: claim, one effect row, commit 201.
async fn pay_fenced(State(app): State<Fenced>, Extension(fence): Extension<Fence>) -> String {
    let n = app.calls.0.fetch_add(1, Ordering::SeqCst) + 1;
    assert_eq!(fence.claim(&app.pool).await.unwrap(), Claim::Proceed);
    let mut client = app.pool.get().await.unwrap();
    let tx = client.transaction().await.unwrap();
    tx.execute("INSERT INTO effects (n) VALUES ($1)", &[&(n as i64)])
        .await
        .unwrap();
    let stored = StoredResponse::new(201, format!("{{\"n\":{n}}}"));
    assert_eq!(fence.commit(tx, &stored).await.unwrap(), Commit::Committed);
    String::from_utf8(stored.body.to_vec()).unwrap()
}

/// The split brain in miniature: the fence commits, the replica hears
/// nothing (503, the record kept on the primary), the primary's record is
/// then lost (as in a failover to the replica that never got it), and the
/// retry gets the committed payment from Postgres: one effect, one answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_answer_no_replica_acknowledged_is_503_and_its_row_answers_the_retry() {
    let (primary, replica) = primary_and_replica();
    let db = PgDatabase::create();
    let mut admin = db.connect().await;
    idem_writer::migrate(&mut admin).await.unwrap();
    admin
        .batch_execute("CREATE TABLE effects (n BIGINT NOT NULL)")
        .await
        .unwrap();
    let config: tokio_postgres::Config = db.url.parse().unwrap();
    let pool = deadpool_postgres::Pool::builder(deadpool_postgres::Manager::new(
        config,
        tokio_postgres::NoTls,
    ))
    .max_size(4)
    .build()
    .unwrap();
    let layer = IdempotencyLayer::new(client_of(&primary).await)
        .read_through(ReadThrough::new(pool.clone()))
        .replica_ack(1, Duration::from_millis(400));
    let app = Fenced {
        pool,
        calls: Calls::default(),
    };
    let router = Router::new()
        .route("/pay", post(pay_fenced))
        .with_state(app.clone())
        .layer(layer);
    let server = Server::start(router).await;

    replica.freeze();
    let first = http_post(&server.base, "/pay", Some("k"), "{}").await;
    replica.thaw();
    assert_eq!(first.status, 503, "{:?}", first.body);
    let mut conn = primary.async_conn().await;
    assert_eq!(
        state_of(&mut conn, "idem:{:k}").await.as_deref(),
        Some("completed")
    );
    // Redis loses the record (the failover to a replica that missed it).
    let () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    let retry = http_post(&server.base, "/pay", Some("k"), "{}").await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert!(retry.replayed());
    assert_eq!(retry.body, "{\"n\":1}");
    assert_eq!(app.calls.0.load(Ordering::SeqCst), 1);
    let effects: i64 = admin
        .query_one("SELECT count(*) FROM effects", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(effects, 1);
}

/// The layer's option refuses what cannot work, at configuration, saying why.
#[tokio::test]
async fn replica_ack_refuses_zero_replicas_a_zero_timeout_and_a_client_that_cannot_wait() {
    let primary = RedisServer::start();
    let client = client_of(&primary).await;
    let panic_text = |configure: Box<dyn FnOnce()>| {
        let payload =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(configure)).expect_err("refused");
        payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    };
    let c = client.clone();
    let zero = panic_text(Box::new(move || {
        let _ = IdempotencyLayer::new(c).replica_ack(0, Duration::from_secs(1));
    }));
    assert!(zero.contains("replicas must be at least 1"), "{zero}");
    let c = client.clone();
    let no_timeout = panic_text(Box::new(move || {
        let _ = IdempotencyLayer::new(c).replica_ack(1, Duration::ZERO);
    }));
    assert!(
        no_timeout.contains("timeout must be more than zero"),
        "{no_timeout}"
    );
    let shared = IdemClient::new(primary.async_conn().await);
    let cannot_wait = panic_text(Box::new(move || {
        let _ = IdempotencyLayer::new(shared).replica_ack(1, Duration::from_secs(1));
    }));
    assert!(cannot_wait.contains("wait connections"), "{cannot_wait}");
    // MemoryStore's wait connections serve BEGIN's wait but run no
    // pipeline: every COMPLETE would fail and release the key, so a retry
    // would run the handler again.
    let memory = IdemClient::memory(idem_client::MemoryStore::new());
    let no_pipelines = panic_text(Box::new(move || {
        let _ = IdempotencyLayer::new(memory).replica_ack(1, Duration::from_secs(1));
    }));
    assert!(no_pipelines.contains("run pipelines"), "{no_pipelines}");
}

/// COMPLETE and WAIT sent again by the same holder (as a cluster connection
/// retrying the pipeline would): the COMPLETE finds its own record, which is
/// stored; the acknowledgement is unknown, so 0, not an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_replicated_sent_again_finds_its_own_record_and_acknowledges_nothing() {
    let (primary, _replica) = primary_and_replica();
    let client = client_of(&primary).await;
    let token = new_token(&client, "again", b"fp", BeginOptions::new(TTL)).await;
    let response = StoredResponse::new(201, "paid");
    let wait = Duration::from_millis(500);
    let first = client
        .complete_replicated("again", token, &response, Origin::Handler, 1, wait)
        .await;
    assert_eq!(first.unwrap(), 1);
    let again = client
        .complete_replicated("again", token, &response, Origin::Handler, 1, wait)
        .await;
    assert_eq!(again.unwrap(), 0, "stored, acknowledgement unknown");
}

/// In a Redis Cluster the COMPLETE and its `WAIT` go to the key's primary
/// on one dedicated cluster connection (`WAIT` has no key): with that
/// primary's replica frozen the ack misses, and it is met on the others. A
/// `WAIT` sent to another node would count that node's replica at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_cluster_the_wait_runs_on_the_keys_primary() {
    let mut cluster = idem_testkit::cluster::RedisCluster::start(3, 1, 5000);
    let primaries: Vec<String> = cluster
        .primaries()
        .into_iter()
        .map(|i| cluster.nodes[i].url())
        .collect();
    let client = IdemClient::cluster(redis::cluster::ClusterClient::new(primaries).unwrap())
        .await
        .unwrap();
    let keys = ["idem:{a}", "idem:{b}", "idem:{c}", "idem:{d}"];
    let owner = |cluster: &mut idem_testkit::cluster::RedisCluster, key: &str| {
        let slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut cluster.conn(0))
            .unwrap();
        cluster.owner_of_slot(slot)
    };
    let frozen_primary = owner(&mut cluster, keys[0]);
    let frozen = cluster.replica_of(frozen_primary);
    let response = StoredResponse::new(201, "paid");
    // Every replica acknowledges once (the first write after a sync waits
    // for the replica's first ACK).
    for key in keys {
        let token = new_token(&client, key, b"fp", BeginOptions::new(TTL)).await;
        let acked = client
            .complete_replicated(
                key,
                token,
                &response,
                Origin::Handler,
                1,
                Duration::from_secs(5),
            )
            .await
            .unwrap();
        assert_eq!(acked, 1, "{key}");
    }
    cluster.nodes[frozen].freeze();
    let mut results = Vec::new();
    for key in keys {
        let key = format!("{key}:again");
        let token = new_token(&client, &key, b"fp", BeginOptions::new(TTL)).await;
        let acked = client
            .complete_replicated(
                &key,
                token,
                &response,
                Origin::Handler,
                1,
                Duration::from_millis(500),
            )
            .await
            .unwrap();
        results.push((owner(&mut cluster, &key) == frozen_primary, acked));
    }
    cluster.nodes[frozen].thaw();
    assert!(results.contains(&(true, 0)), "{results:?}");
    for (on_frozen, acked) in results {
        assert_eq!(acked, u32::from(!on_frozen), "{on_frozen}");
    }
}

/// A `WAIT` that fails after the COMPLETE (here the ACL user may not run
/// it) acknowledges nothing: 503, counted as `wait_failed`, the record
/// stored; `complete_replicated` answers 0 replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_that_fails_after_the_complete_is_503_and_the_record_stays() {
    let (primary, _replica) = primary_and_replica();
    let mut admin = primary.async_conn().await;
    let () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("app")
        .arg("on")
        .arg(">pw")
        .arg("~*")
        .arg("&*")
        .arg("+@all")
        .arg("-wait")
        .query_async(&mut admin)
        .await
        .unwrap();
    let url = format!("redis://app:pw@127.0.0.1:{}/", primary.port);
    let client = IdemClient::standalone(redis::Client::open(url).unwrap())
        .await
        .unwrap();
    let token = new_token(&client, "direct", b"fp", BeginOptions::new(TTL)).await;
    let acked = client
        .complete_replicated(
            "direct",
            token,
            &StoredResponse::new(201, "paid"),
            Origin::Handler,
            1,
            ACK,
        )
        .await
        .unwrap();
    assert_eq!(acked, 0);
    assert_eq!(
        state_of(&mut admin, "direct").await.as_deref(),
        Some("completed")
    );
    let mut registry = Registry::default();
    let metrics = LayerMetrics::new(&mut registry);
    let layer = IdempotencyLayer::new(client)
        .replica_ack(1, ACK)
        .metrics(metrics);
    let calls = Calls::default();
    let server = Server::start(routes(calls.clone()).layer(layer)).await;
    let reply = http_post(&server.base, "/pay", Some("k"), "{}").await;
    assert_eq!(reply.status, 503, "{:?}", reply.body);
    assert_eq!(
        state_of(&mut admin, "idem:{:k}").await.as_deref(),
        Some("completed")
    );
    let failed = sample(
        &registry,
        metric_names::REPLICA_ACK_FAILURES,
        "route=\"\",reason=\"wait_failed\"",
    );
    let noperm = sample(
        &registry,
        metric_names::REDIS_ERRORS,
        "op=\"wait\",kind=\"noperm\"",
    );
    assert_eq!((failed, noperm), (1, 1));
}
