//! The lease table: what each counter's lease holds, how big the next one is, and what goes
//! back. No I/O: the layer calls the backend and tells the table what it answered.

use std::sync::Arc;
use std::time::Duration;

use super::LeaseOptions;
use crate::clock::Clock;
use crate::limiter::{Limit, Verdict};
use crate::store::sharded::{SHARDS, Sharded};
use crate::store::{Check, CheckKind, Mode, Outcome};

/// A lease never takes more than 1/SHARE_DIVISOR of what the backend has left.
const SHARE_DIVISOR: u64 = 4;
/// A lease sized past `target` (up to its ttl's traffic) takes at most 1/ROOM_DIVISOR of what
/// the backend has left.
const ROOM_DIVISOR: u64 = 64;
/// Rates are measured over at least this long, so two requests arriving together do not look
/// like a flood.
const MIN_RATE_SPAN_US: u64 = 10_000;
/// The first lease of a counter, and the floor of the doubling that sizes the next ones.
const FIRST_LEASE: u64 = 4;

#[derive(Debug, Clone)]
struct Lease {
    limit: Limit,
    tag: Box<[u8]>,
    /// Hits this node holds and may admit locally.
    left: u64,
    /// Local clock: `left` may be admitted until then.
    use_until_us: u64,
    /// Backend clock: the end of the window `left` was charged to (the refund's guard).
    window_end_us: u64,
    /// Local clock: by then that window has certainly ended (the answer's arrival plus what
    /// was left of the window when Redis decided), and a leftover is not worth a refund: Redis
    /// would drop it.
    window_over_us: u64,
    /// What the backend had left after the last call, not counting `left`.
    backend_remaining: u64,
    /// Local clock: when the limit is fully replenished, as the backend last said.
    reset_at_us: u64,
    /// Local clock: the last backend call for this counter.
    last_call_us: u64,
    /// Hits admitted on this node since `last_call_us` (the rate estimate).
    used_since_call: u64,
    /// The size of the last lease (the next is at most double).
    last_grant: u64,
}

impl Lease {
    /// Whether this lease may admit `c` now: its limit, live, with `c`'s hits left.
    fn holds(&self, c: &Check<'_>, now: u64) -> bool {
        self.limit == *c.limit && now < self.use_until_us && self.left >= c.hits
    }

    /// The leftover, unless there is none or its window is surely over (Redis would drop it).
    fn leftover_to_give(&self, now: u64) -> Option<u64> {
        (self.left > 0 && now < self.window_over_us).then_some(self.left)
    }
}

/// A lease's unused hits, to give back to the window they were charged to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Leftover {
    pub hits: u64,
    /// The limit they were taken under.
    pub limit: Limit,
    /// The refund's guard: the end of their window on the backend's clock.
    pub until_us: u64,
}

impl Leftover {
    /// The refund of these hits to `key`'s counter (slot `tag`).
    pub fn refund<'a>(&'a self, key: &'a [u8], tag: &'a [u8]) -> Check<'a> {
        Check {
            key,
            tag,
            limit: &self.limit,
            hits: self.hits,
            kind: CheckKind::Refund,
            on_failure: None,
            mode: None,
            until_us: self.until_us,
            slot: 0,
        }
    }
}

/// One counter's part in a backend call: extra hits asked for a lease, and the old lease's
/// leftover, given back in the same call.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ask {
    pub extra: u64,
    pub give_back: Option<Leftover>,
    /// The counter's live lease covers its check, and another check of the request is what
    /// sends it to the backend: the lease stays as it is (not given back, not renewed), and the
    /// check goes to the backend with its own hits, as a strict check would. Its hits are then
    /// counted once, there, not taken from the lease.
    pub kept: bool,
}

/// A leftover of a lease that ran out, with the counter it goes back to.
#[derive(Debug, Clone)]
pub struct Returned {
    pub key: Box<[u8]>,
    pub tag: Box<[u8]>,
    pub leftover: Leftover,
}

impl Returned {
    pub fn check(&self) -> Check<'_> {
        self.leftover.refund(&self.key, &self.tag)
    }
}

pub struct LeaseTable {
    entries: Sharded<Lease>,
    max_per_shard: usize,
    options: LeaseOptions,
    clock: Arc<dyn Clock>,
}

impl LeaseTable {
    pub fn new(options: LeaseOptions, clock: Arc<dyn Clock>) -> Self {
        Self {
            entries: Sharded::new(),
            max_per_shard: options.max_entries.div_ceil(SHARDS),
            options,
            clock,
        }
    }

    pub fn now(&self) -> u64 {
        self.clock.now_micros()
    }

    pub fn options(&self) -> &LeaseOptions {
        &self.options
    }

    /// Whether this check may be decided from a lease.
    pub fn is_hybrid(&self, c: &Check<'_>) -> bool {
        c.kind == CheckKind::Enforce
            && !c.limit.overdraft
            && c.mode.unwrap_or(self.options.default_mode) == Mode::Hybrid
            && c.limit.algorithm.leasable()
            && c.limit.requests > 0
    }

    /// Whether `c` is hybrid and its counter's live lease holds its hits (as
    /// `decide_locally` would take them).
    fn covers(&self, c: &Check<'_>, now: u64) -> bool {
        self.is_hybrid(c)
            && self
                .entries
                .lock(c.key)
                .get(c.key)
                .is_some_and(|l| l.left > 0 && l.holds(c, now))
    }

    /// Hits held in leases now (metrics, tests).
    pub fn held(&self) -> u64 {
        let mut held = 0u64;
        self.entries
            .for_each_shard(|m| held = m.values().fold(held, |h, l| h.saturating_add(l.left)));
        held
    }

    /// What this node holds in a lease of the counter `key` (`GET /counters`); None without one.
    pub fn held_for(&self, key: &[u8]) -> Option<u64> {
        self.entries.lock(key).get(key).map(|l| l.left)
    }

    /// Decides the whole batch from leases, if every check is hybrid and its lease is live and
    /// holds enough; then the hits are taken from the leases. None: ask the backend.
    pub fn decide_locally(&self, checks: &[Check<'_>], now: u64) -> Option<Vec<Verdict>> {
        if !checks.iter().all(|c| self.is_hybrid(c)) {
            return None;
        }
        // Every shard of the batch at once, so the batch is all-or-nothing.
        let (mut guards, shard) = self.entries.lock_all(checks.iter().map(|c| c.key));
        let fits = checks
            .iter()
            .zip(&shard)
            .all(|(c, &s)| guards[s].get(c.key).is_some_and(|l| l.holds(c, now)));
        if !fits {
            return None;
        }
        let verdicts = checks
            .iter()
            .zip(&shard)
            .map(|(c, &s)| {
                let l = guards[s].get_mut(c.key).expect("checked above");
                l.left -= c.hits;
                l.used_since_call += c.hits;
                Verdict {
                    allowed: true,
                    remaining: l.backend_remaining.saturating_add(l.left),
                    reset_after_us: l.reset_at_us.saturating_sub(now),
                    retry_after_us: 0,
                }
            })
            .collect();
        Some(verdicts)
    }

    /// What to ask the backend for each check: a lease sized from the node's recent rate, and
    /// the current lease's leftover back (it is replaced by the new one).
    ///
    /// A lease that covers its own check stays while another check of the request is what
    /// sends it to the backend (see [`Ask::kept`]). Replaced instead, a counter every request
    /// shares (a tenant's tier) lost its lease whenever any request's other counter renewed:
    /// the requests in flight then missed it too and went to the backend, replacing it again,
    /// and a two-tier load was decided mostly in Redis (BENCHMARKS.md).
    pub fn plan(&self, checks: &[Check<'_>], now: u64) -> Vec<Ask> {
        let covered: Vec<bool> = checks.iter().map(|c| self.covers(c, now)).collect();
        let keep_covered = covered.iter().any(|&covered| !covered);
        checks
            .iter()
            .zip(covered)
            .map(|(c, covered)| {
                if !self.is_hybrid(c) {
                    return Ask::default();
                }
                if covered && keep_covered {
                    return Ask {
                        kept: true,
                        ..Ask::default()
                    };
                }
                let mut entries = self.entries.lock(c.key);
                let Some(l) = entries.get_mut(c.key) else {
                    return Ask::default();
                };
                let give_back = l.leftover_to_give(now).map(|hits| Leftover {
                    hits,
                    limit: l.limit,
                    until_us: l.window_end_us,
                });
                l.left = 0;
                if l.limit != *c.limit {
                    // The rules changed: the old lease goes back and no rate is known yet.
                    return Ask {
                        extra: 0,
                        give_back,
                        kept: false,
                    };
                }
                let span = now.saturating_sub(l.last_call_us).max(MIN_RATE_SPAN_US);
                let used = l.used_since_call.saturating_add(c.hits);
                let traffic_in = |d: Duration| {
                    let hits = u128::from(used) * d.as_micros() / u128::from(span);
                    u64::try_from(hits).unwrap_or(u64::MAX)
                };
                let by_rate = traffic_in(self.options.target);
                // Where the room left dwarfs it, a lease covers the traffic of its whole life
                // (ttl), not just `target`: a counter with a few hits a second then gets a lease
                // of a few hits instead of none, and still parks under 1/ROOM_DIVISOR of the
                // room. Near the limit this floor shrinks away, and `by_share` rules.
                let by_room = traffic_in(self.options.ttl).min(l.backend_remaining / ROOM_DIVISOR);
                let by_growth = l.last_grant.saturating_mul(2).max(FIRST_LEASE);
                let by_share = l.backend_remaining.saturating_sub(c.hits) / SHARE_DIVISOR;
                Ask {
                    extra: by_rate.max(by_room).min(by_growth).min(by_share),
                    give_back,
                    kept: false,
                }
            })
            .collect()
    }

    /// Learns from the backend's answer to a batch sent at `sent_at` with `asks`: an allowed
    /// batch grants every extra asked, and each hybrid counter's view of the backend is updated.
    /// Returns, per check, the hits this node holds in the counter's live lease afterwards: a
    /// status counts them as remaining.
    pub fn learn(
        &self,
        checks: &[Check<'_>],
        asks: &[Ask],
        outcome: &Outcome,
        sent_at: u64,
    ) -> Vec<u64> {
        let mut held = vec![0; checks.len()];
        // Redis decided before the answer arrived: no earlier than `sent_at`, no later than now.
        let received_at = self.now();
        for (i, c) in checks.iter().enumerate() {
            if !self.is_hybrid(c) {
                continue;
            }
            let Some(&backend_now) = outcome.backend_now_us.get(i) else {
                continue;
            };
            let mut entries = self.entries.lock(c.key);
            if !entries.contains_key(c.key) && entries.len() >= self.max_per_shard {
                // Full: this counter stays strict until the sweep forgets idle ones (a scan
                // here would cost every new counter the whole table).
                continue;
            }
            let v = &outcome.verdicts[i];
            let kept = asks.get(i).is_some_and(|a| a.kept);
            let l = if kept {
                // The lease stayed: only the backend's view is new, and the check's hits, if
                // admitted, are this node's traffic for the counter too.
                let Some(l) = entries.get_mut(c.key).filter(|l| l.limit == *c.limit) else {
                    continue;
                };
                if outcome.allowed {
                    l.used_since_call = l.used_since_call.saturating_add(c.hits);
                }
                l
            } else {
                let l = entries.entry(c.key.into()).or_insert_with(|| Lease {
                    limit: *c.limit,
                    tag: c.tag.into(),
                    left: 0,
                    use_until_us: 0,
                    window_end_us: 0,
                    window_over_us: 0,
                    backend_remaining: 0,
                    reset_at_us: 0,
                    last_call_us: sent_at,
                    used_since_call: 0,
                    last_grant: 0,
                });
                l.limit = *c.limit;
                l.last_call_us = sent_at;
                l.used_since_call = 0;
                l
            };
            l.reset_at_us = sent_at + v.reset_after_us;
            l.backend_remaining = v.remaining;
            let extra = asks.get(i).map_or(0, |a| a.extra);
            if outcome.allowed && extra > 0 {
                let (_, window_end) = c.limit.window_at(backend_now);
                // Measured from when the request was sent: Redis decided later, so this ends
                // no later than the window does.
                let to_end = window_end - backend_now;
                let use_until = sent_at + to_end.min(self.options.ttl.as_micros() as u64);
                let window_over = received_at + to_end;
                if l.left > 0 && l.window_end_us == window_end && sent_at < l.use_until_us {
                    // A concurrent call's lease of the same window: hold both, until the
                    // earlier deadline.
                    l.left += extra;
                    l.use_until_us = l.use_until_us.min(use_until);
                    l.window_over_us = l.window_over_us.min(window_over);
                } else {
                    // Any other leftover has run out (its window or its ttl ended): dropping it
                    // can only under-admit.
                    l.left = extra;
                    l.use_until_us = use_until;
                    l.window_over_us = window_over;
                }
                l.window_end_us = window_end;
                l.last_grant = extra;
                held[i] = l.left;
            } else {
                if !outcome.allowed && !kept {
                    l.last_grant = 0;
                }
                // A live lease this call did not replace (kept, by this call or by the one
                // before it when this is the request sent again alone): its held hits count as
                // remaining.
                if l.left > 0 && received_at < l.use_until_us {
                    held[i] = l.left;
                }
            }
        }
        held
    }

    /// A refund of a counter this node holds a live lease on takes the lease back first, in the
    /// same check: the backend counts admitted + held, and a refund larger than what was
    /// admitted would otherwise eat into the held hits there, leaving this node hits to admit
    /// that no counter holds (over-admission across the fleet). Merged, the backend saturates
    /// at zero exactly as one counter of admitted hits would. Within the lease's life the
    /// window is still the one it was charged to, so no guard is needed. None: no change.
    pub fn absorb_into_refunds<'c>(&self, checks: &[Check<'c>]) -> Option<Vec<Check<'c>>> {
        if !checks.iter().any(|c| c.kind == CheckKind::Refund) {
            return None;
        }
        let now = self.now();
        let mut changed = None;
        for (i, c) in checks.iter().enumerate() {
            if c.kind != CheckKind::Refund {
                continue;
            }
            let mut entries = self.entries.lock(c.key);
            let Some(l) = entries.get_mut(c.key) else {
                continue;
            };
            if l.left == 0 || l.limit != *c.limit || now >= l.use_until_us {
                continue;
            }
            let out = changed.get_or_insert_with(|| checks.to_vec());
            out[i].hits = c.hits.saturating_add(l.left);
            l.left = 0;
        }
        changed
    }

    /// Learns what refunds left in the backend: a refund is never decided from a lease, but it
    /// changes the counter a lease reports from. (A live lease on the counter was absorbed into
    /// the refund; one past its deadline is not this node's to count.)
    pub fn learn_refunds(&self, checks: &[Check<'_>], outcome: &Outcome) {
        if outcome.decided_by.is_policy() {
            return;
        }
        for (c, v) in checks.iter().zip(&outcome.verdicts) {
            if c.kind != CheckKind::Refund {
                continue;
            }
            if let Some(l) = self.entries.lock(c.key).get_mut(c.key)
                && l.limit == *c.limit
            {
                l.backend_remaining = v.remaining;
            }
        }
    }

    fn stale_after(&self) -> u64 {
        10 * self.options.ttl.as_micros() as u64
    }

    /// Takes the leftovers of leases that ran out (or of every lease, when the node stops), to
    /// be refunded; forgets counters not used for a while.
    pub fn take_leftovers(&self, all: bool) -> Vec<Returned> {
        let now = self.now();
        let stale = self.stale_after();
        let mut out = Vec::new();
        self.entries.for_each_shard(|entries| {
            entries.retain(|key, l| {
                if l.left > 0 && (all || now >= l.use_until_us) {
                    if let Some(hits) = l.leftover_to_give(now) {
                        out.push(Returned {
                            key: key.clone(),
                            tag: l.tag.clone(),
                            leftover: Leftover {
                                hits,
                                limit: l.limit,
                                until_us: l.window_end_us,
                            },
                        });
                    }
                    l.left = 0;
                }
                l.left > 0 || now < l.last_call_us.saturating_add(stale)
            })
        });
        out
    }

    /// Counters with lease state.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::limiter::Algorithm;
    use crate::store::DecidedBy;

    const S: u64 = 1_000_000;

    fn table(clock: &Arc<ManualClock>) -> LeaseTable {
        table_with(clock, LeaseOptions::default())
    }

    /// A table where every rule is hybrid.
    fn table_with(clock: &Arc<ManualClock>, options: LeaseOptions) -> LeaseTable {
        LeaseTable::new(
            LeaseOptions {
                default_mode: Mode::Hybrid,
                ..options
            },
            clock.clone(),
        )
    }

    fn check(limit: &Limit) -> Check<'_> {
        Check::enforce(b"k", limit, 1)
    }

    fn answer(allowed: bool, remaining: u64, backend_now: u64) -> Outcome {
        answer_of(allowed, &[remaining], backend_now)
    }

    /// The backend's answer to a batch: `allowed`, each check's remaining, one time.
    fn answer_of(allowed: bool, remaining: &[u64], backend_now: u64) -> Outcome {
        Outcome {
            allowed,
            verdicts: remaining
                .iter()
                .map(|&remaining| Verdict {
                    allowed,
                    remaining,
                    reset_after_us: S,
                    retry_after_us: 0,
                })
                .collect(),
            decided_by: DecidedBy::Counters,
            backend_now_us: vec![backend_now; remaining.len()],
        }
    }

    #[test]
    fn only_window_algorithms_lease() {
        let clock = Arc::new(ManualClock::new(100 * S));
        let t = table(&clock);
        for alg in Algorithm::ALL {
            let limit = Limit::new(alg, 10, S, None).unwrap();
            let hybrid = t.is_hybrid(&check(&limit));
            assert_eq!(
                hybrid,
                matches!(alg, Algorithm::FixedWindow | Algorithm::SlidingWindow),
                "{alg}"
            );
            let strict = Check {
                mode: Some(Mode::Strict),
                ..check(&limit)
            };
            assert!(!t.is_hybrid(&strict), "a rule's own mode wins");
        }
    }

    #[test]
    fn a_slow_counter_far_from_its_limit_leases_what_it_uses_in_a_ttl() {
        let clock = Arc::new(ManualClock::new(100 * S));
        let t = table_with(
            &clock,
            LeaseOptions {
                ttl: Duration::from_millis(500),
                ..LeaseOptions::default()
            },
        );
        let limit = Limit::new(Algorithm::FixedWindow, 1_000_000, 60 * S, None).unwrap();
        let c = check(&limit);
        let asks = t.plan(&[c], clock.now_micros());
        t.learn(
            &[c],
            &asks,
            &answer(true, 999_999, 100 * S),
            clock.now_micros(),
        );
        // One request every 200 ms: `target` (100 ms) of it is half a hit, no lease; the ttl
        // (500 ms) of it is 2.5 hits, far under 1/64 of the room.
        clock.advance(200_000);
        let asks = t.plan(&[c], clock.now_micros());
        assert_eq!(asks[0].extra, 2);
        t.learn(&[c], &asks, &answer(true, 100, 100 * S), clock.now_micros());
        // 100 left: the floor is 100 / 64 = 1.
        clock.advance(200_000);
        let asks = t.plan(&[c], clock.now_micros());
        assert_eq!(asks[0].extra, 1);
        t.learn(&[c], &asks, &answer(true, 50, 100 * S), clock.now_micros());
        // 50 left: no floor, and 100 ms of traffic is under a hit: strict.
        clock.advance(200_000);
        let asks = t.plan(&[c], clock.now_micros());
        assert_eq!(asks[0].extra, 0);
    }

    #[test]
    fn a_lease_grows_with_the_rate_and_stays_a_quarter_of_what_remains() {
        let clock = Arc::new(ManualClock::new(100 * S));
        let t = table(&clock);
        let limit = Limit::new(Algorithm::FixedWindow, 1_000_000, 60 * S, None).unwrap();
        let c = check(&limit);
        // First sight: no rate known, no lease.
        let asks = t.plan(&[c], clock.now_micros());
        assert_eq!(asks[0].extra, 0);
        t.learn(&[c], &asks, &answer(true, 999_999, 100 * S), 100 * S);
        // 1 request per ms: 100 ms is 100 hits, but a lease at most doubles (from 4).
        clock.advance(1_000);
        let asks = t.plan(&[c], clock.now_micros());
        assert_eq!(asks[0].extra, FIRST_LEASE);
        let held = t.learn(
            &[c],
            &asks,
            &answer(true, 999_000, 100 * S),
            clock.now_micros(),
        );
        assert_eq!(held, [FIRST_LEASE], "the lease's hits are held here");
        for _ in 0..FIRST_LEASE {
            assert!(t.decide_locally(&[c], clock.now_micros()).is_some());
        }
        assert!(
            t.decide_locally(&[c], clock.now_micros()).is_none(),
            "spent"
        );
        // Near the limit: a quarter of what remains.
        let asks = t.plan(&[c], clock.now_micros() + 1_000);
        t.learn(&[c], &asks, &answer(true, 9, 100 * S), clock.now_micros());
        let asks = t.plan(&[c], clock.now_micros() + 1_000);
        assert_eq!(asks[0].extra, 2, "(9 - 1) / 4");
        t.learn(&[c], &asks, &answer(true, 3, 100 * S), clock.now_micros());
        let asks = t.plan(&[c], clock.now_micros() + 1_000);
        assert_eq!(asks[0].extra, 0, "strict near the limit");
        assert_eq!(
            asks[0].give_back.map(|g| g.hits),
            Some(2),
            "the old lease goes back"
        );
    }

    #[test]
    fn a_lease_that_covers_its_check_stays_while_another_check_goes_to_the_backend() {
        let clock = Arc::new(ManualClock::new(100 * S));
        let t = table(&clock);
        let limit = Limit::new(Algorithm::FixedWindow, 1_000_000, 60 * S, None).unwrap();
        let shared = Check::enforce(b"tenant", &limit, 1);
        let own = Check::enforce(b"client", &limit, 1);
        // The shared counter gets a lease of FIRST_LEASE.
        let asks = t.plan(&[shared], clock.now_micros());
        t.learn(&[shared], &asks, &answer(true, 999_999, 100 * S), 100 * S);
        clock.advance(1_000);
        let asks = t.plan(&[shared], clock.now_micros());
        assert_eq!(asks[0].extra, FIRST_LEASE);
        t.learn(
            &[shared],
            &asks,
            &answer(true, 999_000, 100 * S),
            clock.now_micros(),
        );
        assert_eq!(t.held(), FIRST_LEASE);
        // A request of both: the other counter has no lease, so it goes to the backend; the
        // shared counter's lease stays and its check goes as it is.
        let both = [own, shared];
        assert!(t.decide_locally(&both, clock.now_micros()).is_none());
        let asks = t.plan(&both, clock.now_micros());
        assert!(!asks[0].kept);
        assert!(asks[1].kept);
        assert_eq!((asks[1].extra, asks[1].give_back.is_none()), (0, true));
        assert_eq!(t.held(), FIRST_LEASE, "not given back");
        let answered = answer_of(true, &[999_999, 998_999], 100 * S);
        let held = t.learn(&both, &asks, &answered, clock.now_micros());
        assert_eq!(
            held,
            [0, FIRST_LEASE],
            "the kept lease's hits are still held"
        );
        // The lease still admits on its own, all of it.
        for _ in 0..FIRST_LEASE {
            assert!(t.decide_locally(&[shared], clock.now_micros()).is_some());
        }
        assert!(t.decide_locally(&[shared], clock.now_micros()).is_none());
        // A request the lease alone does not cover replaces it as before.
        let asks = t.plan(&[shared], clock.now_micros());
        assert!(!asks[0].kept);
    }

    #[test]
    fn a_lease_ends_with_its_window_measured_from_the_send_time() {
        let clock = Arc::new(ManualClock::new(100 * S));
        let t = table(&clock);
        let limit = Limit::new(Algorithm::FixedWindow, 1_000, S, None).unwrap();
        let c = check(&limit);
        let asks = t.plan(&[c], clock.now_micros());
        t.learn(&[c], &asks, &answer(true, 900, 100 * S), clock.now_micros());
        clock.advance(1_000);
        let asks = t.plan(&[c], clock.now_micros());
        assert!(asks[0].extra > 0);
        let sent = clock.now_micros();
        // Redis decided 0.95 s into its window, somewhere in a 2 ms round trip: 50 ms are
        // left of it.
        clock.advance(2_000);
        t.learn(&[c], &asks, &answer(true, 800, 200 * S + 950_000), sent);
        clock.set(sent + 49_999);
        assert!(t.decide_locally(&[c], clock.now_micros()).is_some());
        clock.set(sent + 50_000);
        assert!(t.decide_locally(&[c], clock.now_micros()).is_none());
        let back = t.take_leftovers(false);
        assert_eq!(back.len(), 1);
        assert_eq!(
            back[0].leftover.until_us,
            201 * S,
            "refund only into the window it came from"
        );
        assert_eq!(back[0].leftover.hits, asks[0].extra - 1);
        assert!(t.take_leftovers(true).is_empty(), "taken once");
    }

    #[test]
    fn a_leftover_of_a_window_surely_over_is_not_given_back() {
        let clock = Arc::new(ManualClock::new(100 * S));
        let t = table(&clock);
        let limit = Limit::new(Algorithm::FixedWindow, 1_000, S, None).unwrap();
        let c = check(&limit);
        let lease = |t: &LeaseTable| {
            let asks = t.plan(&[c], clock.now_micros());
            let sent = clock.now_micros();
            // Redis decides 0.9 s into its window; the answer takes 2 ms to arrive.
            clock.advance(2_000);
            t.learn(&[c], &asks, &answer(true, 900, 200 * S + 900_000), sent);
            (sent, asks)
        };
        lease(&t);
        clock.advance(1_000);
        let (sent, asks) = lease(&t);
        assert!(asks[0].extra > 0);
        // Its use ended at sent + 100 ms; the window surely at received + 100 ms.
        clock.set(sent + 101_000);
        assert_eq!(t.take_leftovers(false).len(), 1, "it may still count");
        let (sent, _) = lease(&t);
        clock.set(sent + 102_000);
        assert!(t.take_leftovers(false).is_empty(), "Redis would drop it");
        let (sent, _) = lease(&t);
        clock.set(sent + 102_000);
        let asks = t.plan(&[c], clock.now_micros());
        assert!(asks[0].give_back.is_none(), "nor with the next lease");
        assert!(t.take_leftovers(true).is_empty(), "and it is gone");
    }

    #[test]
    fn a_changed_limit_returns_the_lease() {
        let clock = Arc::new(ManualClock::new(100 * S));
        let t = table(&clock);
        let old = Limit::new(Algorithm::FixedWindow, 1_000, 60 * S, None).unwrap();
        let new = Limit::new(Algorithm::FixedWindow, 10, 60 * S, None).unwrap();
        let asks = t.plan(&[check(&old)], clock.now_micros());
        t.learn(&[check(&old)], &asks, &answer(true, 999, 100 * S), 100 * S);
        clock.advance(1_000);
        let asks = t.plan(&[check(&old)], clock.now_micros());
        t.learn(
            &[check(&old)],
            &asks,
            &answer(true, 990, 100 * S),
            clock.now_micros(),
        );
        assert!(
            t.decide_locally(&[check(&new)], clock.now_micros())
                .is_none()
        );
        let asks = t.plan(&[check(&new)], clock.now_micros());
        assert_eq!(asks[0].extra, 0);
        assert_eq!(asks[0].give_back.map(|g| g.limit), Some(old));
    }

    #[test]
    fn a_full_table_leaves_new_counters_strict_until_idle_ones_are_forgotten() {
        let clock = Arc::new(ManualClock::new(100 * S));
        let t = table_with(
            &clock,
            LeaseOptions {
                max_entries: 1,
                ..LeaseOptions::default()
            },
        );
        let limit = Limit::new(Algorithm::FixedWindow, 1_000, 60 * S, None).unwrap();
        // The bound is per shard (rounded up): at most one counter in each.
        let keys: Vec<Vec<u8>> = (0..1_000u32).map(|i| i.to_be_bytes().to_vec()).collect();
        for key in &keys {
            let c = Check {
                key,
                ..check(&limit)
            };
            t.learn(
                &[c],
                &[Ask::default()],
                &answer(true, 999, 100 * S),
                100 * S,
            );
        }
        assert!(t.len() <= SHARDS, "bounded: {}", t.len());
        clock.advance(10 * t.options().ttl.as_micros() as u64);
        assert!(t.take_leftovers(false).is_empty());
        assert_eq!(t.len(), 0, "idle counters are forgotten");
    }
}
