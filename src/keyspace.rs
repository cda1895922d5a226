//! An open Redis key holding (or about to hold) an idem record.

use std::ffi::c_int;

use idem_core::record::NO_EXPIRY;
use idem_core::{Error, Record};
use redis_module::raw;

use crate::datatype::IDEM_TYPE;

/// An open key. The module sets `NO_IMPLICIT_SIGNAL_MODIFIED`, so closing a
/// key opened for writing signals nothing: a command that changed it calls
/// `modified` (WATCH, client-side caching), one that did not (a replay, an
/// error) leaves watchers alone.
pub struct Key {
    ptr: *mut raw::RedisModuleKey,
    ctx: *mut raw::RedisModuleCtx,
    name: *mut raw::RedisModuleString,
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
        Key {
            ptr: ptr.cast(),
            ctx,
            name,
        }
    }

    /// Tells Redis the key changed: WATCHers abort, tracking clients are
    /// invalidated.
    pub fn modified(&self) {
        // SAFETY: plain FFI call with the context and name the key was
        // opened with.
        unsafe {
            raw::RedisModule_SignalModifiedKey.expect("SignalModifiedKey")(self.ctx, self.name)
        };
    }

    /// Signals the key modified, then reads its record (for changes made in
    /// place through an earlier `record()` borrow).
    pub fn signal_then_record(&mut self) -> Result<Option<&mut Record>, Error> {
        self.modified();
        self.record()
    }

    /// The key's absolute expiry, `NO_EXPIRY` when it has none.
    pub fn expiry(&self) -> u64 {
        // SAFETY: plain FFI call on an open key.
        let at = unsafe { raw::RedisModule_GetAbsExpire.expect("GetAbsExpire")(self.ptr) };
        u64::try_from(at).unwrap_or(NO_EXPIRY)
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

    /// Stores `record` with its absolute expiry, and signals the change.
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
        self.modified();
    }

    /// Sets the key's absolute expiry; `NO_EXPIRY` removes it.
    pub fn set_abs_expire(&self, at_ms: u64) {
        let at = if at_ms == NO_EXPIRY {
            raw::REDISMODULE_NO_EXPIRE as i64
        } else {
            at_ms.min(i64::MAX as u64) as i64
        };
        unsafe { raw::RedisModule_SetAbsExpire.expect("SetAbsExpire")(self.ptr, at) };
    }

    /// Deletes the key, and signals the change.
    pub fn delete(&self) {
        unsafe { raw::RedisModule_DeleteKey.expect("DeleteKey")(self.ptr) };
        self.modified();
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
