//! The layer's operational series against redis-server with the module,
//! killed and restarted under it: fail-open passes and 503s with the Redis
//! errors behind them, and a response finished while Redis is down counted
//! in `idem_store_pending` until it is stored, or given up on
//! (`idem_store_gave_up_total`) when `store_retry` runs out first. What the
//! alerts IdemFailOpenInUse, IdemLayer5xx, IdemStorePending and
//! IdemStoreGaveUp read (deploy/prometheus/idem-rules.yml).

mod common;

use std::time::{Duration, Instant};

use axum::extract::MatchedPath;
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use common::{state_of, Server};
use idem_client::middleware::metric_names as names;
use idem_client::middleware::prometheus_client::encoding::text::encode;
use idem_client::middleware::prometheus_client::registry::Registry;
use idem_client::middleware::LayerMetrics;
use idem_client::{IdemClient, IdempotencyLayer};
use idem_testkit::RedisConfig;

/// The app: `/pay` answers 201 after `delay`.
fn app<C>(layer: IdempotencyLayer<C>, delay: Duration) -> Router
where
    C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
{
    Router::new()
        .route(
            "/pay",
            post(move || async move {
                tokio::time::sleep(delay).await;
                (StatusCode::CREATED, "paid")
            }),
        )
        .layer(layer)
}

/// A registry with the layer's metrics, labelled by the matched route.
fn instrumented<C>(layer: IdempotencyLayer<C>) -> (IdempotencyLayer<C>, Registry) {
    let mut registry = Registry::default();
    let layer = layer
        .metrics(LayerMetrics::new(&mut registry))
        .metrics_route(|ext| ext.get::<MatchedPath>().map(|p| p.as_str().to_owned()));
    (layer, registry)
}

/// The value of `series` (name and labels as encoded) in `registry`, 0
/// when absent.
fn sample(registry: &Registry, series: &str) -> f64 {
    let mut text = String::new();
    encode(&mut text, registry).unwrap();
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .map_or(0.0, |value| value.parse().unwrap())
}

fn outcome(registry: &Registry, outcome: &str) -> f64 {
    sample(
        registry,
        &format!(
            "{}{{route=\"/pay\",outcome=\"{outcome}\"}}",
            names::REQUESTS
        ),
    )
}

fn begin_unavailable(registry: &Registry) -> f64 {
    sample(
        registry,
        &format!(
            "{}{{op=\"begin\",kind=\"unavailable\"}}",
            names::REDIS_ERRORS
        ),
    )
}

/// Redis down: with `fail_open` the handler runs and the request counts as
/// `fail_open`; without it, 503 and `unavailable`. Either way BEGIN's
/// errors are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_counts_fail_open_passes_or_503s() {
    for fail_open in [true, false] {
        let mut redis = RedisConfig::default().start();
        let client =
            IdemClient::new(redis.async_conn().await).with_call_timeout(Duration::from_millis(300));
        let (layer, registry) = instrumented(IdempotencyLayer::new(client).fail_open(fail_open));
        let server = Server::start(app(layer, Duration::ZERO)).await;
        let reply = common::post(&server.base, "/pay", Some("k1"), "{}").await;
        assert_eq!(reply.status, 201);
        assert_eq!(outcome(&registry, "new"), 1.0);

        redis.kill();
        let reply = common::post(&server.base, "/pay", Some("k2"), "{}").await;
        let (status, counted, other) = if fail_open {
            (201, "fail_open", "unavailable")
        } else {
            (503, "unavailable", "fail_open")
        };
        assert_eq!(
            reply.status, status,
            "fail_open {fail_open}: {:?}",
            reply.body
        );
        assert_eq!(outcome(&registry, counted), 1.0, "fail_open {fail_open}");
        assert_eq!(outcome(&registry, other), 0.0, "fail_open {fail_open}");
        assert_eq!(outcome(&registry, "new"), 1.0);
        assert!(begin_unavailable(&registry) >= 1.0, "fail_open {fail_open}");
    }
}

/// Redis goes down while the handler runs, so the response cannot be
/// stored before it is sent. With a `store_retry` longer than the outage,
/// it is pending until Redis is back, then stored (the retry replays); with
/// one shorter, it is given up on and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_stored_in_the_background_is_pending_until_stored_or_given_up() {
    for (store_retry, stored) in [
        (Duration::from_secs(30), true),
        (Duration::from_secs(1), false),
    ] {
        let mut redis = RedisConfig::default().aof_always().start();
        let client = IdemClient::standalone(redis.client()).await.unwrap();
        let (layer, registry) = instrumented(
            IdempotencyLayer::new(client)
                .lease(Duration::from_secs(5))
                .store_retry(store_retry),
        );
        let server = Server::start(app(layer, Duration::from_millis(500))).await;
        let pending = || sample(&registry, names::STORE_PENDING);
        let gave_up = || sample(&registry, names::STORE_GAVE_UP);
        let original = common::post(&server.base, "/pay", Some("k"), "{}");
        let mut conn = redis.async_conn().await;
        let outage = async {
            let deadline = Instant::now() + Duration::from_secs(5);
            while state_of(&mut conn, "idem:{:k}").await.as_deref() != Some("in_progress") {
                assert!(Instant::now() < deadline, "the key never went in progress");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            drop(conn);
            redis.kill();
        };
        let (original, ()) = tokio::join!(original, outage);
        assert_eq!(original.status, 201, "{:?}", original.body);
        assert_eq!(
            pending(),
            1.0,
            "the response is being stored in the background"
        );
        assert_eq!(gave_up(), 0.0);

        if stored {
            redis.restart();
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while pending() != 0.0 {
            assert!(Instant::now() < deadline, "still pending");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if stored {
            assert_eq!(gave_up(), 0.0);
            let retry = common::post(&server.base, "/pay", Some("k"), "{}").await;
            assert!(retry.replayed(), "{:?}", retry.body);
            assert_eq!(outcome(&registry, "replay"), 1.0);
        } else {
            assert_eq!(gave_up(), 1.0, "store_retry ran out while Redis was down");
        }
        assert!(
            sample(
                &registry,
                &format!(
                    "{}{{op=\"complete\",kind=\"unavailable\"}}",
                    names::REDIS_ERRORS
                )
            ) >= 1.0
        );
    }
}
