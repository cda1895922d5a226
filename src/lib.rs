//! The idem Redis module: atomic four-outcome idempotency keys.
//!
//! This crate is the FFI layer only: it registers the commands, the data
//! type, configs and INFO, and translates between Redis and `idem-core`,
//! where the decisions and the encoding live.

#![warn(clippy::undocumented_unsafe_blocks)]

use redis_module::{
    configuration::ConfigurationFlags, raw, redis_module, Context, RedisString, Status,
};

mod commands;
mod compat;
mod config;
mod consumers;
mod datatype;
mod effects;
mod ffi;
mod info;
mod mirror;
mod stats;
mod tokens;
mod waiters;

use std::sync::{Mutex, MutexGuard};

use idem_core::token::TokenClock;

use config::{
    EFFECT_FORMAT, LEASE_MS, MAX_BODY_BYTES, MAX_HEADERS, MAX_TTL, MIRROR_CLAIM_MS,
    MIRROR_MAX_CLAIM_MS,
};
use datatype::IDEM_TYPE;
use ffi::ctx::{log_warning, Ctx};

/// Module state touched only on Redis' main thread; the mutex is uncontended
/// and a poisoned lock (a caught panic) is still usable.
pub struct Shared<T>(Mutex<T>);

impl<T> Shared<T> {
    pub const fn new(value: T) -> Self {
        Shared(Mutex::new(value))
    }

    pub fn lock(&self) -> MutexGuard<'_, T> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Issues fencing tokens on this node.
pub static TOKENS: Shared<TokenClock> = Shared::new(TokenClock::new());

fn init(ctx: &Context, args: &[RedisString]) -> Status {
    let args: Vec<&[u8]> = args.iter().map(RedisString::as_slice).collect();
    if let Err(e) = config::check_load_args(&args) {
        ctx.log_warning(&format!("idem: {e}"));
        return Status::Err;
    }
    let ctx = Ctx::from_raw(ctx.get_raw());
    // Short reads are errors, not aborts; commands signal a modified key
    // themselves, and only when they change it (a replay must not abort a
    // WATCH): ffi::key.
    ctx.set_module_options(
        raw::REDISMODULE_OPTIONS_HANDLE_IO_ERRORS
            | raw::REDISMODULE_OPTION_NO_IMPLICIT_SIGNAL_MODIFIED,
    );
    ffi::key::set_record_type(*IDEM_TYPE.raw_type.borrow());
    info::register(ctx);
    compat::check(ctx);
    match commands::register(ctx)
        .and_then(|()| mirror::events::subscribe(ctx))
        .and_then(|()| consumers::start(ctx))
        .and_then(|()| tokens::start(ctx))
    {
        Ok(()) => Status::Ok,
        Err(e) => {
            log_warning(&format!("idem: {e}"));
            Status::Err
        }
    }
}

redis_module! {
    name: "idem",
    version: 1,
    allocator: (redis_module::alloc::RedisAlloc, redis_module::alloc::RedisAlloc),
    data_types: [IDEM_TYPE],
    init: init,
    commands: [],
    configurations: [
        i64: [
            ["lease-ms", &LEASE_MS, config::LEASE_MS_DEFAULT, 1, config::MAX_MS, ConfigurationFlags::DEFAULT, None],
            ["max-ttl", &MAX_TTL, config::MAX_TTL_DEFAULT, 1, config::MAX_TTL_LIMIT, ConfigurationFlags::DEFAULT, None],
            ["max-body-bytes", &MAX_BODY_BYTES, config::MAX_BODY_BYTES_DEFAULT, 0, config::MAX_BODY_LIMIT, ConfigurationFlags::DEFAULT, None],
            ["mirror-claim-ms", &MIRROR_CLAIM_MS, config::MIRROR_CLAIM_MS_DEFAULT, 1, config::MAX_MS, ConfigurationFlags::DEFAULT, None],
            ["mirror-max-claim-ms", &MIRROR_MAX_CLAIM_MS, config::MIRROR_MAX_CLAIM_MS_DEFAULT, 1, config::MAX_MS, ConfigurationFlags::DEFAULT, None],
            ["max-headers", &MAX_HEADERS, config::MAX_HEADERS_DEFAULT, 0, config::MAX_HEADERS_LIMIT, ConfigurationFlags::DEFAULT, None],
            ["effect-format", &EFFECT_FORMAT, config::EFFECT_FORMAT_DEFAULT, 1, config::EFFECT_FORMAT_SENT, ConfigurationFlags::DEFAULT, None],
        ],
        string: [],
        bool: [],
        enum: [],
        module_args_as_configuration: true,
    ]
}
