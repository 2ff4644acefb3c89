//! The bucket family: token bucket, leaky bucket (as a meter) and GCRA.
//!
//! The three are one policy in three vocabularies: a token bucket with `burst` tokens refilled
//! at `requests / period` is a leaky bucket of capacity `burst` draining at the same rate
//! (tokens = capacity − level), and GCRA's theoretical arrival time is `now + level / rate`
//! with tolerance `burst × emission interval`. sluice computes all three with one exact meter.
//!
//! Units: a hit adds `P` (the period in ticks) to the level; the level drains by `requests`
//! per tick; the capacity is `burst × P`. So rates that are not whole ticks per hit stay exact.

use super::{Limit, State, Update, Verdict, div_ceil};

/// The level at `now_us`, after draining since the last update, clamped to the capacity (a
/// lowered limit must not leave an out-of-range level).
fn level_now(limit: &Limit, state: &State, now_us: u64) -> u64 {
    let (level, at_us) = match state {
        State::Meter { level, at_us } => (*level, *at_us),
        _ => return 0,
    };
    let capacity = limit.burst * limit.period_ticks();
    // An overdraft limit's level may be in debt, up to its cap.
    let level = level.min(capacity.max(limit.overdraft_cap()));
    let elapsed = (now_us / limit.tick_us).saturating_sub(at_us / limit.tick_us);
    // elapsed × requests could be huge after a long idle time; compare by division first.
    if elapsed >= div_ceil(level, limit.requests) {
        0
    } else {
        level - elapsed * limit.requests
    }
}

/// Microseconds from `now_us` until a level of `level` has drained to `target`.
fn drain_time(limit: &Limit, level: u64, target: u64, now_us: u64) -> u64 {
    if level <= target {
        return 0;
    }
    let ticks = div_ceil(level - target, limit.requests);
    let now_tick = now_us / limit.tick_us;
    (now_tick + ticks) * limit.tick_us - now_us
}

pub(super) fn empty_at_us(limit: &Limit, level: u64, at_us: u64) -> u64 {
    at_us + drain_time(limit, level, 0, at_us)
}

pub(super) fn decide(limit: &Limit, state: &State, now_us: u64, hits: u64) -> (Verdict, Update) {
    let p = limit.period_ticks();
    let capacity = limit.burst * p;
    let level = level_now(limit, state, now_us);
    if limit.overdraft {
        return overdraft(limit, level, capacity, now_us, hits);
    }
    if hits <= limit.burst && level <= capacity - hits * p {
        let level = level + hits * p;
        let verdict = Verdict {
            allowed: true,
            remaining: (capacity - level) / p,
            reset_after_us: drain_time(limit, level, 0, now_us),
            retry_after_us: 0,
        };
        return (
            verdict,
            Update::Set(State::Meter {
                level,
                at_us: now_us,
            }),
        );
    }
    let reset_after_us = drain_time(limit, level, 0, now_us);
    let retry_after_us = if hits > limit.burst {
        limit.period_us
    } else {
        drain_time(limit, level, capacity - hits * p, now_us)
    };
    let verdict = Verdict {
        allowed: false,
        remaining: (capacity - level) / p,
        reset_after_us,
        retry_after_us,
    };
    (verdict, Update::Keep)
}

/// A cost limit: allowed while one unit of room is left, and the hits go in even past the
/// capacity (the level in debt, up to the cap), so later requests wait for it to drain.
fn overdraft(
    limit: &Limit,
    level: u64,
    capacity: u64,
    now_us: u64,
    hits: u64,
) -> (Verdict, Update) {
    let p = limit.period_ticks();
    let next = level
        .saturating_add(hits.saturating_mul(p))
        .min(limit.overdraft_cap());
    let update = if hits > 0 {
        Update::Set(State::Meter {
            level: next,
            at_us: now_us,
        })
    } else {
        Update::Keep
    };
    let allowed = level <= capacity - p;
    let shown = if allowed { next } else { level };
    let verdict = Verdict {
        allowed,
        remaining: capacity.saturating_sub(shown) / p,
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
    let p = limit.period_ticks();
    let level = level_now(limit, state, now_us);
    let give_back = hits.saturating_mul(p);
    State::Meter {
        level: level.saturating_sub(give_back),
        at_us: now_us,
    }
}
