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
