//! State in this process: a sharded map, one mutex per shard, no global lock. A batch locks the
//! shards it touches in ascending order (so two batches never deadlock), decides every check,
//! then commits all or nothing before unlocking.

use std::collections::HashMap;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{Check, CheckKind, Outcome, Store, StoreError};
use crate::clock::Clock;
use crate::limiter::{self, State, Update, Verdict};

const SHARDS: usize = 256;

struct Entry {
    state: State,
    /// When `state` is empty again; the sweeper forgets the key then.
    expires_at_us: u64,
}

type Shard = HashMap<Box<[u8]>, Entry>;

pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    shard_hasher: RandomState,
    clock: Arc<dyn Clock>,
    max_keys: usize,
    keys: AtomicUsize,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("keys", &self.len())
            .field("max_keys", &self.max_keys)
            .finish()
    }
}

static EMPTY: State = State::Empty;

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while holding a shard cannot leave an entry half-written (every write is one
    // insert or remove), so a poisoned lock is still consistent.
    shard.lock().unwrap_or_else(|e| e.into_inner())
}

impl MemoryStore {
    pub fn new(clock: Arc<dyn Clock>, max_keys: usize) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            shard_hasher: RandomState::new(),
            clock,
            max_keys,
            keys: AtomicUsize::new(0),
        }
    }

    /// Keys currently held.
    pub fn len(&self) -> usize {
        self.keys.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard_of(&self, key: &[u8]) -> usize {
        (self.shard_hasher.hash_one(key) % SHARDS as u64) as usize
    }

    /// Forgets every key whose state is empty by now. Returns how many were dropped.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now_micros();
        let mut dropped = 0;
        for shard in self.shards.iter() {
            dropped += sweep_shard(&mut lock(shard), now);
        }
        self.keys.fetch_sub(dropped, Ordering::Relaxed);
        dropped
    }

    /// The all-or-nothing batch, synchronously.
    pub fn apply_now(&self, checks: &[Check<'_>]) -> Result<Outcome, StoreError> {
        match self.apply_locked(checks) {
            // At the cap: forget every expired key (all shards, so no lock is held now) and
            // try once more.
            Err(StoreError::Full(_)) => {
                self.sweep();
                self.apply_locked(checks)
            }
            other => other,
        }
    }

    fn apply_locked(&self, checks: &[Check<'_>]) -> Result<Outcome, StoreError> {
        let now = self.clock.now_micros();
        let shard_of: Vec<usize> = checks.iter().map(|c| self.shard_of(c.key)).collect();
        let mut order = shard_of.clone();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<MutexGuard<'_, Shard>> =
            order.iter().map(|&s| lock(&self.shards[s])).collect();
        let slot = |i: usize| order.binary_search(&shard_of[i]).expect("locked above");

        // Decide every check against the committed state, or against the state after the
        // earlier checks of this batch on the same key (a request may name one counter twice).
        let mut updates: Vec<Option<Update>> = vec![None; checks.len()];
        let mut verdicts = Vec::with_capacity(checks.len());
        let mut allowed = true;
        let mut new_keys = 0;
        for (i, c) in checks.iter().enumerate() {
            if c.kind == CheckKind::Refund {
                verdicts.push(Verdict::default());
                continue;
            }
            let committed = guards[slot(i)].get(c.key).map(|e| &e.state);
            let earlier: Vec<&Update> = (0..i)
                .filter(|&j| checks[j].key == c.key)
                .filter_map(|j| updates[j].as_ref())
                .collect();
            let (verdict, update) = if earlier.is_empty() {
                limiter::decide(c.limit, committed.unwrap_or(&EMPTY), now, c.hits)
            } else {
                let mut state = committed.cloned().unwrap_or_default();
                for u in earlier {
                    state.apply(u.clone());
                }
                limiter::decide(c.limit, &state, now, c.hits)
            };
            if verdict.allowed {
                let first_for_key = !(0..i).any(|j| updates[j].is_some() && checks[j].key == c.key);
                if committed.is_none() && first_for_key && update != Update::Keep {
                    new_keys += 1;
                }
                updates[i] = Some(update);
            } else if c.kind == CheckKind::Enforce {
                allowed = false;
            }
            verdicts.push(verdict);
        }

        if allowed && new_keys > 0 && self.len() + new_keys > self.max_keys {
            return Err(StoreError::Full(self.max_keys));
        }

        for (i, c) in checks.iter().enumerate() {
            let shard = &mut guards[slot(i)];
            if c.kind == CheckKind::Refund {
                let current = shard.get(c.key).map_or(&EMPTY, |e| &e.state);
                let (verdict, next) = limiter::refund(c.limit, current, now, c.hits);
                verdicts[i] = verdict;
                self.commit(shard, c, Update::Set(next));
            } else if let Some(update) = updates[i].take() {
                if allowed {
                    self.commit(shard, c, update);
                } else {
                    verdicts[i] = verdicts[i].unconsumed(c.hits);
                }
            }
        }
        Ok(Outcome { allowed, verdicts })
    }

    /// Applies `update` to the key's state in place; an empty result forgets the key.
    fn commit(&self, shard: &mut Shard, check: &Check<'_>, update: Update) {
        if update == Update::Keep {
            return;
        }
        let entry = match shard.get_mut(check.key) {
            Some(e) => e,
            None => {
                self.keys.fetch_add(1, Ordering::Relaxed);
                shard.entry(check.key.into()).or_insert(Entry {
                    state: State::Empty,
                    expires_at_us: 0,
                })
            }
        };
        entry.state.apply(update);
        if entry.state.is_empty() {
            shard.remove(check.key);
            self.keys.fetch_sub(1, Ordering::Relaxed);
        } else {
            entry.expires_at_us = entry.state.expires_at_us(check.limit);
        }
    }
}

fn sweep_shard(shard: &mut Shard, now: u64) -> usize {
    let before = shard.len();
    shard.retain(|_, e| e.expires_at_us > now);
    before - shard.len()
}

impl Store for MemoryStore {
    fn apply(
        &self,
        checks: &[Check<'_>],
    ) -> impl std::future::Future<Output = Result<Outcome, StoreError>> + Send {
        std::future::ready(self.apply_now(checks))
    }

    fn housekeeping(&self) {
        self.sweep();
    }
}

#[cfg(test)]
mod tests;
