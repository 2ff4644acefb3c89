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

/// 1200 a minute.
fn limited() -> Treatment {
    Treatment::Limited {
        period_end_us: MINUTE_END,
        rate: 20.0,
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
    // A calendar month: its grants end when the month does (or at a 64-day boundary first).
    let calendar =
        crate::calendar::Calendar::interned("Europe/Berlin", crate::calendar::CalendarUnit::Month)
            .unwrap();
    let month = limit(Algorithm::FixedWindow, 10, 30 * 86_400)
        .with_calendar(calendar)
        .unwrap();
    let (_, month_end) = month.window_at(now);
    let longest = (now / MAX_PERIOD_US + 1) * MAX_PERIOD_US;
    assert_eq!(period_end_us([&month], now), Some(month_end.min(longest)));
    assert_ne!(month_end % (30 * 86_400 * S), 0, "not an aligned 30 days");
}

#[test]
fn a_time_to_live_is_whole_seconds_lasting_past_the_period_end_by_the_slack() {
    let end = 100 * S;
    assert_eq!(ttl_seconds(97 * S, end), Some(4));
    assert_eq!(ttl_seconds(97 * S + 400_000, end), Some(3));
    assert_eq!(ttl_seconds(97 * S + 800_000, end), Some(3));
    assert_eq!(ttl_seconds(99 * S + 5_000, end), Some(2));
    assert_eq!(ttl_seconds(end - 1, end), Some(1));
    assert_eq!(ttl_seconds(end, end), None);
    assert_eq!(ttl_seconds(end + S, end), None);
}

#[test]
fn a_first_report_gets_a_grant_sized_to_its_demand() {
    let grant = |allowed: u64, now: u64| {
        let mut h = Holding::default();
        h.on_report(report(allowed, 0, 0), now, limited(), Fleet::default(), 12)
    };
    let until_us = MINUTE_END;
    // The request that made the bucket says little of its demand: the first grant is the
    // limit's rate (20/s) until the next report (5 s).
    assert_eq!(
        grant(1, MINUTE_END - 30 * S),
        Step::Grant {
            want: 100,
            until_us
        }
    );
    // Near the window's end, only what is left of it.
    assert_eq!(
        grant(1, MINUTE_END - 3 * S),
        Step::Grant { want: 60, until_us }
    );
    // A burst in the first report: its own rate, over two reports.
    assert_eq!(
        grant(50, MINUTE_END - 30 * S),
        Step::Grant {
            want: 500,
            until_us
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
    h.assign(
        Assigned::Tokens {
            size,
            until_us: MINUTE_END,
            expires_us: MINUTE_END,
            granted_us: now - 5 * S,
        },
        0,
    );
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
    // Plenty left in the counter: 50 left at 10/s lasts past the next tick, so the ticks
    // watch it, and top it up a tick and a half before it would run out.
    let mut h = holding_tokens(100, 10, now);
    assert_eq!(
        h.on_report(report(50, 0, 5), now, limited(), Fleet::default(), 0),
        Step::Nothing
    );
    assert_eq!(
        h.on_tick(now + 3 * S, limited(), Fleet::default()),
        Step::Nothing
    );
    assert!(matches!(
        h.on_tick(now + 4 * S, limited(), Fleet::default()),
        Step::Grant { .. }
    ));
    // Little left in the counter: the ticks leave it alone.
    let mut h = holding_tokens(100, 10, now);
    let scarce = Fleet {
        demand: 10.0,
        remaining: Some(100),
        held: 50,
    };
    h.on_report(report(50, 0, 5), now, limited(), scarce, 0);
    assert_eq!(h.on_tick(now + 4 * S, limited(), scarce), Step::Nothing);
}

#[test]
fn when_little_is_left_a_grant_is_renewed_only_once_nearly_spent() {
    let now = MINUTE_END - 40 * S;
    // The counter has 300 left for 40 s of 10/s: scarce.
    let scarce = Fleet {
        demand: 10.0,
        remaining: Some(300),
        held: 0,
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
        held: 0,
    };
    assert_eq!(h.want(now, MINUTE_END, 20.0, fleet), 30);
    assert_eq!(h.want(now, MINUTE_END, 20.0, Fleet::default()), 200);
    // Nothing left still asks for one (the counter says no).
    let empty = Fleet {
        demand: 60.0,
        remaining: Some(0),
        held: 0,
    };
    assert_eq!(h.want(now, MINUTE_END, 20.0, empty), 1);
}

#[test]
fn the_window_end_brings_a_new_grant_and_renewals_stop_at_it() {
    let now = MINUTE_END - 3 * S - 400_000;
    let mut h = holding_tokens(100, 10, now);
    h.renewed(now, 2);
    // Expires 1.4 s before the end; the first tick within a second of that renews it to past
    // the end (by the slack), and then it is left alone.
    assert_eq!(
        h.on_tick(MINUTE_END - 3 * S + 5_000, limited(), Fleet::default()),
        Step::Nothing
    );
    assert_eq!(
        h.on_tick(MINUTE_END - 2 * S + 5_000, limited(), Fleet::default()),
        Step::Renew { ttl_s: 3 }
    );
    h.renewed(MINUTE_END - 2 * S + 5_000, 3);
    assert_eq!(
        h.on_tick(MINUTE_END - S + 5_000, limited(), Fleet::default()),
        Step::Nothing
    );
    // The next window: a new grant at once.
    let next = Treatment::Limited {
        period_end_us: MINUTE_END + 60 * S,
        rate: 20.0,
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
        rate: 20.0,
    };
    assert!(matches!(
        h.on_tick(now, next, Fleet::default()),
        Step::Grant { .. }
    ));
    h.assign(
        Assigned::Tokens {
            size: 200,
            until_us: MINUTE_END + 60 * S,
            expires_us: MINUTE_END + 60 * S,
            granted_us: now,
        },
        0,
    );
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
        rate in proptest::num::f64::POSITIVE | proptest::num::f64::ZERO,
    ) {
        let mut h = Holding::default();
        h.on_report(report(allowed, denied, elapsed_s), now, Treatment::Allow, Fleet::default(), 0);
        prop_assert!(h.demand.is_finite() && h.demand >= 0.0);
        let end = now.saturating_add(left_us);
        let fleet = Fleet { demand: fleet_demand, remaining, held: 0 };
        let want = h.want(now, end, rate, fleet);
        prop_assert!((1..=MAX_GRANT).contains(&want));
        if let Some(r) = remaining.filter(|r| *r > 0) {
            prop_assert!(want <= r.max(1));
        }
    }

    /// A time to live lasts past its period's end by the slack and less than a second more;
    /// none once the period is over.
    #[test]
    fn a_time_to_live_outlasts_its_period_by_the_slack_and_no_more(
        now in any::<u64>(),
        left in any::<u64>(),
    ) {
        let until = now.saturating_add(left);
        match ttl_seconds(now, until) {
            Some(ttl) => {
                let expires = u128::from(now) + u128::from(ttl) * u128::from(S);
                prop_assert!(ttl >= 1);
                let slack = u128::from(TICK_SLACK_US);
                prop_assert!(expires >= u128::from(until) + slack);
                prop_assert!(expires < u128::from(until) + slack + u128::from(S));
            }
            None => prop_assert!(until <= now),
        }
    }
}

fn tokens(size: u64, granted_us: u64) -> Assigned {
    Assigned::Tokens {
        size,
        until_us: MINUTE_END,
        expires_us: MINUTE_END,
        granted_us,
    }
}

#[test]
fn an_ended_grant_gives_back_what_the_reports_prove_it_did_not_spend() {
    let t = MINUTE_END - 50 * S;
    let reported = |h: &mut Holding, allowed: u64, at: u64| {
        h.on_report(report(allowed, 0, 5), at, limited(), Fleet::default(), 0);
    };
    // Granted 10 at a report; 3 allowed by the next; replaced at that report: the report after
    // it (2 allowed, every one of which may be the old grant's) settles 10 - 3 - 2 = 5.
    let mut h = Holding::default();
    reported(&mut h, 1, t);
    h.assign(tokens(10, t), t);
    reported(&mut h, 3, t + 5 * S);
    h.assign(tokens(8, t + 5 * S), t + 5 * S);
    assert!(h.settling());
    assert_eq!(
        h.take_returned(),
        0,
        "nothing proven before the next report"
    );
    reported(&mut h, 2, t + 10 * S);
    assert_eq!(h.take_returned(), 5);
    assert!(!h.settling());
    // A spent grant gives nothing back.
    let mut h = Holding::default();
    reported(&mut h, 1, t);
    h.assign(tokens(4, t), t);
    reported(&mut h, 4, t + 5 * S);
    h.assign(tokens(4, t + 5 * S), t + 5 * S);
    assert!(!h.settling());
}

#[test]
fn a_grant_replaced_between_reports_waits_for_a_report_that_left_after_the_replacement() {
    let t = MINUTE_END - 50 * S;
    // The tick replaces it 4.5 s later (a new period, say).
    let at = t + 4_500_000;
    // A grant of 10 at `t`, replaced by one of 6 at `at` by the tick at the minute's end.
    let replaced_by_the_tick = || {
        let mut h = Holding::default();
        h.on_report(report(1, 0, 0), t, limited(), Fleet::default(), 0);
        h.assign(tokens(10, t), t);
        assert!(matches!(
            h.on_tick(MINUTE_END + 10_000, limited_next(), Fleet::default()),
            Step::Grant { .. }
        ));
        h.assign(tokens(6, at), at);
        h
    };
    let reported = |h: &mut Holding, allowed: u64, when: u64| {
        h.on_report(
            report(allowed, 0, 5),
            when,
            limited_next(),
            Fleet::default(),
            0,
        );
    };
    // A report 0.5 s after it may have left the Envoy before the replacement reached it: the
    // report after it settles (10 - 2 - 1 = 7).
    let mut h = replaced_by_the_tick();
    reported(&mut h, 2, at + 500_000);
    assert_eq!(h.take_returned(), 0);
    assert!(h.settling());
    reported(&mut h, 1, at + 5_500_000);
    assert_eq!(h.take_returned(), 7);
    // Arriving a second or more after the replacement, one report settles.
    let mut h = replaced_by_the_tick();
    reported(&mut h, 2, at + DELIVERY_BOUND_US);
    assert_eq!(h.take_returned(), 8);
}

/// The minute after [`limited`]'s.
fn limited_next() -> Treatment {
    Treatment::Limited {
        period_end_us: MINUTE_END + 60 * S,
        rate: 20.0,
    }
}

#[test]
fn short_of_room_a_grant_its_envoy_will_not_spend_is_replaced_by_one_it_will() {
    let now = MINUTE_END - 20 * S;
    // 1 request a second seen, holding 200 with 20 s left, and the counter short of room (the
    // fleet's demand outruns what is left): the grant is sized down.
    let mut h = holding_tokens(200, 1, now);
    let short = Fleet {
        demand: 50.0,
        remaining: Some(10),
        held: 0,
    };
    assert!(matches!(
        h.on_report(report(5, 0, 5), now, limited(), short, 0),
        Step::Grant { .. }
    ));
    // With room for everyone, it is left alone.
    let mut h = holding_tokens(200, 1, now);
    assert_eq!(
        h.on_report(report(5, 0, 5), now, limited(), Fleet::default(), 0),
        Step::Nothing
    );
}
