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
///
/// Every BEGIN hashes one, usually 32 bytes (idem-client sends a raw
/// SHA-256): a message that fits one block is padded here and compressed
/// directly, without the streaming hasher's buffering.
pub fn fingerprint(bytes: &[u8]) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    /// FIPS 180-4, 5.3.3: SHA-256's initial hash value.
    const INITIAL: [u32; 8] = [
        0x6a09_e667,
        0xbb67_ae85,
        0x3c6e_f372,
        0xa54f_f53a,
        0x510e_527f,
        0x9b05_688c,
        0x1f83_d9ab,
        0x5be0_cd19,
    ];
    // The message, a 1 bit, zeros, and its length in bits in the last 8
    // bytes (FIPS 180-4, 5.1.1) fit one 64-byte block up to 55 bytes.
    if bytes.len() > 55 {
        return Sha256::digest(bytes).into();
    }
    let mut block = [0u8; 64];
    block[..bytes.len()].copy_from_slice(bytes);
    block[bytes.len()] = 0x80;
    block[56..].copy_from_slice(&(bytes.len() as u64 * 8).to_be_bytes());
    let mut state = INITIAL;
    sha2::block_api::compress256(&mut state, &[block]);
    let mut out = [0u8; 32];
    for (chunk, word) in out.chunks_exact_mut(4).zip(state) {
        chunk.copy_from_slice(&word.to_be_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use sha2::{Digest, Sha256};

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]
        /// The one-block path and the streaming hasher agree on every length
        /// around the block boundary.
        #[test]
        fn fingerprint_is_sha256(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let want: [u8; 32] = Sha256::digest(&bytes).into();
            prop_assert_eq!(super::fingerprint(&bytes), want);
        }
    }

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
        for len in 54..=57 {
            let m = vec![b'x'; len];
            let want: [u8; 32] = Sha256::digest(&m).into();
            assert_eq!(super::fingerprint(&m), want, "length {len}");
        }
    }
}
