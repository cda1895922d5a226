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
