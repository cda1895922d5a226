//! The idempotency record stored under each key.

use std::ops::RangeInclusive;

use crate::{Error, Fingerprint};

/// `expires_at` of a record whose key has no TTL (after `PERSIST`).
pub const NO_EXPIRY: u64 = u64::MAX;
/// Tokens stay below 2^53, so JSON clients keep them exact.
pub const TOKEN_LIMIT: u64 = 1 << 53;
/// Latest time (Unix ms) a record may carry: a node issues tokens of
/// `now_ms * 1000`, so a clock past this (the year 2255) could issue none.
pub const TIME_LIMIT_MS: u64 = TOKEN_LIMIT / 1000;
/// HTTP statuses a response may have.
pub const STATUS_RANGE: RangeInclusive<u16> = 100..=599;
/// Most bytes of body plus header names and values a record may hold:
/// Redis' own 512 MiB string limit (the bound of `max-body-bytes`).
pub const RESPONSE_LIMIT: u64 = 512 * 1024 * 1024;

/// One idempotency key's record. Times are Unix milliseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The request fingerprint the key was first used with.
    pub fingerprint: Fingerprint,
    /// Fencing token of the current (or completing) holder.
    pub token: u64,
    pub created_at: u64,
    /// Absolute expiry, kept equal to the Redis key's expiry (`NO_EXPIRY`
    /// when the key has none).
    pub expires_at: u64,
    pub state: State,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// A holder is running the business logic until `lease_until`.
    InProgress {
        lease_until: u64,
    },
    Completed(Completed),
}

/// The stored response of a completed record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completed {
    pub status: u16,
    pub body: Vec<u8>,
    pub headers: Vec<Header>,
    pub completed_at: u64,
    pub mirror: MirrorState,
}

impl Completed {
    /// Bytes of body plus header names and values (what `max-body-bytes`
    /// bounds).
    pub fn response_len(&self) -> usize {
        self.body.len()
            + self
                .headers
                .iter()
                .map(|h| h.name.len() + h.value.len())
                .sum::<usize>()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub name: Vec<u8>,
    pub value: Vec<u8>,
}

/// Whether the Postgres mirror still has to receive this record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MirrorState {
    Pending,
    Mirrored,
}

impl Record {
    pub fn completed(&self) -> Option<&Completed> {
        match &self.state {
            State::Completed(c) => Some(c),
            State::InProgress { .. } => None,
        }
    }

    /// True when the record waits for the mirror.
    pub fn mirror_pending(&self) -> bool {
        matches!(&self.state, State::Completed(c) if c.mirror == MirrorState::Pending)
    }

    /// Makes a completed record wait for the mirror again (it arrived under
    /// a name Postgres may have no row for); an in-progress one is left.
    pub fn mark_pending(&mut self) {
        if let State::Completed(c) = &mut self.state {
            c.mirror = MirrorState::Pending;
        }
    }

    /// Checks a record that came from outside this node's own decisions (RDB,
    /// RESTORE, AOF, replication): a forged or damaged record is refused
    /// before it can drive the token clock or be replayed.
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |what: &str| Err(Error::Corrupt(format!("idem record has {what}")));
        if self.token == 0 || self.token >= TOKEN_LIMIT {
            return bad("a token outside 1..2^53");
        }
        let time_ok = |t: u64| t <= TIME_LIMIT_MS;
        // The expiry is the key's TTL, which any TTL command may set up to
        // Redis' own bound; it never feeds tokens.
        let expiry_ok = |t: u64| t <= i64::MAX as u64 || t == NO_EXPIRY;
        if !time_ok(self.created_at) || !expiry_ok(self.expires_at) {
            return bad("a time out of range");
        }
        match &self.state {
            State::InProgress { lease_until } if !time_ok(*lease_until) => {
                bad("a lease out of range")
            }
            State::InProgress { .. } => Ok(()),
            State::Completed(c) => {
                if !STATUS_RANGE.contains(&c.status) {
                    return bad("a status outside 100..599");
                }
                if !time_ok(c.completed_at) {
                    return bad("a completion time out of range");
                }
                if c.response_len() as u64 > RESPONSE_LIMIT {
                    return bad("a response over 512 MiB");
                }
                if c.headers.iter().any(|h| h.name.is_empty()) {
                    return bad("a header without a name");
                }
                Ok(())
            }
        }
    }

    /// Heap and inline bytes, for `MEMORY USAGE`.
    pub fn memory_usage(&self) -> usize {
        let mut n = std::mem::size_of::<Record>();
        if let State::Completed(c) = &self.state {
            n += c.body.capacity();
            n += c.headers.capacity() * std::mem::size_of::<Header>();
            n += c
                .headers
                .iter()
                .map(|h| h.name.capacity() + h.value.capacity())
                .sum::<usize>();
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completed(status: u16) -> Record {
        Record {
            fingerprint: Fingerprint::Digest([0; 32]),
            token: 7,
            created_at: 1,
            expires_at: 2,
            state: State::Completed(Completed {
                status,
                body: b"x".to_vec(),
                headers: vec![],
                completed_at: 3,
                mirror: MirrorState::Pending,
            }),
        }
    }

    #[test]
    fn validation_refuses_forged_fields() {
        assert!(completed(200).validate().is_ok());
        let mut r = completed(200);
        r.expires_at = NO_EXPIRY;
        assert!(r.validate().is_ok(), "no expiry is valid");
        for bad in [
            Record {
                token: 0,
                ..completed(200)
            },
            Record {
                token: TOKEN_LIMIT,
                ..completed(200)
            },
            Record {
                token: u64::MAX,
                ..completed(200)
            },
            Record {
                created_at: TIME_LIMIT_MS + 1,
                ..completed(200)
            },
            Record {
                expires_at: i64::MAX as u64 + 1,
                ..completed(200)
            },
            Record {
                state: State::InProgress {
                    lease_until: u64::MAX,
                },
                ..completed(200)
            },
            completed(99),
            completed(600),
            {
                // COMPLETE refuses a header without a name; so do loads.
                let mut r = completed(200);
                if let State::Completed(c) = &mut r.state {
                    c.headers.push(Header {
                        name: vec![],
                        value: b"v".to_vec(),
                    });
                }
                r
            },
        ] {
            assert!(matches!(bad.validate(), Err(Error::Corrupt(_))), "{bad:?}");
        }
    }

    #[test]
    fn record_is_compact() {
        // One jemalloc size class for the record itself (body separate).
        println!("size_of::<Record>() = {}", std::mem::size_of::<Record>());
        assert!(std::mem::size_of::<Record>() <= 128);
    }
}
