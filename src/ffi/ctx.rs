//! A Redis module context (`RedisModuleCtx`): what the module asks of the
//! server while it runs a command or a callback.

use std::ffi::{c_char, c_int, CString};
use std::ptr;

use redis_module::raw;

use super::api;
use super::reply::Reply;

/// A context Redis passed to a command or callback; valid for its duration.
#[derive(Clone, Copy)]
pub struct Ctx(*mut raw::RedisModuleCtx);

/// The context flags that forbid blocking a client.
const NO_BLOCKING: u32 = raw::REDISMODULE_CTX_FLAGS_MULTI
    | raw::REDISMODULE_CTX_FLAGS_LUA
    | raw::REDISMODULE_CTX_FLAGS_DENY_BLOCKING;

impl Ctx {
    /// Wraps the context Redis passed in.
    pub fn from_raw(ctx: *mut raw::RedisModuleCtx) -> Ctx {
        Ctx(ctx)
    }

    /// No context: for calls outside a command or callback that accept
    /// none (`CreateString`, `FreeString`; strings are then not
    /// auto-freed).
    pub fn detached() -> Ctx {
        Ctx(ptr::null_mut())
    }

    pub fn raw(self) -> *mut raw::RedisModuleCtx {
        self.0
    }

    fn flags(self) -> u32 {
        // SAFETY: a live context (module docs).
        unsafe { api!(RedisModule_GetContextFlags)(self.0) as u32 }
    }

    /// The command arrives from the primary or the AOF: apply, never decide.
    pub fn is_replicated(self) -> bool {
        self.flags() & (raw::REDISMODULE_CTX_FLAGS_REPLICATED | raw::REDISMODULE_CTX_FLAGS_LOADING)
            != 0
    }

    /// This node is a replica.
    pub fn is_replica(self) -> bool {
        self.flags() & raw::REDISMODULE_CTX_FLAGS_SLAVE != 0
    }

    /// The server runs in cluster mode.
    pub fn in_cluster(self) -> bool {
        self.flags() & raw::REDISMODULE_CTX_FLAGS_CLUSTER != 0
    }

    /// Cluster mode, or a child process of any kind running (RDB, AOF
    /// rewrite, a module's fork, and whatever kinds later servers add).
    pub fn in_cluster_or_forked(self) -> bool {
        self.flags()
            & (raw::REDISMODULE_CTX_FLAGS_CLUSTER | raw::REDISMODULE_CTX_FLAGS_ACTIVE_CHILD)
            != 0
    }

    /// The server is loading a dataset (RDB, full sync, AOF, DEBUG RELOAD).
    pub fn is_loading(self) -> bool {
        self.flags() & raw::REDISMODULE_CTX_FLAGS_LOADING != 0
    }

    /// The calling client may be blocked (not in MULTI, Lua, or a context
    /// that denies blocking).
    pub fn may_block(self) -> bool {
        self.flags() & NO_BLOCKING == 0
    }

    /// The calling client may wait for a key's holder: it may block, and the
    /// command was not replicated or loaded.
    pub fn may_wait(self) -> bool {
        self.may_block() && !self.is_replicated()
    }

    /// The selected database.
    pub fn db(self) -> i32 {
        // SAFETY: a live context.
        unsafe { api!(RedisModule_GetSelectedDb)(self.0) }
    }

    pub fn select_db(self, db: i32) {
        // SAFETY: a live context; an out-of-range db answers ERR, harmlessly.
        unsafe { api!(RedisModule_SelectDb)(self.0, db) };
    }

    pub fn reply(self) -> Reply {
        Reply::new(self.0)
    }

    /// A Redis string holding `bytes`, freed when dropped.
    pub fn string(self, bytes: &[u8]) -> OwnedString {
        // SAFETY: a live context; Redis copies the bytes.
        let s = unsafe {
            api!(RedisModule_CreateString)(self.0, bytes.as_ptr().cast::<c_char>(), bytes.len())
        };
        OwnedString { ctx: self, s }
    }

    /// Propagates `cmd key blob` to replicas and the AOF (a registered
    /// command; Redis copies the arguments).
    pub fn replicate_key_blob(self, cmd: &std::ffi::CStr, key: Name, blob: &[u8]) {
        // SAFETY: a live context; "sb" matches (string, buffer + length).
        unsafe {
            api!(RedisModule_Replicate)(
                self.0,
                cmd.as_ptr(),
                c"sb".as_ptr(),
                key.0,
                blob.as_ptr().cast::<c_char>(),
                blob.len(),
            )
        };
    }

    /// Propagates `cmd key` to replicas and the AOF.
    pub fn replicate_key(self, cmd: &std::ffi::CStr, key: Name) {
        // SAFETY: a live context; "s" matches one string argument.
        unsafe { api!(RedisModule_Replicate)(self.0, cmd.as_ptr(), c"s".as_ptr(), key.0) };
    }

    /// Propagates the running command as it was called (and, like every
    /// propagation, counts one change towards the `save` points).
    pub fn replicate_verbatim(self) {
        // SAFETY: a live command context.
        unsafe { api!(RedisModule_ReplicateVerbatim)(self.0) };
    }

    /// A field of an INFO section, as text (at load: `server`'s
    /// `valkey_version`, say).
    pub fn server_info_field(
        self,
        section: &std::ffi::CStr,
        field: &std::ffi::CStr,
    ) -> Option<String> {
        self.server_info_fields(section, &[field]).pop().flatten()
    }

    /// Fields of one INFO section, as text, in the order asked (`None`: a
    /// field the server does not report).
    pub fn server_info_fields(
        self,
        section: &std::ffi::CStr,
        fields: &[&std::ffi::CStr],
    ) -> Vec<Option<String>> {
        // SAFETY: a live context; the data is freed below, after the fields
        // (C strings inside it) were copied.
        unsafe {
            let data = api!(RedisModule_GetServerInfo)(self.0, section.as_ptr());
            if data.is_null() {
                return vec![None; fields.len()];
            }
            let out = fields
                .iter()
                .map(|field| {
                    let value = api!(RedisModule_ServerInfoGetFieldC)(data, field.as_ptr());
                    (!value.is_null()).then(|| {
                        std::ffi::CStr::from_ptr(value)
                            .to_string_lossy()
                            .into_owned()
                    })
                })
                .collect();
            api!(RedisModule_FreeServerInfo)(self.0, data);
            out
        }
    }

    /// Sets the module options (at load).
    pub fn set_module_options(self, options: u32) {
        // SAFETY: a live load context.
        unsafe { api!(RedisModule_SetModuleOptions)(self.0, options as c_int) };
    }
}

/// A Redis string the module did not create (an argument, an event's key),
/// valid for the command or callback that received it.
#[derive(Clone, Copy)]
pub struct Name(pub(super) *mut raw::RedisModuleString);

impl Name {
    pub fn from_raw(s: *mut raw::RedisModuleString) -> Name {
        Name(s)
    }

    /// The string's bytes, borrowed.
    pub fn bytes<'a>(self) -> &'a [u8] {
        bytes(self.0)
    }
}

/// The bytes of a Redis string, borrowed for as long as Redis keeps it.
pub fn bytes<'a>(s: *const raw::RedisModuleString) -> &'a [u8] {
    let mut len = 0;
    // SAFETY: `s` is a string Redis keeps alive for the current command or
    // callback; a null pointer reads as empty.
    unsafe {
        if s.is_null() {
            return &[];
        }
        let p = api!(RedisModule_StringPtrLen)(s, &mut len);
        if p.is_null() {
            &[]
        } else {
            std::slice::from_raw_parts(p.cast::<u8>(), len)
        }
    }
}

/// A Redis string created by the module, freed on drop.
pub struct OwnedString {
    ctx: Ctx,
    s: *mut raw::RedisModuleString,
}

impl OwnedString {
    pub fn name(&self) -> Name {
        Name(self.s)
    }
}

impl Drop for OwnedString {
    fn drop(&mut self) {
        // SAFETY: created by CreateString on this context, freed once.
        unsafe { api!(RedisModule_FreeString)(self.ctx.0, self.s) };
    }
}

/// Unix time in milliseconds by the server's clock.
pub fn now_ms() -> u64 {
    // SAFETY: no arguments.
    unsafe { api!(RedisModule_Milliseconds)() as u64 }
}

/// True while clients are paused (`CLIENT PAUSE WRITE|ALL`, failover): code
/// running outside a command must then not write, since Redis asserts that
/// nothing is propagated during a pause.
pub fn writes_paused() -> bool {
    // SAFETY: no arguments.
    unsafe { api!(RedisModule_AvoidReplicaTraffic)() != 0 }
}

/// True when used memory (less replication and AOF buffers) is above
/// `maxmemory`: what makes Redis refuse a `deny-oom` command.
pub fn out_of_memory() -> bool {
    // SAFETY: no arguments; 0 when no `maxmemory` is set.
    unsafe { api!(RedisModule_GetUsedMemoryRatio)() > 1.0 }
}

/// Writes a warning to the server log.
pub fn log_warning(msg: &str) {
    let Ok(msg) = CString::new(msg.replace('\0', " ")) else {
        return;
    };
    // SAFETY: a null context logs as the module; "%s" takes one C string.
    unsafe {
        api!(RedisModule_Log)(
            ptr::null_mut(),
            c"warning".as_ptr(),
            c"%s".as_ptr(),
            msg.as_ptr(),
        )
    };
}
