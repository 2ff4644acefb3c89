//! Exact sliding window: one stamp per admitted batch of hits, kept for one period. A request
//! is admitted iff the hits stamped within the last period plus its own fit the limit.
//!
//! The state keeps a running total, and an allowed decision describes its change (drop the
//! expired prefix, add one stamp) instead of copying the log, so a decision costs the number of
//! stamps that expired since the last one, not the length of the log.

use std::collections::VecDeque;

use super::{Limit, Stamp, State, Update, Verdict};

const NO_STAMPS: &VecDeque<Stamp> = &VecDeque::new();

fn stamps(state: &State) -> (u64, &VecDeque<Stamp>) {
    match state {
        State::Log { total, stamps } => (*total, stamps.as_ref()),
        _ => (0, NO_STAMPS),
    }
}

/// How many of the oldest stamps have left the window ending at `now_us` (a stamp at `t`
/// counts until `t + P`), and their hits.
fn expired(limit: &Limit, stamps: &VecDeque<Stamp>, now_us: u64) -> (usize, u64) {
    let mut count = 0;
    let mut hits = 0;
    for s in stamps {
        if s.at_us + limit.period_us > now_us {
            break;
        }
        count += 1;
        hits += s.hits;
    }
    (count, hits)
}

pub(super) fn decide(limit: &Limit, state: &State, now_us: u64, hits: u64) -> (Verdict, Update) {
    let (total, stamps) = stamps(state);
    let (gone, gone_hits) = expired(limit, stamps, now_us);
    let used = total - gone_hits;
    let newest = stamps
        .back()
        .filter(|_| gone < stamps.len())
        .map(|s| s.at_us);
    if hits <= limit.requests && used <= limit.requests - hits {
        let last = if hits > 0 { Some(now_us) } else { newest };
        let verdict = Verdict {
            allowed: true,
            remaining: limit.requests - used - hits,
            reset_after_us: last.map_or(0, |t| t + limit.period_us - now_us),
            retry_after_us: 0,
        };
        let update = Update::Log {
            expired: gone,
            at_us: now_us,
            hits,
        };
        return (verdict, update);
    }
    let reset_after_us = newest.map_or(0, |t| t + limit.period_us - now_us);
    let retry_after_us = if hits > limit.requests {
        limit.period_us
    } else {
        // The oldest stamps leave first; find the one whose leaving makes room.
        let mut still = used;
        let mut at = reset_after_us;
        for s in stamps.iter().skip(gone) {
            still -= s.hits;
            if still + hits <= limit.requests {
                at = s.at_us + limit.period_us - now_us;
                break;
            }
        }
        at
    };
    let verdict = Verdict {
        allowed: false,
        remaining: limit.requests.saturating_sub(used),
        reset_after_us,
        retry_after_us,
    };
    (verdict, Update::Keep)
}

/// Applies a decision's change to the log.
pub(super) fn apply(state: &mut State, expired: usize, at_us: u64, hits: u64) {
    if !matches!(state, State::Log { .. }) {
        *state = State::Log {
            total: 0,
            stamps: Box::default(),
        };
    }
    let State::Log { total, stamps } = state else {
        unreachable!("made a log above")
    };
    for s in stamps.drain(..expired) {
        *total -= s.hits;
    }
    if hits > 0 {
        *total += hits;
        match stamps.back_mut() {
            Some(last) if last.at_us == at_us => last.hits += hits,
            _ => stamps.push_back(Stamp { at_us, hits }),
        }
    }
}

pub(super) fn refund(limit: &Limit, state: &State, now_us: u64, hits: u64) -> State {
    let (total, stamps) = stamps(state);
    let (gone, gone_hits) = expired(limit, stamps, now_us);
    let mut stamps: VecDeque<Stamp> = stamps.iter().skip(gone).copied().collect();
    let mut total = total - gone_hits;
    let mut left = hits;
    // The newest hits go back first: they would have stayed longest.
    while left > 0 {
        let Some(last) = stamps.back_mut() else { break };
        let take = left.min(last.hits);
        last.hits -= take;
        total -= take;
        left -= take;
        if last.hits == 0 {
            stamps.pop_back();
        }
    }
    State::Log {
        total,
        stamps: Box::new(stamps),
    }
}
