//! Exact sliding window: one stamp per admitted batch of hits, kept for one period. A request
//! is admitted iff the hits stamped within the last period plus its own fit the limit.

use std::collections::VecDeque;

use super::{Limit, Stamp, State, Verdict};

/// The stamps still inside the window ending at `now_us` (a stamp at `t` counts until `t + P`).
fn live<'a>(limit: &'a Limit, state: &'a State, now_us: u64) -> impl Iterator<Item = &'a Stamp> {
    let log = match state {
        State::Log(log) => Some(log),
        _ => None,
    };
    // Stamps are in time order, so the expired ones are a prefix.
    log.into_iter()
        .flatten()
        .skip_while(move |s| s.at_us + limit.period_us <= now_us)
}

pub(super) fn decide(limit: &Limit, state: &State, now_us: u64, hits: u64) -> (Verdict, State) {
    let used: u64 = live(limit, state, now_us).map(|s| s.hits).sum();
    let newest = live(limit, state, now_us).last().map(|s| s.at_us);
    if hits <= limit.requests && used <= limit.requests - hits {
        let mut log: VecDeque<Stamp> = live(limit, state, now_us).copied().collect();
        if hits > 0 {
            match log.back_mut() {
                Some(last) if last.at_us == now_us => last.hits += hits,
                _ => log.push_back(Stamp {
                    at_us: now_us,
                    hits,
                }),
            }
        }
        let reset_after_us = log.back().map_or(0, |s| s.at_us + limit.period_us - now_us);
        let verdict = Verdict {
            allowed: true,
            remaining: limit.requests - used - hits,
            reset_after_us,
            retry_after_us: 0,
        };
        return (verdict, State::Log(log));
    }
    let reset_after_us = newest.map_or(0, |t| t + limit.period_us - now_us);
    let retry_after_us = if hits > limit.requests {
        limit.period_us
    } else {
        // The oldest stamps leave first; find the one whose leaving makes room.
        let mut still = used;
        let mut at = reset_after_us;
        for s in live(limit, state, now_us) {
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
    (verdict, state.clone())
}

pub(super) fn refund(limit: &Limit, state: &State, now_us: u64, hits: u64) -> State {
    let mut log: VecDeque<Stamp> = live(limit, state, now_us).copied().collect();
    let mut left = hits;
    // The newest hits go back first: they would have stayed longest.
    while left > 0 {
        let Some(last) = log.back_mut() else { break };
        let take = left.min(last.hits);
        last.hits -= take;
        left -= take;
        if last.hits == 0 {
            log.pop_back();
        }
    }
    State::Log(log)
}
