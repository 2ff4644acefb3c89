//! A map split over independent mutexes, so threads deciding different counters do not queue
//! on one lock. A key's shard comes from a keyed (HashDoS-resistant) hash; a batch that needs
//! several shards at once locks them in ascending order, so two batches never deadlock.
//!
//! Keyed by a counter's bytes by default; a table that keys its entries by something else (a
//! fingerprint it hashed already, `fallback::last_seen`) picks their shards itself
//! (`lock_shard`) and may give its shards' maps their own hasher.

use std::collections::HashMap;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::{Mutex, MutexGuard};

pub(crate) const SHARDS: usize = 64;

type Map<V, K, H> = HashMap<K, V, H>;

pub(crate) struct Sharded<V, K = Box<[u8]>, H = RandomState> {
    shards: Box<[Mutex<Map<V, K, H>>]>,
    hasher: RandomState,
}

pub(crate) type Guard<'a, V, K = Box<[u8]>, H = RandomState> = MutexGuard<'a, Map<V, K, H>>;

impl<V, K, H: Default> Sharded<V, K, H> {
    pub fn new() -> Self {
        Self {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(HashMap::default()))
                .collect(),
            hasher: RandomState::new(),
        }
    }

    /// Shard `shard` (below [`SHARDS`]), locked. A panic while holding a shard cannot leave an
    /// entry half-written (every write is one insert, remove or field update), so a poisoned
    /// lock is still consistent.
    pub fn lock_shard(&self, shard: usize) -> Guard<'_, V, K, H> {
        self.shards[shard].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every shard in turn (one lock at a time).
    pub fn for_each_shard(&self, mut f: impl FnMut(&mut Map<V, K, H>)) {
        for shard in 0..SHARDS {
            f(&mut self.lock_shard(shard));
        }
    }

    pub fn len(&self) -> usize {
        let mut n = 0;
        self.for_each_shard(|m| n += m.len());
        n
    }
}

impl<V> Sharded<V> {
    pub fn shard_of(&self, key: &[u8]) -> usize {
        (self.hasher.hash_one(key) % SHARDS as u64) as usize
    }

    /// The shard of `key`, locked (see `lock_shard`).
    pub fn lock(&self, key: &[u8]) -> Guard<'_, V> {
        self.lock_shard(self.shard_of(key))
    }

    /// The shards of all `keys`, each locked once, in ascending order; with the shard each key
    /// maps to (an index into the returned guards).
    pub fn lock_all<'k>(
        &self,
        keys: impl Iterator<Item = &'k [u8]>,
    ) -> (Vec<Guard<'_, V>>, Vec<usize>) {
        let shards: Vec<usize> = keys.map(|k| self.shard_of(k)).collect();
        let mut order = shards.clone();
        order.sort_unstable();
        order.dedup();
        let guards = order.iter().map(|&s| self.lock_shard(s)).collect();
        let index = shards
            .iter()
            .map(|s| order.binary_search(s).expect("locked above"))
            .collect();
        (guards, index)
    }
}
