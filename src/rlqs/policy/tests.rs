use proptest::prelude::*;

use super::*;
use crate::limiter::Algorithm;

const S: u64 = MICROS_PER_SECOND;

fn limit(algorithm: Algorithm, requests: u64, period_s: u64) -> Limit {
    Limit::new(algorithm, requests, period_s * S, None).unwrap()
}

fn report(allowed: u64, denied: u64, elapsed_s: u64) -> Usage {
    Usage {
        allowed,
        denied,
        elapsed_us: elapsed_s * S,
    }
}

const MINUTE_END: u64 = 1_000 * 60 * S;

fn limited() -> Treatment {
    Treatment::Limited {
        period_end_us: MINUTE_END,
    }
}

#[test]
fn a_period_ends_with_the_earliest_window_and_a_second_for_the_others() {
    let now = 1_000 * 60 * S + 12 * S + 345;
    let minute = limit(Algorithm::FixedWindow, 100, 60);
    let day = limit(Algorithm::SlidingWindow, 1000, 86_400);
    assert_eq!(period_end_us([&minute], now), Some(1_001 * 60 * S));
    assert_eq!(
        period_end_us([&day], now),
        Some((now / (86_400 * S) + 1) * 86_400 * S)
    );
    // Several tiers: the first to end.
    assert_eq!(period_end_us([&day, &minute], now), Some(1_001 * 60 * S));
    // Buckets and the sliding log: the current second.
    let bucket = limit(Algorithm::TokenBucket, 10, 1);
    assert_eq!(period_end_us([&bucket, &day], now), Some(now / S * S + S));
    let log = limit(Algorithm::SlidingLog, 10, 3600);
    assert_eq!(period_end_us([&log], now), Some(now / S * S + S));
    // A year is granted in 64-day periods, aligned, so every moment of one agrees on its end.
    let year = limit(Algorithm::FixedWindow, 10, 365 * 86_400);
    let end = period_end_us([&year], now).unwrap();
    assert_eq!(end % MAX_PERIOD_US, 0);
    assert_eq!(period_end_us([&year], end - 1), Some(end));
    assert_eq!(period_end_us([], now), None);
}

#[test]
fn a_time_to_live_is_whole_seconds_ending_by_the_period_give_or_take_the_slack() {
    let end = 100 * S;
    assert_eq!(ttl_seconds(97 * S, end), Some(3));
    assert_eq!(ttl_seconds(97 * S + 400_000, end), Some(2));
    // A tick a few milliseconds late still renews to the window's end.
    assert_eq!(ttl_seconds(99 * S + 5_000, end), Some(1));
    assert_eq!(ttl_seconds(99 * S + TTL_SLACK_US + 1, end), None);
    assert_eq!(ttl_seconds(end, end), None);
    assert_eq!(ttl_seconds(end + S, end), None);
}

#[test]
fn a_first_report_gets_a_grant_sized_to_its_demand() {
    let mut h = Holding::default();
    let now = MINUTE_END - 30 * S;
    // The request that made the bucket: one, as a second's demand, for two reports' time.
    let step = h.on_report(report(1, 0, 0), now, limited(), Fleet::default(), 12);
    assert_eq!(
        step,
        Step::Grant {
            want: 10,
            until_us: MINUTE_END
        }
    );
    // Near the window's end, only what is left of it.
    let mut h = Holding::default();
    let step = h.on_report(
        report(1, 0, 0),
        MINUTE_END - 3 * S,
        limited(),
        Fleet::default(),
        12,
    );
    assert_eq!(
        step,
        Step::Grant {
            want: 3,
            until_us: MINUTE_END
        }
    );
}

fn holding_tokens(size: u64, demand_per_s: u64, now: u64) -> Holding {
    let mut h = Holding::default();
    h.on_report(
        report(demand_per_s * 5, 0, 5),
        now - 5 * S,
        limited(),
        Fleet::default(),
        0,
    );
    h.assign(Assigned::Tokens {
        size,
        until_us: MINUTE_END,
        expires_us: MINUTE_END,
        granted_us: now - 5 * S,
    });
    h
}

#[test]
fn a_spent_grant_is_granted_again_and_a_lasting_one_is_left_alone() {
    let now = MINUTE_END - 40 * S;
    // 10/s, holding 200: 50 used, plenty left: nothing to do.
    let mut h = holding_tokens(200, 10, now);
    assert_eq!(
        h.on_report(report(50, 0, 5), now, limited(), Fleet::default(), 0),
        Step::Nothing
    );
    // Denials: it ran out.
    let mut h = holding_tokens(200, 10, now);
    assert!(matches!(
        h.on_report(report(50, 3, 5), now, limited(), Fleet::default(), 0),
        Step::Grant { .. }
    ));
    // Plenty left in the counter: topped up before it would run out by the next report.
    let mut h = holding_tokens(100, 10, now);
    assert!(matches!(
        h.on_report(report(50, 0, 5), now, limited(), Fleet::default(), 0),
        Step::Grant { .. }
    ));
}

#[test]
fn when_little_is_left_a_grant_is_renewed_only_once_nearly_spent() {
    let now = MINUTE_END - 40 * S;
    // The counter has 300 left for 40 s of 10/s: scarce.
    let scarce = Fleet {
        demand: 10.0,
        remaining: Some(300),
    };
    let mut h = holding_tokens(100, 10, now);
    assert_eq!(
        h.on_report(report(50, 0, 5), now, limited(), scarce, 0),
        Step::Nothing
    );
    let mut h = holding_tokens(100, 10, now);
    assert!(matches!(
        h.on_report(report(90, 0, 5), now, limited(), scarce, 0),
        Step::Grant { .. }
    ));
}

#[test]
fn a_grant_is_the_envoys_share_of_what_is_left_by_demand() {
    let mut h = Holding::default();
    h.on_report(
        report(100, 0, 5),
        MINUTE_END - 50 * S,
        limited(),
        Fleet::default(),
        0,
    );
    assert_eq!(h.demand, 20.0);
    let now = MINUTE_END - 30 * S;
    // Its demand over 10 s is 200; three Envoys want 60/s together and 90 are left: a third.
    let fleet = Fleet {
        demand: 60.0,
        remaining: Some(90),
    };
    assert_eq!(h.want(now, MINUTE_END, fleet), 30);
    assert_eq!(h.want(now, MINUTE_END, Fleet::default()), 200);
    // Nothing left still asks for one (the counter says no).
    let empty = Fleet {
        demand: 60.0,
        remaining: Some(0),
    };
    assert_eq!(h.want(now, MINUTE_END, empty), 1);
}

#[test]
fn the_window_end_brings_a_new_grant_and_renewals_stop_at_it() {
    let now = MINUTE_END - 3 * S - 400_000;
    let mut h = holding_tokens(100, 10, now);
    h.renewed(now, 2);
    // Expires 1.4 s before the end; the first tick within a second of that renews it to the
    // end, and then it is left alone.
    assert_eq!(
        h.on_tick(MINUTE_END - 3 * S + 5_000, limited(), Fleet::default()),
        Step::Nothing
    );
    assert_eq!(
        h.on_tick(MINUTE_END - 2 * S + 5_000, limited(), Fleet::default()),
        Step::Renew { ttl_s: 2 }
    );
    h.renewed(MINUTE_END - 2 * S + 5_000, 2);
    assert_eq!(
        h.on_tick(MINUTE_END - S + 5_000, limited(), Fleet::default()),
        Step::Nothing
    );
    // The next window: a new grant at once.
    let next = Treatment::Limited {
        period_end_us: MINUTE_END + 60 * S,
    };
    assert_eq!(
        h.on_tick(MINUTE_END + 5_000, next, Fleet::default()),
        Step::Grant {
            want: 100,
            until_us: MINUTE_END + 60 * S
        }
    );
}

#[test]
fn the_report_after_a_grant_between_reports_counts_only_what_came_after_it() {
    let now = MINUTE_END + 5_000;
    let mut h = holding_tokens(100, 10, MINUTE_END - 2 * S);
    let next = Treatment::Limited {
        period_end_us: MINUTE_END + 60 * S,
    };
    assert!(matches!(
        h.on_tick(now, next, Fleet::default()),
        Step::Grant { .. }
    ));
    h.assign(Assigned::Tokens {
        size: 200,
        until_us: MINUTE_END + 60 * S,
        expires_us: MINUTE_END + 60 * S,
        granted_us: now,
    });
    // The report 4 s later covers 5 s: one of them before the grant, with its denials.
    let step = h.on_report(report(50, 20, 5), now + 4 * S, next, Fleet::default(), 0);
    assert_eq!(
        step,
        Step::Nothing,
        "old denials do not make the new grant spent"
    );
}

#[test]
fn idle_buckets_are_abandoned_and_unlimited_ones_allowed() {
    let mut h = Holding::default();
    for i in 0..3 {
        assert_eq!(
            h.on_report(
                report(0, 0, 5),
                i * 5 * S,
                Treatment::Allow,
                Fleet::default(),
                3
            ),
            if i < 2 { Step::AllowAll } else { Step::Abandon }
        );
    }
    let mut h = Holding::default();
    assert_eq!(
        h.on_report(report(7, 0, 5), 0, Treatment::Shadow, Fleet::default(), 3),
        Step::Count { hits: 7 }
    );
}

proptest! {
    /// Whatever the demand, what is left and the time, a grant asks for at least one token and
    /// never more than `max_tokens` holds, nor more than the share of what is left (when known
    /// and not zero).
    #[test]
    fn a_grant_is_within_bounds_over_the_whole_range(
        allowed in any::<u64>(),
        denied in any::<u64>(),
        elapsed_s in 0u64..=u64::MAX / S,
        now in any::<u64>(),
        left_us in any::<u64>(),
        remaining in proptest::option::of(any::<u64>()),
        fleet_demand in proptest::num::f64::POSITIVE | proptest::num::f64::ZERO,
    ) {
        let mut h = Holding::default();
        h.on_report(report(allowed, denied, elapsed_s), now, Treatment::Allow, Fleet::default(), 0);
        prop_assert!(h.demand.is_finite() && h.demand >= 0.0);
        let end = now.saturating_add(left_us);
        let fleet = Fleet { demand: fleet_demand, remaining };
        let want = h.want(now, end, fleet);
        prop_assert!((1..=MAX_GRANT).contains(&want));
        if let Some(r) = remaining.filter(|r| *r > 0) {
            prop_assert!(want <= r.max(1));
        }
    }

    /// A renewal never lives past its period's end by more than the slack.
    #[test]
    fn a_renewal_never_outlives_its_period(now in any::<u64>(), left in any::<u64>()) {
        let until = now.saturating_add(left);
        if let Some(ttl) = ttl_seconds(now, until) {
            prop_assert!(ttl >= 1);
            prop_assert!(u128::from(now) + u128::from(ttl) * u128::from(S)
                <= u128::from(until) + u128::from(TTL_SLACK_US));
        }
    }
}
