//! Fencing tokens: positive, and only ever growing on a node.
//!
//! A token is `max(last + 1, now_ms * 1000)`. The clock part keeps tokens
//! growing for a key across its expiry and reuse, and across restarts and
//! failover (replicas observe every token they apply); the counter part keeps
//! them strictly increasing within a millisecond. Values stay below 2^53, so
//! they survive JSON clients intact.

#[derive(Debug, Default, Clone)]
pub struct TokenClock {
    last: u64,
}

impl TokenClock {
    pub const fn new() -> Self {
        TokenClock { last: 0 }
    }

    /// The next token, strictly larger than every token issued or observed.
    pub fn next(&mut self, now_ms: u64) -> u64 {
        let t = self.last.saturating_add(1).max(now_ms.saturating_mul(1000));
        self.last = t;
        t
    }

    /// Record a token seen elsewhere (loaded, replicated, restored).
    pub fn observe(&mut self, token: u64) {
        self.last = self.last.max(token);
    }

    pub fn last(&self) -> u64 {
        self.last
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_within_and_across_milliseconds() {
        let mut c = TokenClock::default();
        let a = c.next(1_000);
        let b = c.next(1_000);
        let d = c.next(999); // clock stepped back
        let e = c.next(2_000);
        assert!(a < b && b < d && d < e);
        assert_eq!(a, 1_000_000);
    }

    #[test]
    fn observed_tokens_are_exceeded() {
        let mut c = TokenClock::default();
        c.observe(u64::MAX / 4);
        assert!(c.next(5) > u64::MAX / 4);
    }
}
