//! Test harness for the payments API: Redis with the module, a throwaway
//! Postgres database, the writer (on demand), and the API served over real
//! TCP on a free port; `processes` runs the API and the writer as processes.

#![allow(dead_code)]

pub mod processes;

use std::time::Duration;

use axum::extract::Request;
use axum::middleware::{from_fn, Next};
use deadpool_postgres::Pool;
use idem_client::Transport;
use idem_example_payments::{
    authenticated, db, idempotency_layer, routes, serve, AppState, Tokens,
};
use idem_testkit::{PgDatabase, RedisConfig, RedisServer};
use serde_json::{json, Value};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

#[derive(Default)]
pub struct Options {
    pub read_through: bool,
    pub wait: Option<Duration>,
    pub lease: Option<Duration>,
    /// Extra time every handler call takes (a slow payment processor).
    pub handler_delay: Option<Duration>,
}

pub struct TestApp {
    pub base: String,
    pub http: reqwest::Client,
    pub pool: Pool,
    pub redis: RedisServer,
    pub db: PgDatabase,
    server: Option<(oneshot::Sender<()>, JoinHandle<anyhow::Result<()>>)>,
    writer: Option<(oneshot::Sender<()>, JoinHandle<idem_writer::Result<()>>)>,
}

pub use idem_testkit::http::Reply;

/// The tokens the test app accepts: `tok_<account>` for each account the
/// tests post as, and `tok_demo` (the account `acct_demo`) for posts that
/// name none.
pub const TOKENS: &str = "tok_demo=acct_demo,tok_acct_1=acct_1,tok_acct_a=acct_a,tok_acct_b=acct_b";

pub fn payment(amount: i64) -> Value {
    json!({ "amount": amount, "currency": "EUR", "recipient": "acct_bob" })
}

impl TestApp {
    pub async fn start(options: Options) -> TestApp {
        let redis = RedisConfig::default().start();
        let db = PgDatabase::create();
        let pool = db::pool(&db.url, 32).expect("pool");
        db::migrate(&pool).await.expect("payments migration");
        {
            let mut client = db.connect().await;
            idem_writer::migrate(&mut client)
                .await
                .expect("mirror migration");
        }
        let read_through = options.read_through.then(|| pool.clone());
        // As payments-api runs with the fence: the claim up front.
        let mut layer = idempotency_layer(&redis.url(), read_through, Transport::Auto)
            .await
            .expect("layer")
            .claim_up_front(true);
        if let Some(wait) = options.wait {
            layer = layer.wait_for_result(wait);
        }
        if let Some(lease) = options.lease {
            layer = layer.lease(lease);
        }
        let mut router = routes(AppState::new(pool.clone()));
        if let Some(delay) = options.handler_delay {
            router = router.layer(from_fn(move |request: Request, next: Next| async move {
                tokio::time::sleep(delay).await;
                next.run(request).await
            }));
        }
        let tokens = Tokens::parse(TOKENS).expect("tokens");
        let router = authenticated(router.layer(layer), tokens.into());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, router, async move {
            let _ = stopped.await;
        }));
        TestApp {
            base,
            http: reqwest::Client::builder()
                .pool_max_idle_per_host(256)
                .build()
                .expect("http client"),
            pool,
            redis,
            db,
            server: Some((stop, server)),
            writer: None,
        }
    }

    /// Runs the mirror writer against this app's Redis and database.
    pub fn start_writer(&mut self) {
        let mut config =
            idem_writer::WriterConfig::new(vec![self.redis.url()], self.db.url.clone());
        config.block = Duration::from_millis(100);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(idem_writer::run(config, async move {
            let _ = stopped.await;
        }));
        self.writer = Some((stop, task));
    }

    /// `POST /payments` as `account` (its bearer token; `None`: `acct_demo`).
    pub async fn post(&self, key: Option<&str>, account: Option<&str>, body: &Value) -> Reply {
        let token = format!("tok_{}", account.unwrap_or("demo"));
        self.post_with(key, Some(&format!("Bearer {token}")), &[], body)
            .await
    }

    /// `POST /payments` with this `Authorization` (or none) and more headers.
    pub async fn post_with(
        &self,
        key: Option<&str>,
        authorization: Option<&str>,
        headers: &[(&str, &str)],
        body: &Value,
    ) -> Reply {
        let mut request = self.http.post(format!("{}/payments", self.base)).json(body);
        if let Some(key) = key {
            request = request.header("idempotency-key", format!("\"{key}\""));
        }
        if let Some(authorization) = authorization {
            request = request.header("authorization", authorization);
        }
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        idem_testkit::http::send(request).await
    }

    pub async fn get(&self, path: &str) -> Reply {
        let request = self.http.get(format!("{}{path}", self.base));
        idem_testkit::http::send(request.header("authorization", "Bearer tok_demo")).await
    }

    pub async fn payment_count(&self) -> i64 {
        let client = self.pool.get().await.expect("pg");
        client
            .query_one("SELECT count(*) FROM payments", &[])
            .await
            .expect("count")
            .get(0)
    }

    /// Whether the mirror holds `key` as completed.
    pub async fn mirrored(&self, key: &str) -> bool {
        let client = self.pool.get().await.expect("pg");
        client
            .query_opt(
                "SELECT 1 FROM idempotency_keys WHERE key = $1 AND status = 'completed'",
                &[&key],
            )
            .await
            .expect("mirror lookup")
            .is_some()
    }

    pub async fn redis_cmd(&self, cmd: &mut redis::Cmd) -> redis::Value {
        let mut conn = self.redis.async_conn().await;
        cmd.query_async(&mut conn).await.expect("redis command")
    }

    pub async fn info_field(&self, name: &str) -> u64 {
        let mut conn = self.redis.async_conn().await;
        let text = idem_testkit::info::idem_info_text_async(&mut conn).await;
        idem_testkit::info::info_int(&text, name)
            .and_then(|v| u64::try_from(v).ok())
            .unwrap_or_else(|| panic!("{name} not in INFO idem:\n{text}"))
    }

    pub async fn stop(mut self) {
        if let Some((stop, task)) = self.writer.take() {
            let _ = stop.send(());
            let _ = tokio::time::timeout(Duration::from_secs(15), task).await;
        }
        if let Some((stop, task)) = self.server.take() {
            let _ = stop.send(());
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
    }
}
