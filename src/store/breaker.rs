//! The circuit breaker layer: after `threshold` consecutive backend failures, calls are refused
//! for `cooldown` (`StoreError::CircuitOpen`, which the failure policy answers at once), then
//! one probe call goes through; its success closes the circuit, its failure opens it again.
//!
//! A probe can never leave the circuit half-open for ever: every call holds a [`Permit`], and a
//! probe's permit dropped without a result — the caller gave up (Envoy's filter timeout, a gRPC
//! deadline, a client that disconnected) while the backend was slow — counts as a failure. As a
//! second guard, a probe that has been out longer than the cooldown no longer blocks the next.
//!
//! The state is one atomic word (no lock on the hot path); a success that finds the circuit
//! closed with no failures writes nothing, so healthy traffic does not bounce a cache line.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::{Check, Outcome, Store, StoreError};
use crate::clock::Clock;

#[derive(Debug, Clone, Copy)]
pub struct BreakerOptions {
    /// Consecutive failures that open the circuit.
    pub threshold: u32,
    /// How long it stays open before a probe (and how long a probe may be out).
    pub cooldown: Duration,
}

impl Default for BreakerOptions {
    fn default() -> Self {
        Self {
            threshold: 5,
            cooldown: Duration::from_millis(500),
        }
    }
}

/// What the breaker says of the backend, for health and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
}

impl BreakerState {
    /// The `sluice_circuit_breaker_state` gauge: 0 closed, 1 open, 2 half-open.
    pub fn gauge(self) -> i64 {
        match self {
            BreakerState::Closed => 0,
            BreakerState::Open => 1,
            BreakerState::HalfOpen => 2,
        }
    }
}

/// The state word: 2 tag bits, 62 bits of value (a failure count or a clock deadline).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Closed {
        failures: u64,
    },
    Open {
        until_us: u64,
    },
    /// One probe is out; another may go after `until_us`.
    Probing {
        until_us: u64,
    },
}

const TAG_SHIFT: u32 = 62;
const VALUE_MASK: u64 = (1 << TAG_SHIFT) - 1;

impl State {
    fn encode(self) -> u64 {
        let (tag, value) = match self {
            State::Closed { failures } => (0, failures),
            State::Open { until_us } => (1, until_us),
            State::Probing { until_us } => (2, until_us),
        };
        (tag << TAG_SHIFT) | (value & VALUE_MASK)
    }

    fn decode(word: u64) -> Self {
        let value = word & VALUE_MASK;
        match word >> TAG_SHIFT {
            0 => State::Closed { failures: value },
            1 => State::Open { until_us: value },
            _ => State::Probing { until_us: value },
        }
    }
}

/// The state machine, shared by the layer and its permits.
pub struct Circuit {
    state: AtomicU64,
    threshold: u64,
    cooldown_us: u64,
    clock: Arc<dyn Clock>,
}

impl Circuit {
    pub fn new(options: BreakerOptions, clock: Arc<dyn Clock>) -> Self {
        Self {
            state: AtomicU64::new(State::Closed { failures: 0 }.encode()),
            threshold: u64::from(options.threshold.max(1)),
            cooldown_us: u64::try_from(options.cooldown.as_micros()).unwrap_or(u64::MAX / 4),
            clock,
        }
    }

    fn load(&self) -> State {
        State::decode(self.state.load(Ordering::Acquire))
    }

    /// Moves from `from` to `to` unless another thread moved first.
    fn exchange(&self, from: State, to: State) -> bool {
        self.state
            .compare_exchange(
                from.encode(),
                to.encode(),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }

    fn deadline(&self) -> u64 {
        self.clock.now_micros().saturating_add(self.cooldown_us) & VALUE_MASK
    }

    /// A permit to call the backend now, or None while the circuit is open (or a probe is out).
    pub fn permit(&self) -> Option<Permit<'_>> {
        loop {
            let state = self.load();
            let probe_after = match state {
                State::Closed { .. } => {
                    return Some(Permit {
                        circuit: self,
                        probe: false,
                        settled: false,
                    });
                }
                State::Open { until_us } | State::Probing { until_us } => until_us,
            };
            if self.clock.now_micros() < probe_after {
                return None;
            }
            if self.exchange(
                state,
                State::Probing {
                    until_us: self.deadline(),
                },
            ) {
                return Some(Permit {
                    circuit: self,
                    probe: true,
                    settled: false,
                });
            }
        }
    }

    fn success(&self) {
        let closed = State::Closed { failures: 0 };
        // Nothing to write on the common path.
        if self.load() != closed {
            self.state.store(closed.encode(), Ordering::Release);
        }
    }

    fn failure(&self) {
        loop {
            let state = self.load();
            let next = match state {
                State::Closed { failures } if failures + 1 < self.threshold => State::Closed {
                    failures: failures + 1,
                },
                // Already open: its deadline stands.
                State::Open { .. } => return,
                _ => State::Open {
                    until_us: self.deadline(),
                },
            };
            if self.exchange(state, next) {
                return;
            }
        }
    }

    pub fn state(&self) -> BreakerState {
        match self.load() {
            State::Closed { .. } => BreakerState::Closed,
            State::Open { .. } => BreakerState::Open,
            State::Probing { .. } => BreakerState::HalfOpen,
        }
    }
}

/// Leave to make one backend call. Settle it with the call's result; a probe's permit dropped
/// unsettled (its caller gave up) counts as a failure, so the circuit cannot stay half-open.
pub struct Permit<'a> {
    circuit: &'a Circuit,
    probe: bool,
    settled: bool,
}

impl Permit<'_> {
    pub fn success(mut self) {
        self.settled = true;
        self.circuit.success();
    }

    pub fn failure(mut self) {
        self.settled = true;
        self.circuit.failure();
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        // An ordinary call cancelled by its caller says nothing certain of the backend; a
        // cancelled probe must not leave the circuit half-open.
        if !self.settled && self.probe {
            self.circuit.failure();
        }
    }
}

/// The layer: a backend behind a circuit breaker.
pub struct Breaker<S> {
    inner: S,
    /// Shared with the store's upkeep, which reports its state.
    circuit: Arc<Circuit>,
}

impl<S: Store> Breaker<S> {
    pub fn new(inner: S, options: BreakerOptions, clock: Arc<dyn Clock>) -> Self {
        Self {
            inner,
            circuit: Arc::new(Circuit::new(options, clock)),
        }
    }

    pub fn state(&self) -> BreakerState {
        self.circuit.state()
    }

    /// The circuit, for the upkeep's report.
    pub fn circuit(&self) -> Arc<Circuit> {
        self.circuit.clone()
    }
}

impl<S: Store> Store for Breaker<S> {
    async fn apply(&self, checks: &[Check<'_>]) -> Result<Outcome, StoreError> {
        let Some(permit) = self.circuit.permit() else {
            return Err(StoreError::CircuitOpen);
        };
        let result = self.inner.apply(checks).await;
        match &result {
            Err(e) if e.is_backend_down() => permit.failure(),
            // Any other answer, a refusal included, came from a backend that answers.
            _ => permit.success(),
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    fn circuit(threshold: u32, clock: &Arc<ManualClock>) -> Circuit {
        Circuit::new(
            BreakerOptions {
                threshold,
                cooldown: Duration::from_millis(500),
            },
            clock.clone(),
        )
    }

    #[test]
    fn states_survive_their_encoding() {
        for s in [
            State::Closed { failures: 0 },
            State::Closed { failures: 7 },
            State::Open {
                until_us: 1_700_000_000_000_000,
            },
            State::Probing {
                until_us: VALUE_MASK,
            },
        ] {
            assert_eq!(State::decode(s.encode()), s);
        }
    }

    #[test]
    fn opens_after_repeated_failures_and_probes_to_recover() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let b = circuit(3, &clock);
        for _ in 0..2 {
            b.permit().unwrap().failure();
        }
        assert_eq!(b.state(), BreakerState::Closed);
        b.permit().unwrap().failure();
        assert_eq!(b.state(), BreakerState::Open);
        assert!(b.permit().is_none(), "open: calls are refused");
        clock.advance(500_000);
        let probe = b.permit().expect("after the cooldown, one probe");
        assert!(b.permit().is_none(), "only one probe at a time");
        probe.failure();
        assert!(b.permit().is_none(), "a failed probe opens it again");
        clock.advance(500_000);
        b.permit().unwrap().success();
        assert_eq!(b.state(), BreakerState::Closed);
        assert!(b.permit().is_some());
    }

    #[test]
    fn a_success_resets_the_count() {
        let clock = Arc::new(ManualClock::new(0));
        let b = circuit(2, &clock);
        b.permit().unwrap().failure();
        b.permit().unwrap().success();
        b.permit().unwrap().failure();
        assert_eq!(b.state(), BreakerState::Closed);
    }

    #[test]
    fn a_dropped_probe_counts_as_a_failure() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let b = circuit(1, &clock);
        b.permit().unwrap().failure();
        clock.advance(500_000);
        let probe = b.permit().unwrap();
        assert_eq!(b.state(), BreakerState::HalfOpen);
        drop(probe);
        assert_eq!(b.state(), BreakerState::Open, "not stuck half-open");
        clock.advance(500_000);
        b.permit().expect("the next probe goes").success();
        assert_eq!(b.state(), BreakerState::Closed);
    }

    #[test]
    fn a_probe_out_longer_than_the_cooldown_does_not_block_the_next() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let b = circuit(1, &clock);
        b.permit().unwrap().failure();
        clock.advance(500_000);
        let stuck = b.permit().unwrap();
        clock.advance(499_999);
        assert!(b.permit().is_none());
        clock.advance(1);
        b.permit().expect("a second probe").success();
        assert_eq!(b.state(), BreakerState::Closed);
        // The first probe ends late: its result still counts, as any call's.
        stuck.success();
        assert_eq!(b.state(), BreakerState::Closed);
    }

    #[test]
    fn a_dropped_ordinary_call_changes_nothing() {
        let clock = Arc::new(ManualClock::new(0));
        let b = circuit(1, &clock);
        drop(b.permit().unwrap());
        assert_eq!(b.state(), BreakerState::Closed);
    }
}
