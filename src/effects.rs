//! Deterministic replication: the primary decides, then propagates the
//! resulting record (with absolute times) as `IDEM._PUT key blob`, or a
//! `DEL`; with `effect-format 2` the blob keeps a fingerprint in the form
//! held (`codec`, v2), so building an effect hashes nothing (format 1, the
//! default, carries the digest every module version reads). Replicas and
//! AOF replay apply effects without deciding anything. On a node nothing
//! consumes effects from (`consumers`) none is built; the change is only
//! counted towards the `save` points.

use idem_core::args::name;
use idem_core::{codec, Error, Record};

use crate::ffi::call::Call;
use crate::ffi::ctx::{now_ms, Ctx, Name};
use crate::ffi::key::Key;
use crate::{config, consumers, mirror, stats, Shared, TOKENS};

/// Propagates `record`, the new value of the running command's key, to
/// replicas and the AOF.
pub fn replicate_put(ctx: Ctx, key: Name, record: &Record) {
    if !consumers::consumed() {
        return unconsumed(ctx);
    }
    replicate_put_always(ctx, key, record);
}

/// As `replicate_put`, for a change the running command did not ask for (a
/// waiter granted a record from a timer, or from another command): always
/// built, since propagating the running command verbatim would not describe
/// it.
pub fn replicate_put_always(ctx: Ctx, key: Name, record: &Record) {
    // One buffer reused for every effect (main thread only): no allocation
    // on the write path. Redis copies the bytes.
    static BUFFER: Shared<Vec<u8>> = Shared::new(Vec::new());
    let mut blob = BUFFER.lock();
    blob.clear();
    if config::effects_keep_sent() {
        codec::encode_effect_into(record, &mut blob);
    } else {
        codec::encode_into(record, &mut blob);
    }
    ctx.replicate_key_blob(name::PUT_C, key, &blob);
    if blob.capacity() > 64 * 1024 {
        *blob = Vec::new(); // do not keep a large body's buffer around
    }
}

/// Propagates the deletion of `key`.
pub fn replicate_del(ctx: Ctx, key: Name) {
    if !consumers::consumed() {
        return unconsumed(ctx);
    }
    ctx.replicate_key(c"DEL", key);
}

/// An effect nothing would receive: propagating the command as called costs
/// no lookup and no encoding, and Redis drops it (it checks for consumers
/// itself); what remains is the change counted towards the `save` points,
/// as any propagation counts it.
fn unconsumed(ctx: Ctx) {
    ctx.replicate_verbatim();
    stats::EFFECTS_UNCONSUMED.incr();
}

/// `IDEM._PUT key blob`: stores a record decided elsewhere. Accepted only
/// from the replication stream and while loading the AOF: a client cannot
/// forge records or tokens with it.
pub fn put(call: &Call) -> Result<(), Error> {
    if !call.ctx.is_replicated() {
        return Err(Error::NoPerm(
            "IDEM._PUT is applied only from the replication stream or the AOF".into(),
        ));
    }
    let [_, blob] = call.args[..] else {
        return Err(Error::bad_arg(
            "wrong number of arguments, usage: IDEM._PUT key blob",
        ));
    };
    let record = codec::decode(blob)?;
    let mut key = Key::open(call.ctx, call.key());
    key.record()?; // refuse to overwrite another type
    TOKENS.lock().observe(record.token, now_ms());
    mirror::track(call.ctx.db(), call.args[0], &record);
    key.store(record);
    call.ctx.replicate_verbatim();
    call.ctx.reply().ok();
    Ok(())
}
