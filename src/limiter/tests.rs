use super::*;
use proptest::prelude::*;

const S: u64 = 1_000_000;

/// [`super::decide`] for the algorithms that name no slot (all but concurrency).
fn decide(limit: &Limit, state: &State, now_us: u64, hits: u64) -> (Verdict, Update) {
    super::decide(limit, state, now_us, hits, 0)
}

/// [`super::refund`] for the algorithms that name no slot.
fn refund(limit: &Limit, state: &State, now_us: u64, hits: u64) -> (Verdict, State) {
    super::refund(limit, state, now_us, hits, 0, 0)
}

fn limit(algorithm: Algorithm, requests: u64, period_s: u64, burst: Option<u64>) -> Limit {
    Limit::new(algorithm, requests, period_s * S, burst).unwrap()
}

/// Runs `hits` at `now` and commits when allowed, like a store does.
fn hit(l: &Limit, state: &mut State, now: u64, hits: u64) -> Verdict {
    let (v, update) = decide(l, state, now, hits);
    if v.allowed {
        state.apply(update);
    }
    v
}

fn admitted(l: &Limit, state: &mut State, now: u64, n: u64) -> u64 {
    (0..n).filter(|_| hit(l, state, now, 1).allowed).count() as u64
}

#[test]
fn fixed_window_counts_per_epoch_aligned_window() {
    let l = limit(Algorithm::FixedWindow, 3, 60, None);
    let mut st = State::Empty;
    let t = 1_000_020 * S; // 20 s into a minute window (1_000_020 % 60 == 0? no: 1_000_020 = 16667*60)
    let start = t - t % (60 * S);
    let v = hit(&l, &mut st, start + 20 * S, 1);
    assert_eq!(
        v,
        Verdict {
            allowed: true,
            remaining: 2,
            reset_after_us: 40 * S,
            retry_after_us: 0
        }
    );
    assert!(hit(&l, &mut st, start + 21 * S, 2).allowed);
    let denied = hit(&l, &mut st, start + 30 * S, 1);
    assert!(!denied.allowed);
    assert_eq!(denied.remaining, 0);
    assert_eq!(denied.retry_after_us, 30 * S);
    // The next window starts empty.
    assert!(hit(&l, &mut st, start + 60 * S, 3).allowed);
}

#[test]
fn fixed_window_allows_twice_the_limit_across_a_boundary() {
    // The known weakness the other algorithms fix: a burst at the end of one window and the
    // start of the next.
    let l = limit(Algorithm::FixedWindow, 10, 60, None);
    let mut st = State::Empty;
    let edge = 600 * S;
    assert_eq!(admitted(&l, &mut st, edge - 1, 10), 10);
    assert_eq!(admitted(&l, &mut st, edge, 10), 10);
    for alg in [
        Algorithm::SlidingWindow,
        Algorithm::SlidingLog,
        Algorithm::TokenBucket,
    ] {
        let l = limit(alg, 10, 60, None);
        let mut st = State::Empty;
        let total = admitted(&l, &mut st, edge - 1, 10) + admitted(&l, &mut st, edge, 10);
        assert_eq!(total, 10, "{alg}");
    }
}

#[test]
fn hits_beyond_the_limit_never_fit() {
    for alg in Algorithm::RATES {
        let l = limit(alg, 5, 1, None);
        let (v, _) = decide(&l, &State::Empty, 100 * S, 6);
        assert!(!v.allowed, "{alg}");
        assert_eq!(v.remaining, 5, "{alg}: a denied request consumes nothing");
        assert!(v.retry_after_us > 0, "{alg}");
    }
}

#[test]
fn probe_checks_without_consuming() {
    for alg in Algorithm::RATES {
        let l = limit(alg, 2, 10, None);
        let mut st = State::Empty;
        let now = 1_000 * S;
        assert!(hit(&l, &mut st, now, 2).allowed);
        let (v, update) = decide(&l, &st, now, 0);
        assert!(v.allowed, "{alg}: a probe at the limit is OK");
        assert_eq!(v.remaining, 0, "{alg}");
        assert_eq!(st.after(&update), st, "{alg}: a probe changes nothing");
    }
}

#[test]
fn zero_limit_denies_every_hit_but_not_a_probe() {
    for alg in Algorithm::RATES {
        let l = limit(alg, 0, 1, None);
        assert!(!decide(&l, &State::Empty, 5 * S, 1).0.allowed, "{alg}");
        assert!(decide(&l, &State::Empty, 5 * S, 0).0.allowed, "{alg}");
    }
}

#[test]
fn sliding_window_weights_the_previous_window() {
    let l = limit(Algorithm::SlidingWindow, 10, 60, None);
    let mut st = State::Empty;
    let w = 6_000 * S;
    assert_eq!(admitted(&l, &mut st, w + 50 * S, 10), 10);
    // 15 s into the next window: 10 × 45/60 = 7.5 of the previous still count, so 2 fit.
    assert_eq!(admitted(&l, &mut st, w + 75 * S, 5), 2);
    // 30 s in: 10 × 30/60 = 5 count, plus the 2 admitted: 3 more fit.
    assert_eq!(admitted(&l, &mut st, w + 90 * S, 5), 3);
}

#[test]
fn sliding_window_retry_after_is_exact() {
    let l = limit(Algorithm::SlidingWindow, 10, 60, None);
    let mut st = State::Empty;
    let w = 6_000 * S;
    assert_eq!(admitted(&l, &mut st, w + 50 * S, 10), 10);
    let now = w + 75 * S;
    assert_eq!(admitted(&l, &mut st, now, 2), 2);
    let v = hit(&l, &mut st, now, 1);
    assert!(!v.allowed);
    let retry_at = now + v.retry_after_us;
    assert!(!decide(&l, &st, retry_at - 1, 1).0.allowed);
    assert!(decide(&l, &st, retry_at, 1).0.allowed);
}

#[test]
fn sliding_log_is_exact() {
    let l = limit(Algorithm::SlidingLog, 3, 10, None);
    let mut st = State::Empty;
    let t = 1_000 * S;
    assert!(hit(&l, &mut st, t, 1).allowed);
    assert!(hit(&l, &mut st, t + 4 * S, 2).allowed);
    let v = hit(&l, &mut st, t + 9 * S, 1);
    assert!(!v.allowed);
    // The first stamp leaves at t + 10 s.
    assert_eq!(v.retry_after_us, S);
    assert!(hit(&l, &mut st, t + 10 * S, 1).allowed);
    assert!(!hit(&l, &mut st, t + 13 * S, 1).allowed);
    assert_eq!(admitted(&l, &mut st, t + 14 * S, 3), 2);
}

#[test]
fn token_bucket_bursts_then_refills_at_the_rate() {
    // 10 per second, burst 20.
    let l = limit(Algorithm::TokenBucket, 10, 1, Some(20));
    let mut st = State::Empty;
    let t = 50 * S;
    assert_eq!(admitted(&l, &mut st, t, 25), 20);
    let v = hit(&l, &mut st, t, 1);
    assert_eq!(v.retry_after_us, 100_000, "one token every 100 ms");
    assert_eq!(admitted(&l, &mut st, t + 99_999, 1), 0);
    assert_eq!(admitted(&l, &mut st, t + 100_000, 2), 1);
    // Fully refilled after 2 s idle.
    assert_eq!(admitted(&l, &mut st, t + 100_000 + 2 * S, 30), 20);
}

#[test]
fn gcra_spaces_requests_after_the_burst() {
    // 100 per minute, burst 100: after 100 at once, one every 600 ms.
    let l = limit(Algorithm::Gcra, 100, 60, None);
    let mut st = State::Empty;
    let t = 7_000 * S;
    assert_eq!(admitted(&l, &mut st, t, 101), 100);
    let v = hit(&l, &mut st, t + 1, 1);
    assert_eq!(v.retry_after_us, 600_000 - 1);
    assert_eq!(admitted(&l, &mut st, t + 600_000, 2), 1);
    assert_eq!(admitted(&l, &mut st, t + 1_200_000, 2), 1);
    let ok = decide(&l, &st, t + 1_200_000, 0).0;
    assert_eq!(
        ok.reset_after_us,
        60 * S,
        "the full bucket drains in one period"
    );
}

#[test]
fn leaky_bucket_drains_at_the_rate() {
    // Capacity 5, drains 1 per second.
    let l = limit(Algorithm::LeakyBucket, 1, 1, Some(5));
    let mut st = State::Empty;
    let t = 90 * S;
    assert!(hit(&l, &mut st, t, 5).allowed);
    let v = hit(&l, &mut st, t, 2);
    assert!(!v.allowed);
    assert_eq!(v.retry_after_us, 2 * S);
    assert!(hit(&l, &mut st, t + 2 * S, 2).allowed);
    assert_eq!(decide(&l, &st, t + 2 * S, 0).0.reset_after_us, 5 * S);
    assert_eq!(st.expires_at_us(&l), t + 7 * S);
}

#[test]
fn refunds_give_hits_back_never_below_empty() {
    for alg in Algorithm::RATES {
        let l = limit(alg, 5, 60, None);
        let mut st = State::Empty;
        let now = 3_000 * S;
        assert!(hit(&l, &mut st, now, 5).allowed);
        assert!(!decide(&l, &st, now, 1).0.allowed, "{alg}");
        let (v, next) = refund(&l, &st, now, 2);
        assert!(v.allowed);
        assert_eq!(v.remaining, 2, "{alg}");
        st = next;
        assert!(hit(&l, &mut st, now, 2).allowed, "{alg}");
        let (v, next) = refund(&l, &st, now, 1_000);
        assert_eq!(v.remaining, 5, "{alg}");
        assert!(next.is_empty(), "{alg}");
    }
}

#[test]
fn long_periods_choose_a_coarser_tick_and_stay_exact() {
    let l = limit(Algorithm::Gcra, 1_000_000, 365 * 86_400, None);
    assert!(l.tick_us > 1);
    assert!(l.burst * (l.period_us / l.tick_us) <= EXACT_MAX);
    assert_eq!(
        Limit::new(
            Algorithm::TokenBucket,
            u32::MAX as u64,
            3_153_600_000 * S,
            None
        ),
        Err(LimitError::OutOfRange {
            requests: u32::MAX as u64,
            period_s: 3_153_600_000
        })
    );
}

#[test]
fn a_bucket_that_would_drain_for_centuries_is_refused() {
    const YEAR: u64 = 365 * 86_400 * S;
    // 100 requests a year with a burst of a million: a full bucket drains in 10 000 years, past
    // the exact range of the times computed from it (found by the Lua twin proptest: the drain
    // time overflowed u64).
    for algorithm in [
        Algorithm::TokenBucket,
        Algorithm::LeakyBucket,
        Algorithm::Gcra,
    ] {
        assert_eq!(
            Limit::new(algorithm, 100, YEAR, Some(1_000_000)),
            Err(LimitError::DrainsTooSlowly {
                burst: 1_000_000,
                requests: 100,
                period_s: YEAR / S
            }),
            "{algorithm}"
        );
        // A full bucket that drains in 100 years is fine.
        assert!(Limit::new(algorithm, 100, YEAR, Some(10_000)).is_ok());
    }
    // Window algorithms have no burst, so nothing to drain.
    assert!(Limit::new(Algorithm::SlidingWindow, 1, 100 * YEAR, None).is_ok());
}

#[test]
fn limit_validation() {
    assert_eq!(
        Limit::new(Algorithm::FixedWindow, 1, S, Some(3)),
        Err(LimitError::BurstNotApplicable(Algorithm::FixedWindow))
    );
    assert_eq!(
        Limit::new(Algorithm::Gcra, 1, S, Some(0)),
        Err(LimitError::ZeroBurst)
    );
    assert_eq!(
        Limit::new(Algorithm::SlidingLog, 100_001, S, None),
        Err(LimitError::SlidingLogTooLarge)
    );
}

fn any_algorithm() -> impl Strategy<Value = Algorithm> {
    prop::sample::select(Algorithm::RATES.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 300,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// No algorithm admits more than its capacity within any period-long interval: for the
    /// exact ones `requests` (buckets: burst plus what refills meanwhile), for fixed windows
    /// `requests` per aligned window.
    #[test]
    fn never_admits_more_than_the_limit(
        alg in any_algorithm(),
        requests in 1u64..20,
        period_s in 1u64..5,
        steps in prop::collection::vec((0u64..400_000, 0u64..4), 1..200),
    ) {
        let l = limit(alg, requests, period_s, None);
        let p = l.period_us;
        let mut st = State::Empty;
        let mut now = 10_000 * S;
        let mut log: Vec<(u64, u64)> = Vec::new();
        for (dt, hits) in steps {
            now += dt;
            let (v, update) = decide(&l, &st, now, hits);
            if v.allowed {
                st.apply(update);
                if hits > 0 { log.push((now, hits)); }
            } else {
                prop_assert_eq!(v.retry_after_us > 0 || hits == 0, true);
            }
        }
        for &(start, _) in &log {
            let window: u64 = match alg {
                Algorithm::FixedWindow => {
                    let w = start - start % p;
                    log.iter().filter(|(t, _)| *t >= w && *t < w + p).map(|(_, h)| h).sum()
                }
                Algorithm::SlidingWindow => {
                    // The weighted estimate may admit up to the previous window's share extra
                    // within a sliding interval, but never more than 2× in one.
                    log.iter().filter(|(t, _)| *t >= start && *t < start + p).map(|(_, h)| h).sum::<u64>() / 2
                }
                Algorithm::SlidingLog => {
                    log.iter().filter(|(t, _)| *t >= start && *t < start + p).map(|(_, h)| h).sum()
                }
                _ => {
                    // A bucket admits at most burst plus what drains during the interval.
                    let total: u64 = log.iter().filter(|(t, _)| *t >= start && *t < start + p).map(|(_, h)| h).sum();
                    total.saturating_sub(requests)
                }
            };
            prop_assert!(window <= requests, "{} admitted {} > {}", alg, window, requests);
        }
    }

    /// A denied request changes nothing, and retry_after is when it first succeeds.
    #[test]
    fn retry_after_is_the_first_moment_it_fits(
        alg in any_algorithm(),
        requests in 1u64..10,
        hits in prop::collection::vec(1u64..4, 1..30),
        dts in prop::collection::vec(0u64..300_000, 30),
    ) {
        let l = limit(alg, requests, 1, None);
        let mut st = State::Empty;
        let mut now = 1_000 * S;
        for (h, dt) in hits.iter().zip(dts) {
            now += dt;
            let (v, update) = decide(&l, &st, now, *h);
            if v.allowed {
                st.apply(update);
            } else if *h <= requests && alg != Algorithm::FixedWindow {
                let at = now + v.retry_after_us;
                prop_assert!(decide(&l, &st, at, *h).0.allowed, "{} not allowed at retry", alg);
                prop_assert!(!decide(&l, &st, at - 1, *h).0.allowed, "{} allowed before retry", alg);
            }
        }
    }
}

#[test]
fn an_overdraft_limit_records_hostile_hits_up_to_its_cap() {
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::TokenBucket,
        Algorithm::Gcra,
    ] {
        let limit = limit(algorithm, 10, 60, None).with_overdraft().unwrap();
        let now = 1_000_000 * S;
        let (v, update) = decide(&limit, &State::Empty, now, u64::MAX);
        assert!(
            v.allowed,
            "{algorithm}: under the limit, any cost is admitted"
        );
        assert_eq!(v.remaining, 0);
        let state = State::Empty.after(&update);
        let (again, _) = decide(&limit, &state, now, 0);
        assert!(!again.allowed, "{algorithm}: in debt");
        // The debt drains (or the window ends) within the exact time range.
        assert!(again.retry_after_us <= TIME_MAX, "{algorithm}: {again:?}");
        let (more, update) = decide(&limit, &state, now, u64::MAX);
        assert!(!more.allowed);
        assert_eq!(
            state.after(&update),
            state,
            "{algorithm}: capped, not wrapped"
        );
    }
    assert_eq!(
        limit(Algorithm::SlidingWindow, 10, 60, None).with_overdraft(),
        Err(LimitError::OverdraftNotApplicable(Algorithm::SlidingWindow))
    );
}

/// Step 1 of the checklist for adding an algorithm (module docs): `Algorithm::ALL` lists it, and
/// its name and id are its own.
#[test]
fn all_lists_every_id() {
    let mut ids: Vec<u8> = Algorithm::ALL.iter().map(|a| a.id()).collect();
    ids.sort_unstable();
    assert_eq!(
        ids,
        (1..=Algorithm::MAX_ID).collect::<Vec<_>>(),
        "Algorithm::ALL must list every algorithm once, with ids 1, 2, 3, ..."
    );
    for a in Algorithm::ALL {
        assert_eq!(Algorithm::parse(a.name()), Some(a), "{a}");
        assert_eq!(
            Algorithm::RATES.contains(&a),
            !a.holds_slots(),
            "{a}: Algorithm::RATES lists every algorithm that counts hits"
        );
    }
}

/// Acquires (`hits` > 0) or releases `slot` at `now` under a concurrency limit, committing as a
/// store does; the verdict.
fn slot_call(l: &Limit, state: &mut State, now: u64, slot: u64, release: bool) -> Verdict {
    if release {
        let (v, next) = super::refund(l, state, now, 1, slot, 0);
        *state = next;
        return v;
    }
    let (v, update) = super::decide(l, state, now, 1, slot);
    if v.allowed {
        state.apply(update);
    }
    v
}

#[test]
fn a_concurrency_limit_holds_one_slot_per_request_until_release_or_max_hold() {
    let l = limit(Algorithm::Concurrency, 2, 30, None);
    let mut state = State::Empty;
    let t = 1_800_000_000 * S;
    let v = slot_call(&l, &mut state, t, 11, false);
    assert_eq!(
        (v.allowed, v.remaining, v.reset_after_us),
        (true, 1, 30 * S)
    );
    // A retried call keeps one slot.
    let v = slot_call(&l, &mut state, t + S, 11, false);
    assert_eq!((v.allowed, v.remaining), (true, 1));
    assert!(slot_call(&l, &mut state, t + 2 * S, 22, false).allowed);
    let full = slot_call(&l, &mut state, t + 3 * S, 33, false);
    assert_eq!(
        (full.allowed, full.remaining, full.retry_after_us),
        (false, 0, 27 * S),
        "full: the oldest slot expires 27 s later"
    );
    // Releasing a slot not held (never acquired, denied, released) changes nothing.
    let v = slot_call(&l, &mut state, t + 3 * S, 33, true);
    assert_eq!((v.allowed, v.remaining), (true, 0));
    // A release frees one at once.
    assert_eq!(slot_call(&l, &mut state, t + 4 * S, 22, true).remaining, 1);
    assert!(slot_call(&l, &mut state, t + 4 * S, 33, false).allowed);
    // Slot 11 was never released: it is freed 30 s after it was taken, not before.
    assert!(!slot_call(&l, &mut state, t + 30 * S - 1, 44, false).allowed);
    assert!(slot_call(&l, &mut state, t + 30 * S, 44, false).allowed);
}

#[test]
fn a_rollback_releases_only_the_slot_its_call_acquired() {
    let l = limit(Algorithm::Concurrency, 3, 30, None);
    let t = 1_800_000_000 * S;
    let mut state = State::Empty;
    slot_call(&l, &mut state, t, 7, false);
    // The same request again 5 s later (a retry): its slot expires at t + 30 s, not t + 35 s.
    let (_, held) = super::refund(&l, &state, t + 5 * S, 1, 7, t + 35 * S);
    assert_eq!(held, state, "a retried call's rollback leaves the slot");
    let (v, released) = super::refund(&l, &state, t + 5 * S, 1, 7, t + 30 * S);
    assert_eq!((v.remaining, released), (3, State::Empty));
}

proptest! {
    /// Any sequence of acquires, releases and retries over any limit the rules take, any
    /// max_hold from a second to a day and any slot number: never more slots live than the
    /// limit, a request is admitted exactly when its slot is held afterwards, and a slot never
    /// outlives its max_hold.
    #[test]
    fn never_more_in_flight_than_the_limit(
        requests in 0u64..=u64::from(u32::MAX),
        max_hold_s in 1u64..=86_400,
        calls in prop::collection::vec((0u64..8, any::<bool>(), 0u64..3_000_000_000), 1..80),
        high in any::<bool>(),
    ) {
        let requests = if high { requests } else { requests % 5 };
        let l = limit(Algorithm::Concurrency, requests, max_hold_s, None);
        let mut state = State::Empty;
        let mut now = 1_800_000_000 * S;
        for (pick, release, advance) in calls {
            now += advance % (2 * max_hold_s * S);
            // Slot numbers at both ends of their range.
            let slot = if pick < 4 { pick + 1 } else { (1 << 53) - pick };
            let v = slot_call(&l, &mut state, now, slot, release);
            let held: Vec<Slot> = match &state {
                State::Slots { held } => held.iter().copied().filter(|s| s.until_us > now).collect(),
                _ => Vec::new(),
            };
            prop_assert!(held.len() as u64 <= requests, "{} live over {requests}", held.len());
            prop_assert!(held.iter().all(|s| s.until_us <= now + max_hold_s * S));
            if !release {
                prop_assert_eq!(v.allowed, held.iter().any(|s| s.id == slot));
            } else {
                prop_assert!(v.allowed && !held.iter().any(|s| s.id == slot));
            }
            prop_assert_eq!(v.remaining, requests.saturating_sub(held.len() as u64));
        }
    }
}

#[test]
fn messages_list_the_algorithms_with_the_property() {
    assert_eq!(
        LimitError::BurstNotApplicable(Algorithm::FixedWindow).to_string(),
        "burst applies only to token_bucket, leaky_bucket and gcra, not to fixed_window"
    );
    assert_eq!(
        Algorithm::names_where(Algorithm::leasable),
        "fixed_window and sliding_window"
    );
    assert_eq!(
        LimitError::OverdraftNotApplicable(Algorithm::SlidingLog).to_string(),
        "overdraft applies to fixed_window, token_bucket, leaky_bucket and gcra, not to sliding_log (it cannot count past its limit exactly)"
    );
}

/// A bucket in plain wide arithmetic, as `bucket`'s docs define it: the level in units (a hit
/// is `P`, a tick drains `requests`), in u128 so that no debit is ever too large for it,
/// bounded only by the documented cap (a debt that drains in `TIME_MAX`).
#[derive(Debug, Clone, Copy)]
struct WideBucket {
    level: u128,
    tick: u64,
}

impl WideBucket {
    /// The level at `now_tick`, drained since the last change.
    fn at(self, l: &Limit, now_tick: u64) -> u128 {
        self.level
            .saturating_sub(u128::from(now_tick.saturating_sub(self.tick)) * u128::from(l.requests))
    }

    /// `hits` given back at `now_us`, never below empty.
    fn refunded(self, l: &Limit, now_us: u64, hits: u64) -> WideBucket {
        let now_tick = now_us / l.tick_us;
        let taken = u128::from(hits) * u128::from(l.period_us / l.tick_us);
        WideBucket {
            level: self.at(l, now_tick).saturating_sub(taken),
            tick: now_tick,
        }
    }
}

fn wide_decide(l: &Limit, b: WideBucket, now_us: u64, hits: u64) -> (Verdict, Option<WideBucket>) {
    let (r, tick) = (u128::from(l.requests), l.tick_us);
    let p = u128::from(l.period_us / tick);
    let c = u128::from(l.burst) * p;
    let now_tick = now_us / tick;
    let level = b.at(l, now_tick);
    let cap = u128::from(TIME_MAX / tick) * r;
    let drain = |level: u128, target: u128| -> u64 {
        if level <= target {
            0
        } else {
            let ticks = (level - target).div_ceil(r);
            u64::try_from((u128::from(now_tick) + ticks) * u128::from(tick) - u128::from(now_us))
                .unwrap()
        }
    };
    let room = |level: u128| {
        if level <= c {
            ((c - level) / p) as u64
        } else {
            0
        }
    };
    let hit_units = u128::from(hits) * p;
    let at = |level| {
        Some(WideBucket {
            level,
            tick: now_tick,
        })
    };
    if l.overdraft {
        let next = (level + hit_units).min(cap);
        let allowed = level + p <= c;
        let shown = if allowed { next } else { level };
        let verdict = Verdict {
            allowed,
            remaining: room(shown),
            reset_after_us: drain(shown, 0),
            retry_after_us: if allowed { 0 } else { drain(level, c - p) },
        };
        return (verdict, if hits > 0 { at(next) } else { None });
    }
    if hits <= l.burst && level + hit_units <= c {
        let next = level + hit_units;
        let verdict = Verdict {
            allowed: true,
            remaining: room(next),
            reset_after_us: drain(next, 0),
            retry_after_us: 0,
        };
        return (verdict, at(next));
    }
    let verdict = Verdict {
        allowed: false,
        remaining: room(level),
        reset_after_us: drain(level, 0),
        retry_after_us: if hits > l.burst {
            l.period_us
        } else {
            drain(level, c - hit_units)
        },
    };
    (verdict, None)
}

/// Any number up to `top`, biased to the edges: small, near `top`, and anywhere between.
fn up_to(top: u64) -> impl Strategy<Value = u64> {
    prop_oneof![
        1u64..=4.min(top),
        (top.saturating_sub(3).max(1))..=top,
        1u64..=top,
    ]
}

/// A bucket limit from the whole range the rules accept: a period from a second to the 2^52 µs
/// bound, `requests` and `burst` up to `u32::MAX`, as a cost limit or not.
fn any_bucket_limit() -> impl Strategy<Value = Limit> {
    let period_s = prop_oneof![
        Just(1u64),
        Just(60),
        Just(3_600),
        Just(86_400),
        Just(7 * 86_400),
        Just(365 * 86_400),
        1u64..=TIME_MAX / S,
    ];
    let alg = prop::sample::select(vec![
        Algorithm::TokenBucket,
        Algorithm::LeakyBucket,
        Algorithm::Gcra,
    ]);
    let top = u64::from(u32::MAX);
    (
        alg,
        period_s,
        up_to(top),
        prop::option::of(up_to(top)),
        any::<bool>(),
    )
        .prop_filter_map(
            "outside what validate accepts",
            |(alg, period_s, requests, burst, overdraft)| {
                let l = Limit::new(alg, requests, period_s * S, burst).ok()?;
                if overdraft {
                    l.with_overdraft().ok()
                } else {
                    Some(l)
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 2_000,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Issue 26: a bucket's level — a cost limit's debt included — is exact over the whole
    /// accepted range of rate × burst × debit: every verdict equals plain u128 arithmetic's.
    /// (A debit of 2 000 000 on a million-a-day bucket used to be capped at ~1 042 500.)
    #[test]
    fn buckets_equal_wide_arithmetic_over_the_whole_range(
        l in any_bucket_limit(),
        start in prop_oneof![1_700_000_000u64 * S..1_900_000_000 * S, 0..TIME_MAX],
        steps in prop::collection::vec(
            (
                prop_oneof![Just(0u64), 0..1_000u64, 0..10 * S, 0..TIME_MAX / 4, Just(u64::MAX)],
                prop_oneof![0u64..3, 0..=u64::from(u32::MAX), any::<u64>()],
                0u8..4,
            ),
            1..12,
        ),
    ) {
        let mut state = State::Empty;
        let mut wide = WideBucket { level: 0, tick: 0 };
        let mut now = start;
        for (advance, hits, kind) in steps {
            // An advance of "a period, or its fraction", so drains land on every scale.
            let advance = match kind {
                0 => advance % l.period_us.saturating_add(1),
                _ => advance,
            };
            now = now.saturating_add(advance).min(TIME_MAX);
            // A refund now and then, of some of the hits (or all of a big debit).
            if kind == 3 {
                state = refund(&l, &state, now, hits).1;
                wide = wide.refunded(&l, now, hits);
                continue;
            }
            let (verdict, update) = decide(&l, &state, now, hits);
            let (want, wide_next) = wide_decide(&l, wide, now, hits);
            prop_assert_eq!(verdict, want, "{:?} at {} with {} hits", l, now, hits);
            if verdict.allowed || charges_always(&l, hits) {
                state.apply(update);
                if let Some(next) = wide_next {
                    wide = next;
                }
            }
        }
    }
}

/// Issue 26's report, on a million tokens a day: a debit of two million on a full bucket is a
/// debt of a million, a day to drain; giving back 43 000 leaves it ~957 000 in debt.
#[test]
fn a_day_budget_records_a_debit_of_twice_its_size() {
    for algorithm in [
        Algorithm::TokenBucket,
        Algorithm::LeakyBucket,
        Algorithm::Gcra,
    ] {
        let l = limit(algorithm, 1_000_000, 86_400, Some(1_000_000))
            .with_overdraft()
            .unwrap();
        let now = 1_800_000_000 * S;
        let (v, update) = decide(&l, &State::Empty, now, 2_000_000);
        assert!(v.allowed);
        let state = State::Empty.after(&update);
        let (probe, _) = decide(&l, &state, now, 0);
        assert!(!probe.allowed);
        // A million past the last unit of room: 86 400 s × (1 000 001 / 1 000 000), rounded up
        // to the tick.
        assert_eq!(probe.retry_after_us, 86_400_086_400, "{algorithm}");
        let (_, given_back) = refund(&l, &state, now, 43_000);
        let (after, _) = decide(&l, &given_back, now, 0);
        assert!(!after.allowed, "{algorithm}: still ~957 000 in debt");
        assert_eq!(after.retry_after_us, 82_684_886_400, "{algorithm}");
    }
}

mod calendar_windows {
    use super::*;
    use crate::calendar::civil_us as at;
    use crate::calendar::{Calendar, CalendarUnit};

    const H: u64 = 3_600 * S;

    fn monthly(requests: u64, zone: &str, unit: CalendarUnit, nominal_s: u64) -> Limit {
        limit(Algorithm::FixedWindow, requests, nominal_s, None)
            .with_calendar(Calendar::interned(zone, unit).unwrap())
            .unwrap()
    }

    #[test]
    fn a_month_counts_to_its_last_microsecond_and_resets_on_the_first() {
        let berlin = "Europe/Berlin";
        let l = monthly(3, berlin, CalendarUnit::Month, 30 * 86_400);
        let mut st = State::Empty;
        let first = at(berlin, "2026-01-01T00:00");
        let last = at(berlin, "2026-01-31T23:59:59.999999");
        assert!(hit(&l, &mut st, first, 2).allowed);
        let v = hit(&l, &mut st, last, 1);
        assert_eq!(
            v,
            Verdict {
                allowed: true,
                remaining: 0,
                reset_after_us: 1,
                retry_after_us: 0
            },
            "the last µs of January is January's"
        );
        let denied = hit(&l, &mut st, last, 1);
        assert!(!denied.allowed);
        assert_eq!(denied.retry_after_us, 1);
        assert_eq!(st.expires_at_us(&l), last + 1);
        // The first µs of February: a new window, 28 days long (not 30).
        let v = hit(&l, &mut st, last + 1, 1);
        assert!(v.allowed);
        assert_eq!(v.remaining, 2);
        assert_eq!(v.reset_after_us, 28 * 24 * H);
        // An epoch-aligned 30-day block would have reset elsewhere.
        let aligned = limit(Algorithm::FixedWindow, 3, 30 * 86_400, None);
        assert_ne!(aligned.window_at(last + 1), l.window_at(last + 1));
    }

    #[test]
    fn days_follow_the_clock_change_and_weeks_start_on_monday() {
        let berlin = "Europe/Berlin";
        let day = monthly(1, berlin, CalendarUnit::Day, 86_400);
        for (civil, hours) in [
            ("2026-03-29T00:30", 23),
            ("2026-10-25T00:30", 25),
            ("2026-10-26T00:30", 24),
        ] {
            let mut st = State::Empty;
            let v = hit(&day, &mut st, at(berlin, civil), 1);
            assert_eq!(v.reset_after_us, hours * H - 30 * 60 * S, "{civil}");
            // Denied until local midnight, whatever the day's length.
            let denied = hit(&day, &mut st, at(berlin, civil) + H, 1);
            assert_eq!(denied.retry_after_us, hours * H - 90 * 60 * S, "{civil}");
        }
        let week = monthly(1, "UTC", CalendarUnit::Week, 7 * 86_400);
        // 2026-12-06 is a Sunday: the week ends at Monday 00:00.
        let v = hit(&week, &mut State::Empty, at("UTC", "2026-12-06T23:00"), 1);
        assert_eq!(v.reset_after_us, H);
    }

    #[test]
    fn a_leap_day_and_a_half_hour_zone() {
        let year = monthly(1, "UTC", CalendarUnit::Year, 365 * 86_400);
        let v = hit(&year, &mut State::Empty, at("UTC", "2028-02-29T00:00"), 1);
        assert_eq!(v.reset_after_us, (366 - 59) * 24 * H, "2028 has 366 days");
        let month = monthly(1, "UTC", CalendarUnit::Month, 30 * 86_400);
        let v = hit(&month, &mut State::Empty, at("UTC", "2028-02-29T23:00"), 1);
        assert_eq!(v.reset_after_us, H, "February 2028 ends after the 29th");
        let kolkata = monthly(1, "Asia/Kolkata", CalendarUnit::Day, 86_400);
        let mut st = State::Empty;
        // 18:29:59 UTC is 23:59:59 in Kolkata (UTC+5:30); 18:30 is the next day there.
        let before = at("UTC", "2026-06-01T18:29:59");
        assert!(hit(&kolkata, &mut st, before, 1).allowed);
        assert!(!hit(&kolkata, &mut st, before + 999_999, 1).allowed);
        assert!(hit(&kolkata, &mut st, before + S, 1).allowed);
    }

    #[test]
    fn a_zero_limit_and_a_cost_limit_reset_on_the_calendar() {
        let berlin = "Europe/Berlin";
        let never = monthly(0, berlin, CalendarUnit::Month, 30 * 86_400);
        let now = at(berlin, "2026-02-28T23:00");
        let (v, _) = decide(&never, &State::Empty, now, 1);
        assert!(!v.allowed);
        assert_eq!(v.retry_after_us, H);
        let cost = monthly(10, berlin, CalendarUnit::Month, 30 * 86_400)
            .with_overdraft()
            .unwrap();
        let mut st = State::Empty;
        let (v, update) = decide(&cost, &st, now, 25);
        assert!(v.allowed);
        st.apply(update);
        let (v, _) = decide(&cost, &st, now + H - 1, 0);
        assert!(!v.allowed, "the debt holds to the month's end");
        assert_eq!(v.retry_after_us, 1);
        let (v, _) = decide(&cost, &st, now + H, 0);
        assert!(v.allowed, "and no further");
    }

    #[test]
    fn only_fixed_windows_keep_calendar_windows() {
        let c = Calendar::interned("UTC", CalendarUnit::Month).unwrap();
        for alg in Algorithm::RATES {
            let l = limit(alg, 10, 30 * 86_400, None).with_calendar(c);
            assert_eq!(l.is_ok(), alg.has_calendar_windows(), "{alg}");
            if let Err(e) = l {
                assert_eq!(
                    e.to_string(),
                    format!("calendar windows apply to fixed_window, not to {alg}")
                );
            }
        }
    }
}
