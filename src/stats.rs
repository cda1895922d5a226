//! Counters of the `INFO idem` section.

use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering};

use redis_module::{raw, Context};

use crate::{keyspace::now_ms, mirror, waiters};

pub struct Counter(AtomicU64);

impl Counter {
    const fn new() -> Self {
        Counter(AtomicU64::new(0))
    }

    pub fn incr(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    fn get(&self) -> u64 {
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

pub fn register_info(ctx: &Context) {
    unsafe {
        raw::RedisModule_RegisterInfoFunc.expect("RegisterInfoFunc")(ctx.get_raw(), Some(info))
    };
}

extern "C" fn info(ctx: *mut raw::RedisModuleInfoCtx, _for_crash_report: std::ffi::c_int) {
    crate::boundary::guard("info", (), || write_info(ctx));
}

fn write_info(ctx: *mut raw::RedisModuleInfoCtx) {
    let (pending, oldest) = mirror::summary();
    let oldest_ms = oldest.map_or(0, |at| now_ms().saturating_sub(at));
    let fields = [
        ("new", NEW.get()),
        ("in_flight", IN_FLIGHT.get()),
        ("replay", REPLAY.get()),
        ("mismatch", MISMATCH.get()),
        ("takeovers", TAKEOVERS.get()),
        ("completes", COMPLETES.get()),
        ("aborts", ABORTS.get()),
        ("touches", TOUCHES.get()),
        ("stale_tokens", STALE_TOKENS.get()),
        ("mirror_pending", pending as u64),
        ("mirror_oldest_pending_ms", oldest_ms),
        ("mirror_acks", MIRROR_ACKS.get()),
        ("waiters", waiters::count() as u64),
        ("waits_replay", WAITS_REPLAY.get()),
        ("waits_takeover", WAITS_TAKEOVER.get()),
        ("waits_timeout", WAITS_TIMEOUT.get()),
    ];
    unsafe {
        // An empty section name makes the section "idem"; fields get "idem_".
        raw::RedisModule_InfoAddSection.expect("InfoAddSection")(ctx, c"".as_ptr());
        for (name, value) in fields {
            let name = CString::new(name).expect("static field name");
            raw::RedisModule_InfoAddFieldULongLong.expect("InfoAddFieldULongLong")(
                ctx,
                name.as_ptr(),
                value,
            );
        }
    }
}
