//! Access control: what each command does to its key (key specs, so ACL
//! key permissions such as `%R~pay:*` mean what they say), ACL categories
//! where the server supports them for module commands (7.2+), and the
//! per-key read check of the keyless `IDEM.MIRROR.PULL`.

use std::ffi::{c_int, CString};
use std::ptr;

use redis_module::commands::{get_redis_key_spec, BeginSearch, FindKeys, KeySpec, KeySpecFlags};
use redis_module::raw;

use super::api;
use super::ctx::{bytes, Ctx};

/// What a keyed command does to its one key (argument 1).
#[derive(Clone, Copy)]
pub enum KeyAccess {
    /// Reads and returns the value (`IDEM.GET`).
    Read,
    /// Reads, returns and writes (`IDEM.BEGIN`: a replay returns the body).
    ReadWrite,
    /// Writes without returning user data (COMPLETE, TOUCH, ACK).
    Update,
    /// Writes, possibly deleting the key (ABORT).
    Delete,
    /// Replaces the value whole (`IDEM._PUT`).
    Overwrite,
}

impl KeyAccess {
    fn flags(self) -> KeySpecFlags {
        match self {
            KeyAccess::Read => KeySpecFlags::READ_ONLY | KeySpecFlags::ACCESS,
            KeyAccess::ReadWrite => {
                KeySpecFlags::READ_WRITE | KeySpecFlags::ACCESS | KeySpecFlags::UPDATE
            }
            KeyAccess::Update => KeySpecFlags::READ_WRITE | KeySpecFlags::UPDATE,
            KeyAccess::Delete => KeySpecFlags::READ_WRITE | KeySpecFlags::DELETE,
            KeyAccess::Overwrite => KeySpecFlags::OVERWRITE | KeySpecFlags::UPDATE,
        }
    }
}

/// Declares the command's key spec (replacing the full-access one Redis
/// derives from first/last/step) and, where supported, its ACL categories.
pub fn describe(
    ctx: Ctx,
    name: &str,
    key: Option<KeyAccess>,
    categories: &str,
) -> Result<(), String> {
    let cname = CString::new(name).map_err(|_| format!("bad command name {name}"))?;
    // SAFETY: the command was registered by this module just before.
    let command = unsafe { api!(RedisModule_GetCommand)(ctx.raw(), cname.as_ptr()) };
    if command.is_null() {
        return Err(format!("cannot find {name}"));
    }
    if let Some(access) = key {
        let version = raw::RedisModuleCommandInfoVersion {
            version: 1,
            sizeof_historyentry: std::mem::size_of::<raw::RedisModuleCommandHistoryEntry>(),
            sizeof_keyspec: std::mem::size_of::<raw::RedisModuleCommandKeySpec>(),
            sizeof_arg: std::mem::size_of::<raw::RedisModuleCommandArg>(),
        };
        // One key at argument 1; zero-terminated by get_redis_key_spec.
        let mut specs = get_redis_key_spec(vec![KeySpec::new(
            None,
            access.flags(),
            BeginSearch::new_index(1),
            FindKeys::new_range(0, 1, 0),
        )]);
        let mut info = raw::RedisModuleCommandInfo {
            version: &version,
            summary: ptr::null(),
            complexity: ptr::null(),
            since: ptr::null(),
            history: ptr::null_mut(),
            tips: ptr::null(),
            arity: 0,
            key_specs: specs.as_mut_ptr(),
            args: ptr::null_mut(),
        };
        // SAFETY: `info` and `specs` outlive the call; Redis copies them.
        let status = unsafe { api!(RedisModule_SetCommandInfo)(command, &mut info) };
        if status != raw::REDISMODULE_OK as c_int {
            return Err(format!("cannot set the key spec of {name}"));
        }
    }
    // Module commands have ACL categories from Redis 7.2 on; 7.0 lacks the
    // call (the pointer stays unset) and puts them in no category.
    // SAFETY: reading a function pointer RedisModule_Init filled (or not).
    if let Some(set_categories) = unsafe { raw::RedisModule_SetCommandACLCategories } {
        let cats = CString::new(categories).map_err(|_| "bad categories".to_string())?;
        // SAFETY: plain FFI call on a command of this module, during load.
        if unsafe { set_categories(command, cats.as_ptr()) } != raw::REDISMODULE_OK as c_int {
            return Err(format!("cannot set the ACL categories of {name}"));
        }
    }
    Ok(())
}

/// The ACL user behind a command's client, for per-key checks of keyless
/// commands.
pub struct Caller {
    ctx: Ctx,
    who: Who,
}

enum Who {
    /// No client user to check (replication stream, AOF).
    Trusted,
    User(*mut raw::RedisModuleUser),
    /// The client's user no longer exists (ACL DELUSER meanwhile).
    Gone,
}

/// The name of the ACL user behind the context's client; None for the
/// replication stream and the AOF, which are trusted.
pub fn user_name(ctx: Ctx) -> Option<Vec<u8>> {
    if ctx.is_replicated() {
        return None;
    }
    // SAFETY: a command's (or a blocked client's reply) context has a client
    // with a user; the name is copied before it is freed.
    unsafe {
        let name = api!(RedisModule_GetCurrentUserName)(ctx.raw());
        let copy = bytes(name).to_vec();
        api!(RedisModule_FreeString)(ctx.raw(), name);
        Some(copy)
    }
}

impl Caller {
    pub fn of(ctx: Ctx) -> Caller {
        match user_name(ctx) {
            Some(name) => Caller::named(ctx, &name),
            None => Caller {
                ctx,
                who: Who::Trusted,
            },
        }
    }

    /// The ACL user called `name`, as it is now: a blocked client's user may
    /// have changed or gone since it blocked. `ctx` may be detached.
    pub fn named(ctx: Ctx, name: &[u8]) -> Caller {
        let name = ctx.string(name);
        // SAFETY: a string alive for the call; the user is freed on drop.
        let user = unsafe { api!(RedisModule_GetModuleUserFromUserName)(name.name().0) };
        let who = if user.is_null() {
            Who::Gone
        } else {
            Who::User(user)
        };
        Caller { ctx, who }
    }

    /// May this caller read the value under `key`?
    pub fn may_read(&self, key: &[u8]) -> bool {
        let user = match self.who {
            Who::Trusted => return true,
            Who::Gone => return false,
            Who::User(user) => user,
        };
        let name = self.ctx.string(key);
        // SAFETY: a user from GetModuleUserFromUserName (freed on drop) and a
        // string alive for the call.
        unsafe {
            api!(RedisModule_ACLCheckKeyPermissions)(
                user,
                name.name().0,
                raw::REDISMODULE_CMD_KEY_ACCESS as c_int,
            ) == raw::REDISMODULE_OK as c_int
        }
    }
}

impl Drop for Caller {
    fn drop(&mut self) {
        if let Who::User(user) = self.who {
            // SAFETY: obtained from GetModuleUserFromUserName, freed once.
            unsafe { api!(RedisModule_FreeModuleUser)(user) };
        }
    }
}
