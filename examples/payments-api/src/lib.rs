//! Example payments API: axum routes for `POST /payments` and
//! `GET /payments/{id}`, wrapped in the idem `Idempotency-Key` layer with
//! Postgres read-through; new payments commit with their idempotency row (the
//! fence). Built as a library so tests and the benchmark run
//! it in-process.

pub mod config;
pub mod db;
pub mod payments;
pub mod processor;

use std::future::Future;
use std::time::Duration;

use anyhow::Context;
use axum::http::HeaderName;
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::Router;
use deadpool_postgres::Pool;
use idem_client::{IdemClient, IdempotencyLayer, ReadThrough};
use idem_client::{StandaloneConnection, Transport};

pub use config::Settings;

/// Header that scopes idempotency keys per account.
pub const ACCOUNT_HEADER: HeaderName = HeaderName::from_static("x-account-id");

#[derive(Clone)]
pub struct AppState {
    pub db: Pool,
    /// The (simulated) payment processor each new payment is charged at.
    pub processor: processor::Processor,
    /// New payments commit with their idempotency row (the fence) (default: on).
    pub fence: bool,
}

impl AppState {
    pub fn new(db: Pool) -> Self {
        AppState {
            processor: processor::Processor::new(db.clone(), Duration::ZERO),
            db,
            fence: true,
        }
    }

    pub fn with_fence(mut self, fence: bool) -> Self {
        self.fence = fence;
        self
    }

    /// The processor's latency per charge (demo; 0 = none).
    pub fn with_processor_delay(mut self, delay: Duration) -> Self {
        self.processor = processor::Processor::new(self.db.clone(), delay);
        self
    }
}

/// The routes alone, without idempotency.
pub fn routes(state: AppState) -> Router {
    Router::new()
        .route("/payments", post(payments::create_payment))
        .route("/payments/{id}", get(payments::get_payment))
        .with_state(state)
}

/// The routes behind the idempotency layer.
pub fn app(state: AppState, layer: IdempotencyLayer<StandaloneConnection>) -> Router {
    routes(state).layer(layer)
}

/// The layer as the example configures it: keys scoped by `X-Account-Id`,
/// JSON bodies canonicalized, read-through from the mirror when `read_through`
/// is given, Redis reached through `transport` (`Transport::Auto` but in
/// benchmarks).
pub async fn idempotency_layer(
    redis_url: &str,
    read_through: Option<Pool>,
    transport: Transport,
) -> anyhow::Result<IdempotencyLayer<StandaloneConnection>> {
    let redis = redis::Client::open(redis_url).context("invalid REDIS_URL")?;
    let client = IdemClient::standalone_with(redis, transport)
        .await
        .context("connect to Redis")?;
    let mut layer = IdempotencyLayer::new(client).tenant_header(ACCOUNT_HEADER);
    if let Some(pool) = read_through {
        layer = layer.read_through(ReadThrough::new(pool));
    }
    Ok(layer)
}

/// Serves `router` on `listener` until `shutdown` completes. Connections use
/// `TCP_NODELAY`: a response written in two segments must not wait for the
/// client's delayed ACK.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let listener = listener.tap_io(|tcp| {
        if let Err(err) = tcp.set_nodelay(true) {
            tracing::warn!(error = %err, "could not set TCP_NODELAY");
        }
    });
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
        .context("serve HTTP")
}
