//! Every raw `RedisModule_*` call of the module lives in this folder, behind
//! safe wrappers; the rest of the crate (commands, the data type, the mirror,
//! the waiters) never calls the C API itself. Each `unsafe` block here says
//! why it is sound. The usual reason: Redis hands the module a valid context,
//! key, string or I/O handle for the duration of the callback or command
//! that received it, and calls the module only on its main thread.

pub mod acl;
pub mod blocked;
pub mod call;
pub mod ctx;
pub mod datatype;
pub mod events;
pub mod io;
pub mod key;
pub mod reply;

/// Fetches a C API function pointer. `RedisModule_Init` fills every pointer
/// the running server exports; the ones used unconditionally here exist on
/// Redis 7.0 and later (newer calls are checked with `if let Some`).
macro_rules! api {
    ($name:ident) => {
        redis_module::raw::$name.expect(stringify!($name))
    };
}
pub(crate) use api;

/// Asks the CPU to load up to 1 KiB from `start` into cache while other work
/// goes on (resolving the arguments, writing the reply's first elements).
pub fn prefetch(start: *const u8, len: usize) {
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (start, len);
    #[cfg(target_arch = "x86_64")]
    for offset in (0..len.min(1024)).step_by(64) {
        // SAFETY: a prefetch is a hint that never faults, whatever the
        // address; SSE is part of every x86_64 target.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                start.wrapping_add(offset).cast(),
            )
        };
    }
}
