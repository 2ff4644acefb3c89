//! A counter per window (epoch-aligned, or a calendar's: [`Limit::window_at`]):
//! `count + hits <= requests` admits (with `overdraft`, `count < requests` admits and the count
//! may pass the limit).

use super::{Limit, State, Update, Verdict};

/// The window's start and end, and its count.
fn current(limit: &Limit, state: &State, now_us: u64) -> (u64, u64, u64) {
    let (start, end) = limit.window_at(now_us);
    let count = match state {
        State::Window { start_us, count } if *start_us == start => *count,
        _ => 0,
    };
    (start, end, count)
}

pub(super) fn decide(limit: &Limit, state: &State, now_us: u64, hits: u64) -> (Verdict, Update) {
    let (start, end, count) = current(limit, state, now_us);
    let to_end = end - now_us;
    if limit.overdraft {
        return overdraft(limit, start, count, to_end, hits);
    }
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

/// A cost limit: allowed while the count is under the limit, and the hits are counted even
/// past it (up to the cap), so the window stays over until it ends.
fn overdraft(limit: &Limit, start: u64, count: u64, to_end: u64, hits: u64) -> (Verdict, Update) {
    let next = count.saturating_add(hits).min(limit.overdraft_cap());
    let update = if hits > 0 {
        Update::Set(State::Window {
            start_us: start,
            count: next,
        })
    } else {
        Update::Keep
    };
    let allowed = count < limit.requests;
    let verdict = Verdict {
        allowed,
        remaining: limit
            .requests
            .saturating_sub(if allowed { next } else { count }),
        reset_after_us: to_end,
        retry_after_us: if allowed { 0 } else { to_end },
    };
    (verdict, update)
}

pub(super) fn refund(limit: &Limit, state: &State, now_us: u64, hits: u64) -> State {
    let (start, _, count) = current(limit, state, now_us);
    State::Window {
        start_us: start,
        count: count.saturating_sub(hits),
    }
}
