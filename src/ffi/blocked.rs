//! Blocked clients whose deadlines the module keeps itself, and the timers
//! behind them.
//!
//! Redis answers a timed-out module client through its timeout callback, but
//! skips that callback for a client the module has already unblocked and
//! whose reply is still queued: the client then gets no reply at all and its
//! connection is out of step (`moduleBlockedClientTimedOut` in Redis'
//! `module.c`). The same holds for `CLIENT UNBLOCK`. So idem blocks without
//! a Redis timeout and without a timeout callback, and arms a module timer
//! for the deadline instead: the only way out is `RedisModule_UnblockClient`,
//! called exactly once per client by whoever removes it from idem's own
//! registry first (the answer, the deadline timer, or the disconnect
//! callback). `CLIENT UNBLOCK` cannot interrupt these clients; closing the
//! connection can.

use std::ffi::{c_int, c_void};
use std::ptr;

use redis_module::raw;

use super::api;
use super::ctx::Ctx;

/// A client blocked by idem, until `unblock` is called once.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct BlockedClient(*mut raw::RedisModuleBlockedClient);
// SAFETY: only touched on Redis' main thread.
unsafe impl Send for BlockedClient {}

pub type ReplyCallback =
    extern "C" fn(*mut raw::RedisModuleCtx, *mut *mut raw::RedisModuleString, c_int) -> c_int;
pub type FreeCallback = extern "C" fn(*mut raw::RedisModuleCtx, *mut c_void);
pub type DisconnectCallback =
    extern "C" fn(*mut raw::RedisModuleCtx, *mut raw::RedisModuleBlockedClient);
pub type TimerCallback = extern "C" fn(*mut raw::RedisModuleCtx, *mut c_void);

impl BlockedClient {
    /// Blocks the client of `ctx` with no Redis timeout (see the module
    /// docs). `reply` answers it with the data passed to `unblock`, `free`
    /// frees that data, `disconnect` runs if the client goes away first.
    pub fn block(
        ctx: Ctx,
        reply: ReplyCallback,
        free: FreeCallback,
        disconnect: DisconnectCallback,
    ) -> BlockedClient {
        // SAFETY: `ctx` is the calling command's context; callers checked
        // that blocking is allowed (not MULTI, Lua or DENY_BLOCKING).
        let bc =
            unsafe { api!(RedisModule_BlockClient)(ctx.raw(), Some(reply), None, Some(free), 0) };
        // SAFETY: `bc` was just returned by BlockClient and is not yet
        // unblocked.
        unsafe { api!(RedisModule_SetDisconnectCallback)(bc, Some(disconnect)) };
        BlockedClient(bc)
    }

    /// Wraps the handle Redis passes to a disconnect callback.
    pub fn from_raw(bc: *mut raw::RedisModuleBlockedClient) -> BlockedClient {
        BlockedClient(bc)
    }

    /// Releases the client; its reply callback runs with `data` (null for a
    /// client that disconnected, whose reply callback does not run).
    /// Call once, by whoever removed it from idem's registry.
    pub fn unblock(self, data: *mut c_void) {
        // SAFETY: every caller removed `self` from the registry that owns it
        // first, so this handle is unblocked exactly once.
        unsafe { api!(RedisModule_UnblockClient)(self.0, data) };
    }
}

/// The data a blocked client was unblocked with, in its reply callback.
pub fn private_data(ctx: Ctx) -> *mut c_void {
    // SAFETY: a live reply-callback context.
    unsafe { api!(RedisModule_GetBlockedClientPrivateData)(ctx.raw()) }
}

/// A module timer.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Timer(raw::RedisModuleTimerID);

impl Timer {
    /// Calls `callback(ctx, data)` on the main thread after `delay_ms`.
    pub fn start(ctx: Ctx, delay_ms: u64, callback: TimerCallback, data: *mut c_void) -> Timer {
        let delay = delay_ms.min(i64::MAX as u64) as i64;
        // SAFETY: plain FFI call; `data` is owned by the timer until it fires
        // or is stopped.
        Timer(unsafe { api!(RedisModule_CreateTimer)(ctx.raw(), delay, Some(callback), data) })
    }

    /// Stops the timer; returns its data if it had not fired yet.
    pub fn stop(self, ctx: Ctx) -> Option<*mut c_void> {
        let mut data: *mut c_void = ptr::null_mut();
        // SAFETY: a live context of this module; an unknown or fired id
        // answers ERR.
        let stopped = unsafe { api!(RedisModule_StopTimer)(ctx.raw(), self.0, &mut data) };
        (stopped == raw::REDISMODULE_OK as c_int).then_some(data)
    }
}
