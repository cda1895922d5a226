//! Middleware CPU per request, in process: the layer around a trivial
//! handler, called without HTTP, each request a task of its own (as a server
//! runs it), against a real redis-server with the module. Prints the CPU time
//! of all the process's threads per request: the middleware's own plus the
//! handler's (`bare`: the handler alone).
//!
//! MW_MODE: bare, new (a fresh key per request), replay (one key), pieces
//! (the fingerprint and its parts, in ns), or a PING plus the bare handler
//! through: ping (redis-rs' `ConnectionManager`), mplex (redis-rs'
//! `MultiplexedConnection`), pipe (idem's `Pipe`), floor (a minimal
//! multiplexer: one socket, a writer task that yields before each write as
//! `Pipe` does, a reader task, no RESP parsing) or direct (each request on a
//! socket of its own from a pool). MW_TRANSPORT (new and replay: pipe, the
//! default, or manager), MW_REQUESTS (20000), MW_CONCURRENCY (32),
//! MW_THREADS (0: a current-thread runtime, which callgrind counts
//! repeatably; else that many workers), MW_PACKED (1: the client asks for
//! packed replays; 0: the four-field reply), MW_BODY (canonical JSON;
//! `unsorted`: the same members in another order).

use std::time::Instant;

use bytes::Bytes;
use futures_util::stream::{FuturesUnordered, StreamExt};
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use idem_client::middleware::IdemBody;
use idem_client::{IdemClient, IdempotencyLayer};
use idem_testkit::RedisConfig;
use tower::{Layer, Service, ServiceExt};

/// The request body: canonical JSON (members sorted, compact), or with
/// MW_BODY=unsorted the same members in another order, so canonicalization
/// takes its full way.
fn request_body() -> &'static str {
    static BODY: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();
    BODY.get_or_init(|| match std::env::var("MW_BODY").as_deref() {
        Ok("unsorted") => r#"{"recipient":"acct_bench","amount":1250,"currency":"EUR"}"#,
        _ => r#"{"amount":1250,"currency":"EUR","recipient":"acct_bench"}"#,
    })
}

/// CPU seconds of all threads of this process (schedstat, ns precision).
fn cpu_seconds() -> f64 {
    let mut ns = 0u64;
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let path = task.unwrap().path().join("schedstat");
        if let Ok(text) = std::fs::read_to_string(path) {
            ns += text
                .split_whitespace()
                .next()
                .unwrap()
                .parse::<u64>()
                .unwrap();
        }
    }
    ns as f64 / 1e9
}

fn thread_ns() -> u64 {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap();
    text.split_whitespace().next().unwrap().parse().unwrap()
}

/// The round-trip references (`floor`, `direct`): PING without redis-rs.
mod raw {
    use std::net::SocketAddr;
    use std::sync::{Arc, Mutex};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tokio::sync::{mpsc, oneshot};

    const PING: &[u8] = b"*1\r\n$4\r\nPING\r\n";
    const PONG: &[u8] = b"+PONG\r\n";

    /// Writes queued PINGs in batches on one socket; a reader task answers
    /// them in order.
    #[derive(Clone)]
    pub struct Mux(mpsc::UnboundedSender<oneshot::Sender<()>>);

    impl Mux {
        pub async fn connect(addr: SocketAddr) -> Mux {
            let stream = TcpStream::connect(addr).await.unwrap();
            stream.set_nodelay(true).unwrap();
            let (mut rd, mut wr) = stream.into_split();
            let (tx, mut queued) = mpsc::unbounded_channel::<oneshot::Sender<()>>();
            let (sent, mut waiting) = mpsc::unbounded_channel::<oneshot::Sender<()>>();
            tokio::spawn(async move {
                let mut out = Vec::new();
                while let Some(reply) = queued.recv().await {
                    // Let every ready request queue its PING first, as `Pipe` does.
                    tokio::task::yield_now().await;
                    out.extend_from_slice(PING);
                    sent.send(reply).unwrap();
                    while let Ok(reply) = queued.try_recv() {
                        out.extend_from_slice(PING);
                        sent.send(reply).unwrap();
                    }
                    wr.write_all(&out).await.unwrap();
                    out.clear();
                }
            });
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                let mut have = 0;
                loop {
                    let n = rd.read(&mut buf[have..]).await.unwrap();
                    if n == 0 {
                        return;
                    }
                    have += n;
                    let mut at = 0;
                    while have - at >= PONG.len() {
                        assert_eq!(&buf[at..at + PONG.len()], PONG);
                        let _ = waiting.recv().await.unwrap().send(());
                        at += PONG.len();
                    }
                    buf.copy_within(at..have, 0);
                    have -= at;
                }
            });
            Mux(tx)
        }

        pub async fn ping(&self) {
            let (tx, rx) = oneshot::channel();
            self.0.send(tx).unwrap();
            rx.await.unwrap();
        }
    }

    /// Sockets lent to one request at a time.
    #[derive(Clone)]
    pub struct Direct(SocketAddr, Arc<Mutex<Vec<TcpStream>>>);

    impl Direct {
        pub fn new(addr: SocketAddr) -> Direct {
            Direct(addr, Arc::default())
        }

        pub async fn ping(&self) {
            let idle = self.1.lock().unwrap().pop();
            let mut stream = match idle {
                Some(stream) => stream,
                None => {
                    let stream = TcpStream::connect(self.0).await.unwrap();
                    stream.set_nodelay(true).unwrap();
                    stream
                }
            };
            stream.write_all(PING).await.unwrap();
            let mut buf = [0u8; 16];
            let mut got = 0;
            while got < PONG.len() {
                got += stream.read(&mut buf[got..]).await.unwrap();
            }
            assert_eq!(&buf[..got], PONG);
            self.1.lock().unwrap().push(stream);
        }
    }
}

async fn handler<B>(request: Request<B>) -> Result<Response<Full<Bytes>>, std::convert::Infallible>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let body = request.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body.len(), request_body().len());
    let mut response = Response::new(Full::new(Bytes::from_static(
        br#"{"id":"pay_0123456789","amount":1250,"currency":"EUR","recipient":"acct_bench","status":"created"}"#,
    )));
    *response.status_mut() = StatusCode::CREATED;
    response
        .headers_mut()
        .insert("content-type", HeaderValue::from_static("application/json"));
    response.headers_mut().insert(
        "location",
        HeaderValue::from_static("/payments/pay_0123456789"),
    );
    Ok(response)
}

fn request(key: Option<String>) -> Request<Full<Bytes>> {
    let mut builder = Request::post("/payments")
        .header("content-type", "application/json")
        .header("x-account-id", "acct_bench")
        .header("host", "127.0.0.1:1234")
        .header("user-agent", "bench");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder
        .body(Full::new(Bytes::from_static(request_body().as_bytes())))
        .unwrap()
}

fn pieces() {
    let n = 200_000;
    let fingerprinter = idem_client::Fingerprinter::new().canonical_json(true);
    let request = request(Some("k-1".into()));
    let (parts, _) = request.into_parts();
    let time = |name: &str, f: &mut dyn FnMut() -> usize| {
        let started = thread_ns();
        let mut sink = 0;
        for _ in 0..n {
            sink += f();
        }
        println!(
            "{name:<20} {:>8.0} ns  ({sink})",
            (thread_ns() - started) as f64 / n as f64
        );
    };
    time("fingerprint", &mut || {
        fingerprinter
            .fingerprint(
                &parts.method,
                &parts.uri,
                &parts.headers,
                request_body().as_bytes(),
            )
            .as_bytes()[0] as usize
    });
    time("canonicalize", &mut || {
        idem_client::canonical_json::canonicalize(request_body().as_bytes())
            .unwrap()
            .len()
    });
    let unsorted = r#"{"recipient":"acct_bench","amount":1250,"currency":"EUR"}"#;
    time("fingerprint unsorted", &mut || {
        fingerprinter
            .fingerprint(
                &parts.method,
                &parts.uri,
                &parts.headers,
                unsorted.as_bytes(),
            )
            .as_bytes()[0] as usize
    });
    let raw = idem_client::Fingerprinter::new();
    time("fingerprint raw", &mut || {
        raw.fingerprint(
            &parts.method,
            &parts.uri,
            &parts.headers,
            request_body().as_bytes(),
        )
        .as_bytes()[0] as usize
    });
    time("stored_hex", &mut || {
        idem_client::fingerprint::stored_hex(&[7u8; 32]).len()
    });
    time("fence new", &mut || {
        let f = idem_client::Fence::new(
            "idem:{acct_bench:k-1}",
            42,
            &[7u8; 32],
            std::time::Duration::from_secs(60),
        );
        std::mem::size_of_val(&f)
    });
    time("redis_key", &mut || {
        idem_client::middleware::redis_key("idem:", "acct_bench", "k-1").len()
    });
}

fn main() {
    let mode = std::env::var("MW_MODE").unwrap_or_else(|_| "new".into());
    if mode == "pieces" {
        return pieces();
    }
    let total: usize = std::env::var("MW_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20000);
    let concurrency: usize = std::env::var("MW_CONCURRENCY")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(32);
    let redis = RedisConfig::default().start();
    let threads: usize = std::env::var("MW_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let runtime = if threads == 0 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()
            .unwrap()
    };
    runtime.block_on(async move {
        let manager = redis::aio::ConnectionManager::new(redis.client())
            .await
            .unwrap();
        let mplex = redis
            .client()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let pipe = idem_client::Pipe::connect(&redis.client()).await.unwrap();
        let packed = std::env::var("MW_PACKED").map_or(true, |v| v != "0");
        let transport = match std::env::var("MW_TRANSPORT").as_deref() {
            Ok("manager") => idem_client::Transport::Manager,
            _ => idem_client::Transport::Pipe,
        };
        let client = IdemClient::standalone_with(redis.client(), transport)
            .await
            .unwrap()
            .with_packed_replies(packed);
        let layer = IdempotencyLayer::new(client)
            .tenant_header(http::HeaderName::from_static("x-account-id"));
        let service = layer.layer(tower::service_fn(handler::<IdemBody<Full<Bytes>>>));
        let bare = tower::service_fn(handler::<Full<Bytes>>);
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], redis.port));
        let mux = raw::Mux::connect(addr).await;
        let direct = raw::Direct::new(addr);
        // Seed the replay key and warm up.
        let seeded = service
            .clone()
            .oneshot(request(Some("replay-key".into())))
            .await
            .unwrap();
        assert_eq!(seeded.status(), StatusCode::CREATED);
        let run = |count: usize, offset: usize| {
            let manager = manager.clone();
            let mplex = mplex.clone();
            let pipe = pipe.clone();
            let service = service.clone();
            let mode = mode.clone();
            let (mux, direct) = (mux.clone(), direct.clone());
            async move {
                let mut next = 0;
                let mut running = FuturesUnordered::new();
                let mut done = 0;
                while done < count {
                    while next < count && running.len() < concurrency {
                        let i = offset + next;
                        next += 1;
                        let mut service = service.clone();
                        let mut bare = bare;
                        let mode = mode.clone();
                        let mut manager = manager.clone();
                        let mut mplex = mplex.clone();
                        let mut pipe = pipe.clone();
                        let (mux, direct) = (mux.clone(), direct.clone());
                        running.push(tokio::spawn(async move {
                            let (status, body) = match mode.as_str() {
                                "ping" | "floor" | "direct" | "mplex" | "pipe" => {
                                    match mode.as_str() {
                                        "pipe" => redis::cmd("PING")
                                            .query_async::<()>(&mut pipe)
                                            .await
                                            .unwrap(),
                                        "floor" => mux.ping().await,
                                        "direct" => direct.ping().await,
                                        "mplex" => redis::cmd("PING")
                                            .query_async::<()>(&mut mplex)
                                            .await
                                            .unwrap(),
                                        _ => redis::cmd("PING")
                                            .query_async::<()>(&mut manager)
                                            .await
                                            .unwrap(),
                                    }
                                    let r = bare.call(request(None)).await.unwrap();
                                    (
                                        r.status(),
                                        r.into_body().collect().await.unwrap().to_bytes(),
                                    )
                                }
                                "bare" => {
                                    let r = bare.call(request(None)).await.unwrap();
                                    (
                                        r.status(),
                                        r.into_body().collect().await.unwrap().to_bytes(),
                                    )
                                }
                                "replay" => {
                                    let r = service
                                        .call(request(Some("replay-key".into())))
                                        .await
                                        .unwrap();
                                    (
                                        r.status(),
                                        r.into_body().collect().await.unwrap().to_bytes(),
                                    )
                                }
                                _ => {
                                    let r = service
                                        .call(request(Some(format!("k-{i}"))))
                                        .await
                                        .unwrap();
                                    (
                                        r.status(),
                                        r.into_body().collect().await.unwrap().to_bytes(),
                                    )
                                }
                            };
                            assert_eq!(status, StatusCode::CREATED);
                            body.len()
                        }));
                    }
                    running.next().await;
                    done += 1;
                }
            }
        };
        run(2000, 0).await;
        let cpu = cpu_seconds();
        let started = Instant::now();
        run(total, 1_000_000).await;
        let cpu = cpu_seconds() - cpu;
        println!(
            "mode {mode}: {total} requests, {:.1} us CPU/request, {:.0} req/s",
            cpu / total as f64 * 1e6,
            total as f64 / started.elapsed().as_secs_f64()
        );
    });
}
