//! `/metrics` (OpenMetrics text, encoded by prometheus-client) and
//! `/healthz` over HTTP.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use tokio_util::sync::CancellationToken;

use crate::error::{Context, Result};
use crate::ops::metrics::{Metrics, CONTENT_TYPE};

/// Binds `addr` now (so a bad address fails the start) and serves until
/// `stop` is cancelled. Returns the bound address and the server task.
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("bind the metrics address {addr}"))?;
    let bound = listener.local_addr().context("metrics listener address")?;
    let app = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(healthz))
        .with_state(metrics);
    let task = tokio::spawn(async move {
        let server = axum::serve(listener, app).with_graceful_shutdown(stop.cancelled_owned());
        if let Err(error) = server.await {
            tracing::error!(%error, "metrics server failed");
        }
    });
    Ok((bound, task))
}

async fn metrics_text(State(metrics): State<Arc<Metrics>>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], metrics.render())
}

/// 200 when Postgres and every Redis node answered last time, else 503
/// naming what is down.
async fn healthz(State(metrics): State<Arc<Metrics>>) -> impl IntoResponse {
    let down = metrics.unhealthy_parts();
    if down.is_empty() {
        (StatusCode::OK, "ok\n".to_string())
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("down: {}\n", down.join(", ")),
        )
    }
}
