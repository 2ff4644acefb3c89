//! The failure policy layer: when the backend cannot answer (`StoreError::is_backend_down`:
//! a timeout, an error, an open circuit), each check is decided by its rule's `failure_mode`
//! (or the default): `allow` (OK), `deny` (OVER_LIMIT), `local` (this node's own memory store
//! decides, so limits hold per node during an outage) or `error` (the call fails with
//! UNAVAILABLE and Envoy's `failure_mode_deny` decides).
//!
//! It decides the request's own checks, whatever the layers inside it were doing (a lease, a
//! refund): it sits outside them.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{Check, CheckKind, FailureMode, MemoryStore, Outcome, Store, StoreError, StoreStatus};
use crate::limiter::Verdict;

/// Retry-After for checks denied by the `deny` policy: the backend's state is unknown.
pub const POLICY_RETRY_US: u64 = 1_000_000;

pub struct Fallback<S> {
    inner: S,
    local: MemoryStore,
    default_mode: FailureMode,
    decisions: AtomicU64,
}

impl<S: Store> Fallback<S> {
    pub fn new(inner: S, local: MemoryStore, default_mode: FailureMode) -> Self {
        Self {
            inner,
            local,
            default_mode,
            decisions: AtomicU64::new(0),
        }
    }

    fn decide(&self, checks: &[Check<'_>], cause: StoreError) -> Result<Outcome, StoreError> {
        self.decisions.fetch_add(1, Ordering::Relaxed);
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
        Ok(Outcome {
            allowed: !denied_by_policy && local_outcome.allowed,
            verdicts,
            by_policy: true,
            backend_now_us: Vec::new(),
        })
    }
}

impl<S: Store> Store for Fallback<S> {
    async fn apply(&self, checks: &[Check<'_>]) -> Result<Outcome, StoreError> {
        match self.inner.apply(checks).await {
            Err(e) if e.is_backend_down() => self.decide(checks, e),
            other => other,
        }
    }

    fn housekeeping(&self) {
        self.local.housekeeping();
        self.inner.housekeeping();
    }

    forward_upkeep!(flush, flush_every);

    fn status(&self, status: &mut StoreStatus) {
        self.inner.status(status);
        status.keys_in_memory = Some(self.local.len());
        status.policy_decisions = Some(self.decisions.load(Ordering::Relaxed));
        status.serves_without_backend = self.default_mode != FailureMode::Error;
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
            Err(StoreError::Timeout(Duration::from_millis(10)))
        }
    }

    fn fallback(mode: FailureMode) -> Fallback<Down> {
        let clock = Arc::new(ManualClock::new(1_000_000_000));
        Fallback::new(Down, MemoryStore::new(clock, 100), mode)
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
            assert!(out.by_policy);
        }
        assert_eq!(r.report().policy_decisions, Some(5));
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
        assert!(!r.report().serves_without_backend);
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
