//! Capped exponential backoff with jitter for retries against a down server,
//! and the cancellable sleep between them.

use std::time::Duration;

use rand::RngExt;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        Backoff {
            initial,
            max,
            next: initial,
        }
    }

    /// The delay before the next attempt: the current step with ±50% jitter
    /// (so that many writers do not retry in lockstep); the step doubles up
    /// to the cap.
    pub fn next_delay(&mut self) -> Duration {
        let step = self.next;
        self.next = (self.next * 2).min(self.max);
        step.mul_f64(rand::rng().random_range(0.5..=1.5))
            .min(self.max)
    }

    /// Back to the first step after a success.
    pub fn reset(&mut self) {
        self.next = self.initial;
    }
}

/// Sleeps for `delay`; `false` (at once) when `token` is cancelled.
pub async fn sleep_unless(token: &CancellationToken, delay: Duration) -> bool {
    tokio::select! {
        () = tokio::time::sleep(delay) => true,
        () = token.cancelled() => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_to_the_cap_and_resets() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let delays: Vec<Duration> = (0..8).map(|_| backoff.next_delay()).collect();
        assert!(delays[0] >= Duration::from_millis(50) && delays[0] <= Duration::from_millis(150));
        assert!(delays.iter().all(|d| *d <= Duration::from_secs(1)));
        assert!(delays[7] >= Duration::from_millis(500), "{delays:?}");
        backoff.reset();
        assert!(backoff.next_delay() <= Duration::from_millis(150));
    }
}
