//! A request fingerprint as a record keeps it.
//!
//! What the module writes out for good or shows (RDB, DUMP, an AOF rewrite,
//! `IDEM.GET`, the mirror, Postgres) carries SHA-256 of the bytes the client
//! sent. In memory a fingerprint of exactly 32 bytes (what idem-client sends:
//! a SHA-256 digest of its own) is kept as sent and hashed only when written
//! out, so a replay, an in-flight answer or a mismatch hashes nothing; a
//! replication effect of format 2 (`codec`) carries it as sent too, so a
//! write hashes nothing either. Two fingerprints compare equal exactly when
//! the bytes sent were equal, whichever form each is in.

use sha2::{Digest, Sha256};

/// SHA-256 of `bytes`: a fingerprint's stored form.
pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

#[derive(Debug, Clone, Copy)]
pub enum Fingerprint {
    /// SHA-256 of what the client sent.
    Digest([u8; 32]),
    /// The client sent exactly these 32 bytes; not hashed yet.
    Sent([u8; 32]),
}

impl Fingerprint {
    /// The fingerprint of a client's argument.
    pub fn of(sent: &[u8]) -> Fingerprint {
        match <[u8; 32]>::try_from(sent) {
            Ok(bytes) => Fingerprint::Sent(bytes),
            Err(_) => Fingerprint::Digest(sha256(sent)),
        }
    }

    /// The stored form: SHA-256 of the bytes sent.
    pub fn digest(&self) -> [u8; 32] {
        match self {
            Fingerprint::Digest(d) => *d,
            Fingerprint::Sent(bytes) => sha256(bytes),
        }
    }
}

impl PartialEq for Fingerprint {
    fn eq(&self, other: &Fingerprint) -> bool {
        match (self, other) {
            // Equal bytes sent, or equal digests: SHA-256 is a function, and
            // a collision is out of reach.
            (Fingerprint::Sent(a), Fingerprint::Sent(b))
            | (Fingerprint::Digest(a), Fingerprint::Digest(b)) => a == b,
            _ => self.digest() == other.digest(),
        }
    }
}

impl Eq for Fingerprint {}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn sha256_known_answers() {
        // FIPS 180-2 appendix B.1 ("abc") and the empty message.
        assert_eq!(
            hex::encode(sha256(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            hex::encode(sha256(b"")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[test]
    fn only_32_bytes_are_kept_as_sent() {
        assert_eq!(Fingerprint::of(&[7; 32]), Fingerprint::Sent([7; 32]));
        assert!(matches!(
            Fingerprint::of(&[7; 32]),
            Fingerprint::Sent(b) if b == [7; 32]
        ));
        for len in [0, 1, 31, 33, 64] {
            assert!(matches!(
                Fingerprint::of(&vec![7; len]),
                Fingerprint::Digest(d) if d == sha256(&vec![7; len])
            ));
        }
        assert_eq!(Fingerprint::of(&[7; 32]).digest(), sha256(&[7; 32]));
    }

    proptest! {
        /// Equal exactly when the bytes sent are equal, in every pairing of
        /// forms (a record loaded from RDB holds the digest, a request the
        /// bytes).
        #[test]
        fn equality_follows_the_bytes_sent(
            a in prop::collection::vec(any::<u8>(), 30..34),
            b in prop::collection::vec(any::<u8>(), 30..34),
            a_stored in any::<bool>(),
            b_stored in any::<bool>(),
        ) {
            let form = |bytes: &[u8], stored: bool| {
                let f = Fingerprint::of(bytes);
                if stored { Fingerprint::Digest(f.digest()) } else { f }
            };
            let (fa, fb) = (form(&a, a_stored), form(&b, b_stored));
            prop_assert_eq!(fa == fb, a == b);
            prop_assert_eq!(fa == form(&a, !a_stored), true);
        }
    }
}
