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
