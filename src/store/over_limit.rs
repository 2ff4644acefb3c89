//! The over-limit cache layer: when the shared store denies a counter until T, later requests
//! on this node that ask as many hits of it are denied here until T, with no backend call.
//! (One asking more cannot fit sooner either, but its wait is longer, so the backend answers
//! it.) This never admits more; it may deny a little longer when another node refunds hits
//! meanwhile.
//!
//! A request is answered here only when *every* one of its checks is a cached denial. When
//! some are not (`[A, B]` with A cached and B not), the whole request goes to the backend: a
//! denied batch consumes nothing there, and each status — B's included, at its real hits — is
//! the backend's own, exactly as the memory store reports it.
//!
//! Only denials whose status cannot change until they fit are cached (a fixed window's, or
//! one hit over), so a cached answer is the backend's answer to the letter.
//!
//! Bounded (`max_entries`, spread over shards so threads do not queue on one lock). The
//! failure policy's answers are never learned: they say nothing of the shared counters.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::sharded::{SHARDS, Sharded};
use super::{Check, CheckKind, DecidedBy, Outcome, Store, StoreError};
use crate::clock::Clock;
use crate::limiter::{Limit, Verdict};

#[derive(Debug, Clone, Copy)]
struct Denial {
    /// The limit it was denied under: after a reload changes it, the backend decides again.
    limit: Limit,
    /// The hits of the denied request: requests asking as many are denied too.
    hits: u64,
    remaining: u64,
    until_us: u64,
    reset_until_us: u64,
}

pub struct OverLimitCache<S> {
    inner: S,
    /// Shared with the store's upkeep, which sweeps and counts them.
    denials: Arc<Denials>,
}

/// The cached denials, sharded.
pub struct Denials {
    entries: Sharded<Denial>,
    /// How many `entries` holds, so a node with none (the common case: nothing over its
    /// limit) looks up and forgets nothing — no key hashed, no shard locked. Read without a
    /// lock: a denial learned by another thread a moment ago may be missed once, and the
    /// backend answers that request instead, as if the cache had not learned it yet.
    held: AtomicUsize,
    /// Per shard; 0: the cache is off.
    max_per_shard: usize,
    clock: Arc<dyn Clock>,
}

impl<S: Store> OverLimitCache<S> {
    /// At most `max_entries` denials (0: off, every call goes through).
    pub fn new(inner: S, max_entries: usize, clock: Arc<dyn Clock>) -> Self {
        Self {
            inner,
            denials: Arc::new(Denials {
                entries: Sharded::new(),
                held: AtomicUsize::new(0),
                max_per_shard: max_entries.div_ceil(SHARDS),
                clock,
            }),
        }
    }

    /// The denials, for the upkeep.
    pub fn denials(&self) -> Arc<Denials> {
        self.denials.clone()
    }
}

impl Denials {
    /// The cached denial of this check at `now`, if one applies.
    fn denial(&self, check: &Check<'_>, now: u64) -> Option<Verdict> {
        // A cost limit's charge must reach the backend, denied or not.
        if check.kind != CheckKind::Enforce
            || check.hits == 0
            || check.limit.overdraft
            || self.held.load(Ordering::Relaxed) == 0
        {
            return None;
        }
        let d = *self.entries.lock(check.key).get(check.key)?;
        let applies = d.limit == *check.limit
            && now < d.until_us
            // The same hits only: a larger request is denied too, but waits longer (or, past a
            // bucket's burst, forever), and its status must say so.
            && check.hits == d.hits
            && check.hits > d.remaining;
        applies.then(|| Verdict {
            allowed: false,
            remaining: d.remaining,
            reset_after_us: d.reset_until_us.saturating_sub(now),
            retry_after_us: d.until_us - now,
        })
    }

    /// Learns from what the store answered to a call sent at `now`: denials are cached, a
    /// counter that was allowed or refunded is forgotten.
    fn learn(&self, checks: &[Check<'_>], outcome: &Outcome, now: u64) {
        if outcome.decided_by.is_policy() {
            return;
        }
        for (c, v) in checks.iter().zip(&outcome.verdicts) {
            let denied = c.kind == CheckKind::Enforce && !v.allowed && v.retry_after_us > 0;
            // Only a denial whose status cannot change before it fits: a fixed window's count
            // stays until the window ends; elsewhere, when one more would fit, the next change
            // is the moment the request fits. (A bucket refilling under a larger request would
            // report a stale remaining.)
            // A request that can never fit waits "one period" each time it asks: no deadline.
            let steady = c.limit.algorithm.denial_is_steady()
                || (c.hits == v.remaining.saturating_add(1) && c.limit.can_ever_allow(c.hits));
            // A concurrency limit's slot comes back with any request's release, on any node.
            let denied = denied && steady && c.limit.algorithm.room_returns_with_time();
            if !denied {
                if (c.kind == CheckKind::Refund || v.allowed)
                    && self.held.load(Ordering::Relaxed) > 0
                    && self.entries.lock(c.key).remove(c.key).is_some()
                {
                    self.held.fetch_sub(1, Ordering::Relaxed);
                }
                continue;
            }
            let mut entries = self.entries.lock(c.key);
            if entries.len() >= self.max_per_shard && !entries.contains_key(c.key) {
                // Full: make room from this shard only (bounded work per request).
                self.forget_run_out(&mut entries, now);
                if entries.len() >= self.max_per_shard {
                    continue;
                }
            }
            let replaced = entries.insert(
                c.key.into(),
                Denial {
                    limit: *c.limit,
                    hits: c.hits,
                    remaining: v.remaining,
                    until_us: now.saturating_add(v.retry_after_us),
                    reset_until_us: now.saturating_add(v.reset_after_us),
                },
            );
            if replaced.is_none() {
                self.held.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Denials held now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets the denials that have run out.
    pub fn sweep(&self) {
        let now = self.clock.now_micros();
        self.entries.for_each_shard(|m| self.forget_run_out(m, now));
    }

    /// Forgets a shard's denials that have run out at `now`, and counts them off.
    fn forget_run_out(&self, shard: &mut HashMap<Box<[u8]>, Denial>, now: u64) {
        let before = shard.len();
        shard.retain(|_, d| d.until_us > now);
        self.held.fetch_sub(before - shard.len(), Ordering::Relaxed);
    }
}

impl<S: Store> Store for OverLimitCache<S> {
    async fn apply(&self, checks: &[Check<'_>]) -> Result<Outcome, StoreError> {
        let denials = &self.denials;
        if denials.max_per_shard == 0 {
            return self.inner.apply(checks).await;
        }
        // The cache's own clock, read when the call is sent: a denial is learned from then.
        let now = denials.clock.now_micros();
        let cached: Option<Vec<Verdict>> = checks.iter().map(|c| denials.denial(c, now)).collect();
        if let Some(verdicts) = cached.filter(|v| !v.is_empty()) {
            return Ok(Outcome {
                allowed: false,
                verdicts,
                decided_by: DecidedBy::Counters,
                backend_now_us: Vec::new(),
            });
        }
        let outcome = self.inner.apply(checks).await?;
        denials.learn(checks, &outcome, now);
        Ok(outcome)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::limiter::Algorithm;
    use crate::store::memory::MemoryStore;

    fn enforce<'a>(key: &'a [u8], limit: &'a Limit) -> Check<'a> {
        Check::enforce(key, limit, 1)
    }

    /// The count that lets a node with no denials skip the cache stays the cache's size through
    /// learning, forgetting, a full shard's room-making and the sweep — and a denial counted is
    /// one the next request is answered from.
    #[tokio::test]
    async fn the_count_of_denials_follows_the_entries() {
        let clock = Arc::new(ManualClock::new(1_000_000_000));
        let memory = Arc::new(MemoryStore::new(clock.clone(), 1_000));
        // One entry per shard at most: a second denial on a shard makes room there.
        let cache = OverLimitCache::new(memory, SHARDS, clock.clone());
        let denials = cache.denials();
        let count = || denials.held.load(Ordering::Relaxed);
        let limit = Limit::new(Algorithm::FixedWindow, 1, 60_000_000, None).unwrap();
        let keys: Vec<Vec<u8>> = (0..300u32).map(|i| i.to_be_bytes().to_vec()).collect();
        for k in &keys {
            assert!(cache.apply(&[enforce(k, &limit)]).await.unwrap().allowed);
            assert_eq!(count(), 0, "an allowed counter is not cached");
        }
        // Each key denied once: learned, up to a shard's room.
        for k in &keys {
            assert!(!cache.apply(&[enforce(k, &limit)]).await.unwrap().allowed);
            assert_eq!(count(), denials.len());
        }
        assert!(count() > 0 && count() <= SHARDS);
        // A cached key is answered here: the count says there are some to look up.
        let cached = keys
            .iter()
            .find(|k| denials.entries.lock(k).contains_key(k.as_slice()))
            .unwrap();
        assert!(
            !cache
                .apply(&[enforce(cached, &limit)])
                .await
                .unwrap()
                .allowed
        );
        // A refund forgets its counter.
        let refund = Check {
            kind: CheckKind::Refund,
            ..enforce(cached, &limit)
        };
        cache.apply(&[refund]).await.unwrap();
        assert_eq!(count(), denials.len());
        // Past the window every denial has run out: the sweep empties the cache, and a full
        // shard makes room from what ran out.
        clock.advance(60_000_000);
        for k in keys.iter().take(100) {
            assert!(cache.apply(&[enforce(k, &limit)]).await.unwrap().allowed);
            assert_eq!(count(), denials.len());
            assert!(!cache.apply(&[enforce(k, &limit)]).await.unwrap().allowed);
            assert_eq!(count(), denials.len());
        }
        clock.advance(60_000_000);
        denials.sweep();
        assert_eq!((count(), denials.len()), (0, 0));
    }
}
