//! Shared helpers for idem-client's integration tests: a BEGIN that must
//! answer `new`, typed access to `IDEM.GET`, an axum server on a free port,
//! and HTTP calls.

#![allow(dead_code)]

use std::collections::HashMap;
use std::time::Duration;

use axum::Router;
use idem_client::{BeginOptions, IdemClient, Outcome};
use tokio::sync::oneshot;

/// `IDEM.BEGIN` that must answer `new`: its token.
pub async fn new_token(
    client: &IdemClient<impl redis::aio::ConnectionLike + Clone + Send + Sync + 'static>,
    key: &str,
    fp: &[u8],
    options: BeginOptions,
) -> u64 {
    match client.begin(key, fp, options).await.expect("BEGIN") {
        Outcome::New { token } => token,
        other => panic!("{key}: expected new, got {other:?}"),
    }
}

/// `IDEM.GET key` (parsed by `idem_core::wire`) as its fields by name,
/// strings and integers as text (`None` when there is no record).
pub async fn idem_get(
    conn: &mut redis::aio::MultiplexedConnection,
    key: &str,
) -> Option<HashMap<String, String>> {
    let record = idem_testkit::wire::idem_get_async(conn, key).await?;
    Some(idem_testkit::wire::get_fields(&record))
}

/// A field of [`idem_get`].
pub fn text(field: &str) -> String {
    field.to_string()
}

pub async fn state_of(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> Option<String> {
    let record = idem_testkit::wire::idem_get_async(conn, key).await?;
    Some(idem_testkit::wire::state_word(&record).to_string())
}

/// An axum router served on 127.0.0.1 until dropped.
pub struct Server {
    pub base: String,
    stop: Option<oneshot::Sender<()>>,
}

impl Server {
    pub async fn start(router: Router) -> Server {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, router)
                .with_graceful_shutdown(async move {
                    let _ = stopped.await;
                })
                .await;
        });
        Server {
            base,
            stop: Some(stop),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

pub use idem_testkit::http::Reply;

pub async fn post(base: &str, path: &str, key: Option<&str>, body: &str) -> Reply {
    send(
        reqwest::Client::new().post(format!("{base}{path}")),
        key,
        body,
    )
    .await
}

pub async fn send(request: reqwest::RequestBuilder, key: Option<&str>, body: &str) -> Reply {
    let mut request = request
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    idem_testkit::http::send(request).await
}

pub const LONG: Duration = Duration::from_secs(60);

/// A `redis-server` without the module (a managed Redis, as the Functions
/// library meets it), on a free port; killed and its directory removed on
/// drop.
pub struct BareRedis {
    pub port: u16,
    dir: std::path::PathBuf,
    child: std::process::Child,
}

impl BareRedis {
    pub fn start() -> BareRedis {
        BareRedis::start_with(&[])
    }

    /// With extra server options (`["--replicaof", "127.0.0.1 6400"]`).
    pub fn start_with(args: &[&str]) -> BareRedis {
        let port = idem_testkit::free_port();
        let dir = idem_testkit::scratch_dir("bare-redis");
        let child = std::process::Command::new(idem_testkit::server_binary())
            .arg("--port")
            .arg(port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&dir)
            .arg("--logfile")
            .arg(dir.join("redis.log"))
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        let server = BareRedis { port, dir, child };
        let ready = idem_testkit::eventually(Duration::from_secs(20), || {
            server
                .client()
                .get_connection()
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
                .is_ok()
        });
        assert!(ready, "redis-server did not start: {}", server.log());
        server
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub fn client(&self) -> redis::Client {
        redis::Client::open(self.url()).expect("redis url")
    }

    /// One command on a fresh connection.
    pub fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> redis::RedisResult<T> {
        let mut conn = self.client().get_connection()?;
        let mut cmd = redis::cmd(args[0]);
        for arg in &args[1..] {
            cmd.arg(*arg);
        }
        cmd.query(&mut conn)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default()
    }
}

impl Drop for BareRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
