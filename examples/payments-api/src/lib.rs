//! Example payments API: axum routes for `POST /payments` and
//! `GET /payments/{id}`, wrapped in the idem `Idempotency-Key` layer with
//! Postgres read-through; new payments commit with their idempotency row (the
//! fence). Callers authenticate with a bearer token (`auth`); the account it
//! maps to scopes their keys. `GET /metrics` serves the layer's metrics,
//! outside the layer.
//! Built as a library so tests and the benchmark run it in-process.

pub mod auth;
pub mod config;
pub mod db;
pub mod payments;
pub mod processor;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::extract::MatchedPath;
use axum::http::header;
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::Router;
use deadpool_postgres::Pool;
use idem_client::middleware::prometheus_client::registry::Registry;
use idem_client::middleware::LayerMetrics;
use idem_client::{Backend, StandaloneConnection, Transport};
use idem_client::{IdemClient, IdempotencyLayer, ReadThrough};

pub use auth::{Account, Tokens};
pub use config::Settings;

#[derive(Clone)]
pub struct AppState {
    pub db: Pool,
    /// The (simulated) payment processor each new payment is charged at.
    pub processor: processor::Processor,
    /// New payments commit with their idempotency row (the fence) (default: on).
    pub fence: bool,
    /// Payment ids reserved ahead: a fenced payment's response is known
    /// before its row is written.
    pub ids: Arc<db::PaymentIds>,
    /// Bearer tokens and their accounts (default: `auth::DEMO_TOKENS`).
    pub tokens: Arc<Tokens>,
}

impl AppState {
    pub fn new(db: Pool) -> Self {
        AppState {
            processor: processor::Processor::new(db.clone(), Duration::ZERO),
            db,
            fence: true,
            ids: Arc::default(),
            tokens: Arc::default(),
        }
    }

    pub fn with_tokens(mut self, tokens: Tokens) -> Self {
        self.tokens = Arc::new(tokens);
        self
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

/// The routes behind the idempotency layer, behind authentication.
pub fn app(state: AppState, layer: IdempotencyLayer<StandaloneConnection>) -> Router {
    let tokens = state.tokens.clone();
    authenticated(routes(state).layer(layer), tokens)
}

/// `router` behind bearer-token authentication (`auth::authenticate`): the
/// outer layer, so a request without a known token is 401 before the
/// idempotency layer (or anything else) runs.
pub fn authenticated(router: Router, tokens: Arc<Tokens>) -> Router {
    router.layer(axum::middleware::from_fn_with_state(
        tokens,
        auth::authenticate,
    ))
}

// ANCHOR: metrics
/// The service's metrics: a prometheus-client registry holding the
/// idempotency layer's series (docs/operations/metrics.md).
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    layer: LayerMetrics,
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let layer = LayerMetrics::new(&mut registry);
        Metrics {
            registry: Arc::new(registry),
            layer,
        }
    }

    /// `layer` recording into these metrics, each request labelled with its
    /// matched route.
    pub fn instrument<C>(&self, layer: IdempotencyLayer<C>) -> IdempotencyLayer<C> {
        layer
            .metrics(self.layer.clone())
            .metrics_route(|extensions| {
                extensions
                    .get::<MatchedPath>()
                    .map(|path| path.as_str().to_owned())
            })
    }

    /// The OpenMetrics text of every series.
    pub fn render(&self) -> String {
        let mut text = String::new();
        idem_client::middleware::prometheus_client::encoding::text::encode(
            &mut text,
            &self.registry,
        )
        .expect("writing to a String does not fail");
        text
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// [`app`] with `layer` recording into `metrics`, and `GET /metrics`
/// serving them (outside the layer).
pub fn app_with_metrics(
    state: AppState,
    layer: IdempotencyLayer<StandaloneConnection>,
    metrics: &Metrics,
) -> Router {
    let scrape = metrics.clone();
    app(state, metrics.instrument(layer)).route(
        "/metrics",
        get(move || async move {
            (
                [(
                    header::CONTENT_TYPE,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                )],
                scrape.render(),
            )
        }),
    )
}
// ANCHOR_END: metrics

/// The layer as the example configures it: keys scoped by the authenticated
/// [`Account`] (left in the request's extensions by [`authenticated`]),
/// JSON bodies canonicalized, read-through from the mirror when `read_through`
/// is given, Redis reached through `transport` (`Transport::Auto` but in
/// benchmarks).
pub async fn idempotency_layer(
    redis_url: &str,
    read_through: Option<Pool>,
    transport: Transport,
) -> anyhow::Result<IdempotencyLayer<StandaloneConnection>> {
    idempotency_layer_with(redis_url, read_through, transport, Backend::Auto).await
}

/// `idempotency_layer` calling idem through `backend` (the `BACKEND`
/// setting); logs the backend in use.
pub async fn idempotency_layer_with(
    redis_url: &str,
    read_through: Option<Pool>,
    transport: Transport,
    backend: Backend,
) -> anyhow::Result<IdempotencyLayer<StandaloneConnection>> {
    // `rediss://` verified against the platform's roots or REDIS_CA_CERT,
    // with REDIS_CLIENT_CERT/REDIS_CLIENT_KEY when set (docs/security.md).
    let redis = idem_writer::secure::RedisTls::from_env()
        .client(redis_url)
        .context("REDIS_URL")?;
    let client = IdemClient::standalone_using(redis, transport, backend)
        .await
        .context("connect to Redis")?;
    tracing::info!(
        backend = %client.backend(),
        asked = %backend,
        "idem backend: {}",
        client.backend()
    );
    let mut layer = IdempotencyLayer::new(client)
        .tenant(|parts| parts.extensions.get::<Account>().map(|a| a.0.clone()));
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
