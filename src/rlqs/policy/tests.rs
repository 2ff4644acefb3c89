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
        refill: None,
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
            until_us,
            carry: None
        }
    );
    // Near the window's end, only what is left of it.
    assert_eq!(
        grant(1, MINUTE_END - 3 * S),
        Step::Grant {
            want: 60,
            until_us,
            carry: None
        }
    );
    // A burst in the first report: its own rate, over two reports.
    assert_eq!(
        grant(50, MINUTE_END - 30 * S),
        Step::Grant {
            want: 500,
            until_us,
            carry: None
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
        ..Fleet::default()
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
        ..Fleet::default()
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
        ..Fleet::default()
    };
    assert_eq!(h.want(now, MINUTE_END, 20.0, fleet), 30);
    assert_eq!(h.want(now, MINUTE_END, 20.0, Fleet::default()), 200);
    // Nothing left still asks for one (the counter says no).
    let empty = Fleet {
        demand: 60.0,
        remaining: Some(0),
        ..Fleet::default()
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
    let next = limited_next();
    assert_eq!(
        h.on_tick(MINUTE_END + 5_000, next, Fleet::default()),
        Step::Grant {
            want: 100,
            until_us: MINUTE_END + 60 * S,
            // No report since the grant: all of it may still be spent after the window.
            carry: Some(Carry {
                tokens: 100,
                ended_us: MINUTE_END
            })
        }
    );
}

#[test]
fn the_report_after_a_grant_between_reports_counts_only_what_came_after_it() {
    let now = MINUTE_END + 5_000;
    let mut h = holding_tokens(100, 10, MINUTE_END - 2 * S);
    let next = limited_next();
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
        let fleet = Fleet { demand: fleet_demand, remaining, ..Fleet::default() };
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
        refill: None,
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
        ..Fleet::default()
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

#[test]
fn what_an_ended_grant_may_still_spend_is_carried_and_a_report_after_the_end_does_not_shrink_it() {
    let t = MINUTE_END - 20 * S;
    let mut h = Holding::default();
    h.on_report(report(1, 0, 0), t, limited(), Fleet::default(), 0);
    h.assign(tokens(10, t), t);
    // 4 reported before the minute ends: 6 may still be spent after it.
    h.on_report(report(4, 0, 5), t + 5 * S, limited(), Fleet::default(), 0);
    assert_eq!(
        h.carry(MINUTE_END + 60 * S),
        Some(Carry {
            tokens: 6,
            ended_us: MINUTE_END
        })
    );
    // Within the period nothing is carried.
    assert_eq!(h.carry(MINUTE_END), None);
    // A report that arrives after the end holds requests that may be late ones: the carry
    // stays 6, and the grant drawn at that report carries them.
    let step = h.on_report(
        report(5, 0, 5),
        MINUTE_END + 2_000,
        limited_next(),
        Fleet::default(),
        0,
    );
    assert!(
        matches!(
            step,
            Step::Grant {
                carry: Some(Carry { tokens: 6, .. }),
                ..
            }
        ),
        "{step:?}"
    );
}

#[test]
fn a_report_is_taken_once_from_the_ended_grants_oldest_first_and_the_rest_from_the_held_one() {
    let t = MINUTE_END - 50 * S;
    let mut h = Holding::default();
    h.on_report(report(1, 0, 0), t, limited(), Fleet::default(), 0);
    h.assign(tokens(10, t), t);
    // Replaced at once by a tick (between reports): 10 wait, due a second later.
    h.grant_between_reports = true;
    h.assign(tokens(20, t + S), t + S);
    // The next report's 14: 10 from the ended grant (which then has nothing to give back),
    // the other 4 from the held one.
    h.on_report(report(14, 0, 5), t + 5 * S, limited(), Fleet::default(), 0);
    assert_eq!(h.take_returned(), 0);
    assert!(!h.settling());
    assert_eq!(h.reported_allowed, 4);
    // Replaced at a report: what it has not shown spent, 16, waits for the next report, which
    // takes its 6 from it.
    h.assign(tokens(8, t + 5 * S), t + 5 * S);
    h.on_report(report(6, 0, 5), t + 10 * S, limited(), Fleet::default(), 0);
    assert_eq!(h.take_returned(), 10);
    assert_eq!(h.reported_allowed, 0);
}

/// A window of `window_s` and `limit` that ends at `period_end_us`.
fn refilling(window_s: u64, limit: u64, period_end_us: u64) -> Treatment {
    Treatment::Limited {
        period_end_us,
        rate: limit as f64 / window_s as f64,
        refill: Some(Refill { window_s, limit }),
    }
}

#[test]
fn windows_shorter_than_the_reports_are_refilled_and_others_are_not() {
    let second = limit(Algorithm::FixedWindow, 100, 1);
    let two = limit(Algorithm::FixedWindow, 10, 2);
    let minute = limit(Algorithm::FixedWindow, 1000, 60);
    let hour = limit(Algorithm::FixedWindow, 5000, 3600);
    let bucket = limit(Algorithm::TokenBucket, 10, 1);
    assert_eq!(
        refill_of([&second, &hour]),
        Some(Refill {
            window_s: 1,
            limit: 100
        })
    );
    assert_eq!(
        refill_of([&two, &minute]),
        Some(Refill {
            window_s: 2,
            limit: 10
        })
    );
    assert_eq!(refill_of([&minute, &hour]), None);
    assert_eq!(
        refill_of([&second, &bucket]),
        None,
        "buckets have no windows"
    );
    let three = limit(Algorithm::FixedWindow, 10, 3);
    assert_eq!(refill_of([&two, &three]), None, "2 s does not divide 3 s");
}

#[test]
fn a_refilling_grant_charges_its_window_what_the_envoy_may_admit_in_it() {
    let fast = refilling(1, 100, MINUTE_END);
    let start = MINUTE_END - S + 400_000;
    // A first report 0.6 s before the window ends: its share is the whole limit until a report
    // says its demand, and the window is charged the token it starts with and 0.6 of a window.
    let mut h = Holding::default();
    let step = h.on_report(report(1, 0, 0), start, fast, Fleet::default(), 0);
    assert_eq!(
        step,
        Step::Refill {
            per_window: 100,
            until_us: MINUTE_END,
            refill: Refill {
                window_s: 1,
                limit: 100
            }
        }
    );
    assert_eq!(h.refill_charge(100, start, MINUTE_END, 1), 61);
    h.assign(
        Assigned::Refill {
            per_window: 100,
            charged: 61,
            until_us: MINUTE_END,
            expires_us: MINUTE_END + S,
            granted_us: start,
        },
        start,
    );
    // Another Envoy, not measured either, weighs as much, and its grant commits 40 a window: at
    // the next window's start the rate falls to its half, 50, and that window is charged the
    // old rate (the new one reaches the Envoy some time into it).
    let fleet = Fleet {
        demand: 2.0,
        committed: 140,
        weight: 200.0,
        ..Fleet::default()
    };
    let next = refilling(1, 100, MINUTE_END + S);
    let step = h.on_tick(MINUTE_END + 5_000, next, fleet);
    let Step::Refill { per_window, .. } = step else {
        panic!("{step:?}");
    };
    assert_eq!(per_window, 50);
    assert_eq!(
        h.refill_charge(50, MINUTE_END + 5_000, MINUTE_END + S, 1),
        100
    );
    // Alone, its share would be the whole limit, and the room (60) what it gets.
    let alone = Fleet {
        weight: 100.0,
        ..fleet
    };
    assert_eq!(
        h.refill_rate(
            Refill {
                window_s: 1,
                limit: 100
            },
            alone
        ),
        60
    );
    // Within the window a report changes nothing.
    h.assign(
        Assigned::Refill {
            per_window: 50,
            charged: 100,
            until_us: MINUTE_END + S,
            expires_us: MINUTE_END + 2 * S,
            granted_us: MINUTE_END + 5_000,
        },
        MINUTE_END + 5_000,
    );
    assert_eq!(
        h.on_report(report(50, 0, 1), MINUTE_END + 500_000, next, fleet, 0),
        Step::Nothing
    );
    // Measured at last (60 a second of 120 asked by the node's Envoys): its share by demand.
    h.on_report(report(30, 30, 1), MINUTE_END + 900_000, next, fleet, 0);
    let fleet = Fleet {
        demand: 120.0,
        committed: 100,
        weight: 120.0,
        ..Fleet::default()
    };
    assert_eq!(
        h.refill_rate(
            Refill {
                window_s: 1,
                limit: 100
            },
            fleet
        ),
        50
    );
}

proptest! {
    /// A refilling grant never lets its Envoy admit more in a window than it commits, nor
    /// commits more than the limit leaves beside the node's other grants, over the whole range.
    #[test]
    fn a_refilling_grant_is_within_its_room_over_the_whole_range(
        allowed in any::<u64>(),
        denied in any::<u64>(),
        elapsed_s in 0u64..=u64::MAX / S,
        window_s in 1u64..5,
        limit in 1u64..=u64::MAX,
        committed in any::<u64>(),
        fleet_demand in proptest::num::f64::POSITIVE | proptest::num::f64::ZERO,
    ) {
        let mut h = Holding::default();
        h.on_report(report(allowed, denied, elapsed_s), S, Treatment::Allow, Fleet::default(), 0);
        let refill = Refill { window_s, limit };
        let fleet = Fleet { demand: fleet_demand, committed, ..Fleet::default() };
        let per_window = h.refill_rate(refill, fleet);
        prop_assert!(per_window <= limit.saturating_sub(committed).min(MAX_GRANT));
        let charge = h.refill_charge(per_window, S, S + window_s * S, window_s);
        prop_assert!(charge <= per_window);
    }
}
