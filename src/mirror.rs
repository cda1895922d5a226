//! The mirror's side of the module: the per-database index of completed
//! records not yet in Postgres, `IDEM.MIRROR.PULL` / `IDEM.MIRROR.ACK`, and
//! keeping the index true when keys are loaded, deleted, renamed or flushed.

use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr;

use idem_core::pending::PendingIndex;
use idem_core::{args, engine, Error, Record};
use redis_module::{raw, Context};

use crate::boundary::{bytes, guard, Call, Reply};
use crate::keyspace::{now_ms, Key};
use crate::{commands, config, stats, waiters, Shared, TOKENS};

/// Pending records by database.
static PENDING: Shared<BTreeMap<i32, PendingIndex>> = Shared::new(BTreeMap::new());

/// Pullers blocked in `IDEM.MIRROR.PULL ... BLOCK`, with their database.
static PULLERS: Shared<Vec<(BlockedClient, i32)>> = Shared::new(Vec::new());

#[derive(Clone, Copy, PartialEq, Eq)]
pub struct BlockedClient(pub *mut raw::RedisModuleBlockedClient);
// SAFETY: only touched on Redis' main thread.
unsafe impl Send for BlockedClient {}

/// Brings the index in line with `record`, now stored under `key`.
pub fn track(db: i32, key: &[u8], record: &Record) {
    match record.completed() {
        Some(c) if record.mirror_pending() => {
            PENDING
                .lock()
                .entry(db)
                .or_default()
                .insert(key, record.token, c.completed_at);
            wake_pullers();
        }
        _ => forget(db, key),
    }
}

pub fn forget(db: i32, key: &[u8]) {
    if let Some(index) = PENDING.lock().get_mut(&db) {
        index.remove(key);
    }
}

/// Called for each record read by rdb_load (RDB, full sync, RESTORE).
pub fn loaded(io: *mut raw::RedisModuleIO, record: &Record) {
    TOKENS.lock().observe(record.token);
    if !record.mirror_pending() {
        return;
    }
    unsafe {
        let name = raw::RedisModule_GetKeyNameFromIO.expect("GetKeyNameFromIO")(io);
        if !name.is_null() {
            let db = raw::RedisModule_GetDbIdFromIO.expect("GetDbIdFromIO")(io);
            track(db, bytes(name), record);
        }
    }
}

/// (pending records, completion time of the oldest) over all databases.
pub fn summary() -> (usize, Option<u64>) {
    let pending = PENDING.lock();
    let count = pending.values().map(PendingIndex::len).sum();
    let oldest = pending
        .values()
        .filter_map(PendingIndex::oldest_completed_at)
        .min();
    (count, oldest)
}

/// `IDEM.MIRROR.PULL count [CLAIM ms] [BLOCK ms]`
pub fn pull(call: &Call) -> Result<(), Error> {
    let req = args::pull(&call.args, config::mirror_claim_ms())?;
    let db = call.db();
    let batch = claim(call.ctx, db, &req);
    let may_block = call.flags()
        & (raw::REDISMODULE_CTX_FLAGS_MULTI
            | raw::REDISMODULE_CTX_FLAGS_LUA
            | raw::REDISMODULE_CTX_FLAGS_DENY_BLOCKING) as c_int
        == 0;
    match req.block_ms {
        Some(ms) if ms > 0 && batch.is_empty() && may_block => {
            let next = PENDING
                .lock()
                .get(&db)
                .and_then(PendingIndex::next_available_at);
            let timeout = next.map_or(ms, |at| ms.min(at.saturating_sub(now_ms()).max(1)));
            block_puller(call.ctx, db, timeout);
        }
        _ => reply_batch(call.reply(), &batch),
    }
    Ok(())
}

/// Claims up to `count` records; drops index entries whose record is gone,
/// replaced or already mirrored.
fn claim<'a>(
    ctx: *mut raw::RedisModuleCtx,
    db: i32,
    req: &args::Pull,
) -> Vec<(Vec<u8>, &'a Record)> {
    let now = now_ms();
    let mut out = Vec::new();
    loop {
        let want = req.count - out.len();
        let claimed = match PENDING.lock().get_mut(&db) {
            Some(index) => index.claim(now, want, req.claim_ms),
            None => Vec::new(),
        };
        if claimed.is_empty() {
            return out;
        }
        for (name, token) in claimed {
            let rec = with_key(ctx, &name, |key| {
                // SAFETY: the value outlives this command: nothing else runs
                // on the main thread before the reply is written.
                key.record()
                    .ok()
                    .flatten()
                    .map(|r| unsafe { &*(r as *const Record) })
            });
            match rec {
                Some(r) if r.token == token && r.mirror_pending() => out.push((name, r)),
                _ => forget(db, &name),
            }
        }
        if out.len() == req.count {
            return out;
        }
    }
}

/// Opens the key named `name` in the context's database.
fn with_key<T>(ctx: *mut raw::RedisModuleCtx, name: &[u8], f: impl FnOnce(&mut Key) -> T) -> T {
    unsafe {
        let s = raw::RedisModule_CreateString.expect("CreateString")(
            ctx,
            name.as_ptr().cast::<c_char>(),
            name.len(),
        );
        let out = f(&mut Key::open_read(ctx, s));
        raw::RedisModule_FreeString.expect("FreeString")(ctx, s);
        out
    }
}

fn reply_batch(reply: Reply, batch: &[(Vec<u8>, &Record)]) {
    reply.array(batch.len());
    for (name, r) in batch {
        let Some(c) = r.completed() else { continue };
        reply.array(9);
        reply.bulk(name);
        reply.int(r.token);
        reply.bulk(hex::encode(r.fingerprint).as_bytes());
        reply.int(u64::from(c.status));
        reply.bulk(&c.body);
        commands::reply_headers(reply, c);
        reply.int(r.created_at);
        reply.int(c.completed_at);
        reply.int(r.expires_at);
    }
}

fn block_puller(ctx: *mut raw::RedisModuleCtx, db: i32, timeout_ms: u64) {
    let bc = unsafe {
        raw::RedisModule_BlockClient.expect("BlockClient")(
            ctx,
            Some(puller_reply),
            Some(puller_timeout),
            Some(free_db),
            timeout_ms as i64,
        )
    };
    unsafe {
        raw::RedisModule_SetDisconnectCallback.expect("SetDisconnectCallback")(
            bc,
            Some(puller_disconnected),
        )
    };
    PULLERS.lock().push((BlockedClient(bc), db));
}

/// Answers blocked pullers: each claims what is there when it runs.
fn wake_pullers() {
    let woken = std::mem::take(&mut *PULLERS.lock());
    for (bc, db) in woken {
        let db = Box::into_raw(Box::new(db)).cast::<c_void>();
        unsafe { raw::RedisModule_UnblockClient.expect("UnblockClient")(bc.0, db) };
    }
}

/// Forgets a blocked puller; false when it was already woken (and so
/// already unblocked: unblocking twice would free it twice).
fn remove_puller(bc: *mut raw::RedisModuleBlockedClient) -> bool {
    let mut pullers = PULLERS.lock();
    let before = pullers.len();
    pullers.retain(|(b, _)| b.0 != bc);
    pullers.len() != before
}

/// Re-parses the blocked command's arguments and answers with a claim.
fn answer_puller(
    ctx: *mut raw::RedisModuleCtx,
    argv: *mut *mut raw::RedisModuleString,
    argc: c_int,
    db: i32,
) {
    let args: Vec<&[u8]> = (1..argc.max(1) as usize)
        .map(|i| bytes(unsafe { *argv.add(i) }))
        .collect();
    let batch = match args::pull(&args, config::mirror_claim_ms()) {
        Ok(req) => {
            unsafe { raw::RedisModule_SelectDb.expect("SelectDb")(ctx, db) };
            claim(ctx, db, &req)
        }
        Err(_) => Vec::new(),
    };
    reply_batch(Reply(ctx), &batch);
}

extern "C" fn puller_reply(
    ctx: *mut raw::RedisModuleCtx,
    argv: *mut *mut raw::RedisModuleString,
    argc: c_int,
) -> c_int {
    guard("pull reply", (), || {
        let db = unsafe {
            raw::RedisModule_GetBlockedClientPrivateData.expect("GetBlockedClientPrivateData")(ctx)
        };
        let db = if db.is_null() {
            0
        } else {
            unsafe { *db.cast::<i32>() }
        };
        answer_puller(ctx, argv, argc, db);
    });
    raw::REDISMODULE_OK as c_int
}

extern "C" fn puller_timeout(
    ctx: *mut raw::RedisModuleCtx,
    argv: *mut *mut raw::RedisModuleString,
    argc: c_int,
) -> c_int {
    guard("pull timeout", (), || unsafe {
        let bc = raw::RedisModule_GetBlockedClientHandle.expect("GetBlockedClientHandle")(ctx);
        if remove_puller(bc) {
            let db = raw::RedisModule_GetSelectedDb.expect("GetSelectedDb")(ctx);
            answer_puller(ctx, argv, argc, db);
            raw::RedisModule_UnblockClient.expect("UnblockClient")(bc, ptr::null_mut());
        }
    });
    raw::REDISMODULE_OK as c_int
}

extern "C" fn puller_disconnected(
    _ctx: *mut raw::RedisModuleCtx,
    bc: *mut raw::RedisModuleBlockedClient,
) {
    guard("pull disconnect", (), || {
        if remove_puller(bc) {
            unsafe { raw::RedisModule_UnblockClient.expect("UnblockClient")(bc, ptr::null_mut()) };
        }
    })
}

extern "C" fn free_db(_ctx: *mut raw::RedisModuleCtx, privdata: *mut c_void) {
    if !privdata.is_null() {
        drop(unsafe { Box::from_raw(privdata.cast::<i32>()) });
    }
}

/// `IDEM.MIRROR.ACK key token`
pub fn ack(call: &Call) -> Result<(), Error> {
    let req = args::key_token(&call.args, "IDEM.MIRROR.ACK key token")?;
    let mut key = Key::open(call.ctx, call.raw_arg(0));
    let (matched, changed) = engine::ack(key.record()?, req.token);
    if changed {
        forget(call.db(), req.key);
        stats::MIRROR_ACKS.incr();
        unsafe { raw::RedisModule_ReplicateVerbatim.expect("ReplicateVerbatim")(call.ctx) };
    }
    call.reply().int(u64::from(matched));
    Ok(())
}

/// Subscribes to the keyspace and flush events that change the index.
pub fn subscribe(ctx: &Context) -> Result<(), String> {
    // Every class whose commands can delete or replace a key's value.
    let types = raw::REDISMODULE_NOTIFY_GENERIC
        | raw::REDISMODULE_NOTIFY_EXPIRED
        | raw::REDISMODULE_NOTIFY_EVICTED
        | raw::REDISMODULE_NOTIFY_STRING
        | raw::REDISMODULE_NOTIFY_LIST
        | raw::REDISMODULE_NOTIFY_SET
        | raw::REDISMODULE_NOTIFY_HASH
        | raw::REDISMODULE_NOTIFY_ZSET
        | raw::REDISMODULE_NOTIFY_STREAM;
    let ok = unsafe {
        raw::RedisModule_SubscribeToKeyspaceEvents.expect("SubscribeToKeyspaceEvents")(
            ctx.get_raw(),
            types as c_int,
            Some(on_keyspace_event),
        ) == raw::REDISMODULE_OK as c_int
            && raw::RedisModule_SubscribeToServerEvent.expect("SubscribeToServerEvent")(
                ctx.get_raw(),
                raw::RedisModuleEvent {
                    id: raw::REDISMODULE_EVENT_FLUSHDB,
                    dataver: 1,
                },
                Some(on_flush),
            ) == raw::REDISMODULE_OK as c_int
    };
    ok.then_some(())
        .ok_or_else(|| "cannot subscribe to keyspace events".to_string())
}

extern "C" fn on_keyspace_event(
    ctx: *mut raw::RedisModuleCtx,
    _type: c_int,
    event: *const c_char,
    key: *mut raw::RedisModuleString,
) -> c_int {
    guard("keyspace event", (), || {
        let name = bytes(key);
        let db = unsafe { raw::RedisModule_GetSelectedDb.expect("GetSelectedDb")(ctx) };
        let event = unsafe { CStr::from_ptr(event) }.to_bytes();
        // A record may arrive under a new name; other events mostly concern
        // keys idem does not track: return fast for those.
        let arrives = matches!(event, b"rename_to" | b"move_to" | b"copy_to" | b"restore");
        let tracked = PENDING
            .lock()
            .get(&db)
            .is_some_and(|i| i.contains_key(name));
        if !arrives && !tracked && !waiters::has(db, name) {
            return;
        }
        match event {
            b"del" | b"expired" | b"evicted" | b"rename_from" | b"move_from" => forget(db, name),
            // Anything else may have replaced the value: look again.
            _ => resync(ctx, db, name),
        }
        waiters::key_gone(ctx, db, name);
    });
    raw::REDISMODULE_OK as c_int
}

/// Re-reads the key and brings its index entry in line.
fn resync(ctx: *mut raw::RedisModuleCtx, db: i32, name: &[u8]) {
    with_key(ctx, name, |k| match k.record() {
        Ok(Some(record)) => track(db, name, record),
        _ => forget(db, name),
    });
}

extern "C" fn on_flush(
    ctx: *mut raw::RedisModuleCtx,
    _eid: raw::RedisModuleEvent,
    subevent: u64,
    data: *mut c_void,
) {
    guard("flush event", (), || {
        if subevent != raw::REDISMODULE_SUBEVENT_FLUSHDB_END || data.is_null() {
            return;
        }
        let db = unsafe { (*data.cast::<raw::RedisModuleFlushInfo>()).dbnum };
        let mut pending = PENDING.lock();
        if db < 0 {
            pending.clear();
        } else {
            pending.remove(&db);
        }
        drop(pending);
        waiters::flushed(ctx, db);
    })
}
