//! `Pipe`, idem's multiplexed connection, against real redis-servers: every
//! caller gets its own reply under load and after abandoned calls, a dead or
//! stalled server fails calls instead of hanging them, the connection comes
//! back with the server, and AUTH, SELECT, TCP settings and Unix sockets
//! are set up.

use std::future::Future;
use std::time::{Duration, Instant};

use idem_client::{IdemClient, IdemError, Pipe, StandaloneConnection, Transport};
use idem_testkit::{RedisConfig, RedisServer};
use redis::aio::ConnectionLike;
use redis::io::tcp::socket2::{SockRef, TcpKeepalive};
use redis::io::tcp::TcpSettings;
use tokio::task::JoinHandle;

async fn pipe(server: &RedisServer) -> Pipe {
    Pipe::connect(&server.client()).await.unwrap()
}

/// Stalls `server` for `secs` with `DEBUG SLEEP` on a connection of its own;
/// returns once the sleep has begun, with the sleep's task.
async fn stall(server: &RedisServer, secs: u32) -> JoinHandle<redis::RedisResult<()>> {
    let mut sleeper = server.async_conn().await;
    let sleep = tokio::spawn(async move {
        redis::cmd("DEBUG")
            .arg("SLEEP")
            .arg(secs)
            .query_async::<()>(&mut sleeper)
            .await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    sleep
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
    let pipe = pipe(&server).await;
    let mut conn = pipe.clone();
    for i in 0..50 {
        let () = redis::cmd("SET")
            .arg(format!("k:{i}"))
            .arg(i)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let sleep = stall(&server, 1).await;
    // Calls queued behind the stall are given up by their callers; their
    // replies come later, to nobody.
    let started = Instant::now();
    let mut abandoned = Vec::new();
    for i in 0..50 {
        let mut conn = pipe.clone();
        abandoned.push(tokio::spawn(async move {
            let cmd = redis::cmd("GET").arg(format!("k:{i}")).clone();
            tokio::time::timeout(
                Duration::from_millis(200),
                cmd.query_async::<i64>(&mut conn),
            )
            .await
        }));
    }
    for task in abandoned {
        assert!(
            task.await.unwrap().is_err(),
            "the call was answered during the stall"
        );
    }
    assert!(started.elapsed() < Duration::from_secs(1));
    // Asked while the abandoned replies are still on their way: each call
    // gets its own reply, not one meant for an abandoned call.
    let mut later = Vec::new();
    for j in 0..50 {
        let mut conn = pipe.clone();
        later.push(tokio::spawn(async move {
            let i = (j + 7) % 50;
            let got: i64 = redis::cmd("GET")
                .arg(format!("k:{i}"))
                .query_async(&mut conn)
                .await
                .unwrap();
            assert_eq!(got, i);
        }));
    }
    for task in later {
        task.await.unwrap();
    }
    sleep.await.unwrap().unwrap();
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
async fn a_server_refusing_the_connection_is_unavailable_not_an_answer() {
    refusing_the_connection(None).await;
    // With a password the refusal arrives where AUTH's answer is awaited; it
    // is still an outage, not refused credentials.
    refusing_the_connection(Some("secret")).await;
}

async fn refusing_the_connection(password: Option<&str>) {
    let server = RedisServer::start();
    let mut admin = server.async_conn().await;
    let client = match password {
        None => server.client(),
        Some(password) => {
            let () = redis::cmd("CONFIG")
                .arg("SET")
                .arg("requirepass")
                .arg(password)
                .query_async(&mut admin)
                .await
                .unwrap();
            let url = format!("redis://:{password}@127.0.0.1:{}", server.port);
            redis::Client::open(url).unwrap()
        }
    };
    let pipe = Pipe::connect(&client).await.unwrap();
    let mut conn = pipe.clone();
    // The admin connection fills the server; the pipe's is killed, so its
    // reconnect is refused with `-ERR max number of clients reached`.
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxclients")
        .arg(1)
        .query_async(&mut admin)
        .await
        .unwrap();
    let _: i64 = redis::cmd("CLIENT")
        .arg(vec!["KILL", "TYPE", "normal", "SKIPME", "yes"])
        .query_async(&mut admin)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_millis(500);
    while Instant::now() < deadline {
        let err = redis::cmd("SET")
            .arg("refused")
            .arg(1)
            .query_async::<()>(&mut conn)
            .await
            .unwrap_err();
        assert!(
            IdemError::from(err).is_unavailable(),
            "a refusal taken as the command's answer"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let err = Pipe::connect(&client).await.unwrap_err();
    assert!(err.to_string().contains("max number of clients"), "{err}");
    assert!(IdemError::from(err).is_unavailable());
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxclients")
        .arg(100)
        .query_async(&mut admin)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while redis::cmd("PING")
        .query_async::<String>(&mut conn)
        .await
        .is_err()
    {
        assert!(
            Instant::now() < deadline,
            "no reconnect once the server accepts"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_stops_answering_is_given_up_after_ten_seconds() {
    let server = RedisServer::start();
    let mut conn = pipe(&server).await;
    let sleep = stall(&server, 13).await;
    // No timeout of the caller's own: the connection gives the call up.
    let started = Instant::now();
    let err = redis::cmd("PING")
        .query_async::<String>(&mut conn)
        .await
        .unwrap_err();
    let took = started.elapsed();
    assert!(IdemError::from(err).is_unavailable());
    assert!(
        took >= Duration::from_secs(9) && took < Duration::from_secs(12),
        "given up after {took:?}"
    );
    sleep.await.unwrap().unwrap();
    let pong: String = redis::cmd("PING").query_async(&mut conn).await.unwrap();
    assert_eq!(pong, "PONG");
}

#[test]
fn a_pipe_outlives_the_runtime_it_was_made_on() {
    let server = RedisServer::start();
    let first = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let pipe = first.block_on(Pipe::connect(&server.client())).unwrap();
    drop(first);
    let second = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    second.block_on(async move {
        let mut conn = pipe.clone();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let cmd = redis::cmd("PING");
            match tokio::time::timeout(Duration::from_secs(1), cmd.query_async::<String>(&mut conn))
                .await
            {
                Ok(Ok(pong)) => break assert_eq!(pong, "PONG"),
                Ok(Err(err)) => assert!(IdemError::from(err).is_unavailable()),
                Err(_) => panic!("a call on a pipe whose runtime is gone hangs"),
            }
            assert!(Instant::now() < deadline, "no reconnect on the new runtime");
        }
    });
}

/// A runtime already shut down: tokio drops what is spawned on it at once.
fn closed_runtime() -> tokio::runtime::Handle {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let handle = runtime.handle().clone();
    runtime.shutdown_background();
    handle
}

async fn ping(conn: &mut Pipe) -> redis::RedisResult<String> {
    redis::cmd("PING").query_async(conn).await
}

/// A connect that finishes on a runtime that is shutting down (its tasks
/// dropped inside `spawn`) leaves the link down. Before, `up` spawned them
/// holding the connection's lock, and their guards' drop locked it again:
/// the thread, and every later user of the pipe, hung for ever.
#[test]
fn a_connect_finishing_on_a_closing_runtime_leaves_the_link_down() {
    let server = RedisServer::start();
    let client = server.client();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let live = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let closed = closed_runtime();
        let pipe = live.block_on(async {
            // First poll on the live runtime (the connect starts), the rest
            // (where `up` spawns the tasks) inside the closed one.
            let mut connect = Box::pin(Pipe::connect(&client));
            let mut polls = 0;
            std::future::poll_fn(|cx| {
                polls += 1;
                let _inside = (polls > 1).then(|| closed.enter());
                connect.as_mut().poll(cx)
            })
            .await
        });
        let answer = pipe.map(|mut pipe| {
            live.block_on(async {
                // The link is down: the next call reconnects on this runtime.
                let deadline = Instant::now() + Duration::from_secs(5);
                loop {
                    match ping(&mut pipe).await {
                        Ok(pong) => break pong,
                        Err(_) if Instant::now() < deadline => {
                            tokio::time::sleep(Duration::from_millis(20)).await
                        }
                        Err(err) => panic!("no reconnect: {err}"),
                    }
                }
            })
        });
        let _ = tx.send(answer.map_err(|e| e.to_string()));
    });
    let answer = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the connect deadlocked");
    assert_eq!(answer.unwrap(), "PONG");
}

/// A reconnect whose task is dropped before it first runs (spawned on a
/// runtime shutting down) leaves the link down, so a later call reconnects.
/// Before, the link stayed "connecting" for ever and every call hung.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_dropped_before_it_ran_leaves_the_link_down() {
    let server = RedisServer::start();
    let mut conn = pipe(&server).await;
    assert_eq!(ping(&mut conn).await.unwrap(), "PONG");
    let mut other = server.async_conn().await;
    let _: redis::Value = redis::cmd("CLIENT")
        .arg(&["KILL", "TYPE", "normal", "SKIPME", "yes"])
        .query_async(&mut other)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await; // the reader saw EOF
    let closed = closed_runtime();
    let cmd = redis::cmd("PING");
    let call = {
        let _inside = closed.enter();
        conn.req_packed_command(&cmd)
    };
    let first = tokio::time::timeout(Duration::from_secs(3), call).await;
    assert!(matches!(first, Ok(Err(_))), "{first:?}");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match tokio::time::timeout(Duration::from_secs(3), ping(&mut conn)).await {
            Ok(Ok(pong)) => break assert_eq!(pong, "PONG"),
            Ok(Err(err)) => assert!(IdemError::from(err).is_unavailable()),
            Err(_) => panic!("a call on the pipe hangs"),
        }
        assert!(Instant::now() < deadline, "no reconnect");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The stall window starts when a call is written, not when the reader
/// began waiting: a call written late in an idle stretch survives a pause of
/// the server shorter than ten seconds. Before, a call written 9.4 s into an
/// idle stretch was failed 0.6 s later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_written_after_an_idle_stretch_gets_the_whole_stall_window() {
    let server = RedisServer::start();
    let mut conn = pipe(&server).await;
    tokio::time::sleep(Duration::from_millis(9300)).await;
    let sleep = stall(&server, 1).await;
    let pong = ping(&mut conn).await;
    sleep.await.unwrap().unwrap();
    assert_eq!(pong.unwrap(), "PONG", "a one-second pause failed the call");
}

/// A `Cmd` marked as getting no reply is refused: its missing reply would
/// pair every later one with the wrong caller.
#[tokio::test]
async fn a_command_without_a_reply_is_refused() {
    let server = RedisServer::start();
    let mut conn = pipe(&server).await;
    let mut silent = redis::cmd("PING");
    silent.set_no_response(true);
    let err = conn.req_packed_command(&silent).await.unwrap_err();
    assert!(err.to_string().contains("get a reply"), "{err}");
    let echo: String = redis::cmd("ECHO")
        .arg("a")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(echo, "a");
}

#[tokio::test]
async fn a_large_reply_read_in_many_pieces_is_read_once() {
    let server = RedisServer::start();
    let mut conn = pipe(&server).await;
    let () = redis::cmd("EVAL")
        .arg("for i = 1, 1000000 do redis.call('RPUSH', KEYS[1], i) end")
        .arg(1)
        .arg("big")
        .query_async(&mut conn)
        .await
        .unwrap();
    let started = Instant::now();
    let items: Vec<i64> = redis::cmd("LRANGE")
        .arg("big")
        .arg(0)
        .arg(-1)
        .query_async(&mut conn)
        .await
        .unwrap();
    let took = started.elapsed();
    assert_eq!(items.len(), 1_000_000);
    assert!(items.iter().zip(1..).all(|(&got, want)| got == want));
    assert!(
        took < Duration::from_secs(5),
        "a 1M-element reply took {took:?}"
    );
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
    // Refused settings are a configuration error, not an outage (fail_open
    // must not run on them): a wrong password, a database out of range.
    assert_eq!(err.kind(), redis::ErrorKind::InvalidClientConfig, "{err}");
    assert!(!IdemError::from(err).is_unavailable());
    let no_such_db = format!("redis://127.0.0.1:{}/99", server.port);
    let err = Pipe::connect(&redis::Client::open(no_such_db).unwrap())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("DB index"), "{err}");
    assert!(!IdemError::from(err).is_unavailable());
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
    let unix = redis::Client::open(url).unwrap();
    let conn = StandaloneConnection::connect(&unix, Transport::Auto)
        .await
        .unwrap();
    assert!(matches!(conn, StandaloneConnection::Pipe(_)));
    let client = IdemClient::new(conn);
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
    // A "server" that answers the connection's PING, then garbage.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let mut reply: &[u8] = b"+PONG\r\n";
                while let Ok(n) = socket.read(&mut buf).await {
                    if n == 0 || socket.write_all(reply).await.is_err() {
                        return;
                    }
                    reply = b"?garbage\r\n";
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

/// Linux: the user timeout and `/proc/self/fd` are Linux's.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn the_connection_infos_tcp_settings_are_applied() {
    let server = RedisServer::start();
    let settings = TcpSettings::default()
        .set_keepalive(TcpKeepalive::new().with_time(Duration::from_secs(37)))
        .set_user_timeout(Duration::from_millis(4321));
    let info = server
        .client()
        .get_connection_info()
        .clone()
        .set_tcp_settings(settings);
    let mut conn = Pipe::connect(&redis::Client::open(info).unwrap())
        .await
        .unwrap();
    let pong: String = redis::cmd("PING").query_async(&mut conn).await.unwrap();
    assert_eq!(pong, "PONG");

    // The server's port is this test's alone (the test kit never hands a
    // port out twice), so the one socket connected to it is the pipe's.
    let sockets = sockets_to(server.port);
    assert_eq!(sockets.len(), 1, "one socket to the server");
    let socket = SockRef::from(&sockets[0]);
    assert!(socket.keepalive().unwrap(), "SO_KEEPALIVE is on");
    assert_eq!(
        socket.tcp_keepalive_time().unwrap(),
        Duration::from_secs(37)
    );
    assert_eq!(
        socket.tcp_user_timeout().unwrap(),
        Some(Duration::from_millis(4321))
    );
    assert!(socket.tcp_nodelay().unwrap(), "TCP_NODELAY is on");
    drop(conn);
}

/// Duplicates of this process' TCP sockets connected to `port` on this
/// host. Each open fd is duplicated first (`F_DUPFD_CLOEXEC`), so a socket
/// that other tests close meanwhile is never touched: its number fails to
/// duplicate, or duplicates whatever now holds it, which the peer check sorts out.
#[cfg(target_os = "linux")]
fn sockets_to(port: u16) -> Vec<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let mut sockets = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd").unwrap() {
        let Ok(fd) = entry.unwrap().file_name().to_string_lossy().parse() else {
            continue;
        };
        // SAFETY: `fcntl` on any number is sound: a closed one fails (EBADF).
        let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
        if dup < 0 {
            continue;
        }
        // SAFETY: `dup` is a new descriptor that nothing else owns.
        let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(dup) };
        let peer = SockRef::from(&owned)
            .peer_addr()
            .ok()
            .and_then(|addr| addr.as_socket());
        if peer.is_some_and(|peer| peer.port() == port) {
            sockets.push(owned);
        }
    }
    sockets
}
