//! The payments-api process's `GET /metrics` against redis-server with the
//! module and Postgres: the layer's outcome counters move as requests are
//! stored, replayed and rejected (409, 422, 400), the fence's commits and
//! the BEGIN/COMPLETE histograms count each new payment, and with Redis
//! gone the 503s and Redis errors show.

mod common;

use std::time::Duration;

use common::payment;
use common::processes::{start_api, ApiOptions};
use idem_client::middleware::metric_names as names;
use idem_testkit::{PgDatabase, RedisConfig};

/// The value of the sample `series` (name and labels as rendered), 0 when
/// absent.
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .map_or(0.0, |value| value.parse().expect("a sample value"))
}

fn outcome(text: &str, outcome: &str) -> f64 {
    sample(
        text,
        &format!(
            "{}{{route=\"/payments\",outcome=\"{outcome}\"}}",
            names::REQUESTS
        ),
    )
}

struct Api {
    base: String,
    http: reqwest::Client,
}

impl Api {
    async fn metrics(&self) -> String {
        let reply = self
            .http
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .expect("GET /metrics");
        assert_eq!(reply.status(), 200);
        let content_type = reply.headers()["content-type"].to_str().unwrap().to_owned();
        assert!(
            content_type.starts_with("application/openmetrics-text"),
            "{content_type}"
        );
        reply.text().await.expect("metrics text")
    }

    async fn post(&self, key: &str, amount: i64) -> u16 {
        self.http
            .post(format!("{}/payments", self.base))
            .header("idempotency-key", key)
            .header("authorization", "Bearer tok_demo")
            .json(&payment(amount))
            .send()
            .await
            .expect("POST /payments")
            .status()
            .as_u16()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcome_counters_move_as_requests_are_stored_replayed_and_rejected() {
    let redis = RedisConfig::default().start();
    let db = PgDatabase::create();
    let (process, base) = start_api(&ApiOptions {
        redis_url: &redis.url(),
        database_url: &db.url,
        fence: true,
        processor_delay: Duration::from_millis(400),
        lease: Duration::from_secs(5),
    })
    .await;
    let api = Api {
        base,
        http: reqwest::Client::new(),
    };
    let before = api.metrics().await;
    assert_eq!(outcome(&before, "new"), 0.0, "{before}");

    // Stored: a new payment, its fenced commit, BEGIN and COMPLETE timed.
    assert_eq!(api.post("\"m-1\"", 100).await, 201);
    let text = api.metrics().await;
    assert_eq!(outcome(&text, "new"), 1.0, "{text}");
    assert_eq!(
        sample(
            &text,
            &format!(
                "{}{{route=\"/payments\",answer=\"committed\"}}",
                names::FENCE
            )
        ),
        1.0,
        "{text}"
    );
    // One BEGIN per keyed request; COMPLETE: the fenced answer put into Redis.
    assert_eq!(
        sample(
            &text,
            &format!("{}_count{{route=\"/payments\"}}", names::BEGIN_DURATION)
        ),
        1.0,
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            &format!("{}_count{{route=\"/payments\"}}", names::COMPLETE_DURATION)
        ),
        1.0,
        "{text}"
    );

    // Replayed twice.
    assert_eq!(api.post("\"m-1\"", 100).await, 201);
    assert_eq!(api.post("\"m-1\"", 100).await, 201);
    // 422: the same key with another amount.
    assert_eq!(api.post("\"m-1\"", 999).await, 422);
    // 400: a key longer than the limit.
    let too_long = format!("\"{}\"", "k".repeat(256));
    assert_eq!(api.post(&too_long, 100).await, 400);
    // 409: a duplicate while the original waits on the processor.
    let first = api.post("\"m-3\"", 300);
    let second = async {
        tokio::time::sleep(Duration::from_millis(150)).await;
        api.post("\"m-3\"", 300).await
    };
    let (first, second) = tokio::join!(first, second);
    assert_eq!((first, second), (201, 409));

    let text = api.metrics().await;
    assert_eq!(outcome(&text, "new"), 2.0, "{text}");
    assert_eq!(outcome(&text, "replay"), 2.0, "{text}");
    assert_eq!(outcome(&text, "mismatch"), 1.0, "{text}");
    assert_eq!(outcome(&text, "bad_key"), 1.0, "{text}");
    assert_eq!(outcome(&text, "in_flight"), 1.0, "{text}");
    assert_eq!(outcome(&text, "unavailable"), 0.0, "{text}");
    assert_eq!(
        sample(
            &text,
            &format!("{}_count{{route=\"/payments\"}}", names::BEGIN_DURATION)
        ),
        6.0,
        "{text}"
    );

    // Redis gone: a new key is 503, counted with the errors BEGIN met.
    drop(redis);
    assert_eq!(api.post("\"m-4\"", 100).await, 503);
    let text = api.metrics().await;
    assert_eq!(outcome(&text, "unavailable"), 1.0, "{text}");
    assert!(
        sample(
            &text,
            &format!(
                "{}{{op=\"begin\",kind=\"unavailable\"}}",
                names::REDIS_ERRORS
            )
        ) >= 1.0,
        "{text}"
    );
    assert_eq!(outcome(&text, "new"), 2.0, "{text}");
    drop(process);
}
