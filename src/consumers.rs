//! Whether anything consumes the effects idem propagates.
//!
//! Redis feeds a propagated command to the AOF when it is on, and to the
//! replication backlog and replicas when either exists; otherwise it drops
//! it (`shouldPropagate` in `server.c`). Building an effect
//! (`RedisModule_Replicate`: a command lookup, argument objects, the
//! record's encoding with its SHA-256) is most of what a new record costs
//! beyond `SET NX EX`, so a node nothing consumes from skips it and only
//! counts the change towards the `save` points (`effects`).
//!
//! The answer starts as "consumed" and stays so on any doubt:
//! - a check every `CHECK_EVERY_MS` (INFO `replication` and `persistence`)
//!   turns it off only on a primary with no replica, no backlog, the AOF off
//!   and no child process, outside cluster mode (Valkey 9 streams a slot
//!   being migrated to its new node with no replica, backlog or lasting
//!   child: `CLUSTER MIGRATESLOTS`);
//! - every fork turns it on at once, before any later command runs. A replica's
//!   full sync or an AOF rewrite starts with a fork, and only what happens
//!   after that fork has to reach it: everything before is in the snapshot.
//!   A role change or a replica coming or going turns it on too.

use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};

use redis_module::raw;

use crate::ffi::blocked::Timer;
use crate::ffi::call::guard;
use crate::ffi::ctx::Ctx;
use crate::ffi::events::{became_primary, subscribe_server, ServerEvent};
use crate::tokens;

/// How often a node checks whether its effects have consumers.
pub const CHECK_EVERY_MS: u64 = 1000;

/// Main thread only; relaxed is enough.
static CONSUMED: AtomicBool = AtomicBool::new(true);

/// Whether a propagated effect would reach the AOF, a backlog or a replica.
pub fn consumed() -> bool {
    CONSUMED.load(Ordering::Relaxed)
}

/// Follows forks and replication changes, and starts the periodic check
/// (at load).
pub fn start(ctx: Ctx) -> Result<(), String> {
    for event in [
        ServerEvent::ForkChild,
        ServerEvent::RoleChanged,
        ServerEvent::ReplicaChange,
    ] {
        subscribe_server(ctx, event, on_change)?;
    }
    Timer::start(ctx, CHECK_EVERY_MS, (), on_timer);
    Ok(())
}

/// One subscription per event and module: a role change also moves the
/// token clock (`tokens`) when this node became a primary.
extern "C" fn on_change(
    _ctx: *mut raw::RedisModuleCtx,
    event: raw::RedisModuleEvent,
    subevent: u64,
    _data: *mut c_void,
) {
    CONSUMED.store(true, Ordering::Relaxed);
    if became_primary(event, subevent) {
        guard("role change", (), tokens::jump);
    }
}

fn on_timer(ctx: Ctx, (): ()) {
    guard("consumers check", (), || {
        CONSUMED.store(has_consumers(ctx), Ordering::Relaxed);
    });
    Timer::start(ctx, CHECK_EVERY_MS, (), on_timer);
}

/// The INFO fields that must all read as below for nothing to consume
/// effects; a field missing (another server's INFO) counts as a consumer.
const QUIET: [(&CStr, &CStr, &[&str]); 4] = [
    (c"replication", c"role", &["master", "primary"]),
    (c"replication", c"connected_slaves", &["0"]),
    (c"replication", c"repl_backlog_active", &["0"]),
    (c"persistence", c"aof_enabled", &["0"]),
];

fn has_consumers(ctx: Ctx) -> bool {
    if ctx.in_cluster_or_forked() {
        return true;
    }
    [c"replication", c"persistence"].into_iter().any(|section| {
        let wanted: Vec<_> = QUIET.iter().filter(|q| q.0 == section).collect();
        let fields: Vec<&CStr> = wanted.iter().map(|q| q.1).collect();
        ctx.server_info_fields(section, &fields)
            .iter()
            .zip(&wanted)
            .any(|(value, q)| !value.as_deref().is_some_and(|v| q.2.contains(&v)))
    })
}
