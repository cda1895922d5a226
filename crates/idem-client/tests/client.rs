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

/// A stand-in for a module from before `PACKED`, on a real socket: it
/// refuses the option as such a module does (`BADARG unknown option
/// 'PACKED'`), answers any other BEGIN with a four-field replay, and records
/// every BEGIN it is sent.
fn old_module() -> (u16, Arc<std::sync::Mutex<Vec<Vec<String>>>>) {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            let log = log.clone();
            std::thread::spawn(move || {
                let mut out = stream.try_clone().unwrap();
                let mut input = BufReader::new(stream);
                let mut line = String::new();
                let mut read_line = |input: &mut BufReader<_>| {
                    line.clear();
                    (input.read_line(&mut line).unwrap_or(0) > 0)
                        .then(|| line.trim_end().to_string())
                };
                while let Some(head) = read_line(&mut input) {
                    let n: usize = head.trim_start_matches('*').parse().unwrap();
                    let mut args = Vec::new();
                    for _ in 0..n {
                        let len: usize = read_line(&mut input).unwrap()[1..].parse().unwrap();
                        let mut arg = vec![0; len + 2];
                        std::io::Read::read_exact(&mut input, &mut arg).unwrap();
                        arg.truncate(len);
                        args.push(String::from_utf8_lossy(&arg).into_owned());
                    }
                    let reply: &[u8] = if args[0] != "IDEM.BEGIN" {
                        b"+OK\r\n"
                    } else if args.iter().any(|a| a.eq_ignore_ascii_case("PACKED")) {
                        b"-BADARG unknown option 'PACKED'\r\n"
                    } else {
                        b"*4\r\n$6\r\nreplay\r\n:201\r\n$2\r\n{}\r\n*2\r\n$1\r\na\r\n$1\r\nb\r\n"
                    };
                    if args[0] == "IDEM.BEGIN" {
                        log.lock().unwrap().push(args);
                    }
                    if out.write_all(reply).is_err() {
                        return;
                    }
                }
            });
        }
    });
    (port, seen)
}

#[tokio::test]
async fn a_module_without_packed_replies_gets_the_four_field_replay() {
    let (port, seen) = old_module();
    let redis = redis::Client::open(format!("redis://127.0.0.1:{port}/")).unwrap();
    let client = IdemClient::new(redis.get_multiplexed_async_connection().await.unwrap());
    let twin = client.clone();
    let expected = Outcome::Replay(StoredResponse::new(201, "{}").with_header("a", "b"));
    assert_eq!(client.begin("k", b"fp", opts()).await.unwrap(), expected);
    // The clone shares what the first call learnt: no second refusal.
    assert_eq!(twin.begin("k", b"fp", opts()).await.unwrap(), expected);
    let packed = |args: &Vec<String>| args.iter().any(|a| a == "PACKED");
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen.iter().map(packed).collect::<Vec<_>>(),
        [true, false, false],
        "{seen:?}"
    );
    // Past the option, the retry is the same command.
    assert_eq!(seen[0][..seen[0].len() - 1], seen[1][..]);

    // Turned off from the start, the option is never sent; the setting is
    // not shared with a clone made before it.
    let (port, seen) = old_module();
    let redis = redis::Client::open(format!("redis://127.0.0.1:{port}/")).unwrap();
    let base = IdemClient::new(redis.get_multiplexed_async_connection().await.unwrap());
    let off = base.clone().with_packed_replies(false);
    assert_eq!(off.begin("k", b"fp", opts()).await.unwrap(), expected);
    assert_eq!(base.begin("k", b"fp", opts()).await.unwrap(), expected);
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen.iter().map(packed).collect::<Vec<_>>(),
        [false, true, false],
        "{seen:?}"
    );
}
