//! State in this process: a sharded map, one mutex per shard, no global lock. A batch locks the
//! shards it touches in ascending order (so two batches never deadlock), decides every check,
//! then commits all or nothing before unlocking.
//!
//! Each shard keeps an expiry index (a min-heap of when its keys empty), so a store at
//! `max_keys` reclaims expired keys in O(log n) each — from a rotating walk over the shards'
//! heap tops, with a hint that skips the walk while nothing can have expired — instead of
//! sweeping every key per request. Checks of zero hits never create a key. The full sweep runs
//! from `housekeeping`, which the server calls on a blocking thread.
//!
//! A key is held as its [`KeyId`], two independent keyed SipHashes of its bytes (128 bits), not
//! as the bytes: a typical key is ~55 bytes in an allocation of its own, and the store holds
//! millions. Two keys share an id with probability ~n²/2^129 (at 10 million keys, ~10^-25), and
//! the hash keys are random per process, so no one can make two descriptors collide on
//! purpose. The readable key is what `sluice explain` shows; the store never needs it back.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{Check, CheckKind, Outcome, Store, StoreError, StoreStatus};
use crate::clock::Clock;
use crate::limiter::{self, State, Update, Verdict};

const SHARDS: usize = 256;

/// A key's identity in the store: see the module's docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct KeyId([u64; 2]);

impl KeyId {
    /// The table's hash (and, by its bits 32.., the shard).
    fn hash(self) -> u64 {
        self.0[0]
    }
}

struct Entry {
    id: KeyId,
    state: State,
    /// When `state` is empty again; the sweeper forgets the key then.
    expires_at_us: u64,
}

/// A shard's keys and its expiry index: `(expires_at_us, hash)` per key, pushed when the key
/// is created. A key whose expiry moved later is pushed again when its old item comes up; an
/// item whose key is gone is dropped then.
#[derive(Default)]
struct Shard {
    table: hashbrown::HashTable<Entry>,
    expiry: BinaryHeap<Reverse<(u64, u64)>>,
}

impl Shard {
    /// When its earliest key may empty (u64::MAX: none).
    fn next_expiry(&self) -> u64 {
        self.expiry.peek().map_or(u64::MAX, |Reverse((at, _))| *at)
    }

    /// Drops up to `wanted` expired keys, popping at most `budget` index items. It stops at
    /// `wanted`: each item costs a heap pop and a table removal under this shard's lock, and
    /// the requests on this shard's live keys wait for it. Returns how many it dropped.
    fn reclaim(&mut self, now: u64, budget: &mut usize, wanted: usize) -> usize {
        let mut dropped = 0;
        while *budget > 0 && dropped < wanted {
            let Some(&Reverse((at, hash))) = self.expiry.peek() else {
                break;
            };
            if at > now {
                break;
            }
            self.expiry.pop();
            *budget -= 1;
            match self.table.find_entry(hash, |e| e.id.hash() == hash) {
                Ok(entry) if entry.get().expires_at_us <= now => {
                    entry.remove();
                    dropped += 1;
                }
                // Its state moved on: index it at its new expiry.
                Ok(entry) => self.expiry.push(Reverse((entry.get().expires_at_us, hash))),
                Err(_) => {}
            }
        }
        dropped
    }

    /// Forgets every key empty by `now`, and rebuilds the index when stale items dominate it.
    fn sweep(&mut self, now: u64) -> usize {
        let before = self.table.len();
        self.table.retain(|e| e.expires_at_us > now);
        if self.expiry.len() > 2 * self.table.len() + 16 {
            self.expiry = self
                .table
                .iter()
                .map(|e| Reverse((e.expires_at_us, e.id.hash())))
                .collect();
        }
        before - self.table.len()
    }
}

/// Most index items one request pops when the store is full.
const RECLAIM_BUDGET: usize = 64;

/// One check's place during a batch.
struct Slot {
    id: KeyId,
    shard: usize,
    /// What the check changes if the batch commits (or whatever it decides, when `always`).
    update: Option<Update>,
    /// [`Check::always_applied`]: a cost limit's charge is committed by a denied batch too.
    always: bool,
}

/// The first half of a [`KeyId`] (std's keyed, HashDoS-resistant SipHash), computed once per
/// check: bits 32.. pick the shard, and the table uses the low bits and the top 7, so the two
/// choices are independent.
fn shard_index(hash: u64) -> usize {
    ((hash >> 32) % SHARDS as u64) as usize
}

fn find(shard: &Shard, id: KeyId) -> Option<&Entry> {
    shard.table.find(id.hash(), |e| e.id == id)
}

pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    /// Two independently keyed hashers: a key's [`KeyId`].
    hashers: [RandomState; 2],
    clock: Arc<dyn Clock>,
    max_keys: usize,
    keys: AtomicUsize,
    /// Where the next reclaiming walk starts.
    reclaim_cursor: AtomicUsize,
    /// No key can be empty before this (the earliest heap top the last fruitless walk saw):
    /// a full store under a flood of new keys does not walk the shards per request.
    nothing_expires_before_us: AtomicU64,
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
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            hashers: [RandomState::new(), RandomState::new()],
            clock,
            max_keys,
            keys: AtomicUsize::new(0),
            reclaim_cursor: AtomicUsize::new(0),
            nothing_expires_before_us: AtomicU64::new(0),
        }
    }

    /// Keys currently held.
    pub fn len(&self) -> usize {
        self.keys.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets every key whose state is empty by now. Returns how many were dropped.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now_micros();
        let mut dropped = 0;
        for shard in self.shards.iter() {
            dropped += lock(shard).sweep(now);
        }
        self.keys.fetch_sub(dropped, Ordering::Relaxed);
        self.nothing_expires_before_us.store(0, Ordering::Relaxed);
        dropped
    }

    /// Frees room for `needed` keys from the expiry indexes: a walk over the shards from a
    /// rotating start, one lock at a time, popping at most `RECLAIM_BUDGET` items in all.
    /// Bounded work whatever the store holds. Returns whether anything was freed.
    fn reclaim(&self, needed: usize) -> bool {
        let now = self.clock.now_micros();
        if now < self.nothing_expires_before_us.load(Ordering::Relaxed) {
            return false;
        }
        let start = self.reclaim_cursor.fetch_add(1, Ordering::Relaxed);
        let mut budget = RECLAIM_BUDGET.max(needed);
        let mut freed = 0;
        let mut earliest = u64::MAX;
        for i in 0..SHARDS {
            let mut shard = lock(&self.shards[(start + i) % SHARDS]);
            freed += shard.reclaim(now, &mut budget, needed - freed);
            earliest = earliest.min(shard.next_expiry());
            drop(shard);
            if freed >= needed || budget == 0 {
                break;
            }
        }
        self.keys.fetch_sub(freed, Ordering::Relaxed);
        if freed == 0 {
            self.nothing_expires_before_us
                .store(earliest, Ordering::Relaxed);
        }
        freed > 0
    }

    fn id(&self, key: &[u8]) -> KeyId {
        KeyId([self.hashers[0].hash_one(key), self.hashers[1].hash_one(key)])
    }

    /// The all-or-nothing batch, synchronously.
    pub fn apply_now(&self, checks: &[Check<'_>]) -> Result<Outcome, StoreError> {
        match self.apply_locked(checks) {
            // At the cap: reclaim expired keys (no lock is held now) and try once more.
            Ok(outcome) => Ok(outcome),
            Err(needed) if self.reclaim(needed) => self
                .apply_locked(checks)
                .map_err(|_| StoreError::Full(self.max_keys)),
            Err(_) => Err(StoreError::Full(self.max_keys)),
        }
    }

    /// The batch, or how many keys too many it would create.
    fn apply_locked(&self, checks: &[Check<'_>]) -> Result<Outcome, usize> {
        let now = self.clock.now_micros();
        let mut slots: Vec<Slot> = checks
            .iter()
            .map(|c| {
                let id = self.id(c.key);
                Slot {
                    id,
                    shard: shard_index(id.hash()),
                    update: None,
                    always: c.always_applied(),
                }
            })
            .collect();
        let mut order: Vec<usize> = slots.iter().map(|s| s.shard).collect();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<MutexGuard<'_, Shard>> =
            order.iter().map(|&s| lock(&self.shards[s])).collect();
        let guard_of = |shard: usize| order.binary_search(&shard).expect("locked above");

        // Decide every check (keys are unique among consuming checks: the engine merges
        // repeats), then commit all or nothing.
        let mut verdicts = Vec::with_capacity(checks.len());
        let mut allowed = true;
        let mut new_keys = 0;
        let mut new_charge_keys = 0;
        for (i, c) in checks.iter().enumerate() {
            if c.kind == CheckKind::Refund {
                verdicts.push(Verdict::default());
                continue;
            }
            let shard = &guards[guard_of(slots[i].shard)];
            let committed = find(shard, slots[i].id).map(|e| &e.state);
            let (verdict, update) =
                limiter::decide(c.limit, committed.unwrap_or(&EMPTY), now, c.hits);
            // Looking at a counter that does not exist (zero hits) leaves it empty whatever the
            // update says: a probe must not take room.
            let looks_at_nothing = committed.is_none() && c.hits == 0;
            let always = slots[i].always;
            if (verdict.allowed || always) && !looks_at_nothing {
                if committed.is_none() && update != Update::Keep {
                    new_keys += 1;
                    new_charge_keys += usize::from(always);
                }
                slots[i].update = Some(update);
            }
            if !verdict.allowed && c.kind == CheckKind::Enforce {
                allowed = false;
            }
            verdicts.push(verdict);
        }

        // A denied batch still records its cost limits' charges.
        let new_keys = if allowed { new_keys } else { new_charge_keys };
        if new_keys > 0 && self.len() + new_keys > self.max_keys {
            return Err(self.len() + new_keys - self.max_keys);
        }

        for (c, (slot, verdict)) in checks.iter().zip(slots.iter_mut().zip(&mut verdicts)) {
            if let Some(update) = slot.update.take() {
                // A cost limit's charge was spent already: recorded whatever the batch does.
                if allowed || slot.always {
                    self.commit(&mut guards[guard_of(slot.shard)], c, slot.id, update);
                } else {
                    *verdict = verdict.unconsumed(c.hits);
                }
            }
        }
        // Refunds last, on the committed state, whatever the decision.
        for (c, (slot, verdict)) in checks.iter().zip(slots.iter().zip(&mut verdicts)) {
            if c.kind == CheckKind::Refund {
                let shard = &mut guards[guard_of(slot.shard)];
                let current = find(shard, slot.id).map_or(&EMPTY, |e| &e.state);
                // A lease's leftover may only go back to the window it came from.
                let hits = if c.until_us != 0 && now >= c.until_us {
                    0
                } else {
                    c.hits
                };
                let (refunded, next) = limiter::refund(c.limit, current, now, hits);
                *verdict = refunded;
                self.commit(shard, c, slot.id, Update::Set(next));
            }
        }
        Ok(Outcome {
            allowed,
            verdicts,
            by_policy: false,
            backend_now_us: Vec::new(),
        })
    }

    /// Applies `update` to the key's state in place; an empty result forgets the key.
    fn commit(&self, shard: &mut Shard, check: &Check<'_>, id: KeyId, update: Update) {
        if update == Update::Keep {
            return;
        }
        let entry = shard
            .table
            .entry(id.hash(), |e| e.id == id, |e| e.id.hash());
        let mut occupied = match entry {
            hashbrown::hash_table::Entry::Occupied(o) => o,
            hashbrown::hash_table::Entry::Vacant(v) => {
                self.keys.fetch_add(1, Ordering::Relaxed);
                v.insert(Entry {
                    id,
                    state: State::Empty,
                    expires_at_us: 0,
                })
            }
        };
        let e = occupied.get_mut();
        let new = e.expires_at_us == 0;
        e.state.apply(update);
        if e.state.is_empty() {
            occupied.remove();
            self.keys.fetch_sub(1, Ordering::Relaxed);
        } else {
            e.expires_at_us = e.state.expires_at_us(check.limit);
            if new {
                shard.expiry.push(Reverse((e.expires_at_us, id.hash())));
            }
        }
    }
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

    fn status(&self, status: &mut StoreStatus) {
        status.keys_in_memory = Some(self.len());
    }
}

#[cfg(test)]
mod tests;
