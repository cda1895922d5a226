//! Tower/axum middleware implementing the `Idempotency-Key` header (IETF
//! httpapi draft, Stripe semantics) on top of the idem module.

mod begin;
mod body;
mod config;
mod flow;
mod key;
mod layer;
mod metrics;
mod problem;
mod service;
mod store;

pub use body::{BoxError, IdemBody};
pub use config::default_store_policy;
pub use key::{
    check_tenant, parse_value as parse_key_header, redis_key, KeyError, TenantError, MAX_KEY_BYTES,
    MAX_TENANT_BYTES,
};
pub use layer::IdempotencyLayer;
pub use metrics::{names as metric_names, LayerMetrics};
pub use problem::{replay_response, Problem, IDEMPOTENT_REPLAYED};
/// The prometheus-client the layer records into ([`LayerMetrics::new`] takes its `Registry`).
pub use prometheus_client;
pub use service::{Idempotency, ResponseFuture};
