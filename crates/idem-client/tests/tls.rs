//! The client and the middleware against a redis-server that listens on a
//! TLS port only: `IdemClient::standalone` over `rediss://` (redis-rs'
//! connection: the `Pipe` speaks plaintext only) with the test CA and a
//! client certificate, and failing closed with a certificate error when
//! the CA is another.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use common::Server;
use idem_client::{BeginOptions, IdemClient, IdempotencyLayer, Origin, Outcome, StoredResponse};
use idem_testkit::tls::{Certs, TlsRedisServer};

fn read(path: &std::path::Path) -> Vec<u8> {
    std::fs::read(path).expect("read a certificate")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn begin_and_complete_over_tls() {
    let certs = Certs::generate();
    let server = TlsRedisServer::start(&certs, true);
    let client = IdemClient::standalone(server.client(&certs))
        .await
        .expect("connect over TLS");
    let options = BeginOptions::new(Duration::from_secs(3600));
    let Outcome::New { token } = client.begin("idem:{tls}", b"fp", options).await.unwrap() else {
        panic!("a fresh key is new");
    };
    let response = StoredResponse::new(201, "created");
    client
        .complete("idem:{tls}", token, &response, Origin::Handler)
        .await
        .unwrap();
    assert_eq!(
        client.begin("idem:{tls}", b"fp", options).await.unwrap(),
        Outcome::Replay(response)
    );

    // The middleware on the same connection: the handler runs once.
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let app = Router::new()
        .route(
            "/p",
            post(move || {
                let runs = counted.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    "paid"
                }
            }),
        )
        .layer(IdempotencyLayer::new(client));
    let http = Server::start(app).await;
    for _ in 0..2 {
        let reply = common::send(
            reqwest::Client::new().post(format!("{}/p", http.base)),
            Some("k"),
            "{}",
        )
        .await;
        assert_eq!(reply.status, 200);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_ca_or_no_client_certificate_fails_closed() {
    let certs = Certs::generate();
    let server = TlsRedisServer::start(&certs, true);
    let wrong_ca = redis::Client::build_with_tls(
        server.url(),
        redis::TlsCertificates {
            client_tls: Some(redis::ClientTlsConfig {
                client_cert: read(&certs.client_cert),
                client_key: read(&certs.client_key),
            }),
            root_cert: Some(read(&certs.other_ca)),
        },
    )
    .unwrap();
    let error = IdemClient::standalone(wrong_ca)
        .await
        .expect_err("a server signed by another CA is refused");
    assert!(
        error.to_string().to_lowercase().contains("certificate"),
        "{error}"
    );
    // The platform's trust store does not know the test CA either.
    let platform = redis::Client::open(server.url()).unwrap();
    let error = IdemClient::standalone(platform)
        .await
        .expect_err("unknown CA");
    assert!(
        error.to_string().to_lowercase().contains("certificate"),
        "{error}"
    );
    // Plaintext to the TLS port gets nothing.
    let plain = redis::Client::open(format!("redis://127.0.0.1:{}/0", server.port)).unwrap();
    assert!(IdemClient::standalone(plain).await.is_err());
}
