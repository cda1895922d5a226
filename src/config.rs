//! Module configs (`idem.<name>` in CONFIG GET/SET, or load arguments).

use std::sync::atomic::{AtomicI64, Ordering};

use idem_core::args::Limits;

pub static LEASE_MS: AtomicI64 = AtomicI64::new(30_000);
pub static MAX_TTL: AtomicI64 = AtomicI64::new(2_592_000);
pub static MAX_BODY_BYTES: AtomicI64 = AtomicI64::new(1_048_576);
pub static MIRROR_CLAIM_MS: AtomicI64 = AtomicI64::new(30_000);

/// Upper bound of the millisecond configs: one year.
pub const MAX_MS: i64 = 366 * 24 * 3600 * 1000;
/// Upper bound of `max-ttl`: ten years, in seconds.
pub const MAX_TTL_LIMIT: i64 = 10 * 366 * 24 * 3600;

fn get(v: &AtomicI64) -> u64 {
    v.load(Ordering::Relaxed).max(0) as u64
}

pub fn limits() -> Limits {
    Limits {
        max_ttl_secs: get(&MAX_TTL),
        max_body_bytes: get(&MAX_BODY_BYTES),
        default_lease_ms: get(&LEASE_MS),
    }
}

pub fn mirror_claim_ms() -> u64 {
    get(&MIRROR_CLAIM_MS)
}
