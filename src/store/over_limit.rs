//! The over-limit cache: when the shared store denies a counter until T, later requests on this
//! node that ask at least as many hits of it are denied here until T, with no Redis call. A
//! request that asks at least as much cannot fit sooner, so this never admits more; it may deny
//! a little longer when another node refunds hits meanwhile. Bounded in size.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::{Check, CheckKind, Outcome};
use crate::clock::Clock;
use crate::limiter::{Limit, Verdict};

#[derive(Debug, Clone, Copy)]
struct Denial {
    /// The limit it was denied under: after a reload changes it, the backend decides again.
    limit: Limit,
    /// The hits of the denied request: requests asking at least this many are denied too.
    hits: u64,
    remaining: u64,
    until_us: u64,
    reset_until_us: u64,
}

pub struct OverLimitCache {
    entries: Mutex<HashMap<Box<[u8]>, Denial>>,
    max_entries: usize,
    clock: Arc<dyn Clock>,
}

impl OverLimitCache {
    pub fn new(max_entries: usize, clock: Arc<dyn Clock>) -> Self {
        Self {
            entries: Mutex::new(HashMap::new()),
            max_entries,
            clock,
        }
    }

    pub fn now(&self) -> u64 {
        self.clock.now_micros()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Box<[u8]>, Denial>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The cached denial of this check at `now`, if one applies.
    pub fn denial(&self, check: &Check<'_>, now: u64) -> Option<Verdict> {
        if check.kind != CheckKind::Enforce || check.hits == 0 {
            return None;
        }
        let d = *self.lock().get(check.key)?;
        let applies = d.limit == *check.limit
            && now < d.until_us
            && check.hits >= d.hits
            && check.hits > d.remaining;
        applies.then(|| Verdict {
            allowed: false,
            remaining: d.remaining,
            reset_after_us: d.reset_until_us.saturating_sub(now),
            retry_after_us: d.until_us - now,
        })
    }

    /// Learns from what the store answered at `now`: denials are cached, a counter that was
    /// allowed or refunded is forgotten.
    pub fn learn(&self, checks: &[Check<'_>], outcome: &Outcome, now: u64) {
        if outcome.by_policy {
            // The failure policy's answers say nothing of the shared counters.
            return;
        }
        let mut entries = self.lock();
        for (c, v) in checks.iter().zip(&outcome.verdicts) {
            let denied = c.kind == CheckKind::Enforce && !v.allowed && v.retry_after_us > 0;
            if !denied {
                if c.kind == CheckKind::Refund || v.allowed {
                    entries.remove(c.key);
                }
                continue;
            }
            if entries.len() >= self.max_entries && !entries.contains_key(c.key) {
                entries.retain(|_, d| d.until_us > now);
                if entries.len() >= self.max_entries {
                    continue;
                }
            }
            entries.insert(
                c.key.into(),
                Denial {
                    limit: *c.limit,
                    hits: c.hits,
                    remaining: v.remaining,
                    until_us: now + v.retry_after_us,
                    reset_until_us: now + v.reset_after_us,
                },
            );
        }
    }

    /// Drops the denials that have run out.
    pub fn sweep(&self) {
        let now = self.now();
        self.lock().retain(|_, d| d.until_us > now);
    }
}
