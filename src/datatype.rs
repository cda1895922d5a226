//! The `idem-recd` module data type: RDB, AOF rewrite, MEMORY USAGE, DEBUG
//! DIGEST, COPY and free callbacks. The encoding itself is `idem_core::codec`.

use std::ffi::{c_int, c_void};
use std::ptr;

use idem_core::args::name;
use idem_core::{codec, Record};
use redis_module::{native_types::RedisType, raw};

use crate::ffi::call::guard;
use crate::ffi::ctx::{log_warning, Name};
use crate::ffi::io::{digest_add, Aof, Rdb};
use crate::mirror;

/// RDB encoding version. Version 1 = one string buffer holding
/// `idem_core::codec` bytes (which carry their own format byte).
const ENCVER: i32 = 1;

pub static IDEM_TYPE: RedisType = RedisType::new(
    "idem-recd",
    ENCVER,
    raw::RedisModuleTypeMethods {
        version: redis_module::TYPE_METHOD_VERSION,
        rdb_load: Some(rdb_load),
        rdb_save: Some(rdb_save),
        aof_rewrite: Some(aof_rewrite),
        mem_usage: Some(mem_usage),
        digest: Some(digest),
        free: Some(free),
        aux_load: None,
        aux_save: None,
        aux_save2: None,
        aux_save_triggers: 0,
        free_effort: None,
        unlink: None,
        copy: Some(copy),
        defrag: None,
        mem_usage2: None,
        free_effort2: None,
        unlink2: None,
        copy2: None,
    },
);

/// The record behind a module value passed to one of the callbacks below.
fn record<'a>(value: *const c_void) -> &'a Record {
    // SAFETY: Redis passes these callbacks only values of IDEM_TYPE: each a
    // Box<Record> this module stored, alive until the type's free callback.
    unsafe { &*value.cast::<Record>() }
}

extern "C" fn rdb_save(io: *mut raw::RedisModuleIO, value: *mut c_void) {
    guard("rdb_save", (), || {
        Rdb::from_raw(io).save_buffer(&codec::encode(record(value)))
    })
}

extern "C" fn rdb_load(io: *mut raw::RedisModuleIO, encver: c_int) -> *mut c_void {
    guard("rdb_load", ptr::null_mut(), || {
        if encver != ENCVER {
            log_warning(&format!("idem: unknown RDB encoding version {encver}"));
            return ptr::null_mut();
        }
        let io = Rdb::from_raw(io);
        let Some(buf) = io.load_buffer() else {
            return ptr::null_mut();
        };
        match codec::decode(&buf) {
            Ok(rec) => {
                mirror::loaded(io.key_and_db(), &rec, io.is_loading());
                Box::into_raw(Box::new(rec)).cast()
            }
            Err(e) => {
                log_warning(&format!("idem: {e}"));
                ptr::null_mut()
            }
        }
    })
}

extern "C" fn aof_rewrite(
    aof: *mut raw::RedisModuleIO,
    key: *mut raw::RedisModuleString,
    value: *mut c_void,
) {
    guard("aof_rewrite", (), || {
        let bytes = codec::encode(record(value));
        Aof::from_raw(aof).emit_key_blob(name::PUT_C, Name::from_raw(key), &bytes);
    })
}

extern "C" fn mem_usage(value: *const c_void) -> usize {
    guard("mem_usage", 0, || record(value).memory_usage())
}

extern "C" fn digest(md: *mut raw::RedisModuleDigest, value: *mut c_void) {
    guard("digest", (), || {
        digest_add(md, &mut codec::encode(record(value)));
    })
}

extern "C" fn free(value: *mut c_void) {
    guard("free", (), || {
        // SAFETY: Redis frees each value once; it is the Box this module made.
        drop(unsafe { Box::from_raw(value.cast::<Record>()) })
    })
}

extern "C" fn copy(
    _from: *mut raw::RedisModuleString,
    _to: *mut raw::RedisModuleString,
    value: *const c_void,
) -> *mut c_void {
    guard("copy", ptr::null_mut(), || {
        // The copy has no row of its own in Postgres: it is pending.
        let mut copy = record(value).clone();
        copy.mark_pending();
        Box::into_raw(Box::new(copy)).cast()
    })
}
