//! The bucket family: token bucket, leaky bucket (as a meter) and GCRA.
//!
//! The three are one policy in three vocabularies: a token bucket with `burst` tokens refilled
//! at `requests / period` is a leaky bucket of capacity `burst` draining at the same rate
//! (tokens = capacity − level), and GCRA's theoretical arrival time is `now + level / rate`
//! with tolerance `burst × emission interval`. sluice computes all three with one exact meter.
//!
//! Units: a hit adds `P` (the period in ticks) to the level; the level drains by `requests`
//! per tick; the capacity is `burst × P`. So rates that are not whole ticks per hit stay exact.
//!
//! **The state is a time, not a level**: the tick at which the level is zero again, as whole
//! ticks and a fraction `frac / requests` of one (GCRA's theoretical arrival time, exactly).
//! A level within the capacity is at most 2^53 units (`Limit::tick_us` is chosen so), but a
//! cost limit's debt is not: a day's million tokens in 10 µs ticks is 2^53 units, and a debit
//! of twice that must still be recorded whole. As a time, the debt needs only its drain time
//! (bounded by `TIME_MAX`, 142 years) and a fraction below `requests`, both exact in a double;
//! every comparison against the capacity works on (ticks, fraction) pairs, so no product of a
//! debt ever exceeds 2^53. The one product that can — a debit of `hits × P` units — is divided
//! by `requests` exactly ([`mul_divmod`]; the Lua twin does it with doubles, bit by bit).

use super::{Limit, State, TIME_MAX, Update, Verdict};

/// A level as the time it takes to drain: `ticks` whole ticks and `frac / requests` of one
/// more (`frac < requests`), so the level is `ticks × requests + frac` units. Ordered as the
/// levels are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Level {
    ticks: u64,
    frac: u64,
}

impl Level {
    const ZERO: Level = Level { ticks: 0, frac: 0 };

    /// `units` (at most 2^53, a level within the capacity) as a drain time.
    fn of(units: u64, requests: u64) -> Level {
        Level {
            ticks: units / requests,
            frac: units % requests,
        }
    }

    /// Whether the level is at most `units` (at most the capacity).
    fn at_most(self, units: u64, requests: u64) -> bool {
        self <= Level::of(units, requests)
    }

    /// The level in units; only for a level at most the capacity (so at most 2^53).
    fn units(self, requests: u64) -> u64 {
        self.ticks * requests + self.frac
    }

    /// Whole ticks from now until the level is at most `units` (at most the capacity).
    fn ticks_to(self, units: u64, requests: u64) -> u64 {
        let target = Level::of(units, requests);
        if self <= target {
            0
        } else {
            // (level − units) / requests = Δticks + (frac − target.frac) / requests, the
            // fraction's part in (−1, 1): rounded up, it adds one only when positive.
            self.ticks - target.ticks + u64::from(self.frac > target.frac)
        }
    }

    /// This level plus `hits` hits, recorded up to `cap_ticks` of drain (142 years).
    fn plus(self, hits: u64, p: u64, requests: u64, cap_ticks: u64) -> Level {
        let (q, rem) = mul_divmod(hits, p, requests);
        let (frac, carry) = if self.frac >= requests - rem {
            (self.frac - (requests - rem), 1)
        } else {
            (self.frac + rem, 0)
        };
        // Past the cap (or on it with a fraction left over): the cap.
        let room = cap_ticks.saturating_sub(self.ticks);
        match q.checked_add(carry) {
            Some(add) if add < room || (add == room && frac == 0) => Level {
                ticks: self.ticks + add,
                frac,
            },
            _ => Level {
                ticks: cap_ticks,
                frac: 0,
            },
        }
    }

    /// This level less `hits` hits, never below zero.
    fn minus(self, hits: u64, p: u64, requests: u64) -> Level {
        let (q, rem) = mul_divmod(hits, p, requests);
        let taken = Level {
            ticks: q,
            frac: rem,
        };
        if taken >= self {
            return Level::ZERO;
        }
        if self.frac >= rem {
            Level {
                ticks: self.ticks - taken.ticks,
                frac: self.frac - rem,
            }
        } else {
            Level {
                ticks: self.ticks - taken.ticks - 1,
                frac: requests - (rem - self.frac),
            }
        }
    }
}

/// `a × b` divided by `m`, exactly: the quotient (saturated at `u64::MAX`) and the remainder.
fn mul_divmod(a: u64, b: u64, m: u64) -> (u64, u64) {
    let product = u128::from(a) * u128::from(b);
    let m = u128::from(m);
    let q = u64::try_from(product / m).unwrap_or(u64::MAX);
    (q, (product % m) as u64)
}

/// The longest a cost limit's debt may take to drain, in ticks: [`TIME_MAX`] µs (142 years).
/// Debt past it is not recorded: it would keep the limit closed past the year 2112 anyway.
pub(super) fn debt_cap_ticks(limit: &Limit) -> u64 {
    TIME_MAX / limit.tick_us
}

/// A stored state's empty time with its fraction below `requests`: a fraction of another rate
/// (the rule changed since) has its whole ticks carried over.
fn empty_time(requests: u64, empty_tick: u64, frac: u64) -> (u64, u64) {
    (empty_tick.saturating_add(frac / requests), frac % requests)
}

/// The level at `now_tick`: the stored drain time less what has passed, bounded by the
/// capacity (a lowered limit must not leave an out-of-range level) or, for a cost limit, by
/// its debt's cap.
fn level_now(limit: &Limit, state: &State, now_tick: u64) -> Level {
    let State::Meter { empty_tick, frac } = *state else {
        return Level::ZERO;
    };
    let requests = limit.requests;
    let (empty_tick, frac) = empty_time(requests, empty_tick, frac);
    if empty_tick < now_tick {
        return Level::ZERO;
    }
    let level = Level {
        ticks: empty_tick - now_tick,
        frac,
    };
    let capacity = limit.burst * limit.period_ticks();
    let bound = if limit.overdraft {
        Level {
            ticks: debt_cap_ticks(limit),
            frac: 0,
        }
    } else {
        Level::of(capacity, requests)
    };
    level.min(bound)
}

/// The state that holds `level` at `now_tick` (a zero level is the empty state's words).
fn stored(level: Level, now_tick: u64) -> State {
    if level == Level::ZERO {
        State::Meter {
            empty_tick: 0,
            frac: 0,
        }
    } else {
        State::Meter {
            empty_tick: now_tick + level.ticks,
            frac: level.frac,
        }
    }
}

/// Microseconds from `now_us` until `level` has drained to `target` units.
fn drain_time(limit: &Limit, level: Level, target: u64, now_us: u64) -> u64 {
    let ticks = level.ticks_to(target, limit.requests);
    if ticks == 0 {
        return 0;
    }
    (now_us / limit.tick_us + ticks) * limit.tick_us - now_us
}

/// Hits' worth of room left above `level` (none when it is at or past the capacity).
fn room(limit: &Limit, level: Level, capacity: u64) -> u64 {
    if level.at_most(capacity, limit.requests) {
        (capacity - level.units(limit.requests)) / limit.period_ticks()
    } else {
        0
    }
}

/// When a state is empty (µs): the end of the tick its level reaches zero in.
pub(super) fn empty_at_us(limit: &Limit, empty_tick: u64, frac: u64) -> u64 {
    let (empty_tick, frac) = empty_time(limit.requests.max(1), empty_tick, frac);
    empty_tick
        .saturating_add(u64::from(frac > 0))
        .saturating_mul(limit.tick_us)
}

pub(super) fn decide(limit: &Limit, state: &State, now_us: u64, hits: u64) -> (Verdict, Update) {
    let p = limit.period_ticks();
    let capacity = limit.burst * p;
    let now_tick = now_us / limit.tick_us;
    let level = level_now(limit, state, now_tick);
    if limit.overdraft {
        return overdraft(limit, level, capacity, now_us, hits);
    }
    if hits <= limit.burst && level.at_most(capacity - hits * p, limit.requests) {
        let next = Level::of(level.units(limit.requests) + hits * p, limit.requests);
        let verdict = Verdict {
            allowed: true,
            remaining: room(limit, next, capacity),
            reset_after_us: drain_time(limit, next, 0, now_us),
            retry_after_us: 0,
        };
        return (verdict, Update::Set(stored(next, now_tick)));
    }
    let retry_after_us = if hits > limit.burst {
        limit.period_us
    } else {
        drain_time(limit, level, capacity - hits * p, now_us)
    };
    let verdict = Verdict {
        allowed: false,
        remaining: room(limit, level, capacity),
        reset_after_us: drain_time(limit, level, 0, now_us),
        retry_after_us,
    };
    (verdict, Update::Keep)
}

/// A cost limit: allowed while one unit of room is left, and the hits go in even past the
/// capacity (the level in debt, up to the cap), so later requests wait for it to drain.
fn overdraft(
    limit: &Limit,
    level: Level,
    capacity: u64,
    now_us: u64,
    hits: u64,
) -> (Verdict, Update) {
    let p = limit.period_ticks();
    let now_tick = now_us / limit.tick_us;
    let (next, update) = if hits > 0 {
        let next = level.plus(hits, p, limit.requests, debt_cap_ticks(limit));
        (next, Update::Set(stored(next, now_tick)))
    } else {
        (level, Update::Keep)
    };
    let allowed = level.at_most(capacity - p, limit.requests);
    let shown = if allowed { next } else { level };
    let verdict = Verdict {
        allowed,
        remaining: room(limit, shown, capacity),
        reset_after_us: drain_time(limit, shown, 0, now_us),
        retry_after_us: if allowed {
            0
        } else {
            drain_time(limit, level, capacity - p, now_us)
        },
    };
    (verdict, update)
}

pub(super) fn refund(limit: &Limit, state: &State, now_us: u64, hits: u64) -> State {
    let now_tick = now_us / limit.tick_us;
    let level = level_now(limit, state, now_tick);
    stored(
        level.minus(hits, limit.period_ticks(), limit.requests),
        now_tick,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mul_divmod_is_exact_past_64_bits() {
        assert_eq!(mul_divmod(u64::MAX, u64::MAX, u64::MAX), (u64::MAX, 0));
        assert_eq!(mul_divmod(1 << 40, 1 << 40, 3), (u64::MAX, 1));
        assert_eq!(
            mul_divmod(2_000_000, 8_640_000_000, 1_000_000),
            (17_280_000_000, 0)
        );
        assert_eq!(mul_divmod(7, 10, 3), (23, 1));
    }

    #[test]
    fn plus_carries_and_caps() {
        let l = Level { ticks: 5, frac: 2 };
        // 3 hits of 1 unit each, 4 units a tick: 2 + 3 = 5 units = 1 tick + 1.
        assert_eq!(l.plus(3, 1, 4, 100), Level { ticks: 6, frac: 1 });
        assert_eq!(
            l.plus(1_000, 1, 4, 100),
            Level {
                ticks: 100,
                frac: 0
            }
        );
        assert_eq!(
            l.plus(u64::MAX, u64::MAX, 1, 100),
            Level {
                ticks: 100,
                frac: 0
            }
        );
        // Exactly at the cap with no fraction is kept; any fraction past it is not.
        assert_eq!(
            Level { ticks: 99, frac: 0 }.plus(4, 1, 4, 100),
            Level {
                ticks: 100,
                frac: 0
            }
        );
        assert_eq!(
            Level { ticks: 99, frac: 1 }.plus(4, 1, 4, 100),
            Level {
                ticks: 100,
                frac: 0
            }
        );
    }

    #[test]
    fn minus_borrows_and_stops_at_zero() {
        let l = Level { ticks: 5, frac: 2 };
        assert_eq!(l.minus(3, 1, 4), Level { ticks: 4, frac: 3 });
        assert_eq!(l.minus(22, 1, 4), Level::ZERO);
        assert_eq!(l.minus(21, 1, 4), Level { ticks: 0, frac: 1 });
        assert_eq!(l.minus(u64::MAX, u64::MAX, 1), Level::ZERO);
    }
}
