//! Known defects of the servers idem loads into, checked at load and logged.

use crate::ffi::ctx::{log_warning, Ctx};

/// Valkey releases from 8.0 up to (not including) 9.1.1 leave a client that
/// ran `MOVE key db` or `COPY src dst DB db` switched to the destination
/// database when a module subscribes to generic keyspace events, as idem
/// does (fixed in Valkey 9.1.1; tests/database_switch.rs shows it).
const VALKEY_DB_SWITCH: ([u32; 3], [u32; 3]) = ([8, 0, 0], [9, 1, 1]);

pub fn check(ctx: Ctx) {
    let Some(version) = ctx.server_info_field(c"server", c"valkey_version") else {
        return;
    };
    if let Some(warning) = valkey_warning(&version) {
        log_warning(&warning);
    }
}

fn valkey_warning(version: &str) -> Option<String> {
    let parts: Vec<u32> = version.split('.').map_while(|p| p.parse().ok()).collect();
    let v = [0, 1, 2].map(|i| parts.get(i).copied().unwrap_or(0));
    let (from, fixed) = VALKEY_DB_SWITCH;
    (from..fixed).contains(&v).then(|| {
        format!(
            "idem: Valkey {version} has a bug that idem's keyspace events trigger: a client that runs \
             MOVE or COPY ... DB stays switched to the destination database. Upgrade to Valkey \
             9.1.1 or later, or have clients SELECT their database again after MOVE/COPY ... DB."
        )
    })
}
