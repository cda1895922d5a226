//! The tower/axum layer over the Functions library (a Redis without the
//! module): a duplicate arriving while the original runs waits for its
//! answer (`wait_for_result`, a poll on the library), and a request after
//! `FUNCTION FLUSH` finds the library loaded again.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use common::{post as http_post, BareRedis, Server};
use idem_client::{Backend, IdemClient, IdempotencyLayer};

#[tokio::test]
async fn a_duplicate_waits_for_the_original_on_the_library() {
    let redis = BareRedis::start();
    let client = IdemClient::standalone(redis.client()).await.unwrap();
    assert_eq!(client.backend(), Backend::Functions);
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let router = Router::new()
        .route(
            "/slow",
            post(move || {
                let calls = counted.clone();
                async move {
                    let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                    tokio::time::sleep(Duration::from_millis(400)).await;
                    (StatusCode::CREATED, format!("payment {n}"))
                }
            }),
        )
        .layer(IdempotencyLayer::new(client).wait_for_result(Duration::from_secs(5)));
    let server = Server::start(router).await;

    let first = {
        let base = server.base.clone();
        tokio::spawn(async move { http_post(&base, "/slow", Some("k1"), "{}").await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let duplicate = http_post(&server.base, "/slow", Some("k1"), "{}").await;
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    assert_eq!(duplicate.status, 201, "{:?}", duplicate.body);
    assert_eq!(duplicate.body, first.body);
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    // The library gone (a restart without persistence, FUNCTION FLUSH):
    // the next request loads it again and is served.
    let _: () = redis.cmd(&["FUNCTION", "FLUSH"]).unwrap();
    let again = http_post(&server.base, "/slow", Some("k2"), "{}").await;
    assert_eq!(again.status, 201, "{:?}", again.body);
    let _: () = redis.cmd(&["FUNCTION", "FLUSH"]).unwrap();
    let replay = http_post(&server.base, "/slow", Some("k2"), "{}").await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.body, again.body);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}
