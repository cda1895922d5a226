//! An open Redis key holding (or about to hold) an idem record.

use std::ffi::c_int;

use idem_core::{Error, Record};
use redis_module::raw;

use crate::datatype::IDEM_TYPE;

pub struct Key {
    ptr: *mut raw::RedisModuleKey,
}

impl Key {
    /// Opens `name` in the context's selected database for reading and writing.
    pub fn open(ctx: *mut raw::RedisModuleCtx, name: *mut raw::RedisModuleString) -> Key {
        Self::open_mode(ctx, name, raw::REDISMODULE_READ | raw::REDISMODULE_WRITE)
    }

    /// Opens `name` read-only: closing it signals no modification (WATCH,
    /// client tracking). A missing key reads as empty.
    pub fn open_read(ctx: *mut raw::RedisModuleCtx, name: *mut raw::RedisModuleString) -> Key {
        Self::open_mode(ctx, name, raw::REDISMODULE_READ)
    }

    fn open_mode(
        ctx: *mut raw::RedisModuleCtx,
        name: *mut raw::RedisModuleString,
        mode: u32,
    ) -> Key {
        let ptr = unsafe { raw::RedisModule_OpenKey.expect("OpenKey")(ctx, name, mode as c_int) };
        Key { ptr: ptr.cast() }
    }

    /// The record under the key; `WRONGTYPE` when the key holds something else.
    pub fn record(&mut self) -> Result<Option<&mut Record>, Error> {
        unsafe {
            let kind = raw::RedisModule_KeyType.expect("KeyType")(self.ptr);
            if kind == raw::REDISMODULE_KEYTYPE_EMPTY as c_int {
                return Ok(None);
            }
            if kind != raw::REDISMODULE_KEYTYPE_MODULE as c_int
                || raw::RedisModule_ModuleTypeGetType.expect("ModuleTypeGetType")(self.ptr)
                    != *IDEM_TYPE.raw_type.borrow()
            {
                return Err(Error::WrongType);
            }
            let value = raw::RedisModule_ModuleTypeGetValue.expect("ModuleTypeGetValue")(self.ptr);
            Ok(value.cast::<Record>().as_mut())
        }
    }

    /// Stores `record` with its absolute expiry.
    pub fn store(&self, record: Record) {
        let expires_at = record.expires_at;
        unsafe {
            raw::RedisModule_ModuleTypeSetValue.expect("ModuleTypeSetValue")(
                self.ptr,
                *IDEM_TYPE.raw_type.borrow(),
                Box::into_raw(Box::new(record)).cast(),
            );
        }
        self.set_abs_expire(expires_at);
    }

    pub fn set_abs_expire(&self, at_ms: u64) {
        unsafe {
            raw::RedisModule_SetAbsExpire.expect("SetAbsExpire")(
                self.ptr,
                at_ms.min(i64::MAX as u64) as i64,
            )
        };
    }

    pub fn delete(&self) {
        unsafe { raw::RedisModule_DeleteKey.expect("DeleteKey")(self.ptr) };
    }
}

impl Drop for Key {
    fn drop(&mut self) {
        unsafe { raw::RedisModule_CloseKey.expect("CloseKey")(self.ptr) };
    }
}

/// Unix time in milliseconds by the server's clock.
pub fn now_ms() -> u64 {
    unsafe { raw::RedisModule_Milliseconds.expect("Milliseconds")() as u64 }
}
