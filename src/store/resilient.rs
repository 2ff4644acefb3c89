//! The failure policy around a remote store: when it is unreachable, erroring, slower than its
//! timeout, or its circuit is open, each check is decided by its rule's `failure_mode` (or the
//! default): `allow` (OK), `deny` (OVER_LIMIT), `local` (this node's memory store decides) or
//! `error` (the call fails with UNAVAILABLE and Envoy's failure_mode_deny decides).

use std::sync::atomic::{AtomicU64, Ordering};

use std::sync::Arc;

use super::breaker::{Breaker, BreakerState};
use super::lease::LeaseTable;
use super::over_limit::OverLimitCache;
use super::{Check, CheckKind, MemoryStore, Outcome, Store, StoreError};
use crate::limiter::Verdict;
use crate::metrics::Metrics;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum FailureMode {
    Allow,
    Deny,
    /// The default: keeps limiting during an outage, with each node enforcing the limit on its
    /// own traffic.
    #[default]
    Local,
    Error,
}

spelled_enum!(FailureMode, "failure mode", {
    Allow => "allow",
    Deny => "deny",
    Local => "local",
    Error => "error",
});

/// Retry-After for checks denied by the `deny` policy: the backend's state is unknown.
const POLICY_RETRY_US: u64 = 1_000_000;

pub struct Resilient<P> {
    primary: P,
    local: MemoryStore,
    breaker: Breaker,
    default_mode: FailureMode,
    /// Decisions the failure policy took (for metrics and tests).
    policy_decisions: AtomicU64,
    metrics: Option<Arc<Metrics>>,
    over_limit: Option<OverLimitCache>,
    leases: Option<LeaseTable>,
}

impl<P: Store> Resilient<P> {
    pub fn new(
        primary: P,
        local: MemoryStore,
        breaker: Breaker,
        default_mode: FailureMode,
    ) -> Self {
        Self {
            primary,
            local,
            breaker,
            default_mode,
            policy_decisions: AtomicU64::new(0),
            metrics: None,
            over_limit: None,
            leases: None,
        }
    }

    /// Hybrid checks are decided from quota leases (see `lease`).
    pub fn with_leases(mut self, leases: LeaseTable) -> Self {
        self.leases = Some(leases);
        self
    }

    pub fn leases(&self) -> Option<&LeaseTable> {
        self.leases.as_ref()
    }

    /// Counters the backend denied are denied here until they can fit again, with no backend
    /// call (see `over_limit`).
    pub fn with_over_limit_cache(mut self, cache: OverLimitCache) -> Self {
        self.over_limit = Some(cache);
        self
    }

    pub fn over_limit_cache(&self) -> Option<&OverLimitCache> {
        self.over_limit.as_ref()
    }

    /// Backend call latency and errors go to `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    fn observe(&self, took: std::time::Duration, error: Option<&str>) {
        if let Some(m) = &self.metrics {
            m.observe_backend(took, error);
        }
    }

    pub fn primary(&self) -> &P {
        &self.primary
    }

    pub fn breaker_state(&self) -> BreakerState {
        self.breaker.state()
    }

    pub fn policy_decisions(&self) -> u64 {
        self.policy_decisions.load(Ordering::Relaxed)
    }

    fn fallback(&self, checks: &[Check<'_>], cause: StoreError) -> Result<Outcome, StoreError> {
        self.policy_decisions.fetch_add(1, Ordering::Relaxed);
        let mode_of = |c: &Check<'_>| c.on_failure.unwrap_or(self.default_mode);
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
        let local_checks: Vec<Check<'_>> = local.iter().map(|(_, c)| *c).collect();
        let local_outcome = if local_checks.is_empty() {
            Outcome {
                allowed: true,
                verdicts: Vec::new(),
                by_policy: true,
                backend_now_us: Vec::new(),
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
        Ok(Outcome {
            allowed: !denied_by_policy && local_outcome.allowed,
            verdicts,
            by_policy: true,
            backend_now_us: Vec::new(),
        })
    }
}

impl<P: Store> Resilient<P> {
    /// The backend behind the circuit breaker; an error when it cannot answer.
    async fn backend(&self, checks: &[Check<'_>]) -> Result<Outcome, StoreError> {
        if !self.breaker.allow() {
            if let Some(m) = &self.metrics {
                m.observe_backend(std::time::Duration::ZERO, Some("circuit_open"));
            }
            return Err(StoreError::Unavailable(
                "circuit open after repeated backend failures".into(),
            ));
        }
        let started = std::time::Instant::now();
        let result = self.primary.apply(checks).await;
        match &result {
            Ok(_) => {
                self.observe(started.elapsed(), None);
                self.breaker.success();
            }
            Err(e @ StoreError::Unavailable(_)) => {
                let kind = if e.to_string().contains("did not answer within") {
                    "timeout"
                } else {
                    "unavailable"
                };
                self.observe(started.elapsed(), Some(kind));
                self.breaker.failure();
                tracing::debug!(error = %e, "backend call failed; applying the failure policy");
            }
            Err(_) => {}
        }
        result
    }

    /// The backend, or the failure policy when it cannot answer.
    async fn call(&self, checks: &[Check<'_>]) -> Result<Outcome, StoreError> {
        match self.backend(checks).await {
            Err(e @ StoreError::Unavailable(_)) => self.fallback(checks, e),
            other => other,
        }
    }

    /// A batch with hybrid checks: from the leases when they hold enough, else one backend call
    /// that also takes new leases (and gives the old leftovers back).
    async fn apply_hybrid(
        &self,
        checks: &[Check<'_>],
        leases: &LeaseTable,
    ) -> Result<Outcome, StoreError> {
        let now = leases.now();
        // The cache keeps its own clock: denials are learned from when the call was sent.
        let cache_now = self.over_limit.as_ref().map_or(0, OverLimitCache::now);
        if let Some(verdicts) = leases.decide_locally(checks, now) {
            return Ok(Outcome {
                allowed: true,
                verdicts,
                by_policy: false,
                backend_now_us: Vec::new(),
            });
        }
        let asks = leases.plan(checks, now);
        let mut sent: Vec<Check<'_>> = checks
            .iter()
            .zip(&asks)
            .map(|(c, a)| Check {
                hits: c.hits.saturating_add(a.extra),
                ..*c
            })
            .collect();
        // The old leases' leftovers go back in the same call (their limit is the old one).
        sent.extend(checks.iter().zip(&asks).filter_map(|(c, a)| {
            let (hits, limit, until_us) = a.give_back.as_ref()?;
            Some(Check {
                hits: *hits,
                limit,
                kind: CheckKind::Refund,
                until_us: *until_us,
                ..*c
            })
        }));
        let outcome = match self.backend(&sent).await {
            Ok(o) => o,
            Err(e @ StoreError::Unavailable(_)) => return self.fallback(checks, e),
            Err(e) => return Err(e),
        };
        let asked = asks.iter().any(|a| a.extra > 0);
        if outcome.allowed || !asked {
            let verdicts = leases.learn(checks, &asks, &outcome, now);
            let mut backend_now_us = outcome.backend_now_us;
            backend_now_us.truncate(checks.len());
            let outcome = Outcome {
                allowed: outcome.allowed,
                verdicts,
                by_policy: outcome.by_policy,
                backend_now_us,
            };
            self.learn_denials(checks, &outcome, cache_now);
            return Ok(outcome);
        }
        // The leases did not fit: the request alone, exactly. Every refund (the request's own
        // and the old leases') was applied by the first call: now they only look.
        let alone: Vec<Check<'_>> = checks
            .iter()
            .map(|c| match c.kind {
                CheckKind::Refund => Check { hits: 0, ..*c },
                _ => *c,
            })
            .collect();
        let outcome = self.call(&alone).await?;
        let verdicts = leases.learn(checks, &[], &outcome, now);
        let outcome = Outcome {
            verdicts,
            ..outcome
        };
        self.learn_denials(checks, &outcome, cache_now);
        Ok(outcome)
    }

    fn learn_denials(&self, checks: &[Check<'_>], outcome: &Outcome, now: u64) {
        if let Some(cache) = &self.over_limit {
            cache.learn(checks, outcome, now);
        }
    }

    /// Gives back the leftovers of leases that ran out (all of them when the node stops).
    pub async fn return_leases(&self, all: bool) {
        let Some(leases) = &self.leases else {
            return;
        };
        let returned = leases.take_leftovers(all);
        if returned.is_empty() {
            return;
        }
        let checks: Vec<Check<'_>> = returned.iter().map(|r| r.check()).collect();
        if let Err(e) = self.backend(&checks).await {
            // They stay counted until their window ends: under-admission, never more.
            tracing::debug!(error = %e, leases = checks.len(), "could not give leases back");
        }
    }
}

impl<P: Store> Resilient<P> {
    /// A batch the over-limit cache does not deny.
    async fn undenied(&self, checks: &[Check<'_>]) -> Result<Outcome, StoreError> {
        if let Some(leases) = &self.leases
            && checks.iter().any(|c| leases.is_hybrid(c))
        {
            return self.apply_hybrid(checks, leases).await;
        }
        let now = self.over_limit.as_ref().map_or(0, |c| c.now());
        let outcome = self.call(checks).await?;
        self.learn_denials(checks, &outcome, now);
        Ok(outcome)
    }
}

impl<P: Store> Store for Resilient<P> {
    async fn apply(&self, checks: &[Check<'_>]) -> Result<Outcome, StoreError> {
        let Some(cache) = &self.over_limit else {
            return self.undenied(checks).await;
        };
        let now = cache.now();
        let cached: Vec<Option<Verdict>> = checks.iter().map(|c| cache.denial(c, now)).collect();
        if cached.iter().all(Option::is_none) {
            return self.undenied(checks).await;
        }
        // Denied here. The other checks are only looked at (hits 0), so their statuses are
        // true and nothing is consumed; refunds still apply.
        let rest: Vec<usize> = (0..checks.len()).filter(|&i| cached[i].is_none()).collect();
        let looks: Vec<Check<'_>> = rest
            .iter()
            .map(|&i| match checks[i].kind {
                CheckKind::Refund => checks[i],
                _ => Check {
                    hits: 0,
                    ..checks[i]
                },
            })
            .collect();
        let mut verdicts: Vec<Verdict> =
            cached.into_iter().map(Option::unwrap_or_default).collect();
        let mut by_policy = false;
        if !looks.is_empty() {
            let outcome = self.call(&looks).await?;
            cache.learn(&looks, &outcome, now);
            by_policy = outcome.by_policy;
            for (&i, v) in rest.iter().zip(outcome.verdicts) {
                verdicts[i] = v;
            }
        }
        Ok(Outcome {
            allowed: false,
            verdicts,
            by_policy,
            backend_now_us: Vec::new(),
        })
    }

    async fn return_leases(&self, all: bool) {
        Resilient::return_leases(self, all).await;
    }

    fn lease_sweep_every(&self) -> Option<std::time::Duration> {
        // A few times per lease lifetime, so leftovers go back soon after they run out.
        self.leases.as_ref().map(|l| l.options().ttl / 4)
    }

    fn housekeeping(&self) {
        self.local.housekeeping();
        self.primary.housekeeping();
        if let Some(cache) = &self.over_limit {
            cache.sweep();
        }
    }

    fn backend_up(&self) -> bool {
        self.breaker.state() == BreakerState::Closed
    }

    fn serves_without_backend(&self) -> bool {
        self.default_mode != FailureMode::Error
    }

    fn keys_in_memory(&self) -> Option<usize> {
        Some(self.local.len())
    }

    fn lease_hits_held(&self) -> Option<u64> {
        self.leases.as_ref().map(LeaseTable::held)
    }

    fn breaker_state(&self) -> Option<i64> {
        Some(match self.breaker.state() {
            BreakerState::Closed => 0,
            BreakerState::Open => 1,
            BreakerState::HalfOpen => 2,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::limiter::{Algorithm, Limit};
    use std::sync::Arc;
    use std::time::Duration;

    /// A backend that is always down.
    struct Down;

    impl Store for Down {
        async fn apply(&self, _: &[Check<'_>]) -> Result<Outcome, StoreError> {
            Err(StoreError::Unavailable("down".into()))
        }
    }

    fn resilient(mode: FailureMode) -> Resilient<Down> {
        let clock = Arc::new(ManualClock::new(1_000_000_000));
        Resilient::new(
            Down,
            MemoryStore::new(clock.clone(), 100),
            Breaker::new(2, Duration::from_secs(1), clock),
            mode,
        )
    }

    fn check(limit: &Limit, on_failure: Option<FailureMode>) -> Check<'_> {
        Check {
            on_failure,
            ..Check::enforce(b"k", limit, 1)
        }
    }

    #[test]
    fn modes_are_spelled_as_in_the_rules() {
        for mode in [
            FailureMode::Allow,
            FailureMode::Deny,
            FailureMode::Local,
            FailureMode::Error,
        ] {
            assert_eq!(mode.to_string().parse::<FailureMode>(), Ok(mode));
        }
        assert_eq!(
            "allowed".parse::<FailureMode>(),
            Err("unknown failure mode 'allowed' (expected allow, deny, local or error)".into())
        );
    }

    #[tokio::test]
    async fn each_mode_answers_as_documented() {
        let limit = Limit::new(Algorithm::FixedWindow, 2, 60_000_000, None).unwrap();
        let r = resilient(FailureMode::Local);
        for i in 0..5 {
            let out = r.apply(&[check(&limit, None)]).await.unwrap();
            assert_eq!(out.allowed, i < 2, "local limits alone, call {i}");
        }
        assert_eq!(r.policy_decisions(), 5);
        let r = resilient(FailureMode::Allow);
        assert!(r.apply(&[check(&limit, None)]).await.unwrap().allowed);
        let r = resilient(FailureMode::Deny);
        let out = r.apply(&[check(&limit, None)]).await.unwrap();
        assert!(!out.allowed);
        assert_eq!(out.verdicts[0].retry_after_us, POLICY_RETRY_US);
        let r = resilient(FailureMode::Error);
        assert!(r.apply(&[check(&limit, None)]).await.is_err());
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
        let r = resilient(FailureMode::Local);
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
