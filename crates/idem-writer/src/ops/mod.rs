//! Operating the writer: its metrics, and the HTTP endpoints (`/metrics`,
//! `/healthz`) serving them.

pub(crate) mod http;
pub(crate) mod metrics;
