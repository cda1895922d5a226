//! Fuzz target: every argument parser on arbitrary arguments (the input
//! split at NUL bytes) answers a value or BADARG/TOOLARGE, never panics.
#![no_main]

use idem_core::args::{self, Limits};
use idem_core::wire::ErrorCode;
use libfuzzer_sys::fuzz_target;

const LIMITS: Limits = Limits {
    max_ttl_secs: 2_592_000,
    max_body_bytes: 1 << 20,
    default_lease_ms: 30_000,
};

fuzz_target!(|data: &[u8]| {
    let a: Vec<&[u8]> = data.split(|&b| b == 0).collect();
    let codes = [
        args::begin(&a, &LIMITS).err(),
        args::complete(&a, &LIMITS).err(),
        args::key_token(&a, "usage").err(),
        args::touch(&a).err(),
        args::pull(&a, 30_000).err(),
    ];
    for e in codes.into_iter().flatten() {
        assert!(
            matches!(e.code(), ErrorCode::BadArg | ErrorCode::TooLarge),
            "{e}"
        );
    }
});
