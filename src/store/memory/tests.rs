use super::*;
use crate::clock::ManualClock;
use crate::limiter::{Algorithm, Limit};

const S: u64 = 1_000_000;

fn store(max_keys: usize) -> (Arc<ManualClock>, MemoryStore) {
    let clock = Arc::new(ManualClock::new(1_000 * S));
    (clock.clone(), MemoryStore::new(clock, max_keys))
}

fn check<'a>(key: &'a [u8], limit: &'a Limit, hits: u64) -> Check<'a> {
    Check::enforce(key, limit, hits)
}

#[test]
fn a_denied_batch_consumes_nothing_anywhere() {
    let (_, s) = store(100);
    let ten = Limit::new(Algorithm::FixedWindow, 10, S, None).unwrap();
    let one = Limit::new(Algorithm::TokenBucket, 1, S, None).unwrap();
    assert!(s.apply_now(&[check(b"b", &one, 1)]).unwrap().allowed);
    let out = s
        .apply_now(&[check(b"a", &ten, 1), check(b"b", &one, 1)])
        .unwrap();
    assert!(!out.allowed);
    assert!(out.verdicts[0].allowed);
    assert_eq!(out.verdicts[0].remaining, 10, "reported as not consumed");
    assert!(!out.verdicts[1].allowed);
    // `a` was not consumed: ten more fit.
    let out = s.apply_now(&[check(b"a", &ten, 10)]).unwrap();
    assert!(out.allowed);
}

#[test]
fn shadow_checks_never_deny_the_batch() {
    let (_, s) = store(100);
    let one = Limit::new(Algorithm::FixedWindow, 1, S, None).unwrap();
    let shadow = |key| Check {
        kind: CheckKind::Shadow,
        ..check(key, &one, 1)
    };
    assert!(s.apply_now(&[shadow(b"s")]).unwrap().allowed);
    let out = s.apply_now(&[shadow(b"s"), check(b"e", &one, 1)]).unwrap();
    assert!(out.allowed);
    assert!(!out.verdicts[0].allowed);
}

#[test]
fn a_refund_and_a_charge_on_one_counter_both_count() {
    let (_, s) = store(100);
    let three = Limit::new(Algorithm::SlidingLog, 3, S, None).unwrap();
    assert!(s.apply_now(&[check(b"k", &three, 3)]).unwrap().allowed);
    let refund = Check {
        kind: CheckKind::Refund,
        ..check(b"k", &three, 2)
    };
    // The refund comes first in the batch but applies after the charge.
    let out = s.apply_now(&[refund, check(b"k", &three, 0)]).unwrap();
    assert_eq!(out.verdicts[0].remaining, 2);
}

#[test]
fn refunds_apply_even_in_a_denied_batch() {
    let (_, s) = store(100);
    let two = Limit::new(Algorithm::FixedWindow, 2, 60 * S, None).unwrap();
    assert!(s.apply_now(&[check(b"r", &two, 2)]).unwrap().allowed);
    let refund = Check {
        kind: CheckKind::Refund,
        ..check(b"r", &two, 1)
    };
    let out = s.apply_now(&[check(b"x", &two, 3), refund]).unwrap();
    assert!(!out.allowed);
    assert_eq!(out.verdicts[1].remaining, 1);
    assert!(s.apply_now(&[check(b"r", &two, 1)]).unwrap().allowed);
}

#[test]
fn empty_keys_are_forgotten() {
    let (clock, s) = store(100);
    let l = Limit::new(Algorithm::Gcra, 10, S, None).unwrap();
    let w = Limit::new(Algorithm::FixedWindow, 10, 60 * S, None).unwrap();
    s.apply_now(&[check(b"g", &l, 5), check(b"w", &w, 1)])
        .unwrap();
    assert_eq!(s.len(), 2);
    clock.advance(S / 2);
    assert_eq!(s.sweep(), 1, "the bucket drained in 500 ms");
    clock.advance(60 * S);
    assert_eq!(s.sweep(), 1);
    assert!(s.is_empty());
    // A refund to empty removes the key at once.
    s.apply_now(&[check(b"g", &l, 1)]).unwrap();
    let refund = Check {
        kind: CheckKind::Refund,
        ..check(b"g", &l, 1)
    };
    s.apply_now(&[refund]).unwrap();
    assert!(s.is_empty());
}

#[test]
fn at_max_keys_new_counters_are_refused_and_old_ones_work() {
    let (clock, s) = store(2);
    let l = Limit::new(Algorithm::FixedWindow, 10, S, None).unwrap();
    s.apply_now(&[check(b"a", &l, 1), check(b"b", &l, 1)])
        .unwrap();
    assert!(matches!(
        s.apply_now(&[check(b"c", &l, 1)]),
        Err(StoreError::Full(2))
    ));
    assert!(s.apply_now(&[check(b"a", &l, 1)]).unwrap().allowed);
    // Expired keys make room.
    clock.advance(S);
    assert!(s.apply_now(&[check(b"c", &l, 1)]).unwrap().allowed);
}

#[test]
fn concurrent_requests_never_admit_more_than_the_limit() {
    for algorithm in Algorithm::RATES {
        let (_, s) = store(1_000);
        let s = Arc::new(s);
        let limit = Limit::new(algorithm, 500, 3_600 * S, None).unwrap();
        let admitted = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for t in 0..8 {
                let (s, limit, admitted) = (&s, &limit, &admitted);
                scope.spawn(move || {
                    for i in 0..200 {
                        // Half the requests also touch a second counter, in either order, so
                        // shard locks are taken in varying combinations.
                        let other = [b'o', (i % 7) as u8];
                        let big = Limit::new(Algorithm::FixedWindow, 1_000_000, S, None).unwrap();
                        let checks: Vec<Check<'_>> = if (t + i) % 2 == 0 {
                            vec![check(b"hot", limit, 1), check(&other, &big, 1)]
                        } else {
                            vec![check(&other, &big, 1), check(b"hot", limit, 1)]
                        };
                        if s.apply_now(&checks).unwrap().allowed {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(admitted.load(Ordering::Relaxed), 500, "{algorithm}");
    }
}

#[test]
fn every_state_survives_the_packed_entry() {
    let (clock, s) = store(100);
    for algorithm in Algorithm::RATES {
        let limit = Limit::new(algorithm, 5, 60 * S, None).unwrap();
        let key = algorithm.name().as_bytes();
        for hit in 1..=5 {
            let out = s.apply_now(&[check(key, &limit, 1)]).unwrap();
            assert!(out.allowed, "{algorithm}: hit {hit}");
            assert_eq!(out.verdicts[0].remaining, 5 - hit, "{algorithm}");
            clock.advance(1_000);
        }
        assert!(!s.apply_now(&[check(key, &limit, 1)]).unwrap().allowed);
    }
    // Only the sliding log's state lives beside its entry.
    let logs: usize = s.shards.iter().map(|sh| lock(sh).boxed.len()).sum();
    assert_eq!(logs, 1);
    clock.advance(3_600 * S);
    assert_eq!(s.sweep(), Algorithm::RATES.len());
    let logs: usize = s.shards.iter().map(|sh| lock(sh).boxed.len()).sum();
    assert_eq!(logs, 0, "a forgotten log's stamps are dropped too");
}

#[test]
fn a_log_that_becomes_another_state_leaves_the_logs() {
    let (_, s) = store(100);
    let log = Limit::new(Algorithm::SlidingLog, 5, 60 * S, None).unwrap();
    let window = Limit::new(Algorithm::FixedWindow, 5, 60 * S, None).unwrap();
    s.apply_now(&[check(b"k", &log, 2)]).unwrap();
    // A reload that gives the key another algorithm (the engine's keys say the algorithm, but
    // the store must not depend on it).
    let out = s.apply_now(&[check(b"k", &window, 1)]).unwrap();
    assert!(out.allowed);
    let logs: usize = s.shards.iter().map(|sh| lock(sh).boxed.len()).sum();
    assert_eq!(logs, 0);
    assert_eq!(s.len(), 1);
}

#[test]
fn a_full_store_finds_its_few_empty_keys_in_bounded_walks() {
    let keys = 20_000;
    let (clock, s) = store(keys);
    let long = Limit::new(Algorithm::FixedWindow, 10, 3_600 * S, None).unwrap();
    let short = Limit::new(Algorithm::FixedWindow, 10, S, None).unwrap();
    for n in 0..keys {
        // Every 1000th key empties after a second; the rest hold for an hour.
        let limit = if n % 1_000 == 0 { &short } else { &long };
        s.apply_now(&[check(format!("k{n}").as_bytes(), limit, 1)])
            .unwrap();
    }
    assert!(matches!(
        s.apply_now(&[check(b"new0", &long, 1)]),
        Err(StoreError::Full(_))
    ));
    clock.advance(2 * S);
    // 20 empty keys among ~30 000 buckets, 512 buckets a request: each one is found within a
    // lap of the hands, and no request walks more than its budget.
    let mut admitted = 0;
    for n in 1..=200 {
        if s.apply_now(&[check(format!("new{n}").as_bytes(), &long, 1)])
            .is_ok()
        {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 20);
    assert_eq!(s.len(), keys);
    // Nothing else empties for an hour: once every shard has been looked at, requests stop
    // walking (the store remembers the earliest bound).
    let hint = s.nothing_expires_before_us.load(Ordering::Relaxed);
    assert!(hint > clock.now_micros(), "{hint}");
    clock.advance(3_600 * S);
    assert!(s.apply_now(&[check(b"later", &long, 1)]).is_ok());
}

#[test]
fn a_key_whose_state_moved_on_is_not_reclaimed_early() {
    let (clock, s) = store(2);
    let bucket = Limit::new(Algorithm::TokenBucket, 10, 10 * S, None).unwrap();
    // `a` empties at 1 s, then a hit at 0.5 s moves that to 1.5 s.
    s.apply_now(&[check(b"a", &bucket, 1), check(b"b", &bucket, 10)])
        .unwrap();
    clock.advance(S / 2);
    s.apply_now(&[check(b"a", &bucket, 1)]).unwrap();
    clock.advance(S * 3 / 4);
    // At 1.25 s neither key is empty: no room, and `a` keeps its count.
    assert!(matches!(
        s.apply_now(&[check(b"c", &bucket, 1)]),
        Err(StoreError::Full(2))
    ));
    let out = s.apply_now(&[check(b"a", &bucket, 0)]).unwrap();
    assert!(out.verdicts[0].remaining < 10);
    clock.advance(10 * S);
    assert!(s.apply_now(&[check(b"c", &bucket, 1)]).is_ok());
}

#[test]
fn shard_shares_spread_over_one_doubling() {
    let bounds = shard_bounds();
    assert_eq!(bounds.len(), SHARDS);
    assert!(bounds.windows(2).all(|w| w[0] < w[1]));
    assert_eq!(*bounds.last().unwrap(), u32::MAX);
    let share = |i: usize| bounds[i] as f64 - if i == 0 { 0.0 } else { bounds[i - 1] as f64 };
    let ratio = share(SHARDS - 1) / share(0);
    assert!((1.98..2.0).contains(&ratio), "{ratio}");
    // Keys land by those shares.
    let (_, s) = store(usize::MAX);
    let mut counts = vec![0usize; SHARDS];
    for n in 0..200_000u32 {
        counts[s.shard_of(s.id(&n.to_le_bytes()))] += 1;
    }
    let first: usize = counts[..32].iter().sum();
    let last: usize = counts[SHARDS - 32..].iter().sum();
    let ratio = last as f64 / first as f64;
    assert!((1.7..2.1).contains(&ratio), "{ratio}");
}
