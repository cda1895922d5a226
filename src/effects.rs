//! Deterministic replication: the primary decides, then propagates the
//! resulting record (with absolute times) as `IDEM._PUT key blob`, or a
//! `DEL`. Replicas and AOF replay apply effects without deciding anything.

use std::ffi::{c_char, c_int};

use idem_core::{codec, Error, Record};
use redis_module::raw;

use crate::boundary::Call;
use crate::keyspace::{now_ms, Key};
use crate::{mirror, Shared, TOKENS};

/// Propagates `record` as the new value of `key` to replicas and the AOF.
pub fn replicate_put(
    ctx: *mut raw::RedisModuleCtx,
    key: *mut raw::RedisModuleString,
    record: &Record,
) {
    // One buffer reused for every effect (main thread only): no allocation
    // on the write path. Redis copies the bytes.
    static BUFFER: Shared<Vec<u8>> = Shared::new(Vec::new());
    let mut blob = BUFFER.lock();
    blob.clear();
    codec::encode_into(record, &mut blob);
    unsafe {
        raw::RedisModule_Replicate.expect("Replicate")(
            ctx,
            c"IDEM._PUT".as_ptr(),
            c"sb".as_ptr(),
            key,
            blob.as_ptr().cast::<c_char>(),
            blob.len(),
        )
    };
    if blob.capacity() > 64 * 1024 {
        *blob = Vec::new(); // do not keep a large body's buffer around
    }
}

/// Propagates the deletion of `key`.
pub fn replicate_del(ctx: *mut raw::RedisModuleCtx, key: *mut raw::RedisModuleString) {
    unsafe {
        raw::RedisModule_Replicate.expect("Replicate")(ctx, c"DEL".as_ptr(), c"s".as_ptr(), key)
    };
}

/// `IDEM._PUT key blob`: stores a record decided elsewhere. Accepted only
/// from the replication stream and while loading the AOF: a client cannot
/// forge records or tokens with it.
pub fn put(call: &Call) -> Result<(), Error> {
    let trusted =
        (raw::REDISMODULE_CTX_FLAGS_REPLICATED | raw::REDISMODULE_CTX_FLAGS_LOADING) as c_int;
    if call.flags() & trusted == 0 {
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
    let mut key = Key::open(call.ctx, call.raw_arg(0));
    key.record()?; // refuse to overwrite another type
    TOKENS.lock().observe(record.token, now_ms());
    mirror::track(call.db(), call.args[0], &record);
    key.store(record);
    unsafe { raw::RedisModule_ReplicateVerbatim.expect("ReplicateVerbatim")(call.ctx) };
    call.reply().simple(c"OK");
    Ok(())
}
