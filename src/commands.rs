//! The IDEM.* commands: parse, decide with `idem_core::engine`, apply,
//! replicate the effect, reply. Each handler writes its reply last.

use std::ffi::{c_int, CString};

use idem_core::engine::{self, Begin};
use idem_core::record::NO_EXPIRY;
use idem_core::{args, Completed, Error, Record, State};
use redis_module::{raw, Context};

use crate::acl::{self, KeyAccess};
use crate::boundary::{entry_point, Call, Reply};
use crate::keyspace::{now_ms, Key};
use crate::{config, effects, mirror, stats, waiters, TOKENS};

entry_point!(begin_cmd, begin);
entry_point!(complete_cmd, complete);
entry_point!(abort_cmd, abort);
entry_point!(touch_cmd, touch);
entry_point!(get_cmd, get);
entry_point!(put_cmd, effects::put);
entry_point!(pull_cmd, mirror::pull);
entry_point!(ack_cmd, mirror::ack);

type EntryPoint =
    extern "C" fn(*mut raw::RedisModuleCtx, *mut *mut raw::RedisModuleString, c_int) -> c_int;

/// name, entry point, flags, what it does to its key (argument 1; None:
/// keyless), ACL categories (Redis 7.2+).
const COMMANDS: &[(&str, EntryPoint, &str, Option<KeyAccess>, &str)] = &[
    (
        "IDEM.BEGIN",
        begin_cmd,
        "write deny-oom",
        Some(KeyAccess::ReadWrite),
        "write",
    ),
    (
        "IDEM.COMPLETE",
        complete_cmd,
        "write deny-oom",
        Some(KeyAccess::Update),
        "write",
    ),
    (
        "IDEM.ABORT",
        abort_cmd,
        "write fast",
        Some(KeyAccess::Delete),
        "write fast",
    ),
    (
        "IDEM.TOUCH",
        touch_cmd,
        "write fast",
        Some(KeyAccess::Update),
        "write fast",
    ),
    (
        "IDEM.GET",
        get_cmd,
        "readonly fast",
        Some(KeyAccess::Read),
        "read fast",
    ),
    (
        "IDEM._PUT",
        put_cmd,
        "write",
        Some(KeyAccess::Overwrite),
        "write",
    ),
    ("IDEM.MIRROR.PULL", pull_cmd, "write", None, "write"),
    (
        "IDEM.MIRROR.ACK",
        ack_cmd,
        "write fast",
        Some(KeyAccess::Update),
        "write fast",
    ),
];

pub fn register(ctx: &Context) -> Result<(), String> {
    for &(name, entry, flags, key, categories) in COMMANDS {
        let (first, last, step) = if key.is_some() { (1, 1, 1) } else { (0, 0, 0) };
        let (cname, cflags) = (CString::new(name).unwrap(), CString::new(flags).unwrap());
        let status = unsafe {
            raw::RedisModule_CreateCommand.expect("CreateCommand")(
                ctx.get_raw(),
                cname.as_ptr(),
                Some(entry),
                cflags.as_ptr(),
                first,
                last,
                step,
            )
        };
        if status != raw::REDISMODULE_OK as c_int {
            return Err(format!("cannot register {name}"));
        }
        acl::describe(ctx.get_raw(), name, key, categories)?;
    }
    Ok(())
}

/// `IDEM.BEGIN key fingerprint ttl-seconds [LEASE ms] [WAIT ms]`
fn begin(call: &Call) -> Result<(), Error> {
    let req = args::begin(&call.args, &config::limits())?;
    let mut key = Key::open(call.ctx, call.raw_arg(0));
    let outcome = engine::begin(key.record()?, &req, now_ms, &mut TOKENS.lock());
    let reply = call.reply();
    match outcome {
        Begin::Created(record) => {
            effects::replicate_put(call.ctx, call.raw_arg(0), &record);
            let token = record.token;
            key.store(record);
            stats::NEW.incr();
            reply_new(reply, token);
        }
        Begin::TakenOver { token } => {
            key.modified();
            let record = key.record()?.ok_or(Error::NotFound)?;
            effects::replicate_put(call.ctx, call.raw_arg(0), record);
            stats::NEW.incr();
            stats::TAKEOVERS.incr();
            reply_new(reply, token);
        }
        Begin::InFlight { retry_after_ms } => {
            if req.wait_ms.is_some_and(|ms| ms > 0)
                && waiters::wait(call, &req, now_ms() + retry_after_ms)
            {
                return Ok(());
            }
            stats::IN_FLIGHT.incr();
            reply_in_flight(reply, retry_after_ms);
        }
        Begin::Replay(completed) => {
            stats::REPLAY.incr();
            reply_replay(reply, completed);
        }
        Begin::Mismatch => {
            stats::MISMATCH.incr();
            reply_mismatch(reply);
        }
    }
    Ok(())
}

pub fn reply_new(reply: Reply, token: u64) {
    reply.array(2);
    reply.bulk(b"new");
    reply.int(token);
}

pub fn reply_in_flight(reply: Reply, retry_after_ms: u64) {
    reply.array(2);
    reply.bulk(b"in_flight");
    reply.int(retry_after_ms);
}

pub fn reply_replay(reply: Reply, c: &Completed) {
    reply.array(4);
    reply.bulk(b"replay");
    reply.int(u64::from(c.status));
    reply.bulk(&c.body);
    reply_headers(reply, c);
}

pub fn reply_mismatch(reply: Reply) {
    reply.array(1);
    reply.bulk(b"mismatch");
}

/// An absolute expiry: Unix ms, or -1 for a key without TTL.
pub fn reply_expiry(reply: Reply, at: u64) {
    if at == NO_EXPIRY {
        reply.signed(-1);
    } else {
        reply.int(at);
    }
}

pub fn reply_headers(reply: Reply, c: &Completed) {
    reply.array(c.headers.len() * 2);
    for h in &c.headers {
        reply.bulk(&h.name);
        reply.bulk(&h.value);
    }
}

/// Counts a refused token before passing the error on.
fn count_stale<T>(r: Result<T, Error>) -> Result<T, Error> {
    if r.as_ref().is_err_and(|e| *e == Error::Stale) {
        stats::STALE_TOKENS.incr();
    }
    r
}

/// `IDEM.COMPLETE key token status body [HEADER name value]... [MIRRORED]`
fn complete(call: &Call) -> Result<(), Error> {
    let req = args::complete(&call.args, &config::limits())?;
    let mut key = Key::open(call.ctx, call.raw_arg(0));
    count_stale(engine::complete(key.record()?, req, now_ms()))?;
    key.modified();
    let record = key.record()?.ok_or(Error::NotFound)?;
    effects::replicate_put(call.ctx, call.raw_arg(0), record);
    mirror::track(call.db(), call.args[0], record);
    stats::COMPLETES.incr();
    waiters::settle(call.ctx, call.db(), call.args[0]);
    call.reply().simple(c"OK");
    Ok(())
}

/// `IDEM.ABORT key token`
fn abort(call: &Call) -> Result<(), Error> {
    let req = args::key_token(&call.args, "IDEM.ABORT key token")?;
    let mut key = Key::open(call.ctx, call.raw_arg(0));
    let record = key.record()?;
    if !engine::may_abort(record.as_deref(), req.token) {
        if record.is_some_and(|r| r.token != req.token) {
            stats::STALE_TOKENS.incr();
        }
        call.reply().int(0);
        return Ok(());
    }
    key.delete();
    drop(key);
    effects::replicate_del(call.ctx, call.raw_arg(0));
    stats::ABORTS.incr();
    waiters::settle(call.ctx, call.db(), call.args[0]);
    call.reply().int(1);
    Ok(())
}

/// `IDEM.TOUCH key token lease-ms`
fn touch(call: &Call) -> Result<(), Error> {
    let req = args::touch(&call.args)?;
    let mut key = Key::open(call.ctx, call.raw_arg(0));
    let remaining = count_stale(engine::touch(
        key.record()?,
        req.token,
        req.lease_ms,
        now_ms(),
    ))?;
    key.modified();
    let record = key.record()?.ok_or(Error::NotFound)?;
    effects::replicate_put(call.ctx, call.raw_arg(0), record);
    stats::TOUCHES.incr();
    call.reply().int(remaining);
    Ok(())
}

/// `IDEM.GET key`: the record as a flat field/value array, or nil.
fn get(call: &Call) -> Result<(), Error> {
    if call.args.len() != 1 {
        return Err(Error::bad_arg(
            "wrong number of arguments, usage: IDEM.GET key",
        ));
    }
    let mut key = Key::open_read(call.ctx, call.raw_arg(0));
    let Some(r) = key.record()? else {
        call.reply().null();
        return Ok(());
    };
    reply_record(call.reply(), r);
    Ok(())
}

fn reply_record(reply: Reply, r: &Record) {
    let common = |state: &[u8], pairs: usize| {
        reply.array(pairs * 2);
        reply.bulk(b"state");
        reply.bulk(state);
        reply.bulk(b"fingerprint");
        reply.bulk(hex::encode(r.fingerprint).as_bytes());
        reply.bulk(b"token");
        reply.int(r.token);
        reply.bulk(b"created_at");
        reply.int(r.created_at);
        reply.bulk(b"expires_at");
        reply_expiry(reply, r.expires_at);
    };
    match &r.state {
        State::InProgress { lease_until } => {
            common(b"in_progress", 6);
            reply.bulk(b"lease_until");
            reply.int(*lease_until);
        }
        State::Completed(c) => {
            common(b"completed", 10);
            reply.bulk(b"status");
            reply.int(u64::from(c.status));
            reply.bulk(b"body");
            reply.bulk(&c.body);
            reply.bulk(b"headers");
            reply_headers(reply, c);
            reply.bulk(b"completed_at");
            reply.int(c.completed_at);
            reply.bulk(b"mirror");
            reply.bulk(if r.mirror_pending() {
                b"pending"
            } else {
                b"mirrored"
            });
        }
    }
}
