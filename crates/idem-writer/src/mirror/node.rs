//! The mirror for one Redis primary, as three stages joined by one-slot
//! channels: the puller (its own connection, for the blocking PULL) fetches
//! the next batch while the committer upserts the current one in a single
//! statement, and the acknowledger (a second connection) acknowledges the
//! previous one. At most two batches of records are in memory (the one
//! being committed and the next one), plus the keys of one being
//! acknowledged. Redis failures are reported to the topology follower.

use std::sync::Arc;
use std::time::{Duration, Instant};

use deadpool_postgres::Pool;
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::backoff::{sleep_unless, Backoff};
use crate::config::{Backend, WriterConfig};
use crate::mirror::functions::{detect, NodeBackend, Sweeper};
use crate::mirror::record::{parse_pull_reply, MirrorRecord, RecordError, Rejected};
use crate::mirror::redis_node::RedisNode;
use crate::ops::metrics::{ErrorKind, Metrics, NodeMetrics};
use crate::postgres::{store_batch, Stored};

/// The two stages of shutdown: `stop` ends pulling; `abort` (a grace period
/// later) gives up retrying the batches in hand.
#[derive(Clone)]
pub struct Shutdown {
    pub stop: CancellationToken,
    pub abort: CancellationToken,
}

/// What the mirror of one node needs.
pub struct NodeLoop {
    /// Connection for `IDEM.MIRROR.PULL ... BLOCK`.
    pub pull_node: RedisNode,
    /// Connection for the acknowledgements, never held up by a blocked pull.
    pub ack_node: RedisNode,
    pub node: Arc<NodeMetrics>,
    pub pool: Pool,
    pub config: Arc<WriterConfig>,
    pub metrics: Arc<Metrics>,
    pub shutdown: Shutdown,
    /// Notified on every Redis failure: the primaries may have changed.
    pub suspect_topology: Arc<Notify>,
}

/// A pulled batch and when its reply arrived.
struct Batch {
    records: Vec<MirrorRecord>,
    pulled_at: Instant,
}

/// Shared by the stages.
struct Context {
    label: String,
    node: Arc<NodeMetrics>,
    config: Arc<WriterConfig>,
    metrics: Arc<Metrics>,
    shutdown: Shutdown,
    suspect_topology: Arc<Notify>,
    /// The node runs the Functions library (acknowledged with
    /// `idem_mirror_ack`).
    functions: bool,
}

impl NodeLoop {
    /// Runs until shutdown: pulling stops at `stop`; every batch already
    /// pulled is still committed and acknowledged unless `abort` comes first.
    /// First finds out what the node runs (module or Functions library).
    pub async fn run(mut self) {
        let Some(backend) = self.backend().await else {
            return;
        };
        let sweeper = (backend == NodeBackend::Functions).then(|| {
            Sweeper::new(
                self.config.sweep_interval,
                self.config.topology_interval,
                self.node.clone(),
            )
        });
        let ctx = Context {
            label: self.pull_node.label().to_string(),
            node: self.node,
            config: self.config,
            metrics: self.metrics,
            shutdown: self.shutdown,
            suspect_topology: self.suspect_topology,
            functions: backend == NodeBackend::Functions,
        };
        let (batches, batches_rx) = mpsc::channel(1);
        let (committed, committed_rx) = mpsc::channel(1);
        tokio::join!(
            pull_batches(&ctx, self.pull_node, sweeper, batches),
            commit_batches(&ctx, &self.pool, batches_rx, committed),
            acknowledge_batches(&ctx, self.ack_node, committed_rx),
        );
        info!(node = ctx.label, "mirror stopped");
    }
}

impl NodeLoop {
    /// The node's backend, as configured or as the node answers; asked
    /// again with backoff while the node is unreachable or runs neither.
    /// `None` at shutdown.
    async fn backend(&mut self) -> Option<NodeBackend> {
        let label = self.pull_node.label().to_string();
        let all = NodeBackend::ALL.map(NodeBackend::label);
        let set = |backend: NodeBackend| self.metrics.set_backend(&label, backend.label(), &all);
        match self.config.backend {
            Backend::Module => {
                set(NodeBackend::Module);
                return Some(NodeBackend::Module);
            }
            Backend::Functions => {
                set(NodeBackend::Functions);
                return Some(NodeBackend::Functions);
            }
            Backend::Auto => {}
        }
        let mut backoff = Backoff::new(self.config.retry_initial, self.config.retry_max);
        let mut warned = false;
        loop {
            match detect(&mut self.pull_node).await {
                Ok((NodeBackend::None, _)) => {
                    set(NodeBackend::None);
                    self.node.up.set(0);
                    if !warned {
                        warn!(
                            node = label,
                            "the node runs neither the idem module nor the Functions library; \
                             asking again"
                        );
                        warned = true;
                    }
                }
                Ok((backend, version)) => {
                    set(backend);
                    info!(node = label, backend = backend.label(), ?version, "backend");
                    return Some(backend);
                }
                Err(error) => {
                    self.metrics.error(ErrorKind::RedisConnect);
                    self.suspect_topology.notify_one();
                    self.node.up.set(0);
                    warn!(node = label, %error, "Redis failed; retrying");
                }
            }
            if !sleep_unless(&self.shutdown.stop, backoff.next_delay()).await {
                return None;
            }
        }
    }
}

/// The puller: reserves the channel's slot, then pulls, so that it never
/// holds more than the one batch it hands over. With a `sweeper` (the
/// Functions library) its sweep stands in for `IDEM.MIRROR.PULL`.
async fn pull_batches(
    ctx: &Context,
    mut node: RedisNode,
    mut sweeper: Option<Sweeper>,
    batches: mpsc::Sender<Batch>,
) {
    let config = &ctx.config;
    let mut backoff = Backoff::new(config.retry_initial, config.retry_max);
    while !ctx.shutdown.stop.is_cancelled() {
        let permit = tokio::select! {
            permit = batches.reserve() => match permit {
                Ok(permit) => permit,
                Err(_) => return, // the committer gave up
            },
            () = ctx.shutdown.stop.cancelled() => return,
        };
        if let Err(error) = node.connect().await {
            ctx.redis_failed(ErrorKind::RedisConnect, &error);
            if !sleep_unless(&ctx.shutdown.stop, backoff.next_delay()).await {
                return;
            }
            continue;
        }
        let pulled = match sweeper.as_mut() {
            Some(sweeper) => {
                sweeper
                    .pull(&mut node, config.batch_size, config.claim, config.block)
                    .await
            }
            None => {
                node.pull(config.batch_size, config.claim, config.block)
                    .await
            }
        };
        let reply = match pulled {
            Ok(reply) => reply,
            Err(error) => {
                ctx.redis_failed(ErrorKind::RedisPull, &error);
                if !sleep_unless(&ctx.shutdown.stop, backoff.next_delay()).await {
                    return;
                }
                continue;
            }
        };
        let pulled_at = Instant::now();
        ctx.node.up.set(1);
        backoff.reset();
        match parse_pull_reply(&reply) {
            Ok((records, rejected)) => {
                ctx.report_rejected(rejected);
                #[cfg(feature = "fault-injection")]
                if std::env::var("IDEM_WRITER_FAULT").as_deref() == Ok("ack-before-commit") {
                    let acks: Vec<(&str, i64)> =
                        records.iter().map(|r| (r.key.as_str(), r.token)).collect();
                    let _ = node.ack(&acks, ctx.functions).await;
                }
                if !records.is_empty() {
                    permit.send(Batch { records, pulled_at });
                }
            }
            Err(error) => {
                ctx.metrics.error(ErrorKind::MalformedRecord);
                warn!(node = ctx.label, %error, "unreadable PULL reply");
            }
        }
    }
}

/// Bytes of records one upsert carries at most. Postgres refuses a protocol
/// message over 1 GiB (and closes the connection, which looks like an
/// outage): a batch of large responses (`max-body-bytes` up to 512 MiB each)
/// was retried for ever and the node's mirror stalled.
const MAX_UPSERT_BYTES: usize = 128 * 1024 * 1024;

/// The committer: one upsert per batch (per `MAX_UPSERT_BYTES` of it),
/// handed on to be acknowledged.
async fn commit_batches(
    ctx: &Context,
    pool: &Pool,
    mut batches: mpsc::Receiver<Batch>,
    committed: mpsc::Sender<Committed>,
) {
    while let Some(batch) = batches.recv().await {
        for part in by_size(&batch.records, MAX_UPSERT_BYTES) {
            let Some(stored) = commit(ctx, pool, part).await else {
                warn!(
                    node = ctx.label,
                    records = part.len(),
                    "stopping with an uncommitted batch; its records stay pending in Redis"
                );
                return;
            };
            ctx.report_refused(&stored);
            let done = Committed {
                acks: stored.acks,
                written: stored.written,
                pulled_at: batch.pulled_at,
            };
            if committed.send(done).await.is_err() {
                return; // the acknowledger gave up
            }
        }
    }
}

/// `records` in order, cut into runs of at most `limit` bytes (a record
/// larger than that alone).
fn by_size(records: &[MirrorRecord], limit: usize) -> impl Iterator<Item = &[MirrorRecord]> {
    let mut rest = records;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut bytes = 0;
        let end = rest
            .iter()
            .position(|r| {
                bytes += r.size();
                bytes > limit
            })
            .unwrap_or(rest.len())
            .max(1);
        let (part, tail) = rest.split_at(end);
        rest = tail;
        Some(part)
    })
}

/// A committed batch waiting for its acknowledgements.
struct Committed {
    acks: Vec<(String, i64)>,
    written: u64,
    pulled_at: Instant,
}

/// The acknowledger: pipelined `IDEM.MIRROR.ACK`s for each committed batch,
/// off the committer's path so the next upsert starts at once.
async fn acknowledge_batches(
    ctx: &Context,
    mut node: RedisNode,
    mut committed: mpsc::Receiver<Committed>,
) {
    while let Some(done) = committed.recv().await {
        if !acknowledge(ctx, &mut node, &done.acks).await {
            return;
        }
        let metrics = &ctx.node;
        metrics.records_mirrored.inc_by(done.acks.len() as u64);
        metrics.rows_written.inc_by(done.written);
        metrics.batches.inc();
        metrics.batch_latency.observe(done.pulled_at.elapsed());
    }
}

/// Commits the batch, retrying with backoff while Postgres fails. `None`
/// when shutdown's grace ran out first.
async fn commit(ctx: &Context, pool: &Pool, records: &[MirrorRecord]) -> Option<Stored> {
    let config = &ctx.config;
    let mut backoff = Backoff::new(config.retry_initial, config.retry_max);
    loop {
        let attempt = tokio::select! {
            result = store_batch(pool, records, config.statement_timeout, config.layout.unwrap_or_default()) => result,
            () = ctx.shutdown.abort.cancelled() => return None,
        };
        match attempt {
            Ok(stored) => {
                ctx.metrics.postgres_up.set(1);
                return Some(stored);
            }
            Err(error) => {
                ctx.metrics.error(ErrorKind::Postgres);
                ctx.metrics.postgres_up.set(0);
                warn!(
                    node = ctx.label,
                    error = error.report(),
                    records = records.len(),
                    "Postgres failed; retrying the batch"
                );
                if !sleep_unless(&ctx.shutdown.abort, backoff.next_delay()).await {
                    return None;
                }
            }
        }
    }
}

/// Acknowledges committed records, reconnecting with backoff while Redis
/// fails. `false` when shutdown's grace ran out first: the records stay
/// claimed until the claim lapses, then are pulled and upserted again (a
/// no-op) and acknowledged. Records that moved to another node, or a node
/// that became a replica, need no acknowledgement here (see
/// [`RedisNode::ack`]).
async fn acknowledge(ctx: &Context, node: &mut RedisNode, acks: &[(String, i64)]) -> bool {
    let pairs: Vec<(&str, i64)> = acks.iter().map(|(k, t)| (k.as_str(), *t)).collect();
    let mut backoff = Backoff::new(ctx.config.retry_initial, ctx.config.retry_max);
    loop {
        match node.ack(&pairs, ctx.functions).await {
            Ok(acked) => {
                ctx.node.up.set(1);
                if acked.superseded > 0 {
                    debug!(
                        node = ctx.label,
                        superseded = acked.superseded,
                        "acks for records since expired or replaced"
                    );
                }
                for (key, error) in &acked.refused {
                    ctx.metrics.error(ErrorKind::RedisAck);
                    warn!(
                        node = ctx.label,
                        key = key.as_str(),
                        error = error.as_str(),
                        "a key refused its acknowledgement; the rest of the batch went on"
                    );
                }
                if acked.moved > 0 || acked.demoted {
                    info!(
                        node = ctx.label,
                        moved = acked.moved,
                        demoted = acked.demoted,
                        "records now served elsewhere are acknowledged there"
                    );
                    ctx.suspect_topology.notify_one();
                }
                return true;
            }
            Err(error) => {
                ctx.redis_failed(ErrorKind::RedisAck, &error);
                if !sleep_unless(&ctx.shutdown.abort, backoff.next_delay()).await {
                    warn!(
                        node = ctx.label,
                        records = acks.len(),
                        "gave up acknowledging a committed batch; it will be pulled again"
                    );
                    return false;
                }
            }
        }
    }
}

impl Context {
    fn redis_failed(&self, kind: ErrorKind, error: &redis::RedisError) {
        self.metrics.error(kind);
        self.suspect_topology.notify_one();
        self.node.up.set(0);
        warn!(node = self.label, kind = kind.label(), %error, "Redis failed; retrying");
    }

    fn report_rejected(&self, rejected: Vec<Rejected>) {
        for Rejected { key, error } in rejected {
            let kind = match error {
                RecordError::KeyNotText | RecordError::KeyTooLong => ErrorKind::InvalidKey,
                RecordError::Malformed(_) => ErrorKind::MalformedRecord,
            };
            self.metrics.error(kind);
            warn!(
                node = self.label,
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
                node = self.label,
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
    gauges: Arc<NodeMetrics>,
    metrics: Arc<Metrics>,
    interval: Duration,
    stop: CancellationToken,
) {
    loop {
        match node.mirror_info().await {
            Ok((pending, oldest_ms)) => {
                gauges.pending.set(pending);
                gauges.oldest_pending_ms.set(oldest_ms);
            }
            Err(error) => {
                metrics.error(ErrorKind::RedisInfo);
                gauges.pending.set(-1);
                gauges.oldest_pending_ms.set(-1);
                debug!(node = node.label(), %error, "INFO idem failed");
            }
        }
        if !sleep_unless(&stop, interval).await {
            return;
        }
    }
}

/// A key for a log line: escaped, at most 200 characters.
fn printable_key(key: &[u8]) -> String {
    String::from_utf8_lossy(key)
        .escape_debug()
        .take(200)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(body: usize) -> MirrorRecord {
        MirrorRecord {
            key: "k".into(),
            token: 1,
            fingerprint: String::new(),
            status: 200,
            body: vec![0; body],
            headers: vec![],
            created_at_ms: 0,
            completed_at_ms: 0,
            expires_at_ms: 0,
        }
    }

    /// Upserts stay under their byte limit (Postgres refuses a message over
    /// 1 GiB), keep the records' order, and a record over the limit goes
    /// alone.
    #[test]
    fn batches_are_cut_by_bytes() {
        let each = record(1000).size();
        let records: Vec<_> = (0..10).map(|_| record(1000)).collect();
        let lens: Vec<_> = by_size(&records, 3 * each).map(<[_]>::len).collect();
        assert_eq!(lens, [3, 3, 3, 1]);
        let lens: Vec<_> = by_size(&records, usize::MAX).map(<[_]>::len).collect();
        assert_eq!(lens, [10]);
        let big = [record(10), record(5000), record(10)];
        let lens: Vec<_> = by_size(&big, 2000).map(<[_]>::len).collect();
        assert_eq!(lens, [1, 1, 1]);
        assert_eq!(by_size(&[], 100).count(), 0);
        let total: usize = by_size(&records, MAX_UPSERT_BYTES).map(<[_]>::len).sum();
        assert_eq!(total, 10);
    }
}
