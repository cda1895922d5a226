//! `payments-api`: the example service on 127.0.0.1:$PORT (see `Settings`),
//! its metrics at `GET /metrics`.

use anyhow::Context;
use idem_client::Transport;
use idem_example_payments::{
    app_with_metrics, db, idempotency_layer_with, serve, AppState, Metrics, Settings,
};
use tracing_subscriber::EnvFilter;

/// The allocator: mimalloc unless built without the `mimalloc` feature.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let settings = Settings::from_env()?;
    let pool = db::pool(&settings.database_url, settings.pool_size)?;
    db::migrate(&pool).await?;
    let read_through = settings.read_through.then(|| pool.clone());
    let mut layer = idempotency_layer_with(
        &settings.redis_url,
        read_through,
        Transport::Auto,
        settings.backend,
    )
    .await?
    .lease(settings.lease)
    // Every keyed route's handler uses the fence: its claim stands in
    // for read-through's lookup (one statement fewer per payment).
    .claim_up_front(settings.fence);
    if let Some(wait) = settings.wait {
        layer = layer.wait_for_result(wait);
    }
    if let Some((replicas, timeout)) = settings.replica_ack {
        layer = layer.replica_ack(replicas, timeout);
    }
    let state = AppState::new(pool)
        .with_processor_delay(settings.processor_delay)
        .with_fence(settings.fence)
        .with_tokens(settings.tokens);
    let router = app_with_metrics(state, layer, &Metrics::new());
    let address = ("127.0.0.1", settings.port);
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("bind 127.0.0.1:{}", settings.port))?;
    tracing::info!(
        port = settings.port,
        read_through = settings.read_through,
        fence = settings.fence,
        replica_ack = ?settings.replica_ack,
        "payments API listening on http://127.0.0.1:{}",
        settings.port
    );
    serve(listener, router, shutdown_signal()).await
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut terminate =
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(signal) => signal,
            Err(err) => {
                tracing::warn!(error = %err, "no SIGTERM handler");
                let _ = ctrl_c.await;
                return;
            }
        };
    tokio::select! {
        _ = ctrl_c => {}
        _ = terminate.recv() => {}
    }
    tracing::info!("shutting down");
}
