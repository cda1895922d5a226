//! The `INFO idem` section: counters, the outbox and the waiters.

use std::ffi::c_int;

use redis_module::raw;

use crate::ffi::call::guard;
use crate::ffi::ctx::{now_ms, Ctx};
use crate::ffi::events::{register_info, write_info_section};
use crate::stats::*;
use crate::{consumers, mirror, waiters};

pub fn register(ctx: Ctx) {
    register_info(ctx, info);
}

extern "C" fn info(ctx: *mut raw::RedisModuleInfoCtx, _for_crash_report: c_int) {
    guard("info", (), || {
        let (pending, oldest) = mirror::summary();
        let oldest_ms = oldest.map_or(0, |at| now_ms().saturating_sub(at));
        write_info_section(
            ctx,
            &[
                (c"new", NEW.get()),
                (c"in_flight", IN_FLIGHT.get()),
                (c"replay", REPLAY.get()),
                (c"mismatch", MISMATCH.get()),
                (c"takeovers", TAKEOVERS.get()),
                (c"completes", COMPLETES.get()),
                (c"aborts", ABORTS.get()),
                (c"touches", TOUCHES.get()),
                (c"stale_tokens", STALE_TOKENS.get()),
                (c"mirror_pending", pending as u64),
                (c"mirror_oldest_pending_ms", oldest_ms),
                (c"mirror_acks", MIRROR_ACKS.get()),
                (c"waiters", waiters::count() as u64),
                (c"waits_replay", WAITS_REPLAY.get()),
                (c"waits_takeover", WAITS_TAKEOVER.get()),
                (c"waits_timeout", WAITS_TIMEOUT.get()),
                (c"effects_consumed", u64::from(consumers::consumed())),
                (c"effects_unconsumed", EFFECTS_UNCONSUMED.get()),
            ],
        );
    });
}
