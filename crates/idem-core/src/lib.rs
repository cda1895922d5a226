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

#[cfg(test)]
mod tests {
    #[test]
    fn fingerprint_known_answers() {
        // FIPS 180-2 appendix B.1 ("abc") and the empty message.
        let hex = |b: [u8; 32]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        assert_eq!(
            hex(super::fingerprint(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            hex(super::fingerprint(b"")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
