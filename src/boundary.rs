//! The command boundary: raw arguments in, one reply out, and no panic ever
//! crossing into redis-server. Also the small reply writer the commands use.

use std::ffi::{c_char, c_int, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use idem_core::Error;
use redis_module::raw;
use smallvec::SmallVec;

/// One command invocation: the raw context and its arguments (name excluded).
pub struct Call<'a> {
    pub ctx: *mut raw::RedisModuleCtx,
    argv: *mut *mut raw::RedisModuleString,
    /// Arguments after the command name; no heap allocation for up to 12.
    pub args: SmallVec<[&'a [u8]; 12]>,
}

impl Call<'_> {
    /// The raw string of argument `i` (0 = the first after the name).
    pub fn raw_arg(&self, i: usize) -> *mut raw::RedisModuleString {
        // SAFETY: callers index arguments they have already parsed.
        unsafe { *self.argv.add(i + 1) }
    }

    pub fn reply(&self) -> Reply {
        Reply(self.ctx)
    }

    pub fn flags(&self) -> c_int {
        unsafe { raw::RedisModule_GetContextFlags.expect("GetContextFlags")(self.ctx) }
    }

    pub fn db(&self) -> i32 {
        unsafe { raw::RedisModule_GetSelectedDb.expect("GetSelectedDb")(self.ctx) }
    }
}

/// The bytes of a Redis string, borrowed.
pub fn bytes<'a>(s: *const raw::RedisModuleString) -> &'a [u8] {
    let mut len = 0;
    // SAFETY: Redis keeps argv strings alive for the whole call.
    unsafe {
        let p = raw::RedisModule_StringPtrLen.expect("StringPtrLen")(s, &mut len);
        if p.is_null() {
            &[]
        } else {
            std::slice::from_raw_parts(p.cast::<u8>(), len)
        }
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
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let args = (1..argc.max(1) as usize)
            .map(|i| bytes(unsafe { *argv.add(i) }))
            .collect();
        handler(&Call { ctx, argv, args })
    }));
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(e)) => Reply(ctx).error(&e),
        Err(_) => Reply(ctx).error(&Error::Internal(
            "command panicked; nothing was changed".into(),
        )),
    }
    raw::Status::Ok as c_int
}

/// Runs a callback body that Redis calls outside a command; a panic is logged
/// and `fallback` returned instead of unwinding into Redis.
pub fn guard<T>(what: &str, fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        log_warning(&format!("idem: panic caught in {what}"));
        fallback
    })
}

pub fn log_warning(msg: &str) {
    if let Ok(msg) = CString::new(msg) {
        unsafe {
            raw::RedisModule_Log.expect("Log")(
                std::ptr::null_mut(),
                c"warning".as_ptr(),
                c"%s".as_ptr(),
                msg.as_ptr(),
            )
        };
    }
}

/// Defines an `extern "C"` command entry point for a handler.
macro_rules! entry_point {
    ($name:ident, $handler:path) => {
        pub extern "C" fn $name(
            ctx: *mut redis_module::raw::RedisModuleCtx,
            argv: *mut *mut redis_module::raw::RedisModuleString,
            argc: std::ffi::c_int,
        ) -> std::ffi::c_int {
            $crate::boundary::run(ctx, argv, argc, $handler)
        }
    };
}
pub(crate) use entry_point;

/// Writes RESP replies on a context.
#[derive(Clone, Copy)]
pub struct Reply(pub *mut raw::RedisModuleCtx);

impl Reply {
    pub fn array(self, len: usize) {
        unsafe { raw::RedisModule_ReplyWithArray.expect("ReplyWithArray")(self.0, len as _) };
    }

    pub fn int(self, v: u64) {
        unsafe {
            raw::RedisModule_ReplyWithLongLong.expect("ReplyWithLongLong")(
                self.0,
                v.min(i64::MAX as u64) as i64,
            )
        };
    }

    pub fn signed(self, v: i64) {
        unsafe { raw::RedisModule_ReplyWithLongLong.expect("ReplyWithLongLong")(self.0, v) };
    }

    pub fn bulk(self, b: &[u8]) {
        unsafe {
            raw::RedisModule_ReplyWithStringBuffer.expect("ReplyWithStringBuffer")(
                self.0,
                b.as_ptr().cast::<c_char>(),
                b.len(),
            )
        };
    }

    /// A simple string; `s` must be NUL-terminated and contain no CR/LF.
    pub fn simple(self, s: &std::ffi::CStr) {
        unsafe {
            raw::RedisModule_ReplyWithSimpleString.expect("ReplyWithSimpleString")(
                self.0,
                s.as_ptr(),
            )
        };
    }

    pub fn null(self) {
        unsafe { raw::RedisModule_ReplyWithNull.expect("ReplyWithNull")(self.0) };
    }

    pub fn error(self, e: &Error) {
        let text = e.to_string().replace(['\r', '\n', '\0'], " ");
        let text = CString::new(text).expect("NULs were replaced");
        unsafe { raw::RedisModule_ReplyWithError.expect("ReplyWithError")(self.0, text.as_ptr()) };
    }
}
