//! The IDEM.* commands: parse, decide with `idem_core::engine`, apply,
//! replicate the effect, reply. Each handler writes its reply last.

use idem_core::args::{self, name};
use idem_core::engine::{self, Begin};
use idem_core::wire::{self, ReplySink};
use idem_core::{Error, Record};

use crate::ffi::acl::{self, KeyAccess};
use crate::ffi::call::{create_command, entry_point, Call, EntryPoint};
use crate::ffi::ctx::{now_ms, out_of_memory, Ctx};
use crate::ffi::key::Key;
use crate::ffi::prefetch;
use crate::{config, effects, mirror, stats, waiters, TOKENS};

entry_point!(begin_cmd, begin);
entry_point!(complete_cmd, complete);
entry_point!(abort_cmd, abort);
entry_point!(touch_cmd, touch);
entry_point!(get_cmd, get);
entry_point!(put_cmd, effects::put);
entry_point!(pull_cmd, mirror::pull::pull);
entry_point!(ack_cmd, mirror::pull::ack);

/// name, entry point, flags, what it does to its key (argument 1; None:
/// keyless), ACL categories (Redis 7.2+).
const COMMANDS: &[(&str, EntryPoint, &str, Option<KeyAccess>, &str)] = &[
    (
        name::BEGIN,
        begin_cmd,
        // Not `deny-oom`: a replay, 409 or 422 allocates nothing and still
        // answers at `maxmemory`; only a new record is refused (`begin`).
        "write",
        Some(KeyAccess::ReadWrite),
        "write",
    ),
    (
        name::COMPLETE,
        complete_cmd,
        "write deny-oom",
        Some(KeyAccess::Update),
        "write",
    ),
    (
        name::ABORT,
        abort_cmd,
        "write fast",
        Some(KeyAccess::Delete),
        "write fast",
    ),
    (
        name::TOUCH,
        touch_cmd,
        "write fast",
        Some(KeyAccess::Update),
        "write fast",
    ),
    (
        name::GET,
        get_cmd,
        "readonly fast",
        Some(KeyAccess::Read),
        "read fast",
    ),
    (
        name::PUT,
        put_cmd,
        "write",
        Some(KeyAccess::Overwrite),
        "write",
    ),
    (name::MIRROR_PULL, pull_cmd, "write", None, "write"),
    (
        name::MIRROR_ACK,
        ack_cmd,
        "write fast",
        Some(KeyAccess::Update),
        "write fast",
    ),
];

pub fn register(ctx: Ctx) -> Result<(), String> {
    for &(name, entry, flags, key, categories) in COMMANDS {
        create_command(ctx, name, entry, flags, key.is_some())?;
        acl::describe(ctx, name, key, categories)?;
    }
    Ok(())
}

/// `IDEM.BEGIN key fingerprint ttl-seconds [LEASE ms] [WAIT ms] [PACKED]`
fn begin(call: &Call) -> Result<(), Error> {
    let limits = config::limits();
    let sent = args::begin_args(&call.args, &limits)?;
    let mut key = Key::open(call.ctx, call.key());
    let record = key.record()?;
    match &record {
        // The record is the one memory access a replay adds to what `GET`
        // does: its cache lines load together, overlapping the arguments'
        // resolution (and the hashing of a fingerprint not 32 bytes long).
        Some(record) => prefetch(
            std::ptr::from_ref::<Record>(record).cast(),
            size_of::<Record>(),
        ),
        None if out_of_memory() => return Err(Error::Oom),
        None => {}
    }
    let req = sent.resolve(&limits);
    let outcome = engine::begin(record, &req, now_ms, || TOKENS.lock());
    let mut reply = call.ctx.reply();
    match outcome {
        Begin::Created(record) => {
            effects::replicate_put(call.ctx, call.key(), &record);
            let token = record.token;
            key.store(record);
            stats::NEW.incr();
            wire::Begin::New { token }.write(&mut reply, req.replay);
        }
        Begin::TakenOver { token } => {
            let record = key.signal_then_record()?.ok_or(Error::NotFound)?;
            effects::replicate_put(call.ctx, call.key(), record);
            stats::NEW.incr();
            stats::TAKEOVERS.incr();
            wire::Begin::New { token }.write(&mut reply, req.replay);
        }
        Begin::InFlight { retry_after_ms } => {
            if req.wait_ms.is_some_and(|ms| ms > 0)
                && waiters::wait(call, &req, now_ms() + retry_after_ms)
            {
                return Ok(());
            }
            stats::IN_FLIGHT.incr();
            wire::Begin::InFlight { retry_after_ms }.write(&mut reply, req.replay);
        }
        Begin::Replay(completed) => {
            prefetch(completed.body.as_ptr(), completed.body.len());
            stats::REPLAY.incr();
            wire::Begin::Replay(completed).write(&mut reply, req.replay);
        }
        Begin::Mismatch => {
            stats::MISMATCH.incr();
            wire::Begin::Mismatch.write(&mut reply, req.replay);
        }
    }
    Ok(())
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
    let mut key = Key::open(call.ctx, call.key());
    count_stale(engine::complete(key.record()?, req, now_ms()))?;
    let record = key.signal_then_record()?.ok_or(Error::NotFound)?;
    effects::replicate_put(call.ctx, call.key(), record);
    mirror::track(call.ctx.db(), call.args[0], record);
    stats::COMPLETES.incr();
    waiters::settle(call.ctx, call.ctx.db(), call.args[0]);
    call.ctx.reply().ok();
    Ok(())
}

/// `IDEM.ABORT key token`
fn abort(call: &Call) -> Result<(), Error> {
    let req = args::key_token(&call.args, "IDEM.ABORT key token")?;
    let mut key = Key::open(call.ctx, call.key());
    let record = key.record()?;
    let mut reply = call.ctx.reply();
    if !engine::may_abort(record.as_deref(), req.token) {
        if record.is_some_and(|r| r.token != req.token) {
            stats::STALE_TOKENS.incr();
        }
        reply.int(0);
        return Ok(());
    }
    key.delete();
    drop(key);
    effects::replicate_del(call.ctx, call.key());
    stats::ABORTS.incr();
    waiters::settle(call.ctx, call.ctx.db(), call.args[0]);
    reply.int(1);
    Ok(())
}

/// `IDEM.TOUCH key token lease-ms`
fn touch(call: &Call) -> Result<(), Error> {
    let req = args::touch(&call.args)?;
    let mut key = Key::open(call.ctx, call.key());
    let remaining = count_stale(engine::touch(
        key.record()?,
        req.token,
        req.lease_ms,
        now_ms(),
    ))?;
    let record = key.signal_then_record()?.ok_or(Error::NotFound)?;
    effects::replicate_put(call.ctx, call.key(), record);
    stats::TOUCHES.incr();
    call.ctx
        .reply()
        .int(i64::try_from(remaining).unwrap_or(i64::MAX));
    Ok(())
}

/// `IDEM.GET key`: the record as a flat field/value array, or nil.
fn get(call: &Call) -> Result<(), Error> {
    if call.args.len() != 1 {
        return Err(Error::bad_arg(
            "wrong number of arguments, usage: IDEM.GET key",
        ));
    }
    let mut key = Key::open_read(call.ctx, call.key());
    wire::write_record(&mut call.ctx.reply(), key.record()?.as_deref());
    Ok(())
}
