//! A counter per epoch-aligned window: `count + hits <= requests` admits.

use super::{Limit, State, Update, Verdict};

fn current(limit: &Limit, state: &State, now_us: u64) -> (u64, u64) {
    let start = now_us - now_us % limit.period_us;
    let count = match state {
        State::Window { start_us, count } if *start_us == start => *count,
        _ => 0,
    };
    (start, count)
}

pub(super) fn decide(limit: &Limit, state: &State, now_us: u64, hits: u64) -> (Verdict, Update) {
    let (start, count) = current(limit, state, now_us);
    let to_end = start + limit.period_us - now_us;
    let fits = hits <= limit.requests && count <= limit.requests - hits;
    if fits {
        let count = count + hits;
        let verdict = Verdict {
            allowed: true,
            remaining: limit.requests - count,
            reset_after_us: to_end,
            retry_after_us: 0,
        };
        (
            verdict,
            Update::Set(State::Window {
                start_us: start,
                count,
            }),
        )
    } else {
        // Whatever the hits, the next window is the first chance (hits beyond the limit never
        // fit; the window end is still the most useful time to report).
        let verdict = Verdict {
            allowed: false,
            remaining: limit.requests.saturating_sub(count),
            reset_after_us: to_end,
            retry_after_us: to_end,
        };
        (verdict, Update::Keep)
    }
}

pub(super) fn refund(limit: &Limit, state: &State, now_us: u64, hits: u64) -> State {
    let (start, count) = current(limit, state, now_us);
    State::Window {
        start_us: start,
        count: count.saturating_sub(hits),
    }
}
