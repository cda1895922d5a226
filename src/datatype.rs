//! The `idem-recd` module data type: RDB, AOF rewrite, MEMORY USAGE, DEBUG
//! DIGEST, COPY and free callbacks. The encoding itself is `idem_core::codec`.

use std::ffi::{c_char, c_int, c_void};
use std::ptr;

use idem_core::{codec, Record};
use redis_module::{native_types::RedisType, raw};

use crate::boundary::{guard, log_warning};
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

unsafe fn record<'a>(value: *const c_void) -> &'a Record {
    &*value.cast::<Record>()
}

extern "C" fn rdb_save(io: *mut raw::RedisModuleIO, value: *mut c_void) {
    guard("rdb_save", (), || {
        let bytes = codec::encode(unsafe { record(value) });
        unsafe {
            raw::RedisModule_SaveStringBuffer.expect("SaveStringBuffer")(
                io,
                bytes.as_ptr().cast::<c_char>(),
                bytes.len(),
            )
        };
    })
}

extern "C" fn rdb_load(io: *mut raw::RedisModuleIO, encver: c_int) -> *mut c_void {
    guard("rdb_load", ptr::null_mut(), || {
        if encver != ENCVER {
            log_warning(&format!("idem: unknown RDB encoding version {encver}"));
            return ptr::null_mut();
        }
        let Ok(buf) = raw::load_string_buffer(io) else {
            return ptr::null_mut();
        };
        match codec::decode(buf.as_ref()) {
            Ok(rec) => {
                mirror::loaded(io, &rec);
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
        let bytes = codec::encode(unsafe { record(value) });
        unsafe {
            raw::RedisModule_EmitAOF.expect("EmitAOF")(
                aof,
                c"IDEM._PUT".as_ptr(),
                c"sb".as_ptr(),
                key,
                bytes.as_ptr().cast::<c_char>(),
                bytes.len(),
            )
        };
    })
}

extern "C" fn mem_usage(value: *const c_void) -> usize {
    guard("mem_usage", 0, || unsafe { record(value) }.memory_usage())
}

extern "C" fn digest(md: *mut raw::RedisModuleDigest, value: *mut c_void) {
    guard("digest", (), || {
        let mut bytes = codec::encode(unsafe { record(value) });
        unsafe {
            raw::RedisModule_DigestAddStringBuffer.expect("DigestAddStringBuffer")(
                md,
                bytes.as_mut_ptr().cast::<c_char>(),
                bytes.len(),
            );
            raw::RedisModule_DigestEndSequence.expect("DigestEndSequence")(md);
        }
    })
}

extern "C" fn free(value: *mut c_void) {
    guard("free", (), || {
        drop(unsafe { Box::from_raw(value.cast::<Record>()) })
    })
}

extern "C" fn copy(
    _from: *mut raw::RedisModuleString,
    _to: *mut raw::RedisModuleString,
    value: *const c_void,
) -> *mut c_void {
    guard("copy", ptr::null_mut(), || {
        Box::into_raw(Box::new(unsafe { record(value) }.clone())).cast()
    })
}
