//! The data type's I/O handles: RDB save/load, AOF rewrite, DEBUG DIGEST,
//! and registering the type's callbacks.

use std::ffi::c_char;

use redis_module::raw;

use super::api;
use super::ctx::{bytes, Ctx, Name};

/// The RDB (or DUMP payload) being written or read.
#[derive(Clone, Copy)]
pub struct Rdb(*mut raw::RedisModuleIO);

impl Rdb {
    pub fn from_raw(io: *mut raw::RedisModuleIO) -> Rdb {
        Rdb(io)
    }

    pub fn save_buffer(self, bytes: &[u8]) {
        // SAFETY: a live I/O handle in rdb_save; Redis copies the bytes.
        unsafe { api!(RedisModule_SaveStringBuffer)(self.0, bytes.as_ptr().cast(), bytes.len()) };
    }

    /// Reads the next string buffer; None on a short or damaged read (the
    /// module sets HANDLE_IO_ERRORS, so Redis reports it instead of aborting).
    pub fn load_buffer(self) -> Option<Vec<u8>> {
        raw::load_string_buffer(self.0)
            .ok()
            .map(|b| b.as_ref().to_vec())
    }

    /// Whether the server is loading a dataset (RDB, full sync, AOF, DEBUG
    /// RELOAD), not running RESTORE.
    pub fn is_loading(self) -> bool {
        // SAFETY: a live I/O handle in rdb_load; its context lives as long.
        let ctx = unsafe { api!(RedisModule_GetContextFromIO)(self.0) };
        Ctx::from_raw(ctx).is_loading()
    }

    /// The key and database being loaded (RDB load, full sync, RESTORE).
    pub fn key_and_db<'a>(self) -> Option<(&'a [u8], i32)> {
        // SAFETY: a live I/O handle in rdb_load; the name (if any) lives as
        // long as the load of this key.
        unsafe {
            let name = api!(RedisModule_GetKeyNameFromIO)(self.0);
            if name.is_null() {
                return None;
            }
            Some((bytes(name), api!(RedisModule_GetDbIdFromIO)(self.0)))
        }
    }
}

/// The AOF being rewritten.
pub struct Aof(*mut raw::RedisModuleIO);

impl Aof {
    pub fn from_raw(io: *mut raw::RedisModuleIO) -> Aof {
        Aof(io)
    }

    /// Emits `cmd key blob`.
    pub fn emit_key_blob(&self, cmd: &std::ffi::CStr, key: Name, blob: &[u8]) {
        // SAFETY: a live AOF handle; "sb" matches (string, buffer + length).
        unsafe {
            api!(RedisModule_EmitAOF)(
                self.0,
                cmd.as_ptr(),
                c"sb".as_ptr(),
                key.0,
                blob.as_ptr().cast::<c_char>(),
                blob.len(),
            )
        };
    }
}

/// Adds one element to a DEBUG DIGEST.
pub fn digest_add(md: *mut raw::RedisModuleDigest, bytes: &mut [u8]) {
    // SAFETY: a live digest handle; Redis reads the bytes.
    unsafe {
        api!(RedisModule_DigestAddStringBuffer)(
            md,
            bytes.as_mut_ptr().cast::<c_char>(),
            bytes.len(),
        );
        api!(RedisModule_DigestEndSequence)(md);
    }
}
