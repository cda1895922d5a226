//! The module's command names, spelled once: the module registers them, the
//! encoders and the in-memory store use them.

use std::ffi::CStr;

pub const BEGIN: &str = "IDEM.BEGIN";
pub const COMPLETE: &str = "IDEM.COMPLETE";
pub const ABORT: &str = "IDEM.ABORT";
pub const TOUCH: &str = "IDEM.TOUCH";
pub const GET: &str = "IDEM.GET";
/// Internal: the effect a primary replicates (never sent by clients).
pub const PUT: &str = as_str(PUT_C);
/// `PUT` as Redis' C API takes it (`RedisModule_Replicate`, AOF rewrite).
pub const PUT_C: &CStr = c"IDEM._PUT";
pub const MIRROR_PULL: &str = "IDEM.MIRROR.PULL";
pub const MIRROR_ACK: &str = "IDEM.MIRROR.ACK";

/// A C string constant as `&str` (command names are ASCII).
const fn as_str(name: &'static CStr) -> &'static str {
    match std::str::from_utf8(name.to_bytes()) {
        Ok(s) => s,
        Err(_) => panic!("command names are ASCII"),
    }
}
