//! The lease layer: decides hybrid batches from leases, or sends one backend call that takes
//! new leases and gives old leftovers back; and [`GiveBack`], which returns what ran out.

use std::sync::Arc;
use std::time::Duration;

use super::table::{Ask, LeaseTable, Returned};
use crate::store::{Check, CheckKind, DecidedBy, Outcome, Store, StoreError};

/// The layer: hybrid checks are decided from leases when they hold enough, else by one call to
/// the inner store that also takes new leases (and gives the old leftovers back). Strict
/// batches pass straight through. A backend failure is returned as it is: the failure policy
/// outside decides the request's own checks.
pub struct Leases<S> {
    /// Shared with [`GiveBack`], which refunds leftovers through it.
    inner: Arc<S>,
    table: Arc<LeaseTable>,
}

/// The checks of `checks` on the counter of check `i` (same key and limit), `i` excluded.
fn same_counter<'a>(checks: &'a [Check<'_>], i: usize) -> impl Iterator<Item = usize> + 'a {
    let (key, limit) = (checks[i].key, checks[i].limit);
    (0..checks.len()).filter(move |&j| j != i && checks[j].key == key && checks[j].limit == limit)
}

/// The request's refunds of check `i`'s counter.
fn refunds_of<'a>(checks: &'a [Check<'_>], i: usize) -> impl Iterator<Item = usize> + 'a {
    same_counter(checks, i).filter(|&r| checks[r].kind == CheckKind::Refund)
}

/// The hits the request itself gives back to check `i`'s counter (as sent by the caller, before
/// any lease was absorbed into them).
fn own_refunds(original: &[Check<'_>], i: usize) -> u64 {
    refunds_of(original, i).fold(0u64, |sum, r| sum.saturating_add(original[r].hits))
}

impl<S: Store> Leases<S> {
    pub fn new(inner: S, table: LeaseTable) -> Self {
        Self {
            inner: Arc::new(inner),
            table: Arc::new(table),
        }
    }

    /// What gives this layer's leftovers back, for the upkeep.
    pub fn give_back(&self) -> GiveBack<S> {
        GiveBack {
            inner: self.inner.clone(),
            table: self.table.clone(),
        }
    }

    /// Hybrid checks: from the leases when they hold enough; else one backend call that also
    /// takes new leases, and when those do not fit, a second call for the request alone.
    async fn apply_hybrid(&self, checks: &[Check<'_>]) -> Result<Outcome, StoreError> {
        let leases = &self.table;
        let original = checks;
        let absorbed = leases.absorb_into_refunds(original);
        let checks = absorbed.as_deref().unwrap_or(original);
        let now = leases.now();
        if let Some(verdicts) = leases.decide_locally(checks, now) {
            return Ok(Outcome {
                allowed: true,
                verdicts,
                decided_by: DecidedBy::Counters,
                backend_now_us: Vec::new(),
            });
        }
        let asks = leases.plan(checks, now);
        let outcome = self.send_with_leases(original, checks, &asks).await?;
        let asked = asks.iter().any(|a| a.extra > 0);
        if outcome.allowed || !asked {
            return Ok(self.learn_leases(original, checks, &asks, outcome, now));
        }
        leases.learn_refunds(checks, &outcome);
        self.send_alone(original, checks, outcome, now).await
    }

    /// One backend call: each check with its lease's extra hits, and the old leases' leftovers
    /// given back in the same call (under their own, maybe old, limit). `original` is the
    /// request as sent, `checks` it with live leases absorbed into its refunds.
    async fn send_with_leases(
        &self,
        original: &[Check<'_>],
        checks: &[Check<'_>],
        asks: &[Ask],
    ) -> Result<Outcome, StoreError> {
        let mut sent: Vec<Check<'_>> = checks
            .iter()
            .zip(asks)
            .map(|(c, a)| Check {
                hits: c.hits.saturating_add(a.extra),
                ..*c
            })
            .collect();
        // The old leases' leftovers go back in the same call (their limit is the old one).
        let mut given_back = Vec::new();
        for (i, (c, a)) in checks.iter().zip(asks).enumerate() {
            if let Some(leftover) = &a.give_back {
                given_back.push((i, sent.len()));
                sent.push(Check {
                    on_failure: c.on_failure,
                    mode: c.mode,
                    ..leftover.refund(c.key, c.tag)
                });
            }
        }
        let mut outcome = self.inner.apply(&sent).await?;
        // Refunds are applied last: a given-back leftover's verdict is the counter's final
        // state (unless the limit changed: the leftover went back to the old limit), which the
        // request's refunds of that counter report too. Its own check reports that state
        // before the request's refunds, as every store reports a batch.
        for &(i, k) in &given_back {
            if sent[k].limit == checks[i].limit {
                let final_remaining = outcome.verdicts[k].remaining;
                for r in refunds_of(checks, i) {
                    outcome.verdicts[r].remaining = final_remaining;
                }
                outcome.verdicts[i].remaining =
                    final_remaining.saturating_add(own_refunds(original, i));
            }
        }
        Ok(outcome)
    }

    /// The leases fit (or none was asked): the table learns them, and each check reports as a
    /// status counts: this node's held hits as remaining.
    fn learn_leases(
        &self,
        original: &[Check<'_>],
        checks: &[Check<'_>],
        asks: &[Ask],
        outcome: Outcome,
        now: u64,
    ) -> Outcome {
        let leases = &self.table;
        let mut verdicts = leases.learn(checks, asks, &outcome, now);
        // After `learn`: a refund's verdict is the counter's final state, later than the
        // charge's.
        leases.learn_refunds(checks, &outcome);
        // A refund of a counter the request also charges: the lease it absorbed was held,
        // not admitted, so the charge reports without it; the refund reports the final
        // state with the new lease (this node's hits) counted, as every status counts one.
        for r in (0..checks.len()).filter(|&r| checks[r].kind == CheckKind::Refund) {
            let taken = checks[r].hits.saturating_sub(original[r].hits);
            for i in same_counter(checks, r).filter(|&i| checks[i].kind != CheckKind::Refund) {
                verdicts[i].remaining = verdicts[i].remaining.saturating_add(taken);
                if outcome.allowed {
                    verdicts[r].remaining = verdicts[r].remaining.saturating_add(asks[i].extra);
                }
            }
        }
        let mut backend_now_us = outcome.backend_now_us;
        backend_now_us.truncate(checks.len());
        Outcome {
            allowed: outcome.allowed,
            verdicts,
            decided_by: outcome.decided_by,
            backend_now_us,
        }
    }

    /// The leases did not fit: the request alone, exactly. Every refund (the request's own and
    /// the old leases') and every cost limit's charge was applied by the `first` call: now they
    /// only look, and a charge reports what the first call decided.
    async fn send_alone(
        &self,
        original: &[Check<'_>],
        checks: &[Check<'_>],
        first: Outcome,
        now: u64,
    ) -> Result<Outcome, StoreError> {
        let leases = &self.table;
        let alone: Vec<Check<'_>> = checks.iter().map(Check::again).collect();
        let outcome = self.inner.apply(&alone).await?;
        let mut verdicts = leases.learn(checks, &[], &outcome, now);
        for (i, c) in checks.iter().enumerate() {
            if c.kind == CheckKind::Refund {
                continue;
            }
            if c.always_applied() {
                verdicts[i] = first.verdicts[i];
                continue;
            }
            // This call saw the request's own refunds of the counter already applied; a batch
            // reports its checks before its refunds.
            verdicts[i].remaining = verdicts[i]
                .remaining
                .saturating_sub(own_refunds(original, i));
        }
        Ok(Outcome {
            verdicts,
            ..outcome
        })
    }
}

impl<S: Store> Store for Leases<S> {
    async fn apply(&self, checks: &[Check<'_>]) -> Result<Outcome, StoreError> {
        if checks.iter().any(|c| self.table.is_hybrid(c)) {
            return self.apply_hybrid(checks).await;
        }
        let absorbed = self.table.absorb_into_refunds(checks);
        let checks = absorbed.as_deref().unwrap_or(checks);
        let outcome = self.inner.apply(checks).await?;
        self.table.learn_refunds(checks, &outcome);
        Ok(outcome)
    }
}

/// Gives the leftovers of leases that ran out back to the backend; the upkeep runs it a few
/// times per lease lifetime, and once for every lease when the node stops.
pub struct GiveBack<S> {
    inner: Arc<S>,
    table: Arc<LeaseTable>,
}

impl<S> GiveBack<S> {
    /// What this node holds in a lease of the counter `key`.
    pub fn held_for(&self, key: &[u8]) -> Option<u64> {
        self.table.held_for(key)
    }
}

impl<S: Store> GiveBack<S> {
    /// Gives back the leftovers of leases that ran out (all of them when the node stops).
    pub async fn run(&self, all: bool) {
        let returned = self.table.take_leftovers(all);
        if returned.is_empty() {
            return;
        }
        let checks: Vec<Check<'_>> = returned.iter().map(Returned::check).collect();
        if let Err(e) = self.inner.apply(&checks).await {
            // They stay counted until their window ends: under-admission, never more.
            tracing::debug!(error = %e, leases = checks.len(), "could not give leases back");
        }
    }

    /// How often [`GiveBack::run`] should run: a few times per lease lifetime, so leftovers go
    /// back soon after they run out.
    pub fn every(&self) -> Duration {
        self.table.options().ttl / 4
    }

    /// Hits held in leases now.
    pub fn held(&self) -> u64 {
        self.table.held()
    }
}
