//! The mirror of each Redis node: its connection (`redis_node`), the
//! records it pulls (`record`), its pull → commit → acknowledge loop
//! (`node`); and here the set of running node mirrors, kept equal to the
//! discovered primaries:
//! a mirror starts for each new primary; a node no longer primary is
//! retired (it stops pulling, still commits and acknowledges the batches in
//! hand, and gives up on them after the grace period).

pub(crate) mod functions;
pub(crate) mod node;
pub(crate) mod record;
pub(crate) mod redis_node;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tracing::info;

use crate::config::WriterConfig;
use crate::error::{Error, Result};
use crate::mirror::node::{poll_mirror_info, NodeLoop, Shutdown};
use crate::mirror::redis_node::RedisNode;
use crate::ops::metrics::Metrics;
use crate::topology::target::Target;

/// A node's mirror tasks; `generation` tells a retired mirror still
/// finishing from a newer one on the same address.
struct Running {
    generation: u64,
    shutdown: Shutdown,
}

pub struct Mirrors {
    running: HashMap<String, Running>,
    /// Every mirror task (pull/commit/ack loop and INFO poller), returning
    /// its node's label and generation.
    tasks: JoinSet<(String, u64)>,
    next_generation: u64,
    pool: Pool,
    config: Arc<WriterConfig>,
    metrics: Arc<Metrics>,
    /// The writer's shutdown; each mirror's tokens are its children.
    shutdown: Shutdown,
    suspect_topology: Arc<Notify>,
}

impl Mirrors {
    pub fn new(
        pool: Pool,
        config: Arc<WriterConfig>,
        metrics: Arc<Metrics>,
        shutdown: Shutdown,
        suspect_topology: Arc<Notify>,
    ) -> Self {
        Mirrors {
            running: HashMap::new(),
            tasks: JoinSet::new(),
            next_generation: 0,
            pool,
            config,
            metrics,
            shutdown,
            suspect_topology,
        }
    }

    /// Starts and retires mirrors so that exactly `targets` are mirrored;
    /// `true` when the set changed.
    pub fn reconcile(&mut self, targets: Vec<Target>) -> Result<bool> {
        let retired: Vec<String> = self
            .running
            .keys()
            .filter(|label| !targets.iter().any(|t| &t.label == *label))
            .cloned()
            .collect();
        let mut changed = !retired.is_empty();
        for label in retired {
            self.retire(&label);
        }
        for target in targets {
            if !self.running.contains_key(&target.label) {
                self.start(&target)?;
                changed = true;
            }
        }
        Ok(changed)
    }

    fn start(&mut self, target: &Target) -> Result<()> {
        let shutdown = Shutdown {
            stop: self.shutdown.stop.child_token(),
            abort: self.shutdown.abort.child_token(),
        };
        let generation = self.next_generation;
        self.next_generation += 1;
        let node = self.metrics.node(&target.label);
        node.mirrored.set(1);
        let label = target.label.clone();
        let poller = poll_mirror_info(
            RedisNode::open(target, Duration::ZERO)?,
            node.clone(),
            self.metrics.clone(),
            self.config.info_interval,
            shutdown.stop.clone(),
        );
        let mirror = NodeLoop {
            pull_node: RedisNode::open(target, self.config.block)?,
            ack_node: RedisNode::open(target, Duration::ZERO)?,
            node,
            pool: self.pool.clone(),
            config: self.config.clone(),
            metrics: self.metrics.clone(),
            shutdown: shutdown.clone(),
            suspect_topology: self.suspect_topology.clone(),
        };
        let tag = (label.clone(), generation);
        let poller_tag = tag.clone();
        self.tasks.spawn(async move {
            poller.await;
            poller_tag
        });
        self.tasks.spawn(async move {
            mirror.run().await;
            tag
        });
        info!(node = label, "mirroring");
        self.running.insert(
            label,
            Running {
                generation,
                shutdown,
            },
        );
        Ok(())
    }

    /// Stops pulling from `label` now, and gives up on its batches in hand
    /// after the grace period (their records are pending on the node that
    /// serves them now).
    fn retire(&mut self, label: &str) {
        let Some(running) = self.running.remove(label) else {
            return;
        };
        info!(node = label, "no longer a primary: retiring its mirror");
        let node = self.metrics.node(label);
        node.mirrored.set(0);
        node.pending.set(-1);
        node.oldest_pending_ms.set(-1);
        running.shutdown.stop.cancel();
        let abort = running.shutdown.abort;
        let grace = self.config.shutdown_grace;
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            abort.cancel();
        });
    }

    /// Resolves when a task of a mirror that was not retired ends (a bug:
    /// they only end at shutdown); retired mirrors ending are collected.
    pub async fn unexpected_end(&mut self) -> Error {
        loop {
            match self.tasks.join_next().await {
                None => std::future::pending::<()>().await,
                Some(Ok((label, generation))) => {
                    let live = self
                        .running
                        .get(&label)
                        .is_some_and(|r| r.generation == generation);
                    if live && !self.shutdown.stop.is_cancelled() {
                        return Error::TaskEnded(format!(
                            "the mirror of {label} ended unexpectedly"
                        ));
                    }
                }
                Some(Err(join_error)) => {
                    return Error::TaskEnded(format!("a mirror task failed: {join_error}"));
                }
            }
        }
    }

    /// After the writer's shutdown was signalled: waits for every mirror to
    /// finish its batches in hand (or give up at the abort).
    pub async fn finish(mut self) {
        while let Some(ended) = self.tasks.join_next().await {
            if let Err(join_error) = ended {
                tracing::error!(%join_error, "a mirror task failed");
            }
        }
    }
}
