//! `IdemClient` against a real redis-server with the module: every outcome,
//! every module error code as a typed error, unavailability, and WAIT on
//! dedicated connections.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{idem_get, new_token, state_of, text, LONG};
use idem_client::{
    BeginOptions, DedicatedConnections, IdemClient, IdemError, Origin, Outcome, StoredResponse,
};
use idem_testkit::{RedisConfig, RedisServer};

async fn client(server: &RedisServer) -> IdemClient<redis::aio::MultiplexedConnection> {
    IdemClient::new(server.async_conn().await)
}

fn opts() -> BeginOptions {
    BeginOptions::new(LONG)
}

#[tokio::test]
async fn begin_complete_then_replay_and_mismatch() {
    let server = RedisServer::start();
    let client = client(&server).await;
    let token = new_token(&client, "k1", b"fp-a", opts()).await;

    assert!(matches!(
        client.begin("k1", b"fp-a", opts()).await.unwrap(),
        Outcome::InFlight { retry_after } if retry_after > Duration::from_secs(20)
    ));

    let response = StoredResponse::new(201, &b"{\"id\":7}"[..])
        .with_header("content-type", "application/json")
        .with_header("location", "/payments/7");
    client
        .complete("k1", token, &response, Origin::Handler)
        .await
        .unwrap();

    assert_eq!(
        client.begin("k1", b"fp-a", opts()).await.unwrap(),
        Outcome::Replay(response)
    );
    assert_eq!(
        client.begin("k1", b"fp-b", opts()).await.unwrap(),
        Outcome::Mismatch
    );

    let mut conn = server.async_conn().await;
    let record = idem_get(&mut conn, "k1").await.expect("record");
    assert_eq!(text(&record["mirror"]), "pending");
}

#[tokio::test]
async fn mirrored_complete_is_not_pending_for_the_writer() {
    let server = RedisServer::start();
    let client = client(&server).await;
    let token = new_token(&client, "km", b"fp", opts()).await;
    client
        .complete("km", token, &StoredResponse::new(200, "ok"), Origin::Mirror)
        .await
        .unwrap();
    let mut conn = server.async_conn().await;
    let record = idem_get(&mut conn, "km").await.expect("record");
    assert_eq!(text(&record["mirror"]), "mirrored");
}

#[tokio::test]
async fn abort_releases_and_touch_extends() {
    let server = RedisServer::start();
    let client = client(&server).await;
    let token = new_token(
        &client,
        "k2",
        b"fp",
        opts().lease(Duration::from_millis(500)),
    )
    .await;

    assert_eq!(
        client
            .touch("k2", token, Duration::from_secs(10))
            .await
            .unwrap(),
        Duration::from_secs(10)
    );
    tokio::time::sleep(Duration::from_millis(700)).await;
    // Without the touch the 500 ms lease would have lapsed.
    assert!(matches!(
        client.begin("k2", b"fp", opts()).await.unwrap(),
        Outcome::InFlight { .. }
    ));

    assert!(
        !client.abort("k2", token + 1).await.unwrap(),
        "wrong token releases nothing"
    );
    assert!(client.abort("k2", token).await.unwrap());
    let mut conn = server.async_conn().await;
    assert_eq!(state_of(&mut conn, "k2").await, None);
    let again = new_token(&client, "k2", b"fp", opts()).await;
    assert!(again > token, "tokens only grow");
}

#[tokio::test]
async fn module_errors_become_typed_errors() {
    let server = RedisConfig::default()
        .module_arg("max-body-bytes", "64")
        .start();
    let client = client(&server).await;

    let err = client
        .touch("missing", 1, Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(matches!(err, IdemError::NotFound(_)), "{err:?}");

    // STALE: the first holder's lease lapses and another request takes over.
    let first = new_token(
        &client,
        "k3",
        b"fp",
        opts().lease(Duration::from_millis(50)),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(120)).await;
    let second = new_token(&client, "k3", b"fp", opts()).await;
    assert!(second > first);
    let err = client
        .touch("k3", first, Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(matches!(err, IdemError::Stale(_)), "{err:?}");
    let err = client
        .complete("k3", first, &StoredResponse::new(200, ""), Origin::Handler)
        .await
        .unwrap_err();
    assert!(matches!(err, IdemError::Stale(_)), "{err:?}");

    let err = client
        .complete(
            "k3",
            second,
            &StoredResponse::new(200, vec![b'x'; 200]),
            Origin::Handler,
        )
        .await
        .unwrap_err();
    assert!(matches!(err, IdemError::TooLarge(_)), "{err:?}");

    client
        .complete(
            "k3",
            second,
            &StoredResponse::new(200, "ok"),
            Origin::Handler,
        )
        .await
        .unwrap();
    let err = client
        .touch("k3", second, Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(matches!(err, IdemError::Completed(_)), "{err:?}");

    let mut conn = server.async_conn().await;
    let _: () = redis::cmd("SET")
        .arg("plain")
        .arg("v")
        .query_async(&mut conn)
        .await
        .unwrap();
    let err = client.begin("plain", b"fp", opts()).await.unwrap_err();
    assert!(matches!(err, IdemError::WrongType(_)), "{err:?}");

    let err = client
        .begin(
            "k4",
            b"fp",
            BeginOptions::new(Duration::from_secs(100 * 365 * 24 * 3600)),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, IdemError::BadArg(_)), "{err:?}");
    assert!(!err.is_unavailable());
}

#[tokio::test]
async fn a_dead_server_is_unavailable_not_a_hang() {
    let mut server = RedisServer::start();
    let client = client(&server)
        .await
        .with_call_timeout(Duration::from_millis(500));
    server.kill();
    let started = Instant::now();
    let err = client.begin("k", b"fp", opts()).await.unwrap_err();
    assert!(err.is_unavailable(), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[tokio::test]
async fn waiting_needs_dedicated_connections() {
    let server = RedisServer::start();
    let client = client(&server).await;
    let err = client
        .begin("k", b"fp", opts().wait(Duration::from_secs(1)))
        .await
        .unwrap_err();
    assert!(matches!(err, IdemError::NoWaitConnections), "{err:?}");
}

#[tokio::test]
async fn a_waiting_duplicate_gets_the_replay_without_blocking_others() {
    let server = RedisServer::start();
    let client = IdemClient::standalone(server.client()).await.unwrap();
    let token = new_token(&client, "kw", b"fp", opts()).await;

    let waiter = {
        let client = client.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let outcome = client
                .begin("kw", b"fp", opts().wait(Duration::from_secs(10)))
                .await;
            (outcome, started.elapsed())
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The shared connection stays usable while the waiter blocks.
    let started = Instant::now();
    new_token(&client, "other", b"fp", opts()).await;
    // Were it blocked behind the waiter, this would take the 2 s call timeout.
    assert!(started.elapsed() < Duration::from_secs(1));

    tokio::time::sleep(Duration::from_millis(200)).await;
    let response = StoredResponse::new(201, "done");
    client
        .complete("kw", token, &response, Origin::Handler)
        .await
        .unwrap();
    let (outcome, waited) = waiter.await.unwrap();
    assert_eq!(outcome.unwrap(), Outcome::Replay(response));
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
}

#[tokio::test]
async fn a_wait_shorter_than_the_work_answers_in_flight() {
    let server = RedisServer::start();
    let connections = Arc::new(DedicatedConnections::standalone(server.client()));
    let client =
        IdemClient::new(server.async_conn().await).with_wait_connections(connections.clone());
    new_token(&client, "ks", b"fp", opts()).await;
    let started = Instant::now();
    let outcome = client
        .begin("ks", b"fp", opts().wait(Duration::from_millis(300)))
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::InFlight { .. }), "{outcome:?}");
    assert!(started.elapsed() >= Duration::from_millis(290));
    assert_eq!(
        connections.idle_count(),
        1,
        "the connection went back to the pool"
    );
}
