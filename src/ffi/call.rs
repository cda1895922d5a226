//! The command boundary: raw arguments in, one reply out, and no panic ever
//! crossing into redis-server; also command registration.

use std::ffi::{c_int, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use idem_core::Error;
use redis_module::raw;
use smallvec::SmallVec;

use super::api;
use super::ctx::{bytes, log_warning, Ctx, Name};

/// One command invocation: its context and arguments (name excluded).
pub struct Call<'a> {
    pub ctx: Ctx,
    argv: *mut *mut raw::RedisModuleString,
    /// Arguments after the command name; no heap allocation for up to 12.
    pub args: SmallVec<[&'a [u8]; 12]>,
}

impl Call<'_> {
    /// Argument `i` (0 = the first after the name) as a Redis string.
    pub fn name(&self, i: usize) -> Name {
        assert!(i < self.args.len(), "argument {i} was not passed");
        // SAFETY: argv has argc entries, and i + 1 < argc (checked above).
        Name::from_raw(unsafe { *self.argv.add(i + 1) })
    }

    /// The key argument (every keyed command has it first).
    pub fn key(&self) -> Name {
        self.name(0)
    }
}

pub type Handler = fn(&Call) -> Result<(), Error>;

/// Runs `handler`; an error or a caught panic becomes an error reply.
/// Handlers decide fully before writing their reply, so an error never
/// follows a partial reply.
pub fn run(
    ctx: *mut raw::RedisModuleCtx,
    argv: *mut *mut raw::RedisModuleString,
    argc: c_int,
    handler: Handler,
) -> c_int {
    let ctx = Ctx::from_raw(ctx);
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        handler(&Call {
            ctx,
            argv,
            args: arg_bytes(argv, argc),
        })
    }));
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(e)) => ctx.reply().error(&e),
        Err(_) => ctx.reply().error(&Error::Internal(
            "command panicked; nothing was changed".into(),
        )),
    }
    raw::Status::Ok as c_int
}

/// The arguments after the command name, borrowed from Redis (a command's
/// or a blocked client's `argv`).
pub fn arg_bytes<'a>(
    argv: *mut *mut raw::RedisModuleString,
    argc: c_int,
) -> SmallVec<[&'a [u8]; 12]> {
    (1..argc.max(1) as usize)
        // SAFETY: Redis passes argc valid strings in argv, alive for the
        // command or callback.
        .map(|i| bytes(unsafe { *argv.add(i) }))
        .collect()
}

/// Runs a callback body that Redis calls outside a command; a panic is logged
/// and `fallback` returned instead of unwinding into Redis.
pub fn guard<T>(what: &str, fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        log_warning(&format!("idem: panic caught in {what}"));
        fallback
    })
}

/// Defines an `extern "C"` command entry point for a handler.
macro_rules! entry_point {
    ($name:ident, $handler:path) => {
        pub extern "C" fn $name(
            ctx: *mut redis_module::raw::RedisModuleCtx,
            argv: *mut *mut redis_module::raw::RedisModuleString,
            argc: std::ffi::c_int,
        ) -> std::ffi::c_int {
            $crate::ffi::call::run(ctx, argv, argc, $handler)
        }
    };
}
pub(crate) use entry_point;

pub type EntryPoint =
    extern "C" fn(*mut raw::RedisModuleCtx, *mut *mut raw::RedisModuleString, c_int) -> c_int;

/// Registers a command whose only key (if `keyed`) is argument 1.
pub fn create_command(
    ctx: Ctx,
    name: &str,
    entry: EntryPoint,
    flags: &str,
    keyed: bool,
) -> Result<(), String> {
    let (first, last, step) = if keyed { (1, 1, 1) } else { (0, 0, 0) };
    let cname = CString::new(name).map_err(|_| format!("bad command name {name}"))?;
    let cflags = CString::new(flags).map_err(|_| format!("bad flags {flags}"))?;
    // SAFETY: a live load context; Redis copies name and flags.
    let status = unsafe {
        api!(RedisModule_CreateCommand)(
            ctx.raw(),
            cname.as_ptr(),
            Some(entry),
            cflags.as_ptr(),
            first,
            last,
            step,
        )
    };
    if status == raw::REDISMODULE_OK as c_int {
        Ok(())
    } else {
        Err(format!("cannot register {name}"))
    }
}
