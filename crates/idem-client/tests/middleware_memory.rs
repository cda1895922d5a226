//! The middleware over `MemoryStore`, driven through tower without a socket
//! or Redis: how a user unit-tests an axum handler with the layer. Replays,
//! 422, 5xx re-runs, 409 while in flight, `wait_for_result`, and the service's
//! `get_mut` / `into_inner`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use idem_client::{IdemClient, IdempotencyLayer, MemoryStore};
use idem_testkit::wire::{idem_get_async, state_word};
use tower::{Layer, ServiceExt};

#[derive(Clone, Default)]
struct Calls(Arc<AtomicUsize>);

impl Calls {
    fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

fn app(layer: IdempotencyLayer<MemoryStore>, calls: &Calls) -> Router {
    Router::new()
        .route(
            "/pay",
            post(|State(calls): State<Calls>, body: String| async move {
                let n = calls.0.fetch_add(1, Ordering::SeqCst) + 1;
                if body.contains("slow") {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                (StatusCode::CREATED, format!("payment {n}"))
            }),
        )
        .route(
            "/fail",
            post(|State(calls): State<Calls>| async move {
                calls.0.fetch_add(1, Ordering::SeqCst);
                StatusCode::SERVICE_UNAVAILABLE.into_response()
            }),
        )
        .layer(layer)
        .with_state(calls.clone())
}

struct Answer {
    status: StatusCode,
    replayed: bool,
    retry_after: Option<String>,
    body: String,
}

async fn send(app: &Router, path: &str, key: &str, body: &str) -> Answer {
    let request = Request::post(path)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let header = |name: &str| {
        parts
            .headers
            .get(name)
            .map(|v| v.to_str().unwrap().to_string())
    };
    let (status, replayed, retry_after) = (
        parts.status,
        header("idempotent-replayed").as_deref() == Some("true"),
        header("retry-after"),
    );
    let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    Answer {
        status,
        replayed,
        retry_after,
        body: String::from_utf8(body.to_vec()).unwrap(),
    }
}

#[tokio::test]
async fn a_handler_runs_once_per_key_on_the_memory_store() {
    let store = MemoryStore::new();
    let calls = Calls::default();
    let app = app(
        IdempotencyLayer::new(IdemClient::memory(store.clone())),
        &calls,
    );

    let first = send(&app, "/pay", "k1", r#"{"amount":1}"#).await;
    assert_eq!((first.status, first.replayed), (StatusCode::CREATED, false));
    // Same request, member order changed: canonical JSON makes it a replay.
    let again = send(&app, "/pay", "k1", r#"{ "amount" : 1 }"#).await;
    assert_eq!((again.status, again.replayed), (StatusCode::CREATED, true));
    assert_eq!(again.body, first.body);
    let other = send(&app, "/pay", "k1", r#"{"amount":2}"#).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(calls.count(), 1);

    let mut conn = store.clone();
    let record = idem_get_async(&mut conn, "idem:{:k1}")
        .await
        .expect("record");
    assert_eq!(state_word(&record), "completed");

    // 5xx is not stored: the retry runs the handler again.
    assert_eq!(
        send(&app, "/fail", "k2", "{}").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(
        send(&app, "/fail", "k2", "{}").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(calls.count(), 3);
    assert!(idem_get_async(&mut conn, "idem:{:k2}").await.is_none());
}

#[tokio::test]
async fn a_duplicate_of_a_running_request_is_409_or_waits_for_its_answer() {
    let calls = Calls::default();
    let store = MemoryStore::new();
    let plain = app(
        IdempotencyLayer::new(IdemClient::memory(store.clone())),
        &calls,
    );
    let original = tokio::spawn({
        let app = plain.clone();
        async move { send(&app, "/pay", "k", "\"slow\"").await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let busy = send(&plain, "/pay", "k", "\"slow\"").await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert_eq!(busy.retry_after.as_deref(), Some("2"));
    let original = original.await.unwrap();
    assert_eq!(original.status, StatusCode::CREATED);

    let waiting = app(
        IdempotencyLayer::new(IdemClient::memory(store)).wait_for_result(Duration::from_secs(5)),
        &calls,
    );
    let original = tokio::spawn({
        let app = waiting.clone();
        async move { send(&app, "/pay", "w", "\"slow\"").await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let duplicate = send(&waiting, "/pay", "w", "\"slow\"").await;
    let original = original.await.unwrap();
    assert_eq!(
        (duplicate.status, duplicate.replayed),
        (StatusCode::CREATED, true)
    );
    assert_eq!(duplicate.body, original.body);
    assert_eq!(calls.count(), 2);
}

#[tokio::test]
async fn the_service_gives_access_to_its_inner_service() {
    #[derive(Clone, Debug, PartialEq)]
    struct Inner(u32);
    let layer = IdempotencyLayer::new(IdemClient::memory(MemoryStore::new()));
    let mut service = layer.layer(Inner(1));
    assert_eq!(service.get_ref(), &Inner(1));
    service.get_mut().0 = 7;
    assert_eq!(service.into_inner(), Inner(7));
}
