//! The middleware with handlers that use the Postgres fence (real HTTP, real
//! redis-server with the module, real Postgres): a committed response is
//! stored whatever its status and marked mirrored, a rolled-back one is not,
//! the fence's replay, 409 and 422 become the HTTP answers and release or
//! refill Redis, and a STALE COMPLETE answers what the key holds now. With
//! `claim_up_front` the layer's claim answers before the handler runs, and a
//! handler that does not use it has it released; a handler that panics has
//! its claim released either way.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use common::{idem_get, state_of, text, Server};
use deadpool_postgres::{Manager, Pool};
use idem_client::{
    Claim, Fence, Fingerprinter, IdemClient, IdempotencyLayer, ReadThrough, StoredResponse,
};
use idem_testkit::{PgDatabase, RedisServer};
use tokio_postgres::NoTls;

#[derive(Clone)]
struct App {
    pool: Pool,
    calls: Arc<AtomicUsize>,
    redis_url: String,
}

/// Claims, records one effect row, and commits `status` through the fence;
/// `rollback` drops the transaction instead of committing.
async fn fenced(app: &App, fence: &Fence, status: u16, rollback: bool) -> Response {
    let n = app.calls.fetch_add(1, Ordering::SeqCst) + 1;
    match fence.claim(&app.pool).await.unwrap() {
        Claim::Proceed => {}
        // The middleware answers for the fence; this must not reach a client.
        _ => return StatusCode::IM_A_TEAPOT.into_response(),
    }
    let mut client = app.pool.get().await.unwrap();
    let tx = client.transaction().await.unwrap();
    tx.execute("INSERT INTO effects (n) VALUES ($1)", &[&(n as i64)])
        .await
        .unwrap();
    let stored = StoredResponse::new(status, format!("{{\"n\":{n}}}"))
        .with_header("content-type", "application/json");
    if !rollback {
        assert_eq!(
            fence.commit(tx, &stored).await.unwrap(),
            idem_client::Commit::Committed
        );
    }
    (
        StatusCode::from_u16(status).unwrap(),
        [("content-type", "application/json")],
        stored.body,
    )
        .into_response()
}

/// The fingerprint the middleware computes for `POST path` with the JSON
/// body `{}`.
fn fingerprint(path: &str) -> Vec<u8> {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", "application/json".parse().unwrap());
    Fingerprinter::new()
        .canonical_json(true)
        .fingerprint(&Method::POST, &path.parse().unwrap(), &headers, b"{}")
        .as_bytes()
        .to_vec()
}

fn routes(app: App) -> Router {
    Router::new()
        .route(
            "/created",
            post(
                |State(app): State<App>, Extension(fence): Extension<Fence>| async move {
                    fenced(&app, &fence, 201, false).await
                },
            ),
        )
        .route(
            "/committed-500",
            post(
                |State(app): State<App>, Extension(fence): Extension<Fence>| async move {
                    fenced(&app, &fence, 500, false).await
                },
            ),
        )
        .route(
            "/rolled-back-201",
            post(
                |State(app): State<App>, Extension(fence): Extension<Fence>| async move {
                    fenced(&app, &fence, 201, true).await
                },
            ),
        )
        .route(
            "/panics-first",
            // Claims through the pool, then panics on its first call.
            post(
                |State(app): State<App>, Extension(fence): Extension<Fence>| async move {
                    assert_eq!(fence.claim(&app.pool).await.unwrap(), Claim::Proceed);
                    if app.calls.load(Ordering::SeqCst) == 0 {
                        app.calls.fetch_add(1, Ordering::SeqCst);
                        panic!("the handler fails after its claim");
                    }
                    fenced(&app, &fence, 201, false).await
                },
            ),
        )
        .route(
            "/unfenced",
            // Leaves its fence alone.
            post(|State(app): State<App>| async move {
                app.calls.fetch_add(1, Ordering::SeqCst);
                (StatusCode::CREATED, "{\"unfenced\":true}")
            }),
        )
        .route(
            "/overtaken",
            // Not fenced: while it runs, another holder takes the key over
            // and completes it; its own COMPLETE is then STALE.
            post(
                |State(app): State<App>, Extension(fence): Extension<Fence>| async move {
                    let mut conn = redis::Client::open(app.redis_url.as_str())
                        .unwrap()
                        .get_multiplexed_async_connection()
                        .await
                        .unwrap();
                    let _: i64 = redis::cmd("IDEM.ABORT")
                        .arg(fence.key())
                        .arg(fence.token())
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                    let client = IdemClient::new(conn);
                    let outcome = client
                        .begin(
                            fence.key(),
                            &fingerprint("/overtaken"),
                            idem_client::BeginOptions::new(common::LONG),
                        )
                        .await
                        .unwrap();
                    let idem_client::Outcome::New { token } = outcome else {
                        panic!("the newer holder gets the key: {outcome:?}");
                    };
                    client
                        .complete(
                            fence.key(),
                            token,
                            &StoredResponse::new(201, "{\"holder\":\"newer\"}"),
                            idem_client::Origin::Handler,
                        )
                        .await
                        .unwrap();
                    (StatusCode::CREATED, "{\"holder\":\"stale\"}")
                },
            ),
        )
        .with_state(app)
}

/// A database with the writer's table and an `effects` table, and a pool of
/// up to `max_size` connections to it (opened on first use).
async fn database(max_size: usize) -> (PgDatabase, Pool) {
    let db = PgDatabase::create();
    let mut client = db.connect().await;
    idem_writer::migrate(&mut client).await.unwrap();
    client
        .batch_execute("CREATE TABLE effects (n BIGINT NOT NULL)")
        .await
        .unwrap();
    let config: tokio_postgres::Config = db.url.parse().unwrap();
    let pool = Pool::builder(Manager::new(config, NoTls))
        .max_size(max_size)
        .build()
        .unwrap();
    (db, pool)
}

struct Fixture {
    redis: RedisServer,
    db: PgDatabase,
    app: App,
    server: Server,
}

impl Fixture {
    async fn start() -> Fixture {
        Fixture::start_with(false).await
    }

    /// With `up_front`, the layer claims every request's fence before its
    /// handler, through read-through's pool.
    async fn start_with(up_front: bool) -> Fixture {
        let redis = RedisServer::start();
        let (db, pool) = database(4).await;
        let app = App {
            pool,
            calls: Arc::default(),
            redis_url: redis.url(),
        };
        let mut layer = IdempotencyLayer::new(IdemClient::new(redis.async_conn().await));
        if up_front {
            layer = layer
                .read_through(ReadThrough::new(app.pool.clone()))
                .claim_up_front(true);
        }
        let server = Server::start(routes(app.clone()).layer(layer)).await;
        Fixture {
            redis,
            db,
            app,
            server,
        }
    }

    async fn post(&self, path: &str, key: &str) -> common::Reply {
        common::post(&self.server.base, path, Some(key), "{}").await
    }

    fn redis_key(key: &str) -> String {
        format!("idem:{{:{key}}}")
    }

    async fn redis_field(&self, key: &str, field: &str) -> Option<String> {
        let mut conn = self.redis.async_conn().await;
        idem_get(&mut conn, &Self::redis_key(key))
            .await
            .map(|f| text(&f[field]))
    }

    async fn effects(&self) -> i64 {
        let client = self.db.connect().await;
        client
            .query_one("SELECT count(*) FROM effects", &[])
            .await
            .unwrap()
            .get(0)
    }

    /// The key's row in Postgres: `(status, token)`.
    async fn row(&self, key: &str) -> Option<(String, i64)> {
        let client = self.db.connect().await;
        client
            .query_opt(
                "SELECT status, token FROM idempotency_keys WHERE key = $1",
                &[&Self::redis_key(key)],
            )
            .await
            .unwrap()
            .map(|row| (row.get(0), row.get(1)))
    }

    fn calls(&self) -> usize {
        self.app.calls.load(Ordering::SeqCst)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_committed_response_is_stored_whatever_its_status_and_not_mirrored_again() {
    let f = Fixture::start().await;
    let first = f.post("/committed-500", "k500").await;
    assert_eq!(first.status, 500);
    assert_eq!(
        f.redis_field("k500", "state").await.as_deref(),
        Some("completed")
    );
    assert_eq!(
        f.redis_field("k500", "mirror").await.as_deref(),
        Some("mirrored"),
        "the fence's row is the mirror: the writer must not write it again"
    );
    let retry = f.post("/committed-500", "k500").await;
    assert_eq!(retry.status, 500);
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!((f.calls(), f.effects().await), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_response_is_not_stored_whatever_its_status() {
    let f = Fixture::start().await;
    let first = f.post("/rolled-back-201", "k").await;
    assert_eq!(first.status, 201);
    assert_eq!(f.redis_field("k", "state").await, None, "released");
    let retry = f.post("/rolled-back-201", "k").await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed(), "the retry ran again");
    assert_eq!((f.calls(), f.effects().await), (2, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fence_replays_what_redis_forgot_and_refills_it() {
    let f = Fixture::start().await;
    let first = f.post("/created", "k").await;
    assert_eq!(first.status, 201);
    let mut conn = f.redis.async_conn().await;
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();

    // No read-through: the handler's claim finds the committed row.
    let retry = f.post("/created", "k").await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(retry.header("content-type"), Some("application/json"));
    assert_eq!(
        f.redis_field("k", "state").await.as_deref(),
        Some("completed")
    );
    assert_eq!(
        f.redis_field("k", "mirror").await.as_deref(),
        Some("mirrored")
    );
    // Refilled: the next retry is answered by Redis alone.
    let again = f.post("/created", "k").await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!((f.calls(), f.effects().await), (2, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_holder_is_409_and_another_request_is_422_and_both_release_redis() {
    let f = Fixture::start().await;
    let redis_key = Fixture::redis_key("k409");
    // Another fenced transaction for the key is open (it holds the gate).
    let mut holder = f.db.connect().await;
    let tx = holder.transaction().await.unwrap();
    let fence = Fence::new(
        redis_key.as_str(),
        1,
        &fingerprint("/created"),
        common::LONG,
    );
    assert_eq!(fence.claim_in(&tx).await.unwrap(), Claim::Proceed);
    let busy = f.post("/created", "k409").await;
    assert_eq!(busy.status, 409);
    assert_eq!(busy.header("retry-after"), Some("1"));
    assert_eq!(
        busy.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(f.redis_field("k409", "state").await, None, "released");
    tx.rollback().await.unwrap();
    assert_eq!(f.post("/created", "k409").await.status, 201);

    // The row holds another request (Redis forgot the key): 422.
    let mut conn = f.redis.async_conn().await;
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    let other = f.post("/committed-500", "k409").await;
    assert_eq!(other.status, 422);
    assert_eq!(f.redis_field("k409", "state").await, None, "released");
    assert_eq!(f.effects().await, 1);
}

/// Redis forgot a key whose holder claimed durably and still runs: the
/// retry's claim finds the committed `in_progress` row and answers 409 while
/// its lease runs, without waiting; nothing runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_durable_claim_is_409_when_redis_forgot_the_key() {
    let f = Fixture::start().await;
    let redis_key = Fixture::redis_key("kd");
    let holder = Fence::new(
        redis_key.as_str(),
        1,
        &fingerprint("/created"),
        common::LONG,
    );
    assert_eq!(holder.claim(&f.app.pool).await.unwrap(), Claim::Proceed);
    let busy = f.post("/created", "kd").await;
    assert_eq!(busy.status, 409);
    assert_eq!(f.redis_field("kd", "state").await, None, "released");
    assert_eq!(f.effects().await, 0);
    // The holder gives up (the middleware does it for its own handlers):
    // the retry proceeds at once.
    holder.release(&f.app.pool).await.unwrap();
    assert_eq!(f.post("/created", "kd").await.status, 201);
    assert_eq!(f.effects().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_complete_answers_what_the_key_holds_now() {
    let f = Fixture::start().await;
    let reply = f.post("/overtaken", "k").await;
    assert_eq!(reply.status, 201);
    assert_eq!(
        reply.body, "{\"holder\":\"newer\"}",
        "the stale holder's own result never reaches its client"
    );
    assert!(reply.replayed());
    let mut conn = f.redis.async_conn().await;
    assert_eq!(
        state_of(&mut conn, &Fixture::redis_key("k"))
            .await
            .as_deref(),
        Some("completed")
    );
}

/// A handler that panics after claiming through the pool leaves no claim
/// behind: the retry proceeds at once instead of answering 409 until the
/// claim's lease (here 60 s) lapses. Before the fix the panic released only
/// Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_panics_after_its_claim_leaves_no_claim_behind() {
    for up_front in [false, true] {
        let f = Fixture::start_with(up_front).await;
        let crashed = reqwest::Client::new()
            .post(format!("{}/panics-first", f.server.base))
            .header("content-type", "application/json")
            .header("idempotency-key", "kp")
            .body("{}")
            .send()
            .await;
        assert!(
            crashed.is_err() || crashed.unwrap().status().is_server_error(),
            "the panic reaches no client as a success"
        );
        assert_eq!(
            f.row("kp").await,
            None,
            "claim released (up front: {up_front})"
        );
        let retry = f.post("/panics-first", "kp").await;
        assert_eq!(retry.status, 201, "up front: {up_front}: {:?}", retry.body);
        assert_eq!(f.effects().await, 1);
    }
}

/// Claimed up front, the layer answers what Postgres holds before any
/// handler runs: a committed row Redis forgot is replayed (and refilled), a
/// row of another request is 422, a live claim is 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claimed_up_front_the_row_is_answered_before_the_handler_runs() {
    let f = Fixture::start_with(true).await;
    let first = f.post("/created", "ku").await;
    assert_eq!(first.status, 201);
    assert_eq!(f.row("ku").await.map(|r| r.0).as_deref(), Some("completed"));
    let mut conn = f.redis.async_conn().await;
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();

    let retry = f.post("/created", "ku").await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(
        f.redis_field("ku", "mirror").await.as_deref(),
        Some("mirrored"),
        "refilled from the row"
    );
    assert_eq!(f.calls(), 1, "the handler did not run for the replay");

    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    let other = f.post("/committed-500", "ku").await;
    assert_eq!(other.status, 422);
    assert_eq!(f.redis_field("ku", "state").await, None, "released");

    // A holder elsewhere claimed durably and runs: 409, nothing runs.
    let holder = Fence::new(
        Fixture::redis_key("kl").as_str(),
        1,
        &fingerprint("/created"),
        common::LONG,
    );
    assert_eq!(holder.claim(&f.app.pool).await.unwrap(), Claim::Proceed);
    let busy = f.post("/created", "kl").await;
    assert_eq!(busy.status, 409);
    assert_eq!(busy.header("retry-after"), Some("1"));
    assert_eq!(f.redis_field("kl", "state").await, None, "released");
    assert_eq!((f.calls(), f.effects().await), (1, 1));
}

/// Claimed up front for a handler that does not use the fence: the claim is
/// released and the response stored in Redis as any other (for the writer
/// to mirror).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_up_front_claim_the_handler_leaves_alone_is_released_and_the_response_stored() {
    let f = Fixture::start_with(true).await;
    let first = f.post("/unfenced", "kn").await;
    assert_eq!(first.status, 201);
    assert_eq!(f.row("kn").await, None, "the claim was released");
    assert_eq!(
        f.redis_field("kn", "state").await.as_deref(),
        Some("completed")
    );
    assert_eq!(
        f.redis_field("kn", "mirror").await.as_deref(),
        Some("pending"),
        "stored by the middleware, for the writer"
    );
    let retry = f.post("/unfenced", "kn").await;
    assert!(retry.replayed());
    assert_eq!(f.calls(), 1);
}

/// With `fail_open`, a claim made up front that Postgres refuses (here a
/// read-only database: it answers, but takes no write) is a 503, and the
/// handler does not run: fail-open is for Redis being unreachable, never
/// for running a payment without its fence. Before the fix every Postgres
/// error counted as unreachable and the handler ran twice, unprotected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_never_runs_a_handler_whose_up_front_claim_failed() {
    let redis = RedisServer::start();
    let (db, pool) = database(2).await;
    let client = db.connect().await;
    let database = client
        .query_one("SELECT current_database()", &[])
        .await
        .unwrap()
        .get::<_, String>(0);
    client
        .batch_execute(&format!(
            "ALTER DATABASE \"{database}\" SET default_transaction_read_only = on"
        ))
        .await
        .unwrap();
    let app = App {
        pool: pool.clone(),
        calls: Arc::default(),
        redis_url: redis.url(),
    };
    let layer = IdempotencyLayer::new(IdemClient::new(redis.async_conn().await))
        .read_through(ReadThrough::new(pool))
        .claim_up_front(true)
        .fail_open(true);
    let server = Server::start(routes(app.clone()).layer(layer)).await;
    for _ in 0..2 {
        let reply = common::post(&server.base, "/unfenced", Some("kro"), "{}").await;
        assert_eq!(reply.status, 503);
    }
    assert_eq!(app.calls.load(Ordering::SeqCst), 0, "the handler never ran");
}

/// Claimed up front, a handler that reaches its claim late (here after the
/// lease, while Redis forgot the key and a retry took it over and
/// committed) claims again instead of proceeding on the layer's old
/// decision: it finds the retry's answer and calls nothing outside
/// Postgres. Before the fix its claim answered Proceed and it went on to
/// call the processor (its commit then found the key lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_reaching_an_old_up_front_claim_claims_again() {
    let redis = RedisServer::start();
    let (_db, pool) = database(4).await;
    let entered = Arc::new(AtomicUsize::new(0));
    let proceeded = Arc::new(AtomicUsize::new(0));
    let app = App {
        pool: pool.clone(),
        calls: Arc::default(),
        redis_url: redis.url(),
    };
    let routes = Router::new()
        .route(
            "/late",
            post({
                let (entered, proceeded) = (entered.clone(), proceeded.clone());
                move |State(app): State<App>, Extension(fence): Extension<Fence>| async move {
                    if entered.fetch_add(1, Ordering::SeqCst) == 0 {
                        // The first run is slow to reach its claim.
                        tokio::time::sleep(std::time::Duration::from_millis(1600)).await;
                    }
                    if fence.claim(&app.pool).await.unwrap() != Claim::Proceed {
                        return StatusCode::IM_A_TEAPOT.into_response();
                    }
                    proceeded.fetch_add(1, Ordering::SeqCst);
                    fenced(&app, &fence, 201, false).await
                }
            }),
        )
        .with_state(app.clone());
    let layer = IdempotencyLayer::new(IdemClient::new(redis.async_conn().await))
        .read_through(ReadThrough::new(pool))
        .claim_up_front(true)
        .lease(std::time::Duration::from_secs(1));
    let server = Server::start(routes.layer(layer)).await;
    let base = server.base.clone();
    let original =
        tokio::spawn(async move { common::post(&base, "/late", Some("kl"), "{}").await });
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let mut conn = redis.async_conn().await;
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    // After the original's lease in Postgres lapsed: the retry takes over.
    tokio::time::sleep(std::time::Duration::from_millis(1000)).await;
    let retry = common::post(&server.base, "/late", Some("kl"), "{}").await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed());
    let original = original.await.unwrap();
    assert_eq!(original.status, 201);
    assert!(
        original.replayed(),
        "the original answers the retry's payment"
    );
    assert_eq!(original.body, retry.body);
    assert_eq!(
        proceeded.load(Ordering::SeqCst),
        1,
        "only the retry went on past its claim"
    );
}
