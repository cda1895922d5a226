//! The writer's counters, gauges and histogram, kept in a prometheus-client
//! registry of their own (one per running writer) and encoded by it for
//! `/metrics`. The series names are in [`names`], documented in
//! docs/operations/metrics.md; deploy/ (alerts, dashboard) queries them.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// The series the writer exports, as a query names them (counters with
/// their `_total`). scripts/test-ops.sh reads this module: every query in
/// deploy/ must name one of these (or the middleware's).
// ANCHOR: names
pub mod names {
    /// Records committed to Postgres and acknowledged in Redis (`node`).
    pub const RECORDS_MIRRORED: &str = "idem_writer_records_mirrored_total";
    /// Rows inserted or moved to a newer token (`node`).
    pub const ROWS_WRITTEN: &str = "idem_writer_rows_written_total";
    /// Non-empty batches committed and acknowledged (`node`).
    pub const BATCHES: &str = "idem_writer_batches_total";
    /// Records pending for the mirror on the node (`node`; -1 unknown).
    pub const NODE_PENDING: &str = "idem_writer_node_pending";
    /// Age of the oldest pending record on the node, ms (`node`; -1 unknown).
    pub const NODE_OLDEST_PENDING_MS: &str = "idem_writer_node_oldest_pending_ms";
    /// 1 when the last exchange with the node succeeded (`node`).
    pub const NODE_UP: &str = "idem_writer_node_up";
    /// 1 while the node is a primary being mirrored (`node`).
    pub const NODE_MIRRORED: &str = "idem_writer_node_mirrored";
    /// Pull to acknowledgement of a non-empty batch, seconds (`node`).
    pub const BATCH_DURATION: &str = "idem_writer_batch_duration_seconds";
    /// Errors by `kind` ([`ErrorKind::label`](super::ErrorKind::label)).
    pub const ERRORS: &str = "idem_writer_errors_total";
    /// Expired rows deleted by the cleanup job.
    pub const CLEANUP_ROWS_REMOVED: &str = "idem_writer_cleanup_rows_removed_total";
    /// Completed cleanup runs.
    pub const CLEANUP_RUNS: &str = "idem_writer_cleanup_runs_total";
    /// Changes of the set of mirrored primaries (the first discovery included).
    pub const TOPOLOGY_CHANGES: &str = "idem_writer_topology_changes_total";
    /// Unix time of the last change of the set of mirrored primaries (0 never).
    pub const TOPOLOGY_LAST_CHANGE: &str = "idem_writer_topology_last_change_timestamp_seconds";
    /// 1 when the last Postgres exchange succeeded.
    pub const POSTGRES_UP: &str = "idem_writer_postgres_up";
    /// 1 for what the node runs (`node`, `backend`: module | functions |
    /// none), 0 for the others.
    pub const NODE_BACKEND: &str = "idem_writer_node_backend";
    /// Functions library: sweeps of every slot the node serves (`node`).
    pub const FUNCTIONS_SWEEPS: &str = "idem_writer_functions_sweeps_total";
    /// Functions library: outbox reads, one per slot read (`node`).
    pub const FUNCTIONS_SLOT_READS: &str = "idem_writer_functions_slot_reads_total";
    /// Functions library: records claimed with idem_mirror_claim (`node`).
    pub const FUNCTIONS_CLAIMED: &str = "idem_writer_functions_claimed_total";
}
// ANCHOR_END: names

/// What went wrong, as the `kind` label of `idem_writer_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// Connecting to a Redis node failed.
    RedisConnect,
    /// `IDEM.MIRROR.PULL` failed (connection lost, error reply).
    RedisPull,
    /// The pipelined `IDEM.MIRROR.ACK` failed; the batch will be re-pulled.
    RedisAck,
    /// `INFO idem` could not be read.
    RedisInfo,
    /// Postgres unreachable, timed out, or failed the batch as a whole.
    Postgres,
    /// A record whose key Postgres `TEXT` cannot hold (not UTF-8, NUL, too long).
    InvalidKey,
    /// A record that does not follow the PULL reply contract.
    MalformedRecord,
    /// A record Postgres refused on its own (constraint, data error).
    RejectedRow,
    /// The cleanup job failed.
    Cleanup,
    /// Discovering the primaries (cluster or Sentinel) failed.
    Topology,
}

impl ErrorKind {
    const ALL: [ErrorKind; 10] = [
        ErrorKind::RedisConnect,
        ErrorKind::RedisPull,
        ErrorKind::RedisAck,
        ErrorKind::RedisInfo,
        ErrorKind::Postgres,
        ErrorKind::InvalidKey,
        ErrorKind::MalformedRecord,
        ErrorKind::RejectedRow,
        ErrorKind::Cleanup,
        ErrorKind::Topology,
    ];

    // ANCHOR: error_kinds
    pub fn label(self) -> &'static str {
        match self {
            ErrorKind::RedisConnect => "redis_connect",
            ErrorKind::RedisPull => "redis_pull",
            ErrorKind::RedisAck => "redis_ack",
            ErrorKind::RedisInfo => "redis_info",
            ErrorKind::Postgres => "postgres",
            ErrorKind::InvalidKey => "invalid_key",
            ErrorKind::MalformedRecord => "malformed_record",
            ErrorKind::RejectedRow => "rejected_row",
            ErrorKind::Cleanup => "cleanup",
            ErrorKind::Topology => "topology",
        }
    }
}
// ANCHOR_END: error_kinds

/// Upper bounds (seconds) of the batch latency histogram buckets.
const LATENCY_BUCKETS: [f64; 13] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeLabel {
    node: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BackendLabel {
    node: String,
    backend: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

/// A histogram of durations in seconds (the batch latency).
#[derive(Debug, Clone)]
pub struct DurationHistogram(Histogram);

impl DurationHistogram {
    pub fn observe(&self, elapsed: Duration) {
        self.0.observe(elapsed.as_secs_f64());
    }
}

/// Per Redis node: handles into the registry's series labelled with it.
#[derive(Debug)]
pub struct NodeMetrics {
    /// `host:port/db`, never the password.
    pub node: String,
    /// Records committed to Postgres and acknowledged in Redis.
    pub records_mirrored: Counter,
    /// Rows inserted or moved forward (the rest were already as new).
    pub rows_written: Counter,
    pub batches: Counter,
    /// Pull → commit → ack of one non-empty batch.
    pub batch_latency: DurationHistogram,
    pub pending: Gauge,
    pub oldest_pending_ms: Gauge,
    /// 1 when the last Redis exchange of the mirror loop succeeded.
    pub up: Gauge,
    /// 1 while the node is a primary being mirrored now (0 once retired).
    pub mirrored: Gauge,
    /// Functions library: sweeps of all the node's slots.
    pub sweeps: Counter,
    /// Functions library: outbox reads.
    pub slot_reads: Counter,
    /// Functions library: records claimed.
    pub claimed: Counter,
}

/// The per-node families.
#[derive(Debug)]
struct NodeFamilies {
    records_mirrored: Family<NodeLabel, Counter>,
    rows_written: Family<NodeLabel, Counter>,
    batches: Family<NodeLabel, Counter>,
    batch_latency: Family<NodeLabel, Histogram, fn() -> Histogram>,
    pending: Family<NodeLabel, Gauge>,
    oldest_pending_ms: Family<NodeLabel, Gauge>,
    up: Family<NodeLabel, Gauge>,
    mirrored: Family<NodeLabel, Gauge>,
    backend: Family<BackendLabel, Gauge>,
    sweeps: Family<NodeLabel, Counter>,
    slot_reads: Family<NodeLabel, Counter>,
    claimed: Family<NodeLabel, Counter>,
}

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

/// All of the writer's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    families: NodeFamilies,
    /// Every node mirrored at some point, in the order first seen; a retired
    /// node keeps its counters (and resumes them if it is mirrored again).
    nodes: Mutex<Vec<Arc<NodeMetrics>>>,
    errors: Family<KindLabel, Counter>,
    /// Changes of the set of mirrored primaries, the first discovery included.
    topology_changes: Counter,
    /// When the set last changed (Unix seconds; 0 never).
    topology_changed_at: Gauge<f64, std::sync::atomic::AtomicU64>,
    pub cleanup_rows_removed: Counter,
    pub cleanup_runs: Counter,
    /// 1 when the last Postgres exchange succeeded.
    pub postgres_up: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// A counter's name as registered: prometheus-client appends `_total`.
fn counter(series: &'static str) -> &'static str {
    series.strip_suffix("_total").unwrap_or(series)
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let families = NodeFamilies {
            records_mirrored: Family::default(),
            rows_written: Family::default(),
            batches: Family::default(),
            batch_latency: Family::new_with_constructor(latency_histogram),
            pending: Family::default(),
            oldest_pending_ms: Family::default(),
            up: Family::default(),
            mirrored: Family::default(),
            backend: Family::default(),
            sweeps: Family::default(),
            slot_reads: Family::default(),
            claimed: Family::default(),
        };
        let errors = Family::<KindLabel, Counter>::default();
        for kind in ErrorKind::ALL {
            // Every kind is exported from the start, at 0.
            errors.get_or_create_owned(&KindLabel { kind: kind.label() });
        }
        let metrics = Metrics {
            registry: Registry::default(),
            families,
            nodes: Mutex::new(Vec::new()),
            errors,
            topology_changes: Counter::default(),
            topology_changed_at: Gauge::default(),
            cleanup_rows_removed: Counter::default(),
            cleanup_runs: Counter::default(),
            postgres_up: Gauge::default(),
        };
        let f = &metrics.families;
        use names::*;
        registry.register(
            counter(RECORDS_MIRRORED),
            "Records committed to Postgres and acknowledged in Redis.",
            f.records_mirrored.clone(),
        );
        registry.register(
            counter(ROWS_WRITTEN),
            "Rows inserted or moved to a newer token (the others were already current).",
            f.rows_written.clone(),
        );
        registry.register(
            counter(BATCHES),
            "Non-empty batches committed and acknowledged.",
            f.batches.clone(),
        );
        registry.register(
            NODE_PENDING,
            "Records pending for the mirror on the node (INFO idem_mirror_pending; -1 unknown).",
            f.pending.clone(),
        );
        registry.register(
            NODE_OLDEST_PENDING_MS,
            "Mirror lag on the node (INFO idem_mirror_oldest_pending_ms; -1 unknown).",
            f.oldest_pending_ms.clone(),
        );
        registry.register(
            NODE_UP,
            "1 when the last exchange with the node succeeded.",
            f.up.clone(),
        );
        registry.register(
            NODE_MIRRORED,
            "1 while the node is a primary being mirrored, 0 once retired (failover, shard removed).",
            f.mirrored.clone(),
        );
        registry.register(
            NODE_BACKEND,
            "1 for what the node runs (backend: module | functions | none), 0 for the others.",
            f.backend.clone(),
        );
        registry.register(
            counter(FUNCTIONS_SWEEPS),
            "Functions library: sweeps of every slot the node serves.",
            f.sweeps.clone(),
        );
        registry.register(
            counter(FUNCTIONS_SLOT_READS),
            "Functions library: outbox reads (one per slot read).",
            f.slot_reads.clone(),
        );
        registry.register(
            counter(FUNCTIONS_CLAIMED),
            "Functions library: records claimed with idem_mirror_claim.",
            f.claimed.clone(),
        );
        registry.register(
            BATCH_DURATION,
            "Time from pull to acknowledgement of a non-empty batch.",
            f.batch_latency.clone(),
        );
        registry.register(counter(ERRORS), "Errors by kind.", metrics.errors.clone());
        registry.register(
            counter(CLEANUP_ROWS_REMOVED),
            "Expired rows deleted by the cleanup job.",
            metrics.cleanup_rows_removed.clone(),
        );
        registry.register(
            counter(CLEANUP_RUNS),
            "Completed cleanup runs.",
            metrics.cleanup_runs.clone(),
        );
        registry.register(
            counter(TOPOLOGY_CHANGES),
            "Changes of the set of mirrored primaries (the first discovery included).",
            metrics.topology_changes.clone(),
        );
        registry.register(
            TOPOLOGY_LAST_CHANGE,
            "Unix time of the last change of the set of mirrored primaries (0 never).",
            metrics.topology_changed_at.clone(),
        );
        registry.register(
            POSTGRES_UP,
            "1 when the last Postgres exchange succeeded.",
            metrics.postgres_up.clone(),
        );
        Metrics {
            registry,
            ..metrics
        }
    }

    fn node_list(&self) -> MutexGuard<'_, Vec<Arc<NodeMetrics>>> {
        self.nodes
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The metrics of node `label`, created on first use (pending unknown).
    pub fn node(&self, label: &str) -> Arc<NodeMetrics> {
        let mut nodes = self.node_list();
        if let Some(node) = nodes.iter().find(|n| n.node == label) {
            return node.clone();
        }
        let key = NodeLabel {
            node: label.to_string(),
        };
        let f = &self.families;
        let node = Arc::new(NodeMetrics {
            node: label.to_string(),
            records_mirrored: f.records_mirrored.get_or_create_owned(&key),
            rows_written: f.rows_written.get_or_create_owned(&key),
            batches: f.batches.get_or_create_owned(&key),
            batch_latency: DurationHistogram(f.batch_latency.get_or_create_owned(&key)),
            pending: f.pending.get_or_create_owned(&key),
            oldest_pending_ms: f.oldest_pending_ms.get_or_create_owned(&key),
            up: f.up.get_or_create_owned(&key),
            mirrored: f.mirrored.get_or_create_owned(&key),
            sweeps: f.sweeps.get_or_create_owned(&key),
            slot_reads: f.slot_reads.get_or_create_owned(&key),
            claimed: f.claimed.get_or_create_owned(&key),
        });
        node.pending.set(-1);
        node.oldest_pending_ms.set(-1);
        nodes.push(node.clone());
        node
    }

    /// Sets `idem_writer_node_backend` of `node`: 1 for `backend`, 0 for
    /// the other `all`.
    pub fn set_backend(&self, node: &str, backend: &'static str, all: &[&'static str]) {
        for other in all {
            let label = BackendLabel {
                node: node.to_string(),
                backend: other,
            };
            self.families
                .backend
                .get_or_create(&label)
                .set(i64::from(*other == backend));
        }
    }

    /// A snapshot of every node's metrics.
    pub fn nodes(&self) -> Vec<Arc<NodeMetrics>> {
        self.node_list().clone()
    }

    /// Records that the set of mirrored primaries changed just now.
    pub fn topology_changed(&self) {
        self.topology_changes.inc();
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.topology_changed_at.set(now);
    }

    pub fn error(&self, kind: ErrorKind) {
        self.error_n(kind, 1);
    }

    pub fn error_n(&self, kind: ErrorKind, n: u64) {
        self.errors
            .get_or_create(&KindLabel { kind: kind.label() })
            .inc_by(n);
    }

    /// Healthy when Postgres and every mirrored node answered last time.
    pub fn unhealthy_parts(&self) -> Vec<String> {
        let mut down = Vec::new();
        if self.postgres_up.get() != 1 {
            down.push("postgres".to_string());
        }
        let nodes = self.nodes();
        let mirrored: Vec<_> = nodes.iter().filter(|n| n.mirrored.get() == 1).collect();
        if mirrored.is_empty() {
            down.push("redis (no primary known)".to_string());
        }
        for node in mirrored {
            if node.up.get() != 1 {
                down.push(format!("redis {}", node.node));
            }
        }
        down
    }

    /// The OpenMetrics text exposition (see [`CONTENT_TYPE`]).
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String does not fail");
        out
    }
}

/// The `Content-Type` of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_histogram_and_errors() {
        let metrics = Metrics::new();
        let node = metrics.node("127.0.0.1:7000/0");
        node.mirrored.set(1);
        node.records_mirrored.inc_by(5);
        node.batch_latency.observe(Duration::from_millis(3));
        node.batch_latency.observe(Duration::from_millis(30));
        metrics.error(ErrorKind::InvalidKey);
        let text = metrics.render();
        assert!(text.contains("idem_writer_records_mirrored_total{node=\"127.0.0.1:7000/0\"} 5\n"));
        assert!(text.contains(
            "idem_writer_batch_duration_seconds_bucket{le=\"0.005\",node=\"127.0.0.1:7000/0\"} 1\n"
        ));
        assert!(text.contains(
            "idem_writer_batch_duration_seconds_bucket{le=\"0.05\",node=\"127.0.0.1:7000/0\"} 2\n"
        ));
        assert!(text
            .contains("idem_writer_batch_duration_seconds_count{node=\"127.0.0.1:7000/0\"} 2\n"));
        assert!(text.contains("idem_writer_errors_total{kind=\"invalid_key\"} 1\n"));
        assert!(text.contains("idem_writer_errors_total{kind=\"postgres\"} 0\n"));
        assert!(text.contains("idem_writer_node_mirrored{node=\"127.0.0.1:7000/0\"} 1\n"));
        assert!(text.contains("idem_writer_node_pending{node=\"127.0.0.1:7000/0\"} -1\n"));
        assert_eq!(
            metrics.unhealthy_parts(),
            vec!["postgres", "redis 127.0.0.1:7000/0"]
        );
    }

    #[test]
    fn retired_nodes_keep_counters_but_leave_health() {
        let metrics = Metrics::new();
        metrics.postgres_up.set(1);
        assert_eq!(metrics.unhealthy_parts(), vec!["redis (no primary known)"]);
        let old = metrics.node("10.0.0.1:7000/0");
        old.records_mirrored.inc_by(3);
        let new = metrics.node("10.0.0.2:7000/0");
        new.mirrored.set(1);
        new.up.set(1);
        assert!(Arc::ptr_eq(&old, &metrics.node("10.0.0.1:7000/0")));
        assert!(metrics.unhealthy_parts().is_empty());
        metrics.topology_changed();
        let text = metrics.render();
        assert!(text.contains("idem_writer_node_mirrored{node=\"10.0.0.1:7000/0\"} 0\n"));
        assert!(text.contains("idem_writer_records_mirrored_total{node=\"10.0.0.1:7000/0\"} 3\n"));
        assert!(text.contains("idem_writer_topology_changes_total 1\n"));
        assert!(!text.contains("idem_writer_topology_last_change_timestamp_seconds 0"));
    }

    #[test]
    fn escapes_label_values() {
        let metrics = Metrics::new();
        metrics.node("a\"b\\c\nd").batches.inc();
        let text = metrics.render();
        assert!(text.contains("idem_writer_batches_total{node=\"a\\\"b\\\\c\\nd\"} 1\n"));
    }

    #[test]
    fn every_named_series_is_exported() {
        let metrics = Metrics::new();
        metrics
            .node("n")
            .batch_latency
            .observe(Duration::from_millis(1));
        metrics.set_backend("n", "functions", &["module", "functions", "none"]);
        let text = metrics.render();
        assert!(text.contains(&format!(
            "{}{{node=\"n\",backend=\"functions\"}} 1\n",
            names::NODE_BACKEND
        )));
        assert!(text.contains(&format!(
            "{}{{node=\"n\",backend=\"module\"}} 0\n",
            names::NODE_BACKEND
        )));
        for name in [
            names::RECORDS_MIRRORED,
            names::ROWS_WRITTEN,
            names::BATCHES,
            names::NODE_PENDING,
            names::NODE_OLDEST_PENDING_MS,
            names::NODE_UP,
            names::NODE_MIRRORED,
            names::ERRORS,
            names::CLEANUP_ROWS_REMOVED,
            names::CLEANUP_RUNS,
            names::TOPOLOGY_CHANGES,
            names::TOPOLOGY_LAST_CHANGE,
            names::POSTGRES_UP,
            names::FUNCTIONS_SWEEPS,
            names::FUNCTIONS_SLOT_READS,
            names::FUNCTIONS_CLAIMED,
        ] {
            assert!(
                text.lines()
                    .any(|l| l.starts_with(&format!("{name}{{"))
                        || l.starts_with(&format!("{name} "))),
                "{name} missing from:\n{text}"
            );
        }
        assert!(text.contains(&format!("{}_bucket{{", names::BATCH_DURATION)));
    }
}
