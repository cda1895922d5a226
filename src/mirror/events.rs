//! Keyspace and server events that change records behind idem's back:
//! deletes, expiry, eviction, renames, moves, copies, overwrites, TTL
//! changes, flushes and SWAPDB. They update the outbox and the records'
//! `expires_at` in place, and wake waiters through a timer (a callback
//! outside a command must not write).

use std::ffi::{c_char, c_int, c_void};

use redis_module::raw;

use super::{flushed, forget, is_tracked, swapped, track};
use crate::ffi::call::guard;
use crate::ffi::ctx::{Ctx, Name};
use crate::ffi::events::{
    event_name, flushed_db, subscribe_keyspace, subscribe_server, swapped_dbs, ServerEvent,
    KEY_CHANGES,
};
use crate::ffi::key::Key;
use crate::waiters;

/// Subscribes to the keyspace and server events that change the outbox.
pub fn subscribe(ctx: Ctx) -> Result<(), String> {
    subscribe_keyspace(ctx, KEY_CHANGES, on_keyspace_event)?;
    subscribe_server(ctx, ServerEvent::FlushDb, on_flush)?;
    subscribe_server(ctx, ServerEvent::SwapDb, on_swapdb)
}

extern "C" fn on_keyspace_event(
    ctx: *mut raw::RedisModuleCtx,
    _type: c_int,
    event: *const c_char,
    key: *mut raw::RedisModuleString,
) -> c_int {
    guard("keyspace event", (), || {
        let (ctx, key) = (Ctx::from_raw(ctx), Name::from_raw(key));
        let (name, db, event) = (key.bytes(), ctx.db(), event_name(event));
        if matches!(event, b"expire" | b"persist") {
            // The key's TTL changed: the record's `expires_at` follows it,
            // the same way on primary, replicas and AOF replay (each applies
            // the TTL command and gets this event).
            follow_ttl(ctx, key);
            return;
        }
        // A record may arrive under a new name; other events mostly concern
        // keys idem does not track: return fast for those.
        let arrives = matches!(event, b"rename_to" | b"move_to" | b"copy_to" | b"restore");
        if !arrives && !is_tracked(db, name) && !waiters::has(db, name) {
            return;
        }
        match event {
            b"del" | b"expired" | b"evicted" | b"rename_from" | b"move_from" => forget(db, name),
            // A record under a new name has no row under that name in
            // Postgres: it is pending again (the copy callback does the same
            // for COPY). Replicas and AOF replay get the same event and do
            // the same. RESTORE keeps the dump's state: MIGRATE moves a key
            // under its own name, whose row Postgres has.
            b"rename_to" => resync(ctx, db, key, Arrival::NewName),
            // Anything else may have replaced the value: look again.
            _ => resync(ctx, db, key, Arrival::Same),
        }
        waiters::key_gone(ctx, db, name);
    });
    raw::REDISMODULE_OK as c_int
}

/// How a record came to be under the key `resync` looks at.
#[derive(PartialEq, Eq)]
enum Arrival {
    /// Its own name (a write, a restore, a move to another database).
    Same,
    /// Renamed to it: pending again (in place, as in `follow_ttl`).
    NewName,
}

/// Re-reads the key and brings its outbox entry (and the record's expiry)
/// in line.
fn resync(ctx: Ctx, db: i32, key: Name, arrival: Arrival) {
    match Key::inspect(ctx, key).record_and_expiry() {
        Some((record, expiry)) => {
            record.expires_at = expiry;
            if arrival == Arrival::NewName {
                record.mark_pending();
            }
            track(db, key.bytes(), record);
        }
        None => forget(db, key.bytes()),
    }
}

/// Sets the record's `expires_at` to the key's TTL (a module value may be
/// updated in place here: nothing is written to the keyspace or propagated).
/// Every TTL change of every key passes here: a key that holds no record
/// costs one quiet lookup and a type check. A pending record a load kept
/// although expired (an AOF's RDB preamble, a replica's load) is not in the
/// outbox; the TTL that brings it back puts it there.
fn follow_ttl(ctx: Ctx, key: Name) {
    if let Some((record, expiry)) = Key::inspect(ctx, key).record_and_expiry() {
        record.expires_at = expiry;
        let db = ctx.db();
        if record.mirror_pending() && !is_tracked(db, key.bytes()) {
            track(db, key.bytes(), record);
        }
    }
}

extern "C" fn on_flush(
    ctx: *mut raw::RedisModuleCtx,
    _eid: raw::RedisModuleEvent,
    subevent: u64,
    data: *mut c_void,
) {
    guard("flush event", (), || {
        if let Some(db) = flushed_db(subevent, data) {
            flushed(db);
            waiters::recheck_dbs(Ctx::from_raw(ctx), &[db]);
        }
    })
}

/// `SWAPDB a b`: the outboxes move with the data; waiters stay with their
/// database number and look at what is there now.
extern "C" fn on_swapdb(
    ctx: *mut raw::RedisModuleCtx,
    _eid: raw::RedisModuleEvent,
    _subevent: u64,
    data: *mut c_void,
) {
    guard("swapdb event", (), || {
        if let Some((a, b)) = swapped_dbs(data) {
            swapped(a, b);
            waiters::recheck_dbs(Ctx::from_raw(ctx), &[a, b]);
        }
    })
}
