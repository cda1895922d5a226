//! `IdempotencyLayer::table_layout`: on a table migrated partitioned, the
//! fence the middleware hands a handler claims with the partitioned protocol
//! without the handler naming the layout (real HTTP, redis-server with the
//! module, Postgres). A layer left at the default layout fails its claims
//! on that table, so the option is what makes it work.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use common::{idem_get, text, Server};
use deadpool_postgres::{Manager, Pool};
use idem_client::{Claim, Fence, IdemClient, IdempotencyLayer, StoredResponse, TableLayout};
use idem_testkit::{PgDatabase, RedisServer};
use idem_writer::Layout;
use tokio_postgres::NoTls;

#[derive(Clone)]
struct App {
    pool: Pool,
    calls: Arc<AtomicUsize>,
}

/// Claims with the fence as the middleware configured it, records one
/// effect and commits 201 through the fence; a failed claim is 500.
async fn create(State(app): State<App>, Extension(fence): Extension<Fence>) -> Response {
    let n = app.calls.fetch_add(1, Ordering::SeqCst) + 1;
    match fence.claim(&app.pool).await {
        Ok(Claim::Proceed) => {}
        // The middleware answers for the claim; this must not reach a client.
        Ok(_) => return StatusCode::IM_A_TEAPOT.into_response(),
        Err(err) => return (StatusCode::INTERNAL_SERVER_ERROR, err.to_string()).into_response(),
    }
    let mut client = app.pool.get().await.unwrap();
    let tx = client.transaction().await.unwrap();
    tx.execute("INSERT INTO effects (n) VALUES ($1)", &[&(n as i64)])
        .await
        .unwrap();
    let created = StoredResponse::new(201, format!("{{\"n\":{n}}}"));
    assert_eq!(
        fence.commit(tx, &created).await.unwrap(),
        idem_client::Commit::Committed
    );
    (StatusCode::CREATED, created.body).into_response()
}

async fn row(db: &PgDatabase, key: &str) -> Option<(String, i64)> {
    let client = db.connect().await;
    client
        .query_opt(
            "SELECT status, token FROM idempotency_keys WHERE key = $1",
            &[&key],
        )
        .await
        .unwrap()
        .map(|r| (r.get(0), r.get(1)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layers_fence_claims_on_the_partitioned_layout() {
    let redis = RedisServer::start();
    let db = PgDatabase::create();
    let mut pg = db.connect().await;
    idem_writer::migrate_with_layout(&mut pg, Layout::Partitioned)
        .await
        .unwrap();
    pg.batch_execute("CREATE TABLE effects (n BIGINT NOT NULL)")
        .await
        .unwrap();
    let config: tokio_postgres::Config = db.url.parse().unwrap();
    let app = App {
        pool: Pool::builder(Manager::new(config, NoTls))
            .max_size(4)
            .build()
            .unwrap(),
        calls: Arc::default(),
    };
    let routes = Router::new()
        .route("/payments", post(create))
        .with_state(app.clone());
    let client = IdemClient::new(redis.async_conn().await);
    let partitioned = Server::start(
        routes
            .clone()
            .layer(IdempotencyLayer::new(client.clone()).table_layout(TableLayout::Partitioned)),
    )
    .await;
    let unpartitioned = Server::start(routes.layer(IdempotencyLayer::new(client))).await;

    let first = common::post(&partitioned.base, "/payments", Some("k"), "{}").await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let redis_key = "idem:{:k}";
    let (status, token) = row(&db, redis_key).await.expect("the fence's row");
    assert_eq!(status, "completed");
    let mut conn = redis.async_conn().await;
    let record = idem_get(&mut conn, redis_key).await.expect("record");
    assert_eq!(text(&record["token"]), token.to_string());
    assert_eq!(text(&record["mirror"]), "mirrored");

    // Redis forgets; the retry's partitioned claim finds the committed row.
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    let retry = common::post(&partitioned.base, "/payments", Some("k"), "{}").await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);

    // The default layout's claim does not work on this table.
    let wrong = common::post(&unpartitioned.base, "/payments", Some("other"), "{}").await;
    assert_eq!(wrong.status, 500, "{:?}", wrong.body);
    assert_eq!(row(&db, "idem:{:other}").await, None);

    let effects: i64 = db
        .connect()
        .await
        .query_one("SELECT count(*) FROM effects", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!((app.calls.load(Ordering::SeqCst), effects), (3, 1));
}
