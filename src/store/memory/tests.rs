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
    for algorithm in Algorithm::ALL {
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
