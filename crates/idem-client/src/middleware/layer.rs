//! `IdempotencyLayer`: the middleware's options, set builder-style, and the
//! tower `Layer` that wraps a service with them.

use std::sync::Arc;
use std::time::Duration;

use http::header::{HeaderName, CONTENT_TYPE, LOCATION};
use http::request::Parts;
use http::{Method, StatusCode};
use tower::Layer;

use super::config::{default_store_policy, Config, ReplicaAck};
use super::key::tenant_of_lines;
use super::metrics::LayerMetrics;
use super::service::Idempotency;
use crate::client::check_replica_ack;
use crate::{Fingerprinter, IdemClient};
#[cfg(feature = "postgres")]
use crate::{ReadThrough, TableLayout};

/// The layer: wraps a service in [`Idempotency`]. Options are set with its
/// methods (defaults in each method's doc); docs/client.md has the table of
/// answers.
///
/// The README's setup (Redis, and read-through on the writer's Postgres):
///
/// ```no_run
/// # use axum::{routing::post, Router};
/// # use idem_client::{IdemClient, IdempotencyLayer, ReadThrough};
/// # async fn create_payment() -> &'static str { "paid" }
/// # #[derive(Clone)]
/// # struct Account(String);
/// # async fn setup(pg_pool: deadpool_postgres::Pool) -> Result<(), Box<dyn std::error::Error>> {
/// let client = IdemClient::standalone(redis::Client::open("redis://127.0.0.1:6390/")?).await?;
/// let layer = IdempotencyLayer::new(client)
///     .tenant(|parts| parts.extensions.get::<Account>().map(|a| a.0.clone()))
///     .read_through(ReadThrough::new(pg_pool));
/// let app = Router::new().route("/payments", post(create_payment)).layer(layer);
/// # let _: Router = app;
/// # Ok(())
/// # }
/// ```
///
/// The same layer over [`MemoryStore`](crate::MemoryStore), which is how a
/// handler is unit-tested with the layer and no Redis:
///
/// ```
/// use axum::{body::Body, http::Request, routing::post, Router};
/// use idem_client::{IdemClient, IdempotencyLayer, MemoryStore};
/// use tower::ServiceExt;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let layer = IdempotencyLayer::new(IdemClient::memory(MemoryStore::new()));
/// let app = Router::new()
///     .route("/payments", post(|| async { "paid" }))
///     .layer(layer);
/// let request = || {
///     Request::post("/payments")
///         .header("idempotency-key", "order-1")
///         .body(Body::from("{}"))
///         .unwrap()
/// };
/// let first = app.clone().oneshot(request()).await.unwrap();
/// assert!(first.headers().get("idempotent-replayed").is_none());
/// let retry = app.oneshot(request()).await.unwrap();
/// assert_eq!(retry.headers()["idempotent-replayed"], "true");
/// # }
/// ```
pub struct IdempotencyLayer<C> {
    pub(crate) config: Config<C>,
}

impl<C: Clone> Clone for IdempotencyLayer<C> {
    fn clone(&self) -> Self {
        IdempotencyLayer {
            config: self.config.clone(),
        }
    }
}

impl<C> IdempotencyLayer<C> {
    /// A layer over `client` with the default options.
    pub fn new(client: IdemClient<C>) -> Self {
        IdempotencyLayer {
            config: Config {
                client,
                #[cfg(feature = "postgres")]
                read_through: None,
                #[cfg(feature = "postgres")]
                table_layout: TableLayout::Unpartitioned,
                #[cfg(feature = "postgres")]
                claim_up_front: false,
                methods: vec![Method::POST, Method::PATCH],
                header: HeaderName::from_static("idempotency-key"),
                required: false,
                tenant: None,
                key_prefix: "idem:".to_string(),
                ttl: Duration::from_secs(24 * 3600),
                lease: Duration::from_secs(30),
                wait: None,
                max_request_body: 1 << 20,
                max_response_body: 1 << 20,
                stored_headers: vec![CONTENT_TYPE, LOCATION],
                store_policy: Arc::new(default_store_policy),
                fail_open: false,
                store_retry: Duration::from_secs(60),
                fingerprinter: Fingerprinter::new().canonical_json(true),
                max_retry_after: Duration::from_secs(2),
                metrics: None,
                metrics_route: None,
                replica_ack: None,
            },
        }
    }

    /// Look keys Redis does not know up in the Postgres mirror (default: off).
    #[cfg(feature = "postgres")]
    pub fn read_through(mut self, read_through: ReadThrough) -> Self {
        self.config.read_through = Some(read_through);
        self
    }

    /// Claim every request's fence durably before its handler runs, in
    /// place of read-through's lookup (default: off; needs `read_through`,
    /// whose pool and timeout it uses). The fence's claim answers what the
    /// lookup would and more, in one statement: a completed row is replayed
    /// (and refilled into Redis), a row of another request is 422, a live
    /// claim of this request (Redis forgot the key while its holder runs) is
    /// 409; otherwise the handler runs holding the claim, and its
    /// `fence.claim(..)` answers `Proceed` with no round trip. For layers
    /// whose handlers all use the fence: a handler that does not has the
    /// claim released after it returns (one more statement) before its
    /// response is stored as usual. docs/fence.md, "Claiming up front".
    #[cfg(feature = "postgres")]
    pub fn claim_up_front(mut self, claim_up_front: bool) -> Self {
        self.config.claim_up_front = claim_up_front;
        self
    }

    /// The layout of `idempotency_keys` the handlers' fences claim on
    /// (default: `Unpartitioned`); `Partitioned` for a table migrated with
    /// `idem-writer migrate --layout partitioned`. Every fenced participant
    /// of one table must use its layout (docs/fence.md).
    #[cfg(feature = "postgres")]
    pub fn table_layout(mut self, layout: TableLayout) -> Self {
        self.config.table_layout = layout;
        self
    }

    /// Methods the layer applies to (default: POST, PATCH); others pass through.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config.methods = methods.into_iter().collect();
        self
    }

    /// The key header (default: `Idempotency-Key`).
    pub fn header(mut self, name: HeaderName) -> Self {
        self.config.header = name;
        self
    }

    /// A request without the header gets 400 instead of passing through (default: false).
    pub fn required(mut self, required: bool) -> Self {
        self.config.required = required;
        self
    }

    /// Scopes keys per tenant (default: none, one scope for everybody).
    /// The tenant must be the **authenticated caller**, as the app's
    /// authentication layer (run before this one) left it in the request's
    /// extensions, never a value the client chooses: with a client-chosen
    /// scope, whoever learns another caller's key and body gets that
    /// caller's stored response without the handler running.
    ///
    /// ```
    /// # use axum::{routing::post, Router};
    /// # use idem_client::{IdemClient, IdempotencyLayer, MemoryStore};
    /// # async fn create_payment() -> &'static str { "paid" }
    /// # async fn authenticate(
    /// #     request: axum::extract::Request,
    /// #     next: axum::middleware::Next,
    /// # ) -> axum::response::Response {
    /// #     next.run(request).await
    /// # }
    /// # let client = IdemClient::memory(MemoryStore::new());
    /// #[derive(Clone)]
    /// struct Account(String); // inserted by your auth middleware
    ///
    /// let layer = IdempotencyLayer::new(client)
    ///     .tenant(|parts| parts.extensions.get::<Account>().map(|a| a.0.clone()));
    /// let app = Router::new()
    ///     .route("/payments", post(create_payment))
    ///     .layer(layer) // inner: runs second
    ///     .layer(axum::middleware::from_fn(authenticate)); // outer: runs first
    /// # let _: Router = app;
    /// ```
    ///
    /// With a tenant source, a request it gives no tenant (`None`) or an
    /// empty one is answered 400 `missing_tenant`, one longer than
    /// [`MAX_TENANT_BYTES`](super::MAX_TENANT_BYTES) bytes 400
    /// `invalid_tenant`, before Redis is called.
    pub fn tenant(
        mut self,
        tenant: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.config.tenant = Some(Arc::new(tenant));
        self
    }

    /// Scopes keys by the value of one request header (byte for byte: a
    /// value that is not UTF-8 is a tenant of its own, see `tenant_of`; a
    /// header sent more than once is its lines combined, `a, b`, a tenant
    /// of its own too). Only for a header the client cannot set: one your
    /// gateway writes after authenticating the caller (and strips from what
    /// clients send); otherwise use [`tenant`](Self::tenant). A missing or
    /// empty header is 400 `missing_tenant`.
    pub fn tenant_header(self, name: HeaderName) -> Self {
        self.tenant(move |parts| tenant_of_lines(parts.headers.get_all(&name).iter()))
    }

    /// Prefix of the Redis keys (default: `idem:`); keys are `prefix{tenant:key}`.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.config.key_prefix = prefix.into();
        self
    }

    /// How long a key and its stored response live (default: 24 h).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.config.ttl = ttl;
        self
    }

    /// The lease of a running request (default: 30 s); renewed (TOUCH) every third of
    /// it while the handler runs, so a slow handler keeps its key.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config.lease = lease;
        self
    }

    /// A duplicate of a running request waits up to `wait` for the
    /// original's answer (replayed) instead of getting 409 (default: off).
    ///
    /// # Panics
    /// When the client has no wait connections (`IdemClient::standalone`,
    /// `IdemClient::cluster` or `with_wait_connections` provide them): a
    /// blocking call on a shared connection would stall all other requests.
    pub fn wait_for_result(mut self, wait: Duration) -> Self {
        assert!(
            self.config.client.can_wait(),
            "wait_for_result needs an IdemClient with wait connections"
        );
        self.config.wait = Some(wait);
        self
    }

    /// Answer a response the layer stores in Redis only once `replicas`
    /// replicas acknowledged it, waiting up to `timeout` (default: off).
    /// Each COMPLETE goes out with `WAIT replicas timeout` behind it, in one
    /// round trip on a dedicated connection. When fewer replicas
    /// acknowledged in time, or the COMPLETE's fate is unknown or Redis
    /// refuses it for now, the client gets 503 (`Retry-After`) instead of
    /// the response, and the key is not released: the record stays, so a
    /// retry replays it where it survived, and with the fence Postgres holds
    /// the answer. Replays are answered as Redis holds them, unacknowledged:
    /// pair this with `min-replicas-to-write` and a `timeout` longer than
    /// the primary takes to refuse writes once cut off (docs/client.md,
    /// docs/partitions.md).
    ///
    /// # Panics
    /// When `replicas` is 0 or `timeout` is zero (`WAIT` with 0 blocks for
    /// ever), or the client's wait connections cannot keep COMPLETE and
    /// `WAIT` on one connection (`IdemClient::standalone` and
    /// `IdemClient::cluster` provide ones that can; `MemoryStore`'s cannot).
    pub fn replica_ack(mut self, replicas: u32, timeout: Duration) -> Self {
        if let Err(reason) = check_replica_ack(replicas, timeout) {
            panic!("{reason}");
        }
        assert!(
            self.config.client.can_ack_replicas(),
            "replica_ack needs an IdemClient whose wait connections run pipelines \
             (IdemClient::standalone or cluster, or DedicatedConnections)"
        );
        self.config.replica_ack = Some(ReplicaAck { replicas, timeout });
        self
    }

    /// Largest request body buffered for the fingerprint (default: 1 MiB); larger → 413.
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.config.max_request_body = bytes;
        self
    }

    /// Largest response body buffered for storing (default: 1 MiB). A larger response
    /// is still sent, but not stored (the key is released).
    pub fn max_response_body(mut self, bytes: usize) -> Self {
        self.config.max_response_body = bytes;
        self
    }

    /// Response headers stored and replayed (default: `content-type`, `location`).
    pub fn stored_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config.stored_headers = names.into_iter().collect();
        self
    }

    /// Which statuses are stored (default: all but 5xx and 429); the others release the
    /// key so that a retry runs the handler again.
    pub fn store_policy(
        mut self,
        policy: impl Fn(StatusCode) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.config.store_policy = Arc::new(policy);
        self
    }

    /// When Redis (or the mirror) is unreachable, run the handler without
    /// idempotency instead of answering 503 (default: false, fail closed).
    /// "Unreachable" covers a node that does not answer in time or refuses
    /// the connection, and one that is down for now (loading, read-only,
    /// cluster down); a primary that answers but refuses writes
    /// (`NOREPLICAS`, `MISCONF`) still gets 503.
    pub fn fail_open(mut self, fail_open: bool) -> Self {
        self.config.fail_open = fail_open;
        self
    }

    /// How long storing a response is retried while Redis is unreachable
    /// (default: 60 s, longer than a typical restart or failover). The
    /// response is sent after the first attempts (about 150 ms, or one call
    /// timeout when an attempt waits it out); the rest
    /// goes on in the background, so that a retry gets the replay rather than
    /// running the handler again once Redis is back. Without the Postgres
    /// fence this narrows, but cannot close, the window for a second run: a
    /// retry that reaches a recovered Redis before the next attempt, after
    /// the key's lease lapsed, takes the key over. The retries are tasks of
    /// this process, not capped, and gone when it stops.
    pub fn store_retry(mut self, retry_for: Duration) -> Self {
        self.config.store_retry = retry_for;
        self
    }

    /// Upper bound of the `Retry-After` of a 409 (default: 2 s). The module answers the
    /// holder's remaining lease, which renewal keeps near the full lease: an
    /// upper bound of the wait, not an estimate.
    pub fn max_retry_after(mut self, max: Duration) -> Self {
        self.config.max_retry_after = max;
        self
    }

    /// Record what each request came to in `metrics` (default: nothing is
    /// recorded). docs/operations/metrics.md lists the series.
    pub fn metrics(mut self, metrics: LayerMetrics) -> Self {
        self.config.metrics = Some(metrics);
        self
    }

    /// The `route` label of a request's metrics, from its extensions: keep
    /// it to a handful of values (a route template, never a path with ids).
    /// With axum, the matched route:
    /// `|ext| ext.get::<MatchedPath>().map(|p| p.as_str().to_owned())`
    /// (the layer added with `Router::layer` runs after routing). Default:
    /// empty.
    pub fn metrics_route(
        mut self,
        route: impl Fn(&http::Extensions) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.config.metrics_route = Some(Arc::new(route));
        self
    }

    /// What goes into the request fingerprint (default: method, path and query, body
    /// with RFC 8785 canonical JSON).
    pub fn fingerprinter(mut self, fingerprinter: Fingerprinter) -> Self {
        self.config.fingerprinter = fingerprinter;
        self
    }
}

impl<S, C: Clone> Layer<S> for IdempotencyLayer<C> {
    type Service = Idempotency<S, C>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, Arc::new(self.config.clone()))
    }
}
