//! Pure logic of the idem Redis module: the record, the four-outcome decision,
//! argument parsing, the versioned encoding and the mirror's pending index.
//!
//! Nothing here touches Redis, so it is unit- and property-tested with plain
//! `cargo test`; the module crate is a thin FFI layer on top.

pub mod args;
pub mod codec;
pub mod engine;
pub mod error;
pub mod pending;
pub mod record;
pub mod token;
pub mod wire;

pub use error::Error;
pub use record::{Completed, Header, MirrorState, Record, State};

/// SHA-256 of the client's fingerprint argument, as the module stores it.
pub fn fingerprint(bytes: &[u8]) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes).into()
}
