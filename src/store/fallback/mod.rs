//! The failure policy layer: when the backend cannot answer (`StoreError::is_backend_down`:
//! a timeout, an error, an open circuit), each check is decided by its rule's `failure_mode`
//! (or the default): `allow` (OK), `deny` (OVER_LIMIT), `local` (this node's own memory store
//! decides) or `error` (the call fails with UNAVAILABLE and Envoy's `failure_mode_deny`
//! decides).
//!
//! **`local` keeps one limit for the fleet, not one per node.** While Redis answers, every node
//! beats in a set there (`redis::FleetBeat`) and learns how many nodes are live ([`FleetShare`]);
//! when Redis is lost, each node enforces its share of every limit over the nodes it last saw,
//! rounded up: of what the window had left as this node last heard from Redis ([`LastSeen`]),
//! or of the whole limit for a window it has not seen (a new one, or a bucket's room). So N
//! nodes admit at most `limit + N - 1` over a window that Redis is lost in, counting what was
//! admitted in Redis before the outage, where each enforcing the whole limit would admit
//! `N × limit` on top of it.
//!
//! It decides the request's own checks, whatever the layers inside it were doing (a lease, a
//! refund): it sits outside them.

mod last_seen;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub use last_seen::LastSeen;

use super::{Check, CheckKind, DecidedBy, FailureMode, MemoryStore, Outcome, Store, StoreError};
use crate::limiter::{Limit, Verdict};

/// Retry-After for checks denied by the `deny` policy: the backend's state is unknown.
pub const POLICY_RETRY_US: u64 = 1_000_000;

/// How many nodes share the limits (the fleet last seen live; 1 when alone or unknown).
#[derive(Debug)]
pub struct FleetShare(AtomicU64);

impl Default for FleetShare {
    fn default() -> Self {
        Self(AtomicU64::new(1))
    }
}

impl FleetShare {
    pub fn nodes(&self) -> u64 {
        self.0.load(Ordering::Relaxed).max(1)
    }

    pub fn set(&self, nodes: u64) {
        self.0.store(nodes.max(1), Ordering::Relaxed);
    }
}

/// One node's share of `limit` among `nodes`: its requests and burst divided, rounded up (a
/// limit of at least one stays at least one).
pub fn share_of(limit: &Limit, nodes: u64) -> Limit {
    if nodes <= 1 {
        return *limit;
    }
    Limit {
        requests: limit.requests.div_ceil(nodes),
        burst: limit.burst.div_ceil(nodes),
        ..*limit
    }
}

pub struct Fallback<S> {
    inner: S,
    /// The fleet `local` shares each limit with.
    fleet: Arc<FleetShare>,
    /// This node's own counters for `local`; the upkeep sweeps them.
    local: Arc<MemoryStore>,
    default_mode: FailureMode,
    decisions: Arc<PolicyDecisions>,
    /// What each `local` counter's window had left when the backend last answered; the upkeep
    /// sweeps it.
    last_seen: Arc<LastSeen>,
}

/// Requests the failure policy answered, shared with the upkeep's report.
#[derive(Debug, Default)]
pub struct PolicyDecisions(AtomicU64);

impl PolicyDecisions {
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl<S: Store> Fallback<S> {
    /// `local` also decides `local` checks when the backend is down; up to `max_seen` counters'
    /// last answers are kept for it.
    pub fn new(
        inner: S,
        local: Arc<MemoryStore>,
        default_mode: FailureMode,
        max_seen: usize,
    ) -> Self {
        Self {
            inner,
            fleet: Arc::default(),
            local,
            default_mode,
            decisions: Arc::default(),
            last_seen: Arc::new(LastSeen::new(max_seen)),
        }
    }

    /// What the counters had left as last seen, shared with the upkeep that sweeps it.
    pub fn last_seen(&self) -> Arc<LastSeen> {
        self.last_seen.clone()
    }

    fn mode_of(&self, c: &Check<'_>) -> FailureMode {
        c.on_failure.unwrap_or(self.default_mode)
    }

    /// The backend answered: what each `local` window counter has left, for an outage.
    fn learn(&self, checks: &[Check<'_>], outcome: &Outcome) {
        if outcome.decided_by.is_policy() {
            return;
        }
        let mut now = None;
        for (i, (c, v)) in checks.iter().zip(&outcome.verdicts).enumerate() {
            if self.mode_of(c) == FailureMode::Local {
                // The backend's time names the window it decided in, and saves a clock read a
                // call; a node's clock a little off then reads the view as another window's
                // near a boundary, which is no view at all (the whole share), as a stale one is.
                let at = match outcome.backend_now_us.get(i) {
                    Some(&t) if t != 0 => t,
                    _ => *now.get_or_insert_with(|| self.local.now()),
                };
                self.last_seen.learn(c, v.remaining, at);
            }
        }
    }

    /// This node's share of `c`'s limit among `nodes`: of what its window had left as last
    /// seen, else of the whole limit.
    fn share(&self, c: &Check<'_>, nodes: u64, now: u64) -> Limit {
        let share = share_of(c.limit, nodes);
        match self.last_seen.left(c, now) {
            Some(left) if left < c.limit.requests => Limit {
                requests: left.div_ceil(nodes),
                ..share
            },
            _ => share,
        }
    }

    /// The fleet size `local` divides limits by, shared with the upkeep that learns it.
    pub fn fleet(&self) -> Arc<FleetShare> {
        self.fleet.clone()
    }

    /// The count of requests the policy answered, for the upkeep.
    pub fn decisions(&self) -> Arc<PolicyDecisions> {
        self.decisions.clone()
    }

    /// Calls are still answered while the backend is down (false when the default is `error`).
    pub fn serves_without_backend(&self) -> bool {
        self.default_mode != FailureMode::Error
    }

    fn decide(&self, checks: &[Check<'_>], cause: StoreError) -> Result<Outcome, StoreError> {
        self.decisions.0.fetch_add(1, Ordering::Relaxed);
        let mode_of = |c: &Check<'_>| self.mode_of(c);
        if checks.iter().any(|c| mode_of(c) == FailureMode::Error) {
            return Err(cause);
        }
        let denied_by_policy = checks
            .iter()
            .any(|c| c.kind == CheckKind::Enforce && mode_of(c) == FailureMode::Deny);
        let local: Vec<(usize, Check<'_>)> = checks
            .iter()
            .enumerate()
            .filter(|(_, c)| mode_of(c) == FailureMode::Local)
            .map(|(i, c)| {
                // When the policy denies anyway, only look (hits 0): nothing may be consumed.
                let hits = if denied_by_policy && c.kind != CheckKind::Refund {
                    0
                } else {
                    c.hits
                };
                (i, Check { hits, ..*c })
            })
            .collect();
        let nodes = self.fleet.nodes();
        let now = self.local.now();
        let shares: Vec<Limit> = local
            .iter()
            .map(|(_, c)| self.share(c, nodes, now))
            .collect();
        let local_checks: Vec<Check<'_>> = local
            .iter()
            .zip(&shares)
            .map(|((_, c), limit)| Check { limit, ..*c })
            .collect();
        let local_outcome = if local_checks.is_empty() {
            Outcome {
                allowed: true,
                ..Outcome::default()
            }
        } else {
            self.local.apply_now(&local_checks)?
        };
        let mut verdicts: Vec<Verdict> = checks
            .iter()
            .map(|c| match mode_of(c) {
                FailureMode::Deny if c.kind != CheckKind::Refund => Verdict {
                    allowed: false,
                    remaining: 0,
                    reset_after_us: POLICY_RETRY_US,
                    retry_after_us: POLICY_RETRY_US,
                },
                _ => Verdict {
                    allowed: true,
                    remaining: c.limit.requests,
                    reset_after_us: 0,
                    retry_after_us: 0,
                },
            })
            .collect();
        for ((i, _), v) in local.iter().zip(local_outcome.verdicts) {
            verdicts[*i] = v;
        }
        let mode = if denied_by_policy {
            FailureMode::Deny
        } else if local.is_empty() {
            FailureMode::Allow
        } else {
            FailureMode::Local
        };
        Ok(Outcome {
            allowed: !denied_by_policy && local_outcome.allowed,
            verdicts,
            decided_by: DecidedBy::Policy(mode),
            backend_now_us: Vec::new(),
        })
    }
}

impl<S: Store> Store for Fallback<S> {
    async fn apply(&self, checks: &[Check<'_>]) -> Result<Outcome, StoreError> {
        match self.inner.apply(checks).await {
            Ok(outcome) => {
                self.learn(checks, &outcome);
                Ok(outcome)
            }
            Err(e) if e.is_backend_down() => self.decide(checks, e),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::limiter::{Algorithm, Limit};
    use std::time::Duration;

    /// A backend that is always down.
    struct Down;

    impl Store for Down {
        async fn apply(&self, _: &[Check<'_>]) -> Result<Outcome, StoreError> {
            Err(StoreError::Timeout(Duration::from_millis(10)))
        }
    }

    proptest::proptest! {
        /// The shares of a limit over N nodes add up to the limit plus at most N − 1, and no
        /// share of a non-zero limit is zero, over the whole range.
        #[test]
        fn shares_add_up_to_the_limit_and_rounding(
            requests in 0u64..=u64::MAX / 2,
            nodes in 1u64..=10_000,
        ) {
            let limit = Limit::new(Algorithm::FixedWindow, requests, 3_600_000_000, None).unwrap();
            let share = share_of(&limit, nodes);
            let total = u128::from(share.requests) * u128::from(nodes);
            proptest::prop_assert!(total >= u128::from(requests));
            proptest::prop_assert!(total < u128::from(requests) + u128::from(nodes));
            proptest::prop_assert!(requests == 0 || share.requests >= 1);
            proptest::prop_assert_eq!(share.burst, share.requests);
        }
    }

    fn fallback(mode: FailureMode) -> Fallback<Down> {
        let clock = Arc::new(ManualClock::new(1_000_000_000));
        Fallback::new(Down, Arc::new(MemoryStore::new(clock, 100)), mode, 100)
    }

    fn check(limit: &Limit, on_failure: Option<FailureMode>) -> Check<'_> {
        Check {
            on_failure,
            ..Check::enforce(b"k", limit, 1)
        }
    }

    #[tokio::test]
    async fn each_mode_answers_as_documented() {
        let limit = Limit::new(Algorithm::FixedWindow, 2, 60_000_000, None).unwrap();
        let r = fallback(FailureMode::Local);
        for i in 0..5 {
            let out = r.apply(&[check(&limit, None)]).await.unwrap();
            assert_eq!(out.allowed, i < 2, "local limits alone, call {i}");
            assert!(out.decided_by.is_policy());
        }
        assert_eq!(r.decisions().get(), 5);
        let r = fallback(FailureMode::Allow);
        assert!(r.apply(&[check(&limit, None)]).await.unwrap().allowed);
        let r = fallback(FailureMode::Deny);
        let out = r.apply(&[check(&limit, None)]).await.unwrap();
        assert!(!out.allowed);
        assert_eq!(out.verdicts[0].retry_after_us, POLICY_RETRY_US);
        let r = fallback(FailureMode::Error);
        assert!(matches!(
            r.apply(&[check(&limit, None)]).await,
            Err(StoreError::Timeout(_))
        ));
        assert!(!r.serves_without_backend());
        // A rule's own mode wins over the default.
        assert!(
            r.apply(&[check(&limit, Some(FailureMode::Allow))])
                .await
                .unwrap()
                .allowed
        );
    }

    #[tokio::test]
    async fn a_policy_denial_consumes_nothing_locally() {
        let limit = Limit::new(Algorithm::FixedWindow, 1, 60_000_000, None).unwrap();
        let r = fallback(FailureMode::Local);
        let denied = r
            .apply(&[
                check(&limit, None),
                Check {
                    key: b"d",
                    ..check(&limit, Some(FailureMode::Deny))
                },
            ])
            .await
            .unwrap();
        assert!(!denied.allowed);
        assert!(
            r.apply(&[check(&limit, None)]).await.unwrap().allowed,
            "k was not consumed"
        );
    }
}
