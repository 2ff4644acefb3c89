//! State in this process: a sharded map, one mutex per shard, no global lock. A batch locks the
//! shards it touches in ascending order (so two batches never deadlock), decides every check,
//! then commits all or nothing before unlocking.
//!
//! ## A counter in 49 bytes
//!
//! The store holds millions of counters, so an [`Entry`] is packed: a key's [`KeyId`] (16
//! bytes), its state's integers (24) and one word holding the state's kind and when it is empty
//! again (8), plus the table's control byte. [`State`] itself is 32 bytes (an enum tag and three
//! integers) and would make it 56. A sliding log's boxed stamps don't fit the words: its whole
//! state lives in the shard's `logs` table, and its entry only says so.
//!
//! A key is held as its [`KeyId`], two independent keyed SipHashes of its bytes (128 bits), not
//! as the bytes: a typical key is ~55 bytes in an allocation of its own. Two keys share an id
//! with probability ~n²/2^129 (at 10 million keys, ~10^-25), and the hash keys are random per
//! process, so no one can make two descriptors collide on purpose. The readable key is what
//! `sluice explain` shows; the store never needs it back.
//!
//! ## Shards of unequal size
//!
//! A hash table doubles when it is 7/8 full, so it is between 44 % and 88 % full. Shards of
//! equal size all double at the same count, and the whole store's bytes per key would saw
//! between 56 and 112 with the number of keys. Shard `i` instead takes a share of the keys
//! proportional to 2^(i/256): the shards' sizes spread evenly over one doubling, so at any count
//! they sit at every point of their growth at once, and the store is on average ~60 % full:
//! ~80 bytes per key whatever the count. The largest shard gets twice the smallest's traffic,
//! which 256 locks absorb.
//!
//! ## Forgetting empty keys
//!
//! Every entry carries when its state is empty again. The full sweep (`sweep`, which the store's
//! upkeep runs on a blocking thread) drops the empty keys of every shard. A store at `max_keys`
//! also reclaims room per request, in bounded work: each shard has a clock hand that walks its
//! buckets a few hundred at a time and drops the empty keys it passes. Each shard also knows a
//! time before which none of its keys empties (exact after a sweep or a full lap of the hand,
//! lowered by every write), so the walk skips shards with nothing to give, and a full store
//! under a flood of new keys stops walking at all until the earliest of those times.

use std::borrow::Cow;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use hashbrown::HashTable;

use super::{Check, CheckKind, DecidedBy, Outcome, Store, StoreError};
use crate::clock::Clock;
use crate::limiter::{self, State, Update, Verdict};

const SHARDS: usize = 256;

/// A key's identity in the store: see the module's docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct KeyId([u64; 2]);

impl KeyId {
    /// The table's hash: its low bits pick the bucket and its top 7 bits are the control byte's
    /// tag. Bits 24..56 pick the shard (see [`MemoryStore::shard_of`]), so the three are
    /// independent.
    fn hash(self) -> u64 {
        self.0[0]
    }
}

/// Which [`State`] an entry's words hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Window = 0,
    Sliding = 1,
    Meter = 2,
    /// The state is in the shard's `boxed` table: a sliding log's stamps, a concurrency
    /// limit's slots.
    Boxed = 3,
}

const KIND_BITS: u32 = 2;
const KIND_MASK: u64 = (1 << KIND_BITS) - 1;
// Every kind fits its bits (a fifth state shape needs a wider KIND_BITS and `Entry::kind`).
const _: () = assert!(Kind::Boxed as u64 <= KIND_MASK);

/// A counter: see the module's docs.
struct Entry {
    id: KeyId,
    words: [u64; 3],
    /// The [`Kind`] in the low bits and, above them, when the state is empty again (µs).
    kind_and_expiry: u64,
}

// Packed on purpose: see the module's docs.
const _: () = assert!(std::mem::size_of::<Entry>() == 48);

impl Entry {
    fn new(id: KeyId) -> Self {
        Entry {
            id,
            words: [0; 3],
            kind_and_expiry: Kind::Window as u64,
        }
    }

    fn kind(&self) -> Kind {
        match self.kind_and_expiry & KIND_MASK {
            0 => Kind::Window,
            1 => Kind::Sliding,
            2 => Kind::Meter,
            _ => Kind::Boxed,
        }
    }

    fn expires_at_us(&self) -> u64 {
        self.kind_and_expiry >> KIND_BITS
    }

    /// The state, unless it is boxed (kept in the shard's `boxed`).
    fn state(&self) -> Option<State> {
        let [a, b, c] = self.words;
        Some(match self.kind() {
            Kind::Window => State::Window {
                start_us: a,
                count: b,
            },
            Kind::Sliding => State::Sliding {
                start_us: a,
                current: b,
                previous: c,
            },
            Kind::Meter => State::Meter {
                empty_tick: a,
                frac: b,
            },
            Kind::Boxed => return None,
        })
    }

    /// Stores `state`, empty at `expires_at_us`. Returns it back if it is a log, for the
    /// shard's `boxed`.
    fn set(&mut self, state: State, expires_at_us: u64) -> Option<State> {
        let (kind, words, log) = match state {
            State::Window { start_us, count } => (Kind::Window, [start_us, count, 0], None),
            State::Sliding {
                start_us,
                current,
                previous,
            } => (Kind::Sliding, [start_us, current, previous], None),
            State::Meter { empty_tick, frac } => (Kind::Meter, [empty_tick, frac, 0], None),
            // Never stored (a commit forgets an empty key); a window of zero hits is empty too.
            State::Empty => (Kind::Window, [0; 3], None),
            boxed @ (State::Log { .. } | State::Slots { .. }) => (Kind::Boxed, [0; 3], Some(boxed)),
        };
        self.words = words;
        // The last µs the word can say is in the year ~75 000: later is as good as never.
        self.kind_and_expiry = expires_at_us.min(u64::MAX >> KIND_BITS) << KIND_BITS | kind as u64;
        log
    }
}

static EMPTY: State = State::Empty;

/// A shard's keys, and what its reclaiming walk knows about them.
struct Shard {
    table: HashTable<Entry>,
    /// The states whose parts are boxed, whole: sliding logs (their stamps) and concurrency
    /// limits (their slots); few keys use one.
    boxed: HashTable<(KeyId, State)>,
    /// No key here is empty before this: exact after a sweep or a clean lap of the hand,
    /// lowered by every write in between.
    earliest_expiry_us: u64,
    /// The next bucket the reclaiming walk looks at.
    hand: usize,
    /// The earliest expiry the hand has passed on this lap, and every write's since it began.
    lap_earliest_us: u64,
    /// No key was inserted since the lap began. An insert may rehash the table and move keys
    /// behind the hand, so only a clean lap has seen every key.
    lap_clean: bool,
}

impl Default for Shard {
    fn default() -> Self {
        Shard {
            table: HashTable::new(),
            boxed: HashTable::new(),
            earliest_expiry_us: u64::MAX,
            hand: 0,
            lap_earliest_us: u64::MAX,
            lap_clean: true,
        }
    }
}

impl Shard {
    fn find(&self, id: KeyId) -> Option<&Entry> {
        self.table.find(id.hash(), |e| e.id == id)
    }

    /// The key's state, if the shard holds the key.
    fn state(&self, id: KeyId) -> Option<Cow<'_, State>> {
        let entry = self.find(id)?;
        Some(match entry.state() {
            Some(state) => Cow::Owned(state),
            None => Cow::Borrowed(
                self.boxed
                    .find(id.hash(), |(k, _)| *k == id)
                    .map_or(&EMPTY, |(_, state)| state),
            ),
        })
    }

    /// Takes a boxed state out of `boxed`.
    fn take_boxed(boxed: &mut HashTable<(KeyId, State)>, id: KeyId) -> State {
        match boxed.find_entry(id.hash(), |(k, _)| *k == id) {
            Ok(entry) => entry.remove().0.1,
            Err(_) => State::Empty,
        }
    }

    /// Drops what a forgotten entry kept beside it in `boxed`.
    fn forget_boxed(boxed: &mut HashTable<(KeyId, State)>, gone: &Entry) {
        if gone.kind() == Kind::Boxed {
            Self::take_boxed(boxed, gone.id);
        }
    }

    /// Starts the hand's next lap from the first bucket.
    fn restart_lap(&mut self) {
        self.hand = 0;
        self.lap_earliest_us = u64::MAX;
        self.lap_clean = true;
    }

    /// Notes a key's new expiry for the walk's bounds.
    fn expires_at(&mut self, at: u64) {
        self.earliest_expiry_us = self.earliest_expiry_us.min(at);
        self.lap_earliest_us = self.lap_earliest_us.min(at);
    }

    /// Drops up to `wanted` empty keys, moving the hand over at most `budget` buckets. It stops
    /// at `wanted`: the requests on this shard's live keys wait for its lock. Returns how many
    /// it dropped.
    fn reclaim(&mut self, now: u64, budget: &mut usize, wanted: usize) -> usize {
        let mut dropped = 0;
        while self.earliest_expiry_us <= now && *budget > 0 && dropped < wanted {
            if self.hand >= self.table.num_buckets() {
                if self.lap_clean {
                    self.earliest_expiry_us = self.lap_earliest_us;
                }
                self.restart_lap();
                if self.table.is_empty() {
                    self.earliest_expiry_us = u64::MAX;
                }
                continue;
            }
            *budget -= 1;
            let bucket = self.hand;
            self.hand += 1;
            let Ok(entry) = self.table.get_bucket_entry(bucket) else {
                continue;
            };
            let at = entry.get().expires_at_us();
            if at > now {
                self.lap_earliest_us = self.lap_earliest_us.min(at);
                continue;
            }
            let (gone, _) = entry.remove();
            Self::forget_boxed(&mut self.boxed, &gone);
            dropped += 1;
        }
        dropped
    }

    /// Forgets every key empty by `now`. Returns how many.
    fn sweep(&mut self, now: u64) -> usize {
        let before = self.table.len();
        let mut earliest = u64::MAX;
        let boxed = &mut self.boxed;
        self.table.retain(|e| {
            let at = e.expires_at_us();
            if at > now {
                earliest = earliest.min(at);
                return true;
            }
            Self::forget_boxed(boxed, e);
            false
        });
        self.earliest_expiry_us = earliest;
        self.restart_lap();
        before - self.table.len()
    }
}

/// Most buckets one request's reclaiming walk passes when the store is full (~1–2 µs).
const RECLAIM_BUDGET: usize = 512;

/// One check's place during a batch.
struct Slot {
    id: KeyId,
    shard: usize,
    /// What the check changes if the batch commits (or whatever it decides, when `always`).
    update: Option<Update>,
    /// [`Check::always_applied`]: a cost limit's charge is committed by a denied batch too.
    always: bool,
}

pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    /// Shard `i` takes the hashes below `shard_bounds[i]` (and at or above the one before):
    /// shares proportional to 2^(i/256), see the module's docs.
    shard_bounds: Box<[u32]>,
    /// Two independently keyed hashers: a key's [`KeyId`].
    hashers: [RandomState; 2],
    clock: Arc<dyn Clock>,
    max_keys: usize,
    keys: AtomicUsize,
    /// Where the next reclaiming walk starts.
    reclaim_cursor: AtomicUsize,
    /// No key can be empty before this (the earliest bound the last fruitless walk saw): a full
    /// store under a flood of new keys does not walk the shards per request.
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

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while holding a shard cannot leave an entry half-written (every write is one
    // insert or remove), so a poisoned lock is still consistent.
    shard.lock().unwrap_or_else(|e| e.into_inner())
}

/// Where each shard's hashes end: shard `i`'s share of 2^32 is proportional to 2^(i/SHARDS).
fn shard_bounds() -> Box<[u32]> {
    (1..=SHARDS)
        .map(|i| {
            let share = (i as f64 / SHARDS as f64).exp2() - 1.0;
            // The last bound is 2^32 - 1: a hash of u32::MAX belongs to the last shard too.
            (share * 4_294_967_296.0).min(u32::MAX as f64) as u32
        })
        .collect()
}

impl MemoryStore {
    pub fn new(clock: Arc<dyn Clock>, max_keys: usize) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            shard_bounds: shard_bounds(),
            hashers: [RandomState::new(), RandomState::new()],
            clock,
            max_keys,
            keys: AtomicUsize::new(0),
            reclaim_cursor: AtomicUsize::new(0),
            nothing_expires_before_us: AtomicU64::new(0),
        }
    }

    /// This store's clock now: the time its windows are computed at.
    pub fn now(&self) -> u64 {
        self.clock.now_micros()
    }

    /// Keys currently held.
    pub fn len(&self) -> usize {
        self.keys.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes the shards' tables hold (allocated, full or not): what the counters cost, less the
    /// sliding logs' stamps.
    pub fn table_bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let s = lock(s);
                s.table.allocation_size() + s.boxed.allocation_size()
            })
            .sum()
    }

    fn shard_of(&self, id: KeyId) -> usize {
        let bits = (id.hash() >> 24) as u32;
        self.shard_bounds
            .partition_point(|&end| end <= bits)
            .min(SHARDS - 1)
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

    /// Frees room for `needed` keys: a walk over the shards from a rotating start, one lock at a
    /// time, moving their hands over at most `RECLAIM_BUDGET` buckets in all. Bounded work
    /// whatever the store holds. Returns whether anything was freed.
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
            earliest = earliest.min(shard.earliest_expiry_us);
            drop(shard);
            if freed >= needed || budget == 0 {
                break;
            }
        }
        self.keys.fetch_sub(freed, Ordering::Relaxed);
        // Every shard was looked at and none has anything to give before `earliest`.
        if freed == 0 && budget > 0 {
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
                    shard: self.shard_of(id),
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
            let committed = shard.state(slots[i].id);
            let (verdict, update) = limiter::decide(
                c.limit,
                committed.as_deref().unwrap_or(&EMPTY),
                now,
                c.hits,
                c.slot,
            );
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
                } else if update != Update::Keep {
                    // Not consumed after all. (A check that would write nothing, a request
                    // that holds its concurrency slot already, consumed nothing to give back.)
                    *verdict = verdict.unconsumed(c.hits);
                }
            }
        }
        // Refunds last, on the committed state, whatever the decision.
        for (c, (slot, verdict)) in checks.iter().zip(slots.iter().zip(&mut verdicts)) {
            if c.kind == CheckKind::Refund {
                let shard = &mut guards[guard_of(slot.shard)];
                let current = shard.state(slot.id);
                let (refunded, next) = limiter::refund(
                    c.limit,
                    current.as_deref().unwrap_or(&EMPTY),
                    now,
                    c.hits,
                    c.slot,
                    c.until_us,
                );
                *verdict = refunded;
                self.commit(shard, c, slot.id, Update::Set(next));
            }
        }
        Ok(Outcome {
            allowed,
            verdicts,
            decided_by: DecidedBy::Counters,
            backend_now_us: Vec::new(),
        })
    }

    /// Applies `update` to the key's state in place; an empty result forgets the key.
    fn commit(&self, shard: &mut Shard, check: &Check<'_>, id: KeyId, update: Update) {
        if update == Update::Keep {
            return;
        }
        let Shard { table, boxed, .. } = shard;
        // `find_entry`, not `entry`: only an insert may rehash the table (see `lap_clean`).
        let (mut entry, inserted) = match table.find_entry(id.hash(), |e| e.id == id) {
            Ok(entry) => (entry, false),
            Err(absent) => {
                self.keys.fetch_add(1, Ordering::Relaxed);
                let entry = absent
                    .into_table()
                    .insert_unique(id.hash(), Entry::new(id), |e| e.id.hash());
                (entry, true)
            }
        };
        let mut state = match (inserted, entry.get().state()) {
            (true, _) => State::Empty,
            (false, Some(state)) => state,
            (false, None) => Shard::take_boxed(boxed, id),
        };
        state.apply(update);
        if state.is_empty() {
            entry.remove();
            self.keys.fetch_sub(1, Ordering::Relaxed);
            return;
        }
        let at = state.expires_at_us(check.limit);
        if let Some(log) = entry.get_mut().set(state, at) {
            boxed.insert_unique(id.hash(), (id, log), |(k, _)| k.hash());
        }
        shard.expires_at(at);
        shard.lap_clean &= !inserted;
    }
}

impl Store for MemoryStore {
    fn apply(
        &self,
        checks: &[Check<'_>],
    ) -> impl std::future::Future<Output = Result<Outcome, StoreError>> + Send {
        std::future::ready(self.apply_now(checks))
    }
}

#[cfg(test)]
mod tests;
