//! The module's event counters (reported by `info`).

use std::sync::atomic::{AtomicU64, Ordering};

pub struct Counter(AtomicU64);

impl Counter {
    const fn new() -> Self {
        Counter(AtomicU64::new(0))
    }

    pub fn incr(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
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
