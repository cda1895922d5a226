//! The tower/axum layer over real HTTP and a real redis-server with the
//! module: store policy, stored headers, fail-closed and fail-open, required
//! keys, methods, size limits, a client hanging up mid-request, a
//! panicking handler, and Redis down, full, refusing writes or demoted
//! around a request.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::routing::{post, put};
use axum::Router;
use common::{send, state_of, Server};
use idem_client::{IdemClient, IdemError, IdempotencyLayer};
use idem_testkit::RedisServer;

#[derive(Clone, Default)]
struct Calls(Arc<AtomicUsize>);

impl Calls {
    fn next(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }

    fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

fn created(n: usize) -> (StatusCode, HeaderMap, String) {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    headers.insert(
        "location",
        HeaderValue::from_str(&format!("/things/{n}")).unwrap(),
    );
    headers.insert("x-extra", HeaderValue::from_static("yes"));
    (StatusCode::CREATED, headers, format!("{{\"n\":{n}}}"))
}

fn routes(calls: Calls) -> Router {
    let ok = calls.clone();
    let flaky = calls.clone();
    let limited = calls.clone();
    let big = calls.clone();
    let slow = calls.clone();
    let panics = calls.clone();
    let put_calls = calls;
    Router::new()
        .route(
            "/ok",
            post(move || async move { created(ok.next()) }).get(|| async { "read" }),
        )
        .route(
            "/flaky",
            post(move || async move {
                match flaky.next() {
                    1 => (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        HeaderMap::new(),
                        "boom".to_string(),
                    ),
                    n => created(n),
                }
            }),
        )
        .route(
            "/limited",
            post(move || async move {
                match limited.next() {
                    1 => (
                        StatusCode::TOO_MANY_REQUESTS,
                        HeaderMap::new(),
                        "slow down".to_string(),
                    ),
                    n => created(n),
                }
            }),
        )
        .route(
            "/big",
            post(move || async move {
                big.next();
                "x".repeat(10_000)
            }),
        )
        .route(
            "/slow",
            post(move || async move {
                tokio::time::sleep(Duration::from_millis(500)).await;
                created(slow.next())
            }),
        )
        .route(
            "/panics",
            post(move || async move {
                if panics.next() == 1 {
                    panic!("handler bug");
                }
                created(2)
            }),
        )
        .route(
            "/put",
            put(move || async move { created(put_calls.next()) }),
        )
}

struct Fixture {
    redis: RedisServer,
    calls: Calls,
    server: Server,
}

impl Fixture {
    async fn start(
        configure: impl FnOnce(
            IdempotencyLayer<redis::aio::MultiplexedConnection>,
        ) -> IdempotencyLayer<redis::aio::MultiplexedConnection>,
    ) -> Fixture {
        let redis = RedisServer::start();
        let client =
            IdemClient::new(redis.async_conn().await).with_call_timeout(Duration::from_millis(500));
        let layer = configure(IdempotencyLayer::new(client));
        let calls = Calls::default();
        let server = Server::start(routes(calls.clone()).layer(layer)).await;
        Fixture {
            redis,
            calls,
            server,
        }
    }

    async fn post(&self, path: &str, key: Option<&str>) -> common::Reply {
        common::post(&self.server.base, path, key, "{}").await
    }

    /// A POST whose client gives up after 100 ms.
    async fn hang_up(&self, path: &str, key: &str) -> reqwest::Result<reqwest::Response> {
        let impatient = reqwest::Client::builder()
            .timeout(Duration::from_millis(100))
            .build()
            .unwrap();
        impatient
            .post(format!("{}{path}", self.server.base))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
    }

    async fn state(&self, key: &str) -> Option<String> {
        let mut conn = self.redis.async_conn().await;
        state_of(&mut conn, &format!("idem:{{:{key}}}")).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_500_is_not_stored_and_the_retry_runs_again() {
    let f = Fixture::start(|l| l).await;
    let first = f.post("/flaky", Some("k")).await;
    assert_eq!(first.status, 500);
    assert_eq!(f.state("k").await, None, "nothing stored, key released");

    let second = f.post("/flaky", Some("k")).await;
    assert_eq!(second.status, 201);
    assert!(!second.replayed());
    let third = f.post("/flaky", Some("k")).await;
    assert_eq!(third.status, 201);
    assert!(third.replayed());
    assert_eq!(third.body, second.body);
    assert_eq!(f.calls.count(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_is_not_stored() {
    let f = Fixture::start(|l| l).await;
    assert_eq!(f.post("/limited", Some("k")).await.status, 429);
    assert_eq!(f.post("/limited", Some("k")).await.status, 201);
    assert_eq!(f.calls.count(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_custom_store_policy_can_store_errors() {
    let f = Fixture::start(|l| l.store_policy(|_| true)).await;
    let first = f.post("/flaky", Some("k")).await;
    let second = f.post("/flaky", Some("k")).await;
    assert_eq!((first.status, second.status), (500, 500));
    assert!(second.replayed());
    assert_eq!(f.calls.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_configured_headers_are_replayed() {
    let f = Fixture::start(|l| l).await;
    let first = f.post("/ok", Some("k")).await;
    assert_eq!(
        first.header("x-extra"),
        Some("yes"),
        "the original answer is untouched"
    );
    let replay = f.post("/ok", Some("k")).await;
    assert!(replay.replayed());
    assert_eq!(replay.header("location"), Some("/things/1"));
    assert_eq!(replay.header("content-type"), Some("application/json"));
    assert_eq!(replay.header("x-extra"), None);

    let g = Fixture::start(|l| l.stored_headers([HeaderName::from_static("x-extra")])).await;
    g.post("/ok", Some("k")).await;
    let replay = g.post("/ok", Some("k")).await;
    assert_eq!(replay.header("x-extra"), Some("yes"));
    assert_eq!(replay.header("location"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_fails_closed_with_503() {
    let mut f = Fixture::start(|l| l).await;
    f.redis.kill();
    let reply = f.post("/ok", Some("k")).await;
    assert_eq!(reply.status, 503);
    assert_eq!(
        reply.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(reply.header("retry-after"), Some("1"));
    assert_eq!(f.calls.count(), 0, "the handler did not run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_with_fail_open_runs_the_handler() {
    let mut f = Fixture::start(|l| l.fail_open(true)).await;
    f.redis.kill();
    let reply = f.post("/ok", Some("k")).await;
    assert_eq!(reply.status, 201);
    assert_eq!(f.calls.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_keys_and_methods() {
    let f = Fixture::start(|l| l.required(true)).await;
    let missing = f.post("/ok", None).await;
    assert_eq!(missing.status, 400);
    assert_eq!(
        missing.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(f.calls.count(), 0);

    // GET and PUT are not covered by default: they pass through.
    let read = reqwest::get(format!("{}/ok", f.server.base)).await.unwrap();
    assert_eq!(read.status(), 200);
    let client = reqwest::Client::new();
    for _ in 0..2 {
        let reply = send(
            client.put(format!("{}/put", f.server.base)),
            Some("k"),
            "{}",
        )
        .await;
        assert_eq!(reply.status, 201);
    }
    assert_eq!(f.calls.count(), 2);
}

/// POST /ok with key `k1` and one `x-account-id` line per tenant.
async fn post_as_tenants(f: &Fixture, tenants: Vec<&'static [u8]>) -> common::Reply {
    let mut request = reqwest::Client::new().post(format!("{}/ok", f.server.base));
    for tenant in tenants {
        request = request.header("x-account-id", HeaderValue::from_bytes(tenant).unwrap());
    }
    send(request, Some("k1"), "{}").await
}

/// Tenants are header values byte for byte: two that differ only in bytes
/// that are not UTF-8 are two tenants. A lossy decoding made them one, and
/// the second tenant was replayed the first one's response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_that_are_not_utf8_stay_apart() {
    let f = Fixture::start(|l| l.tenant_header(HeaderName::from_static("x-account-id"))).await;
    let post_as = |tenant: &'static [u8]| post_as_tenants(&f, vec![tenant]);
    let a = post_as(b"acct\xff").await;
    let b = post_as(b"acct\xfe").await;
    let c = post_as("acct\u{fffd}".as_bytes()).await;
    assert_eq!((a.status, b.status, c.status), (201, 201, 201));
    assert!(!b.replayed() && !c.replayed());
    assert_eq!(f.calls.count(), 3);
    assert!(post_as(b"acct\xff").await.replayed());
}

/// A tenant header sent twice (a client's own line ahead of the one a proxy
/// appends) is a tenant of its own: the lines combined, `acct_b, acct_a`.
/// Before, the first line alone decided, and the client was replayed
/// `acct_b`'s stored response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_tenant_header_is_not_its_first_line() {
    let f = Fixture::start(|l| l.tenant_header(HeaderName::from_static("x-account-id"))).await;
    let post_as = |tenants: &[&'static str]| {
        post_as_tenants(&f, tenants.iter().map(|t| t.as_bytes()).collect())
    };
    assert_eq!(post_as(&["acct_b"]).await.status, 201);
    let spoofed = post_as(&["acct_b", "acct_a"]).await;
    assert_eq!(spoofed.status, 201);
    assert!(
        !spoofed.replayed(),
        "acct_b's response went to another tenant"
    );
    assert_eq!(f.calls.count(), 2);
    assert!(post_as(&["acct_b"]).await.replayed());
}

/// The account the app's authentication found, left in the request's
/// extensions for the layer's tenant callback.
#[derive(Clone)]
struct Account(String);

/// A stand-in for the app's authentication: bearer tokens mapped to
/// accounts (`tok_empty` to an empty one, `tok_128`/`tok_129` to long ones);
/// an unknown or missing token leaves no account.
async fn authenticate(
    mut request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let token = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let account = match token {
        Some("tok_a") => Some("acct_1".to_string()),
        Some("tok_b") => Some("acct_2".to_string()),
        Some("tok_empty") => Some(String::new()),
        Some("tok_128") => Some("a".repeat(128)),
        Some("tok_129") => Some("a".repeat(129)),
        _ => None,
    };
    if let Some(account) = account {
        request.extensions_mut().insert(Account(account));
    }
    next.run(request).await
}

/// The tenant is the authenticated caller, read from the request's
/// extensions: the same key and body from another account runs its own
/// request; no account (or an empty one) is 400 `missing_tenant` and one
/// over 128 bytes 400 `invalid_tenant`, with nothing in Redis and the
/// handler not run. Before, such a request went to the anonymous scope,
/// shared with every caller that had none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tenant_comes_from_the_authenticated_caller() {
    let redis = RedisServer::start();
    let client = IdemClient::new(redis.async_conn().await);
    let layer = IdempotencyLayer::new(client)
        .tenant(|parts| parts.extensions.get::<Account>().map(|a| a.0.clone()));
    let calls = Calls::default();
    let app = routes(calls.clone())
        .layer(layer)
        .layer(axum::middleware::from_fn(authenticate));
    let server = Server::start(app).await;
    let post_as = |token: Option<&'static str>| {
        let mut request = reqwest::Client::new().post(format!("{}/ok", server.base));
        if let Some(token) = token {
            request = request.header("authorization", format!("Bearer {token}"));
        }
        send(request, Some("k"), "{}")
    };

    let a = post_as(Some("tok_a")).await;
    let b = post_as(Some("tok_b")).await;
    assert_eq!((a.status, b.status), (201, 201));
    assert!(!b.replayed(), "acct_1's response went to acct_2");
    assert!(post_as(Some("tok_a")).await.replayed());
    assert_eq!(calls.count(), 2);

    for (token, problem) in [
        (None, "missing-tenant"),
        (Some("tok_unknown"), "missing-tenant"),
        (Some("tok_empty"), "missing-tenant"),
        (Some("tok_129"), "invalid-tenant"),
    ] {
        let refused = post_as(token).await;
        assert_eq!(refused.status, 400, "{token:?}");
        assert_eq!(
            refused.json()["type"],
            format!("urn:idem:problem:{problem}"),
            "{token:?}"
        );
    }
    assert_eq!(calls.count(), 2, "no refused request ran");
    let mut conn = redis.async_conn().await;
    assert_eq!(
        state_of(&mut conn, "idem:{:k}").await,
        None,
        "no anonymous scope"
    );
    let long = format!("idem:{{{}:k}}", "a".repeat(129));
    assert_eq!(state_of(&mut conn, &long).await, None);

    assert_eq!(post_as(Some("tok_128")).await.status, 201, "at the bound");
    let at_bound = format!("idem:{{{}:k}}", "a".repeat(128));
    assert_eq!(
        state_of(&mut conn, &at_bound).await.as_deref(),
        Some("completed")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sf_string_and_bare_token_are_the_same_key() {
    let f = Fixture::start(|l| l).await;
    let quoted = f.post("/ok", Some("\"abc\"")).await;
    let bare = f.post("/ok", Some("abc")).await;
    assert_eq!(quoted.status, 201);
    assert!(bare.replayed());
    assert_eq!(f.calls.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_keys_and_large_requests_are_rejected_before_redis() {
    let f = Fixture::start(|l| l.max_request_body(16)).await;
    assert_eq!(f.post("/ok", Some("\"\"")).await.status, 400);
    assert_eq!(f.post("/ok", Some(&"k".repeat(256))).await.status, 400);
    assert_eq!(f.post("/ok", Some("a b")).await.status, 400);
    let large = common::post(&f.server.base, "/ok", Some("k"), &"x".repeat(100)).await;
    assert_eq!(large.status, 413);
    assert_eq!(f.calls.count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_over_the_limit_is_sent_whole_but_not_stored() {
    let f = Fixture::start(|l| l.max_response_body(1024)).await;
    let first = f.post("/big", Some("k")).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.body.len(), 10_000);
    assert_eq!(f.state("k").await, None);
    let second = f.post("/big", Some("k")).await;
    assert!(!second.replayed());
    assert_eq!(f.calls.count(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_hanging_up_does_not_cut_the_handler_short() {
    let f = Fixture::start(|l| l).await;
    let result = f.hang_up("/slow", "k").await;
    assert!(result.is_err(), "the client gave up");

    let mut completed = false;
    for _ in 0..100 {
        if f.state("k").await.as_deref() == Some("completed") {
            completed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(completed, "the handler finished and its answer was stored");
    let retry = f.post("/slow", Some("k")).await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert!(retry.replayed());
    assert_eq!(f.calls.count(), 1);
}

/// A client that hangs up while BEGIN is still on its way (Redis paused for
/// writes) leaves a request that arrived whole: it is decided, run and
/// stored as if the client had waited, so the retry replays at once. Before,
/// the flow was dropped with BEGIN's reply unread: the key stayed in
/// progress until its lease lapsed and the handler never ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_hanging_up_before_begin_answers_still_gets_its_request_run() {
    let f = Fixture::start(|l| l).await;
    let mut admin = f.redis.async_conn().await;
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(400) // under the client's call timeout (500 ms): BEGIN waits, then answers
        .arg("WRITE")
        .query_async(&mut admin)
        .await
        .unwrap();
    let result = f.hang_up("/ok", "k").await;
    assert!(result.is_err(), "the client gave up while Redis was paused");
    assert_eq!(f.calls.count(), 0, "BEGIN had not answered yet");

    let mut state = None;
    for _ in 0..100 {
        state = f.state("k").await;
        if state.as_deref() == Some("completed") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        state.as_deref(),
        Some("completed"),
        "the request ran and was stored"
    );
    let retry = f.post("/ok", Some("k")).await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert!(retry.replayed());
    assert_eq!(f.calls.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_releases_the_key() {
    let f = Fixture::start(|l| l).await;
    let client = reqwest::Client::new();
    let crashed = client
        .post(format!("{}/panics", f.server.base))
        .header("idempotency-key", "k")
        .body("{}")
        .send()
        .await;
    assert!(crashed.is_err(), "the connection is dropped: {crashed:?}");
    assert_eq!(f.state("k").await, None);
    let retry = f.post("/panics", Some("k")).await;
    assert_eq!(retry.status, 201);
    assert_eq!(f.calls.count(), 2);
}

/// `CONFIG SET maxmemory` on the fixture's Redis (0: no limit).
async fn set_maxmemory(f: &Fixture, bytes: u64) {
    let mut conn = f.redis.async_conn().await;
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(bytes)
        .query_async(&mut conn)
        .await
        .unwrap();
}

/// Redis reaches `maxmemory` while the handler runs: COMPLETE answers OOM.
/// The key stays held and the response is stored once memory is back, so
/// the retries get 409, then the replay; the handler runs once. Before, the
/// layer released the key on OOM and the retry ran the handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_redis_at_complete_keeps_the_key_and_stores_the_response_later() {
    let f = Fixture::start(|l| l).await;
    let original = f.post("/slow", Some("k"));
    let squeeze = async {
        tokio::time::sleep(Duration::from_millis(150)).await;
        set_maxmemory(&f, 1).await;
    };
    let (original, ()) = tokio::join!(original, squeeze);
    assert_eq!(original.status, 201);
    assert_eq!(f.state("k").await.as_deref(), Some("in_progress"));
    let during = f.post("/slow", Some("k")).await;
    assert_eq!(during.status, 409, "{:?}", during.body);
    set_maxmemory(&f, 0).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while f.state("k").await.as_deref() != Some("completed") {
        assert!(Instant::now() < deadline, "the response was never stored");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let retry = f.post("/slow", Some("k")).await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(retry.body, original.body);
    assert_eq!(f.calls.count(), 1);
}

/// A new key at `maxmemory` is 503 (retry later), not 500, and runs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_redis_answers_a_new_key_503() {
    let f = Fixture::start(|l| l).await;
    set_maxmemory(&f, 1).await;
    let reply = f.post("/ok", Some("k")).await;
    assert_eq!(reply.status, 503, "{:?}", reply.body);
    assert_eq!(f.calls.count(), 0);
    set_maxmemory(&f, 0).await;
    assert_eq!(f.post("/ok", Some("k")).await.status, 201);
}

/// A flow whose handler panics in the request's task ends there: it is not
/// detached and polled again when dropped (which panicked a second time,
/// "`async fn` resumed after panicking").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicked_flow_is_not_polled_again() {
    static PROBE: AtomicUsize = AtomicUsize::new(0);
    static RESUMED: AtomicUsize = AtomicUsize::new(0);
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let text = info.to_string();
        if text.contains("flow probe") {
            PROBE.fetch_add(1, Ordering::SeqCst);
        }
        if text.contains("resumed after panicking") {
            RESUMED.fetch_add(1, Ordering::SeqCst);
        }
        previous(info);
    }));
    let client = IdemClient::memory(idem_client::MemoryStore::new());
    let app = Router::new()
        .route(
            "/p",
            post(|| async {
                if PROBE.load(Ordering::SeqCst) < usize::MAX {
                    panic!("flow probe");
                }
                "never"
            }),
        )
        .layer(IdempotencyLayer::new(client));
    let server = Server::start(app).await;
    let crashed = reqwest::Client::new()
        .post(format!("{}/p", server.base))
        .header("idempotency-key", "k")
        .body("{}")
        .send()
        .await;
    assert!(crashed.is_err(), "the connection is dropped: {crashed:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(PROBE.load(Ordering::SeqCst), 1);
    assert_eq!(RESUMED.load(Ordering::SeqCst), 0);
}

/// With fail-open and `wait_for_result`, a duplicate whose wait cannot be
/// had (here its wait connections point nowhere) answers 409: its first
/// BEGIN already found the original in flight. It used to count as "Redis
/// unavailable" and run the handler a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_wait_under_fail_open_answers_in_flight_and_runs_nothing_twice() {
    let redis = RedisServer::start();
    let nowhere =
        redis::Client::open(format!("redis://127.0.0.1:{}/", idem_testkit::free_port())).unwrap();
    let client = IdemClient::new(redis.async_conn().await)
        .with_call_timeout(Duration::from_millis(500))
        .with_wait_connections(Arc::new(idem_client::DedicatedConnections::standalone(
            nowhere,
        )));
    let layer = IdempotencyLayer::new(client)
        .fail_open(true)
        .wait_for_result(Duration::from_secs(2));
    let calls = Calls::default();
    let server = Server::start(routes(calls.clone()).layer(layer)).await;
    let original = common::post(&server.base, "/slow", Some("k"), "{}");
    let duplicate = slow_again(&server.base, Duration::from_millis(100));
    let (original, duplicate) = tokio::join!(original, duplicate);
    assert_eq!(original.status, 201);
    assert_eq!(duplicate.status, 409, "{:?}", duplicate.body);
    assert_eq!(calls.count(), 1, "the handler ran once");
}

/// Redis loses the key while the handler runs (here: DEL): the COMPLETE
/// finds it gone (`NOTFOUND`), BEGINs again and stores the response under
/// the new token, so the client's retry replays it. It used to send the
/// response unstored, and the retry ran the handler a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_lost_while_the_handler_runs_still_gets_its_response_stored() {
    let f = Fixture::start(|l| l).await;
    let original = f.post("/slow", Some("k"));
    let lose_it = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(f.state("k").await.as_deref(), Some("in_progress"));
        let mut conn = f.redis.async_conn().await;
        let deleted: i64 = redis::cmd("DEL")
            .arg("idem:{:k}")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(deleted, 1);
    };
    let (original, ()) = tokio::join!(original, lose_it);
    assert_eq!(original.status, 201);
    assert_eq!(f.state("k").await.as_deref(), Some("completed"));
    let retry = f.post("/slow", Some("k")).await;
    assert!(retry.replayed(), "{:?}", retry.body);
    assert_eq!(retry.body, original.body);
    assert_eq!(f.calls.count(), 1, "the handler ran once");
}

/// Redis is down when the handler finishes (killed, then restarted on the
/// same data): the response is sent, and storing it goes on in the
/// background until Redis is back, so the retry after the lease lapsed
/// replays it. It used to give up after about 150 ms and leave the key in
/// progress: the retry took it over and ran the handler a second time, which
/// `store_retry(0)` shows again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_finished_while_redis_is_down_is_stored_once_it_is_back() {
    assert_eq!(runs_after_an_outage(Duration::from_secs(60)).await, 1);
    assert_eq!(
        runs_after_an_outage(Duration::ZERO).await,
        2,
        "without retries the handler runs again"
    );
}

/// How often the handler ran for the original and a retry when Redis goes
/// down while the 500 ms handler runs and comes back 1 s later.
async fn runs_after_an_outage(store_retry: Duration) -> usize {
    let mut redis = idem_testkit::RedisConfig::default().aof_always().start();
    let client = IdemClient::standalone(redis.client()).await.unwrap();
    let layer = IdempotencyLayer::new(client)
        .lease(Duration::from_millis(1200))
        .store_retry(store_retry);
    let calls = Calls::default();
    let server = Server::start(routes(calls.clone()).layer(layer)).await;
    let original = common::post(&server.base, "/slow", Some("k"), "{}");
    let mut conn = redis.async_conn().await;
    let outage = async {
        // Down once the handler runs, until after it finished.
        in_progress(&mut conn, "idem:{:k}").await;
        drop(conn);
        redis.kill();
        // Past the handler's end and the first attempts to store (~150 ms).
        tokio::time::sleep(Duration::from_millis(1000)).await;
        redis.restart();
    };
    let (original, ()) = tokio::join!(original, outage);
    assert_eq!(original.status, 201, "{:?}", original.body);
    // Past the lease: only a stored response keeps the retry from running.
    tokio::time::sleep(Duration::from_millis(2000)).await;
    // A client retries a 503 (a reconnect still backing off on a loaded
    // machine); it runs nothing, so the count below still decides.
    let mut retry = common::post(&server.base, "/slow", Some("k"), "{}").await;
    for _ in 0..20 {
        if retry.status != 503 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        retry = common::post(&server.base, "/slow", Some("k"), "{}").await;
    }
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    if calls.count() == 1 {
        assert!(retry.replayed(), "{:?}", retry.body);
        assert_eq!(retry.body, original.body);
    }
    calls.count()
}

/// A primary refusing writes for now (`min-replicas-to-write` unmet:
/// `NOREPLICAS`) is Redis unavailable: 503, also under `fail_open` (the
/// primary holds every key: the request may be one already answered), and
/// the retry runs once it accepts writes again. It used to be a 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_without_its_replicas_answers_503() {
    without_replicas(false).await;
    without_replicas(true).await;
}

async fn without_replicas(fail_open: bool) {
    let f = Fixture::start(|l| l.fail_open(fail_open)).await;
    let mut conn = f.redis.async_conn().await;
    let config = |value: &'static str| {
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("min-replicas-to-write")
            .arg(value)
            .clone()
    };
    let () = config("1").query_async(&mut conn).await.unwrap();
    let refused = f.post("/ok", Some("k")).await;
    assert_eq!(refused.status, 503, "{:?}", refused.body);
    assert_eq!(f.calls.count(), 0);
    let () = config("0").query_async(&mut conn).await.unwrap();
    let accepted = f.post("/ok", Some("k")).await;
    assert_eq!(accepted.status, 201, "{:?}", accepted.body);
    assert_eq!(f.calls.count(), 1);
}

/// A duplicate waiting for the original's answer on a primary that is
/// demoted meanwhile (`REPLICAOF`: Redis answers `UNBLOCKED`) gets 409: the
/// key is known to be in flight. It used to be a 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_unblocked_by_a_demotion_answers_in_flight() {
    let redis = RedisServer::start();
    let other = RedisServer::start();
    let client = IdemClient::standalone(redis.client()).await.unwrap();
    let layer = IdempotencyLayer::new(client).wait_for_result(Duration::from_secs(5));
    let calls = Calls::default();
    let server = Server::start(routes(calls.clone()).layer(layer)).await;
    let original = tokio::spawn(slow_again(server.base.clone(), Duration::ZERO));
    let mut conn = redis.async_conn().await;
    in_progress(&mut conn, "idem:{:k}").await;
    let duplicate = tokio::spawn(slow_again(server.base.clone(), Duration::ZERO));
    // Demoted once the duplicate waits (blocked in `BEGIN ... WAIT`).
    let deadline = Instant::now() + Duration::from_secs(5);
    while blocked_clients(&mut conn).await != Some(1) {
        assert!(Instant::now() < deadline, "the duplicate never blocked");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(other.port)
        .query_async(&mut conn)
        .await
        .unwrap();
    let duplicate = duplicate.await.unwrap();
    assert_eq!(duplicate.status, 409, "{:?}", duplicate.body);
    drop(original.await.unwrap());
    assert_eq!(calls.count(), 1, "the duplicate ran nothing");
}

/// Credentials the server refuses are a configuration error, not an outage:
/// even under `fail_open` no handler runs unprotected on them (500). The
/// password changes on the server, the client's connection is cut, and its
/// reconnect is refused (`WRONGPASS`); that was taken for Redis being down,
/// so every request ran unprotected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_credentials_never_run_a_handler_unprotected() {
    let redis = RedisServer::start();
    let mut admin = redis.async_conn().await;
    let config_set =
        |name: &str, value: &str| redis::cmd("CONFIG").arg("SET").arg(name).arg(value).clone();
    let () = config_set("requirepass", "first")
        .query_async(&mut admin)
        .await
        .unwrap();
    let url = format!("redis://:first@127.0.0.1:{}", redis.port);
    let client = IdemClient::standalone(redis::Client::open(url).unwrap())
        .await
        .unwrap();
    let layer = IdempotencyLayer::new(client.clone()).fail_open(true);
    let calls = Calls::default();
    let server = Server::start(routes(calls.clone()).layer(layer)).await;
    let first = common::post(&server.base, "/ok", Some("a"), "{}").await;
    assert_eq!(first.status, 201, "{:?}", first.body);

    // The password changes; the client's connection is cut and its
    // reconnect carries the old one.
    let () = config_set("requirepass", "second")
        .query_async(&mut admin)
        .await
        .unwrap();
    let _: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .arg("SKIPME")
        .arg("yes")
        .query_async(&mut admin)
        .await
        .unwrap();
    // Once the client noticed its connection closed, its reconnect is
    // refused (before that, a call may still meet the closing socket).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match client.abort("probe", 1).await {
            Err(IdemError::Redis(_)) => break,
            other => assert!(Instant::now() < deadline, "never refused: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for key in ["b", "c"] {
        let refused = common::post(&server.base, "/ok", Some(key), "{}").await;
        assert_eq!(refused.status, 500, "{key}: {:?}", refused.body);
    }
    assert_eq!(calls.count(), 1, "a handler ran unprotected");
}

/// The slow request with key `k` again, `after` the original was sent.
async fn slow_again(base: impl AsRef<str>, after: Duration) -> common::Reply {
    tokio::time::sleep(after).await;
    common::post(base.as_ref(), "/slow", Some("k"), "{}").await
}

/// `INFO clients`' `blocked_clients`.
async fn blocked_clients(conn: &mut redis::aio::MultiplexedConnection) -> Option<i64> {
    let text: String = redis::cmd("INFO")
        .arg("clients")
        .query_async(conn)
        .await
        .unwrap();
    idem_testkit::info::info_int(&text, "blocked_clients")
}

/// Returns once `key` is in progress (its handler runs); fails after 5 s.
async fn in_progress(conn: &mut redis::aio::MultiplexedConnection, key: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while state_of(conn, key).await.as_deref() != Some("in_progress") {
        assert!(Instant::now() < deadline, "{key} never went in progress");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[test]
#[should_panic(expected = "wait connections")]
fn wait_for_result_needs_wait_connections() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let redis = RedisServer::start();
    let client = IdemClient::new(runtime.block_on(redis.async_conn()));
    let _ = IdempotencyLayer::new(client).wait_for_result(Duration::from_secs(1));
}
