//! `Pipe`, idem's multiplexed connection, against real redis-servers: every
//! caller gets its own reply under load and after abandoned calls, a dead or
//! stalled server fails calls instead of hanging them, the connection comes
//! back with the server, and AUTH, SELECT and Unix sockets are set up.

use std::time::{Duration, Instant};

use idem_client::{IdemClient, IdemError, Pipe, StandaloneConnection, Transport};
use idem_testkit::{RedisConfig, RedisServer};
use redis::aio::ConnectionLike;

async fn pipe(server: &RedisServer) -> Pipe {
    Pipe::connect(&server.client()).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_caller_gets_its_own_reply() {
    let server = RedisServer::start();
    let pipe = pipe(&server).await;
    let mut tasks = Vec::new();
    for i in 0..2000 {
        let mut conn = pipe.clone();
        tasks.push(tokio::spawn(async move {
            let key = format!("pipe:{i}");
            let value = format!("value-{i}-{}", "x".repeat(i % 300));
            let () = redis::cmd("SET")
                .arg(&key)
                .arg(&value)
                .query_async(&mut conn)
                .await
                .unwrap();
            let got: String = redis::cmd("GET")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .unwrap();
            assert_eq!(got, value);
            let missing: Option<String> = redis::cmd("GET")
                .arg(format!("{key}:none"))
                .query_async(&mut conn)
                .await
                .unwrap();
            assert_eq!(missing, None);
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    // A transaction: the replies of MULTI and the queued commands are
    // skipped, EXEC's array is the result.
    let mut conn = pipe.clone();
    let (a, b): (i64, i64) = redis::pipe()
        .atomic()
        .incr("pipe:counter", 2)
        .incr("pipe:counter", 3)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!((a, b), (2, 5));
    // A server error is the error redis-rs' own connections give.
    let err = redis::cmd("INCR")
        .arg("pipe:0")
        .query_async::<i64>(&mut conn)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("ERR"), "{err}");
    assert_eq!(conn.get_db(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_abandoned_on_a_stalled_server_do_not_shift_later_replies() {
    let server = RedisServer::start();
    let client = IdemClient::standalone_with(server.client(), Transport::Pipe)
        .await
        .unwrap()
        .with_call_timeout(Duration::from_millis(200));
    let StandaloneConnection::Pipe(pipe) =
        StandaloneConnection::connect(&server.client(), Transport::Auto)
            .await
            .unwrap()
    else {
        panic!("a plain TCP address gets a Pipe");
    };
    let mut sleeper = server.async_conn().await;
    let sleep = tokio::spawn(async move {
        redis::cmd("DEBUG")
            .arg("SLEEP")
            .arg("1")
            .query_async::<()>(&mut sleeper)
            .await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Calls queued behind the stall time out; their replies come later.
    let mut abandoned = Vec::new();
    for i in 0..50 {
        let client = client.clone();
        abandoned.push(tokio::spawn(async move {
            client.abort(&format!("idem:stalled:{i}"), 1).await
        }));
        let mut conn = pipe.clone();
        abandoned.push(tokio::spawn(async move {
            redis::cmd("SET")
                .arg(format!("stalled:{i}"))
                .arg(i)
                .query_async::<()>(&mut conn)
                .await
                .map(|()| true)
                .map_err(IdemError::from)
        }));
    }
    let started = Instant::now();
    for task in abandoned.drain(..50) {
        let result = tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("a call on a stalled server returns by its timeout")
            .unwrap();
        if let Err(err) = result {
            assert!(err.is_unavailable(), "{err}");
        }
    }
    assert!(started.elapsed() < Duration::from_secs(2));
    sleep.await.unwrap().unwrap();
    for task in abandoned {
        let _ = task.await.unwrap();
    }
    // Every later call gets its own reply, not one meant for an abandoned call.
    let mut conn = pipe.clone();
    for i in 0..200 {
        let key = format!("after:{i}");
        let () = redis::cmd("SET")
            .arg(&key)
            .arg(i)
            .query_async(&mut conn)
            .await
            .unwrap();
        let got: i64 = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(got, i);
        assert!(!client.abort(&format!("idem:after:{i}"), 7).await.unwrap());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_server_fails_calls_at_once_and_the_pipe_reconnects() {
    let mut server = RedisServer::start();
    let pipe = pipe(&server).await;
    // Calls in flight when the server dies fail with an I/O error, at once.
    let mut pending = Vec::new();
    for _ in 0..20 {
        let mut conn = pipe.clone();
        pending.push(tokio::spawn(async move {
            redis::cmd("DEBUG")
                .arg("SLEEP")
                .arg("0.2")
                .query_async::<()>(&mut conn)
                .await
        }));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    server.kill();
    let killed = Instant::now();
    for task in pending {
        let result = tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("a call on a dead connection returns")
            .unwrap();
        if let Err(err) = result {
            assert!(IdemError::from(err).is_unavailable());
        }
    }
    assert!(killed.elapsed() < Duration::from_secs(1));
    // While the server is down, calls fail fast.
    let mut conn = pipe.clone();
    let started = Instant::now();
    for _ in 0..5 {
        let err = redis::cmd("PING")
            .query_async::<String>(&mut conn)
            .await
            .unwrap_err();
        assert!(IdemError::from(err).is_unavailable());
    }
    assert!(started.elapsed() < Duration::from_secs(3));
    // The server is back: the same pipe answers again.
    server.restart();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match redis::cmd("PING").query_async::<String>(&mut conn).await {
            Ok(pong) => {
                assert_eq!(pong, "PONG");
                break;
            }
            Err(err) => {
                assert!(Instant::now() < deadline, "no reconnect: {err}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

#[tokio::test]
async fn auth_and_database_are_set_up() {
    let server = RedisServer::start();
    let mut admin = server.async_conn().await;
    let () = redis::cmd("ACL")
        .arg(vec!["SETUSER", "payments", "on", ">s3cret", "~*", "+@all"])
        .query_async(&mut admin)
        .await
        .unwrap();
    let url = format!("redis://payments:s3cret@127.0.0.1:{}/3", server.port);
    let pipe = Pipe::connect(&redis::Client::open(url).unwrap())
        .await
        .unwrap();
    let mut conn = pipe.clone();
    let () = redis::cmd("SET")
        .arg("in-db-3")
        .arg("yes")
        .query_async(&mut conn)
        .await
        .unwrap();
    let whoami: String = redis::cmd("ACL")
        .arg("WHOAMI")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(whoami, "payments");
    assert_eq!(conn.get_db(), 3);
    let () = redis::cmd("SELECT")
        .arg(3)
        .query_async(&mut admin)
        .await
        .unwrap();
    let there: Option<String> = redis::cmd("GET")
        .arg("in-db-3")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(there.as_deref(), Some("yes"));

    let wrong = format!("redis://payments:wrong@127.0.0.1:{}/", server.port);
    let err = Pipe::connect(&redis::Client::open(wrong).unwrap())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("WRONGPASS"), "{err}");
    // Dropping the last clone closes the connection.
    let clients = |list: String| list.lines().filter(|l| l.contains("user=payments")).count();
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(clients(list), 1);
    drop((pipe, conn));
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let list: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query_async(&mut admin)
            .await
            .unwrap();
        if clients(list) == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the connection stayed open");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_unix_socket_works_and_resp3_is_left_to_redis_rs() {
    let dir = idem_testkit::scratch_dir("pipe-unix");
    let socket = dir.join("redis.sock");
    let server = RedisConfig::default()
        .server_arg("unixsocket", socket.to_str().unwrap())
        .start();
    let url = format!("redis+unix://{}", socket.display());
    let client = IdemClient::standalone(redis::Client::open(url).unwrap())
        .await
        .unwrap();
    assert!(!client.abort("idem:unix", 1).await.unwrap());
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();

    // RESP3 is left to redis-rs.
    let server = RedisServer::start();
    let resp3 = redis::Client::open(format!("{}?protocol=resp3", server.url())).unwrap();
    assert!(Pipe::supports(resp3.get_connection_info()).is_err());
    let err = Pipe::connect(&resp3).await.unwrap_err();
    assert!(err.to_string().contains("RESP2"), "{err}");
    let conn = StandaloneConnection::connect(&resp3, Transport::Auto)
        .await
        .unwrap();
    assert!(matches!(conn, StandaloneConnection::Manager(_)));
    let client = IdemClient::new(conn);
    assert!(!client.abort("idem:resp3", 1).await.unwrap());
}

#[tokio::test]
async fn bytes_that_are_not_resp_close_the_connection() {
    // A "server" that answers every command with garbage.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                while let Ok(n) = socket.read(&mut buf).await {
                    if n == 0 || socket.write_all(b"?garbage\r\n").await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).unwrap();
    let mut pipe = Pipe::connect(&client).await.unwrap();
    let cmd = redis::cmd("PING");
    let ping = cmd.query_async::<String>(&mut pipe);
    let err = tokio::time::timeout(Duration::from_secs(5), ping)
        .await
        .expect("a call answered with garbage returns")
        .unwrap_err();
    assert!(err.to_string().contains("not a RESP2 reply"), "{err}");
    assert!(IdemError::from(err).is_unavailable());
}
