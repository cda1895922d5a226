//! The middleware's settings (`Config`), shared by the layer that builds them
//! and the service and flow that read them, and the default store policy.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::header::HeaderName;
use http::request::Parts;
use http::{Extensions, Method, StatusCode};

use super::metrics::{LayerMetrics, Observer, RouteFn};
use crate::fence::FenceReport;
#[cfg(feature = "postgres")]
use crate::{Fence, ReadThrough, TableLayout};
use crate::{Fingerprint, Fingerprinter, IdemClient};

type TenantFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;
type StorePolicyFn = dyn Fn(StatusCode) -> bool + Send + Sync;

pub(crate) struct Config<C> {
    pub(crate) client: IdemClient<C>,
    #[cfg(feature = "postgres")]
    pub(crate) read_through: Option<ReadThrough>,
    #[cfg(feature = "postgres")]
    pub(crate) table_layout: TableLayout,
    #[cfg(feature = "postgres")]
    pub(crate) claim_up_front: bool,
    pub(crate) methods: Vec<Method>,
    pub(crate) header: HeaderName,
    pub(crate) required: bool,
    pub(crate) tenant: Option<Arc<TenantFn>>,
    pub(crate) key_prefix: String,
    pub(crate) ttl: Duration,
    pub(crate) lease: Duration,
    pub(crate) wait: Option<Duration>,
    pub(crate) max_request_body: usize,
    pub(crate) max_response_body: usize,
    pub(crate) stored_headers: Vec<HeaderName>,
    pub(crate) store_policy: Arc<StorePolicyFn>,
    pub(crate) fail_open: bool,
    pub(crate) store_retry: Duration,
    pub(crate) fingerprinter: Fingerprinter,
    pub(crate) max_retry_after: Duration,
    pub(crate) metrics: Option<LayerMetrics>,
    pub(crate) metrics_route: Option<RouteFn>,
    pub(crate) replica_ack: Option<ReplicaAck>,
}

/// `IdempotencyLayer::replica_ack`: a stored response is answered only
/// once `replicas` replicas acknowledged it within `timeout` (checked).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReplicaAck {
    pub(crate) replicas: u32,
    pub(crate) timeout: Duration,
}

impl<C: Clone> Clone for Config<C> {
    fn clone(&self) -> Self {
        Config {
            client: self.client.clone(),
            #[cfg(feature = "postgres")]
            read_through: self.read_through.clone(),
            #[cfg(feature = "postgres")]
            table_layout: self.table_layout,
            #[cfg(feature = "postgres")]
            claim_up_front: self.claim_up_front,
            methods: self.methods.clone(),
            header: self.header.clone(),
            required: self.required,
            tenant: self.tenant.clone(),
            key_prefix: self.key_prefix.clone(),
            ttl: self.ttl,
            lease: self.lease,
            wait: self.wait,
            max_request_body: self.max_request_body,
            max_response_body: self.max_response_body,
            stored_headers: self.stored_headers.clone(),
            store_policy: self.store_policy.clone(),
            fail_open: self.fail_open,
            store_retry: self.store_retry,
            fingerprinter: self.fingerprinter.clone(),
            max_retry_after: self.max_retry_after,
            metrics: self.metrics.clone(),
            metrics_route: self.metrics_route.clone(),
            replica_ack: self.replica_ack,
        }
    }
}

impl<C> Config<C> {
    /// Whether the handler runs unprotected after the first BEGIN failed
    /// with `err`: with `fail_open`, when the store was unreachable. Not when
    /// the fence's claim made up front failed: that is the write keeping a
    /// payment single when Redis forgets, and without it the handler would
    /// run with no fence at all (a Postgres that answers but refuses the
    /// write would otherwise count as unreachable too). That is a 503.
    pub(crate) fn fails_open_on(&self, err: &crate::IdemError) -> bool {
        #[cfg(feature = "postgres")]
        if self.claim_up_front
            && self.read_through.is_some()
            && matches!(err, crate::IdemError::Postgres(_))
        {
            return false;
        }
        self.fail_open && err.is_unreachable()
    }

    /// The metrics of a request with these `extensions` (nothing recorded
    /// without `metrics`).
    pub(crate) fn observer(&self, extensions: &Extensions) -> Observer {
        Observer::new(
            self.metrics.as_ref(),
            self.metrics_route.as_ref(),
            extensions,
        )
    }

    /// The `Fence` of a request about to run (for the configured table
    /// layout and lease), and where the handler's use of it is reported.
    /// Without the `postgres` feature there is no fence and the report stays
    /// `Unused`.
    pub(crate) fn request_fence(
        &self,
        key: &str,
        token: u64,
        fingerprint: &Fingerprint,
    ) -> RequestFence {
        #[cfg(feature = "postgres")]
        {
            let (fence, report) = Fence::new(key, token, fingerprint.as_bytes(), self.ttl)
                .with_layout(self.table_layout)
                .with_lease(self.lease)
                .reporting();
            RequestFence { fence, report }
        }
        #[cfg(not(feature = "postgres"))]
        {
            let _ = (key, token, fingerprint);
            RequestFence {
                report: Arc::default(),
            }
        }
    }
}

/// A request's fence, and the report of what its handler did with it.
pub(crate) struct RequestFence {
    #[cfg(feature = "postgres")]
    pub(crate) fence: Fence,
    report: Arc<Mutex<FenceReport>>,
}

impl RequestFence {
    /// Puts the fence into the request's extensions, for the handler.
    pub(crate) fn attach(&self, extensions: &mut Extensions) {
        #[cfg(feature = "postgres")]
        extensions.insert(self.fence.clone());
        #[cfg(not(feature = "postgres"))]
        let _ = extensions;
    }

    /// What the handler did with the fence, leaving `Unused`.
    pub(crate) fn take_report(&self) -> FenceReport {
        std::mem::take(&mut *self.report.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Marks the fence's claim as made by the middleware before the handler
    /// ran, through `pool`.
    #[cfg(feature = "postgres")]
    pub(crate) fn claimed_up_front(&self, pool: deadpool_postgres::Pool) {
        *self.report.lock().unwrap_or_else(|p| p.into_inner()) = FenceReport::ClaimedUpFront(
            crate::fence::Release { pool: Some(pool) },
            std::time::Instant::now(),
        );
    }
}

/// The default store policy: everything but 5xx and 429 is stored; those
/// release the key so the client can retry.
pub fn default_store_policy(status: StatusCode) -> bool {
    !(status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS)
}
