//! Fencing tokens: positive, and only ever growing on a node.
//!
//! A token is `max(last + 1, now_ms * 1000)`. The clock part keeps tokens
//! growing for a key across its expiry and reuse, and across restarts and
//! failover (replicas observe every token they apply); the counter part keeps
//! them strictly increasing within a millisecond. Values stay below 2^53, so
//! they survive JSON clients intact.
//!
//! Observed tokens come from data (RDB, RESTORE, replication). A token more
//! than `MAX_SKEW_MS` ahead of this node's clock is not trusted to move the
//! clock: one forged record cannot push every later token of the node to the
//! bound. Records carrying such a token are still fenced exactly (a holder's
//! token must equal the record's); only their order against later tokens is
//! lost, which needs node clocks a day apart. After a primary's load and a
//! promotion the clock jumps (`jump`): the node may not know every token
//! issued before.

use crate::record::TOKEN_LIMIT;

/// How far ahead of this node's clock an observed token may be and still move
/// the clock: one day.
pub const MAX_SKEW_MS: u64 = 24 * 3600 * 1000;

/// Token space a node skips (`jump`) when it may not know every token issued
/// before: it became a primary (a replica knows only the tokens it applied),
/// or it loaded a dataset that may lack the tail of what it issued. Once
/// `last` runs ahead of the clock (a record from a node whose clock is ahead,
/// a clock stepping back), tokens are a counter, and without the gap the
/// first one after a failover or restart could be one a live holder has.
/// Ten minutes of the clock's microseconds: more than a replication lag or
/// a lost tail holds, a sliver of the 2^53 range.
pub const JUMP_MS: u64 = 10 * 60 * 1000;

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

    /// Record a token seen elsewhere (loaded, replicated, restored, or held
    /// by a record being taken over), unless it is implausibly far ahead of
    /// `now_ms` (see the module docs).
    pub fn observe(&mut self, token: u64, now_ms: u64) {
        let horizon = now_ms
            .saturating_add(MAX_SKEW_MS)
            .saturating_mul(1000)
            .min(TOKEN_LIMIT - 1);
        if token <= horizon {
            self.last = self.last.max(token);
        }
    }

    /// Moves past every token this node may have missed (`JUMP_MS`).
    pub fn jump(&mut self, now_ms: u64) {
        self.last = self
            .last
            .max(now_ms.saturating_mul(1000))
            .saturating_add(JUMP_MS * 1000)
            .min(TOKEN_LIMIT - 1);
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
        let now = 1_800_000_000_000;
        c.observe(now * 1000 + 5_000, now);
        assert!(c.next(now) > now * 1000 + 5_000);
    }

    #[test]
    fn a_jump_skips_what_another_node_may_have_issued() {
        let now = 1_800_000_000_000;
        // Ahead of the clock (a counter): the old primary went on from
        // `seen`, a node that saw only `seen` must not issue seen + 1.
        let seen = (now + 3_600_000) * 1000;
        let mut c = TokenClock::default();
        c.observe(seen, now);
        c.jump(now);
        assert_eq!(c.next(now), seen + JUMP_MS * 1000 + 1);
        // On the clock: the gap is taken from now.
        let mut c = TokenClock::default();
        c.jump(now);
        assert_eq!(c.next(now), (now + JUMP_MS) * 1000 + 1);
        let mut c = TokenClock::default();
        c.observe(TOKEN_LIMIT - 2, TOKEN_LIMIT / 1000);
        c.jump(TOKEN_LIMIT / 1000);
        assert_eq!(c.last(), TOKEN_LIMIT - 1, "never past the bound");
    }

    #[test]
    fn data_cannot_drive_tokens_past_the_bound() {
        let mut c = TokenClock::default();
        let now = 1_800_000_000_000;
        c.observe(u64::MAX, now);
        c.observe(TOKEN_LIMIT - 1, now);
        c.observe((now + MAX_SKEW_MS + 1) * 1000, now);
        assert_eq!(c.next(now), now * 1000, "far-future tokens are not trusted");
        c.observe((now + 1000) * 1000, now);
        assert_eq!(
            c.next(now),
            (now + 1000) * 1000 + 1,
            "a clock a second ahead is"
        );
    }
}
