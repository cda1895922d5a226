//! The mirror loop for one Redis primary: pull a batch, commit it to
//! Postgres in one statement, acknowledge it, repeat; plus the poller that
//! reads the node's pending gauges.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use deadpool_postgres::Pool;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::backoff::Backoff;
use crate::config::WriterConfig;
use crate::metrics::{ErrorKind, Metrics, NodeMetrics};
use crate::postgres::{store_batch, Stored};
use crate::record::{parse_pull_reply, MirrorRecord, RecordError, Rejected};
use crate::redis_node::RedisNode;

/// The two stages of shutdown: `stop` ends pulling; `abort` (a grace period
/// later) gives up retrying the batch in hand.
#[derive(Clone)]
pub struct Shutdown {
    pub stop: CancellationToken,
    pub abort: CancellationToken,
}

pub struct NodeLoop {
    pub node: RedisNode,
    pub node_index: usize,
    pub pool: Pool,
    pub config: Arc<WriterConfig>,
    pub metrics: Arc<Metrics>,
    pub shutdown: Shutdown,
}

impl NodeLoop {
    /// Runs until shutdown. At most one batch is in hand at any time; the
    /// batch latency runs from the pull's reply to the acknowledgement.
    pub async fn run(mut self) {
        let mut redis_backoff = Backoff::new(self.config.retry_initial, self.config.retry_max);
        while !self.shutdown.stop.is_cancelled() {
            if let Err(error) = self.node.connect().await {
                self.redis_failed(ErrorKind::RedisConnect, &error);
                if !sleep_unless(&self.shutdown.stop, redis_backoff.next_delay()).await {
                    break;
                }
                continue;
            }
            let pulled = self
                .node
                .pull(self.config.batch_size, self.config.claim, self.config.block)
                .await;
            let reply = match pulled {
                Ok(reply) => reply,
                Err(error) => {
                    self.redis_failed(ErrorKind::RedisPull, &error);
                    if !sleep_unless(&self.shutdown.stop, redis_backoff.next_delay()).await {
                        break;
                    }
                    continue;
                }
            };
            let started = Instant::now();
            self.node_metrics().up.store(true, Ordering::Relaxed);
            redis_backoff.reset();
            let records = match parse_pull_reply(reply) {
                Ok((records, rejected)) => {
                    self.report_rejected(rejected);
                    records
                }
                Err(error) => {
                    self.metrics.error(ErrorKind::MalformedRecord);
                    warn!(node = self.node.label(), %error, "unreadable PULL reply");
                    continue;
                }
            };
            if records.is_empty() {
                continue;
            }
            let Some(stored) = self.commit(&records).await else {
                warn!(
                    node = self.node.label(),
                    records = records.len(),
                    "stopping with an uncommitted batch; its records stay pending in Redis"
                );
                break;
            };
            self.report_refused(&stored);
            if self.acknowledge(&stored.acks).await {
                let node = self.node_metrics();
                node.records_mirrored
                    .fetch_add(stored.acks.len() as u64, Ordering::Relaxed);
                node.rows_written
                    .fetch_add(stored.written, Ordering::Relaxed);
                node.batches.fetch_add(1, Ordering::Relaxed);
                node.batch_latency.observe(started.elapsed());
            }
        }
        info!(node = self.node.label(), "mirror loop stopped");
    }

    fn node_metrics(&self) -> &NodeMetrics {
        &self.metrics.nodes[self.node_index]
    }

    fn redis_failed(&self, kind: ErrorKind, error: &redis::RedisError) {
        self.metrics.error(kind);
        self.node_metrics().up.store(false, Ordering::Relaxed);
        warn!(node = self.node.label(), kind = kind.label(), %error, "Redis failed; retrying");
    }

    /// Commits the batch, retrying with backoff while Postgres fails. `None`
    /// when shutdown's grace ran out first.
    async fn commit(&self, records: &[MirrorRecord]) -> Option<Stored> {
        let mut backoff = Backoff::new(self.config.retry_initial, self.config.retry_max);
        loop {
            let attempt = tokio::select! {
                result = store_batch(&self.pool, records, self.config.statement_timeout) => result,
                () = self.shutdown.abort.cancelled() => return None,
            };
            match attempt {
                Ok(stored) => {
                    self.metrics.postgres_up.store(true, Ordering::Relaxed);
                    return Some(stored);
                }
                Err(error) => {
                    self.metrics.error(ErrorKind::Postgres);
                    self.metrics.postgres_up.store(false, Ordering::Relaxed);
                    warn!(
                        node = self.node.label(),
                        error = format!("{error:#}"),
                        records = records.len(),
                        "Postgres failed; retrying the batch"
                    );
                    if !sleep_unless(&self.shutdown.abort, backoff.next_delay()).await {
                        return None;
                    }
                }
            }
        }
    }

    /// Acknowledges committed records, reconnecting with backoff while Redis
    /// fails. `false` when shutdown's grace ran out first: the records stay
    /// claimed until the claim lapses, then are pulled and upserted again
    /// (a no-op) and acknowledged.
    async fn acknowledge(&mut self, acks: &[(String, i64)]) -> bool {
        let pairs: Vec<(&str, i64)> = acks.iter().map(|(k, t)| (k.as_str(), *t)).collect();
        let mut backoff = Backoff::new(self.config.retry_initial, self.config.retry_max);
        loop {
            match self.node.ack(&pairs).await {
                Ok(replies) => {
                    self.node_metrics().up.store(true, Ordering::Relaxed);
                    let superseded = replies.iter().filter(|r| **r != 1).count();
                    if superseded > 0 {
                        debug!(
                            node = self.node.label(),
                            superseded, "acks for records since expired or replaced"
                        );
                    }
                    return true;
                }
                Err(error) => {
                    self.redis_failed(ErrorKind::RedisAck, &error);
                    if !sleep_unless(&self.shutdown.abort, backoff.next_delay()).await {
                        warn!(
                            node = self.node.label(),
                            records = acks.len(),
                            "gave up acknowledging a committed batch; it will be pulled again"
                        );
                        return false;
                    }
                }
            }
        }
    }

    fn report_rejected(&self, rejected: Vec<Rejected>) {
        for Rejected { key, error } in rejected {
            let kind = match error {
                RecordError::KeyNotText | RecordError::KeyTooLong => ErrorKind::InvalidKey,
                RecordError::Malformed(_) => ErrorKind::MalformedRecord,
            };
            self.metrics.error(kind);
            warn!(
                node = self.node.label(),
                key = printable_key(&key),
                %error,
                "record cannot be mirrored; left pending"
            );
        }
    }

    fn report_refused(&self, stored: &Stored) {
        for (key, reason) in &stored.refused {
            self.metrics.error(ErrorKind::RejectedRow);
            warn!(
                node = self.node.label(),
                key = printable_key(key.as_bytes()),
                reason,
                "Postgres refused the record; left pending"
            );
        }
    }
}

/// Reads `INFO idem` every `interval` into the node's pending gauges.
pub async fn poll_mirror_info(
    mut node: RedisNode,
    node_index: usize,
    metrics: Arc<Metrics>,
    interval: Duration,
    stop: CancellationToken,
) {
    loop {
        let gauges = &metrics.nodes[node_index];
        match node.mirror_info().await {
            Ok((pending, oldest_ms)) => {
                gauges.pending.store(pending, Ordering::Relaxed);
                gauges.oldest_pending_ms.store(oldest_ms, Ordering::Relaxed);
            }
            Err(error) => {
                metrics.error(ErrorKind::RedisInfo);
                gauges.pending.store(-1, Ordering::Relaxed);
                gauges.oldest_pending_ms.store(-1, Ordering::Relaxed);
                debug!(node = node.label(), %error, "INFO idem failed");
            }
        }
        if !sleep_unless(&stop, interval).await {
            return;
        }
    }
}

/// Sleeps for `delay`; `false` (at once) when `token` is cancelled.
pub async fn sleep_unless(token: &CancellationToken, delay: Duration) -> bool {
    tokio::select! {
        () = tokio::time::sleep(delay) => true,
        () = token.cancelled() => false,
    }
}

/// A key for a log line: escaped, at most 200 characters.
fn printable_key(key: &[u8]) -> String {
    String::from_utf8_lossy(key)
        .escape_debug()
        .take(200)
        .collect()
}
