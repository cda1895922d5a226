//! Subscriptions to keyspace and server events, and reading their payloads.

use std::ffi::{c_char, c_int, c_void, CStr};

use redis_module::raw;

use super::api;
use super::ctx::Ctx;

pub type KeyspaceCallback = extern "C" fn(
    *mut raw::RedisModuleCtx,
    c_int,
    *const c_char,
    *mut raw::RedisModuleString,
) -> c_int;

pub type ServerEventCallback =
    extern "C" fn(*mut raw::RedisModuleCtx, raw::RedisModuleEvent, u64, *mut c_void);

/// Every keyspace event class whose commands can delete, replace or re-time
/// a key's value.
pub const KEY_CHANGES: i32 = raw::REDISMODULE_NOTIFY_GENERIC
    | raw::REDISMODULE_NOTIFY_EXPIRED
    | raw::REDISMODULE_NOTIFY_EVICTED
    | raw::REDISMODULE_NOTIFY_STRING
    | raw::REDISMODULE_NOTIFY_LIST
    | raw::REDISMODULE_NOTIFY_SET
    | raw::REDISMODULE_NOTIFY_HASH
    | raw::REDISMODULE_NOTIFY_ZSET
    | raw::REDISMODULE_NOTIFY_STREAM;

pub fn subscribe_keyspace(ctx: Ctx, types: i32, callback: KeyspaceCallback) -> Result<(), String> {
    // SAFETY: a live load context.
    let status =
        unsafe { api!(RedisModule_SubscribeToKeyspaceEvents)(ctx.raw(), types, Some(callback)) };
    ok(status, "keyspace events")
}

/// Server events idem follows.
#[derive(Clone, Copy)]
pub enum ServerEvent {
    FlushDb,
    SwapDb,
    /// A child process was born or died (BGSAVE, AOF rewrite, a replica's
    /// snapshot, a module's fork).
    ForkChild,
    /// This node became a primary or a replica.
    RoleChanged,
    /// A replica came online or went offline.
    ReplicaChange,
    /// A dataset load started or ended (startup, full sync, DEBUG RELOAD).
    Loading,
}

/// The event says this node became a primary.
pub fn became_primary(event: raw::RedisModuleEvent, subevent: u64) -> bool {
    event.id == raw::REDISMODULE_EVENT_REPLICATION_ROLE_CHANGED
        && subevent == raw::REDISMODULE_EVENT_REPLROLECHANGED_NOW_MASTER
}

/// A `Loading` event's sub-event says the load ended (not failed).
pub fn loading_ended(subevent: u64) -> bool {
    subevent == raw::REDISMODULE_SUBEVENT_LOADING_ENDED
}

pub fn subscribe_server(
    ctx: Ctx,
    event: ServerEvent,
    callback: ServerEventCallback,
) -> Result<(), String> {
    let id = match event {
        ServerEvent::FlushDb => raw::REDISMODULE_EVENT_FLUSHDB,
        ServerEvent::SwapDb => raw::REDISMODULE_EVENT_SWAPDB,
        ServerEvent::ForkChild => raw::REDISMODULE_EVENT_FORK_CHILD,
        ServerEvent::RoleChanged => raw::REDISMODULE_EVENT_REPLICATION_ROLE_CHANGED,
        ServerEvent::ReplicaChange => raw::REDISMODULE_EVENT_REPLICA_CHANGE,
        ServerEvent::Loading => raw::REDISMODULE_EVENT_LOADING,
    };
    let event = raw::RedisModuleEvent { id, dataver: 1 };
    // SAFETY: a live load context; every one of these events exists since
    // Redis 6.2.
    let status =
        unsafe { api!(RedisModule_SubscribeToServerEvent)(ctx.raw(), event, Some(callback)) };
    ok(status, "server events")
}

fn ok(status: c_int, what: &str) -> Result<(), String> {
    (status == raw::REDISMODULE_OK as c_int)
        .then_some(())
        .ok_or_else(|| format!("cannot subscribe to {what}"))
}

/// A keyspace event's name (`del`, `expire`, ...).
pub fn event_name<'a>(event: *const c_char) -> &'a [u8] {
    if event.is_null() {
        return b"";
    }
    // SAFETY: Redis passes a NUL-terminated name alive for the callback.
    unsafe { CStr::from_ptr(event) }.to_bytes()
}

/// The database a finished flush emptied (`-1`: all), or None for the
/// flush's start.
pub fn flushed_db(subevent: u64, data: *mut c_void) -> Option<i32> {
    if subevent != raw::REDISMODULE_SUBEVENT_FLUSHDB_END || data.is_null() {
        return None;
    }
    // SAFETY: Redis passes a RedisModuleFlushInfo with FLUSHDB events.
    Some(unsafe { (*data.cast::<raw::RedisModuleFlushInfo>()).dbnum })
}

/// The two databases a SWAPDB exchanged.
pub fn swapped_dbs(data: *mut c_void) -> Option<(i32, i32)> {
    if data.is_null() {
        return None;
    }
    // SAFETY: Redis passes a RedisModuleSwapDbInfo with SWAPDB events.
    let info = unsafe { &*data.cast::<raw::RedisModuleSwapDbInfo>() };
    Some((info.dbnum_first, info.dbnum_second))
}

pub type InfoCallback = extern "C" fn(*mut raw::RedisModuleInfoCtx, c_int);

pub fn register_info(ctx: Ctx, callback: InfoCallback) {
    // SAFETY: a live load context.
    unsafe { api!(RedisModule_RegisterInfoFunc)(ctx.raw(), Some(callback)) };
}

/// Writes the module's INFO section: `idem_<name>:<value>` lines.
pub fn write_info_section(ctx: *mut raw::RedisModuleInfoCtx, fields: &[(&CStr, u64)]) {
    // SAFETY: the info context Redis passed to the callback. An empty
    // section name makes the section "idem"; fields get "idem_".
    unsafe {
        api!(RedisModule_InfoAddSection)(ctx, c"".as_ptr());
        for (name, value) in fields {
            api!(RedisModule_InfoAddFieldULongLong)(ctx, name.as_ptr(), *value);
        }
    }
}
