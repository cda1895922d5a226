//! The module's event counters (reported by `info`).

use std::sync::atomic::{AtomicU64, Ordering};

pub struct Counter(AtomicU64);

impl Counter {
    const fn new() -> Self {
        Counter(AtomicU64::new(0))
    }

    /// A load and a store, not a locked read-modify-write: every counter is
    /// written on Redis' main thread only (the module starts no threads), so
    /// no increment is lost, and the hot path pays no bus lock.
    pub fn incr(&self) {
        let n = self.0.load(Ordering::Relaxed);
        self.0.store(n.wrapping_add(1), Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

pub static NEW: Counter = Counter::new();
pub static IN_FLIGHT: Counter = Counter::new();
pub static REPLAY: Counter = Counter::new();
pub static MISMATCH: Counter = Counter::new();
pub static TAKEOVERS: Counter = Counter::new();
pub static COMPLETES: Counter = Counter::new();
pub static ABORTS: Counter = Counter::new();
pub static TOUCHES: Counter = Counter::new();
pub static STALE_TOKENS: Counter = Counter::new();
pub static MIRROR_ACKS: Counter = Counter::new();
pub static WAITS_REPLAY: Counter = Counter::new();
pub static WAITS_TAKEOVER: Counter = Counter::new();
pub static WAITS_TIMEOUT: Counter = Counter::new();
pub static EFFECTS_UNCONSUMED: Counter = Counter::new();
