//! A circuit breaker: after `threshold` consecutive failures, calls are refused for `cooldown`
//! (answered at once by the failure policy), then one probe call goes through; its success
//! closes the circuit, its failure opens it again.

use std::sync::Arc;
use std::sync::Mutex;

use crate::clock::Clock;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Closed {
        failures: u32,
    },
    Open {
        until_us: u64,
    },
    /// One probe is out.
    Probing,
}

pub struct Breaker {
    state: Mutex<State>,
    threshold: u32,
    cooldown_us: u64,
    clock: Arc<dyn Clock>,
}

/// What the breaker says of the backend, for health and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
}

impl Breaker {
    pub fn new(threshold: u32, cooldown: std::time::Duration, clock: Arc<dyn Clock>) -> Self {
        Self {
            state: Mutex::new(State::Closed { failures: 0 }),
            threshold: threshold.max(1),
            cooldown_us: cooldown.as_micros() as u64,
            clock,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a call may go to the backend now.
    pub fn allow(&self) -> bool {
        let mut state = self.lock();
        match *state {
            State::Closed { .. } => true,
            State::Open { until_us } if self.clock.now_micros() >= until_us => {
                *state = State::Probing;
                true
            }
            State::Open { .. } | State::Probing => false,
        }
    }

    pub fn success(&self) {
        *self.lock() = State::Closed { failures: 0 };
    }

    pub fn failure(&self) {
        let mut state = self.lock();
        let open = State::Open {
            until_us: self.clock.now_micros() + self.cooldown_us,
        };
        *state = match *state {
            State::Closed { failures } if failures + 1 < self.threshold => State::Closed {
                failures: failures + 1,
            },
            _ => open,
        };
    }

    pub fn state(&self) -> BreakerState {
        match *self.lock() {
            State::Closed { .. } => BreakerState::Closed,
            State::Open { .. } => BreakerState::Open,
            State::Probing => BreakerState::HalfOpen,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use std::time::Duration;

    #[test]
    fn opens_after_repeated_failures_and_probes_to_recover() {
        let clock = Arc::new(ManualClock::new(0));
        let b = Breaker::new(3, Duration::from_millis(500), clock.clone());
        for _ in 0..2 {
            assert!(b.allow());
            b.failure();
        }
        assert_eq!(b.state(), BreakerState::Closed);
        assert!(b.allow());
        b.failure();
        assert_eq!(b.state(), BreakerState::Open);
        assert!(!b.allow(), "open: calls are refused");
        clock.advance(500_000);
        assert!(b.allow(), "after the cooldown, one probe");
        assert!(!b.allow(), "only one probe at a time");
        b.failure();
        assert!(!b.allow(), "a failed probe opens it again");
        clock.advance(500_000);
        assert!(b.allow());
        b.success();
        assert_eq!(b.state(), BreakerState::Closed);
        assert!(b.allow());
    }

    #[test]
    fn a_success_resets_the_count() {
        let b = Breaker::new(2, Duration::from_secs(1), Arc::new(ManualClock::new(0)));
        b.failure();
        b.success();
        b.failure();
        assert_eq!(b.state(), BreakerState::Closed);
    }
}
