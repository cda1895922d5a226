//! The mirror's side of a node running the Functions library
//! (`functions/idem.lua`, `spec/functions.json`) instead of the module:
//! which of the two a node runs, and the sweep that stands in for
//! `IDEM.MIRROR.PULL`.
//!
//! On the library a completed record waits in the outbox of its hash slot
//! (a sorted set scored by when it is next due), so every call stays in one
//! slot. The sweep reads, for every slot the node serves (all of them on a
//! standalone or Sentinel-managed primary, its own in a cluster), whether
//! the slot has a due member, pipelined, once per `sweep_interval`; the
//! slots that had one are read in full and claimed with `idem_mirror_claim`
//! at once, and read again at once until they come up empty. The claim
//! answers `IDEM.MIRROR.PULL`'s entries, so the rest of the mirror (commit,
//! then `idem_mirror_ack`) is the module's. A writer that dies between its
//! commit and its acknowledgement leaves the records claimed: they fall due
//! again when the claim lapses and are committed again (a no-op).

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idem_core::functions::{self as lib, outbox_for_slot, SLOTS};
use redis::{RedisError, RedisResult, ServerErrorKind, Value};

use crate::mirror::redis_node::RedisNode;
use crate::ops::metrics::NodeMetrics;

/// Slots whose due members one pipelined probe asks for.
const PROBE_PIPELINE: usize = 2048;
/// Due slots read and claimed per round trip pair.
const HOT_PIPELINE: usize = 256;
/// Shortest wait of a pull that finds nothing (a zero BLOCK would spin).
const MIN_WAIT: Duration = Duration::from_millis(50);

/// What a node runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeBackend {
    /// The module: `IDEM.MIRROR.PULL` / `IDEM.MIRROR.ACK`.
    Module,
    /// The Functions library: outbox sweep, `idem_mirror_claim` /
    /// `idem_mirror_ack`.
    Functions,
    /// Neither: nothing to mirror until one is loaded.
    None,
}

impl NodeBackend {
    /// The `backend` label of `idem_writer_node_backend`.
    pub fn label(self) -> &'static str {
        match self {
            NodeBackend::Module => "module",
            NodeBackend::Functions => "functions",
            NodeBackend::None => "none",
        }
    }

    pub const ALL: [NodeBackend; 3] = [
        NodeBackend::Module,
        NodeBackend::Functions,
        NodeBackend::None,
    ];
}

/// Asks the node: the module when `COMMAND INFO IDEM.MIRROR.PULL` names
/// the command, else the library (with its version) when `FCALL
/// idem_version 0` answers, else neither. A connection failure is an error;
/// a refusal (no FCALL on Redis 6, an ACL) only rules that backend out.
pub async fn detect(node: &mut RedisNode) -> RedisResult<(NodeBackend, Option<i64>)> {
    let info = node
        .query_cmd(redis::cmd("COMMAND").arg("INFO").arg("IDEM.MIRROR.PULL"))
        .await;
    match info {
        Ok(Value::Array(entries)) if entries.iter().any(|e| !matches!(e, Value::Nil)) => {
            return Ok((NodeBackend::Module, None));
        }
        Ok(_) => {}
        Err(e) if e.code().is_none() => return Err(e),
        Err(_) => {}
    }
    match node
        .query_cmd(redis::cmd("FCALL").arg(lib::VERSION_FN).arg(0))
        .await
    {
        Ok(Value::Int(version)) => Ok((NodeBackend::Functions, Some(version))),
        Ok(_) => Ok((NodeBackend::Functions, None)),
        Err(e) if e.code().is_none() => Err(e),
        Err(_) => Ok((NodeBackend::None, None)),
    }
}

/// Every slot's outbox name, made once.
fn outboxes() -> &'static [String] {
    static NAMES: OnceLock<Vec<String>> = OnceLock::new();
    NAMES.get_or_init(|| (0..SLOTS).map(outbox_for_slot).collect())
}

fn outbox(slot: u16) -> &'static str {
    &outboxes()[usize::from(slot % SLOTS)]
}

/// The sweep of one node's outboxes.
pub struct Sweeper {
    /// The slots the node serves, as last read.
    slots: Vec<u16>,
    /// When `slots` was read; `None`: read it before the next sweep.
    slots_read_at: Option<Instant>,
    /// How long the slots are trusted (a reshard moves them).
    slots_refresh: Duration,
    /// Not a cluster node: it serves every slot for good.
    standalone: bool,
    /// Slots that had due members, read again before anything else.
    hot: VecDeque<u16>,
    in_hot: Vec<bool>,
    /// When every slot is probed next.
    next_sweep: Instant,
    interval: Duration,
    /// The server's clock minus ours, ms: outbox scores are the server's.
    clock_offset_ms: i64,
    metrics: Arc<NodeMetrics>,
}

impl Sweeper {
    pub fn new(interval: Duration, slots_refresh: Duration, metrics: Arc<NodeMetrics>) -> Self {
        Sweeper {
            slots: Vec::new(),
            slots_read_at: None,
            slots_refresh,
            standalone: false,
            hot: VecDeque::new(),
            in_hot: vec![false; usize::from(SLOTS)],
            next_sweep: Instant::now(),
            interval,
            clock_offset_ms: 0,
            metrics,
        }
    }

    /// Stands in for `IDEM.MIRROR.PULL count CLAIM claim BLOCK block`: up
    /// to `count` claimed entries in PULL's layout, waiting up to `block`
    /// (the next sweep) when nothing is due.
    pub async fn pull(
        &mut self,
        node: &mut RedisNode,
        count: u32,
        claim: Duration,
        block: Duration,
    ) -> RedisResult<Value> {
        let deadline = Instant::now() + block.max(MIN_WAIT);
        loop {
            let stale = self
                .slots_read_at
                .is_none_or(|at| !self.standalone && at.elapsed() >= self.slots_refresh);
            if stale {
                self.read_slots(node).await?;
            }
            if Instant::now() >= self.next_sweep {
                self.probe(node).await?;
            }
            if !self.hot.is_empty() {
                // Each slot hot now at most once per pull: those that had
                // members go to the back and wait for the next pull.
                let mut round = self.hot.len();
                let mut entries = Vec::new();
                while round > 0 && entries.len() < count as usize {
                    let take = round.min(HOT_PIPELINE);
                    round -= take;
                    let budget = count as usize - entries.len();
                    entries.extend(self.claim_hot(node, take, budget, claim).await?);
                }
                if !entries.is_empty() {
                    return Ok(Value::Array(entries));
                }
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(Value::Array(Vec::new()));
            }
            tokio::time::sleep_until(self.next_sweep.min(deadline).into()).await;
        }
    }

    /// The slots this node serves: all of them outside a cluster, else the
    /// ranges `CLUSTER SLOTS` gives to `CLUSTER MYID`.
    async fn read_slots(&mut self, node: &mut RedisNode) -> RedisResult<()> {
        let slots = match node.query_cmd(redis::cmd("CLUSTER").arg("MYID")).await {
            Err(e) if e.code().is_some() => {
                self.standalone = true;
                (0..SLOTS).collect()
            }
            Err(e) => return Err(e),
            Ok(id) => {
                let id = text(&id).unwrap_or_default();
                let reply = node.query_cmd(redis::cmd("CLUSTER").arg("SLOTS")).await?;
                owned_slots(&reply, &id)
            }
        };
        let mut served = vec![false; usize::from(SLOTS)];
        for &slot in &slots {
            served[usize::from(slot)] = true;
        }
        let in_hot = &mut self.in_hot;
        self.hot.retain(|&slot| {
            let keep = served[usize::from(slot)];
            in_hot[usize::from(slot)] = keep;
            keep
        });
        self.slots = slots;
        self.slots_read_at = Some(Instant::now());
        Ok(())
    }

    /// The server's clock now, ms, from the offset of the last probe.
    fn server_now_ms(&self) -> i64 {
        local_ms() + self.clock_offset_ms
    }

    /// Asks every served slot whether it has a due member (`LIMIT 0 1`);
    /// those that do join the hot slots.
    async fn probe(&mut self, node: &mut RedisNode) -> RedisResult<()> {
        let time = node.query_cmd(&redis::cmd("TIME")).await?;
        if let Some(server_ms) = time_ms(&time) {
            self.clock_offset_ms = server_ms - local_ms();
        }
        let now_ms = self.server_now_ms();
        let slots = std::mem::take(&mut self.slots);
        let result = self.probe_slots(node, &slots, now_ms).await;
        self.slots = slots;
        self.next_sweep = Instant::now() + self.interval;
        self.metrics.sweeps.inc();
        result
    }

    async fn probe_slots(
        &mut self,
        node: &mut RedisNode,
        slots: &[u16],
        now_ms: i64,
    ) -> RedisResult<()> {
        for chunk in slots.chunks(PROBE_PIPELINE) {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            for &slot in chunk {
                pipe.add_command(due_cmd(slot, now_ms, 1));
            }
            let replies = node.query_pipe(&pipe).await?;
            self.metrics.slot_reads.inc_by(chunk.len() as u64);
            for (&slot, reply) in chunk.iter().zip(replies) {
                match reply {
                    Value::Array(members) if !members.is_empty() => self.make_hot(slot),
                    Value::ServerError(e) => self.slot_failed(e.into())?,
                    _ => {}
                }
            }
        }
        Ok(())
    }

    fn make_hot(&mut self, slot: u16) {
        let flag = &mut self.in_hot[usize::from(slot)];
        if !*flag {
            *flag = true;
            self.hot.push_back(slot);
        }
    }

    /// A slot the node no longer serves (`MOVED`/`ASK`: a reshard) makes
    /// the slots be read again; any other error fails the pull.
    fn slot_failed(&mut self, error: RedisError) -> RedisResult<()> {
        if matches!(
            error.kind(),
            redis::ErrorKind::Server(ServerErrorKind::Moved | ServerErrorKind::Ask)
        ) {
            self.slots_read_at = None;
            Ok(())
        } else {
            Err(error)
        }
    }

    /// Reads the due members of the first `take` hot slots and claims up
    /// to `budget` of them; slots that had any stay hot (at the back).
    async fn claim_hot(
        &mut self,
        node: &mut RedisNode,
        take: usize,
        budget: usize,
        claim: Duration,
    ) -> RedisResult<Vec<Value>> {
        let take = take.min(self.hot.len());
        let count = u32::try_from(budget).unwrap_or(u32::MAX);
        let slots: Vec<u16> = self.hot.drain(..take).collect();
        for &slot in &slots {
            self.in_hot[usize::from(slot)] = false;
        }
        let now_ms = self.server_now_ms();
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for &slot in &slots {
            pipe.add_command(due_cmd(slot, now_ms, count));
        }
        let replies = match node.query_pipe(&pipe).await {
            Ok(replies) => replies,
            Err(e) => {
                // Kept for the next attempt.
                for &slot in &slots {
                    self.make_hot(slot);
                }
                return Err(e);
            }
        };
        self.metrics.slot_reads.inc_by(slots.len() as u64);
        let mut budget = budget;
        let mut claims: Vec<(u16, Vec<Vec<u8>>)> = Vec::new();
        for (&slot, reply) in slots.iter().zip(replies) {
            match reply {
                Value::Array(members) if !members.is_empty() => {
                    self.make_hot(slot);
                    let n = members.len().min(budget);
                    budget -= n;
                    if n > 0 {
                        let keys = members.into_iter().take(n).filter_map(|m| match m {
                            Value::BulkString(key) => Some(key),
                            _ => None,
                        });
                        claims.push((slot, keys.collect()));
                    }
                }
                Value::ServerError(e) => self.slot_failed(e.into())?,
                _ => {}
            }
        }
        if claims.is_empty() {
            return Ok(Vec::new());
        }
        let claim_ms = u64::try_from(claim.as_millis()).unwrap_or(u64::MAX);
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for (slot, members) in &claims {
            let mut cmd = redis::cmd("FCALL");
            cmd.arg(lib::MIRROR_CLAIM)
                .arg(1 + members.len())
                .arg(outbox(*slot));
            for member in members {
                cmd.arg(member);
            }
            cmd.arg(claim_ms);
            pipe.add_command(cmd);
        }
        let replies = node.query_pipe(&pipe).await?;
        let mut entries = Vec::new();
        for reply in replies {
            match reply {
                Value::Array(claimed) => entries.extend(claimed),
                Value::ServerError(e) => self.slot_failed(e.into())?,
                other => {
                    return Err(RedisError::from((
                        redis::ErrorKind::Parse,
                        "idem_mirror_claim answered no array",
                        format!("{other:?}"),
                    )))
                }
            }
        }
        self.metrics.claimed.inc_by(entries.len() as u64);
        Ok(entries)
    }
}

/// `ZRANGEBYSCORE <outbox of slot> -inf now_ms LIMIT 0 count`.
fn due_cmd(slot: u16, now_ms: i64, count: u32) -> redis::Cmd {
    let mut cmd = redis::cmd("ZRANGEBYSCORE");
    cmd.arg(outbox(slot))
        .arg("-inf")
        .arg(now_ms)
        .arg("LIMIT")
        .arg(0)
        .arg(count);
    cmd
}

fn local_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A bulk or simple string reply as text.
fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) | Value::VerbatimString { text: s, .. } => Some(s.clone()),
        _ => None,
    }
}

fn int(value: &Value) -> Option<i64> {
    match value {
        Value::Int(n) => Some(*n),
        other => text(other)?.parse().ok(),
    }
}

/// `TIME`'s `[seconds, microseconds]` in ms.
fn time_ms(value: &Value) -> Option<i64> {
    let Value::Array(parts) = value else {
        return None;
    };
    let secs = int(parts.first()?)?;
    let micros = int(parts.get(1)?)?;
    Some(secs * 1000 + micros / 1000)
}

/// The slots `CLUSTER SLOTS` gives to the primary with node id `id`.
pub fn owned_slots(reply: &Value, id: &str) -> Vec<u16> {
    let Value::Array(ranges) = reply else {
        return Vec::new();
    };
    let mut slots = Vec::new();
    for range in ranges {
        let Value::Array(fields) = range else {
            continue;
        };
        let (Some(start), Some(end), Some(Value::Array(primary))) = (
            fields.first().and_then(int),
            fields.get(1).and_then(int),
            fields.get(2),
        ) else {
            continue;
        };
        let ours = primary.get(2).and_then(text).is_some_and(|p| p == id);
        let (Ok(start), Ok(end)) = (u16::try_from(start), u16::try_from(end)) else {
            continue;
        };
        if ours {
            slots.extend((start..=end.min(SLOTS - 1)).filter(|s| *s < SLOTS));
        }
    }
    slots.sort_unstable();
    slots.dedup();
    slots
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn reads_its_own_ranges_from_cluster_slots() {
        let node = |id: &str| Value::Array(vec![bulk("127.0.0.1"), Value::Int(7000), bulk(id)]);
        let reply = Value::Array(vec![
            Value::Array(vec![Value::Int(0), Value::Int(2), node("a"), node("r")]),
            Value::Array(vec![Value::Int(3), Value::Int(5), node("b")]),
            Value::Array(vec![Value::Int(10), Value::Int(10), node("a")]),
            Value::Int(4),
        ]);
        assert_eq!(owned_slots(&reply, "a"), vec![0, 1, 2, 10]);
        assert_eq!(owned_slots(&reply, "b"), vec![3, 4, 5]);
        assert!(owned_slots(&reply, "r").is_empty());
        assert!(owned_slots(&Value::Nil, "a").is_empty());
    }

    #[test]
    fn acks_name_the_records_outbox() {
        let cmd = crate::mirror::redis_node::library_ack_cmd("idem:{acct}:k", 7);
        let args: Vec<Vec<u8>> = cmd
            .args_iter()
            .map(|a| match a {
                redis::Arg::Simple(b) => b.to_vec(),
                _ => Vec::new(),
            })
            .collect();
        let outbox = idem_core::functions::outbox_key(b"idem:{acct}:k");
        let want: Vec<&[u8]> = vec![
            b"FCALL",
            b"idem_mirror_ack",
            b"2",
            b"idem:{acct}:k",
            outbox.as_bytes(),
            b"7",
        ];
        assert_eq!(args, want);
    }

    #[test]
    fn reads_time() {
        let reply = Value::Array(vec![bulk("1700000000"), bulk("123456")]);
        assert_eq!(time_ms(&reply), Some(1_700_000_000_123));
        assert_eq!(time_ms(&Value::Nil), None);
    }
}
