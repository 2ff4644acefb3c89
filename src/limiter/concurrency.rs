//! Concurrency: at most `requests` requests in flight at once. Each request holds a *slot*,
//! named by its request (a number the engine derives from the request's id, see
//! `counter::slot_id`), from the call that acquires it (positive hits) until the call that releases
//! it (a refund of the same slot, `is_negative_hits`), or until `period_us` (the rule's
//! `max_hold`) has passed since it was acquired, whichever comes first.
//!
//! Why a slot per request rather than a count: what can go wrong between the two calls — a
//! retried RLS call, a release of a request that was denied, a release that never comes
//! because the proxy crashed — would leave a count wrong for good. A set of named slots makes
//! each of them harmless: acquiring a slot held already keeps one slot, releasing a slot not
//! held changes nothing, and a slot nobody releases expires.
//!
//! The state is the slots held, oldest expiry first. Expired slots count for nothing; a
//! decision that writes drops them.

use super::{Limit, Slot, State, Update, Verdict};

const NO_SLOTS: &[Slot] = &[];

fn slots(state: &State) -> &[Slot] {
    match state {
        State::Slots { held } => held,
        _ => NO_SLOTS,
    }
}

/// The slots still held at `now_us`, oldest expiry first.
fn live(held: &[Slot], now_us: u64) -> impl Iterator<Item = &Slot> {
    held.iter().filter(move |s| s.until_us > now_us)
}

/// The state with the expired slots dropped, `slot` added until `until_us` (if given) and
/// `release`d (if given), ordered by expiry, then by slot.
fn rewritten(held: &[Slot], now_us: u64, add: Option<Slot>, release: Option<u64>) -> State {
    let mut next: Vec<Slot> = live(held, now_us)
        .filter(|s| Some(s.id) != release)
        .copied()
        .chain(add)
        .collect();
    next.sort_unstable_by_key(|s| (s.until_us, s.id));
    if next.is_empty() {
        State::Empty
    } else {
        State::Slots {
            held: Box::new(next),
        }
    }
}

pub(super) fn decide(
    limit: &Limit,
    state: &State,
    now_us: u64,
    hits: u64,
    slot: u64,
) -> (Verdict, Update) {
    let held = slots(state);
    let in_flight = live(held, now_us).count() as u64;
    let oldest = live(held, now_us).map(|s| s.until_us).min();
    let free = limit.requests.saturating_sub(in_flight);
    let until_oldest = oldest.map_or(0, |t| t - now_us);
    let look = Verdict {
        allowed: true,
        remaining: free,
        reset_after_us: until_oldest,
        retry_after_us: 0,
    };
    if hits == 0 {
        return (look, Update::Keep);
    }
    if let Some(own) = live(held, now_us).find(|s| s.id == slot) {
        // The request holds its slot already (a retried call): one slot, kept as it was. It is
        // rewritten as it is (the expired ones dropped), so it counts as this call's like any
        // acquisition: a batch denied after all reports it unconsumed, on every store alike,
        // and a rollback does not release it (it does not expire when this call's would).
        let own = *own;
        return (
            look,
            Update::Set(rewritten(held, now_us, Some(own), Some(own.id))),
        );
    }
    if free > 0 {
        let until_us = now_us + limit.period_us;
        let verdict = Verdict {
            allowed: true,
            remaining: free - 1,
            reset_after_us: oldest.map_or(limit.period_us, |t| t.min(until_us) - now_us),
            retry_after_us: 0,
        };
        let taken = Slot { id: slot, until_us };
        let update = Update::Set(rewritten(held, now_us, Some(taken), None));
        return (verdict, update);
    }
    // Full: the request may go once the oldest slot expires (or any is released before).
    let verdict = Verdict {
        allowed: false,
        remaining: 0,
        reset_after_us: until_oldest,
        retry_after_us: until_oldest,
    };
    (verdict, Update::Keep)
}

/// Releases `slot` (any hits: a slot is one request's; 0 hits only looks); a slot not held
/// changes nothing. With `only_until` (0: any), only the slot that expires then: the one a call
/// acquired, which a rollback undoes.
pub(super) fn refund(state: &State, now_us: u64, hits: u64, slot: u64, only_until: u64) -> State {
    let held = slots(state);
    if held.is_empty() {
        return State::Empty;
    }
    let release = (hits > 0
        && held
            .iter()
            .any(|s| s.id == slot && (only_until == 0 || s.until_us == only_until)))
    .then_some(slot);
    rewritten(held, now_us, None, release)
}
