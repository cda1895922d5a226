//! When the node's fencing-token clock (`TOKENS`) jumps ahead: after a
//! dataset load on a primary (a restart from a snapshot may lack the tail
//! of what it issued) and when this node becomes a primary (a replica knows
//! only the tokens it applied). See `idem_core::token::JUMP_MS`.

use std::ffi::c_void;

use redis_module::raw;

use crate::ffi::call::guard;
use crate::ffi::ctx::{now_ms, Ctx};
use crate::ffi::events::{loading_ended, subscribe_server, ServerEvent};
use crate::TOKENS;

/// Follows loads (at module load; role changes arrive through
/// `consumers`, which holds that subscription, and call `jump`).
pub fn start(ctx: Ctx) -> Result<(), String> {
    subscribe_server(ctx, ServerEvent::Loading, on_loading)
}

/// Moves the token clock past every token this node may have missed.
pub fn jump() {
    TOKENS.lock().jump(now_ms());
}

extern "C" fn on_loading(
    ctx: *mut raw::RedisModuleCtx,
    _event: raw::RedisModuleEvent,
    subevent: u64,
    _data: *mut c_void,
) {
    guard("loading event", (), || {
        // A replica's loads need none: it jumps when it becomes a primary.
        if loading_ended(subevent) && !Ctx::from_raw(ctx).is_replica() {
            jump();
        }
    })
}
