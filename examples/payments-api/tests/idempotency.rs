//! The payments API behind the idempotency layer, over real HTTP, with real
//! Redis (module loaded) and Postgres: concurrent duplicates, mismatches,
//! replays, Redis data loss with read-through, slow handlers, tenants, and
//! duplicates that wait for the original's answer.

mod common;

use std::time::{Duration, Instant};

use common::{payment, Options, TestApp};
use futures_util::future::join_all;
use idem_testkit::eventually_async as eventually;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_duplicates_create_one_payment() {
    let app = TestApp::start(Options::default()).await;
    let body = payment(1999);
    let replies = join_all((0..200).map(|_| app.post(Some("dup-200"), None, &body))).await;

    assert_eq!(app.payment_count().await, 1);
    let originals: Vec<_> = replies
        .iter()
        .filter(|r| r.status == 201 && !r.replayed())
        .collect();
    assert_eq!(originals.len(), 1, "exactly one request ran the handler");
    let original = originals[0];
    for reply in &replies {
        match reply.status {
            201 => {
                assert_eq!(reply.body, original.body, "replay is byte-identical");
                assert_eq!(reply.header("location"), original.header("location"));
            }
            409 => {
                assert_eq!(
                    reply.header("content-type"),
                    Some("application/problem+json")
                );
                let retry_after: u64 = reply
                    .header("retry-after")
                    .and_then(|v| v.parse().ok())
                    .expect("Retry-After in seconds");
                assert!((1..=2).contains(&retry_after), "capped: {retry_after}");
            }
            other => panic!("unexpected status {other}: {:?}", reply.body),
        }
    }
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_with_another_amount_is_422_and_creates_nothing() {
    let app = TestApp::start(Options::default()).await;
    let first = app.post(Some("k-422"), None, &payment(100)).await;
    assert_eq!(first.status, 201);

    let changed = app.post(Some("k-422"), None, &payment(101)).await;
    assert_eq!(changed.status, 422);
    assert_eq!(
        changed.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(changed.json()["status"], 422);
    assert_eq!(app.payment_count().await, 1);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_completion_is_replayed() {
    let app = TestApp::start(Options::default()).await;
    let first = app.post(Some("k-replay"), None, &payment(500)).await;
    assert_eq!(first.status, 201);
    assert!(!first.replayed());
    let id = first.json()["id"].as_i64().expect("id");

    // Member order and whitespace differ: canonical JSON makes it the same request.
    let reordered: serde_json::Value =
        serde_json::from_str(r#"{"recipient":"acct_bob","currency":"EUR","amount":500}"#).unwrap();
    let retry = app.post(Some("k-replay"), None, &reordered).await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(
        retry.header("location"),
        Some(format!("/payments/{id}").as_str())
    );
    assert_eq!(retry.header("content-type"), Some("application/json"));
    assert_eq!(app.payment_count().await, 1);

    let fetched = app.get(&format!("/payments/{id}")).await;
    assert_eq!(fetched.status, 200);
    assert_eq!(fetched.json(), first.json());
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_redis_loses_everything_the_retry_replays_from_postgres() {
    let mut app = TestApp::start(Options {
        read_through: true,
        ..Options::default()
    })
    .await;
    app.start_writer();
    let first = app
        .post(Some("k-flush"), Some("acct_1"), &payment(4200))
        .await;
    assert_eq!(first.status, 201);
    let redis_key = "idem:{acct_1:k-flush}";
    assert!(
        eventually(Duration::from_secs(10), || app.mirrored(redis_key)).await,
        "the writer mirrors the completed key"
    );

    app.redis_cmd(&mut redis::cmd("FLUSHALL")).await;
    assert_eq!(
        app.redis_cmd(redis::cmd("IDEM.GET").arg(redis_key)).await,
        redis::Value::Nil
    );

    let retry = app
        .post(Some("k-flush"), Some("acct_1"), &payment(4200))
        .await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(retry.header("location"), first.header("location"));
    assert_eq!(app.payment_count().await, 1);

    // Redis is refilled (marked mirrored), so the next retry needs no lookup.
    let record = app.redis_cmd(redis::cmd("IDEM.GET").arg(redis_key)).await;
    let fields: Vec<String> = match record {
        redis::Value::Array(items) => items
            .into_iter()
            .map(|v| match v {
                redis::Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
                redis::Value::SimpleString(s) => s,
                other => format!("{other:?}"),
            })
            .collect(),
        other => panic!("IDEM.GET {other:?}"),
    };
    let field = |name: &str| {
        fields
            .chunks(2)
            .find(|pair| pair[0] == name)
            .map(|pair| pair[1].clone())
    };
    assert_eq!(field("state").as_deref(), Some("completed"));
    assert_eq!(field("mirror").as_deref(), Some("mirrored"));

    // A different request under the same key is still a mismatch after a flush.
    app.redis_cmd(&mut redis::cmd("FLUSHALL")).await;
    let changed = app
        .post(Some("k-flush"), Some("acct_1"), &payment(4300))
        .await;
    assert_eq!(changed.status, 422);
    assert_eq!(app.payment_count().await, 1);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_slower_than_the_lease_runs_once() {
    let app = TestApp::start(Options {
        lease: Some(Duration::from_millis(500)),
        handler_delay: Some(Duration::from_millis(2000)),
        ..Options::default()
    })
    .await;
    let body = payment(700);
    let original = app.post(Some("k-slow"), None, &body);
    let duplicates = async {
        // Well past the 500 ms lease: without renewal these would take over.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let mut replies = Vec::new();
        for _ in 0..3 {
            replies.push(app.post(Some("k-slow"), None, &body).await);
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        replies
    };
    let (original, duplicates) = tokio::join!(original, duplicates);
    assert_eq!(original.status, 201);
    for reply in duplicates {
        assert_eq!(reply.status, 409, "the lease was renewed: {:?}", reply.body);
    }
    assert_eq!(app.payment_count().await, 1);
    assert!(app.info_field("idem_touches").await >= 3);
    assert_eq!(app.info_field("idem_takeovers").await, 0);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tenants_with_the_same_key_each_get_their_payment() {
    let app = TestApp::start(Options::default()).await;
    let a = app
        .post(Some("shared-key"), Some("acct_a"), &payment(100))
        .await;
    let b = app
        .post(Some("shared-key"), Some("acct_b"), &payment(100))
        .await;
    assert_eq!((a.status, b.status), (201, 201));
    assert!(!a.replayed() && !b.replayed());
    assert_ne!(a.json()["id"], b.json()["id"]);
    assert_eq!(app.payment_count().await, 2);

    let a_again = app
        .post(Some("shared-key"), Some("acct_a"), &payment(100))
        .await;
    assert!(a_again.replayed());
    assert_eq!(a_again.body, a.body);
    app.stop().await;
}

/// The account comes from the bearer token, checked before the idempotency
/// layer: no token or an unknown one is 401 with nothing run or stored, and
/// an `X-Account-Id` the client sends is not trusted: it neither opens
/// another account's scope nor a scope of its own. Before, the tenant was
/// that header: whoever sent another account's id, key and body got its
/// stored payment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_account_is_the_bearer_tokens_and_x_account_id_is_ignored() {
    let app = TestApp::start(Options::default()).await;
    for authorization in [
        None,
        Some("Bearer tok_unknown"),
        Some("tok_acct_a"),
        Some("Bearer "),
    ] {
        let refused = app
            .post_with(Some("k-auth"), authorization, &[], &payment(100))
            .await;
        assert_eq!(refused.status, 401, "{authorization:?}");
        assert_eq!(refused.json()["error"], "unauthorized");
    }
    assert_eq!(app.payment_count().await, 0);
    assert_eq!(
        app.redis_cmd(&mut redis::cmd("DBSIZE")).await,
        redis::Value::Int(0),
        "nothing reached Redis"
    );

    let a = app
        .post(Some("k-auth"), Some("acct_a"), &payment(100))
        .await;
    assert_eq!(a.status, 201);
    // acct_b claiming to be acct_a: its own scope, its own payment.
    let spoofed = app
        .post_with(
            Some("k-auth"),
            Some("Bearer tok_acct_b"),
            &[("x-account-id", "acct_a")],
            &payment(100),
        )
        .await;
    assert_eq!(spoofed.status, 201);
    assert!(!spoofed.replayed(), "acct_a's payment went to acct_b");
    assert_ne!(spoofed.json()["id"], a.json()["id"]);
    // acct_a naming another account in the header: still acct_a's replay.
    let again = app
        .post_with(
            Some("k-auth"),
            Some("Bearer tok_acct_a"),
            &[("x-account-id", "acct_other")],
            &payment(100),
        )
        .await;
    assert!(again.replayed());
    assert_eq!(again.body, a.body);
    assert_eq!(app.payment_count().await, 2);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_wait_for_result_fifty_duplicates_all_get_the_201() {
    let handler_time = Duration::from_millis(300);
    let app = TestApp::start(Options {
        wait: Some(Duration::from_secs(10)),
        handler_delay: Some(handler_time),
        ..Options::default()
    })
    .await;
    let body = payment(12_345);
    let started = Instant::now();
    let replies = join_all((0..50).map(|_| app.post(Some("k-wait"), None, &body))).await;
    let elapsed = started.elapsed();

    assert_eq!(app.payment_count().await, 1);
    let first = &replies[0];
    for reply in &replies {
        assert_eq!(reply.status, 201, "{:?}", reply.body);
        assert_eq!(reply.body, first.body);
    }
    assert_eq!(replies.iter().filter(|r| !r.replayed()).count(), 1);
    assert!(
        app.info_field("idem_waits_replay").await >= 1,
        "duplicates waited"
    );
    assert!(
        elapsed < handler_time + Duration::from_secs(3),
        "answered soon after the original: {elapsed:?}"
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_a_key_pass_through_and_bad_keys_are_400() {
    let app = TestApp::start(Options::default()).await;
    let a = app.post(None, None, &payment(1)).await;
    let b = app.post(None, None, &payment(1)).await;
    assert_eq!((a.status, b.status), (201, 201));
    assert_eq!(app.payment_count().await, 2, "no key, no idempotency");

    let too_long = "k".repeat(256);
    let rejected = app.post(Some(&too_long), None, &payment(1)).await;
    assert_eq!(rejected.status, 400);
    assert_eq!(
        rejected.header("content-type"),
        Some("application/problem+json")
    );

    let invalid = app
        .post(Some("x"), None, &serde_json::json!({"amount": -1}))
        .await;
    assert_eq!(
        invalid.status, 422,
        "validation errors are answered (and stored)"
    );
    assert_eq!(app.payment_count().await, 2);
    app.stop().await;
}
