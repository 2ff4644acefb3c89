//! Two counters: the current window's and the previous one's. The estimate of the sliding
//! window is `previous × (period − elapsed) / period + current`, computed scaled by the period
//! (in ticks) so it stays an integer:
//! `used = previous × (P − e) + current × P`, admitted iff `used + hits × P <= requests × P`.
//! The estimate assumes the previous window's requests were spread evenly; its error is bounded
//! by the previous window's count times how unevenly they arrived.

use super::{Limit, State, Update, Verdict};

struct Window {
    start_us: u64,
    current: u64,
    previous: u64,
}

fn current(limit: &Limit, state: &State, now_us: u64) -> Window {
    let start = now_us - now_us % limit.period_us;
    let (current, previous) = match state {
        State::Sliding {
            start_us,
            current,
            previous,
        } => {
            if *start_us == start {
                (*current, *previous)
            } else if *start_us + limit.period_us == start {
                (0, *current)
            } else {
                (0, 0)
            }
        }
        _ => (0, 0),
    };
    // A lowered limit leaves counters above it; clamping keeps every product within range and
    // the decision the same (full).
    Window {
        start_us: start,
        current: current.min(limit.requests),
        previous: previous.min(limit.requests),
    }
}

pub(super) fn decide(limit: &Limit, state: &State, now_us: u64, hits: u64) -> (Verdict, Update) {
    let w = current(limit, state, now_us);
    let p = limit.period_ticks();
    let elapsed = (now_us - w.start_us) / limit.tick_us;
    let weight = p - elapsed;
    let used = w.previous * weight + w.current * p;
    let capacity = limit.requests * p;
    let to_end = w.start_us + limit.period_us - now_us;
    if hits <= limit.requests && used + hits * p <= capacity {
        let current = w.current + hits;
        let reset_after_us = if current > 0 {
            to_end + limit.period_us
        } else if w.previous > 0 {
            to_end
        } else {
            0
        };
        let verdict = Verdict {
            allowed: true,
            remaining: (capacity - used - hits * p) / p,
            reset_after_us,
            retry_after_us: 0,
        };
        let next = State::Sliding {
            start_us: w.start_us,
            current,
            previous: w.previous,
        };
        return (verdict, Update::Set(next));
    }
    let full_reset = to_end + if w.current > 0 { limit.period_us } else { 0 };
    let retry_after_us = if hits > limit.requests {
        limit.period_us
    } else if w.current + hits <= limit.requests {
        // Later in this window the previous window's weight falls enough:
        // previous × (P − e') <= (requests − current − hits) × P.
        let room = (limit.requests - w.current - hits) * p;
        let max_weight = room / w.previous; // previous > 0, or the request would fit now
        let e_at = p - max_weight;
        (w.start_us + e_at * limit.tick_us) - now_us
    } else {
        // In the next window the current counter becomes the previous one:
        // current × (P − e') + hits × P <= requests × P.
        let e_at = ((limit.requests - hits) * p)
            .checked_div(w.current)
            .map_or(0, |max_weight| p - max_weight.min(p));
        to_end + e_at * limit.tick_us
    };
    let verdict = Verdict {
        allowed: false,
        remaining: (capacity - used.min(capacity)) / p,
        reset_after_us: full_reset,
        retry_after_us,
    };
    (verdict, Update::Keep)
}

pub(super) fn refund(limit: &Limit, state: &State, now_us: u64, hits: u64) -> State {
    let w = current(limit, state, now_us);
    let from_current = hits.min(w.current);
    let from_previous = (hits - from_current).min(w.previous);
    State::Sliding {
        start_us: w.start_us,
        current: w.current - from_current,
        previous: w.previous - from_previous,
    }
}
