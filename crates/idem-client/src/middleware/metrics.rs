//! The layer's metrics, through prometheus-client: what each keyed request
//! came to, how long BEGIN and COMPLETE took, what the fence answered, the
//! responses still being stored in the background, and Redis errors by
//! kind. Registered once in the application's `Registry` by
//! [`LayerMetrics::new`] and handed to any number of layers
//! ([`IdempotencyLayer::metrics`](super::IdempotencyLayer::metrics));
//! without it the layer records nothing. The series names are in [`names`]
//! and documented in docs/operations/metrics.md.

use std::sync::Arc;
use std::time::Duration;

use http::Extensions;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::IdemError;

/// The series the layer exports, as a query names them (counters with
/// their `_total`). scripts/test-ops.sh reads this module: every query in
/// deploy/ must name one of these (or the writer's).
// ANCHOR: names
pub mod names {
    /// Requests with a key (or missing a required one) by `route` and
    /// `outcome` (the labels of this module's `Outcome`).
    pub const REQUESTS: &str = "idem_requests_total";
    /// `IDEM.BEGIN` (with read-through or the up-front claim) by `route`, seconds.
    pub const BEGIN_DURATION: &str = "idem_begin_duration_seconds";
    /// Storing the answer (`IDEM.COMPLETE`, with its retries within the
    /// request) by `route`, seconds.
    pub const COMPLETE_DURATION: &str = "idem_complete_duration_seconds";
    /// What the Postgres fence answered, by `route` and `answer`
    /// (the labels of this module's `FenceAnswer`).
    pub const FENCE: &str = "idem_fence_answers_total";
    /// Responses whose COMPLETE goes on in the background (Redis unreachable).
    pub const STORE_PENDING: &str = "idem_store_pending";
    /// Responses given up on in the background (`store_retry` ran out): their
    /// keys lapse, and a retry runs the handler again.
    pub const STORE_GAVE_UP: &str = "idem_store_gave_up_total";
    /// Failed Redis calls of the layer by `op` and `kind`.
    pub const REDIS_ERRORS: &str = "idem_redis_errors_total";
    /// Stored responses answered 503 instead because the layer's
    /// `replica_ack` was not met, by `route` and `reason` (the labels of
    /// this module's `AckFailure`).
    pub const REPLICA_ACK_FAILURES: &str = "idem_replica_ack_failures_total";
}
// ANCHOR_END: names

/// What a request with a key came to (the `outcome` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// BEGIN let the handler run.
    New,
    /// The stored answer was replayed.
    Replay,
    /// 409: another request with the key is running.
    InFlight,
    /// 422: the key was used with another request.
    Mismatch,
    /// 400: the key header is malformed, or missing where required; or
    /// the tenant a tenant source gave is missing, empty or too long.
    BadKey,
    /// 413 or 400: the body was too large or could not be read.
    BadBody,
    /// The store was unreachable and the handler ran unprotected (`fail_open`).
    FailOpen,
    /// 503: the store was unavailable.
    Unavailable,
    /// 500: BEGIN failed otherwise.
    Error,
}

// ANCHOR: outcome_labels
impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::New => "new",
            Outcome::Replay => "replay",
            Outcome::InFlight => "in_flight",
            Outcome::Mismatch => "mismatch",
            Outcome::BadKey => "bad_key",
            Outcome::BadBody => "bad_body",
            Outcome::FailOpen => "fail_open",
            Outcome::Unavailable => "unavailable",
            Outcome::Error => "error",
        }
    }
}
// ANCHOR_END: outcome_labels

/// What the fence answered for a request (the `answer` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FenceAnswer {
    /// The handler's transaction committed through the fence.
    Committed,
    /// Claimed but not committed: the claim was given up.
    Released,
    /// Another answer was found (a conflict: at the claim, or at a commit
    /// that found the key lost): replayed.
    Replay,
    /// A conflict: another holder's claim was live (409).
    InFlight,
    /// A conflict: the key's row is another request's (422).
    Mismatch,
}

// ANCHOR: fence_labels
impl FenceAnswer {
    fn label(self) -> &'static str {
        match self {
            FenceAnswer::Committed => "committed",
            FenceAnswer::Released => "released",
            FenceAnswer::Replay => "replay",
            FenceAnswer::InFlight => "in_flight",
            FenceAnswer::Mismatch => "mismatch",
        }
    }
}
// ANCHOR_END: fence_labels

/// Why a stored response was not acknowledged by enough replicas (the
/// `reason` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AckFailure {
    /// `WAIT` answered fewer replicas than asked within the timeout.
    Missed,
    /// `WAIT` failed after the COMPLETE was stored.
    WaitFailed,
    /// The COMPLETE itself could not be stored for now (unreachable,
    /// refused for now, fate unknown): nothing to acknowledge.
    NotStored,
}

// ANCHOR: ack_labels
impl AckFailure {
    fn label(self) -> &'static str {
        match self {
            AckFailure::Missed => "missed",
            AckFailure::WaitFailed => "wait_failed",
            AckFailure::NotStored => "not_stored",
        }
    }
}
// ANCHOR_END: ack_labels

/// The Redis call that failed (the `op` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RedisOp {
    Begin,
    Complete,
    Abort,
    Touch,
    /// The replica `WAIT` after a COMPLETE (`replica_ack`).
    Wait,
}

// ANCHOR: op_labels
impl RedisOp {
    fn label(self) -> &'static str {
        match self {
            RedisOp::Begin => "begin",
            RedisOp::Complete => "complete",
            RedisOp::Abort => "abort",
            RedisOp::Touch => "touch",
            RedisOp::Wait => "wait",
        }
    }
}
// ANCHOR_END: op_labels

/// The `kind` label of an error: the module's code, or what failed.
// ANCHOR: kind_labels
fn error_kind(err: &IdemError) -> &'static str {
    match err {
        IdemError::BadArg(_) => "badarg",
        IdemError::Stale(_) => "stale",
        IdemError::NotFound(_) => "notfound",
        IdemError::Completed(_) => "completed",
        IdemError::TooLarge(_) => "toolarge",
        IdemError::WrongType(_) => "wrongtype",
        IdemError::Corrupt(_) => "corrupt",
        IdemError::NoPerm(_) => "noperm",
        IdemError::Oom(_) => "oom",
        IdemError::Internal(_) => "internal",
        IdemError::Unavailable(_) => "unavailable",
        IdemError::WritesRefused(_) => "writes_refused",
        IdemError::Redis(_) => "redis",
        IdemError::UnexpectedReply(_) => "unexpected_reply",
        IdemError::NoWaitConnections => "no_wait_connections",
        IdemError::NotInstalled(_) => "not_installed",
        IdemError::Postgres(_) => "postgres",
    }
}
// ANCHOR_END: kind_labels

/// Upper bounds (seconds) of the BEGIN and COMPLETE histograms: a round
/// trip on one host is ~0.1 ms, the client's call timeout is 1 s.
const BUCKETS: [f64; 14] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

fn histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    route: Arc<str>,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabel {
    route: Arc<str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FenceLabels {
    route: Arc<str>,
    answer: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AckLabels {
    route: Arc<str>,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    op: &'static str,
    kind: &'static str,
}

/// The layer's metrics, registered in a `Registry`; cheap to clone, one
/// set for every layer of an application.
///
/// ```
/// use idem_client::middleware::prometheus_client::registry::Registry;
/// use idem_client::middleware::LayerMetrics;
/// use idem_client::{IdemClient, IdempotencyLayer, MemoryStore};
///
/// let mut registry = Registry::default();
/// let metrics = LayerMetrics::new(&mut registry);
/// let layer = IdempotencyLayer::new(IdemClient::memory(MemoryStore::new()))
///     .metrics(metrics)
///     // axum: .metrics_route(|ext| ext.get::<axum::extract::MatchedPath>().map(|p| p.as_str().to_owned()))
///     .metrics_route(|_| Some("/payments".to_owned()));
/// # let _ = layer;
/// ```
#[derive(Clone, Debug)]
pub struct LayerMetrics {
    inner: Arc<Families>,
}

#[derive(Debug)]
struct Families {
    requests: Family<OutcomeLabels, Counter>,
    begin: Family<RouteLabel, Histogram, fn() -> Histogram>,
    complete: Family<RouteLabel, Histogram, fn() -> Histogram>,
    fence: Family<FenceLabels, Counter>,
    store_pending: Gauge,
    store_gave_up: Counter,
    redis_errors: Family<ErrorLabels, Counter>,
    replica_ack_failures: Family<AckLabels, Counter>,
}

/// A counter's name as registered: prometheus-client appends `_total`.
fn counter(series: &'static str) -> &'static str {
    series.strip_suffix("_total").unwrap_or(series)
}

impl LayerMetrics {
    /// Registers the layer's series in `registry` (once per registry).
    pub fn new(registry: &mut Registry) -> Self {
        let families = Families {
            requests: Family::default(),
            begin: Family::new_with_constructor(histogram),
            complete: Family::new_with_constructor(histogram),
            fence: Family::default(),
            store_pending: Gauge::default(),
            store_gave_up: Counter::default(),
            redis_errors: Family::default(),
            replica_ack_failures: Family::default(),
        };
        registry.register(
            counter(names::REQUESTS),
            "Requests with an idempotency key by route and outcome.",
            families.requests.clone(),
        );
        registry.register(
            names::BEGIN_DURATION,
            "IDEM.BEGIN (with read-through or the fence's up-front claim), seconds.",
            families.begin.clone(),
        );
        registry.register(
            names::COMPLETE_DURATION,
            "Storing the answer (IDEM.COMPLETE with its retries in the request), seconds.",
            families.complete.clone(),
        );
        registry.register(
            counter(names::FENCE),
            "What the Postgres fence answered: committed, released, or a conflict (replay, in_flight, mismatch).",
            families.fence.clone(),
        );
        registry.register(
            names::STORE_PENDING,
            "Responses still being stored in the background while Redis is unreachable.",
            families.store_pending.clone(),
        );
        registry.register(
            counter(names::STORE_GAVE_UP),
            "Responses given up on after store_retry: a retry runs the handler again.",
            families.store_gave_up.clone(),
        );
        registry.register(
            counter(names::REDIS_ERRORS),
            "Failed Redis calls of the layer by op and kind.",
            families.redis_errors.clone(),
        );
        registry.register(
            counter(names::REPLICA_ACK_FAILURES),
            "Stored responses answered 503 because too few replicas acknowledged them (replica_ack), by route and reason.",
            families.replica_ack_failures.clone(),
        );
        LayerMetrics {
            inner: Arc::new(families),
        }
    }

    pub(crate) fn redis_error(&self, op: RedisOp, err: &IdemError) {
        self.inner
            .redis_errors
            .get_or_create(&ErrorLabels {
                op: op.label(),
                kind: error_kind(err),
            })
            .inc();
    }

    /// One more response stored in the background, until the guard drops.
    pub(crate) fn store_pending(&self) -> PendingStore {
        self.inner.store_pending.inc();
        PendingStore(self.clone())
    }

    pub(crate) fn store_gave_up(&self) {
        self.inner.store_gave_up.inc();
    }
}

/// Counts a response in `idem_store_pending` while it lives.
pub(crate) struct PendingStore(LayerMetrics);

impl Drop for PendingStore {
    fn drop(&mut self) {
        self.0.inner.store_pending.dec();
    }
}

/// Names a request's route from its extensions (axum's `MatchedPath`).
pub(crate) type RouteFn = Arc<dyn Fn(&Extensions) -> Option<String> + Send + Sync>;

/// The metrics of one request: the layer's, with the request's route; does
/// nothing when the layer has no metrics.
#[derive(Clone, Debug, Default)]
pub(crate) struct Observer(Option<(LayerMetrics, Arc<str>)>);

impl Observer {
    /// The request's observer; the route is what `route` names, or empty.
    pub(crate) fn new(
        metrics: Option<&LayerMetrics>,
        route: Option<&RouteFn>,
        extensions: &Extensions,
    ) -> Observer {
        Observer(metrics.map(|metrics| {
            let route = route
                .and_then(|route| route(extensions))
                .map_or_else(|| Arc::from(""), Arc::from);
            (metrics.clone(), route)
        }))
    }

    pub(crate) fn metrics(&self) -> Option<&LayerMetrics> {
        self.0.as_ref().map(|(metrics, _)| metrics)
    }

    pub(crate) fn outcome(&self, outcome: Outcome) {
        if let Some((metrics, route)) = &self.0 {
            metrics
                .inner
                .requests
                .get_or_create(&OutcomeLabels {
                    route: route.clone(),
                    outcome: outcome.label(),
                })
                .inc();
        }
    }

    pub(crate) fn begin(&self, took: Duration) {
        if let Some((metrics, route)) = &self.0 {
            observe(&metrics.inner.begin, route, took);
        }
    }

    pub(crate) fn complete(&self, took: Duration) {
        if let Some((metrics, route)) = &self.0 {
            observe(&metrics.inner.complete, route, took);
        }
    }

    pub(crate) fn fence(&self, answer: FenceAnswer) {
        if let Some((metrics, route)) = &self.0 {
            metrics
                .inner
                .fence
                .get_or_create(&FenceLabels {
                    route: route.clone(),
                    answer: answer.label(),
                })
                .inc();
        }
    }

    pub(crate) fn replica_ack_failed(&self, reason: AckFailure) {
        if let Some((metrics, route)) = &self.0 {
            metrics
                .inner
                .replica_ack_failures
                .get_or_create(&AckLabels {
                    route: route.clone(),
                    reason: reason.label(),
                })
                .inc();
        }
    }

    pub(crate) fn redis_error(&self, op: RedisOp, err: &IdemError) {
        if let Some(metrics) = self.metrics() {
            metrics.redis_error(op, err);
        }
    }
}

fn observe(
    family: &Family<RouteLabel, Histogram, fn() -> Histogram>,
    route: &Arc<str>,
    took: Duration,
) {
    family
        .get_or_create(&RouteLabel {
            route: route.clone(),
        })
        .observe(took.as_secs_f64());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(registry: &Registry) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
        text
    }

    #[test]
    fn records_outcomes_latency_fence_and_errors_under_their_names() {
        let mut registry = Registry::default();
        let metrics = LayerMetrics::new(&mut registry);
        let route: RouteFn = Arc::new(|_| Some("/payments".to_owned()));
        let observer = Observer::new(Some(&metrics), Some(&route), &Extensions::new());
        observer.outcome(Outcome::Replay);
        observer.outcome(Outcome::Replay);
        observer.begin(Duration::from_micros(300));
        observer.complete(Duration::from_millis(2));
        observer.fence(FenceAnswer::InFlight);
        observer.replica_ack_failed(AckFailure::Missed);
        metrics.redis_error(RedisOp::Complete, &IdemError::Oom("full".into()));
        let pending = metrics.store_pending();
        let text = render(&registry);
        assert!(text.contains("idem_requests_total{route=\"/payments\",outcome=\"replay\"} 2\n"));
        assert!(text
            .contains("idem_begin_duration_seconds_bucket{le=\"0.0005\",route=\"/payments\"} 1\n"));
        assert!(text.contains(
            "idem_begin_duration_seconds_bucket{le=\"0.00025\",route=\"/payments\"} 0\n"
        ));
        assert!(text.contains("idem_complete_duration_seconds_count{route=\"/payments\"} 1\n"));
        assert!(
            text.contains("idem_fence_answers_total{route=\"/payments\",answer=\"in_flight\"} 1\n")
        );
        assert!(text.contains("idem_redis_errors_total{op=\"complete\",kind=\"oom\"} 1\n"));
        assert!(text.contains(
            "idem_replica_ack_failures_total{route=\"/payments\",reason=\"missed\"} 1\n"
        ));
        assert!(text.contains("idem_store_pending 1\n"));
        drop(pending);
        assert!(render(&registry).contains("idem_store_pending 0\n"));
    }

    #[test]
    fn without_metrics_nothing_is_observed_and_an_unnamed_route_is_empty() {
        assert!(Observer::new(None, None, &Extensions::new())
            .metrics()
            .is_none());
        let mut registry = Registry::default();
        let metrics = LayerMetrics::new(&mut registry);
        Observer::new(Some(&metrics), None, &Extensions::new()).outcome(Outcome::New);
        assert!(render(&registry).contains("idem_requests_total{route=\"\",outcome=\"new\"} 1\n"));
    }

    #[test]
    fn every_named_series_is_exported() {
        let mut registry = Registry::default();
        let metrics = LayerMetrics::new(&mut registry);
        let observer = Observer::new(Some(&metrics), None, &Extensions::new());
        observer.outcome(Outcome::New);
        observer.begin(Duration::ZERO);
        observer.complete(Duration::ZERO);
        observer.fence(FenceAnswer::Committed);
        observer.redis_error(RedisOp::Touch, &IdemError::Stale(String::new()));
        observer.replica_ack_failed(AckFailure::NotStored);
        metrics.store_gave_up();
        let text = render(&registry);
        for name in [
            names::REQUESTS,
            names::FENCE,
            names::STORE_PENDING,
            names::STORE_GAVE_UP,
            names::REDIS_ERRORS,
            names::REPLICA_ACK_FAILURES,
        ] {
            assert!(
                text.lines()
                    .any(|l| l.starts_with(&format!("{name}{{"))
                        || l.starts_with(&format!("{name} "))),
                "{name} missing from:\n{text}"
            );
        }
        for name in [names::BEGIN_DURATION, names::COMPLETE_DURATION] {
            assert!(text.contains(&format!("{name}_bucket{{")), "{name}");
        }
    }
}
