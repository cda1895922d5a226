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
use std::marker::PhantomData;
use std::ptr;

use redis_module::raw;

use super::api;
use super::call::{arg_bytes, guard};
use super::ctx::Ctx;

/// What a kind of blocked client is answered with, and how: the typed side
/// of Redis' reply, free and disconnect callbacks, so the data a client is
/// unblocked with never leaves this module as a raw pointer.
pub trait Blocking: Sized + 'static {
    /// The answer a client of this kind is unblocked with.
    type Answer: 'static;
    /// Names the callbacks in the log when one panics.
    const WHAT: &'static str;
    /// Writes the client's reply; `args` are its blocked command's
    /// arguments after the name.
    fn reply(ctx: Ctx, args: &[&[u8]], answer: &Self::Answer);
    /// The client disconnected while blocked.
    fn disconnected(ctx: Ctx, client: BlockedClient<Self>);
}

/// A client blocked by idem, until `unblock` is called once.
pub struct BlockedClient<B> {
    raw: *mut raw::RedisModuleBlockedClient,
    kind: PhantomData<fn(B)>,
}

impl<B> Clone for BlockedClient<B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for BlockedClient<B> {}
impl<B> PartialEq for BlockedClient<B> {
    fn eq(&self, other: &Self) -> bool {
        self.raw == other.raw
    }
}
impl<B> Eq for BlockedClient<B> {}
// SAFETY: only touched on Redis' main thread.
unsafe impl<B> Send for BlockedClient<B> {}

impl<B: Blocking> BlockedClient<B> {
    /// Blocks the client of `ctx` with no Redis timeout (see the module
    /// docs); `B` answers it.
    pub fn block(ctx: Ctx) -> BlockedClient<B> {
        // SAFETY: `ctx` is the calling command's context; callers checked
        // that blocking is allowed (not MULTI, Lua or DENY_BLOCKING).
        let bc = unsafe {
            api!(RedisModule_BlockClient)(
                ctx.raw(),
                Some(on_reply::<B>),
                None,
                Some(on_free::<B>),
                0,
            )
        };
        // SAFETY: `bc` was just returned by BlockClient and is not yet
        // unblocked.
        unsafe { api!(RedisModule_SetDisconnectCallback)(bc, Some(on_disconnect::<B>)) };
        BlockedClient {
            raw: bc,
            kind: PhantomData,
        }
    }

    /// Releases the client; `B::reply` answers it with `answer` (None for a
    /// client that disconnected, whose reply callback does not run).
    /// Call once, by whoever removed it from idem's registry.
    pub fn unblock(self, answer: Option<B::Answer>) {
        let data = answer.map_or(ptr::null_mut(), |a| Box::into_raw(Box::new(a)).cast());
        // SAFETY: every caller removed `self` from the registry that owns it
        // first, so this handle is unblocked exactly once; `data` is a
        // Box<B::Answer> that `on_free::<B>` frees.
        unsafe { api!(RedisModule_UnblockClient)(self.raw, data) };
    }
}

extern "C" fn on_reply<B: Blocking>(
    ctx: *mut raw::RedisModuleCtx,
    argv: *mut *mut raw::RedisModuleString,
    argc: c_int,
) -> c_int {
    let ctx = Ctx::from_raw(ctx);
    guard(B::WHAT, (), || {
        // SAFETY: a live reply-callback context.
        let data = unsafe { api!(RedisModule_GetBlockedClientPrivateData)(ctx.raw()) };
        // SAFETY: clients of kind B are unblocked with a Box<B::Answer> (or
        // null), freed by `on_free::<B>` after this callback.
        if let Some(answer) = unsafe { data.cast::<B::Answer>().as_ref() } {
            B::reply(ctx, &arg_bytes(argv, argc), answer);
        }
    });
    raw::REDISMODULE_OK as c_int
}

extern "C" fn on_free<B: Blocking>(_ctx: *mut raw::RedisModuleCtx, data: *mut c_void) {
    if !data.is_null() {
        // SAFETY: the Box<B::Answer> a client of kind B was unblocked with,
        // freed once.
        drop(unsafe { Box::from_raw(data.cast::<B::Answer>()) });
    }
}

extern "C" fn on_disconnect<B: Blocking>(
    ctx: *mut raw::RedisModuleCtx,
    bc: *mut raw::RedisModuleBlockedClient,
) {
    let ctx = Ctx::from_raw(ctx);
    guard(B::WHAT, (), || {
        B::disconnected(
            ctx,
            BlockedClient {
                raw: bc,
                kind: PhantomData,
            },
        )
    })
}

/// A module timer that owns its data until it fires (the callback takes
/// it) or is stopped (`stop` hands it back).
pub struct Timer<T> {
    id: raw::RedisModuleTimerID,
    data: PhantomData<fn(T)>,
}

impl<T> Clone for Timer<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Timer<T> {}
impl<T> PartialEq for Timer<T> {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}
impl<T> Eq for Timer<T> {}
impl<T> std::fmt::Debug for Timer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Timer").field(&self.id).finish()
    }
}

/// What a timer carries: its callback and the data handed to it.
type Armed<T> = (fn(Ctx, T), T);

impl<T: 'static> Timer<T> {
    /// Calls `callback(ctx, data)` on the main thread after `delay_ms`.
    pub fn start(ctx: Ctx, delay_ms: u64, data: T, callback: fn(Ctx, T)) -> Timer<T> {
        let delay = delay_ms.min(i64::MAX as u64) as i64;
        let armed: *mut Armed<T> = Box::into_raw(Box::new((callback, data)));
        // SAFETY: plain FFI call; `armed` is owned by the timer until it
        // fires (`on_timer::<T>` frees it) or is stopped (`stop` does).
        let id = unsafe {
            api!(RedisModule_CreateTimer)(ctx.raw(), delay, Some(on_timer::<T>), armed.cast())
        };
        Timer {
            id,
            data: PhantomData,
        }
    }

    /// Stops the timer; returns its data if it had not fired yet.
    pub fn stop(self, ctx: Ctx) -> Option<T> {
        let mut data: *mut c_void = ptr::null_mut();
        // SAFETY: a live context of this module; an unknown, stopped or
        // fired id answers ERR and hands nothing back.
        let stopped = unsafe { api!(RedisModule_StopTimer)(ctx.raw(), self.id, &mut data) };
        if stopped != raw::REDISMODULE_OK as c_int || data.is_null() {
            return None;
        }
        // SAFETY: a stopped timer hands back the Box<Armed<T>> `start` made,
        // exactly once.
        let (_, data) = *unsafe { Box::from_raw(data.cast::<Armed<T>>()) };
        Some(data)
    }
}

extern "C" fn on_timer<T: 'static>(ctx: *mut raw::RedisModuleCtx, data: *mut c_void) {
    // SAFETY: the Box<Armed<T>> `Timer::<T>::start` made; a fired timer's
    // data is ours to free, once.
    let (callback, data) = *unsafe { Box::from_raw(data.cast::<Armed<T>>()) };
    callback(Ctx::from_raw(ctx), data);
}
