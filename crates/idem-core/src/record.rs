//! The idempotency record stored under each key.

use serde::{Deserialize, Serialize};

/// One idempotency key's record. Times are Unix milliseconds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// SHA-256 of the request fingerprint the key was first used with.
    pub fingerprint: [u8; 32],
    /// Fencing token of the current (or completing) holder.
    pub token: u64,
    pub created_at: u64,
    /// Absolute expiry; also the Redis key's expiry.
    pub expires_at: u64,
    pub state: State,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum State {
    /// A holder is running the business logic until `lease_until`.
    InProgress {
        lease_until: u64,
    },
    Completed(Completed),
}

/// The stored response of a completed record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Completed {
    pub status: u16,
    pub body: Vec<u8>,
    pub headers: Vec<Header>,
    pub completed_at: u64,
    pub mirror: MirrorState,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    pub name: Vec<u8>,
    pub value: Vec<u8>,
}

/// Whether the Postgres mirror still has to receive this record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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

    #[test]
    fn record_is_compact() {
        // One jemalloc size class for the record itself (body separate).
        println!("size_of::<Record>() = {}", std::mem::size_of::<Record>());
        assert!(std::mem::size_of::<Record>() <= 128);
    }
}
