//! The writer's counters and gauges, rendered as Prometheus text exposition.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

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

/// Upper bounds (seconds) of the batch latency histogram buckets.
const LATENCY_BUCKETS: [f64; 13] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// A cumulative histogram of durations.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; LATENCY_BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, elapsed: Duration) {
        let seconds = elapsed.as_secs_f64();
        for (bound, bucket) in LATENCY_BUCKETS.iter().zip(&self.buckets) {
            if seconds <= *bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        let micros = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        self.sum_micros.fetch_add(micros, Ordering::Relaxed);
    }
}

/// Per Redis node.
#[derive(Debug)]
pub struct NodeMetrics {
    /// `host:port/db`, never the password.
    pub node: String,
    /// Records committed to Postgres and acknowledged in Redis.
    pub records_mirrored: AtomicU64,
    /// Rows inserted or moved forward (the rest were already as new).
    pub rows_written: AtomicU64,
    pub batches: AtomicU64,
    /// Pull → commit → ack of one non-empty batch.
    pub batch_latency: Histogram,
    pub pending: AtomicI64,
    pub oldest_pending_ms: AtomicI64,
    /// The last Redis exchange of the mirror loop succeeded.
    pub up: AtomicBool,
    /// The node is a primary being mirrored now (false once retired).
    pub mirrored: AtomicBool,
}

impl NodeMetrics {
    fn new(node: String) -> Self {
        NodeMetrics {
            node,
            records_mirrored: AtomicU64::new(0),
            rows_written: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            batch_latency: Histogram::default(),
            pending: AtomicI64::new(-1),
            oldest_pending_ms: AtomicI64::new(-1),
            up: AtomicBool::new(false),
            mirrored: AtomicBool::new(false),
        }
    }
}

/// All of the writer's metrics.
#[derive(Debug)]
pub struct Metrics {
    /// Every node mirrored at some point, in the order first seen; a retired
    /// node keeps its counters (and resumes them if it is mirrored again).
    nodes: Mutex<Vec<Arc<NodeMetrics>>>,
    /// Changes of the set of mirrored primaries, the first discovery included.
    pub topology_changes: AtomicU64,
    /// When the set last changed (Unix ms; 0 never).
    pub topology_changed_at_ms: AtomicI64,
    errors: [AtomicU64; ErrorKind::ALL.len()],
    pub cleanup_rows_removed: AtomicU64,
    pub cleanup_runs: AtomicU64,
    /// The last Postgres exchange succeeded.
    pub postgres_up: AtomicBool,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        Metrics {
            nodes: Mutex::new(Vec::new()),
            topology_changes: AtomicU64::new(0),
            topology_changed_at_ms: AtomicI64::new(0),
            errors: Default::default(),
            cleanup_rows_removed: AtomicU64::new(0),
            cleanup_runs: AtomicU64::new(0),
            postgres_up: AtomicBool::new(false),
        }
    }

    fn node_list(&self) -> MutexGuard<'_, Vec<Arc<NodeMetrics>>> {
        self.nodes
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The metrics of node `label`, created on first use.
    pub fn node(&self, label: &str) -> Arc<NodeMetrics> {
        let mut nodes = self.node_list();
        if let Some(node) = nodes.iter().find(|n| n.node == label) {
            return node.clone();
        }
        let node = Arc::new(NodeMetrics::new(label.to_string()));
        nodes.push(node.clone());
        node
    }

    /// A snapshot of every node's metrics.
    pub fn nodes(&self) -> Vec<Arc<NodeMetrics>> {
        self.node_list().clone()
    }

    /// Records that the set of mirrored primaries changed just now.
    pub fn topology_changed(&self) {
        self.topology_changes.fetch_add(1, Ordering::Relaxed);
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        self.topology_changed_at_ms.store(now, Ordering::Relaxed);
    }

    pub fn error(&self, kind: ErrorKind) {
        self.error_n(kind, 1);
    }

    pub fn error_n(&self, kind: ErrorKind, n: u64) {
        if let Some(i) = ErrorKind::ALL.iter().position(|k| *k == kind) {
            self.errors[i].fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Healthy when Postgres and every mirrored node answered last time.
    pub fn unhealthy_parts(&self) -> Vec<String> {
        let mut down = Vec::new();
        if !self.postgres_up.load(Ordering::Relaxed) {
            down.push("postgres".to_string());
        }
        let nodes = self.nodes();
        let mirrored: Vec<_> = nodes
            .iter()
            .filter(|n| n.mirrored.load(Ordering::Relaxed))
            .collect();
        if mirrored.is_empty() {
            down.push("redis (no primary known)".to_string());
        }
        for node in mirrored {
            if !node.up.load(Ordering::Relaxed) {
                down.push(format!("redis {}", node.node));
            }
        }
        down
    }

    /// The Prometheus text exposition format (version 0.0.4).
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        let nodes = self.nodes();
        let per_node = |out: &mut String,
                        name: &str,
                        kind: &str,
                        help: &str,
                        f: &dyn Fn(&NodeMetrics) -> String| {
            header(out, name, kind, help);
            for node in &nodes {
                let _ = writeln!(out, "{name}{{node=\"{}\"}} {}", escape(&node.node), f(node));
            }
        };
        per_node(
            &mut out,
            "idem_writer_records_mirrored_total",
            "counter",
            "Records committed to Postgres and acknowledged in Redis.",
            &|n| n.records_mirrored.load(Ordering::Relaxed).to_string(),
        );
        per_node(
            &mut out,
            "idem_writer_rows_written_total",
            "counter",
            "Rows inserted or moved to a newer token (the others were already current).",
            &|n| n.rows_written.load(Ordering::Relaxed).to_string(),
        );
        per_node(
            &mut out,
            "idem_writer_batches_total",
            "counter",
            "Non-empty batches committed and acknowledged.",
            &|n| n.batches.load(Ordering::Relaxed).to_string(),
        );
        per_node(
            &mut out,
            "idem_writer_node_pending",
            "gauge",
            "Records pending for the mirror on the node (INFO idem_mirror_pending; -1 unknown).",
            &|n| n.pending.load(Ordering::Relaxed).to_string(),
        );
        per_node(
            &mut out,
            "idem_writer_node_oldest_pending_ms",
            "gauge",
            "Mirror lag on the node (INFO idem_mirror_oldest_pending_ms; -1 unknown).",
            &|n| n.oldest_pending_ms.load(Ordering::Relaxed).to_string(),
        );
        per_node(
            &mut out,
            "idem_writer_node_up",
            "gauge",
            "1 when the last exchange with the node succeeded.",
            &|n| u8::from(n.up.load(Ordering::Relaxed)).to_string(),
        );
        per_node(
            &mut out,
            "idem_writer_node_mirrored",
            "gauge",
            "1 while the node is a primary being mirrored, 0 once retired (failover, shard removed).",
            &|n| u8::from(n.mirrored.load(Ordering::Relaxed)).to_string(),
        );

        let name = "idem_writer_batch_duration_seconds";
        header(
            &mut out,
            name,
            "histogram",
            "Time from pull to acknowledgement of a non-empty batch.",
        );
        for node in &nodes {
            let label = escape(&node.node);
            let h = &node.batch_latency;
            for (bound, bucket) in LATENCY_BUCKETS.iter().zip(&h.buckets) {
                let _ = writeln!(
                    out,
                    "{name}_bucket{{node=\"{label}\",le=\"{bound}\"}} {}",
                    bucket.load(Ordering::Relaxed)
                );
            }
            let count = h.count.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{node=\"{label}\",le=\"+Inf\"}} {count}");
            let sum = h.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
            let _ = writeln!(out, "{name}_sum{{node=\"{label}\"}} {sum}");
            let _ = writeln!(out, "{name}_count{{node=\"{label}\"}} {count}");
        }

        let name = "idem_writer_errors_total";
        header(&mut out, name, "counter", "Errors by kind.");
        for (kind, count) in ErrorKind::ALL.iter().zip(&self.errors) {
            let _ = writeln!(
                out,
                "{name}{{kind=\"{}\"}} {}",
                kind.label(),
                count.load(Ordering::Relaxed)
            );
        }

        let scalar = |out: &mut String, name: &str, kind: &str, help: &str, value: String| {
            header(out, name, kind, help);
            let _ = writeln!(out, "{name} {value}");
        };
        let count = |c: &AtomicU64| c.load(Ordering::Relaxed).to_string();
        let flag = |f: &AtomicBool| u8::from(f.load(Ordering::Relaxed)).to_string();
        scalar(
            &mut out,
            "idem_writer_cleanup_rows_removed_total",
            "counter",
            "Expired rows deleted by the cleanup job.",
            count(&self.cleanup_rows_removed),
        );
        scalar(
            &mut out,
            "idem_writer_cleanup_runs_total",
            "counter",
            "Completed cleanup runs.",
            count(&self.cleanup_runs),
        );
        scalar(
            &mut out,
            "idem_writer_topology_changes_total",
            "counter",
            "Changes of the set of mirrored primaries (the first discovery included).",
            count(&self.topology_changes),
        );
        scalar(
            &mut out,
            "idem_writer_topology_last_change_timestamp_seconds",
            "gauge",
            "Unix time of the last change of the set of mirrored primaries (0 never).",
            (self.topology_changed_at_ms.load(Ordering::Relaxed) as f64 / 1e3).to_string(),
        );
        scalar(
            &mut out,
            "idem_writer_postgres_up",
            "gauge",
            "1 when the last Postgres exchange succeeded.",
            flag(&self.postgres_up),
        );
        out
    }
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Escapes a label value (backslash, double quote, newline).
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_histogram_and_errors() {
        let metrics = Metrics::new();
        let node = metrics.node("127.0.0.1:7000/0");
        node.mirrored.store(true, Ordering::Relaxed);
        node.records_mirrored.fetch_add(5, Ordering::Relaxed);
        node.batch_latency.observe(Duration::from_millis(3));
        node.batch_latency.observe(Duration::from_millis(30));
        metrics.error(ErrorKind::InvalidKey);
        let text = metrics.render();
        assert!(text.contains("idem_writer_records_mirrored_total{node=\"127.0.0.1:7000/0\"} 5\n"));
        assert!(text.contains(
            "idem_writer_batch_duration_seconds_bucket{node=\"127.0.0.1:7000/0\",le=\"0.005\"} 1\n"
        ));
        assert!(text.contains(
            "idem_writer_batch_duration_seconds_bucket{node=\"127.0.0.1:7000/0\",le=\"0.05\"} 2\n"
        ));
        assert!(text
            .contains("idem_writer_batch_duration_seconds_count{node=\"127.0.0.1:7000/0\"} 2\n"));
        assert!(text.contains("idem_writer_errors_total{kind=\"invalid_key\"} 1\n"));
        assert!(text.contains("idem_writer_errors_total{kind=\"postgres\"} 0\n"));
        assert!(text.contains("idem_writer_node_mirrored{node=\"127.0.0.1:7000/0\"} 1\n"));
        assert_eq!(
            metrics.unhealthy_parts(),
            vec!["postgres", "redis 127.0.0.1:7000/0"]
        );
    }

    #[test]
    fn retired_nodes_keep_counters_but_leave_health() {
        let metrics = Metrics::new();
        metrics.postgres_up.store(true, Ordering::Relaxed);
        assert_eq!(metrics.unhealthy_parts(), vec!["redis (no primary known)"]);
        let old = metrics.node("10.0.0.1:7000/0");
        old.records_mirrored.fetch_add(3, Ordering::Relaxed);
        let new = metrics.node("10.0.0.2:7000/0");
        new.mirrored.store(true, Ordering::Relaxed);
        new.up.store(true, Ordering::Relaxed);
        assert!(Arc::ptr_eq(&old, &metrics.node("10.0.0.1:7000/0")));
        assert!(metrics.unhealthy_parts().is_empty());
        metrics.topology_changed();
        let text = metrics.render();
        assert!(text.contains("idem_writer_node_mirrored{node=\"10.0.0.1:7000/0\"} 0\n"));
        assert!(text.contains("idem_writer_records_mirrored_total{node=\"10.0.0.1:7000/0\"} 3\n"));
        assert!(text.contains("idem_writer_topology_changes_total 1\n"));
        assert!(!text.contains("idem_writer_topology_last_change_timestamp_seconds 0\n"));
    }

    #[test]
    fn escapes_label_values() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
