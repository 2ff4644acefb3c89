//! Time for every decision comes through [`Clock`], so tests drive it by hand.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Microseconds since the Unix epoch. Windows are aligned to the epoch, so the origin matters.
pub trait Clock: Send + Sync + 'static {
    fn now_micros(&self) -> u64;
}

/// The wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_micros(&self) -> u64 {
        // A clock before 1970 is a broken host; treating it as the epoch keeps decisions defined.
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0)
    }
}

/// Time that never steps: microseconds since the process started (so not epoch-aligned). For
/// what only measures durations on this node — a lease's deadline, a cached denial's end — where
/// a wall clock set back would stretch them.
#[derive(Debug, Clone, Copy)]
pub struct MonotonicClock(std::time::Instant);

impl MonotonicClock {
    pub fn new() -> Self {
        Self(std::time::Instant::now())
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now_micros(&self) -> u64 {
        // Starts at one second, so no deadline computed from it is ever 0 ("none").
        self.0.elapsed().as_micros() as u64 + MICROS_PER_SECOND
    }
}

/// A clock that moves only when told to.
#[derive(Debug, Default)]
pub struct ManualClock(AtomicU64);

impl ManualClock {
    pub fn new(start_micros: u64) -> Self {
        Self(AtomicU64::new(start_micros))
    }

    pub fn set(&self, micros: u64) {
        self.0.store(micros, Ordering::SeqCst);
    }

    pub fn advance(&self, micros: u64) {
        self.0.fetch_add(micros, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_micros(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

impl<C: Clock> Clock for std::sync::Arc<C> {
    fn now_micros(&self) -> u64 {
        (**self).now_micros()
    }
}

pub const MICROS_PER_SECOND: u64 = 1_000_000;

/// A duration such as `1500us`, `10ms`, `2s`, `5m` or `1h` (a whole number and its unit).
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("'{s}' is not a duration like 10ms, 2s or 5m"))?;
    let seconds = |per: u64| {
        n.checked_mul(per)
            .map(std::time::Duration::from_secs)
            .ok_or_else(|| format!("'{s}' is too long a duration"))
    };
    match unit {
        "us" => Ok(std::time::Duration::from_micros(n)),
        "ms" => Ok(std::time::Duration::from_millis(n)),
        "s" => seconds(1),
        "m" => seconds(60),
        "h" => seconds(3_600),
        _ => Err(format!("'{s}': the unit must be us, ms, s, m or h")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_monotonic_clock_never_goes_back_and_is_never_zero() {
        let c = MonotonicClock::new();
        let mut last = c.now_micros();
        assert!(last >= MICROS_PER_SECOND);
        for _ in 0..1_000 {
            let now = c.now_micros();
            assert!(now >= last);
            last = now;
        }
    }
}
