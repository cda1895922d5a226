//! A module data type's callbacks: Redis hands them a value as a raw
//! pointer; here it becomes the Rust value a `ModuleValue` implementation
//! sees, and the value's `Box` is made and freed only here.

use std::ffi::{c_int, c_void};
use std::ptr;

use redis_module::raw;

use super::call::guard;
use super::ctx::Name;
use super::io::{digest_add, Aof, Rdb};

/// A value stored in Redis as a module type.
pub trait ModuleValue: Sized + 'static {
    /// Loads a value `rdb_save` wrote with encoding version `encver`; None
    /// (logged by the implementation) makes the load fail.
    fn rdb_load(io: Rdb, encver: c_int) -> Option<Self>;
    /// The bytes RDB keeps.
    fn rdb_save(&self) -> Vec<u8>;
    /// Emits what rebuilds the value under `key` in a rewritten AOF.
    fn aof_rewrite(&self, aof: &Aof, key: Name);
    /// Bytes of memory the value uses (`MEMORY USAGE`).
    fn mem_usage(&self) -> usize;
    /// The bytes `DEBUG DIGEST` hashes.
    fn digest(&self) -> Vec<u8>;
    /// The value `COPY` stores under another name.
    fn copy_to_another_name(&self) -> Self;
}

/// The callback table of a module type whose values are `T`.
pub const fn methods<T: ModuleValue>() -> raw::RedisModuleTypeMethods {
    raw::RedisModuleTypeMethods {
        version: redis_module::TYPE_METHOD_VERSION,
        rdb_load: Some(rdb_load::<T>),
        rdb_save: Some(rdb_save::<T>),
        aof_rewrite: Some(aof_rewrite::<T>),
        mem_usage: Some(mem_usage::<T>),
        digest: Some(digest::<T>),
        free: Some(free::<T>),
        aux_load: None,
        aux_save: None,
        aux_save2: None,
        aux_save_triggers: 0,
        free_effort: None,
        unlink: None,
        copy: Some(copy::<T>),
        defrag: None,
        mem_usage2: None,
        free_effort2: None,
        unlink2: None,
        copy2: None,
    }
}

/// Stores `value` as a module value: Redis owns it until `free::<T>`.
pub fn into_raw<T: ModuleValue>(value: T) -> *mut c_void {
    Box::into_raw(Box::new(value)).cast()
}

/// The value behind a pointer Redis passes to one of these callbacks.
fn value<'a, T: ModuleValue>(value: *const c_void) -> &'a T {
    // SAFETY: Redis passes these callbacks only values of the type they
    // were registered for: each a Box<T> made by `into_raw`, alive until
    // the type's free callback.
    unsafe { &*value.cast::<T>() }
}

extern "C" fn rdb_save<T: ModuleValue>(io: *mut raw::RedisModuleIO, v: *mut c_void) {
    guard("rdb_save", (), || {
        Rdb::from_raw(io).save_buffer(&value::<T>(v).rdb_save())
    })
}

extern "C" fn rdb_load<T: ModuleValue>(io: *mut raw::RedisModuleIO, encver: c_int) -> *mut c_void {
    guard("rdb_load", ptr::null_mut(), || {
        T::rdb_load(Rdb::from_raw(io), encver).map_or(ptr::null_mut(), into_raw)
    })
}

extern "C" fn aof_rewrite<T: ModuleValue>(
    aof: *mut raw::RedisModuleIO,
    key: *mut raw::RedisModuleString,
    v: *mut c_void,
) {
    guard("aof_rewrite", (), || {
        value::<T>(v).aof_rewrite(&Aof::from_raw(aof), Name::from_raw(key))
    })
}

extern "C" fn mem_usage<T: ModuleValue>(v: *const c_void) -> usize {
    guard("mem_usage", 0, || value::<T>(v).mem_usage())
}

extern "C" fn digest<T: ModuleValue>(md: *mut raw::RedisModuleDigest, v: *mut c_void) {
    guard("digest", (), || digest_add(md, &mut value::<T>(v).digest()))
}

extern "C" fn free<T: ModuleValue>(v: *mut c_void) {
    guard("free", (), || {
        if !v.is_null() {
            // SAFETY: Redis frees each value once; it is the Box `into_raw`
            // made.
            drop(unsafe { Box::from_raw(v.cast::<T>()) })
        }
    })
}

extern "C" fn copy<T: ModuleValue>(
    _from: *mut raw::RedisModuleString,
    _to: *mut raw::RedisModuleString,
    v: *const c_void,
) -> *mut c_void {
    guard("copy", ptr::null_mut(), || {
        into_raw(value::<T>(v).copy_to_another_name())
    })
}
