//! The mirror's side of the module: the per-database index of completed
//! records not yet in Postgres, `IDEM.MIRROR.PULL` / `IDEM.MIRROR.ACK`, and
//! keeping the index true when keys are loaded, deleted, renamed or flushed.

use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr;

use idem_core::pending::PendingIndex;
use idem_core::{args, engine, Error, Record};
use redis_module::{raw, Context};

use crate::acl::Caller;
use crate::blocked::{BlockedClient, Timer};
use crate::boundary::{bytes, guard, Call, Reply};
use crate::keyspace::{now_ms, Key};
use crate::{commands, config, stats, waiters, Shared, TOKENS};

/// Pending records by database.
static PENDING: Shared<BTreeMap<i32, PendingIndex>> = Shared::new(BTreeMap::new());

/// A client blocked in `IDEM.MIRROR.PULL ... BLOCK`.
struct Puller {
    id: u64,
    bc: BlockedClient,
    db: i32,
}

struct Pullers {
    list: Vec<Puller>,
    next_id: u64,
}

/// Blocked pullers. Each leaves this list exactly once, and whoever takes it
/// out unblocks it: a wake-up, its deadline timer, or its disconnect.
static PULLERS: Shared<Pullers> = Shared::new(Pullers {
    list: Vec::new(),
    next_id: 1,
});

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
    TOKENS.lock().observe(record.token, now_ms());
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
    let caller = Caller::of(ctx);
    let mut out = Vec::new();
    loop {
        let want = req.count - out.len();
        // Only records the caller may read are handed out or claimed: a user
        // limited to `~pay:*` neither sees nor hides anyone else's.
        let claimed = match PENDING.lock().get_mut(&db) {
            Some(index) => index.claim_where(now, want, req.claim_ms, |k| caller.may_read(k)),
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
        commands::reply_expiry(reply, r.expires_at);
    }
}

fn block_puller(ctx: *mut raw::RedisModuleCtx, db: i32, timeout_ms: u64) {
    let bc = BlockedClient::block(ctx, puller_reply, free_db, puller_disconnected);
    let mut pullers = PULLERS.lock();
    let id = pullers.next_id;
    pullers.next_id += 1;
    // Not stopped when the puller is woken earlier: it then finds nobody.
    Timer::start(ctx, timeout_ms, puller_deadline, id as usize as *mut c_void);
    pullers.list.push(Puller { id, bc, db });
}

/// Answers blocked pullers: each claims what is there when it runs.
fn wake_pullers() {
    let woken = std::mem::take(&mut PULLERS.lock().list);
    for p in woken {
        p.bc.unblock(Box::into_raw(Box::new(p.db)).cast::<c_void>());
    }
}

/// Takes a blocked puller out of the list; None when it already left (and
/// so was already unblocked: unblocking twice would free it twice).
fn take_puller(pick: impl Fn(&Puller) -> bool) -> Option<Puller> {
    let mut pullers = PULLERS.lock();
    let pos = pullers.list.iter().position(pick)?;
    Some(pullers.list.swap_remove(pos))
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

/// The puller's `BLOCK` ran out: it answers with whatever it can claim now
/// (usually nothing).
extern "C" fn puller_deadline(_ctx: *mut raw::RedisModuleCtx, data: *mut c_void) {
    guard("pull deadline", (), || {
        let id = data as usize as u64;
        if let Some(p) = take_puller(|p| p.id == id) {
            p.bc.unblock(Box::into_raw(Box::new(p.db)).cast::<c_void>());
        }
    })
}

extern "C" fn puller_disconnected(
    _ctx: *mut raw::RedisModuleCtx,
    bc: *mut raw::RedisModuleBlockedClient,
) {
    guard("pull disconnect", (), || {
        let bc = BlockedClient::from_raw(bc);
        if let Some(p) = take_puller(|p| p.bc == bc) {
            p.bc.unblock(ptr::null_mut());
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
        key.modified();
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
            && raw::RedisModule_SubscribeToServerEvent.expect("SubscribeToServerEvent")(
                ctx.get_raw(),
                raw::RedisModuleEvent {
                    id: raw::REDISMODULE_EVENT_SWAPDB,
                    dataver: 1,
                },
                Some(on_swapdb),
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

/// Re-reads the key and brings its index entry (and the record's expiry)
/// in line.
fn resync(ctx: *mut raw::RedisModuleCtx, db: i32, name: &[u8]) {
    with_key(ctx, name, |k| {
        let expiry = k.expiry();
        match k.record() {
            Ok(Some(record)) => {
                record.expires_at = expiry;
                track(db, name, record)
            }
            _ => forget(db, name),
        }
    });
}

/// Sets the record's `expires_at` to the key's TTL (a module value may be
/// updated in place here: nothing is written to the keyspace or propagated).
fn follow_ttl(ctx: *mut raw::RedisModuleCtx, key: *mut raw::RedisModuleString) {
    let mut k = Key::open_read(ctx, key);
    let expiry = k.expiry();
    if let Ok(Some(record)) = k.record() {
        record.expires_at = expiry;
    }
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
        waiters::recheck_dbs(ctx, &[db]);
    })
}

/// `SWAPDB a b`: the two datasets trade numbers, and so do their outboxes;
/// waiters stay with their database number and look at what is there now.
extern "C" fn on_swapdb(
    ctx: *mut raw::RedisModuleCtx,
    _eid: raw::RedisModuleEvent,
    _subevent: u64,
    data: *mut c_void,
) {
    guard("swapdb event", (), || {
        if data.is_null() {
            return;
        }
        // SAFETY: Redis passes a RedisModuleSwapDbInfo with this event.
        let info = unsafe { &*data.cast::<raw::RedisModuleSwapDbInfo>() };
        let (a, b) = (info.dbnum_first, info.dbnum_second);
        let mut pending = PENDING.lock();
        let (from_a, from_b) = (pending.remove(&a), pending.remove(&b));
        if let Some(index) = from_a {
            pending.insert(b, index);
        }
        if let Some(index) = from_b {
            pending.insert(a, index);
        }
        drop(pending);
        waiters::recheck_dbs(ctx, &[a, b]);
    })
}
