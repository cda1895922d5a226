//! An open Redis key holding (or about to hold) an idem record.
//!
//! The module sets `NO_IMPLICIT_SIGNAL_MODIFIED`, so closing a key opened for
//! writing signals nothing: a command that changed it calls `modified`
//! (WATCH, client-side caching), one that did not (a replay, an error) leaves
//! watchers alone.

use std::ffi::c_int;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::OnceLock;

use idem_core::record::NO_EXPIRY;
use idem_core::{Error, Record};
use redis_module::raw;

use super::api;
use super::ctx::{Ctx, Name};

/// The registered `idem-recd` type (set once at load).
static TYPE: AtomicPtr<raw::RedisModuleType> = AtomicPtr::new(std::ptr::null_mut());

/// Remembers the module type that holds records (`datatype` registers it).
pub fn set_record_type(t: *mut raw::RedisModuleType) {
    TYPE.store(t, Ordering::Relaxed);
}

/// The open mode of `Key::inspect`. Redis 7.2+ has modes for exactly that
/// (`NOSTATS`, `NOEXPIRE`; `RedisModule_GetOpenKeyModesAll` lists them). On
/// 7.0 a write-mode lookup is the one that counts no hit or miss and raises
/// no `keymiss`; it deletes an expired key as a read on a primary would (and
/// on a writable replica, locally), and writes nothing else.
fn quiet_mode() -> u32 {
    static MODE: OnceLock<u32> = OnceLock::new();
    *MODE.get_or_init(|| {
        let quiet = raw::REDISMODULE_OPEN_KEY_NOTOUCH
            | raw::REDISMODULE_OPEN_KEY_NONOTIFY
            | raw::REDISMODULE_OPEN_KEY_NOSTATS
            | raw::REDISMODULE_OPEN_KEY_NOEXPIRE;
        // SAFETY: a plain query of the server's supported modes (7.2+); on
        // older servers the pointer is null and not called.
        let supported = unsafe { raw::RedisModule_GetOpenKeyModesAll.map(|all| all()) };
        match supported {
            Some(all) if all as u32 & quiet == quiet => raw::REDISMODULE_READ | quiet,
            _ => raw::REDISMODULE_WRITE | raw::REDISMODULE_OPEN_KEY_NOTOUCH,
        }
    })
}

/// What an open key holds, as idem sees it.
#[derive(PartialEq, Eq)]
enum Contents {
    Nothing,
    Record,
    Other,
}

pub struct Key {
    ptr: *mut raw::RedisModuleKey,
    ctx: Ctx,
    name: Name,
}

impl Key {
    /// Opens `name` in the context's selected database for reading and
    /// writing.
    pub fn open(ctx: Ctx, name: Name) -> Key {
        Self::open_mode(ctx, name, raw::REDISMODULE_READ | raw::REDISMODULE_WRITE)
    }

    /// Opens `name` read-only. A missing key reads as empty.
    pub fn open_read(ctx: Ctx, name: Name) -> Key {
        Self::open_mode(ctx, name, raw::REDISMODULE_READ)
    }

    /// Opens `name` to look at it on idem's own behalf (keyspace events,
    /// timers, the mirror's PULL), not for a client's read: the server's
    /// `keyspace_hits`/`keyspace_misses`, the key's LRU/LFU and `keymiss`
    /// events are left alone, so loading idem changes no user's statistics.
    pub fn inspect(ctx: Ctx, name: Name) -> Key {
        Self::open_mode(ctx, name, quiet_mode())
    }

    fn open_mode(ctx: Ctx, name: Name, mode: u32) -> Key {
        // SAFETY: a live context and a string valid for this call; the key
        // is closed on drop.
        let ptr = unsafe { api!(RedisModule_OpenKey)(ctx.raw(), name.0, mode as c_int) };
        Key {
            ptr: ptr.cast(),
            ctx,
            name,
        }
    }

    /// What the key holds.
    fn contents(&self) -> Contents {
        // SAFETY: an open key (a null handle, a missing key, reads as empty).
        unsafe {
            match api!(RedisModule_KeyType)(self.ptr) {
                k if k == raw::REDISMODULE_KEYTYPE_EMPTY as c_int => Contents::Nothing,
                k if k == raw::REDISMODULE_KEYTYPE_MODULE as c_int
                    && api!(RedisModule_ModuleTypeGetType)(self.ptr)
                        == TYPE.load(Ordering::Relaxed) =>
                {
                    Contents::Record
                }
                _ => Contents::Other,
            }
        }
    }

    /// The record under a key that holds one (`Contents::Record`).
    fn value(&mut self) -> Option<&mut Record> {
        // SAFETY: an open key holding our type: its value is a Box<Record>
        // this module stored, owned by Redis until the free callback; the
        // borrow is tied to this handle, which the caller holds.
        unsafe {
            api!(RedisModule_ModuleTypeGetValue)(self.ptr)
                .cast::<Record>()
                .as_mut()
        }
    }

    /// The record under the key; `WRONGTYPE` when the key holds something
    /// else.
    pub fn record(&mut self) -> Result<Option<&mut Record>, Error> {
        match self.contents() {
            Contents::Record => Ok(self.value()),
            Contents::Nothing => Ok(None),
            Contents::Other => Err(Error::WrongType),
        }
    }

    /// The record and the key's expiry, or `None` when the key holds no
    /// record: one type check, and the expiry (a second lookup) is read only
    /// for a record.
    pub fn record_and_expiry(&mut self) -> Option<(&mut Record, u64)> {
        if self.contents() != Contents::Record {
            return None;
        }
        let expiry = self.expiry();
        self.value().map(|record| (record, expiry))
    }

    /// Stores `record` with its absolute expiry, and signals the change.
    pub fn store(&self, record: Record) {
        let expires_at = record.expires_at;
        // SAFETY: a key opened for writing; Redis owns the box from here and
        // frees it with the type's free callback.
        unsafe {
            api!(RedisModule_ModuleTypeSetValue)(
                self.ptr,
                TYPE.load(Ordering::Relaxed),
                super::datatype::into_raw(record),
            );
        }
        self.set_abs_expire(expires_at);
        self.modified();
    }

    /// Tells Redis the key changed: WATCHers abort, tracking clients are
    /// invalidated.
    pub fn modified(&self) {
        // SAFETY: the context and name the key was opened with.
        unsafe { api!(RedisModule_SignalModifiedKey)(self.ctx.raw(), self.name.0) };
    }

    /// Signals the key modified, then reads its record (for changes made in
    /// place through an earlier `record()` borrow).
    pub fn signal_then_record(&mut self) -> Result<Option<&mut Record>, Error> {
        self.modified();
        self.record()
    }

    /// The key's absolute expiry, `NO_EXPIRY` when it has none.
    pub fn expiry(&self) -> u64 {
        // SAFETY: an open key.
        let at = unsafe { api!(RedisModule_GetAbsExpire)(self.ptr) };
        u64::try_from(at).unwrap_or(NO_EXPIRY)
    }

    /// Sets the key's absolute expiry; `NO_EXPIRY` removes it.
    fn set_abs_expire(&self, at_ms: u64) {
        let at = if at_ms == NO_EXPIRY {
            raw::REDISMODULE_NO_EXPIRE as i64
        } else {
            at_ms.min(i64::MAX as u64) as i64
        };
        // SAFETY: a key opened for writing that holds a value.
        unsafe { api!(RedisModule_SetAbsExpire)(self.ptr, at) };
    }

    /// Deletes the key, and signals the change.
    pub fn delete(&self) {
        // SAFETY: a key opened for writing.
        unsafe { api!(RedisModule_DeleteKey)(self.ptr) };
        self.modified();
    }
}

impl Drop for Key {
    fn drop(&mut self) {
        // SAFETY: opened by OpenKey, closed once.
        unsafe { api!(RedisModule_CloseKey)(self.ptr) };
    }
}
