//! One body of decision-table tests run twice: against `MemoryStore` and
//! against a real redis-server with the module. The four outcomes, growing
//! tokens, fencing of a stale holder, the error codes a client can meet,
//! lease takeover, key expiry and WAIT must come out the same on both.

mod common;

use std::time::{Duration, Instant};

use common::{new_token, LONG};
use idem_client::{
    BeginOptions, IdemClient, IdemError, MemoryStore, Origin, Outcome, StandaloneConnection,
    StoredResponse, Transport,
};
use idem_core::State;
use idem_testkit::wire::idem_get_async;
use idem_testkit::RedisServer;
use redis::aio::ConnectionLike;

trait Conn: ConnectionLike + Clone + Send + Sync + 'static {}
impl<T: ConnectionLike + Clone + Send + Sync + 'static> Conn for T {}

/// `cmd` on `conn`, as the client maps its error.
async fn raw<C: Conn>(conn: &mut C, cmd: &redis::Cmd) -> Result<redis::Value, IdemError> {
    cmd.query_async(conn).await.map_err(IdemError::from)
}

/// The four outcomes, and what each holder may do afterwards.
async fn outcomes<C: Conn>(client: IdemClient<C>, mut conn: C) {
    let opts = BeginOptions::new(LONG).lease(Duration::from_secs(30));
    let t1 = new_token(&client, "k", b"a", opts).await;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    assert!(
        t1 >= (now_ms - 5_000) * 1000,
        "tokens follow the clock: {t1}"
    );
    match client.begin("k", b"a", opts).await.unwrap() {
        Outcome::InFlight { retry_after } => {
            assert!(retry_after > Duration::from_secs(25) && retry_after <= Duration::from_secs(30))
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        client.begin("k", b"b", opts).await.unwrap(),
        Outcome::Mismatch
    );
    assert_eq!(
        client
            .touch("k", t1, Duration::from_millis(20_000))
            .await
            .unwrap(),
        Duration::from_millis(20_000)
    );
    let response = StoredResponse::new(201, "{\"id\":1}")
        .with_header("content-type", "application/json")
        .with_header("set-cookie", "a=1")
        .with_header("set-cookie", "b=2");
    assert!(matches!(
        client
            .complete("k", t1 + 1, &response, Origin::Handler)
            .await,
        Err(IdemError::Stale(_))
    ));
    client
        .complete("k", t1, &response, Origin::Handler)
        .await
        .unwrap();
    assert!(matches!(
        client.complete("k", t1, &response, Origin::Handler).await,
        Err(IdemError::Completed(_))
    ));
    assert!(matches!(
        client.touch("k", t1, Duration::from_secs(1)).await,
        Err(IdemError::Completed(_))
    ));
    assert!(
        !client.abort("k", t1).await.unwrap(),
        "a completed key is not released"
    );
    assert_eq!(
        client.begin("k", b"a", opts).await.unwrap(),
        Outcome::Replay(response.clone())
    );
    assert_eq!(
        client.begin("k", b"b", opts).await.unwrap(),
        Outcome::Mismatch
    );

    let record = idem_get_async(&mut conn, "k").await.expect("record");
    assert_eq!(record.token, t1);
    assert_eq!(
        record.fingerprint.digest(),
        idem_core::fingerprint::sha256(b"a")
    );
    let State::Completed(completed) = &record.state else {
        panic!("{record:?}");
    };
    assert_eq!(
        (completed.status, &completed.body[..]),
        (201, &b"{\"id\":1}"[..])
    );
    assert_eq!(completed.headers.len(), 3);

    let t2 = new_token(&client, "k2", b"a", opts).await;
    assert!(t2 > t1, "tokens grow");
    assert!(client
        .abort("k2", t2 + 1)
        .await
        .map(|released| !released)
        .unwrap());
    assert!(client.abort("k2", t2).await.unwrap());
    assert!(!client.abort("k2", t2).await.unwrap());
    assert!(idem_get_async(&mut conn, "k2").await.is_none());
    assert!(matches!(
        client.complete("k2", t2, &response, Origin::Handler).await,
        Err(IdemError::NotFound(_))
    ));
    assert!(matches!(
        client.touch("k2", t2, Duration::from_secs(1)).await,
        Err(IdemError::NotFound(_))
    ));
    let t3 = new_token(&client, "k2", b"other", opts).await;
    assert!(t3 > t2, "a released key starts afresh with a larger token");
}

/// Argument errors and size limits, answered before any record changes.
async fn refusals<C: Conn>(client: IdemClient<C>, mut conn: C) {
    let bad = [
        redis::cmd("IDEM.BEGIN").arg("k").arg("fp").arg(0).clone(),
        redis::cmd("IDEM.BEGIN")
            .arg("k")
            .arg("fp")
            .arg(60)
            .arg("LEASE")
            .arg(0)
            .clone(),
        redis::cmd("IDEM.BEGIN")
            .arg("k")
            .arg("fp")
            .arg(60)
            .arg("NOPE")
            .arg(1)
            .clone(),
        redis::cmd("IDEM.BEGIN").arg("k").arg("fp").clone(),
        redis::cmd("IDEM.COMPLETE")
            .arg("k")
            .arg(5)
            .arg(99)
            .arg("b")
            .clone(),
        redis::cmd("IDEM.COMPLETE")
            .arg("k")
            .arg(0)
            .arg(200)
            .arg("b")
            .clone(),
        redis::cmd("IDEM.TOUCH").arg("k").arg(5).arg(0).clone(),
        redis::cmd("IDEM.ABORT").arg("k").clone(),
    ];
    for (i, cmd) in bad.iter().enumerate() {
        let err = raw(&mut conn, cmd).await.unwrap_err();
        assert!(matches!(err, IdemError::BadArg(_)), "command {i}: {err:?}");
    }
    assert!(matches!(
        client
            .begin(
                "k",
                b"fp",
                BeginOptions::new(Duration::from_secs(3_000_000))
            )
            .await,
        Err(IdemError::BadArg(_))
    ));
    let token = new_token(&client, "big", b"fp", BeginOptions::new(LONG)).await;
    let too_large = StoredResponse::new(200, vec![b'x'; 1_048_576]).with_header("h", "v");
    assert!(matches!(
        client
            .complete("big", token, &too_large, Origin::Handler)
            .await,
        Err(IdemError::TooLarge(_))
    ));
    // A header counts its name, its value and HEADER_OVERHEAD bytes.
    let just_fits = StoredResponse::new(
        200,
        vec![b'x'; 1_048_574 - idem_core::args::HEADER_OVERHEAD],
    )
    .with_header("h", "v");
    client
        .complete("big", token, &just_fits, Origin::Mirror)
        .await
        .unwrap();
    assert!(idem_get_async(&mut conn, "nothing").await.is_none());
}

/// A lapsed lease is taken over with a larger token, fencing the old
/// holder; a key is gone once its TTL passes.
async fn leases_and_expiry<C: Conn>(client: IdemClient<C>, mut conn: C) {
    let short = BeginOptions::new(Duration::from_secs(1)).lease(Duration::from_millis(100));
    let old = new_token(&client, "t", b"fp", short).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    let new = new_token(&client, "t", b"fp", short).await;
    assert!(new > old);
    let response = StoredResponse::new(200, "old");
    assert!(matches!(
        client.complete("t", old, &response, Origin::Handler).await,
        Err(IdemError::Stale(_))
    ));
    assert!(!client.abort("t", old).await.unwrap());
    assert!(matches!(
        client.touch("t", old, Duration::from_secs(1)).await,
        Err(IdemError::Stale(_))
    ));
    // The holder's lease lapsed too, but nobody took over: it still completes.
    tokio::time::sleep(Duration::from_millis(150)).await;
    client
        .complete("t", new, &response, Origin::Handler)
        .await
        .unwrap();
    assert_eq!(
        client.begin("t", b"fp", short).await.unwrap(),
        Outcome::Replay(response)
    );
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert!(
        idem_get_async(&mut conn, "t").await.is_none(),
        "the TTL passed"
    );
    new_token(&client, "t", b"another request", short).await;
}

/// `WAIT`: a duplicate gets the holder's response, takes over when the
/// holder aborts, or gets `in_flight` when the wait runs out.
async fn waits<C: Conn>(client: IdemClient<C>) {
    let opts = BeginOptions::new(LONG);
    let waiting = opts.wait(Duration::from_secs(10));

    let holder = new_token(&client, "w1", b"fp", opts).await;
    let response = StoredResponse::new(201, "done");
    let completer = {
        let (client, response) = (client.clone(), response.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            client
                .complete("w1", holder, &response, Origin::Handler)
                .await
                .unwrap();
        })
    };
    let started = Instant::now();
    assert_eq!(
        client.begin("w1", b"fp", waiting).await.unwrap(),
        Outcome::Replay(response)
    );
    assert!(started.elapsed() >= Duration::from_millis(90));
    completer.await.unwrap();

    let holder = new_token(&client, "w2", b"fp", opts).await;
    let aborter = {
        let client = client.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert!(client.abort("w2", holder).await.unwrap());
        })
    };
    match client.begin("w2", b"fp", waiting).await.unwrap() {
        Outcome::New { token } => assert!(token > holder),
        other => panic!("{other:?}"),
    }
    aborter.await.unwrap();

    let holder_opts = opts.lease(Duration::from_millis(300));
    let holder = new_token(&client, "w3", b"fp", holder_opts).await;
    match client.begin("w3", b"fp", waiting).await.unwrap() {
        Outcome::New { token } => assert!(token > holder, "the lapsed lease is taken over"),
        other => panic!("{other:?}"),
    }

    new_token(&client, "w4", b"fp", opts).await;
    let started = Instant::now();
    let outcome = client
        .begin("w4", b"fp", opts.wait(Duration::from_millis(200)))
        .await
        .unwrap();
    assert!(
        matches!(outcome, Outcome::InFlight { retry_after } if retry_after > Duration::from_secs(20)),
        "{outcome:?}"
    );
    assert!(started.elapsed() >= Duration::from_millis(190));
    assert_eq!(
        client.begin("w4", b"other", waiting).await.unwrap(),
        Outcome::Mismatch
    );
}

fn memory() -> (IdemClient<MemoryStore>, MemoryStore) {
    let store = MemoryStore::new();
    (IdemClient::memory(store.clone()), store)
}

async fn redis(server: &RedisServer) -> (IdemClient<StandaloneConnection>, StandaloneConnection) {
    let client = IdemClient::standalone(server.client()).await.unwrap();
    let conn = StandaloneConnection::connect(&server.client(), Transport::Auto)
        .await
        .unwrap();
    (client, conn)
}

#[tokio::test]
async fn outcomes_in_memory() {
    let (client, conn) = memory();
    outcomes(client, conn).await;
}

#[tokio::test]
async fn outcomes_on_redis() {
    let server = RedisServer::start();
    let (client, conn) = redis(&server).await;
    outcomes(client, conn).await;
}

#[tokio::test]
async fn refusals_in_memory() {
    let (client, conn) = memory();
    refusals(client, conn).await;
}

#[tokio::test]
async fn refusals_on_redis() {
    let server = RedisServer::start();
    let (client, conn) = redis(&server).await;
    refusals(client, conn).await;
}

#[tokio::test]
async fn leases_and_expiry_in_memory() {
    let (client, conn) = memory();
    leases_and_expiry(client, conn).await;
}

#[tokio::test]
async fn leases_and_expiry_on_redis() {
    let server = RedisServer::start();
    let (client, conn) = redis(&server).await;
    leases_and_expiry(client, conn).await;
}

#[tokio::test]
async fn waits_in_memory() {
    waits(memory().0).await;
}

#[tokio::test]
async fn waits_on_redis() {
    let server = RedisServer::start();
    waits(redis(&server).await.0).await;
}

/// Paused tokio time drives the store's clock: a day-long lease lapses at
/// once.
#[tokio::test(start_paused = true)]
async fn paused_time_drives_leases_and_ttls() {
    let (client, mut conn) = memory();
    let opts =
        BeginOptions::new(Duration::from_secs(2 * 86_400)).lease(Duration::from_secs(86_400));
    let first = new_token(&client, "p", b"fp", opts).await;
    tokio::time::advance(Duration::from_secs(86_399)).await;
    assert!(matches!(
        client.begin("p", b"fp", opts).await.unwrap(),
        Outcome::InFlight { retry_after } if retry_after == Duration::from_secs(1)
    ));
    tokio::time::advance(Duration::from_secs(1)).await;
    let second = new_token(&client, "p", b"fp", opts).await;
    assert!(second > first);
    tokio::time::advance(Duration::from_secs(86_400)).await;
    assert!(idem_get_async(&mut conn, "p").await.is_none());
}

#[tokio::test]
async fn memory_refuses_other_commands() {
    let (_, mut conn) = memory();
    let refused = [
        redis::cmd("IDEM.MIRROR.PULL").arg(10).clone(),
        redis::cmd("IDEM._PUT").arg("k").arg("x").clone(),
        redis::cmd("SET").arg("k").arg("v").clone(),
    ];
    for (i, cmd) in refused.iter().enumerate() {
        match raw(&mut conn, cmd).await {
            Err(IdemError::Redis(err)) => {
                assert_eq!(err.code(), Some("ERR"), "{err}");
                assert!(
                    err.to_string().contains("in-memory store runs IDEM.BEGIN"),
                    "{err}"
                );
            }
            other => panic!("command {i}: {other:?}"),
        }
    }
    let pipeline: redis::RedisResult<Vec<redis::Value>> = redis::pipe()
        .cmd("IDEM.GET")
        .arg("k")
        .query_async(&mut conn)
        .await;
    assert!(pipeline.is_err());
}
