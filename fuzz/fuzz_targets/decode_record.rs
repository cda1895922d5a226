//! Fuzz target: the record decoder never panics, and whatever it accepts
//! re-encodes to exactly the input.
#![no_main]

use idem_core::codec::{decode, encode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(record) = decode(data) {
        assert_eq!(encode(&record), data);
    }
});
