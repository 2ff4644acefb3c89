//! What each counter had left when this node last heard from the backend: so that when the
//! backend is lost mid-window, `failure_mode: local` shares out what the fleet had left of the
//! window, not the whole limit again.
//!
//! Only window counters are kept ([`Algorithm::windowed`](crate::limiter::Algorithm::windowed)):
//! what a window has left stays left until the window ends, so a node's last answer bounds what
//! the fleet may still admit in it. A bucket's room refills as time passes, so the limit's share
//! is all a node can go by there.
//!
//! Bounded like the lease table: at most `max_entries` counters (rounded up per shard); a new
//! counter past it is not kept (its share is the limit's, as before), and the upkeep's sweep
//! forgets windows that have ended.
//!
//! Every strict answer is learned, so where keys are many (a key per user, most hits a key's
//! first in its window) the table gains an entry on nearly every decision. A counter is
//! therefore kept under a 128-bit fingerprint of its key, two independently keyed hashes, not a
//! boxed copy of the key: no allocation to learn a new counter, none to forget it, and no second
//! memory read to compare keys. The first hash picks the shard and the second the map's bucket,
//! so each key is hashed twice, as before. Two live counters sharing a fingerprint would read
//! each other's view; with hashes keyed by this process's random keys that takes, for ten
//! million counters, odds of about 10^-25.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, BuildHasherDefault, Hash, Hasher};

use crate::limiter::Limit;
use crate::store::Check;
use crate::store::sharded::{Guard, SHARDS, Sharded};

/// One counter as last seen.
#[derive(Debug, Clone, Copy)]
struct Seen {
    limit: Limit,
    /// This node's clock: the end of the window `remaining` belongs to.
    window_end_us: u64,
    /// What the backend had left of the window then, this request's hits taken.
    remaining: u64,
}

/// A counter's key as the table knows it: two keyed hashes of it (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fingerprint {
    shard_hash: u64,
    bucket_hash: u64,
}

impl Hash for Fingerprint {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.bucket_hash);
    }
}

/// The map's hasher: the fingerprint is a keyed hash already, so its bucket hash is used as it
/// is.
#[derive(Default)]
struct AsHashed(u64);

impl Hasher for AsHashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `Fingerprint` is hashed here, through `write_u64`.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type ByFingerprint = BuildHasherDefault<AsHashed>;

pub struct LastSeen {
    entries: Sharded<Seen, Fingerprint, ByFingerprint>,
    /// The two keys of a fingerprint's hashes, random per process.
    keys: (RandomState, RandomState),
    max_per_shard: usize,
}

impl LastSeen {
    pub fn new(max_entries: usize) -> Self {
        Self {
            entries: Sharded::new(),
            keys: (RandomState::new(), RandomState::new()),
            max_per_shard: max_entries.div_ceil(SHARDS).max(1),
        }
    }

    fn fingerprint(&self, key: &[u8]) -> Fingerprint {
        Fingerprint {
            shard_hash: self.keys.0.hash_one(key),
            bucket_hash: self.keys.1.hash_one(key),
        }
    }

    fn shard(&self, f: &Fingerprint) -> Guard<'_, Seen, Fingerprint, ByFingerprint> {
        self.entries
            .lock_shard((f.shard_hash % SHARDS as u64) as usize)
    }

    /// The backend answered `c`'s counter with `remaining` at `now_us` (this node's clock). On
    /// the strict path, every decision: a window's end (a calendar's is a time-zone reckoning)
    /// is computed once per window, not per call.
    pub fn learn(&self, c: &Check<'_>, remaining: u64, now_us: u64) {
        if !c.limit.algorithm.windowed() {
            return;
        }
        let f = self.fingerprint(c.key);
        let mut entries = self.shard(&f);
        if let Some(s) = entries.get_mut(&f) {
            if s.limit != *c.limit || now_us >= s.window_end_us {
                s.limit = *c.limit;
                s.window_end_us = c.limit.window_at(now_us).1;
            }
            s.remaining = remaining;
        } else if entries.len() < self.max_per_shard {
            let seen = Seen {
                limit: *c.limit,
                window_end_us: c.limit.window_at(now_us).1,
                remaining,
            };
            entries.insert(f, seen);
        }
    }

    /// What `c`'s counter had left of the window `now_us` is in, as last seen; None when not
    /// seen in this window under this limit.
    pub fn left(&self, c: &Check<'_>, now_us: u64) -> Option<u64> {
        let f = self.fingerprint(c.key);
        let entries = self.shard(&f);
        let s = entries.get(&f)?;
        (s.limit == *c.limit && now_us < s.window_end_us).then_some(s.remaining)
    }

    /// Forgets the counters whose window has ended.
    pub fn sweep(&self, now_us: u64) {
        self.entries
            .for_each_shard(|m| m.retain(|_, s| now_us < s.window_end_us));
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Algorithm;

    const MINUTE: u64 = 60_000_000;

    #[test]
    fn a_window_is_remembered_until_it_ends_and_only_under_its_limit() {
        let seen = LastSeen::new(100);
        let limit = Limit::new(Algorithm::FixedWindow, 300, MINUTE, None).unwrap();
        let c = Check::enforce(b"k", &limit, 1);
        let t = 10 * MINUTE + 1_000;
        seen.learn(&c, 99, t);
        assert_eq!(seen.left(&c, t + 1), Some(99));
        assert_eq!(seen.left(&c, 11 * MINUTE - 1), Some(99));
        assert_eq!(seen.left(&c, 11 * MINUTE), None, "the next window");
        let other = Limit::new(Algorithm::FixedWindow, 600, MINUTE, None).unwrap();
        assert_eq!(
            seen.left(&Check::enforce(b"k", &other, 1), t),
            None,
            "another limit"
        );
        seen.sweep(11 * MINUTE);
        assert!(seen.is_empty());
    }

    #[test]
    fn counters_are_kept_apart() {
        let seen = LastSeen::new(100_000);
        let limit = Limit::new(Algorithm::FixedWindow, 100_000, MINUTE, None).unwrap();
        let keys: Vec<Vec<u8>> = (0..10_000u32)
            .map(|n| format!("k{n}").into_bytes())
            .collect();
        for (n, key) in keys.iter().enumerate() {
            seen.learn(&Check::enforce(key, &limit, 1), n as u64, MINUTE);
        }
        assert_eq!(seen.len(), keys.len());
        for (n, key) in keys.iter().enumerate() {
            assert_eq!(
                seen.left(&Check::enforce(key, &limit, 1), MINUTE + 1),
                Some(n as u64)
            );
        }
        assert_eq!(
            seen.left(&Check::enforce(b"unseen", &limit, 1), MINUTE + 1),
            None
        );
    }

    #[test]
    fn buckets_are_not_kept_and_the_table_is_bounded() {
        let seen = LastSeen::new(1);
        let bucket = Limit::new(Algorithm::TokenBucket, 300, MINUTE, None).unwrap();
        seen.learn(&Check::enforce(b"b", &bucket, 1), 5, MINUTE);
        assert!(seen.is_empty());
        let limit = Limit::new(Algorithm::SlidingWindow, 300, MINUTE, None).unwrap();
        let keys: Vec<[u8; 4]> = (0..1_000u32).map(u32::to_be_bytes).collect();
        for key in &keys {
            seen.learn(&Check::enforce(key, &limit, 1), 1, MINUTE);
        }
        assert!(seen.len() <= SHARDS, "at most one a shard: {}", seen.len());
    }
}
