//! Module configs (`idem.<name>` in CONFIG GET/SET, or load arguments).

use std::sync::atomic::{AtomicI64, Ordering};

use idem_core::args::Limits;

/// Defaults of the configs (the limits are idem-core's `Limits::DEFAULT`).
pub const LEASE_MS_DEFAULT: i64 = Limits::DEFAULT.default_lease_ms as i64;
pub const MAX_TTL_DEFAULT: i64 = Limits::DEFAULT.max_ttl_secs as i64;
pub const MAX_BODY_BYTES_DEFAULT: i64 = Limits::DEFAULT.max_body_bytes as i64;
pub const MIRROR_CLAIM_MS_DEFAULT: i64 = 30_000;
/// The longest claim `IDEM.MIRROR.PULL` grants: five minutes.
pub const MIRROR_MAX_CLAIM_MS_DEFAULT: i64 = 300_000;
pub const MAX_HEADERS_DEFAULT: i64 = Limits::DEFAULT.max_headers as i64;
/// Upper bound of `max-headers`.
pub const MAX_HEADERS_LIMIT: i64 = 65_535;
/// Record format of replication effects: 1 (every module version reads it)
/// until every node runs a module that reads format 2 (`codec`).
pub const EFFECT_FORMAT_DEFAULT: i64 = 1;
/// `effect-format` of effects that keep a 32-byte fingerprint as sent: the
/// config's upper bound.
pub const EFFECT_FORMAT_SENT: i64 = idem_core::codec::FORMAT_SENT as i64;

pub static LEASE_MS: AtomicI64 = AtomicI64::new(LEASE_MS_DEFAULT);
pub static MAX_TTL: AtomicI64 = AtomicI64::new(MAX_TTL_DEFAULT);
pub static MAX_BODY_BYTES: AtomicI64 = AtomicI64::new(MAX_BODY_BYTES_DEFAULT);
pub static MIRROR_CLAIM_MS: AtomicI64 = AtomicI64::new(MIRROR_CLAIM_MS_DEFAULT);
pub static MIRROR_MAX_CLAIM_MS: AtomicI64 = AtomicI64::new(MIRROR_MAX_CLAIM_MS_DEFAULT);
pub static MAX_HEADERS: AtomicI64 = AtomicI64::new(MAX_HEADERS_DEFAULT);
pub static EFFECT_FORMAT: AtomicI64 = AtomicI64::new(EFFECT_FORMAT_DEFAULT);

/// Upper bound of the millisecond configs: one year.
pub const MAX_MS: i64 = 366 * 24 * 3600 * 1000;
/// Upper bound of `max-ttl`: ten years, in seconds.
pub const MAX_TTL_LIMIT: i64 = 10 * 366 * 24 * 3600;

/// Name, minimum and maximum of each config, as registered in `lib.rs`.
pub const RANGES: &[(&str, i64, i64)] = &[
    ("lease-ms", 1, MAX_MS),
    ("max-ttl", 1, MAX_TTL_LIMIT),
    ("max-body-bytes", 0, MAX_BODY_LIMIT),
    ("mirror-claim-ms", 1, MAX_MS),
    ("mirror-max-claim-ms", 1, MAX_MS),
    ("max-headers", 0, MAX_HEADERS_LIMIT),
    ("effect-format", 1, EFFECT_FORMAT_SENT),
];

/// Upper bound of `max-body-bytes`: what a record may hold at all.
pub const MAX_BODY_LIMIT: i64 = idem_core::record::RESPONSE_LIMIT as i64;

/// Checks the module's load arguments: `name value` pairs of known configs
/// with in-range integer values. A bad argument stops the load, loudly.
pub fn check_load_args(args: &[&[u8]]) -> Result<(), String> {
    if !args.len().is_multiple_of(2) {
        return Err("load arguments must be `name value` pairs".into());
    }
    for pair in args.chunks(2) {
        let name = String::from_utf8_lossy(pair[0]);
        let Some(&(_, min, max)) = RANGES.iter().find(|(n, _, _)| *n == name) else {
            return Err(format!("unknown load argument '{name}'"));
        };
        let value = std::str::from_utf8(pair[1])
            .ok()
            .and_then(|v| v.parse::<i64>().ok());
        match value {
            Some(v) if (min..=max).contains(&v) => {}
            _ => return Err(format!("{name} must be an integer between {min} and {max}")),
        }
    }
    Ok(())
}

fn get(v: &AtomicI64) -> u64 {
    v.load(Ordering::Relaxed).max(0) as u64
}

pub fn limits() -> Limits {
    Limits {
        max_ttl_secs: get(&MAX_TTL),
        max_body_bytes: get(&MAX_BODY_BYTES),
        default_lease_ms: get(&LEASE_MS),
        max_headers: get(&MAX_HEADERS),
    }
}

pub fn mirror_claim_ms() -> u64 {
    get(&MIRROR_CLAIM_MS)
}

pub fn mirror_max_claim_ms() -> u64 {
    get(&MIRROR_MAX_CLAIM_MS)
}

/// Whether effects carry a 32-byte fingerprint as sent (`effect-format 2`).
pub fn effects_keep_sent() -> bool {
    EFFECT_FORMAT.load(Ordering::Relaxed) == EFFECT_FORMAT_SENT
}
