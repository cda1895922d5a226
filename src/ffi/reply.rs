//! Writing replies on a context: the module's `wire::ReplySink`.

use std::ffi::{c_char, CStr, CString};

use idem_core::wire::ReplySink;
use idem_core::Error;
use redis_module::raw;

use super::api;

/// The reply of the command (or blocked client's callback) on `ctx`.
#[derive(Clone, Copy)]
pub struct Reply(*mut raw::RedisModuleCtx);

impl Reply {
    pub(super) fn new(ctx: *mut raw::RedisModuleCtx) -> Reply {
        Reply(ctx)
    }

    /// An error reply: the error's text, code word first.
    pub fn error(self, e: &Error) {
        let text = e.to_string().replace(['\r', '\n', '\0'], " ");
        let text = CString::new(text).expect("NULs were replaced");
        // SAFETY: a live reply context; Redis copies the text.
        unsafe { api!(RedisModule_ReplyWithError)(self.0, text.as_ptr()) };
    }

    pub fn ok(mut self) {
        self.simple(c"OK");
    }
}

impl ReplySink for Reply {
    fn array(&mut self, len: usize) {
        // SAFETY: a live reply context.
        unsafe { api!(RedisModule_ReplyWithArray)(self.0, len as _) };
    }

    fn int(&mut self, v: i64) {
        // SAFETY: a live reply context.
        unsafe { api!(RedisModule_ReplyWithLongLong)(self.0, v) };
    }

    fn bulk(&mut self, b: &[u8]) {
        // SAFETY: a live reply context; Redis copies the bytes.
        unsafe {
            api!(RedisModule_ReplyWithStringBuffer)(self.0, b.as_ptr().cast::<c_char>(), b.len())
        };
    }

    fn simple(&mut self, s: &'static CStr) {
        // SAFETY: a live reply context; `s` is NUL-terminated, no CR/LF.
        unsafe { api!(RedisModule_ReplyWithSimpleString)(self.0, s.as_ptr()) };
    }

    fn null(&mut self) {
        // SAFETY: a live reply context.
        unsafe { api!(RedisModule_ReplyWithNull)(self.0) };
    }
}
