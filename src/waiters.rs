//! `IDEM.BEGIN ... WAIT ms`: duplicates block on the key instead of getting
//! `in_flight`, and are answered when the holder's fate is known.
//!
//! Redis 7.0 only wakes key-blocked clients while the key exists, so the
//! waiter lists are our own: per (db, key), oldest first. `settle` looks at
//! the record and answers: completed → every waiter replays; holder gone
//! (aborted, lease lapsed, key deleted/expired/flushed) → the first waiter
//! takes over as a normal BEGIN would; lease alive → a timer re-checks when
//! it lapses. Every blocked client is unblocked exactly once: by `settle`,
//! by its WAIT timeout, or on disconnect.

use std::collections::{BTreeMap, VecDeque};
use std::ffi::{c_char, c_int, c_void};
use std::ptr;

use idem_core::engine::{self, Begin};
use idem_core::{args, Completed, Error, State};
use redis_module::raw;

use crate::boundary::{guard, Call, Reply};
use crate::commands::{reply_in_flight, reply_mismatch, reply_new, reply_replay};
use crate::keyspace::{now_ms, Key};
use crate::mirror::BlockedClient;
use crate::{effects, stats, Shared, TOKENS};

struct Waiter {
    bc: BlockedClient,
    fingerprint: [u8; 32],
    ttl_ms: u64,
    lease_ms: u64,
}

#[derive(Default)]
struct KeyWaiters {
    queue: VecDeque<Waiter>,
    /// The pending lease timer and when it fires.
    timer: Option<(raw::RedisModuleTimerID, u64)>,
}

type KeyId = (i32, Vec<u8>);

static WAITERS: Shared<BTreeMap<KeyId, KeyWaiters>> = Shared::new(BTreeMap::new());

/// What a woken waiter is answered.
enum Answer {
    New(u64),
    Replay(Completed),
    Mismatch,
    Error(Error),
}

pub fn has(db: i32, key: &[u8]) -> bool {
    let all = WAITERS.lock();
    !all.is_empty() && all.contains_key(&(db, key.to_vec()))
}

pub fn count() -> usize {
    WAITERS.lock().values().map(|w| w.queue.len()).sum()
}

/// Blocks the calling client as a waiter on its key. Returns false (the
/// caller answers `in_flight` at once) where blocking is not allowed: inside
/// MULTI, Lua, or a context that denies blocking.
pub fn wait(call: &Call, req: &args::Begin, lease_until: u64) -> bool {
    let denied = (raw::REDISMODULE_CTX_FLAGS_MULTI
        | raw::REDISMODULE_CTX_FLAGS_LUA
        | raw::REDISMODULE_CTX_FLAGS_DENY_BLOCKING
        | raw::REDISMODULE_CTX_FLAGS_REPLICATED
        | raw::REDISMODULE_CTX_FLAGS_LOADING) as c_int;
    let Some(wait_ms) = req.wait_ms.filter(|_| call.flags() & denied == 0) else {
        return false;
    };
    let bc = unsafe {
        raw::RedisModule_BlockClient.expect("BlockClient")(
            call.ctx,
            Some(on_reply),
            Some(on_timeout),
            Some(free_answer),
            wait_ms as i64,
        )
    };
    unsafe {
        raw::RedisModule_SetDisconnectCallback.expect("SetDisconnectCallback")(
            bc,
            Some(on_disconnect),
        )
    };
    let id = (call.db(), req.key.to_vec());
    let mut all = WAITERS.lock();
    let entry = all.entry(id.clone()).or_default();
    entry.queue.push_back(Waiter {
        bc: BlockedClient(bc),
        fingerprint: req.fingerprint,
        ttl_ms: req.ttl_ms,
        lease_ms: req.lease_ms,
    });
    arm_timer(call.ctx, entry, &id, lease_until);
    true
}

/// Makes sure a timer re-checks the key no later than `at`.
fn arm_timer(ctx: *mut raw::RedisModuleCtx, entry: &mut KeyWaiters, id: &KeyId, at: u64) {
    if let Some((timer, fires_at)) = entry.timer {
        if fires_at <= at {
            return;
        }
        stop_timer(ctx, timer);
    }
    let delay = at.saturating_sub(now_ms());
    let data = Box::into_raw(Box::new(id.clone())).cast::<c_void>();
    let timer = unsafe {
        raw::RedisModule_CreateTimer.expect("CreateTimer")(ctx, delay as i64, Some(on_timer), data)
    };
    entry.timer = Some((timer, now_ms() + delay));
}

fn stop_timer(ctx: *mut raw::RedisModuleCtx, timer: raw::RedisModuleTimerID) {
    let mut data: *mut c_void = ptr::null_mut();
    let stopped = unsafe { raw::RedisModule_StopTimer.expect("StopTimer")(ctx, timer, &mut data) };
    if stopped == raw::REDISMODULE_OK as c_int && !data.is_null() {
        drop(unsafe { Box::from_raw(data.cast::<KeyId>()) });
    }
}

extern "C" fn on_timer(ctx: *mut raw::RedisModuleCtx, data: *mut c_void) {
    guard("wait timer", (), || {
        let (db, key) = *unsafe { Box::from_raw(data.cast::<KeyId>()) };
        if let Some(entry) = WAITERS.lock().get_mut(&(db, key.clone())) {
            entry.timer = None;
        }
        unsafe { raw::RedisModule_SelectDb.expect("SelectDb")(ctx, db) };
        settle(ctx, db, &key);
    })
}

/// The key was deleted, expired, renamed or restored: settle from a timer,
/// since keyspace callbacks must not write.
pub fn key_gone(ctx: *mut raw::RedisModuleCtx, db: i32, key: &[u8]) {
    let id = (db, key.to_vec());
    if let Some(entry) = WAITERS.lock().get_mut(&id) {
        arm_timer(ctx, entry, &id, 0);
    }
}

/// A database (or all, `db < 0`) was flushed.
pub fn flushed(ctx: *mut raw::RedisModuleCtx, db: i32) {
    let mut all = WAITERS.lock();
    for (id, entry) in all.iter_mut().filter(|(id, _)| db < 0 || id.0 == db) {
        arm_timer(ctx, entry, id, 0);
    }
}

/// Answers the waiters of `key` as far as its record allows (see module docs).
pub fn settle(ctx: *mut raw::RedisModuleCtx, db: i32, key: &[u8]) {
    if !has(db, key) {
        return;
    }
    let id = (db, key.to_vec());
    let name = unsafe {
        raw::RedisModule_CreateString.expect("CreateString")(
            ctx,
            key.as_ptr().cast::<c_char>(),
            key.len(),
        )
    };
    loop {
        let Some(waiter) = WAITERS
            .lock()
            .get_mut(&id)
            .and_then(|e| e.queue.pop_front())
        else {
            break;
        };
        let bc = waiter.bc;
        let mut handle = Key::open(ctx, name);
        let req = args::Begin {
            key,
            fingerprint: waiter.fingerprint,
            ttl_ms: waiter.ttl_ms,
            lease_ms: waiter.lease_ms,
            wait_ms: None,
        };
        let record = match handle.record() {
            Ok(r) => r,
            Err(e) => {
                answer(bc, Answer::Error(e));
                continue;
            }
        };
        let answer_now = match engine::begin(record, &req, now_ms, &mut TOKENS.lock()) {
            Begin::Created(record) => {
                effects::replicate_put(ctx, name, &record);
                let (token, lease_until) = (record.token, lease_end(&record.state));
                handle.store(record);
                Some((Answer::New(token), Some(lease_until)))
            }
            Begin::TakenOver { token } => match handle.record() {
                Ok(Some(record)) => {
                    effects::replicate_put(ctx, name, record);
                    stats::TAKEOVERS.incr();
                    Some((Answer::New(token), Some(lease_end(&record.state))))
                }
                _ => Some((Answer::Error(Error::NotFound), None)),
            },
            Begin::InFlight { retry_after_ms } => {
                let mut all = WAITERS.lock();
                if let Some(entry) = all.get_mut(&id) {
                    entry.queue.push_front(waiter);
                    arm_timer(ctx, entry, &id, now_ms() + retry_after_ms);
                }
                None
            }
            Begin::Replay(c) => Some((Answer::Replay(c.clone()), None)),
            Begin::Mismatch => Some((Answer::Mismatch, None)),
        };
        drop(handle);
        let Some((reply, lease_until)) = answer_now else {
            break;
        };
        if matches!(reply, Answer::New(_)) {
            stats::NEW.incr();
            stats::WAITS_TAKEOVER.incr();
        }
        answer(bc, reply);
        if let Some(at) = lease_until {
            // The new holder's lease: the rest wait on it.
            if let Some(entry) = WAITERS.lock().get_mut(&id) {
                arm_timer(ctx, entry, &id, at);
            }
            break;
        }
    }
    unsafe { raw::RedisModule_FreeString.expect("FreeString")(ctx, name) };
    let mut all = WAITERS.lock();
    if all.get(&id).is_some_and(|e| e.queue.is_empty()) {
        if let Some((timer, _)) = all.remove(&id).and_then(|e| e.timer) {
            stop_timer(ctx, timer);
        }
    }
}

fn lease_end(state: &State) -> u64 {
    match state {
        State::InProgress { lease_until } => *lease_until,
        State::Completed(_) => 0,
    }
}

fn answer(bc: BlockedClient, answer: Answer) {
    if matches!(answer, Answer::Replay(_)) {
        stats::WAITS_REPLAY.incr();
        stats::REPLAY.incr();
    }
    let data = Box::into_raw(Box::new(answer)).cast::<c_void>();
    unsafe { raw::RedisModule_UnblockClient.expect("UnblockClient")(bc.0, data) };
}

/// Forgets a waiter; false when it was already answered (and so already
/// unblocked: unblocking twice would free it twice).
fn remove(bc: *mut raw::RedisModuleBlockedClient) -> bool {
    let mut all = WAITERS.lock();
    let mut found = false;
    for entry in all.values_mut() {
        let before = entry.queue.len();
        entry.queue.retain(|w| w.bc.0 != bc);
        found |= entry.queue.len() != before;
    }
    all.retain(|_, e| !e.queue.is_empty() || e.timer.is_some());
    found
}

extern "C" fn on_reply(
    ctx: *mut raw::RedisModuleCtx,
    _argv: *mut *mut raw::RedisModuleString,
    _argc: c_int,
) -> c_int {
    guard("wait reply", (), || {
        let data = unsafe {
            raw::RedisModule_GetBlockedClientPrivateData.expect("GetBlockedClientPrivateData")(ctx)
        };
        let Some(answer) = (unsafe { data.cast::<Answer>().as_ref() }) else {
            return;
        };
        let reply = Reply(ctx);
        match answer {
            Answer::New(token) => reply_new(reply, *token),
            Answer::Replay(c) => reply_replay(reply, c),
            Answer::Mismatch => reply_mismatch(reply),
            Answer::Error(e) => reply.error(e),
        }
    });
    raw::REDISMODULE_OK as c_int
}

extern "C" fn on_timeout(
    ctx: *mut raw::RedisModuleCtx,
    argv: *mut *mut raw::RedisModuleString,
    argc: c_int,
) -> c_int {
    guard("wait timeout", (), || unsafe {
        let bc = raw::RedisModule_GetBlockedClientHandle.expect("GetBlockedClientHandle")(ctx);
        if !remove(bc) {
            return; // already answered (and unblocked) by `settle`
        }
        let retry_after = if argc > 1 {
            let mut key = Key::open_read(ctx, *argv.add(1));
            match key.record() {
                Ok(Some(r)) => lease_end(&r.state).saturating_sub(now_ms()),
                _ => 0,
            }
        } else {
            0
        };
        stats::IN_FLIGHT.incr();
        stats::WAITS_TIMEOUT.incr();
        reply_in_flight(Reply(ctx), retry_after.max(1));
        raw::RedisModule_UnblockClient.expect("UnblockClient")(bc, ptr::null_mut());
    });
    raw::REDISMODULE_OK as c_int
}

extern "C" fn on_disconnect(
    _ctx: *mut raw::RedisModuleCtx,
    bc: *mut raw::RedisModuleBlockedClient,
) {
    guard("wait disconnect", (), || {
        if remove(bc) {
            unsafe { raw::RedisModule_UnblockClient.expect("UnblockClient")(bc, ptr::null_mut()) };
        }
    })
}

extern "C" fn free_answer(_ctx: *mut raw::RedisModuleCtx, data: *mut c_void) {
    if !data.is_null() {
        drop(unsafe { Box::from_raw(data.cast::<Answer>()) });
    }
}
