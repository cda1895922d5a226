//! The replica acknowledgement after COMPLETE, against a real primary with
//! the module and a real replica: `IdemClient::complete_replicated` and the
//! layer's `replica_ack`. Met with one replica in sync; missed with the
//! replica frozen (SIGSTOP), where the layer answers 503 and keeps the key
//! completed, so the retry replays it; settings that cannot work refused
//! before anything is sent.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use common::{idem_get, new_token, post as http_post, state_of, Server};
use idem_client::middleware::prometheus_client::registry::Registry;
use idem_client::middleware::{metric_names, LayerMetrics};
use idem_client::{BeginOptions, IdemClient, IdemError, IdempotencyLayer, Origin, StoredResponse};
use idem_testkit::RedisServer;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_answers_once_a_replica_acknowledged_and_503_when_none_did() {
    let (primary, replica) = primary_and_replica();
    let mut registry = Registry::default();
    let metrics = LayerMetrics::new(&mut registry);
    let layer = IdempotencyLayer::new(client_of(&primary).await)
        .replica_ack(1, Duration::from_millis(400))
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
    let first = http_post(&server.base, "/pay", Some("met"), "{}").await;
    assert_eq!(first.status, 201, "{:?}", first.body);
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
    assert!(
        took >= Duration::from_millis(390),
        "answered after the WAIT: {took:?}"
    );
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
}
